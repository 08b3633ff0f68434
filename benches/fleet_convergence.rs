//! How well and how fast the fleet's admitted rate meets its limit.
//!
//! `cargo bench --bench fleet_convergence` (or `bench/convergence.sh`). An in-process fleet
//! (controller, one or two aggregator replicas for zone eu-1 and one for eu-2, three proxies,
//! one app on loopback) gets one API key:
//! - open loop: offered 6:2:1 across the proxies at 1x the limit, then a step to 3x;
//! - closed loop: 16 clients per proxy, each sending its next request as soon as it has an
//!   answer (no step: the offered rate is whatever the answers allow).
//!
//! Admitted requests are counted every 100 ms. Reported: the steady-state error (the mean
//! admitted rate over the last 8 s against the limit); for the open loop also the settling
//! time (from the step until the admitted rate over a sliding 1 s window first comes within
//! +-10 % of the limit) and the share of later 1 s windows within +-10 %. Dropping is a coin
//! toss per request, so even a perfect ratio leaves binomial noise (at 900 offered/s and a
//! ratio of 2/3, one standard deviation is 14 req/s, ~5 %, per second).

use std::time::Duration;

use spillway::internal::demo::fleet::Fleet;

const LIMIT: u64 = 300;
const STEP_AT: Duration = Duration::from_secs(10);
const RUN_FOR: Duration = Duration::from_secs(30);
const SAMPLE: Duration = Duration::from_millis(100);

#[derive(Clone, Copy)]
enum Load {
    Open,
    Closed,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    println!("| load | eu-1 aggregators | report interval | steady-state error (last 8 s) | offered/s | within +-10 % after the 1x -> 3x step | later 1 s windows within +-10 % |");
    println!("|---|---|---|---|---|---|---|");
    let runs = [
        (Load::Open, 1, Duration::from_secs(1)),
        (Load::Open, 2, Duration::from_secs(1)),
        (Load::Open, 1, Duration::from_millis(250)),
        (Load::Open, 2, Duration::from_millis(250)),
        (Load::Closed, 1, Duration::from_secs(1)),
        (Load::Closed, 2, Duration::from_secs(1)),
    ];
    for (load, replicas, interval) in runs {
        let fleet = Fleet::start_with(LIMIT, interval, replicas).await?;
        let start = tokio::time::Instant::now();
        let run_for = match load {
            Load::Open => RUN_FOR,
            Load::Closed => Duration::from_secs(20),
        };
        let deadline = start + run_for;
        let (tallies, generators) = match load {
            Load::Open => fleet.load(|t| if t < STEP_AT { LIMIT } else { 3 * LIMIT }, deadline)?,
            Load::Closed => fleet.load_closed(16, deadline)?,
        };
        let mut samples = Vec::new();
        let mut offered = Vec::new();
        let mut tick = tokio::time::interval_at(start + SAMPLE, SAMPLE);
        while tokio::time::Instant::now() < deadline {
            tick.tick().await;
            let (mut o, mut a) = (0, 0);
            for t in &tallies {
                let (to, ta, _) = t.take();
                o += to;
                a += ta;
            }
            samples.push(a);
            offered.push(o);
        }
        for g in generators {
            let _ = g.await;
        }
        fleet.stop().await;

        let per_window = (Duration::from_secs(1).as_millis() / SAMPLE.as_millis()) as usize;
        let last = (Duration::from_secs(8).as_millis() / SAMPLE.as_millis()) as usize;
        let tail = &samples[samples.len() - last..];
        let steady = tail.iter().sum::<u64>() as f64 / 8.0;
        let offered_rate = offered[offered.len() - last..].iter().sum::<u64>() as f64 / 8.0;
        let error = (steady - LIMIT as f64) / LIMIT as f64;
        let (settled, later) = match load {
            Load::Closed => ("no step".to_string(), "-".to_string()),
            Load::Open => {
                // 1 s sliding windows ending at each sample after the step.
                let step = (STEP_AT.as_millis() / SAMPLE.as_millis()) as usize;
                let window_rate =
                    |end: usize| samples[end + 1 - per_window..=end].iter().sum::<u64>() as f64;
                let ok = |end: usize| (window_rate(end) - LIMIT as f64).abs() <= 0.1 * LIMIT as f64;
                let ends: Vec<usize> = (step + per_window..samples.len()).collect();
                let first = ends.iter().position(|&e| ok(e));
                let settled = first
                    .map(|i| {
                        let end_t = (ends[i] + 1) as f64 * SAMPLE.as_secs_f64();
                        format!("{:.1} s", end_t - STEP_AT.as_secs_f64())
                    })
                    .unwrap_or_else(|| "not within the run".into());
                let later = first.map_or(0.0, |i| {
                    let rest = &ends[i..];
                    rest.iter().filter(|&&e| ok(e)).count() as f64 / rest.len() as f64
                });
                (settled, format!("{:.0} %", later * 100.0))
            }
        };
        println!(
            "| {} | {replicas} | {} ms | {:+.1} % ({steady:.0}/s against {LIMIT}/s) | {offered_rate:.0} | {settled} | {later} |",
            match load {
                Load::Open => "open",
                Load::Closed => "closed, 16 clients per proxy",
            },
            interval.as_millis(),
            error * 100.0,
        );
    }
    Ok(())
}
