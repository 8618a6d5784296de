//! The guest's console as both VM backends keep it: the bytes the guest
//! prints (QEMU's stdout and stderr, or COM1 of the in-process VM) split
//! into lines, each cleaned of control characters, logged at debug (one
//! event per line) and kept in a short tail that error messages quote.
//!
//! Limits: the tail holds [`CONSOLE_TAIL`] lines of at most
//! [`MAX_CONSOLE_LINE`] bytes (the rest of a longer line starts a new
//! line); an error quotes the last [`QUOTED_LINES`]. Escape sequences other
//! than CSI and two-byte escapes leave their printable rest in the line.

use std::collections::VecDeque;
use std::fmt;
use std::io::Write;
use std::sync::{Arc, Mutex};
use vmm::sync::MutexExt;

/// Console lines kept for error messages.
pub const CONSOLE_TAIL: usize = 40;
/// Console lines quoted in an error.
pub const QUOTED_LINES: usize = 15;
/// Longest console line kept; the rest of a longer one starts a new line.
pub const MAX_CONSOLE_LINE: usize = 1024;

/// The last console lines, shared by the readers and the error paths, and
/// the lines someone waits for ([`Console::watch`]).
#[derive(Clone, Default)]
pub(crate) struct Console {
    tail: Arc<Mutex<VecDeque<String>>>,
    watches: Arc<Mutex<Vec<Watch>>>,
}

/// A wait for the first line containing `text`.
struct Watch {
    text: &'static str,
    found: tokio::sync::oneshot::Sender<String>,
}

impl Console {
    /// The first line from now on that contains `text` (the guest prints
    /// it: a line says what the guest claims, nothing more).
    pub(crate) fn watch(&self, text: &'static str) -> tokio::sync::oneshot::Receiver<String> {
        let (found, line) = tokio::sync::oneshot::channel();
        self.watches.locked().push(Watch { text, found });
        line
    }

    pub(crate) fn push(&self, line: String) {
        {
            let mut w = self.watches.locked();
            if !w.is_empty() {
                let (hit, rest): (Vec<Watch>, Vec<Watch>) =
                    w.drain(..).partition(|x| line.contains(x.text));
                *w = rest;
                for x in hit {
                    let _ = x.found.send(line.clone());
                }
            }
        }
        let mut t = self.tail.locked();
        if t.len() == CONSOLE_TAIL {
            t.pop_front();
        }
        t.push_back(line);
    }

    /// Every kept line, oldest first.
    #[cfg(test)]
    pub(crate) fn lines(&self) -> Vec<String> {
        let t = self.tail.locked();
        t.iter().cloned().collect()
    }

    /// The last `n` lines, for an error message.
    pub(crate) fn quote(&self, n: usize) -> ConsoleQuote {
        let t = self.tail.locked();
        let skip = t.len().saturating_sub(n);
        ConsoleQuote {
            lines: t.iter().skip(skip).cloned().collect(),
        }
    }
}

/// The console's last lines as an error or a machine's end quotes them:
/// appended to the message it follows, each line indented on its own line
/// (the log escapes the line breaks, so a log line stays one line), or a
/// note that the console printed nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConsoleQuote {
    /// The quoted lines, oldest first, already cleaned
    /// ([`clean_console_line`]).
    pub lines: Vec<String>,
}

impl fmt::Display for ConsoleQuote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.lines.is_empty() {
            return f.write_str(" (the console printed nothing)");
        }
        f.write_str("; last console lines:")?;
        for l in &self.lines {
            write!(f, "\n  {l}")?;
        }
        Ok(())
    }
}

/// A console byte stream cut into lines: each line is cleaned
/// ([`clean_console_line`]), logged with its `source` and kept in the
/// [`Console`]. Written to like a file (the in-process VM's serial port
/// writes it from a vCPU thread, so it only buffers, logs and pushes); the
/// unfinished last line is emitted when it is dropped.
pub(crate) struct ConsoleLines {
    console: Console,
    source: &'static str,
    line: Vec<u8>,
}

impl ConsoleLines {
    pub(crate) fn new(console: Console, source: &'static str) -> ConsoleLines {
        ConsoleLines {
            console,
            source,
            line: Vec::new(),
        }
    }

    /// Splits `data` into the lines it ends or overfills.
    pub(crate) fn feed(&mut self, data: &[u8]) {
        for &b in data {
            if b == b'\n' {
                self.emit();
            } else {
                self.line.push(b);
                if self.line.len() >= MAX_CONSOLE_LINE {
                    self.emit();
                }
            }
        }
    }

    fn emit(&mut self) {
        let text = clean_console_line(&self.line);
        self.line.clear();
        if !text.is_empty() {
            tracing::debug!(source = self.source, line = %text, "guest console");
            self.console.push(text);
        }
    }
}

impl Write for ConsoleLines {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.feed(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for ConsoleLines {
    fn drop(&mut self) {
        self.emit();
    }
}

/// Removes control characters (ANSI escapes' printable rest is kept) and
/// trailing whitespace from one console line.
pub fn clean_console_line(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI sequences (ESC [ ... final byte) and two-byte escapes vanish whole.
            if chars.peek() == Some(&'[') {
                chars.next();
                for c2 in chars.by_ref() {
                    if ('\u{40}'..='\u{7e}').contains(&c2) {
                        break;
                    }
                }
            } else {
                chars.next();
            }
        } else if c == '\t' {
            out.push(' ');
        } else if !c.is_control() {
            out.push(c);
        }
    }
    out.trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_gets_the_first_matching_line_once() {
        let console = Console::default();
        let mut mark = console.watch("template point");
        let mut other = console.watch("never");
        let mut lines = ConsoleLines::new(console.clone(), "serial");
        lines.feed(b"booting\nagent: template point quiet_ms=3\nagent: template point again\n");
        assert_eq!(mark.try_recv().unwrap(), "agent: template point quiet_ms=3");
        assert!(other.try_recv().is_err());
        assert_eq!(console.watches.locked().len(), 1);
        assert_eq!(console.lines().len(), 3);
    }

    #[test]
    fn console_lines_are_cleaned() {
        assert_eq!(
            clean_console_line(b"\x1bc\x1b[?7l\x1b[2JSeaBIOS (version 1)\r"),
            "SeaBIOS (version 1)"
        );
        assert_eq!(clean_console_line(b"a\tb\x07c  "), "a bc");
        assert_eq!(clean_console_line(b"\xff\xfeok"), "\u{fffd}\u{fffd}ok");
        assert_eq!(clean_console_line(b"\x1b["), "");
    }

    #[test]
    fn console_sink_splits_cleans_and_bounds_lines() {
        let console = Console::default();
        let mut sink = ConsoleLines::new(console.clone(), "serial");
        for i in 0..60 {
            write!(sink, "line {i}\r\n").unwrap();
        }
        sink.write_all(b"\x1b[0mhalf ").unwrap();
        sink.write_all(b"a line\n").unwrap();
        sink.write_all(&vec![b'x'; MAX_CONSOLE_LINE + 3]).unwrap();
        sink.write_all(b"no newline").unwrap();
        drop(sink);
        let tail: Vec<String> = console.lines();
        assert_eq!(tail.len(), CONSOLE_TAIL);
        assert_eq!(tail[tail.len() - 1], "xxxno newline");
        assert_eq!(tail[tail.len() - 2], "x".repeat(MAX_CONSOLE_LINE));
        assert_eq!(tail[tail.len() - 3], "half a line");
        assert_eq!(tail[tail.len() - 4], "line 59");
        assert!(console.quote(1).to_string().ends_with("\n  xxxno newline"));
        assert!(Console::default()
            .quote(3)
            .to_string()
            .contains("printed nothing"));
    }
}
