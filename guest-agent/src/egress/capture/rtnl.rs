//! The one route the capture needs, added over a raw rtnetlink socket (no
//! `ip` binary in the guest image): `local 0.0.0.0/0 dev lo table local`.
//!
//! A `local` route makes every address it covers one of this machine's own,
//! so a connection to any IPv4 address is delivered to a local socket (the
//! kernel's "AnyIP"), where the capture's listener takes it; more specific
//! entries (`127.0.0.0/8`) still win. The request is sent with
//! `NLM_F_CREATE | NLM_F_REPLACE` (adding it twice is fine) and the kernel's
//! acknowledgement is checked.
//!
//! Limits: IPv4 only; the route is never removed (without the capture's
//! listener, connections it covers are refused, which is safe).

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// The loopback interface's name.
pub(super) const LOOPBACK: &CStr = c"lo";

/// How long to wait for the kernel's acknowledgement (it answers at once; a
/// bound keeps a wedged socket from hanging the agent's start).
const ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// Sequence number of our one request (matched against the reply).
const SEQ: u32 = 1;

/// Size of `struct nlmsghdr` (`linux/netlink.h`: len, type, flags, seq,
/// pid).
const NLMSG_HDR_LEN: usize = 16;

/// Size of `struct rtmsg` (`linux/rtnetlink.h`: family, dst_len, src_len,
/// tos, table, protocol, scope, type, flags).
const RTMSG_LEN: usize = 12;

/// Size of a route attribute carrying a `u32` (`struct rtattr` len and type,
/// then the value).
const RTA_U32_LEN: usize = 8;

/// Receive buffer for the acknowledgement (an error reply echoes our
/// request after the errno).
const RECV_BUF: usize = 4096;

/// `lo`'s interface index in this network namespace.
pub(super) fn loopback_index() -> io::Result<u32> {
    // SAFETY: a valid NUL-terminated name.
    match unsafe { libc::if_nametoindex(LOOPBACK.as_ptr()) } {
        0 => Err(io::Error::last_os_error()),
        i => Ok(i),
    }
}

/// The `RTM_NEWROUTE` request for `local 0.0.0.0/0 dev <ifindex> table
/// local`.
fn request(ifindex: u32) -> Vec<u8> {
    let len = NLMSG_HDR_LEN + RTMSG_LEN + 2 * RTA_U32_LEN;
    let flags =
        (libc::NLM_F_REQUEST | libc::NLM_F_ACK | libc::NLM_F_CREATE | libc::NLM_F_REPLACE) as u16;
    let mut m = Vec::with_capacity(len);
    // struct nlmsghdr
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&libc::RTM_NEWROUTE.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&SEQ.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel fills it
                                              // struct rtmsg
    m.push(libc::AF_INET as u8); // rtm_family
    m.push(0); // rtm_dst_len: 0.0.0.0/0, so no RTA_DST
    m.push(0); // rtm_src_len
    m.push(0); // rtm_tos
    m.push(libc::RT_TABLE_LOCAL); // rtm_table
    m.push(libc::RTPROT_BOOT); // rtm_protocol, as `ip route add` says
    m.push(libc::RT_SCOPE_HOST); // rtm_scope: local routes are host scope
    m.push(libc::RTN_LOCAL); // rtm_type
    m.extend_from_slice(&0u32.to_ne_bytes()); // rtm_flags
    for (kind, value) in [
        (libc::RTA_TABLE, u32::from(libc::RT_TABLE_LOCAL)),
        (libc::RTA_OIF, ifindex),
    ] {
        m.extend_from_slice(&(RTA_U32_LEN as u16).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&value.to_ne_bytes());
    }
    m
}

/// Adds (or replaces) `local 0.0.0.0/0 dev <ifindex> table local` in this
/// thread's network namespace and waits for the kernel's acknowledgement.
pub(super) fn add_local_default_route(ifindex: u32) -> io::Result<()> {
    // SAFETY: plain socket(2).
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: ACK_TIMEOUT.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    // SAFETY: a valid timeval of the given size.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: sockaddr_nl is plain data; zero is valid (pid 0: the kernel).
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    let msg = request(ifindex);
    // SAFETY: a valid buffer and address of the given sizes.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            msg.as_ptr().cast(),
            msg.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; RECV_BUF];
    loop {
        // SAFETY: a valid buffer of the given size.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if let Some(result) = ack_result(&buf[..n as usize]) {
            return result;
        }
    }
}

/// Finds the acknowledgement of request [`SEQ`] among the messages in one
/// datagram: `Some(Ok)` for errno 0, `Some(Err)` for an error, `None` when
/// this datagram holds no reply to it.
fn ack_result(mut data: &[u8]) -> Option<io::Result<()>> {
    while data.len() >= NLMSG_HDR_LEN {
        let word =
            |at: usize| u32::from_ne_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
        let len = word(0) as usize;
        let kind = u16::from_ne_bytes([data[4], data[5]]);
        let seq = word(8);
        if len < NLMSG_HDR_LEN || len > data.len() {
            return Some(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "malformed rtnetlink reply",
            )));
        }
        if seq == SEQ && i32::from(kind) == libc::NLMSG_ERROR {
            let errno = data
                .get(NLMSG_HDR_LEN..NLMSG_HDR_LEN + 4)
                .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))?;
            return Some(if errno == 0 {
                Ok(())
            } else {
                Err(io::Error::from_raw_os_error(-errno))
            });
        }
        // Messages are padded to 4 bytes (NLMSG_ALIGN).
        let next = (len + 3) & !3;
        data = data.get(next..)?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_is_laid_out_as_rtnetlink_expects() {
        let m = request(1);
        assert_eq!(m.len(), 44);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 44);
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), 24);
        // REQUEST | ACK | REPLACE | CREATE
        assert_eq!(u16::from_ne_bytes(m[6..8].try_into().unwrap()), 0x0505);
        // family AF_INET, /0, table 255, boot, host scope, type local.
        assert_eq!(&m[16..24], &[2, 0, 0, 0, 255, 3, 254, 2]);
        // RTA_TABLE 255, RTA_OIF 1.
        assert_eq!(&m[28..30], &8u16.to_ne_bytes());
        assert_eq!(&m[30..32], &15u16.to_ne_bytes());
        assert_eq!(&m[32..36], &255u32.to_ne_bytes());
        assert_eq!(&m[38..40], &4u16.to_ne_bytes());
        assert_eq!(&m[40..44], &1u32.to_ne_bytes());
    }

    #[test]
    fn acks_errors_and_garbage_are_told_apart() {
        let reply = |seq: u32, kind: u16, errno: i32| {
            let mut r = Vec::new();
            r.extend_from_slice(&20u32.to_ne_bytes());
            r.extend_from_slice(&kind.to_ne_bytes());
            r.extend_from_slice(&0u16.to_ne_bytes());
            r.extend_from_slice(&seq.to_ne_bytes());
            r.extend_from_slice(&0u32.to_ne_bytes());
            r.extend_from_slice(&errno.to_ne_bytes());
            r
        };
        assert!(matches!(ack_result(&reply(SEQ, 2, 0)), Some(Ok(()))));
        let e = ack_result(&reply(SEQ, 2, -libc::EPERM))
            .unwrap()
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        // Another sequence number, then ours, in one datagram.
        let mut two = reply(7, 2, -libc::EINVAL);
        two.extend(reply(SEQ, 2, 0));
        assert!(matches!(ack_result(&two), Some(Ok(()))));
        assert!(ack_result(&reply(7, 2, 0)).is_none());
        assert!(ack_result(&[1, 2, 3]).is_none());
        let mut bad = reply(SEQ, 2, 0);
        bad[0] = 200;
        assert!(matches!(ack_result(&bad), Some(Err(_))));
        // Truncated just after the header: no errno to read.
        assert!(ack_result(&reply(SEQ, 2, 0)[..16]).is_some());
    }
}
