#!/usr/bin/env bash
# Fetch Debian's cloud kernel into the guest cache and unpack vmlinuz, an ELF vmlinux and the
# module tree. Idempotent; once cached it runs offline and touches neither apt nor the network.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

META_PACKAGE=linux-image-cloud-amd64

usage() {
	cat <<USAGE
Usage: $COWORK_SCRIPT_NAME [--cache DIR] [--package NAME] [--refresh] [--quiet]

Downloads Debian's $META_PACKAGE kernel (resolved to its versioned
linux-image-<version>-cloud-amd64 package) with 'apt-get download', unpacks it and
produces, under the cache directory:

  current -> kernel/<version>/      symlink to the kernel in use
  kernel/<version>/vmlinuz          the bzImage as shipped
  kernel/<version>/vmlinux          uncompressed ELF kernel taken out of the bzImage payload
  kernel/<version>/modules/         the module tree (lib/modules/<version>)
  kernel/<version>/version          the kernel release string
  debs/                             downloaded .deb files

On success prints shell-style assignments on stdout:
  KERNEL_VERSION=... VMLINUZ=... VMLINUX=... MODULES_DIR=...

Options:
  --cache DIR      cache directory (default: \$COWORK_GUEST_CACHE, else
                   \$XDG_CACHE_HOME/cowork-helper/guest, else <repo>/target/guest-cache;
                   now: $(guest_cache_dir))
  --package NAME   versioned kernel package to use instead of resolving $META_PACKAGE
  --refresh        resolve and download again even if a kernel is cached
  --quiet          no progress messages on stderr
  -h, --help       this text
USAGE
}

cache=""
package=""
refresh=0
while (($#)); do
	case "$1" in
	--cache) cache="${2:?--cache needs a directory}"; shift 2 ;;
	--package) package="${2:?--package needs a name}"; shift 2 ;;
	--refresh) refresh=1; shift ;;
	--quiet) COWORK_QUIET=1; shift ;;
	-h | --help) usage; exit 0 ;;
	*) usage >&2; die "unknown argument '$1'" ;;
	esac
done
cache="$(abs_path "${cache:-$(guest_cache_dir)}")"

print_result() {
	local dir="$1"
	printf 'KERNEL_VERSION=%s\n' "$(cat "$dir/version")"
	printf 'VMLINUZ=%s\n' "$dir/vmlinuz"
	printf 'VMLINUX=%s\n' "$dir/vmlinux"
	printf 'MODULES_DIR=%s\n' "$dir/modules"
}

# Fast path: a complete kernel is cached and no refresh was asked for.
if ((refresh == 0)) && [[ -z "$package" && -e "$cache/current/.complete" ]]; then
	print_result "$(cd "$cache/current" && pwd -P)"
	exit 0
fi

# Read a little-endian unsigned integer of $3 bytes at offset $2 of file $1.
read_le() {
	local v
	v="$(od -An -t "u$3" -j "$2" -N "$3" --endian=little "$1" | tr -d ' ')"
	[[ -n "$v" ]] || die "cannot read $3 bytes at offset $2 of $1"
	printf '%s\n' "$v"
}

# Decompress the kernel payload of a bzImage into an ELF vmlinux.
#
# The x86 boot protocol (>= 2.08) records where the compressed kernel lives: payload_offset (u32
# at 0x248) and payload_length (u32 at 0x24c), relative to the start of the protected-mode code,
# which follows the (setup_sects + 1) * 512 bytes of real-mode setup (setup_sects is the byte at
# 0x1f1; 0 means 4). The compression format is recognised from the payload's magic bytes. The
# kernel build appends the uncompressed size as 4 trailing bytes for most formats, which some
# decompressors report as trailing garbage, so the decompressor's status is not trusted; the
# result is checked with readelf instead.
extract_vmlinux() {
	local bz="$1" out="$2" tmp magic setup_sects version start off len decomp
	[[ "$(od -An -c -j 0x202 -N 4 "$bz" | tr -d ' ')" == HdrS ]] ||
		die "$bz is not a bzImage (no HdrS signature)"
	version="$(read_le "$bz" $((0x206)) 2)"
	((version >= 0x208)) || die "$bz: boot protocol $version too old to locate the payload"
	setup_sects="$(read_le "$bz" $((0x1f1)) 1)"
	((setup_sects == 0)) && setup_sects=4
	start=$(((setup_sects + 1) * 512))
	off="$(read_le "$bz" $((0x248)) 4)"
	len="$(read_le "$bz" $((0x24c)) 4)"
	tmp="$out.payload"
	dd if="$bz" of="$tmp" bs=64K skip=$((start + off)) count="$len" \
		iflag=skip_bytes,count_bytes status=none
	magic="$(od -An -tx1 -N 6 "$tmp" | tr -d ' \n')"
	case "$magic" in
	1f8b*) decomp=(gzip -dc) ;;
	fd377a585a00) decomp=(xz -dc --single-stream) ;;
	28b52ffd*) decomp=(zstd -dc) ;;
	425a68*) decomp=(bzip2 -dc) ;;
	5d0000*) decomp=(xz -dc --format=lzma) ;;
	02214c18*) decomp=(lz4 -dc) ;;
	894c5a*) decomp=(lzop -dc) ;;
	*) rm -f "$tmp"; die "$bz: unknown payload compression (magic $magic)" ;;
	esac
	local pkg="${decomp[0]}"
	[[ "$pkg" == xz ]] && pkg=xz-utils
	need_cmd "${decomp[0]}" "the kernel payload is ${decomp[0]}-compressed: apt-get install $pkg"
	"${decomp[@]}" <"$tmp" >"$out.tmp" 2>/dev/null || true
	rm -f "$tmp"
	if ! readelf -h "$out.tmp" >/dev/null 2>&1; then
		rm -f "$out.tmp"
		die "$bz: decompressing the payload with ${decomp[0]} did not give an ELF file"
	fi
	# Its zero pages (.bss, .brk: ~21 MiB of Debian's 51 MiB) become holes, which the kvm
	# backend's loader skips instead of copying into guest RAM (vmm/src/sparse.rs).
	dig_holes "$out.tmp"
	mv "$out.tmp" "$out"
}

resolve_package() {
	apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks \
		--no-replaces --no-enhances "$META_PACKAGE" 2>/dev/null |
		awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }'
}

need_cmd apt-get "this script needs Debian's apt"
need_cmd dpkg-deb "this script needs dpkg"
need_cmd readelf "install binutils"
need_cmd od "install coreutils"

if [[ -z "$package" ]]; then
	package="$(resolve_package || true)"
	if [[ -z "$package" ]]; then
		if ((EUID == 0)); then
			note "apt cannot resolve $META_PACKAGE; running apt-get update"
			apt-get update -qq >&2 || die "apt-get update failed"
			package="$(resolve_package || true)"
		fi
		[[ -n "$package" ]] || die "cannot resolve $META_PACKAGE to a versioned kernel package (run 'apt-get update'?)"
	fi
fi
[[ "$package" == linux-image-* ]] || die "'$package' is not a linux-image-* package"
kver="${package#linux-image-}"
kdir="$cache/kernel/$kver"

if [[ ! -e "$kdir/.complete" ]]; then
	mkdir -p "$cache/debs"
	deb="$(find "$cache/debs" -maxdepth 1 -name "${package}_*_amd64.deb" -print -quit)"
	if [[ -z "$deb" ]]; then
		note "downloading $package"
		# apt-get download writes into the current directory. As root it warns that the
		# download is unsandboxed because _apt cannot write there; that is expected.
		(cd "$cache/debs" && apt-get download -q "$package" 2>&1 |
			grep -v 'unsandboxed as root' >&2) || true
		deb="$(find "$cache/debs" -maxdepth 1 -name "${package}_*_amd64.deb" -print -quit)"
		[[ -n "$deb" ]] || die "apt-get download $package failed"
	fi
	note "unpacking $(basename "$deb")"
	rm -rf "$kdir"
	mkdir -p "$kdir"
	dpkg-deb -x "$deb" "$kdir/root"
	vmlinuz="$kdir/root/boot/vmlinuz-$kver"
	[[ -f "$vmlinuz" ]] || die "$deb has no boot/vmlinuz-$kver"
	moddir=""
	for d in "$kdir/root/lib/modules/$kver" "$kdir/root/usr/lib/modules/$kver"; do
		[[ -d "$d" ]] && moddir="$d" && break
	done
	[[ -n "$moddir" ]] || die "$deb has no lib/modules/$kver"
	ln -s "root/boot/vmlinuz-$kver" "$kdir/vmlinuz"
	ln -s "${moddir#"$kdir/"}" "$kdir/modules"
	printf '%s\n' "$kver" >"$kdir/version"
	note "extracting vmlinux from the bzImage payload"
	extract_vmlinux "$vmlinuz" "$kdir/vmlinux"
	touch "$kdir/.complete"
fi

ln -sfn "kernel/$kver" "$cache/current.tmp"
mv -T "$cache/current.tmp" "$cache/current"
print_result "$kdir"
