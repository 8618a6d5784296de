//! Destination names and authorities as a client asks for them: the
//! `host:port` of an HTTP CONNECT, the authority of an absolute-form URI, a
//! SOCKS5 address.
//!
//! Parsing is strict on purpose: a destination is either a DNS name made of
//! letters, digits, `-` and `_` labels, a dotted-quad IPv4 literal, or a
//! bracketed IPv6 literal. Userinfo (`a.com:443@b.com`), empty or zero ports,
//! and names that the system resolver would read as an IPv4 number in another
//! notation (`2130706433`, `0x7f.1`) are refused, so that the policy and the
//! resolver always agree on what the destination is.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::EgressError;

/// Longest DNS name accepted (RFC 1035: 253 characters without the root dot).
const MAX_NAME_LEN: usize = 253;

/// Longest DNS label accepted (RFC 1035).
const MAX_LABEL_LEN: usize = 63;

/// A destination host: a normalised DNS name or an IP literal.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Host {
    /// Lower-case, without a trailing dot.
    Name(String),
    /// An IPv4 or (bracketed in text) IPv6 literal.
    Ip(IpAddr),
}

impl Host {
    /// Parses a host as it appears in an authority: a name, an IPv4 literal,
    /// or a bracketed IPv6 literal (`[::1]`).
    pub fn parse(text: &str) -> Result<Host, EgressError> {
        if let Some(inner) = text.strip_prefix('[') {
            let inner = inner
                .strip_suffix(']')
                .ok_or_else(|| EgressError::BadHost(text.to_owned()))?;
            return inner
                .parse::<Ipv6Addr>()
                .map(|a| Host::Ip(IpAddr::V6(a)))
                .map_err(|_| EgressError::BadHost(text.to_owned()));
        }
        Host::parse_unbracketed(text)
    }

    /// Parses a host without IPv6 brackets (SOCKS5 domain names, and the
    /// inside of brackets). An IPv6 literal here is refused: an authority
    /// must bracket it.
    pub fn parse_unbracketed(text: &str) -> Result<Host, EgressError> {
        if let Ok(v4) = text.parse::<Ipv4Addr>() {
            return Ok(Host::Ip(IpAddr::V4(v4)));
        }
        normalise_name(text)
            .map(Host::Name)
            .ok_or_else(|| EgressError::BadHost(text.to_owned()))
    }

    /// The name, if this is one.
    pub fn name(&self) -> Option<&str> {
        match self {
            Host::Name(n) => Some(n),
            Host::Ip(_) => None,
        }
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Ip(IpAddr::V4(a)) => write!(f, "{a}"),
            Host::Ip(IpAddr::V6(a)) => write!(f, "[{a}]"),
        }
    }
}

/// Lower-cases `text`, drops one trailing dot, and checks it is a DNS name
/// the policy can reason about. `None` when it is not.
pub(crate) fn normalise_name(text: &str) -> Option<String> {
    let name = text.strip_suffix('.').unwrap_or(text).to_ascii_lowercase();
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return None;
    }
    let labels: Vec<&str> = name.split('.').collect();
    for label in &labels {
        let ok = !label.is_empty()
            && label.len() <= MAX_LABEL_LEN
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return None;
        }
    }
    // getaddrinfo reads inet_aton forms ("2130706433", "127.1", "0x7f.1") as
    // addresses: such a "name" would dodge the IP-literal rule.
    let last = labels.last()?;
    let numeric = last.bytes().all(|b| b.is_ascii_digit())
        || (last.starts_with("0x") && last[2..].bytes().all(|b| b.is_ascii_hexdigit()));
    if numeric {
        return None;
    }
    Some(name)
}

/// Parses a CONNECT target or any `host:port` authority: the port is
/// required (1..=65535), IPv6 literals are bracketed, userinfo is refused.
pub fn parse_authority(text: &str) -> Result<(Host, u16), EgressError> {
    let bad = || EgressError::BadAuthority(text.to_owned());
    if text.contains('@') || text.contains('/') || text.contains('?') || text.contains('#') {
        return Err(bad());
    }
    let (host, port) = if text.starts_with('[') {
        let close = text.find(']').ok_or_else(bad)?;
        let port = text[close + 1..].strip_prefix(':').ok_or_else(bad)?;
        (&text[..=close], port)
    } else {
        let (h, p) = text.rsplit_once(':').ok_or_else(bad)?;
        if h.contains(':') {
            return Err(bad()); // an unbracketed IPv6 literal
        }
        (h, p)
    };
    let port = parse_port(port).ok_or_else(bad)?;
    let host = Host::parse(host).map_err(|_| bad())?;
    Ok((host, port))
}

/// A decimal port in 1..=65535 (no sign, no leading `+`, at most 5 digits).
pub(crate) fn parse_port(text: &str) -> Option<u16> {
    if text.is_empty() || text.len() > 5 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    match text.parse::<u16>() {
        Ok(0) | Err(_) => None,
        Ok(p) => Some(p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(n: &str) -> Host {
        Host::Name(n.to_owned())
    }

    #[test]
    fn authority_forms() {
        assert_eq!(parse_authority("a.com:443").unwrap(), (name("a.com"), 443));
        assert_eq!(
            parse_authority("A.CoM.:8443").unwrap(),
            (name("a.com"), 8443)
        );
        assert_eq!(
            parse_authority("10.1.2.3:80").unwrap(),
            (Host::Ip("10.1.2.3".parse().unwrap()), 80)
        );
        assert_eq!(
            parse_authority("[fd00::2]:443").unwrap(),
            (Host::Ip("fd00::2".parse().unwrap()), 443)
        );
        assert_eq!(
            parse_authority("[::ffff:127.0.0.1]:1").unwrap(),
            (Host::Ip("::ffff:127.0.0.1".parse().unwrap()), 1)
        );
    }

    #[test]
    fn authority_refusals() {
        for bad in [
            "a.com:443@b.com",
            "a.com:443@b.com:443",
            "user@a.com:443",
            "a.com",
            "a.com:",
            "a.com:0",
            "a.com:65536",
            "a.com:99999999999",
            "a.com:+443",
            "a.com:-1",
            "a.com:44 3",
            "fd00::2:443",
            "[fd00::2]",
            "[fd00::2]443",
            "[fd00::2:443",
            "[not-v6]:443",
            "[10.0.0.1]:443",
            ":443",
            "",
            "a..com:443",
            "-a.com:443",
            "a.com/x:443",
            "a com:443",
            "2130706433:80",
            "127.1:80",
            "0x7f.0.0.1:80",
            "0x7f000001:80",
            "\u{e9}.com:443",
        ] {
            assert!(parse_authority(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn names_are_normalised() {
        assert_eq!(Host::parse("Example.COM.").unwrap(), name("example.com"));
        assert_eq!(Host::parse("a_b.example").unwrap(), name("a_b.example"));
        assert!(Host::parse(".").is_err());
        assert!(Host::parse(&"a".repeat(64)).is_err());
        assert!(Host::parse(&format!("{}.com", "a.".repeat(130))).is_err());
        assert_eq!(Host::parse("1.2.3.4").unwrap().to_string(), "1.2.3.4");
        assert_eq!(Host::parse("[::1]").unwrap().to_string(), "[::1]");
        assert!(Host::parse_unbracketed("::1").is_err());
    }
}
