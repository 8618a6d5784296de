//! The sandbox backend's network, driven through the daemon as the client
//! drives it: sessions have loopback only and cannot reach the host's
//! loopback services; the egress proxy's unix socket is in the agent's view
//! (named in its environment, served) and not in a session's; the socket and
//! its directory go away at `stopVM` and when the machine dies, and
//! start/stop cycles leak no descriptor in the daemon. A session's proxied
//! request goes agent relay → egress socket → host proxy, which takes the
//! spawn's credential and applies its guard. Nothing here leaves the
//! machine (the one name resolved on the host is `localhost`).

mod support;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::daemon::*;

/// The egress socket as the agent sees it.
const AGENT_SOCKET: &str = "/.egress/proxy.sock";

/// The daemon's sandbox run directories (`cowork-sandbox-<pid>-<n>`), under
/// the runtime directory the harness gives it or the temporary directory.
fn run_dirs(d: &Daemon) -> Vec<PathBuf> {
    let prefix = format!("cowork-sandbox-{}-", d.pid());
    let bases = [d.dir.join("xdg-run"), std::env::temp_dir()];
    let mut found: Vec<PathBuf> = bases
        .iter()
        .filter_map(|b| std::fs::read_dir(b).ok())
        .flat_map(|entries| entries.flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// Waits (bounded) until `pred` holds; returns whether it did.
async fn eventually(limit: Duration, mut pred: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !pred() {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// The parent pid of `pid`, from `/proc/<pid>/stat`.
fn ppid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Host pid of the agent of `d`'s sandbox: the `__agent` process whose
/// parent (the sandbox init) is a child of the daemon.
fn agent_pid(d: &Daemon) -> u32 {
    let found: Vec<u32> = pids_with_arg("__agent")
        .into_iter()
        .filter(|&pid| ppid(pid).and_then(ppid) == Some(d.pid()))
        .collect();
    assert_eq!(found.len(), 1, "one agent of daemon {}: {found:?}", d.pid());
    found[0]
}

/// Open descriptors of `pid`.
fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Sends a CONNECT without credentials on `socket` and returns the status
/// line of the answer.
fn proxy_status_line(socket: &Path) -> String {
    let mut s = std::os::unix::net::UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
    s.set_read_timeout(Some(T)).expect("timeout");
    s.write_all(b"CONNECT example.invalid:443 HTTP/1.1\r\nHost: example.invalid:443\r\n\r\n")
        .expect("write");
    let mut head = [0u8; 12];
    s.read_exact(&mut head).expect("an answer");
    String::from_utf8_lossy(&head).into_owned()
}

#[tokio::test]
async fn sessions_have_loopback_only_and_the_socket_is_the_agent_s_alone() {
    let (d, p) = shared_vm().await;
    let pipe = p.pipe(d).await;
    let mut sub = p.subscribe(d).await;

    // A service on the host's loopback.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = listener.local_addr().expect("addr").port();
    listener.set_nonblocking(true).expect("nonblocking");

    let session = uid("s-net");
    let script = format!(
        r#"echo "ifaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ' ')"
echo "egress_env=${{COWORK_EGRESS_SOCKET:-unset}}"
echo "egress_dir=$(ls -A /.egress 2>&1 | tr '\n' ' ')"
if test -e {AGENT_SOCKET}; then echo socket=visible; else echo socket=absent; fi
if bash -c 'exec 5<>/dev/tcp/127.0.0.1/{port}' 2>/dev/null; then echo host_tcp=connected; else echo host_tcp=failed; fi
echo "hosts=$(grep -v '^#' /etc/hosts | tr '\n' ';')"
echo "resolv=$(grep -v '^#' /etc/resolv.conf | tr '\n' ';')"
"#
    );
    let out = run(&pipe, &mut sub, sh(&uid("net"), &session, &script)).await;
    let text = out.stdout_str();
    assert_eq!(out.exit_code(), Some(0), "{text}{}", out.stderr_str());
    let fields: std::collections::BTreeMap<&str, &str> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k, v.trim()))
        .collect();
    let get = |k: &str| *fields.get(k).unwrap_or_else(|| panic!("no {k}: {text}"));
    assert_eq!(get("ifaces"), "lo", "{text}");
    assert_eq!(get("host_tcp"), "failed", "{text}");
    assert!(
        listener.accept().is_err(),
        "a session reached the host's loopback listener"
    );
    assert_eq!(get("egress_env"), "unset", "{text}");
    assert_eq!(
        get("egress_dir"),
        "",
        "the egress directory is not hidden: {text}"
    );
    assert_eq!(get("socket"), "absent", "{text}");
    // The sandbox's own names, nothing of the host's /etc/hosts.
    assert_eq!(
        get("hosts"),
        "127.0.0.1\tlocalhost cowork-sandbox;::1\tlocalhost ip6-localhost ip6-loopback;",
        "{text}"
    );
    assert_eq!(get("resolv"), "nameserver 127.0.0.1;", "{text}");

    // The agent's view: the variable names the socket, and the proxy
    // answers there (without a credential: 407).
    let agent = agent_pid(d);
    let environ = std::fs::read(format!("/proc/{agent}/environ")).expect("agent environ");
    let want = format!("COWORK_EGRESS_SOCKET={AGENT_SOCKET}");
    assert!(
        environ.split(|&b| b == 0).any(|kv| kv == want.as_bytes()),
        "{}",
        String::from_utf8_lossy(&environ)
    );
    let in_agent_view = PathBuf::from(format!("/proc/{agent}/root{AGENT_SOCKET}"));
    assert_eq!(proxy_status_line(&in_agent_view), "HTTP/1.1 407");

    // On the host: one private run directory holding the socket.
    let dirs = run_dirs(d);
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    assert_eq!(
        proxy_status_line(&dirs[0].join("proxy.sock")),
        "HTTP/1.1 407"
    );
}

#[tokio::test]
async fn the_socket_goes_at_stop_vm_and_machine_death_without_leaks() {
    let mut d = Daemon::start_with(Opts {
        wait_ready: true,
        ..Opts::default()
    });
    let p = Profile::new(&d, "cycles");
    let pipe = p.pipe(&d).await;
    assert_eq!(run_dirs(&d), Vec::<PathBuf>::new());

    let cycle = |stop: bool| {
        let (d, pipe) = (&d, &pipe);
        async move {
            start_vm(d, pipe, json!({})).await;
            let dirs = run_dirs(d);
            assert_eq!(dirs.len(), 1, "{dirs:?}");
            let socket = dirs[0].join("proxy.sock");
            assert_eq!(proxy_status_line(&socket), "HTTP/1.1 407");
            if stop {
                pipe.call("stopVM", Value::Null).await.expect("stopVM");
            } else {
                // The machine dies under the daemon.
                let agent = agent_pid(d);
                // SAFETY: signalling the sandbox's PID 1, a process we found.
                assert_eq!(unsafe { libc::kill(agent as i32, libc::SIGKILL) }, 0);
                wait_guest(pipe, false).await;
            }
            assert!(
                eventually(T, || !dirs[0].exists()).await,
                "{} outlived the machine",
                dirs[0].display()
            );
        }
    };

    // The first cycle opens what the daemon keeps for good.
    cycle(true).await;
    let settle = |before: usize| {
        let pid = d.pid();
        async move { eventually(T, || fd_count(pid) <= before).await }
    };
    let before = fd_count(d.pid());
    for _ in 0..3 {
        cycle(true).await;
    }
    assert!(
        settle(before).await,
        "daemon descriptors grew across stopVM cycles: {before} -> {}",
        fd_count(d.pid())
    );
    cycle(false).await;
    cycle(false).await;
    assert!(
        settle(before).await,
        "daemon descriptors grew across machine deaths: {before} -> {}",
        fd_count(d.pid())
    );
    assert_eq!(run_dirs(&d), Vec::<PathBuf>::new());
    d.stop();
}

#[tokio::test]
async fn a_session_reaches_the_host_proxy_through_the_agent() {
    // The proxy named in the session's environment is the agent's relay on
    // the sandbox's loopback; it carries the request over the egress socket
    // to the host proxy, which takes the spawn's credential (no 407) and
    // applies its guard: `localhost` resolves (through the host's
    // /etc/hosts, no DNS query) to the host's loopback, which is refused.
    let (d, p) = shared_vm().await;
    let pipe = p.pipe(d).await;
    let mut sub = p.subscribe(d).await;
    let script = "curl -sS -D - -o /dev/null --noproxy '' -x \"$http_proxy\" http://localhost:9/";
    let out = run(&pipe, &mut sub, sh(&uid("via"), &uid("s-via"), script)).await;
    let text = out.stdout_str();
    assert_eq!(out.exit_code(), Some(0), "{text}{}", out.stderr_str());
    let status = text.lines().next().unwrap_or_default();
    assert!(status.starts_with("HTTP/1.1 403"), "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("x-proxy-error: blocked-by-allowlist"),
        "{text}"
    );
}
