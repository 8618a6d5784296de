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
use crate::daemon::{Daemon, Settings};

/// Environment variable of `--seccomp`.
pub const SECCOMP_ENV: &str = "COWORK_SECCOMP";
/// Environment variable of `--guest-thp`.
pub const GUEST_THP_ENV: &str = "COWORK_GUEST_THP";

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
    #[arg(long, env = "COWORK_IDLE_TIMEOUT", default_value_t = 900)]
    pub idle_timeout: u64,
    /// Let the VM read and set extended attributes (`user.*`, POSIX ACLs) on
    /// the shared folders. Off by default, as in virtiofsd: serving them
    /// costs the guest a round trip to the helper before the first write to
    /// every file (the kernel asks for `security.capability`).
    #[arg(long, env = "COWORK_FS_XATTR")]
    pub fs_xattr: bool,
    /// Which userland sessions run in under the VM backends: `auto` prefers
    /// the client bundle's rootfs.img when it validates, then our Debian
    /// image's rootfs.img, then the busybox initramfs; the others force one
    /// (startVM fails when it is unusable).
    #[arg(long, env = "COWORK_USERLAND", value_enum, default_value = "auto")]
    pub userland: UserlandArg,
    /// Seccomp filters on the threads that handle guest data (the kvm
    /// backend's vCPUs, VMM event loop and device workers, the qemu
    /// backend's vhost-user servers): each may make only the system calls
    /// its job needs. `off` disables them (with a
    /// warning), `log` only has the kernel log what they would refuse.
    #[arg(long, env = SECCOMP_ENV, value_enum, default_value = "on")]
    pub seccomp: SeccompArg,
    /// `off` maps the kvm backend's guest RAM without the huge-page advice
    /// (anything else means on).
    #[arg(
        long,
        env = GUEST_THP_ENV,
        value_name = "on|off",
        default_value = "on",
        value_parser = parse_guest_thp
    )]
    pub guest_thp: vmm::memory::Backing,
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

/// `bench boot`'s options (see [`crate::bench::boot`]).
#[derive(Debug, Args)]
pub struct BenchBootArgs {
    /// Which backend(s) to boot.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BenchBackend,
    /// Boots per backend.
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
    /// Unmeasured boots per backend first (the first formats the session
    /// disk, which later starts find ready).
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
        use crate::bench::boot::Backends;
        crate::bench::boot::Options {
            backends: match self.backend {
                BenchBackend::Auto => Backends::Auto,
                BenchBackend::Kvm => Backends::Kvm,
                BenchBackend::Qemu => Backends::Qemu,
                BenchBackend::Both => Backends::Both,
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
    /// Build cache (default: $COWORK_GUEST_CACHE, else
    /// /var/cache/cowork-helper as root, else $XDG_CACHE_HOME/cowork-helper).
    #[arg(long, value_name = "DIR")]
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
    /// The build's options, with the data directory `data_dir`.
    pub fn options(&self, data_dir: &std::path::Path) -> crate::image_build::Options {
        crate::image_build::Options::new(
            self.output.clone(),
            self.cache.clone(),
            self.mirror.clone(),
            self.refresh,
            data_dir,
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

impl Cli {
    /// `--data-dir`, else the default, made absolute (the sandbox binds it
    /// into the guest).
    pub fn data_dir_or_default(&self) -> PathBuf {
        let data_dir = self.data_dir.clone().unwrap_or_else(default_data_dir);
        if data_dir.is_absolute() {
            return data_dir;
        }
        std::env::current_dir()
            .map(|d| d.join(&data_dir))
            .unwrap_or(data_dir)
    }

    /// Where this process looks for the guest image and the userland.
    pub fn image_search(&self) -> ImageSearch {
        ImageSearch::from_process(Some(self.data_dir_or_default()))
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

/// `--guest-thp`: `off` (any case) maps guest RAM without the huge-page
/// advice; anything else keeps it, as the variable always was read.
fn parse_guest_thp(text: &str) -> Result<vmm::memory::Backing, std::convert::Infallible> {
    Ok(if text.trim().eq_ignore_ascii_case("off") {
        vmm::memory::Backing::AnonymousBasePages
    } else {
        vmm::memory::Backing::Anonymous
    })
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

fn default_socket() -> Result<PathBuf, String> {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => Ok(PathBuf::from(dir).join(SOCKET_NAME)),
        _ => Err("no -socket given and XDG_RUNTIME_DIR is not set".into()),
    }
}

fn default_data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("cowork-helper");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h).join(".local/share/cowork-helper");
    }
    PathBuf::from("/var/tmp/cowork-helper")
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
                userland: userland.into(),
                seccomp: cli.seccomp.into(),
                images: cli.image_search(),
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
            crate::image_build::main(&b.options(&cli.data_dir_or_default()))
        }
        Some(Command::Vm(VmCommand::Run {
            kernel,
            initrd,
            cmdline,
            mem,
            cpus,
            force,
        })) => {
            crate::logging::init();
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
        None => serve(cli),
    }
}

fn serve(cli: Cli) -> i32 {
    crate::logging::init();
    let socket = match cli.socket.clone().map(Ok).unwrap_or_else(default_socket) {
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
    let (backend, why) = resolve_backend(cli.backend, &cli.image_search());
    let data_dir = cli.data_dir_or_default();
    let settings = Settings {
        images: cli.image_search(),
        api_hosts: cli.api_hosts.clone(),
        data_dir,
        backend,
        helper_exe,
        fs_xattr: cli.fs_xattr,
        userland: cli.userland.into(),
        seccomp: cli.seccomp.into(),
        guest_thp: cli.guest_thp,
    };
    match settings.seccomp {
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
        let idle = (cli.idle_timeout > 0).then(|| Duration::from_secs(cli.idle_timeout));
        let trigger =
            crate::server::serve(&listener, daemon.clone(), idle, shutdown.requested()).await;
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
        let settings = Settings {
            data_dir: "/d".into(),
            backend: crate::backend::BackendKind::Qemu,
            helper_exe: "/h".into(),
            fs_xattr: cli.fs_xattr,
            userland: cli.userland.into(),
            seccomp: cli.seccomp.into(),
            images: ImageSearch::default(),
            api_hosts: cli.api_hosts.clone(),
            guest_thp: cli.guest_thp,
        };
        assert!(settings.fs_options().xattr);
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
}
