//! The one place where Spillway answers by itself: 429 (or its gRPC form) and the 4xx/5xx it
//! sends when it cannot or will not forward. Keeping them together keeps headers and bodies
//! consistent between the sidecar and the embedded layer.
//!
//! Bodies are short `application/problem+json` documents (RFC 9457) that say what happened;
//! rule names are validated to `[A-Za-z0-9_.-]`, so they need no escaping in JSON or in the
//! structured-field strings of the `RateLimit` headers (draft-ietf-httpapi-ratelimit-headers-11).
//! A limited gRPC call gets what gRPC clients understand: HTTP 200 with `grpc-status: 8`
//! (RESOURCE_EXHAUSTED), a `grpc-message`, and the retry hint as `grpc-retry-pushback-ms`.

use std::fmt::Write as _;

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::config::HeaderMode;
use crate::gate::{PermitBody, Refusal};
use crate::rules::{Denial, RateState};

/// Response bodies of the sidecar: the upstream's, streamed, or a short one of ours.
pub type Body = Either<PermitBody<Incoming>, Full<Bytes>>;

/// A response of ours, for whatever the other body type is.
type Ours<L> = Response<Either<L, Full<Bytes>>>;

pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");
static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
static GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// True for gRPC requests (`content-type: application/grpc*`).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The answer to a refused request.
pub fn refusal<L>(refusal: &Refusal, grpc: bool) -> Ours<L> {
    match refusal {
        Refusal::Limited(denial) => too_many_requests(denial, grpc),
        Refusal::BadCost(header) => error(
            StatusCode::BAD_REQUEST,
            &format!("the {header} header must be a whole number"),
        ),
    }
}

/// 429 (or gRPC RESOURCE_EXHAUSTED) for a request a rule refused.
///
/// Built with one buffer for the body and one per formatted header value (nginx answers
/// `limit_req` with a static page; this is the closest we get while saying which rule and when).
pub fn too_many_requests<L>(denial: &Denial, grpc: bool) -> Ours<L> {
    if denial.capacity {
        return reduced_capacity(denial, grpc);
    }
    let rule = &denial.state.rule;
    let retry = denial.retry_after_secs();
    let mut resp = if grpc {
        let mut resp = Response::new(Either::Right(Full::new(Bytes::new())));
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert(GRPC_STATUS.clone(), HeaderValue::from_static("8"));
        // grpc-message is percent-encoded; the detail is plain ASCII without '%'.
        let mut msg = String::with_capacity(96);
        write_detail(&mut msg, rule, retry);
        if let Ok(v) = HeaderValue::from_str(&msg.replace(' ', "%20")) {
            h.insert(GRPC_MESSAGE.clone(), v);
        }
        if let Some(ms) = denial.retry_after.map(|n| n.div_ceil(1_000_000)) {
            h.insert(GRPC_PUSHBACK.clone(), HeaderValue::from(ms));
        }
        resp
    } else {
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
        problem(StatusCode::TOO_MANY_REQUESTS, body.freeze())
    };
    let headers = resp.headers_mut();
    if let Some(secs) = retry {
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    if denial.header_mode != HeaderMode::Never {
        add_rate_headers(headers, std::slice::from_ref(&denial.state));
    }
    resp
}

/// The problem type of draft-ietf-httpapi-ratelimit-headers for capacity, not quota.
const REDUCED_CAPACITY: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// 503 with `Retry-After` for a request an adaptive limit refused: the upstream is at the
/// concurrency its latency allows now. No `RateLimit` headers: this is not the client's quota.
fn reduced_capacity<L>(denial: &Denial, grpc: bool) -> Ours<L> {
    let rule = &denial.state.rule;
    let secs = denial.retry_after_secs().unwrap_or(1);
    let mut resp = if grpc {
        // UNAVAILABLE: gRPC clients retry it with back-off.
        let mut resp = Response::new(Either::Right(Full::new(Bytes::new())));
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert(GRPC_STATUS.clone(), HeaderValue::from_static("14"));
        resp
    } else {
        let mut body = BytesMut::with_capacity(256);
        let _ = writeln!(
            body,
            "{{\"type\":\"{REDUCED_CAPACITY}\",\"title\":\"Temporary Reduced Capacity\",\"status\":503,\
             \"detail\":\"the upstream is at the concurrency rule {rule} allows for its latency now; retry in {secs} s\",\
             \"rule\":\"{rule}\",\"retry_after\":{secs}}}"
        );
        problem(StatusCode::SERVICE_UNAVAILABLE, body.freeze())
    };
    resp.headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(secs));
    resp
}

/// The human-readable reason of a 429, plain ASCII without quotes or '%'.
fn write_detail(out: &mut impl std::fmt::Write, rule: &str, retry: Option<u64>) {
    let _ = match retry {
        Some(secs) => write!(out, "rate limit of rule {rule} exceeded; retry in {secs} s"),
        None => write!(
            out,
            "the cost of this request exceeds the burst of rule {rule}; it can never be admitted"
        ),
    };
}

/// Adds `RateLimit-Policy` and `RateLimit` for `states`, one list member per rule.
pub fn add_rate_headers(headers: &mut HeaderMap, states: &[RateState]) {
    if states.is_empty() {
        return;
    }
    if let [one] = states {
        headers.insert(RATELIMIT_POLICY.clone(), one.policy.clone());
    } else {
        let mut joined = BytesMut::with_capacity(64 * states.len());
        for (i, s) in states.iter().enumerate() {
            if i > 0 {
                joined.put_slice(b", ");
            }
            joined.put_slice(s.policy.as_bytes());
        }
        if let Ok(v) = HeaderValue::from_maybe_shared(joined.freeze()) {
            headers.insert(RATELIMIT_POLICY.clone(), v);
        }
    }
    let mut value = BytesMut::with_capacity(48 * states.len());
    for (i, s) in states.iter().enumerate() {
        if i > 0 {
            value.put_slice(b", ");
        }
        let _ = write!(value, "\"{}\";r={};t={}", s.rule, s.remaining, s.reset_secs);
    }
    if let Ok(v) = HeaderValue::from_maybe_shared(value.freeze()) {
        headers.insert(RATELIMIT.clone(), v);
    }
}

/// A short problem document for errors Spillway answers itself (400, 431, 502, 503, 504).
pub fn error<L>(status: StatusCode, detail: &str) -> Ours<L> {
    let title = status.canonical_reason().unwrap_or("Error");
    let body = format!(
        "{{\"type\":\"about:blank\",\"title\":\"{title}\",\"status\":{},\"detail\":{}}}\n",
        status.as_u16(),
        serde_json::Value::from(detail)
    );
    problem(status, Bytes::from(body))
}

fn problem<L>(status: StatusCode, body: Bytes) -> Ours<L> {
    let mut resp = Response::new(Either::Right(Full::new(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, PROBLEM_JSON.clone());
    resp
}
