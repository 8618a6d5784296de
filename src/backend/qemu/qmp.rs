//! A small async client of the QEMU Machine Protocol (QMP) on the Unix
//! socket QEMU opens with `-qmp unix:<path>,server=on,wait=off`: connect
//! (waiting for QEMU to create the socket), negotiate capabilities, then run
//! commands one at a time (`stop`, `cont`, migration, `chardev-add`,
//! `device_add`, `getfd` with a descriptor passed as `SCM_RIGHTS`, ...).
//!
//! Protocol: one JSON object per line. Each command carries an `"id"` (a
//! counter) and its reply is the `{"return": ...}` or `{"error": ...}` with
//! the same id; a reply with another id (the late answer to a command whose
//! call timed out or was cancelled) is skipped. Asynchronous events
//! (`{"event": ...}`) may come at any time: they are skipped while waiting
//! for a reply and the last [`MAX_EVENTS`] are kept ([`Qmp::events`]).
//!
//! Limits: one command in flight at a time (`&mut self`); no out-of-band
//! execution (the `oob` capability is not enabled); a message longer than
//! [`MAX_MESSAGE`] bytes is refused. A call interrupted while its command
//! was being written (a timeout or a dropped future) leaves the connection
//! out of step: every later call fails with [`QmpError::Desynchronized`]
//! and QEMU has to be restarted. An interrupted read is harmless (the bytes
//! read so far are kept). Paths are sent as JSON strings, so they must be
//! valid UTF-8.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Map, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio::time::{sleep_until, timeout_at, Instant};

/// How long one command may take, from sending it to its reply, before
/// [`Qmp::execute`] gives up with [`QmpError::Timeout`].
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long [`Qmp::connect`] waits between attempts while QEMU has not
/// created (or is not yet listening on) its QMP socket.
pub const CONNECT_RETRY: Duration = Duration::from_millis(5);
/// The first pause between two `query-migrate` polls of
/// [`Qmp::wait_migration`]; it doubles up to [`MIGRATION_POLL_MAX`].
pub const MIGRATION_POLL_FIRST: Duration = Duration::from_millis(2);
/// The longest pause between two `query-migrate` polls.
pub const MIGRATION_POLL_MAX: Duration = Duration::from_millis(5);
/// How many asynchronous events [`Qmp::events`] keeps (the most recent).
pub const MAX_EVENTS: usize = 64;
/// The longest QMP message accepted from QEMU, in bytes (the largest reply,
/// `query-qmp-schema`, is a few hundred KiB).
pub const MAX_MESSAGE: usize = 16 << 20;
/// How many bytes of an unexpected message are quoted in an error.
const QUOTE_LEN: usize = 200;
/// How many bytes one read from the socket asks for.
const READ_CHUNK: usize = 8192;
/// Room for a control message carrying one descriptor.
// SAFETY: CMSG_SPACE only computes a size from its argument.
const FD_CMSG_SPACE: usize = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as usize;

/// Errors of the QMP client, worded for the log.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("cannot connect to QEMU's QMP socket {}: {source}", path.display())]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the QMP connection to QEMU failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("QEMU closed its QMP connection (it probably exited; see its console output)")]
    Closed,
    #[error("QEMU sent an unexpected QMP message: {0}")]
    Malformed(String),
    #[error("QEMU refused `{command}`: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    #[error("the migration ended as `{status}`: {desc}")]
    Migration { status: String, desc: String },
    #[error("{} is not valid UTF-8 and QMP takes paths as JSON strings; use a UTF-8 path", path.display())]
    NonUtf8Path { path: PathBuf },
    #[error(
        "the QMP connection is out of step: an earlier command was interrupted while being \
         sent; QEMU has to be restarted"
    )]
    Desynchronized,
}

/// How a migration ended when it succeeded ([`Qmp::wait_migration`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationDone {
    /// The final `query-migrate` status (`"completed"`).
    pub status: String,
    /// The migration's `total-time` in milliseconds, when QEMU gave it.
    pub total_time_ms: Option<u64>,
    /// The migration's `downtime` in milliseconds, when QEMU gave it.
    pub downtime_ms: Option<u64>,
}

/// A connected, negotiated QMP session with one QEMU.
#[derive(Debug)]
pub struct Qmp {
    stream: UnixStream,
    /// Bytes read from QEMU and not yet consumed as a message.
    rbuf: Vec<u8>,
    /// How much of `rbuf` is known to hold no newline.
    scanned: usize,
    /// The id of the next command.
    next_id: u64,
    /// The last [`MAX_EVENTS`] events, oldest first.
    events: Vec<Value>,
    /// A command's line was being written when its call was interrupted.
    writing: bool,
}

/// One message from QEMU, sorted by kind.
enum Message {
    Greeting(Value),
    Event(Value),
    Reply {
        id: Option<Value>,
        result: Result<Value, (String, String)>,
    },
}

impl Qmp {
    /// Connects to QEMU's QMP socket at `path`, retrying every
    /// [`CONNECT_RETRY`] while it does not exist or refuses connections,
    /// reads the greeting and negotiates capabilities, all before
    /// `deadline`.
    pub async fn connect(path: &Path, deadline: Instant) -> Result<Qmp, QmpError> {
        let started = Instant::now();
        let timeout = |what: String| QmpError::Timeout {
            what,
            after: Instant::now().saturating_duration_since(started),
        };
        let stream = loop {
            let attempt = match timeout_at(deadline, UnixStream::connect(path)).await {
                Ok(attempt) => attempt,
                Err(_) => return Err(timeout(format!("QEMU's QMP socket {}", path.display()))),
            };
            match attempt {
                Ok(stream) => break stream,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                    ) =>
                {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(timeout(format!(
                            "QEMU to open its QMP socket {} (last attempt: {e})",
                            path.display()
                        )));
                    }
                    sleep_until((now + CONNECT_RETRY).min(deadline)).await;
                }
                Err(source) => {
                    return Err(QmpError::Connect {
                        path: path.to_owned(),
                        source,
                    })
                }
            }
        };
        let mut qmp = Qmp {
            stream,
            rbuf: Vec::new(),
            scanned: 0,
            next_id: 1,
            events: Vec::new(),
            writing: false,
        };
        let greeting = match timeout_at(deadline, qmp.read_message()).await {
            Ok(message) => message?,
            Err(_) => {
                return Err(timeout(format!(
                    "QEMU's QMP greeting on {}",
                    path.display()
                )))
            }
        };
        match greeting {
            Message::Greeting(greeting) => {
                let version = &greeting["QMP"]["version"]["qemu"];
                tracing::debug!(
                    path = %path.display(),
                    version = %format_args!("{}.{}.{}", version["major"], version["minor"], version["micro"]),
                    "QMP connected"
                );
            }
            Message::Event(event)
            | Message::Reply {
                result: Ok(event), ..
            } => {
                return Err(QmpError::Malformed(format!(
                    "expected the QMP greeting, got {}",
                    quote(event.to_string().as_bytes())
                )))
            }
            Message::Reply {
                result: Err((class, desc)),
                ..
            } => {
                return Err(QmpError::Malformed(format!(
                    "expected the QMP greeting, got the error {class}: {desc}"
                )))
            }
        }
        qmp.run("qmp_capabilities", None, None, deadline, false)
            .await?;
        Ok(qmp)
    }

    /// Runs `command` with `arguments` (a JSON object) and returns its
    /// `return` value; an error reply becomes [`QmpError::Command`]. Gives
    /// up after [`COMMAND_TIMEOUT`].
    pub async fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let limit = Instant::now() + COMMAND_TIMEOUT;
        self.run(command, arguments, None, limit, false).await
    }

    /// Passes `fd` to QEMU under `name` (`getfd`), as `SCM_RIGHTS` data on
    /// the command's own message; commands can then name it (`"fd": name`).
    pub async fn send_fd(&mut self, name: &str, fd: BorrowedFd<'_>) -> Result<(), QmpError> {
        let limit = Instant::now() + COMMAND_TIMEOUT;
        self.run(
            "getfd",
            Some(json!({ "fdname": name })),
            Some(fd),
            limit,
            false,
        )
        .await?;
        Ok(())
    }

    /// The last [`MAX_EVENTS`] asynchronous events QEMU sent, oldest first,
    /// as received (`{"event": ..., "data": ..., "timestamp": ...}`).
    pub fn events(&self) -> &[Value] {
        &self.events
    }

    /// Pauses the guest's CPUs (`stop`).
    pub async fn stop(&mut self) -> Result<(), QmpError> {
        self.execute("stop", None).await.map(drop)
    }

    /// Resumes the guest's CPUs (`cont`).
    pub async fn cont(&mut self) -> Result<(), QmpError> {
        self.execute("cont", None).await.map(drop)
    }

    /// Turns migration capabilities on or off (`migrate-set-capabilities`).
    pub async fn set_capabilities(&mut self, caps: &[(&str, bool)]) -> Result<(), QmpError> {
        let capabilities: Vec<Value> = caps
            .iter()
            .map(|(capability, state)| json!({ "capability": capability, "state": state }))
            .collect();
        self.execute(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": capabilities })),
        )
        .await
        .map(drop)
    }

    /// Starts migrating the guest to `uri` (`migrate`); returns once QEMU
    /// accepted it ([`Qmp::wait_migration`] waits for its end).
    pub async fn migrate(&mut self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// Makes a QEMU started with `-incoming defer` receive a migration
    /// from `uri` (`migrate-incoming`).
    pub async fn migrate_incoming(&mut self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate-incoming", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// Polls `query-migrate` (every [`MIGRATION_POLL_FIRST`] growing to
    /// [`MIGRATION_POLL_MAX`]) until the migration completed, failed or was
    /// cancelled ([`QmpError::Migration`], with QEMU's `error-desc`), or
    /// `deadline` passed ([`QmpError::Timeout`]).
    pub async fn wait_migration(&mut self, deadline: Instant) -> Result<MigrationDone, QmpError> {
        let started = Instant::now();
        let mut pause = MIGRATION_POLL_FIRST;
        let mut last = String::new();
        loop {
            let limit = deadline.min(Instant::now() + COMMAND_TIMEOUT);
            let info = match self.run("query-migrate", None, None, limit, true).await {
                Err(QmpError::Timeout { .. }) if Instant::now() >= deadline => {
                    return Err(QmpError::Timeout {
                        what: format!("the migration to end (last status: {last:?})"),
                        after: Instant::now().saturating_duration_since(started),
                    })
                }
                other => other?,
            };
            // No status: no migration ever started (yet).
            let status = info.get("status").and_then(Value::as_str).unwrap_or("none");
            if status != last {
                tracing::debug!(status, "migration status");
                last = status.to_owned();
            }
            match status {
                "completed" => {
                    return Ok(MigrationDone {
                        status: last,
                        total_time_ms: info.get("total-time").and_then(Value::as_u64),
                        downtime_ms: info.get("downtime").and_then(Value::as_u64),
                    })
                }
                "failed" | "cancelled" => {
                    let desc = info
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("QEMU gave no reason");
                    return Err(QmpError::Migration {
                        status: last,
                        desc: desc.to_owned(),
                    });
                }
                _ => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(QmpError::Timeout {
                    what: format!("the migration to end (last status: {last:?})"),
                    after: now.saturating_duration_since(started),
                });
            }
            sleep_until((now + pause).min(deadline)).await;
            pause = (pause * 2).min(MIGRATION_POLL_MAX);
        }
    }

    /// The guest's run state (`query-status`): `"running"`, `"paused"`,
    /// `"prelaunch"`, `"postmigrate"`, ...
    pub async fn status(&mut self) -> Result<String, QmpError> {
        let info = self.execute("query-status", None).await?;
        match info.get("status").and_then(Value::as_str) {
            Some(status) => Ok(status.to_owned()),
            None => Err(QmpError::Malformed(format!(
                "`query-status` returned no status: {}",
                quote(info.to_string().as_bytes())
            ))),
        }
    }

    /// Adds a character device `id` that connects, as a client, to the Unix
    /// socket at `path` (`chardev-add`).
    pub async fn chardev_add_unix(&mut self, id: &str, path: &Path) -> Result<(), QmpError> {
        let path = utf8(path)?;
        let backend = json!({
            "type": "socket",
            "data": {
                "addr": { "type": "unix", "data": { "path": path } },
                "server": false,
            },
        });
        self.execute("chardev-add", Some(json!({ "id": id, "backend": backend })))
            .await
            .map(drop)
    }

    /// Hot-plugs a device (`device_add`) of `driver` named `id` with the
    /// properties `props` (`driver` and `id` there are overridden).
    pub async fn device_add(
        &mut self,
        driver: &str,
        id: &str,
        mut props: Map<String, Value>,
    ) -> Result<(), QmpError> {
        props.insert("driver".into(), driver.into());
        props.insert("id".into(), id.into());
        self.execute("device_add", Some(Value::Object(props)))
            .await
            .map(drop)
    }

    /// Sends `command` (with `fd` as `SCM_RIGHTS` data when given) and
    /// waits until `limit` for its reply; `quiet` logs it at trace (polls).
    async fn run(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: Option<BorrowedFd<'_>>,
        limit: Instant,
        quiet: bool,
    ) -> Result<Value, QmpError> {
        if self.writing {
            return Err(QmpError::Desynchronized);
        }
        let started = Instant::now();
        match timeout_at(limit, self.exchange(command, arguments, fd, quiet)).await {
            Ok(result) => result,
            Err(_) => Err(QmpError::Timeout {
                what: format!("QEMU's reply to `{command}`"),
                after: limit.saturating_duration_since(started),
            }),
        }
    }

    /// [`Qmp::run`] without its time limit.
    async fn exchange(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: Option<BorrowedFd<'_>>,
        quiet: bool,
    ) -> Result<Value, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut message = Map::new();
        message.insert("execute".into(), command.into());
        if let Some(arguments) = arguments {
            message.insert("arguments".into(), arguments);
        }
        message.insert("id".into(), id.into());
        let mut line = Value::Object(message).to_string().into_bytes();
        line.extend_from_slice(b"\r\n");
        if quiet {
            tracing::trace!(command, id, "QMP command");
        } else {
            tracing::debug!(command, id, fd = fd.is_some(), "QMP command");
        }
        self.writing = true;
        match fd {
            Some(fd) => self.write_with_fd(&line, fd).await?,
            None => self.stream.write_all(&line).await?,
        }
        self.writing = false;
        let id = Value::from(id);
        loop {
            let (reply_id, result) = match self.read_message().await? {
                Message::Reply { id, result } => (id, result),
                Message::Greeting(greeting) => {
                    return Err(QmpError::Malformed(format!(
                        "a second greeting: {}",
                        quote(greeting.to_string().as_bytes())
                    )))
                }
                Message::Event(_) => continue,
            };
            match (reply_id, result) {
                (Some(reply_id), _) if reply_id != id => {
                    tracing::debug!(id = %reply_id, "QMP reply to an earlier command, skipped");
                }
                (_, Err((class, desc))) => {
                    // Without an id: QEMU could not parse the command.
                    return Err(QmpError::Command {
                        command: command.to_owned(),
                        class,
                        desc,
                    });
                }
                (Some(_), Ok(value)) => return Ok(value),
                (None, Ok(value)) => {
                    return Err(QmpError::Malformed(format!(
                        "a reply without an id: {}",
                        quote(value.to_string().as_bytes())
                    )))
                }
            }
        }
    }

    /// Writes `line` with `fd` attached to its first byte(s) as
    /// `SCM_RIGHTS`, then the rest of `line` if `sendmsg` took only part.
    async fn write_with_fd(&mut self, line: &[u8], fd: BorrowedFd<'_>) -> Result<(), QmpError> {
        let socket = self.stream.as_raw_fd();
        let fd = fd.as_raw_fd();
        let sent = loop {
            self.stream.writable().await?;
            match self
                .stream
                .try_io(Interest::WRITABLE, || sendmsg_with_fd(socket, line, fd))
            {
                Ok(sent) => break sent,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(e.into()),
            }
        };
        if let Some(rest) = line.get(sent..).filter(|rest| !rest.is_empty()) {
            self.stream.write_all(rest).await?;
        }
        Ok(())
    }

    /// Reads the next message; events are recorded (and returned too).
    /// Cancel-safe: bytes read stay in `rbuf`.
    async fn read_message(&mut self) -> Result<Message, QmpError> {
        loop {
            let line = match self.next_line() {
                Some(line) => line,
                None => {
                    if self.rbuf.len() > MAX_MESSAGE {
                        return Err(QmpError::Malformed(format!(
                            "a message longer than {MAX_MESSAGE} bytes, starting {}",
                            quote(&self.rbuf)
                        )));
                    }
                    self.rbuf.reserve(READ_CHUNK);
                    if self.stream.read_buf(&mut self.rbuf).await? == 0 {
                        return Err(QmpError::Closed);
                    }
                    continue;
                }
            };
            let text = line.trim_ascii();
            if text.is_empty() {
                continue;
            }
            let message = classify(text)?;
            if let Message::Event(event) = &message {
                let name = event["event"].as_str().unwrap_or("?");
                let data = event.get("data").cloned().unwrap_or_default();
                tracing::debug!(event = name, %data, "QMP event");
                if self.events.len() >= MAX_EVENTS {
                    self.events.remove(0);
                }
                self.events.push(event.clone());
            }
            return Ok(message);
        }
    }

    /// Takes the first complete line (with its newline) out of `rbuf`.
    fn next_line(&mut self) -> Option<Vec<u8>> {
        let newline = self.rbuf[self.scanned..].iter().position(|&b| b == b'\n');
        match newline {
            Some(at) => {
                let line = self.rbuf.drain(..=self.scanned + at).collect();
                self.scanned = 0;
                Some(line)
            }
            None => {
                self.scanned = self.rbuf.len();
                None
            }
        }
    }
}

/// Parses one line from QEMU and sorts it.
fn classify(text: &[u8]) -> Result<Message, QmpError> {
    let malformed = |why: &str| QmpError::Malformed(format!("{why}: {}", quote(text)));
    let value: Value = serde_json::from_slice(text).map_err(|_| malformed("not JSON"))?;
    let Value::Object(object) = &value else {
        return Err(malformed("not a JSON object"));
    };
    if object.contains_key("QMP") {
        return Ok(Message::Greeting(value));
    }
    if object.get("event").is_some_and(Value::is_string) {
        return Ok(Message::Event(value));
    }
    let id = object.get("id").cloned();
    if let Some(result) = object.get("return") {
        return Ok(Message::Reply {
            id,
            result: Ok(result.clone()),
        });
    }
    if let Some(error) = object.get("error") {
        let field = |name: &str| error.get(name).and_then(Value::as_str).map(str::to_owned);
        return match (field("class"), field("desc")) {
            (Some(class), Some(desc)) => Ok(Message::Reply {
                id,
                result: Err((class, desc)),
            }),
            _ => Err(malformed("an error without class and desc")),
        };
    }
    Err(malformed("neither a reply nor an event"))
}

/// The start of `bytes`, for an error message.
fn quote(bytes: &[u8]) -> String {
    let cut = &bytes[..bytes.len().min(QUOTE_LEN)];
    let more = if bytes.len() > QUOTE_LEN { "..." } else { "" };
    format!("{:?}{more}", String::from_utf8_lossy(cut))
}

/// `path` as a JSON string, or why not.
fn utf8(path: &Path) -> Result<&str, QmpError> {
    path.to_str().ok_or_else(|| QmpError::NonUtf8Path {
        path: path.to_owned(),
    })
}

/// One non-blocking `sendmsg` of `data` on `socket` with `fd` attached as
/// `SCM_RIGHTS`; returns how many bytes of `data` were sent.
fn sendmsg_with_fd(socket: RawFd, data: &[u8], fd: RawFd) -> std::io::Result<usize> {
    /// A control-message buffer aligned for `cmsghdr`.
    #[repr(C)]
    union ControlBuffer {
        _align: libc::cmsghdr,
        bytes: [u8; FD_CMSG_SPACE],
    }
    let mut control = ControlBuffer {
        bytes: [0; FD_CMSG_SPACE],
    };
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain old data (integers and pointers), for which
    // all zeroes is a valid value (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = (&raw mut control).cast();
    msg.msg_controllen = FD_CMSG_SPACE as _;
    // SAFETY: msg_control points to FD_CMSG_SPACE = CMSG_SPACE(4) bytes
    // aligned for cmsghdr, so CMSG_FIRSTHDR returns a header inside that
    // buffer (checked non-null) and CMSG_DATA the 4 data bytes after it,
    // also inside; the data is written unaligned.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        if header.is_null() {
            return Err(std::io::Error::other("no room for the SCM_RIGHTS header"));
        }
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as _;
        libc::CMSG_DATA(header).cast::<RawFd>().write_unaligned(fd);
    }
    // SAFETY: msg and everything it points to (iov, data, control) live
    // across the call; the kernel only reads them.
    let sent = unsafe { libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(sent as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    use std::os::unix::fs::MetadataExt;
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncBufReadExt, BufReader};
    use tokio::net::UnixListener;
    use tokio::task::JoinHandle;

    const GREETING: &str = "{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 0, \"minor\": 2, \"major\": 7}, \"package\": \"\"}, \"capabilities\": [\"oob\"]}}\r\n";

    /// What the fake server does in answer to a command.
    enum Out {
        /// Sends this text as is.
        Raw(String),
        /// Sends this text, then waits a bit (splits it from what follows).
        RawThenPause(String),
        /// Closes the connection.
        Close,
    }

    fn reply(cmd: &Value, value: Value) -> Out {
        Out::Raw(format!(
            "{}\r\n",
            json!({ "return": value, "id": cmd["id"] })
        ))
    }

    fn error(cmd: &Value, class: &str, desc: &str) -> Out {
        Out::Raw(format!(
            "{}\r\n",
            json!({ "error": { "class": class, "desc": desc }, "id": cmd["id"] })
        ))
    }

    fn event(name: &str, n: u64) -> Out {
        Out::Raw(format!(
            "{}\r\n",
            json!({ "event": name, "data": { "n": n },
                    "timestamp": { "seconds": 1, "microseconds": n } })
        ))
    }

    /// Accepts one connection on `listener`, greets, answers
    /// `qmp_capabilities` (checking it comes first), then answers each
    /// command with `handler` and checks the ids grow. Returns the commands
    /// after `qmp_capabilities`, when the client hangs up or `Out::Close`.
    fn serve(
        listener: UnixListener,
        mut handler: impl FnMut(&Value) -> Vec<Out> + Send + 'static,
    ) -> JoinHandle<Vec<Value>> {
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let (read, mut write) = stream.into_split();
            let mut lines = BufReader::new(read).lines();
            write.write_all(GREETING.as_bytes()).await.unwrap();
            let mut seen: Vec<Value> = Vec::new();
            let mut last_id = 0;
            let mut negotiated = false;
            while let Ok(Some(line)) = lines.next_line().await {
                let cmd: Value = serde_json::from_str(&line).unwrap();
                let id = cmd["id"].as_u64().expect("every command has a numeric id");
                assert!(id > last_id, "ids grow: {id} after {last_id}");
                last_id = id;
                if !negotiated {
                    assert_eq!(cmd["execute"], "qmp_capabilities");
                    assert!(cmd.get("arguments").is_none());
                    negotiated = true;
                    let Out::Raw(ok) = reply(&cmd, json!({})) else {
                        unreachable!()
                    };
                    write.write_all(ok.as_bytes()).await.unwrap();
                    continue;
                }
                let outs = handler(&cmd);
                seen.push(cmd);
                for out in outs {
                    match out {
                        // A client that gave up may be gone: the test decides.
                        Out::Raw(text) => {
                            if write.write_all(text.as_bytes()).await.is_err() {
                                return seen;
                            }
                        }
                        Out::RawThenPause(text) => {
                            if write.write_all(text.as_bytes()).await.is_err() {
                                return seen;
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        Out::Close => return seen,
                    }
                }
            }
            seen
        })
    }

    /// A fake QMP server in a fresh directory: (dir, socket path, server).
    fn fake(
        handler: impl FnMut(&Value) -> Vec<Out> + Send + 'static,
    ) -> (tempfile::TempDir, PathBuf, JoinHandle<Vec<Value>>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        (dir, path, serve(listener, handler))
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[tokio::test]
    async fn connect_retries_until_the_socket_appears() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let server_path = path.clone();
        let server = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let listener = UnixListener::bind(&server_path).unwrap();
            serve(listener, |cmd| vec![reply(cmd, json!({}))])
                .await
                .unwrap()
        });
        let started = Instant::now();
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(100));
        qmp.execute("ping", None).await.unwrap();
        drop(qmp);
        assert_eq!(server.await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn connect_retries_while_the_socket_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        // A socket file nobody listens on: ECONNREFUSED.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let server_path = path.clone();
        let server = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            std::fs::remove_file(&server_path).unwrap();
            let listener = UnixListener::bind(&server_path).unwrap();
            serve(listener, |_| vec![]).await.unwrap()
        });
        let qmp = Qmp::connect(&path, soon()).await.unwrap();
        drop(qmp);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn connect_times_out_when_the_socket_never_appears() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let started = Instant::now();
        let err = Qmp::connect(&path, started + Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, QmpError::Timeout { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
        let message = err.to_string();
        assert!(message.contains("qmp.sock"), "{message}");
        assert!(message.contains("timed out after"), "{message}");
    }

    #[tokio::test]
    async fn connect_times_out_without_a_greeting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            drop(stream);
        });
        let err = Qmp::connect(&path, Instant::now() + Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, QmpError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("greeting"), "{err}");
        server.abort();
    }

    #[tokio::test]
    async fn connect_reports_other_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        // ENOTDIR: not retried.
        let err = Qmp::connect(&file.join("qmp.sock"), soon())
            .await
            .unwrap_err();
        assert!(matches!(err, QmpError::Connect { .. }), "{err}");
        assert!(err
            .to_string()
            .starts_with("cannot connect to QEMU's QMP socket"));
    }

    #[tokio::test]
    async fn execute_returns_the_value_and_sends_arguments() {
        let (_dir, path, server) = fake(|cmd| match cmd["execute"].as_str() {
            Some("query-status") => vec![
                // A reply split across two writes.
                Out::RawThenPause("{\"return\": {\"status\": \"runn".into()),
                Out::Raw(format!(
                    "ing\", \"running\": true}}, \"id\": {}}}\r\n",
                    cmd["id"]
                )),
            ],
            _ => vec![reply(cmd, json!({ "echo": cmd["arguments"] }))],
        });
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let value = qmp.execute("echo", Some(json!({ "a": 1 }))).await.unwrap();
        assert_eq!(value, json!({ "echo": { "a": 1 } }));
        assert_eq!(qmp.status().await.unwrap(), "running");
        drop(qmp);
        let seen = server.await.unwrap();
        assert_eq!(seen[0]["execute"], "echo");
        assert_eq!(seen[0]["arguments"], json!({ "a": 1 }));
        assert!(seen[1].get("arguments").is_none());
    }

    #[tokio::test]
    async fn an_error_reply_becomes_a_command_error() {
        let (_dir, path, server) =
            fake(|cmd| vec![error(cmd, "GenericError", "migration already running")]);
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let err = qmp.migrate("unix:/nowhere").await.unwrap_err();
        match &err {
            QmpError::Command {
                command,
                class,
                desc,
            } => {
                assert_eq!(command, "migrate");
                assert_eq!(class, "GenericError");
                assert_eq!(desc, "migration already running");
            }
            other => panic!("not a command error: {other}"),
        }
        assert_eq!(
            err.to_string(),
            "QEMU refused `migrate`: GenericError: migration already running"
        );
        drop(qmp);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn events_are_skipped_and_the_last_ones_kept() {
        let (_dir, path, server) = fake(|cmd| {
            let mut outs: Vec<Out> = (0..70).map(|n| event("STOP", n)).collect();
            outs.push(reply(cmd, json!({ "ok": true })));
            outs.push(event("RESUME", 99));
            outs
        });
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        assert_eq!(qmp.execute("x", None).await.unwrap(), json!({ "ok": true }));
        assert_eq!(qmp.events().len(), MAX_EVENTS);
        assert_eq!(qmp.events()[0]["data"]["n"], 70 - MAX_EVENTS as u64);
        assert_eq!(qmp.events()[MAX_EVENTS - 1]["data"]["n"], 69);
        // The event after the reply is read with the next command's reply.
        qmp.execute("y", None).await.unwrap();
        let last = qmp.events().last().unwrap();
        assert_eq!(last["event"], "STOP");
        assert_eq!(last["data"]["n"], 69);
        drop(qmp);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_reply_with_another_id_is_skipped() {
        let (_dir, path, server) = fake(|cmd| {
            vec![
                Out::Raw("{\"return\": {\"stale\": true}, \"id\": 12345}\r\n".into()),
                reply(cmd, json!({ "stale": false })),
            ]
        });
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let value = qmp.execute("x", None).await.unwrap();
        assert_eq!(value, json!({ "stale": false }));
        drop(qmp);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_timed_out_command_leaves_the_connection_usable() {
        let pending: Arc<Mutex<Option<Value>>> = Arc::default();
        let (_dir, path, server) = fake(move |cmd| {
            let mut pending = pending.lock().unwrap();
            match cmd["execute"].as_str() {
                Some("slow") => {
                    *pending = Some(cmd.clone());
                    vec![]
                }
                _ => {
                    let mut outs = Vec::new();
                    if let Some(slow) = pending.take() {
                        outs.push(reply(&slow, json!("late")));
                    }
                    outs.push(reply(cmd, json!("fast")));
                    outs
                }
            }
        });
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let limit = Instant::now() + Duration::from_millis(50);
        let err = qmp.run("slow", None, None, limit, false).await.unwrap_err();
        assert!(matches!(err, QmpError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("`slow`"), "{err}");
        assert_eq!(qmp.execute("fast", None).await.unwrap(), json!("fast"));
        drop(qmp);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_closed_connection_is_reported() {
        let (_dir, path, server) = fake(|_| vec![event("SHUTDOWN", 0), Out::Close]);
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let err = qmp.execute("quit", None).await.unwrap_err();
        assert!(matches!(err, QmpError::Closed), "{err}");
        assert_eq!(qmp.events().len(), 1);
        let err = qmp.execute("again", None).await.unwrap_err();
        assert!(matches!(err, QmpError::Closed | QmpError::Io(_)), "{err}");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn malformed_lines_are_reported() {
        let (_dir, path, server) = fake(|cmd| match cmd["execute"].as_str() {
            Some("garbage") => vec![Out::Raw("this is not json\r\n".into())],
            Some("array") => vec![Out::Raw("[1, 2]\r\n".into())],
            Some("unknown") => vec![Out::Raw("{\"hello\": 1}\r\n".into())],
            Some("bad-error") => vec![Out::Raw(format!(
                "{{\"error\": {{\"class\": 3}}, \"id\": {}}}\r\n",
                cmd["id"]
            ))],
            _ => vec![reply(cmd, json!({}))],
        });
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        for (command, why) in [
            ("garbage", "not JSON"),
            ("array", "not a JSON object"),
            ("unknown", "neither a reply nor an event"),
            ("bad-error", "an error without class and desc"),
        ] {
            let err = qmp.execute(command, None).await.unwrap_err();
            assert!(matches!(err, QmpError::Malformed(_)), "{command}: {err}");
            assert!(err.to_string().contains(why), "{command}: {err}");
        }
        // The bad lines were consumed; the connection goes on.
        qmp.execute("fine", None).await.unwrap();
        drop(qmp);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_bad_greeting_is_malformed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            stream.write_all(b"{\"return\": {}}\r\n").await.unwrap();
            stream
        });
        let err = Qmp::connect(&path, soon()).await.unwrap_err();
        assert!(matches!(err, QmpError::Malformed(_)), "{err}");
        assert!(err.to_string().contains("greeting"), "{err}");
        drop(server.await.unwrap());
    }

    /// A fake server whose `query-migrate` answers with `statuses` in turn
    /// (the last one repeated), with `extra` fields on the last one.
    fn migration(
        statuses: &'static [&'static str],
        extra: Value,
    ) -> (tempfile::TempDir, PathBuf, JoinHandle<Vec<Value>>) {
        let mut polls = 0;
        fake(move |cmd| {
            assert_eq!(cmd["execute"], "query-migrate");
            let status = statuses[polls.min(statuses.len() - 1)];
            polls += 1;
            let mut info = json!({ "status": status });
            if polls >= statuses.len() {
                if let (Some(info), Some(extra)) = (info.as_object_mut(), extra.as_object()) {
                    info.extend(extra.clone());
                }
            }
            vec![event("MIGRATION_PASS", polls as u64), reply(cmd, info)]
        })
    }

    #[tokio::test]
    async fn wait_migration_goes_from_active_to_completed() {
        let (_dir, path, server) = migration(
            &["setup", "active", "active", "completed"],
            json!({ "total-time": 42, "downtime": 7 }),
        );
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let done = qmp.wait_migration(soon()).await.unwrap();
        assert_eq!(
            done,
            MigrationDone {
                status: "completed".into(),
                total_time_ms: Some(42),
                downtime_ms: Some(7),
            }
        );
        drop(qmp);
        assert_eq!(server.await.unwrap().len(), 4);
    }

    #[tokio::test]
    async fn wait_migration_reports_a_failure_with_its_reason() {
        let (_dir, path, server) = migration(
            &["active", "failed"],
            json!({ "error-desc": "Unable to write to socket: Broken pipe" }),
        );
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let err = qmp.wait_migration(soon()).await.unwrap_err();
        match &err {
            QmpError::Migration { status, desc } => {
                assert_eq!(status, "failed");
                assert_eq!(desc, "Unable to write to socket: Broken pipe");
            }
            other => panic!("not a migration error: {other}"),
        }
        assert_eq!(
            err.to_string(),
            "the migration ended as `failed`: Unable to write to socket: Broken pipe"
        );
        drop(qmp);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn wait_migration_reports_a_cancellation_without_reason() {
        let (_dir, path, server) = migration(&["cancelled"], json!({}));
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let err = qmp.wait_migration(soon()).await.unwrap_err();
        assert!(
            matches!(&err, QmpError::Migration { status, .. } if status == "cancelled"),
            "{err}"
        );
        assert!(err.to_string().contains("QEMU gave no reason"), "{err}");
        drop(qmp);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn wait_migration_times_out_at_its_deadline() {
        let (_dir, path, server) = migration(&["active"], json!({}));
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let started = Instant::now();
        let err = qmp
            .wait_migration(started + Duration::from_millis(60))
            .await
            .unwrap_err();
        assert!(matches!(err, QmpError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("\"active\""), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(qmp);
        // Polled more than once, at most every 2 ms.
        let polls = server.await.unwrap().len();
        assert!((2..=31).contains(&polls), "{polls} polls");
    }

    #[tokio::test]
    async fn wrappers_send_the_documented_commands() {
        let (_dir, path, server) = fake(|cmd| vec![reply(cmd, json!({}))]);
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        qmp.stop().await.unwrap();
        qmp.cont().await.unwrap();
        qmp.set_capabilities(&[("x-ignore-shared", true), ("events", false)])
            .await
            .unwrap();
        qmp.migrate("unix:/run/m.sock").await.unwrap();
        qmp.migrate_incoming("unix:/run/in.sock").await.unwrap();
        qmp.chardev_add_unix("vsock0", Path::new("/run/v.sock"))
            .await
            .unwrap();
        let mut props = Map::new();
        props.insert("chardev".into(), "vsock0".into());
        props.insert("id".into(), "ignored".into());
        qmp.device_add("vhost-user-vsock-pci", "dev0", props)
            .await
            .unwrap();
        drop(qmp);
        let seen: Vec<Value> = server
            .await
            .unwrap()
            .into_iter()
            .map(|mut cmd| {
                cmd.as_object_mut().unwrap().remove("id");
                cmd
            })
            .collect();
        assert_eq!(
            seen,
            vec![
                json!({ "execute": "stop" }),
                json!({ "execute": "cont" }),
                json!({ "execute": "migrate-set-capabilities", "arguments": { "capabilities": [
                    { "capability": "x-ignore-shared", "state": true },
                    { "capability": "events", "state": false },
                ] } }),
                json!({ "execute": "migrate", "arguments": { "uri": "unix:/run/m.sock" } }),
                json!({ "execute": "migrate-incoming", "arguments": { "uri": "unix:/run/in.sock" } }),
                json!({ "execute": "chardev-add", "arguments": { "id": "vsock0", "backend": {
                    "type": "socket", "data": {
                        "addr": { "type": "unix", "data": { "path": "/run/v.sock" } },
                        "server": false,
                    } } } }),
                json!({ "execute": "device_add", "arguments": {
                    "driver": "vhost-user-vsock-pci", "id": "dev0", "chardev": "vsock0" } }),
            ]
        );
    }

    #[tokio::test]
    async fn a_non_utf8_path_is_refused_before_sending() {
        use std::os::unix::ffi::OsStrExt;
        let (_dir, path, server) = fake(|cmd| vec![reply(cmd, json!({}))]);
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let bad = Path::new(std::ffi::OsStr::from_bytes(b"/tmp/\xff.sock"));
        let err = qmp.chardev_add_unix("c", bad).await.unwrap_err();
        assert!(matches!(err, QmpError::NonUtf8Path { .. }), "{err}");
        drop(qmp);
        assert!(server.await.unwrap().is_empty());
    }

    /// Reads from `socket` until a newline, collecting the descriptors that
    /// came with the data; also says whether the descriptors came with the
    /// line's first bytes.
    fn recv_line_with_fds(
        socket: &std::os::unix::net::UnixStream,
    ) -> Option<(String, Vec<OwnedFd>, bool)> {
        let mut line = Vec::new();
        let mut fds = Vec::new();
        let mut fds_with_start = false;
        while !line.ends_with(b"\n") {
            let mut data = [0u8; 256];
            let mut control = [0u64; 8];
            let mut iov = libc::iovec {
                iov_base: data.as_mut_ptr().cast(),
                iov_len: data.len(),
            };
            // SAFETY: plain old data, all zeroes is valid.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = size_of_val(&control) as _;
            // SAFETY: msg points to live buffers of the sizes it says.
            let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            assert!(n >= 0, "recvmsg: {}", std::io::Error::last_os_error());
            if n == 0 {
                return None;
            }
            assert_eq!(msg.msg_flags & libc::MSG_CTRUNC, 0);
            // SAFETY: walking the control messages the kernel wrote into
            // `control`, as CMSG_FIRSTHDR/CMSG_NXTHDR bound them; each
            // SCM_RIGHTS payload holds (len - CMSG_LEN(0)) / 4 descriptors
            // now owned by this process.
            unsafe {
                let mut header = libc::CMSG_FIRSTHDR(&msg);
                while !header.is_null() {
                    if (*header).cmsg_level == libc::SOL_SOCKET
                        && (*header).cmsg_type == libc::SCM_RIGHTS
                    {
                        let len = (*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                        let data = libc::CMSG_DATA(header).cast::<RawFd>();
                        for i in 0..len / size_of::<RawFd>() {
                            fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                        }
                        fds_with_start |= line.is_empty();
                    }
                    header = libc::CMSG_NXTHDR(&msg, header);
                }
            }
            line.extend_from_slice(&data[..n as usize]);
        }
        Some((String::from_utf8(line).unwrap(), fds, fds_with_start))
    }

    #[tokio::test]
    async fn send_fd_delivers_a_usable_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let file_path = dir.path().join("payload");
        std::fs::write(&file_path, b"through SCM_RIGHTS").unwrap();
        let inode = std::fs::metadata(&file_path).unwrap().ino();
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        // A blocking server thread, reading with recvmsg.
        let server = std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            socket.write_all(GREETING.as_bytes()).unwrap();
            let mut received = Vec::new();
            while let Some((line, fds, fds_with_start)) = recv_line_with_fds(&socket) {
                let cmd: Value = serde_json::from_str(&line).unwrap();
                let answer = json!({ "return": {}, "id": cmd["id"] });
                socket
                    .write_all(format!("{answer}\r\n").as_bytes())
                    .unwrap();
                received.push((cmd, fds, fds_with_start));
            }
            received
        });
        let mut qmp = Qmp::connect(&path, soon()).await.unwrap();
        let file = std::fs::File::open(&file_path).unwrap();
        qmp.send_fd("migfd", file.as_fd()).await.unwrap();
        drop(file);
        qmp.execute("after", None).await.unwrap();
        drop(qmp);
        let mut received = tokio::task::spawn_blocking(move || server.join().unwrap())
            .await
            .unwrap();
        assert_eq!(received.len(), 3);
        assert_eq!(received[0].0["execute"], "qmp_capabilities");
        assert!(received[0].1.is_empty());
        assert!(received[2].1.is_empty());
        let (cmd, fds, fds_with_start) = received.remove(1);
        assert_eq!(cmd["execute"], "getfd");
        assert_eq!(cmd["arguments"], json!({ "fdname": "migfd" }));
        assert!(fds_with_start, "the descriptor came with the getfd line");
        let [fd]: [OwnedFd; 1] = fds.try_into().unwrap();
        let mut received_file = std::fs::File::from(fd);
        assert_eq!(received_file.metadata().unwrap().ino(), inode);
        let mut text = String::new();
        received_file.read_to_string(&mut text).unwrap();
        assert_eq!(text, "through SCM_RIGHTS");
    }

    /// Runs the real `qemu-system-x86_64` (`-M none -S`) only when
    /// `COWORK_QEMU_TESTS=1`; otherwise returns at once (and passes).
    #[tokio::test]
    async fn real_qemu_status_chardev_quit_only_with_cowork_qemu_tests() {
        if std::env::var("COWORK_QEMU_TESTS").as_deref() != Ok("1") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let qmp_path = dir.path().join("q.sock");
        let chardev_path = dir.path().join("chardev.sock");
        let chardev_listener = UnixListener::bind(&chardev_path).unwrap();
        let mut child = tokio::process::Command::new("qemu-system-x86_64")
            .args(["-M", "none", "-nodefaults", "-nographic", "-qmp"])
            .arg(format!("unix:{},server=on,wait=off", qmp_path.display()))
            .arg("-S")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("qemu-system-x86_64 runs (COWORK_QEMU_TESTS=1)");
        let mut qmp = Qmp::connect(&qmp_path, soon()).await.unwrap();
        assert_eq!(qmp.status().await.unwrap(), "prelaunch");
        qmp.chardev_add_unix("test0", &chardev_path).await.unwrap();
        let accepted =
            tokio::time::timeout(Duration::from_secs(10), chardev_listener.accept()).await;
        assert!(matches!(accepted, Ok(Ok(_))), "QEMU connected the chardev");
        let err = qmp.execute("no-such-command", None).await.unwrap_err();
        assert!(
            matches!(&err, QmpError::Command { class, .. } if class == "CommandNotFound"),
            "{err}"
        );
        match qmp.execute("quit", None).await {
            Ok(_) | Err(QmpError::Closed) => {}
            Err(other) => panic!("quit: {other}"),
        }
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "{status}");
    }
}
