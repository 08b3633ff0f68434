//! GCRA (generic cell rate algorithm): the state machine behind the token bucket, the
//! leaky bucket and the `gcra` algorithm itself.
//!
//! The state is one `AtomicU64`, the "theoretical arrival time" (TAT): the instant at which
//! the bucket will be whole again. Units available at `now` are
//! `burst - (max(tat, now) - now) / emission`, fractions included, so refill never rounds
//! (half a unit short at t is whole at t + emission/2). A decision is one load and one CAS. A
//! TAT in the past is exactly a fresh state, which is what makes idle keys free to forget.
//!
//! GCRA and the token bucket admit exactly the same requests (a token bucket of capacity
//! `burst` refilled at `rate` is GCRA with tolerance `(burst - 1) / rate`); the tests check it
//! against a textbook floating-point token bucket.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Decision, Limiter, Nanos, Quota};

/// The most time a key's debt may take to refill (a year): a charge past it is dropped.
pub const MAX_DEBT: Nanos = 365 * 86_400 * super::NANOS_PER_SEC;

/// Per-key GCRA state: 8 bytes.
#[derive(Debug, Default)]
pub struct Gcra {
    // Relaxed everywhere: the atomic is the whole state and publishes no other memory, and
    // every read-modify-write sees the latest value in its modification order.
    tat: AtomicU64,
}

impl Gcra {
    /// A full bucket.
    pub const fn new() -> Self {
        Self {
            tat: AtomicU64::new(0),
        }
    }

    /// A state of its own with this one's value now.
    pub(crate) fn copy(&self) -> Self {
        Self {
            tat: AtomicU64::new(self.tat.load(Ordering::Relaxed)),
        }
    }

    /// Takes `cost` units at `now`, or says when they will be there. On success also returns
    /// `max(tat, now)`: the instant the request's units start, which a shaper waits for.
    #[inline]
    pub fn take(&self, quota: &Quota, now: Nanos, cost: u32) -> (Decision, Nanos) {
        if cost > quota.burst {
            return (Decision::Deny { retry_after: None }, now);
        }
        let need = quota.emission * u64::from(cost);
        super::decide(&self.tat, |tat| {
            let base = tat.max(now);
            // Saturating: a key deep in debt (see `owe`) is far ahead, never wrapped.
            let new_tat = base.saturating_add(need);
            let ahead = new_tat - now;
            if ahead > quota.tolerance {
                let deny = Decision::Deny {
                    retry_after: Some(ahead - quota.tolerance),
                };
                return Err((deny, now));
            }
            let allow = Decision::Allow {
                remaining: ((quota.tolerance - ahead) / quota.emission) as u32,
                reset_after: ahead,
                wait: 0,
            };
            Ok((new_tat, (allow, base)))
        })
    }

    /// Charges `units` at `now` whatever the bucket holds: past empty, the key owes them (its
    /// next requests are refused until the debt has refilled). For a cost known after the
    /// decision (a response's usage): the decision took what was reserved, this the rest.
    /// The debt stops at [`MAX_DEBT`] past the tolerance: beyond, a Retry-After says nothing
    /// more, and the arithmetic stays far from overflowing.
    pub fn owe(&self, quota: &Quota, now: Nanos, units: u32) {
        let need = quota.emission.saturating_mul(u64::from(units));
        let most = now.saturating_add(quota.tolerance).saturating_add(MAX_DEBT);
        let _ = self
            .tat
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
                Some(tat.max(now).saturating_add(need).min(most.max(tat)))
            });
    }

    /// Units owed at `now` past an empty bucket (a fraction owed counts as one; 0 when not
    /// in debt).
    pub fn owed(&self, quota: &Quota, now: Nanos) -> u64 {
        let ahead = self.tat.load(Ordering::Relaxed).saturating_sub(now);
        ahead
            .saturating_sub(quota.tolerance)
            .div_ceil(quota.emission)
    }

    /// Units available at `now` (fractions dropped), without taking any.
    pub fn available(&self, quota: &Quota, now: Nanos) -> u32 {
        let ahead = self.tat.load(Ordering::Relaxed).saturating_sub(now);
        (quota.tolerance.saturating_sub(ahead) / quota.emission) as u32
    }
}

impl Limiter for Gcra {
    fn peek(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        self.copy().check(quota, now, cost)
    }

    #[inline]
    fn check(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        self.take(quota, now, cost).0
    }
    /// Gives back `cost` units taken by an admitted `check`, when another rule refused the
    /// same request.
    fn refund(&self, quota: &Quota, _now: Nanos, cost: u32) {
        let give = quota.emission * u64::from(cost);
        // A state that refilled meanwhile saturates at "whole"; fetch_update never fails here.
        let _ = self
            .tat
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
                Some(tat.saturating_sub(give))
            });
    }

    #[inline]
    fn is_idle(&self, _quota: &Quota, now: Nanos) -> bool {
        self.tat.load(Ordering::Relaxed) <= now
    }
}

/// A [`Limiter`]'s `refund` and `is_idle` for a type whose state is the [`Gcra`] in its field
/// 0 (the token and leaky buckets).
macro_rules! refund_and_is_idle_of_field_0 {
    () => {
        fn refund(&self, quota: &Quota, now: Nanos, cost: u32) {
            self.0.refund(quota, now, cost)
        }
        #[inline]
        fn is_idle(&self, quota: &Quota, now: Nanos) -> bool {
            self.0.is_idle(quota, now)
        }
    };
}
pub(super) use refund_and_is_idle_of_field_0;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::testing::quota;
    use proptest::prelude::*;
    use std::time::Duration;

    /// The textbook token bucket, in floating point, as a reference model.
    struct Textbook {
        tokens: f64,
        last: f64,
    }

    impl Textbook {
        fn check(&mut self, rate_per_ns: f64, burst: f64, now: f64, cost: f64) -> bool {
            self.tokens = (self.tokens + (now - self.last) * rate_per_ns).min(burst);
            self.last = now;
            if self.tokens + 1e-9 >= cost {
                self.tokens -= cost;
                true
            } else {
                false
            }
        }
    }

    proptest! {
        /// GCRA admits exactly what a token bucket admits, for arrivals on a 1 ms grid (the
        /// float model is exact there for these rates).
        #[test]
        fn gcra_admits_exactly_what_a_textbook_token_bucket_admits(
            rate in 1u32..200,
            burst in 1u32..50,
            gaps in proptest::collection::vec(0u64..50, 1..300),
            costs in proptest::collection::vec(1u32..4, 300),
        ) {
            let q = quota(rate, Duration::from_secs(1), burst);
            let g = Gcra::new();
            let mut tb = Textbook { tokens: f64::from(burst), last: 0.0 };
            let mut now = 0u64;
            for (gap, cost) in gaps.iter().zip(&costs) {
                now += gap * 1_000_000;
                let cost = (*cost).min(burst);
                let want = tb.check(
                    1.0 / q.emission() as f64,
                    f64::from(burst),
                    now as f64,
                    f64::from(cost),
                );
                prop_assert_eq!(g.check(&q, now, cost).is_allowed(), want, "at {} ns", now);
            }
        }
    }
}
