//! Legacy platform devices on the port-I/O bus: the COM1 8250 UART
//! (vm-superio), the i8042 controller (reset only), the boot-timing port,
//! and the ACPI sleep control/status registers (power off).
//!
//! All of them implement [`crate::bus::BusDevice`] (the bus trait is shared
//! between MMIO and port I/O) and treat every access as guest-controlled:
//! unexpected widths or offsets are ignored, reads return zeroes.

pub mod acpi_pm;
pub mod boot_timer;
pub mod i8042;
pub mod serial;

/// Errors creating devices.
#[derive(Debug, thiserror::Error)]
pub enum PlatformDeviceError {
    /// eventfd creation failed.
    #[error("cannot create an eventfd for {what}: {source}")]
    EventFd {
        /// Which device.
        what: &'static str,
        /// Cause.
        source: std::io::Error,
    },
    /// A saved UART state is not one a 16550A can be in.
    #[error("the saved COM1 state is invalid: {0}")]
    SerialState(String),
}
