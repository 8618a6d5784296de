//! The egress readiness gate: session processes start only once egress
//! start-up has finished, so a spawn's very first connection is captured
//! or relayed like every later one.
//!
//! The slow parts of egress start-up (the capture's install, see
//! [`super::start`]; the ssh tool's copy, see [`super::connect_tool`]) run
//! on threads of their own while the agent dials the host and says hello.
//! Each part holds a [`GateHold`] until it is done; the gate opens when the
//! last hold is dropped, whatever the outcome: a part that failed (logged
//! where it failed) opens it as well, and egress runs without it, as it
//! always did. A part that panics drops its hold while unwinding.
//!
//! The process supervisor awaits [`EgressGate::wait`] before each fork;
//! nothing else waits. Without egress (a plain agent, a sandbox without a
//! proxy) the gate is [`EgressGate::open`] from the start.
//!
//! The wait is bounded: [`START_LIMIT`] after the gate was made, a gate that
//! is still closed is given up on (one warning) and every wait returns at
//! once, so a stuck install never holds spawns for good; they then run as
//! after a failed install.
//!
//! Limits: the gate only opens, never closes again; the limit counts from
//! the gate's creation, not from each wait.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// How long after egress start-up began spawns wait for it at most. The
/// install takes well under a second even in a VM under TCG (about 0.4 s
/// measured in the nested harness); thirty seconds is far beyond any
/// healthy start-up yet short of the host's patience with a spawn.
pub const START_LIMIT: Duration = Duration::from_secs(30);

/// How a wait at the gate ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Passage {
    /// Start-up finished (each part succeeded or failed).
    Open,
    /// Start-up did not finish within the gate's limit: go ahead as after
    /// a failed install.
    GaveUp,
}

/// Opens the gate when dropped (the last [`GateHold`] going away).
#[derive(Debug)]
struct Opener {
    tx: watch::Sender<bool>,
}

impl Drop for Opener {
    fn drop(&mut self) {
        self.tx.send_replace(true);
    }
}

/// A part of egress start-up that is still running; the gate opens when
/// every clone has been dropped (or [`released`](GateHold::release)).
#[derive(Clone, Debug)]
pub struct GateHold {
    _opener: Arc<Opener>,
}

impl GateHold {
    /// This part is done (the same as dropping the hold; reads better at
    /// the end of a task).
    pub fn release(self) {}
}

/// What spawns wait on; cheap to clone. `Default` is an open gate.
#[derive(Clone, Debug)]
pub struct EgressGate {
    /// `None`: open from the start (no egress).
    rx: Option<watch::Receiver<bool>>,
    /// When waits stop waiting.
    deadline: Instant,
    /// The limit the deadline came from (for the log line).
    limit: Duration,
    /// Whether the give-up was logged already (shared by the clones).
    gave_up: Arc<AtomicBool>,
}

impl Default for EgressGate {
    fn default() -> Self {
        Self::open()
    }
}

/// A closed gate with its first hold; waits give up [`START_LIMIT`] from now.
pub fn gate() -> (GateHold, EgressGate) {
    gate_with_limit(START_LIMIT)
}

/// [`gate`] with another limit (tests).
pub fn gate_with_limit(limit: Duration) -> (GateHold, EgressGate) {
    let (tx, rx) = watch::channel(false);
    let hold = GateHold {
        _opener: Arc::new(Opener { tx }),
    };
    let gate = EgressGate {
        rx: Some(rx),
        deadline: Instant::now() + limit,
        limit,
        gave_up: Arc::new(AtomicBool::new(false)),
    };
    (hold, gate)
}

impl EgressGate {
    /// A gate that never held anything: for agents without egress.
    pub fn open() -> Self {
        Self {
            rx: None,
            deadline: Instant::now(),
            limit: Duration::ZERO,
            gave_up: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether start-up has finished (a wait would return at once with
    /// [`Passage::Open`]).
    pub fn is_open(&self) -> bool {
        self.rx.as_ref().is_none_or(|rx| *rx.borrow())
    }

    /// Waits until start-up has finished, or until the gate's limit has
    /// passed (logged once per gate). Needs a runtime with time enabled.
    pub async fn wait(&self) -> Passage {
        let Some(rx) = &self.rx else {
            return Passage::Open;
        };
        let mut rx = rx.clone();
        // The opener sends before its sender goes away, so an error (the
        // sender gone) also means open.
        let opened = tokio::time::timeout_at(self.deadline, rx.wait_for(|open| *open)).await;
        if opened.is_ok() {
            return Passage::Open;
        }
        if !self.gave_up.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                limit_s = self.limit.as_secs_f64(),
                "egress start-up has not finished in time; session processes start without waiting for it (captured connections may fail)"
            );
        }
        Passage::GaveUp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::task::Poll;

    /// A bound for things that happen at once; generous for loaded hosts.
    const PROMPT: Duration = Duration::from_secs(10);

    /// A short but visible while: a closed gate must still be closed after it.
    const A_WHILE: Duration = Duration::from_millis(100);

    /// Polls `fut` once: its output if it finished at once.
    async fn at_once<F: Future>(fut: F) -> Option<F::Output> {
        let mut fut = std::pin::pin!(fut);
        std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
            Poll::Ready(v) => Poll::Ready(Some(v)),
            Poll::Pending => Poll::Ready(None),
        })
        .await
    }

    #[tokio::test]
    async fn without_egress_the_gate_is_open_from_the_start() {
        let gate = EgressGate::open();
        assert!(gate.is_open());
        assert_eq!(at_once(gate.wait()).await, Some(Passage::Open));
        assert!(EgressGate::default().is_open());
    }

    #[tokio::test]
    async fn a_wait_ends_only_when_the_last_hold_goes() {
        let (hold, gate) = gate();
        let second = hold.clone();
        assert!(!gate.is_open());
        assert_eq!(at_once(gate.wait()).await, None);
        let waiter = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.wait().await })
        };
        tokio::time::sleep(A_WHILE).await;
        assert!(!waiter.is_finished(), "passed a closed gate");
        hold.release();
        tokio::time::sleep(A_WHILE).await;
        assert!(!waiter.is_finished(), "passed with one part still running");
        assert!(!gate.is_open());
        drop(second);
        let passage = tokio::time::timeout(PROMPT, waiter).await;
        assert_eq!(passage.unwrap().unwrap(), Passage::Open);
        assert!(gate.is_open());
        // Later waits pass at once.
        assert_eq!(at_once(gate.wait()).await, Some(Passage::Open));
    }

    #[tokio::test]
    async fn a_part_that_panics_opens_the_gate() {
        let (hold, gate) = gate();
        let part = std::thread::spawn(move || {
            let _hold = hold;
            panic!("install failed badly");
        });
        assert!(part.join().is_err());
        let passage = tokio::time::timeout(PROMPT, gate.wait()).await;
        assert_eq!(passage.unwrap(), Passage::Open);
    }

    #[tokio::test]
    async fn a_stuck_start_up_is_given_up_on_after_the_limit() {
        let limit = Duration::from_millis(200);
        let (hold, gate) = gate_with_limit(limit);
        let started = std::time::Instant::now();
        let passage = tokio::time::timeout(PROMPT, gate.wait()).await;
        assert_eq!(passage.unwrap(), Passage::GaveUp);
        assert!(started.elapsed() >= limit, "{:?}", started.elapsed());
        assert!(!gate.is_open());
        // The limit counts from the gate's creation: later waits (and
        // clones) do not wait again.
        assert_eq!(at_once(gate.clone().wait()).await, Some(Passage::GaveUp));
        assert!(gate.gave_up.load(Ordering::Relaxed));
        // Once start-up does finish, the gate is simply open.
        drop(hold);
        assert_eq!(at_once(gate.wait()).await, Some(Passage::Open));
    }
}
