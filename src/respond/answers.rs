//! A rule's 429s, built once per retry hint and kept with the rule: the body, the header map
//! and the same fields as the lines of an HTTP/1 head.
//!
//! Owns those bytes and how they are built. Must never: depend on the decision (the rule set
//! holds an [`Answers`] per rule, so this module stays below it), or allocate for a hint it
//! keeps once built.

use std::fmt::Write as _;
use std::sync::{Arc, OnceLock};

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};

pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(crate) static PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// Retry hints (whole seconds) whose 429 parts a rule keeps: up to a minute covers rules
/// limited per second or per minute; longer hints are formatted per refusal.
const CACHED_SECS: usize = 60;

/// The parts of one rule's 429s, one set per retry hint of up to `CACHED_SECS` (60 s), each built
/// on first use. About 1 KiB per rule until used, plus about 1 KiB per hint seen.
pub struct Answers {
    rule: Arc<str>,
    /// The rule's `RateLimit-Policy` value.
    policy: HeaderValue,
    // Shared so that a refusal's response can hold its answer; a pointer per unused hint.
    by_secs: [OnceLock<Arc<Answer>>; CACHED_SECS],
}

impl Answers {
    pub fn new(rule: Arc<str>, policy: HeaderValue) -> Self {
        Self {
            rule,
            policy,
            by_secs: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// The parts for `retry`, when it is a hint worth keeping.
    pub(crate) fn get(&self, retry: Option<u64>) -> Option<&Arc<Answer>> {
        let secs = retry?;
        let slot = self
            .by_secs
            .get(usize::try_from(secs).ok()?.checked_sub(1)?)?;
        Some(slot.get_or_init(|| Arc::new(self.build(retry))))
    }

    /// The parts for `retry`, built now.
    pub(crate) fn build(&self, retry: Option<u64>) -> Answer {
        Answer::new(&self.rule, &self.policy, retry)
    }
}

impl std::fmt::Debug for Answers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cached = self.by_secs.iter().filter(|s| s.get().is_some()).count();
        f.debug_struct("Answers")
            .field("rule", &self.rule)
            .field("cached", &cached)
            .finish()
    }
}

/// A 429's body and headers for one rule and retry hint: `Content-Type`, `Retry-After`,
/// `RateLimit-Policy` and `RateLimit` (`r=0`), as a map and as the lines of an HTTP/1 head.
pub(crate) struct Answer {
    pub(crate) body: Bytes,
    pub(crate) headers: HeaderMap,
    /// `headers` written as `name: value\r\n` lines, the `RateLimit` ones last...
    pub(crate) fields: Box<[u8]>,
    /// ...from here on.
    pub(crate) rate_at: usize,
}

impl Answer {
    fn new(rule: &str, policy: &HeaderValue, retry: Option<u64>) -> Self {
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
        let mut headers = HeaderMap::with_capacity(4);
        headers.insert(CONTENT_TYPE, PROBLEM_JSON.clone());
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
        Self {
            body: body.freeze(),
            headers,
            fields: fields.into_boxed_slice(),
            rate_at,
        }
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
