//! Seccomp filters for the threads that touch guest data: one allowlist of
//! system calls per thread class, built from the table in this module with
//! `seccompiler` and installed by each thread on itself before it reads
//! anything the guest wrote.
//!
//! Classes ([`ThreadClass`]): the vCPU threads (`KVM_RUN` and the MMIO/PIO
//! exits, which include the virtio-mmio register file and so device
//! activation), the VMM event loop (waits for the VM's end, then tears it
//! down), the workers of the in-process virtio devices (vsock, blk, rng,
//! balloon; virtio-fs has its own class because it alone needs the file
//! system calls), and the vhost-user servers the QEMU backend runs
//! (protocol socket, guest memory mapped from fds, and every device model
//! behind it; they filter themselves, see `devices::vhost_user`). The
//! daemon's own threads (tokio runtime, agent link, egress proxy) are not
//! filtered: they start processes, open sockets and files on behalf of the
//! client, and never read guest memory (the agent link's frames arrive
//! through a socketpair and are parsed by code with its own limits).
//!
//! Installation: [`Filter::install`] on the thread itself (filters are per
//! thread, no `TSYNC`). A thread created by a filtered thread inherits its
//! filter, so device workers are never created by the (filtered) vCPU thread
//! that activates them, nor vCPUs by the (filtered) event loop:
//! [`spawn_unfiltered`] hands the `clone` to one process-wide spawner thread
//! ([`SPAWNER_THREAD_NAME`], started by [`start_spawner`] before any filter
//! exists, never filtered itself: it only creates threads), and the new
//! thread installs its own class's filter first thing. As a consequence no
//! filtered thread needs `clone`, `execve` or `fork`.
//!
//! What a denied call does: it fails with `EPERM` ([`Mode::On`]); nothing is
//! killed. A denied call in a worker surfaces as an ordinary I/O error: the
//! device logs it and asks the guest driver for a reset, or the VM ends with
//! an error, while the daemon and the user's other profiles keep running.
//! `SECCOMP_RET_KILL_PROCESS` would stop a hijacked thread a few instructions
//! earlier, but a call our table forgot (a new glibc, a distribution
//! kernel's different fallback) would then kill the user's desktop helper
//! with no message; refusing the call costs an attacker nothing they could
//! use (they learn that the call is not allowed) and keeps a missing entry
//! a bug report instead of a crash. [`Mode::Log`] allows everything and has
//! the kernel log each call the table does not allow (`dmesg`, audit type
//! 1326 with the thread name as `comm`): the way to find a missing entry.
//! [`Mode::Off`] installs nothing.
//!
//! Argument filters where the values are known: `ioctl` only with the
//! request codes each class issues (`KVM_RUN` on vCPUs), `mmap`/`mprotect`
//! never with `PROT_EXEC`, `socket`/`socketpair` only `AF_UNIX`, `tgkill`
//! only inside this process, `fcntl` only for dups and fd and status flags.
//!
//! Limits: x86_64 only (the syscall numbers are this architecture's). The
//! threads share one address space: a filter stops a hijacked thread from
//! calling, say, `execve` or `socket(AF_INET)` itself, it is not a boundary
//! against an attacker who can already run arbitrary code and rewrite the
//! memory of unfiltered threads. File system calls of the virtio-fs worker
//! cannot be restricted to the granted folders here (paths are pointers);
//! that is the virtio-fs server's job (its policy and `openat` below the
//! grant roots).

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::str::FromStr;
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use crate::sync::MutexExt;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Name of the process-wide thread that creates device worker threads on
/// behalf of filtered threads (see [`spawn_unfiltered`]).
pub const SPAWNER_THREAD_NAME: &str = "vmm-spawner";

/// `KVM_RUN`: `_IO(KVMIO, 0x80)` with `KVMIO` = 0xAE. The only KVM ioctl
/// a vCPU thread issues once it runs.
const KVM_RUN: u64 = 0xAE80;

/// Whether and how threads are filtered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Calls outside the table fail with `EPERM`.
    #[default]
    On,
    /// No filter at all.
    Off,
    /// Calls outside the table are allowed and logged by the kernel
    /// (finding missing entries).
    Log,
}

impl Mode {
    /// The word the helper's `--seccomp` (`COWORK_SECCOMP`) uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::On => "on",
            Mode::Off => "off",
            Mode::Log => "log",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = SeccompError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "on" | "1" | "true" | "yes" => Ok(Mode::On),
            "off" | "0" | "false" | "no" => Ok(Mode::Off),
            "log" => Ok(Mode::Log),
            _ => Err(SeccompError::BadMode(s.to_string())),
        }
    }
}

/// Errors of building, installing or spawning under filters.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// An unknown `--seccomp` (`COWORK_SECCOMP`) word.
    #[error("unknown seccomp mode {0:?}: use on, off or log")]
    BadMode(String),
    /// seccompiler refused the table (a bug in the table).
    #[error("cannot build the seccomp filter of the {class} threads: {reason}")]
    Build {
        /// Which class.
        class: &'static str,
        /// seccompiler's message.
        reason: String,
    },
    /// The kernel refused the filter.
    #[error(
        "cannot install the seccomp filter of the {class} threads: {reason}; \
         this kernel may lack seccomp filters (run with --seccomp=off or COWORK_SECCOMP=off)"
    )]
    Install {
        /// Which class.
        class: &'static str,
        /// seccompiler's message.
        reason: String,
    },
    /// The spawner thread could not be created or is gone.
    #[error("cannot start the VMM's thread spawner: {0}")]
    Spawner(io::Error),
    /// [`start_spawner`] was called on a filtered thread (the spawner would
    /// inherit the filter).
    #[error("the VMM's thread spawner must be started before any seccomp filter")]
    SpawnerFiltered,
}

/// The kinds of threads that get a filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ThreadClass {
    /// A vCPU thread: `KVM_RUN`, port and MMIO exits (serial console,
    /// virtio-mmio registers, device activation and reset).
    Vcpu,
    /// The VMM event loop: waits for the VM's end, kicks and joins the
    /// vCPUs, stops the devices and closes everything.
    EventLoop,
    /// The worker of an in-process vsock, blk, rng or balloon device.
    DeviceWorker,
    /// The worker of the in-process virtio-fs device (file system calls on
    /// the granted folders).
    FsWorker,
    /// A vhost-user server thread and the threads it creates (QEMU
    /// backend): protocol socket, guest memory mapped from fds, every
    /// device model.
    VhostUser,
}

impl ThreadClass {
    /// Every class.
    pub const ALL: [ThreadClass; 5] = [
        ThreadClass::Vcpu,
        ThreadClass::EventLoop,
        ThreadClass::DeviceWorker,
        ThreadClass::FsWorker,
        ThreadClass::VhostUser,
    ];

    /// Short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            ThreadClass::Vcpu => "vCPU",
            ThreadClass::EventLoop => "VMM event loop",
            ThreadClass::DeviceWorker => "device worker",
            ThreadClass::FsWorker => "virtio-fs worker",
            ThreadClass::VhostUser => "vhost-user",
        }
    }

    /// The groups of the table this class is allowed, in order.
    fn groups(self) -> &'static [&'static [Allow]] {
        match self {
            ThreadClass::Vcpu => &[RUNTIME, VCPU, ACTIVATION],
            ThreadClass::EventLoop => &[RUNTIME, EVENT_LOOP, ACTIVATION, DISK],
            ThreadClass::DeviceWorker => &[RUNTIME, QUEUES, ACTIVATION, DISK, STREAMS],
            ThreadClass::FsWorker => &[RUNTIME, QUEUES, ACTIVATION, FILES],
            ThreadClass::VhostUser => &[
                RUNTIME, QUEUES, ACTIVATION, DISK, STREAMS, FILES, VHOST_USER,
            ],
        }
    }
}

/// Which arguments an allowed call may have.
#[derive(Debug, Clone, Copy)]
enum Only {
    /// Any arguments.
    Any,
    /// Argument `.0` (32 bits) is one of `.1`.
    ArgIn(u8, &'static [u64]),
    /// Argument `.0` (32 bits) has none of the bits `.1`.
    ArgWithout(u8, u64),
    /// Argument `.0` is this process's pid.
    OwnPid(u8),
}

/// One entry of the table: a system call, the arguments it may have, and
/// why the class needs it.
#[derive(Debug, Clone, Copy)]
struct Allow {
    nr: libc::c_long,
    name: &'static str,
    only: Only,
    #[allow(dead_code)] // Read by people; the tests check it is filled in.
    why: &'static str,
}

/// The `fcntl` commands any filtered thread may issue: dups (std's
/// `try_clone` is `F_DUPFD_CLOEXEC`; plain `dup` is allowed anyway), the
/// close-on-exec flag (vmm-sys-util's event pairs) and the status flags
/// (`O_NONBLOCK`; fuse-backend-rs's passthrough re-applies a FUSE open's
/// `O_APPEND`/`O_DIRECT` with `F_SETFL`). Not: record locks (the
/// passthrough answers FUSE lock requests with `ENOSYS` without calling
/// the host), leases and dnotify (a hijacked worker could hold off or watch
/// the user's other programs on a granted file), signal ownership
/// (`F_SETOWN`/`F_SETSIG` would route `SIGIO` at a thread of its choosing),
/// pipe sizes and seals.
const FCNTL_COMMANDS: &[u64] = &[
    libc::F_DUPFD as u64,
    libc::F_DUPFD_CLOEXEC as u64,
    libc::F_GETFD as u64,
    libc::F_SETFD as u64,
    libc::F_GETFL as u64,
    libc::F_SETFL as u64,
];

/// Shorthand for table entries.
macro_rules! allow {
    ($name:ident, $why:expr) => {
        Allow {
            nr: libc::$name,
            name: stringify!($name),
            only: Only::Any,
            why: $why,
        }
    };
    ($name:ident, $only:expr, $why:expr) => {
        Allow {
            nr: libc::$name,
            name: stringify!($name),
            only: $only,
            why: $why,
        }
    };
}

/// Every filtered thread: what Rust's std, glibc and our logging do on any
/// thread.
const RUNTIME: &[Allow] = &[
    allow!(SYS_futex, "mutexes, condition variables, channels, joins"),
    allow!(
        SYS_mmap,
        Only::ArgWithout(2, libc::PROT_EXEC as u64),
        "the allocator's large blocks and arenas; never executable"
    ),
    allow!(
        SYS_mprotect,
        Only::ArgWithout(2, libc::PROT_EXEC as u64),
        "the allocator growing an arena; never executable"
    ),
    allow!(SYS_munmap, "the allocator returning memory"),
    allow!(SYS_mremap, "the allocator growing a large block (realloc)"),
    allow!(SYS_madvise, "the allocator trimming freed pages"),
    allow!(SYS_brk, "the allocator's main heap"),
    allow!(SYS_rt_sigprocmask, "glibc blocks signals around some calls"),
    allow!(
        SYS_rt_sigreturn,
        "return from a signal handler (the vCPU kick signal)"
    ),
    allow!(
        SYS_sigaltstack,
        "std removes its guard stack when the thread ends"
    ),
    allow!(SYS_sched_yield, "spinning locks back off"),
    allow!(
        SYS_sched_getaffinity,
        "glibc and std size per-thread caches"
    ),
    allow!(
        SYS_getrandom,
        "std's HashMap keys (once per thread); virtio-rng"
    ),
    allow!(
        SYS_clock_gettime,
        "Instant/SystemTime when the vDSO falls back"
    ),
    allow!(SYS_clock_nanosleep, "thread::sleep"),
    allow!(SYS_nanosleep, "thread::sleep on older glibc"),
    allow!(SYS_gettimeofday, "log timestamps when the vDSO falls back"),
    allow!(
        SYS_restart_syscall,
        "the kernel restarting a sleep after a signal"
    ),
    allow!(SYS_write, "log lines to stderr; eventfd and socket writes"),
    allow!(SYS_writev, "log lines; socket writes"),
    allow!(SYS_close, "dropping fds (eventfd clones, streams, files)"),
    allow!(SYS_getpid, "abort() and tgkill"),
    allow!(SYS_gettid, "abort() and log thread ids"),
    allow!(
        SYS_tgkill,
        Only::OwnPid(0),
        "abort() on a double panic; kicking vCPUs; only in this process"
    ),
    allow!(SYS_exit, "the thread ends"),
    allow!(
        SYS_exit_group,
        "a fatal error ends the process (no more than a crash could)"
    ),
    allow!(
        SYS_prctl,
        Only::ArgIn(0, &[libc::PR_SET_NAME as u64, libc::PR_GET_NAME as u64]),
        "std names threads"
    ),
];

/// vCPU threads once they run.
const VCPU: &[Allow] = &[
    allow!(
        SYS_ioctl,
        Only::ArgIn(1, &[KVM_RUN, libc::FIONBIO, libc::FIOCLEX]),
        "KVM_RUN; FIONBIO/FIOCLEX when a device activation sets up its fds"
    ),
    allow!(SYS_read, "draining an eventfd on device reset"),
];

/// Device activation and reset: they run on the vCPU that wrote the
/// status register, and again on workers and the event loop.
const ACTIVATION: &[Allow] = &[
    allow!(SYS_eventfd2, "the worker's stop eventfd"),
    allow!(SYS_epoll_create1, "the worker's epoll set"),
    allow!(SYS_epoll_ctl, "registering queue notifiers and streams"),
    allow!(
        SYS_fcntl,
        Only::ArgIn(1, FCNTL_COMMANDS),
        "dup of eventfds (F_DUPFD_CLOEXEC), fd and status flags"
    ),
    allow!(SYS_dup, "cloning an fd"),
    allow!(SYS_timerfd_create, "the vsock muxer's credit/retry timer"),
    allow!(SYS_timerfd_settime, "arming that timer"),
    allow!(SYS_timerfd_gettime, "reading that timer"),
];

/// The VMM event loop.
const EVENT_LOOP: &[Allow] = &[
    allow!(SYS_epoll_wait, "event-manager waits for the exit eventfd"),
    allow!(SYS_epoll_pwait, "same, newer glibc"),
    allow!(SYS_read, "draining the exit eventfd"),
    allow!(
        SYS_ioctl,
        Only::ArgIn(1, &[libc::FIONBIO, libc::FIOCLEX]),
        "devices stopped at teardown adjust their fds"
    ),
    allow!(SYS_flock, "the session disk's lock released at close"),
];

/// Waiting on and serving virtqueues.
const QUEUES: &[Allow] = &[
    allow!(SYS_epoll_wait, "the worker waits for kicks and streams"),
    allow!(SYS_epoll_pwait, "same, newer glibc"),
    allow!(SYS_read, "eventfd counters, stream reads"),
    allow!(SYS_readv, "stream reads into several buffers"),
    allow!(
        SYS_ioctl,
        Only::ArgIn(1, &[libc::FIONBIO, libc::FIOCLEX, libc::FIONREAD]),
        "non-blocking streams and fds, bytes pending on a stream"
    ),
];

/// virtio-blk: reading and writing the disk image.
const DISK: &[Allow] = &[
    allow!(SYS_pread64, "reads at an offset"),
    allow!(SYS_pwrite64, "writes at an offset"),
    allow!(SYS_preadv, "scatter reads"),
    allow!(SYS_pwritev, "gather writes"),
    allow!(SYS_preadv2, "scatter reads, newer std"),
    allow!(SYS_pwritev2, "gather writes, newer std"),
    allow!(SYS_lseek, "image size"),
    allow!(SYS_fsync, "VIRTIO_BLK_T_FLUSH and the final flush"),
    allow!(SYS_fdatasync, "VIRTIO_BLK_T_FLUSH"),
    allow!(SYS_fallocate, "discard and write-zeroes punch holes"),
    allow!(SYS_fstat, "image size"),
    allow!(SYS_statx, "image metadata through std"),
];

/// virtio-vsock: the host side of guest connections (socketpairs, and
/// host unix sockets the device connects to).
const STREAMS: &[Allow] = &[
    allow!(
        SYS_socketpair,
        Only::ArgIn(0, &[libc::AF_UNIX as u64]),
        "a guest connection to a host port"
    ),
    allow!(
        SYS_socket,
        Only::ArgIn(0, &[libc::AF_UNIX as u64]),
        "a guest connection forwarded to a host unix socket; never IP"
    ),
    allow!(SYS_connect, "the same connection"),
    allow!(SYS_sendto, "stream writes"),
    allow!(SYS_recvfrom, "stream reads"),
    allow!(SYS_sendmsg, "stream writes"),
    allow!(SYS_recvmsg, "stream reads"),
    allow!(SYS_shutdown, "a half-closed guest connection"),
    allow!(SYS_getsockopt, "SO_ERROR of a connection"),
    allow!(SYS_setsockopt, "buffer sizes"),
];

/// virtio-fs: the passthrough file system on the granted folders.
const FILES: &[Allow] = &[
    allow!(SYS_openat, "lookups and opens below a grant root"),
    allow!(SYS_openat2, "opens that must not leave the grant"),
    allow!(SYS_open_by_handle_at, "reopening an inode by its handle"),
    allow!(SYS_name_to_handle_at, "an inode's handle and mount id"),
    allow!(SYS_newfstatat, "getattr and lookup"),
    allow!(SYS_fstat, "getattr on an open file"),
    allow!(SYS_statx, "getattr through std"),
    allow!(SYS_fstatfs, "statfs"),
    allow!(SYS_statfs, "statfs on a path"),
    allow!(SYS_getdents64, "readdir"),
    allow!(SYS_lseek, "readdir offsets and SEEK_DATA/SEEK_HOLE"),
    allow!(SYS_read, "reads"),
    allow!(SYS_pread64, "reads at an offset"),
    allow!(SYS_pwrite64, "writes at an offset"),
    allow!(SYS_preadv, "scatter reads into guest buffers"),
    allow!(SYS_pwritev, "gather writes from guest buffers"),
    allow!(SYS_preadv2, "same, newer std"),
    allow!(SYS_pwritev2, "same, newer std"),
    allow!(SYS_fsync, "fsync"),
    allow!(SYS_fdatasync, "fsync with datasync"),
    allow!(SYS_fallocate, "fallocate"),
    allow!(SYS_ftruncate, "setattr size"),
    allow!(SYS_readlinkat, "readlink; resolving /proc/self/fd"),
    allow!(SYS_mkdirat, "mkdir"),
    allow!(SYS_mknodat, "mknod (fifos, sockets)"),
    allow!(SYS_unlinkat, "unlink and rmdir"),
    allow!(SYS_renameat, "rename"),
    allow!(SYS_renameat2, "rename with flags"),
    allow!(SYS_linkat, "link"),
    allow!(SYS_symlinkat, "symlink"),
    allow!(SYS_fchmod, "setattr mode"),
    allow!(SYS_fchmodat, "setattr mode by path"),
    allow!(SYS_fchown, "setattr owner"),
    allow!(SYS_fchownat, "setattr owner by path"),
    allow!(SYS_utimensat, "setattr times"),
    allow!(SYS_faccessat, "access"),
    allow!(SYS_faccessat2, "access, newer glibc"),
    allow!(SYS_fgetxattr, "getxattr"),
    allow!(SYS_fsetxattr, "setxattr"),
    allow!(SYS_flistxattr, "listxattr"),
    allow!(SYS_fremovexattr, "removexattr"),
    allow!(SYS_getxattr, "getxattr by path"),
    allow!(SYS_lgetxattr, "getxattr on a symlink"),
    allow!(SYS_setxattr, "setxattr by path"),
    allow!(SYS_lsetxattr, "setxattr on a symlink"),
    allow!(SYS_listxattr, "listxattr by path"),
    allow!(SYS_llistxattr, "listxattr on a symlink"),
    allow!(SYS_removexattr, "removexattr by path"),
    allow!(SYS_lremovexattr, "removexattr on a symlink"),
    allow!(SYS_flock, "flock"),
    allow!(SYS_copy_file_range, "copy_file_range"),
    allow!(SYS_fadvise64, "readahead hints"),
    allow!(SYS_umask, "creating files with the caller's umask"),
    allow!(SYS_fchdir, "*at calls relative to a directory"),
    allow!(SYS_setresuid, "per-request credentials of the passthrough"),
    allow!(SYS_setresgid, "per-request credentials of the passthrough"),
    allow!(SYS_setfsuid, "per-request credentials of the passthrough"),
    allow!(SYS_setfsgid, "per-request credentials of the passthrough"),
    allow!(SYS_capget, "capability checks of the passthrough"),
    allow!(SYS_capset, "dropping CAP_FSETID for writes"),
    allow!(
        SYS_ioctl,
        Only::ArgIn(1, &[libc::FIONBIO, libc::FIOCLEX]),
        "fd flags; no file ioctls are passed through"
    ),
];

/// vhost-user: the protocol socket and the frontend's memory.
const VHOST_USER: &[Allow] = &[
    allow!(SYS_accept4, "the frontend's connection"),
    allow!(SYS_accept, "the frontend's connection, older std"),
    allow!(
        SYS_recvmsg,
        "protocol messages with fds (memory, kick, call)"
    ),
    allow!(SYS_sendmsg, "protocol replies"),
    allow!(SYS_getsockname, "the listener's address"),
    allow!(SYS_epoll_create1, "vring handler epoll sets"),
    allow!(SYS_memfd_create, "shared log memory"),
    allow!(
        SYS_unlink,
        "the server removes its socket when the frontend leaves"
    ),
];

/// A condition on the 32-bit argument `arg`.
fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, String> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value).map_err(|e| e.to_string())
}

/// The rules of one entry (an empty vector: any arguments).
fn rules_of(only: Only) -> Result<Vec<SeccompRule>, String> {
    let rule = |c: SeccompCondition| SeccompRule::new(vec![c]).map_err(|e| e.to_string());
    match only {
        Only::Any => Ok(Vec::new()),
        Only::ArgIn(arg, values) => values
            .iter()
            .map(|&v| rule(cond(arg, SeccompCmpOp::Eq, v)?))
            .collect(),
        Only::ArgWithout(arg, bits) => Ok(vec![rule(cond(arg, SeccompCmpOp::MaskedEq(bits), 0)?)?]),
        Only::OwnPid(arg) => Ok(vec![rule(cond(
            arg,
            SeccompCmpOp::Eq,
            u64::from(std::process::id()),
        )?)?]),
    }
}

/// The merged rules of `class`: one map entry per system call; a call any
/// group allows unconditionally is unconditional, else the union of the
/// groups' conditions.
fn rule_map(class: ThreadClass) -> Result<BTreeMap<i64, Vec<SeccompRule>>, String> {
    let mut unconditional: BTreeMap<i64, bool> = BTreeMap::new();
    let mut map: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for group in class.groups() {
        for entry in group.iter() {
            let nr: i64 = entry.nr;
            let rules = rules_of(entry.only)?;
            let any = unconditional.entry(nr).or_insert(false);
            if rules.is_empty() {
                *any = true;
            }
            map.entry(nr).or_default().extend(rules);
        }
    }
    for (nr, any) in unconditional {
        if any {
            map.insert(nr, Vec::new());
        }
    }
    Ok(map)
}

/// The system call names `class` may use (sorted, deduplicated): for
/// `doctor` and the tests.
pub fn allowed_syscalls(class: ThreadClass) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = class
        .groups()
        .iter()
        .flat_map(|g| g.iter().map(|a| a.name.trim_start_matches("SYS_")))
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// A compiled filter for one class, ready to install on any thread.
#[derive(Clone)]
pub struct Filter {
    class: ThreadClass,
    mode: Mode,
    program: Arc<BpfProgram>,
}

impl std::fmt::Debug for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filter")
            .field("class", &self.class)
            .field("mode", &self.mode)
            .field("instructions", &self.program.len())
            .finish()
    }
}

/// Compiled filters, by class and mode (built once per process).
type Cache = Mutex<HashMap<(ThreadClass, Mode), Filter>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Filter {
    /// The filter of `class` under `mode`; `None` for [`Mode::Off`].
    pub fn new(class: ThreadClass, mode: Mode) -> Result<Option<Filter>, SeccompError> {
        let mismatch = match mode {
            Mode::Off => return Ok(None),
            Mode::On => SeccompAction::Errno(libc::EPERM as u32),
            Mode::Log => SeccompAction::Log,
        };
        let mut cache = cache().locked();
        if let Some(f) = cache.get(&(class, mode)) {
            return Ok(Some(f.clone()));
        }
        let build = |reason: String| SeccompError::Build {
            class: class.name(),
            reason,
        };
        let arch =
            TargetArch::try_from(std::env::consts::ARCH).map_err(|e| build(e.to_string()))?;
        let filter = SeccompFilter::new(
            rule_map(class).map_err(build)?,
            mismatch,
            SeccompAction::Allow,
            arch,
        )
        .map_err(|e| build(e.to_string()))?;
        let program: BpfProgram = filter
            .try_into()
            .map_err(|e: seccompiler::BackendError| build(e.to_string()))?;
        let f = Filter {
            class,
            mode,
            program: Arc::new(program),
        };
        cache.insert((class, mode), f.clone());
        Ok(Some(f))
    }

    /// Which class this filter is for.
    pub fn class(&self) -> ThreadClass {
        self.class
    }

    /// Installs the filter on the calling thread, for the rest of its life
    /// (and that of threads it creates). Sets the thread's `no_new_privs`.
    pub fn install(&self) -> Result<(), SeccompError> {
        seccompiler::apply_filter(&self.program).map_err(|e| SeccompError::Install {
            class: self.class.name(),
            reason: e.to_string(),
        })?;
        CURRENT.with(|c| c.set(Some((self.class, self.mode))));
        tracing::debug!(
            class = self.class.name(),
            mode = %self.mode,
            instructions = self.program.len(),
            "seccomp filter installed"
        );
        Ok(())
    }
}

thread_local! {
    /// The filter this thread installed through [`Filter::install`].
    static CURRENT: Cell<Option<(ThreadClass, Mode)>> = const { Cell::new(None) };
}

/// The class and mode of the filter the calling thread installed (`None`:
/// unfiltered, as far as this module knows).
pub fn current() -> Option<(ThreadClass, Mode)> {
    CURRENT.with(Cell::get)
}

/// A job for the spawner thread.
type Job = Box<dyn FnOnce() + Send>;

fn spawner() -> &'static Mutex<Option<mpsc::Sender<Job>>> {
    static SPAWNER: OnceLock<Mutex<Option<mpsc::Sender<Job>>>> = OnceLock::new();
    SPAWNER.get_or_init(|| Mutex::new(None))
}

/// Starts the process-wide spawner thread ([`SPAWNER_THREAD_NAME`]) if it
/// does not run yet. Must be called on an unfiltered thread (the spawner
/// would inherit the filter), before the threads that will need it are
/// filtered.
pub fn start_spawner() -> Result<(), SeccompError> {
    let mut slot = spawner().locked();
    if slot.is_some() {
        return Ok(());
    }
    if current().is_some() {
        return Err(SeccompError::SpawnerFiltered);
    }
    let (tx, rx) = mpsc::channel::<Job>();
    std::thread::Builder::new()
        .name(SPAWNER_THREAD_NAME.into())
        .spawn(move || {
            while let Ok(job) = rx.recv() {
                job();
            }
        })
        .map_err(SeccompError::Spawner)?;
    *slot = Some(tx);
    Ok(())
}

/// Spawns `f` on a thread built by `builder` without the calling thread's
/// filter: through the spawner thread when the caller is filtered, directly
/// otherwise. The new thread installs what it needs itself.
pub fn spawn_unfiltered<T: Send + 'static>(
    builder: std::thread::Builder,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<JoinHandle<T>> {
    if current().is_none() {
        return builder.spawn(f);
    }
    let sender = spawner()
        .locked()
        .clone()
        .ok_or_else(|| io::Error::other("the VMM's thread spawner was not started"))?;
    let (tx, rx) = mpsc::sync_channel(1);
    let job: Job = Box::new(move || {
        let _ = tx.send(builder.spawn(f));
    });
    sender
        .send(job)
        .map_err(|_| io::Error::other("the VMM's thread spawner is gone"))?;
    rx.recv()
        .map_err(|_| io::Error::other("the VMM's thread spawner dropped a request"))?
}

#[cfg(test)]
mod tests;
