//! Backends: what boots the machine the guest agent runs in.
//!
//! A backend turns a [`VmConfig`] into a [`Booted`] machine: a handle the
//! controller can wait on or kill, a future that yields the stream the agent
//! dialled (the agent link), and the way host paths are reached from the
//! agent's view (for session mounts and the SDK). Everything after the
//! agent's hello is backend-independent (see `crate::vm`, which builds on
//! this module; nothing here depends on it).
//!
//! Modules: [`sandbox`] (namespaces on the host), [`qemu`] and
//! [`kvm`] (the two VM backends) and what those two share, each imported
//! by both and never by one from the other: [`image`] (finding the guest
//! image), [`userland`] (which root disk the guest gets), [`guest`] (vsock
//! identity, agent dial, power-off, KVM suitability), [`console`] (the
//! guest console's lines and tail), [`sizing`] (memory and vCPUs),
//! [`snapstore`] (where boot snapshots are kept) and [`fsgrants`] (host
//! folders granted through the virtio-fs share).
//!
//! Errors: what crosses this seam is typed. [`boot`] fails with a
//! [`BootError`] (the backend's own error: [`SandboxError`],
//! [`qemu::QemuError`] or [`kvm::KvmError`], each saying what to do),
//! the agent's stream with a [`guest::AgentDialError`], a grant with a
//! [`GrantError`]; a machine's end is a [`MachineEnd`]. Their texts are
//! what the client reads in a failed `startVM` (or mount), so each names the
//! cause and, where there is one, the remedy; `source()` keeps the cause
//! for the log.
//!
//! Limits: one machine per [`boot`]; the VM backends are x86_64 only.

pub mod choice;
pub mod console;
pub mod fsgrants;
pub mod guest;
pub mod image;
pub mod kvm;
pub mod qemu;
pub mod sandbox;
pub mod sizing;
pub mod snapstore;
pub mod userland;

use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use guest_agent::proto::MountMode;
use tokio::net::UnixStream;

use crate::hostfs::HostEnv;
pub use fsgrants::GrantError;
use sandbox::{Sandbox, SandboxConfig, SandboxError, SandboxExit};

/// How long `startVM` waits for the agent's hello after the machine
/// started booting; the VM backends bound their own wait for the agent's
/// dial below it ([`guest::AGENT_DIAL_TIMEOUT`]).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(60);

/// File name of a profile's session disk (qemu and kvm backends), in the
/// profile directory; the name the official bundle uses.
pub const SESSION_DISK_FILE: &str = "sessiondata.img";

/// Which machine runs the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Linux namespaces on the host.
    Sandbox,
    /// A Linux guest under QEMU, reached over our vhost-user vsock device.
    Qemu,
    /// A Linux guest under our in-process VMM, reached over our in-process
    /// vsock device.
    Kvm,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sandbox => "sandbox",
            Self::Qemu => "qemu",
            Self::Kvm => "kvm",
        }
    }
}

/// Static facts a VM needs.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub backend: BackendKind,
    /// Per-profile state directory on the host.
    pub profile_dir: PathBuf,
    /// This executable, re-executed as sandbox init and agent.
    pub helper_exe: PathBuf,
    /// The daemon's egress proxy (shared by every profile): the only way
    /// out of a session, reached over vsock [`guest_agent::proto::EGRESS_PORT`]
    /// (VM backends) or a unix socket (sandbox).
    pub egress: crate::egress::EgressProxy,
    /// Processes the profile may run at once (the daemon's
    /// `--max-processes`; default [`crate::vm::MAX_PROCESSES`]).
    pub max_processes: usize,
    /// Agent requests that may await their answer at once (the daemon's
    /// `--max-pending-requests`; default
    /// [`crate::vm::MAX_PENDING_REQUESTS`]).
    pub max_pending_requests: usize,
}

impl VmConfig {
    /// Host directory holding the session directories (sandbox backend).
    pub fn sessions_dir(&self) -> PathBuf {
        self.profile_dir.join("sessions")
    }

    /// The session disk image (qemu and kvm backends): a sparse raw file
    /// the guest agent formats as ext4 and mounts at `/sessions`.
    pub fn session_disk(&self) -> PathBuf {
        self.profile_dir.join(SESSION_DISK_FILE)
    }

    /// Whether sessions live on a session disk (a VM backend) rather than
    /// in a host directory (sandbox).
    pub fn uses_session_disk(&self) -> bool {
        !matches!(self.backend, BackendKind::Sandbox)
    }
}

/// The agent link, once the agent has dialled in.
pub type AgentStream =
    Pin<Box<dyn Future<Output = Result<UnixStream, guest::AgentDialError>> + Send>>;

/// Why [`boot`] could not start a machine: the chosen backend's own error.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Qemu(#[from] qemu::QemuError),
    #[error(transparent)]
    Kvm(#[from] kvm::KvmError),
}

/// How host paths appear to the agent.
#[derive(Clone, Debug)]
pub enum HostPaths {
    /// Under this prefix (the sandbox binds the host root there for the agent only).
    Prefix(String),
    /// Granted one mount at a time through the VM's virtio-fs share, which
    /// enforces each mount's mode on the host (QEMU backend).
    Shared(fsgrants::SharedFolders),
}

impl HostPaths {
    /// Makes `host_rel` (relative to the host's `/`, already canonical)
    /// reachable for `session`'s mount `mount_name` in `mode`; returns the
    /// agent's path of it (the mount's source).
    pub fn grant(
        &self,
        session: &str,
        mount_name: &str,
        host_rel: &str,
        mode: MountMode,
    ) -> Result<String, GrantError> {
        match self {
            Self::Prefix(p) => Ok(format!("{}/{}", p.trim_end_matches('/'), host_rel)),
            Self::Shared(s) => s.grant(session, mount_name, host_rel, mode),
        }
    }

    /// Makes the SDK binary `host_rel` reachable read-only; returns the
    /// agent's path of the binary.
    pub fn grant_sdk(&self, host_rel: &str) -> Result<String, GrantError> {
        match self {
            Self::Prefix(p) => Ok(format!("{}/{}", p.trim_end_matches('/'), host_rel)),
            Self::Shared(s) => s.grant_sdk(host_rel),
        }
    }

    /// Drops what was granted for `session` (its directory was deleted).
    pub fn release_session(&self, session: &str) {
        match self {
            Self::Prefix(_) => {}
            Self::Shared(s) => {
                s.release_session(session);
            }
        }
    }
}

/// A running machine.
pub enum BackendMachine {
    Sandbox(Sandbox),
    Qemu(qemu::QemuMachine),
    Kvm(kvm::KvmMachine),
}

/// How a machine ended ([`BackendMachine::wait`]), by backend; its text is
/// what the log and a `startVM` that failed on it say.
#[derive(Clone, Debug)]
pub enum MachineEnd {
    Sandbox(SandboxExit),
    Qemu(qemu::QemuEnd),
    Kvm(kvm::KvmEnd),
}

impl fmt::Display for MachineEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sandbox(end) => end.fmt(f),
            Self::Qemu(end) => end.fmt(f),
            Self::Kvm(end) => end.fmt(f),
        }
    }
}

impl BackendMachine {
    /// Waits until the machine ends by itself; says how.
    pub async fn wait(&mut self) -> MachineEnd {
        match self {
            Self::Sandbox(s) => MachineEnd::Sandbox(s.wait().await),
            Self::Qemu(q) => MachineEnd::Qemu(q.wait().await),
            Self::Kvm(k) => MachineEnd::Kvm(k.wait().await),
        }
    }

    /// Ends the machine and reaps it; idempotent. A VM guest told to power
    /// off gets until `poweroff_by` to do so before it is killed; a sandbox
    /// is killed at once.
    pub async fn kill_by(&mut self, poweroff_by: std::time::Instant) {
        match self {
            Self::Sandbox(s) => s.kill().await,
            Self::Qemu(q) => q.kill_by(poweroff_by).await,
            Self::Kvm(k) => k.kill_by(poweroff_by).await,
        }
    }
}

/// A machine that has started booting.
pub struct Booted {
    pub machine: BackendMachine,
    pub agent: AgentStream,
    pub host_paths: HostPaths,
    /// The VM backends' userland plan, checked against the agent's hello.
    pub userland: Option<userland::UserlandPlan>,
}

/// What `startVM` asks of the machine beyond the profile's static config,
/// and the daemon's settings every machine gets (from its command line and
/// environment, read by [`crate::cli`] only: the daemon keeps one of these
/// with the request's fields unset and fills them in per `startVM`);
/// backends use what applies to them. [`Default`]: no request, the
/// settings' defaults, an empty [`HostEnv`].
#[derive(Clone, Debug, Default)]
pub struct BootOptions {
    /// `startVM.bundlePath`: a directory that may hold a guest image.
    pub bundle_path: Option<PathBuf>,
    /// Where the guest image and the default userland are looked for.
    pub images: image::ImageSearch,
    /// `startVM.memoryGB`.
    pub memory_gb: Option<f64>,
    /// `startVM.cpuCount`.
    pub cpu_count: Option<u32>,
    /// How the VM backends serve the shared folders (the daemon's
    /// `--fs-xattr`).
    pub fs: devices::fs::SessionFsOptions,
    /// Which userland the VM backends give the guest (the daemon's
    /// `--userland`).
    pub userland: userland::UserlandChoice,
    /// Seccomp filters of the threads handling guest data (the daemon's
    /// `--seccomp`): the kvm backend's VM threads, the qemu backend's
    /// vhost-user servers.
    pub seccomp: vmm::seccomp::Mode,
    /// How the kvm backend backs guest RAM (the daemon's `--guest-thp`:
    /// huge pages advised unless `off`).
    pub memory_backing: vmm::memory::Backing,
    /// The VM backends' boot snapshots (the daemon's `--snapshot` and
    /// `--snapshot-dir`; [`snapstore`], `kvm::warm`, `qemu::warm`).
    pub snapshot: snapstore::SnapshotOptions,
    /// The QEMU binary (the daemon's `--qemu`: a path, or a name looked up
    /// in `PATH`); none: [`qemu::DEFAULT_QEMU`].
    pub qemu: Option<PathBuf>,
    /// QEMU's accelerator as asked (the daemon's `--qemu-accel`: `kvm` or
    /// `tcg`, anything else fails `startVM`); none: KVM where `/dev/kvm`
    /// runs Linux, else TCG.
    pub qemu_accel: Option<String>,
    /// The guest agent's log filter under the VM backends (the daemon's
    /// `--guest-log`); none: the agent's default.
    pub guest_log: Option<String>,
    /// The helper's own log filter (`--log`): the sandbox's init and agent
    /// log with it; none: their default.
    pub log: Option<String>,
    /// Test hook [`guest::GUEST_ROOT_SESSION_ENV`]: this session's
    /// processes run as guest root (VM backends).
    pub guest_root_session: Option<String>,
    /// Test hook [`sandbox::AGENT_WRAPPER_ENV`]: an absolute host path of a
    /// program the sandbox runs in front of the agent.
    pub sandbox_agent_wrapper: Option<PathBuf>,
    /// Test hook [`sandbox::cgroup::DISABLE_ENV`]: the sandbox gets no
    /// cgroup (the rlimit stand-ins only).
    pub sandbox_cgroup_disabled: bool,
    /// The helper's `PATH`, runtime and temporary directories.
    pub host: HostEnv,
}

/// Boots `cfg.backend`.
pub async fn boot(cfg: &VmConfig, opts: &BootOptions) -> Result<Booted, BootError> {
    match cfg.backend {
        BackendKind::Sandbox => {
            // The guest-hostility tests' hook (see its docs): a program in
            // front of the agent, named by the helper's environment only.
            let command_override = opts
                .sandbox_agent_wrapper
                .as_ref()
                .filter(|p| p.is_absolute())
                .map(|wrapper| {
                    tracing::warn!(wrapper = %wrapper.display(), "test hook: the sandbox runs this program in front of the agent");
                    crate::backend::sandbox::wrapped_agent_command(wrapper, &cfg.helper_exe, true)
                });
            let sandbox_cfg = SandboxConfig {
                helper_exe: cfg.helper_exe.clone(),
                sessions_dir: cfg.sessions_dir(),
                agent_args: vec![],
                command_override,
                // Sessions' only way out: the daemon's proxy on the sandbox's
                // own unix socket, which ends with the sandbox.
                egress: Some(cfg.egress.clone()),
                // Bounded like a VM of the size the client asked for.
                limits: Some(crate::backend::sandbox::limits::Limits::for_request(
                    opts.memory_gb,
                    opts.cpu_count,
                )),
                cgroup_disabled: opts.sandbox_cgroup_disabled,
                log: opts.log.clone(),
                host: opts.host.clone(),
            };
            let (sandbox, stream) = Sandbox::start(sandbox_cfg).await?;
            let host_paths = HostPaths::Prefix(sandbox.agent_path_for_host(""));
            Ok(Booted {
                machine: BackendMachine::Sandbox(sandbox),
                agent: Box::pin(async move { Ok(stream) }),
                host_paths,
                userland: None,
            })
        }
        BackendKind::Qemu => Ok(qemu::boot(opts, &cfg.session_disk(), &cfg.egress).await?),
        BackendKind::Kvm => Ok(kvm::boot(opts, &cfg.session_disk(), &cfg.egress).await?),
    }
}
