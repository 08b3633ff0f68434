//! The controller (one per region, or per service shard): sums what aggregator replicas (or
//! hosts, for small fleets) report per (service, rule, key), smooths the sums, and answers each
//! report with the drop ratios its sender may see.
//!
//! Soft state only: a restarted controller knows nothing, and the next round of reports
//! rebuilds everything, with no operator. Its state (`/v1/state`, `/ui/state.json`) holds keys,
//! often API keys and client addresses: it is shown only to a token that may see them. The
//! accumulator sits behind one mutex: taken once per report (twice for a reply that waits,
//! at most `STEP_MATCH_WAIT`, for a step down to match a step up), never on a request path,
//! never across an await.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, StatusCode};
use hyper::body::Incoming;
use prometheus::{GaugeVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tokio::sync::watch;

use super::auth::{Credentials, Principal};
use super::server::{self, Body, Running};
use super::{Accumulator, Shared, SourceRefusal};

/// How to run a controller.
#[derive(Clone)]
pub struct ControllerOptions {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// Who may report and read state; open (no token) only on loopback or with `insecure`.
    pub credentials: Credentials,
    /// Serve HTTPS with this certificate.
    pub tls: Option<super::tls::ServerTls>,
    /// Serve a non-loopback address without a token anyway.
    pub insecure: bool,
    /// The time constant of the smoothing of the fleet's sums.
    pub smoothing: std::time::Duration,
    /// The least time after a start during which replies say the controller is warming up
    /// ([`super::WARMING_HEADER`]); never less than two of the longest intervals reported.
    pub warm_up: std::time::Duration,
}

impl ControllerOptions {
    /// Loopback-style defaults: no token, no TLS, 1 s smoothing, a 2 s warm-up.
    pub fn new(listen: SocketAddr, admin: SocketAddr) -> Self {
        ControllerOptions {
            listen,
            admin,
            credentials: Credentials::open(),
            tls: None,
            insecure: false,
            smoothing: std::time::Duration::from_secs(1),
            warm_up: std::time::Duration::from_secs(2),
        }
    }
}

struct State {
    acc: Shared<Accumulator>,
    /// The least warm-up, in seconds of `acc`'s clock (which starts with the controller).
    warm_up: f64,
    /// The longest `interval_ms` reported since the start.
    longest_ms: std::sync::atomic::AtomicU64,
    warming: IntGauge,
    credentials: Credentials,
    registry: Registry,
    reports: IntCounterVec,
    reads: IntCounterVec,
    sources: IntGauge,
    tracked: IntGauge,
    ratios_cut: IntGauge,
    conflicts: IntCounter,
    refused: IntCounter,
    /// The principals reading state now: one read at a time each.
    reading: dashmap::DashSet<String>,
    /// A report's step down was taken (see [`STEP_MATCH_WAIT`]).
    stepped_down: tokio::sync::Notify,
}

/// The most a reply to a report with a step up left half unmatched or more waits for a step
/// down (and at most a quarter of the report's interval): the two halves of load moving
/// between proxies come at once, but through different aggregators.
const STEP_MATCH_WAIT: Duration = Duration::from_millis(200);

/// A principal's one state read in progress; the next may start when it is dropped.
struct Reading<'a> {
    state: &'a State,
    who: String,
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.state.reading.remove(&self.who);
    }
}

impl State {
    async fn report(&self, req: Request<Incoming>) -> http::Response<Body> {
        // The step wait below counts from here (see the aggregator's).
        let arrived = tokio::time::Instant::now();
        let wire2 = server::speaks_wire2(&req);
        let (report, principal, turn) =
            match server::receive_report(req, &self.credentials, &self.reports).await {
                Ok(r) => r,
                Err(resp) => return resp,
            };
        // Owned: the report and its body's turn are let go before any wait (its bytes count
        // against the bodies' budget until it is recorded).
        let services: Option<Vec<String>> = server::reply_services(&report, &principal)
            .map(|s| s.into_iter().map(str::to_string).collect());
        let interval_ms = report.interval_ms;
        let now = self.acc.now();
        let warming = self.warming(interval_ms, now);
        let light = report.entries.len() <= super::HEAVY_ENTRIES;
        let down = self.acc.with(light, |acc| {
            acc.settle(warming);
            match acc.record(&report, principal.owner(&report), now) {
                Ok(()) => self.reports.with_label_values(&["ok"]).inc(),
                // Counted already: the sender (a retry, or a replay) gets the usual reply.
                Err(SourceRefusal::Duplicate(_)) => {
                    self.reports.with_label_values(&["duplicate"]).inc()
                }
                Err(refusal) => {
                    return Err(Box::new(server::source_refused(&refusal, &self.reports)))
                }
            }
            let (unmatched, stepped_down) = acc.steps_seen();
            if stepped_down {
                self.stepped_down.notify_waiters();
            }
            if warming && !wire2 {
                // A previous release cannot read the warming header and would take these
                // ratios, computed on part of the fleet, as fresh: it gets none, and keeps
                // (and ages) the ones it holds, as on any failed report.
                return Err(Box::new(server::warming_refused()));
            }
            // Waited on from before the lock is let go: no step down is missed. Not for a
            // reply that carries no ratios (a forward's later parts).
            let ratios = services.as_ref().is_none_or(|s| !s.is_empty());
            Ok((unmatched && ratios).then(|| self.stepped_down.notified()))
        });
        let down = match down {
            Ok(down) => down,
            Err(resp) => return *resp,
        };
        drop((report, turn));
        let mut now = now;
        if let Some(down) = down {
            // A step up whose step down (load moving between proxies) is on its way through
            // another zone's aggregator: its reply waits a moment for it, so that the proxy
            // the load moved to is not held to its old share for a whole interval more (any
            // step down ends the wait: the sums are read again then).
            let wait = STEP_MATCH_WAIT.min(Duration::from_millis(interval_ms / 4));
            let _ = tokio::time::timeout_at(arrived + wait, down).await;
            now = self.acc.now();
        }
        // Zone sums get every ratio: one serialization per snapshot, not per reply (a large
        // one, off the workers).
        let reply = self.acc.with(services.is_some(), |acc| match services {
            None => Err(acc.reply_all(now, wire2)),
            Some(s) => {
                let s: Vec<&str> = s.iter().map(String::as_str).collect();
                Ok(acc.reply(Some(&s), now))
            }
        });
        let reply = match reply {
            Ok(reply) => reply,
            Err(all) => {
                let mut resp = server::json_bytes(StatusCode::OK, all);
                resp.headers_mut().insert(
                    super::WIRE_HEADER,
                    http::HeaderValue::from_static(super::WIRE),
                );
                return server::warming(resp, warming);
            }
        };
        server::warming(server::reply(reply, wire2), warming)
    }

    /// Whether, `now` seconds after the start, replies are still not authoritative: before
    /// the warm-up, and before two of the longest intervals reported (`interval_ms` the
    /// report's), so that every source has been heard and the sums have settled.
    fn warming(&self, interval_ms: u64, now: f64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let longest = self
            .longest_ms
            .fetch_max(interval_ms, Relaxed)
            .max(interval_ms);
        let warming = now < self.warm_up.max(2.0 * longest as f64 / 1000.0);
        self.warming.set(i64::from(warming));
        warming
    }

    /// Who may read state: a service's token sees that service (`Some`), the aggregators',
    /// admin or shared token everything; else the 401 to answer, or 429 while the same
    /// principal's last read is still being served (one at a time each: readers in a loop
    /// cannot multiply what state costs).
    #[allow(clippy::result_large_err)]
    fn reader<B>(
        &self,
        req: &Request<B>,
    ) -> Result<(Option<String>, Reading<'_>), http::Response<Body>> {
        let principal = server::authenticate(req, &self.credentials, &self.reads)?;
        if principal == Principal::Metrics {
            return Err(server::error(
                StatusCode::FORBIDDEN,
                "the metrics token reads /metrics only",
            ));
        }
        self.reads.with_label_values(&[principal.kind()]).inc();
        let only = match &principal {
            Principal::Service(s) => Some(s.to_string()),
            _ => None,
        };
        let who = principal.id();
        if !self.reading.insert(who.clone()) {
            let mut resp = server::error(
                StatusCode::TOO_MANY_REQUESTS,
                "a state read of this token is in progress; read again when it ends",
            );
            resp.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
            return Err(resp);
        }
        Ok((only, Reading { state: self, who }))
    }

    /// The state readers see, from the snapshot: the lock is held for two reference counts.
    fn view(&self) -> super::StateView {
        let now = self.acc.now();
        self.acc.with(true, |acc| acc.state(now))
    }

    fn state<B>(&self, req: &Request<B>) -> http::Response<Body> {
        let (only, _reading) = match self.reader(req) {
            Ok(o) => o,
            Err(resp) => return resp,
        };
        let view = self.view();
        let rules: Vec<&super::RuleState> = view
            .rules
            .iter()
            .filter(|r| only.as_deref().is_none_or(|s| r.service == s))
            .collect();
        let mut keys: Vec<&crate::control::KeyView> =
            rules.iter().flat_map(|r| r.heaviest.iter()).collect();
        keys.sort_by(|a, b| (&a.service, &a.rule, &a.key).cmp(&(&b.service, &b.rule, &b.key)));
        // Each rule's heaviest keys, and how many it has in all.
        let counts: Vec<serde_json::Value> = rules
            .iter()
            .map(|r| {
                serde_json::json!({
                    "service": r.service, "rule": r.rule, "keys": r.keys, "shown": r.heaviest.len(),
                })
            })
            .collect();
        server::json(
            StatusCode::OK,
            &serde_json::json!({ "keys": keys, "rules": counts }),
        )
    }

    /// What the status page shows: per (service, rule) totals with the heaviest keys, and
    /// the sources reporting with the age of their last report.
    #[cfg(feature = "ui")]
    fn ui_state<B>(&self, req: &Request<B>) -> http::Response<Body> {
        let (only, _reading) = match self.reader(req) {
            Ok(o) => o,
            Err(resp) => return resp,
        };
        let view = self.view();
        // A service's token does not learn which other hosts report.
        let sources: &[(String, f64)] = if only.is_some() { &[] } else { &view.sources };
        let rules: Vec<serde_json::Value> = view
            .rules
            .iter()
            .filter(|r| only.as_deref().is_none_or(|s| r.service == s))
            .map(|r| {
                let (service, rule) = (&r.service, &r.rule);
                let (offered, admitted, dropped) = (r.offered_rps, r.admitted_rps, r.dropped_rps);
                // What the limit lets through at this demand: the target of `admitted`.
                let allowed = r.allowed_rps;
                let limit = r.limit_rps;
                let heaviest: Vec<serde_json::Value> = r
                    .heaviest
                    .iter()
                    .filter(|k| k.key.is_some())
                    .take(10)
                    .map(|k| {
                        serde_json::json!({
                            "key": k.key.as_deref().map(shorten), "offered_rps": k.offered_rps,
                            "admitted_rps": k.admitted_rps, "ratio": k.ratio, "sources": k.sources,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "service": service, "rule": rule, "kind": "global",
                    "limit": format!("{limit:.1}/s per key"),
                    "offered_rps": offered, "admitted_rps": admitted, "limit_rps": allowed,
                    "drop_ratio": if offered > 0.0 { dropped / offered } else { 0.0 },
                    "keys": r.keys, "heaviest": heaviest,
                })
            })
            .collect();
        let sources: Vec<serde_json::Value> = sources
            .iter()
            .map(|(name, age)| serde_json::json!({ "name": name, "age_s": age }))
            .collect();
        server::json(
            StatusCode::OK,
            &serde_json::json!({ "role": "controller", "rules": rules, "sources": sources }),
        )
    }

    /// The process's metrics, and per-rule gauges (never per key) refreshed at scrape time for
    /// the rules `who` may read: every service's for the admin (or with no tokens), a
    /// service's own for its token, none without a token (the admin port is not
    /// authenticated: rule names and rates are a tenant's to see, not a stranger's).
    fn metrics<B>(&self, req: &Request<B>) -> Vec<u8> {
        let who = self.credentials.authenticate(req.headers());
        // From the ratio snapshot's per-rule totals: a scrape never walks every key under the
        // lock (the admin port needs no token).
        let now = self.acc.now();
        let (totals, sources, conflicts, refused, tracked, cut) = self.acc.with(true, |acc| {
            (
                acc.rule_totals(now),
                acc.sources(),
                acc.conflicts,
                acc.refused,
                acc.tracked(),
                acc.ratios_cut,
            )
        });
        self.sources.set(sources as i64);
        self.tracked.set(tracked as i64);
        self.conflicts
            .inc_by(conflicts.saturating_sub(self.conflicts.get()));
        self.refused
            .inc_by(refused.saturating_sub(self.refused.get()));
        self.ratios_cut.set(cut as i64);
        let mut out = server::render(&self.registry);
        let visible = |service: &str| match &who {
            Some(
                Principal::Open | Principal::Shared(_) | Principal::Admin | Principal::Metrics,
            ) => true,
            Some(p @ Principal::Service(_)) => p.may_report(service),
            Some(Principal::Aggregator) | None => false,
        };
        // A registry of this scrape's own: two scrapes by different principals never see each
        // other's rows.
        let rules = Registry::new();
        let offered = gauge(
            &rules,
            "spillway_controller_offered_requests_per_second",
            "Offered requests/s per rule, fleet-wide.",
        );
        let admitted = gauge(
            &rules,
            "spillway_controller_admitted_requests_per_second",
            "Admitted requests/s per rule, fleet-wide.",
        );
        let limit = gauge(
            &rules,
            "spillway_controller_limit_requests_per_second",
            "The rule's limit per key, requests/s.",
        );
        let drop_ratio = gauge(
            &rules,
            "spillway_controller_drop_ratio",
            "Share of the rule's offered load being dropped.",
        );
        for t in totals.iter().filter(|t| visible(&t.service)) {
            let l = [&*t.service, &*t.rule];
            offered.with_label_values(&l).set(t.offered);
            admitted.with_label_values(&l).set(t.admitted);
            limit.with_label_values(&l).set(t.limit);
            let ratio = if t.offered > 0.0 {
                t.dropped / t.offered
            } else {
                0.0
            };
            drop_ratio.with_label_values(&l).set(ratio);
        }
        out.extend(server::render(&rules));
        out
    }
}

/// A key as the status page shows it: long ones cut, so that the page shows which key it is
/// without handing the whole of an API key to whoever looks over a shoulder.
#[cfg(feature = "ui")]
fn shorten(key: &str) -> String {
    if key.chars().count() <= 12 {
        return key.to_string();
    }
    let head: String = key.chars().take(8).collect();
    format!("{head}…")
}

fn gauge(registry: &Registry, name: &str, help: &str) -> GaugeVec {
    // `spillway_service`, as the proxies label theirs: a scraper's own `service` would rename
    // a `service` label of ours.
    let g = GaugeVec::new(
        Opts::new(name, help),
        &[crate::metrics::SERVICE_LABEL, "rule"],
    )
    .expect("valid metric");
    registry.register(Box::new(g.clone())).expect("unique");
    g
}

/// Binds the listeners and starts serving.
pub async fn start(opts: ControllerOptions) -> std::io::Result<Running> {
    let insecure = server::check_exposure(
        "controller",
        &[opts.listen, opts.admin],
        &opts.credentials,
        opts.insecure,
    )?;
    let listener = server::bind(opts.listen, "controller").await?;
    let admin = server::bind(opts.admin, "admin").await?;
    server::room_for_connections(&listener, "controller");
    let (addr, admin_addr) = (listener.local_addr()?, admin.local_addr()?);
    let registry = Registry::new();
    crate::metrics::register_process(&registry);
    let reports = IntCounterVec::new(
        Opts::new(
            "spillway_controller_reports_total",
            "Reports received, by result (ok, duplicate, unauthorized, forbidden, foreign, throttled, too_soon, held, malformed, invalid); entries_dropped counts invalid entries dropped from reports that were kept.",
        ),
        &["result"],
    )
    .expect("valid metric");
    let sources = IntGauge::new(
        "spillway_controller_sources",
        "Zones or hosts reporting now.",
    )
    .expect("valid metric");
    let conflicts = IntCounter::new(
        "spillway_controller_limit_conflicts_total",
        "Times reporters disagreed on a rule's limit (the smallest applies).",
    )
    .expect("valid metric");
    registry
        .register(Box::new(reports.clone()))
        .expect("unique");
    registry
        .register(Box::new(sources.clone()))
        .expect("unique");
    let reads = IntCounterVec::new(
        Opts::new(
            "spillway_controller_state_reads_total",
            "Reads of /v1/state and /ui/state.json, by who read (service, aggregator, admin, shared, open) or unauthorized.",
        ),
        &["by"],
    )
    .expect("valid metric");
    registry.register(Box::new(reads.clone())).expect("unique");
    let tracked = IntGauge::new(
        "spillway_controller_tracked",
        "(source, key) values held now.",
    )
    .expect("valid metric");
    registry
        .register(Box::new(tracked.clone()))
        .expect("unique");
    let ratios_cut = IntGauge::new(
        "spillway_controller_ratios_cut",
        "Drop ratios left out of replies now: past 10 000 for one service or 100 000 in all (the highest travel).",
    )
    .expect("valid metric");
    registry
        .register(Box::new(ratios_cut.clone()))
        .expect("unique");
    server::insecure_gauge(&registry, "controller", insecure);
    let refused = IntCounter::new(
        "spillway_controller_entries_refused_total",
        "Report entries dropped because the controller holds its maximum of rates (a flood).",
    )
    .expect("valid metric");
    registry
        .register(Box::new(conflicts.clone()))
        .expect("unique");
    registry
        .register(Box::new(refused.clone()))
        .expect("unique");
    let warming = IntGauge::new(
        "spillway_controller_warming",
        "1 while the controller is warming up after its start: its replies say their ratios are not authoritative yet.",
    )
    .expect("valid metric");
    registry
        .register(Box::new(warming.clone()))
        .expect("unique");
    warming.set(1);
    let state = Arc::new(State {
        acc: Shared::new(Accumulator::new(opts.smoothing.as_secs_f64())),
        warm_up: opts.warm_up.as_secs_f64(),
        longest_ms: Default::default(),
        warming,
        credentials: opts.credentials,
        reads,
        tracked,
        ratios_cut,

        reading: Default::default(),
        stepped_down: tokio::sync::Notify::new(),
        registry,
        reports,
        sources,
        conflicts,
        refused,
    });
    let (stop, stopped) = watch::channel(false);
    let s = state.clone();
    let api = tokio::spawn(server::serve(
        listener,
        stopped.clone(),
        opts.tls.clone(),
        move |req| {
            let s = s.clone();
            async move {
                match (req.method(), req.uri().path()) {
                    (&Method::POST, "/v1/report") => s.report(req).await,
                    (&Method::GET, "/v1/state") => s.state(&req),
                    // Also here, so that with TLS the page's token travels encrypted.
                    #[cfg(feature = "ui")]
                    (&Method::GET, "/ui") => crate::ui::page(),
                    #[cfg(feature = "ui")]
                    (&Method::GET, "/ui/state.json") => s.ui_state(&req),
                    _ => server::error(
                        StatusCode::NOT_FOUND,
                        "not found; try POST /v1/report or GET /v1/state",
                    ),
                }
            }
        },
    ));
    let s = state.clone();
    // The admin port stays plain HTTP, for Prometheus; the state it serves needs a token.
    let admin_task = tokio::spawn(server::serve(admin, stopped, None, move |req| {
        let s = s.clone();
        async move {
            match req.uri().path() {
                #[cfg(feature = "ui")]
                "/ui" => crate::ui::page(),
                #[cfg(feature = "ui")]
                "/ui/state.json" => s.ui_state(&req),
                path => server::admin_route(path, || s.metrics(&req)),
            }
        }
    }));
    Ok(Running::new(addr, admin_addr, stop, vec![api, admin_task]))
}
