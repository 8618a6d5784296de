#!/usr/bin/env bash
# Run a command inside a nested-KVM guest: a QEMU TCG L1 guest with emulated AMD SVM whose root
# is this host's / over virtiofs, so the command sees the same files (the checkout, its build
# outputs, installed tools) and a working /dev/kvm that can boot Linux.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
SCRIPTS_DIR="$COWORK_REPO_ROOT/scripts"

usage() {
	cat <<USAGE
Usage: $COWORK_SCRIPT_NAME [options] -- COMMAND [ARG...]
       $COWORK_SCRIPT_NAME [options] -c 'SHELL COMMAND'
       $COWORK_SCRIPT_NAME --check

Boots an L1 guest under QEMU TCG with '-cpu EPYC,+svm', shares this host's / with it over
virtiofs, loads kvm-amd there and runs the command with bash, chrooted into the share, in the
current directory (or --cwd) with this environment (unless --clean-env). The command's stdout
and stderr (merged; they travel over the serial console, so binary output is not preserved)
are printed on stdout, and this script exits with the command's exit status.

Harness failures exit 125 (timeout: 124) with a message on stderr; use --result to tell them
apart from a command that exits 124/125 itself. --result's status is one of ok (rc= holds the
command's exit status), timeout, l1-panic (the L1 kernel crashed or locked up: L1 boots with
softlockup_panic=1), l1-hang (L1 stopped running: no heartbeat for --hang-after seconds) or
error; the two L1 failures are worth one retry.

Options:
  -c CMD             run CMD with 'bash -c' instead of an argument vector
  --check            only check the prerequisites and report what is missing
  --timeout SECS     whole-run limit, boot included (default: 600)
  --hang-after SECS  end the run as l1-hang when L1's heartbeat (a file the job touches every
                     5 s) is older than this while the command runs (default: 90; 0: never)
  --mem MIB          L1 memory (default: 2048)
  --smp N            L1 vCPUs (default: 2)
  --cwd DIR          working directory of the command (default: the current one)
  --clean-env        pass only PATH, HOME, LANG, TERM and COWORK_*/RUST_* instead of the whole
                     environment
  --kernel PATH      L1 kernel (default: \$CACHE/current/vmlinuz, see fetch-kernel.sh)
  --initrd PATH      L1 initramfs (default: built on first use into \$CACHE/harness/)
  --qemu PATH        QEMU binary (default: \$COWORK_QEMU or qemu-system-x86_64)
  --virtiofsd PATH   virtiofsd binary (default: \$COWORK_VIRTIOFSD, then 'virtiofsd' in PATH,
                     /usr/libexec/virtiofsd, /usr/lib/qemu/virtiofsd)
  --accel SPEC       QEMU -accel value for L1 (default: tcg; e.g. tcg,thread=single)
  --virtiofs-cache M virtiofsd cache mode of the shared / (always, auto or none; default:
                     always: L1 keeps what it read in its page cache, as a machine keeps a
                     local disk's; with auto every open drops the file's cached pages, so
                     each VM boot re-read its kernel, initrd and disk images over L1's
                     emulated virtio. L1 may then see a file the host changes while L1 runs
                     stale; nested commands must not depend on that)
  --no-kvm-hold      do not hold an empty VM in L1 during the command (held by default, so
                     KVM never turns SVM off and on across L1's CPUs between the command's VMs)
  --qemu-arg ARG     extra argument for the L1 QEMU; repeatable
  --append STR       extra L1 kernel command-line arguments
  --log FILE         write the whole L1 console log to FILE
  --result FILE      write 'status=ok rc=N', 'status=timeout' or 'status=error' (plus timings)
  --no-lock          do not wait for other nested runs (by default one runs at a time)
  -v, --verbose      show the L1 boot log on stderr
  -q, --quiet        no timing summary on stderr
  -h, --help         this text

CACHE is $(guest_cache_dir)
(\$COWORK_GUEST_CACHE, else \$XDG_CACHE_HOME/cowork-helper/guest, else <repo>/target/guest-cache).
Inside, COWORK_NESTED_INSIDE=1 is set, and COWORK_GUEST_THP=off unless the caller set it: with
the huge-page advice on guest RAM (the kvm backend's default) L1 compacts memory under running
L2 guests, and L1 crashed or locked up in about 1 of 12 nested boots with it, against none of
about 40 without (2026-12-03; QEMU TCG's SVM emulation). L1's THP mode is 'always', so the
guests still get huge pages where L1 has them free.
USAGE
}

timeout_s=600
hang_s=90
mem=2048
smp=2
cwd="$PWD"
clean_env=0
kernel=""
initrd=""
qemu="${COWORK_QEMU:-qemu-system-x86_64}"
virtiofsd="${COWORK_VIRTIOFSD:-}"
accel=tcg
vfs_cache=always
extra_qemu_args=()
extra_append=""
logfile=""
resultfile=""
use_lock=1
verbose=0
quiet=0
hold_kvm=1
check_only=0
shell_cmd=""
argv=()
while (($#)); do
	case "$1" in
	-c) shell_cmd="${2:?-c needs a command}"; shift 2 ;;
	--check) check_only=1; shift ;;
	--timeout) timeout_s="${2:?}"; shift 2 ;;
	--hang-after)
		hang_s="${2:?}"
		[[ "$hang_s" =~ ^[0-9]+$ ]] || die "--hang-after takes whole seconds"
		shift 2 ;;
	--mem) mem="${2:?}"; shift 2 ;;
	--smp) smp="${2:?}"; shift 2 ;;
	--cwd) cwd="${2:?}"; shift 2 ;;
	--clean-env) clean_env=1; shift ;;
	--kernel) kernel="${2:?}"; shift 2 ;;
	--initrd) initrd="${2:?}"; shift 2 ;;
	--qemu) qemu="${2:?}"; shift 2 ;;
	--virtiofsd) virtiofsd="${2:?}"; shift 2 ;;
	--virtiofs-cache)
		vfs_cache="${2:?}"
		[[ "$vfs_cache" =~ ^(auto|always|none)$ ]] || die "--virtiofs-cache takes auto, always or none"
		shift 2 ;;
	--accel) accel="${2:?}"; shift 2 ;;
	--qemu-arg) extra_qemu_args+=("${2:?}"); shift 2 ;;
	--append) extra_append="${2:?}"; shift 2 ;;
	--log) logfile="$(abs_path "${2:?}")"; shift 2 ;;
	--result) resultfile="$(abs_path "${2:?}")"; shift 2 ;;
	--no-lock) use_lock=0; shift ;;
	-v | --verbose) verbose=1; shift ;;
	--no-kvm-hold) hold_kvm=0; shift ;;
	-q | --quiet) quiet=1; shift ;;
	-h | --help) usage; exit 0 ;;
	--) shift; argv=("$@"); break ;;
	*) usage >&2; die "unknown argument '$1' (put the command after --)" ;;
	esac
done
[[ "$timeout_s" =~ ^[0-9]+$ && "$mem" =~ ^[0-9]+$ && "$smp" =~ ^[0-9]+$ ]] ||
	die "--timeout, --mem and --smp take whole numbers"

# Results go to --result as well as the exit status, so callers can tell a harness failure
# from a command's own exit status.
write_result() {
	[[ -n "$resultfile" ]] || return 0
	printf '%s\n' "$@" >"$resultfile"
}
qemu_version() { "$qemu_path" --version | sed -n '1s/.*version \([^ ]*\).*/\1/p'; }
harness_fail() { # status message
	write_result "status=$1" "message=$2"
	printf '%s: error: %s\n' "$COWORK_SCRIPT_NAME" "$2" >&2
	[[ "$1" == timeout ]] && exit 124
	exit 125
}

cache="$(guest_cache_dir)"

# --- prerequisites -------------------------------------------------------------------------
find_virtiofsd() {
	local c
	for c in "$virtiofsd" "$(command -v virtiofsd || true)" /usr/libexec/virtiofsd /usr/lib/qemu/virtiofsd; do
		if [[ -n "$c" && -x "$c" ]]; then
			printf '%s\n' "$c"
			return 0
		fi
	done
	return 1
}

problems=()
qemu_path="$(command -v "$qemu" || true)"
[[ -n "$qemu_path" ]] || problems+=("QEMU '$qemu' not found: apt-get install qemu-system-x86")
virtiofsd_path="$(find_virtiofsd || true)"
[[ -n "$virtiofsd_path" ]] ||
	problems+=("virtiofsd not found: apt-get install qemu-system-common (Debian 12 ships /usr/lib/qemu/virtiofsd) or set COWORK_VIRTIOFSD")
if [[ -z "$kernel" ]]; then
	kernel="$cache/current/vmlinuz"
	[[ -e "$cache/current/.complete" ]] || problems+=("no cached kernel in $cache: run scripts/fetch-kernel.sh")
elif [[ ! -f "$kernel" ]]; then
	problems+=("kernel '$kernel' not found")
fi
if [[ -z "$initrd" ]]; then
	command -v cpio >/dev/null || problems+=("cpio not found: apt-get install cpio")
	[[ -x /bin/busybox ]] || problems+=("/bin/busybox not found: apt-get install busybox-static")
elif [[ ! -f "$initrd" ]]; then
	problems+=("initrd '$initrd' not found")
fi
[[ -c /dev/fuse || -n "$virtiofsd_path" ]] || true
if ((check_only)); then
	if ((${#problems[@]})); then
		printf 'missing: %s\n' "${problems[@]}"
		exit 1
	fi
	printf 'ok: qemu=%s virtiofsd=%s kernel=%s\n' "$qemu_path" "$virtiofsd_path" "$(readlink -f "$kernel")"
	exit 0
fi
((${#problems[@]} == 0)) || harness_fail error "$(printf '%s; ' "${problems[@]}")"
[[ -n "$shell_cmd" || ${#argv[@]} -gt 0 ]] || { usage >&2; die "no command given"; }
[[ -z "$shell_cmd" || ${#argv[@]} -eq 0 ]] || die "give either -c CMD or -- COMMAND, not both"
cwd="$(cd "$cwd" && pwd)" || die "--cwd '$cwd' is not a directory"

# Children must neither keep the lock (a SIGKILLed run would block the next one until its QEMU
# times out) nor outlive this script: spawn closes the lock fd for them, and setpriv's parent-
# death signal ends them when this script dies, even by SIGKILL.
lock_fd=""
pdeath=()
command -v setpriv >/dev/null && pdeath=(setpriv --pdeathsig)
# Use as 'spawn SIGNAL COMMAND... &': the background subshell execs COMMAND, so $! is its pid
# and this script its parent.
spawn() {
	local sig="$1"
	shift
	if ((${#pdeath[@]})); then
		set -- "${pdeath[@]}" "$sig" "$@"
	fi
	if [[ -n "$lock_fd" ]]; then
		exec "$@" {lock_fd}>&-
	else
		exec "$@"
	fi
}

mkdir -p "$cache"
if ((use_lock)); then
	need_cmd flock "install util-linux or pass --no-lock"
	exec {lock_fd}>"$cache/nested.lock"
	if ! flock -n "$lock_fd"; then
		note "waiting for another nested run to finish"
		flock "$lock_fd"
	fi
fi

# --- L1 initramfs --------------------------------------------------------------------------
if [[ -z "$initrd" ]]; then
	kver="$(cat "$cache/current/version")"
	initrd="$cache/harness/initramfs-$kver.img"
	stale=0
	[[ -f "$initrd" ]] || stale=1
	for src in "$SCRIPTS_DIR/initramfs/harness-init" "$SCRIPTS_DIR/mkinitramfs.sh" \
		"$SCRIPTS_DIR/lib/common.sh" "$cache/current/.complete"; do
		[[ "$src" -nt "$initrd" ]] && stale=1
	done
	if ((stale)); then
		note "building the L1 initramfs $initrd"
		COWORK_QUIET=1 "$SCRIPTS_DIR/mkinitramfs.sh" --output "$initrd" \
			--init "$SCRIPTS_DIR/initramfs/harness-init" --module-set harness \
			--modules-dir "$cache/current/modules" >&2 ||
			harness_fail error "building the L1 initramfs failed"
	fi
fi

# --- job directory -------------------------------------------------------------------------
# Job directories of runs that were SIGKILLed (no trap ran) are removed by the next run. QEMU
# and virtiofsd of such a run end by themselves: QEMU at its timeout, virtiofsd with QEMU.
for stale in "${TMPDIR:-/tmp}"/nested-run.*; do
	[[ -f "$stale/owner.pid" ]] || continue
	kill -0 "$(<"$stale/owner.pid")" 2>/dev/null && continue
	rm -rf "$stale"
done
job="$(mktemp -d "${TMPDIR:-/tmp}/nested-run.XXXXXX")"
job="$(cd "$job" && pwd -P)"
echo "$$" >"$job/owner.pid"
[[ "$job" =~ ^[A-Za-z0-9_./-]+$ ]] || die "job directory '$job' has characters the kernel command line cannot carry; set TMPDIR"
token="$(od -An -tx1 -N8 /dev/urandom | tr -d ' \n')"
sock="$job/virtiofs.sock"
fifo="$job/console"
alive="$job/alive"
hb_interval=5
mkfifo "$fifo"

vfs_pid=""
qemu_pid=""
# shellcheck disable=SC2317 # invoked by the EXIT trap
cleanup() {
	local pid
	for pid in "$qemu_pid" "$vfs_pid"; do
		if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
			kill "$pid" 2>/dev/null || true
		fi
	done
	for pid in "$qemu_pid" "$vfs_pid"; do
		if [[ -n "$pid" ]]; then
			wait "$pid" 2>/dev/null || true
		fi
	done
	rm -rf "$job"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

{
	printf '#!/bin/bash\n# written by nested-run.sh\n'
	if ((clean_env)); then
		for name in PATH HOME LANG TERM; do
			[[ -n "${!name:-}" ]] && printf 'export %s=%q\n' "$name" "${!name}"
		done
	fi
	while IFS= read -r -d '' kv; do
		name="${kv%%=*}"
		[[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
		case "$name" in
		PWD | OLDPWD | SHLVL | _) continue ;;
		esac
		if ((clean_env)); then
			[[ "$name" == COWORK_* || "$name" == RUST_* ]] || continue
		fi
		printf 'export %s=%q\n' "$name" "${kv#*=}"
	done < <(env -0)
	if ((hold_kvm)); then
		# One empty VM for the whole run: KVM turns SVM on across L1's CPUs when its first VM is
		# created and off when its last one goes, each time with an IPI it waits for on every CPU.
		# Under QEMU TCG's SVM emulation an L1 CPU now and then stops answering IPIs (seen after
		# it ran L2 guests, and once right after SVM was turned on), and the VMM thread closing
		# its VM then spins there for good (soft lockup in kvm_destroy_vm ->
		# on_each_cpu_cond_mask). With a VM held, the command's VMs never take that path; other
		# IPIs still can stall, which softlockup_panic and the heartbeat below catch. The holder
		# (perl-base is Essential on Debian) creates the VM before it forks into the
		# background, so the command's first VM already finds SVM on.
		printf '%s\n' "perl -e 'open(my \$k, \"+<\", \"/dev/kvm\") or exit 1; defined(ioctl(\$k, 0xAE01, 0)) or exit 2; exit 0 if fork; sleep' </dev/null >/dev/null 2>&1 || echo 'nested-run: warning: could not hold a KVM VM' >&2"
	fi
	if ((hang_s > 0)); then
		# L1's heartbeat: a file on the share the host watches while the command runs. Both of
		# L1's CPUs have been seen to stop for good (QEMU busy, no console output, no soft-lockup
		# report: interrupts off, or an L2 guest L1 never gets back from); the run then ends as
		# l1-hang after --hang-after seconds instead of at the whole-run timeout.
		printf '( while :; do echo "$SECONDS" >%q; sleep %d; done ) </dev/null >/dev/null 2>&1 &\n' "$alive" "$hb_interval"
	fi
	printf 'export COWORK_NESTED_INSIDE=1\n'
	printf 'export COWORK_GUEST_THP=%q\n' "${COWORK_GUEST_THP:-off}"
	printf 'cd -- %q || exit 125\n' "$cwd"
	if [[ -n "$shell_cmd" ]]; then
		printf 'exec /bin/bash -c %q\n' "$shell_cmd"
	else
		printf 'exec'
		printf ' %q' "${argv[@]}"
		printf '\n'
	fi
} >"$job/job.sh"

# --- virtiofsd -----------------------------------------------------------------------------
if "$virtiofsd_path" --help 2>&1 | grep -q -- '--shared-dir'; then
	# the Rust virtiofsd
	vfs_cmd=("$virtiofsd_path" "--socket-path=$sock" --shared-dir / --sandbox none --cache "$vfs_cache")
else
	# QEMU's C virtiofsd (Debian 12: /usr/lib/qemu/virtiofsd). Without sandbox=chroot it fails
	# on pivot_root for source=/.
	vfs_cmd=("$virtiofsd_path" "--socket-path=$sock" -o source=/ -o sandbox=chroot -o "cache=$vfs_cache")
fi
t_start="$EPOCHREALTIME"
spawn TERM "${vfs_cmd[@]}" </dev/null >"$job/virtiofsd.log" 2>&1 &
vfs_pid=$!
for _ in $(seq 100); do
	[[ -S "$sock" ]] && break
	kill -0 "$vfs_pid" 2>/dev/null || break
	sleep 0.05
done
[[ -S "$sock" ]] || harness_fail error "virtiofsd did not start: $(tail -n 5 "$job/virtiofsd.log")"

# --- QEMU ----------------------------------------------------------------------------------
# An L1 CPU stuck in the kernel never comes back under TCG's SVM emulation (seen: a VMM
# thread spinning 650 s until the whole-run timeout). softlockup_panic turns the first
# soft-lockup report into an L1 panic, which ends the run at once as l1-panic (retried by the
# tests) and, since panic() raises the console level, prints the stuck CPU's backtrace.
# watchdog_thresh=20 reports after 40 s in the kernel, twice the default, to leave room for
# slow but legitimate paths at TCG speed.
l1_watchdog="softlockup_panic=1 watchdog_thresh=20"
# shellcheck disable=SC2054 # the commas belong to QEMU option values
qemu_cmd=(
	"$qemu_path" -accel "$accel" -cpu EPYC,+svm -smp "$smp" -m "$mem" -M pc
	-nodefaults -no-user-config -display none -serial stdio -no-reboot
	-object "memory-backend-memfd,id=mem,size=${mem}M,share=on" -numa node,memdev=mem
	-chardev "socket,id=vfs,path=$sock" -device vhost-user-fs-pci,chardev=vfs,tag=hostroot
	-kernel "$kernel" -initrd "$initrd"
	-append "console=ttyS0 quiet panic=-1 $l1_watchdog $extra_append nested.job=$job nested.token=$token"
	"${extra_qemu_args[@]}"
)
# timeout passes the TERM it gets at this script's death on to QEMU; QEMU gets KILL should
# timeout itself die.
qemu_launch=(timeout --kill-after=5 "$timeout_s")
if ((${#pdeath[@]})); then
	qemu_launch+=("${pdeath[@]}" KILL)
fi
spawn TERM "${qemu_launch[@]}" "${qemu_cmd[@]}" </dev/null >"$fifo" 2>"$job/qemu.log" &
qemu_pid=$!

# --- console filter ------------------------------------------------------------------------
state=boot
boot_tail=()
rc=""
guest_error=""
guest_ready_uptime=""
l1_panic=0
l1_hang=""
t_ready=""
t_exit=""
log="${logfile:-/dev/null}"
: >"$log"

# While the command runs: the age in seconds of L1's heartbeat (the job's writes to $alive;
# the command's start until the first one).
heartbeat_age() {
	local last
	last="$(stat -c %Y "$alive" 2>/dev/null)" || last="${t_ready%.*}"
	echo $((EPOCHSECONDS - last))
}
next_check=0
partial=""
at_eof=0
exec {console}<"$fifo"
while ((!at_eof)); do
	# Wake up every heartbeat interval even when L1 prints nothing; a timed-out read keeps
	# the part of a line it got.
	got_line=1
	if IFS= read -r -t "$hb_interval" -u "$console" chunk; then
		line="$partial$chunk"
		partial=""
	elif (($? > 128)); then
		partial+="$chunk"
		got_line=0
	else
		at_eof=1
		line="$partial$chunk"
		partial=""
		[[ -n "$line" ]] || got_line=0
	fi
	if [[ "$state" == run ]] && ((hang_s > 0 && EPOCHSECONDS >= next_check)) && [[ -z "$l1_hang" ]]; then
		next_check=$((EPOCHSECONDS + hb_interval))
		age="$(heartbeat_age)"
		if ((age > hang_s)); then
			l1_hang="$age"
			kill "$qemu_pid" 2>/dev/null || true
		fi
	fi
	((got_line)) || continue
	line="${line%$'\r'}"
	printf '%s\n' "$line" >>"$log"
	# Only counts as the L1 kernel's if no exit marker follows (an L2 guest's panic message
	# also passes through here as command output).
	[[ "$line" == *"Kernel panic - not syncing"* ]] && l1_panic=1
	case "$state" in
	boot)
		if [[ "$line" == *"@@NESTED-READY $token "* ]]; then
			state=run
			t_ready="$EPOCHREALTIME"
			guest_ready_uptime="${line##*uptime=}"
			guest_ready_uptime="${guest_ready_uptime%@@}"
		elif [[ "$line" == *"@@NESTED-ERROR $token "* ]]; then
			guest_error="${line#*"@@NESTED-ERROR $token "}"
			guest_error="${guest_error%@@}"
		else
			boot_tail+=("$line")
			((${#boot_tail[@]} > 40)) && boot_tail=("${boot_tail[@]:1}")
			((verbose)) && printf '%s\n' "$line" >&2
		fi
		;;
	run)
		if [[ "$line" == *"@@NESTED-EXIT $token rc="* ]]; then
			prefix="${line%%"@@NESTED-EXIT $token rc="*}"
			[[ -n "$prefix" ]] && printf '%s' "$prefix"
			rc="${line##*rc=}"
			rc="${rc%@@}"
			t_exit="$EPOCHREALTIME"
			state="done"
		else
			printf '%s\n' "$line"
		fi
		;;
	done)
		((verbose)) && printf '%s\n' "$line" >&2
		;;
	esac
done
exec {console}<&-
qemu_status=0
wait "$qemu_pid" || qemu_status=$?
qemu_pid=""
t_end="$EPOCHREALTIME"

elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
timings=()
[[ -n "$t_ready" ]] && timings+=("l1_ready_s=$(elapsed "$t_start" "$t_ready")" "l1_guest_uptime_s=$guest_ready_uptime")
[[ -n "$t_exit" ]] && timings+=("command_s=$(elapsed "$t_ready" "$t_exit")")
timings+=("total_s=$(elapsed "$t_start" "$t_end")")
if ((!quiet)); then
	note "timings: ${timings[*]}"
fi

show_boot_tail() {
	if ((!verbose)) && ((${#boot_tail[@]})); then
		printf '%s: last L1 console lines:\n' "$COWORK_SCRIPT_NAME" >&2
		printf '  | %s\n' "${boot_tail[@]}" >&2
	fi
	if [[ -s "$job/qemu.log" ]]; then
		printf '%s: qemu stderr:\n' "$COWORK_SCRIPT_NAME" >&2
		# The EPYC model asks for features TCG lacks; those warnings are expected.
		grep -v "TCG doesn't support requested feature" "$job/qemu.log" |
			sed 's/^/  | /' | tail -n 20 >&2 || true
	fi
}

if [[ -n "$rc" ]]; then
	write_result "status=ok" "rc=$rc" "${timings[@]}"
	exit "$rc"
fi
if [[ -n "$l1_hang" ]]; then
	show_boot_tail
	harness_fail l1-hang "the L1 guest stopped running while the command ran: its heartbeat was ${l1_hang}s old (limit ${hang_s}s; QEMU $(qemu_version) TCG's SVM emulation has shown rare hangs of both L1 CPUs while they run L2 guests); QEMU was stopped"
fi
if ((qemu_status == 124 || qemu_status == 137)); then
	show_boot_tail
	harness_fail timeout "timed out after ${timeout_s}s ($([[ "$state" == run ]] && echo "command was running" || echo "L1 did not get ready"))"
fi
show_boot_tail
if ((l1_panic)); then
	harness_fail l1-panic "the L1 guest kernel panicked or locked up (QEMU $(qemu_version) TCG's SVM emulation has shown rare crashes and soft lockups of L1 while it runs an L2 guest); the command did not finish"
fi
if [[ -n "$guest_error" ]]; then
	harness_fail error "L1 guest: $guest_error"
fi
harness_fail error "QEMU exited with status $qemu_status before the command finished"
