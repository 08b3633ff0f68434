//! The drop ratios a proxy holds: one snapshot, swapped whole when a reply arrives.
//!
//! Pure data with no I/O: the request path reads it through an `ArcSwap` load, the reporter
//! replaces it. It knows how old it is, so that a proxy cut off from the control plane can let
//! its ratios fall to zero (fail open).

use std::collections::HashMap;

use super::Reply;
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

    /// The ratios of `service` in `reply`, computed at `at`.
    pub fn from_reply(reply: &Reply, service: &str, at: Nanos) -> Self {
        let mut rules: HashMap<String, RuleRatios> = HashMap::new();
        for r in reply.ratios.iter().filter(|r| r.service == service) {
            let ratio = if r.ratio.is_finite() {
                r.ratio.clamp(0.0, 1.0)
            } else {
                0.0
            };
            let rule = rules.entry(r.rule.clone()).or_default();
            match &r.key {
                Some(k) => {
                    rule.keys.insert(k.clone(), ratio);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{Ratio, VERSION};

    #[test]
    fn named_keys_get_their_ratio_and_the_rest_the_other_ratio() {
        let reply = Reply {
            version: VERSION,
            age_ms: 0,
            ratios: vec![
                Ratio {
                    service: "s".into(),
                    rule: "r".into(),
                    key: Some("k".into()),
                    ratio: 0.5,
                },
                Ratio {
                    service: "s".into(),
                    rule: "r".into(),
                    key: None,
                    ratio: 0.1,
                },
                Ratio {
                    service: "other".into(),
                    rule: "r".into(),
                    key: Some("j".into()),
                    ratio: 0.9,
                },
            ],
        };
        let d = DropRatios::from_reply(&reply, "s", 7);
        assert_eq!(d.ratio("r", b"k"), 0.5);
        assert_eq!(
            d.ratio("r", b"j"),
            0.1,
            "another service's ratio does not apply"
        );
        assert_eq!(d.ratio("q", b"k"), 0.0);
        assert_eq!(d.at, 7);
    }

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
