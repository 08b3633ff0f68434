//! The controller (one per region): sums what zones (or hosts, for small fleets) report per
//! (service, rule, key), and answers each report with the drop ratios of its services.
//!
//! Soft state only: a restarted controller knows nothing, and the next round of reports
//! rebuilds everything, with no operator. The accumulator sits behind one mutex: it is taken
//! once per report (a few per second per zone), never on a request path, never across an await.

use std::net::SocketAddr;
use std::sync::Arc;

use http::{Method, Request, StatusCode};
use hyper::body::Incoming;
use prometheus::{GaugeVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tokio::sync::watch;

use super::server::{self, Body, Running};
use super::SharedAccumulator;

/// How to run a controller.
#[derive(Debug, Clone)]
pub struct ControllerOptions {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// Reports must carry this bearer token when set.
    pub token: server::Token,
}

struct State {
    acc: SharedAccumulator,
    token: server::Token,
    registry: Registry,
    reports: IntCounterVec,
    sources: IntGauge,
    conflicts: IntCounter,
    refused: IntCounter,
    offered: GaugeVec,
    admitted: GaugeVec,
    limit: GaugeVec,
    ratio: GaugeVec,
}

impl State {
    async fn report(&self, req: Request<Incoming>) -> http::Response<Body> {
        let report = match server::receive_report(req, &self.token, &self.reports).await {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        let mut services: Vec<&str> = report.entries.iter().map(|e| e.service.as_str()).collect();
        services.sort_unstable();
        services.dedup();
        let now = self.acc.now();
        let reply = {
            let mut acc = self.acc.lock();
            acc.expire(now);
            match server::record(acc, &report, now, &self.reports) {
                Ok(acc) => acc.reply(&services),
                Err(resp) => return resp,
            }
        };
        server::json(StatusCode::OK, &reply)
    }

    fn state(&self) -> http::Response<Body> {
        let mut view = {
            let mut acc = self.acc.lock();
            acc.expire(self.acc.now());
            acc.view(None)
        };
        view.sort_by(|a, b| (&a.service, &a.rule, &a.key).cmp(&(&b.service, &b.rule, &b.key)));
        server::json(StatusCode::OK, &serde_json::json!({ "keys": view }))
    }

    /// What the status page shows: per (service, rule) totals with the heaviest keys, and
    /// the sources reporting with the age of their last report.
    fn ui_state(&self) -> http::Response<Body> {
        let (view, sources) = {
            let mut acc = self.acc.lock();
            let now = self.acc.now();
            acc.expire(now);
            (acc.view(None), acc.source_ages(now))
        };
        let mut rules: std::collections::BTreeMap<(String, String), Vec<&crate::control::KeyView>> =
            Default::default();
        for v in &view {
            rules
                .entry((v.service.clone(), v.rule.clone()))
                .or_default()
                .push(v);
        }
        let rules: Vec<serde_json::Value> = rules
            .into_iter()
            .map(|((service, rule), mut keys)| {
                let offered: f64 = keys.iter().map(|k| k.offered_rps).sum();
                let admitted: f64 = keys.iter().map(|k| k.admitted_rps).sum();
                let dropped: f64 = keys.iter().map(|k| k.offered_rps * k.ratio).sum();
                // What the limit lets through at this demand: the target of `admitted`.
                let allowed: f64 = keys.iter().map(|k| k.offered_rps.min(k.limit_rps)).sum();
                let limit = keys
                    .iter()
                    .find(|k| k.key.is_some())
                    .map_or(0.0, |k| k.limit_rps);
                keys.sort_by(|a, b| b.offered_rps.total_cmp(&a.offered_rps));
                let heaviest: Vec<serde_json::Value> = keys
                    .iter()
                    .filter(|k| k.key.is_some())
                    .take(10)
                    .map(|k| {
                        serde_json::json!({
                            "key": k.key, "offered_rps": k.offered_rps,
                            "admitted_rps": k.admitted_rps, "ratio": k.ratio, "sources": k.sources,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "service": service, "rule": rule, "kind": "global",
                    "limit": format!("{limit:.1}/s per key"),
                    "offered_rps": offered, "admitted_rps": admitted, "limit_rps": allowed,
                    "drop_ratio": if offered > 0.0 { dropped / offered } else { 0.0 },
                    "keys": keys.len(), "heaviest": heaviest,
                })
            })
            .collect();
        let sources: Vec<serde_json::Value> = sources
            .into_iter()
            .map(|(name, age)| serde_json::json!({ "name": name, "age_s": age }))
            .collect();
        server::json(
            StatusCode::OK,
            &serde_json::json!({ "role": "controller", "rules": rules, "sources": sources }),
        )
    }

    /// Per-rule gauges (never per key), refreshed at scrape time.
    fn metrics(&self) -> Vec<u8> {
        let (view, sources, conflicts, refused) = {
            let mut acc = self.acc.lock();
            acc.expire(self.acc.now());
            (acc.view(None), acc.sources(), acc.conflicts, acc.refused)
        };
        self.sources.set(sources as i64);
        self.conflicts
            .inc_by(conflicts.saturating_sub(self.conflicts.get()));
        self.refused
            .inc_by(refused.saturating_sub(self.refused.get()));
        for g in [&self.offered, &self.admitted, &self.limit, &self.ratio] {
            g.reset();
        }
        let mut per_rule: std::collections::BTreeMap<(&str, &str), (f64, f64, f64, f64)> =
            Default::default();
        for v in &view {
            let e = per_rule
                .entry((&v.service, &v.rule))
                .or_insert((0.0, 0.0, 0.0, 0.0));
            e.0 += v.offered_rps;
            e.1 += v.admitted_rps;
            if v.key.is_some() {
                e.2 = v.limit_rps;
            }
            // Expected dropped rate, to turn into the rule's overall drop ratio.
            e.3 += v.offered_rps * v.ratio;
        }
        for ((service, rule), (offered, admitted, limit, dropped)) in per_rule {
            let l = [service, rule];
            self.offered.with_label_values(&l).set(offered);
            self.admitted.with_label_values(&l).set(admitted);
            self.limit.with_label_values(&l).set(limit);
            let ratio = if offered > 0.0 {
                dropped / offered
            } else {
                0.0
            };
            self.ratio.with_label_values(&l).set(ratio);
        }
        server::render(&self.registry)
    }
}

fn gauge(registry: &Registry, name: &str, help: &str) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), &["service", "rule"]).expect("valid metric");
    registry.register(Box::new(g.clone())).expect("unique");
    g
}

/// Binds the listeners and starts serving.
pub async fn start(opts: ControllerOptions) -> std::io::Result<Running> {
    let listener = server::bind(opts.listen, "controller").await?;
    let admin = server::bind(opts.admin, "admin").await?;
    let (addr, admin_addr) = (listener.local_addr()?, admin.local_addr()?);
    let registry = Registry::new();
    let reports = IntCounterVec::new(
        Opts::new(
            "spillway_controller_reports_total",
            "Reports received, by result (ok, unauthorized, malformed, invalid); entries_dropped counts invalid entries dropped from reports that were kept.",
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
    let state = Arc::new(State {
        acc: SharedAccumulator::default(),
        token: opts.token,
        offered: gauge(
            &registry,
            "spillway_controller_offered_rps",
            "Offered requests/s per rule, fleet-wide.",
        ),
        admitted: gauge(
            &registry,
            "spillway_controller_admitted_rps",
            "Admitted requests/s per rule, fleet-wide.",
        ),
        limit: gauge(
            &registry,
            "spillway_controller_limit_rps",
            "The rule's limit per key, requests/s.",
        ),
        ratio: gauge(
            &registry,
            "spillway_controller_drop_ratio",
            "Share of the rule's offered load being dropped.",
        ),
        registry,
        reports,
        sources,
        conflicts,
        refused,
    });
    let (stop, stopped) = watch::channel(false);
    let s = state.clone();
    let api = tokio::spawn(server::serve(listener, stopped.clone(), move |req| {
        let s = s.clone();
        async move {
            match (req.method(), req.uri().path()) {
                (&Method::POST, "/v1/report") => s.report(req).await,
                (&Method::GET, "/v1/state") => s.state(),
                _ => server::error(
                    StatusCode::NOT_FOUND,
                    "not found; try POST /v1/report or GET /v1/state",
                ),
            }
        }
    }));
    let s = state.clone();
    let admin_task = tokio::spawn(server::serve(admin, stopped, move |req| {
        let s = s.clone();
        async move {
            match req.uri().path() {
                "/ui" => crate::ui::page(),
                "/ui/state.json" => s.ui_state(),
                path => server::admin_route(path, || s.metrics()),
            }
        }
    }));
    Ok(Running::new(addr, admin_addr, stop, vec![api, admin_task]))
}
