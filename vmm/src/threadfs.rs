//! A thread's own filesystem context (working directory, root, umask).
//!
//! Threads share one `fs_struct` unless one of them unshares it
//! (`unshare(CLONE_FS)`). The FUSE server behind virtio-fs sets the umask
//! to 0 when it (re)opens a share's root (fuse-backend-rs's
//! `PassthroughFs::import`, so a guest's mode bits reach the host exactly);
//! on a shared `fs_struct` that is the whole helper's umask, and any thread
//! creating a file in that moment would create it world-writable. The
//! threads that run the FUSE server (virtio-fs workers, vhost-user
//! workers) and the short-lived thread that opens a new grant's root
//! therefore call [`unshare_once`] before anything else, and before a
//! seccomp filter, which does not allow `unshare`.
//!
//! Limits: Linux only; a thread keeps its private context until it ends.

use std::cell::Cell;
use std::io;

thread_local! {
    /// Whether this thread has its own `fs_struct` already.
    static PRIVATE: Cell<bool> = const { Cell::new(false) };
}

/// Gives the calling thread its own filesystem context, once per thread
/// (later calls return at once). Fails only where `unshare` is refused (a
/// seccomp filter installed before the call).
pub fn unshare_once() -> io::Result<()> {
    if PRIVATE.with(Cell::get) {
        return Ok(());
    }
    // SAFETY: unshare(CLONE_FS) only copies this thread's cwd, root and
    // umask into a context of its own; no memory is touched.
    if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    PRIVATE.with(|p| p.set(true));
    Ok(())
}

/// Whether the calling thread has called [`unshare_once`] successfully.
pub fn is_private() -> bool {
    PRIVATE.with(Cell::get)
}

/// The umask of thread `tid` of this process, read from
/// `/proc/self/task/<tid>/status` (`umask(2)` can only read it by setting
/// it, which would race with the thread itself).
pub fn umask_of(tid: libc::pid_t) -> io::Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        .ok_or_else(|| io::Error::other(format!("no Umask line for thread {tid}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's umask.
    fn umask_now() -> u32 {
        // SAFETY: gettid has no arguments and cannot fail.
        umask_of(unsafe { libc::gettid() }).unwrap()
    }

    #[test]
    fn a_private_threads_umask_stays_its_own() {
        let before = umask_now();
        std::thread::spawn(|| {
            assert!(!is_private());
            unshare_once().unwrap();
            unshare_once().unwrap();
            assert!(is_private());
            // SAFETY: changes only this thread's private umask.
            unsafe { libc::umask(0) };
            assert_eq!(umask_now(), 0);
        })
        .join()
        .unwrap();
        assert_eq!(umask_now(), before, "the test thread's umask changed");
    }
}
