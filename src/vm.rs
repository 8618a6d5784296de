//! One profile's sandbox VM: its lifecycle, the link to the guest agent, and
//! the table of the processes it runs.
//!
//! A [`Vm`] is started by `startVM`: the backend boots a machine whose agent
//! dials back over the link returned by the backend; the agent's hello makes
//! the guest "connected". From then on every session method is one request on
//! the [`AgentLink`], and the agent's unsolicited messages (output, exits,
//! guest requests) become client events on the profile's [`EventHub`].
//!
//! Concurrency: start and stop are serialized by an async mutex; the hot
//! queries (`isRunning`, `isGuestConnected`, `isProcessRunning`) read atomics
//! and short std mutexes only, so a slow boot never delays them.
//!
//! Limits: one machine per profile; exited process records are kept for the
//! last [`EXITED_RECORDS`] processes.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use guest_agent::framing::{self, FrameError};
use guest_agent::proto::{
    self, AgentMessage, Envelope, Hello, HostMessage, MountMode, MountSpec, Op,
};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot, watch};

use crate::backend::{HostPaths, Machine as BackendMachine, VmConfig, HELLO_TIMEOUT};
use crate::events::{self, EventHub};
use crate::protocol::{event, step};
use crate::utf8::Utf8Stream;

/// Default deadline of one agent request.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long `stopVM` lets the agent end its processes before the machine is killed.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Exited process records kept for `isProcessRunning`.
pub const EXITED_RECORDS: usize = 4096;

/// Frames queued towards the agent before senders wait.
const AGENT_QUEUE: usize = 256;

/// Largest batch the link writer coalesces into one write.
const WRITE_BATCH: usize = 1024 * 1024;

/// Size of the session disk, in GiB, when it must be created and
/// `createVM.diskSizeGB` did not say (or `startVM` came without `createVM`).
pub const DEFAULT_SESSION_DISK_GIB: u64 = 10;

/// Largest `createVM.diskSizeGB` accepted, in GiB (the sparse image costs
/// nothing up front; this only refuses absurd values with a clear error).
pub const MAX_SESSION_DISK_GIB: u64 = 16 * 1024;

/// Bytes in one GiB (`diskSizeGB` is read as GiB).
const GIB: u64 = 1 << 30;

/// Errors of VM operations, worded for the client's log.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("the VM is not running: call startVM first")]
    NotRunning,
    #[error("the VM failed to start: {0}")]
    Start(String),
    #[error("the guest agent did not connect within {0:?}")]
    HelloTimeout(Duration),
    #[error("the guest agent disconnected")]
    AgentGone,
    #[error("the guest agent did not answer {op} within {timeout:?}")]
    Timeout { op: &'static str, timeout: Duration },
    #[error("{0}")]
    Agent(String),
    #[error("{0}")]
    Invalid(String),
    #[error("cannot prepare the session disk: {0}")]
    SessionDisk(String),
    #[error("{op} needs a connected guest under the {backend} backend: the sessions live in the ext4 session disk {disk}, which only the guest reads; call startVM first")]
    JanitorNeedsGuest {
        op: &'static str,
        backend: &'static str,
        disk: PathBuf,
    },
}

/// Bytes of a `createVM.diskSizeGB` value (GiB), or why it is refused.
pub fn session_disk_bytes(disk_size_gb: u64) -> Result<u64, VmError> {
    if disk_size_gb == 0 || disk_size_gb > MAX_SESSION_DISK_GIB {
        return Err(VmError::Invalid(format!(
            "createVM: diskSizeGB {disk_size_gb} is out of range; give 1 to {MAX_SESSION_DISK_GIB} (GiB)"
        )));
    }
    Ok(disk_size_gb * GIB)
}

/// A process as the host knows it.
#[derive(Debug, Default)]
struct ProcRecord {
    session: String,
    running: bool,
    exit_code: Option<i32>,
    stdout: Utf8Stream,
    stderr: Utf8Stream,
}

/// Process table shared with the link reader.
#[derive(Default)]
struct Procs {
    map: HashMap<String, ProcRecord>,
    exited: VecDeque<String>,
}

impl Procs {
    fn mark_exited(&mut self, id: &str, code: Option<i32>) {
        if let Some(r) = self.map.get_mut(id) {
            if r.running {
                r.running = false;
                r.exit_code = code;
                self.exited.push_back(id.to_string());
            }
        }
        while self.exited.len() > EXITED_RECORDS {
            if let Some(old) = self.exited.pop_front() {
                if self.map.get(&old).is_some_and(|r| !r.running) {
                    self.map.remove(&old);
                }
            }
        }
    }
}

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
    closed: AtomicBool,
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

    fn fail_pending(&self) {
        self.closed.store(true, Ordering::Release);
        for (_, tx) in lock(&self.pending).drain() {
            let _ = tx.send(Reply {
                result: Err("the guest agent disconnected".into()),
                payload: vec![],
            });
        }
    }
}

fn op_name(op: &Op) -> &'static str {
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running machine as the controller holds it.
struct Machine {
    kill: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
    probe_stop: watch::Sender<bool>,
    host_paths: HostPaths,
}

/// What `spawn` needs beyond the agent's [`proto::SpawnSpec`].
pub struct SpawnRequest {
    pub spec: proto::SpawnSpec,
    /// `additionalMounts`: name → (host path relative to `/`, mode string).
    pub mounts: Vec<(String, String, String)>,
}

/// One profile's VM.
pub struct Vm {
    cfg: VmConfig,
    pub hub: Arc<EventHub>,
    lifecycle: tokio::sync::Mutex<Option<Machine>>,
    link: RwLock<Option<Arc<AgentLink>>>,
    running: AtomicBool,
    procs: Mutex<Procs>,
    sdk: Mutex<Option<(String, String)>>,
    approved_token: Mutex<Option<proto::Secret>>,
    last_activity: Mutex<Instant>,
}

impl Vm {
    pub fn new(cfg: VmConfig) -> Arc<Vm> {
        Arc::new(Vm {
            cfg,
            hub: Arc::new(EventHub::default()),
            lifecycle: tokio::sync::Mutex::new(None),
            link: RwLock::new(None),
            running: AtomicBool::new(false),
            procs: Mutex::new(Procs::default()),
            sdk: Mutex::new(None),
            approved_token: Mutex::new(None),
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
        *lock(&self.last_activity) = Instant::now();
    }

    pub fn idle_for(&self) -> Duration {
        lock(&self.last_activity).elapsed()
    }

    fn link(&self) -> Option<Arc<AgentLink>> {
        self.link.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn is_guest_connected(&self) -> bool {
        self.link()
            .is_some_and(|l| !l.closed.load(Ordering::Acquire))
    }

    fn connected_link(&self) -> Result<Arc<AgentLink>, VmError> {
        match self.link() {
            Some(l) if !l.closed.load(Ordering::Acquire) => Ok(l),
            _ => Err(VmError::NotRunning),
        }
    }

    /// Remembers a token approved by the client (never logged).
    pub fn approve_token(&self, token: String) {
        *lock(&self.approved_token) = Some(proto::Secret(token));
    }

    /// Creates (or keeps) the persistent session storage. Sandbox: the
    /// host sessions directory (`disk_size_gb` does not apply). qemu and
    /// kvm: the sparse session disk [`VmConfig::session_disk`]. An existing
    /// disk is never truncated, shrunk or recreated: with `disk_size_gb` it
    /// is grown sparsely when smaller (the guest's filesystem keeps its
    /// size) and kept when larger; without it (`startVM`) it is kept as it
    /// is, and a missing one is created with [`DEFAULT_SESSION_DISK_GIB`].
    pub fn create_storage(&self, disk_size_gb: Option<u64>) -> Result<(), VmError> {
        if !self.cfg.uses_session_disk() {
            return std::fs::create_dir_all(self.cfg.sessions_dir()).map_err(|e| {
                VmError::Start(format!(
                    "cannot create {}: {e}",
                    self.cfg.sessions_dir().display()
                ))
            });
        }
        let requested = disk_size_gb.map(session_disk_bytes).transpose()?;
        let disk = self.cfg.session_disk();
        if requested.is_none() && std::fs::symlink_metadata(&disk).is_ok() {
            tracing::debug!(disk = %disk.display(), "session disk kept");
            return Ok(());
        }
        std::fs::create_dir_all(&self.cfg.profile_dir).map_err(|e| {
            VmError::SessionDisk(format!(
                "cannot create {}: {e}",
                self.cfg.profile_dir.display()
            ))
        })?;
        let bytes = requested.unwrap_or(DEFAULT_SESSION_DISK_GIB * GIB);
        let size = devices::blk::create_sparse_image(&disk, bytes)
            .map_err(|e| VmError::SessionDisk(e.to_string()))?;
        tracing::info!(disk = %disk.display(), size, requested = bytes, "session disk ready");
        Ok(())
    }

    /// Boots the machine and waits for the agent. Idempotent while running.
    pub async fn start(
        self: &Arc<Self>,
        api_probe_url: Option<String>,
        boot: crate::backend::BootOptions,
    ) -> Result<(), VmError> {
        let mut lifecycle = self.lifecycle.lock().await;
        if lifecycle.is_some() && self.is_guest_connected() {
            return Ok(());
        }
        if let Some(old) = lifecycle.take() {
            // A machine whose agent is gone: clear it before booting anew.
            self.teardown(old).await;
        }
        let began = Instant::now();
        self.hub
            .publish(&event::startup_step(step::VM_BOOT, "started"))
            .await;
        if let Err(e) = self.create_storage(None) {
            self.hub
                .publish(&event::startup_step(step::VM_BOOT, "failed"))
                .await;
            return Err(e);
        }
        let booted = crate::backend::boot(&self.cfg, &boot)
            .await
            .map_err(VmError::Start);
        let crate::backend::Booted {
            machine: backend_machine,
            agent,
            host_paths,
            userland,
        } = match booted {
            Ok(b) => b,
            Err(e) => {
                self.hub
                    .publish(&event::startup_step(step::VM_BOOT, "failed"))
                    .await;
                tracing::error!(error = %e, "vm boot failed");
                return Err(e);
            }
        };
        self.hub
            .publish(&event::startup_step(step::VM_BOOT, "completed"))
            .await;
        self.hub
            .publish(&event::startup_step(step::GUEST_CONNECT, "started"))
            .await;

        let (kill_tx, kill_rx) = oneshot::channel();
        let (machine_gone_tx, mut machine_gone_rx) = oneshot::channel::<String>();
        let done = tokio::spawn(run_machine(backend_machine, kill_rx, machine_gone_tx));
        let (probe_stop, probe_rx) = watch::channel(false);
        let machine = Machine {
            kill: Some(kill_tx),
            done,
            probe_stop,
            host_paths,
        };

        let hello = tokio::select! {
            h = tokio::time::timeout(HELLO_TIMEOUT, async move {
                let stream = agent.await.map_err(VmError::Start)?;
                read_hello(stream).await
            }) => match h {
                Ok(Ok(h)) => Ok(h),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(VmError::HelloTimeout(HELLO_TIMEOUT)),
            },
            gone = &mut machine_gone_rx => Err(VmError::Start(gone.unwrap_or_else(|_| "the machine ended".into()))),
        };
        let hello = hello.and_then(|(hello, stream)| {
            check_userland(userland.as_ref(), &hello)?;
            Ok((hello, stream))
        });
        let (hello, stream) = match hello {
            Ok(h) => h,
            Err(e) => {
                self.hub
                    .publish(&event::startup_step(step::GUEST_CONNECT, "failed"))
                    .await;
                tracing::error!(error = %e, "guest agent did not connect");
                self.teardown(machine).await;
                return Err(e);
            }
        };
        tracing::info!(
            backend = self.cfg.backend.as_str(),
            agent = %hello.version,
            kernel = %hello.kernel,
            boot_ms = began.elapsed().as_secs_f64() * 1e3,
            agent_start_us = hello.boot.agent_start_us,
            connected_us = hello.boot.connected_us,
            "guest agent connected"
        );
        let link = self.attach(hello, stream);
        self.running.store(true, Ordering::Release);
        self.hub
            .publish(&event::startup_step(step::GUEST_CONNECT, "completed"))
            .await;
        self.hub.publish(&event::network_status("connected")).await;
        tokio::spawn(crate::probe::monitor(
            api_probe_url,
            self.hub.clone(),
            probe_rx,
        ));

        // Watch for the machine ending on its own.
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            if let Ok(reason) = machine_gone_rx.await {
                if let Some(vm) = me.upgrade() {
                    vm.machine_gone(&reason).await;
                }
            }
        });
        *lifecycle = Some(machine);
        drop(lifecycle);

        // Re-apply a previously requested SDK install.
        let pending_sdk = lock(&self.sdk).clone();
        if let Some((rel, version)) = pending_sdk {
            self.hub
                .publish(&event::startup_step(step::SDK_INSTALL, "started"))
                .await;
            let outcome = self.apply_sdk(&link, &rel, &version).await;
            if let Err(e) = &outcome {
                tracing::warn!(error = %e, "installing the SDK after boot failed");
            }
            self.publish_sdk_outcome(outcome.is_ok()).await;
        }
        Ok(())
    }

    /// Wires a connected agent stream: writer and reader tasks.
    fn attach(self: &Arc<Self>, hello: Hello, stream: UnixStream) -> Arc<AgentLink> {
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

    /// The agent's stream ended: every process it ran is gone.
    async fn agent_gone(&self, link: &Arc<AgentLink>) {
        link.fail_pending();
        {
            let mut slot = self.link.write().unwrap_or_else(|p| p.into_inner());
            if !slot.as_ref().is_some_and(|l| Arc::ptr_eq(l, link)) {
                // Already accounted for (stop and the link reader both get here).
                return;
            }
            *slot = None;
        }
        self.running.store(false, Ordering::Release);
        let orphans: Vec<String> = {
            let procs = lock(&self.procs);
            procs
                .map
                .iter()
                .filter(|(_, r)| r.running)
                .map(|(id, _)| id.clone())
                .collect()
        };
        for id in orphans {
            // The agent could not report these processes' ends: they died
            // with the machine. Say so, then close them with an exit.
            self.flush_output(&id).await;
            lock(&self.procs).mark_exited(&id, None);
            self.hub
                .publish(&event::error(
                    &id,
                    "the VM stopped unexpectedly; the process was killed with it",
                    true,
                ))
                .await;
            self.hub
                .publish(&event::exit(&id, None, Some("SIGKILL"), None))
                .await;
        }
        self.hub
            .publish(&event::network_status("disconnected"))
            .await;
        tracing::info!("guest agent disconnected");
    }

    async fn machine_gone(self: &Arc<Self>, reason: &str) {
        let mut lifecycle = self.lifecycle.lock().await;
        if let Some(m) = lifecycle.take() {
            tracing::warn!(reason, "the VM ended unexpectedly");
            let _ = m.probe_stop.send(true);
            self.running.store(false, Ordering::Release);
        }
    }

    async fn teardown(&self, mut m: Machine) {
        let _ = m.probe_stop.send(true);
        if let Some(kill) = m.kill.take() {
            let _ = kill.send(());
        }
        let _ = (&mut m.done).await;
        if let Some(link) = self.link() {
            // Make sure everything that ran is accounted for.
            self.agent_gone(&link).await;
        }
        self.running.store(false, Ordering::Release);
    }

    /// Stops the VM: processes end (exit events delivered), then the machine.
    pub async fn stop(&self) -> Result<(), VmError> {
        let mut lifecycle = self.lifecycle.lock().await;
        let Some(machine) = lifecycle.take() else {
            return Ok(());
        };
        if let Some(link) = self.link() {
            if let Err(e) = link.call(Op::Shutdown, &[], SHUTDOWN_GRACE).await {
                tracing::warn!(error = %e, "agent shutdown did not complete; killing the VM");
            }
        }
        self.teardown(machine).await;
        tracing::info!("vm stopped");
        Ok(())
    }

    async fn flush_output(&self, id: &str) {
        let (out, err) = {
            let mut procs = lock(&self.procs);
            match procs.map.get_mut(id) {
                Some(r) => (r.stdout.finish(), r.stderr.finish()),
                None => (None, None),
            }
        };
        if let Some(s) = out {
            self.hub.publish(&event::output("stdout", id, &s)).await;
        }
        if let Some(s) = err {
            self.hub.publish(&event::output("stderr", id, &s)).await;
        }
    }

    /// Routes one unsolicited agent message.
    async fn on_agent_message(&self, msg: AgentMessage, payload: &[u8]) {
        match msg {
            AgentMessage::Stdout { id } => self.on_output(true, id, payload).await,
            AgentMessage::Stderr { id } => self.on_output(false, id, payload).await,
            AgentMessage::Exit {
                id,
                exit_code,
                signal,
                oom_kill_count,
            } => {
                self.flush_output(&id).await;
                lock(&self.procs).mark_exited(&id, exit_code);
                tracing::debug!(id = %id, exit_code, signal = signal.as_deref(), "process exited");
                self.hub
                    .publish(&event::exit(
                        &id,
                        exit_code,
                        signal.as_deref(),
                        oom_kill_count,
                    ))
                    .await;
            }
            AgentMessage::Error { id, message, fatal } => {
                self.hub.publish(&event::error(&id, &message, fatal)).await;
            }
            AgentMessage::Request { id, method, params } => {
                tracing::debug!(id = %id, method = %method, "guest request");
                self.hub
                    .publish(&event::guest_request(&id, &method, &params))
                    .await;
            }
            AgentMessage::Hello(_) | AgentMessage::Response { .. } => {
                tracing::warn!("unexpected agent message ignored");
            }
        }
    }

    async fn on_output(&self, stdout: bool, id: String, bytes: &[u8]) {
        let stream = if stdout { "stdout" } else { "stderr" };
        let frame = {
            let mut procs = lock(&self.procs);
            let rec = procs.map.entry(id.clone()).or_default();
            let decoder = if stdout {
                &mut rec.stdout
            } else {
                &mut rec.stderr
            };
            decoder.push_with(bytes, |text| {
                (!text.is_empty()).then(|| events::output_frame(stream, &id, text))
            })
        };
        if let Some(frame) = frame {
            self.hub.publish_output(frame).await;
        }
    }

    // ---- session methods ------------------------------------------------

    async fn current_host_paths(&self) -> Result<HostPaths, VmError> {
        let lifecycle = self.lifecycle.lock().await;
        lifecycle
            .as_ref()
            .map(|m| m.host_paths.clone())
            .ok_or(VmError::NotRunning)
    }

    /// Validates a client mount and maps it into the agent's view.
    fn mount_spec(
        &self,
        host_paths: &HostPaths,
        session: &str,
        name: &str,
        host_path: &str,
        mode: &str,
    ) -> Result<MountSpec, String> {
        guest_agent::names::mount_name(name).map_err(|e| e.to_string())?;
        let mode = MountMode::parse(mode)
            .ok_or_else(|| format!("mount {name:?}: mode must be ro, rw or rwd, got {mode:?}"))?;
        let rel = guest_agent::names::host_relative_path(host_path).map_err(|e| e.to_string())?;
        let real = std::fs::canonicalize(Path::new("/").join(&rel))
            .map_err(|e| format!("mount {name:?}: host path /{rel}: {e}"))?;
        let real_rel = real
            .strip_prefix("/")
            .ok()
            .and_then(|p| p.to_str())
            .filter(|p| !p.is_empty())
            .ok_or_else(|| format!("mount {name:?}: refusing to share the host root"))?
            .to_string();
        Ok(MountSpec {
            session: session.to_string(),
            name: name.to_string(),
            source: host_paths
                .grant(session, name, &real_rel, mode)
                .map_err(|e| format!("mount {name:?}: {e}"))?,
            mode,
        })
    }

    pub async fn spawn(&self, req: SpawnRequest) -> Result<Value, VmError> {
        let SpawnRequest { mut spec, mounts } = req;
        guest_agent::names::session_name(&spec.name)
            .map_err(|e| VmError::Invalid(e.to_string()))?;
        if spec.id.is_empty() {
            return Err(VmError::Invalid("spawn: id must not be empty".into()));
        }
        let link = self.connected_link()?;
        let host_paths = self.current_host_paths().await?;
        let mut failed = Vec::new();
        for (name, path, mode) in mounts {
            match self.mount_spec(&host_paths, &spec.name, &name, &path, &mode) {
                Ok(m) => spec.mounts.push(m),
                Err(e) => {
                    tracing::warn!(session = %spec.name, mount = %name, error = %e, "mount refused");
                    failed.push(Value::String(name));
                }
            }
        }
        if spec.oauth_token.is_none() {
            spec.oauth_token = lock(&self.approved_token).clone();
        }
        {
            let mut procs = lock(&self.procs);
            if procs.map.get(&spec.id).is_some_and(|r| r.running) {
                return Err(VmError::Invalid(format!(
                    "a process with id {:?} is already running",
                    spec.id
                )));
            }
            procs.map.insert(
                spec.id.clone(),
                ProcRecord {
                    session: spec.name.clone(),
                    running: true,
                    ..Default::default()
                },
            );
        }
        let id = spec.id.clone();
        tracing::info!(id = %id, session = %spec.name, command = %spec.command, "spawn");
        match link.call(Op::Spawn(spec), &[], CALL_TIMEOUT).await {
            Ok((result, _)) => {
                if let Some(Value::Array(agent_failed)) = result.get("failedMounts") {
                    failed.extend(agent_failed.iter().cloned());
                }
                Ok(json!({ "failedMounts": failed }))
            }
            Err(e) => {
                let mut procs = lock(&self.procs);
                if procs.map.get(&id).is_some_and(|r| r.running) {
                    procs.map.remove(&id);
                }
                Err(e)
            }
        }
    }

    pub async fn kill(&self, id: &str, signal: i32) -> Result<(), VmError> {
        let link = self.connected_link()?;
        link.call(
            Op::Kill {
                id: id.to_string(),
                signal,
            },
            &[],
            CALL_TIMEOUT,
        )
        .await
        .map(|_| ())
    }

    /// Queues stdin data for a process (in call order) and returns the wait
    /// for the agent's acknowledgement, so that a connection can keep the
    /// order of pipelined writes without serialising their round trips.
    pub async fn write_stdin_ordered(
        &self,
        id: &str,
        data: &[u8],
    ) -> Result<impl std::future::Future<Output = Result<(), VmError>>, VmError> {
        let link = self.connected_link()?;
        let pending = link
            .send(Op::WriteStdin { id: id.to_string() }, data)
            .await?;
        Ok(async move { pending.wait(&link, CALL_TIMEOUT).await.map(|_| ()) })
    }

    pub fn process_status(&self, id: &str) -> Value {
        let procs = lock(&self.procs);
        match procs.map.get(id) {
            Some(r) if r.running => json!({"running": true}),
            Some(ProcRecord {
                exit_code: Some(c), ..
            }) => json!({"running": false, "exitCode": c}),
            _ => json!({"running": false}),
        }
    }

    fn session_of(&self, process_id: &str) -> Option<String> {
        lock(&self.procs)
            .map
            .get(process_id)
            .map(|r| r.session.clone())
            .filter(|s| !s.is_empty())
    }

    pub async fn mount_path(
        &self,
        process_id: &str,
        subpath: &str,
        name: &str,
        mode: &str,
    ) -> Result<(), VmError> {
        let link = self.connected_link()?;
        let session = self.session_of(process_id).ok_or_else(|| {
            VmError::Invalid(format!("mountPath: unknown process {process_id:?}"))
        })?;
        let host_paths = self.current_host_paths().await?;
        let spec = self
            .mount_spec(&host_paths, &session, name, subpath, mode)
            .map_err(VmError::Invalid)?;
        link.call(Op::Mount(spec), &[], CALL_TIMEOUT)
            .await
            .map(|_| ())
    }

    pub async fn read_file(&self, session: &str, path: &str) -> Result<Vec<u8>, VmError> {
        guest_agent::names::session_name(session).map_err(|e| VmError::Invalid(e.to_string()))?;
        let link = self.connected_link()?;
        let op = Op::ReadFile {
            session: session.to_string(),
            path: path.to_string(),
        };
        link.call(op, &[], CALL_TIMEOUT)
            .await
            .map(|(_, bytes)| bytes)
    }

    /// Records the SDK to install and installs it now when the guest is up.
    pub async fn install_sdk(&self, sdk_subpath: &str, version: &str) -> Result<Value, VmError> {
        let rel = match check_sdk(sdk_subpath, version) {
            Ok(rel) => rel,
            Err(e) => {
                self.hub
                    .publish(&event::startup_step(step::SDK_INSTALL, "started"))
                    .await;
                self.publish_sdk_outcome(false).await;
                return Err(e);
            }
        };
        *lock(&self.sdk) = Some((rel.clone(), version.to_string()));
        let Ok(link) = self.connected_link() else {
            // Installed (with its startup steps) when the guest connects.
            return Ok(json!({"installed": false, "pending": true}));
        };
        self.hub
            .publish(&event::startup_step(step::SDK_INSTALL, "started"))
            .await;
        let outcome = self.apply_sdk(&link, &rel, version).await;
        self.publish_sdk_outcome(outcome.is_ok()).await;
        outcome
    }

    async fn publish_sdk_outcome(&self, ok: bool) {
        let status = if ok { "completed" } else { "failed" };
        self.hub
            .publish(&event::startup_step(step::SDK_INSTALL, status))
            .await;
    }

    async fn apply_sdk(
        &self,
        link: &AgentLink,
        rel: &str,
        version: &str,
    ) -> Result<Value, VmError> {
        let host_paths = self.current_host_paths().await?;
        let real = std::fs::canonicalize(Path::new("/").join(rel))
            .map_err(|e| VmError::Invalid(format!("installSdk: /{rel}: {e}")))?;
        let real_rel = real.to_string_lossy().trim_start_matches('/').to_string();
        let op = Op::InstallSdk {
            source: host_paths
                .grant_sdk(&real_rel)
                .map_err(|e| VmError::Invalid(format!("installSdk: {e}")))?,
            version: version.to_string(),
        };
        link.call(op, &[], CALL_TIMEOUT).await.map(|(v, _)| v)
    }

    /// Sessions with a live process (the janitor must not touch them).
    fn live_sessions(&self) -> std::collections::HashSet<String> {
        lock(&self.procs)
            .map
            .values()
            .filter(|r| r.running)
            .map(|r| r.session.clone())
            .collect()
    }

    /// Runs a janitor operation in the guest, or on the host's session
    /// directory when no guest is connected. Deleted session directories
    /// also lose what the backend granted their mounts.
    pub async fn janitor(&self, op: Op) -> Result<Value, VmError> {
        let deleting = matches!(op, Op::DeleteSessionDirs { .. });
        let result = self.run_janitor(op).await?;
        if deleting {
            if let Some(host_paths) = self
                .lifecycle
                .lock()
                .await
                .as_ref()
                .map(|m| m.host_paths.clone())
            {
                let deleted = result["deleted"].as_array().into_iter().flatten();
                for session in deleted.filter_map(Value::as_str) {
                    host_paths.release_session(session);
                }
            }
        }
        Ok(result)
    }

    async fn run_janitor(&self, op: Op) -> Result<Value, VmError> {
        if let Ok(link) = self.connected_link() {
            return link.call(op, &[], CALL_TIMEOUT).await.map(|(v, _)| v);
        }
        if self.cfg.uses_session_disk() {
            let method = match op {
                Op::DiskInfo { .. } => "getSessionsDiskInfo",
                ref other => op_name(other),
            };
            return Err(VmError::JanitorNeedsGuest {
                op: method,
                backend: self.cfg.backend.as_str(),
                disk: self.cfg.session_disk(),
            });
        }
        let root = self.cfg.sessions_dir();
        let live = self.live_sessions();
        tokio::task::spawn_blocking(move || {
            use guest_agent::janitor;
            std::fs::create_dir_all(&root)
                .map_err(|e| VmError::Agent(format!("{}: {e}", root.display())))?;
            let outcome = match op {
                Op::DiskInfo { low_water_bytes } => janitor::disk_info(&root, low_water_bytes),
                Op::DeleteSessionDirs { names } => {
                    Ok(janitor::delete_session_dirs(&root, &names, &live))
                }
                Op::PruneSessionCaches {
                    only_if_free_bytes_below,
                    include_session_tmp,
                    session_tmp_older_than_seconds,
                } => janitor::prune_session_caches(
                    &root,
                    only_if_free_bytes_below,
                    include_session_tmp,
                    session_tmp_older_than_seconds,
                    &live,
                ),
                other => {
                    return Err(VmError::Invalid(format!(
                        "{} needs a running VM",
                        op_name(&other)
                    )))
                }
            };
            outcome.map_err(|e| VmError::Agent(e.to_string()))
        })
        .await
        .map_err(|e| VmError::Agent(format!("janitor task failed: {e}")))?
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

/// Validates an `installSdk` request against the host file system; returns
/// the CLI's path relative to `/`.
fn check_sdk(sdk_subpath: &str, version: &str) -> Result<String, VmError> {
    let sub = guest_agent::names::host_relative_path(sdk_subpath)
        .map_err(|e| VmError::Invalid(format!("installSdk: {e}")))?;
    guest_agent::names::session_name(version)
        .map_err(|_| VmError::Invalid(format!("installSdk: invalid version {version:?}")))?;
    let rel = format!("{sub}/{version}/claude");
    let host = Path::new("/").join(&rel);
    let meta = std::fs::metadata(&host)
        .map_err(|e| VmError::Invalid(format!("installSdk: {}: {e}", host.display())))?;
    if !meta.is_file() {
        return Err(VmError::Invalid(format!(
            "installSdk: {} is not a file",
            host.display()
        )));
    }
    Ok(rel)
}

/// Logs the userland the agent reports against the backend's plan: why
/// candidates were skipped on the host, which one the guest took and why it
/// rejected others. A forced `--userland` the guest did not honour fails the
/// start.
fn check_userland(
    plan: Option<&crate::backend::userland::UserlandPlan>,
    hello: &Hello,
) -> Result<(), VmError> {
    let Some(plan) = plan else {
        return Ok(());
    };
    for why in &plan.skipped {
        tracing::warn!(reason = %why, "userland candidate skipped on the host");
    }
    let (kind, fallbacks, os) = match &hello.userland {
        Some(u) => (
            Some(u.kind.as_str()),
            u.fallbacks.as_slice(),
            u.pretty_name.as_deref(),
        ),
        None => (None, &[][..], None),
    };
    match crate::backend::userland::check_hello(plan, kind, fallbacks) {
        Ok(line) => {
            tracing::info!(os = os.unwrap_or("-"), "{line}");
            Ok(())
        }
        Err(line) => Err(VmError::Start(format!(
            "the guest did not boot the requested userland: {line}"
        ))),
    }
}

/// Reads the agent's first message, which must be its hello.
async fn read_hello(mut stream: UnixStream) -> Result<(Hello, UnixStream), VmError> {
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

/// Owns the machine until it ends or is killed; reports how it ended.
async fn run_machine(
    mut machine: BackendMachine,
    kill: oneshot::Receiver<()>,
    gone: oneshot::Sender<String>,
) {
    tokio::select! {
        how = machine.wait() => {
            let _ = gone.send(how);
        }
        _ = kill => {
            machine.kill().await;
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BackendKind, SESSION_DISK_FILE};
    use std::os::unix::fs::MetadataExt;

    fn vm(backend: BackendKind, dir: &Path) -> Arc<Vm> {
        Vm::new(VmConfig {
            backend,
            profile_dir: dir.join("profile"),
            helper_exe: "/nonexistent/cowork-helper".into(),
        })
    }

    #[test]
    fn the_session_disk_is_created_sparse_grown_and_never_shrunk() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = vm(BackendKind::Qemu, tmp.path());
        let disk = vm.config().session_disk();
        assert_eq!(disk, tmp.path().join("profile").join(SESSION_DISK_FILE));

        vm.create_storage(Some(1)).unwrap();
        let meta = std::fs::metadata(&disk).unwrap();
        assert_eq!(meta.len(), GIB);
        assert!(
            meta.blocks() * 512 < 1 << 20,
            "not sparse: {} blocks",
            meta.blocks()
        );
        assert_eq!(meta.mode() & 0o777, 0o600);
        let data = b"a session's bytes";
        std::os::unix::fs::FileExt::write_all_at(
            &std::fs::OpenOptions::new().write(true).open(&disk).unwrap(),
            data,
            4096,
        )
        .unwrap();

        // startVM keeps the disk as it is; a larger createVM grows it; a
        // smaller one keeps it; the data survives all of them.
        vm.create_storage(None).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), GIB);
        vm.create_storage(Some(2)).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
        vm.create_storage(Some(1)).unwrap();
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
        let mut back = vec![0u8; data.len()];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(&disk).unwrap(),
            &mut back,
            4096,
        )
        .unwrap();
        assert_eq!(&back, data);

        for bad in [0, MAX_SESSION_DISK_GIB + 1, u64::MAX] {
            let e = vm.create_storage(Some(bad)).unwrap_err();
            assert!(e.to_string().contains("diskSizeGB"), "{e}");
        }
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 2 * GIB);
    }

    #[test]
    fn start_creates_a_missing_disk_with_the_default_size() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = vm(BackendKind::Kvm, tmp.path());
        vm.create_storage(None).unwrap();
        let meta = std::fs::metadata(vm.config().session_disk()).unwrap();
        assert_eq!(meta.len(), DEFAULT_SESSION_DISK_GIB * GIB);
        assert!(!vm.config().sessions_dir().exists());
    }

    #[test]
    fn the_sandbox_keeps_its_host_sessions_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = vm(BackendKind::Sandbox, tmp.path());
        vm.create_storage(Some(1)).unwrap();
        assert!(vm.config().sessions_dir().is_dir());
        assert!(!vm.config().session_disk().exists());
    }

    #[tokio::test]
    async fn the_janitor_needs_the_guest_under_vm_backends() {
        let tmp = tempfile::tempdir().unwrap();
        for backend in [BackendKind::Qemu, BackendKind::Kvm] {
            let vm = vm(backend, tmp.path());
            let e = vm
                .janitor(Op::DiskInfo { low_water_bytes: 0 })
                .await
                .unwrap_err();
            let text = e.to_string();
            assert!(text.contains("getSessionsDiskInfo"), "{text}");
            assert!(text.contains("call startVM first"), "{text}");
            assert!(text.contains(backend.as_str()), "{text}");
            let e = vm
                .janitor(Op::DeleteSessionDirs {
                    names: vec!["s1".into()],
                })
                .await
                .unwrap_err();
            assert!(matches!(e, VmError::JanitorNeedsGuest { .. }), "{e}");
            // The host never made a sessions directory to fall back on.
            assert!(!vm.config().sessions_dir().exists());
        }
        // The sandbox still measures its host directory.
        let vm = vm(BackendKind::Sandbox, tmp.path());
        let info = vm
            .janitor(Op::DiskInfo { low_water_bytes: 0 })
            .await
            .unwrap();
        assert!(info["totalBytes"].as_u64().unwrap_or(0) > 0, "{info}");
    }
}
