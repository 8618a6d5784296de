//! This process's mount table: which mounts sit at or below a directory
//! (read from `/proc/self/mountinfo`), detaching them, mounting a
//! filesystem where none is yet ([`mount_unless_mounted`]), and the one lock
//! that serializes the mount changes of sessions.
//!
//! A library-level module: the [`crate::janitor`] detaches the mounts below a
//! session before deleting it (in the agent, and on the host when no agent
//! runs), and the agent's session mounts take the same lock, so a mount and
//! an unmount of the same place never interleave.
//!
//! Limits: only this process's mount namespace is seen; mount points are
//! compared lexically (the caller passes a canonical path).

use std::ffi::{CStr, OsStr};
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::sync::MutexExt;
use crate::sys;

/// The mount table of this process's mount namespace.
const MOUNTINFO: &str = "/proc/self/mountinfo";

/// The field of a mountinfo line that holds the mount point (0-based,
/// space-separated; see proc(5)).
const MOUNT_POINT_FIELD: usize = 4;

static MOUNT_LOCK: Mutex<()> = Mutex::new(());

/// Takes the lock that serializes the mount changes made while requests are
/// served (the agent's session mounts and SDK bind, [`unmount_below`]); the
/// boot-time mounts run before any request and do not take it. A poisoned
/// lock is taken over: it guards no data, only ordering.
pub(crate) fn lock() -> MutexGuard<'static, ()> {
    MOUNT_LOCK.locked()
}

/// The mount points at or below `dir` in this mount namespace, deepest
/// first.
pub fn mounts_below(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let info = std::fs::read_to_string(MOUNTINFO)?;
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(MOUNT_POINT_FIELD))
        .map(|p| PathBuf::from(unescape_mountinfo(p)))
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found.dedup();
    Ok(found)
}

/// Undoes the octal escapes (`\040` for space…) of mountinfo paths.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = u32::from(b[i + 1] - b'0') * 64
                + u32::from(b[i + 2] - b'0') * 8
                + u32::from(b[i + 3] - b'0');
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Detaches every mount at or below `dir`, deepest first. Mounts that are
/// already gone are not an error.
pub fn unmount_below(dir: &Path) -> io::Result<()> {
    let _guard = lock();
    for m in mounts_below(dir)? {
        let c = sys::cstring(&m)?;
        match sys::umount2(&c, libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) {
            Ok(()) => {}
            Err(e) if matches!(sys::errno_of(&e), libc::EINVAL | libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Mounts `source` as `fstype` with `flags` on `target`, creating `target`
/// and its missing parents with `dir_mode`. A `target` that is a mount point
/// already is left as it is (whatever is mounted there): boot steps that run
/// again find their work done.
pub fn mount_unless_mounted(
    source: impl AsRef<OsStr>,
    target: &Path,
    fstype: &CStr,
    flags: libc::c_ulong,
    dir_mode: u32,
) -> io::Result<()> {
    if sys::is_mount_point(target).unwrap_or(false) {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(dir_mode)
        .create(target)?;
    let c_source = sys::cstring(source)?;
    let c_target = sys::cstring(target)?;
    sys::mount(Some(&c_source), &c_target, Some(fstype), flags, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/x\\"), "/x\\");
    }

    #[test]
    fn a_mount_point_is_left_alone_and_a_missing_target_is_made() {
        // /proc is mounted: nothing is tried (the bogus type would fail).
        mount_unless_mounted("none", Path::new("/proc"), c"no-such-fs", 0, 0o700).unwrap();
        let t = tempfile::tempdir().unwrap();
        let target = t.path().join("a/b");
        let err = mount_unless_mounted("none", &target, c"no-such-fs", 0, 0o700).unwrap_err();
        assert!(err.raw_os_error().is_some(), "{err}");
        use std::os::unix::fs::PermissionsExt;
        for dir in [target.as_path(), target.parent().unwrap()] {
            let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", dir.display());
        }
    }

    #[test]
    fn the_root_mount_is_below_the_root_and_listed_last() {
        let found = mounts_below(Path::new("/")).unwrap();
        assert_eq!(found.last().map(PathBuf::as_path), Some(Path::new("/")));
        assert!(mounts_below(Path::new("/nonexistent/below"))
            .unwrap()
            .is_empty());
    }
}
