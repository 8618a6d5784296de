//! The vhost-user face of virtio-fs: serves a [`SessionFs`] to a vhost-user
//! frontend (QEMU's `vhost-user-fs-pci`) over a Unix socket the helper
//! creates.
//!
//! ```text
//! let fs = Arc::new(SessionFs::new(SessionFsOptions::default()));
//! let server = VhostUserFsServer::bind(&VhostUserFsConfig::new(sock), fs.clone())?;
//! let thread = server.spawn()?;      // then start QEMU with:
//! //   -object memory-backend-memfd,id=mem,size=512M,share=on -numa node,memdev=mem
//! //   -chardev socket,id=fs0,path=SOCK
//! //   -device vhost-user-fs-pci,chardev=fs0,tag=cowork-sessions,queue-size=1024
//! fs.add_grant("s1", "project", Path::new("/home/u/project"), GrantMode::Rw)?;
//! ```
//!
//! The same FUSE server as the in-process device answers every request:
//! each descriptor chain is parsed by fuse-backend-rs's virtiofs transport
//! and handled by its `Server` over the shared [`SessionFs`], so grants
//! added or removed through the `Arc<SessionFs>` take effect at once, and
//! a malformed chain or FUSE message is completed with a used length of 0
//! (counted, logged within a budget) without stopping the device.
//!
//! Threads: every queue has its own vring worker thread (queue 0, the
//! high-priority queue, and each request queue), so FORGETs never wait
//! behind a slow request and a guest that uses several request queues gets
//! them served in parallel. Within one queue requests are served in order
//! on that queue's thread, and the used ring is signalled after each
//! completed request (subject to event-index suppression) so the guest can
//! go on while the next one is served.
//!
//! Guest memory comes from the frontend's shared (memfd) regions, mapped by
//! the vhost-user-backend crate. The tag lives in QEMU's config space
//! (`tag=` of `vhost-user-fs-pci`), not here.
//!
//! Limits: one frontend connection per [`VhostUserFsServer`] (the server
//! returns when it disconnects; bind a new one for the next VM); no DAX
//! window and no notification queue; no dirty-page logging (no live
//! migration). A panic inside the FUSE server is caught and its request
//! completed with length 0 (the guest sees an I/O error), the queue keeps
//! being served.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;

use fuse_backend_rs::api::filesystem::FileSystem;
use fuse_backend_rs::api::server::Server;
use tracing::{debug, error, info, warn};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Listener;
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon, VringRwLock, VringT};
use virtio_bindings::virtio_config::{VIRTIO_F_NOTIFY_ON_EMPTY, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{EventConsumer, EventNotifier};

use crate::fs::device::{
    serve_chain, FsDeviceStats, MALFORMED_LOG_BUDGET, MAX_REQUEST_QUEUES, QUEUE_SIZE,
};
use crate::fs::SessionFs;
use crate::vhost_user::{ExitEvent, ThreadFilter};
use vmm::sync::RwLockExt;

/// Guest memory as the vhost-user-backend crate maps it.
type Mem = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// Request queues offered when the configuration does not say (the Linux
/// driver before 6.11 uses one).
pub const DEFAULT_REQUEST_QUEUES: u16 = 1;

/// Errors of the vhost-user virtio-fs server.
#[derive(Debug, thiserror::Error)]
pub enum VhostUserFsError {
    /// Request queue count out of range.
    #[error("vhost-user-fs needs 1..={MAX_REQUEST_QUEUES} request queues, not {0}")]
    RequestQueues(u16),
    /// Queue size not a power of two in range.
    #[error("vhost-user-fs queue size must be a power of two in 2..={QUEUE_SIZE}, not {0}")]
    QueueSize(u16),
    /// Binding the vhost-user socket failed.
    #[error("cannot listen on vhost-user socket {path}: {source}; check the directory exists and is writable")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// vhost error.
        source: vhost::vhost_user::Error,
    },
    /// The vhost-user daemon failed to start or serve.
    #[error("vhost-user-fs daemon failed: {0}")]
    Daemon(String),
    /// Creating a worker's exit event failed.
    #[error("cannot set up the vhost-user-fs workers: {0}; check the process fd limit")]
    Setup(#[source] io::Error),
}

/// vhost-user-backend errors may carry a thread's panic payload, which is not
/// `Sync`; keep their text.
fn daemon_err(e: vhost_user_backend::Error) -> VhostUserFsError {
    VhostUserFsError::Daemon(e.to_string())
}

/// Configuration of the vhost-user face.
#[derive(Debug, Clone)]
pub struct VhostUserFsConfig {
    /// Path of the vhost-user Unix socket (replaced if it exists).
    pub socket: PathBuf,
    /// Request queues offered (besides the high-priority queue); the
    /// frontend's `num-request-queues` must not exceed it.
    pub request_queues: u16,
    /// Largest queue size offered; the frontend's `queue-size` must not
    /// exceed it.
    pub queue_size: u16,
}

impl VhostUserFsConfig {
    /// Defaults for `socket`: [`DEFAULT_REQUEST_QUEUES`] request queues of
    /// up to [`QUEUE_SIZE`] entries.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            request_queues: DEFAULT_REQUEST_QUEUES,
            queue_size: QUEUE_SIZE,
        }
    }

    fn check(&self) -> Result<(), VhostUserFsError> {
        if self.request_queues == 0 || self.request_queues > MAX_REQUEST_QUEUES {
            return Err(VhostUserFsError::RequestQueues(self.request_queues));
        }
        if self.queue_size < 2 || self.queue_size > QUEUE_SIZE || !self.queue_size.is_power_of_two()
        {
            return Err(VhostUserFsError::QueueSize(self.queue_size));
        }
        Ok(())
    }
}

/// The [`VhostUserBackend`] serving a [`SessionFs`]. Shared by the vring
/// worker threads (one per queue).
pub struct VhostUserFsBackend {
    fs: Arc<SessionFs>,
    server: Server<Arc<SessionFs>>,
    mem: RwLock<Mem>,
    num_queues: usize,
    queue_size: u16,
    stats: Arc<FsDeviceStats>,
    log_budget: AtomicU32,
    /// Requests whose handler panicked (answered with length 0).
    panics: AtomicU64,
    /// One exit event per worker thread.
    exits: Vec<ExitEvent>,
    /// Seccomp of the threads serving the frontend.
    filter: ThreadFilter,
}

impl VhostUserFsBackend {
    /// A backend serving `fs` over guest memory `mem`.
    pub fn new(
        config: &VhostUserFsConfig,
        fs: Arc<SessionFs>,
        mem: Mem,
    ) -> Result<Self, VhostUserFsError> {
        config.check()?;
        let num_queues = usize::from(config.request_queues) + 1;
        let exits = (0..num_queues)
            .map(|_| ExitEvent::new())
            .collect::<io::Result<Vec<_>>>()
            .map_err(VhostUserFsError::Setup)?;
        Ok(Self {
            server: Server::new(fs.clone()),
            fs,
            mem: RwLock::new(mem),
            num_queues,
            queue_size: config.queue_size,
            stats: Arc::default(),
            log_budget: AtomicU32::new(MALFORMED_LOG_BUDGET),
            panics: AtomicU64::new(0),
            exits,
            filter: ThreadFilter::default(),
        })
    }

    /// The device's counters.
    pub fn stats(&self) -> Arc<FsDeviceStats> {
        self.stats.clone()
    }

    fn memory(&self) -> Mem {
        self.mem.read_locked().clone()
    }

    /// Serves every available chain of `vring` (queue `index`).
    fn process(&self, vring: &VringRwLock<Mem>, index: u16) -> Result<(), virtio_queue::Error> {
        let atomic = self.memory();
        let mem = atomic.memory();
        loop {
            vring.disable_notification()?;
            loop {
                let chain = {
                    let mut state = vring.get_mut();
                    let q = state.get_queue_mut();
                    if !q.ready() {
                        return Ok(());
                    }
                    let mut it = q.iter(&*mem)?;
                    it.next()
                };
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                let len = match serve_chain(
                    &self.server,
                    &mem,
                    chain,
                    index,
                    &self.stats,
                    &self.log_budget,
                ) {
                    Ok(len) => len,
                    Err(e) => {
                        self.panics.fetch_add(1, Ordering::Relaxed);
                        self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                        error!(queue = index, "vhost-user-fs: {e}; request answered empty");
                        0
                    }
                };
                vring.add_used(head, len)?;
                self.stats.chains.fetch_add(1, Ordering::Relaxed);
                if vring.needs_notification()? {
                    if let Err(e) = vring.signal_used_queue() {
                        warn!(queue = index, "vhost-user-fs: cannot signal the guest: {e}");
                    }
                }
            }
            if !vring.enable_notification()? {
                return Ok(());
            }
        }
    }
}

impl VhostUserBackend for VhostUserFsBackend {
    type Bitmap = ();
    type Vring = VringRwLock<Mem>;

    fn num_queues(&self) -> usize {
        self.num_queues
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.queue_size)
    }

    fn features(&self) -> u64 {
        // The request thread's first call.
        self.filter.apply_or_log("fs");
        (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_F_NOTIFY_ON_EMPTY)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn set_event_idx(&self, _enabled: bool) {
        // The handler applies it to each vring's queue.
    }

    fn reset_device(&self) {
        // End the FUSE session as DESTROY would; the driver's next INIT
        // starts clean.
        FileSystem::destroy(&*self.fs);
        info!("vhost-user-fs: device reset");
    }

    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        self.filter.apply()?;
        *self.mem.write_locked() = mem;
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.num_queues).map(|i| 1u64 << i).collect()
    }

    fn exit_event(&self, thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        self.exits.get(thread_index)?.for_worker()
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Self::Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        // Before the ring is read.
        self.filter.apply()?;
        // Each thread has exactly one vring: queue `thread_id`.
        let (Some(vring), Ok(index)) = (vrings.first(), u16::try_from(thread_id)) else {
            debug!(
                device_event,
                thread_id, "vhost-user-fs: event without a vring ignored"
            );
            return Ok(());
        };
        if let Err(e) = self.process(vring, index) {
            // A broken ring is the guest's fault; the other queues go on.
            warn!(queue = index, "vhost-user-fs: {e}");
        }
        Ok(())
    }
}

/// Unblocks a [`VhostUserFsServer::run`] that waits for a frontend which
/// will never come.
#[derive(Debug, Clone)]
pub struct FsServerCanceller {
    socket: PathBuf,
}

impl FsServerCanceller {
    /// Connects to the server's socket and hangs up at once: a server still
    /// accepting takes that as a frontend that disconnected and returns.
    /// Harmless once a real frontend is connected.
    pub fn cancel(&self) {
        if let Ok(s) = std::os::unix::net::UnixStream::connect(&self.socket) {
            drop(s);
        }
    }
}

/// A bound vhost-user-fs socket, ready to serve one frontend.
pub struct VhostUserFsServer {
    socket: PathBuf,
    listener: Listener,
    backend: Arc<VhostUserFsBackend>,
    daemon: VhostUserDaemon<Arc<VhostUserFsBackend>>,
}

impl VhostUserFsServer {
    /// Creates the socket at `config.socket` (replacing a stale one) and the
    /// backend serving `fs`; the frontend may connect from now on.
    pub fn bind(config: &VhostUserFsConfig, fs: Arc<SessionFs>) -> Result<Self, VhostUserFsError> {
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let backend = Arc::new(VhostUserFsBackend::new(config, fs, mem.clone())?);
        let daemon = VhostUserDaemon::new("vhost-user-fs".into(), backend.clone(), mem)
            .map_err(daemon_err)?;
        let listener =
            Listener::new(&config.socket, true).map_err(|source| VhostUserFsError::Bind {
                path: config.socket.clone(),
                source,
            })?;
        info!(
            socket = %config.socket.display(),
            request_queues = config.request_queues,
            queue_size = config.queue_size,
            "vhost-user-fs: listening"
        );
        Ok(Self {
            socket: config.socket.clone(),
            listener,
            backend,
            daemon,
        })
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The device's counters (valid after the server ends too).
    pub fn stats(&self) -> Arc<FsDeviceStats> {
        self.backend.stats()
    }

    /// A handle that makes a [`Self::run`] still waiting for its frontend
    /// return (e.g. QEMU failed to start).
    pub fn canceller(&self) -> FsServerCanceller {
        FsServerCanceller {
            socket: self.socket.clone(),
        }
    }

    /// Accepts one frontend and serves it until it disconnects.
    pub fn run(mut self) -> Result<(), VhostUserFsError> {
        self.daemon.start(&mut self.listener).map_err(daemon_err)?;
        // The request thread is started: from here this one only waits.
        self.backend.filter.apply_or_log("fs");
        info!(socket = %self.socket.display(), "vhost-user-fs: frontend connected");
        let res = self.daemon.wait();
        for h in self.daemon.get_epoll_handlers() {
            h.send_exit_event();
        }
        let stats = self.backend.stats();
        info!(
            socket = %self.socket.display(),
            requests = stats.chains.load(Ordering::Relaxed),
            malformed = stats.malformed.load(Ordering::Relaxed),
            panics = self.backend.panics.load(Ordering::Relaxed),
            "vhost-user-fs: frontend disconnected"
        );
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
        self.backend.filter.set(mode);
        self
    }

    /// [`Self::run`] on a new thread named `vhost-user-fs`.
    pub fn spawn(self) -> io::Result<JoinHandle<Result<(), VhostUserFsError>>> {
        std::thread::Builder::new()
            .name("vhost-user-fs".into())
            .spawn(move || self.run())
    }
}

#[cfg(test)]
mod tests;
