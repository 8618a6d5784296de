//! Logging: `tracing` to stderr, one line per event (the desktop client copies
//! our stderr into its log file): no colours or other terminal escapes, and a
//! line break or control character in a message or field (an OS error, the
//! guest's words quoted in an error) is escaped rather than written, so no
//! event spans lines (see [`guest_agent::logline`]). The caller passes the
//! initial filter (the helper's `--log`, `COWORK_LOG`, read by
//! [`crate::cli`]); `setDebugLogging` switches to debug and back at runtime
//! through a reload handle. Nothing here ever formats secrets: callers log
//! names, never values.

use std::sync::OnceLock;

use guest_agent::logline::OneLine;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{fmt, prelude::*, reload, EnvFilter, Layer, Registry};

/// Filter used when none is given (`--log` and `COWORK_LOG` unset) or
/// the one given does not parse.
pub const DEFAULT_FILTER: &str = "info";

/// Filter installed by `setDebugLogging {enabled: true}`.
const DEBUG_FILTER: &str = "debug";

struct Handle {
    reload: reload::Handle<EnvFilter, Registry>,
    initial: String,
}

static HANDLE: OnceLock<Handle> = OnceLock::new();

/// Installs the global subscriber once, filtering with `filter` (`tracing`
/// syntax; [`DEFAULT_FILTER`] when `None` or when it does not parse); later
/// calls are no-ops.
pub fn init(filter: Option<&str>) {
    if HANDLE.get().is_some() {
        return;
    }
    let initial = filter.unwrap_or(DEFAULT_FILTER).to_string();
    let filter = EnvFilter::try_new(&initial).unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let (layer, reload) = reload::Layer::new(filter);
    if tracing_subscriber::registry()
        .with(layer)
        .with(line_layer(std::io::stderr))
        .try_init()
        .is_ok()
    {
        let _ = HANDLE.set(Handle { reload, initial });
    }
}

/// The formatting layer: one line per event written to `writer`'s writers,
/// without ANSI colours, control characters escaped.
fn line_layer<S, W>(writer: W) -> impl Layer<S>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    fmt::layer()
        .with_writer(OneLine::new(writer))
        .with_ansi(false)
        .with_target(false)
}

/// Why `setDebugLogging` could not switch the log level.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    #[error("logging is not initialised")]
    NotInitialised,
    #[error("bad log filter {spec:?}: {source}")]
    Filter {
        spec: String,
        source: tracing_subscriber::filter::ParseError,
    },
    #[error("cannot switch log level: {0}")]
    Reload(#[source] reload::Error),
}

/// Switches debug logging on or off (back to the initial filter).
pub fn set_debug(enabled: bool) -> Result<(), LoggingError> {
    let handle = HANDLE.get().ok_or(LoggingError::NotInitialised)?;
    let spec = if enabled {
        DEBUG_FILTER
    } else {
        handle.initial.as_str()
    };
    let filter = EnvFilter::try_new(spec).map_err(|source| LoggingError::Filter {
        spec: spec.to_string(),
        source,
    })?;
    handle.reload.reload(filter).map_err(LoggingError::Reload)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A writer appending to a shared buffer.
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn every_event_is_one_line_without_terminal_escapes() {
        let capture = Capture::default();
        let make = {
            let c = capture.clone();
            move || c.clone()
        };
        let subscriber = tracing_subscriber::registry().with(line_layer(make));
        tracing::subscriber::with_default(subscriber, || {
            // A multi-line OS error and guest output with a colour escape.
            let error = std::io::Error::other("first line\nsecond line\r\n");
            let console = "\u{1b}[31mpanic\u{1b}[0m\n  at guest";
            tracing::error!(error = %error, console, "vm boot failed:\n{console}");
            tracing::info!(socket = "/run/x.sock", "listening");
        });
        let text = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text:?}");
        assert!(text.ends_with('\n'), "{text:?}");
        assert!(
            !text.contains('\u{1b}') && !text.contains('\r'),
            "a terminal escape or carriage return reached the log: {text:?}"
        );
        assert!(
            lines[0].contains("ERROR")
                && lines[0].contains("vm boot failed:\\n")
                && lines[0].contains("[31mpanic")
                && lines[0].contains("error=first line\\nsecond line\\r\\n"),
            "{text:?}"
        );
        assert!(
            lines[1].contains("INFO") && lines[1].contains("listening socket=\"/run/x.sock\""),
            "{text:?}"
        );
    }
}
