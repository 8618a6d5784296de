//! What a virtio device looks like in a snapshot: the virtio-mmio
//! transport's registers ([`TransportState`]), each virtqueue's
//! configuration and position ([`QueueSnapshot`]), and the device model's
//! own bytes, plus the helpers device models use to encode and decode
//! those bytes ([`encode`], [`decode`]).
//!
//! The transport saves and restores its part itself
//! ([`super::MmioTransport::save_state`],
//! [`super::MmioTransport::restore`]); a device model takes part through
//! the snapshot half of [`super::VirtioDevice`]: `pause` (stop serving and
//! hand its queues back, positions included), `save_state`, `restore_state`
//! and `resume`. A device with nothing beyond its queues keeps the trait's
//! defaults for the last three and saves no bytes.
//!
//! Everything here is read back from a file: [`decode`] bounds what it
//! accepts ([`MAX_DEVICE_STATE_BYTES`]) and every value is checked again by
//! whoever uses it (queue sizes and ring addresses against guest memory,
//! status bits against what a driver may write).
//!
//! Limits: the encoding is bincode's with fixed-width integers; a device
//! that changes the layout of its state must bump the snapshot format
//! version ([`crate::snapshot::FORMAT_VERSION`]).

use bincode::Options;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use virtio_queue::QueueState;

/// Largest device state [`decode`] accepts, in bytes: far above what any
/// of our devices saves (tens of bytes), small enough that a corrupt
/// length cannot make the VMM allocate much.
pub const MAX_DEVICE_STATE_BYTES: u64 = 1 << 20;

/// Why a device could not be paused, saved or restored.
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    /// The device model has no snapshot support.
    #[error("virtio device type {device_type} cannot be paused or saved in a snapshot (its model has no snapshot support)")]
    Unsupported {
        /// The device's virtio type.
        device_type: u32,
    },
    /// The device's worker could not be stopped (it keeps running).
    #[error("cannot stop the {device} device's worker: {reason}")]
    Stop {
        /// Which device.
        device: &'static str,
        /// Why.
        reason: String,
    },
    /// The saved bytes do not decode as this device's state.
    #[error("the saved state of the {device} device is invalid: {reason}")]
    Invalid {
        /// Which device.
        device: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The saved state does not fit the device it is restored into.
    #[error("the saved state of the {device} device does not fit this device: {reason}")]
    Mismatch {
        /// Which device.
        device: &'static str,
        /// What differs.
        reason: String,
    },
}

/// One virtqueue as saved: the driver's configuration (size, ring
/// addresses, ready) and the device's position in the rings (rust-vmm
/// virtio-queue's [`QueueState`], mirrored here to be serialisable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    /// Largest size the device offers.
    pub max_size: u16,
    /// Size the driver chose.
    pub size: u16,
    /// The driver finished setting the queue up.
    pub ready: bool,
    /// Guest-physical address of the descriptor table.
    pub desc_table: u64,
    /// Guest-physical address of the available ring.
    pub avail_ring: u64,
    /// Guest-physical address of the used ring.
    pub used_ring: u64,
    /// Next available ring entry the device will take.
    pub next_avail: u16,
    /// Next used ring entry the device will fill.
    pub next_used: u16,
    /// `VIRTIO_RING_F_EVENT_IDX` is in effect on the queue.
    pub event_idx: bool,
}

impl From<QueueState> for QueueSnapshot {
    fn from(s: QueueState) -> Self {
        Self {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx: s.event_idx_enabled,
        }
    }
}

impl From<QueueSnapshot> for QueueState {
    fn from(s: QueueSnapshot) -> Self {
        QueueState {
            max_size: s.max_size,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        }
    }
}

/// A virtio-mmio transport and its device as saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportState {
    /// The device's virtio type.
    pub device_type: u32,
    /// Features the transport offered.
    pub offered: u64,
    /// Features the driver wrote (pages 0 and 1).
    pub driver_features: u64,
    /// The driver wrote a non-zero value to a feature page above 1.
    pub driver_features_beyond: bool,
    /// DeviceFeaturesSel.
    pub device_features_sel: u32,
    /// DriverFeaturesSel.
    pub driver_features_sel: u32,
    /// QueueSel.
    pub queue_sel: u32,
    /// Status as the driver wrote it (DEVICE_NEEDS_RESET is `needs_reset`).
    pub status: u32,
    /// The device was active (DRIVER_OK accepted, activation succeeded).
    pub activated: bool,
    /// The device had failed to reset and stays in DEVICE_NEEDS_RESET.
    pub broken: bool,
    /// DEVICE_NEEDS_RESET was raised by the device or a failed activation.
    pub needs_reset: bool,
    /// InterruptStatus.
    pub interrupt_status: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// Every queue the device declares, by index.
    pub queues: Vec<QueueSnapshot>,
    /// The device's config space as the driver last could read it
    /// ([`super::VirtioDevice::config_snapshot`]; empty: not compared).
    pub config: Vec<u8>,
    /// The device model's own state ([`super::VirtioDevice::save_state`]).
    pub device: Vec<u8>,
}

fn options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .reject_trailing_bytes()
        .with_limit(MAX_DEVICE_STATE_BYTES)
}

/// Encodes a device model's state for [`super::VirtioDevice::save_state`].
pub fn encode<T: Serialize>(device: &'static str, state: &T) -> Result<Vec<u8>, DeviceStateError> {
    options()
        .serialize(state)
        .map_err(|e| DeviceStateError::Invalid {
            device,
            reason: e.to_string(),
        })
}

/// Decodes what [`encode`] made, refusing anything longer than
/// [`MAX_DEVICE_STATE_BYTES`], trailing bytes, and values that do not fit
/// `T`.
pub fn decode<T: DeserializeOwned>(
    device: &'static str,
    bytes: &[u8],
) -> Result<T, DeviceStateError> {
    options()
        .deserialize(bytes)
        .map_err(|e| DeviceStateError::Invalid {
            device,
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Sample {
        a: u32,
        b: Vec<u8>,
    }

    #[test]
    fn device_state_round_trips_and_bad_bytes_are_refused() {
        let s = Sample {
            a: 7,
            b: vec![1, 2, 3],
        };
        let bytes = encode("test", &s).unwrap();
        assert_eq!(decode::<Sample>("test", &bytes).unwrap(), s);
        // Truncated, trailing bytes, a huge length: all refused.
        assert!(decode::<Sample>("test", &bytes[..bytes.len() - 1]).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode::<Sample>("test", &longer).is_err());
        let mut huge = 7u32.to_le_bytes().to_vec();
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        let e = decode::<Sample>("test", &huge).unwrap_err();
        assert!(e.to_string().contains("test device"), "{e}");
    }

    #[test]
    fn queue_snapshot_mirrors_queue_state() {
        let q = QueueSnapshot {
            max_size: 256,
            size: 128,
            ready: true,
            desc_table: 0x1000,
            avail_ring: 0x2000,
            used_ring: 0x3000,
            next_avail: 5,
            next_used: 4,
            event_idx: true,
        };
        assert_eq!(QueueSnapshot::from(QueueState::from(q)), q);
    }
}
