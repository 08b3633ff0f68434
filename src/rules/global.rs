//! What a global rule decides by and counts: the drop ratios the control plane last sent (one
//! snapshot, swapped whole; it knows its age, so that ratios of a control plane gone silent
//! fall to zero and the proxy fails open), how their age is treated, and per (rule, key) the
//! offered and admitted requests the reporter drains. Pure data with no I/O: how replies
//! become ratios and counts become reports is the control plane's. Must never: block, or
//! hand one counter's interval to two reports.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};
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
    #[inline(always)]
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
    /// This proxy's offered units per second of the key, smoothed over [`OWN_SMOOTHING`] (and
    /// jumping as [`jumped`] says), as of the last report (high 32 bits) and of the one before
    /// (low 32 bits): `f32`s' bits; the reporter writes, decisions read.
    rate: AtomicU64,
    /// This proxy's offered units per second of the key over the last report's interval, not
    /// smoothed (an `f32`'s bits): with the count since, its offered rate now (see
    /// [`Self::keep_now`]).
    raw: AtomicU32,
    /// The smoothed rate as of the report before the two `rate` holds (an `f32`'s bits).
    older: AtomicU32,
    /// The last jump of this proxy's offered rate ([`jumped`]): the low 32 bits of its
    /// report's sequence number (high 32 bits) and, for a surge (a jump up), what this proxy
    /// was allowed before it (low 32 bits, an `f32`'s; 0: none). 0: no jump yet.
    surge: AtomicU64,
    /// The last dip of this proxy's offered rate (jumps down within [`DIP_REPORTS`] of the
    /// first): the low 32 bits of the first one's report's sequence number (high 32 bits) and
    /// what this proxy was allowed before it (low 32 bits, an `f32`'s); 0: none. See
    /// [`Self::held`].
    dip: AtomicU64,
    /// That dip's fleet: the share `keep` in force before it (high 32 bits) and by how many
    /// units a second this proxy's rate fell in it (low 32 bits), `f32`s' bits.
    dip_fleet: AtomicU64,
    /// The share `keep` of the ratios in force at that surge's report (an `f32`'s bits): how
    /// much the fleet's load grew since, against this proxy's own jump, says whether the
    /// fleet surged too.
    surge_keep: AtomicU32,
    /// How many reports in a row found nothing offered (saturating; none taken yet counts as
    /// [`QUIET_REPORTS`]).
    quiet: AtomicU8,
    /// Bumped by every [`Self::take`] once it has changed the counts an allowance is worked
    /// out from: one worked out before it is stale.
    taken: AtomicU16,
    /// The allowance decisions last worked out ([`Self::allowance_of`]), tagged with the
    /// reply it is for and the [`Self::take`] it followed (high 32 bits; 0: none), and the
    /// allowance itself (low 32 bits, an `f32`'s, negative for a surge's bound): once per
    /// reply and report, not per request.
    allowed: AtomicU64,
    /// What the last report this key was in did with it, staged until its answer comes: the
    /// report's sequence number (high 48 bits), the choice before it (8 bits) and its own (low 8
    /// bits): 0 not yet reported, [`NAMED`] or [`FOLDED`]. Relaxed: one word the reporter
    /// writes once per report, read with the ratios that say which report they answer.
    choice: AtomicU64,
    /// For a rule whose cost is the response's: the key's mean charged units per admitted
    /// request, smoothed over the last [`MEAN_OF`] or so (an `f32`'s bits; 0: none charged
    /// yet), which a decision takes as the request's units (see [`Self::estimate`]).
    mean: AtomicU32,
    /// The name reports and ratios know the key by when it is not the key itself (a digest
    /// of its private parts): worked out on the key's first decision.
    name: std::sync::OnceLock<Box<[u8]>>,
}

/// How far past now a charge after the response sets a key's guard back at most (see
/// [`GlobalCounters::settle`]): a few report intervals' pacing; the debt itself is the
/// share's credit's to hold.
pub const GUARD_DEBT: Nanos = 2 * NANOS_PER_SEC;

/// How many of a key's recent charges its mean charged units weigh (see
/// [`GlobalCounters::estimate`]): every request counts the mean as offered and earns the key's
/// share a part of it, so that the mean's chance swings become the fleet's (the mean of a few
/// calls of widely spread sizes swings by a large part of itself); a change in what the key's
/// calls cost is charged in full meanwhile (the share pays actual units), only the estimate
/// follows it this slowly.
pub const MEAN_OF: f32 = 32.0;

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
/// own rate the guard would refuse what the share admits in steady state. None in a surge
/// (see [`GlobalCounters::allowance`]): a surge is not noise.
pub const GUARD_HEADROOM: f64 = 1.25;

/// A key's allowance is at least its provisional limit's share (see the guard in
/// `RuleSet::check`), up to this many units per report interval: below it, a report's count
/// is too few to estimate a rate from; above it, the floor would let a small proxy's surge
/// through at the whole provisional limit.
pub const GUARD_FLOOR_UNITS: f64 = 10.0;

/// How far past the fleet's share `keep_now` may go: a rate counted since the last report
/// reads low for a client that waits and then sends at once (the wait counts as its rate), so
/// that more than this would let such a client time its way past the share.
pub const KEEP_NOW_MOST: f64 = 1.125;

/// Past this many requests a report interval offered here (of the cost of the one deciding),
/// an assigned key is paced: its share admits up to [`PACED_SHARE`] times the fleet's, and the
/// guard lets through its allowance itself, with no headroom (see the guard in
/// `RuleSet::check`). A count this large estimates the allowance within a few percent, and a
/// rate counted since the report cannot follow a swing within the interval (a closed loop's
/// clients on a busy machine), where pacing holds the allowance through it. Fewer, and the
/// share decides.
pub const PACED_REQUESTS: f64 = 2000.0;

/// How far past the fleet's share a paced key's share goes: a swing of what this proxy is
/// offered down to half of what it reported still leaves the pace, not the share, deciding.
pub const PACED_SHARE: f64 = 2.0;

/// A jump up within this many reports of a jump down, while the fleet's load fell by as large
/// a part as this proxy's, is load coming back, not a surge past what this proxy was allowed
/// before the fall (see [`GlobalCounters::held`]).
pub const DIP_REPORTS: u32 = 3;

/// The least units a key's offered rate now is counted over (see
/// [`GlobalCounters::keep_now`]): fewer, and chance in the count moves the share.
pub const NOW_UNITS: f64 = 20.0;

/// A change in a key's offered rate from one report to the next is a step, not chance, past
/// this share of the rate (and three standard deviations of a Poisson count): see [`jumped`].
pub const JUMP_SHARE: f64 = 0.25;

/// Whether a key offered at `now` units a second over `secs`, against a smoothed `before`,
/// stepped: further from it than chance puts a count (three standard deviations of a Poisson
/// count of requests of `per_request` units each) and than [`JUMP_SHARE`] of the rate. A
/// proxy's smoothed rate then jumps to `now`, and its report says by how much, so that the
/// controller's smoothed sum jumps with it: a surge held within a report, and load moved
/// between proxies (one jumps up, another down) leaves the sum where it was. Counted in
/// units, requests of many units each (a response's tokens) swing the count by far more than
/// a count of units would by chance.
pub fn jumped(before: f64, now: f64, secs: f64, per_request: f64) -> bool {
    let (expected, counted) = (before * secs, now * secs);
    let gap = (counted - expected).abs();
    let larger = expected.max(counted);
    gap > 3.0 * (larger.max(1.0) * per_request.max(1.0)).sqrt() && gap > JUMP_SHARE * larger
}

/// One unit of credit in a key's share: fractions of a request to 2⁻²⁴. Far over its limit a
/// key's share of one proxy's requests is a few in ten thousand: coarser, each request's
/// earning would be rounded down by a few percent of itself.
const UNIT_BITS: u32 = 24;
const UNIT: i64 = 1 << UNIT_BITS;
/// A request's units past this count as this in its share (what the credit's bits hold); a
/// global rule's response cost may charge no more (`check-config`).
pub const SHARE_MAX_UNITS: u32 = 1 << 22;
/// The bits of the next admission's place within its unit of credit (the low bits of the
/// word; the credit, signed, has the rest): finer than a tiny share's earning per request, so
/// that clients taking turns do not find the admissions on the same places of the cycle.
const PLACE_BITS: u32 = 16;

fn pack(credit: i64, place: u16) -> u64 {
    ((credit << PLACE_BITS) as u64) | u64::from(place)
}

/// The next admission's place as the word holds it.
fn place(word: u64) -> u16 {
    word as u16
}

/// The credit, and the next admission's place in 1/[`UNIT`]s.
fn unpack(word: u64) -> (i64, i64) {
    (
        (word as i64) >> PLACE_BITS,
        i64::from(place(word)) << (UNIT_BITS - PLACE_BITS),
    )
}

impl Default for GlobalCounters {
    fn default() -> Self {
        GlobalCounters {
            offered: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
            // Where the first admission falls is drawn like every later one.
            share: AtomicU64::new(pack(0, fastrand::u16(..))),
            guard: AtomicU64::new(0),
            rate: AtomicU64::new(0),
            raw: AtomicU32::new(0),
            older: AtomicU32::new(0),
            surge: AtomicU64::new(0),
            dip: AtomicU64::new(0),
            dip_fleet: AtomicU64::new(0),
            surge_keep: AtomicU32::new(0),
            quiet: AtomicU8::new(QUIET_REPORTS as u8),
            taken: AtomicU16::new(0),
            allowed: AtomicU64::new(0),
            choice: AtomicU64::new(0),
            mean: AtomicU32::new(0),
            name: std::sync::OnceLock::new(),
        }
    }
}

impl GlobalCounters {
    /// Counters of their own with these ones' values now (for `explain`, which decides on
    /// the copy and takes nothing from the key).
    pub(super) fn copy(&self) -> Self {
        let r = Ordering::Relaxed;
        let name = std::sync::OnceLock::new();
        if let Some(n) = self.name.get() {
            let _ = name.set(n.clone());
        }
        GlobalCounters {
            offered: AtomicU64::new(self.offered.load(r)),
            admitted: AtomicU64::new(self.admitted.load(r)),
            share: AtomicU64::new(self.share.load(r)),
            guard: AtomicU64::new(self.guard.load(r)),
            rate: AtomicU64::new(self.rate.load(r)),
            raw: AtomicU32::new(self.raw.load(r)),
            older: AtomicU32::new(self.older.load(r)),
            surge: AtomicU64::new(self.surge.load(r)),
            dip: AtomicU64::new(self.dip.load(r)),
            dip_fleet: AtomicU64::new(self.dip_fleet.load(r)),
            surge_keep: AtomicU32::new(self.surge_keep.load(r)),
            quiet: AtomicU8::new(self.quiet.load(r)),
            taken: AtomicU16::new(self.taken.load(r)),
            allowed: AtomicU64::new(self.allowed.load(r)),
            choice: AtomicU64::new(self.choice.load(r)),
            mean: AtomicU32::new(self.mean.load(r)),
            name,
        }
    }

    /// Units offered since the last report.
    pub(super) fn offered_now(&self) -> u64 {
        self.offered.load(Ordering::Relaxed)
    }

    /// What `explain` shows of the key at `now`: counts since the last report, its smoothed
    /// offered rate as last reported, its credit in requests and when its guard admits next.
    pub(super) fn describe(&self, now: Nanos) -> serde_json::Value {
        let r = Ordering::Relaxed;
        let (credit, _) = unpack(self.share.load(r));
        let guard = self.guard.load(r);
        serde_json::json!({
            "offered_since_report": self.offered.load(r),
            "admitted_since_report": self.admitted.load(r),
            "offered_per_sec_reported": f32::from_bits((self.rate.load(r) >> 32) as u32),
            "share_credit": credit as f64 / UNIT as f64,
            "guard_next_in_ms": guard.saturating_sub(now) as f64 / 1e6,
        })
    }

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
    /// drawn early); a response cost's charges move it past that, by what a call used
    /// beyond or short of its estimate (see [`Self::settle`]).
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
                    pack(credit - units * UNIT, fastrand::u16(..))
                } else {
                    pack(credit, place(word))
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
                let (credit, _) = unpack(word);
                let back = (credit + units * UNIT).min(units * UNIT - 1);
                Some(pack(back.max(credit), place(word)))
            });
    }

    /// For a rule whose cost is the response's: the units a request of this key is decided
    /// by, before its response says what it cost: the key's mean charged units, or `reserve`
    /// before any was charged; at least 1 (a refused request offered something).
    #[inline]
    pub(super) fn estimate(&self, reserve: u32) -> u32 {
        let mean = f32::from_bits(self.mean.load(Ordering::Relaxed));
        let units = if mean > 0.0 {
            mean.round() as u32
        } else {
            reserve
        };
        units.max(1)
    }

    /// A request decided as `estimate` units (see [`Self::estimate`]) was charged `units`
    /// after its response: the admitted count the next report sends, the share's credit (if
    /// the share decided it, `shared`) and the guard (which took `per_unit` nanoseconds a
    /// unit; 0: none) take the difference, so that each is in actual units; and the key's mean
    /// moves toward `units`. The offered count keeps the estimate, as a refused request's
    /// does: the fleet's ratio then follows how many calls the key makes and their mean, not
    /// which sizes chance gave the admitted ones (which would swing it, and the next report's
    /// admissions with it). Over its estimate the credit goes into debt, which later
    /// requests earn back before the share admits again; under it, the difference is given
    /// back in full (capped at what a credit may hold, [`SHARE_MAX_UNITS`] either way): given
    /// back only in part, the share would admit less than its part of the limit, since a
    /// refund that comes while later requests have earned credit is as common as a debt. A
    /// credit a refund raised past one request admits the next ones at once; the guard still
    /// paces them.
    pub(super) fn settle(&self, now: Nanos, estimate: u32, units: u32, held: (bool, f32)) {
        let (shared, per_unit) = held;
        let delta = i64::from(units) - i64::from(estimate);
        if delta != 0 {
            let _ = self
                .admitted
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_add_signed(delta))
                });
        }
        if shared && delta != 0 {
            let most = i64::from(SHARE_MAX_UNITS) * UNIT;
            let least = -most;
            let _ = self
                .share
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                    let (credit, _) = unpack(word);
                    let after = credit.saturating_sub(delta.saturating_mul(UNIT));
                    // Never past what the credit's bits hold, nor past where it was.
                    let after = if delta < 0 {
                        after.min(most.max(credit))
                    } else {
                        after.max(least.min(credit))
                    };
                    Some(pack(after, place(word)))
                });
        }
        if per_unit > 0.0 && delta != 0 {
            let ns = (f64::from(per_unit) * delta.unsigned_abs() as f64).min(1e18) as u64;
            let _ = self
                .guard
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
                    // The share's credit holds the debt; the guard, which paces what this
                    // proxy admits, is set back by at most [`GUARD_DEBT`] past now.
                    Some(if delta > 0 {
                        tat.saturating_add(ns)
                            .min(tat.max(now.saturating_add(GUARD_DEBT)))
                    } else {
                        tat.saturating_sub(ns)
                    })
                });
        }
        let _ = self
            .mean
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let mean = f32::from_bits(bits);
                let units = units as f32;
                let next = if mean > 0.0 {
                    mean + (units - mean) / MEAN_OF
                } else {
                    units
                };
                Some(next.max(f32::MIN_POSITIVE).to_bits())
            });
    }

    /// Counts `units` offered; what was offered since the last report, these included.
    #[inline]
    pub(super) fn offer(&self, units: u32) -> u64 {
        let units = u64::from(units);
        self.offered.fetch_add(units, Ordering::Relaxed) + units
    }

    pub(super) fn admit(&self, units: u32) {
        self.admitted.fetch_add(u64::from(units), Ordering::Relaxed);
    }

    /// What the last report answered by ratios answering report `answers` did with this key:
    /// [`Choice::New`] if no such report had it.
    #[inline]
    pub(super) fn choice(&self, answers: u64) -> Choice {
        if answers == 0 {
            // No reply has answered a report (a warming controller's replies keep none): the
            // choice before the last report was no reply's either.
            return Choice::New;
        }
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
    /// standing until that report's answer comes; whether that choice before named it.
    pub(super) fn choose(&self, seq: u64, folded: bool) -> bool {
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
        before == NAMED
    }

    /// What this proxy may admit of the key a second while the fleet admits `keep` of what
    /// it is offered (the ratios answering report `answers`, whose sums hold this proxy's
    /// report `lag` before it) under a limit of `limit` units a second, and whether that is a
    /// surge's bound.
    ///
    /// In steady state, `keep` of its smoothed offered rate as the sums weighed it: as of the
    /// report before the one they hold (at most two back), or the one they hold if it stepped
    /// (paired with a later one, a surge would be let through at its new rate times the old
    /// share). Both sides' smoothed rates jump together
    /// ([`jumped`]), so once the sums hold a jump the allowance is this proxy's new share of
    /// the limit, whether the fleet surged with it or its load moved here. A surge here is
    /// held to what this proxy was allowed before it until the sums hold its report, and
    /// then, if the fleet's load grew by half this proxy's jump or more (it surged too, and
    /// other proxies' jumps may still be on their way through an aggregator's relay), until
    /// they hold the report after it; if it grew less, load moved here and the hold ends.
    #[inline]
    pub(super) fn allowance(&self, keep: f64, answers: u64, lag: u8, limit: f64) -> (f64, bool) {
        if let Some(held) = self.held(keep, answers, lag, limit) {
            return (held, true);
        }
        // The controller smooths its sums over time from when each report's rates arrive,
        // so sums taken as a report arrives weigh it hardly at all: they pair with this
        // proxy's smoothed rate from the report before the one they hold, unless that one
        // stepped (a step moves both at once; see [`jumped`]).
        let surge = self.surge.load(Ordering::Relaxed);
        let since_step = (answers as u32).wrapping_sub((surge >> 32) as u32);
        let stepped =
            surge != 0 && (since_step == u32::from(lag) || since_step == u32::from(lag) + 1);
        let back = if stepped { lag } else { lag.saturating_add(1) };
        let word = self.rate.load(Ordering::Relaxed);
        let paired = f64::from(f32::from_bits(match back {
            0 => (word >> 32) as u32,
            1 => word as u32,
            _ => self.older.load(Ordering::Relaxed),
        }));
        // Never past the whole limit: the sums and this proxy's part of them are smoothed in
        // different places, and near nothing the sums may say less than this proxy alone.
        ((paired * keep).min(limit), false)
    }

    /// [`Self::allowance`] for a decision on one key's counters (not the shared overflow's,
    /// whose keys each have their own `keep`): the reply `answers` says `keep` of the key
    /// whatever request asks, and the counts change only with a [`Self::take`], so it is
    /// worked out once for each reply and report and kept.
    #[inline]
    pub(super) fn allowance_of(&self, keep: f64, answers: u64, lag: u8, limit: f64) -> (f64, bool) {
        // Read before the counts: a take between them leaves what is worked out untagged
        // for the counts it changed.
        let taken = self.taken.load(Ordering::Acquire);
        // Bit 0 set: never the empty word's tag.
        let tag = (answers as u16 as u32) << 16 | u32::from(taken & 0x7fff) << 1 | 1;
        let word = self.allowed.load(Ordering::Relaxed);
        if (word >> 32) as u32 == tag {
            let a = f32::from_bits(word as u32);
            return (f64::from(a.abs()), a.is_sign_negative());
        }
        let (a, surge) = self.allowance(keep, answers, lag, limit);
        let a = a as f32;
        let bits = if surge { -a } else { a }.to_bits();
        self.allowed
            .store(u64::from(tag) << 32 | u64::from(bits), Ordering::Relaxed);
        (f64::from(a), surge)
    }

    /// The share of what this proxy is offered now that admits its allowance (see
    /// [`Self::allowance`], asked only when needed), for an assigned key the fleet admits
    /// `keep` of: `offered` units before this request in the `since` nanoseconds since the
    /// last report (of `interval`) took the counts.
    ///
    /// The fleet's `keep` is of what it was offered a reply ago; admitting `keep` of what it
    /// is offered now would pass on every swing of the load between (a closed loop's clients
    /// follow their own answers, and all proxies on a busy machine swing together) to the
    /// admitted rate. So this proxy's offered rate over the last interval, the count since the
    /// report taken for its part and the interval before for the rest, scales `keep` to
    /// admit its allowance; the allowances sum to the limit. Within half `keep` and
    /// [`KEEP_NOW_MOST`] times it: the rate is estimated from counts. `keep` as it is with too
    /// few units a report to estimate a rate from ([`NOW_UNITS`]), or with no report taken
    /// lately. With [`PACED_REQUESTS`] of `cost` or more a report, [`PACED_SHARE`] times
    /// `keep`, and `true`: the guard paces the key at its allowance.
    #[inline]
    pub(super) fn keep_now(
        &self,
        keep: f64,
        allowance: impl FnOnce() -> f64,
        (offered, cost): (f64, u32),
        since: Nanos,
        interval: Nanos,
    ) -> (f64, bool) {
        let before = f64::from(f32::from_bits(self.raw.load(Ordering::Relaxed)));
        let secs = interval as f64 / NANOS_PER_SEC as f64;
        if before * secs < NOW_UNITS || since > 2 * interval {
            return (keep, false);
        }
        if before * secs >= PACED_REQUESTS * f64::from(cost) {
            return ((PACED_SHARE * keep).min(1.0), true);
        }
        let allowance = allowance();
        let elapsed = since as f64 / NANOS_PER_SEC as f64;
        // Counted over the time since the report, and at least a quarter of an interval and
        // the time [`NOW_UNITS`] take (the interval before standing in for the rest).
        let least = (NOW_UNITS / before).clamp(secs / 4.0, secs);
        let now = (offered + before * (least - elapsed).max(0.0)) / least.max(elapsed);
        if !(now > 0.0 && allowance > 0.0) {
            return (keep, false);
        }
        let keep_now = (allowance / now).clamp(keep / 2.0, (KEEP_NOW_MOST * keep).min(1.0));
        (keep_now, false)
    }

    /// What a surge here is held to, while it is (see [`Self::allowance`]; after a dip of the
    /// fleet's, what was allowed before it, if more: [`Self::before_dip`]); for a key the
    /// reply does not bound (`keep` 0: under half its limit fleet-wide), until the sums hold
    /// the surge's report (if the fleet is still under half its limit with it, nothing to
    /// hold).
    #[inline]
    pub(super) fn held(&self, keep: f64, answers: u64, lag: u8, limit: f64) -> Option<f64> {
        let surge = self.surge.load(Ordering::Relaxed);
        let before = f64::from(f32::from_bits(surge as u32));
        if before <= 0.0 {
            return None;
        }
        // Wrapping: the low 32 bits of two numbers of one proxy's recent reports.
        let held = (answers as u32).wrapping_sub((surge >> 32) as u32) as i32 - i32::from(lag);
        let holds = match held {
            ..0 => true,
            0 => {
                let keep_before =
                    f64::from(f32::from_bits(self.surge_keep.load(Ordering::Relaxed)));
                if keep > 0.0 && keep_before > 0.0 {
                    let own = f64::from(f32::from_bits(
                        (self.rate.load(Ordering::Relaxed) >> 32) as u32,
                    ));
                    let jump = own - before / keep_before;
                    limit / keep - limit / keep_before >= jump / 2.0
                } else {
                    false
                }
            }
            _ => false,
        };
        holds.then(|| before.max(self.before_dip(surge)))
    }

    /// For a surge (its `surge` word) within [`DIP_REPORTS`] of a dip's first fall, while the
    /// fleet's load fell by as large a part of itself as this proxy's did between that fall
    /// and the surge (the ratios in force at each): what this proxy was allowed before the
    /// dip. Load coming back after a dip of the fleet's (a busy machine) is no surge past it;
    /// in the dip this proxy's rate stepped down a reply before the sums did, and what it was
    /// allowed there is short. Else 0. A fleet that fell by a smaller part gave the proxies
    /// that fell less a larger share meanwhile: held to what it had before, load coming back
    /// here would be admitted on top of that (a client that pauses on one proxy, or on all but
    /// one, every few reports). With every proxy held fallen by no larger a part than the
    /// fleet, the others fell by as large a part, and their shares did not grow.
    fn before_dip(&self, surge: u64) -> f64 {
        let dip = self.dip.load(Ordering::Relaxed);
        let since = ((surge >> 32) as u32).wrapping_sub((dip >> 32) as u32);
        if dip == 0 || since > DIP_REPORTS {
            return 0.0;
        }
        let fleet = self.dip_fleet.load(Ordering::Relaxed);
        let keep_before = f64::from(f32::from_bits((fleet >> 32) as u32));
        let fell = f64::from(f32::from_bits(fleet as u32));
        let keep_at_surge = f64::from(f32::from_bits(self.surge_keep.load(Ordering::Relaxed)));
        let allowed = f64::from(f32::from_bits(dip as u32));
        if !(keep_before > 0.0 && keep_at_surge > 0.0 && allowed > 0.0) {
            return 0.0;
        }
        // The parts that fell: the fleet's, from its sums (limit / keep), and this proxy's,
        // of its rate as the sums then paired it (what it was allowed / keep).
        let fleet_fell = 1.0 - keep_before / keep_at_surge;
        if fleet_fell >= fell * keep_before / allowed {
            allowed
        } else {
            0.0
        }
    }

    /// Records a fall of `by` units a second at report `seq`, this proxy allowed `allowed` by
    /// ratios that keep `keep` before it: the first of a dip, or one more within
    /// [`DIP_REPORTS`] of its first (which keeps the first's number, what was allowed before
    /// it and the fleet's share then, and adds the fall). Only a key the reply bounds.
    fn fell(&self, seq: u64, by: f64, allowed: f64, keep: f64) {
        if !(keep > 0.0 && allowed > 0.0) {
            return;
        }
        let bits = |r: f64| u64::from((r as f32).to_bits());
        let dip = self.dip.load(Ordering::Relaxed);
        let first = (dip >> 32) as u32;
        if dip != 0 && (seq as u32).wrapping_sub(first) <= DIP_REPORTS {
            let fleet = self.dip_fleet.load(Ordering::Relaxed);
            let fallen = f64::from(f32::from_bits(fleet as u32)) + by;
            self.dip_fleet
                .store(fleet & !0xffff_ffff | bits(fallen), Ordering::Relaxed);
        } else {
            self.dip
                .store((seq as u32 as u64) << 32 | bits(allowed), Ordering::Relaxed);
            self.dip_fleet
                .store(bits(keep) << 32 | bits(by), Ordering::Relaxed);
        }
    }

    /// Offered and admitted over the last `secs` for report `seq`, zeroed, and by how many
    /// units a second the smoothed rate jumped ([`jumped`]; 0 if it did not); one more quiet
    /// report if nothing was offered. The smoothed rate starts from the first rate offered, as
    /// the controller's sum does, and never jumps to nothing (a key missing from a report is no
    /// step the controller hears of). A jump up starts a surge held to what `bound` says the
    /// key is allowed now (see [`Self::allowance`]): units a second (0: no bound), by ratios
    /// that keep what share, and whether that is a surge's hold already (which the new jump
    /// continues, from where it began); a jump down ends one, and is a dip's fall, with what
    /// `bound` said was allowed before it (see [`Self::held`]).
    pub(super) fn take(
        &self,
        secs: f64,
        seq: u64,
        bound: impl FnOnce() -> (f64, f64, bool),
    ) -> (u64, u64, f64) {
        let (offered, admitted) = (
            self.offered.swap(0, Ordering::Relaxed),
            self.admitted.swap(0, Ordering::Relaxed),
        );
        let word = self.rate.load(Ordering::Relaxed);
        let last = f64::from(f32::from_bits((word >> 32) as u32));
        let now = offered as f64 / secs.max(1e-9);
        let bits = |r: f64| (r as f32).to_bits();
        self.raw.store(bits(now), Ordering::Relaxed);
        let mut jump = 0.0;
        if last == 0.0 {
            self.older.store(bits(now), Ordering::Relaxed);
            self.rate.store(
                u64::from(bits(now)) << 32 | u64::from(bits(now)),
                Ordering::Relaxed,
            );
        } else {
            let surge = self.surge.load(Ordering::Relaxed);
            let after_jump = surge != 0 && (surge >> 32) as u32 == (seq as u32).wrapping_sub(1);
            // A response cost's requests are the key's mean charged units each; a fixed or
            // request header's cost is not known here, and counts as one unit a request.
            let per_request = f64::from(f32::from_bits(self.mean.load(Ordering::Relaxed)));
            let rate = if now > 0.0 && jumped(last, now, secs, per_request) {
                jump = now - last;
                let (allowed, keep, surging) = bound();
                let held = if jump > 0.0 {
                    if !surging {
                        self.surge_keep.store(bits(keep), Ordering::Relaxed);
                    }
                    allowed
                } else {
                    self.fell(seq, -jump, allowed, keep);
                    0.0
                };
                self.surge.store(
                    (seq as u32 as u64) << 32 | u64::from(bits(held)),
                    Ordering::Relaxed,
                );
                now
            } else if now > 0.0 && after_jump {
                // The step fell inside the jump's interval, whose rate was part old, part new:
                // this is the first whole interval at the new rate, and both sums step to it.
                jump = now - last;
                now
            } else {
                last + (1.0 - (-secs / OWN_SMOOTHING).exp()) * (now - last)
            };
            self.older.store(word as u32, Ordering::Relaxed);
            self.rate.store(
                u64::from(bits(rate)) << 32 | (word >> 32),
                Ordering::Relaxed,
            );
        }
        let quiet = self.quiet.load(Ordering::Relaxed);
        let quiet = if offered == 0 {
            quiet.saturating_add(1)
        } else {
            0
        };
        self.quiet.store(quiet, Ordering::Relaxed);
        // Emptied as well as untagged: `taken` wraps, and a word a key under its limit left
        // standing for as long would match again.
        self.allowed.store(0, Ordering::Relaxed);
        self.taken.fetch_add(1, Ordering::Release);
        (offered, admitted, jump)
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
    /// The named keys with a limit of their own (`overrides:`), and that limit.
    pub owns: std::collections::HashMap<String, Rate>,
}

/// A key drained for a report: its name, offered and admitted units, step, counters, and its
/// own limit if it has one.
pub(super) type Drained = (String, u64, u64, f64, Arc<GlobalCounters>, Option<Rate>);

/// Keys a report names per rule beyond its `top_k`, heaviest first: what the control plane
/// asked for, bounded so that a report's size does not grow with the keys.
pub const EXTRA_NAMED: usize = 1_000;

/// Keys with a limit of their own a report names per rule beyond its `top_k`, heaviest first;
/// the rest (offered least) fold into the tail.
pub const MAX_OWN_NAMED: usize = 10_000;

/// A key's name with its offered and admitted units, and the step in its offered rate
/// (units a second; 0 if none, or if the report before folded the key: the controller's sum
/// for it did not hold this proxy's part to step from).
pub type Counted = (String, u64, u64, f64);

/// Splits `keys` (key, offered, admitted, counters) into those a report names and the tail,
/// marking each key's counters with the choice: the `top_k` heaviest, then up to
/// [`EXTRA_NAMED`] of those `ratios` watches for `rule` or that offered at least `name_above`
/// units per second over `secs` (before any reply, the rule's `limit`).
pub(super) fn choose_named(
    mut keys: Vec<Drained>,
    ratios: &DropRatios,
    rule: &str,
    limit: f64,
    top_k: usize,
    secs: f64,
    seq: u64,
) -> (Vec<Counted>, Vec<Counted>) {
    keys.sort_unstable_by_key(|k| std::cmp::Reverse(k.1));
    let watched = ratios.watch(rule);
    // Before any reply says the rule's name_above: a key this proxy alone was offered past
    // the fleet-wide limit is over it wherever the rest is, and folded it would get the
    // tail's ratio until the controller found it.
    let floor = watched.map_or(limit, |w| w.name_above) * secs;
    let asked =
        |key: &str, o: u64| o as f64 >= floor || watched.is_some_and(|w| w.keys.contains_key(key));
    let mut named = Vec::new();
    let mut tail = Vec::new();
    let mut extra = 0;
    let mut own_named = 0;
    for (i, (key, o, a, jump, counters, own)) in keys.into_iter().enumerate() {
        // A key with its own limit is named (the tail's ratio is the rule's limit's), the
        // heaviest MAX_OWN_NAMED of them: a report's size stays bounded.
        let mut name = i < top_k;
        if !name && own.is_some() && own_named < MAX_OWN_NAMED {
            own_named += 1;
            name = true;
        }
        if !name && extra < EXTRA_NAMED && asked(&key, o) {
            extra += 1;
            name = true;
        }
        let named_before = counters.choose(seq, !name);
        if name {
            named.push((key, o, a, if named_before { jump } else { 0.0 }));
        } else {
            tail.push((key, o, a, 0.0));
        }
    }
    (named, tail)
}

/// The `tracing` target of one event per key and report that counts it, at `trace` level
/// (what it was offered and admitted, its jump, the reply's share and the allowance it was
/// held to until then), in a span naming the proxy: `RUST_LOG=info,spillway::fleet=trace` on a
/// proxy or the fleet benches, and `bench/fleet_trace.py` sums what the proxies were allowed
/// against the limit report by report.
pub const FLEET_TRACE: &str = "spillway::fleet";

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

    /// `n` units offered to `c`, then report `seq` taken over 1 s with `bound` as what the
    /// guard allows: how many it counted, and its jump.
    fn reported(c: &GlobalCounters, n: u32, seq: u64, bound: (f64, f64, bool)) -> (u64, f64) {
        for _ in 0..n {
            c.offer(1);
        }
        let (offered, _, jump) = c.take(1.0, seq, || bound);
        (offered, jump)
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

    #[test]
    fn a_decision_s_allowance_is_worked_out_again_for_each_reply_and_report() {
        let c = GlobalCounters::default();
        let report = |n: u32, seq: u64| reported(&c, n, seq, (0.0, 0.0, false));
        let close = |(a, s): (f64, bool), (b, t): (f64, bool)| {
            assert_eq!(s, t, "surge");
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} against {b}");
        };
        report(100, 1);
        report(100, 2);
        let first = c.allowance_of(0.37, 2, 0, 1000.0);
        close(first, c.allowance(0.37, 2, 0, 1000.0));
        // Kept for the reply: another `keep` under it (never asked of one key's counters)
        // gets the kept one.
        assert_eq!(
            c.allowance_of(0.9, 2, 0, 1000.0),
            first,
            "kept for the reply"
        );
        // A new reply.
        close(c.allowance_of(0.2, 3, 0, 1000.0), (20.0, false));
        // A report that moves the rate, under the same reply: worked out again.
        report(400, 3);
        let after = c.allowance_of(0.2, 3, 0, 1000.0);
        close(after, c.allowance(0.2, 3, 0, 1000.0));
        assert!(after.0 > 30.0, "{after:?}");
        // A surge's bound keeps its flag.
        reported(&c, 1000, 4, (7.5, 0.2, false));
        close(c.allowance(0.2, 3, 0, 1000.0), (7.5, true));
        close(c.allowance_of(0.2, 3, 0, 1000.0), (7.5, true));
        close(c.allowance_of(0.2, 3, 0, 1000.0), (7.5, true));
    }

    #[test]
    fn a_charge_past_its_estimate_sets_the_guard_back_at_most_guard_debt() {
        let c = GlobalCounters::default();
        let now = 100 * NANOS_PER_SEC;
        // The guard took 500 units at a millisecond each; the call used 4 000 000.
        let took = c
            .guard(now, 1000.0, 500, NANOS_PER_SEC)
            .expect("a fresh guard");
        c.settle(now, 500, 4_000_000, (false, took as f32 / 500.0));
        assert_eq!(c.guard.load(Ordering::Relaxed), now + GUARD_DEBT);
        // Within it, the whole difference: 100 units more is 100 ms.
        let c = GlobalCounters::default();
        let took = c.guard(now, 1000.0, 500, NANOS_PER_SEC).unwrap();
        c.settle(now, 500, 600, (false, took as f32 / 500.0));
        assert_eq!(c.guard.load(Ordering::Relaxed), now + 600 * 1_000_000);
        // Under it, given back.
        c.settle(now, 500, 100, (false, took as f32 / 500.0));
        assert_eq!(c.guard.load(Ordering::Relaxed), now + 200 * 1_000_000);
    }

    #[test]
    fn a_step_past_chance_and_a_quarter_of_the_rate_jumps() {
        assert!(jumped(100.0, 300.0, 1.0, 1.0));
        assert!(jumped(300.0, 100.0, 1.0, 1.0));
        // Within three standard deviations of a Poisson count: chance (25 against 33.5).
        assert!(!jumped(100.0, 125.0, 1.0, 1.0));
        assert!(!jumped(2.0, 6.0, 1.0, 1.0));
        // Past them at a high rate, but under a quarter of it: a drift the smoothing takes.
        assert!(!jumped(10_000.0, 12_000.0, 1.0, 1.0));
        // The same rates over a longer interval are more counts, less chance; over a
        // shorter one, fewer.
        assert!(jumped(100.0, 150.0, 10.0, 1.0));
        assert!(!jumped(100.0, 150.0, 0.25, 1.0));
        // Counted in units of requests of 500 each: 30 requests' chance swings are no step,
        // 2.5 times as many is one.
        assert!(jumped(15_000.0, 21_000.0, 1.0, 1.0));
        assert!(!jumped(15_000.0, 21_000.0, 1.0, 500.0));
        assert!(jumped(15_000.0, 37_500.0, 1.0, 500.0));
    }

    #[test]
    fn a_step_moves_the_smoothed_rate_at_once_and_the_first_whole_interval_after_it_follows() {
        let c = GlobalCounters::default();
        let report = |n: u32, seq: u64| {
            let (offered, jump) = reported(&c, n, seq, (5.0, 0.5, false));
            assert_eq!(offered, u64::from(n));
            jump
        };
        let smoothed = || {
            f64::from(f32::from_bits(
                (c.rate.load(Ordering::Relaxed) >> 32) as u32,
            ))
        };
        assert_eq!(
            report(100, 1),
            0.0,
            "the first rate is where smoothing starts"
        );
        assert_eq!(report(100, 2), 0.0);
        // 3x from the middle of the interval: 200, a jump of 100, and a surge held to the
        // 5/s allowed before it.
        assert_eq!(report(200, 3), 100.0);
        assert_eq!(smoothed(), 200.0);
        assert_eq!(c.surge.load(Ordering::Relaxed) >> 32, 3);
        assert_eq!(c.allowance(0.5, 2, 0, 100.0), (5.0, true));
        // The first whole interval after it follows (60 is no jump from 200, and a jump of
        // 60); then smoothing again.
        assert_eq!(report(260, 4), 60.0);
        assert_eq!(smoothed(), 260.0);
        assert_eq!(report(270, 5), 0.0);
        assert!(smoothed() > 260.0 && smoothed() < 270.0);
        // A drop jumps down, and ends the surge.
        assert!(report(50, 6) < -200.0);
        assert_eq!(c.allowance(0.5, 6, 0, 100.0), (25.0, false), "50/s x 0.5");
        assert_eq!(report(50, 7), 0.0, "followed, nothing left to step");
        // A report without the key is no step.
        assert_eq!(report(0, 8), 0.0);
    }
}
