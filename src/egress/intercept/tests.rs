//! Placeholder in, real credential out: a guest-side client (rustls,
//! trusting only the helper's CA) talks through the real proxy to an
//! upstream TLS server of the test, reached through the proxy's own
//! upstream HTTP proxy (so no name is resolved and nothing but loopback is
//! used); the upstream records what arrives.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Frame;
use hyper::Request;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::egress::secrets::{Carrier, RealSecret, SecretCell, Substituter};
use crate::egress::{
    AddressGuard, Credential, EgressDialer, EgressProxy, NoProxy, Policy, ProxyConfig,
    UpstreamProxy,
};

/// Bound for anything that should take milliseconds.
const T: Duration = Duration::from_secs(10);
const API: &str = "api.anthropic.com";
const REAL: &str = "sk-ant-oat01-THE-REAL-TOKEN-0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz0123";

/// What the test upstream saw of one request.
#[derive(Clone, Debug)]
struct Seen {
    version: hyper::Version,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// The test's "real" API: a TLS server with a certificate for every name
/// of `names` from the test CA, speaking HTTP/1.1 or HTTP/2.
struct Upstream {
    addr: SocketAddr,
    ca: CertificateDer<'static>,
    seen: Arc<Mutex<Vec<Seen>>>,
    /// Released by the test to let a streamed answer finish.
    release: Arc<tokio::sync::Notify>,
}

fn test_ca() -> (Issuer<'static, KeyPair>, CertificateDer<'static>) {
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (Issuer::new(params, key), cert.der().clone())
}

async fn upstream(h2: bool) -> Upstream {
    let (issuer, ca) = test_ca();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec![API.to_string(), "other.example".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![leaf.der().clone(), ca.clone()],
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
    )
    .unwrap();
    config.alpn_protocols = if h2 {
        vec![b"h2".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let release = Arc::new(tokio::sync::Notify::new());
    let (s, r) = (seen.clone(), release.clone());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, seen, release) = (acceptor.clone(), s.clone(), r.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service =
                    hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let (seen, release) = (seen.clone(), release.clone());
                        async move {
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
                            seen.lock().unwrap().push(Seen {
                                version: parts.version,
                                path: path.clone(),
                                headers: parts
                                    .headers
                                    .iter()
                                    .map(|(k, v)| {
                                        (k.to_string(), v.to_str().unwrap_or("?").to_string())
                                    })
                                    .collect(),
                                body,
                            });
                            // /stream: one event now, the rest when released.
                            let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
                            tokio::spawn(async move {
                                let _ = tx.send(Bytes::from_static(b"event: first\n\n")).await;
                                if path == "/stream" {
                                    release.notified().await;
                                }
                                let _ = tx.send(Bytes::from_static(b"event: last\n\n")).await;
                            });
                            let body = ChannelBody(rx);
                            Ok::<_, std::convert::Infallible>(
                                hyper::Response::builder()
                                    .header("content-type", "text/event-stream")
                                    .body(body)
                                    .unwrap(),
                            )
                        }
                    });
                let io = TokioIo::new(tls);
                if h2 {
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
        ca,
        seen,
        release,
    }
}

/// A response body fed through a channel, frame by frame as sent.
struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

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

/// A CONNECT proxy standing in for the user's `HTTPS_PROXY`: every tunnel
/// goes to `to`; records the targets asked for.
async fn corporate_proxy(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let targets = Arc::new(Mutex::new(Vec::new()));
    let t = targets.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = listener.accept().await else {
                return;
            };
            let t = t.clone();
            tokio::spawn(async move {
                let head = read_head(&mut c).await;
                let target = head.split_whitespace().nth(1).unwrap_or("").to_string();
                t.lock().unwrap().push(target);
                let Ok(mut up) = TcpStream::connect(to).await else {
                    return;
                };
                c.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut c, &mut up).await;
            });
        }
    });
    (addr, targets)
}

/// Reads through the blank line ending a head.
async fn read_head(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut b = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).await.unwrap() == 0 {
            break;
        }
        buf.push(b[0]);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// The helper's proxy (API upstream trusted through `roots`), serving on a
/// loopback port, dialling everything through `corporate`.
async fn helper_proxy(
    corporate: SocketAddr,
    roots: rustls::RootCertStore,
) -> (EgressProxy, SocketAddr) {
    let upstream = UpstreamProxy::parse(&format!("http://{corporate}")).unwrap();
    let proxy = EgressProxy::with_upstream_roots(
        EgressDialer::new(AddressGuard::new(), Some(upstream), NoProxy::default()),
        ProxyConfig::default(),
        Ok(roots),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let p = proxy.clone();
    tokio::spawn(async move { p.serve_tcp(listener).await });
    (proxy, addr)
}

fn roots_of(ca: &CertificateDer<'static>) -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    roots
}

/// A spawn of session `s` holding the placeholder of `cell`'s token.
fn spawn_credential(proxy: &EgressProxy, cell: &SecretCell) -> (Credential, String) {
    let mut subs = Substituter::default();
    let placeholder = subs
        .substitute(Carrier::Bearer, REAL, cell.clone())
        .unwrap();
    let cred = proxy
        .issue_with_secrets("s", Policy::Unrestricted, subs.finish())
        .unwrap();
    (cred, placeholder)
}

/// A guest-side HTTP/1.1 connection to `target` through the proxy at
/// `proxy_addr`: CONNECT, then TLS with SNI `sni` trusting only `ca`.
async fn guest(
    proxy_addr: SocketAddr,
    cred: &Credential,
    target: &str,
    sni: &str,
    ca: &CertificateDer<'static>,
) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, String> {
    let mut tcp = TcpStream::connect(proxy_addr).await.unwrap();
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("s:{}", cred.expose()));
    tcp.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut tcp).await;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head);
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots_of(ca))
    .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(sni.to_string()).unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    Ok(sender)
}

fn request(path: &str, headers: &[(&str, &str)], body: &str) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method("POST")
        .uri(path)
        .header("host", API);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::from(body.to_string()))).unwrap()
}

/// The CA the guest is told to trust.
fn helper_ca(proxy: &EgressProxy) -> CertificateDer<'static> {
    let pem = proxy.ca_pem().expect("interception is on by default");
    let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    CertificateDer::from(
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap(),
    )
}

struct Rig {
    up: Upstream,
    proxy: EgressProxy,
    addr: SocketAddr,
    corporate_targets: Arc<Mutex<Vec<String>>>,
    cell: SecretCell,
}

async fn rig(h2: bool) -> Rig {
    let up = upstream(h2).await;
    let (corporate, corporate_targets) = corporate_proxy(up.addr).await;
    let (proxy, addr) = helper_proxy(corporate, roots_of(&up.ca)).await;
    let cell = SecretCell::new(RealSecret::new(REAL.to_string()).unwrap());
    Rig {
        up,
        proxy,
        addr,
        corporate_targets,
        cell,
    }
}

async fn body_text(resp: hyper::Response<hyper::body::Incoming>) -> String {
    String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap()
}

#[tokio::test]
async fn the_placeholder_becomes_the_real_token_in_authorization_only() {
    for h2 in [false, true] {
        let r = rig(h2).await;
        let (cred, ph) = spawn_credential(&r.proxy, &r.cell);
        let ca = helper_ca(&r.proxy);
        let mut g = guest(r.addr, &cred, "api.anthropic.com:443", API, &ca)
            .await
            .unwrap();
        let bearer = format!("Bearer {ph}");
        let resp = tokio::time::timeout(
            T,
            g.send_request(request(
                &format!("/v1/messages?echo={ph}"),
                &[
                    ("authorization", &bearer),
                    ("x-echo", &ph),
                    ("anthropic-beta", "oauth-2025-04-20"),
                ],
                &format!("{{\"content\":\"{ph}\"}}"),
            )),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(resp.status(), 200, "h2={h2}");
        assert_eq!(body_text(resp).await, "event: first\n\nevent: last\n\n");
        let seen = r.up.seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 1);
        let s = &seen[0];
        assert_eq!(
            s.version,
            if h2 {
                hyper::Version::HTTP_2
            } else {
                hyper::Version::HTTP_11
            }
        );
        assert_eq!(
            s.header("authorization"),
            [format!("Bearer {REAL}").as_str()]
        );
        // Nothing else was touched: query, other headers and body keep the placeholder.
        assert_eq!(s.path, format!("/v1/messages?echo={ph}"));
        assert_eq!(s.header("x-echo"), [ph.as_str()]);
        assert_eq!(s.header("anthropic-beta"), ["oauth-2025-04-20"]);
        assert_eq!(
            String::from_utf8_lossy(&s.body),
            format!("{{\"content\":\"{ph}\"}}")
        );
        assert!(s.header("proxy-authorization").is_empty());
        // Through the user's proxy, dialled by name.
        assert_eq!(
            *r.corporate_targets.lock().unwrap(),
            ["api.anthropic.com:443"]
        );

        // A refreshed token (addApprovedOauthToken) is used from the next request on.
        r.cell
            .set(RealSecret::new("sk-ant-oat01-REFRESHED".into()).unwrap());
        let resp = g
            .send_request(request("/v1/messages", &[("authorization", &bearer)], "{}"))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let _ = body_text(resp).await;
        let seen = r.up.seen.lock().unwrap().clone();
        assert_eq!(
            seen[1].header("authorization"),
            ["Bearer sk-ant-oat01-REFRESHED"]
        );
    }
}

#[tokio::test]
async fn other_credentials_never_leave_and_get_a_local_401() {
    let r = rig(false).await;
    let (cred, _ph) = spawn_credential(&r.proxy, &r.cell);
    // Another spawn's placeholder, and an attacker's own key.
    let (_other_cred, other_ph) = spawn_credential(&r.proxy, &r.cell);
    let ca = helper_ca(&r.proxy);
    let mut g = guest(r.addr, &cred, "api.anthropic.com:443", API, &ca)
        .await
        .unwrap();
    for auth in [
        format!("Bearer {other_ph}"),
        "Bearer sk-ant-api03-attackers-own".to_string(),
    ] {
        let resp = g
            .send_request(request("/v1/files", &[("authorization", &auth)], "x"))
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);
        let text = body_text(resp).await;
        assert!(
            text.contains("authentication_error") && text.contains("placeholder"),
            "{text}"
        );
        assert!(
            !text.contains(REAL) && !text.contains("attackers-own"),
            "{text}"
        );
    }
    let resp = g
        .send_request(request("/api/oauth/claude_cli/create_api_key", &[], ""))
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let _ = body_text(resp).await;
    assert!(
        r.up.seen.lock().unwrap().is_empty(),
        "nothing reached the API"
    );
}

#[tokio::test]
async fn sni_and_host_must_name_the_connect_target() {
    let r = rig(false).await;
    let (cred, ph) = spawn_credential(&r.proxy, &r.cell);
    let ca = helper_ca(&r.proxy);
    // SNI for another name: the tunnel is closed, no certificate is minted.
    let e = guest(r.addr, &cred, "api.anthropic.com:443", "other.example", &ca)
        .await
        .err();
    assert!(e.is_some(), "a mismatched SNI must not get a handshake");
    // Host for another name on the API tunnel: 421.
    let mut g = guest(r.addr, &cred, "api.anthropic.com:443", API, &ca)
        .await
        .unwrap();
    let mut req = request(
        "/v1/messages",
        &[("authorization", &format!("Bearer {ph}"))],
        "{}",
    );
    req.headers_mut()
        .insert("host", "other.example".parse().unwrap());
    let resp = g.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 421);
    assert!(r.up.seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn other_hosts_stay_end_to_end_and_keep_the_placeholder() {
    let r = rig(false).await;
    let (cred, ph) = spawn_credential(&r.proxy, &r.cell);
    // The guest verifies other.example against the upstream's own CA: no
    // interception there.
    let mut g = guest(
        r.addr,
        &cred,
        "other.example:443",
        "other.example",
        &r.up.ca,
    )
    .await
    .unwrap();
    let mut req = request("/echo", &[("authorization", &format!("Bearer {ph}"))], "{}");
    req.headers_mut()
        .insert("host", "other.example".parse().unwrap());
    let resp = g.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let _ = body_text(resp).await;
    let seen = r.up.seen.lock().unwrap().clone();
    assert_eq!(
        seen[0].header("authorization"),
        [format!("Bearer {ph}").as_str()]
    );
    // And our CA cannot vouch for it.
    let ca = helper_ca(&r.proxy);
    assert!(
        guest(r.addr, &cred, "other.example:443", "other.example", &ca)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn an_untrusted_upstream_is_refused_not_bypassed() {
    let up = upstream(false).await;
    let (corporate, _) = corporate_proxy(up.addr).await;
    // The helper trusts some other CA, not the upstream's.
    let (_, unrelated) = test_ca();
    let (proxy, addr) = helper_proxy(corporate, roots_of(&unrelated)).await;
    let cell = SecretCell::new(RealSecret::new(REAL.to_string()).unwrap());
    let (cred, ph) = spawn_credential(&proxy, &cell);
    let ca = helper_ca(&proxy);
    let mut g = guest(addr, &cred, "api.anthropic.com:443", API, &ca)
        .await
        .unwrap();
    let resp = g
        .send_request(request(
            "/v1/messages",
            &[("authorization", &format!("Bearer {ph}"))],
            "{}",
        ))
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
    let text = body_text(resp).await;
    assert!(!text.contains(REAL), "{text}");
    assert!(
        up.seen.lock().unwrap().is_empty(),
        "no request reached an unverified upstream"
    );
}

#[tokio::test]
async fn streamed_answers_pass_through_unbuffered() {
    let r = rig(false).await;
    let (cred, ph) = spawn_credential(&r.proxy, &r.cell);
    let ca = helper_ca(&r.proxy);
    let mut g = guest(r.addr, &cred, "api.anthropic.com:443", API, &ca)
        .await
        .unwrap();
    let resp = g
        .send_request(request(
            "/stream",
            &[("authorization", &format!("Bearer {ph}"))],
            "{}",
        ))
        .await
        .unwrap();
    let mut body = resp.into_body();
    // The first event arrives while the upstream still holds the rest.
    let first = tokio::time::timeout(T, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        first.into_data().unwrap(),
        Bytes::from_static(b"event: first\n\n")
    );
    r.up.release.notify_one();
    let rest = tokio::time::timeout(T, body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    assert_eq!(rest, Bytes::from_static(b"event: last\n\n"));
}

#[tokio::test]
async fn the_api_host_is_reached_by_name_on_443_only() {
    let r = rig(false).await;
    let (cred, _ph) = spawn_credential(&r.proxy, &r.cell);
    // Another name (or an address) whose TLS names the API host: refused
    // before a byte reaches the upstream.
    let e = guest(r.addr, &cred, "other.example:443", API, &r.up.ca)
        .await
        .err();
    assert!(
        e.is_some(),
        "a relayed tunnel naming the API host in its SNI must not work"
    );
    // Another port of the API host: refused at CONNECT.
    let head = guest(r.addr, &cred, "api.anthropic.com:80", API, &r.up.ca)
        .await
        .err()
        .unwrap();
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert!(r.up.seen.lock().unwrap().is_empty());
    assert!(
        !r.corporate_targets
            .lock()
            .unwrap()
            .iter()
            .any(|t| t.ends_with(":80")),
        "port 80 was never dialled"
    );
}

#[tokio::test]
async fn relayed_tunnels_where_the_server_speaks_first_are_not_held_up() {
    // An SSH-like server: banner first, then echo.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(b"SSH-2.0-test\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).await.unwrap();
        s.write_all(&buf[..n]).await.unwrap();
    });
    let (corporate, _) = corporate_proxy(server).await;
    let (_, unrelated) = test_ca();
    let (proxy, addr) = helper_proxy(corporate, roots_of(&unrelated)).await;
    let cred = proxy.issue("s", Policy::Unrestricted).unwrap();
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("s:{}", cred.expose()));
    tcp.write_all(
        format!("CONNECT git.example:22 HTTP/1.1\r\nProxy-Authorization: Basic {auth}\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    assert!(read_head(&mut tcp).await.starts_with("HTTP/1.1 200"));
    let mut banner = [0u8; 14];
    tokio::time::timeout(T, tcp.read_exact(&mut banner))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&banner, b"SSH-2.0-test\r\n");
    tcp.write_all(b"hello").await.unwrap();
    let mut echo = [0u8; 5];
    tokio::time::timeout(T, tcp.read_exact(&mut echo))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&echo, b"hello");
}
