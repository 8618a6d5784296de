//! The virtio-blk device model ([`BlkModel`]) and its in-process face
//! ([`BlkDevice`], a [`VirtioDevice`] for the vmm's virtio-mmio transport).
//!
//! [`BlkModel`] knows one request queue and the guest memory it lives in,
//! nothing of KVM or vhost-user: a face calls [`BlkModel::process_queue`]
//! when the queue is kicked, and every available chain is served
//! ([`super::request::serve`]) and returned to the used ring. A malformed
//! chain is completed (with an error status when it has a status byte, with
//! a used length of 0 otherwise) and counted; the device keeps serving. Only
//! a broken available ring stops the worker, which then asks the driver for
//! a reset.
//!
//! Config space (virtio 1.2 §5.2.4, little-endian, laid out as Linux's
//! `struct virtio_blk_config`): `capacity` in 512-byte sectors, `seg_max`,
//! `blk_size` (512), and for writable disks the DISCARD / WRITE_ZEROES
//! limits. Read-only; writes are ignored.
//!
//! Snapshots: the device saves nothing beyond its queue; a restored VM's
//! disk is whatever backend the new device was built with (the session
//! disk of the new start), and the transport raises a config-change
//! interrupt when its capacity differs from the snapshot's.
//!
//! Limits: one request queue; the worker serves one request at a time.
//!
//! [`VirtioDevice`]: vmm::virtio::VirtioDevice

use std::io;
use std::mem::offset_of;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use tracing::{debug, error, info, warn};
use virtio_bindings::virtio_blk::{
    virtio_blk_config, VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::Queue;
use vm_memory::GuestMemory;
use vmm::virtio::in_process::{DeviceCommon, InProcessDevice};
use vmm::virtio::single_queue::{QueueModel, SingleQueueWorker};
use vmm::virtio::worker::StopError;
use vmm::virtio::{
    drain, features, ActivateError, ActiveQueue, DeviceStateError, GuestMemoryMmap, VirtioInterrupt,
};

use super::image::BlockBackend;
use super::request::{self, Completion, DiskParams};
use super::{ID_BYTES, SECTOR_SHIFT, SECTOR_SIZE};

/// Virtio device ID of a block device (virtio 1.2 §5.2).
pub const VIRTIO_ID_BLOCK: u32 = 2;
/// Index of the only request queue.
pub const REQUEST_QUEUE: u16 = 0;
/// Number of queues.
pub const NUM_QUEUES: usize = 1;
/// Default maximum queue size.
pub const QUEUE_SIZE: u16 = 256;
/// Size of the config space (Linux's `struct virtio_blk_config`, zoned
/// fields included and left zero).
pub const CONFIG_SIZE: usize = std::mem::size_of::<virtio_blk_config>();
/// Most segments in one DISCARD / WRITE_ZEROES request.
pub const MAX_DISCARD_SEGMENTS: u32 = 32;
/// Most sectors in one DISCARD / WRITE_ZEROES segment (2 GiB).
pub const MAX_SEGMENT_SECTORS: u32 = 1 << 22;
/// Discard granularity reported to the driver, in sectors (4 KiB, the host
/// filesystem's usual block size: smaller holes cannot be punched).
pub const DISCARD_ALIGNMENT_SECTORS: u32 = 8;
/// How many per-request warnings (malformed chains, I/O errors) a model
/// logs at warning level before going quiet (debug level), so a hostile
/// driver cannot flood the host log.
pub const WARN_LOG_BUDGET: u32 = 32;

/// Errors of the device model.
#[derive(Debug, thiserror::Error)]
pub enum BlkDeviceError {
    /// The serial does not fit GET_ID's 20 bytes.
    #[error("disk serial {serial:?} is {len} bytes; at most {ID_BYTES} fit a GET_ID answer")]
    SerialTooLong {
        /// The refused serial.
        serial: String,
        /// Its length in bytes.
        len: usize,
    },
    /// The queue size is not a power of two in 2..=32768.
    #[error("queue size {0} is invalid; use a power of two in 2..=32768")]
    QueueSize(u16),
    /// The available ring could not be read: the queue is broken and the
    /// device needs a reset.
    #[error("virtqueue {index} is unusable: {source}; the guest driver must reset the device")]
    Queue {
        /// Queue index.
        index: u16,
        /// virtio-queue error.
        source: virtio_queue::Error,
    },
}

/// Settings of a disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlkConfig {
    /// Serial answered to GET_ID (`/sys/block/vdX/serial` in the guest), at
    /// most [`ID_BYTES`] bytes.
    pub serial: String,
    /// Largest queue size offered.
    pub queue_size: u16,
}

impl BlkConfig {
    /// A disk with `serial` and the default queue size.
    pub fn new(serial: impl Into<String>) -> Self {
        Self {
            serial: serial.into(),
            queue_size: QUEUE_SIZE,
        }
    }
}

/// Counters of a model (since it was built).
#[derive(Debug, Default)]
pub struct BlkStats {
    /// Chains completed.
    pub requests: AtomicU64,
    /// Bytes read from the disk into guest memory.
    pub bytes_read: AtomicU64,
    /// Bytes written from guest memory to the disk.
    pub bytes_written: AtomicU64,
    /// FLUSH requests completed successfully.
    pub flushes: AtomicU64,
    /// DISCARD and WRITE_ZEROES requests completed successfully.
    pub discards: AtomicU64,
    /// Requests completed with a status other than OK.
    pub errors: AtomicU64,
    /// Chains that were malformed (subset of `errors`, plus chains without a
    /// status byte).
    pub malformed: AtomicU64,
}

/// The virtio-blk device model over one request queue.
pub struct BlkModel {
    backend: Box<dyn BlockBackend>,
    params: DiskParams,
    config: [u8; CONFIG_SIZE],
    queue_size: u16,
    scratch: Vec<u8>,
    stats: Arc<BlkStats>,
    log_budget: AtomicU32,
}

impl BlkModel {
    /// A model serving `backend` with `config`.
    pub fn new(backend: Box<dyn BlockBackend>, config: &BlkConfig) -> Result<Self, BlkDeviceError> {
        if config.serial.len() > ID_BYTES {
            return Err(BlkDeviceError::SerialTooLong {
                serial: config.serial.clone(),
                len: config.serial.len(),
            });
        }
        if config.queue_size < 2 || !config.queue_size.is_power_of_two() {
            return Err(BlkDeviceError::QueueSize(config.queue_size));
        }
        let mut id = [0u8; ID_BYTES];
        id[..config.serial.len()].copy_from_slice(config.serial.as_bytes());
        let writable = !backend.read_only();
        let params = DiskParams {
            id,
            discard: writable,
            write_zeroes: writable,
            max_segments: MAX_DISCARD_SEGMENTS,
            max_segment_sectors: MAX_SEGMENT_SECTORS,
        };
        let config_bytes = build_config(backend.size(), config.queue_size, &params);
        Ok(Self {
            backend,
            params,
            config: config_bytes,
            queue_size: config.queue_size,
            scratch: Vec::new(),
            stats: Arc::default(),
            log_budget: AtomicU32::new(WARN_LOG_BUDGET),
        })
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity(&self) -> u64 {
        self.backend.size() >> SECTOR_SHIFT
    }

    /// Whether the disk is read-only.
    pub fn read_only(&self) -> bool {
        self.backend.read_only()
    }

    /// Largest queue size offered.
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    /// Device feature bits (virtio-blk ones plus the ring features the
    /// model handles: event index, indirect descriptors, VERSION_1).
    pub fn features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1u64 << VIRTIO_BLK_F_BLK_SIZE)
            | (1u64 << VIRTIO_BLK_F_FLUSH)
            | features::VERSION_1
            | features::RING_EVENT_IDX
            | features::RING_INDIRECT_DESC;
        if self.read_only() {
            f |= 1u64 << VIRTIO_BLK_F_RO;
        }
        if self.params.discard {
            f |= 1u64 << VIRTIO_BLK_F_DISCARD;
        }
        if self.params.write_zeroes {
            f |= 1u64 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        f
    }

    /// The config space bytes.
    pub fn config(&self) -> &[u8] {
        &self.config
    }

    /// Counters.
    pub fn stats(&self) -> Arc<BlkStats> {
        self.stats.clone()
    }

    /// Makes every completed write durable (also done on drop by backends
    /// that keep metadata).
    pub fn flush(&mut self) -> io::Result<()> {
        self.backend.flush()
    }

    /// Serves every available chain of the request queue. Returns whether
    /// the driver needs a used-buffer notification.
    pub fn process_queue<M: GuestMemory>(
        &mut self,
        mem: &M,
        q: &mut Queue,
    ) -> Result<bool, BlkDeviceError> {
        let qerr = |source| BlkDeviceError::Queue {
            index: REQUEST_QUEUE,
            source,
        };
        let budget = &self.log_budget;
        let stats = &self.stats;
        let (backend, params, scratch) = (&mut self.backend, &self.params, &mut self.scratch);
        drain(
            q,
            mem,
            qerr,
            |chain| {
                let head = chain.head_index();
                let c = request::serve(mem, chain, backend.as_mut(), params, scratch);
                account(stats, budget, head, &c);
                Ok(c.used_len)
            },
            |head, e| {
                vmm::guest_log!(budget, warn, "blk: cannot return chain {head}: {e}");
                Ok(())
            },
        )
    }
}

impl QueueModel for BlkModel {
    type Error = BlkDeviceError;

    fn process_queue(
        &mut self,
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
    ) -> Result<bool, BlkDeviceError> {
        BlkModel::process_queue(self, mem, queue)
    }
}

/// Counts a completed request in `s` and logs a failure (within `budget`).
fn account(s: &BlkStats, budget: &AtomicU32, head: u16, c: &Completion) {
    s.requests.fetch_add(1, Ordering::Relaxed);
    let ok = c.error.is_none();
    if ok {
        let data = u64::from(c.used_len.saturating_sub(1));
        match c.kind {
            Some(VIRTIO_BLK_T_IN) => {
                s.bytes_read.fetch_add(data, Ordering::Relaxed);
            }
            Some(VIRTIO_BLK_T_OUT) => {
                s.bytes_written
                    .fetch_add(c.bytes_from_guest, Ordering::Relaxed);
            }
            Some(VIRTIO_BLK_T_FLUSH) => {
                s.flushes.fetch_add(1, Ordering::Relaxed);
            }
            Some(VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES) => {
                s.discards.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        debug!(head, kind = ?c.kind, used = c.used_len, "blk: request done");
        return;
    }
    s.errors.fetch_add(1, Ordering::Relaxed);
    let Some(e) = &c.error else { return };
    if e.is_malformed() || c.status.is_none() {
        s.malformed.fetch_add(1, Ordering::Relaxed);
    }
    match e {
        request::RequestError::Unsupported(kind) => {
            debug!(head, kind, "blk: unsupported request type answered UNSUPP")
        }
        _ => vmm::guest_log!(
            budget,
            warn,
            "blk: request {head} (type {:?}) failed, status {:?}: {e}",
            c.kind,
            c.status
        ),
    }
}

/// The config space image for a disk of `size` bytes.
fn build_config(size: u64, queue_size: u16, params: &DiskParams) -> [u8; CONFIG_SIZE] {
    let mut c = [0u8; CONFIG_SIZE];
    let mut put = |off: usize, bytes: &[u8]| c[off..off + bytes.len()].copy_from_slice(bytes);
    put(
        offset_of!(virtio_blk_config, capacity),
        &(size >> SECTOR_SHIFT).to_le_bytes(),
    );
    // Two descriptors of every chain carry the header and the status.
    put(
        offset_of!(virtio_blk_config, seg_max),
        &u32::from(queue_size.saturating_sub(2)).to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, blk_size),
        &(SECTOR_SIZE as u32).to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, num_queues),
        &1u16.to_le_bytes(),
    );
    if params.discard {
        put(
            offset_of!(virtio_blk_config, max_discard_sectors),
            &params.max_segment_sectors.to_le_bytes(),
        );
        put(
            offset_of!(virtio_blk_config, max_discard_seg),
            &params.max_segments.to_le_bytes(),
        );
        put(
            offset_of!(virtio_blk_config, discard_sector_alignment),
            &DISCARD_ALIGNMENT_SECTORS.to_le_bytes(),
        );
    }
    if params.write_zeroes {
        put(
            offset_of!(virtio_blk_config, max_write_zeroes_sectors),
            &params.max_segment_sectors.to_le_bytes(),
        );
        put(
            offset_of!(virtio_blk_config, max_write_zeroes_seg),
            &params.max_segments.to_le_bytes(),
        );
        put(offset_of!(virtio_blk_config, write_zeroes_may_unmap), &[1]);
    }
    c
}

/// The in-process face: a [`VirtioDevice`] for the vmm's virtio-mmio
/// transport, running a [`BlkModel`] on its own thread while active.
///
/// [`VirtioDevice`]: vmm::virtio::VirtioDevice
pub struct BlkDevice {
    /// The model while inactive; the worker owns it while active and hands
    /// it back when stopped.
    model: Option<BlkModel>,
    /// Read-only config space: the model's.
    common: DeviceCommon,
    /// Capacity in sectors, for the activation log line.
    capacity: u64,
    stats: Arc<BlkStats>,
    /// Hands the model back when stopped.
    worker: SingleQueueWorker<BlkModel>,
}

impl BlkDevice {
    /// A device serving `backend` with `config`.
    pub fn new(backend: Box<dyn BlockBackend>, config: &BlkConfig) -> Result<Self, BlkDeviceError> {
        let model = BlkModel::new(backend, config)?;
        Ok(Self {
            common: DeviceCommon::new(
                "blk",
                VIRTIO_ID_BLOCK,
                [model.queue_size],
                model.features(),
                model.config,
            ),
            capacity: model.capacity(),
            stats: model.stats(),
            model: Some(model),
            worker: SingleQueueWorker::new("blk", REQUEST_QUEUE),
        })
    }

    /// Counters.
    pub fn stats(&self) -> Arc<BlkStats> {
        self.stats.clone()
    }

    /// Features the driver accepted at the last FEATURES_OK.
    pub fn acked_features(&self) -> u64 {
        self.common.acked_features()
    }

    /// Whether the worker runs.
    pub fn is_active(&self) -> bool {
        self.worker.is_running()
    }

    /// Stops the worker (taking the model back from it).
    fn stop_worker(&mut self) -> bool {
        match self.worker.stop() {
            Ok(model) => {
                if let Some(model) = model {
                    self.model = Some(model);
                }
                true
            }
            Err(StopError::Panicked) => {
                error!("blk: the worker panicked; the disk is gone until the VM restarts");
                false
            }
            Err(StopError::Signal(_)) => false,
        }
    }
}

impl Drop for BlkDevice {
    fn drop(&mut self) {
        self.stop_worker();
        if let Some(m) = self.model.as_mut() {
            if let Err(e) = m.flush() {
                warn!("blk: flush on close failed: {e}");
            }
        }
    }
}

impl InProcessDevice for BlkDevice {
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
        let model = &mut self.model;
        self.worker.start(mem, interrupt, queues, || {
            // The model is the worker's from here; if the thread cannot be
            // spawned it is gone with it.
            model
                .take()
                .ok_or_else(|| ActivateError::Device("the disk model was lost".into()))
        })?;
        info!(capacity = self.capacity, "blk: device activated");
        Ok(())
    }

    fn stop(&mut self) -> bool {
        let stopped = self.stop_worker();
        if stopped {
            info!("blk: device reset");
        }
        stopped
    }

    /// Nothing beyond the queue is saved: a restored VM's disk is the new
    /// device's backend (its config space, compared by the transport,
    /// tells the driver when the capacity changed).
    fn pause_worker(&mut self) -> Result<Vec<ActiveQueue>, DeviceStateError> {
        match self.worker.pause() {
            Ok(Some((model, queue))) => {
                self.model = Some(model);
                Ok(vec![queue])
            }
            Ok(None) => Ok(Vec::new()),
            Err(e) => {
                if matches!(e, StopError::Panicked) {
                    error!("blk: the worker panicked; the disk is gone until the VM restarts");
                }
                Err(DeviceStateError::Stop {
                    device: "blk",
                    reason: e.to_string(),
                })
            }
        }
    }
}
