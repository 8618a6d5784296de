//! Guest memory: a `vm_memory::GuestMemoryMmap` laid out around the 32-bit
//! MMIO gap ([`crate::layout::ram_ranges`]).
//!
//! Memory is mapped with `MAP_NORESERVE` and never pre-touched, so the host
//! only pays for pages the guest uses. With [`Backing::Memfd`] the regions
//! are `MAP_SHARED` views of one sealed-size memfd (offsets follow the
//! guest-physical order), which a vhost-user backend can map too.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::Arc;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::layout::{self, RamRange};

/// Guest memory type used throughout the machine.
pub type GuestMemory = GuestMemoryMmap<()>;

/// How guest RAM is backed on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backing {
    /// Private anonymous memory (`MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE`).
    #[default]
    Anonymous,
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
        Backing::Anonymous => None,
        Backing::Memfd => Some(Arc::new(new_memfd(size)?)),
    };
    let mut regions = Vec::with_capacity(ranges.len());
    let mut file_off = 0u64;
    for r in &ranges {
        let len =
            usize::try_from(r.len).map_err(|_| MemoryError::Layout("region too large".into()))?;
        let map = match &memfd {
            None => MmapRegion::new(len),
            Some(f) => MmapRegion::from_file(FileOffset::from_arc(f.clone(), file_off), len),
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
    })
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
}
