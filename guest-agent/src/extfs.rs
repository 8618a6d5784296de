//! The few fields of an ext2/3/4 superblock that cowork reads: the magic
//! (is this an ext filesystem at all), the volume label (which filesystem),
//! the incompatible-feature flags (does its journal need a replay, can a
//! kernel mount it) and the size (block size and count).
//!
//! A library-level module of plain parsing: the agent uses it to find its
//! userland disk by label and to probe and grow the session disk; the host
//! can use it for the same fields of a disk image. [`Superblock`] is a view
//! over bytes already read; [`read`] reads them from a file or device.
//!
//! Limits: no checksum is verified and nothing beyond these fields is
//! parsed; a field that lies past the bytes given reads as absent. The
//! layout is `struct ext4_super_block` of the Linux kernel (little-endian).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Where the superblock starts, in bytes from the start of its filesystem
/// (the first 1024 bytes are left for a boot sector).
pub const SUPERBLOCK_OFFSET: u64 = 1024;

/// Bytes of the superblock [`read`] reads: through `s_blocks_count_hi`, the
/// last field looked at.
pub const READ_LEN: usize = 0x154;

/// The ext2/3/4 magic (`s_magic`, `EXT4_SUPER_MAGIC`).
pub const MAGIC: u16 = 0xEF53;

/// Offset of `s_magic` in the superblock.
pub const MAGIC_AT: usize = 0x38;

/// Offset of `s_feature_incompat` in the superblock.
pub const INCOMPAT_AT: usize = 0x60;

/// Offset of `s_volume_name` in the superblock.
pub const LABEL_AT: usize = 0x78;

/// Length of `s_volume_name` (NUL-padded, not necessarily NUL-terminated).
pub const LABEL_LEN: usize = 16;

/// Offset of `s_blocks_count_lo` in the superblock.
pub const BLOCKS_COUNT_LO_AT: usize = 0x04;

/// Offset of `s_log_block_size` in the superblock (block size is
/// `1024 << s_log_block_size`).
pub const LOG_BLOCK_SIZE_AT: usize = 0x18;

/// Offset of `s_blocks_count_hi` in the superblock (meaningful with
/// [`INCOMPAT_64BIT`]).
pub const BLOCKS_COUNT_HI_AT: usize = 0x150;

/// `EXT3_FEATURE_INCOMPAT_RECOVER`: the journal holds transactions that were
/// never checkpointed, i.e. the filesystem was not cleanly unmounted (or
/// remounted read-only) before the machine ended.
pub const INCOMPAT_RECOVER: u32 = 0x4;

/// `EXT4_FEATURE_INCOMPAT_64BIT`: `s_blocks_count_hi` is meaningful.
pub const INCOMPAT_64BIT: u32 = 0x80;

/// Largest `s_log_block_size` accepted (64 KiB blocks, the most Linux
/// supports).
pub const MAX_LOG_BLOCK_SIZE: u32 = 6;

/// An ext filesystem's size: its block size and block count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSize {
    /// Bytes per block.
    pub block_size: u64,
    /// Blocks in the filesystem.
    pub blocks: u64,
}

/// The bytes of an ext2/3/4 superblock (from its start) that carry its
/// magic; the other fields read as `None` when the bytes end before them.
#[derive(Debug, Clone, Copy)]
pub struct Superblock<'a> {
    raw: &'a [u8],
}

impl<'a> Superblock<'a> {
    /// The superblock in `sb` (bytes from the superblock's start), or `None`
    /// when they do not hold the ext magic.
    pub fn parse(sb: &'a [u8]) -> Option<Self> {
        let magic = sb.get(MAGIC_AT..MAGIC_AT + 2)?;
        (u16::from_le_bytes([magic[0], magic[1]]) == MAGIC).then_some(Self { raw: sb })
    }

    /// The superblock of the filesystem whose first bytes are `head`, or
    /// `None` when there is no ext magic there.
    pub fn in_head(head: &'a [u8]) -> Option<Self> {
        Self::parse(head.get(SUPERBLOCK_OFFSET as usize..)?)
    }

    fn u32_at(&self, at: usize) -> Option<u32> {
        let b = self.raw.get(at..at + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// The volume label: up to its first NUL, bytes that are not UTF-8
    /// replaced (empty when unlabelled).
    pub fn label(&self) -> Option<String> {
        let raw = self.raw.get(LABEL_AT..LABEL_AT + LABEL_LEN)?;
        let end = raw.iter().position(|&b| b == 0).unwrap_or(LABEL_LEN);
        Some(String::from_utf8_lossy(&raw[..end]).into_owned())
    }

    /// The incompatible-feature flags (`s_feature_incompat`).
    pub fn incompat(&self) -> Option<u32> {
        self.u32_at(INCOMPAT_AT)
    }

    /// Whether the journal needs a replay ([`INCOMPAT_RECOVER`]); `false`
    /// when the flags were not read.
    pub fn needs_recovery(&self) -> bool {
        self.incompat()
            .is_some_and(|flags| flags & INCOMPAT_RECOVER != 0)
    }

    /// The filesystem size, or `None` when its fields were not read or the
    /// block size is out of range.
    pub fn size(&self) -> Option<FsSize> {
        let log = self.u32_at(LOG_BLOCK_SIZE_AT)?;
        if log > MAX_LOG_BLOCK_SIZE {
            return None;
        }
        let mut blocks = u64::from(self.u32_at(BLOCKS_COUNT_LO_AT)?);
        if self.incompat()? & INCOMPAT_64BIT != 0 {
            blocks |= u64::from(self.u32_at(BLOCKS_COUNT_HI_AT)?) << 32;
        }
        Some(FsSize {
            block_size: 1024 << log,
            blocks,
        })
    }
}

/// Reads the [`READ_LEN`] superblock bytes of the filesystem that starts
/// `fs_offset` bytes into `file` (a device, a partition's offset in a disk
/// image). Parse them with [`Superblock::parse`].
pub fn read(file: &File, fs_offset: u64) -> io::Result<Vec<u8>> {
    let at = fs_offset
        .checked_add(SUPERBLOCK_OFFSET)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut sb = vec![0u8; READ_LEN];
    file.read_exact_at(&mut sb, at)?;
    Ok(sb)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Superblock bytes with the magic, `label` and `incompat` set.
    fn superblock(label: &[u8], incompat: u32) -> Vec<u8> {
        let mut sb = vec![0u8; READ_LEN];
        sb[MAGIC_AT..MAGIC_AT + 2].copy_from_slice(&MAGIC.to_le_bytes());
        sb[LABEL_AT..LABEL_AT + label.len()].copy_from_slice(label);
        sb[INCOMPAT_AT..INCOMPAT_AT + 4].copy_from_slice(&incompat.to_le_bytes());
        sb
    }

    #[test]
    fn labels_are_read_from_ext_superblocks_only() {
        let label = |sb: &[u8]| Superblock::parse(sb).and_then(|s| s.label());
        assert_eq!(
            label(&superblock(b"cloudimg-rootfs", 0)).as_deref(),
            Some("cloudimg-rootfs")
        );
        // A 16-byte label fills the field with no NUL.
        assert_eq!(
            label(&superblock(b"0123456789abcdef", 0)).as_deref(),
            Some("0123456789abcdef")
        );
        assert_eq!(label(&superblock(b"", 0)).as_deref(), Some(""));
        // Not UTF-8: replaced, not refused.
        assert_eq!(
            label(&superblock(b"a\xffb", 0)).as_deref(),
            Some("a\u{fffd}b")
        );
        // No magic, or bytes that end inside the label.
        let mut other = superblock(b"cowork-rootfs", 0);
        other[MAGIC_AT] = 0;
        assert!(Superblock::parse(&other).is_none());
        let short = superblock(b"x", 0);
        assert_eq!(label(&short[..LABEL_AT + LABEL_LEN - 1]), None);
        assert!(Superblock::parse(&[]).is_none());
    }

    #[test]
    fn the_superblock_is_found_1024_bytes_into_a_filesystem() {
        let mut head = vec![0u8; SUPERBLOCK_OFFSET as usize];
        head.extend(superblock(b"cowork-rootfs", 0));
        let sb = Superblock::in_head(&head).unwrap();
        assert_eq!(sb.label().as_deref(), Some("cowork-rootfs"));
        // The magic alone (a short read) is still an ext filesystem.
        let magic_end = SUPERBLOCK_OFFSET as usize + MAGIC_AT + 2;
        let sb = Superblock::in_head(&head[..magic_end]).unwrap();
        assert_eq!((sb.label(), sb.incompat()), (None, None));
        assert!(Superblock::in_head(&head[..magic_end - 1]).is_none());
        assert!(Superblock::in_head(&head[SUPERBLOCK_OFFSET as usize..]).is_none());
    }

    #[test]
    fn a_journal_needing_recovery_is_seen() {
        // has_journal is compat; filetype|extents are incompat and harmless.
        assert!(!Superblock::parse(&superblock(b"", 0x42))
            .unwrap()
            .needs_recovery());
        let dirty = superblock(b"", 0x46);
        assert!(Superblock::parse(&dirty).unwrap().needs_recovery());
        let short = Superblock::parse(&dirty[..INCOMPAT_AT]).unwrap();
        assert!(!short.needs_recovery(), "short read");
    }

    #[test]
    fn sizes_are_parsed_and_garbage_refused() {
        let size = |sb: &[u8]| Superblock::parse(sb).and_then(|s| s.size());
        let mut sb = superblock(b"", 0);
        sb[LOG_BLOCK_SIZE_AT..LOG_BLOCK_SIZE_AT + 4].copy_from_slice(&2u32.to_le_bytes());
        sb[BLOCKS_COUNT_LO_AT..BLOCKS_COUNT_LO_AT + 4].copy_from_slice(&1000u32.to_le_bytes());
        sb[BLOCKS_COUNT_HI_AT..BLOCKS_COUNT_HI_AT + 4].copy_from_slice(&1u32.to_le_bytes());
        // Without the 64bit feature the high word is ignored.
        assert_eq!(
            size(&sb),
            Some(FsSize {
                block_size: 4096,
                blocks: 1000
            })
        );
        sb[INCOMPAT_AT..INCOMPAT_AT + 4].copy_from_slice(&INCOMPAT_64BIT.to_le_bytes());
        assert_eq!(size(&sb).unwrap().blocks, (1 << 32) + 1000);
        // A block size beyond 64 KiB, a wrong magic, a short buffer: refused.
        sb[LOG_BLOCK_SIZE_AT..LOG_BLOCK_SIZE_AT + 4].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(size(&sb), None);
        sb[LOG_BLOCK_SIZE_AT..LOG_BLOCK_SIZE_AT + 4].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(size(&sb[..0x100]), None, "64bit needs 0x154 bytes");
        sb[MAGIC_AT] = 0;
        assert_eq!(size(&sb), None);
    }

    #[test]
    fn read_takes_the_superblock_of_a_filesystem_at_an_offset() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        let fs_offset = 4096u64;
        f.write_all(&vec![0u8; (fs_offset + SUPERBLOCK_OFFSET) as usize])
            .unwrap();
        f.write_all(&superblock(b"p1", 0)).unwrap();
        let sb = read(&f, fs_offset).unwrap();
        assert_eq!(
            Superblock::parse(&sb).unwrap().label().as_deref(),
            Some("p1")
        );
        // The whole file read as a filesystem holds no superblock there.
        assert!(Superblock::parse(&read(&f, 0).unwrap()).is_none());
        // Past the end: an error, not a panic.
        let err = read(&f, fs_offset + 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert!(read(&f, u64::MAX).is_err());
    }
}
