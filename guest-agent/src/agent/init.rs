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
//! ([`super::clock`]), the loopback interface (with a second address,
//! [`crate::net::SECOND_LOOPBACK_ADDR`]; the sandbox's init does the same
//! through [`crate::net`]) and the session userland
//! ([`super::userland`], which may switch the root away from the initramfs
//! and sets up host name, `/etc` and limits). That is the template point
//! ([`super::setup`]): after the host's `Setup`, [`finish_machine_init`]
//! mounts the session disk and the host's session share. Powering off at
//! the end is [`super::power`].
//!
//! The session share ([`mount_sessions_share`]): when the machine has a
//! virtio-fs device, the tag [`proto::SESSIONS_FS_TAG`] is mounted at
//! [`proto::SESSIONS_FS_MOUNT`] (in a 0700 directory, `nosuid,nodev`). The
//! host grants each session mount there and sends its path as the mount's
//! source; the agent hides the share itself from session processes (it
//! becomes a private path, see [`super::child`]).
//!
//! Limits: no network beyond `lo` (the host link is vsock). Hiding the share is a convenience, not a
//! boundary: a guest process with `CAP_SYS_ADMIN` can mount the tag again;
//! what it may read and write there is enforced by the host.

use std::ffi::CStr;
use std::io;
use std::path::{Path, PathBuf};

use super::{clock, modules, userland};
use crate::mounttable;
use crate::net::{self, LOOPBACK, LOOPBACK_ALIAS, SECOND_LOOPBACK_ADDR};
use crate::proto;
use crate::sys;

/// `statfs` magic of devtmpfs (it reports tmpfs's).
const DEVTMPFS_MAGIC: u64 = libc::TMPFS_MAGIC as u64;

/// `statfs` magic of devpts.
const DEVPTS_MAGIC: u64 = libc::DEVPTS_SUPER_MAGIC as u64;

/// `statfs` magic of tmpfs.
const TMPFS_MAGIC: u64 = libc::TMPFS_MAGIC as u64;

/// sysfs directory listing the virtio devices bound to the virtio-fs driver.
pub const VIRTIOFS_DRIVER_DIR: &str = "/sys/bus/virtio/drivers/virtiofs";

/// Mode of the directories holding the session share's mount point.
const SHARE_DIR_MODE: u32 = 0o700;

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
    #[error("cannot mount the host's session share (virtio-fs tag {tag:?}) on {target}: {source}; session mounts will fail")]
    Share {
        tag: &'static str,
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

/// Runs [`mount_early_filesystems`] on `/` and logs the outcome: one line
/// for all of them (each mount at debug level), a warning per failure.
pub fn run_early_init() {
    let (mut mounted, mut present, mut failed) = (0, 0, 0);
    for outcome in mount_early_filesystems(Path::new("/")) {
        match outcome {
            MountOutcome::Mounted(p) => {
                mounted += 1;
                tracing::debug!(target_dir = %p.display(), "mounted")
            }
            MountOutcome::AlreadyMounted(p) => {
                present += 1;
                tracing::debug!(target_dir = %p.display(), "already mounted")
            }
            MountOutcome::Failed(e) => {
                failed += 1;
                tracing::warn!(error = %e, "early mount failed")
            }
        }
    }
    tracing::info!(mounted, present, failed, "kernel filesystems mounted");
}

/// Brings the loopback interface up (the kernel then gives it 127.0.0.1).
pub fn loopback_up() -> Result<(), InitError> {
    net::set_link_up(LOOPBACK).map_err(InitError::Loopback)
}

/// Adds [`SECOND_LOOPBACK_ADDR`] to `lo` (as [`LOOPBACK_ALIAS`]); adding it
/// again is harmless.
pub fn loopback_alias() -> Result<(), InitError> {
    net::add_ipv4_address(LOOPBACK_ALIAS, SECOND_LOOPBACK_ADDR).map_err(InitError::Loopback)
}

/// Whether a virtio device is bound to the virtio-fs driver (a share may be
/// there; which tags is only known by trying).
pub fn virtiofs_device_present(driver_dir: &Path) -> bool {
    std::fs::read_dir(driver_dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with("virtio"))
        })
    })
}

/// Mounts virtio-fs `tag` on `target` (`nosuid,nodev`), creating `target`
/// and its missing parents with mode 0700. Already mounted there: nothing
/// to do.
pub fn mount_sessions_share(tag: &'static str, target: &Path) -> Result<(), InitError> {
    let fail = |source| InitError::Share {
        tag,
        target: target.to_path_buf(),
        source,
    };
    mounttable::mount_unless_mounted(
        tag,
        target,
        c"virtiofs",
        libc::MS_NOSUID | libc::MS_NODEV,
        SHARE_DIR_MODE,
    )
    .map_err(fail)
}

/// What [`run_machine_init`] set up that the agent needs later.
#[derive(Debug)]
pub struct MachineInit {
    /// Paths session processes must not see: the session share (when
    /// mounted) and the userland's layers.
    pub private_paths: Vec<PathBuf>,
    /// When the switch to a userland disk finished (`CLOCK_BOOTTIME` µs),
    /// if there was one.
    pub userland_switched_us: Option<u64>,
}

/// Everything a VM's init does before the agent dials the host: mounts,
/// kernel modules, clock, loopback and the session userland
/// ([`userland::boot`]); the session disk and share come after the host's
/// `Setup` ([`finish_machine_init`]). Each step logs its own outcome; none
/// stops the others.
///
/// The modules load in the background ([`modules::start_all`]) while the
/// rest goes on: the userland waits only for the modules it needs
/// ([`userland::MODULES`]), so mounting the image overlaps the other
/// devices' probes (vsock, virtio-fs, balloon, rng); everything is loaded
/// before the agent dials.
pub fn run_machine_init() -> MachineInit {
    let mut steps = StepTimes::start();
    run_early_init();
    steps.lap("mounts");
    let modules = modules::start_all();
    clock::set_clock();
    match loopback_up() {
        Ok(()) => tracing::debug!("loopback up"),
        Err(e) => tracing::warn!(error = %e, "loopback not up"),
    }
    match loopback_alias() {
        Ok(()) => tracing::debug!(addr = %SECOND_LOOPBACK_ADDR, "second loopback address"),
        Err(e) => tracing::warn!(
            error = %e,
            "cannot add {SECOND_LOOPBACK_ADDR} to lo; IPv4-only name lookups of sessions \
             (AI_ADDRCONFIG) will find nothing"
        ),
    }
    steps.lap("clock_net");
    modules.wait_for(userland::MODULES);
    steps.lap("userland_modules");
    let booted = userland::boot();
    steps.lap("userland");
    modules.finish();
    steps.lap("modules");
    let prefetched = prefetch(PREFETCH);
    steps.lap("prefetch");
    tracing::info!(steps = %steps, prefetched_kib = prefetched / 1024, "machine init done up to the template point");
    MachineInit {
        private_paths: booted.private_paths,
        userland_switched_us: booted.switched_us,
    }
}

/// Files of the session userland every start reads right after its
/// `Setup` or on its first spawn: the CA bundle the egress CA is added to,
/// the account files a session's user is added to, the skeleton of its
/// home, and bash with what it loads. [`run_machine_init`] reads them
/// before the template point so they are in the page cache a snapshot
/// keeps: a restored machine then finds them in memory instead of reading
/// its root disk at emulated speed (the cold boot pays once, ~4 MiB).
/// Missing files are skipped (another userland, the initramfs).
pub const PREFETCH: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/passwd",
    "/etc/group",
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/ld.so.cache",
    "/etc/skel/.bashrc",
    "/etc/skel/.profile",
    "/etc/skel/.bash_logout",
    "/etc/bash.bashrc",
    "/etc/profile",
    "/usr/bin/bash",
    "/usr/lib/x86_64-linux-gnu/libtinfo.so.6",
    "/usr/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/lib64/ld-linux-x86-64.so.2",
];

/// Reads each of `paths` whole (into the page cache); returns the bytes
/// read. Unreadable paths are skipped.
pub fn prefetch(paths: &[&str]) -> u64 {
    paths
        .iter()
        .filter_map(|p| {
            let mut f = std::fs::File::open(p).ok()?;
            std::io::copy(&mut f, &mut std::io::sink()).ok()
        })
        .sum()
}

/// What a VM's init does after the host's `Setup` (see
/// [`super::setup`]): mounts the session disk and the session share, the
/// per-boot state a snapshot must not hold. Returns the paths session
/// processes must not see (the share, when mounted).
pub fn finish_machine_init() -> Vec<PathBuf> {
    // The two mounts are independent (`/sessions` and the share's own
    // directory under /run) and each mostly waits on its host device, so
    // they run side by side: a warm start pays for the longer, not both.
    let began = crate::sys::boottime_us();
    let since = |from: u64| crate::sys::boottime_us().saturating_sub(from) / 1000;
    let (disk_ms, (share, share_ms)) = std::thread::scope(|scope| {
        let share = scope.spawn(|| {
            let share: Vec<PathBuf> = mount_share().into_iter().collect();
            (share, since(began))
        });
        userland::mount_sessions();
        let disk_ms = since(began);
        // A panic in the share's thread is the share not mounted.
        (disk_ms, share.join().unwrap_or_default())
    });
    // Debug: on every (warm) start's path, where each console byte is a
    // port I/O exit; `--guest-log debug` shows it.
    tracing::debug!(
        session_disk_ms = disk_ms,
        share_ms,
        total_ms = since(began),
        "machine init done"
    );
    share
}

/// How long each step of [`run_machine_init`] took (`CLOCK_BOOTTIME`), for
/// its one summary line: `mounts=12ms,modules=1240ms,...`.
struct StepTimes {
    last_us: u64,
    laps: Vec<(&'static str, u64)>,
}

impl StepTimes {
    fn start() -> Self {
        StepTimes {
            last_us: crate::sys::boottime_us(),
            laps: Vec::new(),
        }
    }

    /// Ends the step `name` now.
    fn lap(&mut self, name: &'static str) {
        let now = crate::sys::boottime_us();
        self.laps.push((name, now.saturating_sub(self.last_us)));
        self.last_us = now;
    }
}

impl std::fmt::Display for StepTimes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, us)) in self.laps.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep}{name}={}ms", us / 1000)?;
        }
        Ok(())
    }
}

/// Mounts the session share when there is a virtio-fs device; returns where.
fn mount_share() -> Option<PathBuf> {
    if !virtiofs_device_present(Path::new(VIRTIOFS_DRIVER_DIR)) {
        tracing::info!("no virtio-fs device; host folders cannot be mounted in this VM");
        return None;
    }
    let target = Path::new(proto::SESSIONS_FS_MOUNT);
    match mount_sessions_share(proto::SESSIONS_FS_TAG, target) {
        Ok(()) => {
            // Debug only (console bytes are exits; the host sees the mount's
            // FUSE INIT and logs it).
            tracing::debug!(
                tag = proto::SESSIONS_FS_TAG,
                target_dir = %target.display(),
                "session share mounted"
            );
            Some(target.to_path_buf())
        }
        Err(e) => {
            tracing::warn!(error = %e, "session share not mounted");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_reads_what_exists_and_skips_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        std::fs::write(&a, vec![1u8; 5000]).unwrap();
        let missing = dir.path().join("missing");
        let paths = [a.to_str().unwrap(), missing.to_str().unwrap()];
        assert_eq!(prefetch(&paths), 5000);
        // Every entry is an absolute path of a Debian-family userland.
        assert!(PREFETCH.iter().all(|p| p.starts_with('/')));
    }

    #[test]
    fn step_times_read_as_one_field() {
        let mut t = StepTimes {
            last_us: 0,
            laps: vec![("mounts", 12_400), ("modules", 1_240_000)],
        };
        assert_eq!(t.to_string(), "mounts=12ms,modules=1240ms");
        t.lap("userland");
        assert_eq!(t.laps.len(), 3);
        assert!(t
            .to_string()
            .starts_with("mounts=12ms,modules=1240ms,userland="));
    }

    #[test]
    fn a_virtiofs_device_is_a_virtio_entry_of_the_driver() {
        let d = tempfile::tempdir().unwrap();
        assert!(!virtiofs_device_present(&d.path().join("missing")));
        for name in ["bind", "unbind", "uevent", "module"] {
            std::fs::write(d.path().join(name), b"").unwrap();
        }
        assert!(!virtiofs_device_present(d.path()));
        std::os::unix::fs::symlink("/nonexistent/virtio2", d.path().join("virtio2")).unwrap();
        assert!(virtiofs_device_present(d.path()));
    }

    #[test]
    fn a_missing_share_is_a_clear_error_and_the_directory_is_private() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("run/cowork/fs");
        // No virtio-fs device with this tag exists outside a VM.
        let err = mount_sessions_share("cowork-no-such-tag", &target).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("cowork-no-such-tag") && text.contains("run/cowork/fs"),
            "{text}"
        );
        use std::os::unix::fs::PermissionsExt;
        for dir in [target.as_path(), target.parent().unwrap()] {
            let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, SHARE_DIR_MODE, "{}", dir.display());
        }
    }
}
