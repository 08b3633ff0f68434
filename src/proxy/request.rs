//! The request path: what happens to one request between the server side that read it and the
//! response it is answered with. Hygiene, the decision (and its waits), the forward upstream,
//! the refusals and the metrics; and what the requests of one client connection share
//! ([`Conn`]), the [`Handler`] both protocol servers are given.
//!
//! Must never: await while holding a rule-set guard, allocate for a known key's decision, or
//! answer a refused request before its small body was drained (the client must read the 429).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, StatusCode};
use tokio::sync::Semaphore;

use super::body::ReqBody;
use super::protocol::Handler;
use super::response::{self, Reply};
use super::shared::Shared;
use super::{access, connection, deadlines, forward, upstream_pool};
use crate::gate;
use crate::key::RequestView;
use crate::limit::Clock;
use crate::metrics::Outcome;
use crate::respond;

/// What the requests of one client connection share.
pub(super) struct Conn {
    pub(super) shared: Arc<Shared>,
    pub(super) client: Arc<forward::UpstreamClient>,
    /// This connection's own upstream connection (HTTP/1 only).
    pub(super) affine: upstream_pool::ClientUpstream,
    /// Upstream connections its HTTP/2 streams use at once (`limits.max_upstream_per_client`);
    /// made at its first stream. An HTTP/1 connection has one request in flight at a time.
    pub(super) streams: std::sync::OnceLock<Arc<Semaphore>>,
    /// The worker's request deadlines.
    pub(super) timers: Arc<deadlines::Timers>,
    pub(super) abandoned: connection::Abandoned,
    pub(super) peer: SocketAddr,
}

impl Conn {
    /// A place for one of this HTTP/2 connection's streams among `max_upstream_per_client`:
    /// at once, or within `timeouts.upstream_connect`; `Err` with the 503 when none came free.
    /// `Ok(None)` for an `h2c://` upstream, where every stream shares one connection.
    pub(super) async fn stream_slot(
        &self,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Reply> {
        let shared = &self.shared;
        if shared.upstream_h2 {
            return Ok(None);
        }
        let slots = self
            .streams
            .get_or_init(|| Arc::new(Semaphore::new(shared.upstream_per_client)));
        if let Ok(p) = slots.clone().try_acquire_owned() {
            return Ok(Some(p));
        }
        let wait = shared.affine_upstream.connect_timeout;
        if let Ok(Ok(p)) = tokio::time::timeout(wait, slots.clone().acquire_owned()).await {
            return Ok(Some(p));
        }
        Err(forward::failed(
            &shared.metrics,
            crate::metrics::UpstreamError::Saturated,
            &crate::ids::RequestId::made().text(),
        ))
    }
}

impl Handler for Conn {
    fn handle<'a>(
        &'a self,
        req: &'a mut Request<ReqBody>,
    ) -> impl Future<Output = Reply> + Send + 'a {
        handle(self, req)
    }

    fn stream_slot(
        &self,
    ) -> impl Future<Output = Result<Option<tokio::sync::OwnedSemaphorePermit>, Reply>> + Send + '_
    {
        Conn::stream_slot(self)
    }

    fn refused(&self, reason: respond::Reason) {
        self.shared.metrics.refused(reason).inc();
    }

    fn abandoned(&self) {
        // Past the budget the connection is closed: its task is tripped awake to end.
        self.abandoned
            .abandon(self.shared.clock.now() / 1_000_000_000);
    }
}

/// The request path.
/// Borrows `req` (see [`forward::Forward::send`]); what is left of it is the caller's to drop.
pub(super) async fn handle(conn: &Conn, req: &mut Request<ReqBody>) -> Reply {
    let (shared, peer) = (&*conn.shared, conn.peer);
    let start = shared.clock.now();
    let metrics = &shared.metrics;
    // A body on a request whose method gives it no meaning (RFC 9110 §9.3), which many apps
    // never read: left on a kept-alive upstream connection, it would be parsed as a request
    // no rule saw. Forwarded on a connection closed after the answer, or (GET and HEAD,
    // `bodies_on_get: reject`) refused with the other malformed requests.
    // Methods compare without case: an app may fold `get` into GET.
    let (get_body, get_or_head) = match http_body::Body::is_end_stream(req.body()) {
        true => (false, false),
        false => {
            let method = req.method().as_str();
            let is = |m: &http::Method| method.eq_ignore_ascii_case(m.as_str());
            let get_or_head = is(&http::Method::GET) || is(&http::Method::HEAD);
            let other =
                is(&http::Method::DELETE) || is(&http::Method::OPTIONS) || is(&http::Method::TRACE);
            (get_or_head || other, get_or_head)
        }
    };
    let refused = match shared.hygiene.apply(req) {
        Err(refused) => Some(refused),
        Ok(()) if get_or_head && shared.hygiene.reject_get_bodies => Some(BODY_ON_GET),
        Ok(()) => None,
    };
    if let Some(refused) = refused {
        metrics
            .duration(Outcome::Error)
            .observe(elapsed(shared, start));
        metrics.refused(refused.reason).inc();
        // A trusted peer's id, if its head was sound enough to read one.
        let trusted = shared.client_ip.trusts(peer.ip());
        let made = crate::ids::RequestId::made();
        let id =
            crate::ids::RequestId::of(req.headers(), trusted, shared.request_ids.from, made).text();
        let reply = Reply::refused(&refused, &id);
        if let Some(asked) = access::Asked::of(req, refusal_budget(shared), true) {
            let answered = access::Answered {
                status: refused.status,
                decision: "error",
                rule: None,
                id: &id,
                bytes_sent: None,
                seconds: elapsed(shared, start),
            };
            access_line(shared, &asked, (peer, None), &answered);
        }
        return reply;
    }
    let grpc = respond::form(req.method(), req.version(), req.headers());
    // The decision itself is synchronous; `admit` only awaits when a rule delays the request,
    // and never holds the rule snapshot across that wait.
    let trusted = shared.client_ip.trusts(peer.ip());
    if !trusted {
        shared.hygiene.untrusted(req);
    }
    let client = shared.client_ip.who(req.headers(), peer.ip());
    let view = RequestView::for_proxy(
        req,
        client,
        (trusted, shared.hygiene.strict_path),
        shared.request_ids.from,
    );
    let admitted = gate::admit(&shared.rules, &shared.clock, &view).await;
    let id = view.request_id();
    let mut admit = match admitted {
        Ok(admit) => admit,
        Err(refusal) => {
            let id = id.text();
            let outcome = match &refusal {
                gate::Refusal::Limited(_) => Outcome::Rejected,
                gate::Refusal::BadRequest(bad) => {
                    metrics.refused(bad.reason).inc();
                    Outcome::Error
                }
            };
            let seconds = elapsed(shared, start);
            metrics.duration(outcome).observe(seconds);
            let mut resp = match respond::kept(&refusal, grpc, &id) {
                Some(kept) => Reply::kept(kept),
                None => Reply::whole(respond::answer(&refusal, grpc, &id)),
            };
            if let Some(asked) = access::Asked::of(req, refusal_budget(shared), true) {
                let (decision, rule) = match &refusal {
                    gate::Refusal::Limited(d) => ("rejected", d.state.rule()),
                    gate::Refusal::BadRequest(bad) => ("error", &bad.rule),
                };
                let answered = access::Answered {
                    status: resp.head.status(),
                    decision,
                    rule: Some(rule),
                    id: &id,
                    bytes_sent: None,
                    seconds,
                };
                access_line(shared, &asked, (peer, Some(client.keyed)), &answered);
            }
            // Refused before its body was read: read (and drop) a small body so that the
            // connection stays usable and the client reads our answer; a large or slow one
            // closes the connection instead (nginx's lingering close, bounded). A body in
            // hand was read with the head. A client waiting for `100 Continue` is not asked
            // for its body (reading it would send the 100): the refusal is its answer.
            let taken = std::mem::replace(req.body_mut(), forward::emptied());
            let http_body_util::Either::Left(body) = taken else {
                return resp;
            };
            let expects = req.version() != http::Version::HTTP_10
                && req
                    .headers()
                    .get(http::header::EXPECT)
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
            // Boxed: the rare path (a body to read) keeps the common future small.
            if !http_body::Body::is_end_stream(&body) && (expects || !Box::pin(drained(body)).await)
            {
                resp.head.close();
            }
            return resp;
        }
    };

    let asked = access::Asked::of(
        req,
        // Not sure of a line: the budget is asked at the line.
        (&shared.access_log, || 0, &shared.metrics.access_dropped),
        false,
    );
    if shared.request_ids.forward {
        // Ours goes in its place, as the request goes up.
        req.headers_mut().remove(&crate::ids::X_REQUEST_ID);
    }
    let fwd = forward::Forward {
        client: &conn.client,
        upstream: &shared.upstream,
        peer: peer.ip(),
        trust_forwarded: trusted,
        response_timeout: shared.response_timeout,
        upload_timeouts: shared.upload_timeouts,
        timers: &conn.timers,
        metrics,
        affine: (!shared.upstream_h2).then_some((&conn.affine, &shared.affine_upstream)),
        now: start,
        upgrades: &shared.hygiene.upgrades,
        close: get_body,
        id,
        // The app gets the request's id (the one a rule's log line used, an answer of ours
        // would) when `forward` says so, written as the request goes up.
        forward_id: shared.request_ids.forward,
    };
    if admit.charges.reads_body() {
        // A compressed answer could not be read for its usage: ask for none (an
        // absent field would let the app choose any coding).
        req.headers_mut().insert(
            http::header::ACCEPT_ENCODING,
            http::HeaderValue::from_static("identity"),
        );
    }
    let mut resp = fwd.send(req, admit.permits).await;
    // What the response owes rules whose cost is the response's: its head's now, the rest
    // as its body streams (dropped here, the app never answered: charged as cut short).
    if let (false, http_body_util::Either::Left(body)) = (admit.charges.is_empty(), &mut resp.body)
    {
        admit.charges.head(|name| resp.head.field(name));
        body.charge(std::mem::take(&mut admit.charges));
    }
    let outcome = if matches!(resp.body, http_body_util::Either::Left(_)) {
        // A rule's own `upstream_body_idle` (an event stream's) goes with its body.
        if let Some(idle) = admit.body_idle {
            resp.head.extensions_mut().insert(response::BodyIdle(idle));
        }
        metrics.upstream_response(resp.head.status()).inc();
        Outcome::Upstream
    } else {
        Outcome::Error
    };
    // `states` is filled only under `headers: always`; the fields go in the response's map,
    // with the upstream's (which replace any the upstream sent).
    if !admit.states.is_empty() {
        respond::add_rate_headers(resp.head.headers_mut(), &admit.states);
    }
    admit.charges.release();
    release(admit.states);
    let seconds = elapsed(shared, start);
    metrics.duration(outcome).observe(seconds);
    // A forwarded request's line only if sampled: its fields are not read otherwise.
    if let Some(asked) = asked.filter(|a| a.sampled || outcome != Outcome::Upstream) {
        let answered = access::Answered {
            status: resp.head.status(),
            decision: if outcome == Outcome::Upstream {
                "forwarded"
            } else {
                "error"
            },
            rule: None,
            id: &fwd.id.text(),
            bytes_sent: resp.head.field(&http::header::CONTENT_LENGTH),
            seconds,
        };
        access_line(shared, &asked, (peer, Some(client.keyed)), &answered);
    }
    resp
}

/// Drops `held` unless it owns nothing (empty and inline): dropped as such, a list of items
/// that need dropping costs every request a call for nothing.
#[inline(always)]
fn release<A: smallvec::Array>(held: smallvec::SmallVec<A>) {
    if held.is_empty() && !held.spilled() {
        std::mem::forget(held);
    }
}

/// A GET or HEAD with a body, under `bodies_on_get: reject` (what follows on the connection may
/// be as malformed: nginx closes after a 400 too).
const BODY_ON_GET: respond::Refused = respond::Refused::closing(
    StatusCode::BAD_REQUEST,
    respond::Reason::BodyOnGet,
    "a GET or HEAD request must not have a body here",
);

/// A refused request's body is read and dropped up to this many bytes...
pub(super) const DRAIN_BYTES: usize = 256 * 1024;
/// ...within this long.
pub(super) const DRAIN_TIME: Duration = Duration::from_millis(500);

/// Reads and drops `body` if it ends within [`DRAIN_BYTES`] and [`DRAIN_TIME`]; false when it
/// did not (the connection should then close). A body that is already over costs nothing.
pub(super) async fn drained(mut body: forward::Streamed) -> bool {
    use http_body_util::BodyExt;
    let mut read = 0usize;
    let drain = async {
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => {
                    read += f.data_ref().map_or(0, |d| d.len());
                    if read > DRAIN_BYTES {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
        true
    };
    tokio::time::timeout(DRAIN_TIME, drain)
        .await
        .unwrap_or(false)
}

/// Writes `asked`'s access log line, from `peer` keyed as `client`, as `answered` says.
fn access_line(
    shared: &Shared,
    asked: &access::Asked,
    (peer, client): (SocketAddr, Option<std::net::IpAddr>),
    answered: &access::Answered<'_>,
) {
    access::log(access_budget(shared), asked, peer, client, answered);
}

/// The access log, now, and where its dropped lines are counted.
fn access_budget(shared: &Shared) -> (&Option<access::AccessLog>, u64, &prometheus::IntCounter) {
    let now = shared.clock.now();
    (&shared.access_log, now, &shared.metrics.access_dropped)
}

/// [`access_budget`] for a refusal's line, the clock read only if the log is on.
#[allow(clippy::type_complexity)]
fn refusal_budget(
    shared: &Shared,
) -> (
    &Option<access::AccessLog>,
    impl FnOnce() -> u64 + '_,
    &prometheus::IntCounter,
) {
    (
        &shared.access_log,
        || shared.clock.now(),
        &shared.metrics.access_dropped,
    )
}

pub(super) fn elapsed(shared: &Shared, start: u64) -> f64 {
    shared.clock.now().saturating_sub(start) as f64 / 1e9
}
