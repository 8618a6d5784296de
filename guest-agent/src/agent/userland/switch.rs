//! Building the session userland's root and switching to it in place: the
//! agent stays PID 1 and nothing is exec'd.
//!
//! * [`mount_lower`]: the read-only image, ext4 `ro,noload` (a dirty
//!   journal is never replayed, and a journal-less image does not care);
//! * [`mount_tmpfs`]: the writable layer, bounded by [`upper_size`];
//! * [`mount_overlay`]: `overlay` of the two on the new root, with
//!   `redirect_dir=on` when the kernel allows it (renaming a directory that
//!   comes from the image then works instead of failing with `EXDEV`);
//! * [`switch_root`]: moves the API filesystems (`/dev`, `/proc`, `/sys`,
//!   `/run`, with everything mounted below them) into the new root, drops
//!   the initramfs's `/tmp`, moves the new root onto `/` and `chroot`s into
//!   it (what `switch_root(8)` does, without the exec: `pivot_root(2)`
//!   cannot move the initramfs), mounts a fresh `/tmp` and frees the
//!   initramfs ([`free_old_root`]).
//!
//! Freeing deletes the old root's files through a directory descriptor
//! opened before the switch. After the switch no mount is left on the old
//! root's tree (everything was moved or unmounted, and the new root sits on
//! top of its root, which a walk from that descriptor never crosses);
//! still, the walk never follows a link, refuses to cross into another
//! mount (`RESOLVE_NO_XDEV`, and the device of every directory is compared
//! with the old root's), and only ever runs on a ramfs or tmpfs root.
//!
//! Limits: a failure before the new root is moved onto `/` is undone (moved
//! mounts go back, `/tmp` is mounted again); a failure of `chroot` after
//! that cannot be undone and leaves the agent without a usable root (it
//! cannot happen to PID 1 short of a kernel bug). Overlay paths must not
//! contain `,`, `:` or `\`.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use crate::sys;

/// Share of the machine's RAM the writable layer may fill (tmpfs pages are
/// only used when written; the bound stops a runaway writer from taking the
/// agent down with the machine).
pub const UPPER_RAM_PERCENT: u64 = 25;

/// Smallest writable layer, whatever the RAM (room for `/etc` edits, logs,
/// the per-session users).
pub const UPPER_MIN_BYTES: u64 = 64 << 20;

/// Largest writable layer: root-level writes are small by design (sessions
/// write to `/sessions`), so a big VM gets no more than this.
pub const UPPER_MAX_BYTES: u64 = 4 << 30;

/// `statfs` magic of ramfs (the kernel's initramfs root without tmpfs).
pub const RAMFS_MAGIC: u64 = 0x8584_58f6;

/// `statfs` magic of tmpfs (the initramfs root when `CONFIG_TMPFS` is set).
pub const TMPFS_MAGIC: u64 = libc::TMPFS_MAGIC as u64;

/// Deepest directory nesting the freeing walk descends (an initramfs is
/// a handful of levels deep).
pub const MAX_FREE_DEPTH: usize = 64;

/// Mode of the directories made in the new root for the moved mounts.
const MOUNT_POINT_MODE: u32 = 0o755;

/// Options of the fresh `/tmp`.
const TMP_OPTIONS: &CStr = c"mode=1777";

/// Overlay option turning on directory renames across layers.
const REDIRECT_DIR: &str = "redirect_dir=on";

/// Errors of building and switching to the new root.
#[derive(Debug, thiserror::Error)]
pub enum SwitchError {
    #[error("cannot mount {what} on {target}: {source}")]
    Mount {
        what: String,
        target: PathBuf,
        source: io::Error,
    },
    #[error("overlay path {0} contains ',', ':' or '\\'")]
    OverlayPath(PathBuf),
    #[error("cannot prepare {path} in the new root: {source}")]
    Prepare { path: PathBuf, source: io::Error },
    #[error("cannot move /{name} into the new root: {source}")]
    Move { name: String, source: io::Error },
    #[error("cannot move the new root {newroot} onto /: {source}")]
    MoveRoot { newroot: PathBuf, source: io::Error },
    #[error("chroot into the new root failed after it was moved onto /: {0}")]
    Chroot(io::Error),
    #[error("not freeing the old root: it is not a ramfs or tmpfs (magic {0:#x})")]
    NotInitramfs(u64),
    #[error("cannot inspect the old root: {0}")]
    OldRoot(io::Error),
}

/// Bytes the writable layer may hold on a machine with `total_ram` bytes.
pub fn upper_size(total_ram: u64) -> u64 {
    let share = u128::from(total_ram) * u128::from(UPPER_RAM_PERCENT) / 100;
    u64::try_from(share)
        .unwrap_or(u64::MAX)
        .clamp(UPPER_MIN_BYTES, UPPER_MAX_BYTES)
}

/// The machine's RAM in bytes (`sysinfo(2)`).
pub fn total_ram() -> io::Result<u64> {
    // SAFETY: sysinfo is plain data; the call fills it.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer.
    sys::cvt(unsafe { libc::sysinfo(&mut info) })?;
    // totalram is a c_ulong (u64 on the 64-bit targets the agent runs on).
    Ok(info.totalram.saturating_mul(u64::from(info.mem_unit)))
}

fn mount_err(what: impl Into<String>, target: &Path) -> impl FnOnce(io::Error) -> SwitchError {
    let what = what.into();
    let target = target.to_path_buf();
    move |source| SwitchError::Mount {
        what,
        target,
        source,
    }
}

/// Mounts a tmpfs of at most `size` bytes on `target` (created if missing),
/// root directory mode `mode`.
pub fn mount_tmpfs(target: &Path, size: u64, mode: u32) -> Result<(), SwitchError> {
    let fail = mount_err("tmpfs", target);
    std::fs::create_dir_all(target)
        .and_then(|()| {
            let data = CString::new(format!("size={size},mode={mode:o}"))
                .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
            sys::mount(
                Some(c"tmpfs"),
                &sys::cstring(target)?,
                Some(c"tmpfs"),
                0,
                Some(&data),
            )
        })
        .map_err(fail)
}

/// Mounts the ext4 filesystem on `dev` read-only on `target` (created if
/// missing), without loading its journal.
pub fn mount_lower(dev: &Path, target: &Path) -> Result<(), SwitchError> {
    let fail = mount_err(format!("{} (ext4, ro,noload)", dev.display()), target);
    std::fs::create_dir_all(target)
        .and_then(|()| {
            sys::mount(
                Some(&sys::cstring(dev)?),
                &sys::cstring(target)?,
                Some(c"ext4"),
                libc::MS_RDONLY,
                Some(c"noload"),
            )
        })
        .map_err(fail)
}

/// Checks a path can be named in overlay options.
fn overlay_path(p: &Path) -> Result<&str, SwitchError> {
    p.to_str()
        .filter(|s| !s.contains([',', ':', '\\']))
        .ok_or_else(|| SwitchError::OverlayPath(p.to_path_buf()))
}

/// Mounts `overlay` of `lower` (read-only) under `upper` (with `work`, both
/// on one filesystem, created if missing) on `target`. Returns whether
/// `redirect_dir=on` was accepted (a user namespace refuses it; the mount is
/// then made without).
pub fn mount_overlay(
    lower: &Path,
    upper: &Path,
    work: &Path,
    target: &Path,
) -> Result<bool, SwitchError> {
    let base = format!(
        "lowerdir={},upperdir={},workdir={}",
        overlay_path(lower)?,
        overlay_path(upper)?,
        overlay_path(work)?
    );
    for dir in [upper, work, target] {
        std::fs::create_dir_all(dir).map_err(|source| SwitchError::Prepare {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let c_target = sys::cstring(target).map_err(mount_err("overlay", target))?;
    let mount = |data: &str| {
        let data = sys::cstring(data)?;
        sys::mount(
            Some(c"overlay"),
            &c_target,
            Some(c"overlay"),
            0,
            Some(&data),
        )
    };
    match mount(&format!("{base},{REDIRECT_DIR}")) {
        Ok(()) => Ok(true),
        Err(first) => {
            tracing::debug!(error = %first, "overlay refused {REDIRECT_DIR}; mounting without it");
            mount(&base)
                .map(|()| false)
                .map_err(mount_err("overlay", target))
        }
    }
}

/// `MS_MOVE` of the mount at `from` onto `to`.
fn move_mount(from: &Path, to: &Path) -> io::Result<()> {
    sys::mount(
        Some(&sys::cstring(from)?),
        &sys::cstring(to)?,
        None,
        libc::MS_MOVE,
        None,
    )
}

fn chdir(path: &Path) -> io::Result<()> {
    let c = sys::cstring(path)?;
    // SAFETY: a NUL-terminated path.
    sys::cvt(unsafe { libc::chdir(c.as_ptr()) }).map(drop)
}

/// Mounts a fresh tmpfs (mode 1777, `nosuid,nodev`) on `/tmp`.
fn mount_fresh_tmp() -> Result<(), SwitchError> {
    let target = Path::new("/tmp");
    std::fs::create_dir_all(target)
        .and_then(|()| {
            sys::mount(
                Some(c"tmpfs"),
                c"/tmp",
                Some(c"tmpfs"),
                libc::MS_NOSUID | libc::MS_NODEV,
                Some(TMP_OPTIONS),
            )
        })
        .map_err(mount_err("tmpfs", target))
}

/// What freeing the old root removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Freed {
    /// Files, links and device nodes removed.
    pub files: u64,
    /// Directories removed.
    pub dirs: u64,
    /// Bytes of the regular files removed.
    pub bytes: u64,
    /// Entries left (another mount, too deep, or removal refused).
    pub kept: u64,
}

/// The outcome of a switch.
#[derive(Debug)]
pub struct Switched {
    /// What freeing the initramfs did.
    pub freed: Result<Freed, SwitchError>,
    /// Whether the fresh `/tmp` is mounted.
    pub tmp: Result<(), SwitchError>,
}

/// Switches the root to the mount at `newroot` (an absolute path in the
/// current root): moves the mounts `/<name>` for each of `moves` (those
/// that are mount points) into it, unmounts `/tmp`, moves `newroot` onto
/// `/`, `chroot`s there, mounts a fresh `/tmp`, and frees the old root.
/// An error means nothing changed: the current root is as before.
pub fn switch_root(newroot: &Path, moves: &[&str]) -> Result<Switched, SwitchError> {
    let old_root = sys::open(Path::new("/"), libc::O_RDONLY | libc::O_DIRECTORY)
        .map_err(SwitchError::OldRoot)?;
    let slash = Path::new("/");
    for name in moves.iter().chain(&["tmp"]) {
        let path = newroot.join(name);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(MOUNT_POINT_MODE)
            .create(&path)
            .map_err(|source| SwitchError::Prepare { path, source })?;
    }
    let mut moved: Vec<&str> = Vec::new();
    for name in moves {
        let from = slash.join(name);
        if !sys::is_mount_point(&from).unwrap_or(false) {
            tracing::debug!(dir = %from.display(), "not a mount point; not moved");
            continue;
        }
        if let Err(source) = move_mount(&from, &newroot.join(name)) {
            undo_moves(newroot, &moved);
            return Err(SwitchError::Move {
                name: name.to_string(),
                source,
            });
        }
        moved.push(name);
    }
    let tmp = slash.join("tmp");
    let had_tmp = sys::is_mount_point(&tmp).unwrap_or(false);
    if had_tmp {
        if let Err(e) = sys::umount2(c"/tmp", libc::MNT_DETACH) {
            tracing::debug!(error = %e, "initramfs /tmp stays mounted in the old root");
        }
    }
    let commit = chdir(newroot).and_then(|()| move_mount(Path::new("."), slash));
    if let Err(source) = commit {
        let _ = chdir(slash);
        undo_moves(newroot, &moved);
        if had_tmp && !sys::is_mount_point(&tmp).unwrap_or(false) {
            let _ = mount_fresh_tmp();
        }
        return Err(SwitchError::MoveRoot {
            newroot: newroot.to_path_buf(),
            source,
        });
    }
    // SAFETY: a static NUL-terminated path.
    sys::cvt(unsafe { libc::chroot(c".".as_ptr()) }).map_err(SwitchError::Chroot)?;
    chdir(slash).map_err(SwitchError::Chroot)?;
    let tmp = mount_fresh_tmp();
    let freed = free_old_root(old_root.as_fd());
    Ok(Switched { freed, tmp })
}

/// Moves the mounts of `moved` back from `newroot` to `/` (newest first).
fn undo_moves(newroot: &Path, moved: &[&str]) {
    for name in moved.iter().rev() {
        if let Err(e) = move_mount(&newroot.join(name), &Path::new("/").join(name)) {
            tracing::error!(error = %e, dir = name, "cannot move a mount back after a failed switch");
        }
    }
}

/// Deletes everything on the filesystem of `root` (a directory descriptor
/// of the old root) that is reachable without crossing a mount or following
/// a link, after checking it is a ramfs or tmpfs.
pub fn free_old_root(root: BorrowedFd<'_>) -> Result<Freed, SwitchError> {
    // SAFETY: statfs is plain data; fstatfs fills it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and out-pointer.
    sys::cvt(unsafe { libc::fstatfs(root.as_raw_fd(), &mut st) }).map_err(SwitchError::OldRoot)?;
    let magic = st.f_type as u64;
    if magic != RAMFS_MAGIC && magic != TMPFS_MAGIC {
        return Err(SwitchError::NotInitramfs(magic));
    }
    let dev = sys::fstat(root).map_err(SwitchError::OldRoot)?.dev;
    let mut freed = Freed::default();
    free_tree(root, dev, 0, &mut freed).map_err(SwitchError::OldRoot)?;
    Ok(freed)
}

/// The names in the directory `dir` (without `.` and `..`), read through a
/// new open file description so `dir`'s own offset is untouched.
fn list_dir(dir: BorrowedFd<'_>) -> io::Result<Vec<CString>> {
    let own = sys::openat(dir, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    let raw = own.as_raw_fd();
    // SAFETY: fdopendir takes ownership of a valid directory descriptor.
    let stream = unsafe { libc::fdopendir(raw) };
    if stream.is_null() {
        return Err(io::Error::last_os_error());
    }
    std::mem::forget(own); // now owned by the stream
    let mut names = Vec::new();
    loop {
        // SAFETY: a valid stream; readdir returns NULL at the end.
        let entry = unsafe { libc::readdir(stream) };
        if entry.is_null() {
            break;
        }
        // SAFETY: d_name is NUL-terminated inside the entry readdir returned.
        let name = unsafe { CStr::from_ptr((*entry).d_name.as_ptr()) };
        if name != c"." && name != c".." {
            names.push(name.to_owned());
        }
    }
    // SAFETY: closes the stream and its descriptor.
    unsafe { libc::closedir(stream) };
    Ok(names)
}

/// Removes the contents of `dir` (on device `dev`), depth first.
fn free_tree(dir: BorrowedFd<'_>, dev: u64, depth: usize, freed: &mut Freed) -> io::Result<()> {
    for name in list_dir(dir)? {
        let Ok(st) = sys::statx(Some(dir), &name, libc::AT_SYMLINK_NOFOLLOW) else {
            freed.kept += 1;
            continue;
        };
        if !st.is_dir() {
            match sys::unlinkat(dir, &name, 0) {
                Ok(()) => {
                    freed.files += 1;
                    if st.is_file() {
                        freed.bytes += st.size;
                    }
                }
                Err(_) => freed.kept += 1,
            }
            continue;
        }
        if st.dev != dev || st.mount_root == Some(true) || depth >= MAX_FREE_DEPTH {
            freed.kept += 1;
            continue;
        }
        let child = sys::openat2(
            dir,
            &name,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            libc::RESOLVE_NO_XDEV | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_BENEATH,
        );
        let child = match child {
            Ok(fd) if sys::fstat(fd.as_fd()).is_ok_and(|s| s.dev == dev) => fd,
            _ => {
                freed.kept += 1;
                continue;
            }
        };
        free_tree(child.as_fd(), dev, depth + 1, freed)?;
        drop(child);
        match sys::unlinkat(dir, &name, libc::AT_REMOVEDIR) {
            Ok(()) => freed.dirs += 1,
            Err(_) => freed.kept += 1,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::OwnedFd;
    use std::os::unix::fs::{symlink, PermissionsExt};

    use crate::agent::testns::{self, in_namespaces};

    /// `statfs` magic of overlayfs.
    const OVERLAYFS_MAGIC: u64 = 0x794c_7630;

    fn put(path: &Path, bytes: &[u8]) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    fn tmpfs(target: &Path) {
        mount_tmpfs(target, 16 << 20, 0o755).unwrap();
    }

    /// Makes `root` this process's root and working directory (the fake
    /// initramfs the agent would boot on).
    fn chroot_into(root: &Path) {
        let c = sys::cstring(root).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::chroot(c.as_ptr()) }, 0);
        chdir(Path::new("/")).unwrap();
    }

    fn names(dir: BorrowedFd<'_>) -> Vec<String> {
        let mut v: Vec<String> = list_dir(dir)
            .unwrap()
            .into_iter()
            .map(|c| c.into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn the_writable_layer_is_a_quarter_of_ram_within_bounds() {
        assert_eq!(upper_size(8 << 30), 2 << 30);
        assert_eq!(upper_size(2 << 30), 512 << 20);
        assert_eq!(upper_size(128 << 20), UPPER_MIN_BYTES);
        assert_eq!(upper_size(0), UPPER_MIN_BYTES);
        assert_eq!(upper_size(64 << 30), UPPER_MAX_BYTES);
        assert_eq!(upper_size(u64::MAX), UPPER_MAX_BYTES);
        assert!(total_ram().unwrap() > UPPER_MIN_BYTES);
    }

    #[test]
    fn overlay_paths_with_separators_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let bad = t.path().join("a,b");
        let e = mount_overlay(
            &bad,
            &t.path().join("u"),
            &t.path().join("w"),
            &t.path().join("m"),
        )
        .unwrap_err();
        assert!(matches!(e, SwitchError::OverlayPath(_)), "{e}");
        assert!(
            !t.path().join("m").exists(),
            "nothing made before the check"
        );
    }

    #[test]
    fn freeing_never_follows_links_out_of_the_tree() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        let outside = t.path().join("outside");
        put(&outside.join("file"), b"outside");
        put(&root.join("init"), b"agent");
        put(
            &root.join("lib/modules/6.1/kernel/fs/overlay.ko"),
            b"module!",
        );
        put(&root.join("etc/hosts"), b"");
        symlink(&outside, root.join("lib/outdir")).unwrap();
        symlink(outside.join("file"), root.join("outfile")).unwrap();
        symlink("/", root.join("slash")).unwrap();
        let fd = sys::open(&root, libc::O_RDONLY | libc::O_DIRECTORY).unwrap();
        let dev = sys::fstat(fd.as_fd()).unwrap().dev;
        let mut freed = Freed::default();
        free_tree(fd.as_fd(), dev, 0, &mut freed).unwrap();
        assert!(names(fd.as_fd()).is_empty(), "{:?}", names(fd.as_fd()));
        assert_eq!(
            freed,
            Freed {
                files: 6,
                dirs: 6,
                bytes: 5 + 7,
                kept: 0
            }
        );
        assert_eq!(std::fs::read(outside.join("file")).unwrap(), b"outside");
    }

    /// The agent's boot sequence on a fake initramfs: a tmpfs made the
    /// process root with `chroot`, API "filesystems" (tmpfs stand-ins, with a
    /// submount) and the layers under its `/run`.
    #[test]
    fn ns_switch_root_moves_api_mounts_and_frees_the_initramfs() {
        let Some(dir) = in_namespaces(
            "agent::userland::switch::tests::ns_switch_root_moves_api_mounts_and_frees_the_initramfs",
            &["-Urm"],
        ) else {
            return;
        };
        let fake = dir.join("root");
        tmpfs(&fake);
        put(&fake.join("init"), b"the agent");
        put(&fake.join("bin/busybox"), b"busybox");
        symlink("busybox", fake.join("bin/sh")).unwrap();
        put(&fake.join("lib/modules/6.1/kernel/overlay.ko"), b"ko");
        symlink("/run/marker", fake.join("linkout")).unwrap();
        for d in ["dev", "proc", "sys", "run", "tmp"] {
            tmpfs(&fake.join(d));
            put(&fake.join(d).join("marker"), d.as_bytes());
        }
        tmpfs(&fake.join("dev/pts"));
        put(&fake.join("dev/pts/marker"), b"pts");
        // A mount the switch does not move stays, with its files.
        tmpfs(&fake.join("mnt/keep"));
        put(&fake.join("mnt/keep/kept"), b"kept");
        tmpfs(&fake.join("run/cowork/userland"));
        put(
            &fake.join("run/cowork/userland/lower/lower-marker"),
            b"from the image",
        );
        std::fs::create_dir_all(fake.join("run/cowork/userland/lower/etc")).unwrap();

        chroot_into(&fake);
        // SAFETY: a NUL-terminated path.
        let old = owned(unsafe { libc::open(c"/".as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) });

        let layers = Path::new("/run/cowork/userland");
        let redirect = mount_overlay(
            &layers.join("lower"),
            &layers.join("upper"),
            &layers.join("work"),
            Path::new("/.cowork-newroot"),
        )
        .unwrap();
        eprintln!("redirect_dir accepted: {redirect}");
        let sw = switch_root(
            Path::new("/.cowork-newroot"),
            &["dev", "proc", "sys", "run"],
        )
        .unwrap();
        sw.tmp.unwrap();
        let freed = sw.freed.unwrap();

        // The new root is the overlay, with the moved mounts in place.
        assert_eq!(sys::fs_magic(Path::new("/")).unwrap(), OVERLAYFS_MAGIC);
        assert_eq!(std::fs::read("/lower-marker").unwrap(), b"from the image");
        for d in ["dev", "proc", "sys", "run"] {
            assert_eq!(std::fs::read(format!("/{d}/marker")).unwrap(), d.as_bytes());
        }
        assert_eq!(std::fs::read("/dev/pts/marker").unwrap(), b"pts");
        assert!(Path::new("/run/cowork/userland/lower/lower-marker").exists());
        // A fresh /tmp.
        assert_eq!(sys::fs_magic(Path::new("/tmp")).unwrap(), TMPFS_MAGIC);
        let mode = std::fs::metadata("/tmp").unwrap().permissions().mode();
        assert_eq!(mode & 0o7777, 0o1777);
        assert!(std::fs::read_dir("/tmp").unwrap().next().is_none());
        // Writes land in the upper layer.
        std::fs::write("/etc/written", b"w").unwrap();
        assert!(Path::new("/run/cowork/userland/upper/etc/written").exists());

        // The initramfs is gone but for the mount that was not moved.
        assert_eq!(names(old.as_fd()), ["mnt"]);
        let kept = sys::openat(old.as_fd(), c"mnt/keep/kept", libc::O_RDONLY, 0).unwrap();
        let mut text = String::new();
        use std::io::Read;
        std::fs::File::from(kept).read_to_string(&mut text).unwrap();
        assert_eq!(text, "kept");
        // init, busybox, sh, overlay.ko, linkout: the moved mounts' files
        // went with them, /tmp's with its unmount.
        assert_eq!(freed.files, 5, "{freed:?}");
        assert_eq!(freed.bytes, 9 + 7 + 2, "{freed:?}");
        assert!(freed.kept >= 1, "{freed:?}");

        // A root that is not an initramfs is never freed.
        let now = sys::open(Path::new("/"), libc::O_RDONLY | libc::O_DIRECTORY).unwrap();
        assert!(matches!(
            free_old_root(now.as_fd()),
            Err(SwitchError::NotInitramfs(OVERLAYFS_MAGIC))
        ));
        assert!(Path::new("/lower-marker").exists());
    }

    /// A failed switch leaves the root as it was, the moved mounts back.
    #[test]
    fn ns_a_failed_switch_moves_everything_back() {
        let Some(dir) = in_namespaces(
            "agent::userland::switch::tests::ns_a_failed_switch_moves_everything_back",
            &["-Urm"],
        ) else {
            return;
        };
        let fake = dir.join("root");
        tmpfs(&fake);
        for d in ["proc", "run", "tmp"] {
            tmpfs(&fake.join(d));
            put(&fake.join(d).join("marker"), d.as_bytes());
        }
        chroot_into(&fake);
        // The "new root" is a plain directory, not a mount: the final move fails.
        std::fs::create_dir("/.cowork-newroot").unwrap();
        let e = switch_root(Path::new("/.cowork-newroot"), &["proc", "run"]).unwrap_err();
        assert!(matches!(e, SwitchError::MoveRoot { .. }), "{e}");
        assert_eq!(std::fs::read("/proc/marker").unwrap(), b"proc");
        assert_eq!(std::fs::read("/run/marker").unwrap(), b"run");
        assert!(!Path::new("/.cowork-newroot/proc/marker").exists());
        // /tmp is mounted again (fresh).
        assert!(sys::is_mount_point(Path::new("/tmp")).unwrap());
        assert_eq!(std::env::current_dir().unwrap(), Path::new("/"));
    }

    /// `redirect_dir=on` (only outside a user namespace): a directory from
    /// the read-only image can be renamed.
    #[test]
    fn ns_root_redirect_dir_lets_image_directories_be_renamed() {
        if !testns::real_root_or_skip("redirect_dir") {
            return;
        }
        let Some(dir) = in_namespaces(
            "agent::userland::switch::tests::ns_root_redirect_dir_lets_image_directories_be_renamed",
            &["-m"],
        ) else {
            return;
        };
        tmpfs(&dir.join("x"));
        put(&dir.join("x/lower/opt/tool/file"), b"tool");
        let merged = dir.join("x/merged");
        let redirect = mount_overlay(
            &dir.join("x/lower"),
            &dir.join("x/upper"),
            &dir.join("x/work"),
            &merged,
        )
        .unwrap();
        assert!(redirect);
        std::fs::rename(merged.join("opt/tool"), merged.join("opt/tool2")).unwrap();
        assert_eq!(
            std::fs::read(merged.join("opt/tool2/file")).unwrap(),
            b"tool"
        );
        assert!(!merged.join("opt/tool").exists());
        // The image itself is untouched.
        assert!(dir.join("x/lower/opt/tool/file").exists());
    }

    /// An owned descriptor from a raw one the kernel returned.
    fn owned(fd: libc::c_int) -> OwnedFd {
        assert!(fd >= 0, "{}", io::Error::last_os_error());
        // SAFETY: a new descriptor nobody else owns.
        unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }
    }
}
