//! What the VM backends (QEMU and in-process KVM) share about the guest
//! they boot: its vsock identity, the host's ability to run it under KVM,
//! the agent's log level passed on the kernel command line, how long a
//! power-off may take, and the wait for the guest agent to dial the helper
//! over vsock. The console both keep is in [`super::console`], the guest's
//! size in [`super::sizing`].
//!
//! Limits: the agent must dial within [`AGENT_DIAL_TIMEOUT`]; the guest
//! must power off within [`POWEROFF_DEADLINE`] of being told to.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devices::vsock::Listener;
use guest_agent::proto::AGENT_PORT;

use super::console::{Console, QUOTED_LINES};
use super::{AgentStream, HELLO_TIMEOUT};

/// The guest's CID (each VM has its own device, so all can use the same).
pub const GUEST_CID: u64 = 3;
/// Environment variable whose value becomes the guest agent's `COWORK_LOG`.
pub const GUEST_LOG_ENV: &str = "COWORK_GUEST_LOG";
/// Longest `COWORK_LOG=` value passed on the kernel command line.
const MAX_GUEST_LOG: usize = 200;
/// How long the agent has to dial in; a little less than the controller's
/// hello timeout so the error quoting the console wins the race.
pub const AGENT_DIAL_TIMEOUT: Duration = HELLO_TIMEOUT.saturating_sub(Duration::from_secs(5));
/// How long the guest gets to power off after the agent was told to shut down.
pub const POWEROFF_DEADLINE: Duration = Duration::from_secs(10);
/// How often the agent listener (and a finishing vhost-user thread) is polled.
pub(crate) const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// Whether `/dev/kvm` is usable and can boot Linux (why not otherwise).
pub fn kvm_for_linux() -> Result<(), String> {
    vmm::kvm_check::check_capabilities().map_err(|e| e.to_string())?;
    vmm::kvm_check::linux_capable().map_err(|e| e.to_string())
}

/// The kernel command-line word passing `$COWORK_GUEST_LOG` to the agent,
/// when it is set and is one word of safe characters.
pub fn guest_log_word(value: Option<&str>) -> Option<String> {
    let v = value?.trim();
    let safe = !v.is_empty()
        && v.len() <= MAX_GUEST_LOG
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_=,:.-".contains(c));
    safe.then(|| format!("COWORK_LOG={v}"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_words() {
        assert_eq!(
            guest_log_word(Some("info,guest_agent=debug")).as_deref(),
            Some("COWORK_LOG=info,guest_agent=debug")
        );
        for bad in [None, Some(""), Some("debug quiet"), Some("a;rm -rf /")] {
            assert_eq!(guest_log_word(bad), None, "{bad:?}");
        }
        assert!(guest_log_word(Some(&"a".repeat(MAX_GUEST_LOG + 1))).is_none());
        assert!(AGENT_DIAL_TIMEOUT < HELLO_TIMEOUT);
    }
}
