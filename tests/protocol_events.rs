//! Events and profiles: startup steps, networkStatus, apiReachability,
//! replay to a late subscriber, fan-out to several subscribers, profile
//! isolation, and stopVM. One shared helper; every test uses its own
//! profiles (hence its own sandboxes), since these are per-profile facts.

mod support;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use cowork_helper::client::{encode_frame, request, ClientError, RawConn, Subscription};
use serde_json::{json, Value};
use support::daemon::*;

fn is_step(ev: &Value, step: &str, status: &str) -> bool {
    ev["type"] == json!("startupStep") && ev["step"] == json!(step) && ev["status"] == json!(status)
}

/// Waits for each of `wanted` in turn (each must come after the previous one).
async fn expect_in_order(sub: &mut Subscription, wanted: &[(&str, &str)], who: &str) {
    let mut seen = Vec::new();
    for (step, status) in wanted {
        let ev = sub
            .next_matching(T, |e| is_step(e, step, status))
            .await
            .unwrap_or_else(|e| {
                panic!("{who}: no startupStep {step}/{status} after {seen:?}: {e}")
            });
        seen.push(ev);
    }
}

/// A tiny HTTP server answering every request with `status`; records
/// request lines.
fn http_server(status: &'static str) -> (u16, Arc<Mutex<Vec<String>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            let s = s.clone();
            std::thread::spawn(move || {
                c.set_read_timeout(Some(Duration::from_secs(5))).ok();
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&buf);
                s.lock()
                    .unwrap()
                    .push(text.lines().next().unwrap_or("").to_string());
                let _ = write!(
                    c,
                    "HTTP/1.1 {status}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                );
            });
        }
    });
    (port, seen)
}

#[tokio::test]
async fn startup_steps_reach_every_subscriber_live() {
    let d = shared();
    let p = Profile::new(d, &uid("boot"));
    let pipe = p.pipe(d).await;
    let mut early = p.subscribe(d).await;
    let mut early2 = p.subscribe(d).await;
    start_vm(d, &pipe, json!({})).await;

    let boot = [
        ("vm_boot", "started"),
        ("vm_boot", "completed"),
        ("guest_vsock_connect", "started"),
        ("guest_vsock_connect", "completed"),
    ];
    expect_in_order(&mut early, &boot, "early subscriber").await;
    expect_in_order(&mut early2, &boot, "second early subscriber").await;
    let net = early
        .next_of_type("networkStatus", T)
        .await
        .expect("networkStatus on guest connect");
    assert!(
        net["status"].as_str().is_some_and(|s| !s.is_empty()),
        "{net}"
    );
    let api = early
        .next_of_type("apiReachability", T)
        .await
        .expect("apiReachability during startup");
    assert_eq!(
        api["status"],
        json!("unknown"),
        "no apiProbeURL → unknown: {api}"
    );

    // installSdk is the sdk_install step.
    let host = tempfile::tempdir().unwrap();
    let dir = host.path().join("sdk").join("1.0.0");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("claude"), "#!/bin/sh\necho cli\n").unwrap();
    std::fs::set_permissions(dir.join("claude"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(host.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    pipe.call(
        "installSdk",
        json!({"sdkSubpath": rel(&host.path().join("sdk")), "version": "1.0.0"}),
    )
    .await
    .expect("installSdk");
    expect_in_order(
        &mut early,
        &[("sdk_install", "started"), ("sdk_install", "completed")],
        "early subscriber",
    )
    .await;

    // A subscriber arriving later still learns the current network and API state.
    let mut late = p.subscribe(d).await;
    let net2 = late
        .next_of_type("networkStatus", T)
        .await
        .expect("current networkStatus for a new subscriber");
    assert_eq!(net2["status"], net["status"]);
    let api2 = late
        .next_of_type("apiReachability", T)
        .await
        .expect("current apiReachability for a new subscriber");
    assert_eq!(api2["status"], json!("unknown"));

    // All subscribers of the profile get a process's events.
    let id = uid("fan");
    pipe.call("spawn", sh(&id, "fan", "echo fan-out"))
        .await
        .unwrap();
    for (who, s) in [
        ("early", &mut early),
        ("early2", &mut early2),
        ("late", &mut late),
    ] {
        let out = s
            .collect_process(&id, T)
            .await
            .unwrap_or_else(|e| panic!("{who}: {e}"));
        assert_eq!(out.stdout_str(), "fan-out\n", "{who}");
        assert_eq!(out.exit_code(), Some(0), "{who}");
    }
    pipe.call("stopVM", Value::Null).await.unwrap();
}

#[tokio::test]
async fn startup_events_wait_for_a_subscriber_that_comes_after_start_vm() {
    let d = shared();
    let p = Profile::new(d, &uid("replay"));
    let pipe = p.pipe(d).await;
    // Nobody subscribed during the whole startup.
    start_vm(d, &pipe, json!({})).await;
    let host = tempfile::tempdir().unwrap();
    let dir = host.path().join("sdk").join("1.0.0");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("claude"), "#!/bin/sh\necho cli\n").unwrap();
    std::fs::set_permissions(dir.join("claude"), std::fs::Permissions::from_mode(0o755)).unwrap();
    pipe.call(
        "installSdk",
        json!({"sdkSubpath": rel(&host.path().join("sdk")), "version": "1.0.0"}),
    )
    .await
    .expect("installSdk");
    let mut late = p.subscribe(d).await;
    expect_in_order(
        &mut late,
        &[
            ("vm_boot", "started"),
            ("vm_boot", "completed"),
            ("guest_vsock_connect", "started"),
            ("guest_vsock_connect", "completed"),
            ("sdk_install", "started"),
            ("sdk_install", "completed"),
        ],
        "late subscriber",
    )
    .await;
    let net = late
        .next_of_type("networkStatus", T)
        .await
        .expect("networkStatus replayed");
    assert!(net["status"].is_string(), "{net}");
    let api = late
        .next_of_type("apiReachability", T)
        .await
        .expect("apiReachability replayed");
    assert_eq!(api["status"], json!("unknown"), "{api}");
    // A failing installSdk is the sdk_install step failing.
    remote_err(
        pipe.call(
            "installSdk",
            json!({"sdkSubpath": rel(&host.path().join("sdk")), "version": "0.0.404"}),
        )
        .await,
        "installSdk of a missing version",
    );
    expect_in_order(
        &mut late,
        &[("sdk_install", "failed")],
        "subscriber after a failed installSdk",
    )
    .await;
    pipe.call("stopVM", Value::Null).await.unwrap();
}

#[tokio::test]
async fn api_reachability_probes_the_url() {
    let d = shared();
    // The probe dials through the egress dialer, whose address guard refuses
    // the host's loopback for sessions and so for the probe: a server there
    // (even one answering) is unreachable and never sees a request. The
    // reachable case needs a server that is neither loopback nor one of the
    // host's addresses: tests/egress_vm.rs probes one in a test network
    // namespace.
    let (port, seen) = http_server("503 Service Unavailable");
    let p = Profile::new(d, &uid("api-loop"));
    let pipe = p.pipe(d).await;
    let mut sub = p.subscribe(d).await;
    start_vm(
        d,
        &pipe,
        json!({"apiProbeURL": format!("http://127.0.0.1:{port}/api/hello")}),
    )
    .await;
    let ev = sub.next_of_type("apiReachability", T).await.unwrap();
    assert_eq!(ev["status"], json!("unreachable"), "{ev}");
    let lines = seen.lock().unwrap().clone();
    assert!(
        lines.is_empty(),
        "the guard must stop the probe before it connects: {lines:?}"
    );
    pipe.call("stopVM", Value::Null).await.unwrap();

    // A port nobody listens on.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let p = Profile::new(d, &uid("api-down"));
    let pipe = p.pipe(d).await;
    let mut sub = p.subscribe(d).await;
    start_vm(
        d,
        &pipe,
        json!({"apiProbeURL": format!("http://127.0.0.1:{dead}/")}),
    )
    .await;
    let ev = sub.next_of_type("apiReachability", T).await.unwrap();
    assert_eq!(ev["status"], json!("unreachable"), "{ev}");
    pipe.call("stopVM", Value::Null).await.unwrap();
}

#[tokio::test]
async fn profiles_are_isolated() {
    let d = shared();
    let a = Profile::new(d, &uid("prof-a"));
    let b = Profile::new(d, &uid("prof-b"));
    let (pa, pb) = (a.pipe(d).await, b.pipe(d).await);
    start_vm(d, &pa, json!({})).await;
    start_vm(d, &pb, json!({})).await;
    let (mut sa, mut sb) = (a.subscribe(d).await, b.subscribe(d).await);

    let ida = uid("in-a");
    let out = run(
        &pa,
        &mut sa,
        sh(&ida, "sess-a", "echo from-a > f && echo from-a"),
    )
    .await;
    assert_eq!(out.stdout_str(), "from-a\n");
    let live_a = uid("live-a");
    pa.call("spawn", json!({"id": live_a, "name": "sess-a", "command": "/bin/cat", "args": [], "isResume": false}))
        .await
        .unwrap();
    // B runs a process to completion: a barrier for its event stream.
    let idb = uid("in-b");
    let out = run(&pb, &mut sb, sh(&idb, "sess-b", "echo from-b")).await;
    assert_eq!(out.stdout_str(), "from-b\n");
    let leaked: Vec<_> = sb
        .stashed()
        .filter(|e| e["id"] == json!(ida) || e["id"] == json!(live_a))
        .cloned()
        .collect();
    assert!(leaked.is_empty(), "profile B saw A's events: {leaked:?}");
    assert!(
        !sa.stashed().any(|e| e["id"] == json!(idb)),
        "profile A saw B's events"
    );

    // B can neither see nor kill A's process, nor read A's session.
    match pb.call("isProcessRunning", json!({"id": live_a})).await {
        Ok(r) => assert_eq!(r["running"], json!(false), "B sees A's process: {r}"),
        Err(ClientError::Remote(_)) => {}
        Err(e) => panic!("{e}"),
    }
    let _ = pb
        .call("kill", json!({"id": live_a, "signal": "SIGKILL"}))
        .await;
    let r = pa
        .call("isProcessRunning", json!({"id": live_a}))
        .await
        .unwrap();
    assert_eq!(r["running"], json!(true), "B's kill reached A's process");
    match pb
        .call(
            "readFile",
            json!({"processName": "sess-a", "filePath": "f"}),
        )
        .await
    {
        Err(ClientError::Remote(_)) => {}
        Ok(v) => panic!("profile B read A's session file: {v}"),
        Err(e) => panic!("{e}"),
    }
    let r = pa
        .call(
            "readFile",
            json!({"processName": "sess-a", "filePath": "f"}),
        )
        .await
        .unwrap();
    let content = base64::engine::general_purpose::STANDARD
        .decode(r["content"].as_str().unwrap())
        .unwrap();
    assert_eq!(content, b"from-a\n");
    let info = pb
        .call("getSessionsDiskInfo", json!({"lowWaterBytes": 0}))
        .await
        .unwrap();
    assert!(
        !info["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["name"] == json!("sess-a")),
        "B lists A's session: {info}"
    );

    // Stopping B leaves A running.
    pb.call("stopVM", Value::Null).await.unwrap();
    assert_eq!(
        pb.call("isRunning", Value::Null).await.unwrap()["running"],
        json!(false)
    );
    assert_eq!(
        pa.call("isRunning", Value::Null).await.unwrap()["running"],
        json!(true)
    );
    assert_eq!(
        pa.call("isProcessRunning", json!({"id": live_a}))
            .await
            .unwrap()["running"],
        json!(true)
    );
    pa.call("stopVM", Value::Null).await.unwrap();
    let out = sa.collect_process(&live_a, T).await.unwrap();
    assert!(out.exit["type"] == json!("exit"));
}

#[tokio::test]
async fn stop_vm_ends_processes_and_sessions_survive_restart() {
    let d = shared();
    let p = Profile::new(d, &uid("stop"));
    let pipe = p.pipe(d).await;
    start_vm(d, &pipe, json!({})).await;
    let mut sub = p.subscribe(d).await;
    let connected = sub.next_of_type("networkStatus", T).await.unwrap()["status"].clone();
    run_ok(
        &pipe,
        &mut sub,
        &uid("keep"),
        "persist",
        "echo kept > kept.txt",
    )
    .await;
    let ids = [uid("sleep"), uid("cat")];
    pipe.call("spawn", json!({"id": ids[0], "name": "persist", "command": "/bin/sleep", "args": ["100"], "isResume": false}))
        .await
        .unwrap();
    pipe.call("spawn", json!({"id": ids[1], "name": "other", "command": "/bin/cat", "args": [], "isResume": false}))
        .await
        .unwrap();

    pipe.call("stopVM", Value::Null).await.expect("stopVM");
    for id in &ids {
        let out = sub
            .collect_process(id, T)
            .await
            .unwrap_or_else(|e| panic!("no exit event for {id} after stopVM: {e}"));
        assert!(
            out.signal().is_some() || out.exit_code().is_some(),
            "{}",
            out.exit
        );
    }
    let net = sub
        .next_matching(T, |e| {
            e["type"] == json!("networkStatus") && e["status"] != connected
        })
        .await
        .expect("networkStatus on guest disconnect");
    assert!(net["status"].is_string());
    assert_eq!(
        pipe.call("isRunning", Value::Null).await.unwrap()["running"],
        json!(false)
    );
    assert_eq!(
        pipe.call("isGuestConnected", Value::Null).await.unwrap()["connected"],
        json!(false)
    );
    for id in &ids {
        match pipe.call("isProcessRunning", json!({"id": id})).await {
            Ok(r) => assert_eq!(r["running"], json!(false), "{r}"),
            Err(ClientError::Remote(_)) => {}
            Err(e) => panic!("{e}"),
        }
    }
    // Start again: the session disk survived.
    start_vm(d, &pipe, json!({})).await;
    let r = pipe
        .call(
            "readFile",
            json!({"processName": "persist", "filePath": "kept.txt"}),
        )
        .await
        .expect("session file after restart");
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(r["content"].as_str().unwrap())
            .unwrap(),
        b"kept\n"
    );
    let info = pipe
        .call("getSessionsDiskInfo", json!({"lowWaterBytes": 0}))
        .await
        .unwrap();
    assert!(
        info["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["name"] == json!("persist")),
        "{info}"
    );
    pipe.call("stopVM", Value::Null).await.unwrap();
}

#[tokio::test]
async fn slow_start_does_not_delay_status_calls() {
    let d = shared();
    let p = Profile::new(d, &uid("slow"));
    let pipe = p.pipe(d).await;
    let bundle = d.dir.join("bundle");
    std::fs::create_dir_all(&bundle).unwrap();
    // startVM and status calls in flight together on one pipe.
    let start = {
        let pipe = pipe.clone();
        let bundle = bundle.to_string_lossy().into_owned();
        tokio::spawn(async move { pipe.call("startVM", json!({"bundlePath": bundle})).await })
    };
    for _ in 0..20 {
        let r = pipe.call("isRunning", Value::Null).await.unwrap();
        assert!(r["running"].is_boolean());
        let r = pipe.call("isGuestConnected", Value::Null).await.unwrap();
        assert!(r["connected"].is_boolean());
    }
    start.await.unwrap().expect("startVM");
    wait_guest(&pipe, true).await;
    // A second startVM while running is harmless (the client re-sends it).
    pipe.call("startVM", json!({"bundlePath": bundle.to_string_lossy()}))
        .await
        .expect("startVM while running");
    assert_eq!(
        pipe.call("isRunning", Value::Null).await.unwrap()["running"],
        json!(true)
    );
    pipe.call("stopVM", Value::Null).await.unwrap();
}

/// `configure` sent back to back with the next request on a fresh pipe
/// (without awaiting its reply) must apply to that request.
#[tokio::test]
async fn pipelined_configure_applies_to_the_next_request() {
    let d = Daemon::start();
    let started = Profile::new(&d, "started");
    let pipe = started.pipe(&d).await;
    start_vm(&d, &pipe, json!({})).await;
    let mut wrong = 0;
    for _ in 0..40 {
        // Make another profile the last configured one.
        Profile::new(&d, "idle").pipe(&d).await;
        let mut raw = RawConn::connect(&d.socket).await.unwrap();
        let mut wire = encode_frame(
            &serde_json::to_vec(&request(
                "configure",
                Some(json!(1)),
                json!({"userDataName": started.name, "userDataRoot": started.root, "sessionOnly": true}),
            ))
            .unwrap(),
        );
        wire.extend(encode_frame(
            &serde_json::to_vec(&request("isRunning", Some(json!(2)), Value::Null)).unwrap(),
        ));
        raw.send_bytes(&wire).await.unwrap();
        for _ in 0..2 {
            let r = raw.read_reply(T).await.unwrap().expect("reply");
            if r["id"] == json!(2) && r["result"]["running"] != json!(true) {
                wrong += 1;
            }
        }
    }
    assert_eq!(
        wrong, 0,
        "isRunning sent right after configure ran against another profile {wrong}/40 times"
    );
    pipe.call("stopVM", Value::Null).await.unwrap();
}

/// installSdk may come before the guest connects: it is applied on connect.
#[tokio::test]
async fn install_sdk_before_start_is_applied_when_the_guest_connects() {
    let d = shared();
    let p = Profile::new(d, &uid("early-sdk"));
    let pipe = p.pipe(d).await;
    let host = tempfile::tempdir().unwrap();
    std::fs::set_permissions(host.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = host.path().join("sdk").join("3.1.4");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("claude"), "#!/bin/sh\necho early-cli\n").unwrap();
    std::fs::set_permissions(dir.join("claude"), std::fs::Permissions::from_mode(0o755)).unwrap();
    pipe.call(
        "installSdk",
        json!({"sdkSubpath": rel(&host.path().join("sdk")), "version": "3.1.4"}),
    )
    .await
    .expect("installSdk before startVM");
    let mut sub = p.subscribe(d).await;
    start_vm(d, &pipe, json!({})).await;
    let out = run_ok(
        &pipe,
        &mut sub,
        &uid("early"),
        "early",
        "/usr/local/bin/claude",
    )
    .await;
    assert_eq!(out, "early-cli\n");
    expect_in_order(
        &mut sub,
        &[("sdk_install", "started"), ("sdk_install", "completed")],
        "subscriber",
    )
    .await;
    pipe.call("stopVM", Value::Null).await.unwrap();
}

/// The machine dying under a running process: the client gets a fatal
/// `error` event and then the process's `exit`, the guest reads as
/// disconnected, and the next `startVM` boots a fresh machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_death_reports_fatal_error_then_exit_and_recovers() {
    let d = Daemon::start();
    let p = Profile::new(&d, &uid("death"));
    let pipe = p.pipe(&d).await;
    start_vm(&d, &pipe, json!({})).await;
    let mut sub = p.subscribe(&d).await;
    let id = uid("victim");
    pipe.call(
        "spawn",
        json!({"id": id, "name": "victim", "command": "/bin/sleep", "args": ["100"], "isResume": false}),
    )
    .await
    .expect("spawn");

    // Kill this daemon's sandbox init from outside, as a crash would.
    let inits: Vec<u32> = pids_with_arg("__sandbox-init")
        .into_iter()
        .filter(|pid| parent_of(*pid) == Some(d.pid()))
        .collect();
    assert_eq!(inits.len(), 1, "one sandbox for this daemon: {inits:?}");
    // SAFETY: kill takes no pointers; the pid is the sandbox init the test found.
    unsafe { libc::kill(inits[0] as i32, libc::SIGKILL) };

    let err = sub
        .next_matching(T, |e| e["type"] == json!("error") && e["id"] == json!(id))
        .await
        .expect("fatal error event for the running process");
    assert_eq!(err["fatal"], json!(true), "{err}");
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{err}"
    );
    let out = sub
        .collect_process(&id, T)
        .await
        .expect("exit after the error");
    assert_eq!(out.signal(), Some("SIGKILL"), "{}", out.exit);
    wait_guest(&pipe, false).await;
    let status = pipe
        .call("isProcessRunning", json!({"id": id}))
        .await
        .unwrap();
    assert_eq!(status["running"], json!(false));

    start_vm(&d, &pipe, json!({})).await;
    wait_guest(&pipe, true).await;
    run_ok(&pipe, &mut sub, &uid("after"), "victim", "echo back").await;
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name: state, ppid, ...
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(1)?.parse().ok()
}
