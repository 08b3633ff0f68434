//! How well and how fast the fleet's admitted rate meets its limit.
//!
//! `cargo bench --bench fleet_convergence` (or `bench/convergence.sh`). An in-process fleet
//! (controller, two zone aggregators, three proxies, one app on loopback) gets one API key
//! offered 6:2:1 across the proxies: 1x the limit, then a step to 3x. Admitted requests are
//! counted every 100 ms. Reported, for report intervals of 1 s and 250 ms:
//! - steady-state error: the mean admitted rate over the last 8 s against the limit;
//! - settling time: from the step until the admitted rate over a sliding 1 s window first
//!   comes within +-10 % of the limit;
//! - how often it stays there afterwards: the share of later 1 s windows within +-10 %.
//!   Dropping is a coin toss per request, so even a perfect ratio leaves binomial noise
//!   (at 900 offered/s and a ratio of 2/3, one standard deviation is 14 req/s, ~5 %).

use std::time::Duration;

use spillway::demo::fleet::Fleet;

const LIMIT: u64 = 300;
const STEP_AT: Duration = Duration::from_secs(10);
const RUN_FOR: Duration = Duration::from_secs(30);
const SAMPLE: Duration = Duration::from_millis(100);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    println!("| report interval | steady-state error (last 8 s) | within +-10 % after the 1x -> 3x step | later 1 s windows within +-10 % |");
    println!("|---|---|---|---|");
    for interval in [Duration::from_secs(1), Duration::from_millis(250)] {
        let fleet = Fleet::start(LIMIT, interval).await?;
        let start = tokio::time::Instant::now();
        let deadline = start + RUN_FOR;
        let (tallies, generators) =
            fleet.load(|t| if t < STEP_AT { LIMIT } else { 3 * LIMIT }, deadline)?;
        let mut samples = Vec::new();
        let mut tick = tokio::time::interval_at(start + SAMPLE, SAMPLE);
        while tokio::time::Instant::now() < deadline {
            tick.tick().await;
            let admitted: u64 = tallies.iter().map(|t| t.take().1).sum();
            samples.push(admitted);
        }
        for g in generators {
            let _ = g.await;
        }
        fleet.stop().await;

        let per_window = (Duration::from_secs(1).as_millis() / SAMPLE.as_millis()) as usize;
        let last = (Duration::from_secs(8).as_millis() / SAMPLE.as_millis()) as usize;
        let tail = &samples[samples.len() - last..];
        let steady = tail.iter().sum::<u64>() as f64 / 8.0;
        let error = (steady - LIMIT as f64) / LIMIT as f64;
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
        println!(
            "| {} ms | {:+.1} % ({steady:.0}/s against {LIMIT}/s) | {settled} | {:.0} % |",
            interval.as_millis(),
            error * 100.0,
            later * 100.0
        );
    }
    Ok(())
}
