//! The values of boot milestones: what the agent writes to the boot-timing
//! port of cowork-helper's VMM and the host decodes from the VMM's record.
//!
//! One 4-byte value per milestone ([`encode`]): the milestone code
//! ([`Milestone`]) in the top byte and the guest's own `CLOCK_BOOTTIME` in
//! milliseconds in the low 24 bits, saturating at [`MAX_STAMP_MS`] (about
//! 4.6 hours). [`decode`] splits a value back.
//!
//! A library-level module: the writing side (port detection and `out`)
//! lives in the agent; the host only needs this format. Limits: a value is
//! a plain `u32`; a code the host does not know is still returned as its
//! byte.

/// Shift of the milestone code within a value (it fills the top byte).
const CODE_SHIFT: u32 = 24;

/// Largest guest time a mark carries, in milliseconds (24 bits).
pub const MAX_STAMP_MS: u32 = 0x00FF_FFFF;

/// A boot milestone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Milestone {
    /// The agent's `main` started (PID 1 entered).
    AgentStart = 0xA1,
    /// Early init (mounts, modules, clock, loopback, userland) is done.
    InitDone = 0xA2,
    /// The host link is established.
    Connected = 0xA3,
    /// The hello went out.
    HelloSent = 0xA4,
    /// The root was switched to a userland disk (`agent::userland`); absent
    /// when the VM stays on its initramfs.
    UserlandSwitched = 0xA5,
    /// The machine is about to power off.
    PowerOff = 0xAF,
}

/// The 4-byte value written for `milestone` at guest time `boot_us`.
pub fn encode(milestone: Milestone, boot_us: u64) -> u32 {
    let ms = u32::try_from(boot_us / 1000)
        .unwrap_or(MAX_STAMP_MS)
        .min(MAX_STAMP_MS);
    ((milestone as u32) << CODE_SHIFT) | ms
}

/// A value split into its milestone code and guest milliseconds.
pub fn decode(value: u32) -> (u8, u32) {
    ((value >> CODE_SHIFT) as u8, value & MAX_STAMP_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_milestone_and_milliseconds() {
        assert_eq!(encode(Milestone::AgentStart, 0), 0xA100_0000);
        assert_eq!(encode(Milestone::Connected, 2_345_678), 0xA300_0000 | 2345);
        assert_eq!(encode(Milestone::InitDone, u64::MAX), 0xA2FF_FFFF);
        assert_eq!(encode(Milestone::UserlandSwitched, 1_000), 0xA500_0001);
        assert_eq!(
            encode(Milestone::PowerOff, (MAX_STAMP_MS as u64 + 5) * 1000),
            0xAFFF_FFFF
        );
    }

    #[test]
    fn decoding_gives_back_code_and_milliseconds() {
        let v = encode(Milestone::HelloSent, 1_234_567);
        assert_eq!(decode(v), (Milestone::HelloSent as u8, 1234));
        assert_eq!(decode(0xAFFF_FFFF), (0xAF, MAX_STAMP_MS));
        assert_eq!(decode(0x0000_0001), (0, 1));
    }
}
