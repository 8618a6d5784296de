//! Fuzzing entry point of the agent's side of the link, shared by the
//! cargo-fuzz target `link_agent` (`fuzz/`, nightly) and the corpus replay
//! test of the workspace (`tests/fuzz_corpora.rs`, stable).
//!
//! [`link_agent`] decodes bytes as the agent reads them from the host:
//! frames with the link's limit, each body as a [`HostMessage`], and, for a
//! body that does not decode, the fallback that looks for the request id to
//! refuse it. Every decoded message must survive an encode/decode round
//! trip unchanged, and the name and signal checks the agent applies to a
//! request's fields run on what it carries.
//!
//! Limits: requests are decoded and checked, not executed (executing them
//! spawns processes, mounts and deletes files in the guest); the agent's
//! own serving loop is covered by the agent's tests.

use serde_json::Value;

use crate::framing::{self, FrameError};
use crate::proto::{self, HostMessage, Op};

/// Decodes `data` as the host's side of the agent link; panics only when a
/// decoded message does not round-trip (a protocol bug, not bad input).
pub fn link_agent(data: &[u8]) {
    RUNTIME.with(|rt| rt.block_on(decode_all(data)))
}

thread_local! {
    /// One runtime per fuzzing thread: building one per input would
    /// dominate the run time.
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread tokio runtime builds");
}

async fn decode_all(data: &[u8]) {
    {
        let mut rd = data;
        let mut buf = Vec::new();
        loop {
            match framing::read_frame(&mut rd, proto::MAX_MESSAGE, &mut buf).await {
                Ok(true) => {}
                Ok(false) | Err(FrameError::TooLarge { .. }) | Err(_) => break,
            }
            let body = std::mem::take(&mut buf);
            match proto::decode::<HostMessage>(body.clone()) {
                Ok(env) => {
                    check_fields(&env.header);
                    let again = proto::encode(&env.header, &env.payload);
                    let back = proto::decode::<HostMessage>(again)
                        .expect("a decoded host message re-encodes to a decodable one");
                    assert_eq!(back.header, env.header, "host message round trip");
                    assert_eq!(back.payload, env.payload, "payload round trip");
                }
                Err(_) => {
                    let _ = malformed_request_id(&body);
                }
            }
        }
    }
}

/// The id of a request whose body did not decode, found the way the agent
/// does to refuse it.
fn malformed_request_id(body: &[u8]) -> Option<u64> {
    let len = u32::from_be_bytes(body.get(..4)?.try_into().ok()?) as usize;
    let header = body.get(4..4usize.saturating_add(len))?;
    serde_json::from_slice::<Value>(header)
        .ok()
        .filter(|v| v["type"] == "request")
        .and_then(|v| v["id"].as_u64())
}

/// Runs the agent's name and signal checks on a request's fields.
fn check_fields(msg: &HostMessage) {
    let HostMessage::Request { op, .. } = msg else {
        return;
    };
    match op {
        Op::Spawn(spec) => {
            let _ = crate::names::session_name(&spec.name);
            for m in &spec.mounts {
                let _ = crate::names::mount_name(&m.name);
            }
        }
        Op::Kill { signal, .. } => {
            let _ = crate::signal::name(*signal);
        }
        Op::ReadFile { session, .. } => {
            let _ = crate::names::session_name(session);
        }
        Op::Mount(m) => {
            let _ = crate::names::session_name(&m.session);
            let _ = crate::names::mount_name(&m.name);
        }
        Op::DeleteSessionDirs { names } => {
            for n in names {
                let _ = crate::names::session_name(n);
            }
        }
        _ => {}
    }
}
