//! Token bucket: `burst` tokens of capacity, refilled continuously at the quota's rate.
//!
//! Admits at once whatever the bucket holds, so it lets bursts of up to `burst` through and
//! then `rate` on average. Computed in its GCRA form (see [`super::gcra`]): one `AtomicU64`
//! per key, one CAS per decision, fractions of a token kept.

use super::{Decision, Gcra, Limiter, Nanos, Quota};

/// Per-key token bucket state: 8 bytes.
#[derive(Debug, Default)]
pub struct TokenBucket(Gcra);

impl TokenBucket {
    /// A full bucket.
    pub const fn new() -> Self {
        Self(Gcra::new())
    }

    /// Charges `units` at `now`, past empty if need be (see [`Gcra::owe`]).
    pub fn owe(&self, quota: &Quota, now: Nanos, units: u32) {
        self.0.owe(quota, now, units)
    }

    /// Units available at `now` (fractions dropped), without taking any.
    pub fn available(&self, quota: &Quota, now: Nanos) -> u32 {
        self.0.available(quota, now)
    }
}

impl Limiter for TokenBucket {
    fn peek(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        TokenBucket(self.0.copy()).check(quota, now, cost)
    }

    #[inline]
    fn check(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        self.0.take(quota, now, cost).0
    }
    super::gcra::refund_and_is_idle_of_field_0!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::testing::{quota, MS};
    use crate::limit::NANOS_PER_SEC;
    use std::time::Duration;

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
                    reset_after: (i as u64 + 1) * 100 * MS,
                    wait: 0,
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
        b.refund(&q, 0, 1);
        assert_eq!(b.available(&q, 0), 2);
        assert!(b.is_idle(&q, 0));
    }

    #[test]
    fn a_bucket_that_refilled_is_idle_and_one_that_did_not_is_not() {
        let q = quota(10, Duration::from_secs(1), 2);
        let b = TokenBucket::new();
        assert!(allowed(b.check(&q, NANOS_PER_SEC, 1)));
        assert!(!b.is_idle(&q, NANOS_PER_SEC + 99 * MS));
        assert!(b.is_idle(&q, NANOS_PER_SEC + 100 * MS));
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
