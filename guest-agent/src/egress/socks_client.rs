//! A SOCKS5 client (RFC 1928) with username/password authentication
//! (RFC 1929): how the agent asks the host's egress proxy for a captured
//! connection's destination on behalf of the spawn that made it.
//!
//! The exchange, one step at a time (the host answers each before the next
//! is sent):
//!
//! ```text
//! -> 05 01 02                      version, one method: username/password
//! <- 05 02
//! -> 01 ulen user plen pass        RFC 1929
//! <- 01 00                         (anything else: refused)
//! -> 05 01 00 atyp addr port       CONNECT, by name (03) or IPv4 (01)
//! <- 05 rep 00 atyp addr port      rep 00: connected; the stream is then raw
//! ```
//!
//! Limits: CONNECT only; only the username/password method is offered (the
//! host requires it); names of 1 to 255 bytes.

use std::io;
use std::net::Ipv4Addr;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::spawns::ProxyCredential;

/// SOCKS protocol version byte.
const VERSION: u8 = 0x05;
/// Method: username/password (RFC 1929).
const METHOD_USERPASS: u8 = 0x02;
/// Version byte of the RFC 1929 subnegotiation.
const USERPASS_VERSION: u8 = 0x01;
/// Command: CONNECT.
const CMD_CONNECT: u8 = 0x01;
/// Address types.
const ATYP_V4: u8 = 0x01;
const ATYP_NAME: u8 = 0x03;
const ATYP_V6: u8 = 0x04;
/// Longest name ATYP 3 can carry (one length byte).
pub const MAX_NAME_BYTES: usize = 255;

/// Where to connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// By name (ATYP 3): the host resolves it and applies its policy to it.
    Name(String, u16),
    /// By IPv4 address (ATYP 1).
    V4(Ipv4Addr, u16),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Name(n, p) => write!(f, "{n}:{p}"),
            Target::V4(a, p) => write!(f, "{a}:{p}"),
        }
    }
}

/// Errors of the handshake; none carries the credential.
#[derive(Debug, thiserror::Error)]
pub enum SocksError {
    #[error("SOCKS5 exchange with the egress proxy failed: {0}")]
    Io(#[from] io::Error),
    #[error("the egress proxy does not speak SOCKS5 (version byte {0:#04x})")]
    NotSocks5(u8),
    #[error("the egress proxy accepts no username/password authentication")]
    NoAcceptableMethod,
    #[error("the egress proxy refused the spawn's credential")]
    AuthRejected,
    #[error("the name {0:?} cannot be sent (1 to {MAX_NAME_BYTES} bytes)")]
    BadName(String),
    #[error("the egress proxy refused the connection to {target}: {reason}")]
    Refused {
        target: Target,
        reason: &'static str,
    },
    #[error("the egress proxy sent an unknown address type {0}")]
    BadReply(u8),
}

impl SocksError {
    /// Whether the proxy decided against the request (as opposed to a
    /// broken exchange).
    pub fn is_refusal(&self) -> bool {
        matches!(self, SocksError::Refused { .. } | SocksError::AuthRejected)
    }
}

/// The RFC 1928 meaning of a reply code.
pub fn reply_reason(code: u8) -> &'static str {
    match code {
        0x01 => "general failure",
        0x02 => "not allowed by the network allowlist",
        0x03 => "network unreachable",
        0x04 => "host unreachable",
        0x05 => "connection refused",
        0x06 => "TTL expired",
        0x07 => "command not supported",
        0x08 => "address type not supported",
        _ => "unknown reply code",
    }
}

/// Runs the handshake on `stream` (a fresh stream to the proxy). On `Ok`
/// the stream carries the connection to `target`.
pub async fn connect<S>(
    stream: &mut S,
    target: &Target,
    cred: &ProxyCredential,
) -> Result<(), SocksError>
where
    S: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let request = encode_connect(target)?;
    let (Ok(ulen), Ok(plen)) = (
        u8::try_from(cred.username.len()),
        u8::try_from(cred.password.len()),
    ) else {
        return Err(SocksError::AuthRejected);
    };
    stream.write_all(&[VERSION, 1, METHOD_USERPASS]).await?;
    let mut two = [0u8; 2];
    stream.read_exact(&mut two).await?;
    if two[0] != VERSION {
        return Err(SocksError::NotSocks5(two[0]));
    }
    if two[1] != METHOD_USERPASS {
        return Err(SocksError::NoAcceptableMethod);
    }
    let mut auth = Vec::with_capacity(3 + cred.username.len() + cred.password.len());
    auth.push(USERPASS_VERSION);
    auth.push(ulen);
    auth.extend_from_slice(&cred.username);
    auth.push(plen);
    auth.extend_from_slice(&cred.password);
    stream.write_all(&auth).await?;
    stream.read_exact(&mut two).await?;
    if two != [USERPASS_VERSION, 0x00] {
        return Err(SocksError::AuthRejected);
    }
    stream.write_all(&request).await?;
    let mut head = [0u8; 4];
    stream.read_exact(&mut head).await?;
    if head[0] != VERSION {
        return Err(SocksError::NotSocks5(head[0]));
    }
    // The bound address follows even on failure; read it so nothing of the
    // reply is left in the stream.
    let addr_len = match head[3] {
        ATYP_V4 => 4,
        ATYP_V6 => 16,
        ATYP_NAME => usize::from(stream.read_u8().await?),
        other => return Err(SocksError::BadReply(other)),
    };
    let mut rest = vec![0u8; addr_len + 2];
    stream.read_exact(&mut rest).await?;
    if head[1] != 0x00 {
        return Err(SocksError::Refused {
            target: target.clone(),
            reason: reply_reason(head[1]),
        });
    }
    Ok(())
}

/// The CONNECT request for `target`.
fn encode_connect(target: &Target) -> Result<Vec<u8>, SocksError> {
    let mut req = vec![VERSION, CMD_CONNECT, 0x00];
    let port = match target {
        Target::Name(name, port) => {
            let len = u8::try_from(name.len())
                .ok()
                .filter(|&l| l > 0)
                .ok_or_else(|| SocksError::BadName(name.clone()))?;
            req.push(ATYP_NAME);
            req.push(len);
            req.extend_from_slice(name.as_bytes());
            *port
        }
        Target::V4(addr, port) => {
            req.push(ATYP_V4);
            req.extend_from_slice(&addr.octets());
            *port
        }
    };
    req.extend_from_slice(&port.to_be_bytes());
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::duplex;

    fn cred() -> ProxyCredential {
        ProxyCredential {
            username: b"sess".to_vec(),
            password: b"s3cret".to_vec(),
        }
    }

    /// A tiny SOCKS5 server: checks every byte the client sends, answers
    /// with `method`, `auth_status` and `rep`, and returns the CONNECT
    /// request's bytes after the header.
    async fn server<S: AsyncRead + AsyncWrite + Unpin>(
        mut s: S,
        method: u8,
        auth_status: u8,
        rep: u8,
    ) -> Option<Vec<u8>> {
        let mut greet = [0u8; 3];
        s.read_exact(&mut greet).await.unwrap();
        assert_eq!(greet, [5, 1, 2]);
        s.write_all(&[5, method]).await.unwrap();
        if method != 2 {
            return None;
        }
        let mut auth = [0u8; 1 + 1 + 4 + 1 + 6];
        s.read_exact(&mut auth).await.unwrap();
        assert_eq!(&auth, b"\x01\x04sess\x06s3cret");
        s.write_all(&[1, auth_status]).await.unwrap();
        if auth_status != 0 {
            return None;
        }
        let mut head = [0u8; 4];
        s.read_exact(&mut head).await.unwrap();
        assert_eq!(&head[..3], &[5, 1, 0]);
        let mut out = vec![head[3]];
        let mut addr = match head[3] {
            1 => vec![0u8; 4 + 2],
            3 => {
                let n = s.read_u8().await.unwrap();
                out.push(n);
                vec![0u8; usize::from(n) + 2]
            }
            t => panic!("atyp {t}"),
        };
        s.read_exact(&mut addr).await.unwrap();
        out.extend_from_slice(&addr);
        // A reply with a name-typed bound address, to exercise its parsing.
        s.write_all(&[5, rep, 0, 3, 3, b'a', b'b', b'c', 0, 1])
            .await
            .unwrap();
        if rep == 0 {
            s.write_all(b"tunnel").await.unwrap();
            let mut x = [0u8; 4];
            s.read_exact(&mut x).await.unwrap();
            assert_eq!(&x, b"ping");
        }
        Some(out)
    }

    #[tokio::test]
    async fn connect_by_name_then_the_stream_is_raw() {
        let (mut c, s) = duplex(1024);
        let srv = tokio::spawn(server(s, 2, 0, 0));
        let t = Target::Name("api.example.com".into(), 443);
        connect(&mut c, &t, &cred()).await.unwrap();
        let mut x = [0u8; 6];
        c.read_exact(&mut x).await.unwrap();
        assert_eq!(&x, b"tunnel");
        c.write_all(b"ping").await.unwrap();
        let req = srv.await.unwrap().unwrap();
        let mut want = vec![3, 15];
        want.extend_from_slice(b"api.example.com");
        want.extend_from_slice(&[0x01, 0xbb]);
        assert_eq!(req, want);
    }

    #[tokio::test]
    async fn connect_by_ipv4_address() {
        let (mut c, s) = duplex(1024);
        let srv = tokio::spawn(server(s, 2, 0, 0));
        let t = Target::V4(Ipv4Addr::new(192, 0, 2, 7), 22);
        connect(&mut c, &t, &cred()).await.unwrap();
        let mut x = [0u8; 6];
        c.read_exact(&mut x).await.unwrap();
        c.write_all(b"ping").await.unwrap();
        assert_eq!(srv.await.unwrap().unwrap(), vec![1, 192, 0, 2, 7, 0, 22]);
    }

    #[tokio::test]
    async fn refusals_are_told_apart_and_never_show_the_credential() {
        let t = Target::Name("denied.example".into(), 443);
        let (mut c, s) = duplex(1024);
        tokio::spawn(server(s, 2, 0, 2));
        let err = connect(&mut c, &t, &cred()).await.unwrap_err();
        assert!(err.is_refusal());
        let text = err.to_string();
        assert!(
            text.contains("allowlist") && text.contains("denied.example:443"),
            "{text}"
        );
        assert!(!text.contains("s3cret"));

        let (mut c, s) = duplex(1024);
        tokio::spawn(server(s, 2, 1, 0));
        let err = connect(&mut c, &t, &cred()).await.unwrap_err();
        assert!(matches!(err, SocksError::AuthRejected), "{err}");

        let (mut c, s) = duplex(1024);
        tokio::spawn(server(s, 0xff, 0, 0));
        let err = connect(&mut c, &t, &cred()).await.unwrap_err();
        assert!(matches!(err, SocksError::NoAcceptableMethod), "{err}");
        assert!(!err.is_refusal());
    }

    #[tokio::test]
    async fn a_non_socks_peer_and_bad_names_fail_cleanly() {
        let (mut c, mut s) = duplex(1024);
        tokio::spawn(async move {
            let mut g = [0u8; 3];
            s.read_exact(&mut g).await.unwrap();
            s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                .await
                .unwrap();
        });
        let t = Target::V4(Ipv4Addr::LOCALHOST, 80);
        let err = connect(&mut c, &t, &cred()).await.unwrap_err();
        assert!(matches!(err, SocksError::NotSocks5(b'H')), "{err}");
        // Closed mid-handshake: an I/O error, not a hang.
        let (mut c, s) = duplex(1024);
        drop(s);
        let err = connect(&mut c, &t, &cred()).await.unwrap_err();
        assert!(matches!(err, SocksError::Io(_)), "{err}");
        // Names that do not fit are refused before anything is sent.
        let (mut c, _s) = duplex(1024);
        for name in [String::new(), "a".repeat(256)] {
            let err = connect(&mut c, &Target::Name(name, 1), &cred())
                .await
                .unwrap_err();
            assert!(matches!(err, SocksError::BadName(_)), "{err}");
        }
    }
}
