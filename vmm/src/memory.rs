//! Guest memory: a `vm_memory::GuestMemoryMmap` laid out around the 32-bit
//! MMIO gap ([`crate::layout::ram_ranges`]).
//!
//! Memory is mapped with `MAP_NORESERVE` and never pre-touched, so the host
//! only pays for pages the guest uses. With [`Backing::Memfd`] the regions
//! are `MAP_SHARED` views of one sealed-size memfd (offsets follow the
//! guest-physical order), which a vhost-user backend can map too.
//!
//! [`Backing::Anonymous`] (the default) asks for transparent huge pages
//! (`MADV_HUGEPAGE`) at a host address aligned to [`HUGE_PAGE`]: with
//! guest-physical and host-virtual 2 MiB frames lined up, KVM maps each
//! huge host page with one large nested-page-table entry, so the guest
//! takes one nested page fault per 2 MiB it touches instead of 512, and
//! fewer TLB misses afterwards (QEMU and Cloud Hypervisor advise their RAM
//! the same way). Without the advice a host whose THP mode is `madvise`
//! (Ubuntu's default) backs the guest with 4 KiB pages only, and one in
//! `always` mode takes a huge page only when it has one free at fault time
//! (no compaction). The cost is host memory in 2 MiB steps where the guest
//! touches a frame sparsely; the balloon's free page reporting releases
//! whole 2 MiB blocks (its reporting order), so freed memory still goes
//! back. [`Backing::AnonymousBasePages`] (the helper's `--guest-thp off`,
//! `COWORK_GUEST_THP=off`) maps without the advice or the alignment. The
//! caller picks; nothing here reads the environment.
//!
//! A restored snapshot's RAM ([`map_snapshot`]) is a private,
//! copy-on-write mapping of the snapshot's memory file
//! (`MAP_PRIVATE | MAP_NORESERVE`): nothing is copied, a page comes in
//! from the page cache when the guest first touches it, and the guest's
//! writes go to anonymous memory, never to the file. Giving pages back
//! ([`discard`]) then cannot use `MADV_DONTNEED`, which would bring the
//! file's page back on the next touch: anonymous memory is mapped over the
//! range instead (as Firecracker does). [`MappingKind`] tells the kinds
//! apart.
//!
//! Limits: the alignment is best effort. Kernels since 6.7 align large
//! anonymous mappings themselves; on older ones [`create`] leaves an
//! aligned hole of the right size in the address space just before mapping,
//! which another thread mapping at that moment can take (the RAM is then
//! mapped elsewhere, unaligned, and still works; [`GuestRam::huge_aligned`]
//! says which happened).

use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::Arc;

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap, MmapRegion,
};

use crate::layout::{self, RamRange};

/// Guest memory type used throughout the machine.
pub type GuestMemory = GuestMemoryMmap<()>;

/// Host page size of a transparent huge page on x86-64 (one page-middle
/// directory entry maps it): guest RAM's host address is aligned to it.
pub const HUGE_PAGE: usize = 2 << 20;

/// How guest RAM is backed on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backing {
    /// Private anonymous memory (`MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE`)
    /// at a [`HUGE_PAGE`]-aligned address, advised `MADV_HUGEPAGE` (see the
    /// module doc).
    #[default]
    Anonymous,
    /// Private anonymous memory without the huge page advice or alignment:
    /// the host's THP mode alone decides.
    AnonymousBasePages,
    /// A memfd mapped `MAP_SHARED | MAP_NORESERVE` (shareable with vhost-user
    /// backends through [`GuestRam::memfd`]).
    Memfd,
}

/// Errors creating guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// Size outside the accepted range.
    #[error("guest memory of {mib} MiB is out of range: use {min}..={max} MiB")]
    BadSize {
        /// Requested MiB.
        mib: u64,
        /// Minimum.
        min: u64,
        /// Maximum.
        max: u64,
    },
    /// memfd_create or ftruncate failed.
    #[error("cannot create the {size}-byte memfd backing guest memory: {source}")]
    Memfd {
        /// Total size.
        size: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// mmap failed.
    #[error("cannot map guest RAM {start:#x}+{len:#x}: {source} (is the host short of address space or is vm.overcommit_memory=2?)")]
    Mmap {
        /// Guest start.
        start: u64,
        /// Length.
        len: u64,
        /// vm-memory's error.
        source: vm_memory::mmap::MmapRegionError,
    },
    /// Region collection rejected the layout (a bug in `layout`).
    #[error("invalid guest memory layout: {0}")]
    Layout(String),
    /// A snapshot's memory file does not have the RAM's size.
    #[error("the snapshot memory file holds {file} bytes, the VM's RAM is {ram} bytes; discard the snapshot")]
    SnapshotSize {
        /// The file's length.
        file: u64,
        /// The RAM's size.
        ram: u64,
    },
    /// Reading the snapshot memory file's metadata failed.
    #[error("cannot inspect the snapshot memory file: {0}")]
    SnapshotFile(std::io::Error),
    /// Giving pages back failed.
    #[error("cannot give back guest memory at host offset {offset:#x}+{len:#x} of its region ({how}): {source}")]
    Discard {
        /// Offset in the region.
        offset: u64,
        /// Length.
        len: u64,
        /// `MADV_DONTNEED`, `MADV_REMOVE` or `mmap(MAP_FIXED)`.
        how: &'static str,
        /// OS error (`EINVAL` for a range outside the region or not page
        /// aligned).
        source: std::io::Error,
    },
}

/// How a region of guest RAM is mapped; it decides how [`discard`] gives
/// pages back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MappingKind {
    /// Private anonymous memory ([`Backing::Anonymous`],
    /// [`Backing::AnonymousBasePages`]): `MADV_DONTNEED`.
    Anonymous,
    /// A shared file mapping ([`Backing::Memfd`]): `MADV_REMOVE` punches
    /// the pages out of the file (a vhost-user backend mapping it too
    /// sees zeroes).
    SharedFile,
    /// A private mapping of a file ([`map_snapshot`]): anonymous memory
    /// mapped over the range, so the file's pages never come back.
    PrivateFile,
}

impl MappingKind {
    /// The kind of `region`.
    pub fn of(region: &GuestRegionMmap<()>) -> MappingKind {
        if region.file_offset().is_none() {
            MappingKind::Anonymous
        } else if region.flags() & libc::MAP_SHARED != 0 {
            MappingKind::SharedFile
        } else {
            MappingKind::PrivateFile
        }
    }
}

/// Host page size, the granularity of [`discard`].
const PAGE: u64 = 4096;

/// Gives the host pages behind `[offset, offset + len)` of `region` back
/// to the host, as its [`MappingKind`] requires; the guest reads zeroes
/// there afterwards. The range must lie in the region and be page
/// aligned. Returns how it was done.
pub fn discard(
    region: &GuestRegionMmap<()>,
    offset: u64,
    len: u64,
) -> Result<&'static str, MemoryError> {
    let kind = MappingKind::of(region);
    let how = match kind {
        MappingKind::Anonymous => "MADV_DONTNEED",
        MappingKind::SharedFile => "MADV_REMOVE",
        MappingKind::PrivateFile => "mmap(MAP_FIXED)",
    };
    let err = |source| MemoryError::Discard {
        offset,
        len,
        how,
        source,
    };
    let inside = offset
        .checked_add(len)
        .is_some_and(|end| end <= region.len());
    if !inside || len == 0 || offset % PAGE != 0 || len % PAGE != 0 {
        return Err(err(std::io::Error::from_raw_os_error(libc::EINVAL)));
    }
    let bytes =
        usize::try_from(len).map_err(|_| err(std::io::Error::from_raw_os_error(libc::EINVAL)))?;
    // `offset < region.len()`, which fits the address space.
    let host = region.as_ptr().wrapping_add(offset as usize);
    let rc = match kind {
        MappingKind::Anonymous | MappingKind::SharedFile => {
            let advice = if kind == MappingKind::Anonymous {
                libc::MADV_DONTNEED
            } else {
                libc::MADV_REMOVE
            };
            // SAFETY: [host, host + bytes) lies inside the region's
            // mapping, which lives as long as `region`. Guest memory is
            // only accessed through volatile reads and writes, never
            // through Rust references, so replacing its contents with
            // zeroes breaks no aliasing rule.
            unsafe { libc::madvise(host.cast(), bytes, advice) }
        }
        MappingKind::PrivateFile => {
            // SAFETY: as above, the range lies inside the region's own
            // mapping, which MAP_FIXED replaces in place (same protection,
            // private and without swap reservation like the rest): the
            // region's later munmap covers it, and KVM's MMU notifier drops
            // the guest's mappings of the old pages.
            let p = unsafe {
                libc::mmap(
                    host.cast(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                -1
            } else {
                0
            }
        }
    };
    if rc != 0 {
        return Err(err(std::io::Error::last_os_error()));
    }
    Ok(how)
}

/// Maps a snapshot's memory file as `mem_mib` MiB of guest RAM: the
/// regions of [`layout::ram_ranges`], in guest-physical order at
/// consecutive offsets of `file`, each `MAP_PRIVATE | MAP_NORESERVE`
/// (copy-on-write; see the module doc). The file must be exactly the
/// RAM's size (a shorter one would fault the VMM with `SIGBUS`) and must
/// not change while the VM lives (the snapshot writer only ever replaces
/// files by renaming new ones over them).
pub fn map_snapshot(mem_mib: u64, file: Arc<File>) -> Result<GuestRam, MemoryError> {
    if !(layout::MIN_MEM_MIB..=layout::MAX_MEM_MIB).contains(&mem_mib) {
        return Err(MemoryError::BadSize {
            mib: mem_mib,
            min: layout::MIN_MEM_MIB,
            max: layout::MAX_MEM_MIB,
        });
    }
    let size = mem_mib * layout::MIB;
    let file_len = file.metadata().map_err(MemoryError::SnapshotFile)?.len();
    if file_len != size {
        return Err(MemoryError::SnapshotSize {
            file: file_len,
            ram: size,
        });
    }
    let ranges = layout::ram_ranges(size);
    let mut regions = Vec::with_capacity(ranges.len());
    let mut file_off = 0u64;
    for r in &ranges {
        let len =
            usize::try_from(r.len).map_err(|_| MemoryError::Layout("region too large".into()))?;
        let map = MmapRegionBuilder::new(len)
            .with_file_offset(FileOffset::from_arc(file.clone(), file_off))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .build()
            .map_err(|source| MemoryError::Mmap {
                start: r.start,
                len: r.len,
                source,
            })?;
        file_off += r.len;
        let region = GuestRegionMmap::new(map, GuestAddress(r.start))
            .ok_or_else(|| MemoryError::Layout(format!("region {:#x} overflows", r.start)))?;
        regions.push(region);
    }
    let mem =
        GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::Layout(e.to_string()))?;
    Ok(GuestRam {
        mem,
        ranges,
        size,
        memfd: None,
        huge_aligned: false,
    })
}

/// Guest RAM plus what the rest of the machine needs to know about it.
#[derive(Debug)]
pub struct GuestRam {
    /// The memory itself.
    pub mem: GuestMemory,
    /// RAM ranges, in guest-physical order (one per KVM memory slot).
    pub ranges: Vec<RamRange>,
    /// Total bytes.
    pub size: u64,
    /// The memfd, when [`Backing::Memfd`] was requested.
    pub memfd: Option<Arc<File>>,
    /// Every region's host address is [`HUGE_PAGE`]-aligned and advised
    /// for huge pages ([`Backing::Anonymous`] only).
    pub huge_aligned: bool,
}

/// Maps `mem_mib` MiB of guest RAM.
pub fn create(mem_mib: u64, backing: Backing) -> Result<GuestRam, MemoryError> {
    if !(layout::MIN_MEM_MIB..=layout::MAX_MEM_MIB).contains(&mem_mib) {
        return Err(MemoryError::BadSize {
            mib: mem_mib,
            min: layout::MIN_MEM_MIB,
            max: layout::MAX_MEM_MIB,
        });
    }
    let size = mem_mib * layout::MIB;
    let ranges = layout::ram_ranges(size);
    let memfd = match backing {
        Backing::Anonymous | Backing::AnonymousBasePages => None,
        Backing::Memfd => Some(Arc::new(new_memfd(size)?)),
    };
    let mut regions = Vec::with_capacity(ranges.len());
    let mut file_off = 0u64;
    let mut huge_aligned = backing == Backing::Anonymous;
    for r in &ranges {
        let len =
            usize::try_from(r.len).map_err(|_| MemoryError::Layout("region too large".into()))?;
        let map = match (&memfd, backing) {
            (None, Backing::Anonymous) => {
                let map = with_aligned_hole(len, |_| MmapRegion::new(len));
                if let Ok(m) = &map {
                    huge_aligned &= advise_huge_pages(m);
                }
                map
            }
            (None, _) => MmapRegion::new(len),
            (Some(f), _) => MmapRegion::from_file(FileOffset::from_arc(f.clone(), file_off), len),
        }
        .map_err(|source| MemoryError::Mmap {
            start: r.start,
            len: r.len,
            source,
        })?;
        file_off += r.len;
        let region = GuestRegionMmap::new(map, GuestAddress(r.start))
            .ok_or_else(|| MemoryError::Layout(format!("region {:#x} overflows", r.start)))?;
        regions.push(region);
    }
    let mem =
        GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::Layout(e.to_string()))?;
    Ok(GuestRam {
        mem,
        ranges,
        size,
        memfd,
        huge_aligned,
    })
}

/// Runs `map` (given the hole's address; 0 when there is none), which
/// maps `len` bytes wherever the kernel puts them, while the address space
/// has a free hole of exactly `len` bytes at a [`HUGE_PAGE`]-aligned
/// address: the kernel places a mapping in the highest free gap that fits,
/// which is that hole unless a gap above it fits too (or another thread
/// maps into it first; see the module doc). The hole is cut from a
/// `PROT_NONE` reservation `HUGE_PAGE` larger than `len`, whose two
/// leftover ends are unmapped after `map` ran.
fn with_aligned_hole<T>(len: usize, map: impl FnOnce(usize) -> T) -> T {
    let Some(total) = len.checked_add(HUGE_PAGE) else {
        return map(0);
    };
    // SAFETY: a new inaccessible reservation at an address of the kernel's
    // choosing; it touches no existing mapping.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return map(0);
    }
    let start = base as usize;
    let hole = start.next_multiple_of(HUGE_PAGE);
    let leftovers = [
        (start, hole - start),
        (hole + len, start + total - (hole + len)),
    ];
    // SAFETY: `hole..hole + len` lies inside the reservation made above,
    // which nothing else uses.
    unsafe { libc::munmap(hole as *mut libc::c_void, len) };
    let out = map(hole);
    for (at, n) in leftovers {
        if n > 0 {
            // SAFETY: the reservation's ends are still ours (`map` cannot
            // have mapped over them: it does not use MAP_FIXED).
            unsafe { libc::munmap(at as *mut libc::c_void, n) };
        }
    }
    out
}

/// Advises `map` for transparent huge pages; whether it is aligned for
/// them and the advice was taken.
fn advise_huge_pages(map: &MmapRegion) -> bool {
    let addr = map.as_ptr();
    // SAFETY: advice on a mapping we own; it changes how the kernel backs
    // it, not its contents.
    let advised = unsafe { libc::madvise(addr.cast(), map.size(), libc::MADV_HUGEPAGE) } == 0;
    advised && (addr as usize) % HUGE_PAGE == 0
}

fn new_memfd(size: u64) -> Result<File, MemoryError> {
    let err = |source| MemoryError::Memfd { size, source };
    // SAFETY: the name is a valid NUL-terminated C string; the returned fd is
    // checked and then owned by the File.
    let fd = unsafe { libc::memfd_create(c"cowork-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(err(std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a freshly created, owned descriptor.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).map_err(err)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemory as _, GuestMemoryRegion};

    #[test]
    fn layouts_and_backings() {
        let r = create(64, Backing::Anonymous).unwrap();
        assert_eq!(r.mem.num_regions(), 1);
        assert_eq!(r.mem.last_addr().0, 64 * layout::MIB - 1);
        assert!(r.memfd.is_none());

        // Above the gap: two regions, the second at 4 GiB. NORESERVE makes
        // this cheap even though it is larger than the test machine may spare.
        let r = create(4096, Backing::Memfd).unwrap();
        let regs: Vec<_> = r.mem.iter().map(|g| (g.start_addr().0, g.len())).collect();
        assert_eq!(regs, vec![(0, 3 << 30), (4 << 30, 1 << 30)]);
        assert_eq!(r.memfd.as_ref().unwrap().metadata().unwrap().len(), 4 << 30);
        r.mem.write_obj(0xabcdu32, GuestAddress(4 << 30)).unwrap();
        assert_eq!(
            r.mem.read_obj::<u32>(GuestAddress(4 << 30)).unwrap(),
            0xabcd
        );
        // The gap is not memory.
        assert!(r.mem.read_obj::<u32>(GuestAddress(0xd000_0000)).is_err());

        assert!(matches!(
            create(1, Backing::Anonymous),
            Err(MemoryError::BadSize { .. })
        ));
    }

    /// The `VmFlags` of the mapping holding `addr` in /proc/self/smaps. Not
    /// "starting at": the kernel merges a mapping with a neighbour of the
    /// same flags, which another test thread may have just made.
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let holds = |line: &str| {
            let range = line.split_whitespace().next().unwrap_or_default();
            let Some((start, end)) = range.split_once('-') else {
                return false;
            };
            match (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) {
                (Ok(start), Ok(end)) => start <= addr && addr < end,
                _ => false,
            }
        };
        let mut lines = smaps.lines().skip_while(|l| !holds(l));
        lines
            .find_map(|l| l.strip_prefix("VmFlags:"))
            .unwrap_or_else(|| panic!("no mapping holds {addr:#x}"))
            .to_string()
    }

    #[test]
    fn anonymous_ram_is_aligned_for_and_advised_huge_pages() {
        // Other test threads may take the aligned hole (module doc); one of
        // a few attempts gets it.
        let ram = (0..8)
            .map(|_| create(64, Backing::Anonymous).unwrap())
            .find(|r| r.huge_aligned)
            .expect("no aligned mapping in 8 attempts");
        let region = ram.mem.iter().next().unwrap();
        let addr = region.as_ptr() as usize;
        assert_eq!(addr % HUGE_PAGE, 0);
        assert!(vm_flags(addr).split_whitespace().any(|f| f == "hg"));
        // Usable memory.
        ram.mem
            .write_obj(7u64, GuestAddress(HUGE_PAGE as u64 + 8))
            .unwrap();
        assert_eq!(
            ram.mem
                .read_obj::<u64>(GuestAddress(HUGE_PAGE as u64 + 8))
                .unwrap(),
            7
        );

        let base = create(64, Backing::AnonymousBasePages).unwrap();
        assert!(!base.huge_aligned);
        let addr = base.mem.iter().next().unwrap().as_ptr() as usize;
        assert!(!vm_flags(addr).split_whitespace().any(|f| f == "hg"));
        let shared = create(64, Backing::Memfd).unwrap();
        assert!(!shared.huge_aligned);
    }

    /// Whether `addr` is mapped (msync fails with ENOMEM on a hole).
    fn mapped(addr: usize) -> bool {
        // SAFETY: msync only asks about the page; MS_ASYNC writes nothing.
        unsafe { libc::msync(addr as *mut libc::c_void, 4096, libc::MS_ASYNC) == 0 }
    }

    #[test]
    fn the_hole_is_aligned_free_and_fenced_while_mapping() {
        let len = 8 * HUGE_PAGE;
        let map = with_aligned_hole(len, |hole| -> MmapRegion {
            assert_eq!(hole % HUGE_PAGE, 0);
            assert!(hole != 0 && !mapped(hole) && !mapped(hole + len - 4096));
            // The reservation's rest fences the hole on at least one side.
            assert!(mapped(hole - 4096) || mapped(hole + len));
            MmapRegion::new(len).unwrap()
        });
        // Usually exactly the hole (not asserted: other test threads map
        // too); the mapping is whole and owned either way.
        let at = map.as_ptr() as usize;
        assert!(mapped(at) && mapped(at + len - 4096));
        drop(map);
        assert!(!mapped(at));
    }
}
