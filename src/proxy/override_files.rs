//! Each rule's `overrides_file`: loaded before the proxy serves and before a reloaded
//! configuration runs, and watched on its own, so that a change to it applies without a
//! configuration reload and without touching any key's state; a file that does not read or
//! check leaves the last good set (logged, and counted in `spillway_overrides_reloads_total`).
//! Must never: read a file on a runtime worker, or stop watching because one load failed.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;

use super::Shared;
use crate::rules::RuleSet;

/// The files watched so far (one watcher each, until the proxy stops), and its stop signal.
#[derive(Default)]
pub(super) struct Watched(tokio::sync::Mutex<(HashSet<PathBuf>, Option<Stop>)>);

type Stop = tokio::sync::watch::Receiver<bool>;

impl Watched {
    /// Watchers started from now on end when `stop` turns true.
    pub(super) async fn until(&self, stop: Stop) {
        self.0.lock().await.1 = Some(stop);
    }
}

/// Loads every `overrides_file` of `rules` (or those at `path`) off the runtime's workers;
/// `Err` names each rule whose file did not load and that has no set from it in force (a
/// rule that has keeps it, and the failure is logged).
pub(super) async fn load(rules: Arc<RuleSet>, path: Option<PathBuf>) -> Result<(), String> {
    let results = tokio::task::spawn_blocking(move || rules.load_override_files(path.as_deref()))
        .await
        .map_err(|e| format!("overrides: the load did not finish: {e}"))?;
    let mut errors = Vec::new();
    for (rule, (result, kept)) in results {
        match result {
            Ok(Some(n)) => tracing::info!(rule = %rule, entries = n, "overrides loaded"),
            Ok(None) => {}
            Err(e) if kept => tracing::error!(
                rule = %rule,
                "overrides reload failed, the last good set stays: overrides_file {e}"
            ),
            Err(e) => errors.push(format!("rule {rule}: overrides_file {e}")),
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// Watches each `overrides_file` of the running rules not watched yet (none before
/// [`Watched::until`]).
pub(super) async fn watch_new(shared: &Arc<Shared>) {
    let mut guard = shared.override_files.0.lock().await;
    let (watched, stop) = &mut *guard;
    let Some(stop) = stop.as_ref() else { return };
    for (_, path) in shared.rules.load().override_files() {
        if watched.contains(&path) {
            continue;
        }
        let (s, p) = (shared.clone(), path.clone());
        let spawned = crate::watch::spawn(&path, stop.clone(), move |_| {
            let (shared, path) = (s.clone(), p.clone());
            async move {
                // The rules running now: a reload since shares the table of an unchanged rule.
                if let Err(e) = load(shared.rules.load_full(), Some(path)).await {
                    tracing::error!("overrides load failed, none of the file's are in force: {e}");
                }
            }
        });
        match spawned {
            Ok(_) => {
                watched.insert(path);
            }
            Err(e) => tracing::warn!(
                file = %path.display(),
                "cannot watch an overrides_file (SIGHUP or a config reload still loads it): {e}"
            ),
        }
    }
}
