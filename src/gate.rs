//! Admission around the synchronous decision: waiting when a rule delays, asking a remote
//! store the questions a decision left open, and holding concurrency slots until the response
//! body ends; the sidecar's request path and the tower layer (`layer`) both admit through it.
//!
//! Owns the only awaits of the limiting path: the leaky bucket's shaping wait, the
//! `on_limit: delay` retries (each a tokio timer, no thread held) and a remote store's answers
//! (each bounded by `redis.timeout`). The rule snapshot is loaded afresh for each try and never
//! held across an await. Must never: answer a request itself (that is `respond`), or wait
//! longer than the rule's `max_delay`.

use std::time::Duration;

use arc_swap::ArcSwap;

use crate::key::RequestView;
use crate::limit::{AnyClock, Clock};
pub use crate::respond::PermitBody;
pub use crate::rules::Refusal;
use crate::rules::{Admit, RuleSet, Verdict};

/// Decides `req`, waiting when a rule says so: the leaky bucket's shaping wait, or, for a
/// rule with `on_limit: delay`, until the limiter admits it (at most `max_delay`, with a place
/// in the rule's queue). A caller that drops this future (the client went away) frees its
/// queue place and any concurrency slot it held.
pub async fn admit(
    rules: &ArcSwap<RuleSet>,
    clock: &AnyClock,
    req: &RequestView<'_>,
) -> Result<Admit, Refusal> {
    let mut place: Option<crate::rules::QueuePlace> = None;
    // Bounded by tokio's clock, so that a waiting request ends even if the limiter's clock
    // were to stand still.
    let mut deadline = None;
    loop {
        let now = clock.now();
        // The snapshot guard is released before any await: a decision that must ask Redis
        // keeps the rule set alive by its `Arc` instead.
        let verdict = {
            let guard = rules.load();
            match guard.check(req, now) {
                Verdict::Remote(remote) => Err((arc_swap::Guard::into_inner(guard), remote)),
                v => Ok(v),
            }
        };
        let verdict = match verdict {
            Ok(v) => v,
            // Boxed: the rare path (a network round trip) keeps the common future small.
            Err((set, remote)) => Box::pin(ask_store(&set, remote, req, now)).await,
        };
        match verdict {
            Verdict::Allow(mut admit) => {
                if admit.wait > 0 {
                    Box::pin(tokio::time::sleep(Duration::from_nanos(admit.wait))).await;
                }
                if let Some(place) = place {
                    place.admitted();
                }
                // From here the request goes to the app: what it owes settles whatever happens.
                admit.charges.arm(clock);
                return Ok(admit);
            }
            Verdict::BadRequest(bad) => return Err(Refusal::BadRequest(bad)),
            Verdict::Remote(_) => unreachable!("ask_store answers Allow or Deny"),
            Verdict::Deny(denial) => {
                let (Some(delay), Some(retry)) = (&denial.delay, denial.retry_after) else {
                    return Err(Refusal::Limited(denial));
                };
                let now = tokio::time::Instant::now();
                let deadline = *deadline.get_or_insert(now + Duration::from_nanos(delay.max_delay));
                let wake = now + Duration::from_nanos(retry);
                if wake > deadline {
                    return Err(Refusal::Limited(denial));
                }
                if place.is_none() {
                    match delay.queue.enter() {
                        Some(p) => place = Some(p),
                        None => return Err(Refusal::Limited(denial)),
                    }
                }
                drop(denial);
                Box::pin(tokio::time::sleep_until(wake)).await;
            }
        }
    }
}

/// Asks the rule set's store each question a decision left open (`scope: redis` rules, in
/// turn, each bounded by `redis.timeout`), then finishes the decision.
async fn ask_store(
    set: &RuleSet,
    mut remote: Box<crate::rules::Remote>,
    req: &RequestView<'_>,
    now: crate::limit::Nanos,
) -> Verdict {
    loop {
        let answer = match (remote.question(set), set.store()) {
            (None, _) => return set.finish(remote),
            (Some(q), Some(store)) => store.decide(q).await,
            (Some(_), None) => None,
        };
        if let Some(refused) = set.answer(&mut remote, answer, req, now) {
            return refused;
        }
    }
}
