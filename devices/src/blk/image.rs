//! Host storage behind a virtio-blk disk: the [`BlockBackend`] trait, raw
//! image files ([`RawImage`]) and [`create_sparse_image`].
//!
//! A backend is addressed in bytes; the request layer has already checked
//! every range against [`BlockBackend::size`] and converted sectors, so a
//! backend only sees in-range, overflow-free offsets. I/O is positional
//! (`pread`/`pwrite`), synchronous and retried on `EINTR` and short
//! transfers.
//!
//! Images are locked while open (`flock`: shared for read-only use,
//! exclusive for writing), so two VMs cannot write one image at once.
//!
//! Limits: an image's size is read once when it is opened; a host process
//! that truncates the file underneath makes later reads past the new end
//! fail with an I/O error (reported to the guest as `VIRTIO_BLK_S_IOERR`)
//! rather than read zeroes.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use tracing::{debug, info};

/// Bytes written at a time when a range must be zeroed by writing (the host
/// filesystem cannot punch holes).
const ZERO_WRITE_CHUNK: usize = 256 * 1024;

/// Errors opening or creating images.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The image file could not be opened.
    #[error("cannot open disk image {path}: {source}; check that it exists and is readable (and writable for a read-write disk)")]
    Open {
        /// Image path.
        path: PathBuf,
        /// OS error.
        source: io::Error,
    },
    /// The image is not a regular file.
    #[error("disk image {0} is not a regular file")]
    NotAFile(PathBuf),
    /// The image holds less than one sector.
    #[error("disk image {path} is {size} bytes; a disk needs at least one 512-byte sector")]
    TooSmall {
        /// Image path.
        path: PathBuf,
        /// Its size in bytes.
        size: u64,
    },
    /// Another disk (this process or another helper) has the image open in
    /// a conflicting mode.
    #[error(
        "disk image {0} is in use by another VM (it is locked); stop that VM or use another image"
    )]
    Locked(PathBuf),
    /// The requested size of a new image is unusable.
    #[error("disk size {0} bytes is invalid; it must be a positive multiple of 512")]
    InvalidSize(u64),
    /// Creating or growing an image failed.
    #[error("cannot create disk image {path}: {source}; check the directory exists, is writable and has room")]
    Create {
        /// Image path.
        path: PathBuf,
        /// OS error.
        source: io::Error,
    },
}

/// Host storage of one disk, addressed in bytes.
///
/// Callers guarantee `offset + len <= size()` for every access.
pub trait BlockBackend: Send + Sync {
    /// Size of the disk in bytes (the guest sees `size / 512` sectors).
    fn size(&self) -> u64;
    /// Whether writes are refused (the device then offers `VIRTIO_BLK_F_RO`).
    fn read_only(&self) -> bool;
    /// Fills `buf` from `offset`.
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `buf` at `offset`.
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable (fdatasync, plus any metadata the
    /// backend keeps).
    fn flush(&mut self) -> io::Result<()>;
    /// The guest no longer needs `len` bytes at `offset`; their contents are
    /// unspecified afterwards. May do nothing.
    fn discard(&mut self, offset: u64, len: u64) -> io::Result<()>;
    /// `len` bytes at `offset` read as zeroes afterwards.
    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()>;
}

/// A raw image file: byte `n` of the file is byte `n` of the disk.
#[derive(Debug)]
pub struct RawImage {
    file: File,
    path: PathBuf,
    size: u64,
    read_only: bool,
}

impl RawImage {
    /// Opens `path` read-write (the session disk).
    pub fn open(path: &Path) -> Result<Self, ImageError> {
        Self::open_with(path, false)
    }

    /// Opens `path` read-only; the guest sees a read-only disk.
    pub fn open_read_only(path: &Path) -> Result<Self, ImageError> {
        Self::open_with(path, true)
    }

    fn open_with(path: &Path, read_only: bool) -> Result<Self, ImageError> {
        let file = open_image_file(path, read_only)?;
        let size = image_size(&file, path)?;
        info!(path = %path.display(), size, read_only, "blk: raw image opened");
        Ok(Self {
            file,
            path: path.to_path_buf(),
            size,
            read_only,
        })
    }

    /// The image's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Opens an image file for a disk, refusing non-regular files, and locks
/// it: shared for a read-only disk, exclusive for a writable one (`flock`,
/// advisory: two VMs writing one image would corrupt it).
pub(crate) fn open_image_file(path: &Path, read_only: bool) -> Result<File, ImageError> {
    let file = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| ImageError::Open {
            path: path.to_path_buf(),
            source,
        })?;
    let meta = file.metadata().map_err(|source| ImageError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.is_file() {
        return Err(ImageError::NotAFile(path.to_path_buf()));
    }
    lock_file(&file, !read_only, path)?;
    Ok(file)
}

/// `flock(LOCK_NB)` on an image: exclusive or shared. Released when the
/// file is closed.
pub(crate) fn lock_file(file: &File, exclusive: bool, path: &Path) -> Result<(), ImageError> {
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    } | libc::LOCK_NB;
    loop {
        // SAFETY: flock on an owned descriptor.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => return Err(ImageError::Locked(path.to_path_buf())),
            _ => {
                return Err(ImageError::Open {
                    path: path.to_path_buf(),
                    source: e,
                })
            }
        }
    }
}

/// The usable size of an image file: its length rounded down to whole
/// sectors.
pub(crate) fn image_size(file: &File, path: &Path) -> Result<u64, ImageError> {
    let len = file
        .metadata()
        .map_err(|source| ImageError::Open {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    let size = len - len % super::SECTOR_SIZE;
    if size == 0 {
        return Err(ImageError::TooSmall {
            path: path.to_path_buf(),
            size: len,
        });
    }
    Ok(size)
}

impl BlockBackend for RawImage {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_bounds(self.size, offset, buf.len() as u64)?;
        self.file.read_exact_at(buf, offset)
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        check_bounds(self.size, offset, buf.len() as u64)?;
        self.file.write_all_at(buf, offset)
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file.sync_data()
    }

    fn discard(&mut self, offset: u64, len: u64) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        check_bounds(self.size, offset, len)?;
        match punch_hole(&self.file, offset, len) {
            Ok(()) => Ok(()),
            // Discard is a hint: a filesystem without hole punching keeps
            // the data.
            Err(e) if is_unsupported(&e) => {
                debug!(path = %self.path.display(), "blk: host cannot punch holes; discard ignored");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        check_bounds(self.size, offset, len)?;
        zero_range(&self.file, offset, len)
    }
}

/// Fails with `InvalidInput` unless `[offset, offset + len)` lies inside a
/// disk of `size` bytes (the request layer checks first; this keeps direct
/// callers of [`BlockBackend`] from growing or misreading an image).
pub(crate) fn check_bounds(size: u64, offset: u64, len: u64) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("range {offset}+{len} outside the {size}-byte disk"),
        )),
    }
}

/// `fallocate(PUNCH_HOLE | KEEP_SIZE)`: the range reads as zeroes and its
/// blocks are released.
pub(crate) fn punch_hole(file: &File, offset: u64, len: u64) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let off =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let l = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    loop {
        // SAFETY: fallocate on an owned descriptor; no memory is passed.
        let r = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                l,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Whether `e` says the filesystem cannot do the `fallocate` mode.
pub(crate) fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
    )
}

/// Makes `len` bytes at `offset` read as zeroes: a punched hole, or written
/// zeroes where the filesystem cannot punch.
pub(crate) fn zero_range(file: &File, offset: u64, len: u64) -> io::Result<()> {
    match punch_hole(file, offset, len) {
        Ok(()) => Ok(()),
        Err(e) if is_unsupported(&e) => write_zeroes_by_writing(file, offset, len),
        Err(e) => Err(e),
    }
}

fn write_zeroes_by_writing(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let zeroes = vec![0u8; ZERO_WRITE_CHUNK.min(usize::try_from(len).unwrap_or(usize::MAX))];
    let mut done = 0u64;
    while done < len {
        let n = zeroes
            .len()
            .min(usize::try_from(len - done).unwrap_or(usize::MAX));
        file.write_all_at(&zeroes[..n], offset + done)?;
        done += n as u64;
    }
    Ok(())
}

/// Creates a sparse image of `size_bytes` at `path` if none exists, for
/// `createVM {diskSizeGB}`. An existing file is never truncated or shrunk
/// (it holds the user's sessions): if it is smaller than `size_bytes` it is
/// grown sparsely, if it is larger it is left as it is. Returns the size of
/// the file afterwards.
///
/// The new file is created with mode 0600 (the session disk holds the
/// user's data).
pub fn create_sparse_image(path: &Path, size_bytes: u64) -> Result<u64, ImageError> {
    if size_bytes == 0 || size_bytes % super::SECTOR_SIZE != 0 || i64::try_from(size_bytes).is_err()
    {
        return Err(ImageError::InvalidSize(size_bytes));
    }
    let err = |source| ImageError::Create {
        path: path.to_path_buf(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
        .map_err(err)?;
    let meta = file.metadata().map_err(err)?;
    if !meta.is_file() {
        return Err(ImageError::NotAFile(path.to_path_buf()));
    }
    let old = meta.len();
    if old >= size_bytes {
        info!(path = %path.display(), size = old, requested = size_bytes, "blk: disk image kept as it is");
        return Ok(old);
    }
    // set_len only ever grows here: the new tail is a hole.
    file.set_len(size_bytes).map_err(err)?;
    file.sync_all().map_err(err)?;
    if old == 0 {
        sync_parent_dir(path).map_err(err)?;
    }
    info!(path = %path.display(), old_size = old, size = size_bytes, "blk: sparse disk image created or grown");
    Ok(size_bytes)
}

/// fsyncs the directory holding `path`, so a new or renamed entry survives
/// a host crash.
pub(crate) fn sync_parent_dir(path: &Path) -> io::Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(parent)?.sync_all()
}
