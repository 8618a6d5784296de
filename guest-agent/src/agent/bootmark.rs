//! Boot milestones written to cowork-helper's in-process VMM.
//!
//! The VMM (`vmm` crate, `devices::boot_timer`) listens on I/O port
//! [`BOOT_TIMER_PORT`] and records every 1-, 2- or 4-byte write with the
//! host time since the VM was built, so its boot timeline shows when the
//! guest reached each milestone. The agent writes one 4-byte value per
//! milestone, in the format of [`crate::milestone`] (which the host decodes
//! with the same module).
//!
//! The port only exists in our VMM, which is recognised by the OEM ID of its
//! ACPI tables ([`VMM_OEM_ID`]); under QEMU or anything else the marks are
//! skipped silently (a stray write could reach some other device there).
//!
//! Limits: x86_64 only (elsewhere [`BootMarks::detect`] finds nothing);
//! needs `CAP_SYS_RAWIO` for `ioperm(2)`, which PID 1 has.

use std::io::Read;
use std::path::Path;

use crate::milestone::{encode, Milestone};

/// The VMM's boot-timing port (`vmm::layout::BOOT_TIMER_PORT`).
pub const BOOT_TIMER_PORT: u16 = 0x402;

/// OEM ID in the ACPI tables of cowork-helper's VMM (`vmm::acpi::OEM_ID`).
pub const VMM_OEM_ID: [u8; 6] = *b"COWORK";

/// An ACPI table whose header tells which VMM built the machine.
const ACPI_TABLE: &str = "/sys/firmware/acpi/tables/DSDT";

/// Offset and length of the OEM ID in an ACPI table header.
const OEM_ID_RANGE: std::ops::Range<usize> = 10..16;

/// Bytes of one mark: a 4-byte `out` touches ports `BOOT_TIMER_PORT..+4`,
/// and the I/O permission bitmap must allow every one of them.
const MARK_BYTES: u16 = 4;

/// Errors of enabling the port (logged; marks are best effort).
#[derive(Debug, thiserror::Error)]
pub enum BootMarkError {
    #[error("ioperm for port {port:#x} failed: {source}")]
    Ioperm { port: u16, source: std::io::Error },
}

/// Whether an ACPI table header was written by our VMM.
pub fn is_our_vmm(table_header: &[u8]) -> bool {
    table_header.get(OEM_ID_RANGE) == Some(&VMM_OEM_ID[..])
}

/// The boot-timing port, when this machine has one.
#[derive(Clone, Copy, Debug, Default)]
pub struct BootMarks {
    enabled: bool,
}

impl BootMarks {
    /// No port: every mark is a no-op.
    pub fn none() -> Self {
        Self { enabled: false }
    }

    /// Detects our VMM and enables port access. Must run after `/sys` is mounted.
    pub fn detect() -> Self {
        if !cfg!(target_arch = "x86_64") || !acpi_says_our_vmm(Path::new(ACPI_TABLE)) {
            return Self::none();
        }
        match enable_port() {
            Ok(()) => {
                tracing::debug!(port = BOOT_TIMER_PORT, "boot-timing port enabled");
                Self { enabled: true }
            }
            Err(e) => {
                tracing::warn!(error = %e, "boot milestones not reported");
                Self::none()
            }
        }
    }

    /// Writes `milestone` stamped with the current boot time.
    pub fn mark(&self, milestone: Milestone, boot_us: u64) {
        if self.enabled {
            write_port(encode(milestone, boot_us));
        }
    }
}

fn acpi_says_our_vmm(table: &Path) -> bool {
    let mut header = [0u8; 16];
    std::fs::File::open(table)
        .and_then(|mut f| f.read_exact(&mut header))
        .is_ok_and(|()| is_our_vmm(&header))
}

#[cfg(target_arch = "x86_64")]
fn enable_port() -> Result<(), BootMarkError> {
    // SAFETY: ioperm changes this thread's I/O permission bitmap only.
    let r = unsafe { libc::ioperm(BOOT_TIMER_PORT.into(), MARK_BYTES.into(), 1) };
    if r == 0 {
        Ok(())
    } else {
        Err(BootMarkError::Ioperm {
            port: BOOT_TIMER_PORT,
            source: std::io::Error::last_os_error(),
        })
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn enable_port() -> Result<(), BootMarkError> {
    Err(BootMarkError::Ioperm {
        port: BOOT_TIMER_PORT,
        source: std::io::Error::from(std::io::ErrorKind::Unsupported),
    })
}

#[cfg(target_arch = "x86_64")]
fn write_port(value: u32) {
    // SAFETY: the port was enabled by `enable_port` on this thread (ioperm is
    // per thread and inherited by threads created later; marks are written
    // from the main thread) and belongs to the VMM's boot timer, which only
    // records the value.
    unsafe {
        std::arch::asm!("out dx, eax", in("dx") BOOT_TIMER_PORT, in("eax") value,
            options(nomem, nostack, preserves_flags));
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn write_port(_value: u32) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_our_acpi_tables_only() {
        let mut ours = *b"DSDT\x24\0\0\0\x02\0COWORKCOWORKVM";
        assert!(is_our_vmm(&ours));
        ours[10..16].copy_from_slice(b"BOCHS ");
        assert!(!is_our_vmm(&ours));
        assert!(!is_our_vmm(b"DSDT"));
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("DSDT");
        std::fs::write(&t, b"DSDT\x24\0\0\0\x02\0COWORKCOWORKVM\x01\0\0\0").unwrap();
        assert!(acpi_says_our_vmm(&t));
        std::fs::write(&t, b"DSDT").unwrap();
        assert!(!acpi_says_our_vmm(&t));
        assert!(!acpi_says_our_vmm(&dir.path().join("missing")));
        // Not our VMM (or not root): a no-op that must not fault.
        BootMarks::none().mark(Milestone::AgentStart, 1);
    }
}
