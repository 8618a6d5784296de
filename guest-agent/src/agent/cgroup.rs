//! One cgroup child per spawned process, for accounting and OOM reports.
//!
//! With `--cgroup-root DIR`, when `DIR` is a writable cgroup2 directory or a
//! directory of a cgroup v1 memory hierarchy (the sandbox backend on a
//! hybrid host), each process gets `DIR/proc-<n>` and joins it before exec
//! (see [`super::child`]). After the process is gone, `oom_kill` of the
//! cgroup's `memory.events` (v2) or `memory.oom_control` (v1) becomes the
//! exit event's `oomKillCount`, and the cgroup is removed. In v2 the agent
//! tries to enable the memory controller for the children (`+memory` in
//! `DIR/cgroup.subtree_control`); without it there is no `memory.events`
//! and `oomKillCount` is omitted.
//!
//! Limits: a cgroup that still holds processes (a daemonized grandchild)
//! cannot be removed; it is retried on later exits and at shutdown, when
//! the agent also writes `cgroup.kill` (v2, kernel 5.14+). In v1 only the
//! memory hierarchy is split per process.

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::sync::MutexExt;
use crate::sys;

/// Errors of cgroup handling.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{path} is neither a cgroup2 directory nor one of a cgroup v1 memory hierarchy")]
    NotCgroup2 { path: PathBuf },
    #[error("{path} is not writable: {source}")]
    NotWritable { path: PathBuf, source: io::Error },
    #[error("cannot create cgroup {path}: {source}")]
    Create { path: PathBuf, source: io::Error },
}

/// `statfs` magic of a cgroup v1 hierarchy.
const CGROUP_V1_MAGIC: u64 = 0x0027_e0eb;

/// The cgroup root of the agent; cheap to clone.
#[derive(Clone, Debug)]
pub struct Cgroups {
    root: Arc<PathBuf>,
    next: Arc<AtomicU64>,
    /// Cgroups that could not be removed yet.
    stale: Arc<Mutex<Vec<PathBuf>>>,
}

/// The cgroup of one process.
#[derive(Debug)]
pub struct ProcCgroup {
    pub path: PathBuf,
}

impl Cgroups {
    /// Checks that `root` is a writable cgroup2 directory and enables the
    /// memory controller for its children (best effort).
    pub fn open(root: &Path) -> Result<Cgroups, CgroupError> {
        let magic =
            sys::fs_magic(root).map_err(|_| CgroupError::NotCgroup2 { path: root.into() })?;
        let v1_memory = magic == CGROUP_V1_MAGIC && root.join("memory.oom_control").exists();
        if magic != libc::CGROUP2_SUPER_MAGIC as u64 && !v1_memory {
            return Err(CgroupError::NotCgroup2 { path: root.into() });
        }
        let c = sys::cstring(root).map_err(|e| CgroupError::NotWritable {
            path: root.into(),
            source: e,
        })?;
        // SAFETY: access(2) on a NUL-terminated path.
        if unsafe { libc::access(c.as_ptr(), libc::W_OK) } != 0 {
            return Err(CgroupError::NotWritable {
                path: root.into(),
                source: io::Error::last_os_error(),
            });
        }
        if !v1_memory {
            if let Err(e) = fs::write(root.join("cgroup.subtree_control"), "+memory") {
                tracing::debug!(error = %e, "memory controller not enabled for process cgroups");
            }
        }
        Ok(Cgroups {
            root: Arc::new(root.into()),
            next: Arc::default(),
            stale: Arc::default(),
        })
    }

    /// Creates a fresh cgroup and opens its `cgroup.procs` for the child to join.
    pub fn create(&self) -> Result<(ProcCgroup, OwnedFd), CgroupError> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self.root.join(format!("proc-{}-{n}", std::process::id()));
        fs::create_dir(&path).map_err(|e| CgroupError::Create {
            path: path.clone(),
            source: e,
        })?;
        match sys::open(&path.join("cgroup.procs"), libc::O_WRONLY) {
            Ok(fd) => Ok((ProcCgroup { path }, fd)),
            Err(e) => {
                let _ = fs::remove_dir(&path);
                Err(CgroupError::Create { path, source: e })
            }
        }
    }

    /// Reads the OOM kill count of `cg`, then removes it (or remembers it for
    /// a later attempt), and retries earlier leftovers.
    pub fn finish(&self, cg: ProcCgroup) -> Option<u64> {
        let ooms = fs::read_to_string(cg.path.join("memory.events"))
            .or_else(|_| fs::read_to_string(cg.path.join("memory.oom_control")))
            .ok()
            .and_then(|s| parse_oom_kills(&s));
        let mut stale = self.stale.locked();
        stale.push(cg.path);
        stale.retain(|p| fs::remove_dir(p).is_err() && p.exists());
        ooms
    }

    /// Kills whatever is left in every process cgroup (`cgroup.kill`) and
    /// removes the ones that are empty.
    pub fn kill_leftovers(&self) {
        let mut stale = self.stale.locked();
        for p in stale.iter() {
            let _ = fs::write(p.join("cgroup.kill"), "1");
        }
        stale.retain(|p| fs::remove_dir(p).is_err() && p.exists());
    }

    /// Kills every process in `cg` (kernel 5.14+; best effort).
    pub fn kill(cg: &ProcCgroup) {
        let _ = fs::write(cg.path.join("cgroup.kill"), "1");
    }
}

/// The `oom_kill` count of a `memory.events` (v2) or `memory.oom_control`
/// (v1) file.
pub fn parse_oom_kills(events: &str) -> Option<u64> {
    events.lines().find_map(|line| {
        let mut it = line.split_whitespace();
        (it.next() == Some("oom_kill")).then(|| it.next()?.parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_kill_line_is_parsed() {
        let text = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_oom_kills(text), Some(2));
        assert_eq!(parse_oom_kills("low 0\n"), None);
        assert_eq!(parse_oom_kills("oom_kill x\n"), None);
        // cgroup v1's memory.oom_control.
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n";
        assert_eq!(parse_oom_kills(v1), Some(1));
    }

    #[test]
    fn plain_directories_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            Cgroups::open(dir.path()),
            Err(CgroupError::NotCgroup2 { .. })
        ));
    }
}
