//! The guest image both VM backends boot: our kernel (`vmlinuz`, and an
//! uncompressed `vmlinux` where present), our initramfs (the static guest
//! agent as `/init`, busybox, the kernel modules) and, optionally, the
//! default userland `rootfs.img` (a read-only ext4 Debian tree, see
//! `scripts/mkrootfs.sh`), all built by `scripts/mkguestimage.sh` into one
//! directory whose `image-info` starts with [`IMAGE_FORMAT`].
//!
//! Where an image is looked for, first match wins: `startVM.bundlePath`
//! when that directory holds one of *ours* (the client's own bundle does
//! not: its kernel and initrd are never booted, see
//! [`super::userland`]), `$COWORK_GUEST_IMAGE_DIR` (which must then hold
//! one), `guest-image/` next to the helper's executable and one level up
//! (`target/guest-image` for a `target/*/cowork-helper` build).
//!
//! Limits: only the files' presence and the format line are checked here;
//! a kernel or initramfs that does not boot is found out by booting it.

use std::path::{Path, PathBuf};

/// Environment variable naming the guest image directory.
pub const IMAGE_DIR_ENV: &str = "COWORK_GUEST_IMAGE_DIR";
/// Directory name of the guest image next to (or above) the executable.
pub const IMAGE_DIR_NAME: &str = "guest-image";
/// First line of `image-info` in an image built by `scripts/mkguestimage.sh`.
pub const IMAGE_FORMAT: &str = "cowork-guest-image/1";
/// Files every guest image has.
pub const IMAGE_FILES: [&str; 3] = ["vmlinuz", "initramfs", "image-info"];
/// The default userland's read-only root filesystem inside an image
/// directory (optional: without it the guest keeps the initramfs userland).
pub const ROOTFS_FILE: &str = "rootfs.img";

/// No guest image was found; says where it was looked for.
#[derive(Debug, thiserror::Error)]
#[error("no guest image: {0}; build one with scripts/setup.sh (or scripts/mkguestimage.sh) or set {IMAGE_DIR_ENV}")]
pub struct NoImage(pub String);

/// A guest image directory of ours.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestImage {
    pub dir: PathBuf,
    pub vmlinuz: PathBuf,
    pub initramfs: PathBuf,
    /// The default userland ([`ROOTFS_FILE`]) when the image has one.
    pub rootfs: Option<PathBuf>,
}

impl GuestImage {
    /// The image in `dir`, or why `dir` does not hold one of ours.
    pub fn at(dir: &Path) -> Result<GuestImage, String> {
        for f in IMAGE_FILES {
            let p = dir.join(f);
            if !p.is_file() {
                return Err(format!("{} is missing", p.display()));
            }
        }
        let info = std::fs::read_to_string(dir.join("image-info"))
            .map_err(|e| format!("cannot read {}/image-info: {e}", dir.display()))?;
        if info.lines().next() != Some(IMAGE_FORMAT) {
            return Err(format!(
                "{}/image-info is not a {IMAGE_FORMAT} image",
                dir.display()
            ));
        }
        let rootfs = dir.join(ROOTFS_FILE);
        Ok(GuestImage {
            dir: dir.to_path_buf(),
            vmlinuz: dir.join("vmlinuz"),
            initramfs: dir.join("initramfs"),
            rootfs: rootfs.is_file().then_some(rootfs),
        })
    }

    /// Finds the image: `bundle` when it holds ours, else
    /// `$COWORK_GUEST_IMAGE_DIR` (which must then hold one), else
    /// `guest-image/` next to or above this executable.
    pub fn locate(bundle: Option<&Path>) -> Result<GuestImage, NoImage> {
        let exe = std::env::current_exe().ok();
        Self::locate_for(exe.as_deref(), bundle)
    }

    /// [`GuestImage::locate`] as the helper executable `exe` would find it
    /// (tests run another binary than the helper they start).
    pub fn locate_for(exe: Option<&Path>, bundle: Option<&Path>) -> Result<GuestImage, NoImage> {
        let mut tried = Vec::new();
        if let Some(b) = bundle {
            // bundlePath may come root-relative like the client's other host paths.
            match GuestImage::at(&Path::new("/").join(b)) {
                Ok(img) => return Ok(img),
                Err(why) => tried.push(format!("bundlePath: {why}")),
            }
        }
        if let Some(dir) = std::env::var_os(IMAGE_DIR_ENV).filter(|d| !d.is_empty()) {
            return GuestImage::at(Path::new(&dir))
                .map_err(|why| NoImage(format!("{IMAGE_DIR_ENV}: {why}")));
        }
        for dir in exe.map(image_dirs_beside).unwrap_or_default() {
            match GuestImage::at(&dir) {
                Ok(img) => return Ok(img),
                Err(why) => tried.push(why),
            }
        }
        Err(NoImage(if tried.is_empty() {
            "no place to look".into()
        } else {
            tried.join("; ")
        }))
    }
}

/// `guest-image/` next to the executable `exe` and one level up.
pub fn image_dirs_beside(exe: &Path) -> Vec<PathBuf> {
    let Some(exe_dir) = exe.parent() else {
        return Vec::new();
    };
    let mut dirs = vec![exe_dir.join(IMAGE_DIR_NAME)];
    if let Some(up) = exe_dir.parent() {
        dirs.push(up.join(IMAGE_DIR_NAME));
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image_dir(format_line: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("vmlinuz"), b"kernel").unwrap();
        std::fs::write(d.path().join("initramfs"), b"initramfs").unwrap();
        std::fs::write(
            d.path().join("image-info"),
            format!("{format_line}\nKERNEL_VERSION=6.1.0-x-cloud-amd64\n"),
        )
        .unwrap();
        d
    }

    #[test]
    fn recognises_our_images_only() {
        let ours = image_dir(IMAGE_FORMAT);
        let img = GuestImage::at(ours.path()).unwrap();
        assert_eq!(img.vmlinuz, ours.path().join("vmlinuz"));
        assert_eq!(img.initramfs, ours.path().join("initramfs"));
        assert_eq!(img.rootfs, None, "no rootfs.img: initramfs userland");
        // A bundle of ours wins over every other place.
        assert_eq!(GuestImage::locate(Some(ours.path())).unwrap(), img);

        let other = image_dir("something-else/2");
        let e = GuestImage::at(other.path()).unwrap_err();
        assert!(e.contains("is not a cowork-guest-image/1 image"), "{e}");
        std::fs::remove_file(other.path().join("initramfs")).unwrap();
        let e = GuestImage::at(other.path()).unwrap_err();
        assert!(e.contains("initramfs is missing"), "{e}");
    }

    #[test]
    fn an_image_with_a_rootfs_offers_it() {
        let ours = image_dir(IMAGE_FORMAT);
        std::fs::write(ours.path().join(ROOTFS_FILE), b"ext4").unwrap();
        let img = GuestImage::at(ours.path()).unwrap();
        assert_eq!(img.rootfs, Some(ours.path().join(ROOTFS_FILE)));
    }

    #[test]
    fn image_dirs_are_beside_and_above_the_executable() {
        let dirs = image_dirs_beside(Path::new("/opt/x/target/release/cowork-helper"));
        assert_eq!(
            dirs,
            [
                PathBuf::from("/opt/x/target/release/guest-image"),
                PathBuf::from("/opt/x/target/guest-image")
            ]
        );
    }
}
