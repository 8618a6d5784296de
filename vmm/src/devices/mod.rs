//! Legacy platform devices on the port-I/O bus: the COM1 8250 UART
//! (vm-superio), the i8042 controller (reset only), the boot-timing port,
//! and the ACPI sleep control/status registers (power off).
//!
//! All of them implement [`crate::bus::MmioDevice`] (the bus trait is shared
//! between MMIO and port I/O) and treat every access as guest-controlled:
//! unexpected widths or offsets are ignored, reads return zeroes.

pub mod acpi_pm;
pub mod boot_timer;
pub mod i8042;
pub mod serial;

use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

use crate::machine::ExitReason;

/// Errors creating devices.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// eventfd creation failed.
    #[error("cannot create an eventfd for {what}: {source}")]
    EventFd {
        /// Which device.
        what: &'static str,
        /// Cause.
        source: std::io::Error,
    },
}

/// A one-shot "the VM should stop" signal: the first reason wins and the
/// eventfd wakes the VMM event loop.
#[derive(Debug)]
pub struct ExitSignal {
    reason: Mutex<Option<ExitReason>>,
    evt: EventFd,
}

impl ExitSignal {
    /// A new, unsignalled exit signal.
    pub fn new() -> Result<Arc<Self>, DeviceError> {
        let evt = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(|source| {
            DeviceError::EventFd {
                what: "the VM exit signal",
                source,
            }
        })?;
        Ok(Arc::new(Self {
            reason: Mutex::new(None),
            evt,
        }))
    }

    /// Records `reason` unless one was recorded already, and wakes the loop.
    pub fn request(&self, reason: ExitReason) {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            tracing::debug!(?reason, "VM exit requested");
            *r = Some(reason);
        }
        drop(r);
        if let Err(e) = self.evt.write(1) {
            tracing::error!("cannot signal VM exit: {e}");
        }
    }

    /// The recorded reason, if any.
    pub fn reason(&self) -> Option<ExitReason> {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The eventfd the event loop waits on.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}
