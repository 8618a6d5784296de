//! Egress through a real VM: connection setup latency and bulk throughput
//! from a session in the guest, through the agent's relay, vsock and the
//! host proxy, to a server outside — against the same measurements made
//! inside the guest over its own loopback (what the guest's CPU can do at
//! all) and from the host directly. One run, same machine, same servers.
//!
//! Run with `cargo bench --bench egress_vm` (root; QEMU and the guest image
//! with its userland, `scripts/setup.sh`). `EGRESS_VM_BACKEND=kvm` measures
//! the in-process VMM instead where `/dev/kvm` boots Linux, and
//! `EGRESS_VM_BACKEND=sandbox` the namespace sandbox (relay in its network
//! namespace, unix socket to the host proxy). Nothing leaves
//! the machine: the bench re-runs itself in network namespaces of its own
//! (`tests/support/netns.rs`), the servers live behind a veth pair and
//! `bench.test` is a name in a bind-mounted `/etc/hosts`.
//!
//! Paths measured (setup = connect + handshake + one byte echoed; bulk =
//! [`GUEST_BULK_MIB`] MiB written one way and counted by the server):
//! - guest loopback: python client and server inside the guest;
//! - guest → relay (HTTP CONNECT with the spawn's credential, stage 1);
//! - guest → capture (a plain socket to `bench.test`: DNS stub, capture,
//!   SOCKS5 by name, stage 2);
//! - host → server directly, for reference.
//!
//! Under QEMU TCG the guest's CPU is emulated, so absolute guest numbers
//! say more about TCG than about the relay; compare the guest rows with each
//! other. Without `--bench` (as `cargo test --benches` runs it) it only
//! checks its prerequisites.

#[path = "../tests/support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;
use support::netns::{self, bind_in, ServerNamespace, S_V4};
use support::session::{self, bash, run};
use support::vm_helper::{self, built_helper, VmHelper};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Echo server port (in the server namespace). 8080 and 8443 are among the
/// ports the sandbox's fixed-port capture listens on, so the capture path
/// works under `EGRESS_VM_BACKEND=sandbox` too.
const ECHO_PORT: u16 = 8080;
/// Sink server port: counts bytes to EOF and answers the count.
const SINK_PORT: u16 = 8443;
/// Connection setups measured per guest path.
const GUEST_SETUPS: usize = 200;
/// Bulk transfer size per guest path, MiB.
const GUEST_BULK_MIB: usize = 256;
/// Setups and bulk size measured from the host.
const HOST_SETUPS: usize = 1000;
/// Write size of the bulk transfers.
const CHUNK: usize = 128 << 10;
/// Set on the re-run inside the namespaces.
const INNER_ARG: &str = "--inner";
/// Backend to measure (`qemu` by default).
const BACKEND_ENV: &str = "EGRESS_VM_BACKEND";

/// The guest side: a python script measuring the three guest paths and
/// printing one `ROW <path> <setup median ms> <setup p90 ms> <MB/s>` line each.
const GUEST_SCRIPT: &str = r#"
import base64, os, socket, statistics, threading, time, urllib.parse
N, MIB = int(os.environ["N"]), int(os.environ["MIB"])
url = urllib.parse.urlsplit(os.environ["https_proxy"])
auth = base64.b64encode(("%s:%s" % (urllib.parse.unquote(url.username), urllib.parse.unquote(url.password))).encode()).decode()
def loop_server(kind):
    l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(64)
    def serve():
        while True:
            c, _ = l.accept()
            def one(c=c):
                if kind == "echo":
                    while True:
                        d = c.recv(65536)
                        if not d: break
                        c.sendall(d)
                else:
                    n = 0
                    while True:
                        d = c.recv(1 << 20)
                        if not d: break
                        n += len(d)
                    c.sendall(n.to_bytes(8, "big"))
                c.close()
            threading.Thread(target=one, daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return l.getsockname()[1]
le, ls = loop_server("echo"), loop_server("sink")
def via_loop(port): return socket.create_connection(("127.0.0.1", port))
def via_relay(port):
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(("CONNECT bench.test:%d HTTP/1.1\r\nHost: bench.test:%d\r\nProxy-Authorization: Basic %s\r\n\r\n" % (port, port, auth)).encode())
    h = b""
    while not h.endswith(b"\r\n\r\n"):
        b = s.recv(1)
        if not b: raise SystemExit("relay closed: %r" % h)
        h += b
    if not h.startswith(b"HTTP/1.1 200"): raise SystemExit("relay refused: %r" % h)
    return s
def via_capture(port): return socket.create_connection(("bench.test", port))
def setup(open_, port):
    t = []
    for _ in range(N):
        t0 = time.perf_counter(); s = open_(port); s.sendall(b"x")
        if s.recv(1) != b"x": raise SystemExit("no echo")
        t.append((time.perf_counter() - t0) * 1e3); s.close()
    t.sort()
    return statistics.median(t), t[int(0.9 * (len(t) - 1))]
def bulk(open_, port):
    s = open_(port); chunk = b"\0" * (128 << 10); total = MIB << 20; left = total
    t0 = time.perf_counter()
    while left > 0:
        n = min(left, len(chunk)); s.sendall(chunk[:n]); left -= n
    s.shutdown(socket.SHUT_WR)
    got = b""
    while len(got) < 8:
        d = s.recv(8 - len(got))
        if not d: raise SystemExit("no count")
        got += d
    secs = time.perf_counter() - t0
    if int.from_bytes(got, "big") != total: raise SystemExit("short count")
    return total / secs / 1e6
for name, open_, e, k in [("guest-loopback", via_loop, le, ls), ("guest-relay", via_relay, 8080, 8443), ("guest-capture", via_capture, 8080, 8443)]:
    med, p90 = setup(open_, e)
    print("ROW %s %.3f %.3f %.1f" % (name, med, p90, bulk(open_, k)), flush=True)
"#;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let full = args.iter().any(|a| a == "--bench");
    if let Some(why) = missing() {
        println!("egress_vm bench skipped: {why}");
        return;
    }
    if !full {
        println!(
            "egress_vm: prerequisites present; run `cargo bench --bench egress_vm` to measure"
        );
        return;
    }
    if !args.iter().any(|a| a == INNER_ARG) {
        let exe = std::env::current_exe().expect("bench binary");
        let status = Command::new("unshare")
            .args(["--net", "--mount", "--propagation", "private", "--"])
            .arg(exe)
            .args([INNER_ARG, "--bench"])
            .status()
            .expect("run unshare");
        assert!(status.success(), "inner run failed: {status}");
        return;
    }
    inner();
}

/// Why the bench cannot run here, if it cannot.
fn missing() -> Option<String> {
    if let Some(why) = netns::missing_tools() {
        return Some(why);
    }
    if let Some(why) = support::gate::qemu_missing() {
        return Some(why);
    }
    match vm_helper::image_for(&built_helper()) {
        Ok(img) if img.rootfs.is_some() => None,
        Ok(_) => Some("the guest image has no rootfs.img (scripts/setup.sh)".into()),
        Err(e) => Some(format!("no guest image ({e})")),
    }
}

/// Echo (single bytes back) and sink (count to EOF) servers in `pid`'s namespace.
fn servers(pid: u32) {
    let mut ls = bind_in(
        pid,
        vec![
            SocketAddr::new(S_V4.parse().expect("ip"), ECHO_PORT),
            SocketAddr::new(S_V4.parse().expect("ip"), SINK_PORT),
        ],
    )
    .into_iter();
    let echo = ls.next().expect("echo");
    let sink = ls.next().expect("sink");
    for (l, is_echo) in [(echo, true), (sink, false)] {
        l.set_nonblocking(true).expect("nonblocking");
        let l = tokio::net::TcpListener::from_std(l).expect("listener");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let _ = s.set_nodelay(true);
                tokio::spawn(async move {
                    if is_echo {
                        let (mut r, mut w) = s.split();
                        let _ = tokio::io::copy(&mut r, &mut w).await;
                        return;
                    }
                    let mut buf = vec![0u8; 1 << 20];
                    let mut n: u64 = 0;
                    while let Ok(k) = s.read(&mut buf).await {
                        if k == 0 {
                            break;
                        }
                        n += k as u64;
                    }
                    let _ = s.write_all(&n.to_be_bytes()).await;
                });
            }
        });
    }
}

/// The host → server reference: (setup median ms, p90 ms, MB/s).
async fn host_direct() -> (f64, f64, f64) {
    let echo = SocketAddr::new(S_V4.parse().expect("ip"), ECHO_PORT);
    let sink = SocketAddr::new(S_V4.parse().expect("ip"), SINK_PORT);
    let mut t = Vec::with_capacity(HOST_SETUPS);
    for _ in 0..HOST_SETUPS {
        let t0 = Instant::now();
        let mut s = tokio::net::TcpStream::connect(echo).await.expect("connect");
        s.write_all(b"x").await.expect("write");
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.expect("echo");
        t.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    let (med, p90) = (t[t.len() / 2], t[(t.len() - 1) * 9 / 10]);
    let bytes = GUEST_BULK_MIB << 20;
    let chunk = vec![0u8; CHUNK];
    let mut s = tokio::net::TcpStream::connect(sink).await.expect("connect");
    let t0 = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(CHUNK);
        s.write_all(&chunk[..n]).await.expect("write");
        left -= n;
    }
    s.shutdown().await.expect("shutdown");
    let mut count = [0u8; 8];
    s.read_exact(&mut count).await.expect("count");
    let mbs = bytes as f64 / t0.elapsed().as_secs_f64() / 1e6;
    (med, p90, mbs)
}

fn inner() {
    let backend = std::env::var(BACKEND_ENV).unwrap_or_else(|_| "qemu".into());
    let ns = ServerNamespace::create();
    let _hosts = netns::bind_hosts("127.0.0.1 localhost\n::1 localhost\n10.203.0.2 bench.test\n");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        servers(ns.pid());
        let (hm, hp, hb) = host_direct().await;
        let mut helper = VmHelper::start_temp(
            &built_helper(),
            "egress-bench-",
            &std::env::temp_dir(),
            &backend,
            Duration::from_secs(15),
        );
        let (pipe, mut sub) =
            session::client(&helper, "bench", "/tmp/egress-bench-profile", Duration::from_secs(180)).await;
        session::start_vm(
            &pipe,
            &helper,
            json!({"memoryGB": 2, "cpuCount": 2}),
            Duration::from_secs(180),
            "startVM",
        )
        .await;
        let script = format!(
            "N={GUEST_SETUPS} MIB={GUEST_BULK_MIB} python3 - <<'PY'\n{GUEST_SCRIPT}PY\n"
        );
        let mut spawn = bash("bench", "bench", &script);
        spawn["allowedDomains"] = json!(["bench.test"]);
        let out = run(&pipe, &mut sub, spawn, Duration::from_secs(1200)).await;
        let stdout = out.stdout_str();
        let _ = pipe.call("stopVM", json!({})).await;
        helper.stop();
        let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("ROW ")).collect();
        assert_eq!(rows.len(), 3, "guest script failed:\n{stdout}\n{}", out.stderr_str());
        println!(
            "egress through the VM relay, --backend {backend} ({GUEST_SETUPS} setups, {GUEST_BULK_MIB} MiB bulk per path)"
        );
        println!("{:<16} {:>14} {:>12} {:>10}", "path", "setup med ms", "setup p90", "MB/s");
        println!("{:<16} {hm:>14.3} {hp:>12.3} {hb:>10.1}", "host-direct");
        for r in rows {
            let w: Vec<&str> = r.split_whitespace().collect();
            println!("{:<16} {:>14} {:>12} {:>10}", w[1], w[2], w[3], w[4]);
        }
    });
}
