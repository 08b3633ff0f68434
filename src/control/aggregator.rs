//! The zone aggregator: sums its hosts' reports per (service, rule, key), forwards the zone's
//! sums to the controller every interval, and answers hosts with the controller's last ratios.
//!
//! It keeps only soft state (hosts silent for three of their intervals are forgotten) and can
//! restart at any time. Its replies say how old the relayed ratios are, so a dead controller
//! makes the proxies stale (and fail open) even while the aggregator itself answers. The
//! accumulator's mutex is taken once per report and once per forward, never across an await.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{Method, Request, StatusCode, Uri};
use hyper::body::Incoming;
use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};
use tokio::sync::watch;

use super::reporter::{json_client, post_report, JsonClient};
use super::server::{self, Body, Running};
use super::{Reply, Report, SharedAccumulator, VERSION};

/// How to run an aggregator.
#[derive(Debug, Clone)]
pub struct AggregatorOptions {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// The controller's base URL, `http://host:port`.
    pub controller: Uri,
    pub zone: String,
    /// How often the zone's sums are forwarded.
    pub interval: Duration,
    /// Hosts must present it, and it is presented to the controller, when set.
    pub token: server::Token,
}

/// The controller's last reply and when it came.
struct Relayed {
    reply: Reply,
    at: tokio::time::Instant,
}

struct State {
    acc: SharedAccumulator,
    relayed: ArcSwap<Relayed>,
    opts: AggregatorOptions,
    url: Uri,
    client: JsonClient,
    registry: Registry,
    reports: IntCounterVec,
    hosts: IntGauge,
    forwards: IntCounterVec,
    forward_seconds: Histogram,
}

impl State {
    async fn report(&self, req: Request<Incoming>) -> http::Response<Body> {
        let report = match server::receive_report(req, &self.opts.token, &self.reports).await {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        if let Err(resp) = server::record(self.acc.lock(), &report, self.acc.now(), &self.reports) {
            return resp;
        }
        let relayed = self.relayed.load();
        let ratios = relayed
            .reply
            .ratios
            .iter()
            .filter(|r| report.entries.iter().any(|e| e.service == r.service))
            .cloned()
            .collect();
        let reply = Reply {
            version: VERSION,
            age_ms: relayed.at.elapsed().as_millis() as u64,
            ratios,
        };
        server::json(StatusCode::OK, &reply)
    }

    /// Forwards the zone's sums and keeps the controller's reply, every interval.
    async fn forward_loop(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.opts.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            let interval_ms = self.opts.interval.as_millis() as u64;
            let (entries, hosts) = {
                let mut acc = self.acc.lock();
                acc.expire(self.acc.now());
                (acc.as_entries(interval_ms), acc.sources())
            };
            self.hosts.set(hosts as i64);
            let report = Report {
                version: VERSION,
                source: format!("zone:{}", self.opts.zone),
                zone: self.opts.zone.clone(),
                interval_ms,
                entries,
            };
            let started = tokio::time::Instant::now();
            let token = self.opts.token.get();
            match post_report(
                &self.client,
                &self.url,
                token.as_deref().map(Vec::as_slice),
                &report,
                self.opts.interval,
            )
            .await
            {
                Ok((reply, _)) => {
                    self.forward_seconds
                        .observe(started.elapsed().as_secs_f64());
                    self.forwards.with_label_values(&["ok"]).inc();
                    self.relayed.store(Arc::new(Relayed { reply, at: started }));
                }
                Err(e) => {
                    self.forwards.with_label_values(&["error"]).inc();
                    tracing::debug!(error = %e, "forward to the controller failed");
                }
            }
        }
    }
}

/// Binds the listeners and starts serving and forwarding.
pub async fn start(opts: AggregatorOptions) -> std::io::Result<Running> {
    let listener = server::bind(opts.listen, "aggregator").await?;
    let admin = server::bind(opts.admin, "admin").await?;
    let (addr, admin_addr) = (listener.local_addr()?, admin.local_addr()?);
    let authority = opts.controller.authority().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "--controller {}: expected http://host:port",
                opts.controller
            ),
        )
    })?;
    let url: Uri = format!("http://{authority}/v1/report")
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{e}")))?;
    let registry = Registry::new();
    let reports = IntCounterVec::new(
        Opts::new(
            "spillway_aggregator_reports_total",
            "Host reports received, by result (ok, unauthorized, malformed, invalid); entries_dropped counts invalid entries dropped from reports that were kept.",
        ),
        &["result"],
    )
    .expect("valid metric");
    let hosts =
        IntGauge::new("spillway_aggregator_hosts", "Hosts reporting now.").expect("valid metric");
    let forwards = IntCounterVec::new(
        Opts::new(
            "spillway_aggregator_forwards_total",
            "Zone reports forwarded to the controller, by result (ok, error).",
        ),
        &["result"],
    )
    .expect("valid metric");
    let forward_seconds = Histogram::with_opts(HistogramOpts::new(
        "spillway_aggregator_forward_seconds",
        "Round trip of a forward to the controller.",
    ))
    .expect("valid metric");
    registry
        .register(Box::new(reports.clone()))
        .expect("unique");
    registry.register(Box::new(hosts.clone())).expect("unique");
    registry
        .register(Box::new(forwards.clone()))
        .expect("unique");
    registry
        .register(Box::new(forward_seconds.clone()))
        .expect("unique");
    let state = Arc::new(State {
        acc: SharedAccumulator::default(),
        relayed: ArcSwap::from_pointee(Relayed {
            reply: Reply {
                version: VERSION,
                age_ms: 0,
                ratios: Vec::new(),
            },
            at: tokio::time::Instant::now(),
        }),
        opts,
        url,
        client: json_client(),
        registry,
        reports,
        hosts,
        forwards,
        forward_seconds,
    });
    let (stop, stopped) = watch::channel(false);
    let forward = tokio::spawn(state.clone().forward_loop(stopped.clone()));
    let s = state.clone();
    let api = tokio::spawn(server::serve(listener, stopped.clone(), move |req| {
        let s = s.clone();
        async move {
            match (req.method(), req.uri().path()) {
                (&Method::POST, "/v1/report") => s.report(req).await,
                _ => server::error(StatusCode::NOT_FOUND, "not found; try POST /v1/report"),
            }
        }
    }));
    let s = state;
    let admin_task = tokio::spawn(server::serve(admin, stopped, move |req| {
        let s = s.clone();
        async move { server::admin_route(req.uri().path(), || server::render(&s.registry)) }
    }));
    Ok(Running::new(
        addr,
        admin_addr,
        stop,
        vec![api, admin_task, forward],
    ))
}
