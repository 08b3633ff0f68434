//! The sidecar's response: its body type, and [`whole`], which puts a kept 429's or an
//! upstream head's fields in the map for a server that writes its own heads. What Spillway's
//! own answers are is `crate::respond`'s. Must never: build a head of its own.

use http::Response;
use http_body_util::Either;
use hyper::body::Incoming;

use crate::respond::{Own, PermitBody, RATELIMIT, RATELIMIT_POLICY};

/// An upstream response's body: from the pooled client, or read from our own connection.
pub type UpstreamBody = Either<Incoming, super::http1::client::RawBody>;

/// Response bodies of the sidecar: the upstream's, streamed, or a short one of ours.
pub type Body = Either<PermitBody<UpstreamBody>, Own>;

/// In a response's extensions: the `upstream_body_idle` its rules set, in place of the
/// global one.
#[derive(Debug, Clone, Copy)]
pub struct BodyIdle(pub std::time::Duration);

/// Puts all of `resp`'s header fields in its map, for a server that writes its own heads
/// (hyper's) or a change to the map: a kept 429's, or those an upstream response of our own
/// connection passes as the upstream wrote them (`http1::client::Passed`). Fields
/// already in the map (a `Connection: close`) stay, after a 429's and before an upstream's.
///
/// Once the fields are in the map the body no longer brings them, so a second call adds
/// nothing: a kept 429 becomes a plain document, upstream lines are taken out.
pub fn whole(resp: &mut Response<Body>) {
    match resp.body_mut() {
        Either::Right(Own::Canned(canned)) => {
            let mut headers = canned.answer.headers.clone();
            if !canned.rate {
                headers.remove(&RATELIMIT);
                headers.remove(&RATELIMIT_POLICY);
            }
            let doc = Own::Doc(canned.body.clone());
            headers.extend(std::mem::take(resp.headers_mut()));
            *resp.headers_mut() = headers;
            *resp.body_mut() = Either::Right(doc);
        }
        Either::Left(permit) => {
            let passed = match permit.inner_mut() {
                Either::Right(raw) => raw.take_passed(),
                Either::Left(_) => None,
            };
            if let Some(passed) = passed {
                passed.into_map(resp.headers_mut());
            }
        }
        Either::Right(Own::Doc(_)) => {}
    }
}
