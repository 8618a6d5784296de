//! Spawned processes: start, output, stdin, signals, exit.
//!
//! Each process runs in its own process group with three pipes. A
//! supervisor task per process pumps stdout and stderr into the outbox in
//! chunks of up to [`proto::MAX_CHUNK`] bytes (read straight into the frame
//! buffer), and sends `Exit` once the process was reaped *and* both pipes
//! reached end-of-file — or [`EOF_GRACE`] after the reap if a grandchild
//! keeps a pipe open, after which further output of that process is
//! dropped. `Exit` is therefore always the last message of a process.
//!
//! Stdin is written by a per-process task from an ordered queue, so a slow
//! reader never blocks the agent. Records of exited processes are kept for
//! `ProcessStatus` (the newest [`MAX_EXITED_RECORDS`]).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, Notify};

use super::cgroup::{Cgroups, ProcCgroup};
use super::child::ChildSetup;
use super::fdio::FdIo;
use super::mounts;
use super::outbox::Outbox;
use super::reaper::{ExitStatus, Reaper};
use super::sys;
use crate::proto::{self, AgentMessage, SpawnSpec};
use crate::{names, signal};

/// How long after the reap the agent waits for the pipes to reach EOF.
pub const EOF_GRACE: Duration = Duration::from_secs(2);

/// Exited processes remembered for `ProcessStatus`.
pub const MAX_EXITED_RECORDS: usize = 1024;

/// Requested pipe capacity (best effort; capped by `/proc/sys/fs/pipe-max-size`).
const PIPE_SIZE: usize = 1024 * 1024;

/// Bytes asked for per `read` of an output pipe.
const READ_CHUNK: usize = proto::MAX_CHUNK;

/// `PATH` of spawned processes whose environment names none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The environment variable that carries the OAuth token.
const OAUTH_VAR: &str = "CLAUDE_CODE_OAUTH_TOKEN";

/// Errors of process operations; their messages go to the user.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("process id must not be empty")]
    EmptyId,
    #[error(transparent)]
    Name(#[from] names::NameError),
    #[error("process {0} is already running")]
    Duplicate(String),
    #[error("working directory {0} does not exist or is not a directory")]
    NoCwd(String),
    #[error("command not found: {0}")]
    CommandNotFound(String),
    #[error("cannot start {command}: {source}")]
    Spawn { command: String, source: io::Error },
    #[error("cannot prepare the session directory: {0}")]
    Session(#[from] mounts::MountError),
    #[error("no process with id {0}")]
    Unknown(String),
    #[error("process {0} is not running")]
    NotRunning(String),
    #[error("stdin of process {0} is closed")]
    StdinClosed(String),
    #[error("invalid signal number {0}")]
    InvalidSignal(i32),
    #[error("cannot signal process {id}: {source}")]
    Kill { id: String, source: io::Error },
    #[error("internal error: {0}")]
    Internal(String),
}

/// Fixed settings of process creation.
#[derive(Debug, Default)]
pub struct ProcessConfig {
    pub sessions_root: PathBuf,
    /// Paths hidden from spawned processes (see [`super::child`]).
    pub private_paths: Vec<CString>,
    pub drop_caps: bool,
    pub cgroups: Option<Cgroups>,
}

enum StdinCmd {
    Data(Vec<u8>),
    Close,
}

enum State {
    Running {
        stdin: Option<mpsc::UnboundedSender<StdinCmd>>,
    },
    Exited(ExitStatus),
}

struct Record {
    pid: libc::pid_t,
    session: String,
    generation: u64,
    cgroup: Option<PathBuf>,
    state: State,
}

#[derive(Default)]
struct Table {
    procs: HashMap<String, Record>,
    exited: VecDeque<(String, u64)>,
    generation: u64,
}

/// All processes of one agent; cheap to clone.
#[derive(Clone)]
pub struct Processes {
    table: Arc<Mutex<Table>>,
    changed: Arc<Notify>,
    reaper: Reaper,
    outbox: Outbox,
    cfg: Arc<ProcessConfig>,
}

/// A freshly forked child, before its pipes are registered.
struct Forked {
    spec: SpawnSpec,
    child: std::process::Child,
    status: oneshot::Receiver<ExitStatus>,
    cgroup: Option<ProcCgroup>,
    /// Names of the spawn's mounts that failed.
    failed: Vec<String>,
}

/// A process that was started and whose response must be sent before its
/// output: call [`Started::run`] after queueing the response.
pub struct Started {
    procs: Processes,
    id: String,
    pid: libc::pid_t,
    generation: u64,
    stdin: (FdIo, mpsc::UnboundedReceiver<StdinCmd>),
    stdout: FdIo,
    stderr: FdIo,
    status: oneshot::Receiver<ExitStatus>,
    cgroup: Option<ProcCgroup>,
    /// Result of the spawn request.
    pub result: Value,
}

/// The environment of a spawned process: the client's, without empty
/// values, plus the OAuth token when no credential is set, `HOME` (the
/// session directory) and a default `PATH` when missing.
pub fn build_env(spec: &SpawnSpec, session_dir: &Path) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = spec
        .env
        .iter()
        .filter(|(k, v)| {
            !v.is_empty()
                && !k.is_empty()
                && !k.contains('=')
                && !k.contains('\0')
                && !v.contains('\0')
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Some(token) = &spec.oauth_token {
        let has_credential = proto::CREDENTIAL_VARS.iter().any(|k| env.contains_key(*k));
        if !has_credential && !token.0.is_empty() {
            env.insert(OAUTH_VAR.to_string(), token.0.clone());
        }
    }
    env.entry("HOME".to_string())
        .or_insert_with(|| session_dir.display().to_string());
    env.entry("PATH".to_string())
        .or_insert_with(|| DEFAULT_PATH.to_string());
    env
}

impl Processes {
    pub fn new(cfg: ProcessConfig, reaper: Reaper, outbox: Outbox) -> Self {
        Self {
            table: Arc::default(),
            changed: Arc::new(Notify::new()),
            reaper,
            outbox,
            cfg: Arc::new(cfg),
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a process (see the module doc). The caller queues the
    /// response with `result`, then calls [`Started::run`].
    pub async fn spawn(&self, spec: SpawnSpec) -> Result<Started, ProcessError> {
        if spec.id.is_empty() {
            return Err(ProcessError::EmptyId);
        }
        names::session_name(&spec.name)?;
        if let Some(Record {
            state: State::Running { .. },
            ..
        }) = self.table().procs.get(&spec.id)
        {
            return Err(ProcessError::Duplicate(spec.id));
        }
        tracing::debug!(
            id = %spec.id,
            is_resume = spec.is_resume,
            one_shot = spec.one_shot,
            mount_skeleton_home = spec.mount_skeleton_home,
            allowed_domains = spec.allowed_domains.as_ref().map(|d| d.len()),
            "spawn options"
        );
        let procs = self.clone();
        let blocking = tokio::task::spawn_blocking(move || procs.spawn_blocking(spec));
        let forked = blocking
            .await
            .map_err(|e| ProcessError::Internal(e.to_string()))??;
        self.register(forked)
    }

    fn spawn_blocking(&self, spec: SpawnSpec) -> Result<Forked, ProcessError> {
        let root = &self.cfg.sessions_root;
        mounts::ensure_session_dir(root, &spec.name)?;
        let session_dir = root.join(&spec.name);
        let mut failed = Vec::new();
        for m in &spec.mounts {
            if let Err(e) = mounts::mount_session(root, m) {
                tracing::warn!(id = %spec.id, mount = %m.name, error = %e, "session mount failed");
                failed.push(m.name.clone());
            }
        }
        let cwd = match &spec.cwd {
            Some(c) if !c.is_empty() => session_dir.join(c),
            _ => session_dir.clone(),
        };
        if !cwd.is_dir() {
            return Err(ProcessError::NoCwd(cwd.display().to_string()));
        }
        let env = build_env(&spec, &session_dir);
        let (cgroup, cgroup_procs) = match &self.cfg.cgroups {
            Some(cgs) => match cgs.create() {
                Ok((cg, fd)) => (Some(cg), Some(fd)),
                Err(e) => {
                    tracing::warn!(id = %spec.id, error = %e, "process runs without its own cgroup");
                    (None, None)
                }
            },
            None => (None, None),
        };
        let setup = ChildSetup {
            cgroup_procs,
            private_paths: self.cfg.private_paths.clone(),
            drop_caps: self.cfg.drop_caps,
        };
        let mut cmd = Command::new(&spec.command);
        cmd.args(&spec.args)
            .env_clear()
            .envs(&env)
            .current_dir(&cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        // SAFETY: `ChildSetup::apply` only makes async-signal-safe raw
        // syscalls on data prepared before the fork.
        unsafe { cmd.pre_exec(move || setup.apply()) };
        let spawned = self.reaper.spawn_registered(|| cmd.spawn());
        drop(cmd); // closes the parent's copy of the cgroup.procs descriptor
        match spawned {
            Ok((child, status)) => Ok(Forked {
                spec,
                child,
                status,
                cgroup,
                failed,
            }),
            Err(e) => {
                if let (Some(cgs), Some(cg)) = (&self.cfg.cgroups, cgroup) {
                    cgs.finish(cg);
                }
                if e.kind() == io::ErrorKind::NotFound {
                    Err(ProcessError::CommandNotFound(spec.command))
                } else {
                    Err(ProcessError::Spawn {
                        command: spec.command,
                        source: e,
                    })
                }
            }
        }
    }

    fn register(&self, forked: Forked) -> Result<Started, ProcessError> {
        let Forked {
            spec,
            mut child,
            status,
            cgroup,
            failed,
        } = forked;
        let pid = child.id() as libc::pid_t;
        let pipes = (|| -> io::Result<(FdIo, FdIo, FdIo)> {
            let take = |fd: Option<OwnedFd>| fd.ok_or_else(|| io::Error::other("missing pipe"));
            let stdin = take(child.stdin.take().map(OwnedFd::from))?;
            let stdout = take(child.stdout.take().map(OwnedFd::from))?;
            let stderr = take(child.stderr.take().map(OwnedFd::from))?;
            for fd in [&stdin, &stdout, &stderr] {
                let _ = sys::set_pipe_size(fd.as_fd(), PIPE_SIZE);
            }
            Ok((FdIo::new(stdin)?, FdIo::new(stdout)?, FdIo::new(stderr)?))
        })();
        let (stdin, stdout, stderr) = match pipes {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: signalling the group we just created.
                unsafe { libc::killpg(pid, libc::SIGKILL) };
                return Err(ProcessError::Internal(format!("cannot set up pipes: {e}")));
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let mut table = self.table();
        if let Some(Record {
            state: State::Running { .. },
            ..
        }) = table.procs.get(&spec.id)
        {
            drop(table);
            // SAFETY: signalling the group we just created.
            unsafe { libc::killpg(pid, libc::SIGKILL) };
            return Err(ProcessError::Duplicate(spec.id));
        }
        table.generation += 1;
        let generation = table.generation;
        table.procs.insert(
            spec.id.clone(),
            Record {
                pid,
                session: spec.name.clone(),
                generation,
                cgroup: cgroup.as_ref().map(|c| c.path.clone()),
                state: State::Running { stdin: Some(tx) },
            },
        );
        drop(table);
        tracing::info!(id = %spec.id, session = %spec.name, command = %spec.command, pid, "process started");
        Ok(Started {
            procs: self.clone(),
            id: spec.id,
            pid,
            generation,
            stdin: (stdin, rx),
            stdout,
            stderr,
            status,
            cgroup,
            result: json!({ "failedMounts": failed }),
        })
    }

    /// Queues `data` for the process's stdin.
    pub fn write_stdin(&self, id: &str, data: Vec<u8>) -> Result<(), ProcessError> {
        let table = self.table();
        match table.procs.get(id).map(|r| &r.state) {
            None => Err(ProcessError::Unknown(id.to_string())),
            Some(State::Exited(_)) => Err(ProcessError::NotRunning(id.to_string())),
            Some(State::Running { stdin: None }) => Err(ProcessError::StdinClosed(id.to_string())),
            Some(State::Running { stdin: Some(tx) }) => tx
                .send(StdinCmd::Data(data))
                .map_err(|_| ProcessError::StdinClosed(id.to_string())),
        }
    }

    /// Closes the process's stdin after the queued data (idempotent).
    pub fn close_stdin(&self, id: &str) -> Result<(), ProcessError> {
        let mut table = self.table();
        match table.procs.get_mut(id).map(|r| &mut r.state) {
            None => Err(ProcessError::Unknown(id.to_string())),
            Some(State::Exited(_)) => Ok(()),
            Some(State::Running { stdin }) => {
                if let Some(tx) = stdin.take() {
                    let _ = tx.send(StdinCmd::Close);
                }
                Ok(())
            }
        }
    }

    /// Sends `sig` to the process's group; success for exited processes.
    pub fn kill(&self, id: &str, sig: i32) -> Result<(), ProcessError> {
        if !(1..=64).contains(&sig) {
            return Err(ProcessError::InvalidSignal(sig));
        }
        let table = self.table();
        let rec = table
            .procs
            .get(id)
            .ok_or_else(|| ProcessError::Unknown(id.to_string()))?;
        if let State::Exited(_) = rec.state {
            return Ok(());
        }
        tracing::info!(id, signal = %signal::name(sig), "signalling process group");
        // SAFETY: plain syscall; the group is ours while the record runs.
        if unsafe { libc::killpg(rec.pid, sig) } == -1 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(ProcessError::Kill {
                    id: id.to_string(),
                    source: e,
                });
            }
        }
        if sig == libc::SIGKILL {
            if let Some(path) = &rec.cgroup {
                Cgroups::kill(&ProcCgroup { path: path.clone() });
            }
        }
        Ok(())
    }

    /// `{"running": bool, "exitCode"?: n, "signal"?: name}`.
    pub fn status(&self, id: &str) -> Result<Value, ProcessError> {
        let table = self.table();
        let rec = table
            .procs
            .get(id)
            .ok_or_else(|| ProcessError::Unknown(id.to_string()))?;
        Ok(match rec.state {
            State::Running { .. } => json!({"running": true}),
            State::Exited(ExitStatus::Code(c)) => json!({"running": false, "exitCode": c}),
            State::Exited(ExitStatus::Signal(s)) => {
                json!({"running": false, "signal": signal::name(s)})
            }
            State::Exited(ExitStatus::Unknown) => json!({"running": false}),
        })
    }

    /// Sessions that have a running process.
    pub fn live_sessions(&self) -> HashSet<String> {
        self.table()
            .procs
            .values()
            .filter(|r| matches!(r.state, State::Running { .. }))
            .map(|r| r.session.clone())
            .collect()
    }

    /// Number of processes whose `Exit` was not sent yet.
    pub fn running(&self) -> usize {
        self.table()
            .procs
            .values()
            .filter(|r| matches!(r.state, State::Running { .. }))
            .count()
    }

    /// SIGKILLs every running process group (and its cgroup).
    pub fn kill_all(&self) {
        let table = self.table();
        for (id, rec) in &table.procs {
            if let State::Running { .. } = rec.state {
                tracing::info!(id = %id, "killing process group");
                // SAFETY: plain syscall on our own process group.
                unsafe { libc::killpg(rec.pid, libc::SIGKILL) };
                if let Some(path) = &rec.cgroup {
                    Cgroups::kill(&ProcCgroup { path: path.clone() });
                }
            }
        }
        drop(table);
        if let Some(cgs) = &self.cfg.cgroups {
            cgs.kill_leftovers();
        }
    }

    /// Waits until no process is running (their exits were queued), at most `limit`.
    pub async fn wait_all_exited(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.changed.notified();
            if self.running() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.running() == 0;
            }
        }
    }

    fn mark_exited(&self, id: &str, generation: u64, status: ExitStatus) {
        let mut table = self.table();
        if let Some(rec) = table.procs.get_mut(id) {
            if rec.generation == generation {
                rec.state = State::Exited(status);
                table.exited.push_back((id.to_string(), generation));
            }
        }
        while table.exited.len() > MAX_EXITED_RECORDS {
            let Some((old, gen)) = table.exited.pop_front() else {
                break;
            };
            if table.procs.get(&old).is_some_and(|r| r.generation == gen) {
                table.procs.remove(&old);
            }
        }
        drop(table);
        self.changed.notify_waiters();
    }
}

impl Started {
    /// The process's pid.
    pub fn pid(&self) -> libc::pid_t {
        self.pid
    }

    /// Starts the stdin writer and the supervisor.
    pub fn run(self) {
        let (stdin, rx) = self.stdin;
        tokio::spawn(stdin_writer(self.id.clone(), stdin, rx));
        tokio::spawn(supervise(
            self.procs,
            self.id,
            self.generation,
            self.stdout,
            self.stderr,
            self.status,
            self.cgroup,
        ));
    }
}

async fn stdin_writer(id: String, io: FdIo, mut rx: mpsc::UnboundedReceiver<StdinCmd>) {
    while let Some(cmd) = rx.recv().await {
        match cmd {
            StdinCmd::Data(d) => {
                if let Err(e) = io.write_all(&d).await {
                    tracing::debug!(id = %id, error = %e, "stdin closed by the process");
                    break;
                }
            }
            StdinCmd::Close => break,
        }
    }
}

/// Reads one pipe until EOF, sending each chunk as a `Stdout`/`Stderr` frame.
async fn pump(outbox: Outbox, header: Vec<u8>, io: FdIo) {
    let prefix = 4 + 4 + header.len();
    loop {
        let mut frame = Vec::with_capacity(prefix + READ_CHUNK);
        frame.extend_from_slice(&[0; 4]);
        frame.extend_from_slice(&(header.len() as u32).to_be_bytes());
        frame.extend_from_slice(&header);
        match io.read_append(&mut frame, READ_CHUNK).await {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "reading process output failed");
                return;
            }
        }
        let body_len = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&body_len.to_be_bytes());
        if frame.len() < frame.capacity() / 4 {
            frame.shrink_to_fit(); // small chunks must not pin big buffers in the queue
        }
        if outbox.send_frame(frame).await.is_err() {
            return;
        }
    }
}

fn header_of(msg: &AgentMessage) -> Vec<u8> {
    // Serializing our own message type cannot fail.
    serde_json::to_vec(msg).unwrap_or_default()
}

async fn supervise(
    procs: Processes,
    id: String,
    generation: u64,
    stdout: FdIo,
    stderr: FdIo,
    mut status: oneshot::Receiver<ExitStatus>,
    cgroup: Option<ProcCgroup>,
) {
    let out_header = header_of(&AgentMessage::Stdout { id: id.clone() });
    let err_header = header_of(&AgentMessage::Stderr { id: id.clone() });
    let mut pumps = Box::pin(async {
        tokio::join!(
            pump(procs.outbox.clone(), out_header, stdout),
            pump(procs.outbox.clone(), err_header, stderr)
        )
    });
    let mut pumps_done = false;
    let exit = tokio::select! {
        _ = &mut pumps => {
            pumps_done = true;
            (&mut status).await.unwrap_or(ExitStatus::Unknown)
        }
        s = &mut status => s.unwrap_or(ExitStatus::Unknown),
    };
    if !pumps_done && tokio::time::timeout(EOF_GRACE, &mut pumps).await.is_err() {
        tracing::warn!(id = %id, "output still open {EOF_GRACE:?} after exit; dropping the rest");
    }
    drop(pumps);
    let oom_kill_count = match (&procs.cfg.cgroups, cgroup) {
        (Some(cgs), Some(cg)) => cgs.finish(cg),
        _ => None,
    };
    let (exit_code, sig) = match exit {
        ExitStatus::Code(c) => (Some(c), None),
        ExitStatus::Signal(s) => (None, Some(signal::name(s))),
        ExitStatus::Unknown => (None, None),
    };
    tracing::info!(id = %id, exit_code, signal = sig.as_deref(), oom_kill_count, "process exited");
    let msg = AgentMessage::Exit {
        id: id.clone(),
        exit_code,
        signal: sig,
        oom_kill_count,
    };
    if let Err(e) = procs.outbox.send(&msg, &[]).await {
        tracing::debug!(id = %id, error = %e, "exit event not sent");
    }
    procs.mark_exited(&id, generation, exit);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Secret;

    fn spec(env: &[(&str, &str)], token: Option<&str>) -> SpawnSpec {
        SpawnSpec {
            id: "p".into(),
            name: "s".into(),
            command: "env".into(),
            args: vec![],
            cwd: None,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            oauth_token: token.map(|t| Secret(t.into())),
            mounts: vec![],
            is_resume: false,
            one_shot: false,
            mount_skeleton_home: false,
            allowed_domains: None,
        }
    }

    #[test]
    fn oauth_rule_and_empty_values() {
        let dir = Path::new("/sessions/s");
        let env = build_env(&spec(&[("A", ""), ("B", "x")], Some("tok")), dir);
        assert_eq!(
            env.get("CLAUDE_CODE_OAUTH_TOKEN").map(String::as_str),
            Some("tok")
        );
        assert!(!env.contains_key("A"));
        assert_eq!(env["B"], "x");
        assert_eq!(env["HOME"], "/sessions/s");
        assert!(env.contains_key("PATH"));
        for cred in proto::CREDENTIAL_VARS {
            let env = build_env(&spec(&[(cred, "mine")], Some("tok")), dir);
            assert_eq!(env[cred], "mine");
            if cred != OAUTH_VAR {
                assert!(!env.contains_key(OAUTH_VAR), "{cred}");
            }
        }
        // An empty credential does not count as one.
        let env = build_env(&spec(&[("ANTHROPIC_API_KEY", "")], Some("tok")), dir);
        assert_eq!(env[OAUTH_VAR], "tok");
        assert!(!env.contains_key("ANTHROPIC_API_KEY"));
        let env = build_env(&spec(&[("HOME", "/home/u"), ("BAD=KEY", "v")], None), dir);
        assert_eq!(env["HOME"], "/home/u");
        assert!(!env.contains_key(OAUTH_VAR));
        assert!(!env.contains_key("BAD=KEY"));
    }
}
