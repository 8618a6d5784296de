//! The session disk: a virtio-blk disk with serial
//! [`proto::SESSION_DISK_SERIAL`], formatted as ext4 on first use and
//! mounted at `/sessions`, where session directories live and the disk
//! janitor measures and prunes.
//!
//! As the VM's init, after the kernel modules are loaded,
//! [`mount_session_disk`]:
//!
//! 1. finds the disk by its serial in `/sys/block/*/serial`
//!    ([`find_disk_by_serial`]); no such disk is not an error (the VM then
//!    keeps sessions on its root filesystem);
//! 2. drops what the kernel cached of it ([`forget_cached`]): a VM
//!    restored from a snapshot was probed with the snapshot's disk, and
//!    this boot's disk is another file (the kernel already drops a block
//!    device's cache when its last opener closes it, so this only matters
//!    if something held it open at the snapshot; it costs one ioctl);
//! 3. reads its first [`PROBE_LEN`] bytes ([`classify`]): an ext2/3/4
//!    superblock magic ([`crate::extfs`]) means it is formatted; all
//!    zeroes there and in its last [`TAIL_LEN`] bytes means blank;
//!    anything else is left alone;
//! 4. formats a blank disk with the image's `mkfs.ext4` (e2fsprogs' mke2fs,
//!    see `scripts/mkguestimage.sh`), bounded by [`MKFS_TIMEOUT`];
//! 5. mounts it at `/sessions` as ext4, `nosuid,nodev` (in the session
//!    userland's new root before the agent switches to it, see
//!    `agent::userland`, so a blank disk is formatted with the initramfs's
//!    `mkfs.ext4`);
//! 6. grows the filesystem online to the whole disk when the host made the
//!    image larger (`createVM` with a bigger `diskSizeGB`): the kernel's
//!    `EXT4_IOC_RESIZE_FS` on the mounted filesystem, as `resize2fs` does
//!    ([`grow`]).
//!
//! What happened is kept for the hello ([`outcome`],
//! [`proto::SessionDiskInfo`]): a disk that was found but could not be
//! mounted is reported as failed with the reason, and the host fails
//! `startVM` with it rather than let sessions live on the root filesystem,
//! which does not survive `stopVM`.
//!
//! Blank: the host already refuses to boot an image that is not zero from
//! its first byte to its last (`src/vm/storage.rs`, which can afford that
//! check because the image is sparse); the agent cannot read a whole disk
//! quickly, so its own check, a second line of defence, covers where
//! signatures live: the first [`PROBE_LEN`] bytes (MBR, GPT, ext, XFS,
//! ISO 9660, btrfs at 64 KiB, the first ZFS labels) and the last
//! [`TAIL_LEN`] (the GPT backup, md 1.0 superblocks, the last ZFS labels).
//!
//! Limits: a disk holding another filesystem or a partition table is
//! never overwritten (and not mounted either: the failure is reported); a
//! format interrupted after its first writes leaves such a disk, which then
//! needs a fresh image from the host. The mount point is the default
//! sessions root (`/sessions`), not a `--sessions-root` override. The
//! filesystem only grows; the host never shrinks the image. A failed grow is
//! logged and the disk stays mounted at its old size.

use std::ffi::CStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::extfs::{self, FsSize, Superblock};
use crate::mounttable;
use crate::proto;

/// Where block devices are listed in sysfs.
pub const SYS_BLOCK: &str = "/sys/block";
/// Where their device nodes are (devtmpfs).
pub const DEV_DIR: &str = "/dev";
/// Bytes read from the start of the disk to decide whether it is blank
/// (1 MiB: past btrfs's superblock at 64 KiB and ZFS's second label at
/// 256 KiB).
pub const PROBE_LEN: usize = 1024 * 1024;
/// Bytes read from the end of the disk to decide whether it is blank
/// (1 MiB: the GPT backup header and entries, md 1.0 superblocks, ZFS's
/// last two labels).
pub const TAIL_LEN: u64 = 1024 * 1024;
/// Programs tried, in order, to format the disk (e2fsprogs' mke2fs under
/// its ext4 name; busybox's `mke2fs` only makes ext2 and is not used).
pub const MKFS_CANDIDATES: [&str; 2] = ["/sbin/mkfs.ext4", "/usr/sbin/mkfs.ext4"];
/// The guest image's self-contained mke2fs (`scripts/mkguestimage.sh`):
/// `mkfs.ext4`, its libraries, the loader as `MKFS_LOADER` and
/// `mke2fs.conf`, flat. Gone with the initramfs after a userland switch,
/// so [`carry_mkfs`] copies it to [`MKFS_CARRIED`] first.
pub const MKFS_BUNDLE: &str = "/lib/cowork-mkfs";
/// Where the bundle is carried across the userland switch (`/run` moves
/// with the switch).
pub const MKFS_CARRIED: &str = "/run/cowork/mkfs";
/// The loader's name inside a bundle.
const MKFS_LOADER: &str = "ld.so";
/// The program's name inside a bundle.
const MKFS_PROGRAM: &str = "mkfs.ext4";
/// The configuration's name inside a bundle.
const MKFS_CONF: &str = "mke2fs.conf";
/// Filesystem label given to the session disk.
pub const FS_LABEL: &str = "cowork-sessions";
/// Longest a format may take before it is killed.
pub const MKFS_TIMEOUT: Duration = Duration::from_secs(120);
/// Mode of the mount point when the agent creates it.
const MOUNT_DIR_MODE: u32 = 0o755;
/// Filesystem type the disk is mounted as.
const FSTYPE: &CStr = c"ext4";
/// `EXT4_IOC_RESIZE_FS`, `_IOW('f', 16, __u64)`: grow a mounted ext4 to the
/// given block count.
const EXT4_IOC_RESIZE_FS: libc::c_ulong = 0x4008_6610;
/// `BLKGETSIZE64`, `_IOR(0x12, 114, size_t)`: a block device's size in bytes.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
/// `BLKFLSBUF`, `_IO(0x12, 97)`: writes back and drops a block device's
/// cached pages.
const BLKFLSBUF: libc::c_ulong = 0x1261;

/// What the start of a disk holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskContents {
    /// An ext2/3/4 filesystem.
    Ext,
    /// Zeroes only: never formatted.
    Blank,
    /// Something else (another filesystem, a partition table, a torn
    /// format): left alone.
    Unknown,
}

/// Errors preparing the session disk.
#[derive(Debug, thiserror::Error)]
pub enum SessionDiskError {
    #[error("cannot read the start of session disk {dev}: {source}")]
    Probe { dev: PathBuf, source: io::Error },
    #[error("session disk {0} holds data that is not an ext filesystem; it is left untouched (give the VM a fresh disk image to start over)")]
    Foreign(PathBuf),
    #[error("no mkfs.ext4 in the guest image (looked for {MKFS_CARRIED}, {MKFS_BUNDLE}, {}); rebuild it with scripts/mkguestimage.sh", MKFS_CANDIDATES.join(", "))]
    NoMkfs,
    #[error("cannot run {mkfs}: {source}")]
    MkfsSpawn { mkfs: PathBuf, source: io::Error },
    #[error("{mkfs} failed on {dev} ({status}): {output}")]
    MkfsFailed {
        mkfs: PathBuf,
        dev: PathBuf,
        status: String,
        output: String,
    },
    #[error("{mkfs} did not finish formatting {dev} within {}s; killed", MKFS_TIMEOUT.as_secs())]
    MkfsTimeout { mkfs: PathBuf, dev: PathBuf },
    #[error("cannot mount session disk {dev} on {target}: {source}{}", kernel.as_deref().map(|k| format!(" (kernel: {k})")).unwrap_or_default())]
    Mount {
        dev: PathBuf,
        target: PathBuf,
        source: io::Error,
        /// The kernel's last log line about the device ([`kernel_says`]).
        kernel: Option<String>,
    },
    #[error("cannot read the size of session disk {dev}: {source}")]
    Size { dev: PathBuf, source: io::Error },
    #[error("session disk {0} has no valid ext4 superblock to grow")]
    BadSuperblock(PathBuf),
    #[error("cannot grow the filesystem on {target} from {from} to {to} blocks: {source}")]
    Grow {
        target: PathBuf,
        from: u64,
        to: u64,
        source: io::Error,
    },
}

/// The filesystem size recorded in `dev`'s superblock.
pub fn fs_size(dev: &Path) -> Result<FsSize, SessionDiskError> {
    let sb = File::open(dev)
        .and_then(|f| extfs::read(&f, 0))
        .map_err(|source| SessionDiskError::Probe {
            dev: dev.to_path_buf(),
            source,
        })?;
    Superblock::parse(&sb)
        .and_then(|sb| sb.size())
        .ok_or_else(|| SessionDiskError::BadSuperblock(dev.to_path_buf()))
}

/// The size of `dev` in bytes: a block device's (`BLKGETSIZE64`) or a
/// regular file's.
pub fn disk_bytes(dev: &Path) -> Result<u64, SessionDiskError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileTypeExt;
    let err = |source| SessionDiskError::Size {
        dev: dev.to_path_buf(),
        source,
    };
    let f = File::open(dev).map_err(err)?;
    let meta = f.metadata().map_err(err)?;
    if !meta.file_type().is_block_device() {
        return Ok(meta.len());
    }
    let mut bytes: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points
    // at a live u64; the descriptor is open for the call.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64, &mut bytes as *mut u64) };
    if r != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    Ok(bytes)
}

/// Drops the pages the kernel caches of block device `dev` (writing back
/// any dirty one first), so the next reads come from the disk the host
/// attached at this boot. A regular file (tests) is left alone.
pub fn forget_cached(dev: &Path) -> Result<(), SessionDiskError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileTypeExt;
    let err = |source| SessionDiskError::Probe {
        dev: dev.to_path_buf(),
        source,
    };
    let f = File::open(dev).map_err(err)?;
    if !f.metadata().map_err(err)?.file_type().is_block_device() {
        return Ok(());
    }
    // SAFETY: BLKFLSBUF takes no argument; the descriptor is open for the
    // call.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKFLSBUF, 0) };
    if r != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    Ok(())
}

/// Grows the ext4 filesystem of `dev`, mounted on `target`, to fill the
/// disk. Returns the old and new block counts when it grew, `None` when the
/// filesystem already fills the disk.
pub fn grow(dev: &Path, target: &Path) -> Result<Option<(u64, u64)>, SessionDiskError> {
    use std::os::fd::AsRawFd;
    let fs = fs_size(dev)?;
    let want = disk_bytes(dev)? / fs.block_size;
    if want <= fs.blocks {
        return Ok(None);
    }
    let fail = |source| SessionDiskError::Grow {
        target: target.to_path_buf(),
        from: fs.blocks,
        to: want,
        source,
    };
    let dir = File::open(target).map_err(fail)?;
    // SAFETY: EXT4_IOC_RESIZE_FS reads one u64 through the pointer, which
    // points at a live u64; the descriptor is the mounted filesystem's root.
    let r = unsafe { libc::ioctl(dir.as_raw_fd(), EXT4_IOC_RESIZE_FS, &want as *const u64) };
    if r != 0 {
        return Err(fail(io::Error::last_os_error()));
    }
    Ok(Some((fs.blocks, want)))
}

/// The block device (name under `sys_block`, e.g. `vdb`) whose `serial`
/// attribute is `serial` (surrounding whitespace and NULs ignored).
pub fn find_disk_by_serial(sys_block: &Path, serial: &str) -> Option<String> {
    let mut names: Vec<String> = std::fs::read_dir(sys_block)
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    // Deterministic when (wrongly) two disks carry the serial.
    names.sort();
    names.into_iter().find(|name| {
        std::fs::read(sys_block.join(name).join("serial")).is_ok_and(|raw| {
            String::from_utf8_lossy(&raw).trim_matches(|c: char| c.is_whitespace() || c == '\0')
                == serial
        })
    })
}

/// Classifies the first bytes of a disk (up to [`PROBE_LEN`]).
pub fn classify(head: &[u8]) -> DiskContents {
    if Superblock::in_head(head).is_some() {
        DiskContents::Ext
    } else if head.iter().all(|&b| b == 0) {
        DiskContents::Blank
    } else {
        DiskContents::Unknown
    }
}

/// Reads the first [`PROBE_LEN`] bytes of `dev` (fewer if it is smaller) and
/// classifies them.
pub fn probe(dev: &Path) -> Result<DiskContents, SessionDiskError> {
    read_head(dev).map(|head| classify(&head))
}

/// Bytes read first: an ext superblock (at 1 KiB) is in them, and a disk
/// that has one needs no more reading (the usual case, every start but the
/// first; a whole [`PROBE_LEN`] costs a warm start tens of milliseconds of
/// guest I/O under emulation).
pub const EXT_PROBE_LEN: usize = 4096;

/// The first [`PROBE_LEN`] bytes of `dev` (fewer if it is smaller), or only
/// the first [`EXT_PROBE_LEN`] when they hold an ext superblock (which
/// [`classify`] decides on alone).
fn read_head(dev: &Path) -> Result<Vec<u8>, SessionDiskError> {
    let err = |source| SessionDiskError::Probe {
        dev: dev.to_path_buf(),
        source,
    };
    let mut file = File::open(dev).map_err(err)?;
    let mut head = Vec::with_capacity(PROBE_LEN);
    (&mut file)
        .take(EXT_PROBE_LEN as u64)
        .read_to_end(&mut head)
        .map_err(err)?;
    if Superblock::in_head(&head).is_some() {
        return Ok(head);
    }
    file.take((PROBE_LEN - head.len()) as u64)
        .read_to_end(&mut head)
        .map_err(err)?;
    Ok(head)
}

/// Whether the last [`TAIL_LEN`] bytes of `dev` (all of it if smaller)
/// read as zeroes.
fn tail_is_zero(dev: &Path) -> Result<bool, SessionDiskError> {
    let err = |source| SessionDiskError::Probe {
        dev: dev.to_path_buf(),
        source,
    };
    let len = disk_bytes(dev).map_err(|e| match e {
        SessionDiskError::Size { source, .. } => err(source),
        other => other,
    })?;
    let start = len.saturating_sub(TAIL_LEN);
    let mut tail = vec![0u8; usize::try_from(len - start).unwrap_or(0)];
    File::open(dev)
        .and_then(|f| f.read_exact_at(&mut tail, start))
        .map_err(err)?;
    Ok(tail.iter().all(|&b| b == 0))
}

/// The first existing program of `candidates`.
pub fn find_mkfs(candidates: &[&str]) -> Option<PathBuf> {
    candidates.iter().map(PathBuf::from).find(|p| p.is_file())
}

/// The first of `bundles` holding a whole mke2fs bundle (see
/// [`MKFS_BUNDLE`]), as the program to run: its loader.
pub fn find_bundle(bundles: &[&Path]) -> Option<PathBuf> {
    bundles
        .iter()
        .find(|d| d.join(MKFS_LOADER).is_file() && d.join(MKFS_PROGRAM).is_file())
        .map(|d| d.to_path_buf())
}

/// Copies the mke2fs bundle `from` to `to` (made 0755), so that it
/// outlives the initramfs; an image without one is not an error.
pub fn carry_mkfs(from: &Path, to: &Path) -> io::Result<bool> {
    if !from.is_dir() {
        return Ok(false);
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(MOUNT_DIR_MODE)
        .create(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(true)
}

/// The command that runs mke2fs: a bundle's program through its loader
/// (`mkfs` names the bundle's directory), or `mkfs` itself.
fn mkfs_command(mkfs: &Path) -> Command {
    if mkfs.is_dir() {
        let mut c = Command::new(mkfs.join(MKFS_LOADER));
        c.arg("--library-path")
            .arg(mkfs)
            .arg(mkfs.join(MKFS_PROGRAM))
            .env("MKE2FS_CONFIG", mkfs.join(MKFS_CONF));
        c
    } else {
        Command::new(mkfs)
    }
}

/// Formats `dev` as ext4 with `mkfs` (mke2fs, or a bundle's directory, see
/// [`find_bundle`]), labelled [`FS_LABEL`].
pub fn format(mkfs: &Path, dev: &Path) -> Result<(), SessionDiskError> {
    let mut child = mkfs_command(mkfs)
        .args(["-t", "ext4", "-F", "-q", "-L", FS_LABEL])
        .arg(dev)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| SessionDiskError::MkfsSpawn {
            mkfs: mkfs.to_path_buf(),
            source,
        })?;
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if start.elapsed() < MKFS_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Ok(None) | Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(SessionDiskError::MkfsTimeout {
                    mkfs: mkfs.to_path_buf(),
                    dev: dev.to_path_buf(),
                });
            }
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut output = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut output);
    }
    Err(SessionDiskError::MkfsFailed {
        mkfs: mkfs.to_path_buf(),
        dev: dev.to_path_buf(),
        status: status.to_string(),
        output: output.trim().to_string(),
    })
}

/// The kernel log (`/dev/kmsg`), where a failed mount says why.
pub const KMSG: &str = "/dev/kmsg";

/// Most kernel log records read when looking for a mount's reason (the
/// ring buffer of our guest kernel holds fewer).
const KMSG_MAX_RECORDS: usize = 10_000;

/// Bytes of the buffer one kernel log record is read into (a record is at
/// most 8 KiB, the kernel's `PRINTK_MESSAGE_MAX`).
const KMSG_RECORD_MAX: usize = 8192;

/// The text of the last record in the kernel log at `kmsg` that names the
/// device `dev_name` in parentheses, as filesystems do (`EXT4-fs (vdb):
/// Invalid log block size: 20`), or `None`. Reads without blocking.
pub fn kernel_says(kmsg: &Path, dev_name: &str) -> Option<String> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(kmsg)
        .ok()?;
    let needle = format!("({dev_name})");
    let mut last = None;
    let mut buf = vec![0u8; KMSG_RECORD_MAX];
    for _ in 0..KMSG_MAX_RECORDS {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            // EPIPE: a record was overwritten while reading; go on.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        };
        let rec = String::from_utf8_lossy(&buf[..n]);
        // `prio,seq,usec,flags;text`, then optional ` KEY=value` lines.
        let text = rec
            .split_once(';')
            .map_or(&*rec, |(_, t)| t)
            .lines()
            .next()
            .unwrap_or_default();
        if text.contains(&needle) {
            last = Some(text.trim().to_string());
        }
    }
    last
}

/// Mounts `dev` (ext4) on `target`, creating `target` if needed. Already a
/// mount point: nothing to do. A failure carries the kernel's reason when
/// its log has one ([`kernel_says`]).
pub fn mount(dev: &Path, target: &Path) -> Result<(), SessionDiskError> {
    let fail = |source| SessionDiskError::Mount {
        dev: dev.to_path_buf(),
        target: target.to_path_buf(),
        source,
        kernel: dev
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| kernel_says(Path::new(KMSG), n)),
    };
    mounttable::mount_unless_mounted(
        dev,
        target,
        FSTYPE,
        libc::MS_NOSUID | libc::MS_NODEV,
        MOUNT_DIR_MODE,
    )
    .map_err(fail)
}

/// What [`prepare`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    /// No disk with the serial.
    NoDisk,
    /// The disk was formatted, then mounted.
    Formatted(PathBuf),
    /// The disk already had a filesystem and was mounted.
    Mounted(PathBuf),
}

/// Finds, formats if blank, and mounts the session disk: the steps of the
/// module docs with every location passed in (tests use a fake sysfs and
/// image files).
pub fn prepare(
    sys_block: &Path,
    dev_dir: &Path,
    mkfs_candidates: &[&str],
    target: &Path,
) -> Result<Prepared, SessionDiskError> {
    let Some(name) = find_disk_by_serial(sys_block, proto::SESSION_DISK_SERIAL) else {
        return Ok(Prepared::NoDisk);
    };
    let dev = dev_dir.join(&name);
    forget_cached(&dev)?;
    let head = read_head(&dev)?;
    let formatted = match classify(&head) {
        DiskContents::Ext => {
            if Superblock::in_head(&head).is_some_and(|sb| sb.needs_recovery()) {
                tracing::warn!(
                    dev = %dev.display(),
                    "the session disk was not cleanly unmounted; ext4 replays its journal"
                );
            }
            false
        }
        DiskContents::Unknown => return Err(SessionDiskError::Foreign(dev)),
        DiskContents::Blank if !tail_is_zero(&dev)? => return Err(SessionDiskError::Foreign(dev)),
        DiskContents::Blank => {
            let mkfs = find_bundle(&[Path::new(MKFS_CARRIED), Path::new(MKFS_BUNDLE)])
                .or_else(|| find_mkfs(mkfs_candidates))
                .ok_or(SessionDiskError::NoMkfs)?;
            tracing::info!(dev = %dev.display(), mkfs = %mkfs.display(), "formatting the blank session disk as ext4");
            format(&mkfs, &dev)?;
            true
        }
    };
    mount(&dev, target)?;
    if !formatted {
        match grow(&dev, target) {
            Ok(Some((from, to))) => tracing::info!(
                dev = %dev.display(),
                from_blocks = from,
                to_blocks = to,
                "session disk filesystem grown to the whole disk"
            ),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "session disk keeps its old size"),
        }
    }
    Ok(if formatted {
        Prepared::Formatted(dev)
    } else {
        Prepared::Mounted(dev)
    })
}

/// What [`mount_session_disk`] did at this boot, for the hello.
static OUTCOME: OnceLock<proto::SessionDiskInfo> = OnceLock::new();

/// What [`mount_session_disk`] did at this boot (`None` when it did not
/// run: the agent is not a VM's init).
pub fn outcome() -> Option<proto::SessionDiskInfo> {
    OUTCOME.get().cloned()
}

/// The hello's report of a [`prepare`] result.
pub fn report(result: &Result<Prepared, SessionDiskError>) -> proto::SessionDiskInfo {
    use proto::SessionDiskInfo as Info;
    let (state, dev, error) = match result {
        Ok(Prepared::NoDisk) => (Info::ABSENT, None, None),
        Ok(Prepared::Formatted(dev)) => (Info::FORMATTED, Some(dev), None),
        Ok(Prepared::Mounted(dev)) => (Info::MOUNTED, Some(dev), None),
        Err(e) => (Info::FAILED, None, Some(e.to_string())),
    };
    Info {
        state: state.to_string(),
        dev: dev.map(|d| d.display().to_string()),
        error,
    }
}

/// [`prepare`] for the running VM, mounting on `target` (`/sessions` of the
/// root the sessions will see: the initramfs's, or the new root's before
/// the agent switches to it), logging the outcome and keeping it for the
/// hello ([`outcome`]); the host refuses a boot whose disk failed.
pub fn mount_session_disk(target: &Path) {
    let result = prepare(
        Path::new(SYS_BLOCK),
        Path::new(DEV_DIR),
        &MKFS_CANDIDATES,
        target,
    );
    match &result {
        Ok(Prepared::NoDisk) => tracing::info!(
            serial = proto::SESSION_DISK_SERIAL,
            "no session disk; sessions live on the root filesystem"
        ),
        Ok(Prepared::Formatted(dev)) => tracing::info!(
            dev = %dev.display(),
            target_dir = %target.display(),
            "session disk formatted and mounted"
        ),
        Ok(Prepared::Mounted(dev)) => tracing::info!(
            dev = %dev.display(),
            target_dir = %target.display(),
            "session disk mounted"
        ),
        Err(e) => {
            tracing::error!(error = %e, "session disk not mounted and not formatted; the host is told")
        }
    }
    let _ = OUTCOME.set(report(&result));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};

    /// Where the ext magic lies in a disk holding an ext filesystem.
    const EXT_MAGIC_AT: usize = extfs::SUPERBLOCK_OFFSET as usize + extfs::MAGIC_AT;

    /// A fake `/sys/block` with `(name, serial)` entries (`None`: no serial
    /// attribute, as for loop devices).
    fn sysfs(dir: &Path, disks: &[(&str, Option<&str>)]) -> PathBuf {
        let root = dir.join("sys-block");
        for (name, serial) in disks {
            let d = root.join(name);
            std::fs::create_dir_all(&d).unwrap();
            if let Some(s) = serial {
                std::fs::write(d.join("serial"), s).unwrap();
            }
        }
        root
    }

    fn image(dir: &Path, name: &str, len: u64) -> PathBuf {
        let p = dir.join(name);
        File::create(&p).unwrap().set_len(len).unwrap();
        p
    }

    #[test]
    fn finds_the_disk_by_serial() {
        let t = tempfile::tempdir().unwrap();
        let sys = sysfs(
            t.path(),
            &[
                ("loop0", None),
                ("vda", Some("cowork-rootfs\n")),
                ("vdb", Some("cowork-sessions\n")),
                ("vdc", Some("cowork-sessions-old")),
            ],
        );
        assert_eq!(
            find_disk_by_serial(&sys, proto::SESSION_DISK_SERIAL).as_deref(),
            Some("vdb")
        );
        // GET_ID answers are NUL-padded to 20 bytes.
        let sys2 = sysfs(
            &t.path().join("2"),
            &[("vdz", Some("cowork-sessions\0\0\0\0\0"))],
        );
        assert_eq!(
            find_disk_by_serial(&sys2, proto::SESSION_DISK_SERIAL).as_deref(),
            Some("vdz")
        );
        assert_eq!(find_disk_by_serial(&sys, "nope"), None);
        assert_eq!(find_disk_by_serial(&t.path().join("missing"), "x"), None);
    }

    #[test]
    fn classifies_blank_ext_and_foreign_disks() {
        let mut head = vec![0u8; PROBE_LEN];
        assert_eq!(classify(&head), DiskContents::Blank);
        head[EXT_MAGIC_AT..EXT_MAGIC_AT + 2].copy_from_slice(&extfs::MAGIC.to_le_bytes());
        assert_eq!(classify(&head), DiskContents::Ext);
        // Any other byte makes it foreign: a GPT header, another fs...
        let mut gpt = vec![0u8; PROBE_LEN];
        gpt[512..520].copy_from_slice(b"EFI PART");
        assert_eq!(classify(&gpt), DiskContents::Unknown);
        let mut late = vec![0u8; PROBE_LEN];
        late[PROBE_LEN - 1] = 1;
        assert_eq!(classify(&late), DiskContents::Unknown);
        // The magic alone in a short read; a disk shorter than the probe.
        assert_eq!(classify(&head[..EXT_MAGIC_AT + 2]), DiskContents::Ext);
        assert_eq!(classify(&[0u8; 512]), DiskContents::Blank);
        assert_eq!(classify(&[]), DiskContents::Blank);
    }

    #[test]
    fn probe_reads_image_files() {
        let t = tempfile::tempdir().unwrap();
        let blank = image(t.path(), "blank", 16 << 20);
        assert_eq!(probe(&blank).unwrap(), DiskContents::Blank);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&blank)
            .unwrap();
        f.write_all_at(&extfs::MAGIC.to_le_bytes(), EXT_MAGIC_AT as u64)
            .unwrap();
        assert_eq!(probe(&blank).unwrap(), DiskContents::Ext);
        let foreign = image(t.path(), "foreign", 1 << 20);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&foreign)
            .unwrap();
        f.write_all_at(b"\x55\xaa", 510).unwrap();
        assert_eq!(probe(&foreign).unwrap(), DiskContents::Unknown);
        // Past the first read: without a superblock the whole probe is read.
        let late = image(t.path(), "late", 2 << 20);
        let f = std::fs::OpenOptions::new().write(true).open(&late).unwrap();
        f.write_all_at(b"\x01", (PROBE_LEN - 1) as u64).unwrap();
        assert_eq!(probe(&late).unwrap(), DiskContents::Unknown);
        assert!(matches!(
            probe(&t.path().join("none")),
            Err(SessionDiskError::Probe { .. })
        ));
    }

    /// The image's layout: the host's mke2fs, its libraries and loader in
    /// one directory, carried elsewhere, formats a disk through the loader.
    #[test]
    fn a_carried_mke2fs_bundle_formats_through_its_loader() {
        let Some(mke2fs) = find_mkfs(&["/sbin/mke2fs", "/usr/sbin/mke2fs"]) else {
            eprintln!("skipping: no mke2fs on this host");
            return;
        };
        let d = tempfile::tempdir().unwrap();
        let bundle = d.path().join("bundle");
        std::fs::create_dir(&bundle).unwrap();
        std::fs::copy(&mke2fs, bundle.join(MKFS_PROGRAM)).unwrap();
        let ldd = Command::new("ldd").arg(&mke2fs).output().unwrap();
        for line in String::from_utf8_lossy(&ldd.stdout).lines() {
            let path = line
                .split("=>")
                .nth(1)
                .unwrap_or(line)
                .split_whitespace()
                .next()
                .unwrap_or("");
            if !path.starts_with('/') {
                continue;
            }
            let name = if path.contains("ld-linux") {
                MKFS_LOADER.to_string()
            } else {
                Path::new(path)
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            };
            std::fs::copy(path, bundle.join(name)).unwrap();
        }
        let carried = d.path().join("run/cowork/mkfs");
        assert!(carry_mkfs(&bundle, &carried).unwrap());
        assert!(!carry_mkfs(&d.path().join("none"), &carried).unwrap());
        assert_eq!(
            find_bundle(&[&d.path().join("none"), &carried]),
            Some(carried.clone())
        );
        let img = d.path().join("disk.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        format(&carried, &img).unwrap();
        assert_eq!(probe(&img).unwrap(), DiskContents::Ext);
    }

    /// What a restored VM could meet: the block device's cache holds a
    /// block the disk no longer has (here the backing file changed behind
    /// a loop device); after [`forget_cached`] the read sees the disk.
    #[test]
    fn forgetting_the_cache_reads_what_the_disk_holds_now() {
        let d = tempfile::tempdir().unwrap();
        let img = image(d.path(), "disk.img", 4 << 20);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&img)
            .unwrap()
            .write_all_at(b"before", 0)
            .unwrap();
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&img)
            .output()
            .expect("losetup (util-linux) runs");
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
        struct Detach<'a>(&'a Path);
        impl Drop for Detach<'_> {
            fn drop(&mut self) {
                let _ = Command::new("losetup").arg("-d").arg(self.0).status();
            }
        }
        let _detach = Detach(&dev);
        // The kernel drops a block device's cache at its last close: a
        // holder keeps it, as anything in a guest holding the disk open
        // would.
        let _holder = File::open(&dev).unwrap();
        let read6 = || {
            let mut b = [0u8; 6];
            File::open(&dev).unwrap().read_exact_at(&mut b, 0).unwrap();
            b
        };
        assert_eq!(&read6(), b"before");
        // Another disk's contents now (written around the loop device's
        // cache, as a restore swaps the disk under the guest's).
        let f = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&img)
            .unwrap();
        let mut block = vec![0u8; 8192];
        let off = block.as_ptr().align_offset(4096);
        block[off..off + 5].copy_from_slice(b"after");
        f.write_all_at(&block[off..off + 4096], 0).unwrap();
        assert_eq!(&read6(), b"before", "the stale block is cached");
        forget_cached(&dev).unwrap();
        assert_eq!(&read6()[..5], b"after");
        // A regular file (the tests' disks) is left alone.
        forget_cached(&img).unwrap();
        assert!(forget_cached(&d.path().join("none")).is_err());
    }

    #[test]
    fn prepare_refuses_foreign_disks_and_reports_missing_mkfs() {
        let t = tempfile::tempdir().unwrap();
        let sys = sysfs(t.path(), &[("vdb", Some(proto::SESSION_DISK_SERIAL))]);
        let dev = t.path().join("dev");
        std::fs::create_dir(&dev).unwrap();
        let target = t.path().join("sessions");
        // No disk with the serial.
        let other = sysfs(&t.path().join("o"), &[("vda", Some("x"))]);
        assert_eq!(
            prepare(&other, &dev, &[], &target).unwrap(),
            Prepared::NoDisk
        );
        // A foreign disk is never formatted.
        let img = image(&dev, "vdb", 1 << 20);
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(b"not a filesystem", 0).unwrap();
        assert!(matches!(
            prepare(&sys, &dev, &["/bin/false"], &target),
            Err(SessionDiskError::Foreign(_))
        ));
        assert_eq!(
            std::fs::read(&img).unwrap()[..16],
            *b"not a filesystem",
            "untouched"
        );
        // A blank disk without mkfs in the image.
        f.write_all_at(&[0u8; 16], 0).unwrap();
        assert!(matches!(
            prepare(&sys, &dev, &["/nonexistent/mkfs.ext4"], &target),
            Err(SessionDiskError::NoMkfs)
        ));
        // A failing mkfs is reported with its status.
        assert!(matches!(
            format(Path::new("/bin/false"), &img),
            Err(SessionDiskError::MkfsFailed { .. })
        ));
        // A zero head is not enough: a GPT backup header in the last
        // sector makes the disk foreign, and it is left as it was.
        f.set_len(8 << 20).unwrap();
        f.write_all_at(b"EFI PART", (8 << 20) - 512).unwrap();
        let result = prepare(&sys, &dev, &["/bin/false"], &target);
        assert!(
            matches!(result, Err(SessionDiskError::Foreign(_))),
            "{result:?}"
        );
        let mut back = [0u8; 8];
        File::open(&img)
            .unwrap()
            .read_exact_at(&mut back, (8 << 20) - 512)
            .unwrap();
        assert_eq!(&back, b"EFI PART", "untouched");
        // The hello says it failed, and why.
        let info = report(&result);
        assert_eq!(info.state, proto::SessionDiskInfo::FAILED);
        assert!(
            info.error
                .as_deref()
                .is_some_and(|e| e.contains("left untouched")),
            "{info:?}"
        );
    }

    #[test]
    fn the_kernels_reason_is_its_last_record_about_the_device() {
        let t = tempfile::tempdir().unwrap();
        // A regular file reads in one go, which is one record as
        // /dev/kmsg gives it.
        let kmsg = t.path().join("kmsg");
        std::fs::write(
            &kmsg,
            "3,812,2419553,-;EXT4-fs (vdb): Invalid log block size: 20\n SUBSYSTEM=block\n",
        )
        .unwrap();
        assert_eq!(
            kernel_says(&kmsg, "vdb").as_deref(),
            Some("EXT4-fs (vdb): Invalid log block size: 20")
        );
        assert_eq!(kernel_says(&kmsg, "vda"), None);
        assert_eq!(kernel_says(&t.path().join("none"), "vdb"), None);
    }

    #[test]
    fn the_hello_reports_each_outcome() {
        use proto::SessionDiskInfo as Info;
        let r = report(&Ok(Prepared::NoDisk));
        assert_eq!(
            (r.state.as_str(), r.dev, r.error),
            (Info::ABSENT, None, None)
        );
        let r = report(&Ok(Prepared::Formatted("/dev/vdb".into())));
        assert_eq!(
            (r.state.as_str(), r.dev.as_deref()),
            (Info::FORMATTED, Some("/dev/vdb"))
        );
        let r = report(&Ok(Prepared::Mounted("/dev/vdb".into())));
        assert_eq!((r.state.as_str(), r.error), (Info::MOUNTED, None));
        let r = report(&Err(SessionDiskError::Mount {
            dev: "/dev/vdb".into(),
            target: "/sessions".into(),
            source: io::Error::from_raw_os_error(libc::EINVAL),
            kernel: Some("EXT4-fs (vdb): Invalid log block size: 20".into()),
        }));
        assert_eq!(r.state, Info::FAILED);
        let error = r.error.unwrap();
        assert!(
            error.contains("cannot mount session disk /dev/vdb on /sessions")
                && error.ends_with("(kernel: EXT4-fs (vdb): Invalid log block size: 20)"),
            "{error}"
        );
        // Not a VM's init in a unit test: nothing to report.
        assert_eq!(outcome(), None);
    }

    #[test]
    fn formats_a_blank_image_with_the_hosts_mke2fs() {
        let Some(mkfs) = find_mkfs(&["/sbin/mke2fs", "/usr/sbin/mke2fs"]) else {
            eprintln!("skipping: no mke2fs on this host");
            return;
        };
        let t = tempfile::tempdir().unwrap();
        let img = image(t.path(), "sessiondata.img", 64 << 20);
        assert_eq!(probe(&img).unwrap(), DiskContents::Blank);
        format(&mkfs, &img).unwrap();
        assert_eq!(probe(&img).unwrap(), DiskContents::Ext);
        // Label and type as the agent asked.
        let head = {
            let mut b = vec![0u8; 2048];
            File::open(&img).unwrap().read_exact_at(&mut b, 0).unwrap();
            b
        };
        let sb = Superblock::in_head(&head).unwrap();
        assert_eq!(sb.label().as_deref(), Some(FS_LABEL));
        // s_feature_incompat bit 0x40 (extents): ext4, not ext2.
        assert_ne!(sb.incompat().unwrap() & 0x40, 0, "extents enabled");
        // mke2fs leaves no journal to replay.
        assert!(!sb.needs_recovery());
        // The size the grow step compares with the disk: the whole image.
        let size = fs_size(&img).unwrap();
        assert_eq!(size.blocks * size.block_size, 64 << 20);
        assert_eq!(disk_bytes(&img).unwrap(), 64 << 20);
        // After the host grows the image, the disk is larger than the fs.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&img)
            .unwrap()
            .set_len(128 << 20)
            .unwrap();
        assert_eq!(disk_bytes(&img).unwrap() / size.block_size, 2 * size.blocks);
    }
}
