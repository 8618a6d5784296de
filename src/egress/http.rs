//! The HTTP/1 face of the proxy (hyper): CONNECT tunnels and absolute-form
//! plain-HTTP forwarding.
//!
//! - Origin-form requests (`GET /x`, not meant for a proxy) get 400.
//! - Every request needs `Proxy-Authorization: Basic base64(user:credential)`
//!   (the user part is ignored); without a live credential: 407 with
//!   `Proxy-Authenticate: Basic realm="cowork"`.
//! - The destination comes from the request target only: the CONNECT
//!   authority, or the authority of the absolute URI. `Host` is ignored and,
//!   for forwarded requests, replaced by the URI's authority (RFC 9112 §3.2.2).
//! - Refusals answer 403 with `X-Proxy-Error: blocked-by-allowlist`.
//!
//! Limits: absolute-form requests are forwarded one upstream connection per
//! request, `https://` absolute URIs are refused (clients use CONNECT for
//! those), and upgrades (WebSocket over plain `http://`) are not forwarded.

use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};

use super::creds::Grant;
use super::host::{parse_authority, Host};
use super::{EgressError, Shared, MAX_REQUEST_HEAD_BYTES};

/// The `X-Proxy-Error` header and its values (those of the official stack,
/// so tools that look for them keep working).
pub const PROXY_ERROR_HEADER: &str = "x-proxy-error";
pub const BLOCKED: &str = "blocked-by-allowlist";
const BLOCKED_BODY: &str = "Connection blocked by network allowlist\n";

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus the proxy ones; never forwarded.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

type Body = BoxBody<Bytes, hyper::Error>;

fn text(status: StatusCode, error: &str, body: &'static str) -> Response<Body> {
    let mut resp = Response::new(
        Full::new(Bytes::from_static(body.as_bytes()))
            .map_err(|n| match n {})
            .boxed(),
    );
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    if let Ok(v) = HeaderValue::from_str(error) {
        h.insert(PROXY_ERROR_HEADER, v);
    }
    resp
}

fn auth_required() -> Response<Body> {
    let mut r = text(
        StatusCode::PROXY_AUTHENTICATION_REQUIRED,
        "proxy-auth-required",
        "Proxy authentication required\n",
    );
    r.headers_mut().insert(
        hyper::header::PROXY_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"cowork\""),
    );
    r
}

fn bad_request(body: &'static str) -> Response<Body> {
    text(StatusCode::BAD_REQUEST, "bad-request", body)
}

/// The answer to a failed open.
fn error_response(err: &EgressError) -> Response<Body> {
    match err {
        EgressError::NotAllowed { .. }
        | EgressError::ApiHostPort { .. }
        | EgressError::ApiHostSni { .. }
        | EgressError::Forbidden { .. }
        | EgressError::BadHost(_) => text(StatusCode::FORBIDDEN, BLOCKED, BLOCKED_BODY),
        EgressError::AtCapacity { .. } => text(
            StatusCode::TOO_MANY_REQUESTS,
            "connection-limit",
            "Too many open connections for this session\n",
        ),
        EgressError::Timeout { .. } => text(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream-timeout",
            "Upstream did not answer in time\n",
        ),
        _ => text(
            StatusCode::BAD_GATEWAY,
            "upstream-unreachable",
            "Upstream unreachable\n",
        ),
    }
}

/// The grant named by a `Proxy-Authorization: Basic` header, if live.
fn authenticate(shared: &Shared, headers: &HeaderMap) -> Option<Grant> {
    let value = headers
        .get(hyper::header::PROXY_AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, b64) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    let colon = raw.iter().position(|&b| b == b':')?;
    shared.registry.lookup(&raw[colon + 1..])
}

/// Where an absolute-form request goes: its URI's authority, never `Host`.
/// `Err` carries the 400 body.
pub fn absolute_target(uri: &Uri) -> Result<(Host, u16), &'static str> {
    match uri.scheme_str() {
        Some(s) if s.eq_ignore_ascii_case("http") => {}
        Some(_) => return Err("Only http:// URIs are proxied; use CONNECT for https\n"),
        None => return Err("This is a proxy: send an absolute URI or CONNECT\n"),
    }
    let authority = uri.authority().ok_or("The URI has no host\n")?;
    if authority.as_str().contains('@') {
        return Err("Userinfo in the URI is not accepted\n");
    }
    let host = Host::parse(authority.host()).map_err(|_| "Bad host in the URI\n")?;
    let port = match authority.port_u16() {
        Some(0) => return Err("Bad port in the URI\n"),
        Some(p) => p,
        None => 80,
    };
    Ok((host, port))
}

/// Serves HTTP/1 on `io` until the client closes.
pub(crate) async fn serve<S>(shared: Arc<Shared>, io: S) -> Result<(), EgressError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let handshake_timeout = shared.config.handshake_timeout;
    let service = hyper::service::service_fn(move |req| {
        let shared = shared.clone();
        async move { Ok::<_, std::convert::Infallible>(handle(shared, req).await) }
    });
    hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(handshake_timeout)
        .max_buf_size(MAX_REQUEST_HEAD_BYTES)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades()
        .await
        .map_err(|e| EgressError::Http(e.to_string()))
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    if req.method() != Method::CONNECT && req.uri().scheme().is_none() {
        return bad_request("This is a proxy: send an absolute URI or CONNECT\n");
    }
    let Some(grant) = authenticate(&shared, req.headers()) else {
        shared.log_refusal(None, "-", 0, "missing or invalid proxy credential");
        return auth_required();
    };
    if req.method() == Method::CONNECT {
        connect(shared, grant, req).await
    } else {
        forward(shared, grant, req).await
    }
}

async fn connect(shared: Arc<Shared>, grant: Grant, req: Request<Incoming>) -> Response<Body> {
    let target = req.uri().to_string();
    let (host, port) = match parse_authority(&target) {
        Ok(v) => v,
        Err(_) => {
            shared.log_refusal(Some(&grant.session), &target, 0, "malformed CONNECT target");
            return bad_request("CONNECT needs host:port\n");
        }
    };
    let (upstream, slot) = match shared.open(&grant, &host, port).await {
        Ok(v) => v,
        Err(e) => return error_response(&e),
    };
    tokio::spawn(async move {
        match hyper::upgrade::on(req).await {
            Ok(upgraded) => {
                let client = TokioIo::new(upgraded);
                super::tunnel(shared, grant, host, port, client, upstream, slot).await;
            }
            Err(e) => tracing::debug!(error = %e, "CONNECT upgrade failed"),
        }
    });
    Response::new(Full::new(Bytes::new()).map_err(|n| match n {}).boxed())
}

async fn forward(shared: Arc<Shared>, grant: Grant, req: Request<Incoming>) -> Response<Body> {
    let (host, port) = match absolute_target(req.uri()) {
        Ok(v) => v,
        Err(body) => return bad_request(body),
    };
    let (upstream, slot) = match shared.open(&grant, &host, port).await {
        Ok(v) => v,
        Err(e) => return error_response(&e),
    };
    let (mut parts, body) = req.into_parts();
    let host_header = match port {
        80 => host.to_string(),
        p => format!("{host}:{p}"),
    };
    strip_hop_by_hop(&mut parts.headers);
    if let Ok(v) = HeaderValue::from_str(&host_header) {
        parts.headers.insert(hyper::header::HOST, v);
    }
    let origin = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "/".to_owned());
    parts.uri = match origin.parse() {
        Ok(u) => u,
        Err(_) => return bad_request("Bad request target\n"),
    };
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
            Ok(v) => v,
            Err(e) => return error_response(&EgressError::Http(e.to_string())),
        };
    tokio::spawn(async move {
        let _slot = slot;
        let _ = conn.await;
    });
    match sender.send_request(Request::from_parts(parts, body)).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, body.boxed())
        }
        Err(e) => {
            tracing::debug!(error = %e, "forwarded request failed");
            error_response(&EgressError::Http(e.to_string()))
        }
    }
}

/// Removes hop-by-hop headers, including those a `Connection` header names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    for n in HOP_BY_HOP {
        headers.remove(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(uri: &str) -> Result<(Host, u16), &'static str> {
        absolute_target(&uri.parse::<Uri>().unwrap())
    }

    #[test]
    fn absolute_form_is_keyed_on_the_uri() {
        assert_eq!(
            target("http://Allowed.Example/x?y").unwrap(),
            (Host::Name("allowed.example".into()), 80)
        );
        assert_eq!(
            target("http://allowed.example:8080/").unwrap(),
            (Host::Name("allowed.example".into()), 8080)
        );
        assert_eq!(
            target("http://[fd00::2]:81/").unwrap(),
            (Host::Ip("fd00::2".parse().unwrap()), 81)
        );
        assert!(target("https://allowed.example/").is_err());
        assert!(target("http://user@allowed.example/").is_err());
        assert!(target("http://allowed.example:0/").is_err());
        assert!(target("/just/a/path").is_err());
        assert!(target("http://127.1/").is_err());
    }

    #[test]
    fn request_host_header_does_not_choose_the_target() {
        // The policy input is the URI; a Host header naming another site
        // changes nothing, and the forwarded Host is rewritten.
        let req = Request::builder()
            .uri("http://allowed.example/")
            .header("host", "denied.example")
            .body(())
            .unwrap();
        assert_eq!(
            absolute_target(req.uri()).unwrap().0,
            Host::Name("allowed.example".into())
        );
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("proxy-authorization", HeaderValue::from_static("Basic abc"));
        h.insert("x-keep", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-keep"));
    }
}
