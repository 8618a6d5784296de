# linux64.s - test guest entered through the 64-bit Linux boot protocol
# (long mode, identity-mapped low 4 GiB, %rsi = boot_params "zero page",
# interrupts off, stack set by the VMM).
#
# It writes boot mark 1 to the boot-timing port, then picks a mode from the
# FIRST CHARACTER of the kernel command line (boot_params.hdr.cmd_line_ptr):
#   q  quiet: reset at once (benchmark guest)
#   t  touch: write one byte in every 4 KiB page from TOUCH_START to
#      TOUCH_END (256 MiB; the guest needs 288 MiB of RAM), then reset
#      (memory-backing benchmark: one nested page fault per host page)
#   s  print the report, then "spinning", then loop forever (host stop test)
#   h  print the report, then "halting", then cli+hlt forever (host stop test)
#   p  print the report, then power off via the ACPI sleep control register
#   u  print the report, then ud2 with no IDT: triple fault
#   *  print the report, "done", boot mark 2, reset through the i8042
# The report, one item per line on COM1:
#   hello from linux64
#   e820 count 0x...
#   e820 <addr> <size> <type>        (each boot_params.e820_table entry)
#   cmdline <text>
#   cpuid1 ebx=<> ecx=<>             (leaf 1: APIC ID, hypervisor bit)
#   cpuid7 ebx=<>                    (leaf 7.0 EBX: AVX2 is bit 5)

    .code64
    .section .text.entry, "ax"
    .globl _start
_start:
    mov %rsi, %r15                  # zero page
    mov $1, %al
    call boot_mark
    mov 0x228(%r15), %r14d          # hdr.cmd_line_ptr
    movzbl (%r14), %ebx             # mode character
    cmp $'q', %bl
    je reset
    cmp $'t', %bl
    je touch
    mov %ebx, %ebp                  # keep the mode in %ebp

    lea msg_hello(%rip), %rsi
    call puts

    movzbl 0x1e8(%r15), %r12d       # e820_entries
    lea 0x2d0(%r15), %r13           # e820_table (20-byte entries)
    lea msg_count(%rip), %rsi
    call puts
    mov %r12, %rdi
    call puthex64
    call newline
e820_loop:
    test %r12d, %r12d
    jz e820_done
    lea msg_e820(%rip), %rsi
    call puts
    mov (%r13), %rdi
    call puthex64
    call space
    mov 8(%r13), %rdi
    call puthex64
    call space
    mov 16(%r13), %edi
    call puthex64
    call newline
    add $20, %r13
    dec %r12d
    jmp e820_loop
e820_done:
    lea msg_cmdline(%rip), %rsi
    call puts
    mov %r14, %rsi
    call puts
    call newline

    mov $1, %eax
    cpuid
    mov %rbx, %r12
    mov %rcx, %r13
    lea msg_cpuid1(%rip), %rsi
    call puts
    mov %r12, %rdi
    call puthex64
    lea msg_ecx(%rip), %rsi
    call puts
    mov %r13, %rdi
    call puthex64
    call newline

    mov $7, %eax
    xor %ecx, %ecx
    cpuid
    mov %rbx, %r12
    lea msg_cpuid7(%rip), %rsi
    call puts
    mov %r12, %rdi
    call puthex64
    call newline

    cmp $'s', %bpl
    je spin
    cmp $'h', %bpl
    je halt
    cmp $'p', %bpl
    je poweroff
    cmp $'u', %bpl
    je triple

    lea msg_done(%rip), %rsi
    call puts
    mov $2, %al
    call boot_mark
    jmp reset

spin:
    lea msg_spin(%rip), %rsi
    call puts
1:  jmp 1b

halt:
    lea msg_halt(%rip), %rsi
    call puts
    cli
1:  hlt
    jmp 1b

poweroff:
    # SLP_EN (bit 5) | SLP_TYP 5 (bits 4:2) to the sleep control register.
    mov $0x600, %dx
    mov $((5 << 2) | (1 << 5)), %al
    out %al, %dx
1:  hlt
    jmp 1b

triple:
    ud2

# touch: one write per 4 KiB page of [TOUCH_START, TOUCH_END), then reset.
    .equ TOUCH_START, 0x2000000     # 32 MiB: above this guest's image and tables
    .equ TOUCH_END, 0x12000000      # 288 MiB
touch:
    mov $TOUCH_START, %rax
    mov $TOUCH_END, %rcx
1:
    movb $1, (%rax)
    add $4096, %rax
    cmp %rcx, %rax
    jb 1b
    jmp reset

    .include "serial64.inc"

    .section .rodata
msg_hello:   .asciz "hello from linux64\n"
msg_count:   .asciz "e820 count "
msg_e820:    .asciz "e820 "
msg_cmdline: .asciz "cmdline "
msg_cpuid1:  .asciz "cpuid1 ebx="
msg_ecx:     .asciz " ecx="
msg_cpuid7:  .asciz "cpuid7 ebx="
msg_done:    .asciz "done\n"
msg_spin:    .asciz "spinning\n"
msg_halt:    .asciz "halting\n"
