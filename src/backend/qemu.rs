//! The QEMU backend (`--backend qemu`): the guest agent runs as PID 1 of a
//! real Linux guest booted by `qemu-system-x86_64`, and reaches the helper
//! over our own virtio-vsock device, served as vhost-user from inside this
//! process (crate `devices`).
//!
//! Boot: the guest image (`vmlinuz`, `initramfs`, `image-info`; built by
//! `scripts/mkguestimage.sh`) is taken from `startVM.bundlePath` when that
//! directory holds one of ours, else from `$COWORK_GUEST_IMAGE_DIR`, else
//! from `guest-image/` next to or one level above the helper's executable
//! (`target/guest-image` for a `target/*/cowork-helper` build). QEMU runs
//! with KVM where `/dev/kvm` can run Linux
//! (`vmm::kvm_check::linux_capable`), else TCG (`$COWORK_QEMU_ACCEL`
//! overrides), on an i440fx `pc` machine with memfd-shared guest memory
//! (vhost-user needs it), `-nodefaults -nographic`, the serial console on
//! QEMU's stdout, and `vhost-user-vsock-pci`, `vhost-user-fs-pci`,
//! `vhost-user-blk-pci` (the session disk) and `vhost-user-rng-pci` on
//! sockets in a private 0700 directory, every device served from threads of
//! this process. The agent dials CID 2 port 51234; the device hands the
//! helper a socketpair end, which becomes the agent link.
//!
//! Session disk: the profile's `sessiondata.img` (created by `createVM` or
//! `startVM`, see `crate::vm`) is opened read-write, locked exclusively for
//! the VM's lifetime, and served with serial
//! [`devices::blk::SESSION_DISK_SERIAL`] and one request queue; the agent
//! formats it as ext4 when blank and mounts it at `/sessions`. When QEMU
//! disconnects (or never connected) the server flushes the disk and closes
//! it, which releases the lock for the next `startVM`. Entropy comes from
//! the host's getrandom through our `vhost-user-rng` server (QEMU's own
//! `virtio-rng-pci` is not used).
//!
//! Host folders: each VM has one [`SessionFs`] served in-process by
//! `devices::vhost_user::fs` as the virtio-fs tag
//! [`guest_agent::proto::SESSIONS_FS_TAG`], which the agent mounts at boot.
//! It starts empty; the controller grants each session mount (and the SDK)
//! through [`HostPaths::Shared`] while the VM runs, and the host enforces
//! each mount's mode (see `devices::fs`).
//!
//! Console: every line QEMU prints (guest serial console and QEMU's own
//! stderr) is logged at debug, one event per line, control characters
//! removed and long lines cut; the last [`CONSOLE_TAIL`] lines are kept and
//! quoted when the boot fails or the machine ends unexpectedly.
//!
//! Lifetime: QEMU is started with `kill_on_drop`, in its own process group,
//! with `PR_SET_PDEATHSIG` = SIGKILL, so it never outlives the helper. The
//! pdeath signal fires when the *thread* that forked QEMU exits: [`boot`]
//! must run on a runtime worker thread (as the daemon's requests do), never
//! on a short-lived blocking-pool thread. On stop the controller first asks
//! the agent to shut down (the agent powers the guest off); [`QemuMachine::kill`]
//! then gives QEMU [`POWEROFF_DEADLINE`] to exit before killing it.
//!
//! Limits: x86_64 guests only; no network besides vsock. Files in shared folders are
//! created with the helper's uid (`devices::fs::Credentials::Helper`).

use std::ffi::OsString;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devices::blk::{BlkConfig, ImageError, RawImage, SESSION_DISK_SERIAL};
use devices::fs::{SessionFs, SessionFsOptions};
use devices::vhost_user::blk::{VhostUserBlkError, VhostUserBlkServer, VhostUserServeError};
use devices::vhost_user::fs::{VhostUserFsConfig, VhostUserFsError, VhostUserFsServer};
use devices::vhost_user::rng::VhostUserRngServer;
use devices::vhost_user::vsock::{VhostUserVsockConfig, VhostUserVsockError, VhostUserVsockServer};
use devices::vsock::{HostError, VsockHost};
use guest_agent::proto::AGENT_PORT;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::{Child, Command};

use super::fsgrants::SharedFolders;
use super::guest::{agent_stream, Console, ACCEPT_POLL, MAX_CONSOLE_LINE, QUOTED_LINES};
pub use super::guest::{AGENT_DIAL_TIMEOUT, CONSOLE_TAIL};
use super::image::{GuestImage, NoImage};
use super::userland::{self, RootDisk, UserlandError, UserlandPlan};
use super::{BootOptions, Booted, HostPaths, Machine};

/// Environment variable naming the QEMU binary (a path or a name in `PATH`).
pub const QEMU_ENV: &str = "COWORK_QEMU";
/// QEMU binary looked up in `PATH` when [`QEMU_ENV`] is unset.
pub const DEFAULT_QEMU: &str = "qemu-system-x86_64";
/// Environment variable forcing the accelerator (`kvm` or `tcg`).
pub const ACCEL_ENV: &str = "COWORK_QEMU_ACCEL";
/// Environment variable whose value becomes the guest agent's `COWORK_LOG`.
pub const GUEST_LOG_ENV: &str = "COWORK_GUEST_LOG";

/// The guest's CID (each VM has its own device, so all can use the same).
pub const GUEST_CID: u64 = 3;
/// Guest memory when `startVM` does not say.
pub const DEFAULT_MEMORY_MIB: u64 = 2048;
/// Smallest guest memory accepted.
pub const MIN_MEMORY_MIB: u64 = 256;
/// Largest guest memory accepted.
pub const MAX_MEMORY_MIB: u64 = 64 * 1024;
/// vCPUs when `startVM` does not say (capped at the host's CPU count).
pub const DEFAULT_CPUS: u32 = 2;
/// Kernel command line (the agent is `/init`; `panic=-1` plus `-no-reboot`
/// turn a guest panic into QEMU exiting).
pub const KERNEL_CMDLINE: &str = "console=ttyS0 panic=-1 quiet";

/// How long QEMU gets to power off after the agent was told to shut down.
pub const POWEROFF_DEADLINE: Duration = Duration::from_secs(10);
/// How long the console readers get to drain QEMU's output after it exited.
const CONSOLE_DRAIN: Duration = Duration::from_secs(1);
/// How long the vhost-user thread gets to end after QEMU is gone.
const VHOST_JOIN: Duration = Duration::from_secs(5);
/// Queue size of the virtio-fs device (QEMU's largest; deep queues let
/// the guest keep readahead and writeback requests in flight).
pub const FS_QUEUE_SIZE: u16 = 1024;
/// Longest Unix socket path (`sun_path` minus the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Errors of starting the QEMU machine, worded for the client's log.
#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    #[error("QEMU not found: {0}; install qemu-system-x86 or set {QEMU_ENV}")]
    NoQemu(String),
    #[error(transparent)]
    NoImage(#[from] NoImage),
    #[error(transparent)]
    Userland(#[from] UserlandError),
    #[error("cannot open the root disk {path}: {source}")]
    RootDisk { path: PathBuf, source: ImageError },
    #[error("{ACCEL_ENV}={0:?} is not kvm or tcg")]
    BadAccel(String),
    #[error("cannot create the VM's runtime directory {path}: {source}")]
    RunDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot set up the vsock device: {0}")]
    Vsock(#[from] HostError),
    #[error("cannot serve the vsock device over vhost-user: {0}")]
    VhostUser(#[from] VhostUserVsockError),
    #[error("cannot serve the virtio-fs device over vhost-user: {0}")]
    VhostUserFs(#[from] VhostUserFsError),
    #[error("cannot open the session disk: {0}")]
    SessionDisk(#[from] ImageError),
    #[error("cannot serve the session disk over vhost-user: {0}")]
    VhostUserBlk(#[from] VhostUserBlkError),
    #[error("cannot serve the entropy device over vhost-user: {0}")]
    VhostUserRng(#[from] VhostUserServeError),
    #[error("cannot start the vhost-user thread: {0}")]
    Thread(std::io::Error),
    #[error("cannot start {qemu}: {source}")]
    Spawn {
        qemu: PathBuf,
        source: std::io::Error,
    },
}

/// The QEMU binary: `$COWORK_QEMU` (a path, or a name looked up in `PATH`)
/// or `qemu-system-x86_64` in `PATH`.
pub fn find_qemu() -> Result<PathBuf, QemuError> {
    let wanted = std::env::var_os(QEMU_ENV)
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| DEFAULT_QEMU.into());
    let wanted = PathBuf::from(wanted);
    if wanted.components().count() > 1 {
        return if is_executable(&wanted) {
            Ok(wanted)
        } else {
            Err(QemuError::NoQemu(format!(
                "{} is not an executable file",
                wanted.display()
            )))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(&wanted))
        .find(|p| is_executable(p))
        .ok_or_else(|| QemuError::NoQemu(format!("{} is not in PATH", wanted.display())))
}

fn is_executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// QEMU's accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// KVM when this host's `/dev/kvm` can run Linux, else TCG; with the reason.
pub fn choose_accel() -> Result<(Accel, String), QemuError> {
    match std::env::var(ACCEL_ENV).ok().filter(|v| !v.is_empty()) {
        Some(v) if v == "kvm" => return Ok((Accel::Kvm, format!("{ACCEL_ENV}=kvm"))),
        Some(v) if v == "tcg" => return Ok((Accel::Tcg, format!("{ACCEL_ENV}=tcg"))),
        Some(v) => return Err(QemuError::BadAccel(v)),
        None => {}
    }
    Ok(match kvm_for_linux() {
        Ok(()) => (Accel::Kvm, "/dev/kvm can run Linux guests".into()),
        Err(why) => (Accel::Tcg, format!("TCG because {why}")),
    })
}

/// Whether `/dev/kvm` is usable and can boot Linux (why not otherwise).
pub fn kvm_for_linux() -> Result<(), String> {
    vmm::kvm_check::check_capabilities().map_err(|e| e.to_string())?;
    vmm::kvm_check::linux_capable().map_err(|e| e.to_string())
}

/// Everything QEMU is started with.
#[derive(Clone, Debug)]
pub struct QemuPlan {
    pub qemu: PathBuf,
    pub image: GuestImage,
    pub accel: Accel,
    pub memory_mib: u64,
    pub cpus: u32,
    pub vsock_socket: PathBuf,
    /// The vhost-user socket of the session share (virtio-fs).
    pub fs_socket: PathBuf,
    /// The vhost-user socket of the session disk (virtio-blk).
    pub blk_socket: PathBuf,
    /// The vhost-user socket of the entropy device (virtio-rng).
    pub rng_socket: PathBuf,
    /// The session disk image, served read-write on [`Self::blk_socket`].
    pub session_disk: PathBuf,
    /// Read-only root disks (the userland), each on its own vhost-user socket.
    pub root_disks: Vec<RootDiskSocket>,
    /// Extra kernel command-line words (`COWORK_LOG=...`).
    pub extra_cmdline: Vec<String>,
}

/// A read-only root disk and the vhost-user socket it is served on.
#[derive(Clone, Debug)]
pub struct RootDiskSocket {
    pub disk: RootDisk,
    pub socket: PathBuf,
}

impl QemuPlan {
    /// QEMU's arguments.
    pub fn args(&self) -> Vec<OsString> {
        let mem = self.memory_mib;
        let mut cmdline = KERNEL_CMDLINE.to_string();
        for w in &self.extra_cmdline {
            cmdline.push(' ');
            cmdline.push_str(w);
        }
        let cpu = match self.accel {
            Accel::Kvm => "host",
            Accel::Tcg => "max",
        };
        let mut a: Vec<OsString> = [
            "-name",
            "cowork-guest",
            "-nodefaults",
            "-nographic",
            "-no-user-config",
            "-no-reboot",
            "-accel",
            self.accel.as_str(),
            "-cpu",
            cpu,
            "-M",
            "pc",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        let mut push = |k: &str, v: String| {
            a.push(k.into());
            a.push(v.into());
        };
        push("-smp", self.cpus.to_string());
        push("-m", format!("{mem}M"));
        push(
            "-object",
            format!("memory-backend-memfd,id=mem,size={mem}M,share=on"),
        );
        push("-numa", "node,memdev=mem".into());
        push("-serial", "stdio".into());
        push(
            "-chardev",
            format!(
                "socket,id=vsock,path={}",
                qemu_opt_escape(&self.vsock_socket.to_string_lossy())
            ),
        );
        push("-device", "vhost-user-vsock-pci,chardev=vsock".into());
        push(
            "-chardev",
            format!(
                "socket,id=fs0,path={}",
                qemu_opt_escape(&self.fs_socket.to_string_lossy())
            ),
        );
        push(
            "-device",
            format!(
                "vhost-user-fs-pci,chardev=fs0,tag={},queue-size={FS_QUEUE_SIZE}",
                guest_agent::proto::SESSIONS_FS_TAG
            ),
        );
        push(
            "-chardev",
            format!(
                "socket,id=blk0,path={}",
                qemu_opt_escape(&self.blk_socket.to_string_lossy())
            ),
        );
        // One request queue: the device model serves exactly one.
        push(
            "-device",
            "vhost-user-blk-pci,chardev=blk0,num-queues=1".into(),
        );
        push(
            "-chardev",
            format!(
                "socket,id=rng0,path={}",
                qemu_opt_escape(&self.rng_socket.to_string_lossy())
            ),
        );
        push("-device", "vhost-user-rng-pci,chardev=rng0".into());
        for (i, root) in self.root_disks.iter().enumerate() {
            push(
                "-chardev",
                format!(
                    "socket,id=root{i},path={}",
                    qemu_opt_escape(&root.socket.to_string_lossy())
                ),
            );
            // Read-only comes from the backend (VIRTIO_BLK_F_RO), the serial
            // from its GET_ID answer.
            push(
                "-device",
                format!("vhost-user-blk-pci,chardev=root{i},num-queues=1"),
            );
        }
        a.push("-kernel".into());
        a.push(self.image.vmlinuz.clone().into());
        a.push("-initrd".into());
        a.push(self.image.initramfs.clone().into());
        a.push("-append".into());
        a.push(cmdline.into());
        a
    }
}

/// Escapes a value for QEMU's `key=value,...` option syntax (commas double).
pub fn qemu_opt_escape(v: &str) -> String {
    v.replace(',', ",,")
}

/// Guest memory for a `startVM.memoryGB` value.
pub fn memory_mib(memory_gb: Option<f64>) -> u64 {
    match memory_gb {
        Some(gb) if gb.is_finite() && gb > 0.0 => {
            ((gb * 1024.0).round() as u64).clamp(MIN_MEMORY_MIB, MAX_MEMORY_MIB)
        }
        _ => DEFAULT_MEMORY_MIB,
    }
}

/// vCPUs for a `startVM.cpuCount` value, at most the host's CPU count.
pub fn cpu_count(requested: Option<u32>, host_cpus: u32) -> u32 {
    requested
        .filter(|&n| n > 0)
        .unwrap_or(DEFAULT_CPUS)
        .min(host_cpus.max(1))
}

/// The kernel command-line word passing `$COWORK_GUEST_LOG` to the agent,
/// when it is set and is one word of safe characters.
pub fn guest_log_word(value: Option<&str>) -> Option<String> {
    let v = value?.trim();
    let safe = !v.is_empty()
        && v.len() <= 200
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_=,:.-".contains(c));
    safe.then(|| format!("COWORK_LOG={v}"))
}

/// What the daemon needs to know about QEMU here (for `auto` and `doctor`).
#[derive(Debug)]
pub struct Probe {
    pub qemu: Result<PathBuf, String>,
    pub image: Result<GuestImage, String>,
    pub accel: Result<(Accel, String), String>,
}

impl Probe {
    /// Looks for QEMU, the guest image and the accelerator.
    pub fn run() -> Probe {
        Probe {
            qemu: find_qemu().map_err(|e| e.to_string()),
            image: GuestImage::locate(None).map_err(|e| e.to_string()),
            accel: choose_accel().map_err(|e| e.to_string()),
        }
    }

    /// Whether the backend can start here.
    pub fn usable(&self) -> bool {
        self.qemu.is_ok() && self.image.is_ok() && self.accel.is_ok()
    }
}

/// Removes control characters (ANSI escapes' printable rest is kept) and
/// trailing whitespace from one console line.
pub fn clean_console_line(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI sequences (ESC [ ... final byte) and two-byte escapes vanish whole.
            if chars.peek() == Some(&'[') {
                chars.next();
                for c2 in chars.by_ref() {
                    if ('\u{40}'..='\u{7e}').contains(&c2) {
                        break;
                    }
                }
            } else {
                chars.next();
            }
        } else if c == '\t' {
            out.push(' ');
        } else if !c.is_control() {
            out.push(c);
        }
    }
    out.trim_end().to_string()
}

/// Reads `stream` line by line into the log and `console` until EOF.
async fn pump_console(mut stream: impl AsyncRead + Unpin, console: Console, source: &'static str) {
    let mut buf = vec![0u8; 4096];
    let mut line: Vec<u8> = Vec::new();
    let emit = |line: &mut Vec<u8>| {
        let text = clean_console_line(line);
        line.clear();
        if !text.is_empty() {
            tracing::debug!(source, line = %text, "guest console");
            console.push(text);
        }
    };
    loop {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &b in &buf[..n] {
            if b == b'\n' {
                emit(&mut line);
            } else {
                line.push(b);
                if line.len() >= MAX_CONSOLE_LINE {
                    emit(&mut line);
                }
            }
        }
    }
    emit(&mut line);
}

/// The VM's private runtime directory (0700; holds the vhost-user socket);
/// removed on drop.
struct RunDir(PathBuf);

/// Distinguishes the runtime directories of one helper's VMs.
static RUN_DIR_SEQ: AtomicU64 = AtomicU64::new(0);

impl RunDir {
    fn create() -> Result<RunDir, QemuError> {
        let name = format!(
            "cowork-qemu-{}-{}",
            std::process::id(),
            RUN_DIR_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .filter(|d| d.join(&name).join("vsock.sock").as_os_str().len() <= MAX_SOCKET_PATH)
            .unwrap_or_else(std::env::temp_dir);
        let path = base.join(name);
        let fail = |source| QemuError::RunDir {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&base).map_err(fail)?;
        sweep_stale_run_dirs(&base);
        // A leftover of a crashed helper with a recycled pid: start clean.
        let _ = std::fs::remove_dir_all(&path);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(fail)?;
        Ok(RunDir(path))
    }
}

/// Removes runtime directories of helpers that are gone (killed before
/// they could clean up), recognised by the pid in their name.
fn sweep_stale_run_dirs(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("cowork-qemu-"))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::debug!(dir = %e.path().display(), "removing a dead helper's runtime directory");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The vhost-user threads of the single-queue devices (virtio-blk and
/// virtio-rng), with what ends and reports them.
struct SingleQueueThreads {
    /// The session disk's server thread; it holds the image (and its lock)
    /// until it ends, flushing the disk when QEMU disconnects.
    blk: Option<std::thread::JoinHandle<Result<(), VhostUserServeError>>>,
    blk_socket: PathBuf,
    blk_stats: Arc<devices::blk::BlkStats>,
    /// The entropy device's server thread.
    rng: Option<std::thread::JoinHandle<Result<(), VhostUserServeError>>>,
    rng_socket: PathBuf,
    /// The read-only root disks' server threads and sockets.
    roots: Vec<(VhostThread, PathBuf)>,
}

/// A vhost-user single-queue server thread, until joined.
type VhostThread = Option<std::thread::JoinHandle<Result<(), VhostUserServeError>>>;

/// A running QEMU guest.
pub struct QemuMachine {
    child: Child,
    pid: Option<u32>,
    console: Console,
    /// The tasks copying QEMU's stdout and stderr into the console.
    pumps: Vec<tokio::task::JoinHandle<()>>,
    /// The agent dialled in (so a stop is expected to power the guest off).
    connected: Arc<AtomicBool>,
    vhost: Option<std::thread::JoinHandle<Result<(), VhostUserVsockError>>>,
    vhost_socket: PathBuf,
    /// The virtio-fs server thread; ends when QEMU disconnects.
    vhost_fs: Option<std::thread::JoinHandle<Result<(), VhostUserFsError>>>,
    fs_canceller: devices::vhost_user::fs::FsServerCanceller,
    /// The session disk's and the entropy device's server threads (boxed:
    /// the machine is moved around inside [`Machine`]).
    single_queue: Box<SingleQueueThreads>,
    /// Keeps the device's host side alive as long as the machine.
    _host: VsockHost,
    ended: Option<String>,
    // Dropped last: the socket lives in it.
    _run_dir: RunDir,
}

impl QemuMachine {
    /// Waits until QEMU exits by itself; describes how, quoting the console.
    pub async fn wait(&mut self) -> String {
        if let Some(how) = &self.ended {
            return how.clone();
        }
        let status = self.child.wait().await;
        self.drain_console().await;
        let how = match status {
            Ok(st) => format!("QEMU exited ({st}){}", self.console.quote(QUOTED_LINES)),
            Err(e) => format!("cannot wait for QEMU: {e}"),
        };
        tracing::info!(pid = self.pid, how = %how, "qemu ended");
        self.ended = Some(how.clone());
        self.finish_vhost().await;
        how
    }

    /// Ends QEMU: when the agent had connected, the guest is expected to
    /// power off (the controller asked the agent to shut down) and gets
    /// [`POWEROFF_DEADLINE`]; then QEMU is killed. Idempotent.
    pub async fn kill(&mut self) {
        if self.ended.is_none() {
            let started = Instant::now();
            let mut status = None;
            if self.connected.load(Ordering::Acquire) {
                match tokio::time::timeout(POWEROFF_DEADLINE, self.child.wait()).await {
                    Ok(Ok(st)) => status = Some(st),
                    Ok(Err(e)) => tracing::warn!(error = %e, "cannot wait for QEMU"),
                    Err(_) => tracing::warn!(
                        deadline_s = POWEROFF_DEADLINE.as_secs(),
                        "guest did not power off in time; killing QEMU"
                    ),
                }
            }
            if status.is_none() {
                let _ = self.child.start_kill();
                status = self.child.wait().await.ok();
            }
            let how = match status {
                Some(st) => format!("QEMU ended ({st})"),
                None => "QEMU ended (status unknown)".into(),
            };
            tracing::info!(
                pid = self.pid,
                how = %how,
                ms = started.elapsed().as_millis() as u64,
                "qemu stopped"
            );
            self.ended = Some(how);
        }
        self.drain_console().await;
        self.finish_vhost().await;
    }

    /// Lets the console readers reach EOF, so the last lines are in.
    async fn drain_console(&mut self) {
        let pumps = std::mem::take(&mut self.pumps);
        let all = async {
            for p in pumps {
                let _ = p.await;
            }
        };
        if tokio::time::timeout(CONSOLE_DRAIN, all).await.is_err() {
            tracing::debug!("QEMU's output is still open (a child holds it?)");
        }
    }

    /// Joins the vhost-user threads. They end when QEMU disconnects; if QEMU
    /// never connected, a throwaway connection unblocks their accept.
    async fn finish_vhost(&mut self) {
        if let Some(handle) = self.vhost.take() {
            if !handle.is_finished() {
                let _ = std::os::unix::net::UnixStream::connect(&self.vhost_socket);
            }
            join_vhost_thread(handle, "vsock").await;
        }
        if let Some(handle) = self.vhost_fs.take() {
            if !handle.is_finished() {
                self.fs_canceller.cancel();
            }
            join_vhost_thread(handle, "virtio-fs").await;
        }
        let sq = &mut self.single_queue;
        if let Some(handle) = sq.blk.take() {
            if !handle.is_finished() {
                let _ = std::os::unix::net::UnixStream::connect(&sq.blk_socket);
            }
            join_vhost_thread(handle, "virtio-blk").await;
            let s = &sq.blk_stats;
            tracing::info!(
                requests = s.requests.load(Ordering::Relaxed),
                bytes_read = s.bytes_read.load(Ordering::Relaxed),
                bytes_written = s.bytes_written.load(Ordering::Relaxed),
                flushes = s.flushes.load(Ordering::Relaxed),
                errors = s.errors.load(Ordering::Relaxed),
                "session disk closed"
            );
        }
        if let Some(handle) = sq.rng.take() {
            if !handle.is_finished() {
                let _ = std::os::unix::net::UnixStream::connect(&sq.rng_socket);
            }
            join_vhost_thread(handle, "virtio-rng").await;
        }
        for (thread, socket) in &mut sq.roots {
            if let Some(handle) = thread.take() {
                if !handle.is_finished() {
                    let _ = std::os::unix::net::UnixStream::connect(&*socket);
                }
                join_vhost_thread(handle, "virtio-blk (root)").await;
            }
        }
    }
}

/// Waits (bounded by [`VHOST_JOIN`]) for a vhost-user server thread to end
/// and logs how it ended.
async fn join_vhost_thread<E>(handle: std::thread::JoinHandle<Result<(), E>>, device: &'static str)
where
    E: std::fmt::Display + Send + 'static,
{
    let joined = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + VHOST_JOIN;
        while !handle.is_finished() && Instant::now() < deadline {
            std::thread::sleep(ACCEPT_POLL);
        }
        if handle.is_finished() {
            Some(handle.join())
        } else {
            None
        }
    })
    .await;
    match joined {
        Ok(Some(Ok(Ok(())))) => tracing::debug!(device, "vhost-user thread ended"),
        Ok(Some(Ok(Err(e)))) => tracing::debug!(device, error = %e, "vhost-user thread ended"),
        Ok(Some(Err(_))) => tracing::warn!(device, "vhost-user thread panicked"),
        Ok(None) => tracing::warn!(device, "vhost-user thread did not end; left behind"),
        Err(e) => tracing::warn!(device, error = %e, "cannot join the vhost-user thread"),
    }
}

/// Boots the guest: resolves QEMU, the image and the accelerator, serves
/// the devices (vsock, virtio-fs, the session disk `session_disk`, rng),
/// starts QEMU and returns the machine with the future of the agent's
/// stream.
pub async fn boot(opts: &BootOptions, session_disk: &Path) -> Result<Booted, String> {
    let plan_parts = (
        find_qemu(),
        GuestImage::locate(opts.bundle_path.as_deref()).map_err(QemuError::from),
        choose_accel(),
    );
    let (qemu, image, (accel, accel_why)) = match plan_parts {
        (Ok(q), Ok(i), Ok(a)) => (q, i, a),
        (q, i, a) => {
            let errs: Vec<String> = [q.err(), i.err(), a.err()]
                .into_iter()
                .flatten()
                .map(|e| e.to_string())
                .collect();
            return Err(errs.join("; "));
        }
    };
    let host_cpus = std::thread::available_parallelism()
        .map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX))
        .unwrap_or(1);
    let userland = userland::plan(opts.userland, &image, opts.bundle_path.as_deref())
        .map_err(|e| e.to_string())?;
    let run_dir = RunDir::create().map_err(|e| e.to_string())?;
    let root_disks = userland
        .disks
        .iter()
        .enumerate()
        .map(|(i, disk)| RootDiskSocket {
            disk: disk.clone(),
            socket: run_dir.0.join(format!("root{i}.sock")),
        })
        .collect();
    let plan = QemuPlan {
        qemu,
        image,
        accel,
        memory_mib: memory_mib(opts.memory_gb),
        cpus: cpu_count(opts.cpu_count, host_cpus),
        vsock_socket: run_dir.0.join("vsock.sock"),
        fs_socket: run_dir.0.join("fs.sock"),
        blk_socket: run_dir.0.join("blk.sock"),
        rng_socket: run_dir.0.join("rng.sock"),
        session_disk: session_disk.to_path_buf(),
        root_disks,
        extra_cmdline: guest_log_word(std::env::var(GUEST_LOG_ENV).ok().as_deref())
            .into_iter()
            .collect(),
    };
    start(plan, run_dir, &accel_why, opts.fs, userland)
        .await
        .map_err(|e| e.to_string())
}

async fn start(
    plan: QemuPlan,
    run_dir: RunDir,
    accel_why: &str,
    fs_options: SessionFsOptions,
    userland: UserlandPlan,
) -> Result<Booted, QemuError> {
    let host = VsockHost::new()?;
    let listener = host.listen(AGENT_PORT)?;
    let server = VhostUserVsockServer::bind(
        &VhostUserVsockConfig::new(&plan.vsock_socket, GUEST_CID),
        &host,
    )?;
    let fs = Arc::new(SessionFs::new(fs_options));
    let mut fs_config = VhostUserFsConfig::new(&plan.fs_socket);
    fs_config.queue_size = FS_QUEUE_SIZE;
    let fs_server = VhostUserFsServer::bind(&fs_config, fs.clone())?;
    // Locked exclusively from here until the blk server thread ends.
    let disk = RawImage::open(&plan.session_disk)?;
    let blk_server = VhostUserBlkServer::bind(
        &plan.blk_socket,
        Box::new(disk),
        &BlkConfig::new(SESSION_DISK_SERIAL),
    )?;
    let blk_stats = blk_server.stats();
    let rng_server = VhostUserRngServer::bind(&plan.rng_socket)?;
    // Read-only: a shared lock, O_RDONLY, VIRTIO_BLK_F_RO.
    let mut root_servers = Vec::with_capacity(plan.root_disks.len());
    for root in &plan.root_disks {
        let image =
            RawImage::open_read_only(&root.disk.path).map_err(|source| QemuError::RootDisk {
                path: root.disk.path.clone(),
                source,
            })?;
        let server = VhostUserBlkServer::bind(
            &root.socket,
            Box::new(image),
            &BlkConfig::new(root.disk.serial),
        )?;
        root_servers.push((server, root.socket.clone()));
    }
    let vhost = server.spawn().map_err(QemuError::Thread)?;
    let fs_canceller = fs_server.canceller();
    let vhost_fs = match fs_server.spawn() {
        Ok(t) => t,
        Err(e) => {
            end_unconnected(&plan.vsock_socket, Some(vhost));
            return Err(QemuError::Thread(e));
        }
    };
    let end_vsock_fs = |vhost, vhost_fs: std::thread::JoinHandle<_>| {
        end_unconnected(&plan.vsock_socket, Some(vhost));
        fs_canceller.cancel();
        let _ = vhost_fs.join();
    };
    let vhost_blk = match blk_server.spawn() {
        Ok(t) => t,
        Err(e) => {
            end_vsock_fs(vhost, vhost_fs);
            return Err(QemuError::Thread(e));
        }
    };
    let vhost_rng = match rng_server.spawn() {
        Ok(t) => t,
        Err(e) => {
            end_vsock_fs(vhost, vhost_fs);
            end_unconnected(&plan.blk_socket, Some(vhost_blk));
            return Err(QemuError::Thread(e));
        }
    };
    let mut roots = Vec::with_capacity(root_servers.len());
    for (server, socket) in root_servers {
        match server.spawn() {
            Ok(t) => roots.push((Some(t), socket)),
            Err(e) => {
                end_vsock_fs(vhost, vhost_fs);
                end_unconnected(&plan.blk_socket, Some(vhost_blk));
                end_unconnected(&plan.rng_socket, Some(vhost_rng));
                for (t, socket) in roots {
                    end_unconnected(&socket, t);
                }
                return Err(QemuError::Thread(e));
            }
        }
    }

    let mut cmd = Command::new(&plan.qemu);
    cmd.args(plan.args())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .process_group(0);
    // SAFETY: the closure only calls async-signal-safe functions (prctl,
    // getppid, _exit) between fork and exec.
    let parent = std::process::id();
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The helper died before prctl took effect: do not start at all.
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let spawned = cmd.spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(source) => {
            // Unblock and end the vhost-user threads: no frontend will come.
            end_vsock_fs(vhost, vhost_fs);
            end_unconnected(&plan.blk_socket, Some(vhost_blk));
            end_unconnected(&plan.rng_socket, Some(vhost_rng));
            for (t, socket) in roots {
                end_unconnected(&socket, t);
            }
            return Err(QemuError::Spawn {
                qemu: plan.qemu.clone(),
                source,
            });
        }
    };
    let pid = child.id();
    tracing::info!(
        pid,
        qemu = %plan.qemu.display(),
        image = %plan.image.dir.display(),
        accel = plan.accel.as_str(),
        accel_reason = accel_why,
        memory_mib = plan.memory_mib,
        cpus = plan.cpus,
        "qemu started"
    );
    let console = Console::default();
    let mut pumps = Vec::new();
    if let Some(out) = child.stdout.take() {
        pumps.push(tokio::spawn(pump_console(out, console.clone(), "serial")));
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(tokio::spawn(pump_console(err, console.clone(), "qemu")));
    }
    let connected = Arc::new(AtomicBool::new(false));
    let agent = agent_stream(listener, console.clone(), connected.clone());
    let machine = QemuMachine {
        child,
        pid,
        console,
        pumps,
        connected,
        vhost: Some(vhost),
        vhost_socket: plan.vsock_socket.clone(),
        vhost_fs: Some(vhost_fs),
        fs_canceller,
        single_queue: Box::new(SingleQueueThreads {
            blk: Some(vhost_blk),
            blk_socket: plan.blk_socket.clone(),
            blk_stats,
            rng: Some(vhost_rng),
            rng_socket: plan.rng_socket.clone(),
            roots,
        }),
        _host: host,
        ended: None,
        _run_dir: run_dir,
    };
    Ok(Booted {
        machine: Machine::Qemu(machine),
        agent,
        host_paths: HostPaths::Shared(SharedFolders::new(fs)),
        userland: Some(userland),
    })
}

/// Ends a vhost-user server thread whose frontend never connected: a
/// throwaway connection unblocks its accept.
fn end_unconnected<T>(socket: &Path, thread: Option<std::thread::JoinHandle<T>>) {
    let _ = std::os::unix::net::UnixStream::connect(socket);
    if let Some(t) = thread {
        let _ = t.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn no_userland() -> UserlandPlan {
        UserlandPlan {
            disks: Vec::new(),
            expected: userland::UserlandKind::Initramfs,
            strict: false,
            skipped: Vec::new(),
        }
    }

    fn plan(accel: Accel, socket: &str) -> QemuPlan {
        QemuPlan {
            qemu: "/usr/bin/qemu-system-x86_64".into(),
            image: GuestImage {
                dir: "/img".into(),
                vmlinuz: "/img/vmlinuz".into(),
                initramfs: "/img/initramfs".into(),
                rootfs: None,
            },
            accel,
            memory_mib: 1024,
            cpus: 2,
            vsock_socket: socket.into(),
            fs_socket: Path::new(socket).with_file_name("fs.sock"),
            blk_socket: Path::new(socket).with_file_name("blk.sock"),
            rng_socket: Path::new(socket).with_file_name("rng.sock"),
            session_disk: "/data/sessiondata.img".into(),
            root_disks: Vec::new(),
            extra_cmdline: vec!["COWORK_LOG=debug".into()],
        }
    }

    /// The value following `key` in `args`, for each occurrence.
    fn values<'a>(args: &'a [OsString], key: &str) -> Vec<&'a str> {
        args.windows(2)
            .filter(|w| w[0] == key)
            .map(|w| w[1].to_str().unwrap())
            .collect()
    }

    #[test]
    fn qemu_command_line() {
        let a = plan(Accel::Tcg, "/run/x,y/vsock.sock").args();
        for flag in ["-nodefaults", "-nographic", "-no-reboot"] {
            assert!(a.iter().any(|x| x == flag), "{flag} missing: {a:?}");
        }
        assert_eq!(values(&a, "-accel"), ["tcg"]);
        assert_eq!(values(&a, "-cpu"), ["max"]);
        assert_eq!(values(&a, "-m"), ["1024M"]);
        assert_eq!(values(&a, "-smp"), ["2"]);
        assert_eq!(
            values(&a, "-object"),
            ["memory-backend-memfd,id=mem,size=1024M,share=on"]
        );
        assert_eq!(values(&a, "-numa"), ["node,memdev=mem"]);
        assert_eq!(values(&a, "-serial"), ["stdio"]);
        // A comma in the socket path must not split QEMU's option.
        assert_eq!(
            values(&a, "-chardev"),
            [
                "socket,id=vsock,path=/run/x,,y/vsock.sock",
                "socket,id=fs0,path=/run/x,,y/fs.sock",
                "socket,id=blk0,path=/run/x,,y/blk.sock",
                "socket,id=rng0,path=/run/x,,y/rng.sock"
            ]
        );
        // Every device is ours over vhost-user; QEMU's own rng is not used.
        assert_eq!(
            values(&a, "-device"),
            [
                "vhost-user-vsock-pci,chardev=vsock",
                "vhost-user-fs-pci,chardev=fs0,tag=cowork-sessions,queue-size=1024",
                "vhost-user-blk-pci,chardev=blk0,num-queues=1",
                "vhost-user-rng-pci,chardev=rng0"
            ]
        );
        // The image itself is never handed to QEMU.
        assert!(!a
            .iter()
            .any(|x| x.to_string_lossy().contains("sessiondata")));
        assert_eq!(values(&a, "-kernel"), ["/img/vmlinuz"]);
        assert_eq!(values(&a, "-initrd"), ["/img/initramfs"]);
        assert_eq!(
            values(&a, "-append"),
            [format!("{KERNEL_CMDLINE} COWORK_LOG=debug").as_str()]
        );
        let k = plan(Accel::Kvm, "/s").args();
        assert_eq!(values(&k, "-accel"), ["kvm"]);
        assert_eq!(values(&k, "-cpu"), ["host"]);

        // Root disks follow the fixed devices, each on its own socket; the
        // image path never reaches QEMU (our server opens it read-only).
        let mut with_roots = plan(Accel::Tcg, "/run/x/vsock.sock");
        for (i, serial) in [userland::BUNDLE_ROOTFS_SERIAL, userland::ROOTFS_SERIAL]
            .into_iter()
            .enumerate()
        {
            with_roots.root_disks.push(RootDiskSocket {
                disk: RootDisk {
                    path: format!("/bundle/rootfs{i}.img").into(),
                    serial,
                    kind: userland::UserlandKind::Default,
                },
                socket: format!("/run/x/root{i}.sock").into(),
            });
        }
        let r = with_roots.args();
        let devices = values(&r, "-device");
        assert_eq!(
            devices[4..],
            [
                "vhost-user-blk-pci,chardev=root0,num-queues=1",
                "vhost-user-blk-pci,chardev=root1,num-queues=1"
            ]
        );
        assert!(values(&r, "-chardev").contains(&"socket,id=root1,path=/run/x/root1.sock"));
        assert!(!r.iter().any(|x| x.to_string_lossy().contains("rootfs")));
    }

    #[test]
    fn sizes_and_log_words() {
        assert_eq!(memory_mib(None), DEFAULT_MEMORY_MIB);
        assert_eq!(memory_mib(Some(4.0)), 4096);
        assert_eq!(memory_mib(Some(0.5)), 512);
        assert_eq!(memory_mib(Some(0.01)), MIN_MEMORY_MIB);
        assert_eq!(memory_mib(Some(1e9)), MAX_MEMORY_MIB);
        for bad in [f64::NAN, f64::INFINITY, -2.0, 0.0] {
            assert_eq!(memory_mib(Some(bad)), DEFAULT_MEMORY_MIB, "{bad}");
        }
        assert_eq!(cpu_count(None, 8), DEFAULT_CPUS);
        assert_eq!(cpu_count(Some(4), 2), 2);
        assert_eq!(cpu_count(Some(0), 8), DEFAULT_CPUS);
        assert_eq!(cpu_count(Some(3), 0), 1);
        assert_eq!(
            guest_log_word(Some("info,guest_agent=debug")).as_deref(),
            Some("COWORK_LOG=info,guest_agent=debug")
        );
        for bad in [None, Some(""), Some("debug quiet"), Some("a;rm -rf /")] {
            assert_eq!(guest_log_word(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn console_lines_are_cleaned() {
        assert_eq!(
            clean_console_line(b"\x1bc\x1b[?7l\x1b[2JSeaBIOS (version 1)\r"),
            "SeaBIOS (version 1)"
        );
        assert_eq!(clean_console_line(b"a\tb\x07c  "), "a bc");
        assert_eq!(clean_console_line(b"\xff\xfeok"), "\u{fffd}\u{fffd}ok");
        assert_eq!(clean_console_line(b"\x1b["), "");
    }

    #[tokio::test]
    async fn console_tail_is_bounded_and_long_lines_are_cut() {
        let mut input = Vec::new();
        for i in 0..100 {
            input.extend_from_slice(format!("line {i}\r\n").as_bytes());
        }
        input.extend_from_slice(&vec![b'x'; MAX_CONSOLE_LINE + 10]);
        input.extend_from_slice(b"\n\n\nlast without newline");
        let console = Console::default();
        pump_console(&input[..], console.clone(), "test").await;
        let tail: Vec<String> = console.lines();
        assert_eq!(tail.len(), CONSOLE_TAIL);
        assert_eq!(tail[tail.len() - 1], "last without newline");
        assert_eq!(tail[tail.len() - 2], "x".repeat(10));
        assert_eq!(tail[tail.len() - 3], "x".repeat(MAX_CONSOLE_LINE));
        assert_eq!(tail[tail.len() - 4], "line 99");
        let q = console.quote(2);
        assert_eq!(
            q,
            format!(
                "; last console lines:\n  {}\n  last without newline",
                "x".repeat(10)
            )
        );
        assert!(Console::default().quote(3).contains("printed nothing"));
    }

    /// A stand-in for QEMU: a script that ignores QEMU's arguments.
    fn fake_qemu(dir: &Path, body: &str) -> PathBuf {
        let p = dir.join("fake-qemu");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    /// A plan for `qemu` whose sockets and (1 MiB) session disk live in `run_dir`.
    fn fake_plan(qemu: PathBuf, run_dir: &RunDir) -> QemuPlan {
        let session_disk = run_dir.0.join("sessiondata.img");
        devices::blk::create_sparse_image(&session_disk, 1 << 20).unwrap();
        QemuPlan {
            qemu,
            vsock_socket: run_dir.0.join("vsock.sock"),
            fs_socket: run_dir.0.join("fs.sock"),
            blk_socket: run_dir.0.join("blk.sock"),
            rng_socket: run_dir.0.join("rng.sock"),
            session_disk,
            ..plan(Accel::Tcg, "")
        }
    }

    #[tokio::test]
    async fn a_failed_boot_quotes_the_console_and_cleans_up() {
        let tmp = tempfile::tempdir().unwrap();
        let qemu = fake_qemu(
            tmp.path(),
            "echo 'Booting the kernel'; echo 'Kernel panic - not syncing: VFS' ; echo 'qemu: bad option' >&2; exit 1",
        );
        let run_dir = RunDir::create().unwrap();
        let dir = run_dir.0.clone();
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let booted = start(
            fake_plan(qemu, &run_dir),
            run_dir,
            "test",
            SessionFsOptions::default(),
            no_userland(),
        )
        .await
        .unwrap();
        let Machine::Qemu(mut m) = booted.machine else {
            panic!("not a QEMU machine")
        };
        let how = m.wait().await;
        assert!(how.contains("exit status: 1"), "{how}");
        assert!(how.contains("Kernel panic - not syncing: VFS"), "{how}");
        assert!(how.contains("qemu: bad option"), "{how}");
        // The vhost-user threads, whose frontend never came, were ended.
        assert!(m.vhost.is_none() && m.vhost_fs.is_none());
        assert!(m.single_queue.blk.is_none() && m.single_queue.rng.is_none());
        // The session disk was closed: its lock is free for the next VM.
        let disk = dir.join("sessiondata.img");
        drop(RawImage::open(&disk).expect("the session disk is still locked"));
        m.kill().await;
        drop(m);
        assert!(!dir.exists(), "runtime directory left behind");
        // Host folders are granted through the VM's share.
        let HostPaths::Shared(shared) = &booted.host_paths else {
            panic!("the QEMU backend shares host folders through virtio-fs")
        };
        let host = tempfile::tempdir().unwrap();
        let rel = host.path().to_str().unwrap().trim_start_matches('/');
        let src = booted
            .host_paths
            .grant("s1", "proj", rel, guest_agent::proto::MountMode::Ro)
            .unwrap();
        assert_eq!(
            src,
            format!("{}/s1/proj", guest_agent::proto::SESSIONS_FS_MOUNT)
        );
        assert_eq!(shared.fs().grants().len(), 1);
        booted.host_paths.release_session("s1");
        assert!(shared.fs().grants().is_empty());
    }

    #[tokio::test]
    async fn kill_before_the_agent_connected_does_not_wait() {
        let tmp = tempfile::tempdir().unwrap();
        let qemu = fake_qemu(tmp.path(), "echo started; exec sleep 600");
        let run_dir = RunDir::create().unwrap();
        let booted = start(
            fake_plan(qemu, &run_dir),
            run_dir,
            "test",
            SessionFsOptions::default(),
            no_userland(),
        )
        .await
        .unwrap();
        let Machine::Qemu(mut m) = booted.machine else {
            panic!("not a QEMU machine")
        };
        let pid = m.pid.unwrap();
        let t0 = Instant::now();
        m.kill().await;
        assert!(t0.elapsed() < POWEROFF_DEADLINE, "{:?}", t0.elapsed());
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "QEMU still there"
        );
        // Idempotent, and wait() reports the earlier end.
        m.kill().await;
        assert!(m.wait().await.contains("QEMU ended"));
    }

    #[test]
    fn stale_runtime_dirs_of_dead_helpers_are_swept() {
        let base = tempfile::tempdir().unwrap();
        // Above any pid_max, so never a live process.
        let dead = base.path().join("cowork-qemu-999999999-0");
        let live = base
            .path()
            .join(format!("cowork-qemu-{}-7", std::process::id()));
        let unrelated = base.path().join("cowork-qemu-x");
        for d in [&dead, &live, &unrelated] {
            std::fs::create_dir(d).unwrap();
        }
        sweep_stale_run_dirs(base.path());
        assert!(!dead.exists());
        assert!(live.exists() && unrelated.exists());
    }

    #[tokio::test]
    async fn the_session_disk_is_exclusive_and_released_when_boot_fails() {
        let tmp = tempfile::tempdir().unwrap();
        let disk = tmp.path().join("sessiondata.img");
        devices::blk::create_sparse_image(&disk, 1 << 20).unwrap();
        let plan_with_disk = |run_dir: &RunDir| QemuPlan {
            session_disk: disk.clone(),
            ..fake_plan("/nonexistent/qemu-system-x86_64".into(), run_dir)
        };
        // Another VM holds the disk: refused, saying so.
        let holder = RawImage::open(&disk).unwrap();
        let run_dir = RunDir::create().unwrap();
        match start(
            plan_with_disk(&run_dir),
            run_dir,
            "test",
            SessionFsOptions::default(),
            no_userland(),
        )
        .await
        {
            Err(e @ QemuError::SessionDisk(ImageError::Locked(_))) => {
                assert!(e.to_string().contains("in use by another VM"), "{e}")
            }
            Err(e) => panic!("unexpected error: {e}"),
            Ok(_) => panic!("served a disk another VM holds"),
        }
        drop(holder);
        // A boot that fails after the disk was opened closes it again.
        let run_dir = RunDir::create().unwrap();
        match start(
            plan_with_disk(&run_dir),
            run_dir,
            "test",
            SessionFsOptions::default(),
            no_userland(),
        )
        .await
        {
            Err(QemuError::Spawn { .. }) => {}
            Err(e) => panic!("unexpected error: {e}"),
            Ok(_) => panic!("started a missing binary"),
        }
        drop(RawImage::open(&disk).expect("the session disk is still locked"));
    }

    #[tokio::test]
    async fn a_missing_qemu_binary_is_a_clear_error() {
        let run_dir = RunDir::create().unwrap();
        let plan = fake_plan("/nonexistent/qemu-system-x86_64".into(), &run_dir);
        match start(
            plan,
            run_dir,
            "test",
            SessionFsOptions::default(),
            no_userland(),
        )
        .await
        {
            Err(QemuError::Spawn { qemu, .. }) => {
                assert_eq!(qemu, PathBuf::from("/nonexistent/qemu-system-x86_64"))
            }
            Err(e) => panic!("unexpected error: {e}"),
            Ok(_) => panic!("started a missing binary"),
        }
    }
}
