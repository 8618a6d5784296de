//! Dropping the host pages behind guest memory the guest reported free.
//!
//! [`HostMappingReleaser`] works on the VMM's own mapping of guest memory,
//! as the memory kind needs (`vmm::memory::MappingKind`; the work is
//! `vmm::memory::discard`'s):
//! * private anonymous memory (the vmm's default, `Backing::Anonymous`):
//!   `madvise(MADV_DONTNEED)` frees the pages (and the transparent huge
//!   pages a 2 MiB report covers) at once; the next guest access faults in
//!   a zero page;
//! * file-backed shared memory (a memfd, `Backing::Memfd`, shared with
//!   vhost-user backends): `MADV_DONTNEED` would only unmap the pages while
//!   the memfd keeps them, so `madvise(MADV_REMOVE)` punches a hole in the
//!   file (and unmaps the range in this process; a backend that mapped the
//!   memfd too sees the hole as zeroes);
//! * a private mapping of a snapshot's memory file (a restored VM):
//!   `MADV_DONTNEED` would bring the *file's* page back on the next touch
//!   (the guest would read stale data, and the page cache keeps it), so
//!   fresh anonymous memory is mapped over the range (`MAP_FIXED`); the
//!   next touch faults in a zero page.
//!
//! With KVM, the kernel's MMU notifier drops the guest's second-level
//! mappings of the released pages too, so nothing else needs telling.
//!
//! Limits: the range must lie inside one region (the device guarantees it);
//! hugetlbfs-backed memory is not handled (the vmm never uses it).

use std::io;

use vm_memory::{GuestAddress, GuestMemory, GuestMemoryRegion, MemoryRegionAddress};
use vmm::virtio::GuestMemoryMmap;

use super::{MemoryReleaser, PAGE_SIZE};

/// Errors of releasing guest memory.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    /// The range is not wholly inside one region of guest memory.
    #[error("range {gpa:#x}+{len:#x} is not inside one region of guest memory; not released")]
    NotGuestMemory {
        /// Guest-physical start.
        gpa: u64,
        /// Length in bytes.
        len: u64,
    },
    /// The range's host address or length is not page aligned.
    #[error("range {gpa:#x}+{len:#x} is not page aligned in the host mapping; not released")]
    Unaligned {
        /// Guest-physical start.
        gpa: u64,
        /// Length in bytes.
        len: u64,
    },
    /// madvise refused.
    #[error(
        "{advice} of guest range {gpa:#x}+{len:#x} failed: {source}; the host keeps those pages"
    )]
    Madvise {
        /// Guest-physical start.
        gpa: u64,
        /// Length in bytes.
        len: u64,
        /// `MADV_DONTNEED`, `MADV_REMOVE` or `mmap(MAP_FIXED)`.
        advice: &'static str,
        /// OS error.
        source: io::Error,
    },
}

/// Releases guest memory through the VMM's host mapping of it.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostMappingReleaser;

impl MemoryReleaser for HostMappingReleaser {
    fn release(
        &self,
        mem: &GuestMemoryMmap,
        gpa: GuestAddress,
        len: u64,
    ) -> Result<(), ReleaseError> {
        let outside = ReleaseError::NotGuestMemory { gpa: gpa.0, len };
        let region = mem.find_region(gpa).ok_or(outside)?;
        let offset = gpa.0 - region.start_addr().0;
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= region.len() => {}
            _ => return Err(ReleaseError::NotGuestMemory { gpa: gpa.0, len }),
        }
        let host = region
            .get_host_address(MemoryRegionAddress(offset))
            .map_err(|_| ReleaseError::NotGuestMemory { gpa: gpa.0, len })?;
        if host as usize % PAGE_SIZE as usize != 0 || len % PAGE_SIZE != 0 {
            return Err(ReleaseError::Unaligned { gpa: gpa.0, len });
        }
        match vmm::memory::discard(region, offset, len) {
            Ok(_) => Ok(()),
            Err(vmm::memory::MemoryError::Discard { how, source, .. }) => {
                Err(ReleaseError::Madvise {
                    gpa: gpa.0,
                    len,
                    advice: how,
                    source,
                })
            }
            Err(e) => Err(ReleaseError::Madvise {
                gpa: gpa.0,
                len,
                advice: "discard",
                source: io::Error::other(e.to_string()),
            }),
        }
    }
}
