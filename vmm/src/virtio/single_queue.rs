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
//! disk image) can be reused after a reset and flushed when the VM ends;
//! pausing it ([`SingleQueueWorker::pause`], for a snapshot) hands the
//! queue back too, with its ring positions.
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
    worker: DeviceWorker<(M, ActiveQueue)>,
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
        Ok(self.worker.stop()?.map(|(model, _)| model))
    }

    /// Stops and joins the worker like [`Self::stop`], handing back the
    /// queue as well (its ring positions are where the worker left them).
    pub fn pause(&mut self) -> Result<Option<(M, ActiveQueue)>, StopError> {
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
    fn run(mut self, worker: WorkerLoop) -> (M, ActiveQueue) {
        if let Err(e) = worker.serve(WORKER_EVENTS, WorkerError::Epoll, |w| self.on_wakeup(w)) {
            error!("{}: {e}; the device needs a reset", self.name);
            worker.park_needs_reset(self.name, self.interrupt.as_ref());
        }
        (self.model, self.queue)
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::{Duration, Instant};

    use virtio_queue::QueueT;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    use super::*;

    /// Index of the queue the test device serves (not 0, to see that the
    /// index is honoured).
    const QUEUE: u16 = 3;

    /// A model that counts its passes and fails on the pass numbered
    /// `fail_on`.
    struct Counting {
        passes: u32,
        fail_on: u32,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("pass {0} failed")]
    struct PassFailed(u32);

    impl QueueModel for Counting {
        type Error = PassFailed;

        fn process_queue(
            &mut self,
            _mem: &GuestMemoryMmap,
            _queue: &mut Queue,
        ) -> Result<bool, PassFailed> {
            self.passes += 1;
            if self.passes == self.fail_on {
                return Err(PassFailed(self.passes));
            }
            Ok(true)
        }
    }

    #[derive(Default)]
    struct Irq {
        used: AtomicU32,
        needs_reset: AtomicU32,
    }

    impl VirtioInterrupt for Irq {
        fn signal_used_queue(&self, queue: u16) -> io::Result<()> {
            assert_eq!(queue, QUEUE);
            self.used.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn signal_config_change(&self) -> io::Result<()> {
            Ok(())
        }
        fn signal_needs_reset(&self) -> io::Result<()> {
            self.needs_reset.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    /// The device's queue and a handle to kick it.
    fn queue(index: u16) -> (ActiveQueue, EventFd) {
        let notify = EventFd::new(EFD_NONBLOCK).unwrap();
        let kick = notify.try_clone().unwrap();
        let q = ActiveQueue {
            index,
            queue: Queue::new(16).unwrap(),
            notify,
        };
        (q, kick)
    }

    fn wait_for(what: &str, counter: &AtomicU32, n: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while counter.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "no {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn serves_kicks_and_hands_the_model_back() {
        let irq = Arc::new(Irq::default());
        let mut w = SingleQueueWorker::new("test", QUEUE);
        let model = || {
            Ok(Counting {
                passes: 0,
                fail_on: 0,
            })
        };
        let (other, _) = queue(0);
        assert!(matches!(
            w.start(GuestMemoryMmap::new(), irq.clone(), vec![other], model),
            Err(ActivateError::MissingQueue { index: QUEUE })
        ));
        assert!(!w.is_running());

        let (q, kick) = queue(QUEUE);
        w.start(GuestMemoryMmap::new(), irq.clone(), vec![q], model)
            .unwrap();
        assert!(w.is_running());
        let (again, _) = queue(QUEUE);
        assert!(matches!(
            w.start(GuestMemoryMmap::new(), irq.clone(), vec![again], model),
            Err(ActivateError::AlreadyActive)
        ));
        kick.write(1).unwrap();
        wait_for("used signal", &irq.used, 1);
        kick.write(1).unwrap();
        wait_for("second used signal", &irq.used, 2);
        let back = w.stop().unwrap().expect("the model comes back");
        assert_eq!(back.passes, 2);
        assert!(!w.is_running());
        assert!(w.stop().unwrap().is_none());
        assert_eq!(irq.needs_reset.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_failed_pass_asks_for_a_reset_and_serves_nothing_more() {
        let irq = Arc::new(Irq::default());
        let mut w = SingleQueueWorker::new("test", QUEUE);
        let (q, kick) = queue(QUEUE);
        w.start(GuestMemoryMmap::new(), irq.clone(), vec![q], || {
            Ok(Counting {
                passes: 0,
                fail_on: 1,
            })
        })
        .unwrap();
        kick.write(1).unwrap();
        wait_for("needs-reset", &irq.needs_reset, 1);
        kick.write(1).unwrap();
        let back = w.stop().unwrap().expect("the model comes back");
        assert_eq!(back.passes, 1, "parked: the second kick was not served");
        assert_eq!(irq.used.load(Ordering::SeqCst), 0);
        assert_eq!(irq.needs_reset.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_refused_model_leaves_the_slot_empty() {
        let irq = Arc::new(Irq::default());
        let mut w: SingleQueueWorker<Counting> = SingleQueueWorker::new("test", QUEUE);
        let (q, _) = queue(QUEUE);
        assert!(matches!(
            w.start(GuestMemoryMmap::new(), irq, vec![q], || Err(
                ActivateError::Device("no model".into())
            )),
            Err(ActivateError::Device(_))
        ));
        assert!(!w.is_running());
    }
}
