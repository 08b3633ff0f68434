//! The sidecar's data plane: accept, decide, forward, stream back; drain on shutdown.
//!
//! Owns the client listener (shared by the worker threads, each with its own current-thread runtime
//! and upstream connections, so a request never hops threads once accepted), the client connections
//! (HTTP/1 served by our own code, `http1`; HTTP/2 with prior knowledge by hyper's server on the
//! same port, `http2`), the request path, and the shutdown sequence. Must never: hold a snapshot
//! guard or any lock across an `.await`, buffer a body (beyond a small one already read with its
//! head), log per request above debug.
//!
//! Layers, each importing only those below it (`tests/modules.rs` fails on an import against
//! them): this file starts a proxy ([`Sidecar`]: binds, builds the [`Shared`] state of
//! `shared`, hands both to `worker`, whose threads each derive their connections' settings
//! once and run their accept loops, timers and drain; `settings` derives each consumer's slice
//! of the configuration); `connection` owns a client connection from accept to end and tells
//! which protocol it speaks; the protocol servers
//! (`http1`'s server side, `http2`) are handed the request path as a `protocol::Handler` and
//! import neither it nor each other; the request path (`request`: hygiene, decision,
//! refusals) calls the forward (`forward`, `forwarded`, `upstream_pool` and `http1`'s client side);
//! every layer may use `response` (the sidecar's response: one head type, its body), `body` and
//! `deadlines`.
//!
//! Cost of the request path beyond the server side's own work (`http1`'s, or hyper's): one pass
//! over the request's fields (`Hygiene`: head size, `Host`, client claims) and one over its path
//! (already canonical: no allocation), the client address by policy, one `ArcSwap` load,
//! [`RuleSet::check`] (see its cost), the header rewrite for the hop (one allocation for
//! `X-Forwarded-For`), two clock reads and one histogram observation; for an HTTP/1 client, the
//! exchange on its own upstream connection in the same task (`upstream_pool`: two uncontended locks, no
//! trip through the runtime's queue); the header-read and response deadlines as slots of the
//! worker's `deadlines` timers (an uncontended lock to arm and one to disarm each, not tokio's timer
//! wheel).

mod accept;
mod access;
pub mod admin;
mod body;
mod clients;
mod connection;
mod deadlines;
mod failure;
pub mod forward;
mod forwarded;
pub(crate) mod http1;
mod http2;
mod override_files;
mod protocol;
pub mod reload;
mod request;
pub mod response;
mod settings;
mod shared;
mod upstream_pool;
mod worker;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{Config, ConfigError};
use crate::control::reporter::Reporter;
use crate::fds;
use crate::limit::{AnyClock, Clock};
use crate::metrics::Metrics;
use crate::rules::DropRatios;
use crate::rules::RuleSet;
pub use shared::Shared;
use worker::{bind_shared, serve};

/// A running proxy: its bound addresses and the handle to stop it.
pub struct Sidecar {
    addr: SocketAddr,
    admin_addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    shared: Arc<Shared>,
}

impl Sidecar {
    /// Binds the listeners of `config` (port 0 picks a free port) and starts serving.
    pub async fn start(config: Config) -> std::io::Result<Sidecar> {
        Self::start_with_clock(config, AnyClock::default()).await
    }

    /// As [`start`](Self::start), with the limiters reading `clock`.
    pub async fn start_with_clock(config: Config, clock: AnyClock) -> std::io::Result<Sidecar> {
        let workers = config
            .workers
            .map(|n| n.get() as usize)
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .unwrap_or(1);
        let listeners = bind_shared(config.listen, workers).map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot listen on {}: {e}", config.listen))
        })?;
        let admin_listener = TcpListener::bind(config.admin).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen on admin {}: {e}", config.admin),
            )
        })?;
        if config.timeouts.idle.is_some() {
            tracing::warn!(
                "timeouts.idle is now timeouts.upstream_idle (the old name still works for now)"
            );
        }
        let needed = fds::needed(
            config.limits.max_connections.get(),
            config.limits.upstream_connections(),
        );
        match fds::prepare(needed, std::os::fd::AsFd::as_fd(&listeners[0])) {
            Ok(room) if room.limit < room.needed => tracing::warn!(
                limit = room.limit,
                needed = room.needed,
                "the open-files limit is below what limits.max_connections and \
                 max_upstream_connections need: raise it (ulimit -n) or lower them"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot read the open-files limit"),
        }
        let addr = listeners[0].local_addr()?;
        let admin_addr = admin_listener.local_addr()?;
        let metrics = Arc::new(Metrics::for_service(&config.service.0));
        // Ratios count as fresh from start-up, so a control plane that never answers makes
        // the proxy stale (fail open, or the fallback limits) after `stale_after`.
        let ratios = Arc::new(ArcSwap::from_pointee(DropRatios::empty(clock.now())));
        let secret = crate::digest::Secret::of(config.key_secret_file.as_deref())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        for warning in config.warnings() {
            tracing::warn!("{warning}");
        }
        #[cfg(feature = "redis")]
        let exact = match &config.redis {
            Some(redis) => {
                let exact = crate::exact::Exact::new(
                    redis,
                    &config.service.0,
                    &secret,
                    metrics.redis_in_use().clone(),
                    clock.clone(),
                )
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
                exact.start().await;
                Some(exact)
            }
            None => None,
        };
        let rules =
            RuleSet::build_with_ratios(&config, &metrics, ratios.clone()).with_secret(secret);
        metrics.show_limits(&config.rules);
        #[cfg(feature = "redis")]
        let rules = rules.with_store(crate::exact::store(&exact));
        let (stop, stopped) = watch::channel(false);
        let reporter = match &config.control_plane {
            Some(cp) => Some(Reporter::new(
                &config.service.0,
                cp,
                &ratios,
                &clock,
                &metrics,
                stop.subscribe(),
            )?),
            None => None,
        };
        let shared = Arc::new(Shared::new(
            config,
            rules,
            ratios,
            clock,
            metrics,
            #[cfg(feature = "redis")]
            exact,
        ));
        shared
            .metrics
            .config_loaded_at
            .set(shared.loaded.load().loaded_at);
        // Each key's own limit holds from the first request: the files load before serving.
        override_files::load(shared.rules.load_full(), None)
            .await
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        shared.override_files.until(stop.subscribe()).await;
        override_files::watch_new(&shared).await;
        let task = tokio::spawn(serve(
            listeners,
            admin_listener,
            shared.clone(),
            stopped,
            reporter,
        ));
        Ok(Sidecar {
            addr,
            admin_addr,
            stop,
            task,
            shared,
        })
    }

    /// Records `text` (the file the configuration came from) as the active version, and
    /// reloads whenever `path` changes (directory events, so a ConfigMap's symlink swap
    /// counts) or the process gets SIGHUP, until shutdown.
    pub fn watch_file(&self, path: PathBuf, text: &str) -> std::io::Result<()> {
        self.shared.loaded.store(Arc::new(reload::Loaded::new(
            crate::watch::version_of(text),
            Some(path.clone()),
        )));
        let shared = self.shared.clone();
        crate::watch::spawn(&path.clone(), self.stop.subscribe(), move |trigger| {
            let (shared, path) = (shared.clone(), path.clone());
            async move { reload::reload_and_log(&shared, &path, trigger).await }
        })?;
        Ok(())
    }

    /// Reloads from `path` now (what SIGHUP does), returning what changed or why nothing did.
    pub async fn reload_file(&self, path: &Path) -> Result<reload::Reloaded, ConfigError> {
        let result = reload::reload(&self.shared, path, crate::watch::Trigger::Signal).await;
        self.shared.metrics.reloaded(result.is_ok());
        result.map(|r| r.expect("a signal-triggered reload always reloads"))
    }

    /// The active configuration's version and load time.
    pub fn loaded(&self) -> Arc<reload::Loaded> {
        self.shared.loaded.load_full()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Starts the shutdown: not ready, stop accepting, drain in-flight requests.
    pub fn shutdown(&self) {
        let _ = self.stop.send(true);
    }

    /// Waits until the proxy has drained and stopped.
    pub async fn wait(self) {
        let _ = self.task.await;
    }

    /// Serves until `signal` completes, then drains and returns.
    pub async fn run_until(self, signal: impl Future<Output = ()>) {
        signal.await;
        self.shutdown();
        self.wait().await;
    }
}

/// The effective configuration as JSON, for `/config`, with its version and load time.
pub fn config_json(config: &Config, loaded: &reload::Loaded) -> Bytes {
    let mut doc = serde_json::to_value(config).unwrap_or_default();
    if let (serde_json::Value::Object(map), Ok(serde_json::Value::Object(meta))) =
        (&mut doc, serde_json::to_value(loaded))
    {
        map.extend(meta);
    }
    serde_json::to_vec_pretty(&doc)
        .map(Bytes::from)
        .unwrap_or_else(|e| Bytes::from(format!("{{\"error\":\"{e}\"}}")))
}

/// A stable text of `config`, for the version of a configuration that came from no file.
fn config_json_text(config: &Config) -> String {
    serde_json::to_string(config).unwrap_or_default()
}
