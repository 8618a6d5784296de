//! The machine: [`Vm::build`] turns a [`Config`] into a ready-to-run KVM VM
//! (memory, irqchip, PIT, kernel, boot tables, vCPUs, devices), and
//! [`Vm::run`] runs it to an [`ExitReason`].
//!
//! Threads: `build()` copies the kernel and initrd on a short-lived thread
//! (`vm-load`) while it creates the vCPUs and devices, and joins it before
//! it returns. `run()` spawns one thread per vCPU and runs the VMM event loop
//! (event-manager); it returns once the guest resets, powers off, fails, or
//! a [`StopHandle`] stops it. With seccomp ([`Config::seccomp`], on by
//! default) the event loop runs on a thread of its own
//! ([`EVENT_LOOP_THREAD_NAME`]) so the caller's thread stays unfiltered,
//! and every vCPU thread, the event loop and every device worker install
//! their class's filter ([`crate::seccomp`]) before the guest runs;
//! without, the event loop runs on the calling thread. Before it returns every
//! vCPU thread is joined and every fd the VM owned (KVM, VM, vCPUs,
//! eventfds, guest memory) is closed — the `Vm` value then only holds the
//! [`Timeline`]. Nothing here ever exits the process.
//!
//! Pausing: a [`PauseHandle`] makes `run()` stop every vCPU (each leaves
//! `KVM_RUN` with its last exit completed and its thread is joined, the fd
//! kept), pause every virtio device (its worker stopped, its queue
//! positions back in its transport), end the event loop and return
//! [`ExitReason::Paused`] with the machine intact: the caller may then
//! [`Vm::snapshot`] it, `run()` it again (the devices resume before the
//! first vCPU thread starts), or drop it. [`Vm::restore`] builds a machine
//! from a snapshot instead of a kernel; it runs the same way (see
//! [`crate::snapshot`]).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, IoEventAddress, Kvm, VcpuFd, VmFd};
use vm_memory::{GuestMemory as _, GuestMemoryRegion};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::acpi::{self, MmioSlot};
use crate::boot::{self, BootInfo, EntryKind};
use crate::bus::Bus;
use crate::devices::acpi_pm::AcpiPm;
use crate::devices::boot_timer::{BootMark, BootTimer};
use crate::devices::i8042::I8042;
use crate::devices::serial::{Serial, SerialSink, SerialSnapshot};
use crate::exit::{ExitReason, ExitSignal};
use crate::memory::{self, Backing, GuestMemory, GuestRam};
use crate::seccomp::{self, Filter, ThreadClass};
use crate::snapshot::{self, kvm_state, RestorePhases, SnapshotError, SnapshotInfo};
use crate::vcpu::{VcpuShared, VcpuThread};
use crate::virtio::{MmioTransport, VirtioDevice};
use crate::{cpuid, kvm_check, layout, mptable};

/// What to boot and how.
pub struct Config {
    /// Kernel: ELF vmlinux (PVH entry when it has the PVH note, else 64-bit
    /// boot protocol) or bzImage.
    pub kernel: PathBuf,
    /// Optional initramfs.
    pub initrd: Option<PathBuf>,
    /// Kernel command line; the machine appends one `virtio_mmio.device=`
    /// per virtio device.
    pub cmdline: String,
    /// Guest memory in MiB.
    pub mem_mib: u64,
    /// Number of vCPUs (1..=254).
    pub vcpus: u8,
    /// How guest memory is backed (default: [`Backing::Anonymous`], huge
    /// pages advised; the helper's `--guest-thp off` picks
    /// [`Backing::AnonymousBasePages`]).
    pub memory_backing: Backing,
    /// Where COM1 output goes (`None`: discarded).
    pub serial: Option<SerialSink>,
    /// virtio device models, in slot order. The machine wraps each in a
    /// virtio-mmio transport ([`MmioTransport`]) at slot `i`
    /// ([`layout::virtio_mmio_slot_addr`], GSI
    /// [`layout::virtio_mmio_slot_irq`]): register file on the MMIO bus,
    /// one ioeventfd per queue on QueueNotify (4 bytes, datamatch = queue
    /// index), an irqfd for the interrupt, a `virtio_mmio.device=` entry on
    /// the command line and an `LNRO0005` device in the DSDT.
    pub virtio_devices: Vec<Box<dyn VirtioDevice>>,
    /// Seccomp filters of the VM's threads (default: [`seccomp::Mode::On`];
    /// the helper passes its `--seccomp`; see [`crate::seccomp`]).
    pub seccomp: seccomp::Mode,
}

impl Config {
    /// A config with 1 vCPU, 256 MiB, anonymous memory with huge pages
    /// advised, no initrd, no devices, serial discarded,
    /// [`DEFAULT_CMDLINE`], and seccomp on. Nothing comes from the
    /// environment: the caller sets what differs.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        Self {
            kernel: kernel.into(),
            initrd: None,
            cmdline: DEFAULT_CMDLINE.to_string(),
            mem_mib: 256,
            vcpus: 1,
            memory_backing: Backing::Anonymous,
            serial: None,
            virtio_devices: Vec::new(),
            seccomp: seccomp::Mode::On,
        }
    }
}

/// Name of the thread running the VMM event loop when seccomp is on.
pub const EVENT_LOOP_THREAD_NAME: &str = "vmm-event-loop";

/// Default kernel command line: console on COM1, reset through the i8042
/// on reboot, reboot instead of hanging on panic, no PCI probing (there is
/// no PCI bus; the legacy config ports read as all-ones anyway).
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 pci=off";

/// Errors of building or running a VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// Bad configuration.
    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// KVM missing capabilities.
    #[error(transparent)]
    Kvm(#[from] kvm_check::KvmCheckError),
    /// A KVM ioctl failed.
    #[error("{what} failed: {source}")]
    Ioctl {
        /// Which call.
        what: &'static str,
        /// Cause.
        source: kvm_ioctls::Error,
    },
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] memory::MemoryError),
    /// Opening kernel/initrd.
    #[error("cannot open {what} {path}: {source}")]
    Open {
        /// "kernel" or "initrd".
        what: &'static str,
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Boot setup.
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    /// ACPI.
    #[error(transparent)]
    Acpi(#[from] acpi::AcpiError),
    /// MP table.
    #[error(transparent)]
    Mptable(#[from] mptable::MptableError),
    /// CPUID.
    #[error(transparent)]
    Cpuid(#[from] cpuid::CpuidError),
    /// Device creation.
    #[error(transparent)]
    Device(#[from] crate::devices::PlatformDeviceError),
    #[error(transparent)]
    Exit(#[from] crate::exit::ExitError),
    /// Bus layout.
    #[error(transparent)]
    Bus(#[from] crate::bus::BusError),
    /// virtio device wiring.
    #[error("virtio-mmio slot {slot}: {msg}")]
    Virtio {
        /// Slot index.
        slot: usize,
        /// What failed.
        msg: String,
    },
    /// vCPU threads.
    #[error(transparent)]
    Vcpu(#[from] crate::vcpu::VcpuError),
    /// Event loop.
    #[error("VMM event loop: {0:?}")]
    EventManager(event_manager::Error),
    /// Seccomp filters could not be built or installed.
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
    /// The event loop thread could not be created.
    #[error("cannot start the VMM event loop thread: {0}")]
    EventLoopThread(std::io::Error),
    /// `run()` was called twice.
    #[error("this VM has already run; build a new one")]
    AlreadyRan,
}

impl From<VmError> for SnapshotError {
    fn from(e: VmError) -> Self {
        SnapshotError::Build(Box::new(e))
    }
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Ioctl { what, source }
}

/// The kernel and initrd in guest memory ([`load_images`]).
struct Images {
    kernel: boot::LoadedKernel,
    initrd: Option<boot::InitrdPlacement>,
    /// Bytes copied and holes skipped, both files together.
    read: crate::sparse::ReadStats,
    load_us: u64,
}

/// Loads the kernel, then the initrd above it, into `mem`, which must be
/// freshly mapped (the loaders skip the files' holes).
fn load_images(mem: &GuestMemory, kernel: &File, initrd: Option<&File>) -> Result<Images, VmError> {
    let began = Instant::now();
    let (loaded, kernel_read) = boot::load_kernel(mem, kernel)?;
    let (initrd, initrd_read) = match initrd {
        Some(f) => {
            let (place, read) = boot::load_initrd(mem, f, &loaded, boot::low_ram_end(mem))?;
            (Some(place), read)
        }
        None => (None, crate::sparse::ReadStats::default()),
    };
    Ok(Images {
        kernel: loaded,
        initrd,
        read: crate::sparse::ReadStats {
            copied: kernel_read.copied + initrd_read.copied,
            skipped: kernel_read.skipped + initrd_read.skipped,
        },
        load_us: began.elapsed().as_micros() as u64,
    })
}

/// The vCPUs and devices of a VM being built ([`build_machine`]).
struct MachineParts {
    vcpu_fds: Vec<VcpuFd>,
    platform: Platform,
    mmio: Bus,
    transports: Vec<Arc<MmioTransport>>,
}

/// The platform devices on the port-I/O bus and what they signal through.
struct Platform {
    exit: Arc<ExitSignal>,
    com1_irq: EventFd,
    serial: Arc<Serial>,
    boot_timer: Arc<BootTimer>,
    pio: Bus,
}

/// Creates the exit signal, COM1 (from `saved` when restoring, with its
/// irqfd), the i8042, the boot-timing port and the ACPI sleep registers
/// on a new port-I/O bus.
fn platform(
    vm_fd: &VmFd,
    serial: Option<SerialSink>,
    saved: Option<&SerialSnapshot>,
    origin: Instant,
) -> Result<Platform, VmError> {
    let exit = ExitSignal::new()?;
    let com1_irq = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(|source| {
        crate::devices::PlatformDeviceError::EventFd {
            what: "COM1 interrupt",
            source,
        }
    })?;
    vm_fd
        .register_irqfd(&com1_irq, layout::COM1_IRQ)
        .map_err(ioctl("KVM_IRQFD (COM1)"))?;
    let sink = serial.unwrap_or_else(|| Box::new(std::io::sink()));
    let serial = Arc::new(match saved {
        Some(state) => Serial::from_snapshot(&com1_irq, sink, state)?,
        None => Serial::new(&com1_irq, sink)?,
    });
    let boot_timer = Arc::new(BootTimer::new(origin));
    let mut pio = Bus::new();
    pio.insert(
        serial.clone(),
        layout::COM1_PORT.into(),
        layout::COM1_PORT_LEN.into(),
    )?;
    pio.insert(
        Arc::new(I8042::new(exit.clone())),
        layout::I8042_PORT.into(),
        layout::I8042_PORT_LEN.into(),
    )?;
    pio.insert(boot_timer.clone(), layout::BOOT_TIMER_PORT.into(), 4)?;
    pio.insert(
        Arc::new(AcpiPm::new(exit.clone())),
        layout::ACPI_SLEEP_CONTROL_PORT.into(),
        2,
    )?;
    Ok(Platform {
        exit,
        com1_irq,
        serial,
        boot_timer,
        pio,
    })
}

/// Creates the vCPUs (CPUID, common registers; the boot vCPU's entry is
/// set once the kernel is loaded) and the platform and virtio devices.
#[allow(clippy::too_many_arguments)]
fn build_machine(
    kvm: &Kvm,
    vm_fd: &VmFd,
    vcpus: u8,
    amx_perm: bool,
    serial: Option<SerialSink>,
    virtio_devices: Vec<Box<dyn VirtioDevice>>,
    slots: &[MmioSlot],
    mem: &GuestMemory,
    origin: Instant,
) -> Result<MachineParts, VmError> {
    // vCPUs.
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(cpuid::CpuidError::Supported)?;
    let amx = amx_perm && cpuid::table_has_amx(supported.as_slice());
    let tsc_deadline = kvm.check_extension(Cap::TscDeadlineTimer);
    let mut vcpu_fds = Vec::with_capacity(usize::from(vcpus));
    for index in 0..vcpus {
        let fd = vm_fd
            .create_vcpu(u64::from(index))
            .map_err(ioctl("KVM_CREATE_VCPU"))?;
        let table = cpuid::for_vcpu(
            &supported,
            &cpuid::CpuParams {
                index,
                count: vcpus,
                tsc_deadline,
                amx,
            },
        )?;
        fd.set_cpuid2(&table).map_err(ioctl("KVM_SET_CPUID2"))?;
        boot::setup_any_vcpu(&fd)?;
        vcpu_fds.push(fd);
    }

    // Devices.
    let platform = platform(vm_fd, serial, None, origin)?;
    let mut mmio = Bus::new();
    let mut transports = Vec::with_capacity(virtio_devices.len());
    for (i, (dev, slot)) in virtio_devices.into_iter().zip(slots).enumerate() {
        transports.push(wire_virtio(vm_fd, &mut mmio, i, dev, slot, mem)?);
    }
    Ok(MachineParts {
        vcpu_fds,
        platform,
        mmio,
        transports,
    })
}

/// Timestamps of one VM's life, relative to the start of [`Vm::build`].
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// `Vm::build` duration (config → vCPUs configured).
    pub build: Duration,
    /// When vCPU 0 first entered KVM_RUN.
    pub first_run: Option<Duration>,
    /// Boot-port writes.
    pub boot_marks: Vec<BootMark>,
    /// When the VMM event loop saw the guest's exit (or the host's stop).
    pub exit: Option<Duration>,
    /// How long stopping vCPUs, joining threads and closing the VM took
    /// (dominated by the kernel destroying the in-kernel irqchip and PIT).
    pub teardown: Option<Duration>,
    /// Entry protocol used (`None` for a restored VM).
    pub entry: Option<EntryKind>,
    /// For a VM built by [`Vm::restore`]: how long each step took (their
    /// sum is [`Timeline::build`], bar bookkeeping).
    pub restore: Option<RestorePhases>,
}

/// Stops a running VM from any thread. Holds only a weak reference: once
/// the VM has finished, [`StopHandle::stop`] does nothing.
#[derive(Debug, Clone)]
pub struct StopHandle(Weak<ExitSignal>);

impl StopHandle {
    /// Asks the VM to stop; `run()` then returns [`ExitReason::Stopped`]
    /// (unless the guest had already exited). Returns whether the VM was
    /// still alive.
    pub fn stop(&self) -> bool {
        match self.0.upgrade() {
            Some(s) => {
                s.request(ExitReason::Stopped);
                true
            }
            None => false,
        }
    }
}

/// Pauses a running VM from any thread (see the module doc). Holds only a
/// weak reference: once the VM has finished, [`PauseHandle::pause`] does
/// nothing.
#[derive(Debug, Clone)]
pub struct PauseHandle(Weak<ExitSignal>);

impl PauseHandle {
    /// Asks the running VM to pause; `run()` then returns
    /// [`ExitReason::Paused`] (unless the guest exited or the VM was
    /// stopped first). A request made while the VM is not running takes
    /// effect as soon as it runs. Returns whether the VM was still alive.
    pub fn pause(&self) -> bool {
        match self.0.upgrade() {
            Some(s) => {
                s.request_pause();
                true
            }
            None => false,
        }
    }
}

/// Everything that holds an fd or a thread; dropped at the end of `run()`
/// (kept while the VM is paused).
struct Live {
    kvm: Kvm,
    vm_fd: VmFd,
    ram: GuestRam,
    vcpus: Vec<VcpuFd>,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    exit: Arc<ExitSignal>,
    serial: Arc<Serial>,
    boot_timer: Arc<BootTimer>,
    _com1_irq: EventFd,
    virtio: Vec<Arc<MmioTransport>>,
    /// kvmclock as it stood when the VM paused: set back before it runs
    /// again, so that the pause is invisible to the guest's clocks.
    paused_clock: Option<kvm_bindings::kvm_clock_data>,
}

/// A built VM.
pub struct Vm {
    live: Option<Live>,
    stop: StopHandle,
    pause: PauseHandle,
    origin: Instant,
    timeline: Timeline,
    cmdline: String,
    seccomp: seccomp::Mode,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm")
            .field("running_state", &self.live.is_some())
            .field("cmdline", &self.cmdline)
            .field("timeline", &self.timeline)
            .finish()
    }
}

/// The event-loop subscriber watching the exit eventfd.
struct ExitWatcher {
    exit: Arc<ExitSignal>,
}

impl MutEventSubscriber for ExitWatcher {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if events.fd() == self.exit.eventfd().as_raw_fd() {
            // Drain the counter; the reason is read by the loop.
            let _ = self.exit.eventfd().read();
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(self.exit.eventfd(), EventSet::IN)) {
            tracing::error!("cannot watch the VM exit eventfd: {e:?}");
        }
    }
}

impl Vm {
    /// Builds the VM described by `config`. Nothing runs yet.
    pub fn build(config: Config) -> Result<Vm, VmError> {
        let origin = Instant::now();
        let Config {
            kernel,
            initrd,
            cmdline,
            mem_mib,
            vcpus,
            memory_backing,
            serial,
            virtio_devices,
            seccomp,
        } = config;
        if vcpus == 0 || vcpus > layout::MAX_VCPUS {
            return Err(VmError::Config(format!(
                "vCPU count {vcpus} out of range 1..={}",
                layout::MAX_VCPUS
            )));
        }
        if virtio_devices.len() > layout::VIRTIO_MMIO_MAX_SLOTS {
            return Err(VmError::Config(format!(
                "{} virtio devices requested, at most {} slots exist",
                virtio_devices.len(),
                layout::VIRTIO_MMIO_MAX_SLOTS
            )));
        }
        let kernel_file = File::open(&kernel).map_err(|source| VmError::Open {
            what: "kernel",
            path: kernel.clone(),
            source,
        })?;
        let initrd_file = match &initrd {
            Some(p) => Some(File::open(p).map_err(|source| VmError::Open {
                what: "initrd",
                path: p.clone(),
                source,
            })?),
            None => None,
        };

        // KVM, VM, platform.
        let kvm = kvm_check::check_capabilities()?;
        let max = kvm.get_max_vcpus();
        if usize::from(vcpus) > max {
            return Err(VmError::Config(format!(
                "{vcpus} vCPUs requested, this KVM allows {max}"
            )));
        }
        // Before KVM_GET_SUPPORTED_CPUID and vCPU creation (see cpuid docs).
        let amx_perm = cpuid::request_amx_permission();
        let vm_fd = kvm.create_vm().map_err(ioctl("KVM_CREATE_VM"))?;
        let ram = memory::create(mem_mib, memory_backing)?;
        register_memory(&vm_fd, &ram)?;
        vm_fd
            .set_identity_map_address(layout::KVM_IDENTITY_MAP_ADDRESS)
            .map_err(ioctl("KVM_SET_IDENTITY_MAP_ADDR"))?;
        vm_fd
            .set_tss_address(layout::KVM_TSS_ADDRESS as usize)
            .map_err(ioctl("KVM_SET_TSS_ADDR"))?;
        vm_fd
            .create_irq_chip()
            .map_err(ioctl("KVM_CREATE_IRQCHIP"))?;
        vm_fd
            .create_pit2(kvm_pit_config {
                flags: KVM_PIT_SPEAKER_DUMMY,
                ..Default::default()
            })
            .map_err(ioctl("KVM_CREATE_PIT2"))?;

        let slots: Vec<MmioSlot> = (0..virtio_devices.len())
            .map(|i| MmioSlot {
                base: layout::virtio_mmio_slot_addr(i),
                len: layout::VIRTIO_MMIO_SLOT_SIZE,
                gsi: layout::virtio_mmio_slot_irq(i),
            })
            .collect();

        // The kernel and initrd copy (tens of MiB: the longest step) runs on
        // a thread of its own while this one creates the vCPUs and wires the
        // devices, which need nothing from guest memory's contents.
        let (images, machine) = std::thread::scope(|scope| {
            let load = || load_images(&ram.mem, &kernel_file, initrd_file.as_ref());
            let loader = std::thread::Builder::new()
                .name("vm-load".into())
                .spawn_scoped(scope, load);
            let machine = build_machine(
                &kvm,
                &vm_fd,
                vcpus,
                amx_perm,
                serial,
                virtio_devices,
                &slots,
                &ram.mem,
                origin,
            );
            let images = match loader {
                Ok(handle) => handle.join().unwrap_or_else(|_| {
                    Err(VmError::Config("the kernel loading thread panicked".into()))
                }),
                Err(_) => load(),
            };
            (images, machine)
        });
        let images = images?;
        let MachineParts {
            vcpu_fds,
            platform:
                Platform {
                    exit,
                    com1_irq,
                    serial,
                    boot_timer,
                    pio,
                },
            mmio,
            transports,
        } = machine?;
        drop(kernel_file);
        drop(initrd_file);
        let Images {
            kernel: loaded,
            initrd: initrd_place,
            read,
            load_us,
        } = images;

        // Command line, tables, boot structures, the boot vCPU's entry.
        let full_cmdline = full_cmdline(&cmdline, &slots);
        boot::write_cmdline(&ram.mem, &full_cmdline, boot::cmdline_limit(&loaded))?;
        let acpi_layout = acpi::write_tables(&ram.mem, vcpus, &slots)?;
        mptable::write(&ram.mem, vcpus)?;
        let e820 = layout::e820_map(ram.size);
        let info = BootInfo {
            kernel: &loaded,
            cmdline_len: full_cmdline.len(),
            initrd: initrd_place,
            e820: &e820,
            rsdp: acpi_layout.rsdp,
        };
        match loaded.kind {
            EntryKind::Linux64 => boot::write_zero_page(&ram.mem, &info)?,
            EntryKind::Pvh => boot::write_pvh(&ram.mem, &info)?,
        }
        boot::write_cpu_tables(&ram.mem)?;
        if let Some(boot_vcpu) = vcpu_fds.first() {
            boot::setup_boot_vcpu(boot_vcpu, &loaded)?;
        }

        let build = origin.elapsed();
        tracing::info!(
            build_us = build.as_micros() as u64,
            load_us,
            copied_kib = read.copied / 1024,
            holes_kib = read.skipped / 1024,
            huge_pages = ram.huge_aligned,
            entry = ?loaded.kind,
            vcpus,
            mem_mib,
            "VM built"
        );
        Ok(Vm::assemble(
            Live {
                kvm,
                vm_fd,
                ram,
                vcpus: vcpu_fds,
                pio: Arc::new(pio),
                mmio: Arc::new(mmio),
                exit,
                serial,
                boot_timer,
                _com1_irq: com1_irq,
                paused_clock: None,
                virtio: transports,
            },
            origin,
            Timeline {
                build,
                entry: Some(loaded.kind),
                ..Default::default()
            },
            full_cmdline,
            seccomp,
        ))
    }

    /// The VM around `live` (built or restored), with its stop and pause
    /// handles on `live`'s exit signal.
    fn assemble(
        live: Live,
        origin: Instant,
        timeline: Timeline,
        cmdline: String,
        seccomp: seccomp::Mode,
    ) -> Vm {
        let stop = StopHandle(Arc::downgrade(&live.exit));
        let pause = PauseHandle(Arc::downgrade(&live.exit));
        Vm {
            live: Some(live),
            stop,
            pause,
            origin,
            timeline,
            cmdline,
            seccomp,
        }
    }

    /// A handle another thread can use to stop [`Vm::run`].
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// A handle another thread can use to pause [`Vm::run`].
    pub fn pause_handle(&self) -> PauseHandle {
        self.pause.clone()
    }

    /// Guest memory, while the VM holds it (not after it finished).
    /// Cloning it keeps the mapping alive.
    pub fn guest_memory(&self) -> Option<&GuestMemory> {
        self.live.as_ref().map(|l| &l.ram.mem)
    }

    /// The command line the guest got (with the virtio entries appended).
    pub fn cmdline(&self) -> &str {
        &self.cmdline
    }

    /// The virtio-mmio transports, in slot order (empty after `run()`).
    /// Holding one past `run()` keeps its eventfds open.
    pub fn virtio_transports(&self) -> Vec<Arc<MmioTransport>> {
        self.live
            .as_ref()
            .map(|l| l.virtio.clone())
            .unwrap_or_default()
    }

    /// Timestamps so far (complete after `run()` returns).
    pub fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    /// Runs the VM until it exits or is stopped. See the module docs for the
    /// threading and cleanup guarantees.
    pub fn run(&mut self) -> Result<ExitReason, VmError> {
        let mut live = self.live.take().ok_or(VmError::AlreadyRan)?;
        // Process-wide and once; before any filter (rt_sigaction is in none).
        crate::vcpu::install_kick_handler()?;
        // Here, on the unfiltered thread: the event loop's filter has no
        // clock ioctls.
        if let Some(clock) = live.paused_clock.take() {
            resume_clock(&live.vm_fd, &live.vcpus, clock);
        }
        let result = match self.seccomp {
            seccomp::Mode::Off => self.run_live(live, None),
            mode => self.run_filtered(live, mode),
        };
        if let (Ok(ExitReason::Paused), Some(live)) = (&result, self.live.as_mut()) {
            live.paused_clock = match live.vm_fd.get_clock() {
                Ok(clock) => Some(clock),
                Err(e) => {
                    tracing::warn!(
                        "cannot read kvmclock at the pause: {e}; the guest will see the pause as elapsed time"
                    );
                    None
                }
            };
        }
        if self.live.is_none() {
            if let Some(exit) = self.timeline.exit {
                self.timeline.teardown = Some(self.origin.elapsed().saturating_sub(exit));
            }
        }
        result
    }

    /// [`Self::run_live`] on an event loop thread of its own that installs
    /// the event loop's filter first; the vCPUs get theirs.
    fn run_filtered(&mut self, live: Live, mode: seccomp::Mode) -> Result<ExitReason, VmError> {
        // Built here so a table error is reported before anything runs; the
        // spawner must exist before the first filtered thread needs it.
        let event_loop = Filter::new(ThreadClass::EventLoop, mode)?;
        let vcpu = Filter::new(ThreadClass::Vcpu, mode)?;
        seccomp::start_spawner()?;
        std::thread::scope(|scope| {
            let handle = std::thread::Builder::new()
                .name(EVENT_LOOP_THREAD_NAME.into())
                .spawn_scoped(scope, move || {
                    if let Some(f) = &event_loop {
                        f.install()?;
                    }
                    self.run_live(live, vcpu)
                })
                .map_err(VmError::EventLoopThread)?;
            match handle.join() {
                Ok(result) => result,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    fn run_live(
        &mut self,
        mut live: Live,
        vcpu_filter: Option<Filter>,
    ) -> Result<ExitReason, VmError> {
        let mut em = EventManager::<Arc<Mutex<dyn MutEventSubscriber + Send>>>::new()
            .map_err(VmError::EventManager)?;
        em.add_subscriber(Arc::new(Mutex::new(ExitWatcher {
            exit: live.exit.clone(),
        })));
        // Devices paused by an earlier run, or restored from a snapshot,
        // serve again before any vCPU runs.
        for t in &live.virtio {
            t.resume();
        }

        let stop = Arc::new(AtomicBool::new(false));
        let first_run = Arc::new(OnceLock::new());
        let shared = VcpuShared {
            pio: live.pio.clone(),
            mmio: live.mmio.clone(),
            exit: live.exit.clone(),
            stop: stop.clone(),
            first_run: first_run.clone(),
            seccomp: vcpu_filter,
        };
        let vcpu_count = live.vcpus.len();
        let mut threads = Vec::with_capacity(vcpu_count);
        let mut spawn_err = None;
        for (i, fd) in live.vcpus.drain(..).enumerate() {
            match VcpuThread::spawn(i as u8, fd, shared.clone()) {
                Ok(t) => threads.push(t),
                Err(e) => {
                    spawn_err = Some(e);
                    break;
                }
            }
        }

        let mut loop_err = None;
        if spawn_err.is_none() {
            while live.exit.reason().is_none() && !live.exit.pause_requested() {
                if let Err(e) = em.run() {
                    loop_err = Some(VmError::EventManager(e));
                    break;
                }
            }
        }
        let exit_at = self.origin.elapsed();
        self.timeline.exit = Some(exit_at);

        // Stop and join every vCPU.
        stop.store(true, Ordering::Release);
        let mut join_err = None;
        for t in &threads {
            t.kick();
        }
        let mut vcpu_fds = Vec::with_capacity(vcpu_count);
        for t in threads {
            // A thread may have been between its flag check and KVM_RUN
            // when kicked; immediate_exit covers that, so one kick suffices.
            match t.join() {
                Ok(fd) => vcpu_fds.push(fd),
                Err(e) => {
                    join_err.get_or_insert(e);
                }
            }
        }
        live.serial.flush();
        if let Some(t) = first_run.get() {
            self.timeline.first_run = Some(t.duration_since(self.origin));
        }
        self.timeline.boot_marks = live.boot_timer.marks();
        let reason = live.exit.reason();
        let paused = reason.is_none()
            && live.exit.pause_requested()
            && spawn_err.is_none()
            && loop_err.is_none()
            && join_err.is_none()
            && vcpu_fds.len() == vcpu_count;
        if paused {
            live.exit.clear_pause();
            for (slot, t) in live.virtio.iter().enumerate() {
                if let Err(e) = t.pause() {
                    tracing::warn!(
                        slot,
                        "virtio device not paused: {e}; this VM cannot be snapshotted"
                    );
                }
            }
            live.vcpus = vcpu_fds;
            drop(em);
            drop(shared);
            tracing::info!(at_us = exit_at.as_micros() as u64, "VM paused");
            self.live = Some(live);
            return Ok(ExitReason::Paused);
        }
        drop(vcpu_fds);
        // Stop device workers (joins their threads).
        for t in &live.virtio {
            t.shutdown();
        }
        drop(em);
        drop(shared);
        drop(live);
        tracing::info!(exit_us = exit_at.as_micros() as u64, ?reason, "VM finished");

        if let Some(e) = spawn_err {
            return Err(e.into());
        }
        if let Some(e) = loop_err {
            return Err(e);
        }
        if let Some(e) = join_err {
            return Err(e.into());
        }
        Ok(reason.unwrap_or(ExitReason::Stopped))
    }
}

impl Vm {
    /// Saves this VM into `dir` (created 0700 if missing) as a snapshot
    /// whose state file carries `key`, which [`Vm::restore`] must be given
    /// again (the caller's identity of the machine: kernel, images,
    /// command line, shape, host, helper build). The VM must be paused
    /// ([`PauseHandle`], `run()` returned [`ExitReason::Paused`]) or never
    /// have run. What is saved and in which order, and how the files are
    /// committed, is in [`crate::snapshot`]. The vsock device resets its
    /// connections here. Afterwards the VM can `run()` again (resume) or be
    /// dropped. On error nothing a later restore would use is left behind
    /// (a previous snapshot in `dir` stays in force).
    pub fn snapshot(&mut self, dir: &Path, key: &str) -> Result<SnapshotInfo, SnapshotError> {
        let began = Instant::now();
        let live = self
            .live
            .as_mut()
            .ok_or(SnapshotError::NotPaused("finished"))?;
        // Every device must be saveable before anything changes.
        for (slot, t) in live.virtio.iter().enumerate() {
            if t.is_activated() && !t.is_paused() {
                return Err(SnapshotError::Device {
                    slot,
                    source: crate::virtio::DeviceStateError::Stop {
                        device: "virtio",
                        reason: "the device did not pause (see the log); it cannot be saved".into(),
                    },
                });
            }
        }
        if key.len() > snapshot::file::MAX_KEY_BYTES {
            return Err(snapshot::file::StateFileError::TooLong {
                what: "key",
                len: key.len() as u64,
                max: snapshot::file::MAX_KEY_BYTES as u64,
            }
            .into());
        }
        snapshot::prepare_dir(dir)?;

        // vCPUs (each in the order of kvm_state), then the VM, then devices.
        let msrs = kvm_state::msr_list(&live.kvm)?;
        let xsave = kvm_state::xsave_size(&live.vm_fd);
        let mut vcpu_states = Vec::with_capacity(live.vcpus.len());
        for (i, fd) in live.vcpus.iter().enumerate() {
            vcpu_states.push(kvm_state::save_vcpu(i as u8, fd, &msrs, xsave)?);
        }
        let vm = kvm_state::save_vm(&live.vm_fd)?;
        let serial = live.serial.snapshot();
        let mut devices = Vec::with_capacity(live.virtio.len());
        for (slot, t) in live.virtio.iter().enumerate() {
            devices.push(
                t.save_state()
                    .map_err(|source| SnapshotError::Device { slot, source })?,
            );
        }
        let state_time = began.elapsed();

        // Memory last: saving a device may still write to it.
        let memory = snapshot::write_memory(dir, &live.ram.mem, live.ram.size)?;
        let memory_time = began.elapsed() - state_time;
        let state = snapshot::VmState {
            memory_file: memory.name.clone(),
            mem_mib: live.ram.size / layout::MIB,
            vcpus: u8::try_from(live.vcpus.len()).unwrap_or(u8::MAX),
            cmdline: self.cmdline.clone(),
            vcpu_states,
            vm,
            serial,
            devices,
        };
        let (state_file, state_bytes) = match snapshot::write_state(dir, key, &state) {
            Ok(written) => written,
            Err(e) => {
                let _ = std::fs::remove_file(&memory.path);
                return Err(e);
            }
        };
        snapshot::remove_stale(dir, &memory.name);
        let info = SnapshotInfo {
            state_file,
            memory_bytes: live.ram.size,
            memory_data_bytes: memory.data_bytes,
            memory_disk_bytes: snapshot::disk_bytes(&memory.path),
            memory_file: memory.path,
            state_bytes,
            state_time,
            memory_time,
            total_time: began.elapsed(),
        };
        tracing::info!(
            dir = %dir.display(),
            state_bytes,
            memory_data_mib = info.memory_data_bytes >> 20,
            memory_disk_mib = info.memory_disk_bytes >> 20,
            state_ms = state_time.as_secs_f64() * 1e3,
            total_ms = info.total_time.as_secs_f64() * 1e3,
            "VM snapshot taken"
        );
        Ok(info)
    }

    /// Builds the VM `config` describes from the snapshot in `dir`
    /// instead of booting it: `key` must be the one the snapshot was taken
    /// with, and the machine's shape (vCPUs, memory, command line, device
    /// types and queues, in slot order) must be the snapshot's; the kernel
    /// and initrd are not read. `config.virtio_devices` are the new VM's
    /// devices, freshly built (new backends); each gets its saved
    /// transport, queue and device state. Guest memory is mapped
    /// copy-on-write from the memory file (`config.memory_backing` must
    /// not be [`memory::Backing::Memfd`]). Nothing runs until [`Vm::run`],
    /// which resumes the devices, then the vCPUs where they stopped. Any
    /// failure is an error with nothing left open; the caller can boot
    /// cold. Steps and order: [`crate::snapshot`].
    pub fn restore(config: Config, dir: &Path, key: &str) -> Result<Vm, SnapshotError> {
        let origin = Instant::now();
        let mut phases = RestorePhases::default();
        let mut mark = origin;
        let mut lap = |slot: &mut Duration| {
            let now = Instant::now();
            *slot += now.duration_since(mark);
            mark = now;
        };
        let Config {
            kernel: _,
            initrd: _,
            cmdline,
            mem_mib,
            vcpus,
            memory_backing,
            serial,
            virtio_devices,
            seccomp,
        } = config;

        // The state file and the shape.
        let state = snapshot::read_state(dir, key)?;
        let shape = |what: &'static str, saved: String, config: String| {
            if saved == config {
                Ok(())
            } else {
                Err(SnapshotError::Shape {
                    what,
                    saved,
                    config,
                })
            }
        };
        if memory_backing == memory::Backing::Memfd {
            shape(
                "guest memory backing",
                "private".into(),
                "a shared memfd".into(),
            )?;
        }
        shape("vCPU count", state.vcpus.to_string(), vcpus.to_string())?;
        shape(
            "vCPU state count",
            state.vcpu_states.len().to_string(),
            vcpus.to_string(),
        )?;
        shape(
            "memory (MiB)",
            state.mem_mib.to_string(),
            mem_mib.to_string(),
        )?;
        shape(
            "virtio device count",
            state.devices.len().to_string(),
            virtio_devices.len().to_string(),
        )?;
        if vcpus == 0 || vcpus > layout::MAX_VCPUS {
            return Err(VmError::Config(format!(
                "vCPU count {vcpus} out of range 1..={}",
                layout::MAX_VCPUS
            ))
            .into());
        }
        if virtio_devices.len() > layout::VIRTIO_MMIO_MAX_SLOTS {
            return Err(VmError::Config(format!(
                "{} virtio devices requested, at most {} slots exist",
                virtio_devices.len(),
                layout::VIRTIO_MMIO_MAX_SLOTS
            ))
            .into());
        }
        for (slot, (dev, saved)) in virtio_devices.iter().zip(&state.devices).enumerate() {
            let sizes: Vec<u16> = saved.queues.iter().map(|q| q.max_size).collect();
            if dev.device_type() != saved.device_type || dev.queue_max_sizes() != sizes {
                return Err(SnapshotError::Shape {
                    what: "virtio device",
                    saved: format!(
                        "slot {slot}: type {} with queues {sizes:?}",
                        saved.device_type
                    ),
                    config: format!(
                        "slot {slot}: type {} with queues {:?}",
                        dev.device_type(),
                        dev.queue_max_sizes()
                    ),
                });
            }
        }
        let slots: Vec<MmioSlot> = (0..virtio_devices.len())
            .map(|i| MmioSlot {
                base: layout::virtio_mmio_slot_addr(i),
                len: layout::VIRTIO_MMIO_SLOT_SIZE,
                gsi: layout::virtio_mmio_slot_irq(i),
            })
            .collect();
        let full_cmdline = full_cmdline(&cmdline, &slots);
        shape("command line", state.cmdline.clone(), full_cmdline.clone())?;
        let memory_file = Arc::new(snapshot::open_memory(dir, &state.memory_file)?);
        lap(&mut phases.state);

        // KVM: the VM and its memory, then platform pages, irqchip, PIT and
        // vCPUs, in build's order: registering a memory slot costs several
        // times more once vCPUs exist (KVM synchronises every vCPU's view
        // of the slots), and nothing in KVM orders the two.
        let kvm = kvm_check::check_capabilities().map_err(VmError::from)?;
        let max = kvm.get_max_vcpus();
        if usize::from(vcpus) > max {
            return Err(
                VmError::Config(format!("{vcpus} vCPUs requested, this KVM allows {max}")).into(),
            );
        }
        let _ = cpuid::request_amx_permission();
        let vm_fd = kvm.create_vm().map_err(ioctl("KVM_CREATE_VM"))?;
        lap(&mut phases.kvm);

        // Guest memory: the memory file, copy-on-write.
        let ram = memory::map_snapshot(mem_mib, memory_file)?;
        register_memory(&vm_fd, &ram)?;
        lap(&mut phases.memory);

        vm_fd
            .set_identity_map_address(layout::KVM_IDENTITY_MAP_ADDRESS)
            .map_err(ioctl("KVM_SET_IDENTITY_MAP_ADDR"))?;
        vm_fd
            .set_tss_address(layout::KVM_TSS_ADDRESS as usize)
            .map_err(ioctl("KVM_SET_TSS_ADDR"))?;
        vm_fd
            .create_irq_chip()
            .map_err(ioctl("KVM_CREATE_IRQCHIP"))?;
        vm_fd
            .create_pit2(kvm_pit_config {
                flags: KVM_PIT_SPEAKER_DUMMY,
                ..Default::default()
            })
            .map_err(ioctl("KVM_CREATE_PIT2"))?;
        let mut vcpu_fds = Vec::with_capacity(usize::from(vcpus));
        for index in 0..vcpus {
            vcpu_fds.push(
                vm_fd
                    .create_vcpu(u64::from(index))
                    .map_err(ioctl("KVM_CREATE_VCPU"))?,
            );
        }
        lap(&mut phases.kvm);

        // vCPUs, then the VM's in-kernel devices.
        let xsave = kvm_state::xsave_size(&vm_fd);
        let tsc_khz = state.vcpu_states.first().and_then(|s| s.tsc_khz);
        if kvm_state::match_tsc_khz(&vcpu_fds, tsc_khz)? {
            tracing::info!(
                tsc_khz,
                "restored vCPUs run at the snapshot's TSC frequency"
            );
        }
        for (i, (fd, s)) in vcpu_fds.iter().zip(&state.vcpu_states).enumerate() {
            kvm_state::restore_vcpu(i as u8, fd, s, xsave)?;
        }
        lap(&mut phases.vcpus);
        kvm_state::restore_vm(&vm_fd, &state.vm)?;
        lap(&mut phases.vm);

        // Devices last: nothing raises an interrupt before the irqchip and
        // LAPICs hold their saved state.
        let Platform {
            exit,
            com1_irq,
            serial,
            boot_timer,
            pio,
        } = platform(&vm_fd, serial, Some(&state.serial), origin)?;
        let mut mmio = Bus::new();
        let mut transports = Vec::with_capacity(virtio_devices.len());
        for (i, ((dev, saved), slot)) in virtio_devices
            .into_iter()
            .zip(&state.devices)
            .zip(&slots)
            .enumerate()
        {
            let t = MmioTransport::restore(dev, ram.mem.clone(), saved)
                .map_err(|source| SnapshotError::Transport { slot: i, source })?;
            transports.push(attach_virtio(&vm_fd, &mut mmio, i, Arc::new(t), slot)?);
        }
        lap(&mut phases.devices);

        let build = origin.elapsed();
        tracing::info!(
            restore_us = build.as_micros() as u64,
            state_us = phases.state.as_micros() as u64,
            kvm_us = phases.kvm.as_micros() as u64,
            memory_us = phases.memory.as_micros() as u64,
            vcpus_us = phases.vcpus.as_micros() as u64,
            vm_us = phases.vm.as_micros() as u64,
            devices_us = phases.devices.as_micros() as u64,
            vcpus,
            mem_mib,
            "VM restored from a snapshot"
        );
        Ok(Vm::assemble(
            Live {
                kvm,
                vm_fd,
                ram,
                vcpus: vcpu_fds,
                pio: Arc::new(pio),
                mmio: Arc::new(mmio),
                exit,
                serial,
                boot_timer,
                _com1_irq: com1_irq,
                paused_clock: None,
                virtio: transports,
            },
            origin,
            Timeline {
                build,
                restore: Some(phases),
                ..Default::default()
            },
            full_cmdline,
            seccomp,
        ))
    }
}

/// Registers every region of `ram` as a KVM memory slot.
fn register_memory(vm_fd: &VmFd, ram: &GuestRam) -> Result<(), VmError> {
    for (slot, region) in ram.mem.iter().enumerate() {
        let r = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: region.as_ptr() as u64,
        };
        // SAFETY: the region is a live mapping of exactly memory_size
        // bytes owned by `ram`, which outlives the VM fd (both are
        // dropped together in `Live`, VM fd first).
        unsafe { vm_fd.set_user_memory_region(r) }.map_err(ioctl("KVM_SET_USER_MEMORY_REGION"))?;
    }
    Ok(())
}

/// Sets kvmclock back to `clock` (read when the VM paused) and tells
/// every vCPU's guest it was stopped (`KVM_KVMCLOCK_CTRL`), as QEMU does
/// on `cont`: the guest's monotonic clock does not jump over the pause,
/// which would otherwise show as a stall to its RCU and lockup detectors
/// (a nested Linux guest here stopped printing for good inside such a
/// stall report after a 23 s snapshot pause). Failures are logged; the
/// VM runs either way.
fn resume_clock(vm_fd: &VmFd, vcpus: &[VcpuFd], mut clock: kvm_bindings::kvm_clock_data) {
    // No flags: KVM_CLOCK_REALTIME would advance the clock by the time
    // elapsed (see snapshot::kvm_state).
    clock.flags = 0;
    if let Err(e) = vm_fd.set_clock(&clock) {
        tracing::warn!("cannot set kvmclock back after the pause: {e}");
    }
    for (i, fd) in vcpus.iter().enumerate() {
        match fd.kvmclock_ctrl() {
            Ok(()) => {}
            Err(e) if e.errno() == libc::EINVAL => {}
            Err(e) => tracing::warn!(vcpu = i, "KVM_KVMCLOCK_CTRL: {e}"),
        }
    }
}

/// The command line plus one `virtio_mmio.device=<size>@<base>:<irq>` per
/// slot (the syntax of Linux's virtio_mmio module parameter).
pub fn full_cmdline(base: &str, slots: &[MmioSlot]) -> String {
    let mut s = base.trim().to_string();
    for slot in slots {
        if !s.is_empty() {
            s.push(' ');
        }
        s.push_str(&format!(
            "virtio_mmio.device={}K@{:#x}:{}",
            slot.len / 1024,
            slot.base,
            slot.gsi
        ));
    }
    s
}

fn wire_virtio(
    vm_fd: &VmFd,
    mmio: &mut Bus,
    i: usize,
    dev: Box<dyn VirtioDevice>,
    slot: &MmioSlot,
    mem: &GuestMemory,
) -> Result<Arc<MmioTransport>, VmError> {
    let t = Arc::new(
        MmioTransport::new(dev, mem.clone()).map_err(|e| VmError::Virtio {
            slot: i,
            msg: e.to_string(),
        })?,
    );
    attach_virtio(vm_fd, mmio, i, t, slot)
}

/// Puts transport `t` at `slot` (index `i`): its register window on the
/// MMIO bus, an ioeventfd per queue, its irqfd.
fn attach_virtio(
    vm_fd: &VmFd,
    mmio: &mut Bus,
    i: usize,
    t: Arc<MmioTransport>,
    slot: &MmioSlot,
) -> Result<Arc<MmioTransport>, VmError> {
    let verr = |msg: String| VmError::Virtio { slot: i, msg };
    mmio.insert(t.clone(), slot.base, slot.len)?;
    for (evt, addr, q) in t.ioeventfds(slot.base) {
        debug_assert_eq!(addr, slot.base + layout::VIRTIO_MMIO_QUEUE_NOTIFY);
        vm_fd
            .register_ioevent(evt, &IoEventAddress::Mmio(addr), q)
            .map_err(|e| verr(format!("KVM_IOEVENTFD for queue {q}: {e}")))?;
    }
    vm_fd
        .register_irqfd(t.interrupt_evt(), slot.gsi)
        .map_err(|e| verr(format!("KVM_IRQFD on GSI {}: {e}", slot.gsi)))?;
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_gets_virtio_entries() {
        let slots = [
            MmioSlot {
                base: 0xd000_0000,
                len: 0x1000,
                gsi: 5,
            },
            MmioSlot {
                base: 0xd000_1000,
                len: 0x1000,
                gsi: 6,
            },
        ];
        assert_eq!(
            full_cmdline(" console=ttyS0 ", &slots),
            "console=ttyS0 virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=4K@0xd0001000:6"
        );
        assert_eq!(
            full_cmdline("", &slots[..1]),
            "virtio_mmio.device=4K@0xd0000000:5"
        );
        assert_eq!(full_cmdline("a", &[]), "a");
    }

    #[test]
    fn stop_handle_outliving_vm_is_harmless() {
        let exit = ExitSignal::new().unwrap();
        let h = StopHandle(Arc::downgrade(&exit));
        assert!(h.stop());
        assert_eq!(exit.reason(), Some(ExitReason::Stopped));
        drop(exit);
        assert!(!h.stop());
    }
}
