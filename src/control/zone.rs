//! An aggregator's sums: the counts its hosts reported since its last forward.
//!
//! [`ZoneSums`] adds them up per (service, rule, key) and hands them over once, keeping nothing
//! of a host past that: a host whose reports land on any mix of the zone's replicas is counted
//! exactly once. Smoothing is the controller's ([`super::sum`]), after the zone's sums meet.
//! Must never: hold more than `max_keys` pending keys, or more than half of them for one
//! service's hosts; keep a count past the forward that carried it.

use std::collections::HashMap;

use super::sources::{SourceRefusal, Sources};
use super::{Entry, Limit, Report};

/// An aggregator's sums since its last forward.
#[derive(Debug)]
pub struct ZoneSums {
    hosts: Sources<()>,
    rules: HashMap<String, HashMap<String, PendingRule>>,
    keys: usize,
    keys_by: HashMap<Box<str>, usize>,
    max_keys: usize,
    /// When the counts now pending began (seconds on the owner's clock).
    since: f64,
    pub conflicts: u64,
    pub refused: u64,
}

#[derive(Debug)]
struct PendingRule {
    limit: Limit,
    keys: HashMap<Option<String>, (u64, u64, u64)>,
}

impl ZoneSums {
    /// Sums starting at `now`, holding at most `max_keys` pending keys.
    pub fn new(now: f64, max_keys: usize) -> Self {
        ZoneSums {
            hosts: Sources::default(),
            rules: HashMap::new(),
            keys: 0,
            keys_by: HashMap::new(),
            max_keys,
            since: now,
            conflicts: 0,
            refused: 0,
        }
    }

    /// Reports refused by kind: (throttled, foreign, duplicate).
    pub fn refusals(&self) -> (u64, u64, u64) {
        (
            self.hosts.throttled,
            self.hosts.foreign,
            self.hosts.duplicates,
        )
    }

    /// Adds a validated host report's counts; `owner` as in [`Sources::admit`].
    pub fn record(&mut self, report: &Report, owner: &str, now: f64) -> Result<(), SourceRefusal> {
        self.hosts.admit(report, owner, now)?;
        for e in &report.entries {
            // Looked up by reference: names are copied only for a rule new in this interval.
            let rules = match self.rules.get_mut(e.service.as_str()) {
                Some(r) => r,
                None => self.rules.entry(e.service.clone()).or_default(),
            };
            let rule = match rules.get_mut(e.rule.as_str()) {
                Some(r) => r,
                None => rules.entry(e.rule.clone()).or_insert_with(|| PendingRule {
                    limit: e.limit,
                    keys: HashMap::new(),
                }),
            };
            if rule.limit != e.limit {
                self.conflicts += 1;
                if e.limit.per_second() < rule.limit.per_second() {
                    rule.limit = e.limit;
                }
            }
            if !rule.keys.contains_key(&e.key) {
                // One service's hosts may hold at most half the room: another service's keys
                // always find some.
                let owned = self.keys_by.get_mut(owner);
                let n = owned.as_ref().map_or(0, |n| **n);
                if self.keys >= self.max_keys || n >= self.max_keys / 2 {
                    self.refused += 1;
                    continue;
                }
                self.keys += 1;
                match owned {
                    Some(n) => *n += 1,
                    None => {
                        self.keys_by.insert(owner.into(), 1);
                    }
                }
            }
            let k = match rule.keys.get_mut(&e.key) {
                Some(k) => k,
                None => rule.keys.entry(e.key.clone()).or_default(),
            };
            k.0 += e.offered;
            k.1 += e.admitted;
            k.2 = k.2.max(e.keys_folded);
        }
        Ok(())
    }

    /// Hands over everything pending as entries, with the milliseconds they cover, and starts
    /// anew at `now`; forgets hosts silent for three of their intervals.
    pub fn take(&mut self, now: f64) -> (Vec<Entry>, u64) {
        let interval_ms = (((now - self.since) * 1000.0).round() as u64).clamp(100, 600_000);
        self.since = now;
        self.keys = 0;
        self.keys_by.clear();
        self.hosts.expire(now, |_, _| {});
        let mut out = Vec::new();
        let pending = std::mem::take(&mut self.rules);
        for (service, rule, p) in pending
            .into_iter()
            .flat_map(|(s, rules)| rules.into_iter().map(move |(r, p)| (s.clone(), r, p)))
        {
            for (key, (offered, admitted, folded)) in p.keys {
                out.push(Entry {
                    service: service.clone(),
                    rule: rule.clone(),
                    limit: p.limit,
                    key,
                    keys_folded: folded,
                    offered,
                    admitted: admitted.min(offered),
                });
            }
        }
        (out, interval_ms)
    }

    /// Hosts reporting now.
    pub fn hosts(&self) -> usize {
        self.hosts.len()
    }
}
