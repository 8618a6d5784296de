//! The fake agent: a guest agent that misbehaves on command, for the
//! guest-hostility tests (`tests/guest_hostility.rs`, `tests/limits.rs`,
//! `tests/client_lifecycle.rs`). Test code only, in no binary of the
//! product: the helper runs it only when its environment names it
//! (`COWORK_TEST_SANDBOX_AGENT_WRAPPER`, see `cowork_helper::backend::sandbox`).
//!
//! The suite's own test binary is the fake agent. [`wrapper`] writes a
//! script next to it, named in that variable, which re-runs the binary as
//! the suite's ignored test `fake_agent` (declared with [`fake_agent_test`])
//! with [`FAKE_AGENT_ENV`] set and the real agent's command line after
//! `--`; that test runs [`run_if_asked`], which is the agent. Its libtest
//! output goes to `/dev/null` (the sandbox's stdout is the helper's log).
//!
//! Under the sandbox backend's agent-wrapper hook it is PID 1 of the
//! sandbox, given the real agent's command line as its arguments. When the
//! profile's session directory (`/sessions` inside) holds no [`MARKER`]
//! file it `exec`s the real agent at once, so the same helper can run real
//! and fake profiles side by side. Otherwise it speaks the agent link
//! itself on fd 3 (the sandbox's agent socket), with the protocol library
//! the real agent uses: a hello, then answers to every request, except
//! that a `spawn` whose command is one of the directives below makes it
//! misbehave (the spawn itself is answered first, so the host knows the
//! process id; directives act on that id).
//!
//! | command | what the fake agent does |
//! |---|---|
//! | `run` | nothing: the process "runs" until killed |
//! | `echo TEXT` | stdout `TEXT`, then exit 0 |
//! | `oversized-frame` | a frame announcing more than `MAX_MESSAGE` bytes |
//! | `truncated-frame` | half a frame, then closes its side of the link |
//! | `stalled-frame` | half a frame, then nothing more at all (link stays open) |
//! | `bad-json` | a message whose header is not JSON |
//! | `wrong-types` | a `stdout` message whose `id` is a number |
//! | `bad-header-length` | a header length past the end of the frame |
//! | `second-hello` | another hello |
//! | `flood-unknown N` | N stdout, N/8 exit and N/8 error messages for process ids the host never spawned, then `done` on the spawned id's stdout |
//! | `flood-stdout N` | N one-byte stdout messages (`0`..`9` cycling) for the spawned id, then exit 0 |
//! | `flood-requests N` | N guest requests, then `done` on stdout |
//! | `wrong-ids` | from now on answers every request with an id nobody asked for |
//! | `never-answer` | from now on answers nothing (not even shutdown) |
//! | `stop-reading` | stops reading the link (the host's writes back up) |
//! | `exit CODE` | the agent exits with CODE (PID 1 of the sandbox dies) |
//! | `crash` | the agent faults on a protected page (a real SIGSEGV) |
//!
//! `kill` of a process answers and reports its exit (SIGKILL); `shutdown`
//! answers and exits 0 (neither does anything after `never-answer`); every other request is answered with `{}`.

use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use guest_agent::framing::PREFIX_LEN;
use guest_agent::proto::{self, AgentMessage, Hello, HostMessage, Op};
use serde_json::{json, Value};

/// File in the profile's session directory that turns the fake agent on
/// (without it, the real agent runs).
const MARKER: &str = "/sessions/.cowork-fake-agent";

/// Set (to `1`) by the [`wrapper`] script only: the suite's `fake_agent`
/// test is the agent then, and does nothing otherwise.
pub const FAKE_AGENT_ENV: &str = "COWORK_FAKE_AGENT";

/// Declares the suite's `fake_agent` test, which the [`wrapper`] script
/// runs as the sandbox's PID 1 (an ignored test: a plain `cargo test`
/// skips it, and without [`FAKE_AGENT_ENV`] it does nothing).
#[allow(unused_macros)] // Used by the three suites that run the fake agent.
macro_rules! fake_agent_test {
    () => {
        #[test]
        #[ignore = "the fake agent: run by the sandbox through support::fake_agent::wrapper"]
        fn fake_agent() {
            support::fake_agent::run_if_asked();
        }
    };
}
#[allow(unused_imports)]
pub(crate) use fake_agent_test;

/// The program to name in `COWORK_TEST_SANDBOX_AGENT_WRAPPER`: a script
/// next to this test binary (written once per process) that runs the
/// binary's `fake_agent` test as the agent.
pub fn wrapper() -> &'static str {
    static WRAPPER: OnceLock<String> = OnceLock::new();
    WRAPPER.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary");
        // The sandbox sees the host's `/` under HOST_ROOT.
        let inside = format!(
            "{}{}",
            cowork_helper::backend::sandbox::HOST_ROOT,
            exe.to_str().expect("a UTF-8 path of the test binary")
        );
        let script = format!(
            "#!/bin/sh\n\
             # The fake agent of tests/support/fake_agent.rs: this test binary's\n\
             # ignored test fake_agent, the agent's command line after --.\n\
             {FAKE_AGENT_ENV}=1 exec '{}' --exact fake_agent --ignored --nocapture \
             --test-threads=1 -q -- \"$@\" >/dev/null\n",
            inside.replace('\'', r"'\''")
        );
        let mut path = exe.into_os_string();
        path.push(".fake-agent");
        let path = PathBuf::from(path);
        // Written aside and renamed: other processes of this binary may be
        // running the script.
        let mut tmp = path.clone().into_os_string();
        tmp.push(format!(".{}", std::process::id()));
        {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o755)
                .open(&tmp)
                .expect("write the fake agent's script");
            f.write_all(script.as_bytes())
                .expect("write the fake agent's script");
        }
        std::fs::rename(&tmp, &path).expect("put the fake agent's script in place");
        path.into_os_string()
            .into_string()
            .expect("a UTF-8 path of the test binary")
    })
}

/// A log line the fake agent's hello tries to smuggle into the helper's
/// log (`tests/guest_hostility.rs` checks it never starts a line).
const FORGED_LOG_LINE: &str = "1999-01-01T00:00:00.000000Z  INFO forged by the guest";

/// Descriptor of the agent link in the sandbox.
const AGENT_FD: i32 = 3;

/// Body length announced by `oversized-frame`: one byte over the link's cap.
const OVERSIZED: usize = proto::MAX_MESSAGE + 1;

/// Body length announced by the half frames (`truncated-frame`,
/// `stalled-frame`), of which only [`HALF_FRAME_SENT`] bytes are sent.
const HALF_FRAME_LEN: u32 = 1000;

/// Bytes of the half frames actually sent.
const HALF_FRAME_SENT: usize = 10;

/// How long a silent fake agent sleeps between checks that it should go on
/// (it never ends by itself; the host kills the sandbox).
const IDLE: Duration = Duration::from_secs(3600);

/// How the fake agent answers requests.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Answers {
    Right,
    WrongIds,
    None,
}

struct Agent {
    link: UnixStream,
    answers: Answers,
}

/// The fake agent, when this process was started by the [`wrapper`]
/// script (it then never returns); nothing otherwise.
pub fn run_if_asked() {
    if std::env::var(FAKE_AGENT_ENV).as_deref() != Ok("1") {
        return;
    }
    // The agent's command line: what the script passed after `--`.
    let args: Vec<String> = std::env::args().skip_while(|a| a != "--").skip(1).collect();
    if !std::path::Path::new(MARKER).exists() {
        exec_real_agent(&args);
    }
    // SAFETY: the sandbox hands the agent link to PID 1 as fd 3; nothing
    // else in this process owns it.
    let link = unsafe { UnixStream::from_raw_fd(AGENT_FD) };
    let mut agent = Agent {
        link,
        answers: Answers::Right,
    };
    // Its version tries to forge a helper log line (the helper must log
    // guest words escaped).
    let hello = AgentMessage::Hello(Hello {
        protocol: proto::PROTOCOL_VERSION,
        version: format!("fake\n{FORGED_LOG_LINE}"),
        kernel: "fake".into(),
        ..Hello::default()
    });
    agent.send(&hello, &[]);
    let mut buf = Vec::new();
    loop {
        if !read_frame(&mut agent.link, &mut buf) {
            std::process::exit(0);
        }
        let Ok(env) = proto::decode::<HostMessage>(std::mem::take(&mut buf)) else {
            eprintln!("fake agent: undecodable host message");
            std::process::exit(2);
        };
        if let HostMessage::Request { id, op } = env.header {
            agent.request(id, op);
        }
    }
}

/// Replaces this process with the real agent (`args` is its command line).
fn exec_real_agent(args: &[String]) -> ! {
    use std::os::unix::process::CommandExt;
    let Some((program, rest)) = args.split_first() else {
        eprintln!("fake agent: no marker and no agent command line");
        std::process::exit(2);
    };
    let err = std::process::Command::new(program)
        .args(rest)
        .env_remove(FAKE_AGENT_ENV)
        .exec();
    eprintln!("fake agent: exec {program}: {err}");
    std::process::exit(2);
}

/// Reads one frame body into `buf`; `false` at end of stream or on error.
fn read_frame(r: &mut UnixStream, buf: &mut Vec<u8>) -> bool {
    let mut prefix = [0u8; PREFIX_LEN];
    if r.read_exact(&mut prefix).is_err() {
        return false;
    }
    let len = u32::from_be_bytes(prefix) as usize;
    if len > proto::MAX_MESSAGE {
        return false;
    }
    buf.resize(len, 0);
    r.read_exact(buf).is_ok()
}

impl Agent {
    fn send(&mut self, msg: &AgentMessage, payload: &[u8]) {
        let mut frame = Vec::new();
        proto::encode_frame_into(&mut frame, msg, payload);
        self.raw(&frame);
    }

    /// Writes bytes as they are; a broken link ends the fake agent.
    fn raw(&mut self, bytes: &[u8]) {
        if self.link.write_all(bytes).is_err() {
            std::process::exit(0);
        }
    }

    fn answer(&mut self, id: u64, result: Value) {
        let id = match self.answers {
            Answers::Right => id,
            Answers::WrongIds => id + (1 << 40),
            Answers::None => return,
        };
        self.send(
            &AgentMessage::Response {
                id,
                error: None,
                result,
            },
            &[],
        );
    }

    fn stdout(&mut self, id: &str, text: &[u8]) {
        self.send(&AgentMessage::Stdout { id: id.into() }, text);
    }

    fn exit(&mut self, id: &str, code: Option<i32>, signal: Option<&str>) {
        self.send(
            &AgentMessage::Exit {
                id: id.into(),
                exit_code: code,
                signal: signal.map(str::to_string),
                oom_kill_count: None,
            },
            &[],
        );
    }

    fn request(&mut self, id: u64, op: Op) {
        match op {
            Op::Spawn(spec) => {
                self.answer(id, json!({"failedMounts": []}));
                self.directive(&spec.id, &spec.command, &spec.args);
            }
            Op::Kill { id: pid, .. } => {
                // A mute agent does nothing at all.
                if self.answers != Answers::None {
                    self.answer(id, json!({}));
                    self.exit(&pid, None, Some("SIGKILL"));
                }
            }
            Op::Shutdown => {
                if self.answers == Answers::None {
                    return;
                }
                self.answer(id, json!({}));
                std::process::exit(0);
            }
            _ => self.answer(id, json!({})),
        }
    }

    fn directive(&mut self, pid: &str, command: &str, args: &[String]) {
        let n = args
            .first()
            .and_then(|a| a.parse::<usize>().ok())
            .unwrap_or(0);
        match command {
            "run" => {}
            "echo" => {
                let text = args.join(" ");
                self.stdout(pid, text.as_bytes());
                self.exit(pid, Some(0), None);
            }
            "oversized-frame" => {
                self.raw(&(OVERSIZED as u32).to_be_bytes());
                self.raw(&[b'x'; 64]);
            }
            "truncated-frame" => {
                self.half_frame();
                let _ = self.link.shutdown(std::net::Shutdown::Write);
            }
            "stalled-frame" => {
                // Nothing more goes out: the link stays inside this frame.
                self.half_frame();
                self.answers = Answers::None;
            }
            "bad-json" => self.body_with_header(b"{this is not json"),
            "wrong-types" => {
                let header = json!({"type": "stdout", "id": 5});
                self.body_with_header(header.to_string().as_bytes());
            }
            "bad-header-length" => {
                let mut body = Vec::new();
                body.extend_from_slice(&1_000_000u32.to_be_bytes());
                body.extend_from_slice(b"{}");
                let mut frame = Vec::new();
                guest_agent::framing::encode_frame_into(&mut frame, &body);
                self.raw(&frame);
            }
            "second-hello" => {
                let hello = AgentMessage::Hello(Hello {
                    protocol: proto::PROTOCOL_VERSION,
                    ..Hello::default()
                });
                self.send(&hello, &[]);
            }
            "flood-unknown" => {
                let mut batch = Vec::new();
                for i in 0..n {
                    let ghost = format!("ghost-{i}");
                    let msg = AgentMessage::Stdout { id: ghost.clone() };
                    proto::encode_frame_into(&mut batch, &msg, b"boo\n");
                    if i % 8 == 0 {
                        let exit = AgentMessage::Exit {
                            id: ghost.clone(),
                            exit_code: Some(0),
                            signal: None,
                            oom_kill_count: None,
                        };
                        proto::encode_frame_into(&mut batch, &exit, &[]);
                        let err = AgentMessage::Error {
                            id: ghost,
                            message: "made up".into(),
                            fatal: true,
                        };
                        proto::encode_frame_into(&mut batch, &err, &[]);
                    }
                    if batch.len() > 1 << 20 {
                        self.raw(&std::mem::take(&mut batch));
                    }
                }
                self.raw(&batch);
                self.stdout(pid, b"done");
            }
            "flood-stdout" => {
                let mut batch = Vec::new();
                for i in 0..n {
                    let digit = [b'0' + (i % 10) as u8];
                    let msg = AgentMessage::Stdout { id: pid.into() };
                    proto::encode_frame_into(&mut batch, &msg, &digit);
                    if batch.len() > 1 << 20 {
                        self.raw(&std::mem::take(&mut batch));
                    }
                }
                self.raw(&batch);
                self.exit(pid, Some(0), None);
            }
            "flood-requests" => {
                let mut batch = Vec::new();
                for i in 0..n {
                    let msg = AgentMessage::Request {
                        id: format!("guest-{i}"),
                        method: "fake/flood".into(),
                        params: json!({"i": i}),
                    };
                    proto::encode_frame_into(&mut batch, &msg, &[]);
                    if batch.len() > 1 << 20 {
                        self.raw(&std::mem::take(&mut batch));
                    }
                }
                self.raw(&batch);
                self.stdout(pid, b"done");
            }
            "wrong-ids" => self.answers = Answers::WrongIds,
            "never-answer" => self.answers = Answers::None,
            "stop-reading" => loop {
                std::thread::sleep(IDLE);
            },
            "exit" => std::process::exit(i32::try_from(n).unwrap_or(1)),
            "crash" => crash(),
            other => {
                self.stdout(pid, format!("unknown directive {other}").as_bytes());
                self.exit(pid, Some(127), None);
            }
        }
    }

    /// A frame announcing [`HALF_FRAME_LEN`] bytes of which only
    /// [`HALF_FRAME_SENT`] follow.
    fn half_frame(&mut self) {
        self.raw(&HALF_FRAME_LEN.to_be_bytes());
        self.raw(&[b'{'; HALF_FRAME_SENT]);
    }

    /// A well-framed message body whose header is `header` (unchecked).
    fn body_with_header(&mut self, header: &[u8]) {
        let mut body = Vec::new();
        body.extend_from_slice(&(header.len() as u32).to_be_bytes());
        body.extend_from_slice(header);
        let mut frame = Vec::new();
        guest_agent::framing::encode_frame_into(&mut frame, &body);
        self.raw(&frame);
    }
}

/// Dies the way a buggy agent would: a store to a page mapped without any
/// access, which the kernel answers with SIGSEGV (forced, so even a PID 1
/// dies of it).
fn crash() -> ! {
    // SAFETY: maps one fresh anonymous page with no access rights; the
    // store below faults by design and never returns.
    unsafe {
        let page = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if page == libc::MAP_FAILED {
            std::process::abort();
        }
        std::ptr::write_volatile(page.cast::<u8>(), 1);
    }
    std::process::abort();
}
