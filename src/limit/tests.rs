//! Properties every rate algorithm must keep, on a manual time line.

use std::time::Duration;

use proptest::prelude::*;

use super::testing::quota;
use super::*;

fn state(a: Algorithm) -> Box<dyn Limiter> {
    match a {
        Algorithm::TokenBucket => Box::<TokenBucket>::default(),
        Algorithm::Gcra => Box::<Gcra>::default(),
        Algorithm::LeakyBucket => Box::<LeakyBucket>::default(),
        Algorithm::FixedWindow => Box::<FixedWindow>::default(),
        Algorithm::SlidingWindowLog => Box::<SlidingWindowLog>::default(),
        Algorithm::SlidingWindowCounter => Box::<SlidingWindowCounter>::default(),
    }
}

fn algorithm() -> impl Strategy<Value = Algorithm> {
    proptest::sample::select(Algorithm::ALL.to_vec())
}

/// Arrivals: (gap since the previous one in µs, cost).
fn arrivals() -> impl Strategy<Value = Vec<(u64, u32)>> {
    proptest::collection::vec((0u64..400_000, 1u32..4), 1..200)
}

/// Admission times (ns) and costs of a run.
fn run(a: Algorithm, q: &Quota, arrivals: &[(u64, u32)]) -> Vec<(Nanos, u32)> {
    let s = state(a);
    let mut now = 1_000_000_000;
    let mut admitted = Vec::new();
    for &(gap, cost) in arrivals {
        now += gap * 1000;
        if let Decision::Allow { wait, .. } = s.check(q, now, cost) {
            // A shaper's request goes on when its wait is over.
            admitted.push((now + wait, cost));
        }
    }
    admitted
}

/// The most cost admitted in any half-open interval of `len` ns.
fn max_in_any(admitted: &[(Nanos, u32)], len: Nanos) -> u64 {
    let mut sorted = admitted.to_vec();
    sorted.sort();
    let mut best = 0u64;
    let mut sum = 0u64;
    let mut lo = 0;
    for hi in 0..sorted.len() {
        sum += u64::from(sorted[hi].1);
        while sorted[hi].0 - sorted[lo].0 >= len {
            sum -= u64::from(sorted[lo].1);
            lo += 1;
        }
        best = best.max(sum);
    }
    best
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Token bucket, GCRA and leaky bucket: never more than `burst + rate * T` in any T.
    #[test]
    fn bucket_algorithms_never_admit_more_than_burst_plus_rate_times_elapsed(
        a in proptest::sample::select(vec![
            Algorithm::TokenBucket, Algorithm::Gcra, Algorithm::LeakyBucket,
        ]),
        count in 1u32..50,
        burst in 3u32..20,
        arrivals in arrivals(),
        len_ms in 1u64..3000,
    ) {
        let q = quota(count, Duration::from_secs(1), burst);
        let admitted = run(a, &q, &arrivals);
        let len = len_ms * 1_000_000;
        // Units in [t, t + len) are at most burst + floor(len / emission) (+1 for the edge).
        let bound = u64::from(burst) + len / q.emission() + 1;
        prop_assert!(max_in_any(&admitted, len) <= bound, "{a:?}: over {bound}");
    }

    /// Fixed window: at most the limit in each aligned window.
    #[test]
    fn fixed_window_never_admits_more_than_the_limit_per_window(
        count in 1u32..30, arrivals in arrivals(),
    ) {
        let q = quota(count, Duration::from_millis(500), count);
        let admitted = run(Algorithm::FixedWindow, &q, &arrivals);
        let mut per_window = std::collections::HashMap::<u64, u64>::new();
        for (t, c) in admitted {
            *per_window.entry(t / q.window()).or_default() += u64::from(c);
        }
        prop_assert!(per_window.values().all(|&n| n <= u64::from(count)));
    }

    /// Sliding log: at most the limit in any window of the configured length.
    #[test]
    fn sliding_log_never_admits_more_than_the_limit_in_any_window(
        count in 1u32..30, arrivals in arrivals(),
    ) {
        let q = quota(count, Duration::from_millis(700), count);
        let admitted = run(Algorithm::SlidingWindowLog, &q, &arrivals);
        prop_assert!(max_in_any(&admitted, q.window()) <= u64::from(count));
    }

    /// Sliding counter: its documented bound, twice the limit in any window.
    #[test]
    fn sliding_counter_never_admits_more_than_twice_the_limit_in_any_window(
        count in 1u32..30, arrivals in arrivals(),
    ) {
        let q = quota(count, Duration::from_millis(700), count);
        let admitted = run(Algorithm::SlidingWindowCounter, &q, &arrivals);
        prop_assert!(max_in_any(&admitted, q.window()) <= 2 * u64::from(count));
    }

    /// Retrying at exactly the returned time is admitted when nothing else consumed.
    #[test]
    fn a_retry_at_the_returned_time_is_admitted(
        a in algorithm(),
        count in 1u32..40,
        burst in 1u32..20,
        arrivals in arrivals(),
        cost in 1u32..5,
    ) {
        let q = quota(count, Duration::from_secs(1), burst);
        let s = state(a);
        let mut now = 1_000_000_000;
        for &(gap, c) in &arrivals {
            now += gap * 1000;
            s.check(&q, now, c);
        }
        match s.check(&q, now, cost) {
            Decision::Deny { retry_after: Some(r) } => {
                prop_assert!(r > 0);
                let at = now + r;
                prop_assert!(s.check(&q, at, cost).is_allowed(), "{a:?}: refused at {at}");
            }
            Decision::Deny { retry_after: None } => prop_assert!(cost > burst),
            Decision::Allow { .. } => {}
        }
    }

    /// A denial takes nothing, and an admitted request refunded leaves the state as it was.
    #[test]
    fn denials_take_nothing_and_refunds_give_everything_back(
        a in algorithm(), arrivals in arrivals(), cost in 1u32..4,
    ) {
        let q = quota(10, Duration::from_secs(1), 5);
        let s = state(a);
        let mut now = 1_000_000_000;
        for &(gap, c) in &arrivals {
            now += gap * 1000;
            if s.check(&q, now, c).is_allowed() {
                s.refund(&q, now, c);
            }
        }
        // Every admission was refunded: the state is whole again.
        prop_assert!(s.is_idle(&q, now), "{a:?}");
        prop_assert!(s.check(&q, now, cost.min(5)).is_allowed());
    }
}
