//! Spillway: a reverse-proxy sidecar with built-in rate limiting.
//!
//! # Layout
//!
//! - [`limit`]: the limiter cores, pure, clock injected: one module per algorithm.
//! - [`config`]: the YAML schema, parsed and validated with file/line/field errors.
//! - [`key`]: which bucket a request belongs to; the client address; bounded key forms.
//! - [`target`]: the canonical request path, and the form rules match it in.
//! - [`rules`]: compiled rules and the synchronous in-path decision.
//! - [`gate`]: waiting (delay, shaping), concurrency slots, and the embeddable tower layer.
//! - [`control`]: reporter, aggregator, controller and the drop-ratio math (fleet limits).
//! - [`exact`]: `scope: redis`: the Lua scripts, the Redis connection and its circuit breaker.
//! - [`hygiene`]: what a request must be before any rule sees it (one `Host`, a canonical
//!   path, no client claims); [`hop`]: the fields that belong to one connection.
//! - [`respond`]: the one place that answers by itself: 429s (kept per rule), 4xx/5xx, gRPC.
//! - [`proxy`]: the data plane (accept, decide, forward, drain) and its admin listener
//!   (`/metrics`, `/healthz`, `/readyz`, `/config`).
//! - [`metrics`]: every Prometheus family, handles resolved once.
//! - [`watch`]: noticing config changes (directory events, SIGHUP) for hot reload.
//! - [`tune`]: limits from Prometheus history; shadow rules promoted when safe.
//! - [`ui`]: the built-in status page on the admin ports.
//! - [`demo`]: a self-contained run that shows the limiter at work.
//!
//! No module file imports one that imports it back (`tests/modules.rs`; a module and those
//! inside it may use each other): the files of `limit`, `key`, `config` and `metrics` sit
//! below those of `rules`, `respond` and `gate`, and those below `proxy` and `control`.

pub mod config;
pub mod control;
pub mod demo;
pub mod exact;
pub mod gate;
pub(crate) mod hop;
pub mod hygiene;
pub mod inject;
pub mod key;
pub mod limit;
pub mod metrics;
pub mod proxy;
pub mod respond;
pub mod rules;
pub mod target;
pub mod tune;
pub mod ui;
pub mod watch;

pub use config::{Config, ConfigError};
pub use gate::{PeerAddr, RateLimitLayer};
pub use proxy::Sidecar;
