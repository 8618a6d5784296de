//! The host end of the agent link: framed requests with ids and
//! deadlines ([`AgentLink::call`], [`AgentLink::send`]), one writer task
//! that coalesces queued frames, one reader task that matches answers to
//! their requests and hands the agent's unsolicited messages to the [`Vm`];
//! and the agent's hello, which must be its first message.
//!
//! Limits: at most [`AGENT_QUEUE`] frames wait for the writer (senders then
//! wait); one write carries at most about [`WRITE_BATCH`] bytes; a frame
//! the link cannot parse ends the link.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use guest_agent::framing::{self, FrameError};
use guest_agent::proto::{self, AgentMessage, Envelope, Hello, HostMessage, Op};
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

use super::{lock, Vm, VmError};

/// Frames queued towards the agent before senders wait.
const AGENT_QUEUE: usize = 256;

/// Largest batch the link writer coalesces into one write.
const WRITE_BATCH: usize = 1024 * 1024;

/// Answer of one agent request.
struct Reply {
    result: Result<Value, String>,
    payload: Vec<u8>,
}

/// The host end of the agent protocol.
pub struct AgentLink {
    tx: mpsc::Sender<Vec<u8>>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    next_id: AtomicU64,
    pub(super) closed: AtomicBool,
    pub hello: Hello,
}

impl AgentLink {
    /// Sends `op` (with `payload`) and waits for its answer.
    pub async fn call(
        &self,
        op: Op,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(Value, Vec<u8>), VmError> {
        self.send(op, payload).await?.wait(self, timeout).await
    }

    /// Queues `op` towards the agent. Requests sent one after another reach
    /// the agent in that order; the answer is awaited separately.
    pub async fn send(&self, op: Op, payload: &[u8]) -> Result<PendingCall, VmError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(VmError::AgentGone);
        }
        let name = op_name(&op);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        let mut frame = Vec::with_capacity(64 + payload.len());
        proto::encode_frame_into(&mut frame, &HostMessage::Request { id, op }, payload);
        if self.tx.send(frame).await.is_err() {
            lock(&self.pending).remove(&id);
            return Err(VmError::AgentGone);
        }
        Ok(PendingCall { id, name, rx })
    }
}

/// A request that reached the agent's queue and awaits its answer.
pub struct PendingCall {
    id: u64,
    name: &'static str,
    rx: oneshot::Receiver<Reply>,
}

impl PendingCall {
    /// Waits for the answer.
    pub async fn wait(
        self,
        link: &AgentLink,
        timeout: Duration,
    ) -> Result<(Value, Vec<u8>), VmError> {
        let PendingCall { id, name, rx } = self;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(Reply {
                result: Ok(v),
                payload,
            })) => Ok((v, payload)),
            Ok(Ok(Reply { result: Err(e), .. })) => Err(VmError::Agent(e)),
            Ok(Err(_)) => Err(VmError::AgentGone),
            Err(_) => {
                lock(&link.pending).remove(&id);
                Err(VmError::Timeout { op: name, timeout })
            }
        }
    }
}

impl AgentLink {
    /// Sends a message that has no answer.
    async fn notify(&self, msg: &HostMessage) -> Result<(), VmError> {
        let mut frame = Vec::new();
        proto::encode_frame_into(&mut frame, msg, &[]);
        self.tx.send(frame).await.map_err(|_| VmError::AgentGone)
    }

    pub(super) fn fail_pending(&self) {
        self.closed.store(true, Ordering::Release);
        for (_, tx) in lock(&self.pending).drain() {
            let _ = tx.send(Reply {
                result: Err("the guest agent disconnected".into()),
                payload: vec![],
            });
        }
    }
}

pub(super) fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Ping => "ping",
        Op::Spawn(_) => "spawn",
        Op::WriteStdin { .. } => "writeStdin",
        Op::CloseStdin { .. } => "closeStdin",
        Op::Kill { .. } => "kill",
        Op::ProcessStatus { .. } => "processStatus",
        Op::ReadFile { .. } => "readFile",
        Op::InstallSdk { .. } => "installSdk",
        Op::Mount(_) => "mount",
        Op::DiskInfo { .. } => "diskInfo",
        Op::DeleteSessionDirs { .. } => "deleteSessionDirs",
        Op::PruneSessionCaches { .. } => "pruneSessionCaches",
        Op::Shutdown => "shutdown",
    }
}

impl Vm {
    /// Wires a connected agent stream: writer and reader tasks.
    pub(super) fn attach(self: &Arc<Self>, hello: Hello, stream: UnixStream) -> Arc<AgentLink> {
        let (rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::channel(AGENT_QUEUE);
        let link = Arc::new(AgentLink {
            tx,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            hello,
        });
        *self.link.write().unwrap_or_else(|p| p.into_inner()) = Some(link.clone());
        tokio::spawn(link_writer(wr, rx));
        tokio::spawn(link_reader(Arc::downgrade(self), link.clone(), rd));
        link
    }

    pub async fn send_guest_response(
        &self,
        id: String,
        result_json: Option<String>,
        error: Option<String>,
    ) -> Result<(), VmError> {
        match self.connected_link() {
            Ok(link) => {
                link.notify(&HostMessage::GuestResponse {
                    id,
                    result_json,
                    error,
                })
                .await
            }
            // Unknown ids (and answers for a guest that went away) are fine.
            Err(_) => Ok(()),
        }
    }
}

/// Reads the agent's first message, which must be its hello.
pub(super) async fn read_hello(mut stream: UnixStream) -> Result<(Hello, UnixStream), VmError> {
    let mut buf = Vec::new();
    match framing::read_frame(&mut stream, proto::MAX_MESSAGE, &mut buf).await {
        Ok(true) => {}
        Ok(false) => {
            return Err(VmError::Start(
                "the guest agent closed the link before its hello".into(),
            ))
        }
        Err(e) => return Err(VmError::Start(format!("reading the agent hello: {e}"))),
    }
    match proto::decode::<AgentMessage>(buf) {
        Ok(Envelope {
            header: AgentMessage::Hello(h),
            ..
        }) => {
            if h.protocol != proto::PROTOCOL_VERSION {
                return Err(VmError::Start(format!(
                    "guest agent speaks protocol {} but this helper speaks {}",
                    h.protocol,
                    proto::PROTOCOL_VERSION
                )));
            }
            Ok((h, stream))
        }
        Ok(_) => Err(VmError::Start(
            "the guest agent's first message was not a hello".into(),
        )),
        Err(e) => Err(VmError::Start(format!("malformed agent hello: {e}"))),
    }
}

async fn link_writer(mut wr: tokio::net::unix::OwnedWriteHalf, mut rx: mpsc::Receiver<Vec<u8>>) {
    let mut batch = Vec::new();
    while let Some(first) = rx.recv().await {
        batch.clear();
        batch.extend_from_slice(&first);
        while batch.len() < WRITE_BATCH {
            match rx.try_recv() {
                Ok(more) => batch.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        if let Err(e) = wr.write_all(&batch).await {
            tracing::debug!(error = %e, "agent link write failed");
            break;
        }
    }
    let _ = wr.shutdown().await;
}

async fn link_reader(
    vm: std::sync::Weak<Vm>,
    link: Arc<AgentLink>,
    mut rd: tokio::net::unix::OwnedReadHalf,
) {
    let mut buf = Vec::new();
    loop {
        match framing::read_frame(&mut rd, proto::MAX_MESSAGE, &mut buf).await {
            Ok(true) => {}
            Ok(false) => break,
            Err(FrameError::Io(e)) => {
                tracing::debug!(error = %e, "agent link read failed");
                break;
            }
            Err(e) => {
                tracing::error!(error = %e, "agent link framing lost; dropping the link");
                break;
            }
        }
        // The frame buffer is reused across frames; output is handled from
        // a view of it, only answers copy their payload out.
        let (header, payload) = match proto::decode_ref::<AgentMessage>(&buf) {
            Ok(decoded) => decoded,
            Err(e) => {
                tracing::warn!(error = %e, "malformed agent message ignored");
                continue;
            }
        };
        match header {
            AgentMessage::Response { id, error, result } => {
                let tx = lock(&link.pending).remove(&id);
                if let Some(tx) = tx {
                    let result = match error {
                        Some(e) => Err(e),
                        None => Ok(result),
                    };
                    let _ = tx.send(Reply {
                        result,
                        payload: payload.to_vec(),
                    });
                }
            }
            other => {
                let Some(vm) = vm.upgrade() else { break };
                vm.on_agent_message(other, payload).await;
            }
        }
    }
    if let Some(vm) = vm.upgrade() {
        vm.agent_gone(&link).await;
    } else {
        link.fail_pending();
    }
}
