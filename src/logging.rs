//! Logging: `tracing` to stderr, one line per event (the desktop client copies
//! our stderr into its log file). `COWORK_LOG` sets the initial filter;
//! `setDebugLogging` switches to debug and back at runtime through a reload
//! handle. Nothing here ever formats secrets: callers log names, never values.

use std::sync::OnceLock;

use tracing_subscriber::{fmt, prelude::*, reload, EnvFilter, Registry};

/// Filter used when `COWORK_LOG` is unset.
const DEFAULT_FILTER: &str = "info";

/// Filter installed by `setDebugLogging {enabled: true}`.
const DEBUG_FILTER: &str = "debug";

struct Handle {
    reload: reload::Handle<EnvFilter, Registry>,
    initial: String,
}

static HANDLE: OnceLock<Handle> = OnceLock::new();

/// Installs the global subscriber once; later calls are no-ops.
pub fn init() {
    if HANDLE.get().is_some() {
        return;
    }
    let initial = std::env::var("COWORK_LOG").unwrap_or_else(|_| DEFAULT_FILTER.to_string());
    let filter = EnvFilter::try_new(&initial).unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let (layer, reload) = reload::Layer::new(filter);
    let fmt = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false);
    if tracing_subscriber::registry()
        .with(layer)
        .with(fmt)
        .try_init()
        .is_ok()
    {
        let _ = HANDLE.set(Handle { reload, initial });
    }
}

/// Switches debug logging on or off (back to the initial filter).
pub fn set_debug(enabled: bool) -> Result<(), String> {
    let handle = HANDLE
        .get()
        .ok_or_else(|| "logging is not initialised".to_string())?;
    let spec = if enabled {
        DEBUG_FILTER
    } else {
        handle.initial.as_str()
    };
    let filter = EnvFilter::try_new(spec).map_err(|e| format!("bad log filter {spec:?}: {e}"))?;
    handle
        .reload
        .reload(filter)
        .map_err(|e| format!("cannot switch log level: {e}"))
}
