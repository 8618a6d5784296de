//! The interception CA: generated in memory when the helper starts, never
//! written anywhere, and able to vouch only for the API hosts.
//!
//! - The CA: ECDSA P-256, basic constraints CA with path length 0 (it signs
//!   leaves only), key usage certificate and CRL signing, and X.509 name
//!   constraints permitting exactly the configured API host names (and
//!   their subdomains, as name constraints do), so even its key could not
//!   vouch for any other site to a client that checks them. Its private
//!   key lives in this process only; the guest gets the certificate.
//! - Leaves: minted on first use for a configured host only, never for an
//!   arbitrary SNI; ECDSA P-256, `serverAuth`, backdated by [`BACKDATE`]
//!   for clock skew, valid [`LEAF_VALIDITY`], cached per host and minted
//!   again when less than [`LEAF_RENEW_BEFORE`] remains.
//!
//! Limits: the CA lives as long as the helper ([`CA_VALIDITY`] covers any
//! realistic uptime); a VM booted by one helper trusts that helper's CA
//! only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
    GeneralSubtree, IsCa, Issuer, KeyPair, KeyUsagePurpose, NameConstraints, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;
use time::OffsetDateTime;
use vmm::sync::MutexExt;

/// How long the CA certificate is valid from its creation.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long a leaf is valid.
pub const LEAF_VALIDITY: Duration = Duration::from_secs(7 * 24 * 3600);
/// A cached leaf with less than this left is minted again.
pub const LEAF_RENEW_BEFORE: Duration = Duration::from_secs(24 * 3600);
/// Certificates start this long before their creation (clock skew between
/// host and guest).
pub const BACKDATE: Duration = Duration::from_secs(3600);
/// The CA's common name.
const CA_NAME: &str = "cowork-helper egress interception CA";

/// The CA or a leaf could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("{0:?} is not one of the intercepted API hosts")]
    NotAnApiHost(String),
    #[error("no API host to intercept")]
    NoHosts,
    #[error("cannot make a certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("cannot load a key into TLS: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A leaf and when it stops being valid.
struct Leaf {
    key: Arc<CertifiedKey>,
    not_after: OffsetDateTime,
}

/// The CA and its leaves.
pub struct InterceptCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
    der: CertificateDer<'static>,
    hosts: Vec<String>,
    leaves: Mutex<HashMap<String, Leaf>>,
}

impl std::fmt::Debug for InterceptCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterceptCa")
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

impl InterceptCa {
    /// A new CA for `hosts` (lower-case DNS names).
    pub fn generate(hosts: &[String]) -> Result<InterceptCa, CaError> {
        if hosts.is_empty() {
            return Err(CaError::NoHosts);
        }
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, CA_NAME);
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.name_constraints = Some(NameConstraints {
            permitted_subtrees: hosts
                .iter()
                .map(|h| GeneralSubtree::DnsName(h.clone()))
                .collect(),
            excluded_subtrees: Vec::new(),
        });
        params.not_before = now - BACKDATE;
        params.not_after = now + CA_VALIDITY;
        params.serial_number = Some(random_serial()?);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let cert = params.self_signed(&key)?;
        Ok(InterceptCa {
            pem: cert.pem(),
            der: cert.der().clone(),
            issuer: Issuer::new(params, key),
            hosts: hosts.to_vec(),
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA certificate, PEM (what the guest trusts).
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// The CA certificate, DER.
    pub fn der(&self) -> &CertificateDer<'static> {
        &self.der
    }

    /// The hosts it vouches for.
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// The leaf for `host` (cached; minted when missing or about to expire).
    pub fn leaf(&self, host: &str) -> Result<Arc<CertifiedKey>, CaError> {
        self.leaf_at(host, OffsetDateTime::now_utc())
    }

    /// [`InterceptCa::leaf`] as of `now`.
    pub fn leaf_at(&self, host: &str, now: OffsetDateTime) -> Result<Arc<CertifiedKey>, CaError> {
        let host = host.to_ascii_lowercase();
        if !self.hosts.contains(&host) {
            return Err(CaError::NotAnApiHost(host));
        }
        let mut leaves = self.leaves.locked();
        if let Some(leaf) = leaves.get(&host) {
            if leaf.not_after - now > LEAF_RENEW_BEFORE {
                return Ok(leaf.key.clone());
            }
        }
        let (key, not_after) = self.mint(&host, now)?;
        leaves.insert(
            host,
            Leaf {
                key: key.clone(),
                not_after,
            },
        );
        Ok(key)
    }

    fn mint(
        &self,
        host: &str,
        now: OffsetDateTime,
    ) -> Result<(Arc<CertifiedKey>, OffsetDateTime), CaError> {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        params.distinguished_name = dn;
        params.subject_alt_names = vec![SanType::DnsName(host.try_into()?)];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = now - BACKDATE;
        params.not_after = now + LEAF_VALIDITY;
        params.serial_number = Some(random_serial()?);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = rustls::crypto::ring::sign::any_ecdsa_type(&private)?;
        let chain = vec![cert.der().clone(), self.der.clone()];
        Ok((
            Arc::new(CertifiedKey::new(chain, signing)),
            params.not_after,
        ))
    }
}

/// A random positive 16-byte serial number.
fn random_serial() -> Result<rcgen::SerialNumber, rcgen::Error> {
    let mut bytes = [0u8; 16];
    getrandom::getrandom(&mut bytes).map_err(|_| rcgen::Error::RingUnspecified)?;
    bytes[0] &= 0x7f;
    Ok(rcgen::SerialNumber::from_slice(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{ServerName, UnixTime};

    fn hosts() -> Vec<String> {
        vec!["api.anthropic.com".to_string()]
    }

    /// Verifies `chain` for `name` at `now` with only `ca` trusted, as a
    /// TLS client would.
    fn verify(
        ca: &InterceptCa,
        chain: &[CertificateDer<'static>],
        name: &str,
        now: OffsetDateTime,
    ) -> Result<(), rustls::Error> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der().clone()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        let at = UnixTime::since_unix_epoch(Duration::from_secs(now.unix_timestamp() as u64));
        verifier
            .verify_server_cert(
                &chain[0],
                &chain[1..],
                &ServerName::try_from(name.to_string()).unwrap(),
                &[],
                at,
            )
            .map(|_| ())
    }

    #[test]
    fn leaves_verify_for_their_host_only_and_only_listed_hosts_get_one() {
        let ca = InterceptCa::generate(&hosts()).unwrap();
        assert!(ca.pem().starts_with("-----BEGIN CERTIFICATE-----"));
        let leaf = ca.leaf("API.anthropic.com").unwrap();
        let now = OffsetDateTime::now_utc();
        verify(&ca, &leaf.cert, "api.anthropic.com", now).unwrap();
        assert!(verify(&ca, &leaf.cert, "evil.example", now).is_err());
        assert!(matches!(
            ca.leaf("evil.example"),
            Err(CaError::NotAnApiHost(_))
        ));
        assert!(matches!(InterceptCa::generate(&[]), Err(CaError::NoHosts)));
        // Cached while fresh.
        assert!(Arc::ptr_eq(&leaf, &ca.leaf("api.anthropic.com").unwrap()));
    }

    #[test]
    fn the_ca_is_name_constrained_to_the_api_hosts() {
        // A leaf for another name signed by this CA's key (what a stolen key
        // could mint) does not verify: the name constraints forbid it.
        let ca = InterceptCa::generate(&hosts()).unwrap();
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::new(vec!["evil.example".to_string()]).unwrap();
        params.not_before = now - BACKDATE;
        params.not_after = now + LEAF_VALIDITY;
        let key = KeyPair::generate().unwrap();
        let rogue = params.signed_by(&key, &ca.issuer).unwrap();
        let chain = vec![rogue.der().clone(), ca.der().clone()];
        let e = verify(&ca, &chain, "evil.example", now).unwrap_err();
        assert!(
            format!("{e:?}").contains("NameConstraint")
                || format!("{e:?}").contains("NotValidForName"),
            "{e:?}"
        );
    }

    #[test]
    fn leaves_expire_and_are_minted_again_before_they_do() {
        let ca = InterceptCa::generate(&hosts()).unwrap();
        let now = OffsetDateTime::now_utc();
        let first = ca.leaf_at("api.anthropic.com", now).unwrap();
        // Past its validity it no longer verifies.
        let later = now + LEAF_VALIDITY + Duration::from_secs(60);
        assert!(verify(&ca, &first.cert, "api.anthropic.com", later).is_err());
        // Close to its end the cache mints a new one, which verifies then.
        let near_end = now + LEAF_VALIDITY - LEAF_RENEW_BEFORE / 2;
        let second = ca.leaf_at("api.anthropic.com", near_end).unwrap();
        assert!(!Arc::ptr_eq(&first, &second));
        verify(&ca, &second.cert, "api.anthropic.com", near_end).unwrap();
        // Backdated: valid a little before it was made.
        verify(&ca, &first.cert, "api.anthropic.com", now - BACKDATE / 2).unwrap();
    }
}
