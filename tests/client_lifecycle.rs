//! The client's lifecycle, end to end: the built helper started the way the
//! desktop client starts it (`<helper> -socket
//! $XDG_RUNTIME_DIR/claude-cowork-vm.sock`, `XDG_RUNTIME_DIR` a 0700
//! directory, stdin, stdout and stderr each a unix socketpair as libuv
//! makes them for Node's `"pipe"`), answering over its socket, and ending
//! when the client goes away:
//!
//! - sandbox backend, a session process running: closing the helper's
//!   stdin (the client quit or crashed) makes it exit 0 within
//!   [`EXIT_LIMIT`], its socket removed and the session process gone; the
//!   same on SIGINT ([`sandbox_stdin_eof_stops_the_sessions_and_exits`],
//!   [`sandbox_sigint_stops_the_sessions_and_exits`]);
//! - an agent that answers nothing (the fake agent of `tests/support/fake_agent.rs`)
//!   is given up on and the helper still exits 0 within [`EXIT_LIMIT`]
//!   ([`a_hung_agent_is_killed_and_the_helper_still_exits_in_time`]);
//! - stdin `/dev/null`, or a terminal whose other side hangs up: the helper
//!   never reads it and is still running and answering seconds later
//!   ([`stdin_dev_null_is_never_read`], [`stdin_terminal_is_never_read`]);
//! - a running VM under `--backend qemu` (QEMU TCG here) and `--backend
//!   kvm` (the nested-KVM harness here): a session writes a file on the
//!   session disk, another runs, stdin closes; the helper exits 0 within
//!   [`EXIT_LIMIT`], its socket removed, no QEMU left, the guest powered off
//!   by itself (not killed at the deadline), and the session disk's ext4
//!   superblock is clean (no journal to replay, state valid). A second
//!   helper on the same data directory mounts it without "not cleanly
//!   unmounted" and the file is there. The time from stdin's end to the
//!   helper's exit is printed.
//!
//! Gates: the QEMU case like the other QEMU suites (`support::gate`: a loud
//! skip, a failure under `COWORK_QEMU_TESTS=1`); the kvm case like
//! `tests/kvm_backend.rs` (`support::nested::run_on_linux_kvm`: directly
//! where KVM boots Linux, else re-run inside the nested harness; a failure
//! under `COWORK_NESTED_TESTS=1`). Both need the guest image with its
//! default userland.

mod support;

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cowork_helper::cli::{EXIT_LIMIT, SOCKET_NAME};
use cowork_helper::client::{Pipe, Subscription};
use guest_agent::extfs::{self, Superblock};
use serde_json::{json, Value};
use support::gate::{qemu_gate, qemu_missing};
use support::helper_process::{print_log_if_failing, wait_listening, CapturedLog};
use support::nested;
use support::procfs::children_named;
use support::session::{self, read_file};
use support::session_disk::{self, write_on_disk, KEPT_FILE};
use support::vm_helper::{self, built_helper, VmHelper};

/// The profile of every case, and its `userDataRoot`.
const PROFILE: &str = "lifecycle";
const ROOT: &str = "/tmp/client-lifecycle-profile";
/// Limit of one request or one process's events in the sandbox cases.
const T: Duration = Duration::from_secs(20);
/// Limit of startVM and of one request in the VM cases (TCG, a shared
/// machine; nested: L2 at TCG speed).
const VM_T: Duration = Duration::from_secs(180);
/// How long a started helper gets to listen on its socket.
const LISTEN_LIMIT: Duration = Duration::from_secs(30);
/// How long a helper whose stdin is not watched is left alone before it
/// must still be running and answering.
const UNWATCHED_WAIT: Duration = Duration::from_secs(3);
/// How long processes of an exited helper get to be gone (reaped by
/// whoever inherits them).
const GONE_LIMIT: Duration = Duration::from_secs(3);
/// The helper's log line for the client going away.
const STDIN_CLOSED: &str = "stdin closed: the client went away; shutting down";
/// The helper's log line for the deadline passing with a VM still running.
const BUDGET_SPENT: &str = "shutdown budget spent";
/// The backends' log line for a guest killed because it did not power off.
const NOT_POWERED_OFF: &str = "did not power off in time";
/// `s_state`'s offset in an ext superblock (`guest_agent::extfs` reads the
/// superblock from its start).
const STATE_AT: usize = 0x3A;
/// `s_state` bit: the filesystem was cleanly unmounted (or is mounted
/// read-only after a clean remount).
const STATE_VALID: u16 = 0x1;
/// `s_state` bit: errors were detected.
const STATE_ERRORS: u16 = 0x2;
/// What the VM cases' session writes on the session disk.
const KEPT_CONTENT: &str = "written before the client went away\n";
/// The VM cases' session that writes [`KEPT_FILE`].
const KEPT_SESSION: &str = "keep";

/// How the helper's stdin is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Input {
    /// One end of a unix socketpair, the other end the test's (the
    /// client's).
    ClientPipe,
    /// `/dev/null`.
    DevNull,
    /// A pseudo-terminal's slave side; the test keeps the master side.
    Terminal,
}

/// A unix socketpair: (the helper's end, the test's end). Both are
/// close-on-exec, so no other child inherits the test's end.
fn socketpair() -> (OwnedFd, UnixStream) {
    let (theirs, ours) = UnixStream::pair().expect("socketpair");
    (theirs.into(), ours)
}

/// A pseudo-terminal: (master, slave).
fn openpty() -> (OwnedFd, OwnedFd) {
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty with valid out-pointers and no name, termios or
    // window size.
    let r = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
    // openpty's descriptors are inherited across exec: the helper (or any
    // other child) holding the master would keep the terminal from hanging
    // up.
    for fd in [master, slave] {
        // SAFETY: fcntl on descriptors just opened.
        assert_eq!(
            // SAFETY: F_SETFD on a descriptor this test owns; no pointers.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) },
            0
        );
    }
    // SAFETY: both descriptors were just opened and are owned here.
    unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) }
}

/// The helper as the client runs it.
struct ClientStarted {
    child: Option<Child>,
    /// The client's end of the helper's stdin, while open.
    stdin: Option<UnixStream>,
    /// The master side of the helper's terminal, while open.
    pty_master: Option<OwnedFd>,
    /// `$XDG_RUNTIME_DIR/claude-cowork-vm.sock`.
    socket: PathBuf,
    /// What the helper wrote to stdout and stderr.
    log: Arc<CapturedLog>,
}

impl ClientStarted {
    /// Starts the helper with `--backend` `backend` (given as the
    /// environment, so its arguments are exactly the client's), its files
    /// in `dir` (data in [`vm_helper::data_dir`]), stdin as `input`; waits
    /// until it listens.
    fn start(dir: &Path, backend: &str, input: Input) -> ClientStarted {
        Self::start_with(dir, backend, input, &[])
    }

    /// [`ClientStarted::start`] with `env` added to the helper's
    /// environment.
    fn start_with(dir: &Path, backend: &str, input: Input, env: &[(&str, &str)]) -> ClientStarted {
        let run = dir.join("xdg-run");
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&run)
            .expect("XDG_RUNTIME_DIR");
        let socket = run.join(SOCKET_NAME);
        let mut cmd = Command::new(built_helper());
        cmd.arg("-socket")
            .arg(&socket)
            .env_remove("COWORK_USERLAND")
            .env_remove("COWORK_IDLE_TIMEOUT")
            .env("COWORK_BACKEND", backend)
            .env("COWORK_DATA_DIR", vm_helper::data_dir(dir))
            .env("COWORK_LOG", "info,cowork_helper=debug")
            .env("XDG_RUNTIME_DIR", &run)
            .env("XDG_DATA_HOME", dir.join("xdg-data"))
            .envs(env.iter().copied());
        let (mut stdin, mut pty_master) = (None, None);
        match input {
            Input::ClientPipe => {
                let (theirs, ours) = socketpair();
                cmd.stdin(Stdio::from(theirs));
                stdin = Some(ours);
            }
            Input::DevNull => {
                cmd.stdin(Stdio::null());
            }
            Input::Terminal => {
                let (master, slave) = openpty();
                cmd.stdin(Stdio::from(slave));
                pty_master = Some(master);
            }
        }
        let log = CapturedLog::new();
        let mut outputs = Vec::new();
        for _ in 0..2 {
            let (theirs, ours) = socketpair();
            outputs.push(theirs);
            log.capture(ours);
        }
        let stderr = outputs.pop().expect("two outputs");
        let stdout = outputs.pop().expect("two outputs");
        cmd.stdout(Stdio::from(stdout)).stderr(Stdio::from(stderr));
        let child = cmd.spawn().expect("start cowork-helper");
        // The helper's ends now live in the helper only.
        drop(cmd);
        let h = ClientStarted {
            child: Some(child),
            stdin,
            pty_master,
            socket,
            log,
        };
        wait_listening(&h.socket, LISTEN_LIMIT, || h.log());
        h
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Everything the helper wrote so far.
    fn log(&self) -> String {
        self.log.text()
    }

    /// Closes the client's end of the helper's stdin; returns when.
    fn close_stdin(&mut self) -> Instant {
        drop(self.stdin.take().expect("stdin is the client's pipe"));
        Instant::now()
    }

    /// Closes the master side of the helper's terminal: a reader of the
    /// slave side would now get EOF or EIO.
    fn hang_up_terminal(&mut self) {
        drop(self.pty_master.take().expect("stdin is a terminal"));
    }

    fn signal(&self, sig: libc::c_int) -> Instant {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid() as libc::pid_t, sig) };
        Instant::now()
    }

    /// Whether the helper still runs.
    fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits for the helper's exit, at most `limit` after `since`; its
    /// status and how long after `since` it came. Panics with the log when
    /// it does not come.
    fn wait_exit(&mut self, since: Instant, limit: Duration) -> (ExitStatus, Duration) {
        let child = self.child.as_mut().expect("the helper was started");
        loop {
            if let Some(status) = child.try_wait().expect("wait for the helper") {
                return (status, since.elapsed());
            }
            assert!(
                since.elapsed() < limit,
                "the helper did not exit within {limit:?}: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Asserts the helper exited 0 within [`EXIT_LIMIT`] of `since`, logged
    /// `trigger` once and removed its socket; returns how long it took.
    fn assert_clean_exit(&mut self, since: Instant, trigger: &str) -> Duration {
        let (status, took) = self.wait_exit(since, EXIT_LIMIT);
        let log = self.log();
        assert!(status.success(), "helper exit {status}: {log}");
        assert!(
            std::fs::symlink_metadata(&self.socket).is_err(),
            "the socket {} is still there: {log}",
            self.socket.display()
        );
        assert_eq!(log.matches(trigger).count(), 1, "{trigger:?}: {log}");
        assert!(log.contains(" bye "), "no final line: {log}");
        assert!(
            !log.contains('\u{1b}'),
            "a terminal escape in the log: {log}"
        );
        took
    }
}

impl Drop for ClientStarted {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        print_log_if_failing(&self.log(), None);
    }
}

/// A configured pipe and a subscription of [`PROFILE`] on `socket`.
async fn client(socket: &Path, limit: Duration) -> (Pipe, Subscription) {
    session::client_at(socket, PROFILE, ROOT, limit).await
}

/// startVM with `params`, within [`VM_T`]; panics with the helper's log.
async fn start_vm(pipe: &Pipe, h: &ClientStarted, params: Value) -> Duration {
    let t0 = Instant::now();
    tokio::time::timeout(VM_T, pipe.call("startVM", params))
        .await
        .unwrap_or_else(|_| panic!("startVM took over {VM_T:?}: {}", h.log()))
        .unwrap_or_else(|e| panic!("startVM: {e}\n{}", h.log()));
    t0.elapsed()
}

/// Spawns `sleep` in `session` (args `1000` and `marker`: sleep adds them
/// up) and checks it runs.
async fn spawn_sleeper(pipe: &Pipe, id: &str, session: &str, marker: &str) {
    pipe.call(
        "spawn",
        session::spawn(id, session, "sleep", &["1000", marker]),
    )
    .await
    .expect("spawn sleep");
    let status = pipe
        .call("isProcessRunning", json!({"id": id}))
        .await
        .expect("isProcessRunning");
    assert_eq!(status["running"], json!(true), "{status}");
}

/// A `sleep` argument no other process has: a fraction of a second made of
/// this test process's pid and `case`.
fn marker(case: u32) -> String {
    format!("0.{}{case}", std::process::id())
}

/// How the sandbox cases end the helper.
#[derive(Clone, Copy, Debug)]
enum End {
    /// The client goes away: its end of stdin closes.
    StdinEof,
    /// SIGINT.
    Sigint,
}

/// The sandbox case: a session runs, the helper is ended `how`; it exits 0
/// within [`EXIT_LIMIT`], its socket and the session process gone.
async fn sandbox_case(how: End, case: u32) {
    let dir = tempfile::Builder::new()
        .prefix("cowork-lifecycle-")
        .tempdir()
        .expect("tempdir");
    let mut h = ClientStarted::start(dir.path(), "sandbox", Input::ClientPipe);
    let (pipe, _sub) = client(&h.socket, T).await;
    start_vm(&pipe, &h, json!({})).await;
    support::daemon::wait_guest(&pipe, true).await;
    let marker = marker(case);
    spawn_sleeper(&pipe, "sleeper", "s1", &marker).await;
    assert!(
        !support::daemon::pids_with_arg(&marker).is_empty(),
        "the session's sleep is not running on the host"
    );

    let (since, trigger) = match how {
        End::StdinEof => (h.close_stdin(), STDIN_CLOSED),
        End::Sigint => (h.signal(libc::SIGINT), "SIGINT received; shutting down"),
    };
    let took = h.assert_clean_exit(since, trigger);
    let left = support::daemon::wait_no_process(&marker, GONE_LIMIT);
    assert!(
        left.is_empty(),
        "the session process outlived the helper: {left:?}"
    );
    let log = h.log();
    assert!(
        log.contains("vm stopped"),
        "the sandbox was not stopped: {log}"
    );
    eprintln!("client_lifecycle: sandbox: {how:?} -> exit {took:?} with a session running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_stdin_eof_stops_the_sessions_and_exits() {
    sandbox_case(End::StdinEof, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_sigint_stops_the_sessions_and_exits() {
    sandbox_case(End::Sigint, 2).await;
}

support::fake_agent::fake_agent_test!();

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_agent_is_killed_and_the_helper_still_exits_in_time() {
    let dir = tempfile::Builder::new()
        .prefix("cowork-lifecycle-")
        .tempdir()
        .expect("tempdir");
    // The fake agent (see support::fake_agent) serves the profile whose
    // session directory holds its marker.
    let key = cowork_helper::daemon::profile_key(Some(PROFILE), Some(ROOT));
    let sessions = vm_helper::data_dir(dir.path())
        .join("profiles")
        .join(key)
        .join("sessions");
    std::fs::create_dir_all(&sessions).expect("sessions dir");
    std::fs::write(sessions.join(".cowork-fake-agent"), b"").expect("marker");
    let mut h = ClientStarted::start_with(
        dir.path(),
        "sandbox",
        Input::ClientPipe,
        &[(
            cowork_helper::backend::sandbox::AGENT_WRAPPER_ENV,
            support::fake_agent::wrapper(),
        )],
    );
    let (pipe, _sub) = client(&h.socket, T).await;
    start_vm(&pipe, &h, json!({})).await;
    support::daemon::wait_guest(&pipe, true).await;
    // From now on the agent answers nothing, not even the shutdown.
    pipe.call(
        "spawn",
        json!({"id": "mute", "name": "hostile", "command": "never-answer", "args": [], "isResume": false}),
    )
    .await
    .expect("spawn never-answer");

    let since = h.close_stdin();
    let took = h.assert_clean_exit(since, STDIN_CLOSED);
    let log = h.log();
    assert!(
        log.contains("agent shutdown did not complete; killing the VM"),
        "the hung agent was not given up on: {log}"
    );
    eprintln!("client_lifecycle: sandbox, agent answering nothing: stdin EOF -> exit {took:?}");
}

/// A helper whose stdin is `input` (not a pipe or socket): it answers,
/// keeps running [`UNWATCHED_WAIT`] after `unplug` did what would end a
/// reader of that stdin, answers again, and still stops on SIGTERM.
async fn unwatched_case(input: Input, unplug: impl FnOnce(&mut ClientStarted)) {
    let dir = tempfile::Builder::new()
        .prefix("cowork-lifecycle-")
        .tempdir()
        .expect("tempdir");
    let mut h = ClientStarted::start(dir.path(), "sandbox", input);
    let (pipe, _sub) = client(&h.socket, T).await;
    assert_eq!(
        pipe.call("isRunning", json!({})).await.expect("isRunning")["running"],
        json!(false)
    );
    drop(pipe);
    unplug(&mut h);
    tokio::time::sleep(UNWATCHED_WAIT).await;
    assert!(h.running(), "the helper ended: {}", h.log());
    let (pipe, _sub) = client(&h.socket, T).await;
    pipe.call("isGuestConnected", json!({}))
        .await
        .unwrap_or_else(|e| panic!("the helper no longer answers: {e}\n{}", h.log()));
    assert!(
        !h.log().contains("shutting down"),
        "{input:?}: the helper started shutting down: {}",
        h.log()
    );
    let since = h.signal(libc::SIGTERM);
    h.assert_clean_exit(since, "SIGTERM received; shutting down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_dev_null_is_never_read() {
    // A reader of /dev/null would see its end at once.
    unwatched_case(Input::DevNull, |_| {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_terminal_is_never_read() {
    // With the master side closed, a reader of the terminal would get EIO.
    unwatched_case(Input::Terminal, ClientStarted::hang_up_terminal).await;
}

/// The session disk image's ext4 superblock says it was cleanly unmounted:
/// no journal to replay, state valid without errors. Returns a summary.
fn assert_disk_clean(disk: &Path) -> String {
    let file = std::fs::File::open(disk).expect("open the session disk");
    let raw = extfs::read(&file, 0).expect("read the superblock");
    let sb = Superblock::parse(&raw).expect("the session disk holds ext4");
    let state = u16::from_le_bytes([raw[STATE_AT], raw[STATE_AT + 1]]);
    assert!(
        !sb.needs_recovery(),
        "the session disk's journal needs a replay (incompat {:#x}): it was not settled before the VM ended",
        sb.incompat().unwrap_or(0)
    );
    assert!(
        state & STATE_VALID != 0 && state & STATE_ERRORS == 0,
        "the session disk's state is {state:#x}, not clean"
    );
    format!(
        "needs_recovery=false state={state:#x} incompat={:#x}",
        sb.incompat().unwrap_or(0)
    )
}

/// The VM case under `backend` with the helper's files under `base`:
/// prints (with `report`'s prefix) the time from stdin's end to the exit.
async fn vm_case(backend: &str, base: &Path, report: &str) {
    let dir = tempfile::Builder::new()
        .prefix("cowork-lifecycle-vm-")
        .tempdir_in(base)
        .expect("tempdir");
    let mut h = ClientStarted::start(dir.path(), backend, Input::ClientPipe);
    let (pipe, mut sub) = client(&h.socket, VM_T).await;
    let disk = session_disk::image_path(dir.path(), PROFILE, ROOT);
    pipe.call("createVM", json!({"diskSizeGB": 1}))
        .await
        .expect("createVM");
    let boot = start_vm(&pipe, &h, json!({"memoryGB": 1, "cpuCount": 1})).await;
    write_on_disk(
        &pipe,
        &mut sub,
        "keep-1",
        KEPT_SESSION,
        KEPT_CONTENT,
        "sync",
        VM_T,
    )
    .await;
    spawn_sleeper(&pipe, "sleeper", "s2", &marker(3)).await;
    let qemus = children_named(h.pid(), "qemu-system");
    assert_eq!(
        qemus.is_empty(),
        backend != "qemu",
        "QEMU children of the helper: {qemus:?}"
    );

    let since = h.close_stdin();
    let took = h.assert_clean_exit(since, STDIN_CLOSED);
    let log = h.log();
    if std::env::var_os(vm_helper::QEMU_VERBOSE_ENV).is_some() {
        eprintln!("---- helper log ----\n{log}---- end ----");
    }
    assert!(
        log.contains(session_disk::REMOUNTED_READ_ONLY),
        "the agent did not settle the session disk: {log}"
    );
    assert!(
        !log.contains(BUDGET_SPENT) && !log.contains(NOT_POWERED_OFF),
        "the VM had to be killed: {log}"
    );
    let t0 = Instant::now();
    for pid in &qemus {
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(t0.elapsed() < GONE_LIMIT, "QEMU {pid} outlived the helper");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let clean = assert_disk_clean(&disk);
    drop((pipe, sub));

    // A second helper on the same data directory: the disk mounts as it
    // was, its journal clean, and the session's file is there.
    let mut second =
        VmHelper::start_in(&built_helper(), dir.path(), "second", backend, LISTEN_LIMIT);
    let (pipe, _sub) = session::client(&second, PROFILE, ROOT, VM_T).await;
    session::start_vm(
        &pipe,
        &second,
        json!({"memoryGB": 1, "cpuCount": 1}),
        VM_T,
        "second helper",
    )
    .await;
    assert_eq!(
        read_file(&pipe, KEPT_SESSION, KEPT_FILE).await.as_deref(),
        Ok(KEPT_CONTENT),
        "{}",
        second.log_text()
    );
    let log2 = second.log_text();
    assert!(
        log2.contains(session_disk::MOUNTED),
        "the second boot did not mount the disk: {log2}"
    );
    assert!(
        !log2.contains(session_disk::NOT_CLEAN) && !log2.contains(session_disk::FORMATTING),
        "the second boot found the disk not clean: {log2}"
    );
    drop(pipe);
    second.stop_clean(vm_helper::QEMU_VERBOSE_ENV);

    println!(
        "{report}{backend}: stdin EOF -> helper exit {} ms with a running VM (startVM took {:.1} s); disk after: {clean}",
        took.as_millis(),
        boot.as_secs_f64()
    );
}

/// The VM cases' runtime (two workers, as in the other VM suites).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Name of the QEMU case.
const QEMU_TEST: &str = "qemu_client_going_away_stops_the_vm_cleanly";

#[test]
fn qemu_client_going_away_stops_the_vm_cleanly() {
    if !qemu_gate(
        QEMU_TEST,
        "the client-lifecycle QEMU test",
        [
            qemu_missing(),
            vm_helper::userland_image_missing(&built_helper()),
        ],
    ) {
        return;
    }
    runtime().block_on(vm_case("qemu", &std::env::temp_dir(), "client_lifecycle: "));
}

/// Name of the kvm case (what its nested re-run selects).
const KVM_TEST: &str = "kvm_client_going_away_stops_the_vm_cleanly";
/// Set (to 1) on the kvm case's re-run inside the nested harness.
const KVM_INSIDE_ENV: &str = "COWORK_CLIENT_LIFECYCLE_INSIDE";
/// Printed by the kvm case's body when every check passed.
const KVM_OK_MARKER: &str = "client_lifecycle: kvm ok";
/// Prefix of the kvm case's report lines.
const KVM_REPORT_PREFIX: &str = "client_lifecycle: ";
/// Prints the kvm case's whole inner output.
const KVM_VERBOSE_ENV: &str = "COWORK_CLIENT_LIFECYCLE_VERBOSE";
/// Limit of the kvm case's body inside the L1 guest (two boots).
const KVM_INNER_TIMEOUT: Duration = Duration::from_secs(600);
/// Limit of the whole harness run (L1 boot included).
const KVM_HARNESS_TIMEOUT: Duration = Duration::from_secs(660);
/// Nested attempts (QEMU TCG's SVM emulation now and then faults a guest).
const KVM_NESTED_ATTEMPTS: u32 = 3;

#[test]
fn kvm_client_going_away_stops_the_vm_cleanly() {
    nested::run_on_linux_kvm(
        &nested::Rerun {
            test: KVM_TEST,
            inside_env: KVM_INSIDE_ENV,
            ok_marker: KVM_OK_MARKER,
            report_prefix: KVM_REPORT_PREFIX,
            verbose_env: KVM_VERBOSE_ENV,
            inner_timeout: KVM_INNER_TIMEOUT,
            harness_timeout: KVM_HARNESS_TIMEOUT,
            attempts: KVM_NESTED_ATTEMPTS,
        },
        || vm_helper::userland_image_missing(&built_helper()),
        || {
            runtime().block_on(vm_case(
                "kvm",
                &nested::helper_base_dir(),
                KVM_REPORT_PREFIX,
            ));
            println!("{KVM_OK_MARKER}");
        },
    );
}
