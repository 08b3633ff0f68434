//! The process's log lines: the subscriber the command line installs (text or JSON on
//! stderr), and its filter, which the admin listener changes while the process runs
//! (`PUT /log-level`). Owns the one reload handle. Must never: be on a request's path (a
//! change swaps the filter; the fields a line carries are the callers').

// A lock taken only by the admin listener's change of the filter, never on a request's path.
#[allow(clippy::disallowed_types)]
use std::sync::Mutex;
use std::sync::OnceLock;

use tracing_subscriber::{reload, EnvFilter};

type Set = Box<dyn Fn(EnvFilter) -> Result<(), String> + Send + Sync>;

/// How the installed subscriber's filter is replaced, and the directives it holds now.
#[allow(clippy::disallowed_types)]
static FILTER: OnceLock<(Set, Mutex<String>)> = OnceLock::new();

/// Installs the process's subscriber on stderr: `json` lines or text (colour only on a
/// terminal), filtered by `RUST_LOG` or else `default`. Once per process.
#[allow(clippy::disallowed_types)]
pub fn init(json: bool, default: &str) {
    let spec = std::env::var("RUST_LOG")
        .ok()
        .filter(|s| EnvFilter::try_new(s).is_ok())
        .unwrap_or_else(|| default.to_string());
    let filter = EnvFilter::try_new(&spec).unwrap_or_else(|_| EnvFilter::new("info"));
    let set: Set = if json {
        let b = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_filter_reloading();
        let handle = b.reload_handle();
        b.init();
        Box::new(move |f| handle.reload(f).map_err(|e: reload::Error| e.to_string()))
    } else {
        let b = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            // Escape codes only where a terminal reads them: not in `kubectl logs` or a file.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter_reloading();
        let handle = b.reload_handle();
        b.init();
        Box::new(move |f| handle.reload(f).map_err(|e: reload::Error| e.to_string()))
    };
    let _ = FILTER.set((set, Mutex::new(spec)));
}

/// The filter's directives now (`RUST_LOG`'s syntax); `None` where [`init`] did not run
/// (a library user's own subscriber).
pub fn level() -> Option<String> {
    let (_, spec) = FILTER.get()?;
    Some(spec.lock().unwrap_or_else(|p| p.into_inner()).clone())
}

/// Replaces the filter with `spec` (`RUST_LOG`'s syntax: `debug`,
/// `info,spillway::rejection=off`); an error says why and changes nothing.
pub fn set_level(spec: &str) -> Result<(), String> {
    let (set, current) = FILTER
        .get()
        .ok_or("this process's log lines are not Spillway's to change")?;
    let spec = spec.trim();
    if spec.is_empty() || spec.len() > 1024 {
        return Err(
            "give directives as RUST_LOG takes them, e.g. debug or info,spillway=debug".into(),
        );
    }
    let filter = EnvFilter::try_new(spec).map_err(|e| format!("{spec:?}: {e}"))?;
    let mut current = current.lock().unwrap_or_else(|p| p.into_inner());
    // Said before the swap: a new filter of `off` would hide it.
    tracing::warn!(from = %*current, to = %spec, "the log filter is changed through the admin listener");
    if let Err(e) = set(filter) {
        tracing::error!(error = %e, "the log filter was not changed");
        return Err(e);
    }
    *current = spec.to_string();
    Ok(())
}
