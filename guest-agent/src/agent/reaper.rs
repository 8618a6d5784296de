//! Reaping child processes and dispatching their exit statuses.
//!
//! The agent does not use `tokio::process`: as PID 1 it must also reap
//! orphans, and two reapers in one process race for statuses. Instead every
//! child is started through [`Reaper::spawn_registered`], which holds the
//! reaper's lock from before `fork` until the pid is registered, so no exit
//! can be collected before someone waits for it. On `SIGCHLD` (and on a slow
//! fallback tick, in case a wakeup is lost) the reaper collects statuses:
//!
//! * [`ReapMode::All`] (the agent is PID 1): `waitpid(-1, WNOHANG)` until no
//!   zombie is left; statuses of registered pids go to their waiter, those of
//!   orphans are dropped.
//! * [`ReapMode::Own`] (any other process, including unit tests that run
//!   several agents in one process): `waitpid(pid, WNOHANG)` for each
//!   registered pid only, never touching other children of the process.

use std::collections::HashMap;
use std::io;
use std::process::Child;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::sync::MutexExt;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::oneshot;

/// Fallback polling interval in case a `SIGCHLD` wakeup is lost.
const FALLBACK_TICK: Duration = Duration::from_millis(500);

/// Errors of the reaper.
#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    #[error("cannot listen for SIGCHLD: {0}")]
    Signal(io::Error),
}

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitStatus {
    /// Normal exit with this code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
    /// The status was lost (someone else reaped the pid).
    Unknown,
}

impl ExitStatus {
    fn from_wait(status: libc::c_int) -> Self {
        if libc::WIFEXITED(status) {
            ExitStatus::Code(libc::WEXITSTATUS(status))
        } else if libc::WIFSIGNALED(status) {
            ExitStatus::Signal(libc::WTERMSIG(status))
        } else {
            ExitStatus::Unknown
        }
    }
}

/// Which children the reaper collects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReapMode {
    /// Every child, including reparented orphans (for PID 1).
    All,
    /// Only registered pids.
    Own,
}

type Waiters = HashMap<libc::pid_t, oneshot::Sender<ExitStatus>>;

/// The process-wide reaper of one agent; cheap to clone.
#[derive(Clone)]
pub struct Reaper {
    waiters: Arc<Mutex<Waiters>>,
    mode: ReapMode,
}

impl Reaper {
    /// Creates a reaper and starts its task (inside a tokio runtime).
    pub fn start(mode: ReapMode) -> Result<Reaper, ReaperError> {
        let sigchld = signal(SignalKind::child()).map_err(ReaperError::Signal)?;
        let reaper = Reaper {
            waiters: Arc::default(),
            mode,
        };
        tokio::spawn(reaper.clone().run(sigchld));
        Ok(reaper)
    }

    fn lock(&self) -> MutexGuard<'_, Waiters> {
        // A poisoned lock only means a panic elsewhere; the map is still sound.
        self.waiters.locked()
    }

    /// Runs `spawn` (which forks) with the reaper locked and registers the
    /// child's pid before any status can be collected.
    pub fn spawn_registered(
        &self,
        spawn: impl FnOnce() -> io::Result<Child>,
    ) -> io::Result<(Child, oneshot::Receiver<ExitStatus>)> {
        let mut waiters = self.lock();
        let child = spawn()?;
        let (tx, rx) = oneshot::channel();
        waiters.insert(child.id() as libc::pid_t, tx);
        Ok((child, rx))
    }

    /// Number of registered children that were not reaped yet.
    pub fn pending(&self) -> usize {
        self.lock().len()
    }

    /// Collects every status available now.
    pub fn reap_now(&self) {
        let mut waiters = self.lock();
        match self.mode {
            ReapMode::All => loop {
                let mut status = 0;
                // SAFETY: plain syscall with a valid out-pointer.
                let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
                if pid > 0 {
                    match waiters.remove(&pid) {
                        Some(tx) => {
                            let _ = tx.send(ExitStatus::from_wait(status));
                        }
                        None => tracing::debug!(pid, "reaped an orphan"),
                    }
                    continue;
                }
                if pid < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                break;
            },
            ReapMode::Own => {
                let pids: Vec<libc::pid_t> = waiters.keys().copied().collect();
                for pid in pids {
                    let mut status = 0;
                    // SAFETY: plain syscall with a valid out-pointer.
                    let got = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                    let exit = if got == pid {
                        ExitStatus::from_wait(status)
                    } else if got < 0
                        && io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD)
                    {
                        tracing::warn!(pid, "child was reaped elsewhere; exit status lost");
                        ExitStatus::Unknown
                    } else {
                        continue;
                    };
                    if let Some(tx) = waiters.remove(&pid) {
                        let _ = tx.send(exit);
                    }
                }
            }
        }
    }

    async fn run(self, mut sigchld: Signal) {
        let mut tick = tokio::time::interval(FALLBACK_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                s = sigchld.recv() => if s.is_none() { break },
                _ = tick.tick() => {}
            }
            self.reap_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[tokio::test]
    async fn delivers_codes_and_signals_to_the_right_waiter() {
        let reaper = Reaper::start(ReapMode::Own).unwrap();
        let (_c1, r1) = reaper
            .spawn_registered(|| Command::new("sh").args(["-c", "exit 5"]).spawn())
            .unwrap();
        let (_c2, r2) = reaper
            .spawn_registered(|| Command::new("sh").args(["-c", "kill -TERM $$"]).spawn())
            .unwrap();
        assert_eq!(r1.await.unwrap(), ExitStatus::Code(5));
        assert_eq!(r2.await.unwrap(), ExitStatus::Signal(libc::SIGTERM));
        assert_eq!(reaper.pending(), 0);
    }

    #[tokio::test]
    async fn own_mode_leaves_other_children_alone() {
        let _reaper = Reaper::start(ReapMode::Own).unwrap();
        // A child nobody registered: its status must stay for std to collect.
        let mut other = Command::new("true").spawn().unwrap();
        tokio::time::sleep(FALLBACK_TICK * 2).await;
        assert!(other.wait().unwrap().success());
    }
}
