//! Small questions about the host's files that several commands ask: is
//! this an executable, which executable of that name does `PATH` give.
//!
//! Limits: the execute bit is looked at, not whether this user may run it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Whether `p` is a regular file with an execute bit (symlinks followed).
pub fn is_executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The first executable called `name` in the directories of `$PATH`.
pub fn on_path(name: &str) -> Option<PathBuf> {
    path_dirs().map(|d| d.join(name)).find(|p| is_executable(p))
}

/// The directories of `$PATH`, in order.
pub fn path_dirs() -> impl Iterator<Item = PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).collect::<Vec<_>>().into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_executables_only() {
        assert!(is_executable(Path::new("/bin/sh")));
        assert!(!is_executable(Path::new("/etc/passwd")));
        assert!(!is_executable(Path::new("/")));
        assert!(on_path("sh").is_some());
        assert!(on_path("cowork-no-such-program").is_none());
    }
}
