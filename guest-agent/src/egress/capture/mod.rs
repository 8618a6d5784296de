//! Transparent capture of outgoing TCP connections: every connection a
//! program opens to a non-loopback IPv4 address ends up accepted here, with
//! the address it dialled, so the relay can carry it to the host's proxy.
//!
//! [`install`] (needs `CAP_NET_ADMIN` in the current network namespace;
//! lo must be up):
//! 1. adds the route `local 0.0.0.0/0 dev lo table local` (submodule
//!    `rtnl`): every IPv4 address becomes local, so connections are
//!    delivered to this machine instead of failing with `ENETUNREACH`;
//! 2. binds one listener on `127.0.0.1:<ephemeral>` and attaches an
//!    `sk_lookup` BPF program (submodule `bpf`) that hands it every TCP SYN
//!    whose destination is outside `127.0.0.0/8`, whatever the port
//!    ([`CaptureMode::SkLookup`]);
//! 3. when BPF is unavailable (a user namespace gets `EPERM`, an old or
//!    stripped kernel `EINVAL`/`ENOSYS`), listens on `0.0.0.0:<port>` for
//!    each of [`FALLBACK_PORTS`] instead ([`CaptureMode::FixedPorts`]) and
//!    logs one line saying so; connections to other ports are refused.
//!
//! [`Capture::accept`] yields [`Captured`] connections; the accepted
//! socket's local address is the original destination (no `SO_ORIGINAL_DST`
//! or netfilter involved). Connections to `127.0.0.0/8` are never returned
//! (in fixed-port mode a loopback client of one of those ports is closed).
//!
//! Measured (6.18 host, in a fresh namespace): connect + accept through the
//! capture costs the same as to a plain loopback listener, 30-45 µs either
//! way; the tests also pass on the guest's Debian 6.1 cloud kernel.
//!
//! Limits: IPv6 is not captured (there is no IPv6 route, so connecting to a
//! non-loopback IPv6 address fails with `ENETUNREACH`: nothing leaks). UDP
//! is not carried: with the local route a datagram to any address is
//! delivered locally, finds no socket and is answered with ICMP port
//! unreachable. In fixed-port mode those ports cannot be used by local
//! services on any address. The route stays when the [`Capture`] is
//! dropped (connections are then refused); the BPF program goes with it.

mod bpf;
mod rtnl;

use std::future::poll_fn;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;

use tokio::net::{TcpListener, TcpStream};

/// Ports captured when the `sk_lookup` program cannot be loaded:
/// 22 (ssh, git over ssh), 80 (HTTP), 443 (HTTPS), 8080 and 8443 (common
/// alternative HTTP/HTTPS ports of registries and APIs), 9418 (`git://`).
pub const FALLBACK_PORTS: [u16; 6] = [22, 80, 443, 8080, 8443, 9418];

/// Where the `sk_lookup` listener is bound: loopback, ephemeral port. The
/// program selects it for any destination regardless of its own address;
/// loopback keeps it out of reach of anything but this machine.
const STEERED_LISTEN_ADDR: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0);

/// Listen backlog of the capture sockets: every outgoing connection of
/// every session queues here until the relay accepts it.
const LISTEN_BACKLOG: libc::c_int = 1024;

/// How connections are steered to the capture's listeners.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureMode {
    /// One listener, every port, by the `sk_lookup` BPF program.
    SkLookup,
    /// One listener per [`FALLBACK_PORTS`] entry that could be bound.
    FixedPorts,
}

/// A captured connection.
#[derive(Debug)]
pub struct Captured {
    pub stream: TcpStream,
    /// The address and port the program connected to.
    pub original_dst: SocketAddrV4,
    /// The program's end of the connection (its address is the destination
    /// address too: the kernel picks a local route's own address as source).
    pub peer: SocketAddr,
}

/// Errors of installing the capture.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("egress capture: cannot find the loopback interface: {0}")]
    Loopback(io::Error),
    #[error("egress capture: cannot add the route `local 0.0.0.0/0 dev lo table local`: {0} (needs CAP_NET_ADMIN in this network namespace, and lo up)")]
    Route(io::Error),
    #[error("egress capture: cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddrV4,
        source: io::Error,
    },
    #[error("egress capture: none of the fallback ports {FALLBACK_PORTS:?} could be bound ({0}); outgoing TCP connections will be refused")]
    NoFallbackPorts(String),
    #[error("egress capture: install must be called inside the agent's tokio runtime: {0}")]
    Runtime(io::Error),
}

/// The installed capture: its listeners and, in [`CaptureMode::SkLookup`],
/// the BPF objects that keep the steering attached.
#[derive(Debug)]
pub struct Capture {
    mode: CaptureMode,
    listeners: Vec<TcpListener>,
    /// Which listener [`Capture::accept`] polls first (rotates, so one busy
    /// port cannot starve the others).
    next: AtomicUsize,
    _steering: Option<bpf::SkLookup>,
}

/// How [`install_with`] steers connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Steering {
    /// `sk_lookup` when the kernel allows it, else fixed ports.
    Best,
    /// Fixed ports only (tests of the fallback).
    #[cfg(test)]
    FixedPortsOnly,
}

/// Installs the capture in the current thread's network namespace (see the
/// module doc). Must be called inside a tokio runtime.
pub fn install() -> Result<Capture, CaptureError> {
    install_with(Steering::Best)
}

fn install_with(steering: Steering) -> Result<Capture, CaptureError> {
    tokio::runtime::Handle::try_current()
        .map_err(|e| CaptureError::Runtime(io::Error::other(e)))?;
    let lo = rtnl::loopback_index().map_err(CaptureError::Loopback)?;
    rtnl::add_local_default_route(lo).map_err(CaptureError::Route)?;
    let why_not_bpf = match steering {
        Steering::Best => match steer_all_ports() {
            Ok(capture) => {
                tracing::info!(
                    "egress capture: all TCP ports to non-loopback IPv4 addresses (sk_lookup)"
                );
                return Ok(capture);
            }
            Err(why) => why,
        },
        #[cfg(test)]
        Steering::FixedPortsOnly => "fixed ports requested".to_string(),
    };
    let mut listeners = Vec::new();
    let mut bound = Vec::new();
    let mut failures = Vec::new();
    for port in FALLBACK_PORTS {
        let addr = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port);
        match listen(addr) {
            Ok(l) => {
                listeners.push(l);
                bound.push(port);
            }
            Err(e) => {
                tracing::warn!(error = %e, "egress capture: fallback port not captured");
                failures.push(format!("{port}: {}", listen_error_source(&e)));
            }
        }
    }
    if listeners.is_empty() {
        return Err(CaptureError::NoFallbackPorts(failures.join(", ")));
    }
    tracing::warn!(
        ports = ?bound,
        reason = %why_not_bpf,
        "egress capture limited to these TCP ports: the sk_lookup BPF program is unavailable"
    );
    Ok(Capture {
        mode: CaptureMode::FixedPorts,
        listeners,
        next: AtomicUsize::new(0),
        _steering: None,
    })
}

/// The listener on [`STEERED_LISTEN_ADDR`] with the BPF program steering
/// every port to it, or why not (one line, the verifier's words included).
fn steer_all_ports() -> Result<Capture, String> {
    let listener = listen(STEERED_LISTEN_ADDR).map_err(|e| e.to_string())?;
    let steering = bpf::attach(listener.as_fd()).map_err(|f| {
        let mut why = format!("BPF {} failed: {}", f.step, f.source);
        if !f.log.is_empty() {
            why.push_str(&format!(" (verifier: {})", f.log));
        }
        why
    })?;
    Ok(Capture {
        mode: CaptureMode::SkLookup,
        listeners: vec![listener],
        next: AtomicUsize::new(0),
        _steering: Some(steering),
    })
}

/// A tokio listener on `addr` with [`LISTEN_BACKLOG`].
fn listen(addr: SocketAddrV4) -> Result<TcpListener, CaptureError> {
    let err = |source| CaptureError::Listen { addr, source };
    let std_listener = std::net::TcpListener::bind(addr).map_err(err)?;
    // Listening again only changes the backlog.
    // SAFETY: listen(2) on a descriptor we own.
    if unsafe { libc::listen(std_listener.as_raw_fd(), LISTEN_BACKLOG) } != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    std_listener.set_nonblocking(true).map_err(err)?;
    TcpListener::from_std(std_listener).map_err(CaptureError::Runtime)
}

fn listen_error_source(e: &CaptureError) -> String {
    match e {
        CaptureError::Listen { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

impl Capture {
    /// How connections reach this capture.
    pub fn mode(&self) -> CaptureMode {
        self.mode
    }

    /// The ports captured: `None` for all of them ([`CaptureMode::SkLookup`]).
    pub fn ports(&self) -> Option<Vec<u16>> {
        match self.mode {
            CaptureMode::SkLookup => None,
            CaptureMode::FixedPorts => Some(
                self.listeners
                    .iter()
                    .filter_map(|l| l.local_addr().ok().map(|a| a.port()))
                    .collect(),
            ),
        }
    }

    /// The next captured connection, from whichever listener has one.
    /// Connections to loopback addresses are closed and skipped. Errors are
    /// the listener's (`EMFILE` and the like): the caller should back off
    /// briefly and call again. Cancel-safe.
    pub async fn accept(&self) -> io::Result<Captured> {
        loop {
            let (stream, peer) = poll_fn(|cx| {
                let n = self.listeners.len();
                let first = self.next.fetch_add(1, Ordering::Relaxed);
                for i in 0..n {
                    if let Poll::Ready(r) = self.listeners[(first + i) % n].poll_accept(cx) {
                        return Poll::Ready(r);
                    }
                }
                Poll::Pending
            })
            .await?;
            match stream.local_addr()? {
                SocketAddr::V4(dst) if !dst.ip().is_loopback() => {
                    return Ok(Captured {
                        stream,
                        original_dst: dst,
                        peer,
                    })
                }
                dst => tracing::debug!(%dst, %peer, "egress capture: loopback connection closed"),
            }
        }
    }
}

#[cfg(test)]
mod tests;
