//! The stage-1 relay: the proxy that session processes find in their
//! `*_PROXY` variables (`127.0.0.1:3128`). Each accepted connection gets a
//! fresh stream to the host's egress proxy ([`Upstream::dial`]) and bytes are
//! copied both ways ([`splice`]) until both directions ended.
//!
//! The relay parses nothing: the client's request (HTTP CONNECT, an
//! absolute-form request or SOCKS5) carries the spawn's credential, and the
//! host checks it and the policy. A client without a credential gets the
//! host's 407 through the relay.
//!
//! Limits: at most [`MAX_RELAYED_CONNECTIONS`] at once; one more is closed
//! at accept (and logged, rate-limited), so a flood cannot use up the
//! agent's descriptors.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::upstream::Upstream;
use super::RateLimitedLog;

/// Buffer per direction of a relayed connection: large enough that a bulk
/// transfer costs few system calls (8 KiB copies held a relay to a fraction
/// of a direct loopback copy on the host side, see the host proxy's
/// `RELAY_BUFFER_BYTES`).
pub const RELAY_BUFFER_BYTES: usize = 256 * 1024;

/// Connections the relay carries at once. Each costs two descriptors and
/// up to 2 × [`RELAY_BUFFER_BYTES`]; 1024 stays well inside the agent's
/// open-file limit and about 512 MiB of buffers at the very worst.
pub const MAX_RELAYED_CONNECTIONS: usize = 1024;

/// Pause after an accept failed for lack of resources (descriptors,
/// memory), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Errors starting the relay.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("cannot listen on {addr} for the egress relay: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
}

/// Copies both ways until both directions ended; one side's EOF becomes a
/// write shutdown of the other (half-close), the other direction keeps
/// flowing. Returns (bytes a→b, bytes b→a).
pub async fn splice<A, B>(a: &mut A, b: &mut B) -> io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    tokio::io::copy_bidirectional_with_sizes(a, b, RELAY_BUFFER_BYTES, RELAY_BUFFER_BYTES).await
}

/// Binds the relay's listener on `addr`; serving starts with [`serve`].
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, RelayError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| RelayError::Bind { addr, source })
}

/// Accepts on `listener` forever, relaying each connection to `upstream`.
/// Returns only when accepting fails for good.
pub async fn serve(listener: TcpListener, upstream: Upstream) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(MAX_RELAYED_CONNECTIONS));
    let full_log = RateLimitedLog::new();
    loop {
        let (mut client, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                accept_failed(e).await?;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            if full_log.allow() {
                tracing::warn!(
                    limit = MAX_RELAYED_CONNECTIONS,
                    "egress relay full; connection closed"
                );
            }
            continue;
        };
        let _ = client.set_nodelay(true);
        let upstream = upstream.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut up = match upstream.dial().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "egress relay: host proxy unreachable");
                    return;
                }
            };
            match splice(&mut client, &mut up).await {
                Ok((sent, received)) => {
                    tracing::debug!(%peer, sent, received, "egress relay connection closed")
                }
                Err(e) => tracing::debug!(%peer, error = %e, "egress relay connection failed"),
            }
        });
    }
}

/// Transient accept errors are retried (after a pause when resources ran
/// out); anything else ends the accept loop.
pub(crate) async fn accept_failed(e: io::Error) -> io::Result<()> {
    use io::ErrorKind::*;
    match e.kind() {
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock => Ok(()),
        _ if matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
        ) =>
        {
            tracing::warn!(error = %e, "egress accept failed; retrying");
            tokio::time::sleep(ACCEPT_BACKOFF).await;
            Ok(())
        }
        _ => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpStream, UnixListener};

    /// End to end: a client through the relay (ephemeral port) to a unix
    /// stand-in for the host proxy, both directions, bulk data, half-close
    /// each way.
    #[tokio::test]
    async fn relay_copies_both_ways_with_half_close() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("egress.sock");
        let host = UnixListener::bind(&sock).unwrap();
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, Upstream::Unix(sock)));
        // The "host": reads the whole request, then answers with a reply that
        // depends on it, then closes its write side.
        let server = tokio::spawn(async move {
            let (mut s, _) = host.accept().await.unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.unwrap();
            let reply: Vec<u8> = got.iter().rev().copied().collect();
            s.write_all(b"HEAD").await.unwrap();
            s.write_all(&reply).await.unwrap();
            s.shutdown().await.unwrap();
            got.len()
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        c.write_all(&data).await.unwrap();
        c.shutdown().await.unwrap(); // half-close: the host sees EOF...
        let mut back = Vec::new();
        c.read_to_end(&mut back).await.unwrap(); // ...and still answers
        assert_eq!(server.await.unwrap(), data.len());
        assert_eq!(&back[..4], b"HEAD");
        assert!(back[4..].iter().eq(data.iter().rev()));
    }

    #[tokio::test]
    async fn relay_closes_the_client_when_the_host_is_unreachable() {
        let dir = tempfile::tempdir().unwrap();
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, Upstream::Unix(dir.path().join("none"))));
        let mut c = TcpStream::connect(addr).await.unwrap();
        let mut buf = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut buf))
            .await
            .expect("closed promptly")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }

    #[tokio::test]
    async fn binding_a_taken_port_names_the_address() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = bind(addr).await.unwrap_err();
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }
}
