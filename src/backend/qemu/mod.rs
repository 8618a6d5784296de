//! The QEMU backend (`--backend qemu`): the guest agent runs as PID 1 of a
//! real Linux guest booted by `qemu-system-x86_64`, and reaches the helper
//! over our own virtio-vsock device, served as vhost-user from inside this
//! process (crate `devices`).
//!
//! Boot: the guest image (`vmlinuz`, `initramfs`, `image-info`; built by
//! `scripts/mkguestimage.sh`) is found by [`ImageSearch`](super::image::ImageSearch) (`startVM.bundlePath`
//! when that directory holds one of ours, `--guest-image-dir`, a
//! checkout's `target/guest-image`, the installed system directory, ...;
//! its doc is the one list of places). QEMU runs
//! with KVM where `/dev/kvm` can run Linux
//! (`vmm::kvm_check::linux_capable`), else TCG (`--qemu-accel`,
//! `$COWORK_QEMU_ACCEL`, overrides), on an i440fx `pc` machine with memfd-shared guest memory
//! (vhost-user needs it), `-nodefaults -nographic`, the serial console on
//! QEMU's stdout, and `vhost-user-vsock-pci`, `vhost-user-fs-pci`,
//! `vhost-user-blk-pci` (the session disk) and `vhost-user-rng-pci` on
//! sockets in a private 0700 directory, every device served from threads of
//! this process, plus QEMU's own `virtio-balloon-pci` with free page
//! reporting (memory the guest frees goes back to the host). The agent dials CID 2 port 51234; the device hands the
//! helper a socketpair end, which becomes the agent link. The guest's relay
//! dials port [`guest_agent::proto::EGRESS_PORT`], served by the host egress
//! proxy through an [`EgressAcceptor`] until the machine ends.
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
//! removed and long lines cut; the last lines are kept and quoted when the
//! boot fails or the machine ends unexpectedly (see [`super::console`]).
//!
//! Lifetime: QEMU is started with `kill_on_drop`, in its own process group,
//! with `PR_SET_PDEATHSIG` = SIGKILL, so it never outlives the helper. The
//! pdeath signal fires when the *thread* that forked QEMU exits: [`boot`]
//! must run on a runtime worker thread (as the daemon's requests do), never
//! on a short-lived blocking-pool thread. On stop the controller first asks
//! the agent to shut down (the agent powers the guest off);
//! [`QemuMachine::kill`] then gives QEMU
//! [`POWEROFF_DEADLINE`](super::guest::POWEROFF_DEADLINE) to exit before
//! killing it ([`QemuMachine::kill_by`]: less when the helper is exiting).
//!
//! Limits: x86_64 guests only; no network besides vsock (the egress proxy
//! is the only way out). Files in shared folders are
//! created with the helper's uid (`devices::fs::Credentials::Helper`).
//!
//! Modules: `plan` (binary, accelerator, command line), `machine` (the
//! running QEMU and its end), `rundir` (the private socket directory);
//! this file serves the devices and starts QEMU.

mod machine;
mod plan;
mod rundir;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use devices::blk::{BlkConfig, ImageError, RawImage, SESSION_DISK_SERIAL};
use devices::fs::SessionFs;
use devices::vhost_user::blk::{VhostUserBlkError, VhostUserBlkServer, VhostUserServeError};
use devices::vhost_user::fs::{VhostUserFsConfig, VhostUserFsError, VhostUserFsServer};
use devices::vhost_user::rng::VhostUserRngServer;
use devices::vhost_user::vsock::{VhostUserVsockConfig, VhostUserVsockError, VhostUserVsockServer};
use devices::vsock::{HostError, VsockHost};
use guest_agent::proto::AGENT_PORT;
use tokio::process::Command;

use super::console::Console;
use super::fsgrants::SharedFolders;
use super::guest::{agent_stream, cmdline_words, EgressAcceptor, EgressServeError, GUEST_CID};
use super::image::{GuestImage, NoImage};
use super::sizing;
use super::userland::{self, UserlandError, UserlandPlan};
use super::{BackendMachine, BootOptions, Booted, HostPaths};
use crate::egress::EgressProxy;
use machine::{pump_console, SingleQueueThreads, VhostThread};
pub use machine::{QemuEnd, QemuMachine};
pub use plan::{
    choose_accel, find_qemu, qemu_opt_escape, Accel, QemuPlan, RootDiskSocket, ACCEL_ENV,
    DEFAULT_QEMU, FS_QUEUE_SIZE, KERNEL_CMDLINE, QEMU_ENV,
};
use rundir::RunDir;

/// Guest memory when `startVM` does not say.
pub const DEFAULT_MEMORY_MIB: u64 = 2048;

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
    #[error(transparent)]
    Egress(#[from] EgressServeError),
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
    /// More than one of QEMU, the guest image and the accelerator is
    /// missing (one alone is reported as itself).
    #[error("{}", join_errors(.0))]
    Unavailable(Vec<QemuError>),
}

/// Each error's message, separated by `"; "`.
fn join_errors(errors: &[QemuError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Guest memory for a `startVM.memoryGB` value.
pub fn memory_mib(memory_gb: Option<f64>) -> u64 {
    sizing::memory_mib(memory_gb, DEFAULT_MEMORY_MIB)
}

/// What the daemon needs to know about QEMU here (for `auto` and `doctor`).
#[derive(Debug)]
pub struct Probe {
    pub qemu: Result<PathBuf, QemuError>,
    pub image: Result<GuestImage, NoImage>,
    /// The accelerator and why it was chosen.
    pub accel: Result<(Accel, String), QemuError>,
}

impl Probe {
    /// Looks for QEMU, the guest image and the accelerator as `opts` say
    /// (`--qemu`, `--qemu-accel`, the image search, `PATH`).
    pub fn run(opts: &BootOptions) -> Probe {
        Probe {
            qemu: find_qemu(opts.qemu.as_deref(), &opts.host),
            image: opts.images.locate(None),
            accel: choose_accel(opts.qemu_accel.as_deref()),
        }
    }

    /// Whether the backend can start here.
    pub fn usable(&self) -> bool {
        self.qemu.is_ok() && self.image.is_ok() && self.accel.is_ok()
    }
}

/// Boots the guest: resolves QEMU, the image and the accelerator, serves
/// the devices (vsock, virtio-fs, the session disk `session_disk`, rng),
/// starts QEMU and returns the machine with the future of the agent's
/// stream. The guest's egress connections are served by `egress` until the
/// machine ends.
pub async fn boot(
    opts: &BootOptions,
    session_disk: &Path,
    egress: &EgressProxy,
) -> Result<Booted, QemuError> {
    let plan_parts = (
        find_qemu(opts.qemu.as_deref(), &opts.host),
        opts.images
            .locate(opts.bundle_path.as_deref())
            .map_err(QemuError::from),
        choose_accel(opts.qemu_accel.as_deref()),
    );
    let (qemu, image, (accel, accel_why)) = match plan_parts {
        (Ok(q), Ok(i), Ok(a)) => (q, i, a),
        (q, i, a) => {
            let mut errs: Vec<QemuError> =
                [q.err(), i.err(), a.err()].into_iter().flatten().collect();
            return Err(match errs.len() {
                1 => errs.remove(0),
                _ => QemuError::Unavailable(errs),
            });
        }
    };
    let host_cpus = sizing::host_cpus();
    let userland = userland::plan(opts.userland, &image, opts.bundle_path.as_deref())?;
    let run_dir = RunDir::create(&opts.host)?;
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
        cpus: sizing::cpu_count(opts.cpu_count, host_cpus),
        vsock_socket: run_dir.0.join("vsock.sock"),
        fs_socket: run_dir.0.join("fs.sock"),
        blk_socket: run_dir.0.join("blk.sock"),
        rng_socket: run_dir.0.join("rng.sock"),
        session_disk: session_disk.to_path_buf(),
        root_disks,
        extra_cmdline: cmdline_words(
            opts.guest_log.as_deref(),
            opts.guest_root_session.as_deref(),
        ),
    };
    start(plan, run_dir, &accel_why, opts, userland, egress).await
}

async fn start(
    plan: QemuPlan,
    run_dir: RunDir,
    accel_why: &str,
    opts: &BootOptions,
    userland: UserlandPlan,
    egress: &EgressProxy,
) -> Result<Booted, QemuError> {
    let host = VsockHost::new()?;
    let listener = host.listen(AGENT_PORT)?;
    // Dropped (port freed, thread joined) on any failure below.
    let egress = EgressAcceptor::start(&host, egress.clone())?;
    let server = VhostUserVsockServer::bind(
        &VhostUserVsockConfig::new(&plan.vsock_socket, GUEST_CID),
        &host,
    )?
    // Every vhost-user server filters the threads that serve QEMU with the
    // daemon's --seccomp (devices::vhost_user).
    .seccomp(opts.seccomp);
    let fs = Arc::new(SessionFs::new(opts.fs));
    let mut fs_config = VhostUserFsConfig::new(&plan.fs_socket);
    fs_config.queue_size = FS_QUEUE_SIZE;
    let fs_server = VhostUserFsServer::bind(&fs_config, fs.clone())?.seccomp(opts.seccomp);
    // Locked exclusively from here until the blk server thread ends.
    let disk = RawImage::open(&plan.session_disk)?;
    let blk_server = VhostUserBlkServer::bind(
        &plan.blk_socket,
        Box::new(disk),
        &BlkConfig::new(SESSION_DISK_SERIAL),
    )?
    .seccomp(opts.seccomp);
    let blk_stats = blk_server.stats();
    let rng_server = VhostUserRngServer::bind(&plan.rng_socket)?.seccomp(opts.seccomp);
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
        )?
        .seccomp(opts.seccomp);
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
    // Ends the session disk, rng and root disk servers once all of them
    // (the roots: those started so far) were started.
    let end_single_queue =
        |blk: VhostThread, rng: VhostThread, roots: Vec<(VhostThread, PathBuf)>| {
            end_unconnected(&plan.blk_socket, blk);
            end_unconnected(&plan.rng_socket, rng);
            for (t, socket) in roots {
                end_unconnected(&socket, t);
            }
        };
    let mut roots = Vec::with_capacity(root_servers.len());
    for (server, socket) in root_servers {
        match server.spawn() {
            Ok(t) => roots.push((Some(t), socket)),
            Err(e) => {
                end_vsock_fs(vhost, vhost_fs);
                end_single_queue(Some(vhost_blk), Some(vhost_rng), roots);
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
    let parent = std::process::id();
    // SAFETY: the closure only calls async-signal-safe functions (prctl,
    // getppid, _exit) between fork and exec.
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
            end_single_queue(Some(vhost_blk), Some(vhost_rng), roots);
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
        egress,
        _host: host,
        ended: None,
        _run_dir: run_dir,
    };
    Ok(Booted {
        machine: BackendMachine::Qemu(machine),
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
