//! Early init duties of the agent as a VM's PID 1 (`--init-mounts`).
//!
//! Mounts the kernel filesystems a minimal root lacks: `proc` on `/proc`,
//! `sysfs` on `/sys`, `devtmpfs` on `/dev` and `cgroup2` on
//! `/sys/fs/cgroup`, each only when its mount point is not already a mount
//! of that filesystem type. Failures are reported per mount and do not stop
//! the others (a sandbox may forbid some of them).
//!
//! Limits: loading kernel modules, `/dev/pts`, `/dev/shm` and `/run` belong
//! to a later change; so does powering off on shutdown.

use std::ffi::CStr;
use std::io;
use std::path::{Path, PathBuf};

use super::sys;

/// `statfs` magic of devtmpfs (it reports tmpfs's).
const DEVTMPFS_MAGIC: u64 = libc::TMPFS_MAGIC as u64;

/// Errors of early init.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("cannot mount {fstype} on {target}: {source}")]
    Mount {
        fstype: &'static str,
        target: PathBuf,
        source: io::Error,
    },
}

/// One kernel filesystem the agent provides.
struct EarlyMount {
    fstype: &'static CStr,
    target: &'static str,
    magic: u64,
    flags: libc::c_ulong,
    data: Option<&'static CStr>,
}

const EARLY_MOUNTS: [EarlyMount; 4] = [
    EarlyMount {
        fstype: c"proc",
        target: "proc",
        magic: libc::PROC_SUPER_MAGIC as u64,
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: None,
    },
    EarlyMount {
        fstype: c"sysfs",
        target: "sys",
        magic: libc::SYSFS_MAGIC as u64,
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: None,
    },
    EarlyMount {
        fstype: c"devtmpfs",
        target: "dev",
        magic: DEVTMPFS_MAGIC,
        flags: libc::MS_NOSUID,
        data: Some(c"mode=0755"),
    },
    EarlyMount {
        fstype: c"cgroup2",
        target: "sys/fs/cgroup",
        magic: libc::CGROUP2_SUPER_MAGIC as u64,
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: None,
    },
];

/// What happened to one early mount.
#[derive(Debug)]
pub enum MountOutcome {
    Mounted(PathBuf),
    AlreadyMounted(PathBuf),
    Failed(InitError),
}

/// Mounts the kernel filesystems below `root` (`/` in production) that are
/// not mounted yet. Returns one outcome per filesystem, in mount order.
pub fn mount_early_filesystems(root: &Path) -> Vec<MountOutcome> {
    EARLY_MOUNTS.iter().map(|m| mount_one(root, m)).collect()
}

fn mount_one(root: &Path, m: &EarlyMount) -> MountOutcome {
    let target = root.join(m.target);
    let fstype = m.fstype.to_str().unwrap_or("?");
    let fail = |source: io::Error| {
        MountOutcome::Failed(InitError::Mount {
            fstype,
            target: target.clone(),
            source,
        })
    };
    let mounted = sys::is_mount_point(&target).unwrap_or(false)
        && sys::fs_magic(&target).is_ok_and(|magic| magic == m.magic);
    if mounted {
        return MountOutcome::AlreadyMounted(target);
    }
    if let Err(e) = std::fs::create_dir_all(&target) {
        return fail(e);
    }
    let c = match sys::cstring(&target) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    match sys::mount(Some(m.fstype), &c, Some(m.fstype), m.flags, m.data) {
        Ok(()) => MountOutcome::Mounted(target),
        Err(e) => fail(e),
    }
}

/// Runs [`mount_early_filesystems`] on `/` and logs the outcome.
pub fn run_early_init() {
    for outcome in mount_early_filesystems(Path::new("/")) {
        match outcome {
            MountOutcome::Mounted(p) => tracing::info!(target_dir = %p.display(), "mounted"),
            MountOutcome::AlreadyMounted(p) => {
                tracing::debug!(target_dir = %p.display(), "already mounted")
            }
            MountOutcome::Failed(e) => tracing::warn!(error = %e, "early mount failed"),
        }
    }
}
