//! A running QEMU guest ([`QemuMachine`]): waiting for it to end, killing
//! it after the guest had its chance to power off, draining its console
//! into the log and the tail, and ending the in-process vhost-user server
//! threads once QEMU is gone (which flushes and unlocks the session disk)
//! and the egress acceptor with them.
//!
//! Limits: a server thread that does not end within [`VHOST_JOIN`] is left
//! behind (logged); QEMU's output is drained for at most [`CONSOLE_DRAIN`].

use std::fmt;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devices::vhost_user::blk::VhostUserServeError;
use devices::vhost_user::fs::VhostUserFsError;
use devices::vhost_user::vsock::VhostUserVsockError;
use devices::vsock::VsockHost;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Child;

use super::rundir::RunDir;
use crate::backend::console::{Console, ConsoleLines, ConsoleQuote, QUOTED_LINES};
use crate::backend::guest::{EgressAcceptor, ACCEPT_POLL, POWEROFF_DEADLINE};

/// How long the console readers get to drain QEMU's output after it exited.
const CONSOLE_DRAIN: Duration = Duration::from_secs(1);
/// How long the vhost-user thread gets to end after QEMU is gone.
const VHOST_JOIN: Duration = Duration::from_secs(5);

/// Reads `stream` into the log and `console`, line by line, until EOF.
pub(super) async fn pump_console(
    mut stream: impl AsyncRead + Unpin,
    console: Console,
    source: &'static str,
) {
    let mut buf = vec![0u8; 4096];
    let mut lines = ConsoleLines::new(console, source);
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => lines.feed(&buf[..n]),
        }
    }
}

/// The vhost-user threads of the single-queue devices (virtio-blk and
/// virtio-rng), with what ends and reports them.
pub(super) struct SingleQueueThreads {
    /// The session disk's server thread; it holds the image (and its lock)
    /// until it ends, flushing the disk when QEMU disconnects.
    pub(super) blk: Option<std::thread::JoinHandle<Result<(), VhostUserServeError>>>,
    pub(super) blk_socket: PathBuf,
    pub(super) blk_stats: Arc<devices::blk::BlkStats>,
    /// The entropy device's server thread.
    pub(super) rng: Option<std::thread::JoinHandle<Result<(), VhostUserServeError>>>,
    pub(super) rng_socket: PathBuf,
    /// The read-only root disks' server threads and sockets.
    pub(super) roots: Vec<(VhostThread, PathBuf)>,
}

/// A vhost-user single-queue server thread, until joined.
pub(super) type VhostThread = Option<std::thread::JoinHandle<Result<(), VhostUserServeError>>>;

/// How a QEMU machine ended ([`QemuMachine::wait`]).
#[derive(Clone, Debug)]
pub enum QemuEnd {
    /// QEMU exited by itself with `status`; the console's last lines say why.
    Exited {
        status: ExitStatus,
        console: ConsoleQuote,
    },
    /// The helper ended QEMU ([`QemuMachine::kill_by`]: the guest powered
    /// off when told to, or QEMU was killed); its status, when known.
    Stopped(Option<ExitStatus>),
    /// Waiting for QEMU failed (shared: a machine's end is reported more
    /// than once).
    WaitFailed(Arc<std::io::Error>),
}

impl fmt::Display for QemuEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QemuEnd::Exited { status, console } => write!(f, "QEMU exited ({status}){console}"),
            QemuEnd::Stopped(Some(status)) => write!(f, "QEMU ended ({status})"),
            QemuEnd::Stopped(None) => f.write_str("QEMU ended (status unknown)"),
            QemuEnd::WaitFailed(e) => write!(f, "cannot wait for QEMU: {e}"),
        }
    }
}

/// A running QEMU guest.
pub struct QemuMachine {
    pub(super) child: Child,
    pub(super) pid: Option<u32>,
    pub(super) console: Console,
    /// The tasks copying QEMU's stdout and stderr into the console.
    pub(super) pumps: Vec<tokio::task::JoinHandle<()>>,
    /// The agent dialled in (so a stop is expected to power the guest off).
    pub(super) connected: Arc<AtomicBool>,
    pub(super) vhost: Option<std::thread::JoinHandle<Result<(), VhostUserVsockError>>>,
    pub(super) vhost_socket: PathBuf,
    /// The virtio-fs server thread; ends when QEMU disconnects.
    pub(super) vhost_fs: Option<std::thread::JoinHandle<Result<(), VhostUserFsError>>>,
    pub(super) fs_canceller: devices::vhost_user::fs::FsServerCanceller,
    /// The session disk's and the entropy device's server threads (boxed:
    /// the machine is moved around inside [`crate::backend::BackendMachine`]).
    pub(super) single_queue: Box<SingleQueueThreads>,
    /// Serves the guest's egress connections; stopped once QEMU is gone.
    pub(super) egress: EgressAcceptor,
    /// Keeps the device's host side alive as long as the machine.
    pub(super) _host: VsockHost,
    pub(super) ended: Option<QemuEnd>,
    // Dropped last: the socket lives in it.
    pub(super) _run_dir: RunDir,
}

impl QemuMachine {
    /// Waits until QEMU exits by itself; says how, quoting the console.
    pub async fn wait(&mut self) -> QemuEnd {
        if let Some(how) = &self.ended {
            return how.clone();
        }
        let status = self.child.wait().await;
        self.drain_console().await;
        let how = match status {
            Ok(status) => QemuEnd::Exited {
                status,
                console: self.console.quote(QUOTED_LINES),
            },
            Err(e) => QemuEnd::WaitFailed(Arc::new(e)),
        };
        tracing::info!(pid = self.pid, how = %how, "qemu ended");
        self.ended = Some(how.clone());
        self.egress.stop();
        self.finish_vhost().await;
        how
    }

    /// Ends QEMU: when the agent had connected, the guest is expected to
    /// power off (the controller asked the agent to shut down) and gets
    /// [`POWEROFF_DEADLINE`]; then QEMU is killed. Idempotent.
    pub async fn kill(&mut self) {
        self.kill_by(Instant::now() + POWEROFF_DEADLINE).await
    }

    /// [`QemuMachine::kill`], the guest's power-off awaited until
    /// `poweroff_by`.
    pub async fn kill_by(&mut self, poweroff_by: Instant) {
        if self.ended.is_none() {
            let started = Instant::now();
            let mut status = None;
            if self.connected.load(Ordering::Acquire) {
                match tokio::time::timeout_at(poweroff_by.into(), self.child.wait()).await {
                    Ok(Ok(st)) => status = Some(st),
                    Ok(Err(e)) => tracing::warn!(error = %e, "cannot wait for QEMU"),
                    Err(_) => tracing::warn!(
                        waited_ms = started.elapsed().as_millis() as u64,
                        "guest did not power off in time; killing QEMU"
                    ),
                }
            }
            if status.is_none() {
                let _ = self.child.start_kill();
                status = self.child.wait().await.ok();
            }
            let how = QemuEnd::Stopped(status);
            tracing::info!(
                pid = self.pid,
                how = %how,
                ms = started.elapsed().as_millis() as u64,
                "qemu stopped"
            );
            self.ended = Some(how);
        }
        self.egress.stop();
        self.drain_console().await;
        self.finish_vhost().await;
    }

    /// Lets the console readers reach EOF, so the last lines are in.
    async fn drain_console(&mut self) {
        let pumps = std::mem::take(&mut self.pumps);
        let all = async {
            for p in pumps {
                let _ = p.await;
            }
        };
        if tokio::time::timeout(CONSOLE_DRAIN, all).await.is_err() {
            tracing::debug!("QEMU's output is still open (a child holds it?)");
        }
    }

    /// Joins the vhost-user threads. They end when QEMU disconnects; if QEMU
    /// never connected, a throwaway connection unblocks their accept.
    async fn finish_vhost(&mut self) {
        if let Some(handle) = self.vhost.take() {
            if !handle.is_finished() {
                let _ = std::os::unix::net::UnixStream::connect(&self.vhost_socket);
            }
            join_vhost_thread(handle, "vsock").await;
        }
        if let Some(handle) = self.vhost_fs.take() {
            if !handle.is_finished() {
                self.fs_canceller.cancel();
            }
            join_vhost_thread(handle, "virtio-fs").await;
        }
        let sq = &mut self.single_queue;
        if let Some(handle) = sq.blk.take() {
            if !handle.is_finished() {
                let _ = std::os::unix::net::UnixStream::connect(&sq.blk_socket);
            }
            join_vhost_thread(handle, "virtio-blk").await;
            let s = &sq.blk_stats;
            tracing::info!(
                requests = s.requests.load(Ordering::Relaxed),
                bytes_read = s.bytes_read.load(Ordering::Relaxed),
                bytes_written = s.bytes_written.load(Ordering::Relaxed),
                flushes = s.flushes.load(Ordering::Relaxed),
                errors = s.errors.load(Ordering::Relaxed),
                "session disk closed"
            );
        }
        if let Some(handle) = sq.rng.take() {
            if !handle.is_finished() {
                let _ = std::os::unix::net::UnixStream::connect(&sq.rng_socket);
            }
            join_vhost_thread(handle, "virtio-rng").await;
        }
        for (thread, socket) in &mut sq.roots {
            if let Some(handle) = thread.take() {
                if !handle.is_finished() {
                    let _ = std::os::unix::net::UnixStream::connect(&*socket);
                }
                join_vhost_thread(handle, "virtio-blk (root)").await;
            }
        }
    }
}

/// Waits (bounded by [`VHOST_JOIN`]) for a vhost-user server thread to end
/// and logs how it ended.
async fn join_vhost_thread<E>(handle: std::thread::JoinHandle<Result<(), E>>, device: &'static str)
where
    E: std::fmt::Display + Send + 'static,
{
    let joined = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + VHOST_JOIN;
        while !handle.is_finished() && Instant::now() < deadline {
            std::thread::sleep(ACCEPT_POLL);
        }
        if handle.is_finished() {
            Some(handle.join())
        } else {
            None
        }
    })
    .await;
    match joined {
        Ok(Some(Ok(Ok(())))) => tracing::debug!(device, "vhost-user thread ended"),
        Ok(Some(Ok(Err(e)))) => tracing::debug!(device, error = %e, "vhost-user thread ended"),
        Ok(Some(Err(_))) => tracing::warn!(device, "vhost-user thread panicked"),
        Ok(None) => tracing::warn!(device, "vhost-user thread did not end; left behind"),
        Err(e) => tracing::warn!(device, error = %e, "cannot join the vhost-user thread"),
    }
}
