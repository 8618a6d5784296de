//! Sessions in a started sandbox: spawn, output and exit events, kill,
//! stdin, mounts, readFile, the session-disk janitor and installSdk. The
//! tests of this file share one helper and one started sandbox (profile
//! `shared`); each uses its own session names and process ids.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use base64::Engine as _;
use cowork_helper::client::{encode_frame, request, ClientError, Pipe, RawConn, Subscription};
use serde_json::{json, Value};
use support::daemon::*;

async fn setup() -> (&'static Daemon, Pipe, Subscription) {
    let (d, p) = shared_vm().await;
    let pipe = p.pipe(d).await;
    let sub = p.subscribe(d).await;
    (d, pipe, sub)
}

fn tempdir() -> tempfile::TempDir {
    let t = tempfile::Builder::new()
        .prefix("cowork-host-")
        .tempdir()
        .unwrap();
    // The sandbox may map our uid; keep host test dirs reachable.
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    t
}

#[tokio::test]
async fn started_vm_reports_running_and_connected() {
    let (_d, pipe, _sub) = setup().await;
    assert_eq!(
        pipe.call("isRunning", Value::Null).await.unwrap(),
        json!({"running": true})
    );
    assert_eq!(
        pipe.call("isGuestConnected", Value::Null).await.unwrap()["connected"],
        json!(true)
    );
}

#[tokio::test]
async fn twenty_thousand_lines_arrive_whole_in_order_then_exit() {
    let (_d, pipe, mut sub) = setup().await;
    let id = uid("seq");
    let out = run(
        &pipe,
        &mut sub,
        json!({"id": id, "name": uid("s-seq"), "command": "/usr/bin/seq", "args": ["1", "20000"], "isResume": false}),
    )
    .await;
    let want: String = (1..=20000).map(|i| format!("{i}\n")).collect();
    let got = out.stdout_str();
    if got != want {
        let bad = got
            .lines()
            .enumerate()
            .find(|(i, l)| *l != (i + 1).to_string())
            .map(|(i, l)| format!("line {} is {l:?}", i + 1));
        panic!(
            "stdout differs: {} bytes vs {} expected; first bad: {bad:?}",
            got.len(),
            want.len()
        );
    }
    assert!(out.stderr.is_empty(), "{}", out.stderr_str());
    assert_eq!(out.exit_code(), Some(0), "{}", out.exit);
    assert!(out.signal().is_none(), "{}", out.exit);
    // Every event was a well-formed {type,id,data} chunk.
    for ev in &out.events[..out.events.len() - 1] {
        assert_eq!(ev["type"], json!("stdout"), "{ev}");
        assert!(ev["data"].is_string(), "{ev}");
    }
    assert_no_events_after_exit(&pipe, &mut sub, &id).await;
}

/// The exit event is a process's last: after another process has run to
/// completion, nothing more arrived for `id`.
async fn assert_no_events_after_exit(pipe: &Pipe, sub: &mut Subscription, id: &str) {
    let barrier = uid("barrier");
    run_ok(pipe, sub, &barrier, "barrier", "true").await;
    let late: Vec<_> = sub
        .stashed()
        .filter(|e| e["id"].as_str() == Some(id))
        .cloned()
        .collect();
    assert!(late.is_empty(), "events of {id} after its exit: {late:?}");
}

#[tokio::test]
async fn stdout_and_stderr_interleave_and_exit_comes_last() {
    let (_d, pipe, mut sub) = setup().await;
    let id = uid("inter");
    let out = run(
        &pipe,
        &mut sub,
        sh(
            &id,
            &uid("s-inter"),
            "i=1; while [ $i -le 500 ]; do echo out$i; echo err$i >&2; i=$((i+1)); done; exit 7",
        ),
    )
    .await;
    let want_out: String = (1..=500).map(|i| format!("out{i}\n")).collect();
    let want_err: String = (1..=500).map(|i| format!("err{i}\n")).collect();
    assert_eq!(out.stdout_str(), want_out);
    assert_eq!(out.stderr_str(), want_err);
    assert_eq!(out.exit_code(), Some(7), "{}", out.exit);
    assert_eq!(out.events.last().unwrap()["type"], json!("exit"));
    assert!(out.events.iter().any(|e| e["type"] == json!("stderr")));
    assert_no_events_after_exit(&pipe, &mut sub, &id).await;
}

#[tokio::test]
async fn exit_codes_and_signal_names() {
    let (_d, pipe, mut sub) = setup().await;
    let s = uid("s-exit");
    let out = run(&pipe, &mut sub, sh(&uid("e42"), &s, "exit 42")).await;
    assert_eq!(out.exit_code(), Some(42), "{}", out.exit);
    assert!(out.signal().is_none(), "{}", out.exit);
    let out = run(&pipe, &mut sub, sh(&uid("segv"), &s, "kill -USR1 $$")).await;
    assert_eq!(out.signal(), Some("SIGUSR1"), "{}", out.exit);
    // A process that cannot start: a spawn error, or an error/exit event.
    let id = uid("missing");
    match pipe
        .call(
            "spawn",
            json!({"id": id, "name": s, "command": "/nonexistent/cmd", "args": [], "isResume": false}),
        )
        .await
    {
        Err(ClientError::Remote(e)) => assert!(!e.is_empty()),
        Err(e) => panic!("spawn of a missing command: {e}"),
        Ok(_) => {
            let out = sub.collect_process(&id, T).await.unwrap();
            assert!(
                !out.errors.is_empty() || out.exit_code().is_some_and(|c| c != 0),
                "a missing command must be reported: {:?}",
                out.events
            );
        }
    }
}

#[tokio::test]
async fn kill_signals_the_whole_process_group() {
    let (_d, pipe, mut sub) = setup().await;
    let cases: [(Option<Value>, &str); 7] = [
        (Some(json!("SIGTERM")), "SIGTERM"),
        (Some(json!("TERM")), "SIGTERM"),
        (Some(json!("sigkill")), "SIGKILL"),
        (Some(json!(9)), "SIGKILL"),
        (Some(json!("HUP")), "SIGHUP"),
        (Some(json!("15")), "SIGTERM"),
        (None, "SIGTERM"),
    ];
    let session = uid("s-kill");
    for (n, (signal, want)) in cases.into_iter().enumerate() {
        let id = uid("grp");
        let marker = format!("{}.{}{n}", 5000 + n, std::process::id());
        pipe.call(
            "spawn",
            sh(
                &id,
                &session,
                &format!("sleep {marker} & sleep 100; echo never"),
            ),
        )
        .await
        .unwrap();
        // Wait until the background child exists, so the kill has a group to hit.
        let t0 = Instant::now();
        while pids_with_arg(&marker).is_empty() {
            assert!(t0.elapsed() < T, "background sleep never started");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            pipe.call("isProcessRunning", json!({"id": id}))
                .await
                .unwrap()["running"],
            json!(true)
        );
        let mut params = json!({"id": id});
        if let Some(s) = &signal {
            params["signal"] = s.clone();
        }
        pipe.call("kill", params)
            .await
            .unwrap_or_else(|e| panic!("kill {signal:?}: {e}"));
        // The exit can only come once the background sleep, which holds
        // stdout open, is gone too.
        let out = sub.collect_process(&id, T).await.unwrap();
        assert_eq!(out.signal(), Some(want), "kill {signal:?}: {}", out.exit);
        assert!(!out.stdout_str().contains("never"));
        let left = wait_no_process(&marker, Duration::from_secs(5));
        assert!(
            left.is_empty(),
            "kill {signal:?} left the group member {left:?}"
        );
        let st = pipe
            .call("isProcessRunning", json!({"id": id}))
            .await
            .unwrap();
        assert_eq!(st["running"], json!(false), "{st}");
    }
}

#[tokio::test]
async fn write_stdin_reaches_cat_in_order() {
    let (_d, pipe, mut sub) = setup().await;
    let session = uid("s-stdin");
    for pipelined in [false, true] {
        let id = uid("cat");
        pipe.call(
            "spawn",
            json!({"id": id, "name": session, "command": "/bin/cat", "args": [], "isResume": false}),
        )
        .await
        .unwrap();
        let lines: Vec<String> = (0..300)
            .map(|i| format!("line {i} {}\n", "é".repeat(i % 7)))
            .collect();
        if pipelined {
            // All writes in flight at once, in one write on one connection, as a
            // client that does not await each writeStdin before the next.
            let (d, p) = shared_vm().await;
            let mut raw = RawConn::connect(&d.socket).await.unwrap();
            raw.send_json(&request(
                "configure",
                Some(json!(0)),
                json!({"userDataName": p.name, "userDataRoot": p.root, "sessionOnly": true}),
            ))
            .await
            .unwrap();
            let r = raw.read_reply(T).await.unwrap().expect("configure reply");
            assert_eq!(r["success"], json!(true), "{r}");
            let mut wire = Vec::new();
            for (i, l) in lines.iter().enumerate() {
                let body = request(
                    "writeStdin",
                    Some(json!(i + 1)),
                    json!({"id": id, "data": l}),
                );
                wire.extend_from_slice(&encode_frame(&serde_json::to_vec(&body).unwrap()));
            }
            raw.send_bytes(&wire).await.unwrap();
            for _ in 0..lines.len() {
                let r = raw.read_reply(T).await.unwrap().expect("writeStdin reply");
                assert_eq!(r["success"], json!(true), "{r}");
            }
        } else {
            for l in &lines {
                pipe.call("writeStdin", json!({"id": id, "data": l}))
                    .await
                    .expect("writeStdin");
            }
        }
        let want: String = lines.concat();
        let mut got = Vec::new();
        while got.len() < want.len() {
            let ev = sub
                .next_matching(T, |e| e["id"].as_str() == Some(id.as_str()))
                .await
                .unwrap_or_else(|e| {
                    panic!("waiting for cat output ({} bytes so far): {e}", got.len())
                });
            assert_eq!(ev["type"], json!("stdout"), "{ev}");
            got.extend_from_slice(ev["data"].as_str().unwrap().as_bytes());
        }
        let got = String::from_utf8_lossy(&got).into_owned();
        if got != want {
            let (g, w): (Vec<_>, Vec<_>) = (got.lines().collect(), want.lines().collect());
            let at = g.iter().zip(&w).position(|(a, b)| a != b).unwrap_or(0);
            panic!(
                "stdin arrived out of order (pipelined: {pipelined}): first difference at line {at}: got {:?}, want {:?}",
                &g[at..(at + 3).min(g.len())],
                &w[at..(at + 3).min(w.len())]
            );
        }
        pipe.call("kill", json!({"id": id, "signal": "SIGKILL"}))
            .await
            .unwrap();
        let out = sub.collect_process(&id, T).await.unwrap();
        assert_eq!(out.signal(), Some("SIGKILL"));
    }
}

#[tokio::test]
async fn is_process_running_before_and_after_exit_is_idempotent() {
    let (_d, pipe, mut sub) = setup().await;
    let session = uid("s-ipr");
    let id = uid("ipr");
    pipe.call(
        "spawn",
        json!({"id": id, "name": session, "command": "/bin/cat", "args": [], "isResume": false}),
    )
    .await
    .unwrap();
    for _ in 0..3 {
        let r = pipe
            .call("isProcessRunning", json!({"id": id}))
            .await
            .unwrap();
        assert_eq!(r["running"], json!(true), "{r}");
    }
    pipe.call("kill", json!({"id": id, "signal": "SIGTERM"}))
        .await
        .unwrap();
    sub.collect_process(&id, T).await.unwrap();
    let a = pipe
        .call("isProcessRunning", json!({"id": id}))
        .await
        .unwrap();
    let b = pipe
        .call("isProcessRunning", json!({"id": id}))
        .await
        .unwrap();
    assert_eq!(a["running"], json!(false), "{a}");
    assert_eq!(a, b, "isProcessRunning must be idempotent");

    let id2 = uid("ipr-code");
    let out = run(&pipe, &mut sub, sh(&id2, &session, "exit 3")).await;
    assert_eq!(out.exit_code(), Some(3));
    for _ in 0..2 {
        let r = pipe
            .call("isProcessRunning", json!({"id": id2}))
            .await
            .unwrap();
        assert_eq!(r, json!({"running": false, "exitCode": 3}));
    }
}

#[tokio::test]
async fn mounts_ro_rw_rwd_and_nested() {
    let (_d, pipe, mut sub) = setup().await;
    let host = tempdir();
    let (ro, rw, rwd, nested) = (
        host.path().join("ro"),
        host.path().join("rw"),
        host.path().join("rwd"),
        host.path().join("skills"),
    );
    for (dir, file) in [
        (&ro, "keep.txt"),
        (&rw, "old.txt"),
        (&rwd, "gone.txt"),
        (&nested, "skill.md"),
    ] {
        std::fs::create_dir(dir).unwrap();
        std::fs::write(dir.join(file), format!("content of {file}\n")).unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let session = uid("s-mnt");
    let mounts = json!({
        "ro": {"path": rel(&ro), "mode": "ro"},
        "rw": {"path": rel(&rw), "mode": "rw"},
        "rwd": {"path": rel(&rwd), "mode": "rwd"},
        ".claude/skills": {"path": rel(&nested), "mode": "ro"},
        "missing": {"path": rel(&host.path().join("does-not-exist")), "mode": "rw"},
    });
    let id = uid("mnt");
    let script = "set -u; cd /sessions/\"$S\"/mnt || exit 90
        cat ro/keep.txt
        if echo x > ro/new.txt 2>/dev/null; then echo RO-WRITE-OK; else echo ro-write-refused; fi
        if rm ro/keep.txt 2>/dev/null; then echo RO-RM-OK; else echo ro-rm-refused; fi
        echo written > rw/new.txt && echo rw-write-ok
        cat rw/old.txt
        rm rwd/gone.txt && echo rwd-rm-ok
        echo made > rwd/made.txt && echo rwd-write-ok
        cat .claude/skills/skill.md
        pwd -P >/dev/null";
    let mut spawn = sh(&id, &session, script);
    spawn["env"] = json!({"S": session});
    spawn["additionalMounts"] = mounts;
    let reply = pipe.call("spawn", spawn).await.expect("spawn with mounts");
    let failed: Vec<String> = reply
        .get("failedMounts")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(failed, vec!["missing".to_string()], "failedMounts: {reply}");
    let out = sub.collect_process(&id, T).await.unwrap();
    let text = out.stdout_str();
    assert_eq!(out.exit_code(), Some(0), "{text}\n{}", out.stderr_str());
    for want in [
        "content of keep.txt",
        "ro-write-refused",
        "ro-rm-refused",
        "rw-write-ok",
        "content of old.txt",
        "rwd-rm-ok",
        "rwd-write-ok",
        "content of skill.md",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    assert!(!text.contains("RO-"), "{text}");
    // The host sees what the session did.
    assert!(!ro.join("new.txt").exists());
    assert!(ro.join("keep.txt").exists());
    assert_eq!(
        std::fs::read_to_string(rw.join("new.txt")).unwrap(),
        "written\n"
    );
    assert!(!rwd.join("gone.txt").exists());
    assert_eq!(
        std::fs::read_to_string(rwd.join("made.txt")).unwrap(),
        "made\n"
    );
}

#[tokio::test]
async fn mount_traversal_and_bad_names_are_refused() {
    let (_d, pipe, mut sub) = setup().await;
    let session = uid("s-badmnt");
    let id = uid("badmnt");
    let mut spawn = sh(&id, &session, "test -e /sessions/$S/mnt/esc/passwd && echo ESCAPED; ls /sessions/$S/mnt 2>/dev/null; true");
    spawn["env"] = json!({"S": session});
    spawn["additionalMounts"] = json!({"esc": {"path": "tmp/../etc", "mode": "ro"}});
    match pipe.call("spawn", spawn).await {
        Ok(r) => {
            let failed = r["failedMounts"].as_array().cloned().unwrap_or_default();
            assert!(
                failed.contains(&json!("esc")),
                "traversal mount not refused: {r}"
            );
            let out = sub.collect_process(&id, T).await.unwrap();
            assert!(!out.stdout_str().contains("ESCAPED"));
        }
        Err(ClientError::Remote(_)) => {}
        Err(e) => panic!("{e}"),
    }
    // mountPath on a running session: traversal in subpath and mountName.
    let live = uid("live");
    pipe.call(
        "spawn",
        json!({"id": live, "name": session, "command": "/bin/cat", "args": [], "isResume": false}),
    )
    .await
    .unwrap();
    for (subpath, name) in [
        ("tmp/../etc", "m1"),
        ("etc/../../etc", "m2"),
        ("tmp", "../escape"),
        ("tmp", "/abs"),
    ] {
        remote_err(
            pipe.call(
                "mountPath",
                json!({"processId": live, "subpath": subpath, "mountName": name, "mode": "ro"}),
            )
            .await,
            &format!("mountPath {subpath} {name}"),
        );
    }
    pipe.call("kill", json!({"id": live, "signal": "SIGKILL"}))
        .await
        .unwrap();
    sub.collect_process(&live, T).await.unwrap();
}

#[tokio::test]
async fn mount_path_adds_a_mount_to_a_running_session() {
    let (_d, pipe, mut sub) = setup().await;
    let host = tempdir();
    std::fs::write(host.path().join("late.txt"), "late content\n").unwrap();
    let session = uid("s-late");
    let id = uid("shell");
    // A shell reading commands from stdin: the already-running process
    // must see the new mount.
    pipe.call(
        "spawn",
        json!({"id": id, "name": session, "command": "/bin/sh", "args": [], "isResume": false}),
    )
    .await
    .unwrap();
    pipe.call(
        "mountPath",
        json!({"processId": id, "subpath": rel(host.path()), "mountName": "late", "mode": "rw"}),
    )
    .await
    .expect("mountPath");
    pipe.call(
        "writeStdin",
        json!({"id": id, "data": format!("cat /sessions/{session}/mnt/late/late.txt; echo fromguest > /sessions/{session}/mnt/late/back.txt; echo done\n")}),
    )
    .await
    .unwrap();
    let mut got = String::new();
    while !got.contains("done\n") {
        let ev = sub
            .next_matching(T, |e| e["id"].as_str() == Some(id.as_str()))
            .await
            .unwrap_or_else(|e| panic!("shell output so far {got:?}: {e}"));
        assert_ne!(
            ev["type"],
            json!("exit"),
            "shell exited: {ev} after {got:?}"
        );
        if ev["type"] == json!("stdout") {
            got.push_str(ev["data"].as_str().unwrap());
        }
    }
    assert!(got.contains("late content"), "{got}");
    assert_eq!(
        std::fs::read_to_string(host.path().join("back.txt")).unwrap(),
        "fromguest\n"
    );
    pipe.call("kill", json!({"id": id})).await.unwrap();
    sub.collect_process(&id, T).await.unwrap();
}

#[tokio::test]
async fn read_file_is_base64_and_refuses_traversal() {
    let (_d, pipe, mut sub) = setup().await;
    let session = uid("s-read");
    let other = uid("s-other");
    run_ok(
        &pipe,
        &mut sub,
        &uid("w-other"),
        &other,
        "echo secret > other.txt",
    )
    .await;
    run_ok(
        &pipe,
        &mut sub,
        &uid("w"),
        &session,
        &format!(
            "printf '\\000\\001bin\\377\\n' > out.bin && mkdir -p sub/dir && echo nested > sub/dir/n.txt
             ln -s /etc/passwd link-abs && ln -s ../{other}/other.txt link-rel && ln -s out.bin link-ok
             head -c 1048576 /dev/zero > big.bin"
        ),
    )
    .await;
    let read = |path: &str| {
        let (pipe, session, path) = (pipe.clone(), session.clone(), path.to_string());
        async move {
            pipe.call(
                "readFile",
                json!({"processName": session, "filePath": path}),
            )
            .await
        }
    };
    let decode = |v: Value| {
        base64::engine::general_purpose::STANDARD
            .decode(v["content"].as_str().expect("content string"))
            .expect("content is base64")
    };
    assert_eq!(decode(read("out.bin").await.unwrap()), b"\x00\x01bin\xff\n");
    assert_eq!(
        decode(read(&format!("/sessions/{session}/out.bin")).await.unwrap()),
        b"\x00\x01bin\xff\n"
    );
    assert_eq!(decode(read("sub/dir/n.txt").await.unwrap()), b"nested\n");
    assert_eq!(decode(read("big.bin").await.unwrap()), vec![0u8; 1 << 20]);
    assert_eq!(decode(read("link-ok").await.unwrap()), b"\x00\x01bin\xff\n");
    for bad in [
        "../../etc/passwd".to_string(),
        "/etc/passwd".to_string(),
        format!("../{other}/other.txt"),
        format!("/sessions/{other}/other.txt"),
        format!("/sessions/{session}/../{other}/other.txt"),
        "link-abs".into(),
        "link-rel".into(),
        "no-such-file".into(),
    ] {
        let e = remote_err(read(&bad).await, &format!("readFile {bad}"));
        assert!(!e.contains("root:x:0:0"), "{e}");
    }
    // A session name that walks out is refused too.
    remote_err(
        pipe.call(
            "readFile",
            json!({"processName": "..", "filePath": "etc/passwd"}),
        )
        .await,
        "readFile processName ..",
    );
}

#[tokio::test]
async fn session_disk_info_delete_and_prune() {
    let (d, _pipe, _sub) = setup().await;
    // An own profile: session listings are per profile.
    let p = Profile::new(d, &uid("janitor"));
    let pipe = p.pipe(d).await;
    start_vm(d, &pipe, json!({})).await;
    let mut sub = p.subscribe(d).await;
    let done = uid("s-done");
    run_ok(
        &pipe,
        &mut sub,
        &uid("fill"),
        &done,
        "head -c 1048576 /dev/zero > blob && mkdir -p tmp && echo x > tmp/t",
    )
    .await;
    let live = uid("s-live");
    let live_id = uid("live");
    pipe.call(
        "spawn",
        json!({"id": live_id, "name": live, "command": "/bin/cat", "args": [], "isResume": false}),
    )
    .await
    .unwrap();

    let info = pipe
        .call("getSessionsDiskInfo", json!({"lowWaterBytes": 1024}))
        .await
        .unwrap();
    let total = info["totalBytes"].as_u64().expect("totalBytes");
    let free = info["freeBytes"].as_u64().expect("freeBytes");
    assert!(total > 0 && free <= total, "{info}");
    let sessions = info["sessions"].as_array().expect("sessions[]");
    let entry = sessions
        .iter()
        .find(|s| s["name"] == json!(done))
        .unwrap_or_else(|| panic!("{done} not listed: {info}"));
    assert!(entry["sizeBytes"].as_u64().unwrap() >= 1 << 20, "{entry}");
    assert!(sessions.iter().any(|s| s["name"] == json!(live)), "{info}");

    // Prune: nothing when free space is plentiful; the shape always.
    let r = pipe
        .call(
            "pruneSessionCaches",
            json!({"onlyIfFreeBytesBelow": 0, "includeSessionTmp": true, "sessionTmpOlderThanSeconds": 0}),
        )
        .await
        .unwrap();
    assert_eq!(r["prunedSessions"], json!([]), "{r}");
    assert_eq!(r["freedBytes"], json!(0), "{r}");
    assert!(
        r["skippedSessions"].is_array() && r["errors"].is_object(),
        "{r}"
    );
    let r = pipe
        .call(
            "pruneSessionCaches",
            json!({"onlyIfFreeBytesBelow": u64::MAX / 2, "includeSessionTmp": true, "sessionTmpOlderThanSeconds": 0}),
        )
        .await
        .unwrap();
    assert!(
        r["prunedSessions"].is_array() && r["skippedSessions"].is_array(),
        "{r}"
    );
    assert!(r["freedBytes"].is_u64() && r["errors"].is_object(), "{r}");
    let live_listed = |v: &Value| v.as_array().unwrap().iter().any(|s| s == &json!(live));
    assert!(
        !live_listed(&r["prunedSessions"]),
        "a live session was pruned: {r}"
    );

    // Real effect: a finished session's .cache is emptied and its old tmp
    // entries go; fresh tmp entries, other files and live sessions stay.
    let cached = uid("s-cache");
    run_ok(
        &pipe,
        &mut sub,
        &uid("mkcache"),
        &cached,
        "mkdir -p .cache/pip tmp && head -c 1048576 /dev/zero > .cache/pip/wheel && echo o > tmp/old && touch -d @1000 tmp/old && echo n > tmp/new && echo keep > work.txt",
    )
    .await;
    // The live session's process is `cat`; give it a cache through another process.
    run_ok(
        &pipe,
        &mut sub,
        &uid("livecache"),
        &live,
        "mkdir -p .cache && echo c > .cache/live-c",
    )
    .await;
    let r = pipe
        .call(
            "pruneSessionCaches",
            json!({"onlyIfFreeBytesBelow": u64::MAX / 2, "includeSessionTmp": true, "sessionTmpOlderThanSeconds": 3600}),
        )
        .await
        .unwrap();
    assert!(
        r["prunedSessions"]
            .as_array()
            .unwrap()
            .contains(&json!(cached)),
        "{cached} not pruned: {r}"
    );
    assert!(
        r["skippedSessions"]
            .as_array()
            .unwrap()
            .contains(&json!(live)),
        "{r}"
    );
    assert!(r["freedBytes"].as_u64().unwrap() >= 1 << 20, "{r}");
    let out = run_ok(
        &pipe,
        &mut sub,
        &uid("lscache"),
        &cached,
        "test -d .cache && echo cache-dir; test -e .cache/pip && echo CACHE-LEFT; test -e tmp/old && echo OLD-LEFT; test -e tmp/new && echo new-kept; test -e work.txt && echo work-kept; true",
    )
    .await;
    assert_eq!(out, "cache-dir\nnew-kept\nwork-kept\n", "after prune");
    let out = run_ok(&pipe, &mut sub, &uid("lslive"), &live, "cat .cache/live-c").await;
    assert_eq!(out, "c\n", "a live session's cache was pruned");

    // deleteSessionDirs: invalid names, a live session, a finished one.
    let r = pipe
        .call(
            "deleteSessionDirs",
            json!({"names": ["..", "a/b", ".", "", "../x", live, done]}),
        )
        .await
        .unwrap();
    assert_eq!(r["deleted"], json!([done]), "{r}");
    let errors = r["errors"].as_object().expect("errors{}");
    for bad in ["..", "a/b", ".", "", "../x", live.as_str()] {
        assert!(errors.contains_key(bad), "{bad:?} not refused: {r}");
    }
    let info = pipe
        .call("getSessionsDiskInfo", json!({"lowWaterBytes": 1024}))
        .await
        .unwrap();
    let names: Vec<_> = info["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].clone())
        .collect();
    assert!(!names.contains(&json!(done)), "{info}");
    assert!(names.contains(&json!(live)), "{info}");
    remote_err(
        pipe.call("readFile", json!({"processName": done, "filePath": "blob"}))
            .await,
        "readFile of a deleted session",
    );
    pipe.call("kill", json!({"id": live_id})).await.unwrap();
    sub.collect_process(&live_id, T).await.unwrap();
    // Once the process is gone its session can be deleted.
    let r = pipe
        .call("deleteSessionDirs", json!({"names": [live]}))
        .await
        .unwrap();
    assert_eq!(r["deleted"], json!([live]), "{r}");
    pipe.call("stopVM", Value::Null).await.unwrap();
}

#[tokio::test]
async fn install_sdk_makes_the_cli_available() {
    let (_d, pipe, mut sub) = setup().await;
    let host = tempdir();
    let dir = host.path().join("sdk").join("2.0.1");
    std::fs::create_dir_all(&dir).unwrap();
    let cli = dir.join("claude");
    std::fs::write(&cli, "#!/bin/sh\necho \"fake-claude $*\"\n").unwrap();
    std::fs::set_permissions(&cli, std::fs::Permissions::from_mode(0o755)).unwrap();
    for p in [host.path().join("sdk"), dir.clone()] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let params = json!({"sdkSubpath": rel(&host.path().join("sdk")), "version": "2.0.1"});
    pipe.call("installSdk", params.clone())
        .await
        .expect("installSdk");
    let out = run_ok(
        &pipe,
        &mut sub,
        &uid("cli"),
        &uid("s-cli"),
        "/usr/local/bin/claude --version",
    )
    .await;
    assert_eq!(out, "fake-claude --version\n");
    let out = run(
        &pipe,
        &mut sub,
        json!({"id": uid("cli2"), "name": uid("s-cli"), "command": "/usr/local/bin/claude", "args": ["-p", "hi"], "isResume": false}),
    )
    .await;
    assert_eq!(out.stdout_str(), "fake-claude -p hi\n");
    // Idempotent and fast when repeated (the client re-sends it on every start).
    let t0 = Instant::now();
    pipe.call("installSdk", params)
        .await
        .expect("second installSdk");
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "second installSdk took {:?}",
        t0.elapsed()
    );
    // A missing version is an error, not a hang.
    remote_err(
        pipe.call(
            "installSdk",
            json!({"sdkSubpath": rel(&host.path().join("sdk")), "version": "9.9.9"}),
        )
        .await,
        "installSdk of a missing version",
    );
}

#[tokio::test]
async fn spawn_environment_cwd_and_sandbox_view() {
    let (_d, pipe, mut sub) = setup().await;
    let session = uid("s-env");
    let host_marker = std::env::temp_dir().join(format!("cowork-host-only-{}", std::process::id()));
    std::fs::write(&host_marker, "x").unwrap();
    let id = uid("env");
    let out = run(
        &pipe,
        &mut sub,
        json!({
            "id": id, "name": session, "command": "/bin/sh", "isResume": false,
            "args": ["-c", format!(
                "echo \"cwd=$(pwd)\"; echo \"FOO=$FOO\"; if [ \"${{EMPTY+set}}\" = set ]; then echo EMPTY-PRESENT; else echo empty-dropped; fi
                 for p in /home /root /work /proc/1/root/work {}; do test -e $p && echo VISIBLE:$p; done
                 test -x /bin/sh && test -x /usr/bin/env && echo tools-ok
                 touch /usr/cowork-probe 2>/dev/null && echo USR-WRITABLE; touch /etc/cowork-probe 2>/dev/null && echo ETC-WRITABLE
                 echo t > /tmp/probe && echo tmp-ok", host_marker.display())],
            "env": {"FOO": "bar baz", "EMPTY": ""},
        }),
    )
    .await;
    let _ = std::fs::remove_file(&host_marker);
    let text = out.stdout_str();
    assert_eq!(out.exit_code(), Some(0), "{text}{}", out.stderr_str());
    assert!(
        text.contains(&format!("cwd=/sessions/{session}\n")),
        "{text}"
    );
    assert!(text.contains("FOO=bar baz\n"), "{text}");
    assert!(text.contains("empty-dropped"), "{text}");
    assert!(
        !text.contains("VISIBLE:"),
        "host paths visible in the sandbox:\n{text}"
    );
    assert!(
        text.contains("tools-ok") && text.contains("tmp-ok"),
        "{text}"
    );
    assert!(!text.contains("WRITABLE"), "{text}");
    // cwd relative to the session, and absolute inside it.
    run_ok(&pipe, &mut sub, &uid("mk"), &session, "mkdir -p work/dir").await;
    let mut s = sh(&uid("cwd"), &session, "pwd");
    s["cwd"] = json!(format!("/sessions/{session}/work/dir"));
    let out = run(&pipe, &mut sub, s).await;
    assert_eq!(out.stdout_str(), format!("/sessions/{session}/work/dir\n"));
}
