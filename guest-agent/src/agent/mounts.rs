//! Session mounts (`Mount`, `Spawn.mounts`) and the SDK install bind.
//!
//! A session mount binds `source` (a path in the agent's view, chosen by the
//! host) onto `<sessions-root>/<session>/mnt/<name>`. The target path lives
//! in a directory that session processes can write to, so it is walked one
//! component at a time with `O_NOFOLLOW` descriptors: a symlink planted by a
//! session process makes the mount fail instead of redirecting it. The bind
//! itself uses the new mount API where available — `open_tree` clones the
//! source, `mount_setattr` makes the detached clone read-only (recursively)
//! before anyone can see it, and `move_mount` attaches it onto the target's
//! descriptor. On older kernels it falls back to `mount(MS_BIND|MS_REC)` onto
//! `/proc/self/fd/<target>` plus a read-only remount that keeps the locked
//! flags of the source mount (a remount of nested mounts is then not
//! recursive: a documented limit of the fallback).
//!
//! The session's home and its `mnt/` normally exist already (made by
//! [`super::users::prepare`], `mnt/` owned by the agent); a `mnt` the agent
//! does not own (a session renamed the real one away and made its own) is
//! refused, so a session cannot choose where its mount points are created.
//!
//! A mount already present at the target is detached first, so repeating a
//! mount replaces it. `rw` and `rwd` are the same here: the agent cannot
//! forbid deletion on a bind mount.
//!
//! All mount changes are serialized by one lock ([`crate::mounttable::lock`],
//! shared with the janitor's unmounts), so concurrent requests for
//! the same target cannot stack mounts.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::users;
use crate::mounttable::lock;
use crate::names;
use crate::proto::MountSpec;
use crate::sys;

/// Most mounts detached from one target before giving up (stacked mounts).
const MAX_STACKED_MOUNTS: usize = 16;

/// Mode of directories the agent creates.
const DIR_MODE: libc::mode_t = 0o755;

/// Mode of empty files created as targets for file mounts.
const FILE_MODE: libc::mode_t = 0o644;

/// Mode of the SDK target placeholder.
const SDK_MODE: libc::mode_t = 0o755;

/// Mount flags a read-only remount must keep (they may be locked in a user namespace).
const KEPT_REMOUNT_FLAGS: libc::c_ulong = libc::MS_NOSUID
    | libc::MS_NODEV
    | libc::MS_NOEXEC
    | libc::MS_NOATIME
    | libc::MS_NODIRATIME
    | libc::MS_RELATIME;

/// Why a mount or the SDK install failed.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error(transparent)]
    Name(#[from] names::NameError),
    #[error("mount {name:?}: source {source_path} does not exist")]
    SourceMissing { name: String, source_path: String },
    #[error("mount {name:?}: source {source_path} is neither a directory nor a regular file")]
    SourceKind { name: String, source_path: String },
    #[error("mount {name:?}: the target path contains a symlink or a non-directory ({path})")]
    UnsafeTarget { name: String, path: String },
    #[error("mount {name:?}: {path} exists and is not an empty {want}")]
    TargetKind {
        name: String,
        path: String,
        want: &'static str,
    },
    #[error("mount {name:?}: cannot prepare {path}: {source}")]
    Prepare {
        name: String,
        path: String,
        source: io::Error,
    },
    #[error("mount {name:?}: {source}")]
    Mount { name: String, source: io::Error },
    #[error("session directory {path}: {source}")]
    SessionDir { path: String, source: io::Error },
    #[error("{path} does not belong to the agent (a session process replaced it); remove it and the next spawn or mount recreates it")]
    ForeignMountDir { path: String },
    #[error("SDK binary {0} does not exist")]
    SdkMissing(String),
    #[error("SDK binary {0} is not a regular file")]
    SdkNotAFile(String),
    #[error("cannot install the SDK at {target}: {source}")]
    Sdk { target: String, source: io::Error },
    #[error("cannot make {path} a shared mount: {source}")]
    Shared { path: String, source: io::Error },
}

/// Creates (if needed) and opens `<root>/<session>` and `<root>/<session>/mnt`,
/// refusing symlinks and a `mnt` the agent does not own. Returns descriptors
/// of both. (Homes are normally made by [`super::users::prepare`] first; what
/// is created here has the same modes and belongs to the agent.)
pub fn ensure_session_dir(root: &Path, session: &str) -> Result<(OwnedFd, OwnedFd), MountError> {
    names::session_name(session)?;
    let dir = root.join(session);
    let err = |e: io::Error| MountError::SessionDir {
        path: dir.display().to_string(),
        source: e,
    };
    std::fs::create_dir_all(root).map_err(err)?;
    let rootfd = sys::open(root, libc::O_PATH | libc::O_DIRECTORY).map_err(err)?;
    let name = sys::cstring(session).map_err(err)?;
    sys::mkdirat_exist_ok(rootfd.as_fd(), &name, users::HOME_MODE).map_err(err)?;
    let sfd = sys::openat(
        rootfd.as_fd(),
        &name,
        libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
    )
    .map_err(err)?;
    sys::mkdirat_exist_ok(sfd.as_fd(), c"mnt", users::MNT_MODE).map_err(err)?;
    let mnt_path = || dir.join(users::MNT_DIR).display().to_string();
    let unsafe_mnt = || MountError::UnsafeTarget {
        name: users::MNT_DIR.to_string(),
        path: mnt_path(),
    };
    let mfd = sys::openat(
        sfd.as_fd(),
        c"mnt",
        libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
    )
    .map_err(|e| match sys::errno_of(&e) {
        libc::ELOOP | libc::ENOTDIR => unsafe_mnt(),
        _ => err(e),
    })?;
    // SAFETY: stat is plain data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat of a descriptor we own (O_PATH is fine) into a valid out-pointer.
    sys::cvt(unsafe { libc::fstat(mfd.as_raw_fd(), &mut st) }).map_err(err)?;
    // SAFETY: geteuid has no preconditions.
    if st.st_uid != unsafe { libc::geteuid() } {
        return Err(MountError::ForeignMountDir { path: mnt_path() });
    }
    Ok((sfd, mfd))
}

/// Performs one session mount (see the module doc).
pub fn mount_session(sessions_root: &Path, spec: &MountSpec) -> Result<(), MountError> {
    mount_session_with(sessions_root, spec, false)
}

/// As [`mount_session`]; `legacy` forces the pre-5.2 code path (for tests).
pub(crate) fn mount_session_with(
    sessions_root: &Path,
    spec: &MountSpec,
    legacy: bool,
) -> Result<(), MountError> {
    names::session_name(&spec.session)?;
    names::mount_name(&spec.name)?;
    let name = spec.name.clone();
    let src = match sys::stat(Path::new(&spec.source)) {
        Ok(st) => st,
        Err(_) => {
            return Err(MountError::SourceMissing {
                name,
                source_path: spec.source.clone(),
            })
        }
    };
    if !src.is_dir() && !src.is_file() {
        return Err(MountError::SourceKind {
            name,
            source_path: spec.source.clone(),
        });
    }
    let want_dir = src.is_dir();
    let target_path = sessions_root
        .join(&spec.session)
        .join("mnt")
        .join(&spec.name);
    let shown = target_path.display().to_string();
    let _guard = lock();
    let (_session, mut parent) = ensure_session_dir(sessions_root, &spec.session)?;
    let parts: Vec<&str> = spec.name.split('/').collect();
    let (last, dirs) = parts
        .split_last()
        .ok_or(names::NameError::Empty { what: "mount name" })?;
    for part in dirs {
        let c = sys::cstring(part).map_err(|e| MountError::Prepare {
            name: name.clone(),
            path: shown.clone(),
            source: e,
        })?;
        sys::mkdirat_exist_ok(parent.as_fd(), &c, DIR_MODE).map_err(|e| MountError::Prepare {
            name: name.clone(),
            path: shown.clone(),
            source: e,
        })?;
        parent = sys::openat(
            parent.as_fd(),
            &c,
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
        )
        .map_err(|_| MountError::UnsafeTarget {
            name: name.clone(),
            path: shown.clone(),
        })?;
    }
    let last = sys::cstring(last).map_err(|e| MountError::Prepare {
        name: name.clone(),
        path: shown.clone(),
        source: e,
    })?;
    let target = prepare_target(parent.as_fd(), &last, want_dir, &target_path)
        .map_err(|e| e.named(&name, &shown))?;
    let source = sys::cstring(&spec.source).map_err(|e| MountError::Mount {
        name: name.clone(),
        source: e,
    })?;
    let target = Target {
        parent: parent.as_fd(),
        name: &last,
        fd: target.as_fd(),
    };
    bind(&source, &target, !spec.mode.writable(), legacy)
        .map_err(|e| MountError::Mount { name, source: e })
}

/// Errors of target preparation before they are attributed to a mount name.
enum TargetError {
    Unsafe,
    Kind(&'static str),
    Io(io::Error),
}

impl TargetError {
    fn named(self, name: &str, path: &str) -> MountError {
        let (name, path) = (name.to_string(), path.to_string());
        match self {
            TargetError::Unsafe => MountError::UnsafeTarget { name, path },
            TargetError::Kind(want) => MountError::TargetKind { name, path, want },
            TargetError::Io(source) => MountError::Prepare { name, path, source },
        }
    }
}

impl From<io::Error> for TargetError {
    fn from(e: io::Error) -> Self {
        TargetError::Io(e)
    }
}

/// Opens (creating if needed) the mount target `name` in `parent` as an
/// `O_PATH` descriptor of the right kind, with any existing mounts detached.
fn prepare_target(
    parent: BorrowedFd<'_>,
    name: &CStr,
    want_dir: bool,
    lexical: &Path,
) -> Result<OwnedFd, TargetError> {
    for _ in 0..MAX_STACKED_MOUNTS {
        let fd = match sys::openat(parent, name, libc::O_PATH | libc::O_NOFOLLOW, 0) {
            Ok(fd) => fd,
            Err(e) if sys::errno_of(&e) == libc::ENOENT => {
                create_target(parent, name, want_dir)?;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let st = sys::fstat(fd.as_fd())?;
        if st.is_symlink() {
            return Err(TargetError::Unsafe);
        }
        if sys::fd_is_mount_root(fd.as_fd(), parent)? {
            detach(fd.as_fd(), lexical)?;
            continue;
        }
        if st.is_dir() == want_dir && (st.is_dir() || st.is_file()) {
            return Ok(fd);
        }
        // Wrong kind: replace it only if it is an empty placeholder.
        let empty = if st.is_dir() {
            std::fs::read_dir(sys::proc_fd_path(fd.as_fd()))
                .map(|mut d| d.next().is_none())
                .unwrap_or(false)
        } else {
            st.is_file() && st.size == 0
        };
        if !empty {
            return Err(TargetError::Kind(if want_dir {
                "directory"
            } else {
                "file"
            }));
        }
        let flags = if st.is_dir() { libc::AT_REMOVEDIR } else { 0 };
        sys::unlinkat(parent, name, flags)?;
    }
    Err(TargetError::Io(io::Error::from_raw_os_error(libc::EBUSY)))
}

fn create_target(parent: BorrowedFd<'_>, name: &CStr, want_dir: bool) -> io::Result<()> {
    if want_dir {
        return sys::mkdirat_exist_ok(parent, name, DIR_MODE);
    }
    let flags = libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_NOFOLLOW;
    match sys::openat(parent, name, flags, FILE_MODE) {
        Ok(_) => Ok(()),
        Err(e) if sys::errno_of(&e) == libc::EEXIST => Ok(()),
        Err(e) => Err(e),
    }
}

/// Detaches the mount whose root `fd` refers to. Uses `/proc/self/fd` so no
/// path walk can be redirected; without `/proc`, the lexical path (already
/// checked to be symlink-free) with `UMOUNT_NOFOLLOW`.
fn detach(fd: BorrowedFd<'_>, lexical: &Path) -> io::Result<()> {
    let via_proc = sys::cstring(sys::proc_fd_path(fd))?;
    match sys::umount2(&via_proc, libc::MNT_DETACH) {
        Err(e) if sys::errno_of(&e) == libc::ENOENT => sys::umount2(
            &sys::cstring(lexical)?,
            libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW,
        ),
        other => other,
    }
}

/// A mount target: the `O_PATH` descriptor of the object to mount over, and
/// where it was found (to reach the new mount root afterwards).
struct Target<'a> {
    parent: BorrowedFd<'a>,
    name: &'a CStr,
    fd: BorrowedFd<'a>,
}

/// Binds `source` onto `target`, read-only if asked.
fn bind(source: &CStr, target: &Target<'_>, readonly: bool, legacy: bool) -> io::Result<()> {
    if !legacy {
        match bind_new_api(source, target, readonly) {
            Err(e) if sys::errno_of(&e) == libc::ENOSYS => {}
            other => return other,
        }
    }
    let at = sys::cstring(sys::proc_fd_path(target.fd))?;
    sys::mount(Some(source), &at, None, libc::MS_BIND | libc::MS_REC, None)?;
    if readonly {
        remount_readonly(source, target, legacy)?;
    }
    Ok(())
}

fn bind_new_api(source: &CStr, target: &Target<'_>, readonly: bool) -> io::Result<()> {
    let tree = sys::open_tree(
        source,
        libc::OPEN_TREE_CLONE | libc::AT_RECURSIVE as libc::c_uint,
    )?;
    let mut remount_after = false;
    if readonly {
        let flags = (libc::AT_EMPTY_PATH | libc::AT_RECURSIVE) as libc::c_uint;
        match sys::mount_setattr(Some(tree.as_fd()), c"", flags, libc::MOUNT_ATTR_RDONLY) {
            Ok(()) => {}
            Err(e) if sys::errno_of(&e) == libc::ENOSYS => remount_after = true,
            Err(e) => return Err(e),
        }
    }
    sys::move_mount_fds(tree.as_fd(), target.fd)?;
    if remount_after {
        remount_readonly(source, target, true)?;
    }
    Ok(())
}

/// Makes the mount just attached at `target` read-only. The target's own
/// descriptor still names the object *under* the new mount, so the new
/// mount root is looked up again (without following symlinks) and checked
/// to be the source before it is changed. On failure the mount is detached:
/// a writable mount is never left behind when read-only was asked.
fn remount_readonly(source: &CStr, target: &Target<'_>, legacy: bool) -> io::Result<()> {
    let root = sys::openat(
        target.parent,
        target.name,
        libc::O_PATH | libc::O_NOFOLLOW,
        0,
    )?;
    let (src, now) = (sys::statx(None, source, 0)?, sys::fstat(root.as_fd())?);
    if (src.dev, src.ino) != (now.dev, now.ino) {
        return Err(io::Error::other("the mount target changed while mounting"));
    }
    let at = sys::cstring(sys::proc_fd_path(root.as_fd()))?;
    let res = make_readonly(&at, legacy);
    if res.is_err() {
        let _ = sys::umount2(&at, libc::MNT_DETACH);
    }
    res
}

/// Makes the mount at `path` read-only: `mount_setattr` (recursive), or a
/// bind remount that keeps the flags that may be locked.
fn make_readonly(path: &CStr, legacy: bool) -> io::Result<()> {
    if !legacy {
        match sys::mount_setattr(
            None,
            path,
            libc::AT_RECURSIVE as libc::c_uint,
            libc::MOUNT_ATTR_RDONLY,
        ) {
            Err(e) if sys::errno_of(&e) == libc::ENOSYS => {}
            other => return other,
        }
    }
    let p = Path::new(std::ffi::OsStr::from_bytes(path.to_bytes()));
    let (_, _, flags) = sys::statvfs(p)?;
    let flags = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | (flags & KEPT_REMOUNT_FLAGS);
    sys::mount(None, path, None, flags, None)
}

/// Makes `source` available read-only at `target` (idempotent). Returns
/// whether anything changed.
pub fn install_sdk(source: &Path, target: &Path) -> Result<bool, MountError> {
    install_sdk_with(source, target, false)
}

pub(crate) fn install_sdk_with(
    source: &Path,
    target: &Path,
    legacy: bool,
) -> Result<bool, MountError> {
    let shown = || target.display().to_string();
    let err = |e: io::Error| MountError::Sdk {
        target: shown(),
        source: e,
    };
    let src =
        sys::stat(source).map_err(|_| MountError::SdkMissing(source.display().to_string()))?;
    if !src.is_file() {
        return Err(MountError::SdkNotAFile(source.display().to_string()));
    }
    let _guard = lock();
    if let Ok(t) = sys::stat(target) {
        if t.dev == src.dev && t.ino == src.ino {
            return Ok(false);
        }
    }
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(err)?;
    }
    for _ in 0..MAX_STACKED_MOUNTS {
        match sys::is_mount_point(target) {
            Ok(true) => {
                sys::umount2(&sys::cstring(target).map_err(err)?, libc::MNT_DETACH).map_err(err)?
            }
            Ok(false) => break,
            Err(e) if sys::errno_of(&e) == libc::ENOENT => {
                let c = sys::cstring(target).map_err(err)?;
                // SAFETY: plain open(2) with a NUL-terminated path.
                let fd = unsafe {
                    libc::open(
                        c.as_ptr(),
                        libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                        SDK_MODE,
                    )
                };
                if fd < 0 {
                    return Err(err(io::Error::last_os_error()));
                }
                // SAFETY: closing the descriptor we just opened.
                unsafe { libc::close(fd) };
                break;
            }
            Err(e) => return Err(err(e)),
        }
    }
    let (Some(dir), Some(name)) = (target.parent(), target.file_name()) else {
        return Err(err(io::Error::from_raw_os_error(libc::EINVAL)));
    };
    let parent = sys::open(dir, libc::O_PATH | libc::O_DIRECTORY).map_err(err)?;
    let name = sys::cstring(name).map_err(err)?;
    let fd = sys::openat(parent.as_fd(), &name, libc::O_PATH | libc::O_NOFOLLOW, 0).map_err(err)?;
    let c = sys::cstring(source).map_err(err)?;
    let t = Target {
        parent: parent.as_fd(),
        name: &name,
        fd: fd.as_fd(),
    };
    bind(&c, &t, true, legacy).map_err(err)?;
    Ok(true)
}

/// Makes `path` a shared mount (binding it onto itself first if it is not a
/// mount point), so that mounts made below it later propagate into the
/// private mount namespaces of processes started with private paths.
pub fn ensure_shared(path: &Path) -> Result<(), MountError> {
    let err = |e| MountError::Shared {
        path: path.display().to_string(),
        source: e,
    };
    std::fs::create_dir_all(path).map_err(err)?;
    let c = sys::cstring(path).map_err(err)?;
    let _guard = lock();
    if !sys::is_mount_point(path).map_err(err)? {
        sys::mount(Some(&c), &c, None, libc::MS_BIND | libc::MS_REC, None).map_err(err)?;
    }
    sys::mount(None, &c, None, libc::MS_SHARED | libc::MS_REC, None).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_sources_name_the_mount() {
        let root = tempfile::tempdir().unwrap();
        let spec = MountSpec {
            session: "s".into(),
            name: "outputs".into(),
            source: "/nonexistent/source".into(),
            mode: crate::proto::MountMode::Rw,
        };
        let err = mount_session(root.path(), &spec).unwrap_err();
        assert!(err.to_string().contains("\"outputs\""), "{err}");
        let bad = MountSpec {
            name: "../x".into(),
            ..spec.clone()
        };
        assert!(matches!(
            mount_session(root.path(), &bad),
            Err(MountError::Name(_))
        ));
        let err = install_sdk(
            Path::new("/nonexistent/claude"),
            &root.path().join("claude"),
        )
        .unwrap_err();
        assert!(matches!(err, MountError::SdkMissing(_)), "{err}");
    }

    #[test]
    fn a_mount_directory_the_session_replaced_is_refused() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        ensure_session_dir(r, "s").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&r.join("s")), users::HOME_MODE);
        assert_eq!(mode(&r.join("s/mnt")), users::MNT_MODE);
        // Renamed away and replaced by a symlink: refused, not followed.
        std::fs::rename(r.join("s/mnt"), r.join("s/old")).unwrap();
        std::os::unix::fs::symlink(r, r.join("s/mnt")).unwrap();
        let err = ensure_session_dir(r, "s").unwrap_err();
        assert!(matches!(err, MountError::UnsafeTarget { .. }), "{err}");
        std::fs::remove_file(r.join("s/mnt")).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED the foreign-owner part: needs root to chown");
            return;
        }
        // Replaced by a directory of the session's own.
        std::fs::create_dir(r.join("s/mnt")).unwrap();
        std::os::unix::fs::chown(r.join("s/mnt"), Some(1_500_000_009), None).unwrap();
        let err = ensure_session_dir(r, "s").unwrap_err();
        assert!(matches!(err, MountError::ForeignMountDir { .. }), "{err}");
        assert!(err.to_string().contains("remove it"), "{err}");
        // Once it is gone, the agent makes its own again.
        std::fs::remove_dir(r.join("s/mnt")).unwrap();
        ensure_session_dir(r, "s").unwrap();
        assert_eq!(std::fs::metadata(r.join("s/mnt")).unwrap().uid(), 0);
    }
}
