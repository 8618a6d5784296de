//! The harness of the sandbox protocol suites (`protocol_*`, `sandbox_*`,
//! `limits`, `guest_hostility`): starts the built `cowork-helper` with
//! `--backend sandbox` on a temporary socket with its own data dir, keeps
//! its stdout and stderr in memory, and stops it (SIGTERM, then SIGKILL)
//! when dropped; many such helpers run at once. A per-binary shared helper
//! with one started sandbox lets a test file reuse a VM where isolation
//! allows. Also the protocol steps those suites share: profiles, startVM,
//! spawning and collecting a process.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cowork_helper::client::{ClientError, Pipe, ProcessOutput, Subscription};
use serde_json::{json, Value};

use super::helper_process::{self, built_helper, CapturedLog};
use super::session::assert_exit_0;
// The session steps the protocol suites use with the ones above.
#[allow(unused_imports)]
pub use super::session::{rel, sh};

/// Generous bound for anything that should take milliseconds.
pub const T: Duration = Duration::from_secs(20);

/// How long a helper gets to listen on its socket.
const LISTEN_LIMIT: Duration = Duration::from_secs(15);

/// How long a stopping helper gets after SIGTERM before it is killed.
const STOP_LIMIT: Duration = Duration::from_secs(10);

/// How long the shared helper gets after SIGTERM when the test binary exits.
const SHARED_STOP_LIMIT: Duration = Duration::from_secs(5);

/// Lines of the log a failing test prints.
const LOG_TAIL: usize = 80;

/// Spawns every helper from one thread that lives as long as the test
/// process, so that `PR_SET_PDEATHSIG` (tied to the spawning thread) fires
/// only when the test process itself goes away.
fn spawn_from_keeper(cmd: Command) -> std::io::Result<Child> {
    type Job = (Command, mpsc::Sender<std::io::Result<Child>>);
    static KEEPER: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    let tx = KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("helper-keeper".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    // SAFETY: the closure only calls prctl, async-signal-safe, between fork and exec.
                    unsafe {
                        cmd.pre_exec(|| {
                            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                            Ok(())
                        });
                    }
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("keeper thread");
        Mutex::new(tx)
    });
    let (rtx, rrx) = mpsc::channel();
    tx.lock().unwrap().send((cmd, rtx)).expect("keeper alive");
    rrx.recv().expect("keeper replies")
}

/// Options for starting a helper.
#[derive(Clone, Debug)]
pub struct Opts {
    pub env: Vec<(String, String)>,
    pub args: Vec<String>,
    /// Socket path; default `<tmp>/run/helper.sock` (parent not created).
    pub socket: Option<PathBuf>,
    /// Wait until the socket accepts connections.
    pub wait_ready: bool,
    /// Pass `-socket` as `-socket`, `--socket` or `-socket=`.
    pub socket_flag: SocketFlag,
}

#[derive(Clone, Copy, Debug)]
pub enum SocketFlag {
    GoStyle,
    Long,
    Equals,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            env: vec![("COWORK_LOG".into(), "debug".into())],
            args: vec![],
            socket: None,
            wait_ready: true,
            socket_flag: SocketFlag::GoStyle,
        }
    }
}

/// A running helper.
pub struct Daemon {
    child: Option<Child>,
    pub socket: PathBuf,
    pub data_dir: PathBuf,
    /// Root of this helper's temporary files.
    pub dir: PathBuf,
    tmp: Option<tempfile::TempDir>,
    log: Arc<CapturedLog>,
}

impl Daemon {
    pub fn start() -> Daemon {
        Self::start_with(Opts::default())
    }

    pub fn start_with(opts: Opts) -> Daemon {
        let tmp = tempfile::Builder::new()
            .prefix("cowork-t-")
            .tempdir()
            .expect("tempdir");
        let dir = tmp.path().to_path_buf();
        let mut d = Self::start_in(dir, opts);
        d.tmp = Some(tmp);
        d
    }

    /// Starts a helper whose files live under `dir` (not removed on drop).
    pub fn start_in(dir: PathBuf, opts: Opts) -> Daemon {
        let socket = opts
            .socket
            .clone()
            .unwrap_or_else(|| dir.join("run").join("helper.sock"));
        let data_dir = dir.join("data");
        let mut cmd = Command::new(built_helper());
        match opts.socket_flag {
            SocketFlag::GoStyle => {
                cmd.arg("-socket").arg(&socket);
            }
            SocketFlag::Long => {
                cmd.arg("--socket").arg(&socket);
            }
            SocketFlag::Equals => {
                let mut a = std::ffi::OsString::from("-socket=");
                a.push(&socket);
                cmd.arg(a);
            }
        }
        cmd.arg("--backend")
            .arg("sandbox")
            .arg("--data-dir")
            .arg(&data_dir)
            .args(&opts.args)
            .env_remove("COWORK_BACKEND")
            .env_remove("COWORK_DATA_DIR")
            .env("XDG_DATA_HOME", dir.join("xdg-data"))
            .env("XDG_RUNTIME_DIR", dir.join("xdg-run"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let mut child = spawn_from_keeper(cmd).expect("start cowork-helper");
        // stderr and stdout both go to the log (the client logs both).
        let log = CapturedLog::new();
        log.capture(child.stderr.take().unwrap());
        log.capture(child.stdout.take().unwrap());
        let d = Daemon {
            child: Some(child),
            socket,
            data_dir,
            dir,
            tmp: None,
            log,
        };
        if opts.wait_ready {
            d.wait_ready();
        }
        d
    }

    /// Polls until the socket accepts a connection (bounded).
    pub fn wait_ready(&self) {
        helper_process::wait_listening(&self.socket, LISTEN_LIMIT, || self.log());
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Everything the helper wrote to stderr/stdout so far.
    pub fn log(&self) -> String {
        self.log.text()
    }

    /// Waits until the helper's stderr and stdout are closed (after exit)
    /// so that [`Daemon::log`] is complete.
    pub fn wait_log_closed(&self, timeout: Duration) -> bool {
        self.log.wait_closed(timeout)
    }

    /// Polls the captured log until `pred` holds (bounded).
    pub fn wait_log(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if pred(&self.log()) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill takes no pointers; the pid is this helper's.
        unsafe {
            libc::kill(self.pid() as i32, sig);
        }
    }

    /// Waits for the helper to exit (bounded); `None` if it is still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, wait, SIGKILL as a last resort.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            helper_process::stop_child(&mut child, STOP_LIMIT);
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
        helper_process::print_log_if_failing(&self.log(), Some(LOG_TAIL));
    }
}

/// The test binary's shared helper (one per test file), stopped at exit.
pub fn shared() -> &'static Daemon {
    static SHARED: OnceLock<Daemon> = OnceLock::new();
    SHARED.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("cowork-shared-")
            .tempdir()
            .expect("tempdir")
            .keep();
        extern "C" fn cleanup() {
            if let Some(d) = SHARED_PID.get() {
                helper_process::terminate(d.0, SHARED_STOP_LIMIT, || {
                    let mut st = 0;
                    // SAFETY: `st` is a writable int that waitpid fills.
                    unsafe { libc::waitpid(d.0 as i32, &mut st, libc::WNOHANG) != 0 }
                });
                let _ = std::fs::remove_dir_all(&d.1);
            }
        }
        static SHARED_PID: OnceLock<(u32, PathBuf)> = OnceLock::new();
        let d = Daemon::start_in(dir.clone(), Opts::default());
        let _ = SHARED_PID.set((d.pid(), dir));
        // SAFETY: `cleanup` is an extern "C" fn that lives as long as the process.
        unsafe {
            libc::atexit(cleanup);
        }
        d
    })
}

/// A profile: its name and root as the desktop client sends them.
#[derive(Clone, Debug)]
pub struct Profile {
    pub name: String,
    pub root: String,
}

impl Profile {
    pub fn new(d: &Daemon, name: &str) -> Profile {
        Profile {
            name: name.to_string(),
            root: d
                .dir
                .join("profiles")
                .join(name)
                .to_string_lossy()
                .into_owned(),
        }
    }

    pub async fn pipe(&self, d: &Daemon) -> Pipe {
        Pipe::connect_profile(&d.socket, &self.name, &self.root)
            .await
            .expect("connect + configure")
    }

    pub async fn subscribe(&self, d: &Daemon) -> Subscription {
        Subscription::connect(&d.socket, &self.name, &self.root)
            .await
            .expect("subscribeEvents")
    }
}

/// `startVM` for the pipe's profile, then polls `isGuestConnected` as the
/// client does until it is true.
pub async fn start_vm(d: &Daemon, pipe: &Pipe, extra: Value) {
    let bundle = d.dir.join("bundle");
    std::fs::create_dir_all(&bundle).unwrap();
    let mut params = json!({"bundlePath": bundle.to_string_lossy()});
    if let (Value::Object(p), Value::Object(e)) = (&mut params, extra) {
        p.extend(e);
    }
    pipe.call("startVM", params).await.expect("startVM");
    wait_guest(pipe, true).await;
}

pub async fn wait_guest(pipe: &Pipe, want: bool) {
    let deadline = Instant::now() + T;
    loop {
        let r = pipe
            .call("isGuestConnected", Value::Null)
            .await
            .expect("isGuestConnected");
        if r["connected"] == Value::Bool(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "isGuestConnected did not become {want}: {r}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The shared helper with a started sandbox for profile `shared`.
pub async fn shared_vm() -> (&'static Daemon, Profile) {
    static STARTED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    let d = shared();
    let p = Profile::new(d, "shared");
    let p2 = p.clone();
    STARTED
        .get_or_init(|| async move {
            // startVM from a pipe that is closed afterwards: the VM belongs to
            // the profile, not to the connection.
            let pipe = p2.pipe(d).await;
            start_vm(d, &pipe, json!({})).await;
        })
        .await;
    (d, p)
}

/// Spawns and waits (up to [`T`]) for the process's exit, returning what
/// it printed.
pub async fn run(pipe: &Pipe, sub: &mut Subscription, spawn: Value) -> ProcessOutput {
    super::session::run(pipe, sub, spawn, T).await
}

/// Runs `sh -c script` in `session`, asserting exit code 0; returns stdout.
pub async fn run_ok(
    pipe: &Pipe,
    sub: &mut Subscription,
    id: &str,
    session: &str,
    script: &str,
) -> String {
    let out = run(pipe, sub, sh(id, session, script)).await;
    assert_exit_0(&format!("{script:?}"), &out);
    out.stdout_str()
}

/// Unique ids across tests in one process.
pub fn uid(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{prefix}-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// Asserts that a call failed with the helper's `success:false`, returning the text.
pub fn remote_err(r: Result<Value, ClientError>, what: &str) -> String {
    match r {
        Err(ClientError::Remote(s)) => {
            assert!(!s.trim().is_empty(), "{what}: empty error text");
            s
        }
        Ok(v) => panic!("{what}: expected an error, got success {v}"),
        Err(e) => panic!("{what}: expected a success:false reply, got {e}"),
    }
}

/// Host pids whose command line contains `needle`.
pub fn pids_with_arg(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let me = std::process::id();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            if cmd.split(|&b| b == 0).any(|a| a == needle.as_bytes()) {
                out.push(pid);
            }
        }
    }
    out
}

/// Waits (bounded) until no host process has `needle` as an argument.
pub fn wait_no_process(needle: &str, timeout: Duration) -> Vec<u32> {
    let deadline = Instant::now() + timeout;
    loop {
        let p = pids_with_arg(needle);
        if p.is_empty() || Instant::now() > deadline {
            return p;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
