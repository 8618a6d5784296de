//! One profile's sandbox VM: its lifecycle, the link to the guest agent, and
//! the table of the processes it runs.
//!
//! A [`ProfileVm`] is started by `startVM`: the backend boots a machine whose agent
//! dials back over the link returned by the backend; the agent's hello makes
//! the guest "connected". From then on every session method is one request on
//! the [`AgentLink`], and the agent's unsolicited messages (output, exits,
//! guest requests) become client events on the profile's [`EventHub`].
//!
//! Concurrency: start and stop are serialized by an async mutex; the hot
//! queries (`isRunning`, `isGuestConnected`, `isProcessRunning`) read atomics
//! and short std mutexes only, so a slow boot never delays them.
//!
//! Modules (each adds methods to [`ProfileVm`]): `lifecycle` (start, stop, the
//! machine ending), `link` (the framed agent link: requests, answers,
//! unsolicited messages), `processes` (spawn, stdio, kill, mounts, the
//! process table), `storage` (the session disk or directory, the janitor),
//! `sdk` (`installSdk`, re-applied after every boot). The machine itself
//! comes from [`crate::backend`], which does not depend on this module.
//!
//! Limits: one machine per profile; at most [`MAX_PROCESSES`] processes
//! per profile; at most [`MAX_PENDING_REQUESTS`] requests awaiting the
//! agent's answer and [`MAX_QUEUED_BYTES`] queued towards it; exited
//! process records are kept for the last [`EXITED_RECORDS`] processes.

mod lifecycle;
mod link;
mod processes;
mod sdk;
mod storage;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use guest_agent::janitor::JanitorError;
use guest_agent::names::NameError;
use guest_agent::proto;
use tokio::sync::{oneshot, watch};

use crate::backend::{HostPaths, VmConfig};
use crate::egress::EgressError;
use crate::events::EventHub;
pub use lifecycle::StartError;
pub use link::{
    AgentLink, HelloError, PendingCall, MAX_PENDING_ENV, MAX_PENDING_REQUESTS, MAX_QUEUED_BYTES,
};
use processes::Procs;
pub use processes::{MountError, SpawnRequest, EXITED_RECORDS, MAX_PROCESSES, MAX_PROCESSES_ENV};
pub use sdk::SdkError;
pub use storage::{
    session_disk_bytes, StorageError, DEFAULT_SESSION_DISK_GIB, MAX_SESSION_DISK_GIB,
};
use vmm::sync::{MutexExt, RwLockExt};

/// Default deadline of one agent request.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long `stopVM` lets the agent end its processes before the machine is killed.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Errors of VM operations, worded for the client's log.
#[derive(Debug, thiserror::Error)]
pub enum ProfileVmError {
    #[error("the VM is not running: call startVM first")]
    NotRunning,
    #[error("the VM failed to start: {0}")]
    Start(#[from] StartError),
    #[error("the guest agent did not connect within {0:?}")]
    HelloTimeout(Duration),
    #[error("the guest agent disconnected")]
    AgentGone,
    #[error("the guest agent did not answer {op} within {timeout:?}")]
    Timeout { op: &'static str, timeout: Duration },
    #[error("the guest agent is not reading its link: {op} could not be sent within {timeout:?}")]
    NotReading { op: &'static str, timeout: Duration },
    #[error("{op} refused: the guest agent already has {limit} requests awaiting an answer (the helper's limit); retry when earlier ones have completed")]
    Busy { op: &'static str, limit: usize },
    #[error("spawn refused: this VM already runs {limit} processes (the helper's limit per profile); wait for one to exit or kill one")]
    TooManyProcesses { limit: usize },
    #[error("the helper is shutting down (SIGTERM, SIGINT, or the client closed its stdin): startVM refused; the client starts a new helper")]
    ShuttingDown,
    #[error("the VM was still starting when the helper's shutdown deadline passed; it ends with the helper")]
    StillStarting,
    /// The guest agent's own error for a request, or why the agent link
    /// ended (the agent broke its protocol): the guest's words, or the
    /// link's, never the client's.
    #[error("{0}")]
    Agent(String),
    /// A session or process name the agent would refuse.
    #[error(transparent)]
    Name(#[from] NameError),
    #[error("spawn: id must not be empty")]
    EmptyId,
    #[error("a process with id {0:?} is already running")]
    AlreadyRunning(String),
    #[error("mountPath: unknown process {0:?}")]
    UnknownProcess(String),
    /// A credential of the spawn cannot be replaced by a placeholder.
    #[error("spawn: {0}")]
    Credentials(#[source] EgressError),
    #[error("cannot issue the process's network credential: {0}")]
    NetworkCredential(#[source] EgressError),
    #[error("createVM: diskSizeGB {0} is out of range; give 1 to {MAX_SESSION_DISK_GIB} (GiB)")]
    DiskSize(u64),
    /// The sandbox's sessions directory cannot be made for the janitor.
    #[error("{}: {source}", root.display())]
    JanitorRoot {
        root: PathBuf,
        source: std::io::Error,
    },
    /// The host-side janitor (sandbox backend) failed.
    #[error(transparent)]
    Janitor(#[from] JanitorError),
    #[error("janitor task failed: {0}")]
    JanitorTask(#[source] tokio::task::JoinError),
    /// An agent request only the guest serves, asked of the host janitor.
    #[error("{0} needs a running VM")]
    NeedsVm(&'static str),
    #[error("cannot prepare the session disk: {0}")]
    SessionDisk(#[from] StorageError),
    #[error(transparent)]
    Mount(#[from] MountError),
    #[error(transparent)]
    Sdk(#[from] SdkError),
    #[error("{op} needs a connected guest under the {backend} backend: the sessions live in the ext4 session disk {disk}, which only the guest reads; call startVM first")]
    JanitorNeedsGuest {
        op: &'static str,
        backend: &'static str,
        disk: PathBuf,
    },
}

/// A running machine as the controller holds it.
struct Running {
    /// Which boot this is (unique in the process): the watcher of a machine
    /// that ended acts only while that machine is still the current one.
    serial: u64,
    /// Ends the machine: the guest may power off until the instant sent,
    /// then it is killed.
    kill: Option<oneshot::Sender<Instant>>,
    done: tokio::task::JoinHandle<()>,
    probe_stop: watch::Sender<bool>,
    host_paths: HostPaths,
}

/// One profile's VM.
pub struct ProfileVm {
    cfg: VmConfig,
    pub hub: Arc<EventHub>,
    lifecycle: tokio::sync::Mutex<Option<Running>>,
    link: RwLock<Option<Arc<AgentLink>>>,
    running: AtomicBool,
    /// Set by [`ProfileVm::shut_down`]: the helper is exiting, no machine starts.
    closing: AtomicBool,
    procs: Mutex<Procs>,
    sdk: Mutex<Option<(String, String)>>,
    approved_token: Mutex<Option<proto::Secret>>,
    /// The real OAuth tokens of spawns that may still use them, refreshed
    /// by [`ProfileVm::approve_token`].
    oauth_cells: Mutex<Vec<Weak<std::sync::RwLock<crate::egress::secrets::RealSecret>>>>,
    last_activity: Mutex<Instant>,
}

impl ProfileVm {
    pub fn new(cfg: VmConfig) -> Arc<ProfileVm> {
        Arc::new(ProfileVm {
            cfg,
            hub: Arc::new(EventHub::default()),
            lifecycle: tokio::sync::Mutex::new(None),
            link: RwLock::new(None),
            running: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            procs: Mutex::new(Procs::default()),
            sdk: Mutex::new(None),
            approved_token: Mutex::new(None),
            oauth_cells: Mutex::new(Vec::new()),
            last_activity: Mutex::new(Instant::now()),
        })
    }

    pub fn config(&self) -> &VmConfig {
        &self.cfg
    }

    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }

    pub fn touch(&self) {
        *self.last_activity.locked() = Instant::now();
    }

    pub fn idle_for(&self) -> Duration {
        self.last_activity.locked().elapsed()
    }

    fn link(&self) -> Option<Arc<AgentLink>> {
        self.link.read_locked().clone()
    }

    pub fn is_guest_connected(&self) -> bool {
        self.link()
            .is_some_and(|l| !l.closed.load(Ordering::Acquire))
    }

    fn connected_link(&self) -> Result<Arc<AgentLink>, ProfileVmError> {
        match self.link() {
            Some(l) if !l.closed.load(Ordering::Acquire) => Ok(l),
            _ => Err(ProfileVmError::NotRunning),
        }
    }

    /// Remembers a token approved by the client (never logged) for later
    /// spawns, and makes it the real token of every running spawn's
    /// placeholder (the CLI cannot refresh a token it got from its
    /// environment). Returns how many running spawns got it.
    pub fn approve_token(&self, token: String) -> usize {
        use crate::egress::secrets::{RealSecret, SecretCell};
        let mut refreshed = 0;
        if let Ok(secret) = RealSecret::new(token.clone()) {
            let cells: Vec<SecretCell> = {
                let mut weak = self.oauth_cells.locked();
                weak.retain(|w| w.strong_count() > 0);
                weak.iter().filter_map(SecretCell::upgrade).collect()
            };
            for cell in &cells {
                cell.set(secret.clone());
                refreshed += 1;
            }
        }
        *self.approved_token.locked() = Some(proto::Secret(token));
        refreshed
    }

    /// Keeps a weak handle on a spawn's OAuth token cell for refreshes.
    fn track_oauth_cell(&self, cell: &crate::egress::secrets::SecretCell) {
        let mut weak = self.oauth_cells.locked();
        weak.retain(|w| w.strong_count() > 0);
        weak.push(cell.downgrade());
    }
}
