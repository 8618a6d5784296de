//! The registry of live spawns' egress credentials: which session leader
//! (a spawned process, see `agent::process`) may use which proxy
//! credential for the connections the agent captures on its behalf.
//!
//! The agent's process supervisor registers each spawn's pid with its
//! `SpawnSpec::egress_proxy` URL right after the fork and removes it when
//! the process is reaped ([`Spawns::register`], [`Spawns::unregister`]).
//! The captured-flow handler looks a session id up ([`Spawns::get`]) after
//! [`super::attrib`] found which process owns a connection.
//!
//! The URL (`http://<user>:<credential>@127.0.0.1:3128`) is parsed once
//! into a [`ProxyCredential`]: the userinfo's two halves, percent-decoded,
//! which the SOCKS5 client sends as RFC 1929 username and password. Neither
//! the URL nor the credential ever reaches a log or `Debug` output.
//!
//! Limits: one credential per pid; a pid registered again replaces the old
//! entry (the old one's [`Ticket`] then no longer removes anything).

use crate::sync::MutexExt;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

/// Longest username or password RFC 1929 can carry (one length byte).
pub const MAX_FIELD_BYTES: usize = 255;

/// Errors parsing a spawn's proxy URL. The messages never contain the URL.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpawnsError {
    #[error("the proxy URL is not of the form scheme://user:password@host:port")]
    Malformed,
    #[error("the proxy URL has no username and password")]
    NoUserinfo,
    #[error("the proxy URL's userinfo has an invalid percent escape")]
    BadEscape,
    #[error("the proxy URL's username or password is longer than {MAX_FIELD_BYTES} bytes")]
    TooLong,
}

/// A spawn's proxy credential: RFC 1929 username and password (bytes, as
/// percent-decoding may produce any). `Debug` shows neither.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyCredential {
    pub username: Vec<u8>,
    pub password: Vec<u8>,
}

impl fmt::Debug for ProxyCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ProxyCredential(<redacted>)")
    }
}

impl ProxyCredential {
    /// Parses `scheme://user:password@host[:port][/...]`: the userinfo is
    /// everything before the last `@` of the authority; both halves are
    /// percent-decoded and must fit RFC 1929's one-byte lengths.
    pub fn from_url(url: &str) -> Result<Self, SpawnsError> {
        let (_, rest) = url.split_once("://").ok_or(SpawnsError::Malformed)?;
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        let (userinfo, host) = authority.rsplit_once('@').ok_or(SpawnsError::NoUserinfo)?;
        if host.is_empty() {
            return Err(SpawnsError::Malformed);
        }
        let (user, pass) = userinfo.split_once(':').ok_or(SpawnsError::NoUserinfo)?;
        let username = percent_decode(user)?;
        let password = percent_decode(pass)?;
        if username.is_empty() && password.is_empty() {
            return Err(SpawnsError::NoUserinfo);
        }
        if username.len() > MAX_FIELD_BYTES || password.len() > MAX_FIELD_BYTES {
            return Err(SpawnsError::TooLong);
        }
        Ok(Self { username, password })
    }
}

/// Decodes `%XX` escapes (either case); every other byte stands for itself.
pub fn percent_decode(s: &str) -> Result<Vec<u8>, SpawnsError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).ok_or(SpawnsError::BadEscape)?;
            let text = std::str::from_utf8(hex).map_err(|_| SpawnsError::BadEscape)?;
            if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(SpawnsError::BadEscape);
            }
            out.push(u8::from_str_radix(text, 16).map_err(|_| SpawnsError::BadEscape)?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

/// Proof of one registration: only it removes that entry again, so a late
/// unregister of an exited process cannot remove a new spawn that reused
/// its pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pid: i32,
    serial: u64,
}

#[derive(Default)]
struct Table {
    by_pid: HashMap<i32, (u64, Arc<ProxyCredential>)>,
    next_serial: u64,
}

/// The live spawns' credentials by pid; cheap to clone, shared between the
/// process supervisor and the egress handlers.
#[derive(Clone, Default)]
pub struct Spawns {
    table: Arc<Mutex<Table>>,
}

impl fmt::Debug for Spawns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Spawns")
            .field("live", &self.len())
            .finish_non_exhaustive()
    }
}

impl Spawns {
    pub fn new() -> Self {
        Self::default()
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.locked()
    }

    /// Registers `pid` with the credential of its proxy URL. `None` (the
    /// host gave the spawn no proxy) registers nothing; a URL that does not
    /// parse is logged (without the URL) and registers nothing, so that
    /// spawn's captured connections are refused.
    pub fn register(&self, pid: i32, url: Option<&str>) -> Option<Ticket> {
        let url = url?;
        let cred = match ProxyCredential::from_url(url) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(pid, error = %e, "spawn's proxy URL unusable; its captured connections will be refused");
                return None;
            }
        };
        let mut t = self.table();
        t.next_serial += 1;
        let serial = t.next_serial;
        t.by_pid.insert(pid, (serial, Arc::new(cred)));
        Some(Ticket { pid, serial })
    }

    /// Removes the entry `ticket` registered, if it is still the current
    /// one for its pid.
    pub fn unregister(&self, ticket: Ticket) {
        let mut t = self.table();
        if t.by_pid
            .get(&ticket.pid)
            .is_some_and(|(serial, _)| *serial == ticket.serial)
        {
            t.by_pid.remove(&ticket.pid);
        }
    }

    /// The credential registered for `pid`.
    pub fn get(&self, pid: i32) -> Option<Arc<ProxyCredential>> {
        self.table().by_pid.get(&pid).map(|(_, c)| Arc::clone(c))
    }

    /// Number of registered spawns.
    pub fn len(&self) -> usize {
        self.table().by_pid.len()
    }

    /// Whether no spawn is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userinfo_is_split_and_percent_decoded() {
        let c = ProxyCredential::from_url("http://sess%2Fa:t0k%40en%3a@127.0.0.1:3128").unwrap();
        assert_eq!(c.username, b"sess/a");
        assert_eq!(c.password, b"t0k@en:");
        // The last '@' of the authority ends the userinfo; a path does not count.
        let c = ProxyCredential::from_url("http://u:p@q@127.0.0.1:3128/x@y").unwrap();
        assert_eq!(
            (c.username.as_slice(), c.password.as_slice()),
            (&b"u"[..], &b"p@q"[..])
        );
        // Only the first ':' splits.
        let c = ProxyCredential::from_url("socks5://u:a:b@h").unwrap();
        assert_eq!(c.password, b"a:b");
        assert_eq!(format!("{c:?}"), "ProxyCredential(<redacted>)");
    }

    #[test]
    fn bad_urls_are_refused_without_echoing_them() {
        let cases = [
            ("127.0.0.1:3128", SpawnsError::Malformed),
            ("http://127.0.0.1:3128", SpawnsError::NoUserinfo),
            ("http://secret@127.0.0.1:3128", SpawnsError::NoUserinfo),
            ("http://:@127.0.0.1:3128", SpawnsError::NoUserinfo),
            ("http://u:secret@", SpawnsError::Malformed),
            ("http://u:sec%2@h", SpawnsError::BadEscape),
            ("http://u:sec%zzret@h", SpawnsError::BadEscape),
            ("http://u:sec%+1ret@h", SpawnsError::BadEscape),
        ];
        for (url, want) in cases {
            let err = ProxyCredential::from_url(url).unwrap_err();
            assert_eq!(err, want, "{url}");
            assert!(!err.to_string().contains("secret"), "{err}");
        }
        let long = format!("http://u:{}@h", "x".repeat(256));
        assert_eq!(ProxyCredential::from_url(&long), Err(SpawnsError::TooLong));
        let max = format!("http://u:{}@h", "%41".repeat(255));
        assert_eq!(ProxyCredential::from_url(&max).unwrap().password.len(), 255);
    }

    #[test]
    fn tickets_remove_only_their_own_registration() {
        let s = Spawns::new();
        assert!(s.register(10, None).is_none());
        assert!(s.register(10, Some("not a url")).is_none());
        assert!(s.is_empty());
        let old = s.register(10, Some("http://a:one@h:1")).unwrap();
        assert_eq!(s.get(10).unwrap().password, b"one");
        // The pid is reused by a new spawn before the old one's exit is handled.
        let new = s.register(10, Some("http://a:two@h:1")).unwrap();
        s.unregister(old);
        assert_eq!(s.get(10).unwrap().password, b"two");
        s.unregister(new);
        assert!(s.get(10).is_none());
        assert!(s.is_empty());
        assert!(!format!("{s:?}").contains("two"));
    }
}
