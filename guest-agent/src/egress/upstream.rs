//! The way to the host's egress proxy: a fresh byte stream per relayed or
//! captured connection.
//!
//! * [`Upstream::Vsock`]: in a VM, an `AF_VSOCK` stream to the host (CID
//!   [`proto::HOST_CID`], port [`proto::EGRESS_PORT`]), connected without
//!   blocking and driven by tokio through [`VsockStream`];
//! * [`Upstream::Unix`]: in the sandbox, the unix socket the sandbox named
//!   in [`proto::EGRESS_SOCKET_ENV`].
//!
//! The host serves every stream with its egress proxy, which tells HTTP from
//! SOCKS5 by the first byte; nothing here looks at the bytes.
//!
//! Limits: a dial that does not complete within [`DIAL_TIMEOUT`] fails; no
//! retry (the client sees its connection closed and may try again).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::UnixStream;

use crate::proto;
use crate::sys;

/// How long a dial to the host may take. The host answers at once when its
/// listener is up; this only bounds a stuck transport.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors reaching the host's proxy.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot reach the host's egress proxy at {target}: {source}")]
    Dial { target: String, source: io::Error },
    #[error("the host's egress proxy at {target} did not answer within {DIAL_TIMEOUT:?}")]
    Timeout { target: String },
}

impl From<UpstreamError> for io::Error {
    fn from(e: UpstreamError) -> Self {
        match e {
            UpstreamError::Dial { source, .. } => source,
            UpstreamError::Timeout { .. } => io::Error::new(io::ErrorKind::TimedOut, e),
        }
    }
}

/// Where the host's egress proxy is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Upstream {
    /// `AF_VSOCK` stream to (cid, port).
    Vsock { cid: u32, port: u32 },
    /// A unix stream socket at this path.
    Unix(PathBuf),
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Upstream::Vsock { cid, port } => write!(f, "vsock:{cid}:{port}"),
            Upstream::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl Upstream {
    /// The host's proxy as a VM reaches it.
    pub fn host_vsock() -> Self {
        Upstream::Vsock {
            cid: proto::HOST_CID,
            port: proto::EGRESS_PORT,
        }
    }

    /// Opens a new stream to the proxy.
    pub async fn dial(&self) -> Result<UpstreamStream, UpstreamError> {
        let attempt = async {
            match self {
                Upstream::Unix(path) => UnixStream::connect(path).await.map(UpstreamStream::Unix),
                Upstream::Vsock { cid, port } => VsockStream::connect(*cid, *port)
                    .await
                    .map(UpstreamStream::Vsock),
            }
        };
        match tokio::time::timeout(DIAL_TIMEOUT, attempt).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(source)) => Err(UpstreamError::Dial {
                target: self.to_string(),
                source,
            }),
            Err(_) => Err(UpstreamError::Timeout {
                target: self.to_string(),
            }),
        }
    }
}

/// A connected stream to the proxy.
#[derive(Debug)]
pub enum UpstreamStream {
    Unix(UnixStream),
    Vsock(VsockStream),
}

impl AsyncRead for UpstreamStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Unix(s) => Pin::new(s).poll_read(cx, buf),
            UpstreamStream::Vsock(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpstreamStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpstreamStream::Unix(s) => Pin::new(s).poll_write(cx, buf),
            UpstreamStream::Vsock(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Unix(s) => Pin::new(s).poll_flush(cx),
            UpstreamStream::Vsock(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            UpstreamStream::Vsock(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// A nonblocking `AF_VSOCK` stream registered with tokio.
#[derive(Debug)]
pub struct VsockStream {
    fd: AsyncFd<OwnedFd>,
}

impl VsockStream {
    /// Connects to (cid, port) without blocking a runtime thread.
    pub async fn connect(cid: u32, port: u32) -> io::Result<Self> {
        // SAFETY: plain socket(2).
        let raw = sys::cvt(unsafe {
            libc::socket(
                libc::AF_VSOCK,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                0,
            )
        })?;
        // SAFETY: a new descriptor that nothing else owns.
        let owned = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_vm is plain data; all-zero is valid.
        let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        addr.svm_cid = cid;
        addr.svm_port = port;
        // SAFETY: a valid address of the given length.
        let r = unsafe {
            libc::connect(
                raw,
                (&addr as *const libc::sockaddr_vm).cast(),
                std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        };
        let pending = if r == 0 {
            false
        } else {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINPROGRESS) | Some(libc::EINTR) => true,
                _ => return Err(e),
            }
        };
        // SAFETY: an OwnedFd's descriptor stays open and the same until the
        // AsyncFd (its owner from now on) is dropped.
        let fd = unsafe {
            AsyncFd::register_with_interest(owned, Interest::READABLE | Interest::WRITABLE)
        }
        .map_err(io::Error::from)?;
        // Wait for the connect to finish. The writable readiness that says so
        // must stay set: the socket stays writable, so under tokio's
        // edge-triggered epoll no new edge would come until the host sends
        // something — and in both proxy protocols the client speaks first.
        // Only a wake-up that finds the socket still unconnected is cleared.
        if pending {
            loop {
                let mut guard = fd.writable().await?;
                let err = socket_error(fd.get_ref())?;
                if err != 0 {
                    return Err(io::Error::from_raw_os_error(err));
                }
                if is_connected(fd.get_ref())? {
                    break;
                }
                guard.clear_ready();
            }
        }
        Ok(Self { fd })
    }
}

/// `SO_ERROR` of a socket: the outcome of a nonblocking connect.
/// Whether the socket has a peer (`getpeername` succeeds): a connect that
/// is still in progress answers `ENOTCONN`.
fn is_connected(fd: &OwnedFd) -> io::Result<bool> {
    // SAFETY: sockaddr_vm is plain data; all-zero is valid.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    // SAFETY: valid out-pointers of the right size.
    let r = unsafe {
        libc::getpeername(
            fd.as_raw_fd(),
            (&mut addr as *mut libc::sockaddr_vm).cast(),
            &mut len,
        )
    };
    match sys::cvt(r) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => Ok(false),
        Err(e) => Err(e),
    }
}

fn socket_error(fd: &OwnedFd) -> io::Result<i32> {
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: valid out-pointers of the right size.
    sys::cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&mut err as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    Ok(err)
}

impl AsyncRead for VsockStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let result = guard.try_io(|inner| {
                // SAFETY: reading into a valid, initialised buffer of this length.
                let n = unsafe {
                    libc::read(
                        inner.get_ref().as_raw_fd(),
                        unfilled.as_mut_ptr().cast(),
                        unfilled.len(),
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match result {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for VsockStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            let result = guard.try_io(|inner| {
                // SAFETY: writing from a valid buffer of this length.
                let n = unsafe {
                    libc::send(
                        inner.get_ref().as_raw_fd(),
                        buf.as_ptr().cast(),
                        buf.len(),
                        libc::MSG_NOSIGNAL,
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match result {
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // SAFETY: shutdown(2) on a descriptor we own.
        let r = unsafe { libc::shutdown(self.fd.get_ref().as_raw_fd(), libc::SHUT_WR) };
        match sys::cvt(r) {
            Ok(_) => Poll::Ready(Ok(())),
            // The peer is gone already: nothing left to half-close.
            Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn unix_upstream_dials_a_fresh_stream_each_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("egress.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let up = Upstream::Unix(path.clone());
        assert_eq!(up.to_string(), format!("unix:{}", path.display()));
        let server = tokio::spawn(async move {
            for i in 0..2u8 {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut b = [0u8; 1];
                s.read_exact(&mut b).await.unwrap();
                s.write_all(&[b[0] + i]).await.unwrap();
            }
        });
        for i in 0..2u8 {
            let mut s = up.dial().await.unwrap();
            s.write_all(&[10]).await.unwrap();
            let mut b = [0u8; 1];
            s.read_exact(&mut b).await.unwrap();
            assert_eq!(b[0], 10 + i);
        }
        server.await.unwrap();
        let missing = Upstream::Unix(dir.path().join("none.sock"));
        let err = missing.dial().await.unwrap_err();
        assert!(matches!(err, UpstreamError::Dial { .. }), "{err}");
        assert!(err.to_string().contains("none.sock"), "{err}");
    }

    #[tokio::test]
    async fn host_vsock_is_the_egress_port_and_fails_cleanly_without_a_peer() {
        assert_eq!(
            Upstream::host_vsock(),
            Upstream::Vsock {
                cid: 2,
                port: 51235
            }
        );
        // Nobody listens on the local CID at this port (and this machine may
        // have no vsock transport at all): a prompt, clear error either way.
        let up = Upstream::Vsock {
            cid: libc::VMADDR_CID_LOCAL,
            port: 40_124,
        };
        let t0 = std::time::Instant::now();
        let err = up.dial().await.unwrap_err();
        assert!(err.to_string().contains("vsock:1:40124"), "{err}");
        assert!(t0.elapsed() < DIAL_TIMEOUT + Duration::from_secs(1));
    }

    /// A real vsock round trip over the loopback transport, when this
    /// machine has one (module `vsock_loopback`).
    #[tokio::test]
    async fn vsock_stream_round_trip_and_half_close_over_loopback() {
        // SAFETY: plain socket(2).
        let raw =
            // SAFETY: socket() takes no pointers; the descriptor is owned at once below.
            unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            eprintln!("SKIPPED: no AF_VSOCK here");
            return;
        }
        // SAFETY: new descriptor.
        let listener = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain data.
        let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        addr.svm_cid = libc::VMADDR_CID_LOCAL;
        addr.svm_port = libc::VMADDR_PORT_ANY;
        let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
        // SAFETY: valid address and length.
        let bound = unsafe {
            libc::bind(raw, (&addr as *const libc::sockaddr_vm).cast(), len) == 0
                && libc::listen(raw, 4) == 0
        };
        if !bound {
            eprintln!(
                "SKIPPED: no vsock loopback transport ({})",
                io::Error::last_os_error()
            );
            return;
        }
        let mut got_len = len;
        // SAFETY: valid out-pointers.
        unsafe {
            libc::getsockname(
                raw,
                (&mut addr as *mut libc::sockaddr_vm).cast(),
                &mut got_len,
            )
        };
        let port = addr.svm_port;
        let server = std::thread::spawn(move || {
            // SAFETY: accept on our listener.
            let c = unsafe {
                libc::accept(
                    listener.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            };
            assert!(c >= 0);
            // SAFETY: new descriptor.
            let c = unsafe { OwnedFd::from_raw_fd(c) };
            let mut f = std::fs::File::from(c);
            let mut all = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut all).unwrap();
            std::io::Write::write_all(&mut f, &all).unwrap();
            all.len()
        });
        let mut s = Upstream::Vsock {
            cid: libc::VMADDR_CID_LOCAL,
            port,
        }
        .dial()
        .await
        .unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        s.write_all(&data).await.unwrap();
        s.shutdown().await.unwrap();
        let mut back = Vec::new();
        s.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, data);
        assert_eq!(server.join().unwrap(), data.len());
    }
}
