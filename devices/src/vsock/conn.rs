//! One vsock stream connection: the state machine between a guest socket and
//! the device's end of a host stream (virtio 1.2 §5.10.6.3–§5.10.6.6).
//!
//! Flow control follows the spec's credit scheme on both directions:
//!
//! * guest → host: we advertise `buf_alloc` and count `rx_cnt`
//!   (payload bytes received) and `fwd_cnt` (bytes actually written to the
//!   host stream). Bytes the host stream cannot take yet wait in an output
//!   buffer that the guest's credit bounds to `buf_alloc`; a guest that sends
//!   beyond its credit is reset. A CREDIT_UPDATE goes out once `fwd_cnt` has
//!   advanced [`CREDIT_UPDATE_THRESHOLD`] past what we last told the guest,
//!   or sooner when the guest's view of our free space is low.
//! * host → guest: we only send what the *guest's* advertised `buf_alloc`
//!   allows: `peer_buf_alloc - (tx_cnt - peer_fwd_cnt)` (wrapping counters).
//!   With zero credit and data waiting we send one CREDIT_REQUEST.
//!
//! Shutdown: a guest SHUTDOWN(SEND) half-closes the host stream once the
//! buffered bytes are written; SHUTDOWN with both flags is answered with RST
//! after the flush. When the host stream reaches EOF we send SHUTDOWN (SEND,
//! plus RCV when the host end is fully closed) and wait up to
//! [`CLOSE_TIMEOUT`] for the guest's RST before resetting it ourselves.
//!
//! Limits: stream sockets only; the host stream is a non-blocking
//! [`UnixStream`] (a socketpair end or a connection to a host socket).

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU32;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use tracing::{debug, warn};
use vm_memory::GuestMemory;

use super::backend::ConnectError;
use super::packet::{
    ChainReader, Header, PacketError, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST, OP_RESPONSE,
    OP_RST, OP_RW, OP_SHUTDOWN, SHUTDOWN_F_BOTH, SHUTDOWN_F_RCV, SHUTDOWN_F_SEND, TYPE_STREAM,
    VSOCK_HOST_CID,
};

/// Send a CREDIT_UPDATE once our `fwd_cnt` moved this many bytes past the
/// value the guest last saw (or when the guest's view of our free space drops
/// below it).
pub const CREDIT_UPDATE_THRESHOLD: u32 = 64 * 1024;
/// How long a closing connection waits for the guest's RST after our
/// SHUTDOWN with both flags before we reset it (§5.10.6.6 leaves the value to
/// the implementation; Linux uses 8 s for its side).
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Connection state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Host-initiated: REQUEST queued or sent, waiting for RESPONSE.
    Connecting,
    /// Data flows.
    Established,
    /// We sent SHUTDOWN with both flags; waiting for the guest's RST.
    Closing,
}

/// What the muxer must do with a connection after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Keep it.
    Keep,
    /// Forget it now (the guest reset it, or the connection is over); no
    /// packet is owed to the guest.
    Remove,
}

/// One connection.
pub struct Conn {
    /// Our port (the host side's).
    pub local_port: u32,
    /// The guest's port.
    pub peer_port: u32,
    /// epoll token of [`Self::stream`].
    pub token: u64,
    /// Whether the muxer has this connection in its RX work list.
    pub queued: bool,
    state: State,
    deadline: Option<Instant>,
    stream: UnixStream,
    connect_reply: Option<Sender<Result<(), ConnectError>>>,

    send_request: bool,
    send_response: bool,
    send_credit_update: bool,
    send_rst: bool,
    /// SHUTDOWN flags still to be sent.
    send_shutdown: u32,
    credit_request_sent: bool,
    /// RST once the output buffer is flushed (guest closed both ways).
    rst_when_flushed: bool,

    buf_alloc: u32,
    fwd_cnt: Wrapping<u32>,
    rx_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    tx_cnt: Wrapping<u32>,

    peer_shutdown: u32,
    local_shutdown: u32,
    write_shut: bool,

    readable: bool,
    stream_eof: bool,
    stream_hup: bool,

    out: Vec<u8>,
    out_head: usize,
}

impl Conn {
    fn base(
        local_port: u32,
        peer_port: u32,
        token: u64,
        stream: UnixStream,
        buf_alloc: u32,
    ) -> Self {
        Self {
            local_port,
            peer_port,
            token,
            queued: false,
            state: State::Established,
            deadline: None,
            stream,
            connect_reply: None,
            send_request: false,
            send_response: false,
            send_credit_update: false,
            send_rst: false,
            send_shutdown: 0,
            credit_request_sent: false,
            rst_when_flushed: false,
            buf_alloc,
            fwd_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            tx_cnt: Wrapping(0),
            peer_shutdown: 0,
            local_shutdown: 0,
            write_shut: false,
            // Edge-triggered polling: assume data may be there until a read
            // says otherwise.
            readable: true,
            stream_eof: false,
            stream_hup: false,
            out: Vec::new(),
            out_head: 0,
        }
    }

    /// A connection the guest requested with `req` and a host end accepted.
    pub fn accepted(req: &Header, token: u64, stream: UnixStream, buf_alloc: u32) -> Self {
        let mut c = Self::base(req.dst_port, req.src_port, token, stream, buf_alloc);
        c.update_peer_credit(req);
        c.send_response = true;
        c
    }

    /// A host-initiated connection to guest port `peer_port`; `reply` learns
    /// the outcome.
    pub fn connecting(
        local_port: u32,
        peer_port: u32,
        token: u64,
        stream: UnixStream,
        buf_alloc: u32,
        reply: Sender<Result<(), ConnectError>>,
        timeout: Duration,
    ) -> Self {
        let mut c = Self::base(local_port, peer_port, token, stream, buf_alloc);
        c.state = State::Connecting;
        c.deadline = Some(Instant::now() + timeout);
        c.connect_reply = Some(reply);
        c.send_request = true;
        c
    }

    /// The host stream (for epoll registration).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// When the pending timer (connect or close) expires.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Credit the guest currently grants us, in bytes.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.tx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Bytes received from the guest and not yet written to the host stream.
    pub fn buffered(&self) -> usize {
        self.out.len() - self.out_head
    }

    fn can_send_data(&self) -> bool {
        self.state == State::Established
            && !self.stream_eof
            && self.local_shutdown & SHUTDOWN_F_SEND == 0
            && self.peer_shutdown & SHUTDOWN_F_RCV == 0
    }

    /// Whether [`Self::next_packet`] may produce something.
    pub fn has_rx_work(&self) -> bool {
        self.send_rst
            || self.send_request
            || self.send_response
            || self.send_shutdown != 0
            || self.send_credit_update
            || (self.readable
                && self.can_send_data()
                && (self.peer_credit() > 0 || !self.credit_request_sent))
    }

    fn update_peer_credit(&mut self, hdr: &Header) {
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        if self.peer_credit() > 0 {
            self.credit_request_sent = false;
        }
    }

    fn header(&mut self, guest_cid: u64, op: u16) -> Header {
        self.last_fwd_cnt_sent = self.fwd_cnt;
        // Every packet carries our credit, so none is owed any more.
        self.send_credit_update = false;
        Header {
            src_cid: VSOCK_HOST_CID,
            dst_cid: guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            len: 0,
            kind: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: self.buf_alloc,
            fwd_cnt: self.fwd_cnt.0,
        }
    }

    /// Produces the next packet for the guest, if any. Payload bytes of an RW
    /// packet are read from the host stream into `scratch[..hdr.len]`; at
    /// most `room` of them. After an RST has been returned the connection
    /// must be removed.
    pub fn next_packet(
        &mut self,
        guest_cid: u64,
        room: usize,
        scratch: &mut [u8],
    ) -> Option<Header> {
        if self.send_rst {
            self.send_rst = false;
            self.fail_connect(ConnectError::Reset);
            return Some(self.header(guest_cid, OP_RST));
        }
        if self.send_request {
            self.send_request = false;
            return Some(self.header(guest_cid, OP_REQUEST));
        }
        if self.send_response {
            self.send_response = false;
            return Some(self.header(guest_cid, OP_RESPONSE));
        }
        if self.readable && self.can_send_data() {
            let credit = self.peer_credit() as usize;
            let want = credit.min(room).min(scratch.len());
            if want > 0 {
                match self.stream.read(&mut scratch[..want]) {
                    Ok(0) => {
                        self.readable = false;
                        self.on_stream_eof();
                    }
                    Ok(n) => {
                        self.tx_cnt += Wrapping(n as u32);
                        let mut h = self.header(guest_cid, OP_RW);
                        h.len = n as u32;
                        return Some(h);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.readable = false,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        warn!(
                            local_port = self.local_port,
                            peer_port = self.peer_port,
                            "vsock: host stream read failed, resetting the connection: {e}"
                        );
                        return Some(self.header(guest_cid, OP_RST));
                    }
                }
            } else if credit == 0 && !self.credit_request_sent {
                self.credit_request_sent = true;
                return Some(self.header(guest_cid, OP_CREDIT_REQUEST));
            }
        }
        if self.send_shutdown != 0 {
            let mut h = self.header(guest_cid, OP_SHUTDOWN);
            h.flags = self.send_shutdown;
            self.local_shutdown |= self.send_shutdown;
            self.send_shutdown = 0;
            if self.local_shutdown == SHUTDOWN_F_BOTH && self.state == State::Established {
                self.state = State::Closing;
                self.deadline = Some(Instant::now() + CLOSE_TIMEOUT);
            }
            return Some(h);
        }
        if self.send_credit_update {
            return Some(self.header(guest_cid, OP_CREDIT_UPDATE));
        }
        None
    }

    fn on_stream_eof(&mut self) {
        if !self.stream_eof {
            debug!(
                local_port = self.local_port,
                peer_port = self.peer_port,
                hup = self.stream_hup,
                "vsock: host stream EOF"
            );
        }
        self.stream_eof = true;
        let mut flags = SHUTDOWN_F_SEND;
        if self.stream_hup {
            flags |= SHUTDOWN_F_RCV;
        }
        self.send_shutdown |= flags & !self.local_shutdown;
    }

    fn fail_connect(&mut self, err: ConnectError) {
        if let Some(reply) = self.connect_reply.take() {
            // The caller may have given up already; nothing to do then.
            let _ = reply.send(Err(err));
        }
    }

    /// The connection is being dropped without a packet to the guest (guest
    /// RST, device teardown): tell a waiting connector why.
    pub fn abort(&mut self, err: ConnectError) {
        self.fail_connect(err);
    }

    /// The connect or close timer expired. Returns whether the connection
    /// now owes the guest an RST.
    pub fn on_deadline(&mut self, now: Instant) -> bool {
        match self.deadline {
            Some(d) if d <= now => {
                self.deadline = None;
                match self.state {
                    State::Connecting => {
                        debug!(
                            local_port = self.local_port,
                            peer_port = self.peer_port,
                            "vsock: guest did not answer our REQUEST in time"
                        );
                        self.fail_connect(ConnectError::TimedOut);
                    }
                    State::Closing => {
                        debug!(
                            local_port = self.local_port,
                            peer_port = self.peer_port,
                            "vsock: guest did not RST a closed connection in time"
                        );
                    }
                    State::Established => {}
                }
                self.send_rst = true;
                true
            }
            _ => false,
        }
    }

    /// Readiness reported by epoll for the host stream (edge-triggered).
    pub fn on_stream_event(&mut self, readable: bool, writable: bool, hup: bool) {
        if hup {
            self.stream_hup = true;
            if self.stream_eof {
                // Half-closed earlier, fully closed now.
                self.send_shutdown |= SHUTDOWN_F_RCV & !self.local_shutdown;
            }
        }
        if readable || hup {
            self.readable = true;
        }
        if writable && self.buffered() > 0 {
            self.flush_out();
        }
    }

    /// Handles a packet from the guest for this connection; `reader` is
    /// positioned at the payload.
    pub fn on_guest_packet<M: GuestMemory>(
        &mut self,
        hdr: &Header,
        reader: &mut ChainReader<'_, M>,
        scratch: &mut [u8],
        log_budget: &AtomicU32,
    ) -> Verdict {
        self.update_peer_credit(hdr);
        match hdr.op {
            OP_RST => {
                debug!(
                    local_port = self.local_port,
                    peer_port = self.peer_port,
                    "vsock: guest reset the connection"
                );
                self.fail_connect(ConnectError::Refused);
                return Verdict::Remove;
            }
            OP_RESPONSE if self.state == State::Connecting => {
                self.state = State::Established;
                self.deadline = None;
                let delivered = self
                    .connect_reply
                    .take()
                    .map(|r| r.send(Ok(())).is_ok())
                    .unwrap_or(false);
                if !delivered {
                    debug!(
                        local_port = self.local_port,
                        "vsock: connector gave up before the guest answered"
                    );
                    self.send_rst = true;
                }
            }
            OP_RW
                if self.state != State::Connecting && self.peer_shutdown & SHUTDOWN_F_SEND == 0 =>
            {
                if let Err(e) = self.receive(hdr.len, reader, scratch) {
                    vmm::guest_log!(
                        log_budget,
                        warn,
                        local_port = self.local_port,
                        peer_port = self.peer_port,
                        "vsock: bad RW packet, resetting: {e}"
                    );
                    self.send_rst = true;
                }
            }
            OP_SHUTDOWN if self.state != State::Connecting => {
                self.peer_shutdown |= hdr.flags & SHUTDOWN_F_BOTH;
                debug!(
                    local_port = self.local_port,
                    peer_port = self.peer_port,
                    flags = hdr.flags,
                    "vsock: guest shutdown"
                );
                if self.peer_shutdown == SHUTDOWN_F_BOTH {
                    self.rst_when_flushed = true;
                }
                self.after_flush();
            }
            OP_CREDIT_UPDATE => {}
            OP_CREDIT_REQUEST => self.send_credit_update = true,
            _ => {
                vmm::guest_log!(
                    log_budget,
                    warn,
                    local_port = self.local_port,
                    peer_port = self.peer_port,
                    op = hdr.op_name(),
                    state = ?self.state,
                    "vsock: unexpected packet, resetting the connection"
                );
                self.send_rst = true;
            }
        }
        Verdict::Keep
    }

    /// Takes `len` payload bytes from `reader` towards the host stream.
    fn receive<M: GuestMemory>(
        &mut self,
        len: u32,
        reader: &mut ChainReader<'_, M>,
        scratch: &mut [u8],
    ) -> Result<(), ConnError> {
        let len_usize = len as usize;
        if len_usize > reader.remaining() {
            return Err(ConnError::Packet(PacketError::LengthMismatch {
                len,
                available: reader.remaining(),
            }));
        }
        let used = (self.rx_cnt - self.fwd_cnt).0;
        if u64::from(used) + u64::from(len) > u64::from(self.buf_alloc) {
            return Err(ConnError::CreditOverrun {
                len,
                free: self.buf_alloc.saturating_sub(used),
            });
        }
        self.rx_cnt += Wrapping(len);
        let mut left = len_usize;
        while left > 0 {
            let want = left.min(scratch.len());
            let n = reader.read(&mut scratch[..want])?;
            if n == 0 {
                break;
            }
            self.push_out(&scratch[..n]);
            left -= n;
        }
        Ok(())
    }

    /// Writes `data` to the host stream, buffering what it cannot take now.
    fn push_out(&mut self, data: &[u8]) {
        if self.send_rst {
            return;
        }
        let mut done = 0;
        if self.buffered() == 0 {
            while done < data.len() {
                match self.stream.write(&data[done..]) {
                    Ok(0) => break,
                    Ok(n) => {
                        done += n;
                        self.fwd_cnt += Wrapping(n as u32);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        self.host_write_failed(e);
                        return;
                    }
                }
            }
            self.maybe_credit_update();
        }
        if done < data.len() {
            if self.out_head > 0 && self.out_head == self.out.len() {
                self.out.clear();
                self.out_head = 0;
            }
            self.out.extend_from_slice(&data[done..]);
        }
    }

    /// Writes buffered bytes to the host stream until it would block.
    fn flush_out(&mut self) {
        while self.buffered() > 0 {
            match self.stream.write(&self.out[self.out_head..]) {
                Ok(0) => break,
                Ok(n) => {
                    self.out_head += n;
                    self.fwd_cnt += Wrapping(n as u32);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.host_write_failed(e);
                    return;
                }
            }
        }
        if self.buffered() == 0 {
            self.out.clear();
            self.out_head = 0;
        } else if self.out_head > self.out.len() / 2 {
            self.out.drain(..self.out_head);
            self.out_head = 0;
        }
        self.maybe_credit_update();
        self.after_flush();
    }

    fn host_write_failed(&mut self, e: io::Error) {
        debug!(
            local_port = self.local_port,
            peer_port = self.peer_port,
            "vsock: host stream write failed, resetting: {e}"
        );
        self.out.clear();
        self.out_head = 0;
        self.send_rst = true;
    }

    /// Applies the guest's shutdown once its data has reached the host.
    fn after_flush(&mut self) {
        if self.buffered() > 0 {
            return;
        }
        if self.peer_shutdown & SHUTDOWN_F_SEND != 0 && !self.write_shut {
            self.write_shut = true;
            // The host end may be gone already; nothing to do then.
            let _ = self.stream.shutdown(Shutdown::Write);
        }
        if self.rst_when_flushed {
            self.rst_when_flushed = false;
            self.send_rst = true;
        }
    }

    fn maybe_credit_update(&mut self) {
        let advance = (self.fwd_cnt - self.last_fwd_cnt_sent).0;
        if advance == 0 {
            return;
        }
        let unacked = (self.rx_cnt - self.last_fwd_cnt_sent).0;
        let guest_view_free = self.buf_alloc.saturating_sub(unacked);
        if advance >= CREDIT_UPDATE_THRESHOLD || guest_view_free < CREDIT_UPDATE_THRESHOLD {
            self.send_credit_update = true;
        }
    }
}

/// Errors of one connection's data path.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The packet itself is malformed.
    #[error(transparent)]
    Packet(#[from] PacketError),
    /// The guest sent more than the credit we granted.
    #[error("guest sent {len} bytes with only {free} bytes of credit; the guest driver ignored our buf_alloc/fwd_cnt")]
    CreditOverrun {
        /// Payload length.
        len: u32,
        /// Credit left.
        free: u32,
    },
}
