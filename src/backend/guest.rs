//! What the VM backends (QEMU and in-process KVM) share about a booting
//! guest: the tail of its serial console kept for error messages, and the
//! wait for the guest agent to dial the helper over vsock.
//!
//! Limits: the console tail holds [`CONSOLE_TAIL`] lines of at most
//! [`MAX_CONSOLE_LINE`] bytes; the agent must dial within
//! [`AGENT_DIAL_TIMEOUT`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use devices::vsock::Listener;
use guest_agent::proto::AGENT_PORT;

use super::AgentStream;
use crate::vm::HELLO_TIMEOUT;

/// How long the agent has to dial in; a little less than the controller's
/// hello timeout so the error quoting the console wins the race.
pub const AGENT_DIAL_TIMEOUT: Duration = HELLO_TIMEOUT.saturating_sub(Duration::from_secs(5));
/// Console lines kept for error messages.
pub const CONSOLE_TAIL: usize = 40;
/// Console lines quoted in an error.
pub(crate) const QUOTED_LINES: usize = 15;
/// Longest console line kept; the rest of a longer one starts a new line.
pub(crate) const MAX_CONSOLE_LINE: usize = 1024;
/// How often the agent listener is polled.
pub(crate) const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// The last console lines, shared by the readers and the error paths.
#[derive(Clone, Default)]
pub(crate) struct Console {
    tail: Arc<Mutex<VecDeque<String>>>,
}

impl Console {
    pub(crate) fn push(&self, line: String) {
        let mut t = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        if t.len() == CONSOLE_TAIL {
            t.pop_front();
        }
        t.push_back(line);
    }

    /// Every kept line, oldest first.
    #[cfg(test)]
    pub(crate) fn lines(&self) -> Vec<String> {
        let t = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        t.iter().cloned().collect()
    }

    /// The last `n` lines, indented, for an error message.
    pub(crate) fn quote(&self, n: usize) -> String {
        let t = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        if t.is_empty() {
            return " (the console printed nothing)".into();
        }
        let skip = t.len().saturating_sub(n);
        let mut s = String::from("; last console lines:");
        for l in t.iter().skip(skip) {
            s.push_str("\n  ");
            s.push_str(l);
        }
        s
    }
}

/// The future of the agent's connection to CID 2 port [`AGENT_PORT`].
pub(crate) fn agent_stream(
    listener: Listener,
    console: Console,
    connected: Arc<AtomicBool>,
) -> AgentStream {
    Box::pin(async move {
        let began = Instant::now();
        let deadline = tokio::time::Instant::now() + AGENT_DIAL_TIMEOUT;
        loop {
            match listener.try_accept() {
                Ok(Some(stream)) => {
                    connected.store(true, Ordering::Release);
                    tracing::info!(
                        ms = began.elapsed().as_millis() as u64,
                        "guest agent dialled vsock port {AGENT_PORT}"
                    );
                    let wrap =
                        |e: std::io::Error| format!("cannot use the agent's vsock stream: {e}");
                    stream.set_nonblocking(true).map_err(wrap)?;
                    return tokio::net::UnixStream::from_std(stream).map_err(wrap);
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(format!(
                        "the vsock device stopped before the guest agent dialled in: {e}{}",
                        console.quote(QUOTED_LINES)
                    ))
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "the guest agent did not dial vsock port {AGENT_PORT} within {}s{}",
                    AGENT_DIAL_TIMEOUT.as_secs(),
                    console.quote(QUOTED_LINES)
                ));
            }
            tokio::time::sleep(ACCEPT_POLL).await;
        }
    })
}
