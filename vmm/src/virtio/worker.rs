//! The worker thread every in-process virtio device runs while active.
//!
//! A device builds a [`WorkerSetup`] in [`VirtioDevice::activate`]: a
//! blocking stop [`EventFd`] and an epoll set in which it is already
//! registered under [`STOP_TOKEN`]; the device adds its queue notify
//! eventfds (and any other fd it waits on) under tokens of its own, then
//! [`DeviceWorker::start`]s a named thread with it. The thread's body gets
//! the worker's end, a [`WorkerLoop`]: [`WorkerLoop::serve`] waits on the
//! epoll set and hands every token but the stop token to the device until
//! stopped, and [`WorkerLoop::park_needs_reset`] is the failure policy (ask
//! the driver for a reset, then do nothing until the transport stops the
//! worker). [`DeviceWorker::stop`] (on reset, and on drop) writes the stop
//! eventfd and joins the thread, returning what its body returned.
//!
//! Seccomp: a worker started by a filtered thread (the vCPU that activated
//! the device, under [`crate::seccomp`]) is created without that filter
//! ([`crate::seccomp::spawn_unfiltered`]) and installs its own class's
//! ([`ThreadClass::DeviceWorker`] unless the device chose another with
//! [`DeviceWorker::with_class`]) in the same mode before its body runs;
//! `start` returns only once it did, and fails if it could not. A worker
//! started by an unfiltered thread (seccomp off, unit tests) is unfiltered.
//!
//! Limits: one thread per device; level-triggered `EPOLLIN` only.
//!
//! [`VirtioDevice::activate`]: super::VirtioDevice::activate

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::thread::JoinHandle;

use tracing::warn;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::{ActivateError, VirtioInterrupt};
use crate::seccomp::{self, Filter, ThreadClass};

/// epoll token of the stop eventfd; devices register their fds under other
/// tokens.
pub const STOP_TOKEN: u64 = 0;

/// What [`WorkerLoop::serve`] hands the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wakeup {
    /// The fd registered under this token is readable.
    Ready(u64),
    /// Every event of one wait was handed over (and none was the stop).
    BatchDone,
}

/// Why [`DeviceWorker::stop`] did not get the worker's result.
#[derive(Debug, thiserror::Error)]
pub enum StopError {
    /// The stop eventfd could not be written; the worker still runs and is
    /// kept, so a later stop can retry.
    #[error("cannot stop the worker: {0}")]
    Signal(#[source] io::Error),
    /// The worker thread panicked; it is gone, and what it owned with it.
    #[error("the worker panicked")]
    Panicked,
}

/// The epoll set and stop eventfd of a worker about to be started.
pub struct WorkerSetup {
    stop: EventFd,
    worker: WorkerLoop,
}

impl WorkerSetup {
    /// A new blocking stop eventfd (a failed worker parks on it) and an
    /// epoll set holding it under [`STOP_TOKEN`]; both close on exec.
    pub fn new() -> Result<Self, ActivateError> {
        let stop = EventFd::new(libc::EFD_CLOEXEC).map_err(ActivateError::Worker)?;
        let epoll = Epoll::new().map_err(ActivateError::Worker)?;
        let worker_stop = stop.try_clone().map_err(ActivateError::Worker)?;
        let setup = Self {
            stop,
            worker: WorkerLoop {
                epoll,
                stop: worker_stop,
            },
        };
        setup.register(setup.stop.as_raw_fd(), STOP_TOKEN)?;
        Ok(setup)
    }

    /// Wakes the worker with [`Wakeup::Ready`]`(token)` while `fd` is
    /// readable. `token` must not be [`STOP_TOKEN`].
    pub fn add(&self, fd: RawFd, token: u64) -> Result<(), ActivateError> {
        if token == STOP_TOKEN {
            return Err(ActivateError::Worker(io::Error::new(
                io::ErrorKind::InvalidInput,
                "epoll token 0 is reserved for the stop eventfd",
            )));
        }
        self.register(fd, token)
    }

    fn register(&self, fd: RawFd, token: u64) -> Result<(), ActivateError> {
        self.worker
            .epoll
            .ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )
            .map_err(ActivateError::Worker)
    }
}

/// The worker thread's end: the epoll set and its copy of the stop eventfd.
pub struct WorkerLoop {
    epoll: Epoll,
    stop: EventFd,
}

impl WorkerLoop {
    /// Waits (up to `max_events` events at a time) and hands each token to
    /// `on_wakeup`, then [`Wakeup::BatchDone`]; returns `Ok` when the stop
    /// eventfd fires (the events before it in the same wait are handed over
    /// first, the ones after it are not). An interrupted wait is retried;
    /// another epoll error is returned through `epoll_error`, and so is the
    /// first error of `on_wakeup`.
    pub fn serve<E>(
        &self,
        max_events: usize,
        epoll_error: impl Fn(io::Error) -> E,
        mut on_wakeup: impl FnMut(Wakeup) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut events = vec![EpollEvent::default(); max_events.max(1)];
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(epoll_error(e)),
            };
            for ev in &events[..n] {
                match ev.data() {
                    STOP_TOKEN => return Ok(()),
                    token => on_wakeup(Wakeup::Ready(token))?,
                }
            }
            on_wakeup(Wakeup::BatchDone)?;
        }
    }

    /// The failure policy: signals DEVICE_NEEDS_RESET through `interrupt`
    /// (logging `"<name>: cannot signal needs-reset: ..."` if that fails),
    /// then blocks until the transport resets (or drops) the device. The
    /// caller logs why it failed first.
    pub fn park_needs_reset(&self, name: &str, interrupt: &dyn VirtioInterrupt) {
        if let Err(e) = interrupt.signal_needs_reset() {
            warn!("{name}: cannot signal needs-reset: {e}");
        }
        let _ = self.stop.read();
    }
}

struct Running<T> {
    stop: EventFd,
    /// `None` when the thread could not install its filter (its body never
    /// ran).
    thread: JoinHandle<Option<T>>,
}

/// A device's worker thread slot: empty while the device is inactive. The
/// thread's body returns a `T` (what it owned that the device wants back)
/// to [`Self::stop`]. Dropping it stops the worker.
pub struct DeviceWorker<T> {
    /// Prefix of the log lines about this worker (`"rng"`, `"blk"`...).
    name: &'static str,
    /// The seccomp class the worker thread installs when filtered.
    class: ThreadClass,
    running: Option<Running<T>>,
}

impl<T> DeviceWorker<T> {
    /// An empty slot for a device that logs as `name`.
    pub fn new(name: &'static str) -> Self {
        Self::with_class(name, ThreadClass::DeviceWorker)
    }

    /// An empty slot whose worker installs `class`'s seccomp filter (when
    /// the thread starting it is filtered) instead of
    /// [`ThreadClass::DeviceWorker`]'s.
    pub fn with_class(name: &'static str, class: ThreadClass) -> Self {
        Self {
            name,
            class,
            running: None,
        }
    }

    /// Whether a worker thread runs (or is parked after a failure).
    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// Stops and joins the worker. `Ok(None)`: none was running;
    /// `Ok(Some(t))`: it stopped and returned `t`.
    pub fn stop(&mut self) -> Result<Option<T>, StopError> {
        let Some(running) = self.running.take() else {
            return Ok(None);
        };
        if let Err(e) = running.stop.write(1) {
            warn!("{}: cannot stop the worker: {e}", self.name);
            // Keep the handle so a later reset can retry.
            self.running = Some(running);
            return Err(StopError::Signal(e));
        }
        running.thread.join().map_err(|_| StopError::Panicked)
    }
}

impl<T: Send + 'static> DeviceWorker<T> {
    /// Spawns the thread `thread_name` running `body` with `setup`'s worker
    /// end. On error the thread did not start and `body` is dropped. The
    /// caller checks [`Self::is_running`] first: starting over a running
    /// worker stops it.
    pub fn start(
        &mut self,
        thread_name: &str,
        setup: WorkerSetup,
        body: impl FnOnce(WorkerLoop) -> T + Send + 'static,
    ) -> io::Result<()> {
        let WorkerSetup { stop, worker } = setup;
        let builder = std::thread::Builder::new().name(thread_name.into());
        // The FUSE server behind virtio-fs sets the umask (see
        // `crate::threadfs`): its workers get their own, before any filter.
        let private_fs = self.class == ThreadClass::FsWorker;
        let name = self.name;
        let unshare = move || {
            if private_fs {
                if let Err(e) = crate::threadfs::unshare_once() {
                    tracing::warn!("{name}: worker keeps the process umask: {e}");
                }
            }
        };
        let filter = match seccomp::current() {
            Some((_, mode)) => Filter::new(self.class, mode).map_err(io::Error::other)?,
            None => None,
        };
        let Some(filter) = filter else {
            let thread = builder.spawn(move || {
                unshare();
                Some(body(worker))
            })?;
            let _ = self.stop();
            self.running = Some(Running { stop, thread });
            return Ok(());
        };
        // The body runs only under the filter; the thread says whether it
        // got there before `start` returns.
        let (installed_tx, installed_rx) = std::sync::mpsc::sync_channel(1);
        let thread = seccomp::spawn_unfiltered(builder, move || {
            unshare();
            let installed = filter.install();
            let ok = installed.is_ok();
            let _ = installed_tx.send(installed);
            ok.then(|| body(worker))
        })?;
        let installed = installed_rx.recv().unwrap_or_else(|_| {
            Err(seccomp::SeccompError::Spawner(io::Error::other(
                "the worker ended before installing its filter",
            )))
        });
        if let Err(e) = installed {
            let _ = thread.join();
            return Err(io::Error::other(e));
        }
        let _ = self.stop();
        self.running = Some(Running { stop, thread });
        Ok(())
    }
}

impl<T> Drop for DeviceWorker<T> {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::mpsc;
    use std::sync::Arc;

    use super::*;

    /// Token the tests register their kick eventfd under.
    const TOKEN_KICK: u64 = 7;

    #[derive(Default)]
    struct CountReset(AtomicU32);

    impl VirtioInterrupt for CountReset {
        fn signal_used_queue(&self, _queue: u16) -> io::Result<()> {
            Ok(())
        }
        fn signal_config_change(&self) -> io::Result<()> {
            Ok(())
        }
        fn signal_needs_reset(&self) -> io::Result<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    /// The `Seccomp:` mode of thread `tid` of this process from /proc (2 =
    /// filtered).
    fn kernel_seccomp_mode(tid: i64) -> u32 {
        std::fs::read_to_string(format!("/proc/self/task/{tid}/status"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    }

    /// Starts a worker of `class` (None: the default) from a thread
    /// filtered as a vCPU when `vcpu_filtered`; returns what the worker
    /// knows of its filter and what the kernel says, read from this
    /// (unfiltered) thread while the worker waits to be stopped (a filtered
    /// thread cannot open /proc).
    fn worker_filter(
        vcpu_filtered: bool,
        class: Option<ThreadClass>,
    ) -> (Option<(ThreadClass, seccomp::Mode)>, u32) {
        seccomp::start_spawner().unwrap();
        let (seen_tx, seen_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let starter = std::thread::spawn(move || {
            if vcpu_filtered {
                let vcpu = Filter::new(ThreadClass::Vcpu, seccomp::Mode::On)
                    .unwrap()
                    .unwrap();
                vcpu.install().unwrap();
            }
            let mut worker = match class {
                Some(c) => DeviceWorker::with_class("test", c),
                None => DeviceWorker::new("test"),
            };
            worker
                .start("worker-test", WorkerSetup::new().unwrap(), move |lp| {
                    // SAFETY: gettid has no arguments.
                    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
                    seen_tx.send((seccomp::current(), tid)).unwrap();
                    lp.serve(1, |e| e, |_| Ok(())).unwrap();
                })
                .unwrap();
            done_rx.recv().unwrap();
            worker.stop().unwrap();
        });
        let (class, tid) = seen_rx.recv().unwrap();
        let kernel = kernel_seccomp_mode(tid);
        done_tx.send(()).unwrap();
        starter.join().unwrap();
        (class, kernel)
    }

    #[test]
    fn a_workers_fds_are_close_on_exec() {
        let setup = WorkerSetup::new().unwrap();
        for fd in [
            setup.stop.as_raw_fd(),
            setup.worker.stop.as_raw_fd(),
            setup.worker.epoll.as_raw_fd(),
        ] {
            // SAFETY: F_GETFD only reads the flags of an fd the setup owns.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
            assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC, "fd {fd}");
        }
    }

    #[test]
    fn workers_of_filtered_threads_get_their_own_class() {
        assert_eq!(
            worker_filter(true, None),
            (Some((ThreadClass::DeviceWorker, seccomp::Mode::On)), 2)
        );
        assert_eq!(
            worker_filter(true, Some(ThreadClass::FsWorker)),
            (Some((ThreadClass::FsWorker, seccomp::Mode::On)), 2)
        );
    }

    /// Whether a worker of `class` started from a thread filtered or not
    /// runs with its own filesystem context (umask).
    fn worker_private_fs(filtered: bool, class: ThreadClass) -> bool {
        seccomp::start_spawner().unwrap();
        let (seen_tx, seen_rx) = mpsc::channel();
        std::thread::spawn(move || {
            if filtered {
                let vcpu = Filter::new(ThreadClass::Vcpu, seccomp::Mode::On)
                    .unwrap()
                    .unwrap();
                vcpu.install().unwrap();
            }
            let mut worker = DeviceWorker::with_class("test", class);
            worker
                .start("worker-fs-test", WorkerSetup::new().unwrap(), move |_| {
                    seen_tx.send(crate::threadfs::is_private()).unwrap();
                })
                .unwrap();
            worker.stop().unwrap();
        })
        .join()
        .unwrap();
        seen_rx.recv().unwrap()
    }

    #[test]
    fn virtio_fs_workers_have_their_own_umask() {
        assert!(worker_private_fs(false, ThreadClass::FsWorker));
        assert!(worker_private_fs(true, ThreadClass::FsWorker));
        assert!(!worker_private_fs(false, ThreadClass::DeviceWorker));
    }

    #[test]
    fn workers_of_unfiltered_threads_are_unfiltered() {
        assert_eq!(worker_filter(false, None), (None, 0));
    }

    #[test]
    fn stop_token_is_reserved() {
        let setup = WorkerSetup::new().unwrap();
        let fd = EventFd::new(0).unwrap();
        assert!(matches!(
            setup.add(fd.as_raw_fd(), STOP_TOKEN),
            Err(ActivateError::Worker(_))
        ));
        setup.add(fd.as_raw_fd(), TOKEN_KICK).unwrap();
    }

    #[test]
    fn serves_tokens_then_returns_the_body_result_on_stop() {
        let kick = EventFd::new(0).unwrap();
        let setup = WorkerSetup::new().unwrap();
        setup.add(kick.as_raw_fd(), TOKEN_KICK).unwrap();
        let worker_kick = kick.try_clone().unwrap();
        let (seen_tx, seen_rx) = mpsc::channel();
        let mut worker = DeviceWorker::new("test");
        assert!(!worker.is_running());
        worker
            .start("worker-test", setup, move |lp| {
                let mut kicks = 0u32;
                let res: Result<(), io::Error> = lp.serve(
                    2,
                    |e| e,
                    |w| {
                        if w == Wakeup::Ready(TOKEN_KICK) {
                            let _ = worker_kick.read();
                            kicks += 1;
                            let _ = seen_tx.send(w);
                        }
                        Ok(())
                    },
                );
                assert!(res.is_ok());
                kicks
            })
            .unwrap();
        assert!(worker.is_running());
        kick.write(1).unwrap();
        assert_eq!(seen_rx.recv().unwrap(), Wakeup::Ready(TOKEN_KICK));
        assert_eq!(worker.stop().unwrap(), Some(1));
        assert!(!worker.is_running());
        assert_eq!(worker.stop().unwrap(), None);
    }

    #[test]
    fn failed_worker_signals_needs_reset_and_parks_until_stopped() {
        let kick = EventFd::new(0).unwrap();
        let setup = WorkerSetup::new().unwrap();
        setup.add(kick.as_raw_fd(), TOKEN_KICK).unwrap();
        let interrupt = Arc::new(CountReset::default());
        let irq = interrupt.clone();
        let mut worker = DeviceWorker::new("test");
        worker
            .start("worker-test", setup, move |lp| {
                let res = lp.serve(2, |e| e.to_string(), |_| Err("broken".to_string()));
                assert_eq!(res, Err("broken".to_string()));
                lp.park_needs_reset("test", irq.as_ref());
                "parked"
            })
            .unwrap();
        kick.write(1).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while interrupt.0.load(Ordering::SeqCst) == 0 {
            assert!(std::time::Instant::now() < deadline, "no needs-reset");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(worker.stop().unwrap(), Some("parked"));
        assert_eq!(interrupt.0.load(Ordering::SeqCst), 1);
    }
}
