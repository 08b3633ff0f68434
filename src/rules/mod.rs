//! The compiled rule set and the in-path decision.
//!
//! Owns: turning config rules into matchers, per-key stores and pre-resolved metric handles,
//! built together so that one `ArcSwap` store swaps them together; and [`RuleSet::check`], the
//! synchronous decision for one request: a loop over the rules, each kind's turn a method of
//! its own (`turns`). A `scope: redis` rule's question is left open in a
//! [`Remote`]; the caller asks the [`RemoteStore`] and hands the answers back ([`RuleSet::answer`],
//! [`RuleSet::finish`]). A refusal is a value; `respond` renders its 429 into the slots the rule
//! keeps ([`Answers`]). Must never: await, import the data plane, `respond` or Redis, log per
//! request, allocate for a key it already tracks, or hold a store guard beyond the call.
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
    Config, ControlPlane, Cost, CostFrom, HeaderMode, HostPattern, Limit, LogKeys, Match, Mode,
    OnLimit, Rate, Rule, Scope, SketchSize,
};
use crate::key::{
    bound_local, canonical_text, extract, extract_shown, extract_text, shown_stored, Extract,
    KeyBuf, KeyPart, RequestView,
};
use crate::limit::{
    ceil_secs, Adaptive, Algorithm, Concurrency, Decision, FixedWindow, Gcra, LeakyBucket, Limiter,
    Nanos, Permit, Permits, Quota, Sketch, SlidingWindowCounter, SlidingWindowLog, TokenBucket,
    NANOS_PER_SEC,
};
use crate::metrics::Metrics;

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
    /// What private key parts are shown and reported as (`key_secret_file`).
    secret: crate::digest::Secret,
    /// Clients without a part of their own in shared limits (see [`share`]).
    share_exempt: Arc<[crate::key::Cidr]>,
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
    /// This rule's 429s, built once per retry hint, with its name and its
    /// `"name";q=<burst>;w=<window seconds>` policy, built once.
    answers: Arc<Answers>,
    allowed: IntCounter,
    rejected: IntCounter,
    shadow_rejected: IntCounter,
    /// Rejections logged in the current second.
    logged: LogBudget,
    /// Its keys refused lately, for `top`.
    refused_keys: refused::RefusedKeys,
    /// The rule's `upstream_body_idle`.
    body_idle: Option<std::time::Duration>,
    /// Its key has a private part, shown and reported as a digest (`log_keys: digest`).
    digested: bool,
    /// A cost that is the response's: what its charges need.
    charge: Option<Arc<ChargeRule>>,
    /// Keys with a limit of their own; `None` (most rules): no lookup at all.
    overrides: Option<Arc<overrides::Overrides>>,
    /// It has overrides or rules that stand in for it: the one flag a decision reads for both.
    extras: bool,
    /// Rules that stand in for this one: it does not apply to a request one of them applies
    /// to (empty for most).
    replaced_by: Box<[usize]>,
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
        /// `release: head`: the slot is given back at the response head.
        at_head: bool,
        /// With `key: []`: one client's part of the slots.
        share: Option<Share>,
    },
    /// In flight at once for the whole rule, a limit that follows the upstream's latency.
    Adaptive {
        limiter: Arc<Adaptive>,
        share: Option<Share>,
    },
    /// Decided by a script in Redis, after the local rules; see [`RuleSet::answer`].
    Redis {
        algorithm: Algorithm,
        quota: Quota,
        /// Keys Redis refused, until when: answered here without a round trip.
        refused: Store<RedisRefused>,
        cache_answers: IntCounter,
        /// Keys not seen lately, bounded before they reach Redis.
        admission: Admission,
        /// The local limit of `on_error: fallback`.
        fallback: Option<Fallback>,
    },
    /// Enforced by the control plane's drop ratio; counted here for the reports.
    Global {
        rate: Rate,
        store: Store<Arc<GlobalCounters>>,
        /// Which keys shared the store's overflow counters since the last report.
        overflow_keys: crate::limit::AtomicDistinct,
        /// A local limit for while the control plane is stale.
        fallback: Option<Fallback>,
        /// When the last report took its counts, on the limiter clock (0: unknown).
        drained: AtomicU64,
    },
}

/// A key Redis refused: requests of at least `cost` are refused until `until` (local clock).
#[derive(Debug, Default)]
pub struct RedisRefused {
    // Relaxed: a hint; a torn pair at worst asks Redis once more.
    until: AtomicU64,
    cost: AtomicU32,
}

impl RedisRefused {
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
    /// The key's counters, and what the decision took from them.
    Global(Arc<GlobalCounters>, GlobalTaken),
    /// Admitted by Redis (nothing to give back there), or by the local fallback limit (its
    /// slot and the units it took).
    Redis(Option<(Slot, u32)>),
}

/// What a global rule's decision took, to be given back if a later rule refuses.
#[derive(Debug, Default)]
pub struct GlobalTaken {
    /// The fallback's slot, if it decided (stale ratios, or a key not yet assigned).
    slot: Option<Slot>,
    units: u32,
    /// The key's share decided.
    shared: bool,
    /// What the provisional limit took.
    guard: Nanos,
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
    /// Local rules admit it; `scope: redis` rules still must: ask the store each
    /// [`Remote::question`] and hand the answers to [`RuleSet::answer`], then [`RuleSet::finish`].
    /// Boxed: it is the rare, network-bound case, and it would triple the size of every
    /// verdict returned on the hot path.
    Remote(Box<Remote>),
}

/// Why a rule cannot decide a request: answered 400, naming the rule.
#[derive(Debug, Clone)]
pub struct BadRequest {
    pub rule: Arc<str>,
    /// The `spillway_bad_requests_total` reason.
    pub reason: crate::metrics::Reason,
    pub detail: String,
}

/// An admitted request.
#[derive(Debug, Default)]
pub struct Admit {
    /// With `headers: always`, the rate-limit state of each rule that applied.
    pub states: SmallVec<[RateState; 2]>,
    /// Concurrency slots, to be held until the response body ends.
    pub permits: Permits,
    /// How long a shaping rule (leaky bucket) wants the request to wait before it goes on.
    pub wait: Nanos,
    /// The longest `upstream_body_idle` of the rules that applied, if any set one.
    pub body_idle: Option<std::time::Duration>,
    /// What the response owes the rules whose cost is the response's, to be armed once the
    /// request is admitted and settled as the response comes.
    pub charges: Charges,
}

/// A rule's state after a decision, for the `RateLimit` headers: the rule (its name and
/// policy, through its answers: one pointer, as every admission carries a few of these) and
/// where its quota stands.
#[derive(Debug, Clone)]
pub struct RateState {
    pub answers: Arc<Answers>,
    pub remaining: u32,
    /// Seconds until the quota is whole again (allowed) or a retry is admitted (denied).
    pub reset_secs: u64,
}

impl RateState {
    pub fn rule(&self) -> &Arc<str> {
        self.answers.rule()
    }

    /// The rule's `RateLimit-Policy` value.
    pub fn policy(&self) -> &HeaderValue {
        self.answers.policy()
    }
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
    /// Gives `scope: redis` rules their store (Redis).
    pub fn with_store(mut self, store: Option<Arc<dyn RemoteStore>>) -> Self {
        self.store = store;
        self
    }

    /// The store that decides `scope: redis` rules, for the caller to ask.
    pub fn store(&self) -> Option<&Arc<dyn RemoteStore>> {
        self.store.as_ref()
    }

    /// Decides one request at `now`. Every matching rule applies (unless a rule that applies
    /// stands in for it, `replaces:`), by the key's own limit where it has one (`overrides:`);
    /// the request is refused if any enforcing rule refuses, and then the units other rules
    /// had granted are given back.
    /// Shadow rules decide and count what they would have refused, and never refuse.
    pub fn check(&self, req: &RequestView<'_>, now: Nanos) -> Verdict {
        let want_states = self.header_mode == HeaderMode::Always;
        let mut admit = Admit::default();
        let mut taken = SmallVec::new();
        let mut granted = Granted {
            admit: &mut admit,
            taken: &mut taken,
        };
        let mut calls: SmallVec<[RedisCall; 1]> = SmallVec::new();
        let mut key = KeyBuf::new();
        let mut ratios = None;
        // The overrides table of the rule deciding now, if it has one.
        let mut table = None;
        for (i, rule) in self.rules.iter().enumerate() {
            if !rule.matcher.matches(req) {
                continue;
            }
            // Rare: one flag for both (overrides, and rules that stand in for this one).
            if rule.extras && self.replaced(rule, req) {
                continue;
            }
            match rule.key_of(req, &mut key) {
                Extract::Found => {
                    if rule.body_idle.is_some() {
                        granted.admit.body_idle = granted.admit.body_idle.max(rule.body_idle);
                    }
                }
                Extract::Missing => continue,
                Extract::Repeated => {
                    self.refund(req, granted.taken, now);
                    return Verdict::BadRequest(rule.repeated_key(req));
                }
            }
            let own = if rule.extras {
                match self.own_of(rule, &key, req, &mut table) {
                    Some(overrides::Own::Unlimited) => continue,
                    own => own,
                }
            } else {
                None
            };
            let cost = match rule.cost_of(req) {
                Ok(cost) => cost,
                Err(bad) => {
                    self.refund(req, granted.taken, now);
                    return Verdict::BadRequest(bad);
                }
            };
            let t = Turn {
                i,
                rule,
                req,
                key: &key,
                cost,
                now,
                dry: false,
                own,
            };
            let decision = match &*rule.kind {
                Kind::Rate {
                    quota,
                    store,
                    overflow,
                } => self.rate_turn(&t, quota, store, overflow, &mut granted),
                Kind::Adaptive { limiter, share } => {
                    self.adaptive_turn(&t, limiter, share.as_ref(), &mut granted)
                }
                Kind::Concurrency {
                    max,
                    store,
                    at_head,
                    share,
                } => {
                    self.concurrency_turn(&t, (*max, *at_head), store, share.as_ref(), &mut granted)
                }
                Kind::Redis {
                    refused,
                    cache_answers,
                    ..
                } => match self.redis_turn(&t, refused, cache_answers) {
                    Some(decision) => decision,
                    None => {
                        // Decided by Redis once the local rules have all admitted.
                        calls.push(RedisCall {
                            rule: i,
                            key: key.to_vec(),
                            cost,
                            own: match own {
                                Some(overrides::Own::Rate { quota, .. }) => Some(*quota),
                                _ => None,
                            },
                        });
                        continue;
                    }
                },
                Kind::Global {
                    rate,
                    store,
                    overflow_keys,
                    fallback,
                    drained,
                } => {
                    let g = GlobalRule {
                        rate: match own {
                            Some(overrides::Own::Rate { rate, .. }) => rate,
                            _ => rate,
                        },
                        store,
                        overflow_keys,
                        fallback: fallback.as_ref(),
                        drained: drained.load(Ordering::Relaxed),
                    };
                    self.global_turn(&t, g, &mut ratios, &mut granted)
                }
            };
            match decision {
                Decision::Allow {
                    remaining,
                    reset_after,
                    wait,
                } => {
                    granted.admit.wait = granted.admit.wait.max(wait);
                    if want_states {
                        granted.admit.states.push(RateState {
                            answers: t.answers().clone(),
                            remaining,
                            reset_secs: ceil_secs(reset_after),
                        });
                    }
                }
                Decision::Deny { retry_after } => match rule.mode {
                    Mode::Shadow => {
                        rule.shadow_rejected.inc();
                        self.log_rejection(rule, req, "shadow_rejected", now);
                    }
                    Mode::Enforce => {
                        self.log_rejection(rule, req, "rejected", now);
                        rule.refused_keys.record(&key, now);
                        return self.refuse(
                            (rule, t.answers()),
                            req,
                            granted.taken,
                            now,
                            retry_after,
                        );
                    }
                },
            }
        }
        // Every local rule admitted: each key about to go to Redis that it has not seen lately
        // takes a place of its rule's `new_keys` (spent only on what is sent). A shadow rule's
        // refused key is counted and not sent.
        let mut refused_new = None;
        calls.retain(|call| {
            let rule = &self.rules[call.rule];
            let Kind::Redis { admission, .. } = &*rule.kind else {
                return true;
            };
            let Some(retry) = refused_new
                .is_none()
                .then(|| admission.admit(&call.key, now))
                .flatten()
            else {
                return true;
            };
            if rule.mode == Mode::Enforce {
                refused_new = Some((call.rule, retry));
                return true;
            }
            rule.shadow_rejected.inc();
            self.log_rejection(rule, req, "shadow_rejected", now);
            false
        });
        if let Some((i, retry)) = refused_new {
            let rule = &self.rules[i];
            self.log_rejection(rule, req, "rejected", now);
            if let Some(call) = calls.iter().find(|c| c.rule == i) {
                rule.refused_keys.record(&call.key, now);
            }
            return self.refuse((rule, &rule.answers), req, &taken, now, Some(retry));
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
        (rule, answers): (&CompiledRule, &Arc<Answers>),
        req: &RequestView<'_>,
        taken: &[(usize, Taken)],
        now: Nanos,
        retry_after: Option<Nanos>,
    ) -> Verdict {
        self.refund(req, taken, now);
        rule.rejected.inc();
        let reset = retry_after.map_or(0, |n| ceil_secs(n).max(1));
        Verdict::Deny(Denial {
            state: RateState {
                answers: answers.clone(),
                remaining: 0,
                reset_secs: reset,
            },
            retry_after,
            header_mode: self.header_mode,
            delay: rule.delay.clone(),
            capacity: matches!(*rule.kind, Kind::Adaptive { .. }),
            answers: answers.clone(),
        })
    }

    /// Logs a rejection by `rule` of `req`, within the rule's budget of lines a second
    /// (`log_rejections`): the rule, the decision, the key in the form global rules report it
    /// (`sha256:` and a digest past 64 bytes or for bytes that are not UTF-8, as the UI shows
    /// it), the client, method, path and the request's `traceparent`; the units the request
    /// takes under the rule (its cost, or a response cost's reservation) and, for a local rule
    /// whose cost is the response's, the units its key owes past its budget.
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
        let text = self.shown_key(rule, req);
        let traceparent = req
            .headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let units = rule.cost_of(req).ok();
        let owed = rule.owed(req, now);
        tracing::info!(
            target: "spillway::rejection",
            rule = %rule.name,
            decision,
            key = %String::from_utf8_lossy(&text),
            client = %req.client_ip,
            method = %req.method,
            path = %req.uri.path(),
            traceparent,
            units,
            owed,
            request_id = %req.request_id().text(),
            "request refused by a rule"
        );
    }

    /// `rule`'s key for `req` as it is logged and reported: its private parts as digests
    /// (unless `log_keys: clear`), bounded as [`canonical_text`] bounds it.
    fn shown_key(&self, rule: &CompiledRule, req: &RequestView<'_>) -> KeyBuf {
        let mut text = KeyBuf::new();
        if rule.digested {
            extract_shown(&rule.key, req, |v, out| self.secret.push(v, out), &mut text);
        } else {
            extract_text(&rule.key, req, &mut text);
        }
        canonical_text(&mut text);
        text
    }

    /// The secret private key parts are digested under.
    pub fn secret(&self) -> &crate::digest::Secret {
        &self.secret
    }

    /// Uses `secret` for the digests of private key parts (`key_secret_file`).
    pub fn with_secret(mut self, secret: crate::digest::Secret) -> Self {
        self.secret = secret;
        self
    }

    /// Counts an admitted request on every rule that granted it.
    fn commit(&self, taken: &[(usize, Taken)]) {
        for (i, t) in taken {
            self.rules[*i].allowed.inc();
            if let Taken::Global(counters, took) = t {
                counters.admit(took.units);
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
                    // A key with its own limit was decided by it.
                    let table = rule.overrides.as_ref().map(|o| o.load());
                    let quota = match table
                        .as_ref()
                        .and_then(|t| self.own_limit(t, rule, &key, req))
                    {
                        Some(overrides::Own::Rate { quota, .. }) => quota,
                        _ => quota,
                    };
                    store.refund(&key, *slot, quota, now, *cost, overflow);
                }
                (Kind::Global { fallback, .. }, Taken::Global(counters, took)) => {
                    if let (Some(fallback), Some(slot)) = (fallback, took.slot) {
                        fallback.refund(&key, slot, now, took.units);
                    }
                    if took.shared {
                        counters.give_back(took.units);
                    }
                    if took.guard > 0 {
                        counters.unguard(took.guard);
                    }
                }
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

    /// Each global rule's name and limit.
    pub fn global_rules(&self) -> impl Iterator<Item = (&str, crate::config::Rate)> {
        self.rules.iter().filter_map(|rule| match &*rule.kind {
            Kind::Global { rate, .. } => Some((&*rule.name, *rate)),
            _ => None,
        })
    }

    /// Takes the counts of every global rule since the last call (each counter is read and
    /// zeroed once) for the report numbered `seq`, naming keys as [`choose_named`] says
    /// (`secs`: the interval they cover) and folding the rest, with a sketch of which keys
    /// those are; `now` on the limiter clock (0: unknown), which decisions until the next
    /// report count the keys' offered rates from (see [`GlobalCounters::keep_now`]).
    pub fn drain_global(&self, top_k: usize, secs: f64, seq: u64, now: Nanos) -> Vec<GlobalCounts> {
        let ratios = self.ratios.load();
        let mut out = Vec::new();
        for rule in &self.rules {
            let Kind::Global {
                rate,
                store,
                overflow_keys,
                drained,
                ..
            } = &*rule.kind
            else {
                continue;
            };
            // What the last answered report did with a key, and the share the reply keeps it to.
            let share_of = |c: &GlobalCounters, name: &[u8]| {
                let choice = c.choice(ratios.answers);
                let (_, keep) = ratios.ratio_keep(&rule.name, name, || choice != Choice::Named);
                (choice, keep)
            };
            // Keys with a limit of their own: each is held to it, and named past top_k.
            let table = rule.overrides.as_ref().map(|o| o.load());
            let own_of = |stored: &[u8], name: &[u8]| -> Option<Rate> {
                let t = table.as_ref()?;
                // Entries by digest are found by the key's shown form: its reported name,
                // unless the rule reports keys in clear.
                let shown = || {
                    if rule.digested {
                        KeyBuf::from_slice(name)
                    } else {
                        shown_stored(&rule.key, stored, false, |v, out| self.secret.push(v, out))
                            .unwrap_or_default()
                    }
                };
                match t.get(stored, shown)? {
                    overrides::Own::Rate { rate, .. } => Some(*rate),
                    _ => None,
                }
            };
            // What the guard allows a key now: a surge the report finds is held to it.
            let take = |c: &GlobalCounters, name: &[u8], own: Option<Rate>| {
                c.take(secs, seq, || {
                    let (choice, keep) = share_of(c, name);
                    let limit = own.unwrap_or(*rate).per_sec();
                    if keep > 0.0 {
                        let (allowed, surging) =
                            c.allowance(keep, ratios.answers, ratios.own_lag, limit);
                        (allowed, keep, surging)
                    } else if choice == Choice::New {
                        (0.0, 0.0, false)
                    } else if let Some(held) = c.held(0.0, ratios.answers, ratios.own_lag, limit) {
                        (held, 0.0, true)
                    } else {
                        // Under half its limit fleet-wide: this proxy was allowed twice what
                        // it offered at least, and its provisional share.
                        let own = c.allowance(1.0, ratios.answers, ratios.own_lag, limit).0;
                        let provisional = ratios.provisional(&rule.name, limit);
                        ((2.0 * own).max(provisional), 0.0, false)
                    }
                })
            };
            // The trace's lines, written once the map is let go (a slow log must not hold its
            // shards); allocated only while the trace is on.
            let traced = tracing::enabled!(target: FLEET_TRACE, tracing::Level::TRACE);
            let mut traces = Vec::new();
            let keys: Vec<Drained> = store
                .map
                .iter()
                .filter_map(|e| {
                    // A digested key is reported by its digest only: one whose name is not
                    // visible yet waits for the next report, its counts kept.
                    if rule.digested && !e.value().named() {
                        return None;
                    }
                    let name = e.value().reported(e.key());
                    let own = own_of(e.key(), name);
                    let limit = own.unwrap_or(*rate).per_sec();
                    // What the key was allowed until now, for the trace: before `take` moves it.
                    let before = traced.then(|| {
                        let c = e.value();
                        let (choice, keep) = share_of(c, name);
                        let allowed = c.allowance(keep, ratios.answers, ratios.own_lag, limit);
                        (choice == Choice::Named, keep, allowed)
                    });
                    let (o, a, jump) = take(e.value(), name, own);
                    if o == 0 {
                        // Not in this report: the last report it was in still says how the
                        // control plane sees it.
                        return None;
                    }
                    let key = String::from_utf8_lossy(name).into_owned();
                    if let Some(before) = before {
                        traces.push((key.clone(), o, a, jump, before));
                    }
                    Some((key, o, a, jump, e.value().clone(), own))
                })
                .collect();
            let stale = self.staleness.factor(now.saturating_sub(ratios.at)).1 && now > 0;
            for (key, offered, admitted, jump, (named, keep, (allowance, held))) in traces {
                tracing::trace!(
                    target: FLEET_TRACE,
                    rule = %rule.name,
                    key = %key,
                    seq,
                    answers = ratios.answers,
                    lag = ratios.own_lag,
                    offered,
                    admitted,
                    jump,
                    named,
                    stale,
                    keep,
                    allowance,
                    held,
                    "drained"
                );
            }
            // Once every key's counts are taken: set before, a key not taken yet would read
            // its whole interval's count as offered since this report.
            drained.store(now, Ordering::Relaxed);
            let owns: std::collections::HashMap<String, Rate> = keys
                .iter()
                .filter_map(|k| Some((k.0.clone(), k.5?)))
                .collect();
            let (named, tail) =
                choose_named(keys, &ratios, &rule.name, rate.per_sec(), top_k, secs, seq);
            // The keys a full store could not track are always in the tail.
            let (o, a, _) = store.overflow.take(secs, seq, || (0.0, 0.0, false));
            store.overflow.choose(seq, true);
            let mut folded = overflow_keys.take();
            let mut other = (o, a, u64::from(o > 0));
            for (k, o, a, _) in tail {
                folded.insert(k.as_bytes());
                other = (other.0 + o, other.1 + a, other.2 + 1);
            }
            out.push(GlobalCounts {
                rule: rule.name.to_string(),
                rate: *rate,
                owns,
                keys: named,
                other,
                folded,
            });
        }
        out
    }

    /// Closes the adaptive limits' windows that no completion closed in time.
    pub fn tick_adaptive(&self) {
        for rule in self.rules.iter() {
            if let Kind::Adaptive { limiter, .. } = &*rule.kind {
                limiter.tick();
            }
        }
    }

    /// The slot of `req`'s client's part of a shared limit of `limit` slots (`Some(None)`:
    /// no part for it), or `None` when it holds its whole part.
    fn client_part(
        &self,
        share: Option<&Share>,
        req: &RequestView<'_>,
        limit: u32,
        now: Nanos,
    ) -> Option<Option<Arc<Concurrency>>> {
        let Some(share) = share else {
            return Some(None);
        };
        match share.take(req.client_ip, limit, now, &self.share_exempt) {
            Part::Exempt => Some(None),
            Part::Taken(part) => Some(Some(part)),
            Part::Full => None,
        }
    }

    /// Forgets idle keys in every rule; returns how many.
    pub fn sweep(&self, now: Nanos) -> usize {
        self.rules
            .iter()
            .map(|r| match &*r.kind {
                Kind::Rate { quota, store, .. } => store.sweep(quota, now),
                Kind::Concurrency { store, share, .. } => {
                    store.sweep(concurrency_idle) + share.as_ref().map_or(0, Share::sweep)
                }
                Kind::Adaptive { share, .. } => share.as_ref().map_or(0, Share::sweep),
                Kind::Redis {
                    refused,
                    fallback,
                    admission,
                    ..
                } => {
                    refused.sweep(|r| r.expired(now))
                        + admission.sweep(now)
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

mod charge;
mod compile;
mod explain;
mod global;
mod kept;
mod matcher;
mod overrides;
mod refused;
mod remote;
mod share;
mod store;
mod turns;

use charge::ChargeRule;
pub use charge::Charges;
use compile::*;
pub use explain::{Explanation, RefusedKey, RuleExplained, TopKey, TopRule};
pub use global::*;
pub use kept::{Answer, Answers, Render};
use matcher::*;
use remote::*;
pub use remote::{Question, Remote, RemoteStore, StoreAnswer};
use share::*;
use store::*;
use turns::*;

#[cfg(test)]
mod tests;
