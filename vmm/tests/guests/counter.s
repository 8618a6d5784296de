# counter.s - snapshot/restore test guest, entered through the 64-bit Linux
# boot protocol (long mode, identity-mapped low 4 GiB, %rsi = zero page,
# interrupts off, stack set by the VMM).
#
# It counts forever: a 64-bit counter in its own data (guest memory)
# is incremented, printed on COM1 as "count 0x<16 hex digits>\n", then the
# guest spins a little. A restored copy continues with the next number,
# so the serial output of the original up to its pause followed by that of
# a restored VM is one unbroken sequence (a line cut by the pause goes on
# in the restored VM's output).
#
# Mode from the FIRST CHARACTER of the kernel command line:
#   c  count
#   f  first fill FILL_START..FILL_END (64 MiB at 32 MiB; the guest needs
#      96 MiB of RAM) with a non-zero pattern, print "filled\n", then count
#      (a snapshot then holds 64 MiB of data the counting loop never touches
#      again: what a restored VM maps without copying)

    .code64
    .section .text.entry, "ax"
    .globl _start
_start:
    mov 0x228(%rsi), %r14d          # hdr.cmd_line_ptr
    movzbl (%r14), %ebx             # mode character
    cmp $'f', %bl
    jne count

    .equ FILL_START, 0x2000000      # 32 MiB: above the image and tables
    .equ FILL_END, 0x6000000        # 96 MiB
    mov $FILL_START, %rdi
    mov $((FILL_END - FILL_START) / 8), %rcx
    mov $0xa5a5a5a5a5a5a5a5, %rax
    cld
    rep stosq
    lea msg_filled(%rip), %rsi
    call puts

count:
    .equ SPIN, 20000                # iterations of a plain loop (PAUSE may
                                    # exit to the hypervisor: not used)
1:  incq counter(%rip)
    lea msg_count(%rip), %rsi
    call puts
    mov counter(%rip), %rdi
    call puthex64
    call newline
    mov $SPIN, %ecx
2:  dec %ecx
    jnz 2b
    jmp 1b

    .include "serial64.inc"

    .section .rodata
msg_filled: .asciz "filled\n"
msg_count:  .asciz "count "

    .section .data
    .balign 8
counter:    .quad 0
