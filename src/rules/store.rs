//! Per-key state of a rule, bounded: one store per algorithm ([`RateStore`]), each a sharded
//! map of at most `max_keys` states, with the rule's count-min sketch (rate limits) or one shared
//! overflow state for the keys that find no place; and a rule's fallback limit.
//!
//! Must never: allocate for a key it already tracks, hold a shard's lock beyond the call, or
//! grow past `max_keys`.

use super::*;

/// The count-min sketch of a rate rule's untracked keys, made when the store first fills.
pub(super) struct Overflow {
    /// The rule's own limit: the sketch's windows are the rule's, whatever a key's own limit
    /// (`overrides:`) says, so that one key's window never rolls every key's counts.
    pub(super) quota: Quota,
    pub(super) sketch: std::sync::OnceLock<Sketch>,
    pub(super) size: SketchSize,
    /// Refusals the sketch made (conservative: its estimates only over-count).
    pub(super) refused: IntCounter,
}

impl Overflow {
    /// The sketch's decision for a key its store had no place for, its refusals counted: by
    /// the rule's limit (a key with its own is decided by it only once it has a place).
    pub(super) fn check(&self, key: &[u8], now: Nanos, cost: u32) -> Decision {
        let decision = self.sketch().check(key, &self.quota, now, cost);
        if !decision.is_allowed() {
            self.refused.inc();
        }
        decision
    }

    pub(super) fn sketch(&self) -> &Sketch {
        self.sketch.get_or_init(|| {
            Sketch::new(
                self.size.width.get() as usize,
                self.size.depth.get() as usize,
            )
        })
    }
}

/// Which keys a redis rule sent to Redis lately, and how many new ones it may still send: a
/// client rotating keys creates at most `new_keys` a second (and as many at once) in Redis
/// from this proxy; the rest get 429 here. Keys are remembered exactly, in a store of the
/// rule's `max_keys`, for two of the rule's windows after their last request (about as long as
/// their Redis state lives); a key is remembered only once it was let through, so asking again
/// gains a refused one nothing. Past `max_keys` remembered keys, a key that finds no place pays
/// for each request it sends.
pub(super) struct Admission {
    pub(super) seen: Store<Seen>,
    /// How long a key stays known after its last request: two of the rule's windows.
    pub(super) memory: Nanos,
    pub(super) budget: Gcra,
    /// `new_keys` a second, as many at once.
    pub(super) quota: Quota,
    pub(super) refused: IntCounter,
}

/// When a key was last sent to Redis (clock nanoseconds).
#[derive(Debug, Default)]
pub(super) struct Seen(AtomicU64);

impl Seen {
    /// Sent within `memory` of `now`.
    fn fresh(&self, now: Nanos, memory: Nanos) -> bool {
        now.saturating_sub(self.0.load(Ordering::Relaxed)) <= memory
    }
}

impl Admission {
    /// `None`: `key` may go to Redis; else, when a new key may (a new key past the budget).
    pub(super) fn admit(&self, key: &[u8], now: Nanos) -> Option<Nanos> {
        let fresh = |s: &Seen| s.fresh(now, self.memory);
        if let Some(s) = self.seen.map.get(key) {
            if fresh(&s) {
                s.0.store(now, Ordering::Relaxed);
                return None;
            }
        }
        if let (Decision::Deny { retry_after }, _) = self.budget.take(&self.quota, now, 1) {
            self.refused.inc();
            return Some(retry_after.unwrap_or(self.quota.emission()));
        }
        if let Some(s) = self.seen.tracked(key, now, |s| !fresh(s)) {
            s.0.store(now, Ordering::Relaxed);
        }
        None
    }

    /// Forgets keys not asked for in two windows.
    pub(super) fn sweep(&self, now: Nanos) -> usize {
        self.seen.sweep(|s| !s.fresh(now, self.memory))
    }
}

/// A global or redis rule's `fallback:` limit: a local rate limit of its own algorithm.
pub(super) struct Fallback {
    pub(super) quota: Quota,
    pub(super) store: RateStore,
    pub(super) overflow: Overflow,
}

impl Fallback {
    pub(super) fn check(&self, key: &[u8], now: Nanos, cost: u32) -> (Decision, Slot) {
        self.store
            .check(key, &self.quota, now, cost, &self.overflow)
    }

    pub(super) fn refund(&self, key: &[u8], slot: Slot, now: Nanos, cost: u32) {
        self.store
            .refund(key, slot, &self.quota, now, cost, &self.overflow)
    }

    /// [`Self::check`], or with `dry` its [`RateStore::peek`] (taking nothing).
    #[inline]
    pub(super) fn decide(&self, key: &[u8], now: Nanos, cost: u32, dry: bool) -> (Decision, Slot) {
        if dry {
            (self.store.peek(key, &self.quota, now, cost).0, Slot::Keyed)
        } else {
            self.check(key, now, cost)
        }
    }

    pub(super) fn sweep(&self, now: Nanos) -> usize {
        self.store.sweep(&self.quota, now)
    }
}

/// One store per algorithm, so that each key costs only its own algorithm's state.
pub(super) enum RateStore {
    /// A token bucket or GCRA (the same limit) whose cost is the response's: each state is
    /// shared with the charges of its calls in flight, so that a charge reaches it without a
    /// lookup and it is never forgotten while one is.
    Owed(Store<Arc<Gcra>>),
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
            RateStore::Owed($s) => $body,
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
    /// The store of a token bucket or GCRA whose cost is the response's.
    pub(super) fn owed(parts: StoreParts) -> Self {
        RateStore::Owed(Store::new(parts))
    }

    pub(super) fn new(algorithm: Algorithm, parts: StoreParts) -> Self {
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
    pub(super) fn check(
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
            None => (overflow.check(key, now, cost), Slot::Sketch),
        }
    }

    pub(super) fn refund(
        &self,
        key: &[u8],
        slot: Slot,
        quota: &Quota,
        now: Nanos,
        cost: u32,
        overflow: &Overflow,
    ) {
        if slot == Slot::Sketch {
            overflow.sketch().refund(key, &overflow.quota, now, cost);
            return;
        }
        each_store!(self, s => s.with_slot(key, slot, |st| st.refund(quota, now, cost)))
    }

    /// [`Self::check`] for a rule whose cost is the response's ([`RateStore::Owed`]): on an
    /// admission, also the state its charge settles with.
    pub(super) fn check_owed(
        &self,
        key: &[u8],
        quota: &Quota,
        now: Nanos,
        cost: u32,
        overflow: &Overflow,
    ) -> (Decision, Slot, Option<Owed>) {
        let RateStore::Owed(s) = self else {
            let (decision, slot) = self.check(key, quota, now, cost, overflow);
            debug_assert!(false, "a response cost's rule has an owed store");
            return (decision, slot, None);
        };
        let tracked = s.tracked(key, now, |st| st.is_idle(quota, now)).map(|st| {
            let decision = st.check(quota, now, cost);
            (
                decision,
                decision.is_allowed().then(|| Owed::Keyed(st.clone())),
            )
        });
        match tracked {
            Some((decision, owed)) => (decision, Slot::Keyed, owed),
            None => {
                let decision = overflow.check(key, now, cost);
                // A key with no place: its charge finds it in the sketch by name.
                let owed = decision
                    .is_allowed()
                    .then(|| Owed::Sketch(Box::new(key.into())));
                (decision, Slot::Sketch, owed)
            }
        }
    }

    pub(super) fn sweep(&self, quota: &Quota, now: Nanos) -> usize {
        each_store!(self, s => s.sweep(|st| st.is_idle(quota, now)))
    }

    /// The decision [`Self::check`] would make for `key` at `now`, taking nothing, and
    /// whether the store tracks the key (else as a fresh state would decide: the sketch of
    /// a full store is not asked). Off the request path (`explain`).
    pub(super) fn peek(
        &self,
        key: &[u8],
        quota: &Quota,
        now: Nanos,
        cost: u32,
    ) -> (Decision, bool) {
        each_store!(self, s => match s.peek_state(key, |st| st.peek(quota, now, cost)) {
            Some(decision) => (decision, true),
            None => (fresh_like(&s.overflow, quota, now, cost), false),
        })
    }

    pub(super) fn len(&self) -> usize {
        each_store!(self, s => s.len.load(Ordering::Relaxed))
    }

    /// Whether the store holds `max_keys` keys (a new key then goes to the sketch).
    pub(super) fn is_full(&self) -> bool {
        each_store!(self, s => s.len.load(Ordering::Relaxed) >= s.max_keys)
    }

    /// The algorithm's name, as the configuration writes it.
    pub(super) fn algorithm_name(&self) -> &'static str {
        match self {
            RateStore::Owed(_) => "gcra (charged after the response)",
            RateStore::TokenBucket(_) => "token_bucket",
            RateStore::Gcra(_) => "gcra",
            RateStore::LeakyBucket(_) => "leaky_bucket",
            RateStore::FixedWindow(_) => "fixed_window",
            RateStore::SlidingWindowLog(_) => "sliding_window_log",
            RateStore::SlidingWindowCounter(_) => "sliding_window_counter",
        }
    }

    /// `f` of each tracked key and what a request of one unit would get now ([`Self::peek`]),
    /// one key's state at a time ([`Store::each_key`]).
    pub(super) fn each<T>(
        &self,
        quota: &Quota,
        now: Nanos,
        mut f: impl FnMut(&[u8], Decision) -> T,
    ) -> Vec<T> {
        each_store!(self, s => s.each_key(|k, st| Some(f(k, st.peek(quota, now, 1)))))
    }
}

/// What a fresh state of `like`'s type decides.
fn fresh_like<S: Default + Limiter>(_like: &S, quota: &Quota, now: Nanos, cost: u32) -> Decision {
    S::default().check(quota, now, cost)
}

/// The state a charge after the response settles with: the key's own, or (a key its store
/// had no place for) the rule's sketch, by the key.
pub(super) enum Owed {
    Keyed(Arc<Gcra>),
    /// Boxed twice: one pointer, so that a charge stays small in every request's admission.
    Sketch(Box<Box<[u8]>>),
    /// A `scope: redis` rule's key, charged by the store.
    Remote(Box<RemoteKey>),
    /// A `scope: global` rule's key: whether its share decided the request, and the
    /// nanoseconds a unit its guard took (see [`GlobalCounters::settle`]).
    Global(Arc<GlobalCounters>, bool, f32),
}

/// A key of a `scope: redis` rule and the store that holds its state.
pub(super) type RemoteKey = (Arc<dyn RemoteStore>, Box<[u8]>);

impl Limiter for Arc<Gcra> {
    #[inline]
    fn check(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        (**self).check(quota, now, cost)
    }
    fn refund(&self, quota: &Quota, now: Nanos, cost: u32) {
        (**self).refund(quota, now, cost)
    }
    fn peek(&self, quota: &Quota, now: Nanos, cost: u32) -> Decision {
        (**self).peek(quota, now, cost)
    }
    /// Not while a call in flight holds it: its charge is still to come.
    #[inline]
    fn is_idle(&self, quota: &Quota, now: Nanos) -> bool {
        Arc::strong_count(self) == 1 && (**self).is_idle(quota, now)
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

pub(super) struct StoreParts {
    pub(super) max_keys: usize,
    pub(super) keys: IntGauge,
    pub(super) evicted_idle: IntCounter,
    pub(super) overflowed: IntCounter,
}

/// A key as stored: inline up to 24 bytes (an IPv6 address with its framing fits), so that a
/// lookup does not chase a pointer to a separate allocation; longer keys spill to the heap.
pub(super) type StoredKey = SmallVec<[u8; 24]>;

/// One state per key, bounded by `max_keys`.
pub(super) struct Store<S> {
    // DashMap shards its table behind per-shard RwLocks: a lookup of a known key takes one
    // shard's read lock for the length of a CAS, never a global lock. foldhash's quality
    // variant, seeded per store, is much cheaper than SipHash on short keys, and the random
    // seed keeps clients from choosing colliding keys blind.
    pub(super) map: DashMap<StoredKey, S, foldhash::quality::RandomState>,
    // Counted apart because DashMap::len visits every shard. Relaxed: only a bound.
    pub(super) len: AtomicUsize,
    pub(super) max_keys: usize,
    /// Shared by every key that finds no place while the store is full (rate rules use their
    /// sketch instead): conservative, since all of them drain one state.
    pub(super) overflow: S,
    pub(super) parts: StoreParts,
    // When the store last looked for idle states to replace (clock nanoseconds), and how long
    // until it looks again: doubled, up to the background sweep's period, while a look frees
    // nothing. Relaxed + CAS: they only pick which caller sweeps, at most one per interval.
    pub(super) reclaimed_at: AtomicU64,
    pub(super) reclaim_every: AtomicU64,
}

/// The keys of a store `top` reads at most a call.
pub(super) const TOP_SCAN: usize = 10_000;

/// A full store looks for states to replace at most this often (a sweep visits every key)...
pub(super) const RECLAIM_EVERY: Nanos = NANOS_PER_SEC / 10;
/// ...and, while its looks free nothing, backs off to this.
pub(super) const RECLAIM_AT_MOST: Nanos = 5 * NANOS_PER_SEC;

impl<S: Default + Send + Sync + 'static> Store<S> {
    pub(super) fn new(parts: StoreParts) -> Self {
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
    pub(super) fn with<R>(
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
    pub(super) fn tracked(
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
    pub(super) fn reclaim(&self, now: Nanos, idle: impl Fn(&S) -> bool) -> usize {
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

    /// `f` of `key`'s state, if the store tracks it; nothing is created. Off the request path
    /// (`explain`): looked up by a key of the stored type, so that the request path's lookup
    /// by borrowed bytes keeps the one caller it is inlined into.
    #[cold]
    pub(super) fn peek_state<R>(&self, key: &[u8], f: impl FnOnce(&S) -> R) -> Option<R> {
        self.map
            .get(&StoredKey::from_slice(key))
            .map(|s| f(s.value()))
    }

    /// `f` of each tracked key and its state, for `top`: the keys are copied first (a shard's
    /// read lock held while its keys are), then each state is read under its own lookup, so
    /// that no lock is held across more than one key's state.
    #[cold]
    pub(super) fn each_key<T>(&self, mut f: impl FnMut(&[u8], &S) -> Option<T>) -> Vec<T> {
        // Past this many a call reads the first the map walks: `/ui` asks every second.
        let keys: Vec<StoredKey> = self
            .map
            .iter()
            .take(TOP_SCAN)
            .map(|e| e.key().clone())
            .collect();
        keys.iter()
            .filter_map(|k| self.peek_state(k, |s| f(k, s)).flatten())
            .collect()
    }

    /// Runs `f` on the state a decision used, if it still exists.
    pub(super) fn with_slot(&self, key: &[u8], slot: Slot, f: impl FnOnce(&S)) {
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
    pub(super) fn sweep(&self, idle: impl Fn(&S) -> bool) -> usize {
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
