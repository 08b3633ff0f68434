//! Costs charged after the response: what a request admitted by a rule whose cost is the
//! app's response's (`cost: { response: ... }`) owes once the app has said what it consumed.
//!
//! The decision took the rule's reservation (`scope: global`: the key's estimate); a
//! [`Charge`] per such rule rides with the response and settles once: at the head (a header),
//! at the trailers, or at the body's end (its bytes or its JSON), the reservation topped up as
//! debt or given back, in the key's bucket here, in its fleet counters and share (`scope:
//! global`), or (`scope: redis`) by one script call sent off the request's path. A response that never says
//! (the field missing or malformed, the body cut short, the app never answering) is charged
//! the rule's `unknown`, a body's bytes what was sent. Only the app's response is read.
//! Must never: charge a request twice or not at all once armed, charge one that was refused,
//! look its key up again (a charge holds its key's state, which is not forgotten meanwhile),
//! allocate for a tracked key, or block.

use std::sync::Arc;

use http::HeaderMap;
use prometheus::IntCounter;
use smallvec::SmallVec;

use super::store::Owed;
use super::Kind;
use crate::config::{ResponseCost, Usage};
use crate::limit::{AnyClock, Clock, Limiter, Nanos};
use crate::usage;

/// What a rule whose cost is the response's needs to charge it: its state, its cost and its
/// counters. One per compiled rule, shared by its charges.
pub(super) struct ChargeRule {
    name: Arc<str>,
    pub(super) kind: Arc<Kind>,
    /// The limiter clock its decisions were made on: the first armed charge's (one rule set
    /// decides on one clock).
    clock: std::sync::OnceLock<AnyClock>,
    pub(super) cost: ResponseCost,
    pub(super) reserved: IntCounter,
    pub(super) charged: IntCounter,
    /// Units a remote store did not take (it failed, or its breaker was open).
    lost: IntCounter,
    missing: IntCounter,
    malformed: IntCounter,
    cut_short: IntCounter,
    encoded: IntCounter,
    clamped: IntCounter,
}

impl ChargeRule {
    pub(super) fn new(
        kind: Arc<Kind>,
        cost: ResponseCost,
        metrics: &crate::metrics::Metrics,
        name: &Arc<str>,
    ) -> Self {
        let rule = &**name;
        let units = |kind| metrics.response_units.with_label_values(&[rule, kind]);
        let unread = |reason| metrics.usage_unread.with_label_values(&[rule, reason]);
        ChargeRule {
            name: name.clone(),
            lost: units("lost"),
            kind,
            clock: std::sync::OnceLock::new(),
            cost,
            reserved: units("reserved"),
            charged: units("charged"),
            missing: unread("missing"),
            malformed: unread("malformed"),
            cut_short: unread("cut_short"),
            encoded: unread("encoded"),
            clamped: unread("clamped"),
        }
    }
}

/// The charges of one admitted request: none for most, one per response-cost rule that
/// admitted it. Armed with the limiter's clock once the request is admitted; until then
/// dropping them charges nothing (a refused request's reservations were given back).
#[derive(Default)]
pub struct Charges {
    list: SmallVec<[Charge; 1]>,
    armed: bool,
    /// When the request was decided (its reservations taken), in whole milliseconds of the
    /// limiter clock, wrapping: kept here once, and small, because every admission carries
    /// these (a reservation is given back only as far as the bucket has not refilled it).
    at_ms: u32,
}

impl std::fmt::Debug for Charges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Charges")
            .field("pending", &self.list.iter().filter(|c| !c.settled).count())
            .finish()
    }
}

struct Charge {
    rule: Arc<ChargeRule>,
    owed: Owed,
    reserved: u32,
    settled: bool,
    /// A body read for its usage, from the head on (boxed: only such rules pay for it).
    body: Option<Box<Scan>>,
}

/// How a body is read for its usage: its bytes counted, or read as one JSON document or as
/// an event stream.
enum Scan {
    Bytes(u64),
    Json(usage::Json),
    Events(usage::Events),
}

/// Why a response's usage was not read as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unread {
    Missing,
    Malformed,
    CutShort,
    /// A compressed body (the proxy asked for none).
    Encoded,
}

impl Charges {
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// A charge for `rule` settling with `owed`, `reserved` units taken at `at`.
    pub(super) fn push(&mut self, rule: &Arc<ChargeRule>, owed: Owed, reserved: u32, at: Nanos) {
        self.at_ms = millis(at);
        self.list.push(Charge {
            rule: rule.clone(),
            owed,
            reserved,
            settled: false,
            body: None,
        });
    }

    /// Drops these, with no call when they hold nothing (no charge, as for every request no
    /// response cost applies to): see `proxy::request::release`.
    #[inline(always)]
    pub fn release(self) {
        if !self.armed && self.list.is_empty() && !self.list.spilled() {
            std::mem::forget(self);
        }
    }

    /// Whether a charge is still open once the head has been read: the body must carry them.
    pub fn pending(&self) -> bool {
        self.armed && self.list.iter().any(|c| !c.settled)
    }

    /// Whether a charge reads the response's body for its usage: the request then asks the
    /// app for no compression (`Accept-Encoding: identity`), which the scan cannot read.
    pub fn reads_body(&self) -> bool {
        self.list
            .iter()
            .any(|c| matches!(c.rule.cost.usage, Usage::Json(_)))
    }

    /// The request was admitted: from now on every charge settles, at the latest when these
    /// are dropped.
    pub fn arm(&mut self, clock: &AnyClock) {
        if self.list.is_empty() || self.armed {
            return;
        }
        for c in &self.list {
            c.rule.reserved.inc_by(u64::from(c.reserved));
            c.rule.clock.get_or_init(|| clock.clone());
        }
        self.armed = true;
    }

    /// Whether the charges settle, and the time on the clock their decisions were made on.
    fn now(&self) -> Option<Nanos> {
        let rule = &self.list.first()?.rule;
        self.armed
            .then(|| rule.clock.get().map(Clock::now))
            .flatten()
    }

    /// The response head has come: charges read from a header settle, by `field` (the first
    /// value of a response field).
    pub fn head<'a>(&mut self, field: impl Fn(&http::HeaderName) -> Option<&'a [u8]>) {
        let Some(now) = self.now() else { return };
        let at = self.at_ms;
        for c in self.list.iter_mut().filter(|c| !c.settled) {
            match &c.rule.cost.usage {
                Usage::Header(name) => c.settle(now, at, read(field(&name.0))),
                Usage::Json(pointers) => {
                    let identity = field(&http::header::CONTENT_ENCODING)
                        .is_none_or(|e| e.trim_ascii().eq_ignore_ascii_case(b"identity"));
                    if !identity {
                        c.settle(now, at, Err(Unread::Encoded));
                        continue;
                    }
                    let events = field(&http::header::CONTENT_TYPE).is_some_and(|t| {
                        let media = t.split(|&c| c == b';').next().unwrap_or(t);
                        media
                            .trim_ascii()
                            .eq_ignore_ascii_case(b"text/event-stream")
                    });
                    c.body = Some(Box::new(if events {
                        Scan::Events(usage::Events::new(pointers))
                    } else {
                        Scan::Json(usage::Json::new(pointers))
                    }));
                }
                Usage::BodyBytes => c.body = Some(Box::new(Scan::Bytes(0))),
                Usage::Trailer(_) => {}
            }
        }
    }

    /// `bytes` of the body are on their way to the client.
    #[inline]
    pub fn data(&mut self, bytes: &[u8]) {
        for c in self.list.iter_mut() {
            match (c.body.as_deref_mut(), &c.rule.cost.usage) {
                (Some(Scan::Bytes(sent)), _) => *sent = sent.saturating_add(bytes.len() as u64),
                (Some(Scan::Json(json)), Usage::Json(pointers)) => json.feed(pointers, bytes),
                (Some(Scan::Events(events)), Usage::Json(pointers)) => events.feed(pointers, bytes),
                _ => {}
            }
        }
    }

    /// The response's trailers: charges read from one settle.
    pub fn trailers(&mut self, trailers: &HeaderMap) {
        let Some(now) = self.now() else { return };
        let at = self.at_ms;
        for c in self.list.iter_mut().filter(|c| !c.settled) {
            if let Usage::Trailer(name) = &c.rule.cost.usage {
                let mut values = trailers.get_all(&name.0).iter();
                let value = match (values.next(), values.next()) {
                    (Some(v), None) => read(Some(v.as_bytes())),
                    (None, _) => Err(Unread::Missing),
                    (Some(_), Some(_)) => Err(Unread::Malformed),
                };
                c.settle(now, at, value);
            }
        }
    }

    /// The body is over (`whole`: it ended as framed; else it was cut short): every charge
    /// still open settles, a body's bytes at what was sent, the rest at `unknown`.
    pub fn end(&mut self, whole: bool) {
        let Some(now) = self.now() else { return };
        let at = self.at_ms;
        for c in self.list.iter_mut().filter(|c| !c.settled) {
            let value = match (&c.rule.cost.usage, c.body.as_deref_mut()) {
                (_, Some(Scan::Bytes(sent))) => Ok(*sent),
                // The app never answered: no byte was sent.
                (Usage::BodyBytes, _) => Ok(0),
                (Usage::Json(pointers), Some(scan)) => {
                    scanned(pointers, scan, whole, c.rule.cost.unknown)
                }
                _ if whole => Err(Unread::Missing),
                _ => Err(Unread::CutShort),
            };
            c.settle(now, at, value);
        }
    }
}

impl Drop for Charges {
    #[inline]
    fn drop(&mut self) {
        // Armed and not ended: the response was cut short, or the app never answered.
        if self.armed {
            self.end(false);
        }
    }
}

impl Charge {
    /// Charges the response's units (or, unread, the rule's `unknown`), reconciling what was
    /// reserved.
    fn settle(&mut self, now: Nanos, at_ms: u32, value: Result<u64, Unread>) {
        self.settled = true;
        let rule = &*self.rule;
        let units = match value {
            Ok(n) if n > u64::from(rule.cost.max) => {
                rule.clamped.inc();
                rule.cost.max
            }
            Ok(n) => n as u32,
            Err(why) => {
                match why {
                    Unread::Missing => rule.missing.inc(),
                    Unread::Malformed => rule.malformed.inc(),
                    Unread::CutShort => rule.cut_short.inc(),
                    Unread::Encoded => rule.encoded.inc(),
                }
                rule.cost.unknown
            }
        };
        rule.charged.inc_by(u64::from(units));
        if let Owed::Global(counters, shared, per_unit) = &self.owed {
            counters.settle(now, self.reserved, units, (*shared, *per_unit));
            return;
        }
        let (quota, overflow) = match &*rule.kind {
            Kind::Rate {
                quota, overflow, ..
            } => (quota, Some(overflow)),
            Kind::Redis { quota, .. } => (quota, None),
            _ => return,
        };
        // What the reservation still holds: the part of it the bucket has not refilled since
        // (given back past that, it would be given back twice, and wipe out a later debt).
        let elapsed = u64::from(millis(now).wrapping_sub(at_ms)) * 1_000_000;
        let refilled = elapsed / quota.emission().max(1);
        let held = u64::from(self.reserved).saturating_sub(refilled) as u32;
        let (owe, back) = if units > self.reserved {
            (units - self.reserved, 0)
        } else {
            (0, (self.reserved - units).min(held))
        };
        if owe == 0 && back == 0 {
            return;
        }
        match (&self.owed, overflow) {
            (Owed::Remote(remote), _) => {
                owe_remote(&self.rule, remote, *quota, i64::from(owe) - i64::from(back))
            }
            (Owed::Keyed(state), _) if owe > 0 => state.owe(quota, now, owe),
            (Owed::Keyed(state), _) => state.refund(quota, now, back),
            (Owed::Sketch(key), Some(overflow)) if owe > 0 => {
                overflow.sketch().owe(key, quota, now, owe)
            }
            (Owed::Sketch(key), Some(overflow)) => overflow.sketch().refund(key, quota, now, back),
            (Owed::Sketch(_), None) | (Owed::Global(..), _) => {}
        }
    }
}

/// `now` in whole milliseconds, wrapping (a call of up to 49 days is told apart).
fn millis(now: Nanos) -> u32 {
    (now / 1_000_000) as u32
}

/// Sends the charge of `units` (given back when negative) to a remote store, which sends it
/// off the request's path and counts what it does not take as lost.
fn owe_remote(
    rule: &Arc<ChargeRule>,
    remote: &super::store::RemoteKey,
    quota: crate::limit::Quota,
    units: i64,
) {
    let (store, key) = remote;
    store.owe(
        rule.name.clone(),
        key.clone(),
        quota,
        units,
        rule.lost.clone(),
    );
}

/// What a body's scan says its usage is, once the body is over (`whole`: as framed): the sum
/// of the numbers found at the pointers (what the app said stands, even in a body cut short
/// after it; cut short before some pointer was found, at least `unknown`); a value there that
/// is not a whole number, or a body that is not JSON (nor an event stream of it), is
/// malformed.
fn scanned(
    pointers: &usage::Pointers,
    scan: &mut Scan,
    whole: bool,
    unknown: u32,
) -> Result<u64, Unread> {
    let (found, read_whole) = match scan {
        Scan::Bytes(_) => return Err(Unread::Malformed),
        Scan::Json(json) => {
            json.end();
            (json.found(), json.done())
        }
        Scan::Events(events) => {
            events.end(pointers);
            (events.found(), true)
        }
    };
    let found = &found[..pointers.text().len()];
    if found.contains(&usage::Found::Bad) {
        return Err(Unread::Malformed);
    }
    let mut any = false;
    let sum = found.iter().fold(0u64, |sum, f| match f {
        usage::Found::Number(n) => {
            any = true;
            sum.saturating_add(*n)
        }
        _ => sum,
    });
    let all = found.iter().all(|f| *f != usage::Found::None);
    match (any, whole, read_whole) {
        // Cut short before every pointer was found (a stream's output count comes last):
        // what was found, or `unknown` if that is more.
        (true, false, _) if !all => Ok(sum.max(u64::from(unknown))),
        (true, ..) => Ok(sum),
        (false, false, _) => Err(Unread::CutShort),
        (false, true, true) => Err(Unread::Missing),
        (false, true, false) => Err(Unread::Malformed),
    }
}

/// A usage field's value: one whole number, spaces around it allowed; past `u64` it is as
/// large as can be (clamped by the caller).
fn read(value: Option<&[u8]>) -> Result<u64, Unread> {
    let v = value.ok_or(Unread::Missing)?.trim_ascii();
    if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
        return Err(Unread::Malformed);
    }
    Ok(v.iter().fold(0u64, |n, d| {
        n.saturating_mul(10).saturating_add(u64::from(d - b'0'))
    }))
}

#[cfg(test)]
mod tests;
