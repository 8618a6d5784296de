#!/usr/bin/env bash
# Inside the nested-KVM harness's L1 guest: record L1 KVM's view of every exit of the L2 guests a
# command runs (kvm_exit with reason and guest RIP, PIO, MMIO, MSR, CPUID, nested page faults,
# exits to the VMM), for profiling a boot. Run it through nested-run.sh.
set -euo pipefail

usage() {
	cat <<USAGE
Usage: scripts/nested-run.sh -c 'scripts/l1-kvm-trace.sh OUT_DIR COMMAND [ARGS...]'

Inside L1 only (it changes L1's tracing settings): enables the kvm tracepoints kvm_exit,
kvm_userspace_exit, kvm_pio, kvm_mmio, kvm_msr, kvm_cpuid, kvm_hypercall and kvm_page_fault
(64 MiB of buffer per CPU, global clock), runs COMMAND, then writes OUT_DIR/trace.txt (the
text trace) and OUT_DIR/trace-stats.txt (per-CPU buffer statistics: "overrun" > 0 means
events were lost). Exits with COMMAND's status.

Reading it: each L2 vCPU is a thread named vcpuN of the VMM (the helper for --backend kvm,
QEMU for --backend qemu); "reason interrupt" exits are L1's own interrupts (its timer
every ~4 ms) landing while L2 ran, so their RIPs sample where the guest spent its time.
Guest kernel addresses resolve with /proc/kallsyms of the same kernel booted with nokaslr
(a PVH boot of the vmlinux is not randomised). Example:

  scripts/nested-run.sh -c 'scripts/l1-kvm-trace.sh /tmp/tr env TMPDIR=/dev/shm \\
      target/release/cowork-helper bench boot --backend kvm -n 1 --json > /tmp/tr/bench.json'
USAGE
}

case "${1:-}" in
-h | --help)
	usage
	exit 0
	;;
esac
if [ $# -lt 2 ]; then
	usage >&2
	exit 2
fi
out=$1
shift
tracing=/sys/kernel/tracing
events="kvm_exit kvm_userspace_exit kvm_pio kvm_mmio kvm_msr kvm_cpuid kvm_hypercall kvm_page_fault"

mkdir -p "$out"
[ -d "$tracing/events" ] || mount -t tracefs nodev "$tracing"
echo 0 >"$tracing/tracing_on"
echo >"$tracing/trace"
echo 65536 >"$tracing/buffer_size_kb"
echo global >"$tracing/trace_clock"
for e in $events; do
	if ! echo 1 >"$tracing/events/kvm/$e/enable" 2>/dev/null; then
		echo "l1-kvm-trace.sh: this kernel has no kvm:$e tracepoint; not recorded" >&2
	fi
done
echo 1 >"$tracing/tracing_on"
status=0
"$@" || status=$?
echo 0 >"$tracing/tracing_on"
for e in $events; do
	echo 0 >"$tracing/events/kvm/$e/enable" 2>/dev/null || true
done
cat "$tracing/trace" >"$out/trace.txt"
cat "$tracing"/per_cpu/cpu*/stats >"$out/trace-stats.txt"
echo "l1-kvm-trace.sh: $(grep -c ': kvm_exit:' "$out/trace.txt" || true) exits recorded in $out/trace.txt" >&2
exit "$status"
