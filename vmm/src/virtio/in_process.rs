//! What the in-process device faces (vsock, fs, blk, rng) share: a fixed
//! description ([`DeviceCommon`]: type, queue sizes, offered features, a
//! read-only config space) and the bookkeeping of feature negotiation.
//!
//! A face holds a [`DeviceCommon`] and implements [`InProcessDevice`]
//! (starting and stopping its worker); it then is a [`VirtioDevice`]:
//! * the driver's feature acknowledgement is recorded as given and always
//!   accepted (the transport has already refused bits that were not offered
//!   and a driver without `VERSION_1`);
//! * config-space reads are served from the byte image when the whole
//!   access lies inside it and leave the transport's zeroed buffer untouched
//!   otherwise ([`read_config_bytes`]): guest offsets and widths are
//!   hostile, nothing here can panic on them;
//! * config-space writes are ignored (logged at debug level).
//!
//! Snapshots: a face that supports them overrides
//! [`InProcessDevice::pause_worker`] (and, when it keeps state beyond its
//! queues, `save`, `load` and `resume_worker`); the fixed config space is
//! what [`VirtioDevice::config_snapshot`] reports.
//!
//! Limits: the config space cannot change after construction (no
//! config-change interrupts) and is never writable; a device that needs
//! either implements [`VirtioDevice`] itself (as the test device does).

use std::sync::Arc;

use tracing::debug;
use virtio_queue::Queue;

use super::{
    read_config_bytes, ActivateError, ActiveQueue, DeviceStateError, GuestMemoryMmap, VirtioDevice,
    VirtioInterrupt,
};

/// The fixed description of an in-process device and the features its
/// driver accepted.
#[derive(Debug, Clone)]
pub struct DeviceCommon {
    /// Prefix of log lines (`"blk"`, `"virtio-fs"`...).
    name: &'static str,
    device_type: u32,
    queue_max_sizes: Vec<u16>,
    features: u64,
    acked: u64,
    /// Read-only config space (empty for a device without one).
    config: Vec<u8>,
}

impl DeviceCommon {
    /// A device that logs as `name`, of virtio type `device_type`, with one
    /// queue per entry of `queue_max_sizes`, offering `features`, whose
    /// config space is `config` (empty: none).
    pub fn new(
        name: &'static str,
        device_type: u32,
        queue_max_sizes: impl Into<Vec<u16>>,
        features: u64,
        config: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            name,
            device_type,
            queue_max_sizes: queue_max_sizes.into(),
            features,
            acked: 0,
            config: config.into(),
        }
    }

    /// Maximum size of each queue, by index.
    pub fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max_sizes
    }

    /// Features the driver accepted at the last FEATURES_OK (0 before).
    pub fn acked_features(&self) -> u64 {
        self.acked
    }

    /// The config space bytes.
    pub fn config(&self) -> &[u8] {
        &self.config
    }
}

/// An in-process device face: its [`DeviceCommon`] plus how it starts and
/// stops its worker. Every implementor is a [`VirtioDevice`].
pub trait InProcessDevice: Send {
    /// The device's description and negotiated features.
    fn common(&self) -> &DeviceCommon;

    /// The same, to record the driver's feature acknowledgement.
    fn common_mut(&mut self) -> &mut DeviceCommon;

    /// [`VirtioDevice::activate`]: start serving `queues`.
    fn start(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError>;

    /// [`VirtioDevice::reset`]: stop the worker and return to the
    /// pre-activation state; `false` if that is impossible.
    fn stop(&mut self) -> bool;

    /// [`VirtioDevice::pause`]: stop the worker, keep the model, hand the
    /// queues back. The default refuses (no snapshot support).
    fn pause_worker(&mut self) -> Result<Vec<ActiveQueue>, DeviceStateError> {
        Err(DeviceStateError::Unsupported {
            device_type: self.common().device_type,
        })
    }

    /// [`VirtioDevice::resume`]: serve again. The default starts afresh.
    fn resume_worker(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        self.start(mem, interrupt, queues)
    }

    /// [`VirtioDevice::save_state`]. The default saves nothing.
    fn save(
        &mut self,
        mem: &GuestMemoryMmap,
        queues: &mut [Queue],
    ) -> Result<Vec<u8>, DeviceStateError> {
        let _ = (mem, queues);
        Ok(Vec::new())
    }

    /// [`VirtioDevice::restore_state`]. The default accepts only "nothing
    /// saved".
    fn load(&mut self, state: &[u8]) -> Result<(), DeviceStateError> {
        if state.is_empty() {
            Ok(())
        } else {
            Err(DeviceStateError::Mismatch {
                device: self.common().name,
                reason: format!("{} bytes of device state saved, none expected", state.len()),
            })
        }
    }
}

impl<T: InProcessDevice> VirtioDevice for T {
    fn device_type(&self) -> u32 {
        self.common().device_type
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.common().queue_max_sizes
    }

    fn avail_features(&self) -> u64 {
        self.common().features
    }

    fn ack_features(&mut self, features: u64) -> bool {
        self.common_mut().acked = features;
        true
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let common = self.common();
        if common.config.is_empty() {
            debug!(
                offset,
                len = data.len(),
                "{}: no config space; read ignored",
                common.name
            );
        } else {
            read_config_bytes(&common.config, offset, data);
        }
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let common = self.common();
        let what = if common.config.is_empty() {
            "no config space"
        } else {
            "config space is read-only"
        };
        debug!(
            offset,
            len = data.len(),
            "{}: {what}; write ignored",
            common.name
        );
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        self.start(mem, interrupt, queues)
    }

    fn reset(&mut self) -> bool {
        self.stop()
    }

    fn pause(&mut self) -> Result<Vec<ActiveQueue>, DeviceStateError> {
        self.pause_worker()
    }

    fn resume(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        self.resume_worker(mem, interrupt, queues)
    }

    fn save_state(
        &mut self,
        mem: &GuestMemoryMmap,
        queues: &mut [Queue],
    ) -> Result<Vec<u8>, DeviceStateError> {
        self.save(mem, queues)
    }

    fn restore_state(&mut self, state: &[u8]) -> Result<(), DeviceStateError> {
        self.load(state)
    }

    /// The fixed config space (the transport compares it at restore).
    fn config_snapshot(&self) -> Vec<u8> {
        self.common().config.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A face that records what reached it.
    struct Face {
        common: DeviceCommon,
        stops: u32,
    }

    impl InProcessDevice for Face {
        fn common(&self) -> &DeviceCommon {
            &self.common
        }
        fn common_mut(&mut self) -> &mut DeviceCommon {
            &mut self.common
        }
        fn start(
            &mut self,
            _mem: GuestMemoryMmap,
            _interrupt: Arc<dyn VirtioInterrupt>,
            _queues: Vec<ActiveQueue>,
        ) -> Result<(), ActivateError> {
            Err(ActivateError::Device("start reached".into()))
        }
        fn stop(&mut self) -> bool {
            self.stops += 1;
            self.stops == 1
        }
    }

    fn face(config: &[u8]) -> Face {
        Face {
            common: DeviceCommon::new("face", 42, [8, 16], 0b1011, config),
            stops: 0,
        }
    }

    #[test]
    fn describes_the_device_and_records_acked_features() {
        let mut f = face(&[]);
        assert_eq!(f.device_type(), 42);
        assert_eq!(VirtioDevice::queue_max_sizes(&f), &[8, 16]);
        assert_eq!(f.avail_features(), 0b1011);
        assert_eq!(f.common().acked_features(), 0);
        assert!(f.ack_features(0b0011));
        assert_eq!(f.common().acked_features(), 0b0011);
        assert!(f.reset());
        assert!(!f.reset());
        let mem = GuestMemoryMmap::new();
        let irq: Arc<dyn VirtioInterrupt> = Arc::new(NoIrq);
        assert!(matches!(
            f.activate(mem, irq, Vec::new()),
            Err(ActivateError::Device(m)) if m == "start reached"
        ));
    }

    #[test]
    fn config_reads_are_bounded_and_writes_ignored() {
        let mut f = face(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let mut d = [0u8; 4];
        f.read_config(4, &mut d);
        assert_eq!(d, [5, 6, 7, 8]);
        for (offset, len) in [(5, 4), (8, 1), (u64::MAX, 1), (u64::MAX - 1, 4)] {
            let mut d = vec![0xaau8; len];
            f.read_config(offset, &mut d);
            assert!(d.iter().all(|&b| b == 0xaa), "{offset}+{len}");
        }
        f.write_config(0, &[9, 9]);
        f.write_config(u64::MAX, &[9]);
        assert_eq!(f.common().config(), &[1, 2, 3, 4, 5, 6, 7, 8]);

        let mut none = face(&[]);
        let mut d = [0xaau8; 2];
        none.read_config(0, &mut d);
        assert_eq!(d, [0xaa; 2]);
        none.write_config(0, &[1]);
        assert!(none.common().config().is_empty());
    }

    struct NoIrq;

    impl VirtioInterrupt for NoIrq {
        fn signal_used_queue(&self, _queue: u16) -> std::io::Result<()> {
            Ok(())
        }
        fn signal_config_change(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn signal_needs_reset(&self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
