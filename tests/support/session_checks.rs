//! Session-driving code shared by the VM end-to-end suites (`qemu_userland`,
//! `kvm_backend`): run a command in a session and collect its events, and
//! the checks that a VM's default userland is one a Claude Code session can
//! work in (GNU bash, python with ssl/sqlite3/venv, node, git, curl, jq,
//! file, its own non-root user, homes closed to other sessions, a
//! read-only `/usr`).

// Each test binary compiles this file and uses a different part of it.
#![allow(dead_code)]

use std::time::Duration;

use cowork_helper::client::{Pipe, ProcessOutput, Subscription};
use serde_json::{json, Value};

/// Spawn parameters of `bash -c script` in `session`.
pub fn bash(id: &str, session: &str, script: &str) -> Value {
    json!({"id": id, "name": session, "command": "bash", "args": ["-c", script], "isResume": false})
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
    assert_eq!(
        out.exit_code(),
        Some(0),
        "{id}: `{script}` failed ({}): stdout {:?} stderr {:?}",
        out.exit,
        out.stdout_str(),
        out.stderr_str()
    );
    out.stdout_str()
}

/// The checks of a default (Debian) userland session, in sessions
/// `<tag>-a` and `<tag>-b`.
pub async fn default_userland(pipe: &Pipe, sub: &mut Subscription, tag: &str, limit: Duration) {
    let a = format!("{tag}-a");
    let b = format!("{tag}-b");

    // GNU bash is the spawn command itself; the OS is ours.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-bash"),
        &a,
        "echo \"$BASH_VERSION\"; bash --version | head -n1; . /etc/os-release; echo \"os=$ID\"",
        limit,
    )
    .await;
    assert!(
        out.contains("GNU bash") && out.contains("os=debian"),
        "{out:?}"
    );

    // Who the session is: its own non-root user, its home, its env.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-id"),
        &a,
        "id -u; id -g; id -un; echo \"home=$HOME shell=$SHELL user=$USER tmp=$TMPDIR lang=$LANG\"; \
         stat -c '%a %u' \"$HOME\"; pwd; grep -E '^Cap(Eff|Prm|Bnd)|^NoNewPrivs' /proc/self/status",
        limit,
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    let uid: u32 = lines[0].parse().expect("uid");
    assert_ne!(uid, 0, "sessions must not run as root: {out}");
    assert_eq!(lines[1], lines[0], "gid == uid: {out}");
    assert_eq!(lines[2], a, "login name is the session name: {out}");
    assert_eq!(
        lines[3],
        format!("home=/sessions/{a} shell=/bin/bash user={a} tmp=/sessions/{a}/tmp lang=C.UTF-8"),
        "{out}"
    );
    assert_eq!(lines[4], format!("700 {uid}"), "home mode and owner: {out}");
    for cap in [
        "CapEff:\t0000000000000000",
        "CapPrm:\t0000000000000000",
        "CapBnd:\t0000000000000000",
        "NoNewPrivs:\t1",
    ] {
        assert!(out.contains(cap), "{cap} missing: {out}");
    }

    // What no systemd sets up, the agent did: /dev/fd (process
    // substitution), the hostname, resolv.conf, a raised open-file limit;
    // the overlay's layers are hidden from sessions.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-dev"),
        &a,
        "readlink /dev/fd; cat <(echo substituted); hostname; test -f /etc/resolv.conf && echo resolv; \
         ulimit -n; ls -A /run/cowork/userland 2>/dev/null | wc -l",
        limit,
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[..4],
        ["/proc/self/fd", "substituted", "claude", "resolv"],
        "{out}"
    );
    let nofile: u64 = lines[4].parse().expect("ulimit -n");
    assert!(nofile >= 65536, "open-file limit {nofile}");
    assert_eq!(lines[5], "0", "the overlay's layers are visible: {out}");

    // Python with ssl, sqlite3 and venv; a venv can be made in the home.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-py"),
        &a,
        "python3 -c 'import ssl, sqlite3, venv, json; c = sqlite3.connect(\":memory:\"); \
         print(ssl.OPENSSL_VERSION.split()[0], c.execute(\"select 6*7\").fetchone()[0])' && \
         python3 -m venv --without-pip ~/venv && ~/venv/bin/python -c 'import sys; print(sys.prefix)'",
        limit,
    )
    .await;
    assert!(
        out.contains("OpenSSL 42") && out.contains(&format!("/sessions/{a}/venv")),
        "{out:?}"
    );

    // Node.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-node"),
        &a,
        "node -e 'console.log(process.version, [1,2,3].map(x => x * 2).join(\",\"))'",
        limit,
    )
    .await;
    assert!(out.starts_with('v') && out.contains("2,4,6"), "{out:?}");

    // git init/add/commit in the home.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-git"),
        &a,
        "cd ~ && git init -q repo && cd repo && echo hello > a.txt && git add a.txt && \
         git -c user.name=t -c user.email=t@example.invalid commit -qm first && git log --format=%s",
        limit,
    )
    .await;
    assert_eq!(out, "first\n");

    // curl, jq and file are there and work offline.
    let out = ok(
        pipe,
        sub,
        &format!("{tag}-tools"),
        &a,
        "curl --version | head -n1; echo '{\"k\":[1,2]}' | jq -c '.k | length'; file -b /bin/bash | cut -d, -f1",
        limit,
    )
    .await;
    assert!(
        out.starts_with("curl ") && out.contains("\n2\n") && out.contains("ELF 64-bit"),
        "{out:?}"
    );

    // /usr is not writable; the session's own tmp is.
    let out = run(
        pipe,
        sub,
        bash(
            &format!("{tag}-usr"),
            &a,
            "touch /usr/bin/x 2>&1; touch /usr/x 2>&1; touch \"$TMPDIR/ok\" && echo tmp-ok",
        ),
        limit,
    )
    .await;
    let text = out.stdout_str();
    assert_eq!(
        text.matches("Permission denied").count(),
        2,
        "/usr writable? {text:?}"
    );
    assert!(text.ends_with("tmp-ok\n"), "{text:?}");

    // Another session's home is closed: b cannot list or read a's files.
    ok(
        pipe,
        sub,
        &format!("{tag}-secret"),
        &a,
        "echo secret-of-a > ~/secret.txt",
        limit,
    )
    .await;
    let out = run(
        pipe,
        sub,
        bash(
            &format!("{tag}-peek"),
            &b,
            &format!("id -u; ls /sessions/{a} 2>&1; cat /sessions/{a}/secret.txt 2>&1; echo end"),
        ),
        limit,
    )
    .await;
    let text = out.stdout_str();
    let b_uid: u32 = text
        .lines()
        .next()
        .and_then(|l| l.parse().ok())
        .expect("b's uid");
    assert!(b_uid != 0 && b_uid != uid, "b has its own uid: {text}");
    assert!(!text.contains("secret-of-a"), "b read a's file: {text}");
    assert_eq!(
        text.matches("Permission denied").count(),
        2,
        "b must be refused twice: {text}"
    );
    // The host still reads it (readFile runs as the agent).
    let r = pipe
        .call(
            "readFile",
            json!({"processName": a, "filePath": "secret.txt"}),
        )
        .await
        .expect("readFile");
    use base64::Engine;
    let content = base64::engine::general_purpose::STANDARD
        .decode(r["content"].as_str().expect("content"))
        .expect("base64");
    assert_eq!(content, b"secret-of-a\n");
}
