//! Capture tests. Each runs in a network namespace of its own, so the
//! machine running them is never touched: a dedicated thread that
//! `unshare(CLONE_NEWNET)`s (network namespaces are per thread, and the
//! sockets, netlink requests and `/proc/thread-self/ns/net` of that thread
//! all see the new one), or, for the user-namespace case, the test binary
//! re-run under `unshare --user --map-root-user --net`.

use super::*;
use std::future::Future;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bound on every wait in these tests (all traffic is on loopback).
const WAIT: Duration = Duration::from_secs(5);

/// How long a connection that must NOT be captured is given to show up.
const NOT_CAPTURED_WAIT: Duration = Duration::from_millis(300);

/// Set in the re-run test binary: it runs inside its namespaces.
const IN_USERNS_ENV: &str = "GUEST_AGENT_CAPTURE_IN_USERNS";

/// Whether this process may create network namespaces; says why not.
fn root_or_skip() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipping: creating a network namespace needs root");
    }
    root
}

/// Runs `body` on a current-thread runtime in a thread with a fresh network
/// namespace whose lo is up; a panic in it fails the test.
fn in_fresh_netns<F, Fut>(body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let thread = std::thread::spawn(move || {
        // SAFETY: unshare of this thread's network namespace only.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            panic!("unshare(CLONE_NEWNET): {}", io::Error::last_os_error());
        }
        crate::agent::init::loopback_up().expect("lo up");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(body());
    });
    if let Err(panic) = thread.join() {
        std::panic::resume_unwind(panic);
    }
}

/// Connects to `dst`, sends `ping`, expects `pong`; returns the client's
/// local address.
async fn client(dst: SocketAddrV4) -> SocketAddr {
    let mut s = tokio::time::timeout(WAIT, TcpStream::connect(dst))
        .await
        .expect("connect in time")
        .unwrap_or_else(|e| panic!("connect {dst}: {e}"));
    s.write_all(b"ping").await.unwrap();
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"pong");
    s.local_addr().unwrap()
}

/// Accepts one captured connection, checks it came for `dst` and moves
/// bytes both ways.
async fn expect_captured(cap: &Capture, dst: SocketAddrV4) {
    let client = tokio::spawn(client(dst));
    let mut c = tokio::time::timeout(WAIT, cap.accept())
        .await
        .unwrap_or_else(|_| panic!("{dst} was not captured"))
        .unwrap();
    assert_eq!(c.original_dst, dst);
    let mut buf = [0u8; 4];
    c.stream.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"ping");
    c.stream.write_all(b"pong").await.unwrap();
    let client_addr = client.await.unwrap();
    assert_eq!(c.peer, client_addr);
    // The kernel used the local route's address as the source.
    assert_eq!(c.peer.ip(), std::net::IpAddr::V4(*dst.ip()));
}

/// A connected UDP socket to `dst` gets nothing back but an error: no
/// socket receives the datagram, ICMP says port unreachable.
async fn udp_goes_nowhere(dst: SocketAddrV4) {
    let udp = tokio::net::UdpSocket::bind("0.0.0.0:0").await.unwrap();
    udp.connect(dst).await.unwrap();
    udp.send(b"\x12\x34 not carried").await.unwrap();
    let mut buf = [0u8; 64];
    match tokio::time::timeout(NOT_CAPTURED_WAIT, udp.recv(&mut buf)).await {
        Err(_) => {}
        Ok(Err(e)) => assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED), "{e}"),
        Ok(Ok(n)) => panic!("UDP to {dst} got {n} bytes back"),
    }
}

/// A loopback listener keeps its connections; the capture sees none.
async fn loopback_is_not_captured(cap: &Capture) {
    let normal = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let SocketAddr::V4(addr) = normal.local_addr().unwrap() else {
        unreachable!("bound an IPv4 address")
    };
    let connect = tokio::spawn(TcpStream::connect(addr));
    let (_, peer) = tokio::time::timeout(WAIT, normal.accept())
        .await
        .unwrap()
        .unwrap();
    assert!(peer.ip().is_loopback());
    connect.await.unwrap().unwrap();
    assert!(
        tokio::time::timeout(NOT_CAPTURED_WAIT, cap.accept())
            .await
            .is_err(),
        "a loopback connection was captured"
    );
}

#[test]
fn sk_lookup_captures_every_port_of_every_non_loopback_address() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(|| async {
        let cap = install().unwrap();
        assert_eq!(
            cap.mode(),
            CaptureMode::SkLookup,
            "this kernel runs sk_lookup"
        );
        assert_eq!(cap.ports(), None);
        for dst in [
            "198.18.0.7:443",
            "10.9.8.7:5432",
            "203.0.113.5:1",
            "198.19.255.254:65535",
        ] {
            expect_captured(&cap, dst.parse().unwrap()).await;
        }
        // Even a port some local service listens on, on every address.
        let local_service = TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = local_service.local_addr().unwrap().port();
        expect_captured(&cap, SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), port)).await;
        loopback_is_not_captured(&cap).await;
        udp_goes_nowhere("10.1.2.3:53".parse().unwrap()).await;
        // IPv6: no route, so no way out at all.
        let v6 = TcpStream::connect("[2001:db8::1]:443").await;
        assert!(v6.is_err(), "IPv6 connect succeeded");
        // Installing again (route replaced, a second program) still works,
        // and dropping the capture detaches its program: connections are
        // then refused, not leaked.
        let again = install().unwrap();
        drop(cap);
        expect_captured(&again, "198.18.0.9:80".parse().unwrap()).await;
        drop(again);
        let refused = TcpStream::connect("198.18.0.9:80").await.unwrap_err();
        assert_eq!(
            refused.raw_os_error(),
            Some(libc::ECONNREFUSED),
            "{refused}"
        );
    });
}

/// The fixed-port fallback, as the sandbox's user namespace gets it.
async fn fixed_ports_behaviour(cap: Capture) {
    assert_eq!(cap.mode(), CaptureMode::FixedPorts);
    assert_eq!(cap.ports(), Some(FALLBACK_PORTS.to_vec()));
    // A loopback client of a captured port is closed and skipped: the next
    // connection returned is the real one.
    let mut lo = TcpStream::connect("127.0.0.1:443").await.unwrap();
    expect_captured(&cap, "198.18.0.7:443".parse().unwrap()).await;
    let mut buf = [0u8; 1];
    let n = tokio::time::timeout(WAIT, lo.read(&mut buf)).await.unwrap();
    assert!(matches!(n, Ok(0) | Err(_)), "loopback client was served");
    expect_captured(&cap, "10.9.8.7:22".parse().unwrap()).await;
    // Other ports are refused.
    let refused = TcpStream::connect("10.9.8.7:5432").await.unwrap_err();
    assert_eq!(
        refused.raw_os_error(),
        Some(libc::ECONNREFUSED),
        "{refused}"
    );
    udp_goes_nowhere("10.1.2.3:53".parse().unwrap()).await;
}

#[test]
fn fixed_ports_capture_only_their_ports() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(|| async {
        // One fallback port already taken: the others are still used.
        let taken = TcpListener::bind("0.0.0.0:9418").await.unwrap();
        let cap = install_with(Steering::FixedPortsOnly).unwrap();
        let ports = cap.ports().unwrap();
        assert!(!ports.contains(&9418), "{ports:?}");
        assert_eq!(ports.len(), FALLBACK_PORTS.len() - 1);
        drop((cap, taken));
        fixed_ports_behaviour(install_with(Steering::FixedPortsOnly).unwrap()).await;
    });
}

#[test]
fn install_outside_a_runtime_is_an_error_not_a_panic() {
    let err = install().unwrap_err();
    assert!(matches!(err, CaptureError::Runtime(_)), "{err}");
}

/// In a user namespace (the sandbox backend's case) BPF is refused and the
/// capture falls back to fixed ports by itself.
#[test]
fn in_a_user_namespace_the_capture_falls_back_to_fixed_ports() {
    let name = "egress::capture::tests::in_a_user_namespace_the_capture_falls_back_to_fixed_ports";
    if std::env::var_os(IN_USERNS_ENV).is_some() {
        crate::agent::init::loopback_up().expect("lo up");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async { fixed_ports_behaviour(install().unwrap()).await });
        return;
    }
    let out = std::process::Command::new("unshare")
        .args(["--user", "--map-root-user", "--net", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(IN_USERNS_ENV, "1")
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            eprintln!("skipping: cannot run unshare(1): {e}");
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.starts_with("unshare:") {
        eprintln!("skipping: no user namespaces here: {stderr}");
        return;
    }
    assert!(
        out.status.success(),
        "failed in a user namespace:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("1 passed"),
        "did not run:\n{stdout}\n{stderr}"
    );
}

#[test]
fn the_capture_types_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Capture>();
    send::<Captured>();
    send_sync::<CaptureError>();
    send_sync::<crate::egress::dns::DnsError>();
    send_sync::<crate::egress::fake::FakePool>();
}
