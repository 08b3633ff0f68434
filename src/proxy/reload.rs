//! Hot reload of the sidecar's configuration: parse and validate the whole file first, then
//! one snapshot swap; rules whose identity is unchanged keep their per-key state.
//!
//! Owns what a reload may change while running (the rules, `headers`, the `redis` section,
//! `log_rejections`, `admin_open`)
//! and what it reports as needing a restart (listeners, upstream, workers, timeouts, limits,
//! client_ip, the request hygiene fields, control_plane, service). Must never: change anything when the new file is bad,
//! or run two reloads at once.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use super::Shared;
use crate::config::{Config, ConfigError};
#[cfg(feature = "redis")]
use crate::exact::Exact;
use crate::rules::RuleSet;
use crate::watch::{version_of, Trigger};

/// The configuration now active.
#[derive(Debug, Clone, Serialize)]
pub struct Loaded {
    /// First 16 hex digits of the SHA-1 of the file's text.
    pub version: String,
    /// Unix time, seconds, of the load.
    pub loaded_at: f64,
    /// The file, when it came from one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<PathBuf>,
    /// Fields the last reload changed that only a restart applies.
    pub pending_restart: Vec<&'static str>,
}

impl Loaded {
    pub fn new(version: String, source: Option<PathBuf>) -> Self {
        Loaded {
            version,
            loaded_at: unix_now(),
            source,
            pending_restart: Vec::new(),
        }
    }
}

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    pub version: String,
    /// Rules that kept their per-key state.
    pub kept: Vec<String>,
    /// Rules that start empty (new, or changed in name, key, limit, scope, fallback or max_keys).
    pub fresh: Vec<String>,
    pub pending_restart: Vec<&'static str>,
}

/// Reloads `path` into `shared`. `Ok(None)`: a file event, but the content is what runs.
pub(super) async fn reload(
    shared: &Arc<Shared>,
    path: &Path,
    trigger: Trigger,
) -> Result<Option<Reloaded>, ConfigError> {
    let _one_at_a_time = shared.reload_lock.lock().await;
    let file = path.display().to_string();
    let text = tokio::fs::read_to_string(path)
        .await
        .map_err(|source| ConfigError::Read {
            file: file.clone(),
            source,
        })?;
    let version = version_of(&text);
    if trigger == Trigger::File && version == shared.loaded.load().version {
        return Ok(None);
    }
    // Parsed on a blocking thread: a large or deeply nested file never stalls the requests
    // this runtime serves.
    let parsed = {
        let file = file.clone();
        tokio::task::spawn_blocking(move || Config::from_yaml(&text, &file)).await
    };
    let new = match parsed {
        Ok(result) => result?,
        Err(e) => {
            return Err(ConfigError::Invalid {
                file,
                line: None,
                column: None,
                message: format!("the configuration could not be parsed: {e}"),
            })
        }
    };
    let mut new = new;
    let old = shared.config.load_full();
    // What the command line placed stays placed: the file's own values are not a change.
    old.placement.clone().apply(&mut new);
    let pending_restart = restart_fields(&old, &new);

    #[cfg(feature = "redis")]
    let exact = redis(shared, &old, &new, &file).await?;

    // What runs: the old settings, with the parts a reload may change taken from the new file.
    let mut active = (*old).clone();
    active.rules = new.rules;
    active.headers = new.headers;
    active.redis = new.redis;
    active.log_rejections = new.log_rejections;
    // Read at each admin request: what the new file opens (or shuts) applies now.
    active.admin_open = new.admin_open;
    // The new rules' overrides under what runs (client_ip and path_match are restart
    // fields): keys distinct under the new file's prefixes may be one under the running ones.
    active
        .check_override_keys()
        .map_err(|(_, message)| ConfigError::Invalid {
            file: file.clone(),
            line: None,
            column: None,
            message: format!("{message} (under the running client_ip and path_match)"),
        })?;
    let previous = shared.rules.load_full();
    // Built on a blocking thread: a rule's inline overrides may be many.
    let rules = {
        let (config, metrics) = (active.clone(), shared.metrics.clone());
        let (ratios, previous) = (shared.ratios.clone(), previous.clone());
        tokio::task::spawn_blocking(move || {
            RuleSet::rebuild(&config, &metrics, ratios, Some(&previous))
        })
        .await
        .map_err(|e| ConfigError::Invalid {
            file: file.clone(),
            line: None,
            column: None,
            message: format!("the rules could not be built: {e}"),
        })?
    };
    #[cfg(feature = "redis")]
    let rules = rules.with_store(crate::exact::store(&exact));
    // The overrides files of the new rules load before they run: a bad one fails the reload.
    let rules = Arc::new(rules);
    super::override_files::load(rules.clone(), None)
        .await
        .map_err(|message| ConfigError::Invalid {
            file: file.clone(),
            line: None,
            column: None,
            message,
        })?;
    let kept = rules.kept_from(&previous);
    let fresh = active
        .rules
        .iter()
        .map(|r| r.name.0.clone())
        .filter(|n| !kept.contains(n))
        .collect();
    shared.rules.store(rules);
    shared.metrics.show_limits(&active.rules);
    match active.redis.is_some() {
        true => {
            shared.metrics.redis_in_use();
        }
        // Gone: its last state would hold an alert (an open breaker) for ever.
        false => {
            shared.metrics.redis.connected.set(0);
            shared.metrics.redis.breaker_state.set(0);
        }
    }
    #[cfg(feature = "redis")]
    shared.exact.store(exact);
    shared.config.store(Arc::new(active));
    shared.loaded.store(Arc::new(Loaded {
        version: version.clone(),
        loaded_at: unix_now(),
        source: Some(path.to_path_buf()),
        pending_restart: pending_restart.clone(),
    }));
    shared.metrics.config_loaded_at.set(unix_now());
    super::override_files::watch_new(shared).await;
    Ok(Some(Reloaded {
        version,
        kept,
        fresh,
        pending_restart,
    }))
}

/// Reloads and accounts for it: the metric, and a log line that names file, line and field
/// on error. The old configuration keeps running on any error.
pub(super) async fn reload_and_log(shared: &Arc<Shared>, path: &Path, trigger: Trigger) {
    match reload(shared, path, trigger).await {
        // The content is what runs (a bad file put back as it was): that is a good state too.
        Ok(None) => shared.metrics.config_reload_ok.set(1),
        Ok(Some(r)) => {
            shared.metrics.reloaded(true);
            tracing::info!(
                version = %r.version,
                kept = ?r.kept,
                fresh = ?r.fresh,
                "configuration reloaded"
            );
            if !r.pending_restart.is_empty() {
                tracing::warn!(fields = ?r.pending_restart, "changed fields that only a restart applies; the running values stay");
            }
        }
        Err(e) => {
            shared.metrics.reloaded(false);
            tracing::error!("configuration reload failed, the previous configuration stays: {e}");
        }
    }
}

/// Top-level fields that differ between `old` and `new` and that a reload cannot apply.
fn restart_fields(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut out = Vec::new();
    let mut check = |name, differs: bool| {
        if differs {
            out.push(name);
        }
    };
    check("service", !same(&old.service, &new.service));
    check("listen", old.listen != new.listen);
    check("upstream", !same(&old.upstream, &new.upstream));
    check("admin", old.admin != new.admin);
    check("client_ip", !same(&old.client_ip, &new.client_ip));
    check("hosts", old.hosts != new.hosts);
    check(
        "trusted_headers",
        !same(&old.trusted_headers, &new.trusted_headers),
    );
    check(
        "key_secret_file",
        old.key_secret_file != new.key_secret_file,
    );
    check("normalize_path", old.normalize_path != new.normalize_path);
    check("path_escapes", old.path_escapes != new.path_escapes);
    check("path_match", old.path_match != new.path_match);
    check("bodies_on_get", old.bodies_on_get != new.bodies_on_get);
    check("upgrades", old.upgrades != new.upgrades);
    check("timeouts", !same(&old.timeouts, &new.timeouts));
    check("limits", !same(&old.limits, &new.limits));
    check("workers", old.workers != new.workers);
    check("request_id", old.request_id != new.request_id);
    check("access_log", old.access_log != new.access_log);
    check(
        "control_plane",
        !same(&old.control_plane, &new.control_plane),
    );
    out
}

/// Equal as configured (`Debug` shows every field, passwords included, and is never logged).
fn same<T: std::fmt::Debug>(a: &T, b: &T) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Redis for the new config: the same section keeps its connection; a changed one gets a new
/// client, connected before the swap (at most a second), so the new rules find it ready.
#[cfg(feature = "redis")]
async fn redis(
    shared: &Shared,
    old: &Config,
    new: &Config,
    file: &str,
) -> Result<Option<Arc<Exact>>, ConfigError> {
    if same(&old.redis, &new.redis) {
        return Ok(shared.exact.load_full());
    }
    let Some(redis) = &new.redis else {
        return Ok(None);
    };
    let exact = Exact::new(
        redis,
        &old.service.0,
        shared.rules.load().secret(),
        shared.metrics.redis.clone(),
        shared.clock.clone(),
    )
    .map_err(|message| ConfigError::Invalid {
        file: file.to_string(),
        line: None,
        column: None,
        message,
    })?;
    exact.start().await;
    Ok(Some(exact))
}
