//! A rate limit for keys a rule has no room to track: a windowed count-min sketch.
//!
//! Owns the decision for keys that arrive while a rule's store is full. Each key's units are
//! counted in `pingora_limits`' lock-free count-min sketch (fixed memory, seeded hashes), one
//! per window of the quota, and a key is admitted while its sliding-window estimate leaves room
//! for its cost within the burst. A count-min sketch only over-estimates: a flood of distinct
//! keys raises an unseen key's estimate by about (flooded units per window) / width, so
//! newcomers are refused only when the flood's rate passes about `width` times the rule's
//! rate. Must never: read a clock of its own (time is passed in), or grow with the keys.
//!
//! Concurrency: the window roll is one CAS on the epoch; a decision racing a roll may count
//! into the window being cleared, or two racing decisions may both fit: an estimator's error,
//! bounded by the requests in flight at that instant.

use std::sync::atomic::{AtomicU64, Ordering};

use pingora_limits::estimator::Estimator;

use super::{Decision, Nanos, Quota};

/// Two windows of estimates for one rule.
pub struct Sketch {
    /// Window `e` counts in `windows[e % 2]`.
    windows: [Estimator; 2],
    // The current window's number. AcqRel on the roll so that the reset is done by exactly
    // one caller; readers after it see the new epoch (Acquire).
    epoch: AtomicU64,
}

impl Sketch {
    /// `depth` rows of `width` counters for each window.
    pub fn new(width: usize, depth: usize) -> Self {
        Sketch {
            windows: [
                Estimator::new(depth.max(1), width.max(1)),
                Estimator::new(depth.max(1), width.max(1)),
            ],
            epoch: AtomicU64::new(0),
        }
    }

    /// Decides `cost` units for `key` at `now` under `quota` (its window and burst).
    pub fn check(&self, key: &[u8], quota: &Quota, now: Nanos, cost: u32) -> Decision {
        let window = quota.window().max(1);
        let epoch = self.roll(now / window);
        let into = now % window;
        let current = &self.windows[(epoch % 2) as usize];
        let previous = &self.windows[((epoch + 1) % 2) as usize];
        let before = u128::from(previous.get(key).max(0) as u64);
        // The previous window's units, weighted by how much of it the sliding window covers.
        let carried = (before * u128::from(window - into) / u128::from(window)) as u64;
        let used = carried.saturating_add(current.get(key).max(0) as u64);
        let burst = u64::from(quota.burst());
        if used.saturating_add(u64::from(cost)) > burst {
            let retry = if u64::from(cost) > burst {
                None
            } else {
                Some(window - into)
            };
            return Decision::Deny { retry_after: retry };
        }
        current.incr(key, cost as isize);
        Decision::Allow {
            remaining: (burst - used - u64::from(cost)) as u32,
            reset_after: window - into,
            wait: 0,
        }
    }

    /// Counts `units` for `key` at `now` whatever the estimate (a cost known after the
    /// decision): the key owes them for as long as the sketch remembers (two windows).
    pub fn owe(&self, key: &[u8], quota: &Quota, now: Nanos, units: u32) {
        let epoch = self.roll(now / quota.window().max(1));
        let units = isize::try_from(units).unwrap_or(isize::MAX);
        self.windows[(epoch % 2) as usize].incr(key, units);
    }

    /// Gives back `cost` units a decision at `now` took for `key` (another rule refused).
    pub fn refund(&self, key: &[u8], quota: &Quota, now: Nanos, cost: u32) {
        let epoch = now / quota.window().max(1);
        if epoch == self.epoch.load(Ordering::Acquire) {
            self.windows[(epoch % 2) as usize].decr(key, cost as isize);
        }
    }

    /// Makes `epoch` the current window (clearing what it reuses) and returns the current
    /// window, which a racing caller may have moved further.
    fn roll(&self, epoch: Nanos) -> u64 {
        let seen = self.epoch.load(Ordering::Acquire);
        if epoch <= seen {
            return seen;
        }
        if self
            .epoch
            .compare_exchange(seen, epoch, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // The window this one reuses held `epoch - 2`; after a longer silence, both are old.
            self.windows[(epoch % 2) as usize].reset();
            if epoch > seen + 1 {
                self.windows[((epoch + 1) % 2) as usize].reset();
            }
            return epoch;
        }
        self.epoch.load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for Sketch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sketch")
            .field("epoch", &self.epoch.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::testing::quota;
    use std::time::Duration;

    const SEC: Nanos = 1_000_000_000;

    #[test]
    fn a_key_gets_its_burst_per_window_and_then_a_retry_hint() {
        let s = Sketch::new(1024, 4);
        let q = quota(5, Duration::from_secs(1), 5);
        let now = 10 * SEC;
        for _ in 0..5 {
            assert!(s.check(b"k", &q, now, 1).is_allowed());
        }
        match s.check(b"k", &q, now, 1) {
            Decision::Deny { retry_after } => assert_eq!(retry_after, Some(SEC)),
            d => panic!("{d:?}"),
        }
        // Other keys are not touched by k's use.
        assert!(s.check(b"other", &q, now, 1).is_allowed());
    }

    #[test]
    fn the_previous_window_counts_in_proportion_then_fades() {
        let s = Sketch::new(1024, 4);
        let q = quota(4, Duration::from_secs(1), 4);
        for _ in 0..4 {
            assert!(s.check(b"k", &q, 10 * SEC, 1).is_allowed());
        }
        // Half-way through the next window, half of the 4 still count: 2 more fit.
        let mid = 11 * SEC + SEC / 2;
        assert!(s.check(b"k", &q, mid, 1).is_allowed());
        assert!(s.check(b"k", &q, mid, 1).is_allowed());
        assert!(!s.check(b"k", &q, mid, 1).is_allowed());
        // Two windows later, nothing is left.
        for _ in 0..4 {
            assert!(s.check(b"k", &q, 14 * SEC, 1).is_allowed());
        }
    }

    #[test]
    fn a_refund_gives_units_back_and_a_cost_above_burst_never_fits() {
        let s = Sketch::new(1024, 4);
        let q = quota(2, Duration::from_secs(1), 2);
        assert!(s.check(b"k", &q, SEC, 2).is_allowed());
        s.refund(b"k", &q, SEC, 2);
        assert!(s.check(b"k", &q, SEC, 2).is_allowed());
        assert_eq!(
            s.check(b"x", &q, SEC, 3),
            Decision::Deny { retry_after: None }
        );
    }

    /// `keys` flooding keys each spend their whole burst of 10 in one window; then how many of
    /// 100 first-time keys are admitted.
    fn newcomers_after_a_flood(s: &Sketch, keys: u32) -> usize {
        let q = quota(10, Duration::from_secs(1), 10);
        for i in 0..keys {
            for _ in 0..10 {
                let _ = s.check(&i.to_le_bytes(), &q, 5 * SEC, 1);
            }
        }
        (0u32..100)
            .filter(|i| {
                s.check(&(1_000_000 + i).to_be_bytes(), &q, 5 * SEC, 1)
                    .is_allowed()
            })
            .count()
    }

    #[test]
    fn a_flood_below_width_times_rate_leaves_room_for_a_newcomer() {
        let s = Sketch::new(4096, 4);
        let q = quota(10, Duration::from_secs(1), 10);
        // A key at its limit fills a counter alone, so a newcomer is refused only where all
        // four rows collide with a flooding key: (1 - e^(-512/4096))^4, about 1 in 5 000.
        let admitted = newcomers_after_a_flood(&s, 512);
        assert!(admitted >= 95, "{admitted} of 100 newcomers admitted");
        // A flooding key stays limited.
        assert!(!s.check(&7u32.to_le_bytes(), &q, 5 * SEC, 1).is_allowed());
    }

    #[test]
    fn a_flood_far_above_width_times_rate_refuses_newcomers_conservatively() {
        let s = Sketch::new(256, 4);
        let admitted = newcomers_after_a_flood(&s, 256 * 8);
        assert!(admitted <= 5, "{admitted} of 100 newcomers admitted");
    }
}
