//! A read-only base image under a copy-on-write overlay file ([`CowImage`]).
//!
//! The base (a downloaded `rootfs.img`) is opened read-only and never
//! written. Every guest write lands in the overlay, a file of our own
//! format:
//!
//! ```text
//! offset 0            header, HEADER_SIZE (4 KiB) bytes, little-endian:
//!                       0  magic            b"CWRKCOW1"
//!                       8  version          u32 = 1
//!                      12  chunk_shift      u32 (chunk size = 1 << shift)
//!                      16  disk_size        u64, bytes (the base's length,
//!                                           rounded down to 512-byte sectors)
//!                      24  base_len         u64, base file length at creation
//!                      32  base_mtime_sec   i64 } base file mtime at
//!                      40  base_mtime_nsec  u32 } creation
//!                      44  (zero)           u32
//!                      48  bitmap_offset    u64 = HEADER_SIZE
//!                      56  bitmap_len       u64 = ceil(chunks / 8)
//!                      64  data_offset      u64, bitmap end rounded up to a
//!                                           chunk
//!                      72  zero up to HEADER_SIZE
//! bitmap_offset       allocation bitmap: bit (i % 8) of byte (i / 8), least
//!                     significant first, is set when chunk i lives in the
//!                     overlay
//! data_offset         the disk's bytes at their own offsets: chunk i at
//!                     data_offset + i * chunk size; the file is sparse, so
//!                     only allocated chunks take host space
//! ```
//!
//! Reads take each chunk from the overlay when its bit is set, else from
//! the base. The first write to a chunk copies it: the base's chunk is read,
//! patched with the new bytes and written to the overlay (a write covering
//! the whole chunk skips the read), then the bit is set in memory. `FLUSH`
//! fdatasyncs the overlay's data, then writes the changed bitmap pages and
//! fdatasyncs again, so a persisted bit always points at persisted data:
//! after a host crash, chunks first written since the last flush read from
//! the base again (the guest was never told they were durable). Bits only
//! ever go from 0 to 1, so a torn bitmap write cannot expose unsynced data.
//! A clean shutdown flushes on drop.
//!
//! The header records the base's length and mtime. [`CowImage::open`]
//! refuses an overlay whose base changed ([`OverlayError::BaseChanged`]),
//! since its chunks were copied from the old base; the caller then starts a
//! fresh overlay with [`CowImage::create`].
//!
//! `DISCARD` punches holes in allocated chunks it covers wholly (they then
//! read as zeroes) and ignores the rest; `WRITE_ZEROES` allocates the chunks
//! it touches and zeroes the range in the overlay (holes where the host
//! filesystem can punch them).
//!
//! The base is locked shared and the overlay exclusive while open, so two
//! VMs cannot share an overlay (each needs its own).
//!
//! Limits: the overlay never shrinks (chunks the guest discards stay
//! allocated, as holes); the disk has the base's size; a base modified in
//! place while a disk uses it, without changing its mtime, goes unnoticed.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use super::image::{
    check_bounds, image_size, lock_file, open_image_file, punch_hole, sync_parent_dir, zero_range,
    BlockBackend, ImageError,
};

/// Magic at the start of an overlay file.
pub const OVERLAY_MAGIC: [u8; 8] = *b"CWRKCOW1";
/// Overlay format version written and accepted.
pub const OVERLAY_VERSION: u32 = 1;
/// Size of the header; the bitmap starts right after it.
pub const HEADER_SIZE: u64 = 4096;
/// log2 of the default chunk size (64 KiB): the copy-on-write granularity.
pub const DEFAULT_CHUNK_SHIFT: u32 = 16;
/// Smallest chunk shift accepted (4 KiB chunks).
pub const MIN_CHUNK_SHIFT: u32 = 12;
/// Largest chunk shift accepted (16 MiB chunks).
pub const MAX_CHUNK_SHIFT: u32 = 24;
/// Bitmap bytes written back together when a flush finds them changed.
const BITMAP_PAGE: u64 = 4096;

/// Errors opening or creating an overlay.
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    /// The base image could not be opened.
    #[error(transparent)]
    Base(#[from] ImageError),
    /// Reading, writing or syncing the overlay file failed.
    #[error("overlay {path}: {source}; check the directory is writable and has room")]
    Io {
        /// Overlay path.
        path: PathBuf,
        /// OS error.
        source: io::Error,
    },
    /// The overlay file is not in our format, or its header is inconsistent.
    #[error("overlay {path} is not a valid overlay ({reason}); delete it to start a fresh one from the base")]
    Corrupt {
        /// Overlay path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The base image is not the one the overlay was made from.
    #[error("base image {base} changed since overlay {overlay} was created (length or mtime differ); the overlay's chunks no longer match it: start a fresh overlay with CowImage::create")]
    BaseChanged {
        /// Base path.
        base: PathBuf,
        /// Overlay path.
        overlay: PathBuf,
    },
    /// The chunk shift is out of range.
    #[error("overlay chunk shift {0} is out of range {MIN_CHUNK_SHIFT}..={MAX_CHUNK_SHIFT}")]
    ChunkShift(u32),
}

/// Identity of the base file recorded in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BaseId {
    len: u64,
    mtime_sec: i64,
    mtime_nsec: u32,
}

impl BaseId {
    fn of(file: &File) -> io::Result<Self> {
        let m = file.metadata()?;
        Ok(Self {
            len: m.len(),
            mtime_sec: m.mtime(),
            mtime_nsec: u32::try_from(m.mtime_nsec()).unwrap_or(0),
        })
    }
}

/// The parsed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    chunk_shift: u32,
    disk_size: u64,
    base: BaseId,
    bitmap_offset: u64,
    bitmap_len: u64,
    data_offset: u64,
}

impl Header {
    fn new(disk_size: u64, chunk_shift: u32, base: BaseId) -> Self {
        let chunk = 1u64 << chunk_shift;
        let chunks = disk_size.div_ceil(chunk);
        let bitmap_len = chunks.div_ceil(8);
        let data_offset = (HEADER_SIZE + bitmap_len).next_multiple_of(chunk);
        Self {
            chunk_shift,
            disk_size,
            base,
            bitmap_offset: HEADER_SIZE,
            bitmap_len,
            data_offset,
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; HEADER_SIZE as usize];
        b[0..8].copy_from_slice(&OVERLAY_MAGIC);
        b[8..12].copy_from_slice(&OVERLAY_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.chunk_shift.to_le_bytes());
        b[16..24].copy_from_slice(&self.disk_size.to_le_bytes());
        b[24..32].copy_from_slice(&self.base.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.base.mtime_sec.to_le_bytes());
        b[40..44].copy_from_slice(&self.base.mtime_nsec.to_le_bytes());
        b[48..56].copy_from_slice(&self.bitmap_offset.to_le_bytes());
        b[56..64].copy_from_slice(&self.bitmap_len.to_le_bytes());
        b[64..72].copy_from_slice(&self.data_offset.to_le_bytes());
        b
    }

    /// Parses and checks a header; the error is the reason for
    /// [`OverlayError::Corrupt`].
    fn decode(b: &[u8]) -> Result<Self, String> {
        let u32_at = |o: usize| {
            b.get(o..o + 4)
                .map(|s| u32::from_le_bytes(s.try_into().unwrap_or([0; 4])))
        };
        let u64_at = |o: usize| {
            b.get(o..o + 8)
                .map(|s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])))
        };
        if b.get(0..8) != Some(&OVERLAY_MAGIC[..]) {
            return Err("bad magic".into());
        }
        let version = u32_at(8).ok_or("short header")?;
        if version != OVERLAY_VERSION {
            return Err(format!("version {version}, expected {OVERLAY_VERSION}"));
        }
        let chunk_shift = u32_at(12).ok_or("short header")?;
        if !(MIN_CHUNK_SHIFT..=MAX_CHUNK_SHIFT).contains(&chunk_shift) {
            return Err(format!("chunk shift {chunk_shift} out of range"));
        }
        let disk_size = u64_at(16).ok_or("short header")?;
        if disk_size == 0 || disk_size % super::SECTOR_SIZE != 0 || disk_size > i64::MAX as u64 / 2
        {
            return Err(format!("disk size {disk_size} invalid"));
        }
        let base = BaseId {
            len: u64_at(24).ok_or("short header")?,
            mtime_sec: u64_at(32).ok_or("short header")? as i64,
            mtime_nsec: u32_at(40).ok_or("short header")?,
        };
        let h = Self::new(disk_size, chunk_shift, base);
        let stored = (
            u64_at(48).ok_or("short header")?,
            u64_at(56).ok_or("short header")?,
            u64_at(64).ok_or("short header")?,
        );
        if stored != (h.bitmap_offset, h.bitmap_len, h.data_offset) {
            return Err(format!(
                "layout (bitmap at {}, {} bytes, data at {}) does not match the disk size",
                stored.0, stored.1, stored.2
            ));
        }
        Ok(h)
    }

    fn chunks(&self) -> u64 {
        self.disk_size.div_ceil(1u64 << self.chunk_shift)
    }

    /// Length the overlay file has: every chunk's slot exists (as a hole).
    fn file_len(&self) -> u64 {
        self.data_offset + self.disk_size
    }
}

/// A read-only base image under a copy-on-write overlay (module docs).
#[derive(Debug)]
pub struct CowImage {
    base: File,
    overlay: File,
    overlay_path: PathBuf,
    header: Header,
    bitmap: Vec<u8>,
    /// Bitmap pages (index = byte offset / [`BITMAP_PAGE`]) changed since the
    /// last flush.
    dirty_pages: BTreeSet<u64>,
    /// Chunk-sized buffer for copy-on-write.
    scratch: Vec<u8>,
}

impl CowImage {
    /// Opens `base` read-only with the overlay at `overlay`, creating a fresh
    /// overlay (64 KiB chunks) if that file does not exist. Fails with
    /// [`OverlayError::BaseChanged`] if the overlay was made from another
    /// version of the base.
    pub fn open(base: &Path, overlay: &Path) -> Result<Self, OverlayError> {
        match std::fs::symlink_metadata(overlay) {
            Ok(_) => Self::open_existing(base, overlay),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                Self::create(base, overlay, DEFAULT_CHUNK_SHIFT)
            }
            Err(source) => Err(OverlayError::Io {
                path: overlay.to_path_buf(),
                source,
            }),
        }
    }

    /// Starts a fresh, empty overlay at `overlay` over `base` (replacing any
    /// file there atomically) with chunks of `1 << chunk_shift` bytes.
    pub fn create(base: &Path, overlay: &Path, chunk_shift: u32) -> Result<Self, OverlayError> {
        if !(MIN_CHUNK_SHIFT..=MAX_CHUNK_SHIFT).contains(&chunk_shift) {
            return Err(OverlayError::ChunkShift(chunk_shift));
        }
        let base_file = open_image_file(base, true)?;
        let disk_size = image_size(&base_file, base)?;
        let io_err = |source| OverlayError::Io {
            path: overlay.to_path_buf(),
            source,
        };
        let id = BaseId::of(&base_file).map_err(io_err)?;
        let header = Header::new(disk_size, chunk_shift, id);
        // Refuse to replace an overlay a running VM holds (it would keep
        // writing to the unlinked file); the lock is held until the rename.
        let _old = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(overlay)
        {
            Ok(f) => {
                lock_file(&f, true, overlay)?;
                Some(f)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(source) => return Err(io_err(source)),
        };
        let mut tmp_name = overlay.as_os_str().to_owned();
        tmp_name.push(".tmp");
        let tmp = PathBuf::from(tmp_name);
        let write = || -> io::Result<()> {
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
                .open(&tmp)?;
            f.write_all_at(&header.encode(), 0)?;
            // The bitmap and the data area start as holes (all zero).
            f.set_len(header.file_len())?;
            f.sync_all()?;
            std::fs::rename(&tmp, overlay)?;
            sync_parent_dir(overlay)
        };
        if let Err(source) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(io_err(source));
        }
        drop(_old);
        info!(
            base = %base.display(),
            overlay = %overlay.display(),
            disk_size,
            chunk = 1u64 << chunk_shift,
            "blk: fresh copy-on-write overlay created"
        );
        Self::open_existing(base, overlay)
    }

    fn open_existing(base: &Path, overlay: &Path) -> Result<Self, OverlayError> {
        let base_file = open_image_file(base, true)?;
        let io_err = |source| OverlayError::Io {
            path: overlay.to_path_buf(),
            source,
        };
        let corrupt = |reason: String| OverlayError::Corrupt {
            path: overlay.to_path_buf(),
            reason,
        };
        let ov = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(overlay)
            .map_err(io_err)?;
        let meta = ov.metadata().map_err(io_err)?;
        if !meta.is_file() {
            return Err(corrupt("not a regular file".into()));
        }
        lock_file(&ov, true, overlay)?;
        let mut hb = vec![0u8; HEADER_SIZE as usize];
        if meta.len() < HEADER_SIZE {
            return Err(corrupt(format!(
                "{} bytes, shorter than the header",
                meta.len()
            )));
        }
        ov.read_exact_at(&mut hb, 0).map_err(io_err)?;
        let header = Header::decode(&hb).map_err(corrupt)?;
        let id = BaseId::of(&base_file).map_err(|source| OverlayError::Io {
            path: base.to_path_buf(),
            source,
        })?;
        let base_size = image_size(&base_file, base)?;
        if id != header.base || base_size != header.disk_size {
            return Err(OverlayError::BaseChanged {
                base: base.to_path_buf(),
                overlay: overlay.to_path_buf(),
            });
        }
        if meta.len() < header.file_len() {
            return Err(corrupt(format!(
                "{} bytes, shorter than its data area ({} bytes)",
                meta.len(),
                header.file_len()
            )));
        }
        let bitmap_len =
            usize::try_from(header.bitmap_len).map_err(|_| corrupt("bitmap too large".into()))?;
        let mut bitmap = vec![0u8; bitmap_len];
        ov.read_exact_at(&mut bitmap, header.bitmap_offset)
            .map_err(io_err)?;
        let allocated: u64 = bitmap.iter().map(|b| u64::from(b.count_ones())).sum();
        info!(
            base = %base.display(),
            overlay = %overlay.display(),
            disk_size = header.disk_size,
            allocated_chunks = allocated,
            chunks = header.chunks(),
            "blk: copy-on-write image opened"
        );
        Ok(Self {
            base: base_file,
            overlay: ov,
            overlay_path: overlay.to_path_buf(),
            scratch: vec![0u8; 1usize << header.chunk_shift],
            header,
            bitmap,
            dirty_pages: BTreeSet::new(),
        })
    }

    /// The chunk size in bytes.
    pub fn chunk_size(&self) -> u64 {
        1u64 << self.header.chunk_shift
    }

    /// How many chunks live in the overlay (including ones not yet flushed).
    pub fn allocated_chunks(&self) -> u64 {
        self.bitmap.iter().map(|b| u64::from(b.count_ones())).sum()
    }

    /// Whether chunk `i` lives in the overlay.
    pub fn is_allocated(&self, chunk: u64) -> bool {
        let Ok(byte) = usize::try_from(chunk / 8) else {
            return false;
        };
        self.bitmap
            .get(byte)
            .is_some_and(|b| b & (1 << (chunk % 8)) != 0)
    }

    fn set_allocated(&mut self, chunk: u64) {
        let Ok(byte) = usize::try_from(chunk / 8) else {
            return;
        };
        if let Some(b) = self.bitmap.get_mut(byte) {
            *b |= 1 << (chunk % 8);
            self.dirty_pages.insert(byte as u64 / BITMAP_PAGE);
        }
    }

    fn chunk_of(&self, offset: u64) -> u64 {
        offset >> self.header.chunk_shift
    }

    /// Start and length of chunk `i` (the last chunk may be short).
    fn chunk_span(&self, chunk: u64) -> (u64, u64) {
        let start = chunk << self.header.chunk_shift;
        (start, self.chunk_size().min(self.header.disk_size - start))
    }

    /// Splits `[offset, offset + len)` into maximal runs of chunks with the
    /// same allocation state: `(offset, len, allocated)`.
    fn runs(&self, offset: u64, len: u64) -> Vec<(u64, u64, bool)> {
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let chunk = self.chunk_of(pos);
            let (cstart, clen) = self.chunk_span(chunk);
            let n = (cstart + clen).min(end) - pos;
            let alloc = self.is_allocated(chunk);
            match out.last_mut() {
                Some(last) if last.2 == alloc => last.1 += n,
                _ => out.push((pos, n, alloc)),
            }
            pos += n;
        }
        out
    }

    /// Copies chunk `chunk` from the base into the overlay, applying
    /// `patch` to the chunk's bytes first, and marks it allocated.
    fn copy_up(&mut self, chunk: u64, patch: impl FnOnce(&mut [u8])) -> io::Result<()> {
        let (start, len) = self.chunk_span(chunk);
        let buf = &mut self.scratch[..len as usize];
        self.base.read_exact_at(buf, start)?;
        patch(buf);
        self.overlay
            .write_all_at(buf, self.header.data_offset + start)?;
        self.set_allocated(chunk);
        Ok(())
    }

    /// Writes the changed bitmap pages (after syncing the data they point at).
    fn persist_bitmap(&mut self) -> io::Result<()> {
        if self.dirty_pages.is_empty() {
            return Ok(());
        }
        self.overlay.sync_data()?;
        for page in std::mem::take(&mut self.dirty_pages) {
            let start = page * BITMAP_PAGE;
            let Some(bytes) = usize::try_from(start).ok().and_then(|s| {
                self.bitmap
                    .get(s..(s + BITMAP_PAGE as usize).min(self.bitmap.len()))
            }) else {
                continue;
            };
            if let Err(e) = self
                .overlay
                .write_all_at(bytes, self.header.bitmap_offset + start)
            {
                // Keep it dirty for the next flush.
                self.dirty_pages.insert(page);
                return Err(e);
            }
        }
        Ok(())
    }
}

impl BlockBackend for CowImage {
    fn size(&self) -> u64 {
        self.header.disk_size
    }

    fn read_only(&self) -> bool {
        false
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_bounds(self.header.disk_size, offset, buf.len() as u64)?;
        let mut done = 0usize;
        for (off, len, alloc) in self.runs(offset, buf.len() as u64) {
            let part = &mut buf[done..done + len as usize];
            if alloc {
                self.overlay
                    .read_exact_at(part, self.header.data_offset + off)?;
            } else {
                self.base.read_exact_at(part, off)?;
            }
            done += len as usize;
        }
        Ok(())
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_bounds(self.header.disk_size, offset, buf.len() as u64)?;
        let mut done = 0usize;
        for (off, len, alloc) in self.runs(offset, buf.len() as u64) {
            let part = &buf[done..done + len as usize];
            done += len as usize;
            if alloc {
                self.overlay
                    .write_all_at(part, self.header.data_offset + off)?;
                continue;
            }
            let mut pos = off;
            let end = off + len;
            while pos < end {
                let chunk = self.chunk_of(pos);
                let (cstart, clen) = self.chunk_span(chunk);
                let n = (cstart + clen).min(end) - pos;
                let src = &part[(pos - off) as usize..(pos - off + n) as usize];
                if n == clen {
                    // The whole chunk is new: no need for the base's bytes.
                    self.overlay
                        .write_all_at(src, self.header.data_offset + cstart)?;
                    self.set_allocated(chunk);
                } else {
                    let within = (pos - cstart) as usize;
                    self.copy_up(chunk, |b| {
                        b[within..within + src.len()].copy_from_slice(src)
                    })?;
                }
                pos += n;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.persist_bitmap()?;
        self.overlay.sync_data()
    }

    fn discard(&mut self, offset: u64, len: u64) -> io::Result<()> {
        check_bounds(self.header.disk_size, offset, len)?;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let chunk = self.chunk_of(pos);
            let (cstart, clen) = self.chunk_span(chunk);
            let n = (cstart + clen).min(end) - pos;
            if n == clen && self.is_allocated(chunk) {
                match punch_hole(&self.overlay, self.header.data_offset + cstart, clen) {
                    Ok(()) => {}
                    Err(e) if super::image::is_unsupported(&e) => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
            pos += n;
        }
        Ok(())
    }

    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        check_bounds(self.header.disk_size, offset, len)?;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let chunk = self.chunk_of(pos);
            let (cstart, clen) = self.chunk_span(chunk);
            let n = (cstart + clen).min(end) - pos;
            if self.is_allocated(chunk) || n == clen {
                // Overlay slot of an unallocated chunk may hold bytes of a
                // copy whose bit never reached the disk: zero it too.
                zero_range(&self.overlay, self.header.data_offset + pos, n)?;
                self.set_allocated(chunk);
            } else {
                let within = (pos - cstart) as usize;
                self.copy_up(chunk, |b| b[within..within + n as usize].fill(0))?;
            }
            pos += n;
        }
        Ok(())
    }
}

impl Drop for CowImage {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            warn!(overlay = %self.overlay_path.display(), "blk: overlay flush on close failed: {e}; writes since the last guest flush may be lost");
        }
    }
}
