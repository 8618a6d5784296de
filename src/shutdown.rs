//! What ends the daemon: SIGTERM, SIGINT, or the client going away.
//!
//! The desktop client starts the helper with its standard input a pipe
//! (Node's `stdio: "pipe"`, which libuv makes a unix socketpair) and tells
//! it nothing when it quits or crashes: its end of that pipe just closes.
//! So when standard input is a pipe or a socket, end-of-file on it (or a
//! read error such as `ECONNRESET`) means the client is gone, and the
//! helper shuts down as it does on SIGTERM. [`Shutdown::requested`]
//! resolves on the first of the three and says which ([`Trigger`]).
//!
//! Whatever the client writes to standard input is read and discarded. A
//! terminal, `/dev/null`, a regular file or anything else that is not a
//! pipe or a socket is never read: standard input then plays no part (a
//! helper started by hand or by a service manager runs until signalled).
//!
//! Limits: the watcher is a plain thread blocked in `read(2)` for the rest
//! of the process's life (it does not keep the process from exiting).
//! Only the serving command watches standard input; the hidden re-exec
//! entries (`__sandbox-init`, `__agent`) never come here.

use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::oneshot;

/// Bytes read from standard input at a time (and thrown away).
const DISCARD_CHUNK: usize = 4096;

/// Name of the thread that watches standard input.
const WATCHER_THREAD: &str = "stdin-watch";

/// Why the daemon shuts down.
#[derive(Debug)]
pub enum Trigger {
    /// SIGTERM or SIGINT (its name).
    Signal(&'static str),
    /// Standard input reached end-of-file.
    StdinClosed,
    /// Reading standard input failed (the client's end was reset).
    StdinFailed(io::Error),
}

impl std::fmt::Display for Trigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Trigger::Signal(name) => write!(f, "{name} received"),
            Trigger::StdinClosed => write!(f, "stdin closed: the client went away"),
            Trigger::StdinFailed(e) => {
                write!(f, "stdin read failed ({e}): the client went away")
            }
        }
    }
}

/// Errors of setting up the shutdown triggers.
#[derive(Debug, thiserror::Error)]
pub enum ShutdownError {
    #[error("cannot install the {signal} handler: {source}")]
    Signal {
        signal: &'static str,
        source: io::Error,
    },
}

/// What standard input is, as far as the shutdown is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// A pipe or a socket: its end-of-file means the client went away.
    PipeOrSocket,
    /// Anything else (a terminal, `/dev/null`, a file, nothing open): not
    /// read.
    Other,
}

/// What `fd` is (see [`InputKind`]).
pub fn input_kind(fd: BorrowedFd<'_>) -> InputKind {
    // SAFETY: an all-zero `stat` is a valid value for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on a borrowed (so open) descriptor with a valid
    // out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return InputKind::Other;
    }
    match st.st_mode & libc::S_IFMT {
        libc::S_IFIFO | libc::S_IFSOCK => InputKind::PipeOrSocket,
        _ => InputKind::Other,
    }
}

/// Reads `input` to its end, discarding what it reads; says how it ended.
pub fn drain(mut input: impl Read) -> Trigger {
    let mut chunk = [0u8; DISCARD_CHUNK];
    loop {
        match input.read(&mut chunk) {
            Ok(0) => return Trigger::StdinClosed,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Trigger::StdinFailed(e),
        }
    }
}

/// The armed triggers; [`Shutdown::requested`] waits for the first.
pub struct Shutdown {
    term: Signal,
    int: Signal,
    /// How standard input ended, when it is watched.
    stdin: Option<oneshot::Receiver<Trigger>>,
}

impl Shutdown {
    /// Installs the SIGTERM and SIGINT handlers and, when standard input
    /// is a pipe or a socket, starts draining it on a thread of its own.
    /// Must run inside the tokio runtime.
    pub fn arm() -> Result<Shutdown, ShutdownError> {
        let handler = |kind, name| {
            signal(kind).map_err(|source| ShutdownError::Signal {
                signal: name,
                source,
            })
        };
        let term = handler(SignalKind::terminate(), "SIGTERM")?;
        let int = handler(SignalKind::interrupt(), "SIGINT")?;
        Ok(Shutdown {
            term,
            int,
            stdin: watch_stdin(),
        })
    }

    /// Waits for the first trigger.
    pub async fn requested(mut self) -> Trigger {
        let stdin_ended = async {
            match self.stdin.take() {
                // A watcher that died without a word (it cannot) is no
                // reason to stop.
                Some(rx) => match rx.await {
                    Ok(trigger) => trigger,
                    Err(_) => std::future::pending().await,
                },
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = self.term.recv() => Trigger::Signal("SIGTERM"),
            _ = self.int.recv() => Trigger::Signal("SIGINT"),
            trigger = stdin_ended => trigger,
        }
    }
}

/// Starts the thread draining standard input when it is a pipe or a
/// socket; its receiver gets how the input ended.
fn watch_stdin() -> Option<oneshot::Receiver<Trigger>> {
    let stdin = io::stdin();
    if input_kind(stdin.as_fd()) != InputKind::PipeOrSocket {
        tracing::debug!("stdin is not a pipe or socket: not watched");
        return None;
    }
    let (tx, rx) = oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name(WATCHER_THREAD.into())
        .spawn(move || {
            let _ = tx.send(drain(stdin.lock()));
        });
    match spawned {
        Ok(_) => {
            tracing::debug!("watching stdin: its end means the client went away");
            Some(rx)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch stdin; the helper will not notice the client going away");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::Write;
    use std::os::fd::FromRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    /// A pipe's reading and writing ends.
    fn pipe() -> (File, File) {
        let mut fds = [0; 2];
        // SAFETY: pipe2 with a valid two-element array.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors were just created and are owned here.
        unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) }
    }

    #[test]
    fn pipes_and_sockets_are_watched_terminals_and_files_are_not() {
        let (r, _w) = pipe();
        assert_eq!(input_kind(r.as_fd()), InputKind::PipeOrSocket);
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(input_kind(a.as_fd()), InputKind::PipeOrSocket);
        let null = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(input_kind(null.as_fd()), InputKind::Other);
        let file = tempfile::tempfile().unwrap();
        assert_eq!(input_kind(file.as_fd()), InputKind::Other);
        // A pseudo-terminal's master side is a character device too.
        if let Ok(tty) = std::fs::File::open("/dev/ptmx") {
            assert_eq!(input_kind(tty.as_fd()), InputKind::Other);
        }
    }

    #[test]
    fn input_is_discarded_until_its_end() {
        let (r, mut w) = pipe();
        let writer = std::thread::spawn(move || {
            // More than a chunk and more than the pipe holds.
            for _ in 0..64 {
                w.write_all(&[b'x'; 4096]).unwrap();
            }
        });
        assert!(matches!(drain(r), Trigger::StdinClosed));
        writer.join().unwrap();
    }

    #[test]
    fn a_reset_socket_is_the_client_gone_too() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        // The peer closes with data it never read: our next read fails
        // with ECONNRESET.
        (&ours).write_all(b"unread").unwrap();
        drop(theirs);
        match drain(&ours) {
            Trigger::StdinFailed(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ECONNRESET), "{e}");
            }
            other => panic!("expected a read error, got {other:?}"),
        }
        assert!(
            Trigger::StdinFailed(io::Error::from_raw_os_error(libc::ECONNRESET))
                .to_string()
                .contains("the client went away")
        );
        assert_eq!(
            Trigger::StdinClosed.to_string(),
            "stdin closed: the client went away"
        );
        assert_eq!(Trigger::Signal("SIGINT").to_string(), "SIGINT received");
    }
}
