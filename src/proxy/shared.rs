//! The state every connection of one proxy shares, built once at start-up from the
//! configuration (`Sidecar::start`) and swapped in parts on reload: the rules and the drop
//! ratios they read, the upstream's address and caps, the client caps, the settings the request
//! path reads per request (hygiene, client address policy, timeouts), the metrics and the clock.
//! Each field says which part of the data plane reads it. Must never: hold per-connection or
//! per-request state, or be written but through an `ArcSwap` or an atomic.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use super::{clients, http2, reload, settings, upstream_pool};
use crate::config::Config;
use crate::hygiene::Hygiene;
use crate::key;
use crate::limit::AnyClock;
use crate::metrics::Metrics;
use crate::rules::{DropRatios, RuleSet};

/// State shared by every connection of one proxy.
pub struct Shared {
    /// Rules, matchers and their metric handles, swapped whole on reload.
    pub rules: Arc<ArcSwap<RuleSet>>,
    /// The control plane's drop ratios, published by the reporter, read by global rules.
    pub ratios: Arc<ArcSwap<DropRatios>>,
    pub config: ArcSwap<Config>,
    pub(super) upstream: http::uri::Authority,
    /// The same with its connect and idle timeouts, for every upstream connection.
    pub(super) affine_upstream: upstream_pool::UpstreamAddr,
    pub(super) upstream_h2: bool,
    /// `limits.max_upstream_connections`, shared by every worker.
    pub(super) upstream_cap: Arc<upstream_pool::Cap>,
    /// `limits.max_upstream_per_client`.
    pub(super) upstream_per_client: usize,
    /// `limits.max_response_buffer` and its per-connection part, for HTTP/2 responses.
    pub(super) h2_budget: Arc<http2::held::Budget>,
    /// `limits.max_connections_per_client`.
    pub(super) per_client: Arc<clients::PerClient>,
    /// Each worker's idle kept-alive connections, one closed for a new client at the cap.
    pub(super) idles: clients::Idles,
    pub clock: AnyClock,
    pub metrics: Arc<Metrics>,
    /// Who the client is, and whose forwarded fields and costs are believed.
    pub(super) client_ip: key::ClientIpPolicy,
    /// What is done to a request's target and headers before the rules see it.
    pub(super) hygiene: Hygiene,
    pub(super) response_timeout: Duration,
    /// `timeouts.send` and `timeouts.client_body_idle`, for a body still coming upstream.
    pub(super) upload_timeouts: (Duration, Duration),
    // Relaxed: a flag read by /readyz; nothing else is published through it.
    pub draining: AtomicBool,
    /// Redis of `scope: redis` rules, kept across reloads while its section is unchanged.
    #[cfg(feature = "redis")]
    pub(super) exact: arc_swap::ArcSwapOption<crate::exact::Exact>,
    /// The active configuration's version, for `/config`.
    pub loaded: ArcSwap<reload::Loaded>,
    pub(super) reload_lock: tokio::sync::Mutex<()>,
    /// The `overrides_file`s watched.
    pub(super) override_files: super::override_files::Watched,
    /// `request_id` (a restart field).
    pub(super) request_ids: crate::config::RequestIds,
    /// `access_log` (a restart field; `None`: off), with its budget of refusal lines.
    pub(super) access_log: Option<super::access::AccessLog>,
}

impl Shared {
    /// The state of a proxy starting with `config`, its rules built: the upstream's slice
    /// (`settings`), its caps, the request path's policies and timeouts
    /// (`timeouts.upstream_response`, and `send` and `client_body_idle` for a body still coming).
    pub(super) fn new(
        config: Config,
        rules: RuleSet,
        ratios: Arc<ArcSwap<DropRatios>>,
        clock: AnyClock,
        metrics: Arc<Metrics>,
        #[cfg(feature = "redis")] exact: Option<Arc<crate::exact::Exact>>,
    ) -> Shared {
        let (t, limits) = (&config.timeouts, &config.limits);
        Shared {
            rules: Arc::new(ArcSwap::from_pointee(rules)),
            ratios,
            upstream: config.upstream.authority.clone(),
            affine_upstream: settings::upstream_addr(&config),
            upstream_h2: config.upstream.h2,
            upstream_cap: upstream_pool::Cap::new(
                limits.upstream_connections() as usize,
                metrics.upstream_waiters.clone(),
            ),
            upstream_per_client: limits.max_upstream_per_client.get() as usize,
            h2_budget: http2::held::Budget::new(
                limits.max_response_buffer.0,
                limits.max_response_buffer_per_connection.0,
                metrics.h2_held.clone(),
                metrics.h2_shed.clone(),
            ),
            per_client: clients::PerClient::new(
                limits.max_connections_per_client.get(),
                config.per_client_exempt(),
            ),
            idles: clients::Idles::default(),
            clock,
            metrics,
            client_ip: config.client_ip.policy(),
            hygiene: Hygiene::of(&config),
            response_timeout: t.upstream_response.0,
            upload_timeouts: (t.send.0, t.client_body_idle.0),
            draining: AtomicBool::new(false),
            #[cfg(feature = "redis")]
            exact: arc_swap::ArcSwapOption::new(exact),
            loaded: ArcSwap::from_pointee(reload::Loaded::new(
                crate::watch::version_of(&super::config_json_text(&config)),
                None,
            )),
            reload_lock: tokio::sync::Mutex::new(()),
            override_files: Default::default(),
            request_ids: config.request_id.clone(),
            access_log: config.access_log.as_ref().map(super::access::AccessLog::of),
            config: ArcSwap::from_pointee(config),
        }
    }
}
