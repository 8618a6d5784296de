#!/usr/bin/env bash
# virtio-fs benchmark under QEMU TCG: our vhost-user-fs (the SessionFs served by
# devices::vhost_user::fs, through a rwd grant) against virtiofsd, same guest kernel, same
# initramfs, same QEMU command line, one VM at a time.
#
#   devices/benches/bench-fs.sh [--mib N] [--files N] [--rounds R] [--only NAME] [--xattr]
#                               [--share-fs ext4|tmpfs|dir]
#
# Backends: ours, virtiofsd-c (Debian's /usr/lib/qemu/virtiofsd), virtiofsd-rs (`virtiofsd` in
# PATH or ~/.cargo/bin, from `cargo install virtiofsd`); a backend whose binary is missing is
# reported and skipped. All run with their defaults: cache=auto, no extended attributes
# (--xattr turns xattrs on in all three). Each VM gets a fresh shared filesystem (--share-fs):
# ext4 on a new loop-mounted image (default as root: the host filesystem's own state, e.g.
# ext4 skipping recently deleted inodes, would otherwise carry from one run into the next),
# tmpfs, or a plain directory under $TMPDIR (default when not root). The guest binds the
# shared directory at /b, as the agent binds a grant at /sessions/NAME/mnt/MOUNT, so path
# walks are the same for every backend. The guest program (guest/fsbench.c) writes a
# file of --mib MiB (default 256) sequentially in 1 MiB writes (timed alone, and again with the
# final fsync, which adds the host disk), drops the guest page cache and reads it back, then
# creates (100 bytes each), stats (after dropping caches) and unlinks --files files (default
# 5000). With --rounds R the backends alternate R times and the table adds the median of each
# column and ours / each other backend (ratio of medians). Our server's stderr line with the
# request count per FUSE opcode is printed after each of its runs.
#
# Needs qemu-system-x86_64, gcc with static glibc, busybox-static, cpio and the cached Debian
# kernel (scripts/fetch-kernel.sh).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
mib=256
files=5000
rounds=1
only=""
xattr=0
share_fs=""
while (($#)); do
	case "$1" in
	--mib) mib="$2"; shift 2 ;;
	--files) files="$2"; shift 2 ;;
	--rounds) rounds="$2"; shift 2 ;;
	--only) only="$2"; shift 2 ;;
	--xattr) xattr=1; shift ;;
	--share-fs) share_fs="$2"; shift 2 ;;
	-h | --help) sed -n '2,28p' "$0"; exit 0 ;;
	*) echo "unknown argument $1" >&2; exit 2 ;;
	esac
done

if [[ -z "$share_fs" ]]; then
	if ((EUID == 0)) && command -v mkfs.ext4 >/dev/null; then share_fs=ext4; else share_fs=dir; fi
fi
case "$share_fs" in
ext4 | tmpfs) ((EUID == 0)) || { echo "--share-fs $share_fs needs root (mount)" >&2; exit 2; } ;;
dir) ;;
*) echo "--share-fs must be ext4, tmpfs or dir" >&2; exit 2 ;;
esac

tag=benchfs
work="$(mktemp -d "${TMPDIR:-/tmp}/fs-bench.XXXXXX")"
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	for m in "$work"/share-*; do mountpoint -q "$m" 2>/dev/null && umount "$m"; done
	rm -rf "$work"
}
trap cleanup EXIT

# make_share DIR: a fresh, empty filesystem (or directory) at DIR for one VM.
make_share() {
	mkdir -p "$1"
	case "$share_fs" in
	ext4)
		rm -f "$work/share.img"
		truncate -s 2G "$work/share.img"
		# Inode tables and journal initialized now, not by a background thread during the run.
		mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$work/share.img"
		mount -o loop "$work/share.img" "$1"
		;;
	tmpfs) mount -t tmpfs -o size=2g,mode=0755 bench "$1" ;;
	dir) ;;
	esac
}

drop_share() {
	if mountpoint -q "$1"; then umount "$1"; fi
	rm -rf "$1"
	rm -f "$work/share.img"
}

echo "building..." >&2
(cd "$repo" && cargo build -q --release -p devices --example fs-vhost-user)
target_dir="$(cd "$repo" && cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
ours_bin="$target_dir/release/examples/fs-vhost-user"
gcc -O2 -static -o "$work/fsbench" "$here/guest/fsbench.c"
eval "$("$repo/scripts/fetch-kernel.sh" --quiet)"
"$repo/scripts/mkinitramfs.sh" --output "$work/initrd" --init "$here/guest/fs-init" \
	--module virtio_pci,virtiofs --add "$work/fsbench:/bin/fsbench" 2>/dev/null

rs_bin="$(command -v virtiofsd || true)"
[[ -z "$rs_bin" && -x "$HOME/.cargo/bin/virtiofsd" ]] && rs_bin="$HOME/.cargo/bin/virtiofsd"
c_bin=/usr/lib/qemu/virtiofsd

wait_socket() {
	for _ in $(seq 1 200); do
		[[ -S "$1" ]] && return 0
		sleep 0.05
	done
	echo "socket $1 never appeared" >&2
	return 1
}

# run_vm SOCKET GUEST_DIR LOG: boots the guest against the vhost-user-fs socket, serial to LOG.
run_vm() {
	timeout 900 qemu-system-x86_64 -accel tcg -M pc -smp 1 -m 1024M -nodefaults -nographic \
		-no-reboot -serial stdio \
		-object memory-backend-memfd,id=mem,size=1024M,share=on -numa node,memdev=mem \
		-chardev socket,id=fs0,path="$1" \
		-device vhost-user-fs-pci,chardev=fs0,tag=$tag,queue-size=1024 \
		-kernel "$VMLINUZ" -initrd "$work/initrd" \
		-append "console=ttyS0 quiet panic=-1 fsb.tag=$tag fsb.dir=$2 fsb.mib=$mib fsb.files=$files" \
		</dev/null >"$3" 2>&1 || true
}

# start_backend NAME SHARE: starts backend NAME sharing directory SHARE; sets $sock and
# $guest_dir (where SHARE appears below the guest's mount point).
start_backend() {
	sock="$work/$1.sock"
	case "$1" in
	ours)
		local x=()
		((xattr)) && x=(--xattr)
		"$ours_bin" --socket "$sock" "${x[@]}" --grant "bench:data:$2:rwd" 2>"$work/$1.err" &
		guest_dir=/bench/data
		;;
	virtiofsd-c)
		local x=(-o no_xattr)
		((xattr)) && x=(-o xattr)
		"$c_bin" --socket-path="$sock" -o source="$2" -o cache=auto "${x[@]}" 2>"$work/$1.err" &
		guest_dir=""
		;;
	virtiofsd-rs)
		local x=()
		((xattr)) && x=(--xattr)
		"$rs_bin" --socket-path="$sock" --shared-dir "$2" --cache auto "${x[@]}" 2>"$work/$1.err" &
		guest_dir=""
		;;
	esac
	pids+=($!)
}

stop_backends() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	pids=()
	rm -f "$work"/*.sock
}

available() {
	case "$1" in
	ours) [[ -x "$ours_bin" ]] ;;
	virtiofsd-c) [[ -x "$c_bin" ]] ;;
	virtiofsd-rs) [[ -n "$rs_bin" ]] ;;
	*) return 1 ;;
	esac
}

# one NAME ROUND: one VM against backend NAME; RESULT lines end up in $work/NAME.ROUND.log.
one() {
	local share="$work/share-$1"
	drop_share "$share"
	make_share "$share"
	start_backend "$1" "$share"
	wait_socket "$sock"
	local t0=$SECONDS
	run_vm "$sock" "$guest_dir" "$work/$1.$2.log"
	echo "$1 (round $2): VM ran $((SECONDS - t0)) s" >&2
	stop_backends
	grep -h "requests by FUSE opcode" "$work/$1.err" >&2 || true
	drop_share "$share"
	if ! grep -q "PLAN DONE" "$work/$1.$2.log" || grep -q "RESULT FAIL" "$work/$1.$2.log"; then
		echo "$1: the guest did not finish cleanly; serial log:" >&2
		tail -n 30 "$work/$1.$2.log" >&2
		tail -n 20 "$work/$1.err" >&2 2>/dev/null || true
		return 1
	fi
}

field() { # LOG KIND KEY: value of KEY= on the "RESULT KIND" line
	grep "RESULT $2 " "$1" | head -n1 | sed -n "s/.*[ ]$3=\([^ ]*\).*/\1/p"
}
median() { sort -n | awk '{v[NR]=$1} END {if (NR) print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }

names=(ours virtiofsd-c virtiofsd-rs)
[[ -n "$only" ]] && names=("$only")
ran=()
for n in "${names[@]}"; do
	if available "$n"; then
		ran+=("$n")
	else
		echo "skipping $n: its binary is missing" >&2
	fi
done
failed=0
for r in $(seq 1 "$rounds"); do
	for n in "${ran[@]}"; do
		one "$n" "$r" || failed=1
	done
done

cols=("write MiB/s:write:MiBps" "+fsync MiB/s:write:fsync_MiBps" "read MiB/s:read:MiBps" "create/s:meta:create_ops"
	"stat/s:meta:stat_ops" "unlink/s:meta:unlink_ops" "meta ops/s:meta:all_ops")
row() { # LABEL LOGS...: one table row (median over LOGS)
	local label="$1"; shift
	printf "%-24s" "$label"
	for c in "${cols[@]}"; do
		IFS=: read -r _ kind key <<<"$c"
		printf ' %12s' "$(for l in "$@"; do [[ -f "$l" ]] && field "$l" "$kind" "$key"; done | median)"
	done
	printf '\n'
}
printf '\n%-24s' backend
for c in "${cols[@]}"; do printf ' %12s' "${c%%:*}"; done
printf '\n'
for n in "${ran[@]}"; do
	for r in $(seq 1 "$rounds"); do
		row "$n (round $r)" "$work/$n.$r.log"
	done
done
col_median() { # NAME COLUMN: median of one column over NAME's rounds
	IFS=: read -r _ kind key <<<"$2"
	for l in "$work/$1".*.log; do [[ -f "$l" ]] && field "$l" "$kind" "$key"; done | median
}
if ((rounds > 1)); then
	for n in "${ran[@]}"; do
		row "$n (median)" "$work/$n".*.log
	done
fi
if [[ " ${ran[*]} " == *" ours "* ]]; then
	for n in "${ran[@]}"; do
		[[ "$n" == ours ]] && continue
		printf "%-24s" "ours / $n"
		for c in "${cols[@]}"; do
			printf ' %12s' "$(awk -v a="$(col_median ours "$c")" -v b="$(col_median "$n" "$c")" \
				'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')"
		done
		printf '\n'
	done
fi
printf '(%s MiB file, %s files; xattrs %s; shared fs: %s; QEMU TCG, -M pc, 1 vCPU, 1 GiB, queue-size=1024, guest-side timing)\n' \
	"$mib" "$files" "$( ((xattr)) && echo on || echo off)" "$share_fs"
exit "$failed"
