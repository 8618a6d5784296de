//! The Unix-socket server: binding, peer checks, and the three connection
//! modes of the client protocol.
//!
//! Every connection is read frame by frame; each request is dispatched on its
//! own task and its reply goes through the connection's single writer task,
//! so replies may be out of order and a slow `startVM` never delays
//! `isRunning`. One-shot requests (no `id`) are the same path: the reply is
//! written even after the client half-closed its side. A `subscribeEvents`
//! request turns the connection into an event stream: ack first, then events.
//!
//! Limits: frames are capped at 10 MiB both ways; a frame that announces more
//! gets an error reply and the connection is closed (framing is lost). Peers
//! with another uid are dropped before anything is read.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use guest_agent::framing::{self, FrameError, MAX_CLIENT_FRAME};
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;

use crate::daemon::{Connection, ConnectionGuard, Daemon, Dispatch, DispatchError};
use crate::events::Frame;
use crate::protocol::{self, ProfileParams, ProtocolError, Request};

/// Replies queued per connection before request tasks wait.
const REPLY_QUEUE: usize = 128;

/// Most client connections served at once. The desktop client keeps a
/// handful open (a pipe, one subscription per window, short one-shots); the
/// cap bounds the daemon's descriptors and tasks against a runaway client.
/// A connection beyond it gets one error reply and is closed.
pub const MAX_CLIENT_CONNECTIONS: usize = 256;

/// Environment variable of `--max-connections`, which overrides
/// [`MAX_CLIENT_CONNECTIONS`] (tests, unusual deployments); read by
/// [`crate::cli`] into [`crate::daemon::Settings::max_connections`].
pub const MAX_CONNECTIONS_ENV: &str = "COWORK_MAX_CONNECTIONS";

/// How often the idle policy looks at the VMs.
const IDLE_CHECK: Duration = Duration::from_secs(30);

/// `S_ISVTX`: in a directory with this bit only a file's owner (or the
/// directory's owner, or root) may remove or rename it, which is what makes
/// a world-writable directory such as `/tmp` safe to put our socket in.
const STICKY_BIT: u32 = 0o1000;

/// Write permission for the group and for others.
const GROUP_OTHER_WRITE: u32 = 0o022;

/// Write permission for others.
const OTHER_WRITE: u32 = 0o002;

/// What kind of directory the socket lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DirKind {
    /// Ours, writable by us alone (`$XDG_RUNTIME_DIR`, a 0700 directory).
    Private,
    /// World-writable with the sticky bit, owned by us or root (`/tmp`):
    /// nobody else can remove or replace our socket once it is bound.
    SharedSticky,
}

/// Decides whether a directory owned by `owner` with `mode` may hold the
/// socket of a helper running as `uid`; the error says why not.
fn socket_dir_kind(owner: u32, mode: u32, uid: u32) -> Result<DirKind, String> {
    let sticky = mode & STICKY_BIT != 0;
    if sticky && mode & OTHER_WRITE != 0 && (owner == uid || owner == 0) {
        return Ok(DirKind::SharedSticky);
    }
    if owner != uid {
        return Err(format!(
            "socket directory is owned by uid {owner}, not by us ({uid}); use a directory of \
             your own (such as $XDG_RUNTIME_DIR) or a sticky shared one such as /tmp"
        ));
    }
    if mode & GROUP_OTHER_WRITE != 0 {
        return Err(format!(
            "socket directory is writable by others (mode {:o}) without the sticky bit, so \
             anyone could replace the socket; make it 0700 (or use a sticky directory such \
             as /tmp)",
            mode & 0o7777
        ));
    }
    Ok(DirKind::Private)
}

/// Errors that keep the server from starting, and the server's own
/// answers to a connection it will not serve.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("another cowork-helper is already serving on {0}; stop it first (or pass a different -socket)")]
    AlreadyRunning(PathBuf),
    #[error("{path}: {what}")]
    Path { path: PathBuf, what: String },
    #[error("cannot bind {path}: {source}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Refused: the connection is one over the cap.
    #[error("the helper already serves {cap} client connections, its limit; close idle connections and retry")]
    TooManyConnections { cap: usize },
    /// Refused: the client sent a frame over the limit.
    #[error("frame of {len} bytes exceeds the {max}-byte limit; closing connection")]
    FrameTooLarge { len: usize, max: usize },
}

fn path_err(path: &Path, what: impl Into<String>) -> ServerError {
    ServerError::Path {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

/// Checks the socket's directory and path, clears a stale socket and binds.
pub async fn bind(path: &Path) -> Result<UnixListener, ServerError> {
    // SAFETY: geteuid takes no arguments and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .ok_or_else(|| path_err(path, "socket path has no parent directory"))?;
    if !parent.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .map_err(|e| path_err(parent, format!("cannot create socket directory: {e}")))?;
    }
    let meta = std::fs::metadata(parent).map_err(|e| path_err(parent, e.to_string()))?;
    let shared = match socket_dir_kind(meta.uid(), meta.mode(), uid) {
        Ok(kind) => kind == DirKind::SharedSticky,
        Err(why) => return Err(path_err(parent, why)),
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(path_err(
                path,
                "socket path is a symlink; refusing to use it",
            ))
        }
        Ok(m) if m.is_dir() => return Err(path_err(path, "socket path is a directory")),
        Ok(m) if m.uid() != uid => {
            // In a shared sticky directory (/tmp) anyone may create our
            // name first; we can neither remove nor trust their file.
            return Err(path_err(
                path,
                format!(
                    "socket path already exists and belongs to uid {}, not to us ({uid}); \
                     someone else created it first: remove it as that user or root, or pass \
                     a different -socket (a directory of your own such as $XDG_RUNTIME_DIR)",
                    m.uid()
                ),
            ));
        }
        Ok(_) => {
            if UnixStream::connect(path).await.is_ok() {
                return Err(ServerError::AlreadyRunning(path.to_path_buf()));
            }
            tracing::info!(path = %path.display(), "removing stale socket");
            std::fs::remove_file(path)
                .map_err(|e| path_err(path, format!("cannot remove stale socket: {e}")))?;
        }
        Err(_) => {}
    }
    if shared {
        tracing::info!(
            dir = %parent.display(),
            "socket directory is shared (world-writable, sticky): the socket is 0600 and \
             peers of other users are refused"
        );
    }
    let listener = UnixListener::bind(path).map_err(|source| ServerError::Bind {
        path: path.into(),
        source,
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| path_err(path, format!("cannot set socket mode: {e}")))?;
    Ok(listener)
}

use std::os::unix::fs::DirBuilderExt;

/// Serves until `shutdown` resolves, and returns what it resolved to. The
/// caller then removes the socket, closes `listener` and stops the VMs
/// ([`Daemon::shut_down`]); connections already open are served until the
/// process exits. At most the daemon's
/// [`max_connections`](crate::daemon::Settings::max_connections) are
/// served at once; a VM is stopped after its
/// [`idle_timeout`](crate::daemon::Settings::idle_timeout).
pub async fn serve<T>(
    listener: &UnixListener,
    daemon: Arc<Daemon>,
    shutdown: impl std::future::Future<Output = T>,
) -> T {
    // SAFETY: geteuid takes no arguments and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let cap = daemon.settings.max_connections;
    if let Some(limit) = daemon.settings.idle_timeout {
        tokio::spawn(idle_policy(daemon.clone(), limit));
    }
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    match stream.peer_cred() {
                        Ok(cred) if cred.uid() == uid => {
                            let open = daemon.connections.load(std::sync::atomic::Ordering::Acquire);
                            if open >= cap {
                                tracing::warn!(open, cap, pid = cred.pid(), "refused a client connection: at the connection limit");
                                tokio::spawn(refuse_connection(stream, cap));
                            } else {
                                // Counted before the task starts, so a burst of
                                // accepts cannot overshoot the cap.
                                let guard = ConnectionGuard::new(daemon.clone());
                                tokio::spawn(handle_connection(daemon.clone(), stream, guard));
                            }
                        }
                        Ok(cred) => {
                            tracing::warn!(peer_uid = cred.uid(), pid = cred.pid(), "refused connection from another user");
                        }
                        Err(e) => tracing::warn!(error = %e, "refused connection: no peer credentials"),
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            trigger = &mut shutdown => return trigger,
        }
    }
}

/// Stops VMs that no client has used for `limit`.
async fn idle_policy(daemon: Arc<Daemon>, limit: Duration) {
    loop {
        tokio::time::sleep(IDLE_CHECK.min(limit)).await;
        if daemon
            .connections
            .load(std::sync::atomic::Ordering::Acquire)
            > 0
        {
            continue;
        }
        for p in daemon.all_profiles() {
            if p.vm.is_running() && p.vm.idle_for() >= limit && p.vm.hub.subscriber_count() == 0 {
                tracing::info!(profile = %p.key, idle_s = p.vm.idle_for().as_secs(), "stopping idle vm");
                if let Err(e) = p.vm.stop().await {
                    tracing::warn!(error = %e, "stopping idle vm failed");
                }
            }
        }
    }
}

/// The framed reply to a request (see [`protocol::reply`]).
fn reply_frame<E: std::fmt::Display>(id: Option<&Value>, outcome: Result<Value, E>) -> Frame {
    let body = protocol::reply(id, outcome);
    let mut out = Vec::with_capacity(body.len() + 4);
    framing::encode_frame_into(&mut out, &body);
    Arc::new(out)
}

/// Tells a connection beyond the cap why it is closed, then closes it.
async fn refuse_connection(mut stream: UnixStream, cap: usize) {
    let frame = reply_frame(None, Err(ServerError::TooManyConnections { cap }));
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.write_all(&frame)).await;
    let _ = stream.shutdown().await;
}

async fn handle_connection(daemon: Arc<Daemon>, stream: UnixStream, _guard: ConnectionGuard) {
    let (mut rd, wr) = stream.into_split();
    let (tx, rx) = mpsc::channel::<Frame>(REPLY_QUEUE);
    let writer = tokio::spawn(write_frames(wr, rx));
    let conn = Arc::new(Connection::default());
    let mut buf = Vec::new();
    loop {
        match framing::read_frame(&mut rd, MAX_CLIENT_FRAME, &mut buf).await {
            Ok(true) => {}
            Ok(false) => break,
            Err(FrameError::TooLarge { len, max }) => {
                tracing::warn!(len, "oversized frame; closing connection");
                let _ = tx
                    .send(reply_frame(
                        None,
                        Err(ServerError::FrameTooLarge { len, max }),
                    ))
                    .await;
                break;
            }
            Err(e) => {
                tracing::debug!(error = %e, "connection read ended");
                break;
            }
        }
        let req = match Request::parse(&buf) {
            Ok(r) => r,
            Err((id, e)) => {
                tracing::debug!(error = %e, "bad request");
                if tx.send(reply_frame(id.as_ref(), Err(e))).await.is_err() {
                    break;
                }
                continue;
            }
        };
        if req.method == "subscribeEvents" {
            let params: ProfileParams = match req.params() {
                Ok(p) => p,
                Err(e) => {
                    let _ = tx.send(reply_frame(req.id.as_ref(), Err(e))).await;
                    continue;
                }
            };
            let profile = daemon.select_profile(&conn, &params, false);
            let _ = tx
                .send(reply_frame(
                    req.id.as_ref(),
                    Ok::<_, ProtocolError>(Value::Null),
                ))
                .await;
            tracing::info!(profile = %profile.key, "event subscriber connected");
            stream_events(profile.vm.hub.clone(), tx.clone(), &mut rd).await;
            break;
        }
        let started = std::time::Instant::now();
        let method = req.method.clone();
        let id = req.id.clone();
        match daemon.begin(&conn, req).await {
            Dispatch::Done(outcome) => {
                log_outcome(&method, started, &outcome);
                if tx.send(reply_frame(id.as_ref(), outcome)).await.is_err() {
                    break;
                }
            }
            Dispatch::Later(work) => {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let outcome = work.await;
                    log_outcome(&method, started, &outcome);
                    let _ = tx.send(reply_frame(id.as_ref(), outcome)).await;
                });
            }
        }
    }
    drop(tx);
    let _ = writer.await;
}

fn log_outcome(method: &str, started: std::time::Instant, outcome: &Result<Value, DispatchError>) {
    match outcome {
        Ok(_) => tracing::debug!(method, ms = started.elapsed().as_secs_f64() * 1e3, "rpc ok"),
        Err(e) => tracing::info!(method, error = %e, "rpc failed"),
    }
}

/// Forwards the hub's events until the subscriber goes away.
async fn stream_events(
    hub: Arc<crate::events::EventHub>,
    tx: mpsc::Sender<Frame>,
    rd: &mut tokio::net::unix::OwnedReadHalf,
) {
    let mut sub = hub.subscribe();
    let mut sink = [0u8; 512];
    let mut reading = true;
    loop {
        tokio::select! {
            frame = sub.rx.recv() => match frame {
                Some(f) => if tx.send(f).await.is_err() { break },
                None => break,
            },
            // The client never sends on a subscription. A read error means it
            // left; a half-close alone does not (writes still reach it).
            n = tokio::io::AsyncReadExt::read(rd, &mut sink), if reading => match n {
                Ok(0) => reading = false,
                Err(_) => break,
                Ok(_) => {}
            },
            _ = tx.closed() => break,
        }
    }
    hub.unsubscribe(sub.id);
    tracing::info!("event subscriber disconnected");
}

async fn write_frames(mut wr: tokio::net::unix::OwnedWriteHalf, mut rx: mpsc::Receiver<Frame>) {
    let mut batch: Vec<u8> = Vec::new();
    while let Some(first) = rx.recv().await {
        // Coalesce what is already queued into one write.
        let result = match rx.try_recv() {
            Err(_) => wr.write_all(&first).await,
            Ok(second) => {
                batch.clear();
                batch.extend_from_slice(&first);
                batch.extend_from_slice(&second);
                while batch.len() < 1 << 20 {
                    match rx.try_recv() {
                        Ok(more) => batch.extend_from_slice(&more),
                        Err(_) => break,
                    }
                }
                wr.write_all(&batch).await
            }
        };
        if result.is_err() {
            break;
        }
    }
    let _ = wr.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: u32 = 1000;
    const OTHER: u32 = 1001;

    #[test]
    fn socket_directory_table() {
        let cases: [(u32, u32, Option<DirKind>); 9] = [
            (ME, 0o700, Some(DirKind::Private)),
            (ME, 0o755, Some(DirKind::Private)),
            // /tmp: root-owned, world-writable, sticky.
            (0, 0o1777, Some(DirKind::SharedSticky)),
            (ME, 0o1777, Some(DirKind::SharedSticky)),
            // World-writable without the sticky bit: anyone can swap the socket.
            (ME, 0o777, None),
            (0, 0o777, None),
            (ME, 0o770, None),
            // Someone else's directories, sticky or not.
            (OTHER, 0o1777, None),
            (OTHER, 0o700, None),
        ];
        for (owner, mode, want) in cases {
            let got = socket_dir_kind(owner, mode, ME);
            assert_eq!(
                got.clone().ok(),
                want,
                "owner {owner} mode {mode:o}: {got:?}"
            );
        }
        let why = socket_dir_kind(ME, 0o777, ME).unwrap_err();
        assert!(why.contains("sticky") && why.contains("777"), "{why}");
        let why = socket_dir_kind(OTHER, 0o700, ME).unwrap_err();
        assert!(why.contains("owned by uid 1001"), "{why}");
    }
}
