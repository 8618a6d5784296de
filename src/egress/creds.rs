//! Attribution: the credential each spawn carries in its proxy URL, and the
//! registry that maps it to the spawn's session and policy.
//!
//! A credential is [`CREDENTIAL_BYTES`] bytes from the OS random source,
//! base64url-encoded. Lookups compare against every live credential in
//! constant time (no early exit, no hash of the secret), so timing tells
//! nothing about how close a guess was. Credentials never appear in logs:
//! their `Debug` is redacted and the registry logs session names only.
//!
//! Limits: attribution is as strong as the separation between sessions in
//! the guest (a session that reads another's environment holds its
//! credential).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use subtle::ConstantTimeEq;

use super::policy::Policy;
use super::secrets::SpawnSecrets;
use super::EgressError;
use vmm::sync::MutexExt;

/// Random bytes per credential: 192 bits, above the 128-bit floor.
pub const CREDENTIAL_BYTES: usize = 24;

/// Connections one session may hold open through the proxy at once (CONNECT
/// tunnels, SOCKS streams and in-flight plain HTTP requests together). A
/// package manager opens a few dozen; far more means a runaway loop.
pub const MAX_CONNECTIONS_PER_SESSION: usize = 256;

/// A spawn's proxy secret. `Debug` and `Display` do not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential(String);

impl Credential {
    /// Draws a fresh credential from the OS random source.
    pub fn generate() -> Result<Credential, EgressError> {
        let mut bytes = [0u8; CREDENTIAL_BYTES];
        getrandom::getrandom(&mut bytes).map_err(|e| EgressError::Random(e.to_string()))?;
        Ok(Credential(
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes),
        ))
    }

    /// The secret itself, for the spawn's environment only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Credential(<redacted>)")
    }
}

/// What a valid credential stands for.
#[derive(Clone, Debug)]
pub struct Grant {
    /// The session the spawn belongs to.
    pub session: String,
    /// The spawn's policy.
    pub policy: Arc<Policy>,
    /// The spawn's credential placeholders (see [`super::secrets`]).
    pub secrets: SpawnSecrets,
    counter: Arc<AtomicUsize>,
}

impl Grant {
    /// Takes one of the session's connection slots, or `None` at the cap.
    pub fn acquire_slot(&self, cap: usize) -> Option<Slot> {
        let mut cur = self.counter.load(Ordering::Relaxed);
        loop {
            if cur >= cap {
                return None;
            }
            match self.counter.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Some(Slot {
                        counter: self.counter.clone(),
                    })
                }
                Err(now) => cur = now,
            }
        }
    }

    /// Connections the session holds now.
    pub fn open_connections(&self) -> usize {
        self.counter.load(Ordering::Relaxed)
    }
}

/// One held connection slot; released on drop.
#[derive(Debug)]
pub struct Slot {
    counter: Arc<AtomicUsize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Entry {
    secret: Vec<u8>,
    grant: Grant,
}

#[derive(Default)]
struct Inner {
    entries: Vec<Entry>,
    /// Per-session counters, shared by all of a session's credentials.
    counters: HashMap<String, Arc<AtomicUsize>>,
}

/// Live credentials.
#[derive(Default)]
pub struct CredentialRegistry {
    inner: Mutex<Inner>,
}

impl fmt::Debug for CredentialRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CredentialRegistry").finish_non_exhaustive()
    }
}

impl CredentialRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// Issues a credential for one spawn of `session` under `policy`.
    pub fn issue(&self, session: &str, policy: Policy) -> Result<Credential, EgressError> {
        self.issue_with_secrets(session, policy, SpawnSecrets::default())
    }

    /// [`CredentialRegistry::issue`] for a spawn holding `secrets`.
    pub fn issue_with_secrets(
        &self,
        session: &str,
        policy: Policy,
        secrets: SpawnSecrets,
    ) -> Result<Credential, EgressError> {
        let cred = Credential::generate()?;
        let mut inner = self.lock();
        let counter = inner
            .counters
            .entry(session.to_owned())
            .or_insert_with(|| Arc::new(AtomicUsize::new(0)))
            .clone();
        inner.entries.push(Entry {
            secret: cred.0.as_bytes().to_vec(),
            grant: Grant {
                session: session.to_owned(),
                policy: Arc::new(policy),
                secrets,
                counter,
            },
        });
        tracing::debug!(session, "egress credential issued");
        Ok(cred)
    }

    /// Revokes a credential (its spawn exited). Connections it already opened
    /// run on; new ones get 407. Returns whether it was live.
    pub fn revoke(&self, cred: &Credential) -> bool {
        let mut inner = self.lock();
        let Some(pos) = find(&inner.entries, cred.0.as_bytes()) else {
            return false;
        };
        let entry = inner.entries.swap_remove(pos);
        let session = entry.grant.session;
        if !inner.entries.iter().any(|e| e.grant.session == session) {
            inner.counters.remove(&session);
        }
        tracing::debug!(session, "egress credential revoked");
        true
    }

    /// The grant of `secret`, if it is a live credential.
    pub fn lookup(&self, secret: &[u8]) -> Option<Grant> {
        let inner = self.lock();
        find(&inner.entries, secret).map(|i| inner.entries[i].grant.clone())
    }

    /// Live credentials.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether no credential is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Index of the entry whose secret equals `secret`, comparing with every
/// entry in constant time.
fn find(entries: &[Entry], secret: &[u8]) -> Option<usize> {
    let mut found = None;
    for (i, e) in entries.iter().enumerate() {
        // `ct_eq` on slices of different lengths returns false at once, but
        // every credential has the same length, so that leaks nothing.
        if bool::from(e.secret.as_slice().ct_eq(secret)) {
            found = Some(i);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_long_random_and_url_safe() {
        let a = Credential::generate().unwrap();
        let b = Credential::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), 32); // 24 bytes in base64url
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(a.expose())
            .unwrap();
        assert!(raw.len() * 8 >= 128);
        assert!(a
            .expose()
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'));
    }

    #[test]
    fn debug_is_redacted() {
        let reg = CredentialRegistry::new();
        let c = reg.issue("s1", Policy::Unrestricted).unwrap();
        let shown = format!("{c:?} {reg:?}");
        assert!(!shown.contains(c.expose()), "{shown}");
        assert!(shown.contains("redacted"));
        let grant = reg.lookup(c.expose().as_bytes()).unwrap();
        assert!(!format!("{grant:?}").contains(c.expose()));
    }

    #[test]
    fn issue_lookup_revoke() {
        let reg = CredentialRegistry::new();
        let a = reg.issue("alpha", Policy::Unrestricted).unwrap();
        let b = reg.issue("beta", Policy::Allow(Vec::new())).unwrap();
        assert_eq!(reg.lookup(a.expose().as_bytes()).unwrap().session, "alpha");
        let gb = reg.lookup(b.expose().as_bytes()).unwrap();
        assert_eq!(gb.session, "beta");
        assert_eq!(*gb.policy, Policy::Allow(Vec::new()));
        // near misses fail
        let mut wrong = a.expose().as_bytes().to_vec();
        wrong[0] ^= 1;
        assert!(reg.lookup(&wrong).is_none());
        assert!(reg.lookup(&a.expose().as_bytes()[..31]).is_none());
        assert!(reg.lookup(b"").is_none());
        assert!(reg.revoke(&a));
        assert!(!reg.revoke(&a));
        assert!(reg.lookup(a.expose().as_bytes()).is_none());
        assert!(reg.lookup(b.expose().as_bytes()).is_some());
        assert_eq!(reg.len(), 1);
    }

    #[test]
    fn slots_are_per_session_and_capped() {
        let reg = CredentialRegistry::new();
        let a1 = reg.issue("alpha", Policy::Unrestricted).unwrap();
        let a2 = reg.issue("alpha", Policy::Unrestricted).unwrap();
        let b = reg.issue("beta", Policy::Unrestricted).unwrap();
        let g1 = reg.lookup(a1.expose().as_bytes()).unwrap();
        let g2 = reg.lookup(a2.expose().as_bytes()).unwrap();
        let gb = reg.lookup(b.expose().as_bytes()).unwrap();
        let s1 = g1.acquire_slot(2).unwrap();
        let _s2 = g2.acquire_slot(2).unwrap();
        assert!(
            g1.acquire_slot(2).is_none(),
            "the session's two spawns share the cap"
        );
        assert!(
            gb.acquire_slot(2).is_some(),
            "another session is not affected"
        );
        drop(s1);
        assert_eq!(g2.open_connections(), 1);
        assert!(g2.acquire_slot(2).is_some());
    }
}
