//! virtio-balloon (virtio 1.2 §5.5) reduced to what gives a VM's memory
//! back to the host: free page reporting (`VIRTIO_BALLOON_F_PAGE_REPORTING`).
//!
//! With free page reporting the guest kernel tells the device, a while
//! after it freed them, about large runs of free pages (on x86_64 Linux
//! reports runs of one pageblock, 2 MiB, or more): every available chain of
//! the reporting queue is a list of such runs, one per descriptor (address
//! and length, no payload). The device hands each run to a
//! [`MemoryReleaser`], which drops the host pages behind it (see
//! [`release::HostMappingReleaser`]), and returns the chain (used length 0).
//! The guest does not touch a reported run until the chain is back and will
//! simply fault fresh zero pages in when it allocates it again.
//!
//! Every run is guest input: [`BalloonModel`] clips it to whole host pages
//! inside guest memory ([`clip_report`]: start rounded up and end rounded
//! down to [`PAGE_SIZE`], at most [`MAX_RANGE_BYTES`] per descriptor, split
//! at region boundaries, anything outside guest memory dropped), so the
//! releaser only ever sees page-aligned, non-empty ranges inside one region.
//! A guest that lies about what is free only loses its own data.
//!
//! The spec's inflate and deflate queues are there (a driver needs them), but
//! the device never asks for pages: the target (`num_pages`) stays 0, so a
//! well-behaved driver never inflates, and chains a driver puts on either
//! queue anyway are returned unread. Queue indices follow what drivers do in
//! practice: absent optional queues take no index, so without the stats and
//! free-page-hint features the reporting queue is index
//! [`REPORTING_QUEUE`] = 2.
//!
//! [`BalloonDevice`] is the in-process face for the vmm's virtio-mmio
//! transport; it knows nothing of KVM (the releaser works on the host
//! mapping of guest memory).
//!
//! Snapshots: pausing stops the worker (no chain is ever held across a
//! pass, so nothing is in flight) and hands the queues back; the saved
//! state is the counters ([`BalloonStats`]), which go on in the restored
//! device. Releasing memory in a restored VM, whose RAM is a private
//! mapping of the snapshot file, maps fresh anonymous memory over the
//! range (see [`release`]): the file's pages must not come back.
//!
//! Limits: no statistics queue, no free page hinting, no page poisoning
//! (`VIRTIO_BALLOON_F_PAGE_POISON`: a guest booted with `init_on_free` or
//! page poisoning does not report), no inflation (the config space is
//! read-only and `num_pages` is always 0); no vhost-user face (QEMU has a
//! balloon of its own).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::{error, info};
use virtio_queue::{DescriptorChain, Queue};
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryRegion};
use vmm::guest_log;
use vmm::virtio::in_process::{DeviceCommon, InProcessDevice};
use vmm::virtio::state::{self, DeviceStateError};
use vmm::virtio::worker::{DeviceWorker, Wakeup, WorkerLoop, WorkerSetup};
use vmm::virtio::{drain, features, ActivateError, ActiveQueue, GuestMemoryMmap, VirtioInterrupt};

pub mod release;

#[cfg(test)]
mod tests;

pub use release::{HostMappingReleaser, ReleaseError};

/// Virtio device ID of a traditional memory balloon.
pub const VIRTIO_ID_BALLOON: u32 = 5;
/// Feature bit: the device may be deflated when the guest runs out of
/// memory (not offered: nothing is ever inflated).
pub const VIRTIO_BALLOON_F_DEFLATE_ON_OOM: u32 = 2;
/// Feature bit of free page reporting (virtio 1.2 §5.5.3).
pub const VIRTIO_BALLOON_F_PAGE_REPORTING: u32 = 5;
/// Index of the inflate queue.
pub const INFLATE_QUEUE: u16 = 0;
/// Index of the deflate queue.
pub const DEFLATE_QUEUE: u16 = 1;
/// Index of the reporting queue when only `PAGE_REPORTING` of the optional
/// queue features is negotiated (Linux and QEMU number only the queues that
/// exist).
pub const REPORTING_QUEUE: u16 = 2;
/// Maximum size of each queue. Linux keeps one reporting chain in flight
/// and inflates a page array of at most 256 entries per chain.
pub const QUEUE_SIZE: u16 = 128;
/// Number of queues offered (inflate, deflate, reporting).
pub const NUM_QUEUES: usize = 3;
/// The balloon's unit and the granularity of every release: the host's base
/// page size on x86_64 (reported runs are multiples of it; a run that is
/// not is shrunk to the whole pages inside it).
pub const PAGE_SIZE: u64 = 4096;
/// Largest run accepted from one descriptor; the rest of a longer one is
/// ignored. Linux reports at most one maximal buddy block (4 MiB on
/// x86_64) per descriptor; the bound keeps one chain's work (32 descriptors
/// for Linux, at most [`QUEUE_SIZE`] here) short whatever the guest claims.
pub const MAX_RANGE_BYTES: u64 = 256 << 20;
/// Size of the config space: `num_pages` and `actual`, both le32 (the
/// fields after them exist only with features this device does not offer).
pub const CONFIG_SIZE: usize = 8;
/// Guest-triggered warnings (bad runs, failed releases) logged at warn level
/// per device before further ones go to debug.
const LOG_BUDGET: u32 = 16;
/// epoll token of queue `i` is `TOKEN_QUEUE_BASE + i` (0 is the stop
/// eventfd's).
const TOKEN_QUEUE_BASE: u64 = 1;
/// Most epoll events the worker takes per wait: the stop eventfd and the
/// three queues.
const WORKER_EVENTS: usize = NUM_QUEUES + 1;

/// Errors of the balloon device.
#[derive(Debug, thiserror::Error)]
pub enum BalloonError {
    /// The available ring could not be read: the queue is broken and the
    /// device needs a reset.
    #[error("virtqueue {index} is unusable: {source}; the guest driver must reset the device")]
    Queue {
        /// Queue index.
        index: u16,
        /// virtio-queue error.
        source: virtio_queue::Error,
    },
    /// The worker's epoll wait failed.
    #[error("epoll_wait failed: {0}")]
    Epoll(#[source] std::io::Error),
}

/// Gives the host memory behind a range of guest memory back to the host.
/// The guest will read zeroes there the next time it touches it.
pub trait MemoryReleaser: Send + Sync {
    /// Releases `[gpa, gpa + len)` of `mem`. The device only calls it with
    /// `len > 0`, both `gpa` and `len` multiples of [`PAGE_SIZE`], and the
    /// whole range inside one region of `mem`.
    fn release(
        &self,
        mem: &GuestMemoryMmap,
        gpa: GuestAddress,
        len: u64,
    ) -> Result<(), ReleaseError>;
}

/// What a queue is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueRole {
    /// Pages the guest gives up (returned unread: nothing is asked for).
    Inflate,
    /// Pages the guest takes back (returned unread).
    Deflate,
    /// Free page reports.
    Reporting,
}

impl QueueRole {
    /// The role of queue `index` when `reporting` (PAGE_REPORTING) was
    /// negotiated; `None` for an index the device has no use for.
    pub fn of(index: u16, reporting: bool) -> Option<Self> {
        match index {
            INFLATE_QUEUE => Some(Self::Inflate),
            DEFLATE_QUEUE => Some(Self::Deflate),
            REPORTING_QUEUE if reporting => Some(Self::Reporting),
            _ => None,
        }
    }

    fn index(self) -> u16 {
        match self {
            Self::Inflate => INFLATE_QUEUE,
            Self::Deflate => DEFLATE_QUEUE,
            Self::Reporting => REPORTING_QUEUE,
        }
    }
}

/// Counters of a device (they survive resets).
#[derive(Debug, Default)]
pub struct BalloonStats {
    /// Reporting chains returned.
    pub reports: AtomicU64,
    /// Ranges handed to the releaser.
    pub ranges_released: AtomicU64,
    /// Bytes handed to the releaser successfully.
    pub bytes_released: AtomicU64,
    /// Reported descriptors (or parts of them) that were dropped: outside
    /// guest memory, less than a page, beyond [`MAX_RANGE_BYTES`].
    pub rejected: AtomicU64,
    /// Releases the releaser refused.
    pub release_failures: AtomicU64,
    /// Inflate or deflate chains returned unread.
    pub ignored_chains: AtomicU64,
}

/// [`BalloonStats`] as a snapshot saves them.
#[derive(Debug, Default, Serialize, Deserialize)]
struct SavedStats {
    reports: u64,
    ranges_released: u64,
    bytes_released: u64,
    rejected: u64,
    release_failures: u64,
    ignored_chains: u64,
}

impl BalloonStats {
    fn saved(&self) -> SavedStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SavedStats {
            reports: get(&self.reports),
            ranges_released: get(&self.ranges_released),
            bytes_released: get(&self.bytes_released),
            rejected: get(&self.rejected),
            release_failures: get(&self.release_failures),
            ignored_chains: get(&self.ignored_chains),
        }
    }

    fn set_saved(&self, s: &SavedStats) {
        let set = |c: &AtomicU64, v: u64| c.store(v, Ordering::Relaxed);
        set(&self.reports, s.reports);
        set(&self.ranges_released, s.ranges_released);
        set(&self.bytes_released, s.bytes_released);
        set(&self.rejected, s.rejected);
        set(&self.release_failures, s.release_failures);
        set(&self.ignored_chains, s.ignored_chains);
    }
}

/// The page-aligned pieces of a reported run `[addr, addr + len)` that lie
/// in guest memory, each inside one region, in address order, at most
/// [`MAX_RANGE_BYTES`] in all; and whether anything of the run was dropped
/// (a partial page at either end, a part outside guest memory, or beyond
/// the bound). Never panics, whatever the numbers.
pub fn clip_report(mem: &GuestMemoryMmap, addr: u64, len: u64) -> (Vec<(GuestAddress, u64)>, bool) {
    let mut pieces = Vec::new();
    let capped = len.min(MAX_RANGE_BYTES);
    let mut dropped = capped != len;
    let Some(end) = addr.checked_add(capped) else {
        return (pieces, true);
    };
    let Some(start) = addr.checked_next_multiple_of(PAGE_SIZE) else {
        return (pieces, true);
    };
    let end = end - end % PAGE_SIZE;
    if start != addr || end != addr.saturating_add(capped) {
        dropped = true;
    }
    let mut cur = start;
    while cur < end {
        let Some(region) = mem.find_region(GuestAddress(cur)) else {
            // Outside memory here; skip to the next region that starts
            // before `end`, if any.
            dropped = true;
            match mem
                .iter()
                .map(|r| r.start_addr().0)
                .filter(|&s| s > cur && s < end)
                .min()
            {
                Some(next) => {
                    cur = next;
                    continue;
                }
                None => break,
            }
        };
        let region_end = region.start_addr().0.saturating_add(region.len());
        let piece_end = end.min(region_end);
        // Regions start and end on page boundaries in our layout; stay
        // aligned even if one does not.
        let piece_end = piece_end - piece_end % PAGE_SIZE;
        if piece_end <= cur {
            dropped = true;
            break;
        }
        pieces.push((GuestAddress(cur), piece_end - cur));
        cur = piece_end;
    }
    (pieces, dropped)
}

/// The balloon model: serves one of the device's queues at a time.
pub struct BalloonModel {
    releaser: Arc<dyn MemoryReleaser>,
    stats: Arc<BalloonStats>,
    log_budget: Arc<AtomicU32>,
}

impl BalloonModel {
    /// A model handing reported runs to `releaser`.
    pub fn new(releaser: Arc<dyn MemoryReleaser>) -> Self {
        Self {
            releaser,
            stats: Arc::default(),
            log_budget: Arc::new(AtomicU32::new(LOG_BUDGET)),
        }
    }

    /// Device feature bits.
    pub fn features(&self) -> u64 {
        features::VERSION_1
            | features::RING_EVENT_IDX
            | features::RING_INDIRECT_DESC
            | 1 << VIRTIO_BALLOON_F_PAGE_REPORTING
    }

    /// Counters.
    pub fn stats(&self) -> Arc<BalloonStats> {
        self.stats.clone()
    }

    /// Serves every available chain of `q`, which plays `role`. Returns
    /// whether the driver needs a used-buffer notification.
    pub fn process_queue(
        &mut self,
        role: QueueRole,
        mem: &GuestMemoryMmap,
        q: &mut Queue,
    ) -> Result<bool, BalloonError> {
        let index = role.index();
        let qerr = |source| BalloonError::Queue { index, source };
        let budget = self.log_budget.clone();
        drain(
            q,
            mem,
            qerr,
            |chain| {
                match role {
                    QueueRole::Reporting => {
                        self.report(mem, chain);
                        self.stats.reports.fetch_add(1, Ordering::Relaxed);
                    }
                    QueueRole::Inflate | QueueRole::Deflate => {
                        self.stats.ignored_chains.fetch_add(1, Ordering::Relaxed);
                        guest_log!(
                            &self.log_budget,
                            warn,
                            queue = index,
                            "balloon: chain on the {role:?} queue returned unread (the target is 0 pages)"
                        );
                    }
                }
                Ok(0)
            },
            |head, e| {
                guest_log!(
                    &budget,
                    warn,
                    "balloon: cannot return chain {head} of queue {index}: {e}"
                );
                Ok(())
            },
        )
    }

    /// Releases every run the chain reports (its descriptors' direction
    /// does not matter: Linux posts them device-writable).
    fn report(&self, mem: &GuestMemoryMmap, chain: DescriptorChain<&GuestMemoryMmap>) {
        for desc in chain {
            let (pieces, dropped) = clip_report(mem, desc.addr().0, u64::from(desc.len()));
            if dropped {
                self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                guest_log!(
                    &self.log_budget,
                    warn,
                    addr = desc.addr().0,
                    len = desc.len(),
                    "balloon: reported run not wholly made of guest pages; only its whole pages inside guest memory are released"
                );
            }
            for (gpa, len) in pieces {
                self.stats.ranges_released.fetch_add(1, Ordering::Relaxed);
                match self.releaser.release(mem, gpa, len) {
                    Ok(()) => {
                        self.stats.bytes_released.fetch_add(len, Ordering::Relaxed);
                    }
                    Err(e) => {
                        self.stats.release_failures.fetch_add(1, Ordering::Relaxed);
                        guest_log!(&self.log_budget, warn, gpa = gpa.0, len, "balloon: {e}");
                    }
                }
            }
        }
    }
}

/// The in-process face: a [`VirtioDevice`] for the vmm's virtio-mmio
/// transport, serving its queues on its own thread while active.
///
/// [`VirtioDevice`]: vmm::virtio::VirtioDevice
pub struct BalloonDevice {
    /// First, so it is stopped before the rest is dropped. Hands the
    /// queues back when stopped.
    worker: DeviceWorker<Vec<ActiveQueue>>,
    releaser: Arc<dyn MemoryReleaser>,
    stats: Arc<BalloonStats>,
    log_budget: Arc<AtomicU32>,
    /// Config space: `num_pages` = 0, `actual` = 0 (read-only).
    common: DeviceCommon,
}

impl BalloonDevice {
    /// A new device handing reported runs to `releaser`.
    pub fn new(releaser: Arc<dyn MemoryReleaser>) -> Self {
        let model = BalloonModel::new(releaser.clone());
        Self {
            worker: DeviceWorker::new("balloon"),
            stats: model.stats(),
            log_budget: model.log_budget.clone(),
            common: DeviceCommon::new(
                "balloon",
                VIRTIO_ID_BALLOON,
                [QUEUE_SIZE; NUM_QUEUES],
                model.features(),
                [0u8; CONFIG_SIZE],
            ),
            releaser,
        }
    }

    /// Counters (they survive resets).
    pub fn stats(&self) -> Arc<BalloonStats> {
        self.stats.clone()
    }

    /// Whether the worker runs.
    pub fn is_active(&self) -> bool {
        self.worker.is_running()
    }
}

impl InProcessDevice for BalloonDevice {
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
        let reporting = self.common.acked_features() & (1 << VIRTIO_BALLOON_F_PAGE_REPORTING) != 0;
        let setup = WorkerSetup::new()?;
        let mut served = Vec::with_capacity(queues.len());
        for q in queues {
            match QueueRole::of(q.index, reporting) {
                Some(role) => {
                    setup.add(
                        std::os::fd::AsRawFd::as_raw_fd(&q.notify),
                        TOKEN_QUEUE_BASE + u64::from(q.index),
                    )?;
                    served.push((role, q));
                }
                None => guest_log!(
                    &self.log_budget,
                    warn,
                    queue = q.index,
                    "balloon: queue enabled that the negotiated features do not define; ignored"
                ),
            }
        }
        let mut model = BalloonModel::new(self.releaser.clone());
        model.stats = self.stats.clone();
        model.log_budget = self.log_budget.clone();
        let ctx = Worker {
            mem,
            interrupt,
            queues: served,
            model,
        };
        if let Err(e) = self
            .worker
            .start("virtio-balloon", setup, move |lp| ctx.run(lp))
        {
            error!("balloon: cannot start the worker: {e}");
            return Err(ActivateError::Worker(e));
        }
        info!(reporting, "balloon: device activated");
        Ok(())
    }

    fn stop(&mut self) -> bool {
        let stopped = self.worker.stop().is_ok();
        if stopped {
            let s = &self.stats;
            info!(
                reports = s.reports.load(Ordering::Relaxed),
                released_mib = s.bytes_released.load(Ordering::Relaxed) >> 20,
                rejected = s.rejected.load(Ordering::Relaxed),
                release_failures = s.release_failures.load(Ordering::Relaxed),
                "balloon: device reset"
            );
        }
        stopped
    }

    fn pause_worker(&mut self) -> Result<Vec<ActiveQueue>, DeviceStateError> {
        match self.worker.stop() {
            Ok(queues) => Ok(queues.unwrap_or_default()),
            Err(e) => Err(DeviceStateError::Stop {
                device: "balloon",
                reason: e.to_string(),
            }),
        }
    }

    fn save(
        &mut self,
        _mem: &GuestMemoryMmap,
        _queues: &mut [Queue],
    ) -> Result<Vec<u8>, DeviceStateError> {
        state::encode("balloon", &self.stats.saved())
    }

    fn load(&mut self, bytes: &[u8]) -> Result<(), DeviceStateError> {
        let saved: SavedStats = state::decode("balloon", bytes)?;
        self.stats.set_saved(&saved);
        Ok(())
    }
}

/// What the worker thread owns.
struct Worker {
    mem: GuestMemoryMmap,
    interrupt: Arc<dyn VirtioInterrupt>,
    queues: Vec<(QueueRole, ActiveQueue)>,
    model: BalloonModel,
}

impl Worker {
    /// Serves until stopped; hands the queues back.
    fn run(mut self, lp: WorkerLoop) -> Vec<ActiveQueue> {
        if let Err(e) = lp.serve(WORKER_EVENTS, BalloonError::Epoll, |w| self.on_wakeup(w)) {
            error!("balloon: {e}; the device needs a reset");
            lp.park_needs_reset("balloon", self.interrupt.as_ref());
        }
        self.queues.into_iter().map(|(_, q)| q).collect()
    }

    fn on_wakeup(&mut self, wakeup: Wakeup) -> Result<(), BalloonError> {
        let Wakeup::Ready(token) = wakeup else {
            return Ok(());
        };
        let Some((role, q)) = self
            .queues
            .iter_mut()
            .find(|(_, q)| TOKEN_QUEUE_BASE + u64::from(q.index) == token)
        else {
            return Ok(());
        };
        // Reset the counter; EAGAIN only means a spurious wakeup.
        let _ = q.notify.read();
        if self.model.process_queue(*role, &self.mem, &mut q.queue)? {
            if let Err(e) = self.interrupt.signal_used_queue(q.index) {
                tracing::warn!("balloon: cannot signal queue {}: {e}", q.index);
            }
        }
        Ok(())
    }
}
