//! API reachability: probes `startVM.apiProbeURL` with a real HTTP client and
//! reports `apiReachability` events — the first result and every change.
//!
//! The probe connects through the egress proxy's dialer
//! ([`crate::egress::EgressDialer::connect_str`], unrestricted policy), the path every
//! session's traffic takes: the same address guard, the same resolver, the
//! helper's own upstream proxy (`HTTPS_PROXY`/`NO_PROXY`) when set. So the
//! answer is what sessions can reach, not what the helper process could: a
//! probe URL on the host's loopback or on one of its interface addresses is
//! `unreachable`, because no session can reach it either. Over that
//! connection ureq speaks HTTP/1.1 (TLS with its built-in roots for
//! `https`), with a one-connection connector of ours, so ureq itself never
//! resolves or dials anything.
//!
//! Any HTTP answer (whatever its status) means `reachable`. A timeout means
//! `probably_unreachable` (a slow network may still work); refused
//! connections, DNS failures, guard refusals and TLS errors mean
//! `unreachable`. Without a URL (or with one that is not http(s)) the status
//! is `unknown`. The HTTP exchange runs on the blocking pool (ureq is
//! synchronous) and never holds a lock.
//!
//! Limits: one `HEAD` per probe, no redirects followed; the whole probe is
//! bounded by [`PROBE_TIMEOUT`].

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ureq::unversioned::resolver::{ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, RustlsConnector, Transport,
};

use crate::egress::{EgressError, EgressProxy, Policy};
use crate::events::EventHub;
use crate::protocol::event;
use vmm::sync::MutexExt;

/// Per-probe deadline (connection setup and the HTTP exchange together).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Delay between probes while the VM runs.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(30);

/// Default ports of the two schemes a probe URL may have.
const HTTP_PORT: u16 = 80;
const HTTPS_PORT: u16 = 443;

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

/// Why a probe could not even start (the URL), for the log.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("apiProbeURL is not an http(s) URL with a host")]
    NotHttpUrl,
}

/// Where a probe URL points.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    host: String,
    port: u16,
}

/// The host and port of an `http`/`https` URL.
fn target_of(url: &str) -> Result<Target, ProbeError> {
    let uri = url
        .parse::<ureq::http::Uri>()
        .map_err(|_| ProbeError::NotHttpUrl)?;
    let default_port = match uri.scheme_str() {
        Some("http") => HTTP_PORT,
        Some("https") => HTTPS_PORT,
        _ => return Err(ProbeError::NotHttpUrl),
    };
    let host = uri.host().filter(|h| !h.is_empty());
    let host = host.ok_or(ProbeError::NotHttpUrl)?;
    Ok(Target {
        host: host.to_owned(),
        port: uri.port_u16().unwrap_or(default_port),
    })
}

/// Probes `url` once, connecting through `egress`'s dialer.
pub async fn probe(url: String, egress: &EgressProxy) -> Reachability {
    let started = Instant::now();
    let target = match target_of(&url) {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %e, "reachability unknown");
            return Reachability::Unknown;
        }
    };
    let dial = egress
        .dialer()
        .connect_str(&target.host, target.port, &Policy::Unrestricted);
    let stream = match tokio::time::timeout(PROBE_TIMEOUT, dial).await {
        Err(_) => return Reachability::ProbablyUnreachable,
        Ok(Err(e)) => return dial_failure(&e),
        Ok(Ok(s)) => s,
    };
    let stream = match stream.into_std().and_then(|s| {
        s.set_nonblocking(false)?;
        Ok(s)
    }) {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, "api probe cannot use its connection");
            return Reachability::Unknown;
        }
    };
    let left = PROBE_TIMEOUT.saturating_sub(started.elapsed());
    tokio::task::spawn_blocking(move || exchange(&url, stream, left))
        .await
        .unwrap_or(Reachability::Unknown)
}

/// What a failed dial means for reachability.
fn dial_failure(e: &EgressError) -> Reachability {
    tracing::debug!(error = %e, "api probe could not connect");
    match e {
        EgressError::Timeout { .. } => Reachability::ProbablyUnreachable,
        EgressError::Connect { source, .. } if source.kind() == std::io::ErrorKind::TimedOut => {
            Reachability::ProbablyUnreachable
        }
        _ => Reachability::Unreachable,
    }
}

/// One `HEAD url` over the already-connected `stream`, within `left`.
fn exchange(url: &str, stream: TcpStream, left: Duration) -> Reachability {
    if left.is_zero() {
        return Reachability::ProbablyUnreachable;
    }
    let config = ureq::Agent::config_builder()
        .timeout_global(Some(left))
        .http_status_as_error(false)
        .max_redirects(0)
        // The connection is ours: no proxy from ureq's environment.
        .proxy(None)
        .max_idle_connections(0)
        .build();
    let connector = OneConnection(Mutex::new(Some(stream))).chain(RustlsConnector::default());
    let agent = ureq::Agent::with_parts(config, connector, NoResolve);
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

/// ureq's resolver, made a no-op: the connection was dialed (and its
/// addresses vetted) by the egress dialer before ureq runs. The one
/// placeholder address it returns is never used.
#[derive(Debug)]
struct NoResolve;

impl Resolver for NoResolve {
    fn resolve(
        &self,
        _uri: &ureq::http::Uri,
        _config: &ureq::config::Config,
        _timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let mut addrs = self.empty();
        addrs.push(std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
        Ok(addrs)
    }
}

/// A connector that hands ureq the one connection the dialer opened.
#[derive(Debug)]
struct OneConnection(Mutex<Option<TcpStream>>);

impl Connector<()> for OneConnection {
    type Out = Dialed;

    fn connect(
        &self,
        details: &ConnectionDetails,
        _chained: Option<()>,
    ) -> Result<Option<Dialed>, ureq::Error> {
        let taken = self.0.locked().take();
        let stream = taken.ok_or(ureq::Error::ConnectionFailed)?;
        let config = details.config;
        Ok(Some(Dialed {
            stream,
            buffers: LazyBuffers::new(config.input_buffer_size(), config.output_buffer_size()),
            open: true,
        }))
    }
}

/// A blocking TCP stream as a ureq transport; each read or write is bounded
/// by the time ureq has left.
#[derive(Debug)]
struct Dialed {
    stream: TcpStream,
    buffers: LazyBuffers,
    open: bool,
}

impl Dialed {
    /// An I/O error as ureq sees it: a socket timeout is ureq's timeout.
    fn failed(&mut self, e: std::io::Error, timeout: &NextTimeout) -> ureq::Error {
        self.open = false;
        match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
                ureq::Error::Timeout(timeout.reason)
            }
            _ => ureq::Error::Io(e),
        }
    }
}

/// The socket timeout for `timeout` (`None`: no deadline).
fn socket_timeout(timeout: &NextTimeout) -> Option<Duration> {
    timeout.not_zero().map(|d| *d)
}

impl Transport for Dialed {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        let timeout = timeout.for_write();
        if let Err(e) = self.stream.set_write_timeout(socket_timeout(&timeout)) {
            return Err(self.failed(e, &timeout));
        }
        let result = {
            let out = &self.buffers.output()[..amount];
            self.stream.write_all(out)
        };
        result.map_err(|e| self.failed(e, &timeout))
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        let timeout = timeout.for_read();
        if let Err(e) = self.stream.set_read_timeout(socket_timeout(&timeout)) {
            return Err(self.failed(e, &timeout));
        }
        let read = loop {
            let buf = self.buffers.input_append_buf();
            match self.stream.read(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        let n = read.map_err(|e| self.failed(e, &timeout))?;
        if n == 0 {
            self.open = false;
        }
        self.buffers.input_appended(n);
        Ok(n > 0)
    }

    fn is_open(&mut self) -> bool {
        self.open
    }
}

/// Runs until `stop` fires: emits the first result and every change.
pub async fn monitor(
    url: Option<String>,
    egress: EgressProxy,
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
            r = probe(url.clone(), &egress) => r,
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
    use crate::egress::{AddressGuard, EgressDialer, NoProxy, ProxyConfig, UpstreamProxy};
    use std::net::{IpAddr, Ipv4Addr};

    /// A proxy whose dialer may reach host loopback (tests only).
    fn loopback_proxy() -> EgressProxy {
        let guard =
            AddressGuard::allowing_networks_for_tests(&[(IpAddr::V4(Ipv4Addr::LOCALHOST), 8)]);
        EgressProxy::new(
            EgressDialer::new(guard, None, NoProxy::default()),
            ProxyConfig::default(),
        )
    }

    /// Reads a request head (up to the blank line) from `s`.
    fn read_head(s: &mut std::net::TcpStream) -> String {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match s.read(&mut byte) {
                Ok(1) => head.push(byte[0]),
                _ => break,
            }
        }
        String::from_utf8_lossy(&head).into_owned()
    }

    #[test]
    fn targets_of_urls() {
        let t = |u: &str| target_of(u).ok();
        let at = |h: &str, p| {
            Some(Target {
                host: h.into(),
                port: p,
            })
        };
        assert_eq!(t("https://api.example.com/v1"), at("api.example.com", 443));
        assert_eq!(t("http://api.example.com"), at("api.example.com", 80));
        assert_eq!(t("http://10.0.0.1:8080/"), at("10.0.0.1", 8080));
        assert_eq!(t("https://[fd00::1]:8443/"), at("[fd00::1]", 8443));
        for bad in [
            "not a url",
            "ftp://example.com/",
            "example.com",
            "http:///x",
        ] {
            assert_eq!(t(bad), None, "{bad}");
        }
    }

    #[tokio::test]
    async fn any_http_answer_is_reachable_and_refused_is_unreachable() {
        let proxy = loopback_proxy();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let head = read_head(&mut s);
            s.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
            head
        });
        assert_eq!(
            probe(format!("http://{addr}/v1/ping"), &proxy).await,
            Reachability::Reachable
        );
        let head = server.join().unwrap();
        assert!(head.starts_with("HEAD /v1/ping HTTP/1.1\r\n"), "{head}");
        // Nothing listens on the port now.
        assert_eq!(
            probe(format!("http://{addr}/"), &proxy).await,
            Reachability::Unreachable
        );
        assert_eq!(
            probe("not a url".into(), &proxy).await,
            Reachability::Unknown
        );
    }

    #[tokio::test]
    async fn a_silent_server_is_probably_unreachable() {
        let proxy = loopback_proxy();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        // Accepts (the kernel does) but never answers.
        let started = Instant::now();
        assert_eq!(
            probe(format!("http://{addr}/"), &proxy).await,
            Reachability::ProbablyUnreachable
        );
        assert!(started.elapsed() < PROBE_TIMEOUT + Duration::from_secs(2));
        drop(listener);
    }

    #[tokio::test]
    async fn the_probe_goes_through_the_dialers_upstream_proxy() {
        // The name resolves nowhere (`.invalid`), so only the dialer's
        // upstream proxy can reach it: a probe that dialed on its own would
        // say unreachable.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let upstream = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let connect = read_head(&mut s);
            s.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .unwrap();
            let request = read_head(&mut s);
            s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").unwrap();
            (connect, request)
        });
        let up = UpstreamProxy::parse(&format!("http://127.0.0.1:{port}")).unwrap();
        let proxy = EgressProxy::new(
            EgressDialer::new(AddressGuard::new(), Some(up), NoProxy::default()),
            ProxyConfig::default(),
        );
        assert_eq!(
            probe("http://api.probe-test.invalid/health".into(), &proxy).await,
            Reachability::Reachable
        );
        let (connect, request) = upstream.join().unwrap();
        assert!(
            connect.starts_with("CONNECT api.probe-test.invalid:80 HTTP/1.1\r\n"),
            "{connect}"
        );
        assert!(
            request.starts_with("HEAD /health HTTP/1.1\r\n"),
            "{request}"
        );
    }

    #[tokio::test]
    async fn host_loopback_is_refused_by_the_guard_and_never_contacted() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        // The production guard, as sessions get it.
        let proxy = EgressProxy::new(EgressDialer::direct(), ProxyConfig::default());
        for url in [
            format!("http://{addr}/"),
            format!("http://localhost:{}/", addr.port()),
        ] {
            assert_eq!(
                probe(url.clone(), &proxy).await,
                Reachability::Unreachable,
                "{url}"
            );
        }
        let err = listener.accept().unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock, "contacted");
    }

    #[tokio::test]
    async fn monitor_reports_the_first_result_and_stops_when_told() {
        let text = |f: Arc<Vec<u8>>| String::from_utf8_lossy(&f[4..]).into_owned();
        // No URL: one `unknown`, then the monitor ends by itself.
        let hub = Arc::new(EventHub::default());
        let mut sub = hub.subscribe();
        let (_stop_tx, stop) = tokio::sync::watch::channel(false);
        monitor(None, loopback_proxy(), hub.clone(), stop).await;
        let first = text(sub.rx.recv().await.unwrap());
        assert!(
            first.contains("apiReachability") && first.contains("unknown"),
            "{first}"
        );

        // A URL answered through the dialer: `reachable`; stop ends it.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            read_head(&mut s);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
        });
        let hub = Arc::new(EventHub::default());
        let mut sub = hub.subscribe();
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(monitor(
            Some(format!("http://{addr}/")),
            loopback_proxy(),
            hub.clone(),
            stop,
        ));
        let first = text(sub.rx.recv().await.unwrap());
        assert!(first.contains("\"reachable\""), "{first}");
        stop_tx.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the monitor ends when told")
            .unwrap();
    }
}
