//! The in-process virtio-fs device (virtio 1.2 §5.11) serving a
//! [`SessionFs`] to the guest through the vmm's virtio transport.
//!
//! Queue 0 is the high-priority queue (the Linux driver sends FORGET,
//! BATCH_FORGET and INTERRUPT there), queues 1..=N are request queues. Every
//! descriptor chain of either kind is parsed by fuse-backend-rs's virtiofs
//! transport (`Reader` over the device-readable descriptors, `VirtioFsWriter`
//! over the device-writable ones) and answered by its `Server`; the chain is
//! then put in the used ring with the number of bytes written, and the
//! driver is signalled through [`VirtioInterrupt`] when the ring's
//! notification suppression asks for it.
//!
//! Config space (little-endian, [`CONFIG_SIZE`] bytes, read-only):
//! * `0x00` `tag`: UTF-8 filesystem tag, NUL-padded to [`TAG_LEN`] bytes (the
//!   guest mounts it with `mount -t virtiofs <tag> <dir>`);
//! * `0x24` `num_request_queues` (u32).
//!
//! A malformed chain (buffers outside guest memory, a truncated or garbage
//! FUSE message) is completed with a used length of 0 and counted; the
//! device keeps serving. A malformed available ring, or a panic inside the
//! FUSE server (caught), makes the worker report
//! [`VirtioInterrupt::signal_needs_reset`] and stop until the driver resets
//! the device. A reset also ends the FUSE session (DESTROY semantics), so
//! the driver's next INIT starts from a clean state.
//!
//! Snapshots: pausing stops the worker without ending the FUSE session;
//! nothing beyond the queues is saved. A restored VM's device is built
//! around the new start's [`SessionFs`] (its own grant table), so the
//! snapshot must be taken before the guest mounted the share: a FUSE
//! session (INIT, inodes, open files) does not survive a snapshot.
//!
//! Limits: one worker thread serves all queues, one request at a time; no
//! DAX window (no shared-memory region) and no notification queue
//! (`VIRTIO_FS_F_NOTIFICATION` is not offered).

use std::io;
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use fuse_backend_rs::api::filesystem::FileSystem;
use fuse_backend_rs::api::server::Server;
use fuse_backend_rs::transport::{Reader, VirtioFsWriter, Writer};
use tracing::{error, info, warn};
use virtio_queue::{DescriptorChain, Queue};
use vm_memory::{Address, Bytes};
use vmm::seccomp::ThreadClass;
use vmm::virtio::in_process::{DeviceCommon, InProcessDevice};
use vmm::virtio::worker::{DeviceWorker, Wakeup, WorkerLoop, WorkerSetup};
use vmm::virtio::{
    drain, features, ActivateError, ActiveQueue, DeviceStateError, GuestMemoryMmap, VirtioInterrupt,
};

use super::SessionFs;

/// Virtio device ID of a filesystem device.
pub const FS_DEVICE_ID: u32 = 26;
/// Size of the `tag` field of the config space.
pub const TAG_LEN: usize = 36;
/// Size of the config space: tag + `num_request_queues`.
pub const CONFIG_SIZE: usize = TAG_LEN + 4;
/// Index of the high-priority queue.
pub const HIPRIO_QUEUE: u16 = 0;
/// Index of the first request queue.
pub const FIRST_REQUEST_QUEUE: u16 = 1;
/// Maximum size of every queue (the Linux driver uses what it is offered).
pub const QUEUE_SIZE: u16 = 1024;
/// Most request queues a device may declare.
pub const MAX_REQUEST_QUEUES: u16 = 16;
/// The tag our guest agent mounts (ours, not the official helper's
/// `claudeshared`, whose share is the whole host root with another layout).
pub const DEFAULT_TAG: &str = "cowork-sessions";
/// How many malformed-chain messages a device logs at warning level before
/// going quiet (debug level), so a hostile driver cannot flood the host log.
pub const MALFORMED_LOG_BUDGET: u32 = 32;

/// epoll token of the queue at position 0 of those the driver enabled;
/// position `i` uses `i + 1` (0 is the worker's stop eventfd).
const TOKEN_FIRST_QUEUE: u64 = 1;

/// Why a device could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FsDeviceError {
    /// The tag is empty.
    #[error("virtio-fs tag must not be empty")]
    EmptyTag,
    /// The tag does not fit the config space.
    #[error("virtio-fs tag {tag:?} is {len} bytes; at most {TAG_LEN} fit the config space")]
    TagTooLong {
        /// The refused tag.
        tag: String,
        /// Its length in bytes.
        len: usize,
    },
    /// The tag contains NUL (it is NUL-padded in config space).
    #[error("virtio-fs tag {0:?} contains NUL")]
    NulInTag(String),
    /// Request queue count out of range.
    #[error("virtio-fs needs 1..={MAX_REQUEST_QUEUES} request queues, not {0}")]
    RequestQueues(u16),
}

/// Counters a device keeps (since it was built).
#[derive(Debug)]
pub struct FsDeviceStats {
    /// Descriptor chains completed (answered or not).
    pub chains: AtomicU64,
    /// Chains completed with length 0 because they could not be parsed or
    /// the FUSE message in them was malformed.
    pub malformed: AtomicU64,
    /// Times the worker gave up and asked for a device reset.
    pub needs_reset: AtomicU64,
    /// Requests seen per FUSE opcode (index = opcode; opcodes at or above
    /// [`OPCODE_SLOTS`] count in the last slot). Read by benchmarks and
    /// `fs-vhost-user` to see what a workload costs in round trips.
    pub opcodes: [AtomicU64; OPCODE_SLOTS],
}

/// Slots of [`FsDeviceStats::opcodes`]: FUSE opcodes run to 52
/// (`FUSE_STATX`) in Linux 6.x; anything above shares the last slot.
pub const OPCODE_SLOTS: usize = 64;

impl Default for FsDeviceStats {
    fn default() -> Self {
        Self {
            chains: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            needs_reset: AtomicU64::new(0),
            opcodes: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl FsDeviceStats {
    /// `(opcode, count)` for every opcode seen, most frequent first.
    pub fn opcode_counts(&self) -> Vec<(usize, u64)> {
        let mut v: Vec<(usize, u64)> = self
            .opcodes
            .iter()
            .enumerate()
            .map(|(op, n)| (op, n.load(Ordering::Relaxed)))
            .filter(|&(_, n)| n > 0)
            .collect();
        v.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
        v
    }
}

/// The virtio-fs device model.
pub struct FsDevice {
    /// First, so it is stopped before the rest is dropped. Hands the
    /// queues back when stopped.
    worker: DeviceWorker<Vec<ActiveQueue>>,
    /// Set while the worker is being paused rather than stopped: it then
    /// leaves the FUSE session alone.
    pausing: Arc<AtomicBool>,
    /// Config space: the tag and the request queue count.
    common: DeviceCommon,
    fs: Arc<SessionFs>,
    server: Arc<Server<Arc<SessionFs>>>,
    stats: Arc<FsDeviceStats>,
    log_budget: Arc<AtomicU32>,
}

impl FsDevice {
    /// A device exporting `fs` under `tag` with `request_queues` request
    /// queues (plus the high-priority queue).
    pub fn new(tag: &str, request_queues: u16, fs: Arc<SessionFs>) -> Result<Self, FsDeviceError> {
        if tag.is_empty() {
            return Err(FsDeviceError::EmptyTag);
        }
        if tag.len() > TAG_LEN {
            return Err(FsDeviceError::TagTooLong {
                tag: tag.to_string(),
                len: tag.len(),
            });
        }
        if tag.contains('\0') {
            return Err(FsDeviceError::NulInTag(tag.to_string()));
        }
        if request_queues == 0 || request_queues > MAX_REQUEST_QUEUES {
            return Err(FsDeviceError::RequestQueues(request_queues));
        }
        let mut config = [0u8; CONFIG_SIZE];
        config[..tag.len()].copy_from_slice(tag.as_bytes());
        config[TAG_LEN..].copy_from_slice(&u32::from(request_queues).to_le_bytes());
        Ok(Self {
            // File system calls: the class with the file table.
            worker: DeviceWorker::with_class("virtio-fs", ThreadClass::FsWorker),
            pausing: Arc::default(),
            common: DeviceCommon::new(
                "virtio-fs",
                FS_DEVICE_ID,
                vec![QUEUE_SIZE; usize::from(request_queues) + 1],
                features::VERSION_1 | features::RING_EVENT_IDX | features::RING_INDIRECT_DESC,
                config,
            ),
            server: Arc::new(Server::new(fs.clone())),
            fs,
            stats: Arc::default(),
            log_budget: Arc::new(AtomicU32::new(MALFORMED_LOG_BUDGET)),
        })
    }

    /// The exported filesystem (add and remove grants through it).
    pub fn fs(&self) -> &Arc<SessionFs> {
        &self.fs
    }

    /// The device's counters.
    pub fn stats(&self) -> Arc<FsDeviceStats> {
        self.stats.clone()
    }

    /// Features the driver accepted at the last FEATURES_OK.
    pub fn acked_features(&self) -> u64 {
        self.common.acked_features()
    }

    /// Whether a worker is running.
    pub fn is_active(&self) -> bool {
        self.worker.is_running()
    }
}

impl InProcessDevice for FsDevice {
    fn common(&self) -> &DeviceCommon {
        &self.common
    }

    fn common_mut(&mut self) -> &mut DeviceCommon {
        &mut self.common
    }

    fn start(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        if self.worker.is_running() {
            return Err(ActivateError::AlreadyActive);
        }
        let declared = self.common.queue_max_sizes().len();
        let queues: Vec<ActiveQueue> = queues
            .into_iter()
            .filter(|q| usize::from(q.index) < declared)
            .collect();
        for required in [HIPRIO_QUEUE, FIRST_REQUEST_QUEUE] {
            if !queues.iter().any(|q| q.index == required) {
                return Err(ActivateError::MissingQueue { index: required });
            }
        }
        let setup = WorkerSetup::new()?;
        for (pos, q) in queues.iter().enumerate() {
            setup.add(q.notify.as_raw_fd(), pos as u64 + TOKEN_FIRST_QUEUE)?;
        }
        let ctx = WorkerCtx {
            mem,
            interrupt,
            queues,
            server: self.server.clone(),
            stats: self.stats.clone(),
            log_budget: self.log_budget.clone(),
            fs: self.fs.clone(),
            pausing: self.pausing.clone(),
        };
        self.worker
            .start("virtio-fs", setup, move |worker| ctx.run(worker))
            .map_err(ActivateError::Worker)?;
        info!(
            tag = %String::from_utf8_lossy(self.common.config().get(..TAG_LEN).unwrap_or_default())
                .trim_end_matches('\0'),
            "virtio-fs device activated"
        );
        Ok(())
    }

    fn stop(&mut self) -> bool {
        // The worker ends the FUSE session before it returns.
        let stopped = self.worker.stop().is_ok();
        if stopped {
            info!("virtio-fs device reset");
        }
        stopped
    }

    fn pause_worker(&mut self) -> Result<Vec<ActiveQueue>, DeviceStateError> {
        self.pausing.store(true, Ordering::SeqCst);
        let stopped = self.worker.stop();
        self.pausing.store(false, Ordering::SeqCst);
        match stopped {
            Ok(queues) => Ok(queues.unwrap_or_default()),
            Err(e) => Err(DeviceStateError::Stop {
                device: "virtio-fs",
                reason: e.to_string(),
            }),
        }
    }
}

/// Why the worker stopped serving.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WorkerError {
    #[error("virtqueue {index}: {source}")]
    Queue {
        index: u16,
        source: virtio_queue::Error,
    },
    #[error("the FUSE server panicked on a request from virtqueue {index}")]
    ServerPanic { index: u16 },
    #[error("epoll failed: {0}")]
    Epoll(io::Error),
}

struct WorkerCtx {
    mem: GuestMemoryMmap,
    interrupt: Arc<dyn VirtioInterrupt>,
    queues: Vec<ActiveQueue>,
    server: Arc<Server<Arc<SessionFs>>>,
    stats: Arc<FsDeviceStats>,
    log_budget: Arc<AtomicU32>,
    /// Destroyed (the FUSE session ended) when the worker is stopped.
    fs: Arc<SessionFs>,
    /// Set when the worker is paused, not stopped: the session stays.
    pausing: Arc<AtomicBool>,
}

impl WorkerCtx {
    /// Serves until stopped; hands the queues back.
    fn run(mut self, worker: WorkerLoop) -> Vec<ActiveQueue> {
        let events = self.queues.len() + 1;
        if let Err(e) = worker.serve(events, WorkerError::Epoll, |w| self.on_wakeup(w)) {
            error!("virtio-fs: {e}; the device needs a reset");
            self.stats.needs_reset.fetch_add(1, Ordering::Relaxed);
            worker.park_needs_reset("virtio-fs", self.interrupt.as_ref());
        }
        // Stopped (device reset or VM end): end the FUSE session as DESTROY
        // would, so open files and inodes of this driver instance are
        // released. Here rather than in `stop`, which runs on the vCPU that
        // wrote the status register: re-importing the grant roots opens
        // files, which only this thread's seccomp class may do. Not when
        // paused: the driver's session goes on after the resume.
        if !self.pausing.load(Ordering::SeqCst) {
            FileSystem::destroy(&*self.fs);
        }
        self.queues
    }

    fn on_wakeup(&mut self, wakeup: Wakeup) -> Result<(), WorkerError> {
        let Wakeup::Ready(token) = wakeup else {
            return Ok(());
        };
        let Some(pos) = token
            .checked_sub(TOKEN_FIRST_QUEUE)
            .and_then(|p| usize::try_from(p).ok())
            .filter(|p| *p < self.queues.len())
        else {
            return Ok(());
        };
        // Reset the counter; EAGAIN only means a spurious wakeup.
        let _ = self.queues[pos].notify.read();
        self.process(pos)
    }

    /// Serves every available chain of the queue at `pos`.
    fn process(&mut self, pos: usize) -> Result<(), WorkerError> {
        let mem = &self.mem;
        let aq = &mut self.queues[pos];
        let index = aq.index;
        let q: &mut Queue = &mut aq.queue;
        let qerr = |source| WorkerError::Queue { index, source };
        let (server, stats, budget) = (&self.server, &self.stats, &self.log_budget);
        let notify = drain(
            q,
            mem,
            qerr,
            |chain| {
                let len = serve_chain(server, mem, chain, index, stats, budget)?;
                stats.chains.fetch_add(1, Ordering::Relaxed);
                Ok(len)
            },
            |_, e| Err(qerr(e)),
        )?;
        if notify {
            if let Err(e) = self.interrupt.signal_used_queue(index) {
                warn!("virtio-fs: cannot signal virtqueue {index}: {e}");
            }
        }
        Ok(())
    }
}

/// Answers the FUSE request in `chain`; returns the used length (bytes
/// written to the device-writable buffers, 0 for a malformed chain).
pub(crate) fn serve_chain(
    server: &Server<Arc<SessionFs>>,
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
    index: u16,
    stats: &FsDeviceStats,
    budget: &AtomicU32,
) -> Result<u32, WorkerError> {
    let malformed = |what: &str, err: &dyn std::fmt::Display| {
        stats.malformed.fetch_add(1, Ordering::Relaxed);
        vmm::guest_log!(
            budget,
            warn,
            queue = index,
            "virtio-fs: malformed request ({what}): {err}"
        );
        0
    };
    let reader = match Reader::from_descriptor_chain(mem, chain.clone()) {
        Ok(r) => r,
        Err(e) => return Ok(malformed("readable buffers", &e)),
    };
    count_opcode(mem, &chain, stats);
    let writer = match VirtioFsWriter::new(mem, chain) {
        Ok(w) => w,
        Err(e) => return Ok(malformed("writable buffers", &e)),
    };
    let result = catch_unwind(AssertUnwindSafe(|| {
        server.handle_message(reader, Writer::VirtioFs(writer), None, None)
    }));
    match result {
        Ok(Ok(written)) => Ok(u32::try_from(written).unwrap_or(u32::MAX)),
        Ok(Err(e)) => Ok(malformed("FUSE message", &e)),
        Err(_) => Err(WorkerError::ServerPanic { index }),
    }
}

/// Offset of `opcode` in `struct fuse_in_header` (after the `u32` length).
const IN_HEADER_OPCODE_OFFSET: u64 = 4;

/// Counts the request's opcode when the chain's first descriptor holds the
/// start of the FUSE header (as every driver lays it out); otherwise counts
/// nothing; the server parses and judges the message itself.
fn count_opcode(
    mem: &GuestMemoryMmap,
    chain: &DescriptorChain<&GuestMemoryMmap>,
    stats: &FsDeviceStats,
) {
    let Some(first) = chain.clone().next() else {
        return;
    };
    if first.is_write_only() || first.len() < 8 {
        return;
    }
    let Some(addr) = first.addr().checked_add(IN_HEADER_OPCODE_OFFSET) else {
        return;
    };
    if let Ok(op) = mem.read_obj::<u32>(addr) {
        let slot = usize::try_from(u32::from_le(op))
            .unwrap_or(OPCODE_SLOTS - 1)
            .min(OPCODE_SLOTS - 1);
        stats.opcodes[slot].fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
