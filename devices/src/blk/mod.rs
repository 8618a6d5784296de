//! virtio-blk: disks backed by host image files.
//!
//! The pieces, outside in:
//!
//! * [`device`]: the device model over one request queue ([`BlkModel`]) and
//!   its in-process face for the vmm's virtio-mmio transport
//!   ([`BlkDevice`]). The vhost-user face is [`crate::vhost_user::blk`].
//! * [`request`]: parsing and executing one `virtio_blk_req` from a
//!   descriptor chain (virtio 1.2 §5.2.6), treating every guest value as
//!   hostile.
//! * [`image`]: the [`BlockBackend`] trait and [`RawImage`], a raw image
//!   file opened read-write (the session disk) or read-only, plus
//!   [`create_sparse_image`] for `createVM {diskSizeGB}`.
//!
//! Requests served: `IN`, `OUT`, `FLUSH` (fdatasync of every file behind the
//! disk), `GET_ID` (the serial), `DISCARD` and `WRITE_ZEROES` (holes punched
//! in the host file; written zeroes where the host filesystem cannot punch).
//! Anything else completes with `VIRTIO_BLK_S_UNSUPP`.
//!
//! Limits: one request queue (no `VIRTIO_BLK_F_MQ`), requests served one at
//! a time on the device's worker thread with synchronous file I/O; 512-byte
//! logical sectors; an image's size is fixed while the device exists (no
//! resize event); no zoned or secure-erase commands; no writeback-cache
//! toggling (`VIRTIO_BLK_F_CONFIG_WCE` is not offered, so the driver treats
//! the cache as write-back and sends `FLUSH`).

pub mod device;
pub mod image;
pub mod request;

#[cfg(test)]
pub(crate) mod testring;
#[cfg(test)]
mod tests;

pub use device::{BlkConfig, BlkDevice, BlkDeviceError, BlkModel, BlkStats, VIRTIO_ID_BLOCK};
pub use image::{create_sparse_image, BlockBackend, ImageError, RawImage};

/// Size of a virtio-blk sector: offsets and lengths in requests are counted
/// in these units whatever the reported `blk_size` (virtio 1.2 §5.2.6).
pub const SECTOR_SIZE: u64 = 512;
/// log2 of [`SECTOR_SIZE`].
pub const SECTOR_SHIFT: u32 = 9;
/// Length of the `GET_ID` answer: the serial, NUL-padded, not NUL-terminated
/// when it uses all 20 bytes (`VIRTIO_BLK_ID_BYTES`).
pub const ID_BYTES: usize = 20;
/// Serial of the session disk; the guest agent looks for a disk with this
/// serial to mount at `/sessions` (`guest_agent::proto::SESSION_DISK_SERIAL`
/// names the same string).
pub const SESSION_DISK_SERIAL: &str = "cowork-sessions";
