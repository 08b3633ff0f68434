//! The controller's sums, and where smoothing happens (an aggregator's are [`super::zone`]).
//!
//! [`Accumulator`] holds
//! each source's latest report as rates until that source's next one (at most two of its
//! intervals), sums them per (service, rule, key), and smooths the sum over time (an EWMA with
//! time constant `tau`; not while the controller warms up): smoothing after summing is what
//! lets replicas share a zone's hosts in any pattern. A sender's step up (and a step down that
//! matches one; [`KeySum::step`]), and a new key's sources in its first interval
//! ([`KeySum::add`]), move the smoothed sum at once. Drop ratios come from the smoothed sums.
//!
//! Must never: copy a source's name per entry; hold more than [`MAX_TRACKED`] contributions, a
//! quarter of them for one service, or [`MAX_HELD_BYTES`] per source; walk every key on each
//! report (replies and metrics come from a snapshot rebuilt at most every [`SNAPSHOT_EVERY`],
//! or ten times its own cost; state readers get what was built once per snapshot); or put
//! more than [`MAX_RATIOS_PER_SERVICE`] of one service's ratios, or [`MAX_RATIOS`] in all, in
//! a reply, or more than [`STATE_KEYS`] keys of a rule in what state readers get.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::Serialize;

use super::sources::{SourceRefusal, Sources};
use super::{drop_ratio, Limit, Ratio, Report, RuleHint};
use crate::limit::Distinct;

/// The most (source, key) contributions one accumulator holds: a few hundred bytes each with
/// their sums, so a flood of fake hosts or keys costs a bounded amount. Past it, new contributions are dropped
/// (and counted) until old ones expire.
pub const MAX_TRACKED: usize = 2_000_000;

/// The longest a key is young (see `KeySum::add`), whatever interval its first source states.
const YOUNG_MOST: f64 = 5.0;

/// One service holds at most this share (1/4) of [`MAX_TRACKED`].
const PER_SERVICE_SHARE: usize = 4;

/// The most key bytes (plus a fixed cost per entry) held for one source; entries past it are
/// dropped and counted.
pub const MAX_HELD_BYTES: usize = 4 << 20;

/// What one held entry costs against [`MAX_HELD_BYTES`] besides its key.
const ENTRY_COST: usize = 48;

/// Non-zero ratios of one service a reply carries (the highest): one service's flood of keys
/// cannot make the replies to every zone too large to read.
pub const MAX_RATIOS_PER_SERVICE: usize = 10_000;

/// Non-zero ratios in all (the highest), so that a reply to zone sums stays well under what a
/// reporter reads ([`super::MAX_REPLY`]) however many services are flooded.
pub const MAX_RATIOS: usize = 100_000;

/// Rules of one service whose hints a reply carries (the busiest), and in all.
pub const MAX_HINTS_PER_SERVICE: usize = 1_000;
pub const MAX_HINTS: usize = 10_000;

/// Replies use ratios at most this old (seconds), or older when rebuilding takes long.
pub const SNAPSHOT_EVERY: f64 = 0.1;

/// Up to this many keys, the snapshot is rebuilt after every change.
const SMALL: usize = 1024;

/// Keys of one (service, rule) that `/v1/state` and the status page show: the heaviest.
pub const STATE_KEYS: usize = 100;

/// A held value stands for at most this many of its source's intervals without a new report.
const HOLD_FOR: f64 = 2.0;

/// How long a stopping sender's last report stands (seconds): the time it says it covers (the
/// rest of its hosts' intervals), and then one of the sender's own intervals (`before`; none
/// for a sender first heard from now): the units of that time reach the controller through
/// another sender's forward only at the end of its interval, as this sender's would have.
/// Held for the covered time alone, a replaced aggregator's zone went uncounted for an
/// interval (over-admitting); held for two of its intervals, counted twice for one.
fn last_hold(secs: f64, before: Option<f64>) -> f64 {
    secs + before.unwrap_or(0.0)
}

/// How early (a share of its [`last_hold`]) a sweep takes a last report away: sweeps come with
/// records, and one still standing at a record just before its end stood to the next, an
/// interval late, counted twice beside its successor's forwards (under-admitting).
const LAST_EARLY: f64 = 0.125;

/// A key once heavy enough to watch is watched this long (seconds) after its load falls: a
/// key that bursts and falls quiet between bursts (its sum steps down with its senders' rates
/// at once) stays in the replies, so that every proxy's guard bounds its next burst.
pub const WATCH_FOR: f64 = 30.0;

#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Rate {
    offered: f64,
    admitted: f64,
    folded: u64,
}

/// One source's latest report, as rates.
#[derive(Debug, Default)]
pub struct Held {
    id: u64,
    rules: Vec<HeldRule>,
    entries: usize,
    /// From its sender's last report: held for its `interval` (see [`last_hold`]), not
    /// [`HOLD_FOR`] of it.
    last: bool,
}

#[derive(Debug)]
struct HeldRule {
    service: Arc<str>,
    rule: Arc<str>,
    keys: Vec<(Option<Arc<str>>, Rate)>,
}

#[derive(Debug)]
struct RuleAcc {
    limit: Limit,
    /// Which source (by id) said what limit: the smallest of those whose statement stands
    /// applies.
    limits: HashMap<u64, Limit>,
    /// What each source says of its hosts and its tail, while its statement stands.
    reporters: HashMap<u64, Reporter>,
    /// The tail's distinct keys, smoothed as its offered load is (so that keys moving out of
    /// the tail do not leave its lagging load against an allowance that has already shrunk),
    /// and when that was brought up to date.
    distinct: Option<(f64, f64)>,
    /// The union of the reporters' sketches, counted; `None` once a sketch changed.
    union: Option<f64>,
    keys: HashMap<Arc<str>, KeySum>,
    /// The folded tail ("other").
    other: Option<KeySum>,
}

impl RuleAcc {
    fn key_mut(&mut self, key: Option<&str>) -> Option<&mut KeySum> {
        match key {
            Some(k) => self.keys.get_mut(k),
            None => self.other.as_mut(),
        }
    }

    /// Every key with its sums, the folded tail (`None`) last.
    fn all_keys(&self) -> impl Iterator<Item = (Option<&Arc<str>>, &KeySum)> {
        self.keys
            .iter()
            .map(|(k, s)| (Some(k), s))
            .chain(self.other.iter().map(|s| (None, s)))
    }

    /// Source `id` no longer states a limit here: the smallest of the others applies.
    fn forget_limit(&mut self, id: u64) {
        if self
            .reporters
            .remove(&id)
            .is_some_and(|r| r.sketch.is_some())
        {
            self.union = None;
        }
        if self.limits.remove(&id).is_some() && !self.limits.is_empty() {
            self.limit = smallest(self.limits.values());
        }
    }

    /// The distinct keys the tails fold ([`Self::distinct_now`]), smoothed over `tau` up to
    /// `now`.
    fn smooth_distinct(&mut self, now: f64, tau: f64) -> f64 {
        let now_count = match self.union {
            Some(n) => n,
            None => {
                let n = self.distinct_now();
                self.union = Some(n);
                n
            }
        };
        let smoothed = match self.distinct {
            Some((d, at)) if tau > 0.0 => {
                let a = 1.0 - (-(now - at).max(0.0) / tau).exp();
                d + a * (now_count - d)
            }
            Some(_) => now_count,
            None => now_count,
        };
        self.distinct = Some((smoothed, now));
        smoothed.max(1.0)
    }

    /// The smoothed distinct tail keys as last brought up to date (or as they are now).
    fn distinct(&self) -> f64 {
        self.distinct
            .map_or_else(|| self.distinct_now(), |d| d.0.max(1.0))
    }

    /// The hosts reporting the rule, at least one.
    fn hosts(&self) -> f64 {
        let n: u64 = self.reporters.values().map(|r| u64::from(r.hosts)).sum();
        n.max(1) as f64
    }

    /// Whether every proxy reporting the rule names keys past its `name_above`.
    fn all_name_above(&self) -> bool {
        self.reporters.values().all(|r| r.relays_hints)
    }

    /// Sketches to union when one changed: what a rebuild may cost beside its keys.
    fn sketches(&self) -> usize {
        self.reporters
            .values()
            .filter(|r| r.sketch.is_some())
            .count()
    }

    /// The distinct keys the tails fold now: the union of the sources' sketches, or (for
    /// version-1 sources, which send a count) the most any one folded, whichever is more.
    fn distinct_now(&self) -> f64 {
        let mut union: Option<Distinct> = None;
        for r in self.reporters.values() {
            if let Some(s) = &r.sketch {
                union.get_or_insert_with(Distinct::default).union(s);
            }
        }
        let v1 = self
            .other
            .as_ref()
            .map_or(0, |o| o.folded.keys().next_back().copied().unwrap_or(0));
        let counted = union.map_or(0.0, |u| u.count());
        counted.max(v1 as f64).max(1.0)
    }
}

/// What one source says of a rule besides its keys.
#[derive(Debug)]
struct Reporter {
    /// The hosts behind it (one, for a host).
    hosts: u32,
    /// The distinct keys its tail folds.
    sketch: Option<Distinct>,
    /// The proxies behind it learn the rule's `name_above`: a host, or a zone whose sums say
    /// their hosts (a previous release's aggregator relays ratios but no hints, and its proxies
    /// fold whatever is past their `top_k`).
    relays_hints: bool,
    /// Until when its statement of the rule stands without another (its values' hold): a
    /// zone forwarding more often than its hosts report says nothing of a rule in some
    /// forwards, and is not gone from it.
    until: f64,
}

/// The ways a sender's step moved a key's smoothed sum (see `KeySum::stepped`).
const STEPPED_UP: u8 = 1;
const STEPPED_DOWN: u8 = 2;

/// One (service, rule, key): the sum of the values held for it and its smoothed history.
#[derive(Debug)]
struct KeySum {
    offered: f64,
    admitted: f64,
    smooth_offered: f64,
    smooth_admitted: f64,
    /// When the smoothed values were last brought up to date.
    at: f64,
    /// Until when the smoothed values move only one way: a sender's step moved them to its
    /// new rate, and the held sum may pull them back (against the step) only once it no
    /// longer holds that sender's counts from before the step (a zone's sums take one
    /// forward to hold the step whole). The other way, the other senders' rates go on
    /// moving them: frozen, they would fall behind what each proxy's own smoothed rate says,
    /// which its allowance pairs with the sum.
    still_until: f64,
    /// Which way the steps since the window up to `still_until` opened moved the sum:
    /// [`STEPPED_UP`], [`STEPPED_DOWN`], or both (the sum then stands still).
    stepped: u8,
    /// Senders' steps up not yet matched by steps down, and steps down not yet matched by
    /// steps up, until `match_until` (see [`KeySum::step`]).
    unmatched_up: f64,
    pending_down: f64,
    match_until: f64,
    /// Until when the key is watched whatever its load (see [`WATCH_FOR`]); set while the
    /// snapshot is rebuilt from shared references, hence a cell.
    watched_until: std::cell::Cell<f64>,
    contributors: u32,
    /// The most sources that contributed at once, and until when the key is young (its
    /// first sum's interval): a source that adds to it while young is one more part of the
    /// fleet's load from the start (zones forward at their own times), not a change in it.
    most_contributors: u32,
    young_until: f64,
    /// When the last contributor left (the key is dropped once its history has faded).
    idle_since: f64,
    fresh: bool,
    /// For the folded tail: how many sources folded how many keys (the most applies).
    folded: BTreeMap<u64, u32>,
    /// Once a source stated a limit of the key's own (`overrides:`): what each source states
    /// of it (its own, else the rule's), per second, and until when that stands. The key is
    /// held to the smallest; empty (most keys): the rule's.
    own: Vec<(u64, f64, f64)>,
}

impl KeySum {
    fn new(now: f64) -> Self {
        KeySum {
            offered: 0.0,
            admitted: 0.0,
            smooth_offered: 0.0,
            smooth_admitted: 0.0,
            at: now,
            still_until: f64::NEG_INFINITY,
            stepped: 0,
            unmatched_up: 0.0,
            pending_down: 0.0,
            match_until: f64::NEG_INFINITY,
            watched_until: std::cell::Cell::new(f64::NEG_INFINITY),
            contributors: 0,
            most_contributors: 0,
            young_until: f64::NEG_INFINITY,
            idle_since: now,
            fresh: true,
            folded: BTreeMap::new(),
            own: Vec::new(),
        }
    }

    /// Source `id` states `per_sec` as the key's limit until `until` (see [`KeySum::own`]).
    fn state_own(&mut self, id: u64, per_sec: f64, until: f64, now: f64) {
        self.own.retain(|s| s.0 != id && s.2 > now);
        self.own.push((id, per_sec, until));
    }

    /// The key's limit at `now`: the smallest its sources state while any states one of its
    /// own, else `rule` (a raise applies once every source states it).
    fn own_limit(&self, rule: f64, now: f64) -> f64 {
        self.own
            .iter()
            .filter(|s| s.2 > now)
            .map(|s| s.1)
            .reduce(f64::min)
            .unwrap_or(rule)
    }

    /// The smoothed (offered, admitted) at `now`, without changing anything.
    fn smoothed(&self, now: f64, tau: f64) -> (f64, f64) {
        if tau <= 0.0 {
            return (self.offered, self.admitted);
        }
        let toward = |(o, a): (f64, f64), secs: f64| {
            let f = 1.0 - (-secs.max(0.0) / tau).exp();
            (o + f * (self.offered - o), a + f * (self.admitted - a))
        };
        let mut from = (self.smooth_offered, self.smooth_admitted);
        let mut since = self.at;
        if since < self.still_until {
            // After a step, only the step's way (see `still_until`).
            let until = now.min(self.still_until);
            let (o, a) = toward(from, until - since);
            from = match self.stepped {
                STEPPED_UP => (o.max(from.0), a.max(from.1)),
                STEPPED_DOWN => (o.min(from.0), a.min(from.1)),
                _ => from,
            };
            since = until;
        }
        toward(from, now - since)
    }

    /// Brings the smoothed values to `now`: the held sum has stood since `at`.
    fn advance(&mut self, now: f64, tau: f64) {
        if now > self.at {
            // A key that has summed nothing yet (a proxy's announce names its rules' tails
            // empty) starts from its first sum still.
            self.fresh &= self.offered == 0.0 && self.smooth_offered == 0.0;
            (self.smooth_offered, self.smooth_admitted) = self.smoothed(now, tau);
            self.at = now;
        }
    }

    /// With no smoothing (`tau` 0: see [`Accumulator::settle`]), the smoothed sums are the
    /// held ones as soon as they change.
    fn settle(&mut self, tau: f64) {
        if tau <= 0.0 {
            (self.smooth_offered, self.smooth_admitted) = (self.offered, self.admitted);
        }
    }

    /// Adds a source's rates, counted over `secs`, for a key of `limit` per second (`None`:
    /// the tail).
    fn add(&mut self, r: Rate, secs: f64, limit: Option<f64>) {
        self.offered += r.offered;
        self.admitted += r.admitted;
        self.contributors += 1;
        if r.folded > 0 {
            *self.folded.entry(r.folded).or_default() += 1;
        }
        let joined = self.contributors > self.most_contributors;
        self.most_contributors = self.most_contributors.max(self.contributors);
        if self.fresh {
            self.young_until = self.at + secs.min(YOUNG_MOST);
        }
        if self.fresh || (joined && self.at < self.young_until) {
            // A key seen for the first time starts from its first sum (every source that
            // reports it within the first one's interval), not from zero, which would
            // under-drop while the average climbs; but a count that chance alone puts within
            // three standard deviations of the limit's (a Poisson count) starts at most at the
            // limit: one request in a 250 ms report is what a client at 1/s sends as often as
            // not, and no evidence of 4/s against 2/s.
            let (mut offered, mut admitted) = (r.offered, r.admitted);
            if let Some(limit) = limit {
                let at_limit = limit * secs;
                if offered * secs <= at_limit + 3.0 * at_limit.sqrt() && offered > limit {
                    admitted *= limit / offered;
                    offered = limit;
                }
            }
            self.smooth_offered += offered;
            self.smooth_admitted += admitted;
        }
    }

    /// A sender's step of `jump` units a second at `now` (its interval `secs`), for a key of
    /// `limit` units a second. A step up moves the smoothed sum at once (a surge); a step down
    /// as far as it matches steps up within two of the sender's intervals, before or after it
    /// (load moved between proxies: the sum stays where it was), and the rest of it as far as
    /// the sum stays at twice the limit or more (the key is still limited hard: its senders'
    /// own rates stepped, and their allowances pair them with the sum). The rest (a surge or a
    /// burst ending) is left to smoothing, so that a key that bursts keeps the ratio and the
    /// watch its last burst earned, and every proxy's guard bounds its next. Either way the sum
    /// then moves only the step's way for the sender's interval (see `still_until`).
    fn step(&mut self, jump: f64, now: f64, secs: f64, limit: f64) {
        if now > self.match_until {
            self.unmatched_up = 0.0;
            self.pending_down = 0.0;
        }
        self.match_until = now + HOLD_FOR * secs;
        let moved = if jump > 0.0 {
            let matched = self.pending_down.min(jump);
            self.pending_down -= matched;
            self.unmatched_up += jump - matched;
            jump - matched
        } else {
            let matched = self.unmatched_up.min(-jump);
            self.unmatched_up -= matched;
            // Unmatched, down to twice the limit at most (never up to it).
            let over = (self.smooth_offered - matched - 2.0 * limit).max(0.0);
            let far = (-jump - matched).min(over);
            self.pending_down += -jump - matched - far;
            -matched - far
        };
        if moved != 0.0 {
            self.smooth_offered = (self.smooth_offered + moved).max(0.0);
            if now >= self.still_until {
                self.stepped = 0;
            }
            self.stepped |= if moved > 0.0 {
                STEPPED_UP
            } else {
                STEPPED_DOWN
            };
            self.still_until = self.still_until.max(now + secs);
        }
    }

    fn remove(&mut self, r: Rate, now: f64) {
        self.contributors = self.contributors.saturating_sub(1);
        if self.contributors == 0 {
            // Exactly zero: no residue of floating-point additions and subtractions.
            self.offered = 0.0;
            self.admitted = 0.0;
            self.idle_since = now;
        } else {
            self.offered = (self.offered - r.offered).max(0.0);
            self.admitted = (self.admitted - r.admitted).max(0.0);
        }
        if r.folded > 0 {
            if let Some(n) = self.folded.get_mut(&r.folded) {
                *n -= 1;
                if *n == 0 {
                    self.folded.remove(&r.folded);
                }
            }
        }
    }

    /// The limit (per second) of this key under a rule of `limit` whose tails fold
    /// `distinct` keys fleet-wide, each with its own limit.
    fn limit<K>(&self, key: Option<K>, limit: f64, distinct: f64, now: f64) -> f64 {
        match key {
            None => limit * distinct,
            Some(_) => self.own_limit(limit, now),
        }
    }
}

/// A (service, rule, key) as seen over all live sources.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct KeyView {
    pub service: String,
    pub rule: String,
    pub key: Option<String>,
    pub limit_rps: f64,
    pub offered_rps: f64,
    pub admitted_rps: f64,
    pub ratio: f64,
    pub sources: usize,
}

impl KeyView {
    /// The view of `key` of `rule` of `service` with its limit, smoothed (offered, admitted)
    /// rates and how many sources hold values of it; its ratio follows from those.
    fn of(
        service: &str,
        rule: &str,
        key: Option<&Arc<str>>,
        limit_rps: f64,
        (offered_rps, admitted_rps): (f64, f64),
        sources: u32,
    ) -> KeyView {
        KeyView {
            service: service.to_string(),
            rule: rule.to_string(),
            key: key.map(|k| k.to_string()),
            limit_rps,
            offered_rps,
            admitted_rps,
            ratio: drop_ratio(offered_rps, limit_rps),
            sources: sources as usize,
        }
    }
}

/// One (service, rule) summed over its keys: smoothed offered and admitted requests/s, the
/// limit per key, and the expected dropped rate (offered x ratio, per key).
#[derive(Debug, Clone)]
pub struct RuleTotal {
    pub service: Arc<str>,
    pub rule: Arc<str>,
    pub limit: f64,
    pub offered: f64,
    pub admitted: f64,
    pub dropped: f64,
}

/// What `/v1/state` and the status page show of one (service, rule): its sums, its keys'
/// count and its [`STATE_KEYS`] heaviest keys (a rule's tail among them).
#[derive(Debug, Clone, Serialize)]
pub struct RuleState {
    pub service: String,
    pub rule: String,
    /// Keys summed (a tail counts as one).
    pub keys: usize,
    /// The limit per key, requests/s.
    pub limit_rps: f64,
    pub offered_rps: f64,
    pub admitted_rps: f64,
    pub dropped_rps: f64,
    /// What the limit lets through at this demand (the target of `admitted_rps`).
    pub allowed_rps: f64,
    /// The heaviest first.
    pub heaviest: Vec<KeyView>,
}

/// What state readers get: built at most once per snapshot, however many read, and shared.
#[derive(Debug, Clone, Default)]
pub struct StateView {
    pub rules: Arc<Vec<RuleState>>,
    /// Every live source and the seconds since its last report, most recent first.
    pub sources: Arc<Vec<(String, f64)>>,
}

/// The controller's sums: see the module's documentation.
#[derive(Debug)]
pub struct Accumulator {
    sources: Sources<Held>,
    rules: HashMap<Arc<str>, HashMap<Arc<str>, RuleAcc>>,
    /// The smoothing time constant, seconds.
    tau: f64,
    /// While the controller warms up its smoothed sums are its held sums (see
    /// [`Self::settle`]).
    settling: bool,
    max_tracked: usize,
    /// Contributions held now, over all sources and per service (at most a quarter of the
    /// bound each).
    tracked: usize,
    tracked_by: HashMap<Arc<str>, usize>,
    next_id: u64,
    /// Times reporters disagreed on a rule's limit.
    pub conflicts: u64,
    /// Entries dropped because a bound was reached.
    pub refused: u64,
    /// Ratios left out of the current snapshot's replies by [`MAX_RATIOS_PER_SERVICE`] and
    /// [`MAX_RATIOS`].
    pub ratios_cut: u64,
    /// How often the snapshot is rebuilt: [`SNAPSHOT_EVERY`], or ten times what the last
    /// rebuild took, whichever is longer.
    snapshot_every: f64,
    last_sweep: f64,
    snapshot: Snapshot,
    /// Since [`Self::steps_seen`] last took them: a step up left unmatched, a step down.
    steps: (bool, bool),
}

#[derive(Debug, Default)]
struct Snapshot {
    /// Per (service, rule): the sums the metrics show.
    totals: Vec<RuleTotal>,
    built: Option<f64>,
    dirty: bool,
    /// The reply carrying every ratio, serialized once per snapshot (aggregators get it),
    /// whole and as version 1.
    all: Option<bytes::Bytes>,
    all_v1: Option<bytes::Bytes>,
    /// Keys visited to build it.
    keys: usize,
    by_service: HashMap<Arc<str>, Vec<Ratio>>,
    hints: HashMap<Arc<str>, Vec<RuleHint>>,
    /// What state readers were shown since this snapshot was built.
    state: Option<StateView>,
}

impl Accumulator {
    /// An accumulator smoothing with time constant `tau` seconds.
    pub fn new(tau: f64) -> Self {
        Self::bounded(tau, MAX_TRACKED)
    }

    /// One holding at most `max_tracked` contributions.
    pub fn bounded(tau: f64, max_tracked: usize) -> Self {
        Accumulator {
            sources: Sources::default(),
            rules: HashMap::new(),
            tau: tau.max(1e-3),
            settling: false,
            max_tracked,
            tracked: 0,
            tracked_by: HashMap::new(),
            next_id: 0,
            conflicts: 0,
            refused: 0,
            ratios_cut: 0,
            snapshot_every: SNAPSHOT_EVERY,
            last_sweep: f64::NEG_INFINITY,
            snapshot: Snapshot::default(),
            steps: (false, false),
        }
    }

    /// Whether, since it was last asked, a report's step up was left half unmatched or more
    /// (a surge, or load moving here whose step down is still on its way: what a proxy takes
    /// for a surge, see `GlobalCounters::held`) and whether a step down came; both taken.
    pub fn steps_seen(&mut self) -> (bool, bool) {
        std::mem::take(&mut self.steps)
    }

    /// Whether the controller is warming up: until it is not, its smoothed sums are its held
    /// sums. It has no history to smooth with, and a key's history would start from the
    /// sources heard first (the part of the fleet one forward holds), so that its first
    /// authoritative sums would still be climbing toward the fleet's load for seconds.
    pub fn settle(&mut self, warming: bool) {
        self.settling = warming;
    }

    /// The time constant sums are smoothed with now: 0 (none) while settling.
    fn tau(&self) -> f64 {
        if self.settling {
            0.0
        } else {
            self.tau
        }
    }

    /// Reports refused by kind: (throttled, foreign, duplicate).
    pub fn refusals(&self) -> (u64, u64, u64) {
        (
            self.sources.throttled,
            self.sources.foreign,
            self.sources.duplicates,
        )
    }

    /// Takes a validated report at `now` (seconds on the caller's clock): its values replace
    /// the source's previous ones.
    /// `owner` is whose budget the source counts against (see [`Sources::admit`]).
    pub fn record(&mut self, report: &Report, owner: &str, now: f64) -> Result<(), SourceRefusal> {
        self.sweep(now);
        let tau = self.tau();
        let interval_before = self.sources.get_mut(&report.source).map(|s| s.interval);
        let src = self.sources.admit(report, owner, now)?;
        let held = &mut src.data;
        if held.id == 0 {
            self.next_id += 1;
            held.id = self.next_id;
        }
        let id = held.id;
        held.last = report.last;
        let old = std::mem::take(&mut held.rules);
        // A last report's rates, each at most what the source held before (see below).
        type Caps<'a> = HashMap<(&'a str, &'a str, Option<&'a str>), Rate>;
        let last_caps: Option<Caps> = report.last.then(|| {
            old.iter()
                .flat_map(|g| {
                    g.keys
                        .iter()
                        .map(move |(k, r)| ((&*g.service, &*g.rule, k.as_deref()), *r))
                })
                .collect()
        });
        self.tracked = self.tracked.saturating_sub(held.entries);
        held.entries = 0;
        for hr in &old {
            withdraw(&mut self.rules, &mut self.tracked_by, hr, now, tau);
        }
        // The service whose entries come now, and how many values it holds with them.
        let mut service_held: Option<(Arc<str>, usize)> = None;
        let secs = report.interval_ms as f64 / 1000.0;
        let zone = report.source.starts_with("zone:");
        // What it says of a rule stands as long as its values would (see `sweep`).
        // (A last report's: see `last_hold`.)
        let hold = if report.last {
            last_hold(secs, interval_before)
        } else {
            secs * HOLD_FOR
        };
        let mut bytes = 0usize;
        // (service, rule, key, jump) of each step up.
        type Up = (Arc<str>, Arc<str>, Arc<str>, f64);
        let mut stepped_up: Vec<Up> = Vec::new();
        let mut new: Vec<HeldRule> = Vec::new();
        let mut limits_set: HashMap<(Arc<str>, Arc<str>), Limit> = HashMap::new();
        let mut group_limit: Option<Limit> = None;
        for e in &report.entries {
            bytes += ENTRY_COST
                + e.key.as_ref().map_or(0, String::len)
                + e.sketch.as_ref().map_or(0, String::len);
            if bytes > MAX_HELD_BYTES || self.tracked >= self.max_tracked {
                self.refused += 1;
                continue;
            }
            // Each service's values count against its own budget, whoever sends them (its
            // proxies, or a zone's sums): one service's flood leaves room for the others.
            if service_held.as_ref().is_none_or(|(s, _)| **s != *e.service) {
                if let Some((s, n)) = service_held.take() {
                    self.tracked_by.insert(s, n);
                }
                let s = intern(&mut self.rules, &e.service);
                let n = self.tracked_by.get(&s).copied().unwrap_or(0);
                service_held = Some((s, n));
            }
            let held_now = &mut service_held.as_mut().expect("set above").1;
            if *held_now >= (self.max_tracked / PER_SERVICE_SHARE).max(1) {
                self.refused += 1;
                continue;
            }
            *held_now += 1;
            // Entries come grouped by rule: the names are looked up once per group.
            let same = new
                .last()
                .is_some_and(|g| *g.service == *e.service && *g.rule == *e.rule);
            if !same {
                let service = intern(&mut self.rules, &e.service);
                let rules = self.rules.get_mut(&*service).expect("interned");
                let rule = match rules.get_key_value(e.rule.as_str()) {
                    Some((r, _)) => r.clone(),
                    None => {
                        let r: Arc<str> = e.rule.as_str().into();
                        rules.insert(
                            r.clone(),
                            RuleAcc {
                                limit: e.limit,
                                limits: HashMap::new(),
                                reporters: HashMap::new(),
                                distinct: None,
                                union: None,
                                keys: HashMap::new(),
                                other: None,
                            },
                        );
                        r
                    }
                };
                // Grown as entries come: a report alternating rules makes many small groups.
                new.push(HeldRule {
                    service,
                    rule,
                    keys: Vec::new(),
                });
            }
            let group = new.last_mut().expect("pushed above");
            let rule = self
                .rules
                .get_mut(&*group.service)
                .and_then(|r| r.get_mut(&*group.rule))
                .expect("interned");
            // A source states one limit per rule and report: the first; another in the same
            // report is a conflict, counted, and costs no walk over the rule's sources.
            if same {
                if Some(e.limit) != group_limit {
                    self.conflicts += 1;
                }
            } else {
                let named = (group.service.clone(), group.rule.clone());
                match limits_set.get(&named) {
                    Some(l) => {
                        if *l != e.limit {
                            self.conflicts += 1;
                        }
                        group_limit = Some(*l);
                    }
                    None => {
                        limits_set.insert(named, e.limit);
                        group_limit = Some(e.limit);
                        // This report's statement of the rule replaces the last one.
                        let before = rule.reporters.insert(
                            id,
                            Reporter {
                                hosts: 1,
                                sketch: None,
                                relays_hints: !zone,
                                until: now + hold,
                            },
                        );
                        if before.is_some_and(|r| r.sketch.is_some()) {
                            rule.union = None;
                        }
                        match rule.limits.insert(id, e.limit) {
                            Some(l) if l == e.limit => {}
                            _ => {
                                if rule.limits.values().any(|l| *l != e.limit) {
                                    self.conflicts += 1;
                                }
                                rule.limit = smallest(rule.limits.values());
                            }
                        }
                    }
                }
            }
            // Looked up only when there is something to say: a zone's sums say their hosts on
            // one entry of each rule, and most entries carry no sketch.
            if let Some(r) = ((zone && e.hosts > 0) || e.sketch.is_some())
                .then(|| rule.reporters.get_mut(&id))
                .flatten()
            {
                // Only a zone's sums stand for several hosts: a host saying otherwise would
                // shrink every proxy's `name_above` and swell their reports.
                if zone {
                    r.hosts = r.hosts.max(e.hosts);
                    r.relays_hints = true;
                }
                if let Some(d) = e.sketch.as_deref().and_then(Distinct::decode) {
                    r.sketch.get_or_insert_with(Distinct::default).union(&d);
                    rule.union = None;
                }
            }
            // The rule's limit as the smallest any source states (the ratio's).
            let key_limit = rule.limit.per_second();
            let (key, ks) = match &e.key {
                Some(k) => {
                    let arc = match rule.keys.get_key_value(k.as_str()) {
                        Some((a, _)) => a.clone(),
                        None => {
                            let a: Arc<str> = k.as_str().into();
                            rule.keys.insert(a.clone(), KeySum::new(now));
                            a
                        }
                    };
                    let ks = rule.keys.get_mut(&*arc).expect("inserted");
                    (Some(arc), ks)
                }
                None => (None, rule.other.get_or_insert_with(|| KeySum::new(now))),
            };
            let mut rate = Rate {
                offered: e.offered as f64 / secs,
                admitted: e.admitted as f64 / secs,
                folded: e.keys_folded,
            };
            if let Some(before) = last_caps
                .as_ref()
                .and_then(|caps| caps.get(&(&*group.service, &*group.rule, e.key.as_deref())))
            {
                // A stopping sender's last report holds what is left of its intervals: no
                // more than it was sending (a previous release's aggregator stated too short
                // an interval for it, multiplying its zone's rates as it stopped).
                rate.offered = rate.offered.min(before.offered);
                rate.admitted = rate.admitted.min(before.admitted);
            }
            if key.is_some() && (e.own.is_some() || !ks.own.is_empty()) {
                ks.state_own(id, e.own.unwrap_or(e.limit).per_second(), now + hold, now);
            }
            let key_limit = if key.is_some() {
                ks.own_limit(key_limit, now)
            } else {
                key_limit
            };
            ks.advance(now, tau);
            ks.add(rate, secs, key.is_some().then_some(key_limit));
            // A sender's step moves the smoothed sum at once, as it moved the sender's own
            // smoothed rate (see `KeySum::step`; a key first seen now starts from its sum
            // already; a last report holds no step).
            if key.is_some() && e.jump != 0.0 && !ks.fresh && !report.last {
                ks.step(e.jump, now, secs, key_limit);
                self.steps.1 |= e.jump < 0.0;
                if e.jump > 0.0 {
                    if let Some(k) = &key {
                        stepped_up.push((
                            group.service.clone(),
                            group.rule.clone(),
                            k.clone(),
                            e.jump,
                        ));
                    }
                }
            }
            ks.settle(tau);
            group.keys.push((key, rate));
            self.tracked += 1;
        }
        if let Some((s, n)) = service_held {
            self.tracked_by.insert(s, n);
        }
        // A step up half unmatched or more once the whole report is in (its own steps down
        // may match it): a surge, or load moving here whose step down is on its way.
        self.steps.0 |= stepped_up.iter().any(|(s, r, k, jump)| {
            self.rules
                .get(s)
                .and_then(|r2| r2.get(r))
                .and_then(|rule| rule.keys.get(k))
                .is_some_and(|ks| 2.0 * ks.unmatched_up >= *jump)
        });
        for g in &mut new {
            g.keys.shrink_to_fit();
        }
        let src = self
            .sources
            .get_mut(&report.source)
            .expect("admitted above");
        src.data.entries = new.iter().map(|g| g.keys.len()).sum();
        if report.last {
            // Swept by its hold, as its values are.
            src.interval = hold;
        }
        src.data.rules = new;
        self.snapshot.dirty = true;
        Ok(())
    }

    /// Takes held values past their time away, forgets silent sources and faded keys, and
    /// rebuilds the ratio snapshot; at most every [`SNAPSHOT_EVERY`].
    pub fn sweep(&mut self, now: f64) {
        if now - self.last_sweep < self.snapshot_every {
            return;
        }
        self.last_sweep = now;
        let tau = self.tau();
        let mut stale: Vec<(u64, Vec<HeldRule>)> = Vec::new();
        let mut lapsed = 0;
        for (_, s) in self.sources.iter_mut() {
            let hold = if s.data.last {
                1.0 - LAST_EARLY
            } else {
                HOLD_FOR
            };
            if now - s.last > hold * s.interval && !s.data.rules.is_empty() {
                stale.push((s.data.id, std::mem::take(&mut s.data.rules)));
                lapsed += s.data.entries;
                s.data.entries = 0;
            }
        }
        self.sources.expire(now, |_, s| {
            lapsed += s.data.entries;
            stale.push((s.data.id, s.data.rules));
        });
        self.tracked = self.tracked.saturating_sub(lapsed);
        for (id, rules) in stale {
            for hr in rules {
                let Some(rule) = withdraw(&mut self.rules, &mut self.tracked_by, &hr, now, tau)
                else {
                    continue;
                };
                rule.forget_limit(id);
            }
        }
        // A source that has said nothing of a rule for as long as its values are held no
        // longer counts there: its limit, hosts and tail go.
        for rules in self.rules.values_mut() {
            for rule in rules.values_mut() {
                let lapsed: Vec<u64> = rule
                    .reporters
                    .iter()
                    .filter(|(_, r)| r.until < now)
                    .map(|(id, _)| *id)
                    .collect();
                for id in lapsed {
                    rule.forget_limit(id);
                }
            }
        }
        // A key nobody holds values for is kept while its smoothed history still matters.
        let faded = |k: &KeySum| {
            k.contributors == 0 && now - k.idle_since > 3.0 * tau && k.watched_until.get() <= now
        };
        for rules in self.rules.values_mut() {
            rules.retain(|_, rule| {
                rule.keys.retain(|_, k| !faded(k));
                if rule.other.as_ref().is_some_and(faded) {
                    rule.other = None;
                }
                !rule.keys.is_empty() || rule.other.is_some()
            });
        }
        self.rules.retain(|_, r| !r.is_empty());
        self.rebuild_snapshot(now);
    }

    fn rebuild_snapshot(&mut self, now: f64) {
        let started = tokio::time::Instant::now();
        // (ratio, offered, rule, key) per service: names are copied only for what travels.
        type Candidate<'a> = (f64, f64, &'a Arc<str>, Option<&'a Arc<str>>);
        let mut candidates: HashMap<&Arc<str>, Vec<Candidate>> = HashMap::new();
        let mut hints: HashMap<Arc<str>, Vec<(f64, RuleHint)>> = HashMap::new();
        let mut totals = Vec::new();
        let mut keys = 0;
        let tau = self.tau();
        for rules in self.rules.values_mut() {
            for rule in rules.values_mut() {
                rule.smooth_distinct(now, tau);
            }
        }
        for (service, rules) in &self.rules {
            for (rule_name, rule) in rules {
                let limit = rule.limit.per_second();
                let (hosts, distinct) = (rule.hosts(), rule.distinct());
                // Pigeonhole: a key offered past the limit fleet-wide is offered past
                // limit / hosts on at least one host; at half that, what proxies folding a
                // key hide of it is under half the limit (see watch_above).
                let name_above = limit / (2.0 * hosts);
                // Proxies that name every key past name_above hide less than hosts x
                // name_above, half the limit, of any key: one over the limit shows more than
                // half of it in the named counts, and one that shows less is under its limit
                // wherever the rest is. Watching from half the limit keeps replies small in a
                // fleet of thousands of hosts, where name_above is a fraction of a unit. Where
                // some proxies do not learn name_above (behind a previous release's
                // aggregator), every key seen past it is watched, so that they name it.
                // (Past a proxy's 1 000 extra names, or in a store's overflow, a key can hide
                // more; docs/fleet.md states the bound's conditions.)
                let watch_above = if rule.all_name_above() {
                    limit / 2.0
                } else {
                    name_above
                };
                // A union of sketches costs about what visiting eight keys does.
                keys += rule.sketches() * 8;
                let mut total = RuleTotal {
                    service: service.clone(),
                    rule: rule_name.clone(),
                    limit,
                    offered: 0.0,
                    admitted: 0.0,
                    dropped: 0.0,
                };
                for (key, k) in rule.all_keys() {
                    keys += 1;
                    let (offered, admitted) = k.smoothed(now, self.tau());
                    let ratio = drop_ratio(offered, k.limit(key, limit, distinct, now));
                    total.offered += offered;
                    total.admitted += admitted;
                    total.dropped += offered * ratio;
                    // Travels: every ratio above 0, and every named key heavy enough to watch
                    // (or so within WATCH_FOR), so that every proxy names it from then on: under
                    // its limit, with its
                    // ratio below 0, `(offered - limit) / offered`, from which a proxy knows
                    // the share of the fleet's load the limit allows (one version back reads
                    // it as 0).
                    let heavy = key.is_some() && offered >= watch_above;
                    if heavy {
                        k.watched_until.set(now + WATCH_FOR);
                    }
                    if ratio > 0.0 {
                        candidates
                            .entry(service)
                            .or_default()
                            .push((ratio, offered, rule_name, key));
                    } else if heavy || (key.is_some() && k.watched_until.get() > now) {
                        // Nothing offered: as far under as a ratio goes (0 would say no bound).
                        let under = if !limit.is_finite() {
                            0.0
                        } else if offered > 0.0 {
                            ((offered - limit) / offered).clamp(-1e6, 0.0)
                        } else {
                            -1e6
                        };
                        candidates
                            .entry(service)
                            .or_default()
                            .push((under, offered, rule_name, key));
                    }
                }
                let hint = RuleHint {
                    service: service.to_string(),
                    rule: rule_name.to_string(),
                    name_above,
                    cut_below: None,
                };
                hints
                    .entry(service.clone())
                    .or_default()
                    .push((total.offered, hint));
                totals.push(total);
            }
        }
        // Highest ratio first, then the heaviest; a rule's tail always travels.
        let rank = |a: &Candidate, b: &Candidate| {
            b.3.is_none()
                .cmp(&a.3.is_none())
                .then(b.0.total_cmp(&a.0))
                .then(b.1.total_cmp(&a.1))
        };
        let mut cut = 0;
        let mut all: Vec<(&Arc<str>, Candidate)> = Vec::new();
        let mut left_out: Vec<(&Arc<str>, Candidate)> = Vec::new();
        for (service, mut c) in candidates {
            // The highest ratios of each service travel; the rest of a flood of keys does not.
            if c.len() > MAX_RATIOS_PER_SERVICE {
                c.select_nth_unstable_by(MAX_RATIOS_PER_SERVICE - 1, rank);
                cut += c.len() - MAX_RATIOS_PER_SERVICE;
                left_out.extend(c.drain(MAX_RATIOS_PER_SERVICE..).map(|x| (service, x)));
            }
            all.extend(c.into_iter().map(|x| (service, x)));
        }
        // And a reply stays readable however many services are flooded at once.
        if all.len() > MAX_RATIOS {
            all.select_nth_unstable_by(MAX_RATIOS - 1, |a, b| rank(&a.1, &b.1));
            cut += all.len() - MAX_RATIOS;
            left_out.extend(all.drain(MAX_RATIOS..));
        }
        // A rule whose ratios were cut says the most any of them was: the most per rule
        // first (left-out entries of one rule mostly come together), then one lookup each.
        let mut cut_most: Vec<(&Arc<str>, &Arc<str>, f64)> = Vec::new();
        for (service, (ratio, _, rule, _)) in left_out {
            match cut_most.last_mut() {
                Some((s, r, most)) if Arc::ptr_eq(s, service) && Arc::ptr_eq(r, rule) => {
                    *most = most.max(ratio);
                }
                _ => cut_most.push((service, rule, ratio)),
            }
        }
        for (service, rule, most) in cut_most {
            if let Some(h) = hints
                .get_mut(service)
                .and_then(|h| h.iter_mut().find(|h| *h.1.rule == **rule))
            {
                h.1.cut_below = Some(h.1.cut_below.unwrap_or(0.0).max(most));
            }
        }
        // Hints of the busiest rules only, so that invented rule names cannot swell a reply.
        let by_offered = |a: &(f64, RuleHint), b: &(f64, RuleHint)| b.0.total_cmp(&a.0);
        let mut kept: Vec<(f64, RuleHint)> = Vec::new();
        for (_, mut h) in hints {
            if h.len() > MAX_HINTS_PER_SERVICE {
                h.select_nth_unstable_by(MAX_HINTS_PER_SERVICE - 1, by_offered);
                h.truncate(MAX_HINTS_PER_SERVICE);
            }
            kept.extend(h);
        }
        if kept.len() > MAX_HINTS {
            kept.select_nth_unstable_by(MAX_HINTS - 1, by_offered);
            kept.truncate(MAX_HINTS);
        }
        let mut hints: HashMap<Arc<str>, Vec<RuleHint>> = HashMap::new();
        for (_, h) in kept {
            hints.entry(h.service.as_str().into()).or_default().push(h);
        }
        let mut by_service: HashMap<Arc<str>, Vec<Ratio>> = HashMap::new();
        for (service, (ratio, _, rule, key)) in all {
            by_service.entry(service.clone()).or_default().push(Ratio {
                service: service.to_string(),
                rule: rule.to_string(),
                key: key.map(|k| k.to_string()),
                ratio,
            });
        }
        self.ratios_cut = cut as u64;
        // Rebuilding holds the lock: at most a tenth of the time goes to it.
        self.snapshot_every = (started.elapsed().as_secs_f64() * 10.0).max(SNAPSHOT_EVERY);
        self.snapshot = Snapshot {
            totals,
            built: Some(now),
            dirty: false,
            all: None,
            all_v1: None,
            keys,
            by_service,
            hints,
            state: None,
        };
    }

    /// What state readers are shown: built on the first read after each snapshot (one walk of
    /// the keys, keeping [`STATE_KEYS`] per rule), then shared by every read until the next
    /// one; nothing is copied per read but two reference counts.
    pub fn state(&mut self, now: f64) -> StateView {
        self.refresh(now);
        if self.snapshot.state.is_none() {
            self.snapshot.state = Some(self.build_state(now));
        }
        self.snapshot.state.clone().unwrap_or_default()
    }

    fn build_state(&self, now: f64) -> StateView {
        type Seen<'a> = (f64, f64, f64, u32, Option<&'a Arc<str>>);
        let heaviest = |a: &Seen, b: &Seen| b.0.total_cmp(&a.0);
        let mut rules = Vec::new();
        for (service, by_rule) in &self.rules {
            for (rule_name, rule) in by_rule {
                let limit = rule.limit.per_second();
                let distinct = rule.distinct();
                let mut state = RuleState {
                    service: service.to_string(),
                    rule: rule_name.to_string(),
                    keys: 0,
                    limit_rps: limit,
                    offered_rps: 0.0,
                    admitted_rps: 0.0,
                    dropped_rps: 0.0,
                    allowed_rps: 0.0,
                    heaviest: Vec::new(),
                };
                // Kept to twice what is shown, cut back whenever it fills: bounded however
                // many keys the rule has.
                let mut seen: Vec<Seen> = Vec::new();
                for (key, k) in rule.all_keys() {
                    let (offered, admitted) = k.smoothed(now, self.tau());
                    let limit_here = k.limit(key, limit, distinct, now);
                    let ratio = drop_ratio(offered, limit_here);
                    state.keys += 1;
                    state.offered_rps += offered;
                    state.admitted_rps += admitted;
                    state.dropped_rps += offered * ratio;
                    state.allowed_rps += offered.min(limit_here);
                    seen.push((offered, admitted, limit_here, k.contributors, key));
                    if seen.len() == 2 * STATE_KEYS {
                        seen.select_nth_unstable_by(STATE_KEYS - 1, heaviest);
                        seen.truncate(STATE_KEYS);
                    }
                }
                seen.sort_by(heaviest);
                seen.truncate(STATE_KEYS);
                state.heaviest = seen
                    .into_iter()
                    .map(|(offered, admitted, limit_here, sources, key)| {
                        KeyView::of(
                            service,
                            rule_name,
                            key,
                            limit_here,
                            (offered, admitted),
                            sources,
                        )
                    })
                    .collect();
                rules.push(state);
            }
        }
        rules.sort_by(|a, b| (&a.service, &a.rule).cmp(&(&b.service, &b.rule)));
        StateView {
            rules: Arc::new(rules),
            sources: Arc::new(self.source_ages(now)),
        }
    }

    /// Rebuilds the snapshot when due. A small fleet's costs little: it is rebuilt whenever
    /// anything changed, so that a reply reflects the report it answers.
    fn refresh(&mut self, now: f64) {
        let small = self.snapshot.keys <= SMALL;
        if self.snapshot.built.is_none() || (self.snapshot.dirty && small) {
            self.last_sweep = f64::NEG_INFINITY;
        }
        self.sweep(now);
    }

    /// The reply to a report of `services` (all, with `None`), from a snapshot at most
    /// [`SNAPSHOT_EVERY`] old (rebuilt now if there is none yet): the ratios that travel and
    /// each rule's hints.
    pub fn reply(&mut self, services: Option<&[&str]>, now: f64) -> super::Reply {
        self.refresh(now);
        let snap = &self.snapshot;
        let mut reply = super::Reply {
            version: super::VERSION,
            age_ms: 0,
            ratios: Vec::new(),
            rules: Vec::new(),
            warming: false,
        };
        let mut add = |s: &str| {
            if let Some(r) = snap.by_service.get(s) {
                reply.ratios.extend(r.iter().cloned());
            }
            if let Some(h) = snap.hints.get(s) {
                reply.rules.extend(h.iter().cloned());
            }
        };
        match services {
            None => snap.hints.keys().for_each(|s| add(s)),
            Some(s) => s.iter().for_each(|s| add(s)),
        }
        reply
    }

    /// The ratios that travel for `services` (all, with `None`): see [`Self::reply`].
    pub fn ratios(&mut self, services: Option<&[&str]>, now: f64) -> Vec<Ratio> {
        self.reply(services, now).ratios
    }

    /// Per (service, rule) sums from a snapshot at most [`SNAPSHOT_EVERY`] old.
    pub fn rule_totals(&mut self, now: f64) -> Vec<RuleTotal> {
        self.refresh(now);
        self.snapshot.totals.clone()
    }

    /// The JSON reply for every service (what an aggregator's zone sums are answered with),
    /// whole or as version 1, serialized once per snapshot.
    pub fn reply_all(&mut self, now: f64, wire2: bool) -> bytes::Bytes {
        self.refresh(now);
        let cached = if wire2 {
            &self.snapshot.all
        } else {
            &self.snapshot.all_v1
        };
        if let Some(b) = cached {
            return b.clone();
        }
        let mut reply = self.reply(None, now);
        if !wire2 {
            reply.downgrade();
        }
        let bytes = bytes::Bytes::from(serde_json::to_vec(&reply).unwrap_or_default());
        if wire2 {
            self.snapshot.all = Some(bytes.clone());
        } else {
            self.snapshot.all_v1 = Some(bytes.clone());
        }
        bytes
    }

    /// Every (service, rule, key) with its smoothed rates and drop ratio at `now`, optionally
    /// only for `services`: for tests; readers get [`Self::state`], which walks the keys at
    /// most once per snapshot and keeps [`STATE_KEYS`] of each rule.
    #[cfg(test)]
    pub fn view(&self, services: Option<&[&str]>, now: f64) -> Vec<KeyView> {
        let mut out = Vec::new();
        for (service, rules) in &self.rules {
            if services.is_some_and(|s| !s.contains(&&**service)) {
                continue;
            }
            for (rule_name, rule) in rules {
                let limit = rule.limit.per_second();
                let distinct = rule.distinct();
                for (key, k) in rule.all_keys() {
                    let (offered, admitted) = k.smoothed(now, self.tau());
                    let limit_here = k.limit(key, limit, distinct, now);
                    out.push(KeyView::of(
                        service,
                        rule_name,
                        key,
                        limit_here,
                        (offered, admitted),
                        k.contributors,
                    ));
                }
            }
        }
        out
    }

    /// Every live source with the seconds since its last report; most recent first.
    pub fn source_ages(&self, now: f64) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = self
            .sources
            .iter()
            .map(|(n, s)| (n.to_string(), (now - s.last).max(0.0)))
            .collect();
        out.sort_by(|a, b| a.1.total_cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
        out
    }

    /// Distinct sources still reporting.
    pub fn sources(&self) -> usize {
        self.sources.len()
    }

    /// Contributions held now.
    pub fn tracked(&self) -> usize {
        self.tracked
    }
}

/// Takes one source's held values of a rule out of the sums (bringing each key's smoothed
/// history up to `now` first) and off its service's count; the rule, if it is still there.
fn withdraw<'a>(
    rules: &'a mut HashMap<Arc<str>, HashMap<Arc<str>, RuleAcc>>,
    tracked_by: &mut HashMap<Arc<str>, usize>,
    held: &HeldRule,
    now: f64,
    tau: f64,
) -> Option<&'a mut RuleAcc> {
    if let Some(n) = tracked_by.get_mut(&*held.service) {
        *n = n.saturating_sub(held.keys.len());
        if *n == 0 {
            tracked_by.remove(&*held.service);
        }
    }
    let rule = rules.get_mut(&*held.service)?.get_mut(&*held.rule)?;
    for (k, r) in &held.keys {
        if let Some(ks) = rule.key_mut(k.as_deref()) {
            ks.advance(now, tau);
            ks.remove(*r, now);
            ks.settle(tau);
        }
    }
    Some(rule)
}

/// The shared name of `service`, added if new.
fn intern(rules: &mut HashMap<Arc<str>, HashMap<Arc<str>, RuleAcc>>, service: &str) -> Arc<str> {
    match rules.get_key_value(service) {
        Some((s, _)) => s.clone(),
        None => {
            let s: Arc<str> = service.into();
            rules.insert(s.clone(), HashMap::new());
            s
        }
    }
}

fn smallest<'a>(limits: impl Iterator<Item = &'a Limit>) -> Limit {
    limits
        .copied()
        .min_by(|a, b| a.per_second().total_cmp(&b.per_second()))
        .expect("at least one limit")
}
