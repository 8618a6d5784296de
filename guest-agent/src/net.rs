//! The loopback interface of a VM or a sandbox, set up by the agent as a
//! VM's init (`agent::init`) and by the host's sandbox init
//! (`cowork_helper::backend::sandbox`) alike: bringing an interface up
//! ([`set_link_up`], and [`set_link_up_raw`] for a forked child) and giving
//! it an address ([`add_ipv4_address`]), with the names and the second
//! loopback address both use ([`LOOPBACK`], [`LOOPBACK_ALIAS`],
//! [`SECOND_LOOPBACK_ADDR`]).
//!
//! A library-level module, like [`crate::sys`]: the host takes it from here
//! rather than from the agent's internals. Limits: interface ioctls on an
//! `AF_INET` datagram socket in the caller's network namespace (they need
//! `CAP_NET_ADMIN` over it); IPv4 addresses only.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::sys;

/// The loopback interface.
pub const LOOPBACK: &str = "lo";

/// A second loopback address, added to `lo` as [`LOOPBACK_ALIAS`]. glibc's
/// `getaddrinfo` with `AI_ADDRCONFIG` (`getent ahostsv4`, curl `-4`, python's
/// `socket.create_connection` through it) answers nothing for IPv4 on a
/// system whose only IPv4 address is 127.0.0.1, which it ignores; a VM has
/// no NIC and a sandbox only loopback, so without this the DNS stub's fake
/// addresses would never reach such programs. 127.0.0.2 already belongs to
/// the 127.0.0.0/8 that `lo` serves: it makes nothing new reachable.
pub const SECOND_LOOPBACK_ADDR: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// The interface label of [`SECOND_LOOPBACK_ADDR`] (an alias of `lo`).
pub const LOOPBACK_ALIAS: &str = "lo:1";

/// An `ifreq` naming `name` (at most `IFNAMSIZ - 1` bytes, no NUL), for the
/// interface ioctls. Prepared before a `fork` when the child uses it.
pub fn ifreq_for(name: &str) -> io::Result<libc::ifreq> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a valid interface name",
        ));
    }
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, &src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

/// Sets `IFF_UP` on the interface `req` names (nothing to do when it is up
/// already). Async-signal-safe: raw system calls on the caller's `ifreq`
/// only; returns the raw errno.
pub fn set_link_up_raw(req: &mut libc::ifreq) -> Result<(), i32> {
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    };
    // SAFETY: socket, ioctls on a valid ifreq, close: plain system calls;
    // the flags are the union member SIOCGIFFLAGS just wrote.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(errno());
        }
        let mut result = Ok(());
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, req as *mut libc::ifreq) != 0 {
            result = Err(errno());
        } else if req.ifr_ifru.ifru_flags & libc::IFF_UP as libc::c_short == 0 {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            if libc::ioctl(fd, libc::SIOCSIFFLAGS, req as *mut libc::ifreq) != 0 {
                result = Err(errno());
            }
        }
        libc::close(fd);
        result
    }
}

/// [`set_link_up_raw`] for an interface name (the kernel gives `lo`
/// 127.0.0.1 when it comes up).
pub fn set_link_up(name: &str) -> io::Result<()> {
    let mut req = ifreq_for(name)?;
    set_link_up_raw(&mut req).map_err(io::Error::from_raw_os_error)
}

/// Gives the interface (or alias) `label` the IPv4 address `addr`
/// (`SIOCSIFADDR`); adding an address it has already is harmless.
pub fn add_ipv4_address(label: &str, addr: Ipv4Addr) -> io::Result<()> {
    let mut req = ifreq_for(label)?;
    // SAFETY: socket() takes no pointers; the descriptor is owned at once below.
    let fd =
        sys::cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: a new descriptor owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: a sockaddr_in (16 bytes) fits the ifreq's sockaddr (16 bytes).
    unsafe {
        std::ptr::copy_nonoverlapping(
            (&sin as *const libc::sockaddr_in).cast::<u8>(),
            std::ptr::addr_of_mut!(req.ifr_ifru.ifru_addr).cast::<u8>(),
            std::mem::size_of::<libc::sockaddr_in>(),
        );
    }
    // SAFETY: SIOCSIFADDR reads a valid ifreq.
    sys::cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFADDR, &req) })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_are_checked() {
        assert!(ifreq_for("").is_err());
        assert!(ifreq_for("a-name-that-is-too-long").is_err());
        assert!(ifreq_for("l\0o").is_err());
        let req = ifreq_for("lo").expect("valid");
        assert_eq!(
            &req.ifr_name[..3],
            &[b'l' as libc::c_char, b'o' as libc::c_char, 0]
        );
        assert!(ifreq_for(LOOPBACK_ALIAS).is_ok());
    }
}
