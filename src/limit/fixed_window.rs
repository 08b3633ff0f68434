//! Fixed window: at most `limit` units per window; the count resets at each window boundary.
//!
//! Windows are aligned on the clock's epoch, so every key resets at the same instants. Cheap
//! and easy to explain, but a client can pass up to twice the limit across a boundary (the end
//! of one window and the start of the next). The state is one `AtomicU64`: the window's index
//! (low 32 bits of it) and the units counted in it.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Decision, Limiter, Nanos, Quota};

/// Per-key fixed window state: 8 bytes.
#[derive(Debug, Default)]
pub struct FixedWindow {
    // Relaxed: the atomic is the whole state and publishes nothing else.
    state: AtomicU64,
}

fn pack(index: u64, count: u32) -> u64 {
    ((index as u32 as u64) << 32) | u64::from(count)
}

fn unpack(state: u64) -> (u32, u32) {
    ((state >> 32) as u32, state as u32)
}

impl FixedWindow {
    /// Units counted in the window that contains `now`.
    fn count_at(state: u64, index: u64) -> u32 {
        let (i, count) = unpack(state);
        if i == index as u32 {
            count
        } else {
            0
        }
    }
}

impl Limiter for FixedWindow {
    fn peek(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        let copy = FixedWindow {
            state: std::sync::atomic::AtomicU64::new(
                self.state.load(std::sync::atomic::Ordering::Relaxed),
            ),
        };
        copy.check(quota, now, cost)
    }

    #[inline]
    fn check(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        let limit = quota.burst();
        if cost > limit {
            return Decision::Deny { retry_after: None };
        }
        let window = quota.window();
        let index = now / window;
        let ends_in = (index + 1) * window - now;
        super::decide(&self.state, |state| {
            let count = Self::count_at(state, index);
            if count + cost > limit {
                return Err(Decision::Deny {
                    retry_after: Some(ends_in),
                });
            }
            let allow = Decision::Allow {
                remaining: limit - count - cost,
                reset_after: ends_in,
                wait: 0,
            };
            Ok((pack(index, count + cost), allow))
        })
    }

    fn refund(&self, quota: &Quota, now: Nanos, cost: u32) {
        let index = now / quota.window();
        let _ = self
            .state
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                let (i, count) = unpack(s);
                (i == index as u32).then(|| pack(index, count.saturating_sub(cost)))
            });
    }

    #[inline]
    fn is_idle(&self, quota: &Quota, now: Nanos) -> bool {
        Self::count_at(self.state.load(Ordering::Relaxed), now / quota.window()) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::testing::{quota, MS};
    use std::time::Duration;

    #[test]
    fn the_limit_holds_per_window_and_resets_at_the_boundary() {
        let q = quota(3, Duration::from_secs(1), 3);
        let w = FixedWindow::default();
        for _ in 0..3 {
            assert!(w.check(&q, 200 * MS, 1).is_allowed());
        }
        assert_eq!(
            w.check(&q, 999 * MS, 1),
            Decision::Deny {
                retry_after: Some(MS)
            }
        );
        assert!(w.check(&q, 1000 * MS, 1).is_allowed());
        assert!(!w.is_idle(&q, 1500 * MS));
        assert!(w.is_idle(&q, 2000 * MS));
    }

    #[test]
    fn twice_the_limit_can_pass_across_a_boundary() {
        // The documented weakness, pinned so that nobody "fixes" it into another algorithm.
        let q = quota(5, Duration::from_secs(1), 5);
        let w = FixedWindow::default();
        let admitted = (0..10)
            .filter(|i| w.check(&q, 995 * MS + i * MS, 1).is_allowed())
            .count();
        assert_eq!(admitted, 10);
    }

    #[test]
    fn a_refund_in_the_same_window_gives_the_units_back() {
        let q = quota(2, Duration::from_secs(1), 2);
        let w = FixedWindow::default();
        assert!(w.check(&q, 0, 2).is_allowed());
        w.refund(&q, 0, 2);
        assert!(w.is_idle(&q, 0));
        assert!(w.check(&q, 0, 2).is_allowed());
    }
}
