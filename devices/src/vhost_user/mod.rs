//! vhost-user faces of the device models.
//!
//! Seccomp: a server given a filtering mode (`ThreadFilter`, set with
//! each server's `seccomp` method before it runs) filters every thread that
//! serves its frontend with [`ThreadClass::VhostUser`]: its own thread once
//! the frontend is accepted (it then only waits), the request thread the
//! daemon starts at its first backend call, and each vring worker at its
//! first event, before it reads a ring. The vring workers are created when
//! the server is bound, on the caller's (unfiltered) thread, which is why
//! they filter themselves lazily. Without a mode nothing is filtered.

use std::io;
#[cfg(test)]
use std::os::fd::IntoRawFd;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use vmm::sync::MutexExt;

use tracing::error;
use vmm::seccomp::{self, Filter, Mode, ThreadClass};
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

pub mod blk;
pub mod fs;
pub mod rng;
pub(crate) mod single_queue;
pub mod vsock;

/// The seccomp mode of one server's threads, shared by the server and its
/// backend; unset means unfiltered.
#[derive(Debug, Clone, Default)]
pub(crate) struct ThreadFilter(Arc<OnceLock<Mode>>);

impl ThreadFilter {
    /// Sets the mode (the first call wins).
    pub(crate) fn set(&self, mode: Mode) {
        let _ = self.0.set(mode);
    }

    /// Gives the calling thread its own umask the first time (the FUSE
    /// server sets it, see `vmm::threadfs`), then installs the vhost-user
    /// filter on it unless it has one already or no filtering mode was set.
    pub(crate) fn apply(&self) -> io::Result<()> {
        if seccomp::current().is_none() {
            vmm::threadfs::unshare_once()?;
        }
        let Some(&mode) = self.0.get() else {
            return Ok(());
        };
        if seccomp::current().is_some() {
            return Ok(());
        }
        match Filter::new(ThreadClass::VhostUser, mode) {
            Ok(Some(f)) => f.install().map_err(io::Error::other),
            Ok(None) => Ok(()),
            Err(e) => Err(io::Error::other(e)),
        }
    }

    /// [`Self::apply`] where the caller cannot return an error: logged.
    pub(crate) fn apply_or_log(&self, name: &str) {
        if let Err(e) = self.apply() {
            error!("vhost-user-{name}: {e}");
        }
    }
}

/// One vring worker thread's exit event, which a backend hands to
/// vhost-user-backend from `exit_event()`.
///
/// vhost-user-backend 0.22 registers the consumer it gets there in the
/// worker's epoll with `into_raw_fd()` and never closes it (upstream code
/// of 2026 read for this does the same): every consumer handed out stayed
/// open for the life of the process, one per worker thread and frontend,
/// six per QEMU boot of the helper (`qemu_start_stop_cycles_release_descriptors`
/// in `tests/qemu_e2e.rs`). `ExitEvent` remembers each consumer it hands
/// out and closes it when dropped, which happens with the backend, so after
/// the daemon, its handler and its workers (all of which hold the backend)
/// are gone. Closing one early would not break a worker either: its epoll
/// watches the open eventfd, which [`ExitEvent`]'s own consumer keeps.
///
/// So `exit_event()` is for the library only: any other caller must give
/// up the consumer the same way (`into_raw_fd()`), or the descriptor would
/// be closed twice. `single_queue::tests::the_library_still_leaks_what_exit_event_hands_out`
/// checks the library still leaves them open: were it to close them
/// itself, closing them again here could close someone else's descriptor.
pub(crate) struct ExitEvent {
    consumer: EventConsumer,
    notifier: EventNotifier,
    /// Descriptors of the consumers handed out, for [`Drop`].
    handed_out: Mutex<Vec<RawFd>>,
}

impl ExitEvent {
    /// A new event (non-blocking, close-on-exec: QEMU, started later,
    /// inherits nothing of it).
    pub(crate) fn new() -> io::Result<Self> {
        let (consumer, notifier) =
            new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC)?;
        Ok(Self {
            consumer,
            notifier,
            handed_out: Mutex::new(Vec::new()),
        })
    }

    /// A consumer and a notifier of this event for one worker thread, as
    /// `VhostUserBackend::exit_event` returns them (`None` when the process
    /// is out of descriptors, which the library reports).
    pub(crate) fn for_worker(&self) -> Option<(EventConsumer, EventNotifier)> {
        let consumer = self.consumer.try_clone().ok()?;
        let notifier = self.notifier.try_clone().ok()?;
        self.handed_out.locked().push(consumer.as_raw_fd());
        Some((consumer, notifier))
    }

    /// The descriptors handed out so far (tests).
    #[cfg(test)]
    fn handed_out(&self) -> Vec<RawFd> {
        self.handed_out.locked().clone()
    }
}

impl Drop for ExitEvent {
    fn drop(&mut self) {
        let fds = std::mem::take(
            self.handed_out
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for fd in fds {
            // SAFETY: `fd` is a consumer `for_worker` handed to
            // vhost-user-backend, which turned it into a bare number with
            // `into_raw_fd()` and never closes it (see the type's docs and
            // the test that checks it), so nothing else owns or closes it;
            // it is closed once, here, when dropping the `OwnedFd`.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}

/// What `/proc/self/fdinfo` says `fd` is: `Some(id)` for an eventfd
/// (its `eventfd-id`, unique per eventfd), `None` when `fd` is closed or
/// something else. Tests use it to tell "still this eventfd" from "closed,
/// or the number reused by another test thread".
#[cfg(test)]
pub(crate) fn eventfd_id(fd: RawFd) -> Option<u64> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("eventfd-id:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod exit_event_tests {
    use super::*;

    #[test]
    fn closes_the_consumers_it_handed_out_when_dropped() {
        let exit = ExitEvent::new().unwrap();
        let mut taken = Vec::new();
        for _ in 0..2 {
            let (consumer, notifier) = exit.for_worker().unwrap();
            // The notifier handed out reaches the worker's consumer.
            notifier.notify().unwrap();
            assert!(consumer.consume().is_ok());
            // What vhost-user-backend then does with them.
            taken.push(consumer.into_raw_fd());
            drop(notifier);
        }
        assert_eq!(exit.handed_out(), taken);
        let ids: Vec<u64> = taken
            .iter()
            .map(|&fd| eventfd_id(fd).expect("an open eventfd"))
            .collect();
        assert_eq!(ids[0], ids[1], "clones of one eventfd");
        drop(exit);
        for (fd, id) in taken.iter().zip(&ids) {
            assert_ne!(
                eventfd_id(*fd),
                Some(*id),
                "fd {fd} still open after the drop"
            );
        }
    }

    #[test]
    fn vhost_user_threads_get_their_own_umask_before_any_filter() {
        std::thread::spawn(|| {
            assert!(!vmm::threadfs::is_private());
            ThreadFilter::default().apply().unwrap();
            assert!(vmm::threadfs::is_private());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn is_close_on_exec() {
        let exit = ExitEvent::new().unwrap();
        // SAFETY: F_GETFD on a descriptor this test owns.
        let flags = unsafe { libc::fcntl(exit.consumer.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        // SAFETY: as above.
        let flags = unsafe { libc::fcntl(exit.notifier.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
    }
}

#[cfg(test)]
mod seccomp_tests {
    use super::*;

    #[test]
    fn thread_filter_filters_only_once_a_mode_is_set() {
        let filter = ThreadFilter::default();
        let f = filter.clone();
        let unset = std::thread::spawn(move || {
            f.apply().unwrap();
            seccomp::current()
        })
        .join()
        .unwrap();
        assert_eq!(unset, None);

        filter.set(Mode::On);
        // The first mode wins.
        filter.set(Mode::Off);
        let f = filter.clone();
        let (class, again, inet) = std::thread::spawn(move || {
            f.apply().unwrap();
            let class = seccomp::current();
            // A second call on a filtered thread is a no-op.
            let again = f.apply().is_ok();
            // SAFETY: plain syscall with integer arguments.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
            let inet = io::Error::last_os_error().raw_os_error();
            if fd >= 0 {
                // SAFETY: closing the fd just created.
                unsafe { libc::close(fd) };
            }
            (class, again, (fd, inet))
        })
        .join()
        .unwrap();
        assert_eq!(class, Some((ThreadClass::VhostUser, Mode::On)));
        assert!(again);
        assert_eq!(inet, (-1, Some(libc::EPERM)));
    }
}
