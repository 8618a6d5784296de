//! virtio-vsock packets: the `virtio_vsock_hdr` wire format and byte-stream
//! access to descriptor chains (virtio 1.2 §5.10.6).
//!
//! A driver may lay a packet out over its descriptors however it likes: the
//! header alone followed by the payload split over several descriptors (Linux
//! since 2025 splits payloads over 32 KiB), header and payload in one
//! descriptor, zero-length descriptors in between. [`ChainReader`] and
//! [`ChainWriter`] therefore treat a chain's readable (resp. writable)
//! descriptors as one contiguous byte stream. Every descriptor is checked
//! against guest memory when the reader/writer is built, and every copy goes
//! through the bounds-checked [`Bytes`] accessors, so a hostile chain yields a
//! [`PacketError`], never a panic.
//!
//! Limits: split-queue descriptors only (whatever `virtio-queue` yields,
//! including indirect tables); a chain is capped at [`MAX_CHAIN_BYTES`].

use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, GuestMemoryError};

use virtio_queue::desc::split::Descriptor;

/// Size of `struct virtio_vsock_hdr` on the wire (virtio 1.2 §5.10.6): it is
/// packed, little-endian, 44 bytes.
pub const HDR_SIZE: usize = 44;

/// CID of the host (virtio 1.2 §5.10.4: CIDs 0..=2 are reserved, 2 is the
/// host). Guests reach the helper by dialling this CID.
pub const VSOCK_HOST_CID: u64 = 2;

/// `type` of a stream socket packet (virtio 1.2 §5.10.6,
/// `VIRTIO_VSOCK_TYPE_STREAM`). The only type this device supports.
pub const TYPE_STREAM: u16 = 1;
/// `type` of a seqpacket socket packet (virtio 1.2 §5.10.6,
/// `VIRTIO_VSOCK_TYPE_SEQPACKET`); needs `VIRTIO_VSOCK_F_SEQPACKET`, which
/// this device does not offer, so such packets are answered with RST.
pub const TYPE_SEQPACKET: u16 = 2;

/// `op`: invalid operation (virtio 1.2 §5.10.6, `VIRTIO_VSOCK_OP_INVALID`).
pub const OP_INVALID: u16 = 0;
/// `op`: connection request (§5.10.6.4 `VIRTIO_VSOCK_OP_REQUEST`).
pub const OP_REQUEST: u16 = 1;
/// `op`: connection accepted (§5.10.6.4 `VIRTIO_VSOCK_OP_RESPONSE`).
pub const OP_RESPONSE: u16 = 2;
/// `op`: connection reset / refused (§5.10.6.4 `VIRTIO_VSOCK_OP_RST`).
pub const OP_RST: u16 = 3;
/// `op`: the sender will no longer send and/or receive; `flags` holds
/// [`SHUTDOWN_F_RCV`] / [`SHUTDOWN_F_SEND`] (§5.10.6.6).
pub const OP_SHUTDOWN: u16 = 4;
/// `op`: stream payload of `len` bytes follows the header (§5.10.6.3).
pub const OP_RW: u16 = 5;
/// `op`: unsolicited credit information (§5.10.6.3
/// `VIRTIO_VSOCK_OP_CREDIT_UPDATE`).
pub const OP_CREDIT_UPDATE: u16 = 6;
/// `op`: asks the peer to send a credit update (§5.10.6.3
/// `VIRTIO_VSOCK_OP_CREDIT_REQUEST`).
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flag: the sender will receive no more data (§5.10.6.6
/// `VIRTIO_VSOCK_SHUTDOWN_F_RECEIVE`).
pub const SHUTDOWN_F_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more data (§5.10.6.6
/// `VIRTIO_VSOCK_SHUTDOWN_F_SEND`).
pub const SHUTDOWN_F_SEND: u32 = 2;
/// Both SHUTDOWN flags: the connection is closing.
pub const SHUTDOWN_F_BOTH: u32 = SHUTDOWN_F_RCV | SHUTDOWN_F_SEND;

/// Event queue `id` telling the driver that all connections were reset
/// (§5.10.6.7 `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`).
pub const EVENT_TRANSPORT_RESET: u32 = 0;
/// Size of `struct virtio_vsock_event` (§5.10.6.7): one le32 `id`.
pub const EVENT_SIZE: usize = 4;

/// Largest number of bytes a chain may carry (virtio 1.2 §2.7.5.2: a chain
/// must not exceed 2^32 bytes).
pub const MAX_CHAIN_BYTES: u64 = 1 << 32;

/// Errors reading or writing a packet in a descriptor chain. Each one means
/// the driver (the guest) handed us a malformed chain; the device drops the
/// chain (and resets the connection it belonged to, if any).
#[derive(Debug, thiserror::Error)]
pub enum PacketError {
    /// A device-writable descriptor in a chain the device should only read.
    #[error("descriptor at {addr:#x} in a TX chain is device-writable; the guest driver must only queue readable buffers on the TX queue")]
    WritableInTx {
        /// Guest address of the descriptor.
        addr: u64,
    },
    /// A device-readable descriptor in a chain the device should only write.
    #[error("descriptor at {addr:#x} in an RX/event chain is device-readable; the guest driver must only queue writable buffers there")]
    ReadableInRx {
        /// Guest address of the descriptor.
        addr: u64,
    },
    /// A descriptor's buffer is not (wholly) backed by guest memory.
    #[error("descriptor buffer [{addr:#x}, +{len:#x}) is outside guest memory; the guest driver queued a bogus address")]
    OutOfMemory {
        /// Guest address of the buffer.
        addr: u64,
        /// Its length.
        len: u32,
    },
    /// The chain's buffers add up to more than virtio allows.
    #[error("descriptor chain carries more than {MAX_CHAIN_BYTES} bytes")]
    TooLong,
    /// The chain ended before a whole header could be read.
    #[error("chain holds {got} readable bytes, fewer than the {HDR_SIZE}-byte virtio_vsock_hdr")]
    ShortHeader {
        /// Bytes the chain holds.
        got: usize,
    },
    /// The header announces more payload than the chain holds.
    #[error("header announces {len} payload bytes but the chain holds only {available}")]
    LengthMismatch {
        /// `len` field of the header.
        len: u32,
        /// Payload bytes actually in the chain.
        available: usize,
    },
    /// An RX chain too small for a header.
    #[error(
        "RX chain offers {got} writable bytes, fewer than the {HDR_SIZE}-byte virtio_vsock_hdr"
    )]
    RxTooSmall {
        /// Writable bytes the chain offers.
        got: usize,
    },
    /// A guest memory access failed although the range had been checked.
    #[error("guest memory access failed: {0}")]
    Memory(#[from] GuestMemoryError),
}

/// `struct virtio_vsock_hdr` (virtio 1.2 §5.10.6), decoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    /// Source CID.
    pub src_cid: u64,
    /// Destination CID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length (only meaningful for [`OP_RW`]).
    pub len: u32,
    /// Socket type ([`TYPE_STREAM`], [`TYPE_SEQPACKET`]).
    pub kind: u16,
    /// Operation (`OP_*`).
    pub op: u16,
    /// Operation flags ([`SHUTDOWN_F_RCV`], [`SHUTDOWN_F_SEND`] for
    /// [`OP_SHUTDOWN`]).
    pub flags: u32,
    /// Sender's receive buffer size for this connection.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from its receive buffer (free-running).
    pub fwd_cnt: u32,
}

impl Header {
    /// Decodes a header from its wire format.
    pub fn from_bytes(b: &[u8; HDR_SIZE]) -> Self {
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let u32_at = |o: usize| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[o..o + 4]);
            u32::from_le_bytes(a)
        };
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            kind: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    /// Encodes the header in its wire format.
    pub fn to_bytes(&self) -> [u8; HDR_SIZE] {
        let mut b = [0u8; HDR_SIZE];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.kind.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// Human-readable name of `op`, for logs.
    pub fn op_name(&self) -> &'static str {
        match self.op {
            OP_INVALID => "INVALID",
            OP_REQUEST => "REQUEST",
            OP_RESPONSE => "RESPONSE",
            OP_RST => "RST",
            OP_SHUTDOWN => "SHUTDOWN",
            OP_RW => "RW",
            OP_CREDIT_UPDATE => "CREDIT_UPDATE",
            OP_CREDIT_REQUEST => "CREDIT_REQUEST",
            _ => "UNKNOWN",
        }
    }
}

/// One descriptor's buffer, already checked against guest memory.
#[derive(Debug, Clone, Copy)]
struct Segment {
    addr: GuestAddress,
    len: usize,
}

/// Collects the buffers of `descs`, all of which must have `writable` as
/// their device-writable flag, checking each against `mem`.
fn collect<M: GuestMemory>(
    mem: &M,
    descs: impl IntoIterator<Item = Descriptor>,
    writable: bool,
) -> Result<(Vec<Segment>, usize), PacketError> {
    let mut segs = Vec::new();
    let mut total: u64 = 0;
    for d in descs {
        let addr = d.addr();
        if d.is_write_only() != writable {
            return Err(if writable {
                PacketError::ReadableInRx { addr: addr.0 }
            } else {
                PacketError::WritableInTx { addr: addr.0 }
            });
        }
        let len = d.len();
        if len == 0 {
            continue;
        }
        if !mem.check_range(addr, len as usize) {
            return Err(PacketError::OutOfMemory { addr: addr.0, len });
        }
        total += u64::from(len);
        if total > MAX_CHAIN_BYTES {
            return Err(PacketError::TooLong);
        }
        segs.push(Segment {
            addr,
            len: len as usize,
        });
    }
    let total = usize::try_from(total).map_err(|_| PacketError::TooLong)?;
    Ok((segs, total))
}

/// Sequential reader over the device-readable buffers of a chain.
pub struct ChainReader<'m, M> {
    mem: &'m M,
    segs: Vec<Segment>,
    seg: usize,
    off: usize,
    remaining: usize,
}

impl<'m, M: GuestMemory> ChainReader<'m, M> {
    /// Builds a reader over `descs` (a chain's descriptors). Every descriptor
    /// must be device-readable and inside guest memory.
    pub fn new(
        mem: &'m M,
        descs: impl IntoIterator<Item = Descriptor>,
    ) -> Result<Self, PacketError> {
        let (segs, remaining) = collect(mem, descs, false)?;
        Ok(Self {
            mem,
            segs,
            seg: 0,
            off: 0,
            remaining,
        })
    }

    /// Bytes left to read.
    pub fn remaining(&self) -> usize {
        self.remaining
    }

    /// Copies up to `buf.len()` bytes into `buf`; returns how many (less only
    /// at the end of the chain).
    pub fn read(&mut self, buf: &mut [u8]) -> Result<usize, PacketError> {
        let mut done = 0;
        while done < buf.len() && self.seg < self.segs.len() {
            let s = self.segs[self.seg];
            let n = (s.len - self.off).min(buf.len() - done);
            let at = s
                .addr
                .checked_add(self.off as u64)
                .ok_or(PacketError::TooLong)?;
            self.mem.read_slice(&mut buf[done..done + n], at)?;
            done += n;
            self.advance(n);
        }
        Ok(done)
    }

    /// Reads a whole `virtio_vsock_hdr`.
    pub fn read_header(&mut self) -> Result<Header, PacketError> {
        let mut b = [0u8; HDR_SIZE];
        let got = self.read(&mut b)?;
        if got < HDR_SIZE {
            return Err(PacketError::ShortHeader { got });
        }
        Ok(Header::from_bytes(&b))
    }

    fn advance(&mut self, n: usize) {
        self.off += n;
        self.remaining -= n;
        if self.seg < self.segs.len() && self.off == self.segs[self.seg].len {
            self.seg += 1;
            self.off = 0;
        }
    }
}

/// Sequential writer over the device-writable buffers of a chain.
pub struct ChainWriter<'m, M> {
    mem: &'m M,
    segs: Vec<Segment>,
    seg: usize,
    off: usize,
    capacity: usize,
    written: usize,
}

impl<'m, M: GuestMemory> ChainWriter<'m, M> {
    /// Builds a writer over `descs`. Every descriptor must be
    /// device-writable and inside guest memory.
    pub fn new(
        mem: &'m M,
        descs: impl IntoIterator<Item = Descriptor>,
    ) -> Result<Self, PacketError> {
        let (segs, capacity) = collect(mem, descs, true)?;
        Ok(Self {
            mem,
            segs,
            seg: 0,
            off: 0,
            capacity,
            written: 0,
        })
    }

    /// Total writable bytes of the chain.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes written so far (what goes in the used ring).
    pub fn written(&self) -> usize {
        self.written
    }

    /// Copies as much of `data` as fits; returns how many bytes were written.
    pub fn write(&mut self, data: &[u8]) -> Result<usize, PacketError> {
        let mut done = 0;
        while done < data.len() && self.seg < self.segs.len() {
            let s = self.segs[self.seg];
            let n = (s.len - self.off).min(data.len() - done);
            let at = s
                .addr
                .checked_add(self.off as u64)
                .ok_or(PacketError::TooLong)?;
            self.mem.write_slice(&data[done..done + n], at)?;
            done += n;
            self.off += n;
            self.written += n;
            if self.off == s.len {
                self.seg += 1;
                self.off = 0;
            }
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    const R: u16 = 0;
    const W: u16 = 2; // VRING_DESC_F_WRITE

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x10000),
            (GuestAddress(0x10000), 0x10000),
        ])
        .unwrap()
    }

    fn d(addr: u64, len: u32, flags: u16) -> Descriptor {
        Descriptor::new(addr, len, flags, 0)
    }

    #[test]
    fn header_roundtrip_is_little_endian_and_44_bytes() {
        let h = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 0x1122_3344,
            dst_port: 51234,
            len: 7,
            kind: TYPE_STREAM,
            op: OP_RW,
            flags: 0,
            buf_alloc: 0x40000,
            fwd_cnt: 9,
        };
        let b = h.to_bytes();
        assert_eq!(b.len(), 44);
        assert_eq!(&b[16..20], &[0x44, 0x33, 0x22, 0x11]);
        assert_eq!(&b[30..32], &[5, 0]);
        assert_eq!(Header::from_bytes(&b), h);
    }

    #[test]
    fn reader_crosses_descriptors_and_regions() {
        let m = mem();
        let data: Vec<u8> = (0..200u8).collect();
        // 100 bytes straddling the region boundary at 0x10000, then 100 more.
        m.write_slice(&data[..100], GuestAddress(0xffce)).unwrap();
        m.write_slice(&data[100..], GuestAddress(0x2000)).unwrap();
        let mut r =
            ChainReader::new(&m, [d(0xffce, 100, R), d(0x5000, 0, R), d(0x2000, 100, R)]).unwrap();
        assert_eq!(r.remaining(), 200);
        let mut out = vec![0u8; 150];
        assert_eq!(r.read(&mut out).unwrap(), 150);
        assert_eq!(&out[..], &data[..150]);
        let mut out = vec![0u8; 100];
        assert_eq!(r.read(&mut out).unwrap(), 50);
        assert_eq!(&out[..50], &data[150..]);
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn reader_rejects_hostile_chains() {
        let m = mem();
        assert!(matches!(
            ChainReader::new(&m, [d(0x1000, 44, W)]),
            Err(PacketError::WritableInTx { .. })
        ));
        assert!(matches!(
            ChainReader::new(&m, [d(0x1_ff00, 0x200, R)]),
            Err(PacketError::OutOfMemory { .. })
        ));
        assert!(matches!(
            ChainReader::new(&m, [d(u64::MAX - 4, 0x10, R)]),
            Err(PacketError::OutOfMemory { .. })
        ));
        let mut r = ChainReader::new(&m, [d(0x1000, 10, R)]).unwrap();
        assert!(matches!(
            r.read_header(),
            Err(PacketError::ShortHeader { got: 10 })
        ));
        let mut r = ChainReader::new(&m, std::iter::empty()).unwrap();
        assert!(matches!(
            r.read_header(),
            Err(PacketError::ShortHeader { got: 0 })
        ));
    }

    #[test]
    fn writer_fills_segments_in_order() {
        let m = mem();
        let mut w = ChainWriter::new(&m, [d(0x3000, 10, W), d(0x4000, 5, W)]).unwrap();
        assert_eq!(w.capacity(), 15);
        assert_eq!(w.write(&[1u8; 12]).unwrap(), 12);
        assert_eq!(w.write(&[2u8; 12]).unwrap(), 3);
        assert_eq!(w.written(), 15);
        let mut out = [0u8; 5];
        m.read_slice(&mut out, GuestAddress(0x4000)).unwrap();
        assert_eq!(out, [1, 1, 2, 2, 2]);
        assert!(matches!(
            ChainWriter::new(&m, [d(0x3000, 10, R)]),
            Err(PacketError::ReadableInRx { .. })
        ));
    }
}
