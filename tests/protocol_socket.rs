//! The socket server as the client sees it: connection modes, envelopes, bad
//! frames, security, socket lifecycle and signals. Needs no sandbox except
//! where noted.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use cowork_helper::client::{encode_frame, request, Client, ClientError, Pipe, RawConn};
use serde_json::{json, Value};
use support::daemon::*;

fn is_error_reply(v: &Value) -> bool {
    v["success"] == json!(false) && v["error"].as_str().is_some_and(|s| !s.trim().is_empty())
}

#[tokio::test]
async fn one_shot_with_half_close_gets_its_reply_without_id() {
    let d = shared();
    let reply = Client::one_shot_raw(&d.socket, &json!({"method": "isRunning"}))
        .await
        .expect("one-shot reply after half-close");
    assert_eq!(reply["success"], json!(true), "{reply}");
    assert!(reply["result"]["running"].is_boolean(), "{reply}");
    assert!(
        reply.get("id").is_none(),
        "a request without id must get a reply without id: {reply}"
    );
    // The same through the typed helper, for a method with a fixed result.
    let r = Client::one_shot(&d.socket, "getNetworkDrives", Value::Null)
        .await
        .unwrap();
    assert_eq!(r, json!({"drives": []}));
}

#[tokio::test]
async fn socket_flag_spellings_and_private_modes() {
    for flag in [SocketFlag::GoStyle, SocketFlag::Long, SocketFlag::Equals] {
        let d = Daemon::start_with(Opts {
            socket_flag: flag,
            ..Opts::default()
        });
        let r = Client::one_shot(&d.socket, "isRunning", Value::Null)
            .await
            .unwrap_or_else(|e| panic!("{flag:?}: {e}"));
        assert_eq!(r["running"], json!(false), "{flag:?}: {r}");
        let sock_mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
        assert_eq!(
            sock_mode & 0o077,
            0,
            "socket mode {sock_mode:o} is open to others"
        );
        let dir_mode = std::fs::metadata(d.socket.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode, 0o700, "created socket dir mode {dir_mode:o}");
    }
}

#[tokio::test]
async fn pipe_echoes_ids_exactly_and_matches_out_of_order() {
    let d = shared();
    let mut raw = RawConn::connect(&d.socket).await.unwrap();
    let ids = [
        json!(1),
        json!("abc"),
        json!("7"),
        json!(9007199254740993u64),
        json!(-3),
        json!(1.5),
    ];
    for id in &ids {
        raw.send_json(&request("isRunning", Some(id.clone()), Value::Null))
            .await
            .unwrap();
    }
    // A request without id on the same connection: its reply carries none.
    raw.send_json(&request("getNetworkDrives", None, Value::Null))
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..ids.len() + 1 {
        let r = raw.read_reply(T).await.unwrap().expect("reply");
        assert_eq!(r["success"], json!(true), "{r}");
        got.push(r);
    }
    for id in &ids {
        let n = got.iter().filter(|r| r.get("id") == Some(id)).count();
        assert_eq!(
            n, 1,
            "id {id} must be echoed exactly once (same type): {got:?}"
        );
    }
    let no_id: Vec<_> = got.iter().filter(|r| r.get("id").is_none()).collect();
    assert_eq!(no_id.len(), 1, "{got:?}");
    assert_eq!(no_id[0]["result"], json!({"drives": []}));

    // Many concurrent calls on one pipe, replies matched by id.
    let pipe = Pipe::connect(&d.socket).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let p = pipe.clone();
        tasks.push(tokio::spawn(async move {
            let m = ["isRunning", "isGuestConnected", "getNetworkDrives"][i % 3];
            (m, p.call(m, Value::Null).await)
        }));
    }
    for t in tasks {
        let (m, r) = t.await.unwrap();
        let r = r.unwrap_or_else(|e| panic!("{m}: {e}"));
        match m {
            "isRunning" => assert!(r["running"].is_boolean(), "{r}"),
            "isGuestConnected" => assert!(r["connected"].is_boolean(), "{r}"),
            _ => assert_eq!(r, json!({"drives": []})),
        }
    }
    assert!(pipe.take_unmatched().is_empty());
}

#[tokio::test]
async fn unknown_method_has_both_spellings() {
    let d = shared();
    for via_pipe in [false, true] {
        let r = if via_pipe {
            Pipe::connect(&d.socket)
                .await
                .unwrap()
                .call("noSuchMethod", json!({}))
                .await
        } else {
            Client::one_shot(&d.socket, "noSuchMethod", Value::Null).await
        };
        let e = remote_err(r, "unknown method");
        assert!(e.contains("Unknown method"), "{e}");
        assert!(e.contains("unknown method"), "{e}");
    }
    // Balloon methods the Linux client never calls are unknown too.
    let e = remote_err(
        Client::one_shot(&d.socket, "getMemoryTier", Value::Null).await,
        "getMemoryTier",
    );
    assert!(e.contains("unknown method"), "{e}");
}

#[tokio::test]
async fn wrong_param_types_name_the_field() {
    let d = shared();
    let p = Profile::new(d, "types");
    let pipe = p.pipe(d).await;
    let cases = [
        (
            "spawn",
            json!({"id": "x", "name": "s", "command": "/bin/true", "args": 5}),
            "args",
        ),
        (
            "spawn",
            json!({"id": 7, "name": "s", "command": "/bin/true", "args": []}),
            "id",
        ),
        (
            "spawn",
            json!({"id": "x", "name": "s", "command": ["/bin/true"], "args": []}),
            "command",
        ),
        (
            "spawn",
            json!({"id": "x", "name": "s", "command": "/bin/true", "args": [], "env": ["A=1"]}),
            "env",
        ),
        (
            "spawn",
            json!({"id": "x", "name": "s", "command": "/bin/true", "args": [], "additionalMounts": []}),
            "additionalMounts",
        ),
        ("kill", json!({"id": "x", "signal": {}}), "signal"),
        ("writeStdin", json!({"id": "x", "data": 12}), "data"),
        ("isProcessRunning", json!({"id": false}), "id"),
        ("setDebugLogging", json!({"enabled": "yes"}), "enabled"),
        (
            "readFile",
            json!({"processName": 1, "filePath": "a"}),
            "processName",
        ),
        (
            "readFile",
            json!({"processName": "s", "filePath": null}),
            "filePath",
        ),
        ("deleteSessionDirs", json!({"names": "abc"}), "names"),
        (
            "getSessionsDiskInfo",
            json!({"lowWaterBytes": "many"}),
            "lowWaterBytes",
        ),
        ("startVM", json!({"bundlePath": 3}), "bundlePath"),
        (
            "mountPath",
            json!({"processId": "x", "subpath": 1, "mountName": "m", "mode": "rw"}),
            "subpath",
        ),
        (
            "installSdk",
            json!({"sdkSubpath": "a", "version": 1}),
            "version",
        ),
        ("addApprovedOauthToken", json!({"token": 5}), "token"),
        (
            "sendGuestResponse",
            json!({"id": "g", "resultJson": 5}),
            "resultJson",
        ),
    ];
    for (method, params, field) in cases {
        let e = remote_err(pipe.call(method, params.clone()).await, method);
        assert!(
            e.contains(field),
            "{method} {params}: error should name {field:?}: {e}"
        );
    }
    // params itself of the wrong type.
    let e = remote_err(pipe.call("kill", json!(5)).await, "kill params 5");
    assert!(e.to_lowercase().contains("param"), "{e}");
}

#[tokio::test]
async fn bad_frames_get_errors_or_close_and_disturb_nobody() {
    let d = shared();
    // A healthy pipe opened before the abuse must keep working after it.
    let witness = Pipe::connect(&d.socket).await.unwrap();
    witness.call("isRunning", Value::Null).await.unwrap();

    // Not JSON, invalid UTF-8, JSON non-objects, objects without a usable method.
    let bodies: [&[u8]; 9] = [
        b"this is not json",
        b"{\"method\": \"isRunning\"",
        b"\xff\xfe{}",
        b"[1,2,3]",
        b"\"isRunning\"",
        b"42",
        b"null",
        b"{}",
        b"{\"method\": 5, \"id\": 1}",
    ];
    for body in bodies {
        let mut c = RawConn::connect(&d.socket).await.unwrap();
        c.send_frame(body).await.unwrap();
        let r = c
            .read_reply(T)
            .await
            .unwrap_or_else(|e| panic!("{:?}: {e}", String::from_utf8_lossy(body)));
        let r = r.unwrap_or_else(|| {
            panic!(
                "{:?}: framing is intact, expected a success:false reply, got a close",
                String::from_utf8_lossy(body)
            )
        });
        assert!(
            is_error_reply(&r),
            "{:?}: {r}",
            String::from_utf8_lossy(body)
        );
    }

    // The connection survives a bad frame when framing is intact.
    let mut c = RawConn::connect(&d.socket).await.unwrap();
    c.send_frame(b"garbage").await.unwrap();
    let r = c.read_reply(T).await.unwrap().expect("error reply");
    assert!(is_error_reply(&r), "{r}");
    c.send_json(&request("isRunning", Some(json!(2)), Value::Null))
        .await
        .unwrap();
    let r = c
        .read_reply(T)
        .await
        .unwrap()
        .expect("reply after a bad frame");
    assert_eq!(r["id"], json!(2), "{r}");
    assert_eq!(r["success"], json!(true), "{r}");

    // Oversized length prefix: an error reply and/or a close, promptly.
    for len in [10 * 1024 * 1024 + 1u32, u32::MAX] {
        let mut c = RawConn::connect(&d.socket).await.unwrap();
        c.send_bytes(&len.to_be_bytes()).await.unwrap();
        // The server may already have answered and closed after the prefix
        // alone: a broken pipe here is that close, not a failure.
        let _ = c.send_bytes(b"{\"method\":").await;
        match c.read_reply(T).await {
            Ok(Some(r)) => {
                assert!(is_error_reply(&r), "oversized {len}: {r}");
                // Framing is lost: nothing else may follow but a close.
                match c.read_reply(T).await {
                    Ok(None) | Err(ClientError::Io(_)) | Err(ClientError::Frame(_)) => {}
                    other => {
                        panic!("oversized {len}: after the error expected a close, got {other:?}")
                    }
                }
            }
            Ok(None) => {}
            Err(ClientError::Io(_)) => {}
            Err(e) => panic!("oversized {len}: expected an error reply or a close, got {e}"),
        }
    }
    // A 10 MiB frame exactly is accepted (it is the limit, not past it).
    let mut big =
        serde_json::to_vec(&json!({"method": "isRunning", "id": 1, "params": {"pad": ""}}))
            .unwrap();
    let pad = 10 * 1024 * 1024 - big.len();
    let at = big.len() - 3;
    big.splice(at..at, std::iter::repeat_n(b'x', pad));
    assert_eq!(big.len(), 10 * 1024 * 1024);
    let mut c = RawConn::connect(&d.socket).await.unwrap();
    c.send_frame(&big).await.unwrap();
    let r = c
        .read_reply(T)
        .await
        .unwrap()
        .expect("reply to a 10 MiB frame");
    assert_eq!(r["success"], json!(true), "10 MiB frame: {r}");

    // Truncated frames: prefix cut short, body cut short, then half-close.
    for bytes in [vec![0u8, 0], {
        let mut f = encode_frame(b"{\"method\":\"isRunning\"}");
        f.truncate(12);
        f
    }] {
        let mut c = RawConn::connect(&d.socket).await.unwrap();
        c.send_bytes(&bytes).await.unwrap();
        c.shutdown_write().await.unwrap();
        match c.read_reply(T).await {
            Ok(Some(r)) => assert!(is_error_reply(&r), "truncated: {r}"),
            Ok(None) | Err(ClientError::Io(_)) => {}
            Err(e) => panic!("truncated frame: expected an error reply or close, got {e}"),
        }
    }
    // A client that sends half a frame and stalls must not block others.
    let mut stalled = RawConn::connect(&d.socket).await.unwrap();
    stalled.send_bytes(&[0, 0, 1, 0, b'{']).await.unwrap();

    let r = witness.call("isGuestConnected", Value::Null).await.unwrap();
    assert!(r["connected"].is_boolean());
    let r = Client::one_shot(&d.socket, "isRunning", Value::Null)
        .await
        .unwrap();
    assert!(r["running"].is_boolean());
    assert!(witness.take_unmatched().is_empty());
    drop(stalled);
}

#[tokio::test]
async fn sixty_four_concurrent_clients() {
    let d = shared();
    let sock = d.socket.clone();
    let mut tasks = Vec::new();
    for i in 0..64 {
        let sock = sock.clone();
        let root = d
            .dir
            .join("profiles")
            .join("many")
            .to_string_lossy()
            .into_owned();
        tasks.push(tokio::spawn(async move {
            let r = Client::one_shot(&sock, "isRunning", Value::Null).await?;
            assert!(r["running"].is_boolean(), "{r}");
            let pipe = Pipe::connect_profile(&sock, "many", &root).await?;
            let mut calls = tokio::task::JoinSet::new();
            for j in 0..10 {
                let p = pipe.clone();
                calls.spawn(async move {
                    let m = if j % 2 == 0 {
                        "isGuestConnected"
                    } else {
                        "getNetworkDrives"
                    };
                    (j, p.call(m, Value::Null).await)
                });
            }
            while let Some(r) = calls.join_next().await {
                let (j, r) = r.unwrap();
                let r = r?;
                if j % 2 == 0 {
                    assert!(r["connected"].is_boolean(), "client {i}: {r}");
                } else {
                    assert_eq!(r, json!({"drives": []}), "client {i}");
                }
            }
            Ok::<_, ClientError>(())
        }));
    }
    let t0 = Instant::now();
    for t in tasks {
        t.await.unwrap().expect("client");
    }
    assert!(t0.elapsed() < T);
}

const NOBODY_ENV: &str = "COWORK_TEST_NOBODY_SOCKET";

/// Runs only as the child of `peer_of_another_uid_is_refused`, as `nobody`:
/// connects, sends a one-shot request and reports what came back.
#[test]
#[ignore = "helper process of peer_of_another_uid_is_refused"]
fn nobody_child() {
    use std::io::{Read, Write};
    let Ok(path) = std::env::var(NOBODY_ENV) else {
        return;
    };
    assert_eq!(
        // SAFETY: geteuid takes no arguments and cannot fail.
        unsafe { libc::geteuid() },
        65534,
        "child must run as nobody"
    );
    let mut s = match std::os::unix::net::UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e) => {
            println!("RESULT connect-failed {e}");
            return;
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(&encode_frame(br#"{"method":"isRunning"}"#));
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Ok(_) if got.is_empty() => println!("RESULT closed"),
        Ok(_) => println!("RESULT reply {}", String::from_utf8_lossy(&got)),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => println!("RESULT closed"),
        Err(e) => println!("RESULT error {e}"),
    }
}

#[tokio::test]
async fn peer_of_another_uid_is_refused() {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run a client as nobody");
        return;
    }
    let d = Daemon::start();
    // Make the path reachable for nobody so that only SO_PEERCRED can refuse.
    for p in [d.dir.as_path(), d.socket.parent().unwrap()] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(&d.socket, std::fs::Permissions::from_mode(0o777)).unwrap();

    let out = tokio::task::spawn_blocking({
        let sock = d.socket.clone();
        let dir = d.dir.clone();
        move || {
            // A copy of this test binary where nobody can execute it, even
            // when the checkout lives below a private directory.
            let exe = dir.join("nobody-child");
            std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
            std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
            let mut cmd = std::process::Command::new(&exe);
            cmd.args([
                "nobody_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(NOBODY_ENV, &sock);
            // SAFETY: the closure only calls setgroups, setgid and setuid (async-signal-safe; a null list with a count of 0) between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::setgroups(0, std::ptr::null()) != 0
                        || libc::setgid(65534) != 0
                        || libc::setuid(65534) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            cmd.output().unwrap()
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let result = stdout
        .lines()
        .find_map(|l| l.split_once("RESULT ").map(|(_, r)| r))
        .unwrap_or_else(|| {
            panic!(
                "child reported nothing: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    assert!(
        result == "closed",
        "a peer of another uid must be dropped without a reply, child saw: {result}"
    );
    // The same path still serves our own uid.
    let r = Client::one_shot(&d.socket, "isRunning", Value::Null)
        .await
        .unwrap();
    assert_eq!(r["running"], json!(false));
}

#[tokio::test]
async fn stale_socket_file_is_replaced() {
    for kind in ["regular", "socket"] {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        std::fs::create_dir(&run).unwrap();
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
        let sock = run.join("helper.sock");
        if kind == "regular" {
            std::fs::write(&sock, b"leftover").unwrap();
        } else {
            // A socket file nobody listens on any more.
            drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
            assert!(std::os::unix::net::UnixStream::connect(&sock).is_err());
        }
        assert!(sock.exists());
        let d = Daemon::start_with(Opts {
            socket: Some(sock.clone()),
            ..Opts::default()
        });
        let r = Client::one_shot(&d.socket, "isRunning", Value::Null)
            .await
            .unwrap_or_else(|e| panic!("stale {kind} file: {e}"));
        assert_eq!(r["running"], json!(false));
    }
}

#[tokio::test]
async fn second_helper_on_a_live_socket_exits_nonzero() {
    let first = Daemon::start();
    let mut second = Daemon::start_with(Opts {
        socket: Some(first.socket.clone()),
        wait_ready: false,
        ..Opts::default()
    });
    let st = second
        .wait_exit(T)
        .expect("second helper must exit when a live helper owns the socket");
    assert!(!st.success(), "second helper exited with {st}");
    assert!(second.wait_log_closed(T));
    let log = second.log();
    let l = log.to_lowercase();
    assert!(
        ["already", "in use", "another", "live", "running"]
            .iter()
            .any(|w| l.contains(w)),
        "message should say a helper is already running: {log}"
    );
    // The first helper keeps its socket and keeps serving.
    assert!(first.socket.exists());
    let r = Client::one_shot(&first.socket, "isRunning", Value::Null)
        .await
        .expect("first helper still serves");
    assert_eq!(r["running"], json!(false));
}

#[tokio::test]
async fn sigterm_and_sigint_stop_vm_remove_socket_exit_zero() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut d = Daemon::start();
        let p = Profile::new(&d, "term");
        let pipe = p.pipe(&d).await;
        start_vm(&d, &pipe, json!({})).await;
        let mut sub = p.subscribe(&d).await;
        let marker = format!("1000.{}{}", std::process::id(), sig);
        pipe.call(
            "spawn",
            json!({"id": "sleeper", "name": "term", "command": "/bin/sleep", "args": [marker], "isResume": false}),
        )
        .await
        .unwrap();
        // spawn answers once the process is forked; wait for its exec.
        let t0 = Instant::now();
        while pids_with_arg(&marker).is_empty() {
            assert!(
                t0.elapsed() < T,
                "the spawned sleep should be visible on the host"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        d.signal(sig);
        // Stopping the VM ends the process: its exit event may still reach us.
        let st = d.wait_exit(T).expect("helper exits after the signal");
        assert_eq!(st.code(), Some(0), "signal {sig}: exit status {st}");
        assert!(!d.socket.exists(), "socket must be removed on signal {sig}");
        let left = wait_no_process(&marker, Duration::from_secs(5));
        assert!(
            left.is_empty(),
            "sandboxed process survived the helper: {left:?}"
        );
        // Whatever the subscription got before the close is well formed.
        for ev in sub.drain_for(Duration::from_millis(50)).await {
            assert!(ev["type"].is_string(), "{ev}");
        }
    }
}

#[tokio::test]
async fn set_debug_logging_switches_debug_lines() {
    let d = Daemon::start_with(Opts {
        env: vec![("COWORK_LOG".into(), "info".into())],
        ..Opts::default()
    });
    let pipe = Pipe::connect(&d.socket).await.unwrap();
    for _ in 0..5 {
        pipe.call("isRunning", Value::Null).await.unwrap();
    }
    let before = d.log().matches("DEBUG").count();
    let r = pipe
        .call("setDebugLogging", json!({"enabled": true}))
        .await
        .expect("setDebugLogging true");
    assert!(r.is_null() || r.is_object(), "{r}");
    // Some work a debug log mentions: requests, a one-shot connection.
    for _ in 0..5 {
        pipe.call("isRunning", Value::Null).await.unwrap();
        Client::one_shot(&d.socket, "isGuestConnected", Value::Null)
            .await
            .unwrap();
    }
    assert!(
        d.wait_log(Duration::from_secs(5), |l| l.matches("DEBUG").count()
            > before),
        "no DEBUG line after setDebugLogging(true):\n{}",
        d.log()
    );
    pipe.call("setDebugLogging", json!({"enabled": false}))
        .await
        .expect("setDebugLogging false");
}

#[tokio::test]
async fn simple_methods_and_their_shapes() {
    let d = shared();
    let p = Profile::new(d, "simple");
    let pipe = p.pipe(d).await;
    assert_eq!(
        pipe.call("isRunning", Value::Null).await.unwrap()["running"],
        json!(false)
    );
    assert_eq!(
        pipe.call("isGuestConnected", Value::Null).await.unwrap()["connected"],
        json!(false)
    );
    assert_eq!(
        pipe.call("getNetworkDrives", Value::Null).await.unwrap(),
        json!({"drives": []})
    );
    pipe.call(
        "sendGuestResponse",
        json!({"id": "no-such-request", "resultJson": "{}"}),
    )
    .await
    .expect("sendGuestResponse with an unknown id succeeds");
    pipe.call(
        "sendGuestResponse",
        json!({"id": "no-such-request-2", "error": "nope"}),
    )
    .await
    .expect("sendGuestResponse with an unknown id succeeds");
    let bundle = d.dir.join("bundle-simple");
    std::fs::create_dir_all(&bundle).unwrap();
    pipe.call(
        "createVM",
        json!({"bundlePath": bundle.to_string_lossy(), "diskSizeGB": 1}),
    )
    .await
    .expect("createVM");
    // A full configure, as the boot orchestrator sends it.
    pipe.call(
        "configure",
        json!({"userDataName": p.name, "userDataRoot": p.root, "networkDrives": [],
               "memoryMB": 4096, "cpuCount": 2, "smolBinPath": "/nonexistent/smol-bin.img",
               "logDir": d.dir.join("logs").to_string_lossy(), "virtiofsdPath": "/usr/libexec/virtiofsd",
               "firmwareCodePath": "/usr/share/OVMF/OVMF_CODE.fd",
               "firmwareVarsTemplatePath": "/usr/share/OVMF/OVMF_VARS.fd"}),
    )
    .await
    .expect("full configure");
    // Idempotent-retry methods answer the same when repeated.
    let a = pipe.call("isRunning", Value::Null).await.unwrap();
    let b = pipe.call("isRunning", Value::Null).await.unwrap();
    assert_eq!(a, b);
    // stopVM of a profile whose VM never started is harmless.
    pipe.call("stopVM", Value::Null)
        .await
        .expect("stopVM when stopped");
}

/// A helper asked to serve on `sock` that must refuse: it exits non-zero and
/// its log holds every word of `words` (lowercased).
fn assert_refused(sock: &std::path::Path, words: &[&str]) {
    let mut d = Daemon::start_with(Opts {
        socket: Some(sock.to_path_buf()),
        wait_ready: false,
        ..Opts::default()
    });
    let st = d
        .wait_exit(T)
        .expect("helper must exit on a refused socket path");
    assert!(!st.success(), "helper exited with {st}");
    assert!(d.wait_log_closed(T));
    let log = d.log().to_lowercase();
    for w in words {
        assert!(log.contains(w), "log should mention {w:?}: {log}");
    }
}

#[tokio::test]
async fn socket_in_a_sticky_shared_directory_like_tmp() {
    let tmp = tempfile::tempdir().unwrap();
    let shared = tmp.path().join("tmp");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let sock = shared.join("claude-cowork-vm.sock");
    let d = Daemon::start_with(Opts {
        socket: Some(sock.clone()),
        ..Opts::default()
    });
    let r = Client::one_shot(&sock, "isRunning", Value::Null)
        .await
        .expect("the helper serves from a sticky shared directory");
    assert_eq!(r["running"], json!(false));
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
    drop(d);

    // Without the sticky bit anyone could replace the socket: refused.
    let open = tmp.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert_refused(&open.join("helper.sock"), &["writable by others", "sticky"]);
}

#[tokio::test]
async fn squatted_socket_paths_and_foreign_directories_are_refused() {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to create files owned by another user");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let shared = tmp.path().join("tmp");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    // Someone else got there first with a socket of their own.
    let squatted = shared.join("claude-cowork-vm.sock");
    let listener = std::os::unix::net::UnixListener::bind(&squatted).unwrap();
    std::os::unix::fs::lchown(&squatted, Some(65534), Some(65534)).unwrap();
    assert_refused(&squatted, &["belongs to uid 65534", "different -socket"]);
    // Their socket is left alone.
    assert!(squatted.exists());
    drop(listener);

    // A directory of another user, even a private one.
    let foreign = tmp.path().join("theirs");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::set_permissions(&foreign, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
    assert_refused(&foreign.join("helper.sock"), &["owned by uid 65534"]);
}

#[tokio::test]
async fn connections_beyond_the_cap_get_a_clear_error_and_the_rest_keep_working() {
    const CAP: usize = 8;
    let mut opts = Opts::default();
    opts.env
        .push(("COWORK_MAX_CONNECTIONS".into(), CAP.to_string()));
    let d = Daemon::start_with(opts);
    // Fill the cap with live pipes (each proven served by a reply).
    let mut held = Vec::new();
    for i in 0..CAP {
        let mut c = RawConn::connect(&d.socket).await.unwrap();
        c.send_json(&json!({"id": i, "method": "isRunning"}))
            .await
            .unwrap();
        let r = c.read_reply(T).await.unwrap().expect("a reply");
        assert_eq!(r["result"]["running"], json!(false), "{r}");
        held.push(c);
    }
    // One more: an error that says why, then EOF.
    let mut extra = RawConn::connect(&d.socket).await.unwrap();
    let r = extra.read_reply(T).await.unwrap().expect("an error reply");
    assert!(is_error_reply(&r), "{r}");
    let msg = r["error"].as_str().unwrap();
    assert!(
        msg.contains("limit") && msg.contains(&CAP.to_string()),
        "{msg}"
    );
    assert!(extra.read_reply(T).await.unwrap().is_none(), "then closed");
    // The held connections are untouched.
    let c = &mut held[0];
    c.send_json(&json!({"id": "again", "method": "isRunning"}))
        .await
        .unwrap();
    let r = c.read_reply(T).await.unwrap().expect("still served");
    assert_eq!(r["id"], json!("again"), "{r}");
    // Closing one frees a slot.
    drop(held.pop());
    let t0 = Instant::now();
    loop {
        match Client::one_shot(&d.socket, "isRunning", Value::Null).await {
            Ok(r) => {
                assert_eq!(r["running"], json!(false));
                break;
            }
            Err(e) if t0.elapsed() < T => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("a freed slot must serve again: {e}"),
        }
    }
}
