//! Asynchronous I/O on raw descriptors (the host link of any socket family,
//! process pipes) through tokio's `AsyncFd`.
//!
//! tokio has no type for AF_VSOCK sockets or inherited descriptors, and its
//! pipe types copy through `ReadBuf`; this wrapper reads straight into the
//! spare capacity of a `Vec` (no zeroing, no copy) and writes many frames per
//! `writev`. The descriptor is switched to non-blocking mode.
//!
//! Limits: readiness is edge-driven by tokio; every operation loops until
//! `EAGAIN` clears the readiness, so callers never see `WouldBlock`.
//!
//! Reads also end on a socket error that comes without `EPOLLIN`: a virtio
//! transport reset (a snapshot, a restore) marks every vsock socket of the
//! guest closed with `ECONNRESET` and reports only `EPOLLERR` (and
//! `EPOLLOUT`), which wakes no tokio reader; a read waiting for data alone
//! would wait for ever.

use std::future::Future;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, Interest, ReadBuf};

use crate::sys;

/// Largest number of buffers handed to one `writev` (the kernel's `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// `read(2)` from `fd` into possibly uninitialized memory: returns how many
/// bytes the kernel wrote, which are then initialized (the rest is not).
fn read_uninit(fd: &OwnedFd, buf: &mut [MaybeUninit<u8>]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes and the kernel
    // writes at most that many; `fd` is open for the call.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// A non-blocking descriptor registered with the tokio reactor. Cloning
/// shares it, so one clone can read while another writes.
#[derive(Clone, Debug)]
pub struct FdIo {
    fd: Arc<AsyncFd<OwnedFd>>,
}

impl FdIo {
    /// Takes ownership of `fd`, makes it non-blocking and close-on-exec and
    /// registers it. Must be called inside a tokio runtime.
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        sys::set_nonblocking(fd.as_fd())?;
        sys::set_cloexec(fd.as_fd())?;
        // SAFETY: an OwnedFd stays open and refers to the same description
        // for as long as the AsyncFd owns it.
        let fd = unsafe { AsyncFd::register(fd) }?;
        Ok(Self { fd: Arc::new(fd) })
    }

    /// The raw descriptor (for `fcntl`-style tuning).
    pub fn as_raw_fd(&self) -> i32 {
        self.fd.get_ref().as_raw_fd()
    }

    /// Reads at most `max` bytes into the spare capacity of `buf`, growing it
    /// as needed. Returns the byte count; 0 means end of stream.
    pub async fn read_append(&self, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
        buf.reserve(max);
        loop {
            // An error alone ends the read too (see the module doc).
            let mut guard = self.fd.ready(Interest::READABLE | Interest::ERROR).await?;
            let spare = buf.spare_capacity_mut();
            let want = spare.len().min(max);
            let res = guard.try_io(|inner| read_uninit(inner.get_ref(), &mut spare[..want]));
            match res {
                Ok(Ok(n)) => {
                    // SAFETY: the kernel initialized exactly `n` bytes after len.
                    unsafe { buf.set_len(buf.len() + n) };
                    return Ok(n);
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `data`.
    pub async fn write_all(&self, data: &[u8]) -> io::Result<()> {
        let mut slices = [IoSlice::new(data)];
        self.writev_all(&mut slices).await
    }

    /// Writes all of `bufs`, as few `writev` calls as the peer allows.
    pub async fn writev_all(&self, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        IoSlice::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            let mut guard = self.fd.writable().await?;
            let count = bufs.len().min(IOV_MAX);
            let res = guard.try_io(|inner| {
                // SAFETY: IoSlice is ABI-compatible with iovec; `count` entries are valid.
                let n = unsafe {
                    libc::writev(
                        inner.get_ref().as_raw_fd(),
                        bufs.as_ptr().cast(),
                        count as libc::c_int,
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(Ok(n)) => IoSlice::advance_slices(&mut bufs, n),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    /// An `AsyncRead` view of this descriptor (for buffered frame parsing).
    pub fn reader(&self) -> FdReader {
        FdReader { io: self.clone() }
    }

    /// An `AsyncRead` + `AsyncWrite` view of this descriptor (for a short
    /// exchange before the agent's own reader and outbox take over).
    pub fn stream(&self) -> FdStream {
        FdStream {
            rd: self.reader(),
            error: None,
        }
    }

    /// Shuts the write side of a socket down (`SHUT_WR`); other descriptors
    /// are left alone.
    pub fn shutdown_write(&self) {
        // SAFETY: shutdown on a descriptor we own; ENOTSOCK is harmless.
        unsafe { libc::shutdown(self.as_raw_fd(), libc::SHUT_WR) };
    }
}

/// `AsyncRead` over an [`FdIo`].
#[derive(Debug)]
pub struct FdReader {
    io: FdIo,
}

impl AsyncRead for FdReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.io.fd.poll_read_ready(cx))?;
            // SAFETY: we only hand the kernel uninitialized memory to write
            // into, and mark exactly the bytes it wrote as initialized.
            let unfilled = unsafe { buf.unfilled_mut() };
            let res = guard.try_io(|inner| read_uninit(inner.get_ref(), unfilled));
            match res {
                Ok(Ok(n)) => {
                    // SAFETY: the kernel initialized `n` bytes.
                    unsafe { buf.assume_init(n) };
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

/// Resolves with the socket's pending error once the descriptor reports
/// one (`EPOLLERR`).
type ErrorWatch = Pin<Box<dyn Future<Output = io::Error> + Send>>;

/// `AsyncRead` and `AsyncWrite` over an [`FdIo`] (see [`FdIo::stream`]).
/// A read waiting for data also ends on a socket error (module doc).
pub struct FdStream {
    rd: FdReader,
    /// Watches for an error while a read waits.
    error: Option<ErrorWatch>,
}

impl std::fmt::Debug for FdStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdStream").field("rd", &self.rd).finish()
    }
}

/// The socket's pending error (`SO_ERROR`, which it clears), or
/// `ECONNRESET` when it has none to report.
fn socket_error(fd: &OwnedFd) -> io::Error {
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `err` and `len` are valid for writes of their sizes for the
    // call; `fd` is open.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            std::ptr::addr_of_mut!(err).cast(),
            &mut len,
        )
    };
    if r == 0 && err != 0 {
        io::Error::from_raw_os_error(err)
    } else {
        io::ErrorKind::ConnectionReset.into()
    }
}

impl FdStream {
    /// The descriptor, for the agent proper.
    pub fn into_io(self) -> FdIo {
        self.rd.io
    }
}

impl AsyncRead for FdStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Poll::Ready(r) = Pin::new(&mut self.rd).poll_read(cx, buf) {
            self.error = None;
            return Poll::Ready(r);
        }
        // No data: an error without EPOLLIN wakes no reader; watch for it.
        let fd = self.rd.io.fd.clone();
        let watch = self.error.get_or_insert_with(|| {
            Box::pin(async move {
                match fd.ready(Interest::ERROR).await {
                    Ok(_) => socket_error(fd.get_ref()),
                    Err(e) => e,
                }
            })
        });
        match watch.as_mut().poll(cx) {
            Poll::Ready(e) => {
                self.error = None;
                Poll::Ready(Err(e))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl tokio::io::AsyncWrite for FdStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.rd.io.fd.poll_write_ready(cx))?;
            let res = guard.try_io(|inner| {
                // SAFETY: `data` is valid for reads of its length; `fd` is open.
                let n = unsafe {
                    libc::write(
                        inner.get_ref().as_raw_fd(),
                        data.as_ptr().cast(),
                        data.len(),
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(n)) => return Poll::Ready(Ok(n)),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.rd.io.shutdown_write();
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A connected UDP socket whose datagram to a closed port came back as
    /// ICMP port unreachable: its error is reported as `EPOLLERR` without
    /// `EPOLLIN`, as a vsock socket's after a transport reset.
    async fn socket_with_an_error_only() -> OwnedFd {
        let closed = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = closed.local_addr().unwrap();
        drop(closed);
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        s.connect(to).unwrap();
        s.send(b"x").unwrap();
        // The ICMP error arrives asynchronously; the reader must be waiting
        // before it or after it, either way it must end.
        s.into()
    }

    #[tokio::test]
    async fn a_read_ends_on_an_error_that_comes_without_data() {
        let io = FdIo::new(socket_with_an_error_only().await).unwrap();
        let mut buf = Vec::new();
        let r = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            io.read_append(&mut buf, 64),
        )
        .await
        .expect("read_append must not wait for ever on an error");
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::ConnectionRefused);

        let mut stream = FdIo::new(socket_with_an_error_only().await)
            .unwrap()
            .stream();
        let mut byte = [0u8; 1];
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut byte))
            .await
            .expect("a stream read must not wait for ever on an error");
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::ConnectionRefused);
    }

    #[tokio::test]
    async fn vectored_writes_and_appending_reads() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let a = FdIo::new(a.into()).unwrap();
        let b = FdIo::new(b.into()).unwrap();
        let big = vec![7u8; 3 * 1024 * 1024];
        let writer = {
            let a = a.clone();
            let big = big.clone();
            tokio::spawn(async move {
                let mut s = [
                    IoSlice::new(b"abc"),
                    IoSlice::new(&big),
                    IoSlice::new(b"xyz"),
                ];
                a.writev_all(&mut s).await.unwrap();
                a.shutdown_write();
            })
        };
        let mut got = Vec::new();
        while b.read_append(&mut got, 256 * 1024).await.unwrap() > 0 {}
        writer.await.unwrap();
        assert_eq!(got.len(), big.len() + 6);
        assert_eq!(&got[..3], b"abc");
        assert_eq!(&got[got.len() - 3..], b"xyz");
        assert!(got[3..got.len() - 3].iter().all(|&x| x == 7));
    }

    #[tokio::test]
    async fn reader_sees_eof() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let a = FdIo::new(a.into()).unwrap();
        let mut r = FdIo::new(b.into()).unwrap().reader();
        a.write_all(b"hello").await.unwrap();
        drop(a);
        let mut s = String::new();
        r.read_to_string(&mut s).await.unwrap();
        assert_eq!(s, "hello");
    }
}
