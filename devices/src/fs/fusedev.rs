//! Serving a [`SessionFs`] on the host through `/dev/fuse`.
//!
//! [`HostMount`] mounts the same filesystem the virtio-fs device serves on a
//! host directory with fuse-backend-rs's fusedev transport and answers the
//! kernel's requests on worker threads. It exists so that tests and
//! benchmarks can run real programs (tar, git, dd...) against the exact
//! `FileSystem` a guest would see, without a VM; it is not how guests reach
//! the filesystem.
//!
//! Limits: mounting needs root (or a user namespace with its own mount
//! namespace); `fusermount3` is only tried when the direct `mount(2)` is
//! refused. A host mount is checked with `default_permissions` by the host
//! kernel, so host permission bits (as the server presents them, see
//! [`super::GrantOwner`]) apply on top of the grant policy. Only the
//! mounting user may use a mount made by [`HostMount::mount`];
//! [`HostMount::mount_for_everyone`] lets other users in (`allow_other`), so
//! tests can run programs as a session's uid the way a guest does.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use fuse_backend_rs::api::server::Server;
use fuse_backend_rs::transport::{FuseChannel, FuseSession};
use tracing::{debug, info, warn};

use super::SessionFs;

/// Filesystem name shown in the host's mount table.
pub const FSNAME: &str = "cowork-fs";

/// Most worker threads a host mount may ask for.
pub const MAX_WORKERS: usize = 64;

/// Why a host mount failed.
#[derive(Debug, thiserror::Error)]
pub enum HostMountError {
    /// `workers` was 0 or above [`MAX_WORKERS`].
    #[error("a host mount needs 1..={MAX_WORKERS} worker threads, not {0}")]
    Workers(usize),
    /// fuse-backend-rs could not set up or mount the session.
    #[error("cannot mount the filesystem on {mountpoint:?}: {reason}; this needs /dev/fuse and root (or fusermount3)")]
    Mount {
        /// The mount point.
        mountpoint: PathBuf,
        /// fuse-backend-rs's error.
        reason: String,
    },
    /// A worker thread could not be started.
    #[error("cannot start a FUSE worker thread: {0}")]
    Worker(#[source] std::io::Error),
    /// Unmounting failed (the mount point may be busy).
    #[error("cannot unmount {mountpoint:?}: {reason}")]
    Unmount {
        /// The mount point.
        mountpoint: PathBuf,
        /// fuse-backend-rs's error.
        reason: String,
    },
}

/// A [`SessionFs`] mounted on a host directory. Unmounted on drop.
pub struct HostMount {
    session: FuseSession,
    workers: Vec<JoinHandle<()>>,
    mountpoint: PathBuf,
}

impl HostMount {
    /// Mounts `fs` on `mountpoint` (an existing directory) and serves it
    /// with `workers` threads; only the mounting user may use it.
    pub fn mount(
        fs: Arc<SessionFs>,
        mountpoint: &Path,
        workers: usize,
    ) -> Result<Self, HostMountError> {
        Self::mount_with(fs, mountpoint, workers, false)
    }

    /// [`Self::mount`] with `allow_other`: every user may use the mount,
    /// subject to the mode bits and owners the server presents (checked by
    /// the host kernel with `default_permissions`). Needs root (or
    /// `user_allow_other` in `/etc/fuse.conf`).
    pub fn mount_for_everyone(
        fs: Arc<SessionFs>,
        mountpoint: &Path,
        workers: usize,
    ) -> Result<Self, HostMountError> {
        Self::mount_with(fs, mountpoint, workers, true)
    }

    fn mount_with(
        fs: Arc<SessionFs>,
        mountpoint: &Path,
        workers: usize,
        allow_other: bool,
    ) -> Result<Self, HostMountError> {
        if workers == 0 || workers > MAX_WORKERS {
            return Err(HostMountError::Workers(workers));
        }
        let mount_err = |e: fuse_backend_rs::transport::Error| HostMountError::Mount {
            mountpoint: mountpoint.to_path_buf(),
            reason: e.to_string(),
        };
        let mut session = FuseSession::new(mountpoint, FSNAME, "", false).map_err(mount_err)?;
        session.set_allow_other(allow_other);
        session.mount().map_err(mount_err)?;
        let mut mount = Self {
            mountpoint: session.mountpoint().to_path_buf(),
            session,
            workers: Vec::with_capacity(workers),
        };
        let server = Arc::new(Server::new(fs));
        for i in 0..workers {
            let channel = mount.session.new_channel().map_err(mount_err)?;
            let server = server.clone();
            let handle = std::thread::Builder::new()
                .name(format!("fuse-host-{i}"))
                .spawn(move || serve(channel, &server))
                .map_err(HostMountError::Worker)?;
            mount.workers.push(handle);
        }
        info!(mountpoint = %mount.mountpoint.display(), workers, allow_other, "virtio-fs: filesystem mounted on the host");
        Ok(mount)
    }

    /// Where the filesystem is mounted (canonicalized).
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts and stops the workers, reporting an unmount failure.
    pub fn unmount(mut self) -> Result<(), HostMountError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), HostMountError> {
        let res = self.session.umount().map_err(|e| HostMountError::Unmount {
            mountpoint: self.mountpoint.clone(),
            reason: e.to_string(),
        });
        if let Err(e) = self.session.wake() {
            warn!("virtio-fs: cannot wake the host mount's workers: {e}");
        }
        for w in self.workers.drain(..) {
            if w.join().is_err() {
                warn!("virtio-fs: a host mount worker panicked");
            }
        }
        if res.is_ok() {
            info!(mountpoint = %self.mountpoint.display(), "virtio-fs: host mount unmounted");
        }
        res
    }
}

impl Drop for HostMount {
    fn drop(&mut self) {
        if !self.workers.is_empty() {
            if let Err(e) = self.shutdown() {
                warn!("virtio-fs: {e}");
            }
        }
    }
}

/// A worker: answers requests from `channel` until the mount goes away.
fn serve(mut channel: FuseChannel, server: &Server<Arc<SessionFs>>) {
    loop {
        match channel.get_request() {
            Ok(Some((reader, writer))) => {
                if let Err(e) = server.handle_message(reader, writer.into(), None, None) {
                    // The kernel aborts requests whose caller was interrupted;
                    // the reply then fails with ENOENT. Nothing to do.
                    debug!("virtio-fs host mount: request failed: {e}");
                }
            }
            Ok(None) => break,
            Err(e) => {
                warn!("virtio-fs host mount: channel failed, worker exits: {e}");
                break;
            }
        }
    }
}
