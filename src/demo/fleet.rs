//! `spillway demo --fleet`: the whole control plane on loopback.
//!
//! A controller, three aggregators (two replicas for zone eu-1, one for eu-2), three proxies
//! (two in eu-1, each reporting to its own replica, one in eu-2) in front of one app, and one API key offered unevenly across the proxies (6:2:1): at the limit for 10 s,
//! then at three times the limit. Every second it prints what each proxy admitted and the
//! fleet's total against the limit, with the controller's drop ratio.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

pub use super::Tally;
use super::{offer, offer_closed, start_upstream};
use crate::control::server::Running;
use crate::control::{aggregator, controller};
use crate::{Config, Sidecar};

const LIMIT: u64 = 300;
const SHARES: [u64; 3] = [6, 2, 1];
const STEP_AT: Duration = Duration::from_secs(10);
const RUN_FOR: Duration = Duration::from_secs(30);

fn proxy_config(
    upstream: std::net::SocketAddr,
    aggregator: std::net::SocketAddr,
    n: usize,
    limit: u64,
    interval: Duration,
) -> String {
    format!(
        r#"
service: shop
listen: 127.0.0.1:0
upstream: http://{upstream}
admin: 127.0.0.1:0
# A handful of clients: no need to ask the system for descriptors for 10 000.
limits: {{ max_connections: 100 }}
control_plane:
  url: http://{aggregator}
  report_interval: {}ms
  stale_after: {}ms
  decay: 5s
  host: proxy-{n}
rules:
  - name: per-api-key
    key: [header:x-api-key]
    limit: {{ rate: {limit}/s }}
    scope: global
"#,
        interval.as_millis(),
        (interval * 8).as_millis()
    )
}

/// The mean, the worst and the 95th-percentile (by size) of 1-second windows' `errors`
/// against a limit, as the fleet benches judge a scenario (0 for none).
pub fn judge(mut errors: Vec<f64>) -> (f64, f64, f64) {
    let mean = errors.iter().sum::<f64>() / errors.len().max(1) as f64;
    errors.sort_by(|a, b| a.abs().total_cmp(&b.abs()));
    let worst = errors.last().copied().unwrap_or(0.0);
    let p95 = errors
        .get(((errors.len() as f64 * 0.95).ceil() as usize).saturating_sub(1))
        .copied()
        .unwrap_or(0.0);
    (mean, worst, p95)
}

/// A tally per proxy, and the load generators to await.
pub type Load = (Vec<Arc<Tally>>, Vec<tokio::task::JoinHandle<()>>);

/// A whole fleet on loopback: a controller, aggregators for zones eu-1 (two replicas by default)
/// and eu-2, three proxies
/// (two in eu-1, one in eu-2) and one app. Reused by the convergence benchmark.
pub struct Fleet {
    pub upstream: std::net::SocketAddr,
    /// One, or controllers that serve at once (every aggregator forwards to each).
    pub controllers: Vec<Running>,
    pub aggregators: Vec<Running>,
    /// How each aggregator was started, for [`Self::restart_aggregator`].
    aggregator_options: Vec<aggregator::AggregatorOptions>,
    pub proxies: Vec<Sidecar>,
}

impl Fleet {
    /// Starts it, with one global rule of `limit`/s per API key, reporting every `interval`.
    pub async fn start(limit: u64, interval: Duration) -> anyhow::Result<Fleet> {
        Self::start_with(limit, interval, 2).await
    }

    /// Starts it with `replicas` aggregators in zone eu-1 (its two proxies report to them in
    /// turn) and one in eu-2.
    pub async fn start_with(
        limit: u64,
        interval: Duration,
        replicas: usize,
    ) -> anyhow::Result<Fleet> {
        Self::start_full(limit, interval, replicas, 1).await
    }

    /// [`Self::start_with`], with `controllers` controllers serving at once.
    pub async fn start_full(
        limit: u64,
        interval: Duration,
        replicas: usize,
        controllers: usize,
    ) -> anyhow::Result<Fleet> {
        let upstream = start_upstream().await?;
        let any = "127.0.0.1:0".parse()?;
        let mut ctls = Vec::new();
        for _ in 0..controllers.max(1) {
            ctls.push(controller::start(controller::ControllerOptions::new(any, any)).await?);
        }
        let urls = ctls
            .iter()
            .map(|c| format!("http://{}", c.addr).parse())
            .collect::<Result<Vec<http::Uri>, _>>()?;
        let mut aggregators = Vec::new();
        let mut aggregator_options = Vec::new();
        let zones = std::iter::repeat_n("eu-1", replicas.max(1)).chain(["eu-2"]);
        for (i, zone) in zones.enumerate() {
            let mut opts = aggregator::AggregatorOptions::new(any, any, urls[0].clone(), zone);
            opts.controllers = urls.clone();
            opts.interval = interval;
            opts.replica = Some(format!("{zone}-{i}"));
            aggregators.push(aggregator::start(opts.clone()).await?);
            opts.listen = aggregators[i].addr;
            aggregator_options.push(opts);
        }
        let eu2 = aggregators.len() - 1;
        let mut proxies = Vec::new();
        for n in 0..3 {
            let agg = if n == 2 {
                &aggregators[eu2]
            } else {
                &aggregators[n % eu2]
            };
            let yaml = proxy_config(upstream, agg.addr, n + 1, limit, interval);
            let config = Config::from_yaml(&yaml, "<fleet>").context("the fleet's own config")?;
            proxies.push(Sidecar::start(config).await?);
        }
        Ok(Fleet {
            upstream,
            controllers: ctls,
            aggregators,
            aggregator_options,
            proxies,
        })
    }

    /// Closed-loop load on one API key: `conns` clients per proxy, each sending its next
    /// request as soon as it has an answer, until `deadline`.
    pub fn load_closed(
        &self,
        conns: usize,
        deadline: tokio::time::Instant,
    ) -> anyhow::Result<Load> {
        let client: Client<HttpConnector, Empty<Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let mut tallies = Vec::new();
        let mut generators = Vec::new();
        for p in &self.proxies {
            let tally = Arc::new(Tally::default());
            generators.push(tokio::spawn(offer_closed(
                client.clone(),
                format!("http://{}/api/orders", p.addr()).parse()?,
                vec![("x-api-key", "team-a".to_string())],
                conns,
                tally.clone(),
                deadline,
            )));
            tallies.push(tally);
        }
        Ok((tallies, generators))
    }

    /// Offers one API key across the proxies 6:2:1, `fleet_rate(elapsed)` requests/s in
    /// all, until `deadline`; returns a tally per proxy and the generators to await.
    pub fn load(
        &self,
        fleet_rate: impl Fn(Duration) -> u64 + Clone + Send + 'static,
        deadline: tokio::time::Instant,
    ) -> anyhow::Result<Load> {
        self.load_key("team-a", fleet_rate, deadline)
    }

    /// Stops the controller and starts a new one at its address (its state is soft: the new
    /// one knows nothing).
    pub async fn restart_controller(&mut self, i: usize) -> anyhow::Result<()> {
        let old = self.controllers.remove(i);
        let addr = old.addr;
        old.shutdown();
        old.wait().await;
        let any = "127.0.0.1:0".parse()?;
        let new = controller::start(controller::ControllerOptions::new(addr, any))
            .await
            .with_context(|| format!("a controller at {addr} again"))?;
        self.controllers.insert(i, new);
        Ok(())
    }

    /// Stops aggregator `i` (its last forward goes out) and starts a new replica at its
    /// address under a new name, as a rolling update of its Deployment would.
    pub async fn restart_aggregator(&mut self, i: usize, generation: usize) -> anyhow::Result<()> {
        let old = self.aggregators.remove(i);
        let addr = old.addr;
        old.shutdown();
        old.wait().await;
        let mut opts = self.aggregator_options[i].clone();
        opts.replica = Some(format!("{}-{i}-{generation}", opts.zone));
        let new = aggregator::start(opts)
            .await
            .with_context(|| format!("an aggregator at {addr} again"))?;
        self.aggregators.insert(i, new);
        Ok(())
    }

    /// [`Self::load`] for API key `key`.
    pub fn load_key(
        &self,
        key: &str,
        fleet_rate: impl Fn(Duration) -> u64 + Clone + Send + 'static,
        deadline: tokio::time::Instant,
    ) -> anyhow::Result<Load> {
        let total: u64 = SHARES.iter().sum();
        self.load_split(
            key,
            move |elapsed, i| fleet_rate(elapsed) * SHARES[i] / total,
            deadline,
        )
    }

    /// Offers key `key` to proxy `i` at `rate(elapsed, i)` requests per second until
    /// `deadline`.
    pub fn load_split(
        &self,
        key: &str,
        rate: impl Fn(Duration, usize) -> u64 + Clone + Send + 'static,
        deadline: tokio::time::Instant,
    ) -> anyhow::Result<Load> {
        let client: Client<HttpConnector, Empty<Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let mut tallies = Vec::new();
        let mut generators = Vec::new();
        for (i, p) in self.proxies.iter().enumerate() {
            let tally = Arc::new(Tally::default());
            let rate = rate.clone();
            generators.push(tokio::spawn(offer(
                client.clone(),
                format!("http://{}/api/orders", p.addr()).parse()?,
                vec![("x-api-key", key.to_string())],
                move |elapsed| rate(elapsed, i),
                tally.clone(),
                deadline,
            )));
            tallies.push(tally);
        }
        Ok((tallies, generators))
    }

    /// Stops everything, proxies first.
    pub async fn stop(self) {
        for p in self.proxies {
            p.shutdown();
            p.wait().await;
        }
        for a in self.aggregators {
            a.shutdown();
            a.wait().await;
        }
        for c in self.controllers {
            c.shutdown();
            c.wait().await;
        }
    }
}

/// Runs the fleet demo for 30 s.
pub async fn run() -> anyhow::Result<()> {
    let fleet = Fleet::start(LIMIT, Duration::from_millis(250)).await?;
    let (ctl, aggs, p) = (&fleet.controllers[0], &fleet.aggregators, &fleet.proxies);
    println!(
        "Spillway fleet demo: controller {}, two aggregator replicas for eu-1 ({} and {}), one for eu-2 ({}),",
        ctl.addr, aggs[0].addr, aggs[1].addr, aggs[2].addr
    );
    println!(
        "proxies {} and {} (eu-1, one per replica) and {} (eu-2), one app on {}.",
        p[0].addr(),
        p[1].addr(),
        p[2].addr(),
        fleet.upstream
    );
    println!(
        "Rule per-api-key: {LIMIT} req/s per key across the whole fleet (scope: global). One key is offered 6:2:1\n\
         across the proxies: {LIMIT} req/s in total for {} s, then {} req/s. Reports every 250 ms.\n",
        STEP_AT.as_secs(),
        3 * LIMIT
    );
    println!(" second | proxy-1 adm/off | proxy-2 adm/off | proxy-3 adm/off | fleet adm/off | limit | ratio");
    println!("--------+-----------------+-----------------+-----------------+---------------+-------+------");
    let deadline = tokio::time::Instant::now() + RUN_FOR;
    let (tallies, generators) = fleet.load(
        |elapsed| if elapsed < STEP_AT { LIMIT } else { 3 * LIMIT },
        deadline,
    )?;
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let state_url: http::Uri = format!("http://{}/v1/state", ctl.addr).parse()?;
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    for second in 1..=RUN_FOR.as_secs() {
        tick.tick().await;
        let mut row = format!(" {second:>6} |");
        let (mut fo, mut fa) = (0, 0);
        for t in &tallies {
            let (o, a, _) = t.take();
            fo += o;
            fa += a;
            row.push_str(&format!(" {a:>7}/{o:<7} |"));
        }
        let ratio = controller_ratio(&client, &state_url).await.unwrap_or(0.0);
        row.push_str(&format!(" {fa:>6}/{fo:<6} | {LIMIT:>5} | {ratio:.2}"));
        println!("{row}");
    }
    for g in generators {
        let _ = g.await;
    }
    println!(
        "\nThe fleet admits about {LIMIT}/s whatever the split: each proxy drops the same share of its own\n\
         traffic (the controller's ratio), decided locally with no network hop per request."
    );
    fleet.stop().await;
    Ok(())
}

/// The controller's largest drop ratio now, from `/v1/state`.
async fn controller_ratio(
    client: &Client<HttpConnector, Empty<Bytes>>,
    url: &http::Uri,
) -> Option<f64> {
    let resp = client.get(url.clone()).await.ok()?;
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    let doc: serde_json::Value = serde_json::from_slice(&body).ok()?;
    doc["keys"]
        .as_array()?
        .iter()
        .filter_map(|k| k["ratio"].as_f64())
        .reduce(f64::max)
}
