//! Sliding window log: the exact count of units admitted in the last window, from a log of
//! admission times.
//!
//! Never admits more than `limit` units in any window of the configured length, and never
//! refuses a request that fits: the most accurate algorithm, and the most expensive, since it
//! keeps one entry (16 bytes) per admitted request still inside the window. Each request is its
//! own entry with its own cost, so requests in the same nanosecond are never merged.
//!
//! The log sits behind a per-key mutex: held for a few comparisons, never across an await, and
//! contended only by requests of the same key.

use std::collections::VecDeque;
#[allow(clippy::disallowed_types)] // per-key, see the module comment
use std::sync::Mutex;

use super::{Decision, Limiter, Nanos, Quota};

/// Bytes one admitted request costs while it is in the window.
pub const BYTES_PER_ENTRY: u64 = 16;

#[derive(Debug, Default)]
struct Log {
    /// Admission time and cost, oldest first.
    entries: VecDeque<(Nanos, u32)>,
    /// Sum of the costs in `entries`.
    sum: u64,
}

impl Log {
    /// Drops entries that have left the window `(now - window, now]`.
    fn expire(&mut self, now: Nanos, window: Nanos) {
        while let Some(&(t, c)) = self.entries.front() {
            if t + window > now {
                break;
            }
            self.entries.pop_front();
            self.sum -= u64::from(c);
        }
    }
}

/// Per-key sliding window log state.
#[derive(Debug, Default)]
#[allow(clippy::disallowed_types)] // per-key, see the module comment
pub struct SlidingWindowLog(Mutex<Log>);

impl SlidingWindowLog {
    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        // A panic while holding the lock cannot leave the log inconsistent in a way that
        // matters more than refusing every later request of the key would.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Limiter for SlidingWindowLog {
    fn check(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        let limit = u64::from(quota.burst());
        if u64::from(cost) > limit {
            return Decision::Deny { retry_after: None };
        }
        let window = quota.window();
        let mut log = self.log();
        log.expire(now, window);
        if log.sum + u64::from(cost) <= limit {
            log.entries.push_back((now, cost));
            log.sum += u64::from(cost);
            return Decision::Allow {
                remaining: (limit - log.sum) as u32,
                reset_after: window,
                wait: 0,
            };
        }
        // The earliest instant at which enough old entries have left for `cost` to fit.
        let mut left = log.sum;
        for &(t, c) in &log.entries {
            left -= u64::from(c);
            if left + u64::from(cost) <= limit {
                return Decision::Deny {
                    retry_after: Some(t + window - now),
                };
            }
        }
        unreachable!("cost <= limit, so the loop returns once the log is empty")
    }

    fn refund(&self, _quota: &Quota, now: Nanos, cost: u32) {
        let mut log = self.log();
        if let Some(i) = log.entries.iter().rposition(|&e| e == (now, cost)) {
            log.entries.remove(i);
            log.sum -= u64::from(cost);
        }
    }

    fn is_idle(&self, quota: &Quota, now: Nanos) -> bool {
        let mut log = self.log();
        log.expire(now, quota.window());
        if log.entries.is_empty() {
            // Give the memory of a past burst back.
            log.entries = VecDeque::new();
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::testing::{quota, MS};
    use std::time::Duration;

    #[test]
    fn the_limit_holds_in_every_window_not_just_aligned_ones() {
        let q = quota(5, Duration::from_secs(1), 5);
        let w = SlidingWindowLog::default();
        // Five at 995..999 ms: the boundary burst a fixed window would let double.
        for i in 0..5 {
            assert!(w.check(&q, 995 * MS + i * MS, 1).is_allowed());
        }
        for i in 0..5 {
            assert!(!w.check(&q, 1000 * MS + i * MS, 1).is_allowed());
        }
        // The first entry leaves exactly one window after it was admitted.
        assert_eq!(
            w.check(&q, 1994 * MS, 1),
            Decision::Deny {
                retry_after: Some(MS)
            }
        );
        assert!(w.check(&q, 1995 * MS, 1).is_allowed());
    }

    #[test]
    fn requests_in_the_same_nanosecond_are_separate_entries() {
        let q = quota(3, Duration::from_secs(1), 3);
        let w = SlidingWindowLog::default();
        for _ in 0..3 {
            assert!(w.check(&q, 7, 1).is_allowed());
        }
        assert!(!w.check(&q, 7, 1).is_allowed());
    }

    #[test]
    fn a_costly_request_waits_for_enough_entries_to_leave() {
        let q = quota(4, Duration::from_secs(1), 4);
        let w = SlidingWindowLog::default();
        assert!(w.check(&q, 0, 1).is_allowed());
        assert!(w.check(&q, 100 * MS, 1).is_allowed());
        assert!(w.check(&q, 200 * MS, 2).is_allowed());
        // 3 units need all three entries gone (4 - 1 - 1 leaves 2 in use): at 1200 ms.
        assert_eq!(
            w.check(&q, 300 * MS, 3),
            Decision::Deny {
                retry_after: Some(900 * MS)
            }
        );
        w.refund(&q, 200 * MS, 2);
        assert!(w.check(&q, 300 * MS, 2).is_allowed());
    }
}
