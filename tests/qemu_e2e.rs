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
//! stopVM delivering exit events and leaving no QEMU behind. A second
//! helper boots and stops three times: after each stopVM it holds the same
//! descriptors as after the first (the vhost-user servers' exit events once
//! stayed open, six per boot).
//!
//! Gate: runs when the guest image exists (`scripts/mkguestimage.sh`, found
//! the way the helper finds it: `$COWORK_GUEST_IMAGE_DIR`, else
//! `guest-image/` next to or above the helper binary) and QEMU is
//! installed; with `COWORK_QEMU_TESTS=1` a missing prerequisite fails the
//! test instead of skipping it.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use cowork_helper::client::{Pipe, Subscription};
use serde_json::json;
use support::gate::{qemu_gate, qemu_missing};
use support::procfs::{children_named, settled_fd_kinds};
use support::session::{self, assert_exit_0, read_file, rel, run, sh, wait_stdout};
use support::session_checks::{self, HostFolders};
use support::vm_helper::{self, built_helper, VmHelper, QEMU_VERBOSE_ENV};

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

/// Whether the test may run; panics when it must run but cannot.
fn prerequisites() -> bool {
    qemu_gate(
        "qemu_e2e",
        "the QEMU end-to-end test",
        [
            qemu_missing(),
            vm_helper::image_for(&built_helper())
                .err()
                .map(|e| format!("no guest image ({e}); build it with scripts/mkguestimage.sh")),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_backend_end_to_end() {
    if !prerequisites() {
        return;
    }
    let _one = ONE_VM.lock().await;
    let mut helper = VmHelper::start_qemu("cowork-qemu-e2e-", &[]);
    let (pipe, mut sub) =
        session::client(&helper, PROFILE, "/tmp/qemu-e2e-profile", START_LIMIT).await;

    // Boot: startVM returns once the agent said hello over vsock.
    let params = json!({"memoryGB": 1, "cpuCount": 1});
    let boot = session::start_vm(&pipe, &helper, params, START_LIMIT, "boot").await;
    eprintln!("qemu_e2e: startVM (QEMU start to agent hello) took {boot:?}");
    session::assert_booted(&pipe, &mut sub, &helper, "qemu", T).await;
    let qemus = children_named(helper.pid(), "qemu-system");
    assert_eq!(qemus.len(), 1, "one QEMU child expected: {qemus:?}");

    // 1. /bin/sh in the guest: stdout, stderr and the exit code; PID 1 is the agent.
    let out = run(
        &pipe,
        &mut sub,
        sh(
            "sh-1",
            "s1",
            "echo out-$(cat /proc/1/comm); echo err >&2; uname -r; exit 3",
        ),
        T,
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
    pipe.call("spawn", session::spawn("cat-1", "s1", "/bin/cat", &[]))
        .await
        .expect("spawn cat");
    for line in ["alpha\n", "beta\n"] {
        pipe.call("writeStdin", json!({"id": "cat-1", "data": line}))
            .await
            .expect("writeStdin");
    }
    let echoed = wait_stdout(&mut sub, "cat-1", "alpha\nbeta\n", T).await;
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
        T,
    )
    .await;
    assert_eq!(out.exit_code(), Some(0), "{}", out.exit);
    assert_eq!(
        read_file(&pipe, "s2", "note.txt").await.as_deref(),
        Ok("from the guest\n")
    );

    // 4. 20,000 lines whole and in order.
    let t_seq = Instant::now();
    let out = run(
        &pipe,
        &mut sub,
        sh("seq-1", "s1", &format!("seq 1 {SEQ_LINES}")),
        T,
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
        session::spawn("sleep-1", "s1", "/bin/sleep", &["1000"]),
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
    helper.stop_clean(QEMU_VERBOSE_ENV);
}

/// Boots in one helper.
const CYCLES: usize = 3;

/// startVM/stopVM again and again in one helper (as a desktop client does
/// over a day) leaves no descriptors behind: after each stopVM the helper
/// holds the same descriptors, kind by kind, as after the first one (which
/// may have created what the helper keeps for its lifetime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_start_stop_cycles_release_descriptors() {
    if !prerequisites() {
        return;
    }
    let _one = ONE_VM.lock().await;
    let mut helper = VmHelper::start_qemu("cowork-qemu-cycles-", &[]);
    let (pipe, mut sub) = session::client(
        &helper,
        "qemu-cycles",
        "/tmp/qemu-cycles-profile",
        START_LIMIT,
    )
    .await;
    let mut after_stop = Vec::new();
    for cycle in 1..=CYCLES {
        let what = format!("boot {cycle}");
        session::start_vm(
            &pipe,
            &helper,
            json!({"memoryGB": 1, "cpuCount": 1}),
            START_LIMIT,
            &what,
        )
        .await;
        let out = run(
            &pipe,
            &mut sub,
            sh(&format!("true-{cycle}"), "s1", "true"),
            T,
        )
        .await;
        assert_exit_0(&what, &out);
        pipe.call("stopVM", json!({})).await.expect("stopVM");
        assert!(
            children_named(helper.pid(), "qemu-system").is_empty(),
            "{what}: QEMU still running after stopVM"
        );
        after_stop.push(settled_fd_kinds(helper.pid()).await);
        eprintln!(
            "qemu_cycles: after stop {cycle}: {:?}",
            after_stop[cycle - 1]
        );
    }
    for (i, kinds) in after_stop.iter().enumerate().skip(1) {
        assert_eq!(
            kinds,
            &after_stop[0],
            "descriptors after stopVM {} differ from after the first\n{}",
            i + 1,
            helper.log_text()
        );
    }
    drop(sub);
    drop(pipe);
    helper.stop_clean(QEMU_VERBOSE_ENV);
}

/// Host folders in the guest: `ro` and `rw` mounts at spawn, what the host
/// sees and refuses, `mountPath` into a running session, a guest symlink to
/// `/`, `installSdk`, and deleting the session releasing its grants.
async fn shared_folders(pipe: &Pipe, sub: &mut Subscription, helper: &VmHelper) {
    let host = tempfile::Builder::new()
        .prefix("cowork-qemu-e2e-fs-")
        .tempdir()
        .expect("tempdir");
    let folders = HostFolders::create(host.path());
    let (ro, rw) = (&folders.ro, &folders.rw);
    let (late, sdk) = (host.path().join("late"), host.path().join("sdk"));
    for d in [&late, &sdk.join("2.0.1")] {
        std::fs::create_dir_all(d).expect("host dir");
    }
    std::fs::write(rw.join("pre.txt"), "pre-existing\n").unwrap();
    std::fs::write(late.join("late.txt"), "added at runtime\n").unwrap();
    let claude = sdk.join("2.0.1/claude");
    std::fs::write(&claude, "#!/bin/sh\necho claude-sdk-ok \"$@\"\n").unwrap();
    std::fs::set_permissions(&claude, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();

    // `ro` and `rw` at spawn (the checks both backends make), and more
    // refusals the host enforces: appending in `ro`, deleting a file the
    // session did not create in `rw`; the share itself stays hidden.
    let m = session::mounts_dir("fs1");
    let more = format!(
        "(echo x >> {m}/ro/readme.txt) 2>/dev/null && echo append-ro=ok || echo append-ro=refused
         rm -f {m}/rw/pre.txt 2>/dev/null && echo rm-pre=ok || echo rm-pre=refused
         echo mine > {m}/rw/mine.txt && rm {m}/rw/mine.txt && echo rm-mine=ok || echo rm-mine=refused
         test -e /run/cowork/fs/fs1 && echo share=visible || echo share=hidden
         grep -c virtiofs /proc/self/mounts"
    );
    let text = session_checks::host_folders(pipe, sub, &folders, "fs-1", "fs1", &more, T).await;
    for want in [
        "append-ro=refused\n",
        "rm-pre=refused\n",
        "rm-mine=ok\n",
        "share=hidden\n",
    ] {
        assert!(text.contains(want), "{want:?} missing from {text:?}");
    }
    // The refused changes did not happen.
    assert!(
        rw.join("pre.txt").exists(),
        "a pre-existing file was deleted"
    );
    assert!(!rw.join("mine.txt").exists());

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
        T,
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
    assert_exit_0("fs-wait", &out);
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
        session::spawn("sdk-1", "s1", "/usr/local/bin/claude", &["--version"]),
        T,
    )
    .await;
    assert_exit_0("sdk-1", &out);
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
    let mut helper = VmHelper::start_qemu("cowork-qemu-e2e-", &[]);
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
