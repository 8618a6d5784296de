//! Finding a userland's root filesystem on a virtio-blk disk by its ext4
//! label, without `blkid` or udev.
//!
//! The disk itself is found by serial ([`super::super::sessiondisk::find_disk_by_serial`]);
//! this module then looks at the whole disk and at each of its partitions
//! (the kernel's built-in GPT/MBR parsers register them as
//! `/sys/block/<disk>/<disk><n>` with a `partition` attribute, and devtmpfs
//! makes their `/dev` nodes) and reads the ext2/3/4 superblock's magic and
//! volume label ([`crate::extfs`]) from each.
//!
//! Limits: only ext2/3/4 labels are read; a label that is not UTF-8 never
//! matches; partitions of partitions (none on Linux) are not looked for.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::extfs::{self, Superblock};

/// Bytes read from the start of each device: through the superblock's label.
pub const HEAD_LEN: usize = extfs::SUPERBLOCK_OFFSET as usize + extfs::LABEL_AT + extfs::LABEL_LEN;

/// sysfs attribute present in a partition's directory (its number).
const PARTITION_ATTR: &str = "partition";

/// Errors finding a labelled filesystem on a disk.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error(
        "no ext filesystem labelled {label:?} on /dev/{disk} or its partitions (found: {found})"
    )]
    NoLabel {
        disk: String,
        label: String,
        found: String,
    },
}

/// What the head of one device holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// An ext2/3/4 superblock with this label (empty when unlabelled; lossy
    /// UTF-8 for display).
    Ext(String),
    /// No ext superblock.
    Other,
    /// The device could not be read.
    Unreadable(String),
}

/// Reads the head of `dev` and says what it holds.
pub fn read_head(dev: &Path) -> Head {
    let mut head = [0u8; HEAD_LEN];
    match File::open(dev).and_then(|f| f.read_exact_at(&mut head, 0)) {
        Ok(()) => Superblock::in_head(&head)
            .and_then(|sb| sb.label())
            .map_or(Head::Other, Head::Ext),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Head::Other,
        Err(e) => Head::Unreadable(e.to_string()),
    }
}

/// The partitions of `disk` listed in `sys_block/<disk>/` (entries named
/// `<disk>…` with a `partition` attribute), by partition number.
pub fn partitions(sys_block: &Path, disk: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(sys_block.join(disk)) else {
        return Vec::new();
    };
    let mut found: Vec<(u64, String)> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| name.starts_with(disk) && name.len() > disk.len())
        .filter_map(|name| {
            let raw =
                std::fs::read_to_string(sys_block.join(disk).join(&name).join(PARTITION_ATTR))
                    .ok()?;
            Some((raw.trim().parse().ok()?, name))
        })
        .collect();
    found.sort();
    found.into_iter().map(|(_, name)| name).collect()
}

/// The device node (in `dev_dir`) of the ext filesystem labelled `label` on
/// `disk`: the whole disk if it carries it, else its first partition that
/// does. The error lists what each device held.
pub fn find_labelled(
    sys_block: &Path,
    dev_dir: &Path,
    disk: &str,
    label: &str,
) -> Result<PathBuf, DiskError> {
    let mut seen = Vec::new();
    let devices = std::iter::once(disk.to_string()).chain(partitions(sys_block, disk));
    for name in devices {
        let dev = dev_dir.join(&name);
        match read_head(&dev) {
            Head::Ext(l) if l == label => return Ok(dev),
            Head::Ext(l) => seen.push(format!("{name} ext label {l:?}")),
            Head::Other => seen.push(format!("{name} not ext")),
            Head::Unreadable(e) => seen.push(format!("{name} unreadable: {e}")),
        }
    }
    Err(DiskError::NoLabel {
        disk: disk.to_string(),
        label: label.to_string(),
        found: seen.join(", "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device image whose head holds an ext superblock labelled `label`.
    fn ext_head(label: &[u8]) -> Vec<u8> {
        let sb = extfs::SUPERBLOCK_OFFSET as usize;
        let mut head = vec![0u8; 4096];
        head[sb + extfs::MAGIC_AT..sb + extfs::MAGIC_AT + 2]
            .copy_from_slice(&extfs::MAGIC.to_le_bytes());
        head[sb + extfs::LABEL_AT..sb + extfs::LABEL_AT + label.len()].copy_from_slice(label);
        head
    }

    #[test]
    fn devices_are_read_through_the_label_only() {
        let t = tempfile::tempdir().unwrap();
        let dev = t.path().join("vdb");
        std::fs::write(&dev, ext_head(b"cowork-rootfs")).unwrap();
        assert_eq!(read_head(&dev), Head::Ext("cowork-rootfs".into()));
        // A device that ends with the label is long enough; one byte less is not.
        std::fs::write(&dev, &ext_head(b"cowork-rootfs")[..HEAD_LEN]).unwrap();
        assert_eq!(read_head(&dev), Head::Ext("cowork-rootfs".into()));
        std::fs::write(&dev, &ext_head(b"cowork-rootfs")[..HEAD_LEN - 1]).unwrap();
        assert_eq!(read_head(&dev), Head::Other);
    }

    #[test]
    fn partitions_come_from_sysfs_in_number_order() {
        let t = tempfile::tempdir().unwrap();
        let sys = t.path();
        let disk = sys.join("vdb");
        // Entries of a real disk directory: attributes, holders, partitions.
        for d in ["queue", "holders", "mq", "vdb15", "vdb1", "vdb14", "vdb2"] {
            std::fs::create_dir_all(disk.join(d)).unwrap();
        }
        for (p, n) in [("vdb1", "1"), ("vdb14", "14"), ("vdb15", "15\n")] {
            std::fs::write(disk.join(p).join("partition"), n).unwrap();
        }
        // vdb2 has no partition attribute: not a partition.
        std::fs::write(disk.join("size"), "2048\n").unwrap();
        assert_eq!(partitions(sys, "vdb"), ["vdb1", "vdb14", "vdb15"]);
        assert!(partitions(sys, "vdz").is_empty());
    }

    #[test]
    fn the_labelled_device_is_found_on_the_disk_or_a_partition() {
        let t = tempfile::tempdir().unwrap();
        let sys = t.path().join("sys");
        let dev = t.path().join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        for (p, n) in [("vdb1", "1"), ("vdb14", "14"), ("vdb15", "15")] {
            std::fs::create_dir_all(sys.join("vdb").join(p)).unwrap();
            std::fs::write(sys.join("vdb").join(p).join("partition"), n).unwrap();
        }
        // A GPT disk: the whole disk is no filesystem, p1 is the root.
        let mut gpt = vec![0u8; 4096];
        gpt[512..520].copy_from_slice(b"EFI PART");
        std::fs::write(dev.join("vdb"), &gpt).unwrap();
        std::fs::write(dev.join("vdb14"), [0u8; 100]).unwrap();
        std::fs::write(dev.join("vdb15"), ext_head(b"UEFI")).unwrap();
        std::fs::write(dev.join("vdb1"), ext_head(b"cloudimg-rootfs")).unwrap();
        assert_eq!(
            find_labelled(&sys, &dev, "vdb", "cloudimg-rootfs").unwrap(),
            dev.join("vdb1")
        );
        // Without the label the error says what each device held.
        std::fs::write(dev.join("vdb1"), ext_head(b"other")).unwrap();
        let e = find_labelled(&sys, &dev, "vdb", "cloudimg-rootfs")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("vdb not ext")
                && e.contains("vdb1 ext label \"other\"")
                && e.contains("vdb14 not ext")
                && e.contains("vdb15 ext label \"UEFI\""),
            "{e}"
        );
        // A whole-disk filesystem (our default image) is found as the disk.
        std::fs::write(dev.join("vda"), ext_head(b"cowork-rootfs")).unwrap();
        assert_eq!(
            find_labelled(&sys, &dev, "vda", "cowork-rootfs").unwrap(),
            dev.join("vda")
        );
        // A missing node is reported, not a panic.
        let e = find_labelled(&sys, &dev, "vdc", "cowork-rootfs").unwrap_err();
        assert!(e.to_string().contains("vdc unreadable"), "{e}");
    }
}
