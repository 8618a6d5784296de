//! The in-process KVM backend (`--backend kvm`): the guest agent runs as
//! PID 1 of a real Linux guest booted by our own VMM (crate `vmm`) inside
//! the helper process, and reaches the helper over our virtio-vsock device
//! on virtio-mmio (crate `devices`), with no socket file and no extra
//! process in between.
//!
//! Boot: the guest image is found exactly like the QEMU backend finds it
//! ([`ImageSearch`], whose doc is the one list of places). When the image
//! directory also holds an uncompressed ELF [`VMLINUX`] it is booted
//! (PVH entry, no decompression), else the image's bzImage `vmlinuz`. The
//! machine gets `startVM.memoryGB` (default [`DEFAULT_MEMORY_MIB`]) and
//! `startVM.cpuCount` vCPUs (default [`sizing::DEFAULT_CPUS`], at most the
//! host's CPUs and [`MAX_CPUS`]), the command line [`KERNEL_CMDLINE`] (plus `COWORK_LOG=` from
//! `--guest-log`), and these virtio-mmio devices, which the guest
//! kernel finds through the `LNRO0005` entries of the VMM's DSDT once the
//! agent loaded `virtio_mmio`: vsock (guest CID [`GUEST_CID`]; the agent
//! dials CID 2 port [`AGENT_PORT`] and the device hands the helper a
//! socketpair end, which becomes the agent link; the guest's relay dials
//! port [`guest_agent::proto::EGRESS_PORT`], served by the host egress proxy
//! through an [`EgressAcceptor`]), virtio-fs (the session
//! share, tag [`guest_agent::proto::SESSIONS_FS_TAG`], granted through
//! [`HostPaths::Shared`] as with QEMU), virtio-blk (the profile's session
//! disk `sessiondata.img`, read-write with serial
//! [`devices::blk::SESSION_DISK_SERIAL`], locked exclusively while the VM
//! exists and flushed and closed when it ends; the agent formats it as
//! ext4 when blank and mounts it at `/sessions`), virtio-rng, the userland's
//! read-only root disks, and virtio-balloon with free page reporting (the
//! guest reports pages it freed, [`HostMappingReleaser`] drops them from the
//! helper's RSS; the balloon itself is never inflated). The host must be
//! able to run Linux under KVM ([`vmm::kvm_check::linux_capable`]); on a
//! host that cannot (no VT-x/AMD-V, or PVM) `startVM` fails at once with
//! the reason instead of booting a kernel that would die half way.
//!
//! Threads: [`vmm::Vm::build`] and [`vmm::Vm::run`] run on one dedicated
//! thread named [`VM_THREAD_NAME`]; `run` adds one thread per vCPU and one
//! worker per device, and joins all of them, closing every fd the VM held,
//! before it returns. The thread reports the build, then how the run ended.
//!
//! Console: every line the guest prints on COM1 is logged at debug, one
//! event per line (control characters removed, long lines cut); the last
//! lines are kept and quoted when the boot fails or the machine ends
//! unexpectedly (see [`super::console`]). The agent's boot marks on the VMM's
//! boot-timing port are logged with the run's end.
//!
//! Stop: the controller first asks the agent to shut down (the agent powers
//! the guest off through ACPI S5, which ends the run); [`KvmMachine::kill_by`]
//! gives the guest [`POWEROFF_DEADLINE`](super::guest::POWEROFF_DEADLINE) for that (less when the helper is
//! exiting), then stops the VM from the host ([`vmm::StopHandle`]) and
//! joins the thread.
//!
//! Limits: x86_64 hosts with hardware virtualisation only; no network
//! besides vsock (the egress proxy is the only way out); guest
//! memory is anonymous and never pre-touched, so the helper's RSS grows by
//! what the guest touches and shrinks again, a few seconds later, by what
//! the guest frees in runs of 2 MiB or more (free page reporting). Files in
//! shared folders are created with the helper's uid, as with QEMU.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devices::balloon::{BalloonDevice, HostMappingReleaser};
use devices::blk::{
    BlkConfig, BlkDevice, BlkDeviceError, ImageError, RawImage, SESSION_DISK_SERIAL,
};
use devices::fs::device::{FsDevice, FsDeviceError};
use devices::fs::SessionFs;
use devices::rng::RngDevice;
use devices::vsock::{HostError, Listener, VsockConfig, VsockDevice, VsockDeviceError, VsockHost};
use guest_agent::proto::{AGENT_PORT, SESSIONS_FS_TAG};
use tokio::sync::oneshot;

use super::console::{Console, ConsoleLines, ConsoleQuote, QUOTED_LINES};
use super::fsgrants::SharedFolders;
use super::guest::{
    accept_agent, agent_stream, cmdline_words, EgressAcceptor, EgressServeError,
    AGENT_DIAL_TIMEOUT, GUEST_CID,
};
pub use super::guest::{kvm_for_linux, KvmUnavailable};
use super::image::{GuestImage, ImageSearch, NoImage};
use super::sizing;
use super::userland::{self, UserlandError};
use super::{AgentStream, BackendMachine, BootOptions, Booted, HostPaths};
use crate::egress::EgressProxy;
use warm::Store;

pub mod warm;

/// Uncompressed ELF kernel preferred over `vmlinuz` when an image has one.
pub const VMLINUX: &str = "vmlinux";
/// Guest memory when `startVM` does not say.
pub const DEFAULT_MEMORY_MIB: u64 = 1024;
/// Most vCPUs the VMM supports.
pub const MAX_CPUS: u32 = 254;
/// Kernel command line: serial console, reset through the i8042 on reboot,
/// a panic resets at once (which ends the run), no PCI bus to probe, then
/// the boot-time words both backends use
/// ([`super::guest::BOOT_TIME_CMDLINE`]). `module_blacklist=` names the
/// virtio PCI transport modules, useless without a PCI bus: the agent does
/// not load them (the qemu backend's machine needs them). The VMM appends
/// one `virtio_mmio.device=` per device.
pub const KERNEL_CMDLINE: &str = concat!(
    "console=ttyS0 reboot=k panic=-1 pci=off quiet ",
    super::guest::boot_time_cmdline!(),
    " module_blacklist=virtio_pci,virtio_pci_legacy_dev,virtio_pci_modern_dev"
);
/// Request queues of the virtio-fs device.
pub const FS_REQUEST_QUEUES: u16 = 1;
/// Name of the thread that builds and runs the VM.
pub const VM_THREAD_NAME: &str = "cowork-kvm-vm";
/// How long the VM gets to finish after the host stopped it (vCPUs and
/// device workers joined, the VM closed; milliseconds in practice).
pub const STOP_DEADLINE: Duration = Duration::from_secs(10);

/// Errors of starting the in-process machine, worded for the client's log.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    #[error(
        "this host's KVM cannot run Linux guests: {0}; use --backend qemu or --backend sandbox"
    )]
    Unsuitable(#[source] KvmUnavailable),
    #[error(transparent)]
    Image(#[from] NoImage),
    #[error(transparent)]
    Userland(#[from] UserlandError),
    #[error("cannot open the root disk {path}: {source}")]
    RootDisk { path: PathBuf, source: ImageError },
    #[error("cannot set up the vsock host side: {0}")]
    VsockHost(#[from] HostError),
    #[error(transparent)]
    Egress(#[from] EgressServeError),
    #[error("cannot create the vsock device: {0}")]
    VsockDevice(#[from] VsockDeviceError),
    #[error("cannot create the virtio-fs device: {0}")]
    FsDevice(#[from] FsDeviceError),
    #[error("cannot open the session disk: {0}")]
    SessionDisk(#[from] ImageError),
    #[error("cannot create the session disk device: {0}")]
    BlkDevice(#[from] BlkDeviceError),
    #[error("cannot start the VM thread: {0}")]
    Thread(std::io::Error),
    #[error("cannot build the VM from {kernel}: {source}")]
    Build {
        kernel: PathBuf,
        source: vmm::VmError,
    },
    #[error("the VM thread ended before it built the VM")]
    ThreadGone,
    #[error("cannot restore the boot snapshot: {0}")]
    Restore(#[source] vmm::SnapshotError),
}

/// The kernel to boot from `image`: its [`VMLINUX`] when present, else its bzImage.
pub fn kernel_of(image: &GuestImage) -> PathBuf {
    let elf = image.dir.join(VMLINUX);
    if elf.is_file() {
        elf
    } else {
        image.vmlinuz.clone()
    }
}

/// Guest memory for a `startVM.memoryGB` value.
pub fn memory_mib(memory_gb: Option<f64>) -> u64 {
    sizing::memory_mib(memory_gb, DEFAULT_MEMORY_MIB)
}

/// vCPUs for a `startVM.cpuCount` value, at most the host's CPU count and
/// [`MAX_CPUS`].
pub fn cpu_count(requested: Option<u32>, host_cpus: u32) -> u8 {
    let n = sizing::cpu_count(requested, host_cpus).min(MAX_CPUS);
    u8::try_from(n).unwrap_or(u8::MAX)
}

/// The guest's kernel command line (before the VMM's virtio entries):
/// [`KERNEL_CMDLINE`], then `extra` (the words both backends take from the
/// helper's settings, [`cmdline_words`]).
pub fn cmdline(extra: &[String]) -> String {
    let mut c = KERNEL_CMDLINE.to_string();
    for w in extra {
        c.push(' ');
        c.push_str(w);
    }
    c
}

/// What the daemon needs to know about this backend here (for `auto` and `doctor`).
#[derive(Debug)]
pub struct Probe {
    pub kvm: Result<(), KvmUnavailable>,
    pub image: Result<GuestImage, NoImage>,
}

impl Probe {
    /// Checks KVM and looks for the guest image.
    pub fn run(images: &ImageSearch) -> Probe {
        Probe {
            kvm: kvm_for_linux(),
            image: images.locate(None),
        }
    }

    /// Whether the backend can start here.
    pub fn usable(&self) -> bool {
        self.kvm.is_ok() && self.image.is_ok()
    }
}

/// How the VM thread's run ended.
#[derive(Clone, Debug)]
pub enum RunEnd {
    /// `vmm::Vm::run` returned this reason.
    Exit(vmm::ExitReason),
    /// `vmm::Vm::run` failed (shared: a machine's end is reported more than
    /// once).
    Failed(Arc<vmm::VmError>),
    /// The VM thread ended without reporting: it panicked.
    Panicked,
    /// The VM did not finish within this long after the host stopped it;
    /// its thread is left behind.
    StopTimedOut(Duration),
}

impl RunEnd {
    fn of(result: Result<vmm::ExitReason, vmm::VmError>) -> RunEnd {
        match result {
            Ok(reason) => RunEnd::Exit(reason),
            Err(e) => RunEnd::Failed(Arc::new(e)),
        }
    }
}

impl fmt::Display for RunEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunEnd::Exit(vmm::ExitReason::Reset) => f.write_str("the guest reset the VM"),
            RunEnd::Exit(vmm::ExitReason::Shutdown) => f.write_str("the guest powered the VM off"),
            RunEnd::Exit(vmm::ExitReason::GuestError(e)) => write!(f, "the guest failed: {e}"),
            RunEnd::Exit(vmm::ExitReason::Stopped) => f.write_str("the host stopped the VM"),
            RunEnd::Exit(vmm::ExitReason::Paused) => f.write_str("the host paused the VM"),
            RunEnd::Failed(e) => write!(f, "the VM failed: {e}"),
            RunEnd::Panicked => f.write_str("the VM thread ended without reporting (it panicked)"),
            RunEnd::StopTimedOut(waited) => write!(
                f,
                "the VM did not finish within {}s of the stop; its thread is left behind",
                waited.as_secs()
            ),
        }
    }
}

/// How an in-process machine ended ([`KvmMachine::wait`]).
#[derive(Clone, Debug)]
pub struct KvmEnd {
    /// How the run ended.
    pub run: RunEnd,
    /// The console's last lines, when the guest ended the run by itself
    /// (unexpectedly, for the controller).
    pub console: Option<ConsoleQuote>,
}

impl fmt::Display for KvmEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.run)?;
        if let Some(console) = &self.console {
            write!(f, "{console}")?;
        }
        Ok(())
    }
}

/// The agent's boot marks as `code@host_ms/guest_ms` words.
fn boot_marks(marks: &[vmm::devices::boot_timer::BootMark]) -> String {
    marks
        .iter()
        .map(|m| {
            let (code, guest_ms) = guest_agent::milestone::decode(m.value);
            format!("{code:#04x}@{}ms/guest{guest_ms}ms", m.at.as_millis())
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// What the VM thread starts the machine from.
enum Start {
    /// Load the kernel and boot it.
    Cold,
    /// Restore this store's snapshot.
    Restore(Store),
}

/// A request to the VM thread, served while its VM is paused.
enum Control {
    /// Save the VM into `store` (then resume it).
    Snapshot {
        store: Store,
        reply: oneshot::Sender<Result<vmm::SnapshotInfo, vmm::SnapshotError>>,
    },
}

/// What the VM thread hands back once the VM exists.
struct Handles {
    stop: vmm::StopHandle,
    pause: vmm::PauseHandle,
}

/// Builds (or restores) and runs the VM on this thread; reports the
/// build on `built` and how the run ended on `done`. Whenever the VM
/// pauses, a request on `control` is served and the VM resumes.
fn vm_thread(
    start: Start,
    config: vmm::Config,
    control: std::sync::mpsc::Receiver<Control>,
    built: oneshot::Sender<Result<Handles, KvmError>>,
    done: oneshot::Sender<RunEnd>,
) {
    let kernel = config.kernel.clone();
    let vm = match &start {
        Start::Cold => vmm::Vm::build(config).map_err(|source| KvmError::Build { kernel, source }),
        Start::Restore(store) => {
            vmm::Vm::restore(config, store.dir(), store.key()).map_err(KvmError::Restore)
        }
    };
    let mut vm = match vm {
        Ok(vm) => vm,
        Err(e) => {
            let _ = built.send(Err(e));
            return;
        }
    };
    tracing::debug!(cmdline = vm.cmdline(), "kvm vm built");
    let handles = Handles {
        stop: vm.stop_handle(),
        pause: vm.pause_handle(),
    };
    if built.send(Ok(handles)).is_err() {
        // Nobody waits for this machine any more.
        return;
    }
    let started = Instant::now();
    let how = loop {
        match vm.run() {
            Ok(vmm::ExitReason::Paused) => match control.try_recv() {
                Ok(Control::Snapshot { store, reply }) => {
                    let _ = reply.send(vm.snapshot(store.dir(), store.key()));
                }
                Err(_) => tracing::debug!("kvm vm paused with nothing to do; resuming"),
            },
            result => break RunEnd::of(result),
        }
    };
    let t = vm.timeline();
    tracing::info!(
        how = %how,
        run_ms = started.elapsed().as_millis() as u64,
        build_ms = t.build.as_secs_f64() * 1e3,
        first_run_ms = t.first_run.map(|d| d.as_secs_f64() * 1e3),
        teardown_ms = t.teardown.map(|d| d.as_secs_f64() * 1e3),
        boot_marks = %boot_marks(&t.boot_marks),
        "kvm vm ended"
    );
    drop(vm);
    let _ = done.send(how);
}

/// The guest image's files this boot uses, found once for both tries.
struct Plan {
    image: GuestImage,
    kernel: PathBuf,
    userland: userland::UserlandPlan,
    cmdline: String,
    mem_mib: u64,
    vcpus: u8,
}

impl Plan {
    fn new(opts: &BootOptions) -> Result<Plan, KvmError> {
        let image = opts.images.locate(opts.bundle_path.as_deref())?;
        let kernel = kernel_of(&image);
        let userland = userland::plan(opts.userland, &image, opts.bundle_path.as_deref())?;
        Ok(Plan {
            cmdline: cmdline(&cmdline_words(
                opts.guest_log.as_deref(),
                opts.guest_root_session.as_deref(),
            )),
            mem_mib: memory_mib(opts.memory_gb),
            vcpus: cpu_count(opts.cpu_count, sizing::host_cpus()),
            image,
            kernel,
            userland,
        })
    }

    /// Device kinds in slot order (as [`Plan::parts`] creates them).
    fn devices(&self) -> Vec<&'static str> {
        let mut d = vec!["vsock", "fs", "blk-session", "rng"];
        d.extend(self.userland.disks.iter().map(|_| "blk-root"));
        d.push("balloon");
        d
    }

    /// This machine's snapshot store, when snapshots are on.
    fn store(&self, opts: &BootOptions) -> Option<Store> {
        let identity = warm::MachineIdentity {
            kernel: &self.kernel,
            initrd: &self.image.initramfs,
            root_disks: self
                .userland
                .disks
                .iter()
                .map(|d| d.path.as_path())
                .collect(),
            cmdline: &self.cmdline,
            mem_mib: self.mem_mib,
            vcpus: self.vcpus,
            devices: self.devices(),
        };
        Store::new(&opts.snapshot, warm::KVM_STORE, || identity.key())
    }

    /// Everything one try needs, new: the vsock host side with the agent's
    /// listener and the egress acceptor, the devices (the session disk
    /// opened and locked), the console, and the VM's config.
    fn parts(
        &self,
        opts: &BootOptions,
        session_disk: &Path,
        egress: &EgressProxy,
    ) -> Result<Parts, KvmError> {
        let host = VsockHost::new()?;
        let listener = host.listen(AGENT_PORT)?;
        // Dropped (port freed, thread joined) on any failure below.
        let egress = EgressAcceptor::start(&host, egress.clone())?;
        let vsock = VsockDevice::new(GUEST_CID, VsockConfig::default(), host.clone())?;
        let fs = Arc::new(SessionFs::new(opts.fs));
        let fs_device = FsDevice::new(SESSIONS_FS_TAG, FS_REQUEST_QUEUES, fs.clone())?;
        // Locked exclusively until the VM (and with it the device) is dropped.
        let blk_device = BlkDevice::new(
            Box::new(RawImage::open(session_disk)?),
            &BlkConfig::new(SESSION_DISK_SERIAL),
        )?;
        // Read-only: a shared lock, O_RDONLY, VIRTIO_BLK_F_RO.
        let mut root_devices = Vec::with_capacity(self.userland.disks.len());
        for disk in &self.userland.disks {
            let image =
                RawImage::open_read_only(&disk.path).map_err(|source| KvmError::RootDisk {
                    path: disk.path.clone(),
                    source,
                })?;
            root_devices.push(BlkDevice::new(
                Box::new(image),
                &BlkConfig::new(disk.serial),
            )?);
        }
        let console = Console::default();

        let mut config = vmm::Config::new(&self.kernel);
        config.initrd = Some(self.image.initramfs.clone());
        config.cmdline = self.cmdline.clone();
        config.mem_mib = self.mem_mib;
        config.vcpus = self.vcpus;
        // vCPUs, the event loop and device workers filter their system calls
        // (vmm::seccomp) unless the daemon runs with --seccomp=off.
        config.seccomp = opts.seccomp;
        // Huge pages advised unless the daemon runs with --guest-thp off.
        config.memory_backing = opts.memory_backing;
        // Runs on the vCPU thread that writes the UART: it only buffers, logs
        // and pushes.
        config.serial = Some(Box::new(ConsoleLines::new(console.clone(), "serial")));
        // In the order of Plan::devices (the snapshot key names them).
        config.virtio_devices = vec![
            Box::new(vsock),
            Box::new(fs_device),
            Box::new(blk_device),
            Box::new(RngDevice::new()),
        ];
        for device in root_devices {
            config.virtio_devices.push(Box::new(device));
        }
        config
            .virtio_devices
            .push(Box::new(BalloonDevice::new(Arc::new(HostMappingReleaser))));
        Ok(Parts {
            host,
            listener,
            egress,
            fs,
            console,
            config,
        })
    }
}

/// One try's new parts ([`Plan::parts`]).
struct Parts {
    host: VsockHost,
    listener: Listener,
    egress: EgressAcceptor,
    fs: Arc<SessionFs>,
    console: Console,
    config: vmm::Config,
}

/// Boots the guest in-process: checks KVM, finds the image, creates the
/// devices, builds the VM on its thread and returns the machine with the
/// future of the agent's stream. With snapshots on ([`warm`]) a snapshot of
/// this machine shape is restored instead when there is one (one that
/// cannot be is removed, with one log line, and the machine boots cold in
/// this same call), and a cold boot takes one at its template point. The
/// guest's egress connections are served by `egress` until the machine
/// ends.
pub async fn boot(
    opts: &BootOptions,
    session_disk: &Path,
    egress: &EgressProxy,
) -> Result<Booted, KvmError> {
    kvm_for_linux().map_err(KvmError::Unsuitable)?;
    let plan = Plan::new(opts)?;
    let store = plan.store(opts);
    if let Some(store) = store.as_ref().filter(|s| s.exists()) {
        let parts = plan.parts(opts, session_disk, egress)?;
        match start(&plan, parts, Start::Restore(store.clone()), None).await {
            Ok(booted) => {
                store.touch_and_prune();
                return Ok(booted);
            }
            Err(KvmError::Restore(e)) => {
                tracing::warn!(
                    dir = %store.dir().display(),
                    error = %e,
                    "the boot snapshot cannot be restored; removed, booting cold"
                );
                store.discard();
            }
            Err(e) => return Err(e),
        }
    }
    let snapshot_to = store.filter(|s| match s.prepare() {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(
                dir = %s.dir().display(),
                error = %e,
                "cannot create the snapshot directory; no snapshot this boot"
            );
            false
        }
    });
    let parts = plan.parts(opts, session_disk, egress)?;
    start(&plan, parts, Start::Cold, snapshot_to).await
}

/// Runs `parts` as a machine started from `from` on its own thread; with
/// `snapshot_to`, the agent future snapshots it at its template point.
async fn start(
    plan: &Plan,
    parts: Parts,
    from: Start,
    snapshot_to: Option<Store>,
) -> Result<Booted, KvmError> {
    let Parts {
        host,
        listener,
        egress,
        fs,
        console,
        config,
    } = parts;
    let warm = matches!(from, Start::Restore(_));
    let began = Instant::now();
    let (built_tx, built_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel();
    let (control_tx, control_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(VM_THREAD_NAME.into())
        .spawn(move || vm_thread(from, config, control_rx, built_tx, done_tx))
        .map_err(KvmError::Thread)?;
    let handles = match built_rx.await {
        Ok(Ok(handles)) => handles,
        Ok(Err(e)) => {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
            return Err(e);
        }
        Err(_) => {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
            return Err(KvmError::ThreadGone);
        }
    };
    tracing::info!(
        image = %plan.image.dir.display(),
        kernel = %plan.kernel.display(),
        memory_mib = plan.mem_mib,
        cpus = plan.vcpus,
        start = if warm { "warm" } else { "cold" },
        build_ms = began.elapsed().as_secs_f64() * 1e3,
        "kvm vm started"
    );
    let connected = Arc::new(AtomicBool::new(false));
    let agent = match snapshot_to {
        Some(store) => agent_after_snapshot(
            listener,
            console.clone(),
            connected.clone(),
            Snapshotter {
                store,
                control: control_tx,
                pause: handles.pause,
            },
        ),
        None => agent_stream(listener, console.clone(), connected.clone()),
    };
    let machine = KvmMachine {
        thread: Some(thread),
        stop: handles.stop,
        outcome: done_rx,
        console,
        connected,
        ended: None,
        egress,
        _host: host,
    };
    Ok(Booted {
        machine: BackendMachine::Kvm(machine),
        agent,
        host_paths: HostPaths::Shared(SharedFolders::new(fs)),
        userland: Some(plan.userland.clone()),
    })
}

/// Takes a running VM's snapshot through its thread.
struct Snapshotter {
    store: Store,
    control: std::sync::mpsc::Sender<Control>,
    pause: vmm::PauseHandle,
}

impl Snapshotter {
    /// Pauses the VM, has its thread save it into the store and resume
    /// it. A failure is logged (the boot goes on; the next one tries
    /// again): it never fails the start.
    async fn take(self) {
        let (reply, answer) = oneshot::channel();
        let request = Control::Snapshot {
            store: self.store.clone(),
            reply,
        };
        if self.control.send(request).is_err() || !self.pause.pause() {
            tracing::warn!("the VM ended before its snapshot was taken");
            return;
        }
        match answer.await {
            Ok(Ok(info)) => {
                tracing::info!(
                    dir = %self.store.dir().display(),
                    memory_data_mib = info.memory_data_bytes >> 20,
                    memory_disk_mib = info.memory_disk_bytes >> 20,
                    state_bytes = info.state_bytes,
                    snapshot_ms = info.total_time.as_secs_f64() * 1e3,
                    "boot snapshot taken"
                );
                self.store.touch_and_prune();
            }
            Ok(Err(e)) => tracing::warn!(
                dir = %self.store.dir().display(),
                error = %e,
                "cannot take the boot snapshot; the next start boots cold again"
            ),
            Err(_) => tracing::warn!("the VM ended before its snapshot was taken"),
        }
    }
}

/// The agent's stream of a cold boot that takes a snapshot: the agent's
/// first connection says the template hello (peeked; an agent that answers
/// `Quiesce` is asked to let its boot's background work finish first, see
/// [`warm::quiesce`]); the VM is saved then, which resets its vsock
/// connections, so the agent dials
/// again and the second connection is the link (its template hello is the
/// lifecycle's to read, as after a restore). A first hello that is not a
/// template hello (an image without a template point) is the link itself,
/// with no snapshot.
fn agent_after_snapshot(
    mut listener: Listener,
    console: Console,
    connected: Arc<AtomicBool>,
    snapshotter: Snapshotter,
) -> AgentStream {
    Box::pin(async move {
        let deadline = tokio::time::Instant::now() + AGENT_DIAL_TIMEOUT;
        let mut first = accept_agent(&mut listener, &console, &connected, deadline).await?;
        match warm::peek_hello(&first).await {
            Ok(Some(hello)) if hello.is_template() => {
                if hello.quiesce {
                    match warm::quiesce(&mut first, warm::QUIESCE_LIMIT).await {
                        Ok((waited_ms, complete)) => tracing::info!(
                            waited_ms,
                            complete,
                            "the guest is quiet for its snapshot"
                        ),
                        Err(e) => tracing::warn!(
                            error = %e,
                            "the guest did not say it is quiet; snapshotting it as it is"
                        ),
                    }
                }
            }
            Ok(_) => {
                tracing::info!("the guest agent has no template point; no boot snapshot");
                return Ok(first);
            }
            Err(e) => {
                tracing::warn!(error = %e, "no boot snapshot");
                return Ok(first);
            }
        }
        snapshotter.take().await;
        // Reset by the snapshot (or, when it failed, closed here): the
        // agent dials again either way, with a deadline of its own (the
        // snapshot's time is not the agent's).
        drop(first);
        let deadline = tokio::time::Instant::now() + AGENT_DIAL_TIMEOUT;
        accept_agent(&mut listener, &console, &connected, deadline).await
    })
}

/// A guest running in this process.
pub struct KvmMachine {
    /// The thread running the VM; joined once it reported its end.
    thread: Option<JoinHandle<()>>,
    stop: vmm::StopHandle,
    /// How the run ended (sent by the VM thread).
    outcome: oneshot::Receiver<RunEnd>,
    console: Console,
    /// The agent dialled in (so a stop is expected to power the guest off).
    connected: Arc<AtomicBool>,
    ended: Option<KvmEnd>,
    /// Serves the guest's egress connections; stopped when the run ends.
    egress: EgressAcceptor,
    /// Keeps the device's host side alive as long as the machine.
    _host: VsockHost,
}

impl KvmMachine {
    /// Waits until the guest ends the run by itself; says how, quoting
    /// the console.
    pub async fn wait(&mut self) -> KvmEnd {
        if let Some(how) = &self.ended {
            return how.clone();
        }
        let run = (&mut self.outcome).await.unwrap_or(RunEnd::Panicked);
        let how = KvmEnd {
            run,
            console: Some(self.console.quote(QUOTED_LINES)),
        };
        tracing::info!(how = %how, "kvm vm ended by itself");
        self.ended = Some(how.clone());
        self.egress.stop();
        self.join_thread().await;
        how
    }

    /// Ends the VM: when the agent had connected, the guest is expected to
    /// power off (the controller asked the agent to shut down) and gets
    /// until `poweroff_by` (the controller's
    /// [`POWEROFF_DEADLINE`](super::guest::POWEROFF_DEADLINE), or the
    /// helper's shutdown deadline); then the host stops it. Idempotent.
    pub async fn kill_by(&mut self, poweroff_by: Instant) {
        if self.ended.is_none() {
            let started = Instant::now();
            let mut how = None;
            if self.connected.load(Ordering::Acquire) {
                match tokio::time::timeout_at(poweroff_by.into(), &mut self.outcome).await {
                    Ok(outcome) => how = Some(outcome),
                    Err(_) => tracing::warn!(
                        waited_ms = started.elapsed().as_millis() as u64,
                        "guest did not power off in time; stopping the VM"
                    ),
                }
            }
            let how = match how {
                Some(h) => h,
                None => {
                    self.stop.stop();
                    match tokio::time::timeout(STOP_DEADLINE, &mut self.outcome).await {
                        Ok(h) => h,
                        Err(_) => Ok(RunEnd::StopTimedOut(STOP_DEADLINE)),
                    }
                }
            };
            let run = how.unwrap_or(RunEnd::Panicked);
            tracing::info!(
                how = %run,
                ms = started.elapsed().as_millis() as u64,
                "kvm vm stopped"
            );
            self.ended = Some(KvmEnd { run, console: None });
        }
        self.egress.stop();
        self.join_thread().await;
    }

    /// Joins the VM thread when it has finished (it has once it reported).
    async fn join_thread(&mut self) {
        let Some(handle) = self.thread.take() else {
            return;
        };
        if !handle.is_finished() && self.stop.stop() {
            // Still running: `kill` timed out on it; do not block on it.
            tracing::warn!("the VM thread is still running; not joining it");
            self.thread = Some(handle);
            return;
        }
        match tokio::task::spawn_blocking(move || handle.join()).await {
            Ok(Ok(())) => tracing::debug!("VM thread joined"),
            Ok(Err(_)) => tracing::warn!("the VM thread panicked"),
            Err(e) => tracing::warn!(error = %e, "cannot join the VM thread"),
        }
    }
}

impl Drop for KvmMachine {
    /// A machine dropped without `kill` (the runtime shutting down) still
    /// stops its VM; the thread is joined only when it already finished,
    /// so dropping never blocks.
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(h) = self.thread.take() {
            if h.is_finished() {
                let _ = h.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image_dir(with_vmlinux: bool) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("vmlinuz"), b"kernel").unwrap();
        std::fs::write(d.path().join("initramfs"), b"initramfs").unwrap();
        std::fs::write(
            d.path().join("image-info"),
            format!(
                "{}\nKERNEL_VERSION=6.1.0-x-cloud-amd64\n",
                crate::backend::image::IMAGE_FORMAT
            ),
        )
        .unwrap();
        if with_vmlinux {
            std::fs::write(d.path().join(VMLINUX), b"\x7fELF").unwrap();
        }
        d
    }

    #[test]
    fn prefers_the_elf_kernel_when_the_image_has_one() {
        let plain = image_dir(false);
        let img = GuestImage::at(plain.path()).unwrap();
        assert_eq!(kernel_of(&img), plain.path().join("vmlinuz"));
        let elf = image_dir(true);
        let img = GuestImage::at(elf.path()).unwrap();
        assert_eq!(kernel_of(&img), elf.path().join(VMLINUX));
    }

    #[test]
    fn sizes_and_command_line() {
        assert_eq!(memory_mib(None), DEFAULT_MEMORY_MIB);
        assert_eq!(memory_mib(Some(2.0)), 2048);
        assert_eq!(memory_mib(Some(0.01)), sizing::MIN_MEMORY_MIB);
        assert_eq!(memory_mib(Some(1e12)), sizing::MAX_MEMORY_MIB);
        for bad in [f64::NAN, f64::NEG_INFINITY, -1.0, 0.0] {
            assert_eq!(memory_mib(Some(bad)), DEFAULT_MEMORY_MIB, "{bad}");
        }
        assert_eq!(cpu_count(None, 8), sizing::DEFAULT_CPUS as u8);
        assert_eq!(cpu_count(Some(4), 2), 2);
        assert_eq!(cpu_count(Some(0), 8), sizing::DEFAULT_CPUS as u8);
        assert_eq!(cpu_count(Some(3), 0), 1);
        assert_eq!(cpu_count(Some(u32::MAX), u32::MAX), MAX_CPUS as u8);
        assert_eq!(cmdline(&[]), KERNEL_CMDLINE);
        let words = [
            super::super::guest::guest_log_word(Some("debug")).unwrap(),
            "X=1".to_string(),
        ];
        assert_eq!(
            cmdline(&words),
            format!("{KERNEL_CMDLINE} COWORK_LOG=debug X=1")
        );
    }

    #[test]
    fn exit_reasons_and_marks_in_words() {
        assert_eq!(
            RunEnd::Exit(vmm::ExitReason::Shutdown).to_string(),
            "the guest powered the VM off"
        );
        assert!(
            RunEnd::Exit(vmm::ExitReason::GuestError("triple fault".into()))
                .to_string()
                .contains("triple fault")
        );
        let ended = KvmEnd {
            run: RunEnd::Panicked,
            console: Some(ConsoleQuote::default()),
        };
        assert_eq!(
            ended.to_string(),
            "the VM thread ended without reporting (it panicked) (the console printed nothing)"
        );
        let marks = [vmm::devices::boot_timer::BootMark {
            at: Duration::from_millis(1500),
            value: 0xA1 << 24 | 1234,
        }];
        assert_eq!(boot_marks(&marks), "0xa1@1500ms/guest1234ms");
    }

    #[tokio::test]
    async fn refuses_hosts_whose_kvm_cannot_run_linux() {
        let Err(why) = kvm_for_linux() else {
            // Hardware KVM: the nested/direct integration test covers booting.
            return;
        };
        let e = boot(
            &BootOptions::default(),
            Path::new("/nonexistent/sessiondata.img"),
            &EgressProxy::direct(),
        )
        .await
        .err()
        .unwrap();
        assert!(matches!(e, KvmError::Unsuitable(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("cannot run Linux guests"), "{e}");
        assert!(e.contains(&why.to_string()), "{e}");
        assert!(e.contains("--backend qemu"), "{e}");
    }
}
