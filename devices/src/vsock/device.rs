//! The virtio-vsock device model ([`VsockModel`]) and its in-process face
//! ([`VsockDevice`], a [`VirtioDevice`] for the vmm's virtio-mmio transport).
//!
//! [`VsockModel`] knows queues and guest memory, nothing of KVM or vhost-user:
//! a face hands it the RX (0), TX (1) and event (2) queues with the guest
//! memory they live in, and calls [`VsockModel::process`] whenever a queue
//! was kicked or [`VsockModel::host_fd`] became readable. TX chains are parsed
//! as byte streams ([`super::packet`]); a malformed chain is consumed (used
//! with length 0) and the connection it names, if any, reset. RX buffers are
//! filled only while a connection has something to say and its guest credit
//! allows.
//!
//! [`VsockDevice`] runs the model on a worker thread
//! ([`vmm::virtio::worker`]) with an epoll loop over the queue notify
//! eventfds, the model's host fd and a stop eventfd. Its
//! config space is the 64-bit guest CID (virtio 1.2 §5.10.4). On activation
//! the event queue gets a TRANSPORT_RESET only if the host asked for one.
//!
//! Snapshots (as Firecracker does, with the three fixes its later releases
//! needed): connections do not survive a snapshot. Saving the device drops
//! every connection (the helper's streams see EOF) and posts a
//! TRANSPORT_RESET on the event queue, so the guest closes its sockets
//! (listening ones survive) and its agent dials again; the restored device
//! starts empty. On resume the device signals the event queue even though
//! the event was posted before the snapshot (the interrupt may not be in
//! the saved irqchip), its transport replays a kick of every queue (a TX
//! chain posted just before the snapshot would otherwise wait for a kick
//! that EVENT_IDX suppression never sends), and no RX packet is posted
//! until the guest has handled the reset ([`ResetAck`]): an answer to a
//! new connection that reached the guest first would be closed by the
//! reset. The guest refills the event queue right after handling an
//! event, so "handled" is "the event queue's available index moved"; the
//! device asks for a kick on that refill while it has something to send.
//!
//! Limits: no `VIRTIO_VSOCK_F_SEQPACKET`, no `VIRTIO_VSOCK_F_NO_IMPLIED_STREAM`
//! (stream only); one RX packet per RX chain (no mergeable buffers).
//!
//! [`VirtioDevice`]: vmm::virtio::VirtioDevice

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestMemory};
use vmm::virtio::in_process::{DeviceCommon, InProcessDevice};
use vmm::virtio::state::{self, DeviceStateError};
use vmm::virtio::worker::{DeviceWorker, StopError, Wakeup, WorkerLoop, WorkerSetup};
use vmm::virtio::{drain, features, ActivateError, ActiveQueue, GuestMemoryMmap, VirtioInterrupt};

use super::backend::VsockHost;
use super::muxer::{Muxer, MuxerError, MuxerStats};
use super::packet::{
    ChainReader, ChainWriter, PacketError, EVENT_SIZE, EVENT_TRANSPORT_RESET, HDR_SIZE,
};
use super::VsockConfig;

/// Virtio device ID of a socket device (virtio 1.2 §5.10).
pub const VIRTIO_ID_VSOCK: u32 = 19;
/// Index of the RX queue (device → driver packets), §5.10.2.
pub const RX_QUEUE: u16 = 0;
/// Index of the TX queue (driver → device packets), §5.10.2.
pub const TX_QUEUE: u16 = 1;
/// Index of the event queue, §5.10.2.
pub const EVENT_QUEUE: u16 = 2;
/// Number of queues of the device.
pub const NUM_QUEUES: usize = 3;
/// Maximum size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Size of the config space: `le64 guest_cid` (§5.10.4).
pub const CONFIG_SIZE: usize = 8;
/// Smallest CID a guest may have (0..=2 are reserved, §5.10.4).
pub const MIN_GUEST_CID: u64 = 3;
/// CIDs are 32-bit in practice (the upper 32 bits of `guest_cid` are
/// reserved and zeroed, §5.10.4); `u32::MAX` is `VMADDR_CID_ANY`.
pub const MAX_GUEST_CID: u64 = u32::MAX as u64 - 1;

/// Errors of the device model.
#[derive(Debug, thiserror::Error)]
pub enum VsockDeviceError {
    /// The guest CID is reserved or out of range.
    #[error("guest CID {0} is invalid; use a value in {MIN_GUEST_CID}..={MAX_GUEST_CID}")]
    InvalidCid(u64),
    /// The muxer's event sources failed.
    #[error(transparent)]
    Muxer(#[from] MuxerError),
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

/// Offset of `avail_event` in a split used ring of `size` entries: after
/// `flags`, `idx` and the ring (virtio 1.2 §2.7.8).
fn avail_event_offset(size: u16) -> u64 {
    4 + 8 * u64::from(size)
}

/// Where a snapshot's TRANSPORT_RESET stands; RX is gated unless
/// [`ResetAck::None`] (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResetAck {
    /// Nothing owed: RX flows.
    #[default]
    None,
    /// A reset is owed and not posted yet (the driver had no event buffer
    /// available): RX is gated.
    Unposted,
    /// The reset was posted when the event queue's available index was
    /// this value: RX is gated until the driver makes another event buffer
    /// available, which it does once it has handled the event.
    Posted(u16),
}

/// The virtio-vsock device model (see the module docs).
pub struct VsockModel {
    guest_cid: u64,
    muxer: Muxer,
    reset_ack: ResetAck,
}

impl VsockModel {
    /// A model for a guest with `guest_cid`, whose host side is `host`.
    pub fn new(
        guest_cid: u64,
        config: VsockConfig,
        host: &VsockHost,
    ) -> Result<Self, VsockDeviceError> {
        check_cid(guest_cid)?;
        Ok(Self {
            guest_cid,
            muxer: Muxer::new(guest_cid, config, host.shared.clone())?,
            reset_ack: ResetAck::None,
        })
    }

    /// Where a snapshot's TRANSPORT_RESET stands.
    pub fn reset_ack(&self) -> ResetAck {
        self.reset_ack
    }

    /// Puts a restored model where the snapshot's reset stood: an unposted
    /// one is owed again (and posted once the driver has an event buffer).
    pub fn set_reset_ack(&mut self, ack: ResetAck) {
        if ack == ResetAck::Unposted {
            self.muxer.reset_all();
        }
        self.reset_ack = ack;
    }

    /// For a snapshot: drops every connection and posts a TRANSPORT_RESET
    /// on the event queue `q` (when the driver has a buffer there; else it
    /// is posted as soon as one comes), gating RX until the guest has
    /// handled it.
    pub fn post_transport_reset<M: GuestMemory>(
        &mut self,
        mem: &M,
        q: &mut Queue,
    ) -> Result<(), VsockDeviceError> {
        self.muxer.reset_all();
        self.reset_ack = ResetAck::Unposted;
        self.process_event(mem, q)?;
        Ok(())
    }

    /// Guest-triggered warnings the model will still log at warning level
    /// before going quiet ([`super::muxer::WARN_LOG_BUDGET`] at start).
    pub fn log_budget_left(&self) -> u32 {
        self.muxer
            .log_budget()
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The guest CID.
    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    /// Becomes readable when host-side work is pending; poll it (level
    /// triggered) and call [`Self::process`].
    pub fn host_fd(&self) -> RawFd {
        self.muxer.epoll_fd()
    }

    /// Counters.
    pub fn stats(&self) -> MuxerStats {
        self.muxer.stats()
    }

    /// The connection table, for diagnostics and tests.
    pub fn muxer(&self) -> &Muxer {
        &self.muxer
    }

    /// Drops every connection and owes the guest a TRANSPORT_RESET event.
    pub fn reset_transport(&mut self) {
        self.muxer.reset_all();
    }

    /// Handles host-side events only (host streams, host requests, timers),
    /// for a face whose queues are not usable yet.
    pub fn process_host_events(&mut self) -> Result<(), VsockDeviceError> {
        self.muxer.process_host_events()?;
        self.muxer.after_processing()?;
        Ok(())
    }

    /// Runs host events, then TX, then RX (and the event queue when given).
    /// Returns which queues need a used-buffer notification:
    /// `[rx, tx, event]`.
    pub fn process<M: GuestMemory>(
        &mut self,
        mem: &M,
        rx: &mut Queue,
        tx: &mut Queue,
        event: Option<&mut Queue>,
    ) -> Result<[bool; 3], VsockDeviceError> {
        self.muxer.process_host_events()?;
        let tx_sig = self.process_tx(mem, tx)?;
        let (ev_sig, gated) = match event {
            Some(q) => {
                let sig = self.process_event(mem, q)?;
                (sig, self.rx_gated(mem, q)?)
            }
            None => {
                // No event queue on this face (QEMU keeps it): nothing to tell.
                self.muxer.take_transport_reset();
                (false, false)
            }
        };
        let rx_sig = if gated {
            false
        } else {
            self.process_rx(mem, rx)?
        };
        self.muxer.after_processing()?;
        Ok([rx_sig, tx_sig, ev_sig])
    }

    /// Whether RX must wait for the guest to handle a snapshot's reset
    /// posted on the event queue `q`; asks for a kick on the driver's
    /// refill while packets wait.
    fn rx_gated<M: GuestMemory>(
        &mut self,
        mem: &M,
        q: &mut Queue,
    ) -> Result<bool, VsockDeviceError> {
        let ResetAck::Posted(at) = self.reset_ack else {
            return Ok(self.reset_ack == ResetAck::Unposted);
        };
        let qerr = |source| VsockDeviceError::Queue {
            index: EVENT_QUEUE,
            source,
        };
        let handled = |q: &Queue| -> Result<bool, VsockDeviceError> {
            Ok(q.avail_idx(mem, std::sync::atomic::Ordering::Acquire)
                .map_err(qerr)?
                .0
                != at)
        };
        if !handled(q)? && self.muxer.has_rx_work() {
            // Notify us when the driver makes the next entry available
            // (without EVENT_IDX the driver always notifies).
            if q.event_idx_enabled() {
                let addr = q
                    .used_ring()
                    .checked_add(avail_event_offset(q.size()))
                    .map(vm_memory::GuestAddress);
                if let Some(addr) = addr {
                    let _ = mem.store(u16::to_le(at), addr, std::sync::atomic::Ordering::Relaxed);
                }
                std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            }
        }
        if handled(q)? {
            debug!("vsock: the guest handled the transport reset; RX resumes");
            self.reset_ack = ResetAck::None;
            return Ok(false);
        }
        Ok(true)
    }

    /// Consumes every available TX chain. Returns whether the driver needs a
    /// notification.
    pub fn process_tx<M: GuestMemory>(
        &mut self,
        mem: &M,
        q: &mut Queue,
    ) -> Result<bool, VsockDeviceError> {
        let qerr = |source| VsockDeviceError::Queue {
            index: TX_QUEUE,
            source,
        };
        let budget = std::sync::Arc::clone(self.muxer.log_budget());
        let budget = budget.as_ref();
        drain(
            q,
            mem,
            qerr,
            |chain| {
                let head = chain.head_index();
                match ChainReader::new(mem, chain) {
                    Ok(mut reader) => match reader.read_header() {
                        Ok(hdr) => {
                            debug!(
                                op = hdr.op_name(),
                                src_port = hdr.src_port,
                                dst_port = hdr.dst_port,
                                len = hdr.len,
                                "vsock: tx"
                            );
                            self.muxer.handle_guest_packet(&hdr, &mut reader);
                        }
                        Err(e) => {
                            vmm::guest_log!(budget, warn, "vsock: TX chain {head} dropped: {e}")
                        }
                    },
                    Err(e) => vmm::guest_log!(budget, warn, "vsock: TX chain {head} dropped: {e}"),
                }
                // The device writes nothing into TX buffers.
                Ok(0)
            },
            |head, e| {
                vmm::guest_log!(budget, warn, "vsock: cannot return TX chain {head}: {e}");
                Ok(())
            },
        )
    }

    /// Fills RX chains while packets are pending. Returns whether the driver
    /// needs a notification.
    pub fn process_rx<M: GuestMemory>(
        &mut self,
        mem: &M,
        q: &mut Queue,
    ) -> Result<bool, VsockDeviceError> {
        let qerr = |source| VsockDeviceError::Queue {
            index: RX_QUEUE,
            source,
        };
        let mut used = false;
        while self.muxer.has_rx_work() {
            let chain = match q.iter(mem) {
                Ok(mut it) => it.next(),
                Err(source) => return Err(qerr(source)),
            };
            let Some(chain) = chain else {
                // Out of buffers: ask for a kick when the driver adds some.
                if q.enable_notification(mem).map_err(qerr)? {
                    continue;
                }
                break;
            };
            let head = chain.head_index();
            let mut writer = match ChainWriter::new(mem, chain) {
                Ok(w) if w.capacity() >= HDR_SIZE => w,
                Ok(w) => {
                    let e = PacketError::RxTooSmall { got: w.capacity() };
                    vmm::guest_log!(
                        self.muxer.log_budget(),
                        warn,
                        "vsock: RX chain {head} dropped: {e}"
                    );
                    used |= q.add_used(mem, head, 0).is_ok();
                    continue;
                }
                Err(e) => {
                    vmm::guest_log!(
                        self.muxer.log_budget(),
                        warn,
                        "vsock: RX chain {head} dropped: {e}"
                    );
                    used |= q.add_used(mem, head, 0).is_ok();
                    continue;
                }
            };
            let room = writer.capacity() - HDR_SIZE;
            let Some((hdr, payload)) = self.muxer.next_rx_packet(room) else {
                // Nobody had anything after all: give the chain back.
                q.go_to_previous_position();
                break;
            };
            debug!(
                op = hdr.op_name(),
                src_port = hdr.src_port,
                dst_port = hdr.dst_port,
                len = hdr.len,
                "vsock: rx"
            );
            let res = writer
                .write(&hdr.to_bytes())
                .and_then(|_| writer.write(payload));
            if let Err(e) = res {
                vmm::guest_log!(
                    self.muxer.log_budget(),
                    warn,
                    "vsock: RX chain {head} could not be written, packet lost: {e}"
                );
            }
            let len = u32::try_from(writer.written()).unwrap_or(u32::MAX);
            if let Err(e) = q.add_used(mem, head, len) {
                vmm::guest_log!(
                    self.muxer.log_budget(),
                    warn,
                    "vsock: cannot return RX chain {head}: {e}"
                );
                continue;
            }
            used = true;
        }
        Ok(used && q.needs_notification(mem).map_err(qerr)?)
    }

    /// Posts a pending TRANSPORT_RESET event. Returns whether the driver
    /// needs a notification.
    pub fn process_event<M: GuestMemory>(
        &mut self,
        mem: &M,
        q: &mut Queue,
    ) -> Result<bool, VsockDeviceError> {
        if !self.muxer.transport_reset_pending() {
            return Ok(false);
        }
        let qerr = |source| VsockDeviceError::Queue {
            index: EVENT_QUEUE,
            source,
        };
        loop {
            let chain = match q.iter(mem) {
                Ok(mut it) => it.next(),
                Err(source) => return Err(qerr(source)),
            };
            let Some(chain) = chain else {
                q.enable_notification(mem).map_err(qerr)?;
                return Ok(false);
            };
            let head = chain.head_index();
            let written = match ChainWriter::new(mem, chain) {
                Ok(mut w) if w.capacity() >= EVENT_SIZE => {
                    w.write(&EVENT_TRANSPORT_RESET.to_le_bytes()).unwrap_or(0)
                }
                Ok(_) => 0,
                Err(e) => {
                    vmm::guest_log!(
                        self.muxer.log_budget(),
                        warn,
                        "vsock: event chain {head} dropped: {e}"
                    );
                    0
                }
            };
            if q.add_used(mem, head, written as u32).is_err() {
                vmm::guest_log!(
                    self.muxer.log_budget(),
                    warn,
                    "vsock: cannot return event chain {head}"
                );
            }
            if written == EVENT_SIZE {
                self.muxer.take_transport_reset();
                debug!("vsock: TRANSPORT_RESET event posted");
                if self.reset_ack == ResetAck::Unposted {
                    let at = q
                        .avail_idx(mem, std::sync::atomic::Ordering::Acquire)
                        .map_err(qerr)?;
                    self.reset_ack = ResetAck::Posted(at.0);
                }
                return q.needs_notification(mem).map_err(qerr);
            }
        }
    }
}

fn check_cid(cid: u64) -> Result<(), VsockDeviceError> {
    if (MIN_GUEST_CID..=MAX_GUEST_CID).contains(&cid) {
        Ok(())
    } else {
        Err(VsockDeviceError::InvalidCid(cid))
    }
}

/// What a snapshot keeps of the in-process device: no connection, only
/// where the transport reset stands and the local port counter.
#[derive(Debug, Default, Serialize, Deserialize)]
struct SavedVsock {
    reset_ack: ResetAck,
    next_port: u32,
}

/// Name of the device in state errors.
const NAME: &str = "vsock";

/// The in-process face: a [`VirtioDevice`] for the vmm's virtio-mmio
/// transport, running a [`VsockModel`] on its own thread while active.
///
/// [`VirtioDevice`]: vmm::virtio::VirtioDevice
pub struct VsockDevice {
    /// First, so it is stopped before the rest is dropped. Hands the model
    /// and the queues back when stopped.
    worker: DeviceWorker<(VsockModel, Vec<ActiveQueue>)>,
    guest_cid: u64,
    config: VsockConfig,
    host: VsockHost,
    /// Config space: the guest CID.
    common: DeviceCommon,
    /// The model while the device is paused (connections and all).
    paused: Option<VsockModel>,
    /// What a restored device resumes with.
    restored: Option<SavedVsock>,
}

impl VsockDevice {
    /// A device with `guest_cid`, whose host side is `host`.
    pub fn new(
        guest_cid: u64,
        config: VsockConfig,
        host: VsockHost,
    ) -> Result<Self, VsockDeviceError> {
        check_cid(guest_cid)?;
        Ok(Self {
            worker: DeviceWorker::new("vsock"),
            guest_cid,
            config,
            host,
            common: DeviceCommon::new(
                "vsock",
                VIRTIO_ID_VSOCK,
                [QUEUE_SIZE; NUM_QUEUES],
                features::VERSION_1 | features::RING_EVENT_IDX,
                guest_cid.to_le_bytes(),
            ),
            paused: None,
            restored: None,
        })
    }

    /// Features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.common.acked_features()
    }

    /// Whether the worker runs.
    pub fn is_active(&self) -> bool {
        self.worker.is_running()
    }
}

impl InProcessDevice for VsockDevice {
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
        let model = VsockModel::new(self.guest_cid, self.config.clone(), &self.host)
            .map_err(|e| ActivateError::Device(e.to_string()))?;
        self.serve(model, mem, interrupt, queues)
    }

    fn stop(&mut self) -> bool {
        self.paused = None;
        self.restored = None;
        self.worker.stop().is_ok()
    }

    fn pause_worker(&mut self) -> Result<Vec<ActiveQueue>, DeviceStateError> {
        match self.worker.stop() {
            Ok(Some((model, queues))) => {
                self.paused = Some(model);
                Ok(queues)
            }
            Ok(None) => Ok(Vec::new()),
            Err(e) => Err(stop_error(e)),
        }
    }

    fn resume_worker(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        let model = match self.paused.take() {
            Some(model) => model,
            None => {
                let mut model = VsockModel::new(self.guest_cid, self.config.clone(), &self.host)
                    .map_err(|e| ActivateError::Device(e.to_string()))?;
                let saved = self.restored.take().unwrap_or_default();
                model.muxer.set_next_port(saved.next_port);
                model.set_reset_ack(saved.reset_ack);
                model
            }
        };
        let owed = model.reset_ack() != ResetAck::None;
        self.serve(model, mem, interrupt.clone(), queues)?;
        if owed {
            // The reset event may be in the ring without its interrupt
            // having reached the saved irqchip: signal it again.
            if let Err(e) = interrupt.signal_used_queue(EVENT_QUEUE) {
                warn!("vsock: cannot signal the event queue: {e}");
            }
        }
        Ok(())
    }

    fn save(
        &mut self,
        mem: &GuestMemoryMmap,
        queues: &mut [Queue],
    ) -> Result<Vec<u8>, DeviceStateError> {
        let saved = match self.paused.as_mut() {
            Some(model) => {
                if let Some(ev) = queues.get_mut(usize::from(EVENT_QUEUE)) {
                    model
                        .post_transport_reset(mem, ev)
                        .map_err(|e| DeviceStateError::Invalid {
                            device: NAME,
                            reason: format!("cannot post the transport reset: {e}"),
                        })?;
                    info!(
                        posted = model.reset_ack() != ResetAck::Unposted,
                        "vsock: connections reset for a snapshot"
                    );
                }
                SavedVsock {
                    reset_ack: model.reset_ack(),
                    next_port: model.muxer.next_port(),
                }
            }
            // Never activated: nothing to tell the guest.
            None => SavedVsock::default(),
        };
        state::encode(NAME, &saved)
    }

    fn load(&mut self, bytes: &[u8]) -> Result<(), DeviceStateError> {
        self.restored = Some(state::decode(NAME, bytes)?);
        Ok(())
    }
}

fn stop_error(e: StopError) -> DeviceStateError {
    DeviceStateError::Stop {
        device: NAME,
        reason: e.to_string(),
    }
}

impl VsockDevice {
    /// Starts the worker serving `model` over `queues`.
    fn serve(
        &mut self,
        model: VsockModel,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        if self.worker.is_running() {
            return Err(ActivateError::AlreadyActive);
        }
        let mut slots: [Option<ActiveQueue>; NUM_QUEUES] = [None, None, None];
        for q in queues {
            if let Some(slot) = slots.get_mut(q.index as usize) {
                *slot = Some(q);
            }
        }
        let [rx, tx, ev] = slots;
        let rx = rx.ok_or(ActivateError::MissingQueue { index: RX_QUEUE })?;
        let tx = tx.ok_or(ActivateError::MissingQueue { index: TX_QUEUE })?;
        let ev = ev.ok_or(ActivateError::MissingQueue { index: EVENT_QUEUE })?;

        let setup = WorkerSetup::new()?;
        setup.add(rx.notify.as_raw_fd(), TOKEN_RX)?;
        setup.add(tx.notify.as_raw_fd(), TOKEN_TX)?;
        setup.add(ev.notify.as_raw_fd(), TOKEN_EVENT)?;
        setup.add(model.host_fd(), TOKEN_HOST)?;
        let ctx = WorkerCtx {
            mem,
            interrupt,
            rx,
            tx,
            ev,
            model,
        };
        self.worker
            .start("virtio-vsock", setup, move |worker| ctx.run(worker))
            .map_err(ActivateError::Worker)
    }
}

/// Most epoll events the worker takes per wait.
const WORKER_EVENTS: usize = 8;
const TOKEN_RX: u64 = 1;
const TOKEN_TX: u64 = 2;
const TOKEN_EVENT: u64 = 3;
const TOKEN_HOST: u64 = 4;

struct WorkerCtx {
    mem: GuestMemoryMmap,
    interrupt: Arc<dyn VirtioInterrupt>,
    rx: ActiveQueue,
    tx: ActiveQueue,
    ev: ActiveQueue,
    model: VsockModel,
}

impl WorkerCtx {
    /// Serves until stopped; hands the model and the queues back.
    fn run(mut self, worker: WorkerLoop) -> (VsockModel, Vec<ActiveQueue>) {
        if let Err(e) = self.event_loop(&worker) {
            warn!("vsock: {e}; device needs reset");
            worker.park_needs_reset("vsock", self.interrupt.as_ref());
        }
        (self.model, vec![self.rx, self.tx, self.ev])
    }

    fn event_loop(&mut self, worker: &WorkerLoop) -> Result<(), WorkerLoopError> {
        // Buffers may have been posted before DRIVER_OK: one pass up front.
        self.pass()?;
        worker.serve(WORKER_EVENTS, WorkerLoopError::Epoll, |wakeup| {
            match wakeup {
                Wakeup::Ready(TOKEN_RX) => drop(self.rx.notify.read()),
                Wakeup::Ready(TOKEN_TX) => drop(self.tx.notify.read()),
                Wakeup::Ready(TOKEN_EVENT) => drop(self.ev.notify.read()),
                // The host fd is level-triggered: the pass serves it.
                Wakeup::Ready(_) => {}
                Wakeup::BatchDone => self.pass()?,
            }
            Ok(())
        })
    }

    fn pass(&mut self) -> Result<(), WorkerLoopError> {
        let sig = self.model.process(
            &self.mem,
            &mut self.rx.queue,
            &mut self.tx.queue,
            Some(&mut self.ev.queue),
        )?;
        for (i, s) in sig.iter().enumerate() {
            if *s {
                if let Err(e) = self.interrupt.signal_used_queue(i as u16) {
                    warn!("vsock: cannot signal queue {i}: {e}");
                }
            }
        }
        Ok(())
    }
}

/// Why the in-process worker stopped.
#[derive(Debug, thiserror::Error)]
enum WorkerLoopError {
    #[error(transparent)]
    Device(#[from] VsockDeviceError),
    #[error("epoll_wait failed: {0}")]
    Epoll(io::Error),
}
