//! Command line: `cowork-helper -socket PATH` serves the client; `doctor`,
//! `bench` and `vm run` are tools for people and CI.
//!
//! The client passes Go-style single-dash long flags (`-socket PATH`,
//! `-socket=PATH`); they are normalised to `--socket` before clap sees them.
//!
//! Each command shows only its own options: serving's (`--socket`,
//! `--data-dir`, ...) belong to the top level, `doctor` takes the two it
//! explains (`--backend`, `--userland`), `bench` and `vm run` take theirs.
//!
//! Settings: this is the one module of the helper that reads the
//! environment. Every flag's `COWORK_*` variable comes through clap's `env`;
//! the test hooks and the host's standard variables (`PATH`, the XDG
//! directories, the upstream proxy) are listed in [`ENV_ONLY`] and read by
//! [`Environment::read`]. [`Cli::settings`] turns both into
//! [`Settings`], which the daemon passes down as values (the machine's
//! part as [`BootOptions`]); docs/configuration.md has the table, kept in
//! step by a unit test.
//!
//! Serving ends on SIGTERM, SIGINT, or the client going away (its end of
//! our stdin closing, see [`crate::shutdown`]): the socket is removed, every
//! VM stopped (killed past [`crate::daemon::SHUTDOWN_BUDGET`]) and the
//! helper exits 0 within [`EXIT_LIMIT`].
//!
//! Limits: serving options given after a subcommand are refused, not ignored.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

pub use crate::backend::choice::{auto_backend, resolve_backend, BackendChoice};
use crate::backend::image::ImageSearch;
use crate::backend::userland::UserlandChoice;
use crate::backend::{BackendKind, BootOptions};
use crate::daemon::{Daemon, Settings};
use crate::hostfs::HostEnv;

/// Socket file name inside `$XDG_RUNTIME_DIR`, as the client expects it.
pub const SOCKET_NAME: &str = "claude-cowork-vm.sock";

/// How soon the helper has exited, at most, after the event that starts
/// its shutdown (SIGTERM, SIGINT, the client closing its stdin): the
/// client's next helper needs the socket and the VM's session disk.
pub const EXIT_LIMIT: Duration = Duration::from_secs(10);

/// How long the runtime gets to end its remaining tasks once the VMs are
/// stopped.
const RUNTIME_EXIT: Duration = Duration::from_millis(500);

const _: () = assert!(
    crate::daemon::SHUTDOWN_BUDGET.as_millis()
        + crate::daemon::KILL_GRACE.as_millis()
        + RUNTIME_EXIT.as_millis()
        < EXIT_LIMIT.as_millis(),
    "the shutdown's parts must fit in EXIT_LIMIT"
);

/// `--userland`, as typed (see [`crate::backend::userland`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum UserlandArg {
    /// A valid client bundle, else our default userland, else the initramfs.
    Auto,
    /// The client bundle's rootfs.img.
    Bundle,
    /// Our Debian userland (the guest image's rootfs.img).
    Default,
    /// The busybox initramfs only.
    Initramfs,
}

/// `--seccomp`, as typed (see [`vmm::seccomp`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SeccompArg {
    /// Filters on: calls outside a thread's table fail with EPERM.
    On,
    /// No filters (logged as a warning at start).
    Off,
    /// Filters that allow everything and have the kernel log what the
    /// table would refuse (dmesg); for finding a missing entry.
    Log,
}

impl From<SeccompArg> for vmm::seccomp::Mode {
    fn from(a: SeccompArg) -> Self {
        match a {
            SeccompArg::On => vmm::seccomp::Mode::On,
            SeccompArg::Off => vmm::seccomp::Mode::Off,
            SeccompArg::Log => vmm::seccomp::Mode::Log,
        }
    }
}

impl From<UserlandArg> for UserlandChoice {
    fn from(a: UserlandArg) -> Self {
        match a {
            UserlandArg::Auto => UserlandChoice::Auto,
            UserlandArg::Bundle => UserlandChoice::Bundle,
            UserlandArg::Default => UserlandChoice::Default,
            UserlandArg::Initramfs => UserlandChoice::Initramfs,
        }
    }
}

/// `help_heading` of the options only the VM backends use.
const VM_HEADING: &str = "VM backends (qemu, kvm)";

/// The command line. Every serving option also comes from its `COWORK_*`
/// variable (clap's `env`; a flag wins); [`ENV_ONLY`] lists the variables
/// read without a flag. The two make [`Settings`] ([`Cli::settings`]), the
/// one value the rest of the helper is configured by.
#[derive(Debug, Parser)]
#[command(
    name = "cowork-helper",
    version,
    about = "Sandbox VM helper for the Claude cowork desktop client"
)]
pub struct Cli {
    /// Unix socket to serve (default: $XDG_RUNTIME_DIR/claude-cowork-vm.sock).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Which backend runs the sessions.
    #[arg(long, env = "COWORK_BACKEND", value_enum, default_value = "auto")]
    pub backend: BackendChoice,
    /// Where per-profile state (session directories) lives
    /// (default: $XDG_DATA_HOME/cowork-helper).
    #[arg(long, env = "COWORK_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Stop a VM after this many seconds without any connected client (0 = never).
    #[arg(
        long,
        env = "COWORK_IDLE_TIMEOUT",
        default_value_t = crate::daemon::DEFAULT_IDLE_TIMEOUT.as_secs()
    )]
    pub idle_timeout: u64,
    /// The helper's log filter, in `tracing` syntax (`debug`,
    /// `info,cowork_helper::egress=debug`); one that does not parse means
    /// info. The sandbox's agent logs with it too. Default: info.
    #[arg(long = "log", env = LOG_ENV, value_name = "FILTER")]
    pub log: Option<String>,
    /// An API host whose TLS the egress proxy terminates to put the real
    /// credential in place of a session's placeholder (repeat for a
    /// gateway such as your ANTHROPIC_BASE_URL's host; the environment
    /// takes a comma-separated list). Default: api.anthropic.com.
    #[arg(
        long = "api-host",
        env = "COWORK_API_HOSTS",
        value_name = "HOST",
        value_delimiter = ',',
        default_values_t = crate::egress::intercept::DEFAULT_API_HOSTS.map(String::from),
        value_parser = parse_api_host
    )]
    pub api_hosts: Vec<String>,
    /// Let the VM read and set extended attributes (`user.*`, POSIX ACLs) on
    /// the shared folders. Off by default, as in virtiofsd: serving them
    /// costs the guest a round trip to the helper before the first write to
    /// every file (the kernel asks for `security.capability`).
    #[arg(long, env = "COWORK_FS_XATTR", help_heading = VM_HEADING)]
    pub fs_xattr: bool,
    /// Which userland sessions run in under the VM backends: `auto` prefers
    /// the client bundle's rootfs.img when it validates, then our Debian
    /// image's rootfs.img, then the busybox initramfs; the others force one
    /// (startVM fails when it is unusable).
    #[arg(
        long,
        env = "COWORK_USERLAND",
        value_enum,
        default_value = "auto",
        help_heading = VM_HEADING
    )]
    pub userland: UserlandArg,
    /// Seccomp filters on the threads that handle guest data (the kvm
    /// backend's vCPUs, VMM event loop and device workers, the qemu
    /// backend's vhost-user servers): each may make only the system calls
    /// its job needs. `off` disables them (with a
    /// warning), `log` only has the kernel log what they would refuse.
    #[arg(
        long,
        env = SECCOMP_ENV,
        value_enum,
        default_value = "on",
        help_heading = VM_HEADING
    )]
    pub seccomp: SeccompArg,
    /// The guest image directory (vmlinuz, initramfs, image-info); when
    /// given it must hold one, and nothing else is tried after startVM's
    /// bundlePath. Default: the installed or checkout's image.
    #[arg(
        long,
        env = crate::backend::image::IMAGE_DIR_ENV,
        value_name = "DIR",
        value_parser = path_or_empty(),
        help_heading = VM_HEADING
    )]
    pub guest_image_dir: Option<PathBuf>,
    /// The guest agent's log filter (one word of letters, digits and
    /// `_=,:.-`, at most 200 characters; anything else is ignored).
    /// Default: the agent's (info).
    #[arg(
        long,
        env = crate::backend::guest::GUEST_LOG_ENV,
        value_name = "FILTER",
        help_heading = VM_HEADING
    )]
    pub guest_log: Option<String>,
    /// `off` maps the kvm backend's guest RAM without the huge-page advice
    /// (anything else means on).
    #[arg(
        long,
        env = GUEST_THP_ENV,
        value_name = "on|off",
        default_value = "on",
        value_parser = parse_guest_thp,
        help_heading = VM_HEADING
    )]
    pub guest_thp: vmm::memory::Backing,
    /// VM backends (kvm, qemu): restore a boot snapshot of the machine
    /// instead of booting when there is one, and take one at the first cold
    /// boot (`auto`), or always boot cold (`off`).
    #[arg(
        long,
        env = SNAPSHOT_ENV,
        value_enum,
        default_value = "auto",
        help_heading = VM_HEADING
    )]
    pub snapshot: crate::backend::snapstore::SnapshotMode,
    /// Where the VM backends keep their boot snapshots (one directory per
    /// machine shape). Default: `snapshots` in the data directory.
    #[arg(
        long,
        env = SNAPSHOT_DIR_ENV,
        value_name = "DIR",
        value_parser = path_or_empty(),
        help_heading = VM_HEADING
    )]
    pub snapshot_dir: Option<PathBuf>,
    /// The QEMU binary: a path, or a name looked up in PATH.
    /// Default: qemu-system-x86_64.
    #[arg(
        long,
        env = crate::backend::qemu::QEMU_ENV,
        value_name = "PATH",
        value_parser = path_or_empty(),
        help_heading = VM_HEADING
    )]
    pub qemu: Option<PathBuf>,
    /// Force QEMU's accelerator, `kvm` or `tcg` (anything else fails
    /// startVM). Default: kvm where /dev/kvm can run Linux, else tcg.
    #[arg(
        long,
        env = crate::backend::qemu::ACCEL_ENV,
        value_name = "kvm|tcg",
        help_heading = VM_HEADING
    )]
    pub qemu_accel: Option<String>,
    /// Client connections served at once (a positive number, else the
    /// default; tests and unusual deployments).
    #[arg(
        long,
        env = crate::server::MAX_CONNECTIONS_ENV,
        value_name = "N",
        default_value_t = crate::server::MAX_CLIENT_CONNECTIONS,
        value_parser = cap_or(crate::server::MAX_CLIENT_CONNECTIONS),
        hide = true
    )]
    pub max_connections: usize,
    /// Processes per profile (a positive number, else the default; tests).
    #[arg(
        long,
        env = crate::vm::MAX_PROCESSES_ENV,
        value_name = "N",
        default_value_t = crate::vm::MAX_PROCESSES,
        value_parser = cap_or(crate::vm::MAX_PROCESSES),
        hide = true
    )]
    pub max_processes: usize,
    /// Agent requests awaiting an answer per VM (a positive number, else
    /// the default; tests).
    #[arg(
        long,
        env = crate::vm::MAX_PENDING_ENV,
        value_name = "N",
        default_value_t = crate::vm::MAX_PENDING_REQUESTS,
        value_parser = cap_or(crate::vm::MAX_PENDING_REQUESTS),
        hide = true
    )]
    pub max_pending_requests: usize,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Report which backends work on this machine and why, and what the
    /// desktop client needs before it starts this helper.
    Doctor(DoctorArgs),
    /// Make the desktop client start this helper: keep its official helper
    /// aside as cowork-linux-helper.official and link ours in its place
    /// (for clients not installed with our Debian package).
    Install(InstallArgs),
    /// Undo `install`: put the official helper back, exactly.
    Uninstall(InstallArgs),
    /// The guest userland.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Measure RPC latency, spawn latency and output throughput
    /// (`bench boot`: the guest's boot under the VM backends).
    Bench(BenchArgs),
    /// The in-process KVM machine.
    #[command(subcommand)]
    Vm(VmCommand),
}

/// `bench`'s options: without a subcommand, the sandbox benchmark.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Fewer iterations.
    #[arg(long)]
    pub quick: bool,
    #[command(subcommand)]
    pub what: Option<BenchCommand>,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Boot the guest image N times through startVM and report each boot
    /// phase's median and p90 (kvm, qemu, or both alternating).
    Boot(BenchBootArgs),
}

/// `bench boot`'s backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchBackend {
    /// kvm where this host's KVM runs Linux, else qemu.
    Auto,
    /// The in-process VMM.
    Kvm,
    /// QEMU.
    Qemu,
    /// Both, alternating run by run, with kvm/qemu ratios.
    Both,
}

/// `bench boot`'s start kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchStart {
    /// Every VM boots its kernel (the helpers run with --snapshot off).
    Cold,
    /// Every measured VM restores the boot snapshot an unmeasured first
    /// boot took (each series has its own snapshot directory).
    Warm,
    /// A cold and a warm series per backend, with warm/cold ratios.
    Both,
}

/// `bench boot`'s options (see [`crate::bench::boot`]).
#[derive(Debug, Args)]
pub struct BenchBootArgs {
    /// Which backend(s) to boot.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BenchBackend,
    /// Cold boots, warm starts (restored from a boot snapshot), or both as
    /// separate series.
    #[arg(long, value_enum, default_value = "cold")]
    pub start: BenchStart,
    /// Measured boots per series (backend and start kind).
    #[arg(short = 'n', long = "runs", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub runs: u32,
    /// Print the report as JSON on stdout (progress stays on stderr).
    #[arg(long)]
    pub json: bool,
    /// Write a stacked timeline of the median phases to this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub chart: Option<PathBuf>,
    /// The userland the helper boots (`default`: the Debian userland disk).
    #[arg(long, value_enum, default_value = "default")]
    pub userland: UserlandArg,
    /// startVM.memoryGB for every backend (their own defaults differ).
    #[arg(long, default_value_t = 1.0)]
    pub memory_gb: f64,
    /// startVM.cpuCount (default: the backends' common default).
    #[arg(long)]
    pub cpus: Option<u32>,
    /// Limit of each request (startVM, the first spawn, stopVM), seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Unmeasured boots per series first (the first formats the session
    /// disk, which later starts find ready; a warm series always has one,
    /// which takes its boot snapshot).
    #[arg(long, default_value_t = 1)]
    pub warmup: u32,
    /// The helper to start (default: this executable).
    #[arg(long)]
    pub helper: Option<PathBuf>,
    /// Keep each helper's directory and log.
    #[arg(long)]
    pub keep_logs: bool,
    /// COWORK_LOG of the helpers; must include info (`debug` adds the guest
    /// console to the kept logs).
    #[arg(long, default_value = crate::bench::boot::HELPER_LOG_FILTER)]
    pub helper_log: String,
    /// Boot nothing: report (table, --json, --chart) the document an
    /// earlier `bench boot --json` wrote to FILE.
    #[arg(long, value_name = "FILE.json")]
    pub replay: Option<PathBuf>,
}

impl BenchBootArgs {
    /// The benchmark's options.
    pub fn options(&self) -> crate::bench::boot::Options {
        use crate::bench::boot::{Backends, Starts};
        crate::bench::boot::Options {
            backends: match self.backend {
                BenchBackend::Auto => Backends::Auto,
                BenchBackend::Kvm => Backends::Kvm,
                BenchBackend::Qemu => Backends::Qemu,
                BenchBackend::Both => Backends::Both,
            },
            start: match self.start {
                BenchStart::Cold => Starts::Cold,
                BenchStart::Warm => Starts::Warm,
                BenchStart::Both => Starts::Both,
            },
            runs: self.runs as usize,
            json: self.json,
            chart: self.chart.clone(),
            helper: self.helper.clone(),
            keep_logs: self.keep_logs,
            memory_gb: self.memory_gb,
            cpus: self.cpus,
            userland: self
                .userland
                .to_possible_value()
                .map(|v| v.get_name().to_string())
                .unwrap_or_else(|| "default".into()),
            timeout: Duration::from_secs(self.timeout.max(1)),
            warmup: self.warmup as usize,
            helper_log: self.helper_log.clone(),
            replay: self.replay.clone(),
        }
    }
}

/// `doctor`'s options: the serving choices it explains. Unset, they are
/// the top level's (`cowork-helper --backend qemu doctor` still works),
/// which fall back to `$COWORK_BACKEND` / `$COWORK_USERLAND` and `auto`.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// The backend to explain (default: the top-level --backend, else
    /// $COWORK_BACKEND, else auto).
    #[arg(long, value_enum)]
    pub backend: Option<BackendChoice>,
    /// The userland to explain (default: the top-level --userland, else
    /// $COWORK_USERLAND, else auto).
    #[arg(long, value_enum)]
    pub userland: Option<UserlandArg>,
    /// The client's resources directory, holding its cowork-linux-helper
    /// (default: /usr/lib/claude-desktop/resources).
    #[arg(long, value_name = "DIR")]
    pub client_dir: Option<PathBuf>,
    /// The client's VM bundle directory (default:
    /// ~/.config/Claude/vm_bundles/claudevm.bundle).
    #[arg(long, value_name = "DIR")]
    pub bundle: Option<PathBuf>,
}

/// `install`'s and `uninstall`'s options.
#[derive(Debug, Args)]
pub struct InstallArgs {
    /// The client's resources directory, holding its cowork-linux-helper.
    #[arg(long, value_name = "DIR", default_value = crate::install::CLIENT_DIR)]
    pub client_dir: PathBuf,
    /// Work on the system under DIR (an image, a chroot): every path is
    /// taken under it and nothing is reloaded.
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub root: PathBuf,
    /// Leave the udev rule, the modules-load entry and the AppArmor profile
    /// alone.
    #[arg(long)]
    pub no_system_files: bool,
}

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Build our Debian userland (rootfs.img) for machines without the
    /// client's bundle: mmdebstrap from the Debian archive, into
    /// /var/lib/cowork-helper/userland as root, else the data directory's userland/.
    Build(ImageBuildArgs),
}

/// `image build`'s options (see [`crate::image_build`]).
#[derive(Debug, Args)]
pub struct ImageBuildArgs {
    /// Where to put rootfs.img (default: /var/lib/cowork-helper/userland as
    /// root, else the data directory's userland/).
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,
    /// Build cache (default: /var/cache/cowork-helper as root, else
    /// $XDG_CACHE_HOME/cowork-helper).
    #[arg(
        long,
        env = crate::image_build::CACHE_ENV,
        value_name = "DIR",
        value_parser = path_or_empty()
    )]
    pub cache: Option<PathBuf>,
    /// Debian archive to install from (default: the host's apt sources'
    /// Debian archive).
    #[arg(long, value_name = "URI")]
    pub mirror: Option<String>,
    /// Build again even when the cache has the image.
    #[arg(long)]
    pub refresh: bool,
}

impl ImageBuildArgs {
    /// The build's options, with the data directory `data_dir` and the
    /// host's variables `host`.
    pub fn options(
        &self,
        data_dir: &std::path::Path,
        host: &HostEnv,
    ) -> crate::image_build::Options {
        crate::image_build::Options::new(
            self.output.clone(),
            self.cache.clone(),
            self.mirror.clone(),
            self.refresh,
            data_dir,
            host,
        )
    }
}

impl DoctorArgs {
    /// The choices to explain: these options, else the top level's.
    pub fn choices(&self, cli: &Cli) -> (BackendChoice, UserlandArg) {
        (
            self.backend.unwrap_or(cli.backend),
            self.userland.unwrap_or(cli.userland),
        )
    }
}

#[derive(Debug, Subcommand)]
pub enum VmCommand {
    /// Boot a kernel on /dev/kvm; the serial console goes to stdout, a boot
    /// timeline to stderr. Exits 0 when the guest resets or powers off.
    Run {
        /// Kernel image: ELF vmlinux (PVH or 64-bit entry) or bzImage.
        #[arg(long)]
        kernel: PathBuf,
        /// Initramfs to load.
        #[arg(long)]
        initrd: Option<PathBuf>,
        /// Kernel command line (default: a serial console and reboot=k).
        #[arg(long)]
        cmdline: Option<String>,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 256)]
        mem: u64,
        /// Number of vCPUs.
        #[arg(long, default_value_t = 1)]
        cpus: u8,
        /// Boot a Linux kernel even where this KVM is known not to run Linux.
        #[arg(long)]
        force: bool,
    },
}

// ------------------------------------------------------------ the settings

/// Environment variable of `--log`: the helper's log filter.
pub const LOG_ENV: &str = "COWORK_LOG";
/// Environment variable of `--seccomp`.
pub const SECCOMP_ENV: &str = "COWORK_SECCOMP";
/// Environment variable of `--guest-thp`.
pub const GUEST_THP_ENV: &str = "COWORK_GUEST_THP";
/// Environment variable of `--snapshot`.
pub const SNAPSHOT_ENV: &str = "COWORK_SNAPSHOT";
/// Environment variable of `--snapshot-dir`.
pub const SNAPSHOT_DIR_ENV: &str = "COWORK_SNAPSHOT_DIR";
/// The VM backends' snapshots' directory under the data directory.
pub const SNAPSHOTS_DIR: &str = "snapshots";

/// An environment variable the helper reads without a flag: a test hook
/// or one of the host's standard variables (see [`ENV_ONLY`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnvOnly {
    /// The variable.
    pub name: &'static str,
    /// The setting its value becomes (who reads it, through [`Settings`]).
    pub reader: &'static str,
    /// What it is for.
    pub purpose: &'static str,
}

/// Every environment variable the helper reads besides those of its flags
/// (clap's `env`, see [`Cli`]): [`Environment::read`] reads these and no
/// other, and docs/configuration.md documents each (a unit test checks
/// both lists against its tables). Test hooks have no flag, so `--help`
/// never shows them; the client cannot set any of them.
pub const ENV_ONLY: &[EnvOnly] = &[
    EnvOnly {
        name: crate::backend::guest::GUEST_ROOT_SESSION_ENV,
        reader: "BootOptions::guest_root_session (backend::guest, the VM's kernel command line)",
        purpose: "test hook: this session's processes run as guest root",
    },
    EnvOnly {
        name: crate::backend::sandbox::AGENT_WRAPPER_ENV,
        reader: "BootOptions::sandbox_agent_wrapper (backend::boot)",
        purpose: "test hook: a program the sandbox runs in front of the agent",
    },
    EnvOnly {
        name: crate::backend::sandbox::cgroup::DISABLE_ENV,
        reader: "BootOptions::sandbox_cgroup_disabled (backend::sandbox, doctor)",
        purpose: "test hook: the sandbox gets no cgroup (the rlimit stand-ins)",
    },
    EnvOnly {
        name: "PATH",
        reader: "HostEnv::path (QEMU, systemd-run, mmdebstrap, doctor's checks)",
        purpose: "where programs named without a directory are found",
    },
    EnvOnly {
        name: "XDG_RUNTIME_DIR",
        reader: "HostEnv::runtime_dir (the default socket, VM run directories, the systemd user manager)",
        purpose: "the user's runtime directory",
    },
    EnvOnly {
        name: "TMPDIR",
        reader: "HostEnv::temp_dir (VM run directories when the runtime directory does not fit, image build)",
        purpose: "the temporary directory (default /tmp)",
    },
    EnvOnly {
        name: "HOME",
        reader: "HostEnv::home (the default data directory, image build's cache, doctor's client bundle)",
        purpose: "the user's home",
    },
    EnvOnly {
        name: "XDG_DATA_HOME",
        reader: "HostEnv::data_home (the default data directory)",
        purpose: "the user's data directory",
    },
    EnvOnly {
        name: "XDG_CACHE_HOME",
        reader: "HostEnv::cache_home (image build's default cache)",
        purpose: "the user's cache directory",
    },
    EnvOnly {
        name: "XDG_CONFIG_HOME",
        reader: "HostEnv::config_home (doctor: the client's bundle)",
        purpose: "the user's configuration directory",
    },
    EnvOnly {
        name: "https_proxy",
        reader: "Settings::https_proxy (egress::EgressDialer)",
        purpose: "an upstream proxy the egress proxy dials through",
    },
    EnvOnly {
        name: "HTTPS_PROXY",
        reader: "Settings::https_proxy, when https_proxy is unset or empty",
        purpose: "as https_proxy",
    },
    EnvOnly {
        name: "no_proxy",
        reader: "Settings::no_proxy (egress::EgressDialer)",
        purpose: "what bypasses the upstream proxy",
    },
    EnvOnly {
        name: "NO_PROXY",
        reader: "Settings::no_proxy, when no_proxy is unset or empty",
        purpose: "as no_proxy",
    },
];

/// `name`'s value, even empty, which must be one of [`ENV_ONLY`].
fn env_only_raw(name: &str) -> Option<std::ffi::OsString> {
    debug_assert!(
        ENV_ONLY.iter().any(|v| v.name == name),
        "{name} is read but not listed in ENV_ONLY"
    );
    std::env::var_os(name)
}

/// `name`'s value, which must be one of [`ENV_ONLY`]; empty counts as
/// unset.
fn env_only(name: &str) -> Option<std::ffi::OsString> {
    env_only_raw(name).filter(|v| !v.is_empty())
}

/// What the variables of [`ENV_ONLY`] say: read once by
/// [`Environment::read`], made by hand in tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Environment {
    /// `PATH`, the XDG directories, `HOME`, `TMPDIR`.
    pub host: HostEnv,
    /// `https_proxy`, else `HTTPS_PROXY`.
    pub https_proxy: Option<String>,
    /// `no_proxy`, else `NO_PROXY`.
    pub no_proxy: Option<String>,
    /// [`crate::backend::guest::GUEST_ROOT_SESSION_ENV`].
    pub guest_root_session: Option<String>,
    /// [`crate::backend::sandbox::AGENT_WRAPPER_ENV`], when an absolute path.
    pub sandbox_agent_wrapper: Option<PathBuf>,
    /// [`crate::backend::sandbox::cgroup::DISABLE_ENV`] is set (to anything).
    pub sandbox_cgroup_disabled: bool,
}

impl Environment {
    /// Reads this process's environment (the variables of [`ENV_ONLY`]).
    pub fn read() -> Environment {
        let path = |name| env_only(name).map(PathBuf::from);
        let text = |name| env_only(name).and_then(|v| v.into_string().ok());
        Environment {
            host: HostEnv {
                // Unset and empty are the same to a PATH search.
                path: env_only("PATH").unwrap_or_default(),
                runtime_dir: path("XDG_RUNTIME_DIR"),
                temp_dir: path("TMPDIR")
                    .unwrap_or_else(|| PathBuf::from(crate::hostfs::DEFAULT_TEMP_DIR)),
                home: path("HOME"),
                data_home: path("XDG_DATA_HOME"),
                cache_home: path("XDG_CACHE_HOME"),
                config_home: path("XDG_CONFIG_HOME"),
            },
            https_proxy: text("https_proxy").or_else(|| text("HTTPS_PROXY")),
            no_proxy: text("no_proxy").or_else(|| text("NO_PROXY")),
            guest_root_session: text(crate::backend::guest::GUEST_ROOT_SESSION_ENV),
            sandbox_agent_wrapper: path(crate::backend::sandbox::AGENT_WRAPPER_ENV)
                .filter(|p| p.is_absolute()),
            // Set at all, even empty, as the hook always meant.
            sandbox_cgroup_disabled: env_only_raw(crate::backend::sandbox::cgroup::DISABLE_ENV)
                .is_some(),
        }
    }
}

/// A cap's parser: a positive number, else (zero, not a number) `default`,
/// as the variables always were read.
fn cap_or(
    default: usize,
) -> impl Fn(&str) -> Result<usize, std::convert::Infallible> + Clone + Send + Sync + 'static {
    move |text| {
        Ok(text
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .unwrap_or(default))
    }
}

/// A path whose variable may be set empty, which means unset (clap's
/// own path parser refuses an empty value); any bytes, as the variables
/// always were read.
fn path_or_empty() -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    use clap::builder::TypedValueParser;
    clap::builder::OsStringValueParser::new().map(PathBuf::from)
}

/// `--guest-thp`: `off` (any case) maps guest RAM without the huge-page
/// advice; anything else keeps it, as the variable always was read.
fn parse_guest_thp(text: &str) -> Result<vmm::memory::Backing, std::convert::Infallible> {
    Ok(if text.trim().eq_ignore_ascii_case("off") {
        vmm::memory::Backing::AnonymousBasePages
    } else {
        vmm::memory::Backing::Anonymous
    })
}

impl Cli {
    /// `--data-dir`, else the default (`$XDG_DATA_HOME/cowork-helper`,
    /// `~/.local/share/cowork-helper`, `/var/tmp/cowork-helper`), made
    /// absolute (the sandbox binds it into the guest).
    pub fn data_dir_or_default(&self, env: &Environment) -> PathBuf {
        let data_dir = self
            .data_dir
            .clone()
            .unwrap_or_else(|| default_data_dir(&env.host));
        if data_dir.is_absolute() {
            return data_dir;
        }
        std::env::current_dir()
            .map(|d| d.join(&data_dir))
            .unwrap_or(data_dir)
    }

    /// Where this process looks for the guest image and the userland.
    pub fn image_search(&self, env: &Environment) -> ImageSearch {
        ImageSearch::new(
            self.guest_image_dir.clone(),
            std::env::current_exe().ok(),
            Some(self.data_dir_or_default(env)),
        )
    }

    /// What every VM's machine gets, before `startVM` fills in its own
    /// fields: these options and `env`'s.
    pub fn machine(&self, env: &Environment) -> BootOptions {
        BootOptions {
            images: self.image_search(env),
            fs: devices::fs::SessionFsOptions {
                xattr: self.fs_xattr,
                ..Default::default()
            },
            userland: self.userland.into(),
            seccomp: self.seccomp.into(),
            memory_backing: self.guest_thp,
            snapshot: crate::backend::snapstore::SnapshotOptions {
                mode: self.snapshot,
                dir: Some(
                    self.snapshot_dir
                        .clone()
                        .filter(|d| !d.as_os_str().is_empty())
                        .unwrap_or_else(|| self.data_dir_or_default(env).join(SNAPSHOTS_DIR)),
                ),
            },
            qemu: self.qemu.clone().filter(|q| !q.as_os_str().is_empty()),
            qemu_accel: self.qemu_accel.clone(),
            guest_log: self.guest_log.clone(),
            log: self.log.clone(),
            guest_root_session: env.guest_root_session.clone(),
            sandbox_agent_wrapper: env.sandbox_agent_wrapper.clone(),
            sandbox_cgroup_disabled: env.sandbox_cgroup_disabled,
            host: env.host.clone(),
            ..BootOptions::default()
        }
    }

    /// The daemon's settings: these options and `env`'s, serving with
    /// `backend` from the executable `helper_exe`.
    pub fn settings(
        &self,
        env: &Environment,
        backend: BackendKind,
        helper_exe: PathBuf,
    ) -> Settings {
        Settings {
            data_dir: self.data_dir_or_default(env),
            backend,
            helper_exe,
            idle_timeout: (self.idle_timeout > 0).then(|| Duration::from_secs(self.idle_timeout)),
            max_connections: self.max_connections,
            max_processes: self.max_processes,
            max_pending_requests: self.max_pending_requests,
            api_hosts: self.api_hosts.clone(),
            https_proxy: env.https_proxy.clone(),
            no_proxy: env.no_proxy.clone(),
            machine: self.machine(env),
        }
    }
}

/// `install` (`true`) or `uninstall`: prints what was done, or the one
/// line saying why nothing was.
fn install_command(a: &InstallArgs, install: bool) -> i32 {
    use crate::install::{self, system::SystemFiles, Target};
    let verb = if install { "install" } else { "uninstall" };
    let exe = match std::env::current_exe().and_then(std::fs::canonicalize) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("cowork-helper {verb}: {}", install::InstallError::OwnExe(e));
            return 1;
        }
    };
    let target = Target::new(&a.root, Some(&a.client_dir), exe);
    let files = SystemFiles {
        write: !a.no_system_files,
    };
    let result = if install {
        install::install(&target, &files)
    } else {
        install::uninstall(&target, &files)
    };
    match result {
        Ok(report) => {
            for line in report.lines {
                println!("{line}");
            }
            0
        }
        Err(e) => {
            eprintln!("cowork-helper {verb}: {e}");
            1
        }
    }
}

/// An `--api-host` value: a DNS name (no port, no address), lower-cased.
fn parse_api_host(text: &str) -> Result<String, String> {
    match crate::egress::Host::parse(text.trim()) {
        Ok(crate::egress::Host::Name(n)) if n.contains('.') => Ok(n),
        _ => Err(format!(
            "{text:?} is not a host name (like api.anthropic.com; no port, no address)"
        )),
    }
}

/// Rewrites `-socket X` / `-socket=X` to their double-dash forms.
pub fn normalize_args(args: Vec<String>) -> Vec<String> {
    args.into_iter()
        .enumerate()
        .map(|(i, a)| {
            if i > 0 && (a == "-socket" || a.starts_with("-socket=")) {
                format!("-{a}")
            } else {
                a
            }
        })
        .collect()
}

/// `$XDG_RUNTIME_DIR/claude-cowork-vm.sock`, the client's socket.
fn default_socket(host: &HostEnv) -> Result<PathBuf, String> {
    match &host.runtime_dir {
        Some(dir) => Ok(dir.join(SOCKET_NAME)),
        None => Err("no -socket given and XDG_RUNTIME_DIR is not set".into()),
    }
}

/// The data directory when `--data-dir` is not given.
fn default_data_dir(host: &HostEnv) -> PathBuf {
    host.data_dir()
        .map(|d| d.join("cowork-helper"))
        .unwrap_or_else(|| PathBuf::from("/var/tmp/cowork-helper"))
}

/// Entry point; returns the process exit code.
pub fn main(args: Vec<String>) -> i32 {
    let cli = match Cli::try_parse_from(normalize_args(args)) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    // The environment-only variables, read once, here (see ENV_ONLY).
    let env = Environment::read();
    match cli.command {
        Some(Command::Bench(BenchArgs {
            what: Some(BenchCommand::Boot(ref b)),
            ..
        })) => crate::bench::boot::main(b.options()),
        Some(Command::Bench(BenchArgs { quick, what: None })) => {
            let mut a = vec!["bench".to_string()];
            if quick {
                a.push("--quick".into());
            }
            crate::bench::main_with_args(a)
        }
        Some(Command::Doctor(ref d)) => {
            let (backend, userland) = d.choices(&cli);
            crate::doctor::run(&crate::doctor::Options {
                backend,
                machine: BootOptions {
                    userland: userland.into(),
                    ..cli.machine(&env)
                },
                client_dir: d
                    .client_dir
                    .clone()
                    .unwrap_or_else(|| crate::install::CLIENT_DIR.into()),
                bundle: d.bundle.clone(),
            })
        }
        Some(Command::Install(ref a)) => install_command(a, true),
        Some(Command::Uninstall(ref a)) => install_command(a, false),
        Some(Command::Image(ImageCommand::Build(ref b))) => {
            crate::image_build::main(&b.options(&cli.data_dir_or_default(&env), &env.host))
        }
        Some(Command::Vm(VmCommand::Run {
            kernel,
            initrd,
            cmdline,
            mem,
            cpus,
            force,
        })) => {
            crate::logging::init(cli.log.as_deref());
            vmm::cli::vm_run(vmm::cli::VmRunArgs {
                kernel,
                initrd,
                cmdline,
                mem_mib: mem,
                cpus,
                allow_unsuitable_kvm: force,
                memory_backing: cli.guest_thp,
                seccomp: cli.seccomp.into(),
            })
        }
        None => serve(cli, &env),
    }
}

fn serve(cli: Cli, env: &Environment) -> i32 {
    crate::logging::init(cli.log.as_deref());
    let socket = match cli
        .socket
        .clone()
        .map(Ok)
        .unwrap_or_else(|| default_socket(&env.host))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cowork-helper: {e}");
            return 2;
        }
    };
    let helper_exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("cowork-helper: cannot locate own executable: {e}");
            return 1;
        }
    };
    let machine = cli.machine(env);
    let (backend, why) = resolve_backend(cli.backend, &machine);
    let settings = cli.settings(env, backend, helper_exe);
    match settings.machine.seccomp {
        vmm::seccomp::Mode::On => {}
        vmm::seccomp::Mode::Off => tracing::warn!(
            "seccomp filters are OFF (--seccomp=off / {SECCOMP_ENV}=off): a guest that takes over a vCPU or device thread can make any system call this helper can"
        ),
        vmm::seccomp::Mode::Log => tracing::warn!(
            "seccomp filters only LOG (--seccomp=log): calls the tables would refuse are allowed and logged by the kernel (dmesg); use it to report a missing entry, not for everyday use"
        ),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(16)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cowork-helper: cannot start the async runtime: {e}");
            return 1;
        }
    };
    let code = runtime.block_on(async move {
        // Armed first: a SIGTERM that arrives while binding is handled too.
        let shutdown = match crate::shutdown::Shutdown::arm() {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("{e}");
                eprintln!("cowork-helper: {e}");
                return 1;
            }
        };
        let listener = match crate::server::bind(&socket).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("{e}");
                eprintln!("cowork-helper: {e}");
                return 1;
            }
        };
        tracing::info!(
            socket = %socket.display(),
            backend = backend.as_str(),
            reason = why,
            data_dir = %settings.data_dir.display(),
            api_hosts = %settings.api_hosts.join(","),
            version = env!("CARGO_PKG_VERSION"),
            "listening"
        );
        let daemon = Daemon::new(settings);
        let trigger = crate::server::serve(&listener, daemon.clone(), shutdown.requested()).await;
        let began = std::time::Instant::now();
        tracing::info!("{trigger}; shutting down");
        // The socket goes first, while it is surely still ours: nothing new
        // connects to a helper that is going away, and the next helper can
        // bind at once.
        let _ = std::fs::remove_file(&socket);
        drop(listener);
        daemon.shut_down().await;
        tracing::info!(ms = began.elapsed().as_millis() as u64, "bye");
        0
    });
    // Tasks still running (connections, a VM abandoned at the deadline)
    // must not hold up the exit.
    runtime.shutdown_timeout(RUNTIME_EXIT);
    code
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn api_hosts_default_to_anthropics_and_take_names_only() {
        if std::env::var_os("COWORK_API_HOSTS").is_none() {
            let cli = Cli::try_parse_from(["h", "--socket", "/x"]).unwrap();
            assert_eq!(cli.api_hosts, ["api.anthropic.com"]);
        }
        let cli = Cli::try_parse_from([
            "h",
            "--api-host",
            "api.anthropic.com",
            "--api-host",
            "LLM.Corp.Example.",
        ])
        .unwrap();
        assert_eq!(cli.api_hosts, ["api.anthropic.com", "llm.corp.example"]);
        for bad in ["10.0.0.1", "gateway:8443", "localhost", "a b"] {
            assert!(
                Cli::try_parse_from(["h", "--api-host", bad]).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn go_style_socket_flags() {
        let a = |v: &[&str]| normalize_args(v.iter().map(|s| s.to_string()).collect());
        assert_eq!(a(&["h", "-socket", "/x"]), ["h", "--socket", "/x"]);
        assert_eq!(a(&["h", "-socket=/x"]), ["h", "--socket=/x"]);
        assert_eq!(a(&["h", "--socket", "/x"]), ["h", "--socket", "/x"]);
        let cli = Cli::try_parse_from(a(&["h", "-socket=/x/y.sock"])).unwrap();
        assert_eq!(
            cli.socket.as_deref(),
            Some(std::path::Path::new("/x/y.sock"))
        );
    }

    #[test]
    fn shared_folder_xattrs_are_opt_in() {
        if std::env::var_os("COWORK_FS_XATTR").is_none() {
            let cli = Cli::try_parse_from(["h", "--socket", "/x"]).unwrap();
            assert!(!cli.fs_xattr);
        }
        let cli = Cli::try_parse_from(["h", "--socket", "/x", "--fs-xattr"]).unwrap();
        assert!(cli.fs_xattr);
        let settings = cli.settings(&Environment::default(), BackendKind::Qemu, "/h".into());
        assert!(settings.machine.fs.xattr);
    }

    #[test]
    fn seccomp_is_on_unless_turned_off() {
        if std::env::var_os(SECCOMP_ENV).is_none() {
            let cli = Cli::try_parse_from(["h", "--socket", "/x"]).unwrap();
            assert_eq!(
                vmm::seccomp::Mode::from(cli.seccomp),
                vmm::seccomp::Mode::On
            );
        }
        for (word, mode) in [
            ("off", vmm::seccomp::Mode::Off),
            ("on", vmm::seccomp::Mode::On),
            ("log", vmm::seccomp::Mode::Log),
        ] {
            let flag = format!("--seccomp={word}");
            let cli = Cli::try_parse_from(["h", "--socket", "/x", &flag]).unwrap();
            assert_eq!(vmm::seccomp::Mode::from(cli.seccomp), mode);
        }
        assert!(Cli::try_parse_from(["h", "--seccomp=maybe"]).is_err());
        // The doctor line installs every class's filter for real.
        use crate::doctor::seccomp_line;
        assert!(seccomp_line(vmm::seccomp::Mode::On).contains("accepts them"));
        assert!(seccomp_line(vmm::seccomp::Mode::Off).starts_with("off"));
    }

    #[test]
    fn userland_is_auto_unless_forced() {
        if std::env::var_os("COWORK_USERLAND").is_none() {
            let cli = Cli::try_parse_from(["h", "--socket", "/x"]).unwrap();
            assert_eq!(UserlandChoice::from(cli.userland), UserlandChoice::Auto);
        }
        for (word, choice) in [
            ("bundle", UserlandChoice::Bundle),
            ("default", UserlandChoice::Default),
            ("initramfs", UserlandChoice::Initramfs),
        ] {
            let cli = Cli::try_parse_from(["h", "--userland", word]).unwrap();
            assert_eq!(UserlandChoice::from(cli.userland), choice);
        }
        assert!(Cli::try_parse_from(["h", "--userland", "ubuntu"]).is_err());
    }

    /// The help text of `args` (the last one being `--help`).
    fn help(args: &[&str]) -> String {
        let e = Cli::try_parse_from(args).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp, "{e}");
        e.render().to_string()
    }

    #[test]
    fn each_command_shows_only_its_own_options() {
        let top = help(&["h", "--help"]);
        for serving in ["--socket", "--backend", "--data-dir", "--idle-timeout"] {
            assert!(top.contains(serving), "{serving} missing:\n{top}");
        }
        for sub in [&["h", "vm", "run", "--help"][..], &["h", "bench", "--help"]] {
            let text = help(sub);
            for serving in ["--socket", "--backend", "--data-dir", "--userland"] {
                assert!(!text.contains(serving), "{sub:?} lists {serving}:\n{text}");
            }
        }
        assert!(help(&["h", "vm", "run", "--help"]).contains("--kernel"));
        assert!(help(&["h", "bench", "--help"]).contains("--quick"));
        let doctor = help(&["h", "doctor", "--help"]);
        assert!(doctor.contains("--backend") && doctor.contains("--userland"));
        assert!(!doctor.contains("--socket") && !doctor.contains("--data-dir"));
        // Serving options after a subcommand are refused, not ignored.
        assert!(
            Cli::try_parse_from(["h", "vm", "run", "--kernel", "k", "--socket", "/x"]).is_err()
        );
        assert!(Cli::try_parse_from(["h", "bench", "--data-dir", "/d"]).is_err());
    }

    #[test]
    fn bench_boot_takes_its_start_kinds() {
        use crate::bench::boot::{Backends, Starts};
        let parse = |v: &[&str]| {
            let cli = Cli::try_parse_from(v).unwrap();
            match cli.command {
                Some(Command::Bench(BenchArgs {
                    what: Some(BenchCommand::Boot(b)),
                    ..
                })) => b.options(),
                other => panic!("not bench boot: {other:?}"),
            }
        };
        // Cold by default: what `bench boot` measured before warm starts.
        let o = parse(&["h", "bench", "boot"]);
        assert_eq!((o.start, o.backends), (Starts::Cold, Backends::Auto));
        for (word, want) in [
            ("cold", Starts::Cold),
            ("warm", Starts::Warm),
            ("both", Starts::Both),
        ] {
            let o = parse(&["h", "bench", "boot", "--backend", "kvm", "--start", word]);
            assert_eq!((o.start, o.backends), (want, Backends::Kvm));
        }
        assert!(Cli::try_parse_from(["h", "bench", "boot", "--start", "hot"]).is_err());
        assert!(help(&["h", "bench", "boot", "--help"]).contains("--start"));
    }

    #[test]
    fn doctor_takes_its_choices_or_the_serving_ones() {
        let parse = |v: &[&str]| {
            let cli = Cli::try_parse_from(v).unwrap();
            match &cli.command {
                Some(Command::Doctor(d)) => d.choices(&cli),
                other => panic!("not doctor: {other:?}"),
            }
        };
        assert_eq!(
            parse(&[
                "h",
                "doctor",
                "--backend",
                "qemu",
                "--userland",
                "initramfs"
            ]),
            (BackendChoice::Qemu, UserlandArg::Initramfs)
        );
        assert_eq!(
            parse(&["h", "--backend", "kvm", "doctor"]).0,
            BackendChoice::Kvm
        );
        assert_eq!(
            parse(&["h", "--backend", "kvm", "doctor", "--backend", "sandbox"]).0,
            BackendChoice::Sandbox
        );
    }

    #[test]
    fn every_option_reaches_the_settings() {
        let cli = Cli::try_parse_from([
            "h",
            "--data-dir=/d",
            "--idle-timeout=0",
            "--log=debug",
            "--api-host=llm.corp.example",
            "--fs-xattr",
            "--userland=initramfs",
            "--seccomp=log",
            "--guest-image-dir=/img",
            "--guest-log=info,guest_agent=debug",
            "--guest-thp=off",
            "--qemu=/opt/qemu",
            "--qemu-accel=tcg",
            "--max-connections=3",
            "--max-processes=4",
            "--max-pending-requests=5",
        ])
        .unwrap();
        let env = Environment {
            host: HostEnv {
                path: "/bin".into(),
                runtime_dir: Some("/run/user/1".into()),
                ..HostEnv::default()
            },
            https_proxy: Some("http://proxy.example:3128".into()),
            no_proxy: Some("localhost".into()),
            guest_root_session: Some("s1".into()),
            sandbox_agent_wrapper: Some("/w".into()),
            sandbox_cgroup_disabled: true,
        };
        let s = cli.settings(&env, BackendKind::Kvm, "/h".into());
        assert_eq!(s.data_dir, PathBuf::from("/d"));
        assert_eq!(s.idle_timeout, None);
        assert_eq!(
            (s.max_connections, s.max_processes, s.max_pending_requests),
            (3, 4, 5)
        );
        assert_eq!(s.api_hosts, ["llm.corp.example"]);
        assert_eq!(s.https_proxy.as_deref(), Some("http://proxy.example:3128"));
        assert_eq!(s.no_proxy.as_deref(), Some("localhost"));
        let m = &s.machine;
        assert!(m.fs.xattr);
        assert_eq!(m.userland, UserlandChoice::Initramfs);
        assert_eq!(m.seccomp, vmm::seccomp::Mode::Log);
        assert_eq!(m.images.env_dir.as_deref(), Some(Path::new("/img")));
        assert_eq!(m.images.data_dir.as_deref(), Some(Path::new("/d")));
        assert_eq!(m.guest_log.as_deref(), Some("info,guest_agent=debug"));
        assert_eq!(m.log.as_deref(), Some("debug"));
        assert_eq!(m.memory_backing, vmm::memory::Backing::AnonymousBasePages);
        assert_eq!(m.qemu.as_deref(), Some(Path::new("/opt/qemu")));
        assert_eq!(m.qemu_accel.as_deref(), Some("tcg"));
        assert_eq!(m.guest_root_session.as_deref(), Some("s1"));
        assert_eq!(m.sandbox_agent_wrapper.as_deref(), Some(Path::new("/w")));
        assert!(m.sandbox_cgroup_disabled);
        assert_eq!(m.host, env.host);
        // Nothing of a request yet.
        assert!(m.bundle_path.is_none() && m.memory_gb.is_none() && m.cpu_count.is_none());
        assert_eq!(
            default_socket(&env.host).unwrap(),
            PathBuf::from("/run/user/1/claude-cowork-vm.sock")
        );
        assert!(default_socket(&HostEnv::default()).is_err());
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        // Only where the test's own environment sets none of them (the
        // variables of clap's env would otherwise apply).
        let command = <Cli as clap::CommandFactory>::command();
        let set: Vec<String> = command
            .get_arguments()
            .filter_map(|a| a.get_env())
            .filter(|name| std::env::var_os(name).is_some())
            .map(|name| name.to_string_lossy().into_owned())
            .collect();
        if !set.is_empty() {
            eprintln!("skipped: the environment sets {set:?}");
            return;
        }
        let cli = Cli::try_parse_from(["h"]).unwrap();
        let env = Environment {
            host: HostEnv {
                home: Some("/home/u".into()),
                ..HostEnv::default()
            },
            ..Environment::default()
        };
        let s = cli.settings(&env, BackendKind::Sandbox, "/h".into());
        assert_eq!(
            s.data_dir,
            PathBuf::from("/home/u/.local/share/cowork-helper")
        );
        assert_eq!(s.idle_timeout, Some(Duration::from_secs(900)));
        assert_eq!(s.max_connections, crate::server::MAX_CLIENT_CONNECTIONS);
        assert_eq!(s.max_processes, crate::vm::MAX_PROCESSES);
        assert_eq!(s.max_pending_requests, crate::vm::MAX_PENDING_REQUESTS);
        assert_eq!(s.api_hosts, ["api.anthropic.com"]);
        assert_eq!((s.https_proxy, s.no_proxy), (None, None));
        let m = s.machine;
        assert!(!m.fs.xattr);
        assert_eq!(m.userland, UserlandChoice::Auto);
        assert_eq!(m.seccomp, vmm::seccomp::Mode::On);
        assert_eq!(m.memory_backing, vmm::memory::Backing::Anonymous);
        assert_eq!(m.images.env_dir, None);
        assert_eq!((m.qemu, m.qemu_accel), (None, None));
        assert_eq!((m.log, m.guest_log), (None, None));
        assert_eq!(m.guest_root_session, None);
        assert_eq!(m.sandbox_agent_wrapper, None);
        assert!(!m.sandbox_cgroup_disabled);
        assert_eq!(
            default_data_dir(&HostEnv::default()),
            PathBuf::from("/var/tmp/cowork-helper")
        );
        let xdg = HostEnv {
            data_home: Some("/x".into()),
            ..env.host
        };
        assert_eq!(default_data_dir(&xdg), PathBuf::from("/x/cowork-helper"));
    }

    #[test]
    fn empty_paths_mean_unset() {
        let cli =
            Cli::try_parse_from(["h", "--qemu=", "--guest-image-dir=", "--qemu-accel="]).unwrap();
        let m = cli.machine(&Environment::default());
        assert_eq!(m.qemu, None);
        assert_eq!(m.images.env_dir, None);
        assert_eq!(
            m.qemu_accel.as_deref(),
            Some(""),
            "choose_accel takes it as unset"
        );
        let cli = Cli::try_parse_from(["h", "image", "build", "--cache="]).unwrap();
        let Some(Command::Image(ImageCommand::Build(b))) = &cli.command else {
            panic!("not image build: {:?}", cli.command)
        };
        let o = b.options(Path::new("/d"), &HostEnv::default());
        assert_ne!(o.cache, PathBuf::new());
    }

    #[test]
    fn caps_and_guest_thp_read_as_their_variables_always_were() {
        let cap = cap_or(7);
        for (text, want) in [
            ("3", 3),
            (" 12 ", 12),
            ("0", 7),
            ("-1", 7),
            ("x", 7),
            ("", 7),
        ] {
            assert_eq!(cap(text).unwrap(), want, "{text:?}");
        }
        for (text, want) in [
            ("off", vmm::memory::Backing::AnonymousBasePages),
            (" OFF ", vmm::memory::Backing::AnonymousBasePages),
            ("on", vmm::memory::Backing::Anonymous),
            ("0", vmm::memory::Backing::Anonymous),
            ("", vmm::memory::Backing::Anonymous),
        ] {
            assert_eq!(parse_guest_thp(text).unwrap(), want, "{text:?}");
        }
        let cli = Cli::try_parse_from(["h", "--max-processes", "0"]).unwrap();
        assert_eq!(cli.max_processes, crate::vm::MAX_PROCESSES);
    }

    #[test]
    fn test_hooks_and_limits_are_parsed_but_not_in_help() {
        let top = help(&["h", "--help"]);
        for hidden in [
            "--max-connections",
            "--max-processes",
            "--max-pending-requests",
        ] {
            assert!(!top.contains(hidden), "{hidden} in --help:\n{top}");
        }
        for hook in ENV_ONLY.iter().filter(|v| v.name.starts_with("COWORK_")) {
            assert!(!top.contains(hook.name), "{} in --help", hook.name);
        }
        for shown in [
            "--log",
            "--guest-log",
            "--guest-image-dir",
            "--qemu-accel",
            "--guest-thp",
        ] {
            assert!(top.contains(shown), "{shown} missing from --help:\n{top}");
        }
        assert!(top.contains(VM_HEADING), "{top}");
    }

    #[test]
    fn the_env_only_registry_is_well_formed() {
        let command = <Cli as clap::CommandFactory>::command();
        let flag_vars = clap_env_vars(&command);
        let mut seen = std::collections::HashSet::new();
        for v in ENV_ONLY {
            assert!(seen.insert(v.name), "{} listed twice", v.name);
            assert!(!v.reader.is_empty() && !v.purpose.is_empty(), "{v:?}");
            assert!(
                !flag_vars.iter().any(|f| f.env == v.name),
                "{} has a flag and is in ENV_ONLY",
                v.name
            );
        }
    }

    /// An argument of the command line that has a variable.
    #[derive(Debug)]
    struct FlagVar {
        env: String,
        /// `--long`, after the subcommand path (`image build --cache`).
        flag: String,
        hidden: bool,
    }

    /// Every argument with an `env` in `command` and its subcommands.
    fn clap_env_vars(command: &clap::Command) -> Vec<FlagVar> {
        fn walk(c: &clap::Command, path: &str, out: &mut Vec<FlagVar>) {
            for a in c.get_arguments() {
                if let (Some(env), Some(long)) = (a.get_env(), a.get_long()) {
                    out.push(FlagVar {
                        env: env.to_string_lossy().into_owned(),
                        flag: format!("{path}--{long}"),
                        hidden: a.is_hide_set(),
                    });
                }
            }
            for sub in c.get_subcommands() {
                walk(sub, &format!("{path}{} ", sub.get_name()), out);
            }
        }
        let mut out = Vec::new();
        walk(command, "", &mut out);
        out
    }

    /// One row of a table of docs/configuration.md: the heading it is under
    /// and its cells.
    #[derive(Debug)]
    struct DocRow {
        heading: String,
        cells: Vec<String>,
    }

    impl DocRow {
        /// The variable names of the first cell (each in backticks).
        fn names(&self) -> Vec<String> {
            self.cells
                .first()
                .map(|c| backticked(c))
                .unwrap_or_default()
                .into_iter()
                .filter(|n| {
                    n.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                        && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                })
                .collect()
        }
    }

    /// The spans of `text` in backticks.
    fn backticked(text: &str) -> Vec<String> {
        text.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    }

    /// The body rows of every table in `markdown`, with the heading each
    /// is under (`\|` inside a cell is not a separator).
    fn doc_rows(markdown: &str) -> Vec<DocRow> {
        let lines: Vec<&str> = markdown.lines().collect();
        let mut heading = String::new();
        let mut rows = Vec::new();
        for (i, line) in lines.iter().enumerate() {
            if line.starts_with('#') {
                heading = line.trim_start_matches('#').trim().to_string();
                continue;
            }
            let separator = |l: &str| l.starts_with("|-") || l.starts_with("|:");
            let header = lines.get(i + 1).is_some_and(|next| separator(next));
            if !line.starts_with('|') || separator(line) || header {
                continue;
            }
            let cells = line
                .replace("\\|", "\u{1}")
                .trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.replace('\u{1}', "|").trim().to_string())
                .collect();
            rows.push(DocRow {
                heading: heading.clone(),
                cells,
            });
        }
        rows
    }

    /// The rows under the heading `heading`, by variable name.
    fn rows_under<'a>(rows: &'a [DocRow], heading: &str) -> Vec<(String, &'a DocRow)> {
        let found: Vec<_> = rows
            .iter()
            .filter(|r| r.heading == heading)
            .flat_map(|r| r.names().into_iter().map(move |n| (n, r)))
            .collect();
        assert!(!found.is_empty(), "no table under the heading {heading:?}");
        found
    }

    /// The settings' reference, which this test keeps in step with the code.
    const CONFIGURATION_MD: &str = include_str!("../docs/configuration.md");

    /// `COWORK_` words in the sources that are not variables.
    const NOT_VARIABLES: [&str; 1] = [
        // A heredoc delimiter in tests/sandbox_limits.rs.
        "COWORK_EOF",
    ];

    #[test]
    fn the_configuration_table_matches_the_code() {
        let rows = doc_rows(CONFIGURATION_MD);
        let command = <Cli as clap::CommandFactory>::command();
        let flags = clap_env_vars(&command);
        let mut problems = Vec::new();

        // Every variable with a flag is in "Settings", naming its flag, and
        // that table lists no other.
        let users = rows_under(&rows, "Settings");
        for f in &flags {
            match users.iter().find(|(n, _)| *n == f.env) {
                None => problems.push(format!(
                    "{} ({}) is missing from the \"Settings\" table",
                    f.env, f.flag
                )),
                Some((_, row)) => {
                    let flag_cell = row.cells.get(1).map(String::as_str).unwrap_or("");
                    // `--flag`, or `--flag VALUE` / `--flag a\|b`.
                    let names_flag = |span: &String| {
                        span.strip_prefix(&f.flag)
                            .is_some_and(|rest| rest.is_empty() || rest.starts_with(' '))
                    };
                    if !backticked(flag_cell).iter().any(names_flag) {
                        problems.push(format!(
                            "{}'s flag cell {flag_cell:?} does not name `{}`",
                            f.env, f.flag
                        ));
                    }
                    if f.hidden && !flag_cell.contains("hidden") {
                        problems.push(format!(
                            "{}'s flag {} is hidden from --help; its flag cell should say so",
                            f.env, f.flag
                        ));
                    }
                }
            }
        }
        for (name, _) in &users {
            if !flags.iter().any(|f| f.env == *name) {
                problems.push(format!(
                    "the \"Settings\" table lists {name}, which no flag of the helper reads"
                ));
            }
        }

        // The environment-only variables: the test hooks and the host's.
        let hooks = rows_under(&rows, "Test hooks the helper reads");
        let host = rows_under(&rows, "Read by the helper");
        for v in ENV_ONLY {
            let (table, list) = if v.name.starts_with("COWORK_") {
                ("Test hooks the helper reads", &hooks)
            } else {
                ("Read by the helper", &host)
            };
            if !list.iter().any(|(n, _)| n == v.name) {
                problems.push(format!(
                    "{} (ENV_ONLY: {}) is missing from the {table:?} table",
                    v.name, v.purpose
                ));
            }
        }
        for (name, _) in hooks.iter().chain(&host) {
            if !ENV_ONLY.iter().any(|v| v.name == name) {
                problems.push(format!(
                    "{name} is documented as read by the helper but is not in cli::ENV_ONLY"
                ));
            }
        }

        // Every COWORK_ variable the repository names is in some table.
        let documented: std::collections::HashSet<String> =
            rows.iter().flat_map(DocRow::names).collect();
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut named = std::collections::BTreeMap::new();
        for dir in [
            "src",
            "vmm/src",
            "devices/src",
            "guest-agent/src",
            "tests",
            "benches",
            "vmm/tests",
            "vmm/benches",
            "devices/tests",
            "guest-agent/tests",
            "scripts",
            ".ci",
            "packaging",
        ] {
            cowork_names(&root.join(dir), root, &mut named);
        }
        for (name, file) in &named {
            if !documented.contains(name) && !NOT_VARIABLES.contains(&name.as_str()) {
                problems.push(format!(
                    "{name} (named in {file}) is in no table of docs/configuration.md"
                ));
            }
        }
        assert!(
            problems.is_empty(),
            "docs/configuration.md and the code disagree:\n  {}",
            problems.join("\n  ")
        );
    }

    /// Adds each `COWORK_[A-Z0-9_]+` word of the text files under `dir`
    /// (recursively) to `named`, with the first file naming it.
    fn cowork_names(
        dir: &Path,
        root: &Path,
        named: &mut std::collections::BTreeMap<String, String>,
    ) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                cowork_names(&path, root, named);
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            for (at, _) in text.match_indices("COWORK_") {
                if text[..at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
                {
                    continue;
                }
                let word: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                if word.len() > "COWORK_".len() && !word.ends_with('_') {
                    let file = path.strip_prefix(root).unwrap_or(&path);
                    named
                        .entry(word)
                        .or_insert_with(|| file.display().to_string());
                }
            }
        }
    }
}
