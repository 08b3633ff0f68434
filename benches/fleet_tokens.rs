//! A fleet-wide token budget, judged by its seconds.
//!
//! `cargo bench --bench fleet_tokens`. In process, on loopback: a controller, two aggregator
//! replicas of one zone, two proxies (each reporting to its own replica) in front of the fake
//! OpenAI-compatible app of `spillway demo --tokens` (streamed answers of 100 to 899 tokens,
//! the usage in the last chunk). One API key has a global budget of 10 000 tokens a second,
//! charged from each streamed answer's usage; it is offered 2.5 times that (50 calls a second,
//! open loop, 3:2 across the proxies). After 10 s to settle, 60 s are measured: the tokens of
//! the answers the client received, summed into whole 1-second windows (each by the time it
//! really lasted), judged against the budget: the mean, the worst and the 95th-percentile
//! window. `SPILLWAY_BENCH_WINDOWS=1` prints every window.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

use spillway::internal::control::{aggregator, controller};
use spillway::internal::demo::fleet::judge;
use spillway::internal::demo::tokens::{start_llm, total_tokens};
use spillway::{Config, Sidecar};

const BUDGET: u64 = 10_000;
/// Calls a second offered to each proxy: 2.5 times the budget at 500 tokens a call.
const CALLS: [u64; 2] = [30, 20];
const SAMPLE: Duration = Duration::from_millis(100);
const PER_WINDOW: usize = 10;

fn proxy_config(app: std::net::SocketAddr, aggregator: std::net::SocketAddr, n: usize) -> String {
    format!(
        r#"
service: llm
listen: 127.0.0.1:0
upstream: http://{app}
admin: 127.0.0.1:0
limits: {{ max_connections: 500 }}
control_plane:
  url: http://{aggregator}
  report_interval: 1s
  stale_after: 8s
  decay: 5s
  host: proxy-{n}
rules:
  - name: tokens
    key: header:authorization
    limit: {{ rate: {BUDGET}/s }}
    scope: global
    cost: {{ response: json, reserve: 500, max: 4000 }}
    log_keys: clear
"#
    )
}

#[derive(Default)]
struct Tally {
    tokens: AtomicU64,
    calls: AtomicU64,
    refused: AtomicU64,
    other: AtomicU64,
}

/// One streamed call through `proxy`, its tokens counted as the client read them.
async fn call(client: &Client<HttpConnector, Full<Bytes>>, proxy: std::net::SocketAddr, t: &Tally) {
    let req = http::Request::post(format!("http://{proxy}/v1/chat/completions"))
        .header("authorization", "Bearer team-a")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"demo","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Hi"}]}"#,
        )))
        .expect("a valid request");
    let Ok(resp) = client.request(req).await else {
        t.other.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let status = resp.status();
    let Ok(body) = resp.into_body().collect().await.map(|b| b.to_bytes()) else {
        t.other.fetch_add(1, Ordering::Relaxed);
        return;
    };
    match status.as_u16() {
        200 => {
            t.calls.fetch_add(1, Ordering::Relaxed);
            t.tokens.fetch_add(total_tokens(&body), Ordering::Relaxed);
        }
        429 => {
            t.refused.fetch_add(1, Ordering::Relaxed);
        }
        _ => {
            t.other.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// `per_sec` calls a second to `proxy` until `deadline`, at even spacing (open loop).
async fn offer(
    client: Client<HttpConnector, Full<Bytes>>,
    proxy: std::net::SocketAddr,
    per_sec: u64,
    tally: Arc<Tally>,
    deadline: tokio::time::Instant,
) {
    let mut tick = tokio::time::interval(Duration::from_nanos(1_000_000_000 / per_sec));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut inflight = tokio::task::JoinSet::new();
    while tick.tick().await < deadline {
        let (client, tally) = (client.clone(), tally.clone());
        inflight.spawn(async move { call(&client, proxy, &tally).await });
        while inflight.try_join_next().is_some() {}
    }
    while inflight.join_next().await.is_some() {}
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let app = start_llm().await?;
    let any = "127.0.0.1:0".parse()?;
    let ctl = controller::start(controller::ControllerOptions::new(any, any)).await?;
    let url: http::Uri = format!("http://{}", ctl.addr).parse()?;
    let mut aggregators = Vec::new();
    for i in 0..2 {
        let mut opts = aggregator::AggregatorOptions::new(any, any, url.clone(), "eu-1");
        opts.interval = Duration::from_secs(1);
        opts.replica = Some(format!("eu-1-{i}"));
        aggregators.push(aggregator::start(opts).await?);
    }
    let mut proxies = Vec::new();
    for (n, agg) in aggregators.iter().enumerate() {
        let config = Config::from_yaml(&proxy_config(app, agg.addr, n + 1), "<bench>")?;
        proxies.push(Sidecar::start(config).await?);
    }
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let start = tokio::time::Instant::now();
    let deadline = start + Duration::from_secs(70);
    let tallies: Vec<Arc<Tally>> = proxies.iter().map(|_| Arc::default()).collect();
    let mut generators = Vec::new();
    for ((p, per_sec), tally) in proxies.iter().zip(CALLS).zip(&tallies) {
        generators.push(tokio::spawn(offer(
            client.clone(),
            p.addr(),
            per_sec,
            tally.clone(),
            deadline,
        )));
    }
    // Every sample: the tokens received since the last, and how long it really lasted.
    let mut samples: Vec<(u64, f64)> = Vec::new();
    let mut tick = tokio::time::interval_at(start + SAMPLE, SAMPLE);
    let mut last = start;
    let (mut calls, mut refused, mut other) = (0, 0, 0);
    while tokio::time::Instant::now() < deadline {
        tick.tick().await;
        let tokens: u64 = tallies
            .iter()
            .map(|t| t.tokens.swap(0, Ordering::Relaxed))
            .sum();
        let now = tokio::time::Instant::now();
        samples.push((tokens, (now - last).as_secs_f64()));
        last = now;
        if samples.len() == 10 * PER_WINDOW {
            for t in &tallies {
                t.calls.swap(0, Ordering::Relaxed);
                t.refused.swap(0, Ordering::Relaxed);
                t.other.swap(0, Ordering::Relaxed);
            }
        }
    }
    for g in generators {
        let _ = g.await;
    }
    for t in &tallies {
        calls += t.calls.load(Ordering::Relaxed);
        refused += t.refused.load(Ordering::Relaxed);
        other += t.other.load(Ordering::Relaxed);
    }
    let windows: Vec<f64> = samples[10 * PER_WINDOW..]
        .chunks_exact(PER_WINDOW)
        .map(|w| {
            let (tokens, secs) = w.iter().fold((0, 0.0), |(a, s), x| (a + x.0, s + x.1));
            tokens as f64 / secs
        })
        .collect();
    if std::env::var_os("SPILLWAY_BENCH_WINDOWS").is_some() {
        let all: Vec<String> = windows.iter().map(|w| format!("{w:.0}")).collect();
        eprintln!("tokens per second: {}", all.join(" "));
    }
    let errors: Vec<f64> = windows
        .iter()
        .map(|w| (w - BUDGET as f64) / BUDGET as f64)
        .collect();
    let (mean, worst, p95) = judge(errors.clone());
    let pct = |x: f64| format!("{:+.1} %", x * 100.0);
    println!("| scenario | mean error | worst 1 s window | 95th percentile 1 s window | calls admitted / refused / failed |");
    println!("|---|---|---|---|---|");
    println!(
        "| 2.5x a 10 000 tokens/s budget, calls of 100-899 tokens, 2 proxies, 2 aggregator replicas, {} s | {} | {} | {} | {calls} / {refused} / {other} |",
        errors.len(),
        pct(mean),
        pct(worst),
        pct(p95),
    );
    for p in proxies {
        p.shutdown();
        p.wait().await;
    }
    for a in aggregators {
        a.shutdown();
        a.wait().await;
    }
    ctl.shutdown();
    ctl.wait().await;
    Ok(())
}
