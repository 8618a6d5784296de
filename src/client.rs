//! A small async client for the helper's socket protocol, speaking it the way
//! the desktop client does (PROTOCOL.md): one-shot requests, the persistent
//! id-multiplexed RPC pipe, and event subscriptions. Used by the integration
//! tests and by `cowork-helper bench`; [`RawConn`] sends arbitrary bytes for
//! malformed-frame tests.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use guest_agent::framing::{self, FrameError, MAX_CLIENT_FRAME};
use serde_json::{json, Map, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio::task::JoinHandle;

/// How long a call waits for its reply unless told otherwise (the desktop
/// client's own default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("framing error: {0}")]
    Frame(#[from] FrameError),
    #[error("reply is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The helper answered `success:false`; the text is its `error`.
    #[error("helper error: {0}")]
    Remote(String),
    #[error("connection closed before the reply arrived")]
    Closed,
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    #[error("protocol violation: {0}")]
    Protocol(String),
}

impl ClientError {
    /// The helper's error text when it answered `success:false`.
    pub fn remote(&self) -> Option<&str> {
        match self {
            ClientError::Remote(s) => Some(s),
            _ => None,
        }
    }
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// Builds a request body: `{method, id?, params?}` (`params` omitted when null).
pub fn request(method: &str, id: Option<Value>, params: Value) -> Value {
    let mut m = Map::new();
    m.insert("method".into(), Value::String(method.into()));
    if let Some(id) = id {
        m.insert("id".into(), id);
    }
    if !params.is_null() {
        m.insert("params".into(), params);
    }
    Value::Object(m)
}

/// Turns a reply envelope into its `result` (null when absent) or a
/// [`ClientError::Remote`]; anything not shaped like a reply is a
/// [`ClientError::Protocol`].
pub fn reply_result(reply: Value) -> Result<Value> {
    let Value::Object(mut m) = reply else {
        return Err(ClientError::Protocol(format!(
            "reply is not an object: {reply}"
        )));
    };
    match m.get("success") {
        Some(Value::Bool(true)) => Ok(m.remove("result").unwrap_or(Value::Null)),
        Some(Value::Bool(false)) => Err(ClientError::Remote(match m.remove("error") {
            Some(Value::String(s)) => s,
            Some(other) => other.to_string(),
            None => String::new(),
        })),
        _ => Err(ClientError::Protocol(format!(
            "reply has no boolean success: {}",
            Value::Object(m)
        ))),
    }
}

/// Length prefix + body, ready to write.
pub fn encode_frame(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + framing::PREFIX_LEN);
    framing::encode_frame_into(&mut out, body);
    out
}

async fn connect(path: &Path) -> Result<UnixStream> {
    UnixStream::connect(path)
        .await
        .map_err(|source| ClientError::Connect {
            path: path.to_path_buf(),
            source,
        })
}

async fn with_timeout<T>(
    limit: Duration,
    fut: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(ClientError::Timeout(limit)),
    }
}

/// Reads one JSON frame; `Ok(None)` on a clean end of stream (or a reset,
/// which is how a peer that closes on us may look).
async fn read_json<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<Option<Value>> {
    match framing::read_frame(r, MAX_CLIENT_FRAME, buf).await {
        Ok(true) => Ok(Some(serde_json::from_slice(buf)?)),
        Ok(false) => Ok(None),
        Err(FrameError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// One-shot requests: a connection per request, as the client's fallback
/// path (and its remote-config mode) does.
pub struct Client;

impl Client {
    /// Sends `{method, params?}` without an id, half-closes, and returns the
    /// reply's `result`.
    pub async fn one_shot(path: impl AsRef<Path>, method: &str, params: Value) -> Result<Value> {
        reply_result(Self::one_shot_raw(path, &request(method, None, params)).await?)
    }

    /// Sends `body` as one frame, half-closes the write side, and returns
    /// the whole reply envelope.
    pub async fn one_shot_raw(path: impl AsRef<Path>, body: &Value) -> Result<Value> {
        Self::one_shot_timeout(path.as_ref(), body, DEFAULT_TIMEOUT).await
    }

    pub async fn one_shot_timeout(path: &Path, body: &Value, limit: Duration) -> Result<Value> {
        with_timeout(limit, async {
            let mut s = connect(path).await?;
            s.write_all(&encode_frame(&serde_json::to_vec(body)?))
                .await?;
            s.shutdown().await?;
            let mut buf = Vec::new();
            read_json(&mut s, &mut buf)
                .await?
                .ok_or(ClientError::Closed)
        })
        .await
    }
}

type Pending = HashMap<String, oneshot::Sender<Value>>;

struct PipeInner {
    writer: Mutex<OwnedWriteHalf>,
    /// Outstanding calls by the canonical JSON text of their id; `None` once
    /// the connection is gone.
    pending: Arc<StdMutex<Option<Pending>>>,
    /// Frames that matched no outstanding call.
    unmatched: Arc<StdMutex<Vec<Value>>>,
    next_id: AtomicU64,
    reader: JoinHandle<()>,
    timeout: Duration,
}

impl Drop for PipeInner {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// The persistent RPC pipe: numeric incrementing ids, any number of calls in
/// flight, replies matched by id in whatever order they come. Cheap to clone.
#[derive(Clone)]
pub struct Pipe {
    inner: Arc<PipeInner>,
}

fn id_key(id: &Value) -> String {
    id.to_string()
}

impl Pipe {
    pub async fn connect(path: impl AsRef<Path>) -> Result<Pipe> {
        Self::connect_with_timeout(path, DEFAULT_TIMEOUT).await
    }

    /// Connects; calls wait at most `timeout` for their reply.
    pub async fn connect_with_timeout(path: impl AsRef<Path>, timeout: Duration) -> Result<Pipe> {
        let stream = connect(path.as_ref()).await?;
        let (mut rd, wr) = stream.into_split();
        let pending: Arc<StdMutex<Option<Pending>>> = Arc::new(StdMutex::new(Some(HashMap::new())));
        let unmatched = Arc::new(StdMutex::new(Vec::new()));
        let (p, u) = (pending.clone(), unmatched.clone());
        let reader = tokio::spawn(async move {
            let mut buf = Vec::new();
            while let Ok(Some(v)) = read_json(&mut rd, &mut buf).await {
                let key = v.get("id").map(id_key);
                let tx = key.and_then(|k| p.lock().unwrap().as_mut().and_then(|m| m.remove(&k)));
                match tx {
                    Some(tx) => {
                        let _ = tx.send(v);
                    }
                    None => u.lock().unwrap().push(v),
                }
            }
            // Dropping the senders wakes every waiting call with `Closed`.
            p.lock().unwrap().take();
        });
        Ok(Pipe {
            inner: Arc::new(PipeInner {
                writer: Mutex::new(wr),
                pending,
                unmatched,
                next_id: AtomicU64::new(1),
                reader,
                timeout,
            }),
        })
    }

    /// Connects and sends `configure {userDataName, userDataRoot, sessionOnly: true}`
    /// as the desktop client does right after connecting.
    pub async fn connect_profile(
        path: impl AsRef<Path>,
        user_data_name: &str,
        user_data_root: &str,
    ) -> Result<Pipe> {
        let pipe = Self::connect(path).await?;
        pipe.call(
            "configure",
            json!({"userDataName": user_data_name, "userDataRoot": user_data_root, "sessionOnly": true}),
        )
        .await?;
        Ok(pipe)
    }

    /// Calls `method` with the next numeric id and returns its `result`.
    pub async fn call(&self, method: &str, params: Value) -> Result<Value> {
        reply_result(self.call_raw(method, params).await?)
    }

    /// Like [`Pipe::call`] but returns the whole reply envelope.
    pub async fn call_raw(&self, method: &str, params: Value) -> Result<Value> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        self.call_with_id(json!(id), method, params).await
    }

    /// Sends a request with the given `id` (any JSON value) and returns the
    /// reply envelope carrying an equal id.
    pub async fn call_with_id(&self, id: Value, method: &str, params: Value) -> Result<Value> {
        let (tx, rx) = oneshot::channel();
        {
            let mut p = self.inner.pending.lock().unwrap();
            let Some(map) = p.as_mut() else {
                return Err(ClientError::Closed);
            };
            map.insert(id_key(&id), tx);
        }
        let body = serde_json::to_vec(&request(method, Some(id.clone()), params))?;
        let sent = self.send_frame(&body).await;
        let res = match sent {
            Ok(()) => match tokio::time::timeout(self.inner.timeout, rx).await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(_)) => Err(ClientError::Closed),
                Err(_) => Err(ClientError::Timeout(self.inner.timeout)),
            },
            Err(e) => Err(e),
        };
        if res.is_err() {
            if let Some(m) = self.inner.pending.lock().unwrap().as_mut() {
                m.remove(&id_key(&id));
            }
        }
        res
    }

    /// Writes one already-encoded body as a frame on the pipe.
    pub async fn send_frame(&self, body: &[u8]) -> Result<()> {
        let frame = encode_frame(body);
        let mut w = self.inner.writer.lock().await;
        w.write_all(&frame).await?;
        Ok(())
    }

    /// Frames received that answered no outstanding call (taken).
    pub fn take_unmatched(&self) -> Vec<Value> {
        std::mem::take(&mut *self.inner.unmatched.lock().unwrap())
    }

    /// Whether the helper closed the connection.
    pub fn is_closed(&self) -> bool {
        self.inner.pending.lock().unwrap().is_none()
    }
}

/// Output and exit of one process, gathered from a subscription.
#[derive(Debug, Clone, Default)]
pub struct ProcessOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// The `exit` event itself.
    pub exit: Value,
    /// `error` events for the process, in order.
    pub errors: Vec<Value>,
    /// Every event of the process in arrival order.
    pub events: Vec<Value>,
}

impl ProcessOutput {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
    pub fn exit_code(&self) -> Option<i64> {
        self.exit.get("exitCode").and_then(Value::as_i64)
    }
    pub fn signal(&self) -> Option<&str> {
        self.exit.get("signal").and_then(Value::as_str)
    }
}

/// An event subscription: `subscribeEvents`, the `{success:true}` ack, then
/// events. Events skipped by [`Subscription::next_matching`] are kept and
/// handed out by later calls, so several waits can interleave.
pub struct Subscription {
    /// Raw frame bodies from the reader task; parsed on receipt.
    rx: mpsc::Receiver<Result<Vec<u8>>>,
    stash: VecDeque<Value>,
    reader: JoinHandle<()>,
    // Kept open: the desktop client never half-closes its subscription.
    _writer: OwnedWriteHalf,
    closed: bool,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Subscription {
    pub async fn connect(
        path: impl AsRef<Path>,
        user_data_name: &str,
        user_data_root: &str,
    ) -> Result<Subscription> {
        let body = request(
            "subscribeEvents",
            None,
            json!({"userDataName": user_data_name, "userDataRoot": user_data_root}),
        );
        Self::connect_raw(path, &body).await
    }

    /// Subscribes with an arbitrary request body; the first frame must be
    /// exactly an ack with `success: true`.
    pub async fn connect_raw(path: impl AsRef<Path>, body: &Value) -> Result<Subscription> {
        let stream = connect(path.as_ref()).await?;
        let (mut rd, mut wr) = stream.into_split();
        wr.write_all(&encode_frame(&serde_json::to_vec(body)?))
            .await?;
        let mut buf = Vec::new();
        let ack = with_timeout(Duration::from_secs(10), async {
            read_json(&mut rd, &mut buf)
                .await?
                .ok_or(ClientError::Closed)
        })
        .await?;
        if ack.get("success") != Some(&Value::Bool(true)) || ack.get("type").is_some() {
            return Err(ClientError::Protocol(format!(
                "expected the {{success:true}} ack first, got {ack}"
            )));
        }
        let (tx, rx) = mpsc::channel(4096);
        let reader = tokio::spawn(async move {
            loop {
                let mut buf = Vec::new();
                let r = match framing::read_frame(&mut rd, MAX_CLIENT_FRAME, &mut buf).await {
                    Ok(true) => Ok(buf),
                    Ok(false) => return,
                    Err(FrameError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                        return
                    }
                    Err(e) => Err(e.into()),
                };
                let failed = r.is_err();
                if tx.send(r).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(Subscription {
            rx,
            stash: VecDeque::new(),
            reader,
            _writer: wr,
            closed: false,
        })
    }

    async fn recv_raw(&mut self, deadline: Instant) -> Result<Vec<u8>> {
        if self.closed {
            return Err(ClientError::Closed);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, self.rx.recv()).await {
            Ok(Some(r)) => r,
            Ok(None) => {
                self.closed = true;
                Err(ClientError::Closed)
            }
            Err(_) => Err(ClientError::Timeout(left)),
        }
    }

    async fn recv(&mut self, deadline: Instant) -> Result<Value> {
        let body = self.recv_raw(deadline).await?;
        Ok(serde_json::from_slice(&body)?)
    }

    /// The next event's frame body, unparsed (stashed events re-encoded).
    /// For consumers that parse events their own, cheaper way.
    pub async fn next_raw(&mut self, timeout: Duration) -> Result<Vec<u8>> {
        if let Some(v) = self.stash.pop_front() {
            return Ok(serde_json::to_vec(&v)?);
        }
        self.recv_raw(Instant::now() + timeout).await
    }

    /// The next event (stashed ones first).
    pub async fn next_event(&mut self, timeout: Duration) -> Result<Value> {
        if let Some(v) = self.stash.pop_front() {
            return Ok(v);
        }
        self.recv(Instant::now() + timeout).await
    }

    /// The first event satisfying `pred`; others are stashed for later.
    pub async fn next_matching(
        &mut self,
        timeout: Duration,
        mut pred: impl FnMut(&Value) -> bool,
    ) -> Result<Value> {
        if let Some(i) = self.stash.iter().position(&mut pred) {
            return Ok(self.stash.remove(i).expect("index in range"));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.recv(deadline).await?;
            if pred(&v) {
                return Ok(v);
            }
            self.stash.push_back(v);
        }
    }

    /// Waits for an event of `type` (and `step`/`status`-independent).
    pub async fn next_of_type(&mut self, ty: &str, timeout: Duration) -> Result<Value> {
        self.next_matching(timeout, |v| {
            v.get("type").and_then(Value::as_str) == Some(ty)
        })
        .await
    }

    /// Gathers stdout, stderr and errors of process `id` up to and including
    /// its exit event; other processes' events stay stashed.
    pub async fn collect_process(&mut self, id: &str, timeout: Duration) -> Result<ProcessOutput> {
        let deadline = Instant::now() + timeout;
        let mut out = ProcessOutput::default();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = self
                .next_matching(left, |v| v.get("id").and_then(Value::as_str) == Some(id) && is_process_event(v))
                .await
                .map_err(|e| match e {
                    ClientError::Timeout(_) => ClientError::Protocol(format!(
                        "no exit of {id} within {timeout:?}; got so far: stdout {:?}, stderr {:?}, errors {:?}",
                        String::from_utf8_lossy(&out.stdout).chars().take(400).collect::<String>(),
                        String::from_utf8_lossy(&out.stderr).chars().take(400).collect::<String>(),
                        out.errors
                    )),
                    e => e,
                })?;
            out.events.push(ev.clone());
            match ev.get("type").and_then(Value::as_str) {
                Some("stdout") => out.stdout.extend_from_slice(event_data(&ev)?.as_bytes()),
                Some("stderr") => out.stderr.extend_from_slice(event_data(&ev)?.as_bytes()),
                Some("error") => out.errors.push(ev),
                Some("exit") => {
                    out.exit = ev;
                    return Ok(out);
                }
                _ => {}
            }
        }
    }

    /// Events currently stashed (not yet handed out).
    pub fn stashed(&self) -> impl Iterator<Item = &Value> {
        self.stash.iter()
    }

    /// Drains everything that arrives within `window` (plus the stash).
    pub async fn drain_for(&mut self, window: Duration) -> Vec<Value> {
        let mut out: Vec<Value> = self.stash.drain(..).collect();
        let deadline = Instant::now() + window;
        while let Ok(v) = self.recv(deadline).await {
            out.push(v);
        }
        out
    }
}

/// stdout/stderr/exit/error events carry a process id.
pub fn is_process_event(v: &Value) -> bool {
    matches!(
        v.get("type").and_then(Value::as_str),
        Some("stdout" | "stderr" | "exit" | "error")
    )
}

fn event_data(v: &Value) -> Result<&str> {
    v.get("data")
        .and_then(Value::as_str)
        .ok_or_else(|| ClientError::Protocol(format!("output event without string data: {v}")))
}

/// A bare connection for sending arbitrary bytes and reading raw replies.
pub struct RawConn {
    stream: UnixStream,
    buf: Vec<u8>,
}

impl RawConn {
    pub async fn connect(path: impl AsRef<Path>) -> Result<RawConn> {
        Ok(RawConn {
            stream: connect(path.as_ref()).await?,
            buf: Vec::new(),
        })
    }

    /// Writes bytes exactly as given (no framing).
    pub async fn send_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream.write_all(bytes).await?;
        Ok(())
    }

    /// Writes `body` as one frame.
    pub async fn send_frame(&mut self, body: &[u8]) -> Result<()> {
        self.send_bytes(&encode_frame(body)).await
    }

    pub async fn send_json(&mut self, v: &Value) -> Result<()> {
        self.send_frame(&serde_json::to_vec(v)?).await
    }

    /// Half-closes the write side.
    pub async fn shutdown_write(&mut self) -> Result<()> {
        self.stream.shutdown().await?;
        Ok(())
    }

    /// The next reply frame as JSON, `Ok(None)` when the helper closed the
    /// connection.
    pub async fn read_reply(&mut self, timeout: Duration) -> Result<Option<Value>> {
        let (s, buf) = (&mut self.stream, &mut self.buf);
        with_timeout(timeout, read_json(s, buf)).await
    }
}
