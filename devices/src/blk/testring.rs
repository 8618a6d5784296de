//! Test support shared by the blk and rng unit tests: a driver-side split
//! virtqueue laid out by hand in real guest memory (virtio-queue's
//! `MockSplitQueue` puts its used ring over the upper half of its available
//! ring, which breaks once more than half the queue is posted).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::virtio::{ActiveQueue, VirtioInterrupt};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Guest memory of the tests.
pub type Mem = GuestMemoryMmap<()>;

/// One descriptor to post: (guest address, length, device-writable).
pub type Desc = (u64, u32, bool);

/// Guest memory of `size` bytes at address 0.
pub fn mem(size: usize) -> Mem {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).unwrap()
}

/// Driver side of one split queue.
pub struct Ring {
    /// Queue size.
    pub size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
    next_buf: u64,
    buf_end: u64,
}

impl Ring {
    /// Lays out a queue of `size` at `base` (descriptor table, available
    /// ring, used ring, each zeroed) and hands out buffers from
    /// `[buf_base, buf_base + buf_len)`.
    pub fn new(mem: &Mem, base: u64, size: u16, buf_base: u64, buf_len: u64) -> Self {
        let n = u64::from(size);
        let desc = base;
        let avail = desc + 16 * n;
        let used = (avail + 6 + 2 * n).next_multiple_of(4);
        let end = used + 6 + 8 * n;
        mem.write_slice(&vec![0u8; (end - base) as usize], GuestAddress(base))
            .unwrap();
        assert!(
            end <= buf_base || base >= buf_base + buf_len,
            "rings overlap buffers"
        );
        Self {
            size,
            desc,
            avail,
            used,
            next_desc: 0,
            avail_idx: 0,
            used_seen: 0,
            next_buf: buf_base,
            buf_end: buf_base + buf_len,
        }
    }

    /// The device-side queue for these rings (event index off).
    pub fn queue(&self, mem: &Mem) -> Queue {
        let mut q = Queue::new(self.size).unwrap();
        q.set_size(self.size);
        q.set_desc_table_address(Some(self.desc as u32), Some((self.desc >> 32) as u32));
        q.set_avail_ring_address(Some(self.avail as u32), Some((self.avail >> 32) as u32));
        q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
        q.set_ready(true);
        assert!(q.is_valid(mem));
        q
    }

    /// These rings as queue `index` handed to an in-process device at
    /// activation, and the eventfd that kicks it.
    pub fn active_queue(&self, mem: &Mem, index: u16) -> (ActiveQueue, EventFd) {
        let notify = EventFd::new(EFD_NONBLOCK).unwrap();
        let kick = notify.try_clone().unwrap();
        let q = ActiveQueue {
            index,
            queue: self.queue(mem),
            notify,
        };
        (q, kick)
    }

    /// A guest buffer holding `data`.
    pub fn buf(&mut self, mem: &Mem, data: &[u8]) -> u64 {
        let a = self.alloc(data.len() as u64);
        mem.write_slice(data, GuestAddress(a)).unwrap();
        a
    }

    /// A guest buffer of `len` bytes filled with `fill`.
    pub fn filled(&mut self, mem: &Mem, len: usize, fill: u8) -> u64 {
        self.buf(mem, &vec![fill; len])
    }

    fn alloc(&mut self, len: u64) -> u64 {
        let a = self.next_buf;
        self.next_buf += len.max(1).next_multiple_of(64);
        assert!(self.next_buf <= self.buf_end, "test buffer area exhausted");
        a
    }

    fn flags(writable: bool, next: bool) -> u16 {
        let mut f = 0u16;
        if writable {
            f |= VRING_DESC_F_WRITE as u16;
        }
        if next {
            f |= VRING_DESC_F_NEXT as u16;
        }
        f
    }

    /// Makes the chain at `head` available.
    fn publish(&mut self, mem: &Mem, head: u16) {
        let slot = self.avail + 4 + u64::from(self.avail_idx % self.size) * 2;
        mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    /// Posts a chain of descriptors in the table; returns its head.
    pub fn post(&mut self, mem: &Mem, descs: &[Desc]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, writable)) in descs.iter().enumerate() {
            let idx = self.next_desc;
            let next = (idx + 1) % self.size;
            let last = i + 1 == descs.len();
            let d = SplitDescriptor::new(addr, len, Self::flags(writable, !last), next);
            mem.write_obj(
                RawDescriptor::from(d),
                GuestAddress(self.desc + u64::from(idx) * 16),
            )
            .unwrap();
            self.next_desc = next;
        }
        self.publish(mem, head);
        head
    }

    /// Posts a chain whose descriptors live in an indirect table; returns
    /// its head.
    pub fn post_indirect(&mut self, mem: &Mem, descs: &[Desc]) -> u16 {
        let table = self.alloc(16 * descs.len() as u64);
        for (i, &(addr, len, writable)) in descs.iter().enumerate() {
            let last = i + 1 == descs.len();
            let d = SplitDescriptor::new(addr, len, Self::flags(writable, !last), (i + 1) as u16);
            mem.write_obj(RawDescriptor::from(d), GuestAddress(table + i as u64 * 16))
                .unwrap();
        }
        let head = self.next_desc;
        let d = SplitDescriptor::new(
            table,
            16 * descs.len() as u32,
            VRING_DESC_F_INDIRECT as u16,
            0,
        );
        mem.write_obj(
            RawDescriptor::from(d),
            GuestAddress(self.desc + u64::from(head) * 16),
        )
        .unwrap();
        self.next_desc = (head + 1) % self.size;
        self.publish(mem, head);
        head
    }

    /// Index of the descriptor the next posted chain starts at.
    pub fn next_index(&self) -> u16 {
        self.next_desc
    }

    /// Posts a head descriptor with arbitrary raw fields (for malformed
    /// chains: loops, bad next indexes).
    pub fn post_raw(&mut self, mem: &Mem, raw: &[(u64, u32, u16, u16)]) -> u16 {
        let head = self.next_desc;
        for &(addr, len, flags, next) in raw {
            let idx = self.next_desc;
            mem.write_obj(
                RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next)),
                GuestAddress(self.desc + u64::from(idx) * 16),
            )
            .unwrap();
            self.next_desc = (idx + 1) % self.size;
        }
        self.publish(mem, head);
        head
    }

    /// Sets the available ring's index to an arbitrary value (a broken
    /// driver).
    pub fn corrupt_avail_idx(&mut self, mem: &Mem, idx: u16) {
        mem.write_obj(idx, GuestAddress(self.avail + 2)).unwrap();
    }

    /// New used elements since the last call: (head, length).
    pub fn used(&mut self, mem: &Mem) -> Vec<(u32, u32)> {
        let idx: u16 = mem.read_obj(GuestAddress(self.used + 2)).unwrap();
        let mut out = Vec::new();
        while self.used_seen != idx {
            let e = self.used + 4 + u64::from(self.used_seen % self.size) * 8;
            let id: u32 = mem.read_obj(GuestAddress(e)).unwrap();
            let len: u32 = mem.read_obj(GuestAddress(e + 4)).unwrap();
            out.push((id, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }

    /// Waits (bounded) for the next used element.
    pub fn wait_used(&mut self, mem: &Mem) -> (u32, u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let idx: u16 = mem.read_obj(GuestAddress(self.used + 2)).unwrap();
            if idx != self.used_seen {
                let e = self.used + 4 + u64::from(self.used_seen % self.size) * 8;
                let id: u32 = mem.read_obj(GuestAddress(e)).unwrap();
                let len: u32 = mem.read_obj(GuestAddress(e + 4)).unwrap();
                self.used_seen = self.used_seen.wrapping_add(1);
                return (id, len);
            }
            assert!(Instant::now() < deadline, "no used element within 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A [`VirtioInterrupt`] that counts signals.
#[derive(Default)]
pub struct CountingInterrupt {
    /// Used-buffer notifications.
    pub used: AtomicU32,
    /// Needs-reset signals.
    pub needs_reset: AtomicU32,
}

impl VirtioInterrupt for CountingInterrupt {
    fn signal_used_queue(&self, _queue: u16) -> std::io::Result<()> {
        self.used.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn signal_config_change(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn signal_needs_reset(&self) -> std::io::Result<()> {
        self.needs_reset.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}
