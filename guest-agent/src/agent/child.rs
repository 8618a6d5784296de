//! What a spawned process does between `fork` and `exec`.
//!
//! Everything here runs in the forked child of a multi-threaded parent, so
//! it is restricted to async-signal-safe raw system calls: no allocation, no
//! locks, no logging. All paths and buffers are prepared in the parent
//! (which builds the [`ChildSetup`]) and only borrowed in [`ChildSetup::apply`]. Errors
//! are returned as raw OS errors, which `std` reports to the parent as the
//! spawn's error.
//!
//! Steps, in order:
//! 1. join the process's own cgroup (write `0` to a pre-opened `cgroup.procs`)
//!    and raise its `oom_score_adj` (best effort: a failure leaves the
//!    inherited value);
//! 2. with private paths: `unshare(CLONE_NEWNS)`, make `/` recursively a
//!    slave (so later session mounts still propagate in, nothing propagates
//!    out), and detach each private path; a path that does not exist is
//!    skipped, any other failure aborts the spawn;
//! 3. with a session user ([`ChildSetup::user`], in a VM): become that user
//!    for good, without any capability (see `become_user`);
//!    otherwise, with `drop_caps`: lock the secure bits so uid 0 gains nothing
//!    on exec, clear the ambient set, empty the bounding set, then zero the
//!    effective/permitted/inheritable sets (the uid stays);
//! 4. with [`ChildSetup::cwd`]: enter the working directory, after the user
//!    switch so the user's own permissions decide whether it may.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// Secure bits set when dropping capabilities: no capabilities for uid 0 on
/// exec, no fixups on setuid, no keep-caps, no ambient raise — all locked.
const SECURE_BITS: libc::c_ulong = (1 << 0) // SECBIT_NOROOT
    | (1 << 1) // SECBIT_NOROOT_LOCKED
    | (1 << 2) // SECBIT_NO_SETUID_FIXUP
    | (1 << 3) // SECBIT_NO_SETUID_FIXUP_LOCKED
    | (1 << 5) // SECBIT_KEEP_CAPS_LOCKED (keep-caps itself stays off)
    | (1 << 6) // SECBIT_NO_CAP_AMBIENT_RAISE
    | (1 << 7); // SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED

/// Secure bits set before a session user's uid change: as [`SECURE_BITS`],
/// except that the setuid fixup stays *on* (locked on): changing every uid
/// from 0 to the user's is what clears the permitted, effective and ambient
/// sets; with `SECBIT_NO_SETUID_FIXUP` they would survive the switch.
const USER_SECURE_BITS: libc::c_ulong = (1 << 0) // SECBIT_NOROOT
    | (1 << 1) // SECBIT_NOROOT_LOCKED
    | (1 << 3) // SECBIT_NO_SETUID_FIXUP_LOCKED (the fixup itself stays on)
    | (1 << 5) // SECBIT_KEEP_CAPS_LOCKED (keep-caps itself stays off)
    | (1 << 6) // SECBIT_NO_CAP_AMBIENT_RAISE
    | (1 << 7); // SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED

/// `_LINUX_CAPABILITY_VERSION_3`: 64-bit capability sets in two u32 words.
const CAP_VERSION_3: u32 = 0x2008_0522;

/// Highest capability number we try to drop from the bounding set; the loop
/// stops early at the first number the kernel does not know (`EINVAL`).
const MAX_CAP: libc::c_ulong = 63;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// The prepared child-side setup of one spawn.
#[derive(Debug, Default)]
pub struct ChildSetup {
    /// `cgroup.procs` of the process's cgroup, opened for writing.
    pub cgroup_procs: Option<OwnedFd>,
    /// The text written to `/proc/self/oom_score_adj` (a decimal number).
    pub oom_score_adj: Option<Vec<u8>>,
    /// Paths to hide (detach) in the child's own mount namespace.
    pub private_paths: Vec<CString>,
    /// Drop every capability before exec.
    pub drop_caps: bool,
    /// Run as this user (and only its group), without capabilities and
    /// with `no_new_privs`. Needs a root parent.
    pub user: Option<Credentials>,
    /// Directory to enter once the ids are final.
    pub cwd: Option<CString>,
}

/// The ids a session's processes run as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub uid: libc::uid_t,
    pub gid: libc::gid_t,
}

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl ChildSetup {
    /// Runs in the child after `fork`. Async-signal-safe: raw syscalls only.
    pub fn apply(&self) -> io::Result<()> {
        if let Some(fd) = &self.cgroup_procs {
            // SAFETY: write of a static byte to a descriptor we own.
            let n = unsafe { libc::write(fd.as_raw_fd(), b"0".as_ptr().cast(), 1) };
            if n != 1 {
                return Err(io::Error::last_os_error());
            }
        }
        if let Some(adj) = &self.oom_score_adj {
            // SAFETY: open/write/close with a static path and a prepared buffer.
            unsafe {
                let fd = libc::open(
                    c"/proc/self/oom_score_adj".as_ptr(),
                    libc::O_WRONLY | libc::O_CLOEXEC,
                );
                if fd >= 0 {
                    libc::write(fd, adj.as_ptr().cast(), adj.len());
                    libc::close(fd);
                }
            }
        }
        if !self.private_paths.is_empty() {
            // SAFETY: raw syscalls with static or prepared NUL-terminated strings.
            unsafe {
                check(libc::unshare(libc::CLONE_NEWNS))?;
                check(libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_SLAVE | libc::MS_REC,
                    std::ptr::null(),
                ))?;
                for path in &self.private_paths {
                    if libc::umount2(path.as_ptr(), libc::MNT_DETACH) == -1 {
                        let err = io::Error::last_os_error();
                        if err.raw_os_error() != Some(libc::ENOENT) {
                            return Err(err);
                        }
                    }
                }
            }
        }
        if let Some(user) = self.user {
            become_user(user)?;
        } else if self.drop_caps {
            drop_all_capabilities()?;
        }
        if let Some(cwd) = &self.cwd {
            // SAFETY: chdir with a NUL-terminated path prepared by the parent.
            check(unsafe { libc::chdir(cwd.as_ptr()) })?;
        }
        Ok(())
    }
}

/// Clears the ambient set and empties the bounding set. Async-signal-safe.
fn drop_ambient_and_bounding() -> io::Result<()> {
    // SAFETY: prctl with plain integer arguments.
    unsafe {
        check(libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        ))?;
        for cap in 0..=MAX_CAP {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) == -1 {
                let err = io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::EINVAL) {
                    break; // past the kernel's last capability
                }
                return Err(err);
            }
        }
    }
    Ok(())
}

/// Zeroes the effective, permitted and inheritable sets. Async-signal-safe.
fn clear_capability_sets() -> io::Result<()> {
    let mut header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset with a valid header and two data words.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    };
    if ret == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Hands the pipes on descriptors 0–2 to `user`. The agent made them as
/// root, and a pipe's inode is its creator's with mode 0600, so reopening
/// one through `/dev/stdout` (`/proc/self/fd/1`) would fail for the user.
/// Only pipes are changed: they were made for this process alone, whereas a
/// terminal or file on these descriptors is not the user's to take.
/// Async-signal-safe.
fn give_stdio_pipes(user: Credentials) -> io::Result<()> {
    for fd in 0..=2 {
        // SAFETY: stat is plain data; all-zero is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat into a valid out-pointer; a closed descriptor is an error.
        if unsafe { libc::fstat(fd, &mut st) } == -1 {
            continue;
        }
        if st.st_mode & libc::S_IFMT == libc::S_IFIFO {
            // SAFETY: fchown of a descriptor of this process.
            check(unsafe { libc::fchown(fd, user.uid, user.gid) })?;
        }
    }
    Ok(())
}

/// Becomes `user` for good. Async-signal-safe: raw system calls only (the
/// libc id wrappers would try to synchronise threads). Order matters:
/// 0. the stdio pipes become the user's ([`give_stdio_pipes`]), while root;
/// 1. supplementary groups = the user's group, then all three gids (needs
///    CAP_SETGID, still held);
/// 2. while still root: clear the ambient set, empty the bounding set and
///    lock the secure bits ([`USER_SECURE_BITS`]: no root magic on exec, no
///    keep-caps, no ambient raise; the setuid fixup on);
/// 3. all three uids: the fixup clears the permitted and effective sets;
/// 4. zero the inheritable set too, and set `no_new_privs` so no setuid or
///    file-capability binary can give anything back.
fn become_user(user: Credentials) -> io::Result<()> {
    give_stdio_pipes(user)?;
    let groups = [user.gid];
    // SAFETY: raw id syscalls with plain integers and a valid one-element array.
    unsafe {
        check_long(libc::syscall(libc::SYS_setgroups, 1usize, groups.as_ptr()))?;
        check_long(libc::syscall(
            libc::SYS_setresgid,
            user.gid,
            user.gid,
            user.gid,
        ))?;
    }
    drop_ambient_and_bounding()?;
    // SAFETY: prctl with plain integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_SECUREBITS, USER_SECURE_BITS, 0, 0, 0) })?;
    // SAFETY: raw id syscall with plain integers.
    check_long(unsafe { libc::syscall(libc::SYS_setresuid, user.uid, user.uid, user.uid) })?;
    clear_capability_sets()?;
    // SAFETY: prctl with plain integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
    Ok(())
}

fn check_long(ret: libc::c_long) -> io::Result<()> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Drops every capability of the calling process for good, keeping its uid.
/// Async-signal-safe.
fn drop_all_capabilities() -> io::Result<()> {
    // SAFETY: prctl with plain integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0) })?;
    drop_ambient_and_bounding()?;
    clear_capability_sets()
}

/// Makes the calling process non-dumpable, so processes it starts cannot
/// reach it through `/proc/<pid>` (`root`, `fd`, `mem`).
pub fn make_self_undumpable() -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    use std::path::Path;
    use std::process::Command;

    /// A uid/gid no account on the test machine has.
    const TEST_ID: u32 = 1_500_000_007;

    /// `key: value` of `/proc/self/status` lines.
    fn field<'a>(status: &'a str, key: &str) -> &'a str {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .unwrap_or_else(|| panic!("no {key} in {status}"))
            .trim()
    }

    fn run_as(user: Credentials, cwd: Option<&Path>, argv: &[&str]) -> std::process::Output {
        let setup = ChildSetup {
            user: Some(user),
            cwd: cwd.map(|c| crate::sys::cstring(c).unwrap()),
            ..ChildSetup::default()
        };
        let mut cmd = Command::new(argv[0]);
        cmd.args(&argv[1..])
            .env_clear()
            .env("PATH", "/usr/bin:/bin");
        // SAFETY: `apply` only makes raw syscalls on prepared data.
        unsafe { cmd.pre_exec(move || setup.apply()) };
        cmd.output().unwrap()
    }

    #[test]
    fn the_oom_score_adjustment_is_raised_before_exec() {
        let setup = ChildSetup {
            oom_score_adj: Some(b"500".to_vec()),
            ..ChildSetup::default()
        };
        let mut cmd = Command::new("cat");
        cmd.arg("/proc/self/oom_score_adj");
        // SAFETY: `apply` only makes raw syscalls on prepared data.
        unsafe { cmd.pre_exec(move || setup.apply()) };
        let out = cmd.output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "500");
        // Without it, the parent's value is inherited.
        let own = std::fs::read_to_string("/proc/self/oom_score_adj").unwrap();
        let out = Command::new("cat")
            .arg("/proc/self/oom_score_adj")
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), own);
    }

    #[test]
    fn a_session_user_has_no_capabilities_and_no_new_privileges() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: switching users needs root");
            return;
        }
        let user = Credentials {
            uid: TEST_ID,
            gid: TEST_ID,
        };
        // `sh` execs `cat`: nothing comes back on either exec.
        let out = run_as(user, None, &["sh", "-c", "cat /proc/self/status"]);
        assert!(out.status.success(), "{out:?}");
        let status = String::from_utf8(out.stdout).unwrap();
        let ids = format!("{TEST_ID}\t{TEST_ID}\t{TEST_ID}\t{TEST_ID}");
        assert_eq!(field(&status, "Uid"), ids);
        assert_eq!(field(&status, "Gid"), ids);
        assert_eq!(field(&status, "Groups"), TEST_ID.to_string());
        for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(
                u64::from_str_radix(field(&status, cap), 16).unwrap(),
                0,
                "{cap}: {status}"
            );
        }
        assert_eq!(field(&status, "NoNewPrivs"), "1");
    }

    #[test]
    fn the_working_directory_is_entered_as_the_user() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: switching users needs root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let private = t.path().join("private");
        std::fs::create_dir(&private).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
        let user = Credentials {
            uid: TEST_ID,
            gid: TEST_ID,
        };
        // Root could enter it; the user cannot, so the spawn fails.
        let err = {
            let setup = ChildSetup {
                user: Some(user),
                cwd: Some(crate::sys::cstring(&private).unwrap()),
                ..ChildSetup::default()
            };
            let mut cmd = Command::new("true");
            // SAFETY: `apply` only makes raw syscalls on prepared data.
            unsafe { cmd.pre_exec(move || setup.apply()) };
            cmd.status().unwrap_err()
        };
        assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
        let out = run_as(user, Some(t.path()), &["pwd"]);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            t.path().display().to_string()
        );
    }
}
