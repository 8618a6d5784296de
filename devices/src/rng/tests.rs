//! virtio-rng model tests against split queues in real guest memory.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress};
use vmm::virtio::VirtioDevice;

use super::*;
use crate::blk::testring::{mem, CountingInterrupt, Mem, Ring};

const MEM_SIZE: usize = 8 << 20;
const QSIZE: u16 = 64;
const RING_BASE: u64 = 0x1_0000;
const BUF_BASE: u64 = 0x10_0000;
const BUF_LEN: u64 = 4 << 20;

fn rig() -> (Mem, Ring, Queue, RngModel) {
    let m = mem(MEM_SIZE);
    let ring = Ring::new(&m, RING_BASE, QSIZE, BUF_BASE, BUF_LEN);
    let q = ring.queue(&m);
    (m, ring, q, RngModel::new())
}

fn read(m: &Mem, addr: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    m.read_slice(&mut b, GuestAddress(addr)).unwrap();
    b
}

#[test]
fn fills_writable_buffers_with_random_bytes() {
    let (m, mut ring, mut q, mut model) = rig();
    let a = ring.filled(&m, 64, 0);
    let b = ring.filled(&m, 100, 0);
    let head = ring.post(&m, &[(a, 64, true), (b, 100, true)]);
    assert!(model.process_queue(&m, &mut q).unwrap());
    assert_eq!(ring.used(&m), vec![(u32::from(head), 164)]);
    let got = [read(&m, a, 64), read(&m, b, 100)].concat();
    // 164 random bytes are all zero with probability 2^-1312; a run of 16
    // equal bytes with about 2^-120.
    assert!(got.iter().any(|&x| x != 0), "not all zero");
    assert!(got.windows(16).all(|w| w.iter().any(|&x| x != w[0])));
    // Two requests differ.
    let c = ring.filled(&m, 64, 0);
    ring.post(&m, &[(c, 64, true)]);
    model.process_queue(&m, &mut q).unwrap();
    assert_eq!(ring.used(&m)[0].1, 64);
    assert_ne!(read(&m, c, 64), read(&m, a, 64));
    assert_eq!(model.stats().bytes.load(Ordering::Relaxed), 228);
}

#[test]
fn bounds_each_request() {
    let (m, mut ring, mut q, mut model) = rig();
    let big = MAX_BYTES_PER_REQUEST + 4096;
    let a = ring.filled(&m, big, 0);
    ring.post(&m, &[(a, big as u32, true)]);
    model.process_queue(&m, &mut q).unwrap();
    assert_eq!(ring.used(&m)[0].1 as usize, MAX_BYTES_PER_REQUEST);
    assert_eq!(
        read(&m, a + MAX_BYTES_PER_REQUEST as u64, 4096),
        vec![0u8; 4096],
        "nothing written past the bound"
    );
}

#[test]
fn bad_chains_do_not_panic() {
    let (m, mut ring, mut q, mut model) = rig();
    // Readable only: nothing written.
    let a = ring.filled(&m, 32, 7);
    ring.post(&m, &[(a, 32, false)]);
    // A readable buffer before a writable one: the writable one is filled,
    // the readable one left alone.
    let r = ring.filled(&m, 32, 7);
    let w = ring.filled(&m, 32, 0);
    ring.post(&m, &[(r, 32, false), (w, 32, true)]);
    // A writable buffer outside guest memory.
    ring.post(&m, &[(MEM_SIZE as u64 - 8, 64, true)]);
    ring.post(&m, &[(u64::MAX - 8, 64, true)]);
    // Zero-length buffer.
    let z = ring.filled(&m, 1, 0);
    ring.post(&m, &[(z, 0, true)]);
    model.process_queue(&m, &mut q).unwrap();
    let lens: Vec<u32> = ring.used(&m).iter().map(|u| u.1).collect();
    assert_eq!(lens, vec![0, 32, 0, 0, 0]);
    assert_eq!(read(&m, a, 32), vec![7u8; 32]);
    assert_eq!(read(&m, r, 32), vec![7u8; 32]);
    assert_eq!(model.stats().malformed.load(Ordering::Relaxed), 4);
    // A broken available ring is a queue error, not a panic.
    ring.corrupt_avail_idx(&m, 5000);
    assert!(matches!(
        model.process_queue(&m, &mut q),
        Err(RngError::Queue { index: 0, .. })
    ));
}

#[test]
fn device_face_serves_from_its_worker() {
    let mut dev = RngDevice::new();
    assert_eq!(dev.device_type(), VIRTIO_ID_RNG);
    assert_eq!(dev.queue_max_sizes(), &[QUEUE_SIZE]);
    let m = mem(MEM_SIZE);
    let irq = Arc::new(CountingInterrupt::default());
    let mut ring = Ring::new(&m, RING_BASE, QSIZE, BUF_BASE, BUF_LEN);
    let (queue, kick) = ring.active_queue(&m, 0);
    dev.activate(m.clone(), irq.clone(), vec![queue]).unwrap();
    let a = ring.filled(&m, 16, 0);
    ring.post(&m, &[(a, 16, true)]);
    kick.write(1).unwrap();
    assert_eq!(ring.wait_used(&m).1, 16);
    assert_ne!(read(&m, a, 16), vec![0u8; 16]);
    assert!(irq.used.load(Ordering::SeqCst) >= 1);
    assert!(dev.reset());
    assert_eq!(dev.stats().bytes.load(Ordering::Relaxed), 16);
}

#[test]
fn fill_random_fills_large_buffers() {
    let mut b = vec![0u8; 1 << 20];
    fill_random(&mut b).unwrap();
    // Every 4 KiB page got bytes (a short getrandom would leave zero pages).
    assert!(b.chunks(4096).all(|p| p.iter().any(|&x| x != 0)));
}

/// Stateless beyond its queue: paused, the device hands the queue back
/// with its positions and a resumed device goes on in the next slot.
#[test]
fn pause_and_resume_keep_the_queue() {
    use virtio_queue::QueueT;
    let mut dev = RngDevice::new();
    let m = mem(MEM_SIZE);
    let irq = Arc::new(CountingInterrupt::default());
    let mut ring = Ring::new(&m, RING_BASE, QSIZE, BUF_BASE, BUF_LEN);
    let (queue, kick) = ring.active_queue(&m, 0);
    dev.activate(m.clone(), irq.clone(), vec![queue]).unwrap();
    let a = ring.filled(&m, 16, 0);
    ring.post(&m, &[(a, 16, true)]);
    kick.write(1).unwrap();
    assert_eq!(ring.wait_used(&m), (0, 16));
    let queues = VirtioDevice::pause(&mut dev).unwrap();
    assert!(!dev.is_active());
    assert_eq!(queues[0].queue.next_used(), 1);
    assert!(VirtioDevice::save_state(&mut dev, &m, &mut [])
        .unwrap()
        .is_empty());
    let mut fresh = RngDevice::new();
    fresh.restore_state(&[]).unwrap();
    assert!(fresh.restore_state(&[1]).is_err());
    fresh.resume(m.clone(), irq.clone(), queues).unwrap();
    let b = ring.filled(&m, 8, 0);
    ring.post(&m, &[(b, 8, true)]);
    kick.write(1).unwrap();
    assert_eq!(ring.wait_used(&m), (1, 8));
    assert!(fresh.reset());
    assert!(
        VirtioDevice::pause(&mut fresh).unwrap().is_empty(),
        "nothing to pause"
    );
}
