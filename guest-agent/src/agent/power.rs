//! Ending the machine as its PID 1.
//!
//! PID 1 must never return or exit: the kernel panics when init dies. When
//! the agent's work is over (the host asked for `Shutdown`, closed the link,
//! or could not be reached) [`power_off`] ends every other process, flushes
//! the filesystems and powers the machine off with `reboot(2)`. If even that
//! fails (no permission: not really a VM's init) it parks the process
//! forever instead of returning.
//!
//! Limits: processes get SIGTERM and a short grace ([`TERM_GRACE`]) before
//! SIGKILL; nothing is unmounted (the guest's writable filesystems are
//! tmpfs, virtiofs and the session disk, which `sync` flushes).

use std::time::{Duration, Instant};

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
    // SAFETY: reboot with a valid command; on success it does not return.
    let r = unsafe { libc::reboot(libc::RB_POWER_OFF) };
    let e = PowerError::Reboot(std::io::Error::last_os_error());
    tracing::error!(result = r, error = %e, "still running; parking forever");
    loop {
        // SAFETY: pause only waits for a signal.
        unsafe { libc::pause() };
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
