//! The control plane: reports up, drop ratios down (Uber's Global Rate Limiter design).
//!
//! Owns the wire types (versioned JSON over HTTP or HTTPS, `/v1/...`), their bounds, the ratio
//! math (a pure function), and the three roles: [`reporter`] (in each proxy), [`aggregator`]
//! (any number of replicas per zone), [`controller`] (one per region, or per service shard), and
//! the JSON client reports go out with ([`client`]).
//! [`zone`] and [`sum`] say where counts are added (aggregator, controller) and smoothed, [`sources`] who may report, [`auth`] whose
//! token may do what. Nothing here is on the request path: the proxy only reads the published
//! [`DropRatios`](crate::rules::DropRatios) snapshot. Must never: block a request, keep state that the next reports
//! cannot rebuild, count one host's interval twice, or let one service's token move another
//! service's ratios or read its keys.

pub mod aggregator;
pub mod auth;
pub mod client;
pub mod controller;
pub mod ratios;
pub mod reporter;
pub mod server;
pub mod sources;
pub mod sum;
#[cfg(feature = "tls")]
pub mod tls;
#[cfg(not(feature = "tls"))]
#[path = "no_tls.rs"]
pub mod tls;
pub mod zone;

pub use sources::SourceRefusal;
pub use sum::{Accumulator, KeyView, RuleState, StateView};
pub use zone::ZoneSums;

use serde::{Deserialize, Serialize};

/// The wire format version; a report of another version is refused with 400.
pub const VERSION: u32 = 1;

/// The header by which a sender says it reads (and a receiver that it takes) the fields added
/// to version 1 since: a tail's sketch, a zone's host count, and a reply's per-rule hints.
/// A peer that does not send it gets and sends version 1's fields only, which its strict
/// parser (unknown fields are refused) reads.
pub const WIRE_HEADER: &str = "spillway-wire";
/// What [`WIRE_HEADER`] carries.
pub const WIRE: &str = "2";

/// The header by which a reply says its ratios are not authoritative yet: the controller
/// that computed them has not been up for its warm-up (its state is soft, so after a restart
/// it has not heard every source yet). A proxy keeps the ratios it has (aged as any) until a
/// reply without it; an aggregator relays it. A reader that does not know it ignores it.
pub const WARMING_HEADER: &str = "spillway-warming";

/// The header by which a report says which process sent it: a random number drawn once per
/// process. A receiver binds a live source's name to it, so that another process holding the
/// same token cannot take the name (or its sequence numbers) while it reports; a previous
/// release ignores it.
pub const INSTANCE_HEADER: &str = "spillway-instance";

/// This process's [`INSTANCE_HEADER`] value, in hex.
pub fn instance() -> &'static str {
    static INSTANCE: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| format!("{:016x}", fastrand::u64(1..)));
    &INSTANCE
}

/// Largest request body the control plane reads (413 past it).
pub const MAX_BODY: usize = 8 << 20;
/// Largest reply a reporter reads (a controller's answer to zone sums carries every service's
/// ratios, at most [`sum::MAX_RATIOS_PER_SERVICE`] each).
pub const MAX_REPLY: usize = 64 << 20;

/// Counts above this per entry and interval are absurd (10^12 requests) and refused.
pub const MAX_COUNT: u64 = 1_000_000_000_000;
/// No proxy decides more than this many units per second for one key (requests, or a
/// rule's cost: bytes at 100 GB/s).
pub const MAX_RATE: f64 = 1e11;
/// New sources (hosts, or aggregator replicas) taken per second; a flood of fake hosts beyond
/// it is refused (429) instead of growing memory and work.
pub const NEW_SOURCES_PER_SEC: u32 = 1_000;

/// Longest `source` (a pod name is at most 253) and `zone`; a report past either is refused.
pub const MAX_SOURCE: usize = 256;
pub const MAX_ZONE: usize = 64;
/// Longest key as sent (proxies send their canonical keys, at most 71 bytes); an entry past it
/// is dropped.
pub const MAX_KEY: usize = 1024;
/// Services one host's report may name (a sidecar reports for one).
pub const MAX_HOST_SERVICES: usize = 16;
/// Entries taken from one report; the rest are dropped and counted.
pub const MAX_ENTRIES: usize = 200_000;
/// Hosts one zone's sums may say reported a rule.
pub const MAX_HOSTS: u32 = 1_000_000;

/// What a proxy (or an aggregator, for its zone) sends every interval: `POST /v1/report`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Report {
    pub version: u32,
    /// Who sends it: a host name, or `zone:<name>/<replica>` for an aggregator replica.
    pub source: String,
    #[serde(default)]
    pub zone: String,
    /// The interval the counts cover, in milliseconds.
    pub interval_ms: u64,
    /// Increases with every report of one source, across its restarts (0: unnumbered); a
    /// report whose number was already seen is not counted again.
    #[serde(default)]
    pub seq: u64,
    /// The sender is stopping: this is its last report, and its values stand for this one
    /// interval only (a stopped aggregator replica is not counted on beside its successors).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub last: bool,
    pub entries: Vec<Entry>,
    /// The sending process, from its [`INSTANCE_HEADER`] (not in the body, which a previous
    /// release's strict parser reads): a live source's name is bound to it.
    #[serde(skip)]
    pub instance: Option<u64>,
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
    /// Units (requests, or the rule's cost) in the interval.
    pub offered: u64,
    pub admitted: u64,
    /// For the "other" entry: a distinct-count sketch of the keys folded into it
    /// ([`crate::limit::Distinct`]'s wire form), which sketches of other sources union with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sketch: Option<String>,
    /// How many hosts reported this (service, rule) in the interval: a zone's sums say it on
    /// one entry of each rule; 0 (left out) stands for one host.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hosts: u32,
    /// For a named key: by how many units a second the sender's offered rate stepped since
    /// its last report, past what chance explains ([`crate::rules::jumped`]; a zone's sums
    /// add their hosts'). The controller's smoothed sum of the key moves by it at once, as
    /// the sender's own smoothed rate did, so that the two stay paired through a surge.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub jump: f64,
    /// For a named key with a limit of its own (`overrides:`): that limit, which the
    /// controller holds the key to instead of the rule's (the smallest any sender states; a
    /// sender that states none states the rule's). A zone's sums relay the smallest of their
    /// hosts'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own: Option<Limit>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

/// A limit as `count` per `period_ms`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    pub count: u64,
    pub period_ms: u64,
}

impl Limit {
    /// A rule's rate as reports carry it.
    pub fn of(rate: crate::config::Rate) -> Limit {
        Limit {
            count: u64::from(rate.count.get()),
            period_ms: (rate.period.as_millis() as u64).max(1),
        }
    }

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
    /// Per (service, rule) of the replied services: what a proxy reports by name, and whether
    /// ratios were left out. Sent only to a sender of [`WIRE_HEADER`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<RuleHint>,
    /// The reply came with [`WARMING_HEADER`]: not on the wire's JSON.
    #[serde(skip)]
    pub warming: bool,
}

impl Reply {
    /// The reply as a version-1 reader takes it.
    pub fn downgrade(&mut self) {
        self.rules = Vec::new();
    }
}

/// What the controller tells the proxies of one (service, rule) besides ratios.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RuleHint {
    pub service: String,
    pub rule: String,
    /// A proxy reports by name, beyond its `top_k`, every key it was offered at least this many
    /// units per second of: a key over the limit fleet-wide is over this on some proxy (there
    /// are fewer than twice the limit over this many proxies), so it is found wherever it hides.
    pub name_above: f64,
    /// The rule's ratios were cut to the highest: every ratio left out is at most this. A key a
    /// proxy named that the reply leaves out then keeps its last ratio, at most this, instead of
    /// 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_below: Option<f64>,
}

/// One drop ratio. A key absent from a reply has ratio 0 if the report it answers named it
/// (unless its rule's ratios were cut: see [`RuleHint::cut_below`]), else the folded tail's
/// ratio (`key: None`): that report, or the last the key was in, folded it, or none has had it.
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
    #[error("interval_ms must be between 100 and 600000")]
    Interval,
    #[error("a host reports for at most {MAX_HOST_SERVICES} services")]
    Services,
    #[error("source must be 1 to {MAX_SOURCE} bytes and zone at most {MAX_ZONE}")]
    Name,
    #[error("entry {0}: {1}")]
    Entry(usize, &'static str),
}

impl Report {
    /// The report as a version-1 reader takes it: sketches, host counts and jumps left out
    /// (the reader then counts the tail as version 1 did, and smooths every step).
    pub fn downgrade(&mut self) {
        for e in &mut self.entries {
            e.sketch = None;
            e.hosts = 0;
            e.jump = 0.0;
        }
    }

    /// Checks what JSON decoding cannot: versions, ranges, and absurd counts.
    pub fn validate(&self) -> Result<(), ReportError> {
        if self.version != VERSION {
            return Err(ReportError::Version(self.version));
        }
        if !(100..=600_000).contains(&self.interval_ms) {
            return Err(ReportError::Interval);
        }
        if !self.source.starts_with("zone:") {
            let mut services: Vec<&str> = self.entries.iter().map(|e| e.service.as_str()).collect();
            services.sort_unstable();
            services.dedup();
            if services.len() > MAX_HOST_SERVICES {
                return Err(ReportError::Services);
            }
        }
        if self.source.is_empty() || self.source.len() > MAX_SOURCE || self.zone.len() > MAX_ZONE {
            return Err(ReportError::Name);
        }
        if self.entries.len() > MAX_ENTRIES {
            return Err(ReportError::Entry(MAX_ENTRIES, "too many entries"));
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
        let mut dropped = self.entries.len().saturating_sub(MAX_ENTRIES);
        self.entries.truncate(MAX_ENTRIES);
        // Keys longer than any proxy sends are dropped before they are hashed.
        let before = self.entries.len();
        self.entries
            .retain(|e| e.key.as_ref().is_none_or(|k| k.len() <= MAX_KEY));
        dropped += before - self.entries.len();
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
        dropped + before - self.entries.len()
    }

    /// What is wrong with one entry, if anything.
    fn problem(&self, e: &Entry) -> Option<&'static str> {
        if e.service.is_empty() || e.rule.is_empty() || e.service.len() > 64 || e.rule.len() > 64 {
            return Some("service and rule are 1 to 64 characters");
        }
        if e.key.as_ref().is_some_and(|k| k.len() > MAX_KEY) {
            return Some("key longer than 1024 bytes");
        }
        if e.offered > MAX_COUNT || e.admitted > e.offered {
            return Some("counts must satisfy 0 <= admitted <= offered <= 10^12");
        }
        // Absurd rates are refused rather than clamped: a clamped lie still moves ratios.
        if e.offered as f64 * 1000.0 / self.interval_ms.max(1) as f64 > MAX_RATE {
            return Some("offered more than 10^11 units/s for one key from one source");
        }
        let bad = |l: &Limit| l.count == 0 || l.period_ms == 0 || l.period_ms > 86_400_000 * 365;
        if bad(&e.limit) {
            return Some("limit needs count > 0 and a period between 1 ms and 365 d");
        }
        if let Some(own) = &e.own {
            if e.key.is_none() || bad(own) {
                return Some(
                    "own is a named key's limit: count > 0 and a period between 1 ms and 365 d",
                );
            }
        }
        if let Some(sketch) = &e.sketch {
            if e.key.is_some() || crate::limit::Distinct::decode(sketch).is_none() {
                return Some("a sketch goes on the tail, as 1024 characters of its alphabet");
            }
        }
        if e.hosts > MAX_HOSTS {
            return Some("hosts is at most 10^6");
        }
        if !(e.jump.is_finite() && e.jump.abs() <= MAX_RATE) || (e.key.is_none() && e.jump != 0.0) {
            return Some("jump is a named key's, at most 10^11 units/s either way");
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

/// An [`Accumulator`] or [`ZoneSums`] shared by a server's handlers, with the clock it is fed by.
///
/// One std mutex guards it: taken once per report or forward, never across an await and never
/// on a request path (where the lint bans it); a panic mid-update leaves soft state that the
/// next reports overwrite. Work that may take long under it (a large report, a forward), and
/// any wait for it while it is held, runs through [`Shared::with`] off the runtime's workers:
/// a tenant's huge reports never hold up the threads that answer other hosts.
#[allow(clippy::disallowed_types)]
pub struct Shared<T> {
    inner: std::sync::Mutex<T>,
    start: tokio::time::Instant,
}

#[allow(clippy::disallowed_types)]
impl<T> Shared<T> {
    pub fn new(inner: T) -> Self {
        Shared {
            inner: std::sync::Mutex::new(inner),
            start: tokio::time::Instant::now(),
        }
    }

    /// Seconds since it was made: the clock its rates are kept on.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, T> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `f` under the lock: on this worker when the lock is free and `f` is `light`, else where
    /// it may block ([`off_workers`]).
    pub fn with<R>(&self, light: bool, f: impl FnOnce(&mut T) -> R) -> R {
        if light {
            match self.inner.try_lock() {
                Ok(mut held) => return f(&mut held),
                Err(std::sync::TryLockError::Poisoned(p)) => return f(&mut p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
        }
        off_workers(|| f(&mut self.lock()))
    }
}

/// Runs `f`, which may take long or wait on a lock held long, with the runtime's other tasks
/// moved to another thread (`block_in_place`) on a multi-thread runtime; in place on a
/// current-thread one (tests), where there is no other thread to move them to.
pub fn off_workers<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// A report (or forward part) with more entries than this is heavy to record or serialize:
/// done [`off_workers`].
pub const HEAVY_ENTRIES: usize = 1024;

#[cfg(test)]
mod tests;
