use super::*;
use crate::backend::image::{IMAGE_FORMAT, ROOTFS_FILE};

/// Sectors before the first partition (MBR, GPT header, 128 entries).
const FIRST_LBA: u64 = 2048;

/// An ext4-looking partition: a superblock with the magic, a label and
/// incompat flags.
fn ext_partition(label: &str, incompat: u32, sectors: u64) -> Vec<u8> {
    let mut p = vec![0u8; (sectors * SECTOR) as usize];
    let sb = EXT_SUPERBLOCK_OFFSET as usize;
    let (magic_at, incompat_at, label_at) = (
        sb + extfs::MAGIC_AT,
        sb + extfs::INCOMPAT_AT,
        sb + extfs::LABEL_AT,
    );
    p[magic_at..magic_at + 2].copy_from_slice(&extfs::MAGIC.to_le_bytes());
    p[incompat_at..incompat_at + 4].copy_from_slice(&incompat.to_le_bytes());
    p[label_at..label_at + label.len()].copy_from_slice(label.as_bytes());
    p
}

/// A GPT disk image holding `parts` back to back from [`FIRST_LBA`].
fn gpt_disk(parts: &[Vec<u8>]) -> Vec<u8> {
    let body: usize = parts.iter().map(Vec::len).sum();
    let total = FIRST_LBA as usize * SECTOR as usize + body + 34 * SECTOR as usize;
    let mut d = vec![0u8; total];
    d[MBR_SIGNATURE_AT] = 0x55;
    d[MBR_SIGNATURE_AT + 1] = 0xAA;
    let mut entries = vec![0u8; 128 * 128];
    let mut lba = FIRST_LBA;
    for (i, p) in parts.iter().enumerate() {
        let e = &mut entries[i * 128..(i + 1) * 128];
        e[..16].copy_from_slice(&[0xAF; 16]); // any non-zero type GUID
        e[16..32].copy_from_slice(&[i as u8 + 1; 16]);
        let sectors = p.len() as u64 / SECTOR;
        e[32..40].copy_from_slice(&lba.to_le_bytes());
        e[40..48].copy_from_slice(&(lba + sectors - 1).to_le_bytes());
        let at = (lba * SECTOR) as usize;
        d[at..at + p.len()].copy_from_slice(p);
        lba += sectors;
    }
    let h = SECTOR as usize;
    d[h..h + 8].copy_from_slice(GPT_SIGNATURE);
    d[h + 8..h + 12].copy_from_slice(&0x0001_0000u32.to_le_bytes());
    d[h + 12..h + 16].copy_from_slice(&92u32.to_le_bytes());
    d[h + 24..h + 32].copy_from_slice(&1u64.to_le_bytes());
    d[h + 72..h + 80].copy_from_slice(&2u64.to_le_bytes());
    d[h + 80..h + 84].copy_from_slice(&128u32.to_le_bytes());
    d[h + 84..h + 88].copy_from_slice(&128u32.to_le_bytes());
    d[h + 88..h + 92].copy_from_slice(&crc32(&entries).to_le_bytes());
    let crc = crc32(&d[h..h + 92]);
    d[h + 16..h + 20].copy_from_slice(&crc.to_le_bytes());
    d[2 * h..2 * h + entries.len()].copy_from_slice(&entries);
    d
}

fn inspect(d: &[u8]) -> Result<BundleRoot, BundleError> {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), d).unwrap();
    inspect_bundle(f.path())
}

#[test]
fn crc32_matches_the_ieee_check_value() {
    assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    assert_eq!(crc32(b""), 0);
}

#[test]
fn finds_the_cloudimg_partition_among_others() {
    let disk = gpt_disk(&[
        vec![0u8; 8 * 1024], // like the BIOS boot partition: no filesystem
        ext_partition("UEFI-ish", 0x2 | 0x40, 16),
        ext_partition(BUNDLE_ROOTFS_LABEL, 0x2 | 0x4 | 0x40 | 0x80 | 0x200, 64),
    ]);
    let root = inspect(&disk).unwrap();
    assert_eq!(root.index, 3);
    assert_eq!(root.offset, (FIRST_LBA + 16 + 16) * SECTOR);
    assert_eq!(root.len, 64 * SECTOR);
}

#[test]
fn refuses_what_is_not_a_usable_bundle_root() {
    let text = |r: Result<BundleRoot, BundleError>| r.unwrap_err().to_string();

    let e = text(inspect(&[7u8; 4096]));
    assert!(e.contains("not a GPT disk") && e.contains("MBR"), "{e}");

    let e = text(inspect(&[0u8; 100]));
    assert!(e.contains("smaller than"), "{e}");

    let good = gpt_disk(&[ext_partition(BUNDLE_ROOTFS_LABEL, 0x2, 64)]);
    let mut bad_header = good.clone();
    bad_header[SECTOR as usize + 40] ^= 1;
    let e = text(inspect(&bad_header));
    assert!(e.contains("header CRC32 mismatch"), "{e}");

    let mut bad_entries = good.clone();
    bad_entries[2 * SECTOR as usize + 40] ^= 1;
    let e = text(inspect(&bad_entries));
    assert!(e.contains("partition array CRC32"), "{e}");

    let e = text(inspect(&gpt_disk(&[ext_partition("other", 0x2, 64)])));
    assert!(
        e.contains("no ext4 partition labelled") && e.contains("\"other\""),
        "{e}"
    );

    let e = text(inspect(&gpt_disk(&[vec![0u8; 64 * 512]])));
    assert!(e.contains("p1: not ext2/3/4"), "{e}");

    // dirdata (0x1000) is not mountable by 6.1.
    let e = text(inspect(&gpt_disk(&[ext_partition(
        BUNDLE_ROOTFS_LABEL,
        0x1002,
        64,
    )])));
    assert!(e.contains("incompat 0x1000"), "{e}");

    // A partition claiming more than the file holds.
    let mut truncated = good.clone();
    truncated.truncate((FIRST_LBA * SECTOR) as usize + 32 * SECTOR as usize);
    let e = text(inspect(&truncated));
    assert!(e.contains("outside the disk"), "{e}");
}

#[test]
fn hostile_gpt_fields_are_errors_not_panics() {
    let good = gpt_disk(&[ext_partition(BUNDLE_ROOTFS_LABEL, 0x2, 64)]);
    let h = SECTOR as usize;
    for (at, value) in [
        (h + 12, u32::MAX), // header size
        (h + 80, u32::MAX), // entry count
        (h + 84, 3),        // entry size
        (h + 72, u32::MAX), // entries LBA (low half)
        (h + 76, u32::MAX), // entries LBA (high half)
    ] {
        let mut d = good.clone();
        d[at..at + 4].copy_from_slice(&value.to_le_bytes());
        let crc_at = h + GPT_HEADER_CRC_AT;
        d[crc_at..crc_at + 4].fill(0);
        let size = (le32(&d, h + 12) as usize).clamp(GPT_HEADER_MIN, h);
        let crc = crc32(&d[h..h + size]);
        d[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
        let e = inspect(&d).unwrap_err().to_string();
        assert!(e.contains("corrupt"), "field at {at}: {e}");
    }
    // Entries whose extents overflow.
    let mut d = good.clone();
    let e0 = 2 * h;
    d[e0 + 32..e0 + 40].copy_from_slice(&u64::MAX.to_le_bytes());
    let entries_crc = crc32(&d[e0..e0 + 128 * 128]);
    d[h + 88..h + 92].copy_from_slice(&entries_crc.to_le_bytes());
    d[h + 16..h + 20].fill(0);
    let crc = crc32(&d[h..h + 92]);
    d[h + 16..h + 20].copy_from_slice(&crc.to_le_bytes());
    let e = inspect(&d).unwrap_err().to_string();
    assert!(e.contains("p1: bad extent"), "{e}");
}

fn image(with_rootfs: bool) -> (tempfile::TempDir, GuestImage) {
    let d = tempfile::tempdir().unwrap();
    for f in ["vmlinuz", "initramfs"] {
        std::fs::write(d.path().join(f), b"x").unwrap();
    }
    std::fs::write(d.path().join("image-info"), format!("{IMAGE_FORMAT}\n")).unwrap();
    if with_rootfs {
        std::fs::write(d.path().join(ROOTFS_FILE), b"ext4").unwrap();
    }
    let img = GuestImage::at(d.path()).unwrap();
    (d, img)
}

fn bundle_dir(valid: bool) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let disk = if valid {
        gpt_disk(&[ext_partition(BUNDLE_ROOTFS_LABEL, 0x2, 64)])
    } else {
        vec![0xEE; 8192]
    };
    std::fs::write(d.path().join(BUNDLE_ROOTFS_FILE), disk).unwrap();
    std::fs::write(d.path().join("vmlinuz"), b"not a kernel").unwrap();
    d
}

#[test]
fn auto_prefers_a_valid_bundle_and_keeps_ours_as_the_guest_fallback() {
    let (_i, img) = image(true);
    let b = bundle_dir(true);
    // bundlePath comes root-relative from the client.
    let rel = b.path().strip_prefix("/").unwrap();
    let p = plan(UserlandChoice::Auto, &img, Some(rel)).unwrap();
    assert_eq!(p.expected, UserlandKind::Bundle);
    assert!(!p.strict);
    let serials: Vec<_> = p.disks.iter().map(|d| d.serial).collect();
    assert_eq!(serials, [BUNDLE_ROOTFS_SERIAL, ROOTFS_SERIAL]);
    assert_eq!(p.disks[0].path, b.path().join(BUNDLE_ROOTFS_FILE));
    assert!(p.skipped.is_empty());
}

#[test]
fn auto_skips_a_corrupt_bundle_and_says_why() {
    let (_i, img) = image(true);
    let b = bundle_dir(false);
    let p = plan(UserlandChoice::Auto, &img, Some(b.path())).unwrap();
    assert_eq!(p.expected, UserlandKind::Default);
    assert_eq!(p.disks.len(), 1);
    assert!(
        p.skipped[0].starts_with("bundle: ") && p.skipped[0].contains("not a GPT disk"),
        "{:?}",
        p.skipped
    );
    // No bundle file at all is no candidate, not a skip.
    let empty = tempfile::tempdir().unwrap();
    let p = plan(UserlandChoice::Auto, &img, Some(empty.path())).unwrap();
    assert_eq!(p.expected, UserlandKind::Default);
    assert!(p.skipped.is_empty());
}

#[test]
fn auto_without_any_rootfs_is_the_initramfs() {
    let (_i, img) = image(false);
    let p = plan(UserlandChoice::Auto, &img, None).unwrap();
    assert_eq!(p.expected, UserlandKind::Initramfs);
    assert!(p.disks.is_empty());
    assert!(
        p.skipped[0].contains("has no rootfs.img"),
        "{:?}",
        p.skipped
    );
}

#[test]
fn forced_choices_attach_one_disk_or_fail() {
    let (_i, img) = image(true);
    let b = bundle_dir(true);
    let p = plan(UserlandChoice::Bundle, &img, Some(b.path())).unwrap();
    assert_eq!(
        (p.disks.len(), p.expected, p.strict),
        (1, UserlandKind::Bundle, true)
    );
    let p = plan(UserlandChoice::Default, &img, Some(b.path())).unwrap();
    assert_eq!(p.disks[0].serial, ROOTFS_SERIAL);
    let p = plan(UserlandChoice::Initramfs, &img, Some(b.path())).unwrap();
    assert!(p.disks.is_empty());

    let bad = bundle_dir(false);
    let e = plan(UserlandChoice::Bundle, &img, Some(bad.path())).unwrap_err();
    assert!(matches!(e, UserlandError::Bundle(_)), "{e:?}");
    assert!(e.to_string().starts_with("--userland bundle: "), "{e}");
    let e = plan(UserlandChoice::Bundle, &img, None).unwrap_err();
    assert!(matches!(e, UserlandError::NoBundlePath), "{e:?}");
    assert!(e.to_string().contains("no bundlePath"), "{e}");
    let (_j, bare) = image(false);
    let e = plan(UserlandChoice::Default, &bare, None).unwrap_err();
    assert!(e.to_string().contains("cowork-helper image build"), "{e}");
}

#[test]
fn the_agents_report_is_checked_against_the_plan() {
    let (_i, img) = image(true);
    let auto = plan(UserlandChoice::Auto, &img, None).unwrap();
    assert_eq!(
        check_hello(&auto, Some("default"), &[])
            .unwrap()
            .to_string(),
        "userland default"
    );
    let fell = check_hello(&auto, Some("initramfs"), &["cowork-rootfs: no bash".into()]).unwrap();
    assert!(!fell.as_expected());
    let fell = fell.to_string();
    assert!(
        fell.contains("initramfs instead of default") && fell.contains("no bash"),
        "{fell}"
    );
    let forced = plan(UserlandChoice::Default, &img, None).unwrap();
    let e = check_hello(&forced, None, &[]).unwrap_err();
    assert!(matches!(e, UserlandError::NotBooted(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "the guest did not boot the requested userland: userland initramfs instead of default"
    );
}
