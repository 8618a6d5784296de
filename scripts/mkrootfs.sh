#!/usr/bin/env bash
# Build the default guest userland: a minimal Debian tree made by mmdebstrap from Debian's
# packages, packed into a read-only ext4 image (no journal, label cowork-rootfs) that the guest
# agent mounts as the lower layer of its overlay root. Cached in the guest cache, keyed by suite,
# package list and recipe version; offline once built.
#
# Limits: amd64 only (the guest kernel is amd64); needs a Debian mirror reachable through the
# host's apt sources (or --mirror) on the first build; the image is meant to be attached
# read-only and has no slack worth writing into.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

# Version of this recipe (hooks, dpkg excludes, image layout). Part of the cache key: bump it
# whenever a change here must produce a different image for the same suite and packages.
RECIPE_VERSION=1
# Debian release of the userland: trixie (13) has node 20, python 3.13 and git 2.47; the host's
# bookworm archive keyring already holds trixie's keys.
DEFAULT_SUITE=trixie
# First line of rootfs-info; readers check it before trusting the other lines.
INFO_FORMAT=cowork-rootfs-info/1
# Filesystem label; the agent and guest_agent::proto::ROOTFS_LABEL use the same string.
LABEL=cowork-rootfs
# Host name written into the image (/etc/hostname, /etc/hosts).
GUEST_HOSTNAME=claude
# ext4 block size: 4 KiB, the kernel's page size, for the fewest indirections on reads.
BLOCK_SIZE=4096
# Free space left after shrinking the filesystem to its minimum, in MiB: room for e2fsck and a
# future `resize2fs`, not for writes (the image is attached read-only).
SLACK_MIB=16
# Packages installed on top of mmdebstrap's minbase variant. What sessions run: GNU bash (the
# CLI refuses other shells), python3 with pip and venv, node and npm, git, curl, and the small
# tools the client's skills and the model's commands expect. ripgrep is also embedded in the
# CLI; the system one serves the model's own shell commands.
PACKAGES=(
	bash ca-certificates curl git python3 python3-pip python3-venv nodejs npm procps less file
	xz-utils unzip zip bzip2 jq patch openssh-client iproute2 netbase tzdata ripgrep locales
)
# Packages that must not be in the image: no init system (the agent is PID 1), and no
# bubblewrap/socat, whose presence makes the CLI wrap every Bash-tool command in its own
# sandbox, which fails in the VM (the VM is the sandbox).
FORBIDDEN_PACKAGES=(systemd systemd-sysv bubblewrap socat)
# Files the image must have for sessions to work (checked after the build).
REQUIRED_FILES=(
	usr/bin/bash usr/bin/python3 usr/bin/node usr/bin/npm usr/bin/git usr/bin/curl usr/bin/jq
	usr/bin/file usr/bin/rg usr/sbin/useradd usr/lib64/ld-linux-x86-64.so.2 usr/lib/locale/C.utf8
	etc/os-release
)
# dpkg path filters: no manual pages, documentation, translations or info pages, but the
# copyright files (licence terms travel with the binaries) and locale.alias (read by glibc).
DPKG_OPTS=(
	'path-exclude=/usr/share/man/*'
	'path-exclude=/usr/share/doc/*'
	'path-include=/usr/share/doc/*/copyright'
	'path-exclude=/usr/share/locale/*'
	'path-include=/usr/share/locale/locale.alias'
	'path-exclude=/usr/share/info/*'
)

usage() {
	cat <<USAGE
Usage: $COWORK_SCRIPT_NAME [--output DIR] [--cache DIR] [--suite NAME] [--mirror URI]
                   [--security-mirror URI|none] [--refresh] [--quiet]

Builds the default guest userland with 'mmdebstrap --variant=minbase' (Debian $DEFAULT_SUITE
unless --suite) plus:
  ${PACKAGES[*]}
and packs it into a read-only ext4 image without a journal, label '$LABEL', shrunk to its
minimum plus $SLACK_MIB MiB. Never contains: ${FORBIDDEN_PACKAGES[*]}.

As root mmdebstrap runs in root mode; otherwise in unshare mode, which needs 'uidmap'
(newuidmap/newgidmap) and ranges for the user in /etc/subuid and /etc/subgid.

Results are cached under <cache>/rootfs/<suite>-<key>/ (key = hash of suite, package list and
recipe version $RECIPE_VERSION): rootfs.img, rootfs-info, packages (installed name=version).
Once built, later runs are offline and print the same assignments.

On success prints shell-style assignments on stdout:
  ROOTFS=<image> ROOTFS_INFO=<info file> ROOTFS_SIZE=<apparent bytes> ROOTFS_SHA256=<hex>
  ROOTFS_SUITE=<suite>

Options:
  --output DIR     also place rootfs.img and rootfs-info in DIR (hard links to the cache when
                   on the same filesystem, else sparse copies); ROOTFS then names DIR's copy
  --cache DIR      cache directory (default: \$COWORK_GUEST_CACHE, else
                   \$XDG_CACHE_HOME/cowork-helper/guest, else <repo>/target/guest-cache;
                   now: $(guest_cache_dir))
  --suite NAME     Debian suite (default: $DEFAULT_SUITE)
  --mirror URI     Debian archive to install from (default: the first Debian archive in the
                   host's apt sources)
  --security-mirror URI|none
                   security archive for <suite>-security (default: the one in the host's apt
                   sources; 'none' leaves security updates out)
  --refresh        build again even if the image is cached
  --quiet          no progress messages on stderr
  -h, --help       this text
USAGE
}

output=""
cache=""
suite="$DEFAULT_SUITE"
mirror=""
security_mirror=""
refresh=0
while (($#)); do
	case "$1" in
	--output) output="${2:?--output needs a directory}"; shift 2 ;;
	--cache) cache="${2:?--cache needs a directory}"; shift 2 ;;
	--suite) suite="${2:?--suite needs a name}"; shift 2 ;;
	--mirror) mirror="${2:?--mirror needs a URI}"; shift 2 ;;
	--security-mirror) security_mirror="${2:?--security-mirror needs a URI or none}"; shift 2 ;;
	--refresh) refresh=1; shift ;;
	--quiet) COWORK_QUIET=1; shift ;;
	-h | --help) usage; exit 0 ;;
	*) usage >&2; die "unknown argument '$1'" ;;
	esac
done
[[ "$suite" =~ ^[a-z][a-z0-9.-]*$ ]] || die "'$suite' does not look like a Debian suite name"
cache="$(abs_path "${cache:-$(guest_cache_dir)}")"
[[ -z "$output" ]] || output="$(abs_path "$output")"

need_cmd sha256sum "install coreutils"

# --- cache key -----------------------------------------------------------------------------
key="$(printf 'recipe=%s\nsuite=%s\npackages=%s\nforbidden=%s\ndpkg=%s\n' \
	"$RECIPE_VERSION" "$suite" "$(printf '%s\n' "${PACKAGES[@]}" | sort | tr '\n' ' ')" \
	"${FORBIDDEN_PACKAGES[*]}" "${DPKG_OPTS[*]}" | sha256sum | cut -c1-16)"
entry="$cache/rootfs/$suite-$key"

# Read KEY=value from an info file.
info_value() {
	sed -n "s/^$2=//p" "$1" | head -n1
}

# Place $1 at $2: a hard link when both are on one filesystem, else a sparse copy. Written
# under a temporary name and renamed, so a reader never sees half a file.
place() {
	local src="$1" dst="$2" tmp="$2.tmp.$$"
	rm -f "$tmp"
	if ! ln "$src" "$tmp" 2>/dev/null; then
		cp --sparse=always "$src" "$tmp"
	fi
	mv -f "$tmp" "$dst"
}

print_result() {
	local img="$entry/rootfs.img" info="$entry/rootfs-info"
	if [[ -n "$output" ]]; then
		mkdir -p "$output"
		# A hard link to this image, or a copy made with this very info file, is kept as it
		# is: no 600 MB copy per run, and a running VM's open file stays what it was.
		if ! [[ "$output/rootfs.img" -ef "$img" ]] &&
			! { cmp -s "$info" "$output/rootfs-info" &&
				[[ "$(stat -c %s "$output/rootfs.img" 2>/dev/null)" == "$(stat -c %s "$img")" ]]; }; then
			place "$img" "$output/rootfs.img"
		fi
		cp -f "$info" "$output/rootfs-info.tmp.$$"
		mv -f "$output/rootfs-info.tmp.$$" "$output/rootfs-info"
		img="$output/rootfs.img"
		info="$output/rootfs-info"
	fi
	printf 'ROOTFS=%s\n' "$img"
	printf 'ROOTFS_INFO=%s\n' "$info"
	printf 'ROOTFS_SIZE=%s\n' "$(info_value "$info" IMAGE_BYTES)"
	printf 'ROOTFS_SHA256=%s\n' "$(info_value "$info" IMAGE_SHA256)"
	printf 'ROOTFS_SUITE=%s\n' "$(info_value "$info" SUITE)"
}

# Fast path: built before, no refresh asked for. Touches neither apt nor the network.
if ((refresh == 0)) && [[ -e "$entry/.complete" ]]; then
	note "using the cached image $entry/rootfs.img"
	print_result
	exit 0
fi

# --- tools ---------------------------------------------------------------------------------
export PATH="$PATH:/usr/sbin:/sbin"
need_cmd mmdebstrap "apt-get install mmdebstrap (scripts/setup.sh does)"
need_cmd mkfs.ext4 "apt-get install e2fsprogs"
need_cmd resize2fs "apt-get install e2fsprogs"
need_cmd e2fsck "apt-get install e2fsprogs"
need_cmd dumpe2fs "apt-get install e2fsprogs"
need_cmd tar "apt-get install tar"
if ((EUID == 0)); then
	mode=root
	# Runs a command as the owner of the extracted tree: root already is.
	as_tree_owner() { "$@"; }
else
	mode=unshare
	need_cmd newuidmap "apt-get install uidmap (rootless builds need newuidmap/newgidmap)"
	need_cmd unshare "apt-get install util-linux"
	unshare --help 2>/dev/null | grep -q -- --map-auto ||
		die "rootless build: this unshare has no --map-auto (util-linux 2.38+, Debian 12 or newer); run as root instead"
	me="$(id -un)"
	if ! grep -q "^$me:" /etc/subuid 2>/dev/null || ! grep -q "^$me:" /etc/subgid 2>/dev/null; then
		die "rootless build: user '$me' has no range in /etc/subuid and /etc/subgid (as root: usermod --add-subuids 100000-165535 --add-subgids 100000-165535 $me)"
	fi
	# In a user namespace whose root is this user and whose ids 1..65535 are the user's
	# subordinate range: the tarball's numeric owners (as the packages set them) are then
	# the owners this namespace sees, which are what mkfs.ext4 -d records.
	as_tree_owner() {
		unshare --map-auto --map-root-user --mount -- "$@"
	}
fi

# --- mirrors from the host's apt sources -----------------------------------------------------
# Print "URI suite" for every deb source of the host (deb822 .sources and one-line .list).
host_sources() {
	local f
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
		[[ -f "$f" ]] || continue
		awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
			print $i, $(i + 1) }' "$f"
	done
	for f in /etc/apt/sources.list.d/*.sources; do
		[[ -f "$f" ]] || continue
		awk 'function flush() { if (deb && enabled) for (u in uris) for (s in suites) print uris[u], suites[s]
				deb = 0; enabled = 1; split("", uris); split("", suites) }
			BEGIN { enabled = 1 }
			/^[[:space:]]*$/ { flush(); next }
			/^#/ { next }
			tolower($1) == "types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
			tolower($1) == "enabled:" { enabled = (tolower($2) != "no") }
			tolower($1) == "uris:" { for (i = 2; i <= NF; i++) uris[i] = $i }
			tolower($1) == "suites:" { for (i = 2; i <= NF; i++) suites[i] = $i }
			END { flush() }' "$f"
	done
}
if [[ -z "$mirror" ]]; then
	mirror="$(host_sources | awk '$2 !~ /-security$/ && $1 ~ /\/debian\/?$/ { print $1; exit }')"
	[[ -n "$mirror" ]] || die "no Debian archive in the host's apt sources; pass --mirror URI"
fi
if [[ -z "$security_mirror" ]]; then
	security_mirror="$(host_sources | awk '$2 ~ /-security$/ { print $1; exit }')"
	[[ -n "$security_mirror" ]] || warn "no security archive in the host's apt sources; building without $suite-security"
fi
sources=("deb $mirror $suite main" "deb $mirror $suite-updates main")
if [[ -n "$security_mirror" && "$security_mirror" != none ]]; then
	sources+=("deb $security_mirror $suite-security main")
fi

# --- build ---------------------------------------------------------------------------------
mkdir -p "$cache/rootfs"
# One build at a time per cache; a run that waited here usually finds the image built.
need_cmd flock "apt-get install util-linux"
exec {lock_fd}>"$cache/rootfs/.lock"
if ! flock -n "$lock_fd"; then
	note "another mkrootfs.sh is building into $cache/rootfs; waiting for it"
	flock "$lock_fd"
fi
if ((refresh == 0)) && [[ -e "$entry/.complete" ]]; then
	print_result
	exit 0
fi
# Work next to the cache entry (same filesystem, so the final rename is atomic, and a large
# disk rather than a tmpfs /tmp).
work="$(mktemp -d "$cache/rootfs/.build.XXXXXX")"
cleanup() {
	# Built rootless, the tree (and mmdebstrap's temporary directory, if it was killed) holds
	# files owned by subordinate ids; only the namespace's root may delete them.
	as_tree_owner rm -rf "$work" 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT
# A signal ends the script through exit, so the EXIT trap cleans up then too.
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
# In unshare mode mmdebstrap's root is the first subordinate uid, not this user: the hook must
# be readable by others.
chmod 0755 "$work"

# Customize hook, run by mmdebstrap with the tree as $1 (outside the chroot, as the tree's root).
cat >"$work/customize.sh" <<HOOK
#!/bin/sh
set -eu
root="\$1"
# Our own identity: mmdebstrap copies the build host's hostname and resolv.conf.
printf '%s\n' '$GUEST_HOSTNAME' >"\$root/etc/hostname"
cat >"\$root/etc/hosts" <<'HOSTS'
127.0.0.1	localhost
127.0.1.1	$GUEST_HOSTNAME
::1	localhost ip6-localhost ip6-loopback
ff02::1	ip6-allnodes
ff02::2	ip6-allrouters
HOSTS
rm -f "\$root/etc/resolv.conf"
cat >"\$root/etc/resolv.conf" <<'RESOLV'
# Placeholder: the cowork guest agent rewrites this file at boot.
nameserver 127.0.0.1
RESOLV
# Session homes live under /sessions (the session disk is mounted there).
mkdir -p "\$root/sessions"
chmod 0755 "\$root/sessions"
# PEP 668 marker: without it a non-root 'pip install' installs into ~/.local on the session disk.
rm -f "\$root"/usr/lib/python3*/EXTERNALLY-MANAGED
# Every VM gets an empty machine id rather than the build's.
: >"\$root/etc/machine-id"
rm -f "\$root/var/lib/dbus/machine-id"
# Package lists are 50+ MB and stale by the time anyone would use them.
rm -rf "\$root"/var/lib/apt/lists/*
rm -f "\$root"/var/cache/apt/*.bin
# C.UTF-8 is compiled into glibc; check the locale resolves (charmap is UTF-8, not ASCII).
charmap="\$(chroot "\$root" env LC_ALL=C.UTF-8 locale charmap 2>/dev/null || true)"
if [ "\$charmap" != UTF-8 ]; then
	echo "customize hook: LC_ALL=C.UTF-8 gives charmap '\$charmap', not UTF-8" >&2
	exit 1
fi
HOOK
chmod 0755 "$work/customize.sh"

mm_args=(
	--variant=minbase
	--mode="$mode"
	--format=tar
	--include="$(
		IFS=,
		printf '%s' "${PACKAGES[*]}"
	)"
	--customize-hook="$work/customize.sh"
)
for opt in "${DPKG_OPTS[@]}"; do
	mm_args+=(--dpkgopt="$opt")
done
((${COWORK_QUIET:-0} == 1)) && mm_args+=(--quiet)

note "building the $suite userland with mmdebstrap ($mode mode; a minute or more)"
start=$SECONDS
# stdin from /dev/null: mmdebstrap reads sources from a non-terminal stdin otherwise. Its
# temporary tree (~500 MB) goes into the work directory rather than a possibly small /tmp.
TMPDIR="$work" mmdebstrap "${mm_args[@]}" "$suite" "$work/rootfs.tar" "${sources[@]}" </dev/null >&2 ||
	die "mmdebstrap failed (see above); is the Debian archive reachable?"
mm_seconds=$((SECONDS - start))

# --- tree -> ext4 --------------------------------------------------------------------------
# Everything from here runs in one shell as the tree's owner: extract (without /dev: the agent
# mounts devtmpfs there, and a user namespace cannot create device nodes), check, make the
# filesystem from the directory (this e2fsprogs takes no tarball), shrink it.
cat >"$work/pack.sh" <<'PACK'
#!/bin/bash
set -euo pipefail
work="$1" label="$2" block="$3" slack_mib="$4"
tree="$work/tree"
img="$work/rootfs.img"
mkdir "$tree"
tar -C "$tree" --numeric-owner --xattrs --xattrs-include='*' -xpf "$work/rootfs.tar" \
	--exclude='./dev/*'
rm -f "$work/rootfs.tar"
# Installed packages, name=version, for the info file and the absence checks.
dpkg-query --admindir="$tree/var/lib/dpkg" -W -f '${db:Status-Abbrev} ${Package}=${Version}\n' |
	awk '$1 == "ii" { print $2 }' | sort >"$work/packages"
tree_bytes="$(du -s --apparent-size -B1 "$tree" | cut -f1)"
files="$(find "$tree" -xdev | wc -l)"
# Room for the tree plus a quarter for metadata; shrunk below.
size_kib=$((tree_bytes / 1024 * 5 / 4 + 65536))
inodes=$((files + files / 4 + 1024))
# The e2fsprogs tools chatter on stdout and stderr; keep it for when one fails.
log="$work/pack.log"
run() {
	"$@" >>"$log" 2>&1 || {
		local rc=$?
		cat "$log" >&2
		echo "pack: '$1' failed with status $rc" >&2
		return "$rc"
	}
}
run mkfs.ext4 -q -F -t ext4 -b "$block" -L "$label" -O ^has_journal -m 0 -N "$inodes" \
	-E root_owner=0:0 -d "$tree" "$img" "${size_kib}K"
# resize2fs wants a freshly checked filesystem; exit 1 means "fixed something", which a new
# filesystem may report for optimisations.
rc=0
e2fsck -fy "$img" >>"$log" 2>&1 || rc=$?
((rc <= 1)) || { cat "$log" >&2; echo "pack: e2fsck of the new image failed ($rc)" >&2; exit 1; }
run resize2fs -M "$img"
blocks="$(dumpe2fs -h "$img" 2>/dev/null | sed -n 's/^Block count: *//p')"
run resize2fs "$img" $((blocks + slack_mib * 1024 * 1024 / block))
run e2fsck -fn "$img"
printf '%s %s\n' "$tree_bytes" "$files" >"$work/tree-stats"
PACK
chmod 0755 "$work/pack.sh"
note "packing the tree into ext4 ($LABEL, no journal)"
pack_start=$SECONDS
as_tree_owner "$work/pack.sh" "$work" "$LABEL" "$BLOCK_SIZE" "$SLACK_MIB" ||
	die "making the ext4 image failed (see above)"
pack_seconds=$((SECONDS - pack_start))
read -r tree_bytes tree_files <"$work/tree-stats"

# --- checks --------------------------------------------------------------------------------
for pkg in "${FORBIDDEN_PACKAGES[@]}"; do
	if grep -q "^$pkg=" "$work/packages"; then
		die "the image contains '$pkg', which must not be there (pulled in by a dependency?)"
	fi
done
for pkg in "${PACKAGES[@]}"; do
	grep -q "^$pkg=" "$work/packages" || die "package '$pkg' is missing from the image"
done
missing=()
for f in "${REQUIRED_FILES[@]}"; do
	# -e follows symlinks inside the tree relative to the host root, so test with -L too.
	[[ -e "$work/tree/$f" || -L "$work/tree/$f" ]] || missing+=("$f")
done
((${#missing[@]} == 0)) || die "the image lacks ${missing[*]}"
for f in usr/bin/bwrap usr/bin/socat usr/lib/systemd/systemd sbin/init usr/sbin/init; do
	[[ -e "$work/tree/$f" || -L "$work/tree/$f" ]] && die "the image contains /$f, which must not be there"
done
features="$(dumpe2fs -h "$work/rootfs.img" 2>/dev/null | sed -n 's/^Filesystem features: *//p')"
[[ " $features " != *" has_journal "* ]] || die "the image has a journal"
[[ "$(dumpe2fs -h "$work/rootfs.img" 2>/dev/null | sed -n 's/^Filesystem volume name: *//p')" == "$LABEL" ]] ||
	die "the image's label is not $LABEL"

# --- results -------------------------------------------------------------------------------
build_seconds=$((SECONDS - start))
image_bytes="$(stat -c %s "$work/rootfs.img")"
alloc_bytes=$(($(stat -c %b "$work/rootfs.img") * $(stat -c %B "$work/rootfs.img")))
{
	printf '%s\n' "$INFO_FORMAT"
	printf 'SUITE=%s\n' "$suite"
	printf 'KEY=%s\n' "$key"
	printf 'RECIPE_VERSION=%s\n' "$RECIPE_VERSION"
	printf 'LABEL=%s\n' "$LABEL"
	printf 'FSTYPE=ext4\n'
	printf 'INCLUDE=%s\n' "${PACKAGES[*]}"
	printf 'PACKAGE_COUNT=%s\n' "$(wc -l <"$work/packages")"
	printf 'PACKAGES_SHA256=%s\n' "$(sha256sum "$work/packages" | cut -d' ' -f1)"
	printf 'BUILD_DATE=%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
	printf 'BUILD_MODE=%s\n' "$mode"
	printf 'BUILD_SECONDS=%s\n' "$build_seconds"
	printf 'MMDEBSTRAP_SECONDS=%s\n' "$mm_seconds"
	printf 'PACK_SECONDS=%s\n' "$pack_seconds"
	printf 'TREE_BYTES=%s\n' "$tree_bytes"
	printf 'TREE_FILES=%s\n' "$tree_files"
	printf 'IMAGE_BYTES=%s\n' "$image_bytes"
	printf 'IMAGE_ALLOCATED_BYTES=%s\n' "$alloc_bytes"
	printf 'IMAGE_SHA256=%s\n' "$(sha256sum "$work/rootfs.img" | cut -d' ' -f1)"
} >"$work/rootfs-info"
chmod 0444 "$work/rootfs.img"

rm -rf "$entry.old"
[[ -e "$entry" ]] && mv "$entry" "$entry.old"
mkdir -p "$entry"
mv "$work/rootfs.img" "$work/rootfs-info" "$work/packages" "$entry/"
touch "$entry/.complete"
rm -rf "$entry.old"
# Images of this suite from an older recipe or package list are stale: drop them (a hard link
# in a guest image directory keeps its copy alive).
for old in "$cache/rootfs/$suite"-*; do
	[[ "$old" == "$entry" || ! -d "$old" ]] || rm -rf "$old"
done
note "built $entry/rootfs.img in ${build_seconds}s ($image_bytes bytes, $alloc_bytes allocated)"
print_result
