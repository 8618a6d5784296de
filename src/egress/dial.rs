//! The egress dialer: the one place that opens connections for sessions
//! (CONNECT tunnels, plain HTTP, SOCKS5, and later `apiProbeURL` probes).
//!
//! Order of decisions: the session's policy on the name or literal asked
//! for; the address guard on a literal; then either the helper's own
//! upstream proxy (`https_proxy`/`HTTPS_PROXY`, unless `no_proxy`/`NO_PROXY`
//! matches), or a direct connection: the name is resolved once through the
//! system resolver (`getaddrinfo`: `/etc/hosts`, then DNS), every address is
//! checked by the guard, and only addresses that passed are dialed, in the
//! resolver's order.
//!
//! Limits: through an upstream proxy the final address is the upstream's
//! choice, so only the name policy applies there; the upstream proxy itself
//! is trusted configuration and is not subject to the guard (it often
//! listens on loopback); only `http://` upstreams are supported (an
//! `https://` one is ignored with a warning).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use base64::Engine as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::guard::{AddressGuard, Forbidden};
use super::host::{parse_port, Host};
use super::policy::Policy;
use super::EgressError;

/// Deadline for resolving a name.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Deadline for one TCP connect (per address).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Deadline for the upstream proxy's answer to our CONNECT.
pub const UPSTREAM_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);

/// Largest upstream CONNECT response head we read.
const MAX_UPSTREAM_HEAD: usize = 16 * 1024;

/// Default port of a proxy URL without one (curl's choice).
const DEFAULT_PROXY_PORT: u16 = 1080;

/// The helper's own upstream HTTP proxy.
#[derive(Clone, PartialEq, Eq)]
pub struct UpstreamProxy {
    pub host: String,
    pub port: u16,
    /// `user:password`, already percent-decoded.
    basic_auth: Option<String>,
}

impl std::fmt::Debug for UpstreamProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamProxy")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("auth", &self.basic_auth.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl UpstreamProxy {
    /// Parses `http://[user[:password]@]host[:port][/]` (scheme optional).
    pub fn parse(url: &str) -> Result<UpstreamProxy, EgressError> {
        let bad = |why: &str| EgressError::Upstream(format!("proxy URL not usable: {why}"));
        let rest = match url.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
            Some((scheme, _)) => return Err(bad(&format!("scheme {scheme} is not supported"))),
            None => url,
        };
        let rest = rest.trim_end_matches('/');
        if rest.contains('/') {
            return Err(bad("it has a path"));
        }
        let (auth, hostport) = match rest.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, rest),
        };
        let (host, port) = if hostport.starts_with('[') {
            let close = hostport.find(']').ok_or_else(|| bad("unclosed bracket"))?;
            let port = match &hostport[close + 1..] {
                "" => DEFAULT_PROXY_PORT,
                p => p
                    .strip_prefix(':')
                    .and_then(parse_port)
                    .ok_or_else(|| bad("bad port"))?,
            };
            (hostport[1..close].to_owned(), port)
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), parse_port(p).ok_or_else(|| bad("bad port"))?),
                None => (hostport.to_owned(), DEFAULT_PROXY_PORT),
            }
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let basic_auth = auth.map(|a| match a.split_once(':') {
            Some((u, p)) => format!("{}:{}", percent_decode(u), percent_decode(p)),
            None => format!("{}:", percent_decode(a)),
        });
        Ok(UpstreamProxy {
            host,
            port,
            basic_auth,
        })
    }
}

/// `NO_PROXY` as curl reads it: `*`, names (a leading `.` or `*.` ignored;
/// a name also covers its subdomains), IP literals, CIDR blocks, each with an
/// optional `:port`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NoProxy {
    all: bool,
    entries: Vec<(NoProxyTarget, Option<u16>)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum NoProxyTarget {
    Name(String),
    Net(IpAddr, u8),
}

impl NoProxy {
    pub fn parse(list: &str) -> NoProxy {
        let mut out = NoProxy::default();
        for raw in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if raw == "*" {
                out.all = true;
                continue;
            }
            let (text, port) = split_port(raw);
            if let Some((net, len)) = text.split_once('/') {
                if let (Ok(ip), Ok(len)) = (net.parse::<IpAddr>(), len.parse::<u8>()) {
                    out.entries.push((NoProxyTarget::Net(ip, len), port));
                }
                continue;
            }
            let bare = text.trim_start_matches('[').trim_end_matches(']');
            if let Ok(ip) = bare.parse::<IpAddr>() {
                let len = if ip.is_ipv4() { 32 } else { 128 };
                out.entries.push((NoProxyTarget::Net(ip, len), port));
                continue;
            }
            let name = text.trim_start_matches("*.").trim_start_matches('.');
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            if !name.is_empty() {
                out.entries.push((NoProxyTarget::Name(name), port));
            }
        }
        out
    }

    /// Whether `host:port` bypasses the upstream proxy.
    pub fn matches(&self, host: &Host, port: u16) -> bool {
        if self.all {
            return true;
        }
        self.entries.iter().any(|(target, p)| {
            if p.is_some_and(|p| p != port) {
                return false;
            }
            match (target, host) {
                (NoProxyTarget::Name(n), Host::Name(h)) => {
                    h == n
                        || h.strip_suffix(n.as_str())
                            .is_some_and(|head| head.ends_with('.'))
                }
                (NoProxyTarget::Net(net, len), Host::Ip(ip)) => {
                    super::guard::in_network(*ip, *net, *len)
                }
                _ => false,
            }
        })
    }
}

/// Splits an optional `:port` off a NO_PROXY entry (IPv6 only when bracketed).
fn split_port(entry: &str) -> (&str, Option<u16>) {
    if let Some(close) = entry.find(']') {
        let port = entry[close + 1..].strip_prefix(':').and_then(parse_port);
        return (&entry[..=close], port);
    }
    match entry.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => match parse_port(p) {
            Some(port) => (h, Some(port)),
            None => (entry, None),
        },
        _ => (entry, None),
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
            if let Some(v) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Opens connections for sessions under their policy.
#[derive(Debug)]
pub struct EgressDialer {
    guard: AddressGuard,
    upstream: Option<UpstreamProxy>,
    no_proxy: NoProxy,
}

impl EgressDialer {
    /// A dialer with the production guard and no upstream proxy.
    pub fn direct() -> Self {
        Self::new(AddressGuard::new(), None, NoProxy::default())
    }

    /// A dialer with `guard` and an optional upstream proxy.
    pub fn new(guard: AddressGuard, upstream: Option<UpstreamProxy>, no_proxy: NoProxy) -> Self {
        EgressDialer {
            guard,
            upstream,
            no_proxy,
        }
    }

    /// The production dialer: the production guard, and the upstream proxy
    /// `https_proxy` (the helper's own `https_proxy`/`HTTPS_PROXY`, read by
    /// [`crate::cli`]; one that does not parse is logged and ignored)
    /// bypassed for `no_proxy` (`no_proxy`/`NO_PROXY`).
    pub fn with_upstream(https_proxy: Option<&str>, no_proxy: Option<&str>) -> Self {
        let upstream = https_proxy.filter(|v| !v.is_empty()).and_then(|url| {
            UpstreamProxy::parse(url)
                .inspect_err(
                    |e| tracing::warn!(error = %e, "HTTPS_PROXY ignored; dialing directly"),
                )
                .ok()
        });
        let no_proxy = NoProxy::parse(no_proxy.unwrap_or_default());
        if let Some(u) = &upstream {
            tracing::info!(host = %u.host, port = u.port, "egress goes through the upstream proxy");
        }
        Self::new(AddressGuard::new(), upstream, no_proxy)
    }

    /// The guard this dialer applies.
    pub fn guard(&self) -> &AddressGuard {
        &self.guard
    }

    /// Connects to `host:port` for a session under `policy`: policy first,
    /// then the guard, then the upstream proxy or a direct connection to a
    /// vetted address.
    pub async fn connect(
        &self,
        host: &Host,
        port: u16,
        policy: &Policy,
    ) -> Result<TcpStream, EgressError> {
        if !policy.allows(host, port) {
            return Err(EgressError::NotAllowed {
                host: host.to_string(),
                port,
            });
        }
        if let Host::Ip(ip) = host {
            self.guard
                .check(*ip)
                .map_err(|why| forbidden(host, *ip, why))?;
        }
        match &self.upstream {
            Some(up) if !self.no_proxy.matches(host, port) => {
                connect_via_upstream(up, host, port).await
            }
            _ => self.connect_direct(host, port).await,
        }
    }

    /// [`EgressDialer::connect`] for a host given as text (`example.com`,
    /// `10.0.0.1`, `[fd00::1]`), e.g. from `apiProbeURL`.
    pub async fn connect_str(
        &self,
        host: &str,
        port: u16,
        policy: &Policy,
    ) -> Result<TcpStream, EgressError> {
        let host = Host::parse(host)?;
        self.connect(&host, port, policy).await
    }

    async fn connect_direct(&self, host: &Host, port: u16) -> Result<TcpStream, EgressError> {
        let candidates: Vec<SocketAddr> = match host {
            Host::Ip(ip) => vec![SocketAddr::new(*ip, port)],
            Host::Name(name) => {
                let found = tokio::time::timeout(
                    RESOLVE_TIMEOUT,
                    tokio::net::lookup_host((name.as_str(), port)),
                )
                .await
                .map_err(|_| EgressError::Timeout {
                    host: host.to_string(),
                    port,
                })?
                .map_err(|source| EgressError::Resolve {
                    host: host.to_string(),
                    source,
                })?;
                found.collect()
            }
        };
        let mut vetted = Vec::with_capacity(candidates.len());
        let mut first_refusal = None;
        for addr in candidates {
            match self.guard.check(addr.ip()) {
                Ok(()) => vetted.push(addr),
                Err(why) => {
                    first_refusal.get_or_insert((addr.ip(), why));
                }
            }
        }
        if vetted.is_empty() {
            return Err(match first_refusal {
                Some((ip, why)) => forbidden(host, ip, why),
                None => EgressError::NoAddresses {
                    host: host.to_string(),
                },
            });
        }
        let mut last = None;
        for addr in vetted {
            match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
                Ok(Ok(s)) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Ok(Err(e)) => last = Some(e),
                Err(_) => last = Some(std::io::Error::from(std::io::ErrorKind::TimedOut)),
            }
        }
        Err(EgressError::Connect {
            host: host.to_string(),
            port,
            source: last.unwrap_or_else(|| std::io::Error::other("no address to try")),
        })
    }
}

fn forbidden(host: &Host, ip: IpAddr, why: Forbidden) -> EgressError {
    EgressError::Forbidden {
        host: host.to_string(),
        addr: ip,
        why,
    }
}

/// Opens a tunnel to `host:port` through the upstream proxy.
async fn connect_via_upstream(
    up: &UpstreamProxy,
    host: &Host,
    port: u16,
) -> Result<TcpStream, EgressError> {
    let fail = |why: String| EgressError::Upstream(why);
    let work = async {
        let mut s = TcpStream::connect((up.host.as_str(), up.port))
            .await
            .map_err(|e| {
                fail(format!(
                    "cannot reach upstream proxy {}:{}: {e}",
                    up.host, up.port
                ))
            })?;
        let _ = s.set_nodelay(true);
        let target = format!("{host}:{port}");
        let mut head = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
        if let Some(auth) = &up.basic_auth {
            let enc = base64::engine::general_purpose::STANDARD.encode(auth);
            head.push_str(&format!("Proxy-Authorization: Basic {enc}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes())
            .await
            .map_err(|e| fail(format!("upstream proxy write: {e}")))?;
        // Read the response head a byte at a time so no tunnel byte is eaten.
        let mut buf = Vec::with_capacity(256);
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            if buf.len() >= MAX_UPSTREAM_HEAD {
                return Err(fail("upstream proxy answer too long".into()));
            }
            let n = s
                .read(&mut byte)
                .await
                .map_err(|e| fail(format!("upstream proxy read: {e}")))?;
            if n == 0 {
                return Err(fail("upstream proxy closed the connection".into()));
            }
            buf.push(byte[0]);
        }
        let status_line = buf.split(|&b| b == b'\r').next().unwrap_or_default();
        let status_line = String::from_utf8_lossy(status_line);
        let code = status_line.split_whitespace().nth(1).unwrap_or("");
        if status_line.starts_with("HTTP/1.") && code == "200" {
            Ok(s)
        } else {
            Err(fail(format!(
                "upstream proxy refused CONNECT {target}: {}",
                status_line.chars().take(80).collect::<String>()
            )))
        }
    };
    tokio::time::timeout(UPSTREAM_HANDSHAKE_TIMEOUT, work)
        .await
        .map_err(|_| fail("upstream proxy timed out".into()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(s: &str) -> Host {
        Host::parse(s).unwrap()
    }

    #[test]
    fn upstream_urls() {
        let u = UpstreamProxy::parse("http://user%40corp:p%3Ass@proxy.corp:8080/").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("proxy.corp", 8080));
        assert_eq!(u.basic_auth.as_deref(), Some("user@corp:p:ss"));
        assert!(!format!("{u:?}").contains("p:ss"));
        let u = UpstreamProxy::parse("proxy.corp").unwrap();
        assert_eq!((u.port, u.basic_auth), (DEFAULT_PROXY_PORT, None));
        let u = UpstreamProxy::parse("http://[fd00::1]:3128").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("fd00::1", 3128));
        assert!(UpstreamProxy::parse("https://proxy.corp:443").is_err());
        assert!(UpstreamProxy::parse("socks5://proxy.corp:1080").is_err());
        assert!(UpstreamProxy::parse("http://proxy.corp:0").is_err());
        assert!(UpstreamProxy::parse("http://proxy.corp/path").is_err());
        assert!(UpstreamProxy::parse("http://").is_err());
    }

    #[test]
    fn no_proxy_matching() {
        let np = NoProxy::parse("localhost, .corp.example,*.int.example, 10.0.0.0/8,192.0.2.7,[fd00::9],only.example:8080");
        assert!(np.matches(&h("localhost"), 80));
        assert!(np.matches(&h("corp.example"), 443));
        assert!(np.matches(&h("a.b.corp.example"), 443));
        assert!(!np.matches(&h("xcorp.example"), 443));
        assert!(np.matches(&h("x.int.example"), 443));
        assert!(np.matches(&h("10.20.30.40"), 443));
        assert!(!np.matches(&h("11.0.0.1"), 443));
        assert!(np.matches(&h("192.0.2.7"), 1));
        assert!(np.matches(&h("[fd00::9]"), 1));
        assert!(np.matches(&h("only.example"), 8080));
        assert!(!np.matches(&h("only.example"), 443));
        assert!(!np.matches(&h("api.example.com"), 443));
        assert!(NoProxy::parse("*").matches(&h("anything.example"), 1));
        assert!(!NoProxy::parse("").matches(&h("anything.example"), 1));
    }

    #[tokio::test]
    async fn policy_and_guard_refuse_before_any_dial() {
        let d = EgressDialer::direct();
        let empty = Policy::Allow(Vec::new());
        let err = d.connect(&h("example.com"), 443, &empty).await.unwrap_err();
        assert!(matches!(err, EgressError::NotAllowed { .. }), "{err}");
        for lit in [
            "127.0.0.1",
            "[::1]",
            "169.254.169.254",
            "[::ffff:127.0.0.1]",
            "0.0.0.0",
        ] {
            let err = d
                .connect(&h(lit), 80, &Policy::Unrestricted)
                .await
                .unwrap_err();
            assert!(matches!(err, EgressError::Forbidden { .. }), "{lit}: {err}");
        }
        // `localhost` resolves (via /etc/hosts) to loopback only: refused
        // on the resolved address.
        let err = d
            .connect(&h("localhost"), 80, &Policy::Unrestricted)
            .await
            .unwrap_err();
        assert!(matches!(err, EgressError::Forbidden { .. }), "{err}");
    }

    #[tokio::test]
    async fn upstream_proxy_gets_connect_with_auth() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let mut got = Vec::new();
            while !got.ends_with(b"\r\n\r\n") {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0);
                got.extend_from_slice(&buf[..n]);
            }
            s.write_all(b"HTTP/1.1 200 Connection established\r\n\r\ntunnel-bytes")
                .await
                .unwrap();
            String::from_utf8(got).unwrap()
        });
        let up = UpstreamProxy::parse(&format!("http://u:pw@127.0.0.1:{port}")).unwrap();
        let d = EgressDialer::new(AddressGuard::new(), Some(up), NoProxy::default());
        let policy = Policy::try_from_allowed_domains(Some(&["api.example.com".into()])).unwrap();
        // Refused by name before the upstream is contacted.
        let err = d
            .connect(&h("other.example.com"), 443, &policy)
            .await
            .unwrap_err();
        assert!(matches!(err, EgressError::NotAllowed { .. }));
        let mut s = d
            .connect(&h("api.example.com"), 443, &policy)
            .await
            .unwrap();
        let mut first = [0u8; 12];
        s.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"tunnel-bytes");
        let head = server.await.unwrap();
        assert!(
            head.starts_with("CONNECT api.example.com:443 HTTP/1.1\r\n"),
            "{head}"
        );
        let auth = base64::engine::general_purpose::STANDARD.encode("u:pw");
        assert!(
            head.contains(&format!("Proxy-Authorization: Basic {auth}\r\n")),
            "{head}"
        );
    }
}
