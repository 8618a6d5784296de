//! virtio-blk model tests: the test plays the guest driver on split queues
//! laid out in real guest memory ([`super::testring`]) and checks what the
//! device answers and what reaches the host files.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_ring::VRING_DESC_F_NEXT;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm::virtio::VirtioDevice;

use super::device::{BlkConfig, BlkDevice, BlkDeviceError, BlkModel, CONFIG_SIZE};
use super::image::{create_sparse_image, BlockBackend, ImageError, RawImage};
use super::testring::{mem, CountingInterrupt, Desc, Mem, Ring};
use super::SESSION_DISK_SERIAL;

const MEM_SIZE: usize = 64 << 20;
const QSIZE: u16 = 256;
const RING_BASE: u64 = 0x1_0000;
const BUF_BASE: u64 = 0x10_0000;
const BUF_LEN: u64 = 48 << 20;
/// Disk size of most tests: 4 MiB.
const DISK: u64 = 4 << 20;
const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .rotate_left(seed as u32) as u8
                ^ seed
        })
        .collect()
}

fn hdr(kind: u32, sector: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(16);
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&sector.to_le_bytes());
    h
}

fn segment(sector: u64, num: u32, flags: u32) -> Vec<u8> {
    let mut s = Vec::with_capacity(16);
    s.extend_from_slice(&sector.to_le_bytes());
    s.extend_from_slice(&num.to_le_bytes());
    s.extend_from_slice(&flags.to_le_bytes());
    s
}

/// A raw image of `size` bytes filled with `fill`.
fn raw_file(dir: &Path, name: &str, size: u64, fill: u8) -> PathBuf {
    let p = dir.join(name);
    let mut f = fs::File::create(&p).unwrap();
    f.write_all(&vec![fill; size as usize]).unwrap();
    p
}

fn file_bytes(p: &Path, off: u64, len: usize) -> Vec<u8> {
    let f = fs::File::open(p).unwrap();
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, off).unwrap();
    b
}

/// A model, its queue and the fake driver.
struct Rig {
    mem: Mem,
    ring: Ring,
    q: Queue,
    model: BlkModel,
}

impl Rig {
    fn new(backend: Box<dyn BlockBackend>) -> Self {
        Self::with_serial(backend, SESSION_DISK_SERIAL)
    }

    fn with_serial(backend: Box<dyn BlockBackend>, serial: &str) -> Self {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("debug")
            .try_init();
        let mem = mem(MEM_SIZE);
        let ring = Ring::new(&mem, RING_BASE, QSIZE, BUF_BASE, BUF_LEN);
        let q = ring.queue(&mem);
        let model = BlkModel::new(backend, &BlkConfig::new(serial)).unwrap();
        Self {
            mem,
            ring,
            q,
            model,
        }
    }

    /// Posts `descs`, runs the device, returns the used length.
    fn run(&mut self, descs: &[Desc]) -> u32 {
        let head = self.ring.post(&self.mem, descs);
        self.model.process_queue(&self.mem, &mut self.q).unwrap();
        let used = self.ring.used(&self.mem);
        assert_eq!(used.len(), 1, "one chain completed");
        assert_eq!(used[0].0, u32::from(head));
        used[0].1
    }

    fn status_buf(&mut self) -> u64 {
        self.ring.filled(&self.mem, 1, 0xee)
    }

    fn status(&self, at: u64) -> u8 {
        self.mem.read_obj(GuestAddress(at)).unwrap()
    }

    /// OUT of `data` at `sector` as header | data | status; returns status.
    fn write(&mut self, sector: u64, data: &[u8]) -> u8 {
        let h = self.ring.buf(&self.mem, &hdr(VIRTIO_BLK_T_OUT, sector));
        let d = self.ring.buf(&self.mem, data);
        let s = self.status_buf();
        let used = self.run(&[(h, 16, false), (d, data.len() as u32, false), (s, 1, true)]);
        assert_eq!(used, 1, "OUT writes only the status");
        self.status(s)
    }

    /// IN of `len` bytes at `sector`; returns (status, data).
    fn read(&mut self, sector: u64, len: usize) -> (u8, Vec<u8>) {
        let h = self.ring.buf(&self.mem, &hdr(VIRTIO_BLK_T_IN, sector));
        let d = self.ring.filled(&self.mem, len, 0xcc);
        let s = self.status_buf();
        let used = self.run(&[(h, 16, false), (d, len as u32, true), (s, 1, true)]);
        let st = self.status(s);
        if st == OK {
            assert_eq!(used as usize, len + 1, "IN used length = data + status");
        }
        let mut out = vec![0u8; len];
        self.mem.read_slice(&mut out, GuestAddress(d)).unwrap();
        (st, out)
    }

    /// A request of `kind` with no data; returns status.
    fn simple(&mut self, kind: u32) -> u8 {
        let h = self.ring.buf(&self.mem, &hdr(kind, 0));
        let s = self.status_buf();
        assert_eq!(self.run(&[(h, 16, false), (s, 1, true)]), 1);
        self.status(s)
    }

    /// DISCARD / WRITE_ZEROES with `segs`; returns status.
    fn segments(&mut self, kind: u32, segs: &[Vec<u8>]) -> u8 {
        let mut body = hdr(kind, 0);
        for s in segs {
            body.extend_from_slice(s);
        }
        let b = self.ring.buf(&self.mem, &body);
        let s = self.status_buf();
        assert_eq!(self.run(&[(b, body.len() as u32, false), (s, 1, true)]), 1);
        self.status(s)
    }
}

fn raw_rig(dir: &Path) -> (Rig, PathBuf) {
    let p = raw_file(dir, "disk.img", DISK, 0);
    (Rig::new(Box::new(RawImage::open(&p).unwrap())), p)
}

#[test]
fn raw_read_write_round_trip_and_host_file_contents() {
    let t = tempfile::tempdir().unwrap();
    let (mut rig, path) = raw_rig(t.path());
    let data = pattern(1, 64 * 1024);
    assert_eq!(rig.write(8, &data), OK);
    let (st, got) = rig.read(8, data.len());
    assert_eq!(st, OK);
    assert_eq!(got, data);
    // The bytes are at sector 8 of the host file.
    assert_eq!(file_bytes(&path, 8 * 512, data.len()), data);
    // Neighbouring sectors untouched.
    assert_eq!(rig.read(7, 512).1, vec![0u8; 512]);
    let s = rig.model.stats();
    assert_eq!(s.bytes_written.load(Ordering::Relaxed), 64 * 1024);
    assert_eq!(s.errors.load(Ordering::Relaxed), 0);
}

#[test]
fn data_split_over_descriptors_and_status_sharing_a_buffer() {
    let t = tempfile::tempdir().unwrap();
    let (mut rig, _p) = raw_rig(t.path());
    let data = pattern(2, 3 * 512);
    // Header and the first 100 data bytes in one descriptor, the rest in two.
    let mut first = hdr(VIRTIO_BLK_T_OUT, 100);
    first.extend_from_slice(&data[..100]);
    let a = rig.ring.buf(&rig.mem, &first);
    let b = rig.ring.buf(&rig.mem, &data[100..1000]);
    let c = rig.ring.buf(&rig.mem, &data[1000..]);
    let s = rig.status_buf();
    rig.run(&[
        (a, first.len() as u32, false),
        (b, 900, false),
        (c, 536, false),
        (s, 1, true),
    ]);
    assert_eq!(rig.status(s), OK);
    // IN whose last data descriptor also holds the status byte.
    let h = rig.ring.buf(&rig.mem, &hdr(VIRTIO_BLK_T_IN, 100));
    let d1 = rig.ring.filled(&rig.mem, 1000, 0);
    let d2 = rig.ring.filled(&rig.mem, 536 + 1, 0);
    let used = rig.run(&[(h, 16, false), (d1, 1000, true), (d2, 537, true)]);
    assert_eq!(used, 1537);
    let mut got = vec![0u8; 1536];
    rig.mem
        .read_slice(&mut got[..1000], GuestAddress(d1))
        .unwrap();
    rig.mem
        .read_slice(&mut got[1000..], GuestAddress(d2))
        .unwrap();
    assert_eq!(got, data);
    assert_eq!(rig.status(d2 + 536), OK);
}

#[test]
fn large_request_through_an_indirect_table() {
    let t = tempfile::tempdir().unwrap();
    let (mut rig, _p) = raw_rig(t.path());
    // 2 MiB: larger than the bounce buffer, in 16 segments.
    let data = pattern(3, 2 << 20);
    let h = rig.ring.buf(&rig.mem, &hdr(VIRTIO_BLK_T_OUT, 0));
    let mut descs = vec![(h, 16, false)];
    for part in data.chunks(128 * 1024) {
        let a = rig.ring.buf(&rig.mem, part);
        descs.push((a, part.len() as u32, false));
    }
    let s = rig.status_buf();
    descs.push((s, 1, true));
    let head = rig.ring.post_indirect(&rig.mem, &descs);
    rig.model.process_queue(&rig.mem, &mut rig.q).unwrap();
    assert_eq!(rig.ring.used(&rig.mem), vec![(u32::from(head), 1)]);
    assert_eq!(rig.status(s), OK);
    let (st, got) = rig.read(0, data.len());
    assert_eq!(st, OK);
    assert_eq!(got, data);
}

#[test]
fn more_than_half_the_queue_in_flight() {
    let t = tempfile::tempdir().unwrap();
    let (mut rig, _p) = raw_rig(t.path());
    // 80 three-descriptor chains = 240 of 256 descriptors.
    let mut posted = Vec::new();
    for i in 0..80u64 {
        let h = rig.ring.buf(&rig.mem, &hdr(VIRTIO_BLK_T_OUT, i));
        let d = rig.ring.buf(&rig.mem, &[i as u8; 512]);
        let s = rig.status_buf();
        posted.push((
            rig.ring
                .post(&rig.mem, &[(h, 16, false), (d, 512, false), (s, 1, true)]),
            s,
        ));
    }
    assert!(rig.model.process_queue(&rig.mem, &mut rig.q).unwrap());
    let used = rig.ring.used(&rig.mem);
    assert_eq!(used.len(), 80);
    for ((head, s), (id, len)) in posted.iter().zip(&used) {
        assert_eq!((u32::from(*head), 1), (*id, *len));
        assert_eq!(rig.status(*s), OK);
    }
    for i in 0..80u64 {
        assert_eq!(rig.read(i, 512).1, vec![i as u8; 512]);
    }
}

#[test]
fn flush_syncs_and_get_id_returns_the_serial() {
    let t = tempfile::tempdir().unwrap();
    let (mut rig, path) = raw_rig(t.path());
    assert_eq!(rig.write(0, &[7u8; 512]), OK);
    assert_eq!(rig.simple(VIRTIO_BLK_T_FLUSH), OK);
    assert_eq!(rig.model.stats().flushes.load(Ordering::Relaxed), 1);
    assert_eq!(file_bytes(&path, 0, 512), vec![7u8; 512]);

    let h = rig.ring.buf(&rig.mem, &hdr(VIRTIO_BLK_T_GET_ID, 0));
    let d = rig.ring.filled(&rig.mem, 20, 0xff);
    let s = rig.status_buf();
    assert_eq!(rig.run(&[(h, 16, false), (d, 20, true), (s, 1, true)]), 21);
    assert_eq!(rig.status(s), OK);
    let mut id = [0u8; 20];
    rig.mem.read_slice(&mut id, GuestAddress(d)).unwrap();
    let mut want = [0u8; 20];
    want[..SESSION_DISK_SERIAL.len()].copy_from_slice(SESSION_DISK_SERIAL.as_bytes());
    assert_eq!(id, want);

    // A short ID buffer gets the serial's first bytes.
    let h = rig.ring.buf(&rig.mem, &hdr(VIRTIO_BLK_T_GET_ID, 0));
    let d = rig.ring.filled(&rig.mem, 6, 0);
    let s = rig.status_buf();
    assert_eq!(rig.run(&[(h, 16, false), (d, 6, true), (s, 1, true)]), 7);
    let mut id = [0u8; 6];
    rig.mem.read_slice(&mut id, GuestAddress(d)).unwrap();
    assert_eq!(&id, b"cowork");
    // No ID buffer at all.
    assert_eq!(rig.simple(VIRTIO_BLK_T_GET_ID), IOERR);
}

#[test]
fn out_of_range_sectors_fail_without_touching_the_file() {
    let t = tempfile::tempdir().unwrap();
    let (mut rig, path) = raw_rig(t.path());
    let cap = DISK / 512;
    assert_eq!(rig.model.capacity(), cap);
    assert_eq!(rig.write(cap, &[1u8; 512]), IOERR);
    assert_eq!(rig.write(cap - 1, &[1u8; 1024]), IOERR);
    assert_eq!(rig.write(u64::MAX, &[1u8; 512]), IOERR);
    assert_eq!(rig.write(u64::MAX >> 9, &[1u8; 512]), IOERR);
    assert_eq!(rig.read(cap, 512).0, IOERR);
    assert_eq!(rig.read(u64::MAX - 1, 1024).0, IOERR);
    // The last sector itself is fine.
    assert_eq!(rig.write(cap - 1, &[2u8; 512]), OK);
    assert_eq!(fs::metadata(&path).unwrap().len(), DISK, "file not grown");
    assert_eq!(
        rig.segments(VIRTIO_BLK_T_WRITE_ZEROES, &[segment(cap - 1, 2, 0)]),
        IOERR
    );
    assert_eq!(
        rig.segments(VIRTIO_BLK_T_DISCARD, &[segment(u64::MAX, 1, 0)]),
        IOERR
    );
    assert_eq!(rig.read(cap - 1, 512).1, vec![2u8; 512]);
}

#[test]
fn read_only_disk_refuses_writes() {
    let t = tempfile::tempdir().unwrap();
    let p = raw_file(t.path(), "ro.img", DISK, 9);
    let mut rig = Rig::new(Box::new(RawImage::open_read_only(&p).unwrap()));
    let f = rig.model.features();
    assert_ne!(f & (1 << VIRTIO_BLK_F_RO), 0, "RO offered");
    assert_eq!(f & (1 << VIRTIO_BLK_F_DISCARD), 0, "no DISCARD on RO");
    assert_eq!(f & (1 << VIRTIO_BLK_F_WRITE_ZEROES), 0);
    assert_eq!(rig.write(0, &[1u8; 512]), IOERR);
    assert_eq!(
        rig.segments(VIRTIO_BLK_T_WRITE_ZEROES, &[segment(0, 1, 0)]),
        UNSUPP
    );
    assert_eq!(rig.read(0, 512), (OK, vec![9u8; 512]));
    assert_eq!(rig.simple(VIRTIO_BLK_T_FLUSH), OK);
    assert_eq!(file_bytes(&p, 0, 512), vec![9u8; 512]);
}

#[test]
fn malformed_chains_complete_without_panic() {
    let t = tempfile::tempdir().unwrap();
    let (mut rig, path) = raw_rig(t.path());
    let m = rig.mem.clone();

    // No status descriptor: readable only -> used length 0, nothing written.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_OUT, 0));
    let d = rig.ring.buf(&m, &[5u8; 512]);
    assert_eq!(rig.run(&[(h, 16, false), (d, 512, false)]), 0);

    // Header too short.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_IN, 0)[..8]);
    let s = rig.status_buf();
    assert_eq!(rig.run(&[(h, 8, false), (s, 1, true)]), 1);
    assert_eq!(rig.status(s), IOERR);

    // Header in a device-writable buffer.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_IN, 0));
    let s = rig.status_buf();
    rig.run(&[(h, 16, true), (s, 1, true)]);
    assert_eq!(rig.status(s), IOERR);

    // IN whose data buffer is device-readable.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_IN, 0));
    let d = rig.ring.filled(&m, 512, 0);
    let s = rig.status_buf();
    rig.run(&[(h, 16, false), (d, 512, false), (s, 1, true)]);
    assert_eq!(rig.status(s), IOERR);

    // OUT whose data buffer is device-writable.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_OUT, 0));
    let d = rig.ring.filled(&m, 512, 5);
    let s = rig.status_buf();
    rig.run(&[(h, 16, false), (d, 512, true), (s, 1, true)]);
    assert_eq!(rig.status(s), IOERR);

    // Data not a whole number of sectors.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_OUT, 0));
    let d = rig.ring.filled(&m, 100, 5);
    let s = rig.status_buf();
    rig.run(&[(h, 16, false), (d, 100, false), (s, 1, true)]);
    assert_eq!(rig.status(s), IOERR);

    // A readable descriptor after a writable one.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_OUT, 0));
    let w = rig.ring.filled(&m, 512, 0);
    let d = rig.ring.filled(&m, 512, 5);
    let s = rig.status_buf();
    rig.run(&[
        (h, 16, false),
        (w, 512, true),
        (d, 512, false),
        (s, 1, true),
    ]);
    assert_eq!(rig.status(s), IOERR);

    // A data buffer outside guest memory.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_IN, 0));
    let s = rig.status_buf();
    rig.run(&[
        (h, 16, false),
        (MEM_SIZE as u64 - 256, 512, true),
        (s, 1, true),
    ]);
    assert_eq!(rig.status(s), IOERR);
    // ... and one whose end wraps the address space.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_IN, 0));
    let s = rig.status_buf();
    rig.run(&[(h, 16, false), (u64::MAX - 100, 512, true), (s, 1, true)]);
    assert_eq!(rig.status(s), IOERR);

    // The status byte outside guest memory: used length 0.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_FLUSH, 0));
    assert_eq!(
        rig.run(&[(h, 16, false), (MEM_SIZE as u64 + 4096, 1, true)]),
        0
    );

    // Unknown and unsupported types.
    assert_eq!(rig.simple(VIRTIO_BLK_T_SCSI_CMD), UNSUPP);
    assert_eq!(rig.simple(0xdead_beef), UNSUPP);
    assert_eq!(rig.simple(VIRTIO_BLK_T_SECURE_ERASE), UNSUPP);

    // A descriptor loop: the chain ends after queue-size descriptors.
    let h = rig.ring.buf(&m, &hdr(VIRTIO_BLK_T_IN, 0));
    let next = rig.ring.next_index();
    rig.ring
        .post_raw(&m, &[(h, 16, VRING_DESC_F_NEXT as u16, next)]);
    rig.model.process_queue(&m, &mut rig.q).unwrap();
    let used = rig.ring.used(&m);
    assert_eq!(used.len(), 1);
    assert_eq!(used[0].1, 0, "no status byte in a looping readable chain");

    // Nothing reached the file, the device still works.
    assert_eq!(file_bytes(&path, 0, 512), vec![0u8; 512]);
    assert_eq!(rig.write(0, &[3u8; 512]), OK);
    assert_eq!(rig.read(0, 512), (OK, vec![3u8; 512]));
    let s = rig.model.stats();
    assert!(s.malformed.load(Ordering::Relaxed) >= 9);
}

#[test]
fn broken_available_ring_is_a_queue_error() {
    let t = tempfile::tempdir().unwrap();
    let (mut rig, _p) = raw_rig(t.path());
    rig.ring.corrupt_avail_idx(&rig.mem, QSIZE + 10);
    match rig.model.process_queue(&rig.mem, &mut rig.q) {
        Err(BlkDeviceError::Queue { index: 0, .. }) => {}
        other => panic!("expected a queue error, got {other:?}"),
    }
}

#[test]
fn discard_and_write_zeroes_on_a_raw_image() {
    let t = tempfile::tempdir().unwrap();
    let p = raw_file(t.path(), "d.img", DISK, 0x5a);
    let mut rig = Rig::new(Box::new(RawImage::open(&p).unwrap()));
    let f = rig.model.features();
    assert_ne!(f & (1 << VIRTIO_BLK_F_DISCARD), 0);
    assert_ne!(f & (1 << VIRTIO_BLK_F_WRITE_ZEROES), 0);
    let blocks_before = fs::metadata(&p).unwrap().blocks();
    // Zero 1 MiB at sector 2048 (with unmap) and 3 sectors at 100 (without).
    assert_eq!(
        rig.segments(
            VIRTIO_BLK_T_WRITE_ZEROES,
            &[segment(2048, 2048, 1), segment(100, 3, 0)]
        ),
        OK
    );
    assert_eq!(rig.read(2048, 1 << 20).1, vec![0u8; 1 << 20]);
    assert_eq!(rig.read(100, 3 * 512).1, vec![0u8; 3 * 512]);
    assert_eq!(rig.read(99, 512).1, vec![0x5a; 512]);
    assert_eq!(rig.read(103, 512).1, vec![0x5a; 512]);
    // The host released blocks (tmpfs and ext4 punch holes).
    assert!(fs::metadata(&p).unwrap().blocks() < blocks_before);
    // Discard is accepted and never touches data outside its range.
    assert_eq!(rig.segments(VIRTIO_BLK_T_DISCARD, &[segment(0, 8, 0)]), OK);
    assert_eq!(rig.read(8, 512).1, vec![0x5a; 512]);
    // The unmap flag is invalid on DISCARD, reserved flags on either.
    assert_eq!(
        rig.segments(VIRTIO_BLK_T_DISCARD, &[segment(0, 8, 1)]),
        UNSUPP
    );
    assert_eq!(
        rig.segments(VIRTIO_BLK_T_WRITE_ZEROES, &[segment(0, 8, 2)]),
        UNSUPP
    );
    // Too many segments, an over-long segment, a torn segment list.
    let many: Vec<Vec<u8>> = (0..33).map(|i| segment(i * 8, 8, 0)).collect();
    assert_eq!(rig.segments(VIRTIO_BLK_T_DISCARD, &many), IOERR);
    assert_eq!(
        rig.segments(VIRTIO_BLK_T_WRITE_ZEROES, &[segment(0, (1 << 22) + 1, 0)]),
        IOERR
    );
    assert_eq!(
        rig.segments(VIRTIO_BLK_T_DISCARD, &[segment(0, 8, 0)[..10].to_vec()]),
        IOERR
    );
    assert_eq!(rig.segments(VIRTIO_BLK_T_DISCARD, &[]), IOERR);
    // A failed segment list changed nothing, even its valid first segment.
    assert_eq!(
        rig.segments(
            VIRTIO_BLK_T_WRITE_ZEROES,
            &[segment(200, 1, 0), segment(DISK / 512, 1, 0)]
        ),
        IOERR
    );
    assert_eq!(rig.read(200, 512).1, vec![0x5a; 512]);
}

#[test]
fn images_are_locked_while_open() {
    let t = tempfile::tempdir().unwrap();
    let p = raw_file(t.path(), "l.img", DISK, 0);
    let rw = RawImage::open(&p).unwrap();
    assert!(matches!(RawImage::open(&p), Err(ImageError::Locked(_))));
    assert!(matches!(
        RawImage::open_read_only(&p),
        Err(ImageError::Locked(_))
    ));
    drop(rw);
    // Direct callers cannot reach past the end either.
    let mut img = RawImage::open(&p).unwrap();
    assert!(img.write_at(&[1u8; 512], DISK).is_err());
    assert!(img.read_at(&mut [0u8; 512], u64::MAX - 10).is_err());
    assert!(img.write_zeroes(DISK - 512, 1024).is_err());
    assert_eq!(fs::metadata(&p).unwrap().len(), DISK);
    drop(img);
    let ro1 = RawImage::open_read_only(&p).unwrap();
    let _ro2 = RawImage::open_read_only(&p).unwrap();
    assert!(matches!(RawImage::open(&p), Err(ImageError::Locked(_))));
    drop(ro1);
}

#[test]
fn config_space_describes_the_disk() {
    let t = tempfile::tempdir().unwrap();
    let (rig, _p) = raw_rig(t.path());
    let c = rig.model.config();
    assert_eq!(c.len(), CONFIG_SIZE);
    let u32_at = |o: usize| u32::from_le_bytes(c[o..o + 4].try_into().unwrap());
    assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), DISK / 512);
    assert_eq!(u32_at(12), u32::from(QSIZE) - 2, "seg_max");
    assert_eq!(u32_at(20), 512, "blk_size");
    assert_eq!(
        u32_at(36),
        super::device::MAX_SEGMENT_SECTORS,
        "max_discard_sectors"
    );
    assert_eq!(
        u32_at(40),
        super::device::MAX_DISCARD_SEGMENTS,
        "max_discard_seg"
    );
    assert_eq!(
        u32_at(48),
        super::device::MAX_SEGMENT_SECTORS,
        "max_write_zeroes_sectors"
    );
    assert_eq!(c[56], 1, "write_zeroes_may_unmap");
    let f = rig.model.features();
    for bit in [
        VIRTIO_BLK_F_SEG_MAX,
        VIRTIO_BLK_F_BLK_SIZE,
        VIRTIO_BLK_F_FLUSH,
    ] {
        assert_ne!(f & (1 << bit), 0, "feature {bit}");
    }
    assert_eq!(f & (1 << VIRTIO_BLK_F_RO), 0);
}

#[test]
fn bad_configs_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let p = raw_file(t.path(), "x.img", 4096, 0);
    let long = BlkConfig::new("a-serial-longer-than-20");
    assert!(matches!(
        BlkModel::new(Box::new(RawImage::open(&p).unwrap()), &long),
        Err(BlkDeviceError::SerialTooLong { .. })
    ));
    let mut odd = BlkConfig::new("x");
    odd.queue_size = 100;
    assert!(matches!(
        BlkModel::new(Box::new(RawImage::open(&p).unwrap()), &odd),
        Err(BlkDeviceError::QueueSize(100))
    ));
    let tiny = raw_file(t.path(), "tiny.img", 100, 0);
    assert!(matches!(
        RawImage::open(&tiny),
        Err(ImageError::TooSmall { size: 100, .. })
    ));
    assert!(matches!(
        RawImage::open(t.path()),
        Err(ImageError::NotAFile(_)) | Err(ImageError::Open { .. })
    ));
}

// ---- create_sparse_image ---------------------------------------------------

#[test]
fn create_sparse_image_creates_grows_and_never_shrinks() {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().join("sessiondata.img");
    assert_eq!(create_sparse_image(&p, 1 << 30).unwrap(), 1 << 30);
    let m = fs::metadata(&p).unwrap();
    assert_eq!(m.len(), 1 << 30);
    assert!(m.blocks() < 64, "sparse: {} blocks", m.blocks());
    assert_eq!(m.mode() & 0o777, 0o600);
    // Data survives a second call with the same, a smaller, a larger size.
    fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .write_all_at(b"session", 4096)
        .unwrap();
    assert_eq!(create_sparse_image(&p, 1 << 30).unwrap(), 1 << 30);
    assert_eq!(create_sparse_image(&p, 1 << 20).unwrap(), 1 << 30);
    assert_eq!(fs::metadata(&p).unwrap().len(), 1 << 30, "never shrunk");
    assert_eq!(create_sparse_image(&p, 2 << 30).unwrap(), 2 << 30);
    assert_eq!(fs::metadata(&p).unwrap().len(), 2 << 30);
    assert_eq!(file_bytes(&p, 4096, 7), b"session");
    for bad in [0, 1000, u64::MAX - 511] {
        assert!(matches!(
            create_sparse_image(&p, bad),
            Err(ImageError::InvalidSize(_))
        ));
    }
    assert!(
        create_sparse_image(t.path(), 1 << 20).is_err(),
        "a directory"
    );
}

// ---- the in-process face ---------------------------------------------------

#[test]
fn device_serves_through_its_worker_and_survives_reset() {
    let t = tempfile::tempdir().unwrap();
    let p = raw_file(t.path(), "dev.img", DISK, 0);
    let mut dev = BlkDevice::new(
        Box::new(RawImage::open(&p).unwrap()),
        &BlkConfig::new("dev"),
    )
    .unwrap();
    assert_eq!(dev.device_type(), 2);
    assert_eq!(dev.queue_max_sizes(), &[QSIZE]);
    let mut cap = [0u8; 8];
    dev.read_config(0, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), DISK / 512);
    let mut oob = [0xffu8; 4];
    dev.read_config(CONFIG_SIZE as u64 - 2, &mut oob);
    assert_eq!(oob, [0xff; 4], "out-of-range config read left untouched");
    let m = mem(MEM_SIZE);
    let irq = Arc::new(CountingInterrupt::default());
    for round in 0..2u8 {
        let mut ring = Ring::new(&m, RING_BASE, QSIZE, BUF_BASE, BUF_LEN);
        let (queue, kick) = ring.active_queue(&m, 0);
        dev.activate(m.clone(), irq.clone(), vec![queue]).unwrap();
        assert!(dev.is_active());
        let h = ring.buf(&m, &hdr(VIRTIO_BLK_T_OUT, u64::from(round)));
        let d = ring.buf(&m, &[round + 1; 512]);
        let s = ring.filled(&m, 1, 0xee);
        ring.post(&m, &[(h, 16, false), (d, 512, false), (s, 1, true)]);
        kick.write(1).unwrap();
        assert_eq!(ring.wait_used(&m).1, 1);
        assert_eq!(m.read_obj::<u8>(GuestAddress(s)).unwrap(), OK);
        assert!(dev.reset());
        assert!(!dev.is_active());
    }
    assert!(irq.used.load(Ordering::SeqCst) >= 2);
    assert_eq!(file_bytes(&p, 0, 512), vec![1u8; 512]);
    assert_eq!(file_bytes(&p, 512, 512), vec![2u8; 512]);
    assert_eq!(dev.stats().requests.load(Ordering::Relaxed), 2);
    // Activation without the request queue is refused.
    assert!(dev.activate(m.clone(), irq.clone(), Vec::new()).is_err());
}

#[test]
fn device_asks_for_reset_on_a_broken_ring() {
    let t = tempfile::tempdir().unwrap();
    let p = raw_file(t.path(), "dev.img", DISK, 0);
    let mut dev = BlkDevice::new(
        Box::new(RawImage::open(&p).unwrap()),
        &BlkConfig::new("dev"),
    )
    .unwrap();
    let m = mem(MEM_SIZE);
    let irq = Arc::new(CountingInterrupt::default());
    let mut ring = Ring::new(&m, RING_BASE, QSIZE, BUF_BASE, BUF_LEN);
    let (queue, kick) = ring.active_queue(&m, 0);
    dev.activate(m.clone(), irq.clone(), vec![queue]).unwrap();
    ring.corrupt_avail_idx(&m, 9999);
    kick.write(1).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while irq.needs_reset.load(Ordering::SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline, "no needs-reset");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert!(dev.reset(), "the parked worker stops on reset");
}

/// A snapshot keeps the queue and swaps the disk: the paused device hands
/// its queue back (positions included) and saves nothing else; a new
/// device over another image resumes that queue, serves the next chain in
/// the next used slot from *its* image, and its config space (another
/// capacity) differs, which makes the transport tell the driver.
#[test]
fn a_snapshot_keeps_the_queue_and_swaps_the_disk() {
    let t = tempfile::tempdir().unwrap();
    let first = raw_file(t.path(), "first.img", DISK, 1);
    let second = raw_file(t.path(), "second.img", 2 * DISK, 2);
    let mut dev = BlkDevice::new(
        Box::new(RawImage::open(&first).unwrap()),
        &BlkConfig::new("d"),
    )
    .unwrap();
    let m = mem(MEM_SIZE);
    let irq = Arc::new(CountingInterrupt::default());
    let mut ring = Ring::new(&m, RING_BASE, QSIZE, BUF_BASE, BUF_LEN);
    let (queue, kick) = ring.active_queue(&m, 0);
    dev.activate(m.clone(), irq.clone(), vec![queue]).unwrap();
    let read_sector = |ring: &mut Ring, kick: &vmm_sys_util::eventfd::EventFd| {
        let h = ring.buf(&m, &hdr(VIRTIO_BLK_T_IN, 0));
        let d = ring.filled(&m, 512, 0);
        let s = ring.filled(&m, 1, 0xee);
        ring.post(&m, &[(h, 16, false), (d, 512, true), (s, 1, true)]);
        kick.write(1).unwrap();
        let used = ring.wait_used(&m);
        assert_eq!(m.read_obj::<u8>(GuestAddress(s)).unwrap(), OK);
        (used, m.read_obj::<u8>(GuestAddress(d)).unwrap())
    };
    assert_eq!(read_sector(&mut ring, &kick), ((0, 513), 1));

    let mut queues = VirtioDevice::pause(&mut dev).unwrap();
    assert!(!dev.is_active());
    assert_eq!(queues.len(), 1);
    assert_eq!(
        (queues[0].queue.next_avail(), queues[0].queue.next_used()),
        (1, 1)
    );
    let saved = VirtioDevice::save_state(&mut dev, &m, &mut []).unwrap();
    assert!(saved.is_empty());
    let config = dev.config_snapshot();
    drop(dev);

    let mut dev = BlkDevice::new(
        Box::new(RawImage::open(&second).unwrap()),
        &BlkConfig::new("d"),
    )
    .unwrap();
    dev.restore_state(&saved).unwrap();
    assert!(dev.restore_state(&[0]).is_err());
    assert_ne!(dev.config_snapshot(), config, "another capacity");
    let queue = queues.pop().unwrap();
    let kick = queue.notify.try_clone().unwrap();
    dev.resume(m.clone(), irq.clone(), vec![queue]).unwrap();
    assert_eq!(
        read_sector(&mut ring, &kick),
        ((3, 513), 2),
        "the next slot, from the new disk"
    );
    assert!(dev.reset());
}
