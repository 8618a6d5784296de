//! The namespace sandbox, driven through `cowork_helper::backend::sandbox` with the
//! built `cowork-helper` as its init, and a shell as PID 1 instead of the
//! agent so the view from inside can be observed. The shell writes its
//! findings to fd 3, the agent link, which the test reads from the daemon
//! end.
//!
//! Some checks run in a child copy of this test binary (an `#[ignore]`d
//! "inner" test selected with `--exact --ignored`): as `nobody` to prove the
//! unprivileged path, inside a user namespace whose `max_user_namespaces`
//! (or `max_net_namespaces`) is 0 to prove that a refused namespace is an
//! error naming the cause, as a stand-in daemon that is killed to prove the
//! sandbox dies with it, in a mount namespace whose `/etc/hosts` holds a
//! test name to prove the sandbox does not see it, and alone to count its
//! descriptors across start/stop cycles.
//!
//! Network: the sandbox has only `lo`; a listener on the host's 127.0.0.1
//! is out of reach; the egress proxy's socket is where the environment says,
//! served, and gone with the sandbox.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cowork_helper::backend::sandbox::{
    probe, Sandbox, SandboxConfig, SandboxError, SandboxExit, HOSTNAME,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

/// Bound for anything that should take milliseconds.
const T: Duration = Duration::from_secs(20);

/// uid and gid of `nobody` on Debian-like systems.
const NOBODY: u32 = 65534;

/// Environment of an inner run: its role's input.
const ENV_SESSIONS: &str = "COWORK_SANDBOX_TEST_SESSIONS";
const ENV_MARKER: &str = "COWORK_SANDBOX_TEST_MARKER";
const ENV_SENTINEL: &str = "COWORK_SANDBOX_TEST_SENTINEL";
const ENV_HELPER: &str = "COWORK_SANDBOX_TEST_HELPER";

/// Printed by an inner run whose assertions all passed.
const INNER_OK: &str = "INNER-CHECKS-PASSED";

/// The helper: the built one, or the copy named by [`ENV_HELPER`].
fn helper() -> PathBuf {
    std::env::var_os(ENV_HELPER)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_cowork-helper")))
}

/// Puts `src` into `dir` (a hard link, else a copy), so a user who cannot
/// traverse the checkout can still execute it.
fn reachable_copy(src: &Path, dir: &Path) -> PathBuf {
    let dst = dir.join(src.file_name().expect("a file name"));
    if std::fs::hard_link(src, &dst).is_err() {
        std::fs::copy(src, &dst).expect("copy the binary");
    }
    dst
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn shell_config(sessions: &Path, script: &str) -> SandboxConfig {
    SandboxConfig {
        command_override: Some(vec!["/bin/sh".into(), "-c".into(), script.into()]),
        ..SandboxConfig::new(helper(), sessions)
    }
}

/// A temporary directory in the host's /tmp, owned by `owner` when given.
fn temp_dir(owner: Option<u32>) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("cowork-sbx-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    if let Some(id) = owner {
        std::os::unix::fs::chown(dir.path(), Some(id), Some(id)).expect("chown");
    }
    dir
}

/// Host pid namespace of `pid`, e.g. `pid:[4026532291]`.
fn pid_ns(pid: i32) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// Host pids of processes in the pid namespace `ns`.
fn processes_in(ns: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid_ns(pid).as_deref() == Some(ns))
        .collect()
}

/// Runs the `#[ignore]`d test `name` of this binary in a child process,
/// prepared by `setup`, and asserts it passed.
fn run_inner(name: &str, setup: impl FnOnce(&mut Command)) -> String {
    run_inner_binary(&std::env::current_exe().expect("test binary"), name, setup)
}

/// [`run_inner`] with another copy of this test binary.
fn run_inner_binary(exe: &Path, name: &str, setup: impl FnOnce(&mut Command)) -> String {
    let mut cmd = Command::new(exe);
    cmd.args([
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    setup(&mut cmd);
    let out = cmd.output().expect("run the inner test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "inner test {name} failed ({}):\n{text}",
        out.status
    );
    assert!(
        text.contains(INNER_OK),
        "inner test {name} did not run its checks:\n{text}"
    );
    text
}

/// Reads the whole agent link until the sandbox closes it.
async fn read_link(link: &mut tokio::net::UnixStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(T, link.read_to_end(&mut out))
        .await
        .expect("link closes")
        .expect("read link");
    String::from_utf8_lossy(&out).into_owned()
}

/// The `key=value` lines of a report.
fn fields(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

fn cap_bit(hex: &str, cap: u32) -> bool {
    u64::from_str_radix(hex, 16)
        .map(|v| v & (1 << cap) != 0)
        .unwrap_or(false)
}

/// CAP_SYS_ADMIN's number.
const CAP_SYS_ADMIN: u32 = 21;

/// CAP_NET_ADMIN's number (the agent's capture route).
const CAP_NET_ADMIN: u32 = 12;

/// CAP_NET_BIND_SERVICE's number (the agent's DNS stub on port 53).
const CAP_NET_BIND_SERVICE: u32 = 10;

// ---------------------------------------------------------------- the view

#[test]
fn view_as_the_current_user() {
    let sessions = temp_dir(None);
    let marker = tempfile::Builder::new()
        .prefix("cowork-host-only-")
        .tempfile_in("/tmp")
        .expect("marker");
    run_inner("inner_view", |cmd| {
        cmd.env(ENV_SESSIONS, sessions.path())
            .env(ENV_MARKER, marker.path())
            .env(ENV_SENTINEL, "must-not-leak");
    });
    // SAFETY: geteuid cannot fail.
    check_sessions_write(sessions.path(), unsafe { libc::geteuid() });
}

#[test]
fn view_as_nobody() {
    if !is_root() {
        // Already unprivileged: view_as_the_current_user covers this path.
        eprintln!(
            "not root: cannot switch to nobody; the current-user test is the unprivileged one"
        );
        return;
    }
    let sessions = temp_dir(Some(NOBODY));
    let marker = tempfile::Builder::new()
        .prefix("cowork-host-only-")
        .tempfile_in("/tmp")
        .expect("marker");
    // The checkout may sit below a directory nobody cannot traverse.
    let bin = temp_dir(None);
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let test_exe = reachable_copy(&std::env::current_exe().expect("test binary"), bin.path());
    let helper_exe = reachable_copy(&helper(), bin.path());
    run_inner_binary(&test_exe, "inner_view", |cmd| {
        cmd.env(ENV_HELPER, &helper_exe);
        cmd.env(ENV_SESSIONS, sessions.path())
            .env(ENV_MARKER, marker.path())
            .env(ENV_SENTINEL, "must-not-leak")
            // Not a readable cwd for nobody otherwise.
            .current_dir("/");
        // SAFETY: only async-signal-safe id changes between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setresgid(NOBODY, NOBODY, NOBODY) != 0
                    || libc::setresuid(NOBODY, NOBODY, NOBODY) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
    check_sessions_write(sessions.path(), NOBODY);
}

/// The file the sandbox wrote in /sessions is on the host, owned by the
/// daemon's own uid (ids are mapped onto themselves).
fn check_sessions_write(sessions: &Path, uid: u32) {
    let file = sessions.join("from-sandbox");
    assert_eq!(
        std::fs::read_to_string(&file).expect("written by the sandbox"),
        "hello\n"
    );
    assert_eq!(std::fs::metadata(&file).expect("stat").uid(), uid);
}

/// What the shell reports about its world.
const VIEW_SCRIPT: &str = r#"exec >&3 2>&1
echo "pid=$$"
echo "hostname=$(cat /proc/sys/kernel/hostname)"
echo "uid=$(id -u)"
echo "root=$(ls -A / | tr '\n' ' ')"
ls /proc/1/fd > /tmp/fds & wait $!; echo "fds=$(tr '\n' ' ' < /tmp/fds)"
test -r /usr/bin/env && echo "usr=readable"
touch /usr/cowork-probe 2>/tmp/err; echo "usr_touch=$? $(cat /tmp/err)"
touch /etc/cowork-probe 2>/tmp/err; echo "etc_touch=$? $(cat /tmp/err)"
echo "usr_mount=$(grep ' /usr ' /proc/self/mountinfo | cut -d' ' -f6)"
echo "root_mount=$(grep ' / / ' /proc/self/mountinfo | cut -d' ' -f6)"
if test -e /home; then echo "home=present"; else echo "home=absent"; fi
echo hello > /sessions/from-sandbox && echo "sessions_write=ok"
echo "sessions_shared=$(grep ' /sessions ' /proc/self/mountinfo | grep -c shared:)"
echo private > /tmp/sandbox-private-$$-@TAG@ && echo "tmp_write=ok"
if test -e "/tmp/@MARKER@"; then echo "tmp_marker=visible"; else echo "tmp_marker=absent"; fi
if test -e "/.host/tmp/@MARKER@"; then echo "host_marker=visible"; else echo "host_marker=absent"; fi
echo "procs=$(ls /proc | grep -c '^[0-9]')"
echo x > /dev/null && echo "devnull=ok"
echo "urandom=$(head -c 16 /dev/urandom | wc -c)"
touch /usr/local/bin/claude && echo "usrlocalbin=writable"
echo "cap_eff=$(grep CapEff /proc/self/status | cut -f2)"
echo "cap_amb=$(grep CapAmb /proc/self/status | cut -f2)"
if test -c /dev/pts/ptmx; then echo "devpts=yes"; else echo "devpts=no"; fi
echo "env=$(env | cut -d= -f1 | sort | tr '\n' ' ')"
echo "sentinel=${COWORK_SANDBOX_TEST_SENTINEL:-unset}"
echo "home_env=$HOME"
echo "end=yes"
"#;

#[tokio::test]
#[ignore = "run by view_as_the_current_user and view_as_nobody in a child process"]
async fn inner_view() {
    let sessions =
        PathBuf::from(std::env::var_os(ENV_SESSIONS).expect("sessions dir from the outer test"));
    let marker = PathBuf::from(std::env::var_os(ENV_MARKER).expect("marker from the outer test"));
    let marker_name = marker
        .file_name()
        .and_then(|n| n.to_str())
        .expect("marker name");
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };

    probe().expect("probe succeeds where the sandbox works");

    // A descriptor leaked without close-on-exec must not reach the sandbox.
    let leaked = std::fs::File::open("/dev/null").expect("open");
    // SAFETY: clearing the flags of our own descriptor.
    unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&leaked), libc::F_SETFD, 0) };

    let tag = std::process::id().to_string();
    let script = VIEW_SCRIPT
        .replace("@MARKER@", marker_name)
        .replace("@TAG@", &tag);
    let (mut sandbox, mut link) = Sandbox::start(shell_config(&sessions, &script))
        .await
        .expect("start");
    assert_eq!(sandbox.agent_path_for_host("home/u/p"), "/.host/home/u/p");
    let text = read_link(&mut link).await;
    let exit = tokio::time::timeout(T, sandbox.wait())
        .await
        .expect("sandbox ends");
    assert_eq!(exit, SandboxExit::Exited(0), "{text}");
    let f = fields(&text);
    let get = |k: &str| {
        f.get(k)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("no {k} in:\n{text}"))
    };

    assert_eq!(get("end"), "yes", "{text}");
    assert_eq!(get("pid"), "1", "{text}");
    assert_eq!(get("hostname"), HOSTNAME);
    assert_eq!(get("uid"), uid.to_string(), "same uid inside as outside");

    // Nothing of the host but the listed directories.
    let mut expected: BTreeSet<String> = [".host", "dev", "proc", "run", "sessions", "tmp"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for d in [
        "usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32",
    ] {
        if std::fs::symlink_metadata(Path::new("/").join(d)).is_ok() {
            expected.insert(d.to_string());
        }
    }
    let seen: BTreeSet<String> = get("root").split_whitespace().map(str::to_string).collect();
    assert_eq!(seen, expected, "{text}");
    assert_eq!(get("home"), "absent");
    assert_eq!(
        get("fds"),
        "0 1 2 3",
        "only stdio and the agent link reach PID 1"
    );

    // Read-only system directories, really read-only.
    assert_eq!(get("usr"), "readable");
    for key in ["usr_touch", "etc_touch"] {
        let v = get(key);
        assert!(
            !v.starts_with('0') && v.contains("Read-only file system"),
            "{key}: {v}"
        );
    }
    assert!(get("usr_mount").split(',').any(|o| o == "ro"), "{text}");
    assert!(get("root_mount").split(',').any(|o| o == "ro"), "{text}");
    assert_eq!(get("usrlocalbin"), "writable");

    // Sessions read-write and shared; /tmp writable and private.
    assert_eq!(get("sessions_write"), "ok");
    assert_eq!(get("sessions_shared"), "1", "{text}");
    assert_eq!(get("tmp_write"), "ok");
    assert_eq!(get("tmp_marker"), "absent", "the host's /tmp leaked in");
    assert!(
        !Path::new(&format!("/tmp/sandbox-private-1-{tag}")).exists(),
        "sandbox /tmp leaked out"
    );
    assert_eq!(
        get("host_marker"),
        "visible",
        "/.host must show the host's own /tmp"
    );

    // Own pid namespace and proc; devices.
    let procs: usize = get("procs").parse().expect("count");
    assert!(
        procs < 10,
        "only the sandbox's processes are visible: {procs}"
    );
    assert_eq!(get("devnull"), "ok");
    assert_eq!(get("urandom"), "16");
    assert_eq!(get("devpts"), "yes", "{text}");

    // The agent keeps CAP_SYS_ADMIN (of its user namespace) across exec;
    // a non-root agent through the ambient set.
    // So do the network capabilities of its egress (over the sandbox's
    // own network namespace).
    for cap in [CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_NET_BIND_SERVICE] {
        assert!(cap_bit(get("cap_eff"), cap), "cap {cap}: {text}");
        if uid != 0 {
            assert!(cap_bit(get("cap_amb"), cap), "cap {cap}: {text}");
        }
    }

    // A minimal environment.
    assert_eq!(
        get("sentinel"),
        "unset",
        "the daemon's environment leaked in"
    );
    assert_eq!(get("home_env"), "/sessions");
    let env: BTreeSet<&str> = get("env").split_whitespace().collect();
    for var in ["HOME", "LANG", "PATH"] {
        assert!(env.contains(var), "{var} missing: {text}");
    }
    drop(leaked);
    println!("{INNER_OK}");
}

// ------------------------------------------------------ lifetime and ending

#[tokio::test]
async fn kill_empties_the_pid_namespace_before_returning() {
    let sessions = temp_dir(None);
    let script = "sleep 1000 & sleep 1000 & echo started >&3; wait";
    let (mut sandbox, link) = Sandbox::start(shell_config(sessions.path(), script))
        .await
        .expect("start");
    let mut lines = BufReader::new(link).lines();
    let first = tokio::time::timeout(T, lines.next_line())
        .await
        .expect("line in time")
        .expect("read");
    assert_eq!(first.as_deref(), Some("started"));

    let ns = pid_ns(sandbox.agent_pid()).expect("PID 1 exists");
    assert_ne!(
        pid_ns(std::process::id() as i32).as_deref(),
        Some(ns.as_str()),
        "own pid namespace"
    );
    assert!(processes_in(&ns).len() >= 3, "sh and two sleeps");

    tokio::time::timeout(T, sandbox.kill())
        .await
        .expect("kill returns");
    assert_eq!(
        processes_in(&ns),
        Vec::<i32>::new(),
        "kill returned before the namespace emptied"
    );
    assert_eq!(sandbox.wait().await, SandboxExit::Killed);
    // Idempotent.
    sandbox.kill().await;
    assert_eq!(sandbox.wait().await, SandboxExit::Killed);
    // Every holder of the agent link is gone.
    let eof = tokio::time::timeout(T, lines.next_line())
        .await
        .expect("eof in time")
        .expect("read");
    assert_eq!(eof, None);
}

#[tokio::test]
async fn exit_status_and_signals_are_reported() {
    let sessions = temp_dir(None);
    let (mut sandbox, _link) = Sandbox::start(shell_config(sessions.path(), "exit 7"))
        .await
        .expect("start");
    assert_eq!(
        tokio::time::timeout(T, sandbox.wait()).await.expect("ends"),
        SandboxExit::Exited(7)
    );

    // PID 1 killed from outside by someone else: the init ends the same way.
    let (mut sandbox, mut link) = Sandbox::start(shell_config(
        sessions.path(),
        "echo up >&3; exec sleep 1000",
    ))
    .await
    .expect("start");
    let mut line = String::new();
    let mut reader = tokio::io::BufReader::new(&mut link);
    tokio::time::timeout(T, reader.read_line(&mut line))
        .await
        .expect("line")
        .expect("read");
    assert_eq!(line, "up\n");
    // SAFETY: signalling the sandbox's PID 1, alive (it just wrote).
    assert_eq!(unsafe { libc::kill(sandbox.agent_pid(), libc::SIGKILL) }, 0);
    let exit = tokio::time::timeout(T, sandbox.wait()).await.expect("ends");
    assert_eq!(exit, SandboxExit::Signaled(libc::SIGKILL));
    assert_eq!(exit.to_string(), "the agent was killed by SIGKILL");
}

#[tokio::test]
async fn sigterm_to_the_init_is_forwarded_to_pid1() {
    let sessions = temp_dir(None);
    let script =
        "trap 'echo got-term >&3; exit 3' TERM; echo ready >&3; while :; do sleep 0.05; done";
    let (mut sandbox, link) = Sandbox::start(shell_config(sessions.path(), script))
        .await
        .expect("start");
    let mut lines = BufReader::new(link).lines();
    let ready = tokio::time::timeout(T, lines.next_line())
        .await
        .expect("line")
        .expect("read");
    assert_eq!(ready.as_deref(), Some("ready"));
    // SAFETY: signalling our own child, not yet reaped.
    assert_eq!(
        // SAFETY: kill takes no pointers; the pid is the sandbox's init.
        unsafe { libc::kill(sandbox.init_pid() as i32, libc::SIGTERM) },
        0
    );
    let got = tokio::time::timeout(T, lines.next_line())
        .await
        .expect("line")
        .expect("read");
    assert_eq!(got.as_deref(), Some("got-term"));
    assert_eq!(
        tokio::time::timeout(T, sandbox.wait()).await.expect("ends"),
        SandboxExit::Exited(3)
    );
}

#[test]
fn the_sandbox_dies_with_its_daemon() {
    let sessions = temp_dir(None);
    let exe = std::env::current_exe().expect("test binary");
    let mut daemon = KillOnDrop(
        Command::new(exe)
            .args([
                "--exact",
                "inner_daemon",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_SESSIONS, sessions.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the stand-in daemon"),
    );
    let stdout = daemon.0.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok) {
            // libtest prints "test inner_daemon ... " before it, unterminated.
            if let Some((_, pid)) = line.split_once("AGENT_PID=") {
                let _ = tx.send(pid.trim().parse::<i32>());
            }
        }
    });
    let agent_pid = rx
        .recv_timeout(T)
        .expect("the stand-in started a sandbox")
        .expect("a pid");
    let ns = pid_ns(agent_pid).expect("PID 1 exists");
    assert!(processes_in(&ns).len() >= 3, "sh and two sleeps");

    daemon.0.kill().expect("SIGKILL the stand-in daemon");
    daemon.0.wait().expect("reap it");
    let deadline = Instant::now() + T;
    while !processes_in(&ns).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        processes_in(&ns),
        Vec::<i32>::new(),
        "sandbox processes outlived the daemon"
    );
}

/// A child process killed (and reaped) when the test ends, passed or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
#[ignore = "run by the_sandbox_dies_with_its_daemon in a child process"]
async fn inner_daemon() {
    let sessions =
        PathBuf::from(std::env::var_os(ENV_SESSIONS).expect("sessions dir from the outer test"));
    let script = "sleep 1000 & sleep 1000 & echo started >&3; wait";
    let (sandbox, link) = Sandbox::start(shell_config(&sessions, script))
        .await
        .expect("start");
    let mut lines = BufReader::new(link).lines();
    let first = tokio::time::timeout(T, lines.next_line())
        .await
        .expect("line")
        .expect("read");
    assert_eq!(first.as_deref(), Some("started"));
    println!("AGENT_PID={}", sandbox.agent_pid());
    // Until the outer test kills this process.
    tokio::time::sleep(Duration::from_secs(3600)).await;
    drop(sandbox);
}

// ---------------------------------------------------------------- failures

#[test]
fn refused_user_namespaces_fail_start_with_the_cause() {
    // Inside a user namespace whose max_user_namespaces is 0, the init's own
    // unshare(CLONE_NEWUSER) fails with ENOSPC.
    let exe = std::env::current_exe().expect("test binary");
    let text = run_inner("inner_userns_refused", |cmd| {
        let inner = std::mem::replace(cmd, Command::new("unshare"));
        let args: Vec<_> = inner.get_args().map(|a| a.to_owned()).collect();
        cmd.args([
            "-Ur",
            "sh",
            "-c",
            "echo 0 > /proc/sys/user/max_user_namespaces && exec \"$0\" \"$@\"",
        ])
        .arg(&exe)
        .args(args);
    });
    assert!(text.contains("user.max_user_namespaces=0"), "{text}");
}

#[tokio::test]
#[ignore = "run by refused_user_namespaces_fail_start_with_the_cause in a child process"]
async fn inner_userns_refused() {
    let sessions = temp_dir(None);
    let started = Instant::now();
    let result = tokio::time::timeout(T, Sandbox::start(shell_config(sessions.path(), "exit 0")))
        .await
        .expect("start fails fast instead of hanging");
    let err = match result {
        Err(e) => e,
        Ok(_) => panic!("start succeeded without user namespaces"),
    };
    let text = err.to_string();
    println!("start error: {text}");
    assert!(
        matches!(err, SandboxError::UserNamespacesUnavailable { .. }),
        "{text}"
    );
    assert!(text.contains("unshare(CLONE_NEWUSER)"), "{text}");
    assert!(text.contains("user.max_user_namespaces=0"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );

    let probed = probe().expect_err("probe must fail too");
    assert!(
        matches!(probed, SandboxError::UserNamespacesUnavailable { .. }),
        "{probed}"
    );
    assert!(
        probed.to_string().contains("user.max_user_namespaces=0"),
        "{probed}"
    );
    println!("{INNER_OK}");
}

#[tokio::test]
async fn a_missing_sessions_dir_fails_start_with_the_step() {
    let err = match Sandbox::start(shell_config(
        Path::new("/nonexistent/cowork-sessions"),
        "exit 0",
    ))
    .await
    {
        Err(e) => e,
        Ok(_) => panic!("started without a sessions directory"),
    };
    let text = err.to_string();
    assert!(matches!(err, SandboxError::Setup { .. }), "{text}");
    assert!(text.contains("building the sandbox root"), "{text}");
    assert!(
        text.contains("/nonexistent/cowork-sessions") && text.contains("No such file"),
        "{text}"
    );
}

#[tokio::test]
async fn a_helper_without_the_init_entry_is_an_error_not_a_hang() {
    let sessions = temp_dir(None);
    let cfg = SandboxConfig {
        helper_exe: "/bin/true".into(),
        ..shell_config(sessions.path(), "exit 0")
    };
    let err = match tokio::time::timeout(T, Sandbox::start(cfg))
        .await
        .expect("no hang")
    {
        Err(e) => e,
        Ok(_) => panic!("/bin/true cannot start a sandbox"),
    };
    assert!(matches!(err, SandboxError::EarlyExit { .. }), "{err}");
    assert!(err.to_string().contains("/bin/true"), "{err}");
}

#[tokio::test]
async fn a_missing_command_fails_start_at_exec() {
    let sessions = temp_dir(None);
    let cfg = SandboxConfig {
        command_override: Some(vec!["/no/such/program".into()]),
        ..SandboxConfig::new(helper(), sessions.path())
    };
    let err = match Sandbox::start(cfg).await {
        Err(e) => e,
        Ok(_) => panic!("started a missing program"),
    };
    let text = err.to_string();
    assert!(
        text.contains("executing the agent") && text.contains("/no/such/program"),
        "{text}"
    );
}

// ------------------------------------------------------------- agent mode

#[tokio::test]
async fn agent_mode_runs_the_helper_as_agent_and_says_hello() {
    use guest_agent::proto::{decode, AgentMessage, MAX_MESSAGE, PROTOCOL_VERSION};
    let sessions = temp_dir(None);
    // No override: the init executes its own binary as `__agent --connect fd:3 ...`.
    let (mut sandbox, mut link) = Sandbox::start(SandboxConfig::new(helper(), sessions.path()))
        .await
        .expect("start");
    let mut body = Vec::new();
    let got = tokio::time::timeout(
        T,
        guest_agent::framing::read_frame(&mut link, MAX_MESSAGE, &mut body),
    )
    .await
    .expect("hello in time")
    .expect("a frame");
    assert!(got, "the agent closed the link without a hello");
    let msg = decode::<AgentMessage>(body).expect("a message").header;
    match msg {
        AgentMessage::Hello(hello) => {
            assert_eq!(hello.protocol, PROTOCOL_VERSION);
            assert!(hello.is_init, "the agent is PID 1 of the sandbox");
        }
        other => panic!("first message is not a hello: {other:?}"),
    }
    sandbox.kill().await;
    assert_eq!(sandbox.wait().await, SandboxExit::Killed);
}

// ----------------------------------------------------- network and egress

/// A sandbox whose PID 1 is a shell, with the daemon's egress proxy served
/// on its socket (as the sandbox backend starts it).
fn egress_shell_config(sessions: &Path, script: &str) -> SandboxConfig {
    SandboxConfig {
        egress: Some(cowork_helper::egress::EgressProxy::direct()),
        ..shell_config(sessions, script)
    }
}

/// What PID 1 (in the agent's place) sees of the network and the egress
/// socket. `@PORT@`: a TCP listener on the host's 127.0.0.1.
const NET_SCRIPT: &str = r#"exec >&3 2>&1
echo "ifaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ' ')"
echo "addrs=$(ip -o -4 addr show dev lo | awk '{print $4}' | tr '\n' ' ')"
echo "v4_lookup=$(getent ahostsv4 localhost | head -n 1 | cut -d' ' -f1)"
bash -c 'exec 5<>/dev/tcp/127.0.0.1/@PORT@' 2>/tmp/err; echo "host_tcp=$? $(tr '\n' ' ' < /tmp/err)"
if command -v python3 >/dev/null; then
  echo "abstract=$(python3 -c 'import socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(b"\0@ABSTRACT@"); print("connected")
except OSError as e:
    print(e.errno)')"
else echo "abstract=no-python"; fi
echo "egress_env=${COWORK_EGRESS_SOCKET:-unset}"
test -S "$COWORK_EGRESS_SOCKET" && echo "egress_socket=yes"
echo "egress_http=$(curl -s -o /dev/null -w '%{http_code}' --unix-socket "$COWORK_EGRESS_SOCKET" http://example.invalid/)"
echo "egress_dir=$(ls -A /.egress | tr '\n' ' ')"
echo "hosts=$(grep -v '^#' /etc/hosts | tr '\n' ';')"
echo "resolv=$(grep -v '^#' /etc/resolv.conf | tr '\n' ';')"
echo "end=yes"
"#;

#[tokio::test]
async fn network_is_loopback_only_and_the_egress_socket_reaches_pid1() {
    check_network_view(temp_dir(None).path()).await;
}

#[test]
fn network_and_egress_socket_as_nobody() {
    if !is_root() {
        eprintln!(
            "not root: cannot switch to nobody; the current-user test is the unprivileged one"
        );
        return;
    }
    let sessions = temp_dir(Some(NOBODY));
    let bin = temp_dir(None);
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let test_exe = reachable_copy(&std::env::current_exe().expect("test binary"), bin.path());
    let helper_exe = reachable_copy(&helper(), bin.path());
    run_inner_binary(&test_exe, "inner_network_view", |cmd| {
        cmd.env(ENV_HELPER, &helper_exe)
            .env(ENV_SESSIONS, sessions.path())
            // Neither root's runtime directory nor a cwd nobody can read.
            .env_remove("XDG_RUNTIME_DIR")
            .env("TMPDIR", "/tmp")
            .current_dir("/");
        // SAFETY: only async-signal-safe id changes between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setresgid(NOBODY, NOBODY, NOBODY) != 0
                    || libc::setresuid(NOBODY, NOBODY, NOBODY) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
}

#[tokio::test]
#[ignore = "run by network_and_egress_socket_as_nobody in a child process"]
async fn inner_network_view() {
    let sessions =
        PathBuf::from(std::env::var_os(ENV_SESSIONS).expect("sessions dir from the outer test"));
    check_network_view(&sessions).await;
    println!("{INNER_OK}");
}

/// Starts a sandbox with an egress socket and a shell as PID 1, and checks
/// its network, its names and the socket, before and after its end.
async fn check_network_view(sessions: &Path) {
    // A service on the host's loopback, reachable from the host.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = listener.local_addr().expect("addr").port();
    let _probe = std::net::TcpStream::connect(("127.0.0.1", port))
        .expect("the host reaches its own listener");
    listener.accept().expect("the host's own connection");

    // A service on a host abstract unix socket (scoped by network namespace).
    let abstract_name = format!("cowork-abstract-probe-{}-{port}", std::process::id());
    let abstract_addr = {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
            .expect("abstract address")
    };
    let abstract_listener =
        std::os::unix::net::UnixListener::bind_addr(&abstract_addr).expect("bind abstract");
    std::os::unix::net::UnixStream::connect_addr(&abstract_addr)
        .expect("the host reaches its own abstract socket");
    abstract_listener
        .accept()
        .expect("the host's own connection");

    let script = NET_SCRIPT
        .replace("@PORT@", &port.to_string())
        .replace("@ABSTRACT@", &abstract_name);
    let (mut sandbox, mut link) = Sandbox::start(egress_shell_config(sessions, &script))
        .await
        .expect("start");
    let socket = sandbox.egress_socket().expect("an egress socket");
    let run_dir = socket.parent().expect("run dir").to_path_buf();
    let mode = std::fs::metadata(&run_dir).expect("run dir").mode() & 0o777;
    assert_eq!(mode, 0o700, "{}", run_dir.display());
    let mode = std::fs::metadata(&socket).expect("socket").mode() & 0o777;
    assert_eq!(mode, 0o600, "{}", socket.display());

    let text = read_link(&mut link).await;
    let exit = tokio::time::timeout(T, sandbox.wait())
        .await
        .expect("sandbox ends");
    assert_eq!(exit, SandboxExit::Exited(0), "{text}");
    let f = fields(&text);
    let get = |k: &str| {
        f.get(k)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("no {k} in:\n{text}"))
    };
    assert_eq!(get("end"), "yes", "{text}");

    // Loopback only, and up: a connection to 127.0.0.1 is refused there
    // (not unreachable), and the host's listener is not behind it.
    assert_eq!(get("ifaces"), "lo", "{text}");
    match get("abstract") {
        "no-python" => eprintln!("no python3 here: the abstract socket check did not run"),
        v => assert_eq!(v, libc::ECONNREFUSED.to_string(), "{text}"),
    }
    // A second loopback address, so IPv4-only lookups with AI_ADDRCONFIG work.
    assert_eq!(get("addrs"), "127.0.0.1/8 127.0.0.2/8", "{text}");
    assert_eq!(get("v4_lookup"), "127.0.0.1", "{text}");
    let tcp = get("host_tcp");
    assert!(
        !tcp.starts_with('0'),
        "the host's loopback is reachable: {text}"
    );
    assert!(tcp.contains("Connection refused"), "{text}");
    listener.set_nonblocking(true).expect("nonblocking");
    assert!(
        listener.accept().is_err(),
        "a connection from the sandbox reached the host's listener"
    );

    // The egress socket: named in the environment, served by the proxy
    // (an origin-form request is answered 400).
    assert_eq!(get("egress_env"), "/.egress/proxy.sock");
    assert_eq!(get("egress_socket"), "yes", "{text}");
    assert_eq!(get("egress_http"), "400", "{text}");
    assert_eq!(get("egress_dir"), "proxy.sock", "{text}");

    // The sandbox's own names.
    assert_eq!(
        get("hosts"),
        "127.0.0.1\tlocalhost cowork-sandbox;::1\tlocalhost ip6-localhost ip6-loopback;",
        "{text}"
    );
    assert_eq!(get("resolv"), "nameserver 127.0.0.1;", "{text}");

    // The end of the sandbox took the socket and its directory away.
    assert!(!socket.exists(), "{} left behind", socket.display());
    assert!(!run_dir.exists(), "{} left behind", run_dir.display());
}

#[tokio::test]
async fn without_a_proxy_there_is_no_egress_socket() {
    let sessions = temp_dir(None);
    let script = r#"exec >&3 2>&1
echo "env=${COWORK_EGRESS_SOCKET:-unset}"
test -e /.egress && echo "dir=present" || echo "dir=absent"
echo "ifaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ' ')"
"#;
    let (mut sandbox, mut link) = Sandbox::start(shell_config(sessions.path(), script))
        .await
        .expect("start");
    assert_eq!(sandbox.egress_socket(), None);
    let text = read_link(&mut link).await;
    assert_eq!(sandbox.wait().await, SandboxExit::Exited(0), "{text}");
    let f = fields(&text);
    assert_eq!(f.get("env").map(String::as_str), Some("unset"), "{text}");
    assert_eq!(f.get("dir").map(String::as_str), Some("absent"), "{text}");
    assert_eq!(f.get("ifaces").map(String::as_str), Some("lo"), "{text}");
}

/// A name only the host's `/etc/hosts` has (bound there by
/// [`host_names_stay_on_the_host`] in a private mount namespace).
const HOST_ONLY_NAME: &str = "cowork-host-only-name.test";

#[test]
fn host_names_stay_on_the_host() {
    let dir = temp_dir(None);
    let hosts = dir.path().join("hosts");
    std::fs::write(
        &hosts,
        format!("127.0.0.1 localhost\n10.1.2.3 {HOST_ONLY_NAME}\n"),
    )
    .expect("write hosts");
    let exe = std::env::current_exe().expect("test binary");
    // Root binds the file over /etc/hosts in a mount namespace of its own;
    // anyone else does so as root of a user namespace of its own.
    let unshare_flags = if is_root() { "-m" } else { "-rm" };
    run_inner("inner_host_names", |cmd| {
        let inner = std::mem::replace(cmd, Command::new("unshare"));
        let args: Vec<_> = inner.get_args().map(|a| a.to_owned()).collect();
        cmd.args([
            unshare_flags,
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount --bind \"$0\" /etc/hosts && exec \"$@\"",
        ])
        .arg(&hosts)
        .arg(&exe)
        .args(args);
    });
}

#[tokio::test]
#[ignore = "run by host_names_stay_on_the_host in a child process"]
async fn inner_host_names() {
    let host_hosts = std::fs::read_to_string("/etc/hosts").expect("read /etc/hosts");
    assert!(
        host_hosts.contains(HOST_ONLY_NAME),
        "the outer test's hosts file is not bound:\n{host_hosts}"
    );
    let sessions = temp_dir(None);
    let script = "exec >&3 2>&1; cat /etc/hosts; \
                  echo \"sandbox_name=$(getent ahostsv4 cowork-sandbox | head -n 1)\"; \
                  echo \"host_name=$(getent hosts cowork-host-only-name.test || echo none)\"; \
                  echo end";
    let (mut sandbox, mut link) = Sandbox::start(shell_config(sessions.path(), script))
        .await
        .expect("start");
    let text = read_link(&mut link).await;
    assert_eq!(sandbox.wait().await, SandboxExit::Exited(0), "{text}");
    assert!(text.ends_with("end\n"), "{text}");
    assert!(
        !text.contains(HOST_ONLY_NAME),
        "the host's names leaked in:\n{text}"
    );
    let f = fields(&text);
    assert!(
        f.get("sandbox_name")
            .is_some_and(|v| v.starts_with("127.0.0.1 ")),
        "{text}"
    );
    assert_eq!(
        f.get("host_name").map(String::as_str),
        Some("none"),
        "{text}"
    );
    println!("{INNER_OK}");
}

#[test]
fn refused_network_namespaces_fail_start_with_the_cause() {
    // Inside a user namespace whose max_net_namespaces is 0, the init's
    // unshare(CLONE_NEWNET) fails with ENOSPC.
    let exe = std::env::current_exe().expect("test binary");
    let text = run_inner("inner_netns_refused", |cmd| {
        let inner = std::mem::replace(cmd, Command::new("unshare"));
        let args: Vec<_> = inner.get_args().map(|a| a.to_owned()).collect();
        cmd.args([
            "-Ur",
            "sh",
            "-c",
            "echo 0 > /proc/sys/user/max_net_namespaces && exec \"$0\" \"$@\"",
        ])
        .arg(&exe)
        .args(args);
    });
    assert!(text.contains("user.max_net_namespaces=0"), "{text}");
}

#[tokio::test]
#[ignore = "run by refused_network_namespaces_fail_start_with_the_cause in a child process"]
async fn inner_netns_refused() {
    let sessions = temp_dir(None);
    let result = tokio::time::timeout(
        T,
        Sandbox::start(egress_shell_config(sessions.path(), "exit 0")),
    )
    .await
    .expect("start fails fast instead of hanging");
    let err = match result {
        Err(e) => e,
        Ok(_) => panic!("start succeeded without network namespaces"),
    };
    let text = err.to_string();
    println!("start error: {text}");
    assert!(
        matches!(err, SandboxError::NetworkNamespacesUnavailable { .. }),
        "{text}"
    );
    assert!(text.contains("unshare(CLONE_NEWNET)"), "{text}");
    assert!(text.contains("user.max_net_namespaces=0"), "{text}");
    // The failed start left no run directory behind.
    assert_eq!(run_dirs_of(std::process::id()), Vec::<PathBuf>::new());

    let probed = probe().expect_err("probe must fail too");
    assert!(
        matches!(probed, SandboxError::NetworkNamespacesUnavailable { .. }),
        "{probed}"
    );
    assert!(
        probed.to_string().contains("user.max_net_namespaces=0"),
        "{probed}"
    );
    println!("{INNER_OK}");
}

/// The sandbox run directories of the daemon `pid`, wherever they may be.
fn run_dirs_of(pid: u32) -> Vec<PathBuf> {
    let prefix = format!("cowork-sandbox-{pid}-");
    let mut bases = vec![std::env::temp_dir(), PathBuf::from("/tmp")];
    bases.extend(std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from));
    let mut found: Vec<PathBuf> = bases
        .iter()
        .filter_map(|b| std::fs::read_dir(b).ok())
        .flat_map(|entries| entries.flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    found.sort();
    found.dedup();
    found
}

/// Open descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn start_stop_cycles_leak_no_descriptor_nor_socket() {
    run_inner("inner_cycles", |_| {});
}

#[tokio::test]
#[ignore = "run by start_stop_cycles_leak_no_descriptor_nor_socket in a child process"]
async fn inner_cycles() {
    let sessions = temp_dir(None);
    let script = "echo up >&3; exec sleep 1000";
    let cycle = |sessions: PathBuf| async move {
        let (mut sandbox, link) = Sandbox::start(egress_shell_config(&sessions, script))
            .await
            .expect("start");
        let mut lines = BufReader::new(link).lines();
        let up = tokio::time::timeout(T, lines.next_line())
            .await
            .expect("line")
            .expect("read");
        assert_eq!(up.as_deref(), Some("up"));
        let socket = sandbox.egress_socket().expect("socket");
        assert!(socket.exists());
        tokio::net::UnixStream::connect(&socket)
            .await
            .expect("the proxy accepts");
        sandbox.kill().await;
        assert!(!socket.exists(), "socket left after kill");
    };
    // The first start opens what the runtime keeps (signal pipe, ...).
    cycle(sessions.path().to_path_buf()).await;
    let before = open_fds();
    for _ in 0..5 {
        cycle(sessions.path().to_path_buf()).await;
    }
    // Serving tasks of accepted connections end as their peers close.
    let deadline = Instant::now() + T;
    while open_fds() > before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(open_fds(), before, "descriptors leaked across cycles");
    assert_eq!(run_dirs_of(std::process::id()), Vec::<PathBuf>::new());
    println!("{INNER_OK}");
}
