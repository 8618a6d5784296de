//! What an intercepted request to an API host may carry, decided from its
//! head alone (a pure function, so every rule is unit-tested):
//!
//! - the request is for the tunnel's host: exactly one `Host` header,
//!   equal to the CONNECT target (optionally with `:443`), and an
//!   origin-form target (or an absolute one naming the same host); else
//!   421 Misdirected Request;
//! - its framing is unambiguous: no `Content-Length` with
//!   `Transfer-Encoding`, one `Content-Length` value, `Transfer-Encoding`
//!   only `chunked`; no `Upgrade`; else 400;
//! - TRACE, TRACK and CONNECT are refused (405);
//! - `POST /api/oauth/claude_cli/create_api_key` is refused (403): its
//!   answer would be a real API key, readable in the guest;
//! - credentials: at most one of `Authorization` and `x-api-key`, once.
//!   `Authorization` must be `Bearer <placeholder of this spawn>`, and
//!   `x-api-key` `<placeholder of this spawn>`; that one header is
//!   rewritten with the real value. Any other credential (an attacker's
//!   own key, another session's or a stale placeholder, cookies, another
//!   auth scheme) gets a local 401 and never leaves the host. A request
//!   without any credential passes unchanged.

use hyper::header::{
    HeaderMap, HeaderName, AUTHORIZATION, CONTENT_LENGTH, COOKIE, HOST, TRANSFER_ENCODING, UPGRADE,
};
use hyper::{Method, StatusCode, Uri};

use crate::egress::secrets::{Carrier, SecretCell, SpawnSecrets};

/// The header carrying an API key.
pub const X_API_KEY: &str = "x-api-key";
/// The port intercepted connections are for.
pub const HTTPS_PORT: u16 = 443;
/// The endpoint that mints API keys from an OAuth token.
pub const CREATE_API_KEY_PATH: &str = "/api/oauth/claude_cli/create_api_key";

/// Why a request is answered locally.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The request is for another host than the tunnel's.
    Misdirected,
    /// Its framing or form is ambiguous or unsupported.
    BadRequest(&'static str),
    /// A method we never forward.
    Method,
    /// An endpoint we never forward.
    Forbidden(&'static str),
    /// A credential that is not this spawn's placeholder.
    Credential(&'static str),
}

impl Refusal {
    /// The status of the local answer.
    pub fn status(self) -> StatusCode {
        match self {
            Refusal::Misdirected => StatusCode::MISDIRECTED_REQUEST,
            Refusal::BadRequest(_) => StatusCode::BAD_REQUEST,
            Refusal::Method => StatusCode::METHOD_NOT_ALLOWED,
            Refusal::Forbidden(_) => StatusCode::FORBIDDEN,
            Refusal::Credential(_) => StatusCode::UNAUTHORIZED,
        }
    }

    /// Words for the log line and the answer's body (never a header value).
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::Misdirected => "the request's Host is not the tunnel's API host",
            Refusal::BadRequest(why) | Refusal::Forbidden(why) | Refusal::Credential(why) => why,
            Refusal::Method => "this method is not forwarded to the API host",
        }
    }
}

/// The credential header to rewrite, and the real value for it.
#[derive(Debug)]
pub struct Swap {
    pub header: HeaderName,
    pub carrier: Carrier,
    pub real: SecretCell,
}

/// Checks a request head for `host`; `Ok(Some(swap))` when a placeholder
/// is to be replaced, `Ok(None)` when it passes as it is.
pub fn check(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    host: &str,
    secrets: &SpawnSecrets,
) -> Result<Option<Swap>, Refusal> {
    if *method == Method::TRACE || *method == Method::CONNECT || method.as_str() == "TRACK" {
        return Err(Refusal::Method);
    }
    if let Some(authority) = uri.authority() {
        if !same_host(authority.as_str(), host) {
            return Err(Refusal::Misdirected);
        }
    }
    let mut hosts = headers.get_all(HOST).iter();
    match (hosts.next(), hosts.next()) {
        (Some(h), None) if h.to_str().is_ok_and(|h| same_host(h, host)) => {}
        // HTTP/1.1 requires Host; hyper fills the URI's authority for
        // absolute-form requests only.
        (None, _) if uri.authority().is_some() => {}
        _ => return Err(Refusal::Misdirected),
    }
    check_framing(headers)?;
    if *method == Method::POST && uri.path() == CREATE_API_KEY_PATH {
        return Err(Refusal::Forbidden(
            "minting API keys is refused: the key would be readable in the session",
        ));
    }
    if headers.contains_key(COOKIE) {
        return Err(Refusal::Credential(
            "cookies are not accepted on the API host",
        ));
    }
    let auth: Vec<_> = headers.get_all(AUTHORIZATION).iter().collect();
    let keys: Vec<_> = headers.get_all(X_API_KEY).iter().collect();
    match (auth.as_slice(), keys.as_slice()) {
        ([], []) => Ok(None),
        ([value], []) => {
            let value = value
                .to_str()
                .map_err(|_| Refusal::Credential("unreadable Authorization header"))?;
            let (scheme, token) = value
                .split_once(' ')
                .ok_or(Refusal::Credential("Authorization must be Bearer <token>"))?;
            if !scheme.eq_ignore_ascii_case("bearer") {
                return Err(Refusal::Credential(
                    "only Bearer credentials are accepted on the API host",
                ));
            }
            let real = secrets
                .lookup(Carrier::Bearer, token.trim())
                .ok_or(Refusal::Credential(
                    "the bearer token is not this session's placeholder (another session's, a stale one, or a real key)",
                ))?;
            Ok(Some(Swap {
                header: AUTHORIZATION,
                carrier: Carrier::Bearer,
                real,
            }))
        }
        ([], [value]) => {
            let value = value
                .to_str()
                .map_err(|_| Refusal::Credential("unreadable x-api-key header"))?;
            let real = secrets
                .lookup(Carrier::ApiKey, value.trim())
                .ok_or(Refusal::Credential(
                    "the API key is not this session's placeholder (another session's, a stale one, or a real key)",
                ))?;
            Ok(Some(Swap {
                header: HeaderName::from_static(X_API_KEY),
                carrier: Carrier::ApiKey,
                real,
            }))
        }
        _ => Err(Refusal::Credential(
            "more than one credential in one request",
        )),
    }
}

/// Whether `authority` (`name` or `name:port`) names `host` on port 443.
fn same_host(authority: &str, host: &str) -> bool {
    let (name, port) = match authority.rsplit_once(':') {
        Some((n, p)) => (n, Some(p)),
        None => (authority, None),
    };
    name.eq_ignore_ascii_case(host) && port.is_none_or(|p| p == "443")
}

fn check_framing(headers: &HeaderMap) -> Result<(), Refusal> {
    let lengths: Vec<_> = headers.get_all(CONTENT_LENGTH).iter().collect();
    let encodings: Vec<_> = headers.get_all(TRANSFER_ENCODING).iter().collect();
    if lengths.len() > 1 {
        return Err(Refusal::BadRequest("more than one Content-Length"));
    }
    if !lengths.is_empty() && !encodings.is_empty() {
        return Err(Refusal::BadRequest(
            "Content-Length together with Transfer-Encoding",
        ));
    }
    if encodings.len() > 1
        || encodings
            .first()
            .is_some_and(|te| !te.as_bytes().eq_ignore_ascii_case(b"chunked"))
    {
        return Err(Refusal::BadRequest("Transfer-Encoding other than chunked"));
    }
    if headers.contains_key(UPGRADE) {
        return Err(Refusal::BadRequest(
            "protocol upgrades are not forwarded to the API host",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::secrets::{RealSecret, Substituter};
    use hyper::header::HeaderValue;

    const HOST_NAME: &str = "api.anthropic.com";

    fn spawn_with(carrier: Carrier) -> (SpawnSecrets, String) {
        let cell = SecretCell::new(RealSecret::new("sk-ant-oat01-REAL".into()).unwrap());
        let mut s = Substituter::default();
        let ph = s.substitute(carrier, "sk-ant-oat01-REAL", cell).unwrap();
        (s.finish(), ph)
    }

    fn head(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn run(
        method: Method,
        path: &str,
        pairs: &[(&str, &str)],
        secrets: &SpawnSecrets,
    ) -> Result<Option<Swap>, Refusal> {
        check(
            &method,
            &path.parse().unwrap(),
            &head(pairs),
            HOST_NAME,
            secrets,
        )
    }

    #[test]
    fn the_spawns_placeholder_is_swapped_in_its_header_only() {
        let (s, ph) = spawn_with(Carrier::Bearer);
        let bearer = format!("Bearer {ph}");
        let swap = run(
            Method::POST,
            "/v1/messages?beta=true",
            &[("host", HOST_NAME), ("authorization", &bearer)],
            &s,
        )
        .unwrap()
        .unwrap();
        assert_eq!(swap.header, AUTHORIZATION);
        assert_eq!(swap.real.with(str::to_owned), "sk-ant-oat01-REAL");
        // The same placeholder as an API key is not accepted.
        let e = run(
            Method::POST,
            "/v1/messages",
            &[("host", HOST_NAME), ("x-api-key", &ph)],
            &s,
        )
        .unwrap_err();
        assert_eq!(e.status(), StatusCode::UNAUTHORIZED);
        let (k, key_ph) = spawn_with(Carrier::ApiKey);
        let swap = run(
            Method::POST,
            "/v1/messages",
            &[("host", "API.anthropic.com:443"), ("x-api-key", &key_ph)],
            &k,
        )
        .unwrap()
        .unwrap();
        assert_eq!(swap.header, HeaderName::from_static(X_API_KEY));
        // No credential: passes unchanged.
        assert!(run(Method::GET, "/", &[("host", HOST_NAME)], &s)
            .unwrap()
            .is_none());
    }

    #[test]
    fn any_other_credential_is_refused() {
        let (s, ph) = spawn_with(Carrier::Bearer);
        let (other, other_ph) = spawn_with(Carrier::Bearer);
        let refused = |pairs: &[(&str, &str)], secrets: &SpawnSecrets| {
            run(Method::POST, "/v1/messages", pairs, secrets).unwrap_err()
        };
        let own = format!("Bearer {ph}");
        for pairs in [
            vec![
                ("host", HOST_NAME),
                ("authorization", "Bearer sk-ant-api03-attackers-own-key"),
            ],
            vec![
                ("host", HOST_NAME),
                ("authorization", &format!("Bearer {other_ph}")),
            ],
            vec![("host", HOST_NAME), ("authorization", "Basic dXNlcjpwYXNz")],
            vec![("host", HOST_NAME), ("authorization", "Bearer")],
            vec![
                ("host", HOST_NAME),
                ("x-api-key", "sk-ant-api03-attackers-own-key"),
            ],
            vec![
                ("host", HOST_NAME),
                ("authorization", &own),
                ("x-api-key", &ph),
            ],
            vec![
                ("host", HOST_NAME),
                ("authorization", &own),
                ("authorization", &own),
            ],
            vec![("host", HOST_NAME), ("cookie", "session=abc")],
        ] {
            let e = refused(&pairs, &s);
            assert_eq!(e.status(), StatusCode::UNAUTHORIZED, "{pairs:?}: {e:?}");
        }
        // A placeholder is worthless in another spawn.
        assert!(matches!(
            refused(&[("host", HOST_NAME), ("authorization", &own)], &other),
            Refusal::Credential(_)
        ));
        assert!(matches!(
            refused(
                &[("host", HOST_NAME), ("authorization", &own)],
                &SpawnSecrets::default()
            ),
            Refusal::Credential(_)
        ));
    }

    #[test]
    fn the_request_must_be_for_the_tunnels_host() {
        let s = SpawnSecrets::default();
        for pairs in [
            vec![("host", "evil.example")],
            vec![("host", "api.anthropic.com:8443")],
            vec![("host", HOST_NAME), ("host", HOST_NAME)],
            vec![],
        ] {
            assert_eq!(
                run(Method::GET, "/", &pairs, &s).unwrap_err(),
                Refusal::Misdirected,
                "{pairs:?}"
            );
        }
        assert_eq!(
            run(
                Method::GET,
                "https://evil.example/",
                &[("host", HOST_NAME)],
                &s
            )
            .unwrap_err(),
            Refusal::Misdirected
        );
        assert!(run(Method::GET, "https://api.anthropic.com/x", &[], &s)
            .unwrap()
            .is_none());
    }

    #[test]
    fn ambiguous_framing_methods_and_key_minting_are_refused() {
        let s = SpawnSecrets::default();
        let h = ("host", HOST_NAME);
        for pairs in [
            vec![h, ("content-length", "5"), ("transfer-encoding", "chunked")],
            vec![h, ("content-length", "5"), ("content-length", "6")],
            vec![h, ("transfer-encoding", "gzip, chunked")],
            vec![
                h,
                ("transfer-encoding", "chunked"),
                ("transfer-encoding", "chunked"),
            ],
            vec![h, ("upgrade", "websocket")],
        ] {
            assert!(
                matches!(
                    run(Method::POST, "/v1/messages", &pairs, &s),
                    Err(Refusal::BadRequest(_))
                ),
                "{pairs:?}"
            );
        }
        assert!(run(
            Method::POST,
            "/v1/messages",
            &[h, ("transfer-encoding", "Chunked")],
            &s
        )
        .is_ok());
        for m in [
            Method::TRACE,
            Method::CONNECT,
            Method::from_bytes(b"TRACK").unwrap(),
        ] {
            assert_eq!(run(m, "/", &[h], &s).unwrap_err(), Refusal::Method);
        }
        let e = run(
            Method::POST,
            "/api/oauth/claude_cli/create_api_key?x=1",
            &[h],
            &s,
        )
        .unwrap_err();
        assert_eq!(e.status(), StatusCode::FORBIDDEN);
        assert!(run(Method::GET, CREATE_API_KEY_PATH, &[h], &s).is_ok());
    }
}
