//! The agent's log line format: short, because in a VM every byte of it
//! crosses an emulated 16550 UART.
//!
//! As the VM's init the agent writes its log to the serial console, and
//! each byte there is a port write the VMM (or QEMU) handles on its own: a
//! few microseconds on hardware KVM, ~0.2 ms in the nested-KVM harness.
//! `tracing`'s default line (`2026-12-03T11:41:52.365340Z  INFO
//! guest_agent::agent::init: mounted target_dir=/proc`, 87 bytes) spends
//! half of that on a wall-clock time the host stamps again on arrival and
//! on the module path. [`BootClock`] writes the time since boot as the
//! kernel does (`[   1.365340]`), the target is left out (filters by
//! target with `COWORK_LOG` still work), so the same line is 44 bytes.
//!
//! Limits: the boot time is `CLOCK_BOOTTIME`; outside a VM (the sandbox
//! backend) that is the host's uptime.

use std::fmt;

use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

use crate::sys;

/// Microseconds per second.
const US_PER_S: u64 = 1_000_000;

/// Time since boot, in the kernel console's `[seconds.micros]` form.
#[derive(Clone, Copy, Debug, Default)]
pub struct BootClock;

impl FormatTime for BootClock {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        write!(w, "{}", stamp(sys::boottime_us()))
    }
}

/// `us` microseconds since boot as `[   s.uuuuuu]` (seconds right-aligned
/// in four columns, as the kernel's console does up to 9999 s).
pub fn stamp(us: u64) -> String {
    format!("[{:4}.{:06}]", us / US_PER_S, us % US_PER_S)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_read_like_the_kernel_console() {
        assert_eq!(stamp(0), "[   0.000000]");
        assert_eq!(stamp(1_365_340), "[   1.365340]");
        assert_eq!(stamp(12_345_678_901), "[12345.678901]");
    }
}
