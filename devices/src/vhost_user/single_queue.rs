//! Shared plumbing of the vhost-user faces of single-queue device models
//! (virtio-blk, virtio-rng): a [`VhostUserBackendMut`] around a
//! [`VhostQueueModel`] and a server that binds the socket and serves one
//! frontend.
//!
//! Guest memory comes from the frontend's shared (memfd) regions, mapped by
//! the vhost-user-backend crate; a device with a config space (blk) serves
//! it through `VHOST_USER_PROTOCOL_F_CONFIG`, one without (rng) does not
//! offer that feature (QEMU's vhost-user-rng warns when it is offered).
//!
//! Migration: the features include `VHOST_F_LOG_ALL` and the protocol
//! features `VHOST_USER_PROTOCOL_F_LOG_SHMFD`, without which QEMU refuses
//! to migrate any machine that has the device, *stopped* ones too. The
//! qemu backend's boot snapshot migrates a stopped machine, whose devices
//! QEMU has stopped first (`GET_VRING_BASE`), so no page is written while
//! it is saved; a log QEMU hands over (`SET_LOG_BASE`) is taken by the
//! vhost-user-backend crate, but this device writes guest memory without
//! marking it.
//!
//! Limits: one frontend connection per server (bind a new one for the next
//! VM); one worker thread; no dirty-page logging, so no *live* migration
//! of a running machine (pages written during one would be lost).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::{ExitEvent, ThreadFilter};

use tracing::{info, warn};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Listener;
use vhost_user_backend::{VhostUserBackendMut, VhostUserDaemon, VringRwLock, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_NOTIFY_ON_EMPTY;
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm::virtio::config_slice;
use vmm::virtio::single_queue::QueueModel;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{EventConsumer, EventNotifier};

/// Guest memory as the vhost-user-backend crate maps it.
pub(crate) type Mem = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// A device model with one queue ([`QueueModel`], which the in-process
/// face drives too), with what the vhost-user face also needs to know.
pub(crate) trait VhostQueueModel: QueueModel + Sync {
    /// Name used for the daemon, its thread and log lines.
    const NAME: &'static str;
    /// Device feature bits (virtio and device specific).
    fn features(&self) -> u64;
    /// Config space bytes (empty if the device has none).
    fn config(&self) -> &[u8];
    /// Largest queue size offered.
    fn max_queue_size(&self) -> u16;
    /// The frontend reset the device or disconnected: make completed work
    /// durable.
    fn quiesce(&mut self) {}
}

/// Errors of binding and serving a vhost-user socket.
#[derive(Debug, thiserror::Error)]
pub enum VhostUserServeError {
    /// Binding the vhost-user socket failed.
    #[error("cannot listen on vhost-user socket {path}: {source}; check the directory exists and is writable")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// vhost error.
        source: vhost::vhost_user::Error,
    },
    /// The vhost-user daemon failed to start or serve.
    #[error("vhost-user {name} daemon failed: {reason}")]
    Daemon {
        /// Device name.
        name: &'static str,
        /// The daemon's error text.
        reason: String,
    },
    /// Creating the exit event failed.
    #[error("cannot set up the vhost-user worker: {0}; check the process fd limit")]
    Setup(#[source] io::Error),
}

/// The [`VhostUserBackendMut`] around a [`VhostQueueModel`].
pub(crate) struct SingleQueueBackend<T> {
    model: T,
    mem: Mem,
    exit: ExitEvent,
    /// Seccomp of the threads serving the frontend.
    filter: ThreadFilter,
}

impl<T: VhostQueueModel> SingleQueueBackend<T> {
    fn new(model: T, mem: Mem) -> Result<Self, VhostUserServeError> {
        Ok(Self {
            model,
            mem,
            exit: ExitEvent::new().map_err(VhostUserServeError::Setup)?,
            filter: ThreadFilter::default(),
        })
    }
}

impl<T: VhostQueueModel> VhostUserBackendMut for SingleQueueBackend<T> {
    type Bitmap = ();
    type Vring = VringRwLock<Mem>;

    fn num_queues(&self) -> usize {
        1
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.model.max_queue_size())
    }

    fn features(&self) -> u64 {
        // The request thread's first call.
        self.filter.apply_or_log(T::NAME);
        self.model.features()
            | (1 << VIRTIO_F_NOTIFY_ON_EMPTY)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            // See the module doc: for the snapshot of a stopped machine.
            | VhostUserVirtioFeatures::LOG_ALL.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        // CONFIG only with a config space to serve: QEMU's frontends of
        // config-less devices (vhost-user-rng) do not negotiate it and log
        // a warning on every boot when the backend offers it.
        // LOG_SHMFD: see the module doc (for the snapshot of a stopped
        // machine).
        let base = VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::LOG_SHMFD;
        if self.model.config().is_empty() {
            base
        } else {
            base | VhostUserProtocolFeatures::CONFIG
        }
    }

    fn set_event_idx(&mut self, _enabled: bool) {
        // The handler applies it to the vring's queue; the model reads it
        // from there.
    }

    fn reset_device(&mut self) {
        info!("vhost-user-{}: device reset", T::NAME);
        self.model.quiesce();
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        // An empty answer tells the frontend the read failed.
        config_slice(self.model.config(), offset.into(), size as usize)
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
        // Before the ring is read.
        self.filter.apply()?;
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            warn!(
                device_event,
                "vhost-user-{}: unknown event ignored",
                T::NAME
            );
            return Ok(());
        };
        let ready = {
            let g = vring.get_ref();
            g.is_enabled() && g.get_queue().ready()
        };
        if !ready {
            return Ok(());
        }
        let mem = self.mem.memory();
        let res = {
            let mut g = vring.get_mut();
            self.model.process_queue(&mem, g.get_queue_mut())
        };
        match res {
            Ok(true) => {
                if let Err(e) = vring.signal_used_queue() {
                    warn!("vhost-user-{}: cannot signal the guest: {e}", T::NAME);
                }
            }
            Ok(false) => {}
            // A broken ring is the guest's fault; the next kick tries again.
            Err(e) => warn!("vhost-user-{}: {e}", T::NAME),
        }
        Ok(())
    }
}

/// A bound vhost-user socket serving one [`VhostQueueModel`] to one frontend.
pub(crate) struct SingleQueueServer<T: VhostQueueModel> {
    socket: PathBuf,
    listener: Listener,
    backend: Arc<Mutex<SingleQueueBackend<T>>>,
    daemon: VhostUserDaemon<Arc<Mutex<SingleQueueBackend<T>>>>,
    /// The backend's seccomp mode, shared.
    filter: ThreadFilter,
}

impl<T: VhostQueueModel> SingleQueueServer<T> {
    /// Creates the socket at `socket` (replacing a stale one); the frontend
    /// may connect from now on.
    pub(crate) fn bind(socket: &Path, model: T) -> Result<Self, VhostUserServeError> {
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let backend = SingleQueueBackend::new(model, mem.clone())?;
        let filter = backend.filter.clone();
        let backend = Arc::new(Mutex::new(backend));
        let daemon = VhostUserDaemon::new(format!("vhost-user-{}", T::NAME), backend.clone(), mem)
            .map_err(|e| VhostUserServeError::Daemon {
                name: T::NAME,
                reason: e.to_string(),
            })?;
        let listener = Listener::new(socket, true).map_err(|source| VhostUserServeError::Bind {
            path: socket.to_path_buf(),
            source,
        })?;
        info!(socket = %socket.display(), "vhost-user-{}: listening", T::NAME);
        Ok(Self {
            socket: socket.to_path_buf(),
            listener,
            backend,
            daemon,
            filter,
        })
    }

    /// Filters the threads serving the frontend with `mode` (see
    /// [`super`]); call before [`Self::run`].
    pub(crate) fn set_seccomp(&self, mode: vmm::seccomp::Mode) {
        self.filter.set(mode);
    }

    /// The socket path.
    pub(crate) fn socket(&self) -> &Path {
        &self.socket
    }

    /// Accepts one frontend and serves it until it disconnects.
    pub(crate) fn run(mut self) -> Result<(), VhostUserServeError> {
        let daemon_err = |e: vhost_user_backend::Error| VhostUserServeError::Daemon {
            name: T::NAME,
            reason: e.to_string(),
        };
        self.daemon.start(&mut self.listener).map_err(daemon_err)?;
        // The request thread is started: from here this one only waits.
        self.filter.apply_or_log(T::NAME);
        info!(socket = %self.socket.display(), "vhost-user-{}: frontend connected", T::NAME);
        let res = self.daemon.wait();
        for h in self.daemon.get_epoll_handlers() {
            h.send_exit_event();
        }
        info!(socket = %self.socket.display(), "vhost-user-{}: frontend disconnected", T::NAME);
        match self.backend.lock() {
            Ok(mut b) => b.model.quiesce(),
            Err(p) => p.into_inner().model.quiesce(),
        }
        match res {
            Ok(()) => Ok(()),
            Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => Ok(()),
            Err(e) => Err(daemon_err(e)),
        }
    }

    /// [`Self::run`] on a new thread named `vhost-user-<name>`.
    pub(crate) fn spawn(self) -> io::Result<JoinHandle<Result<(), VhostUserServeError>>> {
        std::thread::Builder::new()
            .name(format!("vhost-user-{}", T::NAME))
            .spawn(move || self.run())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blk::{create_sparse_image, BlkConfig, BlkModel, RawImage};
    use crate::rng::RngModel;

    fn backend<T: VhostQueueModel>(model: T) -> SingleQueueBackend<T> {
        SingleQueueBackend::new(model, GuestMemoryAtomic::new(GuestMemoryMmap::new())).unwrap()
    }

    #[test]
    fn config_is_offered_only_with_a_config_space() {
        let rng = backend(RngModel::new());
        assert_eq!(
            rng.protocol_features(),
            VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::LOG_SHMFD
        );
        assert!(rng.get_config(0, 1).is_empty());

        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("disk.img");
        create_sparse_image(&img, 1 << 20).unwrap();
        let model = BlkModel::new(
            Box::new(RawImage::open(&img).unwrap()),
            &BlkConfig::new("cfg-test"),
        )
        .unwrap();
        let blk = backend(model);
        assert!(blk
            .protocol_features()
            .contains(VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::CONFIG));
        // virtio_blk_config starts with the capacity in 512-byte sectors.
        assert_eq!(blk.get_config(0, 8), (2048u64).to_le_bytes().to_vec());
        // QEMU migrates (snapshots) a machine only when every vhost-user
        // device offers VHOST_F_LOG_ALL; no log is ever handed over.
        let log_all = VhostUserVirtioFeatures::LOG_ALL.bits();
        assert_eq!(blk.features() & log_all, log_all);
        assert_eq!(rng.features() & log_all, log_all);
        assert!(blk
            .protocol_features()
            .contains(VhostUserProtocolFeatures::LOG_SHMFD));
    }

    /// What [`ExitEvent`]'s `Drop` relies on: vhost-user-backend leaves the
    /// exit-event consumers it took open after its daemon, handler and
    /// workers are gone. Should a new version close them itself, this
    /// fails, and `ExitEvent` must stop closing them (a second close could
    /// hit another thread's descriptor).
    #[test]
    fn the_library_still_leaks_what_exit_event_hands_out() {
        let dir = tempfile::tempdir().unwrap();
        let server =
            SingleQueueServer::bind(&dir.path().join("rng.sock"), RngModel::new()).unwrap();
        let backend = server.backend.clone();
        let handed_out = backend.lock().unwrap().exit.handed_out();
        assert_eq!(handed_out.len(), 1, "one worker thread");
        let ids: Vec<Option<u64>> = handed_out
            .iter()
            .map(|&fd| super::super::eventfd_id(fd))
            .collect();
        assert!(
            ids.iter().all(Option::is_some),
            "{handed_out:?} are eventfds"
        );
        // The daemon, its handler and its worker end; only the test holds
        // the backend now.
        drop(server);
        assert_eq!(Arc::strong_count(&backend), 1);
        let after: Vec<Option<u64>> = handed_out
            .iter()
            .map(|&fd| super::super::eventfd_id(fd))
            .collect();
        assert_eq!(
            after, ids,
            "vhost-user-backend closed the exit-event consumers itself"
        );
        // The backend's drop closes them.
        drop(backend);
        for (fd, id) in handed_out.iter().zip(&ids) {
            assert_ne!(super::super::eventfd_id(*fd), *id, "fd {fd} still open");
        }
    }
}
