//! The egress proxy with the production address guard, against real servers
//! in network namespaces this test creates. Nothing leaves the machine.
//!
//! Topology (all inside namespaces made here, root required):
//! - the outer test re-runs this binary's `#[ignore]`d `inner_egress` under
//!   `unshare --net --mount`: namespace P, with loopback, one end of a veth
//!   pair (10.203.0.1, fd42:203::1) and `/etc/hosts` bind-mounted over in
//!   its private mount namespace;
//! - a holder process in a second namespace S owns the other end
//!   (10.203.0.2, fd42:203::2), where the test servers listen;
//! - the proxy runs in P (so 10.203.0.1 is one of "the host's" addresses),
//!   on a unix socket and on 127.0.0.1; decoy servers in P on 127.0.0.1 and
//!   10.203.0.1 must never see a connection.
//!
//! Every server records each request line it gets; at the end the set of
//! request paths seen must equal exactly the set of requests that were
//! supposed to pass, so a refused request that reached any server fails.

mod support;

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener as StdTcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use cowork_helper::egress::{
    AddressGuard, Credential, EgressDialer, EgressProxy, NoProxy, Policy, ProxyConfig,
    UpstreamProxy,
};
use support::netns::{
    self, bind_in, have, serve_http, Log, ServerNamespace, P_V4, P_V6, S_V4, S_V6,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

/// Bound for anything that should take milliseconds.
const T: Duration = Duration::from_secs(20);

/// Printed by the inner run when all its assertions passed.
const INNER_OK: &str = "EGRESS-INNER-CHECKS-PASSED";

/// Port every test server listens on.
const PORT: u16 = 8080;

/// The test's /etc/hosts.
const HOSTS: &str = "127.0.0.1 localhost\n::1 localhost\n\
10.203.0.2 allowed.test other.test a.b.wild.test\n\
fd42:203::2 v6.test\n\
127.0.0.1 loop.test\n\
::ffff:127.0.0.1 mapped.test\n\
10.203.0.1 self.test\n";

#[test]
fn egress_in_network_namespaces() {
    if let Some(why) = netns::missing_tools() {
        eprintln!("skipped: {why}");
        return;
    }
    netns::rerun_in_namespaces("inner_egress", &[], INNER_OK);
}

fn basic(cred: &Credential) -> String {
    let enc = base64::engine::general_purpose::STANDARD.encode(format!("sess:{}", cred.expose()));
    format!("Proxy-Authorization: Basic {enc}\r\n")
}

async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> String {
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(T, s.read(&mut b))
            .await
            .expect("head in time")
            .expect("read head");
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
        got.push(b[0]);
    }
    String::from_utf8(got).expect("utf-8 head")
}

async fn read_all<S: AsyncRead + Unpin>(s: &mut S) -> String {
    let mut v = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut v))
        .await
        .expect("body in time")
        .expect("read body");
    String::from_utf8_lossy(&v).into_owned()
}

/// Where clients reach the proxy.
#[derive(Clone)]
enum Via {
    Unix(std::path::PathBuf),
    Tcp(SocketAddr),
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

async fn open(via: &Via) -> Box<dyn Io> {
    match via {
        Via::Unix(p) => Box::new(UnixStream::connect(p).await.expect("proxy unix socket")),
        Via::Tcp(a) => Box::new(TcpStream::connect(a).await.expect("proxy tcp")),
    }
}

/// CONNECT `target` with `auth` (a header line or ""), and on 200 send
/// `GET path` through the tunnel. Returns the proxy's head and the body.
async fn connect_get(via: &Via, target: &str, auth: &str, path: &str) -> (String, String) {
    let mut s = open(via).await;
    let req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n");
    s.write_all(req.as_bytes()).await.expect("write CONNECT");
    let head = read_head(&mut s).await;
    if !head.starts_with("HTTP/1.1 200") {
        return (head, String::new());
    }
    let get = format!("GET {path} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    s.write_all(get.as_bytes()).await.expect("write GET");
    let body = read_all(&mut s).await;
    (head, body)
}

/// An absolute-form GET; returns the whole response.
async fn absolute_get(via: &Via, url: &str, auth: &str, host_header: &str) -> String {
    let mut s = open(via).await;
    let req =
        format!("GET {url} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n{auth}\r\n");
    s.write_all(req.as_bytes()).await.expect("write GET");
    read_all(&mut s).await
}

/// SOCKS5 CONNECT with password `pass` to `addr` (ATYP + address bytes);
/// on success sends `GET path`. Returns the reply code and the body.
async fn socks_get(via: &Via, pass: &str, cmd: u8, addr: &[u8], path: &str) -> (u8, String) {
    let mut s = open(via).await;
    s.write_all(&[5, 1, 2]).await.expect("greeting");
    let mut m = [0u8; 2];
    s.read_exact(&mut m).await.expect("method");
    assert_eq!(m, [5, 2]);
    let mut a = vec![1, 4];
    a.extend_from_slice(b"sess");
    a.push(pass.len() as u8);
    a.extend_from_slice(pass.as_bytes());
    s.write_all(&a).await.expect("auth");
    let mut r = [0u8; 2];
    s.read_exact(&mut r).await.expect("auth reply");
    if r[1] != 0 {
        return (0xff, String::new());
    }
    let mut req = vec![5, cmd, 0];
    req.extend_from_slice(addr);
    req.extend_from_slice(&PORT.to_be_bytes());
    s.write_all(&req).await.expect("request");
    let mut rep = [0u8; 10];
    tokio::time::timeout(T, s.read_exact(&mut rep))
        .await
        .expect("reply in time")
        .expect("reply");
    if rep[1] != 0 {
        return (rep[1], String::new());
    }
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .expect("GET");
    (0, read_all(&mut s).await)
}

fn name(n: &str) -> Vec<u8> {
    let mut v = vec![3, n.len() as u8];
    v.extend_from_slice(n.as_bytes());
    v
}

fn v4(a: &str) -> Vec<u8> {
    let ip: std::net::Ipv4Addr = a.parse().expect("v4");
    let mut v = vec![1];
    v.extend_from_slice(&ip.octets());
    v
}

fn v6(a: &str) -> Vec<u8> {
    let ip: std::net::Ipv6Addr = a.parse().expect("v6");
    let mut v = vec![4];
    v.extend_from_slice(&ip.octets());
    v
}

fn list(entries: &[&str]) -> Policy {
    let v: Vec<String> = entries.iter().map(|s| s.to_string()).collect();
    Policy::try_from_allowed_domains(Some(&v)).expect("valid list")
}

#[test]
#[ignore = "run by egress_in_network_namespaces inside its namespaces"]
fn inner_egress() {
    let holder = ServerNamespace::create();
    let _hosts = netns::bind_hosts(HOSTS);

    let server_listeners = bind_in(
        holder.pid(),
        vec![
            format!("{S_V4}:{PORT}").parse().expect("addr"),
            format!("[{S_V6}]:{PORT}").parse().expect("addr"),
        ],
    );
    let decoys: Vec<StdTcpListener> = [format!("127.0.0.1:{PORT}"), format!("{P_V4}:{PORT}")]
        .iter()
        .map(|a| StdTcpListener::bind(a.as_str()).expect("bind decoy"))
        .collect();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let log: Log = Arc::default();
        let mut it = server_listeners.into_iter();
        serve_http(it.next().expect("v4"), "srv4", log.clone());
        serve_http(it.next().expect("v6"), "srv6", log.clone());
        let mut it = decoys.into_iter();
        serve_http(it.next().expect("lo"), "DECOY-loopback", log.clone());
        serve_http(
            it.next().expect("self"),
            "DECOY-host-interface",
            log.clone(),
        );

        // The production guard and no upstream proxy.
        let proxy = EgressProxy::new(
            EgressDialer::new(AddressGuard::new(), None, NoProxy::default()),
            ProxyConfig::default(),
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("egress.sock");
        let ul = tokio::net::UnixListener::bind(&sock).expect("bind unix");
        let tl = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind tcp");
        let tcp = tl.local_addr().expect("addr");
        let p = proxy.clone();
        tokio::spawn(async move { p.serve_unix(ul).await });
        let p = proxy.clone();
        tokio::spawn(async move { p.serve_tcp(tl).await });
        let unix = Via::Unix(sock);
        let tcpv = Via::Tcp(tcp);

        let a = proxy
            .issue(
                "alpha",
                list(&[
                    "allowed.test",
                    "*.wild.test",
                    "v6.test",
                    "loop.test",
                    "mapped.test",
                    "self.test",
                    "[fd42:203::2]",
                    "localhost",
                ]),
            )
            .expect("issue");
        let b = proxy.issue("beta", list(&["other.test"])).expect("issue");
        let c = proxy.issue("gamma", list(&["10.203.0.2"])).expect("issue");
        let e = proxy.issue("empty", list(&[])).expect("issue");
        let (aa, ab, ac, ae) = (basic(&a), basic(&b), basic(&c), basic(&e));
        let mut expected: BTreeSet<String> = BTreeSet::new();
        let blocked = |head: &str| {
            head.starts_with("HTTP/1.1 403")
                && head
                    .to_ascii_lowercase()
                    .contains("x-proxy-error: blocked-by-allowlist")
        };

        // Allowed: CONNECT (unix and tcp), absolute-form, wildcard depth 2.
        for (via, path) in [(&unix, "/ok-connect-unix"), (&tcpv, "/ok-connect-tcp")] {
            let (h, body) = connect_get(via, "allowed.test:8080", &aa, path).await;
            assert!(h.starts_with("HTTP/1.1 200"), "{h}");
            assert!(
                body.contains(&format!("srv4 GET {path} HTTP/1.1")),
                "{body}"
            );
            expected.insert(path.into());
        }
        let (h, body) = connect_get(&unix, "a.b.wild.test:8080", &aa, "/ok-wild").await;
        assert!(
            h.starts_with("HTTP/1.1 200") && body.contains("/ok-wild"),
            "{h}{body}"
        );
        expected.insert("/ok-wild".into());
        let resp = absolute_get(
            &unix,
            "http://allowed.test:8080/ok-absolute",
            &aa,
            "other.test",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.contains("srv4 GET /ok-absolute HTTP/1.1"), "{resp}");
        expected.insert("/ok-absolute".into());
        // IPv6 by name through CONNECT
        let (h, body) = connect_get(&unix, "v6.test:8080", &aa, "/ok-v6-name").await;
        assert!(
            h.starts_with("HTTP/1.1 200") && body.contains("srv6"),
            "{h}{body}"
        );
        expected.insert("/ok-v6-name".into());

        // Refused by the list: unlisted name, Host header can't launder it,
        // unlisted IP literal (its name is listed), [] refuses everything.
        for (target, auth) in [
            ("other.test:8080", &aa),
            ("10.203.0.2:8080", &aa),
            ("[fd42:203::2]:8080", &ab),
            ("allowed.test:8080", &ab),
            ("allowed.test:8080", &ae),
            ("10.203.0.2:8080", &ae),
            ("nowhere.test:8080", &aa),
        ] {
            let (h, _) = connect_get(&unix, target, auth, "/REFUSED-list").await;
            assert!(blocked(&h), "{target}: {h}");
        }
        let resp = absolute_get(
            &tcpv,
            "http://other.test:8080/REFUSED-abs",
            &aa,
            "allowed.test:8080",
        )
        .await;
        assert!(blocked(&resp), "{resp}");
        // Refused by the guard although listed: loopback, mapped loopback,
        // the proxy host's own interface, localhost.
        for target in [
            "loop.test:8080",
            "mapped.test:8080",
            "self.test:8080",
            "localhost:8080",
            "127.0.0.1:8080",
            "[::ffff:127.0.0.1]:8080",
            "10.203.0.1:8080",
        ] {
            let (h, _) = connect_get(&unix, target, &aa, "/REFUSED-guard").await;
            assert!(blocked(&h), "{target}: {h}");
        }
        let resp = absolute_get(
            &unix,
            "http://self.test:8080/REFUSED-guard-abs",
            &aa,
            "self.test",
        )
        .await;
        assert!(blocked(&resp), "{resp}");

        // Two sessions, different lists, each reaches only its own.
        let (h, body) = connect_get(&tcpv, "other.test:8080", &ab, "/ok-beta").await;
        assert!(
            h.starts_with("HTTP/1.1 200") && body.contains("/ok-beta"),
            "{h}{body}"
        );
        expected.insert("/ok-beta".into());
        // A listed literal works.
        let (h, body) = connect_get(&unix, "10.203.0.2:8080", &ac, "/ok-literal").await;
        assert!(
            h.starts_with("HTTP/1.1 200") && body.contains("/ok-literal"),
            "{h}{body}"
        );
        expected.insert("/ok-literal".into());

        // Credentials: none, wrong, revoked.
        let (h, _) = connect_get(&unix, "allowed.test:8080", "", "/REFUSED-nocred").await;
        assert!(
            h.starts_with("HTTP/1.1 407") && h.contains("Basic realm=\"cowork\""),
            "{h}"
        );
        let bogus = "Proxy-Authorization: Basic c2VzczpndWVzcw==\r\n";
        let (h, _) = connect_get(&unix, "allowed.test:8080", bogus, "/REFUSED-bogus").await;
        assert!(h.starts_with("HTTP/1.1 407"), "{h}");
        let d = proxy.issue("delta", Policy::Unrestricted).expect("issue");
        let ad = basic(&d);
        let (h, _) = connect_get(&unix, "allowed.test:8080", &ad, "/ok-before-revoke").await;
        assert!(h.starts_with("HTTP/1.1 200"), "{h}");
        expected.insert("/ok-before-revoke".into());
        assert!(proxy.revoke(&d));
        let (h, _) = connect_get(&unix, "allowed.test:8080", &ad, "/REFUSED-revoked").await;
        assert!(h.starts_with("HTTP/1.1 407"), "{h}");
        // Unrestricted still has the guard.
        let a2 = proxy.issue("epsilon", Policy::Unrestricted).expect("issue");
        let (h, _) = connect_get(
            &unix,
            "loop.test:8080",
            &basic(&a2),
            "/REFUSED-unrestricted",
        )
        .await;
        assert!(blocked(&h), "{h}");

        // SOCKS5: by name, IPv4, IPv6; refusals; UDP ASSOCIATE and BIND.
        let (pa, pc, pe) = (a.expose(), c.expose(), e.expose());
        let (code, body) = socks_get(&tcpv, pa, 1, &name("allowed.test"), "/ok-socks-name").await;
        assert_eq!(code, 0);
        assert!(body.contains("srv4 GET /ok-socks-name"), "{body}");
        expected.insert("/ok-socks-name".into());
        let (code, body) = socks_get(&unix, pc, 1, &v4(S_V4), "/ok-socks-v4").await;
        assert_eq!(code, 0);
        assert!(body.contains("/ok-socks-v4"), "{body}");
        expected.insert("/ok-socks-v4".into());
        let (code, body) = socks_get(&unix, pa, 1, &v6(S_V6), "/ok-socks-v6").await;
        assert_eq!(code, 0);
        assert!(body.contains("srv6 GET /ok-socks-v6"), "{body}");
        expected.insert("/ok-socks-v6".into());
        for (pass, addr) in [
            (pa, name("other.test")),
            (pa, v4(S_V4)),
            (pa, name("loop.test")),
            (pa, name("self.test")),
            (pa, v4(P_V4)),
            (pa, v6("::ffff:127.0.0.1")),
            (pa, v6(P_V6)),
            (pe, name("allowed.test")),
            (pc, name("allowed.test")),
        ] {
            let (code, _) = socks_get(&unix, pass, 1, &addr, "/REFUSED-socks").await;
            assert_eq!(code, 0x02, "{addr:?}");
        }
        for cmd in [2u8, 3] {
            let (code, _) = socks_get(&unix, pa, cmd, &v4(S_V4), "/REFUSED-udp").await;
            assert_eq!(code, 0x07, "command {cmd}");
        }
        let (code, _) = socks_get(
            &unix,
            "wrong-password",
            1,
            &name("allowed.test"),
            "/REFUSED-x",
        )
        .await;
        assert_eq!(code, 0xff, "auth failure");

        // Upstream (corporate) proxy: a front proxy dials through a back
        // proxy, as it would through the helper's HTTPS_PROXY, except for
        // NO_PROXY names. The back proxy admits only allowed.test, which
        // shows which way each connection went.
        let back = EgressProxy::new(
            EgressDialer::new(AddressGuard::new(), None, NoProxy::default()),
            ProxyConfig::default(),
        );
        let bl = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind back");
        let bport = bl.local_addr().expect("addr").port();
        let p = back.clone();
        tokio::spawn(async move { p.serve_tcp(bl).await });
        let corp = back.issue("corp", list(&["allowed.test"])).expect("issue");
        let up = UpstreamProxy::parse(&format!("http://corp:{}@127.0.0.1:{bport}", corp.expose()))
            .expect("upstream url");
        let front = EgressProxy::new(
            EgressDialer::new(AddressGuard::new(), Some(up), NoProxy::parse("other.test")),
            ProxyConfig::default(),
        );
        let fdir = tempfile::tempdir().expect("tempdir");
        let fsock = fdir.path().join("front.sock");
        let fl = tokio::net::UnixListener::bind(&fsock).expect("bind front");
        let p = front.clone();
        tokio::spawn(async move { p.serve_unix(fl).await });
        let fvia = Via::Unix(fsock);
        let fc = front
            .issue("front", list(&["allowed.test", "other.test", "v6.test"]))
            .expect("issue");
        let af = basic(&fc);
        let (h, body) = connect_get(&fvia, "allowed.test:8080", &af, "/ok-upstream").await;
        assert!(
            h.starts_with("HTTP/1.1 200") && body.contains("srv4 GET /ok-upstream"),
            "{h}{body}"
        );
        expected.insert("/ok-upstream".into());
        let resp = absolute_get(&fvia, "http://allowed.test:8080/ok-upstream-abs", &af, "x").await;
        assert!(resp.contains("srv4 GET /ok-upstream-abs"), "{resp}");
        expected.insert("/ok-upstream-abs".into());
        // v6.test goes to the back proxy, which refuses it: a 502 here.
        let (h, _) = connect_get(&fvia, "v6.test:8080", &af, "/REFUSED-by-upstream").await;
        assert!(h.starts_with("HTTP/1.1 502"), "{h}");
        // other.test is in NO_PROXY: direct, so the back proxy's list does not apply.
        let (h, body) = connect_get(&fvia, "other.test:8080", &af, "/ok-no-proxy").await;
        assert!(
            h.starts_with("HTTP/1.1 200") && body.contains("/ok-no-proxy"),
            "{h}{body}"
        );
        expected.insert("/ok-no-proxy".into());
        // The front's own list still applies first.
        let (h, _) = connect_get(&fvia, "a.b.wild.test:8080", &af, "/REFUSED-front").await;
        assert!(blocked(&h), "{h}");

        // Real clients, if present: curl through the proxy (absolute-form,
        // CONNECT tunnel, SOCKS by name), allowed and refused.
        if have("curl") {
            let url = |p: &str| format!("http://allowed.test:8080{p}");
            let curl = |args: Vec<String>| async move {
                let out = tokio::process::Command::new("curl")
                    .args(["-sS", "--max-time", "10", "--noproxy", ""])
                    .args(&args)
                    .env_remove("http_proxy")
                    .env_remove("https_proxy")
                    .env_remove("HTTPS_PROXY")
                    .env_remove("ALL_PROXY")
                    .env_remove("all_proxy")
                    .env_remove("NO_PROXY")
                    .env_remove("no_proxy")
                    .output()
                    .await
                    .expect("run curl");
                (
                    out.status.code(),
                    String::from_utf8_lossy(&out.stdout).into_owned(),
                )
            };
            let px = format!("http://127.0.0.1:{}", tcp.port());
            let user = format!("sess:{pa}");
            let (rc, out) = curl(vec![
                "-x".into(),
                px.clone(),
                "-U".into(),
                user.clone(),
                url("/ok-curl-abs"),
            ])
            .await;
            assert_eq!(rc, Some(0), "{out}");
            assert!(out.contains("srv4 GET /ok-curl-abs"), "{out}");
            expected.insert("/ok-curl-abs".into());
            let (rc, out) = curl(vec![
                "-p".into(),
                "-x".into(),
                px.clone(),
                "-U".into(),
                user.clone(),
                url("/ok-curl-tunnel"),
            ])
            .await;
            assert_eq!(rc, Some(0), "{out}");
            assert!(out.contains("/ok-curl-tunnel"), "{out}");
            expected.insert("/ok-curl-tunnel".into());
            let socks = format!("127.0.0.1:{}", tcp.port());
            let (rc, out) = curl(vec![
                "--socks5-hostname".into(),
                socks,
                "-U".into(),
                user.clone(),
                url("/ok-curl-socks"),
            ])
            .await;
            assert_eq!(rc, Some(0), "{out}");
            assert!(out.contains("/ok-curl-socks"), "{out}");
            expected.insert("/ok-curl-socks".into());
            let (rc, _) = curl(vec![
                "-p".into(),
                "-x".into(),
                px.clone(),
                "-U".into(),
                user.clone(),
                "http://other.test:8080/REFUSED-curl".into(),
            ])
            .await;
            assert_ne!(rc, Some(0), "a refused tunnel fails curl");
            let (_, out) = curl(vec![
                "-x".into(),
                px.clone(),
                "-w".into(),
                "%{http_code}".into(),
                "http://allowed.test:8080/REFUSED-curl-nocred".into(),
            ])
            .await;
            assert!(out.ends_with("407"), "{out}");
        } else {
            eprintln!("curl not installed: real-client checks skipped");
        }

        // Per-session cap, on its own proxy: two tunnels held open, the
        // third is refused (HTTP 429, SOCKS general failure), then freed.
        let capped = EgressProxy::new(
            EgressDialer::new(AddressGuard::new(), None, NoProxy::default()),
            ProxyConfig {
                max_connections_per_session: 2,
                ..ProxyConfig::default()
            },
        );
        let cdir = tempfile::tempdir().expect("tempdir");
        let csock = cdir.path().join("capped.sock");
        let cl = tokio::net::UnixListener::bind(&csock).expect("bind");
        let p = capped.clone();
        tokio::spawn(async move { p.serve_unix(cl).await });
        let cvia = Via::Unix(csock);
        let k = capped
            .issue("kappa", list(&["allowed.test"]))
            .expect("issue");
        let ak = basic(&k);
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = open(&cvia).await;
            s.write_all(format!("CONNECT allowed.test:8080 HTTP/1.1\r\n{ak}\r\n").as_bytes())
                .await
                .expect("write");
            let h = read_head(&mut s).await;
            assert!(h.starts_with("HTTP/1.1 200"), "{h}");
            held.push(s);
        }
        let (h, _) = connect_get(&cvia, "allowed.test:8080", &ak, "/REFUSED-cap").await;
        assert!(h.starts_with("HTTP/1.1 429"), "{h}");
        assert!(
            h.to_ascii_lowercase()
                .contains("x-proxy-error: connection-limit"),
            "{h}"
        );
        let (code, _) = socks_get(
            &cvia,
            k.expose(),
            1,
            &name("allowed.test"),
            "/REFUSED-cap-socks",
        )
        .await;
        assert_eq!(code, 0x01);
        // Finish the held tunnels (each sends a request the server logs).
        for (i, mut s) in held.into_iter().enumerate() {
            let path = format!("/ok-held-{i}");
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .expect("GET");
            assert!(read_all(&mut s).await.contains(&path));
            expected.insert(path);
        }
        let deadline = Instant::now() + T;
        loop {
            let (h, _) = connect_get(&cvia, "allowed.test:8080", &ak, "/ok-after-cap").await;
            if h.starts_with("HTTP/1.1 200") {
                expected.insert("/ok-after-cap".into());
                break;
            }
            assert!(Instant::now() < deadline, "slots never freed: {h}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // The servers saw exactly the allowed requests, and the decoys none.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let seen = log.lock().unwrap().clone();
        for (label, line) in &seen {
            assert!(!label.starts_with("DECOY"), "{label} got {line}");
            assert!(
                !line.contains("REFUSED"),
                "{label} got a refused request: {line}"
            );
        }
        let paths: BTreeSet<String> = seen
            .iter()
            .filter_map(|(_, l)| l.split_whitespace().nth(1).map(str::to_owned))
            .collect();
        assert_eq!(paths, expected);
        assert_eq!(
            seen.len(),
            expected.len(),
            "one connection per allowed request: {seen:?}"
        );
    });
    drop(holder);
    println!("{INNER_OK}");
}
