//! What keeping credentials on the host costs: the API path intercepted by
//! the egress proxy (TLS terminated, the placeholder swapped, TLS again to
//! the upstream) against the same request tunnelled end to end, and the
//! proxy's memory while 20 intercepted answers stream at once.
//!
//! Run with `cargo bench --bench api_intercept` (without `--bench`, a short
//! smoke run). Everything is on loopback: an upstream TLS server (a test
//! CA's certificate for both names) stands in for the API, reached through
//! a CONNECT forwarder standing in for a corporate proxy (the helper's own
//! `HTTPS_PROXY`), so no name is resolved. The proxy runs in a child
//! process (this binary again, under [`CHILD_ENV`]) so that its resident
//! memory is its own.
//!
//! - request: on an established connection, one `POST /v1/messages` (a
//!   2 KiB body) and its small event-stream answer; median and p99.
//! - connection: CONNECT, the TLS handshake(s) and the first request.
//!   Paths are interleaved round by round (load on the shared machine falls
//!   on both alike).
//! - memory: the proxy's VmRSS before and with [`STREAMS`] intercepted
//!   answers held open (each upstream answer sends one event, then waits).

use std::io::BufRead;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use cowork_helper::egress::secrets::{Carrier, RealSecret, SecretCell, Substituter};
use cowork_helper::egress::{
    AddressGuard, EgressDialer, EgressProxy, NoProxy, Policy, ProxyConfig, UpstreamProxy,
};
use http_body_util::{BodyExt, Full};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Set in the child that runs the proxy: `<upstream CA PEM file>
/// <forwarder address>`.
const CHILD_ENV: &str = "COWORK_API_BENCH_PROXY_CHILD";
const API: &str = "api.anthropic.com";
const OTHER: &str = "other.example";
/// The real token the child's proxy swaps in.
const REAL: &str = "sk-ant-oat01-bench-real-token-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789ab";
/// Rounds of each measurement (full run, smoke run).
const REQUESTS: (usize, usize) = (2000, 50);
const CONNECTIONS: (usize, usize) = (300, 10);
/// Concurrent intercepted streams for the memory figure.
const STREAMS: usize = 20;
/// The request body size.
const BODY: usize = 2048;

/// A response body fed frame by frame.
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

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The stand-in API: `/hold` answers one event and then holds the stream.
async fn upstream() -> (SocketAddr, CertificateDer<'static>, String) {
    let mut ca_params = CertificateParams::default();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().expect("key");
    let ca = ca_params.self_signed(&ca_key).expect("ca");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(vec![API.to_string(), OTHER.to_string()])
        .expect("params")
        .signed_by(&key, &issuer)
        .expect("leaf");
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .expect("config");
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            // As a real server does: no Nagle delay between a head and its body.
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                let service = hyper::service::service_fn(
                    |req: hyper::Request<hyper::body::Incoming>| async move {
                        let hold = req.uri().path() == "/hold";
                        let _ = req.into_body().collect().await;
                        let (tx, rx) = tokio::sync::mpsc::channel(2);
                        tokio::spawn(async move {
                            let _ = tx
                                .send(Bytes::from_static(b"event: message_start\ndata: {}\n\n"))
                                .await;
                            if hold {
                                tx.closed().await;
                            } else {
                                let _ = tx
                                    .send(Bytes::from_static(b"event: message_stop\ndata: {}\n\n"))
                                    .await;
                            }
                        });
                        Ok::<_, std::convert::Infallible>(
                            hyper::Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(ChannelBody(rx))
                                .expect("response"),
                        )
                    },
                );
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
    (addr, ca.der().clone(), ca.pem())
}

/// The stand-in corporate proxy: every CONNECT goes to `to`.
async fn forwarder(to: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut c, _)) = listener.accept().await {
            tokio::spawn(async move {
                if read_head(&mut c).await.is_empty() {
                    return;
                }
                let Ok(mut up) = TcpStream::connect(to).await else {
                    return;
                };
                let _ = up.set_nodelay(true);
                let _ = c.set_nodelay(true);
                if c.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.is_ok() {
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut up).await;
                }
            });
        }
    });
    addr
}

async fn read_head(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut b = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match s.read(&mut b).await {
            Ok(1) => buf.push(b[0]),
            _ => return String::new(),
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// The child: the helper's proxy, trusting the upstream CA, dialling
/// through the forwarder; prints its address and a spawn's credentials.
fn child(ca_file: &str, forwarder: &str) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let pem = std::fs::read(ca_file).expect("CA file");
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile_certs(&pem) {
            roots.add(cert).expect("root");
        }
        let upstream = UpstreamProxy::parse(&format!("http://{forwarder}")).expect("forwarder");
        let proxy = EgressProxy::with_upstream_roots(
            EgressDialer::new(AddressGuard::new(), Some(upstream), NoProxy::default()),
            ProxyConfig::default(),
            Ok(roots),
        );
        let cell = SecretCell::new(RealSecret::new(REAL.into()).expect("secret"));
        let mut subs = Substituter::default();
        let placeholder = subs
            .substitute(Carrier::Bearer, REAL, cell)
            .expect("placeholder");
        let cred = proxy
            .issue_with_secrets("bench", Policy::Unrestricted, subs.finish())
            .expect("credential");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        println!(
            "{} {} {placeholder}\n{}",
            listener.local_addr().expect("addr"),
            cred.expose(),
            proxy.ca_pem().expect("interception")
        );
        println!("END");
        proxy.serve_tcp(listener).await.expect("serve");
    });
}

/// The certificates of a PEM text (base64 between the markers).
fn rustls_pemfile_certs(pem: &[u8]) -> Vec<CertificateDer<'static>> {
    let text = String::from_utf8_lossy(pem);
    text.split("-----BEGIN CERTIFICATE-----")
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

/// Where the child proxy is and what a spawn holds.
struct Proxy {
    addr: SocketAddr,
    auth: String,
    placeholder: String,
    ca: CertificateDer<'static>,
    pid: u32,
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// CONNECT `target` through the proxy, TLS for `name` trusting `ca`.
async fn open(p: &Proxy, target: &str, name: &str, ca: &CertificateDer<'static>) -> Sender {
    let mut tcp = TcpStream::connect(p.addr).await.expect("proxy");
    tcp.set_nodelay(true).expect("nodelay");
    tcp.write_all(
        format!(
            "CONNECT {target} HTTP/1.1\r\nProxy-Authorization: Basic {}\r\n\r\n",
            p.auth
        )
        .as_bytes(),
    )
    .await
    .expect("CONNECT");
    let head = read_head(&mut tcp).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).expect("root");
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(name.to_string()).expect("name"), tcp)
        .await
        .expect("TLS");
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("h1");
    tokio::spawn(conn);
    sender
}

fn request(p: &Proxy, host: &str, path: &str) -> hyper::Request<Full<Bytes>> {
    hyper::Request::post(path)
        .header("host", host)
        .header("authorization", format!("Bearer {}", p.placeholder))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(vec![b'x'; BODY])))
        .expect("request")
}

/// One request and its whole answer.
async fn once(s: &mut Sender, req: hyper::Request<Full<Bytes>>) -> Duration {
    let t = Instant::now();
    let resp = s.send_request(req).await.expect("answer");
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.expect("body");
    t.elapsed()
}

fn stats(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3;
    (at(0.5), at(0.99))
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    if let Ok(args) = std::env::var(CHILD_ENV) {
        let mut a = args.split(' ');
        child(a.next().expect("ca"), a.next().expect("forwarder"));
        return;
    }
    let full = std::env::args().any(|a| a == "--bench");
    let (requests, connections) = if full {
        (REQUESTS.0, CONNECTIONS.0)
    } else {
        (REQUESTS.1, CONNECTIONS.1)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let (up, up_ca, up_ca_pem) = upstream().await;
        let fwd = forwarder(up).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let ca_file = dir.path().join("upstream-ca.pem");
        std::fs::write(&ca_file, up_ca_pem).expect("CA file");
        let exe = std::env::current_exe().expect("exe");
        let mut child = std::process::Command::new(exe)
            .env(CHILD_ENV, format!("{} {fwd}", ca_file.display()))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("proxy child");
        let mut lines = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        let first = lines.next().expect("child line").expect("read");
        let mut w = first.split(' ');
        let addr: SocketAddr = w.next().expect("addr").parse().expect("addr");
        let cred = w.next().expect("cred").to_string();
        let placeholder = w.next().expect("placeholder").to_string();
        let mut pem = String::new();
        for l in lines.by_ref() {
            let l = l.expect("read");
            if l == "END" {
                break;
            }
            pem.push_str(&l);
            pem.push('\n');
        }
        let proxy = Proxy {
            addr,
            auth: base64::engine::general_purpose::STANDARD.encode(format!("bench:{cred}")),
            placeholder,
            ca: rustls_pemfile_certs(pem.as_bytes()).pop().expect("helper CA"),
            pid: child.id(),
        };
        println!("api_intercept bench: {requests} requests, {connections} connections per path, loopback");

        // Per request, on established connections.
        let mut tunnelled = open(&proxy, &format!("{OTHER}:443"), OTHER, &up_ca).await;
        let mut intercepted = open(&proxy, &format!("{API}:443"), API, &proxy.ca).await;
        let (mut t, mut i) = (Vec::new(), Vec::new());
        for _ in 0..requests {
            t.push(once(&mut tunnelled, request(&proxy, OTHER, "/v1/messages")).await);
            i.push(once(&mut intercepted, request(&proxy, API, "/v1/messages")).await);
        }
        let (tm, tp) = stats(t);
        let (im, ip) = stats(i);
        println!("  request, tunnelled (TLS end to end):   median {tm:.3} ms  p99 {tp:.3} ms");
        println!("  request, intercepted (swap on host):   median {im:.3} ms  p99 {ip:.3} ms  (+{:.3} ms median)", im - tm);

        // New connection + first request.
        let (mut t, mut i) = (Vec::new(), Vec::new());
        for _ in 0..connections {
            let start = Instant::now();
            let mut s = open(&proxy, &format!("{OTHER}:443"), OTHER, &up_ca).await;
            once(&mut s, request(&proxy, OTHER, "/v1/messages")).await;
            t.push(start.elapsed());
            let start = Instant::now();
            let mut s = open(&proxy, &format!("{API}:443"), API, &proxy.ca).await;
            once(&mut s, request(&proxy, API, "/v1/messages")).await;
            i.push(start.elapsed());
        }
        let (tm, tp) = stats(t);
        let (im, ip) = stats(i);
        println!("  connection + first request, tunnelled:   median {tm:.3} ms  p99 {tp:.3} ms");
        println!("  connection + first request, intercepted: median {im:.3} ms  p99 {ip:.3} ms  (+{:.3} ms median)", im - tm);

        // Memory with STREAMS intercepted answers open.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = rss_kib(proxy.pid);
        let mut held = Vec::new();
        for _ in 0..STREAMS {
            let mut s = open(&proxy, &format!("{API}:443"), API, &proxy.ca).await;
            let resp = s.send_request(request(&proxy, API, "/hold")).await.expect("answer");
            let mut body = resp.into_body();
            let first = body.frame().await.expect("frame").expect("data");
            assert!(first.is_data());
            held.push((s, body));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let with = rss_kib(proxy.pid);
        println!(
            "  proxy VmRSS: {} KiB idle after the runs, {} KiB with {STREAMS} intercepted streams open (+{} KiB, {} KiB per stream)",
            before,
            with,
            with.saturating_sub(before),
            with.saturating_sub(before) / STREAMS as u64
        );
        drop(held);
        let _ = child.kill();
        let _ = child.wait();
    });
}
