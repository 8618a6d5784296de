//! A profile's session storage: the sparse session disk the VM backends
//! hand the guest (created by `createVM` or `startVM`, grown but never
//! shrunk) or the sandbox's host sessions directory, and the janitor
//! operations on it (run by the agent, or on the host directory when the
//! sandbox's guest is down).
//!
//! Data safety (issue 11; `tests/data_safety.rs` tests each point):
//!
//! - **Room on the host first.** `createVM` (and `startVM` when it must
//!   create the disk) refuses with [`StorageError::HostFull`] when the
//!   host filesystem holding the profile has less than
//!   [`MIN_HOST_FREE_BYTES`] free (plus what formatting a new disk, or
//!   growing the filesystem into an image's new space, writes:
//!   [`FORMAT_COST_DIVISOR`]): a sparse image is only a
//!   promise, and a guest writing into a full host filesystem gets I/O
//!   errors instead of a clear message. The existing image is not touched.
//! - **No half-made disk.** A new image is made as
//!   `sessiondata.img`[`NEW_DISK_SUFFIX`], sized, fsynced and only then
//!   renamed into place without replacing anything (`RENAME_NOREPLACE`),
//!   and the directory is fsynced; a failure removes the temporary file,
//!   so a later `startVM` never finds a truncated disk it would keep. An
//!   existing image is only ever grown in place (`ftruncate` to a larger
//!   size, which adds a hole and cannot lose data).
//! - **Only a blank disk is formatted.** Before every boot the host
//!   inspects the image ([`inspect_image`]): an ext2/3/4 superblock is
//!   handed to the guest to mount; an image that reads as zeroes from the
//!   first byte to the last is blank and the guest formats it; anything
//!   else is refused with [`StorageError::NotBlank`] and the VM does not
//!   start (the image is left byte for byte as it was). The guest runs its
//!   own check again and reports what it did in its hello; a disk it
//!   could not mount fails `startVM` ([`check_guest_disk`]) instead of
//!   letting sessions silently live on a throw-away root filesystem.
//!
//! Why "every byte zero" and not "zero where signatures live": signatures
//! are all over a disk (ext at 1 KiB, btrfs at 64 KiB, ZFS and GPT
//! copies and md 1.0 superblocks at the end), and a disk whose first
//! blocks were wiped by accident still holds the user's files further in,
//! which `mkfs` would overwrite with fresh metadata. Reading every byte is
//! cheap here because the image is sparse: `SEEK_DATA`/`SEEK_HOLE` skip
//! the holes, so a never-used image costs nothing and only allocated
//! extents are read (a fully allocated zero image of `N` GiB costs reading
//! `N` GiB once, until it is formatted).
//!
//! Limits: `createVM.diskSizeGB` is 1..=[`MAX_SESSION_DISK_GIB`]; under the
//! VM backends the janitor needs a connected guest (only the guest reads
//! the ext4 disk). The free-space check is a snapshot: a host filesystem
//! filled by others after `createVM` still surfaces in the guest as I/O
//! errors. An ext superblock that is present but damaged is only found out
//! by the guest's mount (reported, never repaired or reformatted).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use guest_agent::proto::{Hello, Op, SessionDiskInfo};
use serde_json::Value;

use super::link::op_name;
use super::{ProfileVm, ProfileVmError, CALL_TIMEOUT};

/// Size of the session disk, in GiB, when it must be created and
/// `createVM.diskSizeGB` did not say (or `startVM` came without `createVM`).
pub const DEFAULT_SESSION_DISK_GIB: u64 = 10;

/// Largest `createVM.diskSizeGB` accepted, in GiB (the sparse image costs
/// nothing up front; this only refuses absurd values with a clear error).
pub const MAX_SESSION_DISK_GIB: u64 = 16 * 1024;

/// Free bytes the host filesystem holding the profile must have for
/// `createVM` to succeed: room for the guest to boot, write its first
/// sessions and replay a journal without hitting a full host filesystem
/// (which the guest only sees as I/O errors). 256 MiB is a few minutes of
/// ordinary session writes and far below what any usable host has free.
pub const MIN_HOST_FREE_BYTES: u64 = 256 << 20;

/// A new disk's first format writes about `size / 128` bytes on the host
/// on top of [`MIN_HOST_FREE_BYTES`] (mke2fs 1.47 on a sparse image,
/// measured with `du`: 33 MiB for 1 GiB, 68 MiB for 10 GiB, 517 MiB for
/// 100 GiB; 1/128 is 8 MiB per GiB, above each).
pub const FORMAT_COST_DIVISOR: u64 = 128;

/// Suffix of the temporary file a new session disk is made in before it
/// is renamed into place (`sessiondata.img.new`); a leftover one from a
/// crash is removed by the next attempt.
pub const NEW_DISK_SUFFIX: &str = ".new";

/// Bytes read at a time when looking for non-zero data in an image.
const SCAN_CHUNK: usize = 1 << 20;

/// Bytes of the image's head read to look for an ext superblock (the
/// superblock sits at 1 KiB).
const HEAD_LEN: usize = 4096;

/// Bytes in one GiB (`diskSizeGB` is read as GiB).
const GIB: u64 = 1 << 30;

/// Bytes in one MiB (for messages).
const MIB: u64 = 1 << 20;

/// Errors preparing the session storage, worded for the client's log.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("the host filesystem holding {dir} has {free_mib} MiB free; the session disk needs at least {needed_mib} MiB there ({why}); free some space and retry ({disk} was not changed)")]
    HostFull {
        dir: PathBuf,
        disk: PathBuf,
        free_mib: u64,
        needed_mib: u64,
        why: &'static str,
    },
    #[error("cannot create {path}: {source}")]
    Dir { path: PathBuf, source: io::Error },
    #[error("cannot measure the free space of {path}: {source}")]
    Statvfs { path: PathBuf, source: io::Error },
    #[error("cannot create the session disk {disk}: {source}; nothing was left behind (check that the directory is writable and has room)")]
    Create { disk: PathBuf, source: io::Error },
    #[error("cannot grow the session disk {disk}: {source}")]
    Grow {
        disk: PathBuf,
        source: devices::blk::ImageError,
    },
    #[error("cannot read the session disk {disk} to check it before boot: {source}")]
    Inspect { disk: PathBuf, source: io::Error },
    #[error("the session disk {disk} holds data (first non-zero byte at offset {at}) but no ext4 filesystem; it was left untouched and not formatted. Move it aside (or restore it) and call startVM again to start with a fresh disk")]
    NotBlank { disk: PathBuf, at: u64 },
    #[error("the guest could not use the session disk {disk}: {error}; it was left untouched and not reformatted. Check it on the host (e2fsck -n {disk}), or move it aside to start with a fresh disk")]
    GuestFailed { disk: PathBuf, error: String },
    #[error("the guest did not find the session disk {disk} the host attached (the agent reported {state:?}); sessions would not be kept")]
    GuestMissing { disk: PathBuf, state: String },
    #[error("the disk check failed: {0}")]
    CheckTask(#[source] tokio::task::JoinError),
}

/// Bytes of a `createVM.diskSizeGB` value (GiB), or why it is refused.
pub fn session_disk_bytes(disk_size_gb: u64) -> Result<u64, ProfileVmError> {
    if disk_size_gb == 0 || disk_size_gb > MAX_SESSION_DISK_GIB {
        return Err(ProfileVmError::DiskSize(disk_size_gb));
    }
    Ok(disk_size_gb * GIB)
}

/// What the host finds in a session disk image before a boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostDiskContents {
    /// An ext2/3/4 superblock (whether it mounts is the guest's to say).
    Ext,
    /// Every byte reads as zero: never formatted.
    Blank,
    /// Something else; the first non-zero byte is at this offset.
    Foreign { at: u64 },
}

/// Inspects the image at `path`: an ext superblock in its head, or whether
/// every byte is zero (reading only the allocated extents, see the module
/// docs).
pub fn inspect_image(path: &Path) -> io::Result<HostDiskContents> {
    let file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut head = vec![0u8; HEAD_LEN.min(usize::try_from(len).unwrap_or(HEAD_LEN))];
    file.read_exact_at(&mut head, 0)?;
    if guest_agent::extfs::Superblock::in_head(&head).is_some() {
        return Ok(HostDiskContents::Ext);
    }
    Ok(match first_nonzero(&file, len)? {
        Some(at) => HostDiskContents::Foreign { at },
        None => HostDiskContents::Blank,
    })
}

/// The offset of the first non-zero byte of `file` (`len` bytes long),
/// reading only its data extents.
fn first_nonzero(file: &File, len: u64) -> io::Result<Option<u64>> {
    let mut buf = vec![0u8; SCAN_CHUNK];
    let mut pos = 0u64;
    while pos < len {
        let Some(data) = seek(file, pos, libc::SEEK_DATA)? else {
            return Ok(None);
        };
        let end = seek(file, data, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        let mut at = data;
        while at < end {
            let n = usize::try_from(end - at).map_or(SCAN_CHUNK, |left| left.min(SCAN_CHUNK));
            let got = file.read_at(&mut buf[..n], at)?;
            if got == 0 {
                return Ok(None);
            }
            if let Some(i) = buf[..got].iter().position(|&b| b != 0) {
                return Ok(Some(at + i as u64));
            }
            at += got as u64;
        }
        pos = end.max(data + 1);
    }
    Ok(None)
}

/// `lseek(fd, offset, whence)`; `None` for `ENXIO` (no data past `offset`).
fn seek(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    use std::os::fd::AsRawFd;
    let off = libc::off_t::try_from(offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset past off_t"))?;
    // SAFETY: lseek on an open descriptor; no memory is passed.
    let r = unsafe { libc::lseek(file.as_raw_fd(), off, whence) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(e);
    }
    Ok(u64::try_from(r).ok())
}

/// Free bytes for an unprivileged writer on the filesystem holding `dir`.
pub fn host_free_bytes(dir: &Path) -> io::Result<u64> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    // SAFETY: statvfs is plain data; zeroed is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a pointer to a live statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Free bytes `createVM` needs on the host: [`MIN_HOST_FREE_BYTES`], plus
/// what the guest writes formatting (or growing its filesystem into)
/// `added_bytes` of new disk space.
pub fn host_bytes_needed(added_bytes: u64) -> u64 {
    MIN_HOST_FREE_BYTES + added_bytes / FORMAT_COST_DIVISOR
}

/// Makes a new sparse image of `bytes` at `disk` (which must not exist):
/// in a temporary file, sized, fsynced, renamed into place without
/// replacing anything, directory fsynced. On failure nothing is left.
fn create_new_image(disk: &Path, bytes: u64) -> io::Result<()> {
    let mut tmp_name = disk.as_os_str().to_os_string();
    tmp_name.push(NEW_DISK_SUFFIX);
    let tmp = PathBuf::from(tmp_name);
    // A leftover of a crashed attempt: ours to remove.
    match std::fs::remove_file(&tmp) {
        Ok(()) => tracing::info!(path = %tmp.display(), "removed a half-made session disk"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let made = (|| {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&tmp)?;
        file.set_len(bytes)?;
        file.sync_all()?;
        rename_noreplace(&tmp, disk)?;
        sync_dir(disk)
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    made
}

/// `renameat2(from, to, RENAME_NOREPLACE)`: fails with `EEXIST` rather
/// than replacing an image that appeared meanwhile. Where the filesystem
/// does not offer the flag (`EINVAL`: some network and FUSE filesystems),
/// a hard link then an unlink, which never replace either.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    match renameat2_noreplace(from, to) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            std::fs::hard_link(from, to)?;
            std::fs::remove_file(from)
        }
        other => other,
    }
}

/// The `renameat2` call of [`rename_noreplace`].
fn renameat2_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
    };
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: two NUL-terminated paths relative to the current directory.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// fsyncs the directory holding `path`, so its new entry survives a host
/// crash.
fn sync_dir(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => File::open(p)?.sync_all(),
        _ => File::open(".")?.sync_all(),
    }
}

/// Checks what the agent's hello says it did with the session disk the
/// host attached (`disk`): a disk it could not mount (or did not find)
/// fails the start. An agent that predates the report passes.
pub fn check_guest_disk(disk: &Path, hello: &Hello) -> Result<(), StorageError> {
    let Some(info) = &hello.session_disk else {
        return Ok(());
    };
    match info.state.as_str() {
        SessionDiskInfo::MOUNTED | SessionDiskInfo::FORMATTED => {
            tracing::info!(disk = %disk.display(), state = %info.state, dev = info.dev.as_deref().unwrap_or("-"), "the guest uses the session disk");
            Ok(())
        }
        SessionDiskInfo::FAILED => Err(StorageError::GuestFailed {
            disk: disk.to_path_buf(),
            error: info
                .error
                .clone()
                .unwrap_or_else(|| "no reason given".into()),
        }),
        other => Err(StorageError::GuestMissing {
            disk: disk.to_path_buf(),
            state: other.to_string(),
        }),
    }
}

impl ProfileVm {
    /// Creates (or keeps) the persistent session storage. Sandbox: the
    /// host sessions directory (`disk_size_gb` does not apply). qemu and
    /// kvm: the sparse session disk
    /// [`crate::backend::VmConfig::session_disk`]. An existing disk is never
    /// truncated, shrunk or recreated: with `disk_size_gb` it is grown
    /// sparsely when smaller (the guest's filesystem keeps its size) and
    /// kept when larger; without it (`startVM`) it is kept as it is, and a
    /// missing one is created with [`DEFAULT_SESSION_DISK_GIB`]. Whenever
    /// it runs with `disk_size_gb`, or creates a disk, the host filesystem
    /// must have `host_bytes_needed` free (`StorageError::HostFull`
    /// otherwise, the image untouched); a new disk appears whole or not at
    /// all (see the module docs).
    pub fn create_storage(&self, disk_size_gb: Option<u64>) -> Result<(), ProfileVmError> {
        if !self.cfg.uses_session_disk() {
            return std::fs::create_dir_all(self.cfg.sessions_dir()).map_err(|source| {
                ProfileVmError::Start(super::StartError::SessionsDir {
                    path: self.cfg.sessions_dir(),
                    source,
                })
            });
        }
        let requested = disk_size_gb.map(session_disk_bytes).transpose()?;
        let disk = self.cfg.session_disk();
        let old_len = std::fs::symlink_metadata(&disk).ok().map(|m| m.len());
        let exists = old_len.is_some();
        if requested.is_none() && exists {
            tracing::debug!(disk = %disk.display(), "session disk kept");
            return Ok(());
        }
        let dir = &self.cfg.profile_dir;
        std::fs::create_dir_all(dir).map_err(|source| StorageError::Dir {
            path: dir.clone(),
            source,
        })?;
        let bytes = requested.unwrap_or(DEFAULT_SESSION_DISK_GIB * GIB);
        let added = bytes.saturating_sub(old_len.unwrap_or(0));
        let needed = host_bytes_needed(added);
        let free = host_free_bytes(dir).map_err(|source| StorageError::Statvfs {
            path: dir.clone(),
            source,
        })?;
        if free < needed {
            let e = StorageError::HostFull {
                dir: dir.clone(),
                disk: disk.clone(),
                free_mib: free / MIB,
                needed_mib: needed.div_ceil(MIB),
                why: match (exists, added) {
                    (false, _) => "to create and format it",
                    (true, 0) => "room for the guest's writes",
                    (true, _) => "to grow it and the filesystem in it",
                },
            };
            tracing::error!(error = %e, "session disk refused");
            return Err(e.into());
        }
        if exists {
            let size = devices::blk::create_sparse_image(&disk, bytes).map_err(|source| {
                StorageError::Grow {
                    disk: disk.clone(),
                    source,
                }
            })?;
            tracing::info!(disk = %disk.display(), size, requested = bytes, free, "session disk kept or grown");
            return Ok(());
        }
        create_new_image(&disk, bytes).map_err(|source| StorageError::Create {
            disk: disk.clone(),
            source,
        })?;
        tracing::info!(disk = %disk.display(), size = bytes, free, "session disk created");
        Ok(())
    }

    /// What `startVM` does with the storage before booting:
    /// [`ProfileVm::create_storage`] without a size, then, under the VM backends,
    /// `inspect_image` (off the async threads: it may read the image)
    /// refusing a disk that is neither ext nor blank.
    pub async fn prepare_storage_for_boot(&self) -> Result<(), ProfileVmError> {
        self.create_storage(None)?;
        if !self.cfg.uses_session_disk() {
            return Ok(());
        }
        let disk = self.cfg.session_disk();
        let path = disk.clone();
        let contents = tokio::task::spawn_blocking(move || inspect_image(&path))
            .await
            .map_err(StorageError::CheckTask)?
            .map_err(|source| StorageError::Inspect {
                disk: disk.clone(),
                source,
            })?;
        match contents {
            HostDiskContents::Foreign { at } => {
                let e = StorageError::NotBlank { disk, at };
                tracing::error!(error = %e, "session disk refused");
                Err(e.into())
            }
            other => {
                tracing::debug!(disk = %disk.display(), contents = ?other, "session disk checked");
                Ok(())
            }
        }
    }

    /// `check_guest_disk` for this VM's disk (VM backends only).
    pub(super) fn check_guest_disk(&self, hello: &Hello) -> Result<(), ProfileVmError> {
        if !self.cfg.uses_session_disk() {
            return Ok(());
        }
        check_guest_disk(&self.cfg.session_disk(), hello).map_err(|e| {
            tracing::error!(error = %e, "session disk unusable in the guest");
            e.into()
        })
    }

    /// Runs a janitor operation in the guest, or on the host's session
    /// directory when no guest is connected. Deleted session directories
    /// also lose what the backend granted their mounts.
    pub async fn janitor(&self, op: Op) -> Result<Value, ProfileVmError> {
        let deleting = matches!(op, Op::DeleteSessionDirs { .. });
        let result = self.run_janitor(op).await?;
        if deleting {
            if let Some(host_paths) = self
                .lifecycle
                .lock()
                .await
                .as_ref()
                .map(|m| m.host_paths.clone())
            {
                let deleted = result["deleted"].as_array().into_iter().flatten();
                for session in deleted.filter_map(Value::as_str) {
                    host_paths.release_session(session);
                }
            }
        }
        Ok(result)
    }

    async fn run_janitor(&self, op: Op) -> Result<Value, ProfileVmError> {
        if let Ok(link) = self.connected_link() {
            return link.call(op, &[], CALL_TIMEOUT).await.map(|(v, _)| v);
        }
        if self.cfg.uses_session_disk() {
            let method = match op {
                Op::DiskInfo { .. } => "getSessionsDiskInfo",
                ref other => op_name(other),
            };
            return Err(ProfileVmError::JanitorNeedsGuest {
                op: method,
                backend: self.cfg.backend.as_str(),
                disk: self.cfg.session_disk(),
            });
        }
        let root = self.cfg.sessions_dir();
        let live = self.live_sessions();
        tokio::task::spawn_blocking(move || {
            use guest_agent::janitor;
            std::fs::create_dir_all(&root).map_err(|source| ProfileVmError::JanitorRoot {
                root: root.clone(),
                source,
            })?;
            let outcome = match op {
                Op::DiskInfo { low_water_bytes } => janitor::disk_info(&root, low_water_bytes),
                Op::DeleteSessionDirs { names } => {
                    Ok(janitor::delete_session_dirs(&root, &names, &live))
                }
                Op::PruneSessionCaches {
                    only_if_free_bytes_below,
                    include_session_tmp,
                    session_tmp_older_than_seconds,
                } => janitor::prune_session_caches(
                    &root,
                    only_if_free_bytes_below,
                    include_session_tmp,
                    session_tmp_older_than_seconds,
                    &live,
                ),
                other => return Err(ProfileVmError::NeedsVm(op_name(&other))),
            };
            Ok(outcome?)
        })
        .await
        .map_err(ProfileVmError::JanitorTask)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BackendKind, VmConfig, SESSION_DISK_FILE};
    use std::os::unix::fs::MetadataExt;
    use std::sync::Arc;

    fn vm(backend: BackendKind, dir: &Path) -> Arc<ProfileVm> {
        ProfileVm::new(VmConfig {
            backend,
            profile_dir: dir.join("profile"),
            helper_exe: "/nonexistent/cowork-helper".into(),
            egress: crate::egress::EgressProxy::direct(),
            max_processes: crate::vm::MAX_PROCESSES,
            max_pending_requests: crate::vm::MAX_PENDING_REQUESTS,
        })
    }

    #[test]
    fn the_session_disk_is_created_sparse_grown_and_never_shrunk() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = vm(BackendKind::Qemu, tmp.path());
        let disk = vm.config().session_disk();
        assert_eq!(disk, tmp.path().join("profile").join(SESSION_DISK_FILE));

        vm.create_storage(Some(1)).unwrap();
        let meta = std::fs::metadata(&disk).unwrap();
        assert_eq!(meta.len(), GIB);
        assert!(
            meta.blocks() * 512 < 1 << 20,
            "not sparse: {} blocks",
            meta.blocks()
        );
        assert_eq!(meta.mode() & 0o777, 0o600);
        let data = b"a session's bytes";
        std::os::unix::fs::FileExt::write_all_at(
            &std::fs::OpenOptions::new().write(true).open(&disk).unwrap(),
            data,
            4096,
        )
        .unwrap();

        // startVM keeps the disk as it is; a larger createVM grows it; a
        // smaller one keeps it; the data survives all of them.
        vm.create_storage(None).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), GIB);
        vm.create_storage(Some(2)).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
        vm.create_storage(Some(1)).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
        let mut back = vec![0u8; data.len()];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(&disk).unwrap(),
            &mut back,
            4096,
        )
        .unwrap();
        assert_eq!(&back, data);

        for bad in [0, MAX_SESSION_DISK_GIB + 1, u64::MAX] {
            let e = vm.create_storage(Some(bad)).unwrap_err();
            assert!(e.to_string().contains("diskSizeGB"), "{e}");
        }
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
    }

    #[test]
    fn start_creates_a_missing_disk_with_the_default_size() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = vm(BackendKind::Kvm, tmp.path());
        vm.create_storage(None).unwrap();
        let meta = std::fs::metadata(vm.config().session_disk()).unwrap();
        assert_eq!(meta.len(), DEFAULT_SESSION_DISK_GIB * GIB);
        assert!(!vm.config().sessions_dir().exists());
    }

    #[test]
    fn the_sandbox_keeps_its_host_sessions_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = vm(BackendKind::Sandbox, tmp.path());
        vm.create_storage(Some(1)).unwrap();
        assert!(vm.config().sessions_dir().is_dir());
        assert!(!vm.config().session_disk().exists());
    }

    #[tokio::test]
    async fn the_janitor_needs_the_guest_under_vm_backends() {
        let tmp = tempfile::tempdir().unwrap();
        for backend in [BackendKind::Qemu, BackendKind::Kvm] {
            let vm = vm(backend, tmp.path());
            let e = vm
                .janitor(Op::DiskInfo { low_water_bytes: 0 })
                .await
                .unwrap_err();
            let text = e.to_string();
            assert!(text.contains("getSessionsDiskInfo"), "{text}");
            assert!(text.contains("call startVM first"), "{text}");
            assert!(text.contains(backend.as_str()), "{text}");
            let e = vm
                .janitor(Op::DeleteSessionDirs {
                    names: vec!["s1".into()],
                })
                .await
                .unwrap_err();
            assert!(matches!(e, ProfileVmError::JanitorNeedsGuest { .. }), "{e}");
            // The host never made a sessions directory to fall back on.
            assert!(!vm.config().sessions_dir().exists());
        }
        // The sandbox still measures its host directory.
        let vm = vm(BackendKind::Sandbox, tmp.path());
        let info = vm
            .janitor(Op::DiskInfo { low_water_bytes: 0 })
            .await
            .unwrap();
        assert!(info["totalBytes"].as_u64().unwrap_or(0) > 0, "{info}");
        // A request only the guest serves is refused by the host janitor.
        let e = vm.janitor(Op::Ping).await.unwrap_err();
        assert!(matches!(e, ProfileVmError::NeedsVm("ping")), "{e:?}");
        assert_eq!(e.to_string(), "ping needs a running VM");
    }

    #[test]
    fn a_disk_size_out_of_range_says_the_range() {
        let e = session_disk_bytes(0).unwrap_err();
        assert!(matches!(e, ProfileVmError::DiskSize(0)), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!(
                "createVM: diskSizeGB 0 is out of range; give 1 to {MAX_SESSION_DISK_GIB} (GiB)"
            )
        );
        assert_eq!(session_disk_bytes(1).unwrap(), GIB);
    }

    /// A file of `len` bytes (sparse) with `data` written at `at`.
    fn image(dir: &Path, len: u64, at: u64, data: &[u8]) -> PathBuf {
        let p = dir.join("img");
        let f = File::create(&p).unwrap();
        f.set_len(len).unwrap();
        f.write_all_at(data, at).unwrap();
        p
    }

    #[test]
    fn only_an_image_of_zeroes_is_blank() {
        let tmp = tempfile::tempdir().unwrap();
        // Sparse, never written: blank, whatever its size.
        let p = image(tmp.path(), 4 * GIB, 0, &[]);
        assert_eq!(inspect_image(&p).unwrap(), HostDiskContents::Blank);
        // Zeroes written (allocated) are still blank.
        let p = image(tmp.path(), 8 << 20, 3 << 20, &vec![0u8; 2 << 20]);
        assert_eq!(inspect_image(&p).unwrap(), HostDiskContents::Blank);
        // One byte anywhere, the last one included, is not.
        for at in [0, 4095, 65_600, (1 << 30) + 7, 4 * GIB - 1] {
            let p = image(tmp.path(), 4 * GIB, at, &[0x5a]);
            assert_eq!(
                inspect_image(&p).unwrap(),
                HostDiskContents::Foreign { at },
                "byte at {at}"
            );
        }
        // An ext superblock magic makes it the guest's to mount.
        let magic_at = guest_agent::extfs::SUPERBLOCK_OFFSET + guest_agent::extfs::MAGIC_AT as u64;
        let p = image(
            tmp.path(),
            GIB,
            magic_at,
            &guest_agent::extfs::MAGIC.to_le_bytes(),
        );
        assert_eq!(inspect_image(&p).unwrap(), HostDiskContents::Ext);
        // A tiny image and a missing one.
        let p = image(tmp.path(), 100, 0, &[]);
        assert_eq!(inspect_image(&p).unwrap(), HostDiskContents::Blank);
        assert!(inspect_image(&tmp.path().join("none")).is_err());
    }

    #[test]
    fn a_new_disk_appears_whole_and_replaces_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let disk = tmp.path().join(SESSION_DISK_FILE);
        let leftover = tmp
            .path()
            .join(format!("{SESSION_DISK_FILE}{NEW_DISK_SUFFIX}"));
        std::fs::write(&leftover, b"half-made by a crash").unwrap();
        create_new_image(&disk, GIB).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), GIB);
        assert!(!leftover.exists(), "the leftover temporary file is gone");
        // An image that is already there is never replaced.
        std::fs::write(&disk, b"the user's sessions").unwrap();
        let e = create_new_image(&disk, GIB).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EEXIST), "{e}");
        assert_eq!(std::fs::read(&disk).unwrap(), b"the user's sessions");
        assert!(!leftover.exists(), "nothing left behind on failure");
    }

    #[test]
    fn the_host_needs_room_for_the_disk() {
        assert_eq!(host_bytes_needed(0), MIN_HOST_FREE_BYTES);
        assert_eq!(host_bytes_needed(10 * GIB), MIN_HOST_FREE_BYTES + 80 * MIB);
        let tmp = tempfile::tempdir().unwrap();
        assert!(host_free_bytes(tmp.path()).unwrap() > 0);
        assert!(host_free_bytes(&tmp.path().join("missing")).is_err());
    }

    #[test]
    fn the_guests_report_decides_the_start() {
        let disk = Path::new("/data/sessiondata.img");
        let hello = |state: Option<&str>, error: Option<&str>| Hello {
            session_disk: state.map(|s| SessionDiskInfo {
                state: s.into(),
                dev: Some("/dev/vdb".into()),
                error: error.map(String::from),
            }),
            ..Hello::default()
        };
        // An agent that predates the report, and the two good outcomes.
        for ok in [
            None,
            Some(SessionDiskInfo::MOUNTED),
            Some(SessionDiskInfo::FORMATTED),
        ] {
            check_guest_disk(disk, &hello(ok, None)).unwrap();
        }
        let e = check_guest_disk(
            disk,
            &hello(Some(SessionDiskInfo::FAILED), Some("cannot mount: EINVAL")),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("/data/sessiondata.img")
                && e.contains("cannot mount: EINVAL")
                && e.contains("not reformatted"),
            "{e}"
        );
        let e = check_guest_disk(disk, &hello(Some(SessionDiskInfo::ABSENT), None)).unwrap_err();
        assert!(matches!(e, StorageError::GuestMissing { .. }), "{e}");
    }
}
