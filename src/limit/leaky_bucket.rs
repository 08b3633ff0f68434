//! Leaky bucket as a queue (a shaper): requests leave at a steady `rate`, never in bursts.
//!
//! Each admitted request gets a departure time one emission interval after the previous one
//! and waits for it; up to `burst` requests may be waiting at once, the next ones are refused.
//! This is nginx's `limit_req` without `nodelay`. The state is the GCRA TAT (the next free
//! departure slot), so a decision is one CAS; the proxy sleeps the returned `wait` before
//! forwarding, without holding a thread. A request whose client leaves while it waits keeps its
//! slot (the outflow has a gap): freeing it would reorder those queued behind it.

use super::{Decision, Gcra, Limiter, Nanos, Quota};

/// Per-key leaky bucket state: 8 bytes.
#[derive(Debug, Default)]
pub struct LeakyBucket(Gcra);

impl Limiter for LeakyBucket {
    fn peek(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        LeakyBucket(self.0.copy()).check(quota, now, cost)
    }

    #[inline]
    fn check(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        match self.0.take(quota, now, cost) {
            (
                Decision::Allow {
                    remaining,
                    reset_after,
                    ..
                },
                start,
            ) => Decision::Allow {
                remaining,
                reset_after,
                wait: start - now,
            },
            (deny, _) => deny,
        }
    }
    super::gcra::refund_and_is_idle_of_field_0!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::testing::{quota, MS};
    use std::time::Duration;

    #[test]
    fn a_burst_is_spaced_out_at_the_rate_instead_of_passing_at_once() {
        // 10/s, 3 may wait: arrivals at t=0 leave at 0, 100, 200, 300 ms; the fifth is refused.
        let q = quota(10, Duration::from_secs(1), 3);
        let b = LeakyBucket::default();
        let waits: Vec<_> = (0..3)
            .map(|_| match b.check(&q, 0, 1) {
                Decision::Allow { wait, .. } => wait,
                d => panic!("{d:?}"),
            })
            .collect();
        assert_eq!(waits, [0, 100 * MS, 200 * MS]);
        assert_eq!(
            b.check(&q, 0, 1),
            Decision::Deny {
                retry_after: Some(100 * MS)
            }
        );
        // Once the first has left, one more may queue, behind the others.
        assert!(matches!(
            b.check(&q, 100 * MS, 1),
            Decision::Allow { wait, .. } if wait == 200 * MS
        ));
    }

    #[test]
    fn a_steady_flow_under_the_rate_never_waits() {
        let q = quota(10, Duration::from_secs(1), 5);
        let b = LeakyBucket::default();
        for i in 0..20 {
            assert!(matches!(
                b.check(&q, i * 100 * MS, 1),
                Decision::Allow { wait: 0, .. }
            ));
        }
    }
}
