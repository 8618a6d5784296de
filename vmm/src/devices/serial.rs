//! COM1: vm-superio's 16550A model at 0x3f8, IRQ 4 through an irqfd, output
//! to a caller-chosen sink.
//!
//! vm-superio flushes its writer after every byte; [`LineSink`] turns that
//! into one write per line (or per 4 KiB) so a chatty guest costs one
//! syscall per line instead of two per byte. The tail is flushed when the
//! device is dropped or [`Serial::flush`] is called.
//!
//! Snapshots save the UART's registers and receive FIFO
//! ([`SerialSnapshot`]): a guest's 8250 driver that had enabled the
//! transmit interrupt must find it enabled after a restore, or its tty
//! output would stall.

use std::io::Write;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::Trigger;
use vmm_sys_util::eventfd::EventFd;

use super::PlatformDeviceError;
use crate::bus::BusDevice;
use crate::sync::MutexExt;

/// Where the guest's serial output goes.
pub type SerialSink = Box<dyn Write + Send>;

/// Interrupt trigger writing an eventfd registered as irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// Line-buffering adapter in front of the sink.
pub struct LineSink {
    inner: SerialSink,
    buf: Vec<u8>,
}

/// Flush threshold without a newline.
const LINE_MAX: usize = 4096;

impl LineSink {
    /// Wraps `inner`.
    pub fn new(inner: SerialSink) -> Self {
        Self {
            inner,
            buf: Vec::with_capacity(256),
        }
    }

    fn push_out(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            let r = self
                .inner
                .write_all(&self.buf)
                .and_then(|_| self.inner.flush());
            self.buf.clear();
            r?;
        }
        Ok(())
    }

    /// Writes out everything buffered, complete line or not.
    pub fn drain(&mut self) -> std::io::Result<()> {
        self.push_out()
    }
}

impl Write for LineSink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.last() == Some(&b'\n') || self.buf.len() >= LINE_MAX {
            self.push_out()
        } else {
            Ok(())
        }
    }
}

impl Drop for LineSink {
    fn drop(&mut self) {
        let _ = self.push_out();
    }
}

type Uart = vm_superio::Serial<IrqTrigger, NoEvents, LineSink>;

/// The UART's registers and receive FIFO as a snapshot saves them
/// (vm-superio's `SerialState`, mirrored to be serialisable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialSnapshot {
    /// Divisor latch, low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch, high byte.
    pub baud_divisor_high: u8,
    /// Interrupt Enable Register.
    pub interrupt_enable: u8,
    /// Interrupt Identification Register.
    pub interrupt_identification: u8,
    /// Line Control Register.
    pub line_control: u8,
    /// Line Status Register.
    pub line_status: u8,
    /// Modem Control Register.
    pub modem_control: u8,
    /// Modem Status Register.
    pub modem_status: u8,
    /// Scratch Register.
    pub scratch: u8,
    /// Bytes received and not read yet (at most the FIFO's 64).
    pub in_buffer: Vec<u8>,
}

impl From<SerialState> for SerialSnapshot {
    fn from(s: SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialSnapshot> for SerialState {
    fn from(s: &SerialSnapshot) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// The COM1 device on the PIO bus.
pub struct Serial(Mutex<Uart>);

impl Serial {
    /// A UART raising its interrupt through `irq` and printing to `sink`.
    pub fn new(irq: &EventFd, sink: SerialSink) -> Result<Self, PlatformDeviceError> {
        let irq = irq
            .try_clone()
            .map_err(|source| PlatformDeviceError::EventFd {
                what: "COM1",
                source,
            })?;
        Ok(Self(Mutex::new(vm_superio::Serial::new(
            IrqTrigger(irq),
            LineSink::new(sink),
        ))))
    }

    /// A UART in the saved state `saved`, raising its interrupt through
    /// `irq` (at once, when the state has one pending) and printing to
    /// `sink`.
    pub fn from_snapshot(
        irq: &EventFd,
        sink: SerialSink,
        saved: &SerialSnapshot,
    ) -> Result<Self, PlatformDeviceError> {
        let irq = irq
            .try_clone()
            .map_err(|source| PlatformDeviceError::EventFd {
                what: "COM1",
                source,
            })?;
        let uart = vm_superio::Serial::from_state(
            &SerialState::from(saved),
            IrqTrigger(irq),
            NoEvents,
            LineSink::new(sink),
        )
        .map_err(|e| PlatformDeviceError::SerialState(format!("{e:?}")))?;
        Ok(Self(Mutex::new(uart)))
    }

    /// The UART's registers and receive FIFO.
    pub fn snapshot(&self) -> SerialSnapshot {
        self.0.locked().state().into()
    }

    /// Writes out any partial line.
    pub fn flush(&self) {
        let mut u = self.0.locked();
        if let Err(e) = u.writer_mut().drain() {
            tracing::warn!("serial sink: {e}");
        }
    }
}

impl BusDevice for Serial {
    fn read(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Some(first), Ok(off)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.0.locked().read(off);
        }
    }

    fn write(&self, offset: u64, data: &[u8]) {
        if let (Some(v), Ok(off)) = (data.first(), u8::try_from(offset)) {
            if let Err(e) = self.0.locked().write(off, *v) {
                tracing::debug!("serial write: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<Vec<u8>>>>);
    impl Write for Shared {
        fn write(&mut self, d: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().push(d.to_vec());
            Ok(d.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn output_is_line_buffered_and_interrupts_fire() {
        let out = Shared::default();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let s = Serial::new(&irq, Box::new(out.clone())).unwrap();
        s.write(1, &[0x02]); // IER: THR empty interrupt
        for b in b"hi\nthere" {
            s.write(0, &[*b]);
        }
        assert_eq!(*out.0.lock().unwrap(), vec![b"hi\n".to_vec()]);
        s.flush();
        assert_eq!(out.0.lock().unwrap()[1], b"there".to_vec());
        assert!(irq.read().unwrap() >= 1);
        let mut lsr = [0u8; 1];
        s.read(5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0, "THR empty");
        // Out-of-range offset from a hostile guest: no panic.
        s.write(300, &[1]);
        s.read(300, &mut lsr);
    }
}
