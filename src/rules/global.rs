//! What a global rule decides by and counts: the drop ratios the control plane last sent (one
//! snapshot, swapped whole; it knows its age, so that ratios of a control plane gone silent
//! fall to zero and the proxy fails open), how their age is treated, and per (rule, key) the
//! offered and admitted requests the reporter drains. Pure data with no I/O: how replies
//! become ratios and counts become reports is the control plane's. Must never: block, or
//! hand one counter's interval to two reports.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::config::Rate;
use crate::limit::Nanos;

/// Drop ratios per (rule, key) for one service, as of `at`.
#[derive(Debug, Default)]
pub struct DropRatios {
    /// When the control plane computed these, on the limiter clock.
    pub at: Nanos,
    rules: HashMap<String, RuleRatios>,
}

#[derive(Debug, Default)]
struct RuleRatios {
    keys: HashMap<String, f64>,
    /// For keys the reply does not name but which were folded into "other".
    other: f64,
}

impl DropRatios {
    /// No ratios (everything admitted), as of `at`.
    pub fn empty(at: Nanos) -> Self {
        DropRatios {
            at,
            rules: HashMap::new(),
        }
    }

    /// The ratios `(rule, key, ratio)` computed at `at`: a key of `None` is a rule's "other"
    /// ratio; a ratio outside [0, 1] is clamped, one not finite is 0.
    pub fn of<'a>(
        at: Nanos,
        ratios: impl Iterator<Item = (&'a str, Option<&'a str>, f64)>,
    ) -> Self {
        let mut rules: HashMap<String, RuleRatios> = HashMap::new();
        for (rule, key, ratio) in ratios {
            let ratio = if ratio.is_finite() {
                ratio.clamp(0.0, 1.0)
            } else {
                0.0
            };
            let rule = rules.entry(rule.to_string()).or_default();
            match key {
                Some(k) => {
                    rule.keys.insert(k.to_string(), ratio);
                }
                None => rule.other = ratio,
            }
        }
        DropRatios { at, rules }
    }

    /// The ratio for `key` (its text form) under `rule`: its own if the control plane named
    /// it, else the rule's "other" ratio, else 0.
    #[inline]
    pub fn ratio(&self, rule: &str, key: &[u8]) -> f64 {
        let Some(r) = self.rules.get(rule) else {
            return 0.0;
        };
        std::str::from_utf8(key)
            .ok()
            .and_then(|k| r.keys.get(k))
            .copied()
            .unwrap_or(r.other)
    }
}

/// How a proxy treats the age of its ratios.
#[derive(Debug, Clone, Copy)]
pub struct Staleness {
    pub stale_after: Nanos,
    pub decay: Nanos,
}

impl Staleness {
    /// The factor to apply to ratios of age `age`: 1 while fresh, then falling linearly to 0
    /// over `decay`; and whether they are stale.
    #[inline]
    pub fn factor(&self, age: Nanos) -> (f64, bool) {
        if age <= self.stale_after {
            return (1.0, false);
        }
        if self.decay == 0 {
            return (0.0, true);
        }
        let into = (age - self.stale_after) as f64 / self.decay as f64;
        ((1.0 - into).max(0.0), true)
    }
}

/// Offered and admitted requests of one (global rule, key) since the last report.
#[derive(Debug, Default)]
pub struct GlobalCounters {
    // Relaxed: counters; the reporter's swap reads each exactly once.
    offered: AtomicU64,
    admitted: AtomicU64,
}

impl GlobalCounters {
    pub(super) fn offer(&self) {
        self.offered.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn admit(&self) {
        self.admitted.fetch_add(1, Ordering::Relaxed);
    }

    /// Offered and admitted since the last take, zeroed.
    pub(super) fn take(&self) -> (u64, u64) {
        (
            self.offered.swap(0, Ordering::Relaxed),
            self.admitted.swap(0, Ordering::Relaxed),
        )
    }
}

/// The counts of one global rule since the last report, heaviest keys first.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalCounts {
    pub rule: String,
    /// The rule's limit, which the control plane sums the fleet against.
    pub rate: Rate,
    /// (key, offered, admitted) for the `top_k` keys that offered most.
    pub keys: Vec<(String, u64, u64)>,
    /// Offered and admitted of every other key, and how many keys that is.
    pub other: (u64, u64, u64),
}

/// Global counters with nothing to report (and no decision holding them) are as good as new.
pub(super) fn global_idle(c: &Arc<GlobalCounters>) -> bool {
    c.offered.load(Ordering::Relaxed) == 0 && Arc::strong_count(c) == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_ratios_fall_linearly_to_zero_over_decay() {
        let s = Staleness {
            stale_after: 5,
            decay: 10,
        };
        assert_eq!(s.factor(5), (1.0, false));
        assert_eq!(s.factor(10), (0.5, true));
        assert_eq!(s.factor(15), (0.0, true));
        assert_eq!(s.factor(1000), (0.0, true));
    }
}
