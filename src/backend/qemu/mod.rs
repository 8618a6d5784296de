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
//! Warm start (`--snapshot auto`, the default, with an image whose agent
//! has `template-console`; [`warm`]): the first start of a machine shape
//! boots in [`Layout::Migratable`] (no vsock, virtio-fs or rng device on
//! the command line, RAM in the helper's memfd, QMP on a socket in the run
//! directory), takes the boot snapshot when the agent prints its template
//! point on the console, and hot-plugs the three devices; later starts
//! restore that snapshot (QEMU `-S -incoming defer`, the state loaded,
//! the devices hot-plugged, `cont`) and the agent, polling for its vsock
//! device, dials in from its template point. A snapshot that cannot be
//! restored is removed and the same start boots cold (and takes a new
//! one). `--snapshot off` boots with every device on the command line.
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
//! running QEMU and its end), `rundir` (the private socket directory),
//! `qmp` (the QMP client), [`warm`] (the boot snapshot's files, key,
//! save, load and hot-plug); this file serves the devices and starts
//! QEMU.

mod machine;
mod plan;
mod qmp;
mod rundir;
#[cfg(test)]
mod tests;
pub mod warm;

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

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
use super::guest::{
    accept_agent, agent_stream, cmdline_words, AgentDialError, EgressAcceptor, EgressServeError,
    AGENT_DIAL_TIMEOUT, GUEST_CID,
};
use super::image::{GuestImage, NoImage};
use super::sizing;
use super::snapstore::Store;
use super::userland::{self, UserlandError, UserlandPlan};
use super::{AgentStream, BackendMachine, BootOptions, Booted, HostPaths};
use crate::egress::EgressProxy;
use machine::{pump_console, SingleQueueThreads, VhostThread};
pub use machine::{QemuEnd, QemuMachine};
pub use plan::{
    choose_accel, find_qemu, qemu_opt_escape, Accel, Hotplug, Layout, QemuPlan, RootDiskSocket,
    ACCEL_ENV, DEFAULT_QEMU, FS_QUEUE_SIZE, KERNEL_CMDLINE, QEMU_ENV,
};
use qmp::Qmp;
use rundir::RunDir;
use warm::{Prepared, QemuIdentity, WarmError, QEMU_STORE};

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
    #[error("cannot make the guest's memory for the boot snapshot: {0}")]
    Memory(WarmError),
    #[error("cannot restore the boot snapshot: {0}")]
    Restore(WarmError),
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
    let memory_mib = memory_mib(opts.memory_gb);
    let cpus = sizing::cpu_count(opts.cpu_count, host_cpus);
    let extra_cmdline = cmdline_words(
        opts.guest_log.as_deref(),
        opts.guest_root_session.as_deref(),
    );
    // The plan of a machine whose sockets live in `dir`.
    let plan_in = |dir: &Path, layout: Layout| -> QemuPlan {
        let root_disks = userland
            .disks
            .iter()
            .enumerate()
            .map(|(i, disk)| RootDiskSocket {
                disk: disk.clone(),
                socket: dir.join(format!("root{i}.sock")),
            })
            .collect();
        let layout = match layout {
            Layout::Migratable {
                ram_fd, incoming, ..
            } => Layout::Migratable {
                ram_fd,
                qmp: dir.join("qmp.sock"),
                incoming,
            },
            Layout::Full => Layout::Full,
        };
        QemuPlan {
            qemu: qemu.clone(),
            image: image.clone(),
            accel,
            memory_mib,
            cpus,
            vsock_socket: dir.join("vsock.sock"),
            fs_socket: dir.join("fs.sock"),
            blk_socket: dir.join("blk.sock"),
            rng_socket: dir.join("rng.sock"),
            session_disk: session_disk.to_path_buf(),
            root_disks,
            extra_cmdline: extra_cmdline.clone(),
            layout,
        }
    };
    // A run directory per attempt: a failed restore's sockets are not reused.
    let make_plan = |layout: Layout| -> Result<(QemuPlan, RunDir), QemuError> {
        let run_dir = RunDir::create(&opts.host)?;
        Ok((plan_in(&run_dir.0, layout), run_dir))
    };
    // Snapshots need an agent that says its template point on the console.
    let store = if image.template_console {
        // The key names no socket or descriptor: any directory will do.
        let probe = plan_in(
            Path::new(""),
            Layout::Migratable {
                ram_fd: -1,
                qmp: PathBuf::new(),
                incoming: false,
            },
        );
        Store::new(&opts.snapshot, QEMU_STORE, || snapshot_key(&probe))
    } else {
        None
    };
    let Some(store) = store else {
        let (plan, run_dir) = make_plan(Layout::Full)?;
        return start(
            plan,
            run_dir,
            &accel_why,
            opts,
            &userland,
            egress,
            Start::Cold,
        )
        .await;
    };
    let mem_bytes = memory_mib << 20;
    if store.exists() {
        let began = std::time::Instant::now();
        let restored = match Prepared::open(&store, mem_bytes) {
            Ok(prepared) => {
                let ram_ms = began.elapsed().as_secs_f64() * 1e3;
                let (plan, run_dir) = make_plan(Layout::Migratable {
                    ram_fd: prepared.ram.as_raw_fd(),
                    qmp: PathBuf::new(),
                    incoming: true,
                })?;
                let restore = Start::Restore {
                    prepared,
                    ram_ms,
                    began,
                };
                start(plan, run_dir, &accel_why, opts, &userland, egress, restore).await
            }
            Err(e) => Err(QemuError::Restore(e)),
        };
        match restored {
            Ok(booted) => {
                store.touch_and_prune();
                return Ok(booted);
            }
            // Not the snapshot's fault (QEMU missing, the session disk
            // locked, ...): a cold boot would fail the same way.
            Err(e) if !matches!(e, QemuError::Restore(_)) => return Err(e),
            Err(e) => {
                tracing::warn!(
                    dir = %store.dir().display(),
                    error = %e,
                    "the boot snapshot cannot be restored; removed, booting cold"
                );
                store.discard();
            }
        }
    }
    let ram = warm::guest_ram(mem_bytes).map_err(QemuError::Memory)?;
    let (plan, run_dir) = make_plan(Layout::Migratable {
        ram_fd: ram.as_raw_fd(),
        qmp: PathBuf::new(),
        incoming: false,
    })?;
    let take = Start::Take {
        store,
        ram,
        mem_bytes,
    };
    start(plan, run_dir, &accel_why, opts, &userland, egress, take).await
}

/// The snapshot key of a machine planned as `plan` (its migratable layout).
fn snapshot_key(plan: &QemuPlan) -> String {
    let session_disk_bytes = std::fs::metadata(&plan.session_disk).map_or(0, |m| m.len());
    let hotplugs = plan.hotplugs();
    let mut devices: Vec<&str> = vec!["vhost-user-blk-pci"; 1 + plan.root_disks.len()];
    devices.push(plan::BALLOON_DEVICE);
    devices.push(plan::VMGENID_DEVICE);
    devices.extend(hotplugs.iter().map(|h| h.driver));
    QemuIdentity {
        qemu: &plan.qemu,
        accel: plan.accel,
        kernel: &plan.image.vmlinuz,
        initrd: &plan.image.initramfs,
        root_disks: plan
            .root_disks
            .iter()
            .map(|r| r.disk.path.as_path())
            .collect(),
        cmdline: &plan.cmdline(),
        mem_mib: plan.memory_mib,
        cpus: plan.cpus,
        devices,
        session_disk_bytes,
    }
    .key()
}

/// How [`start`] starts the machine.
enum Start {
    /// Every device on the command line; no snapshot.
    Cold,
    /// The migratable layout, booted; the boot snapshot is taken into
    /// `store` at the agent's template point (`ram` is the guest's RAM).
    Take {
        store: Store,
        ram: std::fs::File,
        mem_bytes: u64,
    },
    /// The migratable layout, restored from `prepared` (its RAM copied in
    /// `ram_ms`; `began` when the restore began).
    Restore {
        prepared: Prepared,
        ram_ms: f64,
        began: std::time::Instant,
    },
}

async fn start(
    plan: QemuPlan,
    run_dir: RunDir,
    accel_why: &str,
    opts: &BootOptions,
    userland: &UserlandPlan,
    egress: &EgressProxy,
    how: Start,
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
    // QEMU opens the guest's RAM through /proc/self/fd (Layout::Migratable).
    let ram_fd = match &plan.layout {
        Layout::Migratable { ram_fd, .. } => Some(*ram_fd),
        Layout::Full => None,
    };
    // SAFETY: the closure only calls async-signal-safe functions (prctl,
    // getppid, fcntl, _exit) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The helper died before prctl took effect: do not start at all.
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            // Inherited by QEMU only: the flag is cleared in the child.
            if let Some(fd) = ram_fd {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let console = Console::default();
    // Registered before QEMU runs, so the mark cannot be missed.
    let mark = matches!(how, Start::Take { .. })
        .then(|| console.watch(guest_agent::proto::TEMPLATE_CONSOLE_MARK));
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
        start = match how {
            Start::Restore { .. } => "warm",
            Start::Cold | Start::Take { .. } => "cold",
        },
        "qemu started"
    );
    let mut pumps = Vec::new();
    if let Some(out) = child.stdout.take() {
        pumps.push(tokio::spawn(pump_console(out, console.clone(), "serial")));
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(tokio::spawn(pump_console(err, console.clone(), "qemu")));
    }
    let connected = Arc::new(AtomicBool::new(false));
    let qmp_socket = match &plan.layout {
        Layout::Migratable { qmp, .. } => qmp.clone(),
        Layout::Full => PathBuf::new(),
    };
    let hotplugs = plan.hotplugs();
    let mut machine = QemuMachine {
        child,
        pid,
        console: console.clone(),
        pumps,
        connected: connected.clone(),
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
    let agent = match how {
        Start::Cold => agent_stream(listener, console, connected),
        Start::Restore {
            prepared,
            ram_ms,
            began,
        } => {
            let restored = restore(&qmp_socket, &prepared, &hotplugs).await;
            let ram_mib = prepared.ram_data >> 20;
            // QEMU has its own mapping of the RAM now.
            drop(prepared);
            match restored {
                Ok(times) => tracing::info!(
                    generation_id = %times.generation_id,
                    ram_mib,
                    ram_ms,
                    load_ms = times.load_ms,
                    hotplug_ms = times.hotplug_ms,
                    total_ms = began.elapsed().as_secs_f64() * 1e3,
                    "qemu boot snapshot restored"
                ),
                Err(e) => {
                    machine.kill_by(Instant::now()).await;
                    return Err(QemuError::Restore(e));
                }
            }
            agent_stream(listener, console, connected)
        }
        Start::Take {
            store,
            ram,
            mem_bytes,
        } => agent_after_snapshot(
            listener,
            console,
            connected,
            mark,
            Snapshotter {
                qmp: qmp_socket,
                store,
                ram,
                mem_bytes,
                hotplugs,
            },
        ),
    };
    Ok(Booted {
        machine: BackendMachine::Qemu(machine),
        agent,
        host_paths: HostPaths::Shared(SharedFolders::new(fs)),
        userland: Some(userland.clone()),
    })
}

/// How long a restore's steps took (ms), and the machine's generation ID.
struct RestoreTimes {
    /// The VM generation ID the restored guest sees (QEMU's
    /// `query-vm-generation-id`; new in every restore).
    generation_id: String,
    /// QEMU's QMP up to the device state loaded.
    load_ms: f64,
    /// The hot-plugs and `cont`.
    hotplug_ms: f64,
}

/// Loads `prepared`'s device state into the QEMU listening on `qmp`
/// (started paused, `-incoming defer`), hot-plugs `hotplugs` and runs the
/// machine.
async fn restore(
    qmp: &Path,
    prepared: &Prepared,
    hotplugs: &[Hotplug],
) -> Result<RestoreTimes, WarmError> {
    let began = Instant::now();
    let deadline = tokio::time::Instant::now() + warm::LOAD_LIMIT;
    let mut qmp = Qmp::connect(qmp, deadline).await?;
    warm::load(&mut qmp, &prepared.state).await?;
    let loaded = Instant::now();
    warm::hotplug(&mut qmp, hotplugs).await?;
    qmp.cont().await?;
    let generation_id = warm::generation_id(&mut qmp).await;
    Ok(RestoreTimes {
        generation_id,
        load_ms: (loaded - began).as_secs_f64() * 1e3,
        hotplug_ms: loaded.elapsed().as_secs_f64() * 1e3,
    })
}

/// What the snapshot-taking machine's agent future needs to take the
/// snapshot and give the machine its hot-plugged devices.
struct Snapshotter {
    /// QEMU's QMP socket.
    qmp: PathBuf,
    store: Store,
    /// The guest's RAM (the helper's memfd).
    ram: std::fs::File,
    mem_bytes: u64,
    hotplugs: Vec<Hotplug>,
}

impl Snapshotter {
    /// Takes the snapshot of the machine `qmp` runs and lets it run on; a
    /// failure is logged (the next start boots cold again), never fatal.
    async fn take(&self, qmp: &mut Qmp) {
        match warm::save(qmp, &self.ram, self.mem_bytes, &self.store).await {
            Ok(pending) => {
                let stopped_ms = pending.stopped.as_secs_f64() * 1e3;
                if let Err(e) = qmp.cont().await {
                    tracing::warn!(error = %e, "cannot continue the machine after its snapshot");
                    pending.abandon();
                    return;
                }
                let (ram_data, state_bytes) = (pending.ram_data, pending.state_bytes);
                let store = self.store.clone();
                // Synced and renamed while the machine runs on.
                tokio::task::spawn_blocking(move || match pending.commit() {
                    Ok(()) => {
                        tracing::info!(
                            dir = %store.dir().display(),
                            memory_data_mib = ram_data >> 20,
                            state_bytes,
                            stopped_ms,
                            "boot snapshot taken"
                        );
                        store.touch_and_prune();
                    }
                    Err(e) => tracing::warn!(
                        dir = %store.dir().display(),
                        error = %e,
                        "cannot take the boot snapshot; the next start boots cold again"
                    ),
                });
            }
            Err(e) => {
                tracing::warn!(
                    dir = %self.store.dir().display(),
                    error = %e,
                    "cannot take the boot snapshot; the next start boots cold again"
                );
                if let Err(e) = qmp.cont().await {
                    tracing::warn!(error = %e, "cannot continue the machine after its snapshot");
                }
            }
        }
    }
}

/// The agent's stream of a machine that takes the boot snapshot: once the
/// agent prints its template point (`mark`), the machine is saved
/// ([`Snapshotter::take`]); then (or at the deadline, without a snapshot)
/// the vsock, virtio-fs and entropy devices are hot-plugged and the agent,
/// polling for its vsock device, dials in.
fn agent_after_snapshot(
    mut listener: devices::vsock::Listener,
    console: Console,
    connected: Arc<AtomicBool>,
    mark: Option<tokio::sync::oneshot::Receiver<String>>,
    snapshotter: Snapshotter,
) -> AgentStream {
    Box::pin(async move {
        let deadline = tokio::time::Instant::now() + AGENT_DIAL_TIMEOUT;
        let hotplug_failed = |e: WarmError| AgentDialError::Hotplug {
            source: Box::new(e),
            console: console.quote(super::console::QUOTED_LINES),
        };
        let mut qmp = Qmp::connect(&snapshotter.qmp, deadline)
            .await
            .map_err(|e| hotplug_failed(e.into()))?;
        let ready = warm::prepare_source(&mut qmp).await;
        let marked = match mark {
            Some(mark) => tokio::time::timeout_at(deadline, mark)
                .await
                .map(Result::ok),
            None => Ok(None),
        };
        match (marked, ready) {
            (Ok(Some(line)), Ok(())) => {
                tracing::debug!(line = %line, "the guest is at its template point");
                snapshotter.take(&mut qmp).await;
            }
            (Ok(Some(_)), Err(e)) => tracing::warn!(
                error = %e,
                "cannot take the boot snapshot; the next start boots cold again"
            ),
            (Ok(None), _) => tracing::warn!("the console closed before the template point"),
            (Err(_), _) => tracing::warn!(
                "the guest agent never said its template point on the console; no boot snapshot"
            ),
        }
        drop(snapshotter.ram);
        warm::hotplug(&mut qmp, &snapshotter.hotplugs)
            .await
            .map_err(hotplug_failed)?;
        drop(qmp);
        accept_agent(&mut listener, &console, &connected, deadline).await
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
