//! Token bucket: `burst` tokens of capacity, refilled continuously at the quota's rate.
//!
//! The state is one `AtomicU64`, the "theoretical arrival time" (TAT) of GCRA: the instant at
//! which the bucket will be full again. Tokens available at `now` are
//! `burst - (max(tat, now) - now) / emission`, fractions included, so refill never rounds
//! (a bucket half a token short at t is whole at t + emission/2). A decision is one load and
//! one CAS; a bucket whose TAT is in the past is exactly a fresh one, which is what makes idle
//! keys free to forget.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Decision, Nanos, Quota};

/// Per-key token bucket state: 8 bytes.
#[derive(Debug, Default)]
pub struct TokenBucket {
    // Relaxed everywhere: the atomic is the whole state and publishes no other memory, and
    // every read-modify-write sees the latest value in its modification order.
    tat: AtomicU64,
}

impl TokenBucket {
    /// A full bucket.
    pub const fn new() -> Self {
        Self {
            tat: AtomicU64::new(0),
        }
    }

    /// Takes `cost` tokens at `now`, or says when they will be there.
    #[inline]
    pub fn check(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        if cost > quota.burst {
            return Decision::Deny { retry_after: None };
        }
        let need = quota.emission * u64::from(cost);
        let mut tat = self.tat.load(Ordering::Relaxed);
        loop {
            let base = tat.max(now);
            let new_tat = base + need;
            let ahead = new_tat - now;
            if ahead > quota.tolerance {
                return Decision::Deny {
                    retry_after: Some(ahead - quota.tolerance),
                };
            }
            match self
                .tat
                .compare_exchange_weak(tat, new_tat, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Decision::Allow {
                        remaining: ((quota.tolerance - ahead) / quota.emission) as u32,
                        reset_after: ahead,
                    }
                }
                Err(actual) => tat = actual,
            }
        }
    }

    /// Gives back `cost` tokens taken by an earlier [`check`](Self::check) that was admitted,
    /// when another rule refused the same request.
    pub fn refund(&self, quota: &Quota, cost: u32) {
        let give = quota.emission * u64::from(cost);
        // A bucket that refilled meanwhile saturates at "full"; fetch_update never fails here.
        let _ = self
            .tat
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
                Some(tat.saturating_sub(give))
            });
    }

    /// True when the bucket is full at `now`, i.e. indistinguishable from a fresh one.
    #[inline]
    pub fn is_idle(&self, now: Nanos) -> bool {
        self.tat.load(Ordering::Relaxed) <= now
    }

    /// Units available at `now` (fractions dropped), without taking any.
    pub fn available(&self, quota: &Quota, now: Nanos) -> u32 {
        let ahead = self.tat.load(Ordering::Relaxed).saturating_sub(now);
        (quota.tolerance.saturating_sub(ahead) / quota.emission) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::NANOS_PER_SEC;
    use std::num::NonZeroU32;
    use std::time::Duration;

    const MS: Nanos = 1_000_000;

    fn quota(count: u32, period: Duration, burst: u32) -> Quota {
        Quota::new(
            NonZeroU32::new(count).unwrap(),
            period,
            NonZeroU32::new(burst).unwrap(),
        )
        .unwrap()
    }

    fn allowed(d: Decision) -> bool {
        d.is_allowed()
    }

    #[test]
    fn a_fresh_bucket_admits_exactly_burst_then_refuses() {
        let q = quota(10, Duration::from_secs(1), 20);
        let b = TokenBucket::new();
        let t0 = 5 * NANOS_PER_SEC;
        for i in 0..20 {
            assert_eq!(
                b.check(&q, t0, 1),
                Decision::Allow {
                    remaining: 19 - i,
                    reset_after: (i as u64 + 1) * 100 * MS
                }
            );
        }
        assert_eq!(
            b.check(&q, t0, 1),
            Decision::Deny {
                retry_after: Some(100 * MS)
            }
        );
    }

    #[test]
    fn refill_is_continuous_and_keeps_fractions() {
        // 10/s, burst 1: one token every 100 ms, half a token after 50 ms is not enough,
        // but two halves make one.
        let q = quota(10, Duration::from_secs(1), 1);
        let b = TokenBucket::new();
        assert!(allowed(b.check(&q, 0, 1)));
        assert_eq!(
            b.check(&q, 50 * MS, 1),
            Decision::Deny {
                retry_after: Some(50 * MS)
            }
        );
        assert_eq!(
            b.check(&q, 100 * MS - 1, 1),
            Decision::Deny {
                retry_after: Some(1)
            }
        );
        assert!(allowed(b.check(&q, 100 * MS, 1)));
        // A refusal consumes nothing: the next token is still due at 200 ms.
        assert!(!allowed(b.check(&q, 150 * MS, 1)));
        assert!(allowed(b.check(&q, 200 * MS, 1)));
    }

    #[test]
    fn a_rate_that_does_not_divide_evenly_still_refills_the_count_per_period() {
        // 3/s: 333_333_333.3 ns per token. After one second from empty, 3 tokens are back.
        let q = quota(3, Duration::from_secs(1), 3);
        let b = TokenBucket::new();
        let t0 = NANOS_PER_SEC;
        for _ in 0..3 {
            assert!(allowed(b.check(&q, t0, 1)));
        }
        assert!(!allowed(b.check(&q, t0, 1)));
        let t1 = t0 + NANOS_PER_SEC;
        for _ in 0..3 {
            assert!(allowed(b.check(&q, t1, 1)));
        }
        assert!(!allowed(b.check(&q, t1, 1)));
    }

    #[test]
    fn retrying_at_the_returned_time_is_admitted() {
        let q = quota(7, Duration::from_secs(3), 4);
        let b = TokenBucket::new();
        let mut now = 0;
        let mut admitted = 0;
        for _ in 0..50 {
            match b.check(&q, now, 1) {
                Decision::Allow { .. } => admitted += 1,
                Decision::Deny { retry_after } => {
                    now += retry_after.unwrap();
                    assert!(allowed(b.check(&q, now, 1)), "retry at {now} refused");
                    admitted += 1;
                }
            }
        }
        assert_eq!(admitted, 50);
    }

    #[test]
    fn a_cost_above_burst_is_never_admitted() {
        let q = quota(10, Duration::from_secs(1), 5);
        let b = TokenBucket::new();
        assert_eq!(b.check(&q, 0, 6), Decision::Deny { retry_after: None });
        assert_eq!(b.available(&q, 0), 5, "a refused cost takes nothing");
    }

    #[test]
    fn refund_returns_exactly_what_was_taken() {
        let q = quota(1, Duration::from_secs(1), 2);
        let b = TokenBucket::new();
        assert!(allowed(b.check(&q, 0, 1)));
        assert_eq!(b.available(&q, 0), 1);
        b.refund(&q, 1);
        assert_eq!(b.available(&q, 0), 2);
        assert!(b.is_idle(0));
    }

    #[test]
    fn a_bucket_that_refilled_is_idle_and_one_that_did_not_is_not() {
        let q = quota(10, Duration::from_secs(1), 2);
        let b = TokenBucket::new();
        assert!(allowed(b.check(&q, NANOS_PER_SEC, 1)));
        assert!(!b.is_idle(NANOS_PER_SEC + 99 * MS));
        assert!(b.is_idle(NANOS_PER_SEC + 100 * MS));
    }

    #[test]
    fn admitted_count_never_exceeds_burst_plus_rate_times_elapsed() {
        let q = quota(50, Duration::from_secs(1), 10);
        let b = TokenBucket::new();
        let mut admitted = 0u64;
        // Offer one request every 7 ms for 10 s.
        let end = 10 * NANOS_PER_SEC;
        let mut now = 0;
        while now <= end {
            if allowed(b.check(&q, now, 1)) {
                admitted += 1;
            }
            now += 7 * MS;
        }
        let bound = 10 + 50 * 10;
        assert!(admitted <= bound, "{admitted} > {bound}");
        // And it is not stingy either: offered 1429, the bucket must admit nearly the bound.
        assert!(admitted >= bound - 2, "{admitted} too few");
    }
}
