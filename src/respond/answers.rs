//! How a rule's 429 is rendered: the body, the header map and the same fields as the lines of
//! an HTTP/1 head, built once per rule and retry hint and kept by the rule
//! ([`crate::rules::Answers`]).
//!
//! Owns those bytes and how they are built. Must never: depend on the decision beyond the rule's
//! name, policy and hint, or be called per refusal for a hint the rule keeps.

use std::fmt::Write as _;

use bytes::{BufMut, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};

pub use crate::rules::{Answer, Answers};

pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(crate) static PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// Renders a rule's 429 for a retry hint: `Content-Type`, `Cache-Control`, `Retry-After`, `RateLimit-Policy`
/// and `RateLimit` (`r=0`), as a map and as the lines of an HTTP/1 head, and the problem
/// document. The rule keeps what this renders ([`Answers`]).
pub(crate) fn render(rule: &str, policy: &HeaderValue, retry: Option<u64>) -> Answer {
    let mut body = BytesMut::with_capacity(192);
    body.put_slice(
        b"{\"type\":\"about:blank\",\"title\":\"Too Many Requests\",\"status\":429,\"detail\":\"",
    );
    write_detail(&mut body, rule, retry);
    let _ = write!(body, "\",\"rule\":\"{rule}\"");
    if let Some(secs) = retry {
        let _ = write!(body, ",\"retry_after\":{secs}");
    }
    body.put_slice(b"}\n");
    let mut headers = HeaderMap::with_capacity(5);
    headers.insert(CONTENT_TYPE, PROBLEM_JSON.clone());
    headers.insert(CACHE_CONTROL, super::NO_STORE.clone());
    if let Some(secs) = retry {
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    headers.insert(RATELIMIT_POLICY.clone(), policy.clone());
    let ratelimit = ratelimit_value(std::iter::once((rule, 0, retry.unwrap_or(0))));
    headers.insert(RATELIMIT.clone(), ratelimit);
    let mut fields = Vec::with_capacity(160);
    let mut rate_at = 0;
    // A map's fields iterate in insertion order, so the `RateLimit` ones come last.
    for (name, value) in &headers {
        if name == RATELIMIT_POLICY {
            rate_at = fields.len();
        }
        field(&mut fields, name.as_str().as_bytes(), value.as_bytes());
    }
    Answer {
        body: body.freeze(),
        headers,
        fields: fields.into_boxed_slice(),
        rate_at,
    }
}

/// The human-readable reason of a 429, plain ASCII without quotes or '%'.
pub(crate) fn write_detail(out: &mut impl std::fmt::Write, rule: &str, retry: Option<u64>) {
    let _ = match retry {
        Some(secs) => write!(out, "rate limit of rule {rule} exceeded; retry in {secs} s"),
        None => write!(
            out,
            "the cost of this request exceeds the burst of rule {rule}; it can never be admitted"
        ),
    };
}

/// The `RateLimit` value: `"<rule>";r=<remaining>;t=<reset secs>` per rule, comma-separated.
pub(crate) fn ratelimit_value<'a>(
    states: impl Iterator<Item = (&'a str, u32, u64)>,
) -> HeaderValue {
    let mut value = BytesMut::with_capacity(48);
    for (i, (rule, remaining, reset)) in states.enumerate() {
        if i > 0 {
            value.put_slice(b", ");
        }
        let _ = write!(value, "\"{rule}\";r={remaining};t={reset}");
    }
    // Rule names are validated to header-safe characters; digits and quotes are too.
    HeaderValue::from_maybe_shared(value.freeze()).expect("RateLimit values are visible ASCII")
}

/// Writes one header field as a line of an HTTP/1 head: `name: value\r\n`.
fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}
