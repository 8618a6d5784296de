#!/usr/bin/env bash
# Real-guest proof and benchmark of the vsock device's vhost-user face under QEMU TCG.
#
#   devices/benches/bench-vsock.sh proof            guest <-> in-process listener: ping, 16 MiB
#                                                   each way with FNV checksums, host-initiated
#                                                   echo; exits non-zero on any failure
#   devices/benches/bench-vsock.sh bench [--size B] [--pings N] [--only NAME] [--rounds R]
#                                                   throughput and connect+ping latency of
#                                                   ours (in-process listener), ours (--map to
#                                                   a Unix socket) and vhost-device-vsock, one
#                                                   VM at a time, same guest, printed as a table;
#                                                   with --rounds the backends alternate R times
#                                                   and the table adds the median of each column
#
# Needs qemu-system-x86_64, gcc with static glibc, busybox-static, cpio, the cached Debian
# kernel (scripts/fetch-kernel.sh) and, for bench, `cargo install vhost-device-vsock`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
mode="${1:-}"
shift || true
size=$((64 * 1024 * 1024))
pings=50
only=""
rounds=1
while (($#)); do
	case "$1" in
	--size) size="$2"; shift 2 ;;
	--pings) pings="$2"; shift 2 ;;
	--only) only="$2"; shift 2 ;;
	--rounds) rounds="$2"; shift 2 ;;
	*) echo "unknown argument $1" >&2; exit 2 ;;
	esac
done
case "$mode" in
proof | bench) ;;
*) sed -n '2,15p' "$0" >&2; exit 2 ;;
esac

port=51234
work="$(mktemp -d "${TMPDIR:-/tmp}/vsock-bench.XXXXXX")"
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT

echo "building..." >&2
(cd "$repo" && cargo build -q --release -p devices --example vsock-vhost-user)
bin="$repo/target/release/examples/vsock-vhost-user"
[[ -x "$bin" ]] || bin="$(cd "$repo" && cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/release/examples/vsock-vhost-user"
gcc -O2 -static -o "$work/vsockt" "$here/guest/vsockt.c" -lpthread
eval "$("$repo/scripts/fetch-kernel.sh" --quiet)"
"$repo/scripts/mkinitramfs.sh" --output "$work/initrd" --init "$here/guest/init" \
	--module virtio_pci,vmw_vsock_virtio_transport --add "$work/vsockt:/bin/vsockt" 2>/dev/null

wait_socket() {
	for _ in $(seq 1 200); do
		[[ -S "$1" ]] && return 0
		sleep 0.05
	done
	echo "socket $1 never appeared" >&2
	return 1
}

# run_vm SOCKET PLAN LOG: boots the guest against the vhost-user socket, serial to LOG.
run_vm() {
	timeout 600 qemu-system-x86_64 -accel tcg -M pc -smp 1 -m 512M -nodefaults -nographic \
		-no-reboot -serial stdio \
		-object memory-backend-memfd,id=mem,size=512M,share=on -numa node,memdev=mem \
		-chardev socket,id=vs,path="$1" -device vhost-user-vsock-pci,chardev=vs \
		-kernel "$VMLINUZ" -initrd "$work/initrd" \
		-append "console=ttyS0 quiet panic=-1 vsockt.plan=$2 vsockt.port=$port vsockt.size=$size vsockt.pings=$pings" \
		</dev/null >"$3" 2>&1 || true
}

# start_backend NAME: starts the backend (in this shell, so its pid is kept) and sets $sock to
# its vhost-user socket path.
start_backend() {
	case "$1" in
	ours-inproc)
		"$bin" serve --socket "$work/ours.sock" --bench-port "$port" >/dev/null 2>"$work/$1.err" &
		pids+=($!)
		sock="$work/ours.sock"
		;;
	ours-map)
		"$bin" bench-server --unix "$work/map.bench" >/dev/null 2>"$work/$1.srv.err" &
		pids+=($!)
		wait_socket "$work/map.bench"
		"$bin" serve --socket "$work/ours.sock" --map "$port=unix:$work/map.bench" \
			>/dev/null 2>"$work/$1.err" &
		pids+=($!)
		sock="$work/ours.sock"
		;;
	vhost-device-vsock)
		command -v vhost-device-vsock >/dev/null || { echo "cargo install vhost-device-vsock" >&2; return 1; }
		"$bin" bench-server --unix "$work/vdv.vsock_$port" >/dev/null 2>"$work/$1.srv.err" &
		pids+=($!)
		wait_socket "$work/vdv.vsock_$port"
		vhost-device-vsock --vm "guest-cid=3,socket=$work/vdv.sock,uds-path=$work/vdv.vsock" \
			>/dev/null 2>"$work/$1.err" &
		pids+=($!)
		sock="$work/vdv.sock"
		;;
	esac
}

stop_backends() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	pids=()
	rm -f "$work"/*.sock "$work"/*.bench "$work"/vdv.vsock*
}

# one NAME PLAN: runs one VM against backend NAME; leaves RESULT lines in $work/NAME.log.
one() {
	sock=""
	start_backend "$1"
	wait_socket "$sock"
	local t0=$SECONDS
	run_vm "$sock" "$2" "$work/$1.log"
	echo "$1: VM ran $((SECONDS - t0)) s" >&2
	stop_backends
	if ! grep -q "PLAN DONE" "$work/$1.log"; then
		echo "$1: guest did not finish; serial log:" >&2
		tail -n 30 "$work/$1.log" >&2
		cat "$work/$1.err" >&2 2>/dev/null || true
		return 1
	fi
}

field() { # LOG KIND KEY [NTH]: value of KEY= on the NTH (default 1) "RESULT KIND" line
	grep "RESULT $2 " "$1" | sed -n "${4:-1}p" | sed -n "s/.*$3=\([^ ]*\).*/\1/p"
}

if [[ "$mode" == proof ]]; then
	size=$((16 * 1024 * 1024))
	one ours-inproc proof
	grep -E "RESULT|PLAN" "$work/ours-inproc.log"
	if grep -q "RESULT FAIL\|check=FAIL" "$work/ours-inproc.log" ||
		[[ "$(grep -c 'check=ok' "$work/ours-inproc.log")" != 3 ]]; then
		echo "proof FAILED" >&2
		exit 1
	fi
	echo "proof OK: connect/accept, ${size} bytes each way with matching checksums, host-initiated echo"
	exit 0
fi

names=(ours-inproc ours-map vhost-device-vsock)
[[ -n "$only" ]] && names=("$only")
for r in $(seq 1 "$rounds"); do
	for n in "${names[@]}"; do
		one "$n" bench
		mv "$work/$n.log" "$work/$n.$r.log"
	done
done
median() { sort -n | awk '{v[NR]=$1} END {if (NR) print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
row() { # LABEL LOGS...: one table row from the RESULT lines of LOGS (median over them)
	local label="$1"; shift
	local g2h h2g ping
	g2h="$(for l in "$@"; do field "$l" g2h MBps 1; field "$l" g2h MBps 2; done | median)"
	h2g="$(for l in "$@"; do field "$l" h2g MBps 1; field "$l" h2g MBps 2; done | median)"
	ping="$(for l in "$@"; do field "$l" ping avg_us; done | median)"
	printf '%-26s %10s %10s %14s\n' "$label" "$g2h" "$h2g" "$ping"
}
printf '\n%-26s %10s %10s %14s\n' backend "g2h MB/s" "h2g MB/s" "connect+ping us"
for n in "${names[@]}"; do
	for r in $(seq 1 "$rounds"); do
		row "$n (round $r)" "$work/$n.$r.log"
	done
done
if ((rounds > 1)); then
	for n in "${names[@]}"; do
		row "$n (median)" "$work/$n".*.log
	done
fi
printf '(%s bytes per transfer, 2 transfers per direction per round, %s connect+pings per round;\n' "$size" "$pings"
printf ' QEMU TCG, -M pc, 1 vCPU, guest-side timing)\n'
