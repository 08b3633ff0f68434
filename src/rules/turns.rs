//! Each rule kind's part of [`RuleSet::check`]: one matching rule's decision for a request
//! whose key and cost for it are known, and what that rule granted, recorded for the refund
//! if a later rule refuses. Must never: allocate for a known key, await, or decide for
//! another rule.

use super::*;

/// One matching rule's turn in [`RuleSet::check`]: the rule (`i`th), the request, its key and
/// cost for the rule, and the time.
pub(super) struct Turn<'a, 'r> {
    pub(super) i: usize,
    pub(super) rule: &'a CompiledRule,
    pub(super) req: &'a RequestView<'r>,
    pub(super) key: &'a [u8],
    pub(super) cost: u32,
    pub(super) now: Nanos,
    /// `explain`'s turn: decided on copies, taking nothing (a fallback peeks).
    pub(super) dry: bool,
    /// The key's own limit (`overrides:`), if it has one.
    pub(super) own: Option<&'a overrides::Own>,
}

impl Turn<'_, '_> {
    /// The 429 parts and policy of this turn's key: its own limit's, else the rule's.
    #[inline]
    pub(super) fn answers(&self) -> &Arc<Answers> {
        self.own
            .and_then(overrides::Own::answers)
            .unwrap_or(&self.rule.answers)
    }
}

/// What the rules of one decision granted so far: two locals of [`RuleSet::check`], lent (a
/// struct owning them would be built and then moved into place).
pub(super) struct Granted<'g> {
    pub(super) admit: &'g mut Admit,
    /// Rules that granted units, for the refund if a later one refuses.
    pub(super) taken: &'g mut SmallVec<[(usize, Taken); 4]>,
}

/// A `scope: global` rule's parts.
pub(super) struct GlobalRule<'a> {
    pub(super) rate: &'a Rate,
    pub(super) store: &'a Store<Arc<GlobalCounters>>,
    pub(super) overflow_keys: &'a crate::limit::AtomicDistinct,
    pub(super) fallback: Option<&'a Fallback>,
    /// When the last report took the rule's counts (0: unknown).
    pub(super) drained: Nanos,
}

impl<'a> GlobalRule<'a> {
    /// A `scope: global` rule's parts, from its kind.
    #[inline]
    pub(super) fn of(kind: &'a Kind) -> Option<Self> {
        let Kind::Global {
            rate,
            store,
            overflow_keys,
            fallback,
            drained,
        } = kind
        else {
            return None;
        };
        Some(GlobalRule {
            rate,
            store,
            overflow_keys,
            fallback: fallback.as_ref(),
            drained: drained.load(Ordering::Relaxed),
        })
    }
}

impl RuleSet {
    /// A local rate rule: its store's decision. A leaky bucket's place past `max_delay` is
    /// given back (the next request may fit) and the request refused.
    #[inline]
    pub(super) fn rate_turn(
        &self,
        t: &Turn<'_, '_>,
        quota: &Quota,
        store: &RateStore,
        overflow: &Overflow,
        granted: &mut Granted<'_>,
    ) -> Decision {
        let quota = match t.own {
            Some(overrides::Own::Rate { quota, .. }) => quota,
            _ => quota,
        };
        let (decision, slot) = match &t.rule.charge {
            None => store.check(t.key, quota, t.now, t.cost, overflow),
            Some(charge) => {
                let (decision, slot, owed) =
                    store.check_owed(t.key, quota, t.now, t.cost, overflow);
                if let Some(owed) = owed {
                    granted.admit.charges.push(charge, owed, t.cost, t.now);
                }
                (decision, slot)
            }
        };
        match decision {
            Decision::Allow { wait, .. } if wait > t.rule.max_wait => {
                store.refund(t.key, slot, quota, t.now, t.cost, overflow);
                Decision::Deny {
                    retry_after: Some(wait - t.rule.max_wait),
                }
            }
            Decision::Allow { .. } => {
                granted.taken.push((t.i, Taken::Rate(slot, t.cost)));
                decision
            }
            deny => deny,
        }
    }

    /// An adaptive concurrency limit: a slot, and the client's part of it when the limit is
    /// shared (a slot refused for the client's part is given back unmeasured).
    #[inline]
    pub(super) fn adaptive_turn(
        &self,
        t: &Turn<'_, '_>,
        limiter: &Arc<Adaptive>,
        share: Option<&Share>,
        granted: &mut Granted<'_>,
    ) -> Decision {
        let limit = limiter.limit();
        let permit = limiter.try_acquire().and_then(|p| {
            match self.client_part(share, t.req, limit, t.now) {
                Some(part) => Some(Permit::from(p).with_part(part)),
                None => {
                    p.cancel();
                    None
                }
            }
        });
        slot(permit, limit, t.i, granted.admit, granted.taken)
    }

    /// A fixed concurrency limit: a slot of the key's, and the client's part of it when the
    /// limit is shared.
    #[inline]
    pub(super) fn concurrency_turn(
        &self,
        t: &Turn<'_, '_>,
        (max, at_head): (u32, bool),
        store: &Store<Arc<Concurrency>>,
        share: Option<&Share>,
        granted: &mut Granted<'_>,
    ) -> Decision {
        // A key with its own limit has it in its own state; the shared overflow (a full
        // store) keeps the rule's.
        let (permit, max) = match store.tracked(t.key, t.now, concurrency_idle) {
            Some(c) => {
                let max = match t.own {
                    Some(overrides::Own::Slots { max, .. }) => *max,
                    _ => max,
                };
                (c.try_acquire(max, at_head), max)
            }
            None => (store.overflow.try_acquire(max, at_head), max),
        };
        let permit = permit.and_then(|p| {
            let part = self.client_part(share, t.req, max, t.now)?;
            Some(p.with_part(part))
        });
        slot(permit, max, t.i, granted.admit, granted.taken)
    }

    /// A `scope: redis` rule: the refusal Redis gave this key lately, while it holds for this
    /// cost; `None` when Redis is to be asked (once every local rule admitted).
    #[inline]
    pub(super) fn redis_turn(
        &self,
        t: &Turn<'_, '_>,
        refused: &Store<RedisRefused>,
        cache_answers: &IntCounter,
    ) -> Option<Decision> {
        let retry = refused
            .map
            .get(t.key)
            .and_then(|r| r.refused(t.now, t.cost))?;
        cache_answers.inc();
        Some(Decision::Deny {
            retry_after: Some(retry),
        })
    }

    /// A `scope: global` rule: the key's share of the drop ratio the control plane sent
    /// (`ratios`, loaded once per request however many global rules match), within the guard
    /// that bounds what this proxy admits until the next reply; the fallback while the ratios
    /// are stale. The key's counters count what it was offered either way.
    #[inline]
    pub(super) fn global_turn(
        &self,
        t: &Turn<'_, '_>,
        g: GlobalRule<'_>,
        ratios: &mut Option<arc_swap::Guard<Arc<DropRatios>>>,
        granted: &mut Granted<'_>,
    ) -> Decision {
        let (counters, at) = g.store.with(t.key, t.now, global_reclaimable, Arc::clone);
        self.global_decide(t, &g, counters, at, ratios, granted)
    }

    /// [`Self::global_turn`] on the key's `counters`, found in the store's slot `at`. Always
    /// inlined: `explain` decides by it too, and a second caller would leave the request
    /// path's outlined.
    #[inline(always)]
    pub(super) fn global_decide(
        &self,
        t: &Turn<'_, '_>,
        g: &GlobalRule<'_>,
        counters: Arc<GlobalCounters>,
        at: Slot,
        ratios: &mut Option<arc_swap::Guard<Arc<DropRatios>>>,
        granted: &mut Granted<'_>,
    ) -> Decision {
        let (rule, now) = (t.rule, t.now);
        // A response's cost is known after it: decided by the key's mean charged units (its
        // reservation before any), the difference charged once the response says. The shared
        // overflow counters stand for many keys: each is decided at the reservation.
        let cost = match &rule.charge {
            Some(_) if at != Slot::Overflow => counters.estimate(t.cost),
            Some(_) => t.cost.max(1),
            None => t.cost,
        };
        // The name the control plane knows the key by: a digest is worked out once per key
        // and kept with its counters, never for a known key.
        let overflow;
        let name: &[u8] = if !rule.digested {
            t.key
        } else if at == Slot::Overflow {
            overflow = self.shown_key(rule, t.req);
            &overflow
        } else {
            counters.name(|| self.shown_key(rule, t.req))
        };
        if at == Slot::Overflow {
            g.overflow_keys.insert(name);
        }
        let offered = counters.offer(cost);
        let ratios = ratios.get_or_insert_with(|| self.ratios.load());
        let age = now.saturating_sub(ratios.at);
        let (factor, stale) = self.staleness.factor(age);
        let mut took = GlobalTaken::default();
        let decision = match g.fallback {
            Some(fallback) if stale => {
                let (d, slot) = fallback.decide(t.key, now, cost, t.dry);
                took.slot = Some(slot);
                d
            }
            _ => {
                let choice = counters.choice(ratios.answers);
                let tail = || choice != Choice::Named;
                let (p, keep) = ratios.ratio_keep(&rule.name, name, tail);
                let p = p * factor;
                took.shared = p > 0.0;
                // The ratio may change with the next reply.
                let interval = self.report_interval.max(1);
                let mut retry = interval - age % interval;
                let mut keep_now = 1.0 - p;
                // The allowance, once worked out here, for the guard below; and whether the
                // guard paces the key at it.
                let mut allowance = None;
                let mut paced = false;
                if took.shared && choice == Choice::Named && factor >= 1.0 && g.drained > 0 {
                    // Fresh ratios of a key the reply names: its allowance, of what it is
                    // offered now (the tail's keys share one ratio, and no allowance each).
                    let since = now.saturating_sub(g.drained);
                    let offered = (offered - u64::from(cost)) as f64;
                    let of = || {
                        let a = counters.allowance_of(
                            keep,
                            ratios.answers,
                            ratios.own_lag,
                            g.rate.per_sec(),
                        );
                        allowance.insert(a).0
                    };
                    (keep_now, paced) =
                        counters.keep_now(keep_now, of, (offered, cost), since, interval);
                }
                let mut allowed = !took.shared || counters.share(keep_now, cost);
                if allowed && choice == Choice::New && !stale {
                    // Not assigned yet: the provisional limit holds it until a reply does.
                    match g.fallback {
                        Some(fallback) => {
                            let (d, slot) = fallback.decide(t.key, now, cost, t.dry);
                            allowed = d.is_allowed();
                            if let Decision::Deny { retry_after } = d {
                                retry = retry_after.unwrap_or(retry);
                            } else {
                                took.slot = Some(slot);
                            }
                        }
                        None => {
                            let per_sec = ratios.provisional(&rule.name, g.rate.per_sec());
                            match counters.guard(now, per_sec, cost, 0) {
                                Ok(ns) => took.guard = ns,
                                Err(wait) => {
                                    allowed = false;
                                    retry = wait;
                                }
                            }
                        }
                    }
                    if !allowed && took.shared {
                        counters.give_back(cost);
                    }
                } else if allowed && !stale {
                    let bound = guard_bound(
                        // The shared overflow counters stand for many keys, each with its own
                        // share: their allowance is not kept.
                        (&counters, at != Slot::Overflow),
                        ratios,
                        rule,
                        g.rate,
                        (keep, allowance, paced),
                        cost,
                        interval,
                    );
                    if let Some((per_sec, early)) = bound {
                        match counters.guard(now, per_sec, cost, early) {
                            Ok(ns) => took.guard = ns,
                            Err(wait) => {
                                allowed = false;
                                retry = wait;
                                // A paced key's share keeps what it paid: given back, every
                                // request would reach the pace, which would pick by the clock
                                // alone, the same places of a fixed cycle of clients each time.
                                if took.shared && !paced {
                                    counters.give_back(cost);
                                }
                            }
                        }
                    }
                }
                if allowed {
                    Decision::Allow {
                        remaining: if p > 0.0 { 0 } else { g.rate.count.get() },
                        reset_after: 0,
                        wait: 0,
                    }
                } else {
                    Decision::Deny {
                        retry_after: Some(retry),
                    }
                }
            }
        };
        if decision.is_allowed() {
            took.units = cost;
            if let Some(charge) = &rule.charge {
                // The overflow's share and guard are many keys': one key's debt is not theirs.
                let own = at != Slot::Overflow;
                let per_unit = if own {
                    took.guard as f32 / cost as f32
                } else {
                    0.0
                };
                let owed = Owed::Global(counters.clone(), took.shared && own, per_unit);
                granted.admit.charges.push(charge, owed, cost, now);
            }
            granted.taken.push((t.i, Taken::Global(counters, took)));
        }
        decision
    }
}

/// What an assigned key's guard lets this proxy admit until the next reply, for the fleet's
/// share `keep` (and `known`, the key's allowance if the share worked it out already): units a
/// second, and how far early (`None`: no bound).
///
/// With the fleet's share its limit allows (`keep` > 0): at most that share of what this
/// proxy was offered, however its load moved since (a surge, a burst), and a report
/// interval's worth more. The allowance is an estimate from counts: with headroom (none in a
/// surge), and for a few units a report its provisional share at least, so that the share
/// decides in steady state. With no bound from the reply (under half its limit fleet-wide), a
/// surge here is held until the sums hold it (with no share from the reply, the limit is not
/// asked). A `paced` key (see [`crate::rules::PACED_REQUESTS`]) is held to its allowance
/// itself: its share lets more through, and the pace, not the share, decides what this proxy
/// admits in any second. `kept`: `counters` are one key's, whose allowance is kept for the
/// reply ([`GlobalCounters::allowance_of`]).
#[inline]
fn guard_bound(
    (counters, kept): (&GlobalCounters, bool),
    ratios: &DropRatios,
    rule: &CompiledRule,
    rate: &Rate,
    (keep, known, paced): (f64, Option<(f64, bool)>, bool),
    cost: u32,
    interval: Nanos,
) -> Option<(f64, Nanos)> {
    if keep > 0.0 {
        let (allowance, surge) = known.unwrap_or_else(|| {
            let (answers, lag, limit) = (ratios.answers, ratios.own_lag, rate.per_sec());
            if kept {
                counters.allowance_of(keep, answers, lag, limit)
            } else {
                counters.allowance(keep, answers, lag, limit)
            }
        });
        let floor = (ratios.provisional(&rule.name, rate.per_sec()) * keep.min(1.0))
            .min(GUARD_FLOOR_UNITS * NANOS_PER_SEC as f64 / interval as f64);
        let headroom = if surge || paced { 1.0 } else { GUARD_HEADROOM };
        let per_sec = allowance.max(floor) * headroom;
        let two =
            (2.0 * NANOS_PER_SEC as f64 * f64::from(cost) / per_sec.max(1e-9)).min(1e18) as Nanos;
        let early = if paced {
            // Up to two requests' spacing less, drawn: a pace that frees its place at fixed
            // times would find the same place of a fixed cycle of clients each time.
            interval.saturating_sub(fastrand::u64(..=two))
        } else {
            interval
        };
        Some((per_sec, early.max(two)))
    } else {
        counters
            .held(0.0, ratios.answers, ratios.own_lag, 0.0)
            .map(|per_sec| (per_sec, interval))
    }
}
