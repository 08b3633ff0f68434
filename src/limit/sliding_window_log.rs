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

#[derive(Debug, Default, Clone)]
struct Log {
    /// Admission time and the running total of admitted cost including this entry, oldest
    /// first. The running totals rise, so the entry to wait for is found by binary search.
    entries: VecDeque<(Nanos, u64)>,
    /// Running total of every cost admitted (the odometer).
    total: u64,
    /// The odometer reading when the last entry that left the window was admitted.
    expired: u64,
}

impl Log {
    /// Drops entries that have left the window `(now - window, now]`.
    fn expire(&mut self, now: Nanos, window: Nanos) {
        while let Some(&(t, cum)) = self.entries.front() {
            if t + window > now {
                break;
            }
            self.entries.pop_front();
            self.expired = cum;
        }
    }

    /// Cost admitted inside the window.
    fn sum(&self) -> u64 {
        self.total - self.expired
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
    // A copy of one key's log, off the request path (`explain`).
    #[allow(clippy::disallowed_types)]
    fn peek(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        // The lock is held for the copy only.
        let log = self.log().clone();
        SlidingWindowLog(Mutex::new(log)).check(quota, now, cost)
    }

    fn check(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        let limit = u64::from(quota.burst());
        let cost = u64::from(cost);
        if cost > limit {
            return Decision::Deny { retry_after: None };
        }
        let window = quota.window();
        let mut log = self.log();
        log.expire(now, window);
        if log.sum() + cost <= limit {
            log.total += cost;
            let total = log.total;
            log.entries.push_back((now, total));
            return Decision::Allow {
                remaining: (limit - log.sum()) as u32,
                reset_after: window,
                wait: 0,
            };
        }
        // `cost` fits once the entries up to the first whose running total reaches
        // `total + cost - limit` have left: O(log n), however long the log.
        let need = log.total + cost - limit;
        let i = log.entries.partition_point(|&(_, cum)| cum < need);
        let (t, _) = log.entries[i];
        Decision::Deny {
            retry_after: Some(t + window - now),
        }
    }

    fn refund(&self, _quota: &Quota, now: Nanos, cost: u32) {
        let cost = u64::from(cost);
        let mut log = self.log();
        // Our entry is normally the newest; another request of the key may have come after.
        let own = |log: &Log, i: usize| {
            let before = if i == 0 {
                log.expired
            } else {
                log.entries[i - 1].1
            };
            log.entries[i].1 - before
        };
        let Some(i) = (0..log.entries.len())
            .rev()
            .find(|&i| log.entries[i].0 == now && own(&log, i) == cost)
        else {
            return;
        };
        log.entries.remove(i);
        for e in log.entries.range_mut(i..) {
            e.1 -= cost;
        }
        log.total -= cost;
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
