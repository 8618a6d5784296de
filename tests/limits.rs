//! Resource bounds of the helper (issue 11 item 5), driven through the real
//! binary over its socket with the sandbox backend: each limit is reached,
//! the request past it fails with an error that names the limit, and what
//! was accepted before it is unharmed.
//!
//! - processes per profile (`COWORK_MAX_PROCESSES`, default
//!   `cowork_helper::vm::MAX_PROCESSES`): spawn beyond it is refused, a slot
//!   freed by an exit is usable again;
//! - queued stdin per process (the agent's `MAX_QUEUED_STDIN`, 16 MiB):
//!   writes to a process that does not read are accepted up to it, the next
//!   one is refused, and once the process reads, every accepted byte arrives
//!   whole and in order;
//! - requests awaiting the agent (`COWORK_MAX_PENDING_REQUESTS`, default
//!   `cowork_helper::vm::MAX_PENDING_REQUESTS`): against an agent that stops
//!   answering (the fake agent of `tests/support/fake_agent.rs`), the request past the
//!   limit fails at once, stopVM still ends the VM (failing the waiting
//!   ones) and startVM works again.
//!
//! The client-connection cap has its own test in `protocol_socket.rs`.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cowork_helper::client::Pipe;
use guest_agent::agent::process::MAX_QUEUED_STDIN;
use serde_json::json;
use support::daemon::{start_vm, Daemon, Opts, Profile, T};

/// Process cap the process-limit test runs the helper with.
const TEST_MAX_PROCESSES: usize = 3;

/// Pending-request cap the pending-request test runs the helper with.
const TEST_MAX_PENDING: usize = 4;

/// Size of one stdin write in the stdin test (ASCII lines).
const STDIN_CHUNK: usize = 1024 * 1024;

support::fake_agent::fake_agent_test!();

fn sleeper(id: &str) -> serde_json::Value {
    json!({"id": id, "name": "limits", "command": "/bin/sh", "args": ["-c", "exec sleep 600"], "isResume": false})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawn_beyond_the_process_limit_is_refused_with_the_limit_named() {
    let d = Daemon::start_with(Opts {
        env: vec![
            ("COWORK_LOG".into(), "info".into()),
            (
                cowork_helper::vm::MAX_PROCESSES_ENV.into(),
                TEST_MAX_PROCESSES.to_string(),
            ),
        ],
        ..Opts::default()
    });
    let p = Profile::new(&d, "limits-procs");
    let pipe = p.pipe(&d).await;
    let mut sub = p.subscribe(&d).await;
    start_vm(&d, &pipe, json!({})).await;

    for i in 0..TEST_MAX_PROCESSES {
        pipe.call("spawn", sleeper(&format!("s{i}")))
            .await
            .unwrap_or_else(|e| panic!("spawn s{i} under the limit: {e}"));
    }
    let err = pipe
        .call("spawn", sleeper("over"))
        .await
        .expect_err("a spawn past the process limit must fail")
        .to_string();
    assert!(
        err.contains(&format!("already runs {TEST_MAX_PROCESSES} processes"))
            && err.contains("limit"),
        "the error names the limit: {err}"
    );
    let r = pipe
        .call("isProcessRunning", json!({"id": "over"}))
        .await
        .unwrap();
    assert_eq!(r["running"], false, "the refused process does not exist");

    // An exit frees a slot.
    pipe.call("kill", json!({"id": "s0", "signal": "SIGKILL"}))
        .await
        .expect("kill s0");
    sub.collect_process("s0", T).await.expect("s0 exits");
    pipe.call(
        "spawn",
        json!({"id": "after", "name": "limits", "command": "/bin/echo", "args": ["again"], "isResume": false}),
    )
    .await
    .expect("a spawn after an exit is under the limit again");
    let out = sub.collect_process("after", T).await.expect("after exits");
    assert_eq!(out.stdout_str(), "again\n");
    assert_eq!(out.exit_code(), Some(0));

    pipe.call("stopVM", json!({})).await.expect("stopVM");
}

/// One stdin chunk: `STDIN_CHUNK` bytes of numbered lines, unique per `n`.
fn chunk(n: usize) -> String {
    let mut s = String::with_capacity(STDIN_CHUNK);
    let mut line = 0;
    while s.len() < STDIN_CHUNK {
        let l = format!("chunk {n:04} line {line:08} ....................................\n");
        let room = STDIN_CHUNK - s.len();
        if l.len() > room {
            s.push_str(&".".repeat(room - 1));
            s.push('\n');
        } else {
            s.push_str(&l);
        }
        line += 1;
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_beyond_the_queue_limit_is_refused_and_accepted_writes_arrive_in_order() {
    let d = Daemon::start_with(Opts {
        env: vec![("COWORK_LOG".into(), "info".into())],
        ..Opts::default()
    });
    let p = Profile::new(&d, "limits-stdin");
    let pipe = Pipe::connect_with_timeout(&d.socket, Duration::from_secs(60))
        .await
        .expect("connect");
    pipe.call(
        "configure",
        json!({"userDataName": p.name, "userDataRoot": p.root, "sessionOnly": true}),
    )
    .await
    .expect("configure");
    let mut sub = p.subscribe(&d).await;
    start_vm(&d, &pipe, json!({})).await;

    // Reads nothing until `go` exists, then echoes its input up to END.
    let script = "while [ ! -e go ]; do sleep 0.05; done; exec sed '/^END$/q'";
    pipe.call(
        "spawn",
        json!({"id": "slow", "name": "limits", "command": "/bin/sh", "args": ["-c", script], "isResume": false}),
    )
    .await
    .expect("spawn the slow reader");

    let mut accepted = Vec::new();
    let refusal = loop {
        let n = accepted.len();
        assert!(
            n * STDIN_CHUNK <= 2 * MAX_QUEUED_STDIN,
            "{n} MiB accepted by a process that reads nothing: no limit"
        );
        let data = chunk(n);
        match pipe
            .call("writeStdin", json!({"id": "slow", "data": data}))
            .await
        {
            Ok(_) => accepted.push(data),
            Err(e) => break e.to_string(),
        }
    };
    assert!(
        refusal.contains(&format!("limit of {MAX_QUEUED_STDIN} bytes")),
        "the refusal names the limit: {refusal}"
    );
    // The queue holds up to the limit; the pipe (1 MiB) and the chunk being
    // written into it hold at most two more.
    let got = accepted.len() * STDIN_CHUNK;
    assert!(
        (MAX_QUEUED_STDIN..=MAX_QUEUED_STDIN + 2 * STDIN_CHUNK).contains(&got),
        "accepted {got} bytes before the refusal (limit {MAX_QUEUED_STDIN})"
    );

    // Let it read, then end its input once there is room again.
    let touch = json!({"id": "go", "name": "limits", "command": "/bin/sh", "args": ["-c", "touch go"], "isResume": false});
    pipe.call("spawn", touch).await.expect("spawn touch");
    let deadline = Instant::now() + T;
    loop {
        match pipe
            .call("writeStdin", json!({"id": "slow", "data": "END\n"}))
            .await
        {
            Ok(_) => break,
            Err(e) => {
                assert!(
                    e.to_string().contains("limit of") && Instant::now() < deadline,
                    "END was not accepted: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let out = sub
        .collect_process("slow", Duration::from_secs(60))
        .await
        .expect("the reader exits");
    assert_eq!(out.exit_code(), Some(0), "{}", out.exit);
    let mut want = accepted.concat();
    want.push_str("END\n");
    let stdout = out.stdout_str();
    assert_eq!(stdout.len(), want.len(), "bytes lost or added");
    assert!(stdout == want, "accepted writes arrived out of order");

    pipe.call("stopVM", json!({})).await.expect("stopVM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_pending_limit_fail_at_once_and_stop_still_works() {
    let d = Daemon::start_with(Opts {
        env: vec![
            ("COWORK_LOG".into(), "info".into()),
            (
                cowork_helper::vm::MAX_PENDING_ENV.into(),
                TEST_MAX_PENDING.to_string(),
            ),
            (
                cowork_helper::backend::sandbox::AGENT_WRAPPER_ENV.into(),
                support::fake_agent::wrapper().into(),
            ),
        ],
        ..Opts::default()
    });
    let p = Profile::new(&d, "limits-pending");
    mark_fake(&d, &p);
    let pipe = Pipe::connect_with_timeout(&d.socket, Duration::from_secs(90))
        .await
        .expect("connect");
    pipe.call(
        "configure",
        json!({"userDataName": p.name, "userDataRoot": p.root, "sessionOnly": true}),
    )
    .await
    .expect("configure");
    let mut sub = p.subscribe(&d).await;
    start_vm(&d, &pipe, json!({})).await;

    pipe.call("spawn", fake_spawn("p", "run", &[]))
        .await
        .expect("spawn p");
    pipe.call("spawn", fake_spawn("mute", "never-answer", &[]))
        .await
        .expect("spawn never-answer");

    // One more kill than the limit, all at once: the agent answers none.
    let pipe = Arc::new(pipe);
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..=TEST_MAX_PENDING)
        .map(|_| {
            let pipe = pipe.clone();
            tokio::spawn(async move {
                let r = pipe
                    .call("kill", json!({"id": "p", "signal": "SIGTERM"}))
                    .await
                    .map_err(|e| e.to_string());
                (r, t0.elapsed())
            })
        })
        .collect();
    // The one past the limit comes back at once; the others wait.
    let deadline = Instant::now() + T;
    while !tasks.iter().any(|t| t.is_finished()) {
        assert!(Instant::now() < deadline, "no kill came back as busy");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // stopVM ends the mute agent's VM (its own shutdown request finds the
    // table full and the VM is killed) and fails the waiting requests.
    pipe.call("stopVM", json!({}))
        .await
        .expect("stopVM with an agent that answers nothing");
    let mut all = Vec::new();
    for t in tasks {
        all.push(t.await.expect("kill task"));
    }
    let busy: Vec<_> = all
        .iter()
        .filter_map(|(r, at)| match r {
            Err(e) if e.contains("requests awaiting an answer") => Some((e.clone(), *at)),
            _ => None,
        })
        .collect();
    assert_eq!(
        busy.len(),
        1,
        "exactly the request past the limit fails as busy: {all:?}"
    );
    assert!(
        busy[0]
            .0
            .contains(&format!("already has {TEST_MAX_PENDING} requests")),
        "the error names the limit: {}",
        busy[0].0
    );
    for (r, _) in &all {
        let e = r.as_ref().expect_err("no kill was answered");
        assert!(
            e.contains("requests awaiting") || e.contains("disconnected"),
            "a waiting request fails when the VM stops: {e}"
        );
    }
    // The process the agent could not report on gets its fatal end.
    let out = sub
        .collect_process("p", T)
        .await
        .expect("p ends with the VM");
    assert!(
        out.errors.iter().any(|e| e["fatal"] == true),
        "fatal error for p: {:?}",
        out.errors
    );

    // A new VM (a fresh fake agent, answering again) starts and works.
    start_vm(&d, &pipe, json!({})).await;
    pipe.call("spawn", fake_spawn("e", "echo", &["hello"]))
        .await
        .expect("spawn after restart");
    let out = sub.collect_process("e", T).await.expect("echo");
    assert_eq!(out.stdout_str(), "hello");
    pipe.call("stopVM", json!({})).await.expect("stopVM");
}

/// Spawn parameters of a fake-agent directive (see `support::fake_agent`).
fn fake_spawn(id: &str, directive: &str, args: &[&str]) -> serde_json::Value {
    json!({"id": id, "name": "hostile", "command": directive, "args": args, "isResume": false})
}

/// Turns the fake agent on for profile `p` of `d` (its session directory
/// holds the marker the fake agent looks for).
fn mark_fake(d: &Daemon, p: &Profile) {
    let key = cowork_helper::daemon::profile_key(Some(&p.name), Some(&p.root));
    let sessions = d.data_dir.join("profiles").join(key).join("sessions");
    std::fs::create_dir_all(&sessions).expect("sessions dir");
    std::fs::write(sessions.join(".cowork-fake-agent"), b"").expect("marker");
}
