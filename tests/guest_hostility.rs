//! Guest hostility (issue 11 item 3): a guest agent that misbehaves must
//! not crash, hang or bloat the helper, nor steer the client.
//!
//! The misbehaving agent is the fake agent of `tests/support/fake_agent.rs`
//! (this test binary itself, as its ignored test `fake_agent`), run
//! by the sandbox backend in place of the real agent through the helper's
//! agent-wrapper test hook (`COWORK_TEST_SANDBOX_AGENT_WRAPPER`, read from
//! the helper's environment only). Only profiles whose session directory
//! holds the fake agent's marker get the fake; the others run the real
//! agent in the same helper. The host's link parser (`src/vm/link.rs`) and
//! process table are the same for every backend, so the sandbox exercises
//! what a hostile VM guest could send just as well; the VM-only part, the
//! real agent dying as PID 1 of a real kernel, is `qemu_agent_pid1_death_*`
//! and `kvm_agent_pid1_death_*` (see [`KILL_PID1`] for how).
//!
//! Each case checks, as applicable: the helper stays up and another
//! profile (real agent) keeps working; the helper's peak memory during the
//! misbehaviour stays under a bound (`/proc/<pid>/status` `VmHWM`, reset
//! before each case through `clear_refs`); the client gets a clear error
//! (a method error, or a fatal `error` event plus an `exit` for each
//! running process, as PROTOCOL.md defines them); stopVM works afterwards
//! and startVM works again.
//!
//! The QEMU case is gated like the other QEMU suites (`COWORK_QEMU_TESTS=1`
//! makes missing prerequisites a failure), the kvm case like the other
//! nested suites (`COWORK_NESTED_TESTS=1`).

mod support;

use std::time::{Duration, Instant};

use cowork_helper::client::{Pipe, Subscription};
use serde_json::{json, Value};
use support::daemon::{Daemon, Opts, Profile, T};

support::fake_agent::fake_agent_test!();

/// One case at a time: the floods are CPU heavy and peak memory is read
/// per helper (each test has its own).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Client-side limit of one call: above the helper's own 30 s agent
/// deadline, so its timeout error is what the client sees.
const CALL_LIMIT: Duration = Duration::from_secs(90);

/// Limit for the events of a flood.
const FLOOD_LIMIT: Duration = Duration::from_secs(180);

/// Messages of the floods (each a separate agent message).
const FLOOD: usize = 1_000_000;

/// Guest requests of the request flood.
const REQUEST_FLOOD: usize = 200_000;

/// Bound on the helper's peak memory growth during one flood: its
/// buffers are bounded (8 MiB of undelivered events, 32 frames per
/// subscriber, one 10 MiB agent frame); a table that grew with the
/// messages would need hundreds of MiB for a million of them.
const FLOOD_RSS_BOUND_KIB: u64 = 48 * 1024;

/// Bound on the helper's peak memory growth while an agent that reads
/// nothing is sent stdin: the link queue's byte budget
/// (`cowork_helper::vm::MAX_QUEUED_BYTES`, 16 MiB), the write waiting for
/// room in it (its client frame, decoded request and encoded agent frame,
/// 7 MiB each) and allocator slack; far below the 140 MiB of writes sent.
const STOP_READING_RSS_BOUND_KIB: u64 = 80 * 1024;

/// Size of one stdin write towards the agent that stops reading.
const BIG_WRITE: usize = 7 * 1024 * 1024;

/// Writes pipelined towards the agent that stops reading: 140 MiB, nine
/// times what the link queue may hold.
const DEAF_WRITES: usize = 20;

/// A helper with one real-agent profile and some fake-agent profiles.
struct Rig {
    d: Daemon,
    good: Client,
    bad: Vec<Client>,
}

/// One profile's pipe and subscription.
struct Client {
    profile: Profile,
    pipe: Pipe,
    sub: Subscription,
}

impl Client {
    async fn new(d: &Daemon, name: &str) -> Client {
        let profile = Profile::new(d, name);
        let pipe = Pipe::connect_with_timeout(&d.socket, CALL_LIMIT)
            .await
            .expect("connect");
        pipe.call(
            "configure",
            json!({"userDataName": profile.name, "userDataRoot": profile.root, "sessionOnly": true}),
        )
        .await
        .expect("configure");
        let sub = profile.subscribe(d).await;
        Client { profile, pipe, sub }
    }

    async fn start(&self, d: &Daemon) {
        support::daemon::start_vm(d, &self.pipe, json!({})).await;
    }

    async fn spawn(&self, id: &str, command: &str, args: &[&str]) -> Result<Value, String> {
        self.pipe
            .call(
                "spawn",
                json!({"id": id, "name": "hostile", "command": command, "args": args, "isResume": false}),
            )
            .await
            .map_err(|e| e.to_string())
    }

    /// Waits for process `id`'s fatal `error` event and its `exit`;
    /// returns the error's message.
    async fn fatal_end(&mut self, id: &str) -> String {
        let out = self
            .sub
            .collect_process(id, T)
            .await
            .unwrap_or_else(|e| panic!("no end of {id}: {e}"));
        let fatal = out
            .errors
            .iter()
            .find(|e| e["fatal"] == true)
            .unwrap_or_else(|| panic!("no fatal error event for {id}: {:?}", out.events));
        assert_eq!(out.exit["type"], "exit", "{id} ends with an exit event");
        fatal["message"].as_str().unwrap_or_default().to_string()
    }

    async fn wait_disconnected(&self) {
        support::daemon::wait_guest(&self.pipe, false).await;
    }
}

impl Rig {
    /// A helper with the fake agent available and `bad` fake profiles, all
    /// started.
    async fn new(bad: usize) -> Rig {
        let d = Daemon::start_with(Opts {
            env: vec![
                ("COWORK_LOG".into(), "info".into()),
                (
                    cowork_helper::backend::sandbox::AGENT_WRAPPER_ENV.into(),
                    support::fake_agent::wrapper().into(),
                ),
            ],
            ..Opts::default()
        });
        let good = Client::new(&d, "good").await;
        let mut bads = Vec::new();
        for i in 0..bad {
            let c = Client::new(&d, &format!("bad{i}")).await;
            mark_fake(&d, &c.profile);
            bads.push(c);
        }
        good.start(&d).await;
        for c in &bads {
            c.start(&d).await;
        }
        Rig { d, good, bad: bads }
    }

    /// The helper's current and peak resident memory (KiB).
    fn memory(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.d.pid()))
            .expect("the helper is alive");
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {name} in the helper's status"))
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Resets the helper's peak memory to its current one; returns that.
    fn reset_peak(&self) -> u64 {
        // "5" resets VmHWM (proc(5), clear_refs).
        std::fs::write(format!("/proc/{}/clear_refs", self.d.pid()), b"5")
            .expect("reset the helper's peak RSS");
        self.memory().0
    }

    /// Asserts the peak since [`Rig::reset_peak`] (`base`) grew less than
    /// `bound_kib`.
    fn assert_peak_within(&self, what: &str, base: u64, bound_kib: u64) {
        let (rss, peak) = self.memory();
        eprintln!(
            "guest_hostility: {what}: helper RSS {base} KiB before, peak {peak} KiB, now {rss} KiB"
        );
        assert!(
            peak.saturating_sub(base) < bound_kib,
            "{what}: the helper's peak memory grew by {} KiB (bound {bound_kib} KiB)",
            peak.saturating_sub(base)
        );
    }

    /// The helper is up and the real-agent profile runs a process.
    async fn assert_good_works(&mut self, tag: &str) {
        let id = format!("good-{tag}");
        self.good
            .pipe
            .call(
                "spawn",
                json!({"id": id, "name": "good", "command": "/bin/echo", "args": [tag], "isResume": false}),
            )
            .await
            .unwrap_or_else(|e| panic!("{tag}: the other profile cannot spawn: {e}"));
        let out = self
            .good
            .sub
            .collect_process(&id, T)
            .await
            .unwrap_or_else(|e| panic!("{tag}: the other profile's process: {e}"));
        assert_eq!(out.stdout_str(), format!("{tag}\n"), "{tag}");
        assert_eq!(out.exit_code(), Some(0), "{tag}");
    }

    /// stopVM of fake profile `i` works (within its grace and the kill),
    /// then startVM does, and the new fake agent runs a process.
    async fn assert_bad_restarts(&mut self, i: usize, tag: &str) {
        let c = &mut self.bad[i];
        tokio::time::timeout(Duration::from_secs(60), c.pipe.call("stopVM", json!({})))
            .await
            .unwrap_or_else(|_| panic!("{tag}: stopVM hangs"))
            .unwrap_or_else(|e| panic!("{tag}: stopVM: {e}"));
        assert_eq!(
            c.pipe.call("isRunning", json!({})).await.unwrap()["running"],
            false,
            "{tag}: still running after stopVM"
        );
        c.start(&self.d).await;
        let id = format!("again-{tag}");
        c.spawn(&id, "echo", &["again"])
            .await
            .unwrap_or_else(|e| panic!("{tag}: spawn after restart: {e}"));
        let out = c
            .sub
            .collect_process(&id, T)
            .await
            .unwrap_or_else(|e| panic!("{tag}: {e}"));
        assert_eq!(out.stdout_str(), "again", "{tag}");
    }
}

/// Turns the fake agent on for profile `p` of `d`: its session directory
/// holds the marker the fake agent looks for.
fn mark_fake(d: &Daemon, p: &Profile) {
    let key = cowork_helper::daemon::profile_key(Some(&p.name), Some(&p.root));
    let sessions = d.data_dir.join("profiles").join(key).join("sessions");
    std::fs::create_dir_all(&sessions).expect("sessions dir");
    std::fs::write(sessions.join(".cowork-fake-agent"), b"").expect("marker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_the_link_cannot_parse_close_it_with_a_clear_error() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut rig = Rig::new(1).await;
    let cases = [
        ("oversized-frame", "exceeds the 10485760-byte limit"),
        ("truncated-frame", "closed in the middle of a frame"),
        ("bad-json", "malformed message header"),
        ("wrong-types", "malformed message header: invalid type"),
        ("bad-header-length", "runs past the end of the message"),
        ("second-hello", "a second hello"),
    ];
    for (i, (directive, want)) in cases.into_iter().enumerate() {
        let base = rig.reset_peak();
        let c = &mut rig.bad[0];
        let p = format!("p{i}");
        c.spawn(&p, "run", &[]).await.expect("spawn a process");
        c.spawn(&format!("d{i}"), directive, &[])
            .await
            .unwrap_or_else(|e| panic!("{directive}: the spawn is answered first: {e}"));
        let msg = c.fatal_end(&p).await;
        assert!(
            msg.contains("broke the link protocol") && msg.contains(want),
            "{directive}: the fatal error says what happened: {msg}"
        );
        c.wait_disconnected().await;
        let err = c
            .spawn(&format!("late{i}"), "run", &[])
            .await
            .expect_err("no spawn on a closed link");
        assert!(err.contains("startVM"), "{directive}: {err}");
        rig.assert_peak_within(directive, base, FLOOD_RSS_BOUND_KIB);
        rig.assert_good_works(directive).await;
        rig.assert_bad_restarts(0, directive).await;
    }
    // The fake agent's hello carries a newline and a would-be log line.
    let log = rig.d.log();
    assert!(
        log.contains("agent=\"fake\\n1999-"),
        "the hello is logged escaped: {log}"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("1999-")),
        "a guest forged a helper log line: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unanswered_and_misanswered_requests_time_out_and_stop_still_works() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut rig = Rig::new(3).await;
    // bad0: half a frame, then silence; bad1: answers under wrong ids;
    // bad2: answers nothing at all (not even shutdown).
    for (i, directive) in ["stalled-frame", "wrong-ids", "never-answer"]
        .into_iter()
        .enumerate()
    {
        let c = &rig.bad[i];
        c.spawn("p", "run", &[]).await.expect("spawn a process");
        c.spawn("d", directive, &[]).await.expect(directive);
    }
    // One request each, concurrently: each fails after the helper's own
    // deadline with an error saying so.
    let kill = json!({"id": "p", "signal": "SIGTERM"});
    let (a, b, c) = tokio::join!(
        rig.bad[0].pipe.call("kill", kill.clone()),
        rig.bad[1].pipe.call("kill", kill.clone()),
        rig.bad[2].pipe.call("kill", kill.clone()),
    );
    for (what, r) in [("stalled-frame", a), ("wrong-ids", b), ("never-answer", c)] {
        let e = r.expect_err("no answer").to_string();
        assert!(
            e.contains("did not answer kill within 30s"),
            "{what}: the client is told the agent did not answer: {e}"
        );
    }
    rig.assert_good_works("unanswered").await;
    for (i, directive) in ["stalled-frame", "wrong-ids", "never-answer"]
        .into_iter()
        .enumerate()
    {
        // stopVM ends the VM even though the agent does not answer its
        // shutdown; the process it ran gets its fatal end.
        tokio::time::timeout(
            Duration::from_secs(60),
            rig.bad[i].pipe.call("stopVM", json!({})),
        )
        .await
        .unwrap_or_else(|_| panic!("{directive}: stopVM hangs"))
        .unwrap_or_else(|e| panic!("{directive}: stopVM: {e}"));
        if directive == "wrong-ids" {
            // That agent did kill p (its answer only had the wrong id) and
            // reported the exit.
            let out = rig.bad[i].sub.collect_process("p", T).await.expect("p");
            assert_eq!(out.signal(), Some("SIGKILL"), "{directive}: {}", out.exit);
        } else {
            let msg = rig.bad[i].fatal_end("p").await;
            assert!(msg.contains("killed"), "{directive}: {msg}");
        }
        rig.assert_bad_restarts(i, directive).await;
    }
    let log = rig.d.log();
    assert!(
        log.contains("stray_answers="),
        "the wrong-id answers were counted: {log}"
    );
}

/// Reads events of `c` until `done(event)`; returns how many events were
/// seen and the last one. `each` sees every event.
async fn read_until(
    c: &mut Client,
    what: &str,
    mut each: impl FnMut(&Value),
    done: impl Fn(&Value) -> bool,
) -> usize {
    let deadline = Instant::now() + FLOOD_LIMIT;
    let mut n = 0;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let ev = c
            .sub
            .next_event(left)
            .await
            .unwrap_or_else(|e| panic!("{what}: after {n} events: {e}"));
        n += 1;
        each(&ev);
        if done(&ev) {
            return n;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_of_messages_keep_the_helpers_memory_bounded() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut rig = Rig::new(1).await;
    let n = FLOOD.to_string();

    // 1. Output, exits and errors for processes the host never spawned:
    // dropped (no events, no records), the link stays up.
    let base = rig.reset_peak();
    let c = &mut rig.bad[0];
    c.spawn("ghosts", "flood-unknown", &[&n])
        .await
        .expect("flood-unknown");
    let mut ghost_events = 0;
    read_until(
        c,
        "flood-unknown",
        |ev| {
            if ev["id"].as_str().is_some_and(|id| id.starts_with("ghost-")) {
                ghost_events += 1;
            }
        },
        |ev| ev["type"] == "stdout" && ev["id"] == "ghosts" && ev["data"] == "done",
    )
    .await;
    assert_eq!(ghost_events, 0, "events for processes nobody spawned");
    rig.assert_peak_within("flood of unknown ids", base, FLOOD_RSS_BOUND_KIB);
    rig.assert_good_works("flood-unknown").await;
    let c = &mut rig.bad[0];
    c.spawn("still", "echo", &["up"])
        .await
        .expect("the link survives a flood of unknown ids");
    let out = c.sub.collect_process("still", T).await.expect("still");
    assert_eq!(out.stdout_str(), "up");

    // 2. A million one-byte outputs of a real process, read by the client:
    // all arrive, in order.
    let base = rig.reset_peak();
    let c = &mut rig.bad[0];
    c.spawn("chatty", "flood-stdout", &[&n])
        .await
        .expect("flood-stdout");
    let mut bytes = Vec::with_capacity(FLOOD);
    read_until(
        c,
        "flood-stdout",
        |ev| {
            if ev["type"] == "stdout" && ev["id"] == "chatty" {
                bytes.extend_from_slice(ev["data"].as_str().unwrap_or_default().as_bytes());
            }
        },
        |ev| ev["type"] == "exit" && ev["id"] == "chatty",
    )
    .await;
    assert_eq!(bytes.len(), FLOOD, "output bytes lost or added");
    assert!(
        bytes
            .iter()
            .enumerate()
            .all(|(i, b)| *b == b'0' + (i % 10) as u8),
        "output reordered"
    );
    rig.assert_peak_within("flood of small outputs, read", base, FLOOD_RSS_BOUND_KIB);

    // 3. The same with nobody subscribed: the undelivered buffer is
    // bounded; a later subscriber gets its tail, the exit last.
    let base = rig.reset_peak();
    let c = &mut rig.bad[0];
    let name = c.profile.name.clone();
    let root = c.profile.root.clone();
    let sub = std::mem::replace(
        &mut c.sub,
        Subscription::connect(&rig.d.socket, "nobody", "/nowhere")
            .await
            .expect("placeholder subscription"),
    );
    drop(sub);
    // Let the helper notice the subscriber left.
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.spawn("unheard", "flood-stdout", &[&n])
        .await
        .expect("flood-stdout");
    let deadline = Instant::now() + FLOOD_LIMIT;
    loop {
        let r = c
            .pipe
            .call("isProcessRunning", json!({"id": "unheard"}))
            .await
            .expect("isProcessRunning");
        if r["running"] == false {
            break;
        }
        assert!(Instant::now() < deadline, "the unheard flood never ended");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rig.assert_peak_within("flood of outputs nobody reads", base, FLOOD_RSS_BOUND_KIB);
    let c = &mut rig.bad[0];
    c.sub = Subscription::connect(&rig.d.socket, &name, &root)
        .await
        .expect("resubscribe");
    let mut kept = 0;
    let seen = read_until(
        c,
        "undelivered tail",
        |ev| {
            if ev["id"] == "unheard" {
                kept += 1;
            }
        },
        |ev| ev["type"] == "exit" && ev["id"] == "unheard",
    )
    .await;
    assert!(
        kept <= cowork_helper::events::UNDELIVERED_MAX_EVENTS && seen <= kept + 8,
        "{kept} of the flood's events were kept for the next subscriber"
    );

    // 4. Guest requests: each reaches the client once.
    let base = rig.reset_peak();
    let c = &mut rig.bad[0];
    c.spawn("asker", "flood-requests", &[&REQUEST_FLOOD.to_string()])
        .await
        .expect("flood-requests");
    let mut requests = 0;
    read_until(
        c,
        "flood-requests",
        |ev| {
            if ev["type"] == "request" && ev["method"] == "fake/flood" {
                requests += 1;
            }
        },
        |ev| ev["type"] == "stdout" && ev["id"] == "asker" && ev["data"] == "done",
    )
    .await;
    assert_eq!(requests, REQUEST_FLOOD, "guest requests lost or added");
    rig.assert_peak_within("flood of guest requests", base, FLOOD_RSS_BOUND_KIB);

    rig.assert_good_works("floods").await;
    rig.assert_bad_restarts(0, "floods").await;
    let log = rig.d.log();
    let want = format!("unknown_process={}", FLOOD + 2 * FLOOD.div_ceil(8));
    assert!(
        log.contains(&want),
        "the dropped messages were counted once ({want}): {}",
        log.lines()
            .filter(|l| l.contains("dropped"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_stops_reading_cannot_make_the_helper_queue_without_bound() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut rig = Rig::new(1).await;
    let base = rig.reset_peak();
    let c = &rig.bad[0];
    c.spawn("p", "run", &[]).await.expect("spawn a process");
    c.spawn("deaf", "stop-reading", &[])
        .await
        .expect("stop-reading");
    // Pipelined writes, more than the link queue's byte budget holds.
    let pipe = std::sync::Arc::new(
        Pipe::connect_with_timeout(&rig.d.socket, CALL_LIMIT)
            .await
            .expect("connect"),
    );
    pipe.call(
        "configure",
        json!({"userDataName": c.profile.name, "userDataRoot": c.profile.root, "sessionOnly": true}),
    )
    .await
    .expect("configure");
    let data = std::sync::Arc::new("x".repeat(BIG_WRITE));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..DEAF_WRITES {
        let (pipe, data, tx) = (pipe.clone(), data.clone(), tx.clone());
        tokio::spawn(async move {
            let r = pipe
                .call("writeStdin", json!({"id": "p", "data": *data}))
                .await
                .map_err(|e| e.to_string());
            let _ = tx.send(r);
        });
    }
    drop(tx);
    // The first write that finds no room fails after the helper's deadline.
    let mut results = Vec::new();
    let not_reading = loop {
        let r = rx.recv().await.expect("every write gets an answer");
        if let Err(e) = &r {
            if e.contains("not reading its link") {
                break e.clone();
            }
        }
        results.push(r);
    };
    assert!(not_reading.contains("writeStdin"), "{not_reading}");
    rig.assert_peak_within(
        "stdin towards a deaf agent",
        base,
        STOP_READING_RSS_BOUND_KIB,
    );
    rig.assert_good_works("deaf").await;
    // stopVM (the agent never reads its shutdown) ends the rest.
    tokio::time::timeout(
        Duration::from_secs(60),
        rig.bad[0].pipe.call("stopVM", json!({})),
    )
    .await
    .expect("stopVM hangs")
    .expect("stopVM");
    while let Some(r) = rx.recv().await {
        results.push(r);
    }
    assert_eq!(results.len(), DEAF_WRITES - 1, "every write was answered");
    for r in &results {
        let e = r.as_ref().expect_err("no write to a deaf agent succeeds");
        assert!(
            e.contains("not reading its link")
                || e.contains("did not answer writeStdin")
                || e.contains("disconnected")
                || e.contains("call startVM first"),
            "{e}"
        );
    }
    rig.assert_bad_restarts(0, "deaf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_dying_ends_its_processes_and_start_works_again() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut rig = Rig::new(1).await;
    // The sandbox's PID 1 exits, or faults (a real SIGSEGV).
    for (i, (directive, args)) in [("exit", &["3"][..]), ("crash", &[][..])]
        .into_iter()
        .enumerate()
    {
        let c = &mut rig.bad[0];
        let p = format!("p{i}");
        c.spawn(&p, "run", &[]).await.expect("spawn a process");
        // The agent answers this spawn, then dies: the helper notices the
        // death at about the time the answer arrives, and still reads what
        // the agent wrote before it died, so the answer is the answer.
        c.spawn(&format!("d{i}"), directive, args)
            .await
            .unwrap_or_else(|e| panic!("{directive}: the spawn answered before the death: {e}"));
        let msg = c.fatal_end(&p).await;
        assert!(
            msg.contains("the VM stopped unexpectedly"),
            "{directive}: the fatal error says the VM stopped: {msg}"
        );
        c.wait_disconnected().await;
        let deadline = Instant::now() + T;
        while c.pipe.call("isRunning", json!({})).await.unwrap()["running"] != false {
            assert!(Instant::now() < deadline, "{directive}: still running");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        rig.assert_good_works(directive).await;
        rig.assert_bad_restarts(0, directive).await;
    }
    // The log is read from the helper's stderr by a thread: under load the
    // crash's line can land a moment after the fatal event did.
    let logged = rig
        .d
        .wait_log(T, |log| log.contains("the agent was killed by SIGSEGV"));
    let log = rig.d.log();
    assert!(
        logged,
        "the crash is logged as one: {}",
        log.lines()
            .filter(|l| l.contains("sandbox ended") || l.contains("ended unexpectedly"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Session whose processes run as guest root in the QEMU case (the
/// helper's `COWORK_GUEST_ROOT_SESSION` test hook).
const ROOT_SESSION: &str = "guestroot";

/// Limit of a QEMU (TCG) startVM; the machine is shared with other tests.
const QEMU_START_LIMIT: Duration = Duration::from_secs(180);

/// How the QEMU case kills the agent, PID 1 of the guest. PID 1 ignores
/// every signal it has no handler for when it comes from inside its own
/// namespace (SIGKILL included), so `kill -9 1` as root does nothing. A
/// fault is different: the kernel forces the signal of a trap on the
/// faulting task, clearing init's protection. So guest root overwrites
/// the agent's code, every executable mapping of `/proc/1/maps`, with
/// `int3` (0xCC) through `/proc/1/mem`; the next instruction PID 1 runs
/// traps, SIGTRAP kills it, the kernel panics ("Attempted to kill init"),
/// and `panic=-1` with QEMU's `-no-reboot` ends the machine: exactly a
/// crashing agent. The script's own exit is never reported.
const KILL_PID1: &str = r#"set -e
head -c 1048576 /dev/zero | tr '\000' '\314' > /tmp/int3
grep ' r-xp ' /proc/1/maps | while read -r range rest; do
  start=$((0x${range%-*})); end=$((0x${range#*-}))
  pages=$(( (end - start) / 4096 ))
  while [ "$pages" -gt 0 ]; do
    n=$pages; [ "$n" -gt 256 ] && n=256
    dd if=/tmp/int3 of=/proc/1/mem bs=4096 seek=$((start / 4096)) count=$n conv=notrunc 2>/dev/null
    start=$((start + n * 4096)); pages=$((pages - n))
  done
done
sleep 600
"#;

/// Guest-root `sh -c` of [`KILL_PID1`] (the busybox userland has `sh`).
fn kill_pid1_spawn() -> Value {
    support::session::sh("killer", ROOT_SESSION, KILL_PID1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_agent_pid1_death_is_a_fatal_end_and_start_works_again() {
    use support::gate::{qemu_gate, qemu_missing};
    use support::vm_helper::{self, built_helper};
    if !qemu_gate(
        "qemu_agent_pid1_death",
        "the QEMU guest-hostility test",
        [
            qemu_missing(),
            vm_helper::image_for(&built_helper())
                .err()
                .map(|e| format!("no guest image ({e}); build it with scripts/mkguestimage.sh")),
        ],
    ) {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    pid1_death(
        "qemu",
        &std::env::temp_dir(),
        &["--userland", "initramfs"],
        QEMU_START_LIMIT,
    )
    .await;
}

/// Name of the kvm variant (what its nested re-run selects).
const KVM_TEST: &str = "kvm_agent_pid1_death_is_a_fatal_end_and_start_works_again";

/// Set (to 1) on the kvm variant's re-run inside the nested harness.
const KVM_INSIDE_ENV: &str = "COWORK_HOSTILE_KVM_INSIDE";

/// Line the kvm variant's body prints when all its checks passed.
const KVM_OK_MARKER: &str = "guest_hostility kvm: ok";

/// Limit of a startVM in the kvm variant (nested harness: TCG speed).
const KVM_START_LIMIT: Duration = Duration::from_secs(300);

/// The same under `--backend kvm`: directly where this host's KVM boots
/// Linux, else re-run inside the nested-KVM harness (gated by
/// `COWORK_NESTED_TESTS` like the other nested suites). The kvm kernel
/// command line has `panic=-1 reboot=k`: the panic resets the machine,
/// which ends the in-process VM.
#[test]
fn kvm_agent_pid1_death_is_a_fatal_end_and_start_works_again() {
    use support::nested::{self, Mode};
    use support::vm_helper::{self, built_helper};
    let inside = std::env::var(KVM_INSIDE_ENV).is_ok_and(|v| v == "1");
    let mode = if inside { Mode::Direct } else { nested::mode() };
    if !inside {
        if let Err(why) = vm_helper::image_for(&built_helper()) {
            let reason = format!("no guest image ({why}); build it with scripts/mkguestimage.sh");
            assert!(
                !nested::nested_tests_required(),
                "COWORK_NESTED_TESTS=1: {reason}"
            );
            nested::unavailable(KVM_TEST, &reason);
            return;
        }
        if mode == Mode::Nested {
            if let Err(missing) = nested::harness_check() {
                nested::unavailable(
                    KVM_TEST,
                    &format!("the nested-KVM harness is not usable: {missing}"),
                );
                return;
            }
        }
    }
    match mode {
        Mode::Direct => {
            // Inside the harness `/` is the host's over virtiofs: the
            // helper's files go to the L1 guest's own tmpfs.
            let base = if inside {
                std::path::PathBuf::from("/dev/shm")
            } else {
                std::env::temp_dir()
            };
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(async {
                    let _one = ONE_AT_A_TIME.lock().await;
                    pid1_death("kvm", &base, &["--userland", "initramfs"], KVM_START_LIMIT).await;
                });
            // On its own line: libtest has printed "test … " without one.
            println!("\n{KVM_OK_MARKER}");
        }
        Mode::Nested => nested::rerun_test(&nested::Rerun {
            test: KVM_TEST,
            inside_env: KVM_INSIDE_ENV,
            ok_marker: KVM_OK_MARKER,
            report_prefix: "guest_hostility: ",
            verbose_env: "COWORK_KVM_E2E_VERBOSE",
            inner_timeout: Duration::from_secs(900),
            harness_timeout: Duration::from_secs(960),
            attempts: 3,
        }),
    }
}

/// Boots `backend` (helper files under `base`, extra helper `args`),
/// kills the agent as PID 1 ([`KILL_PID1`]) and checks what the client
/// sees, then that a new boot works.
async fn pid1_death(backend: &str, base: &std::path::Path, args: &[&str], start_limit: Duration) {
    use support::vm_helper::{built_helper, VmHelper, QEMU_VERBOSE_ENV};
    // The helper inherits it; the sandbox cases of this file ignore it.
    std::env::set_var(
        cowork_helper::backend::guest::GUEST_ROOT_SESSION_ENV,
        ROOT_SESSION,
    );
    let mut helper = VmHelper::start_temp_with(
        &built_helper(),
        "cowork-hostile-",
        base,
        backend,
        args,
        Duration::from_secs(30),
    );
    let (pipe, mut sub) = support::session::client(
        &helper,
        &format!("hostile-{backend}"),
        &format!("/tmp/hostile-{backend}-profile"),
        start_limit,
    )
    .await;
    let params = json!({"memoryGB": 1, "cpuCount": 1});
    support::session::start_vm(&pipe, &helper, params.clone(), start_limit, "boot").await;

    // A process of an ordinary session, then guest root kills PID 1.
    pipe.call("spawn", support::session::sh("victim", "s1", "sleep 600"))
        .await
        .expect("spawn victim");
    pipe.call("spawn", kill_pid1_spawn())
        .await
        .expect("spawn the killer");
    let out = sub
        .collect_process("victim", start_limit)
        .await
        .unwrap_or_else(|e| panic!("no end of the victim: {e}\n{}", helper.log_text()));
    let fatal = out
        .errors
        .iter()
        .find(|e| e["fatal"] == true)
        .unwrap_or_else(|| panic!("no fatal error: {:?}\n{}", out.events, helper.log_text()));
    assert!(
        fatal["message"]
            .as_str()
            .is_some_and(|m| m.contains("the VM stopped unexpectedly")),
        "{fatal}"
    );
    assert_eq!(out.exit["type"], "exit");
    let deadline = Instant::now() + start_limit;
    loop {
        let running = pipe.call("isRunning", json!({})).await.unwrap()["running"] == true;
        let connected =
            pipe.call("isGuestConnected", json!({})).await.unwrap()["connected"] == true;
        if !running && !connected {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dead machine still counts as running ({running}) or connected ({connected})\n{}",
            helper.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = helper.log_text();
    assert!(
        log.contains("Attempted to kill init"),
        "the guest console shows PID 1 dying: {log}"
    );

    // stopVM of the dead machine, then a new boot works.
    pipe.call("stopVM", json!({}))
        .await
        .expect("stopVM after the death");
    support::session::start_vm(&pipe, &helper, params, start_limit, "reboot").await;
    let out = support::session::run(
        &pipe,
        &mut sub,
        support::session::sh("after", "s1", "echo alive"),
        start_limit,
    )
    .await;
    assert_eq!(out.stdout_str(), "alive\n", "{}", out.exit);
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    helper.stop_clean(QEMU_VERBOSE_ENV);
}
