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
//! - [`proxy`]: the data plane (accept, decide, forward, drain) and its one place for 429s.
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz`, `/config` on their own listener.
//! - [`metrics`]: every Prometheus family, handles resolved once.
//! - [`watch`]: noticing config changes (directory events, SIGHUP) for hot reload.
//! - [`tune`]: limits from Prometheus history; shadow rules promoted when safe.
//! - [`ui`]: the built-in status page on the admin ports.
//! - [`demo`]: a self-contained run that shows the limiter at work.

pub mod admin;
pub mod config;
pub mod control;
pub mod demo;
pub mod exact;
pub mod gate;
pub mod inject;
pub mod key;
pub mod limit;
pub mod metrics;
pub mod proxy;
pub mod rules;
pub mod target;
pub mod tune;
pub mod ui;
pub mod watch;

pub use config::{Config, ConfigError};
pub use gate::{PeerAddr, RateLimitLayer};
pub use proxy::Sidecar;
