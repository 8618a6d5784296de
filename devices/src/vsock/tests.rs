//! Device model tests against virtio-queue's driver-side mock rings in real
//! guest memory: the test plays the guest driver (posting TX packets and RX
//! buffers, reading used rings) and the helper (host streams).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};

use super::conn::CLOSE_TIMEOUT;
use super::device::{VsockModel, EVENT_QUEUE, RX_QUEUE, TX_QUEUE};
use super::muxer::{EPHEMERAL_PORT_FIRST, WARN_LOG_BUDGET};
use super::packet::*;
use super::{ConnectError, HostError, VsockConfig, VsockHost, DEFAULT_BUF_ALLOC};

type Mem = GuestMemoryMmap<()>;

const GUEST_CID: u64 = 3;
const QSIZE: u16 = 256;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
/// Guest memory: 16 MiB.
const MEM_SIZE: usize = 16 << 20;
/// Size of the RX buffers the fake driver posts (Linux posts 4 KiB + header;
/// larger here so 64 KiB packets fit).
const RX_BUF: u32 = 64 * 1024 + HDR_SIZE as u32;

fn mem() -> Mem {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
}

/// The fake driver's side of one queue.
struct Drv<'a> {
    mem: &'a Mem,
    vq: MockSplitQueue<'a, Mem>,
    next_desc: u16,
    used_seen: u16,
    data: u64,
    data_end: u64,
    heads: std::collections::HashMap<u16, u64>,
}

impl<'a> Drv<'a> {
    fn new(mem: &'a Mem, ring: u64, data: u64, data_len: u64) -> Self {
        Self {
            mem,
            vq: MockSplitQueue::create(mem, GuestAddress(ring), QSIZE),
            next_desc: 0,
            used_seen: 0,
            data,
            data_end: data + data_len,
            heads: Default::default(),
        }
    }

    fn queue(&self) -> Queue {
        let mut q: Queue = self.vq.create_queue().unwrap();
        q.set_event_idx(false);
        q
    }

    fn alloc(&mut self, len: u32) -> u64 {
        let len = u64::from(len).max(1).next_multiple_of(16);
        if self.data + len > self.data_end {
            panic!("test data area exhausted");
        }
        let a = self.data;
        self.data += len;
        a
    }

    /// Adds one chain of (addr, len, flags) descriptors; returns its head.
    fn add_chain(&mut self, descs: &[(u64, u32, u16)]) -> u16 {
        let head = self.next_desc;
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, flags))| {
                let idx = (head + i as u16) % QSIZE;
                let last = i + 1 == descs.len();
                let (flags, next) = if last {
                    (flags & !F_NEXT, 0)
                } else {
                    (flags | F_NEXT, (idx + 1) % QSIZE)
                };
                RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
            })
            .collect();
        self.vq.add_desc_chains(&raw, head).unwrap();
        self.next_desc = (head + descs.len().max(1) as u16) % QSIZE;
        if let Some(&(a, _, _)) = descs.first() {
            self.heads.insert(head, a);
        }
        head
    }

    /// Posts `bytes` split into readable descriptors of the given sizes.
    fn tx_split(&mut self, bytes: &[u8], sizes: &[usize]) -> u16 {
        let mut descs = Vec::new();
        let mut off = 0;
        for &s in sizes {
            let a = self.alloc(s as u32);
            self.mem
                .write_slice(&bytes[off..off + s], GuestAddress(a))
                .unwrap();
            descs.push((a, s as u32, 0));
            off += s;
        }
        assert_eq!(off, bytes.len(), "sizes must cover the packet");
        self.add_chain(&descs)
    }

    fn tx(&mut self, hdr: &Header, payload: &[u8]) -> u16 {
        let mut b = hdr.to_bytes().to_vec();
        b.extend_from_slice(payload);
        let n = b.len();
        self.tx_split(&b, &[n])
    }

    fn post_rx(&mut self, n: usize) {
        for _ in 0..n {
            let a = self.alloc(RX_BUF);
            self.add_chain(&[(a, RX_BUF, F_WRITE)]);
        }
    }

    /// New used-ring entries: (head, len).
    fn used(&mut self) -> Vec<(u16, u32)> {
        let used_addr = self.vq.used_addr();
        let idx: u16 = self.mem.read_obj(used_addr.unchecked_add(2)).unwrap();
        let mut out = Vec::new();
        while self.used_seen != idx {
            let slot = u64::from(self.used_seen % QSIZE);
            let e = used_addr.unchecked_add(4 + slot * 8);
            let id: u32 = self.mem.read_obj(e).unwrap();
            let len: u32 = self.mem.read_obj(e.unchecked_add(4)).unwrap();
            out.push((id as u16, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }

    /// RX packets the device completed since the last call.
    fn rx_packets(&mut self) -> Vec<(Header, Vec<u8>)> {
        self.used()
            .into_iter()
            .filter(|&(_, len)| len as usize >= HDR_SIZE)
            .map(|(head, len)| {
                let a = self.heads[&head];
                let mut buf = vec![0u8; len as usize];
                self.mem.read_slice(&mut buf, GuestAddress(a)).unwrap();
                let mut h = [0u8; HDR_SIZE];
                h.copy_from_slice(&buf[..HDR_SIZE]);
                let hdr = Header::from_bytes(&h);
                assert_eq!(
                    hdr.len as usize,
                    buf.len() - HDR_SIZE,
                    "used len matches header"
                );
                (hdr, buf[HDR_SIZE..].to_vec())
            })
            .collect()
    }
}

/// A model plus the fake driver's three queues.
struct Rig<'a> {
    model: VsockModel,
    host: VsockHost,
    rx: Drv<'a>,
    tx: Drv<'a>,
    ev: Drv<'a>,
    rxq: Queue,
    txq: Queue,
    evq: Queue,
    mem: &'a Mem,
}

impl<'a> Rig<'a> {
    fn new(mem: &'a Mem, config: VsockConfig) -> Self {
        let host = VsockHost::new().unwrap();
        let model = VsockModel::new(GUEST_CID, config, &host).unwrap();
        let rx = Drv::new(mem, 0x0, 0x10_0000, 0x60_0000);
        let tx = Drv::new(mem, 0x1_0000, 0x70_0000, 0x60_0000);
        let ev = Drv::new(mem, 0x2_0000, 0xd0_0000, 0x1_0000);
        let (rxq, txq, evq) = (rx.queue(), tx.queue(), ev.queue());
        Self {
            model,
            host,
            rx,
            tx,
            ev,
            rxq,
            txq,
            evq,
            mem,
        }
    }

    fn process(&mut self) -> [bool; 3] {
        self.model
            .process(self.mem, &mut self.rxq, &mut self.txq, Some(&mut self.evq))
            .unwrap()
    }

    /// Processes until the device has nothing more to say (bounded).
    fn settle(&mut self) -> Vec<(Header, Vec<u8>)> {
        let mut out = Vec::new();
        for _ in 0..50 {
            self.process();
            let p = self.rx.rx_packets();
            if p.is_empty() {
                break;
            }
            out.extend(p);
        }
        out
    }
}

fn ghdr(src_port: u32, dst_port: u32, op: u16) -> Header {
    Header {
        src_cid: GUEST_CID,
        dst_cid: VSOCK_HOST_CID,
        src_port,
        dst_port,
        len: 0,
        kind: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 256 * 1024,
        fwd_cnt: 0,
    }
}

fn rw(src_port: u32, dst_port: u32, len: usize) -> Header {
    Header {
        len: len as u32,
        ..ghdr(src_port, dst_port, OP_RW)
    }
}

fn ops(p: &[(Header, Vec<u8>)]) -> Vec<u16> {
    p.iter().map(|(h, _)| h.op).collect()
}

/// Guest port 5000 connects to listener port 1234; returns the helper's stream.
fn establish(rig: &mut Rig<'_>, listener: &super::Listener) -> UnixStream {
    rig.rx.post_rx(8);
    rig.tx.tx(&ghdr(5000, listener.port(), OP_REQUEST), &[]);
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_RESPONSE]);
    let h = p[0].0;
    assert_eq!(
        (h.src_cid, h.dst_cid, h.src_port, h.dst_port),
        (2, GUEST_CID, 1234, 5000)
    );
    assert_eq!(h.kind, TYPE_STREAM);
    assert_eq!(h.buf_alloc, DEFAULT_BUF_ALLOC);
    let s = listener
        .try_accept()
        .unwrap()
        .expect("listener got the connection");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn read_exact(s: &mut UnixStream, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).unwrap();
    b
}

fn payload(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
}

#[test]
fn connect_accept_and_data_both_ways() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    assert_eq!(rig.model.stats().connections, 1);

    rig.tx.tx(&rw(5000, 1234, 5), b"hello");
    rig.settle();
    assert_eq!(read_exact(&mut s, 5), b"hello");
    // All TX chains were returned with length 0.
    assert!(rig.tx.used().iter().all(|&(_, len)| len == 0));

    s.write_all(b"world!").unwrap();
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_RW]);
    assert_eq!(p[0].1, b"world!");
    assert_eq!((p[0].0.src_port, p[0].0.dst_port), (1234, 5000));
    // fwd_cnt tells the guest the 5 bytes reached the host.
    assert_eq!(p[0].0.fwd_cnt, 5);
}

#[test]
fn tx_header_alone_then_data_over_three_descriptors() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    let data = payload(3000);
    let mut pkt = rw(5000, 1234, data.len()).to_bytes().to_vec();
    pkt.extend_from_slice(&data);
    rig.tx.tx_split(&pkt, &[HDR_SIZE, 1000, 1, 1999]);
    rig.settle();
    assert_eq!(read_exact(&mut s, 3000), data);
}

#[test]
fn tx_header_and_data_share_descriptors() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    let data = payload(100);
    // One descriptor holding header + data.
    rig.tx.tx(&rw(5000, 1234, data.len()), &data);
    // Header split mid-way, the rest of it sharing a descriptor with data,
    // with a zero-length descriptor in between.
    let mut pkt = rw(5000, 1234, data.len()).to_bytes().to_vec();
    pkt.extend_from_slice(&data);
    let a = rig.tx.alloc(20);
    let b = rig.tx.alloc(124);
    m.write_slice(&pkt[..20], GuestAddress(a)).unwrap();
    m.write_slice(&pkt[20..], GuestAddress(b)).unwrap();
    let z = rig.tx.alloc(1);
    rig.tx.add_chain(&[(a, 20, 0), (z, 0, 0), (b, 124, 0)]);
    rig.settle();
    let got = read_exact(&mut s, 200);
    assert_eq!(&got[..100], &data[..]);
    assert_eq!(&got[100..], &data[..]);
}

#[test]
fn tx_64k_payload_split_into_32k_descriptors() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    let data = payload(64 * 1024);
    let mut pkt = rw(5000, 1234, data.len()).to_bytes().to_vec();
    pkt.extend_from_slice(&data);
    rig.tx.tx_split(&pkt, &[HDR_SIZE, 32 * 1024, 32 * 1024]);
    // Read concurrently: the socketpair may not hold 64 KiB at once.
    let reader = std::thread::spawn(move || read_exact(&mut s, 64 * 1024));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !reader.is_finished() && Instant::now() < deadline {
        rig.settle();
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(reader.join().unwrap(), data);
}

#[test]
fn host_stops_at_zero_guest_credit_and_resumes_on_credit_update() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    rig.rx.post_rx(16);
    let mut req = ghdr(5000, 1234, OP_REQUEST);
    req.buf_alloc = 100;
    rig.tx.tx(&req, &[]);
    assert_eq!(ops(&rig.settle()), vec![OP_RESPONSE]);
    let mut s = l.try_accept().unwrap().unwrap();
    s.write_all(&payload(300)).unwrap();

    let p = rig.settle();
    // Exactly the 100 bytes of credit, then one CREDIT_REQUEST, then silence.
    assert_eq!(ops(&p), vec![OP_RW, OP_CREDIT_REQUEST]);
    assert_eq!(p[0].1, payload(300)[..100]);
    assert_eq!(rig.model.muxer().peer_credit(1234, 5000), Some(0));
    assert!(rig.settle().is_empty());

    // The guest consumed 60 bytes.
    let mut upd = ghdr(5000, 1234, OP_CREDIT_UPDATE);
    upd.buf_alloc = 100;
    upd.fwd_cnt = 60;
    rig.tx.tx(&upd, &[]);
    let p = rig.settle();
    assert_eq!(p[0].0.op, OP_RW);
    assert_eq!(p[0].1, payload(300)[100..160]);
    // A larger buffer lets the rest through.
    upd.buf_alloc = 1000;
    upd.fwd_cnt = 160;
    rig.tx.tx(&upd, &[]);
    let p = rig.settle();
    let rest: Vec<u8> = p
        .iter()
        .filter(|(h, _)| h.op == OP_RW)
        .flat_map(|(_, d)| d.clone())
        .collect();
    assert_eq!(rest, payload(300)[160..]);
}

#[test]
fn guest_credit_request_gets_credit_update_and_overrun_is_reset() {
    let m = mem();
    let config = VsockConfig {
        buf_alloc: 1000,
        ..VsockConfig::default()
    };
    let mut rig = Rig::new(&m, config);
    let l = rig.host.listen(1234).unwrap();
    rig.rx.post_rx(8);
    rig.tx.tx(&ghdr(5000, 1234, OP_REQUEST), &[]);
    let p = rig.settle();
    assert_eq!(p[0].0.buf_alloc, 1000);
    let _s = l.try_accept().unwrap().unwrap();
    rig.tx.tx(&ghdr(5000, 1234, OP_CREDIT_REQUEST), &[]);
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_CREDIT_UPDATE]);
    assert_eq!((p[0].0.buf_alloc, p[0].0.fwd_cnt), (1000, 0));
    // 1001 bytes with 1000 bytes of credit: reset.
    rig.tx.tx(&rw(5000, 1234, 1001), &payload(1001));
    assert_eq!(ops(&rig.settle()), vec![OP_RST]);
    assert_eq!(rig.model.stats().connections, 0);
}

#[test]
fn credit_update_sent_when_host_consumes_guest_data() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    // 200 KiB in 4 packets: more than the socketpair holds, so some of it
    // waits in the device until the helper reads.
    let data = payload(200 * 1024);
    for c in data.chunks(50 * 1024) {
        rig.tx.tx(&rw(5000, 1234, c.len()), c);
    }
    // The reader hands the stream back so that it stays open: closing it
    // would make the device send SHUTDOWN, which this test does not expect.
    let reader = std::thread::spawn(move || (read_exact(&mut s, 200 * 1024), s));
    let mut fwd = 0;
    let deadline = Instant::now() + Duration::from_secs(5);
    while fwd < 200 * 1024 && Instant::now() < deadline {
        for (h, _) in rig.settle() {
            assert_eq!(h.op, OP_CREDIT_UPDATE);
            fwd = h.fwd_cnt;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let (got, _stream) = reader.join().unwrap();
    assert_eq!(got, data);
    assert_eq!(fwd, 200 * 1024, "the guest learns every byte was forwarded");
}

#[test]
fn rst_for_unknown_port_and_unknown_connection() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    rig.rx.post_rx(8);
    rig.tx.tx(&ghdr(5000, 4321, OP_REQUEST), &[]);
    rig.tx.tx(&rw(5001, 4321, 3), b"abc");
    // An RST for an unknown connection is not answered.
    rig.tx.tx(&ghdr(5002, 4321, OP_RST), &[]);
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_RST, OP_RST]);
    let h = p[0].0;
    assert_eq!(
        (h.src_cid, h.dst_cid, h.src_port, h.dst_port),
        (2, GUEST_CID, 4321, 5000)
    );
    assert_eq!(p[1].0.dst_port, 5001);
    // Wrong destination CID and unsupported socket type are refused too.
    let mut other = ghdr(5003, 1, OP_REQUEST);
    other.dst_cid = 7;
    rig.tx.tx(&other, &[]);
    let mut seq = ghdr(5004, 1, OP_REQUEST);
    seq.kind = TYPE_SEQPACKET;
    rig.tx.tx(&seq, &[]);
    // A spoofed source CID is dropped silently.
    let mut spoof = ghdr(5005, 1, OP_REQUEST);
    spoof.src_cid = 9;
    rig.tx.tx(&spoof, &[]);
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_RST, OP_RST]);
    assert_eq!(p[0].0.src_cid, 7);
    assert_eq!(rig.model.stats().refused, 4);
}

#[test]
fn connection_limit_refuses_extra_requests() {
    let m = mem();
    let config = VsockConfig {
        max_connections: 2,
        ..VsockConfig::default()
    };
    let mut rig = Rig::new(&m, config);
    let l = rig.host.listen(1234).unwrap();
    rig.rx.post_rx(8);
    for port in [5000, 5001, 5002] {
        rig.tx.tx(&ghdr(port, 1234, OP_REQUEST), &[]);
    }
    let p = rig.settle();
    let mut got: Vec<(u16, u32)> = p.iter().map(|(h, _)| (h.op, h.dst_port)).collect();
    got.sort();
    assert_eq!(
        got,
        vec![(OP_RESPONSE, 5000), (OP_RESPONSE, 5001), (OP_RST, 5002)]
    );
    assert_eq!(rig.model.stats().connections, 2);
    // Host connects are refused at the limit as well.
    let host = rig.host.clone();
    let t = std::thread::spawn(move || host.connect(9, Duration::from_secs(2)));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !t.is_finished() && Instant::now() < deadline {
        rig.settle();
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(matches!(
        t.join().unwrap(),
        Err(HostError::Connect {
            source: ConnectError::Limit,
            ..
        })
    ));
    drop(l);
}

#[test]
fn guest_orderly_shutdown() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    rig.tx.tx(&rw(5000, 1234, 4), b"last");
    let mut sd = ghdr(5000, 1234, OP_SHUTDOWN);
    sd.flags = SHUTDOWN_F_SEND;
    rig.tx.tx(&sd, &[]);
    assert!(rig.settle().is_empty());
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    assert_eq!(all, b"last", "data, then EOF");
    // The host can still send after the guest's half close.
    s.write_all(b"reply").unwrap();
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_RW]);
    // Full shutdown from the guest: we answer RST and forget the connection.
    sd.flags = SHUTDOWN_F_BOTH;
    rig.tx.tx(&sd, &[]);
    assert_eq!(ops(&rig.settle()), vec![OP_RST]);
    assert_eq!(rig.model.stats().connections, 0);
}

#[test]
fn host_close_sends_shutdown_then_guest_rst_closes() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    s.write_all(b"bye").unwrap();
    drop(s);
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_RW, OP_SHUTDOWN]);
    assert_eq!(p[1].0.flags, SHUTDOWN_F_BOTH);
    assert_eq!(rig.model.stats().connections, 1);
    rig.tx.tx(&ghdr(5000, 1234, OP_RST), &[]);
    assert!(rig.settle().is_empty(), "no answer to the guest's RST");
    assert_eq!(rig.model.stats().connections, 0);
}

#[test]
fn host_half_close_then_close_and_timeout_rst() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let s = establish(&mut rig, &l);
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_SHUTDOWN]);
    assert_eq!(p[0].0.flags, SHUTDOWN_F_SEND);
    drop(s);
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_SHUTDOWN]);
    assert_eq!(p[0].0.flags, SHUTDOWN_F_RCV);
    // The guest never answers: RST after the close timeout.
    std::thread::sleep(CLOSE_TIMEOUT + Duration::from_millis(100));
    assert_eq!(ops(&rig.settle()), vec![OP_RST]);
    assert_eq!(rig.model.stats().connections, 0);
}

#[test]
fn abrupt_guest_rst_gives_host_eof() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    rig.tx.tx(&ghdr(5000, 1234, OP_RST), &[]);
    assert!(rig.settle().is_empty());
    let mut b = [0u8; 8];
    assert_eq!(s.read(&mut b).unwrap(), 0);
    assert_eq!(rig.model.stats().connections, 0);
}

#[test]
fn malformed_chains_are_dropped_without_panic() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    rig.tx.used();

    // Too short for a header.
    let a = rig.tx.alloc(10);
    rig.tx.add_chain(&[(a, 10, 0)]);
    // Device-writable descriptor in TX.
    let a = rig.tx.alloc(64);
    m.write_slice(&rw(5000, 1234, 0).to_bytes(), GuestAddress(a))
        .unwrap();
    rig.tx.add_chain(&[(a, 64, F_WRITE)]);
    // Buffer outside guest memory, and one straddling its end.
    rig.tx.add_chain(&[(MEM_SIZE as u64 + 0x1000, 64, 0)]);
    rig.tx.add_chain(&[(MEM_SIZE as u64 - 8, 64, 0)]);
    rig.tx.add_chain(&[(u64::MAX - 16, 64, 0)]);
    // A zero-length descriptor only.
    let a = rig.tx.alloc(1);
    rig.tx.add_chain(&[(a, 0, 0)]);
    // A descriptor chain that loops on itself: virtio-queue stops after
    // queue-size descriptors; the bytes read (zeros) name no valid source.
    let a = rig.tx.alloc(HDR_SIZE as u32);
    m.write_slice(&[0u8; 8], GuestAddress(a)).unwrap();
    let i = rig.tx.next_desc;
    let looped = RawDescriptor::from(SplitDescriptor::new(a, 8, F_NEXT, i));
    rig.tx.vq.add_desc_chains(&[looped], i).unwrap();
    rig.tx.next_desc += 1;
    // Avail ring entry naming a descriptor beyond the table.
    let avail = rig.tx.vq.avail_addr();
    let idx: u16 = m.read_obj(avail.unchecked_add(2)).unwrap();
    m.write_obj(999u16, avail.unchecked_add(4 + u64::from(idx % QSIZE) * 2))
        .unwrap();
    m.write_obj(idx.wrapping_add(1), avail.unchecked_add(2))
        .unwrap();
    assert!(
        rig.settle().is_empty(),
        "nothing is answered to unparseable chains"
    );
    let used = rig.tx.used();
    // Every chain with an in-table head came back, empty; the head beyond the
    // table cannot be returned and is skipped.
    assert_eq!(used.len(), 7, "{used:?}");
    assert!(used.iter().all(|&(_, len)| len == 0));

    // Payload length larger than the descriptors: the connection is reset.
    rig.tx.tx(&rw(5000, 1234, 100), b"only ten..");
    assert_eq!(ops(&rig.settle()), vec![OP_RST]);
    let mut b = [0u8; 8];
    assert_eq!(s.read(&mut b).unwrap(), 0);
}

#[test]
fn a_flood_of_malformed_chains_spends_the_log_budget_only() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    rig.tx.used();
    assert_eq!(rig.model.log_budget_left(), WARN_LOG_BUDGET);
    // Chains too short for a header, in batches the queue can hold: every
    // one is dropped, and only the first WARN_LOG_BUDGET are logged at
    // warning level.
    for _ in 0..(3 * WARN_LOG_BUDGET).div_ceil(16) {
        for _ in 0..16 {
            let a = rig.tx.alloc(10);
            rig.tx.add_chain(&[(a, 10, 0)]);
        }
        assert!(rig.settle().is_empty());
        assert_eq!(rig.tx.used().len(), 16);
    }
    assert_eq!(rig.model.log_budget_left(), 0);
    // The connection still carries data.
    rig.tx.tx(&rw(5000, 1234, 2), b"ok");
    rig.settle();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(read_exact(&mut s, 2), b"ok");
}

#[test]
fn malformed_rx_chains_are_returned_empty() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    // RX chains that cannot hold a packet are returned empty; the packet goes
    // to the next good one.
    let a = rig.rx.alloc(16);
    rig.rx.add_chain(&[(a, 16, F_WRITE)]);
    let a = rig.rx.alloc(64);
    rig.rx.add_chain(&[(a, 64, 0)]);
    rig.rx.add_chain(&[(MEM_SIZE as u64, 4096, F_WRITE)]);
    rig.tx.tx(&ghdr(6000, 1234, OP_REQUEST), &[]);
    rig.process();
    let used = rig.rx.used();
    assert_eq!(used.len(), 3);
    assert!(used.iter().all(|&(_, len)| len == 0));
    rig.rx.post_rx(4);
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_RESPONSE]);
    let mut s = l.try_accept().unwrap().unwrap();
    // The device still works.
    rig.tx.tx(&rw(6000, 1234, 2), b"ok");
    rig.settle();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(read_exact(&mut s, 2), b"ok");
}

#[test]
fn host_initiated_connect_accepted_and_refused() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    rig.rx.post_rx(8);
    let host = rig.host.clone();
    let t = std::thread::spawn(move || host.connect(7000, Duration::from_secs(5)));
    let deadline = Instant::now() + Duration::from_secs(5);
    let req = loop {
        assert!(Instant::now() < deadline, "no REQUEST reached the guest");
        let p = rig.settle();
        if let Some((h, _)) = p.first() {
            break *h;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!(req.op, OP_REQUEST);
    assert_eq!(
        (req.src_port, req.dst_port, req.dst_cid),
        (EPHEMERAL_PORT_FIRST, 7000, GUEST_CID)
    );
    // The guest accepts.
    let mut resp = ghdr(7000, req.src_port, OP_RESPONSE);
    resp.buf_alloc = 4096;
    rig.tx.tx(&resp, &[]);
    rig.settle();
    let mut s = t.join().unwrap().unwrap();
    s.write_all(b"hi guest").unwrap();
    let p = rig.settle();
    assert_eq!(ops(&p), vec![OP_RW]);
    assert_eq!(p[0].1, b"hi guest");
    rig.tx.tx(&rw(7000, req.src_port, 8), b"hi host!");
    rig.settle();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(read_exact(&mut s, 8), b"hi host!");

    // A second connect to a port nobody listens on: the guest says RST.
    let host = rig.host.clone();
    let t = std::thread::spawn(move || host.connect(7001, Duration::from_secs(5)));
    let req = loop {
        let p = rig.settle();
        if let Some((h, _)) = p.first() {
            break *h;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!(req.src_port, EPHEMERAL_PORT_FIRST + 1);
    rig.tx.tx(&ghdr(7001, req.src_port, OP_RST), &[]);
    rig.settle();
    assert!(matches!(
        t.join().unwrap(),
        Err(HostError::Connect {
            source: ConnectError::Refused,
            ..
        })
    ));
}

#[test]
fn transport_reset_drops_connections_and_posts_event() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    let a = rig.ev.alloc(8);
    rig.ev.add_chain(&[(a, 8, F_WRITE)]);
    rig.host.reset_transport().unwrap();
    let sig = rig.process();
    assert!(sig[EVENT_QUEUE as usize], "event queue signalled");
    assert_eq!(rig.ev.used(), vec![(0, 4)]);
    let id: u32 = m.read_obj(GuestAddress(a)).unwrap();
    assert_eq!(id, EVENT_TRANSPORT_RESET);
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).unwrap(), 0, "helper stream sees EOF");
    assert_eq!(rig.model.stats().connections, 0);
    // No second event.
    let a = rig.ev.alloc(8);
    rig.ev.add_chain(&[(a, 8, F_WRITE)]);
    rig.process();
    assert!(rig.ev.used().is_empty());
}

#[test]
fn map_unix_forwards_to_a_host_socket() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let dir = std::env::temp_dir().join(format!("vsock-map-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tool.sock");
    let _ = std::fs::remove_file(&path);
    let ul = std::os::unix::net::UnixListener::bind(&path).unwrap();
    rig.host.map_unix(2222, &path).unwrap();
    assert!(matches!(
        rig.host.listen(2222),
        Err(HostError::PortInUse(2222))
    ));
    rig.rx.post_rx(4);
    rig.tx.tx(&ghdr(5000, 2222, OP_REQUEST), &[]);
    assert_eq!(ops(&rig.settle()), vec![OP_RESPONSE]);
    let (mut s, _) = ul.accept().unwrap();
    rig.tx.tx(&rw(5000, 2222, 3), b"abc");
    rig.settle();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(read_exact(&mut s, 3), b"abc");
    // Unmapped: refused.
    rig.host.unmap(2222);
    rig.tx.tx(&ghdr(5001, 2222, OP_REQUEST), &[]);
    assert_eq!(ops(&rig.settle()), vec![OP_RST]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dropped_listener_frees_the_port() {
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    assert!(matches!(
        rig.host.listen(1234),
        Err(HostError::PortInUse(1234))
    ));
    drop(l);
    rig.rx.post_rx(2);
    rig.tx.tx(&ghdr(5000, 1234, OP_REQUEST), &[]);
    assert_eq!(ops(&rig.settle()), vec![OP_RST]);
    let _l = rig.host.listen(1234).unwrap();
}

/// Records what the device signals.
#[derive(Default)]
struct Irq {
    used: Mutex<Vec<u16>>,
}

impl vmm::virtio::VirtioInterrupt for Irq {
    fn signal_used_queue(&self, queue: u16) -> std::io::Result<()> {
        self.used.lock().unwrap().push(queue);
        Ok(())
    }
    fn signal_config_change(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn signal_needs_reset(&self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn in_process_face_runs_the_model_on_its_worker() {
    use vmm::virtio::{ActiveQueue, VirtioDevice};
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    let m = mem();
    let host = VsockHost::new().unwrap();
    let l = host.listen(1234).unwrap();
    let mut dev = super::VsockDevice::new(GUEST_CID, VsockConfig::default(), host).unwrap();
    assert_eq!(dev.device_type(), 19);
    assert_eq!(dev.queue_max_sizes().len(), 3);
    let mut cfg = [0u8; 8];
    dev.read_config(0, &mut cfg);
    assert_eq!(u64::from_le_bytes(cfg), GUEST_CID);
    assert!(super::VsockDevice::new(2, VsockConfig::default(), VsockHost::new().unwrap()).is_err());

    let mut rx = Drv::new(&m, 0x0, 0x10_0000, 0x60_0000);
    let mut tx = Drv::new(&m, 0x1_0000, 0x70_0000, 0x60_0000);
    let ev = Drv::new(&m, 0x2_0000, 0xd0_0000, 0x1_0000);
    let kicks: Vec<EventFd> = (0..3)
        .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
        .collect();
    let queues = [&rx, &tx, &ev]
        .iter()
        .zip(&kicks)
        .enumerate()
        .map(|(i, (d, k))| ActiveQueue {
            index: i as u16,
            queue: d.queue(),
            notify: k.try_clone().unwrap(),
        })
        .collect();
    let irq = Arc::new(Irq::default());
    dev.activate(m.clone(), irq.clone(), queues).unwrap();
    assert!(dev.is_active());

    rx.post_rx(4);
    kicks[RX_QUEUE as usize].write(1).unwrap();
    tx.tx(&ghdr(5000, 1234, OP_REQUEST), &[]);
    kicks[TX_QUEUE as usize].write(1).unwrap();
    let mut s = l.accept_timeout(Duration::from_secs(5)).unwrap();
    s.write_all(b"from helper").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut got = Vec::new();
    while got.len() < 2 && Instant::now() < deadline {
        got.extend(rx.rx_packets());
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(ops(&got), vec![OP_RESPONSE, OP_RW]);
    assert_eq!(got[1].1, b"from helper");
    assert!(irq.used.lock().unwrap().contains(&RX_QUEUE));

    assert!(dev.reset());
    assert!(!dev.is_active());
    let mut b = [0u8; 1];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(s.read(&mut b).unwrap(), 0, "reset closes the connections");
}

/// The in-process face behind the vmm's virtio-mmio transport, driven
/// register by register like a guest driver (event-idx negotiated).
#[test]
fn behind_the_mmio_transport() {
    use vmm::virtio::mmio::*;
    use vmm::virtio::{features, status, MmioTransport};

    let m = mem();
    let host = VsockHost::new().unwrap();
    let l = host.listen(1234).unwrap();
    let dev = super::VsockDevice::new(GUEST_CID, VsockConfig::default(), host).unwrap();
    let t = MmioTransport::new(Box::new(dev), m.clone()).unwrap();
    let r32 = |off: u64| {
        let mut d = [0u8; 4];
        t.read(off, &mut d);
        u32::from_le_bytes(d)
    };
    let w32 = |off: u64, v: u32| t.write(off, &v.to_le_bytes());
    assert_eq!(r32(MAGIC), MAGIC_VALUE);
    assert_eq!(r32(DEVICE_ID), 19);
    let mut cid = [0u8; 8];
    t.read(CONFIG_SPACE, &mut cid);
    assert_eq!(u64::from_le_bytes(cid), GUEST_CID);

    w32(STATUS, status::ACKNOWLEDGE | status::DRIVER);
    let acked = features::VERSION_1 | features::RING_EVENT_IDX;
    w32(DRIVER_FEATURES_SEL, 0);
    w32(DRIVER_FEATURES, acked as u32);
    w32(DRIVER_FEATURES_SEL, 1);
    w32(DRIVER_FEATURES, (acked >> 32) as u32);
    w32(
        STATUS,
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
    );
    assert_ne!(r32(STATUS) & status::FEATURES_OK, 0);

    let mut rx = Drv::new(&m, 0x0, 0x10_0000, 0x60_0000);
    let mut tx = Drv::new(&m, 0x1_0000, 0x70_0000, 0x60_0000);
    let ev = Drv::new(&m, 0x2_0000, 0xd0_0000, 0x1_0000);
    for (i, d) in [&rx, &tx, &ev].iter().enumerate() {
        w32(QUEUE_SEL, i as u32);
        w32(QUEUE_NUM, u32::from(QSIZE));
        for (reg, addr) in [
            (QUEUE_DESC_LOW, d.vq.desc_table_addr().0),
            (QUEUE_DRIVER_LOW, d.vq.avail_addr().0),
            (QUEUE_DEVICE_LOW, d.vq.used_addr().0),
        ] {
            w32(reg, addr as u32);
            w32(reg + 4, (addr >> 32) as u32);
        }
        w32(QUEUE_READY, 1);
    }
    rx.post_rx(4);
    w32(
        STATUS,
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
    );
    assert!(t.is_activated());

    tx.tx(&ghdr(5000, 1234, OP_REQUEST), &[]);
    // The guest kicks TX through the notify register.
    w32(QUEUE_NOTIFY, u32::from(TX_QUEUE));
    let mut s = l.accept_timeout(Duration::from_secs(5)).unwrap();
    s.write_all(b"over mmio").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut got = Vec::new();
    while got.len() < 2 && Instant::now() < deadline {
        got.extend(rx.rx_packets());
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(ops(&got), vec![OP_RESPONSE, OP_RW]);
    assert_eq!(got[1].1, b"over mmio");
    assert!(t.interrupt_evt().read().unwrap() >= 1, "irqfd written");
    assert_ne!(r32(INTERRUPT_STATUS) & INT_VRING, 0);

    // Driver reset: the worker stops and the helper stream sees EOF.
    w32(STATUS, 0);
    assert!(!t.is_activated());
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).unwrap(), 0);
}

/// The model's side of a snapshot: the reset posted on the event queue
/// drops the connections, and nothing is sent to the guest until it has
/// made another event buffer available (it does so once it has handled
/// the event); with no event buffer at snapshot time the reset is owed and
/// RX stays gated until it is posted and handled.
#[test]
fn snapshot_reset_gates_rx_until_the_guest_handled_it() {
    use super::device::ResetAck;
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    let mut s = establish(&mut rig, &l);
    for _ in 0..2 {
        let a = rig.ev.alloc(8);
        rig.ev.add_chain(&[(a, 8, F_WRITE)]);
    }
    rig.model.post_transport_reset(&m, &mut rig.evq).unwrap();
    assert_eq!(rig.model.reset_ack(), ResetAck::Posted(2));
    assert_eq!(rig.ev.used(), vec![(0, 4)]);
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).unwrap(), 0, "the helper's stream sees EOF");

    // A new connection: accepted on the host, but the answer waits.
    rig.tx.tx(&ghdr(5001, 1234, OP_REQUEST), &[]);
    assert!(
        rig.settle().is_empty(),
        "RX before the guest handled the reset"
    );
    let _s2 = l.try_accept().unwrap().expect("the host side accepted");
    // The guest refills its event queue: RX flows again.
    let a = rig.ev.alloc(8);
    rig.ev.add_chain(&[(a, 8, F_WRITE)]);
    assert_eq!(ops(&rig.settle()), vec![OP_RESPONSE]);
    assert_eq!(rig.model.reset_ack(), ResetAck::None);

    // No event buffer at all: the reset is owed.
    let m = mem();
    let mut rig = Rig::new(&m, VsockConfig::default());
    let l = rig.host.listen(1234).unwrap();
    rig.model.post_transport_reset(&m, &mut rig.evq).unwrap();
    assert_eq!(rig.model.reset_ack(), ResetAck::Unposted);
    rig.rx.post_rx(4);
    rig.tx.tx(&ghdr(5000, 1234, OP_REQUEST), &[]);
    assert!(rig.settle().is_empty());
    let a = rig.ev.alloc(8);
    rig.ev.add_chain(&[(a, 8, F_WRITE)]);
    assert!(rig.settle().is_empty(), "posted, not handled yet");
    assert_eq!(rig.ev.used(), vec![(0, 4)]);
    assert!(matches!(rig.model.reset_ack(), ResetAck::Posted(_)));
    let a = rig.ev.alloc(8);
    rig.ev.add_chain(&[(a, 8, F_WRITE)]);
    assert_eq!(ops(&rig.settle()), vec![OP_RESPONSE]);
    drop(l);
}

/// Sets the virtio-vsock device up behind a transport the way the Linux
/// driver does (EVENT_IDX, three queues, event buffers, RX buffers).
fn drive_to_driver_ok<'a>(
    t: &vmm::virtio::MmioTransport,
    m: &'a Mem,
) -> (Drv<'a>, Drv<'a>, Drv<'a>) {
    use vmm::virtio::mmio::*;
    use vmm::virtio::{features, status};
    let w32 = |off: u64, v: u32| t.write(off, &v.to_le_bytes());
    w32(STATUS, status::ACKNOWLEDGE | status::DRIVER);
    let acked = features::VERSION_1 | features::RING_EVENT_IDX;
    w32(DRIVER_FEATURES_SEL, 0);
    w32(DRIVER_FEATURES, acked as u32);
    w32(DRIVER_FEATURES_SEL, 1);
    w32(DRIVER_FEATURES, (acked >> 32) as u32);
    w32(
        STATUS,
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
    );
    let mut rx = Drv::new(m, 0x0, 0x10_0000, 0x60_0000);
    let tx = Drv::new(m, 0x1_0000, 0x70_0000, 0x60_0000);
    let mut ev = Drv::new(m, 0x2_0000, 0xd0_0000, 0x1_0000);
    for (i, d) in [&rx, &tx, &ev].iter().enumerate() {
        w32(QUEUE_SEL, i as u32);
        w32(QUEUE_NUM, u32::from(QSIZE));
        for (reg, addr) in [
            (QUEUE_DESC_LOW, d.vq.desc_table_addr().0),
            (QUEUE_DRIVER_LOW, d.vq.avail_addr().0),
            (QUEUE_DEVICE_LOW, d.vq.used_addr().0),
        ] {
            w32(reg, addr as u32);
            w32(reg + 4, (addr >> 32) as u32);
        }
        w32(QUEUE_READY, 1);
    }
    rx.post_rx(8);
    for _ in 0..4 {
        let a = ev.alloc(8);
        ev.add_chain(&[(a, 8, F_WRITE)]);
    }
    w32(
        STATUS,
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
    );
    assert!(t.is_activated());
    (rx, tx, ev)
}

/// Waits up to 5 s for RX packets.
fn rx_wait(rx: &mut Drv<'_>, n: usize) -> Vec<(Header, Vec<u8>)> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        got.extend(rx.rx_packets());
        std::thread::sleep(Duration::from_millis(2));
    }
    got
}

/// The in-process face through a snapshot: paused and saved behind its
/// transport (the connection is reset, the event posted), restored around
/// a new device with a new host side, resumed (the event queue is
/// signalled again); a new connection is answered only once the guest
/// has handled the reset.
#[test]
fn the_device_goes_through_a_snapshot() {
    use vmm::virtio::mmio::*;
    use vmm::virtio::MmioTransport;

    let m = mem();
    let host = VsockHost::new().unwrap();
    let l = host.listen(1234).unwrap();
    let dev = super::VsockDevice::new(GUEST_CID, VsockConfig::default(), host).unwrap();
    let t = MmioTransport::new(Box::new(dev), m.clone()).unwrap();
    let (mut rx, mut tx, mut ev) = drive_to_driver_ok(&t, &m);
    tx.tx(&ghdr(5000, 1234, OP_REQUEST), &[]);
    t.write(QUEUE_NOTIFY, &u32::from(TX_QUEUE).to_le_bytes());
    let mut s = l.accept_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(ops(&rx_wait(&mut rx, 1)), vec![OP_RESPONSE]);

    t.pause().unwrap();
    let saved = t.save_state().unwrap();
    drop(t);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).unwrap(), 0, "the connection did not survive");
    assert_eq!(ev.used(), vec![(0, 4)], "TRANSPORT_RESET posted");
    assert!(saved.activated);

    // The restored VM: a new host side, a new device.
    let host = VsockHost::new().unwrap();
    let l = host.listen(1234).unwrap();
    let dev = super::VsockDevice::new(GUEST_CID, VsockConfig::default(), host).unwrap();
    let t = MmioTransport::restore(Box::new(dev), m.clone(), &saved).unwrap();
    let _ = t.interrupt_evt().read();
    t.resume();
    assert!(t.is_activated());
    assert!(
        t.interrupt_evt().read().unwrap_or(0) >= 1,
        "the event queue is signalled again"
    );
    let mut isr = [0u8; 4];
    t.read(INTERRUPT_STATUS, &mut isr);
    assert_ne!(u32::from_le_bytes(isr) & INT_VRING, 0);

    // The agent dials again before the guest refilled its event queue.
    tx.tx(&ghdr(5001, 1234, OP_REQUEST), &[]);
    t.write(QUEUE_NOTIFY, &u32::from(TX_QUEUE).to_le_bytes());
    let _s2 = l.accept_timeout(Duration::from_secs(5)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        rx.rx_packets().is_empty(),
        "answered before the reset was handled"
    );
    // The guest handles the event and refills the buffer: the device asked
    // for a kick there (EVENT_IDX), which the driver sends.
    let a = ev.alloc(8);
    ev.add_chain(&[(a, 8, F_WRITE)]);
    t.write(QUEUE_NOTIFY, &u32::from(EVENT_QUEUE).to_le_bytes());
    assert_eq!(ops(&rx_wait(&mut rx, 1)), vec![OP_RESPONSE]);
    t.shutdown();
}
