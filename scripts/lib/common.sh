# shellcheck shell=bash
# Helpers shared by the guest-image and nested-harness scripts. Source it; do not run it.
#
# Cache directory for downloaded kernels and built images, first match wins:
#   $COWORK_GUEST_CACHE
#   $XDG_CACHE_HOME/cowork-helper/guest   (only when XDG_CACHE_HOME is set)
#   <repo>/target/guest-cache             (target/ is gitignored)
# tests/support/nested.rs resolves the same way; keep the two in sync.

COWORK_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
COWORK_SCRIPT_NAME="$(basename "$0")"

die() {
	printf '%s: error: %s\n' "$COWORK_SCRIPT_NAME" "$*" >&2
	exit 1
}

warn() {
	printf '%s: warning: %s\n' "$COWORK_SCRIPT_NAME" "$*" >&2
}

note() {
	if [[ "${COWORK_QUIET:-0}" != 1 ]]; then
		printf '%s: %s\n' "$COWORK_SCRIPT_NAME" "$*" >&2
	fi
}

need_cmd() {
	local cmd="$1" hint="$2"
	command -v "$cmd" >/dev/null 2>&1 || die "'$cmd' not found; $hint"
}

guest_cache_dir() {
	if [[ -n "${COWORK_GUEST_CACHE:-}" ]]; then
		printf '%s\n' "$COWORK_GUEST_CACHE"
	elif [[ -n "${XDG_CACHE_HOME:-}" ]]; then
		printf '%s\n' "$XDG_CACHE_HOME/cowork-helper/guest"
	else
		printf '%s\n' "$COWORK_REPO_ROOT/target/guest-cache"
	fi
}

# Make a path absolute without requiring it to exist.
abs_path() {
	case "$1" in
	/*) printf '%s\n' "$1" ;;
	*) printf '%s/%s\n' "$PWD" "$1" ;;
	esac
}

# Turn the zero blocks of file $1 into holes (same content, less to read); a file system that
# cannot punch holes keeps the file as it is.
dig_holes() {
	fallocate --dig-holes "$1" 2>/dev/null || true
}
