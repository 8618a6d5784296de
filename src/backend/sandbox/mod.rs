//! The namespace sandbox: the daemon's first backend runs the guest agent in
//! fresh Linux namespaces instead of a VM.
//!
//! [`Sandbox::start`] re-executes the helper as `__sandbox-init` ([`init_main`]),
//! which enters a new user namespace (always, also as root, mapping only the
//! caller's uid and gid), new mount, pid, ipc, uts and network namespaces
//! (the network one holds only `lo`, brought up), forks PID 1, builds a
//! minimal root (read-only `/usr`, `/etc`, `/bin`, `/sbin`, `/lib*`, with the
//! sandbox's own `/etc/hosts` and `/etc/resolv.conf`; private `/tmp`, `/run`,
//! `/dev`, `/proc`; `/sessions` read-write; the host's `/` at [`HOST_ROOT`]
//! and the egress proxy's socket in [`EGRESS_DIR`] for the agent alone) and
//! executes the agent with one end of a socketpair as fd [`AGENT_FD`]. The
//! other end is returned to the daemon; the agent's hello arrives on it.
//!
//! Network: sessions have loopback only (no host interfaces, no host
//! loopback services, no host abstract unix sockets). The one way out is
//! the daemon's egress proxy ([`SandboxConfig::egress`]), served on a unix
//! socket per sandbox (module `egress`) that only the agent sees, at
//! [`EGRESS_DIR`]`/`[`EGRESS_SOCKET_NAME`], named to it in the environment
//! variable [`guest_agent::proto::EGRESS_SOCKET_ENV`]. The socket and its
//! serving task end with the sandbox.
//!
//! Failures before the agent runs come back on a status pipe as the step and
//! errno, so `startVM` fails with the cause (for example "user namespaces are
//! unavailable") instead of timing out. The daemon's death kills the init
//! (`PR_SET_PDEATHSIG`), whose death kills PID 1, whose death makes the kernel
//! kill everything else in the pid namespace.
//!
//! Limits: Linux only; needs user and network namespaces (see [`probe`]), a
//! fully visible host `/proc` and a root `pivot_root` accepts. Started with
//! [`SandboxConfig::limits`], the sandbox runs in a cgroup of its own
//! ([`cgroup`], [`limits`]); without, it shares the helper's. Inside, only
//! the caller's uid and gid exist: files of
//! other users appear as the overflow id and only their "other" permission
//! bits apply (this also holds for the agent under `/.host` when the helper
//! runs as root). `start` must be called from a thread that lives as long as
//! the sandbox (a runtime worker, not a short-lived blocking-pool thread):
//! the parent-death signal follows the thread that forked the init.

pub mod cgroup;
mod check;
mod egress;
mod init;
pub mod limits;
mod rootfs;
mod sys;
mod wire;

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use crate::hostfs::HostEnv;
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;

pub use check::probe;
pub use egress::SOCKET_NAME as EGRESS_SOCKET_NAME;
pub use init::HOSTNAME;

use cgroup::SandboxCgroup;
use egress::EgressSocket;
use limits::{Enforcement, Hold, Limit, Limits, SESSION_OOM_SCORE_ADJ};

use wire::{ExecSpec, Failure, InitSpec, Reports, Stage};

/// The hidden subcommand that runs [`init_main`].
pub const INIT_SUBCOMMAND: &str = "__sandbox-init";

/// Descriptor of the agent link in the init and the agent.
pub const AGENT_FD: RawFd = 3;

/// Descriptor of the status pipe in the init (close-on-exec there).
const STATUS_FD: RawFd = 4;

/// Exit status of the init when setup failed before the agent ran.
pub const SETUP_FAILED_STATUS: i32 = 125;

/// Where the host's `/` is reachable inside the sandbox (agent only; the
/// agent hides it from the processes it spawns).
pub const HOST_ROOT: &str = "/.host";

/// Where the agent finds the egress proxy's socket directory inside the
/// sandbox (agent only, hidden from spawned processes like [`HOST_ROOT`]).
pub const EGRESS_DIR: &str = "/.egress";

/// How long the init may take to build the sandbox and execute the agent.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(20);

/// How long [`Sandbox::kill`] waits for the pid namespace to empty after
/// SIGKILL before it kills the init too and gives up waiting for the rest.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// Descriptors handed to the init are first moved at or above this number,
/// so placing them on 3 and 4 in the child never overwrites one another.
const FD_FLOOR: RawFd = 10;

/// What to start.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// The daemon's own executable (`std::env::current_exe()`, or
    /// `/proc/self/exe` to survive the file being replaced); it is
    /// re-executed as the init, and the init executes itself as the agent.
    pub helper_exe: PathBuf,
    /// Host directory bound read-write at `/sessions`; must be absolute.
    pub sessions_dir: PathBuf,
    /// Extra arguments appended to the agent's command line.
    pub agent_args: Vec<String>,
    /// Runs this command (absolute path inside the sandbox first) as PID 1
    /// instead of the agent; `agent_args` are then ignored. For tests and
    /// diagnostics.
    pub command_override: Option<Vec<String>>,
    /// The egress proxy served to this sandbox on its own unix socket; none:
    /// the sandbox has no way out at all (loopback only).
    pub egress: Option<crate::egress::EgressProxy>,
    /// Resource limits: the sandbox gets a cgroup of its own holding them
    /// (or the stand-ins, see [`limits`]) and its agent's sessions are the
    /// OOM killer's first choice; none: it shares the helper's cgroup.
    pub limits: Option<Limits>,
    /// With [`SandboxConfig::limits`], place the sandbox in no cgroup at
    /// all (the rlimit stand-ins only), as on a host without delegation:
    /// the [`cgroup::DISABLE_ENV`] test hook.
    pub cgroup_disabled: bool,
    /// The log filter of the init and the agent (the helper's `--log`,
    /// `COWORK_LOG`; the agent gets it as its `COWORK_LOG`); none: their
    /// defaults.
    pub log: Option<String>,
    /// The helper's `PATH` (`systemd-run`), runtime directory (the
    /// systemd user manager, the egress socket's directory) and temporary
    /// directory.
    pub host: HostEnv,
}

/// Environment variable of the agent-wrapper test hook: an absolute host
/// path of a program the sandbox runs as PID 1 *instead of* the agent, with
/// the agent's own command line (as a path under [`HOST_ROOT`]) as its
/// arguments, so it can `exec` the real agent or stand in for it. The
/// guest-hostility tests put a misbehaving fake agent there. Read from the
/// helper's environment by [`crate::cli`] only, no flag (the client cannot
/// set it); whoever sets the helper's environment can run any program as
/// the helper's user anyway.
pub const AGENT_WRAPPER_ENV: &str = "COWORK_TEST_SANDBOX_AGENT_WRAPPER";

/// The [`SandboxConfig::command_override`] of the [`AGENT_WRAPPER_ENV`]
/// hook: `wrapper` (a host path) followed by the agent's command line as
/// the init would run it, with the helper `helper_exe` (a host path) named
/// by its path under [`HOST_ROOT`]; `egress` as for a sandbox with an
/// egress proxy.
pub fn wrapped_agent_command(
    wrapper: &std::path::Path,
    helper_exe: &std::path::Path,
    egress: bool,
) -> Vec<String> {
    let under_host_root = |p: &std::path::Path| agent_view_of_host(&p.to_string_lossy());
    std::iter::once(under_host_root(wrapper))
        .chain(std::iter::once(under_host_root(helper_exe)))
        .chain(init::agent_args(egress))
        .collect()
}

impl SandboxConfig {
    /// A configuration that runs the agent with no extra arguments, no
    /// egress, no limits, the default log filters and an empty host
    /// environment (no `PATH`, so no systemd scope; sockets under `/tmp`).
    pub fn new(helper_exe: impl Into<PathBuf>, sessions_dir: impl Into<PathBuf>) -> Self {
        Self {
            helper_exe: helper_exe.into(),
            sessions_dir: sessions_dir.into(),
            agent_args: Vec::new(),
            command_override: None,
            egress: None,
            limits: None,
            cgroup_disabled: false,
            log: None,
            host: HostEnv::default(),
        }
    }

    /// The init's instructions; `egress_dir` is the host directory of the
    /// egress socket, when there is one.
    fn init_spec(&self, egress_dir: Option<&std::path::Path>) -> Result<InitSpec, SandboxError> {
        if !self.sessions_dir.is_absolute() {
            return Err(SandboxError::Config(format!(
                "the sessions directory {} is not an absolute path",
                self.sessions_dir.display()
            )));
        }
        let sessions_dir = self.sessions_dir.to_str().ok_or_else(|| {
            SandboxError::Config(format!(
                "the sessions directory {} is not valid UTF-8",
                self.sessions_dir.display()
            ))
        })?;
        let exec = match &self.command_override {
            Some(argv) if argv.first().is_some_and(|p| p.starts_with('/')) => {
                ExecSpec::Command { argv: argv.clone() }
            }
            Some(_) => {
                return Err(SandboxError::Config(
                    "the command override must start with an absolute path".to_string(),
                ))
            }
            None => ExecSpec::Agent {
                argv0: self.helper_exe.to_string_lossy().into_owned(),
                args: self.agent_args.clone(),
            },
        };
        let egress_dir = egress_dir
            .map(|dir| {
                dir.to_str().map(str::to_string).ok_or_else(|| {
                    SandboxError::Config(format!(
                        "the sandbox run directory {} is not valid UTF-8",
                        dir.display()
                    ))
                })
            })
            .transpose()?;
        Ok(InitSpec {
            sessions_dir: sessions_dir.to_string(),
            exec,
            parent_pid: std::process::id() as i32,
            egress_dir,
            cgroup: None,
            rlimits: limits::Rlimits::default(),
            session_oom_score_adj: self.limits.map(|_| SESSION_OOM_SCORE_ADJ),
            log: self.log.clone(),
        })
    }
}

/// Why the sandbox could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(
        "user namespaces are unavailable: {cause}. Enable them (sysctl \
         kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_userns=0 or an \
         AppArmor profile that allows user namespaces for the helper, user.max_user_namespaces > 0, \
         no seccomp filter blocking unshare) or run the helper as root"
    )]
    UserNamespacesUnavailable { cause: String },
    #[error(
        "network namespaces are unavailable: {cause}. The sandbox gives sessions a network of \
         their own (loopback only; the egress proxy is their only way out), so it needs them: \
         a kernel with CONFIG_NET_NS, user.max_net_namespaces > 0 and no seccomp filter or \
         security module refusing unshare(CLONE_NEWNET)"
    )]
    NetworkNamespacesUnavailable { cause: String },
    #[error("sandbox setup failed while {stage}: {cause}")]
    Setup { stage: String, cause: String },
    #[error("the sandbox could not be placed in its cgroup: {cause}")]
    Limits { cause: String },
    #[error("cannot run the sandbox init {}: {source}", exe.display())]
    Spawn { exe: PathBuf, source: io::Error },
    #[error("cannot {what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
    #[error("invalid sandbox configuration: {0}")]
    Config(String),
    #[error("the sandbox init did not start the agent within {0:?}; it was killed")]
    Timeout(Duration),
    #[error(
        "the sandbox init {} ended before starting the agent ({status}){detail}; is it a \
         cowork-helper with the {INIT_SUBCOMMAND} entry?",
        exe.display()
    )]
    EarlyExit {
        exe: PathBuf,
        status: String,
        detail: String,
    },
}

/// How a sandbox ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SandboxExit {
    /// The agent (PID 1) exited with this status.
    Exited(i32),
    /// The agent, or the init, was killed by this signal.
    Signaled(i32),
    /// [`Sandbox::kill`] ended it.
    Killed,
    /// The end could not be observed (the text says why).
    Unknown(String),
}

impl SandboxExit {
    fn from_status(status: io::Result<ExitStatus>, killed: bool) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match status {
            _ if killed => SandboxExit::Killed,
            Err(e) => SandboxExit::Unknown(e.to_string()),
            Ok(s) => match (s.code(), s.signal()) {
                (Some(code), _) => SandboxExit::Exited(code),
                (None, Some(sig)) => SandboxExit::Signaled(sig),
                (None, None) => SandboxExit::Unknown(format!("wait status {}", s.into_raw())),
            },
        }
    }
}

impl fmt::Display for SandboxExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SandboxExit::Exited(code) => write!(f, "the agent exited with status {code}"),
            SandboxExit::Signaled(sig) => {
                write!(
                    f,
                    "the agent was killed by {}",
                    guest_agent::signal::name(*sig)
                )
            }
            SandboxExit::Killed => f.write_str("the sandbox was killed by the helper"),
            SandboxExit::Unknown(why) => write!(f, "the sandbox ended in an unknown way: {why}"),
        }
    }
}

/// One running sandbox. Dropping it kills everything in it.
#[derive(Debug)]
pub struct Sandbox {
    child: tokio::process::Child,
    init_pid: u32,
    agent_pid: i32,
    /// Pins PID 1 so [`Sandbox::kill`] can never hit a reused pid.
    agent_pidfd: Option<OwnedFd>,
    killed: bool,
    exit: Option<SandboxExit>,
    /// The egress proxy's socket and serving task; dropped when the sandbox
    /// ends.
    egress: Option<EgressSocket>,
    /// The sandbox's cgroup; removed when the sandbox ends.
    cgroup: Option<SandboxCgroup>,
    /// Which limits hold (with [`SandboxConfig::limits`]).
    enforcement: Option<Enforcement>,
}

impl Sandbox {
    /// Starts the sandbox; returns once the agent is being executed as its
    /// PID 1. The returned stream is the daemon's end of the agent link (a
    /// socketpair); the agent's hello arrives on it.
    ///
    /// With [`SandboxConfig::limits`], a sandbox whose init could not join
    /// the cgroup made for it is started once more without one (the
    /// stand-ins then hold, and the log says so).
    pub async fn start(cfg: SandboxConfig) -> Result<(Sandbox, UnixStream), SandboxError> {
        match Self::start_placed(cfg.clone(), None).await {
            Err(SandboxError::Limits { cause }) if cfg.limits.is_some() => {
                tracing::warn!(
                    error = %cause,
                    "the sandbox could not join its cgroup; starting it without one"
                );
                let why = format!("no cgroup: the sandbox could not join its own: {cause}");
                Self::start_placed(cfg, Some(why)).await
            }
            other => other,
        }
    }

    /// [`Sandbox::start`] once; `no_cgroup`: place it in none, for this
    /// reason.
    async fn start_placed(
        cfg: SandboxConfig,
        no_cgroup: Option<String>,
    ) -> Result<(Sandbox, UnixStream), SandboxError> {
        // Checked before anything is created.
        cfg.init_spec(None)?;
        let egress = cfg
            .egress
            .clone()
            .map(|proxy| EgressSocket::open(proxy, &cfg.host))
            .transpose()?;
        let mut spec = cfg.init_spec(egress.as_ref().map(EgressSocket::dir))?;
        let placement = match cfg.limits {
            Some(limits) => {
                let exe = cfg.helper_exe.clone();
                let (host, hook_disabled) = (cfg.host.clone(), cfg.cgroup_disabled);
                let placed = tokio::task::spawn_blocking(move || {
                    let mut facts = cgroup::HostFacts::read(&host, hook_disabled);
                    if no_cgroup.is_some() {
                        facts.disabled = no_cgroup;
                    }
                    cgroup::place(&limits, &facts, &exe)
                })
                .await
                .map_err(|e| SandboxError::Config(format!("placing the sandbox failed: {e}")))?;
                Some((limits, placed))
            }
            None => None,
        };
        let (limits, mut cgroup, enforcement) = match placement {
            Some((limits, p)) => {
                spec.cgroup = p.cgroup.as_ref().map(SandboxCgroup::init_spec);
                spec.rlimits = p.rlimits;
                (Some(limits), p.cgroup, Some(p.enforcement))
            }
            None => (None, None, None),
        };
        let systemd_scope = cgroup
            .as_ref()
            .and_then(|c| c.command_prefix().map(<[String]>::to_vec));
        let encoded = serde_json::to_string(&spec)
            .map_err(|e| SandboxError::Config(format!("cannot encode the init spec: {e}")))?;
        let io_err = |what| move |source| SandboxError::Io { what, source };
        let (daemon_end, agent_end) = std::os::unix::net::UnixStream::pair()
            .map_err(io_err("create the agent socketpair"))?;
        let (status_r, status_w) = sys::pipe().map_err(io_err("create the status pipe"))?;
        let agent_fd = sys::dup_above(agent_end.as_fd(), FD_FLOOR)
            .map_err(io_err("duplicate a descriptor"))?;
        let status_fd =
            sys::dup_above(status_w.as_fd(), FD_FLOOR).map_err(io_err("duplicate a descriptor"))?;
        drop((agent_end, status_w));
        let (agent_raw, status_raw) = (agent_fd.as_raw_fd(), status_fd.as_raw_fd());

        // In a systemd scope: systemd-run asks for the scope, then executes
        // the init in place (same pid, descriptors kept).
        let program: PathBuf = match &systemd_scope {
            Some(prefix) => prefix.first().map(PathBuf::from).unwrap_or_default(),
            None => cfg.helper_exe.clone(),
        };
        let mut cmd = tokio::process::Command::new(&program);
        if let Some(prefix) = &systemd_scope {
            cmd.args(prefix.iter().skip(1)).arg(&cfg.helper_exe);
        }
        cmd.arg(INIT_SUBCOMMAND)
            .arg(&encoded)
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            // Out of the terminal's process group: a Ctrl-C reaches the
            // daemon, which stops the sandbox itself.
            .process_group(0);
        // SAFETY: only dup2, which is async-signal-safe, runs in the child.
        // dup2 leaves the new descriptors without close-on-exec.
        unsafe {
            cmd.pre_exec(move || {
                sys::cvt(libc::dup2(agent_raw, AGENT_FD))?;
                sys::cvt(libc::dup2(status_raw, STATUS_FD))?;
                Ok(())
            });
        }
        let child = match cmd.spawn() {
            Ok(child) => child,
            Err(source) => {
                if let Some(cg) = cgroup.take() {
                    release(cg).await;
                }
                return Err(SandboxError::Spawn {
                    exe: program,
                    source,
                });
            }
        };
        drop((agent_fd, status_fd));
        let init_pid = child.id().unwrap_or_default();
        let mut sandbox = Sandbox {
            child,
            init_pid,
            agent_pid: 0,
            agent_pidfd: None,
            killed: false,
            exit: None,
            egress,
            cgroup,
            enforcement,
        };
        tracing::debug!(init_pid, "sandbox init started");

        let reports = match tokio::time::timeout(SETUP_TIMEOUT, read_status(status_r)).await {
            Ok(Ok(bytes)) => Reports::parse(&bytes),
            Ok(Err(source)) => {
                sandbox.kill().await;
                return Err(SandboxError::Io {
                    what: "read the sandbox status pipe",
                    source,
                });
            }
            Err(_) => {
                sandbox.kill().await;
                return Err(SandboxError::Timeout(SETUP_TIMEOUT));
            }
        };
        if let Some(failure) = reports.failure {
            sandbox.reap_after_setup().await;
            return Err(error_from_failure(failure, &check::HostSwitches::read()));
        }
        let agent_pid = match (reports.exec, reports.forked) {
            (true, Some(pid)) => pid,
            _ => {
                let status = sandbox.reap_after_setup().await;
                if systemd_scope.is_some() && reports.forked.is_none() && reports.garbage.is_empty()
                {
                    return Err(SandboxError::Limits {
                        cause: format!(
                            "{} ended ({status}) before the sandbox's init ran; its message is in \
                             the log above",
                            program.display()
                        ),
                    });
                }
                let detail = if reports.garbage.is_empty() {
                    String::new()
                } else {
                    format!("; it said {:?}", reports.garbage.join(" | "))
                };
                return Err(SandboxError::EarlyExit {
                    exe: cfg.helper_exe,
                    status,
                    detail,
                });
            }
        };
        sandbox.agent_pid = agent_pid;
        sandbox.agent_pidfd = open_child_pidfd(agent_pid, init_pid);
        if let Some(limits) = limits {
            sandbox.settle_limits(&limits);
        }

        daemon_end
            .set_nonblocking(true)
            .map_err(io_err("configure the agent link"))?;
        let link = UnixStream::from_std(daemon_end).map_err(io_err("register the agent link"))?;
        tracing::info!(init_pid, agent_pid, "sandbox started");
        Ok((sandbox, link))
    }

    /// Path, in the agent's view, under which the host path `rel` (relative
    /// to the host's `/`, already validated by
    /// `guest_agent::names::host_relative_path`) is reachable.
    pub fn agent_path_for_host(&self, rel: &str) -> String {
        agent_view_of_host(rel)
    }

    /// Host path of the egress proxy's socket, while the sandbox runs with
    /// one.
    pub fn egress_socket(&self) -> Option<PathBuf> {
        self.egress
            .as_ref()
            .map(|e| e.dir().join(EGRESS_SOCKET_NAME))
    }

    /// Host pid of the init process.
    pub fn init_pid(&self) -> u32 {
        self.init_pid
    }

    /// Which of the sandbox's limits hold, when it was started with some.
    pub fn enforcement(&self) -> Option<&Enforcement> {
        self.enforcement.as_ref()
    }

    /// The sandbox's cgroup, while it runs in one of its own.
    pub fn cgroup(&self) -> Option<&SandboxCgroup> {
        self.cgroup.as_ref()
    }

    /// Once the init runs: a systemd scope's limits are read from the scope
    /// itself (what the probe scope promised stays for the stand-ins); then
    /// the limits are logged, one line each that is not as asked.
    fn settle_limits(&mut self, limits: &Limits) {
        if let Some(cg) = self.cgroup.as_mut() {
            if matches!(cg.origin(), cgroup::Origin::Systemd { .. }) {
                cg.learn_scope(self.init_pid);
                let no_swap = cgroup::host_swap_total_kib() == Some(0);
                let real = cg.verify(limits, no_swap);
                let planned = self.enforcement.get_or_insert_with(Enforcement::default);
                for l in Limit::ALL {
                    if !matches!(planned.get(l), Hold::StandIn { .. }) {
                        planned.set(l, real.get(l));
                    }
                }
            }
        }
        let place = self.cgroup.as_ref().map_or_else(
            || "no cgroup of its own".to_string(),
            SandboxCgroup::describe,
        );
        if let Some(e) = &self.enforcement {
            e.log(limits, &place);
        }
    }

    /// Host pid of the sandbox's PID 1 (the agent).
    pub fn agent_pid(&self) -> i32 {
        self.agent_pid
    }

    /// Waits for the sandbox to end by itself; returns how it ended.
    /// Cancel-safe; after the end it returns the same answer again.
    pub async fn wait(&mut self) -> SandboxExit {
        if let Some(exit) = &self.exit {
            return exit.clone();
        }
        let status = self.child.wait().await;
        let exit = self.finish(status);
        self.release_cgroup().await;
        exit
    }

    /// Removes the sandbox's cgroup (once it has ended).
    async fn release_cgroup(&mut self) {
        if let Some(cg) = self.cgroup.take() {
            release(cg).await;
        }
    }

    /// Kills everything in the sandbox (SIGKILL) and reaps the init, which
    /// only ends once the pid namespace is empty. Idempotent.
    pub async fn kill(&mut self) {
        if self.exit.is_some() {
            return;
        }
        if let Ok(Some(status)) = self.child.try_wait() {
            self.finish(Ok(status));
            self.release_cgroup().await;
            return;
        }
        if self.agent_pidfd.as_ref().is_some_and(pidfd_exited) {
            // PID 1 already ended by itself (the link closed first): the
            // init is about to pass its status on. Waiting for that keeps
            // the real cause (an exit code, a SIGSEGV) rather than
            // reporting the helper's kill.
            if let Ok(status) = tokio::time::timeout(KILL_TIMEOUT, self.child.wait()).await {
                self.finish(status);
                self.release_cgroup().await;
                return;
            }
        }
        self.killed = true;
        let agent_signalled = self.agent_pidfd.as_ref().is_some_and(|fd| {
            match sys::pidfd_send_signal(fd.as_fd(), libc::SIGKILL) {
                Ok(()) => true,
                // Already gone: the init is about to end by itself.
                Err(e) => e.raw_os_error() == Some(libc::ESRCH),
            }
        });
        if !agent_signalled {
            // Without a pidfd, PID 1 dies through its parent-death signal.
            let _ = self.child.start_kill();
        }
        let status = match tokio::time::timeout(KILL_TIMEOUT, self.child.wait()).await {
            Ok(status) => status,
            Err(_) => {
                tracing::warn!(
                    init_pid = self.init_pid,
                    "sandbox still not empty {KILL_TIMEOUT:?} after SIGKILL; killing its init"
                );
                let _ = self.child.start_kill();
                self.child.wait().await
            }
        };
        self.finish(status);
        self.release_cgroup().await;
    }

    fn finish(&mut self, status: io::Result<ExitStatus>) -> SandboxExit {
        let exit = SandboxExit::from_status(status, self.killed);
        tracing::info!(init_pid = self.init_pid, "sandbox ended: {exit}");
        self.exit = Some(exit.clone());
        // Nothing is left to use the proxy's socket.
        self.egress = None;
        exit
    }

    /// After a failed setup the init ends by itself: reaps it (killing it if
    /// it lingers) and describes its exit status.
    async fn reap_after_setup(&mut self) -> String {
        let status = match tokio::time::timeout(KILL_TIMEOUT, self.child.wait()).await {
            Ok(status) => status,
            Err(_) => {
                let _ = self.child.start_kill();
                self.child.wait().await
            }
        };
        let text = match &status {
            Ok(s) => s.to_string(),
            Err(e) => format!("unknown exit: {e}"),
        };
        self.exit = Some(SandboxExit::from_status(status, false));
        self.egress = None;
        self.release_cgroup().await;
        text
    }
}

/// Removes a sandbox's cgroup on a blocking thread (it may wait for the
/// last processes to go); a failure is logged, and the next helper to
/// create a cgroup there removes it.
async fn release(cg: SandboxCgroup) {
    let what = cg.describe();
    match tokio::task::spawn_blocking(move || cg.remove()).await {
        Ok(Ok(())) => tracing::debug!(cgroup = %what, "sandbox cgroup removed"),
        Ok(Err(e)) => tracing::warn!(error = %e, "sandbox cgroup left behind"),
        Err(e) => tracing::warn!(error = %e, "sandbox cgroup removal did not run"),
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if self.exit.is_none() {
            if let Some(fd) = &self.agent_pidfd {
                let _ = sys::pidfd_send_signal(fd.as_fd(), libc::SIGKILL);
            }
            // kill_on_drop then kills the init, and the runtime reaps it.
        }
        if let Some(cg) = self.cgroup.take() {
            // Its processes are dying: removal may have to wait for them.
            let spawned = std::thread::Builder::new()
                .name("cgroup-removal".into())
                .spawn(move || {
                    if let Err(e) = cg.remove() {
                        tracing::warn!(error = %e, "sandbox cgroup left behind");
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "sandbox cgroup left behind: no thread to remove it");
            }
        }
    }
}

/// Entry of the hidden subcommand `cowork-helper __cgroup-probe`, run by
/// the systemd probe scope (see [`cgroup`]): prints the limits of its own
/// cgroup. Returns the exit status.
pub fn cgroup_probe_main() -> i32 {
    cgroup::probe_main()
}

/// Entry of the hidden subcommand `cowork-helper __sandbox-init <spec>`.
/// `args` is the whole command line (`std::env::args()`). Must run
/// single-threaded, before any runtime exists. Returns the exit status for
/// the process (the agent's, or [`SETUP_FAILED_STATUS`]); when the agent was
/// killed by a signal the init kills itself with the same signal instead.
pub fn init_main(args: Vec<String>) -> i32 {
    init::main(args)
}

/// `/.host/<rel>`: where the agent finds the host path `rel`.
fn agent_view_of_host(rel: &str) -> String {
    format!("{HOST_ROOT}/{}", rel.trim_start_matches('/'))
}

async fn read_status(fd: OwnedFd) -> io::Result<Vec<u8>> {
    let pipe = tokio::net::unix::pipe::Receiver::from_owned_fd(fd)?;
    let mut bytes = Vec::new();
    pipe.take(wire::MAX_REPORT_BYTES)
        .read_to_end(&mut bytes)
        .await?;
    Ok(bytes)
}

/// A pidfd for `pid` if it is (still) the child of `parent`: the pidfd pins
/// the process, so the check after opening it is free of pid-reuse races.
/// Whether the process behind `pidfd` has ended (a pidfd reads as ready
/// once its process exits, zombie or reaped).
fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd on the stack, zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & libc::POLLIN != 0
}

fn open_child_pidfd(pid: i32, parent: u32) -> Option<OwnedFd> {
    let fd = match sys::pidfd_open(pid) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::debug!(pid, error = %e, "no pidfd for the sandbox's PID 1");
            return None;
        }
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    (parent_from_stat(&stat) == Some(parent)).then_some(fd)
}

/// The ppid field of `/proc/<pid>/stat` (the name before it may hold spaces
/// and parentheses, so fields are counted after the last `)`).
fn parent_from_stat(stat: &str) -> Option<u32> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Turns an init failure into the daemon's error, naming the kernel switch
/// that forbids user namespaces when one does.
fn error_from_failure(failure: Failure, switches: &check::HostSwitches) -> SandboxError {
    let userns_step = matches!(failure.stage, Stage::UserNamespace | Stage::IdMap);
    // With AppArmor's restriction, unshare succeeds but the namespace grants
    // no capabilities: later steps fail with EPERM.
    let restricted_later = failure.errno == Some(libc::EPERM) && switches.apparmor_restricts();
    if userns_step || restricted_later {
        let mut cause = failure.to_string();
        let hints = switches.hints(failure.errno);
        if !hints.is_empty() {
            cause = format!("{cause} ({})", hints.join("; "));
        }
        return SandboxError::UserNamespacesUnavailable { cause };
    }
    if failure.stage == Stage::Network && failure.what.starts_with(check::UNSHARE_NET) {
        let mut cause = failure.to_string();
        let hints = switches.net_hints(failure.errno);
        if !hints.is_empty() {
            cause = format!("{cause} ({})", hints.join("; "));
        }
        return SandboxError::NetworkNamespacesUnavailable { cause };
    }
    if failure.stage == Stage::Limits {
        return SandboxError::Limits {
            cause: failure.to_string(),
        };
    }
    SandboxError::Setup {
        stage: failure.stage.to_string(),
        cause: failure.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parent_survives_odd_names() {
        assert_eq!(parent_from_stat("123 (sh) S 77 123 123 0"), Some(77));
        assert_eq!(parent_from_stat("123 (a) b) (c) R 9 1"), Some(9));
        assert_eq!(parent_from_stat("garbage"), None);
    }

    #[test]
    fn host_paths_live_under_the_host_root() {
        assert_eq!(agent_view_of_host("home/u/p"), "/.host/home/u/p");
        assert_eq!(agent_view_of_host("/etc/x"), "/.host/etc/x");
    }

    #[test]
    fn config_is_checked() {
        let mut cfg = SandboxConfig::new("/usr/bin/cowork-helper", "relative/dir");
        assert!(matches!(cfg.init_spec(None), Err(SandboxError::Config(_))));
        cfg.sessions_dir = "/var/lib/sessions".into();
        cfg.agent_args = vec!["--log".into()];
        let spec = cfg.init_spec(None).expect("valid");
        assert_eq!(
            spec.exec,
            ExecSpec::Agent {
                argv0: "/usr/bin/cowork-helper".into(),
                args: vec!["--log".into()]
            }
        );
        assert_eq!(spec.parent_pid, std::process::id() as i32);
        assert_eq!(spec.egress_dir, None);
        let with_dir = cfg
            .init_spec(Some(std::path::Path::new("/run/user/0/cowork-sandbox-1-0")))
            .expect("valid");
        assert_eq!(
            with_dir.egress_dir.as_deref(),
            Some("/run/user/0/cowork-sandbox-1-0")
        );
        cfg.command_override = Some(vec!["sh".into()]);
        assert!(matches!(cfg.init_spec(None), Err(SandboxError::Config(_))));
        cfg.command_override = Some(vec!["/bin/sh".into(), "-c".into(), "true".into()]);
        assert!(matches!(
            cfg.init_spec(None).map(|s| s.exec),
            Ok(ExecSpec::Command { .. })
        ));
    }

    #[test]
    fn userns_failures_name_the_switch() {
        let failure = Failure {
            stage: Stage::UserNamespace,
            what: "unshare(CLONE_NEWUSER)".into(),
            errno: Some(libc::EPERM),
        };
        let switches = check::HostSwitches {
            unprivileged_userns_clone: Some(0),
            apparmor_restrict: None,
            max_user_namespaces: Some(1000),
            max_net_namespaces: Some(1000),
            root: false,
        };
        let err = error_from_failure(failure.clone(), &switches);
        let text = err.to_string();
        assert!(
            matches!(err, SandboxError::UserNamespacesUnavailable { .. }),
            "{text}"
        );
        assert!(
            text.contains("kernel.unprivileged_userns_clone=0"),
            "{text}"
        );
        assert!(text.contains("run the helper as root"), "{text}");

        // AppArmor: unshare works, the first mount fails with EPERM.
        let mount = Failure {
            stage: Stage::Namespaces,
            what: "make every mount private".into(),
            ..failure
        };
        let switches = check::HostSwitches {
            apparmor_restrict: Some(1),
            unprivileged_userns_clone: None,
            ..switches
        };
        let text = error_from_failure(mount.clone(), &switches).to_string();
        assert!(
            text.contains("apparmor_restrict_unprivileged_userns=1"),
            "{text}"
        );

        // Same EPERM without the switch is a plain setup failure.
        let switches = check::HostSwitches {
            apparmor_restrict: Some(0),
            ..switches
        };
        assert!(matches!(
            error_from_failure(mount, &switches),
            SandboxError::Setup { .. }
        ));
    }

    #[test]
    fn network_namespace_failures_say_so() {
        let switches = check::HostSwitches {
            unprivileged_userns_clone: Some(1),
            apparmor_restrict: Some(0),
            max_user_namespaces: Some(1000),
            max_net_namespaces: Some(0),
            root: true,
        };
        let failure = Failure {
            stage: Stage::Network,
            what: check::UNSHARE_NET.to_string(),
            errno: Some(libc::ENOSPC),
        };
        let err = error_from_failure(failure.clone(), &switches);
        let text = err.to_string();
        assert!(
            matches!(err, SandboxError::NetworkNamespacesUnavailable { .. }),
            "{text}"
        );
        assert!(text.contains("user.max_net_namespaces=0"), "{text}");
        assert!(
            text.starts_with("network namespaces are unavailable"),
            "{text}"
        );

        let switches = check::HostSwitches {
            max_net_namespaces: Some(1000),
            ..switches
        };
        let no_kernel = Failure {
            errno: Some(libc::EINVAL),
            ..failure
        };
        let text = error_from_failure(no_kernel, &switches).to_string();
        assert!(text.contains("built without network namespaces"), "{text}");

        // The loopback step is a plain setup failure.
        let lo = Failure {
            stage: Stage::Network,
            what: "bring up lo".to_string(),
            errno: Some(libc::EPERM),
        };
        assert!(matches!(
            error_from_failure(lo, &switches),
            SandboxError::Setup { .. }
        ));
    }

    #[test]
    fn a_failed_cgroup_join_is_a_limits_error() {
        let failure = Failure {
            stage: Stage::Limits,
            what: "join the sandbox's cgroup (write to /x/cgroup.procs)".into(),
            errno: Some(libc::EACCES),
        };
        let err = error_from_failure(failure, &check::HostSwitches::default());
        assert!(matches!(err, SandboxError::Limits { .. }), "{err}");
        assert!(err.to_string().contains("/x/cgroup.procs"), "{err}");
    }

    #[test]
    fn exits_are_described() {
        use std::os::unix::process::ExitStatusExt;
        let exited = SandboxExit::from_status(Ok(ExitStatus::from_raw(3 << 8)), false);
        assert_eq!(exited, SandboxExit::Exited(3));
        let signaled = SandboxExit::from_status(Ok(ExitStatus::from_raw(libc::SIGSEGV)), false);
        assert_eq!(signaled.to_string(), "the agent was killed by SIGSEGV");
        let killed = SandboxExit::from_status(Ok(ExitStatus::from_raw(libc::SIGKILL)), true);
        assert_eq!(killed, SandboxExit::Killed);
    }
}
