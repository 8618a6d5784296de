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
//! 1. join the process's own cgroup (write `0` to a pre-opened `cgroup.procs`);
//! 2. with private paths: `unshare(CLONE_NEWNS)`, make `/` recursively a
//!    slave (so later session mounts still propagate in, nothing propagates
//!    out), and detach each private path; a path that does not exist is
//!    skipped, any other failure aborts the spawn;
//! 3. with `drop_caps`: lock the secure bits so uid 0 gains nothing on exec,
//!    clear the ambient set, empty the bounding set, then zero the
//!    effective/permitted/inheritable sets.

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
    /// Paths to hide (detach) in the child's own mount namespace.
    pub private_paths: Vec<CString>,
    /// Drop every capability before exec.
    pub drop_caps: bool,
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
        if self.drop_caps {
            drop_all_capabilities()?;
        }
        Ok(())
    }
}

/// Drops every capability of the calling process for good. Async-signal-safe.
fn drop_all_capabilities() -> io::Result<()> {
    // SAFETY: prctl/capset with plain integer arguments and valid pointers.
    unsafe {
        check(libc::prctl(libc::PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0))?;
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
        let mut header = CapHeader {
            version: CAP_VERSION_3,
            pid: 0,
        };
        let data = [CapData {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        }; 2];
        let ret = libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        );
        if ret == -1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Makes the calling process non-dumpable, so processes it starts cannot
/// reach it through `/proc/<pid>` (`root`, `fd`, `mem`).
pub fn make_self_undumpable() -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })
}
