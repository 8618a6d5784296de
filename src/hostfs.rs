//! Small questions about the host's files that several commands ask: is
//! this an executable, which executable of that name does `PATH` give; and
//! [`HostEnv`], the host's standard environment variables (`PATH`, the XDG
//! directories, `HOME`, `TMPDIR`) as values, read once by [`crate::cli`] and
//! passed down, so no library module reads the environment itself.
//!
//! Limits: the execute bit is looked at, not whether this user may run it.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The temporary directory when `TMPDIR` is unset (what
/// `std::env::temp_dir` gives then).
pub const DEFAULT_TEMP_DIR: &str = "/tmp";

/// What the host's standard environment variables say, as the helper was
/// started: built by [`crate::cli`] (its `ENV_ONLY` registry names each
/// variable), made by hand in tests. Unset and empty variables are `None`.
/// [`Default`] is an empty environment: no `PATH`, no XDG directories, the
/// temporary directory [`DEFAULT_TEMP_DIR`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostEnv {
    /// `PATH`: where programs named without a directory are looked up.
    pub path: OsString,
    /// `XDG_RUNTIME_DIR`: the default socket's directory, and where a
    /// running VM's private sockets go when their paths fit.
    pub runtime_dir: Option<PathBuf>,
    /// The temporary directory (`TMPDIR`, else [`DEFAULT_TEMP_DIR`]).
    pub temp_dir: PathBuf,
    /// `HOME`.
    pub home: Option<PathBuf>,
    /// `XDG_DATA_HOME` (the default data directory's parent).
    pub data_home: Option<PathBuf>,
    /// `XDG_CACHE_HOME` (`image build`'s default cache as a user).
    pub cache_home: Option<PathBuf>,
    /// `XDG_CONFIG_HOME` (where the client keeps its bundle).
    pub config_home: Option<PathBuf>,
}

impl Default for HostEnv {
    fn default() -> Self {
        HostEnv {
            path: OsString::new(),
            runtime_dir: None,
            temp_dir: PathBuf::from(DEFAULT_TEMP_DIR),
            home: None,
            data_home: None,
            cache_home: None,
            config_home: None,
        }
    }
}

impl HostEnv {
    /// The directories of [`HostEnv::path`], in order.
    pub fn path_dirs(&self) -> impl Iterator<Item = PathBuf> {
        std::env::split_paths(&self.path)
            .collect::<Vec<_>>()
            .into_iter()
    }

    /// The first executable called `name` in [`HostEnv::path_dirs`].
    pub fn on_path(&self, name: &str) -> Option<PathBuf> {
        self.path_dirs()
            .map(|d| d.join(name))
            .find(|p| is_executable(p))
    }

    /// `$XDG_CONFIG_HOME`, else `~/.config`.
    pub fn config_dir(&self) -> Option<PathBuf> {
        self.config_home
            .clone()
            .or_else(|| self.home.as_ref().map(|h| h.join(".config")))
    }

    /// `$XDG_CACHE_HOME`, else `~/.cache`.
    pub fn cache_dir(&self) -> Option<PathBuf> {
        self.cache_home
            .clone()
            .or_else(|| self.home.as_ref().map(|h| h.join(".cache")))
    }

    /// `$XDG_DATA_HOME`, else `~/.local/share`.
    pub fn data_dir(&self) -> Option<PathBuf> {
        self.data_home
            .clone()
            .or_else(|| self.home.as_ref().map(|h| h.join(".local/share")))
    }
}

/// Whether `p` is a regular file with an execute bit (symlinks followed).
pub fn is_executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_executables_only() {
        assert!(is_executable(Path::new("/bin/sh")));
        assert!(!is_executable(Path::new("/etc/passwd")));
        assert!(!is_executable(Path::new("/")));
        let host = HostEnv {
            path: "/nonexistent:/usr/bin:/bin".into(),
            ..HostEnv::default()
        };
        assert!(host.on_path("sh").is_some());
        assert!(host.on_path("cowork-no-such-program").is_none());
        assert!(HostEnv::default().on_path("sh").is_none());
        assert_eq!(host.path_dirs().count(), 3);
    }
}
