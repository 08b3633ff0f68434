//! The control plane: reports up, drop ratios down (Uber's Global Rate Limiter design).
//!
//! Owns the wire types (versioned JSON over plain HTTP, `/v1/...`), the ratio math (a pure
//! function), the per-source rate accumulator that both tiers use, and the three roles:
//! [`reporter`] (in each proxy), [`aggregator`] (one per zone), [`controller`] (one per
//! region). Nothing here is on the request path: the proxy only reads the published
//! [`DropRatios`] snapshot. Must never: block a request, keep state that the next reports
//! cannot rebuild, or let one source's absurd numbers move another service's ratios.

pub mod aggregator;
pub mod controller;
pub mod ratios;
pub mod reporter;
pub mod server;

pub use ratios::{DropRatios, Staleness};

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// The wire format version; a report of another version is refused with 400.
pub const VERSION: u32 = 1;

/// Largest request body the control plane reads (413 past it).
pub const MAX_BODY: usize = 8 << 20;

/// Counts above this per entry and interval are absurd (10^12 requests) and refused.
pub const MAX_COUNT: u64 = 1_000_000_000_000;
/// No proxy decides more than this many requests per second for one key.
pub const MAX_RATE: f64 = 1e8;
/// New sources (hosts, or zones' aggregators) the accumulator takes per second; a flood of
/// fake hosts beyond it is refused (429) instead of growing memory and work.
pub const NEW_SOURCES_PER_SEC: u32 = 1_000;

/// What a proxy (or an aggregator, for its zone) sends every interval: `POST /v1/report`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Report {
    pub version: u32,
    /// Who sends it: a host name, or `zone:<name>` for an aggregator.
    pub source: String,
    #[serde(default)]
    pub zone: String,
    /// The interval the counts cover, in milliseconds.
    pub interval_ms: u64,
    pub entries: Vec<Entry>,
}

/// Counts of one (service, rule, key) over one interval.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub service: String,
    pub rule: String,
    /// The rule's fleet-wide limit, as the sender's config has it.
    pub limit: Limit,
    /// The key, or `None` for the folded tail ("other") of keys not reported one by one.
    pub key: Option<String>,
    /// For the "other" entry: how many distinct keys were folded into it.
    #[serde(default)]
    pub keys_folded: u64,
    pub offered: u64,
    pub admitted: u64,
}

/// A limit as `count` per `period_ms`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    pub count: u64,
    pub period_ms: u64,
}

impl Limit {
    pub fn per_second(&self) -> f64 {
        self.count as f64 * 1000.0 / self.period_ms as f64
    }
}

/// The reply to a report: the drop ratios of the services it named.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Reply {
    pub version: u32,
    /// How old the ratios are: 0 from a controller; an aggregator relaying the controller's
    /// last answer says how long ago it got it, so that staleness reaches the proxies.
    #[serde(default)]
    pub age_ms: u64,
    pub ratios: Vec<Ratio>,
}

/// One drop ratio. Keys absent from a reply have ratio 0.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Ratio {
    pub service: String,
    pub rule: String,
    /// `None`: the ratio for keys folded into "other".
    pub key: Option<String>,
    pub ratio: f64,
}

/// Why a report is refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ReportError {
    #[error("unsupported version {0}; this build speaks {VERSION}")]
    Version(u32),
    #[error("interval_ms must be between 10 and 600000")]
    Interval,
    #[error("entry {0}: {1}")]
    Entry(usize, &'static str),
}

impl Report {
    /// Checks what JSON decoding cannot: versions, ranges, and absurd counts.
    pub fn validate(&self) -> Result<(), ReportError> {
        if self.version != VERSION {
            return Err(ReportError::Version(self.version));
        }
        if !(10..=600_000).contains(&self.interval_ms) {
            return Err(ReportError::Interval);
        }
        for (i, e) in self.entries.iter().enumerate() {
            if let Some(what) = self.problem(e) {
                return Err(ReportError::Entry(i, what));
            }
        }
        Ok(())
    }

    /// Puts every key in its canonical form ([`crate::key::canonical_key`]: what proxies of
    /// every release look ratios up by) and drops the entries [`validate`](Self::validate)
    /// would refuse, so that one bad entry never costs a whole report; returns how many.
    pub fn drop_invalid(&mut self) -> usize {
        for e in &mut self.entries {
            if let Some(k) = &e.key {
                if let std::borrow::Cow::Owned(c) = crate::key::canonical_key(k) {
                    e.key = Some(c);
                }
            }
        }
        let before = self.entries.len();
        let entries = std::mem::take(&mut self.entries);
        self.entries = entries
            .into_iter()
            .filter(|e| self.problem(e).is_none())
            .collect();
        before - self.entries.len()
    }

    /// What is wrong with one entry, if anything.
    fn problem(&self, e: &Entry) -> Option<&'static str> {
        if e.service.is_empty() || e.rule.is_empty() || e.service.len() > 64 || e.rule.len() > 64 {
            return Some("service and rule are 1 to 64 characters");
        }
        if e.key.as_ref().is_some_and(|k| k.len() > 1024) {
            return Some("key longer than 1024 bytes");
        }
        if e.offered > MAX_COUNT || e.admitted > e.offered {
            return Some("counts must satisfy 0 <= admitted <= offered <= 10^12");
        }
        // Absurd rates are refused rather than clamped: a clamped lie still moves ratios.
        if e.offered as f64 * 1000.0 / self.interval_ms.max(1) as f64 > MAX_RATE {
            return Some("offered more than 10^8 requests/s for one key from one source");
        }
        if e.limit.count == 0 || e.limit.period_ms == 0 || e.limit.period_ms > 86_400_000 * 365 {
            return Some("limit needs count > 0 and a period between 1 ms and 365 d");
        }
        None
    }
}

/// The drop ratio for a fleet offered `offered_rps` against `limit_rps`:
/// `max(0, (offered - limit) / offered)`, on offered load so that dropping does not hide the
/// demand that caused it.
pub fn drop_ratio(offered_rps: f64, limit_rps: f64) -> f64 {
    if offered_rps.is_nan() || offered_rps <= 0.0 || !limit_rps.is_finite() {
        return 0.0;
    }
    ((offered_rps - limit_rps) / offered_rps).clamp(0.0, 1.0)
}

/// Per (service, rule, key) rates, summed over sources from each source's latest report.
///
/// Each source's counts are turned into a rate over its own interval and smoothed (EWMA),
/// so sources need not report in phase; a source silent for three of its intervals is
/// forgotten. Both the
/// aggregator (its hosts) and the controller (zones or direct hosts) use it.
#[derive(Debug)]
pub struct Accumulator {
    rules: HashMap<(String, String), RuleAcc>,
    /// Limit conflicts seen (reporters disagreeing on a rule's limit).
    pub conflicts: u64,
    /// (source, key) rates held, bounded by [`MAX_TRACKED`].
    tracked: usize,
    /// Entries refused because the bound was reached.
    pub refused: u64,
    max_tracked: usize,
    /// Every live source: when it last reported, how long it lives, and (for a host reporting
    /// directly) the services it reports for, pinned by its first report.
    source_index: HashMap<String, SourceInfo>,
    /// The second new sources are being counted in, and how many came in it.
    new_sources: (u64, u32),
    /// Reports refused by [`admit_source`](Self::admit_source): a flood of new hosts, or a
    /// host reporting for another service than its own.
    pub throttled: u64,
    pub foreign: u64,
}

#[derive(Debug)]
struct SourceInfo {
    last: f64,
    ttl: f64,
    services: Vec<String>,
}

/// Why a report's source was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceRefusal {
    #[error("too many new sources this second; retry")]
    Flood,
    #[error("source {0} reports for service {1}, but it is a source of {2}")]
    Foreign(String, String, String),
}

impl Default for Accumulator {
    fn default() -> Self {
        Self::bounded(MAX_TRACKED)
    }
}

/// The most (source, service, rule, key) rates one accumulator holds: about 100 bytes each
/// plus the strings, so a flood of fake hosts or keys costs at most a few hundred MiB. Past
/// it, entries for new keys or sources are dropped (and counted) until old ones expire.
pub const MAX_TRACKED: usize = 1_000_000;

#[derive(Debug)]
struct RuleAcc {
    limit: Limit,
    /// Which source said what limit, to take the smallest of those still reporting.
    limits: HashMap<String, Limit>,
    keys: HashMap<Option<String>, KeyAcc>,
}

#[derive(Debug, Default)]
struct KeyAcc {
    sources: HashMap<String, SourceRate>,
}

#[derive(Debug, Clone, Copy)]
struct SourceRate {
    offered: f64,
    admitted: f64,
    keys_folded: u64,
    /// Seconds on the accumulator's clock when last updated.
    at: f64,
    /// Forgotten when silent this long: three of the source's own intervals.
    ttl: f64,
}

/// Weight of the newest interval in the smoothed rate. Measured with
/// `benches/fleet_convergence.rs`: 0.5 took 7 s to follow a 1x -> 3x step with 1 s reports,
/// 0.8 takes 3.9 s (1.9 s with 250 ms reports), and both hold the steady state within 2 %;
/// the per-request coin toss already averages out what noise 0.8 lets through.
const EWMA: f64 = 0.8;

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

impl Accumulator {
    /// An accumulator holding at most `max_tracked` (source, key) rates.
    pub fn bounded(max_tracked: usize) -> Self {
        Accumulator {
            rules: HashMap::new(),
            conflicts: 0,
            tracked: 0,
            refused: 0,
            max_tracked,
            source_index: HashMap::new(),
            new_sources: (0, 0),
            throttled: 0,
            foreign: 0,
        }
    }

    /// Folds a validated report in at time `now` (seconds on the caller's clock).
    /// Whether `report`'s source may report now. A source not seen in its last three intervals
    /// counts against [`NEW_SOURCES_PER_SEC`]. A host reporting directly (any source but an
    /// aggregator's `zone:...`) is pinned to the services of its first report, so that one
    /// sidecar cannot move another service's drop ratios under its own name.
    pub fn admit_source(&mut self, report: &Report, now: f64) -> Result<(), SourceRefusal> {
        let ttl = 3.0 * report.interval_ms as f64 / 1000.0;
        let pinned = !report.source.starts_with("zone:");
        if let Some(info) = self.source_index.get_mut(&report.source) {
            if now - info.last <= info.ttl {
                if pinned && info.services.is_empty() {
                    // Its first reports were empty: the first service it names pins it.
                    info.services = report.entries.iter().map(|e| e.service.clone()).collect();
                    info.services.sort_unstable();
                    info.services.dedup();
                }
                if pinned {
                    if let Some(e) = report
                        .entries
                        .iter()
                        .find(|e| !info.services.iter().any(|s| s == &e.service))
                    {
                        self.foreign += 1;
                        return Err(SourceRefusal::Foreign(
                            report.source.clone(),
                            e.service.clone(),
                            info.services.join(", "),
                        ));
                    }
                }
                info.last = now;
                info.ttl = ttl;
                return Ok(());
            }
        }
        let second = now as u64;
        if self.new_sources.0 != second {
            self.new_sources = (second, 0);
        }
        if self.new_sources.1 >= NEW_SOURCES_PER_SEC {
            self.throttled += 1;
            return Err(SourceRefusal::Flood);
        }
        self.new_sources.1 += 1;
        let mut services: Vec<String> = report.entries.iter().map(|e| e.service.clone()).collect();
        services.sort_unstable();
        services.dedup();
        self.source_index.insert(
            report.source.clone(),
            SourceInfo {
                last: now,
                ttl,
                services: if pinned { services } else { Vec::new() },
            },
        );
        Ok(())
    }

    pub fn add(&mut self, report: &Report, now: f64) {
        let secs = report.interval_ms as f64 / 1000.0;
        for e in &report.entries {
            let rule = self
                .rules
                .entry((e.service.clone(), e.rule.clone()))
                .or_insert_with(|| RuleAcc {
                    limit: e.limit,
                    limits: HashMap::new(),
                    keys: HashMap::new(),
                });
            if rule.limits.insert(report.source.clone(), e.limit) != Some(e.limit) {
                // The smallest limit wins; a source that disagrees with another is a conflict.
                rule.limit = smallest(rule.limits.values());
                if rule.limits.values().any(|l| l != &e.limit) {
                    self.conflicts += 1;
                }
            }
            let known = rule
                .keys
                .get(&e.key)
                .is_some_and(|k| k.sources.contains_key(&report.source));
            if !known && self.tracked >= self.max_tracked {
                self.refused += 1;
                continue;
            }
            let key = rule.keys.entry(e.key.clone()).or_default();
            let fresh = SourceRate {
                offered: e.offered as f64 / secs,
                admitted: e.admitted as f64 / secs,
                keys_folded: e.keys_folded,
                at: now,
                ttl: 3.0 * secs,
            };
            key.sources
                .entry(report.source.clone())
                .and_modify(|r| {
                    r.offered = EWMA * fresh.offered + (1.0 - EWMA) * r.offered;
                    r.admitted = EWMA * fresh.admitted + (1.0 - EWMA) * r.admitted;
                    r.keys_folded = fresh.keys_folded;
                    r.at = now;
                    r.ttl = fresh.ttl;
                })
                .or_insert_with(|| {
                    self.tracked += 1;
                    fresh
                });
        }
    }

    /// Forgets sources silent for three of their intervals, and keys and rules left empty.
    pub fn expire(&mut self, now: f64) {
        let mut tracked = 0;
        self.rules.retain(|_, rule| {
            rule.keys.retain(|_, k| {
                k.sources.retain(|_, s| now - s.at <= s.ttl);
                tracked += k.sources.len();
                !k.sources.is_empty()
            });
            let live: std::collections::HashSet<&String> =
                rule.keys.values().flat_map(|k| k.sources.keys()).collect();
            rule.limits.retain(|src, _| live.contains(src));
            if !rule.limits.is_empty() {
                rule.limit = smallest(rule.limits.values());
            }
            !rule.keys.is_empty()
        });
        self.tracked = tracked;
        self.source_index.retain(|_, s| now - s.last <= s.ttl);
    }

    /// Every (service, rule, key) with its summed rates and drop ratio, optionally only for
    /// `services`.
    pub fn view(&self, services: Option<&[&str]>) -> Vec<KeyView> {
        let mut out = Vec::new();
        for ((service, rule_name), rule) in &self.rules {
            if services.is_some_and(|s| !s.contains(&service.as_str())) {
                continue;
            }
            let limit = rule.limit.per_second();
            for (key, k) in &rule.keys {
                let offered: f64 = k.sources.values().map(|s| s.offered).sum();
                let admitted: f64 = k.sources.values().map(|s| s.admitted).sum();
                // The folded tail holds at least as many keys as the most any source folded,
                // each with its own limit.
                let keys = k.sources.values().map(|s| s.keys_folded).max().unwrap_or(0);
                let limit_here = if key.is_none() {
                    limit * keys.max(1) as f64
                } else {
                    limit
                };
                out.push(KeyView {
                    service: service.clone(),
                    rule: rule_name.clone(),
                    key: key.clone(),
                    limit_rps: limit_here,
                    offered_rps: offered,
                    admitted_rps: admitted,
                    ratio: drop_ratio(offered, limit_here),
                    sources: k.sources.len(),
                });
            }
        }
        out
    }

    /// The non-zero ratios of `services`, for a reply.
    pub fn reply(&self, services: &[&str]) -> Reply {
        Reply {
            version: VERSION,
            age_ms: 0,
            ratios: self
                .view(Some(services))
                .into_iter()
                .filter(|v| v.ratio > 0.0)
                .map(|v| Ratio {
                    service: v.service,
                    rule: v.rule,
                    key: v.key,
                    ratio: v.ratio,
                })
                .collect(),
        }
    }

    /// Entries summing every live source, as counts over `interval_ms` (what an aggregator
    /// forwards for its zone).
    pub fn as_entries(&self, interval_ms: u64) -> Vec<Entry> {
        let secs = interval_ms as f64 / 1000.0;
        let mut out = Vec::new();
        for ((service, rule_name), rule) in &self.rules {
            for (key, k) in &rule.keys {
                let offered: f64 = k.sources.values().map(|s| s.offered).sum();
                let admitted: f64 = k.sources.values().map(|s| s.admitted).sum();
                let offered = (offered * secs).round() as u64;
                out.push(Entry {
                    service: service.clone(),
                    rule: rule_name.clone(),
                    limit: rule.limit,
                    key: key.clone(),
                    keys_folded: k.sources.values().map(|s| s.keys_folded).max().unwrap_or(0),
                    offered,
                    admitted: ((admitted * secs).round() as u64).min(offered),
                });
            }
        }
        out
    }

    /// Distinct sources still reporting.
    /// Every live source (a zone's aggregator, or a proxy reporting directly) with the seconds
    /// since its last report, at `now` on the accumulator's clock; most recent first.
    pub fn source_ages(&self, now: f64) -> Vec<(String, f64)> {
        let mut last: HashMap<&str, f64> = HashMap::new();
        for rule in self.rules.values() {
            for k in rule.keys.values() {
                for (name, s) in &k.sources {
                    let at = last.entry(name.as_str()).or_insert(s.at);
                    *at = at.max(s.at);
                }
            }
        }
        let mut out: Vec<(String, f64)> = last
            .into_iter()
            .map(|(n, at)| (n.to_string(), (now - at).max(0.0)))
            .collect();
        out.sort_by(|a, b| a.1.total_cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
        out
    }

    pub fn sources(&self) -> usize {
        let mut all = std::collections::HashSet::new();
        for rule in self.rules.values() {
            for k in rule.keys.values() {
                all.extend(k.sources.keys());
            }
        }
        all.len()
    }
}

/// An [`Accumulator`] shared by a server's handlers, with the clock it is fed by.
///
/// One std mutex guards it: taken once per report or forward (a few per second per zone), never
/// across an await and never on a request path (where the lint bans it); a panic mid-update
/// leaves soft state that the next reports overwrite.
#[allow(clippy::disallowed_types)]
pub struct SharedAccumulator {
    acc: std::sync::Mutex<Accumulator>,
    start: tokio::time::Instant,
}

impl Default for SharedAccumulator {
    #[allow(clippy::disallowed_types)]
    fn default() -> Self {
        SharedAccumulator {
            acc: std::sync::Mutex::new(Accumulator::default()),
            start: tokio::time::Instant::now(),
        }
    }
}

impl SharedAccumulator {
    /// Seconds since the accumulator was made: the clock its rates are kept on.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, Accumulator> {
        self.acc.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn smallest<'a>(limits: impl Iterator<Item = &'a Limit>) -> Limit {
    limits
        .copied()
        .min_by(|a, b| a.per_second().total_cmp(&b.per_second()))
        .expect("at least one limit")
}

#[cfg(test)]
mod tests;
