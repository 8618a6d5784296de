//! virtio-balloon tests: the clipping of reported runs, the model against
//! split queues in real guest memory, the device face on its worker, and
//! the host-mapping releaser on anonymous and memfd-backed memory.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryRegion, MemoryRegionAddress};
use vmm::virtio::VirtioDevice;

use super::*;
use crate::blk::testring::{mem, CountingInterrupt, Mem, Ring};

const MEM_SIZE: usize = 16 << 20;
const RING_BASE: u64 = 0x1_0000;
const BUF_BASE: u64 = 0x10_0000;
const BUF_LEN: u64 = 1 << 20;
/// Where the tests' "free" runs live (past the rings and buffers).
const FREE_BASE: u64 = 0x40_0000;
const MIB: u64 = 1 << 20;

/// A releaser that records what it was asked to release.
#[derive(Default)]
struct Recorder(Mutex<Vec<(u64, u64)>>);

impl MemoryReleaser for Recorder {
    fn release(
        &self,
        mem: &GuestMemoryMmap,
        gpa: GuestAddress,
        len: u64,
    ) -> Result<(), ReleaseError> {
        // The device's promise: aligned, non-empty, inside one region.
        assert!(len > 0 && gpa.0 % PAGE_SIZE == 0 && len % PAGE_SIZE == 0);
        let region = mem.find_region(gpa).expect("inside guest memory");
        assert!(gpa.0 + len <= region.start_addr().0 + region.len());
        self.0.lock().unwrap().push((gpa.0, len));
        Ok(())
    }
}

impl Recorder {
    fn take(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

fn rig() -> (Mem, Ring, Queue, BalloonModel, Arc<Recorder>) {
    let m = mem(MEM_SIZE);
    let ring = Ring::new(&m, RING_BASE, QUEUE_SIZE, BUF_BASE, BUF_LEN);
    let q = ring.queue(&m);
    let rec = Arc::new(Recorder::default());
    (m, ring, q, BalloonModel::new(rec.clone()), rec)
}

/// Memory of two regions with a hole: [0, 4 MiB) and [8 MiB, 12 MiB).
fn holey() -> Mem {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20), (GuestAddress(8 << 20), 4 << 20)])
        .unwrap()
}

#[test]
fn clip_keeps_whole_pages_inside_guest_memory() {
    let m = holey();
    // A well-formed 2 MiB report.
    assert_eq!(
        clip_report(&m, 2 * MIB, 2 * MIB),
        (vec![(GuestAddress(2 * MIB), 2 * MIB)], false)
    );
    // Partial pages at both ends are dropped.
    assert_eq!(
        clip_report(&m, 0x1800, 0x3000),
        (vec![(GuestAddress(0x2000), 0x2000)], true)
    );
    // Less than a page: nothing.
    assert_eq!(clip_report(&m, 0x1001, 0xfff), (vec![], true));
    // Zero length: nothing, nothing dropped.
    assert_eq!(clip_report(&m, 0x1000, 0), (vec![], false));
    // Across the hole: the two parts in memory, split by region.
    assert_eq!(
        clip_report(&m, 3 * MIB, 6 * MIB),
        (
            vec![(GuestAddress(3 * MIB), MIB), (GuestAddress(8 * MIB), MIB)],
            true
        )
    );
    // Past the end of memory.
    assert_eq!(
        clip_report(&m, 11 * MIB, 4 * MIB),
        (vec![(GuestAddress(11 * MIB), MIB)], true)
    );
    // Wholly outside, and wrapping around the address space.
    assert_eq!(clip_report(&m, 5 * MIB, MIB), (vec![], true));
    assert_eq!(clip_report(&m, 64 << 30, 1 << 30), (vec![], true));
    assert_eq!(clip_report(&m, u64::MAX - 0x10, 0x1000), (vec![], true));
    assert_eq!(clip_report(&m, u64::MAX, u64::MAX), (vec![], true));
    assert_eq!(clip_report(&m, u64::MAX - 0x800, 0x400), (vec![], true));
}

#[test]
fn clip_bounds_each_run() {
    let big =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 * MAX_RANGE_BYTES as usize)]).unwrap();
    let (pieces, dropped) = clip_report(&big, 0, u64::from(u32::MAX) & !(PAGE_SIZE - 1));
    assert_eq!(pieces, vec![(GuestAddress(0), MAX_RANGE_BYTES)]);
    assert!(dropped);
}

#[test]
fn reports_are_released_and_returned_empty() {
    let (m, mut ring, mut q, mut model, rec) = rig();
    // Linux posts each report as one chain of device-writable descriptors.
    let head = ring.post(
        &m,
        &[
            (FREE_BASE, 2 * MIB as u32, true),
            (FREE_BASE + 4 * MIB, 4 * MIB as u32, true),
        ],
    );
    assert!(model
        .process_queue(QueueRole::Reporting, &m, &mut q)
        .unwrap());
    assert_eq!(ring.used(&m), vec![(u32::from(head), 0)]);
    assert_eq!(
        rec.take(),
        vec![(FREE_BASE, 2 * MIB), (FREE_BASE + 4 * MIB, 4 * MIB)]
    );
    let stats = model.stats();
    assert_eq!(stats.reports.load(Ordering::Relaxed), 1);
    assert_eq!(stats.bytes_released.load(Ordering::Relaxed), 6 * MIB);
    assert_eq!(stats.rejected.load(Ordering::Relaxed), 0);
    // Readable descriptors and indirect tables work the same way.
    ring.post_indirect(
        &m,
        &[(FREE_BASE, 4096, false), (FREE_BASE + 8192, 4096, true)],
    );
    model
        .process_queue(QueueRole::Reporting, &m, &mut q)
        .unwrap();
    assert_eq!(ring.used(&m).len(), 1);
    assert_eq!(
        rec.take(),
        vec![(FREE_BASE, 4096), (FREE_BASE + 8192, 4096)]
    );
}

#[test]
fn hostile_reports_release_nothing_outside_guest_memory() {
    let (m, mut ring, mut q, mut model, rec) = rig();
    let end = MEM_SIZE as u64;
    ring.post(&m, &[(end, 2 * MIB as u32, true)]);
    ring.post(&m, &[(u64::MAX - 4095, u32::MAX, true)]);
    ring.post(&m, &[(end - 4096, 8192, true), (0x1234, 10, false)]);
    ring.post(&m, &[(FREE_BASE + 1, 4096, true)]);
    // A descriptor loop is virtio-queue's to stop; the chain still returns.
    let next = ring.next_index();
    ring.post_raw(
        &m,
        &[(
            FREE_BASE,
            4096,
            virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16,
            next,
        )],
    );
    model
        .process_queue(QueueRole::Reporting, &m, &mut q)
        .unwrap();
    let lens: Vec<u32> = ring.used(&m).iter().map(|u| u.1).collect();
    assert_eq!(lens, vec![0; 5], "every chain is returned, empty");
    let got = rec.take();
    // Only the last page of memory (the in-range part of the third chain)
    // and at most the looping chain's page were released.
    assert!(got.contains(&(end - 4096, 4096)), "{got:?}");
    assert!(got
        .iter()
        .all(|&(a, l)| a + l <= end && (a == end - 4096 || a == FREE_BASE)));
    assert!(model.stats().rejected.load(Ordering::Relaxed) >= 4);
    // A broken available ring is a queue error, not a panic.
    ring.corrupt_avail_idx(&m, 5000);
    assert!(matches!(
        model.process_queue(QueueRole::Reporting, &m, &mut q),
        Err(BalloonError::Queue {
            index: REPORTING_QUEUE,
            ..
        })
    ));
}

#[test]
fn inflate_and_deflate_chains_are_returned_unread() {
    let (m, mut ring, mut q, mut model, rec) = rig();
    let pfns: Vec<u8> = [0x400u32, 0x401]
        .iter()
        .flat_map(|p| p.to_le_bytes())
        .collect();
    let a = ring.buf(&m, &pfns);
    let head = ring.post(&m, &[(a, 8, false)]);
    assert!(model.process_queue(QueueRole::Inflate, &m, &mut q).unwrap());
    assert_eq!(ring.used(&m), vec![(u32::from(head), 0)]);
    assert!(rec.take().is_empty());
    assert_eq!(model.stats().ignored_chains.load(Ordering::Relaxed), 1);
}

#[test]
fn roles_follow_the_negotiated_features() {
    assert_eq!(QueueRole::of(0, false), Some(QueueRole::Inflate));
    assert_eq!(QueueRole::of(1, true), Some(QueueRole::Deflate));
    assert_eq!(QueueRole::of(2, true), Some(QueueRole::Reporting));
    assert_eq!(QueueRole::of(2, false), None);
    assert_eq!(QueueRole::of(3, true), None);
}

#[test]
fn device_face_reports_from_its_worker() {
    let rec = Arc::new(Recorder::default());
    let mut dev = BalloonDevice::new(rec.clone());
    assert_eq!(dev.device_type(), VIRTIO_ID_BALLOON);
    assert_eq!(dev.queue_max_sizes(), &[QUEUE_SIZE; NUM_QUEUES]);
    let offered = dev.avail_features();
    assert_ne!(offered & (1 << VIRTIO_BALLOON_F_PAGE_REPORTING), 0);
    assert_eq!(offered & (1 << VIRTIO_BALLOON_F_DEFLATE_ON_OOM), 0);
    // num_pages and actual are 0; beyond the config space nothing is read.
    let mut cfg = [0xffu8; 8];
    dev.read_config(0, &mut cfg);
    assert_eq!(cfg, [0; 8]);
    let mut past = [0xffu8; 4];
    dev.read_config(8, &mut past);
    assert_eq!(past, [0xff; 4]);
    assert!(dev.ack_features(offered));

    let m = mem(MEM_SIZE);
    let irq = Arc::new(CountingInterrupt::default());
    // Three queues in separate areas of memory.
    let mut rings: Vec<Ring> = (0..NUM_QUEUES as u64)
        .map(|i| {
            Ring::new(
                &m,
                RING_BASE + i * 0x4000,
                QUEUE_SIZE,
                BUF_BASE + i * 0x1_0000,
                0x1_0000,
            )
        })
        .collect();
    let mut kicks = Vec::new();
    let mut queues = Vec::new();
    for (i, ring) in rings.iter().enumerate() {
        let (q, kick) = ring.active_queue(&m, i as u16);
        queues.push(q);
        kicks.push(kick);
    }
    dev.activate(m.clone(), irq.clone(), queues).unwrap();
    assert!(dev.is_active());
    let reporting = &mut rings[REPORTING_QUEUE as usize];
    reporting.post(&m, &[(FREE_BASE, 2 * MIB as u32, true)]);
    kicks[REPORTING_QUEUE as usize].write(1).unwrap();
    assert_eq!(reporting.wait_used(&m).1, 0);
    assert_eq!(rec.take(), vec![(FREE_BASE, 2 * MIB)]);
    assert!(irq.used.load(Ordering::SeqCst) >= 1);
    let inflate = &mut rings[INFLATE_QUEUE as usize];
    let a = inflate.buf(&m, &[0; 4]);
    inflate.post(&m, &[(a, 4, false)]);
    kicks[INFLATE_QUEUE as usize].write(1).unwrap();
    assert_eq!(inflate.wait_used(&m).1, 0);
    assert!(dev.reset());
    assert!(!dev.is_active());
    assert_eq!(dev.stats().bytes_released.load(Ordering::Relaxed), 2 * MIB);
    assert_eq!(irq.needs_reset.load(Ordering::SeqCst), 0);

    // A driver without free page reporting: queue 2 is not served.
    assert!(dev.ack_features(offered & !(1 << VIRTIO_BALLOON_F_PAGE_REPORTING)));
    let mut queues = Vec::new();
    let mut kicks = Vec::new();
    for (i, ring) in rings.iter().enumerate() {
        let (q, kick) = ring.active_queue(&m, i as u16);
        queues.push(q);
        kicks.push(kick);
    }
    // Fresh rings (the old ones' indexes moved on).
    let mut fresh = Ring::new(&m, 0xC_0000, QUEUE_SIZE, 0xD_0000, 0x1_0000);
    let (q2, kick2) = fresh.active_queue(&m, REPORTING_QUEUE);
    queues[REPORTING_QUEUE as usize] = q2;
    dev.activate(m.clone(), irq.clone(), queues).unwrap();
    fresh.post(&m, &[(FREE_BASE, 2 * MIB as u32, true)]);
    kick2.write(1).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(fresh.used(&m).is_empty(), "queue 2 is not served");
    assert!(rec.take().is_empty());
    assert!(dev.reset());
}

/// Which of the `pages` pages at `host` are resident (mincore).
fn resident(host: *mut u8, pages: usize) -> Vec<bool> {
    let mut vec = vec![0u8; pages];
    // SAFETY: [host, host + pages pages) is a mapping owned by the test's
    // guest memory; vec has one byte per page.
    let rc = unsafe { libc::mincore(host.cast(), pages * PAGE_SIZE as usize, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().map(|b| b & 1 != 0).collect()
}

fn host_addr(m: &Mem, gpa: u64) -> *mut u8 {
    let r = m.find_region(GuestAddress(gpa)).unwrap();
    r.get_host_address(MemoryRegionAddress(gpa - r.start_addr().0))
        .unwrap()
}

#[test]
fn host_mapping_releaser_frees_anonymous_memory() {
    let m = vmm::memory::create(8, vmm::memory::Backing::Anonymous)
        .unwrap()
        .mem;
    let gpa = 2 * MIB;
    let pages = 64;
    let len = pages as u64 * PAGE_SIZE;
    m.write_slice(&vec![0xa5u8; len as usize + 4096], GuestAddress(gpa))
        .unwrap();
    assert!(resident(host_addr(&m, gpa), pages).iter().all(|&r| r));
    HostMappingReleaser
        .release(&m, GuestAddress(gpa), len)
        .unwrap();
    assert!(resident(host_addr(&m, gpa), pages).iter().all(|&r| !r));
    let mut back = vec![0xffu8; len as usize];
    m.read_slice(&mut back, GuestAddress(gpa)).unwrap();
    assert!(back.iter().all(|&b| b == 0), "released pages read as zero");
    // The page after the range is untouched.
    assert_eq!(m.read_obj::<u8>(GuestAddress(gpa + len)).unwrap(), 0xa5);
    // Hostile ranges are refused, not released.
    assert!(matches!(
        HostMappingReleaser.release(&m, GuestAddress(8 * MIB), PAGE_SIZE),
        Err(ReleaseError::NotGuestMemory { .. })
    ));
    assert!(matches!(
        HostMappingReleaser.release(&m, GuestAddress(7 * MIB), 2 * MIB),
        Err(ReleaseError::NotGuestMemory { .. })
    ));
    assert!(matches!(
        HostMappingReleaser.release(&m, GuestAddress(0x800), PAGE_SIZE),
        Err(ReleaseError::Unaligned { .. })
    ));
}

#[test]
fn host_mapping_releaser_punches_holes_in_memfd_memory() {
    let ram = vmm::memory::create(8, vmm::memory::Backing::Memfd).unwrap();
    let (m, fd) = (ram.mem, ram.memfd.unwrap());
    let blocks = || {
        // SAFETY: fstat on an fd we own into a zeroed stat buffer.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a writable stat buffer that fstat fills; the descriptor is open.
        assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
        st.st_blocks as u64 * 512
    };
    let gpa = 2 * MIB;
    m.write_slice(&vec![0x5au8; 4 * MIB as usize], GuestAddress(gpa))
        .unwrap();
    let before = blocks();
    assert!(before >= 4 * MIB, "memfd holds the written pages: {before}");
    HostMappingReleaser
        .release(&m, GuestAddress(gpa), 2 * MIB)
        .unwrap();
    let after = blocks();
    assert!(
        before - after >= 2 * MIB,
        "hole punched: {before} -> {after} bytes"
    );
    let mut back = vec![0xffu8; 2 * MIB as usize];
    m.read_slice(&mut back, GuestAddress(gpa)).unwrap();
    assert!(back.iter().all(|&b| b == 0));
    assert_eq!(m.read_obj::<u8>(GuestAddress(gpa + 2 * MIB)).unwrap(), 0x5a);
}

#[test]
fn the_real_releaser_behind_the_model_zeroes_reported_pages() {
    let m = vmm::memory::create(16, vmm::memory::Backing::Anonymous)
        .unwrap()
        .mem;
    let mut ring = Ring::new(&m, RING_BASE, QUEUE_SIZE, BUF_BASE, BUF_LEN);
    let mut q = ring.queue(&m);
    let mut model = BalloonModel::new(Arc::new(HostMappingReleaser));
    m.write_slice(&vec![0x77u8; 4 * MIB as usize], GuestAddress(FREE_BASE))
        .unwrap();
    ring.post(&m, &[(FREE_BASE, 2 * MIB as u32, true)]);
    model
        .process_queue(QueueRole::Reporting, &m, &mut q)
        .unwrap();
    assert_eq!(ring.used(&m).len(), 1);
    assert!(resident(host_addr(&m, FREE_BASE), 512).iter().all(|&r| !r));
    assert_eq!(m.read_obj::<u8>(GuestAddress(FREE_BASE)).unwrap(), 0);
    assert_eq!(
        m.read_obj::<u8>(GuestAddress(FREE_BASE + 2 * MIB)).unwrap(),
        0x77
    );
    assert_eq!(
        model.stats().bytes_released.load(Ordering::Relaxed),
        2 * MIB
    );
}

#[test]
fn host_mapping_releaser_never_brings_back_a_snapshots_pages() {
    // A restored VM's RAM: a private mapping of a snapshot's memory file
    // full of non-zero data.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("memory.bin");
    std::fs::write(&path, vec![0x3cu8; 8 * MIB as usize]).unwrap();
    let file = Arc::new(std::fs::File::open(&path).unwrap());
    let m = vmm::memory::map_snapshot(8, file).unwrap().mem;
    let region = m.find_region(GuestAddress(0)).unwrap();
    assert_eq!(
        vmm::memory::MappingKind::of(region),
        vmm::memory::MappingKind::PrivateFile
    );
    let gpa = 2 * MIB;
    // One page the guest wrote (copy-on-write), the rest as in the file.
    m.write_obj(0x11u8, GuestAddress(gpa)).unwrap();
    assert_eq!(m.read_obj::<u8>(GuestAddress(gpa + 8192)).unwrap(), 0x3c);
    HostMappingReleaser
        .release(&m, GuestAddress(gpa), 2 * MIB)
        .unwrap();
    // The released range reads zeroes, not the file's bytes, and keeps
    // reading zeroes once written and released again.
    let mut back = vec![0xffu8; 2 * MIB as usize];
    m.read_slice(&mut back, GuestAddress(gpa)).unwrap();
    assert!(back.iter().all(|&b| b == 0), "the file's pages came back");
    m.write_obj(0x22u8, GuestAddress(gpa + 4096)).unwrap();
    HostMappingReleaser
        .release(&m, GuestAddress(gpa), 2 * MIB)
        .unwrap();
    assert_eq!(m.read_obj::<u8>(GuestAddress(gpa + 4096)).unwrap(), 0);
    // Outside the range: the file's bytes; the file itself is unchanged.
    assert_eq!(m.read_obj::<u8>(GuestAddress(gpa - 1)).unwrap(), 0x3c);
    assert_eq!(m.read_obj::<u8>(GuestAddress(gpa + 2 * MIB)).unwrap(), 0x3c);
    let file = std::fs::read(&path).unwrap();
    assert!(
        file.iter().all(|&b| b == 0x3c),
        "the snapshot file was written"
    );
}

/// Paused, the device hands back the queues it served; its counters are
/// what it saves, and a restored device reports on from there, on the
/// reporting queue's next slot.
#[test]
fn pause_save_and_restore_keep_the_queues_and_counters() {
    let rec = Arc::new(Recorder::default());
    let mut dev = BalloonDevice::new(rec.clone());
    assert!(dev.ack_features(dev.avail_features()));
    let m = mem(MEM_SIZE);
    let irq = Arc::new(CountingInterrupt::default());
    let mut rings: Vec<Ring> = (0..NUM_QUEUES as u64)
        .map(|i| {
            Ring::new(
                &m,
                RING_BASE + i * 0x4000,
                QUEUE_SIZE,
                BUF_BASE + i * 0x1_0000,
                0x1_0000,
            )
        })
        .collect();
    let mut kicks = Vec::new();
    let mut queues = Vec::new();
    for (i, ring) in rings.iter().enumerate() {
        let (q, kick) = ring.active_queue(&m, i as u16);
        queues.push(q);
        kicks.push(kick);
    }
    dev.activate(m.clone(), irq.clone(), queues).unwrap();
    let reporting = &mut rings[REPORTING_QUEUE as usize];
    reporting.post(&m, &[(FREE_BASE, 2 * MIB as u32, true)]);
    kicks[REPORTING_QUEUE as usize].write(1).unwrap();
    assert_eq!(reporting.wait_used(&m), (0, 0));

    let queues = VirtioDevice::pause(&mut dev).unwrap();
    assert!(!dev.is_active());
    assert_eq!(queues.len(), NUM_QUEUES);
    let saved = VirtioDevice::save_state(&mut dev, &m, &mut []).unwrap();
    drop(dev);

    let mut dev = BalloonDevice::new(rec.clone());
    assert!(dev.ack_features(dev.avail_features()));
    assert!(dev.restore_state(&saved[1..]).is_err());
    dev.restore_state(&saved).unwrap();
    assert_eq!(dev.stats().bytes_released.load(Ordering::Relaxed), 2 * MIB);
    assert_eq!(dev.stats().reports.load(Ordering::Relaxed), 1);
    dev.resume(m.clone(), irq.clone(), queues).unwrap();
    let reporting = &mut rings[REPORTING_QUEUE as usize];
    reporting.post(&m, &[(FREE_BASE + 2 * MIB, 2 * MIB as u32, true)]);
    kicks[REPORTING_QUEUE as usize].write(1).unwrap();
    assert_eq!(reporting.wait_used(&m), (1, 0), "the next slot");
    assert_eq!(
        rec.take(),
        vec![(FREE_BASE, 2 * MIB), (FREE_BASE + 2 * MIB, 2 * MIB)]
    );
    assert_eq!(dev.stats().bytes_released.load(Ordering::Relaxed), 4 * MIB);
    assert!(dev.reset());
}
