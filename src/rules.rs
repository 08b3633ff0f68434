//! The compiled rule set and the in-path decision.
//!
//! Owns: turning config rules into matchers, per-key stores and pre-resolved metric handles,
//! built together so that one `ArcSwap` store swaps them together; and [`RuleSet::check`], the
//! synchronous decision for one request. Must never: await, log per request, allocate for a
//! key it already tracks, or hold a store guard beyond the call.
//!
//! Cost of `check` per matching rule: a few string compares for the match, the key written
//! into a stack buffer, one hash of it, one sharded read lock + lookup by borrowed bytes, one
//! CAS on the bucket, one relaxed counter add. A new key costs one boxed copy of the key and a
//! shard write lock; past `max_keys` new keys share one overflow bucket per rule.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use dashmap::mapref::one::Ref;
use dashmap::DashMap;
use http::HeaderValue;
use prometheus::{IntCounter, IntGauge};
use smallvec::SmallVec;

use crate::config::{Config, HeaderMode, HostPattern, Match, Mode};
use crate::key::{extract, KeyBuf, KeyPart, RequestView};
use crate::limit::{ceil_secs, Decision, Nanos, Quota, TokenBucket};
use crate::metrics::Metrics;

/// Every rule of one configuration, ready to decide.
pub struct RuleSet {
    rules: Vec<CompiledRule>,
    header_mode: HeaderMode,
}

struct CompiledRule {
    name: Arc<str>,
    matcher: Matcher,
    key: Vec<KeyPart>,
    quota: Quota,
    mode: Mode,
    store: KeyedStore,
    /// `"name";q=<burst>;w=<refill seconds>`, built once.
    policy: HeaderValue,
    allowed: IntCounter,
    rejected: IntCounter,
    shadow_rejected: IntCounter,
}

/// One bucket per key, bounded by `max_keys`.
struct KeyedStore {
    // DashMap shards its table behind per-shard RwLocks: a lookup of a known key takes one
    // shard's read lock for the length of a CAS, never a global lock.
    // foldhash's quality variant, seeded per store: about 3x cheaper than SipHash on short
    // keys, and the random seed keeps clients from choosing colliding keys blind.
    map: DashMap<Box<[u8]>, TokenBucket, foldhash::quality::RandomState>,
    // Counted separately because DashMap::len visits every shard. Relaxed: only a bound.
    len: AtomicUsize,
    max_keys: usize,
    /// Shared by every key that arrives while the store is full: conservative, since all of
    /// them drain one bucket, so an abuser cannot earn a fresh bucket by flooding keys.
    overflow: TokenBucket,
    keys: IntGauge,
    evicted_idle: IntCounter,
    overflowed: IntCounter,
}

enum BucketRef<'a> {
    Keyed(Ref<'a, Box<[u8]>, TokenBucket>),
    Overflow(&'a TokenBucket),
}

impl std::ops::Deref for BucketRef<'_> {
    type Target = TokenBucket;
    fn deref(&self) -> &TokenBucket {
        match self {
            BucketRef::Keyed(r) => r.value(),
            BucketRef::Overflow(b) => b,
        }
    }
}

impl KeyedStore {
    fn bucket(&self, key: &[u8]) -> BucketRef<'_> {
        if let Some(r) = self.map.get(key) {
            return BucketRef::Keyed(r);
        }
        if self.len.load(Ordering::Relaxed) >= self.max_keys {
            self.overflowed.inc();
            return BucketRef::Overflow(&self.overflow);
        }
        let entry = self.map.entry(Box::from(key));
        let inserted = matches!(entry, dashmap::Entry::Vacant(_));
        let r = entry.or_default().downgrade();
        if inserted {
            self.len.fetch_add(1, Ordering::Relaxed);
            self.keys.inc();
        }
        BucketRef::Keyed(r)
    }

    /// Forgets buckets that have refilled: they are identical to fresh ones, so nothing is
    /// lost. Locks one shard at a time, so requests on other shards never wait.
    fn sweep(&self, now: Nanos) -> usize {
        let mut removed = 0usize;
        self.map.retain(|_, bucket| {
            let idle = bucket.is_idle(now);
            removed += usize::from(idle);
            !idle
        });
        self.len.fetch_sub(removed, Ordering::Relaxed);
        self.keys.sub(removed as i64);
        self.evicted_idle.inc_by(removed as u64);
        removed
    }
}

/// What the caller needs to answer a request, owned so that no snapshot guard outlives
/// `check`.
#[derive(Debug)]
pub enum Verdict {
    /// Forward it. With `headers: always`, the rate-limit state of each rule that applied.
    Allow(SmallVec<[RateState; 2]>),
    /// Answer 429.
    Deny(Denial),
}

/// A rule's state after a decision, for the `RateLimit` headers.
#[derive(Debug, Clone)]
pub struct RateState {
    pub rule: Arc<str>,
    pub policy: HeaderValue,
    pub remaining: u32,
    /// Seconds until the quota is whole again (allowed) or a retry is admitted (denied).
    pub reset_secs: u64,
}

/// Why a request was refused.
#[derive(Debug, Clone)]
pub struct Denial {
    pub state: RateState,
    /// Nanoseconds until a retry would be admitted; `None` = never (cost above burst).
    pub retry_after: Option<Nanos>,
    pub header_mode: HeaderMode,
}

impl Denial {
    /// `Retry-After` in whole seconds: rounded up, at least 1.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(|n| ceil_secs(n).max(1))
    }
}

impl RuleSet {
    /// Compiles `config`'s rules, resolving their metric handles in `metrics`.
    pub fn build(config: &Config, metrics: &Metrics) -> RuleSet {
        let rules = config
            .rules
            .iter()
            .map(|r| {
                let name: Arc<str> = Arc::from(r.name.0.as_str());
                let quota = r.limit.quota;
                let window = ceil_secs(quota.refill_time()).max(1);
                let policy =
                    HeaderValue::from_str(&format!("\"{name}\";q={};w={window}", quota.burst()))
                        .expect("rule names are header-safe by validation");
                let label = &*name;
                CompiledRule {
                    matcher: Matcher::from(&r.matcher),
                    key: r.key.0.clone(),
                    quota,
                    mode: r.mode,
                    store: KeyedStore {
                        map: DashMap::with_hasher(foldhash::quality::RandomState::default()),
                        len: AtomicUsize::new(0),
                        max_keys: r.max_keys.get() as usize,
                        overflow: TokenBucket::new(),
                        keys: metrics.keys.with_label_values(&[label]),
                        evicted_idle: metrics.evicted.with_label_values(&[label, "idle"]),
                        overflowed: metrics.overflow.with_label_values(&[label]),
                    },
                    policy,
                    allowed: metrics.requests.with_label_values(&[label, "allowed"]),
                    rejected: metrics.requests.with_label_values(&[label, "rejected"]),
                    shadow_rejected: metrics
                        .requests
                        .with_label_values(&[label, "shadow_rejected"]),
                    name,
                }
            })
            .collect();
        RuleSet {
            rules,
            header_mode: config.headers,
        }
    }

    pub fn header_mode(&self) -> HeaderMode {
        self.header_mode
    }

    pub fn len(&self) -> usize {
        self.rules.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Decides one request at `now`. Every matching rule applies; the request is refused if
    /// any enforcing rule refuses, and then the tokens other rules had granted are given back.
    /// Shadow rules decide and count what they would have refused, and never refuse.
    pub fn check(&self, req: &RequestView<'_>, now: Nanos) -> Verdict {
        let want_states = self.header_mode == HeaderMode::Always;
        let mut states: SmallVec<[RateState; 2]> = SmallVec::new();
        let mut taken: SmallVec<[(&CompiledRule, BucketRef<'_>); 4]> = SmallVec::new();
        let mut key = KeyBuf::new();
        for rule in &self.rules {
            if !rule.matcher.matches(req) || !extract(&rule.key, req, &mut key) {
                continue;
            }
            let bucket = rule.store.bucket(&key);
            match bucket.check(&rule.quota, now, 1) {
                Decision::Allow {
                    remaining,
                    reset_after,
                } => {
                    if want_states {
                        states.push(rule.state(remaining, ceil_secs(reset_after)));
                    }
                    taken.push((rule, bucket));
                }
                Decision::Deny { retry_after } => match rule.mode {
                    Mode::Shadow => rule.shadow_rejected.inc(),
                    Mode::Enforce => {
                        for (r, b) in &taken {
                            b.refund(&r.quota, 1);
                        }
                        rule.rejected.inc();
                        let denial = Denial {
                            state: rule.state(0, retry_after.map_or(0, |n| ceil_secs(n).max(1))),
                            retry_after,
                            header_mode: self.header_mode,
                        };
                        return Verdict::Deny(denial);
                    }
                },
            }
        }
        for (rule, _) in &taken {
            rule.allowed.inc();
        }
        Verdict::Allow(states)
    }

    /// Forgets idle keys in every rule; returns how many.
    pub fn sweep(&self, now: Nanos) -> usize {
        self.rules.iter().map(|r| r.store.sweep(now)).sum()
    }

    /// Keys tracked by the rule called `name`.
    pub fn tracked_keys(&self, name: &str) -> Option<usize> {
        self.rules
            .iter()
            .find(|r| &*r.name == name)
            .map(|r| r.store.len.load(Ordering::Relaxed))
    }
}

impl CompiledRule {
    fn state(&self, remaining: u32, reset_secs: u64) -> RateState {
        RateState {
            rule: self.name.clone(),
            policy: self.policy.clone(),
            remaining,
            reset_secs,
        }
    }
}

/// A compiled `match:` block; an absent condition always holds.
struct Matcher {
    path: Option<String>,
    path_prefix: Option<String>,
    path_regex: Option<regex::Regex>,
    host: Option<HostPattern>,
    methods: Vec<http::Method>,
    headers: Vec<(http::HeaderName, HeaderValue)>,
    present: Vec<http::HeaderName>,
    absent: Vec<http::HeaderName>,
}

impl From<&Match> for Matcher {
    fn from(m: &Match) -> Self {
        Matcher {
            path: m.path.clone(),
            path_prefix: m.path_prefix.clone(),
            path_regex: m.path_regex.as_ref().map(|r| r.0.clone()),
            host: m.host.clone(),
            methods: m.methods.iter().map(|m| m.0.clone()).collect(),
            headers: m.headers.0.clone(),
            present: m.headers_present.iter().map(|h| h.0.clone()).collect(),
            absent: m.headers_absent.iter().map(|h| h.0.clone()).collect(),
        }
    }
}

impl Matcher {
    #[inline]
    fn matches(&self, req: &RequestView<'_>) -> bool {
        let path = req.uri.path();
        if let Some(p) = &self.path {
            if path != p {
                return false;
            }
        }
        if let Some(p) = &self.path_prefix {
            if !path.starts_with(p.as_str()) {
                return false;
            }
        }
        if !self.methods.is_empty() && !self.methods.contains(req.method) {
            return false;
        }
        if let Some(h) = &self.host {
            if !host_matches(&h.0, req.host) {
                return false;
            }
        }
        if !self.present.iter().all(|h| req.headers.contains_key(h)) {
            return false;
        }
        if self.absent.iter().any(|h| req.headers.contains_key(h)) {
            return false;
        }
        if !self
            .headers
            .iter()
            .all(|(name, want)| req.headers.get_all(name).iter().any(|v| v == want))
        {
            return false;
        }
        if let Some(re) = &self.path_regex {
            if !re.is_match(path) {
                return false;
            }
        }
        true
    }
}

/// `pattern` is lower case: `api.example.com` or `*.example.com` (subdomains only).
fn host_matches(pattern: &str, host: Option<&str>) -> bool {
    let Some(host) = host else { return false };
    match pattern.strip_prefix('*') {
        Some(suffix) => {
            host.len() > suffix.len()
                && host.is_char_boundary(host.len() - suffix.len())
                && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
        }
        None => host.eq_ignore_ascii_case(pattern),
    }
}

#[cfg(test)]
mod tests;
