//! Which userland a VM's sessions run in, decided on the host before boot.
//!
//! Three userlands exist, in order of preference under `auto`:
//!
//! * **bundle**: the client's own `rootfs.img` in `startVM.bundlePath` (a
//!   GPT disk whose ext4 partition labelled [`BUNDLE_ROOTFS_LABEL`] holds an
//!   Ubuntu userland with the client's tools). Only the root filesystem is
//!   used: the bundle's `vmlinuz`/`initrd` are never booted (we always boot
//!   our kernel and initramfs), and the bundle's `sdk-daemon`/systemd never
//!   start (our agent stays PID 1 and execs no init).
//! * **default**: our Debian userland, the image's `rootfs.img` (a
//!   journal-less ext4 labelled `cowork-rootfs`, `scripts/mkrootfs.sh`).
//! * **initramfs**: the busybox initramfs the agent boots from; always there.
//!
//! A chosen root disk is attached read-only: opened `O_RDONLY` on the host
//! (a shared lock), offered with `VIRTIO_BLK_F_RO`, every write refused by
//! the device model; the agent mounts it read-only (`noload` for the bundle,
//! whose journal may be dirty) under a tmpfs overlay. So the file is
//! byte-identical after any session, and nothing written to `/` survives a
//! `stopVM` (the session disk at `/sessions` does).
//!
//! What the host checks ([`inspect_bundle`]): the file opens read-only, has a
//! protective MBR and a GPT header and entry array whose CRC32s are right,
//! one partition inside the file carries an ext4 superblock labelled
//! [`BUNDLE_ROOTFS_LABEL`], and that filesystem uses no incompatible ext4
//! feature our guest kernel (Linux 6.1) lacks. What only the guest can
//! check (that it mounts, and has GNU bash and the dynamic loader) the agent
//! checks; under `auto` our default disk is attached too, so the agent can
//! fall back to it, and says in its hello which userland it took and why
//! (see [`check_hello`]).
//!
//! `--userland` forces one: `bundle` and `default` attach only that disk and
//! fail `startVM` when it is unusable (host check or the agent's); `auto`
//! logs why it skipped a candidate and takes the next.
//!
//! Limits: 512-byte logical sectors only (what raw cloud images use); the
//! GPT backup header is not consulted.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub use guest_agent::proto::{BUNDLE_ROOTFS_LABEL, BUNDLE_ROOTFS_SERIAL, ROOTFS_SERIAL};

use guest_agent::extfs::{self, Superblock};

use super::image::GuestImage;

/// File name of the client's root filesystem inside its bundle directory.
pub const BUNDLE_ROOTFS_FILE: &str = "rootfs.img";
/// Environment variable of `--userland`.
pub const USERLAND_ENV: &str = "COWORK_USERLAND";

/// Logical sector size the GPT is read with.
const SECTOR: u64 = 512;
/// Byte offset of the GPT header (LBA 1).
const GPT_HEADER_OFFSET: u64 = SECTOR;
/// `"EFI PART"`, the GPT header signature.
const GPT_SIGNATURE: &[u8; 8] = b"EFI PART";
/// Smallest GPT header (UEFI 2.x: 92 bytes of defined fields).
const GPT_HEADER_MIN: usize = 92;
/// Offset of the header's CRC32 field inside the header.
const GPT_HEADER_CRC_AT: usize = 16;
/// Most partition entries we read (the usual array has 128).
const GPT_MAX_ENTRIES: u32 = 1024;
/// Smallest partition entry (UEFI: 128 bytes, a power of two multiple).
const GPT_ENTRY_MIN: u32 = 128;
/// Largest partition entry we accept.
const GPT_ENTRY_MAX: u32 = 4096;
/// Offset of the MBR boot signature `55 AA`.
const MBR_SIGNATURE_AT: usize = 510;
/// Where an ext2/3/4 superblock starts inside its filesystem.
const EXT_SUPERBLOCK_OFFSET: u64 = extfs::SUPERBLOCK_OFFSET;
/// Bytes of the superblock read (every field parsed lies below).
const EXT_SUPERBLOCK_LEN: usize = extfs::READ_LEN;
/// Incompatible ext4 features Linux 6.1 mounts (`EXT4_FEATURE_INCOMPAT_SUPP`
/// there): filetype 0x2, recover 0x4, meta_bg 0x10, extents 0x40, 64bit
/// 0x80, mmp 0x100, flex_bg 0x200, ea_inode 0x400, csum_seed 0x2000,
/// largedir 0x4000, inline_data 0x8000, encrypt 0x10000, casefold 0x20000.
const EXT4_INCOMPAT_SUPPORTED: u32 = 0x2
    | 0x4
    | 0x10
    | 0x40
    | 0x80
    | 0x100
    | 0x200
    | 0x400
    | 0x2000
    | 0x4000
    | 0x8000
    | 0x10000
    | 0x20000;

/// What `--userland` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UserlandChoice {
    /// A valid client bundle, else our default userland, else the initramfs.
    #[default]
    Auto,
    /// The client bundle's `rootfs.img`, or fail.
    Bundle,
    /// Our default userland, or fail.
    Default,
    /// The initramfs (busybox) only.
    Initramfs,
}

/// A userland a VM can get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UserlandKind {
    Bundle,
    Default,
    Initramfs,
}

impl UserlandKind {
    /// The word the agent reports in its hello for this userland.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bundle => "bundle",
            Self::Default => "default",
            Self::Initramfs => "initramfs",
        }
    }
}

/// A read-only root disk to attach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootDisk {
    pub path: PathBuf,
    /// The virtio-blk serial the agent finds it by.
    pub serial: &'static str,
    pub kind: UserlandKind,
}

/// What the VM gets: disks to attach (preferred first) and what is expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserlandPlan {
    pub disks: Vec<RootDisk>,
    /// The userland the guest should end up in when the agent accepts the
    /// first disk.
    pub expected: UserlandKind,
    /// Whether another userland than `expected` is a failure (`--userland`
    /// forced one).
    pub strict: bool,
    /// Why candidates were skipped (for the log).
    pub skipped: Vec<String>,
}

/// Why a bundle's root filesystem is not usable.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("{path}: cannot open read-only: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("{path}: cannot read: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path}: not a GPT disk ({why})")]
    NotGpt { path: PathBuf, why: String },
    #[error("{path}: the GPT is corrupt ({why})")]
    CorruptGpt { path: PathBuf, why: String },
    #[error("{path}: no ext4 partition labelled {BUNDLE_ROOTFS_LABEL:?} (found: {found})")]
    NoRoot { path: PathBuf, found: String },
    #[error("{path}: partition {index} uses ext4 features our guest kernel cannot mount (incompat 0x{unsupported:x})")]
    Unsupported {
        path: PathBuf,
        index: u32,
        unsupported: u32,
    },
}

/// Why the userland `--userland` asks for cannot be had: no plan could be
/// made on the host, or the guest did not boot into it.
#[derive(Debug, thiserror::Error)]
pub enum UserlandError {
    #[error("--userland bundle: startVM gave no bundlePath")]
    NoBundlePath,
    #[error("--userland bundle: {0}")]
    Bundle(#[source] BundleError),
    #[error(
        "--userland default: no default userland (the guest image {0} has no rootfs.img, and none was built into a userland directory); build it with `cowork-helper image build` (scripts/setup.sh in a checkout)"
    )]
    NoDefault(PathBuf),
    /// The agent's hello reports another userland than the forced one.
    #[error("the guest did not boot the requested userland: {0}")]
    NotBooted(UserlandReport),
}

/// The userland the agent reports in its hello, against the plan
/// ([`check_hello`]); its text is the log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserlandReport {
    /// The agent's word for the userland it took (`initramfs` when it named
    /// none).
    pub got: String,
    /// What the plan expected.
    pub expected: UserlandKind,
    /// Why the agent rejected candidates (its words).
    pub fallbacks: Vec<String>,
}

impl UserlandReport {
    /// Whether the guest took the userland the plan expected.
    pub fn as_expected(&self) -> bool {
        self.got == self.expected.as_str()
    }
}

impl fmt::Display for UserlandReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "userland {}", self.got)?;
        if !self.as_expected() {
            write!(f, " instead of {}", self.expected.as_str())?;
        }
        if !self.fallbacks.is_empty() {
            write!(f, " (agent: {})", self.fallbacks.join("; "))?;
        }
        Ok(())
    }
}

/// The bundle's root filesystem, as found on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleRoot {
    /// 1-based GPT partition number.
    pub index: u32,
    /// Byte offset and length of the partition in the file.
    pub offset: u64,
    pub len: u64,
}

/// Decides what `choice` gives a VM booting `image`, with the client's
/// bundle directory `bundle_dir` (`startVM.bundlePath`, root-relative like
/// the client's other host paths) when there is one.
pub fn plan(
    choice: UserlandChoice,
    image: &GuestImage,
    bundle_dir: Option<&Path>,
) -> Result<UserlandPlan, UserlandError> {
    let default_disk = image.rootfs.as_ref().map(|p| RootDisk {
        path: p.clone(),
        serial: ROOTFS_SERIAL,
        kind: UserlandKind::Default,
    });
    let bundle = bundle_dir.map(|d| Path::new("/").join(d).join(BUNDLE_ROOTFS_FILE));
    // A missing file is inspect_bundle's open error (forced) or no
    // candidate at all (auto checks first).
    let bundle_disk = |path: &Path| -> Result<RootDisk, BundleError> {
        inspect_bundle(path)?;
        Ok(RootDisk {
            path: path.to_path_buf(),
            serial: BUNDLE_ROOTFS_SERIAL,
            kind: UserlandKind::Bundle,
        })
    };
    let only = |disk: Option<RootDisk>, kind| UserlandPlan {
        disks: disk.into_iter().collect(),
        expected: kind,
        strict: true,
        skipped: Vec::new(),
    };
    match choice {
        UserlandChoice::Initramfs => Ok(only(None, UserlandKind::Initramfs)),
        UserlandChoice::Default => match default_disk {
            Some(d) => Ok(only(Some(d), UserlandKind::Default)),
            None => Err(UserlandError::NoDefault(image.dir.clone())),
        },
        UserlandChoice::Bundle => {
            let Some(path) = bundle else {
                return Err(UserlandError::NoBundlePath);
            };
            bundle_disk(&path)
                .map(|d| only(Some(d), UserlandKind::Bundle))
                .map_err(UserlandError::Bundle)
        }
        UserlandChoice::Auto => {
            let mut skipped = Vec::new();
            let mut disks = Vec::new();
            if let Some(path) = &bundle {
                if path.exists() {
                    match bundle_disk(path) {
                        Ok(d) => disks.push(d),
                        Err(why) => skipped.push(format!("bundle: {why}")),
                    }
                }
            }
            match default_disk {
                Some(d) => disks.push(d),
                None => skipped.push(format!(
                    "default: the guest image {} has no rootfs.img and no userland was built (`cowork-helper image build` builds one)",
                    image.dir.display()
                )),
            }
            let expected = disks.first().map_or(UserlandKind::Initramfs, |d| d.kind);
            Ok(UserlandPlan {
                disks,
                expected,
                strict: false,
                skipped,
            })
        }
    }
}

/// Checks a client bundle's `rootfs.img` without writing to it (see the
/// module doc for what is checked).
pub fn inspect_bundle(path: &Path) -> Result<BundleRoot, BundleError> {
    let file = File::open(path).map_err(|source| BundleError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let size = file
        .metadata()
        .map_err(|source| BundleError::Read {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    inspect_disk(&file, size, path)
}

/// [`inspect_bundle`] over any positioned reader of `size` bytes.
pub fn inspect_disk(
    disk: &impl FileExt,
    size: u64,
    path: &Path,
) -> Result<BundleRoot, BundleError> {
    let not_gpt = |why: &str| BundleError::NotGpt {
        path: path.to_path_buf(),
        why: why.to_string(),
    };
    let corrupt = |why: String| BundleError::CorruptGpt {
        path: path.to_path_buf(),
        why,
    };
    let read = |offset: u64, len: usize| -> Result<Vec<u8>, BundleError> {
        let mut buf = vec![0u8; len];
        disk.read_exact_at(&mut buf, offset)
            .map_err(|source| BundleError::Read {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(buf)
    };
    if size < 3 * SECTOR {
        return Err(not_gpt("smaller than an MBR and a GPT header"));
    }
    let mbr = read(0, SECTOR as usize)?;
    if mbr[MBR_SIGNATURE_AT..MBR_SIGNATURE_AT + 2] != [0x55, 0xAA] {
        return Err(not_gpt("no MBR boot signature"));
    }
    let header = read(GPT_HEADER_OFFSET, SECTOR as usize)?;
    if &header[..8] != GPT_SIGNATURE {
        return Err(not_gpt("no \"EFI PART\" header at LBA 1"));
    }
    let header_size = le32(&header, 12) as usize;
    if !(GPT_HEADER_MIN..=SECTOR as usize).contains(&header_size) {
        return Err(corrupt(format!("header size {header_size}")));
    }
    let mut zeroed = header[..header_size].to_vec();
    zeroed[GPT_HEADER_CRC_AT..GPT_HEADER_CRC_AT + 4].fill(0);
    let stored_crc = le32(&header, GPT_HEADER_CRC_AT);
    if crc32(&zeroed) != stored_crc {
        return Err(corrupt("header CRC32 mismatch".to_string()));
    }
    let entries_lba = le64(&header, 72);
    let count = le32(&header, 80);
    let entry_size = le32(&header, 84);
    let entries_crc = le32(&header, 88);
    if count == 0 || count > GPT_MAX_ENTRIES {
        return Err(corrupt(format!("{count} partition entries")));
    }
    if !(GPT_ENTRY_MIN..=GPT_ENTRY_MAX).contains(&entry_size) || !entry_size.is_power_of_two() {
        return Err(corrupt(format!("partition entry size {entry_size}")));
    }
    let array_len = count as usize * entry_size as usize;
    let array_at = entries_lba
        .checked_mul(SECTOR)
        .filter(|at| {
            at.checked_add(array_len as u64)
                .is_some_and(|end| end <= size)
        })
        .ok_or_else(|| {
            corrupt(format!(
                "partition array at LBA {entries_lba} lies outside the disk"
            ))
        })?;
    let array = read(array_at, array_len)?;
    if crc32(&array) != entries_crc {
        return Err(corrupt("partition array CRC32 mismatch".to_string()));
    }
    let mut found = Vec::new();
    for (i, entry) in array.chunks_exact(entry_size as usize).enumerate() {
        if entry[..16].iter().all(|b| *b == 0) {
            continue; // unused entry
        }
        let index = i as u32 + 1;
        let (first, last) = (le64(entry, 32), le64(entry, 40));
        let span = last
            .checked_sub(first)
            .and_then(|n| n.checked_add(1))
            .and_then(|n| n.checked_mul(SECTOR));
        let offset = first.checked_mul(SECTOR);
        let (Some(len), Some(offset)) = (span, offset) else {
            found.push(format!("p{index}: bad extent"));
            continue;
        };
        if offset.checked_add(len).is_none_or(|end| end > size)
            || len < EXT_SUPERBLOCK_OFFSET + EXT_SUPERBLOCK_LEN as u64
        {
            found.push(format!("p{index}: outside the disk"));
            continue;
        }
        let raw = read(offset + EXT_SUPERBLOCK_OFFSET, EXT_SUPERBLOCK_LEN)?;
        let Some(sb) = Superblock::parse(&raw) else {
            found.push(format!("p{index}: not ext2/3/4"));
            continue;
        };
        let label = sb.label().unwrap_or_default();
        if label != BUNDLE_ROOTFS_LABEL {
            found.push(format!("p{index}: ext4 {label:?}"));
            continue;
        }
        let unsupported = sb.incompat().unwrap_or(0) & !EXT4_INCOMPAT_SUPPORTED;
        if unsupported != 0 {
            return Err(BundleError::Unsupported {
                path: path.to_path_buf(),
                index,
                unsupported,
            });
        }
        return Ok(BundleRoot { index, offset, len });
    }
    Err(BundleError::NoRoot {
        path: path.to_path_buf(),
        found: if found.is_empty() {
            "no partitions".to_string()
        } else {
            found.join(", ")
        },
    })
}

/// Checks the userland the agent reports in its hello against the plan:
/// returns the report for the log, or an error when a forced choice was not
/// met.
pub fn check_hello(
    plan: &UserlandPlan,
    got: Option<&str>,
    fallbacks: &[String],
) -> Result<UserlandReport, UserlandError> {
    let report = UserlandReport {
        got: got.unwrap_or("initramfs").to_string(),
        expected: plan.expected,
        fallbacks: fallbacks.to_vec(),
    };
    if plan.strict && !report.as_expected() {
        Err(UserlandError::NotBooted(report))
    } else {
        Ok(report)
    }
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

/// CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320), as GPT uses.
pub fn crc32(data: &[u8]) -> u32 {
    const POLY: u32 = 0xEDB8_8320;
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { POLY ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut crc = !0u32;
    for b in data {
        crc = TABLE[((crc ^ *b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

#[cfg(test)]
mod tests;
