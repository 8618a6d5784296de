//! Why a VM stops, and the one-shot signal that asks it to: the leaf both
//! the machine and its devices (the i8042 reset line, the ACPI power-off
//! register) and vCPUs use, so none of them imports another for it.
//!
//! A pause ([`ExitSignal::request_pause`]) is not an exit: it wakes the
//! event loop without recording a reason, and `run()` returns
//! [`ExitReason::Paused`] with the machine kept for a snapshot, a resume
//! or a drop. An exit reason recorded meanwhile wins over the pause.
//!
//! Limits: the first reason recorded wins; later requests only wake the
//! event loop again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::sync::MutexExt;
use vmm_sys_util::eventfd::EventFd;

/// The exit signal could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ExitError {
    #[error("cannot create an eventfd for the VM exit signal: {0}")]
    EventFd(std::io::Error),
}

/// Why [`crate::Vm::run`] returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest reset the machine (i8042 reset command, KVM reset event).
    Reset,
    /// The guest powered off (ACPI S5, KVM shutdown event).
    Shutdown,
    /// The guest failed: triple fault, KVM internal/emulation error, failed
    /// VM entry, crash event. The message says which and on which vCPU.
    GuestError(String),
    /// The host stopped the VM through a [`crate::StopHandle`].
    Stopped,
    /// The host paused the VM through a [`crate::PauseHandle`]: every vCPU
    /// is out of `KVM_RUN` and every device stopped, and the `Vm` is kept:
    /// [`crate::Vm::snapshot`] it, `run()` it again to resume, or drop it.
    Paused,
}

/// A one-shot "the VM should stop" signal: the first reason wins and the
/// eventfd wakes the VMM event loop.
#[derive(Debug)]
pub struct ExitSignal {
    reason: Mutex<Option<ExitReason>>,
    /// A pause was asked for and `run()` has not returned for it yet.
    pause: AtomicBool,
    evt: EventFd,
}

impl ExitSignal {
    /// A new, unsignalled exit signal.
    pub fn new() -> Result<Arc<Self>, ExitError> {
        let evt =
            EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(ExitError::EventFd)?;
        Ok(Arc::new(Self {
            reason: Mutex::new(None),
            pause: AtomicBool::new(false),
            evt,
        }))
    }

    /// Records `reason` unless one was recorded already, and wakes the loop.
    pub fn request(&self, reason: ExitReason) {
        let mut r = self.reason.locked();
        if r.is_none() {
            tracing::debug!(?reason, "VM exit requested");
            *r = Some(reason);
        }
        drop(r);
        if let Err(e) = self.evt.write(1) {
            tracing::error!("cannot signal VM exit: {e}");
        }
    }

    /// Asks the running VM to pause (see the module doc) and wakes the
    /// loop.
    pub fn request_pause(&self) {
        self.pause.store(true, Ordering::SeqCst);
        if let Err(e) = self.evt.write(1) {
            tracing::error!("cannot signal VM pause: {e}");
        }
    }

    /// Whether a pause is asked for.
    pub fn pause_requested(&self) -> bool {
        self.pause.load(Ordering::SeqCst)
    }

    /// Clears the pause request (the VM has paused).
    pub fn clear_pause(&self) {
        self.pause.store(false, Ordering::SeqCst);
    }

    /// The recorded reason, if any.
    pub fn reason(&self) -> Option<ExitReason> {
        self.reason.locked().clone()
    }

    /// The eventfd the event loop waits on.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}
