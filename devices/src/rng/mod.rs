//! virtio-rng (virtio 1.2 §5.4): the guest's `/dev/hwrng` fed from the
//! host's `getrandom(2)`.
//!
//! [`RngModel`] knows one request queue and the guest memory it lives in:
//! for every available chain it fills the device-writable buffers with
//! random bytes, at most [`MAX_BYTES_PER_REQUEST`] per chain, and returns the
//! chain with the number of bytes written. Device-readable buffers (the spec
//! has none) are skipped; a buffer outside guest memory ends the fill at
//! that point, so the chain returns with what was written before it (0 for
//! a chain with nothing usable). [`RngDevice`] is the in-process face for
//! the vmm's virtio-mmio transport; the vhost-user face is
//! [`crate::vhost_user::rng`].
//!
//! Limits: no rate limiting beyond the per-request bound (a guest that keeps
//! asking costs the host one worker thread's CPU, as with any device); one
//! queue, no config space.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tracing::{debug, info, warn};
use virtio_queue::{DescriptorChain, Queue};
use vm_memory::{Bytes, GuestMemory};
use vmm::virtio::in_process::{DeviceCommon, InProcessDevice};
use vmm::virtio::single_queue::{QueueModel, SingleQueueWorker};
use vmm::virtio::{
    drain, features, ActivateError, ActiveQueue, DeviceStateError, GuestMemoryMmap, VirtioInterrupt,
};

#[cfg(test)]
mod tests;

/// Virtio device ID of an entropy device.
pub const VIRTIO_ID_RNG: u32 = 4;
/// Index of the only queue (`requestq`).
pub const REQUEST_QUEUE: u16 = 0;
/// Number of queues.
pub const NUM_QUEUES: usize = 1;
/// Maximum queue size offered (Linux keeps one buffer in flight).
pub const QUEUE_SIZE: u16 = 64;
/// Most random bytes written into one chain, however large its buffers
/// (Linux asks for at most a page at a time).
pub const MAX_BYTES_PER_REQUEST: usize = 64 * 1024;

/// Errors of the rng device.
#[derive(Debug, thiserror::Error)]
pub enum RngError {
    /// The available ring could not be read: the queue is broken and the
    /// device needs a reset.
    #[error("virtqueue {index} is unusable: {source}; the guest driver must reset the device")]
    Queue {
        /// Queue index.
        index: u16,
        /// virtio-queue error.
        source: virtio_queue::Error,
    },
    /// `getrandom(2)` failed.
    #[error("getrandom failed: {0}; the host kernel cannot supply random bytes")]
    GetRandom(#[source] io::Error),
}

/// Counters of a model.
#[derive(Debug, Default)]
pub struct RngStats {
    /// Chains completed.
    pub requests: AtomicU64,
    /// Random bytes written to the guest.
    pub bytes: AtomicU64,
    /// Chains with a buffer outside guest memory, or no writable buffer.
    pub malformed: AtomicU64,
}

/// Fills `buf` from `getrandom(2)` (blocking only until the host's pool is
/// initialised, which it is long before a VM starts).
pub fn fill_random(buf: &mut [u8]) -> Result<(), RngError> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: getrandom writes at most rest.len() bytes into rest.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(RngError::GetRandom(e));
        }
        done += n as usize;
    }
    Ok(())
}

/// The virtio-rng device model over one request queue.
#[derive(Debug)]
pub struct RngModel {
    buf: Vec<u8>,
    stats: Arc<RngStats>,
}

impl Default for RngModel {
    fn default() -> Self {
        Self::new()
    }
}

impl RngModel {
    /// A new model.
    pub fn new() -> Self {
        Self {
            buf: Vec::new(),
            stats: Arc::default(),
        }
    }

    /// Device feature bits.
    pub fn features(&self) -> u64 {
        features::VERSION_1 | features::RING_EVENT_IDX | features::RING_INDIRECT_DESC
    }

    /// Counters.
    pub fn stats(&self) -> Arc<RngStats> {
        self.stats.clone()
    }

    /// Fills every available chain. Returns whether the driver needs a
    /// used-buffer notification.
    pub fn process_queue<M: GuestMemory>(
        &mut self,
        mem: &M,
        q: &mut Queue,
    ) -> Result<bool, RngError> {
        let qerr = |source| RngError::Queue {
            index: REQUEST_QUEUE,
            source,
        };
        drain(
            q,
            mem,
            qerr,
            |chain| {
                let written = self.fill_chain(mem, chain)?;
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .bytes
                    .fetch_add(u64::from(written), Ordering::Relaxed);
                Ok(written)
            },
            |head, e| {
                warn!("rng: cannot return chain {head}: {e}");
                Ok(())
            },
        )
    }

    /// Writes random bytes into the chain's writable buffers; returns how
    /// many.
    fn fill_chain<M, D>(&mut self, mem: &M, chain: DescriptorChain<D>) -> Result<u32, RngError>
    where
        M: GuestMemory,
        D: std::ops::Deref,
        D::Target: GuestMemory,
    {
        let mut written = 0usize;
        let mut bad = false;
        for desc in chain.writable() {
            let room = MAX_BYTES_PER_REQUEST - written;
            if room == 0 {
                break;
            }
            let n = (desc.len() as usize).min(room);
            if n == 0 {
                continue;
            }
            if !mem.check_range(desc.addr(), n) {
                bad = true;
                break;
            }
            self.buf.resize(n, 0);
            fill_random(&mut self.buf[..n])?;
            if mem.write_slice(&self.buf[..n], desc.addr()).is_err() {
                bad = true;
                break;
            }
            written += n;
        }
        if bad || written == 0 {
            self.stats.malformed.fetch_add(1, Ordering::Relaxed);
            debug!(written, "rng: chain without usable writable buffers");
        }
        // Bounded by MAX_BYTES_PER_REQUEST.
        Ok(written as u32)
    }
}

impl QueueModel for RngModel {
    type Error = RngError;

    fn process_queue(
        &mut self,
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
    ) -> Result<bool, RngError> {
        RngModel::process_queue(self, mem, queue)
    }
}

/// The in-process face: a [`VirtioDevice`] for the vmm's virtio-mmio
/// transport, running an [`RngModel`] on its own thread while active.
///
/// [`VirtioDevice`]: vmm::virtio::VirtioDevice
pub struct RngDevice {
    /// First, so it is stopped before the rest is dropped. A fresh model
    /// (sharing the counters) serves each activation.
    worker: SingleQueueWorker<RngModel>,
    stats: Arc<RngStats>,
    /// No config space.
    common: DeviceCommon,
}

impl Default for RngDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl RngDevice {
    /// A new device.
    pub fn new() -> Self {
        let model = RngModel::new();
        Self {
            worker: SingleQueueWorker::new("rng", REQUEST_QUEUE),
            stats: model.stats(),
            common: DeviceCommon::new("rng", VIRTIO_ID_RNG, [QUEUE_SIZE], model.features(), []),
        }
    }

    /// Counters (they survive resets).
    pub fn stats(&self) -> Arc<RngStats> {
        self.stats.clone()
    }

    /// Whether the worker runs.
    pub fn is_active(&self) -> bool {
        self.worker.is_running()
    }
}

impl InProcessDevice for RngDevice {
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
        let stats = self.stats.clone();
        self.worker.start(mem, interrupt, queues, move || {
            let mut model = RngModel::new();
            model.stats = stats;
            Ok(model)
        })?;
        info!("rng: device activated");
        Ok(())
    }

    fn stop(&mut self) -> bool {
        let stopped = self.worker.stop().is_ok();
        if stopped {
            info!("rng: device reset");
        }
        stopped
    }

    /// Stateless beyond its queue: the queue comes back, a resume starts a
    /// fresh model (sharing the counters).
    fn pause_worker(&mut self) -> Result<Vec<ActiveQueue>, DeviceStateError> {
        match self.worker.pause() {
            Ok(Some((_model, queue))) => Ok(vec![queue]),
            Ok(None) => Ok(Vec::new()),
            Err(e) => Err(DeviceStateError::Stop {
                device: "rng",
                reason: e.to_string(),
            }),
        }
    }
}
