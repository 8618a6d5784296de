//! The worker of an in-process device that serves one virtqueue
//! (virtio-blk's and virtio-rng's request queue).
//!
//! A device model that knows how to drain its queue implements
//! [`QueueModel`]; its in-process face keeps a [`SingleQueueWorker`] and
//! calls [`SingleQueueWorker::start`] from [`VirtioDevice::activate`] and
//! [`SingleQueueWorker::stop`] from [`VirtioDevice::reset`]. While active, a
//! thread named `virtio-<name>` owns the model, the queue and the guest
//! memory: every kick of the queue reads the notify eventfd, drains the
//! queue through [`QueueModel::process_queue`] and signals the driver when
//! the ring asks for it. An error of the model (a broken available ring) or
//! of epoll is logged once and the worker asks the driver for a reset
//! ([`WorkerLoop::park_needs_reset`]), serving nothing until the transport
//! stops it. Stopping the worker hands the model back, so what it owns (a
//! disk image) can be reused after a reset and flushed when the VM ends.
//!
//! Limits: one queue, one thread, one request at a time. If the thread
//! panics, the model is gone with it.
//!
//! [`VirtioDevice::activate`]: super::VirtioDevice::activate
//! [`VirtioDevice::reset`]: super::VirtioDevice::reset

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use tracing::{error, warn};
use virtio_queue::Queue;

use super::worker::{DeviceWorker, StopError, Wakeup, WorkerLoop, WorkerSetup};
use super::{ActivateError, ActiveQueue, GuestMemoryMmap, VirtioInterrupt};

/// epoll token of the queue's notify eventfd (0 is the stop eventfd's).
const TOKEN_QUEUE: u64 = 1;
/// Most epoll events the worker takes per wait: the stop eventfd and the
/// queue.
const WORKER_EVENTS: usize = 2;

/// A device model that serves one virtqueue.
pub trait QueueModel: Send + 'static {
    /// Why the queue cannot be served any more (the device then needs a
    /// reset).
    type Error: std::error::Error;

    /// Serves every available chain of `queue`, whose buffers live in
    /// `mem`. Returns whether the driver needs a used-buffer notification.
    fn process_queue(
        &mut self,
        mem: &GuestMemoryMmap,
        queue: &mut Queue,
    ) -> Result<bool, Self::Error>;
}

/// The worker slot of a single-queue device: empty while the device is
/// inactive, the thread owning the model while active. Dropping it stops the
/// worker (and drops the model).
pub struct SingleQueueWorker<M> {
    /// Prefix of log lines (`"blk"`, `"rng"`); the thread is `virtio-<name>`.
    name: &'static str,
    /// Index of the queue the device serves.
    queue_index: u16,
    worker: DeviceWorker<M>,
}

impl<M: QueueModel> SingleQueueWorker<M> {
    /// An empty slot for a device that logs as `name` and serves queue
    /// `queue_index`.
    pub fn new(name: &'static str, queue_index: u16) -> Self {
        Self {
            name,
            queue_index,
            worker: DeviceWorker::new(name),
        }
    }

    /// Whether a worker thread runs (or is parked after a failure).
    pub fn is_running(&self) -> bool {
        self.worker.is_running()
    }

    /// Starts serving the device's queue among `queues` with the model
    /// `model` returns, in this order of checks: the worker must not run
    /// ([`ActivateError::AlreadyActive`]), the queue must have been enabled
    /// ([`ActivateError::MissingQueue`]), the epoll set must be built, then
    /// `model` is called (its error is returned as is) and the thread
    /// spawned. If the spawn fails the model is dropped with it.
    pub fn start(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActiveQueue>,
        model: impl FnOnce() -> Result<M, ActivateError>,
    ) -> Result<(), ActivateError> {
        if self.worker.is_running() {
            return Err(ActivateError::AlreadyActive);
        }
        let index = self.queue_index;
        let queue = queues
            .into_iter()
            .find(|q| q.index == index)
            .ok_or(ActivateError::MissingQueue { index })?;
        let setup = WorkerSetup::new()?;
        setup.add(queue.notify.as_raw_fd(), TOKEN_QUEUE)?;
        let ctx = WorkerCtx {
            name: self.name,
            mem,
            interrupt,
            queue,
            model: model()?,
        };
        let thread_name = format!("virtio-{}", self.name);
        if let Err(e) = self
            .worker
            .start(&thread_name, setup, move |worker| ctx.run(worker))
        {
            error!("{}: cannot start the worker: {e}", self.name);
            return Err(ActivateError::Worker(e));
        }
        Ok(())
    }

    /// Stops and joins the worker. `Ok(None)`: none was running;
    /// `Ok(Some(model))`: it stopped and handed the model back.
    pub fn stop(&mut self) -> Result<Option<M>, StopError> {
        self.worker.stop()
    }
}

/// What the worker thread owns.
struct WorkerCtx<M> {
    name: &'static str,
    mem: GuestMemoryMmap,
    interrupt: Arc<dyn VirtioInterrupt>,
    queue: ActiveQueue,
    model: M,
}

/// Why the worker stopped serving.
#[derive(Debug, thiserror::Error)]
enum WorkerError<E: std::error::Error> {
    #[error(transparent)]
    Model(E),
    #[error("epoll_wait failed: {0}")]
    Epoll(io::Error),
}

impl<M: QueueModel> WorkerCtx<M> {
    fn run(mut self, worker: WorkerLoop) -> M {
        if let Err(e) = worker.serve(WORKER_EVENTS, WorkerError::Epoll, |w| self.on_wakeup(w)) {
            error!("{}: {e}; the device needs a reset", self.name);
            worker.park_needs_reset(self.name, self.interrupt.as_ref());
        }
        self.model
    }

    fn on_wakeup(&mut self, wakeup: Wakeup) -> Result<(), WorkerError<M::Error>> {
        if wakeup == Wakeup::Ready(TOKEN_QUEUE) {
            // Reset the counter; EAGAIN only means a spurious wakeup.
            let _ = self.queue.notify.read();
            let notify = self
                .model
                .process_queue(&self.mem, &mut self.queue.queue)
                .map_err(WorkerError::Model)?;
            if notify {
                if let Err(e) = self.interrupt.signal_used_queue(self.queue.index) {
                    warn!("{}: cannot signal the request queue: {e}", self.name);
                }
            }
        }
        Ok(())
    }
}
