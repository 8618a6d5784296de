//! Ending the machine as its PID 1.
//!
//! PID 1 must never return or exit: the kernel panics when init dies. When
//! the agent's work is over (the host asked for `Shutdown`, closed the link,
//! or could not be reached) [`power_off`] ends every other process, flushes
//! the filesystems and powers the machine off with `reboot(2)`. If even that
//! fails (no permission: not really a VM's init) it parks the process
//! forever instead of returning.
//!
//! The session disk ([`SESSIONS_MOUNT`]) is remounted read-only after the
//! processes are gone: ext4 then checkpoints its journal and marks itself
//! clean, so the next boot mounts it without replaying anything (a plain
//! `sync` leaves the journal to be replayed). It is not unmounted: session
//! folders are bind-mounted below it.
//!
//! Limits: processes get SIGTERM and a short grace ([`TERM_GRACE`]) before
//! SIGKILL; a process the kernel cannot kill (stuck in I/O) keeps the
//! remount from succeeding, which is logged, and the journal is then
//! replayed at the next mount. The other writable filesystems are tmpfs and
//! virtiofs (the host's files), which need nothing.

use std::time::{Duration, Instant};

/// Where the session disk is mounted (see `super::sessiondisk`).
pub const SESSIONS_MOUNT: &std::ffi::CStr = c"/sessions";

/// How long processes get between SIGTERM and SIGKILL.
pub const TERM_GRACE: Duration = Duration::from_millis(500);

/// How long to collect the killed processes' statuses before powering off.
const REAP_WAIT: Duration = Duration::from_secs(1);

/// Pause between reaping rounds.
const REAP_TICK: Duration = Duration::from_millis(20);

/// Errors of powering off (only ever logged: there is no one to return to).
#[derive(Debug, thiserror::Error)]
pub enum PowerError {
    #[error("reboot(RB_POWER_OFF) failed: {0} (is this process the VM's init?)")]
    Reboot(std::io::Error),
}

/// Why the machine is being powered off, for the console log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The host asked for `Shutdown` or closed the link.
    HostDone,
    /// The host link broke or could not be established.
    LinkFailed,
    /// The agent itself failed (runtime, panic).
    AgentFailed,
}

/// Stops every process, syncs and powers off. Never returns.
pub fn power_off(reason: Reason) -> ! {
    tracing::info!(?reason, "powering off");
    signal_all(libc::SIGTERM);
    reap_until_alone(TERM_GRACE);
    signal_all(libc::SIGKILL);
    reap_until_alone(REAP_WAIT);
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    settle_session_disk();
    // SAFETY: reboot with a valid command; on success it does not return.
    let r = unsafe { libc::reboot(libc::RB_POWER_OFF) };
    let e = PowerError::Reboot(std::io::Error::last_os_error());
    tracing::error!(result = r, error = %e, "still running; parking forever");
    loop {
        // SAFETY: pause only waits for a signal.
        unsafe { libc::pause() };
    }
}

/// Remounts the session disk read-only (checkpointing its journal); a
/// missing mount is fine (no session disk, or not a VM).
fn settle_session_disk() {
    // SAFETY: mount(2) with a static path and no data; MS_REMOUNT only
    // changes flags of an existing mount.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            SESSIONS_MOUNT.as_ptr(),
            std::ptr::null(),
            libc::MS_REMOUNT | libc::MS_RDONLY,
            std::ptr::null(),
        )
    };
    if r == 0 {
        tracing::info!("session disk remounted read-only (journal checkpointed)");
    } else {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            tracing::warn!(error = %e, "session disk not remounted read-only; its journal will be replayed");
        }
    }
}

/// Sends `sig` to every process this one may signal, except itself.
fn signal_all(sig: libc::c_int) {
    // SAFETY: kill(-1) never signals the caller; as PID 1 it reaches every
    // other process of the machine.
    unsafe { libc::kill(-1, sig) };
}

/// Reaps children until none is left or `limit` passes.
fn reap_until_alone(limit: Duration) {
    let end = Instant::now() + limit;
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid out-pointer.
        let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if r > 0 {
            continue;
        }
        if r < 0 || Instant::now() >= end {
            // ECHILD: nobody left.
            return;
        }
        std::thread::sleep(REAP_TICK);
    }
}
