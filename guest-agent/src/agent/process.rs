//! Spawned processes: start, output, stdin, signals, exit.
//!
//! Each process leads its own session (and so its own process group) with
//! three pipes; its session id is what egress attribution keys on (see
//! [`crate::egress::attrib`]): a process cannot join another session, so
//! one spawn's descendants cannot pass for another's. A
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
//!
//! Before a spawn the session's home is prepared ([`users::prepare`]); with
//! [`ProcessConfig::users`] (a VM) the session's user is created too and the
//! process runs as it, without capabilities ([`super::child`]). The process
//! environment is the client's plus defaults ([`build_env`]).
//!
//! Each spawn's egress proxy URL ([`SpawnSpec::egress_proxy`]) is
//! registered with its pid in [`ProcessConfig::egress`] right after the
//! fork and removed when the process is reaped. No spawn is forked before
//! egress start-up has finished ([`ProcessConfig::egress_ready`], bounded
//! by [`crate::egress::gate::START_LIMIT`]), so its first connection is
//! captured like any later one; a spawn that arrives earlier (right after
//! the hello) waits there, after its request was checked. The serve loop
//! handles spawns in order, so requests behind such a spawn wait with it;
//! requests that do not follow a spawn never do.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, Notify};

use super::cgroup::{Cgroups, ProcCgroup};
use super::child::{ChildSetup, Credentials};
use super::fdio::FdIo;
use super::mounts;
use super::outbox::Outbox;
use super::reaper::{ExitStatus, Reaper};
use super::users::{self, Home, UserDb};
use crate::proto::{self, AgentMessage, SpawnSpec};
use crate::sync::MutexExt;
use crate::sys;
use crate::{janitor, names, signal};

/// How long after the reap the agent waits for the pipes to reach EOF.
pub const EOF_GRACE: Duration = Duration::from_secs(2);

/// Exited processes remembered for `ProcessStatus`.
pub const MAX_EXITED_RECORDS: usize = 1024;

/// Requested pipe capacity (best effort; capped by `/proc/sys/fs/pipe-max-size`).
const PIPE_SIZE: usize = 1024 * 1024;

/// Stdin bytes a process may have queued in the agent (accepted by
/// `WriteStdin`, not yet written into its pipe) before further writes are
/// refused with [`ProcessError::StdinFull`]: sixteen times the process's
/// 1 MiB pipe, so a client streaming into a process that reads keeps
/// far ahead of it, while one that never reads cannot grow the agent (in
/// the sandbox, a host process) without bound. A refused write is not
/// queued at all; the accepted ones stay whole and in order.
pub const MAX_QUEUED_STDIN: usize = 16 * PIPE_SIZE;

/// Bytes asked for per `read` of an output pipe.
const READ_CHUNK: usize = proto::MAX_CHUNK;

/// `PATH` of spawned processes whose environment names none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The environment variable that carries the OAuth token.
const OAUTH_VAR: &str = "CLAUDE_CODE_OAUTH_TOKEN";

/// `LANG` of spawned processes whose environment names none: UTF-8 without
/// depending on generated locales (glibc has C.UTF-8 built in since 2.35).
const DEFAULT_LANG: &str = "C.UTF-8";

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
    #[error("cannot start {command} as the session user {login}: permission denied (the program or the working directory {cwd} is not accessible to that user)")]
    Denied {
        command: String,
        login: String,
        cwd: String,
    },
    #[error("cannot prepare the session directory: {0}")]
    Session(#[from] mounts::MountError),
    #[error(transparent)]
    User(#[from] users::UserError),
    #[error("no process with id {0}")]
    Unknown(String),
    #[error("process {0} is not running")]
    NotRunning(String),
    #[error("stdin of process {0} is closed")]
    StdinClosed(String),
    #[error("stdin of process {id} already has {queued} bytes queued that it has not read; writing {len} more would pass the limit of {limit} bytes per process: the write was refused, retry once the process reads its input")]
    StdinFull {
        id: String,
        queued: usize,
        len: usize,
        limit: usize,
    },
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
    /// `oom_score_adj` of spawned processes (`--oom-score-adj`).
    pub oom_score_adj: Option<i32>,
    /// Copied into every new home (`/etc/skel`).
    pub skel_dir: Option<PathBuf>,
    /// Per-session users: each session's processes run as its own user
    /// (the VM's init only; needs root). `None`: they run as the agent's
    /// user (the sandbox backend, tests).
    pub users: Option<UserDb>,
    /// `SHELL` of spawned processes whose environment names none.
    pub shell: Option<String>,
    /// The live spawns' egress credentials, for the captured-flow handler.
    pub egress: crate::egress::Spawns,
    /// Opens when egress start-up has finished; every spawn waits for it
    /// before the fork (open from the start without egress).
    pub egress_ready: crate::egress::EgressGate,
    /// The session whose processes run as the agent's user (root in a VM)
    /// with its capabilities: the test hook [`proto::ROOT_SESSION_ENV`].
    pub root_session: Option<String>,
}

/// Defaults of a session's process environment (the client's env wins).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionEnv {
    /// `HOME`; `TMPDIR` is its `tmp/`.
    pub home: PathBuf,
    /// `USER` and `LOGNAME`, when the session has its own user.
    pub user: Option<String>,
    /// `SHELL`.
    pub shell: Option<String>,
}

enum StdinCmd {
    Data(Vec<u8>),
    Close,
}

/// The sending end of a process's stdin queue and its byte count (bytes
/// accepted and not yet written into the pipe, see [`MAX_QUEUED_STDIN`]).
struct StdinTx {
    tx: mpsc::UnboundedSender<StdinCmd>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
}

enum State {
    Running { stdin: Option<StdinTx> },
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
    /// The session user it runs as, if any.
    uid: Option<u32>,
    /// Its egress credential's registration.
    egress: Option<crate::egress::Ticket>,
}

/// A process that was started and whose response must be sent before its
/// output: call [`Started::run`] after queueing the response.
pub struct Started {
    procs: Processes,
    id: String,
    pid: libc::pid_t,
    generation: u64,
    stdin: (
        FdIo,
        mpsc::UnboundedReceiver<StdinCmd>,
        Arc<std::sync::atomic::AtomicUsize>,
    ),
    stdout: FdIo,
    stderr: FdIo,
    status: oneshot::Receiver<ExitStatus>,
    cgroup: Option<ProcCgroup>,
    egress: Option<crate::egress::Ticket>,
    /// Result of the spawn request.
    pub result: Value,
}

/// The environment of a spawned process: the client's, without empty
/// values, plus the OAuth token when no credential is set, and where the
/// client's environment does not set them: `HOME` (the session directory),
/// `TMPDIR` (its `tmp/`), `PATH`, `LANG`, and from `defaults` `USER` and
/// `LOGNAME` (the session user's login name) and `SHELL`.
pub fn build_env(spec: &SpawnSpec, defaults: &SessionEnv) -> BTreeMap<String, String> {
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
    let mut default = |k: &str, v: String| {
        env.entry(k.to_string()).or_insert(v);
    };
    default("HOME", defaults.home.display().to_string());
    default(
        "TMPDIR",
        defaults.home.join(janitor::TMP_DIR).display().to_string(),
    );
    default("PATH", DEFAULT_PATH.to_string());
    default("LANG", DEFAULT_LANG.to_string());
    if let Some(user) = &defaults.user {
        default("USER", user.clone());
        default("LOGNAME", user.clone());
    }
    if let Some(shell) = &defaults.shell {
        default("SHELL", shell.clone());
    }
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
        self.table.locked()
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
        self.wait_for_egress(&spec.id).await;
        let procs = self.clone();
        let blocking = tokio::task::spawn_blocking(move || procs.spawn_blocking(spec));
        let forked = blocking
            .await
            .map_err(|e| ProcessError::Internal(e.to_string()))??;
        self.register(forked)
    }

    /// Waits (bounded, see [`crate::egress::gate`]) until egress start-up
    /// has finished; logs how long when it had to.
    async fn wait_for_egress(&self, id: &str) {
        let gate = &self.cfg.egress_ready;
        if gate.is_open() {
            return;
        }
        let began = std::time::Instant::now();
        let passage = gate.wait().await;
        tracing::debug!(
            id,
            ?passage,
            waited_ms = began.elapsed().as_millis() as u64,
            "spawn waited for egress start-up"
        );
    }

    /// Creates (if needed) the session's home, and its user when sessions
    /// have their own users. Every spawn and mount of a session comes here first.
    pub fn prepare_session(&self, session: &str) -> Result<Home, ProcessError> {
        Ok(users::prepare(
            &self.cfg.sessions_root,
            session,
            self.cfg.skel_dir.as_deref(),
            self.cfg.users.as_ref(),
        )?)
    }

    fn spawn_blocking(&self, spec: SpawnSpec) -> Result<Forked, ProcessError> {
        let root = &self.cfg.sessions_root;
        let as_root = self.cfg.root_session.as_deref() == Some(spec.name.as_str());
        let home = if as_root {
            tracing::warn!(id = %spec.id, session = %spec.name, "test hook: this session runs as the agent's user with its capabilities");
            users::prepare(root, &spec.name, self.cfg.skel_dir.as_deref(), None)?
        } else {
            self.prepare_session(&spec.name)?
        };
        let session_dir = home.dir;
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
        let defaults = SessionEnv {
            home: session_dir.clone(),
            user: home.user.as_ref().map(|u| u.login.clone()),
            shell: self.cfg.shell.clone(),
        };
        let env = build_env(&spec, &defaults);
        // A session user enters its working directory itself, after the
        // switch, so its own permissions apply (not the agent's).
        let child_cwd = match &home.user {
            Some(_) => Some(
                sys::cstring(&cwd).map_err(|_| ProcessError::NoCwd(cwd.display().to_string()))?,
            ),
            None => None,
        };
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
            oom_score_adj: self
                .cfg
                .oom_score_adj
                .map(|adj| adj.to_string().into_bytes()),
            private_paths: self.cfg.private_paths.clone(),
            drop_caps: self.cfg.drop_caps && !as_root,
            user: home.user.as_ref().map(|u| Credentials {
                uid: u.uid,
                gid: u.gid,
            }),
            cwd: child_cwd,
        };
        let mut cmd = Command::new(&spec.command);
        if setup.cwd.is_none() {
            cmd.current_dir(&cwd);
        }
        cmd.args(&spec.args)
            .env_clear()
            .envs(&env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: `setsid` and `ChildSetup::apply` only make
        // async-signal-safe raw syscalls on data prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                // A new session (and process group) led by the child.
                sys::cvt(libc::setsid())?;
                setup.apply()
            })
        };
        let spawned = self.reaper.spawn_registered(|| cmd.spawn());
        drop(cmd); // closes the parent's copy of the cgroup.procs descriptor
        match spawned {
            Ok((child, status)) => {
                let egress = self.cfg.egress.register(
                    child.id() as i32,
                    spec.egress_proxy.as_ref().map(|s| s.0.as_str()),
                );
                Ok(Forked {
                    spec,
                    child,
                    status,
                    cgroup,
                    failed,
                    uid: home.user.as_ref().map(|u| u.uid),
                    egress,
                })
            }
            Err(e) => {
                if let (Some(cgs), Some(cg)) = (&self.cfg.cgroups, cgroup) {
                    cgs.finish(cg);
                }
                if e.kind() == io::ErrorKind::NotFound {
                    Err(ProcessError::CommandNotFound(spec.command))
                } else if let (Some(user), Some(libc::EACCES)) = (&home.user, e.raw_os_error()) {
                    Err(ProcessError::Denied {
                        command: spec.command,
                        login: user.login.clone(),
                        cwd: cwd.display().to_string(),
                    })
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
            uid,
            egress,
        } = forked;
        let unregister = || {
            if let Some(t) = egress {
                self.cfg.egress.unregister(t);
            }
        };
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
                unregister();
                return Err(ProcessError::Internal(format!("cannot set up pipes: {e}")));
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let tx = StdinTx {
            tx,
            queued: queued.clone(),
        };
        let mut table = self.table();
        if let Some(Record {
            state: State::Running { .. },
            ..
        }) = table.procs.get(&spec.id)
        {
            drop(table);
            // SAFETY: signalling the group we just created.
            unsafe { libc::killpg(pid, libc::SIGKILL) };
            unregister();
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
        tracing::info!(id = %spec.id, session = %spec.name, command = %spec.command, pid, uid, "process started");
        Ok(Started {
            procs: self.clone(),
            id: spec.id,
            pid,
            generation,
            stdin: (stdin, rx, queued),
            stdout,
            stderr,
            status,
            cgroup,
            egress,
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
            Some(State::Running { stdin: Some(tx) }) => {
                use std::sync::atomic::Ordering;
                let len = data.len();
                // Only this function adds (under the table lock); the
                // writer subtracts, so the check cannot be raced past.
                let queued = tx.queued.load(Ordering::Acquire);
                if queued.saturating_add(len) > MAX_QUEUED_STDIN && queued > 0 {
                    return Err(ProcessError::StdinFull {
                        id: id.to_string(),
                        queued,
                        len,
                        limit: MAX_QUEUED_STDIN,
                    });
                }
                tx.queued.fetch_add(len, Ordering::AcqRel);
                tx.tx.send(StdinCmd::Data(data)).map_err(|_| {
                    tx.queued.fetch_sub(len, Ordering::AcqRel);
                    ProcessError::StdinClosed(id.to_string())
                })
            }
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
                    let _ = tx.tx.send(StdinCmd::Close);
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
        let (stdin, rx, queued) = self.stdin;
        tokio::spawn(stdin_writer(self.id.clone(), stdin, rx, queued));
        tokio::spawn(supervise(
            self.procs,
            self.id,
            self.generation,
            self.stdout,
            self.stderr,
            self.status,
            Held {
                cgroup: self.cgroup,
                egress: self.egress,
            },
        ));
    }
}

async fn stdin_writer(
    id: String,
    io: FdIo,
    mut rx: mpsc::UnboundedReceiver<StdinCmd>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
) {
    while let Some(cmd) = rx.recv().await {
        match cmd {
            StdinCmd::Data(d) => {
                let written = io.write_all(&d).await;
                // Counted as queued until it is in the pipe.
                queued.fetch_sub(d.len(), std::sync::atomic::Ordering::AcqRel);
                if let Err(e) = written {
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

/// What a process holds until it exits: its cgroup and its egress
/// credential's registration.
struct Held {
    cgroup: Option<ProcCgroup>,
    egress: Option<crate::egress::Ticket>,
}

async fn supervise(
    procs: Processes,
    id: String,
    generation: u64,
    stdout: FdIo,
    stderr: FdIo,
    mut status: oneshot::Receiver<ExitStatus>,
    held: Held,
) {
    let Held { cgroup, egress } = held;
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
    // Reaped: its credential is revoked on the host; captured connections of
    // leftover descendants are no longer attributed to it.
    if let Some(t) = egress {
        procs.cfg.egress.unregister(t);
    }
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
    use super::super::fdio::FdIo;
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
            egress_proxy: None,
        }
    }

    fn defaults(home: &str) -> SessionEnv {
        SessionEnv {
            home: home.into(),
            user: None,
            shell: None,
        }
    }

    #[test]
    fn oauth_rule_and_empty_values() {
        let dir = &defaults("/sessions/s");
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

    #[test]
    fn session_defaults_fill_only_what_the_client_left_out() {
        let full = SessionEnv {
            home: "/sessions/s".into(),
            user: Some("s".into()),
            shell: Some("/bin/bash".into()),
        };
        let env = build_env(&spec(&[], None), &full);
        let want = [
            ("HOME", "/sessions/s"),
            ("TMPDIR", "/sessions/s/tmp"),
            ("PATH", DEFAULT_PATH),
            ("LANG", "C.UTF-8"),
            ("USER", "s"),
            ("LOGNAME", "s"),
            ("SHELL", "/bin/bash"),
        ];
        let got: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut want_sorted = want.to_vec();
        want_sorted.sort();
        assert_eq!(got, want_sorted);
        assert!(DEFAULT_PATH.split(':').any(|d| d == "/usr/local/bin"));
        // The client's values win, each one separately.
        for (k, _) in want {
            let env = build_env(&spec(&[(k, "mine")], None), &full);
            assert_eq!(env[k], "mine", "{k}");
            assert_eq!(env.len(), want.len(), "{k}");
        }
        // Without a session user or bash, no USER, LOGNAME or SHELL is made up.
        let env = build_env(&spec(&[], None), &defaults("/sessions/s"));
        for k in ["USER", "LOGNAME", "SHELL"] {
            assert!(!env.contains_key(k), "{k}");
        }
        assert_eq!(env["TMPDIR"], "/sessions/s/tmp");
    }

    /// Runs `script` with `sh -c` as a process of `session`; returns its
    /// stdout, stderr and exit code.
    async fn run_sh(
        procs: &Processes,
        link: &mut tokio::io::BufReader<tokio::net::UnixStream>,
        id: &str,
        session: &str,
        script: &str,
    ) -> (String, String, Option<i32>) {
        let mut s = spec(&[], None);
        s.id = id.into();
        s.name = session.into();
        s.command = "sh".into();
        s.args = vec!["-c".into(), script.into()];
        procs.spawn(s).await.expect("spawn").run();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut buf = Vec::new();
        loop {
            let more = crate::framing::read_frame(link, proto::MAX_MESSAGE, &mut buf)
                .await
                .unwrap();
            assert!(more, "link closed");
            let env: proto::Envelope<AgentMessage> =
                proto::decode(std::mem::take(&mut buf)).unwrap();
            match env.header {
                AgentMessage::Stdout { id: i } if i == id => out.extend(env.payload),
                AgentMessage::Stderr { id: i } if i == id => err.extend(env.payload),
                AgentMessage::Exit {
                    id: i, exit_code, ..
                } if i == id => {
                    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
                    return (text(out), text(err), exit_code);
                }
                _ => {}
            }
        }
    }

    /// Each spawn leads its own session (what egress attribution keys on),
    /// and its egress credential is registered under its pid while it runs
    /// and removed when it has exited.
    #[tokio::test]
    async fn spawns_lead_sessions_and_register_their_egress_credential() {
        let t = tempfile::tempdir().unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (outbox, _writer) = Outbox::start(FdIo::new(a.into()).unwrap());
        b.set_nonblocking(true).unwrap();
        let mut link = tokio::io::BufReader::new(tokio::net::UnixStream::from_std(b).unwrap());
        let spawns = crate::egress::Spawns::new();
        let procs = Processes::new(
            ProcessConfig {
                sessions_root: t.path().join("sessions"),
                egress: spawns.clone(),
                ..ProcessConfig::default()
            },
            Reaper::start(super::super::reaper::ReapMode::Own).unwrap(),
            outbox,
        );
        let mut s = spec(&[], None);
        s.command = "sh".into();
        s.args = vec![
            "-c".into(),
            "echo $$ $(cut -d' ' -f6 /proc/$$/stat); read x || true".into(),
        ];
        s.egress_proxy = Some(Secret("http://s:t%40k@127.0.0.1:3128".into()));
        let started = procs.spawn(s).await.expect("spawn");
        let pid = started.pid();
        started.run();
        let mut out = Vec::new();
        let mut buf = Vec::new();
        while !out.ends_with(b"\n") {
            assert!(
                crate::framing::read_frame(&mut link, proto::MAX_MESSAGE, &mut buf)
                    .await
                    .unwrap()
            );
            let env: proto::Envelope<AgentMessage> =
                proto::decode(std::mem::take(&mut buf)).unwrap();
            if let AgentMessage::Stdout { .. } = env.header {
                out.extend(env.payload);
            }
        }
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.trim(), format!("{pid} {pid}"), "pid and session id");
        let cred = spawns.get(pid).expect("registered while running");
        assert_eq!(cred.password, b"t@k");
        procs.close_stdin("p").unwrap();
        loop {
            assert!(
                crate::framing::read_frame(&mut link, proto::MAX_MESSAGE, &mut buf)
                    .await
                    .unwrap()
            );
            let env: proto::Envelope<AgentMessage> =
                proto::decode(std::mem::take(&mut buf)).unwrap();
            if let AgentMessage::Exit { exit_code, .. } = env.header {
                assert_eq!(exit_code, Some(0));
                break;
            }
        }
        assert!(spawns.get(pid).is_none(), "removed at exit");
        assert!(spawns.is_empty());
    }

    /// Processes on a socket pair, spawns gated by `ready`; the host end.
    fn gated_processes(
        sessions_root: PathBuf,
        ready: crate::egress::EgressGate,
    ) -> (Processes, tokio::io::BufReader<tokio::net::UnixStream>) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (outbox, _writer) = Outbox::start(FdIo::new(a.into()).unwrap());
        b.set_nonblocking(true).unwrap();
        let link = tokio::io::BufReader::new(tokio::net::UnixStream::from_std(b).unwrap());
        let procs = Processes::new(
            ProcessConfig {
                sessions_root,
                egress_ready: ready,
                ..ProcessConfig::default()
            },
            Reaper::start(super::super::reaper::ReapMode::Own).unwrap(),
            outbox,
        );
        (procs, link)
    }

    /// A bound for what must happen promptly (not a timing target).
    const PROMPT: Duration = Duration::from_secs(20);

    /// A spawn that arrives while egress start-up is still running is
    /// neither forked nor even prepared until the gate opens, and then
    /// runs normally; a request that fails its checks is answered at once;
    /// the other process operations never wait.
    #[tokio::test]
    async fn a_spawn_waits_for_egress_start_up() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("sessions");
        let (hold, ready) = crate::egress::gate::gate();
        let (procs, mut link) = gated_processes(root.clone(), ready);
        let mut bad = spec(&[], None);
        bad.id = String::new();
        let refused = tokio::time::timeout(PROMPT, procs.spawn(bad)).await;
        assert!(matches!(refused, Ok(Err(ProcessError::EmptyId))));
        assert!(matches!(procs.status("g"), Err(ProcessError::Unknown(_))));
        let marker = t.path().join("started");
        let script = format!("touch {}", marker.display());
        let waiting = {
            let procs = procs.clone();
            tokio::spawn(async move {
                let mut link = link;
                let out = run_sh(&procs, &mut link, "g", "s", &script).await;
                (out, link)
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "the spawn passed a closed gate");
        assert!(!marker.exists(), "the process ran before egress was up");
        assert!(!root.join("s").exists(), "the session was prepared early");
        hold.release();
        let ((_, err, code), returned) = tokio::time::timeout(PROMPT, waiting)
            .await
            .expect("the spawn goes ahead once the gate opens")
            .unwrap();
        link = returned;
        assert_eq!(code, Some(0), "{err}");
        assert!(marker.exists());
        // Later spawns do not wait at all.
        let (_, _, code) = run_sh(&procs, &mut link, "h", "s", "true").await;
        assert_eq!(code, Some(0));
    }

    /// A start-up that never finishes holds spawns only until the gate's
    /// limit; they then run (as after a failed install).
    #[tokio::test]
    async fn a_stuck_egress_start_up_delays_spawns_only_until_the_limit() {
        let t = tempfile::tempdir().unwrap();
        let limit = Duration::from_millis(300);
        let (_stuck, ready) = crate::egress::gate::gate_with_limit(limit);
        let (procs, mut link) = gated_processes(t.path().join("sessions"), ready);
        let began = std::time::Instant::now();
        let (out, _, code) =
            tokio::time::timeout(PROMPT, run_sh(&procs, &mut link, "g", "s", "echo ran"))
                .await
                .expect("the spawn goes ahead after the limit");
        assert_eq!((out.as_str(), code), ("ran\n", Some(0)));
        assert!(began.elapsed() >= limit, "{:?}", began.elapsed());
    }

    #[tokio::test]
    async fn session_processes_run_as_their_own_users() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: per-session users need root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        // Session users must be able to walk down to their homes.
        std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let etc = t.path().join("etc");
        std::fs::create_dir_all(etc.join("skel")).unwrap();
        std::fs::write(etc.join("skel/.profile"), b"# profile\n").unwrap();
        std::fs::write(etc.join("passwd"), b"root:x:0:0:root:/root:/bin/sh\n").unwrap();
        std::fs::write(etc.join("group"), b"root:x:0:\n").unwrap();
        let root = t.path().join("sessions");
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (outbox, _writer) = Outbox::start(FdIo::new(a.into()).unwrap());
        b.set_nonblocking(true).unwrap();
        let mut link = tokio::io::BufReader::new(tokio::net::UnixStream::from_std(b).unwrap());
        let procs = Processes::new(
            ProcessConfig {
                sessions_root: root.clone(),
                skel_dir: Some(etc.join("skel")),
                users: Some(UserDb::new(&etc, "/bin/sh")),
                shell: Some("/bin/bash".into()),
                ..ProcessConfig::default()
            },
            Reaper::start(super::super::reaper::ReapMode::Own).unwrap(),
            outbox,
        );
        let (uid1, uid2) = (proto::session_uid("s1"), proto::session_uid("s2"));
        let (_, err, code) = run_sh(
            &procs,
            &mut link,
            "w",
            "s2",
            "echo secret > \"$HOME/secret\" && chmod 644 \"$HOME/secret\"",
        )
        .await;
        assert_eq!(code, Some(0), "{err}");
        let secret = root.join("s2/secret");
        assert_eq!(std::fs::metadata(&secret).unwrap().uid(), uid2);
        let script = format!(
            "cat /proc/self/status; echo \"cwd=$(pwd)\"; env; \
             touch \"$TMPDIR/t\" && echo tmp-ok; \
             cat {} || echo other-denied; \
             touch mnt/x || echo mnt-denied; \
             echo via-dev-stdout > /dev/stdout; echo via-dev-stderr > /dev/stderr; \
             head -c0 /dev/stdin && echo stdin-path-ok; \
             echo x >> {} || echo passwd-denied",
            secret.display(),
            etc.join("passwd").display()
        );
        let (out, err, code) = run_sh(&procs, &mut link, "r", "s1", &script).await;
        assert_eq!(code, Some(0), "{out}");
        // The output pipes are the user's: /dev/stdout and /dev/stderr open.
        assert!(err.lines().any(|l| l == "via-dev-stderr"), "{err}");
        assert!(!err.contains("/dev/std"), "{err}");
        let line = |key: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(key))
                .unwrap_or_else(|| panic!("no {key} in {out}"))
                .trim()
                .to_string()
        };
        let ids = format!("{uid1}\t{uid1}\t{uid1}\t{uid1}");
        assert_eq!(line("Uid:"), ids);
        assert_eq!(line("Gid:"), ids);
        assert_eq!(line("Groups:"), uid1.to_string());
        for cap in ["CapPrm:", "CapEff:", "CapBnd:", "CapAmb:", "CapInh:"] {
            assert_eq!(u64::from_str_radix(&line(cap), 16).unwrap(), 0, "{cap}");
        }
        assert_eq!(line("NoNewPrivs:"), "1");
        let home = root.join("s1");
        assert_eq!(line("cwd="), home.display().to_string());
        assert_eq!(line("HOME="), home.display().to_string());
        assert_eq!(line("TMPDIR="), home.join("tmp").display().to_string());
        assert_eq!(line("USER="), "s1");
        assert_eq!(line("LOGNAME="), "s1");
        assert_eq!(line("SHELL="), "/bin/bash");
        assert_eq!(line("LANG="), "C.UTF-8");
        for marker in [
            "tmp-ok",
            "other-denied",
            "mnt-denied",
            "passwd-denied",
            "via-dev-stdout",
            "stdin-path-ok",
        ] {
            assert!(out.lines().any(|l| l == marker), "{marker}: {out}");
        }
        assert!(
            !out.contains("secret\n"),
            "read another session's file: {out}"
        );
        // A working directory in another session's home is the user's to enter, or not.
        let mut s = spec(&[], None);
        s.id = "cd".into();
        s.name = "s1".into();
        s.command = "pwd".into();
        s.cwd = Some(root.join("s2").display().to_string());
        let err = procs.spawn(s).await.err().expect("spawn refused");
        let text = err.to_string();
        assert!(matches!(err, ProcessError::Denied { .. }), "{text}");
        assert!(
            text.contains("s1") && text.contains("permission denied"),
            "{text}"
        );
        // The home came with /etc/skel, and the account files with the users.
        assert_eq!(
            std::fs::read(home.join(".profile")).unwrap(),
            b"# profile\n"
        );
        let passwd = std::fs::read_to_string(etc.join("passwd")).unwrap();
        assert!(passwd.contains(&format!("s1:x:{uid1}:{uid1}:")), "{passwd}");
        assert!(passwd.contains(&format!("s2:x:{uid2}:{uid2}:")), "{passwd}");
    }
}
