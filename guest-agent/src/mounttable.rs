//! This process's mount table: which mounts sit at or below a directory
//! (read from `/proc/self/mountinfo`), detaching them, and the one lock that
//! serializes every mount change the process makes.
//!
//! A library-level module: the [`crate::janitor`] detaches the mounts below a
//! session before deleting it (in the agent, and on the host when no agent
//! runs), and the agent's session mounts take the same lock, so a mount and
//! an unmount of the same place never interleave.
//!
//! Limits: only this process's mount namespace is seen; mount points are
//! compared lexically (the caller passes a canonical path).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::sys;

/// The mount table of this process's mount namespace.
const MOUNTINFO: &str = "/proc/self/mountinfo";

/// The field of a mountinfo line that holds the mount point (0-based,
/// space-separated; see proc(5)).
const MOUNT_POINT_FIELD: usize = 4;

static MOUNT_LOCK: Mutex<()> = Mutex::new(());

/// Takes the lock that serializes all mount changes of this process. A
/// poisoned lock is taken over: it guards no data, only ordering.
pub(crate) fn lock() -> MutexGuard<'static, ()> {
    MOUNT_LOCK.lock().unwrap_or_else(|p| p.into_inner())
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
    fn the_root_mount_is_below_the_root_and_listed_last() {
        let found = mounts_below(Path::new("/")).unwrap();
        assert_eq!(found.last().map(PathBuf::as_path), Some(Path::new("/")));
        assert!(mounts_below(Path::new("/nonexistent/below"))
            .unwrap()
            .is_empty());
    }
}
