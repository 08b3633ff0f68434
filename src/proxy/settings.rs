//! The data plane's settings, each consumer's slice derived from the configuration once: the
//! upstream's address and timeouts (`upstream_pool`, `forward`, at start-up into `Shared`), a
//! worker's client connections ([`ConnSettings`], what the protocol servers are given),
//! hyper's HTTP/2 server for them (its PING cadence among them), and the worker's tick. Each
//! function says which `timeouts.*` and `limits.*` it reads. Must never: be read per request
//! (its results are), or give a setting a meaning the schema (docs/configuration.md) does not.

use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http2::Builder;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::watch;

use super::deadlines::Timers;
use super::http2::held::Budget;
use super::http2::stalls::Stalls;
use super::protocol::ConnSettings;
use super::upstream_pool::UpstreamAddr;
use crate::config::Config;
use crate::metrics::Metrics;

/// Our own upstream connections' address, `timeouts.upstream_connect` and
/// `timeouts.upstream_idle` (an idle connection unused longer is closed).
pub(super) fn upstream_addr(config: &Config) -> UpstreamAddr {
    let authority = &config.upstream.authority;
    UpstreamAddr {
        address: format!(
            "{}:{}",
            authority.host(),
            authority.port_u16().unwrap_or(80)
        ),
        connect_timeout: config.timeouts.upstream_connect.0,
        idle: config.timeouts.upstream_idle().as_nanos() as u64,
    }
}

/// A worker's client connections: `timeouts.header_read` (the first head from the accept, each
/// next one from its first byte), `client_idle` (between requests), `send`, and
/// `upstream_body_idle`; a partial head twice `limits.max_header_bytes` long is answered 431 as
/// it is read (below it, the request path answers 431 at `max_header_bytes`).
pub(super) fn conn_settings(
    config: &Config,
    (h2_budget, metrics): (&Arc<Budget>, &Metrics),
    timers: Arc<Timers>,
    stalls: Arc<Stalls>,
    draining: watch::Receiver<bool>,
) -> ConnSettings {
    let t = &config.timeouts;
    ConnSettings {
        hyper: h2_server(config, h2_budget),
        max_head: (config.limits.max_header_bytes.0 * 2).max(8192 + 1024),
        header_read: t.header_read.0,
        client_idle: t.client_idle.0,
        send: t.send.0,
        body_idle: t.upstream_body_idle.0,
        body_idle_errors: metrics
            .upstream_error(crate::metrics::UpstreamError::BodyIdle)
            .clone(),
        timers,
        stalls,
        h2_budget: h2_budget.clone(),
        draining,
    }
}

/// hyper's HTTP/2 server for the client connections that begin with its preface:
/// `limits.max_h2_streams` streams at once, `max_header_bytes` of header list, each stream's
/// share of `max_response_buffer_per_connection` as its send buffer. Its PING cadence is the
/// client-facing side of two timeouts (docs/operations.md, timeouts): a PING every
/// `upstream_idle`, to be answered within `header_read`, or the connection is closed.
fn h2_server(config: &Config, h2_budget: &Budget) -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(config.limits.max_h2_streams.get())
        .max_send_buf_size(h2_budget.per_stream())
        .max_header_list_size(config.limits.max_header_bytes.0 as u32)
        .max_pending_accept_reset_streams(64)
        .keep_alive_interval(Some(config.timeouts.upstream_idle()))
        .keep_alive_timeout(config.timeouts.header_read.0);
    builder
}

/// The worker's tick: half the shortest per-request timer (`header_read`, `upstream_response`,
/// `send`, `upstream_body_idle`, `client_body_idle`, a rule's `upstream_body_idle` at start
/// included), at most a second (a shorter one a reload brings fires up to a second late).
pub(super) fn anchor_period(config: &Config) -> Duration {
    let t = &config.timeouts;
    let rules = config.rules.iter().filter_map(|r| r.upstream_body_idle);
    (rules.fold(
        t.header_read
            .0
            .min(t.upstream_response.0)
            .min(t.send.0)
            .min(t.upstream_body_idle.0)
            .min(t.client_body_idle.0),
        |shortest, d| shortest.min(d.0),
    ) / 2)
        .clamp(Duration::from_millis(1), Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_anchor_ticks_at_half_the_shortest_timer_a_rules_included() {
        let yaml = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: feeds\n    key: []\n    limit: { rate: 10/s }\n    upstream_body_idle: 600ms\n";
        let config = Config::from_yaml(yaml, "t").unwrap();
        assert_eq!(anchor_period(&config), Duration::from_millis(300));
        let config =
            Config::from_yaml(&yaml.replace("    upstream_body_idle: 600ms\n", ""), "t").unwrap();
        assert_eq!(anchor_period(&config), Duration::from_secs(1));
    }
}
