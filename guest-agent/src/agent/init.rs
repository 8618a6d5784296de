//! Early init duties of the agent as a VM's PID 1.
//!
//! [`mount_early_filesystems`] (`--init-mounts`, and part of `--init`)
//! mounts the kernel filesystems a minimal root lacks: `proc` on `/proc`,
//! `sysfs` on `/sys`, `devtmpfs` on `/dev`, `cgroup2` on `/sys/fs/cgroup`,
//! `devpts` on `/dev/pts` and tmpfs on `/dev/shm`, `/tmp` and `/run`, each
//! only when its mount point is not already a mount of that filesystem type.
//! Failures are reported per mount and do not stop the others (a sandbox may
//! forbid some of them).
//!
//! [`run_machine_init`] (`--init`, or PID 1 started by the kernel without
//! arguments) does everything a VM's init must before the agent dials the
//! host: the mounts, the kernel modules ([`super::modules`]), the clock
//! ([`super::clock`]) and the loopback interface. Powering off at the end is
//! [`super::power`].
//!
//! Limits: no network beyond `lo` (the host link is vsock); no hostname,
//! users or `/etc` setup.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use super::sys;
use super::{clock, modules};

/// `statfs` magic of devtmpfs (it reports tmpfs's).
const DEVTMPFS_MAGIC: u64 = libc::TMPFS_MAGIC as u64;

/// `statfs` magic of devpts.
const DEVPTS_MAGIC: u64 = libc::DEVPTS_SUPER_MAGIC as u64;

/// `statfs` magic of tmpfs.
const TMPFS_MAGIC: u64 = libc::TMPFS_MAGIC as u64;

/// The loopback interface brought up by [`run_machine_init`].
pub const LOOPBACK: &CStr = c"lo";

/// Errors of early init.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("cannot mount {fstype} on {target}: {source}")]
    Mount {
        fstype: &'static str,
        target: PathBuf,
        source: io::Error,
    },
    #[error("cannot bring up the loopback interface: {0}")]
    Loopback(io::Error),
}

/// One kernel filesystem the agent provides.
struct EarlyMount {
    fstype: &'static CStr,
    target: &'static str,
    magic: u64,
    flags: libc::c_ulong,
    data: Option<&'static CStr>,
}

/// In mount order; a mount point below another comes after it.
const EARLY_MOUNTS: [EarlyMount; 8] = [
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
    EarlyMount {
        fstype: c"devpts",
        target: "dev/pts",
        magic: DEVPTS_MAGIC,
        flags: libc::MS_NOSUID | libc::MS_NOEXEC,
        data: Some(c"mode=0620,ptmxmode=0666"),
    },
    EarlyMount {
        fstype: c"tmpfs",
        target: "dev/shm",
        magic: TMPFS_MAGIC,
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: Some(c"mode=1777"),
    },
    EarlyMount {
        fstype: c"tmpfs",
        target: "tmp",
        magic: TMPFS_MAGIC,
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: Some(c"mode=1777"),
    },
    EarlyMount {
        fstype: c"tmpfs",
        target: "run",
        magic: TMPFS_MAGIC,
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: Some(c"mode=0755"),
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

/// Brings the loopback interface up (the kernel then gives it 127.0.0.1).
pub fn loopback_up() -> Result<(), InitError> {
    // SAFETY: plain socket(2).
    let fd =
        sys::cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })
            .map_err(InitError::Loopback)?;
    // SAFETY: a new descriptor owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; zero is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(LOOPBACK.to_bytes()) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS fills the flags of a valid ifreq.
    sys::cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) })
        .map_err(InitError::Loopback)?;
    // SAFETY: reading the union member SIOCGIFFLAGS just wrote.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    if flags & libc::IFF_UP as libc::c_short != 0 {
        return Ok(());
    }
    req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads a valid ifreq.
    sys::cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) })
        .map_err(InitError::Loopback)?;
    Ok(())
}

/// Everything a VM's init does before the agent dials the host: mounts,
/// kernel modules, clock, loopback. Each step logs its own outcome; none
/// stops the others.
pub fn run_machine_init() {
    run_early_init();
    modules::load_all();
    clock::set_clock();
    match loopback_up() {
        Ok(()) => tracing::debug!("loopback up"),
        Err(e) => tracing::warn!(error = %e, "loopback not up"),
    }
}
