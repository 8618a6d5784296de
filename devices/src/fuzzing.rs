//! Fuzzing entry points of the device models, shared by the cargo-fuzz
//! targets in `fuzz/` (nightly, libFuzzer) and the workspace's corpus replay
//! test (`tests/fuzz_corpora.rs`, stable). Each function takes the raw fuzz
//! input, turns it into a structured script with `arbitrary` (so inputs
//! reach the device logic instead of dying in ring validation), and plays
//! the guest driver against the real model in real guest memory.
//!
//! * [`vsock`]: TX packets (well-formed headers over any descriptor layout,
//!   or raw descriptors), RX and event buffers, and the host side (accepting,
//!   writing to and closing host streams) through the muxer's state machine.
//! * [`blk`]: request chains against a raw image, writable or read-only.
//! * [`fs`]: FUSE requests in descriptor chains served by the virtio-fs
//!   server over a [`SessionFs`] with `ro`, `rw` and `rwd` grants; afterwards
//!   the host file outside every grant must be untouched.
//!
//! Checks beyond "no panic": every used-ring entry names a chain the driver
//! posted and claims no more bytes than the chain's device-writable buffers
//! hold (not checkable once a raw chain used an indirect table, whose
//! entries may aim the device at the driver's own rings); nothing outside
//! the grants changes. A panic
//! inside the FUSE server (which the device catches and turns into
//! DEVICE_NEEDS_RESET) is raised here as a failure.
//!
//! Limits: host-initiated vsock connects are not driven (they block the
//! caller until the guest answers); rings are laid out by hand rather than
//! with virtio-queue's `MockSplitQueue`, whose used ring overlaps the upper
//! half of its available ring; scratch files live under the system's
//! temporary directory and are removed after each input.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use arbitrary::{Arbitrary, Unstructured};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm::virtio::GuestMemoryMmap;

use crate::blk::image::{BlockBackend, RawImage};
use crate::blk::{BlkConfig, BlkModel};
use crate::fs::device::{serve_chain, FsDeviceStats, WorkerError};
use crate::fs::{GrantMode, SessionFs, SessionFsOptions};
use crate::vsock::packet::{Header, VSOCK_HOST_CID};
use crate::vsock::{VsockConfig, VsockHost, VsockModel};

/// Guest memory of every device target: small, so guest addresses chosen by
/// the fuzzer often land inside it.
const MEM_SIZE: u64 = 1 << 20;
/// Queue size the fuzzing driver uses (every model accepts it).
const QSIZE: u16 = 64;
/// Where queue `i`'s rings start: `RING_BASE + i * RING_STRIDE`.
const RING_BASE: u64 = 0x1000;
/// Room for one queue's descriptor table and rings.
const RING_STRIDE: u64 = 0x1000;
/// Start of the area the driver allocates buffers from.
const DATA_BASE: u64 = 0x1_0000;
/// Most bytes of device-writable buffer in one chain.
const MAX_WRITABLE: u32 = 16 * 1024;
/// Most descriptors in one chain the driver builds (raw chains included).
const MAX_CHAIN_DESCS: usize = 16;
/// Most script steps one input runs.
const MAX_STEPS: usize = 64;
/// Guest CID of the vsock targets.
const GUEST_CID: u64 = 3;
/// The vsock port the host listens on.
const LISTEN_PORT: u32 = 1234;
/// Disk size of the blk target.
const DISK_SIZE: u64 = 64 * 1024;
/// Sector size of the disk model.
const SECTOR: u64 = 512;

/// `VRING_DESC_F_NEXT`.
const F_NEXT: u16 = 1;
/// `VRING_DESC_F_WRITE`.
const F_WRITE: u16 = 2;
/// `VRING_DESC_F_INDIRECT`.
const F_INDIRECT: u16 = 4;

/// Where a raw descriptor's buffer goes: as given, unless the buffer
/// overlaps the rings (`[RING_BASE, DATA_BASE)`), where it is moved up by
/// `DATA_BASE`. A driver that points buffers at its own rings gets them
/// overwritten by the device, which is its own doing and not a device bug
/// the used-ring checks should report. Indirect tables stay where they are
/// (the device only reads them; see [`DriverQueue::raw_indirect`]).
fn raw_buffer_addr(addr: u32, len: u16, flags: u16) -> u64 {
    let (addr, end) = (u64::from(addr), u64::from(addr) + u64::from(len));
    if flags & F_INDIRECT == 0 && addr < DATA_BASE && end > RING_BASE {
        addr + DATA_BASE
    } else {
        addr
    }
}

/// A descriptor with every field chosen by the input.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct RawDesc {
    addr: u32,
    len: u16,
    flags: u8,
    next: u8,
}

/// One descriptor chain as a driver would post it.
#[derive(Arbitrary, Debug)]
pub enum ChainSpec {
    /// Device-readable `bytes` split into descriptors of the given sizes
    /// (the last takes the rest), then device-writable buffers of the given
    /// lengths; optionally through an indirect table.
    Layout {
        bytes: Vec<u8>,
        splits: Vec<u8>,
        writable: Vec<u16>,
        indirect: bool,
    },
    /// Descriptors exactly as given (out-of-memory addresses, loops, bad
    /// flags, indirect tables pointing anywhere).
    Raw(Vec<RawDesc>),
}

/// Driver side of one split queue in guest memory.
struct DriverQueue {
    desc: u64,
    avail: u64,
    used: u64,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
    /// In-flight chains by head: the writable capacity (`None` for raw
    /// chains, which are not checked) and how many table entries they use.
    posted: HashMap<u16, (Option<u64>, u16)>,
    /// Table entries not used by an in-flight chain. Chains are laid out
    /// one after another and every device here completes them in order, so
    /// a count is enough to never overwrite an in-flight chain.
    free: u16,
    /// A raw chain of this queue had an indirect descriptor: its table is
    /// whatever guest memory holds there (fuzzer bytes, or what the device
    /// wrote into an RX buffer), so its entries may name buffers inside any
    /// queue's rings, and the device then rightly overwrites the driver's
    /// own rings. The used-ring checks of every queue stop for that input.
    raw_indirect: bool,
}

/// Bump allocator over the data area.
struct Alloc {
    next: u64,
}

impl Alloc {
    fn take(&mut self, len: u64) -> Option<u64> {
        let a = self.next;
        let end = a.checked_add(len.max(1).next_multiple_of(16))?;
        if end > MEM_SIZE {
            return None;
        }
        self.next = end;
        Some(a)
    }
}

fn guest_memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)])
        .expect("fuzzing guest memory maps")
}

fn write_desc(mem: &GuestMemoryMmap, at: u64, d: SplitDescriptor) {
    // Inside the memory the harness laid out: cannot fail.
    let _ = mem.write_obj(RawDescriptor::from(d), GuestAddress(at));
}

impl DriverQueue {
    fn new(mem: &GuestMemoryMmap, index: u64) -> Self {
        let desc = RING_BASE + index * RING_STRIDE;
        let n = u64::from(QSIZE);
        let avail = desc + 16 * n;
        let used = (avail + 6 + 2 * n).next_multiple_of(4);
        let _ = mem.write_slice(&vec![0u8; RING_STRIDE as usize], GuestAddress(desc));
        Self {
            desc,
            avail,
            used,
            next_desc: 0,
            avail_idx: 0,
            used_seen: 0,
            posted: HashMap::new(),
            free: QSIZE,
            raw_indirect: false,
        }
    }

    /// The device's view of this queue (event index off).
    fn queue(&self) -> Queue {
        let mut q = Queue::new(QSIZE).expect("queue size is a power of two");
        q.set_desc_table_address(Some(self.desc as u32), Some((self.desc >> 32) as u32));
        q.set_avail_ring_address(Some(self.avail as u32), Some((self.avail >> 32) as u32));
        q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
        q.set_ready(true);
        q
    }

    fn publish(&mut self, mem: &GuestMemoryMmap, head: u16) {
        let slot = self.avail + 4 + u64::from(self.avail_idx % QSIZE) * 2;
        let _ = mem.write_obj(head, GuestAddress(slot));
        self.avail_idx = self.avail_idx.wrapping_add(1);
        let _ = mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2));
    }

    /// Posts `spec`; returns false when the data area is exhausted or the
    /// ring is full (nothing posted).
    fn post(&mut self, mem: &GuestMemoryMmap, alloc: &mut Alloc, spec: &ChainSpec) -> bool {
        match spec {
            ChainSpec::Raw(descs) => {
                let descs = &descs[..descs.len().min(MAX_CHAIN_DESCS)];
                if descs.is_empty() || descs.len() > usize::from(self.free) {
                    return false;
                }
                let head = self.next_desc;
                for d in descs {
                    let idx = self.next_desc;
                    let flags = u16::from(d.flags);
                    self.raw_indirect |= flags & F_INDIRECT != 0;
                    write_desc(
                        mem,
                        self.desc + u64::from(idx) * 16,
                        SplitDescriptor::new(
                            raw_buffer_addr(d.addr, d.len, flags),
                            u32::from(d.len),
                            flags,
                            u16::from(d.next) % QSIZE,
                        ),
                    );
                    self.next_desc = (idx + 1) % QSIZE;
                }
                self.take(head, None, descs.len() as u16);
                self.publish(mem, head);
                true
            }
            ChainSpec::Layout {
                bytes,
                splits,
                writable,
                indirect,
            } => {
                let mut bufs: Vec<(u64, u32, bool)> = Vec::new();
                let mut off = 0usize;
                let mut split_iter = splits.iter();
                while off < bytes.len() && bufs.len() < MAX_CHAIN_DESCS / 2 {
                    let n = match split_iter.next() {
                        Some(&s) if s > 0 => usize::from(s).min(bytes.len() - off),
                        _ => bytes.len() - off,
                    };
                    let Some(a) = alloc.take(n as u64) else {
                        return false;
                    };
                    let _ = mem.write_slice(&bytes[off..off + n], GuestAddress(a));
                    bufs.push((a, n as u32, false));
                    off += n;
                }
                let mut cap = 0u64;
                for &w in writable.iter().take(MAX_CHAIN_DESCS / 2) {
                    let len = u32::from(w).min(MAX_WRITABLE);
                    let Some(a) = alloc.take(u64::from(len)) else {
                        return false;
                    };
                    bufs.push((a, len, true));
                    cap += u64::from(len);
                }
                let entries = if *indirect { 1 } else { bufs.len() as u16 };
                if bufs.is_empty() || entries > self.free {
                    return false;
                }
                let head = self.next_desc;
                let flags = |i: usize, w: bool| {
                    let mut f = if w { F_WRITE } else { 0 };
                    if i + 1 < bufs.len() {
                        f |= F_NEXT;
                    }
                    f
                };
                if *indirect {
                    let Some(table) = alloc.take(16 * bufs.len() as u64) else {
                        return false;
                    };
                    for (i, &(a, l, w)) in bufs.iter().enumerate() {
                        write_desc(
                            mem,
                            table + 16 * i as u64,
                            SplitDescriptor::new(a, l, flags(i, w), (i + 1) as u16),
                        );
                    }
                    write_desc(
                        mem,
                        self.desc + u64::from(head) * 16,
                        SplitDescriptor::new(table, 16 * bufs.len() as u32, F_INDIRECT, 0),
                    );
                    self.next_desc = (head + 1) % QSIZE;
                } else {
                    for (i, &(a, l, w)) in bufs.iter().enumerate() {
                        let idx = self.next_desc;
                        let next = (idx + 1) % QSIZE;
                        write_desc(
                            mem,
                            self.desc + u64::from(idx) * 16,
                            SplitDescriptor::new(a, l, flags(i, w), next),
                        );
                        self.next_desc = next;
                    }
                }
                self.take(head, Some(cap), entries);
                self.publish(mem, head);
                true
            }
        }
    }

    fn take(&mut self, head: u16, cap: Option<u64>, entries: u16) {
        self.free -= entries;
        self.posted.insert(head, (cap, entries));
    }

    /// Reads the used ring's new entries and checks each against what was
    /// posted: a known head, and no more bytes than its writable buffers.
    /// With `trusted` false (a raw indirect chain on some queue, see
    /// [`Self::raw_indirect`]) the rings may hold anything: the entries are
    /// consumed (chains they name are freed) but not checked.
    fn check_used(&mut self, mem: &GuestMemoryMmap, what: &str, trusted: bool) {
        let Ok(idx) = mem.read_obj::<u16>(GuestAddress(self.used + 2)) else {
            return;
        };
        let new = idx.wrapping_sub(self.used_seen);
        assert!(
            !trusted || new <= self.avail_idx.wrapping_sub(self.used_seen),
            "{what}: the device used {new} chains but only {} were in flight",
            self.avail_idx.wrapping_sub(self.used_seen)
        );
        while self.used_seen != idx {
            let slot = self.used + 4 + u64::from(self.used_seen % QSIZE) * 8;
            let id: u32 = mem.read_obj(GuestAddress(slot)).unwrap_or(u32::MAX);
            let len: u32 = mem.read_obj(GuestAddress(slot + 4)).unwrap_or(0);
            self.used_seen = self.used_seen.wrapping_add(1);
            let Some((cap, entries)) = u16::try_from(id)
                .ok()
                .and_then(|head| self.posted.remove(&head))
            else {
                assert!(
                    !trusted,
                    "{what}: used ring names chain {id}, which is not in flight"
                );
                continue;
            };
            self.free += entries;
            if let Some(cap) = cap.filter(|_| trusted) {
                assert!(
                    u64::from(len) <= cap,
                    "{what}: chain {id} used with {len} bytes but holds {cap} writable bytes"
                );
            }
        }
    }
}

/// What a vsock TX header carries, the ports from a small set so packets
/// meet each other and the listener.
#[derive(Arbitrary, Debug)]
pub struct VsockHdr {
    src_port: u8,
    dst_port: u8,
    op: u8,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
    /// `None`: the payload's length.
    len: Option<u32>,
    /// Wrong CIDs and types, some of the time.
    odd: Option<(u64, u64, u16)>,
}

/// One step of a vsock script.
#[derive(Arbitrary, Debug)]
pub enum VsockStep {
    /// A packet with a header the script describes, laid out over
    /// descriptors of the given sizes.
    Tx {
        hdr: VsockHdr,
        payload: Vec<u8>,
        splits: Vec<u8>,
        indirect: bool,
    },
    /// Any TX chain.
    TxChain(ChainSpec),
    /// RX buffers.
    Rx(ChainSpec),
    /// Event-queue buffers.
    Event(ChainSpec),
    /// Run the model (host events, TX, RX, event queue).
    Process,
    /// Accept a pending host-side connection on the listener.
    Accept,
    /// Write to accepted host stream `n`.
    HostWrite { n: u8, data: Vec<u8> },
    /// Read what arrived on host stream `n`.
    HostRead { n: u8 },
    /// Close host stream `n`.
    HostClose { n: u8 },
    /// Drop every connection (transport reset).
    Reset,
}

fn vsock_port(sel: u8) -> u32 {
    match sel % 6 {
        0 | 1 => LISTEN_PORT,
        2 => 5000,
        3 => 5001,
        4 => 1024,
        _ => u32::from(sel) << 8,
    }
}

/// Plays a guest driver and a host against a vsock model.
pub fn vsock(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(steps) = Vec::<VsockStep>::arbitrary(&mut u) else {
        return;
    };
    let mem = guest_memory();
    let Ok(host) = VsockHost::new() else { return };
    let Ok(mut model) = VsockModel::new(GUEST_CID, VsockConfig::default(), &host) else {
        return;
    };
    let Ok(listener) = host.listen(LISTEN_PORT) else {
        return;
    };
    let mut rx = DriverQueue::new(&mem, 0);
    let mut tx = DriverQueue::new(&mem, 1);
    let mut ev = DriverQueue::new(&mem, 2);
    let (mut rxq, mut txq, mut evq) = (rx.queue(), tx.queue(), ev.queue());
    let mut alloc = Alloc { next: DATA_BASE };
    let mut streams: Vec<UnixStream> = Vec::new();
    let mut broken = false;
    for step in steps.iter().take(MAX_STEPS) {
        match step {
            VsockStep::Tx {
                hdr,
                payload,
                splits,
                indirect,
            } => {
                let (src_cid, dst_cid, kind) = hdr.odd.unwrap_or((GUEST_CID, VSOCK_HOST_CID, 1));
                let h = Header {
                    src_cid,
                    dst_cid,
                    src_port: vsock_port(hdr.src_port),
                    dst_port: vsock_port(hdr.dst_port),
                    len: hdr.len.unwrap_or(payload.len() as u32),
                    kind,
                    op: u16::from(hdr.op % 9),
                    flags: hdr.flags,
                    buf_alloc: hdr.buf_alloc,
                    fwd_cnt: hdr.fwd_cnt,
                };
                let mut bytes = h.to_bytes().to_vec();
                bytes.extend_from_slice(payload);
                let spec = ChainSpec::Layout {
                    bytes,
                    splits: splits.clone(),
                    writable: Vec::new(),
                    indirect: *indirect,
                };
                tx.post(&mem, &mut alloc, &spec);
            }
            VsockStep::TxChain(spec) => {
                tx.post(&mem, &mut alloc, spec);
            }
            VsockStep::Rx(spec) => {
                rx.post(&mem, &mut alloc, spec);
            }
            VsockStep::Event(spec) => {
                ev.post(&mem, &mut alloc, spec);
            }
            VsockStep::Process => {
                if !broken {
                    // An error means a ring the device can no longer trust:
                    // the device then stops until reset, and so do we.
                    broken = model
                        .process(&mem, &mut rxq, &mut txq, Some(&mut evq))
                        .is_err();
                }
                let trusted = !(rx.raw_indirect || tx.raw_indirect || ev.raw_indirect);
                rx.check_used(&mem, "vsock rx", trusted);
                tx.check_used(&mem, "vsock tx", trusted);
                ev.check_used(&mem, "vsock event", trusted);
            }
            VsockStep::Accept => {
                if let Ok(Some(s)) = listener.try_accept() {
                    let _ = s.set_nonblocking(true);
                    streams.push(s);
                }
            }
            VsockStep::HostWrite { n, data } => {
                if let Some(s) = pick(&mut streams, *n) {
                    let _ = s.write(data);
                }
            }
            VsockStep::HostRead { n } => {
                if let Some(s) = pick(&mut streams, *n) {
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf);
                }
            }
            VsockStep::HostClose { n } => {
                if !streams.is_empty() {
                    let i = usize::from(*n) % streams.len();
                    drop(streams.swap_remove(i));
                }
            }
            VsockStep::Reset => model.reset_transport(),
        }
    }
}

fn pick(streams: &mut [UnixStream], n: u8) -> Option<&mut UnixStream> {
    if streams.is_empty() {
        return None;
    }
    let i = usize::from(n) % streams.len();
    streams.get_mut(i)
}

/// A scratch directory for one input, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Option<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("cowork-fuzz-{what}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).ok()?;
        Some(Self(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A blk script: the request chains, served from a raw image.
#[derive(Arbitrary, Debug)]
pub struct BlkScript {
    /// Unused. Its byte once chose a copy-on-write overlay (removed with the
    /// overlay); it stays so the committed corpus, picked with it, still
    /// decodes to the chains it was picked for.
    _retired_backend_choice: bool,
    read_only: bool,
    chains: Vec<ChainSpec>,
}

/// Serves request chains against a raw image, writable or read-only.
pub fn blk(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(script) = BlkScript::arbitrary(&mut u) else {
        return;
    };
    let Some(dir) = Scratch::new("blk") else {
        return;
    };
    let base = dir.0.join("base.img");
    if std::fs::write(&base, base_image()).is_err() {
        return;
    }
    // Request parsing over the real queue.
    let backend: Box<dyn BlockBackend> = if script.read_only {
        match RawImage::open_read_only(&base) {
            Ok(r) => Box::new(r),
            Err(_) => return,
        }
    } else {
        match RawImage::open(&base) {
            Ok(r) => Box::new(r),
            Err(_) => return,
        }
    };
    let mem = guest_memory();
    let Ok(mut model) = BlkModel::new(backend, &BlkConfig::new("fuzz-serial")) else {
        return;
    };
    let mut drv = DriverQueue::new(&mem, 0);
    let mut q = drv.queue();
    let mut alloc = Alloc { next: DATA_BASE };
    for chunk in script.chains.chunks(8).take(MAX_STEPS / 8) {
        for spec in chunk {
            drv.post(&mem, &mut alloc, spec);
        }
        if model.process_queue(&mem, &mut q).is_err() {
            break;
        }
        let trusted = !drv.raw_indirect;
        drv.check_used(&mem, "blk", trusted);
    }
}

/// Content of the base image: sector `n` filled with `n ^ 0x5a`. Built once
/// per process (a per-byte loop over the disk at every input cost more than
/// the requests themselves under coverage instrumentation).
fn base_image() -> &'static [u8] {
    static BASE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BASE.get_or_init(|| (0..DISK_SIZE).map(|i| (i / SECTOR) as u8 ^ 0x5a).collect())
}

/// A virtio-fs script: which options the filesystem has, then the FUSE
/// request chains on the high-priority queue or a request queue.
#[derive(Arbitrary, Debug)]
pub struct FsScript {
    xattr: bool,
    chains: Vec<(bool, ChainSpec)>,
}

/// Content of the host file outside every grant.
const OUTSIDE_SECRET: &[u8] = b"host secret";

/// Builds the host tree of one fs input:
///
/// ```text
/// <dir>/host/pre.txt, host/sub/inner.txt, host/rel_out -> ../outside/secret.txt
/// <dir>/outside/secret.txt (0600)
/// ```
fn fs_fixture(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let host = dir.join("host");
    std::fs::create_dir_all(host.join("sub"))?;
    std::fs::create_dir_all(dir.join("outside"))?;
    std::fs::write(host.join("pre.txt"), b"pre-existing")?;
    std::fs::write(host.join("sub/inner.txt"), b"inner")?;
    let secret = dir.join("outside/secret.txt");
    std::fs::write(&secret, OUTSIDE_SECRET)?;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600))?;
    std::os::unix::fs::symlink("../outside/secret.txt", host.join("rel_out"))?;
    Ok(())
}

/// Serves FUSE requests in descriptor chains through the virtio-fs server
/// over a [`SessionFs`] with three grants of the same host directory (`ro`,
/// `rw`, `rwd`) and one of a single file; afterwards the file outside every
/// grant must be unchanged.
pub fn fs(data: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    let mut u = Unstructured::new(data);
    let Ok(script) = FsScript::arbitrary(&mut u) else {
        return;
    };
    let Some(dir) = Scratch::new("fs") else {
        return;
    };
    if fs_fixture(&dir.0).is_err() {
        return;
    }
    let host = dir.0.join("host");
    let fs = SessionFs::new(SessionFsOptions {
        xattr: script.xattr,
        ..Default::default()
    });
    for (name, mode) in [
        ("ro", GrantMode::Ro),
        ("rw", GrantMode::Rw),
        ("rwd", GrantMode::Rwd),
    ] {
        if fs.add_grant("s1", name, &host, mode).is_err() {
            return;
        }
    }
    if fs
        .add_grant("s2", "one", &host.join("pre.txt"), GrantMode::Rw)
        .is_err()
    {
        return;
    }
    let server = fuse_backend_rs::api::server::Server::new(Arc::new(fs));
    let stats = FsDeviceStats::default();
    let budget = AtomicU32::new(0);
    let mem = guest_memory();
    let mut queues = [DriverQueue::new(&mem, 0), DriverQueue::new(&mem, 1)];
    let mut qs = [queues[0].queue(), queues[1].queue()];
    let mut alloc = Alloc { next: DATA_BASE };
    for (hiprio, spec) in script.chains.iter().take(MAX_STEPS) {
        let i = usize::from(!*hiprio);
        if !queues[i].post(&mem, &mut alloc, spec) {
            continue;
        }
        let index = i as u16;
        let served = vmm::virtio::drain(
            &mut qs[i],
            &mem,
            |source| WorkerError::Queue { index, source },
            |chain| serve_chain(&server, &mem, chain, index, &stats, &budget),
            |_, source| Err(WorkerError::Queue { index, source }),
        );
        match served {
            Ok(_) => {
                let trusted = !queues.iter().any(|q| q.raw_indirect);
                queues[i].check_used(&mem, "virtio-fs", trusted);
            }
            Err(e @ WorkerError::ServerPanic { .. }) => panic!("virtio-fs: {e}"),
            Err(_) => break,
        }
    }
    let secret = dir.0.join("outside/secret.txt");
    let content = std::fs::read(&secret).unwrap_or_default();
    assert_eq!(
        content, OUTSIDE_SECRET,
        "the file outside the grants changed"
    );
    let mode = std::fs::symlink_metadata(&secret)
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap_or(0);
    assert_eq!(
        mode, 0o600,
        "the mode of the file outside the grants changed"
    );
}
