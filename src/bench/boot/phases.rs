//! The boot phases of one `bench boot` run, derived from what the client
//! measured and what the helper logged ([`super::log::BootEvents`]), and
//! their medians and 90th percentiles over the runs.
//!
//! Two clocks meet here: the host's wall clock (the client's `startVM` and
//! the helper's log lines) and the guest's `CLOCK_BOOTTIME`, which starts
//! with the guest kernel's early clock (TSC) set-up, moments after kernel
//! entry, and which the agent reports in its hello (agent start, userland
//! switch, connection; see `guest_agent::proto::BootTimes`). The host time
//! at which that guest clock read zero ("kernel clock start") ties them:
//! - kvm: each boot-port mark is logged with the host time it was written
//!   and carries the guest clock in ms; marks written at the moment they
//!   stamp (init done, connected) give the offset to within a millisecond
//!   (the smallest host − guest difference is taken, plus half a
//!   millisecond for the guest's truncation);
//! - qemu (no boot port): the hello's arrival at the helper minus the
//!   guest clock at the agent's connection; the few milliseconds the agent
//!   takes to send the hello make that start look later, so QEMU's
//!   "VMM ready → kernel" phase is slightly longer and its "hello →
//!   connected" slightly shorter than they are.
//!
//! "VMM ready" is the first `KVM_RUN` of our VMM (from its timeline) and,
//! for QEMU, the last of its vhost-user frontends connecting (QEMU has
//! parsed its configuration and realised our devices; what is left before
//! the first guest instruction is QEMU's machine reset). A phase whose
//! source is missing is `None` (absent, `null` in JSON), never guessed.
//!
//! A warm start ([`StartKind::Warm`]) restores the boot snapshot instead
//! of booting, so the guest's boot clock and the hello's boot marks are
//! those of the snapshot's own boot and say nothing about this start: none
//! of the kernel and agent phases is derived for it. Its phases are
//! host-side, each backend's own restore then the guest's reconnection:
//! - kvm ([`Phase::KVM_WARM_TIMELINE`]): the VMM's restore phases (from
//!   its `VM restored from a snapshot` line; "VMM ready" is the first
//!   `KVM_RUN` after the restore), the agent's connection after the
//!   restore (the boot-port mark it writes when it dials again, by the
//!   VMM's clock: only its host time is used);
//! - qemu ([`Phase::QEMU_WARM_TIMELINE`]): the backend's restore phases
//!   (from its `qemu boot snapshot restored` line: the RAM copied into a
//!   new memfd, the helper's device servers set up and QEMU spawned, QEMU
//!   up and the device state loaded, the hot-plugs and `cont`; the line is
//!   logged as the machine runs, which is "VMM ready"), the agent's
//!   connection after the restore (the helper's `guest agent dialled`
//!   line, which lags the dial by up to its 20 ms accept poll);
//!
//! then the helper reading the agent's final hello, and `startVM`'s
//! answer. The phases both kinds measure the same way (helper → VMM ready,
//! VMM ready → final hello read, final hello read → answered, startVM →
//! connected, first spawn → exit) give the warm/cold ratios.

use guest_agent::milestone::{self, Milestone};

use super::log::{BootEvents, LogLine};

/// Half a millisecond in µs: the midpoint of a guest stamp truncated to ms.
const HALF_MS_US: f64 = US_PER_MS / 2.0;

/// µs per ms.
const US_PER_MS: f64 = 1000.0;

/// Which backend a run used.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Kvm,
    Qemu,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Kvm => "kvm",
            Backend::Qemu => "qemu",
        }
    }
}

/// How a run's VM started.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    serde::Deserialize,
    serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum StartKind {
    /// The kernel booted (the helper ran with `--snapshot off`, or took
    /// the boot snapshot; every run of a document from before warm starts
    /// were measured).
    #[default]
    Cold,
    /// The backend restored its boot snapshot.
    Warm,
}

impl StartKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StartKind::Cold => "cold",
            StartKind::Warm => "warm",
        }
    }
}

/// One phase of a boot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// `startVM` sent → the VMM runs the guest (kvm: first `KVM_RUN`) or
    /// QEMU is up (its last vhost-user frontend connected).
    HelperToVmmReady,
    /// VMM ready → the guest kernel's clock starts (firmware, kernel
    /// loading and decompression, the kernel's earliest set-up).
    VmmReadyToKernel,
    /// Kernel clock start → the agent's `main` (the kernel's boot, the
    /// initramfs unpacked, `/init` executed).
    KernelToAgent,
    /// Agent start → root switched to the userland disk (mounts, modules,
    /// clock, loopback, the userland disk and its overlay).
    AgentToUserland,
    /// Userland switch → the agent connected to the host (session disk,
    /// share, egress, connection).
    UserlandToHello,
    /// Agent start → connected to the host (the two phases above, or all
    /// of init when the VM stays on its initramfs).
    AgentToHello,
    /// Kernel clock start → agent connected: the guest-side part.
    KernelToHello,
    /// Agent connected (guest) → `startVM` answered (host): reading the
    /// hello, checking it, wiring the link, the reply.
    HelloToConnected,
    /// Warm: `startVM` sent → the restore begins (the request, the
    /// session disk check; kvm: the devices, the VM thread).
    HelperToRestore,
    /// Warm, restore: the state file read and checked against this
    /// machine.
    RestoreState,
    /// Warm, restore: the KVM VM, its irqchip, PIT and vCPUs created.
    RestoreKvm,
    /// Warm, restore: the memory file mapped copy-on-write and registered.
    RestoreMemory,
    /// Warm, restore: the vCPUs' saved state loaded.
    RestoreVcpus,
    /// Warm, restore: the VM's saved clock, PIT and irqchip loaded.
    RestoreVm,
    /// Warm, restore: platform and virtio devices restored and attached.
    RestoreDevices,
    /// Warm, qemu restore: the snapshot's RAM data copied into a new memfd.
    RestoreRam,
    /// Warm, qemu restore: the helper's vhost-user servers set up and QEMU
    /// spawned (the restore's total minus its three measured steps).
    RestoreSpawn,
    /// Warm, qemu restore: QEMU up (its QMP socket) and the device state
    /// loaded (`-incoming defer`).
    RestoreLoad,
    /// Warm, qemu restore: vsock, virtio-fs and rng hot-plugged, `cont`.
    RestoreHotplug,
    /// Warm: the whole restore (kvm: the VMM's six phases; qemu: from the
    /// RAM copy to the machine running).
    RestoreTotal,
    /// Warm, kvm: restore done → the first `KVM_RUN` (the VM thread hands
    /// the machine over and resumes the devices and vCPUs).
    RestoredToVmRun,
    /// Warm: the VM runs (kvm: first `KVM_RUN`; qemu: `cont`) → the agent
    /// dialled the host again (kvm: its link was reset by the restore;
    /// qemu: it found its hot-plugged vsock device).
    VmRunToRedial,
    /// Warm: the agent dialled → the helper read its final hello (template
    /// hello, this boot's Setup, the session disk and share mounted, final
    /// hello).
    RedialToHelloRead,
    /// VMM ready → the helper read the agent's final hello (host clock):
    /// cold, the whole guest boot; warm, the guest-side part of the start.
    VmmReadyToHelloRead,
    /// The helper read the agent's final hello → `startVM` answered (host
    /// clock): checking the hello, wiring the link, the reply.
    HelloReadToConnected,
    /// `startVM` sent → its reply (the guest connected), at the client.
    StartVmToConnected,
    /// First `spawn` of `/bin/true` sent → its exit event, at the client.
    FirstSpawnToExit,
}

impl Phase {
    pub const ALL: [Phase; 27] = [
        Phase::HelperToVmmReady,
        Phase::VmmReadyToKernel,
        Phase::KernelToAgent,
        Phase::AgentToUserland,
        Phase::UserlandToHello,
        Phase::AgentToHello,
        Phase::KernelToHello,
        Phase::HelloToConnected,
        Phase::HelperToRestore,
        Phase::RestoreState,
        Phase::RestoreKvm,
        Phase::RestoreMemory,
        Phase::RestoreVcpus,
        Phase::RestoreVm,
        Phase::RestoreDevices,
        Phase::RestoreRam,
        Phase::RestoreSpawn,
        Phase::RestoreLoad,
        Phase::RestoreHotplug,
        Phase::RestoreTotal,
        Phase::RestoredToVmRun,
        Phase::VmRunToRedial,
        Phase::RedialToHelloRead,
        Phase::VmmReadyToHelloRead,
        Phase::HelloReadToConnected,
        Phase::StartVmToConnected,
        Phase::FirstSpawnToExit,
    ];

    /// The phases that follow each other from `startVM` to connected in a
    /// cold boot (the chart's stacked segments), when the VM switched to a
    /// userland disk.
    pub const COLD_TIMELINE: [Phase; 6] = [
        Phase::HelperToVmmReady,
        Phase::VmmReadyToKernel,
        Phase::KernelToAgent,
        Phase::AgentToUserland,
        Phase::UserlandToHello,
        Phase::HelloToConnected,
    ];

    /// The phases that follow each other from `startVM` to connected in a
    /// kvm warm start.
    pub const KVM_WARM_TIMELINE: [Phase; 11] = [
        Phase::HelperToRestore,
        Phase::RestoreState,
        Phase::RestoreKvm,
        Phase::RestoreMemory,
        Phase::RestoreVcpus,
        Phase::RestoreVm,
        Phase::RestoreDevices,
        Phase::RestoredToVmRun,
        Phase::VmRunToRedial,
        Phase::RedialToHelloRead,
        Phase::HelloReadToConnected,
    ];

    /// The phases that follow each other from `startVM` to connected in a
    /// qemu warm start.
    pub const QEMU_WARM_TIMELINE: [Phase; 8] = [
        Phase::HelperToRestore,
        Phase::RestoreRam,
        Phase::RestoreSpawn,
        Phase::RestoreLoad,
        Phase::RestoreHotplug,
        Phase::VmRunToRedial,
        Phase::RedialToHelloRead,
        Phase::HelloReadToConnected,
    ];

    /// The stacked phases of a start of this backend and kind.
    pub fn timeline(backend: Backend, kind: StartKind) -> &'static [Phase] {
        match (backend, kind) {
            (_, StartKind::Cold) => &Phase::COLD_TIMELINE,
            (Backend::Kvm, StartKind::Warm) => &Phase::KVM_WARM_TIMELINE,
            (Backend::Qemu, StartKind::Warm) => &Phase::QEMU_WARM_TIMELINE,
        }
    }

    /// Whether a start of this backend and kind measures the phase (the
    /// others are always absent for it).
    pub fn measured_in(self, backend: Backend, kind: StartKind) -> bool {
        let warm = kind == StartKind::Warm;
        match self {
            Phase::HelperToVmmReady
            | Phase::VmmReadyToHelloRead
            | Phase::HelloReadToConnected
            | Phase::StartVmToConnected
            | Phase::FirstSpawnToExit => true,
            Phase::VmmReadyToKernel
            | Phase::KernelToAgent
            | Phase::AgentToUserland
            | Phase::UserlandToHello
            | Phase::AgentToHello
            | Phase::KernelToHello
            | Phase::HelloToConnected => kind == StartKind::Cold,
            Phase::HelperToRestore
            | Phase::RestoreTotal
            | Phase::VmRunToRedial
            | Phase::RedialToHelloRead => warm,
            Phase::RestoreState
            | Phase::RestoreKvm
            | Phase::RestoreMemory
            | Phase::RestoreVcpus
            | Phase::RestoreVm
            | Phase::RestoreDevices
            | Phase::RestoredToVmRun => warm && backend == Backend::Kvm,
            Phase::RestoreRam
            | Phase::RestoreSpawn
            | Phase::RestoreLoad
            | Phase::RestoreHotplug => warm && backend == Backend::Qemu,
        }
    }

    /// The JSON key.
    pub fn key(self) -> &'static str {
        match self {
            Phase::HelperToVmmReady => "helper_to_vmm_ready",
            Phase::VmmReadyToKernel => "vmm_ready_to_kernel",
            Phase::KernelToAgent => "kernel_to_agent",
            Phase::AgentToUserland => "agent_to_userland",
            Phase::UserlandToHello => "userland_to_hello",
            Phase::AgentToHello => "agent_to_hello",
            Phase::KernelToHello => "kernel_to_hello",
            Phase::HelloToConnected => "hello_to_connected",
            Phase::HelperToRestore => "helper_to_restore",
            Phase::RestoreState => "restore_state",
            Phase::RestoreKvm => "restore_kvm",
            Phase::RestoreMemory => "restore_memory",
            Phase::RestoreVcpus => "restore_vcpus",
            Phase::RestoreVm => "restore_vm",
            Phase::RestoreDevices => "restore_devices",
            Phase::RestoreRam => "restore_ram",
            Phase::RestoreSpawn => "restore_spawn",
            Phase::RestoreLoad => "restore_load",
            Phase::RestoreHotplug => "restore_hotplug",
            Phase::RestoreTotal => "restore_total",
            Phase::RestoredToVmRun => "restored_to_vm_run",
            Phase::VmRunToRedial => "vm_run_to_redial",
            Phase::RedialToHelloRead => "redial_to_hello_read",
            Phase::VmmReadyToHelloRead => "vmm_ready_to_hello_read",
            Phase::HelloReadToConnected => "hello_read_to_connected",
            Phase::StartVmToConnected => "startvm_to_connected",
            Phase::FirstSpawnToExit => "first_spawn_to_exit",
        }
    }

    /// Words for the table and the chart's legend.
    pub fn label(self) -> &'static str {
        match self {
            Phase::HelperToVmmReady => "helper → VMM/QEMU ready",
            Phase::VmmReadyToKernel => "VMM ready → kernel clock",
            Phase::KernelToAgent => "kernel → agent start",
            Phase::AgentToUserland => "agent → userland switch",
            Phase::UserlandToHello => "userland → hello",
            Phase::AgentToHello => "agent → hello",
            Phase::KernelToHello => "kernel → hello (guest side)",
            Phase::HelloToConnected => "hello → startVM answered",
            Phase::HelperToRestore => "helper → restore begins",
            Phase::RestoreState => "restore: state file",
            Phase::RestoreKvm => "restore: KVM VM and vCPUs",
            Phase::RestoreMemory => "restore: guest memory",
            Phase::RestoreVcpus => "restore: vCPU state",
            Phase::RestoreVm => "restore: VM clock, PIT, irqchip",
            Phase::RestoreDevices => "restore: devices",
            Phase::RestoreRam => "restore: RAM copied into memfd",
            Phase::RestoreSpawn => "restore: servers set up, QEMU spawned",
            Phase::RestoreLoad => "restore: QEMU start + device state loaded",
            Phase::RestoreHotplug => "restore: hot-plug + cont",
            Phase::RestoreTotal => "restore (total)",
            Phase::RestoredToVmRun => "restored → first KVM_RUN",
            Phase::VmRunToRedial => "VM runs → agent (re)dialled",
            Phase::RedialToHelloRead => "redial → final hello (Setup, disks)",
            Phase::VmmReadyToHelloRead => "VMM ready → final hello read",
            Phase::HelloReadToConnected => "final hello read → answered",
            Phase::StartVmToConnected => "startVM → connected",
            Phase::FirstSpawnToExit => "first spawn → exit",
        }
    }

    fn index(self) -> usize {
        Phase::ALL
            .iter()
            .position(|p| *p == self)
            .unwrap_or_default()
    }
}

/// Milliseconds per phase of one run ([`Phase::ALL`] order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Phases([Option<f64>; Phase::ALL.len()]);

impl Phases {
    pub fn get(&self, p: Phase) -> Option<f64> {
        self.0[p.index()]
    }

    pub fn set(&mut self, p: Phase, ms: Option<f64>) {
        self.0[p.index()] = ms.filter(|v| v.is_finite());
    }
}

/// What the client measured in one run, with the helper's boot events.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRecord {
    pub backend: Backend,
    /// How the VM started (checked against the helper's log before the
    /// phases are derived).
    pub start: StartKind,
    /// Wall time (µs since the epoch) the client sent `startVM`.
    pub start_vm_sent_at: i64,
    /// `startVM` sent → answered, at the client (ms).
    pub start_vm_ms: f64,
    /// First spawn → its exit event, at the client (ms).
    pub spawn_exit_ms: Option<f64>,
    /// Resident memory once `startVM` answered of the process that holds
    /// the guest's memory: the kvm helper (the VMM is in-process), the
    /// QEMU process (its `pid` from the `qemu started` line).
    pub rss: Option<Rss>,
    pub events: BootEvents,
}

/// Resident memory of a process (`/proc/<pid>/status`), KiB: anonymous
/// (a cold VM's touched RAM, a restored one's written pages) and file-backed
/// (a restored VM's pages read from its snapshot, the executable; shared
/// memory counts here too: a snapshot in a tmpfs data directory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rss {
    pub anon_kib: u64,
    pub file_kib: u64,
}

impl Rss {
    /// `RssAnon` and `RssFile` of a `/proc/<pid>/status` text.
    pub fn of_status(status: &str) -> Option<Rss> {
        use crate::bench::status_kib;
        Some(Rss {
            anon_kib: status_kib(status, "RssAnon:")?,
            file_kib: status_kib(status, "RssFile:")?
                + status_kib(status, "RssShmem:").unwrap_or(0),
        })
    }
}

/// The guest's boot clock as the hello reported it (µs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct GuestClock {
    agent_start: Option<f64>,
    userland_switched: Option<f64>,
    connected: Option<f64>,
}

fn guest_clock(hello: Option<&LogLine>, ev: &BootEvents) -> GuestClock {
    let mut g = GuestClock {
        agent_start: hello.and_then(|h| h.num("agent_start_us")),
        userland_switched: hello.and_then(|h| h.num("userland_switched_us")),
        connected: hello.and_then(|h| h.num("connected_us")),
    };
    // An agent whose hello predates the field: the kvm boot port has it.
    if g.userland_switched.is_none() {
        g.userland_switched = ev.marks.iter().find_map(|m| {
            let (code, guest_ms) = milestone::decode(m.value);
            (code == Milestone::UserlandSwitched as u8)
                .then_some(f64::from(guest_ms) * US_PER_MS + HALF_MS_US)
        });
    }
    g
}

/// Wall time (µs) at which our VMM began building the VM: each mark's log
/// line minus the VMM's own time of the write (the smallest difference is
/// the least delayed line); else the "started" line minus the build time.
/// A restored VM's VMM clock starts with the restore: its line (logged as
/// the restore ended) minus the restore's time.
fn vmm_origin(rec: &RunRecord) -> Option<f64> {
    let ev = &rec.events;
    if rec.start == StartKind::Warm {
        if let Some(r) = ev.restore {
            return Some(r.logged_at as f64 - r.total_us);
        }
    }
    let from_marks = ev
        .marks
        .iter()
        .map(|m| m.logged_at as f64 - m.at_us as f64)
        .min_by(f64::total_cmp);
    match rec.start {
        StartKind::Cold => from_marks.or_else(|| {
            ev.kvm_started
                .map(|(at, build_ms)| at as f64 - build_ms * US_PER_MS)
        }),
        // The "started" line's build time is the helper's, from before the
        // VM thread began the restore.
        StartKind::Warm => from_marks,
    }
}

/// Wall time (µs) at which the guest's boot clock read zero (see the module
/// documentation).
fn kernel_clock_start(rec: &RunRecord, g: &GuestClock) -> Option<f64> {
    match rec.backend {
        Backend::Kvm => {
            let origin = vmm_origin(rec)?;
            rec.events
                .marks
                .iter()
                .filter_map(|m| {
                    let (code, guest_ms) = milestone::decode(m.value);
                    // Marks written at the moment they stamp.
                    let prompt =
                        code == Milestone::InitDone as u8 || code == Milestone::Connected as u8;
                    prompt.then(|| {
                        origin + m.at_us as f64 - f64::from(guest_ms) * US_PER_MS - HALF_MS_US
                    })
                })
                .min_by(f64::total_cmp)
        }
        Backend::Qemu => {
            let hello = rec.events.agent_connected.as_ref()?;
            Some(hello.at_us as f64 - g.connected?)
        }
    }
}

/// Wall time (µs) the VMM was ready (see the module documentation).
fn vmm_ready(rec: &RunRecord) -> Option<f64> {
    match (rec.backend, rec.start) {
        (Backend::Kvm, _) => Some(vmm_origin(rec)? + rec.events.kvm_first_run_ms? * US_PER_MS),
        // The restore's line is logged once `cont` returned.
        (Backend::Qemu, StartKind::Warm) => rec.events.qemu_restore.map(|r| r.logged_at as f64),
        (Backend::Qemu, StartKind::Cold) => {
            let hello_at = rec.events.agent_connected.as_ref().map(|h| h.at_us);
            rec.events
                .frontend_connected
                .iter()
                .copied()
                .filter(|&at| hello_at.is_none_or(|h| at <= h))
                .max()
                .map(|at| at as f64)
        }
    }
}

fn diff_ms(later: Option<f64>, earlier: Option<f64>) -> Option<f64> {
    Some((later? - earlier?) / US_PER_MS)
}

/// The phases of one run: those of its start kind (see the module
/// documentation), then those both kinds measure.
pub fn phases(rec: &RunRecord) -> Phases {
    let t0 = Some(rec.start_vm_sent_at as f64);
    let ready = vmm_ready(rec);
    let answered = Some(rec.start_vm_sent_at as f64 + rec.start_vm_ms * US_PER_MS);
    let hello_read = rec.events.agent_connected.as_ref().map(|h| h.at_us as f64);
    let mut p = Phases::default();
    match (rec.start, rec.backend) {
        (StartKind::Cold, _) => cold_phases(rec, ready, answered, &mut p),
        (StartKind::Warm, Backend::Kvm) => kvm_warm_phases(rec, t0, ready, hello_read, &mut p),
        (StartKind::Warm, Backend::Qemu) => qemu_warm_phases(rec, t0, ready, hello_read, &mut p),
    }
    p.set(Phase::HelperToVmmReady, diff_ms(ready, t0));
    p.set(Phase::VmmReadyToHelloRead, diff_ms(hello_read, ready));
    p.set(Phase::HelloReadToConnected, diff_ms(answered, hello_read));
    p.set(Phase::StartVmToConnected, Some(rec.start_vm_ms));
    p.set(Phase::FirstSpawnToExit, rec.spawn_exit_ms);
    p
}

/// A cold boot's guest phases, from the guest's boot clock.
fn cold_phases(rec: &RunRecord, ready: Option<f64>, answered: Option<f64>, p: &mut Phases) {
    let g = guest_clock(rec.events.agent_connected.as_ref(), &rec.events);
    let clock0 = kernel_clock_start(rec, &g);
    p.set(Phase::VmmReadyToKernel, diff_ms(clock0, ready));
    p.set(Phase::KernelToAgent, diff_ms(g.agent_start, Some(0.0)));
    p.set(
        Phase::AgentToUserland,
        diff_ms(g.userland_switched, g.agent_start),
    );
    p.set(
        Phase::UserlandToHello,
        diff_ms(g.connected, g.userland_switched),
    );
    p.set(Phase::AgentToHello, diff_ms(g.connected, g.agent_start));
    p.set(Phase::KernelToHello, diff_ms(g.connected, Some(0.0)));
    let hello_at = clock0.zip(g.connected).map(|(c, k)| c + k);
    p.set(Phase::HelloToConnected, diff_ms(answered, hello_at));
}

/// A kvm warm start's phases, from the host's clocks only: the VMM's
/// restore phases, its first `KVM_RUN`, the agent's redial (the first
/// "connected" boot-port mark, at the VMM's time of the write) and the
/// helper reading the final hello.
fn kvm_warm_phases(
    rec: &RunRecord,
    t0: Option<f64>,
    ready: Option<f64>,
    hello_read: Option<f64>,
    p: &mut Phases,
) {
    let ev = &rec.events;
    let origin = vmm_origin(rec);
    p.set(Phase::HelperToRestore, diff_ms(origin, t0));
    if let Some(r) = ev.restore {
        let us = |v: Option<f64>| v.map(|v| v / US_PER_MS);
        p.set(Phase::RestoreState, us(r.state_us));
        p.set(Phase::RestoreKvm, us(r.kvm_us));
        p.set(Phase::RestoreMemory, us(r.memory_us));
        p.set(Phase::RestoreVcpus, us(r.vcpus_us));
        p.set(Phase::RestoreVm, us(r.vm_us));
        p.set(Phase::RestoreDevices, us(r.devices_us));
        p.set(Phase::RestoreTotal, us(Some(r.total_us)));
        let restored = origin.map(|o| o + r.total_us);
        p.set(Phase::RestoredToVmRun, diff_ms(ready, restored));
    }
    let redial = origin.zip(ev.marks.iter().find_map(|m| {
        let (code, _guest_ms) = milestone::decode(m.value);
        (code == Milestone::Connected as u8).then_some(m.at_us as f64)
    }));
    let redial = redial.map(|(o, at)| o + at);
    p.set(Phase::VmRunToRedial, diff_ms(redial, ready));
    p.set(Phase::RedialToHelloRead, diff_ms(hello_read, redial));
}

/// A qemu warm start's phases, from the host's clock only: the backend's
/// restore steps (its line is logged as the machine runs, `ready`; the
/// restore began `total_ms` before), the agent's dial (the helper's
/// accept) and the helper reading the final hello.
fn qemu_warm_phases(
    rec: &RunRecord,
    t0: Option<f64>,
    ready: Option<f64>,
    hello_read: Option<f64>,
    p: &mut Phases,
) {
    let ev = &rec.events;
    if let Some(r) = ev.qemu_restore {
        let began = r.logged_at as f64 - r.total_ms * US_PER_MS;
        p.set(Phase::HelperToRestore, diff_ms(Some(began), t0));
        p.set(Phase::RestoreRam, r.ram_ms);
        p.set(Phase::RestoreLoad, r.load_ms);
        p.set(Phase::RestoreHotplug, r.hotplug_ms);
        let steps = r
            .ram_ms
            .zip(r.load_ms)
            .zip(r.hotplug_ms)
            .map(|((a, b), c)| a + b + c);
        p.set(Phase::RestoreSpawn, steps.map(|s| r.total_ms - s));
        p.set(Phase::RestoreTotal, Some(r.total_ms));
    }
    let dialled = ev.agent_dialled.map(|at| at as f64);
    p.set(Phase::VmRunToRedial, diff_ms(dialled, ready));
    p.set(Phase::RedialToHelloRead, diff_ms(hello_read, dialled));
}

/// Median, 90th percentile and count of one phase over the runs that
/// measured it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stat {
    pub median_ms: f64,
    pub p90_ms: f64,
    pub n: usize,
}

/// The value at quantile `q` (0..=1) of sorted samples, by linear
/// interpolation between the closest ranks.
pub fn quantile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let pos = q.clamp(0.0, 1.0) * last as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    let frac = pos - lo as f64;
    Some(sorted[lo] + (sorted[hi.min(last)] - sorted[lo]) * frac)
}

/// [`Stat`] of `phase` over `runs`; `None` when no run measured it.
pub fn stat(runs: &[Phases], phase: Phase) -> Option<Stat> {
    let mut v: Vec<f64> = runs.iter().filter_map(|r| r.get(phase)).collect();
    v.sort_by(f64::total_cmp);
    Some(Stat {
        median_ms: quantile(&v, 0.5)?,
        p90_ms: quantile(&v, 0.9)?,
        n: v.len(),
    })
}

#[cfg(test)]
mod rss_tests {
    use super::Rss;

    #[test]
    fn resident_memory_is_read_from_a_status_text() {
        let status = "Name:\tcowork-helper\nVmRSS:\t  150000 kB\nRssAnon:\t  120000 kB\nRssFile:\t   30000 kB\nRssShmem:\t     512 kB\n";
        assert_eq!(
            Rss::of_status(status),
            Some(Rss {
                anon_kib: 120_000,
                file_kib: 30_512
            })
        );
        assert_eq!(Rss::of_status("Name:\tx\nRssAnon:\t1 kB\n"), None);
    }
}

#[cfg(test)]
mod tests {
    use super::super::log::{parse_line, Mark, MSG_AGENT_CONNECTED};
    use super::*;
    use guest_agent::milestone::encode;

    const T0: i64 = 1_000_000_000;

    fn hello(at: i64, fields: &str) -> LogLine {
        let mut l = parse_line(
            &format!("1970-01-01T00:00:00Z  INFO {MSG_AGENT_CONNECTED} {fields}"),
            MSG_AGENT_CONNECTED,
        )
        .unwrap();
        l.at_us = at;
        l
    }

    #[test]
    fn kvm_phases_come_from_the_vmm_timeline_marks_and_hello() {
        // VMM origin at T0+2 ms, first KVM_RUN 3 ms later; guest clock zero
        // at T0+100 ms; agent at 400 ms, switch at 600 ms, connected 700 ms.
        let origin = T0 + 2_000;
        let clock0 = T0 + 100_000;
        let mark = |m, guest_us: i64, delay: i64| {
            let host = clock0 + guest_us + delay;
            Mark {
                value: encode(m, guest_us as u64),
                at_us: (host - origin) as u64,
                logged_at: host + 30,
            }
        };
        let ev = BootEvents {
            kvm_started: Some((T0 + 2_500, 0.4)),
            kvm_first_run_ms: Some(3.0),
            marks: vec![
                mark(Milestone::AgentStart, 400_000, 150_000),
                mark(Milestone::UserlandSwitched, 600_000, 40_000),
                mark(Milestone::InitDone, 650_500, 0),
                mark(Milestone::Connected, 700_500, 0),
            ],
            agent_connected: Some(hello(
                T0 + 802_000,
                "agent_start_us=400000 init_done_us=650500 connected_us=700500",
            )),
            ..BootEvents::default()
        };
        let rec = RunRecord {
            backend: Backend::Kvm,
            start: StartKind::Cold,
            start_vm_sent_at: T0,
            start_vm_ms: 810.0,
            spawn_exit_ms: Some(4.5),
            rss: None,
            events: ev,
        };
        let p = phases(&rec);
        let close = |ph: Phase, want: f64| {
            let got = p.get(ph).unwrap_or_else(|| panic!("{ph:?} absent"));
            assert!((got - want).abs() < 0.6, "{ph:?}: {got} != {want}");
        };
        close(Phase::HelperToVmmReady, 5.0);
        close(Phase::VmmReadyToKernel, 95.0);
        close(Phase::KernelToAgent, 400.0);
        close(Phase::AgentToUserland, 200.5);
        close(Phase::UserlandToHello, 100.0);
        close(Phase::AgentToHello, 300.5);
        close(Phase::KernelToHello, 700.5);
        close(Phase::HelloToConnected, 9.5);
        close(Phase::VmmReadyToHelloRead, 797.0);
        close(Phase::HelloReadToConnected, 8.0);
        close(Phase::StartVmToConnected, 810.0);
        close(Phase::FirstSpawnToExit, 4.5);
        // A cold boot measures no warm phase.
        for ph in Phase::ALL {
            if !ph.measured_in(Backend::Kvm, StartKind::Cold) {
                assert_eq!(p.get(ph), None, "{ph:?}");
            }
        }
    }

    #[test]
    fn qemu_phases_use_the_hello_and_absent_sources_stay_absent() {
        let ev = BootEvents {
            qemu_started: Some(super::super::log::QemuStarted {
                at_us: T0 + 5_000,
                accel: "tcg".into(),
                pid: Some(7),
            }),
            frontend_connected: vec![T0 + 90_000, T0 + 120_000, T0 + 9_000_000],
            agent_connected: Some(hello(
                T0 + 3_120_000,
                "agent_start_us=1000000 userland_switched_us=1800000 connected_us=2500000",
            )),
            ..BootEvents::default()
        };
        let rec = RunRecord {
            backend: Backend::Qemu,
            start: StartKind::Cold,
            start_vm_sent_at: T0,
            start_vm_ms: 3_125.0,
            spawn_exit_ms: None,
            rss: None,
            events: ev,
        };
        let p = phases(&rec);
        // The frontend connecting after the hello (a reconnect) is ignored.
        assert_eq!(p.get(Phase::HelperToVmmReady), Some(120.0));
        assert_eq!(p.get(Phase::VmmReadyToKernel), Some(500.0));
        assert_eq!(p.get(Phase::KernelToAgent), Some(1000.0));
        assert_eq!(p.get(Phase::AgentToUserland), Some(800.0));
        assert_eq!(p.get(Phase::UserlandToHello), Some(700.0));
        assert_eq!(p.get(Phase::HelloToConnected), Some(5.0));
        assert_eq!(p.get(Phase::FirstSpawnToExit), None);

        assert_eq!(p.get(Phase::VmmReadyToHelloRead), Some(3000.0));
        assert_eq!(p.get(Phase::HelloReadToConnected), Some(5.0));

        // No hello line at all: every guest and derived phase is absent.
        let bare = RunRecord {
            events: BootEvents::default(),
            ..rec
        };
        let p = phases(&bare);
        for ph in Phase::ALL {
            let want = ph == Phase::StartVmToConnected;
            assert_eq!(p.get(ph).is_some(), want, "{ph:?}");
        }
    }

    #[test]
    fn warm_phases_are_the_restore_and_the_host_side_never_the_snapshot_boot() {
        use super::super::log::{parse_timestamp, HelperLog, WARM_LOG};
        let base = parse_timestamp("2026-12-06T02:00:00Z").unwrap();
        // startVM sent 0.2 ms before the daemon logged it; answered at
        // 02:00:00.190.
        let rec = RunRecord {
            backend: Backend::Kvm,
            start: StartKind::Warm,
            start_vm_sent_at: base - 200,
            start_vm_ms: 190.2,
            spawn_exit_ms: Some(6.0),
            rss: None,
            events: HelperLog(WARM_LOG).parse(),
        };
        let p = phases(&rec);
        let close = |ph: Phase, want: f64| {
            let got = p.get(ph).unwrap_or_else(|| panic!("{ph:?} absent"));
            assert!((got - want).abs() < 1e-6, "{ph:?}: {got} != {want}");
        };
        // The VMM began the restore at 11 ms (its line at 41 ms, 30 ms
        // long); first KVM_RUN at the VMM's 32.5 ms; the redial mark at
        // its 89 ms; the final hello read at 180 ms.
        close(Phase::HelperToRestore, 11.2);
        close(Phase::RestoreState, 2.0);
        close(Phase::RestoreKvm, 8.0);
        close(Phase::RestoreMemory, 5.0);
        close(Phase::RestoreVcpus, 6.0);
        close(Phase::RestoreVm, 1.0);
        close(Phase::RestoreDevices, 8.0);
        close(Phase::RestoreTotal, 30.0);
        close(Phase::RestoredToVmRun, 2.5);
        close(Phase::VmRunToRedial, 56.5);
        close(Phase::RedialToHelloRead, 80.0);
        close(Phase::HelperToVmmReady, 43.7);
        close(Phase::VmmReadyToHelloRead, 136.5);
        close(Phase::HelloReadToConnected, 10.0);
        close(Phase::StartVmToConnected, 190.2);
        close(Phase::FirstSpawnToExit, 6.0);
        // The stacked phases add up to startVM → connected.
        let sum: f64 = Phase::KVM_WARM_TIMELINE
            .iter()
            .filter_map(|ph| p.get(*ph))
            .sum();
        assert!((sum - 190.2).abs() < 1e-6, "{sum}");
        // The hello's boot times and the mark's guest clock are the
        // snapshot's boot: no kernel or agent phase is made of them.
        for ph in Phase::ALL {
            if !ph.measured_in(Backend::Kvm, StartKind::Warm) {
                assert_eq!(p.get(ph), None, "{ph:?}");
            }
        }

        // Without the restore line: the restore phases are absent, the
        // rest comes from the VMM clock the marks give.
        let mut bare = rec.clone();
        bare.events.restore = None;
        let p = phases(&bare);
        for ph in [
            Phase::RestoreState,
            Phase::RestoreTotal,
            Phase::RestoredToVmRun,
        ] {
            assert_eq!(p.get(ph), None, "{ph:?}");
        }
        let got = p.get(Phase::VmRunToRedial).unwrap();
        assert!((got - 56.5).abs() < 1e-6, "{got}");
        // Without a redial mark: the guest side stays whole, unsplit.
        let mut unmarked = rec;
        unmarked.events.marks.clear();
        let p = phases(&unmarked);
        assert_eq!(p.get(Phase::VmRunToRedial), None);
        assert_eq!(p.get(Phase::RedialToHelloRead), None);
        assert!((p.get(Phase::VmmReadyToHelloRead).unwrap() - 136.5).abs() < 1e-6);
    }

    #[test]
    fn qemu_warm_phases_are_its_restore_steps_and_the_host_side() {
        use super::super::log::{parse_timestamp, HelperLog, QEMU_WARM_LOG};
        let base = parse_timestamp("2026-12-06T03:00:00Z").unwrap();
        // startVM sent 0.2 ms before the daemon logged it; answered at
        // 03:00:00.7292.
        let rec = RunRecord {
            backend: Backend::Qemu,
            start: StartKind::Warm,
            start_vm_sent_at: base - 200,
            start_vm_ms: 729.4,
            spawn_exit_ms: Some(97.0),
            rss: None,
            events: HelperLog(QEMU_WARM_LOG).parse(),
        };
        let p = phases(&rec);
        let close = |ph: Phase, want: f64| {
            let got = p.get(ph).unwrap_or_else(|| panic!("{ph:?} absent"));
            assert!((got - want).abs() < 1e-6, "{ph:?}: {got} != {want}");
        };
        // The restore line at 182 ms, 181.5 ms long: it began at 0.5 ms.
        close(Phase::HelperToRestore, 0.7);
        close(Phase::RestoreRam, 115.4);
        close(Phase::RestoreSpawn, 1.8);
        close(Phase::RestoreLoad, 49.7);
        close(Phase::RestoreHotplug, 14.6);
        close(Phase::RestoreTotal, 181.5);
        // The machine runs at 182 ms (not at its last frontend, 177 ms).
        close(Phase::HelperToVmmReady, 182.2);
        close(Phase::VmRunToRedial, 465.4);
        close(Phase::RedialToHelloRead, 81.6);
        close(Phase::VmmReadyToHelloRead, 547.0);
        close(Phase::HelloReadToConnected, 0.2);
        close(Phase::StartVmToConnected, 729.4);
        close(Phase::FirstSpawnToExit, 97.0);
        let sum: f64 = Phase::QEMU_WARM_TIMELINE
            .iter()
            .filter_map(|ph| p.get(*ph))
            .sum();
        assert!((sum - 729.4).abs() < 1e-6, "{sum}");
        // Neither the snapshot's boot nor kvm's restore phases.
        for ph in Phase::ALL {
            if !ph.measured_in(Backend::Qemu, StartKind::Warm) {
                assert_eq!(p.get(ph), None, "{ph:?}");
            }
        }
        for ph in [Phase::RestoreMemory, Phase::RestoredToVmRun] {
            assert!(!ph.measured_in(Backend::Qemu, StartKind::Warm), "{ph:?}");
            assert!(ph.measured_in(Backend::Kvm, StartKind::Warm), "{ph:?}");
        }
        assert!(!Phase::RestoreRam.measured_in(Backend::Kvm, StartKind::Warm));
        assert!(!Phase::RestoreRam.measured_in(Backend::Qemu, StartKind::Cold));

        // Without the restore line: its phases and the VM's start are
        // absent, the redial → hello read stays.
        let mut bare = rec;
        bare.events.qemu_restore = None;
        let p = phases(&bare);
        for ph in [
            Phase::HelperToRestore,
            Phase::RestoreRam,
            Phase::RestoreSpawn,
            Phase::RestoreTotal,
            Phase::HelperToVmmReady,
            Phase::VmRunToRedial,
            Phase::VmmReadyToHelloRead,
        ] {
            assert_eq!(p.get(ph), None, "{ph:?}");
        }
        assert!((p.get(Phase::RedialToHelloRead).unwrap() - 81.6).abs() < 1e-6);
    }

    #[test]
    fn medians_and_p90_skip_absent_runs() {
        assert_eq!(quantile(&[], 0.5), None);
        assert_eq!(quantile(&[3.0], 0.9), Some(3.0));
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0], 0.5), Some(2.5));
        let v: Vec<f64> = (1..=11).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.9), Some(10.0));
        let mut a = Phases::default();
        a.set(Phase::KernelToAgent, Some(10.0));
        let mut b = Phases::default();
        b.set(Phase::KernelToAgent, Some(30.0));
        b.set(Phase::FirstSpawnToExit, Some(f64::NAN));
        let runs = [a, b, Phases::default()];
        let s = stat(&runs, Phase::KernelToAgent).unwrap();
        assert_eq!((s.median_ms, s.n), (20.0, 2));
        assert!((s.p90_ms - 28.0).abs() < 1e-9);
        assert_eq!(stat(&runs, Phase::FirstSpawnToExit), None);
    }
}
