//! The host side of the vsock device, as the helper sees it.
//!
//! [`VsockHost`] is a cheap, cloneable handle shared by the helper and the
//! device model (either face). It lives independently of the device: ports
//! can be listened on before the guest boots and survive device resets.
//!
//! * [`VsockHost::listen`] registers a port; each guest connection to
//!   (CID 2, port) is accepted by the device and handed to the returned
//!   [`Listener`] as a [`UnixStream`]: one end of a socketpair whose other end
//!   the device thread pumps. No socket files, no text protocol. The stream is
//!   blocking; call `set_nonblocking(true)` and `tokio::net::UnixStream::from_std`
//!   for async use.
//! * [`VsockHost::connect`] dials a guest port and returns the same kind of
//!   stream once the guest accepted.
//! * [`VsockHost::map_unix`] forwards guest connections on a port to a host
//!   Unix socket path (for tools): the device connects to the path for each
//!   guest connection.
//! * [`VsockHost::reset_transport`] drops every connection and tells the guest
//!   with a TRANSPORT_RESET event (when the face has an event queue).
//!
//! Closing a helper stream makes the guest see an orderly shutdown; dropping a
//! [`Listener`] frees its port (later guest connections get RST).
//!
//! Limits: one device model per handle; a `map_unix` target is connected with
//! a blocking `connect(2)` on the device thread (Unix sockets only block when
//! the target's backlog is full).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use vmm::sync::MutexExt;
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};

/// Default time [`VsockHost::connect`] waits for the guest to accept.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a host-initiated connection failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConnectError {
    /// The guest answered our REQUEST with RST: nothing listens on the port.
    #[error("the guest refused the connection (no listener on that port)")]
    Refused,
    /// The guest did not answer in time.
    #[error("the guest did not answer the connection request in time; is its vsock driver up?")]
    TimedOut,
    /// The device's connection table is full.
    #[error("the vsock device is at its connection limit; close some connections")]
    Limit,
    /// The connection was reset before it was established (device reset,
    /// host stream error).
    #[error("the connection was reset before it was established (device reset or guest reboot)")]
    Reset,
}

/// Errors of the host API.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// Another listener or mapping owns the port.
    #[error("vsock port {0} is already listened on or mapped; pick another port or drop the existing listener")]
    PortInUse(u32),
    /// Creating the socketpair or an eventfd failed.
    #[error("cannot create a socketpair/eventfd for vsock: {0}; check the process fd limit")]
    Io(#[from] io::Error),
    /// The connection attempt failed.
    #[error("vsock connect to guest port {port} failed: {source}")]
    Connect {
        /// Guest port.
        port: u32,
        /// Why.
        source: ConnectError,
    },
    /// The device model behind this handle is gone for good.
    #[error("the vsock device was dropped; no connection can be made")]
    DeviceGone,
    /// Nothing arrived within the timeout.
    #[error("no guest connection arrived within the timeout")]
    AcceptTimedOut,
}

/// What a guest connection to a listened-on port is handed to.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// An in-process [`Listener`].
    Channel(Sender<UnixStream>),
    /// A host Unix socket path.
    Unix(PathBuf),
}

/// A host-side request to the device thread.
pub(crate) enum Request {
    /// Dial `port` in the guest; the device pumps `stream`.
    Connect {
        port: u32,
        stream: UnixStream,
        reply: Sender<Result<(), ConnectError>>,
        timeout: Duration,
    },
    /// Reset every connection and notify the guest.
    ResetTransport,
}

/// State shared between the handle and the device.
pub(crate) struct Shared {
    pub(crate) targets: Mutex<HashMap<u32, Target>>,
    pub(crate) requests: Mutex<VecDeque<Request>>,
    /// Written when a request is queued; the device polls it.
    pub(crate) wake: EventFd,
}

impl Shared {
    pub(crate) fn targets(&self) -> MutexGuard<'_, HashMap<u32, Target>> {
        // A panic while holding the lock cannot leave the map inconsistent
        // (single insert/remove operations), so poisoning is ignored.
        self.targets.locked()
    }

    pub(crate) fn take_requests(&self) -> VecDeque<Request> {
        std::mem::take(&mut *self.requests.locked())
    }

    fn push(&self, req: Request) -> io::Result<()> {
        self.requests.locked().push_back(req);
        self.wake.write(1)
    }
}

/// Handle on the host side of a vsock device (see the module docs).
#[derive(Clone)]
pub struct VsockHost {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for VsockHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VsockHost").finish_non_exhaustive()
    }
}

impl VsockHost {
    /// A new handle with no listeners.
    pub fn new() -> Result<Self, HostError> {
        Ok(Self {
            shared: Arc::new(Shared {
                targets: Mutex::new(HashMap::new()),
                requests: Mutex::new(VecDeque::new()),
                wake: EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC)?,
            }),
        })
    }

    fn claim(&self, port: u32, target: Target) -> Result<(), HostError> {
        let mut t = self.shared.targets();
        if t.contains_key(&port) {
            return Err(HostError::PortInUse(port));
        }
        t.insert(port, target);
        Ok(())
    }

    /// Accepts guest connections to (CID 2, `port`).
    pub fn listen(&self, port: u32) -> Result<Listener, HostError> {
        let (tx, rx) = mpsc::channel();
        self.claim(port, Target::Channel(tx))?;
        tracing::debug!(port, "vsock: listening");
        Ok(Listener {
            port,
            rx,
            shared: self.shared.clone(),
        })
    }

    /// Forwards guest connections to (CID 2, `port`) to the Unix socket at
    /// `path`, connecting once per guest connection.
    pub fn map_unix(&self, port: u32, path: impl Into<PathBuf>) -> Result<(), HostError> {
        let path = path.into();
        tracing::debug!(port, path = %path.display(), "vsock: mapping port to a host socket");
        self.claim(port, Target::Unix(path))
    }

    /// Removes a [`Self::map_unix`] mapping (or a listener's registration).
    pub fn unmap(&self, port: u32) {
        self.shared.targets().remove(&port);
    }

    /// Dials guest port `port` and waits up to `timeout` for the guest to
    /// accept. The returned stream is blocking.
    pub fn connect(&self, port: u32, timeout: Duration) -> Result<UnixStream, HostError> {
        let (ours, device) = UnixStream::pair()?;
        device.set_nonblocking(true)?;
        let (reply, result) = mpsc::channel();
        self.shared.push(Request::Connect {
            port,
            stream: device,
            reply,
            timeout,
        })?;
        // The device enforces `timeout` itself; the margin covers a device
        // thread that is not running at all (not yet activated).
        match result.recv_timeout(timeout + Duration::from_millis(500)) {
            Ok(Ok(())) => Ok(ours),
            Ok(Err(source)) => Err(HostError::Connect { port, source }),
            Err(RecvTimeoutError::Timeout) => Err(HostError::Connect {
                port,
                source: ConnectError::TimedOut,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(HostError::DeviceGone),
        }
    }

    /// Drops every connection and sends the guest a TRANSPORT_RESET event.
    pub fn reset_transport(&self) -> Result<(), HostError> {
        self.shared.push(Request::ResetTransport)?;
        Ok(())
    }
}

/// Guest connections to one port (see [`VsockHost::listen`]). Dropping it
/// frees the port.
pub struct Listener {
    port: u32,
    rx: Receiver<UnixStream>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("port", &self.port)
            .finish()
    }
}

impl Listener {
    /// The port.
    pub fn port(&self) -> u32 {
        self.port
    }

    /// Waits for the next guest connection.
    pub fn accept(&self) -> Result<UnixStream, HostError> {
        self.rx.recv().map_err(|_| HostError::DeviceGone)
    }

    /// Waits up to `timeout` for the next guest connection.
    pub fn accept_timeout(&self, timeout: Duration) -> Result<UnixStream, HostError> {
        self.rx.recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => HostError::AcceptTimedOut,
            RecvTimeoutError::Disconnected => HostError::DeviceGone,
        })
    }

    /// The next guest connection if one is waiting.
    pub fn try_accept(&self) -> Result<Option<UnixStream>, HostError> {
        match self.rx.try_recv() {
            Ok(s) => Ok(Some(s)),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(HostError::DeviceGone),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let mut t = self.shared.targets();
        if matches!(t.get(&self.port), Some(Target::Channel(_))) {
            t.remove(&self.port);
        }
    }
}
