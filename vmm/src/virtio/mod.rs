//! Virtio device models' interface to the machine, and the virtio-mmio transport.
//!
//! A device model (block, net, vsock, fs... in the `devices/` work) implements
//! [`VirtioDevice`]: it describes itself (type, queues, features, config space)
//! and, once the driver has finished initialisation, receives its queues, their
//! notification [`EventFd`]s and a [`VirtioInterrupt`] handle in
//! [`VirtioDevice::activate`], where it moves its work to its own thread or
//! event loop ([`worker`] holds the thread, stop and epoll machinery the
//! in-process devices share; [`single_queue`] is the whole worker of a
//! device that serves one queue; [`in_process`] gives a device whose
//! description and config space are fixed data its [`VirtioDevice`]
//! half). Devices know nothing of KVM: the transport
//! ([`mmio::MmioTransport`]) turns a [`VirtioInterrupt`] signal into an
//! interrupt-status bit plus a write to an `EventFd` the machine registers as a
//! KVM irqfd, and the machine registers each queue's notify `EventFd` as a KVM
//! ioeventfd.
//!
//! Snapshots ([`state`]): a device pauses (its worker stops without a
//! reset and hands its queues back with their ring positions), saves and
//! restores its own state, and resumes; the transport saves and restores
//! everything else and restores it around a freshly built device, so a
//! restored VM gets new backends under the same guest-visible devices.
//!
//! Limits: split virtqueues only (no `VIRTIO_F_RING_PACKED`), modern (virtio
//! 1.x, MMIO version 2) drivers only, no shared-memory regions, no per-queue
//! reset (`VIRTIO_F_RING_RESET`), no notification data. Guest memory is a
//! [`GuestMemoryMmap`] fixed for the life of the VM (no hotplug).

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

pub mod drain;
pub mod in_process;
pub mod mmio;
pub mod single_queue;
pub mod state;
// Test support, not in the product: the transport's unit tests, the
// tiny-guest suites and the mmio fuzz target drive it.
#[cfg(any(test, feature = "test-devices"))]
pub mod testdev;
pub mod worker;

pub use drain::drain;
pub use mmio::{MmioTransport, MmioTransportError};
pub use state::{DeviceStateError, QueueSnapshot, TransportState};

/// Takes one message from a log budget for guest-triggered events: `true`
/// while messages remain (the budget is decremented), `false` once it is
/// spent.
pub fn take_log_budget(budget: &AtomicU32) -> bool {
    budget
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

/// Logs a guest-triggered event at `$level` while `$budget` (an
/// `&AtomicU32`, see [`take_log_budget`]) lasts, then at debug level, so a
/// hostile guest cannot flood the host log. The transport and the device
/// models share it.
#[macro_export]
macro_rules! guest_log {
    ($budget:expr, $level:ident, $($arg:tt)+) => {
        if $crate::virtio::take_log_budget($budget) {
            ::tracing::$level!($($arg)+)
        } else {
            ::tracing::debug!($($arg)+)
        }
    };
}

/// Guest memory as handed to devices at activation (cheap to clone: the
/// regions are reference-counted).
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<()>;

/// Device status bits (virtio 1.2 §2.1), as read and written through the
/// transport's Status register.
pub mod status {
    /// The guest OS has noticed the device.
    pub const ACKNOWLEDGE: u32 = 0x01;
    /// The guest OS knows how to drive the device.
    pub const DRIVER: u32 = 0x02;
    /// The driver is set up and ready to drive the device; the transport
    /// activates the device when this bit is set.
    pub const DRIVER_OK: u32 = 0x04;
    /// The driver has acknowledged the features it understands and feature
    /// negotiation is complete (cleared again by the device if it refuses).
    pub const FEATURES_OK: u32 = 0x08;
    /// The device hit an error it cannot recover from; the driver must reset
    /// it. Only the device sets this bit.
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    /// The driver gave up on the device.
    pub const FAILED: u32 = 0x80;
}

/// Feature bits the transport itself knows about (virtio 1.2 §6). Device
/// specific bits (0..=23) are the device model's business.
pub mod features {
    use virtio_bindings::virtio_config::{
        VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_RING_PACKED, VIRTIO_F_RING_RESET, VIRTIO_F_VERSION_1,
    };
    use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

    /// Indirect descriptor tables are supported by the queue implementation.
    pub const RING_INDIRECT_DESC: u64 = 1 << VIRTIO_RING_F_INDIRECT_DESC;
    /// `used_event`/`avail_event` notification suppression; when acked the
    /// transport enables it on every queue at activation.
    pub const RING_EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;
    /// Virtio 1.x ("modern") device. Always offered by the transport and
    /// required from the driver: legacy drivers are refused at FEATURES_OK.
    pub const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
    /// The device accesses memory through a platform IOMMU.
    pub const ACCESS_PLATFORM: u64 = 1 << VIRTIO_F_ACCESS_PLATFORM;
    /// Packed virtqueues (not supported by this transport: never offer it).
    pub const RING_PACKED: u64 = 1 << VIRTIO_F_RING_PACKED;
    /// Per-queue reset (not supported by this transport: never offer it).
    pub const RING_RESET: u64 = 1 << VIRTIO_F_RING_RESET;
    /// Bits a device model must not offer because the transport cannot
    /// honour them; [`crate::virtio::MmioTransport::new`] masks them out.
    pub const UNSUPPORTED_BY_TRANSPORT: u64 = RING_PACKED | RING_RESET;
}

/// Why [`VirtioDevice::activate`] (or the transport's checks before it)
/// refused to start a device. The transport then sets DEVICE_NEEDS_RESET.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// A queue the driver enabled is unusable (size or rings outside guest
    /// memory, misaligned...).
    #[error("virtqueue {index} is invalid: {reason}; the guest driver set it up wrong, the device stays in NEEDS_RESET until the driver resets it")]
    InvalidQueue {
        /// Queue index.
        index: u16,
        /// What is wrong with it.
        reason: String,
    },
    /// The device needs a queue the driver did not enable.
    #[error("virtqueue {index} is required by the device but was not enabled by the driver")]
    MissingQueue {
        /// Queue index.
        index: u16,
    },
    /// Duplicating a notify EventFd for the device failed (fd exhaustion).
    #[error("cannot duplicate the notify eventfd of virtqueue {index}: {source}; check the process fd limit")]
    CloneEventFd {
        /// Queue index.
        index: u16,
        /// OS error.
        source: io::Error,
    },
    /// The device could not start its worker thread or event-loop handler.
    #[error("cannot start the device worker: {0}; check thread and fd limits")]
    Worker(#[source] io::Error),
    /// The device is already active (the transport never does this; a device
    /// reports it if it is activated twice without a reset).
    #[error("device is already active; it must be reset before being activated again")]
    AlreadyActive,
    /// A device-specific reason.
    #[error("device refused activation: {0}")]
    Device(String),
}

/// A virtqueue handed to a device at activation.
#[derive(Debug)]
pub struct ActiveQueue {
    /// Queue index within the device (the value the driver writes to
    /// QueueSel / QueueNotify).
    pub index: u16,
    /// The queue, with the size, ring addresses and event-idx setting the
    /// driver negotiated, validated against guest memory.
    pub queue: Queue,
    /// Becomes readable when the driver kicks this queue (a duplicate of the
    /// transport's notify eventfd, so the KVM ioeventfd and the MMIO-exit
    /// path both reach it). Read it (to reset the counter) before processing.
    pub notify: EventFd,
}

/// How a device signals the driver. Implemented by the transport; devices only
/// ever hold it as `Arc<dyn VirtioInterrupt>`.
///
/// After the device is reset, a handle from the previous activation is inert:
/// its signals are dropped.
pub trait VirtioInterrupt: Send + Sync {
    /// The device put buffers in the used ring of `queue`. (virtio-mmio has
    /// one interrupt line per device, so its transport ignores the index;
    /// it is there for transports with per-queue vectors.)
    fn signal_used_queue(&self, queue: u16) -> io::Result<()>;
    /// The device configuration space changed (the transport also bumps the
    /// ConfigGeneration register).
    fn signal_config_change(&self) -> io::Result<()>;
    /// The device hit an unrecoverable error (typically malformed guest data):
    /// the transport sets DEVICE_NEEDS_RESET and signals a configuration
    /// change. The device should stop processing until it is reset.
    fn signal_needs_reset(&self) -> io::Result<()>;
}

/// A virtio device model, driven by a transport.
///
/// Everything the guest hands in (config offsets and widths, queue contents)
/// is hostile: implementations must bounds-check and never panic on it. The
/// transport serialises all calls (it holds the device under a mutex), and
/// calls [`read_config`](Self::read_config) / [`write_config`](Self::write_config)
/// concurrently with the device's own worker thread after activation, so
/// state shared with the worker needs its own synchronisation.
pub trait VirtioDevice: Send {
    /// Virtio device ID (virtio 1.2 §5), e.g. 2 for block. 0 is invalid.
    fn device_type(&self) -> u32;

    /// Maximum size of each queue, by index. Each must be a power of two in
    /// `1..=32768`; the transport refuses other values at construction.
    fn queue_max_sizes(&self) -> &[u16];

    /// Features the device offers. The transport adds
    /// [`features::VERSION_1`] and removes
    /// [`features::UNSUPPORTED_BY_TRANSPORT`].
    fn avail_features(&self) -> u64;

    /// The driver accepted `features` (always a subset of what was offered,
    /// including `VERSION_1`) and is setting FEATURES_OK. Return `false` to
    /// refuse the combination: FEATURES_OK is then not set. May be called
    /// again after a reset.
    fn ack_features(&mut self, features: u64) -> bool;

    /// Read device configuration space at `offset` into `data`, which the
    /// transport has zeroed. Out-of-range parts must be left untouched
    /// (see [`read_config_bytes`]).
    fn read_config(&self, offset: u64, data: &mut [u8]);

    /// Write device configuration space at `offset`. Out-of-range or
    /// read-only parts must be ignored (see [`write_config_bytes`]).
    fn write_config(&mut self, offset: u64, data: &[u8]);

    /// The driver set DRIVER_OK. `queues` holds every queue the driver
    /// enabled, in index order, already validated against `mem`. The device
    /// moves its work to its own thread/event loop and returns; the transport
    /// then kicks every queue once so buffers posted before DRIVER_OK are
    /// seen. An error puts the device in DEVICE_NEEDS_RESET.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError>;

    /// The driver reset an activated device: stop the worker, drop the
    /// queues, notify fds and interrupt handle, and return to the
    /// pre-activation state. Return `false` if that is impossible; the
    /// transport then keeps the device in DEVICE_NEEDS_RESET for good.
    fn reset(&mut self) -> bool;

    // Snapshots ([`state`]). The transport calls these only while no vCPU
    // runs; the defaults suit a device without snapshot support
    // (`pause` refuses) or with nothing to save beyond its queues.

    /// Stops serving an activated device *without* resetting it, and hands
    /// back every queue it was activated with, in any order, each with its
    /// current ring positions (`next_avail`, `next_used`). Whatever else
    /// the device needs to serve again (its model, connections, counters)
    /// it keeps. Afterwards the device touches neither guest memory nor
    /// its interrupt until [`resume`](Self::resume); `save_state` may come
    /// in between. The default refuses: such a device cannot be paused,
    /// and a VM with it cannot be snapshotted.
    fn pause(&mut self) -> Result<Vec<ActiveQueue>, DeviceStateError> {
        Err(DeviceStateError::Unsupported {
            device_type: self.device_type(),
        })
    }

    /// Serves `queues` again after [`pause`](Self::pause), or for the first
    /// time after [`restore_state`](Self::restore_state) in a restored VM:
    /// like [`activate`](Self::activate), except that the queues carry
    /// positions in rings the driver already uses. The default activates.
    fn resume(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        self.activate(mem, interrupt, queues)
    }

    /// The device's own state for a snapshot, on a paused (or never
    /// activated) device. `queues` are the transport's, by index, with the
    /// positions `pause` handed back; a device may still use a ready one
    /// (virtio-vsock posts its TRANSPORT_RESET event there). The default
    /// saves nothing.
    fn save_state(
        &mut self,
        mem: &GuestMemoryMmap,
        queues: &mut [Queue],
    ) -> Result<Vec<u8>, DeviceStateError> {
        let _ = (mem, queues);
        Ok(Vec::new())
    }

    /// Loads what [`save_state`](Self::save_state) saved into a freshly
    /// built device, before the transport resumes it. The bytes come from
    /// a file: check everything, never panic. The default accepts only
    /// "nothing saved".
    fn restore_state(&mut self, state: &[u8]) -> Result<(), DeviceStateError> {
        if state.is_empty() {
            Ok(())
        } else {
            Err(DeviceStateError::Mismatch {
                device: "virtio",
                reason: format!(
                    "{} bytes of device state saved, but virtio device type {} keeps none",
                    state.len(),
                    self.device_type()
                ),
            })
        }
    }

    /// The device's config space when it cannot change while the device
    /// exists (empty: not compared). The transport saves it; when a
    /// restored device's differs (a session disk of another size), it
    /// raises a configuration-change interrupt once the device resumes, so
    /// the driver reads it again.
    fn config_snapshot(&self) -> Vec<u8> {
        Vec::new()
    }
}

/// Serves a config-space read from a byte image of the config structure.
///
/// Copies `config[offset..offset + data.len()]` into `data` and returns `true`
/// when the whole access is in range; otherwise leaves `data` untouched and
/// returns `false`. Never panics, whatever the offset.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) -> bool {
    match config_slice(config, offset, data.len()) {
        Some(bytes) => {
            data.copy_from_slice(bytes);
            true
        }
        None => {
            tracing::debug!(
                offset,
                len = data.len(),
                size = config.len(),
                "virtio config read out of range ignored"
            );
            false
        }
    }
}

/// The `len` bytes of `config` at `offset`, if the whole access lies inside
/// it (`None` otherwise, whatever the offset; never panics). For faces that
/// answer a config read with a buffer of their own (vhost-user's
/// GET_CONFIG).
pub fn config_slice(config: &[u8], offset: u64, len: usize) -> Option<&[u8]> {
    config_range(config.len(), offset, len).map(|(start, end)| &config[start..end])
}

/// Applies a config-space write to a byte image of the (writable part of the)
/// config structure. Returns `true` when the whole access is in range and was
/// applied, `false` (nothing written) otherwise. Never panics.
pub fn write_config_bytes(config: &mut [u8], offset: u64, data: &[u8]) -> bool {
    match config_range(config.len(), offset, data.len()) {
        Some((start, end)) => {
            config[start..end].copy_from_slice(data);
            true
        }
        None => {
            tracing::debug!(
                offset,
                len = data.len(),
                size = config.len(),
                "virtio config write out of range ignored"
            );
            false
        }
    }
}

/// `[start, end)` of an access of `len` bytes at `offset` if it lies wholly
/// inside a buffer of `size` bytes.
fn config_range(size: usize, offset: u64, len: usize) -> Option<(usize, usize)> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(len)?;
    (end <= size).then_some((start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_bytes_bounds() {
        let mut cfg = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let mut d = [0u8; 4];
        assert!(read_config_bytes(&cfg, 4, &mut d));
        assert_eq!(d, [5, 6, 7, 8]);
        let mut d = [0xaau8; 4];
        assert!(!read_config_bytes(&cfg, 5, &mut d));
        assert_eq!(d, [0xaa; 4]);
        assert!(!read_config_bytes(&cfg, u64::MAX, &mut d));
        assert!(!read_config_bytes(&cfg, u64::MAX - 1, &mut d[..1]));
        assert!(read_config_bytes(&cfg, 8, &mut []));
        assert_eq!(config_slice(&cfg, 6, 2), Some(&cfg[6..]));
        assert_eq!(config_slice(&cfg, 6, 3), None);
        assert_eq!(config_slice(&cfg, u64::MAX, 2), None);

        assert!(write_config_bytes(&mut cfg, 6, &[9, 9]));
        assert_eq!(cfg, [1, 2, 3, 4, 5, 6, 9, 9]);
        assert!(!write_config_bytes(&mut cfg, 7, &[0, 0]));
        assert!(!write_config_bytes(&mut cfg, u64::MAX, &[0]));
        assert_eq!(cfg, [1, 2, 3, 4, 5, 6, 9, 9]);
    }

    #[test]
    fn feature_bits_match_spec() {
        assert_eq!(features::VERSION_1, 1 << 32);
        assert_eq!(features::RING_EVENT_IDX, 1 << 29);
        assert_eq!(features::RING_INDIRECT_DESC, 1 << 28);
        assert_eq!(features::RING_PACKED, 1 << 34);
        assert_eq!(features::RING_RESET, 1 << 40);
        assert_eq!(
            status::DEVICE_NEEDS_RESET,
            virtio_bindings::virtio_config::VIRTIO_CONFIG_S_NEEDS_RESET
        );
        assert_eq!(
            status::FEATURES_OK,
            virtio_bindings::virtio_config::VIRTIO_CONFIG_S_FEATURES_OK
        );
    }
}
