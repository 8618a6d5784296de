//! The egress proxy's interception of the API hosts, through its real
//! network faces: a guest-side client (rustls, trusting only the helper's
//! CA) talks through the proxy to a loopback TLS upstream of the test
//! (`support::tls_upstream`), reached through a stand-in for the user's
//! `HTTPS_PROXY`, which records what arrives. Placeholder in, real
//! credential out, and nothing else changed or let through.

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use cowork_helper::egress::secrets::{Carrier, RealSecret, SecretCell, Substituter};
use cowork_helper::egress::{Credential, EgressProxy, Policy};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use rustls::pki_types::CertificateDer;
use support::tls_upstream::{
    forwarder, helper_proxy, pem_certs, read_head, roots_of, test_ca, upstream, Upstream, API,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bound for anything that should take milliseconds.
const T: Duration = Duration::from_secs(10);
const REAL: &str = "sk-ant-oat01-THE-REAL-TOKEN-0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz0123";

/// Serves `proxy` on a loopback port.
async fn serve(proxy: EgressProxy) -> (EgressProxy, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let p = proxy.clone();
    tokio::spawn(async move { p.serve_tcp(listener).await });
    (proxy, addr)
}

fn basic(cred: &Credential) -> String {
    base64::engine::general_purpose::STANDARD.encode(format!("s:{}", cred.expose()))
}

/// [`support::tls_upstream::guest`] for spawn `cred`.
async fn guest_as(
    proxy: SocketAddr,
    cred: &Credential,
    target: &str,
    sni: &str,
    ca: &CertificateDer<'static>,
) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, String> {
    support::tls_upstream::guest(proxy, &basic(cred), target, sni, ca).await
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
    pem_certs(proxy.ca_pem().expect("interception is on by default"))
        .pop()
        .expect("one certificate")
}

struct Rig {
    up: Upstream,
    proxy: EgressProxy,
    addr: SocketAddr,
    forwarded: Arc<Mutex<Vec<String>>>,
    cell: SecretCell,
}

async fn rig(h2: bool) -> Rig {
    let up = upstream(h2).await;
    let (fwd, forwarded) = forwarder(up.addr).await;
    let (proxy, addr) = serve(helper_proxy(fwd, roots_of(&up.ca))).await;
    let cell = SecretCell::new(RealSecret::new(REAL.to_string()).unwrap());
    Rig {
        up,
        proxy,
        addr,
        forwarded,
        cell,
    }
}

/// Sends `req` once the connection is ready (it may still be finishing the
/// previous exchange).
async fn send(
    g: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    req: Request<Full<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, hyper::Error> {
    g.ready().await?;
    g.send_request(req).await
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
        let mut g = guest_as(r.addr, &cred, "api.anthropic.com:443", API, &ca)
            .await
            .unwrap();
        let bearer = format!("Bearer {ph}");
        let resp = tokio::time::timeout(
            T,
            send(
                &mut g,
                request(
                    &format!("/v1/messages?echo={ph}"),
                    &[
                        ("authorization", &bearer),
                        ("x-echo", &ph),
                        ("anthropic-beta", "oauth-2025-04-20"),
                    ],
                    &format!("{{\"content\":\"{ph}\"}}"),
                ),
            ),
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
        assert_eq!(*r.forwarded.lock().unwrap(), ["api.anthropic.com:443"]);

        // A refreshed token (addApprovedOauthToken) is used from the next request on.
        r.cell
            .set(RealSecret::new("sk-ant-oat01-REFRESHED".into()).unwrap());
        let resp = send(
            &mut g,
            request("/v1/messages", &[("authorization", &bearer)], "{}"),
        )
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
    let mut g = guest_as(r.addr, &cred, "api.anthropic.com:443", API, &ca)
        .await
        .unwrap();
    for auth in [
        format!("Bearer {other_ph}"),
        "Bearer sk-ant-api03-attackers-own".to_string(),
    ] {
        let resp = send(
            &mut g,
            request("/v1/files", &[("authorization", &auth)], "x"),
        )
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
    let resp = send(
        &mut g,
        request("/api/oauth/claude_cli/create_api_key", &[], ""),
    )
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
    let e = guest_as(r.addr, &cred, "api.anthropic.com:443", "other.example", &ca)
        .await
        .err();
    assert!(e.is_some(), "a mismatched SNI must not get a handshake");
    // Host for another name on the API tunnel: 421.
    let mut g = guest_as(r.addr, &cred, "api.anthropic.com:443", API, &ca)
        .await
        .unwrap();
    let mut req = request(
        "/v1/messages",
        &[("authorization", &format!("Bearer {ph}"))],
        "{}",
    );
    req.headers_mut()
        .insert("host", "other.example".parse().unwrap());
    let resp = send(&mut g, req).await.unwrap();
    assert_eq!(resp.status(), 421);
    assert!(r.up.seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn other_hosts_stay_end_to_end_and_keep_the_placeholder() {
    let r = rig(false).await;
    let (cred, ph) = spawn_credential(&r.proxy, &r.cell);
    // The guest verifies other.example against the upstream's own CA: no
    // interception there.
    let mut g = guest_as(
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
    let resp = send(&mut g, req).await.unwrap();
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
        guest_as(r.addr, &cred, "other.example:443", "other.example", &ca)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn an_untrusted_upstream_is_refused_not_bypassed() {
    let up = upstream(false).await;
    let (corporate, _) = forwarder(up.addr).await;
    // The helper trusts some other CA, not the upstream's.
    let (_, unrelated) = test_ca();
    let (proxy, addr) = serve(helper_proxy(corporate, roots_of(unrelated.der()))).await;
    let cell = SecretCell::new(RealSecret::new(REAL.to_string()).unwrap());
    let (cred, ph) = spawn_credential(&proxy, &cell);
    let ca = helper_ca(&proxy);
    let mut g = guest_as(addr, &cred, "api.anthropic.com:443", API, &ca)
        .await
        .unwrap();
    let resp = send(
        &mut g,
        request(
            "/v1/messages",
            &[("authorization", &format!("Bearer {ph}"))],
            "{}",
        ),
    )
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
    let mut g = guest_as(r.addr, &cred, "api.anthropic.com:443", API, &ca)
        .await
        .unwrap();
    let resp = send(
        &mut g,
        request(
            "/stream",
            &[("authorization", &format!("Bearer {ph}"))],
            "{}",
        ),
    )
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
    let e = guest_as(r.addr, &cred, "other.example:443", API, &r.up.ca)
        .await
        .err();
    assert!(
        e.is_some(),
        "a relayed tunnel naming the API host in its SNI must not work"
    );
    // Another port of the API host: refused at CONNECT.
    let head = guest_as(r.addr, &cred, "api.anthropic.com:80", API, &r.up.ca)
        .await
        .err()
        .unwrap();
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert!(r.up.seen.lock().unwrap().is_empty());
    assert!(
        !r.forwarded
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
    let (corporate, _) = forwarder(server).await;
    let (_, unrelated) = test_ca();
    let (proxy, addr) = serve(helper_proxy(corporate, roots_of(unrelated.der()))).await;
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
