//! The session userland: which root filesystem a VM's sessions run in, and
//! switching to it at boot while the agent stays PID 1.
//!
//! The agent boots from a busybox initramfs, which cannot run Claude Code
//! sessions (no GNU bash, no glibc). As the VM's init, after the kernel
//! modules are loaded, [`boot`] looks for a userland disk the host attached
//! read-only, in order of preference ([`CANDIDATES`]):
//!
//! 1. **bundle**: the client's `rootfs.img` (serial
//!    [`proto::BUNDLE_ROOTFS_SERIAL`]; a GPT disk whose root is the ext4
//!    partition labelled [`proto::BUNDLE_ROOTFS_LABEL`]);
//! 2. **default**: our Debian image (serial [`proto::ROOTFS_SERIAL`]; a
//!    whole-disk ext4 labelled [`proto::ROOTFS_LABEL`]).
//!
//! A candidate whose disk is not attached is skipped silently (the host
//! decides what to attach). One that is attached is found by label
//! ([`disk`]), mounted read-only without replaying a journal
//! ([`switch::mount_lower`]) at [`LOWER_DIR`] and checked ([`root`]: GNU
//! bash and the dynamic loader); on any failure the reason is logged and
//! kept for the hello ([`proto::UserlandInfo::fallbacks`]), and the next is
//! tried. The first good one becomes the lower layer of an overlay whose
//! upper is a bounded tmpfs ([`USERLAND_DIR`], [`switch::upper_size`]); the
//! session disk is mounted at `/sessions` inside it (while the initramfs's
//! `mkfs.ext4` can still format a blank disk), and the agent switches root
//! to it ([`switch::switch_root`]) and frees the initramfs. With no good
//! candidate the agent stays on the initramfs, as before userland disks
//! existed. Either way [`etc`] then sets up what an init system would
//! (`/dev/fd`, host name, `/etc/resolv.conf`, open-file limit).
//!
//! What survives `stopVM`: the session disk (`/sessions`). Everything else
//! written to `/` lands in the tmpfs upper and is gone at the next boot;
//! the image itself is never written (read-only device and mount).
//!
//! The layers stay mounted under [`USERLAND_DIR`] (root-only, mode 0700) for
//! the overlay's life; [`Booted::private_paths`] names it so session
//! processes get it detached from their mount namespace.
//!
//! Limits: the agent never execs the userland's init (systemd) or any of
//! its services (the bundle's `sdk-daemon` would dial the host like the
//! agent), so nothing of the image's boot sequence runs; kernel modules
//! come only from the initramfs (the images carry none for our kernel).
//! Only the choice falls back from one candidate to the next: when the
//! overlay or the switch itself fails for the chosen one (not expected
//! short of a missing `overlay` module), the agent stays on the initramfs
//! and says why. Renaming a directory that comes from the image works
//! (`redirect_dir=on`). Files on `/` report their layer's device number,
//! directories the overlay's (no `xino`: it would unify them but give
//! inode numbers above 2^53, which JavaScript's `fs.stat` cannot hold
//! exactly); sessions work under `/sessions`, which is plain ext4.

pub mod disk;
pub mod etc;
pub mod root;
pub mod switch;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::cli::DEFAULT_SESSIONS_ROOT;
use super::sessiondisk;
use crate::proto::{self, UserlandInfo};
use crate::sys;

/// Kernel modules [`boot`] needs loaded before it looks for disks: a virtio
/// transport (whichever the machine has; the other finds nothing) with the
/// block driver, so the userland and session disks exist, and overlayfs for
/// the root. ext4 is built into the guest kernel.
pub const MODULES: &[&str] = &["virtio_mmio", "virtio_pci", "virtio_blk", "overlay"];

/// tmpfs holding the overlay's writable layer ([`UPPER_DIR`], [`WORK_DIR`])
/// and the read-only image's mount ([`LOWER_DIR`]); hidden from sessions.
pub const USERLAND_DIR: &str = "/run/cowork/userland";

/// Where the read-only image is mounted (the overlay's lower layer).
pub const LOWER_DIR: &str = "/run/cowork/userland/lower";

/// The overlay's upper layer: everything written to `/`.
pub const UPPER_DIR: &str = "/run/cowork/userland/upper";

/// The overlay's work directory (same filesystem as the upper).
pub const WORK_DIR: &str = "/run/cowork/userland/work";

/// Mode of [`USERLAND_DIR`]'s root: only the agent looks inside.
pub const USERLAND_DIR_MODE: u32 = 0o700;

/// Where the new root is assembled on the initramfs before the switch (not
/// under `/run`, which is moved into it).
pub const NEWROOT: &str = "/.cowork-newroot";

/// Mounts moved from the initramfs into the new root, with everything below
/// them (`/dev/pts`, `/dev/shm`, `/sys/fs/cgroup`, the layers in `/run`).
pub const API_MOUNTS: [&str; 4] = ["dev", "proc", "sys", "run"];

/// One userland disk the agent may switch to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// What the hello reports ([`UserlandInfo::kind`]).
    pub kind: &'static str,
    /// virtio-blk serial of its disk.
    pub serial: &'static str,
    /// ext4 label of its root filesystem (on the disk or a partition).
    pub label: &'static str,
}

/// The userland disks, preferred first.
pub const CANDIDATES: [Candidate; 2] = [
    Candidate {
        kind: UserlandInfo::BUNDLE,
        serial: proto::BUNDLE_ROOTFS_SERIAL,
        label: proto::BUNDLE_ROOTFS_LABEL,
    },
    Candidate {
        kind: UserlandInfo::DEFAULT,
        serial: proto::ROOTFS_SERIAL,
        label: proto::ROOTFS_LABEL,
    },
];

/// Errors of entering a chosen userland (selection failures are
/// [`disk::DiskError`], [`switch::SwitchError`] and [`root::RootError`]).
#[derive(Debug, thiserror::Error)]
pub enum UserlandError {
    #[error(transparent)]
    Disk(#[from] disk::DiskError),
    #[error(transparent)]
    Switch(#[from] switch::SwitchError),
    #[error("{dev}: {source}")]
    Root {
        dev: PathBuf,
        source: root::RootError,
    },
}

/// What [`boot`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booted {
    /// What the hello reports.
    pub info: UserlandInfo,
    /// Paths session processes must not see (the layers).
    pub private_paths: Vec<PathBuf>,
    /// When the switch finished (`CLOCK_BOOTTIME` µs), if there was one.
    pub switched_us: Option<u64>,
}

/// What this boot got, once [`boot`] ran (for the hello).
static BOOTED: OnceLock<UserlandInfo> = OnceLock::new();

/// The userland this boot switched to; `None` when the agent is not a VM's
/// init (or [`boot`] has not run).
pub fn booted() -> Option<UserlandInfo> {
    BOOTED.get().cloned()
}

/// A validated candidate, its image mounted at [`LOWER_DIR`].
struct Chosen {
    candidate: Candidate,
    dev: PathBuf,
    pretty_name: Option<String>,
}

/// Picks the userland, switches to it (or stays on the initramfs), mounts
/// the session disk, sets the machine up ([`etc`]); logs each step. For the
/// VM's init, after the modules are loaded and before the session share is
/// mounted.
pub fn boot() -> Booted {
    let mut fallbacks = Vec::new();
    let upper_bytes = switch::total_ram()
        .map(switch::upper_size)
        .unwrap_or(switch::UPPER_MIN_BYTES);
    let mut booted = match choose(&Layout::machine(), &CANDIDATES, upper_bytes, &mut fallbacks) {
        Some(chosen) => match enter(&chosen, upper_bytes) {
            Ok(switched_us) => Booted {
                info: UserlandInfo {
                    kind: chosen.candidate.kind.to_string(),
                    pretty_name: chosen.pretty_name.clone(),
                    fallbacks: Vec::new(),
                },
                private_paths: vec![PathBuf::from(USERLAND_DIR)],
                switched_us: Some(switched_us),
            },
            Err(e) => {
                tracing::warn!(userland = chosen.candidate.kind, error = %e, "cannot switch to the userland; staying on the initramfs");
                fallbacks.push(format!("{}: {e}", chosen.candidate.kind));
                release_layers();
                stay_on_initramfs()
            }
        },
        None => {
            release_layers();
            stay_on_initramfs()
        }
    };
    booted.info.fallbacks = fallbacks;
    etc::prepare_machine();
    let _ = BOOTED.set(booted.info.clone());
    booted
}

/// Where [`choose`] looks and mounts (the machine's paths in production).
struct Layout<'a> {
    /// `/sys/block`.
    sys_block: &'a Path,
    /// `/dev`.
    dev_dir: &'a Path,
    /// [`USERLAND_DIR`].
    layers: &'a Path,
    /// [`LOWER_DIR`].
    lower: &'a Path,
}

impl Layout<'static> {
    /// The running machine's.
    fn machine() -> Self {
        Layout {
            sys_block: Path::new(sessiondisk::SYS_BLOCK),
            dev_dir: Path::new(sessiondisk::DEV_DIR),
            layers: Path::new(USERLAND_DIR),
            lower: Path::new(LOWER_DIR),
        }
    }
}

/// The first of `candidates` whose disk holds a valid root, mounted at
/// `at.lower` (with a tmpfs of `upper_bytes` on `at.layers` under it).
/// Rejections are logged and appended to `fallbacks`.
fn choose(
    at: &Layout<'_>,
    candidates: &[Candidate],
    upper_bytes: u64,
    fallbacks: &mut Vec<String>,
) -> Option<Chosen> {
    for &candidate in candidates {
        let Some(disk) = sessiondisk::find_disk_by_serial(at.sys_block, candidate.serial) else {
            tracing::debug!(serial = candidate.serial, "no such userland disk");
            continue;
        };
        let reject = |fallbacks: &mut Vec<String>, e: UserlandError| {
            tracing::warn!(userland = candidate.kind, serial = candidate.serial, error = %e, "userland rejected");
            fallbacks.push(format!("{}: {e}", candidate.kind));
        };
        if !sys::is_mount_point(at.layers).unwrap_or(false) {
            if let Err(e) = switch::mount_tmpfs(at.layers, upper_bytes, USERLAND_DIR_MODE) {
                reject(fallbacks, e.into());
                return None;
            }
        }
        let dev = match disk::find_labelled(at.sys_block, at.dev_dir, &disk, candidate.label) {
            Ok(dev) => dev,
            Err(e) => {
                reject(fallbacks, e.into());
                continue;
            }
        };
        if let Err(e) = switch::mount_lower(&dev, at.lower) {
            reject(fallbacks, e.into());
            continue;
        }
        if let Err(source) = root::validate(at.lower) {
            unmount(at.lower);
            reject(fallbacks, UserlandError::Root { dev, source });
            continue;
        }
        return Some(Chosen {
            candidate,
            pretty_name: root::pretty_name(at.lower),
            dev,
        });
    }
    None
}

/// Builds the overlay on [`NEWROOT`] and switches root (`upper_bytes`: the
/// writable layer's bound, for the log). The session disk is mounted later,
/// after the host's `Setup` ([`mount_sessions`]).
/// Returns when the switch finished. On error the agent is
/// still on the initramfs (the caller releases the layers).
fn enter(chosen: &Chosen, upper_bytes: u64) -> Result<u64, UserlandError> {
    let newroot = Path::new(NEWROOT);
    let redirect_dir = switch::mount_overlay(
        Path::new(LOWER_DIR),
        Path::new(UPPER_DIR),
        Path::new(WORK_DIR),
        newroot,
    )?;
    // The session disk is formatted (when blank) after the switch, when the
    // initramfs and its mke2fs are gone: carry the bundle on /run.
    match sessiondisk::carry_mkfs(
        Path::new(sessiondisk::MKFS_BUNDLE),
        Path::new(sessiondisk::MKFS_CARRIED),
    ) {
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(error = %e, "mke2fs not carried across the switch: a blank session disk cannot be formatted")
        }
    }
    let switched = match switch::switch_root(newroot, &API_MOUNTS) {
        Ok(s) => s,
        Err(e) => {
            unmount(newroot);
            return Err(e.into());
        }
    };
    let at = sys::boottime_us();
    if let Err(e) = &switched.tmp {
        tracing::warn!(error = %e, "no fresh /tmp; /tmp is on the writable layer");
    }
    tracing::info!(
        userland = chosen.candidate.kind,
        os = chosen.pretty_name.as_deref().unwrap_or("unknown"),
        dev = %chosen.dev.display(),
        writable_bytes = upper_bytes,
        redirect_dir,
        "switched root to the session userland"
    );
    match &switched.freed {
        Ok(f) => tracing::info!(
            files = f.files,
            dirs = f.dirs,
            bytes = f.bytes,
            kept = f.kept,
            "initramfs freed"
        ),
        Err(e) => tracing::warn!(error = %e, "initramfs not freed"),
    }
    Ok(at)
}

/// Unmounts the image and the layers' tmpfs if mounted (after a failure).
fn release_layers() {
    for dir in [LOWER_DIR, USERLAND_DIR] {
        unmount(Path::new(dir));
    }
}

/// Detaches the mount at `dir` if there is one; failures are logged.
fn unmount(dir: &Path) {
    if !sys::is_mount_point(dir).unwrap_or(false) {
        return;
    }
    if let Err(e) = sys::cstring(dir).and_then(|c| sys::umount2(&c, libc::MNT_DETACH)) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot unmount");
    }
}

/// Mounts the session disk at `/sessions` of the userland booted (after the
/// host's `Setup`: nothing per boot is mounted before it).
pub fn mount_sessions() {
    sessiondisk::mount_session_disk(Path::new(DEFAULT_SESSIONS_ROOT));
}

/// The initramfs userland.
fn stay_on_initramfs() -> Booted {
    tracing::info!("sessions run in the initramfs (busybox) userland");
    Booted {
        info: UserlandInfo {
            kind: UserlandInfo::INITRAMFS.to_string(),
            pretty_name: root::pretty_name(Path::new("/")),
            fallbacks: Vec::new(),
        },
        private_paths: Vec::new(),
        switched_us: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::testns;
    use std::os::unix::fs::PermissionsExt;
    use std::process::Command;

    #[test]
    fn the_bundle_is_preferred_and_every_path_is_where_the_docs_say() {
        assert_eq!(CANDIDATES[0].kind, "bundle");
        assert_eq!(CANDIDATES[0].serial, "cowork-bundle-root");
        assert_eq!(CANDIDATES[0].label, "cloudimg-rootfs");
        assert_eq!(CANDIDATES[1].kind, "default");
        assert_eq!(CANDIDATES[1].serial, "cowork-rootfs");
        assert_eq!(CANDIDATES[1].label, "cowork-rootfs");
        // The layers live in one private tmpfs below /run (moved with it).
        for p in [LOWER_DIR, UPPER_DIR, WORK_DIR] {
            assert_eq!(Path::new(p).parent(), Some(Path::new(USERLAND_DIR)));
        }
        assert!(Path::new(USERLAND_DIR).starts_with("/run"));
        assert!(API_MOUNTS.contains(&"run"));
        // The new root is assembled outside every moved mount.
        assert!(API_MOUNTS
            .iter()
            .all(|m| !Path::new(NEWROOT).starts_with(Path::new("/").join(m))));
        assert_eq!(booted(), None, "not a VM's init");
    }

    /// A loop device attached read-only, detached on drop.
    struct Loop(PathBuf);

    impl Loop {
        fn attach(image: &Path) -> Option<Loop> {
            let out = Command::new("losetup")
                .args(["--read-only", "--find", "--show"])
                .arg(image)
                .output()
                .ok()?;
            let dev = String::from_utf8(out.stdout).ok()?.trim().to_string();
            (out.status.success() && dev.starts_with("/dev/loop")).then(|| Loop(dev.into()))
        }
        fn name(&self) -> &str {
            self.0.file_name().and_then(|n| n.to_str()).unwrap()
        }
    }

    impl Drop for Loop {
        fn drop(&mut self) {
            let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
        }
    }

    /// Runs `cmd`, true when it succeeded.
    fn runs(cmd: &mut Command) -> bool {
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// An ext4 image (with a journal) of `tree`, labelled `label`.
    fn ext4_image(path: &Path, label: &str, tree: &Path) -> bool {
        runs(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-L", label, "-d"])
                .arg(tree)
                .arg(path)
                .arg("16M"),
        )
    }

    /// The real machine's disks: `choose` on loop devices (read-only, like
    /// the VM's disks) behind a fake `/sys/block` that gives them serials.
    /// The bundle lacks bash and is rejected with a reason; the default
    /// image's journal is marked as needing recovery and still mounts,
    /// read-only, and neither image changes.
    #[test]
    fn ns_root_choose_rejects_with_reasons_and_mounts_a_dirty_image_read_only() {
        if !testns::real_root_or_skip("loop devices and ext4 mounts") {
            return;
        }
        let Some(dir) = testns::in_namespaces(
            "agent::userland::tests::ns_root_choose_rejects_with_reasons_and_mounts_a_dirty_image_read_only",
            &["-m"],
        ) else {
            return;
        };
        // The trees: GNU bash and the loader from this machine.
        let (Ok(bash), Ok(loader)) = (
            std::fs::canonicalize("/bin/bash"),
            std::fs::canonicalize("/lib64/ld-linux-x86-64.so.2"),
        ) else {
            eprintln!("skipping: no GNU bash or x86-64 loader on this host");
            return;
        };
        let good = dir.join("good");
        let bad = dir.join("bad");
        for tree in [&good, &bad] {
            std::fs::create_dir_all(tree.join("usr/bin")).unwrap();
            std::fs::create_dir_all(tree.join("lib64")).unwrap();
            std::fs::create_dir_all(tree.join("etc")).unwrap();
            std::fs::copy(&loader, tree.join("lib64/ld-linux-x86-64.so.2")).unwrap();
            std::os::unix::fs::symlink("usr/bin", tree.join("bin")).unwrap();
        }
        std::fs::copy(&bash, good.join("usr/bin/bash")).unwrap();
        std::fs::write(good.join("etc/os-release"), "PRETTY_NAME=\"Test OS 1\"\n").unwrap();
        let bundle = dir.join("bundle.img");
        let default = dir.join("default.img");
        if !ext4_image(&bundle, proto::BUNDLE_ROOTFS_LABEL, &bad)
            || !ext4_image(&default, proto::ROOTFS_LABEL, &good)
        {
            eprintln!("skipping: mkfs.ext4 -d failed (e2fsprogs 1.43 or later needed)");
            return;
        }
        // A journal that needs recovery: mounting without noload would
        // replay it, which a read-only device refuses.
        let spec = format!("{}", default.display());
        if !runs(Command::new("debugfs").args(["-w", "-R", "feature needs_recovery", &spec])) {
            eprintln!("skipping: no debugfs to mark the journal dirty");
            return;
        }
        let before = [
            std::fs::read(&bundle).unwrap(),
            std::fs::read(&default).unwrap(),
        ];
        let (Some(lb), Some(ld)) = (Loop::attach(&bundle), Loop::attach(&default)) else {
            eprintln!("skipping: no loop devices");
            return;
        };
        let sys_block = dir.join("sys-block");
        for (lo, serial) in [
            (&lb, proto::BUNDLE_ROOTFS_SERIAL),
            (&ld, proto::ROOTFS_SERIAL),
        ] {
            std::fs::create_dir_all(sys_block.join(lo.name())).unwrap();
            std::fs::write(sys_block.join(lo.name()).join("serial"), serial).unwrap();
        }
        let layers = dir.join("layers");
        let lower = layers.join("lower");
        let at = Layout {
            sys_block: &sys_block,
            dev_dir: Path::new("/dev"),
            layers: &layers,
            lower: &lower,
        };
        let mut fallbacks = Vec::new();
        let chosen = choose(&at, &CANDIDATES, 32 << 20, &mut fallbacks).expect("default chosen");
        assert_eq!(chosen.candidate.kind, UserlandInfo::DEFAULT);
        assert_eq!(chosen.dev, ld.0);
        assert_eq!(chosen.pretty_name.as_deref(), Some("Test OS 1"));
        assert_eq!(fallbacks.len(), 1, "{fallbacks:?}");
        assert!(
            fallbacks[0].starts_with(&format!("bundle: {}: has no GNU bash", lb.0.display())),
            "{fallbacks:?}"
        );
        // Mounted read-only, the layers' tmpfs private and bounded.
        assert!(lower.join("usr/bin/bash").is_file());
        let err = std::fs::write(lower.join("x"), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
        let (total, _, _) = sys::statvfs(&layers).unwrap();
        assert_eq!(total, 32 << 20);
        let mode = std::fs::metadata(&layers).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, USERLAND_DIR_MODE);
        unmount(&lower);
        unmount(&layers);
        drop((lb, ld));
        let after = [
            std::fs::read(&bundle).unwrap(),
            std::fs::read(&default).unwrap(),
        ];
        assert!(before == after, "an image changed");
    }
}
