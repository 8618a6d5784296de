#!/usr/bin/env bash
# Build the Debian package of cowork-helper (target/debian/cowork-helper_<version>_<arch>.deb)
# with dpkg-deb from a staged tree: the helper, the guest kernel and initramfs (no userland),
# the client's helper path as a symlink to ours with the maintainer scripts that divert the
# client's own helper, a udev rule and a modules-load.d entry for /dev/vhost-vsock, and an
# AppArmor profile. Build inputs come from crates.io (cargo) and the Debian archive (the
# kernel, busybox, e2fsprogs) only. Progress goes to stderr; the last line of stdout is the
# .deb's path.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
SCRIPTS_DIR="$COWORK_REPO_ROOT/scripts"
PACKAGING_DIR="$COWORK_REPO_ROOT/packaging"

PACKAGE=cowork-helper
CLIENT_HELPER=usr/lib/claude-desktop/resources/cowork-linux-helper
IMAGE_FORMAT=cowork-guest-image/1
IMAGE_DEST=usr/lib/cowork-helper/guest-image

usage() {
	cat <<USAGE
Usage: $COWORK_SCRIPT_NAME [--helper PATH] [--image-dir DIR] [--version V] [--output DIR]
                    [--maintainer 'NAME <EMAIL>'] [--compression TYPE] [--no-strip] [--quiet]

Builds ${PACKAGE}_<version>_<arch>.deb and prints its path as the last line of stdout.

The package holds:
  /usr/bin/cowork-helper                   the helper (stripped)
  /$IMAGE_DEST/  vmlinuz, vmlinux (when the image has one), initramfs and
                                           image-info: the guest image without its userland
                                           (no rootfs.img: 'cowork-helper image build' makes
                                           that in /var/lib/cowork-helper)
  /$CLIENT_HELPER
                                           a symlink to /usr/bin/cowork-helper; preinst
                                           diverts the client's own helper to
                                           cowork-linux-helper.official, postrm puts it back
  /usr/lib/udev/rules.d/70-cowork-helper.rules   /dev/vhost-vsock for the logged-in user
  /usr/lib/modules-load.d/cowork-helper.conf     loads vhost_vsock at boot
  /usr/share/cowork-helper/apparmor/cowork-helper
                                           AppArmor 4 profile allowing user namespaces;
                                           postinst installs it in /etc/apparmor.d where
                                           AppArmor 4 is present (also when it comes later:
                                           a trigger on /etc/apparmor.d/abi)
  /usr/share/doc/cowork-helper/copyright

Depends: is computed with dpkg-shlibdeps; Recommends: names what the client's own support
check looks for (QEMU, OVMF, virtiofsd) and what 'image build' needs (mmdebstrap,
debian-archive-keyring, uidmap).

Options:
  --helper PATH    package this helper binary instead of running
                   cargo build --release --bin cowork-helper
  --image-dir DIR  take vmlinuz, vmlinux, initramfs and image-info from this guest image
                   directory (e.g. target/guest-image; its rootfs.img is left out); default:
                   scripts/mkguestimage.sh --no-rootfs into a staging directory
  --version V      package version (default: the workspace Cargo.toml's, with a
                   pre-release '-' as '~')
  --output DIR     where the .deb goes (default: <repo>/target/debian)
  --maintainer M   the Maintainer field (default: \$DEBFULLNAME <\$DEBEMAIL> when set, else
                   the author of the repository's last commit)
  --compression T  dpkg-deb's compression of the files: xz (default; every dpkg reads it),
                   zstd, gzip (quick, for tests) or none
  --no-strip       keep the helper's symbols
  --quiet          no progress messages on stderr
  -h, --help       this text

SOURCE_DATE_EPOCH (default: the last commit's time) sets every file's time in the package;
owners are root:root, directories 0755, files 0644, the helper 0755.
USAGE
}

helper=""
image_dir=""
version=""
output="$COWORK_REPO_ROOT/target/debian"
maintainer=""
strip_helper=1
compression=xz
while (($#)); do
	case "$1" in
	--helper) helper="${2:?--helper needs a path}"; shift 2 ;;
	--image-dir) image_dir="${2:?--image-dir needs a directory}"; shift 2 ;;
	--version) version="${2:?--version needs a version}"; shift 2 ;;
	--output) output="${2:?--output needs a directory}"; shift 2 ;;
	--maintainer) maintainer="${2:?--maintainer needs 'NAME <EMAIL>'}"; shift 2 ;;
	--compression) compression="${2:?--compression needs xz, zstd, gzip or none}"; shift 2 ;;
	--no-strip) strip_helper=0; shift ;;
	--quiet) COWORK_QUIET=1; export COWORK_QUIET; shift ;;
	-h | --help) usage; exit 0 ;;
	*) usage >&2; die "unknown argument '$1'" ;;
	esac
done
output="$(abs_path "$output")"
case "$compression" in
xz | zstd | gzip | none) ;;
*) die "--compression must be xz, zstd, gzip or none, not '$compression'" ;;
esac
[[ -z "$helper" ]] || helper="$(abs_path "$helper")"
[[ -z "$image_dir" ]] || image_dir="$(abs_path "$image_dir")"

need_cmd dpkg-deb "apt-get install dpkg"
need_cmd dpkg-shlibdeps "apt-get install dpkg-dev"
need_cmd readelf "apt-get install binutils"
need_cmd md5sum "apt-get install coreutils"

# --- version, architecture, maintainer -----------------------------------------------------
if [[ -z "$version" ]]; then
	version="$(awk '/^\[/ { section = $0 } section == "[package]" && $1 == "version" {
		gsub(/[" ]/, "", $3); print $3; exit }' "$COWORK_REPO_ROOT/Cargo.toml")"
	[[ -n "$version" ]] || die "no version in $COWORK_REPO_ROOT/Cargo.toml's [package]; pass --version"
	# Cargo's 1.2.0-rc.1 sorts before 1.2.0; Debian's 1.2.0~rc.1 does, 1.2.0-rc.1 does not.
	version="${version/-/\~}"
fi
[[ "$version" =~ ^[0-9][A-Za-z0-9.+~]*(-[A-Za-z0-9.+~]+)?$ ]] ||
	die "'$version' is not a Debian version (digits first, then letters, digits and . + ~)"
arch="$(dpkg --print-architecture)"
case "$arch" in
amd64) elf_machine="X86-64"; qemu_pkg=qemu-system-x86; firmware_pkg=ovmf ;;
arm64) elf_machine="AArch64"; qemu_pkg=qemu-system-arm; firmware_pkg=qemu-efi-aarch64 ;;
*) die "no package recipe for architecture '$arch' (amd64 and arm64 only)" ;;
esac
if [[ -z "$maintainer" ]]; then
	if [[ -n "${DEBEMAIL:-}" ]]; then
		maintainer="${DEBFULLNAME:-cowork-helper maintainers} <$DEBEMAIL>"
	else
		maintainer="$(git -C "$COWORK_REPO_ROOT" log -1 --format='%an <%ae>' 2>/dev/null || true)"
	fi
fi
[[ "$maintainer" =~ ^[^\<\>]+\ \<[^\<\>@]+@[^\<\>]+\>$ ]] ||
	die "maintainer '$maintainer' is not 'NAME <EMAIL>'; pass --maintainer or set DEBFULLNAME and DEBEMAIL"
if [[ -z "${SOURCE_DATE_EPOCH:-}" ]]; then
	SOURCE_DATE_EPOCH="$(git -C "$COWORK_REPO_ROOT" log -1 --format=%ct 2>/dev/null || true)"
	SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-0}"
fi
[[ "$SOURCE_DATE_EPOCH" =~ ^[0-9]+$ ]] || die "SOURCE_DATE_EPOCH='$SOURCE_DATE_EPOCH' is not a number of seconds"
export SOURCE_DATE_EPOCH

# --- staging -------------------------------------------------------------------------------
mkdir -p "$output"
umask 022
work="$(mktemp -d "$output/.build-${PACKAGE}.XXXXXX")"
trap 'rm -rf "$work"' EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
root="$work/root"
mkdir -p "$root/DEBIAN"

# --- the helper ----------------------------------------------------------------------------
if [[ -z "$helper" ]]; then
	need_cmd cargo "install Rust (rustup) to build the helper, or pass --helper"
	note "building the helper (cargo build --release)"
	(cd "$COWORK_REPO_ROOT" && cargo build --release --bin cowork-helper ${COWORK_QUIET:+--quiet}) >&2 ||
		die "building the helper failed (see above)"
	target_dir="$(cd "$COWORK_REPO_ROOT" && cargo metadata --format-version 1 --no-deps |
		sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
	[[ -n "$target_dir" ]] || die "cannot find cargo's target directory"
	helper="$target_dir/release/cowork-helper"
fi
[[ -f "$helper" && -x "$helper" ]] || die "helper binary '$helper' not found or not executable"
machine="$(readelf -h "$helper" 2>/dev/null | sed -n 's/^ *Machine: *//p')"
[[ -n "$machine" ]] || die "'$helper' is not an ELF executable"
[[ "$machine" == *"$elf_machine"* ]] ||
	die "'$helper' is built for '$machine', not for $arch ($elf_machine)"
install -d "$root/usr/bin"
if ((strip_helper)); then
	need_cmd strip "apt-get install binutils, or pass --no-strip"
	# What dh_strip does to a program.
	strip --strip-unneeded --remove-section=.comment --remove-section=.note \
		-o "$root/usr/bin/cowork-helper" "$helper" || die "strip failed on '$helper'"
else
	cp "$helper" "$root/usr/bin/cowork-helper"
fi
chmod 0755 "$root/usr/bin/cowork-helper"

# --- the guest image, without its userland ---------------------------------------------------
if [[ -z "$image_dir" ]]; then
	# mkguestimage.sh --no-rootfs deletes a rootfs.img in its output directory: give it one
	# of ours.
	image_dir="$work/guest-image"
	note "building the initramfs-only guest image (scripts/mkguestimage.sh --no-rootfs)"
	quiet_args=()
	[[ "${COWORK_QUIET:-0}" == 1 ]] && quiet_args=(--quiet)
	"$SCRIPTS_DIR/mkguestimage.sh" --no-rootfs --output "$image_dir" "${quiet_args[@]}" >/dev/null ||
		die "building the guest image failed (see above)"
fi
for f in vmlinuz initramfs image-info; do
	[[ -f "$image_dir/$f" ]] ||
		die "$image_dir/$f is missing: not a guest image (build one with scripts/mkguestimage.sh)"
done
[[ "$(head -n1 "$image_dir/image-info")" == "$IMAGE_FORMAT" ]] ||
	die "$image_dir/image-info does not start with $IMAGE_FORMAT: not a guest image of ours"
install -d "$root/$IMAGE_DEST"
install -m 0644 "$image_dir/vmlinuz" "$image_dir/initramfs" "$root/$IMAGE_DEST/"
[[ ! -f "$image_dir/vmlinux" ]] || install -m 0644 "$image_dir/vmlinux" "$root/$IMAGE_DEST/"
# The package has no rootfs.img: its image-info says so, as mkguestimage.sh --no-rootfs's does.
grep -v '^ROOTFS_' "$image_dir/image-info" >"$root/$IMAGE_DEST/image-info"
kernel_version="$(sed -n 's/^KERNEL_VERSION=//p' "$image_dir/image-info")"

# --- the client's helper path, udev, modules, AppArmor ---------------------------------------
install -d "$root/$(dirname "$CLIENT_HELPER")"
ln -s ../../../bin/cowork-helper "$root/$CLIENT_HELPER"
[[ "$(readlink -m "$root/$CLIENT_HELPER")" == "$root/usr/bin/cowork-helper" ]] ||
	die "the client helper symlink does not resolve to /usr/bin/cowork-helper (a bug)"
# The texts are packaging/'s, shared with `cowork-helper install`.
install -D -m 0644 "$PACKAGING_DIR/70-cowork-helper.rules" "$root/usr/lib/udev/rules.d/70-cowork-helper.rules"
install -D -m 0644 "$PACKAGING_DIR/modules-load.conf" "$root/usr/lib/modules-load.d/cowork-helper.conf"
install -d "$root/usr/share/cowork-helper/apparmor"
sed 's|@HELPER@|/usr/bin/cowork-helper|g' "$PACKAGING_DIR/apparmor.in" \
	>"$root/usr/share/cowork-helper/apparmor/cowork-helper"
grep -q '^profile cowork-helper /usr/bin/cowork-helper ' "$root/usr/share/cowork-helper/apparmor/cowork-helper" ||
	die "$PACKAGING_DIR/apparmor.in gave no profile attached to /usr/bin/cowork-helper"

# --- copyright -------------------------------------------------------------------------------
# The initramfs carries Debian's busybox-static and mke2fs with the libraries it loads, the
# kernel is Debian's: name their source packages (their source is in the Debian archive).
source_of() {
	dpkg-query -W -f='${source:Package} ${source:Version}\n' "$1" 2>/dev/null | head -n1
}
guest_sources=()
for pkg in busybox-static e2fsprogs; do
	s="$(source_of "$pkg")"
	[[ -z "$s" ]] || guest_sources+=("$s")
done
mke2fs_bin="$(PATH="$PATH:/usr/sbin:/sbin" command -v mke2fs || true)"
if [[ -n "$mke2fs_bin" ]] && command -v ldd >/dev/null 2>&1; then
	# The libraries and the loader, as mkguestimage.sh copies them. dpkg knows a library by
	# the path its package ships (/lib/... on a merged-/usr system), so ask for both names.
	while read -r lib; do
		pkg=""
		for name in "$lib" "$(readlink -f "$lib")"; do
			pkg="$(dpkg-query -S "$name" 2>/dev/null | head -n1 | cut -d: -f1)" || pkg=""
			[[ -z "$pkg" ]] || break
		done
		[[ -z "$pkg" ]] || guest_sources+=("$(source_of "$pkg")")
	done < <(ldd "$mke2fs_bin" | sed -n 's/.*=> \(\/[^ ]*\).*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) (0x.*/\1/p')
fi
install -d "$root/usr/share/doc/$PACKAGE"
{
	cat <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: cowork-helper

Files: *
Copyright: the cowork-helper authors
License: Apache-2.0
Comment: The helper links the Rust crates listed in the source's Cargo.lock statically (from
 crates.io, each under its own licence, mostly MIT or Apache-2.0).

Files: $IMAGE_DEST/*
Copyright: the Linux kernel, BusyBox, e2fsprogs and GNU C library authors
License: GPL-2 and LGPL-2.1+
Comment: vmlinuz and vmlinux are Debian's Linux kernel ${kernel_version:-(version in image-info)}
 (linux-image-${kernel_version:-*}, source package linux). The initramfs holds the
 cowork-helper guest agent (Apache-2.0), Debian's busybox-static, and e2fsprogs' mke2fs with
 the shared libraries it loads, built from these Debian source packages (as installed on
 the build host; their copyright files name every licence: mostly GPL-2, LGPL-2.1+, BSD):
COPYRIGHT
	if ((${#guest_sources[@]})); then
		printf '%s\n' "${guest_sources[@]}" | sort -u | sed 's/^/ /'
	else
		echo " (not found in this build host's dpkg database: busybox-static, e2fsprogs)"
	fi
	cat <<COPYRIGHT
 Their source code is in the Debian archive (https://deb.debian.org, and
 https://snapshot.debian.org for every version ever published).

License: Apache-2.0
 Licensed under the Apache License, Version 2.0 (the "License"); you may not use this file
 except in compliance with the License. You may obtain a copy of the License at
 https://www.apache.org/licenses/LICENSE-2.0
 .
 On Debian systems, the full text of the Apache License version 2.0 can be found in the file
 /usr/share/common-licenses/Apache-2.0.

License: GPL-2
 On Debian systems, the full text of the GNU General Public License version 2 can be found
 in the file /usr/share/common-licenses/GPL-2.

License: LGPL-2.1+
 On Debian systems, the full text of the GNU Lesser General Public License version 2.1 can
 be found in the file /usr/share/common-licenses/LGPL-2.1.
COPYRIGHT
} >"$root/usr/share/doc/$PACKAGE/copyright"

# --- control ---------------------------------------------------------------------------------
# dpkg-shlibdeps wants a debian/control to read; it needs nothing from it but a package stanza.
mkdir -p "$work/src/debian"
printf 'Source: %s\n\nPackage: %s\nArchitecture: any\n' "$PACKAGE" "$PACKAGE" >"$work/src/debian/control"
shlibs="$(cd "$work/src" && dpkg-shlibdeps -O -e"$root/usr/bin/cowork-helper" 2>"$work/shlibdeps.err")" || {
	cat "$work/shlibdeps.err" >&2
	die "dpkg-shlibdeps failed on the helper (see above)"
}
depends="$(printf '%s\n' "$shlibs" | sed -n 's/^shlibs:Depends=//p')"
[[ -n "$depends" ]] || die "dpkg-shlibdeps found no dependency of the helper (is it static?): $shlibs"

# dpkg-gencontrol's rule: 1 KiB per directory and symlink, the size rounded up for files.
installed_size="$(find "$root" -path "$root/DEBIAN" -prune -o -printf '%y %s\n' |
	awk '$1 == "f" { kib += int(($2 + 1023) / 1024); next } { kib += 1 } END { print kib }')"

cat >"$root/DEBIAN/control" <<CONTROL
Package: $PACKAGE
Version: $version
Architecture: $arch
Maintainer: $maintainer
Installed-Size: $installed_size
Depends: $depends
Recommends: $qemu_pkg, $firmware_pkg, virtiofsd | qemu-system-common, mmdebstrap, debian-archive-keyring, uidmap
Enhances: claude-desktop
Section: utils
Priority: optional
Description: microVM helper for Claude desktop's Cowork sessions on Linux
 cowork-helper runs the Cowork sessions of the Claude desktop app in a Linux guest under
 its own in-process KVM machine, under QEMU, or in a namespace sandbox. The guest kernel
 and initramfs are included; the Debian userland is not: the client's bundle is used, or
 'cowork-helper image build' makes one (with mmdebstrap, debian-archive-keyring and
 uidmap).
 .
 The package puts the helper where the client starts it
 (/usr/lib/claude-desktop/resources/cowork-linux-helper): the client's own helper is
 diverted to cowork-linux-helper.official, whether the client is installed before or
 after this package, and across upgrades of either; removing this package puts it back.
 .
 The client's own support check looks for QEMU, OVMF, virtiofsd, /dev/kvm and
 /dev/vhost-vsock before it ever starts a helper, so the packages providing them are
 recommended although the kvm backend uses none of them; the package loads vhost_vsock
 at boot and gives the logged-in user access to /dev/vhost-vsock as to /dev/kvm. Where
 AppArmor 4 restricts unprivileged user namespaces (Ubuntu 24.04), it installs a profile
 that lets the helper's sandbox create them.
CONTROL

for script in preinst postinst postrm; do
	install -m 0755 "$PACKAGING_DIR/deb/$script" "$root/DEBIAN/$script"
done
# postinst installs or removes the AppArmor profile when AppArmor 4 comes or goes after us.
install -m 0644 "$PACKAGING_DIR/deb/triggers" "$root/DEBIAN/triggers"
(cd "$root" && find usr -type f -print0 | LC_ALL=C sort -z | xargs -0 md5sum) >"$root/DEBIAN/md5sums"
chmod 0644 "$root/DEBIAN/control" "$root/DEBIAN/md5sums"
find "$root" -type d -exec chmod 0755 {} +
find "$root" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

# --- build -----------------------------------------------------------------------------------
deb="$output/${PACKAGE}_${version}_${arch}.deb"
note "packing $deb ($compression)"
# dpkg-deb says which package it builds on stdout: progress, so stderr (or nowhere with --quiet).
if [[ "${COWORK_QUIET:-0}" == 1 ]]; then progress=/dev/null; else progress=/dev/stderr; fi
dpkg-deb --root-owner-group -Z"$compression" --build "$root" "$work/package.deb" >"$progress" ||
	die "dpkg-deb failed (see above)"
mv -f "$work/package.deb" "$deb"
note "built $deb ($(stat -c %s "$deb") bytes; installed $installed_size KiB; Depends: $depends)"
printf '%s\n' "$deb"
