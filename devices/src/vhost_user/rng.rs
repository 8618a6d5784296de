//! The vhost-user face of the virtio-rng model: serves an [`RngModel`] to a
//! vhost-user frontend (QEMU's `vhost-user-rng-pci`) over a Unix socket.
//!
//! ```text
//! let thread = VhostUserRngServer::bind(sock)?.spawn()?;   // then start QEMU with:
//! //   -object memory-backend-memfd,id=mem,size=512M,share=on -numa node,memdev=mem
//! //   -chardev socket,id=rng0,path=SOCK -device vhost-user-rng-pci,chardev=rng0
//! ```
//!
//! Limits: those of `vhost_user::single_queue` (one frontend per server, one
//! worker thread).

use std::io;
use std::path::Path;
use std::thread::JoinHandle;

use super::single_queue::{SingleQueueServer, VhostQueueModel, VhostUserServeError};
use crate::rng::{RngModel, QUEUE_SIZE};

impl VhostQueueModel for RngModel {
    const NAME: &'static str = "rng";

    fn features(&self) -> u64 {
        RngModel::features(self)
    }

    fn config(&self) -> &[u8] {
        &[]
    }

    fn max_queue_size(&self) -> u16 {
        QUEUE_SIZE
    }
}

/// A bound vhost-user rng socket, ready to serve one frontend.
pub struct VhostUserRngServer {
    inner: SingleQueueServer<RngModel>,
}

impl VhostUserRngServer {
    /// Creates the socket at `socket` (replacing a stale one).
    pub fn bind(socket: &Path) -> Result<Self, VhostUserServeError> {
        Ok(Self {
            inner: SingleQueueServer::bind(socket, RngModel::new())?,
        })
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        self.inner.socket()
    }

    /// Accepts one frontend and serves it until it disconnects.
    pub fn run(self) -> Result<(), VhostUserServeError> {
        self.inner.run()
    }

    /// Filters the threads serving the frontend with `mode` (see
    /// [`super`]); call before [`Self::run`].
    pub fn seccomp(self, mode: vmm::seccomp::Mode) -> Self {
        self.inner.set_seccomp(mode);
        self
    }

    /// [`Self::run`] on a new thread named `vhost-user-rng`.
    pub fn spawn(self) -> io::Result<JoinHandle<Result<(), VhostUserServeError>>> {
        self.inner.spawn()
    }
}
