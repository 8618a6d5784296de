//! The host egress proxy: the only way a session's traffic leaves the
//! machine, with the session's `allowedDomains` enforced on the host.
//!
//! One entry point, [`EgressProxy::serve_stream`], serves any byte stream
//! (a vsock stream from a VM, a unix socket from the sandbox, a TCP
//! connection in tests): the first byte tells SOCKS5 (`0x05`) from HTTP/1
//! (CONNECT or an absolute-form request, via hyper). Every request must carry
//! a spawn's credential ([`creds`]), which selects that spawn's [`Policy`];
//! the [`EgressDialer`] applies the policy, the address guard ([`guard`]) and
//! the helper's own upstream proxy, and the proxy then relays bytes both ways
//! with half-close.
//!
//! Wiring (done by the caller, not here): at spawn, [`EgressProxy::issue`] a
//! credential with the spawn's policy and put [`proxy_url`] into its
//! environment; at its exit, [`EgressProxy::revoke`] it. Hand every stream
//! that arrives on the egress vsock port or the sandbox's proxy socket to
//! [`EgressProxy::serve_stream`] (or let [`EgressProxy::serve_unix`] accept).
//!
//! Limits: SOCKS4, SOCKS5 BIND/UDP and UDP in general are refused; plain-HTTP
//! forwarding uses one upstream connection per request; refusals are logged
//! at most [`LOG_BURST`] lines per [`LOG_WINDOW`] (the rest are counted).

pub mod creds;
pub mod dial;
pub mod guard;
pub mod host;
pub mod http;
pub mod intercept;
pub mod policy;
pub mod secrets;
pub mod socks;

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixListener};

pub use creds::{Credential, CredentialRegistry, Grant, Slot, MAX_CONNECTIONS_PER_SESSION};
pub use dial::{EgressDialer, NoProxy, UpstreamProxy};
pub use guard::{AddressGuard, Forbidden};
pub use host::Host;
pub use policy::{Pattern, Policy};

/// The port the guest-side relay listens on (`127.0.0.1:3128`), the usual
/// proxy port and the one the official stack uses.
pub use guest_agent::proto::GUEST_PROXY_PORT;
use vmm::sync::MutexExt;

/// Deadline for a client to finish its request head (HTTP) or its whole
/// handshake (SOCKS5) — slow-loris protection.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest HTTP request head we buffer (hyper's minimum is 8 KiB); real
/// proxy requests are well under 4 KiB.
pub const MAX_REQUEST_HEAD_BYTES: usize = 16 * 1024;

/// Refusal log lines allowed per [`LOG_WINDOW`]; the rest are counted and
/// reported in the next window's first line.
pub const LOG_BURST: u32 = 20;

/// The refusal log's window.
pub const LOG_WINDOW: Duration = Duration::from_secs(10);

/// Pause after a failed `accept` (e.g. out of file descriptors) before
/// trying again, so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Buffer per direction of a relayed connection. tokio's default (8 KiB)
/// costs a syscall pair per 8 KiB and held bulk transfers to about a fifth
/// of a direct loopback copy; 256 KiB per direction brings the relay close
/// to the kernel's own socket buffer sizes.
pub const RELAY_BUFFER_BYTES: usize = 256 * 1024;

/// SOCKS4's version byte: recognised only to be refused quietly.
const SOCKS4_VERSION: u8 = 0x04;

/// Everything that can go wrong in the egress proxy.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("not a valid destination host: {0:?}")]
    BadHost(String),
    #[error("not a valid host:port (a port is required; IPv6 needs brackets; no user@): {0:?}")]
    BadAuthority(String),
    #[error("allowedDomains entry can never match (use name, *.domain.tld, IP, [IPv6], optional :port): {0:?}")]
    BadPattern(String),
    #[error("{host}:{port} is not in the session's allowedDomains")]
    NotAllowed { host: String, port: u16 },
    #[error("{host} is an API host: it is reached on port 443 only, through the credential guard (asked for port {port})")]
    ApiHostPort { host: String, port: u16 },
    #[error("this tunnel's TLS names the API host {sni}: the API hosts are reached by name only")]
    ApiHostSni { sni: String },
    #[error("{host} is refused: {addr} is a {}", why.as_str())]
    Forbidden {
        host: String,
        addr: IpAddr,
        why: Forbidden,
    },
    #[error("cannot resolve {host}: {source}")]
    Resolve {
        host: String,
        source: std::io::Error,
    },
    #[error("{host} has no addresses")]
    NoAddresses { host: String },
    #[error("cannot connect to {host}:{port}: {source}")]
    Connect {
        host: String,
        port: u16,
        source: std::io::Error,
    },
    #[error("{host}:{port} did not answer in time")]
    Timeout { host: String, port: u16 },
    #[error("session {session} already has {cap} connections open")]
    AtCapacity { session: String, cap: usize },
    #[error("upstream proxy: {0}")]
    Upstream(String),
    #[error("client did not finish its proxy handshake in time")]
    HandshakeTimeout,
    #[error("HTTP: {0}")]
    Http(String),
    #[error("OS random source failed: {0}")]
    Random(String),
    #[error(
        "a credential from the client is empty, too long, or has characters a header cannot carry"
    )]
    BadCredential,
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl EgressError {
    /// Whether this is a policy refusal (as opposed to a network failure).
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            EgressError::NotAllowed { .. }
                | EgressError::ApiHostPort { .. }
                | EgressError::ApiHostSni { .. }
                | EgressError::Forbidden { .. }
                | EgressError::BadHost(_)
                | EgressError::AtCapacity { .. }
        )
    }
}

/// Tunables; [`Default`] is production.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// See [`MAX_CONNECTIONS_PER_SESSION`].
    pub max_connections_per_session: usize,
    /// See [`HANDSHAKE_TIMEOUT`].
    pub handshake_timeout: Duration,
    /// The API hosts whose tunnels are intercepted to swap placeholders
    /// for real credentials ([`intercept`]); empty: none is.
    pub api_hosts: Vec<String>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            max_connections_per_session: MAX_CONNECTIONS_PER_SESSION,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            api_hosts: intercept::DEFAULT_API_HOSTS.map(String::from).to_vec(),
        }
    }
}

/// Rate limiter for refusal log lines.
struct RefusalLog {
    window_start: Instant,
    lines: u32,
    suppressed: u64,
}

/// State shared by all connections of one proxy.
pub(crate) struct Shared {
    pub(crate) registry: CredentialRegistry,
    dialer: EgressDialer,
    pub(crate) config: ProxyConfig,
    log: Mutex<RefusalLog>,
    /// The API hosts' interception, when there are API hosts.
    interceptor: Option<Arc<intercept::Interceptor>>,
}

impl Shared {
    /// Logs one refusal (session, host, port, reason), rate-limited.
    pub(crate) fn log_refusal(&self, session: Option<&str>, host: &str, port: u16, reason: &str) {
        let mut log = self.log.locked();
        if log.window_start.elapsed() >= LOG_WINDOW {
            log.window_start = Instant::now();
            log.lines = 0;
        }
        if log.lines >= LOG_BURST {
            log.suppressed += 1;
            return;
        }
        log.lines += 1;
        let suppressed = std::mem::take(&mut log.suppressed);
        drop(log);
        tracing::warn!(
            session = session.unwrap_or("-"),
            host,
            port,
            reason,
            suppressed_before = suppressed,
            "egress refused"
        );
    }

    /// Takes a slot of the grant's session and dials under its policy.
    pub(crate) async fn open(
        &self,
        grant: &Grant,
        host: &Host,
        port: u16,
    ) -> Result<(TcpStream, Slot), EgressError> {
        let refuse = |e: EgressError| {
            self.log_refusal(
                Some(&grant.session),
                &host.to_string(),
                port,
                &e.to_string(),
            );
            Err(e)
        };
        if let Some(i) = &self.interceptor {
            if i.is_api_host(host) && port != intercept::rules::HTTPS_PORT {
                return refuse(EgressError::ApiHostPort {
                    host: host.to_string(),
                    port,
                });
            }
        }
        let cap = self.config.max_connections_per_session;
        let Some(slot) = grant.acquire_slot(cap) else {
            return refuse(EgressError::AtCapacity {
                session: grant.session.clone(),
                cap,
            });
        };
        match self.dialer.connect(host, port, &grant.policy).await {
            Ok(s) => {
                tracing::debug!(session = %grant.session, %host, port, "egress opened");
                Ok((s, slot))
            }
            Err(e) => {
                if e.is_refusal() {
                    self.log_refusal(
                        Some(&grant.session),
                        &host.to_string(),
                        port,
                        &e.to_string(),
                    );
                } else {
                    tracing::debug!(session = %grant.session, %host, port, error = %e, "egress dial failed");
                }
                Err(e)
            }
        }
    }
}

/// The proxy. Cheap to clone; clones share credentials and state.
#[derive(Clone)]
pub struct EgressProxy {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for EgressProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressProxy")
            .field("credentials", &self.shared.registry.len())
            .field("config", &self.shared.config)
            .finish()
    }
}

impl EgressProxy {
    /// A proxy dialing through `dialer` (production: [`EgressDialer::with_upstream`]),
    /// trusting the host's store for the API hosts' upstream.
    pub fn new(dialer: EgressDialer, config: ProxyConfig) -> Self {
        Self::with_upstream_roots(dialer, config, intercept::native_roots())
    }

    /// [`EgressProxy::new`] with the API upstream verified against `roots`.
    pub fn with_upstream_roots(
        dialer: EgressDialer,
        config: ProxyConfig,
        roots: Result<rustls::RootCertStore, String>,
    ) -> Self {
        let interceptor = if config.api_hosts.is_empty() {
            None
        } else {
            match intercept::Interceptor::new(&config.api_hosts, roots) {
                Ok(i) => Some(Arc::new(i)),
                Err(e) => {
                    tracing::error!(error = %e, "cannot set up the API hosts' interception: sessions' API credentials will be refused");
                    None
                }
            }
        };
        EgressProxy {
            shared: Arc::new(Shared {
                registry: CredentialRegistry::new(),
                dialer,
                config,
                log: Mutex::new(RefusalLog {
                    window_start: Instant::now(),
                    lines: 0,
                    suppressed: 0,
                }),
                interceptor,
            }),
        }
    }

    /// The CA certificate (PEM) sessions must trust for the API hosts, when
    /// they are intercepted.
    pub fn ca_pem(&self) -> Option<&str> {
        self.shared.interceptor.as_deref().map(|i| i.ca_pem())
    }

    /// The intercepted API hosts.
    pub fn api_hosts(&self) -> &[String] {
        self.shared
            .interceptor
            .as_deref()
            .map_or(&[], |i| i.hosts())
    }

    /// A proxy with the production guard that dials directly (no upstream
    /// proxy), with the default limits and API hosts: for tests and tools;
    /// the daemon builds its own from its settings.
    pub fn direct() -> Self {
        Self::new(EgressDialer::direct(), ProxyConfig::default())
    }

    /// Issues a credential for one spawn of `session` under `policy`.
    pub fn issue(&self, session: &str, policy: Policy) -> Result<Credential, EgressError> {
        self.shared.registry.issue(session, policy)
    }

    /// [`EgressProxy::issue`] for a spawn whose API credentials are the
    /// placeholders of `secrets`.
    pub fn issue_with_secrets(
        &self,
        session: &str,
        policy: Policy,
        secrets: secrets::SpawnSecrets,
    ) -> Result<Credential, EgressError> {
        self.shared
            .registry
            .issue_with_secrets(session, policy, secrets)
    }

    /// Revokes a spawn's credential (call when its process exits).
    pub fn revoke(&self, cred: &Credential) -> bool {
        self.shared.registry.revoke(cred)
    }

    /// The dialer (for `apiProbeURL` probes through the same path).
    pub fn dialer(&self) -> &EgressDialer {
        &self.shared.dialer
    }

    /// Serves one client stream to its end. Errors are the client's
    /// (malformed handshake, timeout, I/O) and are only worth a debug line.
    pub async fn serve_stream<S>(&self, mut stream: S) -> Result<(), EgressError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let limit = self.shared.config.handshake_timeout;
        let first = match tokio::time::timeout(limit, stream.read_u8()).await {
            Err(_) => return Err(EgressError::HandshakeTimeout),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e.into()),
            Ok(Ok(b)) => b,
        };
        match first {
            socks::SOCKS5_VERSION => socks::serve(self.shared.clone(), stream).await,
            SOCKS4_VERSION => {
                self.shared
                    .log_refusal(None, "-", 0, "SOCKS4 is not supported");
                Ok(())
            }
            _ => http::serve(self.shared.clone(), Rewind::new(first, stream)).await,
        }
    }

    /// Accepts on `listener` forever, serving each connection on its own
    /// task. Returns only if the listener itself fails for good.
    pub async fn serve_unix(&self, listener: UnixListener) -> std::io::Result<()> {
        loop {
            match listener.accept().await {
                Ok((s, _)) => self.spawn_serve(s),
                Err(e) => accept_failed(e).await?,
            }
        }
    }

    /// Like [`EgressProxy::serve_unix`] for TCP (tests, benchmarks, and a
    /// loopback listener if one is ever wanted).
    pub async fn serve_tcp(&self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        loop {
            match listener.accept().await {
                Ok((s, _)) => {
                    let _ = s.set_nodelay(true);
                    self.spawn_serve(s)
                }
                Err(e) => accept_failed(e).await?,
            }
        }
    }

    fn spawn_serve<S>(&self, s: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let me = self.clone();
        tokio::spawn(async move {
            if let Err(e) = me.serve_stream(s).await {
                tracing::debug!(error = %e, "egress client connection ended with an error");
            }
        });
    }
}

/// Carries a tunnel the dialer opened (`upstream`, holding `slot`) for the
/// client stream `client`: intercepted when it goes to an API host
/// ([`intercept`]), else relayed as bytes.
pub(crate) async fn tunnel<C>(
    shared: Arc<Shared>,
    grant: Grant,
    host: Host,
    port: u16,
    mut client: C,
    mut upstream: TcpStream,
    slot: Slot,
) where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let intercepted = shared
        .interceptor
        .clone()
        .and_then(|i| i.covers(&host, port).map(|name| (i, name)));
    match intercepted {
        Some((interceptor, name)) => {
            let session = grant.session.clone();
            if let Err(e) = interceptor
                .serve(shared, grant, name, client, upstream, slot)
                .await
            {
                tracing::debug!(session, %host, port, error = %e, "intercepted connection ended with an error");
            }
        }
        None => {
            let _slot = slot;
            if let Some(interceptor) = &shared.interceptor {
                // A tunnel to an address or another name whose TLS names an
                // API host would carry credentials past the guard.
                match intercept::guard_relayed(interceptor, &mut client, &mut upstream).await {
                    Ok(()) => {}
                    Err(e) => {
                        shared.log_refusal(
                            Some(&grant.session),
                            &host.to_string(),
                            port,
                            &e.to_string(),
                        );
                        return;
                    }
                }
            }
            relay(&mut client, &mut upstream, &grant.session, &host, port).await;
        }
    }
}

/// Copies both ways until both sides are done; a side's EOF is passed on as
/// a write shutdown (half-close), the other direction keeps flowing. Logs
/// one debug line at the end (session, destination, bytes, duration).
pub(crate) async fn relay<A, B>(
    client: &mut A,
    upstream: &mut B,
    session: &str,
    host: &Host,
    port: u16,
) where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let started = Instant::now();
    let result = tokio::io::copy_bidirectional_with_sizes(
        client,
        upstream,
        RELAY_BUFFER_BYTES,
        RELAY_BUFFER_BYTES,
    )
    .await;
    let ms = started.elapsed().as_millis() as u64;
    match result {
        Ok((up, down)) => {
            tracing::debug!(session, %host, port, up, down, ms, "egress closed")
        }
        Err(e) => {
            tracing::debug!(session, %host, port, ms, error = %e, "egress closed with an error")
        }
    }
}

/// Transient accept errors back off; others end the accept loop.
async fn accept_failed(e: std::io::Error) -> std::io::Result<()> {
    use std::io::ErrorKind::*;
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

/// The proxy URL for a spawn: `http://<session>:<credential>@127.0.0.1:<port>`
/// (the session name percent-encoded; the credential is base64url and needs
/// no encoding).
pub fn proxy_url(session: &str, cred: &Credential, port: u16) -> String {
    let mut user = String::with_capacity(session.len());
    for b in session.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            user.push(char::from(b));
        } else {
            user.push_str(&format!("%{b:02X}"));
        }
    }
    format!("http://{user}:{}@127.0.0.1:{port}", cred.expose())
}

/// `NO_PROXY` for session processes: only the guest's own loopback
/// bypasses the proxy (there is nothing else to reach directly).
pub const SESSION_NO_PROXY: &str = "localhost,127.0.0.1,::1";

/// The environment a spawn needs to use the proxy at `url` (from
/// [`proxy_url`]): both spellings of the proxy variables (curl reads only
/// lowercase `http_proxy`), `NO_PROXY`, `NODE_USE_ENV_PROXY=1` (Node's
/// built-in `fetch` ignores the variables otherwise), and git's
/// `http.proxyAuthMethod=basic` through `GIT_CONFIG_*` so git sends the
/// credential without waiting for a 407. The caller merges these over the
/// client's environment; `GIT_CONFIG_COUNT` replaces any the client set.
pub fn proxy_env(url: &str) -> Vec<(&'static str, String)> {
    let mut env: Vec<(&'static str, String)> = [
        "HTTPS_PROXY",
        "https_proxy",
        "HTTP_PROXY",
        "http_proxy",
        "ALL_PROXY",
        "all_proxy",
    ]
    .into_iter()
    .map(|k| (k, url.to_owned()))
    .collect();
    env.push(("NO_PROXY", SESSION_NO_PROXY.to_owned()));
    env.push(("no_proxy", SESSION_NO_PROXY.to_owned()));
    env.push(("NODE_USE_ENV_PROXY", "1".to_owned()));
    env.push(("GIT_CONFIG_COUNT", "1".to_owned()));
    env.push(("GIT_CONFIG_KEY_0", "http.proxyAuthMethod".to_owned()));
    env.push(("GIT_CONFIG_VALUE_0", "basic".to_owned()));
    env
}

/// A stream with one byte pushed back in front (the mux's peek).
struct Rewind<S> {
    first: Option<u8>,
    inner: S,
}

impl<S> Rewind<S> {
    fn new(first: u8, inner: S) -> Self {
        Rewind {
            first: Some(first),
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if buf.remaining() > 0 {
            if let Some(b) = self.first.take() {
                buf.put_slice(&[b]);
                return Poll::Ready(Ok(()));
            }
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests;
