//! Credentials that never enter the session machine: a spawn's environment
//! carries a *placeholder* of each API credential the client gave it, and
//! the egress proxy's interception of the API hosts ([`super::intercept`])
//! writes the real value into the request on its way out.
//!
//! - A placeholder has the real value's shape: its `sk-ant-…-` prefix
//!   (`sk-ant-oat01-` for an OAuth token, `sk-ant-api03-` for an API key
//!   when the real one has no such prefix) and random URL-safe characters
//!   up to the real value's length (at least [`MIN_RANDOM_CHARS`] of them),
//!   drawn anew for every spawn. Tools that look at the prefix or the
//!   length see a token; it is worth nothing anywhere else.
//! - The real values ([`RealSecret`]) live only here, in memory: `Debug`
//!   shows `<redacted>`, they are zeroed when dropped, never logged, never
//!   written to disk, never sent to the guest.
//! - A spawn's [`SpawnSecrets`] travel with its proxy credential (its
//!   [`super::Grant`]), so a placeholder is honoured only on connections
//!   that spawn's proxy credential opened: another session's placeholder is
//!   a wrong credential there.
//! - Each real value sits in a [`SecretCell`] the client can refresh:
//!   `addApprovedOauthToken` replaces the OAuth token of every running
//!   spawn of the profile (the CLI cannot refresh a token it got from its
//!   environment).
//!
//! Limits: only the three variables of
//! [`guest_agent::proto::CREDENTIAL_VARS`] and `spawn.oauthToken` are
//! substituted; a credential the client hides under another name reaches
//! the guest as it is (and is then refused on the API hosts, where only
//! placeholders are accepted).

use std::fmt;
use std::sync::{Arc, RwLock};

use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

use super::EgressError;
use vmm::sync::RwLockExt;

/// Prefix of an OAuth token (`claude setup-token`, `/login`).
pub const OAUTH_PREFIX: &str = "sk-ant-oat01-";
/// Prefix of an API key.
pub const API_KEY_PREFIX: &str = "sk-ant-api03-";
/// Common start of every Anthropic credential.
const ANTHROPIC_PREFIX: &str = "sk-ant-";
/// Longest prefix kept from a real value (`sk-ant-oat01-` is 13).
const MAX_PREFIX: usize = 16;
/// Fewest random characters in a placeholder (6 bits each: 192 bits).
pub const MIN_RANDOM_CHARS: usize = 32;
/// Longest credential accepted (a real one is about 108 characters).
pub const MAX_CREDENTIAL_LEN: usize = 4096;
/// The placeholder alphabet: base64url, valid in any HTTP header.
const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// Which request header a credential travels in on the API hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carrier {
    /// `Authorization: Bearer <value>` (`CLAUDE_CODE_OAUTH_TOKEN`,
    /// `ANTHROPIC_AUTH_TOKEN`).
    Bearer,
    /// `x-api-key: <value>` (`ANTHROPIC_API_KEY`).
    ApiKey,
}

impl Carrier {
    /// The carrier of a credential environment variable.
    pub fn of_var(name: &str) -> Option<Carrier> {
        match name {
            "CLAUDE_CODE_OAUTH_TOKEN" | "ANTHROPIC_AUTH_TOKEN" => Some(Carrier::Bearer),
            "ANTHROPIC_API_KEY" => Some(Carrier::ApiKey),
            _ => None,
        }
    }
}

/// A real credential value. Never shown, zeroed on drop (clones too).
#[derive(Clone)]
pub struct RealSecret(Zeroizing<String>);

impl RealSecret {
    /// Wraps `value` (checked: printable ASCII without spaces, bounded).
    pub fn new(value: String) -> Result<RealSecret, EgressError> {
        let value = Zeroizing::new(value);
        let ok = !value.is_empty()
            && value.len() <= MAX_CREDENTIAL_LEN
            && value.bytes().all(|b| b.is_ascii_graphic());
        if !ok {
            return Err(EgressError::BadCredential);
        }
        Ok(RealSecret(value))
    }

    /// The value, for the one header it is written into.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for RealSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RealSecret(<redacted>)")
    }
}

/// A real value that can be replaced while spawns use it.
#[derive(Clone, Debug)]
pub struct SecretCell(Arc<RwLock<RealSecret>>);

impl SecretCell {
    pub fn new(secret: RealSecret) -> SecretCell {
        SecretCell(Arc::new(RwLock::new(secret)))
    }

    /// Replaces the value (a refreshed token).
    pub fn set(&self, secret: RealSecret) {
        *self.0.write_locked() = secret;
    }

    /// Runs `f` on the current value.
    pub fn with<T>(&self, f: impl FnOnce(&str) -> T) -> T {
        f(self.0.read_locked().expose())
    }

    /// A weak handle, for a list of cells to refresh.
    pub fn downgrade(&self) -> std::sync::Weak<RwLock<RealSecret>> {
        Arc::downgrade(&self.0)
    }

    /// The cell behind a live weak handle.
    pub fn upgrade(weak: &std::sync::Weak<RwLock<RealSecret>>) -> Option<SecretCell> {
        weak.upgrade().map(SecretCell)
    }
}

/// One placeholder and the real value it stands for.
pub struct Substitution {
    pub carrier: Carrier,
    placeholder: Zeroizing<String>,
    pub real: SecretCell,
}

impl fmt::Debug for Substitution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Substitution")
            .field("carrier", &self.carrier)
            .finish_non_exhaustive()
    }
}

/// A spawn's placeholders (cheap to clone).
#[derive(Clone, Debug, Default)]
pub struct SpawnSecrets(Arc<Vec<Substitution>>);

impl SpawnSecrets {
    pub fn new(subs: Vec<Substitution>) -> SpawnSecrets {
        SpawnSecrets(Arc::new(subs))
    }

    /// Whether the spawn has no credential at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The real value behind `presented` in `carrier`, comparing with
    /// every placeholder of the spawn in constant time.
    pub fn lookup(&self, carrier: Carrier, presented: &str) -> Option<SecretCell> {
        let mut found = None;
        for s in self.0.iter() {
            let same = bool::from(s.placeholder.as_bytes().ct_eq(presented.as_bytes()));
            if same && s.carrier == carrier {
                found = Some(s.real.clone());
            }
        }
        found
    }
}

/// Draws a placeholder for `real`: its prefix (or `carrier`'s default) and
/// random characters to its length.
pub fn placeholder(real: &str, carrier: Carrier) -> Result<String, EgressError> {
    let prefix = known_prefix(real).unwrap_or(match carrier {
        Carrier::Bearer => OAUTH_PREFIX,
        Carrier::ApiKey => API_KEY_PREFIX,
    });
    let random_len = real
        .len()
        .saturating_sub(prefix.len())
        .max(MIN_RANDOM_CHARS);
    let mut bytes = vec![0u8; random_len];
    getrandom::getrandom(&mut bytes).map_err(|e| EgressError::Random(e.to_string()))?;
    let mut out = String::with_capacity(prefix.len() + random_len);
    out.push_str(prefix);
    out.extend(
        bytes
            .iter()
            .map(|b| char::from(ALPHABET[usize::from(b & 63)])),
    );
    Ok(out)
}

/// The `sk-ant-<kind>-` prefix of a real value, when it has one.
fn known_prefix(real: &str) -> Option<&str> {
    let rest = real.strip_prefix(ANTHROPIC_PREFIX)?;
    let dash = rest.find('-')?;
    let end = ANTHROPIC_PREFIX.len() + dash + 1;
    let prefix = &real[..end];
    let kind = &rest[..dash];
    (end <= MAX_PREFIX && !kind.is_empty() && kind.bytes().all(|b| b.is_ascii_alphanumeric()))
        .then_some(prefix)
}

/// Replaces real credentials with placeholders, collecting the
/// substitutions.
#[derive(Default)]
pub struct Substituter {
    subs: Vec<Substitution>,
}

impl Substituter {
    /// A placeholder for the real value `real` carried in `carrier`, bound
    /// to `cell` (a fresh one unless the caller shares it).
    pub fn substitute(
        &mut self,
        carrier: Carrier,
        real: &str,
        cell: SecretCell,
    ) -> Result<String, EgressError> {
        let placeholder = placeholder(real, carrier)?;
        self.subs.push(Substitution {
            carrier,
            placeholder: Zeroizing::new(placeholder.clone()),
            real: cell,
        });
        Ok(placeholder)
    }

    /// The spawn's substitutions.
    pub fn finish(self) -> SpawnSecrets {
        SpawnSecrets::new(self.subs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn real(len: usize, prefix: &str) -> String {
        format!("{prefix}{}", "R".repeat(len - prefix.len()))
    }

    #[test]
    fn placeholders_have_the_real_shape_and_differ_every_time() {
        let token = real(108, OAUTH_PREFIX);
        let a = placeholder(&token, Carrier::Bearer).unwrap();
        let b = placeholder(&token, Carrier::Bearer).unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), 108);
        assert!(a.starts_with(OAUTH_PREFIX), "{a}");
        assert!(!a.contains("RRRR"), "nothing of the real value");
        assert!(a[OAUTH_PREFIX.len()..]
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'));
        // An API key keeps its own prefix; a short or foreign value gets the
        // carrier's prefix and at least the minimum of randomness.
        let key = placeholder(&real(90, "sk-ant-api03-"), Carrier::ApiKey).unwrap();
        assert!(key.starts_with("sk-ant-api03-") && key.len() == 90, "{key}");
        let short = placeholder("abc", Carrier::ApiKey).unwrap();
        assert!(short.starts_with(API_KEY_PREFIX));
        assert_eq!(short.len(), API_KEY_PREFIX.len() + MIN_RANDOM_CHARS);
        let odd = placeholder("sk-ant-x y-zzz", Carrier::Bearer).unwrap();
        assert!(odd.starts_with(OAUTH_PREFIX), "{odd}");
    }

    #[test]
    fn lookups_are_bound_to_carrier_and_spawn() {
        let cell = SecretCell::new(RealSecret::new(real(108, OAUTH_PREFIX)).unwrap());
        let mut s = Substituter::default();
        let ph = s
            .substitute(Carrier::Bearer, &real(108, OAUTH_PREFIX), cell.clone())
            .unwrap();
        let spawn = s.finish();
        assert!(spawn.lookup(Carrier::Bearer, &ph).is_some());
        assert!(spawn.lookup(Carrier::ApiKey, &ph).is_none(), "wrong header");
        let mut near = ph.clone().into_bytes();
        near[20] ^= 1;
        assert!(spawn
            .lookup(Carrier::Bearer, &String::from_utf8(near).unwrap())
            .is_none());
        // Another spawn's placeholder for the same token is not this one's.
        let mut other = Substituter::default();
        let ph2 = other
            .substitute(Carrier::Bearer, &real(108, OAUTH_PREFIX), cell.clone())
            .unwrap();
        assert!(spawn.lookup(Carrier::Bearer, &ph2).is_none());
        // A refresh reaches the spawn through its cell.
        cell.set(RealSecret::new("sk-ant-oat01-NEW".into()).unwrap());
        let got = spawn.lookup(Carrier::Bearer, &ph).unwrap();
        assert_eq!(got.with(str::to_owned), "sk-ant-oat01-NEW");
    }

    #[test]
    fn secrets_are_never_shown() {
        let secret = RealSecret::new("sk-ant-oat01-SECRETVALUE".into()).unwrap();
        let cell = SecretCell::new(secret);
        let mut s = Substituter::default();
        let ph = s
            .substitute(Carrier::Bearer, "sk-ant-oat01-SECRETVALUE", cell.clone())
            .unwrap();
        let spawn = s.finish();
        let shown = format!("{cell:?} {spawn:?}");
        assert!(
            !shown.contains("SECRETVALUE") && !shown.contains(&ph),
            "{shown}"
        );
        assert!(RealSecret::new(String::new()).is_err());
        assert!(RealSecret::new("has space".into()).is_err());
        assert!(RealSecret::new("line\nbreak".into()).is_err());
        assert!(RealSecret::new("x".repeat(MAX_CREDENTIAL_LEN + 1)).is_err());
        assert_eq!(Carrier::of_var("ANTHROPIC_API_KEY"), Some(Carrier::ApiKey));
        assert_eq!(
            Carrier::of_var("CLAUDE_CODE_OAUTH_TOKEN"),
            Some(Carrier::Bearer)
        );
        assert_eq!(Carrier::of_var("HOME"), None);
    }
}
