//! The agent's DNS stub: the resolver every session process uses
//! (`/etc/resolv.conf` names [`STUB_ADDR`]), answering each name with a
//! fake address from the [`FakePool`].
//!
//! Nothing is resolved here: the host resolves names when the relay asks its
//! proxy for them, and applies the session's allowlist then. So every valid
//! host name gets an address (`A`), and a program connecting to it is
//! captured ([`super::capture`]) and relayed *by name*.
//!
//! Answers, per RFC 1035 wire format (our own small parser and writer):
//! * `A`/`IN` for a valid name: one record, the name's pool address, TTL
//!   [`TTL_SECS`]; `localhost` and `*.localhost` (RFC 6761): `127.0.0.1`;
//! * `PTR`/`IN` for `d.c.b.a.in-addr.arpa` of an assigned pool address: the
//!   name;
//! * every other type (`AAAA` above all, so clients use IPv4): `NOERROR`
//!   with no records;
//! * a name that is not a host name ([`super::fake::normalise`]) or a `PTR`
//!   we cannot answer: `NXDOMAIN`; a class other than `IN`: `REFUSED`;
//!   opcodes other than `QUERY`: `NOTIMP`;
//! * a malformed query (not exactly one question, compression in the
//!   question, truncated fields): `FORMERR`; fewer than 12 bytes, or a
//!   response rather than a query: dropped.
//!
//! The question is echoed byte for byte (clients that randomise letter case
//! compare it). EDNS records are ignored, so answers stay within 512 bytes
//! and need no truncation (each is checked anyway).
//!
//! Served over UDP and TCP (2-byte length prefix, RFC 1035 §4.2.2) on the
//! same address. Limits: no recursion, no DNSSEC, no zone data; IPv4 only.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::fake::{normalise, FakePool};

/// Where the stub listens in production: loopback port 53, the address
/// `/etc/resolv.conf` names (glibc, musl, node's c-ares and Go's resolver
/// all read that file).
pub const STUB_ADDR: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 53);

/// TTL of every answer: short, so a name's address is asked for again soon
/// and the table's least-recently-used eviction sees which names are live.
pub const TTL_SECS: u32 = 60;

/// Size of a DNS header (RFC 1035 §4.1.1).
const HEADER_LEN: usize = 12;

/// Longest name on the wire, length octets and root label included
/// (RFC 1035 §2.3.4).
const MAX_WIRE_NAME: usize = 255;

/// Largest UDP answer without EDNS (RFC 1035 §4.2.1); a longer one would
/// have to be truncated.
const UDP_MAX: usize = 512;

/// Receive buffer for one UDP query (EDNS clients may send up to this).
const UDP_RECV_BUF: usize = 4096;

/// A TCP connection with no complete query for this long is closed, so idle
/// clients cannot pin tasks forever.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// Pause after a failed UDP receive or TCP accept, so a persistent error
/// (`EMFILE`) costs no busy loop.
const RECV_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// At most this many TCP clients are served at once; more wait in the
/// listen backlog.
const TCP_MAX_CLIENTS: usize = 64;

/// Record type `A` (RFC 1035 §3.2.2).
const TYPE_A: u16 = 1;
/// Record type `PTR` (RFC 1035 §3.2.2).
const TYPE_PTR: u16 = 12;
/// Class `IN` (RFC 1035 §3.2.4).
const CLASS_IN: u16 = 1;
/// Class `ANY` in a question (RFC 1035 §3.2.5): treated as `IN`.
const CLASS_ANY: u16 = 255;

/// Header flag: this is a response (QR).
const FLAG_QR: u16 = 0x8000;
/// Header field: opcode (4 bits).
const OPCODE_MASK: u16 = 0x7800;
/// Header flag: recursion desired (RD, echoed).
const FLAG_RD: u16 = 0x0100;
/// Header flag: recursion available (RA): we answer every name ourselves,
/// so clients get no "recursion not available" warnings.
const FLAG_RA: u16 = 0x0080;

/// Response codes (RFC 1035 §4.1.1).
const RCODE_NOERROR: u16 = 0;
const RCODE_FORMERR: u16 = 1;
const RCODE_NXDOMAIN: u16 = 3;
const RCODE_NOTIMP: u16 = 4;
const RCODE_REFUSED: u16 = 5;

/// Pointer to the question's name at offset 12 (RFC 1035 §4.1.4): how the
/// answer record names its owner.
const NAME_PTR_TO_QUESTION: [u8; 2] = [0xc0, 0x0c];

/// Suffix of reverse-lookup names for IPv4 (RFC 1035 §3.5).
const REVERSE_SUFFIX: &str = ".in-addr.arpa";

/// Errors of starting the stub.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("DNS stub: cannot bind UDP {addr}: {source} (is another DNS server running there, or is the agent without the right to bind port 53?)")]
    BindUdp {
        addr: SocketAddrV4,
        source: io::Error,
    },
    #[error("DNS stub: cannot bind TCP {addr}: {source} (is another DNS server running there, or is the agent without the right to bind port 53?)")]
    BindTcp {
        addr: SocketAddrV4,
        source: io::Error,
    },
    #[error("DNS stub: {0} (start must be called inside the agent's tokio runtime)")]
    Runtime(io::Error),
}

/// Binds UDP and TCP on `addr` (production: [`STUB_ADDR`]) and serves the
/// stub there on spawned tasks. Must be called inside a tokio runtime.
pub fn start(pool: Arc<FakePool>, addr: SocketAddrV4) -> Result<(), DnsError> {
    serve(pool, addr).map(|_| ())
}

/// [`start`], returning the bound address: with port 0, TCP gets an
/// ephemeral port and UDP is bound to the same one.
pub fn serve(pool: Arc<FakePool>, addr: SocketAddrV4) -> Result<SocketAddrV4, DnsError> {
    tokio::runtime::Handle::try_current().map_err(|e| DnsError::Runtime(io::Error::other(e)))?;
    let tcp =
        std::net::TcpListener::bind(addr).map_err(|source| DnsError::BindTcp { addr, source })?;
    let bound = match tcp.local_addr() {
        Ok(SocketAddr::V4(a)) => a,
        Ok(SocketAddr::V6(_)) => addr,
        Err(source) => return Err(DnsError::BindTcp { addr, source }),
    };
    let udp = std::net::UdpSocket::bind(bound).map_err(|source| DnsError::BindUdp {
        addr: bound,
        source,
    })?;
    tcp.set_nonblocking(true).map_err(DnsError::Runtime)?;
    udp.set_nonblocking(true).map_err(DnsError::Runtime)?;
    let tcp = tokio::net::TcpListener::from_std(tcp).map_err(DnsError::Runtime)?;
    let udp = tokio::net::UdpSocket::from_std(udp).map_err(DnsError::Runtime)?;
    tokio::spawn(serve_udp(udp, pool.clone()));
    tokio::spawn(serve_tcp(tcp, pool));
    tracing::debug!(addr = %bound, "DNS stub listening (UDP and TCP)");
    Ok(bound)
}

async fn serve_udp(sock: tokio::net::UdpSocket, pool: Arc<FakePool>) {
    let mut buf = vec![0u8; UDP_RECV_BUF];
    loop {
        let (n, from) = match sock.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                // E.g. ICMP errors reported on the socket: nothing to do
                // but not spin should the error persist.
                tracing::debug!(error = %e, "DNS stub: UDP receive failed");
                tokio::time::sleep(RECV_ERROR_PAUSE).await;
                continue;
            }
        };
        let Some(reply) = answer(&pool, &buf[..n]) else {
            continue;
        };
        if let Err(e) = sock.send_to(&reply, from).await {
            tracing::debug!(error = %e, peer = %from, "DNS stub: UDP reply failed");
        }
    }
}

async fn serve_tcp(listener: tokio::net::TcpListener, pool: Arc<FakePool>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(TCP_MAX_CLIENTS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        match listener.accept().await {
            Ok((stream, _)) => {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    serve_tcp_client(stream, &pool).await;
                });
            }
            Err(e) => {
                // EMFILE and friends: back off briefly instead of spinning.
                tracing::warn!(error = %e, "DNS stub: TCP accept failed");
                tokio::time::sleep(RECV_ERROR_PAUSE).await;
            }
        }
    }
}

/// Serves length-prefixed queries on one connection until it closes, idles
/// for [`TCP_IDLE`], or sends something we drop.
async fn serve_tcp_client(mut stream: tokio::net::TcpStream, pool: &FakePool) {
    loop {
        let query = tokio::time::timeout(TCP_IDLE, async {
            let len = stream.read_u16().await?;
            let mut query = vec![0u8; usize::from(len)];
            stream.read_exact(&mut query).await?;
            io::Result::Ok(query)
        })
        .await;
        let Ok(Ok(query)) = query else {
            return;
        };
        let Some(reply) = answer(pool, &query) else {
            return;
        };
        // Answers are far below 64 KiB (one question, at most one record).
        let Ok(len) = u16::try_from(reply.len()) else {
            return;
        };
        let mut framed = Vec::with_capacity(reply.len() + 2);
        framed.extend_from_slice(&len.to_be_bytes());
        framed.extend_from_slice(&reply);
        if stream.write_all(&framed).await.is_err() {
            return;
        }
    }
}

/// The parsed question of a query.
struct Question<'a> {
    /// The question section as received (name, type, class), echoed.
    raw: &'a [u8],
    /// The labels of the name, as sent.
    labels: Vec<&'a [u8]>,
    qtype: u16,
    qclass: u16,
}

/// Why a query gets no normal answer.
enum Reject {
    /// Not worth a reply (too short for a header, or itself a response).
    Drop,
    /// Answer with this response code and no records.
    Rcode(u16),
}

/// The reply to one query message, or `None` to send nothing. Never panics.
pub fn answer(pool: &FakePool, query: &[u8]) -> Option<Vec<u8>> {
    let header = query.get(..HEADER_LEN)?;
    let id = [header[0], header[1]];
    let flags = u16::from_be_bytes([header[2], header[3]]);
    if flags & FLAG_QR != 0 {
        return None;
    }
    let reply_flags = |rcode: u16| FLAG_QR | (flags & (OPCODE_MASK | FLAG_RD)) | FLAG_RA | rcode;
    let bare = |rcode: u16| {
        let mut r = Vec::with_capacity(HEADER_LEN);
        r.extend_from_slice(&id);
        r.extend_from_slice(&reply_flags(rcode).to_be_bytes());
        r.extend_from_slice(&[0; 8]);
        r
    };
    if flags & OPCODE_MASK != 0 {
        return Some(bare(RCODE_NOTIMP));
    }
    let q = match parse_question(query) {
        Ok(q) => q,
        Err(Reject::Drop) => return None,
        Err(Reject::Rcode(rcode)) => return Some(bare(rcode)),
    };
    let (rcode, record) = match resolve(pool, &q) {
        Ok(record) => (RCODE_NOERROR, record),
        Err(rcode) => (rcode, None),
    };
    let mut r = Vec::with_capacity(HEADER_LEN + q.raw.len() + 16);
    r.extend_from_slice(&id);
    r.extend_from_slice(&reply_flags(rcode).to_be_bytes());
    r.extend_from_slice(&1u16.to_be_bytes()); // QDCOUNT
    r.extend_from_slice(&u16::from(record.is_some()).to_be_bytes()); // ANCOUNT
    r.extend_from_slice(&[0; 4]); // NSCOUNT, ARCOUNT
    r.extend_from_slice(q.raw);
    if let Some((rtype, rdata)) = record {
        r.extend_from_slice(&NAME_PTR_TO_QUESTION);
        r.extend_from_slice(&rtype.to_be_bytes());
        r.extend_from_slice(&CLASS_IN.to_be_bytes());
        r.extend_from_slice(&TTL_SECS.to_be_bytes());
        let rdlen = u16::try_from(rdata.len()).ok()?;
        r.extend_from_slice(&rdlen.to_be_bytes());
        r.extend_from_slice(&rdata);
    }
    if r.len() > UDP_MAX {
        // Cannot happen with one question and one record of at most a
        // name; refuse rather than send something a UDP client would cut.
        return Some(bare(RCODE_REFUSED));
    }
    Some(r)
}

/// Parses the header counts and the single question of `msg`.
fn parse_question(msg: &[u8]) -> Result<Question<'_>, Reject> {
    let header = msg.get(..HEADER_LEN).ok_or(Reject::Drop)?;
    let qdcount = u16::from_be_bytes([header[4], header[5]]);
    if qdcount != 1 {
        return Err(Reject::Rcode(RCODE_FORMERR));
    }
    let mut pos = HEADER_LEN;
    let mut labels = Vec::new();
    loop {
        let len = *msg.get(pos).ok_or(Reject::Rcode(RCODE_FORMERR))?;
        pos += 1;
        match len {
            0 => break,
            // Compression pointers (0b11) and the reserved 0b01/0b10 label
            // types: a question's name is the first in the message, so a
            // pointer has nothing valid to point at.
            l if l & 0xc0 != 0 => return Err(Reject::Rcode(RCODE_FORMERR)),
            l => {
                let end = pos + usize::from(l);
                let label = msg.get(pos..end).ok_or(Reject::Rcode(RCODE_FORMERR))?;
                labels.push(label);
                pos = end;
            }
        }
        if pos - HEADER_LEN > MAX_WIRE_NAME {
            return Err(Reject::Rcode(RCODE_FORMERR));
        }
    }
    let fixed = msg.get(pos..pos + 4).ok_or(Reject::Rcode(RCODE_FORMERR))?;
    Ok(Question {
        raw: &msg[HEADER_LEN..pos + 4],
        labels,
        qtype: u16::from_be_bytes([fixed[0], fixed[1]]),
        qclass: u16::from_be_bytes([fixed[2], fixed[3]]),
    })
}

/// The text form of a name from its labels, when every label is a plain
/// host-name label (no dots or other bytes that [`normalise`] would read
/// differently from the wire), normalised.
fn name_text(labels: &[&[u8]]) -> Option<String> {
    if labels.is_empty() {
        return None;
    }
    let mut text = String::new();
    for (i, label) in labels.iter().enumerate() {
        let s = std::str::from_utf8(label).ok()?;
        if s.contains('.') {
            return None;
        }
        if i > 0 {
            text.push('.');
        }
        text.push_str(s);
    }
    normalise(&text)
}

/// The record answering `q` (type, data), `None` for an empty `NOERROR`,
/// or the error response code.
fn resolve(pool: &FakePool, q: &Question<'_>) -> Result<Option<(u16, Vec<u8>)>, u16> {
    if q.qclass != CLASS_IN && q.qclass != CLASS_ANY {
        return Err(RCODE_REFUSED);
    }
    let name = name_text(&q.labels).ok_or(RCODE_NXDOMAIN)?;
    if name == "localhost" || name.ends_with(".localhost") {
        return Ok((q.qtype == TYPE_A).then(|| (TYPE_A, Ipv4Addr::LOCALHOST.octets().to_vec())));
    }
    match q.qtype {
        TYPE_A => {
            let ip = pool.assign(&name).ok_or(RCODE_NXDOMAIN)?;
            Ok(Some((TYPE_A, ip.octets().to_vec())))
        }
        TYPE_PTR if name.ends_with(REVERSE_SUFFIX) => {
            let ip = reverse_ip(&name).ok_or(RCODE_NXDOMAIN)?;
            let target = pool.name_of(ip).ok_or(RCODE_NXDOMAIN)?;
            Ok(Some((TYPE_PTR, wire_name(&target).ok_or(RCODE_NXDOMAIN)?)))
        }
        _ => Ok(None),
    }
}

/// The address of a reverse name `d.c.b.a.in-addr.arpa`.
fn reverse_ip(name: &str) -> Option<Ipv4Addr> {
    let digits = name.strip_suffix(REVERSE_SUFFIX)?;
    let mut octets = [0u8; 4];
    let mut parts = digits.split('.');
    for slot in octets.iter_mut().rev() {
        let p = parts.next()?;
        // Decimal without leading zeros, as reverse names are written.
        if p.len() > 1 && p.starts_with('0') {
            return None;
        }
        *slot = p.parse().ok()?;
    }
    parts.next().is_none().then(|| Ipv4Addr::from(octets))
}

/// `name` (a normalised host name) in wire form, root label included.
fn wire_name(name: &str) -> Option<Vec<u8>> {
    let mut w = Vec::with_capacity(name.len() + 2);
    for label in name.split('.') {
        w.push(u8::try_from(label.len()).ok()?);
        w.extend_from_slice(label.as_bytes());
    }
    w.push(0);
    (w.len() <= MAX_WIRE_NAME).then_some(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Record type `AAAA` (RFC 3596).
    const TYPE_AAAA: u16 = 28;
    /// Record type `MX`.
    const TYPE_MX: u16 = 15;

    /// A query message: id, flags (RD), one question.
    fn query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
        query_class(id, name, qtype, CLASS_IN)
    }

    fn query_class(id: u16, name: &str, qtype: u16, qclass: u16) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&id.to_be_bytes());
        m.extend_from_slice(&FLAG_RD.to_be_bytes());
        m.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]);
        for label in name.split('.').filter(|l| !l.is_empty()) {
            m.push(label.len() as u8);
            m.extend_from_slice(label.as_bytes());
        }
        m.push(0);
        m.extend_from_slice(&qtype.to_be_bytes());
        m.extend_from_slice(&qclass.to_be_bytes());
        m
    }

    /// A parsed reply: (id, flags, rcode, answers as (type, ttl, rdata)).
    struct Reply {
        id: u16,
        flags: u16,
        rcode: u16,
        question: Vec<u8>,
        answers: Vec<(u16, u32, Vec<u8>)>,
    }

    /// Parses a reply as a client would (answers' owner must point at the
    /// question).
    fn parse_reply(r: &[u8]) -> Reply {
        let id = u16::from_be_bytes([r[0], r[1]]);
        let flags = u16::from_be_bytes([r[2], r[3]]);
        let qd = u16::from_be_bytes([r[4], r[5]]);
        let an = u16::from_be_bytes([r[6], r[7]]);
        assert_eq!(&r[8..12], &[0, 0, 0, 0]);
        let mut pos = 12;
        let mut question = Vec::new();
        if qd == 1 {
            while r[pos] != 0 {
                pos += 1 + r[pos] as usize;
            }
            pos += 5;
            question = r[12..pos].to_vec();
        }
        let mut answers = Vec::new();
        for _ in 0..an {
            assert_eq!(&r[pos..pos + 2], &NAME_PTR_TO_QUESTION);
            let t = u16::from_be_bytes([r[pos + 2], r[pos + 3]]);
            assert_eq!(u16::from_be_bytes([r[pos + 4], r[pos + 5]]), CLASS_IN);
            let ttl = u32::from_be_bytes([r[pos + 6], r[pos + 7], r[pos + 8], r[pos + 9]]);
            let len = u16::from_be_bytes([r[pos + 10], r[pos + 11]]) as usize;
            answers.push((t, ttl, r[pos + 12..pos + 12 + len].to_vec()));
            pos += 12 + len;
        }
        assert_eq!(pos, r.len(), "trailing bytes");
        Reply {
            id,
            flags,
            rcode: flags & 0xf,
            question,
            answers,
        }
    }

    #[test]
    fn a_queries_get_the_pool_address_and_the_question_back() {
        let pool = FakePool::new();
        let q = query(0xbeef, "Api.Example.COM", TYPE_A);
        let r = parse_reply(&answer(&pool, &q).unwrap());
        assert_eq!(r.id, 0xbeef);
        assert_eq!(r.flags & FLAG_QR, FLAG_QR);
        assert_eq!(r.flags & FLAG_RD, FLAG_RD);
        assert_eq!(r.rcode, RCODE_NOERROR);
        // The question as sent, letter case included.
        assert_eq!(r.question, q[12..].to_vec());
        let ip = pool.assign("api.example.com").unwrap();
        assert_eq!(r.answers, vec![(TYPE_A, TTL_SECS, ip.octets().to_vec())]);
        // Same name, same answer; the trailing-dot form is the same name.
        let again = parse_reply(&answer(&pool, &query(2, "api.example.com.", TYPE_A)).unwrap());
        assert_eq!(again.answers[0].2, ip.octets().to_vec());
    }

    #[test]
    fn aaaa_and_other_types_are_empty_noerror() {
        let pool = FakePool::new();
        for t in [TYPE_AAAA, TYPE_MX, 16, 33, 65] {
            let r = parse_reply(&answer(&pool, &query(7, "example.com", t)).unwrap());
            assert_eq!((r.rcode, r.answers.len()), (RCODE_NOERROR, 0), "type {t}");
        }
        // No address was used up by them.
        assert_eq!(pool.name_of(Ipv4Addr::new(198, 18, 0, 1)), None);
    }

    #[test]
    fn localhost_ptr_and_odd_questions() {
        let pool = FakePool::new();
        let r = parse_reply(&answer(&pool, &query(1, "localhost", TYPE_A)).unwrap());
        assert_eq!(r.answers, vec![(TYPE_A, TTL_SECS, vec![127, 0, 0, 1])]);
        let r = parse_reply(&answer(&pool, &query(1, "x.localhost", TYPE_AAAA)).unwrap());
        assert_eq!((r.rcode, r.answers.len()), (RCODE_NOERROR, 0));
        // PTR of an assigned address gives the name back.
        let ip = pool.assign("git.example.org").unwrap();
        let [a, b, c, d] = ip.octets();
        let rev = format!("{d}.{c}.{b}.{a}.in-addr.arpa");
        let r = parse_reply(&answer(&pool, &query(1, &rev, TYPE_PTR)).unwrap());
        assert_eq!(
            r.answers,
            vec![(TYPE_PTR, TTL_SECS, wire_name("git.example.org").unwrap())]
        );
        // Unassigned or malformed reverse names: NXDOMAIN.
        for name in [
            "9.9.9.9.in-addr.arpa",
            "01.0.18.198.in-addr.arpa",
            "1.2.3.in-addr.arpa",
        ] {
            let r = parse_reply(&answer(&pool, &query(1, name, TYPE_PTR)).unwrap());
            assert_eq!(r.rcode, RCODE_NXDOMAIN, "{name}");
        }
        // An invalid name, a dotted label, and the root: NXDOMAIN.
        let r = parse_reply(&answer(&pool, &query(1, "bad!name.com", TYPE_A)).unwrap());
        assert_eq!((r.rcode, r.answers.len()), (RCODE_NXDOMAIN, 0));
        let mut dotted = query(1, "xxx.com", TYPE_A);
        dotted[13 + 1] = b'.';
        let r = parse_reply(&answer(&pool, &dotted).unwrap());
        assert_eq!(r.rcode, RCODE_NXDOMAIN);
        let r = parse_reply(&answer(&pool, &query(1, "", TYPE_A)).unwrap());
        assert_eq!(r.rcode, RCODE_NXDOMAIN);
        // Class CHAOS: refused; class ANY is read as IN.
        let r = parse_reply(&answer(&pool, &query_class(1, "version.bind", 16, 3)).unwrap());
        assert_eq!(r.rcode, RCODE_REFUSED);
        let r = parse_reply(&answer(&pool, &query_class(1, "a.test", TYPE_A, CLASS_ANY)).unwrap());
        assert_eq!(r.answers.len(), 1);
    }

    #[test]
    fn malformed_queries_get_formerr_notimp_or_nothing() {
        let pool = FakePool::new();
        let good = query(9, "example.com", TYPE_A);
        // Too short for a header: dropped.
        assert!(answer(&pool, &good[..11]).is_none());
        // A response: dropped (no reply loops).
        let mut resp = good.clone();
        resp[2] |= 0x80;
        assert!(answer(&pool, &resp).is_none());
        // Opcode STATUS (2): NOTIMP.
        let mut status = good.clone();
        status[2] |= 2 << 3;
        let r = parse_reply(&answer(&pool, &status).unwrap());
        assert_eq!((r.rcode, r.flags & OPCODE_MASK), (RCODE_NOTIMP, 2 << 11));
        // Two questions, or none: FORMERR.
        for qd in [0u8, 2] {
            let mut m = good.clone();
            m[5] = qd;
            let r = parse_reply(&answer(&pool, &m).unwrap());
            assert_eq!((r.id, r.rcode), (9, RCODE_FORMERR), "qdcount {qd}");
        }
        // Every truncation of the question: FORMERR.
        for cut in 12..good.len() {
            let r = parse_reply(&answer(&pool, &good[..cut]).unwrap());
            assert_eq!(r.rcode, RCODE_FORMERR, "cut at {cut}");
        }
        // A compression pointer in the question (even to itself): FORMERR.
        let mut ptr = good[..12].to_vec();
        ptr.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1]);
        assert_eq!(
            parse_reply(&answer(&pool, &ptr).unwrap()).rcode,
            RCODE_FORMERR
        );
        // A name longer than 255 octets on the wire: FORMERR.
        let mut long = good[..12].to_vec();
        for _ in 0..5 {
            long.push(63);
            long.extend_from_slice(&[b'a'; 63]);
        }
        long.extend_from_slice(&[0, 0, 1, 0, 1]);
        assert_eq!(
            parse_reply(&answer(&pool, &long).unwrap()).rcode,
            RCODE_FORMERR
        );
        // Trailing records (an EDNS OPT) are ignored.
        let mut edns = good.clone();
        edns[11] = 1;
        edns.extend_from_slice(&[0, 0, 41, 0x10, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(parse_reply(&answer(&pool, &edns).unwrap()).answers.len(), 1);
    }

    #[test]
    fn random_and_mangled_input_never_panics() {
        let pool = FakePool::new();
        // A small deterministic generator (xorshift): no new crates.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let good = query(1, "www.example.com", TYPE_A);
        for round in 0..20_000 {
            let msg: Vec<u8> = if round % 2 == 0 {
                let len = (next() % 300) as usize;
                (0..len).map(|_| next() as u8).collect()
            } else {
                // Flip a few bytes of a valid query and maybe cut it.
                let mut m = good.clone();
                for _ in 0..(next() % 4 + 1) {
                    let i = (next() as usize) % m.len();
                    m[i] = next() as u8;
                }
                m.truncate((next() as usize) % (m.len() + 1));
                m
            };
            if let Some(r) = answer(&pool, &msg) {
                assert!(r.len() >= HEADER_LEN && r.len() <= UDP_MAX);
                assert_eq!(&r[..2], &msg[..2]);
                assert_ne!(r[2] & 0x80, 0);
            }
        }
    }

    /// Runs the stub on an ephemeral loopback port; queries it over UDP and
    /// over TCP with hand-built packets.
    #[tokio::test]
    async fn the_stub_answers_over_udp_and_tcp() {
        let pool = Arc::new(FakePool::new());
        let addr = serve(pool.clone(), SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)).unwrap();
        assert_ne!(addr.port(), 0);

        let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        udp.connect(addr).await.unwrap();
        udp.send(&query(0x1234, "registry.npmjs.org", TYPE_A))
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(5), udp.recv(&mut buf))
            .await
            .unwrap()
            .unwrap();
        let r = parse_reply(&buf[..n]);
        assert_eq!((r.id, r.rcode), (0x1234, RCODE_NOERROR));
        let ip = Ipv4Addr::from(<[u8; 4]>::try_from(r.answers[0].2.as_slice()).unwrap());
        assert!(FakePool::contains(ip));
        assert_eq!(pool.name_of(ip).as_deref(), Some("registry.npmjs.org"));
        // Garbage is dropped and the socket keeps serving.
        udp.send(&[1, 2, 3]).await.unwrap();
        udp.send(&query(0x1235, "registry.npmjs.org", TYPE_AAAA))
            .await
            .unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), udp.recv(&mut buf))
            .await
            .unwrap()
            .unwrap();
        let r = parse_reply(&buf[..n]);
        assert_eq!((r.id, r.rcode, r.answers.len()), (0x1235, RCODE_NOERROR, 0));

        // TCP: two queries on one connection, each length-prefixed.
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        for (id, name) in [(1u16, "github.com"), (2, "registry.npmjs.org")] {
            let q = query(id, name, TYPE_A);
            tcp.write_all(&(q.len() as u16).to_be_bytes())
                .await
                .unwrap();
            tcp.write_all(&q).await.unwrap();
            let len = tcp.read_u16().await.unwrap();
            let mut reply = vec![0u8; len as usize];
            tcp.read_exact(&mut reply).await.unwrap();
            let r = parse_reply(&reply);
            assert_eq!((r.id, r.rcode), (id, RCODE_NOERROR));
            let expect = pool.assign(name).unwrap();
            assert_eq!(r.answers[0].2, expect.octets().to_vec());
        }
        // A query too short for a header closes the connection.
        tcp.write_all(&[0, 3, 1, 2, 3]).await.unwrap();
        let mut rest = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut rest))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n, 0);

        // Binding the same address again fails with an actionable error.
        let err = serve(pool, addr).unwrap_err();
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }

    #[test]
    fn start_outside_a_runtime_is_an_error_not_a_panic() {
        let pool = Arc::new(FakePool::new());
        let err = start(pool, SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)).unwrap_err();
        assert!(matches!(err, DnsError::Runtime(_)), "{err}");
    }

    /// A real client library (python's socket module, when python3 is
    /// installed) gets an answer it can parse.
    #[tokio::test]
    async fn python_can_query_the_stub() {
        let pool = Arc::new(FakePool::new());
        let addr = serve(pool.clone(), SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)).unwrap();
        let script = r#"
import socket, struct, sys
port = int(sys.argv[1])
q = struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0)
for label in b"pypi.org".split(b"."):
    q += bytes([len(label)]) + label
q += b"\0" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(5)
s.sendto(q, ("127.0.0.1", port))
r = s.recv(512)
ident, flags, qd, an = struct.unpack(">HHHH", r[:8])
assert ident == 0x4242 and flags & 0x8000 and (flags & 0xf) == 0 and an == 1, r
print(socket.inet_ntoa(r[-4:]))
"#;
        let out = match tokio::process::Command::new("python3")
            .args(["-c", script, &addr.port().to_string()])
            .output()
            .await
        {
            Ok(out) => out,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                eprintln!("skipping: no python3 on PATH");
                return;
            }
            Err(e) => panic!("python3: {e}"),
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let printed = String::from_utf8_lossy(&out.stdout);
        let ip: Ipv4Addr = printed.trim().parse().unwrap();
        assert_eq!(pool.name_of(ip).as_deref(), Some("pypi.org"));
    }
}
