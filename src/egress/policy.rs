//! A spawn's network policy, built from its `allowedDomains`.
//!
//! Semantics (those of Anthropic's sandbox-runtime, so lists written for it
//! mean the same here):
//! - `None` (absent or null list): no name restriction; the address guard
//!   still applies. `Some([])`: nothing is reachable.
//! - `example.com`: that name exactly, case-insensitive, trailing dot ignored.
//! - `*.example.com`: any subdomain at any depth, never `example.com` itself.
//!   `*`, `*.com` (a wildcard over a single label) and `*` anywhere else are
//!   refused as entries.
//! - `:port` suffix restricts the entry to that port; without it any port.
//! - IP literals (`10.0.0.5`, `[fd00::5]`) match only that literal; a wildcard
//!   never matches an IP literal, and a name never matches its addresses.
//!
//! Limits: the policy decides on the name a client asked for; what that name
//! resolves to is the address guard's business ([`super::guard`]).

use std::net::IpAddr;

use super::host::{normalise_name, parse_port, Host};
use super::EgressError;

/// What an entry matches, before its port.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    /// One normalised name.
    Exact(String),
    /// Names ending in `.` + this suffix (the suffix has at least two labels).
    Subdomains(String),
    /// One literal address.
    Ip(IpAddr),
}

/// One parsed `allowedDomains` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    target: Target,
    /// `None` = any port.
    port: Option<u16>,
}

impl Pattern {
    /// Parses one entry; an error says why it can never match.
    pub fn parse(entry: &str) -> Result<Pattern, EgressError> {
        let bad = || EgressError::BadPattern(entry.to_owned());
        let text = entry.trim();
        // Split an optional port off, minding IPv6 brackets.
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let close = rest.find(']').ok_or_else(bad)?;
            let after = &rest[close + 1..];
            let port = match after {
                "" => None,
                p => Some(parse_port(p.strip_prefix(':').ok_or_else(bad)?).ok_or_else(bad)?),
            };
            let ip: std::net::Ipv6Addr = rest[..close].parse().map_err(|_| bad())?;
            return Ok(Pattern {
                target: Target::Ip(IpAddr::V6(ip)),
                port,
            });
        } else {
            match text.rsplit_once(':') {
                Some((h, p)) if !h.contains(':') => (h, Some(parse_port(p).ok_or_else(bad)?)),
                Some(_) => return Err(bad()), // unbracketed IPv6
                None => (text, None),
            }
        };
        let target = if let Some(base) = host.strip_prefix("*.") {
            let base = normalise_name(base).ok_or_else(bad)?;
            if !base.contains('.') {
                return Err(bad()); // `*.com`: a whole top-level domain
            }
            Target::Subdomains(base)
        } else {
            match Host::parse_unbracketed(host).map_err(|_| bad())? {
                Host::Ip(ip) => Target::Ip(ip),
                Host::Name(n) => Target::Exact(n),
            }
        };
        Ok(Pattern { target, port })
    }

    /// Whether this entry admits `host:port`.
    pub fn matches(&self, host: &Host, port: u16) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match (&self.target, host) {
            (Target::Exact(want), Host::Name(name)) => want == name,
            (Target::Subdomains(base), Host::Name(name)) => name
                .strip_suffix(base.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            (Target::Ip(want), Host::Ip(ip)) => want == ip,
            _ => false,
        }
    }
}

/// The destinations a session may ask for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Policy {
    /// No name restriction (the guard still applies).
    Unrestricted,
    /// Only these entries (empty = nothing).
    Allow(Vec<Pattern>),
}

impl Policy {
    /// Builds a policy from a spawn's `allowedDomains`, skipping (and logging)
    /// entries that can never match, so one odd entry does not fail a spawn;
    /// skipping only ever narrows the policy.
    pub fn from_allowed_domains(list: Option<&[String]>) -> Policy {
        let Some(list) = list else {
            return Policy::Unrestricted;
        };
        let mut patterns = Vec::with_capacity(list.len());
        for entry in list {
            match Pattern::parse(entry) {
                Ok(p) => patterns.push(p),
                Err(e) => tracing::warn!(error = %e, "allowedDomains entry ignored"),
            }
        }
        Policy::Allow(patterns)
    }

    /// Like [`Policy::from_allowed_domains`], but the first bad entry is an
    /// error.
    pub fn try_from_allowed_domains(list: Option<&[String]>) -> Result<Policy, EgressError> {
        match list {
            None => Ok(Policy::Unrestricted),
            Some(list) => list
                .iter()
                .map(|e| Pattern::parse(e))
                .collect::<Result<Vec<_>, _>>()
                .map(Policy::Allow),
        }
    }

    /// Whether the policy admits the name or literal `host` on `port`.
    pub fn allows(&self, host: &Host, port: u16) -> bool {
        match self {
            Policy::Unrestricted => true,
            Policy::Allow(patterns) => patterns.iter().any(|p| p.matches(host, port)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(entries: &[&str]) -> Policy {
        let v: Vec<String> = entries.iter().map(|s| s.to_string()).collect();
        Policy::try_from_allowed_domains(Some(&v)).expect("valid entries")
    }

    fn allows(p: &Policy, host: &str, port: u16) -> bool {
        p.allows(&Host::parse(host).expect("valid host"), port)
    }

    #[test]
    fn matcher_table() {
        let p = policy(&[
            "api.example.com",
            "*.pkg.example.org",
            "Mixed.Case.Example.",
            "only443.example.net:443",
            "*.ports.example:8443",
            "10.9.8.7",
            "[fd00::7]",
            "[fd00::8]:22",
            "192.0.2.9:80",
        ]);
        let table: &[(&str, u16, bool)] = &[
            // exact, case, trailing dot
            ("api.example.com", 443, true),
            ("API.Example.COM", 443, true),
            ("api.example.com.", 443, true),
            ("api.example.com", 1, true),
            ("x.api.example.com", 443, false),
            ("example.com", 443, false),
            ("api.example.co", 443, false),
            ("mixed.case.example", 80, true),
            // wildcard depth and apex
            ("a.pkg.example.org", 443, true),
            ("a.b.c.pkg.example.org", 443, true),
            ("A.PKG.example.org.", 443, true),
            ("pkg.example.org", 443, false),
            ("xpkg.example.org", 443, false),
            ("a.pkg.example.org.evil.com", 443, false),
            // ports
            ("only443.example.net", 443, true),
            ("only443.example.net", 80, false),
            ("a.ports.example", 8443, true),
            ("a.ports.example", 443, false),
            // IP literals
            ("10.9.8.7", 443, true),
            ("10.9.8.6", 443, false),
            ("[fd00::7]", 443, true),
            ("[fd00:0:0::7]", 1, true),
            ("[fd00::8]", 22, true),
            ("[fd00::8]", 23, false),
            ("192.0.2.9", 80, true),
            ("192.0.2.9", 443, false),
        ];
        for (host, port, want) in table {
            assert_eq!(allows(&p, host, *port), *want, "{host}:{port}");
        }
    }

    #[test]
    fn wildcard_never_matches_ip_and_name_never_matches_ip() {
        let p = policy(&["*.example.com", "example.com", "localhost"]);
        assert!(!allows(&p, "127.0.0.1", 80));
        assert!(!allows(&p, "[::1]", 80));
        assert!(!allows(&p, "93.184.216.34", 80));
        // A wildcard whose base is numeric is no pattern at all.
        assert!(Pattern::parse("*.2.3.4").is_err());
    }

    #[test]
    fn empty_and_null() {
        let none = Policy::from_allowed_domains(None);
        assert!(allows(&none, "anything.example", 1));
        assert!(allows(&none, "10.0.0.1", 1));
        let empty = Policy::from_allowed_domains(Some(&[]));
        assert!(!allows(&empty, "anything.example", 443));
        assert!(!allows(&empty, "10.0.0.1", 443));
    }

    #[test]
    fn bad_entries_are_refused_or_skipped() {
        for bad in [
            "*",
            "*.com",
            "*.",
            "a.*.com",
            "*a.com",
            "**.a.com",
            "a.com:0",
            "a.com:70000",
            "a.com:",
            "fd00::1",
            "[fd00::1",
            "[fd00::1]x",
            "[1.2.3.4]",
            "",
            "a b.com",
            "2130706433",
        ] {
            assert!(Pattern::parse(bad).is_err(), "{bad:?} must be refused");
        }
        let list = vec!["*".to_string(), "ok.example.com".to_string()];
        let p = Policy::from_allowed_domains(Some(&list));
        assert!(allows(&p, "ok.example.com", 443));
        assert!(!allows(&p, "other.example.com", 443));
        assert!(Policy::try_from_allowed_domains(Some(&list)).is_err());
    }
}
