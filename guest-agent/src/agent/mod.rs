//! The guest agent runtime: dials the host, says hello, and serves the
//! host's requests (processes, files, mounts, the session-disk janitor)
//! until the host goes away or asks it to shut down.
//!
//! The agent runs as the VM's PID 1 (the guest image's `/init`), as PID 1
//! of a pid namespace in the host's sandbox, or as a plain process.
//! Everything environment-specific comes from [`Config`] (the command line).
//! As PID 1 it reaps orphans ([`reaper`]); with `--init-mounts` it mounts the
//! kernel filesystems ([`init`]); as the VM's init (`--init`, or PID 1
//! started by the kernel without arguments) it also loads the kernel modules
//! ([`modules`]), sets the clock ([`clock`]), brings up `lo`, reports boot
//! milestones to our VMM ([`bootmark`]) and powers the machine off when the
//! connection ends ([`power`]).
//!
//! Structure: one current-thread tokio runtime. The connection's read side
//! is parsed by the serve loop, which answers quick requests inline and
//! runs slow ones (files, mounts, janitor) on the blocking pool; spawns are
//! handled in order so later requests for a new process find it. Every
//! outgoing message goes through the [`outbox`] (one writer, bounded
//! memory). Each process has a supervisor task ([`process`]).
//!
//! Connection end: on EOF from the host every process group is SIGKILLed,
//! the agent waits (bounded) for their exit events to be queued and
//! flushed, and returns 0. `Shutdown` does the same and answers first.
//!
//! Janitor requests see the set of live sessions as it is when they arrive;
//! a spawn into a session that is being deleted at that moment races with
//! the deletion (the host is expected not to do both at once).
//!
//! Egress ([`crate::egress`]) starts before the host link is dialled, in a
//! VM (after the userland switch and `lo`) and in the sandbox (which names
//! its proxy socket in [`proto::EGRESS_SOCKET_ENV`]); a plain agent has
//! none. Only its cheap part is on the way to the hello: the relay and the
//! DNS stub are bound first; the capture's install (the BPF program's load
//! and verification) and, in a VM, the ssh tool's copy run on threads of
//! their own while the agent dials and says hello. Its spawn registry and
//! its readiness gate ([`egress::EgressGate`]) go to the process
//! supervisor, which starts no session process before that work has
//! finished (or failed, or run past [`egress::gate::START_LIMIT`]); other
//! requests do not wait for it.
//!
//! Limits: one connection per boot (the VM powers off when it ends); the
//! in-guest CLI's access to [`GuestRequests`] is a later change.

pub mod bootmark;
pub mod cgroup;
pub mod child;
pub mod cli;
pub mod clock;
pub mod connect;
pub mod fdio;
pub mod files;
pub mod guest;
pub mod init;
pub mod logfmt;
pub mod modules;
pub(crate) mod mounts;
pub mod outbox;
pub mod power;
pub mod process;
pub mod reaper;
pub mod sessiondisk;
pub mod setup;
pub mod trust;
pub mod userland;
pub mod users;

#[cfg(test)]
mod testns;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::BufReader;
use tokio::task::JoinHandle;

pub use cli::{Config, ConnectTarget};
pub use guest::{GuestRequestError, GuestRequests};

use crate::egress;
use crate::framing::{self, FrameError};
use crate::janitor;
use crate::milestone::Milestone;
use crate::proto::{self, AgentMessage, BootTimes, Hello, HostMessage, Op};
use crate::sys;
use bootmark::BootMarks;
use fdio::{FdIo, FdReader};
use outbox::Outbox;
use process::{ProcessConfig, Processes};
use reaper::{ReapMode, Reaper};

/// How long `Shutdown` and connection loss wait for exit events to be queued.
pub const EXIT_WAIT: Duration = Duration::from_secs(3);

/// How long the agent tries to flush queued messages before it exits.
const FLUSH_WAIT: Duration = Duration::from_secs(2);

/// Read buffer of the host link.
const READ_BUFFER: usize = 256 * 1024;

/// Threads of the blocking pool (file reads, mounts, janitor walks).
const MAX_BLOCKING_THREADS: usize = 8;

/// How long the runtime's blocking threads get to finish at exit.
const RUNTIME_SHUTDOWN: Duration = Duration::from_secs(1);

/// Exit code: the host went away or asked for shutdown.
pub const EXIT_OK: i32 = 0;
/// Exit code: the host could not be reached or the link broke.
pub const EXIT_LINK: i32 = 1;
/// Exit code: bad command line.
pub const EXIT_USAGE: i32 = 2;

/// Errors that stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Connect(#[from] connect::ConnectError),
    #[error(transparent)]
    Reaper(#[from] reaper::ReaperError),
    #[error("cannot set up the host link: {0}")]
    Io(#[from] io::Error),
    #[error("host link broken: {0}")]
    Frame(#[from] FrameError),
    #[error("host link closed while sending")]
    Outbox(#[from] outbox::OutboxError),
}

/// Boot timestamps (`CLOCK_BOOTTIME`, microseconds) taken before connecting.
#[derive(Clone, Copy, Debug, Default)]
pub struct BootClock {
    pub start_us: u64,
    pub init_done_us: u64,
    /// When the root was switched to a userland disk, if it was.
    pub userland_switched_us: Option<u64>,
}

impl BootClock {
    /// Both stamps now (when there is no separate init phase).
    pub fn now() -> Self {
        let t = sys::boottime_us();
        Self {
            start_us: t,
            init_done_us: t,
            userland_switched_us: None,
        }
    }

    /// The hello's times: absolute as init, else relative to the agent's start.
    fn times(&self, is_init: bool, connected_us: u64) -> BootTimes {
        let base = if is_init { 0 } else { self.start_us };
        BootTimes {
            agent_start_us: self.start_us - base,
            init_done_us: self.init_done_us.saturating_sub(base),
            connected_us: connected_us.saturating_sub(base),
            userland_switched_us: self.userland_switched_us.map(|t| t.saturating_sub(base)),
        }
    }
}

/// Entry point: parses `args` (the options, see [`cli::USAGE`]), runs the
/// agent on a current-thread runtime and returns the process exit code.
///
/// As the VM's init (`--init`, or PID 1 started without arguments, which is
/// how the kernel starts `/init`) it never returns: it prepares the machine
/// ([`init::run_machine_init`]), runs the agent and then powers off
/// ([`power::power_off`]), also when the agent fails or panics. A bad
/// command line as PID 1 is logged and the defaults are used, since
/// returning would panic the kernel.
pub fn main_with_args(args: Vec<String>) -> i32 {
    let clock_start = sys::boottime_us();
    // SAFETY: getpid has no preconditions.
    let pid1 = unsafe { libc::getpid() } == 1;
    let mut config = match cli::parse(&args) {
        Ok(cli::Command::Run(c)) => c,
        Ok(cli::Command::Help) => {
            print!("{}", cli::USAGE);
            return EXIT_OK;
        }
        Ok(cli::Command::Version) => {
            println!("cowork-guest-agent {}", env!("CARGO_PKG_VERSION"));
            return EXIT_OK;
        }
        Err(e) if pid1 => {
            eprintln!("cowork-guest-agent: {e}; running as init with the defaults");
            Config {
                init: true,
                ..Config::default()
            }
        }
        Err(e) => {
            eprintln!("cowork-guest-agent: {e}\n\n{}", cli::USAGE);
            return EXIT_USAGE;
        }
    };
    if config.init && !pid1 {
        eprintln!("cowork-guest-agent: --init is only for the VM's PID 1");
        return EXIT_USAGE;
    }
    config.init |= pid1 && args.is_empty();
    init_logging();
    // Writes to a closed host link must fail with EPIPE, not kill the agent.
    // SAFETY: setting a signal disposition.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    if !config.init {
        if config.init_mounts {
            init::run_early_init();
        }
        return run_agent(config, clock_start, None, BootMarks::none());
    }
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        kernel = %sys::kernel_release(),
        "agent starting as the VM's init"
    );
    let machine = init::run_machine_init();
    // Session processes see their binds, never the whole share or the
    // userland's layers.
    config.private_paths.extend(machine.private_paths);
    let marks = BootMarks::detect();
    marks.mark(Milestone::AgentStart, clock_start);
    let switched = machine.userland_switched_us;
    if let Some(at) = switched {
        marks.mark(Milestone::UserlandSwitched, at);
    }
    let code = std::panic::catch_unwind(move || run_agent(config, clock_start, switched, marks));
    let reason = match code {
        Ok(EXIT_OK) => power::Reason::HostDone,
        Ok(_) => power::Reason::LinkFailed,
        Err(_) => power::Reason::AgentFailed,
    };
    marks.mark(Milestone::PowerOff, sys::boottime_us());
    power::power_off(reason)
}

/// Per-session users, for the VM's init only: the sandbox backend runs the
/// agent in a user namespace that maps no other uid, and a plain agent
/// (tests) keeps running processes as itself.
/// The session of the [`proto::ROOT_SESSION_ENV`] test hook: a VM's init
/// only, and only a valid session name.
fn root_session(config: &Config) -> Option<String> {
    if !config.init {
        return None;
    }
    let name = std::env::var(proto::ROOT_SESSION_ENV).ok()?;
    match crate::names::session_name(&name) {
        Ok(_) => {
            tracing::warn!(session = %name, "test hook: this session will run as root");
            Some(name)
        }
        Err(e) => {
            tracing::warn!(error = %e, "{} ignored", proto::ROOT_SESSION_ENV);
            None
        }
    }
}

fn session_users(config: &Config) -> Option<users::UserDb> {
    if !config.init {
        return None;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tracing::warn!("not root: session processes run as the agent's user");
        return None;
    }
    let db = users::UserDb::system();
    tracing::debug!(
        shell = users::login_shell(),
        "each session runs as its own user"
    );
    Some(db)
}

/// Connects to the host and serves it; returns the process exit code.
fn run_agent(
    config: Config,
    clock_start: u64,
    userland_switched_us: Option<u64>,
    marks: BootMarks,
) -> i32 {
    let clock = BootClock {
        start_us: clock_start,
        init_done_us: sys::boottime_us(),
        userland_switched_us,
    };
    marks.mark(Milestone::InitDone, clock.init_done_us);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return EXIT_LINK;
        }
    };
    let code = runtime.block_on(async move {
        let mut config = config;
        tracing::info!(connect = %config.connect, pid = std::process::id(), "agent starting");
        let (spawns, egress_ready) = start_egress(&config);
        let mut ca_trust = None;
        let io = if config.init {
            match template_point(&mut config, &clock, marks, &egress_ready).await {
                Ok((io, trusted)) => {
                    ca_trust = trusted;
                    io
                }
                Err(e) => {
                    tracing::error!(error = %e, "giving up at the template point");
                    return EXIT_LINK;
                }
            }
        } else {
            let conn = match connect::connect(&config.connect, connect::CONNECT_PATIENCE).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "giving up");
                    return EXIT_LINK;
                }
            };
            marks.mark(Milestone::Connected, sys::boottime_us());
            tracing::debug!(connect = %config.connect, "connected to the host");
            match FdIo::new(conn) {
                Ok(io) => io,
                Err(e) => {
                    tracing::error!(error = %e, "cannot register the host link");
                    return EXIT_LINK;
                }
            }
        };
        match Agent::with_egress_io(config, io, clock, spawns, egress_ready) {
            Ok(agent) => agent.with_ca_trust(ca_trust).run().await,
            Err(e) => {
                tracing::error!(error = %e, "cannot start the agent");
                EXIT_LINK
            }
        }
    });
    // Blocking work stuck in a syscall must not hold up the exit (or power off).
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN);
    code
}

/// Most times a VM's agent dials the host before its `Setup` arrives (a
/// snapshot and each restore reset the link once).
const MAX_TEMPLATE_DIALS: usize = 8;

/// A VM's template point (see [`setup`]): dials, says the template hello,
/// applies the host's `Setup`, finishes the boot (session disk and share,
/// and the `Setup`'s egress CA at the same time) and returns the link for
/// the agent proper, which then says its final hello, with what became of
/// the CA.
async fn template_point(
    config: &mut Config,
    clock: &BootClock,
    marks: BootMarks,
    egress_ready: &egress::EgressGate,
) -> Result<(FdIo, Option<proto::CaTrust>), setup::SetupError> {
    let hello = Hello {
        protocol: proto::PROTOCOL_VERSION,
        version: env!("CARGO_PKG_VERSION").to_string(),
        is_init: true,
        boot: clock.times(true, sys::boottime_us()),
        kernel: sys::kernel_release(),
        userland: userland::booted(),
        session_disk: None,
        phase: Some(Hello::TEMPLATE.to_string()),
        ca_trust: None,
        quiesce: true,
    };
    let target = config.connect.clone();
    let quiet = || async {
        let began = sys::boottime_us();
        let complete = egress_ready.wait().await == egress::gate::Passage::Open;
        (sys::boottime_us().saturating_sub(began) / 1000, complete)
    };
    let pacing = if signals_on_console() {
        // No vsock device yet (the qemu backend hot-plugs it after its
        // snapshot): quiet down, say so on the console, then poll for it.
        let (waited_ms, complete) = quiet().await;
        announce_on_console(waited_ms, complete);
        connect::Pacing::steady(std::time::Duration::from_millis(proto::TEMPLATE_POLL_MS))
    } else {
        connect::Pacing::GROWING
    };
    let dial = || {
        let target = target.clone();
        async move {
            let fd = connect::connect_paced(&target, connect::CONNECT_PATIENCE, pacing)
                .await
                .map_err(|e| e.to_string())?;
            marks.mark(Milestone::Connected, sys::boottime_us());
            // Debug only: every console byte is a port I/O exit, and the
            // host logs the same connection.
            tracing::debug!(connect = %target, "connected to the host");
            FdIo::new(fd)
                .map(|io| io.stream())
                .map_err(|e| e.to_string())
        }
    };
    let (stream, setup) =
        setup::template_handshake(dial, &hello, quiet, MAX_TEMPLATE_DIALS).await?;
    if let Err(e) = setup::apply(&setup) {
        tracing::warn!(error = %e, "this boot's setup is incomplete");
    }
    let trust = setup.trust_ca.clone().map(|pem| {
        let root = config.trust_root.clone();
        tokio::task::spawn_blocking(move || trust::report(trust::trust_ca(&root, &pem)))
    });
    match tokio::task::spawn_blocking(init::finish_machine_init).await {
        Ok(paths) => config.private_paths.extend(paths),
        Err(e) => tracing::error!(error = %e, "finishing the boot failed"),
    }
    let ca_trust = match trust {
        Some(task) => Some(task.await.unwrap_or_else(|e| proto::CaTrust {
            error: Some(format!("the trust task failed: {e}")),
            ..Default::default()
        })),
        None => None,
    };
    Ok((stream.into_io(), ca_trust))
}

/// Whether the kernel command line asks for the template point on the
/// console ([`proto::TEMPLATE_SIGNAL_ENV`]).
fn signals_on_console() -> bool {
    std::env::var(proto::TEMPLATE_SIGNAL_ENV).is_ok_and(|v| v == proto::TEMPLATE_SIGNAL_CONSOLE)
}

/// Prints [`proto::TEMPLATE_CONSOLE_MARK`] on the console (the agent's
/// stderr as init), whatever the log filter: the host snapshots the
/// machine when it reads it.
fn announce_on_console(quiet_ms: u64, complete: bool) {
    use std::io::Write;
    let line = format!(
        "{} quiet_ms={quiet_ms} complete={complete}\n",
        proto::TEMPLATE_CONSOLE_MARK
    );
    let mut err = std::io::stderr().lock();
    if let Err(e) = err.write_all(line.as_bytes()).and_then(|()| err.flush()) {
        tracing::error!(error = %e, "cannot announce the template point on the console");
    }
}

/// Starts egress when this agent has a host proxy (see
/// [`egress::choose_upstream`]); returns the spawn registry its
/// captured-flow handler reads and the gate that opens when its start-up
/// has finished (both unused, the gate open, without egress). Returns once
/// the relay and the DNS stub are bound; the rest runs on its own threads
/// (see the module doc). Must run inside the runtime, on its thread. A
/// relay that cannot start is logged: sessions then have no network,
/// everything else works.
fn start_egress(config: &Config) -> (egress::Spawns, egress::EgressGate) {
    let spawns = egress::Spawns::new();
    let Some(upstream) = egress::choose_upstream(config.init, |k| std::env::var(k).ok()) else {
        tracing::debug!(
            "no egress: not a VM's init and {} is not set",
            proto::EGRESS_SOCKET_ENV
        );
        return (spawns, egress::EgressGate::open());
    };
    let began = sys::boottime_us();
    let (hold, ready) = egress::gate::gate();
    if config.init {
        // A copy of this binary into the userland, for ssh's ProxyCommand.
        let tool = hold.clone();
        tokio::task::spawn_blocking(move || {
            egress::connect_tool::install_in_machine();
            tool.release();
        });
    }
    match egress::start(egress::Options::production(upstream, spawns.clone(), hold)) {
        Ok(s) => tracing::debug!(
            relay = %s.relay_addr,
            dns = ?s.dns,
            capture_pending = s.capture.is_some(),
            elapsed_us = sys::boottime_us().saturating_sub(began),
            "egress started; the capture installs in the background"
        ),
        Err(e) => {
            tracing::error!(error = %e, "egress relay not started; session processes have no network")
        }
    }
    (spawns, ready)
}

/// Logging to stderr, one line per event (control characters escaped, see
/// [`crate::logline`]), filtered by `COWORK_LOG`, in the short form of
/// [`logfmt`].
fn init_logging() {
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::prelude::*;
    let default = Targets::new().with_default(tracing::Level::INFO);
    let (filter, bad) = match std::env::var("COWORK_LOG") {
        Ok(s) if !s.trim().is_empty() => match s.parse::<Targets>() {
            Ok(t) => (t, None),
            Err(e) => (default, Some(e.to_string())),
        },
        _ => (default, None),
    };
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(crate::logline::OneLine::new(io::stderr))
        .with_ansi(false)
        .with_timer(logfmt::BootClock)
        .with_target(false);
    // Another subscriber (the embedding binary's) may already be installed.
    let _ = tracing_subscriber::registry()
        .with(layer)
        .with(filter)
        .try_init();
    if let Some(e) = bad {
        tracing::warn!(error = %e, "COWORK_LOG is not a valid filter; using info");
    }
}

/// How the serve loop ended.
#[derive(Debug, PartialEq, Eq)]
enum Ending {
    HostClosed,
    Shutdown,
    LinkBroken,
}

/// A connected agent.
pub struct Agent {
    config: Config,
    is_init: bool,
    clock: BootClock,
    reader: BufReader<FdReader>,
    outbox: Outbox,
    writer: JoinHandle<io::Result<()>>,
    procs: Processes,
    guest: GuestRequests,
    /// For the hello: the template point's trust of the `Setup`'s CA.
    ca_trust: Option<proto::CaTrust>,
}

impl Agent {
    /// Sets the agent up on an established host connection. Must run inside
    /// a tokio runtime (with time and I/O enabled). Without egress.
    pub fn new(config: Config, conn: OwnedFd, clock: BootClock) -> Result<Agent, AgentError> {
        Self::with_egress(
            config,
            conn,
            clock,
            egress::Spawns::new(),
            egress::EgressGate::open(),
        )
    }

    /// [`Agent::new`], registering each spawn's egress credential in
    /// `spawns` (the registry [`egress::start`] was given) and starting
    /// spawns only once `ready` is open.
    pub fn with_egress(
        config: Config,
        conn: OwnedFd,
        clock: BootClock,
        spawns: egress::Spawns,
        ready: egress::EgressGate,
    ) -> Result<Agent, AgentError> {
        let io = FdIo::new(conn)?;
        Self::with_egress_io(config, io, clock, spawns, ready)
    }

    /// [`Agent::with_egress`] on a host link already registered with the
    /// runtime (after the template point).
    pub fn with_egress_io(
        config: Config,
        io: FdIo,
        clock: BootClock,
        spawns: egress::Spawns,
        ready: egress::EgressGate,
    ) -> Result<Agent, AgentError> {
        // SAFETY: getpid has no preconditions.
        let is_init = unsafe { libc::getpid() } == 1;
        let reaper = Reaper::start(if is_init {
            ReapMode::All
        } else {
            ReapMode::Own
        })?;
        let reader = BufReader::with_capacity(READ_BUFFER, io.reader());
        let (outbox, writer) = Outbox::start(io);
        if config.drop_caps {
            // Processes without capabilities must not reach the agent via /proc/1/{root,fd,mem}.
            if let Err(e) = child::make_self_undumpable() {
                tracing::warn!(error = %e, "cannot make the agent non-dumpable");
            }
        }
        let mut private_paths = Vec::new();
        for p in &config.private_paths {
            private_paths.push(sys::cstring(p)?);
        }
        if !private_paths.is_empty() {
            if let Err(e) = mounts::ensure_shared(&config.sessions_root) {
                tracing::warn!(error = %e, "mounts made later will not reach running sessions");
            }
        }
        let cgroups =
            config
                .cgroup_root
                .as_deref()
                .and_then(|root| match cgroup::Cgroups::open(root) {
                    Ok(c) => Some(c),
                    Err(e) => {
                        tracing::warn!(error = %e, "processes run without their own cgroups");
                        None
                    }
                });
        let procs = Processes::new(
            ProcessConfig {
                sessions_root: config.sessions_root.clone(),
                private_paths,
                drop_caps: config.drop_caps,
                cgroups,
                oom_score_adj: config.oom_score_adj,
                skel_dir: Some(PathBuf::from(users::ETC_DIR).join(users::SKEL_SUBDIR)),
                users: session_users(&config),
                shell: users::bash().map(String::from),
                egress: spawns,
                egress_ready: ready,
                root_session: root_session(&config),
            },
            reaper,
            outbox.clone(),
        );
        let guest = GuestRequests::new(outbox.clone());
        Ok(Agent {
            config,
            is_init,
            clock,
            reader,
            outbox,
            writer,
            procs,
            guest,
            ca_trust: None,
        })
    }

    /// Reports `ca_trust` (the template point's trust of the `Setup`'s CA)
    /// in the hello.
    pub fn with_ca_trust(mut self, ca_trust: Option<proto::CaTrust>) -> Self {
        self.ca_trust = ca_trust;
        self
    }

    /// The router for guest-originated requests of this connection.
    pub fn guest_requests(&self) -> GuestRequests {
        self.guest.clone()
    }

    /// Sends the hello and serves the host until it goes away or asks for
    /// shutdown. Returns the process exit code.
    pub async fn run(mut self) -> i32 {
        let hello = AgentMessage::Hello(Hello {
            protocol: proto::PROTOCOL_VERSION,
            version: env!("CARGO_PKG_VERSION").to_string(),
            is_init: self.is_init,
            boot: self.clock.times(self.is_init, sys::boottime_us()),
            kernel: sys::kernel_release(),
            userland: userland::booted(),
            session_disk: sessiondisk::outcome(),
            phase: None,
            ca_trust: self.ca_trust.take().map(Box::new),
            quiesce: false,
        });
        let ending = match self.outbox.send(&hello, &[]).await {
            Ok(()) => self.serve().await,
            Err(_) => Ending::LinkBroken,
        };
        tracing::info!(?ending, "connection ended; stopping every process");
        self.guest.fail_all();
        self.procs.kill_all();
        if !self.procs.wait_all_exited(EXIT_WAIT).await {
            tracing::warn!(
                left = self.procs.running(),
                "processes still running after SIGKILL"
            );
        }
        let _ = tokio::time::timeout(FLUSH_WAIT, self.outbox.flush()).await;
        match ending {
            Ending::HostClosed | Ending::Shutdown => EXIT_OK,
            Ending::LinkBroken => EXIT_LINK,
        }
    }

    async fn serve(&mut self) -> Ending {
        let mut buf = Vec::new();
        loop {
            let read = tokio::select! {
                r = framing::read_frame(&mut self.reader, proto::MAX_MESSAGE, &mut buf) => r,
                w = &mut self.writer => {
                    tracing::warn!(result = ?w.map(|r| r.map_err(|e| e.to_string())), "host link writer stopped");
                    return Ending::LinkBroken;
                }
            };
            match read {
                Ok(true) => {}
                Ok(false) => return Ending::HostClosed,
                Err(e) => {
                    tracing::error!(error = %e, "host link broken");
                    return Ending::LinkBroken;
                }
            }
            let body = std::mem::take(&mut buf);
            let header = header_bytes(&body).to_vec();
            match proto::decode::<HostMessage>(body) {
                Ok(env) => match env.header {
                    HostMessage::Request { id, op } => {
                        if self.dispatch(id, op, env.payload).await {
                            return Ending::Shutdown;
                        }
                    }
                    HostMessage::GuestResponse {
                        id,
                        result_json,
                        error,
                    } => {
                        self.guest.complete(&id, result_json, error);
                    }
                    HostMessage::Setup { .. } | HostMessage::Quiesce => {
                        tracing::warn!("a Setup or Quiesce after the template point is ignored");
                    }
                },
                Err(e) => self.refuse_malformed(&header, e).await,
            }
        }
    }

    /// Answers a request that did not decode (an unknown op, a missing
    /// field) when its id can be found; anything else is logged and skipped.
    async fn refuse_malformed(&self, header: &[u8], e: proto::ProtoError) {
        let id = serde_json::from_slice::<Value>(header)
            .ok()
            .filter(|v| v["type"] == "request")
            .and_then(|v| v["id"].as_u64());
        match id {
            Some(id) => {
                tracing::warn!(id, error = %e, "request not understood");
                self.reply(id, Err(format!("unsupported or malformed request: {e}")))
                    .await;
            }
            None => tracing::warn!(error = %e, "malformed message from the host skipped"),
        }
    }

    /// Handles one request; returns true when the agent must stop (Shutdown).
    async fn dispatch(&mut self, id: u64, op: Op, payload: Vec<u8>) -> bool {
        tracing::debug!(id, ?op, "request");
        let procs = self.procs.clone();
        let root = self.config.sessions_root.clone();
        match op {
            Op::Ping => self.reply(id, Ok(json!({}))).await,
            Op::Spawn(spec) => match procs.spawn(spec).await {
                Ok(started) => {
                    let result = started.result.clone();
                    self.reply(id, Ok(result)).await;
                    started.run();
                }
                Err(e) => self.reply(id, Err(e.to_string())).await,
            },
            Op::WriteStdin { id: pid } => {
                let r = procs.write_stdin(&pid, payload).map(|()| json!({}));
                self.reply(id, r.map_err(|e| e.to_string())).await
            }
            Op::CloseStdin { id: pid } => {
                let r = procs.close_stdin(&pid).map(|()| json!({}));
                self.reply(id, r.map_err(|e| e.to_string())).await
            }
            Op::Kill {
                id: pid,
                signal: sig,
            } => {
                let r = procs.kill(&pid, sig).map(|()| json!({}));
                self.reply(id, r.map_err(|e| e.to_string())).await
            }
            Op::ProcessStatus { id: pid } => {
                let r = procs.status(&pid);
                self.reply(id, r.map_err(|e| e.to_string())).await
            }
            Op::ReadFile { session, path } => {
                self.in_background(id, move || {
                    files::read_session_file(&root, &session, &path)
                        .map(|bytes| (json!({}), bytes))
                        .map_err(|e| e.to_string())
                });
            }
            Op::InstallSdk { source, version } => {
                let target = self.config.sdk_target.clone();
                self.in_background(id, move || {
                    let changed = mounts::install_sdk(&PathBuf::from(&source), &target)
                        .map_err(|e| e.to_string())?;
                    tracing::info!(%version, changed, target = %target.display(), "SDK installed");
                    Ok((
                        json!({"installed": target.display().to_string(), "version": version}),
                        Vec::new(),
                    ))
                });
            }
            Op::Mount(spec) => {
                self.in_background(id, move || {
                    // The home (and user) exist before anything is mounted in it.
                    procs
                        .prepare_session(&spec.session)
                        .map_err(|e| e.to_string())?;
                    mounts::mount_session(&root, &spec)
                        .map(|()| (json!({}), Vec::new()))
                        .map_err(|e| e.to_string())
                });
            }
            Op::DiskInfo { low_water_bytes } => {
                self.in_background(id, move || {
                    janitor::disk_info(&root, low_water_bytes)
                        .map(|v| (v, Vec::new()))
                        .map_err(|e| e.to_string())
                });
            }
            Op::DeleteSessionDirs { names } => {
                let live = procs.live_sessions();
                self.in_background(id, move || {
                    Ok((
                        janitor::delete_session_dirs(&root, &names, &live),
                        Vec::new(),
                    ))
                });
            }
            Op::PruneSessionCaches {
                only_if_free_bytes_below,
                include_session_tmp,
                session_tmp_older_than_seconds,
            } => {
                let live: HashSet<String> = procs.live_sessions();
                self.in_background(id, move || {
                    janitor::prune_session_caches(
                        &root,
                        only_if_free_bytes_below,
                        include_session_tmp,
                        session_tmp_older_than_seconds,
                        &live,
                    )
                    .map(|v| (v, Vec::new()))
                    .map_err(|e| e.to_string())
                });
            }
            Op::TrustCa { pem } => {
                let root = self.config.trust_root.clone();
                self.in_background(id, move || {
                    let done = trust::report(trust::trust_ca(&root, &pem));
                    if let Some(e) = done.error {
                        return Err(e);
                    }
                    // The reply is the final hello's `caTrust`, as JSON.
                    let reply = serde_json::to_value(&done).map_err(|e| e.to_string())?;
                    Ok((reply, Vec::new()))
                });
            }
            Op::Shutdown => {
                tracing::info!("shutdown requested");
                procs.kill_all();
                if !procs.wait_all_exited(EXIT_WAIT).await {
                    tracing::warn!(
                        left = procs.running(),
                        "processes still running after SIGKILL"
                    );
                }
                self.reply(id, Ok(json!({}))).await;
                return true;
            }
        }
        false
    }

    async fn reply(&self, id: u64, result: Result<Value, String>) {
        send_response(&self.outbox, id, result.map(|v| (v, Vec::new()))).await;
    }

    /// Runs `work` on the blocking pool and answers with its result.
    fn in_background<F>(&self, id: u64, work: F)
    where
        F: FnOnce() -> Result<(Value, Vec<u8>), String> + Send + 'static,
    {
        let outbox = self.outbox.clone();
        tokio::spawn(async move {
            let result = tokio::task::spawn_blocking(work)
                .await
                .unwrap_or_else(|e| Err(format!("internal error: {e}")));
            send_response(&outbox, id, result).await;
        });
    }
}

async fn send_response(outbox: &Outbox, id: u64, result: Result<(Value, Vec<u8>), String>) {
    let (msg, payload) = match result {
        Ok((result, payload)) => (
            AgentMessage::Response {
                id,
                error: None,
                result,
            },
            payload,
        ),
        Err(e) => {
            tracing::debug!(id, error = %e, "request failed");
            (
                AgentMessage::Response {
                    id,
                    error: Some(e),
                    result: Value::Null,
                },
                Vec::new(),
            )
        }
    };
    if let Err(e) = outbox.send(&msg, &payload).await {
        tracing::debug!(id, error = %e, "response not sent");
    }
}

/// The JSON header of a message body (empty when the body is too short).
fn header_bytes(body: &[u8]) -> &[u8] {
    let Some(prefix) = body.get(..4) else {
        return &[];
    };
    let len = u32::from_be_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    body.get(4..4usize.saturating_add(len)).unwrap_or(&[])
}
