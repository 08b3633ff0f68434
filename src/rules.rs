//! The compiled rule set and the in-path decision.
//!
//! Owns: turning config rules into matchers, per-key stores and pre-resolved metric handles,
//! built together so that one `ArcSwap` store swaps them together; and [`RuleSet::check`], the
//! synchronous decision for one request. A `scope: redis` rule's question is left open in a
//! [`Remote`]; the caller asks the [`RemoteStore`] and hands the answers back ([`RuleSet::answer`],
//! [`RuleSet::finish`]). Must never: await, import the data plane or Redis, log per request,
//! allocate for a key it already tracks, or hold a store guard beyond the call.
//!
//! Cost of `check` per matching rule: a few string compares for the match, the key written
//! into a stack buffer, one hash of it, one sharded read lock + lookup by borrowed bytes, the
//! algorithm's CAS (a per-key lock for the sliding log), one relaxed counter add. A new key
//! costs a shard write lock (and a heap copy of the key past 24 bytes; keys past 64 bytes are
//! kept as a 17-byte keyed hash). A full store first replaces states indistinguishable from
//! fresh (a sweep, at most every 100 ms, backing off to 5 s while none frees); keys that still
//! find no place are decided by the rule's count-min sketch (rate limits) or share one
//! overflow state (the others). Measured in `benches/decision.rs`.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use dashmap::DashMap;
use http::HeaderValue;
use prometheus::{IntCounter, IntGauge};
use smallvec::SmallVec;

use crate::config::OnError;
use crate::config::{
    Config, Cost, CostFrom, HeaderMode, HostPattern, Limit, Match, Mode, OnLimit, Rule, Scope,
    SketchSize,
};
use crate::control::{DropRatios, Staleness};
use crate::key::{
    bound_local, canonical_text, extract, extract_text, Extract, KeyBuf, KeyPart, RequestView,
};
use crate::limit::{
    ceil_secs, Adaptive, Algorithm, Concurrency, Decision, FixedWindow, Gcra, LeakyBucket, Limiter,
    Nanos, Permit, Quota, Sketch, SlidingWindowCounter, SlidingWindowLog, TokenBucket,
    NANOS_PER_SEC,
};
use crate::metrics::Metrics;
use crate::respond::answers::Answers;

/// Every rule of one configuration, ready to decide.
pub struct RuleSet {
    rules: Vec<CompiledRule>,
    header_mode: HeaderMode,
    /// The control plane's drop ratios for global rules, published by the reporter.
    ratios: Arc<ArcSwap<DropRatios>>,
    staleness: Staleness,
    /// How often ratios are refreshed, for the retry hint of a global drop.
    report_interval: Nanos,
    /// Rejection log lines per rule per second (`log_rejections`).
    log_rejections: u32,
    /// Redis, for `scope: redis` rules; kept across reloads by whoever builds the set.
    store: Option<Arc<dyn RemoteStore>>,
}

struct CompiledRule {
    name: Arc<str>,
    matcher: Matcher,
    key: Vec<KeyPart>,
    mode: Mode,
    cost: Cost,
    /// The per-key state, shared with the next rule set when a reload leaves the rule's
    /// identity unchanged.
    kind: Arc<Kind>,
    /// Name, key, limit, scope, fallback and max_keys: what the state depends on.
    identity: String,
    delay: Option<Delay>,
    /// A leaky bucket's `max_delay`: a request that would wait longer in its queue is refused
    /// (`Nanos::MAX`: no bound but the queue's).
    max_wait: Nanos,
    /// `"name";q=<burst>;w=<window seconds>`, built once.
    policy: HeaderValue,
    /// This rule's 429s, built once per retry hint.
    answers: Arc<Answers>,
    allowed: IntCounter,
    rejected: IntCounter,
    shadow_rejected: IntCounter,
    /// Rejections logged in the current second.
    logged: LogBudget,
}

/// How many of a rule's rejections were logged in the current second: the log answers "why
/// did I get a 429?" without a line per refusal under a flood.
#[derive(Default)]
struct LogBudget {
    second: AtomicU64,
    count: AtomicU32,
}

impl LogBudget {
    /// Whether one more line fits in `per_second` at `now`. Relaxed: a bound, not an exact
    /// count (two threads turning the second may let one more through).
    fn take(&self, now: Nanos, per_second: u32) -> bool {
        if per_second == 0 {
            return false;
        }
        // Read first: under a flood most refusals find this second's budget spent, and then
        // write nothing to a line every worker reads.
        let this = now / NANOS_PER_SEC;
        if self.second.load(Ordering::Relaxed) != this {
            if self.second.swap(this, Ordering::Relaxed) != this {
                self.count.store(0, Ordering::Relaxed);
            }
        } else if self.count.load(Ordering::Relaxed) >= per_second {
            return false;
        }
        self.count.fetch_add(1, Ordering::Relaxed) < per_second
    }
}

enum Kind {
    Rate {
        quota: Quota,
        store: RateStore,
        /// Decides the keys that find no place in `store`.
        overflow: Overflow,
    },
    Concurrency {
        max: u32,
        store: Store<Arc<Concurrency>>,
    },
    /// In flight at once for the whole rule, a limit that follows the upstream's latency.
    Adaptive { limiter: Arc<Adaptive> },
    /// Decided by a script in Redis, after the local rules; see [`RuleSet::resolve`].
    Redis {
        algorithm: Algorithm,
        quota: Quota,
        /// Keys Redis refused, until when: answered here without a round trip.
        refused: Store<Refused>,
        cache_answers: IntCounter,
        /// The local limit of `on_error: fallback`.
        fallback: Option<Fallback>,
    },
    /// Enforced by the control plane's drop ratio; counted here for the reports.
    Global {
        limit: crate::control::Limit,
        store: Store<Arc<GlobalCounters>>,
        /// A local limit for while the control plane is stale.
        fallback: Option<Fallback>,
    },
}

/// Offered and admitted requests of one (global rule, key) since the last report.
#[derive(Debug, Default)]
pub struct GlobalCounters {
    // Relaxed: counters; the reporter's swap reads each exactly once.
    offered: AtomicU64,
    admitted: AtomicU64,
}

/// A key Redis refused: requests of at least `cost` are refused until `until` (local clock).
#[derive(Debug, Default)]
pub struct Refused {
    // Relaxed: a hint; a torn pair at worst asks Redis once more.
    until: AtomicU64,
    cost: AtomicU32,
}

impl Refused {
    fn remember(&self, until: Nanos, cost: u32) {
        self.until.store(until, Ordering::Relaxed);
        self.cost.store(cost, Ordering::Relaxed);
    }

    /// Past its retry time: as good as no entry.
    fn expired(&self, now: Nanos) -> bool {
        self.until.load(Ordering::Relaxed) <= now
    }

    fn refused(&self, now: Nanos, cost: u32) -> Option<Nanos> {
        let until = self.until.load(Ordering::Relaxed);
        (until > now && cost >= self.cost.load(Ordering::Relaxed)).then(|| until - now)
    }
}

/// Why a request is not admitted.
#[derive(Debug)]
pub enum Refusal {
    /// A rule refused it: 429.
    Limited(Denial),
    /// A rule cannot decide it as sent (its cost, a keyed field twice): 400.
    BadRequest(crate::rules::BadRequest),
}

/// What a granted rule needs at the end of the decision (count it) or on a refusal (refund).
#[derive(Debug)]
pub enum Taken {
    Rate(Slot, u32),
    Concurrency,
    Global(Arc<GlobalCounters>, Option<Slot>),
    /// Admitted by Redis (nothing to give back there), or by the local fallback limit (its
    /// slot and the units it took).
    Redis(Option<(Slot, u32)>),
}

/// The local part of a decision that waits for Redis: what the local rules granted, and the
/// questions for Redis. Owned, so no snapshot guard is held while Redis answers.
#[derive(Debug)]
pub struct Remote {
    admit: Admit,
    taken: SmallVec<[(usize, Taken); 4]>,
    calls: SmallVec<[RedisCall; 1]>,
    /// Questions answered so far.
    asked: usize,
}

impl Remote {
    /// The next question for the store, or `None` once all were answered.
    pub fn question<'a>(&'a self, rules: &'a RuleSet) -> Option<Question<'a>> {
        let call = self.calls.get(self.asked)?;
        let rule = &rules.rules[call.rule];
        let Kind::Redis {
            algorithm, quota, ..
        } = &*rule.kind
        else {
            return None;
        };
        Some(Question {
            rule: &rule.name,
            key: &call.key,
            algorithm: *algorithm,
            quota,
            cost: call.cost,
        })
    }
}

/// One question for the store: may `cost` units of `key` pass `rule`'s limit?
#[derive(Debug, Clone, Copy)]
pub struct Question<'a> {
    pub rule: &'a str,
    pub key: &'a [u8],
    pub algorithm: Algorithm,
    pub quota: &'a Quota,
    pub cost: u32,
}

/// The store's answer to a [`Question`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreAnswer {
    pub admitted: bool,
    pub remaining: u32,
    /// Nanoseconds until a retry can be admitted; `None`: never (the cost exceeds the limit).
    pub retry_after: Option<Nanos>,
    /// Nanoseconds until the quota is whole again (window end, or the bucket full).
    pub reset_after: Nanos,
}

/// Where `scope: redis` rules are decided (Redis, through `exact`). The caller of
/// [`RuleSet::check`] asks it and hands each answer to [`RuleSet::answer`]: the rule set never
/// awaits.
pub trait RemoteStore: Send + Sync {
    /// Answers `q`, or `None` when the store gave no answer (then `on_error` decides).
    fn decide<'a>(
        &'a self,
        q: Question<'a>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<StoreAnswer>> + Send + 'a>>;
    /// What a decision does when the store gave no answer.
    fn on_error(&self) -> OnError;
    /// Whether a refusal is remembered until its retry time and answered without asking.
    fn cache_refusals(&self) -> bool;
    /// The retry hint of a refusal made without the store (`on_error: deny`).
    fn retry_hint(&self) -> Nanos;
    fn metrics(&self) -> &crate::metrics::RedisMetrics;
}

#[derive(Debug)]
struct RedisCall {
    rule: usize,
    key: Vec<u8>,
    cost: u32,
}

/// The counts of one global rule since the last report, heaviest keys first.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalCounts {
    pub rule: String,
    pub limit: crate::control::Limit,
    /// (key, offered, admitted) for the `top_k` keys that offered most.
    pub keys: Vec<(String, u64, u64)>,
    /// Offered and admitted of every other key, and how many keys that is.
    pub other: (u64, u64, u64),
}

/// The count-min sketch of a rate rule's untracked keys, made when the store first fills.
struct Overflow {
    sketch: std::sync::OnceLock<Sketch>,
    size: SketchSize,
    /// Refusals the sketch made (conservative: its estimates only over-count).
    refused: IntCounter,
}

impl Overflow {
    fn sketch(&self) -> &Sketch {
        self.sketch.get_or_init(|| {
            Sketch::new(
                self.size.width.get() as usize,
                self.size.depth.get() as usize,
            )
        })
    }
}

/// A leaky bucket's admission whose wait passes its `max_delay` by `over`: its place in the
/// queue is given back (the next request may fit), and it is refused.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn waits_too_long(
    store: &RateStore,
    key: &[u8],
    slot: Slot,
    quota: &Quota,
    now: Nanos,
    cost: u32,
    overflow: &Overflow,
    over: Nanos,
) -> Decision {
    store.refund(key, slot, quota, now, cost, overflow);
    Decision::Deny {
        retry_after: Some(over),
    }
}

/// A global or redis rule's `fallback:` limit: a local rate limit of its own algorithm.
struct Fallback {
    quota: Quota,
    store: RateStore,
    overflow: Overflow,
}

impl Fallback {
    fn check(&self, key: &[u8], now: Nanos, cost: u32) -> (Decision, Slot) {
        self.store
            .check(key, &self.quota, now, cost, &self.overflow)
    }

    fn refund(&self, key: &[u8], slot: Slot, now: Nanos, cost: u32) {
        self.store
            .refund(key, slot, &self.quota, now, cost, &self.overflow)
    }

    fn sweep(&self, now: Nanos) -> usize {
        self.store.sweep(&self.quota, now)
    }
}

/// One store per algorithm, so that each key costs only its own algorithm's state.
enum RateStore {
    TokenBucket(Store<TokenBucket>),
    Gcra(Store<Gcra>),
    LeakyBucket(Store<LeakyBucket>),
    FixedWindow(Store<FixedWindow>),
    SlidingWindowLog(Store<SlidingWindowLog>),
    SlidingWindowCounter(Store<SlidingWindowCounter>),
}

macro_rules! each_store {
    ($rs:expr, $s:ident => $body:expr) => {
        match $rs {
            RateStore::TokenBucket($s) => $body,
            RateStore::Gcra($s) => $body,
            RateStore::LeakyBucket($s) => $body,
            RateStore::FixedWindow($s) => $body,
            RateStore::SlidingWindowLog($s) => $body,
            RateStore::SlidingWindowCounter($s) => $body,
        }
    };
}

impl RateStore {
    fn new(algorithm: Algorithm, parts: StoreParts) -> Self {
        match algorithm {
            Algorithm::TokenBucket => RateStore::TokenBucket(Store::new(parts)),
            Algorithm::Gcra => RateStore::Gcra(Store::new(parts)),
            Algorithm::LeakyBucket => RateStore::LeakyBucket(Store::new(parts)),
            Algorithm::FixedWindow => RateStore::FixedWindow(Store::new(parts)),
            Algorithm::SlidingWindowLog => RateStore::SlidingWindowLog(Store::new(parts)),
            Algorithm::SlidingWindowCounter => RateStore::SlidingWindowCounter(Store::new(parts)),
        }
    }

    #[inline]
    fn check(
        &self,
        key: &[u8],
        quota: &Quota,
        now: Nanos,
        cost: u32,
        overflow: &Overflow,
    ) -> (Decision, Slot) {
        let tracked = each_store!(self, s => s
            .tracked(key, now, |st| st.is_idle(quota, now))
            .map(|st| st.check(quota, now, cost)));
        match tracked {
            Some(decision) => (decision, Slot::Keyed),
            None => {
                let decision = overflow.sketch().check(key, quota, now, cost);
                if !decision.is_allowed() {
                    overflow.refused.inc();
                }
                (decision, Slot::Sketch)
            }
        }
    }

    fn refund(
        &self,
        key: &[u8],
        slot: Slot,
        quota: &Quota,
        now: Nanos,
        cost: u32,
        overflow: &Overflow,
    ) {
        if slot == Slot::Sketch {
            overflow.sketch().refund(key, quota, now, cost);
            return;
        }
        each_store!(self, s => s.with_slot(key, slot, |st| st.refund(quota, now, cost)))
    }

    fn sweep(&self, quota: &Quota, now: Nanos) -> usize {
        each_store!(self, s => s.sweep(|st| st.is_idle(quota, now)))
    }

    fn len(&self) -> usize {
        each_store!(self, s => s.len.load(Ordering::Relaxed))
    }
}

/// Which state a decision used, so that a refund reaches the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    Keyed,
    /// The store's one shared overflow state.
    Overflow,
    /// A rate rule's sketch.
    Sketch,
}

struct StoreParts {
    max_keys: usize,
    keys: IntGauge,
    evicted_idle: IntCounter,
    overflowed: IntCounter,
}

/// A key as stored: inline up to 24 bytes (an IPv6 address with its framing fits), so that a
/// lookup does not chase a pointer to a separate allocation; longer keys spill to the heap.
type StoredKey = SmallVec<[u8; 24]>;

/// One state per key, bounded by `max_keys`.
struct Store<S> {
    // DashMap shards its table behind per-shard RwLocks: a lookup of a known key takes one
    // shard's read lock for the length of a CAS, never a global lock. foldhash's quality
    // variant, seeded per store, is much cheaper than SipHash on short keys, and the random
    // seed keeps clients from choosing colliding keys blind.
    map: DashMap<StoredKey, S, foldhash::quality::RandomState>,
    // Counted apart because DashMap::len visits every shard. Relaxed: only a bound.
    len: AtomicUsize,
    max_keys: usize,
    /// Shared by every key that finds no place while the store is full (rate rules use their
    /// sketch instead): conservative, since all of them drain one state.
    overflow: S,
    parts: StoreParts,
    // When the store last looked for idle states to replace (clock nanoseconds), and how long
    // until it looks again: doubled, up to the background sweep's period, while a look frees
    // nothing. Relaxed + CAS: they only pick which caller sweeps, at most one per interval.
    reclaimed_at: AtomicU64,
    reclaim_every: AtomicU64,
}

/// A full store looks for states to replace at most this often (a sweep visits every key)...
const RECLAIM_EVERY: Nanos = NANOS_PER_SEC / 10;
/// ...and, while its looks free nothing, backs off to this.
const RECLAIM_AT_MOST: Nanos = 5 * NANOS_PER_SEC;

impl<S: Default + Send + Sync + 'static> Store<S> {
    fn new(parts: StoreParts) -> Self {
        Store {
            map: DashMap::with_hasher(foldhash::quality::RandomState::default()),
            len: AtomicUsize::new(0),
            max_keys: parts.max_keys,
            overflow: S::default(),
            parts,
            reclaimed_at: AtomicU64::new(0),
            reclaim_every: AtomicU64::new(RECLAIM_EVERY),
        }
    }

    /// Runs `f` on the state of `key`, creating it when there is room (made, if need be, by
    /// forgetting states that `idle` says are fresh); else on the shared overflow state.
    #[inline]
    fn with<R>(
        &self,
        key: &[u8],
        now: Nanos,
        idle: impl Fn(&S) -> bool,
        f: impl FnOnce(&S) -> R,
    ) -> (R, Slot) {
        match self.tracked(key, now, idle) {
            Some(state) => (f(&state), Slot::Keyed),
            None => (f(&self.overflow), Slot::Overflow),
        }
    }

    /// The state of `key`, created when there is room; `None` when the store is full of
    /// states that are not idle.
    #[inline]
    fn tracked(
        &self,
        key: &[u8],
        now: Nanos,
        idle: impl Fn(&S) -> bool,
    ) -> Option<dashmap::mapref::one::Ref<'_, StoredKey, S>> {
        if let Some(r) = self.map.get(key) {
            return Some(r);
        }
        if self.len.load(Ordering::Relaxed) >= self.max_keys && self.reclaim(now, idle) == 0 {
            self.parts.overflowed.inc();
            return None;
        }
        let entry = self.map.entry(StoredKey::from_slice(key));
        let inserted = matches!(entry, dashmap::Entry::Vacant(_));
        let r = entry.or_default().downgrade();
        if inserted {
            self.len.fetch_add(1, Ordering::Relaxed);
            self.parts.keys.inc();
        }
        Some(r)
    }

    /// Forgets idle states so that new keys can take their place: nothing is lost, since an
    /// idle state is indistinguishable from a fresh one. At most once per [`RECLAIM_EVERY`],
    /// backing off to [`RECLAIM_AT_MOST`] while nothing is freed.
    #[cold]
    fn reclaim(&self, now: Nanos, idle: impl Fn(&S) -> bool) -> usize {
        let last = self.reclaimed_at.load(Ordering::Relaxed);
        let every = self.reclaim_every.load(Ordering::Relaxed);
        if now.saturating_sub(last) < every && last != 0 {
            return 0;
        }
        if self
            .reclaimed_at
            .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return 0;
        }
        let freed = self.sweep(idle);
        let next = if freed == 0 {
            (every * 2).min(RECLAIM_AT_MOST)
        } else {
            RECLAIM_EVERY
        };
        self.reclaim_every.store(next, Ordering::Relaxed);
        freed
    }

    /// Runs `f` on the state a decision used, if it still exists.
    fn with_slot(&self, key: &[u8], slot: Slot, f: impl FnOnce(&S)) {
        match slot {
            Slot::Overflow => f(&self.overflow),
            Slot::Sketch => {}
            Slot::Keyed => {
                if let Some(r) = self.map.get(key) {
                    f(r.value())
                }
            }
        }
    }

    /// Forgets the states `idle` says are fresh: nothing is lost. Locks one shard at a time,
    /// so requests on other shards never wait.
    fn sweep(&self, idle: impl Fn(&S) -> bool) -> usize {
        let mut removed = 0usize;
        self.map.retain(|_, state| {
            let forget = idle(state);
            removed += usize::from(forget);
            !forget
        });
        self.len.fetch_sub(removed, Ordering::Relaxed);
        self.parts.keys.sub(removed as i64);
        self.parts.evicted_idle.inc_by(removed as u64);
        removed
    }
}

impl<S> Drop for Store<S> {
    /// A store dropped by a reload (its rule changed or went away) no longer tracks its keys.
    fn drop(&mut self) {
        self.parts.keys.sub(self.len.load(Ordering::Relaxed) as i64);
    }
}

/// The waiting room of an `on_limit: delay` rule.
#[derive(Debug, Clone)]
pub struct Delay {
    pub max_delay: Nanos,
    pub queue: Arc<DelayQueue>,
}

/// Counts the requests of one rule waiting for admission.
#[derive(Debug)]
pub struct DelayQueue {
    // Relaxed: a bound, exact because every change is one read-modify-write.
    waiting: AtomicU32,
    max: u32,
    gauge: IntGauge,
    /// Requests that waited and were then admitted.
    delayed: IntCounter,
}

impl DelayQueue {
    /// A place in the queue, if there is one.
    pub fn enter(self: &Arc<Self>) -> Option<QueuePlace> {
        self.waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()?;
        self.gauge.inc();
        Some(QueuePlace(self.clone()))
    }
}

/// A place in a [`DelayQueue`]; dropping it (admitted, refused, or the client gone) frees it.
#[derive(Debug)]
pub struct QueuePlace(Arc<DelayQueue>);

impl QueuePlace {
    /// The request that held this place was admitted: count it and free the place.
    pub fn admitted(self) {
        self.0.delayed.inc();
    }
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
        self.0.gauge.dec();
    }
}

/// What the caller needs to answer a request, owned so that no snapshot guard outlives
/// `check`.
#[derive(Debug)]
pub enum Verdict {
    Allow(Admit),
    /// Answer 429 (or wait, when the denial carries a [`Delay`]).
    Deny(Denial),
    /// The request is malformed for a rule (its cost, a keyed field sent twice): answer 400.
    BadRequest(BadRequest),
    /// Local rules admit it; `scope: redis` rules still must: call [`RuleSet::resolve`].
    /// Boxed: it is the rare, network-bound case, and it would triple the size of every
    /// verdict returned on the hot path.
    Remote(Box<Remote>),
}

/// Why a rule cannot decide a request: answered 400, naming the rule.
#[derive(Debug, Clone)]
pub struct BadRequest {
    pub rule: Arc<str>,
    /// The `spillway_bad_requests_total` reason.
    pub reason: &'static str,
    pub detail: String,
}

/// An admitted request.
#[derive(Debug, Default)]
pub struct Admit {
    /// With `headers: always`, the rate-limit state of each rule that applied.
    pub states: SmallVec<[RateState; 2]>,
    /// Concurrency slots, to be held until the response body ends.
    pub permits: SmallVec<[Permit; 1]>,
    /// How long a shaping rule (leaky bucket) wants the request to wait before it goes on.
    pub wait: Nanos,
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
    /// Set when the refusing rule has `on_limit: delay`.
    pub delay: Option<Delay>,
    /// Refused for capacity (an adaptive limit), not quota: 503, not 429.
    pub capacity: bool,
    /// The refusing rule's prepared 429 parts.
    pub answers: Arc<Answers>,
}

impl Denial {
    /// `Retry-After` in whole seconds: rounded up, at least 1.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(|n| ceil_secs(n).max(1))
    }
}

/// A concurrency limit cannot know when a slot frees; this is the hint it gives.
const CONCURRENCY_RETRY: Nanos = NANOS_PER_SEC;

impl RuleSet {
    /// Compiles `config`'s rules, resolving their metric handles in `metrics`.
    pub fn build(config: &Config, metrics: &Metrics) -> RuleSet {
        let ratios = Arc::new(ArcSwap::from_pointee(DropRatios::empty(0)));
        Self::build_with_ratios(config, metrics, ratios)
    }

    /// As [`build`](Self::build), with global rules reading the drop ratios in `ratios`.
    pub fn build_with_ratios(
        config: &Config,
        metrics: &Metrics,
        ratios: Arc<ArcSwap<DropRatios>>,
    ) -> RuleSet {
        Self::rebuild(config, metrics, ratios, None)
    }

    /// Builds the rule set of a reloaded `config`, keeping the state of every rule of
    /// `previous` whose identity did not change (see [`from_rules`](Self::from_rules)).
    pub fn rebuild(
        config: &Config,
        metrics: &Metrics,
        ratios: Arc<ArcSwap<DropRatios>>,
        previous: Option<&RuleSet>,
    ) -> RuleSet {
        let mut set = Self::from_rules_keeping(&config.rules, config.headers, metrics, previous);
        set.ratios = ratios;
        set.log_rejections = config.log_rejections;
        if let Some(cp) = &config.control_plane {
            set.staleness = Staleness {
                stale_after: cp.stale_after.0.as_nanos() as Nanos,
                decay: cp.decay.0.as_nanos() as Nanos,
            };
            set.report_interval = cp.report_interval.0.as_nanos() as Nanos;
        }
        set
    }

    /// Compiles `rules`, resolving their metric handles in `metrics`.
    pub fn from_rules(rules: &[Rule], header_mode: HeaderMode, metrics: &Metrics) -> RuleSet {
        Self::from_rules_keeping(rules, header_mode, metrics, None)
    }

    /// As [`from_rules`](Self::from_rules); a rule whose identity (name, key, limit, scope,
    /// fallback, max_keys) is the same as one of `previous`'s shares that rule's per-key state,
    /// so a reload hands no client a fresh bucket. Other rules start empty.
    fn from_rules_keeping(
        rules: &[Rule],
        header_mode: HeaderMode,
        metrics: &Metrics,
        previous: Option<&RuleSet>,
    ) -> RuleSet {
        RuleSet {
            rules: rules
                .iter()
                .map(|r| {
                    let identity = identity(r);
                    let kept = previous.and_then(|p| {
                        p.rules
                            .iter()
                            .find(|old| old.identity == identity)
                            .map(|old| old.kind.clone())
                    });
                    compile(r, metrics, identity, kept)
                })
                .collect(),
            header_mode,
            ratios: Arc::new(ArcSwap::from_pointee(DropRatios::empty(0))),
            staleness: Staleness {
                stale_after: 5 * NANOS_PER_SEC,
                decay: 10 * NANOS_PER_SEC,
            },
            report_interval: NANOS_PER_SEC,
            log_rejections: crate::config::DEFAULT_LOG_REJECTIONS,
            store: None,
        }
    }

    /// Names of the rules that share their state with `other` (kept across a reload).
    pub fn kept_from(&self, other: &RuleSet) -> Vec<String> {
        self.rules
            .iter()
            .filter(|r| other.rules.iter().any(|o| Arc::ptr_eq(&o.kind, &r.kind)))
            .map(|r| r.name.to_string())
            .collect()
    }

    /// Gives `scope: redis` rules their store (Redis).
    pub fn with_store(mut self, store: Option<Arc<dyn RemoteStore>>) -> Self {
        self.store = store;
        self
    }

    /// The store that decides `scope: redis` rules, for the caller to ask.
    pub fn store(&self) -> Option<&Arc<dyn RemoteStore>> {
        self.store.as_ref()
    }

    /// Decides one request at `now`. Every matching rule applies; the request is refused if
    /// any enforcing rule refuses, and then the units other rules had granted are given back.
    /// Shadow rules decide and count what they would have refused, and never refuse.
    pub fn check(&self, req: &RequestView<'_>, now: Nanos) -> Verdict {
        let want_states = self.header_mode == HeaderMode::Always;
        let mut admit = Admit::default();
        // Rules that granted units, for the refund if a later one refuses.
        let mut taken: SmallVec<[(usize, Taken); 4]> = SmallVec::new();
        let mut calls: SmallVec<[RedisCall; 1]> = SmallVec::new();
        let mut key = KeyBuf::new();
        let mut ratios = None;
        for (i, rule) in self.rules.iter().enumerate() {
            if !rule.matcher.matches(req) {
                continue;
            }
            match rule.key_of(req, &mut key) {
                Extract::Found => {}
                Extract::Missing => continue,
                Extract::Repeated => {
                    self.refund(req, &taken, now);
                    return Verdict::BadRequest(rule.repeated_key(req));
                }
            }
            let cost = match rule.cost_of(req) {
                Ok(cost) => cost,
                Err(bad) => {
                    self.refund(req, &taken, now);
                    return Verdict::BadRequest(bad);
                }
            };
            let decision = match &*rule.kind {
                Kind::Rate {
                    quota,
                    store,
                    overflow,
                } => {
                    let (decision, slot) = store.check(&key, quota, now, cost, overflow);
                    match decision {
                        Decision::Allow { wait, .. } if wait > rule.max_wait => {
                            let over = wait - rule.max_wait;
                            waits_too_long(store, &key, slot, quota, now, cost, overflow, over)
                        }
                        Decision::Allow { .. } => {
                            taken.push((i, Taken::Rate(slot, cost)));
                            decision
                        }
                        deny => deny,
                    }
                }
                Kind::Adaptive { limiter } => {
                    let permit = limiter.try_acquire().map(Permit::from);
                    slot(permit, limiter.limit(), i, &mut admit, &mut taken)
                }
                Kind::Redis {
                    refused,
                    cache_answers,
                    ..
                } => match refused.map.get(&key[..]).and_then(|r| r.refused(now, cost)) {
                    Some(retry) => {
                        cache_answers.inc();
                        Decision::Deny {
                            retry_after: Some(retry),
                        }
                    }
                    None => {
                        // Decided by Redis once the local rules have all admitted.
                        calls.push(RedisCall {
                            rule: i,
                            key: key.to_vec(),
                            cost,
                        });
                        continue;
                    }
                },
                Kind::Concurrency { max, store } => {
                    let (permit, _) =
                        store.with(&key, now, concurrency_idle, |c| c.try_acquire(*max));
                    slot(permit, *max, i, &mut admit, &mut taken)
                }
                Kind::Global {
                    limit,
                    store,
                    fallback,
                } => {
                    let (counters, _) = store.with(&key, now, global_idle, Arc::clone);
                    counters.offered.fetch_add(1, Ordering::Relaxed);
                    // One snapshot load per request, however many global rules match.
                    let ratios = ratios.get_or_insert_with(|| self.ratios.load());
                    let age = now.saturating_sub(ratios.at);
                    let (factor, stale) = self.staleness.factor(age);
                    let (decision, slot) = match fallback {
                        Some(fallback) if stale => {
                            let (d, slot) = fallback.check(&key, now, 1);
                            (d, Some(slot))
                        }
                        _ => {
                            let p = ratios.ratio(&rule.name, &key) * factor;
                            let d = if p > 0.0 && fastrand::f64() < p {
                                // The ratio may change with the next reply.
                                let interval = self.report_interval.max(1);
                                Decision::Deny {
                                    retry_after: Some(interval - age % interval),
                                }
                            } else {
                                Decision::Allow {
                                    remaining: if p > 0.0 { 0 } else { limit.count as u32 },
                                    reset_after: 0,
                                    wait: 0,
                                }
                            };
                            (d, None)
                        }
                    };
                    if decision.is_allowed() {
                        taken.push((i, Taken::Global(counters, slot)));
                    }
                    decision
                }
            };
            match decision {
                Decision::Allow {
                    remaining,
                    reset_after,
                    wait,
                } => {
                    admit.wait = admit.wait.max(wait);
                    if want_states {
                        admit
                            .states
                            .push(rule.state(remaining, ceil_secs(reset_after)));
                    }
                }
                Decision::Deny { retry_after } => match rule.mode {
                    Mode::Shadow => {
                        rule.shadow_rejected.inc();
                        self.log_rejection(rule, req, "shadow_rejected", now);
                    }
                    Mode::Enforce => {
                        self.log_rejection(rule, req, "rejected", now);
                        return self.refuse(rule, req, &taken, now, retry_after);
                    }
                },
            }
        }
        if !calls.is_empty() {
            return Verdict::Remote(Box::new(Remote {
                admit,
                taken,
                calls,
                asked: 0,
            }));
        }
        self.commit(&taken);
        Verdict::Allow(admit)
    }

    /// Refuses a request for `rule`: gives back what `taken` granted, counts the rejection,
    /// and says when to retry (a redis rule has no delay and no adaptive limit: the fields
    /// follow from the rule).
    fn refuse(
        &self,
        rule: &CompiledRule,
        req: &RequestView<'_>,
        taken: &[(usize, Taken)],
        now: Nanos,
        retry_after: Option<Nanos>,
    ) -> Verdict {
        self.refund(req, taken, now);
        rule.rejected.inc();
        let reset = retry_after.map_or(0, |n| ceil_secs(n).max(1));
        Verdict::Deny(Denial {
            state: rule.state(0, reset),
            retry_after,
            header_mode: self.header_mode,
            delay: rule.delay.clone(),
            capacity: matches!(*rule.kind, Kind::Adaptive { .. }),
            answers: rule.answers.clone(),
        })
    }

    /// Logs a rejection by `rule` of `req`, within the rule's budget of lines a second
    /// (`log_rejections`): the rule, the decision, the key in the form global rules report it
    /// (`sha256:` and a digest past 64 bytes or for bytes that are not UTF-8, as the UI shows
    /// it), the client, method, path and the request's `traceparent`.
    #[cold]
    fn log_rejection(
        &self,
        rule: &CompiledRule,
        req: &RequestView<'_>,
        decision: &str,
        now: Nanos,
    ) {
        // A rule that delays decides again when the wait ends: only its final refusal (in
        // the gate) is one, and that is not logged here.
        if rule.delay.is_some() || !rule.logged.take(now, self.log_rejections) {
            return;
        }
        // Worked out again in text form: a local rule keeps its key as bytes.
        let mut text = KeyBuf::new();
        extract_text(&rule.key, req, &mut text);
        crate::key::canonical_text(&mut text);
        let traceparent = req
            .headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        tracing::info!(
            target: "spillway::rejection",
            rule = %rule.name,
            decision,
            key = %String::from_utf8_lossy(&text),
            client = %req.client_ip,
            method = %req.method,
            path = %req.uri.path(),
            traceparent,
            "request refused by a rule"
        );
    }

    /// Counts an admitted request on every rule that granted it.
    fn commit(&self, taken: &[(usize, Taken)]) {
        for (i, t) in taken {
            self.rules[*i].allowed.inc();
            if let Taken::Global(counters, _) = t {
                counters.admitted.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Applies the store's answer to the first open question of `remote` (`None`: the store
    /// gave none, and `on_error` decides): a verdict when that ends the decision (a refusal,
    /// which gives back what the local rules granted and is remembered until its retry time,
    /// so that the key's next requests are answered here). Units the store granted to earlier
    /// rules of a refused request are not given back (Redis has no refund).
    pub fn answer(
        &self,
        remote: &mut Remote,
        answer: Option<StoreAnswer>,
        req: &RequestView<'_>,
        now: Nanos,
    ) -> Option<Verdict> {
        let call = remote.calls.get(remote.asked)?;
        remote.asked += 1;
        let rule = &self.rules[call.rule];
        let Kind::Redis {
            refused, fallback, ..
        } = &*rule.kind
        else {
            return None;
        };
        let (decision, slot) = match answer {
            Some(a) if a.admitted => (
                Decision::Allow {
                    remaining: a.remaining,
                    reset_after: a.reset_after,
                    wait: 0,
                },
                None,
            ),
            Some(a) => {
                let cache = self.store.as_ref().is_some_and(|s| s.cache_refusals());
                if let (Some(retry), true) = (a.retry_after, cache) {
                    refused.with(
                        &call.key,
                        now,
                        |r| r.expired(now),
                        |r| r.remember(now.saturating_add(retry), call.cost),
                    );
                }
                (
                    Decision::Deny {
                        retry_after: a.retry_after,
                    },
                    None,
                )
            }
            None => self.on_redis_error(fallback, call, now),
        };
        match decision {
            Decision::Allow {
                remaining,
                reset_after,
                ..
            } => {
                remote.taken.push((call.rule, Taken::Redis(slot)));
                if self.header_mode == HeaderMode::Always {
                    remote
                        .admit
                        .states
                        .push(rule.state(remaining, ceil_secs(reset_after)));
                }
                None
            }
            Decision::Deny { retry_after } => match rule.mode {
                Mode::Shadow => {
                    rule.shadow_rejected.inc();
                    self.log_rejection(rule, req, "shadow_rejected", now);
                    None
                }
                Mode::Enforce => {
                    self.log_rejection(rule, req, "rejected", now);
                    Some(self.refuse(rule, req, &remote.taken, now, retry_after))
                }
            },
        }
    }

    /// The verdict of a decision whose every question was answered without a refusal.
    pub fn finish(&self, remote: Box<Remote>) -> Verdict {
        self.commit(&remote.taken);
        Verdict::Allow(remote.admit)
    }

    /// The decision `on_error` makes when Redis gave no answer.
    fn on_redis_error(
        &self,
        fallback: &Option<Fallback>,
        call: &RedisCall,
        now: Nanos,
    ) -> (Decision, Option<(Slot, u32)>) {
        let Some(store) = &self.store else {
            return (Decision::Deny { retry_after: None }, None);
        };
        let metrics = store.metrics();
        match (store.on_error(), fallback) {
            (OnError::Fallback, Some(fallback)) => {
                metrics.on_error_fallback.inc();
                let (d, slot) = fallback.check(&call.key, now, call.cost);
                (d, Some((slot, call.cost)))
            }
            (OnError::Deny, _) => {
                metrics.on_error_deny.inc();
                (
                    Decision::Deny {
                        retry_after: Some(store.retry_hint()),
                    },
                    None,
                )
            }
            _ => {
                metrics.on_error_allow.inc();
                (
                    Decision::Allow {
                        remaining: 0,
                        reset_after: 0,
                        wait: 0,
                    },
                    None,
                )
            }
        }
    }

    /// Gives back what `taken` granted. The keys are extracted again from the request rather
    /// than copied on every decision: refunds are the rare path.
    fn refund(&self, req: &RequestView<'_>, taken: &[(usize, Taken)], now: Nanos) {
        let mut key = KeyBuf::new();
        for (i, t) in taken {
            let rule = &self.rules[*i];
            if rule.key_of(req, &mut key) != Extract::Found {
                continue;
            }
            match (&*rule.kind, t) {
                (
                    Kind::Rate {
                        quota,
                        store,
                        overflow,
                    },
                    Taken::Rate(slot, cost),
                ) => {
                    store.refund(&key, *slot, quota, now, *cost, overflow);
                }
                (
                    Kind::Global {
                        fallback: Some(fallback),
                        ..
                    },
                    Taken::Global(_, Some(slot)),
                ) => fallback.refund(&key, *slot, now, 1),
                (
                    Kind::Redis {
                        fallback: Some(fallback),
                        ..
                    },
                    Taken::Redis(Some((slot, cost))),
                ) => fallback.refund(&key, *slot, now, *cost),
                _ => {}
            }
        }
    }

    /// Takes the counts of every global rule since the last call (each counter is read and
    /// zeroed once), reporting the `top_k` heaviest keys per rule one by one.
    pub fn drain_global(&self, top_k: usize) -> Vec<GlobalCounts> {
        let mut out = Vec::new();
        for rule in &self.rules {
            let Kind::Global { limit, store, .. } = &*rule.kind else {
                continue;
            };
            let take = |c: &GlobalCounters| {
                (
                    c.offered.swap(0, Ordering::Relaxed),
                    c.admitted.swap(0, Ordering::Relaxed),
                )
            };
            let mut keys: Vec<(String, u64, u64)> = store
                .map
                .iter()
                .filter_map(|e| {
                    let (o, a) = take(e.value());
                    (o > 0).then(|| (String::from_utf8_lossy(e.key()).into_owned(), o, a))
                })
                .collect();
            keys.sort_unstable_by_key(|k| std::cmp::Reverse(k.1));
            let (o, a) = take(&store.overflow);
            let mut other = (o, a, u64::from(o > 0));
            for (_, o, a) in keys.drain(top_k.min(keys.len())..) {
                other = (other.0 + o, other.1 + a, other.2 + 1);
            }
            out.push(GlobalCounts {
                rule: rule.name.to_string(),
                limit: *limit,
                keys,
                other,
            });
        }
        out
    }

    /// Forgets idle keys in every rule; returns how many.
    pub fn sweep(&self, now: Nanos) -> usize {
        self.rules
            .iter()
            .map(|r| match &*r.kind {
                Kind::Rate { quota, store, .. } => store.sweep(quota, now),
                Kind::Concurrency { store, .. } => store.sweep(concurrency_idle),
                Kind::Adaptive { .. } => 0,
                Kind::Redis {
                    refused, fallback, ..
                } => {
                    refused.sweep(|r| r.expired(now))
                        + fallback.as_ref().map_or(0, |f| f.sweep(now))
                }
                Kind::Global {
                    store, fallback, ..
                } => store.sweep(global_idle) + fallback.as_ref().map_or(0, |f| f.sweep(now)),
            })
            .sum()
    }

    /// A leaky-bucket rule's bound on its queue's wait (tests).
    #[cfg(test)]
    pub(crate) fn max_wait_of(&self, name: &str) -> Option<Nanos> {
        self.rules
            .iter()
            .find(|r| &*r.name == name)
            .map(|r| r.max_wait)
    }

    /// Keys tracked by the rule called `name`.
    pub fn tracked_keys(&self, name: &str) -> Option<usize> {
        self.rules
            .iter()
            .find(|r| &*r.name == name)
            .map(|r| match &*r.kind {
                Kind::Rate { store, .. } => store.len(),
                Kind::Concurrency { store, .. } => store.len.load(Ordering::Relaxed),
                Kind::Global { store, .. } => store.len.load(Ordering::Relaxed),
                Kind::Redis { refused, .. } => refused.len.load(Ordering::Relaxed),
                Kind::Adaptive { .. } => 0,
            })
    }
}

/// A store's bound and metric handles, labelled `label` (the rule, or a part of it).
fn store_parts(r: &Rule, metrics: &Metrics, label: &str) -> StoreParts {
    StoreParts {
        max_keys: r.max_keys.get() as usize,
        keys: metrics.keys.with_label_values(&[label]),
        evicted_idle: metrics.evicted.with_label_values(&[label, "idle"]),
        overflowed: metrics.overflow.with_label_values(&[label]),
    }
}

/// A rule's `fallback:` limit, if it has one.
fn fallback_store(r: &Rule, metrics: &Metrics, label: &str) -> Option<Fallback> {
    match &r.fallback {
        Some(Limit::Rate {
            quota, algorithm, ..
        }) => {
            let label = format!("{label}.fallback");
            Some(Fallback {
                quota: *quota,
                store: RateStore::new(*algorithm, store_parts(r, metrics, &label)),
                overflow: Overflow {
                    sketch: std::sync::OnceLock::new(),
                    size: r.sketch,
                    refused: metrics.sketch_refused.with_label_values(&[&label]),
                },
            })
        }
        _ => None,
    }
}

/// `"name";q=<burst>;w=<seconds>` for a rate limit: the window of the window algorithms, the
/// refill time of the buckets.
fn rate_policy(name: &str, algorithm: Algorithm, quota: &Quota) -> String {
    let window = match algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket => quota.refill_time(),
        _ => quota.window(),
    };
    format!(
        "\"{name}\";q={};w={}",
        quota.burst(),
        ceil_secs(window).max(1)
    )
}

/// `RateLimit-Policy` of a rule: `"name";q=<quota>;w=<window seconds>`.
fn policy_of(r: &Rule, name: &str) -> String {
    match &r.limit {
        Limit::Rate { rate, quota, .. } if r.scope == Scope::Global => format!(
            "\"{name}\";q={};w={}",
            rate.count,
            ceil_secs(quota.period()).max(1)
        ),
        Limit::Rate {
            algorithm, quota, ..
        } => rate_policy(name, *algorithm, quota),
        Limit::Concurrency(n) => format!("\"{name}\";q={n}"),
        Limit::Adaptive(spec) => format!("\"{name}\";q={}", spec.max),
    }
}

/// A rule's empty per-key state and its limiter.
fn compile_kind(r: &Rule, metrics: &Metrics, label: &str) -> Kind {
    let parts = store_parts(r, metrics, label);
    match &r.limit {
        Limit::Rate { rate, .. } if r.scope == Scope::Global => Kind::Global {
            limit: crate::control::Limit {
                count: u64::from(rate.count.get()),
                period_ms: (rate.period.as_millis() as u64).max(1),
            },
            store: Store::new(parts),
            fallback: fallback_store(r, metrics, label),
        },
        Limit::Rate {
            algorithm, quota, ..
        } if r.scope == Scope::Redis => Kind::Redis {
            algorithm: *algorithm,
            quota: *quota,
            refused: Store::new(store_parts(r, metrics, &format!("{label}.refused"))),
            cache_answers: metrics.redis.cache_answers.with_label_values(&[label]),
            fallback: fallback_store(r, metrics, label),
        },
        Limit::Rate {
            algorithm, quota, ..
        } => Kind::Rate {
            quota: *quota,
            store: RateStore::new(*algorithm, parts),
            overflow: Overflow {
                sketch: std::sync::OnceLock::new(),
                size: r.sketch,
                refused: metrics.sketch_refused.with_label_values(&[label]),
            },
        },
        Limit::Concurrency(n) => Kind::Concurrency {
            max: n.get(),
            store: Store::new(parts),
        },
        Limit::Adaptive(spec) => {
            let limit = metrics.adaptive_limit.with_label_values(&[label]);
            let baseline = metrics.adaptive_baseline.with_label_values(&[label]);
            let sample = metrics.adaptive_latency.with_label_values(&[label]);
            let settings = spec.settings();
            limit.set(i64::from(
                settings.initial.clamp(settings.min, settings.max),
            ));
            Kind::Adaptive {
                limiter: Arc::new(Adaptive::with_observer(settings, move |s| {
                    limit.set(i64::from(s.limit));
                    baseline.set(s.baseline as f64 / 1e9);
                    sample.set(s.sample as f64 / 1e9);
                })),
            }
        }
    }
}

/// The decision of a concurrency limit (fixed or adaptive) of `limit` slots for rule `i`:
/// a granted slot goes into `admit`, held until the response body ends.
fn slot(
    permit: Option<Permit>,
    limit: u32,
    i: usize,
    admit: &mut Admit,
    taken: &mut SmallVec<[(usize, Taken); 4]>,
) -> Decision {
    match permit {
        Some(p) => {
            let remaining = limit.saturating_sub(p.in_flight());
            admit.permits.push(p);
            taken.push((i, Taken::Concurrency));
            Decision::Allow {
                remaining,
                reset_after: 0,
                wait: 0,
            }
        }
        None => Decision::Deny {
            retry_after: Some(CONCURRENCY_RETRY),
        },
    }
}

/// What a rule's per-key state depends on: while these are equal, the state stays valid.
fn identity(r: &Rule) -> String {
    format!(
        "{:?}|{:?}|{:?}|{:?}|{:?}|{}",
        r.name, r.key, r.limit, r.scope, r.fallback, r.max_keys
    )
}

fn compile(r: &Rule, metrics: &Metrics, identity: String, kept: Option<Arc<Kind>>) -> CompiledRule {
    let name: Arc<str> = Arc::from(r.name.0.as_str());
    let label = &*name;
    let policy = HeaderValue::from_str(&policy_of(r, &name))
        .expect("rule names are header-safe by validation");
    // A kept rule's state is the previous set's; its policy follows from the same limit.
    let kind = kept.unwrap_or_else(|| Arc::new(compile_kind(r, metrics, label)));
    let delay = (r.on_limit == OnLimit::Delay).then(|| Delay {
        max_delay: r
            .max_delay
            .map_or(0, |d| Nanos::try_from(d.0.as_nanos()).unwrap_or(Nanos::MAX)),
        queue: Arc::new(DelayQueue {
            waiting: AtomicU32::new(0),
            max: r.max_queue.get(),
            gauge: metrics.delay_queue.with_label_values(&[label]),
            delayed: metrics.delayed.with_label_values(&[label]),
        }),
    });
    CompiledRule {
        matcher: Matcher::from(&r.matcher),
        key: r.key.0.clone(),
        mode: r.mode,
        cost: r.cost.clone(),
        kind,
        identity,
        delay,
        max_wait: match &r.limit {
            Limit::Rate {
                algorithm: Algorithm::LeakyBucket,
                ..
            } => r.max_delay.map_or(Nanos::MAX, |d| {
                Nanos::try_from(d.0.as_nanos()).unwrap_or(Nanos::MAX)
            }),
            _ => Nanos::MAX,
        },
        // Cloned here, the value's bytes become shared now rather than on the rule's first
        // refusal (`state` clones it per request).
        answers: Arc::new(Answers::new(name.clone(), policy.clone())),
        policy,
        allowed: metrics.requests.with_label_values(&[label, "allowed"]),
        rejected: metrics.requests.with_label_values(&[label, "rejected"]),
        shadow_rejected: metrics
            .requests
            .with_label_values(&[label, "shadow_rejected"]),
        logged: LogBudget::default(),
        name,
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

    /// Writes the rule's key for `req` into `key`, bounded: a global or redis rule's in its
    /// fleet-wide text form, a local rule's as bytes (hashed past 64).
    #[inline]
    fn key_of(&self, req: &RequestView<'_>, key: &mut KeyBuf) -> Extract {
        if matches!(*self.kind, Kind::Global { .. } | Kind::Redis { .. }) {
            let found = extract_text(&self.key, req, key);
            if found == Extract::Found {
                canonical_text(key);
            }
            found
        } else {
            let found = extract(&self.key, req, key);
            if found == Extract::Found {
                bound_local(key);
            }
            found
        }
    }

    /// The 400 for a request that sends a keyed field more than once.
    #[cold]
    fn repeated_key(&self, req: &RequestView<'_>) -> BadRequest {
        let part = self
            .key
            .iter()
            .find(|p| {
                let mut k = KeyBuf::new();
                extract(std::slice::from_ref(*p), req, &mut k) == Extract::Repeated
            })
            .map_or_else(|| "a key part".to_string(), ToString::to_string);
        BadRequest {
            rule: self.name.clone(),
            reason: "repeated_key",
            detail: format!(
                "rule {} keys requests by {part}, which this request sends more than once",
                self.name
            ),
        }
    }

    /// The request's cost under this rule, at least 1. A cost header is read only from a
    /// trusted proxy (unless the rule says `from: any`); one it reads must be a whole number
    /// of at least 1, sent once.
    #[inline]
    fn cost_of(&self, req: &RequestView<'_>) -> Result<u32, BadRequest> {
        match &self.cost {
            Cost::Fixed(n) => Ok(*n),
            Cost::Header {
                header,
                default,
                max,
                from,
            } => {
                if *from == CostFrom::Trusted && !req.trusted_peer {
                    return Ok(*default);
                }
                let mut values = req.headers.get_all(header).iter();
                match (values.next(), values.next()) {
                    (None, _) => Ok(*default),
                    (Some(v), None) => match parse_cost(v.as_bytes()) {
                        Some(n) => Ok(n.min(*max)),
                        None => Err(self.bad_cost(header)),
                    },
                    (Some(_), Some(_)) => Err(self.bad_cost(header)),
                }
            }
        }
    }

    #[cold]
    fn bad_cost(&self, header: &http::HeaderName) -> BadRequest {
        BadRequest {
            rule: self.name.clone(),
            reason: "cost",
            detail: format!(
                "rule {} reads the cost from {header}, which must be sent once, as a whole number of at least 1",
                self.name
            ),
        }
    }
}

/// A whole number of at least 1; values past `u32::MAX` saturate (they are capped at `max`).
fn parse_cost(bytes: &[u8]) -> Option<u32> {
    let bytes = bytes.trim_ascii();
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = bytes.iter().fold(0u32, |n, d| {
        n.saturating_mul(10).saturating_add(u32::from(d - b'0'))
    });
    (n >= 1).then_some(n)
}

/// A concurrency state nobody holds a slot of (nor a reference to) is as good as new.
fn concurrency_idle(c: &Arc<Concurrency>) -> bool {
    c.in_flight() == 0 && Arc::strong_count(c) == 1
}

/// Global counters with nothing to report (and no decision holding them) are as good as new.
fn global_idle(c: &Arc<GlobalCounters>) -> bool {
    c.offered.load(Ordering::Relaxed) == 0 && Arc::strong_count(c) == 1
}

/// A compiled `match:` block; an absent condition always holds.
struct Matcher {
    path: Option<String>,
    /// `path` in its match form (see [`RequestView::path`]).
    path_lenient: Option<String>,
    path_prefix: Option<String>,
    path_regex: Option<regex::Regex>,
    /// The same, matching without case.
    path_regex_lenient: Option<regex::Regex>,
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
            path_lenient: m
                .path
                .as_deref()
                .map(|p| crate::target::match_form(p).into_owned()),
            path_prefix: m.path_prefix.clone(),
            path_regex: m.path_regex.as_ref().map(|r| r.0.clone()),
            path_regex_lenient: m.path_regex.as_ref().map(|r| {
                regex::RegexBuilder::new(r.0.as_str())
                    .case_insensitive(true)
                    .build()
                    .unwrap_or_else(|_| r.0.clone())
            }),
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
        let strict = req.strict_path;
        if self.path.is_some() || self.path_prefix.is_some() || self.path_regex.is_some() {
            let path = req.path();
            if strict {
                if self.path.as_ref().is_some_and(|p| path != p)
                    || self
                        .path_prefix
                        .as_ref()
                        .is_some_and(|p| !path.starts_with(p.as_str()))
                    || self
                        .path_regex
                        .as_ref()
                        .is_some_and(|re| !re.is_match(path))
                {
                    return false;
                }
            } else if self
                .path_lenient
                .as_ref()
                .is_some_and(|p| !(path == p || path.eq_ignore_ascii_case(p)))
                || self.path_prefix.as_ref().is_some_and(|p| {
                    // As written first: the common case, and a plain compare.
                    !(path.starts_with(p.as_str())
                        || (path.len() >= p.len()
                            && path.as_bytes()[..p.len()].eq_ignore_ascii_case(p.as_bytes())))
                })
                || self
                    .path_regex_lenient
                    .as_ref()
                    .is_some_and(|re| !re.is_match(path))
            {
                return false;
            }
        }
        // HEAD runs the GET handler in most frameworks: a rule on GET counts it too.
        let method_ok = self.methods.is_empty()
            || self.methods.contains(req.method)
            || (req.method == http::Method::HEAD && self.methods.contains(&http::Method::GET));
        if !method_ok {
            return false;
        }
        if let Some(h) = &self.host {
            if !host_matches(&h.0, req.host()) {
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
        true
    }
}

/// `pattern` is lower case: `api.example.com` or `*.example.com` (subdomains only). A request
/// without a host (HTTP/1.0) reaches the one app all the same: every host rule applies to it.
fn host_matches(pattern: &str, host: Option<&str>) -> bool {
    let Some(host) = host else { return true };
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
