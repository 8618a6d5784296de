//! One virtio-blk request: parsing a descriptor chain (virtio 1.2 §5.2.6)
//! and executing it against a [`BlockBackend`].
//!
//! A request is a byte stream over the chain, device-readable part first:
//!
//! ```text
//! readable:  le32 type | le32 reserved | le64 sector | OUT data or
//!            DISCARD/WRITE_ZEROES segments (16 bytes each)
//! writable:  IN data or GET_ID bytes | u8 status (the stream's last byte)
//! ```
//!
//! The parser makes no assumption about how the driver splits that stream
//! into descriptors (the header may share a descriptor with data, the status
//! byte may share one with IN data). Everything in the chain is hostile and
//! checked: descriptor ranges must lie in guest memory, readable descriptors
//! must come before writable ones, the header must be complete and
//! device-readable, the data must travel in the direction the type implies
//! and be a whole number of sectors, and every sector range must lie inside
//! the disk (checked arithmetic throughout). A request that fails a check
//! completes with `VIRTIO_BLK_S_IOERR` (or `VIRTIO_BLK_S_UNSUPP` for an
//! unknown type or flag) written to its status byte; a chain without a
//! writable byte for the status, or whose status byte lies outside guest
//! memory, is returned to the driver with a used length of 0.
//!
//! Limits: data moves through a bounded bounce buffer ([`IO_CHUNK`] bytes
//! at a time), not directly between guest memory and the file.

use std::io;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

use super::image::BlockBackend;
use super::{ID_BYTES, SECTOR_SHIFT, SECTOR_SIZE};

/// Size of the request header (`type`, `reserved`, `sector`).
pub const HEADER_SIZE: u64 = 16;
/// Size of one DISCARD / WRITE_ZEROES segment (`sector`, `num_sectors`,
/// `flags`).
pub const SEGMENT_SIZE: u64 = 16;
/// Segment flag: the device may deallocate the range (WRITE_ZEROES only;
/// set on a DISCARD it makes the request unsupported).
pub const SEGMENT_FLAG_UNMAP: u32 = 1;
/// Largest piece of data moved between guest memory and the backend at a
/// time.
pub const IO_CHUNK: usize = 512 * 1024;

/// Why a request failed. The guest gets the status in [`Self::status`].
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// A descriptor's buffer is not inside guest memory.
    #[error("descriptor buffer at {addr:#x} ({len} bytes) is outside guest memory")]
    BadBuffer {
        /// Guest physical address.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// A device-readable descriptor follows a device-writable one.
    #[error("device-readable descriptor after a device-writable one")]
    Order,
    /// No device-writable byte for the status.
    #[error("no device-writable byte for the status")]
    NoStatus,
    /// The readable part is shorter than the 16-byte header (or the header
    /// was put in device-writable buffers).
    #[error("request header is {0} readable bytes, needs {HEADER_SIZE}")]
    ShortHeader(u64),
    /// Data travels in the wrong direction for the request type.
    #[error("type {kind} request carries {len} bytes of {dir} data it must not have")]
    Direction {
        /// Request type.
        kind: u32,
        /// Offending byte count.
        len: u64,
        /// "device-readable" or "device-writable".
        dir: &'static str,
    },
    /// Data length is not a whole number of sectors.
    #[error("data length {0} is not a multiple of 512")]
    Unaligned(u64),
    /// The sector range runs past the end of the disk.
    #[error("sectors {sector}+{count} run past the end of the disk ({capacity} sectors)")]
    OutOfRange {
        /// First sector.
        sector: u64,
        /// Sector count.
        count: u64,
        /// Disk capacity in sectors.
        capacity: u64,
    },
    /// A write-type request to a read-only disk.
    #[error("type {0} request refused: the disk is read-only")]
    ReadOnly(u32),
    /// A GET_ID request without room for the ID.
    #[error("GET_ID without a device-writable data buffer")]
    NoIdBuffer,
    /// Malformed DISCARD / WRITE_ZEROES segment list.
    #[error("{0}")]
    Segments(String),
    /// A segment flag the device does not support.
    #[error("segment flags {0:#x} not supported for this request type")]
    SegmentFlags(u32),
    /// The request type is not supported (or its feature was not offered).
    #[error("request type {0} is not supported")]
    Unsupported(u32),
    /// Reading or writing guest memory failed.
    #[error("guest memory access failed: {0}")]
    Memory(String),
    /// The host file operation failed.
    #[error("host I/O failed: {0}")]
    Io(#[from] io::Error),
}

impl RequestError {
    /// The status byte reported to the driver.
    pub fn status(&self) -> u8 {
        match self {
            Self::Unsupported(_) | Self::SegmentFlags(_) => VIRTIO_BLK_S_UNSUPP as u8,
            _ => VIRTIO_BLK_S_IOERR as u8,
        }
    }

    /// Whether the error says the chain itself is malformed (as opposed to
    /// a valid request the device refused or failed).
    pub fn is_malformed(&self) -> bool {
        matches!(
            self,
            Self::BadBuffer { .. }
                | Self::Order
                | Self::NoStatus
                | Self::ShortHeader(_)
                | Self::Direction { .. }
                | Self::Unaligned(_)
                | Self::NoIdBuffer
                | Self::Segments(_)
                | Self::Memory(_)
        )
    }
}

/// What the device serves, fixed when it is built.
#[derive(Debug, Clone)]
pub struct DiskParams {
    /// GET_ID answer: the serial, NUL-padded.
    pub id: [u8; ID_BYTES],
    /// DISCARD is offered.
    pub discard: bool,
    /// WRITE_ZEROES is offered.
    pub write_zeroes: bool,
    /// Most segments in one DISCARD / WRITE_ZEROES request.
    pub max_segments: u32,
    /// Most sectors in one segment.
    pub max_segment_sectors: u32,
}

/// The chain's buffers, split by direction.
#[derive(Debug, Default)]
pub struct ChainBuffers {
    readable: Vec<(GuestAddress, u32)>,
    writable: Vec<(GuestAddress, u32)>,
    readable_len: u64,
    writable_len: u64,
    /// First defect found while walking the chain.
    defect: Option<RequestError>,
}

impl ChainBuffers {
    /// Walks `chain`, recording each non-empty buffer and the first defect.
    pub fn from_chain<M, D>(mem: &M, chain: DescriptorChain<D>) -> Self
    where
        M: GuestMemory + ?Sized,
        D: std::ops::Deref,
        D::Target: GuestMemory,
    {
        let mut b = Self::default();
        for desc in chain {
            let (addr, len) = (desc.addr(), desc.len());
            if len == 0 {
                continue;
            }
            if b.defect.is_none() && !mem.check_range(addr, len as usize) {
                b.defect = Some(RequestError::BadBuffer { addr: addr.0, len });
            }
            if desc.is_write_only() {
                b.writable.push((addr, len));
                b.writable_len += u64::from(len);
            } else {
                if !b.writable.is_empty() && b.defect.is_none() {
                    b.defect = Some(RequestError::Order);
                }
                b.readable.push((addr, len));
                b.readable_len += u64::from(len);
            }
        }
        b
    }

    /// Total device-readable bytes.
    pub fn readable_len(&self) -> u64 {
        self.readable_len
    }

    /// Total device-writable bytes (data plus the status byte).
    pub fn writable_len(&self) -> u64 {
        self.writable_len
    }

    /// Copies readable stream bytes `[off, off + buf.len())` into `buf`.
    fn read<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        off: u64,
        buf: &mut [u8],
    ) -> Result<(), RequestError> {
        copy_stream(&self.readable, off, buf.len(), |addr, range| {
            mem.read_slice(&mut buf[range], addr)
        })
    }

    /// Copies `buf` into the writable stream at `off`.
    fn write<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        off: u64,
        buf: &[u8],
    ) -> Result<(), RequestError> {
        copy_stream(&self.writable, off, buf.len(), |addr, range| {
            mem.write_slice(&buf[range], addr)
        })
    }
}

/// Walks the buffers covering stream bytes `[off, off + len)`, calling `f`
/// with each guest address and the matching range of the caller's buffer.
fn copy_stream<F>(
    bufs: &[(GuestAddress, u32)],
    off: u64,
    len: usize,
    mut f: F,
) -> Result<(), RequestError>
where
    F: FnMut(GuestAddress, std::ops::Range<usize>) -> Result<(), vm_memory::GuestMemoryError>,
{
    let mut skip = off;
    let mut done = 0usize;
    for &(addr, blen) in bufs {
        if done == len {
            break;
        }
        let blen = u64::from(blen);
        if skip >= blen {
            skip -= blen;
            continue;
        }
        let n = usize::try_from(blen - skip)
            .unwrap_or(usize::MAX)
            .min(len - done);
        let at = addr
            .checked_add(skip)
            .ok_or_else(|| RequestError::Memory(format!("address {addr:?} + {skip} overflows")))?;
        f(at, done..done + n).map_err(|e| RequestError::Memory(e.to_string()))?;
        done += n;
        skip = 0;
    }
    if done == len {
        Ok(())
    } else {
        Err(RequestError::Memory(format!(
            "stream of {len} bytes at {off} runs past the chain's buffers"
        )))
    }
}

/// How a served chain completes.
#[derive(Debug)]
pub struct Completion {
    /// Used length for the used ring: bytes written to writable buffers.
    pub used_len: u32,
    /// The request type, when the header could be read.
    pub kind: Option<u32>,
    /// The status written, if a status byte could be written.
    pub status: Option<u8>,
    /// Data bytes an OUT request moved from guest memory to the disk.
    pub bytes_from_guest: u64,
    /// Why the request failed, if it did.
    pub error: Option<RequestError>,
}

/// Parses and executes one request chain against `disk`. Never panics on
/// guest data; `scratch` is the bounce buffer (grown to [`IO_CHUNK`]).
pub fn serve<M, D>(
    mem: &M,
    chain: DescriptorChain<D>,
    disk: &mut dyn BlockBackend,
    params: &DiskParams,
    scratch: &mut Vec<u8>,
) -> Completion
where
    M: GuestMemory + ?Sized,
    D: std::ops::Deref,
    D::Target: GuestMemory,
{
    let mut bufs = ChainBuffers::from_chain(mem, chain);
    if bufs.writable_len == 0 {
        return Completion {
            used_len: 0,
            kind: None,
            status: None,
            bytes_from_guest: 0,
            error: Some(bufs.defect.take().unwrap_or(RequestError::NoStatus)),
        };
    }
    let status_off = bufs.writable_len - 1;
    let mut kind = None;
    let result = match bufs.defect.take() {
        Some(e) => Err((e, 0)),
        None => execute(mem, &bufs, disk, params, scratch, &mut kind),
    };
    let (status, written, from_guest, error) = match result {
        Ok(x) => (VIRTIO_BLK_S_OK as u8, x.to_guest, x.from_guest, None),
        Err((e, written)) => (e.status(), written, 0, Some(e)),
    };
    match bufs.write(mem, status_off, &[status]) {
        Ok(()) => Completion {
            used_len: u32::try_from(written.saturating_add(1)).unwrap_or(u32::MAX),
            kind,
            status: Some(status),
            bytes_from_guest: from_guest,
            error,
        },
        Err(e) => Completion {
            used_len: 0,
            kind,
            status: None,
            bytes_from_guest: from_guest,
            error: Some(error.unwrap_or(e)),
        },
    }
}

/// Data a successful request moved.
#[derive(Debug, Clone, Copy, Default)]
struct Xfer {
    /// Bytes written to the writable buffers (before the status byte).
    to_guest: u64,
    /// Bytes read from the readable buffers after the header.
    from_guest: u64,
}

impl Xfer {
    fn to_guest(n: u64) -> Self {
        Self {
            to_guest: n,
            from_guest: 0,
        }
    }
}

/// The request's result, or the error with the bytes already written to
/// the writable buffers.
type Outcome = Result<Xfer, (RequestError, u64)>;

fn execute<M: GuestMemory + ?Sized>(
    mem: &M,
    bufs: &ChainBuffers,
    disk: &mut dyn BlockBackend,
    params: &DiskParams,
    scratch: &mut Vec<u8>,
    kind_out: &mut Option<u32>,
) -> Outcome {
    let fail = |e: RequestError| Err((e, 0));
    if bufs.readable_len < HEADER_SIZE {
        return fail(RequestError::ShortHeader(bufs.readable_len));
    }
    let mut hdr = [0u8; HEADER_SIZE as usize];
    if let Err(e) = bufs.read(mem, 0, &mut hdr) {
        return fail(e);
    }
    let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes([
        hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15],
    ]);
    *kind_out = Some(kind);
    // Data bytes in each direction, beyond the header and the status byte.
    let out_len = bufs.readable_len - HEADER_SIZE;
    let in_len = bufs.writable_len - 1;
    let capacity = disk.size() >> SECTOR_SHIFT;
    match kind {
        VIRTIO_BLK_T_IN => {
            if out_len != 0 {
                return fail(RequestError::Direction {
                    kind,
                    len: out_len,
                    dir: "device-readable",
                });
            }
            let offset = check_range(sector, in_len, capacity).map_err(|e| (e, 0))?;
            read_into_guest(mem, bufs, disk, offset, in_len, scratch)
        }
        VIRTIO_BLK_T_OUT => {
            if in_len != 0 {
                return fail(RequestError::Direction {
                    kind,
                    len: in_len,
                    dir: "device-writable",
                });
            }
            if disk.read_only() {
                return fail(RequestError::ReadOnly(kind));
            }
            let offset = check_range(sector, out_len, capacity).map_err(|e| (e, 0))?;
            write_from_guest(mem, bufs, disk, offset, out_len, scratch).map_err(|e| (e, 0))?;
            Ok(Xfer {
                to_guest: 0,
                from_guest: out_len,
            })
        }
        VIRTIO_BLK_T_FLUSH => {
            disk.flush().map_err(|e| (RequestError::Io(e), 0))?;
            Ok(Xfer::default())
        }
        VIRTIO_BLK_T_GET_ID => {
            if in_len == 0 {
                return fail(RequestError::NoIdBuffer);
            }
            let n = usize::try_from(in_len).unwrap_or(usize::MAX).min(ID_BYTES);
            bufs.write(mem, 0, &params.id[..n]).map_err(|e| (e, 0))?;
            Ok(Xfer::to_guest(n as u64))
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            let offered = if kind == VIRTIO_BLK_T_DISCARD {
                params.discard
            } else {
                params.write_zeroes
            };
            if !offered {
                return fail(RequestError::Unsupported(kind));
            }
            if disk.read_only() {
                return fail(RequestError::ReadOnly(kind));
            }
            segments(mem, bufs, disk, params, kind, out_len, in_len, capacity)
                .map_err(|e| (e, 0))?;
            Ok(Xfer::default())
        }
        other => fail(RequestError::Unsupported(other)),
    }
}

/// Checks `len` data bytes at `sector` against the disk; returns the byte
/// offset.
fn check_range(sector: u64, len: u64, capacity: u64) -> Result<u64, RequestError> {
    if len % SECTOR_SIZE != 0 {
        return Err(RequestError::Unaligned(len));
    }
    check_sectors(sector, len >> SECTOR_SHIFT, capacity)?;
    // capacity << 9 fits u64 (it came from a byte size), so this cannot
    // overflow once the range check passed.
    Ok(sector << SECTOR_SHIFT)
}

fn check_sectors(sector: u64, count: u64, capacity: u64) -> Result<(), RequestError> {
    match sector.checked_add(count) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(RequestError::OutOfRange {
            sector,
            count,
            capacity,
        }),
    }
}

fn grow(scratch: &mut Vec<u8>, len: u64) -> usize {
    if scratch.len() < IO_CHUNK {
        scratch.resize(IO_CHUNK, 0);
    }
    usize::try_from(len).unwrap_or(IO_CHUNK).min(IO_CHUNK)
}

fn read_into_guest<M: GuestMemory + ?Sized>(
    mem: &M,
    bufs: &ChainBuffers,
    disk: &mut dyn BlockBackend,
    offset: u64,
    len: u64,
    scratch: &mut Vec<u8>,
) -> Outcome {
    let mut done = 0u64;
    while done < len {
        let n = grow(scratch, len - done);
        let buf = &mut scratch[..n];
        disk.read_at(buf, offset + done)
            .map_err(|e| (RequestError::Io(e), done))?;
        bufs.write(mem, done, buf).map_err(|e| (e, done))?;
        done += n as u64;
    }
    Ok(Xfer::to_guest(done))
}

fn write_from_guest<M: GuestMemory + ?Sized>(
    mem: &M,
    bufs: &ChainBuffers,
    disk: &mut dyn BlockBackend,
    offset: u64,
    len: u64,
    scratch: &mut Vec<u8>,
) -> Result<(), RequestError> {
    let mut done = 0u64;
    while done < len {
        let n = grow(scratch, len - done);
        let buf = &mut scratch[..n];
        bufs.read(mem, HEADER_SIZE + done, buf)?;
        disk.write_at(buf, offset + done)?;
        done += n as u64;
    }
    Ok(())
}

/// Validates every DISCARD / WRITE_ZEROES segment, then applies them.
#[allow(clippy::too_many_arguments)]
fn segments<M: GuestMemory + ?Sized>(
    mem: &M,
    bufs: &ChainBuffers,
    disk: &mut dyn BlockBackend,
    params: &DiskParams,
    kind: u32,
    out_len: u64,
    in_len: u64,
    capacity: u64,
) -> Result<(), RequestError> {
    if in_len != 0 {
        return Err(RequestError::Direction {
            kind,
            len: in_len,
            dir: "device-writable",
        });
    }
    if out_len == 0 || out_len % SEGMENT_SIZE != 0 {
        return Err(RequestError::Segments(format!(
            "segment list of {out_len} bytes is not a non-empty multiple of {SEGMENT_SIZE}"
        )));
    }
    let count = out_len / SEGMENT_SIZE;
    if count > u64::from(params.max_segments) {
        return Err(RequestError::Segments(format!(
            "{count} segments, at most {} allowed",
            params.max_segments
        )));
    }
    let mut list = Vec::with_capacity(count as usize);
    for i in 0..count {
        let mut s = [0u8; SEGMENT_SIZE as usize];
        bufs.read(mem, HEADER_SIZE + i * SEGMENT_SIZE, &mut s)?;
        let sector = u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]);
        let num = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
        let flags = u32::from_le_bytes([s[12], s[13], s[14], s[15]]);
        let allowed = if kind == VIRTIO_BLK_T_WRITE_ZEROES {
            SEGMENT_FLAG_UNMAP
        } else {
            0
        };
        if flags & !allowed != 0 {
            return Err(RequestError::SegmentFlags(flags));
        }
        if num > params.max_segment_sectors {
            return Err(RequestError::Segments(format!(
                "segment of {num} sectors, at most {} allowed",
                params.max_segment_sectors
            )));
        }
        check_sectors(sector, u64::from(num), capacity)?;
        list.push((sector << SECTOR_SHIFT, u64::from(num) << SECTOR_SHIFT));
    }
    for (offset, len) in list {
        if kind == VIRTIO_BLK_T_DISCARD {
            disk.discard(offset, len)?;
        } else {
            disk.write_zeroes(offset, len)?;
        }
    }
    Ok(())
}
