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
use std::sync::{Arc, OnceLock};

use tracing::error;
use vmm::seccomp::{self, Filter, Mode, ThreadClass};

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

    /// Installs the vhost-user filter on the calling thread unless it has
    /// one already or no filtering mode was set.
    pub(crate) fn apply(&self) -> io::Result<()> {
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
