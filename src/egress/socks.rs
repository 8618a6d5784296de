//! SOCKS5 (RFC 1928) with username/password authentication (RFC 1929):
//! our own small parser, since the permissively licensed crates either do
//! their own dialing or are GPL.
//!
//! Only CONNECT is served; BIND and UDP ASSOCIATE get "command not
//! supported" (0x07). The only method accepted is username/password: the
//! password is the spawn's credential, the username is ignored. Addresses may
//! be IPv4 (ATYP 1), a name (ATYP 3) or IPv6 (ATYP 4); the policy sees names
//! as names, so stage-2 capture can send flows by name.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::host::Host;
use super::{EgressError, Shared};

/// Protocol version byte of SOCKS5; also what the mux looks for.
pub const SOCKS5_VERSION: u8 = 0x05;

/// RFC 1929 sub-negotiation version.
const USERPASS_VERSION: u8 = 0x01;

/// Method: username/password (RFC 1929).
const METHOD_USERPASS: u8 = 0x02;

/// Method: none acceptable.
const METHOD_NONE_ACCEPTABLE: u8 = 0xff;

const CMD_CONNECT: u8 = 0x01;
const ATYP_V4: u8 = 0x01;
const ATYP_NAME: u8 = 0x03;
const ATYP_V6: u8 = 0x04;

/// Reply codes (RFC 1928 §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Reply {
    Succeeded = 0x00,
    GeneralFailure = 0x01,
    NotAllowed = 0x02,
    NetworkUnreachable = 0x03,
    HostUnreachable = 0x04,
    ConnectionRefused = 0x05,
    CommandNotSupported = 0x07,
    AddressTypeNotSupported = 0x08,
}

/// A parsed request.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    Connect(Host, u16),
    /// BIND, UDP ASSOCIATE or anything else.
    Unsupported(u8),
    BadAddressType(u8),
    /// A name that is no valid destination (refused by policy).
    BadName,
}

/// Reads the method list (after the version byte) and says whether
/// username/password was offered.
pub async fn read_methods<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<bool> {
    let n = r.read_u8().await?;
    let mut methods = vec![0u8; usize::from(n)];
    r.read_exact(&mut methods).await?;
    Ok(methods.contains(&METHOD_USERPASS))
}

/// Reads an RFC 1929 request; returns the password (the username is
/// ignored). `None` on a wrong sub-negotiation version.
pub async fn read_userpass<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Option<Vec<u8>>> {
    let ver = r.read_u8().await?;
    let ulen = r.read_u8().await?;
    let mut user = vec![0u8; usize::from(ulen)];
    r.read_exact(&mut user).await?;
    let plen = r.read_u8().await?;
    let mut pass = vec![0u8; usize::from(plen)];
    r.read_exact(&mut pass).await?;
    Ok((ver == USERPASS_VERSION).then_some(pass))
}

/// Reads a request (VER CMD RSV ATYP DST.ADDR DST.PORT). Errors only on I/O
/// or a wrong version; odd content is a [`Request`] variant to answer.
pub async fn read_request<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Request> {
    let mut head = [0u8; 4];
    r.read_exact(&mut head).await?;
    let [ver, cmd, _rsv, atyp] = head;
    if ver != SOCKS5_VERSION {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a SOCKS5 request",
        ));
    }
    let host = match atyp {
        ATYP_V4 => {
            let mut a = [0u8; 4];
            r.read_exact(&mut a).await?;
            Some(Host::Ip(IpAddr::V4(Ipv4Addr::from(a))))
        }
        ATYP_V6 => {
            let mut a = [0u8; 16];
            r.read_exact(&mut a).await?;
            Some(Host::Ip(IpAddr::V6(Ipv6Addr::from(a))))
        }
        ATYP_NAME => {
            let len = r.read_u8().await?;
            let mut name = vec![0u8; usize::from(len)];
            r.read_exact(&mut name).await?;
            std::str::from_utf8(&name).ok().and_then(|s| {
                s.parse::<Ipv6Addr>()
                    .map(|a| Host::Ip(IpAddr::V6(a)))
                    .ok()
                    .or_else(|| Host::parse_unbracketed(s).ok())
            })
        }
        other => return Ok(Request::BadAddressType(other)),
    };
    let port = r.read_u16().await?;
    if cmd != CMD_CONNECT {
        return Ok(Request::Unsupported(cmd));
    }
    match host {
        Some(h) if port != 0 => Ok(Request::Connect(h, port)),
        _ => Ok(Request::BadName),
    }
}

/// A reply with an all-zero IPv4 bound address (clients ignore it for
/// CONNECT, and the real one would reveal host addresses).
pub fn reply(code: Reply) -> [u8; 10] {
    [SOCKS5_VERSION, code as u8, 0, ATYP_V4, 0, 0, 0, 0, 0, 0]
}

/// The reply for a failed open.
fn reply_for(err: &EgressError) -> Reply {
    match err {
        EgressError::NotAllowed { .. }
        | EgressError::Forbidden { .. }
        | EgressError::BadHost(_) => Reply::NotAllowed,
        EgressError::Resolve { .. }
        | EgressError::NoAddresses { .. }
        | EgressError::Timeout { .. } => Reply::HostUnreachable,
        EgressError::Connect { source, .. } => match source.kind() {
            std::io::ErrorKind::ConnectionRefused => Reply::ConnectionRefused,
            std::io::ErrorKind::NetworkUnreachable => Reply::NetworkUnreachable,
            _ => Reply::HostUnreachable,
        },
        _ => Reply::GeneralFailure,
    }
}

/// Serves one SOCKS5 connection whose version byte was already read.
pub(crate) async fn serve<S>(shared: Arc<Shared>, mut stream: S) -> Result<(), EgressError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let handshake = async {
        if !read_methods(&mut stream).await? {
            stream
                .write_all(&[SOCKS5_VERSION, METHOD_NONE_ACCEPTABLE])
                .await?;
            shared.log_refusal(None, "-", 0, "SOCKS5 client offered no username/password");
            return Ok(None);
        }
        stream.write_all(&[SOCKS5_VERSION, METHOD_USERPASS]).await?;
        let grant = read_userpass(&mut stream)
            .await?
            .and_then(|pass| shared.registry.lookup(&pass));
        let Some(grant) = grant else {
            stream.write_all(&[USERPASS_VERSION, 0x01]).await?;
            shared.log_refusal(None, "-", 0, "missing or invalid proxy credential");
            return Ok(None);
        };
        stream.write_all(&[USERPASS_VERSION, 0x00]).await?;
        let request = read_request(&mut stream).await?;
        Ok::<_, std::io::Error>(Some((grant, request)))
    };
    let (grant, request) =
        match tokio::time::timeout(shared.config.handshake_timeout, handshake).await {
            Err(_) => return Err(EgressError::HandshakeTimeout),
            Ok(Err(e)) => return Err(EgressError::Io(e)),
            Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(v))) => v,
        };
    let (host, port) = match request {
        Request::Connect(h, p) => (h, p),
        Request::Unsupported(cmd) => {
            shared.log_refusal(
                Some(&grant.session),
                "-",
                0,
                &format!("SOCKS5 command {cmd} refused"),
            );
            stream.write_all(&reply(Reply::CommandNotSupported)).await?;
            return Ok(());
        }
        Request::BadAddressType(_) => {
            stream
                .write_all(&reply(Reply::AddressTypeNotSupported))
                .await?;
            return Ok(());
        }
        Request::BadName => {
            shared.log_refusal(Some(&grant.session), "-", 0, "invalid destination");
            stream.write_all(&reply(Reply::NotAllowed)).await?;
            return Ok(());
        }
    };
    let (upstream, slot) = match shared.open(&grant, &host, port).await {
        Ok(v) => v,
        Err(e) => {
            stream.write_all(&reply(reply_for(&e))).await?;
            return Ok(());
        }
    };
    stream.write_all(&reply(Reply::Succeeded)).await?;
    super::tunnel(shared, grant, host, port, stream, upstream, slot).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn req(bytes: &[u8]) -> std::io::Result<Request> {
        let mut r = bytes;
        read_request(&mut r).await
    }

    #[tokio::test]
    async fn address_types() {
        assert_eq!(
            req(&[5, 1, 0, 1, 10, 0, 0, 2, 0x01, 0xbb]).await.unwrap(),
            Request::Connect(Host::Ip("10.0.0.2".parse().unwrap()), 443)
        );
        let mut v6 = vec![5, 1, 0, 4];
        v6.extend_from_slice(&"fd00::2".parse::<Ipv6Addr>().unwrap().octets());
        v6.extend_from_slice(&[0, 80]);
        assert_eq!(
            req(&v6).await.unwrap(),
            Request::Connect(Host::Ip("fd00::2".parse().unwrap()), 80)
        );
        let mut name = vec![5, 1, 0, 3, 15];
        name.extend_from_slice(b"API.Example.com");
        name.extend_from_slice(&[0x1f, 0x90]);
        assert_eq!(
            req(&name).await.unwrap(),
            Request::Connect(Host::Name("api.example.com".into()), 8080)
        );
        // a name that is an IPv4 text is the literal, not a name
        let mut lit = vec![5, 1, 0, 3, 9];
        lit.extend_from_slice(b"127.0.0.1");
        lit.extend_from_slice(&[0, 80]);
        assert_eq!(
            req(&lit).await.unwrap(),
            Request::Connect(Host::Ip("127.0.0.1".parse().unwrap()), 80)
        );
    }

    #[tokio::test]
    async fn commands_and_malformed_input() {
        // UDP ASSOCIATE and BIND
        assert_eq!(
            req(&[5, 3, 0, 1, 0, 0, 0, 0, 0, 0]).await.unwrap(),
            Request::Unsupported(3)
        );
        assert_eq!(
            req(&[5, 2, 0, 1, 0, 0, 0, 0, 0, 0]).await.unwrap(),
            Request::Unsupported(2)
        );
        assert_eq!(
            req(&[5, 1, 0, 9]).await.unwrap(),
            Request::BadAddressType(9)
        );
        // empty name, bad name, non-UTF-8 name, port 0
        assert_eq!(
            req(&[5, 1, 0, 3, 0, 0, 80]).await.unwrap(),
            Request::BadName
        );
        assert_eq!(
            req(&[5, 1, 0, 3, 3, b'a', b'@', b'b', 0, 80])
                .await
                .unwrap(),
            Request::BadName
        );
        assert_eq!(
            req(&[5, 1, 0, 3, 2, 0xff, 0xfe, 0, 80]).await.unwrap(),
            Request::BadName
        );
        assert_eq!(
            req(&[5, 1, 0, 1, 10, 0, 0, 2, 0, 0]).await.unwrap(),
            Request::BadName
        );
        // truncated and wrong version
        assert!(req(&[5, 1, 0, 1, 10, 0]).await.is_err());
        assert!(req(&[5, 1, 0, 3, 10, b'a']).await.is_err());
        assert!(req(&[4, 1, 0, 1, 10, 0, 0, 2, 0, 80]).await.is_err());
        assert!(req(&[]).await.is_err());
    }

    #[tokio::test]
    async fn greeting_and_auth() {
        let mut r: &[u8] = &[2, 0, 2];
        assert!(read_methods(&mut r).await.unwrap());
        let mut r: &[u8] = &[1, 0];
        assert!(!read_methods(&mut r).await.unwrap());
        let mut r: &[u8] = &[0];
        assert!(!read_methods(&mut r).await.unwrap());
        let mut r: &[u8] = &[3, 0];
        assert!(read_methods(&mut r).await.is_err());
        let mut r: &[u8] = &[1, 1, b'u', 3, b'a', b'b', b'c'];
        assert_eq!(read_userpass(&mut r).await.unwrap(), Some(b"abc".to_vec()));
        let mut r: &[u8] = &[2, 1, b'u', 1, b'a'];
        assert_eq!(read_userpass(&mut r).await.unwrap(), None);
        let mut r: &[u8] = &[1, 5, b'u'];
        assert!(read_userpass(&mut r).await.is_err());
        assert_eq!(reply(Reply::NotAllowed)[1], 0x02);
        assert_eq!(reply(Reply::CommandNotSupported)[1], 0x07);
    }
}
