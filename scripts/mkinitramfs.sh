#!/usr/bin/env bash
# Build a newc cpio initramfs from busybox-static, kernel modules (with their dependencies, read
# from each module's own depends= field since Debian's .deb ships no modules.dep), a caller-given
# /init and extra files.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# Byte-wise string lengths for the cpio headers.
export LC_ALL=C

# This script avoids a fork per file in its loops: it also runs inside the nested harness's
# L1 guest, where every process start costs TCG time.

# Named module sets. Dependencies are added automatically, so each set lists only the modules
# the guest actually uses.
#   harness: the nested-KVM harness's L1 guest (virtio-pci, virtiofs root share, KVM on AMD SVM,
#            veth for tests that build network namespaces inside L1, e.g. tests/egress_vm.rs)
#   guest:   the cowork guest image (virtio-mmio and -pci, vsock, virtiofs, block, rng, balloon
#            for free page reporting, overlay for the session userland's writable layer, and
#            tcp_diag so the egress relay attributes a connection to its session with one
#            sock_diag lookup instead of scanning /proc/net/tcp)
module_set() {
	case "$1" in
	harness) echo "virtio_pci virtiofs kvm_amd veth" ;;
	guest) echo "virtio_mmio virtio_pci virtio_blk virtio_rng virtio_balloon vmw_vsock_virtio_transport virtiofs ext4 overlay tcp_diag" ;;
	*) die "unknown module set '$1' (known: harness, guest)" ;;
	esac
}

usage() {
	cat <<USAGE
Usage: $COWORK_SCRIPT_NAME --output FILE --init PATH [options]

Options:
  --output FILE        initramfs to write (written atomically)
  --init PATH          program or script installed as /init (mode 0755)
  --module NAME        kernel module to include with its dependencies; repeatable, also takes
                       a comma- or space-separated list; '-' and '_' are interchangeable
  --module-set NAME    add a named set: harness ($(module_set harness))
                       or guest ($(module_set guest))
  --modules-dir DIR    module tree lib/modules/<version> (default: the cached kernel's,
                       $(guest_cache_dir)/current/modules, see fetch-kernel.sh)
  --add SRC:DST        copy file or directory SRC to DST inside the image; repeatable
  --busybox PATH       static busybox to install as /bin/busybox with applet links
                       (default: /bin/busybox from busybox-static)
  --no-busybox         do not install busybox
  --omit-applet NAME   leave busybox's link for applet NAME (e.g. modprobe) out; repeatable
  --no-softdeps        do not follow 'softdep=pre:' module hints
  --keep-signatures    keep the modules' appended signatures (by default they are dropped: the
                       kernel would verify each at load time, see strip_signature)
  --compress KIND      gzip (default), zstd or none
  -h, --help           this text

Layout of the image:
  /bin/busybox and links for its applets (bin/, sbin/, usr/bin/, usr/sbin/)
  /init
  /lib/modules/<version>/<path>.ko       modules, decompressed, signatures dropped
  /lib/modules/<version>/modules.dep     in depmod's format, for the included modules
  /lib/modules/<version>/modules.builtin copied from the tree
  /lib/modules/load-order                module paths (relative to lib/modules/<version>), one a
                                         line, dependencies first: 'insmod' them in this order
  /dev/console (char 5:1) and /dev/null (char 1:3), created without needing root
USAGE
}

output=""
init=""
modules_dir=""
busybox=/bin/busybox
compress=gzip
softdeps=1
keep_signatures=0
# Trailer of a signed kernel module (followed by a newline), see strip_signature.
SIG_MAGIC='~Module signature appended~'
modules=()
adds=()
applets=()
# Applet names (basenames) whose links are left out: --omit-applet.
declare -A omit_applet=()
while (($#)); do
	case "$1" in
	--output) output="${2:?--output needs a file}"; shift 2 ;;
	--init) init="${2:?--init needs a path}"; shift 2 ;;
	--module)
		read -r -a words <<<"${2//,/ }"
		modules+=("${words[@]}")
		shift 2
		;;
	--module-set)
		read -r -a words <<<"$(module_set "${2:?--module-set needs a name}")"
		modules+=("${words[@]}")
		shift 2
		;;
	--modules-dir) modules_dir="${2:?--modules-dir needs a directory}"; shift 2 ;;
	--add) adds+=("${2:?--add needs SRC:DST}"); shift 2 ;;
	--busybox) busybox="${2:?--busybox needs a path}"; shift 2 ;;
	--no-busybox) busybox=""; shift ;;
	--omit-applet) omit_applet[${2:?--omit-applet needs an applet name}]=1; shift 2 ;;
	--no-softdeps) softdeps=0; shift ;;
	--keep-signatures) keep_signatures=1; shift ;;
	--compress) compress="${2:?--compress needs gzip, zstd or none}"; shift 2 ;;
	-h | --help) usage; exit 0 ;;
	*) usage >&2; die "unknown argument '$1'" ;;
	esac
done

[[ -n "$output" ]] || { usage >&2; die "--output is required"; }
[[ -n "$init" ]] || { usage >&2; die "--init is required"; }
[[ -f "$init" ]] || die "init program '$init' does not exist"
case "$compress" in
gzip | none) ;;
zstd) need_cmd zstd "install zstd or use --compress gzip" ;;
*) die "--compress must be gzip, zstd or none" ;;
esac
need_cmd cpio "install cpio (apt-get install cpio)"
output="$(abs_path "$output")"

stage="$(mktemp -d "${TMPDIR:-/tmp}/mkinitramfs.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
root="$stage/root"
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,dev,proc,sys,mnt,tmp,run,root,etc,lib/modules}

# --- busybox -------------------------------------------------------------------------------
if [[ -n "$busybox" ]]; then
	[[ -x "$busybox" ]] || die "busybox '$busybox' not found (apt-get install busybox-static)"
	if readelf -l "$busybox" 2>/dev/null | grep -q 'Requesting program interpreter'; then
		die "$busybox is dynamically linked; install busybox-static"
	fi
	cp "$busybox" "$root/bin/busybox"
	# The applet links are written straight into the archive (see below), not created here.
	mapfile -t applets < <("$busybox" --list-full)
fi

# --- kernel modules ------------------------------------------------------------------------
# Module names use '_' where file names may use '-'; sets the variable named $1.
norm() { printf -v "$1" '%s' "${2//-/_}"; }

if ((${#modules[@]})); then
	modules_dir="${modules_dir:-$(guest_cache_dir)/current/modules}"
	[[ -d "$modules_dir/kernel" ]] ||
		die "no module tree at '$modules_dir' (run scripts/fetch-kernel.sh or pass --modules-dir)"
	modules_dir="$(cd "$modules_dir" && pwd -P)"
	kver="$(basename "$modules_dir")"
	need_cmd readelf "install binutils"
	dest="$root/lib/modules/$kver"
	mkdir -p "$dest"

	# name -> path relative to the tree, for every module file in it
	declare -A mod_path=()
	while IFS= read -r rel; do
		base="${rel##*/}"
		norm name "${base%%.ko*}"
		mod_path[$name]="$rel"
	done < <(cd "$modules_dir" && find kernel -name '*.ko' -o -name '*.ko.*')

	declare -A builtin=()
	if [[ -f "$modules_dir/modules.builtin" ]]; then
		while IFS= read -r rel; do
			base="${rel##*/}"
			norm name "${base%%.ko*}"
			builtin[$name]=1
		done <"$modules_dir/modules.builtin"
	fi

	# Copy one module into the image, decompressed; prints its path inside lib/modules/<kver>.
	stage_module() {
		local rel="$1" out
		out="${rel%.ko*}.ko"
		mkdir -p "$dest/$(dirname "$out")"
		case "$rel" in
		*.ko) cp "$modules_dir/$rel" "$dest/$out" ;;
		*.ko.xz) xz -dc "$modules_dir/$rel" >"$dest/$out" ;;
		*.ko.zst) zstd -qdc "$modules_dir/$rel" >"$dest/$out" ;;
		*.ko.gz) gzip -dc "$modules_dir/$rel" >"$dest/$out" ;;
		*) die "unsupported module compression: $rel" ;;
		esac
		((keep_signatures)) || strip_signature "$dest/$out"
		printf '%s\n' "$out"
	}

	# Drop a module's appended signature (the kernel's format: the signature, a 12-byte
	# struct module_signature ending in the signature's big-endian length, then
	# SIG_MAGIC and a newline). Debian's kernel (CONFIG_MODULE_SIG without _FORCE) verifies a
	# signature it finds at every load (RSA, SHA-256 over the whole module), which was most
	# of the module loading time of a TCG boot (about 0.15 s a module); unsigned modules load
	# the same, with a taint noted at KERN_NOTICE (which 'quiet' does not print). The modules
	# come from the kernel package the host supplies with the kernel itself, so in the guest
	# the check proves nothing more. Unsigned modules are left as they are.
	strip_signature() {
		local f="$1" size magic len b
		size="$(stat -c %s "$f")"
		((size > ${#SIG_MAGIC} + 13)) || return 0
		magic="$(tail -c $((${#SIG_MAGIC} + 1)) "$f")"
		[[ "$magic" == "$SIG_MAGIC" ]] || return 0
		len=0
		for b in $(od -An -tu1 -j $((size - ${#SIG_MAGIC} - 5)) -N4 "$f"); do
			len=$((len * 256 + b))
		done
		((len > 0 && len + 12 + ${#SIG_MAGIC} + 1 < size)) ||
			die "$f: implausible module signature length $len"
		truncate -s $((size - len - 12 - ${#SIG_MAGIC} - 1)) "$f"
	}

	# Print the value of a .modinfo key (e.g. depends) of an uncompressed module.
	modinfo_field() {
		readelf -p .modinfo "$1" 2>/dev/null |
			sed -n "s/^ *\[ *[0-9a-f]*\]  $2=//p"
	}

	declare -A state=() staged=() deps_of=()
	order=()
	# Depth-first: a module is appended to 'order' after everything it depends on.
	visit() {
		local name dep rel ko depends soft word pre
		norm name "$1"
		case "${state[$name]:-}" in
		done) return 0 ;;
		visiting) die "module dependency cycle through $name" ;;
		esac
		if [[ -z "${mod_path[$name]:-}" ]]; then
			if [[ -n "${builtin[$name]:-}" ]]; then
				note "$name is built into the kernel, nothing to add"
				state[$name]="done"
				return 0
			fi
			die "module '$name' is not in $modules_dir"
		fi
		state[$name]=visiting
		rel="${mod_path[$name]}"
		ko="$(stage_module "$rel")"
		staged[$name]="$ko"
		depends="$(modinfo_field "$dest/$ko" depends)"
		local dep_list=()
		for dep in ${depends//,/ }; do
			visit "$dep"
			norm dep "$dep"
			[[ -n "${staged[$dep]:-}" ]] && dep_list+=("$dep")
		done
		if ((softdeps)); then
			soft="$(modinfo_field "$dest/$ko" softdep)"
			pre=0
			for word in $soft; do
				case "$word" in
				pre:) pre=1 ;;
				post:) pre=0 ;;
				*)
					norm word "$word"
					if ((pre)); then
						if [[ -n "${mod_path[$word]:-}" ]]; then
							visit "$word"
						elif [[ -z "${builtin[$word]:-}" ]]; then
							note "$name: soft dependency '$word' is not a module file, skipped"
						fi
					fi
					;;
				esac
			done
		fi
		deps_of[$name]="${dep_list[*]}"
		state[$name]="done"
		order+=("$name")
	}
	for m in "${modules[@]}"; do
		visit "$m"
	done

	# All dependencies of a module, transitively, in reverse load order (depmod's convention:
	# modprobe loads the list from its end).
	closure() {
		local -A seen=()
		local out=() stack=("$1") n d
		while ((${#stack[@]})); do
			n="${stack[-1]}"
			unset 'stack[-1]'
			for d in ${deps_of[$n]}; do
				[[ -n "${seen[$d]:-}" ]] && continue
				seen[$d]=1
				stack+=("$d")
			done
		done
		for ((i = ${#order[@]} - 1; i >= 0; i--)); do
			[[ -n "${seen[${order[i]}]:-}" ]] && out+=("${staged[${order[i]}]}")
		done
		printf '%s' "${out[*]}"
	}
	: >"$dest/modules.dep"
	: >"$root/lib/modules/load-order"
	for name in "${order[@]}"; do
		printf '%s: %s\n' "${staged[$name]}" "$(closure "$name")" >>"$dest/modules.dep"
		printf '%s\n' "${staged[$name]}" >>"$root/lib/modules/load-order"
	done
	[[ -f "$modules_dir/modules.builtin" ]] && cp "$modules_dir/modules.builtin" "$dest/"
	note "modules ($kver), load order: ${order[*]:-none}"
fi

# --- init and extra files ------------------------------------------------------------------
cp "$init" "$root/init"
chmod 0755 "$root/init"
for spec in "${adds[@]}"; do
	src="${spec%%:*}"
	dst="${spec#*:}"
	[[ "$spec" == *:* && -n "$src" && "$dst" == /* ]] || die "--add wants SRC:/absolute/DST, got '$spec'"
	[[ -e "$src" ]] || die "--add: '$src' does not exist"
	mkdir -p "$root$(dirname "$dst")"
	cp -a "$src" "$root$dst"
done

# --- archive -------------------------------------------------------------------------------
# Device nodes and busybox's applet links go into a second, hand-written newc archive: no root
# or mknod is needed, and no process per link. The kernel unpacks concatenated archives in
# order.
# Padding as printf format text: bash strings cannot hold NUL bytes, printf formats can.
NUL_PADS=('' '\0' '\0\0' '\0\0\0')
newc_entry() { # name mode(octal) rdevmajor rdevminor [data]
	local name="$1" data="${5:-}" namesize=$((${#1} + 1)) hpad dpad
	hpad=$(((4 - (110 + namesize) % 4) % 4))
	dpad=$(((4 - ${#data} % 4) % 4))
	# shellcheck disable=SC2059 # the padding is format text on purpose
	printf "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%s\\0${NUL_PADS[hpad]}%s${NUL_PADS[dpad]}" \
		0 "$((8#$2))" 0 0 1 0 "${#data}" 0 0 "$3" "$4" "$namesize" 0 "$name" "$data"
}
{
	(cd "$root" && find . -mindepth 1 | sort |
		cpio --quiet -o -H newc -R 0:0 --reproducible)
	{
		newc_entry dev/console 020600 5 1
		newc_entry dev/null 020666 1 3
		declare -A seen_applet=()
		for applet in "${applets[@]}"; do
			[[ -z "$applet" || "$applet" == bin/busybox || -n "${seen_applet[$applet]:-}" ]] && continue
			[[ -n "${omit_applet[${applet##*/}]:-}" ]] && continue
			seen_applet[$applet]=1
			# Relative link from the applet's directory back to bin/busybox.
			dir="${applet%/*}"
			[[ "$applet" == */* ]] || dir=""
			up=""
			while [[ -n "$dir" ]]; do
				up+="../"
				[[ "$dir" == */* ]] && dir="${dir%/*}" || dir=""
			done
			newc_entry "$applet" 0120777 0 0 "${up}bin/busybox"
		done
		newc_entry 'TRAILER!!!' 0 0 0
	}
} >"$stage/initramfs.cpio"

case "$compress" in
gzip) gzip -n -6 <"$stage/initramfs.cpio" >"$stage/out" ;;
zstd) zstd -q -19 <"$stage/initramfs.cpio" >"$stage/out" ;;
none) mv "$stage/initramfs.cpio" "$stage/out" ;;
esac
mkdir -p "$(dirname "$output")"
mv -f "$stage/out" "$output.tmp.$$"
mv -f "$output.tmp.$$" "$output"
note "wrote $output ($(stat -c %s "$output") bytes)"
