//! The virtio-mmio transport, register layout version 2 (virtio 1.2 §4.2.2).
//!
//! [`MmioTransport`] wraps one [`VirtioDevice`] and serves the guest's MMIO
//! accesses to its register window (it implements [`crate::bus::BusDevice`]).
//! It owns feature negotiation, queue setup, the device status state machine,
//! the interrupt-status register and the device's notification and interrupt
//! eventfds:
//!
//! * one notify [`EventFd`] per queue ([`MmioTransport::queue_evts`]); the
//!   machine registers each as a KVM ioeventfd at
//!   `base + `[`QUEUE_NOTIFY`] with a 4-byte datamatch on the queue index
//!   ([`MmioTransport::ioeventfds`] lists them). A QueueNotify write that
//!   still reaches the transport as an MMIO exit writes the same eventfd.
//! * one interrupt [`EventFd`] ([`MmioTransport::interrupt_evt`]) the machine
//!   registers as a KVM irqfd on the device's GSI (edge-triggered). The
//!   transport sets the InterruptStatus bit *before* writing it.
//!
//! At DRIVER_OK the enabled queues are validated against guest memory and
//! handed to the device ([`VirtioDevice::activate`]), then each is kicked once.
//! A failed activation or a device error sets DEVICE_NEEDS_RESET and raises a
//! configuration-change interrupt; nothing the guest writes can panic the VMM.
//!
//! Snapshots: [`MmioTransport::pause`] stops an active device's worker
//! without resetting it (the queue positions come back to the transport),
//! [`MmioTransport::save_state`] saves registers, queues and the device's
//! own state ([`super::state::TransportState`]), [`MmioTransport::restore`]
//! builds a transport around a fresh device in that state, and
//! [`MmioTransport::resume`] starts a paused or restored device again:
//! its queues are kicked once, and a restored device re-raises a pending
//! interrupt and signals a changed config space.
//!
//! Limits: modern (version 2) register layout only — a legacy driver that
//! does not accept `VIRTIO_F_VERSION_1` cannot set FEATURES_OK; no
//! shared-memory regions; no per-queue reset; no notification data.
//! Control registers take 32-bit aligned accesses only, config space 1, 2,
//! 4 or 8-byte accesses aligned to their width; anything else reads as zero
//! and is ignored on write (logged at debug level).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tracing::{debug, error};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, GuestAddress, GuestMemory, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};

use super::state::{DeviceStateError, TransportState};
use super::VirtioInterrupt;
use super::{features, status, ActivateError, ActiveQueue, GuestMemoryMmap, VirtioDevice};
use crate::guest_log;
use crate::sync::MutexExt;

/// Offset of MagicValue (R): always [`MAGIC_VALUE`].
pub const MAGIC: u64 = 0x000;
/// Offset of Version (R): always [`MMIO_VERSION`].
pub const VERSION: u64 = 0x004;
/// Offset of DeviceID (R): the virtio device type.
pub const DEVICE_ID: u64 = 0x008;
/// Offset of VendorID (R): always [`VENDOR_ID_VALUE`].
pub const VENDOR_ID: u64 = 0x00c;
/// Offset of DeviceFeatures (R): 32 feature bits of the page chosen by
/// DeviceFeaturesSel.
pub const DEVICE_FEATURES: u64 = 0x010;
/// Offset of DeviceFeaturesSel (W): feature page (0 = bits 0..31, 1 = 32..63).
pub const DEVICE_FEATURES_SEL: u64 = 0x014;
/// Offset of DriverFeatures (W): 32 accepted feature bits of the page chosen
/// by DriverFeaturesSel.
pub const DRIVER_FEATURES: u64 = 0x020;
/// Offset of DriverFeaturesSel (W): feature page for DriverFeatures.
pub const DRIVER_FEATURES_SEL: u64 = 0x024;
/// Offset of QueueSel (W): the queue the Queue* registers refer to.
pub const QUEUE_SEL: u64 = 0x030;
/// Offset of QueueNumMax (R): maximum size of the selected queue, 0 if it
/// does not exist.
pub const QUEUE_NUM_MAX: u64 = 0x034;
/// Offset of QueueNum (W): size the driver chose for the selected queue.
pub const QUEUE_NUM: u64 = 0x038;
/// Offset of QueueReady (RW): 1 once the driver finished setting up the
/// selected queue.
pub const QUEUE_READY: u64 = 0x044;
/// Offset of QueueNotify (W): the driver writes a queue index to kick it.
/// This is where the machine registers the ioeventfds.
pub const QUEUE_NOTIFY: u64 = 0x050;
/// Offset of InterruptStatus (R): pending [`INT_VRING`] / [`INT_CONFIG`].
pub const INTERRUPT_STATUS: u64 = 0x060;
/// Offset of InterruptACK (W): clears the written InterruptStatus bits.
pub const INTERRUPT_ACK: u64 = 0x064;
/// Offset of Status (RW): device status bits ([`super::status`]); writing 0
/// resets the device.
pub const STATUS: u64 = 0x070;
/// Offset of QueueDescLow (W): descriptor table address, bits 0..31.
pub const QUEUE_DESC_LOW: u64 = 0x080;
/// Offset of QueueDescHigh (W): descriptor table address, bits 32..63.
pub const QUEUE_DESC_HIGH: u64 = 0x084;
/// Offset of QueueDriverLow (W): available ring address, bits 0..31.
pub const QUEUE_DRIVER_LOW: u64 = 0x090;
/// Offset of QueueDriverHigh (W): available ring address, bits 32..63.
pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
/// Offset of QueueDeviceLow (W): used ring address, bits 0..31.
pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
/// Offset of QueueDeviceHigh (W): used ring address, bits 32..63.
pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
/// Offset of SHMSel (W): shared memory region selector.
pub const SHM_SEL: u64 = 0x0ac;
/// Offset of SHMLenLow (R): selected region length, bits 0..31.
pub const SHM_LEN_LOW: u64 = 0x0b0;
/// Offset of SHMLenHigh (R): selected region length, bits 32..63.
pub const SHM_LEN_HIGH: u64 = 0x0b4;
/// Offset of SHMBaseLow (R): selected region base, bits 0..31.
pub const SHM_BASE_LOW: u64 = 0x0b8;
/// Offset of SHMBaseHigh (R): selected region base, bits 32..63.
pub const SHM_BASE_HIGH: u64 = 0x0bc;
/// Offset of ConfigGeneration (R): changes whenever the device changes its
/// configuration space, so the driver can detect torn multi-access reads.
pub const CONFIG_GENERATION: u64 = 0x0fc;
/// Offset of the device-specific configuration space.
pub const CONFIG_SPACE: u64 = 0x100;

/// MagicValue register contents: "virt" in little-endian ASCII.
pub const MAGIC_VALUE: u32 = 0x7472_6976;
/// Version register contents: 2 = modern (virtio 1.x) register layout.
pub const MMIO_VERSION: u32 = 2;
/// VendorID register contents. Drivers do not interpret it; this is "CWRK"
/// in little-endian ASCII, to tell our devices apart in guest dumps.
pub const VENDOR_ID_VALUE: u32 = u32::from_le_bytes(*b"CWRK");
/// What SHMLen*/SHMBase* read for a non-existent region: all ones
/// (virtio 1.2 §4.2.2: a length of -1 means "no such region").
pub const SHM_NONE: u32 = u32::MAX;
/// InterruptStatus bit: the device used buffers in at least one queue.
pub const INT_VRING: u32 = 0x1;
/// InterruptStatus bit: the device configuration changed (also raised on
/// DEVICE_NEEDS_RESET).
pub const INT_CONFIG: u32 = 0x2;
/// Size of the register window up to the start of config space; the slot the
/// machine gives a device must be at least this plus the device's config
/// size (a 4 KiB slot fits every virtio device).
pub const REGISTERS_SIZE: u64 = CONFIG_SPACE;

/// How many guest-triggered messages (protocol violations, activations,
/// resets, device errors) a transport logs at their own level; later ones
/// go to debug level, so a hostile guest cannot flood the host log.
pub const GUEST_LOG_BUDGET: u32 = 32;

/// Status bits a driver may write (the device owns DEVICE_NEEDS_RESET).
const DRIVER_STATUS_BITS: u32 =
    status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK | status::FAILED;

/// Alignment the split-ring layout requires of the descriptor table.
const DESC_TABLE_ALIGN: u64 = 16;
/// Alignment the split-ring layout requires of the available ring.
const AVAIL_RING_ALIGN: u64 = 2;
/// Alignment the split-ring layout requires of the used ring.
const USED_RING_ALIGN: u64 = 4;
/// Bytes per descriptor table entry.
const DESC_SIZE: u64 = 16;
/// Available ring: flags + idx + used_event, plus 2 bytes per entry.
const AVAIL_RING_FIXED: u64 = 6;
/// Used ring: flags + idx + avail_event, plus 8 bytes per entry.
const USED_RING_FIXED: u64 = 6;

/// Errors building a transport.
#[derive(Debug, thiserror::Error)]
pub enum MmioTransportError {
    /// The device model declared an impossible queue size.
    #[error("device type {device_type} declares queue {index} with max size {size}; virtio queue sizes must be powers of two in 1..=32768 (fix the device model)")]
    InvalidQueueMaxSize {
        /// Device type.
        device_type: u32,
        /// Queue index.
        index: usize,
        /// Declared size.
        size: u16,
    },
    /// The device model declared more queues than QueueSel can address.
    #[error("device type {device_type} declares {count} queues; at most 65535 are addressable")]
    TooManyQueues {
        /// Device type.
        device_type: u32,
        /// Declared count.
        count: usize,
    },
    /// The device model declared type 0, which drivers treat as "no device".
    #[error(
        "device type 0 is reserved as \"no device\" by the virtio spec (fix the device model)"
    )]
    InvalidDeviceType,
    /// Creating an eventfd failed.
    #[error("cannot create the {what} eventfd: {source}; check the process fd limit")]
    EventFd {
        /// Which eventfd.
        what: &'static str,
        /// OS error.
        source: io::Error,
    },
    /// A saved transport or device state cannot be restored into this
    /// device ([`MmioTransport::restore`]).
    #[error(transparent)]
    State(#[from] DeviceStateError),
}

/// State shared between the transport and the interrupt handles it gives to
/// device threads.
struct Shared {
    /// InterruptStatus register.
    interrupt_status: AtomicU32,
    /// Set by a device error or a failed activation; cleared by reset.
    needs_reset: AtomicBool,
    /// ConfigGeneration register.
    config_generation: AtomicU32,
    /// Activation counter: an interrupt handle from an older activation is
    /// inert.
    epoch: AtomicU64,
    /// Registered by the machine as the device's irqfd.
    irq: EventFd,
    /// See [`GUEST_LOG_BUDGET`].
    log_budget: Arc<AtomicU32>,
}

impl Shared {
    fn raise(&self, bit: u32) -> io::Result<()> {
        // The bit must be visible before the guest can take the interrupt and
        // read InterruptStatus.
        self.interrupt_status.fetch_or(bit, Ordering::SeqCst);
        self.irq.write(1)
    }

    fn config_changed(&self) -> io::Result<()> {
        self.config_generation.fetch_add(1, Ordering::SeqCst);
        self.raise(INT_CONFIG)
    }

    fn set_needs_reset(&self) -> io::Result<()> {
        self.needs_reset.store(true, Ordering::SeqCst);
        self.config_changed()
    }
}

/// The [`VirtioInterrupt`] handed to a device at activation.
struct MmioInterrupt {
    shared: Arc<Shared>,
    epoch: u64,
}

impl MmioInterrupt {
    fn current(&self) -> bool {
        let live = self.shared.epoch.load(Ordering::SeqCst) == self.epoch;
        if !live {
            debug!(
                epoch = self.epoch,
                "signal from a reset device activation dropped"
            );
        }
        live
    }
}

impl VirtioInterrupt for MmioInterrupt {
    fn signal_used_queue(&self, _queue: u16) -> io::Result<()> {
        if !self.current() {
            return Ok(());
        }
        self.shared.raise(INT_VRING)
    }

    fn signal_config_change(&self) -> io::Result<()> {
        if !self.current() {
            return Ok(());
        }
        self.shared.config_changed()
    }

    fn signal_needs_reset(&self) -> io::Result<()> {
        if !self.current() {
            return Ok(());
        }
        guest_log!(
            &self.shared.log_budget,
            warn,
            "virtio device reported an error; setting DEVICE_NEEDS_RESET"
        );
        self.shared.set_needs_reset()
    }
}

/// Register state guarded by the transport mutex.
struct State {
    device: Box<dyn VirtioDevice>,
    device_type: u32,
    mem: GuestMemoryMmap,
    /// Offered features (device's, plus VERSION_1, minus unsupported).
    offered: u64,
    /// Driver-written feature bits of pages 0 and 1.
    driver_features: u64,
    /// The driver wrote a non-zero value to a feature page above 1.
    driver_features_beyond: bool,
    device_features_sel: u32,
    driver_features_sel: u32,
    queue_sel: u32,
    queues: Vec<Queue>,
    /// Status as written by the driver (DEVICE_NEEDS_RESET lives in Shared).
    status: u32,
    activated: bool,
    /// Activated, but its worker is stopped ([`MmioTransport::pause`], or
    /// restored from a snapshot): the queue positions are in `queues`
    /// until [`MmioTransport::resume`].
    paused: bool,
    /// What [`MmioTransport::resume`] must tell the driver once the device
    /// serves again (a restored device).
    on_resume: OnResume,
    /// The device failed to reset: it stays in DEVICE_NEEDS_RESET for good.
    broken: bool,
    /// See [`GUEST_LOG_BUDGET`] (shared with [`Shared`]).
    log_budget: Arc<AtomicU32>,
}

/// Interrupts a restored device owes its driver when it resumes.
#[derive(Debug, Default, Clone, Copy)]
struct OnResume {
    /// InterruptStatus was not zero when the snapshot was taken: raise the
    /// line again (the irqfd injection may not have reached the saved
    /// irqchip; an extra one only costs the driver a status read).
    raise: bool,
    /// The config space differs from the one the driver saw: a
    /// configuration-change interrupt.
    config_changed: bool,
}

/// The name of a virtio device type in messages.
fn type_name(device_type: u32) -> &'static str {
    match device_type {
        2 => "blk",
        4 => "rng",
        5 => "balloon",
        19 => "vsock",
        26 => "virtio-fs",
        #[cfg(any(test, feature = "test-devices"))]
        super::testdev::TEST_DEVICE_ID => "testdev",
        _ => "virtio",
    }
}

/// A virtio-mmio (version 2) transport around one device.
///
/// Thread-safe: vCPU threads call [`read`](Self::read) / [`write`](Self::write)
/// concurrently; register state sits behind one mutex, QueueNotify takes no
/// lock.
pub struct MmioTransport {
    state: Mutex<State>,
    shared: Arc<Shared>,
    queue_evts: Vec<EventFd>,
    /// QueueNotify writes that arrived as MMIO exits (see
    /// [`MmioTransport::notify_exits`]).
    notify_exits: AtomicU64,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("queues", &self.queue_evts.len())
            .finish_non_exhaustive()
    }
}

impl MmioTransport {
    /// Wraps `device`, whose queues live in `mem`.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
    ) -> Result<Self, MmioTransportError> {
        let device_type = device.device_type();
        if device_type == 0 {
            return Err(MmioTransportError::InvalidDeviceType);
        }
        let sizes = device.queue_max_sizes().to_vec();
        if sizes.len() > usize::from(u16::MAX) {
            return Err(MmioTransportError::TooManyQueues {
                device_type,
                count: sizes.len(),
            });
        }
        let mut queues = Vec::with_capacity(sizes.len());
        let mut queue_evts = Vec::with_capacity(sizes.len());
        for (index, &size) in sizes.iter().enumerate() {
            let q = Queue::new(size).map_err(|_| MmioTransportError::InvalidQueueMaxSize {
                device_type,
                index,
                size,
            })?;
            queues.push(q);
            queue_evts.push(EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC).map_err(|source| {
                MmioTransportError::EventFd {
                    what: "queue notify",
                    source,
                }
            })?);
        }
        let irq = EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC).map_err(|source| {
            MmioTransportError::EventFd {
                what: "interrupt",
                source,
            }
        })?;
        let offered =
            (device.avail_features() | features::VERSION_1) & !features::UNSUPPORTED_BY_TRANSPORT;
        let log_budget = Arc::new(AtomicU32::new(GUEST_LOG_BUDGET));
        Ok(Self {
            state: Mutex::new(State {
                device,
                device_type,
                mem,
                offered,
                driver_features: 0,
                driver_features_beyond: false,
                device_features_sel: 0,
                driver_features_sel: 0,
                queue_sel: 0,
                queues,
                status: 0,
                activated: false,
                paused: false,
                on_resume: OnResume::default(),
                broken: false,
                log_budget: log_budget.clone(),
            }),
            shared: Arc::new(Shared {
                interrupt_status: AtomicU32::new(0),
                needs_reset: AtomicBool::new(false),
                config_generation: AtomicU32::new(0),
                epoch: AtomicU64::new(0),
                irq,
                log_budget,
            }),
            queue_evts,
            notify_exits: AtomicU64::new(0),
        })
    }

    /// The interrupt eventfd, to register as a KVM irqfd on the device's GSI.
    pub fn interrupt_evt(&self) -> &EventFd {
        &self.shared.irq
    }

    /// One notify eventfd per queue, by index, to register as KVM ioeventfds
    /// at `base + QUEUE_NOTIFY` with a 4-byte datamatch on the index.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// `(eventfd, guest physical address, datamatch)` for every queue of a
    /// transport mapped at `base`: exactly what `KVM_IOEVENTFD` needs (the
    /// datamatch is 32 bits wide, the width of the driver's write).
    pub fn ioeventfds(&self, base: u64) -> impl Iterator<Item = (&EventFd, u64, u32)> + '_ {
        let addr = base.wrapping_add(QUEUE_NOTIFY);
        self.queue_evts
            .iter()
            .enumerate()
            .map(move |(i, evt)| (evt, addr, i as u32))
    }

    /// How many QueueNotify writes reached the transport as MMIO exits
    /// rather than through a KVM ioeventfd. Stays 0 when the machine
    /// registered [`ioeventfds`](Self::ioeventfds) (each exit costs a
    /// round trip to userspace: a growing count means the wiring is wrong).
    pub fn notify_exits(&self) -> u64 {
        self.notify_exits.load(Ordering::Relaxed)
    }

    /// The wrapped device's virtio type.
    pub fn device_type(&self) -> u32 {
        self.lock().device_type
    }

    /// Current value of the Status register.
    pub fn status(&self) -> u32 {
        let st = self.lock();
        self.status_value(&st)
    }

    /// Whether the device is active (DRIVER_OK accepted and activation
    /// succeeded, not reset since).
    pub fn is_activated(&self) -> bool {
        self.lock().activated
    }

    /// Resets the device as if the driver had written 0 to Status: stops the
    /// device's worker. The machine calls this when the VM stops so that
    /// every device thread is joined.
    pub fn shutdown(&self) {
        let mut st = self.lock();
        self.reset(&mut st);
    }

    /// Whether the device is activated but stopped by [`Self::pause`] (or
    /// restored and not resumed yet).
    pub fn is_paused(&self) -> bool {
        self.lock().paused
    }

    /// Stops an active device's worker without resetting it, the queue
    /// positions coming back to the transport: the VM is pausing (no vCPU
    /// runs, so no register access races this). Nothing to do for a device
    /// that is not active or already paused. On error the device keeps
    /// serving and cannot be saved.
    pub fn pause(&self) -> Result<(), DeviceStateError> {
        let mut st = self.lock();
        if !st.activated || st.paused {
            return Ok(());
        }
        let queues = st.device.pause()?;
        // Handles given to the stopped worker are inert from here.
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for aq in queues {
            if let Some(q) = st.queues.get_mut(usize::from(aq.index)) {
                *q = aq.queue;
            }
        }
        st.paused = true;
        Ok(())
    }

    /// Restarts a device stopped by [`Self::pause`] or restored from a
    /// snapshot ([`Self::restore`]): its queues, positions included, go
    /// back to it with a fresh interrupt handle and every queue is kicked
    /// once, as at activation (a chain the driver posted while the device
    /// was stopped may have no kick to come, notably under EVENT_IDX). A
    /// restored device then gets the interrupts it owes the driver. A
    /// failure puts the device in DEVICE_NEEDS_RESET, as a failed
    /// activation does.
    pub fn resume(&self) {
        let mut st = self.lock();
        if !st.paused {
            return;
        }
        st.paused = false;
        st.activated = false;
        self.start_device(&mut st, true);
        let owed = std::mem::take(&mut st.on_resume);
        if st.activated {
            if owed.raise {
                if let Err(e) = self.shared.irq.write(1) {
                    error!("virtio-mmio: cannot raise the interrupt of a restored device: {e}");
                }
            }
            if owed.config_changed {
                if let Err(e) = self.shared.config_changed() {
                    error!("virtio-mmio: cannot raise the config interrupt: {e}");
                }
            }
        }
    }

    /// The transport's and the device's state for a snapshot. The device
    /// must be paused ([`Self::pause`]) or never activated; the device may
    /// still use its queues first ([`VirtioDevice::save_state`]).
    pub fn save_state(&self) -> Result<TransportState, DeviceStateError> {
        let mut st = self.lock();
        let device_type = st.device_type;
        if st.activated && !st.paused {
            return Err(DeviceStateError::Stop {
                device: type_name(device_type),
                reason: "the device still runs: pause the VM before saving it".into(),
            });
        }
        let State {
            device,
            mem,
            queues,
            ..
        } = &mut *st;
        let device_bytes = device.save_state(mem, queues)?;
        Ok(TransportState {
            device_type,
            offered: st.offered,
            driver_features: st.driver_features,
            driver_features_beyond: st.driver_features_beyond,
            device_features_sel: st.device_features_sel,
            driver_features_sel: st.driver_features_sel,
            queue_sel: st.queue_sel,
            status: st.status,
            activated: st.activated,
            broken: st.broken,
            needs_reset: self.shared.needs_reset.load(Ordering::SeqCst),
            interrupt_status: self.shared.interrupt_status.load(Ordering::SeqCst),
            config_generation: self.shared.config_generation.load(Ordering::SeqCst),
            queues: st.queues.iter().map(|q| q.state().into()).collect(),
            config: st.device.config_snapshot(),
            device: device_bytes,
        })
    }

    /// A transport around `device` (freshly built, with the backends of the
    /// new VM: another session disk, another grant table) in the state
    /// `saved`: registers, queues with their positions, the device's own
    /// state. An active device comes back paused: [`Self::resume`] starts
    /// it once the rest of the machine is restored. Everything in `saved`
    /// is checked as if a driver had written it (device type and queue
    /// sizes must match the device, negotiated features must still be
    /// offered and accepted, every ready queue of an active device must
    /// lie in `mem`); a mismatch is an error and nothing runs.
    pub fn restore(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
        saved: &TransportState,
    ) -> Result<Self, MmioTransportError> {
        let t = Self::new(device, mem)?;
        {
            let mut st = t.lock();
            t.load_state(&mut st, saved)?;
        }
        Ok(t)
    }

    fn load_state(&self, st: &mut State, saved: &TransportState) -> Result<(), DeviceStateError> {
        let name = type_name(st.device_type);
        let mismatch = |reason: String| DeviceStateError::Mismatch {
            device: name,
            reason,
        };
        let invalid = |reason: String| DeviceStateError::Invalid {
            device: name,
            reason,
        };
        if saved.device_type != st.device_type {
            return Err(mismatch(format!(
                "saved as virtio device type {}, restored into type {}",
                saved.device_type, st.device_type
            )));
        }
        let max_sizes: Vec<u16> = st.queues.iter().map(|q| q.max_size()).collect();
        let saved_sizes: Vec<u16> = saved.queues.iter().map(|q| q.max_size).collect();
        if max_sizes != saved_sizes {
            return Err(mismatch(format!(
                "queue sizes {saved_sizes:?} saved, the device has {max_sizes:?}"
            )));
        }
        if saved.status & !DRIVER_STATUS_BITS != 0 {
            return Err(invalid(format!("status {:#x}", saved.status)));
        }
        if saved.interrupt_status & !(INT_VRING | INT_CONFIG) != 0 {
            return Err(invalid(format!(
                "interrupt status {:#x}",
                saved.interrupt_status
            )));
        }
        let features_ok = saved.status & status::FEATURES_OK != 0;
        let driver_ok = saved.status & status::DRIVER_OK != 0;
        if saved.activated && (!features_ok || !driver_ok || saved.status & status::FAILED != 0) {
            return Err(invalid(format!("active with status {:#x}", saved.status)));
        }
        st.driver_features = saved.driver_features;
        st.driver_features_beyond = saved.driver_features_beyond;
        if features_ok && !st.accept_features() {
            return Err(mismatch(format!(
                "the driver's features {:#x} are not all offered ({:#x}) or accepted by the device",
                saved.driver_features, st.offered
            )));
        }
        let mut queues = Vec::with_capacity(saved.queues.len());
        for (index, q) in saved.queues.iter().enumerate() {
            let queue = Queue::try_from(virtio_queue::QueueState::from(*q))
                .map_err(|e| invalid(format!("queue {index}: {e}")))?;
            if saved.activated && queue.ready() {
                validate_queue(&queue, &st.mem)
                    .map_err(|reason| invalid(format!("queue {index}: {reason}")))?;
            }
            queues.push(queue);
        }
        st.device.restore_state(&saved.device)?;
        let config_changed =
            !saved.config.is_empty() && st.device.config_snapshot() != saved.config;
        st.queues = queues;
        st.device_features_sel = saved.device_features_sel;
        st.driver_features_sel = saved.driver_features_sel;
        st.queue_sel = saved.queue_sel;
        st.status = saved.status;
        st.broken = saved.broken;
        // A device that had failed is not restarted: the driver resets it,
        // as it would have.
        let resume = saved.activated && !saved.needs_reset && !saved.broken;
        st.activated = resume;
        st.paused = resume;
        st.on_resume = OnResume {
            raise: saved.interrupt_status != 0,
            config_changed,
        };
        self.shared
            .interrupt_status
            .store(saved.interrupt_status, Ordering::SeqCst);
        self.shared
            .needs_reset
            .store(saved.needs_reset || saved.broken, Ordering::SeqCst);
        self.shared
            .config_generation
            .store(saved.config_generation, Ordering::SeqCst);
        Ok(())
    }

    /// Guest read of `data.len()` bytes at `offset` in the register window.
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset >= CONFIG_SPACE {
            if !config_access_ok(offset, data.len()) {
                debug!(offset, len = data.len(), "virtio-mmio: bad config read");
                return;
            }
            self.lock().device.read_config(offset - CONFIG_SPACE, data);
            return;
        }
        let Ok(out) = <&mut [u8; 4]>::try_from(data) else {
            debug!(offset, "virtio-mmio: register read of wrong width ignored");
            return;
        };
        if offset % 4 != 0 {
            debug!(offset, "virtio-mmio: misaligned register read ignored");
            return;
        }
        let v = self.read_reg(offset);
        *out = v.to_le_bytes();
    }

    /// Guest write of `data` at `offset` in the register window.
    pub fn write(&self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE {
            if !config_access_ok(offset, data.len()) {
                debug!(offset, len = data.len(), "virtio-mmio: bad config write");
                return;
            }
            self.lock().device.write_config(offset - CONFIG_SPACE, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            debug!(offset, "virtio-mmio: register write of wrong width ignored");
            return;
        };
        if offset % 4 != 0 {
            debug!(offset, "virtio-mmio: misaligned register write ignored");
            return;
        }
        self.write_reg(offset, u32::from_le_bytes(bytes));
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock would be a VMM bug; the register
        // state is still consistent enough to keep serving the guest.
        self.state.locked()
    }

    fn status_value(&self, st: &State) -> u32 {
        if st.broken || self.shared.needs_reset.load(Ordering::SeqCst) {
            st.status | status::DEVICE_NEEDS_RESET
        } else {
            st.status
        }
    }

    fn read_reg(&self, offset: u64) -> u32 {
        match offset {
            MAGIC => MAGIC_VALUE,
            VERSION => MMIO_VERSION,
            VENDOR_ID => VENDOR_ID_VALUE,
            INTERRUPT_STATUS => self.shared.interrupt_status.load(Ordering::SeqCst),
            CONFIG_GENERATION => self.shared.config_generation.load(Ordering::SeqCst),
            SHM_LEN_LOW | SHM_LEN_HIGH | SHM_BASE_LOW | SHM_BASE_HIGH => SHM_NONE,
            _ => {
                let st = self.lock();
                match offset {
                    DEVICE_ID => st.device_type,
                    DEVICE_FEATURES => match st.device_features_sel {
                        0 => st.offered as u32,
                        1 => (st.offered >> 32) as u32,
                        _ => 0,
                    },
                    QUEUE_NUM_MAX => st.selected_queue().map_or(0, |q| q.max_size().into()),
                    QUEUE_READY => st.selected_queue().map_or(0, |q| q.ready().into()),
                    STATUS => self.status_value(&st),
                    _ => {
                        debug!(
                            offset,
                            "virtio-mmio: read of unknown or write-only register"
                        );
                        0
                    }
                }
            }
        }
    }

    fn write_reg(&self, offset: u64, value: u32) {
        match offset {
            QUEUE_NOTIFY => {
                self.notify_exits.fetch_add(1, Ordering::Relaxed);
                self.notify(value)
            }
            INTERRUPT_ACK => {
                self.shared
                    .interrupt_status
                    .fetch_and(!(value & (INT_VRING | INT_CONFIG)), Ordering::SeqCst);
            }
            _ => {
                let mut st = self.lock();
                match offset {
                    DEVICE_FEATURES_SEL => st.device_features_sel = value,
                    DRIVER_FEATURES_SEL => st.driver_features_sel = value,
                    DRIVER_FEATURES => st.write_driver_features(value),
                    QUEUE_SEL => st.queue_sel = value,
                    SHM_SEL => debug!(value, "virtio-mmio: SHMSel written; no regions"),
                    QUEUE_NUM | QUEUE_READY | QUEUE_DESC_LOW | QUEUE_DESC_HIGH
                    | QUEUE_DRIVER_LOW | QUEUE_DRIVER_HIGH | QUEUE_DEVICE_LOW
                    | QUEUE_DEVICE_HIGH => st.write_queue_reg(offset, value),
                    STATUS => self.write_status(&mut st, value),
                    _ => debug!(
                        offset,
                        value, "virtio-mmio: write to unknown or read-only register ignored"
                    ),
                }
            }
        }
    }

    /// QueueNotify reached us as an MMIO exit (no ioeventfd registered, or
    /// a write that did not match): kick the same eventfd.
    fn notify(&self, value: u32) {
        match self.queue_evts.get(value as usize) {
            Some(evt) => {
                if let Err(e) = evt.write(1) {
                    error!(
                        queue = value,
                        "virtio-mmio: cannot signal queue notify: {e}"
                    );
                }
            }
            None => debug!(
                queue = value,
                "virtio-mmio: notify of non-existent queue ignored"
            ),
        }
    }

    fn write_status(&self, st: &mut State, value: u32) {
        if value == 0 {
            self.reset(st);
            return;
        }
        if st.broken {
            guest_log!(
                &st.log_budget,
                warn,
                value,
                "virtio-mmio: status write to a device that failed to reset ignored"
            );
            return;
        }
        // The driver echoes back what it read, which may include the device's
        // NEEDS_RESET bit: that bit is not the driver's to set or clear.
        let value = value & !status::DEVICE_NEEDS_RESET;
        if value & !DRIVER_STATUS_BITS != 0 {
            guest_log!(
                &st.log_budget,
                warn,
                value,
                "virtio-mmio: status write with unknown bits ignored"
            );
            return;
        }
        let cur = st.status;
        if value & cur != cur {
            guest_log!(
                &st.log_budget,
                warn,
                cur,
                value,
                "virtio-mmio: status bits can only be cleared by a reset; write ignored"
            );
            return;
        }
        let mut new = value;
        let added = new & !cur;
        if added == 0 {
            return;
        }
        // Each step needs the previous one (virtio 1.2 §3.1.1).
        if (new & status::DRIVER != 0 && new & status::ACKNOWLEDGE == 0)
            || (new & status::FEATURES_OK != 0 && new & status::DRIVER == 0)
            || (new & status::DRIVER_OK != 0 && new & status::FEATURES_OK == 0)
        {
            guest_log!(
                &st.log_budget,
                warn,
                cur,
                value,
                "virtio-mmio: status bits set out of order; write ignored"
            );
            return;
        }
        if added & status::FEATURES_OK != 0 && !st.accept_features() {
            new &= !status::FEATURES_OK;
        }
        if new & status::DRIVER_OK != 0 && new & status::FEATURES_OK == 0 {
            guest_log!(
                &st.log_budget,
                warn,
                "virtio-mmio: DRIVER_OK without accepted features ignored"
            );
            new &= !status::DRIVER_OK;
        }
        st.status = new;
        let activate = new & !cur & status::DRIVER_OK != 0;
        if activate {
            if new & status::FAILED != 0 || self.shared.needs_reset.load(Ordering::SeqCst) {
                guest_log!(
                    &st.log_budget,
                    warn,
                    status = self.status_value(st),
                    "virtio-mmio: DRIVER_OK on a failed device; not activating"
                );
                return;
            }
            self.activate(st);
        }
    }

    fn activate(&self, st: &mut State) {
        self.start_device(st, false);
    }

    /// Activates the device (`resume`: resumes it) with the enabled queues.
    fn start_device(&self, st: &mut State, resume: bool) {
        let epoch = self.shared.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        let result = self.prepare_queues(st).and_then(|queues| {
            let n = queues.len();
            let interrupt: Arc<dyn VirtioInterrupt> = Arc::new(MmioInterrupt {
                shared: self.shared.clone(),
                epoch,
            });
            let mem = st.mem.clone();
            let kicks: Vec<u16> = queues.iter().map(|q| q.index).collect();
            if resume {
                st.device.resume(mem, interrupt, queues)?;
            } else {
                st.device.activate(mem, interrupt, queues)?;
            }
            Ok((n, kicks))
        });
        match result {
            Ok((n, kicks)) => {
                st.activated = true;
                guest_log!(
                    &st.log_budget,
                    info,
                    device_type = st.device_type,
                    queues = n,
                    resume,
                    "virtio-mmio: device activated"
                );
                // Buffers may have been posted (and kicked into a notify fd
                // the device drained at reset, or not kicked at all) before
                // DRIVER_OK: make the device look at every queue once.
                for i in kicks {
                    self.notify(u32::from(i));
                }
            }
            Err(e) => {
                guest_log!(
                    &st.log_budget,
                    error,
                    device_type = st.device_type,
                    "virtio-mmio: activation failed: {e}"
                );
                if let Err(e) = self.shared.set_needs_reset() {
                    error!("virtio-mmio: cannot raise the config interrupt: {e}");
                }
            }
        }
    }

    /// Validates every enabled queue and builds the device's copies.
    fn prepare_queues(&self, st: &State) -> Result<Vec<ActiveQueue>, ActivateError> {
        let event_idx = st.driver_features & features::RING_EVENT_IDX != 0;
        let mut out = Vec::new();
        for (i, q) in st.queues.iter().enumerate() {
            if !q.ready() {
                continue;
            }
            // `new` refused more than u16::MAX queues.
            let index = i as u16;
            validate_queue(q, &st.mem)
                .map_err(|reason| ActivateError::InvalidQueue { index, reason })?;
            let mut queue =
                Queue::try_from(q.state()).map_err(|e| ActivateError::InvalidQueue {
                    index,
                    reason: format!("{e}"),
                })?;
            queue.set_event_idx(event_idx);
            let notify = self.queue_evts[i]
                .try_clone()
                .map_err(|source| ActivateError::CloneEventFd { index, source })?;
            out.push(ActiveQueue {
                index,
                queue,
                notify,
            });
        }
        Ok(out)
    }

    fn reset(&self, st: &mut State) {
        if st.activated {
            if st.device.reset() {
                guest_log!(
                    &st.log_budget,
                    info,
                    device_type = st.device_type,
                    "virtio-mmio: device reset"
                );
            } else {
                error!(
                    device_type = st.device_type,
                    "virtio-mmio: device cannot be reset; it stays in DEVICE_NEEDS_RESET"
                );
                st.broken = true;
            }
            st.activated = false;
        }
        st.paused = false;
        st.on_resume = OnResume::default();
        // Interrupt handles of the previous activation become inert.
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for q in &mut st.queues {
            q.reset();
        }
        for evt in &self.queue_evts {
            // Drop stale kicks; EAGAIN when there are none.
            let _ = evt.read();
        }
        st.status = 0;
        st.driver_features = 0;
        st.driver_features_beyond = false;
        st.device_features_sel = 0;
        st.driver_features_sel = 0;
        st.queue_sel = 0;
        self.shared.interrupt_status.store(0, Ordering::SeqCst);
        self.shared.needs_reset.store(st.broken, Ordering::SeqCst);
    }
}

impl State {
    fn selected_queue(&self) -> Option<&Queue> {
        self.queues.get(self.queue_sel as usize)
    }

    fn write_driver_features(&mut self, value: u32) {
        // Features are accepted between DRIVER and FEATURES_OK only.
        if self.status & status::DRIVER == 0 || self.status & status::FEATURES_OK != 0 {
            guest_log!(
                &self.log_budget,
                warn,
                status = self.status,
                "virtio-mmio: DriverFeatures written outside feature negotiation; ignored"
            );
            return;
        }
        match self.driver_features_sel {
            0 => self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(value),
            1 => {
                self.driver_features =
                    (self.driver_features & 0xffff_ffff) | (u64::from(value) << 32)
            }
            sel => {
                if value != 0 {
                    guest_log!(
                        &self.log_budget,
                        warn,
                        sel,
                        value,
                        "virtio-mmio: driver accepted features on a page we never offered"
                    );
                    self.driver_features_beyond = true;
                }
            }
        }
    }

    /// Checks the driver's feature selection at FEATURES_OK.
    fn accept_features(&mut self) -> bool {
        let unknown = self.driver_features & !self.offered;
        if unknown != 0 || self.driver_features_beyond {
            guest_log!(
                &self.log_budget,
                warn,
                acked = self.driver_features,
                offered = self.offered,
                "virtio-mmio: driver accepted features that were not offered; FEATURES_OK refused"
            );
            return false;
        }
        if self.driver_features & features::VERSION_1 == 0 {
            guest_log!(
                &self.log_budget,
                warn,
                "virtio-mmio: driver did not accept VIRTIO_F_VERSION_1 \
                 (legacy drivers are not supported); FEATURES_OK refused"
            );
            return false;
        }
        if !self.device.ack_features(self.driver_features) {
            guest_log!(
                &self.log_budget,
                warn,
                acked = self.driver_features,
                "virtio-mmio: device refused the feature combination; FEATURES_OK refused"
            );
            return false;
        }
        true
    }

    fn write_queue_reg(&mut self, offset: u64, value: u32) {
        let sel = self.queue_sel;
        let status = self.status;
        let Some(q) = self.queues.get_mut(sel as usize) else {
            debug!(
                queue = sel,
                offset, "virtio-mmio: write to a non-existent queue ignored"
            );
            return;
        };
        // Queues are set up after FEATURES_OK and before DRIVER_OK.
        if status & status::FEATURES_OK == 0
            || status & (status::DRIVER_OK | status::FAILED) != 0
            || self.activated
        {
            guest_log!(
                &self.log_budget,
                warn,
                queue = sel,
                offset,
                status,
                "virtio-mmio: queue register written outside queue setup; ignored"
            );
            return;
        }
        if offset == QUEUE_READY {
            match value {
                0 => q.set_ready(false),
                1 => {
                    // The spec leaves QueueNum at QueueNumMax if never written.
                    q.set_ready(true)
                }
                _ => guest_log!(
                    &self.log_budget,
                    warn,
                    queue = sel,
                    value,
                    "virtio-mmio: QueueReady must be 0 or 1"
                ),
            }
            return;
        }
        if q.ready() {
            guest_log!(
                &self.log_budget,
                warn,
                queue = sel,
                offset,
                "virtio-mmio: register of a ready queue written; ignored"
            );
            return;
        }
        let set_low = |old: u64| (old & !0xffff_ffff) | u64::from(value);
        let set_high = |old: u64| (old & 0xffff_ffff) | (u64::from(value) << 32);
        let result = match offset {
            QUEUE_NUM => {
                let max = q.max_size();
                match u16::try_from(value) {
                    Ok(n) if n != 0 && n.is_power_of_two() && n <= max => q.try_set_size(n),
                    _ => {
                        guest_log!(
                            &self.log_budget,
                            warn,
                            queue = sel,
                            value,
                            max,
                            "virtio-mmio: QueueNum must be a power of two <= QueueNumMax"
                        );
                        return;
                    }
                }
            }
            QUEUE_DESC_LOW => q.try_set_desc_table_address(GuestAddress(set_low(q.desc_table()))),
            QUEUE_DESC_HIGH => q.try_set_desc_table_address(GuestAddress(set_high(q.desc_table()))),
            QUEUE_DRIVER_LOW => q.try_set_avail_ring_address(GuestAddress(set_low(q.avail_ring()))),
            QUEUE_DRIVER_HIGH => {
                q.try_set_avail_ring_address(GuestAddress(set_high(q.avail_ring())))
            }
            QUEUE_DEVICE_LOW => q.try_set_used_ring_address(GuestAddress(set_low(q.used_ring()))),
            QUEUE_DEVICE_HIGH => q.try_set_used_ring_address(GuestAddress(set_high(q.used_ring()))),
            _ => return,
        };
        if let Err(e) = result {
            guest_log!(
                &self.log_budget,
                warn,
                queue = sel,
                offset,
                value,
                "virtio-mmio: queue register value refused: {e}"
            );
        }
    }
}

/// Whether a config-space access has a CPU-like width and natural alignment.
fn config_access_ok(offset: u64, len: usize) -> bool {
    matches!(len, 1 | 2 | 4 | 8) && offset % len as u64 == 0
}

/// Checks a ready queue against guest memory: size, alignment, and every ring
/// wholly inside one guest memory region. virtio-queue's `is_valid` is then
/// consulted too; it is stricter by one byte (it wants the byte *after* each
/// ring to be guest memory too), so a ring ending exactly at the top of a RAM
/// region is refused — no driver lays rings out that way in practice.
fn validate_queue(q: &Queue, mem: &GuestMemoryMmap) -> Result<(), String> {
    let size = q.size();
    if size == 0 || !size.is_power_of_two() || size > q.max_size() {
        return Err(format!(
            "size {size} is not a power of two <= {}",
            q.max_size()
        ));
    }
    let n = u64::from(size);
    let rings = [
        (
            "descriptor table",
            q.desc_table(),
            DESC_SIZE * n,
            DESC_TABLE_ALIGN,
        ),
        (
            "available ring",
            q.avail_ring(),
            AVAIL_RING_FIXED + 2 * n,
            AVAIL_RING_ALIGN,
        ),
        (
            "used ring",
            q.used_ring(),
            USED_RING_FIXED + 8 * n,
            USED_RING_ALIGN,
        ),
    ];
    for (what, addr, len, align) in rings {
        if addr % align != 0 {
            return Err(format!("{what} at {addr:#x} is not {align}-byte aligned"));
        }
        if !ring_in_memory(mem, GuestAddress(addr), len) {
            return Err(format!(
                "{what} at {addr:#x} (+{len:#x}) is not inside guest memory"
            ));
        }
    }
    // virtio-queue's own check (same properties, kept as a second opinion).
    if !q.is_valid(mem) {
        return Err("rejected by the queue implementation".to_string());
    }
    Ok(())
}

/// Whether `[addr, addr + len)` lies inside a single guest memory region
/// (rings are accessed as contiguous objects).
fn ring_in_memory(mem: &GuestMemoryMmap, addr: GuestAddress, len: u64) -> bool {
    let Some(last) = len.checked_sub(1).and_then(|l| addr.checked_add(l)) else {
        return false;
    };
    match (mem.find_region(addr), mem.find_region(last)) {
        (Some(a), Some(b)) => a.start_addr() == b.start_addr(),
        _ => false,
    }
}

impl crate::bus::BusDevice for MmioTransport {
    fn read(&self, offset: u64, data: &mut [u8]) {
        MmioTransport::read(self, offset, data)
    }

    fn write(&self, offset: u64, data: &[u8]) {
        MmioTransport::write(self, offset, data)
    }
}

#[cfg(test)]
mod tests;
