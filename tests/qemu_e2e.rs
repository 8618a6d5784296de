//! End-to-end test of `--backend qemu`: the helper binary serves its socket
//! protocol, boots the guest image under QEMU (TCG here), and the agent, as
//! PID 1 of a real Linux guest, connects over our vhost-user vsock device.
//! One VM is started and reused by every case to keep the run short: spawn
//! `/bin/sh` with stdout/stderr/exit events, stdin to `cat`, kill, readFile,
//! 20,000 `seq` lines whole and in order, host folders through our
//! vhost-user virtio-fs share (an `ro` and an `rw` mount read and written
//! by a guest process and checked on the host, host-enforced refusals, a
//! `mountPath` into a running session, a guest `ln -s / x` that stays in
//! the guest, `installSdk`, release of a deleted session's grants), and
//! stopVM delivering exit events and leaving no QEMU behind.
//!
//! Gate: runs when the guest image exists (`scripts/mkguestimage.sh`, found
//! the way the helper finds it: `$COWORK_GUEST_IMAGE_DIR`, else
//! `guest-image/` next to or above the helper binary) and QEMU is
//! installed; with `COWORK_QEMU_TESTS=1` a missing prerequisite fails the
//! test instead of skipping it.

#[path = "support/vm_helper.rs"]
mod vm_helper;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine;
use cowork_helper::backend::qemu;
use cowork_helper::client::{Pipe, ProcessOutput, Subscription};
use serde_json::{json, Value};
use vm_helper::VmHelper;

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

/// Whether the test may run; panics when it must run but cannot.
fn prerequisites() -> bool {
    let required = std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1");
    let missing: Vec<String> = [
        qemu::find_qemu().err().map(|e| e.to_string()),
        vm_helper::image_for(&helper_exe())
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
    let mut helper = VmHelper::start_temp(
        &helper_exe(),
        "cowork-qemu-e2e-",
        &std::env::temp_dir(),
        "qemu",
        Duration::from_secs(15),
    );
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

    // 5. Host folders through the VM's virtio-fs share.
    shared_folders(&pipe, &mut sub, &helper).await;

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

/// A host path as the client sends it (relative to `/`).
fn rel(p: &Path) -> String {
    p.to_str()
        .expect("UTF-8 temp path")
        .trim_start_matches('/')
        .to_string()
}

/// Host folders in the guest: `ro` and `rw` mounts at spawn, what the host
/// sees and refuses, `mountPath` into a running session, a guest symlink to
/// `/`, `installSdk`, and deleting the session releasing its grants.
async fn shared_folders(pipe: &Pipe, sub: &mut Subscription, helper: &VmHelper) {
    let host = tempfile::Builder::new()
        .prefix("cowork-qemu-e2e-fs-")
        .tempdir()
        .expect("tempdir");
    let (ro, rw, late, sdk) = (
        host.path().join("ro"),
        host.path().join("rw"),
        host.path().join("late"),
        host.path().join("sdk"),
    );
    for d in [&ro, &rw, &late, &sdk.join("2.0.1")] {
        std::fs::create_dir_all(d).expect("host dir");
    }
    std::fs::write(ro.join("readme.txt"), "host ro content\n").unwrap();
    std::fs::write(rw.join("pre.txt"), "pre-existing\n").unwrap();
    std::fs::write(late.join("late.txt"), "added at runtime\n").unwrap();
    let claude = sdk.join("2.0.1/claude");
    std::fs::write(&claude, "#!/bin/sh\necho claude-sdk-ok \"$@\"\n").unwrap();
    std::fs::set_permissions(&claude, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();

    let m = "/sessions/fs1/mnt";
    let script = format!(
        "cat {m}/ro/readme.txt
         echo from-guest > {m}/rw/new.txt && echo write-rw=ok
         (echo x > {m}/ro/evil.txt) 2>/dev/null && echo create-ro=ok || echo create-ro=refused
         (echo x >> {m}/ro/readme.txt) 2>/dev/null && echo append-ro=ok || echo append-ro=refused
         rm -f {m}/rw/pre.txt 2>/dev/null && echo rm-pre=ok || echo rm-pre=refused
         echo mine > {m}/rw/mine.txt && rm {m}/rw/mine.txt && echo rm-mine=ok || echo rm-mine=refused
         test -e /run/cowork/fs/fs1 && echo share=visible || echo share=hidden
         grep -c virtiofs /proc/self/mounts"
    );
    let r = pipe
        .call(
            "spawn",
            json!({"id": "fs-1", "name": "fs1", "command": "/bin/sh", "args": ["-c", script],
                   "isResume": false, "additionalMounts": {
                       "ro": {"path": rel(&ro), "mode": "ro"},
                       "rw": {"path": rel(&rw), "mode": "rw"}}}),
        )
        .await
        .expect("spawn with mounts");
    assert_eq!(r["failedMounts"], json!([]), "{r}");
    let out = sub.collect_process("fs-1", T).await.expect("fs-1 exit");
    let text = out.stdout_str();
    eprintln!(
        "qemu_e2e: shared folders: {text:?} stderr {:?}",
        out.stderr_str()
    );
    assert_eq!(out.exit_code(), Some(0), "{}", out.exit);
    for want in [
        "host ro content\n",
        "write-rw=ok\n",
        "create-ro=refused\n",
        "append-ro=refused\n",
        "rm-pre=refused\n",
        "rm-mine=ok\n",
        "share=hidden\n",
    ] {
        assert!(text.contains(want), "{want:?} missing from {text:?}");
    }
    // The host sees the guest's write; the refused changes did not happen.
    assert_eq!(
        std::fs::read_to_string(rw.join("new.txt")).unwrap(),
        "from-guest\n"
    );
    assert!(
        rw.join("pre.txt").exists(),
        "a pre-existing file was deleted"
    );
    assert!(!rw.join("mine.txt").exists());
    assert!(!ro.join("evil.txt").exists());
    assert_eq!(
        std::fs::read_to_string(ro.join("readme.txt")).unwrap(),
        "host ro content\n"
    );

    // A symlink to / planted by the guest resolves in the guest, never on the host.
    let out = run(
        pipe,
        sub,
        sh(
            "fs-ln",
            "fs1",
            &format!(
                "cd {m}/rw && ln -s / x && echo ls:; ls x/; echo hostname:; cat x/etc/hostname 2>&1; \
                 echo link=$(readlink x); test -e x/work && echo host-root=reached || echo host-root=not-reached"
            ),
        ),
    )
    .await;
    let text = out.stdout_str();
    eprintln!("qemu_e2e: symlink escape attempt: {text:?}");
    assert_eq!(out.exit_code(), Some(0), "{}", out.exit);
    assert!(text.contains("link=/\n"), "{text}");
    // The guest's root (its /etc/hostname is the agent's "claude"), not the host's.
    let listing = text
        .split("ls:\n")
        .nth(1)
        .and_then(|t| t.split("hostname:").next())
        .unwrap_or_default();
    assert!(listing.lines().any(|l| l == "sessions"), "{text}");
    assert!(text.contains("hostname:\nclaude\n"), "{text}");
    assert!(text.contains("host-root=not-reached"), "{text}");
    if let Ok(host_name) = std::fs::read_to_string("/etc/hostname") {
        let host_name = host_name.trim();
        if !host_name.is_empty() {
            assert!(
                !text.lines().any(|l| l.trim() == host_name),
                "the host's /etc/hostname leaked: {text}"
            );
        }
    }
    let link = std::fs::symlink_metadata(rw.join("x")).expect("the guest's symlink on the host");
    assert!(link.file_type().is_symlink());

    // mountPath into a running session: the waiting process sees the new mount.
    pipe.call(
        "spawn",
        json!({"id": "fs-wait", "name": "fs1", "command": "/bin/sh",
               "args": ["-c", format!("read go; cat {m}/late/late.txt")], "isResume": false}),
    )
    .await
    .expect("spawn waiting process");
    pipe.call(
        "mountPath",
        json!({"processId": "fs-wait", "subpath": rel(&late), "mountName": "late", "mode": "ro"}),
    )
    .await
    .expect("mountPath");
    pipe.call("writeStdin", json!({"id": "fs-wait", "data": "go\n"}))
        .await
        .expect("writeStdin");
    let out = sub
        .collect_process("fs-wait", T)
        .await
        .expect("fs-wait exit");
    assert_eq!(
        out.exit_code(),
        Some(0),
        "{} {}",
        out.exit,
        out.stderr_str()
    );
    assert_eq!(out.stdout_str(), "added at runtime\n");

    // installSdk: the CLI is bound from the share and runs.
    let r = pipe
        .call(
            "installSdk",
            json!({"sdkSubpath": rel(&sdk), "version": "2.0.1"}),
        )
        .await
        .expect("installSdk");
    eprintln!("qemu_e2e: installSdk: {r}");
    let out = run(
        pipe,
        sub,
        json!({"id": "sdk-1", "name": "s1", "command": "/usr/local/bin/claude",
               "args": ["--version"], "isResume": false}),
    )
    .await;
    assert_eq!(
        out.exit_code(),
        Some(0),
        "{} {}",
        out.exit,
        out.stderr_str()
    );
    assert_eq!(out.stdout_str(), "claude-sdk-ok --version\n");
    // Again (it is re-sent on every startVM): idempotent.
    pipe.call(
        "installSdk",
        json!({"sdkSubpath": rel(&sdk), "version": "2.0.1"}),
    )
    .await
    .expect("installSdk again");

    // Deleting the session releases its grants on the host.
    let r = pipe
        .call("deleteSessionDirs", json!({"names": ["fs1"]}))
        .await
        .expect("deleteSessionDirs");
    assert_eq!(r["deleted"], json!(["fs1"]), "{r}");
    let log = helper.log_text();
    assert!(
        log.lines().any(|l| l.contains("virtio-fs session removed")
            && l.contains("session=\"fs1\"")
            && l.contains("grants=3")),
        "the session's three grants were not released: {log}"
    );
    // Host files survive the session's deletion.
    assert!(rw.join("pre.txt").exists() && rw.join("new.txt").exists());
    assert!(late.join("late.txt").exists() && ro.join("readme.txt").exists());
}

/// A helper killed with SIGKILL (no chance to clean up) takes its QEMU with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_dies_with_a_killed_helper() {
    if !prerequisites() {
        return;
    }
    let _one = ONE_VM.lock().await;
    let mut helper = VmHelper::start_temp(
        &helper_exe(),
        "cowork-qemu-e2e-",
        &std::env::temp_dir(),
        "qemu",
        Duration::from_secs(15),
    );
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
    let mut child = helper.take_child().expect("helper child");
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
