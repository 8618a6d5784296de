//! What keeping credentials on the host costs: the API path intercepted by
//! the egress proxy (TLS terminated, the placeholder swapped, TLS again to
//! the upstream) against the same request tunnelled end to end, and the
//! proxy's memory while 20 intercepted answers stream at once.
//!
//! Run with `cargo bench --bench api_intercept` (without `--bench`, a short
//! smoke run). Everything is on loopback (`tests/support/tls_upstream.rs`):
//! an upstream TLS server (a test CA's certificate for both names) stands
//! in for the API, reached through a CONNECT forwarder standing in for a
//! corporate proxy (the helper's own `HTTPS_PROXY`), so no name is
//! resolved. The proxy runs in a child
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

// The bench uses the rig's upstream and proxy, not its request records.
#[allow(dead_code)]
#[path = "../tests/support/tls_upstream.rs"]
mod tls_upstream;

use std::io::BufRead;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use cowork_helper::egress::secrets::{Carrier, RealSecret, SecretCell, Substituter};
use cowork_helper::egress::Policy;
use http_body_util::{BodyExt, Full};
use rustls::pki_types::CertificateDer;
use tls_upstream::{forwarder, helper_proxy, pem_certs, upstream, API, OTHER};
use tokio::net::TcpListener;

/// Set in the child that runs the proxy: `<upstream CA PEM file>
/// <forwarder address>`.
const CHILD_ENV: &str = "COWORK_API_BENCH_PROXY_CHILD";
/// The real token the child's proxy swaps in.
const REAL: &str = "sk-ant-oat01-bench-real-token-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789ab";
/// Rounds of each measurement (full run, smoke run).
const REQUESTS: (usize, usize) = (2000, 50);
const CONNECTIONS: (usize, usize) = (300, 10);
/// Concurrent intercepted streams for the memory figure.
const STREAMS: usize = 20;
/// The request body size.
const BODY: usize = 2048;

/// The child: the helper's proxy, trusting the upstream CA, dialling
/// through the forwarder; prints its address and a spawn's credentials.
fn child(ca_file: &str, forwarder: &str) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let pem = std::fs::read_to_string(ca_file).expect("CA file");
        let mut roots = rustls::RootCertStore::empty();
        for cert in pem_certs(&pem) {
            roots.add(cert).expect("root");
        }
        let proxy = helper_proxy(forwarder.parse().expect("forwarder"), roots);
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
    tls_upstream::guest(p.addr, &p.auth, target, name, ca)
        .await
        .expect("a connection through the proxy")
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
    // The connection may still be finishing the previous exchange.
    s.ready().await.expect("connection ready");
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
        let up = upstream(true).await;
        let up_ca = up.ca.clone();
        let (fwd, _) = forwarder(up.addr).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let ca_file = dir.path().join("upstream-ca.pem");
        std::fs::write(&ca_file, &up.ca_pem).expect("CA file");
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
            ca: pem_certs(&pem).pop().expect("helper CA"),
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
