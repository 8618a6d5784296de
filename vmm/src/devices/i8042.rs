//! i8042 keyboard controller at ports 0x60-0x64, only as far as a guest
//! needs it to reset the machine: the "pulse reset line" command (0xfe to
//! port 0x64, what Linux does for `reboot=k`) ends the run with
//! [`ExitReason::Reset`]. The model is vm-superio's `I8042Device`.

use std::sync::{Arc, Mutex};

use vm_superio::{I8042Device, Trigger};

use crate::bus::BusDevice;
use crate::exit::ExitReason;
use crate::exit::ExitSignal;
use crate::sync::MutexExt;

/// Trigger that turns the CPU-reset command into a VM exit.
pub struct ResetTrigger(Arc<ExitSignal>);

impl Trigger for ResetTrigger {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        tracing::info!("guest requested reset through the i8042");
        self.0.request(ExitReason::Reset);
        Ok(())
    }
}

/// The i8042 on the PIO bus.
pub struct I8042(Mutex<I8042Device<ResetTrigger>>);

impl I8042 {
    /// A controller whose reset ends the VM through `exit`.
    pub fn new(exit: Arc<ExitSignal>) -> Self {
        Self(Mutex::new(I8042Device::new(ResetTrigger(exit))))
    }
}

impl BusDevice for I8042 {
    fn read(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Some(first), Ok(off)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.0.locked().read(off);
        }
    }

    fn write(&self, offset: u64, data: &[u8]) {
        if let (Some(v), Ok(off)) = (data.first(), u8::try_from(offset)) {
            // The trigger is infallible.
            let _ = self.0.locked().write(off, *v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_requests_reset() {
        let exit = ExitSignal::new().unwrap();
        let dev = I8042::new(exit.clone());
        dev.write(0, &[0xfe]); // data port: ignored
        dev.write(4, &[0xd1]); // other command: ignored
        assert_eq!(exit.reason(), None);
        dev.write(4, &[0xfe]);
        assert_eq!(exit.reason(), Some(ExitReason::Reset));
        assert_eq!(exit.eventfd().read().unwrap(), 1);
        let mut b = [0xaa; 2];
        dev.read(4, &mut b);
        assert_eq!(b, [0, 0]);
    }
}
