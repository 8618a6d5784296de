# smp.s - test guest for multi-vCPU start, entered through the 64-bit Linux
# boot protocol on the boot vCPU. The other vCPUs wait in KVM's
# wait-for-SIPI state (in-kernel LAPIC).
#
#  1. reads the vCPU count from CPUID.0BH.1:EBX[15:0] (set by the VMM's
#     CPUID normalizer) and its own APIC ID from CPUID.01H:EBX[31:24],
#  2. copies a real-mode trampoline to 0x10000 and clears a 256-bit APIC ID
#     bitmap at 0x10100 and a counter at 0x10200,
#  3. sends INIT then SIPI (vector 0x10 -> CS:IP 1000:0000) to all other
#     CPUs through the xAPIC ICR at 0xfee00300,
#  4. each AP runs the trampoline in real mode: CPUID.01H gives its APIC ID
#     (again from the VMM's per-vCPU CPUID), it sets that bit in the bitmap,
#     increments the counter, and halts,
#  5. the BSP waits (bounded) until count + 1 == expected, then prints
#       smp expected <n> online <m> bsp <id> map <bits 0-63> <64-127> <128-191> <192-255>
#     and resets through the i8042 (or prints "smp timeout" first).

    .code64
    .section .text.entry, "ax"
    .globl _start
_start:
    mov $1, %al
    call boot_mark
    mov $0xb, %eax
    mov $1, %ecx
    cpuid
    movzwl %bx, %r12d               # expected vCPUs
    mov $1, %eax
    cpuid
    shr $24, %ebx
    mov %rbx, %r13                  # BSP APIC ID

    lea ap_tramp(%rip), %rsi
    mov $0x10000, %rdi
    mov $(ap_tramp_end - ap_tramp), %ecx
    rep movsb
    mov $0x10100, %rdi
    xor %eax, %eax
    mov $0x104, %ecx
    rep stosb
    bts %r13, 0x10100               # BSP's own bit

    mov $0xfee00000, %rbx
    orl $0x100, 0xf0(%rbx)          # SVR: APIC software enable
    movl $0, 0x310(%rbx)            # ICR high: destination (unused: shorthand)
    movl $0x000c4500, 0x300(%rbx)   # INIT, level assert, all excluding self
    movl $0x000c4610, 0x300(%rbx)   # SIPI vector 0x10, all excluding self

    mov $400000000, %rcx
1:  movzwl 0x10200, %eax
    inc %eax
    cmp %r12d, %eax
    jae 2f
    pause
    dec %rcx
    jnz 1b
    lea msg_timeout(%rip), %rsi
    call puts
2:
    lea msg_expected(%rip), %rsi
    call puts
    mov %r12, %rdi
    call puthex64
    lea msg_online(%rip), %rsi
    call puts
    movzwl 0x10200, %edi
    inc %edi
    call puthex64
    lea msg_bsp(%rip), %rsi
    call puts
    mov %r13, %rdi
    call puthex64
    lea msg_map(%rip), %rsi
    call puts
    mov 0x10100, %rdi
    call puthex64
    call space
    mov 0x10108, %rdi
    call puthex64
    call space
    mov 0x10110, %rdi
    call puthex64
    call space
    mov 0x10118, %rdi
    call puthex64
    call newline
    mov $2, %al
    call boot_mark
    jmp reset

# Real-mode AP trampoline, copied to 0x10000 (position independent).
    .code16
ap_tramp:
    cli
    mov $0x1000, %ax
    mov %ax, %ds                    # ds:0 = 0x10000
    mov $1, %eax
    cpuid
    shr $24, %ebx
    lock btsl %ebx, 0x100           # bitmap at 0x10100
    lock incw 0x200                 # counter at 0x10200
1:  hlt
    jmp 1b
ap_tramp_end:
    .code64

    .include "serial64.inc"

    .section .rodata
msg_expected: .asciz "smp expected "
msg_online:   .asciz " online "
msg_bsp:      .asciz " bsp "
msg_map:      .asciz " map "
msg_timeout:  .asciz "smp timeout\n"
