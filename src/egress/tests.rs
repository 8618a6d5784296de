//! In-process tests of the proxy faces over in-memory streams. Forwarding
//! targets are loopback servers, reachable here only through the test-only
//! guard; the production guard is exercised in `tests/egress_*.rs`.

use std::net::SocketAddr;
use std::time::Duration;

use base64::Engine as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::TcpListener;

use super::*;

/// Bound for anything that should take milliseconds.
const T: Duration = Duration::from_secs(10);

/// Handshake deadline of the test proxies (production: [`HANDSHAKE_TIMEOUT`]).
const SHORT: Duration = Duration::from_millis(300);

fn permissive(cap: usize) -> EgressProxy {
    let guard = AddressGuard::allowing_networks_for_tests(&[("127.0.0.0".parse().unwrap(), 8)]);
    EgressProxy::new(
        EgressDialer::new(guard, None, NoProxy::default()),
        ProxyConfig {
            max_connections_per_session: cap,
            handshake_timeout: SHORT,
            ..ProxyConfig::default()
        },
    )
}

fn list(entries: &[&str]) -> Policy {
    let v: Vec<String> = entries.iter().map(|s| s.to_string()).collect();
    Policy::try_from_allowed_domains(Some(&v)).unwrap()
}

fn client(
    proxy: &EgressProxy,
) -> (
    DuplexStream,
    tokio::task::JoinHandle<Result<(), EgressError>>,
) {
    let (a, b) = tokio::io::duplex(1 << 16);
    let p = proxy.clone();
    (a, tokio::spawn(async move { p.serve_stream(b).await }))
}

fn basic(cred: &Credential) -> String {
    let enc = base64::engine::general_purpose::STANDARD.encode(format!("s:{}", cred.expose()));
    format!("Proxy-Authorization: Basic {enc}\r\n")
}

/// Sends `request` to `proxy` on a new stream and returns the reply's head.
async fn ask(proxy: &EgressProxy, request: &[u8]) -> String {
    let (mut c, _) = client(proxy);
    c.write_all(request).await.unwrap();
    head(&mut c).await
}

/// Reads a response head (through the blank line).
async fn head(s: &mut DuplexStream) -> String {
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(T, s.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
        got.push(b[0]);
    }
    String::from_utf8(got).unwrap()
}

/// A loopback echo server that counts its connections.
async fn echo_server() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    (addr, count)
}

#[tokio::test]
async fn origin_form_is_400_and_missing_or_revoked_credential_is_407() {
    let proxy = permissive(8);
    assert!(ask(
        &proxy,
        b"GET /index.html HTTP/1.1\r\nHost: a.example\r\n\r\n"
    )
    .await
    .starts_with("HTTP/1.1 400"));

    let h = ask(
        &proxy,
        b"CONNECT a.example:443 HTTP/1.1\r\nHost: a.example:443\r\n\r\n",
    )
    .await;
    assert!(h.starts_with("HTTP/1.1 407"), "{h}");
    assert!(
        h.to_ascii_lowercase()
            .contains("proxy-authenticate: basic realm=\"cowork\""),
        "{h}"
    );

    let cred = proxy.issue("s", Policy::Unrestricted).unwrap();
    assert!(proxy.revoke(&cred));
    assert!(ask(
        &proxy,
        format!("GET http://a.example/ HTTP/1.1\r\n{}\r\n", basic(&cred)).as_bytes()
    )
    .await
    .starts_with("HTTP/1.1 407"));

    // garbage credentials
    for auth in ["Basic !!!", "Bearer abc", "Basic", "Basic Og=="] {
        assert!(
            ask(
                &proxy,
                format!("CONNECT a.example:443 HTTP/1.1\r\nProxy-Authorization: {auth}\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .starts_with("HTTP/1.1 407"),
            "{auth}"
        );
    }
}

#[tokio::test]
async fn refusals_are_403_with_the_header_and_never_dial() {
    let (addr, count) = echo_server().await;
    let proxy = permissive(8);
    let cred = proxy.issue("s", list(&["allowed.example"])).unwrap();
    for target in [
        format!("CONNECT 127.0.0.1:{} HTTP/1.1\r\n", addr.port()),
        format!("GET http://127.0.0.1:{}/ HTTP/1.1\r\n", addr.port()),
        "CONNECT other.example:443 HTTP/1.1\r\n".to_string(),
        "GET http://other.example/ HTTP/1.1\r\nHost: allowed.example\r\n".to_string(),
    ] {
        let h = ask(&proxy, format!("{target}{}\r\n", basic(&cred)).as_bytes()).await;
        assert!(h.starts_with("HTTP/1.1 403"), "{target}: {h}");
        assert!(
            h.to_ascii_lowercase()
                .contains("x-proxy-error: blocked-by-allowlist"),
            "{h}"
        );
    }
    // a malformed CONNECT target
    for target in [
        "a.example:443@allowed.example",
        "allowed.example",
        "allowed.example:0",
    ] {
        let h = ask(
            &proxy,
            format!("CONNECT {target} HTTP/1.1\r\n{}\r\n", basic(&cred)).as_bytes(),
        )
        .await;
        assert!(h.starts_with("HTTP/1.1 400"), "{target}: {h}");
    }
    assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn connect_relays_both_ways_with_half_close() {
    let (addr, count) = echo_server().await;
    let proxy = permissive(8);
    let cred = proxy
        .issue("s", list(&[&format!("127.0.0.1:{}", addr.port())]))
        .unwrap();
    let (mut c, _) = client(&proxy);
    c.write_all(
        format!(
            "CONNECT 127.0.0.1:{} HTTP/1.1\r\n{}\r\n",
            addr.port(),
            basic(&cred)
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let h = head(&mut c).await;
    assert!(h.starts_with("HTTP/1.1 200"), "{h}");
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let (mut r, mut w) = tokio::io::split(c);
    let p2 = payload.clone();
    let writer = tokio::spawn(async move {
        w.write_all(&p2).await.unwrap();
        w.shutdown().await.unwrap(); // half-close: the echo ends after this
    });
    let mut back = Vec::new();
    tokio::time::timeout(T, r.read_to_end(&mut back))
        .await
        .unwrap()
        .unwrap();
    writer.await.unwrap();
    assert_eq!(back, payload);
    assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn absolute_form_goes_to_the_uri_authority_with_host_rewritten() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.ends_with(b"\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
        }
        s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
            .await
            .unwrap();
        String::from_utf8(got).unwrap()
    });
    let proxy = permissive(8);
    let cred = proxy.issue("s", list(&["127.0.0.1"])).unwrap();
    let (mut c, _) = client(&proxy);
    c.write_all(
        format!(
            "GET http://127.0.0.1:{port}/p?q=1 HTTP/1.1\r\nHost: evil.example\r\nX-Keep: yes\r\n{}\r\n",
            basic(&cred)
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let h = head(&mut c).await;
    assert!(h.starts_with("HTTP/1.1 200"), "{h}");
    let mut body = [0u8; 5];
    c.read_exact(&mut body).await.unwrap();
    assert_eq!(&body, b"hello");
    let seen = server.await.unwrap().to_ascii_lowercase();
    assert!(seen.starts_with("get /p?q=1 http/1.1\r\n"), "{seen}");
    assert!(
        seen.contains(&format!("host: 127.0.0.1:{port}\r\n")),
        "{seen}"
    );
    assert!(!seen.contains("evil.example"), "{seen}");
    assert!(!seen.contains("proxy-authorization"), "{seen}");
    assert!(seen.contains("x-keep: yes"), "{seen}");
}

async fn socks_auth(c: &mut DuplexStream, pass: &[u8]) -> [u8; 2] {
    c.write_all(&[5, 1, 2]).await.unwrap();
    let mut m = [0u8; 2];
    c.read_exact(&mut m).await.unwrap();
    assert_eq!(m, [5, 2]);
    let mut a = vec![1, 1, b's', pass.len() as u8];
    a.extend_from_slice(pass);
    c.write_all(&a).await.unwrap();
    let mut r = [0u8; 2];
    c.read_exact(&mut r).await.unwrap();
    r
}

async fn socks_reply(c: &mut DuplexStream) -> u8 {
    let mut r = [0u8; 10];
    tokio::time::timeout(T, c.read_exact(&mut r))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r[0], 5);
    r[1]
}

#[tokio::test]
async fn socks5_faces() {
    let (addr, count) = echo_server().await;
    let proxy = permissive(8);
    let cred = proxy.issue("s", list(&["127.0.0.1"])).unwrap();

    // no username/password method offered
    let (mut c, _) = client(&proxy);
    c.write_all(&[5, 1, 0]).await.unwrap();
    let mut m = [0u8; 2];
    c.read_exact(&mut m).await.unwrap();
    assert_eq!(m, [5, 0xff]);

    // wrong password
    let (mut c, _) = client(&proxy);
    assert_eq!(socks_auth(&mut c, b"nope").await, [1, 1]);

    // UDP ASSOCIATE and BIND
    for cmd in [3u8, 2] {
        let (mut c, _) = client(&proxy);
        assert_eq!(socks_auth(&mut c, cred.expose().as_bytes()).await, [1, 0]);
        c.write_all(&[5, cmd, 0, 1, 127, 0, 0, 1, 0, 53])
            .await
            .unwrap();
        assert_eq!(socks_reply(&mut c).await, 0x07);
    }

    // unlisted name: 0x02
    let (mut c, _) = client(&proxy);
    assert_eq!(socks_auth(&mut c, cred.expose().as_bytes()).await, [1, 0]);
    let mut req = vec![5, 1, 0, 3, 13];
    req.extend_from_slice(b"other.example");
    req.extend_from_slice(&addr.port().to_be_bytes());
    c.write_all(&req).await.unwrap();
    assert_eq!(socks_reply(&mut c).await, 0x02);
    assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 0);

    // listed literal: relayed
    let (mut c, _) = client(&proxy);
    assert_eq!(socks_auth(&mut c, cred.expose().as_bytes()).await, [1, 0]);
    let mut req = vec![5, 1, 0, 1, 127, 0, 0, 1];
    req.extend_from_slice(&addr.port().to_be_bytes());
    c.write_all(&req).await.unwrap();
    assert_eq!(socks_reply(&mut c).await, 0x00);
    c.write_all(b"ping").await.unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"ping");
    assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn per_session_cap_refuses_clearly() {
    let (addr, _) = echo_server().await;
    let proxy = permissive(1);
    let cred = proxy.issue("s", Policy::Unrestricted).unwrap();
    let connect = format!(
        "CONNECT 127.0.0.1:{} HTTP/1.1\r\n{}\r\n",
        addr.port(),
        basic(&cred)
    );
    let (mut c1, _) = client(&proxy);
    c1.write_all(connect.as_bytes()).await.unwrap();
    assert!(head(&mut c1).await.starts_with("HTTP/1.1 200"));
    let (mut c2, _) = client(&proxy);
    c2.write_all(connect.as_bytes()).await.unwrap();
    let h = head(&mut c2).await;
    assert!(h.starts_with("HTTP/1.1 429"), "{h}");
    assert!(h
        .to_ascii_lowercase()
        .contains("x-proxy-error: connection-limit"));
    // closing the first tunnel frees the slot
    drop(c1);
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let (mut c3, _) = client(&proxy);
        c3.write_all(connect.as_bytes()).await.unwrap();
        if head(&mut c3).await.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "slot never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn arbitrary_input_never_panics() {
    let proxy = permissive(4);
    let cred = proxy.issue("s", list(&["allowed.example"])).unwrap();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let prefixes: Vec<Vec<u8>> = vec![
        vec![5],
        vec![5, 1, 2, 1],
        b"CONNECT ".to_vec(),
        b"GET http://".to_vec(),
        vec![4],
        vec![],
    ];
    for i in 0..300 {
        let mut input = prefixes[i % prefixes.len()].clone();
        let len = (next() % 200) as usize;
        input.extend((0..len).map(|_| next() as u8));
        if i % 7 == 0 {
            input.extend_from_slice(basic(&cred).as_bytes());
            input.extend_from_slice(b"\r\n");
        }
        let (mut c, task) = client(&proxy);
        let _ = c.write_all(&input).await;
        let _ = c.shutdown().await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(T, c.read_to_end(&mut sink)).await;
        drop(c);
        let joined = tokio::time::timeout(T, task)
            .await
            .expect("serve_stream returns");
        assert!(joined.is_ok(), "serve_stream panicked on {input:?}");
    }
}

#[test]
fn proxy_url_shape() {
    let cred = Credential::generate().unwrap();
    let url = proxy_url("my session/1", &cred, GUEST_PROXY_PORT);
    assert_eq!(
        url,
        format!("http://my%20session%2F1:{}@127.0.0.1:3128", cred.expose())
    );
}

#[test]
fn proxy_env_covers_every_spelling() {
    let env = proxy_env("http://s:c@127.0.0.1:3128");
    let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
    for k in [
        "HTTPS_PROXY",
        "https_proxy",
        "HTTP_PROXY",
        "http_proxy",
        "ALL_PROXY",
        "all_proxy",
    ] {
        assert_eq!(get(k), Some("http://s:c@127.0.0.1:3128"), "{k}");
    }
    assert_eq!(get("no_proxy"), Some("localhost,127.0.0.1,::1"));
    assert_eq!(get("NODE_USE_ENV_PROXY"), Some("1"));
    assert_eq!(get("GIT_CONFIG_KEY_0"), Some("http.proxyAuthMethod"));
    assert_eq!(get("GIT_CONFIG_VALUE_0"), Some("basic"));
}

#[tokio::test]
async fn stalled_handshakes_are_dropped() {
    let proxy = permissive(4);
    let cred = proxy.issue("s", Policy::Unrestricted).unwrap();
    let stalls: Vec<Vec<u8>> = vec![
        vec![],                                         // nothing at all
        b"CONNECT a.example:443 HTTP/1.1\r\n".to_vec(), // head never ends
        vec![5],                                        // SOCKS greeting cut short
        vec![5, 1, 2, 1, 1, b's'],                      // SOCKS auth cut short
    ];
    for (i, bytes) in stalls.into_iter().enumerate() {
        let (mut c, task) = client(&proxy);
        c.write_all(&bytes).await.unwrap();
        let started = std::time::Instant::now();
        let mut sink = Vec::new();
        // The proxy closes (or answers and closes) on its own; we never
        // shut down our side.
        tokio::time::timeout(T, c.read_to_end(&mut sink))
            .await
            .unwrap_or_else(|_| panic!("stall {i} was never dropped"))
            .unwrap();
        assert!(started.elapsed() < T, "stall {i}");
        tokio::time::timeout(T, task).await.unwrap().unwrap().ok();
    }
    // a prompt client on the same proxy is unaffected
    let (addr, _) = echo_server().await;
    let (mut c, _) = client(&proxy);
    let auth = basic(&cred);
    c.write_all(format!("CONNECT {addr} HTTP/1.1\r\n{auth}\r\n").as_bytes())
        .await
        .unwrap();
    assert!(head(&mut c).await.starts_with("HTTP/1.1 200"));
}

#[test]
fn refusal_log_is_rate_limited() {
    let proxy = permissive(4);
    for _ in 0..(LOG_BURST * 3) {
        proxy
            .shared
            .log_refusal(Some("s"), "h.example", 443, "test");
    }
    let log = proxy.shared.log.lock().unwrap();
    assert_eq!(log.lines, LOG_BURST);
    assert_eq!(log.suppressed, u64::from(LOG_BURST * 2));
}

#[tokio::test]
async fn oversized_request_heads_are_refused() {
    let proxy = permissive(4);
    let (mut c, task) = client(&proxy);
    let big = "a".repeat(MAX_REQUEST_HEAD_BYTES * 2);
    let req = format!("CONNECT a.example:443 HTTP/1.1\r\nX-Big: {big}\r\n\r\n");
    // The proxy may stop reading before we finish writing.
    let _ = c.write_all(req.as_bytes()).await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(T, c.read_to_end(&mut got))
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 431"), "{text}");
    tokio::time::timeout(T, task).await.unwrap().unwrap().ok();
}
