//! End-to-end tests: a real agent loop on its own thread and runtime, over a
//! socketpair, driven by a small protocol client.
//!
//! Tests that need mounts or capabilities re-run themselves inside fresh
//! user + mount (+ pid) namespaces with `unshare(1)`, so they behave the
//! same as root and as an unprivileged user (see [`in_namespaces`]).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use super::*;
use crate::proto::{Envelope, MountMode, MountSpec, Secret, SpawnSpec};

/// Longest wait for any single agent message.
const RECV_TIMEOUT: Duration = Duration::from_secs(30);

/// Read buffer of the test host: large, so bulk output tests read in few calls.
const CLIENT_READ_BUFFER: usize = 1 << 20;

/// Read buffer of a test host that only exchanges small messages (tokio's
/// default `BufReader` size).
const SMALL_READ_BUFFER: usize = 8 * 1024;

type Msg = (AgentMessage, Vec<u8>);

/// A minimal host: sends requests, collects agent messages.
struct Client {
    rd: BufReader<OwnedReadHalf>,
    wr: Option<OwnedWriteHalf>,
    next_id: u64,
    buf: Vec<u8>,
    /// Messages received but not consumed yet.
    stash: VecDeque<Msg>,
    hello: Hello,
}

/// Everything one process produced.
#[derive(Debug, Default)]
struct Output {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exit_code: Option<i32>,
    signal: Option<String>,
    oom_kill_count: Option<u64>,
}

impl Output {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

struct TestAgent {
    client: Client,
    thread: Option<std::thread::JoinHandle<i32>>,
}

impl TestAgent {
    /// The agent's exit code, once it returned.
    fn join(&mut self) -> i32 {
        self.thread
            .take()
            .expect("joined twice")
            .join()
            .expect("agent thread panicked")
    }
}

fn config(sessions_root: &Path) -> Config {
    Config {
        sessions_root: sessions_root.to_path_buf(),
        sdk_target: sessions_root.join("../usr/local/bin/claude"),
        ..Config::default()
    }
}

async fn start(config: Config) -> TestAgent {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let agent = Agent::new(config, a.into(), BootClock::now()).expect("agent starts");
            agent.run().await
        })
    });
    let mut client = Client::new(b, CLIENT_READ_BUFFER);
    match client.recv_raw().await {
        Some((AgentMessage::Hello(h), _)) => client.hello = h,
        other => panic!("first message is not a hello: {other:?}"),
    }
    TestAgent {
        client,
        thread: Some(thread),
    }
}

impl Client {
    /// The host's end of the link `b`, reading through a `capacity`-byte
    /// buffer; the hello is not read yet.
    fn new(b: std::os::unix::net::UnixStream, capacity: usize) -> Self {
        b.set_nonblocking(true).unwrap();
        let (rd, wr) = tokio::net::UnixStream::from_std(b).unwrap().into_split();
        Client {
            rd: BufReader::with_capacity(capacity, rd),
            wr: Some(wr),
            next_id: 1,
            buf: Vec::new(),
            stash: VecDeque::new(),
            hello: Hello::default(),
        }
    }

    async fn recv_raw(&mut self) -> Option<Msg> {
        let read = framing::read_frame(&mut self.rd, proto::MAX_MESSAGE, &mut self.buf);
        let more = tokio::time::timeout(RECV_TIMEOUT, read)
            .await
            .expect("timed out waiting for the agent")
            .expect("valid frame");
        if !more {
            return None;
        }
        let env: Envelope<AgentMessage> =
            proto::decode(std::mem::take(&mut self.buf)).expect("valid message");
        Some((env.header, env.payload))
    }

    async fn next(&mut self) -> Option<Msg> {
        match self.stash.pop_front() {
            Some(m) => Some(m),
            None => self.recv_raw().await,
        }
    }

    async fn send_raw(&mut self, msg: &HostMessage, payload: &[u8]) {
        let body = proto::encode(msg, payload);
        let wr = self.wr.as_mut().expect("write side open");
        framing::write_frame(wr, &body, proto::MAX_MESSAGE)
            .await
            .unwrap();
    }

    async fn send(&mut self, op: Op, payload: &[u8]) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.send_raw(&HostMessage::Request { id, op }, payload)
            .await;
        id
    }

    /// Waits for the response to `id`, stashing everything else.
    async fn response(&mut self, id: u64) -> Result<(Value, Vec<u8>), String> {
        let mut skipped = VecDeque::new();
        let found = loop {
            let Some(m) = self.next().await else {
                panic!("connection closed before response {id}")
            };
            match m {
                (
                    AgentMessage::Response {
                        id: rid,
                        error,
                        result,
                    },
                    payload,
                ) if rid == id => {
                    break match error {
                        Some(e) => Err(e),
                        None => Ok((result, payload)),
                    };
                }
                other => skipped.push_back(other),
            }
        };
        skipped.extend(self.stash.drain(..));
        self.stash = skipped;
        found
    }

    async fn request(&mut self, op: Op, payload: &[u8]) -> Result<(Value, Vec<u8>), String> {
        let id = self.send(op, payload).await;
        self.response(id).await
    }

    async fn spawn(&mut self, spec: SpawnSpec) -> Result<Value, String> {
        self.request(Op::Spawn(spec), &[]).await.map(|(v, _)| v)
    }

    /// Collects the output of `pid` until its exit, checking that nothing of
    /// it arrives after the exit and that no message precedes the spawn.
    async fn wait_exit(&mut self, pid: &str) -> Output {
        let mut out = Output::default();
        let mut others = VecDeque::new();
        loop {
            let Some((msg, payload)) = self.next().await else {
                panic!("closed before exit of {pid}")
            };
            match msg {
                AgentMessage::Stdout { id } if id == pid => out.stdout.extend_from_slice(&payload),
                AgentMessage::Stderr { id } if id == pid => out.stderr.extend_from_slice(&payload),
                AgentMessage::Exit {
                    id,
                    exit_code,
                    signal,
                    oom_kill_count,
                } if id == pid => {
                    out.exit_code = exit_code;
                    out.signal = signal;
                    out.oom_kill_count = oom_kill_count;
                    break;
                }
                other => others.push_back((other, payload)),
            }
        }
        others.extend(self.stash.drain(..));
        self.stash = others;
        out
    }

    async fn run(&mut self, spec: SpawnSpec) -> Output {
        let pid = spec.id.clone();
        self.spawn(spec).await.expect("spawn succeeds");
        self.wait_exit(&pid).await
    }

    /// Half-closes the connection (EOF for the agent).
    fn close_write(&mut self) {
        self.wr = None;
    }

    /// Reads until the agent closes the connection; returns the rest.
    async fn drain(&mut self) -> Vec<AgentMessage> {
        let mut all: Vec<AgentMessage> = self.stash.drain(..).map(|(m, _)| m).collect();
        while let Some((m, _)) = self.recv_raw().await {
            all.push(m);
        }
        all
    }
}

fn spec(id: &str, session: &str, argv: &[&str]) -> SpawnSpec {
    SpawnSpec {
        id: id.into(),
        name: session.into(),
        command: argv[0].into(),
        args: argv[1..].iter().map(|s| s.to_string()).collect(),
        cwd: None,
        env: Default::default(),
        oauth_token: None,
        mounts: vec![],
        is_resume: false,
        one_shot: false,
        mount_skeleton_home: false,
        allowed_domains: None,
        egress_proxy: None,
    }
}

fn sh(id: &str, script: &str) -> SpawnSpec {
    spec(id, "s", &["sh", "-c", script])
}

#[tokio::test]
async fn hello_describes_the_agent() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let h = &agent.client.hello;
    assert_eq!(h.protocol, proto::PROTOCOL_VERSION);
    assert_eq!(h.version, env!("CARGO_PKG_VERSION"));
    assert!(!h.is_init);
    assert!(!h.kernel.is_empty());
    assert_eq!(
        h.boot.agent_start_us, 0,
        "times are relative to the start outside init"
    );
    assert!(h.boot.connected_us >= h.boot.init_done_us);
    let (v, _) = agent.client.request(Op::Ping, &[]).await.unwrap();
    assert_eq!(v, json!({}));
    agent.client.close_write();
    agent.client.drain().await;
    assert_eq!(agent.join(), EXIT_OK);
}

#[tokio::test]
async fn spawn_response_then_output_then_exit() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let c = &mut agent.client;
    let id = c
        .send(
            Op::Spawn(sh("p1", "echo out; echo err >&2; printf tail; exit 3")),
            &[],
        )
        .await;
    // The very next message must be the spawn's response: output never precedes it.
    match c.recv_raw().await.unwrap() {
        (
            AgentMessage::Response {
                id: rid,
                error: None,
                result,
            },
            _,
        ) => {
            assert_eq!(rid, id);
            assert_eq!(result, json!({"failedMounts": []}));
        }
        other => panic!("expected the spawn response first, got {other:?}"),
    }
    let out = c.wait_exit("p1").await;
    assert_eq!(out.stdout(), "out\ntail");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.exit_code, Some(3));
    assert_eq!(out.signal, None);
    assert_eq!(out.oom_kill_count, None, "no cgroup root: no OOM count");
    // The session directory and its mnt/ exist.
    assert!(root.path().join("s/mnt").is_dir());
    let status = c
        .request(Op::ProcessStatus { id: "p1".into() }, &[])
        .await
        .unwrap()
        .0;
    assert_eq!(status, json!({"running": false, "exitCode": 3}));
}

#[tokio::test]
async fn twenty_thousand_lines_arrive_whole_and_in_order() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let out = agent
        .client
        .run(spec("seq", "s", &["seq", "1", "20000"]))
        .await;
    let expected: String = (1..=20000).map(|i| format!("{i}\n")).collect();
    assert_eq!(out.stdout.len(), expected.len());
    assert!(out.stdout() == expected, "output differs from seq 1 20000");
    assert_eq!(out.exit_code, Some(0));
}

#[tokio::test]
async fn stdin_is_echoed_by_cat_in_order() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let c = &mut agent.client;
    c.spawn(spec("cat", "s", &["cat"])).await.unwrap();
    let mut expected = Vec::new();
    for i in 0..200 {
        let chunk = format!("line {i} {}\n", "x".repeat(i * 37));
        expected.extend_from_slice(chunk.as_bytes());
        c.request(Op::WriteStdin { id: "cat".into() }, chunk.as_bytes())
            .await
            .unwrap();
    }
    c.request(Op::CloseStdin { id: "cat".into() }, &[])
        .await
        .unwrap();
    let out = c.wait_exit("cat").await;
    assert!(out.stdout == expected, "echo differs");
    assert_eq!(out.exit_code, Some(0));
    let err = c
        .request(Op::WriteStdin { id: "cat".into() }, b"late")
        .await
        .unwrap_err();
    assert_eq!(err, "process cat is not running");
    // Closing again after the exit is harmless.
    c.request(Op::CloseStdin { id: "cat".into() }, &[])
        .await
        .unwrap();
}

fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    after.trim_start().chars().next()
}

#[tokio::test]
async fn kill_takes_the_whole_process_group() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let c = &mut agent.client;
    c.spawn(sh("grp", "sleep 100 & echo $!; sleep 100"))
        .await
        .unwrap();
    // The background sleep's pid comes first on stdout.
    let mut line = Vec::new();
    while !line.ends_with(b"\n") {
        match c.next().await.unwrap() {
            (AgentMessage::Stdout { id }, p) if id == "grp" => line.extend_from_slice(&p),
            other => c.stash.push_back(other),
        }
    }
    let bg: i32 = String::from_utf8(line).unwrap().trim().parse().unwrap();
    assert_eq!(
        c.request(Op::ProcessStatus { id: "grp".into() }, &[])
            .await
            .unwrap()
            .0,
        json!({"running": true})
    );
    let t0 = Instant::now();
    c.request(
        Op::Kill {
            id: "grp".into(),
            signal: libc::SIGTERM,
        },
        &[],
    )
    .await
    .unwrap();
    let out = c.wait_exit("grp").await;
    assert_eq!(out.signal.as_deref(), Some("SIGTERM"));
    assert_eq!(out.exit_code, None);
    // The exit came well before the 2 s grace: the background sleep, which
    // held the pipe, died with the group.
    assert!(t0.elapsed() < EXIT_GRACE_BOUND, "{:?}", t0.elapsed());
    let deadline = Instant::now() + Duration::from_secs(5);
    while matches!(proc_state(bg), Some(s) if s != 'Z') {
        assert!(
            Instant::now() < deadline,
            "background sleep {bg} survived the group kill"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Killing an exited process is fine; unknown ids and bad signals are not.
    c.request(
        Op::Kill {
            id: "grp".into(),
            signal: libc::SIGKILL,
        },
        &[],
    )
    .await
    .unwrap();
    let err = c
        .request(
            Op::Kill {
                id: "nope".into(),
                signal: 9,
            },
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(err, "no process with id nope");
    c.spawn(spec("sl", "s", &["sleep", "100"])).await.unwrap();
    let err = c
        .request(
            Op::Kill {
                id: "sl".into(),
                signal: 0,
            },
            &[],
        )
        .await
        .unwrap_err();
    assert!(err.contains("invalid signal"), "{err}");
    c.request(
        Op::Kill {
            id: "sl".into(),
            signal: 9,
        },
        &[],
    )
    .await
    .unwrap();
    assert_eq!(c.wait_exit("sl").await.signal.as_deref(), Some("SIGKILL"));
}

/// An exit that waited for the EOF grace would take at least this long.
const EXIT_GRACE_BOUND: Duration = Duration::from_millis(1500);

#[tokio::test]
async fn exit_codes_and_signal_names() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let c = &mut agent.client;
    let out = c.run(sh("e7", "exit 7")).await;
    assert_eq!((out.exit_code, out.signal), (Some(7), None));
    let out = c.run(sh("k9", "kill -KILL $$")).await;
    assert_eq!(
        (out.exit_code, out.signal.as_deref()),
        (None, Some("SIGKILL"))
    );
    let out = c.run(sh("segv", "kill -SEGV $$")).await;
    assert_eq!(out.signal.as_deref(), Some("SIGSEGV"));
    let status = c
        .request(Op::ProcessStatus { id: "k9".into() }, &[])
        .await
        .unwrap()
        .0;
    assert_eq!(status, json!({"running": false, "signal": "SIGKILL"}));
}

#[tokio::test]
async fn exit_waits_for_open_pipes_only_within_the_grace() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let c = &mut agent.client;
    // A grandchild that finishes soon: its output is delivered before the exit.
    let out = c
        .run(sh("soon", "(sleep 0.3; echo late) & echo early"))
        .await;
    assert_eq!(out.stdout(), "early\nlate\n");
    assert_eq!(out.exit_code, Some(0));
    // A grandchild that keeps the pipe for long: the exit comes after the
    // grace, and its later output is never sent.
    let t0 = Instant::now();
    let out = c
        .run(sh("long", "(sleep 4; echo never) & echo early"))
        .await;
    let waited = t0.elapsed();
    assert_eq!(out.stdout(), "early\n");
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_millis(3900),
        "{waited:?}"
    );
    // Nothing more for "long" arrives afterwards, even once the grandchild wrote.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    c.request(Op::Ping, &[]).await.unwrap();
    for (m, _) in &c.stash {
        assert!(
            !matches!(m, AgentMessage::Stdout { id } if id == "long"),
            "output after exit: {m:?}"
        );
    }
}

#[tokio::test]
async fn environment_rules_reach_the_process() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let c = &mut agent.client;
    let mut s = spec("env1", "sess", &["env"]);
    s.env.insert("EMPTY".into(), String::new());
    s.env.insert("KEEP".into(), "yes".into());
    s.oauth_token = Some(Secret("tok-123".into()));
    let out = c.run(s.clone()).await;
    let lines: Vec<String> = out.stdout().lines().map(String::from).collect();
    assert!(
        lines.contains(&"CLAUDE_CODE_OAUTH_TOKEN=tok-123".to_string()),
        "{lines:?}"
    );
    assert!(lines.contains(&"KEEP=yes".to_string()));
    assert!(
        !lines.iter().any(|l| l.starts_with("EMPTY=")),
        "empty value kept: {lines:?}"
    );
    let home = format!("HOME={}", root.path().join("sess").display());
    assert!(lines.contains(&home), "{lines:?}");
    // The agent's own environment does not leak into the process.
    assert!(!lines.iter().any(|l| l.starts_with("CARGO_")), "{lines:?}");
    let mut s2 = s.clone();
    s2.id = "env2".into();
    s2.env.insert("ANTHROPIC_API_KEY".into(), "sk-own".into());
    let out = c.run(s2).await;
    assert!(out.stdout().contains("ANTHROPIC_API_KEY=sk-own"));
    assert!(!out.stdout().contains("CLAUDE_CODE_OAUTH_TOKEN"));
    // cwd defaults to the session directory; a relative cwd is below it.
    std::fs::create_dir_all(root.path().join("sess/work")).unwrap();
    let out = c.run(spec("pwd1", "sess", &["pwd"])).await;
    assert_eq!(
        out.stdout().trim(),
        root.path().join("sess").display().to_string()
    );
    let mut p = spec("pwd2", "sess", &["pwd"]);
    p.cwd = Some("work".into());
    assert_eq!(
        c.run(p).await.stdout().trim(),
        root.path().join("sess/work").display().to_string()
    );
}

#[tokio::test]
async fn bad_requests_get_actionable_errors() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let c = &mut agent.client;
    let err = c
        .spawn(spec("x1", "s", &["/nonexistent/bin/tool"]))
        .await
        .unwrap_err();
    assert_eq!(err, "command not found: /nonexistent/bin/tool");
    let err = c
        .spawn(spec("x2", "s", &["definitely-not-a-command-xyz"]))
        .await
        .unwrap_err();
    assert!(err.contains("command not found"), "{err}");
    let mut s = spec("x3", "s", &["true"]);
    s.cwd = Some("/nonexistent/dir".into());
    let err = c.spawn(s).await.unwrap_err();
    assert!(
        err.contains("working directory") && err.contains("does not exist"),
        "{err}"
    );
    let err = c.spawn(spec("x4", "../etc", &["true"])).await.unwrap_err();
    assert!(err.contains("session name"), "{err}");
    let err = c.spawn(spec("", "s", &["true"])).await.unwrap_err();
    assert!(err.contains("must not be empty"), "{err}");
    // A mount that cannot be made (here: a bad name) is reported, not fatal.
    let mut s = spec("badmount", "s", &["true"]);
    s.mounts = vec![MountSpec {
        session: "s".into(),
        name: "../escape".into(),
        source: "/tmp".into(),
        mode: MountMode::Ro,
    }];
    assert_eq!(
        c.spawn(s).await.unwrap(),
        json!({"failedMounts": ["../escape"]})
    );
    assert_eq!(c.wait_exit("badmount").await.exit_code, Some(0));
    c.spawn(spec("dup", "s", &["sleep", "100"])).await.unwrap();
    let err = c.spawn(spec("dup", "s", &["true"])).await.unwrap_err();
    assert_eq!(err, "process dup is already running");
    for op in [
        Op::WriteStdin { id: "ghost".into() },
        Op::CloseStdin { id: "ghost".into() },
        Op::ProcessStatus { id: "ghost".into() },
    ] {
        assert_eq!(
            c.request(op, b"x").await.unwrap_err(),
            "no process with id ghost"
        );
    }
    // A request the agent does not understand still gets an answer.
    let raw = json!({"type": "request", "id": 4242, "op": {"op": "frobnicate"}});
    let body = proto::encode(&raw, &[]);
    framing::write_frame(c.wr.as_mut().unwrap(), &body, proto::MAX_MESSAGE)
        .await
        .unwrap();
    let err = c.response(4242).await.unwrap_err();
    assert!(err.contains("unsupported or malformed request"), "{err}");
    // A failed spawn leaves nothing behind; the same id can be used again.
    c.request(
        Op::Kill {
            id: "dup".into(),
            signal: 9,
        },
        &[],
    )
    .await
    .unwrap();
    c.wait_exit("dup").await;
    let out = c.run(spec("dup", "s", &["sh", "-c", "echo again"])).await;
    assert_eq!(out.stdout(), "again\n");
}

#[tokio::test]
async fn read_file_stays_inside_the_session() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    std::fs::create_dir_all(r.join("s/out")).unwrap();
    std::fs::create_dir_all(r.join("other")).unwrap();
    let bytes: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    std::fs::write(r.join("s/out/data.bin"), &bytes).unwrap();
    std::fs::write(r.join("other/secret"), b"nope").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", r.join("s/passwd")).unwrap();
    std::os::unix::fs::symlink("../other/secret", r.join("s/sneaky")).unwrap();
    let mut agent = start(config(r)).await;
    let c = &mut agent.client;
    let read = |path: &str| Op::ReadFile {
        session: "s".into(),
        path: path.into(),
    };
    let (v, payload) = c.request(read("out/data.bin"), &[]).await.unwrap();
    assert_eq!(v, json!({}));
    assert!(payload == bytes);
    let abs = r.join("s/out/data.bin").display().to_string();
    assert!(c.request(read(&abs), &[]).await.unwrap().1 == bytes);
    for bad in [
        "../other/secret",
        "passwd",
        "sneaky",
        "/etc/passwd",
        "out/../../other/secret",
    ] {
        let err = c.request(read(bad), &[]).await.unwrap_err();
        assert!(err.contains("outside the session"), "{bad}: {err}");
    }
    let err = c.request(read("missing.txt"), &[]).await.unwrap_err();
    assert!(err.contains("does not exist"), "{err}");
    let err = c
        .request(
            Op::ReadFile {
                session: "a/b".into(),
                path: "x".into(),
            },
            &[],
        )
        .await
        .unwrap_err();
    assert!(err.contains("session name"), "{err}");
}

#[tokio::test]
async fn shutdown_reports_exits_before_answering() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let c = &mut agent.client;
    c.spawn(spec("a", "s", &["sleep", "100"])).await.unwrap();
    c.spawn(sh("b", "trap '' TERM; sleep 100")).await.unwrap();
    let id = c.send(Op::Shutdown, &[]).await;
    let rest = c.drain().await;
    let pos =
        |pred: &dyn Fn(&AgentMessage) -> bool| rest.iter().position(pred).expect("message present");
    let exit_a = pos(&|m| matches!(m, AgentMessage::Exit { id, .. } if id == "a"));
    let exit_b = pos(&|m| matches!(m, AgentMessage::Exit { id, .. } if id == "b"));
    let reply =
        pos(&|m| matches!(m, AgentMessage::Response { id: r, error: None, .. } if *r == id));
    assert!(exit_a < reply && exit_b < reply, "{rest:?}");
    assert!(
        matches!(&rest[exit_b], AgentMessage::Exit { signal: Some(s), .. } if s == "SIGKILL"),
        "{rest:?}"
    );
    assert_eq!(agent.join(), EXIT_OK);
}

#[tokio::test]
async fn host_eof_kills_everything_and_exits_zero() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let c = &mut agent.client;
    c.spawn(sh("bg", "sleep 100 & echo $!; wait"))
        .await
        .unwrap();
    let mut line = Vec::new();
    while !line.ends_with(b"\n") {
        if let (AgentMessage::Stdout { .. }, p) = c.next().await.unwrap() {
            line.extend_from_slice(&p);
        }
    }
    let bg: i32 = String::from_utf8(line).unwrap().trim().parse().unwrap();
    c.close_write();
    let rest = c.drain().await;
    assert!(
        rest.iter()
            .any(|m| matches!(m, AgentMessage::Exit { id, .. } if id == "bg")),
        "{rest:?}"
    );
    assert_eq!(agent.join(), EXIT_OK);
    let deadline = Instant::now() + Duration::from_secs(5);
    while matches!(proc_state(bg), Some(s) if s != 'Z') {
        assert!(Instant::now() < deadline, "process {bg} survived the agent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn janitor_requests_respect_live_sessions() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    std::fs::create_dir_all(r.join("idle/.cache")).unwrap();
    std::fs::write(r.join("idle/.cache/blob"), vec![1u8; 64 * 1024]).unwrap();
    let mut agent = start(config(r)).await;
    let c = &mut agent.client;
    c.spawn(spec("busy-proc", "busy", &["sleep", "100"]))
        .await
        .unwrap();
    let (info, _) = c
        .request(Op::DiskInfo { low_water_bytes: 0 }, &[])
        .await
        .unwrap();
    let names: Vec<&str> = info["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["busy", "idle"]);
    let prune = Op::PruneSessionCaches {
        only_if_free_bytes_below: None,
        include_session_tmp: false,
        session_tmp_older_than_seconds: None,
    };
    let (v, _) = c.request(prune, &[]).await.unwrap();
    assert_eq!(v["prunedSessions"], json!(["idle"]));
    assert_eq!(v["skippedSessions"], json!(["busy"]));
    let del = Op::DeleteSessionDirs {
        names: vec!["busy".into(), "idle".into(), "..".into()],
    };
    let (v, _) = c.request(del, &[]).await.unwrap();
    assert_eq!(v["deleted"], json!(["idle"]));
    assert!(v["errors"]["busy"]
        .as_str()
        .unwrap()
        .contains("running process"));
    assert!(v["errors"][".."].is_string());
    assert!(r.join("busy").is_dir() && !r.join("idle").exists());
    c.request(
        Op::Kill {
            id: "busy-proc".into(),
            signal: 9,
        },
        &[],
    )
    .await
    .unwrap();
    c.wait_exit("busy-proc").await;
    let (v, _) = c
        .request(
            Op::DeleteSessionDirs {
                names: vec!["busy".into()],
            },
            &[],
        )
        .await
        .unwrap();
    assert_eq!(v["deleted"], json!(["busy"]));
}

#[tokio::test]
async fn guest_requests_are_routed_by_id() {
    let root = tempfile::tempdir().unwrap();
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let cfg = config(root.path());
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let agent = Agent::new(cfg, a.into(), BootClock::now()).unwrap();
            let guest = agent.guest_requests();
            let caller = tokio::spawn(async move {
                let ok = guest
                    .request(
                        "openUrl",
                        json!({"url": "https://example.invalid"}),
                        RECV_TIMEOUT,
                    )
                    .await;
                let err = guest.request("denied", json!({}), RECV_TIMEOUT).await;
                let late = guest
                    .request("slow", json!({}), Duration::from_millis(200))
                    .await;
                tx.send((
                    ok.map_err(|e| e.to_string()),
                    err.map_err(|e| e.to_string()),
                    late.map_err(|e| e.to_string()),
                ))
                .unwrap();
            });
            let code = agent.run().await;
            caller.await.unwrap();
            code
        })
    });
    let mut c = Client::new(b, SMALL_READ_BUFFER);
    let mut answered = 0;
    while answered < 2 {
        match c.recv_raw().await.unwrap() {
            (AgentMessage::Request { id, method, params }, _) => {
                let (result_json, error) = match method.as_str() {
                    "openUrl" => {
                        assert_eq!(params["url"], "https://example.invalid");
                        (Some(r#"{"opened":true}"#.to_string()), None)
                    }
                    "denied" => (None, Some("user said no".to_string())),
                    other => panic!("unexpected method {other}"),
                };
                // A stray answer for an unknown id is ignored.
                c.send_raw(
                    &HostMessage::GuestResponse {
                        id: "g999".into(),
                        result_json: None,
                        error: None,
                    },
                    &[],
                )
                .await;
                c.send_raw(
                    &HostMessage::GuestResponse {
                        id,
                        result_json,
                        error,
                    },
                    &[],
                )
                .await;
                answered += 1;
            }
            (AgentMessage::Hello(_), _) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let (ok, err, late) = tokio::task::spawn_blocking(move || rx.recv().unwrap())
        .await
        .unwrap();
    assert_eq!(ok.unwrap(), json!({"opened": true}));
    assert_eq!(
        err.unwrap_err(),
        "the client answered with an error: user said no"
    );
    assert!(late.unwrap_err().contains("no answer"));
    c.close_write();
    c.drain().await;
    assert_eq!(thread.join().unwrap(), EXIT_OK);
}

/// Bytes pushed through stdout in the throughput test.
const THROUGHPUT_BYTES: u64 = 512 * 1024 * 1024;

#[tokio::test]
async fn bulk_output_is_fast_and_complete() {
    let root = tempfile::tempdir().unwrap();
    let mut agent = start(config(root.path())).await;
    let c = &mut agent.client;
    let n = THROUGHPUT_BYTES.to_string();
    c.spawn(spec("bulk", "s", &["head", "-c", &n, "/dev/zero"]))
        .await
        .unwrap();
    // Count payload bytes straight off the socket, parsing only headers, so
    // the client is not what is measured.
    let t0 = Instant::now();
    let (mut got, mut frames) = (0u64, 0u64);
    let mut header = Vec::new();
    let mut sink = vec![0u8; proto::MAX_CHUNK];
    loop {
        let len = c.rd.read_u32().await.unwrap() as usize;
        let hlen = c.rd.read_u32().await.unwrap() as usize;
        header.resize(hlen, 0);
        c.rd.read_exact(&mut header).await.unwrap();
        let mut left = len - 4 - hlen;
        let msg: AgentMessage = serde_json::from_slice(&header).unwrap();
        while left > 0 {
            let k = left.min(sink.len());
            c.rd.read_exact(&mut sink[..k]).await.unwrap();
            left -= k;
        }
        match msg {
            AgentMessage::Stdout { .. } => {
                got += (len - 4 - hlen) as u64;
                frames += 1;
            }
            AgentMessage::Exit { exit_code, .. } => {
                assert_eq!(exit_code, Some(0));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(got, THROUGHPUT_BYTES);
    assert!(
        frames >= THROUGHPUT_BYTES / proto::MAX_CHUNK as u64,
        "chunks above MAX_CHUNK"
    );
    eprintln!(
        "bulk output: {} MiB in {secs:.2} s = {:.0} MiB/s ({frames} frames)",
        got >> 20,
        got as f64 / secs / 1048576.0
    );
    c.write_all_ping().await;
}

impl Client {
    /// A round trip proving the link still works after raw reads.
    async fn write_all_ping(&mut self) {
        let id = self.send(Op::Ping, &[]).await;
        assert!(self.response(id).await.is_ok());
        self.wr.as_mut().unwrap().flush().await.unwrap();
    }
}

/// A cgroup2 mount point where this process may create directories.
fn writable_cgroup2() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    for line in info.lines() {
        let (left, right) = line.split_once(" - ")?;
        if right.split(' ').next() == Some("cgroup2") {
            let mp = PathBuf::from(left.split(' ').nth(4)?);
            let probe = mp.join(format!("ga-probe-{}", std::process::id()));
            if std::fs::create_dir(&probe).is_ok() {
                let _ = std::fs::remove_dir(&probe);
                return Some(mp);
            }
        }
    }
    None
}

#[tokio::test]
async fn each_process_gets_its_own_cgroup() {
    let root = tempfile::tempdir().unwrap();
    let Some(mp) = writable_cgroup2() else {
        eprintln!("SKIPPED: no writable cgroup2 hierarchy on this machine");
        return;
    };
    let cg_root = mp.join(format!("ga-test-{}", std::process::id()));
    std::fs::create_dir(&cg_root).unwrap();
    let mut cfg = config(root.path());
    cfg.cgroup_root = Some(cg_root.clone());
    let mut agent = start(cfg).await;
    let out = agent
        .client
        .run(spec("cg", "s", &["cat", "/proc/self/cgroup"]))
        .await;
    let line = out
        .stdout()
        .lines()
        .find(|l| l.starts_with("0::"))
        .map(String::from)
        .unwrap();
    let leaf = format!("ga-test-{}/proc-", std::process::id());
    assert!(
        line.contains(&leaf),
        "process not in its own cgroup: {line}"
    );
    let memory =
        std::fs::read_to_string(cg_root.join("cgroup.subtree_control")).unwrap_or_default();
    if memory.contains("memory") {
        assert_eq!(out.oom_kill_count, Some(0));
    } else {
        assert_eq!(
            out.oom_kill_count, None,
            "no memory controller: no OOM count"
        );
    }
    agent.client.close_write();
    agent.client.drain().await;
    agent.join();
    // The per-process cgroup was removed after the exit.
    std::fs::remove_dir(&cg_root).expect("process cgroups were cleaned up");
}

/// This process's own directory in a cgroup v1 memory hierarchy where it
/// may create cgroups (a hybrid host, as root).
fn writable_v1_memory() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| {
        let mut p = l.splitn(3, ':');
        let (_, ctrls, path) = (p.next()?, p.next()?, p.next()?);
        ctrls
            .split(',')
            .any(|c| c == "memory")
            .then(|| path.to_string())
    })?;
    for line in info.lines() {
        let (left, right) = line.split_once(" - ")?;
        let mut r = right.split(' ');
        if r.next() == Some("cgroup")
            && r.nth(1)
                .is_some_and(|o| o.split(',').any(|c| c == "memory"))
        {
            let dir = PathBuf::from(left.split(' ').nth(4)?).join(path.trim_start_matches('/'));
            let probe = dir.join(format!("ga-probe-{}", std::process::id()));
            if std::fs::create_dir(&probe).is_ok() {
                let _ = std::fs::remove_dir(&probe);
                return Some(dir);
            }
        }
    }
    None
}

#[tokio::test]
async fn a_v1_memory_hierarchy_gives_each_process_a_cgroup_and_an_oom_count() {
    let root = tempfile::tempdir().unwrap();
    let Some(own) = writable_v1_memory() else {
        eprintln!("SKIPPED: no writable cgroup v1 memory hierarchy on this machine");
        return;
    };
    let cg_root = own.join(format!("ga-test-v1-{}", std::process::id()));
    std::fs::create_dir(&cg_root).unwrap();
    // Small enough for a quick OOM kill of the hog below.
    std::fs::write(
        cg_root.join("memory.limit_in_bytes"),
        (64u64 << 20).to_string(),
    )
    .unwrap();
    let mut cfg = config(root.path());
    cfg.cgroup_root = Some(cg_root.clone());
    let mut agent = start(cfg).await;
    let out = agent
        .client
        .run(spec("cg", "s", &["cat", "/proc/self/cgroup"]))
        .await;
    let line = out
        .stdout()
        .lines()
        .find(|l| {
            l.split(':')
                .nth(1)
                .is_some_and(|c| c.split(',').any(|c| c == "memory"))
        })
        .map(String::from)
        .unwrap();
    let leaf = format!("ga-test-v1-{}/proc-", std::process::id());
    assert!(
        line.contains(&leaf),
        "process not in its own cgroup: {line}"
    );
    assert_eq!(out.oom_kill_count, Some(0), "memory.oom_control is read");
    let hog = agent
        .client
        .run(spec(
            "hog",
            "s",
            &["perl", "-e", "my @a; while (1) { push @a, 'x' x 1048576 }"],
        ))
        .await;
    assert_eq!(hog.oom_kill_count, Some(1), "the OOM kill is counted");
    agent.client.close_write();
    agent.client.drain().await;
    agent.join();
    std::fs::remove_dir(&cg_root).expect("process cgroups were cleaned up");
}

// ---------------------------------------------------------------------------
// Tests inside user + mount (+ pid) namespaces.
// ---------------------------------------------------------------------------

/// Re-runs test `name` (path below the crate) under `unshare <flags>` with a
/// fresh scratch directory and returns `None` after checking it passed
/// ([`testns::in_namespaces`]); inside, returns that directory to run the
/// body in.
fn in_namespaces(name: &str, flags: &[&str]) -> Option<NsDir> {
    if let Some(dir) = testns::inside() {
        return Some(NsDir(dir));
    }
    let inside = testns::in_namespaces(name, flags);
    assert!(inside.is_none(), "the outer half runs no test body");
    None
}

/// The scratch directory of a test inside namespaces; its mounts are
/// detached when the test ends (the outer half removes the directory).
struct NsDir(PathBuf);

impl NsDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for NsDir {
    fn drop(&mut self) {
        let _ = crate::mounttable::unmount_below(&self.0);
    }
}

fn mount_count(target: &Path) -> usize {
    crate::mounttable::mounts_below(target)
        .unwrap()
        .iter()
        .filter(|p| p.as_path() == target)
        .count()
}

fn write_fails_with_erofs(path: &Path) {
    let err = std::fs::write(path, b"x").unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(libc::EROFS),
        "{}: {err}",
        path.display()
    );
}

#[tokio::test]
async fn ns_session_mounts_ro_rw_replace_and_refuse_symlinks() {
    let Some(t) = in_namespaces(
        "agent::tests::ns_session_mounts_ro_rw_replace_and_refuse_symlinks",
        &["-Urm"],
    ) else {
        return;
    };
    let r = t.path().join("sessions");
    let host = t.path().join("host");
    std::fs::create_dir_all(host.join("proj")).unwrap();
    std::fs::create_dir_all(host.join("skills")).unwrap();
    std::fs::create_dir_all(host.join("other")).unwrap();
    std::fs::create_dir_all(t.path().join("outside")).unwrap();
    std::fs::write(host.join("proj/a.txt"), b"project file").unwrap();
    std::fs::write(host.join("other/b.txt"), b"other file").unwrap();
    std::fs::write(host.join("notes.txt"), b"notes").unwrap();
    let mut agent = start(config(&r)).await;
    let c = &mut agent.client;
    let m = |name: &str, source: &Path, mode: MountMode| MountSpec {
        session: "s".into(),
        name: name.into(),
        source: source.display().to_string(),
        mode,
    };
    let mnt = r.join("s/mnt");

    c.request(Op::Mount(m("proj", &host.join("proj"), MountMode::Ro)), &[])
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(mnt.join("proj/a.txt")).unwrap(),
        b"project file"
    );
    write_fails_with_erofs(&mnt.join("proj/new.txt"));

    c.request(
        Op::Mount(m(".claude/skills", &host.join("skills"), MountMode::Rw)),
        &[],
    )
    .await
    .unwrap();
    std::fs::write(mnt.join(".claude/skills/s.md"), b"written").unwrap();
    assert_eq!(std::fs::read(host.join("skills/s.md")).unwrap(), b"written");

    c.request(
        Op::Mount(m("notes.txt", &host.join("notes.txt"), MountMode::Rwd)),
        &[],
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read(mnt.join("notes.txt")).unwrap(), b"notes");

    // Mounting again replaces: the old mount is gone, only one is stacked.
    c.request(
        Op::Mount(m("proj", &host.join("other"), MountMode::Rw)),
        &[],
    )
    .await
    .unwrap();
    assert!(!mnt.join("proj/a.txt").exists());
    assert_eq!(
        std::fs::read(mnt.join("proj/b.txt")).unwrap(),
        b"other file"
    );
    assert_eq!(mount_count(&mnt.join("proj")), 1);

    // A symlink planted in mnt/ does not redirect a mount.
    std::os::unix::fs::symlink(t.path().join("outside"), mnt.join("evil")).unwrap();
    let err = c
        .request(Op::Mount(m("evil", &host.join("proj"), MountMode::Rw)), &[])
        .await
        .unwrap_err();
    assert!(err.contains("symlink"), "{err}");
    let err = c
        .request(
            Op::Mount(m("evil/deeper", &host.join("proj"), MountMode::Rw)),
            &[],
        )
        .await
        .unwrap_err();
    assert!(err.contains("symlink"), "{err}");
    assert!(!sys::is_mount_point(&t.path().join("outside")).unwrap());
    assert!(std::fs::read_dir(t.path().join("outside"))
        .unwrap()
        .next()
        .is_none());

    let err = c
        .request(
            Op::Mount(m("gone", &host.join("missing"), MountMode::Ro)),
            &[],
        )
        .await
        .unwrap_err();
    assert!(
        err.contains("\"gone\"") && err.contains("does not exist"),
        "{err}"
    );

    // Spawn with mounts: the failed one is reported, the process sees the good one.
    let mut s = spec("reader", "s2", &["cat", "mnt/proj/a.txt"]);
    s.mounts = vec![
        MountSpec {
            session: "s2".into(),
            ..m("proj", &host.join("proj"), MountMode::Ro)
        },
        MountSpec {
            session: "s2".into(),
            ..m("broken", &host.join("nope"), MountMode::Ro)
        },
    ];
    let result = c.spawn(s).await.unwrap();
    assert_eq!(result, json!({"failedMounts": ["broken"]}));
    let out = c.wait_exit("reader").await;
    assert_eq!(out.stdout(), "project file");

    // The pre-5.2 code path (mount + read-only remount) gives the same result.
    let legacy = MountSpec {
        session: "s3".into(),
        ..m("old", &host.join("proj"), MountMode::Ro)
    };
    mounts::mount_session_with(&r, &legacy, true).unwrap();
    assert_eq!(
        std::fs::read(r.join("s3/mnt/old/a.txt")).unwrap(),
        b"project file"
    );
    write_fails_with_erofs(&r.join("s3/mnt/old/x"));
    let legacy_rw = MountSpec {
        session: "s3".into(),
        ..m("old", &host.join("skills"), MountMode::Rw)
    };
    mounts::mount_session_with(&r, &legacy_rw, true).unwrap();
    std::fs::write(r.join("s3/mnt/old/legacy.md"), b"ok").unwrap();
    assert_eq!(mount_count(&r.join("s3/mnt/old")), 1);

    // Deleting a session detaches its mounts and never touches their sources.
    let live = Default::default();
    let v = janitor::delete_session_dirs(&r, &["s".to_string(), "s3".to_string()], &live);
    assert_eq!(v["deleted"], json!(["s", "s3"]), "{v}");
    assert_eq!(
        std::fs::read(host.join("other/b.txt")).unwrap(),
        b"other file"
    );
    assert_eq!(std::fs::read(host.join("skills/s.md")).unwrap(), b"written");
    assert_eq!(std::fs::read(host.join("notes.txt")).unwrap(), b"notes");
}

#[tokio::test]
async fn ns_disk_info_does_not_count_mounted_folders() {
    let Some(t) = in_namespaces(
        "agent::tests::ns_disk_info_does_not_count_mounted_folders",
        &["-Urm"],
    ) else {
        return;
    };
    let r = t.path().join("sessions");
    let big = t.path().join("big");
    std::fs::create_dir_all(&big).unwrap();
    std::fs::write(big.join("blob"), vec![7u8; 4 * 1024 * 1024]).unwrap();
    let spec = MountSpec {
        session: "s".into(),
        name: "user".into(),
        source: big.display().to_string(),
        mode: MountMode::Rw,
    };
    mounts::mount_session(&r, &spec).unwrap();
    std::fs::write(r.join("s/own"), vec![1u8; 100_000]).unwrap();
    let info = janitor::disk_info(&r, 0).unwrap();
    let size = info["sessions"][0]["sizeBytes"].as_u64().unwrap();
    assert!(
        (100_000..1024 * 1024).contains(&size),
        "mounted folder counted: {size}"
    );
    // With the mount still there, deletion refuses rather than deleting through it.
    let v = janitor::delete_session_dirs(&r, &["s".to_string()], &Default::default());
    assert_eq!(v["deleted"], json!(["s"]), "mounts are detached first: {v}");
    assert_eq!(
        std::fs::metadata(big.join("blob")).unwrap().len(),
        4 * 1024 * 1024
    );
}

#[tokio::test]
async fn ns_install_sdk_is_read_only_and_idempotent() {
    let Some(t) = in_namespaces(
        "agent::tests::ns_install_sdk_is_read_only_and_idempotent",
        &["-Urm"],
    ) else {
        return;
    };
    let r = t.path().join("sessions");
    std::fs::create_dir_all(&r).unwrap();
    let v1 = t.path().join("sdk/1.0/claude");
    let v2 = t.path().join("sdk/2.0/claude");
    for (p, text) in [(&v1, "#!/bin/sh\necho v1\n"), (&v2, "#!/bin/sh\necho v2\n")] {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
        std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    let mut cfg = config(&r);
    cfg.sdk_target = t.path().join("usr/local/bin/claude");
    let target = cfg.sdk_target.clone();
    let mut agent = start(cfg).await;
    let c = &mut agent.client;
    let install = |src: &Path, version: &str| Op::InstallSdk {
        source: src.display().to_string(),
        version: version.into(),
    };
    let (v, _) = c.request(install(&v1, "1.0"), &[]).await.unwrap();
    assert_eq!(
        v,
        json!({"installed": target.display().to_string(), "version": "1.0"})
    );
    assert_eq!(
        std::fs::read_to_string(&target).unwrap(),
        "#!/bin/sh\necho v1\n"
    );
    write_fails_with_erofs(&target);
    let out = c
        .run(spec("run-sdk", "s", &[target.to_str().unwrap()]))
        .await;
    assert_eq!(out.stdout(), "v1\n");
    // Again: nothing changes, quickly.
    let t0 = Instant::now();
    c.request(install(&v1, "1.0"), &[]).await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(1));
    assert_eq!(mount_count(&target), 1);
    // A new version replaces the old bind instead of stacking on it.
    c.request(install(&v2, "2.0"), &[]).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(&target).unwrap(),
        "#!/bin/sh\necho v2\n"
    );
    assert_eq!(mount_count(&target), 1);
    let err = c
        .request(install(&t.path().join("sdk/9.9/claude"), "9.9"), &[])
        .await
        .unwrap_err();
    assert!(err.contains("does not exist"), "{err}");
    // The legacy path also yields a read-only bind.
    let target2 = t.path().join("opt/claude");
    assert!(mounts::install_sdk_with(&v1, &target2, true).unwrap());
    write_fails_with_erofs(&target2);
    assert!(!mounts::install_sdk_with(&v1, &target2, true).unwrap());
}

#[tokio::test]
async fn ns_private_paths_are_hidden_and_later_mounts_propagate() {
    let Some(t) = in_namespaces(
        "agent::tests::ns_private_paths_are_hidden_and_later_mounts_propagate",
        &["-Urm"],
    ) else {
        return;
    };
    let r = t.path().join("sessions");
    let private = t.path().join("private");
    std::fs::create_dir_all(&private).unwrap();
    let c_private = sys::cstring(&private).unwrap();
    sys::mount(Some(c"tmpfs"), &c_private, Some(c"tmpfs"), 0, None).unwrap();
    std::fs::write(private.join("secret"), b"host secret").unwrap();
    let late_src = t.path().join("late");
    std::fs::create_dir_all(&late_src).unwrap();
    std::fs::write(late_src.join("f"), b"propagated").unwrap();

    let mut cfg = config(&r);
    cfg.private_paths = vec![private.clone(), t.path().join("does-not-exist")];
    let mut agent = start(cfg).await;
    let c = &mut agent.client;
    let script = format!("cat {}/secret; echo rc=$?", private.display());
    let out = c.run(spec("peek", "s", &["sh", "-c", &script])).await;
    assert!(!out.stdout().contains("host secret"), "{}", out.stdout());
    assert!(out.stdout().contains("rc=1"), "{}", out.stdout());
    // The agent itself still sees it.
    assert_eq!(
        std::fs::read(private.join("secret")).unwrap(),
        b"host secret"
    );

    // A mount made while the process runs reaches its private namespace.
    let wait = "i=0; while [ ! -e mnt/late/f ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; cat mnt/late/f";
    c.spawn(spec("waiter", "s", &["sh", "-c", wait]))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let ms = MountSpec {
        session: "s".into(),
        name: "late".into(),
        source: late_src.display().to_string(),
        mode: MountMode::Ro,
    };
    c.request(Op::Mount(ms), &[]).await.unwrap();
    let out = c.wait_exit("waiter").await;
    assert_eq!(out.stdout(), "propagated");

    // Without private paths the same command sees the file (the check above is meaningful).
    let mut agent2 = start(config(&t.path().join("sessions2"))).await;
    let out = agent2
        .client
        .run(spec("peek2", "s", &["sh", "-c", &script]))
        .await;
    assert!(out.stdout().contains("host secret"));
}

fn cap_lines(status: &str) -> Vec<(String, u64)> {
    status
        .lines()
        .filter(|l| l.starts_with("Cap"))
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.to_string(), u64::from_str_radix(v.trim(), 16).unwrap())
        })
        .collect()
}

#[tokio::test]
async fn ns_drop_caps_leaves_nothing_to_regain() {
    let Some(t) = in_namespaces(
        "agent::tests::ns_drop_caps_leaves_nothing_to_regain",
        &["-Urm"],
    ) else {
        return;
    };
    // Control: root of the user namespace normally has capabilities.
    let mut plain = start(config(&t.path().join("a"))).await;
    let out = plain
        .client
        .run(spec("caps0", "s", &["cat", "/proc/self/status"]))
        .await;
    let caps = cap_lines(&out.stdout());
    assert!(
        caps.iter().any(|(k, v)| k == "CapEff" && *v != 0),
        "{caps:?}"
    );

    let mut cfg = config(&t.path().join("b"));
    cfg.drop_caps = true;
    let mut agent = start(cfg).await;
    // SAFETY: prctl query without arguments.
    assert_eq!(
        // SAFETY: PR_GET_DUMPABLE takes no pointer arguments.
        unsafe { libc::prctl(libc::PR_GET_DUMPABLE) },
        0,
        "agent must be non-dumpable"
    );
    // `sh` execs `cat` as uid 0: neither exec regains anything.
    let out = agent
        .client
        .run(spec("caps", "s", &["sh", "-c", "cat /proc/self/status"]))
        .await;
    let caps = cap_lines(&out.stdout());
    assert_eq!(caps.len(), 5, "{caps:?}");
    for (k, v) in &caps {
        assert_eq!(*v, 0, "{k} not empty: {caps:?}");
    }
    let uid_line = out
        .stdout()
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .map(String::from)
        .unwrap();
    assert!(
        uid_line.split_whitespace().nth(1) == Some("0"),
        "runs as uid 0: {uid_line}"
    );
}

#[tokio::test]
async fn ns_pid1_reaps_orphans_and_still_reports_exits() {
    let Some(t) = in_namespaces(
        "agent::tests::ns_pid1_reaps_orphans_and_still_reports_exits",
        &["-Urmpf", "--mount-proc"],
    ) else {
        return;
    };
    // SAFETY: getpid has no preconditions.
    assert_eq!(unsafe { libc::getpid() }, 1);
    let mut agent = start(config(&t.path().join("sessions"))).await;
    let c = &mut agent.client;
    assert!(c.hello.is_init);
    // Orphans that outlive their parent, some holding the pipes.
    let out = c
        .run(sh(
            "o1",
            "sleep 0.2 & sleep 0.3 & (sleep 0.4 </dev/null >/dev/null 2>&1 &); exit 4",
        ))
        .await;
    assert_eq!(out.exit_code, Some(4));
    for i in 0..5 {
        let out = c.run(sh(&format!("n{i}"), &format!("exit {i}"))).await;
        assert_eq!(out.exit_code, Some(i));
    }
    // Once the orphans ended, PID 1 (this process) left no zombies behind.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let zombies: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(|n| n.parse::<i32>().ok())
        .filter(|&pid| proc_state(pid) == Some('Z'))
        .map(|pid| pid.to_string())
        .collect();
    assert!(zombies.is_empty(), "zombies left: {zombies:?}");
}

#[tokio::test]
async fn ns_init_mounts_kernel_filesystems_once() {
    let Some(t) = in_namespaces(
        "agent::tests::ns_init_mounts_kernel_filesystems_once",
        &["-Urmpfn", "-C", "--mount-proc"],
    ) else {
        return;
    };
    use init::MountOutcome;
    let first = init::mount_early_filesystems(t.path());
    let mounted = |o: &MountOutcome, dir: &str| matches!(o, MountOutcome::Mounted(p) if p == &t.path().join(dir));
    assert!(mounted(&first[0], "proc"), "{first:?}");
    assert!(mounted(&first[1], "sys"), "{first:?}");
    assert!(mounted(&first[3], "sys/fs/cgroup"), "{first:?}");
    assert!(t.path().join("proc/self/stat").exists());
    assert!(t.path().join("sys/kernel").is_dir());
    assert!(t.path().join("sys/fs/cgroup/cgroup.controllers").exists());
    assert!(mounted(&first[4], "dev/pts"), "{first:?}");
    assert!(t.path().join("dev/pts/ptmx").exists());
    for (i, dir) in [(5, "dev/shm"), (6, "tmp"), (7, "run")] {
        assert!(mounted(&first[i], dir), "{first:?}");
    }
    let second = init::mount_early_filesystems(t.path());
    for i in [0, 1, 3, 4, 5, 6, 7] {
        assert!(
            matches!(second[i], MountOutcome::AlreadyMounted(_)),
            "{second:?}"
        );
    }
}
