//! The fleet's arithmetic: many keys, uneven intervals and weighted requests.
//!
//! `cargo bench --bench fleet_arithmetic` (or `bench/convergence.sh`). Each scenario starts an
//! in-process controller (and an aggregator where it says so), proxies in front of one app on
//! loopback, and offers per-key load; after a warm-up it counts what each group of keys was
//! admitted in every 1-second window and prints, per group, what its keys are allowed against
//! what they got: the mean over the measured seconds and the worst single second.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use spillway::internal::control::{aggregator, controller, server::Running};
use spillway::internal::demo::{offer, start_upstream, Tally};
use spillway::{Config, Sidecar};

const WARM_UP: Duration = Duration::from_secs(4);
const MEASURE: u64 = 10;

/// A proxy of service `shop` with `rules`, reporting to `control` every `interval`.
async fn proxy(
    upstream: std::net::SocketAddr,
    control: std::net::SocketAddr,
    host: &str,
    interval: &str,
    top_k: u32,
    rules: &str,
) -> anyhow::Result<Sidecar> {
    let yaml = format!(
        r#"service: shop
listen: 127.0.0.1:0
admin: 127.0.0.1:0
upstream: http://{upstream}
limits: {{ max_connections: 2000 }}
control_plane:
  url: http://{control}
  report_interval: {interval}
  stale_after: 30s
  top_k: {top_k}
  host: {host}
rules:
{rules}"#
    );
    Ok(Sidecar::start(Config::from_yaml(&yaml, "<bench>")?).await?)
}

fn per_key(rate: &str, extra: &str) -> String {
    format!(
        "  - name: per-key\n    key: [header:x-api-key]\n    limit: {{ rate: {rate} }}\n    scope: global\n{extra}"
    )
}

/// Keys offered to one proxy at one rate, tallied together as `group`.
struct Offer {
    proxy: usize,
    keys: Vec<String>,
    rps: u64,
    group: &'static str,
}

struct Scenario {
    name: &'static str,
    controller: Running,
    aggregator: Option<Running>,
    proxies: Vec<Sidecar>,
    offers: Vec<Offer>,
    /// Per group: what its keys are allowed per second, in requests.
    allowed: Vec<(&'static str, f64)>,
    /// Target, for the table.
    target: &'static str,
    /// Before measuring: long enough for every proxy's reports to have been answered twice.
    warm_up: Duration,
}

async fn control() -> anyhow::Result<Running> {
    let any = "127.0.0.1:0".parse()?;
    Ok(controller::start(controller::ControllerOptions::new(any, any)).await?)
}

async fn zone(ctl: &Running, every: Duration) -> anyhow::Result<Running> {
    let any = "127.0.0.1:0".parse()?;
    let mut opts =
        aggregator::AggregatorOptions::new(any, any, format!("http://{}", ctl.addr).parse()?, "z");
    opts.interval = every;
    Ok(aggregator::start(opts).await?)
}

fn keys(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}-{i}")).collect()
}

async fn flood(up: std::net::SocketAddr) -> anyhow::Result<Scenario> {
    let ctl = control().await?;
    let rules = per_key("2/s", "");
    let mut proxies = Vec::new();
    for i in 0..2 {
        proxies.push(proxy(up, ctl.addr, &format!("flood-{i}"), "250ms", 10, &rules).await?);
    }
    let mut offers = Vec::new();
    for p in 0..2 {
        offers.push(Offer {
            proxy: p,
            keys: keys("attacker", 0..151),
            rps: 2,
            group: "151 attacker keys at 2x",
        });
        offers.push(Offer {
            proxy: p,
            keys: keys(&format!("legit-{p}"), 0..2),
            rps: 1,
            group: "4 legitimate keys at 0.5x",
        });
    }
    Ok(Scenario {
        name: "key flood beside legitimate keys (2 proxies, 2/s per key, top_k 10)",
        controller: ctl,
        aggregator: None,
        proxies,
        offers,
        allowed: vec![
            ("151 attacker keys at 2x", 302.0),
            ("4 legitimate keys at 0.5x", 4.0),
        ],
        target: "legitimate >= 99 %",
        warm_up: WARM_UP,
    })
}

async fn tails(up: std::net::SocketAddr) -> anyhow::Result<Scenario> {
    let ctl = control().await?;
    let rules = per_key("5/s", "");
    let mut proxies = Vec::new();
    let mut offers = Vec::new();
    for p in 0..3 {
        proxies.push(proxy(up, ctl.addr, &format!("tail-{p}"), "1s", 10, &rules).await?);
        offers.push(Offer {
            proxy: p,
            keys: keys(&format!("client-{p}"), 0..30),
            rps: 3,
            group: "90 clients at 0.6x",
        });
    }
    Ok(Scenario {
        name: "disjoint tails (3 proxies, 30 clients each, 5/s per key, top_k 10, 1 s reports)",
        controller: ctl,
        aggregator: None,
        proxies,
        offers,
        allowed: vec![("90 clients at 0.6x", 270.0)],
        target: ">= 99 %",
        warm_up: WARM_UP,
    })
}

async fn hidden(up: std::net::SocketAddr) -> anyhow::Result<Scenario> {
    let ctl = control().await?;
    let rules = per_key("10/s", "");
    let mut proxies = Vec::new();
    let mut offers = Vec::new();
    for p in 0..3 {
        proxies.push(proxy(up, ctl.addr, &format!("hide-{p}"), "1s", 3, &rules).await?);
        offers.push(Offer {
            proxy: p,
            keys: vec!["hidden".into()],
            rps: 20,
            group: "the hidden key at 6x",
        });
        offers.push(Offer {
            proxy: p,
            keys: keys(&format!("heavy-{p}"), 0..3),
            rps: 30,
            group: "9 heavier keys at 3x",
        });
        offers.push(Offer {
            proxy: p,
            keys: keys(&format!("light-{p}"), 0..10),
            rps: 2,
            group: "30 light keys at 0.2x",
        });
    }
    Ok(Scenario {
        name: "a heavy key hidden in tails (3 proxies, 10/s per key, top_k 3, 1 s reports)",
        controller: ctl,
        aggregator: None,
        proxies,
        offers,
        allowed: vec![
            ("the hidden key at 6x", 10.0),
            ("9 heavier keys at 3x", 90.0),
            ("30 light keys at 0.2x", 60.0),
        ],
        target: "heavy keys +-10 %",
        warm_up: WARM_UP,
    })
}

async fn intervals(up: std::net::SocketAddr) -> anyhow::Result<Scenario> {
    let ctl = control().await?;
    let agg = zone(&ctl, Duration::from_secs(1)).await?;
    let rules = per_key("150/s", "");
    let mut proxies = Vec::new();
    let mut offers = Vec::new();
    for (p, every) in ["250ms", "1s", "5s"].iter().enumerate() {
        proxies.push(proxy(up, agg.addr, &format!("mixed-{p}"), every, 10, &rules).await?);
        offers.push(Offer {
            proxy: p,
            keys: vec!["hot".into()],
            rps: 150,
            group: "one key at 3x",
        });
    }
    Ok(Scenario {
        name: "mixed intervals (proxies at 250 ms, 1 s, 5 s behind an aggregator at 1 s)",
        controller: ctl,
        aggregator: Some(agg),
        proxies,
        offers,
        allowed: vec![("one key at 3x", 150.0)],
        target: "+-5 %",
        // Two of the 5 s proxy's reports.
        warm_up: Duration::from_secs(11),
    })
}

async fn weighted(up: std::net::SocketAddr) -> anyhow::Result<Scenario> {
    let ctl = control().await?;
    let rules = per_key("500/s", "    cost: 5\n");
    let mut proxies = Vec::new();
    let mut offers = Vec::new();
    for p in 0..3 {
        proxies.push(proxy(up, ctl.addr, &format!("cost-{p}"), "1s", 10, &rules).await?);
        offers.push(Offer {
            proxy: p,
            keys: vec!["metered".into()],
            rps: 100,
            group: "cost 5, 1500 units/s offered",
        });
    }
    Ok(Scenario {
        name: "weighted requests (3 proxies, 500 units/s, cost 5)",
        controller: ctl,
        aggregator: None,
        proxies,
        offers,
        allowed: vec![("cost 5, 1500 units/s offered", 100.0)],
        target: "+-10 %",
        warm_up: WARM_UP,
    })
}

async fn run(s: Scenario) -> anyhow::Result<()> {
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let deadline = tokio::time::Instant::now() + s.warm_up + Duration::from_secs(MEASURE);
    let mut groups: Vec<(&'static str, Arc<Tally>)> = Vec::new();
    let mut generators = Vec::new();
    for o in &s.offers {
        let tally = match groups.iter().find(|g| g.0 == o.group) {
            Some(g) => g.1.clone(),
            None => {
                let t = Arc::new(Tally::default());
                groups.push((o.group, t.clone()));
                t
            }
        };
        let uri: http::Uri = format!("http://{}/api", s.proxies[o.proxy].addr()).parse()?;
        for k in &o.keys {
            let rps = o.rps;
            // Independent clients are not in lockstep: each starts at its own phase of its
            // period (the golden ratio's multiples spread any number evenly), or all of a
            // flood's keys would meet their ratio at the same point of its ripple.
            let phase = (generators.len() as f64 * 0.618_033_988_75).fract();
            let start = Duration::from_secs_f64(phase / rps.max(1) as f64);
            let (client, uri, tally) = (client.clone(), uri.clone(), tally.clone());
            let headers = vec![("x-api-key", k.clone())];
            generators.push(tokio::spawn(async move {
                tokio::time::sleep(start).await;
                offer(client, uri, headers, move |_| rps, tally, deadline).await
            }));
        }
    }
    tokio::time::sleep(s.warm_up).await;
    for (_, t) in &groups {
        t.take();
    }
    let mut windows: Vec<Vec<u64>> = vec![Vec::new(); groups.len()];
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    for _ in 0..MEASURE {
        tick.tick().await;
        for (i, (_, t)) in groups.iter().enumerate() {
            windows[i].push(t.take().1);
        }
    }
    for g in generators {
        let _ = g.await;
    }
    for (i, (group, _)) in groups.iter().enumerate() {
        let allowed = s
            .allowed
            .iter()
            .find(|a| a.0 == *group)
            .map_or(0.0, |a| a.1);
        let w = &windows[i];
        if std::env::var_os("SPILLWAY_BENCH_WINDOWS").is_some() {
            // Every measured second of the group, for reading one scenario's course.
            let all: Vec<String> = w.iter().map(u64::to_string).collect();
            eprintln!("{}: {group}: {}", s.name, all.join(" "));
        }
        let mean = w.iter().sum::<u64>() as f64 / w.len() as f64;
        let worst = w
            .iter()
            .map(|&x| x as f64 - allowed)
            .max_by(|a, b| a.abs().total_cmp(&b.abs()))
            .unwrap_or(0.0);
        println!(
            "| {} | {group} | {allowed:.0}/s | {mean:.1}/s ({:+.1} %) | {:+.1} % | {} |",
            s.name,
            (mean - allowed) / allowed * 100.0,
            worst / allowed * 100.0,
            s.target,
        );
    }
    for p in s.proxies {
        p.shutdown();
        p.wait().await;
    }
    if let Some(a) = s.aggregator {
        a.shutdown();
        a.wait().await;
    }
    s.controller.shutdown();
    s.controller.wait().await;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    println!("| scenario | keys | allowed | admitted, mean of 10 s | worst 1 s window | target |");
    println!("|---|---|---|---|---|---|");
    // `cargo bench --bench fleet_arithmetic -- hidden`: only the scenarios named.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted = |name: &str| only.is_empty() || only.iter().any(|w| w == name);
    let up = start_upstream().await?;
    if wanted("flood") {
        run(flood(up).await?).await?;
    }
    if wanted("tails") {
        run(tails(up).await?).await?;
    }
    if wanted("hidden") {
        run(hidden(up).await?).await?;
    }
    if wanted("intervals") {
        run(intervals(up).await?).await?;
    }
    if wanted("weighted") {
        run(weighted(up).await?).await?;
    }
    Ok(())
}
