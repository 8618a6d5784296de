//! One TCP socket's inode by its exact addresses, through the kernel's
//! socket diagnostics (`NETLINK_SOCK_DIAG`, an "exact" `inet_diag` request):
//! a single hash lookup in the kernel, where reading `/proc/net/tcp`
//! prints every socket of the namespace (milliseconds with a thousand
//! sockets, time-wait ones included).
//!
//! [`super::attrib`] uses it first and falls back to the procfs tables on
//! any failure. "Not found" cannot be told apart from "no `tcp_diag`
//! handler" (both are `ENOENT`; the Debian cloud kernel builds `inet_diag`
//! and `tcp_diag` as modules, which a VM may not load), so the caller marks
//! the lookup unusable ([`Diag::disable`]) when the tables then find a
//! socket it missed, and asks only the tables from then on.
//!
//! Limits: TCP only; the calling thread's network namespace.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::sys;

/// `SOCK_DIAG_BY_FAMILY`: the request and answer message type.
const SOCK_DIAG_BY_FAMILY: u16 = 20;

/// `NLMSG_ERROR`: an error (or acknowledgement) answer.
const NLMSG_ERROR: u16 = 2;

/// `INET_DIAG_NOCOOKIE`: match any socket cookie.
const NO_COOKIE: u32 = !0;

/// Every TCP state (`idiag_states` bit mask).
const ALL_STATES: u32 = !0;

/// Length of `struct nlmsghdr`.
const NLMSG_HDR_LEN: usize = 16;

/// Length of `struct inet_diag_req_v2`.
const REQ_LEN: usize = 56;

/// Offset of `idiag_inode` in `struct inet_diag_msg` (family, state,
/// timer, retrans: 4 bytes; sockid: 48; expires, rqueue, wqueue, uid: 16).
const MSG_INODE_OFFSET: usize = 68;

/// Bound on waiting for the kernel's answer (it answers synchronously; this
/// only keeps a broken netlink from hanging a blocking thread).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(1);

/// Answer buffer: one `inet_diag_msg` with no extensions, or an error.
const ANSWER_BUF: usize = 8192;

/// The exact lookup, with its "usable" switch.
#[derive(Debug)]
pub struct Diag {
    usable: AtomicBool,
}

impl Default for Diag {
    fn default() -> Self {
        Self::new()
    }
}

impl Diag {
    pub fn new() -> Self {
        Self {
            usable: AtomicBool::new(true),
        }
    }

    /// Whether lookups are still tried.
    pub fn is_usable(&self) -> bool {
        self.usable.load(Ordering::Relaxed)
    }

    /// Stops trying (the kernel cannot answer; see the module doc).
    pub fn disable(&self) {
        if self.usable.swap(false, Ordering::Relaxed) {
            tracing::debug!("socket diagnostics do not know TCP here (no tcp_diag); attribution reads /proc/net/tcp");
        }
    }

    /// The inode of the TCP socket whose local address is `local` and
    /// remote address is `remote`: `Ok(None)` when the kernel knows none
    /// (or cannot look: see the module doc) or lookups were disabled.
    pub fn inode(&self, local: SocketAddr, remote: SocketAddr) -> io::Result<Option<u64>> {
        if !self.is_usable() {
            return Ok(None);
        }
        lookup(local, remote)
    }
}

/// Both families a connection between `local` and `remote` may live in:
/// IPv4 as itself, and as IPv4-mapped on a dual-stack IPv6 socket.
fn candidates(local: SocketAddr, remote: SocketAddr) -> Vec<(u8, [u8; 16], [u8; 16])> {
    let bytes = |ip: IpAddr| -> ([u8; 16], [u8; 16]) {
        match ip {
            IpAddr::V4(v4) => {
                let mut plain = [0u8; 16];
                plain[..4].copy_from_slice(&v4.octets());
                (plain, v4.to_ipv6_mapped().octets())
            }
            IpAddr::V6(v6) => (v6.octets(), v6.octets()),
        }
    };
    let (l_plain, l_mapped) = bytes(local.ip());
    let (r_plain, r_mapped) = bytes(remote.ip());
    match (local.ip(), remote.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => vec![
            (libc::AF_INET as u8, l_plain, r_plain),
            (libc::AF_INET6 as u8, l_mapped, r_mapped),
        ],
        _ => vec![(libc::AF_INET6 as u8, l_mapped, r_mapped)],
    }
}

/// The request message for one family.
pub fn request(family: u8, local: ([u8; 16], u16), remote: ([u8; 16], u16), seq: u32) -> Vec<u8> {
    let total = NLMSG_HDR_LEN + REQ_LEN;
    let mut m = Vec::with_capacity(total);
    m.extend_from_slice(&(total as u32).to_ne_bytes());
    m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    // inet_diag_req_v2
    m.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    m.extend_from_slice(&ALL_STATES.to_ne_bytes());
    // inet_diag_sockid: ports and addresses in network order.
    m.extend_from_slice(&local.1.to_be_bytes());
    m.extend_from_slice(&remote.1.to_be_bytes());
    m.extend_from_slice(&local.0);
    m.extend_from_slice(&remote.0);
    m.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    m.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    m.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    debug_assert_eq!(m.len(), total);
    m
}

/// Reads the answer: `Ok(Some(inode))`, `Ok(None)` for `ENOENT`, else the
/// error. Malformed answers are `InvalidData`.
pub fn parse_answer(buf: &[u8]) -> io::Result<Option<u64>> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "short sock_diag answer");
    let hdr = buf.get(..NLMSG_HDR_LEN).ok_or_else(bad)?;
    let kind = u16::from_ne_bytes([hdr[4], hdr[5]]);
    let body = &buf[NLMSG_HDR_LEN..];
    match kind {
        NLMSG_ERROR => {
            let code = body.get(..4).ok_or_else(bad)?;
            let code = i32::from_ne_bytes([code[0], code[1], code[2], code[3]]);
            match -code {
                0 => Err(bad()),
                libc::ENOENT => Ok(None),
                errno => Err(io::Error::from_raw_os_error(errno)),
            }
        }
        SOCK_DIAG_BY_FAMILY => {
            let ino = body
                .get(MSG_INODE_OFFSET..MSG_INODE_OFFSET + 4)
                .ok_or_else(bad)?;
            Ok(Some(u64::from(u32::from_ne_bytes([
                ino[0], ino[1], ino[2], ino[3],
            ]))))
        }
        _ => Err(bad()),
    }
}

/// The exact lookup over a new netlink socket.
fn lookup(local: SocketAddr, remote: SocketAddr) -> io::Result<Option<u64>> {
    // SAFETY: plain socket(2).
    let fd = sys::cvt(unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    })?;
    // SAFETY: a new descriptor nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: ANSWER_TIMEOUT.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    // SAFETY: a valid timeval of the given size.
    sys::cvt(unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    })?;
    let mut buf = vec![0u8; ANSWER_BUF];
    for (seq, (family, l, r)) in candidates(local, remote).into_iter().enumerate() {
        let req = request(
            family,
            (l, local.port()),
            (r, remote.port()),
            seq as u32 + 1,
        );
        // SAFETY: sending a valid buffer; the kernel is the default destination.
        let sent = unsafe { libc::send(sock.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: receiving into a valid buffer of its length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if let Some(inode) = parse_answer(&buf[..n as usize])? {
            return Ok(Some(inode));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn the_request_is_laid_out_as_inet_diag_expects() {
        let mut l = [0u8; 16];
        l[..4].copy_from_slice(&[198, 18, 0, 7]);
        let r = [0u8; 16];
        let m = request(libc::AF_INET as u8, (l, 40000), (r, 443), 9);
        assert_eq!(m.len(), 72);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 72);
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), SOCK_DIAG_BY_FAMILY);
        assert_eq!(u32::from_ne_bytes(m[8..12].try_into().unwrap()), 9);
        assert_eq!(&m[16..20], &[libc::AF_INET as u8, 6, 0, 0]);
        assert_eq!(&m[24..26], &40000u16.to_be_bytes());
        assert_eq!(&m[26..28], &443u16.to_be_bytes());
        assert_eq!(&m[28..32], &[198, 18, 0, 7]);
        assert_eq!(&m[64..72], &[0xff; 8], "no cookie");
    }

    #[test]
    fn answers_are_parsed_and_odd_ones_refused() {
        let mut ok = vec![0u8; NLMSG_HDR_LEN + 72];
        ok[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        ok[NLMSG_HDR_LEN + MSG_INODE_OFFSET..][..4].copy_from_slice(&4242u32.to_ne_bytes());
        assert_eq!(parse_answer(&ok).unwrap(), Some(4242));
        let mut err = vec![0u8; NLMSG_HDR_LEN + 4];
        err[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        err[16..20].copy_from_slice(&(-libc::ENOENT).to_ne_bytes());
        assert_eq!(parse_answer(&err).unwrap(), None);
        err[16..20].copy_from_slice(&(-libc::EPERM).to_ne_bytes());
        assert_eq!(
            parse_answer(&err).unwrap_err().raw_os_error(),
            Some(libc::EPERM)
        );
        for short in [&ok[..10], &ok[..NLMSG_HDR_LEN + 70], &err[..18]] {
            assert!(parse_answer(short).is_err());
        }
    }

    /// A real connection of this process: the kernel's answer is the inode
    /// behind the client's descriptor (when this kernel has tcp_diag).
    #[test]
    fn a_real_socket_is_found_by_its_addresses() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_accepted, _) = listener.accept().unwrap();
        let (local, remote) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        let want = std::fs::metadata(format!("/proc/self/fd/{}", client.as_raw_fd()))
            .unwrap()
            .ino();
        let diag = Diag::new();
        match diag.inode(local, remote).unwrap() {
            Some(inode) => assert_eq!(inode, want),
            None => eprintln!("SKIPPED: this kernel's socket diagnostics know no TCP"),
        }
        // Nothing on an unused port; a disabled lookup asks nothing.
        let none: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(diag.inode(local, none).unwrap(), None);
        diag.disable();
        assert_eq!(diag.inode(local, remote).unwrap(), None);
    }
}
