//! The QEMU VM's private runtime directory: 0700, under
//! `$XDG_RUNTIME_DIR` (or the temporary directory when the socket paths
//! would not fit there; both as [`HostEnv`] says), holding the vhost-user sockets; removed when the
//! machine is dropped, and swept at the next start when a helper died
//! before it could remove it.
//!
//! Limits: a socket path must fit `sun_path` ([`MAX_SOCKET_PATH`]); a stale
//! directory is recognised only by the dead pid in its name.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::QemuError;
use crate::hostfs::HostEnv;

/// Longest Unix socket path (`sun_path` minus the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The VM's private runtime directory (0700; holds the vhost-user socket);
/// removed on drop.
pub(super) struct RunDir(pub(super) PathBuf);

/// Distinguishes the runtime directories of one helper's VMs.
static RUN_DIR_SEQ: AtomicU64 = AtomicU64::new(0);

impl RunDir {
    /// A new runtime directory under `host`'s runtime directory, else its
    /// temporary directory.
    pub(super) fn create(host: &HostEnv) -> Result<RunDir, QemuError> {
        let name = format!(
            "cowork-qemu-{}-{}",
            std::process::id(),
            RUN_DIR_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let base = host
            .runtime_dir
            .clone()
            .filter(|d| d.join(&name).join("vsock.sock").as_os_str().len() <= MAX_SOCKET_PATH)
            .unwrap_or_else(|| host.temp_dir.clone());
        let path = base.join(name);
        let fail = |source| QemuError::RunDir {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&base).map_err(fail)?;
        sweep_stale_run_dirs(&base);
        // A leftover of a crashed helper with a recycled pid: start clean.
        let _ = std::fs::remove_dir_all(&path);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(fail)?;
        Ok(RunDir(path))
    }
}

/// Removes runtime directories of helpers that are gone (killed before
/// they could clean up), recognised by the pid in their name.
pub(super) fn sweep_stale_run_dirs(base: &Path) {
    sweep_dead_helpers(
        base,
        |n| {
            n.strip_prefix("cowork-qemu-")
                .and_then(|rest| rest.split_once('-'))
                .map(|(pid, _)| pid)
        },
        "runtime directory",
    );
}

/// Removes the entries of `dir` (files or directories) whose name holds
/// the pid of a helper that is gone; `pid_of` finds the pid's text in a
/// name (none: not such an entry, left alone). `what` names the entries
/// in the log.
pub(super) fn sweep_dead_helpers(dir: &Path, pid_of: impl Fn(&str) -> Option<&str>, what: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(&pid_of)
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::debug!(path = %e.path().display(), "removing a dead helper's {what}");
            let path = e.path();
            let _ = if e.file_type().is_ok_and(|t| t.is_dir()) {
                std::fs::remove_dir_all(path)
            } else {
                std::fs::remove_file(path)
            };
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
