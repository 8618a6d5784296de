#!/usr/bin/env bash
# Sets up a fresh Debian/Ubuntu machine to build, test and run cowork-helper:
# system packages, then a release build. Run as root or with sudo available.
set -euo pipefail

build=1
for arg in "$@"; do
    case "$arg" in
        --no-build) build=0 ;;
        -h|--help) echo "usage: scripts/setup.sh [--no-build]"; exit 0 ;;
        *) echo "setup: unknown option $arg" >&2; exit 2 ;;
    esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi

packages=(
    build-essential pkg-config  # C toolchain for ring (TLS) and the test guests
    util-linux                  # setpriv, used by the tests to act as another user
    qemu-system-x86             # QEMU backend and the nested-KVM test harness
    busybox-static cpio zstd xz-utils  # guest initramfs
    lz4                         # fetch-kernel.sh: the Debian kernel's payload is LZ4 (vmlinux)
    e2fsprogs                   # mke2fs for the guest image; e2fsck/debugfs in the disk tests
    git tar                     # real programs the virtio-fs tests run over /dev/fuse
)

export DEBIAN_FRONTEND=noninteractive
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: Rust is missing: install Rust 1.85 or newer with rustup, then re-run this script" >&2
    exit 1
fi

# Guest kernel and initramfs tooling (cached; offline once fetched).
if [ -x "$here/scripts/fetch-kernel.sh" ]; then
    "$here/scripts/fetch-kernel.sh"
fi

if [ "$build" = 1 ]; then
    cargo build --release --manifest-path "$here/Cargo.toml" --workspace
    echo "setup: done; the helper is $here/target/release/cowork-helper"
fi
