//! vCPU threads: one OS thread per vCPU running the `KVM_RUN` loop and
//! dispatching port-I/O and MMIO exits to the buses.
//!
//! Stopping: [`VcpuThread::kick`] sets the shared stop flag, sets the vCPU's
//! `kvm_run.immediate_exit`, and sends [`kick_signal`] to the thread. Every
//! position of the thread is covered: in the guest (the signal forces an exit
//! with `EINTR`), about to enter (`immediate_exit` makes `KVM_RUN` return
//! `EINTR` at once), halted in the kernel (the signal wakes it), or in
//! userspace (the loop checks the flag before re-entering). The signal
//! handler itself does nothing.
//!
//! Leaving the loop on the stop flag, a thread enters `KVM_RUN` once more
//! with `immediate_exit` set: KVM then completes an I/O or MMIO exit that
//! was already handled here (an `IN` whose value it has not stored in the
//! guest's register yet) and returns at once, so the vCPU's saved state
//! is consistent (the KVM API's advice before saving a vCPU). A joined
//! thread hands its vCPU fd back ([`VcpuThread::join`]), and a new thread
//! can run it again (a paused VM resuming): it clears `immediate_exit`
//! first.
//!
//! Guest-triggered terminations (KVM system events, entry failures, internal
//! errors, triple faults) are reported through the VM's
//! [`ExitSignal`]; the event loop then kicks
//! every vCPU.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use kvm_bindings::kvm_run;
use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::bus::Bus;
use crate::exit::{ExitReason, ExitSignal};
use crate::seccomp::Filter;

/// Errors of vCPU thread management.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// Installing the kick signal handler failed.
    #[error("cannot install the vCPU kick signal handler (SIGRTMIN+{offset}): {source}")]
    Signal {
        /// Offset from SIGRTMIN.
        offset: i32,
        /// Cause.
        source: vmm_sys_util::errno::Error,
    },
    /// Spawning the thread failed.
    #[error("cannot spawn the thread for vCPU {id}: {source}")]
    Spawn {
        /// vCPU index.
        id: u8,
        /// Cause.
        source: std::io::Error,
    },
    /// The vCPU thread panicked (a VMM bug).
    #[error("vCPU {0} thread panicked; this is a bug in the VMM")]
    Panicked(u8),
}

/// Offset from SIGRTMIN of the real-time signal used to kick vCPU threads.
pub const KICK_SIGNAL_OFFSET: i32 = 0;

/// The kick signal number.
pub fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN() + KICK_SIGNAL_OFFSET
}

extern "C" fn noop_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the (no-op) kick handler once per process.
pub fn install_kick_handler() -> Result<(), VcpuError> {
    static RESULT: OnceLock<Result<(), i32>> = OnceLock::new();
    let r = RESULT.get_or_init(|| {
        vmm_sys_util::signal::register_signal_handler(kick_signal(), noop_handler)
            .map_err(|e| e.errno())
    });
    r.map_err(|errno| VcpuError::Signal {
        offset: KICK_SIGNAL_OFFSET,
        source: vmm_sys_util::errno::Error::new(errno),
    })
}

/// Raw pointer to a vCPU's `kvm_run` page, used only to set
/// `immediate_exit` from the stopping thread while the owning `VcpuFd` is
/// alive (it is returned through the join handle and dropped only after).
struct RunPtr(*mut kvm_run);
// SAFETY: the pointee is a shared mmap of the kernel's kvm_run page; the one
// cross-thread access is a volatile byte store the kernel reads on entry.
unsafe impl Send for RunPtr {}
// SAFETY: see above.
unsafe impl Sync for RunPtr {}

/// Shared per-VM state the vCPU loops use.
#[derive(Clone)]
pub struct VcpuShared {
    /// Port-I/O bus.
    pub pio: Arc<Bus>,
    /// MMIO bus.
    pub mmio: Arc<Bus>,
    /// Where guest-initiated terminations are reported.
    pub exit: Arc<ExitSignal>,
    /// Set when the VM is stopping.
    pub stop: Arc<AtomicBool>,
    /// When vCPU 0 first entered KVM_RUN.
    pub first_run: Arc<OnceLock<Instant>>,
    /// The filter each vCPU thread installs before its first KVM_RUN
    /// (`None`: seccomp off).
    pub seccomp: Option<Filter>,
}

/// A running vCPU thread.
pub struct VcpuThread {
    id: u8,
    run: RunPtr,
    handle: JoinHandle<VcpuFd>,
}

impl VcpuThread {
    /// Starts the run loop for `vcpu` (index `id`) on a new thread.
    pub fn spawn(id: u8, mut vcpu: VcpuFd, shared: VcpuShared) -> Result<Self, VcpuError> {
        let run = RunPtr(vcpu.get_kvm_run() as *mut kvm_run);
        let builder = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .stack_size(256 * 1024);
        // The caller (the event loop) may be filtered: its filter must not
        // be inherited, the thread installs the vCPU one itself.
        let handle = crate::seccomp::spawn_unfiltered(builder, move || {
            // A previous run's kick may have left it set.
            vcpu.set_kvm_immediate_exit(0);
            // Before the guest runs: every exit it causes is handled
            // under the filter.
            if let Some(filter) = &shared.seccomp {
                if let Err(e) = filter.install() {
                    shared
                        .exit
                        .request(ExitReason::GuestError(format!("vCPU {id}: {e}")));
                    return vcpu;
                }
            }
            run_loop(id, &mut vcpu, &shared);
            vcpu
        })
        .map_err(|source| VcpuError::Spawn { id, source })?;
        Ok(Self { id, run, handle })
    }

    /// Makes the thread leave KVM_RUN and its loop (the stop flag must be
    /// set before calling this).
    pub fn kick(&self) {
        // SAFETY: the VcpuFd owning this mapping is alive until `join`
        // returns it; a volatile byte store is what KVM expects here.
        unsafe { std::ptr::addr_of_mut!((*self.run.0).immediate_exit).write_volatile(1) };
        if self.handle.is_finished() {
            return;
        }
        use std::os::unix::thread::JoinHandleExt;
        // SAFETY: the pthread is alive (not joined yet); the signal has a
        // handler installed, so it cannot terminate the process.
        let rc = unsafe { libc::pthread_kill(self.handle.as_pthread_t(), kick_signal()) };
        if rc != 0 && rc != libc::ESRCH {
            tracing::warn!(vcpu = self.id, rc, "pthread_kill failed");
        }
    }

    /// Whether the thread's loop has ended.
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the thread and hands its vCPU fd back.
    pub fn join(self) -> Result<VcpuFd, VcpuError> {
        self.handle.join().map_err(|_| VcpuError::Panicked(self.id))
    }
}

enum Next {
    Continue,
    Stop(ExitReason),
    InternalError,
}

/// KVM_SYSTEM_EVENT_SHUTDOWN.
const SYSTEM_EVENT_SHUTDOWN: u32 = 1;
/// KVM_SYSTEM_EVENT_RESET.
const SYSTEM_EVENT_RESET: u32 = 2;
/// KVM_SYSTEM_EVENT_CRASH.
const SYSTEM_EVENT_CRASH: u32 = 3;

/// Lets KVM finish an exit already handled here without running guest
/// code (see the module doc).
fn complete_pending_exit(id: u8, vcpu: &mut VcpuFd) {
    vcpu.set_kvm_immediate_exit(1);
    match vcpu.run() {
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
        Err(e) => tracing::debug!(vcpu = id, "completing the last exit: {e}"),
        Ok(exit) => tracing::debug!(
            vcpu = id,
            "unexpected exit completing the last one: {exit:?}"
        ),
    }
}

fn run_loop(id: u8, vcpu: &mut VcpuFd, sh: &VcpuShared) {
    loop {
        if sh.stop.load(Ordering::Acquire) {
            complete_pending_exit(id, vcpu);
            break;
        }
        if id == 0 {
            sh.first_run.get_or_init(Instant::now);
        }
        let next = match vcpu.run() {
            Ok(exit) => handle_exit(id, exit, sh),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Next::Continue,
            Err(e) => Next::Stop(ExitReason::GuestError(format!(
                "vCPU {id}: KVM_RUN failed: {e}"
            ))),
        };
        match next {
            Next::Continue => {}
            Next::Stop(reason) => {
                sh.exit.request(reason);
                break;
            }
            Next::InternalError => {
                let run = vcpu.get_kvm_run();
                // SAFETY: exit_reason was KVM_EXIT_INTERNAL_ERROR, so the
                // `internal` union member is the valid one.
                let (sub, nd, data) = unsafe {
                    let i = run.__bindgen_anon_1.internal;
                    (i.suberror, i.ndata, i.data)
                };
                let n = (nd as usize).min(data.len());
                let msg = format!(
                    "vCPU {id}: KVM internal error, suberror {sub} ({}), data {:x?}",
                    match sub {
                        1 => "emulation failure",
                        2 => "simultaneous exceptions",
                        3 => "delivery event",
                        4 => "unexpected exit reason",
                        _ => "unknown",
                    },
                    &data[..n]
                );
                sh.exit.request(ExitReason::GuestError(msg));
                break;
            }
        }
    }
}

fn handle_exit(id: u8, exit: VcpuExit<'_>, sh: &VcpuShared) -> Next {
    match exit {
        VcpuExit::IoIn(port, data) => {
            if let Err(e) = sh.pio.read(u64::from(port), data) {
                tracing::trace!(vcpu = id, "pio read: {e}");
            }
            Next::Continue
        }
        VcpuExit::IoOut(port, data) => {
            if let Err(e) = sh.pio.write(u64::from(port), data) {
                tracing::trace!(vcpu = id, "pio write: {e}");
            }
            Next::Continue
        }
        VcpuExit::MmioRead(addr, data) => {
            if let Err(e) = sh.mmio.read(addr, data) {
                tracing::debug!(vcpu = id, "mmio read: {e}");
            }
            Next::Continue
        }
        VcpuExit::MmioWrite(addr, data) => {
            if let Err(e) = sh.mmio.write(addr, data) {
                tracing::debug!(vcpu = id, "mmio write: {e}");
            }
            Next::Continue
        }
        VcpuExit::SystemEvent(kind, _) => match kind {
            SYSTEM_EVENT_SHUTDOWN => Next::Stop(ExitReason::Shutdown),
            SYSTEM_EVENT_RESET => Next::Stop(ExitReason::Reset),
            SYSTEM_EVENT_CRASH => Next::Stop(ExitReason::GuestError(format!("vCPU {id}: guest crashed (KVM_SYSTEM_EVENT_CRASH)"))),
            other => {
                tracing::warn!(vcpu = id, kind = other, "ignoring KVM system event");
                Next::Continue
            }
        },
        VcpuExit::Shutdown => Next::Stop(ExitReason::GuestError(format!(
            "vCPU {id}: triple fault (KVM_EXIT_SHUTDOWN); the guest crashed before installing its exception handlers or reset by triple fault"
        ))),
        VcpuExit::FailEntry(reason, cpu) => Next::Stop(ExitReason::GuestError(format!(
            "vCPU {id}: VM entry failed, hardware reason {reason:#x} on host CPU {cpu}"
        ))),
        VcpuExit::InternalError => Next::InternalError,
        VcpuExit::Hlt => Next::Stop(ExitReason::GuestError(format!(
            "vCPU {id}: unexpected HLT exit (the in-kernel LAPIC should handle HLT)"
        ))),
        VcpuExit::Intr | VcpuExit::IrqWindowOpen | VcpuExit::IoapicEoi(_) | VcpuExit::Debug(_) => Next::Continue,
        other => Next::Stop(ExitReason::GuestError(format!("vCPU {id}: unhandled exit {other:?}"))),
    }
}
