//! A loopback stand-in for the API behind the egress proxy's interception:
//! a TLS upstream (a test CA's certificate for [`API`] and [`OTHER`]) that
//! records what arrives, reached through a CONNECT forwarder standing in
//! for the helper's own `HTTPS_PROXY` (so no name is ever resolved), and
//! the helper's real proxy dialling through it. Used by
//! `tests/egress_intercept.rs` and `benches/api_intercept.rs`; the tests
//! with the real CLI use [`super::mock_api`] in network namespaces instead.
//!
//! Paths of the upstream: `/stream` sends one event, then the rest when
//! the test releases it; `/hold` sends one event and holds the stream until
//! the client goes; anything else answers two events at once. Everything
//! is an event stream (`text/event-stream`), HTTP/1.1 or HTTP/2 (ALPN).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use cowork_helper::egress::{
    AddressGuard, EgressDialer, EgressProxy, NoProxy, ProxyConfig, UpstreamProxy,
};
use http_body_util::BodyExt;
use hyper::body::Frame;
use hyper::Request;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The intercepted API host.
pub const API: &str = "api.anthropic.com";
/// Another host, relayed end to end.
pub const OTHER: &str = "other.example";

/// What the upstream saw of one request.
#[derive(Clone, Debug)]
pub struct Seen {
    pub version: hyper::Version,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Seen {
    /// Every value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// The running upstream.
pub struct Upstream {
    pub addr: SocketAddr,
    /// Its CA (DER and PEM).
    pub ca: CertificateDer<'static>,
    pub ca_pem: String,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// Lets a `/stream` answer finish.
    pub release: Arc<tokio::sync::Notify>,
}

/// A response body fed through a channel, frame by frame as sent.
pub struct ChannelBody(pub tokio::sync::mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// The ring crypto provider.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A test CA: its issuer and certificate.
pub fn test_ca() -> (Issuer<'static, KeyPair>, rcgen::Certificate) {
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let key = KeyPair::generate().expect("CA key");
    let cert = params.self_signed(&key).expect("CA certificate");
    (Issuer::new(params, key), cert)
}

/// A root store of one certificate.
pub fn roots_of(ca: &CertificateDer<'static>) -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).expect("root");
    roots
}

/// Starts the upstream, offering HTTP/2 when `h2` (else HTTP/1.1 only).
pub async fn upstream(h2: bool) -> Upstream {
    let (issuer, ca) = test_ca();
    let leaf_key = KeyPair::generate().expect("leaf key");
    let leaf = CertificateParams::new(vec![API.to_string(), OTHER.to_string()])
        .expect("leaf params")
        .signed_by(&leaf_key, &issuer)
        .expect("leaf");
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone(), ca.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
        )
        .expect("server config");
    config.alpn_protocols = if h2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let release = Arc::new(tokio::sync::Notify::new());
    let (s, r) = (seen.clone(), release.clone());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            // As a real server does: no Nagle delay between a head and its body.
            let _ = tcp.set_nodelay(true);
            let (acceptor, seen, release) = (acceptor.clone(), s.clone(), r.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let negotiated_h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                let service =
                    hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let (seen, release) = (seen.clone(), release.clone());
                        async move {
                            Ok::<_, std::convert::Infallible>(answer(req, &seen, release).await)
                        }
                    });
                let io = TokioIo::new(tls);
                if negotiated_h2 {
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(io, service)
                    .await;
                } else {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                }
            });
        }
    });
    Upstream {
        addr,
        ca: ca.der().clone(),
        ca_pem: ca.pem(),
        seen,
        release,
    }
}

/// Records `req` and answers it (see the module doc).
async fn answer(
    req: Request<hyper::body::Incoming>,
    seen: &Mutex<Vec<Seen>>,
    release: Arc<tokio::sync::Notify>,
) -> hyper::Response<ChannelBody> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_default();
    seen.lock().expect("seen").push(Seen {
        version: parts.version,
        path: path.clone(),
        headers: parts
            .headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("?").to_string()))
            .collect(),
        body,
    });
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    tokio::spawn(async move {
        let _ = tx.send(Bytes::from_static(b"event: first\n\n")).await;
        match path.as_str() {
            "/stream" => release.notified().await,
            "/hold" => {
                tx.closed().await;
                return;
            }
            _ => {}
        }
        let _ = tx.send(Bytes::from_static(b"event: last\n\n")).await;
    });
    hyper::Response::builder()
        .header("content-type", "text/event-stream")
        .body(ChannelBody(rx))
        .expect("response")
}

/// A CONNECT forwarder standing in for the user's `HTTPS_PROXY`: every
/// tunnel goes to `to`; returns its address and the targets asked for.
pub async fn forwarder(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let targets = Arc::new(Mutex::new(Vec::new()));
    let t = targets.clone();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = listener.accept().await {
            let t = t.clone();
            tokio::spawn(async move {
                let head = read_head(&mut c).await;
                let target = head.split_whitespace().nth(1).unwrap_or("").to_string();
                t.lock().expect("targets").push(target);
                let Ok(mut up) = TcpStream::connect(to).await else {
                    return;
                };
                let _ = (up.set_nodelay(true), c.set_nodelay(true));
                if c.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.is_ok() {
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut up).await;
                }
            });
        }
    });
    (addr, targets)
}

/// Reads through the blank line ending a head ("" at end of stream).
pub async fn read_head(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut b = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match s.read(&mut b).await {
            Ok(1) => buf.push(b[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// The helper's proxy (the API upstream trusted through `roots`), dialling
/// everything through `forwarder`.
pub fn helper_proxy(forwarder: SocketAddr, roots: rustls::RootCertStore) -> EgressProxy {
    let upstream = UpstreamProxy::parse(&format!("http://{forwarder}")).expect("forwarder URL");
    EgressProxy::with_upstream_roots(
        EgressDialer::new(AddressGuard::new(), Some(upstream), NoProxy::default()),
        ProxyConfig::default(),
        Ok(roots),
    )
}

/// The certificates of a PEM text.
pub fn pem_certs(pem: &str) -> Vec<CertificateDer<'static>> {
    use base64::Engine as _;
    pem.split("-----BEGIN CERTIFICATE-----")
        .skip(1)
        .filter_map(|b| b.split("-----END CERTIFICATE-----").next())
        .map(|b| {
            let b64: String = b.split_whitespace().collect();
            CertificateDer::from(
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .expect("base64"),
            )
        })
        .collect()
}

/// A guest-side HTTP/1.1 connection through the proxy at `proxy`: CONNECT
/// `target` with Basic `auth` (base64 of `user:credential`), then TLS with
/// SNI `sni` trusting only `ca`. `Err` carries the proxy's answer or the
/// TLS failure.
pub async fn guest<B>(
    proxy: SocketAddr,
    auth: &str,
    target: &str,
    sni: &str,
    ca: &CertificateDer<'static>,
) -> Result<hyper::client::conn::http1::SendRequest<B>, String>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut tcp = TcpStream::connect(proxy).await.expect("proxy");
    tcp.set_nodelay(true).expect("nodelay");
    tcp.write_all(
        format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}\r\n\r\n")
            .as_bytes(),
    )
    .await
    .expect("CONNECT");
    let head = read_head(&mut tcp).await;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head);
    }
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots_of(ca))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name = rustls::pki_types::ServerName::try_from(sni.to_string()).expect("server name");
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    Ok(sender)
}
