//! The address guard: addresses no session may reach, whatever its list says.
//!
//! Refused: loopback, unspecified (`0.0.0.0/8`, `::`), link-local
//! (`169.254.0.0/16` with the cloud metadata address, `fe80::/10`), multicast,
//! the IPv4 broadcast address, well-known metadata addresses outside those
//! ranges, and every address currently assigned to one of this host's
//! interfaces. IPv6 forms that carry an IPv4 address (mapped `::ffff:a.b.c.d`,
//! compatible `::a.b.c.d`, NAT64 `64:ff9b::/96`) are judged by that IPv4
//! address. The guard runs on literals and on every resolved address, and the
//! dialer connects only to an address that passed it.
//!
//! Limits: the host's interface addresses are re-read at most every
//! [`OWN_ADDRESSES_TTL`], so an address added in that window is not yet
//! known; private ranges (10/8, 192.168/16, …) are not refused, since
//! corporate services live there.

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use vmm::sync::MutexExt;

/// How long a reading of the host's interface addresses is trusted. Short,
/// because a new interface (a VPN coming up) must be covered quickly; one
/// `getifaddrs` is a netlink dump of a few microseconds.
pub const OWN_ADDRESSES_TTL: Duration = Duration::from_secs(1);

/// Metadata services that sit outside the link-local range: Alibaba Cloud's
/// `100.100.100.200` (inside CGNAT space, which is otherwise allowed).
const METADATA_V4: [Ipv4Addr; 1] = [Ipv4Addr::new(100, 100, 100, 200)];

/// AWS's IPv6 instance metadata address `fd00:ec2::254`.
const METADATA_V6: [Ipv6Addr; 1] = [Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)];

/// The NAT64 well-known prefix `64:ff9b::/96` (RFC 6052): its last 32 bits
/// are an IPv4 address.
const NAT64_PREFIX: [u16; 6] = [0x64, 0xff9b, 0, 0, 0, 0];

/// Why an address is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forbidden {
    Loopback,
    Unspecified,
    LinkLocal,
    Multicast,
    Broadcast,
    Metadata,
    /// Assigned to one of this host's interfaces.
    HostInterface,
    /// The host's interface addresses could not be read: fail closed.
    HostAddressesUnknown,
}

impl Forbidden {
    /// Short reason for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Forbidden::Loopback => "loopback address",
            Forbidden::Unspecified => "unspecified address",
            Forbidden::LinkLocal => "link-local address",
            Forbidden::Multicast => "multicast address",
            Forbidden::Broadcast => "broadcast address",
            Forbidden::Metadata => "cloud metadata address",
            Forbidden::HostInterface => "address of a host interface",
            Forbidden::HostAddressesUnknown => "host addresses unreadable",
        }
    }
}

/// Where the guard reads the host's own addresses from.
type AddressSource = fn() -> io::Result<Vec<IpAddr>>;

struct OwnAddresses {
    addrs: HashSet<IpAddr>,
    read_at: Option<Instant>,
}

/// Decides whether an address may be dialed.
pub struct AddressGuard {
    /// Networks exempt from every check; empty in production.
    test_networks: Vec<(IpAddr, u8)>,
    source: AddressSource,
    own: Mutex<OwnAddresses>,
}

impl std::fmt::Debug for AddressGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddressGuard")
            .field("test_networks", &self.test_networks)
            .finish_non_exhaustive()
    }
}

impl Default for AddressGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl AddressGuard {
    /// The production guard.
    pub fn new() -> Self {
        Self::with_source(Vec::new(), host_addresses)
    }

    /// **Tests and benchmarks only**: a guard that lets the given networks
    /// (`(address, prefix length)`) through every check, loopback included.
    /// Nothing in the daemon calls this.
    #[doc(hidden)]
    pub fn allowing_networks_for_tests(networks: &[(IpAddr, u8)]) -> Self {
        Self::with_source(networks.to_vec(), host_addresses)
    }

    fn with_source(test_networks: Vec<(IpAddr, u8)>, source: AddressSource) -> Self {
        AddressGuard {
            test_networks,
            source,
            own: Mutex::new(OwnAddresses {
                addrs: HashSet::new(),
                read_at: None,
            }),
        }
    }

    /// `Ok` when `ip` may be dialed.
    pub fn check(&self, ip: IpAddr) -> Result<(), Forbidden> {
        if self
            .test_networks
            .iter()
            .any(|(net, len)| in_network(ip, *net, *len))
        {
            return Ok(());
        }
        let addr = canonical(ip);
        if let Some(why) = classify(addr) {
            return Err(why);
        }
        let mut own = self.own.locked();
        let stale = own.read_at.is_none_or(|t| t.elapsed() >= OWN_ADDRESSES_TTL);
        if stale {
            match (self.source)() {
                Ok(list) => {
                    own.addrs = list.into_iter().map(canonical).collect();
                    own.read_at = Some(Instant::now());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the host's interface addresses");
                    return Err(Forbidden::HostAddressesUnknown);
                }
            }
        }
        if own.addrs.contains(&addr) {
            return Err(Forbidden::HostInterface);
        }
        Ok(())
    }
}

/// An IPv6 address that embeds an IPv4 one (mapped, compatible, NAT64) as
/// that IPv4 address; anything else unchanged.
pub fn canonical(ip: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = ip else {
        return ip;
    };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return IpAddr::V4(v4);
    }
    let seg = v6.segments();
    let tail = Ipv4Addr::new(
        (seg[6] >> 8) as u8,
        seg[6] as u8,
        (seg[7] >> 8) as u8,
        seg[7] as u8,
    );
    // `::a.b.c.d` (deprecated compatible form); `::` and `::1` stay IPv6.
    if seg[..6] == [0; 6] && !(seg[6] == 0 && seg[7] <= 1) {
        return IpAddr::V4(tail);
    }
    if seg[..6] == NAT64_PREFIX {
        return IpAddr::V4(tail);
    }
    ip
}

/// The fixed classes (everything but the host's own addresses).
pub fn classify(ip: IpAddr) -> Option<Forbidden> {
    match canonical(ip) {
        IpAddr::V4(a) => {
            if a.is_loopback() {
                Some(Forbidden::Loopback)
            } else if a.octets()[0] == 0 {
                Some(Forbidden::Unspecified)
            } else if METADATA_V4.contains(&a) {
                Some(Forbidden::Metadata)
            } else if a.is_link_local() {
                Some(Forbidden::LinkLocal)
            } else if a.is_multicast() {
                Some(Forbidden::Multicast)
            } else if a.is_broadcast() {
                Some(Forbidden::Broadcast)
            } else {
                None
            }
        }
        IpAddr::V6(a) => {
            if a.is_loopback() {
                Some(Forbidden::Loopback)
            } else if a.is_unspecified() {
                Some(Forbidden::Unspecified)
            } else if METADATA_V6.contains(&a) {
                Some(Forbidden::Metadata)
            } else if a.segments()[0] & 0xffc0 == 0xfe80 {
                Some(Forbidden::LinkLocal)
            } else if a.is_multicast() {
                Some(Forbidden::Multicast)
            } else {
                None
            }
        }
    }
}

/// Whether `ip` lies in `net/len` (same family only).
pub(crate) fn in_network(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let len = u32::from(len.min(32));
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let len = u32::from(len.min(128));
            let mask = if len == 0 {
                0
            } else {
                u128::MAX << (128 - len)
            };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// Every address assigned to an interface of this host (this network
/// namespace), through `getifaddrs(3)`.
pub fn host_addresses() -> io::Result<Vec<IpAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive
        // until freeifaddrs; ifa_addr is null or points to a sockaddr of the
        // family it declares.
        unsafe {
            let addr = (*cur).ifa_addr;
            if !addr.is_null() {
                match i32::from((*addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(addr as *const libc::sockaddr_in);
                        out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                            sin.sin_addr.s_addr,
                        ))));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(addr as *const libc::sockaddr_in6);
                        out.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            cur = (*cur).ifa_next;
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an address")
    }

    fn fixed_own() -> io::Result<Vec<IpAddr>> {
        Ok(vec![ip("10.1.2.3"), ip("2001:db8::3")])
    }

    fn failing_own() -> io::Result<Vec<IpAddr>> {
        Err(io::Error::other("no netlink"))
    }

    #[test]
    fn fixed_classes() {
        let g = AddressGuard::with_source(Vec::new(), fixed_own);
        let table: &[(&str, Option<Forbidden>)] = &[
            ("127.0.0.1", Some(Forbidden::Loopback)),
            ("127.255.1.2", Some(Forbidden::Loopback)),
            ("::1", Some(Forbidden::Loopback)),
            ("0.0.0.0", Some(Forbidden::Unspecified)),
            ("0.1.2.3", Some(Forbidden::Unspecified)),
            ("::", Some(Forbidden::Unspecified)),
            ("169.254.169.254", Some(Forbidden::LinkLocal)),
            ("169.254.0.1", Some(Forbidden::LinkLocal)),
            ("fe80::1", Some(Forbidden::LinkLocal)),
            ("febf::1", Some(Forbidden::LinkLocal)),
            ("224.0.0.1", Some(Forbidden::Multicast)),
            ("239.1.2.3", Some(Forbidden::Multicast)),
            ("ff02::1", Some(Forbidden::Multicast)),
            ("255.255.255.255", Some(Forbidden::Broadcast)),
            ("100.100.100.200", Some(Forbidden::Metadata)),
            ("fd00:ec2::254", Some(Forbidden::Metadata)),
            // embedded IPv4 forms
            ("::ffff:127.0.0.1", Some(Forbidden::Loopback)),
            ("::ffff:169.254.169.254", Some(Forbidden::LinkLocal)),
            ("::ffff:0.0.0.0", Some(Forbidden::Unspecified)),
            ("::127.0.0.1", Some(Forbidden::Loopback)),
            ("64:ff9b::7f00:1", Some(Forbidden::Loopback)),
            ("::ffff:224.0.0.1", Some(Forbidden::Multicast)),
            // host interfaces, plain and embedded
            ("10.1.2.3", Some(Forbidden::HostInterface)),
            ("::ffff:10.1.2.3", Some(Forbidden::HostInterface)),
            ("2001:db8::3", Some(Forbidden::HostInterface)),
            // allowed
            ("10.1.2.4", None),
            ("192.0.2.1", None),
            ("100.64.0.1", None),
            ("2001:db8::4", None),
            ("fec0::1", None),
            ("::ffff:192.0.2.1", None),
        ];
        for (addr, want) in table {
            assert_eq!(g.check(ip(addr)).err(), *want, "{addr}");
        }
    }

    #[test]
    fn unreadable_host_addresses_fail_closed() {
        let g = AddressGuard::with_source(Vec::new(), failing_own);
        assert_eq!(
            g.check(ip("192.0.2.1")),
            Err(Forbidden::HostAddressesUnknown)
        );
        // the fixed classes are still named as such
        assert_eq!(g.check(ip("127.0.0.1")), Err(Forbidden::Loopback));
    }

    #[test]
    fn real_host_addresses_are_refused() {
        let own = host_addresses().expect("getifaddrs");
        assert!(own.contains(&ip("127.0.0.1")), "lo has 127.0.0.1: {own:?}");
        let g = AddressGuard::new();
        for a in own {
            assert!(
                g.check(a).is_err(),
                "{a} is this host's and must be refused"
            );
        }
    }

    #[test]
    fn test_networks_exempt_only_themselves() {
        let g = AddressGuard::allowing_networks_for_tests(&[(ip("127.0.0.0"), 8)]);
        assert_eq!(g.check(ip("127.0.0.1")), Ok(()));
        assert_eq!(g.check(ip("127.9.9.9")), Ok(()));
        assert_eq!(g.check(ip("::1")), Err(Forbidden::Loopback));
        assert_eq!(g.check(ip("169.254.169.254")), Err(Forbidden::LinkLocal));
        assert!(in_network(ip("fd00::1:2"), ip("fd00::"), 64));
        assert!(!in_network(ip("fd01::1"), ip("fd00::"), 64));
        assert!(in_network(ip("1.2.3.4"), ip("9.9.9.9"), 0));
    }
}
