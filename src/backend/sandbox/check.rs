//! Whether the sandbox can be created here: [`probe`] (for `doctor` and
//! early diagnosis) and the kernel switches that forbid user namespaces
//! ([`HostSwitches`], named in error messages).
//!
//! The probe forks a child that walks the init's namespace steps (user
//! namespace and id maps, mount/pid/ipc/uts namespaces, the network
//! namespace and its `lo` brought up, private propagation, a tmpfs, a fresh
//! `/proc` from a grandchild that is PID 1) and reports the first failing
//! step. A kernel that refuses network namespaces is reported as such
//! ([`SandboxError::NetworkNamespacesUnavailable`]), with the switch or errno
//! that explains it ([`HostSwitches::net_hints`]). The child runs only async-signal-safe system calls, so
//! it is safe to call from a multi-threaded daemon. It does not test
//! `pivot_root` nor the host paths the real root binds.

use std::ffi::CStr;
use std::io::{self, Read};
use std::os::fd::AsRawFd;

use guest_agent::net::{self, LOOPBACK};

use super::sys;
use super::wire::{Failure, Stage};
use super::{error_from_failure, SandboxError};

/// The init's network namespace step, as named in failures (the daemon
/// recognises a refused network namespace by it).
pub const UNSHARE_NET: &str = "unshare(CLONE_NEWNET)";

/// Index of the network namespace step in [`PROBE_STEPS`].
const STEP_NET: usize = 3;

/// The probe's steps in order; the child reports the index of the first that
/// failed (or the length, for none) and its errno.
const PROBE_STEPS: [(Stage, &str); 9] = [
    (Stage::UserNamespace, "unshare(CLONE_NEWUSER)"),
    (
        Stage::IdMap,
        "write /proc/self/setgroups, uid_map and gid_map",
    ),
    (
        Stage::Namespaces,
        "unshare(CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWIPC|CLONE_NEWUTS)",
    ),
    (Stage::Network, UNSHARE_NET),
    (Stage::Network, "bring up lo"),
    (Stage::Namespaces, "make every mount private"),
    (Stage::Root, "mount a tmpfs"),
    (Stage::Fork, "fork a PID 1"),
    (
        Stage::Root,
        "mount a new /proc (needs a fully visible /proc on the host)",
    ),
];

/// Sysctl files that can forbid user namespaces.
const UNPRIVILEGED_USERNS_CLONE: &str = "/proc/sys/kernel/unprivileged_userns_clone";
const APPARMOR_RESTRICT: &str = "/proc/sys/kernel/apparmor_restrict_unprivileged_userns";
const MAX_USER_NAMESPACES: &str = "/proc/sys/user/max_user_namespaces";
const MAX_NET_NAMESPACES: &str = "/proc/sys/user/max_net_namespaces";

/// The host's user namespace switches, as far as they exist.
#[derive(Debug, Clone, Default)]
pub struct HostSwitches {
    pub unprivileged_userns_clone: Option<i64>,
    pub apparmor_restrict: Option<i64>,
    pub max_user_namespaces: Option<i64>,
    pub max_net_namespaces: Option<i64>,
    /// Whether the daemon runs as root (the unprivileged switches do not
    /// apply then).
    pub root: bool,
}

impl HostSwitches {
    pub fn read() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).ok()?.trim().parse().ok();
        Self {
            unprivileged_userns_clone: read(UNPRIVILEGED_USERNS_CLONE),
            apparmor_restrict: read(APPARMOR_RESTRICT),
            max_user_namespaces: read(MAX_USER_NAMESPACES),
            max_net_namespaces: read(MAX_NET_NAMESPACES),
            // SAFETY: geteuid cannot fail.
            root: unsafe { libc::geteuid() } == 0,
        }
    }

    /// AppArmor lets unprivileged processes create user namespaces but
    /// grants them no capabilities there.
    pub fn apparmor_restricts(&self) -> bool {
        !self.root && self.apparmor_restrict == Some(1)
    }

    /// The switches that explain a failure with `errno`, or what the errno
    /// alone suggests when none is set.
    pub fn hints(&self, errno: Option<i32>) -> Vec<String> {
        let mut hints = Vec::new();
        if !self.root && self.unprivileged_userns_clone == Some(0) {
            hints.push("kernel.unprivileged_userns_clone=0".to_string());
        }
        if self.apparmor_restricts() {
            hints.push(
                "kernel.apparmor_restrict_unprivileged_userns=1: AppArmor denies capabilities in \
                 new user namespaces"
                    .to_string(),
            );
        }
        if self.max_user_namespaces == Some(0) {
            hints.push("user.max_user_namespaces=0".to_string());
        }
        if hints.is_empty() {
            let by_errno = match errno {
                Some(libc::ENOSPC) => {
                    "the limit of user namespaces (user.max_user_namespaces) or their nesting \
                     depth is reached"
                }
                Some(libc::EPERM) | Some(libc::EACCES) => {
                    "refused by a seccomp filter or security module (inside a container?)"
                }
                Some(libc::EINVAL) => "the kernel was built without user namespaces",
                _ => "",
            };
            if !by_errno.is_empty() {
                hints.push(by_errno.to_string());
            }
        }
        hints
    }

    /// What explains a refused network namespace (`unshare(CLONE_NEWNET)`
    /// failing with `errno`): the switch when it is 0, else the errno.
    pub fn net_hints(&self, errno: Option<i32>) -> Vec<String> {
        if self.max_net_namespaces == Some(0) {
            return vec!["user.max_net_namespaces=0".to_string()];
        }
        let by_errno = match errno {
            Some(libc::ENOSPC) => {
                "the limit of network namespaces (user.max_net_namespaces) is reached"
            }
            Some(libc::EPERM) | Some(libc::EACCES) => {
                "refused by a seccomp filter or security module (inside a container?)"
            }
            Some(libc::EINVAL) => "the kernel was built without network namespaces",
            _ => return Vec::new(),
        };
        vec![by_errno.to_string()]
    }
}

/// Checks that the sandbox's namespaces can be created here; the error names
/// the step and the cause.
pub fn probe() -> Result<(), SandboxError> {
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    // Everything the child touches is prepared before the fork.
    let uid_map = format!("{uid} {uid} 1");
    let gid_map = format!("{gid} {gid} 1");
    let writes: [(&CStr, &[u8]); 3] = [
        (c"/proc/self/setgroups", b"deny"),
        (c"/proc/self/uid_map", uid_map.as_bytes()),
        (c"/proc/self/gid_map", gid_map.as_bytes()),
    ];
    let io_err = |what| move |source| SandboxError::Io { what, source };
    let mut lo = net::ifreq_for(LOOPBACK).map_err(io_err("name the loopback interface"))?;
    let (read_end, write_end) = sys::pipe().map_err(io_err("create the probe's pipe"))?;

    // SAFETY: the child runs async-signal-safe system calls only, then _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io_err("fork the probe")(io::Error::last_os_error()));
    }
    if pid == 0 {
        drop(read_end);
        let (step, errno) = probe_child(&writes, &mut lo);
        let mut answer = [0u8; 8];
        answer[..4].copy_from_slice(&(step as u32).to_ne_bytes());
        answer[4..].copy_from_slice(&errno.to_ne_bytes());
        // SAFETY: write and _exit are async-signal-safe.
        unsafe {
            libc::write(write_end.as_raw_fd(), answer.as_ptr().cast(), answer.len());
            libc::_exit(0);
        }
    }
    drop(write_end);
    let mut answer = [0u8; 8];
    let read = std::fs::File::from(read_end).read_exact(&mut answer);
    let _ = sys::waitpid(pid);
    read.map_err(io_err("read the probe's answer"))?;

    let step = u32::from_ne_bytes([answer[0], answer[1], answer[2], answer[3]]) as usize;
    let errno = i32::from_ne_bytes([answer[4], answer[5], answer[6], answer[7]]);
    match PROBE_STEPS.get(step) {
        None => Ok(()),
        Some(&(stage, what)) => {
            let failure = Failure {
                stage,
                what: what.to_string(),
                errno: Some(errno),
            };
            Err(error_from_failure(failure, &HostSwitches::read()))
        }
    }
}

fn errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// The forked probe: returns the index of the failed step (or the number of
/// steps) and the errno. Async-signal-safe: system calls on prepared data.
fn probe_child(writes: &[(&CStr, &[u8]); 3], lo: &mut libc::ifreq) -> (usize, i32) {
    // SAFETY: system calls with valid, NUL-terminated, prepared arguments.
    unsafe {
        if libc::unshare(libc::CLONE_NEWUSER) != 0 {
            return (0, errno());
        }
        for (i, (path, content)) in writes.iter().enumerate() {
            let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                // setgroups does not exist before Linux 3.19.
                if i == 0 && errno() == libc::ENOENT {
                    continue;
                }
                return (1, errno());
            }
            let n = libc::write(fd, content.as_ptr().cast(), content.len());
            let write_errno = errno();
            libc::close(fd);
            if n < 0 {
                return (1, write_errno);
            }
        }
        let namespaces =
            libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;
        if libc::unshare(namespaces) != 0 {
            return (2, errno());
        }
        if libc::unshare(libc::CLONE_NEWNET) != 0 {
            return (STEP_NET, errno());
        }
        if let Err(e) = net::set_link_up_raw(lo) {
            return (STEP_NET + 1, e);
        }
        let none = std::ptr::null::<libc::c_char>();
        if libc::mount(
            none,
            c"/".as_ptr(),
            none,
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return (STEP_NET + 2, errno());
        }
        let tmpfs = c"tmpfs".as_ptr();
        if libc::mount(
            tmpfs,
            c"/tmp".as_ptr(),
            tmpfs,
            libc::MS_NOSUID | libc::MS_NODEV,
            std::ptr::null(),
        ) != 0
        {
            return (STEP_NET + 3, errno());
        }
        let pid = libc::fork();
        if pid < 0 {
            return (STEP_NET + 4, errno());
        }
        if pid == 0 {
            let proc_ = c"proc".as_ptr();
            let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
            let status =
                if libc::mount(proc_, c"/tmp".as_ptr(), proc_, flags, std::ptr::null()) == 0 {
                    0
                } else {
                    errno()
                };
            libc::_exit(status);
        }
        let status = match sys::waitpid(pid) {
            Ok(status) => status,
            Err(e) => return (STEP_NET + 4, e.raw_os_error().unwrap_or(libc::EIO)),
        };
        match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
            (true, 0) => (PROBE_STEPS.len(), 0),
            (true, e) => (STEP_NET + 5, e),
            _ => (STEP_NET + 4, libc::EIO),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn switches() -> HostSwitches {
        HostSwitches {
            unprivileged_userns_clone: Some(1),
            apparmor_restrict: Some(0),
            max_user_namespaces: Some(1000),
            max_net_namespaces: Some(1000),
            root: false,
        }
    }

    #[test]
    fn hints_name_the_switch_first() {
        let s = HostSwitches {
            max_user_namespaces: Some(0),
            ..switches()
        };
        assert_eq!(
            s.hints(Some(libc::ENOSPC)),
            vec!["user.max_user_namespaces=0".to_string()]
        );
        let s = HostSwitches {
            unprivileged_userns_clone: Some(0),
            ..switches()
        };
        assert_eq!(
            s.hints(Some(libc::EPERM)),
            vec!["kernel.unprivileged_userns_clone=0".to_string()]
        );
        // Root is not subject to the unprivileged switches.
        let s = HostSwitches {
            unprivileged_userns_clone: Some(0),
            apparmor_restrict: Some(1),
            root: true,
            ..switches()
        };
        assert!(!s.apparmor_restricts());
        assert!(s.hints(Some(libc::EPERM))[0].contains("seccomp"));
    }

    #[test]
    fn net_hints_name_the_switch_or_the_errno() {
        let s = HostSwitches {
            max_net_namespaces: Some(0),
            ..switches()
        };
        assert_eq!(
            s.net_hints(Some(libc::ENOSPC)),
            vec!["user.max_net_namespaces=0".to_string()]
        );
        assert!(switches().net_hints(Some(libc::EINVAL))[0].contains("without network"));
        assert!(switches().net_hints(Some(libc::EPERM))[0].contains("seccomp"));
        assert!(switches().net_hints(None).is_empty());
        // The steps the indices stand for.
        assert_eq!(PROBE_STEPS[STEP_NET], (Stage::Network, UNSHARE_NET));
        assert_eq!(PROBE_STEPS[STEP_NET + 1].0, Stage::Network);
        assert_eq!(PROBE_STEPS[STEP_NET + 5].0, Stage::Root);
    }

    #[test]
    fn hints_fall_back_to_errno() {
        assert!(switches().hints(Some(libc::ENOSPC))[0].contains("limit"));
        assert!(switches().hints(Some(libc::EINVAL))[0].contains("without user namespaces"));
        assert!(switches().hints(None).is_empty());
    }
}
