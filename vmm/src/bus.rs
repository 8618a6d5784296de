//! Port-I/O and MMIO dispatch.
//!
//! A [`Bus`] maps non-overlapping guest address ranges (`[base, base + len)`)
//! to devices. A vCPU exit for address `addr` with an access of `size` bytes
//! is delivered to the device whose range contains the *whole* access, with
//! the offset relative to the range base. Accesses that straddle a range end
//! or hit no device are reported to the caller (which logs them and, for
//! reads, returns all-ones like an unclaimed bus) — never a panic.
//!
//! The device side is the [`BusDevice`] trait. It takes `&self` because
//! several vCPU threads dispatch concurrently; devices use interior
//! mutability. The virtio-mmio transport in [`crate::virtio`] implements it,
//! and so do the legacy port-I/O devices (the PIO bus uses the same trait:
//! "offset" is then the port minus the range's first port).

use std::sync::Arc;

/// A device that claims a range on the MMIO or port-I/O bus.
///
/// `offset` is relative to the start of the range the device was inserted at.
/// `data.len()` is the access width (1, 2, 4 or 8 bytes for CPU accesses).
/// Implementations must treat every offset and width as guest-controlled: no
/// panics, ignore what they do not understand, and fill reads they cannot
/// serve (e.g. with zeroes).
pub trait BusDevice: Send + Sync {
    /// Guest read at `offset`: fill `data`.
    fn read(&self, offset: u64, data: &mut [u8]);
    /// Guest write at `offset` of `data`.
    fn write(&self, offset: u64, data: &[u8]);
}

/// Errors of bus construction and dispatch.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// A device range has zero length or wraps around the address space.
    #[error(
        "invalid bus range base={base:#x} len={len:#x}: length must be non-zero and must not wrap"
    )]
    InvalidRange {
        /// Range start.
        base: u64,
        /// Range length.
        len: u64,
    },
    /// Two devices were given overlapping ranges.
    #[error("bus range {base:#x}+{len:#x} overlaps the existing range {other_base:#x}+{other_len:#x}; pick a free slot from vmm::layout")]
    Overlap {
        /// New range start.
        base: u64,
        /// New range length.
        len: u64,
        /// Existing range start.
        other_base: u64,
        /// Existing range length.
        other_len: u64,
    },
    /// The access hits no device (or crosses a range end).
    #[error("no device at {addr:#x} for a {size}-byte access")]
    Unclaimed {
        /// Accessed address.
        addr: u64,
        /// Access size.
        size: usize,
    },
}

#[derive(Clone)]
struct Entry {
    base: u64,
    len: u64,
    dev: Arc<dyn BusDevice>,
}

/// An immutable-after-build address → device map (sorted by base).
///
/// Built once before the vCPUs start and then shared read-only between vCPU
/// threads, so dispatch takes no lock of its own.
#[derive(Clone, Default)]
pub struct Bus {
    entries: Vec<Entry>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut l = f.debug_list();
        for e in &self.entries {
            l.entry(&format_args!("{:#x}+{:#x}", e.base, e.len));
        }
        l.finish()
    }
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Claims `[base, base + len)` for `dev`.
    pub fn insert(&mut self, dev: Arc<dyn BusDevice>, base: u64, len: u64) -> Result<(), BusError> {
        if len == 0 || base.checked_add(len).is_none() {
            return Err(BusError::InvalidRange { base, len });
        }
        let end = base + len;
        for e in &self.entries {
            if base < e.base + e.len && e.base < end {
                return Err(BusError::Overlap {
                    base,
                    len,
                    other_base: e.base,
                    other_len: e.len,
                });
            }
        }
        let pos = self.entries.partition_point(|e| e.base < base);
        self.entries.insert(pos, Entry { base, len, dev });
        Ok(())
    }

    /// Number of claimed ranges.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no range is claimed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Finds the device whose range contains the whole `[addr, addr + size)`,
    /// returning it with the offset into its range.
    fn resolve(&self, addr: u64, size: usize) -> Result<(&Arc<dyn BusDevice>, u64), BusError> {
        let unclaimed = BusError::Unclaimed { addr, size };
        // Last entry whose base is <= addr.
        let idx = self.entries.partition_point(|e| e.base <= addr);
        let e = idx
            .checked_sub(1)
            .map(|i| &self.entries[i])
            .ok_or(unclaimed.clone())?;
        let offset = addr - e.base;
        let end = offset.checked_add(size as u64).ok_or(unclaimed.clone())?;
        if size == 0 || end > e.len {
            return Err(unclaimed);
        }
        Ok((&e.dev, offset))
    }

    /// Dispatches a read. On [`BusError::Unclaimed`] `data` is filled with
    /// `0xff` (what an unclaimed ISA/PCI bus returns) before the error is
    /// returned.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> Result<(), BusError> {
        match self.resolve(addr, data.len()) {
            Ok((dev, off)) => {
                dev.read(off, data);
                Ok(())
            }
            Err(e) => {
                data.fill(0xff);
                Err(e)
            }
        }
    }

    /// Dispatches a write.
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        let (dev, off) = self.resolve(addr, data.len())?;
        dev.write(off, data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Rec(Mutex<Vec<(char, u64, usize)>>);
    impl BusDevice for Rec {
        fn read(&self, offset: u64, data: &mut [u8]) {
            self.0.lock().unwrap().push(('r', offset, data.len()));
            data.fill(offset as u8);
        }
        fn write(&self, offset: u64, data: &[u8]) {
            self.0.lock().unwrap().push(('w', offset, data.len()));
        }
    }

    #[test]
    fn dispatch_and_range_checks() {
        let a = Arc::new(Rec::default());
        let b = Arc::new(Rec::default());
        let mut bus = Bus::new();
        bus.insert(a.clone(), 0x1000, 0x100).unwrap();
        bus.insert(b.clone(), 0x3f8, 8).unwrap();
        assert_eq!(bus.len(), 2);

        let mut d = [0u8; 4];
        bus.read(0x1010, &mut d).unwrap();
        assert_eq!(d, [0x10; 4]);
        bus.write(0x3fd, &[1]).unwrap();
        assert_eq!(*b.0.lock().unwrap(), vec![('w', 5, 1)]);
        // Last byte of a range is fine, crossing the end is not.
        bus.read(0x10fc, &mut d).unwrap();
        assert_eq!(
            bus.read(0x10fd, &mut d),
            Err(BusError::Unclaimed {
                addr: 0x10fd,
                size: 4
            })
        );
        assert_eq!(d, [0xff; 4]);
        // Below the first range, between ranges, past the last, at u64::MAX.
        assert!(bus.write(0x0, &[0]).is_err());
        assert!(bus.write(0x400, &[0]).is_err());
        assert!(bus.write(0x1100, &[0]).is_err());
        assert!(bus.write(u64::MAX, &[0, 0]).is_err());
        assert!(bus.write(0x1000, &[]).is_err());
        assert_eq!(a.0.lock().unwrap().len(), 2);
    }

    #[test]
    fn rejects_overlap_and_bad_ranges() {
        let d: Arc<dyn BusDevice> = Arc::new(Rec::default());
        let mut bus = Bus::new();
        bus.insert(d.clone(), 0x1000, 0x100).unwrap();
        assert!(matches!(
            bus.insert(d.clone(), 0x10ff, 1),
            Err(BusError::Overlap { .. })
        ));
        assert!(matches!(
            bus.insert(d.clone(), 0xf00, 0x101),
            Err(BusError::Overlap { .. })
        ));
        bus.insert(d.clone(), 0xf00, 0x100).unwrap();
        bus.insert(d.clone(), 0x1100, 0x100).unwrap();
        assert!(matches!(
            bus.insert(d.clone(), 5, 0),
            Err(BusError::InvalidRange { .. })
        ));
        assert!(matches!(
            bus.insert(d, u64::MAX, 2),
            Err(BusError::InvalidRange { .. })
        ));
    }
}
