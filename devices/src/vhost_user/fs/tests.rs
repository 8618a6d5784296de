//! The vhost-user-fs backend driven the way the vhost-user-backend crate
//! drives it: vrings in real guest memory, FUSE requests written as a
//! driver writes them, and `handle_event` called for the kicked queue.

use std::os::fd::IntoRawFd;
use std::time::{Duration, Instant};

use fuse_backend_rs::abi::fuse_abi::{
    EntryOut, InHeader, InitIn, Opcode, OpenIn, OpenOut, OutHeader, ReadIn, KERNEL_MINOR_VERSION,
    KERNEL_VERSION,
};
use fuse_backend_rs::api::filesystem::ROOT_ID;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use vm_memory::{ByteValued, Bytes, GuestAddress};

use super::*;
use crate::fs::testutil::{Fixture, PRE};
use crate::fs::{GrantMode, SessionFsOptions};

/// Guest memory size.
const MEM_SIZE: u64 = 16 << 20;
/// Queue size used by the tests.
const QSIZE: u16 = 16;
/// Where queue `i`'s rings live: `RING_BASE + i * RING_STRIDE`.
const RING_BASE: u64 = 0x1_0000;
/// Distance between two queues' rings.
const RING_STRIDE: u64 = 0x1_0000;
/// Where request and reply buffers are allocated from.
const BUF_BASE: u64 = 0x10_0000;
/// Size of each reply buffer.
const REPLY_LEN: u32 = 8192;

/// One descriptor of a chain to post: (address, length, device-writable).
type Desc = (u64, u32, bool);

/// Driver-side view of one split queue.
struct Ring {
    desc: u64,
    avail: u64,
    used: u64,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
}

struct Harness {
    mem: GuestMemoryMmap<()>,
    backend: VhostUserFsBackend,
    vrings: Vec<VringRwLock<Mem>>,
    rings: Vec<Ring>,
    next_buf: u64,
    unique: u64,
    fx: Fixture,
}

impl Harness {
    fn new(request_queues: u16) -> Self {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("debug")
            .try_init();
        let fx = Fixture::new();
        let fs = Arc::new(SessionFs::new(SessionFsOptions::default()));
        fs.add_grant("s", "ro", &fx.host(), GrantMode::Ro).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap();
        let atomic = GuestMemoryAtomic::new(mem.clone());
        let mut cfg = VhostUserFsConfig::new("/nonexistent/unused.sock");
        cfg.request_queues = request_queues;
        let backend = VhostUserFsBackend::new(&cfg, fs, atomic.clone()).unwrap();
        let mut vrings = Vec::new();
        let mut rings = Vec::new();
        for i in 0..backend.num_queues() as u64 {
            // Split-ring layout (virtio 1.2 §2.7).
            let n = u64::from(QSIZE);
            let desc = RING_BASE + i * RING_STRIDE;
            let avail = desc + 16 * n;
            let used = (avail + 6 + 2 * n).next_multiple_of(4);
            let v = VringRwLock::new(atomic.clone(), QSIZE).unwrap();
            v.set_queue_size(QSIZE);
            v.set_queue_info(desc, avail, used).unwrap();
            v.set_queue_ready(true);
            v.set_enabled(true);
            vrings.push(v);
            rings.push(Ring {
                desc,
                avail,
                used,
                next_desc: 0,
                avail_idx: 0,
                used_seen: 0,
            });
        }
        Self {
            mem,
            backend,
            vrings,
            rings,
            next_buf: BUF_BASE,
            unique: 1,
            fx,
        }
    }

    fn buf(&mut self, data: &[u8]) -> u64 {
        let addr = self.next_buf;
        self.mem.write_slice(data, GuestAddress(addr)).unwrap();
        self.next_buf += (data.len() as u64).max(1).next_multiple_of(64);
        addr
    }

    /// Posts a chain of (address, length, device-writable) on queue `q` and
    /// runs the queue's worker as the event loop would after a kick.
    fn post(&mut self, q: usize, descs: &[Desc]) {
        let ring = &mut self.rings[q];
        let head = ring.next_desc;
        for (i, (addr, len, writable)) in descs.iter().enumerate() {
            let idx = ring.next_desc;
            let mut flags = if *writable { VRING_DESC_F_WRITE } else { 0 } as u16;
            if i + 1 != descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let next = (idx + 1) % QSIZE;
            let d = RawDescriptor::from(SplitDescriptor::new(*addr, *len, flags, next));
            self.mem
                .write_obj(d, GuestAddress(ring.desc + u64::from(idx) * 16))
                .unwrap();
            ring.next_desc = next;
        }
        let slot = ring.avail + 4 + u64::from(ring.avail_idx % QSIZE) * 2;
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        ring.avail_idx = ring.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(ring.avail_idx, GuestAddress(ring.avail + 2))
            .unwrap();
        self.backend
            .handle_event(q as u16, EventSet::IN, &self.vrings[q..=q], q)
            .unwrap();
    }

    /// The next used element of queue `q`: (head, length).
    fn used(&mut self, q: usize) -> (u32, u32) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let ring = &mut self.rings[q];
        loop {
            let idx: u16 = self.mem.read_obj(GuestAddress(ring.used + 2)).unwrap();
            if idx != ring.used_seen {
                let elem = ring.used + 4 + u64::from(ring.used_seen % QSIZE) * 8;
                let id: u32 = self.mem.read_obj(GuestAddress(elem)).unwrap();
                let len: u32 = self.mem.read_obj(GuestAddress(elem + 4)).unwrap();
                ring.used_seen = ring.used_seen.wrapping_add(1);
                return (id, len);
            }
            assert!(Instant::now() < deadline, "queue {q}: no used element");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

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

    /// One request on request queue `q`: (out header, body).
    fn call_on(
        &mut self,
        q: usize,
        opcode: Opcode,
        nodeid: u64,
        body: &[u8],
    ) -> (OutHeader, Vec<u8>) {
        let req = self.request(opcode, nodeid, body);
        let rd = self.buf(&req);
        let wr = self.buf(&vec![0u8; REPLY_LEN as usize]);
        self.post(q, &[(rd, req.len() as u32, false), (wr, REPLY_LEN, true)]);
        let (_, len) = self.used(q);
        let mut reply = vec![0u8; len as usize];
        self.mem.read_slice(&mut reply, GuestAddress(wr)).unwrap();
        let hdr_len = std::mem::size_of::<OutHeader>();
        assert!(reply.len() >= hdr_len, "reply shorter than its header");
        let hdr = *OutHeader::from_slice(&reply[..hdr_len]).unwrap();
        assert_eq!(hdr.len, len);
        (hdr, reply[hdr_len..].to_vec())
    }

    fn call(&mut self, opcode: Opcode, nodeid: u64, body: &[u8]) -> (OutHeader, Vec<u8>) {
        self.call_on(1, opcode, nodeid, body)
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

    fn lookup_on(&mut self, q: usize, parent: u64, name: &str) -> Result<EntryOut, i32> {
        let mut body = name.as_bytes().to_vec();
        body.push(0);
        let (hdr, reply) = self.call_on(q, Opcode::Lookup, parent, &body);
        if hdr.error != 0 {
            return Err(-hdr.error);
        }
        Ok(*EntryOut::from_slice(&reply[..std::mem::size_of::<EntryOut>()]).unwrap())
    }

    fn lookup(&mut self, parent: u64, name: &str) -> Result<EntryOut, i32> {
        self.lookup_on(1, parent, name)
    }
}

#[test]
fn backend_describes_a_virtio_fs_device() {
    let fs = Arc::new(SessionFs::new(SessionFsOptions::default()));
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
    let mut cfg = VhostUserFsConfig::new("/tmp/x.sock");
    cfg.request_queues = 3;
    let b = VhostUserFsBackend::new(&cfg, fs.clone(), mem.clone()).unwrap();
    assert_eq!(b.num_queues(), 4);
    assert_eq!(b.max_queue_size(), usize::from(QUEUE_SIZE));
    // One worker thread per queue, each with its own exit event.
    assert_eq!(b.queues_per_thread(), vec![1, 2, 4, 8]);
    for t in 0..4 {
        let (consumer, _notifier) = b.exit_event(t).expect("an exit event per thread");
        // As vhost-user-backend does: the backend's drop closes it (ExitEvent).
        let _ = consumer.into_raw_fd();
    }
    assert!(b.exit_event(4).is_none());
    let f = b.features();
    for bit in [
        VIRTIO_F_VERSION_1,
        VIRTIO_RING_F_EVENT_IDX,
        VIRTIO_RING_F_INDIRECT_DESC,
    ] {
        assert_ne!(f & (1 << bit), 0, "feature bit {bit}");
    }
    assert_ne!(f & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(), 0);
    assert!(b
        .protocol_features()
        .contains(VhostUserProtocolFeatures::MQ));

    for (queues, size) in [(0, QUEUE_SIZE), (MAX_REQUEST_QUEUES + 1, QUEUE_SIZE)] {
        let cfg = VhostUserFsConfig {
            request_queues: queues,
            queue_size: size,
            ..VhostUserFsConfig::new("/tmp/x.sock")
        };
        assert!(matches!(
            VhostUserFsBackend::new(&cfg, fs.clone(), mem.clone()),
            Err(VhostUserFsError::RequestQueues(_))
        ));
    }
    for size in [0, 1, 100, QUEUE_SIZE * 2] {
        let cfg = VhostUserFsConfig {
            queue_size: size,
            ..VhostUserFsConfig::new("/tmp/x.sock")
        };
        assert!(
            matches!(
                VhostUserFsBackend::new(&cfg, fs.clone(), mem.clone()),
                Err(VhostUserFsError::QueueSize(s)) if s == size
            ),
            "{size}"
        );
    }
}

#[test]
fn serves_the_session_fs_from_shared_memory() {
    let mut h = Harness::new(2);
    h.init();
    let s = h.lookup(ROOT_ID, "s").unwrap();
    let ro = h.lookup(s.nodeid, "ro").unwrap();
    let pre = h.lookup(ro.nodeid, "pre.txt").unwrap();
    assert_eq!(pre.attr.size as usize, PRE.len());
    let open = OpenIn {
        flags: libc::O_RDONLY as u32,
        fuse_flags: 0,
    };
    let (hdr, reply) = h.call(Opcode::Open, pre.nodeid, open.as_slice());
    assert_eq!(hdr.error, 0);
    let fh = OpenOut::from_slice(&reply[..std::mem::size_of::<OpenOut>()])
        .unwrap()
        .fh;
    let read = ReadIn {
        fh,
        size: 4096,
        ..ReadIn::default()
    };
    let (hdr, data) = h.call(Opcode::Read, pre.nodeid, read.as_slice());
    assert_eq!(hdr.error, 0);
    assert_eq!(data, PRE);
    // The host refuses writes through a read-only grant.
    let open_rw = OpenIn {
        flags: libc::O_RDWR as u32,
        fuse_flags: 0,
    };
    let (hdr, _) = h.call(Opcode::Open, pre.nodeid, open_rw.as_slice());
    assert_eq!(hdr.error, -libc::EROFS);
    // Nothing outside the grant: `..` is refused.
    assert_eq!(h.lookup(ro.nodeid, "..").err(), Some(libc::EINVAL));
    // The second request queue serves the same filesystem.
    assert!(h.lookup_on(2, ro.nodeid, "sub").is_ok());
    // A grant added while serving shows up at once.
    let sub = h.fx.host().join("sub");
    h.backend
        .fs
        .add_grant("s", "late", &sub, GrantMode::Rw)
        .unwrap();
    let late = h.lookup(s.nodeid, "late").unwrap();
    assert!(h.lookup(late.nodeid, "inner.txt").is_ok());
    let stats = h.backend.stats();
    assert_eq!(stats.malformed.load(Ordering::SeqCst), 0);
    assert!(stats.chains.load(Ordering::SeqCst) >= 9);
}

#[test]
fn malformed_chains_are_answered_empty_and_serving_goes_on() {
    let mut h = Harness::new(1);
    h.init();
    let valid = h.request(Opcode::Getattr, ROOT_ID, &[0u8; 16]);
    let rd = h.buf(&valid);
    let vlen = valid.len() as u32;
    let wr = h.buf(&[0u8; REPLY_LEN as usize]);
    let outside = MEM_SIZE + 0x1000;
    let cases: Vec<(&str, Vec<Desc>)> = vec![
        (
            "readable buffer outside memory",
            vec![(outside, 64, false), (wr, REPLY_LEN, true)],
        ),
        (
            "writable buffer outside memory",
            vec![(rd, vlen, false), (outside, 4096, true)],
        ),
        (
            "truncated header",
            vec![(rd, 10, false), (wr, REPLY_LEN, true)],
        ),
        ("no reply buffer", vec![(rd, vlen, false)]),
        ("only a reply buffer", vec![(wr, REPLY_LEN, true)]),
        (
            "readable length overflowing",
            vec![(rd, u32::MAX, false), (wr, REPLY_LEN, true)],
        ),
    ];
    for (what, descs) in &cases {
        h.post(1, descs);
        let (_, len) = h.used(1);
        assert_eq!(len, 0, "{what}");
    }
    let stats = h.backend.stats();
    assert_eq!(stats.malformed.load(Ordering::SeqCst), cases.len() as u64);
    // The queue still answers.
    assert!(h.lookup(ROOT_ID, "s").is_ok());
    // A queue whose rings point outside memory is an error of that queue
    // only; handle_event does not fail.
    let v = &h.vrings[0];
    v.set_queue_info(outside, outside + 0x1000, outside + 0x2000)
        .unwrap();
    h.backend
        .handle_event(0, EventSet::IN, &h.vrings[0..=0], 0)
        .unwrap();
    assert!(h.lookup(ROOT_ID, "s").is_ok());
}

#[test]
fn canceller_ends_a_server_waiting_for_its_frontend() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fs.sock");
    let fs = Arc::new(SessionFs::new(SessionFsOptions::default()));
    let server = VhostUserFsServer::bind(&VhostUserFsConfig::new(&path), fs).unwrap();
    assert!(path.exists());
    assert_eq!(server.socket(), path);
    let cancel = server.canceller();
    let t = server.spawn().unwrap();
    cancel.cancel();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !t.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(t.is_finished(), "server still waiting after cancel");
    t.join().unwrap().unwrap();
}

#[test]
fn binding_in_a_missing_directory_is_a_clear_error() {
    let fs = Arc::new(SessionFs::new(SessionFsOptions::default()));
    let cfg = VhostUserFsConfig::new("/nonexistent-dir/fs.sock");
    match VhostUserFsServer::bind(&cfg, fs) {
        Err(e @ VhostUserFsError::Bind { .. }) => {
            assert!(e.to_string().contains("/nonexistent-dir/fs.sock"), "{e}")
        }
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("bound in a missing directory"),
    }
}
