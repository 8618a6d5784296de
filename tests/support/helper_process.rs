//! The helper process under test, the pieces every harness that starts one
//! shares: which binary ([`built_helper`]), its stdout and stderr captured
//! in memory ([`CapturedLog`]), waiting until its socket answers
//! ([`wait_listening`]), ending it with SIGTERM and then SIGKILL
//! ([`terminate`], [`stop_child`]) and its log on stderr when a test fails
//! ([`print_log_if_failing`]).
//!
//! The harnesses built on them: [`super::daemon`] (the sandbox protocol
//! suites: many helpers at once, logs in memory), [`super::vm_helper`] (the
//! VM suites: one helper, its log in a file) and `tests/client_lifecycle.rs`
//! (the helper started exactly as the client starts it).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How often the waits below look again.
const POLL: Duration = Duration::from_millis(5);

/// The helper binary cargo built for the test.
pub fn built_helper() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cowork-helper"))
}

/// A child's output streams, captured line by line into one text as they
/// come (invalid UTF-8 replaced), with a way to wait until every captured
/// stream is closed.
#[derive(Default)]
pub struct CapturedLog {
    text: Mutex<String>,
    /// Streams still open.
    open: Mutex<usize>,
    closed: Condvar,
}

impl CapturedLog {
    /// An empty log capturing nothing yet.
    pub fn new() -> Arc<CapturedLog> {
        Arc::new(CapturedLog::default())
    }

    /// Appends everything `stream` yields to the log, from a thread of its
    /// own, until it ends.
    pub fn capture(self: &Arc<Self>, stream: impl Read + Send + 'static) {
        *self.open.lock().unwrap() += 1;
        let log = self.clone();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stream);
            let mut line = Vec::new();
            while let Ok(n) = r.read_until(b'\n', &mut line) {
                if n == 0 {
                    break;
                }
                log.text
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&line));
                line.clear();
            }
            let mut open = log.open.lock().unwrap();
            *open -= 1;
            if *open == 0 {
                log.closed.notify_all();
            }
        });
    }

    /// Everything captured so far.
    pub fn text(&self) -> String {
        self.text.lock().unwrap().clone()
    }

    /// Waits (at most `timeout`) until every captured stream is closed (the
    /// child exited and nothing else holds them), so [`CapturedLog::text`]
    /// is complete; whether they are.
    pub fn wait_closed(&self, timeout: Duration) -> bool {
        let open = self.open.lock().unwrap();
        let (open, _) = self
            .closed
            .wait_timeout_while(open, timeout, |open| *open > 0)
            .unwrap();
        *open == 0
    }
}

/// Polls until `socket` accepts a connection; after `limit` panics with
/// the helper's `log`.
pub fn wait_listening(socket: &Path, limit: Duration, log: impl Fn() -> String) {
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        assert!(
            t0.elapsed() < limit,
            "the helper did not listen on {} within {limit:?}; log:\n{}",
            socket.display(),
            log()
        );
        std::thread::sleep(POLL);
    }
}

/// Ends process `pid`: SIGTERM, then up to `limit` for `exited` to say it
/// is gone, then SIGKILL.
pub fn terminate(pid: u32, limit: Duration, mut exited: impl FnMut() -> bool) {
    // SAFETY: kill takes no pointers; the pid is a child of this process
    // that was not reaped yet.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if exited() {
            return;
        }
        std::thread::sleep(POLL);
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
}

/// [`terminate`] for a child still running, then its exit status.
pub fn stop_child(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    if let Ok(None) = child.try_wait() {
        let pid = child.id();
        terminate(pid, limit, || matches!(child.try_wait(), Ok(Some(_))));
    }
    child.wait().ok()
}

/// When the current test is failing (panicking), prints the helper's `log`
/// to stderr: all of it, or its last `tail` lines.
pub fn print_log_if_failing(log: &str, tail: Option<usize>) {
    if !std::thread::panicking() {
        return;
    }
    match tail {
        None => eprintln!("---- helper log ----\n{log}\n---- end ----"),
        Some(n) => {
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "---- helper log (last {n} of {} lines) ----\n{}",
                lines.len(),
                lines[lines.len().saturating_sub(n)..].join("\n")
            );
        }
    }
}
