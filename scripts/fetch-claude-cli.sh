#!/usr/bin/env bash
# Fetch the Claude Code CLI's native Linux binary (the glibc x64 build the desktop client
# installs into the VM) from the npm registry with the npm client, and cache it in the guest
# cache as claude-cli/<version>/claude. The tests lay out an SDK directory from it the way the
# client does (<dir>/<version>/claude). Offline once cached: when npm cannot be reached the
# newest cached version is used.
#
# Limits: linux-x64 (glibc) only; the binary needs a CPU with AVX2 to run.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

# The per-platform npm package that carries the native binary (the meta package
# @anthropic-ai/claude-code lists it as an optional dependency).
PACKAGE=@anthropic-ai/claude-code-linux-x64
# Where the binary sits in the package tarball (checked: package/claude, mode 0755).
TARBALL_BINARY=package/claude
# Seconds to wait for npm to answer a version query or download the ~190 MB tarball before
# falling back to the cache.
NPM_VIEW_TIMEOUT=30
NPM_PACK_TIMEOUT=900
# Versions look like 2.1.334; anything else is refused before it becomes a path.
VERSION_RE='^[0-9]+\.[0-9]+\.[0-9]+([-+][0-9A-Za-z.-]+)?$'

usage() {
	cat <<USAGE
Usage: $COWORK_SCRIPT_NAME [--version VER] [--cache DIR] [--quiet]

Fetches $PACKAGE (the newest version unless --version) with 'npm view' and
'npm pack', and caches its binary as <cache>/claude-cli/<version>/claude (mode 0755). Checks
that '<binary> --version' runs and names that version. When npm cannot be reached, the newest
cached version (or the asked one, if cached) is used.

On success prints shell-style assignments on stdout:
  CLAUDE_CLI=<path to the binary> CLAUDE_CLI_VERSION=<version>

Options:
  --version VER  this version instead of the newest
  --cache DIR    cache directory (default: \$COWORK_GUEST_CACHE, else
                 \$XDG_CACHE_HOME/cowork-helper/guest, else <repo>/target/guest-cache;
                 now: $(guest_cache_dir))
  --quiet        no progress messages on stderr
  -h, --help     this text
USAGE
}

version=""
cache=""
while (($#)); do
	case "$1" in
	--version) version="${2:?--version needs a version}"; shift 2 ;;
	--cache) cache="${2:?--cache needs a directory}"; shift 2 ;;
	--quiet) COWORK_QUIET=1; shift ;;
	-h | --help) usage; exit 0 ;;
	*) usage >&2; die "unknown argument '$1'" ;;
	esac
done
cache="$(abs_path "${cache:-$(guest_cache_dir)}")"
store="$cache/claude-cli"
if [[ -n "$version" && ! "$version" =~ $VERSION_RE ]]; then
	die "'$version' is not a version like 2.1.334"
fi

print_result() {
	printf 'CLAUDE_CLI=%s\n' "$store/$1/claude"
	printf 'CLAUDE_CLI_VERSION=%s\n' "$1"
}

# Complete cached versions, oldest first.
newest_cached_all() {
	local d
	for d in "$store"/*/; do
		d="${d%/}"
		if [[ -e "$d/.complete" && -x "$d/claude" ]]; then
			basename "$d"
		fi
	done | sort -V
}

# The newest complete cached version, or nothing.
newest_cached() {
	newest_cached_all | tail -n1
}

if [[ -n "$version" && -e "$store/$version/.complete" ]]; then
	print_result "$version"
	exit 0
fi

# npm runs with its own throw-away cache, so the tarball is not kept twice (npm's cache and
# ours), never reads stdin, and retries once (its default backoff spends a minute on an
# unreachable registry).
work="$(mktemp -d "${TMPDIR:-/tmp}/fetch-claude-cli.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# A signal ends the script through exit, so the EXIT trap cleans up then too.
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
# The first line of npm's error output that says something (not where its deleted log was).
npm_error() {
	grep -v -e 'complete log of this run' -e '^[[:space:]]*$' "$1" 2>/dev/null | head -n1 || true
}
npm_cmd=(npm --cache "$work/npm-cache" --no-update-notifier --no-fund --no-audit
	--fetch-retries=1)

if [[ -z "$version" ]]; then
	if command -v npm >/dev/null 2>&1; then
		version="$(timeout "$NPM_VIEW_TIMEOUT" "${npm_cmd[@]}" view "$PACKAGE" version \
			</dev/null 2>"$work/view.err" || true)"
		version="${version//[$'\r\n ']/}"
	else
		echo "npm not found" >"$work/view.err"
	fi
	if [[ ! "$version" =~ $VERSION_RE ]]; then
		cached="$(newest_cached)"
		[[ -n "$cached" ]] ||
			die "cannot ask npm for the newest $PACKAGE ($(npm_error "$work/view.err")) and none is cached"
		warn "npm did not answer ($(npm_error "$work/view.err")); using the cached $cached"
		print_result "$cached"
		exit 0
	fi
	if [[ -e "$store/$version/.complete" ]]; then
		print_result "$version"
		exit 0
	fi
fi

need_cmd npm "install npm (apt-get install npm), or pass --version of a cached copy"
need_cmd flock "apt-get install util-linux"
# One download at a time per cache; a run that waited here usually finds the version cached.
mkdir -p "$store"
exec {lock_fd}>"$store/.lock"
if ! flock -n "$lock_fd"; then
	note "another fetch-claude-cli.sh is downloading into $store; waiting for it"
	flock "$lock_fd"
fi
if [[ -e "$store/$version/.complete" ]]; then
	print_result "$version"
	exit 0
fi
need_cmd tar "install tar"
note "downloading $PACKAGE@$version (about 190 MB)"
(cd "$work" && timeout "$NPM_PACK_TIMEOUT" "${npm_cmd[@]}" pack --loglevel=error \
	"$PACKAGE@$version" </dev/null >"$work/pack.out" 2>"$work/pack.err") || {
	cached="$(newest_cached)"
	[[ -z "$cached" ]] || warn "the cached version is $cached (pass --version $cached to use it)"
	die "npm pack $PACKAGE@$version failed: $(npm_error "$work/pack.err")"
}
tarball="$work/$(tail -n1 "$work/pack.out")"
[[ -f "$tarball" ]] || die "npm pack did not leave the tarball it named ($(tail -n1 "$work/pack.out"))"
mkdir "$work/x"
tar -C "$work/x" -xzf "$tarball" "$TARBALL_BINARY" package/package.json ||
	die "$tarball has no $TARBALL_BINARY (has the package's layout changed?)"
pkg_version="$(sed -n 's/^ *"version": *"\([^"]*\)".*/\1/p' "$work/x/package/package.json" | head -n1)"
[[ "$pkg_version" == "$version" ]] ||
	die "the tarball's package.json says version '$pkg_version', expected '$version'"
bin="$work/x/$TARBALL_BINARY"
[[ "$(head -c4 "$bin" | od -An -c | tr -d ' ')" == 177ELF ]] || die "$TARBALL_BINARY is not an ELF binary"
chmod 0755 "$bin"
said="$("$bin" --version 2>&1 </dev/null || true)"
[[ "$said" == *"$version"* ]] ||
	die "'claude --version' printed '${said:0:200}', not $version (the binary needs a CPU with AVX2)"

dest="$store/$version"
rm -rf "$dest.tmp.$$"
mkdir -p "$dest.tmp.$$"
mv "$bin" "$dest.tmp.$$/claude"
cp "$work/x/package/package.json" "$dest.tmp.$$/package.json"
rm -rf "$dest"
mv "$dest.tmp.$$" "$dest"
touch "$dest/.complete"
note "cached $dest/claude ($said)"
# Keep this version and the newest other one (a fallback while a new release is suspect); each
# is about 400 MB.
for old in $(newest_cached_all | head -n -2); do
	[[ "$old" == "$version" ]] || rm -rf "${store:?}/$old"
done
print_result "$version"
