//! The vhost-user face of the virtio-blk model: serves a [`BlkModel`] to a
//! vhost-user frontend (QEMU's `vhost-user-blk-pci`) over a Unix socket.
//!
//! ```text
//! let disk = RawImage::open(Path::new("sessiondata.img"))?;
//! let server = VhostUserBlkServer::bind(sock, Box::new(disk), &BlkConfig::new(SESSION_DISK_SERIAL))?;
//! let thread = server.spawn()?;          // then start QEMU with:
//! //   -object memory-backend-memfd,id=mem,size=512M,share=on -numa node,memdev=mem
//! //   -chardev socket,id=blk0,path=SOCK -device vhost-user-blk-pci,chardev=blk0,num-queues=1
//! ```
//!
//! QEMU reads capacity, limits and the like through the config space
//! (`VHOST_USER_PROTOCOL_F_CONFIG`) and passes every request, GET_ID
//! included, to this backend. The disk is flushed (fdatasync) when the
//! frontend resets the device or disconnects.
//!
//! Limits: those of `vhost_user::single_queue` (one frontend per server, one
//! worker thread) and of [`crate::blk`] (one request queue: start QEMU with
//! `num-queues=1`).

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;

use tracing::warn;

pub use super::single_queue::VhostUserServeError;
use super::single_queue::{SingleQueueServer, VhostQueueModel};
use crate::blk::{BlkConfig, BlkDeviceError, BlkModel, BlkStats, BlockBackend};

/// Errors of the vhost-user blk server.
#[derive(Debug, thiserror::Error)]
pub enum VhostUserBlkError {
    /// The device model could not be built.
    #[error(transparent)]
    Model(#[from] BlkDeviceError),
    /// Binding or serving the socket failed.
    #[error(transparent)]
    Serve(#[from] VhostUserServeError),
}

impl VhostQueueModel for BlkModel {
    const NAME: &'static str = "blk";

    fn features(&self) -> u64 {
        BlkModel::features(self)
    }

    fn config(&self) -> &[u8] {
        BlkModel::config(self)
    }

    fn max_queue_size(&self) -> u16 {
        self.queue_size()
    }

    fn quiesce(&mut self) {
        if let Err(e) = self.flush() {
            warn!("vhost-user-blk: flush at reset or disconnect failed: {e}");
        }
    }
}

/// A bound vhost-user blk socket, ready to serve one frontend.
pub struct VhostUserBlkServer {
    inner: SingleQueueServer<BlkModel>,
    stats: Arc<BlkStats>,
}

impl VhostUserBlkServer {
    /// Creates the socket at `socket` (replacing a stale one) serving
    /// `backend` with `config`.
    pub fn bind(
        socket: &Path,
        backend: Box<dyn BlockBackend>,
        config: &BlkConfig,
    ) -> Result<Self, VhostUserBlkError> {
        let model = BlkModel::new(backend, config)?;
        let stats = model.stats();
        Ok(Self {
            inner: SingleQueueServer::bind(socket, model)?,
            stats,
        })
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        self.inner.socket()
    }

    /// The model's counters (live while it serves).
    pub fn stats(&self) -> Arc<BlkStats> {
        self.stats.clone()
    }

    /// Accepts one frontend and serves it until it disconnects.
    pub fn run(self) -> Result<(), VhostUserBlkError> {
        Ok(self.inner.run()?)
    }

    /// Filters the threads serving the frontend with `mode` (see
    /// [`super`]); call before [`Self::run`].
    pub fn seccomp(self, mode: vmm::seccomp::Mode) -> Self {
        self.inner.set_seccomp(mode);
        self
    }

    /// [`Self::run`] on a new thread named `vhost-user-blk`.
    pub fn spawn(self) -> io::Result<JoinHandle<Result<(), VhostUserServeError>>> {
        self.inner.spawn()
    }
}
