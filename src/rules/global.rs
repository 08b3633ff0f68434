//! What a global rule decides by and counts: the drop ratios the control plane last sent (one
//! snapshot, swapped whole; it knows its age, so that ratios of a control plane gone silent
//! fall to zero and the proxy fails open), how their age is treated, and per (rule, key) the
//! offered and admitted requests the reporter drains. Pure data with no I/O: how replies
//! become ratios and counts become reports is the control plane's. Must never: block, or
//! hand one counter's interval to two reports.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::config::Rate;
use crate::limit::{Nanos, NANOS_PER_SEC};

/// Looked up on every request a global rule decides: foldhash's quality variant, seeded per
/// map, is much cheaper than SipHash on short keys, and its random seed keeps clients from
/// choosing colliding keys blind (as in the rules' stores).
type Map<V> = HashMap<String, V, foldhash::quality::RandomState>;

/// Drop ratios per (rule, key) for one service, as of `at`.
#[derive(Debug, Default)]
pub struct DropRatios {
    /// When the control plane computed these, on the limiter clock.
    pub at: Nanos,
    /// The sequence number of the report these answer: a key's choice (named or folded) in a
    /// later report, whose answer has not come, does not apply yet.
    pub answers: u64,
    /// How many reports before the one these answer the sums behind them hold this proxy's
    /// last report of (0 straight to the controller; behind an aggregator, 1 or 2).
    pub own_lag: u8,
    rules: Map<RuleRatios>,
}

#[derive(Debug)]
struct RuleRatios {
    keys: Map<f64>,
    /// For keys the reply does not name that this proxy folded into "other" in its report.
    other: f64,
    /// Units per second past which a key is reported by name whatever `top_k` says.
    name_above: f64,
    /// The reply left out ratios of this rule, each at most this.
    cut_below: Option<f64>,
}

impl Default for RuleRatios {
    fn default() -> Self {
        RuleRatios {
            keys: Map::default(),
            other: 0.0,
            name_above: f64::INFINITY,
            cut_below: None,
        }
    }
}

impl DropRatios {
    /// No ratios (everything admitted), as of `at`.
    pub fn empty(at: Nanos) -> Self {
        DropRatios {
            at,
            answers: 0,
            own_lag: 0,
            rules: Map::default(),
        }
    }

    /// These ratios as the answer to the report numbered `seq`.
    pub fn answering(mut self, seq: u64) -> Self {
        self.answers = seq;
        self
    }

    /// The ratios `(rule, key, ratio)` computed at `at`: a key of `None` is a rule's "other"
    /// ratio; a ratio above 1 is 1, one not finite is 0, and one below 0 is kept for a key
    /// (it says how far under its limit the key is: see [`Self::ratio_keep`]) and is 0 for
    /// the tail.
    pub fn of<'a>(
        at: Nanos,
        ratios: impl Iterator<Item = (&'a str, Option<&'a str>, f64)>,
    ) -> Self {
        let mut rules: Map<RuleRatios> = Map::default();
        for (rule, key, ratio) in ratios {
            let ratio = if ratio.is_finite() {
                ratio.min(1.0)
            } else {
                0.0
            };
            let rule = rules.entry(rule.to_string()).or_default();
            match key {
                // Below 0: how far under its limit the key is (see `ratio_keep`).
                Some(k) => {
                    rule.keys.insert(k.to_string(), ratio.max(MIN_RATIO));
                }
                None => rule.other = ratio.max(0.0),
            }
        }
        DropRatios {
            at,
            answers: 0,
            own_lag: 0,
            rules,
        }
    }

    /// The ratio for `key` (its text form) under `rule`: its own if the control plane named
    /// it; else, if `tail` (this proxy folded the key into the tail of the last report these
    /// answer, or has not reported it yet), the rule's "other" ratio; else 0 (a key the report
    /// named that the reply leaves out is under its limit).
    #[inline]
    pub fn ratio(&self, rule: &str, key: &[u8], tail: bool) -> f64 {
        self.ratio_with(rule, key, || tail)
    }

    /// [`Self::ratio`], asking `tail` only for a key the reply does not name.
    #[inline]
    pub fn ratio_with(&self, rule: &str, key: &[u8], tail: impl FnOnce() -> bool) -> f64 {
        self.ratio_keep(rule, key, tail).0
    }

    /// [`Self::ratio_with`], and for a key the reply names with a ratio other than 0 the
    /// fleet's share of its offered load that its limit allows, `limit / offered` (above 1
    /// for a key under its limit), which bounds what this proxy admits of the key between
    /// replies (0: no bound). A ratio is `(offered - limit) / offered`: the control plane
    /// sends it below 0 for keys it watches under their limit, which readers of one version
    /// back take as 0.
    #[inline]
    pub fn ratio_keep(&self, rule: &str, key: &[u8], tail: impl FnOnce() -> bool) -> (f64, f64) {
        let Some(r) = self.rules.get(rule) else {
            return (0.0, 0.0);
        };
        match std::str::from_utf8(key).ok().and_then(|k| r.keys.get(k)) {
            Some(0.0) => (0.0, 0.0),
            Some(&ratio) => (ratio.max(0.0), 1.0 - ratio),
            None if tail() => (r.other, 0.0),
            None => (0.0, 0.0),
        }
    }

    /// Sets what the control plane said of `rule` besides its ratios.
    pub fn hint(&mut self, rule: &str, name_above: f64, cut_below: Option<f64>) {
        let r = self.rules.entry(rule.to_string()).or_default();
        if name_above.is_finite() && name_above >= 0.0 {
            r.name_above = name_above;
        }
        r.cut_below = cut_below
            .filter(|c| c.is_finite())
            .map(|c| c.clamp(0.0, 1.0));
    }

    /// For a rule whose ratios were cut, the keys of `named` (what the report this answers
    /// named) that the reply leaves out keep their ratio in `previous`, at most the cut: their
    /// ratio was not sent, which is not the same as 0.
    pub fn keep_cut<'a>(
        &mut self,
        previous: &DropRatios,
        named: impl Iterator<Item = (&'a str, &'a str)>,
    ) {
        for (rule, key) in named {
            let Some(r) = self.rules.get_mut(rule) else {
                continue;
            };
            let Some(cut) = r.cut_below else { continue };
            if r.keys.contains_key(key) {
                continue;
            }
            let before = previous
                .rules
                .get(rule)
                .and_then(|p| p.keys.get(key))
                .copied()
                .unwrap_or(0.0);
            if before > 0.0 {
                r.keys.insert(key.to_string(), before.min(cut));
            }
        }
    }

    /// The provisional limit of a key of `rule` (limit `limit` units a second) that no reply
    /// has assigned: its share of the limit, limit / N over the N proxies the control plane
    /// last said report the rule (as `name_above`, limit / 2N); the whole limit before it
    /// has said.
    pub fn provisional(&self, rule: &str, limit: f64) -> f64 {
        self.rules
            .get(rule)
            .map(|r| 2.0 * r.name_above)
            .filter(|p| p.is_finite() && *p > 0.0)
            .map_or(limit, |p| p.min(limit))
    }

    /// Whether the control plane named `key` under `rule` (a key it watches: reported by name
    /// from then on), and the rate past which any key is named.
    fn watch(&self, rule: &str) -> Option<&RuleRatios> {
        self.rules.get(rule)
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

/// Offered and admitted units of one (global rule, key) since the last report, and the key's
/// share of what it offers.
#[derive(Debug)]
pub struct GlobalCounters {
    // Relaxed: counters; the reporter's swap reads each exactly once.
    offered: AtomicU64,
    admitted: AtomicU64,
    /// The key's credit toward its next admission, in 1/[`UNIT`]s of a unit (high 48 bits,
    /// signed), and where on the credit line that admission falls (low 16 bits): see
    /// [`GlobalCounters::share`]. Relaxed: one word, changed by compare-and-swap.
    share: AtomicU64,
    /// The guard's theoretical arrival time (a GCRA), on the limiter clock: the provisional
    /// limit's until the key is assigned, this proxy's allowance's after.
    guard: AtomicU64,
    /// This proxy's offered units per second of the key, smoothed over [`OWN_SMOOTHING`], as
    /// of the last report (high 32 bits) and of the one before (low 32 bits): `f32`s' bits;
    /// the reporter writes, decisions read.
    rate: AtomicU64,
    /// The last report's offered units per second, unsmoothed (an `f32`'s bits).
    last: AtomicU32,
    /// How many reports in a row found nothing offered (saturating; none taken yet counts as
    /// [`QUIET_REPORTS`]).
    quiet: AtomicU8,
    /// What the last report this key was in did with it, staged until its answer comes: the
    /// report's sequence number (high 48 bits), the choice before it (8 bits) and its own (low 8
    /// bits): 0 not yet reported, [`NAMED`] or [`FOLDED`]. Relaxed: one word the reporter
    /// writes once per report, read with the ratios that say which report they answer.
    choice: AtomicU64,
    /// The name reports and ratios know the key by when it is not the key itself (a digest
    /// of its private parts): worked out on the key's first decision.
    name: std::sync::OnceLock<Box<[u8]>>,
}

const NAMED: u64 = 1;
const FOLDED: u64 = 2;

/// What the last answered report did with a key: named it, folded it into the tail, or had
/// not had it (the key is not yet *assigned*).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Choice {
    New,
    Named,
    Folded,
}

/// The least ratio a reply's key keeps: a key at a millionth of its limit.
const MIN_RATIO: f64 = -1e6;

/// The time constant (seconds) a proxy smooths its own offered rate of a key over: the
/// controller's default `--smoothing`, so that this proxy's part of the fleet's smoothed
/// sum is what its own smoothed rate says, through a surge too.
pub const OWN_SMOOTHING: f64 = 1.0;

/// How far above its allowance an assigned key's guard admits (see the guard in
/// `RuleSet::check`): the allowance is estimated from a few counts, and below the share's
/// own rate the guard would refuse what the share admits in steady state.
pub const GUARD_HEADROOM: f64 = 1.25;

/// One unit of credit in a key's share: fractions of a request to 1/65 536.
const UNIT: i64 = 1 << 16;
/// A request's units past this count as this in its share (what the credit's bits hold).
const SHARE_MAX_UNITS: u32 = 1 << 24;

fn pack(credit: i64, next: i64) -> u64 {
    ((credit << 16) as u64) | (next as u64 & 0xffff)
}

fn unpack(word: u64) -> (i64, i64) {
    ((word as i64) >> 16, (word & 0xffff) as i64)
}

impl Default for GlobalCounters {
    fn default() -> Self {
        GlobalCounters {
            offered: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
            // Where the first admission falls is drawn like every later one.
            share: AtomicU64::new(pack(0, i64::from(fastrand::u16(..)))),
            guard: AtomicU64::new(0),
            rate: AtomicU64::new(0),
            last: AtomicU32::new(0),
            quiet: AtomicU8::new(QUIET_REPORTS as u8),
            choice: AtomicU64::new(0),
            name: std::sync::OnceLock::new(),
        }
    }
}

impl GlobalCounters {
    /// The key's reported name, worked out by `shown` the first time.
    #[inline]
    pub(super) fn name(&self, shown: impl FnOnce() -> crate::key::KeyBuf) -> &[u8] {
        self.name
            .get_or_init(|| shown().into_vec().into_boxed_slice())
    }

    /// Whether the key's own name is set.
    pub(super) fn named(&self) -> bool {
        self.name.get().is_some()
    }

    /// The name the key's reports carry: its own name if it has one, else `key`.
    pub(super) fn reported<'a>(&'a self, key: &'a [u8]) -> &'a [u8] {
        self.name.get().map_or(key, |n| &n[..])
    }

    /// Whether the key's share `keep` (1 − its drop ratio) admits a request of `units`.
    ///
    /// Exact, not drawn: every request earns the key `keep × units` of credit, and a request
    /// is admitted when the credit passes the next admission's place, then pays `units`. Each
    /// admission's place is drawn afresh within its unit of credit (jittered, not at its
    /// end): requests that come in a fixed cycle (clients of one key taking turns) would
    /// otherwise find the admissions on the same places of the cycle every time, and the
    /// others starve. The credit stays within (−1, 1) units of a request, so a new key's
    /// first n requests admit n × keep within one, and any n in a row within two (the
    /// jitter's price: a stretch may begin after a place drawn late and end before one
    /// drawn early).
    #[inline]
    pub(super) fn share(&self, keep: f64, units: u32) -> bool {
        let units = i64::from(units.min(SHARE_MAX_UNITS));
        let earned = (keep.clamp(0.0, 1.0) * (units * UNIT) as f64) as i64;
        let mut admitted = false;
        let _ = self
            .share
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                let (credit, next) = unpack(word);
                let credit = credit + earned;
                admitted = credit >= (units - 1) * UNIT + next;
                Some(if admitted {
                    pack(credit - units * UNIT, i64::from(fastrand::u16(..)))
                } else {
                    pack(credit, next)
                })
            });
        admitted
    }

    /// A request [`Self::share`] admitted was refused by a later rule: its units go back to
    /// the key's credit, as if the share had refused it, so that its next request has the
    /// place; never past the most a request of `units` holds unadmitted, so that refusals
    /// bank no burst (the next n requests still admit fewer than n × keep + 2).
    pub(super) fn give_back(&self, units: u32) {
        let units = i64::from(units.min(SHARE_MAX_UNITS));
        let _ = self
            .share
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                let (credit, next) = unpack(word);
                let back = (credit + units * UNIT).min(units * UNIT - 1);
                Some(pack(back.max(credit), next))
            });
    }

    pub(super) fn offer(&self, units: u32) {
        self.offered.fetch_add(u64::from(units), Ordering::Relaxed);
    }

    pub(super) fn admit(&self, units: u32) {
        self.admitted.fetch_add(u64::from(units), Ordering::Relaxed);
    }

    /// What the last report answered by ratios answering report `answers` did with this key:
    /// [`Choice::New`] if no such report had it.
    #[inline]
    pub(super) fn choice(&self, answers: u64) -> Choice {
        let w = self.choice.load(Ordering::Relaxed);
        let choice = if w >> 16 <= answers { w } else { w >> 8 };
        match choice & 0xff {
            NAMED => Choice::Named,
            FOLDED => Choice::Folded,
            _ => Choice::New,
        }
    }

    /// Whether the key's guard of `per_sec` units a second admits a request of `units` at
    /// `now`: `Ok` with what it took (for [`Self::unguard`]), or `Err` with when a retry
    /// would be admitted. A GCRA that takes a request up to `early` or half its spacing early,
    /// whichever is more. The provisional limit gives no more (no burst beyond the request:
    /// a new key's first second gets the provisional limit, not a bucket's worth on top of
    /// it, and a client at the rate is not refused for its timers' jitter); an assigned key's
    /// allowance, a report interval (what a reply's lag may owe it).
    pub(super) fn guard(
        &self,
        now: Nanos,
        per_sec: f64,
        units: u32,
        early: Nanos,
    ) -> Result<Nanos, Nanos> {
        let per_unit = (NANOS_PER_SEC as f64 / per_sec.max(1e-9)).min(1e18) as Nanos;
        let cost = per_unit.saturating_mul(u64::from(units)).max(1);
        let allowed = cost.saturating_add(early.max(cost / 2));
        let mut retry = 0;
        self.guard
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
                let next = tat.max(now).saturating_add(cost);
                if next - now <= allowed {
                    Some(next)
                } else {
                    retry = next - now - allowed;
                    None
                }
            })
            .map(|_| cost)
            .map_err(|_| retry)
    }

    /// Gives back what [`Self::guard`] took for a request a later rule refused.
    pub(super) fn unguard(&self, took: Nanos) {
        let _ = self
            .guard
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
                Some(tat.saturating_sub(took))
            });
    }

    /// Says what report `seq` does with this key (`folded`, or named), the choice before it
    /// standing until that report's answer comes.
    pub(super) fn choose(&self, seq: u64, folded: bool) {
        let w = self.choice.load(Ordering::Relaxed);
        let now = if folded { FOLDED } else { NAMED };
        // A second report under the same number (none is sent) keeps what stood before it.
        let before = if w >> 16 < seq {
            w & 0xff
        } else {
            (w >> 8) & 0xff
        };
        self.choice
            .store((seq << 16) | (before << 8) | now, Ordering::Relaxed);
    }

    /// What this proxy may admit of the key a second while the fleet admits `keep` of what
    /// it is offered: `keep` of this proxy's offered rate, the more of two. Its smoothed rate
    /// as of the report the fleet's sums behind `keep` hold (`lag` reports before the last),
    /// the rate that pairs with them: paired with a later one, a surge would be let through
    /// at its new rate times the old share. And the last report's rate as it was: when
    /// clients move to this proxy (the fleet's load unchanged), the share is right at once,
    /// and the guard must not hold them to what this proxy had before. So a burst shorter
    /// than a report interval is held to what this proxy was offered before it; a surge that
    /// lasts, from the report after it on, only by the share.
    #[inline]
    pub(super) fn allowance(&self, keep: f64, lag: u8) -> f64 {
        let word = self.rate.load(Ordering::Relaxed);
        let paired = if lag == 0 { word >> 32 } else { word } as u32;
        let last = self.last.load(Ordering::Relaxed);
        f64::from(f32::from_bits(paired).max(f32::from_bits(last))) * keep
    }

    /// Offered and admitted over the last `secs`, zeroed; one more quiet report if nothing
    /// was. The smoothed rate starts from the first rate offered, as the controller's sum
    /// does.
    pub(super) fn take(&self, secs: f64) -> (u64, u64) {
        let taken = (
            self.offered.swap(0, Ordering::Relaxed),
            self.admitted.swap(0, Ordering::Relaxed),
        );
        let word = self.rate.load(Ordering::Relaxed);
        let last = f64::from(f32::from_bits((word >> 32) as u32));
        let now = taken.0 as f64 / secs.max(1e-9);
        let bits = |r: f64| (r as f32).to_bits();
        self.last.store(bits(now), Ordering::Relaxed);
        if last == 0.0 {
            self.rate.store(
                u64::from(bits(now)) << 32 | u64::from(bits(now)),
                Ordering::Relaxed,
            );
        } else {
            let rate = last + (1.0 - (-secs / OWN_SMOOTHING).exp()) * (now - last);
            self.rate.store(
                u64::from(bits(rate)) << 32 | (word >> 32),
                Ordering::Relaxed,
            );
        }
        let quiet = self.quiet.load(Ordering::Relaxed);
        let quiet = if taken.0 == 0 {
            quiet.saturating_add(1)
        } else {
            0
        };
        self.quiet.store(quiet, Ordering::Relaxed);
        taken
    }
}

/// The counts of one global rule since the last report, heaviest keys first.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalCounts {
    pub rule: String,
    /// The rule's limit, which the control plane sums the fleet against.
    pub rate: Rate,
    /// (key, offered, admitted) for the keys reported by name: the `top_k` that offered most,
    /// then (up to [`EXTRA_NAMED`] more) those the control plane watches or that offered past
    /// its `name_above`.
    pub keys: Vec<Counted>,
    /// Offered and admitted of every other key, and how many keys that is.
    pub other: (u64, u64, u64),
    /// The distinct keys folded into `other` (those a full store could not track included).
    pub folded: crate::limit::Distinct,
}

/// Keys a report names per rule beyond its `top_k`, heaviest first: what the control plane
/// asked for, bounded so that a report's size does not grow with the keys.
pub const EXTRA_NAMED: usize = 1_000;

/// A key's name with its offered and admitted units.
pub type Counted = (String, u64, u64);

/// Splits `keys` (key, offered, admitted, counters) into those a report names and the tail,
/// marking each key's counters with the choice: the `top_k` heaviest, then up to
/// [`EXTRA_NAMED`] of those `ratios` watches for `rule` or that offered at least `name_above`
/// units per second over `secs`.
pub(super) fn choose_named(
    mut keys: Vec<(String, u64, u64, Arc<GlobalCounters>)>,
    ratios: &DropRatios,
    rule: &str,
    top_k: usize,
    secs: f64,
    seq: u64,
) -> (Vec<Counted>, Vec<Counted>) {
    keys.sort_unstable_by_key(|k| std::cmp::Reverse(k.1));
    let watched = ratios.watch(rule);
    let floor = watched.map_or(f64::INFINITY, |w| w.name_above * secs);
    let asked =
        |key: &str, o: u64| o as f64 >= floor || watched.is_some_and(|w| w.keys.contains_key(key));
    let mut named = Vec::new();
    let mut tail = Vec::new();
    let mut extra = 0;
    for (i, (key, o, a, counters)) in keys.into_iter().enumerate() {
        let mut name = i < top_k;
        if !name && extra < EXTRA_NAMED && asked(&key, o) {
            extra += 1;
            name = true;
        }
        counters.choose(seq, !name);
        if name {
            named.push((key, o, a));
        } else {
            tail.push((key, o, a));
        }
    }
    (named, tail)
}

/// Reports in a row that must find a global key unoffered before the sweep forgets it.
/// Forgotten, a key is new again, held to its provisional limit until a reply assigns it
/// anew: a client that pauses between requests, or a sweep just after a report, must not
/// make it so.
pub const QUIET_REPORTS: u64 = 4;

/// Global counters the sweep may forget: nothing to report, [`QUIET_REPORTS`] reports in a
/// row unoffered, and no decision holding them.
pub(super) fn global_idle(c: &Arc<GlobalCounters>) -> bool {
    quiet_for(c, QUIET_REPORTS as u8)
}

/// Global counters a full store may give to a new key: as [`global_idle`], but one quiet
/// report is enough (a full store would otherwise send the new key to the shared overflow).
pub(super) fn global_reclaimable(c: &Arc<GlobalCounters>) -> bool {
    quiet_for(c, 1)
}

fn quiet_for(c: &Arc<GlobalCounters>, reports: u8) -> bool {
    c.offered.load(Ordering::Relaxed) == 0
        && c.quiet.load(Ordering::Relaxed) >= reports
        && Arc::strong_count(c) == 1
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
