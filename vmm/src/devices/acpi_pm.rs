//! ACPI hardware-reduced sleep registers (FADT `SLEEP_CONTROL_REG` at
//! [`layout::ACPI_SLEEP_CONTROL_PORT`], `SLEEP_STATUS_REG` right after).
//! Writing `SLP_EN | SLP_TYP=5` (the `\_S5` type from our DSDT) powers the
//! machine off: the run ends with [`ExitReason::Shutdown`]. Other sleep
//! states are not supported and are ignored.

use std::sync::Arc;

use crate::bus::BusDevice;
use crate::exit::ExitReason;
use crate::exit::ExitSignal;
use crate::layout;

/// Offset of the control register in the block (status is at +1,
/// [`layout::ACPI_SLEEP_STATUS_PORT`]).
const CONTROL_OFFSET: u64 = 0;
/// Sleep control register: SLP_EN (bit 5).
const SLP_EN: u8 = 1 << 5;
/// Sleep control register: SLP_TYPx (bits 4:2).
const SLP_TYP_SHIFT: u8 = 2;
const SLP_TYP_MASK: u8 = 0x7;

/// The two-port sleep register block.
pub struct AcpiPm {
    exit: Arc<ExitSignal>,
}

impl AcpiPm {
    /// Device ending the VM through `exit` on an S5 request.
    pub fn new(exit: Arc<ExitSignal>) -> Self {
        Self { exit }
    }
}

impl BusDevice for AcpiPm {
    fn read(&self, _offset: u64, data: &mut [u8]) {
        // Status: never "woken" (WAK_STS clear); control reads as zero.
        data.fill(0);
    }

    fn write(&self, offset: u64, data: &[u8]) {
        let Some(v) = data.first() else { return };
        if offset == CONTROL_OFFSET && v & SLP_EN != 0 {
            let typ = (v >> SLP_TYP_SHIFT) & SLP_TYP_MASK;
            if typ == layout::ACPI_S5_SLEEP_TYPE {
                tracing::info!("guest powered off (ACPI S5)");
                self.exit.request(ExitReason::Shutdown);
            } else {
                tracing::warn!(
                    sleep_type = typ,
                    "guest requested an unsupported ACPI sleep state; ignored"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s5_powers_off_other_states_ignored() {
        let exit = ExitSignal::new().unwrap();
        let pm = AcpiPm::new(exit.clone());
        pm.write(0, &[(3 << 2) | SLP_EN]); // S3: ignored
        pm.write(0, &[5 << 2]); // no SLP_EN
        pm.write(1, &[(5 << 2) | SLP_EN]); // status register
        pm.write(0, &[]);
        assert_eq!(exit.reason(), None);
        pm.write(0, &[(5 << 2) | SLP_EN]);
        assert_eq!(exit.reason(), Some(ExitReason::Shutdown));
    }
}
