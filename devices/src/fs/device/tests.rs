//! FsDevice with split virtqueues in real guest memory: FUSE requests
//! written the way a driver does, well-formed and malformed. (The rings are
//! laid out here rather than with virtio-queue's `MockSplitQueue`, whose
//! used ring overlaps the upper half of its available ring.)

use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

use fuse_backend_rs::abi::fuse_abi::{
    AttrOut, EntryOut, ForgetIn, InHeader, InitIn, Opcode, OpenIn, OpenOut, OutHeader, ReadIn,
    SetattrIn, KERNEL_MINOR_VERSION, KERNEL_VERSION,
};
use fuse_backend_rs::api::filesystem::{SetattrValid, ROOT_ID};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::QueueT;
use vm_memory::{ByteValued, Bytes, GuestAddress};
use vmm::virtio::VirtioDevice;
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::fs::testutil::{Fixture, PRE};
use crate::fs::{GrantMode, GrantOwner, SessionFsOptions};

/// Guest memory size.
const MEM_SIZE: u64 = 32 << 20;
/// Queue size used by the tests.
const QSIZE: u16 = 16;
/// Where the queues' rings live.
const RING_BASE: [u64; 2] = [0x1_0000, 0x2_0000];
/// Where request and reply buffers are allocated from.
const BUF_BASE: u64 = 0x10_0000;
/// Size of each reply buffer.
const REPLY_LEN: u32 = 8192;

#[derive(Default)]
struct TestInterrupt {
    used: AtomicU32,
    config: AtomicU32,
    needs_reset: AtomicU32,
}

impl VirtioInterrupt for TestInterrupt {
    fn signal_used_queue(&self, _queue: u16) -> io::Result<()> {
        self.used.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn signal_config_change(&self) -> io::Result<()> {
        self.config.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn signal_needs_reset(&self) -> io::Result<()> {
        self.needs_reset.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// Driver-side view of one split queue.
struct Ring {
    desc: GuestAddress,
    avail: GuestAddress,
    used: GuestAddress,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
}

/// One descriptor of a chain to post: (address, length, device-writable).
type Desc = (u64, u32, bool);

struct Harness {
    mem: GuestMemoryMmap,
    dev: FsDevice,
    irq: Arc<TestInterrupt>,
    rings: Vec<Ring>,
    kicks: Vec<EventFd>,
    next_buf: u64,
    unique: u64,
    _fx: Fixture,
}

impl Harness {
    fn new() -> Self {
        // Device logs show up with a failing test's output.
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("debug")
            .try_init();
        let fx = Fixture::new();
        let fs = Arc::new(SessionFs::new(SessionFsOptions::default()));
        fs.add_grant("s", "m", &fx.host(), GrantMode::Ro).unwrap();
        let dev = FsDevice::new(DEFAULT_TAG, 1, fs).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap();
        let mut h = Self {
            mem,
            dev,
            irq: Arc::default(),
            rings: Vec::new(),
            kicks: Vec::new(),
            next_buf: BUF_BASE,
            unique: 1,
            _fx: fx,
        };
        h.activate().unwrap();
        h
    }

    fn activate(&mut self) -> Result<(), ActivateError> {
        self.activate_queues(&[HIPRIO_QUEUE, FIRST_REQUEST_QUEUE])
    }

    fn activate_queues(&mut self, indexes: &[u16]) -> Result<(), ActivateError> {
        self.rings.clear();
        self.kicks.clear();
        let mut queues = Vec::new();
        for (i, base) in RING_BASE.iter().enumerate() {
            // Zero the rings (a re-activation starts from scratch).
            self.mem
                .write_slice(&[0u8; 0x1000], GuestAddress(*base))
                .unwrap();
            // Split-ring layout (virtio 1.2 §2.7): descriptor table, then the
            // available ring (flags, idx, ring[n], used_event), then the used
            // ring (flags, idx, ring[n] of 8 bytes, avail_event), 4-aligned.
            let n = u64::from(QSIZE);
            let desc = GuestAddress(*base);
            let avail = GuestAddress(*base + 16 * n);
            let used = GuestAddress((avail.0 + 6 + 2 * n).next_multiple_of(4));
            let mut queue = Queue::new(QSIZE).unwrap();
            queue.set_size(QSIZE);
            queue.set_desc_table_address(Some(desc.0 as u32), Some((desc.0 >> 32) as u32));
            queue.set_avail_ring_address(Some(avail.0 as u32), Some((avail.0 >> 32) as u32));
            queue.set_used_ring_address(Some(used.0 as u32), Some((used.0 >> 32) as u32));
            queue.set_ready(true);
            assert!(queue.is_valid(&self.mem));
            self.rings.push(Ring {
                desc,
                avail,
                used,
                next_desc: 0,
                avail_idx: 0,
                used_seen: 0,
            });
            let notify = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
            self.kicks.push(notify.try_clone().unwrap());
            if indexes.contains(&(i as u16)) {
                queues.push(ActiveQueue {
                    index: i as u16,
                    queue,
                    notify,
                });
            }
        }
        self.dev
            .activate(self.mem.clone(), self.irq.clone(), queues)
    }

    /// Copies `data` into a fresh guest buffer.
    fn buf(&mut self, data: &[u8]) -> u64 {
        let addr = self.next_buf;
        self.mem.write_slice(data, GuestAddress(addr)).unwrap();
        self.next_buf += (data.len() as u64).max(1).next_multiple_of(64);
        addr
    }

    /// A zeroed device-writable buffer.
    fn reply_buf(&mut self) -> u64 {
        self.buf(&vec![0u8; REPLY_LEN as usize])
    }

    /// Posts a chain on queue `q` and kicks it.
    fn post(&mut self, q: usize, descs: &[Desc]) {
        let ring = &mut self.rings[q];
        let head = ring.next_desc;
        for (i, (addr, len, writable)) in descs.iter().enumerate() {
            let idx = ring.next_desc;
            let last = i + 1 == descs.len();
            let mut flags = if *writable { VRING_DESC_F_WRITE } else { 0 } as u16;
            if !last {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let next = (idx + 1) % QSIZE;
            let d = RawDescriptor::from(SplitDescriptor::new(*addr, *len, flags, next));
            let at = ring.desc.0 + u64::from(idx) * 16;
            self.mem.write_obj(d, GuestAddress(at)).unwrap();
            ring.next_desc = next;
        }
        let slot = ring.avail.0 + 4 + u64::from(ring.avail_idx % QSIZE) * 2;
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        ring.avail_idx = ring.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(ring.avail_idx, GuestAddress(ring.avail.0 + 2))
            .unwrap();
        self.kicks[q].write(1).unwrap();
    }

    /// Waits for the next used element of queue `q`: (head, length).
    fn wait_used(&mut self, q: usize) -> (u32, u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let ring = &mut self.rings[q];
        loop {
            let idx: u16 = self.mem.read_obj(GuestAddress(ring.used.0 + 2)).unwrap();
            if idx != ring.used_seen {
                let elem = ring.used.0 + 4 + u64::from(ring.used_seen % QSIZE) * 8;
                let id: u32 = self.mem.read_obj(GuestAddress(elem)).unwrap();
                let len: u32 = self.mem.read_obj(GuestAddress(elem + 4)).unwrap();
                ring.used_seen = ring.used_seen.wrapping_add(1);
                return (id, len);
            }
            assert!(Instant::now() < deadline, "queue {q}: no used element");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A FUSE request: header + body.
    fn request(&mut self, opcode: Opcode, nodeid: u64, body: &[u8]) -> Vec<u8> {
        let header = InHeader {
            len: (std::mem::size_of::<InHeader>() + body.len()) as u32,
            opcode: opcode as u32,
            unique: self.unique,
            nodeid,
            ..InHeader::default()
        };
        self.unique += 1;
        let mut out = header.as_slice().to_vec();
        out.extend_from_slice(body);
        out
    }

    /// Sends a request on the request queue and returns (out header, body).
    fn call(&mut self, opcode: Opcode, nodeid: u64, body: &[u8]) -> (OutHeader, Vec<u8>) {
        let req = self.request(opcode, nodeid, body);
        let rd = self.buf(&req);
        let wr = self.reply_buf();
        self.post(1, &[(rd, req.len() as u32, false), (wr, REPLY_LEN, true)]);
        let (_, len) = self.wait_used(1);
        let mut reply = vec![0u8; len as usize];
        self.mem.read_slice(&mut reply, GuestAddress(wr)).unwrap();
        let hdr_len = std::mem::size_of::<OutHeader>();
        assert!(
            reply.len() >= hdr_len,
            "reply shorter than its header: {len}"
        );
        let hdr = *OutHeader::from_slice(&reply[..hdr_len]).unwrap();
        assert_eq!(hdr.len, len, "out header length matches the used length");
        (hdr, reply[hdr_len..].to_vec())
    }

    fn init(&mut self) {
        let body = InitIn {
            major: KERNEL_VERSION,
            minor: KERNEL_MINOR_VERSION,
            max_readahead: 0,
            flags: 0,
        };
        let (hdr, _) = self.call(Opcode::Init, 0, body.as_slice());
        assert_eq!(hdr.error, 0, "INIT failed");
    }

    fn lookup(&mut self, parent: u64, name: &str) -> Result<EntryOut, i32> {
        let mut body = name.as_bytes().to_vec();
        body.push(0);
        let (hdr, reply) = self.call(Opcode::Lookup, parent, &body);
        if hdr.error != 0 {
            return Err(-hdr.error);
        }
        Ok(*EntryOut::from_slice(&reply[..std::mem::size_of::<EntryOut>()]).unwrap())
    }

    fn read_file(&mut self, nodeid: u64) -> Vec<u8> {
        let open = OpenIn {
            flags: libc::O_RDONLY as u32,
            fuse_flags: 0,
        };
        let (hdr, reply) = self.call(Opcode::Open, nodeid, open.as_slice());
        assert_eq!(hdr.error, 0);
        let out = *OpenOut::from_slice(&reply[..std::mem::size_of::<OpenOut>()]).unwrap();
        let read = ReadIn {
            fh: out.fh,
            offset: 0,
            size: 4096,
            ..ReadIn::default()
        };
        let (hdr, data) = self.call(Opcode::Read, nodeid, read.as_slice());
        assert_eq!(hdr.error, 0);
        data
    }

    fn getattr_root_works(&mut self) {
        let (hdr, _) = self.call(Opcode::Getattr, ROOT_ID, &[0u8; 16]);
        assert_eq!(hdr.error, 0, "the device still answers");
    }
}

#[test]
fn config_space_features_and_construction() {
    let fs = Arc::new(SessionFs::new(SessionFsOptions::default()));
    let mut dev = FsDevice::new("cowork-sessions", 2, fs.clone()).unwrap();
    assert_eq!(dev.device_type(), 26);
    assert_eq!(dev.queue_max_sizes(), &[QUEUE_SIZE; 3]);
    let f = dev.avail_features();
    assert_ne!(f & features::VERSION_1, 0);
    assert_eq!(f & 1, 0, "VIRTIO_FS_F_NOTIFICATION is not offered");
    assert!(dev.ack_features(features::VERSION_1));
    assert_eq!(dev.acked_features(), features::VERSION_1);

    let mut tag = [0u8; TAG_LEN];
    dev.read_config(0, &mut tag);
    assert_eq!(&tag[..15], b"cowork-sessions");
    assert!(tag[15..].iter().all(|b| *b == 0));
    let mut n = [0u8; 4];
    dev.read_config(TAG_LEN as u64, &mut n);
    assert_eq!(u32::from_le_bytes(n), 2);
    // Out of range: untouched. Writes: ignored.
    let mut d = [0xaa_u8; 8];
    dev.read_config(CONFIG_SIZE as u64 - 4, &mut d);
    assert_eq!(d, [0xaa; 8]);
    dev.read_config(u64::MAX, &mut d[..1]);
    assert_eq!(d, [0xaa; 8]);
    dev.write_config(0, b"evil");
    dev.write_config(u64::MAX, b"evil");
    dev.read_config(0, &mut tag[..4]);
    assert_eq!(&tag[..4], b"cowo");

    assert!(matches!(
        FsDevice::new("", 1, fs.clone()),
        Err(FsDeviceError::EmptyTag)
    ));
    assert!(matches!(
        FsDevice::new(&"t".repeat(37), 1, fs.clone()),
        Err(FsDeviceError::TagTooLong { len: 37, .. })
    ));
    FsDevice::new(&"t".repeat(36), 1, fs.clone()).unwrap();
    assert!(matches!(
        FsDevice::new("a\0b", 1, fs.clone()),
        Err(FsDeviceError::NulInTag(_))
    ));
    assert!(matches!(
        FsDevice::new("t", 0, fs.clone()),
        Err(FsDeviceError::RequestQueues(0))
    ));
    assert!(matches!(
        FsDevice::new("t", MAX_REQUEST_QUEUES + 1, fs),
        Err(FsDeviceError::RequestQueues(_))
    ));
}

#[test]
fn activation_needs_the_hiprio_and_a_request_queue() {
    let mut h = Harness::new();
    assert!(matches!(h.activate(), Err(ActivateError::AlreadyActive)));
    assert!(h.dev.reset());
    assert!(matches!(
        h.activate_queues(&[HIPRIO_QUEUE]),
        Err(ActivateError::MissingQueue { index: 1 })
    ));
    assert!(matches!(
        h.activate_queues(&[FIRST_REQUEST_QUEUE]),
        Err(ActivateError::MissingQueue { index: 0 })
    ));
    assert!(!h.dev.is_active());
    h.activate().unwrap();
    assert!(h.dev.is_active());
}

#[test]
fn serves_fuse_requests_from_guest_memory() {
    let mut h = Harness::new();
    h.init();
    let s = h.lookup(ROOT_ID, "s").unwrap();
    assert_eq!(s.attr.mode & libc::S_IFMT, libc::S_IFDIR);
    let m = h.lookup(s.nodeid, "m").unwrap();
    let pre = h.lookup(m.nodeid, "pre.txt").unwrap();
    assert_eq!(pre.attr.size as usize, PRE.len());
    assert_eq!(h.read_file(pre.nodeid), PRE);
    assert_eq!(h.lookup(m.nodeid, "missing").err(), Some(libc::ENOENT));
    assert_eq!(h.lookup(m.nodeid, "..").err(), Some(libc::EINVAL));
    // The grant is read-only: OPEN for writing is refused by the host.
    let open = OpenIn {
        flags: libc::O_RDWR as u32,
        fuse_flags: 0,
    };
    let (hdr, _) = h.call(Opcode::Open, pre.nodeid, open.as_slice());
    assert_eq!(hdr.error, -libc::EROFS);
    assert!(
        h.irq.used.load(Ordering::SeqCst) > 0,
        "the driver was signalled"
    );

    // FORGET on the high-priority queue: consumed without a reply.
    let forget = h.request(
        Opcode::Forget,
        pre.nodeid,
        ForgetIn { nlookup: 1 }.as_slice(),
    );
    let rd = h.buf(&forget);
    h.post(0, &[(rd, forget.len() as u32, false)]);
    assert_eq!(h.wait_used(0).1, 0);
    // A grant added while the device runs is visible at once.
    h.dev
        .fs()
        .add_grant("s", "late", &h._fx.host().join("sub"), GrantMode::Rw)
        .unwrap();
    let late = h.lookup(s.nodeid, "late").unwrap();
    assert!(h.lookup(late.nodeid, "inner.txt").is_ok());
    let stats = h.dev.stats();
    assert_eq!(stats.malformed.load(Ordering::SeqCst), 0);
    assert_eq!(stats.needs_reset.load(Ordering::SeqCst), 0);
    h.getattr_root_works();
}

#[test]
fn a_presented_owner_reaches_the_driver() {
    const OWNER: GrantOwner = GrantOwner {
        uid: 4321,
        gid: 4322,
    };
    let mut h = Harness::new();
    h.init();
    let host = h._fx.host();
    let real_uid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&host).unwrap());
    assert_ne!(real_uid, OWNER.uid);
    h.dev
        .fs()
        .add_grant_with_owner("s", "owned", &host, GrantMode::Rw, Some(OWNER))
        .unwrap();
    let s = h.lookup(ROOT_ID, "s").unwrap();
    assert_eq!((s.attr.uid, s.attr.gid), (0, 0), "virtual directories");
    let owned = h.lookup(s.nodeid, "owned").unwrap();
    assert_eq!((owned.attr.uid, owned.attr.gid), (OWNER.uid, OWNER.gid));
    let pre = h.lookup(owned.nodeid, "pre.txt").unwrap();
    assert_eq!((pre.attr.uid, pre.attr.gid), (OWNER.uid, OWNER.gid));
    // The grant without an owner next to it shows the host's.
    let m = h.lookup(s.nodeid, "m").unwrap();
    assert_eq!(m.attr.uid, real_uid);
    let (hdr, reply) = h.call(Opcode::Getattr, pre.nodeid, &[0u8; 16]);
    assert_eq!(hdr.error, 0);
    let attr = AttrOut::from_slice(&reply[..std::mem::size_of::<AttrOut>()])
        .unwrap()
        .attr;
    assert_eq!((attr.uid, attr.gid), (OWNER.uid, OWNER.gid));
    // SETATTR: chown to the presented owner is a no-op, to root refused.
    let chown = |uid: u32| SetattrIn {
        valid: (SetattrValid::UID | SetattrValid::GID).bits(),
        uid,
        gid: OWNER.gid,
        ..SetattrIn::default()
    };
    let (hdr, reply) = h.call(Opcode::Setattr, pre.nodeid, chown(OWNER.uid).as_slice());
    assert_eq!(hdr.error, 0);
    let attr = AttrOut::from_slice(&reply[..std::mem::size_of::<AttrOut>()])
        .unwrap()
        .attr;
    assert_eq!((attr.uid, attr.gid), (OWNER.uid, OWNER.gid));
    let (hdr, _) = h.call(Opcode::Setattr, pre.nodeid, chown(0).as_slice());
    assert_eq!(hdr.error, -libc::EPERM);
    let host_uid =
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(host.join("pre.txt")).unwrap());
    assert_eq!(host_uid, real_uid, "the host file keeps its owner");
}

#[test]
fn malformed_chains_are_completed_without_panicking() {
    let mut h = Harness::new();
    h.init();
    let stats = h.dev.stats();
    let valid = h.request(Opcode::Getattr, ROOT_ID, &[0u8; 16]);
    let valid_rd = h.buf(&valid);
    let vlen = valid.len() as u32;
    let wr = h.reply_buf();
    let outside = MEM_SIZE + 0x1000;
    let cases: Vec<(&str, Vec<Desc>)> = vec![
        (
            "readable buffer outside memory",
            vec![(outside, 64, false), (wr, REPLY_LEN, true)],
        ),
        (
            "writable buffer outside memory",
            vec![(valid_rd, vlen, false), (outside, 4096, true)],
        ),
        (
            "buffer straddling the end of memory",
            vec![(valid_rd, vlen, false), (MEM_SIZE - 16, 4096, true)],
        ),
        (
            "readable length overflowing",
            vec![(valid_rd, u32::MAX, false), (wr, REPLY_LEN, true)],
        ),
        ("no descriptors readable", vec![(wr, REPLY_LEN, true)]),
        (
            "zero-length buffers",
            vec![(valid_rd, 0, false), (wr, 0, true)],
        ),
        (
            "truncated header",
            vec![(valid_rd, 10, false), (wr, REPLY_LEN, true)],
        ),
        ("no reply buffer", vec![(valid_rd, vlen, false)]),
        (
            "reply buffer too small",
            vec![(valid_rd, vlen, false), (wr, 8, true)],
        ),
        (
            "writable before readable",
            vec![(wr, REPLY_LEN, true), (valid_rd, vlen, false)],
        ),
    ];
    for (what, descs) in &cases {
        h.post(1, descs);
        let (_, len) = h.wait_used(1);
        assert!(len <= REPLY_LEN, "{what}: used length {len}");
    }
    assert!(
        stats.malformed.load(Ordering::SeqCst) >= 6,
        "malformed chains are counted"
    );

    // Garbage FUSE messages inside well-formed chains.
    let mut lying = h.request(Opcode::Lookup, ROOT_ID, b"s\0");
    lying[..4].copy_from_slice(&u32::MAX.to_le_bytes());
    let unterminated = h.request(Opcode::Lookup, ROOT_ID, b"no-nul");
    let unknown = h.request(Opcode::Lookup, ROOT_ID, b"s\0");
    let mut unknown = unknown;
    unknown[4..8].copy_from_slice(&9999u32.to_le_bytes());
    let init_again = h.request(
        Opcode::Init,
        0,
        InitIn {
            major: u32::MAX,
            minor: u32::MAX,
            max_readahead: u32::MAX,
            flags: u32::MAX,
        }
        .as_slice(),
    );
    let forged_node = h.request(Opcode::Getattr, u64::MAX, &[0u8; 16]);
    let random: Vec<u8> = (0..512u32).map(|i| (i * 7919 % 251) as u8).collect();
    for msg in [
        lying,
        unterminated,
        unknown,
        init_again,
        forged_node,
        random,
    ] {
        let rd = h.buf(&msg);
        let wr = h.reply_buf();
        h.post(1, &[(rd, msg.len() as u32, false), (wr, REPLY_LEN, true)]);
        let (_, len) = h.wait_used(1);
        assert!(len <= REPLY_LEN);
    }
    // The device still answers normal requests.
    assert!(h.lookup(ROOT_ID, "s").is_ok());
    // A descriptor loop (next pointing back at itself) ends the chain.
    let rd = h.buf(&valid);
    let ring = &mut h.rings[1];
    let idx = ring.next_desc;
    let d = RawDescriptor::from(SplitDescriptor::new(
        rd,
        vlen,
        VRING_DESC_F_NEXT as u16,
        idx,
    ));
    h.mem
        .write_obj(d, GuestAddress(ring.desc.0 + u64::from(idx) * 16))
        .unwrap();
    ring.next_desc = (idx + 1) % QSIZE;
    let slot = ring.avail.0 + 4 + u64::from(ring.avail_idx % QSIZE) * 2;
    h.mem.write_obj(idx, GuestAddress(slot)).unwrap();
    ring.avail_idx = ring.avail_idx.wrapping_add(1);
    h.mem
        .write_obj(ring.avail_idx, GuestAddress(ring.avail.0 + 2))
        .unwrap();
    h.kicks[1].write(1).unwrap();
    h.wait_used(1);

    assert_eq!(stats.needs_reset.load(Ordering::SeqCst), 0);
    assert_eq!(h.irq.needs_reset.load(Ordering::SeqCst), 0);
    h.getattr_root_works();
}

#[test]
fn an_unknown_opcode_gets_enosys() {
    let mut h = Harness::new();
    h.init();
    let mut req = h.request(Opcode::Getattr, ROOT_ID, &[0u8; 16]);
    req[4..8].copy_from_slice(&9999u32.to_le_bytes());
    let rd = h.buf(&req);
    let wr = h.reply_buf();
    h.post(1, &[(rd, req.len() as u32, false), (wr, REPLY_LEN, true)]);
    let (_, len) = h.wait_used(1);
    assert_eq!(len as usize, std::mem::size_of::<OutHeader>());
    let hdr: OutHeader = h.mem.read_obj(GuestAddress(wr)).unwrap();
    assert_eq!(hdr.error, -libc::ENOSYS);
}

#[test]
fn a_corrupt_available_ring_asks_for_a_reset_and_reset_recovers() {
    let mut h = Harness::new();
    h.init();
    let pre_before = {
        let s = h.lookup(ROOT_ID, "s").unwrap();
        let m = h.lookup(s.nodeid, "m").unwrap();
        h.lookup(m.nodeid, "pre.txt").unwrap()
    };
    // The driver claims far more available entries than the ring holds.
    let ring = &h.rings[1];
    let bogus = ring.avail_idx.wrapping_add(QSIZE + 5);
    h.mem
        .write_obj(bogus, GuestAddress(ring.avail.0 + 2))
        .unwrap();
    h.kicks[1].write(1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.irq.needs_reset.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "no needs-reset signal");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(h.dev.stats().needs_reset.load(Ordering::SeqCst), 1);

    // The driver resets and starts over: a fresh FUSE session.
    assert!(h.dev.reset());
    assert!(!h.dev.is_active());
    h.activate().unwrap();
    h.init();
    let s = h.lookup(ROOT_ID, "s").unwrap();
    let m = h.lookup(s.nodeid, "m").unwrap();
    let pre = h.lookup(m.nodeid, "pre.txt").unwrap();
    assert_eq!(h.read_file(pre.nodeid), PRE);
    // Inodes of the previous driver instance are gone.
    if pre_before.nodeid != pre.nodeid {
        let (hdr, _) = h.call(Opcode::Getattr, pre_before.nodeid, &[0u8; 16]);
        assert_ne!(hdr.error, 0);
    }
}

/// Paused, the device keeps its FUSE session (the same device resumes
/// where it was, no new INIT) and hands both queues back; a restored
/// device around a new `SessionFs` resumes those queues and serves the
/// guest's mount (INIT) from its own grant table.
#[test]
fn pause_keeps_the_session_and_a_restored_device_has_its_own_grants() {
    let mut h = Harness::new();
    h.init();
    h.getattr_root_works();
    let queues = VirtioDevice::pause(&mut h.dev).unwrap();
    assert_eq!(queues.len(), 2);
    assert!(!h.dev.is_active());
    assert!(VirtioDevice::save_state(&mut h.dev, &h.mem, &mut [])
        .unwrap()
        .is_empty());
    h.dev.resume(h.mem.clone(), h.irq.clone(), queues).unwrap();
    h.getattr_root_works();

    let queues = VirtioDevice::pause(&mut h.dev).unwrap();
    let fs = Arc::new(SessionFs::new(SessionFsOptions::default()));
    let mut dev = FsDevice::new(DEFAULT_TAG, 1, fs).unwrap();
    assert!(dev.restore_state(&[1]).is_err());
    dev.restore_state(&[]).unwrap();
    h.dev = dev;
    h.dev.resume(h.mem.clone(), h.irq.clone(), queues).unwrap();
    h.init();
    h.getattr_root_works();
    assert_eq!(h.irq.needs_reset.load(Ordering::SeqCst), 0);
}
