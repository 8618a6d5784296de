//! Establishing the host link: an inherited descriptor, a Unix socket, or
//! AF_VSOCK to the host. Unix and vsock connects are retried with a growing
//! pause (`FIRST_RETRY` up to `MAX_RETRY`) for [`CONNECT_PATIENCE`]: the
//! host may still be setting up its listener when the agent starts.

use std::io;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::time::Duration;

use super::cli::ConnectTarget;
use crate::sys;

/// How long the agent keeps trying to reach the host.
pub const CONNECT_PATIENCE: Duration = Duration::from_secs(30);

/// First pause between connection attempts.
const FIRST_RETRY: Duration = Duration::from_millis(20);

/// Longest pause between connection attempts.
const MAX_RETRY: Duration = Duration::from_millis(500);

/// Socket buffer size asked for on the host link (best effort), so bulk
/// output moves in large writes.
const SOCKET_BUFFER: libc::c_int = 4 * 1024 * 1024;

/// Errors reaching the host.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("descriptor {fd} is not usable: {source}")]
    BadFd { fd: i32, source: io::Error },
    #[error("cannot reach the host at {target} within {patience:?}: {source}")]
    GaveUp {
        target: String,
        patience: Duration,
        source: io::Error,
    },
}

/// The pauses between connection attempts: `first`, doubling up to `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pacing {
    first: Duration,
    max: Duration,
}

impl Pacing {
    /// From `FIRST_RETRY` up to `MAX_RETRY`: the host's listener is
    /// usually there, or soon.
    pub const GROWING: Pacing = Pacing {
        first: FIRST_RETRY,
        max: MAX_RETRY,
    };

    /// The pause after `pause`.
    fn next(self, pause: Duration) -> Duration {
        (pause * 2).min(self.max)
    }

    /// The same pause every time (waiting for a device that will be
    /// hot-plugged: the moment it binds should not wait for a long pause).
    pub const fn steady(pause: Duration) -> Pacing {
        Pacing {
            first: pause,
            max: pause,
        }
    }
}

/// Connects to `target`, retrying within `patience` ([`Pacing::GROWING`]).
pub async fn connect(target: &ConnectTarget, patience: Duration) -> Result<OwnedFd, ConnectError> {
    connect_paced(target, patience, Pacing::GROWING).await
}

/// Connects to `target`, retrying within `patience` at `pacing`.
pub async fn connect_paced(
    target: &ConnectTarget,
    patience: Duration,
    pacing: Pacing,
) -> Result<OwnedFd, ConnectError> {
    if let ConnectTarget::Fd(fd) = *target {
        return adopt_fd(fd);
    }
    let deadline = tokio::time::Instant::now() + patience;
    let mut pause = pacing.first;
    loop {
        let attempt = match target {
            ConnectTarget::Unix(path) => tokio::net::UnixStream::connect(path)
                .await
                .and_then(|s| s.into_std())
                .map(OwnedFd::from),
            ConnectTarget::Vsock { cid, port } => {
                let (cid, port) = (*cid, *port);
                tokio::task::spawn_blocking(move || vsock_connect(cid, port))
                    .await
                    .unwrap_or_else(|e| Err(io::Error::other(e.to_string())))
            }
            ConnectTarget::Fd(_) => unreachable!("handled above"),
        };
        match attempt {
            Ok(fd) => {
                tune(&fd);
                return Ok(fd);
            }
            Err(e) if tokio::time::Instant::now() + pause < deadline => {
                tracing::debug!(target_addr = %target, error = %e, "host not reachable yet; retrying");
                tokio::time::sleep(pause).await;
                pause = pacing.next(pause);
            }
            Err(e) => {
                return Err(ConnectError::GaveUp {
                    target: target.to_string(),
                    patience,
                    source: e,
                })
            }
        }
    }
}

/// Takes ownership of an inherited descriptor after checking it is open.
fn adopt_fd(fd: i32) -> Result<OwnedFd, ConnectError> {
    // SAFETY: F_GETFD only queries the descriptor table.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
        return Err(ConnectError::BadFd {
            fd,
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: the descriptor is open and handed to us by the command line;
    // nothing else in this process owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    sys::set_cloexec(owned.as_fd()).map_err(|e| ConnectError::BadFd { fd, source: e })?;
    tune(&owned);
    Ok(owned)
}

/// A blocking AF_VSOCK stream connect.
fn vsock_connect(cid: u32, port: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let fd = sys::cvt(unsafe {
        libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0)
    })?;
    // SAFETY: new descriptor owned by us.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_vm is plain data; zero is valid.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    loop {
        // SAFETY: valid address of the given length.
        let r = unsafe {
            libc::connect(
                fd,
                (&addr as *const libc::sockaddr_vm).cast(),
                std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        };
        if r == 0 {
            return Ok(sock);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Best-effort larger socket buffers.
fn tune(fd: &OwnedFd) {
    use std::os::fd::AsRawFd;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: setsockopt with a valid int option; ENOTSOCK is harmless.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&SOCKET_BUFFER as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unix_connect_retries_until_the_listener_exists() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("host.sock");
        let p2 = path.clone();
        let listener = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let l = tokio::net::UnixListener::bind(&p2).unwrap();
            l.accept().await.unwrap()
        });
        let fd = connect(&ConnectTarget::Unix(path), Duration::from_secs(5))
            .await
            .unwrap();
        drop(fd);
        listener.await.unwrap();
    }

    #[test]
    fn pacing_grows_to_its_limit_or_stays_steady() {
        let mut p = Pacing::GROWING.first;
        let mut seen = vec![p];
        for _ in 0..8 {
            p = Pacing::GROWING.next(p);
            seen.push(p);
        }
        assert_eq!(seen[1], FIRST_RETRY * 2);
        assert_eq!(*seen.last().unwrap(), MAX_RETRY);
        let steady = Pacing::steady(Duration::from_millis(10));
        assert_eq!(steady.next(steady.first), Duration::from_millis(10));
    }

    #[tokio::test]
    async fn gives_up_after_patience_and_checks_fds() {
        let err = connect(
            &ConnectTarget::Unix("/nonexistent/x.sock".into()),
            Duration::from_millis(100),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, ConnectError::GaveUp { .. }), "{err}");
        // No vsock peer listens on the local CID: retried, then a clear error
        // (whether or not this machine has a vsock transport at all).
        let t0 = std::time::Instant::now();
        let err = connect(
            &ConnectTarget::Vsock {
                cid: 1,
                port: 40_123,
            },
            Duration::from_millis(200),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, ConnectError::GaveUp { .. }), "{err}");
        assert!(err.to_string().contains("vsock:1:40123"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(10));
        let err = connect(&ConnectTarget::Fd(987_654), Duration::ZERO)
            .await
            .unwrap_err();
        assert!(matches!(err, ConnectError::BadFd { .. }), "{err}");
    }
}
