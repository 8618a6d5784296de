//! Driving a VM's sessions over the socket protocol, the way the client
//! does: connect and configure a profile and subscribe to its events,
//! startVM and the startup steps that show the agent connected, spawn a
//! command and collect its output and exit, readFile. Host paths are sent as
//! the client sends them (relative to `/`).
//!
//! Limits: one profile per client, `sessionOnly` (what the desktop client
//! sends for VM sessions); every failure panics with what was seen.

use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine;
use cowork_helper::client::{Pipe, ProcessOutput, Subscription};
use serde_json::{json, Value};

use super::vm_helper::VmHelper;

/// The startup steps whose completion shows the VM booted and its agent
/// connected (in the order the helper reports them).
const BOOT_STEPS: [&str; 2] = ["vm_boot", "guest_vsock_connect"];

/// A client of `helper`'s profile `profile` at `root`: a pipe whose calls
/// wait at most `call_limit` for their reply, configured
/// (`sessionOnly`), and a subscription to the profile's events.
pub async fn client(
    helper: &VmHelper,
    profile: &str,
    root: &str,
    call_limit: Duration,
) -> (Pipe, Subscription) {
    client_at(&helper.socket, profile, root, call_limit).await
}

/// [`client`] of the helper listening on `socket`.
pub async fn client_at(
    socket: &Path,
    profile: &str,
    root: &str,
    call_limit: Duration,
) -> (Pipe, Subscription) {
    let pipe = Pipe::connect_with_timeout(socket, call_limit)
        .await
        .expect("connect");
    pipe.call(
        "configure",
        json!({"userDataName": profile, "userDataRoot": root, "sessionOnly": true}),
    )
    .await
    .expect("configure");
    let sub = Subscription::connect(socket, profile, root)
        .await
        .expect("subscribe");
    (pipe, sub)
}

/// startVM with `params` (the `what`-th boot of the test), within `limit`;
/// returns how long it took. A failure panics with the helper's log.
pub async fn start_vm(
    pipe: &Pipe,
    helper: &VmHelper,
    params: Value,
    limit: Duration,
    what: &str,
) -> Duration {
    let t0 = Instant::now();
    tokio::time::timeout(limit, pipe.call("startVM", params))
        .await
        .unwrap_or_else(|_| panic!("{what}: startVM took over {limit:?}"))
        .unwrap_or_else(|e| panic!("{what}: startVM: {e}\n{}", helper.log_text()));
    t0.elapsed()
}

/// After startVM: the boot's startup steps completed, the agent is
/// connected, and the helper (`--backend <backend>`) logged the agent's
/// hello and the guest console shows the agent starting as PID 1.
pub async fn assert_booted(
    pipe: &Pipe,
    sub: &mut Subscription,
    helper: &VmHelper,
    backend: &str,
    limit: Duration,
) {
    for step in BOOT_STEPS {
        let ev = sub
            .next_matching(limit, |v: &Value| {
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
    let log = helper.log_text();
    assert!(
        log.contains("guest agent connected") && log.contains(&format!("backend=\"{backend}\"")),
        "the helper log lacks the agent's hello: {log}"
    );
    // A cold boot's console has the agent's start; a warm start's (a
    // restored boot snapshot) has the agent's redial after the restore.
    assert!(
        log.contains("agent starting as the VM's init")
            || log.contains("the host link was reset at the template point"),
        "the guest console (agent as PID 1) is not in the helper log: {log}"
    );
}

/// Spawn parameters of `command args…` in `session`.
pub fn spawn(id: &str, session: &str, command: &str, args: &[&str]) -> Value {
    json!({"id": id, "name": session, "command": command, "args": args, "isResume": false})
}

/// Spawn parameters of `/bin/sh -c script` in `session` (there in every
/// userland, the initramfs one included).
pub fn sh(id: &str, session: &str, script: &str) -> Value {
    spawn(id, session, "/bin/sh", &["-c", script])
}

/// Spawn parameters of `bash -c script` in `session` (the default
/// userland's shell, found on `PATH`).
pub fn bash(id: &str, session: &str, script: &str) -> Value {
    spawn(id, session, "bash", &["-c", script])
}

/// Spawns `params` and collects the process's output and exit (within `limit`).
pub async fn run(
    pipe: &Pipe,
    sub: &mut Subscription,
    params: Value,
    limit: Duration,
) -> ProcessOutput {
    let id = params["id"].as_str().expect("id").to_string();
    pipe.call("spawn", params).await.expect("spawn");
    sub.collect_process(&id, limit)
        .await
        .unwrap_or_else(|e| panic!("process {id}: {e}"))
}

/// Runs `script` under bash in `session`; asserts exit 0 and returns stdout.
pub async fn ok(
    pipe: &Pipe,
    sub: &mut Subscription,
    id: &str,
    session: &str,
    script: &str,
    limit: Duration,
) -> String {
    let out = run(pipe, sub, bash(id, session, script), limit).await;
    assert_exit_0(&format!("{id}: `{script}`"), &out);
    out.stdout_str()
}

/// Asserts that the process (`what`, for the message) exited 0; the
/// message has its exit, stdout and stderr.
pub fn assert_exit_0(what: &str, out: &ProcessOutput) {
    assert_eq!(
        out.exit_code(),
        Some(0),
        "{what} failed ({}): stdout {:?} stderr {:?}",
        out.exit,
        out.stdout_str(),
        out.stderr_str()
    );
}

/// Waits (up to `limit`) for the stdout of process `id` to contain `want`;
/// returns all of it seen so far. Other events stay stashed.
pub async fn wait_stdout(sub: &mut Subscription, id: &str, want: &str, limit: Duration) -> String {
    let mut seen = String::new();
    let deadline = Instant::now() + limit;
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

/// readFile of `path` (relative to the session's directory) in `session`,
/// decoded as UTF-8; `Err` says why not.
pub async fn read_file(pipe: &Pipe, session: &str, path: &str) -> Result<String, String> {
    let r = pipe
        .call(
            "readFile",
            json!({"processName": session, "filePath": path}),
        )
        .await
        .map_err(|e| e.to_string())?;
    let content = r["content"]
        .as_str()
        .ok_or_else(|| format!("readFile replied without content: {r}"))?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(content)
        .map_err(|e| e.to_string())?;
    String::from_utf8(bytes).map_err(|e| e.to_string())
}

/// A host path as the client sends it (relative to `/`).
pub fn rel(p: &Path) -> String {
    p.to_str()
        .expect("UTF-8 temp path")
        .trim_start_matches('/')
        .to_string()
}

/// Where a session sees its `additionalMounts` and `mountPath` mounts
/// (`<this>/<mount name>`).
pub fn mounts_dir(session: &str) -> String {
    format!("/sessions/{session}/mnt")
}
