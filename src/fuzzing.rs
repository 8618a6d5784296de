//! Fuzzing entry points of the daemon's parsers, shared by the cargo-fuzz
//! targets in `fuzz/` (nightly, libFuzzer) and by the corpus replay test
//! `tests/fuzz_corpora.rs` (stable, part of `cargo test`). Each function
//! takes the raw fuzz input and must never panic, hang or grow without
//! bound, whatever the bytes.
//!
//! * [`client`]: bytes as they come off a client connection: the frame
//!   decoder, the request envelope and the dispatch of every method against
//!   a fresh [`Daemon`] that has no VM.
//! * [`link_host`]: bytes as they come off the agent link on the host: the
//!   hello, then every message through the link reader (`crate::vm`).
//! * [`egress`]: bytes a session sends to the egress proxy (HTTP CONNECT,
//!   absolute-form HTTP, SOCKS5), with one live credential whose policy
//!   allows nothing, so no input dials out.
//!
//! Limits: `startVM` and `createVM` have their parameters parsed and
//! validated but are not executed ([`client`]): one boots a machine, the
//! other creates a disk image file, neither parses anything further of the
//! client's. The egress target never reaches a relay (no destination is
//! allowed), so what runs after a successful dial is covered by the egress
//! tests, not here.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use guest_agent::framing::{self, FrameError, MAX_CLIENT_FRAME};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::backend::{BackendKind, VmConfig};
use crate::daemon::{Connection, Daemon, Dispatch, Settings};
use crate::egress::{EgressDialer, EgressProxy, Policy, ProxyConfig};
use crate::protocol::{self, CreateVmParams, ProfileParams, Request, StartVmParams};
use crate::vm::ProfileVm;

/// Session name of the credential the egress target issues.
const EGRESS_SESSION: &str = "fuzz";

/// Placeholder in egress inputs replaced by the live credential (the SOCKS5
/// password, or anything else that carries the bare secret).
pub const CRED_PLACEHOLDER: &[u8] = b"@CRED@";

/// Placeholder in egress inputs replaced by `base64("fuzz:<credential>")`,
/// the value of a `Proxy-Authorization: Basic` header.
pub const BASIC_PLACEHOLDER: &[u8] = b"@BASIC@";

/// Directory named in the fuzzing daemon's settings. Nothing is written
/// there: the methods that would create files are not executed.
const FUZZ_DATA_DIR: &str = "/nonexistent/cowork-fuzz";

thread_local! {
    /// One single-threaded runtime per fuzzing thread (building one per
    /// input would dominate the time of every run).
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread tokio runtime builds");
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    RUNTIME.with(|rt| rt.block_on(f))
}

fn settings() -> Settings {
    Settings {
        data_dir: PathBuf::from(FUZZ_DATA_DIR),
        backend: BackendKind::Kvm,
        helper_exe: PathBuf::from(FUZZ_DATA_DIR).join("cowork-helper"),
        idle_timeout: None,
        max_connections: crate::server::MAX_CLIENT_CONNECTIONS,
        max_processes: crate::vm::MAX_PROCESSES,
        max_pending_requests: crate::vm::MAX_PENDING_REQUESTS,
        api_hosts: Vec::new(),
        https_proxy: None,
        no_proxy: None,
        machine: Default::default(),
    }
}

/// Serves `data` as one client connection's incoming bytes, the way the
/// server's connection loop does: frames are decoded with the client frame
/// limit, each request envelope is parsed, `subscribeEvents` selects its
/// profile, and everything else goes through [`Daemon::begin`] and is
/// awaited. Replies are built (and dropped) like the server builds them.
pub fn client(data: &[u8]) {
    block_on(async {
        let daemon = Daemon::new(settings());
        let conn = Arc::new(Connection::default());
        let mut rd = data;
        let mut buf = Vec::new();
        let mut later = Vec::new();
        loop {
            match framing::read_frame(&mut rd, MAX_CLIENT_FRAME, &mut buf).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(FrameError::TooLarge { len, max }) => {
                    let refused = crate::server::ServerError::FrameTooLarge { len, max };
                    drop(protocol::reply(None, Err(refused)));
                    break;
                }
                Err(_) => break,
            }
            let req = match Request::parse(&buf) {
                Ok(r) => r,
                Err((id, e)) => {
                    drop(protocol::reply(id.as_ref(), Err(e)));
                    continue;
                }
            };
            let outcome = match req.method.as_str() {
                "subscribeEvents" => req.params::<ProfileParams>().map(|p| {
                    daemon.select_profile(&conn, &p, false);
                    serde_json::Value::Null
                }),
                "startVM" => req
                    .params::<StartVmParams>()
                    .map(|_| serde_json::Value::Null),
                "createVM" => req.params::<CreateVmParams>().map(|p| {
                    if let Some(gb) = p.disk_size_gb {
                        let _ = crate::vm::session_disk_bytes(gb);
                    }
                    serde_json::Value::Null
                }),
                _ => {
                    let id = req.id.clone();
                    match daemon.begin(&conn, req).await {
                        Dispatch::Done(outcome) => drop(protocol::reply(id.as_ref(), outcome)),
                        Dispatch::Later(work) => later.push((id, work)),
                    }
                    continue;
                }
            };
            drop(protocol::reply(req.id.as_ref(), outcome));
        }
        for (id, work) in later {
            drop(protocol::reply(id.as_ref(), work.await));
        }
    })
}

/// Runs the host end of the agent link over `data`, the bytes the agent
/// sends: its hello first, then every frame through the link reader into a
/// fresh [`ProfileVm`] (output, exits, errors and guest requests reach its process
/// table and event hub).
pub fn link_host(data: &[u8]) {
    block_on(async {
        let vm = ProfileVm::new(VmConfig {
            backend: BackendKind::Kvm,
            profile_dir: PathBuf::from(FUZZ_DATA_DIR),
            helper_exe: PathBuf::from(FUZZ_DATA_DIR).join("cowork-helper"),
            egress: EgressProxy::new(EgressDialer::direct(), ProxyConfig::default()),
            max_processes: crate::vm::MAX_PROCESSES,
            max_pending_requests: crate::vm::MAX_PENDING_REQUESTS,
        });
        let _ = vm.replay_agent_stream(data.to_vec()).await;
        round_trip_agent_messages(data).await;
    })
}

/// Every agent message the link decodes re-encodes to the same message.
async fn round_trip_agent_messages(data: &[u8]) {
    use guest_agent::proto::{self, AgentMessage};
    let mut rd = data;
    let mut buf = Vec::new();
    while let Ok(true) = framing::read_frame(&mut rd, proto::MAX_MESSAGE, &mut buf).await {
        if let Ok((header, payload)) = proto::decode_ref::<AgentMessage>(&buf) {
            let again = proto::encode(&header, payload);
            let (back, back_payload) = proto::decode_ref::<AgentMessage>(&again)
                .expect("a decoded agent message re-encodes to a decodable one");
            assert_eq!(back, header, "agent message round trip");
            assert_eq!(back_payload, payload, "payload round trip");
        }
    }
}

/// Replaces every `from` in `data` with `to`.
fn replace_all(data: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len());
    let mut i = 0;
    while i < data.len() {
        if data[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(data[i]);
            i += 1;
        }
    }
    out
}

/// A client stream of the egress proxy: reads `input`, then end of file;
/// whatever the proxy writes is discarded.
struct ScriptedStream {
    input: Vec<u8>,
    pos: usize,
}

impl AsyncRead for ScriptedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let rest = &self.input[self.pos..];
        let n = rest.len().min(buf.remaining());
        buf.put_slice(&rest[..n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for ScriptedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        b: &[u8],
    ) -> Poll<io::Result<usize>> {
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Serves `data` as one client connection of the egress proxy. The proxy
/// holds one credential (session `fuzz`, a policy that allows nothing);
/// [`CRED_PLACEHOLDER`] and [`BASIC_PLACEHOLDER`] in `data` are replaced by
/// it so inputs get past authentication to the target parsing and policy.
pub fn egress(data: &[u8]) {
    use base64::Engine;
    block_on(async {
        let proxy = EgressProxy::new(EgressDialer::direct(), ProxyConfig::default());
        let Ok(cred) = proxy.issue(EGRESS_SESSION, Policy::Allow(Vec::new())) else {
            return;
        };
        let basic = base64::engine::general_purpose::STANDARD
            .encode(format!("{EGRESS_SESSION}:{}", cred.expose()));
        let input = replace_all(data, CRED_PLACEHOLDER, cred.expose().as_bytes());
        let input = replace_all(&input, BASIC_PLACEHOLDER, basic.as_bytes());
        let _ = proxy.serve_stream(ScriptedStream { input, pos: 0 }).await;
    })
}
