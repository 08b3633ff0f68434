//! Spillway: a reverse-proxy sidecar with built-in rate limiting.
//!
//! The surface is the sidecar ([`Sidecar`], started from a [`Config`]), the tower
//! [`RateLimitLayer`] for embedding the same decision in a service, and the limiter cores
//! ([`Limiter`] and one type per [`Algorithm`]). The modules are private.
//!
//! # Layout
//!
//! - `limit`: the limiter cores, pure, clock injected: one module per algorithm.
//! - `config`: the YAML schema, parsed and validated with file/line/field errors.
//! - `key`: which bucket a request belongs to; the client address; bounded key forms.
//! - `ids`: request ids, taken from a trusted request or made here.
//! - `digest`: the keyed digest a key's private parts are shown and sent as.
//! - `fds`: room for the descriptors a process's connections need (proxy and control plane).
//! - `target`: the canonical request path, and the form rules match it in.
//! - `rules`: compiled rules and the synchronous in-path decision.
//! - `gate`: admission around the decision: waiting (delay, shaping), remote stores, slots.
//! - `layer`: the embeddable tower layer, a thin adapter over `gate` and `respond`.
//! - `control`: reporter, aggregator, controller and the drop-ratio math (fleet limits).
//! - `exact`: `scope: redis`: the Lua scripts, the Redis connection and its circuit breaker.
//! - `hygiene`: what a request must be before any rule sees it (one `Host`, a canonical
//!   path, no client claims); `hop`: the fields that belong to one connection.
//! - `respond`: the one place that answers by itself: 429s (kept per rule), 4xx/5xx, gRPC.
//! - `proxy`: the data plane (accept, decide, forward, drain) and its admin listener
//!   (`/metrics`, `/healthz`, `/readyz`, `/config`).
//! - `metrics`: every Prometheus family, handles resolved once.
//! - `logs`: the process's log subscriber and its filter, changed at run time.
//! - `watch`: noticing config changes (directory events, SIGHUP) for hot reload.
//! - `tune`: limits from Prometheus history; shadow rules promoted when safe.
//! - `ui`: the built-in status page on the admin ports.
//! - `demo`: a self-contained run that shows the limiter at work.
//!
//! No module file imports one that imports it back (`tests/modules.rs`; a module and those
//! inside it may use each other): the files of `limit`, `key`, `config` and `metrics` sit
//! below those of `rules`, `respond` and `gate`, and those below `proxy`, `control` and
//! `layer`.

mod allocator;
mod config;
mod control;
mod demo;
mod digest;
#[cfg(feature = "redis")]
mod exact;
mod fds;
mod gate;
mod hop;
mod hygiene;
mod ids;
mod inject;
mod key;
mod layer;
mod limit;
mod logs;
mod metrics;
mod proxy;
mod respond;
mod rules;
mod scenario;
mod target;
#[cfg(feature = "tune")]
mod tune;
#[cfg(feature = "ui")]
mod ui;
mod usage;
mod watch;

pub use config::{Config, ConfigError};
pub use layer::{PeerAddr, RateLimitLayer};
pub use limit::{
    Algorithm, AnyClock, Clock, Decision, FixedWindow, Gcra, LeakyBucket, Limiter, ManualClock,
    MonotonicClock, Quota, SlidingWindowCounter, SlidingWindowLog, TokenBucket,
};
pub use proxy::Sidecar;

/// What the command line, the tests and the benches reach beyond the curated surface above:
/// the modules as they are inside, with no promise that they stay so.
#[doc(hidden)]
pub mod internal {
    pub mod allocator {
        pub use crate::allocator::*;
    }
    pub mod config {
        pub use crate::config::*;
    }
    pub mod control {
        pub use crate::control::*;
    }
    pub mod demo {
        pub use crate::demo::*;
    }
    #[cfg(feature = "redis")]
    pub mod exact {
        pub use crate::exact::*;
    }
    pub mod digest {
        pub use crate::digest::*;
    }
    pub mod gate {
        pub use crate::gate::*;
    }
    pub mod hygiene {
        pub use crate::hygiene::*;
    }
    pub mod ids {
        pub use crate::ids::*;
    }
    pub mod inject {
        pub use crate::inject::*;
    }
    pub mod key {
        pub use crate::key::*;
    }
    pub mod scenario {
        pub use crate::scenario::*;
    }
    pub mod usage {
        pub use crate::usage::*;
    }
    pub mod layer {
        pub use crate::layer::*;
    }
    pub mod limit {
        pub use crate::limit::*;
    }
    pub mod metrics {
        pub use crate::metrics::*;
    }
    pub mod logs {
        pub use crate::logs::*;
    }
    pub mod proxy {
        pub use crate::proxy::*;
    }
    pub mod respond {
        pub use crate::respond::*;
    }
    pub mod rules {
        pub use crate::rules::*;
    }
    pub mod target {
        pub use crate::target::*;
    }
    #[cfg(feature = "tune")]
    pub mod tune {
        pub use crate::tune::*;
    }
    #[cfg(feature = "ui")]
    pub mod ui {
        pub use crate::ui::*;
    }
    pub mod watch {
        pub use crate::watch::*;
    }
}
