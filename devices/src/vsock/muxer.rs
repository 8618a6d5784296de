//! The connection table: routes guest packets to connections, host streams'
//! readiness to connections, and decides which connection fills the next RX
//! buffer.
//!
//! Connections are keyed by (local port, guest port). A guest REQUEST to a
//! port nobody listens on, a packet for an unknown connection, a packet of an
//! unsupported socket type, or a REQUEST beyond the connection limit is
//! answered with RST (from a bounded backlog of control packets). Host streams
//! sit in an edge-triggered epoll set of their own ([`Muxer::epoll_fd`]),
//! together with the host handle's wake eventfd and a timerfd for connect and
//! close timeouts; the device faces poll that one fd.
//!
//! Limits: [`VsockConfig::max_connections`] connections; at most
//! [`MAX_BACKLOG`] pending RST packets (older ones are dropped when the guest
//! does not post RX buffers); host-initiated connections use local ports from
//! [`EPHEMERAL_PORT_FIRST`] up.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};
use vm_memory::GuestMemory;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;

use super::backend::{ConnectError, Request, Shared, Target};
use super::conn::{Conn, Verdict};
use super::packet::{ChainReader, Header, OP_REQUEST, OP_RST, TYPE_STREAM, VSOCK_HOST_CID};
use super::VsockConfig;

/// First local port handed to host-initiated connections (the start of the
/// IANA dynamic range).
pub const EPHEMERAL_PORT_FIRST: u32 = 49152;
/// Most RST packets waiting for RX buffers.
pub const MAX_BACKLOG: usize = 1024;
/// Largest payload of one RX packet (Linux's `VIRTIO_VSOCK_MAX_PKT_BUF_SIZE`).
pub const MAX_RX_PAYLOAD: usize = 64 * 1024;

/// epoll token of the host handle's wake eventfd.
const TOKEN_WAKE: u64 = 1;
/// epoll token of the timerfd.
const TOKEN_TIMER: u64 = 2;
/// First epoll token given to a connection.
const TOKEN_FIRST_CONN: u64 = 16;
/// Most epoll events handled per wait.
const EVENTS_PER_WAIT: usize = 64;

/// Key of a connection: (local port, guest port).
type Key = (u32, u32);

/// Errors setting up or running the muxer's event sources.
#[derive(Debug, thiserror::Error)]
pub enum MuxerError {
    /// epoll/timerfd creation or control failed.
    #[error("vsock muxer {what} failed: {source}; check the process fd limit")]
    Os {
        /// Which operation.
        what: &'static str,
        /// OS error.
        source: io::Error,
    },
}

fn os(what: &'static str) -> impl FnOnce(io::Error) -> MuxerError {
    move |source| MuxerError::Os { what, source }
}

fn errno(what: &'static str) -> impl FnOnce(vmm_sys_util::errno::Error) -> MuxerError {
    move |e| MuxerError::Os {
        what,
        source: io::Error::from_raw_os_error(e.errno()),
    }
}

/// Counters for diagnostics and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MuxerStats {
    /// Connections currently open.
    pub connections: usize,
    /// RST packets sent for unknown connections or refused requests.
    pub refused: u64,
    /// Control packets dropped because the backlog was full.
    pub backlog_dropped: u64,
}

/// How many warnings about guest packets (malformed chains, spoofed CIDs,
/// protocol violations) the device logs at warning level before going quiet
/// (debug level), so a hostile guest cannot flood the host log.
pub const WARN_LOG_BUDGET: u32 = 32;

/// The connection table.
pub struct Muxer {
    guest_cid: u64,
    config: VsockConfig,
    host: std::sync::Arc<Shared>,
    conns: HashMap<Key, Conn>,
    tokens: HashMap<u64, Key>,
    next_token: u64,
    next_port: u32,
    rx_ready: VecDeque<Key>,
    backlog: VecDeque<Header>,
    epoll: Epoll,
    timer: TimerFd,
    timer_armed_for: Option<Instant>,
    scratch: Vec<u8>,
    stats: MuxerStats,
    transport_reset_pending: bool,
    /// Warnings about guest packets still logged at warning level (starts
    /// at [`WARN_LOG_BUDGET`]; shared by device, muxer and connections).
    log_budget: std::sync::Arc<AtomicU32>,
}

impl Muxer {
    /// A muxer for a guest with `guest_cid`, serving `host`.
    pub(crate) fn new(
        guest_cid: u64,
        config: VsockConfig,
        host: std::sync::Arc<Shared>,
    ) -> Result<Self, MuxerError> {
        let epoll = Epoll::new().map_err(os("epoll_create"))?;
        let timer = TimerFd::new().map_err(errno("timerfd_create"))?;
        epoll
            .ctl(
                ControlOperation::Add,
                host.wake.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_WAKE),
            )
            .map_err(os("epoll_ctl(wake)"))?;
        epoll
            .ctl(
                ControlOperation::Add,
                timer.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_TIMER),
            )
            .map_err(os("epoll_ctl(timer)"))?;
        Ok(Self {
            guest_cid,
            config,
            host,
            conns: HashMap::new(),
            tokens: HashMap::new(),
            next_token: TOKEN_FIRST_CONN,
            next_port: EPHEMERAL_PORT_FIRST,
            rx_ready: VecDeque::new(),
            backlog: VecDeque::new(),
            epoll,
            timer,
            timer_armed_for: None,
            scratch: vec![0u8; MAX_RX_PAYLOAD],
            stats: MuxerStats::default(),
            transport_reset_pending: false,
            log_budget: std::sync::Arc::new(AtomicU32::new(WARN_LOG_BUDGET)),
        })
    }

    /// The fd that becomes readable when host-side work is pending (host
    /// streams, host requests, timers). Poll it and call
    /// [`Self::process_host_events`].
    pub fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Counters.
    pub fn stats(&self) -> MuxerStats {
        MuxerStats {
            connections: self.conns.len(),
            ..self.stats
        }
    }

    /// The next local port tried for a host-initiated connection (kept
    /// across a snapshot so a restored guest does not see the ports of
    /// connections it may still remember reused at once).
    pub fn next_port(&self) -> u32 {
        self.next_port
    }

    /// Sets [`Self::next_port`] (from a snapshot); a port below
    /// [`EPHEMERAL_PORT_FIRST`] is taken as that.
    pub fn set_next_port(&mut self, port: u32) {
        self.next_port = port.max(EPHEMERAL_PORT_FIRST);
    }

    /// Whether a TRANSPORT_RESET event is owed to the guest; clears it.
    pub fn take_transport_reset(&mut self) -> bool {
        std::mem::take(&mut self.transport_reset_pending)
    }

    /// Whether a TRANSPORT_RESET event is owed to the guest.
    pub fn transport_reset_pending(&self) -> bool {
        self.transport_reset_pending
    }

    /// Whether [`Self::next_rx_packet`] may have something to send.
    pub fn has_rx_work(&self) -> bool {
        !self.backlog.is_empty() || !self.rx_ready.is_empty()
    }

    fn mark_ready(&mut self, key: Key) {
        if let Some(c) = self.conns.get_mut(&key) {
            if !c.queued && c.has_rx_work() {
                c.queued = true;
                self.rx_ready.push_back(key);
            }
        }
    }

    fn push_backlog(&mut self, hdr: Header) {
        if self.backlog.len() >= MAX_BACKLOG {
            self.backlog.pop_front();
            self.stats.backlog_dropped += 1;
        }
        self.backlog.push_back(hdr);
    }

    /// Queues an RST answering `hdr` (addresses swapped).
    fn refuse(&mut self, hdr: &Header, why: &'static str) {
        if hdr.op == OP_RST {
            return;
        }
        debug!(
            src_port = hdr.src_port,
            dst_port = hdr.dst_port,
            op = hdr.op_name(),
            why,
            "vsock: answering with RST"
        );
        self.stats.refused += 1;
        self.push_backlog(Header {
            src_cid: hdr.dst_cid,
            dst_cid: hdr.src_cid,
            src_port: hdr.dst_port,
            dst_port: hdr.src_port,
            kind: hdr.kind,
            op: OP_RST,
            ..Header::default()
        });
    }

    fn register(&mut self, stream: &UnixStream, token: u64) -> io::Result<()> {
        self.epoll.ctl(
            ControlOperation::Add,
            stream.as_raw_fd(),
            EpollEvent::new(
                EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED,
                token,
            ),
        )
    }

    fn insert(&mut self, conn: Conn) -> Result<(), ConnectError> {
        let key = (conn.local_port, conn.peer_port);
        if let Err(e) = self.register(conn.stream(), conn.token) {
            warn!("vsock: cannot poll a host stream: {e}");
            return Err(ConnectError::Reset);
        }
        info!(
            local_port = key.0,
            peer_port = key.1,
            "vsock: connection opened"
        );
        self.tokens.insert(conn.token, key);
        self.conns.insert(key, conn);
        self.mark_ready(key);
        Ok(())
    }

    fn remove(&mut self, key: Key, err: ConnectError) {
        if let Some(mut c) = self.conns.remove(&key) {
            c.abort(err);
            self.tokens.remove(&c.token);
            // Closing the stream removes it from the epoll set.
            info!(
                local_port = key.0,
                peer_port = key.1,
                "vsock: connection closed"
            );
        }
    }

    fn alloc_token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(TOKEN_FIRST_CONN);
        t
    }

    /// The budget of guest-triggered warnings (see [`vmm::guest_log!`]).
    pub fn log_budget(&self) -> &std::sync::Arc<AtomicU32> {
        &self.log_budget
    }

    /// Handles one packet the guest sent on the TX queue; `reader` is
    /// positioned after the header.
    pub fn handle_guest_packet<M: GuestMemory>(
        &mut self,
        hdr: &Header,
        reader: &mut ChainReader<'_, M>,
    ) {
        if hdr.src_cid != self.guest_cid {
            vmm::guest_log!(
                &self.log_budget,
                warn,
                src_cid = hdr.src_cid,
                guest_cid = self.guest_cid,
                "vsock: packet with a spoofed source CID dropped"
            );
            return;
        }
        if hdr.dst_cid != VSOCK_HOST_CID {
            self.refuse(hdr, "destination CID is not the host");
            return;
        }
        if hdr.kind != TYPE_STREAM {
            self.refuse(hdr, "unsupported socket type");
            return;
        }
        let key = (hdr.dst_port, hdr.src_port);
        if hdr.op == OP_REQUEST {
            if self.conns.contains_key(&key) {
                vmm::guest_log!(
                    &self.log_budget,
                    warn,
                    local_port = key.0,
                    peer_port = key.1,
                    "vsock: REQUEST for an existing connection, resetting it"
                );
                self.remove(key, ConnectError::Reset);
                self.refuse(hdr, "duplicate connection");
                return;
            }
            self.accept(hdr);
            return;
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            self.refuse(hdr, "unknown connection");
            return;
        };
        match conn.on_guest_packet(hdr, reader, &mut self.scratch, &self.log_budget) {
            Verdict::Remove => self.remove(key, ConnectError::Refused),
            Verdict::Keep => self.mark_ready(key),
        }
    }

    fn accept(&mut self, hdr: &Header) {
        if self.conns.len() >= self.config.max_connections {
            vmm::guest_log!(
                &self.log_budget,
                warn,
                port = hdr.dst_port,
                limit = self.config.max_connections,
                "vsock: connection limit reached, refusing"
            );
            self.refuse(hdr, "connection limit");
            return;
        }
        let target = self.host.targets().get(&hdr.dst_port).cloned();
        let stream = match target {
            None => {
                self.refuse(hdr, "nobody listens on the port");
                return;
            }
            Some(Target::Channel(tx)) => {
                let (helper, device) = match UnixStream::pair() {
                    Ok(p) => p,
                    Err(e) => {
                        warn!("vsock: cannot create a socketpair: {e}");
                        self.refuse(hdr, "socketpair failed");
                        return;
                    }
                };
                if tx.send(helper).is_err() {
                    self.host.targets().remove(&hdr.dst_port);
                    self.refuse(hdr, "listener dropped");
                    return;
                }
                device
            }
            Some(Target::Unix(path)) => match UnixStream::connect(&path) {
                Ok(s) => s,
                Err(e) => {
                    warn!(port = hdr.dst_port, path = %path.display(), "vsock: cannot reach the mapped host socket: {e}");
                    self.refuse(hdr, "mapped socket unreachable");
                    return;
                }
            },
        };
        if let Err(e) = stream.set_nonblocking(true) {
            warn!("vsock: cannot make a host stream non-blocking: {e}");
            self.refuse(hdr, "host stream setup failed");
            return;
        }
        let token = self.alloc_token();
        let conn = Conn::accepted(hdr, token, stream, self.config.buf_alloc);
        if self.insert(conn).is_err() {
            self.refuse(hdr, "host stream setup failed");
        }
    }

    fn host_connect(
        &mut self,
        port: u32,
        stream: UnixStream,
        reply: std::sync::mpsc::Sender<Result<(), ConnectError>>,
        timeout: Duration,
    ) {
        if self.conns.len() >= self.config.max_connections {
            let _ = reply.send(Err(ConnectError::Limit));
            return;
        }
        let Some(local) = self.alloc_port(port) else {
            let _ = reply.send(Err(ConnectError::Limit));
            return;
        };
        let token = self.alloc_token();
        let conn = Conn::connecting(
            local,
            port,
            token,
            stream,
            self.config.buf_alloc,
            reply.clone(),
            timeout,
        );
        if let Err(e) = self.insert(conn) {
            let _ = reply.send(Err(e));
        }
    }

    /// A free local port for a connection to guest port `peer`.
    fn alloc_port(&mut self, peer: u32) -> Option<u32> {
        let targets = self.host.targets();
        // The table holds at most max_connections entries, so a free port
        // turns up within that many + listeners + 1 probes.
        let probes = self.conns.len() + targets.len() + 1;
        for _ in 0..probes {
            let p = self.next_port;
            self.next_port = if p == u32::MAX {
                EPHEMERAL_PORT_FIRST
            } else {
                p + 1
            };
            if !targets.contains_key(&p) && !self.conns.contains_key(&(p, peer)) {
                return Some(p);
            }
        }
        None
    }

    /// Drops every connection (their host streams see EOF) and marks a
    /// TRANSPORT_RESET event as owed.
    pub fn reset_all(&mut self) {
        let keys: Vec<Key> = self.conns.keys().copied().collect();
        for k in keys {
            self.remove(k, ConnectError::Reset);
        }
        self.rx_ready.clear();
        self.backlog.clear();
        self.transport_reset_pending = true;
    }

    /// Handles everything pending on [`Self::epoll_fd`] without blocking.
    pub fn process_host_events(&mut self) -> Result<(), MuxerError> {
        let mut events = [EpollEvent::default(); EVENTS_PER_WAIT];
        loop {
            let n = match self.epoll.wait(0, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(MuxerError::Os {
                        what: "epoll_wait",
                        source: e,
                    })
                }
            };
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_WAKE => {
                        // Reset the counter; EAGAIN means a spurious wakeup.
                        let _ = self.host.wake.read();
                        for req in self.host.take_requests() {
                            match req {
                                Request::Connect {
                                    port,
                                    stream,
                                    reply,
                                    timeout,
                                } => self.host_connect(port, stream, reply, timeout),
                                Request::ResetTransport => {
                                    info!("vsock: transport reset requested by the host");
                                    self.reset_all();
                                }
                            }
                        }
                    }
                    TOKEN_TIMER => {
                        let _ = self.timer.wait();
                        self.timer_armed_for = None;
                        self.expire(Instant::now());
                    }
                    token => {
                        let Some(&key) = self.tokens.get(&token) else {
                            continue;
                        };
                        let set = EventSet::from_bits_truncate(ev.events);
                        if let Some(c) = self.conns.get_mut(&key) {
                            c.on_stream_event(
                                set.contains(EventSet::IN),
                                set.contains(EventSet::OUT),
                                set.intersects(EventSet::HANG_UP | EventSet::ERROR),
                            );
                        }
                        self.mark_ready(key);
                    }
                }
            }
            if n < events.len() {
                break;
            }
        }
        self.arm_timer()
    }

    fn expire(&mut self, now: Instant) {
        let keys: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, c)| c.deadline().is_some_and(|d| d <= now))
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            if let Some(c) = self.conns.get_mut(&k) {
                if c.on_deadline(now) {
                    self.mark_ready(k);
                }
            }
        }
    }

    /// Arms the timerfd for the earliest connection deadline.
    fn arm_timer(&mut self) -> Result<(), MuxerError> {
        let next = self.conns.values().filter_map(|c| c.deadline()).min();
        if next == self.timer_armed_for {
            return Ok(());
        }
        self.timer_armed_for = next;
        match next {
            Some(at) => {
                let wait = at
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                self.timer
                    .reset(wait, None)
                    .map_err(errno("timerfd_settime"))
            }
            None => self
                .timer
                .reset(Duration::ZERO, None)
                .map_err(errno("timerfd_settime")),
        }
    }

    /// Produces the next packet for the guest, given `room` payload bytes in
    /// the RX buffer: RSTs for unknown connections first, then connections in
    /// round-robin order. Returns the header and its payload, or `None` when
    /// nothing is pending.
    pub fn next_rx_packet(&mut self, room: usize) -> Option<(Header, &[u8])> {
        if let Some(h) = self.backlog.pop_front() {
            return Some((h, &[]));
        }
        let room = room.min(MAX_RX_PAYLOAD);
        while let Some(key) = self.rx_ready.pop_front() {
            let Some(c) = self.conns.get_mut(&key) else {
                continue;
            };
            c.queued = false;
            let Some(h) = c.next_packet(self.guest_cid, room, &mut self.scratch) else {
                continue;
            };
            if h.op == OP_RST {
                self.remove(key, ConnectError::Reset);
            } else {
                // Round-robin: back of the line if it has more to say.
                self.mark_ready(key);
            }
            let len = h.len as usize;
            return Some((h, &self.scratch[..len]));
        }
        None
    }

    /// Re-arms the timer after RX/TX processing may have changed deadlines.
    pub fn after_processing(&mut self) -> Result<(), MuxerError> {
        self.arm_timer()
    }

    /// Credit the guest grants on a connection, for tests and diagnostics.
    pub fn peer_credit(&self, local_port: u32, peer_port: u32) -> Option<u32> {
        self.conns
            .get(&(local_port, peer_port))
            .map(|c| c.peer_credit())
    }
}

impl Drop for Muxer {
    fn drop(&mut self) {
        let keys: Vec<Key> = self.conns.keys().copied().collect();
        for k in keys {
            self.remove(k, ConnectError::Reset);
        }
    }
}
