//! The real Claude Code CLI completes a turn against the mock Anthropic API
//! (`support::mock_api`), without the helper: the groundwork of the test
//! that checks the egress proxy's credential swap end to end, which puts
//! the helper between the two.
//!
//! Each test re-runs this binary's inner test under `unshare --net --mount`
//! (namespace P, `support::netns`); the mock listens on 443 in a second
//! namespace S behind a veth pair, and P's bind-mounted `/etc/hosts` maps
//! `api.anthropic.com` to it. The CLI runs in P as `claude -p <prompt>` with
//! nothing of the test's environment but:
//!
//! - `CLAUDE_CODE_OAUTH_TOKEN` = `sk-ant-oat01-` and random URL-safe
//!   characters to 108 (the shape of a setup token), which the mock requires;
//! - `NODE_EXTRA_CA_CERTS` = the mock's test CA (the CLI's runtime, Bun,
//!   ignores `SSL_CERT_FILE`);
//! - `HOME` and the working directory: empty temporary directories;
//! - `PATH=/usr/bin:/bin`;
//! - `CLAUDE_CODE_MAX_RETRIES=0` and `API_TIMEOUT_MS`, so that a mock that
//!   cannot be reached or answers wrong fails the turn in seconds instead of
//!   minutes of retries (not needed for a turn to succeed).
//!
//! Nothing else keeps it offline: P has no route off the machine, and the CLI
//! asks for no name but `api.anthropic.com` (checked with a logging DNS
//! server when this test was written), so neither
//! `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC` nor `DISABLE_AUTOUPDATER` is
//! set: the mock sees everything a session's CLI sends.
//!
//! - `cli_turn_direct`: the CLI connects to the mock itself.
//! - `cli_turn_through_connect_proxy`: the CLI gets the proxy environment
//!   of a session (`egress::proxy_env`: `HTTPS_PROXY=http://<user>:<credential>@127.0.0.1:3128`
//!   and the rest) and a tiny CONNECT proxy of the test's listens there; it
//!   must send every request through a CONNECT to `api.anthropic.com:443`
//!   with that `Proxy-Authorization`, and the mock must see only connections
//!   from the proxy, each with SNI `api.anthropic.com`.
//! - `mock_api_self_check` (no CLI needed): the parts of the mock the CLI
//!   does not use: HTTP/2, a JSON message, a second name, `x-api-key`, the
//!   refusals, and a stream that arrives event by event.
//!
//! The CLI tests check that the CLI exits 0 and prints the mock's marker
//! text, and that the mock saw `/v1/messages` with `Authorization: Bearer
//! <the token>` and the `oauth-2025-04-20` beta, and no other credential
//! anywhere. They print what the CLI sent and how long it took (run with
//! `--nocapture`).
//!
//! Gate: root with `unshare`, `ip` and `nsenter` (else a skip, like the
//! egress tests); the CLI from `scripts/fetch-claude-cli.sh` (cached; a
//! loud skip where npm cannot be reached and nothing is cached, a failure
//! under `COWORK_QEMU_TESTS=1`). The binary needs a CPU with AVX2.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use support::claude_cli;
use support::mock_api::{MockApi, API_HOST, HTTPS_PORT, OAUTH_BETA};
use support::netns::{self, ServerNamespace, S_V4};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Printed by the inner run when all its assertions passed.
const INNER_OK: &str = "MOCK-API-CLI-INNER-CHECKS-PASSED";
/// Prefix of the inner run's report lines, which the outer test prints.
const REPORT: &str = "REPORT ";
/// The CLI binary, for the inner run.
const CLI_ENV: &str = "COWORK_MOCK_API_CLI";
/// The CLI's version, for the inner run's report.
const CLI_VERSION_ENV: &str = "COWORK_MOCK_API_CLI_VERSION";
/// How the inner run's CLI reaches the mock: [`DIRECT`] or [`VIA_PROXY`].
const ROUTE_ENV: &str = "COWORK_MOCK_API_CLI_ROUTE";
const DIRECT: &str = "direct";
const VIA_PROXY: &str = "connect-proxy";

/// The mock's answer; the CLI must print it.
const MARKER: &str = "COWORK-MOCK-API-MARKER-4f1d9c";
const PROMPT: &str = "Reply with the marker.";
/// Prefix and length of a Claude setup token (`claude setup-token`).
const TOKEN_PREFIX: &str = "sk-ant-oat01-";
const TOKEN_LEN: usize = 108;
/// URL-safe characters, 64 of them.
const URL_SAFE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
/// The CLI's request timeout (`API_TIMEOUT_MS`), in ms.
const CLI_API_TIMEOUT_MS: &str = "30000";
/// Limit for the whole CLI run (a turn takes about 2 s).
const CLI_LIMIT: Duration = Duration::from_secs(120);
/// The session proxy's port in the guest (the product's relay).
const PROXY_PORT: u16 = 3128;
/// The proxy user (the product uses the session name).
const PROXY_USER: &str = "mock-api-cli";
/// Largest request head the test's proxy reads.
const MAX_HEAD: usize = 16 << 10;
/// Bound for the proxy's request head and dial, and for each self-check
/// exchange.
const T: Duration = Duration::from_secs(20);
/// The mock's second name and answer in the self-check.
const OTHER_HOST: &str = "other-allowed.test";
const SELF_CHECK_REPLY: &str = "three streamed words";
/// Between the self-check's stream events, so that they arrive apart.
const SELF_CHECK_EVENT_GAP: Duration = Duration::from_millis(20);

/// The test's /etc/hosts (in P).
fn hosts() -> String {
    format!("127.0.0.1 localhost\n::1 localhost\n{S_V4} {API_HOST}\n")
}

#[test]
fn cli_turn_direct() {
    outer("cli_turn_direct", DIRECT);
}

#[test]
fn cli_turn_through_connect_proxy() {
    outer("cli_turn_through_connect_proxy", VIA_PROXY);
}

/// Fetches the CLI, re-runs the inner test in namespaces, prints its report.
fn outer(test: &str, route: &str) {
    if let Some(why) = netns::missing_tools() {
        support::nested::loud_notice(&format!("SKIPPED {test}: {why}"));
        return;
    }
    let Some(cli) = claude_cli::fetch_or_skip(test) else {
        return;
    };
    let out = netns::rerun_in_namespaces(
        "inner_cli_turn",
        &[
            (CLI_ENV, cli.path.to_str().expect("utf-8 path")),
            (CLI_VERSION_ENV, &cli.version),
            (ROUTE_ENV, route),
        ],
        INNER_OK,
    );
    // A report line may follow libtest's "test inner_cli_turn ... " on its line.
    for l in out
        .lines()
        .filter_map(|l| l.split_once(REPORT).map(|(_, r)| r))
    {
        eprintln!("{test}: {l}");
    }
}

#[test]
#[ignore = "run by cli_turn_direct and cli_turn_through_connect_proxy inside their namespaces"]
fn inner_cli_turn() {
    let cli = PathBuf::from(std::env::var(CLI_ENV).expect("the CLI's path"));
    let version = std::env::var(CLI_VERSION_ENV).unwrap_or_default();
    let via_proxy = match std::env::var(ROUTE_ENV).as_deref() {
        Ok(DIRECT) => false,
        Ok(VIA_PROXY) => true,
        other => panic!("{ROUTE_ENV} is {other:?}"),
    };
    let holder = ServerNamespace::create();
    let _hosts = netns::bind_hosts(&hosts());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let token = random_token();
        let mock = MockApi::builder()
            .reply_text(MARKER)
            .require_token(&token)
            .start(
                &holder,
                &[SocketAddr::new(S_V4.parse().expect("S_V4"), HTTPS_PORT)],
            );
        let home = tempfile::tempdir().expect("HOME");
        let work = tempfile::tempdir().expect("working directory");

        let mut cmd = tokio::process::Command::new(&cli);
        cmd.env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", home.path())
            .env("NODE_EXTRA_CA_CERTS", mock.ca_pem_path())
            .env("CLAUDE_CODE_OAUTH_TOKEN", &token)
            .env("CLAUDE_CODE_MAX_RETRIES", "0")
            .env("API_TIMEOUT_MS", CLI_API_TIMEOUT_MS)
            .args(["-p", PROMPT])
            .current_dir(work.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let proxy = if via_proxy {
            let proxy = ConnectProxy::start().await;
            cmd.envs(cowork_helper::egress::proxy_env(&proxy.url()));
            Some(proxy)
        } else {
            None
        };

        let t0 = Instant::now();
        let child = cmd.spawn().expect("start the CLI");
        let out = tokio::time::timeout(CLI_LIMIT, child.wait_with_output())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the CLI did not finish within {CLI_LIMIT:?}; the mock saw:\n{}",
                    mock.describe()
                )
            })
            .expect("wait for the CLI");
        let took = t0.elapsed();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let seen = || {
            format!(
                "exit {}\nstdout: {stdout}\nstderr: {stderr}\nthe mock saw:\n{}{}",
                out.status,
                mock.describe(),
                proxy.as_ref().map(|p| p.describe()).unwrap_or_default()
            )
        };

        // The report first, so a failure below still shows what was sent.
        let route = if via_proxy { VIA_PROXY } else { DIRECT };
        println!(
            "{REPORT}claude {version} ({route}): {} in {:.2} s",
            out.status,
            took.as_secs_f64()
        );
        for l in mock.describe().lines() {
            println!("{REPORT}{l}");
        }
        if let Some(p) = &proxy {
            for l in p.describe().lines() {
                println!("{REPORT}{l}");
            }
        }
        let unknown = mock.unknown_routes();
        if !unknown.is_empty() {
            println!("{REPORT}routes the mock does not know (answered 404): {unknown:?}");
        }

        assert!(out.status.success(), "the CLI failed: {}", seen());
        assert!(
            stdout.contains(MARKER),
            "the CLI did not print {MARKER}: {}",
            seen()
        );
        check_requests(&mock, &token, &seen);
        for c in mock.connections() {
            assert!(
                c.error.is_none() && c.sni.as_deref() == Some(API_HOST),
                "connection {c:?}: {}",
                seen()
            );
        }
        if let Some(p) = &proxy {
            check_tunnels(p, &mock, &seen);
        }
        println!("{INNER_OK}");
    });
}

/// `/v1/messages` came with the token as an OAuth Bearer, and no request
/// carried any other credential.
fn check_requests(mock: &MockApi, token: &str, seen: &dyn Fn() -> String) {
    let messages = mock.requests_to("/v1/messages");
    assert!(!messages.is_empty(), "no /v1/messages: {}", seen());
    for m in &messages {
        assert!(
            m.bearer() == Some(token)
                && m.has_beta(OAUTH_BETA)
                && m.header("anthropic-version").is_some()
                && m.status == 200,
            "/v1/messages without the token as an OAuth Bearer: {}\n{}",
            m.summary(),
            seen()
        );
    }
    for r in mock.requests() {
        let auth = r.headers_named("authorization");
        assert!(
            auth.iter()
                .all(|a| a.strip_prefix("Bearer ") == Some(token))
                && auth.len() <= 1
                && r.header("x-api-key").is_none(),
            "a request with another credential: {}\n{}",
            r.summary(),
            seen()
        );
    }
}

/// Every tunnel was a CONNECT to the API host with the session's proxy
/// credential, and every connection the mock got came through one.
fn check_tunnels(proxy: &ConnectProxy, mock: &MockApi, seen: &dyn Fn() -> String) {
    let tunnels = proxy.tunnels();
    assert!(!tunnels.is_empty(), "nothing used the proxy: {}", seen());
    for t in &tunnels {
        assert!(
            t.request_line == format!("CONNECT {API_HOST}:{HTTPS_PORT} HTTP/1.1")
                && t.proxy_authorization.as_deref() == Some(proxy.expected_auth.as_str())
                && t.status == 200,
            "tunnel {t:?}: {}",
            seen()
        );
    }
    let from_proxy: BTreeSet<SocketAddr> = tunnels.iter().filter_map(|t| t.upstream).collect();
    for c in mock.connections() {
        assert!(
            from_proxy.contains(&c.peer),
            "connection {} from {} bypassed the proxy: {}",
            c.id,
            c.peer,
            seen()
        );
    }
}

/// `sk-ant-oat01-` and random URL-safe characters, [`TOKEN_LEN`] in all.
fn random_token() -> String {
    let mut bytes = [0u8; TOKEN_LEN];
    getrandom::getrandom(&mut bytes).expect("random bytes");
    let tail: String = bytes[TOKEN_PREFIX.len()..]
        .iter()
        .map(|b| char::from(URL_SAFE[usize::from(b % 64)]))
        .collect();
    format!("{TOKEN_PREFIX}{tail}")
}

/// One CONNECT the test's proxy got.
#[derive(Clone, Debug)]
struct Tunnel {
    request_line: String,
    proxy_authorization: Option<String>,
    /// The proxy's own address on its connection to the target.
    upstream: Option<SocketAddr>,
    /// What the proxy answered.
    status: u16,
}

/// A tiny HTTP CONNECT proxy on 127.0.0.1:[`PROXY_PORT`] in P, standing in
/// for the session's relay to the helper: it requires its Basic credential,
/// dials the target by name (P's `/etc/hosts`) and relays bytes.
struct ConnectProxy {
    credential: String,
    expected_auth: String,
    tunnels: Arc<Mutex<Vec<Tunnel>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ConnectProxy {
    async fn start() -> ConnectProxy {
        let mut raw = [0u8; 16];
        getrandom::getrandom(&mut raw).expect("random bytes");
        let credential: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let expected_auth = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{PROXY_USER}:{credential}"))
        );
        let listener = TcpListener::bind(("127.0.0.1", PROXY_PORT))
            .await
            .expect("bind the proxy");
        let tunnels: Arc<Mutex<Vec<Tunnel>>> = Arc::default();
        let (log, auth) = (tunnels.clone(), expected_auth.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(tunnel(client, auth.clone(), log.clone()));
            }
        });
        ConnectProxy {
            credential,
            expected_auth,
            tunnels,
            task,
        }
    }

    /// The proxy URL, as a session's `HTTPS_PROXY` has it.
    fn url(&self) -> String {
        format!(
            "http://{PROXY_USER}:{}@127.0.0.1:{PROXY_PORT}",
            self.credential
        )
    }

    fn tunnels(&self) -> Vec<Tunnel> {
        self.tunnels.lock().expect("lock").clone()
    }

    /// One line per tunnel (the credential shown only as matching or not).
    fn describe(&self) -> String {
        self.tunnels()
            .iter()
            .map(|t| {
                let auth = match &t.proxy_authorization {
                    Some(a) if *a == self.expected_auth => "the session's Basic credential",
                    Some(_) => "ANOTHER credential",
                    None => "no Proxy-Authorization",
                };
                format!(
                    "proxy: {} with {auth} → {} (upstream from {:?})\n",
                    t.request_line, t.status, t.upstream
                )
            })
            .collect()
    }
}

impl Drop for ConnectProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves one proxy client.
async fn tunnel(mut client: TcpStream, expected_auth: String, log: Arc<Mutex<Vec<Tunnel>>>) {
    let Ok(Some(head)) = tokio::time::timeout(T, read_head(&mut client)).await else {
        return;
    };
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default().to_owned();
    let proxy_authorization = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("proxy-authorization"))
        .map(|(_, v)| v.trim().to_owned());
    let mut words = request_line.split_whitespace();
    let is_connect = words.next() == Some("CONNECT");
    let target = words.next().unwrap_or_default().to_owned();
    let mut record = Tunnel {
        request_line,
        proxy_authorization,
        upstream: None,
        status: 0,
    };
    let upstream = if !is_connect {
        Err((405, "Method Not Allowed"))
    } else if record.proxy_authorization.as_deref() != Some(expected_auth.as_str()) {
        Err((407, "Proxy Authentication Required"))
    } else {
        match tokio::time::timeout(T, TcpStream::connect(target.as_str())).await {
            Ok(Ok(s)) => Ok(s),
            _ => Err((502, "Bad Gateway")),
        }
    };
    match upstream {
        Ok(mut upstream) => {
            record.upstream = upstream.local_addr().ok();
            record.status = 200;
            log.lock().expect("lock").push(record);
            if client
                .write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                .await
                .is_ok()
            {
                let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
            }
        }
        Err((status, reason)) => {
            record.status = status;
            log.lock().expect("lock").push(record);
            let challenge = if status == 407 {
                "Proxy-Authenticate: Basic realm=\"test\"\r\n"
            } else {
                ""
            };
            let _ = client
                .write_all(
                    format!(
                        "HTTP/1.1 {status} {reason}\r\n{challenge}Content-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                    .as_bytes(),
                )
                .await;
        }
    }
}

/// The request head, read a byte at a time so nothing after it is taken.
async fn read_head(s: &mut TcpStream) -> Option<String> {
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        if got.len() > MAX_HEAD || s.read(&mut b).await.ok()? == 0 {
            return None;
        }
        got.push(b[0]);
    }
    String::from_utf8(got).ok()
}

/// The mock itself, as the credential-swap test's proxy will use it,
/// without the CLI: HTTP/2 and HTTP/1.1, a JSON message and an event
/// stream, a second name, and its refusals.
#[test]
fn mock_api_self_check() {
    if let Some(why) = netns::missing_tools() {
        support::nested::loud_notice(&format!("SKIPPED mock_api_self_check: {why}"));
        return;
    }
    netns::rerun_in_namespaces("inner_mock_self_check", &[], INNER_OK);
}

#[test]
#[ignore = "run by mock_api_self_check inside its namespaces"]
fn inner_mock_self_check() {
    let holder = ServerNamespace::create();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let token = random_token();
        let mock = MockApi::builder()
            .name(OTHER_HOST)
            .reply_text(SELF_CHECK_REPLY)
            .require_token(&token)
            .event_gap(SELF_CHECK_EVENT_GAP)
            .start(
                &holder,
                &[SocketAddr::new(S_V4.parse().expect("S_V4"), HTTPS_PORT)],
            );
        let bearer = format!("Bearer {token}");
        let oauth = [
            ("authorization", bearer.as_str()),
            ("anthropic-beta", OAUTH_BETA),
        ];
        let message = r#"{"model":"claude-test","max_tokens":8,"messages":[]}"#;
        let streamed = r#"{"model":"claude-test","max_tokens":8,"messages":[],"stream":true}"#;

        // HTTP/2, a JSON message.
        let (status, _, frames) =
            self_check_request(&mock, API_HOST, true, "/v1/messages", &oauth, message).await;
        let body: serde_json::Value =
            serde_json::from_slice(&frames.concat()).expect("a JSON message");
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["content"][0]["text"], SELF_CHECK_REPLY, "{body}");
        assert_eq!(body["stop_reason"], "end_turn", "{body}");
        assert_eq!(body["model"], "claude-test", "{body}");

        // HTTP/1.1, an event stream, one frame per event.
        let (status, content_type, frames) = self_check_request(
            &mock,
            API_HOST,
            false,
            "/v1/messages?beta=true",
            &oauth,
            streamed,
        )
        .await;
        assert_eq!(status, 200);
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
        let text = String::from_utf8(frames.concat()).expect("utf-8 stream");
        check_event_stream(&text, SELF_CHECK_REPLY);
        assert!(frames.len() > 1, "the stream came in one piece: {text}");

        // The second name, an x-api-key, and the refusals.
        let key = [("x-api-key", token.as_str())];
        let (status, ..) =
            self_check_request(&mock, OTHER_HOST, false, "/v1/messages", &key, message).await;
        assert_eq!(status, 200, "x-api-key with the token on {OTHER_HOST}");
        let wrong = [
            ("authorization", "Bearer sk-ant-oat01-wrong"),
            ("anthropic-beta", OAUTH_BETA),
        ];
        let (status, _, frames) =
            self_check_request(&mock, API_HOST, false, "/v1/messages", &wrong, message).await;
        let body = String::from_utf8_lossy(&frames.concat()).into_owned();
        assert!(
            status == 401 && body.contains("authentication_error"),
            "{status} {body}"
        );
        let no_beta = [("authorization", bearer.as_str())];
        let (status, _, frames) =
            self_check_request(&mock, API_HOST, true, "/v1/messages", &no_beta, message).await;
        let body = String::from_utf8_lossy(&frames.concat()).into_owned();
        assert!(
            status == 401 && body.contains("OAuth authentication is currently not supported"),
            "{status} {body}"
        );
        let (status, ..) =
            self_check_request(&mock, API_HOST, false, "/v1/nowhere", &oauth, "").await;
        assert_eq!(status, 404);

        let conns = mock.connections();
        let alpn: Vec<(Option<&str>, Option<&str>)> = conns
            .iter()
            .map(|c| (c.sni.as_deref(), c.alpn.as_deref()))
            .collect();
        assert_eq!(
            alpn,
            [
                (Some(API_HOST), Some("h2")),
                (Some(API_HOST), Some("http/1.1")),
                (Some(OTHER_HOST), Some("http/1.1")),
                (Some(API_HOST), Some("http/1.1")),
                (Some(API_HOST), Some("h2")),
                (Some(API_HOST), Some("http/1.1")),
            ],
            "{}",
            mock.describe()
        );
        let reqs = mock.requests();
        assert_eq!(reqs[0].version, "HTTP/2.0", "{}", mock.describe());
        assert_eq!(
            reqs[0].header("host"),
            Some(API_HOST),
            "{}",
            mock.describe()
        );
        assert_eq!(reqs[1].target, "/v1/messages?beta=true");
        assert_eq!(reqs[1].bearer(), Some(token.as_str()));
        assert_eq!(reqs[2].header("host"), Some(OTHER_HOST));
        assert_eq!(
            mock.unknown_routes(),
            BTreeSet::from(["POST /v1/nowhere".to_owned()])
        );
        println!("{INNER_OK}");
    });
}

/// One request to the mock over a fresh connection to `sni` (HTTP/2 when
/// `h2`); returns the status, the content type and the body's frames.
async fn self_check_request(
    mock: &MockApi,
    sni: &str,
    h2: bool,
    target: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, Vec<Bytes>) {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(mock.ca_der().clone()).expect("the test CA");
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![if h2 {
        b"h2".to_vec()
    } else {
        b"http/1.1".to_vec()
    }];
    let tcp = tokio::time::timeout(T, TcpStream::connect(mock.addrs()[0]))
        .await
        .expect("connect in time")
        .expect("connect to the mock");
    let name = rustls::pki_types::ServerName::try_from(sni.to_owned()).expect("server name");
    let tls = tokio::time::timeout(
        T,
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp),
    )
    .await
    .expect("handshake in time")
    .expect("TLS to the mock");
    let io = hyper_util::rt::TokioIo::new(tls);
    let mut req = hyper::Request::builder()
        .method("POST")
        .uri(format!("https://{sni}{target}"));
    if !h2 {
        req = req.uri(target).header("host", sni);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("request");
    let exchange = async {
        let resp = if h2 {
            let (mut send, conn) =
                hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                    .await
                    .expect("h2 handshake");
            tokio::spawn(conn);
            send.send_request(req).await
        } else {
            let (mut send, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .expect("http/1.1 handshake");
            tokio::spawn(conn);
            send.send_request(req).await
        }
        .expect("an answer");
        let status = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap_or_default().to_owned())
            .unwrap_or_default();
        let mut body = resp.into_body();
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.expect("body frame").into_data() {
                frames.push(data);
            }
        }
        (status, content_type, frames)
    };
    tokio::time::timeout(T, exchange)
        .await
        .expect("the answer in time")
}

/// `text` is a Messages API event stream whose text is `reply`.
fn check_event_stream(text: &str, reply: &str) {
    let mut names = Vec::new();
    let mut said = String::new();
    for event in text.split_terminator("\n\n") {
        let (name, data) = event
            .strip_prefix("event: ")
            .and_then(|e| e.split_once("\ndata: "))
            .unwrap_or_else(|| panic!("not an SSE event: {event:?} in {text}"));
        let data: serde_json::Value = serde_json::from_str(data).expect("JSON event data");
        assert_eq!(data["type"], name, "{event}");
        if name == "content_block_delta" {
            assert_eq!(data["delta"]["type"], "text_delta", "{event}");
            said.push_str(data["delta"]["text"].as_str().expect("delta text"));
        }
        if name == "message_delta" {
            assert_eq!(data["delta"]["stop_reason"], "end_turn", "{event}");
            assert!(data["usage"]["output_tokens"].is_u64(), "{event}");
        }
        names.push(name.to_owned());
    }
    let deltas = names.iter().filter(|n| *n == "content_block_delta").count();
    let mut want = vec!["message_start", "content_block_start", "ping"];
    want.extend(std::iter::repeat_n("content_block_delta", deltas.max(1)));
    want.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, want, "{text}");
    assert_eq!(said, reply, "{text}");
}
