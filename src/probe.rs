//! API reachability: probes `startVM.apiProbeURL` with a real HTTP client and
//! reports `apiReachability` events — the first result and every change.
//!
//! Any HTTP answer (whatever its status) means `reachable`. A timeout means
//! `probably_unreachable` (a slow network may still work); refused
//! connections, DNS failures and TLS errors mean `unreachable`. Without a URL
//! the status is `unknown`. The probe runs on the blocking pool (ureq is
//! synchronous) and never holds a lock.

use std::sync::Arc;
use std::time::Duration;

use crate::events::EventHub;
use crate::protocol::event;

/// Per-probe deadline.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Delay between probes while the VM runs.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(30);

/// The client's reachability values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reachability {
    Reachable,
    ProbablyUnreachable,
    Unreachable,
    Unknown,
}

impl Reachability {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reachable => "reachable",
            Self::ProbablyUnreachable => "probably_unreachable",
            Self::Unreachable => "unreachable",
            Self::Unknown => "unknown",
        }
    }
}

/// Probes `url` once.
pub async fn probe(url: String) -> Reachability {
    tokio::task::spawn_blocking(move || probe_blocking(&url))
        .await
        .unwrap_or(Reachability::Unknown)
}

fn probe_blocking(url: &str) -> Reachability {
    let valid = url
        .parse::<ureq::http::Uri>()
        .is_ok_and(|u| matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some());
    if !valid {
        tracing::warn!("apiProbeURL is not an http(s) URL; reachability unknown");
        return Reachability::Unknown;
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(PROBE_TIMEOUT))
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into();
    match agent.head(url).call() {
        Ok(_) => Reachability::Reachable,
        Err(ureq::Error::StatusCode(_)) => Reachability::Reachable,
        Err(ureq::Error::Timeout(_)) => Reachability::ProbablyUnreachable,
        Err(ureq::Error::BadUri(_)) => Reachability::Unknown,
        Err(e) => {
            tracing::debug!(error = %e, "api probe failed");
            Reachability::Unreachable
        }
    }
}

/// Runs until `stop` fires: emits the first result and every change.
pub async fn monitor(
    url: Option<String>,
    hub: Arc<EventHub>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let Some(url) = url.filter(|u| !u.trim().is_empty()) else {
        hub.publish(&event::api_reachability(Reachability::Unknown.as_str()))
            .await;
        return;
    };
    let mut last = None;
    loop {
        let now = tokio::select! {
            r = probe(url.clone()) => r,
            _ = stop.changed() => return,
        };
        if last != Some(now) {
            tracing::info!(status = now.as_str(), "api reachability");
            hub.publish(&event::api_reachability(now.as_str())).await;
            last = Some(now);
        }
        tokio::select! {
            _ = tokio::time::sleep(PROBE_INTERVAL) => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn any_http_answer_is_reachable_and_refused_is_unreachable() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            if let Ok((mut s, _)) = listener.accept() {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf);
                let _ = s.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n");
            }
        });
        assert_eq!(
            probe(format!("http://{addr}/")).await,
            Reachability::Reachable
        );
        // Nothing listens on the port now.
        assert_eq!(
            probe(format!("http://{addr}/")).await,
            Reachability::Unreachable
        );
        assert_eq!(probe("not a url".into()).await, Reachability::Unknown);
    }
}
