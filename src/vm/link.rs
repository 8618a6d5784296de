//! The host end of the agent link: framed requests with ids and
//! deadlines ([`AgentLink::call`], [`AgentLink::send`]), one writer task
//! that coalesces queued frames, one reader task that matches answers to
//! their requests and hands the agent's unsolicited messages to the [`ProfileVm`];
//! and the agent's hello, which must be its first message.
//!
//! The agent is not trusted (a guest is hostile by assumption): whatever it
//! sends, the helper neither panics nor grows without bound, and a caller
//! never waits longer than its deadline.
//!
//! - A frame the link cannot parse (announced over [`proto::MAX_MESSAGE`],
//!   cut short, a header that is not one of our messages, a second hello)
//!   is a protocol violation: the link is closed, every request waiting on
//!   it fails with the reason, and the VM handles it like the agent going
//!   away (each running process gets a fatal `error` event and an `exit`).
//! - Answers to ids nobody waits for (late answers of requests that timed
//!   out, or made-up ids) are dropped; output, exits and errors for process
//!   ids the host does not know are dropped by the process table. Such
//!   drops are counted and logged once per link, not once per message.
//! - At most [`MAX_PENDING_REQUESTS`] requests may await their answer at
//!   once (the helper's `--max-pending-requests`,
//!   [`VmConfig::max_pending_requests`](crate::backend::VmConfig::max_pending_requests),
//!   overrides it); beyond it a request fails at
//!   once with [`ProfileVmError::Busy`]. A request whose caller gave up (timed out
//!   or dropped) leaves the table at once.
//! - At most [`MAX_QUEUED_BYTES`] of frames wait for the writer (and at
//!   most [`AGENT_QUEUE`] frames); a sender waits for room no longer than
//!   its deadline, so an agent that stops reading makes requests fail with
//!   a timeout instead of piling up.
//!
//! - When the machine ends, whatever the agent wrote before it died is
//!   still read ([`AgentLink::drain`]): an answer or an exit the agent sent
//!   just before the end reaches its caller instead of a "disconnected"
//!   error.
//!
//! Limits: one write carries at most about [`WRITE_BATCH`] bytes.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use guest_agent::framing::{self, FrameError};
use guest_agent::proto::{self, AgentMessage, Envelope, Hello, HostMessage, Op};
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};

use super::{ProfileVm, ProfileVmError};
use vmm::sync::MutexExt;
use vmm::sync::RwLockExt;

/// Frames queued towards the agent before senders wait.
const AGENT_QUEUE: usize = 256;

/// Bytes of frames queued towards the agent before senders wait: 16 MiB,
/// more than one largest frame ([`proto::MAX_MESSAGE`], which always fits
/// an empty queue) plus the small ones behind it, and sixteen of the
/// writer's batches, so a reading agent never waits for the queue; it is
/// also what an agent that stops reading can make the helper hold per VM.
pub const MAX_QUEUED_BYTES: usize = 16 * 1024 * 1024;

/// Largest batch the link writer coalesces into one write.
const WRITE_BATCH: usize = 1024 * 1024;

/// Requests to the agent that may await their answer at once, per VM.
/// Far above what a client has in flight (the desktop client waits for
/// each spawn and pipelines stdin writes the agent answers at once), and
/// what an agent that stops answering can make the helper track: each
/// entry is a few hundred bytes until its caller's deadline passes.
pub const MAX_PENDING_REQUESTS: usize = 1024;

/// Environment variable of `--max-pending-requests`, which overrides
/// [`MAX_PENDING_REQUESTS`] (tests use a small number); read by
/// [`crate::cli`] into [`crate::backend::VmConfig::max_pending_requests`].
pub const MAX_PENDING_ENV: &str = "COWORK_MAX_PENDING_REQUESTS";

/// How long [`AgentLink::drain`] waits for the reader to take what the
/// agent wrote before its machine ended. Frames already in the socket
/// take microseconds; the bound only matters for a reader stuck behind a
/// slow event consumer, and keeps a machine's teardown from hanging on it.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// Why the agent's hello, its first message, was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum HelloError {
    #[error("the guest agent closed the link before its hello")]
    Closed,
    #[error("reading the agent hello: {0}")]
    Read(#[source] FrameError),
    #[error(
        "guest agent speaks protocol {agent} but this helper speaks {}",
        proto::PROTOCOL_VERSION
    )]
    Protocol { agent: u32 },
    #[error("the guest agent's first message was not a hello")]
    NotHello,
    #[error("malformed agent hello: {0}")]
    Malformed(#[source] proto::ProtoError),
    #[error("the OS random source failed for the guest's setup: {0}")]
    Entropy(getrandom::Error),
    #[error("sending the guest its setup: {0}")]
    SendSetup(#[source] std::io::Error),
    #[error("the guest agent said its template hello again after its setup")]
    TemplateTwice,
}

/// Answer of one agent request.
struct Reply {
    result: Result<Value, String>,
    payload: Vec<u8>,
}

/// Requests awaiting their answer, by id.
type PendingMap = Arc<Mutex<HashMap<u64, oneshot::Sender<Reply>>>>;

/// The host end of the agent protocol.
pub struct AgentLink {
    tx: mpsc::Sender<(Vec<u8>, OwnedSemaphorePermit)>,
    /// Byte budget of the frames queued for the writer.
    queued: Arc<Semaphore>,
    pending: PendingMap,
    max_pending: usize,
    next_id: AtomicU64,
    pub(super) closed: AtomicBool,
    /// Why the link ended, when the agent broke the protocol (said to the
    /// callers it fails and in the processes' fatal events).
    violation: Mutex<Option<String>>,
    /// The link's socket (a second descriptor of it), to end its reading
    /// side once the machine is gone ([`AgentLink::drain`]).
    socket: Option<OwnedFd>,
    /// Turns true when the reader task has handled its last frame.
    reader_done: watch::Receiver<bool>,
    pub hello: Hello,
}

impl AgentLink {
    /// Sends `op` (with `payload`) and waits for its answer; `timeout`
    /// bounds the wait for room in the queue and, again, for the answer.
    pub async fn call(
        &self,
        op: Op,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(Value, Vec<u8>), ProfileVmError> {
        self.send_within(op, payload, timeout)
            .await?
            .wait(self, timeout)
            .await
    }

    /// Queues `op` towards the agent. Requests sent one after another reach
    /// the agent in that order; the answer is awaited separately.
    pub async fn send(&self, op: Op, payload: &[u8]) -> Result<PendingCall, ProfileVmError> {
        self.send_within(op, payload, super::CALL_TIMEOUT).await
    }

    /// [`AgentLink::send`], waiting at most `timeout` for room in the queue.
    async fn send_within(
        &self,
        op: Op,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<PendingCall, ProfileVmError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(self.gone_error());
        }
        let name = op_name(&op);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = self.pending.locked();
            if pending.len() >= self.max_pending {
                return Err(ProfileVmError::Busy {
                    op: name,
                    limit: self.max_pending,
                });
            }
            pending.insert(id, tx);
        }
        // From here on the entry leaves the table when `call` is dropped.
        let call = PendingCall {
            id,
            name,
            rx,
            pending: self.pending.clone(),
        };
        let mut frame = Vec::with_capacity(64 + payload.len());
        proto::encode_frame_into(&mut frame, &HostMessage::Request { id, op }, payload);
        self.enqueue(frame, name, timeout).await?;
        Ok(call)
    }

    /// Puts one frame in the writer's queue, waiting at most `timeout` for
    /// room (bytes and frames).
    async fn enqueue(
        &self,
        frame: Vec<u8>,
        op: &'static str,
        timeout: Duration,
    ) -> Result<(), ProfileVmError> {
        // A frame never exceeds MAX_MESSAGE plus its prefix, far below the
        // budget, so one frame always fits an empty queue.
        let cost = u32::try_from(frame.len().min(MAX_QUEUED_BYTES)).unwrap_or(u32::MAX);
        let queue = async {
            let permit = self
                .queued
                .clone()
                .acquire_many_owned(cost)
                .await
                .map_err(|_| self.gone_error())?;
            self.tx
                .send((frame, permit))
                .await
                .map_err(|_| self.gone_error())
        };
        match tokio::time::timeout(timeout, queue).await {
            Ok(r) => r,
            Err(_) => Err(ProfileVmError::NotReading { op, timeout }),
        }
    }

    /// The error of a request on a link that ended.
    fn gone_error(&self) -> ProfileVmError {
        match self.violation.locked().clone() {
            Some(why) => ProfileVmError::Agent(why),
            None => ProfileVmError::AgentGone,
        }
    }

    /// Why the link ended, when the agent broke the protocol.
    pub(super) fn violation(&self) -> Option<String> {
        self.violation.locked().clone()
    }
}

/// A request that reached the agent's queue and awaits its answer. Dropping
/// it (the caller gave up) forgets the request: a late answer is dropped.
pub struct PendingCall {
    id: u64,
    name: &'static str,
    rx: oneshot::Receiver<Reply>,
    pending: PendingMap,
}

impl Drop for PendingCall {
    fn drop(&mut self) {
        self.pending.locked().remove(&self.id);
    }
}

impl PendingCall {
    /// Waits for the answer.
    pub async fn wait(
        mut self,
        _link: &AgentLink,
        timeout: Duration,
    ) -> Result<(Value, Vec<u8>), ProfileVmError> {
        let name = self.name;
        match tokio::time::timeout(timeout, &mut self.rx).await {
            Ok(Ok(Reply {
                result: Ok(v),
                payload,
            })) => Ok((v, payload)),
            Ok(Ok(Reply { result: Err(e), .. })) => Err(ProfileVmError::Agent(e)),
            Ok(Err(_)) => Err(ProfileVmError::AgentGone),
            Err(_) => Err(ProfileVmError::Timeout { op: name, timeout }),
        }
    }
}

impl AgentLink {
    /// Sends a message that has no answer.
    async fn notify(&self, msg: &HostMessage) -> Result<(), ProfileVmError> {
        let mut frame = Vec::new();
        proto::encode_frame_into(&mut frame, msg, &[]);
        self.enqueue(frame, "sendGuestResponse", super::CALL_TIMEOUT)
            .await
    }

    /// Ends the link: every waiting request fails (with `violation` when
    /// the agent broke the protocol), later ones fail at once.
    pub(super) fn fail_pending(&self) {
        self.closed.store(true, Ordering::Release);
        self.queued.close();
        let why = self
            .violation()
            .unwrap_or_else(|| "the guest agent disconnected".into());
        for (_, tx) in self.pending.locked().drain() {
            let _ = tx.send(Reply {
                result: Err(why.clone()),
                payload: vec![],
            });
        }
    }

    /// Once the machine has ended: lets the reader take every frame the
    /// agent wrote before it died, then returns (after [`DRAIN_LIMIT`] at
    /// most). Nothing new can arrive, so the socket's reading side is shut:
    /// the reader gets what is buffered, then end-of-stream, whether or not
    /// the backend still holds the other end.
    pub(super) async fn drain(&self) {
        if let Some(socket) = &self.socket {
            // SAFETY: shutdown(2) on a socket descriptor this link owns.
            if unsafe { libc::shutdown(socket.as_raw_fd(), libc::SHUT_RD) } != 0 {
                let e = std::io::Error::last_os_error();
                tracing::debug!(error = %e, "shutting the agent link's reading side");
            }
        }
        let mut done = self.reader_done.clone();
        if tokio::time::timeout(DRAIN_LIMIT, done.wait_for(|d| *d))
            .await
            .is_err()
        {
            tracing::warn!(
                limit_ms = DRAIN_LIMIT.as_millis() as u64,
                "the agent link's reader did not finish; its last messages are dropped"
            );
        }
    }

    /// Records that the agent broke the protocol (the first reason wins).
    fn set_violation(&self, why: String) {
        self.violation.locked().get_or_insert(why);
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
        Op::TrustCa { .. } => "trustCa",
    }
}

impl ProfileVm {
    /// Wires a connected agent stream: writer and reader tasks.
    pub(super) fn attach(self: &Arc<Self>, hello: Hello, stream: UnixStream) -> Arc<AgentLink> {
        self.attach_tasks(hello, stream).0
    }

    /// Runs the host end of the link over `data`, the bytes an agent sends
    /// (its hello first), until the link ends; the fuzz target of the link
    /// reader. Nothing the host sends is answered.
    #[cfg(feature = "fuzzing")]
    #[doc(hidden)]
    pub async fn replay_agent_stream(
        self: &Arc<Self>,
        data: Vec<u8>,
    ) -> Result<(), ProfileVmError> {
        let (host, mut agent) = UnixStream::pair()
            .map_err(|e| ProfileVmError::Start(super::StartError::Socketpair(e)))?;
        let feeder = tokio::spawn(async move {
            let _ = agent.write_all(&data).await;
            let _ = agent.shutdown().await;
            // Kept open (and drained) until the host side is done.
            let mut sink = Vec::new();
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut agent, &mut sink).await;
        });
        let (hello, stream) = match read_hello(host).await {
            Ok(h) => h,
            Err(e) => {
                feeder.abort();
                return Err(ProfileVmError::Start(e.into()));
            }
        };
        let (link, reader) = self.attach_tasks(hello, stream);
        let _ = reader.await;
        link.fail_pending();
        feeder.abort();
        Ok(())
    }

    /// [`ProfileVm::attach`], also returning the reader task.
    fn attach_tasks(
        self: &Arc<Self>,
        hello: Hello,
        stream: UnixStream,
    ) -> (Arc<AgentLink>, tokio::task::JoinHandle<()>) {
        // Only descriptor exhaustion fails the dup; the drain then waits for
        // the backend to close the stream instead.
        let socket = stream
            .as_fd()
            .try_clone_to_owned()
            .inspect_err(
                |e| tracing::warn!(error = %e, "cannot keep a second descriptor of the agent link"),
            )
            .ok();
        let (done_tx, reader_done) = watch::channel(false);
        let (rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::channel(AGENT_QUEUE);
        let link = Arc::new(AgentLink {
            tx,
            queued: Arc::new(Semaphore::new(MAX_QUEUED_BYTES)),
            pending: Arc::new(Mutex::new(HashMap::new())),
            max_pending: self.cfg.max_pending_requests,
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            violation: Mutex::new(None),
            socket,
            reader_done,
            hello,
        });
        *self.link.write_locked() = Some(link.clone());
        tokio::spawn(link_writer(wr, rx));
        let reader = tokio::spawn(link_reader(Arc::downgrade(self), link.clone(), rd, done_tx));
        (link, reader)
    }

    pub async fn send_guest_response(
        &self,
        id: String,
        result_json: Option<String>,
        error: Option<String>,
    ) -> Result<(), ProfileVmError> {
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

/// Reads the agent's hello; a VM's template hello ([`Hello::is_template`])
/// gets this boot's `Setup` (host entropy and wall clock, see
/// `guest_agent::agent::setup`, and `trust_ca`, the egress CA the agent
/// trusts before its final hello) and the final hello is read after it.
pub(super) async fn hello_with_setup(
    stream: UnixStream,
    trust_ca: Option<&str>,
) -> Result<(Hello, UnixStream), HelloError> {
    use tokio::io::AsyncWriteExt;
    let (hello, mut stream) = read_hello(stream).await?;
    if !hello.is_template() {
        return Ok((hello, stream));
    }
    let mut entropy = [0u8; proto::SETUP_ENTROPY_BYTES];
    getrandom::getrandom(&mut entropy).map_err(HelloError::Entropy)?;
    let wall_clock_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let mut frame = Vec::new();
    let setup = HostMessage::Setup {
        wall_clock_ns,
        trust_ca: trust_ca.map(String::from),
    };
    proto::encode_frame_into(&mut frame, &setup, &entropy);
    stream
        .write_all(&frame)
        .await
        .map_err(HelloError::SendSetup)?;
    let (hello, stream) = read_hello(stream).await?;
    if hello.is_template() {
        return Err(HelloError::TemplateTwice);
    }
    Ok((hello, stream))
}

/// Reads the agent's first message, which must be its hello.
pub(super) async fn read_hello(mut stream: UnixStream) -> Result<(Hello, UnixStream), HelloError> {
    let mut buf = Vec::new();
    match framing::read_frame(&mut stream, proto::MAX_MESSAGE, &mut buf).await {
        Ok(true) => {}
        Ok(false) => return Err(HelloError::Closed),
        Err(e) => return Err(HelloError::Read(e)),
    }
    match proto::decode::<AgentMessage>(buf) {
        Ok(Envelope {
            header: AgentMessage::Hello(h),
            ..
        }) => {
            if h.protocol != proto::PROTOCOL_VERSION {
                return Err(HelloError::Protocol { agent: h.protocol });
            }
            Ok((h, stream))
        }
        Ok(_) => Err(HelloError::NotHello),
        Err(e) => Err(HelloError::Malformed(e)),
    }
}

async fn link_writer(
    mut wr: tokio::net::unix::OwnedWriteHalf,
    mut rx: mpsc::Receiver<(Vec<u8>, OwnedSemaphorePermit)>,
) {
    let mut batch = Vec::new();
    // The permits of the frames in `batch`: their bytes stay counted as
    // queued until they are written.
    let mut permits = Vec::new();
    while let Some((first, permit)) = rx.recv().await {
        permits.push(permit);
        if first.len() >= WRITE_BATCH {
            // A large frame goes out as it is, without a copy.
            if let Err(e) = wr.write_all(&first).await {
                tracing::debug!(error = %e, "agent link write failed");
                break;
            }
            permits.clear();
            continue;
        }
        batch.clear();
        batch.extend_from_slice(&first);
        drop(first);
        while batch.len() < WRITE_BATCH {
            match rx.try_recv() {
                Ok((more, permit)) => {
                    batch.extend_from_slice(&more);
                    permits.push(permit);
                }
                Err(_) => break,
            }
        }
        if let Err(e) = wr.write_all(&batch).await {
            tracing::debug!(error = %e, "agent link write failed");
            break;
        }
        permits.clear();
        // A burst of large frames must not pin its peak size.
        if batch.capacity() > 2 * WRITE_BATCH {
            batch = Vec::new();
        }
    }
    let _ = wr.shutdown().await;
}

/// The sentence a protocol violation ends the link with (callers and
/// processes get it as their error).
fn violation_text(what: &str) -> String {
    format!(
        "the guest agent broke the link protocol ({what}); the helper closed the link: \
         stop and start the VM"
    )
}

/// Messages the link reader dropped, counted for one summary line.
#[derive(Default)]
struct Dropped {
    /// Answers to requests nobody waits for.
    stray_answers: u64,
    /// Output, exits and errors of processes the host does not know.
    unknown_process: u64,
}

impl Dropped {
    fn note_stray_answer(&mut self, id: u64) {
        if self.stray_answers == 0 {
            tracing::debug!(
                id,
                "answer to a request nobody waits for dropped (later ones are counted)"
            );
        }
        self.stray_answers += 1;
    }

    fn note_unknown_process(&mut self) {
        if self.unknown_process == 0 {
            tracing::warn!(
                "message about a process the helper does not know dropped (later ones are counted)"
            );
        }
        self.unknown_process += 1;
    }
}

async fn link_reader(
    vm: std::sync::Weak<ProfileVm>,
    link: Arc<AgentLink>,
    mut rd: tokio::net::unix::OwnedReadHalf,
    done: watch::Sender<bool>,
) {
    let mut buf = Vec::new();
    let mut dropped = Dropped::default();
    loop {
        match framing::read_frame(&mut rd, proto::MAX_MESSAGE, &mut buf).await {
            Ok(true) => {}
            Ok(false) => break,
            Err(FrameError::Io(e)) => {
                tracing::debug!(error = %e, "agent link read failed");
                break;
            }
            Err(e) => {
                tracing::error!(error = %e, "agent link framing lost; closing the link");
                link.set_violation(violation_text(&e.to_string()));
                break;
            }
        }
        // The frame buffer is reused across frames; output is handled from
        // a view of it, only answers copy their payload out.
        let (header, payload) = match proto::decode_ref::<AgentMessage>(&buf) {
            Ok(decoded) => decoded,
            Err(e) => {
                // serde quotes the guest's bytes: escaped, they cannot forge a
                // log line.
                tracing::error!(error = %e.to_string().escape_debug(), "malformed agent message; closing the link");
                link.set_violation(violation_text(&e.to_string()));
                break;
            }
        };
        match header {
            AgentMessage::Response { id, error, result } => {
                let tx = link.pending.locked().remove(&id);
                match tx {
                    Some(tx) => {
                        let result = match error {
                            Some(e) => Err(e),
                            None => Ok(result),
                        };
                        let _ = tx.send(Reply {
                            result,
                            payload: payload.to_vec(),
                        });
                    }
                    None => dropped.note_stray_answer(id),
                }
            }
            AgentMessage::Hello(_) => {
                tracing::error!("second hello from the guest agent; closing the link");
                link.set_violation(violation_text("a second hello"));
                break;
            }
            other => {
                let Some(vm) = vm.upgrade() else { break };
                if !vm.on_agent_message(other, payload).await {
                    dropped.note_unknown_process();
                }
            }
        }
        // A huge frame must not pin its buffer for the link's life.
        if buf.capacity() > 2 * proto::MAX_CHUNK + 4096 {
            buf = Vec::new();
        }
    }
    if dropped.stray_answers > 0 || dropped.unknown_process > 0 {
        tracing::warn!(
            stray_answers = dropped.stray_answers,
            unknown_process = dropped.unknown_process,
            "agent messages dropped on this link"
        );
    }
    // Every frame is handled: a drain waiting on this can account for the
    // rest (it and this task both end up in agent_gone; the first does it).
    done.send_replace(true);
    if let Some(vm) = vm.upgrade() {
        vm.agent_gone(&link).await;
    } else {
        link.fail_pending();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(template: bool) -> Vec<u8> {
        let h = Hello {
            protocol: proto::PROTOCOL_VERSION,
            phase: template.then(|| Hello::TEMPLATE.to_string()),
            ..Hello::default()
        };
        let mut f = Vec::new();
        proto::encode_frame_into(&mut f, &AgentMessage::Hello(h), &[]);
        f
    }

    /// A VM's agent: template hello, this boot's Setup, final hello.
    #[tokio::test]
    async fn a_template_hello_gets_the_boots_setup_before_the_final_one() {
        use tokio::io::AsyncWriteExt;
        let (host, mut agent) = UnixStream::pair().unwrap();
        let guest = tokio::spawn(async move {
            agent.write_all(&hello(true)).await.unwrap();
            let mut buf = Vec::new();
            assert!(
                framing::read_frame(&mut agent, proto::MAX_MESSAGE, &mut buf)
                    .await
                    .unwrap()
            );
            let env = proto::decode::<HostMessage>(buf).unwrap();
            let HostMessage::Setup {
                wall_clock_ns,
                trust_ca,
            } = env.header
            else {
                panic!("not a setup: {:?}", env.header)
            };
            assert_eq!(trust_ca.as_deref(), Some("the CA"));
            agent.write_all(&hello(false)).await.unwrap();
            (wall_clock_ns, env.payload)
        });
        let (h, _stream) = hello_with_setup(host, Some("the CA")).await.unwrap();
        assert!(!h.is_template());
        let (clock, entropy) = guest.await.unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        assert!(now.abs_diff(clock) < 5_000_000_000, "{clock} vs {now}");
        assert_eq!(entropy.len(), proto::SETUP_ENTROPY_BYTES);
        assert!(entropy.iter().any(|&b| b != 0));
    }

    #[tokio::test]
    async fn a_sandbox_hello_needs_no_setup_and_a_second_template_is_refused() {
        use tokio::io::AsyncWriteExt;
        let (host, mut agent) = UnixStream::pair().unwrap();
        agent.write_all(&hello(false)).await.unwrap();
        let (h, _s) = hello_with_setup(host, None).await.unwrap();
        assert!(!h.is_template());

        let (host, mut agent) = UnixStream::pair().unwrap();
        let guest = tokio::spawn(async move {
            agent.write_all(&hello(true)).await.unwrap();
            let mut buf = Vec::new();
            framing::read_frame(&mut agent, proto::MAX_MESSAGE, &mut buf)
                .await
                .unwrap();
            agent.write_all(&hello(true)).await.unwrap();
            agent
        });
        let e = hello_with_setup(host, None).await.unwrap_err().to_string();
        assert!(e.contains("template hello again"), "{e}");
        guest.await.unwrap();
    }
}
