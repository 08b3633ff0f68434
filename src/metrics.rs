//! Prometheus metrics: one registry per process role, handles resolved once.
//!
//! Owns every metric family and the label sets they may carry. Labels never carry raw keys
//! (unbounded and possibly personal): only rule names from the config and fixed enums. The
//! request path only touches pre-resolved handles (`IntCounter`, `Histogram`): an atomic add.
//! Must never: export a label a scraper sets itself (`service`, `namespace`, `pod`, `job`,
//! `instance`, `endpoint`, `container`: the Prometheus Operator would rename ours
//! `exported_*`), nor the Redis families before a Redis is configured. Every histogram has
//! [`SECONDS_BUCKETS`].

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every histogram's bounds, in seconds: round decimal steps from 100 µs to 30 s, so that a
/// query or an alert can name a bound as people write it (`le="0.25"`).
pub const SECONDS_BUCKETS: [f64; 17] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];

/// Why Spillway answered a request itself, not for a limit: the label it is counted by, the
/// `reason` of `spillway_bad_requests_total` for the request's own faults ([`Reason::ALL`]),
/// the `kind` of `spillway_upstream_errors_total` for the upstream's. Each series is made at
/// start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// A head that does not parse, an invalid field value, `Expect` other than 100-continue.
    Malformed,
    /// A head or its fields larger than `limits.max_header_bytes` allows (431).
    HeaderTooLarge,
    /// A method in lower case, or `CONNECT` (501).
    Method,
    /// A missing, repeated or invalid `Host`.
    Host,
    /// A request target that does not normalise.
    Target,
    /// A `Connection` header naming a field the request cannot go without.
    Connection,
    /// A request for a host the service does not answer for (421).
    Misdirected,
    /// A length and codings that conflict, or a coding not served.
    Framing,
    /// A GET or HEAD with a body, under `bodies_on_get: reject`.
    BodyOnGet,
    /// A keyed field sent twice (a rule's).
    RepeatedKey,
    /// A rule's cost field that is not a cost.
    Cost,
    /// A request body malformed or cut off.
    Body,
    /// A request body that stalled past `timeouts.client_body_idle` (408).
    BodyTimeout,
    /// A connection closed for abandoning requests faster than its budget.
    RapidReset,
    /// The upstream did not answer (502, 503, 504).
    Upstream(UpstreamError),
}

impl Reason {
    /// The request's own faults: the `spillway_bad_requests_total` series, in their order.
    pub const ALL: [Reason; 14] = [
        Reason::Malformed,
        Reason::HeaderTooLarge,
        Reason::Method,
        Reason::Host,
        Reason::Target,
        Reason::Connection,
        Reason::Misdirected,
        Reason::Framing,
        Reason::BodyOnGet,
        Reason::RepeatedKey,
        Reason::Cost,
        Reason::Body,
        Reason::BodyTimeout,
        Reason::RapidReset,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Reason::Malformed => "malformed",
            Reason::HeaderTooLarge => "header_too_large",
            Reason::Method => "method",
            Reason::Host => "host",
            Reason::Target => "target",
            Reason::Connection => "connection",
            Reason::Misdirected => "misdirected",
            Reason::Framing => "framing",
            Reason::BodyOnGet => "body_on_get",
            Reason::RepeatedKey => "repeated_key",
            Reason::Cost => "cost",
            Reason::Body => "body",
            Reason::BodyTimeout => "body_timeout",
            Reason::RapidReset => "rapid_reset",
            Reason::Upstream(kind) => kind.label(),
        }
    }

    /// Its place in [`Reason::ALL`]; for the upstream's, its kind.
    fn slot(self) -> Result<usize, UpstreamError> {
        Ok(match self {
            Reason::Malformed => 0,
            Reason::HeaderTooLarge => 1,
            Reason::Method => 2,
            Reason::Host => 3,
            Reason::Target => 4,
            Reason::Connection => 5,
            Reason::Misdirected => 6,
            Reason::Framing => 7,
            Reason::BodyOnGet => 8,
            Reason::RepeatedKey => 9,
            Reason::Cost => 10,
            Reason::Body => 11,
            Reason::BodyTimeout => 12,
            Reason::RapidReset => 13,
            Reason::Upstream(kind) => return Err(kind),
        })
    }
}

/// Why the proxy could not get a response from the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamError {
    /// Connection refused or reset before a response (502).
    Connect,
    /// No connection within `timeouts.upstream_connect` (504).
    ConnectTimeout,
    /// No response head within `timeouts.upstream_response` (504).
    ResponseTimeout,
    /// The upstream broke the protocol or closed mid-request (502).
    Protocol,
    /// No upstream connection came free within `timeouts.upstream_connect` under
    /// `limits.max_upstream_connections` or `max_upstream_per_client` (503).
    Saturated,
    /// A response body with no byte for `timeouts.upstream_body_idle` (given up).
    BodyIdle,
    /// The upstream took no byte of a request body for `timeouts.send` (504).
    UploadStalled,
}

impl UpstreamError {
    pub const ALL: [UpstreamError; 7] = [
        UpstreamError::Connect,
        UpstreamError::ConnectTimeout,
        UpstreamError::ResponseTimeout,
        UpstreamError::Protocol,
        UpstreamError::Saturated,
        UpstreamError::BodyIdle,
        UpstreamError::UploadStalled,
    ];
    pub fn label(self) -> &'static str {
        match self {
            UpstreamError::Connect => "connect",
            UpstreamError::ConnectTimeout => "connect_timeout",
            UpstreamError::ResponseTimeout => "response_timeout",
            UpstreamError::Protocol => "protocol",
            UpstreamError::Saturated => "saturated",
            UpstreamError::BodyIdle => "body_idle",
            UpstreamError::UploadStalled => "upload_stalled",
        }
    }
}

/// Why a Redis decision failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisError {
    /// No answer within `redis.timeout`.
    Timeout,
    /// No connection, or it broke during the call.
    Connection,
    /// Redis answered with an error about its state (OOM, READONLY, BUSY, LOADING, ...).
    Server,
    /// A script or its arguments failed, or its answer was not understood: a bug to report,
    /// never a sign that Redis is down (it does not count toward the breaker).
    Script,
}

impl RedisError {
    pub const ALL: [RedisError; 4] = [
        RedisError::Timeout,
        RedisError::Connection,
        RedisError::Server,
        RedisError::Script,
    ];
    pub fn label(self) -> &'static str {
        match self {
            RedisError::Timeout => "timeout",
            RedisError::Connection => "connection",
            RedisError::Server => "server",
            RedisError::Script => "script",
        }
    }
}

/// The Redis mode's families, handles resolved once; registered by [`Metrics::redis_in_use`]
/// (a process without Redis shows none of them).
#[derive(Clone)]
pub struct RedisMetrics {
    pub duration: Histogram,
    errors: [IntCounter; 4],
    /// 0 closed, 1 open, 2 half-open (one probe in flight).
    pub breaker_state: IntGauge,
    pub breaker_opened: IntCounter,
    pub connected: IntGauge,
    /// Decisions made by `on_error` (`spillway_redis_on_error_total{action}`).
    pub on_error_allow: IntCounter,
    pub on_error_deny: IntCounter,
    pub on_error_fallback: IntCounter,
    /// Refusals answered from the local cache of keys known to be refused, per rule.
    pub cache_answers: IntCounterVec,
    /// Keys not seen lately refused before Redis, past the rule's `new_keys`, per rule.
    pub new_keys_refused: IntCounterVec,
}

impl RedisMetrics {
    #[inline]
    pub fn error(&self, kind: RedisError) -> &IntCounter {
        &self.errors[kind as usize]
    }

    /// The handles, and their families for [`Metrics::redis_in_use`] to register.
    fn new() -> (Self, Vec<Family>) {
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "spillway_redis_duration_seconds",
                "Round trip of one Redis decision (EVALSHA), answered or not.",
            )
            .buckets(SECONDS_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        let errors = IntCounterVec::new(
            Opts::new(
                "spillway_redis_errors_total",
                "Redis decisions that failed, by kind (timeout, connection, server; script: a script or its answer failed, which never opens the breaker).",
            ),
            &["kind"],
        )
        .expect("valid metric");
        let breaker_state = IntGauge::new(
            "spillway_redis_breaker_state",
            "Redis circuit breaker: 0 closed, 1 open (Redis not asked), 2 half-open (probing).",
        )
        .expect("valid metric");
        let breaker_opened = IntCounter::new(
            "spillway_redis_breaker_opened_total",
            "Times the Redis circuit breaker opened.",
        )
        .expect("valid metric");
        let connected = IntGauge::new(
            "spillway_redis_connected",
            "1 while a connection to Redis is up.",
        )
        .expect("valid metric");
        let on_error = IntCounterVec::new(
            Opts::new(
                "spillway_redis_on_error_total",
                "Decisions made without Redis's answer (failure or open breaker), by the on_error action taken.",
            ),
            &["action"],
        )
        .expect("valid metric");
        let cache_answers = IntCounterVec::new(
            Opts::new(
                "spillway_redis_cache_answers_total",
                "Refusals answered locally because Redis had refused the key until a known time.",
            ),
            &["rule"],
        )
        .expect("valid metric");
        let new_keys_refused = IntCounterVec::new(
            Opts::new(
                "spillway_redis_new_keys_refused_total",
                "Keys not seen lately refused here, before Redis, past the rule's new_keys a second.",
            ),
            &["rule"],
        )
        .expect("valid metric");
        let collectors = vec![
            Family(std::sync::Arc::new(duration.clone())),
            Family(std::sync::Arc::new(new_keys_refused.clone())),
            Family(std::sync::Arc::new(errors.clone())),
            Family(std::sync::Arc::new(breaker_state.clone())),
            Family(std::sync::Arc::new(breaker_opened.clone())),
            Family(std::sync::Arc::new(connected.clone())),
            Family(std::sync::Arc::new(on_error.clone())),
            Family(std::sync::Arc::new(cache_answers.clone())),
        ];
        let redis = RedisMetrics {
            duration,
            errors: RedisError::ALL.map(|k| errors.with_label_values(&[k.label()])),
            breaker_state,
            breaker_opened,
            connected,
            on_error_allow: on_error.with_label_values(&["allow"]),
            on_error_deny: on_error.with_label_values(&["deny"]),
            on_error_fallback: on_error.with_label_values(&["fallback"]),
            cache_answers,
            new_keys_refused,
        };
        (redis, collectors)
    }
}

/// A metric family that can be registered after it was made (its handles already in use).
#[derive(Clone)]
struct Family(std::sync::Arc<dyn prometheus::core::Collector>);

impl prometheus::core::Collector for Family {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.0.desc()
    }
    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.0.collect()
    }
}

/// How a request ended, for the duration histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The upstream answered (whatever its status).
    Upstream,
    /// A rule rejected it with 429.
    Rejected,
    /// We answered with an error (4xx for bad input, 502/504 for the upstream).
    Error,
}

/// All metric families of the proxy.
pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub keys: IntGaugeVec,
    /// `spillway_overrides{rule}`: keys with a limit of their own, loaded.
    pub overrides: IntGaugeVec,
    /// `spillway_overrides_reloads_total{rule,result}`: loads of an `overrides_file`.
    pub overrides_reloads: IntCounterVec,
    pub evicted: IntCounterVec,
    pub overflow: IntCounterVec,
    pub sketch_refused: IntCounterVec,
    /// `spillway_response_units_total{rule, kind}`: a response cost's units, `reserved` at
    /// admission, `charged` once the response said them, `lost` by a remote store.
    pub response_units: IntCounterVec,
    /// `spillway_response_usage_unread_total{rule, reason}`: responses charged their rule's
    /// `unknown` (`missing`, `malformed`, `cut_short`, `encoded`), or clamped to its `max`
    /// (`clamped`).
    pub usage_unread: IntCounterVec,
    pub delay_queue: IntGaugeVec,
    pub delayed: IntCounterVec,
    durations: [Histogram; 3],
    upstream_errors: [IntCounter; 7],
    /// `spillway_upstream_connections_discarded_total{reason}`, by [`Unusable`].
    pub upstream_discards: [IntCounter; 3],
    /// `spillway_client_send_timeouts_total`.
    pub send_timeouts: IntCounter,
    /// `spillway_access_log_dropped_total`: refusal and error lines past the access log's
    /// budget.
    pub access_dropped: IntCounter,
    /// `spillway_upstream_connection_waiters`.
    pub upstream_waiters: IntGauge,
    /// `spillway_h2_response_bytes_held`: the process's HTTP/2 response bytes not yet written.
    pub h2_held: IntGauge,
    /// `spillway_h2_connections_shed_total`: closed at `limits.max_response_buffer`.
    pub h2_shed: IntCounter,
    /// `spillway_connections_refused_total{reason="per_client"}`.
    pub refused_per_client: IntCounter,
    /// `spillway_connections_closed_for_room_total`: idle kept-alive connections closed for
    /// a new client at `limits.max_connections`.
    pub closed_for_room: IntCounter,
    /// `spillway_bad_requests_total`, by [`Reason`].
    bad_requests: [IntCounter; 14],
    pub connections: IntGauge,
    pub draining: IntGauge,
    pub reports_ok: IntCounter,
    pub reports_failed: IntCounter,
    pub report_bytes: IntGauge,
    pub control_plane_age: prometheus::Gauge,
    pub control_plane_stale: IntGauge,
    pub redis: RedisMetrics,
    /// The Redis families, registered once by [`Metrics::redis_in_use`].
    redis_families: Vec<Family>,
    redis_shown: std::sync::Once,
    /// `spillway_upstream_responses_total{code_class}`, by the status's first digit (1xx-5xx,
    /// then `other`).
    upstream_responses: [IntCounter; 6],
    /// `spillway_rule_limit{rule, unit}`: each local rule's configured limit.
    rule_limit: prometheus::GaugeVec,
    /// `spillway_config_last_reload_successful`.
    pub config_reload_ok: IntGauge,
    /// `spillway_config_reloads_total{result}`.
    pub config_reloads_ok: IntCounter,
    pub config_reloads_error: IntCounter,
    pub config_loaded_at: prometheus::Gauge,
    /// Adaptive concurrency, per rule: the limit now, the learned no-load latency, the last
    /// window's latency.
    pub adaptive_limit: IntGaugeVec,
    pub adaptive_baseline: prometheus::GaugeVec,
    pub adaptive_latency: prometheus::GaugeVec,
}

/// The label every data-plane series carries: the configured service. Not `service`, which a
/// ServiceMonitor sets to the Kubernetes Service scraped.
pub const SERVICE_LABEL: &str = "spillway_service";

impl Metrics {
    /// Metrics with no service label (the tower layer, tests).
    pub fn new() -> Self {
        Self::with_registry(Registry::new())
    }

    /// A proxy's metrics: every series labelled with `service`, so that fleets and tools such
    /// as `spillway tune` can tell services that share rule names apart.
    pub fn for_service(service: &str) -> Self {
        let labels =
            std::collections::HashMap::from([(SERVICE_LABEL.to_string(), service.to_string())]);
        Self::with_registry(Registry::new_custom(None, Some(labels)).expect("a valid label"))
    }

    fn with_registry(registry: Registry) -> Self {
        register_process(&registry);
        let requests = IntCounterVec::new(
            Opts::new(
                "spillway_requests_total",
                "Rule decisions; decision is allowed, rejected or shadow_rejected.",
            ),
            &["rule", "decision"],
        )
        .expect("valid metric");
        let keys = IntGaugeVec::new(
            Opts::new("spillway_keys", "Keys tracked per rule."),
            &["rule"],
        )
        .expect("valid metric");
        let overrides = IntGaugeVec::new(
            Opts::new(
                "spillway_overrides",
                "Keys with a limit of their own, per rule (overrides and overrides_file).",
            ),
            &["rule"],
        )
        .expect("valid metric");
        let overrides_reloads = IntCounterVec::new(
            Opts::new(
                "spillway_overrides_reloads_total",
                "Loads of a rule's overrides_file; result is ok or error (the last good set stays).",
            ),
            &["rule", "result"],
        )
        .expect("valid metric");
        let evicted = IntCounterVec::new(
            Opts::new(
                "spillway_keys_evicted_total",
                "Keys forgotten per rule; reason idle means the bucket had refilled.",
            ),
            &["rule", "reason"],
        )
        .expect("valid metric");
        let overflow = IntCounterVec::new(
            Opts::new(
                "spillway_overflow_total",
                "Decisions of keys that found no place in a rule's store (max_keys reached, none idle): by its sketch or shared overflow state.",
            ),
            &["rule"],
        )
        .expect("valid metric");
        let sketch_refused = IntCounterVec::new(
            Opts::new(
                "spillway_sketch_refused_total",
                "Requests of untracked keys (the rule's store full) refused by its count-min sketch.",
            ),
            &["rule"],
        )
        .expect("valid metric");
        let response_units = IntCounterVec::new(
            Opts::new(
                "spillway_response_units_total",
                "Units of rules whose cost is the response's: reserved at admission, charged once the response said them (the reservation reconciled), and lost (a remote store did not take what it was owed).",
            ),
            &["rule", "kind"],
        )
        .expect("valid metric");
        let usage_unread = IntCounterVec::new(
            Opts::new(
                "spillway_response_usage_unread_total",
                "Responses whose usage could not be read as sent (missing, malformed, cut_short or encoded: charged the rule's unknown) or was past the rule's max (clamped).",
            ),
            &["rule", "reason"],
        )
        .expect("valid metric");
        let delay_queue = IntGaugeVec::new(
            Opts::new(
                "spillway_delay_queue",
                "Requests waiting for admission now, per on_limit: delay rule.",
            ),
            &["rule"],
        )
        .expect("valid metric");
        let delayed = IntCounterVec::new(
            Opts::new(
                "spillway_delayed_total",
                "Requests that waited and were then admitted, per on_limit: delay rule.",
            ),
            &["rule"],
        )
        .expect("valid metric");
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "spillway_request_duration_seconds",
                "Time from request head to response head, by outcome.",
            )
            .buckets(SECONDS_BUCKETS.to_vec()),
            &["outcome"],
        )
        .expect("valid metric");
        let upstream = IntCounterVec::new(
            Opts::new(
                "spillway_upstream_errors_total",
                "Requests the upstream did not answer, by kind.",
            ),
            &["kind"],
        )
        .expect("valid metric");
        let discarded = IntCounterVec::new(
            Opts::new(
                "spillway_upstream_connections_discarded_total",
                "Upstream connections closed instead of reused, by reason: leftover (bytes past the response's framing), unasked_bytes (the upstream sent while idle), closed.",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let upstream_responses = IntCounterVec::new(
            Opts::new(
                "spillway_upstream_responses_total",
                "Responses of the upstream forwarded to clients, by the status's class (1xx to 5xx; other: 600 and past).",
            ),
            &["code_class"],
        )
        .expect("valid metric");
        let rule_limit = prometheus::GaugeVec::new(
            Opts::new(
                "spillway_rule_limit",
                "Each local rule's configured limit per key: unit per_second for a rate (its count over its period), in_flight for concurrency.",
            ),
            &["rule", "unit"],
        )
        .expect("valid metric");
        let bad_requests = IntCounterVec::new(
            Opts::new(
                "spillway_bad_requests_total",
                "Requests refused before any rule for being malformed, by reason.",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let send_timeouts = IntCounter::new(
            "spillway_client_send_timeouts_total",
            "Responses given up because the client took none of their bytes for timeouts.send (the HTTP/1 connection closed, the HTTP/2 stream's response dropped).",
        )
        .expect("valid metric");
        let access_dropped = IntCounter::new(
            "spillway_access_log_dropped_total",
            "Access log lines of refusals and errors not written: past access_log.refusals_per_second.",
        )
        .expect("valid metric");
        let upstream_waiters = IntGauge::new(
            "spillway_upstream_connection_waiters",
            "Requests waiting now for an upstream connection under limits.max_upstream_connections.",
        )
        .expect("valid metric");
        let h2_held = IntGauge::new(
            "spillway_h2_response_bytes_held",
            "HTTP/2 response bytes handed to client connections and not yet written to them (limits.max_response_buffer).",
        )
        .expect("valid metric");
        let h2_shed = IntCounter::new(
            "spillway_h2_connections_shed_total",
            "HTTP/2 connections closed because the process held limits.max_response_buffer of response bytes and they held the most.",
        )
        .expect("valid metric");
        let refused = IntCounterVec::new(
            Opts::new(
                "spillway_connections_refused_total",
                "Client connections answered 429 and closed as they came, by reason (per_client: limits.max_connections_per_client).",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let closed_for_room = IntCounter::new(
            "spillway_connections_closed_for_room_total",
            "Idle kept-alive client connections closed for a new client at limits.max_connections.",
        )
        .expect("valid metric");
        let connections = IntGauge::new("spillway_connections", "Client connections open now.")
            .expect("valid metric");
        let draining = IntGauge::new(
            "spillway_draining",
            "1 while the proxy is shutting down and draining.",
        )
        .expect("valid metric");
        let reports = IntCounterVec::new(
            Opts::new(
                "spillway_reports_total",
                "Reports sent to the control plane, by result: ok once per report answered, error once per URL that failed.",
            ),
            &["result"],
        )
        .expect("valid metric");
        let report_bytes = IntGauge::new("spillway_report_bytes", "Size of the last report sent.")
            .expect("valid metric");
        let control_plane_age = prometheus::Gauge::new(
            "spillway_control_plane_age_seconds",
            "Age of the drop ratios held (since the control plane computed them).",
        )
        .expect("valid metric");
        let control_plane_stale = IntGauge::new(
            "spillway_control_plane_stale",
            "1 while the drop ratios are older than stale_after (failing open).",
        )
        .expect("valid metric");
        for c in [
            Box::new(reports.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(report_bytes.clone()),
            Box::new(control_plane_age.clone()),
            Box::new(control_plane_stale.clone()),
            Box::new(requests.clone()),
            Box::new(keys.clone()),
            Box::new(overrides.clone()),
            Box::new(overrides_reloads.clone()),
            Box::new(evicted.clone()),
            Box::new(overflow.clone()),
            Box::new(sketch_refused.clone()),
            Box::new(response_units.clone()),
            Box::new(usage_unread.clone()),
            Box::new(delay_queue.clone()),
            Box::new(delayed.clone()),
            Box::new(duration.clone()),
            Box::new(upstream.clone()),
            Box::new(upstream_responses.clone()),
            Box::new(rule_limit.clone()),
            Box::new(discarded.clone()),
            Box::new(send_timeouts.clone()),
            Box::new(access_dropped.clone()),
            Box::new(upstream_waiters.clone()),
            Box::new(h2_held.clone()),
            Box::new(h2_shed.clone()),
            Box::new(refused.clone()),
            Box::new(closed_for_room.clone()),
            Box::new(bad_requests.clone()),
            Box::new(connections.clone()),
            Box::new(draining.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        let durations = [
            duration.with_label_values(&["upstream"]),
            duration.with_label_values(&["rejected"]),
            duration.with_label_values(&["error"]),
        ];
        let (redis, redis_families) = RedisMetrics::new();
        let reloads = IntCounterVec::new(
            Opts::new(
                "spillway_config_reloads_total",
                "Configuration reloads, by result (ok; error: the previous configuration stays).",
            ),
            &["result"],
        )
        .expect("valid metric");
        let config_loaded_at = prometheus::Gauge::new(
            "spillway_config_loaded_timestamp_seconds",
            "Unix time the active configuration was loaded.",
        )
        .expect("valid metric");
        let config_reload_ok = IntGauge::new(
            "spillway_config_last_reload_successful",
            "1 if the last configuration reload (or the start) succeeded, 0 while a bad configuration waits to be fixed (the previous one stays).",
        )
        .expect("valid metric");
        config_reload_ok.set(1);
        registry
            .register(Box::new(config_reload_ok.clone()))
            .expect("metric names are unique");
        registry
            .register(Box::new(reloads.clone()))
            .expect("metric names are unique");
        registry
            .register(Box::new(config_loaded_at.clone()))
            .expect("metric names are unique");
        let adaptive_limit = IntGaugeVec::new(
            Opts::new(
                "spillway_adaptive_limit",
                "Adaptive concurrency: requests the rule lets in flight now.",
            ),
            &["rule"],
        )
        .expect("valid metric");
        let adaptive_baseline = prometheus::GaugeVec::new(
            Opts::new(
                "spillway_adaptive_baseline_seconds",
                "Adaptive concurrency: the upstream's learned no-load latency.",
            ),
            &["rule"],
        )
        .expect("valid metric");
        let adaptive_latency = prometheus::GaugeVec::new(
            Opts::new(
                "spillway_adaptive_latency_seconds",
                "Adaptive concurrency: the upstream's average latency in the last window.",
            ),
            &["rule"],
        )
        .expect("valid metric");
        for c in [
            Box::new(adaptive_limit.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(adaptive_baseline.clone()),
            Box::new(adaptive_latency.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        let upstream_errors = UpstreamError::ALL.map(|k| upstream.with_label_values(&[k.label()]));
        let upstream_discards = Unusable::ALL.map(|k| discarded.with_label_values(&[k.label()]));
        let upstream_responses = ["1xx", "2xx", "3xx", "4xx", "5xx", "other"]
            .map(|c| upstream_responses.with_label_values(&[c]));
        // Every reason shown at 0 before its first.
        let bad_requests = Reason::ALL.map(|r| bad_requests.with_label_values(&[r.label()]));
        Self {
            registry,
            requests,
            keys,
            overrides,
            overrides_reloads,
            evicted,
            overflow,
            sketch_refused,
            response_units,
            usage_unread,
            delay_queue,
            delayed,
            durations,
            upstream_errors,
            upstream_discards,
            send_timeouts,
            access_dropped,
            upstream_waiters,
            h2_held,
            h2_shed,
            refused_per_client: refused.with_label_values(&["per_client"]),
            closed_for_room,
            bad_requests,
            connections,
            draining,
            reports_ok: reports.with_label_values(&["ok"]),
            reports_failed: reports.with_label_values(&["error"]),
            report_bytes,
            control_plane_age,
            control_plane_stale,
            redis,
            redis_families,
            redis_shown: std::sync::Once::new(),
            upstream_responses,
            rule_limit,
            config_reloads_ok: reloads.with_label_values(&["ok"]),
            config_reloads_error: reloads.with_label_values(&["error"]),
            config_loaded_at,
            config_reload_ok,
            adaptive_limit,
            adaptive_baseline,
            adaptive_latency,
        }
    }

    #[inline]
    pub fn duration(&self, outcome: Outcome) -> &Histogram {
        &self.durations[outcome as usize]
    }

    /// Accounts for a configuration reload that applied a file (`true`) or refused one: the
    /// counter, and the gauge an alert holds on until a good file is back.
    pub fn reloaded(&self, ok: bool) {
        match ok {
            true => self.config_reloads_ok.inc(),
            false => self.config_reloads_error.inc(),
        }
        self.config_reload_ok.set(ok.into());
    }

    /// Registers the Redis families (once): called where a Redis store is made, so that a
    /// process that never had one exports none of their series.
    pub fn redis_in_use(&self) -> &RedisMetrics {
        self.redis_shown.call_once(|| {
            for f in &self.redis_families {
                self.registry
                    .register(Box::new(f.clone()))
                    .expect("metric names are unique");
            }
        });
        &self.redis
    }

    /// `spillway_upstream_responses_total` of `status`'s class (`other` past 599, which no
    /// standard defines: not the app's errors).
    #[inline]
    pub fn upstream_response(&self, status: http::StatusCode) -> &IntCounter {
        let class = usize::from(status.as_u16() / 100).clamp(1, 6) - 1;
        &self.upstream_responses[class]
    }

    /// Sets `spillway_rule_limit` to `rules`' local limits, then forgets rules no longer
    /// there (never all at once: a scrape meanwhile would see none).
    pub fn show_limits(&self, rules: &[crate::config::Rule]) {
        use crate::config::{Limit, Scope};
        let mut shown = Vec::new();
        for r in rules.iter().filter(|r| r.scope == Scope::Local) {
            let (unit, value) = match &r.limit {
                Limit::Rate { rate, .. } => ("per_second", rate.per_sec()),
                Limit::Concurrency(n) => ("in_flight", f64::from(n.get())),
                // Its limit moves: `spillway_adaptive_limit`.
                Limit::Adaptive(_) => continue,
            };
            self.rule_limit
                .with_label_values(&[&r.name.0, unit])
                .set(value);
            shown.push((r.name.0.as_str(), unit));
        }
        let stale: Vec<(String, String)> = prometheus::core::Collector::collect(&self.rule_limit)
            .iter()
            .flat_map(|family| family.get_metric())
            .filter_map(|m| {
                let label = |name: &str| {
                    m.get_label()
                        .iter()
                        .find(|l| l.name() == name)
                        .map(|l| l.value().to_string())
                };
                Some((label("rule")?, label("unit")?))
            })
            .filter(|(rule, unit)| !shown.contains(&(rule.as_str(), unit.as_str())))
            .collect();
        for (rule, unit) in stale {
            let _ = self.rule_limit.remove_label_values(&[&rule, &unit]);
        }
    }

    #[inline]
    pub fn upstream_error(&self, kind: UpstreamError) -> &IntCounter {
        &self.upstream_errors[kind as usize]
    }

    /// The counter of `reason`: `spillway_bad_requests_total{reason}`, or for the upstream's
    /// `spillway_upstream_errors_total{kind}`.
    pub fn refused(&self, reason: Reason) -> &IntCounter {
        match reason.slot() {
            Ok(at) => &self.bad_requests[at],
            Err(kind) => self.upstream_error(kind),
        }
    }

    /// The registry in Prometheus text format.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 * 1024);
        // Encoding into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Registers what every Spillway process exports in `registry`: `spillway_build_info` and the
/// standard `process_*` metrics (CPU, memory, descriptors, start time).
pub fn register_process(registry: &Registry) {
    let info = IntGaugeVec::new(
        Opts::new(
            "spillway_build_info",
            "1, labelled with the version and commit this binary was built from.",
        ),
        &["version", "commit"],
    )
    .expect("valid metric");
    info.with_label_values(&[env!("CARGO_PKG_VERSION"), env!("SPILLWAY_COMMIT")])
        .set(1);
    let _ = registry.register(Box::new(info));
    // The `prometheus` crate reads /proc: Linux only.
    #[cfg(target_os = "linux")]
    let _ = registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ));
}

/// Why an upstream connection was closed instead of reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unusable {
    /// Bytes were left after the response's framing.
    Leftover = 0,
    /// The upstream sent bytes while the connection was idle.
    Readable = 1,
    /// The upstream closed it (or it failed).
    Closed = 2,
}

impl Unusable {
    pub const ALL: [Unusable; 3] = [Unusable::Leftover, Unusable::Readable, Unusable::Closed];

    pub fn label(self) -> &'static str {
        match self {
            Unusable::Leftover => "leftover",
            Unusable::Readable => "unasked_bytes",
            Unusable::Closed => "closed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bad_request_reason_is_its_own_series_shown_at_zero_from_start() {
        let m = Metrics::new();
        for (i, reason) in Reason::ALL.into_iter().enumerate() {
            assert_eq!(
                reason.slot(),
                Ok(i),
                "{reason:?} is counted in its own place"
            );
        }
        let text = String::from_utf8(m.render()).unwrap();
        for reason in Reason::ALL {
            let series = format!(
                "spillway_bad_requests_total{{reason=\"{}\"}} 0\n",
                reason.label()
            );
            assert!(text.contains(&series), "{series} in\n{text}");
        }
        for (i, reason) in Reason::ALL.into_iter().enumerate() {
            for _ in 0..=i {
                m.refused(reason).inc();
            }
        }
        m.refused(Reason::Upstream(UpstreamError::Saturated)).inc();
        let text = String::from_utf8(m.render()).unwrap();
        for (i, reason) in Reason::ALL.into_iter().enumerate() {
            let series = format!(
                "spillway_bad_requests_total{{reason=\"{}\"}} {}\n",
                reason.label(),
                i + 1
            );
            assert!(text.contains(&series), "{series} in\n{text}");
        }
        assert!(text.contains("spillway_upstream_errors_total{kind=\"saturated\"} 1\n"));
    }

    /// The label names and the `le` bounds of every series `m` renders.
    fn labels_and_bounds(m: &Metrics) -> (std::collections::BTreeSet<String>, Vec<Vec<f64>>) {
        let mut labels = std::collections::BTreeSet::new();
        let mut bounds = Vec::new();
        for family in m.registry.gather() {
            for metric in family.get_metric() {
                labels.extend(metric.get_label().iter().map(|l| l.name().to_string()));
                if family.get_field_type() == prometheus::proto::MetricType::HISTOGRAM {
                    let h = metric.get_histogram();
                    bounds.push(h.get_bucket().iter().map(|b| b.upper_bound()).collect());
                }
            }
        }
        (labels, bounds)
    }

    #[test]
    fn no_label_a_scraper_sets_and_every_histogram_on_round_bounds() {
        let m = Metrics::for_service("shop");
        m.redis_in_use();
        m.duration(Outcome::Upstream).observe(0.01);
        m.redis.duration.observe(0.001);
        let (labels, bounds) = labels_and_bounds(&m);
        for taken in [
            "service",
            "namespace",
            "pod",
            "job",
            "instance",
            "endpoint",
            "container",
        ] {
            assert!(!labels.contains(taken), "{taken} in {labels:?}");
        }
        assert!(labels.contains(SERVICE_LABEL), "{labels:?}");
        assert_eq!(bounds.len(), 4, "three outcomes and Redis's");
        for b in bounds {
            assert_eq!(b, SECONDS_BUCKETS, "bounds of a histogram");
        }
        assert!(SECONDS_BUCKETS.windows(2).all(|w| w[0] < w[1]));
        assert_eq!((SECONDS_BUCKETS[0], SECONDS_BUCKETS[16]), (0.0001, 30.0));
    }

    #[test]
    fn redis_series_appear_only_once_a_redis_is_in_use() {
        let m = Metrics::for_service("shop");
        let text = String::from_utf8(m.render()).unwrap();
        assert!(!text.contains("spillway_redis_"), "{text}");
        m.redis_in_use().connected.set(1);
        m.redis_in_use();
        let text = String::from_utf8(m.render()).unwrap();
        assert!(text.contains("spillway_redis_connected{spillway_service=\"shop\"} 1\n"));
        assert!(text.contains("spillway_redis_breaker_state"), "{text}");
    }

    #[test]
    fn upstream_responses_count_by_class() {
        let m = Metrics::new();
        for code in [101, 200, 204, 302, 404, 429, 503, 599, 999] {
            m.upstream_response(http::StatusCode::from_u16(code).unwrap())
                .inc();
        }
        let text = String::from_utf8(m.render()).unwrap();
        for (class, n) in [
            ("1xx", 1),
            ("2xx", 2),
            ("3xx", 1),
            ("4xx", 2),
            ("5xx", 2),
            ("other", 1),
        ] {
            let series =
                format!("spillway_upstream_responses_total{{code_class=\"{class}\"}} {n}\n");
            assert!(text.contains(&series), "{series} in\n{text}");
        }
    }

    #[test]
    fn rule_limits_show_local_rules_and_forget_removed_ones() {
        let rules = |yaml: &str| {
            crate::config::Config::from_yaml(
                &format!("service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: {{ url: 'http://127.0.0.1:2' }}\nrules:\n{yaml}"),
                "t",
            )
            .unwrap()
            .rules
        };
        let m = Metrics::new();
        m.show_limits(&rules(
            "  - { name: a, key: [client_ip], limit: { rate: 30/m } }\n  - { name: b, key: [], limit: { concurrency: 8 } }\n  - { name: g, key: [client_ip], limit: { rate: 5/s }, scope: global }\n",
        ));
        let text = String::from_utf8(m.render()).unwrap();
        assert!(
            text.contains("spillway_rule_limit{rule=\"a\",unit=\"per_second\"} 0.5\n"),
            "{text}"
        );
        assert!(
            text.contains("spillway_rule_limit{rule=\"b\",unit=\"in_flight\"} 8\n"),
            "{text}"
        );
        assert!(
            !text.contains("rule_limit{rule=\"g\""),
            "a global rule's limit is the controller's: {text}"
        );
        m.show_limits(&rules("  - { name: c, key: [], limit: { rate: 2/s } }\n"));
        let text = String::from_utf8(m.render()).unwrap();
        assert!(
            text.contains("spillway_rule_limit{rule=\"c\",unit=\"per_second\"} 2\n"),
            "{text}"
        );
        assert!(
            !text.contains("rule_limit{rule=\"a\""),
            "a removed rule is forgotten: {text}"
        );
    }
}
