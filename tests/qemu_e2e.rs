//! End-to-end test of `--backend qemu`: the helper binary serves its socket
//! protocol, boots the guest image under QEMU (TCG here), and the agent, as
//! PID 1 of a real Linux guest, connects over our vhost-user vsock device.
//! One VM is started and reused by every case to keep the run short: spawn
//! `/bin/sh` with stdout/stderr/exit events, stdin to `cat`, kill, readFile,
//! 20,000 `seq` lines whole and in order, a mount that this backend cannot
//! make reported in `failedMounts`, and stopVM delivering exit events and
//! leaving no QEMU behind.
//!
//! Gate: runs when the guest image exists (`scripts/mkguestimage.sh`, found
//! the way the helper finds it: `$COWORK_GUEST_IMAGE_DIR`, else
//! `guest-image/` next to or above the helper binary) and QEMU is
//! installed; with `COWORK_QEMU_TESTS=1` a missing prerequisite fails the
//! test instead of skipping it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use cowork_helper::backend::qemu::{self, GuestImage};
use cowork_helper::client::{Pipe, ProcessOutput, Subscription};
use serde_json::{json, Value};

/// Environment variable that makes missing prerequisites a failure.
const REQUIRE_ENV: &str = "COWORK_QEMU_TESTS";
/// Profile name used by the test.
const PROFILE: &str = "qemu-e2e";
/// Limit for startVM (a TCG boot takes a few seconds; the machine is shared).
const START_LIMIT: Duration = Duration::from_secs(120);
/// Limit for one case's events.
const T: Duration = Duration::from_secs(60);
/// Lines of the bulk-output case.
const SEQ_LINES: usize = 20_000;
/// One VM at a time: TCG is CPU heavy and the machine is shared.
static ONE_VM: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// Environment variable that prints the helper's whole log at the end.
const VERBOSE_ENV: &str = "COWORK_QEMU_E2E_VERBOSE";

fn helper_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cowork-helper"))
}

/// The guest image the helper binary will use, or why there is none.
fn image_for_helper() -> Result<GuestImage, String> {
    if let Some(dir) = std::env::var_os(qemu::IMAGE_DIR_ENV).filter(|d| !d.is_empty()) {
        return GuestImage::at(Path::new(&dir));
    }
    let exe_dir = helper_exe()
        .parent()
        .map(Path::to_path_buf)
        .ok_or("the helper binary has no directory")?;
    let mut why = Vec::new();
    for dir in [exe_dir.join("guest-image"), exe_dir.join("../guest-image")] {
        match GuestImage::at(&dir) {
            Ok(img) => return Ok(img),
            Err(e) => why.push(e),
        }
    }
    Err(why.join("; "))
}

/// Whether the test may run; panics when it must run but cannot.
fn prerequisites() -> bool {
    let required = std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1");
    let missing: Vec<String> = [
        qemu::find_qemu().err().map(|e| e.to_string()),
        image_for_helper()
            .err()
            .map(|e| format!("no guest image ({e}); build it with scripts/mkguestimage.sh")),
    ]
    .into_iter()
    .flatten()
    .collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        !required,
        "{REQUIRE_ENV}=1 but the QEMU end-to-end test cannot run: {}",
        missing.join("; ")
    );
    eprintln!(
        "\n========================================================================\n\
         SKIPPED qemu_e2e: {}\n\
         (set {REQUIRE_ENV}=1 to make this a failure)\n\
         ========================================================================\n",
        missing.join("; ")
    );
    false
}

/// The helper process; killed (and its log printed when failing) on drop.
struct Helper {
    child: Option<Child>,
    socket: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Helper {
    fn start() -> Helper {
        let dir = tempfile::Builder::new()
            .prefix("cowork-qemu-e2e-")
            .tempdir()
            .expect("tempdir");
        let socket = dir.path().join("helper.sock");
        let log = dir.path().join("helper.log");
        let out = File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let child = Command::new(helper_exe())
            .arg("--socket")
            .arg(&socket)
            .args(["--backend", "qemu", "--data-dir"])
            .arg(dir.path().join("data"))
            .env_remove("COWORK_BACKEND")
            .env("COWORK_LOG", "info,cowork_helper=debug")
            .env("XDG_RUNTIME_DIR", dir.path().join("run"))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("start cowork-helper");
        let h = Helper {
            child: Some(child),
            socket,
            log,
            _dir: dir,
        };
        let t0 = Instant::now();
        while std::os::unix::net::UnixStream::connect(&h.socket).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "helper did not listen: {}",
                h.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        h
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then the exit status (bounded).
    fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        child.wait().ok()
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("---- helper log ----\n{}\n---- end ----", self.log_text());
        }
    }
}

/// Children of `pid` whose command name starts with `prefix`.
fn children_named(pid: u32, prefix: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
                return false;
            };
            // pid (comm) state ppid ...
            let Some((head, rest)) = stat.rsplit_once(") ") else {
                return false;
            };
            let comm = head.split_once(" (").map_or("", |(_, c)| c);
            let ppid = rest.split_whitespace().nth(1).and_then(|s| s.parse().ok());
            ppid == Some(pid) && comm.starts_with(prefix)
        })
        .collect()
}

fn sh(id: &str, session: &str, script: &str) -> Value {
    json!({"id": id, "name": session, "command": "/bin/sh", "args": ["-c", script], "isResume": false})
}

async fn run(pipe: &Pipe, sub: &mut Subscription, params: Value) -> ProcessOutput {
    let id = params["id"].as_str().expect("id").to_string();
    pipe.call("spawn", params).await.expect("spawn");
    sub.collect_process(&id, T).await.expect("process events")
}

/// Waits for stdout of `id` to contain `want` (other events stay stashed).
async fn wait_stdout(sub: &mut Subscription, id: &str, want: &str) -> String {
    let mut seen = String::new();
    let deadline = Instant::now() + T;
    while !seen.contains(want) {
        let left = deadline.saturating_duration_since(Instant::now());
        let ev = sub
            .next_matching(left, |v| v["type"] == "stdout" && v["id"] == id)
            .await
            .unwrap_or_else(|e| panic!("no {want:?} on {id}'s stdout (got {seen:?}): {e}"));
        seen.push_str(ev["data"].as_str().unwrap_or_default());
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_backend_end_to_end() {
    if !prerequisites() {
        return;
    }
    let _one = ONE_VM.lock().await;
    let mut helper = Helper::start();
    let root = "/tmp/qemu-e2e-profile";
    let pipe = Pipe::connect_with_timeout(&helper.socket, START_LIMIT)
        .await
        .expect("connect");
    pipe.call(
        "configure",
        json!({"userDataName": PROFILE, "userDataRoot": root, "sessionOnly": true}),
    )
    .await
    .expect("configure");
    let mut sub = Subscription::connect(&helper.socket, PROFILE, root)
        .await
        .expect("subscribe");

    // Boot: startVM returns once the agent said hello over vsock.
    let t0 = Instant::now();
    pipe.call("startVM", json!({"memoryGB": 1, "cpuCount": 1}))
        .await
        .expect("startVM");
    let boot = t0.elapsed();
    eprintln!("qemu_e2e: startVM (QEMU start to agent hello) took {boot:?}");
    for step in ["vm_boot", "guest_vsock_connect"] {
        let ev = sub
            .next_matching(T, |v| {
                v["type"] == "startupStep" && v["step"] == step && v["status"] == "completed"
            })
            .await
            .unwrap_or_else(|e| panic!("no completed {step}: {e}"));
        assert_eq!(ev["status"], "completed");
    }
    assert_eq!(
        pipe.call("isGuestConnected", json!({})).await.unwrap()["connected"],
        json!(true)
    );
    let qemus = children_named(helper.pid(), "qemu-system");
    assert_eq!(qemus.len(), 1, "one QEMU child expected: {qemus:?}");
    let log = helper.log_text();
    assert!(
        log.contains("guest agent connected") && log.contains("backend=\"qemu\""),
        "the helper log lacks the agent's hello: {log}"
    );
    assert!(
        log.contains("agent starting as the VM's init"),
        "the guest console (agent as PID 1) is not in the helper log: {log}"
    );

    // 1. /bin/sh in the guest: stdout, stderr and the exit code; PID 1 is the agent.
    let out = run(
        &pipe,
        &mut sub,
        sh(
            "sh-1",
            "s1",
            "echo out-$(cat /proc/1/comm); echo err >&2; uname -r; exit 3",
        ),
    )
    .await;
    assert_eq!(out.exit_code(), Some(3), "{}", out.exit);
    assert!(
        out.stdout_str().starts_with("out-init\n"),
        "stdout: {:?}",
        out.stdout_str()
    );
    assert!(
        out.stdout_str().contains("cloud-amd64"),
        "not the guest kernel: {:?}",
        out.stdout_str()
    );
    assert_eq!(out.stderr_str(), "err\n");

    // 2. stdin to cat, then kill it.
    pipe.call(
        "spawn",
        json!({"id": "cat-1", "name": "s1", "command": "/bin/cat", "args": [], "isResume": false}),
    )
    .await
    .expect("spawn cat");
    for line in ["alpha\n", "beta\n"] {
        pipe.call("writeStdin", json!({"id": "cat-1", "data": line}))
            .await
            .expect("writeStdin");
    }
    let echoed = wait_stdout(&mut sub, "cat-1", "alpha\nbeta\n").await;
    assert_eq!(echoed, "alpha\nbeta\n");
    assert_eq!(
        pipe.call("isProcessRunning", json!({"id": "cat-1"}))
            .await
            .unwrap()["running"],
        json!(true)
    );
    pipe.call("kill", json!({"id": "cat-1", "signal": "SIGTERM"}))
        .await
        .expect("kill");
    let out = sub.collect_process("cat-1", T).await.expect("cat exit");
    assert_eq!(out.signal(), Some("SIGTERM"), "{}", out.exit);
    let status = pipe
        .call("isProcessRunning", json!({"id": "cat-1"}))
        .await
        .unwrap();
    assert_eq!(status["running"], json!(false), "{status}");

    // 3. readFile of a file a process wrote into its session.
    let out = run(
        &pipe,
        &mut sub,
        sh("w-1", "s2", "printf 'from the guest\\n' > note.txt"),
    )
    .await;
    assert_eq!(out.exit_code(), Some(0), "{}", out.exit);
    let r = pipe
        .call(
            "readFile",
            json!({"processName": "s2", "filePath": "note.txt"}),
        )
        .await
        .expect("readFile");
    let content = base64::engine::general_purpose::STANDARD
        .decode(r["content"].as_str().expect("content"))
        .expect("base64");
    assert_eq!(content, b"from the guest\n");

    // 4. 20,000 lines whole and in order.
    let t_seq = Instant::now();
    let out = run(
        &pipe,
        &mut sub,
        sh("seq-1", "s1", &format!("seq 1 {SEQ_LINES}")),
    )
    .await;
    eprintln!(
        "qemu_e2e: {SEQ_LINES} lines ({} bytes) in {:?}",
        out.stdout.len(),
        t_seq.elapsed()
    );
    assert_eq!(out.exit_code(), Some(0), "{}", out.exit);
    let expected: String = (1..=SEQ_LINES).map(|i| format!("{i}\n")).collect();
    assert!(
        out.stdout_str() == expected,
        "seq output differs: {} bytes, expected {}",
        out.stdout.len(),
        expected.len()
    );

    // 5. Host folders cannot be shared yet: the mount is reported, the process runs.
    let r = pipe
        .call(
            "spawn",
            json!({"id": "m-1", "name": "s3", "command": "/bin/sh", "args": ["-c", "exit 0"],
                   "isResume": false, "additionalMounts": {"proj": {"path": "tmp", "mode": "ro"}}}),
        )
        .await
        .expect("spawn with a mount");
    assert_eq!(r["failedMounts"], json!(["proj"]), "{r}");
    let out = sub.collect_process("m-1", T).await.expect("m-1 exit");
    assert_eq!(out.exit_code(), Some(0), "{}", out.exit);

    // 6. stopVM: the running process gets its exit event, QEMU powers off.
    pipe.call(
        "spawn",
        json!({"id": "sleep-1", "name": "s1", "command": "/bin/sleep", "args": ["1000"], "isResume": false}),
    )
    .await
    .expect("spawn sleep");
    let t_stop = Instant::now();
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    eprintln!("qemu_e2e: stopVM took {:?}", t_stop.elapsed());
    let out = sub.collect_process("sleep-1", T).await.expect("sleep exit");
    assert!(
        out.signal().is_some() || out.exit_code().is_some(),
        "{}",
        out.exit
    );
    assert_eq!(
        pipe.call("isRunning", json!({})).await.unwrap()["running"],
        json!(false)
    );
    assert!(
        children_named(helper.pid(), "qemu-system").is_empty(),
        "QEMU still running after stopVM"
    );
    let log = helper.log_text();
    assert!(
        log.contains("powering off") && log.contains("qemu stopped"),
        "the guest did not power off cleanly: {log}"
    );
    assert!(
        !log.contains("did not power off in time"),
        "QEMU had to be killed: {log}"
    );
    drop(sub);
    drop(pipe);
    let st = helper.stop().expect("helper exit status");
    if std::env::var_os(VERBOSE_ENV).is_some() {
        eprintln!("---- helper log ----\n{}---- end ----", helper.log_text());
    }
    assert!(st.success(), "helper exit: {st}");
}

/// A helper killed with SIGKILL (no chance to clean up) takes its QEMU with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_dies_with_a_killed_helper() {
    if !prerequisites() {
        return;
    }
    let _one = ONE_VM.lock().await;
    let mut helper = Helper::start();
    let pipe = Pipe::connect_profile(&helper.socket, PROFILE, "/tmp/qemu-e2e-kill")
        .await
        .expect("connect");
    // startVM's reply is not awaited: QEMU only has to exist.
    let call = tokio::spawn(async move { pipe.call("startVM", json!({"cpuCount": 1})).await });
    let t0 = Instant::now();
    let qemu = loop {
        if let Some(&pid) = children_named(helper.pid(), "qemu-system").first() {
            break pid;
        }
        assert!(t0.elapsed() < T, "QEMU never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut child = helper.child.take().expect("helper child");
    child.kill().expect("SIGKILL the helper");
    child.wait().expect("reap the helper");
    let t1 = Instant::now();
    while Path::new(&format!("/proc/{qemu}")).exists() {
        assert!(
            t1.elapsed() < Duration::from_secs(10),
            "QEMU {qemu} outlived the killed helper"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = call.await;
}
