//! Reading kernel and initrd files into fresh guest RAM without copying
//! their holes.
//!
//! An x86 vmlinux carries its zero-initialised data (`.bss`, `.brk` and
//! the like, inside a `PT_LOAD` segment whose file size equals its memory
//! size) as zero bytes in the file: Debian's cloud kernel has 21 MiB of
//! zero pages in a 51 MiB file. Guest RAM is fresh anonymous memory, zero
//! already, so copying those pages only costs time (a page fault, a page
//! cleared, a page copied) and host memory for pages the guest may never
//! touch. When the file is sparse (`scripts/fetch-kernel.sh` digs its holes
//! with `fallocate --dig-holes`), [`HoleSkipper`] asks the file system for
//! its data ranges (`lseek` `SEEK_DATA`/`SEEK_HOLE`) and leaves the holes'
//! guest memory untouched; a file without holes reads exactly as before.
//!
//! [`HoleSkipper`] is the reader the boot loaders (linux-loader's ELF and
//! bzImage loaders, [`crate::boot::load_initrd`]) read through: `Read` and
//! `Seek` for headers, `ReadVolatile` for guest memory.
//!
//! Limits: skipping is only correct into memory that reads as zero, which
//! is why only [`crate::machine::Vm::build`] uses it, on the RAM it has just
//! mapped (see [`HoleSkipper::into_fresh_ram`]). File systems without
//! `SEEK_DATA` support report the whole file as data (nothing is skipped).

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, VolatileMemoryError, VolatileSlice};

/// How a [`HoleSkipper`]'s bytes reached guest memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Bytes copied (into guest memory or the loaders' header buffers).
    pub copied: u64,
    /// Bytes of holes left as the zeros guest memory already held.
    pub skipped: u64,
}

/// A kernel or initrd file read into fresh (all-zero) guest RAM, skipping
/// its holes (see the module doc).
#[derive(Debug)]
pub struct HoleSkipper<'a> {
    file: &'a File,
    /// File size when the reader was made; reads stop there.
    size: u64,
    pos: u64,
    stats: ReadStats,
}

impl<'a> HoleSkipper<'a> {
    /// A reader of `file` from offset 0 whose volatile reads go into guest
    /// memory that reads as zero wherever they land (freshly mapped RAM).
    /// With any other destination, the holes' bytes would be left stale.
    pub fn into_fresh_ram(file: &'a File) -> io::Result<HoleSkipper<'a>> {
        let size = file.metadata()?.len();
        Ok(HoleSkipper {
            file,
            size,
            pos: 0,
            stats: ReadStats::default(),
        })
    }

    /// The file's size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// What was copied and what was skipped so far.
    pub fn stats(&self) -> ReadStats {
        self.stats
    }

    /// Bytes left before the end of the file, at most `want`.
    fn available(&self, want: usize) -> usize {
        let left = self.size.saturating_sub(self.pos);
        usize::try_from(left).map_or(want, |l| l.min(want))
    }

    /// The current offset as the `off_t` the syscalls take.
    fn offset(&self) -> io::Result<libc::off_t> {
        libc::off_t::try_from(self.pos)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file offset too large"))
    }

    /// `lseek(fd, pos, whence)` for `SEEK_DATA`/`SEEK_HOLE`; `None` when
    /// there is no such offset after `pos` (`ENXIO`).
    fn seek_kind(&self, whence: libc::c_int) -> io::Result<Option<u64>> {
        let pos = self.offset()?;
        // SAFETY: lseek on a descriptor we borrow; it moves the file's own
        // offset, which nothing else here uses (reads are pread).
        let at = unsafe { libc::lseek(self.file.as_raw_fd(), pos, whence) };
        if at < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENXIO) => Ok(None),
                _ => Err(e),
            };
        }
        Ok(Some(at as u64))
    }

    /// Bytes of data (to copy) and then of hole (to skip) from the current
    /// offset, within `left`. A file system that cannot tell reports all
    /// data.
    fn extent(&self, left: usize) -> (usize, usize) {
        let clamp = |n: u64| usize::try_from(n).map_or(left, |n| n.min(left));
        match self.seek_kind(libc::SEEK_DATA) {
            // In a hole: skip up to the next data, or to the end.
            Ok(Some(data)) if data > self.pos => (0, clamp(data - self.pos)),
            Ok(None) => (0, left),
            // In data: copy up to the next hole (the end counts as one).
            Ok(Some(_)) => match self.seek_kind(libc::SEEK_HOLE) {
                Ok(Some(hole)) => (clamp(hole.saturating_sub(self.pos)).max(1), 0),
                _ => (left, 0),
            },
            Err(_) => (left, 0),
        }
    }

    /// Copies up to `len` bytes at the current offset into `dst` (fewer at
    /// the end of the file), the destination's pages populated first
    /// ([`populate_for_write`]).
    fn copy_to(&mut self, dst: *mut u8, len: usize) -> io::Result<usize> {
        let offset = self.offset()?;
        populate_for_write(dst, len);
        // SAFETY: `dst..dst + len` is inside the VolatileSlice the caller
        // holds mutably; pread writes at most `len` bytes there.
        let n = unsafe { libc::pread(self.file.as_raw_fd(), dst.cast(), len, offset) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }
}

/// Host page size the populate range is aligned to (x86-64's base page;
/// a larger page only means the range covers more than one call needs).
const HOST_PAGE: usize = 4096;

/// Asks the host kernel to allocate the fresh guest pages under
/// `dst..dst + len` in one go (`MADV_POPULATE_WRITE`, Linux 5.14) before
/// `pread` fills them: otherwise every 4 KiB page of the ~50 MiB a boot
/// copies faults on its own inside the copy (12,000 faults; in the nested
/// harness, where the helper runs under TCG, each costs ~0.1 ms). The
/// range is widened to whole pages, which lie inside the same guest RAM
/// mapping (mappings are page-aligned), and populating a page keeps its
/// contents. A kernel without the advice (`EINVAL`) or any other failure
/// changes nothing: the copy then faults the pages in itself.
fn populate_for_write(dst: *mut u8, len: usize) {
    if len == 0 {
        return;
    }
    let start = dst as usize & !(HOST_PAGE - 1);
    let end = (dst as usize).saturating_add(len);
    // SAFETY: madvise only changes how the kernel backs these pages of the
    // guest RAM mapping `dst..dst + len` lies in (see above); it reads and
    // writes no memory of ours and cannot unmap anything.
    unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_POPULATE_WRITE,
        );
    }
}

impl Read for HoleSkipper<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = self.available(buf.len());
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        self.pos += n as u64;
        self.stats.copied += n as u64;
        Ok(n)
    }
}

impl Seek for HoleSkipper<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let new = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.size.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = new.ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "seek before the file start")
        })?;
        Ok(self.pos)
    }
}

impl ReadVolatile for HoleSkipper<'_> {
    /// Fills as much of `buf` as the file holds in one call (guest memory's
    /// `read_volatile_from` does not call again): data ranges are copied,
    /// holes skipped.
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let want = self.available(buf.len());
        let guard = buf.ptr_guard_mut();
        let base = guard.as_ptr();
        let mut done = 0;
        while done < want {
            let (data, hole) = self.extent(want - done);
            if hole > 0 {
                self.pos += hole as u64;
                self.stats.skipped += hole as u64;
                done += hole;
                continue;
            }
            // SAFETY: `done < want <= buf.len()`: inside the slice.
            let dst = unsafe { base.add(done) };
            let n = self
                .copy_to(dst, data)
                .map_err(VolatileMemoryError::IOError)?;
            if n == 0 {
                break;
            }
            self.pos += n as u64;
            self.stats.copied += n as u64;
            done += n;
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{self, Backing};
    use std::io::Write;
    use vm_memory::{Bytes, GuestAddress};

    /// Block size large enough for every file system's hole granularity.
    const BLOCK: usize = 64 << 10;

    /// A file of data, hole, data, hole (the last hole made by `set_len`),
    /// and its bytes.
    fn holey_file() -> (tempfile::NamedTempFile, Vec<u8>) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let a: Vec<u8> = (0..BLOCK + 100).map(|i| (i % 251) as u8 | 1).collect();
        let b: Vec<u8> = (0..BLOCK).map(|i| (i % 13) as u8 | 0x80).collect();
        f.write_all(&a).unwrap();
        f.as_file().write_all_at(&b, (4 * BLOCK) as u64).unwrap();
        f.as_file().set_len((8 * BLOCK) as u64).unwrap();
        let mut all = vec![0u8; 8 * BLOCK];
        all[..a.len()].copy_from_slice(&a);
        all[4 * BLOCK..5 * BLOCK].copy_from_slice(&b);
        (f, all)
    }

    fn read_back(ram: &memory::GuestRam, at: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        ram.mem.read_slice(&mut out, GuestAddress(at)).unwrap();
        out
    }

    #[test]
    fn holes_are_skipped_and_data_copied() {
        let ram = memory::create(64, Backing::Anonymous).unwrap();
        let (f, all) = holey_file();
        let file = f.reopen().unwrap();
        let mut src = HoleSkipper::into_fresh_ram(&file).unwrap();
        ram.mem
            .read_exact_volatile_from(GuestAddress(0x10_0000), &mut src, all.len())
            .unwrap();
        assert_eq!(read_back(&ram, 0x10_0000, all.len()), all);
        let s = src.stats();
        assert_eq!(s.copied + s.skipped, all.len() as u64);
        // tmpfs and ext4 both report these holes (block-aligned, 64 KiB+).
        assert!(s.skipped >= (5 * BLOCK) as u64, "{s:?}");
        assert!(s.copied >= (2 * BLOCK) as u64, "{s:?}");
    }

    #[test]
    fn a_read_from_inside_a_hole_or_data_lands_where_it_should() {
        let (f, all) = holey_file();
        let file = f.reopen().unwrap();
        for start in [50usize, BLOCK + 200, 3 * BLOCK, 4 * BLOCK + 7] {
            // Fresh RAM for each read, as the reader requires.
            let ram = memory::create(64, Backing::Anonymous).unwrap();
            let mut src = HoleSkipper::into_fresh_ram(&file).unwrap();
            src.seek(SeekFrom::Start(start as u64)).unwrap();
            let len = all.len() - start;
            ram.mem
                .read_exact_volatile_from(GuestAddress(0x100_0000), &mut src, len)
                .unwrap();
            assert_eq!(
                read_back(&ram, 0x100_0000, len),
                all[start..],
                "from {start}"
            );
        }
    }

    #[test]
    fn a_file_without_holes_is_copied_whole() {
        let ram = memory::create(64, Backing::Anonymous).unwrap();
        let data: Vec<u8> = (0..3 * BLOCK + 5).map(|i| (i % 7) as u8 + 1).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&data).unwrap();
        let file = f.reopen().unwrap();
        let mut src = HoleSkipper::into_fresh_ram(&file).unwrap();
        ram.mem
            .read_exact_volatile_from(GuestAddress(0x20_0000), &mut src, data.len())
            .unwrap();
        assert_eq!(read_back(&ram, 0x20_0000, data.len()), data);
        assert_eq!(
            src.stats(),
            ReadStats {
                copied: data.len() as u64,
                skipped: 0
            }
        );
    }

    #[test]
    fn reads_stop_at_the_end_of_the_file() {
        let ram = memory::create(64, Backing::Anonymous).unwrap();
        let (f, all) = holey_file();
        let file = f.reopen().unwrap();
        let mut src = HoleSkipper::into_fresh_ram(&file).unwrap();
        let err = ram
            .mem
            .read_exact_volatile_from(GuestAddress(0x10_0000), &mut src, all.len() + 10)
            .unwrap_err();
        assert!(
            matches!(
                err,
                vm_memory::GuestMemoryError::PartialBuffer { expected, completed }
                    if expected == all.len() + 10 && completed == all.len()
            ),
            "{err}"
        );
        assert!(src
            .seek(SeekFrom::Current(-(all.len() as i64) - 11))
            .is_err());
        src.seek(SeekFrom::End(5)).unwrap();
        let mut b = [0u8; 4];
        assert_eq!(src.read(&mut b).unwrap(), 0);
    }
}
