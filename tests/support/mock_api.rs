//! A mock of the Anthropic API over TLS that the real Claude Code CLI
//! completes a turn against: the upstream of the tests that check the
//! egress proxy's credential swap (the session holds a placeholder, the
//! proxy puts the real token in, the mock must see the real one).
//!
//! [`MockApi::builder`] makes a test CA with rcgen (written to a PEM file the
//! test points `SSL_CERT_FILE` or `NODE_EXTRA_CA_CERTS` at, [`MockApi::ca_pem_path`])
//! and one leaf for [`API_HOST`] plus any other names the caller asks for,
//! and serves them on listeners bound inside a network namespace the test
//! made ([`super::netns::ServerNamespace`], [`super::netns::bind_in`]); a
//! loopback or unspecified address is refused, so nothing outside the test's
//! namespaces can reach it. It speaks HTTP/1.1 and, when the client offers
//! it in ALPN, HTTP/2 (as the real API does; [`MockApiBuilder::http1_only`]
//! turns that off).
//!
//! Every TLS connection ([`RecordedConnection`]: peer, SNI, ALPN offered
//! and chosen, handshake error) and every request ([`RecordedRequest`]:
//! method, path and query, HTTP version, all headers including
//! `authorization` and `x-api-key`, the body, the status answered) is
//! recorded for the test to read afterwards.
//!
//! # Routes
//!
//! What Claude Code 2.1.337 sends in `claude -p` with `CLAUDE_CODE_OAUTH_TOKEN`
//! (recorded by `tests/mock_api_cli.rs`), and what the mock answers. Every
//! answer carries a `request-id` header, as the real API's do. "Bearer" means
//! `Authorization: Bearer <token>` with `anthropic-beta: oauth-2025-04-20`.
//!
//! | route | the CLI sends | the mock answers |
//! |---|---|---|
//! | `HEAD /api/hello` | nothing (a preconnect; skipped when `HTTPS_PROXY` is set) | 200, empty |
//! | `GET /api/claude_code/settings` | Bearer | 404 `not_found_error` ("No settings found": no managed settings) |
//! | `GET /api/claude_code/policy_limits` | Bearer | 200 `{"restrictions":{}}` (no restrictions) |
//! | `POST /api/eval/<sdk key>` | Bearer; GrowthBook attributes | 200 `{"features":{}}` (no feature flags) |
//! | `GET /api/claude_cli/bootstrap` | Bearer; `?entrypoint=…&model=…` | 200 `{"client_data":null,"additional_model_options":[]}` |
//! | `GET /api/directory/server-urls` | no credential | 200 `{"urls":[]}` (no official MCP servers) |
//! | `POST /v1/messages[?beta=true]` | Bearer, `anthropic-version`, `x-app: cli`, the request | the assistant's answer (below) |
//! | `POST /v1/messages/count_tokens` | not sent by 2.1.337 `-p` | 200 `{"input_tokens":…}` (public API docs) |
//! | `POST /api/event_logging/v2/batch` | telemetry; Bearer from the plugin logger, none from the main one | 200 `{}` |
//! | anything else | | 404 `not_found_error` |
//!
//! `/api/hello`, `/api/eval`, `/api/claude_cli/bootstrap`,
//! `/api/directory/server-urls` and `/api/event_logging` are "nonessential
//! traffic": `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1` leaves only
//! settings, policy limits and messages.
//!
//! `/v1/messages` answers a `"stream": true` request with a Messages API
//! event stream (`content-type: text/event-stream`; `message_start`,
//! `content_block_start`, `ping`, one `content_block_delta` `text_delta` per
//! word of the text, `content_block_stop`, `message_delta` with
//! `stop_reason: end_turn` and usage, `message_stop`), each event written as
//! its own frame ([`MockApiBuilder::event_gap`] spaces them out), and any
//! other request with the same message as JSON. The text is
//! [`MockApiBuilder::reply_text`]; the model is the request's.
//!
//! Credentials: a Bearer without the `oauth-2025-04-20` beta gets the real
//! API's 401 ("OAuth authentication is currently not supported."). With
//! [`MockApiBuilder::require_token`], a request on a route that takes a
//! credential (all but `/api/hello` and `/api/directory/server-urls`) whose
//! `Authorization: Bearer` or `x-api-key` is not that token, or that has
//! none where the CLI always sends one, gets a 401 `authentication_error`, so
//! a CLI holding a placeholder fails its turn.
//!
//! Limits: no tool use, thinking or multi-block answers, no rate limits or
//! overload errors, no WebSocket; token counts are fixed numbers. The routes
//! above are what one CLI version does: a newer one may call more (they get
//! 404s, which [`MockApi::unknown_routes`] lists).

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::netns::{bind_in, ServerNamespace};

/// The API host the CLI talks to.
pub const API_HOST: &str = "api.anthropic.com";
/// Where HTTPS servers listen.
pub const HTTPS_PORT: u16 = 443;
/// The beta flag that makes the API accept an OAuth Bearer token.
pub const OAUTH_BETA: &str = "oauth-2025-04-20";
/// The assistant's text unless the builder says otherwise.
pub const DEFAULT_REPLY: &str = "Hello from the mock Anthropic API.";

/// Bound for a client to finish its TLS handshake.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// Bound for a client to send a request head (HTTP/1.1).
const HEADER_LIMIT: Duration = Duration::from_secs(10);
/// Bound for a client to send a request body.
const BODY_LIMIT: Duration = Duration::from_secs(30);
/// Largest request body accepted (the CLI's telemetry batches reach about
/// 300 KB, a first turn's request about 50 KB).
const MAX_BODY: usize = 16 << 20;
/// The certificates are valid this long either side of now.
const CERT_VALIDITY: Duration = Duration::from_secs(24 * 3600);
/// ALPN protocol ids.
const ALPN_H2: &[u8] = b"h2";
const ALPN_HTTP11: &[u8] = b"http/1.1";
/// Fixed usage numbers of every answer.
const INPUT_TOKENS: u64 = 12;
const OUTPUT_TOKENS: u64 = 7;
/// The real API's answer to a Bearer token without [`OAUTH_BETA`].
const OAUTH_NOT_SUPPORTED: &str = "OAuth authentication is currently not supported.";

/// One TLS connection the mock accepted.
#[derive(Clone, Debug)]
pub struct RecordedConnection {
    /// Index in [`MockApi::connections`], which
    /// [`RecordedRequest::connection`] refers to.
    pub id: usize,
    /// The client's address as the mock saw it.
    pub peer: SocketAddr,
    /// The ClientHello's server name.
    pub sni: Option<String>,
    /// The ALPN protocols the ClientHello offered (empty: no ALPN extension).
    pub alpn_offered: Vec<String>,
    /// The protocol agreed on (`None`: no ALPN, HTTP/1.1).
    pub alpn: Option<String>,
    /// Why the handshake failed, if it did. A CLI that does not trust the
    /// CA shows here as "tls handshake eof" or a reset: it sends no alert.
    pub error: Option<String>,
}

/// One request the mock answered.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    /// The [`RecordedConnection`] it came on.
    pub connection: usize,
    pub method: String,
    /// Path and query, as sent.
    pub target: String,
    /// `HTTP/1.1` or `HTTP/2.0`.
    pub version: String,
    /// Every header as sent, names in lower case, in order (the `:authority`
    /// of HTTP/2 shows as `host`).
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    /// The status the mock answered.
    pub status: u16,
    /// Whether the route is one of the mock's (else it got a 404).
    pub known_route: bool,
}

impl RecordedRequest {
    /// The path without the query.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or_default()
    }

    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of header `name` (lower case).
    pub fn headers_named(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The token of `Authorization: Bearer <token>`, if that is how it came.
    pub fn bearer(&self) -> Option<&str> {
        self.header("authorization")?.strip_prefix("Bearer ")
    }

    /// Whether `anthropic-beta` lists `flag`.
    pub fn has_beta(&self, flag: &str) -> bool {
        self.headers_named("anthropic-beta")
            .iter()
            .flat_map(|v| v.split(','))
            .any(|f| f.trim() == flag)
    }

    /// One line for a report: method, target, version, status, the
    /// credential's form (never more than its first characters), the
    /// headers the interception cares about, and the body's length.
    pub fn summary(&self) -> String {
        let cred = |name: &str| {
            self.header(name).map_or_else(
                || "-".to_owned(),
                |v| {
                    let shown: String = v.chars().take(20).collect();
                    format!("{shown}…({} chars)", v.len())
                },
            )
        };
        let h = |name: &str| self.header(name).unwrap_or("-").to_owned();
        format!(
            "{} {} {} → {} | authorization {} | x-api-key {} | anthropic-beta {} | \
             anthropic-version {} | x-app {} | user-agent {} | body {} bytes",
            self.method,
            self.target,
            self.version,
            self.status,
            cred("authorization"),
            cred("x-api-key"),
            h("anthropic-beta"),
            h("anthropic-version"),
            h("x-app"),
            h("user-agent"),
            self.body.len()
        )
    }
}

/// How to start a [`MockApi`]; from [`MockApi::builder`].
pub struct MockApiBuilder {
    names: Vec<String>,
    reply: String,
    http2: bool,
    token: Option<String>,
    event_gap: Duration,
}

impl MockApiBuilder {
    /// Also serve `name` (another SAN on the leaf), e.g. a second allowed
    /// host where a placeholder must arrive unchanged.
    pub fn name(mut self, name: &str) -> Self {
        self.names.push(name.to_owned());
        self
    }

    /// The assistant's text (default [`DEFAULT_REPLY`]); a marker the test
    /// then finds in the CLI's output.
    pub fn reply_text(mut self, text: &str) -> Self {
        self.reply = text.to_owned();
        self
    }

    /// Offer only `http/1.1` in ALPN (default: `h2` too).
    pub fn http1_only(mut self) -> Self {
        self.http2 = false;
        self
    }

    /// Answer 401 to a credential other than `token` (see the module doc).
    pub fn require_token(mut self, token: &str) -> Self {
        self.token = Some(token.to_owned());
        self
    }

    /// Wait this long between the events of a stream (default none).
    pub fn event_gap(mut self, gap: Duration) -> Self {
        self.event_gap = gap;
        self
    }

    /// Makes the CA and the leaf, binds `addrs` inside `ns` and serves them
    /// on the current Tokio runtime until the [`MockApi`] is dropped.
    pub fn start(self, ns: &ServerNamespace, addrs: &[SocketAddr]) -> MockApi {
        for a in addrs {
            assert!(
                !a.ip().is_loopback() && !a.ip().is_unspecified(),
                "the mock API listens only on a namespace's own address, not {a}"
            );
        }
        let dir = tempfile::tempdir().expect("mock API tempdir");
        let (ca_der, ca_pem, leaf, leaf_key) = certificates(&self.names);
        let ca_pem_path = dir.path().join("mock-api-ca.pem");
        std::fs::write(&ca_pem_path, &ca_pem).expect("write the mock API's CA");

        let mut tls = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(vec![leaf], leaf_key)
        .expect("mock API server config");
        tls.alpn_protocols = if self.http2 {
            vec![ALPN_H2.to_vec(), ALPN_HTTP11.to_vec()]
        } else {
            vec![ALPN_HTTP11.to_vec()]
        };

        let shared = Arc::new(Shared {
            tls: Arc::new(tls),
            reply: self.reply,
            token: self.token,
            event_gap: self.event_gap,
            connections: Mutex::default(),
            requests: Mutex::default(),
            next_id: AtomicUsize::new(1),
        });
        let listeners = bind_in(ns.pid(), addrs.to_vec());
        let tasks = listeners
            .into_iter()
            .map(|l| {
                l.set_nonblocking(true).expect("nonblocking");
                let l = tokio::net::TcpListener::from_std(l).expect("tokio listener");
                let shared = shared.clone();
                tokio::spawn(async move {
                    while let Ok((tcp, peer)) = l.accept().await {
                        tokio::spawn(serve_connection(tcp, peer, shared.clone()));
                    }
                })
            })
            .collect();
        MockApi {
            addrs: addrs.to_vec(),
            names: self.names,
            ca_pem,
            ca_der,
            ca_pem_path,
            shared,
            tasks,
            _dir: dir,
        }
    }
}

/// The running mock; stops serving when dropped.
pub struct MockApi {
    addrs: Vec<SocketAddr>,
    names: Vec<String>,
    ca_pem: String,
    ca_der: CertificateDer<'static>,
    ca_pem_path: PathBuf,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl MockApi {
    /// A mock for [`API_HOST`] answering [`DEFAULT_REPLY`].
    pub fn builder() -> MockApiBuilder {
        MockApiBuilder {
            names: vec![API_HOST.to_owned()],
            reply: DEFAULT_REPLY.to_owned(),
            http2: true,
            token: None,
            event_gap: Duration::ZERO,
        }
    }

    /// Where it listens.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The names its certificate is for.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The test CA's certificate, PEM (only the CA).
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The test CA's certificate, DER (for a rustls root store).
    pub fn ca_der(&self) -> &CertificateDer<'static> {
        &self.ca_der
    }

    /// A file holding [`Self::ca_pem`], for `SSL_CERT_FILE` or
    /// `NODE_EXTRA_CA_CERTS`; removed when the mock is dropped.
    pub fn ca_pem_path(&self) -> &Path {
        &self.ca_pem_path
    }

    /// Every TLS connection so far.
    pub fn connections(&self) -> Vec<RecordedConnection> {
        self.shared.connections.lock().expect("lock").clone()
    }

    /// Every request so far, in the order they were answered.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.requests.lock().expect("lock").clone()
    }

    /// The requests to `path` (without query).
    pub fn requests_to(&self, path: &str) -> Vec<RecordedRequest> {
        self.requests()
            .into_iter()
            .filter(|r| r.path() == path)
            .collect()
    }

    /// Method and path of each request to a route the mock does not know.
    pub fn unknown_routes(&self) -> BTreeSet<String> {
        self.requests()
            .iter()
            .filter(|r| !r.known_route)
            .map(|r| format!("{} {}", r.method, r.path()))
            .collect()
    }

    /// Every connection and request, one line each (for failure messages
    /// and reports; credentials shortened).
    pub fn describe(&self) -> String {
        let mut s = String::new();
        for c in self.connections() {
            let _ = writeln!(
                s,
                "connection {} from {} SNI {:?} ALPN offered {:?} chosen {:?}{}",
                c.id,
                c.peer,
                c.sni,
                c.alpn_offered,
                c.alpn,
                c.error.map(|e| format!(" FAILED: {e}")).unwrap_or_default()
            );
        }
        for r in self.requests() {
            let _ = writeln!(s, "  [conn {}] {}", r.connection, r.summary());
        }
        if s.is_empty() {
            s.push_str("(the mock API saw no connection)\n");
        }
        s
    }
}

impl Drop for MockApi {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// State the connections share.
struct Shared {
    tls: Arc<rustls::ServerConfig>,
    reply: String,
    token: Option<String>,
    event_gap: Duration,
    connections: Mutex<Vec<RecordedConnection>>,
    requests: Mutex<Vec<RecordedRequest>>,
    /// For message and request ids.
    next_id: AtomicUsize,
}

/// The CA (DER and PEM) and a leaf for `names` with its key.
fn certificates(
    names: &[String],
) -> (
    CertificateDer<'static>,
    String,
    CertificateDer<'static>,
    PrivateKeyDer<'static>,
) {
    let now = time::OffsetDateTime::now_utc();
    let mut ca = CertificateParams::default();
    ca.distinguished_name.push(
        DnType::CommonName,
        "cowork-helper mock Anthropic API test CA",
    );
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.not_before = now - CERT_VALIDITY;
    ca.not_after = now + CERT_VALIDITY;
    let ca_key = KeyPair::generate().expect("CA key");
    let ca_cert = ca.self_signed(&ca_key).expect("self-sign the CA");
    let issuer = Issuer::new(ca, ca_key);

    let mut leaf = CertificateParams::new(names.to_vec()).expect("leaf names");
    leaf.distinguished_name
        .push(DnType::CommonName, names[0].as_str());
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.use_authority_key_identifier_extension = true;
    leaf.not_before = now - CERT_VALIDITY;
    leaf.not_after = now + CERT_VALIDITY;
    let leaf_key = KeyPair::generate().expect("leaf key");
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer).expect("sign the leaf");
    (
        ca_cert.der().clone(),
        ca_cert.pem(),
        leaf_cert.der().clone(),
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
    )
}

/// TLS (recording the ClientHello), then HTTP/1.1 or HTTP/2 as agreed.
async fn serve_connection(tcp: TcpStream, peer: SocketAddr, shared: Arc<Shared>) {
    let mut conn = RecordedConnection {
        id: 0,
        peer,
        sni: None,
        alpn_offered: Vec::new(),
        alpn: None,
        error: None,
    };
    // One deadline for reading the ClientHello and finishing the handshake.
    let handshake = async {
        let start = tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), tcp)
            .await
            .map_err(|e| format!("reading the ClientHello: {e}"))?;
        let hello = start.client_hello();
        conn.sni = hello.server_name().map(str::to_owned);
        conn.alpn_offered = hello
            .alpn()
            .map(|protos| {
                protos
                    .map(|p| String::from_utf8_lossy(p).into_owned())
                    .collect()
            })
            .unwrap_or_default();
        start
            .into_stream(shared.tls.clone())
            .await
            .map_err(|e| format!("handshake: {e}"))
    };
    let tls = match tokio::time::timeout(HANDSHAKE_LIMIT, handshake).await {
        Ok(Ok(tls)) => Some(tls),
        Ok(Err(e)) => {
            conn.error = Some(e);
            None
        }
        Err(_) => {
            conn.error = Some(format!("no handshake within {HANDSHAKE_LIMIT:?}"));
            None
        }
    };
    conn.alpn = tls
        .as_ref()
        .and_then(|t| t.get_ref().1.alpn_protocol())
        .map(|p| String::from_utf8_lossy(p).into_owned());
    let h2 = conn.alpn.as_deref() == Some("h2");
    let id = {
        let mut all = shared.connections.lock().expect("lock");
        conn.id = all.len();
        all.push(conn);
        all.len() - 1
    };
    let Some(tls) = tls else { return };
    let service = hyper::service::service_fn(move |req| {
        let shared = shared.clone();
        async move { Ok::<_, Infallible>(answer(req, id, &shared).await) }
    });
    let io = TokioIo::new(tls);
    // A connection ends when the client closes it or the mock is dropped.
    let _ = if h2 {
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(io, service)
            .await
    } else {
        hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_LIMIT)
            .serve_connection(io, service)
            .await
    };
}

type Reply = hyper::Response<BoxBody<Bytes, Infallible>>;

/// Reads the request, records it and answers it.
async fn answer(req: hyper::Request<Incoming>, connection: usize, shared: &Shared) -> Reply {
    let (parts, body) = req.into_parts();
    let body = match tokio::time::timeout(BODY_LIMIT, Limited::new(body, MAX_BODY).collect()).await
    {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => Bytes::from(format!("<body unreadable: {e}>")),
        Err(_) => Bytes::from_static(b"<body not sent in time>"),
    };
    let mut record = RecordedRequest {
        connection,
        method: parts.method.to_string(),
        target: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_owned(), |pq| pq.as_str().to_owned()),
        version: format!("{:?}", parts.version),
        headers: parts
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body,
        status: 0,
        known_route: true,
    };
    if record.header("host").is_none() {
        if let Some(authority) = parts.uri.authority() {
            record
                .headers
                .push(("host".to_owned(), authority.as_str().to_owned()));
        }
    }
    let route = Route::of(&parts.method, record.path());
    record.known_route = route != Route::Unknown;
    let mut reply = match credential_refusal(&record, route, shared.token.as_deref()) {
        Some(refusal) => refusal,
        None => route.answer(&record, shared),
    };
    let request_id = format!(
        "req_mock_{}",
        shared.next_id.fetch_add(1, Ordering::Relaxed)
    );
    reply.headers_mut().insert(
        "request-id",
        HeaderValue::from_str(&request_id).expect("ascii id"),
    );
    record.status = reply.status().as_u16();
    shared.requests.lock().expect("lock").push(record);
    reply
}

/// The routes the mock knows (see the module doc).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Route {
    Hello,
    Settings,
    PolicyLimits,
    FeatureEval,
    Bootstrap,
    McpServerUrls,
    Messages,
    CountTokens,
    EventLogging,
    Unknown,
}

/// Whether a route takes a credential: the CLI always sends one, sometimes
/// does, or never does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum CredentialUse {
    Always,
    Sometimes,
    Never,
}

impl Route {
    fn of(method: &Method, path: &str) -> Route {
        let get = method == Method::GET || method == Method::HEAD;
        let post = method == Method::POST;
        match path {
            "/api/hello" if get => Route::Hello,
            "/api/claude_code/settings" if get => Route::Settings,
            "/api/claude_code/policy_limits" if get => Route::PolicyLimits,
            "/api/claude_cli/bootstrap" if get => Route::Bootstrap,
            "/api/directory/server-urls" if get => Route::McpServerUrls,
            "/v1/messages" if post => Route::Messages,
            "/v1/messages/count_tokens" if post => Route::CountTokens,
            "/api/event_logging/v2/batch" if post => Route::EventLogging,
            p if post && p.starts_with("/api/eval/") => Route::FeatureEval,
            _ => Route::Unknown,
        }
    }

    fn credential(self) -> CredentialUse {
        match self {
            Route::Hello | Route::McpServerUrls | Route::Unknown => CredentialUse::Never,
            Route::EventLogging => CredentialUse::Sometimes,
            _ => CredentialUse::Always,
        }
    }

    fn answer(self, req: &RecordedRequest, shared: &Shared) -> Reply {
        match self {
            Route::Hello => reply(StatusCode::OK, None, Bytes::new()),
            Route::Settings | Route::Unknown => not_found(req),
            Route::PolicyLimits => json_reply(StatusCode::OK, &json!({"restrictions": {}})),
            Route::FeatureEval => json_reply(StatusCode::OK, &json!({"features": {}})),
            Route::Bootstrap => json_reply(
                StatusCode::OK,
                &json!({"client_data": null, "additional_model_options": []}),
            ),
            Route::McpServerUrls => json_reply(StatusCode::OK, &json!({"urls": []})),
            Route::EventLogging => json_reply(StatusCode::OK, &json!({})),
            Route::CountTokens => {
                json_reply(StatusCode::OK, &json!({"input_tokens": INPUT_TOKENS}))
            }
            Route::Messages => messages(req, shared),
        }
    }
}

/// The 401 a request gets for its credential, if any (see the module doc).
fn credential_refusal(req: &RecordedRequest, route: Route, token: Option<&str>) -> Option<Reply> {
    if route.credential() == CredentialUse::Never {
        return None;
    }
    if req.bearer().is_some() && !req.has_beta(OAUTH_BETA) {
        return Some(api_error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            OAUTH_NOT_SUPPORTED,
        ));
    }
    let token = token?;
    let sent = req.bearer().or_else(|| req.header("x-api-key"));
    let ok = match sent {
        Some(t) => t == token,
        None => route.credential() == CredentialUse::Sometimes,
    };
    (!ok).then(|| {
        api_error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "Invalid bearer token",
        )
    })
}

/// `/v1/messages`: an event stream or a JSON message.
fn messages(req: &RecordedRequest, shared: &Shared) -> Reply {
    let Ok(body) = serde_json::from_slice::<Value>(&req.body) else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the body is not JSON",
        );
    };
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("claude-mock")
        .to_owned();
    let id = format!(
        "msg_mock_{}",
        shared.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let usage = json!({"input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS});
    if body.get("stream").and_then(Value::as_bool) != Some(true) {
        return json_reply(
            StatusCode::OK,
            &json!({
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": shared.reply}],
                "stop_reason": "end_turn", "stop_sequence": null, "usage": usage,
            }),
        );
    }
    let mut events = vec![
        json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": INPUT_TOKENS, "output_tokens": 1},
        }}),
        json!({"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}}),
        json!({"type": "ping"}),
    ];
    events.extend(words(&shared.reply).into_iter().map(|w| {
        json!({"type": "content_block_delta", "index": 0,
               "delta": {"type": "text_delta", "text": w}})
    }));
    events.extend([
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta",
               "delta": {"stop_reason": "end_turn", "stop_sequence": null},
               "usage": {"output_tokens": OUTPUT_TOKENS}}),
        json!({"type": "message_stop"}),
    ]);
    let (tx, rx) = mpsc::channel(events.len());
    let gap = shared.event_gap;
    tokio::spawn(async move {
        for (i, e) in events.iter().enumerate() {
            if i > 0 && !gap.is_zero() {
                tokio::time::sleep(gap).await;
            }
            let kind = e["type"].as_str().expect("event type");
            let frame = Bytes::from(format!("event: {kind}\ndata: {e}\n\n"));
            if tx.send(frame).await.is_err() {
                return; // the client went away
            }
        }
    });
    let mut r = hyper::Response::new(ChannelBody(rx).boxed());
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r.headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-cache"));
    r
}

/// `text` cut after each space (so the pieces join back to it).
fn words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for c in text.chars() {
        cur.push(c);
        if c == ' ' {
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() || out.is_empty() {
        out.push(cur);
    }
    out
}

fn reply(status: StatusCode, content_type: Option<&'static str>, body: Bytes) -> Reply {
    let mut r = hyper::Response::new(Full::new(body).boxed());
    *r.status_mut() = status;
    if let Some(ct) = content_type {
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(ct));
    }
    r
}

fn json_reply(status: StatusCode, v: &Value) -> Reply {
    reply(status, Some("application/json"), Bytes::from(v.to_string()))
}

/// The API's error shape.
fn api_error(status: StatusCode, kind: &str, message: &str) -> Reply {
    json_reply(
        status,
        &json!({"type": "error", "error": {"type": kind, "message": message}}),
    )
}

fn not_found(req: &RecordedRequest) -> Reply {
    api_error(
        StatusCode::NOT_FOUND,
        "not_found_error",
        &format!(
            "{} {} is not a route of the mock API",
            req.method,
            req.path()
        ),
    )
}

/// A response body fed frame by frame from a channel (each SSE event is
/// written when it is sent, not buffered to the end).
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}
