//! Boot-timing port ([`crate::layout::BOOT_TIMER_PORT`]): the guest writes a
//! 1-, 2- or 4-byte milestone code (e.g. the guest init writes one when it
//! starts, another when the agent is up); the VMM records it with the time
//! since the VM build started and logs it. `vm run` prints them in its
//! boot timeline. Reads return 0.
//!
//! The number of records is capped ([`MAX_RECORDS`]) so a guest writing in a
//! loop cannot grow host memory; later writes are counted and dropped.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::bus::BusDevice;
use crate::sync::MutexExt;

/// Most milestones kept.
pub const MAX_RECORDS: usize = 256;

/// One milestone written by the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootMark {
    /// Time since the VM build started.
    pub at: Duration,
    /// The value written (zero-extended).
    pub value: u32,
}

#[derive(Debug, Default)]
struct State {
    marks: Vec<BootMark>,
    dropped: u64,
}

/// The boot-timing device.
#[derive(Debug)]
pub struct BootTimer {
    origin: Instant,
    state: Mutex<State>,
}

impl BootTimer {
    /// A timer measuring from `origin`.
    pub fn new(origin: Instant) -> Self {
        Self {
            origin,
            state: Mutex::new(State::default()),
        }
    }

    /// Recorded milestones, oldest first.
    pub fn marks(&self) -> Vec<BootMark> {
        self.state.locked().marks.clone()
    }

    /// Writes dropped because the record was full.
    pub fn dropped(&self) -> u64 {
        self.state.locked().dropped
    }
}

impl BusDevice for BootTimer {
    fn read(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&self, offset: u64, data: &[u8]) {
        if offset != 0 || data.is_empty() || data.len() > 4 {
            return;
        }
        let at = self.origin.elapsed();
        let mut b = [0u8; 4];
        b[..data.len()].copy_from_slice(data);
        let value = u32::from_le_bytes(b);
        tracing::info!(value, at_us = at.as_micros() as u64, "guest boot milestone");
        let mut s = self.state.locked();
        if s.marks.len() < MAX_RECORDS {
            s.marks.push(BootMark { at, value });
        } else {
            s.dropped += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_widths_and_caps() {
        let t = BootTimer::new(Instant::now());
        t.write(0, &[7]);
        t.write(0, &[0x34, 0x12]);
        t.write(0, &[1, 2, 3, 4]);
        t.write(0, &[1, 2, 3, 4, 5, 6, 7, 8]); // 8 bytes: ignored
        t.write(1, &[9]); // wrong offset: ignored
        let m = t.marks();
        assert_eq!(
            m.iter().map(|m| m.value).collect::<Vec<_>>(),
            vec![7, 0x1234, 0x0403_0201]
        );
        assert!(m[0].at <= m[2].at);
        for i in 0..MAX_RECORDS + 10 {
            t.write(0, &[i as u8]);
        }
        assert_eq!(t.marks().len(), MAX_RECORDS);
        assert_eq!(t.dropped(), 13);
    }
}
