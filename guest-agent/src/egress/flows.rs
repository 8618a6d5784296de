//! The stage-2 handler for captured connections: programs that ignore the
//! proxy variables connect "directly" (to a fake address the DNS stub gave
//! them, or to an IP literal), the capture ([`super::capture`]) hands each
//! such connection to the agent, and this module sends it to the host's
//! egress proxy as SOCKS5 CONNECT with the credential of the spawn that
//! made it.
//!
//! Per connection ([`handle`]):
//! 1. attribution ([`super::attrib`], on a blocking thread): which spawn's
//!    credential applies; none → the connection is reset;
//! 2. the target ([`target_for`]): a pool address is sent **by name** (the
//!    one the DNS stub handed out), so the host applies the same policy as
//!    for proxy-aware programs; a pool address without a name (handed out
//!    before an agent restart, or evicted) is reset; any other address is
//!    sent as an IPv4 literal (refused by the host unless listed);
//! 3. a fresh upstream stream, the SOCKS5 handshake
//!    ([`super::socks_client`]) within [`HANDSHAKE_TIMEOUT`], then bytes are
//!    copied both ways ([`super::relay::splice`]).
//!
//! A refusal or failure resets the client's connection (`SO_LINGER` 0), so
//! it fails at once instead of waiting on a silent socket, and produces one
//! rate-limited log line (never the credential).
//!
//! Limits: at most [`MAX_CAPTURED_CONNECTIONS`] at once (more are reset);
//! IPv4 only (the capture sees no IPv6: the stub answers no AAAA).

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use super::attrib;
use super::fake::FakePool;
use super::relay;
use super::sockdiag::Diag;
use super::socks_client::{self, Target};
use super::spawns::Spawns;
use super::upstream::Upstream;
use super::RateLimitedLog;

/// Captured connections carried at once (each costs two descriptors and
/// relay buffers, like the relay's [`relay::MAX_RELAYED_CONNECTIONS`]).
pub const MAX_CAPTURED_CONNECTIONS: usize = 1024;

/// Deadline for the SOCKS5 exchange with the host (the host answers at
/// once for a refusal; a connect to a slow destination takes longer).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a captured connection was not carried.
#[derive(Debug, thiserror::Error)]
pub enum FlowError {
    #[error("not attributable to a spawn: {0}")]
    Attrib(#[from] attrib::AttribError),
    #[error("{0} is a fake address the DNS stub has no name for (handed out before an agent restart, or evicted)")]
    StaleFakeAddress(Ipv4Addr),
    #[error(transparent)]
    Upstream(#[from] super::upstream::UpstreamError),
    #[error(transparent)]
    Socks(#[from] socks_client::SocksError),
    #[error("the egress proxy did not complete the SOCKS5 exchange within {HANDSHAKE_TIMEOUT:?}")]
    Timeout,
    #[error("attribution task failed: {0}")]
    Internal(String),
}

/// What the handler needs, shared by every captured connection.
pub struct FlowContext {
    pub upstream: Upstream,
    pub spawns: Spawns,
    pub pool: Arc<FakePool>,
    /// procfs root for attribution ([`attrib::PROC_ROOT`] in production).
    pub proc_root: PathBuf,
    diag: Diag,
    slots: Arc<Semaphore>,
    log: RateLimitedLog,
}

impl FlowContext {
    pub fn new(
        upstream: Upstream,
        spawns: Spawns,
        pool: Arc<FakePool>,
        proc_root: PathBuf,
    ) -> Self {
        Self {
            upstream,
            spawns,
            pool,
            proc_root,
            diag: Diag::new(),
            slots: Arc::new(Semaphore::new(MAX_CAPTURED_CONNECTIONS)),
            log: RateLimitedLog::new(),
        }
    }
}

/// What to ask the host for, for a connection to `dst`.
pub fn target_for(pool: &FakePool, dst: SocketAddrV4) -> Result<Target, FlowError> {
    let ip = *dst.ip();
    if FakePool::contains(ip) {
        return match pool.name_of(ip) {
            Some(name) => Ok(Target::Name(name, dst.port())),
            None => Err(FlowError::StaleFakeAddress(ip)),
        };
    }
    Ok(Target::V4(ip, dst.port()))
}

/// Carries one captured connection (see the module doc); returns when it
/// ended. Spawn it per connection.
pub async fn handle(
    ctx: Arc<FlowContext>,
    mut stream: TcpStream,
    original_dst: SocketAddrV4,
    peer: SocketAddr,
) {
    let Ok(_slot) = Arc::clone(&ctx.slots).try_acquire_owned() else {
        if ctx.log.allow() {
            tracing::warn!(
                limit = MAX_CAPTURED_CONNECTIONS,
                "too many captured connections; reset"
            );
        }
        reset(stream);
        return;
    };
    let _ = stream.set_nodelay(true);
    let mut up = match open(&ctx, original_dst, peer).await {
        Ok(up) => up,
        Err(e) => {
            if ctx.log.allow() {
                tracing::warn!(%peer, dst = %original_dst, error = %e, "captured connection refused");
            }
            reset(stream);
            return;
        }
    };
    match relay::splice(&mut stream, &mut up).await {
        Ok((sent, received)) => {
            tracing::debug!(%peer, dst = %original_dst, sent, received, "captured connection closed")
        }
        Err(e) => {
            tracing::debug!(%peer, dst = %original_dst, error = %e, "captured connection failed")
        }
    }
}

/// Attribution, target, upstream stream and handshake.
async fn open(
    ctx: &Arc<FlowContext>,
    dst: SocketAddrV4,
    peer: SocketAddr,
) -> Result<super::upstream::UpstreamStream, FlowError> {
    let target = target_for(&ctx.pool, dst)?;
    let c = Arc::clone(ctx);
    let (pid, cred) = tokio::task::spawn_blocking(move || {
        attrib::attribute(&c.proc_root, &c.diag, &c.spawns, peer, SocketAddr::V4(dst))
    })
    .await
    .map_err(|e| FlowError::Internal(e.to_string()))??;
    tracing::debug!(%peer, pid, %target, "captured connection attributed");
    let mut up = ctx.upstream.dial().await?;
    match tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        socks_client::connect(&mut up, &target, &cred),
    )
    .await
    {
        Ok(Ok(())) => Ok(up),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(FlowError::Timeout),
    }
}

/// Closes `stream` with a reset (`SO_LINGER` on, 0 s), so the client sees
/// `ECONNRESET` at once.
pub fn reset(stream: TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt with a valid linger struct on a socket we own.
    let r = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::debug!(error = %io::Error::last_os_error(), "cannot set SO_LINGER; closing normally");
    }
    drop(stream);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, UnixListener};

    #[test]
    fn pool_addresses_go_by_name_others_by_address() {
        let pool = FakePool::new();
        let ip = pool.assign("API.Example.com.").unwrap();
        assert_eq!(
            target_for(&pool, SocketAddrV4::new(ip, 443)).unwrap(),
            Target::Name("api.example.com".into(), 443)
        );
        let stale = Ipv4Addr::new(198, 19, 255, 1);
        assert!(matches!(
            target_for(&pool, SocketAddrV4::new(stale, 22)),
            Err(FlowError::StaleFakeAddress(a)) if a == stale
        ));
        let lit = Ipv4Addr::new(192, 0, 2, 9);
        assert_eq!(
            target_for(&pool, SocketAddrV4::new(lit, 22)).unwrap(),
            Target::V4(lit, 22)
        );
    }

    /// A captured connection of this very process (its session registered
    /// as a spawn) reaches a fake host proxy as SOCKS5 CONNECT with the
    /// spawn's credential, and the bytes flow both ways. The "capture" is a
    /// plain listener whose own address stands for the original
    /// destination (what an AnyIP capture reports too); it is no pool
    /// address, so it goes by address (by name is [`target_for`]'s test).
    #[tokio::test]
    async fn a_captured_connection_is_attributed_and_relayed() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("egress.sock");
        let host = UnixListener::bind(&sock).unwrap();
        let spawns = Spawns::new();
        // SAFETY: getsid(0) has no preconditions.
        let sid = unsafe { libc::getsid(0) };
        let key = if sid > 1 {
            sid
        } else {
            std::process::id() as i32
        };
        spawns
            .register(key, Some("http://sess:t%40ken@127.0.0.1:3128"))
            .unwrap();
        let ctx = Arc::new(FlowContext::new(
            Upstream::Unix(sock),
            spawns,
            Arc::new(FakePool::new()),
            attrib::PROC_ROOT.into(),
        ));
        let capture = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let SocketAddr::V4(cap_addr) = capture.local_addr().unwrap() else {
            unreachable!()
        };
        let server = tokio::spawn(async move {
            let (mut s, _) = host.accept().await.unwrap();
            let mut greet = [0u8; 3];
            s.read_exact(&mut greet).await.unwrap();
            assert_eq!(greet, [5, 1, 2]);
            s.write_all(&[5, 2]).await.unwrap();
            let mut auth = [0u8; 1 + 1 + 4 + 1 + 5];
            s.read_exact(&mut auth).await.unwrap();
            assert_eq!(&auth, b"\x01\x04sess\x05t@ken");
            s.write_all(&[1, 0]).await.unwrap();
            let mut req = [0u8; 10];
            s.read_exact(&mut req).await.unwrap();
            s.write_all(&[5, 0, 0, 1, 0, 0, 0, 0, 0, 0]).await.unwrap();
            let mut hello = [0u8; 5];
            s.read_exact(&mut hello).await.unwrap();
            s.write_all(b"world").await.unwrap();
            s.shutdown().await.unwrap();
            (req, hello)
        });
        let mut client = TcpStream::connect(cap_addr).await.unwrap();
        let (accepted, peer) = capture.accept().await.unwrap();
        let handler = tokio::spawn(handle(Arc::clone(&ctx), accepted, cap_addr, peer));
        client.write_all(b"hello").await.unwrap();
        let mut world = Vec::new();
        client.read_to_end(&mut world).await.unwrap();
        assert_eq!(world, b"world");
        let (req, hello) = server.await.unwrap();
        assert_eq!(&hello, b"hello");
        let mut want = vec![5, 1, 0, 1, 127, 0, 0, 1];
        want.extend_from_slice(&cap_addr.port().to_be_bytes());
        assert_eq!(req.to_vec(), want);
        drop(client);
        tokio::time::timeout(Duration::from_secs(5), handler)
            .await
            .expect("handler ends after both sides closed")
            .unwrap();
    }

    /// Unattributable (no spawn registered) or refused by the host: the
    /// client's connection is reset, not left hanging.
    #[tokio::test]
    async fn refused_and_unattributable_connections_are_reset() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("egress.sock");
        let host = UnixListener::bind(&sock).unwrap();
        // The host refuses every CONNECT (not allowed by the allowlist).
        tokio::spawn(async move {
            loop {
                let (mut s, _) = host.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut b = [0u8; 3];
                    s.read_exact(&mut b).await.unwrap();
                    s.write_all(&[5, 2]).await.unwrap();
                    let mut h = [0u8; 2];
                    s.read_exact(&mut h).await.unwrap();
                    let mut u = vec![0u8; usize::from(h[1]) + 1];
                    s.read_exact(&mut u).await.unwrap();
                    let mut p = vec![0u8; usize::from(*u.last().unwrap())];
                    s.read_exact(&mut p).await.unwrap();
                    s.write_all(&[1, 0]).await.unwrap();
                    let mut r = [0u8; 10];
                    s.read_exact(&mut r).await.unwrap();
                    s.write_all(&[5, 2, 0, 1, 0, 0, 0, 0, 0, 0]).await.unwrap();
                });
            }
        });
        let capture = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let SocketAddr::V4(cap_addr) = capture.local_addr().unwrap() else {
            unreachable!()
        };
        for registered in [false, true] {
            let spawns = Spawns::new();
            if registered {
                // SAFETY: getsid(0) has no preconditions.
                let sid = unsafe { libc::getsid(0) };
                let key = if sid > 1 {
                    sid
                } else {
                    std::process::id() as i32
                };
                spawns.register(key, Some("http://s:p@h:1")).unwrap();
            }
            let ctx = Arc::new(FlowContext::new(
                Upstream::Unix(sock.clone()),
                spawns,
                Arc::new(FakePool::new()),
                attrib::PROC_ROOT.into(),
            ));
            let mut client = TcpStream::connect(cap_addr).await.unwrap();
            let (accepted, peer) = capture.accept().await.unwrap();
            tokio::spawn(handle(ctx, accepted, cap_addr, peer));
            let mut buf = [0u8; 16];
            let r = tokio::time::timeout(Duration::from_secs(10), client.read(&mut buf))
                .await
                .expect("reset promptly");
            let err = r.expect_err("reset, not a clean EOF");
            assert_eq!(
                err.kind(),
                io::ErrorKind::ConnectionReset,
                "{registered}: {err}"
            );
        }
    }
}
