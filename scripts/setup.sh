#!/usr/bin/env bash
# Sets up a fresh Debian/Ubuntu machine to build, test and run cowork-helper: system packages,
# the guest kernel, the guest image with its default Debian userland (rootfs.img), and a release
# build of the helper. Run as root or with sudo available for apt-get; the userland is built
# rootless when run as a user (mmdebstrap unshare mode, needs /etc/subuid and /etc/subgid ranges).
# Every step is cached: a second run is quick and offline.
set -euo pipefail

usage() {
	cat <<'USAGE'
Usage: scripts/setup.sh [--no-build] [--no-image] [--no-rootfs]

Installs the system packages, fetches the guest kernel, builds the guest image
(target/guest-image: kernel, initramfs with the static agent, and rootfs.img, the Debian
userland sessions run in; the first build downloads Debian packages and takes
a few minutes), then builds the helper in release mode.

  --no-build    skip the release build of the helper (the guest image is still built)
  --no-image    skip the guest image (VM backends then have nothing to boot)
  --no-rootfs   build the guest image without rootfs.img (initramfs-only: sessions get the
                busybox userland; quick)
  -h, --help    this text
USAGE
}

build=1
image=1
image_args=()
for arg in "$@"; do
	case "$arg" in
	--no-build) build=0 ;;
	--no-image) image=0 ;;
	--no-rootfs) image_args+=(--no-rootfs) ;;
	-h | --help) usage; exit 0 ;;
	*) echo "setup: unknown option $arg" >&2; usage >&2; exit 2 ;;
	esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
	sudo="sudo"
fi

packages=(
	build-essential pkg-config  # C toolchain for ring (TLS) and the test guests
	util-linux                  # setpriv, used by the tests to act as another user; unshare
	qemu-system-x86             # QEMU backend and the nested-KVM test harness
	busybox-static cpio zstd xz-utils  # guest initramfs
	lz4                         # fetch-kernel.sh: the Debian kernel's payload is LZ4 (vmlinux)
	e2fsprogs                   # mke2fs for the guest image; e2fsck/debugfs in the disk tests
	git tar                     # real programs the virtio-fs tests run over /dev/fuse
	dpkg-dev                    # build-deb.sh: dpkg-shlibdeps computes the package's Depends
	mmdebstrap                  # mkrootfs.sh: the Debian userland of the guest image;
	                            # tests/package_deb.rs: the throwaway roots it installs into
	uidmap                      # newuidmap/newgidmap: mmdebstrap's rootless (unshare) mode
	debian-archive-keyring      # verifies the Debian archive mmdebstrap installs from
	fdisk                       # sfdisk: the client-style GPT bundle of tests/qemu_userland.rs
	iproute2 curl               # tests/egress_netns.rs: veth pairs, curl as a real proxy client
	openssl python3             # tests/egress_vm.rs: test certificate, HTTPS/UDP test servers,
	                            # python urllib in sandbox sessions
)
# node: sandbox sessions' `fetch` in tests/egress_vm.rs (the host's node; any source will do).
if ! command -v node >/dev/null 2>&1; then
	packages+=(nodejs)
fi
# npm fetches the Claude Code CLI for the tests (scripts/fetch-claude-cli.sh). Only installed
# when missing: a node from another source already brings its own npm, and Debian's npm
# package would want Debian's nodejs instead.
if ! command -v npm >/dev/null 2>&1; then
	packages+=(npm)
fi

export DEBIAN_FRONTEND=noninteractive
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
	$sudo apt-get update -qq
	$sudo apt-get install -y -qq --no-install-recommends "${packages[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
	echo "setup: Rust is missing: install Rust 1.85 or newer with rustup, then re-run this script" >&2
	exit 1
fi

# Guest kernel (cached; offline once fetched).
"$here/scripts/fetch-kernel.sh" >/dev/null

# Guest image with the default userland (cached; offline once built). mkguestimage.sh builds the
# static agent itself.
if [ "$image" = 1 ]; then
	start=$SECONDS
	image_vars="$("$here/scripts/mkguestimage.sh" "${image_args[@]}")"
	echo "setup: guest image in $(printf '%s\n' "$image_vars" | sed -n 's/^IMAGE_DIR=//p') ($((SECONDS - start)) s)"
fi

if [ "$build" = 1 ]; then
	cargo build --release --manifest-path "$here/Cargo.toml" --workspace
	echo "setup: done; the helper is $here/target/release/cowork-helper"
fi
