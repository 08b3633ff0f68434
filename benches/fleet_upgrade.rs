//! A rolling upgrade from the previous release, judged by its seconds, with real processes on
//! loopback (the previous release's binary and this one's).
//!
//! `cargo bench --bench fleet_upgrade` with `SPILLWAY_PREVIOUS` naming the previous release's
//! binary (`bench/convergence.sh` builds it as `scripts/test` does; without it, this says so
//! and prints nothing). A fleet of the previous release (a controller, two aggregator replicas
//! for zone eu-1 and one for eu-2, three proxies reporting every second, one key offered 6:2:1
//! at 2.4x a 100/s limit) is upgraded in place, 4 s apart, as a rolling update would: the
//! controller, then each aggregator (stopped with SIGTERM, its last forward sent), then each
//! proxy (its pod replaced: requests to it fail meanwhile and count as errors, not admitted),
//! this release's with the rule's `log_keys: clear` for the rollout as CHANGELOG says (the
//! previous release reports header keys in clear). `SPILLWAY_BENCH_WINDOWS=1` prints each
//! proxy's seconds.
//! Admitted requests are counted every second. Two rows: the whole upgrade, and the mixed
//! versions it passes through (previous proxies behind this release's aggregators and
//! controller, the seconds before the first proxy is replaced).

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{temp_file, upstream, Proc, BIN};
use spillway::internal::demo::fleet::judge;
use spillway::internal::demo::{offer, Tally};

const LIMIT: u64 = 100;
const SHARES: [u64; 3] = [6, 2, 1];
const STEP: Duration = Duration::from_secs(4);

fn aggregator(bin: &str, listen: &str, controller: &str, zone: &str) -> Proc {
    let url = format!("http://{controller}");
    Proc::spawn_bin(
        bin,
        &[
            "aggregator",
            "--listen",
            listen,
            "--admin",
            "127.0.0.1:0",
            "--controller",
            &url,
            "--zone",
            zone,
            "--interval",
            "1s",
        ],
    )
}

fn controller(bin: &str, listen: &str) -> Proc {
    Proc::spawn_bin(
        bin,
        &["controller", "--listen", listen, "--admin", "127.0.0.1:0"],
    )
}

fn proxy(bin: &str, n: usize, listen: &str, up: std::net::SocketAddr, agg: &str) -> Proc {
    // This release's proxies as CHANGELOG's "Upgrading to this release (the keyed digest)"
    // says: the rule's keys reported as sent for the rollout, as the previous release does
    // (which refuses the field); with digests, old and new proxies would count the key apart.
    let clear = if bin == BIN {
        "    log_keys: clear\n"
    } else {
        ""
    };
    let yaml = format!(
        "service: shop\nlisten: {listen}\nadmin: 127.0.0.1:0\nupstream: http://{up}\n\
         control_plane:\n  url: http://{agg}\n  report_interval: 1s\n  stale_after: 8s\n  host: p{n}\n\
         rules:\n  - name: per-key\n    key: [header:x-api-key]\n    limit: {{ rate: {LIMIT}/s }}\n    scope: global\n{clear}"
    );
    let path = temp_file(&format!("upgrade-p{n}.yaml"), &yaml);
    Proc::spawn_bin(bin, &["proxy", "--config", path.to_str().expect("UTF-8")])
}

fn port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.to_string())
        .expect("a free port")
}

/// (mean, worst, 95th percentile) error of `windows` against the limit.
fn judge_windows(windows: &[u64]) -> (f64, f64, f64) {
    judge(
        windows
            .iter()
            .map(|&w| (w as f64 - LIMIT as f64) / LIMIT as f64)
            .collect(),
    )
}

fn pct(x: f64) -> String {
    format!("{:+.1} %", x * 100.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Some(old) = std::env::var("SPILLWAY_PREVIOUS")
        .ok()
        .filter(|b| !b.is_empty())
    else {
        eprintln!(
            "SPILLWAY_PREVIOUS is not set (bench/convergence.sh sets it): no upgrade measured"
        );
        return Ok(());
    };
    let up = upstream().await;
    let ctl_port = port();
    let agg_ports = [port(), port(), port()];
    let zones = ["eu-1", "eu-1", "eu-2"];
    let proxy_ports = [port(), port(), port()];
    // Proxies 1 and 2 report to eu-1's replicas, proxy 3 to eu-2's.
    let proxy_agg = [0, 1, 2];
    let mut ctl = controller(&old, &ctl_port);
    let mut aggs: Vec<Proc> = (0..3)
        .map(|i| aggregator(&old, &agg_ports[i], &ctl_port, zones[i]))
        .collect();
    let mut proxies: Vec<Proc> = (0..3)
        .map(|i| {
            proxy(
                &old,
                i + 1,
                &proxy_ports[i],
                up.addr,
                &agg_ports[proxy_agg[i]],
            )
        })
        .collect();

    // 2.4x the limit, 6:2:1, for the whole run; admitted counted every second.
    let over = LIMIT * 12 / 5;
    let steps = 3 + 3 + 1;
    let run = Duration::from_secs(8) + STEP * steps + Duration::from_secs(2);
    let start = tokio::time::Instant::now();
    let deadline = start + run;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let total: u64 = SHARES.iter().sum();
    let mut tallies = Vec::new();
    let mut load = Vec::new();
    for (i, p) in proxy_ports.iter().enumerate() {
        let tally = Arc::new(Tally::default());
        load.push(tokio::spawn(offer(
            client.clone(),
            format!("http://{p}/api/orders").parse()?,
            vec![("x-api-key", "team-a".to_string())],
            move |_| over * SHARES[i] / total,
            tally.clone(),
            deadline,
        )));
        tallies.push(tally);
    }
    let sampler = tokio::spawn(async move {
        let mut windows = Vec::new();
        let mut tick =
            tokio::time::interval_at(start + Duration::from_secs(1), Duration::from_secs(1));
        while tokio::time::Instant::now() < deadline {
            tick.tick().await;
            let (mut ok, mut failed) = (0, 0);
            let mut each = Vec::new();
            for t in &tallies {
                let admitted = t.take().1;
                ok += admitted;
                each.push(admitted);
                failed += t.other.swap(0, std::sync::atomic::Ordering::Relaxed);
            }
            if std::env::var_os("SPILLWAY_BENCH_WINDOWS").is_some() {
                // Each proxy's second, for reading what a replacement does.
                eprintln!("second {}: {each:?}", windows.len() + 1);
            }
            windows.push((ok, failed));
        }
        windows
    });

    // The previous release settles; then each part is replaced in turn, 4 s apart.
    tokio::time::sleep_until(start + Duration::from_secs(8)).await;
    let upgrade_from = 8;
    let replace = |p: &mut Proc, graceful: bool| {
        if graceful {
            p.terminate();
        } else {
            p.kill();
        }
    };
    replace(&mut ctl, true);
    ctl = tokio::task::spawn_blocking({
        let port = ctl_port.clone();
        move || controller(BIN, &port)
    })
    .await?;
    tokio::time::sleep(STEP).await;
    for i in 0..3 {
        replace(&mut aggs[i], true);
        let (listen, ctl, zone) = (agg_ports[i].clone(), ctl_port.clone(), zones[i]);
        aggs[i] = tokio::task::spawn_blocking(move || aggregator(BIN, &listen, &ctl, zone)).await?;
        tokio::time::sleep(STEP).await;
    }
    let mixed_until = tokio::time::Instant::now() - start;
    for i in 0..3 {
        replace(&mut proxies[i], false);
        let (listen, agg) = (proxy_ports[i].clone(), agg_ports[proxy_agg[i]].clone());
        let up = up.addr;
        proxies[i] =
            tokio::task::spawn_blocking(move || proxy(BIN, i + 1, &listen, up, &agg)).await?;
        tokio::time::sleep(STEP).await;
    }
    for l in load {
        l.await?;
    }
    let windows = sampler.await?;
    drop((ctl, aggs, proxies));
    eprintln!("admitted (and failed) per second: {windows:?}");

    let admitted: Vec<u64> = windows.iter().map(|w| w.0).collect();
    let during = &admitted[upgrade_from.min(admitted.len())..];
    let failed: u64 = windows.iter().map(|w| w.1).sum();
    let (mean, worst, p95) = judge_windows(during);
    println!("| scenario | eu-1 aggregators | report interval | mean error | worst 1 s window | 95th percentile 1 s window | after the event |");
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| rolling upgrade from the previous release, {LIMIT}/s: controller, aggregators, proxies | 2 | 1000 ms | {} | {} | {} | {failed} requests failed while proxies were replaced |",
        pct(mean),
        pct(worst),
        pct(p95)
    );
    // The mixed seconds: this release's controller and aggregators, the previous proxies
    // (from a controller step in, to the first proxy replaced).
    let mixed_from = upgrade_from + STEP.as_secs() as usize;
    let mixed_to = (mixed_until.as_secs() as usize).min(admitted.len());
    let (mean, worst, p95) = judge_windows(&admitted[mixed_from.min(mixed_to)..mixed_to]);
    println!(
        "| mixed versions: the previous proxies behind this release's aggregators and controller, {LIMIT}/s | 2 | 1000 ms | {} | {} | {} | {} s |",
        pct(mean),
        pct(worst),
        pct(p95),
        mixed_to.saturating_sub(mixed_from)
    );
    Ok(())
}
