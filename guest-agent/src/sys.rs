//! Thin, safe wrappers over the Linux system calls that `std` does not
//! offer: `openat2`, the new mount API (`open_tree`, `move_mount`,
//! `mount_setattr`), `statx` mount information, classic `mount`/`umount2`,
//! `statvfs`/`statfs`, clocks, `uname` and descriptor flags.
//!
//! The one set of such wrappers in the workspace: the [`crate::janitor`]
//! (which the host runs too) and the agent use it, and so does the host's
//! namespace sandbox (`cowork_helper::backend::sandbox`, whose own `sys`
//! keeps only what nothing else needs: namespaces, capabilities, pidfds,
//! exec), so none of them reaches into another's internals. What the
//! sandbox uses is `pub` ([`cstring`], [`cvt`], [`cvt_long`], [`open`],
//! [`mount`], [`mount_path`], [`umount2`], [`statvfs`], [`set_cloexec`]);
//! the rest is `pub(crate)`.
//!
//! Every wrapper returns `std::io::Error` with the raw errno so callers can
//! decide about fallbacks (`ENOSYS` on old kernels). Nothing here allocates
//! on behalf of a forked child: child-side code lives in the agent's `child`
//! module. Limits: Linux only; `statx` mount ids need 5.8+ (older kernels
//! report none and callers fall back to device numbers).

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Converts a path to a C string; an interior NUL is `EINVAL`.
pub fn cstring(path: impl AsRef<OsStr>) -> io::Result<CString> {
    CString::new(path.as_ref().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Maps a `-1` return to the current `errno`.
pub fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// [`cvt`] for calls returning `c_long` (`libc::syscall`).
pub fn cvt_long(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// The errno of an I/O error, or 0 when it carries none.
pub(crate) fn errno_of(err: &io::Error) -> i32 {
    err.raw_os_error().unwrap_or(0)
}

/// `/proc/self/fd/<fd>`: a path that names exactly the object behind `fd`.
pub(crate) fn proc_fd_path(fd: BorrowedFd<'_>) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

/// `openat2(dirfd, path, {flags, mode: 0, resolve})`; `O_CLOEXEC` is added.
pub(crate) fn openat2(
    dirfd: BorrowedFd<'_>,
    path: &CStr,
    flags: libc::c_int,
    resolve: u64,
) -> io::Result<OwnedFd> {
    // SAFETY: open_how is plain data; all-zero is valid (mode 0).
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = resolve;
    // SAFETY: `how` is a valid open_how of the size passed; `path` is NUL terminated.
    let fd = cvt_long(unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dirfd.as_raw_fd(),
            path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    })?;
    // SAFETY: the kernel returned a new descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `openat(dirfd, path, flags | O_CLOEXEC, mode)`.
pub(crate) fn openat(
    dirfd: BorrowedFd<'_>,
    path: &CStr,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall with a NUL-terminated path.
    let fd = cvt(unsafe {
        libc::openat(
            dirfd.as_raw_fd(),
            path.as_ptr(),
            flags | libc::O_CLOEXEC,
            mode,
        )
    })?;
    // SAFETY: new descriptor owned by us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `open(path, flags | O_CLOEXEC)`.
pub fn open(path: &Path, flags: libc::c_int) -> io::Result<OwnedFd> {
    let c = cstring(path)?;
    // SAFETY: plain syscall with a NUL-terminated path.
    let fd = cvt(unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) })?;
    // SAFETY: new descriptor owned by us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `mkdirat(dirfd, name, mode)`, treating `EEXIST` as success.
pub(crate) fn mkdirat_exist_ok(
    dirfd: BorrowedFd<'_>,
    name: &CStr,
    mode: libc::mode_t,
) -> io::Result<()> {
    // SAFETY: plain syscall with a NUL-terminated name.
    match cvt(unsafe { libc::mkdirat(dirfd.as_raw_fd(), name.as_ptr(), mode) }) {
        Ok(_) => Ok(()),
        Err(e) if errno_of(&e) == libc::EEXIST => Ok(()),
        Err(e) => Err(e),
    }
}

/// `unlinkat(dirfd, name, flags)`.
pub(crate) fn unlinkat(dirfd: BorrowedFd<'_>, name: &CStr, flags: libc::c_int) -> io::Result<()> {
    // SAFETY: plain syscall with a NUL-terminated name.
    cvt(unsafe { libc::unlinkat(dirfd.as_raw_fd(), name.as_ptr(), flags) }).map(drop)
}

/// What the agent wants to know from `statx`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StatInfo {
    pub dev: u64,
    pub ino: u64,
    pub mode: u32,
    pub size: u64,
    /// Bytes actually allocated (512-byte blocks).
    pub allocated: u64,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Mount id, when the kernel reports it (5.8+).
    pub mnt_id: Option<u64>,
    /// Whether this is the root of a mount, when the kernel reports it (5.8+).
    pub mount_root: Option<bool>,
}

impl StatInfo {
    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }
    pub fn is_file(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }
    pub fn is_symlink(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFLNK
    }
    /// Whether this object, found in a walk below `base`, is on another
    /// mount than `base` (a mount point below it): the root of a mount, or
    /// another mount id (5.8+), or else another device (which misses bind
    /// mounts within one filesystem on old kernels).
    pub fn crosses_mount_from(&self, base: &StatInfo) -> bool {
        if self.mount_root == Some(true) {
            return true;
        }
        match (base.mnt_id, self.mnt_id) {
            (Some(a), Some(b)) => a != b,
            _ => base.dev != self.dev,
        }
    }
}

/// `statx(dirfd, path, flags)`; pass `AT_EMPTY_PATH` and an empty path to stat
/// `dirfd` itself, `AT_SYMLINK_NOFOLLOW` to stat links themselves.
pub(crate) fn statx(
    dirfd: Option<BorrowedFd<'_>>,
    path: &CStr,
    flags: libc::c_int,
) -> io::Result<StatInfo> {
    // SAFETY: statx is plain data; all-zero is a valid value.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    let raw_dir = dirfd.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    let mask = libc::STATX_BASIC_STATS | libc::STATX_MNT_ID;
    // SAFETY: `st` is a valid out-pointer; `path` is NUL terminated.
    cvt(unsafe { libc::statx(raw_dir, path.as_ptr(), flags, mask, &mut st) })?;
    let mnt_id = (st.stx_mask & libc::STATX_MNT_ID != 0).then_some(st.stx_mnt_id);
    let mount_root = (st.stx_attributes_mask & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0)
        .then_some(st.stx_attributes & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0);
    Ok(StatInfo {
        dev: libc::makedev(st.stx_dev_major, st.stx_dev_minor),
        ino: st.stx_ino,
        mode: u32::from(st.stx_mode),
        size: st.stx_size,
        allocated: st.stx_blocks.saturating_mul(512),
        mtime: st.stx_mtime.tv_sec,
        mnt_id,
        mount_root,
    })
}

/// `statx` of a path, not following a final symlink.
pub(crate) fn lstat(path: &Path) -> io::Result<StatInfo> {
    statx(None, &cstring(path)?, libc::AT_SYMLINK_NOFOLLOW)
}

/// `statx` of a path, following symlinks.
pub(crate) fn stat(path: &Path) -> io::Result<StatInfo> {
    statx(None, &cstring(path)?, 0)
}

/// `statx` of an open descriptor.
pub(crate) fn fstat(fd: BorrowedFd<'_>) -> io::Result<StatInfo> {
    statx(Some(fd), c"", libc::AT_EMPTY_PATH)
}

/// Whether `path` is the root of a mount. Uses `STATX_ATTR_MOUNT_ROOT`; on
/// kernels without it, compares the device with the parent's (which misses
/// bind mounts within one filesystem).
pub(crate) fn is_mount_point(path: &Path) -> io::Result<bool> {
    let st = lstat(path)?;
    if let Some(root) = st.mount_root {
        return Ok(root);
    }
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => Ok(stat(parent)?.dev != st.dev),
        _ => Ok(true),
    }
}

/// Whether the object behind `fd` is the root of a mount (see [`is_mount_point`]).
pub(crate) fn fd_is_mount_root(fd: BorrowedFd<'_>, parent: BorrowedFd<'_>) -> io::Result<bool> {
    let st = fstat(fd)?;
    if let Some(root) = st.mount_root {
        return Ok(root);
    }
    Ok(fstat(parent)?.dev != st.dev)
}

/// Classic `mount(2)`. Allocates nothing (usable in a forked child).
pub fn mount(
    source: Option<&CStr>,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> io::Result<()> {
    let p = |s: Option<&CStr>| s.map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: all pointers are NULL or NUL-terminated strings.
    cvt(unsafe { libc::mount(p(source), target.as_ptr(), p(fstype), flags, p(data).cast()) })
        .map(drop)
}

/// [`mount`] of paths and strings, each converted with [`cstring`] (so it
/// allocates).
pub fn mount_path(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = source.map(cstring).transpose()?;
    let target = cstring(target)?;
    let fstype = fstype.map(cstring).transpose()?;
    let data = data.map(cstring).transpose()?;
    mount(
        source.as_deref(),
        &target,
        fstype.as_deref(),
        flags,
        data.as_deref(),
    )
}

/// `umount2(path, flags)`.
pub fn umount2(path: &CStr, flags: libc::c_int) -> io::Result<()> {
    // SAFETY: NUL-terminated path.
    cvt(unsafe { libc::umount2(path.as_ptr(), flags) }).map(drop)
}

/// `open_tree(AT_FDCWD, path, flags | OPEN_TREE_CLOEXEC)`.
pub(crate) fn open_tree(path: &CStr, flags: libc::c_uint) -> io::Result<OwnedFd> {
    // SAFETY: NUL-terminated path; returns a new descriptor.
    let fd = cvt_long(unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            path.as_ptr(),
            flags | libc::OPEN_TREE_CLOEXEC,
        )
    })?;
    // SAFETY: new descriptor owned by us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `move_mount(from, "", to, "", F_EMPTY_PATH | T_EMPTY_PATH)`: attaches the
/// detached tree `from` on top of the object `to` refers to.
pub(crate) fn move_mount_fds(from: BorrowedFd<'_>, to: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: empty NUL-terminated paths with EMPTY_PATH flags.
    cvt_long(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            from.as_raw_fd(),
            c"".as_ptr(),
            to.as_raw_fd(),
            c"".as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
        )
    })
    .map(drop)
}

/// `mount_setattr(dirfd, path, flags, {attr_set, attr_clr})`.
pub(crate) fn mount_setattr(
    dirfd: Option<BorrowedFd<'_>>,
    path: &CStr,
    flags: libc::c_uint,
    attr_set: u64,
) -> io::Result<()> {
    // SAFETY: mount_attr is plain data.
    let mut attr: libc::mount_attr = unsafe { std::mem::zeroed() };
    attr.attr_set = attr_set;
    let raw_dir = dirfd.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    // SAFETY: valid attr pointer and size; NUL-terminated path.
    cvt_long(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            raw_dir,
            path.as_ptr(),
            flags,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    })
    .map(drop)
}

/// `statvfs(path)`: (total bytes, bytes available to unprivileged users, mount flags).
pub fn statvfs(path: &Path) -> io::Result<(u64, u64, libc::c_ulong)> {
    let c = cstring(path)?;
    // SAFETY: statvfs is plain data.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer and path.
    cvt(unsafe { libc::statvfs(c.as_ptr(), &mut st) })?;
    let frsize = st.f_frsize as u64;
    Ok((
        (st.f_blocks as u64).saturating_mul(frsize),
        (st.f_bavail as u64).saturating_mul(frsize),
        st.f_flag,
    ))
}

/// `statfs(path).f_type`: the filesystem magic.
pub(crate) fn fs_magic(path: &Path) -> io::Result<u64> {
    let c = cstring(path)?;
    // SAFETY: statfs is plain data.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer and path.
    cvt(unsafe { libc::statfs(c.as_ptr(), &mut st) })?;
    Ok(st.f_type as u64)
}

/// Microseconds of `CLOCK_BOOTTIME` (time since the kernel booted, including suspend).
pub(crate) fn boottime_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_BOOTTIME always exists on Linux.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec as u64).saturating_mul(1_000_000) + (ts.tv_nsec as u64) / 1_000
}

/// The kernel release (`uname -r`).
pub(crate) fn kernel_release() -> String {
    // SAFETY: utsname is plain data.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return String::new();
    }
    // SAFETY: the kernel NUL-terminates every utsname field.
    let rel = unsafe { CStr::from_ptr(uts.release.as_ptr()) };
    rel.to_string_lossy().into_owned()
}

/// Sets `O_NONBLOCK` on `fd`.
pub(crate) fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we borrow.
    let flags = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    if flags & libc::O_NONBLOCK == 0 {
        // SAFETY: as above.
        cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    }
    Ok(())
}

/// Sets `FD_CLOEXEC` on `fd`.
pub fn set_cloexec(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we borrow.
    let flags = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, flags | libc::FD_CLOEXEC) })?;
    Ok(())
}

/// Best-effort `F_SETPIPE_SZ`; returns the resulting size.
pub(crate) fn set_pipe_size(fd: BorrowedFd<'_>, size: usize) -> io::Result<usize> {
    let size = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
    // SAFETY: fcntl on a descriptor we borrow.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETPIPE_SZ, size) }).map(|n| n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn statx_sees_files_and_mount_roots() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"12345").unwrap();
        let st = lstat(&f).unwrap();
        assert!(st.is_file() && !st.is_dir());
        assert_eq!(st.size, 5);
        assert!(!is_mount_point(&f).unwrap());
        assert!(is_mount_point(Path::new("/")).unwrap());
        assert!(is_mount_point(Path::new("/proc")).unwrap());
    }

    #[test]
    fn mounts_are_crossed_by_mount_root_id_or_device() {
        let dir = tempfile::tempdir().unwrap();
        let base = lstat(dir.path()).unwrap();
        std::fs::write(dir.path().join("f"), b"").unwrap();
        let inside = lstat(&dir.path().join("f")).unwrap();
        assert!(!inside.crosses_mount_from(&base));
        assert!(lstat(Path::new("/proc")).unwrap().crosses_mount_from(&base));
        // Without mount information (old kernels) the device decides.
        let old = |st: StatInfo| StatInfo {
            mnt_id: None,
            mount_root: None,
            ..st
        };
        assert!(!old(inside).crosses_mount_from(&old(base)));
        let other_dev = StatInfo {
            dev: base.dev + 1,
            ..old(inside)
        };
        assert!(other_dev.crosses_mount_from(&old(base)));
        // A mount id differing from the base's wins over an equal device.
        let other_mount = StatInfo {
            mnt_id: base.mnt_id.map(|id| id + 1),
            mount_root: Some(false),
            ..inside
        };
        assert_eq!(other_mount.crosses_mount_from(&base), base.mnt_id.is_some());
    }

    #[test]
    fn cstring_refuses_nul() {
        assert!(cstring("a\0b").is_err());
        assert_eq!(
            cstring("/usr").map(|c| c.into_bytes()).ok(),
            Some(b"/usr".to_vec())
        );
    }

    #[test]
    fn cloexec_is_set() {
        let (r, _w) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        let fd = r.as_raw_fd();
        // SAFETY: F_SETFD/F_GETFD only write and read this test's own
        // descriptor's flags.
        unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
        set_cloexec(r.as_fd()).expect("set");
        assert_ne!(
            // SAFETY: as above.
            unsafe { libc::fcntl(fd, libc::F_GETFD) } & libc::FD_CLOEXEC,
            0
        );
    }

    #[test]
    fn clocks_and_uname() {
        assert!(boottime_us() > 0);
        assert!(!kernel_release().is_empty());
    }

    #[test]
    fn openat2_refuses_escapes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("s")).unwrap();
        std::os::unix::fs::symlink("/etc", dir.path().join("s/out")).unwrap();
        let base = open(&dir.path().join("s"), libc::O_PATH | libc::O_DIRECTORY).unwrap();
        let beneath = libc::RESOLVE_BENEATH;
        let err = openat2(base.as_fd(), c"../", libc::O_PATH, beneath).unwrap_err();
        assert_eq!(errno_of(&err), libc::EXDEV);
        let err = openat2(base.as_fd(), c"out/hostname", libc::O_RDONLY, beneath).unwrap_err();
        assert_eq!(errno_of(&err), libc::EXDEV);
    }
}
