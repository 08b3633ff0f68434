//! Sliding window counter: the previous window's count, weighted by how much of it still
//! overlaps the sliding window, plus the current window's count (Cloudflare's estimator).
//!
//! Admits when `prev * (W - elapsed) / W + cur + cost <= limit`, computed exactly in integers.
//! It smooths the fixed window's boundary burst with 8 bytes per key. The estimate assumes the
//! previous window's requests were spread evenly: when they were, it is exact; in the worst case
//! (all of them at its very end) a window of length W can hold up to twice the limit, never more,
//! since each fixed window holds at most `limit`.
//!
//! The state is one `AtomicU64`: 24 bits of window index, 20 bits each for the previous and the
//! current count, so limits are below 2^20 units per window (validated with the config).

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Decision, Limiter, Nanos, Quota};

/// The largest limit this algorithm can count.
pub const MAX_LIMIT: u32 = (1 << 20) - 1;
const COUNT_MASK: u64 = (1 << 20) - 1;
const INDEX_MASK: u64 = (1 << 24) - 1;

/// Per-key sliding window counter state: 8 bytes.
#[derive(Debug, Default)]
pub struct SlidingWindowCounter {
    // Relaxed: the atomic is the whole state and publishes nothing else.
    state: AtomicU64,
}

fn pack(index: u64, prev: u64, cur: u64) -> u64 {
    ((index & INDEX_MASK) << 40) | (prev << 20) | cur
}

/// `(prev, cur)` as seen from window `index`.
fn counts_at(state: u64, index: u64) -> (u64, u64) {
    let i = state >> 40;
    let (prev, cur) = ((state >> 20) & COUNT_MASK, state & COUNT_MASK);
    if i == index & INDEX_MASK {
        (prev, cur)
    } else if i == index.wrapping_sub(1) & INDEX_MASK {
        (cur, 0)
    } else {
        (0, 0)
    }
}

/// True when `cost` more fits at `elapsed` into a window holding `prev`/`cur`.
fn fits(prev: u64, cur: u64, cost: u64, limit: u64, window: u64, elapsed: u64) -> bool {
    u128::from(prev) * u128::from(window - elapsed) + u128::from(cur + cost) * u128::from(window)
        <= u128::from(limit) * u128::from(window)
}

/// The first offset into a window holding `prev`/`cur` at which `cost` fits, if any.
fn earliest(prev: u64, cur: u64, cost: u64, limit: u64, window: u64) -> Option<u64> {
    if cur + cost > limit {
        return None;
    }
    if prev == 0 {
        return Some(0);
    }
    // prev * (W - e) <= (limit - cur - cost) * W  <=>  e >= W - floor((limit-cur-cost)*W/prev)
    let room = u128::from(limit - cur - cost) * u128::from(window) / u128::from(prev);
    let e = u128::from(window).saturating_sub(room) as u64;
    (e < window).then_some(e)
}

impl Limiter for SlidingWindowCounter {
    fn peek(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        let copy = SlidingWindowCounter {
            state: std::sync::atomic::AtomicU64::new(
                self.state.load(std::sync::atomic::Ordering::Relaxed),
            ),
        };
        copy.check(quota, now, cost)
    }

    #[inline]
    fn check(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        let limit = u64::from(quota.burst());
        let cost64 = u64::from(cost);
        if cost64 > limit {
            return Decision::Deny { retry_after: None };
        }
        let window = quota.window();
        let index = now / window;
        let start = index * window;
        let elapsed = now - start;
        super::decide(&self.state, |state| {
            let (prev, cur) = counts_at(state, index);
            if !fits(prev, cur, cost64, limit, window, elapsed) {
                // Here or in one of the next two windows (after two, both counts are gone).
                let retry_at = earliest(prev, cur, cost64, limit, window)
                    .map(|e| start + e)
                    .filter(|&t| t > now)
                    .or_else(|| earliest(cur, 0, cost64, limit, window).map(|e| start + window + e))
                    .unwrap_or(start + 2 * window);
                return Err(Decision::Deny {
                    retry_after: Some(retry_at - now),
                });
            }
            let used = u128::from(prev) * u128::from(window - elapsed)
                + u128::from(cur + cost64) * u128::from(window);
            let left = u128::from(limit) * u128::from(window) - used;
            let allow = Decision::Allow {
                remaining: (left / u128::from(window)) as u32,
                reset_after: start + window - now,
                wait: 0,
            };
            Ok((pack(index, prev, cur + cost64), allow))
        })
    }

    fn refund(&self, quota: &Quota, now: Nanos, cost: u32) {
        let index = now / quota.window();
        let _ = self
            .state
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                ((s >> 40) == index & INDEX_MASK).then(|| {
                    let (prev, cur) = counts_at(s, index);
                    pack(index, prev, cur.saturating_sub(u64::from(cost)))
                })
            });
    }

    #[inline]
    fn is_idle(&self, quota: &Quota, now: Nanos) -> bool {
        counts_at(self.state.load(Ordering::Relaxed), now / quota.window()) == (0, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::testing::{quota, MS};
    use std::time::Duration;

    #[test]
    fn the_previous_window_weighs_by_its_overlap() {
        // 10 per second. 10 at the end of window 0; at 1.5 s the estimate is 10 * 0.5 = 5,
        // so exactly 5 more fit.
        let q = quota(10, Duration::from_secs(1), 10);
        let w = SlidingWindowCounter::default();
        for _ in 0..10 {
            assert!(w.check(&q, 900 * MS, 1).is_allowed());
        }
        let admitted = (0..10)
            .filter(|_| w.check(&q, 1500 * MS, 1).is_allowed())
            .count();
        assert_eq!(admitted, 5);
    }

    #[test]
    fn a_denial_names_the_first_instant_that_fits() {
        let q = quota(10, Duration::from_secs(1), 10);
        let w = SlidingWindowCounter::default();
        for _ in 0..10 {
            assert!(w.check(&q, 500 * MS, 1).is_allowed());
        }
        // In window 1, prev = 10: one more fits once 10 * (1 - e) <= 9, i.e. at e = 100 ms.
        let Decision::Deny {
            retry_after: Some(r),
        } = w.check(&q, 1000 * MS, 1)
        else {
            panic!()
        };
        assert_eq!(r, 100 * MS);
        assert!(!w.check(&q, 1100 * MS - 1, 1).is_allowed());
        assert!(w.check(&q, 1100 * MS, 1).is_allowed());
    }

    #[test]
    fn counts_older_than_the_previous_window_are_forgotten() {
        let q = quota(2, Duration::from_secs(1), 2);
        let w = SlidingWindowCounter::default();
        assert!(w.check(&q, 0, 2).is_allowed());
        assert!(!w.is_idle(&q, 1500 * MS));
        assert!(w.is_idle(&q, 2000 * MS));
        assert!(w.check(&q, 2000 * MS, 2).is_allowed());
    }
}
