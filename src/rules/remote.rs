//! What a decision leaves to a remote store (Redis, for `scope: redis` rules): the questions
//! [`RuleSet::check`] leaves open in a [`Remote`], the [`RemoteStore`] the caller asks, and
//! [`RuleSet::answer`]/[`RuleSet::finish`], which apply each answer (or `on_error` and the
//! fallback when there is none). Must never: await, or know which store answers.

use super::*;

/// The local part of a decision that waits for Redis: what the local rules granted, and the
/// questions for Redis. Owned, so no snapshot guard is held while Redis answers.
#[derive(Debug)]
pub struct Remote {
    pub(super) admit: Admit,
    pub(super) taken: SmallVec<[(usize, Taken); 4]>,
    pub(super) calls: SmallVec<[RedisCall; 1]>,
    /// Questions answered so far.
    pub(super) asked: usize,
}

impl Remote {
    /// The next question for the store, or `None` once all were answered.
    pub fn question<'a>(&'a self, rules: &'a RuleSet) -> Option<Question<'a>> {
        let call = self.calls.get(self.asked)?;
        let mut q = rules.question_of(call.rule, &call.key, call.cost)?;
        if let Some(own) = &call.own {
            q.quota = own;
        }
        Some(q)
    }
}

impl RuleSet {
    /// The question for the store of the `i`th rule (a `scope: redis` one) for `cost` units
    /// of `key`.
    pub(super) fn question_of<'a>(
        &'a self,
        i: usize,
        key: &'a [u8],
        cost: u32,
    ) -> Option<Question<'a>> {
        let rule = self.rules.get(i)?;
        let Kind::Redis {
            algorithm, quota, ..
        } = &*rule.kind
        else {
            return None;
        };
        Some(Question {
            rule: &rule.name,
            key,
            algorithm: *algorithm,
            quota,
            cost,
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
    /// What [`Self::decide`] would answer now, writing nothing (`explain`); `None` when the
    /// store gave no answer.
    fn peek<'a>(
        &'a self,
        q: Question<'a>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<StoreAnswer>> + Send + 'a>>;
    /// Charges `units` (given back when negative) to `key` of `rule`'s bucket after the
    /// response said them (`cost: { response }`), in the background: the caller never waits.
    /// Units owed that the store does not take are counted in `lost`.
    fn owe(&self, rule: Arc<str>, key: Box<[u8]>, quota: Quota, units: i64, lost: IntCounter);
    /// What a decision does when the store gave no answer.
    fn on_error(&self) -> OnError;
    /// Whether a refusal is remembered until its retry time and answered without asking.
    fn cache_refusals(&self) -> bool;
    /// The retry hint of a refusal made without the store (`on_error: deny`).
    fn retry_hint(&self) -> Nanos;
    fn metrics(&self) -> &crate::metrics::RedisMetrics;
}

#[derive(Debug)]
pub(super) struct RedisCall {
    pub(super) rule: usize,
    pub(super) key: Vec<u8>,
    pub(super) cost: u32,
    /// The key's own limit (`overrides:`), asked of Redis instead of the rule's. (Its 429s
    /// are looked up again on the answer: a field with a destructor would cost every decision
    /// the drop of its calls.)
    pub(super) own: Option<Quota>,
}

impl RuleSet {
    /// Applies the store's answer to the first open question of `remote` (`None`: the store
    /// gave none, and `on_error` decides): a verdict when that ends the decision (a refusal,
    /// which gives back what the local rules granted and is remembered until its retry time,
    /// so that the key's next requests are answered here). Units the store granted to earlier
    /// rules of a refused request are not given back (a decision there is one script call,
    /// and a refund would be another on the refusal's path).
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
        let table = call.own.and(rule.overrides.as_ref()).map(|o| o.load());
        let answers = table
            .as_ref()
            .and_then(|t| self.own_limit(t, rule, &call.key, req))
            .and_then(overrides::Own::answers)
            .unwrap_or(&rule.answers);
        let Kind::Redis {
            refused, fallback, ..
        } = &*rule.kind
        else {
            return None;
        };
        // Redis itself took the reservation (else `on_error` decided, and Redis is owed all of
        // a response's units).
        let in_store = answer.is_some_and(|a| a.admitted);
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
                // A response cost is charged to the key in the store (admitted by
                // `on_error` too: the store's debt is the one every proxy sees; a fallback's
                // local reservation is not reconciled).
                if let (Some(charge), Some(store)) = (&rule.charge, &self.store) {
                    let owed = Owed::Remote(Box::new((store.clone(), call.key.clone().into())));
                    let reserved = if in_store { call.cost } else { 0 };
                    remote.admit.charges.push(charge, owed, reserved, now);
                }
                if self.header_mode == HeaderMode::Always {
                    remote.admit.states.push(RateState {
                        answers: answers.clone(),
                        remaining,
                        reset_secs: ceil_secs(reset_after),
                    });
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
                    rule.refused_keys.record(&call.key, now);
                    Some(self.refuse((rule, answers), req, &remote.taken, now, retry_after))
                }
            },
        }
    }

    /// The verdict of a decision whose every question was answered without a refusal.
    pub fn finish(&self, remote: Box<Remote>) -> Verdict {
        debug_assert_eq!(remote.asked, remote.calls.len(), "every question answered");
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
}
