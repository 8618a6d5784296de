//! TLS interception of the API hosts: how a session's placeholder becomes
//! the real credential without the real one ever entering the guest.
//!
//! A tunnel (HTTP CONNECT or SOCKS5) to one of the API hosts on port 443
//! (default [`DEFAULT_API_HOSTS`]; `--api-host` adds gateways) is not
//! relayed as bytes. Instead:
//!
//! 1. The guest's TLS ClientHello is read first; its SNI must be the
//!    CONNECT target, or the tunnel is closed (and logged).
//! 2. The helper answers the handshake with a leaf for that host from its
//!    in-memory CA ([`ca`]), which the guest trusts (the agent installs the
//!    CA certificate; spawns get `NODE_EXTRA_CA_CERTS`). Only `http/1.1` is
//!    offered to the guest.
//! 3. Each request is parsed by hyper and checked ([`rules`]): right host,
//!    unambiguous framing, no key minting, and either no credential or
//!    exactly this spawn's placeholder, which is replaced by the real
//!    value in that one header (marked sensitive). Nothing else is
//!    touched: not bodies, query strings or other headers.
//! 4. The request is re-serialised to the upstream, dialled by name on the
//!    host through the same dialer as every tunnel (policy, address guard,
//!    the helper's own `HTTPS_PROXY`), over TLS verified against the host's
//!    trust store (`SSL_CERT_FILE`/`SSL_CERT_DIR` honoured), HTTP/2 where the
//!    upstream offers it. The answer streams back unbuffered (SSE).
//!
//! Every other host stays end-to-end TLS: those tunnels are relayed as
//! bytes, and a placeholder sent there stays a placeholder.
//!
//! Tests: `tests/egress_intercept.rs` (through the proxy's real faces to a
//! loopback TLS upstream) and `tests/credentials_e2e.rs` (the real CLI).
//!
//! Limits: one upstream connection per intercepted guest connection;
//! WebSocket upgrades to the API hosts are refused; a guest that pins
//! certificates cannot talk to the API hosts through us.

pub mod ca;
pub mod rules;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, HOST};
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::creds::{Grant, Slot};
use super::host::Host;
use super::Shared;
use ca::InterceptCa;
use rules::HTTPS_PORT;

/// The API hosts intercepted by default.
pub const DEFAULT_API_HOSTS: [&str; 1] = ["api.anthropic.com"];
/// Deadline for the guest's TLS handshake, ClientHello included.
pub const GUEST_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline for the upstream's TLS handshake.
pub const UPSTREAM_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);
/// ALPN offered to the guest.
const GUEST_ALPN: &[u8] = b"http/1.1";
/// ALPN offered to the upstream, preferred first.
const UPSTREAM_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

type Body = BoxBody<Bytes, hyper::Error>;

/// Why interception could not be set up or a connection failed.
#[derive(Debug, thiserror::Error)]
pub enum InterceptError {
    #[error(transparent)]
    Ca(#[from] ca::CaError),
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error("no trusted root certificates for the API upstream (the system store, or SSL_CERT_FILE / SSL_CERT_DIR): {0}")]
    NoRoots(String),
    #[error("the guest's TLS ClientHello names {sni:?}, not the CONNECT target {host}")]
    SniMismatch { sni: Option<String>, host: String },
    #[error("the guest's TLS handshake: {0}")]
    GuestHandshake(std::io::Error),
    #[error("the upstream's TLS handshake with {host}: {source}")]
    UpstreamHandshake {
        host: String,
        source: std::io::Error,
    },
    #[error("timed out: {0}")]
    Timeout(&'static str),
    #[error("HTTP with {host}: {source}")]
    Http { host: String, source: hyper::Error },
}

/// Answers guest certificates for the one host of a connection.
#[derive(Debug)]
struct OneLeaf(Arc<rustls::sign::CertifiedKey>);

impl rustls::server::ResolvesServerCert for OneLeaf {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// The interception state of one proxy.
pub struct Interceptor {
    ca: InterceptCa,
    upstream: Result<Arc<rustls::ClientConfig>, String>,
}

impl std::fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interceptor")
            .field("hosts", &self.ca.hosts())
            .field("upstream_roots", &self.upstream.is_ok())
            .finish()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Interceptor {
    /// Interception of `hosts`, trusting `roots` upstream.
    pub fn new(
        hosts: &[String],
        roots: Result<rustls::RootCertStore, String>,
    ) -> Result<Interceptor, InterceptError> {
        let hosts: Vec<String> = hosts.iter().map(|h| h.to_ascii_lowercase()).collect();
        let ca = InterceptCa::generate(&hosts)?;
        let upstream = match roots {
            Ok(roots) => {
                let mut config = rustls::ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()?
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                config.alpn_protocols = UPSTREAM_ALPN.iter().map(|p| p.to_vec()).collect();
                Ok(Arc::new(config))
            }
            Err(why) => Err(why),
        };
        Ok(Interceptor { ca, upstream })
    }

    /// The CA certificate the guest must trust, PEM.
    pub fn ca_pem(&self) -> &str {
        self.ca.pem()
    }

    /// The intercepted hosts.
    pub fn hosts(&self) -> &[String] {
        self.ca.hosts()
    }

    /// Whether `host` is one of the API hosts (any port).
    pub fn is_api_host(&self, host: &Host) -> bool {
        host.name()
            .is_some_and(|n| self.ca.hosts().iter().any(|h| h.eq_ignore_ascii_case(n)))
    }

    /// The intercepted host a tunnel to `host:port` is for, if any.
    pub fn covers(&self, host: &Host, port: u16) -> Option<String> {
        let name = host.name()?.to_ascii_lowercase();
        (port == HTTPS_PORT && self.ca.hosts().contains(&name)).then_some(name)
    }

    /// Serves an intercepted tunnel to `host`: the guest's side is
    /// `client`, `upstream` the connection the dialer opened for it (and
    /// `slot` its connection slot).
    pub(crate) async fn serve<C>(
        self: Arc<Self>,
        shared: Arc<Shared>,
        grant: Grant,
        host: String,
        client: C,
        upstream: TcpStream,
        slot: Slot,
    ) -> Result<(), InterceptError>
    where
        C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let start = tokio::time::timeout(
            GUEST_HANDSHAKE_TIMEOUT,
            tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), client),
        )
        .await
        .map_err(|_| InterceptError::Timeout("the guest's ClientHello"))?
        .map_err(InterceptError::GuestHandshake)?;
        let sni = start
            .client_hello()
            .server_name()
            .map(str::to_ascii_lowercase);
        if sni.as_deref() != Some(host.as_str()) {
            let e = InterceptError::SniMismatch {
                sni,
                host: host.clone(),
            };
            shared.log_refusal(Some(&grant.session), &host, HTTPS_PORT, &e.to_string());
            return Err(e);
        }
        let leaf = self.ca.leaf(&host)?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(OneLeaf(leaf)));
        config.alpn_protocols = vec![GUEST_ALPN.to_vec()];
        let tls =
            tokio::time::timeout(GUEST_HANDSHAKE_TIMEOUT, start.into_stream(Arc::new(config)))
                .await
                .map_err(|_| InterceptError::Timeout("the guest's TLS handshake"))?
                .map_err(InterceptError::GuestHandshake)?;
        let conn = Arc::new(Connection {
            interceptor: self.clone(),
            shared,
            grant,
            host: host.clone(),
            upstream: tokio::sync::Mutex::new(Upstream::Dialled(upstream, slot)),
        });
        let service = hyper::service::service_fn(move |req| {
            let conn = conn.clone();
            async move { Ok::<_, std::convert::Infallible>(conn.handle(req).await) }
        });
        hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(super::HANDSHAKE_TIMEOUT)
            .max_buf_size(super::MAX_REQUEST_HEAD_BYTES.max(64 * 1024))
            .serve_connection(TokioIo::new(tls), service)
            .await
            .map_err(|source| InterceptError::Http { host, source })
    }
}

/// Most bytes read looking for a TLS ClientHello in a relayed tunnel.
const MAX_SNIFF: usize = 64 * 1024;
/// A TLS handshake record's first byte.
const TLS_HANDSHAKE: u8 = 0x16;

/// Before a tunnel is relayed as bytes: when the client speaks first and
/// its first bytes are a TLS ClientHello naming an API host, refuse (the
/// API hosts are reached by name, through the guard); else pass what was
/// read on to `upstream`. A server that speaks first skips the check.
pub(crate) async fn guard_relayed<C>(
    interceptor: &Interceptor,
    client: &mut C,
    upstream: &mut TcpStream,
) -> Result<(), super::EgressError>
where
    C: AsyncRead + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::with_capacity(4096);
    let mut acceptor = rustls::server::Acceptor::default();
    let mut probe = [0u8; 1];
    loop {
        let mut chunk = [0u8; 4096];
        let n = tokio::select! {
            n = client.read(&mut chunk) => n?,
            // The server speaks first (SSH, SMTP...): nothing to look at.
            // (A peek, not `readable()`: readiness left over from the
            // dialer's own reads would end the wait at once.)
            r = upstream.peek(&mut probe), if buf.is_empty() => { r?; break; }
        };
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf[0] != TLS_HANDSHAKE || buf.len() > MAX_SNIFF {
            break;
        }
        let mut rd: &[u8] = &chunk[..n];
        if acceptor.read_tls(&mut rd).is_err() {
            break;
        }
        match acceptor.accept() {
            Ok(Some(accepted)) => {
                let sni = accepted
                    .client_hello()
                    .server_name()
                    .map(str::to_ascii_lowercase);
                if let Some(sni) = sni.filter(|s| interceptor.is_api_host(&Host::Name(s.clone()))) {
                    return Err(super::EgressError::ApiHostSni { sni });
                }
                break;
            }
            Ok(None) => continue,
            Err(_) => break,
        }
    }
    if !buf.is_empty() {
        upstream.write_all(&buf).await?;
    }
    Ok(())
}

/// The host's trust store for the upstream side.
pub fn native_roots() -> Result<rustls::RootCertStore, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let errors: Vec<String> = found.errors.iter().map(|e| e.to_string()).collect();
        return Err(if errors.is_empty() {
            "the store is empty".into()
        } else {
            errors.join("; ")
        });
    }
    Ok(roots)
}

/// The upstream side of an intercepted connection.
enum Upstream {
    /// The TCP connection the CONNECT opened, not yet used.
    Dialled(TcpStream, Slot),
    /// A live HTTP connection.
    H1(hyper::client::conn::http1::SendRequest<Body>),
    H2(hyper::client::conn::http2::SendRequest<Body>),
    /// Closed; the next request dials again.
    Closed,
}

/// One intercepted guest connection.
struct Connection {
    interceptor: Arc<Interceptor>,
    shared: Arc<Shared>,
    grant: Grant,
    host: String,
    upstream: tokio::sync::Mutex<Upstream>,
}

/// A local answer in the API's error shape, so the CLI shows the reason.
fn local_answer(status: StatusCode, kind: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({
        "type": "error",
        "error": {"type": kind, "message": format!("cowork-helper egress: {message}")},
    })
    .to_string();
    let mut resp = Response::new(Full::new(Bytes::from(body)).map_err(|n| match n {}).boxed());
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut().insert(
        super::http::PROXY_ERROR_HEADER,
        HeaderValue::from_static("refused-by-credential-guard"),
    );
    resp
}

impl Connection {
    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let swap = match rules::check(
            req.method(),
            req.uri(),
            req.headers(),
            &self.host,
            &self.grant.secrets,
        ) {
            Ok(swap) => swap,
            Err(refusal) => {
                self.shared.log_refusal(
                    Some(&self.grant.session),
                    &self.host,
                    HTTPS_PORT,
                    refusal.reason(),
                );
                let kind = match refusal {
                    rules::Refusal::Credential(_) => "authentication_error",
                    rules::Refusal::Forbidden(_) => "permission_error",
                    _ => "invalid_request_error",
                };
                return local_answer(refusal.status(), kind, refusal.reason());
            }
        };
        let (mut parts, body) = req.into_parts();
        super::http::strip_hop_by_hop(&mut parts.headers);
        if let Some(swap) = swap {
            let value = swap.real.with(|real| match swap.carrier {
                crate::egress::secrets::Carrier::Bearer => {
                    HeaderValue::from_str(&format!("Bearer {real}"))
                }
                crate::egress::secrets::Carrier::ApiKey => HeaderValue::from_str(real),
            });
            match value {
                Ok(mut v) => {
                    v.set_sensitive(true);
                    parts.headers.insert(swap.header, v);
                }
                Err(_) => {
                    return local_answer(
                        StatusCode::UNAUTHORIZED,
                        "authentication_error",
                        "the client's credential cannot be sent in a header",
                    )
                }
            }
        }
        let path = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .unwrap_or_else(|| "/".into());
        let req = Request::from_parts(parts, body.boxed());
        match self.send(req, &path).await {
            Ok(resp) => {
                let (mut parts, body) = resp.into_parts();
                super::http::strip_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, body.boxed())
            }
            Err(e) => {
                tracing::debug!(session = %self.grant.session, host = %self.host, error = %e, "intercepted request failed");
                local_answer(StatusCode::BAD_GATEWAY, "api_error", &e.to_string())
            }
        }
    }

    /// Sends `req` (target `path`) on the upstream connection, opening
    /// one when there is none.
    async fn send(
        &self,
        mut req: Request<Body>,
        path: &str,
    ) -> Result<Response<Incoming>, InterceptError> {
        let mut upstream = self.upstream.lock().await;
        let live = match &*upstream {
            Upstream::H1(s) => !s.is_closed(),
            Upstream::H2(s) => !s.is_closed(),
            _ => false,
        };
        if !live {
            let previous = std::mem::replace(&mut *upstream, Upstream::Closed);
            let (tcp, slot) = match previous {
                Upstream::Dialled(tcp, slot) => (tcp, slot),
                _ => {
                    let host = Host::Name(self.host.clone());
                    self.shared
                        .open(&self.grant, &host, HTTPS_PORT)
                        .await
                        .map_err(|e| InterceptError::UpstreamHandshake {
                            host: self.host.clone(),
                            source: std::io::Error::other(e.to_string()),
                        })?
                }
            };
            *upstream = self.connect(tcp, slot).await?;
        }
        // HTTP/1.1 takes an origin-form target and Host; HTTP/2 an absolute
        // URI (its :authority) and no Host.
        let h2 = matches!(*upstream, Upstream::H2(_));
        let target = if h2 {
            format!("https://{}{path}", self.host)
        } else {
            path.to_string()
        };
        *req.uri_mut() = target.parse().unwrap_or_else(|_| Uri::from_static("/"));
        if h2 {
            *req.version_mut() = hyper::Version::HTTP_2;
            req.headers_mut().remove(HOST);
        } else if !req.headers().contains_key(HOST) {
            if let Ok(v) = HeaderValue::from_str(&self.host) {
                req.headers_mut().insert(HOST, v);
            }
        }
        let sent = match &mut *upstream {
            Upstream::H1(sender) => match sender.ready().await {
                Ok(()) => sender.send_request(req).await,
                Err(e) => Err(e),
            },
            Upstream::H2(sender) => match sender.ready().await {
                Ok(()) => sender.send_request(req).await,
                Err(e) => Err(e),
            },
            _ => return Err(InterceptError::Timeout("no upstream connection")),
        };
        sent.map_err(|source| self.http_err(source))
    }

    fn http_err(&self, source: hyper::Error) -> InterceptError {
        InterceptError::Http {
            host: self.host.clone(),
            source,
        }
    }

    /// TLS (verified) and HTTP over `tcp`.
    async fn connect(&self, tcp: TcpStream, slot: Slot) -> Result<Upstream, InterceptError> {
        let config = self
            .interceptor
            .upstream
            .clone()
            .map_err(InterceptError::NoRoots)?;
        let name = ServerName::try_from(self.host.clone()).map_err(|e| {
            InterceptError::UpstreamHandshake {
                host: self.host.clone(),
                source: std::io::Error::other(e.to_string()),
            }
        })?;
        let tls = tokio::time::timeout(
            UPSTREAM_HANDSHAKE_TIMEOUT,
            tokio_rustls::TlsConnector::from(config).connect(name, tcp),
        )
        .await
        .map_err(|_| InterceptError::Timeout("the upstream's TLS handshake"))?
        .map_err(|source| {
            let e = InterceptError::UpstreamHandshake {
                host: self.host.clone(),
                source,
            };
            tracing::warn!(session = %self.grant.session, host = %self.host, error = %e, "API upstream refused: its certificate is not trusted here, or TLS failed");
            e
        })?;
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        let io = TokioIo::new(tls);
        // The connection task holds the tunnel's slot for as long as it runs.
        let drive = |conn: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>| {
            tokio::spawn(async move {
                let _slot = slot;
                conn.await;
            })
        };
        if h2 {
            let (sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .map_err(|source| self.http_err(source))?;
            drive(Box::pin(async move { drop(conn.await) }));
            Ok(Upstream::H2(sender))
        } else {
            let (sender, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|source| self.http_err(source))?;
            drive(Box::pin(async move { drop(conn.await) }));
            Ok(Upstream::H1(sender))
        }
    }
}
