//! A virtio test device: fills the driver's buffers with a known pattern.
//!
//! It exists to exercise the transport end to end (unit tests, the KVM
//! guest tests and the mmio fuzz target) and is compiled only for them
//! (`cfg(test)` or the `test-devices` feature), never into the product: on every kick of a queue its worker thread takes each
//! available descriptor chain, writes `seed + i` (mod 256) into byte `i` of
//! the chain's device-writable buffers, puts the chain in the used ring with
//! the number of bytes written, and signals the used queue.
//!
//! Config space (little-endian, 8 bytes):
//! * `0x0` `seed` (u32, read-write; only its low byte shapes the pattern),
//! * `0x4` `completed` (u32, read-only): chains used since activation.
//!
//! A chain whose buffers lie outside guest memory, or a malformed available
//! ring, makes the worker report [`VirtioInterrupt::signal_needs_reset`] and
//! stop. Snapshots: pausing stops the worker and hands the queues back; the
//! saved state is the seed and the completed counter.
//!
//! Limits: not a real virtio device type; no readable-buffer handling
//! (device-readable descriptors are skipped).

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use tracing::{debug, warn};
use virtio_queue::Queue;
use vm_memory::{Address, Bytes, GuestAddress};

use serde::{Deserialize, Serialize};

use super::state::{self, DeviceStateError};
use super::worker::{DeviceWorker, Wakeup, WorkerLoop, WorkerSetup};
use super::{drain, features, read_config_bytes, write_config_bytes};
use super::{ActivateError, ActiveQueue, GuestMemoryMmap, VirtioDevice, VirtioInterrupt};

/// Device ID of the test device. Unassigned by the virtio spec, so no guest
/// driver other than our test's binds to it.
pub const TEST_DEVICE_ID: u32 = 0xc0de;
/// A device-specific feature the test device offers (bit 0), so tests can
/// tell the device's bits from the transport's.
pub const TEST_F_PATTERN: u64 = 1 << 0;
/// Config space offset of the pattern seed.
pub const CONFIG_SEED: u64 = 0;
/// Config space offset of the completed-chains counter.
pub const CONFIG_COMPLETED: u64 = 4;
/// Size of the config space.
pub const CONFIG_SIZE: usize = 8;
/// Largest buffer chunk the worker writes at once.
const CHUNK: usize = 4096;
/// epoll token of the queue at position 0; position `i` uses `i + 1` (0 is
/// the worker's stop eventfd).
const TOKEN_FIRST_QUEUE: u64 = 1;

/// The pattern repeats every this many bytes ([`pattern_byte`] wraps a `u8`).
const PATTERN_PERIOD: usize = 256;
const _: () = assert!(CHUNK % PATTERN_PERIOD == 0, "a chunk is whole periods");

/// Byte `i` of the pattern for `seed`.
pub fn pattern_byte(seed: u32, i: usize) -> u8 {
    (seed as u8).wrapping_add(i as u8)
}

/// State shared between the device and its worker.
#[derive(Default)]
struct Counters {
    seed: AtomicU32,
    completed: AtomicU32,
}

/// What a snapshot keeps of the device beyond its queues.
#[derive(Debug, Serialize, Deserialize)]
struct SavedCounters {
    seed: u32,
    completed: u32,
}

/// The pattern-writing test device.
pub struct PatternDevice {
    /// First, so it is stopped before the rest is dropped. Hands the
    /// queues back when stopped.
    worker: DeviceWorker<Vec<ActiveQueue>>,
    max_sizes: Vec<u16>,
    acked: u64,
    counters: Arc<Counters>,
}

impl PatternDevice {
    /// A device with one queue per entry of `max_sizes`.
    pub fn new(max_sizes: Vec<u16>) -> Self {
        Self {
            worker: DeviceWorker::new("testdev"),
            max_sizes,
            acked: 0,
            counters: Arc::default(),
        }
    }

    /// Features the driver accepted at the last FEATURES_OK.
    pub fn acked_features(&self) -> u64 {
        self.acked
    }

    /// Whether a worker thread is running.
    pub fn is_active(&self) -> bool {
        self.worker.is_running()
    }

    /// Chains used since activation (the config space's counter).
    pub fn completed(&self) -> u32 {
        self.counters.completed.load(Ordering::SeqCst)
    }

    fn start(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        if self.worker.is_running() {
            return Err(ActivateError::AlreadyActive);
        }
        let setup = WorkerSetup::new()?;
        for (pos, q) in queues.iter().enumerate() {
            setup.add(q.notify.as_raw_fd(), pos as u64 + TOKEN_FIRST_QUEUE)?;
        }
        let ctx = WorkerCtx {
            mem,
            interrupt,
            queues,
            counters: self.counters.clone(),
        };
        self.worker
            .start("virtio-testdev", setup, move |worker| ctx.run(worker))
            .map_err(ActivateError::Worker)
    }
}

impl VirtioDevice for PatternDevice {
    fn device_type(&self) -> u32 {
        TEST_DEVICE_ID
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.max_sizes
    }

    fn avail_features(&self) -> u64 {
        features::VERSION_1 | features::RING_EVENT_IDX | TEST_F_PATTERN
    }

    fn ack_features(&mut self, features: u64) -> bool {
        self.acked = features;
        true
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut cfg = [0u8; CONFIG_SIZE];
        cfg[..4].copy_from_slice(&self.counters.seed.load(Ordering::SeqCst).to_le_bytes());
        cfg[4..].copy_from_slice(&self.counters.completed.load(Ordering::SeqCst).to_le_bytes());
        read_config_bytes(&cfg, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only the seed is writable.
        let mut seed = self.counters.seed.load(Ordering::SeqCst).to_le_bytes();
        if write_config_bytes(&mut seed, offset, data) {
            self.counters
                .seed
                .store(u32::from_le_bytes(seed), Ordering::SeqCst);
        } else {
            debug!(offset, "testdev: write outside the seed ignored");
        }
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        if self.worker.is_running() {
            return Err(ActivateError::AlreadyActive);
        }
        self.counters.completed.store(0, Ordering::SeqCst);
        self.start(mem, interrupt, queues)
    }

    fn reset(&mut self) -> bool {
        self.worker.stop().is_ok()
    }

    fn pause(&mut self) -> Result<Vec<ActiveQueue>, DeviceStateError> {
        match self.worker.stop() {
            Ok(queues) => Ok(queues.unwrap_or_default()),
            Err(e) => Err(DeviceStateError::Stop {
                device: "testdev",
                reason: e.to_string(),
            }),
        }
    }

    fn resume(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        // Unlike an activation, the counter goes on.
        self.start(mem, interrupt, queues)
    }

    fn save_state(
        &mut self,
        _mem: &GuestMemoryMmap,
        _queues: &mut [Queue],
    ) -> Result<Vec<u8>, DeviceStateError> {
        state::encode(
            "testdev",
            &SavedCounters {
                seed: self.counters.seed.load(Ordering::SeqCst),
                completed: self.counters.completed.load(Ordering::SeqCst),
            },
        )
    }

    fn restore_state(&mut self, bytes: &[u8]) -> Result<(), DeviceStateError> {
        let saved: SavedCounters = state::decode("testdev", bytes)?;
        self.counters.seed.store(saved.seed, Ordering::SeqCst);
        self.counters
            .completed
            .store(saved.completed, Ordering::SeqCst);
        Ok(())
    }
}

/// Why the worker gave up on the queues.
#[derive(Debug, thiserror::Error)]
enum WorkerError {
    #[error("virtqueue {index}: {source}")]
    Queue {
        index: u16,
        source: virtio_queue::Error,
    },
    #[error("virtqueue {index}: buffer at {addr:#x} is not in guest memory: {source}")]
    Buffer {
        index: u16,
        addr: u64,
        source: vm_memory::GuestMemoryError,
    },
    #[error("epoll failed: {0}")]
    Epoll(io::Error),
}

struct WorkerCtx {
    mem: GuestMemoryMmap,
    interrupt: Arc<dyn VirtioInterrupt>,
    queues: Vec<ActiveQueue>,
    counters: Arc<Counters>,
}

impl WorkerCtx {
    /// Serves until stopped; hands the queues back.
    fn run(mut self, worker: WorkerLoop) -> Vec<ActiveQueue> {
        let events = self.queues.len() + 1;
        let served = worker.serve(events, WorkerError::Epoll, |wakeup| {
            let Wakeup::Ready(token) = wakeup else {
                return Ok(());
            };
            let pos = (token - TOKEN_FIRST_QUEUE) as usize;
            // Reset the counter; EAGAIN just means a spurious wakeup.
            let _ = self.queues[pos].notify.read();
            self.process(pos)
        });
        if let Err(e) = served {
            warn!("testdev: {e}; device needs reset");
            worker.park_needs_reset("testdev", self.interrupt.as_ref());
        }
        self.queues
    }

    fn process(&mut self, pos: usize) -> Result<(), WorkerError> {
        let seed = self.counters.seed.load(Ordering::SeqCst);
        let mem = &self.mem;
        let aq = &mut self.queues[pos];
        let index = aq.index;
        let q: &mut Queue = &mut aq.queue;
        let qerr = |source| WorkerError::Queue { index, source };
        let counters = &self.counters;
        let notify = drain(
            q,
            mem,
            qerr,
            |chain| {
                let mut written: usize = 0;
                for desc in chain.writable() {
                    fill_pattern(mem, desc.addr(), desc.len(), seed, &mut written).map_err(
                        |source| WorkerError::Buffer {
                            index,
                            addr: desc.addr().0,
                            source,
                        },
                    )?;
                }
                counters.completed.fetch_add(1, Ordering::SeqCst);
                Ok(u32::try_from(written).unwrap_or(u32::MAX))
            },
            |_, e| Err(qerr(e)),
        )?;
        if notify {
            if let Err(e) = self.interrupt.signal_used_queue(index) {
                warn!("testdev: cannot signal queue {index}: {e}");
            }
        }
        Ok(())
    }
}

/// Writes the pattern into `[addr, addr + len)`, continuing from byte
/// `*written` of the chain.
fn fill_pattern(
    mem: &GuestMemoryMmap,
    addr: GuestAddress,
    len: u32,
    seed: u32,
    written: &mut usize,
) -> Result<(), vm_memory::GuestMemoryError> {
    // One period of the pattern from byte `*written` on, copied across the
    // chunk: as CHUNK is a whole number of periods, `buf[k]` is pattern byte
    // `*written + done + k` for every chunk (no per-byte loop per buffer).
    let mut period = [0u8; PATTERN_PERIOD];
    for (i, b) in period.iter_mut().enumerate() {
        *b = pattern_byte(seed, *written + i);
    }
    let mut buf = [0u8; CHUNK];
    for piece in buf.chunks_mut(PATTERN_PERIOD) {
        piece.copy_from_slice(&period[..piece.len()]);
    }
    let mut done: usize = 0;
    let len = len as usize;
    while done < len {
        let n = (len - done).min(CHUNK);
        let at = addr
            .checked_add(done as u64)
            .ok_or(vm_memory::GuestMemoryError::InvalidGuestAddress(addr))?;
        mem.write_slice(&buf[..n], at)?;
        done += n;
        *written += n;
    }
    Ok(())
}
