//! The one place where Spillway answers by itself: 429 (or its gRPC form) and the 4xx/5xx it
//! sends when it cannot or will not forward. Keeping them together keeps headers and bodies
//! consistent between the sidecar and the embedded layer.
//!
//! Bodies are short `application/problem+json` documents (RFC 9457) that say what happened;
//! rule names are validated to `[A-Za-z0-9_.-]`, so they need no escaping in JSON or in the
//! structured-field strings of the `RateLimit` headers (draft-ietf-httpapi-ratelimit-headers-11).
//! A limited gRPC call gets what gRPC clients understand: HTTP 200 with `grpc-status: 8`
//! (RESOURCE_EXHAUSTED), a `grpc-message`, and the retry hint as `grpc-retry-pushback-ms`.
//!
//! Cost: a rule's 429 for a retry hint of up to a minute is built once and kept, its header
//! fields both as a map and as the lines of an HTTP/1 head. The sidecar's refused request takes
//! two reference counts and no allocation ([`kept`]); our HTTP/1 side copies the lines into
//! its write, and only hyper's server (HTTP/2) gets the map cloned. The rule keeps them
//! ([`Answers`], `rules`'), this module renders them ([`answers::render`]).

use std::fmt::Write as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full};

use crate::config::HeaderMode;
pub use crate::ids::{IdText, X_REQUEST_ID};
use crate::limit::Permits;
pub use crate::metrics::{Reason, UpstreamError};
use crate::rules::{Charges, Denial, RateState, Refusal};

pub mod answers;

use answers::{ratelimit_value, render, write_detail, Answer, PROBLEM_JSON};
pub use answers::{Answers, RATELIMIT, RATELIMIT_POLICY};

/// A response of ours, for whatever the other body type is: `R` is `Full<Bytes>` for the
/// embedded layer, and the sidecar's own.
type Ours<L, R> = Response<Either<L, R>>;

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
static GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// The form of an answer of ours: a problem document, or the status a gRPC client reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    Http,
    /// gRPC over HTTP/2.
    Grpc,
    /// gRPC-Web (any version), with the content type to answer in.
    GrpcWeb(&'static str),
}

/// The form a request is answered in: gRPC only for a `POST` of `application/grpc` over
/// HTTP/2 or of `application/grpc-web*` over any version. Anything else saying gRPC (a GET, a
/// plain HTTP/1.1 request) gets HTTP's answer: a `200` to it is a success to a cache.
#[inline]
pub fn form(method: &http::Method, version: http::Version, headers: &HeaderMap) -> Form {
    if method != http::Method::POST {
        return Form::Http;
    }
    let Some(ct) = headers.get(CONTENT_TYPE) else {
        return Form::Http;
    };
    // The media type without its parameters (`; charset=...`).
    let ct = ct.as_bytes();
    let ct = ct
        .split(|&b| b == b';')
        .next()
        .unwrap_or(ct)
        .trim_ascii_end();
    if let Some(rest) = strip_prefix_ignore_case(ct, b"application/grpc-web") {
        let (text, rest) = match strip_prefix_ignore_case(rest, b"-text") {
            Some(after) => (true, after),
            None => (false, rest),
        };
        // `application/grpc-web`, `-text`, and either with a `+format`; not `grpc-webx`.
        if !(rest.is_empty() || rest.starts_with(b"+")) {
            return Form::Http;
        }
        let proto = rest.eq_ignore_ascii_case(b"+proto");
        return Form::GrpcWeb(match (text, proto) {
            (true, true) => "application/grpc-web-text+proto",
            (true, false) => "application/grpc-web-text",
            (false, true) => "application/grpc-web+proto",
            (false, false) => "application/grpc-web",
        });
    }
    match strip_prefix_ignore_case(ct, b"application/grpc") {
        Some(rest)
            if version == http::Version::HTTP_2 && matches!(rest.first(), None | Some(b'+')) =>
        {
            Form::Grpc
        }
        _ => Form::Http,
    }
}

fn strip_prefix_ignore_case<'a>(s: &'a [u8], prefix: &[u8]) -> Option<&'a [u8]> {
    (s.len() >= prefix.len() && s[..prefix.len()].eq_ignore_ascii_case(prefix))
        .then(|| &s[prefix.len()..])
}

/// `Cache-Control` of every answer of ours: a refusal or an error is about this request now,
/// never a page for a cache to serve.
pub(crate) static NO_STORE: HeaderValue = HeaderValue::from_static("no-store");

/// The answer to a refused request, in its response's map (the tower layer's, and the sidecar's
/// when the rule keeps none: see [`kept`]).
pub fn answer<L, R: From<Full<Bytes>>>(refusal: &Refusal, grpc: Form, id: &IdText) -> Ours<L, R> {
    match refusal {
        Refusal::Limited(denial) => too_many_requests(denial, grpc, id),
        Refusal::BadRequest(bad) => Refused::from(bad).response(id),
    }
}

/// 429 (or gRPC RESOURCE_EXHAUSTED) for a request a rule refused.
///
/// The body and the `Retry-After` and `RateLimit` values of a 429 depend only on the rule and
/// the retry hint in whole seconds, so they come from the rule's [`Answers`]: shared bytes,
/// built on a rule's first refusal with that hint (nginx answers `limit_req` with a static
/// page; this is as close as we get while saying which rule and when).
pub fn too_many_requests<L, R: From<Full<Bytes>>>(
    denial: &Denial,
    grpc: Form,
    id: &IdText,
) -> Ours<L, R> {
    if denial.capacity {
        return reduced_capacity(denial, grpc, id);
    }
    let rule = denial.state.rule();
    let retry = denial.retry_after_secs();
    if grpc != Form::Http {
        return grpc_exhausted(denial, rule, retry, grpc, id);
    }
    // A denial's state is `r=0;t=<retry, or 0 for never>` (rules.rs), which is what the
    // cached `RateLimit` value says.
    debug_assert_eq!(
        (denial.state.remaining, denial.state.reset_secs),
        (0, retry.unwrap_or(0))
    );
    let built;
    let answer = match denial.answers.get(retry, render) {
        Some(kept) => &**kept,
        None => {
            built = denial.answers.render(retry, render);
            &built
        }
    };
    // The policy is the rule's, the one its answers are built with.
    debug_assert_eq!(
        answer.headers.get(&RATELIMIT_POLICY),
        Some(denial.state.policy())
    );
    let body = with_id(&answer.body, id);
    let mut resp = Response::new(Either::Right(Full::new(body).into()));
    *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    *resp.headers_mut() = fields(answer, denial.header_mode != HeaderMode::Never);
    resp.headers_mut()
        .insert(X_REQUEST_ID.clone(), id.header_value());
    resp
}

/// `doc` (a problem document, ending `}` and a newline) with the request's id as its last
/// member, `"request_id"`. Written into this thread's room for answers, whose space the
/// next answers reuse once this one is sent.
pub fn with_id(doc: &Bytes, id: &IdText) -> Bytes {
    /// The room a thread's answers are written in, at least.
    const ROOM: usize = 4096;
    thread_local! {
        static ANSWERS: std::cell::RefCell<BytesMut> = std::cell::RefCell::new(BytesMut::new());
    }
    let Some(open) = open_document(doc) else {
        return doc.clone();
    };
    ANSWERS.with(|room| {
        let Ok(mut room) = room.try_borrow_mut() else {
            return doc.clone();
        };
        let len = open.len() + id_member_len(id);
        if room.capacity() < len {
            // Taken back in place once every answer written in it was sent.
            room.reserve(ROOM.max(len));
        }
        room.put_slice(open);
        put_id_member(&mut *room, id);
        room.split().freeze()
    })
}

/// A problem document without its closing `}` and newline, for its id to follow.
pub fn open_document(doc: &[u8]) -> Option<&[u8]> {
    doc.strip_suffix(b"}\n")
}

const ID_MEMBER: &[u8] = b",\"request_id\":\"";

/// The bytes [`put_id_member`] writes.
pub fn id_member_len(id: &IdText) -> usize {
    ID_MEMBER.len() + id.as_bytes().len() + 3
}

/// Closes an open problem document ([`open_document`]) with the request's id.
pub fn put_id_member(out: &mut impl BufMut, id: &IdText) {
    out.put_slice(ID_MEMBER);
    out.put_slice(id.as_bytes());
    out.put_slice(b"\"}\n");
}

/// A 429's header fields in a map, with the `RateLimit` ones when `rate` (any `headers` mode but
/// `never`): one copy of the answer's map, cheaper than inserting the fields one by one.
fn fields(answer: &Answer, rate: bool) -> HeaderMap {
    let mut headers = answer.headers.clone();
    if !rate {
        headers.remove(&RATELIMIT);
        headers.remove(&RATELIMIT_POLICY);
    }
    headers
}

/// The 429 a rule keeps for `refusal`, when it keeps one (a plain HTTP request, a retry hint of
/// up to a minute): the sidecar answers with its fields as they are kept, no map cloned, walked
/// and dropped per refusal (`proxy::response`'s head holds them unread). `None`: [`answer`].
pub fn kept(refusal: &Refusal, grpc: Form, id: &IdText) -> Option<Kept> {
    let Refusal::Limited(denial) = refusal else {
        return None;
    };
    if grpc != Form::Http || denial.capacity {
        return None;
    }
    let answer = denial.answers.get(denial.retry_after_secs(), render)?;
    Some(Kept {
        answer: answer.clone(),
        rate: denial.header_mode != HeaderMode::Never,
        id: *id,
    })
}

/// A 429 kept by its rule: its header fields (as lines of an HTTP/1 head, and as a map) and
/// its body.
#[derive(Clone)]
pub struct Kept {
    answer: Arc<Answer>,
    /// With the `RateLimit` headers (any `headers` mode but `never`).
    rate: bool,
    /// The request's id, in its own field and in the document.
    id: IdText,
}

impl Kept {
    /// The response's header fields as lines of an HTTP/1 head (no `Content-Length`).
    pub fn fields(&self) -> &[u8] {
        let fields = &self.answer.fields;
        &fields[..if self.rate {
            fields.len()
        } else {
            self.answer.rate_at
        }]
    }

    /// The request's id: an `x-request-id` field after [`Self::fields`].
    pub fn id(&self) -> &IdText {
        &self.id
    }

    /// The same fields in a map, the id's too.
    pub fn map(&self) -> HeaderMap {
        let mut map = fields(&self.answer, self.rate);
        map.insert(X_REQUEST_ID.clone(), self.id.header_value());
        map
    }

    /// The problem document, with the request's id.
    pub fn body(&self) -> Bytes {
        with_id(&self.answer.body, &self.id)
    }

    /// The problem document without its end, which [`put_id_member`] writes: for a server
    /// that writes the document itself (ours), with no copy of it made first.
    pub fn open_body(&self) -> &[u8] {
        open_document(&self.answer.body).unwrap_or(&self.answer.body)
    }
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept")
            .field("fields", &String::from_utf8_lossy(self.fields()))
            .finish()
    }
}

/// A limited gRPC call: HTTP 200 with `grpc-status: 8`.
fn grpc_exhausted<L, R: From<Full<Bytes>>>(
    denial: &Denial,
    rule: &str,
    retry: Option<u64>,
    form: Form,
    id: &IdText,
) -> Ours<L, R> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::new()).into()));
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, grpc_type(form));
    h.insert(CACHE_CONTROL, NO_STORE.clone());
    h.insert(X_REQUEST_ID.clone(), id.header_value());
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
    if let Some(secs) = retry {
        h.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    if denial.header_mode != HeaderMode::Never {
        add_rate_headers(h, std::slice::from_ref(&denial.state));
    }
    resp
}

/// The content type of a gRPC answer in `form`.
fn grpc_type(form: Form) -> HeaderValue {
    HeaderValue::from_static(match form {
        Form::GrpcWeb(ct) => ct,
        _ => "application/grpc",
    })
}

/// The problem type of draft-ietf-httpapi-ratelimit-headers for capacity, not quota.
const REDUCED_CAPACITY: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// 503 with `Retry-After` for a request an adaptive limit refused: the upstream is at the
/// concurrency its latency allows now. No `RateLimit` headers: this is not the client's quota.
fn reduced_capacity<L, R: From<Full<Bytes>>>(
    denial: &Denial,
    grpc: Form,
    id: &IdText,
) -> Ours<L, R> {
    let rule = denial.state.rule();
    let secs = denial.retry_after_secs().unwrap_or(1);
    let mut resp = if grpc != Form::Http {
        // UNAVAILABLE: gRPC clients retry it with back-off.
        let mut resp = Response::new(Either::Right(Full::new(Bytes::new()).into()));
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, grpc_type(grpc));
        h.insert(CACHE_CONTROL, NO_STORE.clone());
        h.insert(GRPC_STATUS.clone(), HeaderValue::from_static("14"));
        resp
    } else {
        let mut body = BytesMut::with_capacity(256);
        let _ = writeln!(
            body,
            "{{\"type\":\"{REDUCED_CAPACITY}\",\"title\":\"Temporary Reduced Capacity\",\"status\":503,\
             \"detail\":\"the upstream is at the concurrency rule {rule} allows for its latency now; retry in {secs} s\",\
             \"rule\":\"{rule}\",\"retry_after\":{secs},\"request_id\":\"{id}\"}}"
        );
        problem(StatusCode::SERVICE_UNAVAILABLE, body.freeze())
    };
    resp.headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(secs));
    resp.headers_mut()
        .insert(X_REQUEST_ID.clone(), id.header_value());
    resp
}

/// Adds `RateLimit-Policy` and `RateLimit` for `states`, one list member per rule.
pub fn add_rate_headers(headers: &mut HeaderMap, states: &[RateState]) {
    if states.is_empty() {
        return;
    }
    if let [one] = states {
        headers.insert(RATELIMIT_POLICY.clone(), one.policy().clone());
    } else {
        let mut joined = BytesMut::with_capacity(64 * states.len());
        for (i, s) in states.iter().enumerate() {
            if i > 0 {
                joined.put_slice(b", ");
            }
            joined.put_slice(s.policy().as_bytes());
        }
        if let Ok(v) = HeaderValue::from_maybe_shared(joined.freeze()) {
            headers.insert(RATELIMIT_POLICY.clone(), v);
        }
    }
    let value = ratelimit_value(
        states
            .iter()
            .map(|s| (&**s.rule(), s.remaining, s.reset_secs)),
    );
    headers.insert(RATELIMIT.clone(), value);
}

/// A request Spillway answers itself, not for a limit (those are [`Denial`]s): refused by the
/// request hygiene, the HTTP/1 head parser, a rule (its key or cost), for a malformed or
/// stalled body, or not answered by the upstream. The status, the reason it is counted by
/// (`spillway_bad_requests_total{reason}`, or `spillway_upstream_errors_total{kind}` for the
/// upstream's), a detail for the client, and whether the connection closes after the answer
/// (what follows on it cannot be trusted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub status: StatusCode,
    pub reason: Reason,
    pub detail: std::borrow::Cow<'static, str>,
    pub close: bool,
    /// The rule that could not decide the request (a rule's bad request), named in the answer.
    pub rule: Option<Arc<str>>,
}

/// A rule's bad request (a repeated key field, a malformed cost): 400, naming the rule; the
/// connection goes on (the request path closes it when the body cannot be drained).
impl From<&crate::rules::BadRequest> for Refused {
    fn from(bad: &crate::rules::BadRequest) -> Self {
        Refused {
            status: StatusCode::BAD_REQUEST,
            reason: bad.reason,
            detail: std::borrow::Cow::Owned(bad.detail.clone()),
            close: false,
            rule: Some(bad.rule.clone()),
        }
    }
}

impl Refused {
    /// Answered with `status`; the connection goes on.
    pub const fn new(status: StatusCode, reason: Reason, detail: &'static str) -> Self {
        Refused {
            status,
            reason,
            detail: std::borrow::Cow::Borrowed(detail),
            close: false,
            rule: None,
        }
    }

    /// Answered with `status`, and the connection closes after the answer.
    pub const fn closing(status: StatusCode, reason: Reason, detail: &'static str) -> Self {
        let mut refused = Refused::new(status, reason, detail);
        refused.close = true;
        refused
    }

    /// The answer to a request the upstream did not answer.
    pub const fn upstream(kind: UpstreamError) -> Self {
        let (status, detail) = match kind {
            UpstreamError::Connect => (StatusCode::BAD_GATEWAY, "upstream refused the connection"),
            UpstreamError::ConnectTimeout => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream did not accept the connection in time",
            ),
            UpstreamError::ResponseTimeout => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream did not respond in time",
            ),
            UpstreamError::Protocol => (
                StatusCode::BAD_GATEWAY,
                "upstream closed the connection or sent an invalid response",
            ),
            UpstreamError::Saturated => (
                StatusCode::SERVICE_UNAVAILABLE,
                "no upstream connection came free in time",
            ),
            // Its head is sent by then; a status is only for completeness.
            UpstreamError::BodyIdle => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream stopped sending the response body",
            ),
            UpstreamError::UploadStalled => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream stopped taking the request body",
            ),
        };
        Refused::new(status, Reason::Upstream(kind), detail)
    }

    /// With a detail worked out for this request.
    pub fn saying(mut self, detail: String) -> Self {
        self.detail = std::borrow::Cow::Owned(detail);
        self
    }

    /// The answer: [`Refused::answer`], with `Connection: close` when the connection closes
    /// (the embedded layer's; the sidecar keeps the connection's fate in its response's head).
    pub fn response<L, R: From<Full<Bytes>>>(&self, id: &IdText) -> Ours<L, R> {
        let mut resp = self.answer(id);
        if self.close {
            resp.headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }

    /// The answer, the connection's fate aside: a problem document (naming the rule, if one),
    /// with `Retry-After: 1` when no upstream connection came free.
    pub fn answer<L, R: From<Full<Bytes>>>(&self, id: &IdText) -> Ours<L, R> {
        let doc = document(self.status, &self.detail, self.rule.as_deref(), id);
        let mut resp = problem(self.status, doc);
        resp.headers_mut()
            .insert(X_REQUEST_ID.clone(), id.header_value());
        if self.reason == Reason::Upstream(UpstreamError::Saturated) {
            resp.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// A short problem document for errors Spillway answers itself (400, 431, 502, 503, 504).
pub fn error<L, R: From<Full<Bytes>>>(status: StatusCode, detail: &str, id: &IdText) -> Ours<L, R> {
    let mut resp = problem(status, document(status, detail, None, id));
    resp.headers_mut()
        .insert(X_REQUEST_ID.clone(), id.header_value());
    resp
}

/// The problem document of an error of ours, naming the rule when one could not decide.
fn document(status: StatusCode, detail: &str, rule: Option<&str>, id: &IdText) -> Bytes {
    let title = status.canonical_reason().unwrap_or("Error");
    let mut body = format!(
        "{{\"type\":\"about:blank\",\"title\":\"{title}\",\"status\":{},\"detail\":{}",
        status.as_u16(),
        serde_json::Value::from(detail)
    );
    if let Some(rule) = rule {
        let _ = write!(body, ",\"rule\":{}", serde_json::Value::from(rule));
    }
    // An id is visible ASCII without quotes or backslashes: no escaping.
    let _ = writeln!(body, ",\"request_id\":\"{id}\"}}");
    Bytes::from(body)
}

fn problem<L, R: From<Full<Bytes>>>(status: StatusCode, body: Bytes) -> Ours<L, R> {
    let mut resp = Response::new(Either::Right(Full::new(body).into()));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, PROBLEM_JSON.clone());
    h.insert(CACHE_CONTROL, NO_STORE.clone());
    resp
}

/// A response body that holds concurrency slots until it ends or is dropped, and settles what
/// the response owes the rules whose cost is the response's ([`Charges`]) as it streams: its
/// bytes, its trailers, and at its end (or its drop, cut short) what was never said.
#[derive(Debug)]
pub struct PermitBody<B> {
    inner: B,
    permits: Permits,
    /// Boxed: most bodies carry none, and every body is moved a few times.
    charges: Option<Box<Charges>>,
}

impl<B> PermitBody<B> {
    pub fn new(inner: B, permits: Permits) -> Self {
        Self {
            inner,
            permits,
            charges: None,
        }
    }

    /// Hands the body the charges still open once its head was read (see
    /// [`Charges::pending`]).
    pub fn charge(&mut self, charges: Charges) {
        self.charges = charges.pending().then(|| Box::new(charges));
    }

    pub fn inner(&self) -> &B {
        &self.inner
    }

    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }
}

impl<B: Body + Unpin> Body for PermitBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let end = matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream();
        if let Some(charges) = &mut self.charges {
            match &polled {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        // Every chunk of the frame's data, read in place.
                        let mut chunks = [std::io::IoSlice::new(&[]); 16];
                        let n = bytes::Buf::chunks_vectored(data, &mut chunks);
                        for chunk in &chunks[..n] {
                            charges.data(chunk);
                        }
                    } else if let Some(trailers) = frame.trailers_ref() {
                        charges.trailers(trailers);
                    }
                }
                // The body broke off: what it owes settles as cut short.
                Poll::Ready(Some(Err(_))) => charges.end(false),
                _ => {}
            }
            if end {
                charges.end(true);
            }
        }
        // Free the slots as soon as the body is over, before its last bytes reach the client:
        // hyper may never poll a body of known length again, and a client that saw the end
        // must be able to use the slot it just gave back.
        if end {
            self.permits.clear();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The id the tests' answers are for.
    fn rid() -> IdText {
        IdText::from_bytes(b"test-id-1").unwrap()
    }
    use crate::config::HeaderMode;
    use crate::rules::RateState;

    fn policy() -> HeaderValue {
        HeaderValue::from_static("\"per-ip\";q=10;w=1")
    }

    fn denial(answers: &Arc<Answers>, retry_secs: Option<u64>) -> Denial {
        Denial {
            state: RateState {
                answers: answers.clone(),
                remaining: 0,
                reset_secs: retry_secs.unwrap_or(0),
            },
            // Just under the whole second, as a limiter's hint usually is.
            retry_after: retry_secs.map(|s| s * 1_000_000_000 - 1),
            header_mode: HeaderMode::OnReject,
            delay: None,
            capacity: false,
            answers: answers.clone(),
        }
    }

    async fn parts(resp: Ours<(), Full<Bytes>>) -> (StatusCode, HeaderMap, Bytes) {
        let (parts, body) = resp.into_parts();
        let Either::Right(full) = body else {
            panic!("a 429 has a body of ours")
        };
        let bytes = http_body_util::BodyExt::collect(full)
            .await
            .unwrap()
            .to_bytes();
        (parts.status, parts.headers, bytes)
    }

    #[tokio::test]
    async fn a_429_says_the_rule_and_its_retry_hint_whether_cached_or_not() {
        let answers = Arc::new(Answers::new(Arc::from("per-ip"), policy()));
        // 3 s is kept, 61 s and "never" are formatted per refusal: all must read the same way.
        for secs in [Some(3), Some(3), Some(61), None] {
            let (status, headers, body) = parts(too_many_requests(
                &denial(&answers, secs),
                Form::Http,
                &rid(),
            ))
            .await;
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(
                headers
                    .get(RETRY_AFTER)
                    .map(|v| v.to_str().unwrap().to_owned()),
                secs.map(|s| s.to_string())
            );
            let t = secs.unwrap_or(0);
            assert_eq!(
                headers[&RATELIMIT],
                format!("\"per-ip\";r=0;t={t}").as_str()
            );
            assert_eq!(headers[&RATELIMIT_POLICY], "\"per-ip\";q=10;w=1");
            assert_eq!(headers[CONTENT_TYPE], "application/problem+json");
            let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(doc["status"], 429);
            assert_eq!(doc["rule"], "per-ip");
            assert_eq!(
                doc["retry_after"],
                secs.map_or(serde_json::Value::Null, Into::into)
            );
            let detail = doc["detail"].as_str().unwrap();
            match secs {
                Some(s) => assert!(detail.ends_with(&format!("retry in {s} s")), "{detail}"),
                None => assert!(detail.contains("can never be admitted"), "{detail}"),
            }
        }
        let cached = format!("{answers:?}");
        assert!(
            cached.contains("kept: 1"),
            "only the 3 s hint is kept: {cached}"
        );
    }

    #[tokio::test]
    async fn every_refusal_of_ours_is_one_value_rendered_here() {
        // A rule's bad request: 400 naming the rule, the connection kept.
        let bad = crate::rules::BadRequest {
            rule: Arc::from("per-key"),
            reason: Reason::RepeatedKey,
            detail: "sent \"twice\"".to_string(),
        };
        let (status, headers, body) = parts(answer(
            &Refusal::BadRequest(bad.clone()),
            Form::Http,
            &rid(),
        ))
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(!headers.contains_key(http::header::CONNECTION));
        assert_eq!(
            body,
            "{\"type\":\"about:blank\",\"title\":\"Bad Request\",\"status\":400,\
             \"detail\":\"sent \\\"twice\\\"\",\"rule\":\"per-key\",\"request_id\":\"test-id-1\"}\n"
        );
        assert_eq!(headers["x-request-id"], "test-id-1");
        assert_eq!(Refused::from(&bad).reason, Reason::RepeatedKey);
        // The hygiene's and the head parser's: their status, and a close when asked.
        let closing = Refused::closing(StatusCode::BAD_REQUEST, Reason::Host, "no host");
        let (status, headers, body) = parts(closing.response(&rid())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(headers[http::header::CONNECTION], "close");
        let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            (doc["detail"].as_str(), doc.get("rule")),
            (Some("no host"), None)
        );
        let kept = Refused::new(
            StatusCode::MISDIRECTED_REQUEST,
            Reason::Misdirected,
            "elsewhere",
        )
        .saying("not here".into());
        let (status, headers, body) = parts(kept.response(&rid())).await;
        assert_eq!(status, StatusCode::MISDIRECTED_REQUEST);
        assert!(!headers.contains_key(http::header::CONNECTION));
        let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(doc["detail"], "not here");
    }

    /// The lines of an HTTP/1 head for `headers`, in their order.
    fn lines(headers: &HeaderMap) -> String {
        headers
            .iter()
            .map(|(n, v)| format!("{n}: {}\r\n", v.to_str().unwrap()))
            .collect()
    }

    #[tokio::test]
    async fn a_kept_429_has_the_same_fields_and_body_as_one_built_with_its_map() {
        let answers = Arc::new(Answers::new(Arc::from("per-ip"), policy()));
        for mode in [HeaderMode::OnReject, HeaderMode::Always, HeaderMode::Never] {
            let mut d = denial(&answers, Some(7));
            d.header_mode = mode;
            let (status, headers, body) = parts(too_many_requests(&d, Form::Http, &rid())).await;
            let refusal = Refusal::Limited(d);
            let kept = super::kept(&refusal, Form::Http, &rid()).expect("a 7 s hint is kept");
            // The id is written after the kept lines, from the request.
            let id_line = "x-request-id: test-id-1\r\n";
            let fields = String::from_utf8_lossy(kept.fields()) + id_line;
            assert_eq!(fields, lines(&headers));
            assert_eq!(kept.map(), headers, "{mode:?}");
            assert_eq!(kept.body(), body);
            let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(doc["request_id"], "test-id-1");
            assert_eq!(doc["rule"], "per-ip");
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        }
    }

    #[test]
    fn only_a_grpc_call_is_answered_in_grpcs_form() {
        let form = |method: &str, version, ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            super::form(&method.parse().unwrap(), version, &h)
        };
        let (h1, h2) = (http::Version::HTTP_11, http::Version::HTTP_2);
        assert_eq!(form("POST", h2, "application/grpc"), Form::Grpc);
        assert_eq!(form("POST", h2, "application/grpc+proto; x=y"), Form::Grpc);
        assert_eq!(form("POST", h1, "application/grpc"), Form::Http);
        assert_eq!(form("GET", h2, "application/grpc"), Form::Http);
        assert_eq!(form("POST", h2, "application/grpcx"), Form::Http);
        for (ct, answered) in [
            ("application/grpc-web", "application/grpc-web"),
            ("application/grpc-web+proto", "application/grpc-web+proto"),
            (
                "application/grpc-web+proto; charset=x",
                "application/grpc-web+proto",
            ),
            ("application/grpc-web-text", "application/grpc-web-text"),
            (
                "Application/gRPC-Web-Text+Proto",
                "application/grpc-web-text+proto",
            ),
            ("application/grpc-web+json", "application/grpc-web"),
        ] {
            assert_eq!(form("POST", h1, ct), Form::GrpcWeb(answered), "{ct}");
        }
        assert_eq!(form("POST", h1, "application/grpc-webx"), Form::Http);
        assert_eq!(form("POST", h1, "application/grpc-web-textual"), Form::Http);
    }

    #[test]
    fn a_429_is_kept_only_for_plain_http_and_a_hint_of_up_to_a_minute() {
        let answers = Arc::new(Answers::new(Arc::from("per-ip"), policy()));
        // A hint over a minute, "never", and gRPC are built per refusal.
        for (secs, grpc) in [
            (Some(61), Form::Http),
            (None, Form::Http),
            (Some(7), Form::Grpc),
        ] {
            let refusal = Refusal::Limited(denial(&answers, secs));
            assert!(kept(&refusal, grpc, &rid()).is_none(), "{secs:?} {grpc:?}");
            let resp = answer::<(), Full<Bytes>>(&refusal, grpc, &rid());
            assert!(resp.headers().contains_key(RETRY_AFTER) || secs.is_none());
        }
        assert!(kept(
            &Refusal::Limited(denial(&answers, Some(7))),
            Form::Http,
            &rid()
        )
        .is_some());
    }

    #[test]
    fn a_kept_429s_fields_are_read_and_mapped_through_its_head_and_one_added_stays() {
        use crate::proxy::response::{Lines, Reply};
        let answers = Arc::new(Answers::new(Arc::from("per-ip"), policy()));
        let kept = kept(
            &Refusal::Limited(denial(&answers, Some(7))),
            Form::Http,
            &rid(),
        )
        .unwrap();
        let mut reply = Reply::kept(kept.clone());
        assert_eq!(reply.head.status(), StatusCode::TOO_MANY_REQUESTS);
        // Read where they are, without mapping them.
        assert_eq!(reply.head.field(&RETRY_AFTER), Some(&b"7"[..]));
        assert_eq!(reply.head.field(&CACHE_CONTROL), Some(&b"no-store"[..]));
        assert_eq!(reply.head.field(&http::header::ETAG), None);
        let (map, lines) = reply.head.written();
        assert!(map.is_empty(), "no map for a kept 429");
        assert!(matches!(lines, Some(Lines::Kept(f, _)) if f == kept.fields()));
        // The connection's fate is not a field.
        reply.head.close();
        assert!(reply.head.closes());
        // Changing the map maps the lines first, and once.
        reply
            .head
            .headers_mut()
            .insert(http::header::ETAG, HeaderValue::from_static("\"x\""));
        let (map, lines) = reply.head.written();
        assert!(lines.is_none(), "all in the map now");
        assert_eq!(map[RETRY_AFTER], "7");
        assert_eq!(map.len(), kept.map().len() + 1);
        assert!(!map.contains_key(http::header::CONNECTION));
        assert_eq!(reply.head.field(&http::header::ETAG), Some(&b"\"x\""[..]));
        let resp = reply.into_http();
        assert_eq!(resp.headers().len(), kept.map().len() + 1);
        assert!(!resp.headers().contains_key(http::header::CONNECTION));
    }

    #[test]
    fn an_upstream_failure_is_a_refusal_counted_by_its_kind() {
        for kind in UpstreamError::ALL {
            let refused = Refused::upstream(kind);
            assert_eq!(refused.reason.label(), kind.label());
            assert!(!refused.close, "{kind:?}: the client connection goes on");
            let resp = refused.response::<(), Full<Bytes>>(&rid());
            assert!(resp.status().is_server_error(), "{kind:?}");
            let retry = resp.headers().get(RETRY_AFTER);
            assert_eq!(
                retry.is_some(),
                kind == UpstreamError::Saturated,
                "{kind:?}"
            );
        }
    }

    #[test]
    fn a_refusal_that_closes_the_connection_says_so_in_its_heads_fate_not_a_field() {
        use crate::proxy::response::Reply;
        let closing = Refused::closing(StatusCode::BAD_REQUEST, Reason::Host, "no host");
        let reply = Reply::refused(&closing, &rid());
        assert!(reply.head.closes());
        assert!(reply.head.field(&http::header::CONNECTION).is_none());
        let kept = Refused::new(StatusCode::MISDIRECTED_REQUEST, Reason::Misdirected, "x");
        assert!(!Reply::refused(&kept, &rid()).head.closes());
        // Any `Connection` value naming the token, in any case.
        let mut listed = kept.response(&rid());
        listed
            .headers_mut()
            .append(http::header::CONNECTION, HeaderValue::from_static("x-a"));
        listed.headers_mut().append(
            http::header::CONNECTION,
            HeaderValue::from_static("Upgrade, Close"),
        );
        let reply = Reply::whole(listed);
        assert!(reply.head.closes());
        assert!(reply.head.field(&http::header::CONNECTION).is_none());
    }

    #[tokio::test]
    async fn header_mode_never_leaves_out_the_ratelimit_headers_but_not_retry_after() {
        let answers = Arc::new(Answers::new(Arc::from("per-ip"), policy()));
        let mut d = denial(&answers, Some(1));
        d.header_mode = HeaderMode::Never;
        let (_, headers, _) = parts(too_many_requests(&d, Form::Http, &rid())).await;
        assert_eq!(headers[RETRY_AFTER], "1");
        assert!(!headers.contains_key(&RATELIMIT));
        assert!(!headers.contains_key(&RATELIMIT_POLICY));
    }
}
