//! Egress proxy benchmark: connection setup latency and bulk throughput
//! through the proxy against a direct loopback TCP connection, in one run.
//!
//! Run with `cargo bench --bench egress`. Everything is on loopback; the
//! proxy uses the test-only guard that admits 127.0.0.0/8 (the production
//! guard refuses loopback by design). The proxy is reached over a unix
//! socket, as the sandbox backend reaches it, and over TCP for comparison.
//!
//! - setup: connect + (CONNECT handshake with credential + 200) + one byte
//!   echoed, median and p99 of [`SETUP_ROUNDS`] rounds.
//! - throughput: [`BULK_BYTES`] written one way and counted by the server,
//!   best of [`BULK_ROUNDS`].
//! - paths are interleaved round by round so machine load hits all alike;
//!   client, proxy and servers run on separate runtimes (threads).
//!
//! Targets (issue 10): ≤ 1 ms added per connection, ≥ 50 % of direct
//! throughput. Set `EGRESS_BENCH_BYTES` to change the bulk size.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine as _;
use cowork_helper::egress::{
    AddressGuard, EgressDialer, EgressProxy, NoProxy, Policy, ProxyConfig,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};

/// Connection-setup rounds per path (bounded: a few seconds in all).
const SETUP_ROUNDS: usize = 2000;

/// Rounds, bytes and bulk rounds when the binary runs as a test (`cargo test
/// --benches`, no `--bench` argument): a smoke run, not a measurement.
const SMOKE: (usize, usize, usize) = (50, 8 << 20, 1);

/// Bytes per bulk transfer.
const BULK_BYTES: usize = 256 << 20;

/// Bulk transfers per path, interleaved with the other paths; the best one
/// counts (least disturbed by the other jobs on a shared 2-core machine).
const BULK_ROUNDS: usize = 5;

/// Write size for bulk transfers.
const CHUNK: usize = 128 << 10;

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

#[derive(Clone)]
enum Path {
    Direct(SocketAddr),
    ProxyUnix(PathBuf, SocketAddr, String),
    ProxyTcp(SocketAddr, SocketAddr, String),
}

impl Path {
    fn label(&self) -> &'static str {
        match self {
            Path::Direct(_) => "direct TCP",
            Path::ProxyUnix(..) => "proxy via unix socket",
            Path::ProxyTcp(..) => "proxy via TCP",
        }
    }

    /// Opens a stream to `server` along this path (handshake included).
    async fn open(&self) -> Box<dyn Io> {
        let (mut s, target, auth): (Box<dyn Io>, SocketAddr, &str) = match self {
            Path::Direct(a) => {
                let s = TcpStream::connect(a).await.expect("connect");
                s.set_nodelay(true).expect("nodelay");
                return Box::new(s);
            }
            Path::ProxyUnix(p, t, auth) => (
                Box::new(UnixStream::connect(p).await.expect("unix")),
                *t,
                auth,
            ),
            Path::ProxyTcp(p, t, auth) => {
                let s = TcpStream::connect(p).await.expect("tcp");
                s.set_nodelay(true).expect("nodelay");
                (Box::new(s), *t, auth)
            }
        };
        s.write_all(
            format!(
                "CONNECT {t} HTTP/1.1\r\nHost: {t}\r\n{auth}\r\n",
                t = target
            )
            .as_bytes(),
        )
        .await
        .expect("CONNECT");
        let mut head = Vec::with_capacity(64);
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(s.read(&mut b).await.expect("head"), 1, "proxy closed");
            head.push(b[0]);
        }
        assert!(
            head.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&head)
        );
        s
    }
}

/// Echo server: echoes single bytes (setup test).
async fn echo_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let a = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    a
}

/// Sink server: counts bytes to EOF, answers the count (8 bytes, BE).
async fn sink_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let a = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; CHUNK];
                let mut n: u64 = 0;
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => n += k as u64,
                    }
                }
                let _ = s.write_all(&n.to_be_bytes()).await;
            });
        }
    });
    a
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn setup_once(path: &Path) -> Duration {
    let t = Instant::now();
    let mut s = path.open().await;
    s.write_all(b"x").await.expect("write");
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await.expect("echo");
    t.elapsed()
}

async fn bulk_once(path: &Path, bytes: usize, chunk: &[u8]) -> f64 {
    let mut s = path.open().await;
    let t = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(CHUNK);
        s.write_all(&chunk[..n]).await.expect("bulk write");
        left -= n;
    }
    s.shutdown().await.expect("shutdown");
    let mut count = [0u8; 8];
    s.read_exact(&mut count).await.expect("count");
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(u64::from_be_bytes(count), bytes as u64, "all bytes arrived");
    bytes as f64 / secs / 1e6
}

fn main() {
    // `cargo bench` passes `--bench`; without it this is a smoke run.
    let full = std::env::args().any(|a| a == "--bench");
    let (setup_rounds, default_bytes, bulk_rounds) = if full {
        (SETUP_ROUNDS, BULK_BYTES, BULK_ROUNDS)
    } else {
        SMOKE
    };
    let bytes = std::env::var("EGRESS_BENCH_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_bytes);
    // Servers, proxy and client each get their own runtime (as they are
    // separate processes in real use): on one shared runtime, tokio runs a
    // woken task on the waking worker, which serialises the direct
    // client/server pair on one core and flatters nothing but confuses the
    // comparison.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("server runtime");
        rt.block_on(async move {
            let echo = echo_server().await;
            let sink = sink_server().await;
            tx.send((echo, sink)).expect("send addresses");
            std::future::pending::<()>().await
        })
    });
    let (echo, sink) = rx.recv().expect("server addresses");
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("egress.sock");
    let proxy_rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("proxy runtime");
    let (taddr, auth) = proxy_rt.block_on(async {
        let guard =
            AddressGuard::allowing_networks_for_tests(&[("127.0.0.0".parse().expect("ip"), 8)]);
        let proxy = EgressProxy::new(
            EgressDialer::new(guard, None, NoProxy::default()),
            ProxyConfig::default(),
        );
        let cred = proxy
            .issue(
                "bench",
                Policy::try_from_allowed_domains(Some(&["127.0.0.1".to_string()])).expect("policy"),
            )
            .expect("issue");
        let auth = format!(
            "Proxy-Authorization: Basic {}\r\n",
            base64::engine::general_purpose::STANDARD.encode(format!("bench:{}", cred.expose()))
        );
        let ul = tokio::net::UnixListener::bind(&sock).expect("bind unix");
        let tl = TcpListener::bind("127.0.0.1:0").await.expect("bind tcp");
        let taddr = tl.local_addr().expect("addr");
        let p = proxy.clone();
        tokio::spawn(async move { p.serve_unix(ul).await });
        tokio::spawn(async move { proxy.serve_tcp(tl).await });
        (taddr, auth)
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    rt.block_on(async move {
        println!(
            "egress bench: {setup_rounds} setups, {} MiB x{bulk_rounds} bulk, loopback",
            bytes >> 20
        );
        let paths_echo = [
            Path::Direct(echo),
            Path::ProxyUnix(sock.clone(), echo, auth.clone()),
            Path::ProxyTcp(taddr, echo, auth.clone()),
        ];
        // Paths are interleaved round by round, so load from other jobs
        // on the machine falls on all of them alike.
        let mut samples: Vec<Vec<Duration>> =
            vec![Vec::with_capacity(setup_rounds); paths_echo.len()];
        for _ in 0..setup_rounds {
            for (i, p) in paths_echo.iter().enumerate() {
                samples[i].push(setup_once(p).await);
            }
        }
        let mut direct_median = Duration::ZERO;
        for (p, v) in paths_echo.iter().zip(samples.iter_mut()) {
            v.sort();
            let (med, p99) = (percentile(v, 0.5), percentile(v, 0.99));
            if matches!(p, Path::Direct(_)) {
                direct_median = med;
            }
            let added = med.saturating_sub(direct_median);
            println!(
                "setup   {:<22} median {:>7.1} us  p99 {:>7.1} us  added {:>7.1} us{}",
                p.label(),
                med.as_secs_f64() * 1e6,
                p99.as_secs_f64() * 1e6,
                added.as_secs_f64() * 1e6,
                if matches!(p, Path::Direct(_)) {
                    ""
                } else if added <= Duration::from_millis(1) {
                    "  (target <= 1 ms: met)"
                } else {
                    "  (target <= 1 ms: MISSED)"
                }
            );
        }
        let paths_sink = [
            Path::Direct(sink),
            Path::ProxyUnix(sock.clone(), sink, auth.clone()),
            Path::ProxyTcp(taddr, sink, auth.clone()),
        ];
        let chunk = vec![0xa5u8; CHUNK];
        let mut best = vec![0f64; paths_sink.len()];
        for _ in 0..bulk_rounds {
            for (i, p) in paths_sink.iter().enumerate() {
                best[i] = best[i].max(bulk_once(p, bytes, &chunk).await);
            }
        }
        let direct = best[0];
        for (p, mbps) in paths_sink.iter().zip(best) {
            let ratio = mbps / direct * 100.0;
            println!(
                "bulk    {:<22} {:>8.0} MB/s  {:>5.1} % of direct{}",
                p.label(),
                mbps,
                ratio,
                if matches!(p, Path::Direct(_)) {
                    ""
                } else if ratio >= 50.0 {
                    "  (target >= 50 %: met)"
                } else {
                    "  (target >= 50 %: MISSED)"
                }
            );
        }
    });
}
