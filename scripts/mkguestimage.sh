#!/usr/bin/env bash
# Build the cowork guest image: Debian's cloud kernel (vmlinuz), an initramfs whose /init is the
# statically linked guest agent, with busybox and the kernel modules the guest needs, and the
# default userland disk rootfs.img (scripts/mkrootfs.sh). Offline once the kernel and the userland
# are cached and the agent's crates are in cargo's cache.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
SCRIPTS_DIR="$COWORK_REPO_ROOT/scripts"

# Rust target of the static agent (glibc, linked with +crt-static).
AGENT_TARGET=x86_64-unknown-linux-gnu
AGENT_BIN=cowork-guest-agent
# Format line of image-info; the QEMU backend accepts a directory as our image only when its
# image-info starts with it.
IMAGE_FORMAT=cowork-guest-image/1

usage() {
	cat <<USAGE
Usage: $COWORK_SCRIPT_NAME [--output DIR] [--agent PATH] [--cache DIR] [--no-rootfs] [--quiet]

Builds, into the output directory:

  vmlinuz      Debian's linux-image-cloud-amd64 kernel (scripts/fetch-kernel.sh)
  vmlinux      the same kernel as an uncompressed ELF (PVH entry), booted by --backend kvm
  initramfs    uncompressed newc cpio (scripts/mkinitramfs.sh): /init = the static guest agent
               ($AGENT_BIN, without its symbol table), busybox-static with applet links
               (but no modprobe: the agent loads the modules itself),
               and mkinitramfs.sh's 'guest' module set (virtio mmio/pci, vsock, virtiofs,
               virtio-blk, virtio-rng, virtio-balloon, ext4)
               with their dependencies, decompressed, plus a modules.dep the agent loads
               them from in dependency order; e2fsprogs' mke2fs in /lib/cowork-mkfs
               (mkfs.ext4 with its shared libraries, the loader as ld.so and
               mke2fs.conf, flat: the agent formats a blank session disk with it after
               the userland switch; busybox's mke2fs only makes ext2)
  rootfs.img   the default session userland: a read-only ext4 Debian tree without a journal,
               label cowork-rootfs (scripts/mkrootfs.sh; built once into the cache, a few
               minutes, then linked or copied from there)
  rootfs-info  what mkrootfs.sh recorded about it (suite, packages, sizes, build time)
  image-info   $IMAGE_FORMAT, kernel version, the agent's SHA-256, its AGENT_FEATURES and, with a rootfs,
               ROOTFS_SHA256 and ROOTFS_SUITE

On success prints shell-style assignments on stdout:
  IMAGE_DIR=... VMLINUZ=... INITRAMFS=... KERNEL_VERSION=... [ROOTFS=...]

Options:
  --output DIR   output directory (default: \$COWORK_GUEST_IMAGE_DIR, else
                 <repo>/target/guest-image)
  --agent PATH   use this static agent binary instead of building it with
                 RUSTFLAGS='-C target-feature=+crt-static' cargo build --release
                 -p guest-agent --target $AGENT_TARGET
  --cache DIR    cache directory, passed to fetch-kernel.sh and mkrootfs.sh (default:
                 $(guest_cache_dir))
  --no-rootfs    no userland disk: an initramfs-only image (quick to build; sessions then
                 get the busybox userland); removes a rootfs.img left in DIR
  --quiet        no progress messages on stderr
  -h, --help     this text
USAGE
}

output="${COWORK_GUEST_IMAGE_DIR:-$COWORK_REPO_ROOT/target/guest-image}"
agent=""
cache_args=()
rootfs=1
while (($#)); do
	case "$1" in
	--output) output="${2:?--output needs a directory}"; shift 2 ;;
	--agent) agent="${2:?--agent needs a path}"; shift 2 ;;
	--cache) cache_args=(--cache "${2:?--cache needs a directory}"); shift 2 ;;
	--no-rootfs) rootfs=0; shift ;;
	--quiet) COWORK_QUIET=1; export COWORK_QUIET; shift ;;
	-h | --help) usage; exit 0 ;;
	*) usage >&2; die "unknown argument '$1'" ;;
	esac
done
output="$(abs_path "$output")"
need_cmd readelf "install binutils"
need_cmd sha256sum "install coreutils"

# --- kernel --------------------------------------------------------------------------------
quiet_args=()
[[ "${COWORK_QUIET:-0}" == 1 ]] && quiet_args=(--quiet)
kernel_vars="$("$SCRIPTS_DIR/fetch-kernel.sh" "${cache_args[@]}" "${quiet_args[@]}")" ||
	die "fetching the kernel failed (see above)"
KERNEL_VERSION="" VMLINUZ="" VMLINUX="" MODULES_DIR=""
while IFS='=' read -r key value; do
	case "$key" in
	KERNEL_VERSION) KERNEL_VERSION="$value" ;;
	VMLINUZ) VMLINUZ="$value" ;;
	VMLINUX) VMLINUX="$value" ;;
	MODULES_DIR) MODULES_DIR="$value" ;;
	esac
done <<<"$kernel_vars"
[[ -n "$KERNEL_VERSION" && -f "$VMLINUZ" && -d "$MODULES_DIR" ]] ||
	die "fetch-kernel.sh did not report a kernel, vmlinuz and module tree"

# --- default userland --------------------------------------------------------------------------
# Built (or found in the cache) before the agent, so a first run does its downloads up front.
ROOTFS="" ROOTFS_SHA256="" ROOTFS_SUITE=""
mkdir -p "$output"
if ((rootfs)); then
	rootfs_vars="$("$SCRIPTS_DIR/mkrootfs.sh" --output "$output" "${cache_args[@]}" "${quiet_args[@]}")" ||
		die "building the default userland failed (see above; --no-rootfs builds without it)"
	while IFS='=' read -r key value; do
		case "$key" in
		ROOTFS) ROOTFS="$value" ;;
		ROOTFS_SHA256) ROOTFS_SHA256="$value" ;;
		ROOTFS_SUITE) ROOTFS_SUITE="$value" ;;
		esac
	done <<<"$rootfs_vars"
	[[ -f "$ROOTFS" && -n "$ROOTFS_SHA256" ]] || die "mkrootfs.sh did not report an image and its SHA-256"
else
	rm -f "$output/rootfs.img" "$output/rootfs-info"
fi

# --- agent ---------------------------------------------------------------------------------
if [[ -z "$agent" ]]; then
	need_cmd cargo "install Rust (rustup) to build the agent, or pass --agent"
	note "building the static guest agent (release, $AGENT_TARGET)"
	target_dir="$(cd "$COWORK_REPO_ROOT" && cargo metadata --format-version 1 --no-deps |
		sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
	[[ -n "$target_dir" ]] || die "cannot find cargo's target directory"
	(cd "$COWORK_REPO_ROOT" &&
		RUSTFLAGS='-C target-feature=+crt-static' cargo build --release -p guest-agent \
			--bin "$AGENT_BIN" --target "$AGENT_TARGET" ${COWORK_QUIET:+--quiet}) >&2 ||
		die "building the agent failed (is the $AGENT_TARGET target installed? rustup target add $AGENT_TARGET)"
	agent="$target_dir/$AGENT_TARGET/release/$AGENT_BIN"
fi
[[ -x "$agent" ]] || die "agent binary '$agent' not found or not executable"
if readelf -l "$agent" 2>/dev/null | grep -q 'Requesting program interpreter'; then
	die "$agent is dynamically linked; it must be static to run as /init"
fi
# The initramfs gets the agent without its symbol table (0.8 of its 4.2 MB, which every boot
# copies into guest memory and the kernel unpacks); a backtrace from the guest then shows
# addresses, which addr2line maps with the unstripped build (image-info's AGENT_SHA256 is the
# unstripped binary's, so that build can be found).
shipped_agent="$output/.agent.stripped"
if command -v strip >/dev/null 2>&1 && strip --strip-all -o "$shipped_agent" "$agent"; then
	:
else
	note "strip (binutils) unavailable or failed: the agent ships with its symbols"
	cp -f "$agent" "$shipped_agent"
fi

# --- mkfs.ext4 for the session disk -----------------------------------------------------------
# The host's mke2fs as one self-contained directory, MKFS_DIR: the program (mkfs.ext4), its
# libraries, the dynamic loader (ld.so) and mke2fs.conf, all flat. The agent formats a blank
# session disk after the host's Setup, when the initramfs is gone and the userland may have no
# e2fsprogs: it copies this directory to /run first and runs the program through the loader
# with --library-path (guest_agent::agent::sessiondisk). busybox's applet links do not cover
# mkfs.ext4.
MKFS_DIR=/lib/cowork-mkfs
need_cmd ldd "install libc-bin"
mke2fs_bin="$(PATH="$PATH:/usr/sbin:/sbin" command -v mke2fs || true)"
[[ -n "$mke2fs_bin" && -x "$mke2fs_bin" ]] || die "mke2fs not found (apt-get install e2fsprogs)"
mkfs_adds=(--add "$mke2fs_bin:$MKFS_DIR/mkfs.ext4")
while read -r lib; do
	mkfs_adds+=(--add "$(readlink -f "$lib"):$MKFS_DIR/$(basename "$lib")")
done < <(ldd "$mke2fs_bin" | sed -n 's/.*=> \(\/[^ ]*\).*/\1/p')
loader="$(ldd "$mke2fs_bin" | sed -n 's/^[[:space:]]*\(\/[^ ]*ld-linux[^ ]*\) (0x.*/\1/p' | head -n1)"
[[ -n "$loader" ]] || die "cannot find the dynamic loader of $mke2fs_bin (ldd)"
mkfs_adds+=(--add "$(readlink -f "$loader"):$MKFS_DIR/ld.so")
[[ -f /etc/mke2fs.conf ]] && mkfs_adds+=(--add /etc/mke2fs.conf:$MKFS_DIR/mke2fs.conf)

# --- image ---------------------------------------------------------------------------------
note "building the initramfs ($KERNEL_VERSION)"
# Uncompressed: the kernel then only copies the cpio into its rootfs instead of inflating it
# first (gzip took about a second of a TCG boot; the loaders read ~11 MiB instead of ~4.5).
# No /sbin/modprobe: the agent loads every module itself (finit_module), and the only callers
# of the kernel's module autoloader are four crypto lookups of IPv6's segment-routing HMAC
# set-up (crypto-hmac(sha1), crypto-hmac(sha256) and their -all forms) during inet6_init. Each
# runs /sbin/modprobe as a usermode helper, which first waits for the initramfs to be unpacked:
# with busybox's modprobe there the boot thread then waited for four futile modprobe runs as
# well (~0.12 s of a nested boot); without it the exec fails at once (docs/boot.md).
"$SCRIPTS_DIR/mkinitramfs.sh" --output "$output/initramfs" --init "$shipped_agent" \
	--module-set guest --modules-dir "$MODULES_DIR" --compress none --omit-applet modprobe \
	"${mkfs_adds[@]}" ||
	die "building the initramfs failed (see above)"
rm -f "$shipped_agent"
cp -f "$VMLINUZ" "$output/vmlinuz.tmp"
mv -f "$output/vmlinuz.tmp" "$output/vmlinuz"
# The uncompressed ELF kernel: the kvm backend boots it through its PVH entry (no
# decompression in the guest); QEMU keeps booting vmlinuz.
if [[ -f "$VMLINUX" ]]; then
	# Kernels cached before fetch-kernel.sh dug holes get theirs now (the content is unchanged,
	# so a VM reading the file meanwhile sees the same bytes).
	dig_holes "$VMLINUX"
fi
if [[ "$output/vmlinux" -ef "$VMLINUX" ]]; then
	: # already a hard link of the cached kernel (a re-run); mv would refuse the same file
elif [[ -f "$VMLINUX" ]]; then
	ln -f "$VMLINUX" "$output/vmlinux.tmp" 2>/dev/null || cp -f "$VMLINUX" "$output/vmlinux.tmp"
	mv -f "$output/vmlinux.tmp" "$output/vmlinux"
else
	rm -f "$output/vmlinux"
fi
{
	printf '%s\n' "$IMAGE_FORMAT"
	printf 'KERNEL_VERSION=%s\n' "$KERNEL_VERSION"
	printf 'AGENT_SHA256=%s\n' "$(sha256sum "$agent" | cut -d' ' -f1)"
	# What the agent can do that the helper asks for (src/backend/image.rs).
	printf 'AGENT_FEATURES=template-console\n'
	if [[ -n "$ROOTFS" ]]; then
		printf 'ROOTFS_SHA256=%s\n' "$ROOTFS_SHA256"
		printf 'ROOTFS_SUITE=%s\n' "$ROOTFS_SUITE"
	fi
} >"$output/image-info.tmp"
mv -f "$output/image-info.tmp" "$output/image-info"

printf 'IMAGE_DIR=%s\n' "$output"
printf 'VMLINUZ=%s\n' "$output/vmlinuz"
printf 'INITRAMFS=%s\n' "$output/initramfs"
printf 'KERNEL_VERSION=%s\n' "$KERNEL_VERSION"
[[ -z "$ROOTFS" ]] || printf 'ROOTFS=%s\n' "$ROOTFS"
