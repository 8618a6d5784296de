//! The guest image both VM backends boot: our kernel (`vmlinuz`, and an
//! uncompressed `vmlinux` where present), our initramfs (the static guest
//! agent as `/init`, busybox, the kernel modules) and, optionally, the
//! default userland `rootfs.img` (a read-only ext4 Debian tree, see
//! `scripts/mkrootfs.sh`). `scripts/mkguestimage.sh` builds them into one
//! directory whose `image-info` starts with [`IMAGE_FORMAT`]; the Debian
//! package ships the image without its userland, which
//! `cowork-helper image build` puts in a userland directory instead.
//!
//! This module is the one place that says where both are looked for
//! ([`ImageSearch`]); first match wins:
//!
//! 1. `startVM.bundlePath` when that directory holds one of *ours* (the
//!    client's own bundle does not: its kernel and initrd are never booted,
//!    see [`super::userland`]);
//! 2. `--guest-image-dir` (`$COWORK_GUEST_IMAGE_DIR`), which must then
//!    hold one (nothing else is tried);
//! 3. `guest-image/` next to the helper's executable and one level up (a
//!    checkout: `target/guest-image` for `target/*/cowork-helper`). The
//!    executable is `/proc/self/exe`, resolved by the kernel, so the
//!    client's symlink to the helper finds the helper's own directory;
//! 4. the installed system directories: `<prefix>/lib/cowork-helper/guest-image`
//!    when the executable lives in `<prefix>/bin` (`/usr/local` installs),
//!    then [`SYSTEM_IMAGE_DIR`] (the package's);
//! 5. the per-user data directory (`--data-dir`, by default
//!    `$XDG_DATA_HOME/cowork-helper`): `guest-image/` in it;
//! 6. the system state directory [`STATE_DIR`] (`/var/lib/cowork-helper/guest-image`).
//!
//! The default userland is the found image directory's own `rootfs.img`
//! (checkouts), else `userland/rootfs.img` in the per-user data directory,
//! else in [`STATE_DIR`] (where `image build` puts it as a user and as
//! root).
//!
//! Limits: only the files' presence and the format line are checked here;
//! a kernel or initramfs that does not boot is found out by booting it.

use std::fmt;
use std::path::{Path, PathBuf};

/// Environment variable of `--guest-image-dir`, naming the guest image
/// directory (read by [`crate::cli`]; messages name it).
pub const IMAGE_DIR_ENV: &str = "COWORK_GUEST_IMAGE_DIR";
/// Directory name of the guest image next to (or above) the executable,
/// and inside the data and state directories.
pub const IMAGE_DIR_NAME: &str = "guest-image";
/// First line of `image-info` in an image built by `scripts/mkguestimage.sh`.
pub const IMAGE_FORMAT: &str = "cowork-guest-image/1";
/// `image-info`'s line listing what the image's agent can do beyond the
/// format (`AGENT_FEATURES=a,b`; an image without it has none).
pub const AGENT_FEATURES_KEY: &str = "AGENT_FEATURES";
/// The agent signals its template point on the console when asked
/// (`guest_agent::proto::TEMPLATE_SIGNAL_ENV`): the qemu backend's boot
/// snapshot needs it.
pub const FEATURE_TEMPLATE_CONSOLE: &str = "template-console";
/// Files every guest image has.
pub const IMAGE_FILES: [&str; 3] = ["vmlinuz", "initramfs", "image-info"];
/// The default userland's read-only root filesystem inside an image or
/// userland directory (optional: without it the guest keeps the initramfs
/// userland).
pub const ROOTFS_FILE: &str = "rootfs.img";
/// Where the Debian package installs the guest image (kernel and
/// initramfs, no userland).
pub const SYSTEM_IMAGE_DIR: &str = "/usr/lib/cowork-helper/guest-image";
/// The image directory relative to an installation prefix (`/usr/local`
/// for a helper in `/usr/local/bin`).
const PREFIX_IMAGE_DIR: &str = "lib/cowork-helper/guest-image";
/// The system-wide state directory: `image build` run as root puts the
/// default userland here; an administrator may put a guest image here.
pub const STATE_DIR: &str = "/var/lib/cowork-helper";
/// Directory name of a built default userland inside the data or state
/// directory (`rootfs.img` and `rootfs-info`).
pub const USERLAND_DIR_NAME: &str = "userland";

/// Why a directory does not hold a guest image of ours.
#[derive(Debug, thiserror::Error)]
pub enum NotAnImage {
    /// One of [`IMAGE_FILES`] is not a file there.
    #[error("{} is missing", .0.display())]
    Missing(PathBuf),
    /// Its `image-info` cannot be read.
    #[error("cannot read {}/image-info ({source}): reinstall the package or rebuild the image with scripts/mkguestimage.sh", dir.display())]
    Unreadable {
        dir: PathBuf,
        source: std::io::Error,
    },
    /// Its `image-info` does not start with [`IMAGE_FORMAT`].
    #[error("{}/image-info is not a {IMAGE_FORMAT} image (a corrupt or foreign image: reinstall the package or rebuild it with scripts/mkguestimage.sh)", .0.display())]
    Foreign(PathBuf),
}

/// One place [`ImageSearch::locate`] tried, and why it holds no image.
#[derive(Debug)]
pub struct Tried {
    /// How the message names the place when the path alone would not say
    /// it (`bundlePath`, [`IMAGE_DIR_ENV`]).
    pub label: Option<&'static str>,
    pub why: NotAnImage,
}

impl fmt::Display for Tried {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.label {
            Some(label) => write!(f, "{label}: {}", self.why),
            None => write!(f, "{}", self.why),
        }
    }
}

/// No guest image was found; says where it was looked for and why each
/// place held none.
#[derive(Debug, thiserror::Error)]
#[error("no guest image: {}; install the cowork-helper package, build one in a checkout with scripts/setup.sh, or set {IMAGE_DIR_ENV}", join_tried(.tried))]
pub struct NoImage {
    /// Every place tried, in order.
    pub tried: Vec<Tried>,
}

/// The places' reasons, separated by `"; "`.
fn join_tried(tried: &[Tried]) -> String {
    tried
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// A guest image directory of ours.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestImage {
    pub dir: PathBuf,
    pub vmlinuz: PathBuf,
    pub initramfs: PathBuf,
    /// The default userland ([`ROOTFS_FILE`]): the image directory's own,
    /// else one from a userland directory (see [`ImageSearch`]).
    pub rootfs: Option<PathBuf>,
    /// Its agent has [`FEATURE_TEMPLATE_CONSOLE`].
    pub template_console: bool,
}

impl GuestImage {
    /// The image in `dir`, or why `dir` does not hold one of ours. Its
    /// `rootfs` is `dir`'s own only.
    pub fn at(dir: &Path) -> Result<GuestImage, NotAnImage> {
        for f in IMAGE_FILES {
            let p = dir.join(f);
            if !p.is_file() {
                return Err(NotAnImage::Missing(p));
            }
        }
        let info = std::fs::read_to_string(dir.join("image-info")).map_err(|source| {
            NotAnImage::Unreadable {
                dir: dir.to_path_buf(),
                source,
            }
        })?;
        if info.lines().next() != Some(IMAGE_FORMAT) {
            return Err(NotAnImage::Foreign(dir.to_path_buf()));
        }
        let rootfs = dir.join(ROOTFS_FILE);
        let template_console = info
            .lines()
            .filter_map(|l| l.strip_prefix(AGENT_FEATURES_KEY)?.strip_prefix('='))
            .flat_map(|v| v.split(','))
            .any(|f| f.trim() == FEATURE_TEMPLATE_CONSOLE);
        Ok(GuestImage {
            dir: dir.to_path_buf(),
            vmlinuz: dir.join("vmlinuz"),
            initramfs: dir.join("initramfs"),
            rootfs: rootfs.is_file().then_some(rootfs),
            template_console,
        })
    }
}

/// Where an image directory was found, for `doctor` and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// `startVM.bundlePath`.
    Bundle,
    /// `$COWORK_GUEST_IMAGE_DIR`.
    Env,
    /// Next to the executable or one level up (a checkout).
    BesideExe,
    /// An installed system directory ([`SYSTEM_IMAGE_DIR`] or the prefix's).
    System,
    /// The per-user data directory.
    UserData,
    /// [`STATE_DIR`].
    State,
}

impl Place {
    /// How `doctor` names the place.
    pub fn describe(self) -> &'static str {
        match self {
            Place::Bundle => "startVM's bundlePath",
            Place::Env => IMAGE_DIR_ENV,
            Place::BesideExe => "beside the helper's executable, a checkout",
            Place::System => "the installed system directory",
            Place::UserData => "your data directory",
            Place::State => "the system state directory",
        }
    }
}

/// The places the guest image and the default userland are looked for, in
/// order (see the module doc). A value built once at start by
/// [`crate::cli`] (from the command line and the environment) and handed
/// down; nothing here reads the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageSearch {
    /// `--guest-image-dir` ([`IMAGE_DIR_ENV`]): when set, the only place
    /// tried after the bundle.
    pub env_dir: Option<PathBuf>,
    /// The helper's executable, resolved (`/proc/self/exe`).
    pub exe: Option<PathBuf>,
    /// The per-user data directory (`--data-dir`).
    pub data_dir: Option<PathBuf>,
    /// The package's image directory ([`SYSTEM_IMAGE_DIR`]; tests move it).
    pub system_dir: PathBuf,
    /// The system state directory ([`STATE_DIR`]; tests move it).
    pub state_dir: PathBuf,
}

impl Default for ImageSearch {
    /// The system directories only: no executable, data directory or
    /// environment override.
    fn default() -> Self {
        Self::new(None, None, None)
    }
}

impl ImageSearch {
    /// The search for the executable `exe` with the data directory
    /// `data_dir`, `--guest-image-dir` ([`IMAGE_DIR_ENV`]) being `env_dir`
    /// (empty: unset), over the real system directories.
    pub fn new(env_dir: Option<PathBuf>, exe: Option<PathBuf>, data_dir: Option<PathBuf>) -> Self {
        ImageSearch {
            env_dir: env_dir.filter(|d| !d.as_os_str().is_empty()),
            exe,
            data_dir,
            system_dir: PathBuf::from(SYSTEM_IMAGE_DIR),
            state_dir: PathBuf::from(STATE_DIR),
        }
    }

    /// The image directories tried after the bundle, in order.
    pub fn image_dirs(&self) -> Vec<(Place, PathBuf)> {
        if let Some(dir) = &self.env_dir {
            return vec![(Place::Env, dir.clone())];
        }
        let mut dirs: Vec<(Place, PathBuf)> = Vec::new();
        if let Some(exe) = &self.exe {
            dirs.extend(
                image_dirs_beside(exe)
                    .into_iter()
                    .map(|d| (Place::BesideExe, d)),
            );
            if let Some(prefix) = prefix_of(exe) {
                dirs.push((Place::System, prefix.join(PREFIX_IMAGE_DIR)));
            }
        }
        dirs.push((Place::System, self.system_dir.clone()));
        if let Some(data) = &self.data_dir {
            dirs.push((Place::UserData, data.join(IMAGE_DIR_NAME)));
        }
        dirs.push((Place::State, self.state_dir.join(IMAGE_DIR_NAME)));
        // The prefix directory of /usr/bin is the system directory itself.
        let mut seen = std::collections::HashSet::new();
        dirs.retain(|(_, d)| seen.insert(d.clone()));
        dirs
    }

    /// The userland directories (`image build`'s outputs) tried when the
    /// image directory has no `rootfs.img` of its own, in order.
    pub fn userland_dirs(&self) -> Vec<(Place, PathBuf)> {
        let mut dirs = Vec::new();
        if let Some(data) = &self.data_dir {
            dirs.push((Place::UserData, data.join(USERLAND_DIR_NAME)));
        }
        dirs.push((Place::State, self.state_dir.join(USERLAND_DIR_NAME)));
        dirs
    }

    /// Where `dir` sits in this search, if it is one of its places.
    pub fn place_of(&self, dir: &Path) -> Option<Place> {
        self.image_dirs()
            .into_iter()
            .chain(self.userland_dirs())
            .find(|(_, d)| d == dir)
            .map(|(place, _)| place)
    }

    /// Finds the image: `bundle` when it holds ours, else the first of
    /// [`ImageSearch::image_dirs`] that does; its `rootfs` falls back to
    /// the first userland directory holding one.
    pub fn locate(&self, bundle: Option<&Path>) -> Result<GuestImage, NoImage> {
        let mut tried = Vec::new();
        if let Some(b) = bundle {
            // bundlePath may come root-relative like the client's other host paths.
            match GuestImage::at(&Path::new("/").join(b)) {
                Ok(img) => return Ok(self.with_userland(img)),
                Err(why) => tried.push(Tried {
                    label: Some("bundlePath"),
                    why,
                }),
            }
        }
        for (place, dir) in self.image_dirs() {
            match GuestImage::at(&dir) {
                Ok(img) => return Ok(self.with_userland(img)),
                Err(why) if place == Place::Env => {
                    return Err(NoImage {
                        tried: vec![Tried {
                            label: Some(IMAGE_DIR_ENV),
                            why,
                        }],
                    })
                }
                Err(why) => tried.push(Tried { label: None, why }),
            }
        }
        Err(NoImage { tried })
    }

    /// `img` with the first userland directory's `rootfs.img` when it has
    /// none of its own.
    fn with_userland(&self, mut img: GuestImage) -> GuestImage {
        if img.rootfs.is_none() {
            img.rootfs = self
                .userland_dirs()
                .into_iter()
                .map(|(_, d)| d.join(ROOTFS_FILE))
                .find(|p| p.is_file());
        }
        img
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

/// The installation prefix of an executable in `<prefix>/bin` or
/// `<prefix>/sbin` (`/usr/local` for `/usr/local/bin/cowork-helper`).
fn prefix_of(exe: &Path) -> Option<&Path> {
    let dir = exe.parent()?;
    matches!(dir.file_name()?.to_str()?, "bin" | "sbin")
        .then(|| dir.parent())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_image(dir: &Path, format_line: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("vmlinuz"), b"kernel").unwrap();
        std::fs::write(dir.join("initramfs"), b"initramfs").unwrap();
        std::fs::write(
            dir.join("image-info"),
            format!("{format_line}\nKERNEL_VERSION=6.1.0-x-cloud-amd64\n"),
        )
        .unwrap();
    }

    fn image_dir(format_line: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        write_image(d.path(), format_line);
        d
    }

    /// A search rooted in `root`: the executable `root/prefix/bin/helper`,
    /// data `root/data`, system `root/system`, state `root/state`.
    fn search_in(root: &Path) -> ImageSearch {
        ImageSearch {
            env_dir: None,
            exe: Some(root.join("prefix/bin/cowork-helper")),
            data_dir: Some(root.join("data")),
            system_dir: root.join("system"),
            state_dir: root.join("state"),
        }
    }

    #[test]
    fn recognises_our_images_only() {
        let ours = image_dir(IMAGE_FORMAT);
        let img = GuestImage::at(ours.path()).unwrap();
        assert_eq!(img.vmlinuz, ours.path().join("vmlinuz"));
        assert_eq!(img.initramfs, ours.path().join("initramfs"));
        assert_eq!(img.rootfs, None, "no rootfs.img: initramfs userland");
        assert!(!img.template_console, "no AGENT_FEATURES line");
        let featured = image_dir(&format!(
            "{IMAGE_FORMAT}\nKERNEL_VERSION=6\n{AGENT_FEATURES_KEY}=other,{FEATURE_TEMPLATE_CONSOLE}"
        ));
        assert!(GuestImage::at(featured.path()).unwrap().template_console);
        // A bundle of ours wins over every other place.
        let elsewhere = tempfile::tempdir().unwrap();
        write_image(&elsewhere.path().join("system"), IMAGE_FORMAT);
        assert_eq!(
            search_in(elsewhere.path())
                .locate(Some(ours.path()))
                .unwrap(),
            img
        );

        let other = image_dir("something-else/2");
        let e = GuestImage::at(other.path()).unwrap_err();
        assert!(matches!(e, NotAnImage::Foreign(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("is not a cowork-guest-image/1 image"), "{e}");
        assert!(e.contains("reinstall the package"), "{e}");
        std::fs::write(other.path().join("image-info"), [0xff, 0xfe, 0x00]).unwrap();
        let e = GuestImage::at(other.path()).unwrap_err().to_string();
        assert!(e.contains("cannot read") && e.contains("reinstall"), "{e}");
        std::fs::remove_file(other.path().join("initramfs")).unwrap();
        let e = GuestImage::at(other.path()).unwrap_err().to_string();
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

    #[test]
    fn the_search_order_is_the_documented_one() {
        let root = Path::new("/r");
        let s = search_in(root);
        let want = [
            (Place::BesideExe, "/r/prefix/bin/guest-image"),
            (Place::BesideExe, "/r/prefix/guest-image"),
            (Place::System, "/r/prefix/lib/cowork-helper/guest-image"),
            (Place::System, "/r/system"),
            (Place::UserData, "/r/data/guest-image"),
            (Place::State, "/r/state/guest-image"),
        ]
        .map(|(p, d)| (p, PathBuf::from(d)));
        assert_eq!(s.image_dirs(), want);
        assert_eq!(
            s.userland_dirs(),
            [
                (Place::UserData, PathBuf::from("/r/data/userland")),
                (Place::State, PathBuf::from("/r/state/userland"))
            ]
        );
        // The package's own layout: /usr/bin's prefix directory is the
        // system directory, tried once.
        let packaged = ImageSearch::new(None, Some("/usr/bin/cowork-helper".into()), None);
        let dirs: Vec<PathBuf> = packaged.image_dirs().into_iter().map(|(_, d)| d).collect();
        assert_eq!(
            dirs,
            [
                "/usr/bin/guest-image",
                "/usr/guest-image",
                SYSTEM_IMAGE_DIR,
                "/var/lib/cowork-helper/guest-image"
            ]
            .map(PathBuf::from)
        );
        // A copy at the client's path is not in a bin directory.
        let copy = ImageSearch::new(
            None,
            Some("/usr/lib/claude-desktop/resources/cowork-linux-helper".into()),
            None,
        );
        assert_eq!(
            copy.image_dirs()[2],
            (Place::System, SYSTEM_IMAGE_DIR.into())
        );
        // The environment variable is the only place when set.
        let env = ImageSearch::new(
            Some("/e".into()),
            Some("/usr/bin/cowork-helper".into()),
            None,
        );
        assert_eq!(env.image_dirs(), [(Place::Env, PathBuf::from("/e"))]);
        assert_eq!(ImageSearch::new(Some("".into()), None, None).env_dir, None);
    }

    #[test]
    fn first_match_wins_and_the_userland_falls_back() {
        let root = tempfile::tempdir().unwrap();
        let s = search_in(root.path());
        let e = s.locate(None).unwrap_err().to_string();
        assert!(e.contains("system/vmlinuz is missing"), "{e}");
        assert!(e.contains("install the cowork-helper package"), "{e}");

        write_image(&root.path().join("state/guest-image"), IMAGE_FORMAT);
        assert_eq!(
            s.locate(None).unwrap().dir,
            root.path().join("state/guest-image")
        );
        write_image(&root.path().join("data/guest-image"), IMAGE_FORMAT);
        assert_eq!(
            s.locate(None).unwrap().dir,
            root.path().join("data/guest-image")
        );
        write_image(&root.path().join("system"), IMAGE_FORMAT);
        let img = s.locate(None).unwrap();
        assert_eq!(img.dir, root.path().join("system"));
        assert_eq!(s.place_of(&img.dir), Some(Place::System));
        assert_eq!(img.rootfs, None);

        // The packaged image has no userland: `image build`'s is used,
        // the user's before the system's.
        let state_rootfs = root.path().join("state/userland").join(ROOTFS_FILE);
        std::fs::create_dir_all(state_rootfs.parent().unwrap()).unwrap();
        std::fs::write(&state_rootfs, b"ext4").unwrap();
        assert_eq!(s.locate(None).unwrap().rootfs, Some(state_rootfs));
        let user_rootfs = root.path().join("data/userland").join(ROOTFS_FILE);
        std::fs::create_dir_all(user_rootfs.parent().unwrap()).unwrap();
        std::fs::write(&user_rootfs, b"ext4").unwrap();
        assert_eq!(s.locate(None).unwrap().rootfs, Some(user_rootfs));
        // A checkout's image keeps its own.
        let own = root.path().join("system").join(ROOTFS_FILE);
        std::fs::write(&own, b"ext4").unwrap();
        assert_eq!(s.locate(None).unwrap().rootfs, Some(own));

        // A corrupt image-info is skipped for the next place, and named.
        std::fs::write(root.path().join("system/image-info"), "garbage\n").unwrap();
        assert_eq!(
            s.locate(None).unwrap().dir,
            root.path().join("data/guest-image")
        );

        // An environment directory without an image is an error, not a
        // reason to look elsewhere.
        let env = ImageSearch {
            env_dir: Some(root.path().join("nowhere")),
            ..s.clone()
        };
        let e = env.locate(None).unwrap_err().to_string();
        assert!(e.contains("COWORK_GUEST_IMAGE_DIR: "), "{e}");
    }
}
