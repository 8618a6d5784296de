//! Log lines that stay lines: a `tracing_subscriber` writer ([`OneLine`])
//! that writes each event as exactly one line.
//!
//! The helper's standard error, and the sandbox agent's (which inherits
//! it), land in the desktop client's log file, one event per line. A
//! message or a field may hold a line break or a terminal escape: an OS
//! error, a guest's output quoted in an error, a name the client chose.
//! [`OneLine`] collects what the formatter writes for one event and writes
//! it out in one piece, every control character but the event's final
//! newline escaped as Rust writes it (`\n`, `\r`, `\t`, `\u{1b}`); the
//! Unicode line and paragraph separators are escaped too.
//!
//! Limits: it relies on the formatter asking for a writer per event, as
//! `tracing_subscriber::fmt` does; an event is held in memory until it is
//! written (the formatter builds it in memory anyway). A failed write is
//! dropped: there is nowhere left to report it (the reader went away).

use std::io::{self, Write};

use tracing_subscriber::fmt::MakeWriter;

/// Whether `c` would break a line or reach a terminal as a control
/// sequence: C0 and C1 controls, DEL, and the Unicode line and paragraph
/// separators.
fn needs_escape(c: char) -> bool {
    c.is_control() || c == '\u{2028}' || c == '\u{2029}'
}

/// One event's text as one line: its final newline dropped, every control
/// character and Unicode line or paragraph separator of the rest written
/// escaped, and one newline added.
pub fn one_line(event: &str) -> String {
    let body = event.strip_suffix('\n').unwrap_or(event);
    let mut line = String::with_capacity(body.len() + 1);
    for c in body.chars() {
        if needs_escape(c) {
            line.extend(c.escape_default());
        } else {
            line.push(c);
        }
    }
    line.push('\n');
    line
}

/// A [`MakeWriter`] whose writers hold one event each and write it to the
/// inner writer as [`one_line`] when dropped.
#[derive(Clone, Copy, Debug, Default)]
pub struct OneLine<M> {
    inner: M,
}

impl<M> OneLine<M> {
    /// Events made one line each, then written to `inner`'s writers.
    pub fn new(inner: M) -> Self {
        Self { inner }
    }
}

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for OneLine<M> {
    type Writer = EventWriter<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        EventWriter::new(self.inner.make_writer())
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        EventWriter::new(self.inner.make_writer_for(meta))
    }
}

/// One event being formatted; written to `out` as one line when dropped.
pub struct EventWriter<W: Write> {
    event: Vec<u8>,
    out: W,
}

impl<W: Write> EventWriter<W> {
    fn new(out: W) -> Self {
        Self {
            event: Vec::new(),
            out,
        }
    }
}

impl<W: Write> Write for EventWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.event.extend_from_slice(buf);
        Ok(buf.len())
    }

    /// Nothing: the event is written whole when the formatter is done.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<W: Write> Drop for EventWriter<W> {
    fn drop(&mut self) {
        if self.event.is_empty() {
            return;
        }
        let line = one_line(&String::from_utf8_lossy(&self.event));
        // A failed write has nowhere to be reported (see the module doc).
        let _ = self.out.write_all(line.as_bytes());
        let _ = self.out.flush();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A writer appending to a shared buffer, counting its writes.
    #[derive(Clone, Default)]
    struct Capture {
        bytes: Arc<Mutex<Vec<u8>>>,
        writes: Arc<Mutex<usize>>,
    }

    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.bytes.lock().unwrap().extend_from_slice(buf);
            *self.writes.lock().unwrap() += 1;
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn control_characters_are_escaped_and_one_newline_ends_the_line() {
        assert_eq!(one_line("plain\n"), "plain\n");
        assert_eq!(one_line("no newline"), "no newline\n");
        assert_eq!(
            one_line("a\nb\r\nc\td\u{1b}[31me\u{7f}\u{9b}f\u{2028}g\n"),
            "a\\nb\\r\\nc\\td\\u{1b}[31me\\u{7f}\\u{9b}f\\u{2028}g\n"
        );
        // Only the final newline is the event's own.
        assert_eq!(one_line("x\n\n"), "x\\n\n");
        // Printable text, quotes and backslashes and all, is left alone.
        assert_eq!(one_line("é \"q\" \\n ü\n"), "é \"q\" \\n ü\n");
    }

    #[test]
    fn an_event_with_line_breaks_in_its_message_and_fields_is_one_line() {
        let capture = Capture::default();
        let make = {
            let c = capture.clone();
            move || c.clone()
        };
        let subscriber = tracing_subscriber::fmt()
            .with_writer(OneLine::new(make))
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let guest_said = "line one\nline two\r\u{1b}[2J";
            tracing::warn!(error = %guest_said, "the guest\nsaid");
            tracing::info!("plain");
        });
        let text = String::from_utf8(capture.bytes.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text:?}");
        assert!(
            lines[0].contains("the guest\\nsaid")
                && lines[0].contains("error=line one\\nline two\\r\\u{1b}[2J"),
            "{text:?}"
        );
        assert!(lines[1].ends_with("plain"), "{text:?}");
        assert!(!text.contains('\u{1b}') && !text.contains('\r'), "{text:?}");
        // Each event reached the inner writer in one write.
        assert_eq!(*capture.writes.lock().unwrap(), 2);
    }
}
