//! The sandbox's init process: `cowork-helper __sandbox-init <spec>`.
//!
//! Runs single-threaded, before any runtime exists, with the agent link on fd
//! [`AGENT_FD`] and the status pipe on fd [`STATUS_FD`]:
//!
//! 1. arms `PR_SET_PDEATHSIG` (the daemon's death kills it) and joins the
//!    sandbox's cgroup ([`super::cgroup`]; in a systemd scope, its leaf);
//! 2. enters a new user namespace — always, also as root, so the sandbox's
//!    root has no power over the host — mapping only the caller's uid and gid
//!    onto themselves, and sets the resource limits standing in for a
//!    missing cgroup ([`super::limits::Rlimits`]);
//! 3. enters new mount, pid, ipc and uts namespaces, names the host
//!    [`HOSTNAME`], makes every mount private;
//! 4. enters a new network namespace (owned by the new user namespace),
//!    brings its `lo` up (the sandbox's only interface) and gives it a
//!    second loopback address (see [`SECOND_LOOPBACK_ADDR`]);
//! 5. forks PID 1 of the new pid namespace and waits for it, forwarding
//!    SIGTERM, SIGINT and SIGHUP and ending the way it ended;
//! 6. PID 1 builds and enters the root ([`super::rootfs`]), keeps the
//!    capabilities the agent needs for its bind mounts and its relay, DNS stub
//!    and capture, and executes the agent (this same executable, through an
//!    fd opened before `pivot_root`), telling it where the egress socket is
//!    ([`EGRESS_SOCKET_ENV`]), to hide [`EGRESS_DIR`] from what it spawns,
//!    where to give each session a cgroup (`--cgroup-root`, under
//!    [`HOST_ROOT`]) and which `--oom-score-adj` the sessions get.
//!
//! Each step that fails is reported on the status pipe ([`super::wire`]) and
//! on stderr, and the init exits with [`SETUP_FAILED_STATUS`].

use std::convert::Infallible;
use std::fs;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

// The loopback interface with its second address (glibc's `AI_ADDRCONFIG`
// ignores 127.0.0.1, so IPv4-only lookups would answer nothing): the VM's
// init sets up the same, with the same functions.
use guest_agent::net::{self, LOOPBACK, LOOPBACK_ALIAS, SECOND_LOOPBACK_ADDR};
use guest_agent::proto::EGRESS_SOCKET_ENV;

use super::cgroup;
use super::check::UNSHARE_NET;
use super::limits::Rlimits;
use super::rootfs;
use super::sys::{self, CStringArray};
use super::wire::{CgroupSpec, Context, ExecSpec, Failure, InitSpec, Report, Stage};
use super::{
    AGENT_FD, EGRESS_DIR, EGRESS_SOCKET_NAME, HOST_ROOT, INIT_SUBCOMMAND, SETUP_FAILED_STATUS,
    STATUS_FD,
};

/// The sandbox's host name.
pub const HOSTNAME: &str = "cowork-sandbox";

/// Signals the init passes on to PID 1.
const FORWARDED_SIGNALS: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// Capabilities a non-root agent keeps across `execve` (ambient set) so it
/// can make bind mounts and manage session users inside the user namespace
/// (CHOWN, DAC_OVERRIDE, FOWNER, KILL, SETGID, SETUID, SETPCAP, SYS_CHROOT,
/// SYS_ADMIN), and serve sessions in its network namespace: its DNS stub and
/// capture listeners on ports below 1024 (NET_BIND_SERVICE) and the capture
/// route (NET_ADMIN). They are capabilities of the sandbox's user namespace
/// only, over the sandbox's own network namespace only.
const AGENT_CAPS: [u32; 11] = [0, 1, 3, 5, 6, 7, 8, 10, 12, 18, 21];

/// `PATH` inside the sandbox.
const SANDBOX_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `HOME` inside the sandbox.
const SANDBOX_HOME: &str = "/sessions";

/// `LANG` inside the sandbox.
const SANDBOX_LANG: &str = "C.UTF-8";

/// The agent's log filter variable, set from the spec's `log`.
const AGENT_LOG_ENV: &str = "COWORK_LOG";

/// Fixed arguments of the agent, after `argv[0]`.
const AGENT_ARGS: [&str; 8] = [
    "__agent",
    "--connect",
    "fd:3",
    "--sessions-root",
    "/sessions",
    "--private-path",
    HOST_ROOT,
    "--drop-caps",
];

/// Host pid of PID 1, read by the signal forwarder (0: none yet).
static CHILD: AtomicI32 = AtomicI32::new(0);

/// The status pipe (absent when run by hand); writes are best effort.
struct Reporter(Option<OwnedFd>);

impl Reporter {
    fn take() -> Self {
        if !sys::fd_is_open(STATUS_FD) {
            return Self(None);
        }
        // SAFETY: fd 4 is open and was given to us to own by the daemon.
        let fd = unsafe { OwnedFd::from_raw_fd(STATUS_FD) };
        if sys::set_cloexec(fd.as_fd()).is_err() {
            // Not usable as the status pipe: left open as it was found.
            let _ = fd.into_raw_fd();
            return Self(None);
        }
        Self(Some(fd))
    }

    fn send(&self, report: &Report) {
        if let Some(fd) = &self.0 {
            if let Err(e) = sys::write_all(fd.as_fd(), &report.to_line()) {
                tracing::debug!(error = %e, "status pipe write failed");
            }
        }
    }
}

/// See [`super::init_main`]. Logging starts with the spec's filter (the
/// helper's), or the default when the spec is unreadable.
pub fn main(args: Vec<String>) -> i32 {
    let mut reporter = Reporter::take();
    let spec = parse_args(&args);
    crate::logging::init(spec.as_ref().ok().and_then(|s| s.log.as_deref()));
    match spec.and_then(|spec| run(spec, &mut reporter)) {
        Ok(status) => status,
        Err(failure) => fail(&reporter, failure),
    }
}

fn fail(reporter: &Reporter, failure: Failure) -> i32 {
    tracing::error!(stage = %failure.stage, "sandbox setup failed: {failure}");
    reporter.send(&Report::Failed(failure));
    SETUP_FAILED_STATUS
}

/// The spec: the argument after [`INIT_SUBCOMMAND`] (or the first one).
fn parse_args(args: &[String]) -> Result<InitSpec, Failure> {
    let at = args
        .iter()
        .position(|a| a == INIT_SUBCOMMAND)
        .map_or(1, |i| i + 1);
    let bad = |what: String| Failure {
        stage: Stage::Arguments,
        what,
        errno: None,
    };
    let encoded = args
        .get(at)
        .ok_or_else(|| bad(format!("{INIT_SUBCOMMAND} needs its spec argument")))?;
    serde_json::from_str(encoded).map_err(|e| bad(format!("malformed spec: {e}")))
}

fn run(spec: InitSpec, reporter: &mut Reporter) -> Result<i32, Failure> {
    if !sys::fd_is_open(AGENT_FD) {
        return Err(Failure {
            stage: Stage::Arguments,
            what: format!("fd {AGENT_FD} (the agent link) is not open"),
            errno: None,
        });
    }
    cloexec_inherited_fds()?;
    sys::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong)
        .context(Stage::Arguments, || {
            "arm the parent-death signal".to_string()
        })?;
    // SAFETY: getppid cannot fail.
    if unsafe { libc::getppid() } != spec.parent_pid {
        return Err(Failure {
            stage: Stage::Arguments,
            what: format!(
                "the helper (pid {}) exited before the sandbox started",
                spec.parent_pid
            ),
            errno: None,
        });
    }

    // Before anything else runs: whatever the sandbox starts is inside.
    let agent_cgroup = join_cgroup(spec.cgroup.as_ref())?;

    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    sys::unshare(libc::CLONE_NEWUSER).context(Stage::UserNamespace, || {
        "unshare(CLONE_NEWUSER)".to_string()
    })?;
    write_id_maps(uid, gid)?;
    // After entering the user namespace: RLIMIT_NPROC then counts the
    // processes of the sandbox's namespace, not all of the user's.
    set_rlimits(&spec.rlimits)?;
    sys::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS)
        .context(Stage::Namespaces, || {
            "unshare(CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWIPC|CLONE_NEWUTS)".to_string()
        })?;
    // Its own call, so a kernel refusing network namespaces is named as such.
    sys::unshare(libc::CLONE_NEWNET).context(Stage::Network, || UNSHARE_NET.to_string())?;
    net::set_link_up(LOOPBACK).context(Stage::Network, || format!("bring up {LOOPBACK}"))?;
    if let Err(e) = net::add_ipv4_address(LOOPBACK_ALIAS, SECOND_LOOPBACK_ADDR) {
        tracing::warn!(
            error = %e,
            "cannot add {SECOND_LOOPBACK_ADDR} to {LOOPBACK}; IPv4-only name lookups with \
             AI_ADDRCONFIG will fail in the sandbox"
        );
    }
    sys::sethostname(HOSTNAME).context(Stage::Namespaces, || format!("sethostname {HOSTNAME}"))?;
    sys::mount_path(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )
    .context(Stage::Namespaces, || "make every mount private".to_string())?;

    let (alive_r, alive_w) = sys::pipe().context(Stage::Fork, || "pipe".to_string())?;
    let blocked = block_forwarded_signals().context(Stage::Fork, || "block signals".to_string())?;
    install_forwarder().context(Stage::Fork, || "install the signal forwarder".to_string())?;
    // SAFETY: the init is single-threaded, so the child may run any code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let e = std::io::Error::last_os_error();
        return Err(Failure::new(Stage::Fork, "fork PID 1", &e));
    }
    if pid == 0 {
        drop(alive_w);
        let failure = match pid1(
            &spec,
            agent_cgroup.as_deref(),
            uid,
            alive_r,
            &blocked,
            reporter,
        ) {
            Err(f) => f,
            Ok(never) => match never {},
        };
        let status = fail(reporter, failure);
        // SAFETY: leaving the child without running the parent's destructors.
        unsafe { libc::_exit(status) };
    }

    CHILD.store(pid, Ordering::SeqCst);
    restore_signal_mask(&blocked);
    reporter.send(&Report::Forked { pid });
    // Only PID 1 and the agent hold the status pipe and the agent link from
    // now on, so the daemon sees them close when they end.
    reporter.0 = None;
    // SAFETY: fd 3 is ours; nothing else in this process uses it.
    unsafe { libc::close(AGENT_FD) };
    drop(alive_r);

    let status = sys::waitpid(pid).context(Stage::Fork, || format!("wait for PID 1 ({pid})"))?;
    drop(alive_w);
    Ok(end_like(status))
}

/// Marks every inherited descriptor above [`STATUS_FD`] close-on-exec, so
/// nothing the daemon leaked reaches the agent.
fn cloexec_inherited_fds() -> Result<(), Failure> {
    let entries = fs::read_dir("/proc/self/fd")
        .context(Stage::Arguments, || "list /proc/self/fd".to_string())?;
    for entry in entries.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // read_dir's own descriptor is already close-on-exec; entries closed
        // since the listing are skipped.
        if fd > STATUS_FD && sys::fd_is_open(fd) {
            // SAFETY: `fd` was just seen open, and nothing closes it
            // meanwhile (the init is single-threaded).
            let inherited = unsafe { BorrowedFd::borrow_raw(fd) };
            sys::set_cloexec(inherited)
                .context(Stage::Arguments, || format!("mark fd {fd} close-on-exec"))?;
        }
    }
    Ok(())
}

/// `setgroups deny`, then map the caller's uid and gid onto themselves.
fn write_id_maps(uid: libc::uid_t, gid: libc::gid_t) -> Result<(), Failure> {
    match fs::write("/proc/self/setgroups", "deny") {
        // Kernels before 3.19 have no such file and need no denial.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        r => r.context(Stage::IdMap, || "write /proc/self/setgroups".to_string())?,
    }
    fs::write("/proc/self/uid_map", format!("{uid} {uid} 1"))
        .context(Stage::IdMap, || format!("write /proc/self/uid_map ({uid})"))?;
    fs::write("/proc/self/gid_map", format!("{gid} {gid} 1"))
        .context(Stage::IdMap, || format!("write /proc/self/gid_map ({gid})"))
}

/// Joins the sandbox's cgroup (`spec`); returns the host directory under
/// which the agent gives each session a cgroup.
fn join_cgroup(spec: Option<&CgroupSpec>) -> Result<Option<String>, Failure> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    for procs in &spec.join {
        write_existing(Path::new(procs), "0").context(Stage::Limits, || {
            format!("join the sandbox's cgroup (write to {procs})")
        })?;
    }
    let Some(mount) = &spec.leaf_under_own else {
        return Ok(spec.agent_root.clone());
    };
    // A systemd scope: move into its leaf, so the scope can give the
    // memory controller to the sessions' cgroups.
    let own = fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| cgroup::parse_proc_cgroup(&t).v2)
        .ok_or_else(|| Failure {
            stage: Stage::Limits,
            what: "find the sandbox's scope in /proc/self/cgroup (no cgroup v2 line)".to_string(),
            errno: None,
        })?;
    let dir = Path::new(mount).join(own.trim_start_matches('/'));
    let leaf = dir.join(cgroup::INIT_LEAF);
    match fs::create_dir(&leaf) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(Failure::new(
                Stage::Limits,
                format!("create the cgroup {}", leaf.display()),
                &e,
            ))
        }
        _ => {}
    }
    write_existing(&leaf.join("cgroup.procs"), "0").context(Stage::Limits, || {
        format!("move into the cgroup {}", leaf.display())
    })?;
    Ok(Some(dir.to_string_lossy().into_owned()))
}

/// Writes `value` to an existing file (a cgroup control file: never created).
fn write_existing(path: &Path, value: &str) -> std::io::Result<()> {
    use std::io::Write;
    fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(value.as_bytes())
}

/// Sets the stand-in resource limits (soft and hard: nothing inside may
/// raise them again).
fn set_rlimits(r: &Rlimits) -> Result<(), Failure> {
    let set = |resource, value: u64, name: &str| {
        let lim = libc::rlimit {
            rlim_cur: value,
            rlim_max: value,
        };
        // SAFETY: setrlimit with a valid struct.
        sys::cvt(unsafe { libc::setrlimit(resource, &lim) })
            .map(drop)
            .context(Stage::Limits, || format!("set {name} to {value}"))
    };
    if let Some(n) = r.nproc {
        set(libc::RLIMIT_NPROC, n, "RLIMIT_NPROC")?;
    }
    if let Some(d) = r.data {
        set(libc::RLIMIT_DATA, d, "RLIMIT_DATA")?;
    }
    Ok(())
}

/// The agent's arguments for its limits: the cgroup root under which it
/// gives each session a cgroup (a host directory, seen under
/// [`HOST_ROOT`]) and the sessions' OOM score adjustment.
fn limit_args(agent_cgroup: Option<&str>, oom_score_adj: Option<i32>) -> Vec<String> {
    let mut args = Vec::new();
    if let Some(root) = agent_cgroup {
        args.push("--cgroup-root".to_string());
        args.push(super::agent_view_of_host(root));
    }
    if let Some(adj) = oom_score_adj {
        args.push("--oom-score-adj".to_string());
        args.push(adj.to_string());
    }
    args
}

/// PID 1: arms its own parent-death signal, builds the root, executes.
fn pid1(
    spec: &InitSpec,
    agent_cgroup: Option<&str>,
    uid: libc::uid_t,
    alive: OwnedFd,
    blocked: &libc::sigset_t,
    reporter: &Reporter,
) -> Result<Infallible, Failure> {
    sys::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong)
        .context(Stage::Fork, || {
            "arm PID 1's parent-death signal".to_string()
        })?;
    if peer_closed(&alive) {
        return Err(Failure {
            stage: Stage::Fork,
            what: "the sandbox init exited before PID 1 was ready".to_string(),
            errno: None,
        });
    }
    drop(alive);
    reset_signals(blocked);

    let exe = match &spec.exec {
        ExecSpec::Agent { .. } => Some(open_own_executable()?),
        ExecSpec::Command { .. } => None,
    };
    let egress_dir = spec.egress_dir.as_deref().map(Path::new);
    rootfs::build_and_enter(Path::new(&spec.sessions_dir), egress_dir)?;
    if uid != 0 {
        sys::raise_ambient_caps(&AGENT_CAPS).context(Stage::Exec, || {
            "raise the agent's capabilities into the ambient set".to_string()
        })?;
    }

    let argv: Vec<String> = match &spec.exec {
        ExecSpec::Agent { argv0, args } => std::iter::once(argv0.clone())
            .chain(agent_args(egress_dir.is_some()))
            .chain(limit_args(agent_cgroup, spec.session_oom_score_adj))
            .chain(args.iter().cloned())
            .collect(),
        ExecSpec::Command { argv } => argv.clone(),
    };
    let Some(program) = argv.first().cloned() else {
        return Err(Failure {
            stage: Stage::Exec,
            what: "empty command".to_string(),
            errno: None,
        });
    };
    let c_argv = CStringArray::new(&argv).context(Stage::Exec, || "agent arguments".to_string())?;
    let c_env = CStringArray::new(&sandbox_env(egress_dir.is_some(), spec.log.as_deref()))
        .context(Stage::Exec, || "agent environment".to_string())?;

    // The exec closes the pipe (close-on-exec): `exec` then end of file.
    reporter.send(&Report::Exec);
    let err = match &exe {
        Some(fd) => sys::execveat_fd(fd.as_fd(), &c_argv, &c_env),
        None => sys::execve(Path::new(&program), &c_argv, &c_env),
    };
    Err(Failure::new(
        Stage::Exec,
        format!("execute {program}"),
        &err,
    ))
}

/// This executable, opened for `execveat` before `pivot_root` hides it.
/// Read access is not needed to execute a file, so an `O_PATH` descriptor is
/// the fallback when the binary is execute-only.
fn open_own_executable() -> Result<OwnedFd, Failure> {
    let exe = Path::new("/proc/self/exe");
    match sys::open(exe, libc::O_RDONLY) {
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => sys::open(exe, libc::O_PATH),
        r => r,
    }
    .context(Stage::Exec, || {
        "open the helper's own executable".to_string()
    })
}

/// The agent's fixed arguments; with an egress socket, its directory is
/// one more private path.
pub(super) fn agent_args(egress: bool) -> Vec<String> {
    let mut args: Vec<String> = AGENT_ARGS.iter().map(|a| a.to_string()).collect();
    if egress {
        args.extend(["--private-path".to_string(), EGRESS_DIR.to_string()]);
    }
    args
}

/// The agent's environment: a fixed minimal one, its log filter `log` (the
/// helper's, from the spec) as `COWORK_LOG`, and with an egress socket, its
/// path ([`EGRESS_SOCKET_ENV`]). The agent does not pass its own
/// environment on to what it spawns.
fn sandbox_env(egress: bool, log: Option<&str>) -> Vec<String> {
    let mut env = vec![
        format!("PATH={SANDBOX_PATH}"),
        format!("HOME={SANDBOX_HOME}"),
        format!("LANG={SANDBOX_LANG}"),
    ];
    if egress {
        env.push(format!(
            "{EGRESS_SOCKET_ENV}={EGRESS_DIR}/{EGRESS_SOCKET_NAME}"
        ));
    }
    if let Some(filter) = log {
        env.push(format!("{AGENT_LOG_ENV}={filter}"));
    }
    env
}

/// Whether the write end of the pipe `fd` reads from is closed.
fn peer_closed(fd: &OwnedFd) -> bool {
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(fd),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & libc::POLLHUP != 0
}

fn block_forwarded_signals() -> std::io::Result<libc::sigset_t> {
    // SAFETY: sigset operations on local values.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in FORWARDED_SIGNALS {
            libc::sigaddset(&mut set, sig);
        }
        sys::cvt(libc::sigprocmask(libc::SIG_BLOCK, &set, &mut old))?;
        Ok(old)
    }
}

fn restore_signal_mask(old: &libc::sigset_t) {
    // SAFETY: restoring a mask obtained from sigprocmask.
    unsafe { libc::sigprocmask(libc::SIG_SETMASK, old, std::ptr::null_mut()) };
}

extern "C" fn forward(sig: libc::c_int) {
    let pid = CHILD.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(pid, sig) };
    }
}

fn install_forwarder() -> std::io::Result<()> {
    for sig in FORWARDED_SIGNALS {
        set_handler(
            sig,
            forward as extern "C" fn(libc::c_int) as libc::sighandler_t,
        )?;
    }
    Ok(())
}

fn set_handler(sig: libc::c_int, handler: libc::sighandler_t) -> std::io::Result<()> {
    // SAFETY: a zeroed sigaction with a valid handler and empty mask.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        sys::cvt(libc::sigaction(sig, &action, std::ptr::null_mut())).map(drop)
    }
}

/// Gives PID 1 default dispositions (SIGPIPE included: Rust ignores it, and
/// an ignored signal stays ignored across `execve`) and the original mask.
fn reset_signals(mask: &libc::sigset_t) {
    for sig in FORWARDED_SIGNALS.into_iter().chain([libc::SIGPIPE]) {
        if let Err(e) = set_handler(sig, libc::SIG_DFL) {
            tracing::warn!(signal = sig, error = %e, "cannot reset a signal disposition");
        }
    }
    restore_signal_mask(mask);
}

/// Ends the way PID 1 ended: same exit code, or the same signal re-raised
/// (without a core file). Returns only when re-raising did not end us.
fn end_like(status: libc::c_int) -> i32 {
    if libc::WIFEXITED(status) {
        return libc::WEXITSTATUS(status);
    }
    let sig = libc::WTERMSIG(status);
    let no_core = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain calls on our own process.
    unsafe {
        libc::setrlimit(libc::RLIMIT_CORE, &no_core);
        libc::signal(sig, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::kill(libc::getpid(), sig);
    }
    128 + sig
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_is_found_after_the_subcommand() {
        let spec = InitSpec {
            sessions_dir: "/s".into(),
            exec: ExecSpec::Command {
                argv: vec!["/bin/true".into()],
            },
            parent_pid: 1,
            egress_dir: None,
            cgroup: None,
            rlimits: Rlimits::default(),
            session_oom_score_adj: None,
            log: Some("debug".into()),
        };
        let json = serde_json::to_string(&spec).expect("serialize");
        let full = vec![
            "/usr/bin/cowork-helper".to_string(),
            INIT_SUBCOMMAND.to_string(),
            json.clone(),
        ];
        assert_eq!(parse_args(&full).expect("full argv"), spec);
        let bare = vec!["cowork-helper".to_string(), json];
        assert_eq!(parse_args(&bare).expect("bare"), spec);
        let missing = vec!["x".to_string(), INIT_SUBCOMMAND.to_string()];
        assert_eq!(
            parse_args(&missing).map_err(|f| f.stage),
            Err(Stage::Arguments)
        );
        let garbage = vec![
            "x".to_string(),
            INIT_SUBCOMMAND.to_string(),
            "{".to_string(),
        ];
        assert!(parse_args(&garbage).is_err());
    }

    #[test]
    fn environment_is_minimal() {
        let env = sandbox_env(false, Some("debug"));
        assert!(env.contains(&format!("PATH={SANDBOX_PATH}")));
        assert!(env.contains(&"COWORK_LOG=debug".to_string()));
        assert!(!sandbox_env(false, None)
            .iter()
            .any(|kv| kv.starts_with("COWORK_LOG=")));
        assert!(env.contains(&"HOME=/sessions".to_string()));
        assert!(env.contains(&"LANG=C.UTF-8".to_string()));
        assert!(env
            .iter()
            .all(|kv| ["PATH=", "HOME=", "LANG=", "COWORK_LOG="]
                .iter()
                .any(|p| kv.starts_with(p))));
    }

    #[test]
    fn egress_socket_is_for_the_agent_only() {
        let env = sandbox_env(true, None);
        assert!(env.contains(&"COWORK_EGRESS_SOCKET=/.egress/proxy.sock".to_string()));
        assert!(!sandbox_env(false, None)
            .iter()
            .any(|kv| kv.starts_with("COWORK_EGRESS_SOCKET=")));
        let args = agent_args(true);
        assert!(
            args.windows(2)
                .any(|w| w[0] == "--private-path" && w[1] == EGRESS_DIR),
            "{args:?}"
        );
        assert!(args
            .windows(2)
            .any(|w| w[0] == "--private-path" && w[1] == HOST_ROOT));
        assert!(!agent_args(false).iter().any(|a| a == EGRESS_DIR));
    }

    #[test]
    fn exit_codes_pass_through() {
        // Exit status 3 as waitpid encodes it.
        assert_eq!(end_like(3 << 8), 3);
        assert_eq!(end_like(0), 0);
    }
}
