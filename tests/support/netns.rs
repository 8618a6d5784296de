//! Network namespaces for the egress tests: nothing these tests do can
//! reach beyond the machine, because everything runs inside namespaces
//! made here.
//!
//! Topology: the test re-runs itself (one `#[ignore]`d inner test) under
//! `unshare --net --mount` ([`rerun_in_namespaces`]): namespace P, with
//! its own loopback and a private mount namespace where [`bind_hosts`]
//! puts test names over `/etc/hosts`. [`ServerNamespace::create`] adds a
//! second namespace S, held by a `cat` process, joined to P by a veth pair
//! ([`P_V4`]/[`P_V6`] in P, [`S_V4`]/[`S_V6`] in S). Servers bind in S with
//! [`bind_in`]; the helper, the proxy and decoys run in P.
//!
//! Needs root, `unshare`, `nsenter` and `ip` ([`missing_tools`]).

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener as StdTcpListener};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Address of P's end of the veth pair (exists only inside the namespaces).
pub const P_V4: &str = "10.203.0.1";
/// Address of S's end of the veth pair: where the test servers listen.
pub const S_V4: &str = "10.203.0.2";
/// P's IPv6 address on the veth pair.
pub const P_V6: &str = "fd42:203::1";
/// S's IPv6 address on the veth pair.
pub const S_V6: &str = "fd42:203::2";

/// Bound for namespace setup and server I/O.
const T: Duration = Duration::from_secs(20);

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether `tool` is on `PATH`.
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Why the namespace tests cannot run here, if they cannot.
pub fn missing_tools() -> Option<String> {
    if !is_root() {
        return Some("needs root to build network namespaces".into());
    }
    let missing: Vec<&str> = ["unshare", "ip", "nsenter"]
        .into_iter()
        .filter(|t| !have(t))
        .collect();
    (!missing.is_empty())
        .then(|| format!("needs {} to build network namespaces", missing.join(", ")))
}

/// Runs `cmd`, panicking with its stderr when it fails.
pub fn run(cmd: &[&str]) {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .output()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Re-runs this test binary's `inner` test under `unshare --net --mount`
/// with `env`; returns its whole output once it exited successfully and
/// printed `ok_marker`, panics with the output otherwise.
pub fn rerun_in_namespaces(inner: &str, env: &[(&str, &str)], ok_marker: &str) -> String {
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new("unshare")
        .args(["--net", "--mount", "--propagation", "private", "--"])
        .arg(exe)
        .args([
            "--exact",
            inner,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(env.iter().copied())
        .output()
        .expect("run unshare");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "inner run failed ({}):\n{text}",
        out.status
    );
    assert!(
        text.contains(ok_marker),
        "inner run did not finish:\n{text}"
    );
    text
}

/// Puts `contents` over `/etc/hosts` (in this process's private mount
/// namespace); the file lives as long as the returned handle.
pub fn bind_hosts(contents: &str) -> tempfile::NamedTempFile {
    let hosts = tempfile::NamedTempFile::new().expect("hosts file");
    std::fs::write(hosts.path(), contents).expect("write hosts");
    run(&[
        "mount",
        "--bind",
        hosts.path().to_str().expect("utf-8 path"),
        "/etc/hosts",
    ]);
    hosts
}

/// A process we started; killed when dropped.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The namespace S and its holder process (`cat` on a pipe, so it also ends
/// when the test does).
pub struct ServerNamespace {
    holder: KillOnDrop,
}

impl ServerNamespace {
    /// Creates S, the veth pair and both ends' addresses; brings up P's
    /// loopback too.
    pub fn create() -> ServerNamespace {
        let holder = KillOnDrop(
            Command::new("unshare")
                .args(["--net", "--", "cat"])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .expect("spawn the namespace holder"),
        );
        let pid = holder.0.id().to_string();
        let ours = std::fs::read_link("/proc/self/ns/net").expect("our netns");
        let deadline = Instant::now() + T;
        while std::fs::read_link(format!("/proc/{pid}/ns/net"))
            .ok()
            .as_ref()
            == Some(&ours)
        {
            assert!(
                Instant::now() < deadline,
                "holder never entered its namespace"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        run(&["ip", "link", "set", "lo", "up"]);
        run(&[
            "ip", "link", "add", "egv0", "type", "veth", "peer", "name", "egv1", "netns", &pid,
        ]);
        run(&["ip", "addr", "add", &format!("{P_V4}/24"), "dev", "egv0"]);
        run(&[
            "ip",
            "-6",
            "addr",
            "add",
            &format!("{P_V6}/64"),
            "dev",
            "egv0",
            "nodad",
        ]);
        run(&["ip", "link", "set", "egv0", "up"]);
        let ns = |args: &[&str]| {
            let mut v = vec!["nsenter", "-t", &pid, "-n", "ip"];
            v.extend_from_slice(args);
            run(&v);
        };
        ns(&["link", "set", "lo", "up"]);
        ns(&["addr", "add", &format!("{S_V4}/24"), "dev", "egv1"]);
        ns(&[
            "-6",
            "addr",
            "add",
            &format!("{S_V6}/64"),
            "dev",
            "egv1",
            "nodad",
        ]);
        ns(&["link", "set", "egv1", "up"]);
        ServerNamespace { holder }
    }

    /// The holder's pid (for `nsenter -t` and [`bind_in`]).
    pub fn pid(&self) -> u32 {
        self.holder.0.id()
    }

    /// Starts `cmd` inside S (`nsenter -t <holder> -n`); killed when dropped.
    pub fn spawn(&self, cmd: &[&str]) -> KillOnDrop {
        KillOnDrop(
            Command::new("nsenter")
                .args(["-t", &self.pid().to_string(), "-n", "--"])
                .args(cmd)
                .stdin(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("start {cmd:?} in the server namespace: {e}")),
        )
    }
}

/// Binds listeners inside the namespace of `pid` (from a thread that joins
/// it; a socket stays in the namespace it was made in).
pub fn bind_in(pid: u32, addrs: Vec<SocketAddr>) -> Vec<StdTcpListener> {
    std::thread::spawn(move || {
        let f = std::fs::File::open(format!("/proc/{pid}/ns/net")).expect("open netns");
        // SAFETY: setns on a namespace fd affects only this thread.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        addrs
            .into_iter()
            .map(|a| StdTcpListener::bind(a).unwrap_or_else(|e| panic!("bind {a}: {e}")))
            .collect()
    })
    .join()
    .expect("bind thread")
}

/// What the test servers saw: (server label, request line) per request.
pub type Log = Arc<Mutex<Vec<(String, String)>>>;

/// The request paths in `log` (second word of each request line).
pub fn paths_seen(log: &Log) -> BTreeSet<String> {
    log.lock()
        .expect("log lock")
        .iter()
        .filter_map(|(_, line)| line.split_whitespace().nth(1).map(str::to_owned))
        .collect()
}

/// A tiny HTTP server on a tokio task: answers each request with
/// `<label> <request line>` and records it in `log`.
pub fn serve_http(listener: StdTcpListener, label: &'static str, log: Log) {
    listener.set_nonblocking(true).expect("nonblocking");
    let l = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 1024];
                while !got.ends_with(b"\r\n\r\n") && got.len() < 16384 {
                    match tokio::time::timeout(T, s.read(&mut buf)).await {
                        Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
                        _ => break,
                    }
                }
                let line = String::from_utf8_lossy(&got)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_owned();
                log.lock()
                    .expect("log lock")
                    .push((label.to_owned(), line.clone()));
                let body = format!("{label} {line}");
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
}
