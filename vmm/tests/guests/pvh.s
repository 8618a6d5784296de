# pvh.s - test guest entered through the PVH boot protocol: the ELF carries a
# XEN_ELFNOTE_PHYS32_ENTRY note, so the VMM starts it in 32-bit protected
# mode, paging off, %ebx = hvm_start_info.
#
# It writes boot mark 1, prints on COM1
#   hello from pvh
#   pvh magic <hvm_start_info.magic>
#   e820 count <memmap_entries>
#   e820 <addr> <size> <type>       (each hvm_memmap_table_entry)
#   cmdline <text at cmdline_paddr>
#   rsdp <rsdp_paddr>
# then "done", boot mark 2, and resets through the i8042.
# Only the low 32 bits of the 64-bit paddr fields are followed (the VMM puts
# everything below 1 MiB).

    .section .note.Xen, "a", @note
    .p2align 2
    .long 4                 # namesz: "Xen\0"
    .long 4                 # descsz
    .long 18                # XEN_ELFNOTE_PHYS32_ENTRY
    .asciz "Xen"
    .long pvh_start

    .code32
    .section .text.entry, "ax"
    .globl _start
_start:
pvh_start:
    mov %ebx, %edi                  # hvm_start_info
    mov $1, %al
    call boot_mark
    mov $msg_hello, %esi
    call puts
    mov $msg_magic, %esi
    call puts
    mov 0(%edi), %eax
    call puthex32
    call newline

    mov 48(%edi), %ebp              # memmap_entries
    mov 40(%edi), %ebx              # memmap_paddr (low half)
    mov $msg_count, %esi
    call puts
    mov %ebp, %eax
    call puthex32
    call newline
1:  test %ebp, %ebp
    jz 2f
    mov $msg_e820, %esi
    call puts
    mov 4(%ebx), %eax               # addr high
    call puthex32
    mov 0(%ebx), %eax               # addr low
    call puthex32_nox
    call space
    mov 12(%ebx), %eax              # size high
    call puthex32
    mov 8(%ebx), %eax               # size low
    call puthex32_nox
    call space
    mov 16(%ebx), %eax              # type
    call puthex32
    call newline
    add $24, %ebx
    dec %ebp
    jmp 1b
2:
    mov $msg_cmdline, %esi
    call puts
    mov 24(%edi), %esi              # cmdline_paddr (low half)
    call puts
    call newline
    mov $msg_rsdp, %esi
    call puts
    mov 32(%edi), %eax
    call puthex32
    call newline
    mov $msg_done, %esi
    call puts
    mov $2, %al
    call boot_mark
    mov $0xfe, %al
    out %al, $0x64
3:  hlt
    jmp 3b

# putc: %al to COM1. Clobbers %edx.
putc:
    mov $0x3f8, %dx
    out %al, %dx
    ret
# puts: NUL-terminated string at %esi. Clobbers %eax, %edx, %esi.
puts:
1:  lodsb
    test %al, %al
    jz 2f
    call putc
    jmp 1b
2:  ret
# puthex32: "0x" + 8 hex digits of %eax; puthex32_nox: digits only.
# Clobber %eax, %ecx, %edx.
puthex32:
    push %eax
    mov $'0', %al
    call putc
    mov $'x', %al
    call putc
    pop %eax
puthex32_nox:
    push %ebx
    mov %eax, %ebx
    mov $8, %ecx
1:  rol $4, %ebx
    mov %ebx, %eax
    and $0xf, %eax
    cmp $10, %al
    jb 2f
    add $('a' - '0' - 10), %al
2:  add $'0', %al
    call putc
    dec %ecx
    jnz 1b
    pop %ebx
    ret
space:
    mov $' ', %al
    jmp putc
newline:
    mov $'\n', %al
    jmp putc
boot_mark:
    mov $0x402, %dx
    out %al, %dx
    ret

    .section .rodata
msg_hello:   .asciz "hello from pvh\n"
msg_magic:   .asciz "pvh magic "
msg_count:   .asciz "e820 count "
msg_e820:    .asciz "e820 "
msg_cmdline: .asciz "cmdline "
msg_rsdp:    .asciz "rsdp "
msg_done:    .asciz "done\n"
