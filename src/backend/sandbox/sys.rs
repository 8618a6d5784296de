//! Checked wrappers over the raw Linux calls only the sandbox uses:
//! namespaces, `pivot_root`, pipes, capabilities, pidfds, exec and the
//! mount flags a remount must keep. The ones the agent uses too (C strings,
//! errno, `open`, `mount`, `umount2`, `statvfs`, close-on-exec) are
//! [`guest_agent::sys`]'s, re-exported here; bringing an interface up and
//! giving it an address are [`guest_agent::net`]'s.
//!
//! Every wrapper returns `io::Result` with the thread's errno; none of them
//! allocates after a `fork` unless its doc says so. System calls that glibc
//! may lack (old versions) go through `libc::syscall` with the kernel's
//! numbers from the `libc` crate.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

pub use guest_agent::sys::{cstring, cvt, cvt_long, mount_path, open, set_cloexec, umount2};

/// Version 3 of the capability ABI: two 32-bit words per set (caps 0..63).
const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// `pivot_root(2)`.
pub fn pivot_root(new_root: &Path, put_old: &Path) -> io::Result<()> {
    let new_root = cstring(new_root)?;
    let put_old = cstring(put_old)?;
    // SAFETY: valid C strings.
    cvt_long(unsafe { libc::syscall(libc::SYS_pivot_root, new_root.as_ptr(), put_old.as_ptr()) })
        .map(drop)
}

/// `unshare(2)`.
pub fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: plain system call.
    cvt(unsafe { libc::unshare(flags) }).map(drop)
}

/// `sethostname(2)`.
pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: pointer and length describe `name`.
    cvt(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }).map(drop)
}

/// `prctl(2)` with integer arguments.
pub fn prctl(option: libc::c_int, arg2: libc::c_ulong) -> io::Result<()> {
    // SAFETY: the options used here take integer arguments only.
    cvt(unsafe {
        libc::prctl(
            option,
            arg2,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    })
    .map(drop)
}

/// A close-on-exec pipe: `(read end, write end)`.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two descriptors.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 succeeded, so both are fresh descriptors we own.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Duplicates `fd` onto the lowest free descriptor `>= floor`, close-on-exec.
pub fn dup_above(fd: BorrowedFd<'_>, floor: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on a valid descriptor.
    let new = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, floor) })?;
    // SAFETY: fcntl returned a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// Whether `fd` is an open descriptor.
pub fn fd_is_open(fd: RawFd) -> bool {
    // SAFETY: F_GETFD on any number is harmless; EBADF means closed.
    unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
}

/// Writes all of `buf` to a raw descriptor, retrying on `EINTR`.
pub fn write_all(fd: BorrowedFd<'_>, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: pointer and length describe `buf`.
        let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// The mount flags (`MS_NOSUID`, `MS_NODEV`, `MS_NOEXEC` and the atime
/// mode) that the mount at `path` currently has, so a remount can keep the
/// ones a user namespace is not allowed to clear.
pub fn preserved_mount_flags(path: &Path) -> io::Result<libc::c_ulong> {
    let (_, _, f_flag) = guest_agent::sys::statvfs(path)?;
    Ok(mount_flags_from_statvfs(f_flag))
}

/// Maps `statvfs.f_flag` bits to the `MS_*` flags a bind remount must repeat.
pub fn mount_flags_from_statvfs(f_flag: libc::c_ulong) -> libc::c_ulong {
    const PAIRS: [(libc::c_ulong, libc::c_ulong); 6] = [
        (libc::ST_NOSUID, libc::MS_NOSUID),
        (libc::ST_NODEV, libc::MS_NODEV),
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ];
    let mut flags = PAIRS
        .iter()
        .filter(|(st, _)| f_flag & st != 0)
        .fold(0, |acc, (_, ms)| acc | ms);
    // Without MS_NOATIME/MS_RELATIME the kernel would default to relatime,
    // which is a change of a possibly locked atime mode: ask for strictatime.
    if f_flag & (libc::ST_NOATIME | libc::ST_RELATIME) == 0 {
        flags |= libc::MS_STRICTATIME;
    }
    flags
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Adds `caps` to the inheritable set, then raises each into the ambient set
/// so they survive `execve` for a non-root uid. They must be permitted.
pub fn raise_ambient_caps(caps: &[u32]) -> io::Result<()> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: header and a two-element data array as the v3 ABI requires.
    cvt_long(unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) })?;
    for &cap in caps {
        let word = (cap / 32) as usize;
        let bit = 1u32 << (cap % 32);
        if let Some(d) = data.get_mut(word) {
            d.inheritable |= bit;
        }
    }
    // SAFETY: as above.
    cvt_long(unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) })?;
    for &cap in caps {
        // SAFETY: PR_CAP_AMBIENT takes integer arguments only.
        cvt(unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong,
                cap as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        })?;
    }
    Ok(())
}

/// `pidfd_open(2)` (Linux 5.3+).
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: plain system call.
    let fd = cvt_long(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: the kernel returned a fresh descriptor (close-on-exec) we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `pidfd_send_signal(2)`.
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: null siginfo means "as if sent by kill(2)".
    cvt_long(unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    })
    .map(drop)
}

/// A NULL-terminated array of C strings for `execve`, owning its strings.
pub struct CStringArray {
    _owned: Vec<CString>,
    ptrs: Vec<*const libc::c_char>,
}

impl CStringArray {
    pub fn new<S: AsRef<OsStr>>(items: &[S]) -> io::Result<Self> {
        let owned = items.iter().map(cstring).collect::<io::Result<Vec<_>>>()?;
        let mut ptrs: Vec<_> = owned.iter().map(|c| c.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        Ok(Self {
            _owned: owned,
            ptrs,
        })
    }

    pub fn as_ptr(&self) -> *const *const libc::c_char {
        self.ptrs.as_ptr()
    }
}

/// `execveat(fd, "", argv, envp, AT_EMPTY_PATH)`: runs the file open at
/// `fd`. Returns only on failure.
pub fn execveat_fd(fd: BorrowedFd<'_>, argv: &CStringArray, envp: &CStringArray) -> io::Error {
    // SAFETY: the arrays are NULL-terminated and outlive the call; the path
    // is the empty C string.
    unsafe {
        libc::syscall(
            libc::SYS_execveat,
            fd.as_raw_fd(),
            c"".as_ptr(),
            argv.as_ptr(),
            envp.as_ptr(),
            libc::AT_EMPTY_PATH,
        );
    }
    io::Error::last_os_error()
}

/// `execve(path, argv, envp)`. Returns only on failure.
pub fn execve(path: &Path, argv: &CStringArray, envp: &CStringArray) -> io::Error {
    let path = match cstring(path) {
        Ok(p) => p,
        Err(e) => return e,
    };
    // SAFETY: valid C string and NULL-terminated arrays that outlive the call.
    unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
    io::Error::last_os_error()
}

/// `waitpid(pid, 0)` retrying on `EINTR`; returns the raw wait status.
pub fn waitpid(pid: libc::pid_t) -> io::Result<libc::c_int> {
    loop {
        let mut status = 0;
        // SAFETY: valid out pointer.
        match cvt(unsafe { libc::waitpid(pid, &mut status, 0) }) {
            Ok(_) => return Ok(status),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statvfs_flags_keep_locked_bits() {
        let f = mount_flags_from_statvfs(libc::ST_NOSUID | libc::ST_NODEV | libc::ST_RELATIME);
        assert_eq!(f, libc::MS_NOSUID | libc::MS_NODEV | libc::MS_RELATIME);
        let f = mount_flags_from_statvfs(libc::ST_NOEXEC | libc::ST_NOATIME);
        assert_eq!(f, libc::MS_NOEXEC | libc::MS_NOATIME);
        // Neither relatime nor noatime: strictatime must be asked for.
        assert_eq!(mount_flags_from_statvfs(0), libc::MS_STRICTATIME);
    }

    #[test]
    fn cstring_array_is_null_terminated() {
        let arr = CStringArray::new(&["a", "bc"]).expect("no NUL");
        // SAFETY: three pointers were pushed: two strings and the NULL.
        let last = unsafe { *arr.as_ptr().add(2) };
        assert!(last.is_null());
    }

    #[test]
    fn open_descriptors_are_seen() {
        let (r, _w) = pipe().expect("pipe");
        assert!(fd_is_open(r.as_raw_fd()));
    }
}
