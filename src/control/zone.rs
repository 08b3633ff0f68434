//! An aggregator's sums: what its hosts offered and admitted over each forward's window.
//!
//! A host's report becomes rates (its counts over its own `interval_ms`), held from its arrival
//! for one of its intervals; [`ZoneSums::take`] hands over the integral of the held rates over
//! the window since the last take. So a host with a 250 ms, 1 s or 5 s interval adds what it
//! offered per second whatever this replica's forward interval. A host's next report arriving
//! before its last one's time is up brings the rest of it into the current window: every unit
//! a host reported is handed over once, whichever replicas its reports land on. Fractions of a
//! unit are carried to the next forward, never rounded away. Tails' sketches are unioned and
//! the hosts of each rule counted. Smoothing is the controller's ([`super::sum`]), after the
//! zone's sums meet.
//! Must never: hold more than `max_keys` entries (a long key is charged as several), or more
//! than half of them for one service's hosts, or more than `max_keys` keys pending, half for
//! one service (past it a key's units go to its rule's tail); hand one host's unit to two
//! forwards.

use std::collections::HashMap;

use super::sources::{SourceRefusal, Sources};
use super::{Entry, Limit, Report};
use crate::limit::Distinct;

/// An aggregator's sums since its last forward.
#[derive(Debug)]
pub struct ZoneSums {
    hosts: Sources<Holding>,
    /// What each (service, rule, key) accrued and not yet handed over: whole units go with
    /// the next take, fractions stay.
    pending: HashMap<Box<str>, HashMap<Box<str>, PendingRule>>,
    /// Keys in `pending`: at most `max_keys`, half of them for one service (a host replacing
    /// its report with new keys many times a window would add each report's); past it a key's
    /// units go to its rule's tail.
    pending_keys: PendingRoom,
    /// Entries held over all hosts, and per owner (at most half of `max_keys` each).
    held: usize,
    held_by: HashMap<Box<str>, usize>,
    max_keys: usize,
    /// When the window now pending began (seconds on the owner's clock).
    since: f64,
    pub conflicts: u64,
    pub refused: u64,
    /// Takes so far: a report recorded when this was n is in take n + 1 and later.
    takes: u64,
}

#[derive(Debug)]
struct PendingRule {
    /// The smallest limit its hosts stated since the last take.
    limit: Limit,
    /// `limit` was stated since the last take (else the next statement replaces it).
    stated: bool,
    keys: HashMap<Box<str>, Pending>,
    tail: Pending,
}

#[derive(Debug, Default)]
struct Pending {
    offered: f64,
    admitted: f64,
    /// The hosts' steps in offered rate ([`Entry::jump`]) not yet handed over.
    jump: f64,
    /// Accrued in the window now pending (else, once its fraction is handed on, forgotten).
    touched: bool,
    /// The smallest limit its hosts stated for the key (a host's own, else the rule's) since
    /// it was last handed on, relayed when some host stated one of its own.
    limit: Option<Limit>,
    own: bool,
}

impl Pending {
    /// The whole units accrued, taken out; the fractions stay.
    fn whole(&mut self) -> Option<(u64, u64)> {
        // A unit's rounding error in the rates' arithmetic is not a missing unit.
        let o = (self.offered + 1e-6).floor();
        if o < 1.0 {
            return None;
        }
        let a = (self.admitted + 1e-6).floor().min(o);
        self.offered -= o;
        self.admitted = (self.admitted - a).max(0.0);
        Some((o as u64, a as u64))
    }
}

/// One host's latest report, as rates, and how much of it was accrued.
#[derive(Debug, Default)]
struct Holding {
    /// The rates stand for `[from, until)`.
    from: f64,
    until: f64,
    /// Accrued into the sums up to here.
    accrued: f64,
    owner: Box<str>,
    rules: Vec<HeldRule>,
    /// What it counts against `max_keys`: an entry each, and a sketch as many entries as its
    /// bytes are.
    charge: usize,
}

#[derive(Debug)]
struct HeldRule {
    service: Box<str>,
    rule: Box<str>,
    limit: Limit,
    /// Keys the host folded (sketch), and how many (a version-1 host's count).
    sketch: Option<Distinct>,
    folded: u64,
    keys: Vec<HeldKey>,
}

/// A key (`None`: the tail) with its offered and admitted units per second, and its step in
/// offered rate until the first accrual hands it to the pending sums (once: it is an event,
/// not a rate).
#[derive(Debug)]
struct HeldKey {
    key: Option<Box<str>>,
    offered: f64,
    admitted: f64,
    jump: f64,
    /// The key's own limit, if the host stated one.
    own: Option<Limit>,
}

/// A (service, rule, key) whose offered rate stepped.
type StepOf = (Box<str>, Box<str>, Box<str>);

/// A step of a key ([`StepOf`]) in units a second, as [`ZoneSums::take_steps`] hands it over.
pub type Step = (Box<str>, Box<str>, Box<str>, f64);

/// Key bytes one entry's charge covers; a longer key is charged as that many entries (it is
/// held twice: with its host's values and in the pending sums), so that the room bounds memory
/// and not only a count.
const KEY_BYTES: usize = 64;

/// Entries a tail's sketch is charged as.
const SKETCH_CHARGE: usize = crate::limit::distinct::WIRE_LEN / 48;

/// What the hosts holding values in a window say of one rule.
#[derive(Default)]
struct WindowRule {
    hosts: u32,
    folded: u64,
    sketch: Option<Distinct>,
}

impl ZoneSums {
    /// Sums starting at `now`, holding at most `max_keys` entries.
    pub fn new(now: f64, max_keys: usize) -> Self {
        ZoneSums {
            hosts: Sources::default(),
            pending: HashMap::new(),
            pending_keys: PendingRoom::default(),
            held: 0,
            held_by: HashMap::new(),
            max_keys,
            since: now,
            conflicts: 0,
            refused: 0,
            takes: 0,
        }
    }

    /// Takes so far (see [`Self::take`] and [`Self::take_steps`]): a report
    /// [`Self::record`]ed now is in the next (its units, or for a take of steps its steps).
    pub fn takes(&self) -> u64 {
        self.takes
    }

    /// Reports refused for coming sooner than one per their source's interval.
    pub fn refusals_too_soon(&self) -> u64 {
        self.hosts.too_soon
    }

    /// Reports refused by kind: (throttled, foreign, duplicate).
    pub fn refusals(&self) -> (u64, u64, u64) {
        (
            self.hosts.throttled,
            self.hosts.foreign,
            self.hosts.duplicates,
        )
    }

    /// Takes a validated host report at `now`; `owner` as in [`Sources::admit`]. What the host's
    /// previous report still held is accrued up to now and replaced.
    pub fn record(&mut self, report: Report, owner: &str, now: f64) -> Result<(), SourceRefusal> {
        let source = self.hosts.admit(&report, owner, now)?;
        let holding = &mut source.data;
        // Early (a stopping host's last report, or jitter): what the previous report still
        // held comes now, so that every unit a host reported is handed over once.
        let until = holding.until;
        self.pending_keys.max = self.max_keys;
        accrue(
            holding,
            until,
            &mut self.pending,
            &mut self.pending_keys,
            &mut self.conflicts,
        );
        let before = std::mem::take(&mut holding.charge);
        self.held = self.held.saturating_sub(before);
        // Given back to whom it was charged (a shared token's host may name another service
        // first this time).
        if let Some(n) = self.held_by.get_mut(&*holding.owner) {
            *n = n.saturating_sub(before);
        }
        let secs = report.interval_ms as f64 / 1000.0;
        holding.from = now;
        holding.until = now + secs;
        holding.accrued = now;
        holding.owner = owner.into();
        holding.rules.clear();
        // One service's hosts may hold at most half the room: another service's keys always
        // find some.
        let mine = self.held_by.get(owner).copied().unwrap_or(0);
        let mut room = self
            .max_keys
            .saturating_sub(self.held)
            .min((self.max_keys / 2).saturating_sub(mine));
        let mut taken = 0;
        for e in report.entries {
            let key_units = e
                .key
                .as_ref()
                .map_or(1, |k| k.len().div_ceil(KEY_BYTES).max(1));
            let charge = key_units + if e.sketch.is_some() { SKETCH_CHARGE } else { 0 };
            if room < charge {
                self.refused += 1;
                continue;
            }
            room -= charge;
            taken += charge;
            let same = holding
                .rules
                .last()
                .is_some_and(|r| *r.service == *e.service && *r.rule == *e.rule);
            if !same {
                holding.rules.push(HeldRule {
                    service: e.service.into(),
                    rule: e.rule.into(),
                    limit: e.limit,
                    sketch: None,
                    folded: 0,
                    keys: Vec::new(),
                });
            }
            let rule = holding.rules.last_mut().expect("pushed above");
            if rule.limit != e.limit {
                self.conflicts += 1;
                if e.limit.per_second() < rule.limit.per_second() {
                    rule.limit = e.limit;
                }
            }
            if e.key.is_none() {
                rule.folded = rule.folded.max(e.keys_folded);
                if let Some(d) = e.sketch.as_deref().and_then(Distinct::decode) {
                    rule.sketch.get_or_insert_with(Distinct::default).union(&d);
                }
            }
            rule.keys.push(HeldKey {
                key: e.key.map(String::into_boxed_str),
                offered: e.offered as f64 / secs,
                admitted: e.admitted.min(e.offered) as f64 / secs,
                jump: e.jump,
                own: e.own,
            });
        }
        holding.charge = taken;
        self.held += taken;
        *self.held_by.entry(owner.into()).or_default() += taken;
        Ok(())
    }

    /// Hands over what the hosts offered and admitted since the last take (whole units; the
    /// fractions wait for the next one), with the milliseconds it covers, and starts anew at
    /// `now`; forgets hosts silent for three of their intervals. The `last` take (the replica
    /// is stopping) hands over all that its hosts' reports hold, to the end of their intervals.
    pub fn take(&mut self, now: f64, last: bool) -> (Vec<Entry>, u64) {
        // The last take covers its hosts' intervals to their ends: its counts are rates over
        // that time, not over the moment since the last take (which would multiply them).
        let to = if last {
            self.hosts
                .iter_mut()
                .filter(|(_, s)| !s.data.rules.is_empty())
                .map(|(_, s)| s.data.until)
                .fold(now, f64::max)
        } else {
            now
        };
        let interval_ms = (((to - self.since) * 1000.0).round() as u64).clamp(100, 600_000);
        let since = self.since;
        self.since = now;
        self.takes += 1;
        let mut window: HashMap<(Box<str>, Box<str>), WindowRule> = HashMap::new();
        let mut spent: Vec<(Box<str>, usize)> = Vec::new();
        for (_, s) in self.hosts.iter_mut() {
            let h = &mut s.data;
            if h.rules.is_empty() {
                continue;
            }
            // Hosts whose values stood in this window say which rules they report.
            if h.until > since {
                let to = if last { h.until } else { now };
                self.pending_keys.max = self.max_keys;
                accrue(
                    h,
                    to,
                    &mut self.pending,
                    &mut self.pending_keys,
                    &mut self.conflicts,
                );
                for r in &h.rules {
                    let w = window
                        .entry((r.service.clone(), r.rule.clone()))
                        .or_default();
                    w.hosts += 1;
                    w.folded = w.folded.max(r.folded);
                    if let Some(d) = &r.sketch {
                        w.sketch.get_or_insert_with(Distinct::default).union(d);
                    }
                }
            }
            if h.until <= now || last {
                spent.push((h.owner.clone(), std::mem::take(&mut h.charge)));
                h.rules.clear();
            }
        }
        for (owner, n) in spent {
            self.held = self.held.saturating_sub(n);
            if let Some(m) = self.held_by.get_mut(&owner) {
                *m = m.saturating_sub(n);
            }
        }
        let mut out: Vec<Entry> = Vec::new();
        for (service, rules) in &mut self.pending {
            let service_start = out.len();
            for (rule, p) in rules.iter_mut() {
                let w = window.remove(&(service.clone(), rule.clone()));
                let first = out.len();
                let entry = |key: Option<&str>, (offered, admitted)| Entry {
                    service: service.to_string(),
                    rule: rule.to_string(),
                    limit: p.limit,
                    key: key.map(str::to_string),
                    keys_folded: 0,
                    offered,
                    admitted,
                    sketch: None,
                    hosts: 0,
                    jump: 0.0,
                    own: None,
                };
                for (k, units) in p.keys.iter_mut() {
                    // A step goes with the key's next whole units (a forward of the key).
                    let jump = units.jump;
                    if let Some(whole) = units.whole() {
                        let mut e = entry(Some(k), whole);
                        e.jump = jump;
                        units.jump = 0.0;
                        if std::mem::take(&mut units.own) {
                            e.own = units.limit;
                        }
                        units.limit = None;
                        out.push(e);
                    }
                }
                if let Some(units) = p.tail.whole() {
                    let mut tail = entry(None, units);
                    if let Some(w) = &w {
                        tail.keys_folded = w.folded;
                        tail.sketch = w.sketch.as_ref().map(Distinct::encode);
                    }
                    out.push(tail);
                }
                if let (Some(e), Some(w)) = (out.get_mut(first), &w) {
                    e.hosts = w.hosts;
                }
                p.stated = false;
                // A fraction accrued in no window since is handed on no more.
                p.keys.retain(|_, k| std::mem::take(&mut k.touched));
                if !std::mem::take(&mut p.tail.touched) {
                    p.tail = Pending::default();
                }
            }
            rules.retain(|_, p| !p.keys.is_empty() || p.tail.offered > 0.0);
            fold_past(&mut out, service_start, FORWARD_KEYS_PER_SERVICE);
        }
        self.pending.retain(|_, r| !r.is_empty());
        self.pending_keys.by_service = self
            .pending
            .iter()
            .map(|(service, rules)| (service.clone(), rules.values().map(|p| p.keys.len()).sum()))
            .collect();
        self.pending_keys.total = self.pending_keys.by_service.values().sum();
        self.hosts.expire(now, |_, _| {});
        (out, interval_ms)
    }

    /// Takes out the hosts' steps not yet handed over, by (service, rule, key), for a forward
    /// that sends them with the last window's rates (see the aggregator's early forward), and
    /// counts that as a take; an empty list if there are none, and `None` if `known` lacks a
    /// stepped key (the steps then wait for the next [`Self::take`]).
    pub fn take_steps(&mut self, known: impl Fn(&str, &str, &str) -> bool) -> Option<Vec<Step>> {
        let mut steps: HashMap<StepOf, f64> = HashMap::new();
        let mut add = |service: &str, rule: &str, key: &str, jump: f64| {
            *steps
                .entry((service.into(), rule.into(), key.into()))
                .or_default() += jump;
        };
        for (service, rules) in &self.pending {
            for (rule, p) in rules {
                for (key, units) in &p.keys {
                    if units.jump != 0.0 {
                        add(service, rule, key, units.jump);
                    }
                }
            }
        }
        // A report's steps wait with its host until its first accrual.
        for (_, s) in self.hosts.iter() {
            for r in &s.data.rules {
                for k in &r.keys {
                    if let (Some(key), true) = (&k.key, k.jump != 0.0) {
                        add(&r.service, &r.rule, key, k.jump);
                    }
                }
            }
        }
        if steps.is_empty() {
            return Some(Vec::new());
        }
        if !steps.keys().all(|(s, r, k)| known(s, r, k)) {
            return None;
        }
        for rules in self.pending.values_mut() {
            for p in rules.values_mut() {
                for units in p.keys.values_mut() {
                    units.jump = 0.0;
                }
            }
        }
        for (_, s) in self.hosts.iter_mut() {
            for r in &mut s.data.rules {
                for k in &mut r.keys {
                    if k.key.is_some() {
                        k.jump = 0.0;
                    }
                }
            }
        }
        self.takes += 1;
        Some(
            steps
                .into_iter()
                .map(|((s, r, k), j)| (s, r, k, j))
                .collect(),
        )
    }

    /// Hosts reporting now.
    pub fn hosts(&self) -> usize {
        self.hosts.len()
    }
}

/// A service's keys forwarded by name at most: the heaviest; the rest go with their rule's
/// tail. The controller answers at most as many of a service's keys by name
/// ([`super::sum::MAX_RATIOS_PER_SERVICE`]), and a tenant's flood of keys must not make every
/// forward, and the controller's work on it, as large as its room allows.
pub const FORWARD_KEYS_PER_SERVICE: usize = super::sum::MAX_RATIOS_PER_SERVICE;

/// Folds the named entries of `out[from..]` (one service's) past the `most` heaviest into
/// their rules' tails, units, hosts and distinct keys with them.
fn fold_past(out: &mut Vec<Entry>, from: usize, most: usize) {
    if out[from..].iter().filter(|e| e.key.is_some()).count() <= most {
        return;
    }
    let (mut named, tails): (Vec<Entry>, Vec<Entry>) =
        out.drain(from..).partition(|e| e.key.is_some());
    // A key with a limit of its own stays named: the tail's ratio is the rule's limit's.
    named.select_nth_unstable_by(most - 1, |a, b| {
        (b.own.is_some(), b.offered).cmp(&(a.own.is_some(), a.offered))
    });
    let folded = named.split_off(most);
    let mut tails: HashMap<String, Entry> =
        tails.into_iter().map(|t| (t.rule.clone(), t)).collect();
    let mut sketches: HashMap<String, Distinct> = HashMap::new();
    for e in folded {
        let t = tails.entry(e.rule.clone()).or_insert_with(|| Entry {
            key: None,
            offered: 0,
            admitted: 0,
            keys_folded: 0,
            sketch: None,
            hosts: 0,
            jump: 0.0,
            ..e.clone()
        });
        t.offered += e.offered;
        t.admitted += e.admitted;
        t.keys_folded += 1;
        t.hosts = t.hosts.max(e.hosts);
        let sketch = sketches.entry(e.rule.clone()).or_insert_with(|| {
            t.sketch
                .as_deref()
                .and_then(Distinct::decode)
                .unwrap_or_default()
        });
        sketch.insert(e.key.as_deref().unwrap_or_default().as_bytes());
    }
    for (rule, sketch) in sketches {
        if let Some(t) = tails.get_mut(&rule) {
            t.sketch = Some(sketch.encode());
        }
    }
    out.extend(named);
    out.extend(tails.into_values());
}

/// The keys pending, in all and per service, against their bound.
#[derive(Debug, Default)]
struct PendingRoom {
    total: usize,
    by_service: HashMap<Box<str>, usize>,
    max: usize,
}

impl PendingRoom {
    /// Takes a place for a key of `service` new in `pending`, if one is left.
    fn take(&mut self, service: &str) -> bool {
        let mine = self.by_service.get(service).copied().unwrap_or(0);
        if self.total >= self.max || mine >= self.max / 2 {
            return false;
        }
        self.total += 1;
        match self.by_service.get_mut(service) {
            Some(n) => *n += 1,
            None => {
                self.by_service.insert(service.into(), 1);
            }
        }
        true
    }
}

/// Adds what `h` held from its last accrual up to `now` (within its own time) to `pending`,
/// taking a place of `room` for each key new there (none left: the units go to the tail).
fn accrue(
    h: &mut Holding,
    now: f64,
    pending: &mut HashMap<Box<str>, HashMap<Box<str>, PendingRule>>,
    room: &mut PendingRoom,
    conflicts: &mut u64,
) {
    let from = h.accrued.max(h.from);
    let to = now.min(h.until);
    h.accrued = h.accrued.max(now);
    if to <= from {
        return;
    }
    let dt = to - from;
    for r in &mut h.rules {
        let rules = match pending.get_mut(&*r.service) {
            Some(rules) => rules,
            None => pending.entry(r.service.clone()).or_default(),
        };
        let p = match rules.get_mut(&*r.rule) {
            Some(p) => p,
            None => rules.entry(r.rule.clone()).or_insert_with(|| PendingRule {
                limit: r.limit,
                stated: true,
                keys: HashMap::new(),
                tail: Pending::default(),
            }),
        };
        if !p.stated {
            p.limit = r.limit;
            p.stated = true;
        } else if p.limit != r.limit {
            *conflicts += 1;
            if r.limit.per_second() < p.limit.per_second() {
                p.limit = r.limit;
            }
        }
        for k in &mut r.keys {
            let (units, named) = match &k.key {
                None => (&mut p.tail, false),
                Some(key) => match p.keys.get_mut(&**key) {
                    Some(u) => (u, true),
                    None if !room.take(&r.service) => (&mut p.tail, false),
                    None => (p.keys.entry(key.clone()).or_default(), true),
                },
            };
            units.offered += k.offered * dt;
            units.admitted += k.admitted * dt;
            units.touched = true;
            // A tail has no sum of one key to step.
            if named {
                units.jump += std::mem::take(&mut k.jump);
                let stated = k.own.unwrap_or(r.limit);
                if units
                    .limit
                    .is_none_or(|l| stated.per_second() < l.per_second())
                {
                    units.limit = Some(stated);
                }
                units.own |= k.own.is_some();
            }
        }
    }
}
