//! How well and how fast the fleet's admitted rate meets its limit, judged by its seconds.
//!
//! `cargo bench --bench fleet_convergence` (or `bench/convergence.sh`). An in-process fleet
//! (controller, one or two aggregator replicas for zone eu-1 and one for eu-2, three proxies,
//! one app on loopback) gets one API key, offered 6:2:1 across the proxies:
//! - steady: 2.4x the limit, open loop, at 300/s and at 40/s, 60 s measured;
//! - closed loop: 16 clients per proxy, each sending its next request as soon as it has an
//!   answer (the offered rate is whatever the answers allow), at 300/s and at 40/s, 60 s
//!   measured;
//! - step: 1x the limit for 10 s, then 3x;
//! - new key: a second key starts at 3x its limit beside the first, under steady overload;
//! - a key moving: 2.4x the limit offered 6:2:1 for 10 s, then 1:2:6 (the fleet's total
//!   unchanged: clients moving to other replicas);
//! - timed bursts: a key limited to 10/s offered 300/s for 1 s every 6 s (and about one
//!   request a second per proxy between), the bursts timed against the report interval;
//! - controller restart: under steady 2.4x, the controller is stopped and a new one (knowing
//!   nothing) started at its address;
//! - rolling restart: two controllers serving at once, each restarted in turn, then every
//!   aggregator replica (a new name at the same address), 4 s apart, under steady 2.4x.
//!
//! Admitted requests are counted every 100 ms and summed into whole 1-second windows, each
//! judged by its count over the time it really lasted. Reported:
//! the mean error over the measured part, the worst and the 95th-percentile window's error
//! (against the limit), and for the step the time from the step until a sliding 1 s window is
//! first within +-10 % (for the new key: what it was admitted in its first second).

use std::time::Duration;

use spillway::internal::demo::fleet::{judge, Fleet, Tally};

const SAMPLE: Duration = Duration::from_millis(100);
const PER_WINDOW: usize = 10;

#[derive(Clone, Copy)]
enum Scenario {
    Steady(u64),
    Closed(u64),
    Step,
    NewKey,
    Bursts,
    Moving,
    Restart,
    Rolling,
}

impl Scenario {
    fn name(self) -> String {
        match self {
            Scenario::Steady(l) => format!("steady 2.4x at {l}/s, open loop"),
            Scenario::Closed(l) => format!("closed loop, 16 clients per proxy, {l}/s"),
            Scenario::Step => "1x -> 3x step, 300/s".into(),
            Scenario::NewKey => "a new key at 3x beside one at 2.4x, 300/s".into(),
            Scenario::Bursts => "timed bursts, 300/s for 1 s every 6 s, 10/s".into(),
            Scenario::Moving => "a key moving from 6:2:1 to 1:2:6 at 2.4x, 300/s".into(),
            Scenario::Restart => "controller restart under 2.4x, 300/s".into(),
            Scenario::Rolling => {
                "two controllers, then the aggregators, restarted one at a time under 2.4x, 300/s"
                    .into()
            }
        }
    }

    fn limit(self) -> u64 {
        match self {
            Scenario::Steady(l) | Scenario::Closed(l) => l,
            Scenario::Bursts => 10,
            _ => 300,
        }
    }
}

/// One sample: what the tallies admitted, and over how many seconds (a tick the machine
/// delays makes one sample longer and the next shorter; judged by ticks alone, a window's
/// rate would move with the sampler's lateness).
#[derive(Clone, Copy)]
struct Sample {
    admitted: u64,
    secs: f64,
}

/// Counts every tally every [`SAMPLE`] until `deadline`.
async fn sample(tallies: &[std::sync::Arc<Tally>], deadline: tokio::time::Instant) -> Vec<Sample> {
    let start = tokio::time::Instant::now();
    let mut tick = tokio::time::interval_at(start + SAMPLE, SAMPLE);
    let (mut out, mut offered) = (Vec::new(), Vec::new());
    let mut each: Vec<Vec<u64>> = vec![Vec::new(); tallies.len()];
    let mut last = start;
    while tokio::time::Instant::now() < deadline {
        tick.tick().await;
        let (mut o, mut a) = (0, 0);
        for (t, each) in tallies.iter().zip(&mut each) {
            let (to, ta, _) = t.take();
            o += to;
            a += ta;
            each.push(ta);
        }
        let now = tokio::time::Instant::now();
        out.push(Sample {
            admitted: a,
            secs: (now - last).as_secs_f64(),
        });
        last = now;
        offered.push(o);
    }
    if std::env::var_os("SPILLWAY_BENCH_WINDOWS").is_some() {
        // What the tallies offered each second, for reading a window's error against it.
        eprintln!("offered per second: {}", per_second(&offered));
        for (i, each) in each.iter().enumerate() {
            eprintln!("proxy {} admitted per second: {}", i + 1, per_second(each));
        }
    }
    out
}

/// Per-sample `counts` summed into whole seconds, for printing.
fn per_second(counts: &[u64]) -> String {
    let seconds: Vec<String> = counts
        .chunks_exact(PER_WINDOW)
        .map(|w| w.iter().sum::<u64>().to_string())
        .collect();
    seconds.join(" ")
}

/// A run of samples' admitted rate, units a second.
fn rate(samples: &[Sample]) -> f64 {
    let (admitted, secs) = samples
        .iter()
        .fold((0, 0.0), |(a, s), x| (a + x.admitted, s + x.secs));
    admitted as f64 / secs.max(1e-9)
}

/// Seconds from sample `from` until the first sliding 1 s window of `samples` whose rate
/// `ok` takes.
fn first_window(samples: &[Sample], from: usize, ok: impl Fn(f64) -> bool) -> Option<f64> {
    (from + PER_WINDOW..samples.len())
        .find(|&end| ok(rate(&samples[end + 1 - PER_WINDOW..=end])))
        .map(|end| (end + 1 - from) as f64 / PER_WINDOW as f64)
}

/// Whole 1 s windows of `samples` from sample `from` on, as errors against `limit`.
fn window_errors(samples: &[Sample], from: usize, limit: u64) -> Vec<f64> {
    samples[from.min(samples.len())..]
        .chunks_exact(PER_WINDOW)
        .map(|w| (rate(w) - limit as f64) / limit as f64)
        .collect()
}

fn pct(x: f64) -> String {
    format!("{:+.1} %", x * 100.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    println!("| scenario | eu-1 aggregators | report interval | mean error | worst 1 s window | 95th percentile 1 s window | after the event |");
    println!("|---|---|---|---|---|---|---|");
    let s = Duration::from_secs(1);
    let q = Duration::from_millis(250);
    let runs = [
        (Scenario::Steady(300), 1, s),
        (Scenario::Steady(300), 2, s),
        (Scenario::Steady(300), 2, q),
        (Scenario::Steady(40), 2, s),
        (Scenario::Closed(300), 2, s),
        (Scenario::Closed(40), 2, s),
        (Scenario::Step, 1, s),
        (Scenario::Step, 2, s),
        (Scenario::Step, 2, q),
        (Scenario::NewKey, 2, s),
        (Scenario::Bursts, 2, s),
        (Scenario::Moving, 2, s),
        (Scenario::Restart, 2, s),
        (Scenario::Rolling, 2, s),
    ];
    // `cargo bench --bench fleet_convergence -- step`: only the scenarios whose name has one
    // of the words given.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    for (scenario, replicas, interval) in runs {
        if !only.is_empty() && !only.iter().any(|w| scenario.name().contains(w.as_str())) {
            continue;
        }
        let limit = scenario.limit();
        let controllers = if matches!(scenario, Scenario::Rolling) {
            2
        } else {
            1
        };
        let mut fleet = Fleet::start_full(limit, interval, replicas, controllers).await?;
        let start = tokio::time::Instant::now();
        let over = limit * 12 / 5;
        let (samples, measured_from, event) = match scenario {
            Scenario::Steady(_) | Scenario::Closed(_) => {
                // 10 s to settle, then the 60 s the issue judges.
                let deadline = start + Duration::from_secs(70);
                let (tallies, generators) = match scenario {
                    Scenario::Closed(_) => fleet.load_closed(16, deadline)?,
                    _ => fleet.load(move |_| over, deadline)?,
                };
                let samples = sample(&tallies, deadline).await;
                for g in generators {
                    let _ = g.await;
                }
                (samples, 100, String::from("-"))
            }
            Scenario::Step => {
                let deadline = start + Duration::from_secs(30);
                let step_at = Duration::from_secs(10);
                let (tallies, generators) = fleet.load(
                    move |t| if t < step_at { limit } else { 3 * limit },
                    deadline,
                )?;
                let samples = sample(&tallies, deadline).await;
                for g in generators {
                    let _ = g.await;
                }
                let step = 100;
                let within = first_window(&samples, step, |w| {
                    (w - limit as f64).abs() <= 0.1 * limit as f64
                });
                let event = within.map_or("not within the run".into(), |secs| {
                    format!("within +-10 % {secs:.1} s after the step")
                });
                // From 2 s after the step.
                (samples, step + 20, event)
            }
            Scenario::NewKey => {
                let deadline = start + Duration::from_secs(20);
                let (tallies, generators) = fleet.load(move |_| over, deadline)?;
                let first = sample(&tallies, start + Duration::from_secs(10)).await;
                let (new_tallies, new_generators) =
                    fleet.load_key("team-new", move |_| 3 * limit, deadline)?;
                let mut both = tallies.clone();
                both.extend(new_tallies.iter().cloned());
                let new_first = sample(&new_tallies, start + Duration::from_secs(11)).await;
                let rest = sample(&both, deadline).await;
                for g in generators.into_iter().chain(new_generators) {
                    let _ = g.await;
                }
                let first_second: u64 = new_first.iter().map(|x| x.admitted).sum();
                let event = format!(
                    "the new key's first second: {first_second} admitted ({} of its limit)",
                    pct((first_second as f64 - limit as f64) / limit as f64)
                );
                // The old key's windows before, then both keys' (two limits) after: judged
                // per key's limit, the first 10 s only.
                let _ = rest;
                (first, 50, event)
            }
            Scenario::Bursts => {
                let deadline = start + Duration::from_secs(37);
                let (tallies, generators) =
                    fleet.load(|t| if t.as_secs() % 6 == 0 { 300 } else { 0 }, deadline)?;
                let samples = sample(&tallies, deadline).await;
                for g in generators {
                    let _ = g.await;
                }
                // Each burst's cycle from the second one on (the first meets a key the
                // control plane has not seen): what it admitted against the 60 a cycle's
                // 6 s allow.
                let cycles: Vec<u64> = samples
                    .chunks_exact(6 * PER_WINDOW)
                    .skip(1)
                    .map(|c| c.iter().map(|x| x.admitted).sum())
                    .collect();
                if std::env::var_os("SPILLWAY_BENCH_WINDOWS").is_some() {
                    // Admitted each second, for reading the cycles' course.
                    let admitted: Vec<u64> = samples.iter().map(|x| x.admitted).collect();
                    eprintln!("{}: {}", scenario.name(), per_second(&admitted));
                }
                let worst = cycles.iter().copied().max().unwrap_or(0);
                let mean = cycles.iter().sum::<u64>() as f64 / cycles.len().max(1) as f64;
                let event = format!(
                    "admitted per 6 s cycle: {mean:.0} on average, {worst} at most, against 60 ({} cycles)",
                    cycles.len()
                );
                // Whole seconds are not the measure here (a burst is one second): none.
                (Vec::new(), 0, event)
            }
            Scenario::Moving => {
                let deadline = start + Duration::from_secs(25);
                let moved_at = Duration::from_secs(10);
                let (tallies, generators) = fleet.load_split(
                    "team-a",
                    move |t, i| {
                        let shares = if t < moved_at { [6, 2, 1] } else { [1, 2, 6] };
                        over * shares[i] / 9
                    },
                    deadline,
                )?;
                let samples = sample(&tallies, deadline).await;
                for g in generators {
                    let _ = g.await;
                }
                let moved = 100;
                let after: Vec<f64> = window_errors(&samples, moved, limit);
                let worst = after
                    .iter()
                    .copied()
                    .fold(0.0, |w: f64, e| if e.abs() > w.abs() { e } else { w });
                let within = first_window(&samples, moved, |w| w >= 0.9 * limit as f64);
                let event = format!(
                    "worst second after the move: {}; within -10 % {} after it",
                    pct(worst),
                    within.map_or("never".into(), |secs| format!("{secs:.1} s"))
                );
                // From 2 s after the move.
                (samples, moved + 20, event)
            }
            Scenario::Restart => {
                let deadline = start + Duration::from_secs(30);
                let (tallies, generators) = fleet.load(move |_| over, deadline)?;
                let before = sample(&tallies, start + Duration::from_secs(12)).await;
                fleet.restart_controller(0).await?;
                let after = sample(&tallies, deadline).await;
                for g in generators {
                    let _ = g.await;
                }
                let worst_after = window_errors(&after, 0, limit)
                    .into_iter()
                    .take(5)
                    .fold(f64::NEG_INFINITY, f64::max);
                let event = format!("worst of the 5 s after the restart: {}", pct(worst_after));
                let mut samples = before;
                let from = 50;
                samples.truncate(samples.len() / PER_WINDOW * PER_WINDOW);
                samples.extend(after);
                (samples, from, event)
            }
            Scenario::Rolling => {
                let deadline = start + Duration::from_secs(29);
                let (tallies, generators) = fleet.load(move |_| over, deadline)?;
                let sampler = tokio::spawn(async move { sample(&tallies, deadline).await });
                let from = 8;
                tokio::time::sleep_until(start + Duration::from_secs(from)).await;
                // As a rolling update does: each one only once the last is back (a
                // controller past its warm-up), 4 s apart.
                for i in 0..2 {
                    fleet.restart_controller(i).await?;
                    tokio::time::sleep(Duration::from_secs(4)).await;
                }
                for i in 0..=replicas {
                    fleet.restart_aggregator(i, 1).await?;
                    tokio::time::sleep(Duration::from_secs(4)).await;
                }
                let samples = sampler.await?;
                for g in generators {
                    let _ = g.await;
                }
                let during = window_errors(&samples, from as usize * PER_WINDOW, limit);
                let worst = during
                    .iter()
                    .copied()
                    .fold(0.0, |w: f64, e| if e.abs() > w.abs() { e } else { w });
                let event = format!(
                    "worst second of the {} s of restarts: {}",
                    during.len(),
                    pct(worst)
                );
                (samples, from as usize * PER_WINDOW, event)
            }
        };
        fleet.stop().await;

        let errors = window_errors(&samples, measured_from, limit);
        if std::env::var_os("SPILLWAY_BENCH_WINDOWS").is_some() {
            // Every whole second of the run, for reading one scenario's course.
            let all: Vec<String> = window_errors(&samples, 0, limit)
                .iter()
                .map(|e| format!("{:+.0}", e * 100.0))
                .collect();
            eprintln!("{}: {}", scenario.name(), all.join(" "));
        }
        let (mean, worst, p95) = judge(errors.clone());
        let pct = |x| {
            if errors.is_empty() {
                "-".into()
            } else {
                pct(x)
            }
        };
        println!(
            "| {} | {replicas} | {} ms | {} | {} | {} | {event} |",
            scenario.name(),
            interval.as_millis(),
            pct(mean),
            pct(worst),
            pct(p95),
        );
    }
    Ok(())
}
