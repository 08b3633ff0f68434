//! The one place where the proxy answers by itself: 429 and the 4xx/5xx it sends when it
//! cannot or will not forward. Keeping them together keeps headers and bodies consistent.
//!
//! Bodies are short `application/problem+json` documents (RFC 9457) that say what happened;
//! rule names are validated to `[A-Za-z0-9_.-]`, so they need no escaping in JSON or in the
//! structured-field strings of the `RateLimit` headers (draft-ietf-httpapi-ratelimit-headers-11).

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::config::HeaderMode;
use crate::rules::{Denial, RateState};

/// Response bodies: the upstream's, streamed, or a short one of ours.
pub type Body = Either<Incoming, Full<Bytes>>;

pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// 429 for a request a rule refused.
pub fn too_many_requests(denial: &Denial) -> Response<Body> {
    let rule = &denial.state.rule;
    let retry = denial.retry_after_secs();
    let body = match retry {
        Some(secs) => format!(
            "{{\"type\":\"about:blank\",\"title\":\"Too Many Requests\",\"status\":429,\
             \"detail\":\"rate limit of rule {rule} exceeded; retry in {secs} s\",\
             \"rule\":\"{rule}\",\"retry_after\":{secs}}}\n"
        ),
        None => format!(
            "{{\"type\":\"about:blank\",\"title\":\"Too Many Requests\",\"status\":429,\
             \"detail\":\"the cost of this request exceeds the burst of rule {rule}; it can never be admitted\",\
             \"rule\":\"{rule}\"}}\n"
        ),
    };
    let mut resp = problem(StatusCode::TOO_MANY_REQUESTS, body);
    let headers = resp.headers_mut();
    if let Some(secs) = retry {
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    if denial.header_mode != HeaderMode::Never {
        add_rate_headers(headers, std::slice::from_ref(&denial.state));
    }
    resp
}

/// Adds `RateLimit-Policy` and `RateLimit` for `states`, one list member per rule.
pub fn add_rate_headers(headers: &mut HeaderMap, states: &[RateState]) {
    if states.is_empty() {
        return;
    }
    if let [one] = states {
        headers.insert(RATELIMIT_POLICY.clone(), one.policy.clone());
    } else {
        let joined = states
            .iter()
            .map(|s| s.policy.to_str().unwrap_or_default())
            .collect::<Vec<_>>()
            .join(", ");
        if let Ok(v) = HeaderValue::from_str(&joined) {
            headers.insert(RATELIMIT_POLICY.clone(), v);
        }
    }
    let value = states
        .iter()
        .map(|s| format!("\"{}\";r={};t={}", s.rule, s.remaining, s.reset_secs))
        .collect::<Vec<_>>()
        .join(", ");
    if let Ok(v) = HeaderValue::from_str(&value) {
        headers.insert(RATELIMIT.clone(), v);
    }
}

/// A short problem document for errors the proxy itself answers (400, 431, 502, 503, 504).
pub fn error(status: StatusCode, detail: &str) -> Response<Body> {
    let title = status.canonical_reason().unwrap_or("Error");
    let body = format!(
        "{{\"type\":\"about:blank\",\"title\":\"{title}\",\"status\":{},\"detail\":{}}}\n",
        status.as_u16(),
        serde_json::Value::from(detail)
    );
    problem(status, body)
}

fn problem(status: StatusCode, body: String) -> Response<Body> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, PROBLEM_JSON.clone());
    resp
}
