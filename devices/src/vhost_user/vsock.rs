//! The vhost-user face of the vsock model: serves [`VsockModel`] to a
//! vhost-user frontend (QEMU's `vhost-user-vsock-pci` /
//! `vhost-user-vsock-device`) over a Unix socket.
//!
//! ```text
//! let host = VsockHost::new()?;
//! let agent = host.listen(51234)?;
//! let server = VhostUserVsockServer::bind(&VhostUserVsockConfig::new(sock, 3), &host)?;
//! let thread = server.spawn()?;          // then start QEMU with:
//! //   -object memory-backend-memfd,id=mem,size=512M,share=on -numa node,memdev=mem
//! //   -chardev socket,id=vs,path=SOCK -device vhost-user-vsock-pci,chardev=vs
//! let stream = agent.accept()?;          // the guest dialled CID 2:51234
//! ```
//!
//! Guest memory comes from the frontend's shared (memfd) regions, mapped by
//! the vhost-user-backend crate. The guest CID is served through the config
//! space (`VHOST_USER_PROTOCOL_F_CONFIG`); QEMU's vhost-user-vsock reads it
//! from there. QEMU keeps the event queue to itself, so this face has none:
//! a host-requested transport reset just drops the connections.
//!
//! Limits: one frontend connection per [`VhostUserVsockServer`] (the server
//! returns when it disconnects; bind a new one for the next VM); one worker
//! thread; no dirty-page logging (no live migration).

use std::io;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;

use tracing::{info, warn};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Listener;
use vhost_user_backend::{VhostUserBackendMut, VhostUserDaemon, VringRwLock, VringT};
use virtio_bindings::virtio_config::{VIRTIO_F_NOTIFY_ON_EMPTY, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm::virtio::config_slice;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{EventConsumer, EventNotifier};

use crate::vhost_user::{ExitEvent, ThreadFilter};
use crate::vsock::device::{NUM_QUEUES, QUEUE_SIZE, RX_QUEUE, TX_QUEUE};
use crate::vsock::{VsockConfig, VsockDeviceError, VsockHost, VsockModel};

/// Guest memory as the vhost-user-backend crate maps it.
type Mem = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// Handler token of the model's host fd (0..=2 are the queues, 3 is the
/// exit event).
const HOST_EVENT: u16 = NUM_QUEUES as u16 + 1;

/// Errors of the vhost-user vsock server.
#[derive(Debug, thiserror::Error)]
pub enum VhostUserVsockError {
    /// The device model could not be built.
    #[error(transparent)]
    Model(#[from] VsockDeviceError),
    /// Binding the vhost-user socket failed.
    #[error("cannot listen on vhost-user socket {path}: {source}; check the directory exists and is writable")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// vhost error.
        source: vhost::vhost_user::Error,
    },
    /// The vhost-user daemon failed to start or serve.
    #[error("vhost-user vsock daemon failed: {0}")]
    Daemon(String),
    /// Registering the host fd with the worker, or creating the exit event,
    /// failed.
    #[error("cannot set up the vhost-user vsock worker: {0}; check the process fd limit")]
    Setup(#[source] io::Error),
}

/// vhost-user-backend errors may carry a thread's panic payload, which is not
/// `Sync`; keep their text.
fn daemon_err(e: vhost_user_backend::Error) -> VhostUserVsockError {
    VhostUserVsockError::Daemon(e.to_string())
}

/// Configuration of the vhost-user face.
#[derive(Debug, Clone)]
pub struct VhostUserVsockConfig {
    /// Path of the vhost-user Unix socket (replaced if it exists).
    pub socket: PathBuf,
    /// CID of the guest.
    pub guest_cid: u64,
    /// Largest queue size offered.
    pub queue_size: u16,
    /// Model tunables.
    pub vsock: VsockConfig,
}

impl VhostUserVsockConfig {
    /// Defaults for `socket` and `guest_cid`.
    pub fn new(socket: impl Into<PathBuf>, guest_cid: u64) -> Self {
        Self {
            socket: socket.into(),
            guest_cid,
            queue_size: QUEUE_SIZE,
            vsock: VsockConfig::default(),
        }
    }
}

/// The [`VhostUserBackendMut`] wrapping a [`VsockModel`].
pub struct VhostUserVsockBackend {
    model: VsockModel,
    mem: Mem,
    queue_size: u16,
    exit: ExitEvent,
    /// Seccomp of the threads serving the frontend.
    filter: ThreadFilter,
}

impl VhostUserVsockBackend {
    /// A backend over a new model.
    pub fn new(
        config: &VhostUserVsockConfig,
        host: &VsockHost,
        mem: Mem,
    ) -> Result<Self, VhostUserVsockError> {
        let model = VsockModel::new(config.guest_cid, config.vsock.clone(), host)?;
        let exit = ExitEvent::new().map_err(VhostUserVsockError::Setup)?;
        Ok(Self {
            model,
            mem,
            queue_size: config.queue_size,
            exit,
            filter: ThreadFilter::default(),
        })
    }

    /// The model's host fd (registered with the worker's epoll).
    pub fn host_fd(&self) -> RawFd {
        self.model.host_fd()
    }

    fn pass(&mut self, vrings: &[VringRwLock<Mem>]) -> Result<(), VsockDeviceError> {
        let (Some(rx), Some(tx)) = (vrings.get(RX_QUEUE as usize), vrings.get(TX_QUEUE as usize))
        else {
            return Ok(());
        };
        let usable = |v: &VringRwLock<Mem>| {
            let g = v.get_ref();
            g.is_enabled() && g.get_queue().ready()
        };
        if !usable(rx) || !usable(tx) {
            // Rings not set up yet: keep host events moving (and the level
            // triggered host fd quiet) without touching guest memory.
            self.model.process_host_events()?;
            return Ok(());
        }
        let mem = self.mem.memory();
        let sig = {
            let mut rxg = rx.get_mut();
            let mut txg = tx.get_mut();
            self.model
                .process(&*mem, rxg.get_queue_mut(), txg.get_queue_mut(), None)?
        };
        for (v, s) in [(rx, sig[0]), (tx, sig[1])] {
            if s {
                if let Err(e) = v.signal_used_queue() {
                    warn!("vhost-user-vsock: cannot signal the guest: {e}");
                }
            }
        }
        Ok(())
    }
}

impl VhostUserBackendMut for VhostUserVsockBackend {
    type Bitmap = ();
    type Vring = VringRwLock<Mem>;

    fn num_queues(&self) -> usize {
        NUM_QUEUES
    }

    fn max_queue_size(&self) -> usize {
        self.queue_size as usize
    }

    fn features(&self) -> u64 {
        // The request thread's first call.
        self.filter.apply_or_log("vsock");
        (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_F_NOTIFY_ON_EMPTY)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::CONFIG
    }

    fn set_event_idx(&mut self, _enabled: bool) {
        // The handler applies it to each vring's queue; the model reads it
        // from there.
    }

    fn reset_device(&mut self) {
        info!("vhost-user-vsock: device reset, dropping connections");
        self.model.reset_transport();
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        // An empty answer tells the frontend the read failed.
        config_slice(
            &self.model.guest_cid().to_le_bytes(),
            offset.into(),
            size as usize,
        )
        .map(<[u8]>::to_vec)
        .unwrap_or_default()
    }

    fn update_memory(&mut self, mem: Mem) -> io::Result<()> {
        self.filter.apply()?;
        self.mem = mem;
        Ok(())
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        self.exit.for_worker()
    }

    fn handle_event(
        &mut self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Self::Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        // Before a ring or a host stream is read.
        self.filter.apply()?;
        if device_event as usize > NUM_QUEUES + 1 {
            warn!(device_event, "vhost-user-vsock: unknown event ignored");
            return Ok(());
        }
        if let Err(e) = self.pass(vrings) {
            // A broken ring is the guest's fault; keep serving the others.
            warn!("vhost-user-vsock: {e}");
        }
        Ok(())
    }
}

/// Unblocks a [`VhostUserVsockServer::run`] that waits for a frontend which
/// will never come.
#[derive(Debug, Clone)]
pub struct ServerCanceller {
    socket: PathBuf,
}

impl ServerCanceller {
    /// Connects to the server's socket and hangs up at once: a server still
    /// accepting takes that as a frontend that disconnected and returns
    /// `Ok(())`. Harmless once a real frontend is connected: the extra
    /// connection then sits unaccepted in the backlog.
    pub fn cancel(&self) {
        if let Ok(s) = std::os::unix::net::UnixStream::connect(&self.socket) {
            drop(s);
        }
    }
}

/// A bound vhost-user vsock socket, ready to serve one frontend.
pub struct VhostUserVsockServer {
    socket: PathBuf,
    listener: Listener,
    daemon: VhostUserDaemon<Arc<RwLock<VhostUserVsockBackend>>>,
    /// The backend's seccomp mode, shared.
    filter: ThreadFilter,
}

impl VhostUserVsockServer {
    /// Creates the socket at `config.socket` (replacing a stale one) and the
    /// backend; the frontend may connect from now on.
    pub fn bind(
        config: &VhostUserVsockConfig,
        host: &VsockHost,
    ) -> Result<Self, VhostUserVsockError> {
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let backend = VhostUserVsockBackend::new(config, host, mem.clone())?;
        let host_fd = backend.host_fd();
        let filter = backend.filter.clone();
        let backend = Arc::new(RwLock::new(backend));
        let daemon =
            VhostUserDaemon::new("vhost-user-vsock".into(), backend, mem).map_err(daemon_err)?;
        for h in daemon.get_epoll_handlers() {
            h.register_listener(host_fd, EventSet::IN, u64::from(HOST_EVENT))
                .map_err(VhostUserVsockError::Setup)?;
        }
        let listener =
            Listener::new(&config.socket, true).map_err(|source| VhostUserVsockError::Bind {
                path: config.socket.clone(),
                source,
            })?;
        info!(socket = %config.socket.display(), guest_cid = config.guest_cid, "vhost-user-vsock: listening");
        Ok(Self {
            socket: config.socket.clone(),
            listener,
            daemon,
            filter,
        })
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// A handle that makes a [`Self::run`] still waiting for its frontend
    /// return (e.g. QEMU failed to start).
    pub fn canceller(&self) -> ServerCanceller {
        ServerCanceller {
            socket: self.socket.clone(),
        }
    }

    /// Accepts one frontend and serves it until it disconnects.
    pub fn run(mut self) -> Result<(), VhostUserVsockError> {
        self.daemon.start(&mut self.listener).map_err(daemon_err)?;
        // The request thread is started: from here this one only waits.
        self.filter.apply_or_log("vsock");
        info!(socket = %self.socket.display(), "vhost-user-vsock: frontend connected");
        let res = self.daemon.wait();
        for h in self.daemon.get_epoll_handlers() {
            h.send_exit_event();
        }
        info!(socket = %self.socket.display(), "vhost-user-vsock: frontend disconnected");
        match res {
            Ok(()) => Ok(()),
            Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => Ok(()),
            Err(e) => Err(daemon_err(e)),
        }
    }

    /// Filters the threads serving the frontend with `mode` (see the
    /// module docs); call before [`Self::run`].
    pub fn seccomp(self, mode: vmm::seccomp::Mode) -> Self {
        self.filter.set(mode);
        self
    }

    /// [`Self::run`] on a new thread named `vhost-user-vsock`.
    pub fn spawn(self) -> io::Result<JoinHandle<Result<(), VhostUserVsockError>>> {
        std::thread::Builder::new()
            .name("vhost-user-vsock".into())
            .spawn(move || self.run())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn socket_path(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!("vu-vsock-{tag}-{}.sock", std::process::id()))
    }

    #[test]
    fn backend_describes_a_vsock_device() {
        let host = VsockHost::new().unwrap();
        let cfg = VhostUserVsockConfig::new(socket_path("desc"), 42);
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let b = VhostUserVsockBackend::new(&cfg, &host, mem).unwrap();
        assert_eq!(b.num_queues(), 3);
        assert_eq!(b.get_config(0, 8), 42u64.to_le_bytes().to_vec());
        assert_eq!(b.get_config(4, 4), vec![0, 0, 0, 0]);
        assert!(b.get_config(6, 4).is_empty());
        assert!(b.get_config(u32::MAX, 2).is_empty());
        assert!(b
            .protocol_features()
            .contains(VhostUserProtocolFeatures::CONFIG));
        assert_ne!(b.features() & (1 << VIRTIO_F_VERSION_1), 0);
        let bad = VhostUserVsockConfig::new(socket_path("bad"), 2);
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        assert!(matches!(
            VhostUserVsockBackend::new(&bad, &host, mem),
            Err(VhostUserVsockError::Model(VsockDeviceError::InvalidCid(2)))
        ));
    }

    #[test]
    fn canceller_ends_a_server_waiting_for_its_frontend() {
        let host = VsockHost::new().unwrap();
        let path = socket_path("cancel");
        let server =
            VhostUserVsockServer::bind(&VhostUserVsockConfig::new(&path, 3), &host).unwrap();
        assert!(path.exists());
        let cancel = server.canceller();
        let t = server.spawn().unwrap();
        cancel.cancel();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !t.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(t.is_finished(), "server still waiting after cancel");
        t.join().unwrap().unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn handle_event_serves_the_model_over_vrings() {
        use crate::vsock::packet::{Header, HDR_SIZE, OP_REQUEST, OP_RESPONSE, TYPE_STREAM};
        use virtio_queue::desc::{split::Descriptor, RawDescriptor};
        use virtio_queue::mock::MockSplitQueue;
        use vm_memory::{Address, Bytes, GuestAddress};

        let gm = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap();
        let mem = GuestMemoryAtomic::new(gm.clone());
        let host = VsockHost::new().unwrap();
        let l = host.listen(1234).unwrap();
        let cfg = VhostUserVsockConfig::new(socket_path("vrings"), 3);
        let mut b = VhostUserVsockBackend::new(&cfg, &host, mem.clone()).unwrap();

        let rxm = MockSplitQueue::create(&gm, GuestAddress(0), 16);
        let txm = MockSplitQueue::create(&gm, GuestAddress(0x1_0000), 16);
        let vrings: Vec<VringRwLock<Mem>> = [&rxm, &txm, &rxm]
            .iter()
            .map(|_| VringRwLock::new(mem.clone(), 256).unwrap())
            .collect();
        // Rings not set up yet: host events only, nothing touched.
        b.handle_event(HOST_EVENT, EventSet::IN, &vrings, 0)
            .unwrap();
        for (v, m) in vrings.iter().zip([&rxm, &txm]) {
            v.set_queue_size(16);
            v.set_queue_info(m.desc_table_addr().0, m.avail_addr().0, m.used_addr().0)
                .unwrap();
            v.set_queue_ready(true);
            v.set_enabled(true);
        }
        let rx_buf = 0x20_0000u64;
        rxm.add_desc_chains(
            &[RawDescriptor::from(Descriptor::new(rx_buf, 4096, 2, 0))],
            0,
        )
        .unwrap();
        let req = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 5000,
            dst_port: 1234,
            kind: TYPE_STREAM,
            op: OP_REQUEST,
            buf_alloc: 4096,
            ..Header::default()
        };
        gm.write_slice(&req.to_bytes(), GuestAddress(0x30_0000))
            .unwrap();
        txm.add_desc_chains(
            &[RawDescriptor::from(Descriptor::new(
                0x30_0000,
                HDR_SIZE as u32,
                0,
                0,
            ))],
            0,
        )
        .unwrap();
        b.handle_event(1, EventSet::IN, &vrings, 0).unwrap();

        assert!(
            l.try_accept().unwrap().is_some(),
            "guest connection accepted"
        );
        let used_idx: u16 = gm.read_obj(rxm.used_addr().unchecked_add(2)).unwrap();
        assert_eq!(used_idx, 1);
        let mut h = [0u8; HDR_SIZE];
        gm.read_slice(&mut h, GuestAddress(rx_buf)).unwrap();
        let resp = Header::from_bytes(&h);
        assert_eq!(
            (resp.op, resp.src_port, resp.dst_port),
            (OP_RESPONSE, 1234, 5000)
        );
        let tx_used: u16 = gm.read_obj(txm.used_addr().unchecked_add(2)).unwrap();
        assert_eq!(tx_used, 1);
    }
}
