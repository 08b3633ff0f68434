//! Forwarding to the upstream: header rewriting, the pooled client, upgrades, error mapping.
//!
//! Owns what a reverse proxy must do to a request and a response in transit (RFC 9110 §7.6:
//! hop-by-hop headers, `X-Forwarded-*`), the mapping of upstream failures to 502/504, and the
//! splice of upgraded connections (WebSocket). Bodies are never buffered whole, except a small
//! client body (up to `inbound::IN_HAND`, with one `Content-Length`) that is all there when the
//! request goes on: it is written with the head. Otherwise the client's body is streamed
//! upstream as it comes, and the upstream's body (hyper's `Incoming` from the pooled
//! client, or `h1::RawBody` from the client connection's own upstream connection) is streamed
//! back as it comes.

use std::error::Error as _;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body as _, Frame};
use http_body_util::Either;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use smallvec::SmallVec;

use super::affine::{Affine, Cap, Upstream};
use super::coarse::{timeout, Sleep, Timers};
use super::respond::{self, Body};
use crate::config::UpgradeProtocol;
use crate::gate::PermitBody;
use crate::limit::Permit;
use crate::metrics::{Metrics, UpstreamError};

pub type UpstreamClient = Client<Capped, ReqBody>;

/// A client request's body: hyper's, or one read whole before it goes on (by our own HTTP/1
/// server side, `inbound`, with its head; or a small one of hyper's that was all there).
pub type ReqBody = Either<Streamed, InHand>;

/// hyper's body of a request, behind the frames of it already read (see [`in_hand`]).
#[derive(Debug)]
pub struct Streamed {
    /// Boxed: rarely any, and every request (kept in its connection's slot) would carry the room.
    ahead: Option<Box<Ahead>>,
    rest: Incoming,
}

/// The frames of a body read before the body went on, in order; and who is told when the body
/// has been read to its end.
#[derive(Debug, Default)]
struct Ahead {
    frames: std::collections::VecDeque<Frame<Bytes>>,
    ended: Option<Arc<Ended>>,
}

/// Set once a body has been read to its end: how `inbound` knows that hyper's server has read
/// the whole of a request it served, and may give its connection back.
#[derive(Debug, Default)]
pub struct Ended(std::sync::atomic::AtomicBool);

impl Ended {
    pub fn set(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Streamed {
    pub fn new(rest: Incoming) -> Self {
        Self { ahead: None, rest }
    }

    /// A body that sets `ended` once it has been read to its end.
    pub fn watched(rest: Incoming, ended: Arc<Ended>) -> Self {
        let ahead = Ahead {
            frames: Default::default(),
            ended: Some(ended),
        };
        Self {
            ahead: Some(Box::new(ahead)),
            rest,
        }
    }

    /// Tells whoever watches this body that hyper's part of it is over, when `over`.
    fn over(&self, over: bool) -> bool {
        if over {
            if let Some(ended) = self.ahead.as_ref().and_then(|a| a.ended.as_ref()) {
                ended.set();
            }
        }
        over
    }
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(frame) = self
            .ahead
            .as_mut()
            .and_then(|ahead| ahead.frames.pop_front())
        {
            return std::task::Poll::Ready(Some(Ok(frame)));
        }
        let polled = std::pin::Pin::new(&mut self.rest).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(None) => self.over(true),
            std::task::Poll::Ready(Some(Ok(_))) => self.over(self.rest.is_end_stream()),
            _ => false,
        };
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ahead
            .as_ref()
            .is_none_or(|ahead| ahead.frames.is_empty())
            && self.over(self.rest.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let ahead = self.ahead.iter().flat_map(|ahead| ahead.frames.iter());
        let ahead: u64 = ahead
            .filter_map(|f| f.data_ref())
            .map(|d| d.len() as u64)
            .sum();
        let rest = self.rest.size_hint();
        let mut hint = http_body::SizeHint::new();
        hint.set_lower(rest.lower() + ahead);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + ahead);
        }
        hint
    }
}

/// Reads what of hyper's `body` is there already, without waiting; the whole body when that
/// was all of it and it is `length` bytes of data. Otherwise what was read stays ahead of the
/// rest, for the pooled client to stream. An error is the client's (a malformed or cut body).
/// Called once per request, before anything else reads the body.
async fn in_hand(body: &mut Streamed, length: usize) -> Result<Option<Bytes>, hyper::Error> {
    // Most small bodies are one frame: no allocation for it.
    let mut frames: SmallVec<[Frame<Bytes>; 1]> = SmallVec::new();
    let whole = std::future::poll_fn(|cx| {
        let mut read = 0;
        while !body.rest.is_end_stream() && read <= length {
            match std::pin::Pin::new(&mut body.rest).poll_frame(cx) {
                std::task::Poll::Ready(Some(Ok(frame))) => {
                    read += frame.data_ref().map_or(0, |d| d.len());
                    frames.push(frame);
                }
                std::task::Poll::Ready(Some(Err(e))) => return std::task::Poll::Ready(Err(e)),
                std::task::Poll::Ready(None) => {
                    body.over(true);
                    break;
                }
                std::task::Poll::Pending => return std::task::Poll::Ready(Ok(false)),
            }
        }
        std::task::Poll::Ready(Ok(body.rest.is_end_stream()
            && read == length
            && frames.iter().all(Frame::is_data)))
    })
    .await?;
    body.over(body.rest.is_end_stream());
    if !whole {
        if !frames.is_empty() {
            let ahead = body.ahead.get_or_insert_with(Default::default);
            ahead.frames.extend(frames);
        }
        return Ok(None);
    }
    // Every frame is data (`whole`). One is the body as it came; more are joined.
    if frames.len() == 1 {
        return Ok(frames.pop().and_then(|f| f.into_data().ok()));
    }
    let mut all = bytes::BytesMut::with_capacity(length);
    for data in frames.into_iter().filter_map(|f| f.into_data().ok()) {
        all.extend_from_slice(&data);
    }
    Ok(Some(all.freeze()))
}

/// What a borrowed request keeps when its body (or the whole request) is taken out of it.
pub fn emptied() -> ReqBody {
    Either::Right(InHand::default())
}

/// A request body read whole before the request was made, given as one frame.
#[derive(Debug, Default)]
pub struct InHand(Option<Bytes>);

impl InHand {
    pub fn new(bytes: Bytes) -> Self {
        Self((!bytes.is_empty()).then_some(bytes))
    }

    /// What is left to give: all of it until the body is polled.
    pub fn bytes(&self) -> &[u8] {
        self.0.as_deref().unwrap_or_default()
    }
}

impl http_body::Body for InHand {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.take().map(|b| Ok(http_body::Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.bytes().len() as u64)
    }
}

/// An upstream response's body: from the pooled client, or read from our own connection.
pub type UpstreamBody = Either<Incoming, super::http1::client::RawBody>;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Builds the pooled upstream client: HTTP/1.1, or HTTP/2 with prior knowledge when `h2`.
/// Each connection it opens holds a permit of `cap` while open.
pub fn client(
    connect_timeout: Duration,
    idle: Duration,
    h2: bool,
    cap: Arc<Cap>,
) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    connector.enforce_http(true);
    let connector = Capped {
        inner: connector,
        cap,
        wait: connect_timeout,
    };
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(idle)
        // Idle pooled connections hold permits of the cap too: few are kept.
        .pool_max_idle_per_host(MAX_POOLED_IDLE)
        .http2_only(h2)
        .build(connector)
}

/// Idle connections the pooled client keeps, per worker: they hold permits of the cap that a
/// waiting request cannot take back.
const MAX_POOLED_IDLE: usize = 8;

/// The pooled client's connector: each connection holds a permit of the proxy's [`Cap`]
/// while it is open (an upgraded one, a WebSocket, until the tunnel closes).
#[derive(Clone)]
pub struct Capped {
    inner: HttpConnector,
    cap: Arc<Cap>,
    wait: Duration,
}

/// No upstream connection came free within `timeouts.upstream_connect`.
#[derive(Debug)]
pub struct Saturated;

impl std::fmt::Display for Saturated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no upstream connection came free in time")
    }
}

impl std::error::Error for Saturated {}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower::Service<Uri> for Capped {
    type Response = CappedIo;
    type Error = BoxError;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<CappedIo, BoxError>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        tower::Service::poll_ready(&mut self.inner, cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (mut inner, cap, wait) = (self.inner.clone(), self.cap.clone(), self.wait);
        Box::pin(async move {
            let permit = cap.permit(wait).await.ok_or(Saturated)?;
            let io = tower::Service::call(&mut inner, uri).await?;
            Ok(CappedIo {
                io,
                _permit: permit,
            })
        })
    }
}

/// A pooled upstream connection and its permit.
pub struct CappedIo {
    io: TokioIo<tokio::net::TcpStream>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl hyper::rt::Read for CappedIo {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for CappedIo {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}

impl hyper_util::client::legacy::connect::Connection for CappedIo {
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        self.io.connected()
    }
}

/// Why a request got no response from the upstream.
#[derive(Debug)]
pub enum Failure {
    Connect(std::io::Error),
    ConnectTimeout,
    /// The exchange on an upstream connection of our own failed.
    Raw(std::io::Error),
    /// The pooled client failed.
    Pooled(hyper_util::client::legacy::Error),
    /// No upstream connection came free in time under the caps.
    Saturated,
}

/// What the request path knows when it forwards.
pub struct Forward<'a> {
    pub client: &'a UpstreamClient,
    pub upstream: &'a http::uri::Authority,
    pub peer: IpAddr,
    /// Whether `X-Forwarded-Proto`/`-Host` from a trusted hop are kept rather than replaced.
    pub trust_forwarded: bool,
    pub response_timeout: Duration,
    /// Where the response deadline is kept (the worker's tick fires it).
    pub timers: &'a Arc<Timers>,
    pub metrics: &'a Metrics,
    /// The upstream speaks HTTP/2 (`h2c://`).
    pub h2: bool,
    /// The client connection's own upstream connection (or, for HTTP/2 streams, one borrowed
    /// from the worker's), for an HTTP/1 upstream; `None` sends through the pooled client.
    pub affine: Option<(&'a Affine, &'a Upstream)>,
    /// The request's start (the clock's nanoseconds).
    pub now: u64,
    /// The `Upgrade` protocols that may be forwarded.
    pub upgrades: &'a [UpgradeProtocol],
    /// The upstream connection must not carry another request after this one (a body on a
    /// GET, which the app may not read): `Connection: close` goes with it.
    pub close: bool,
}

impl Forward<'_> {
    /// Sends `req` upstream and returns the response to stream back, or the error response.
    /// `permits` are concurrency slots, held until the response body ends.
    /// Borrows `req`: the client connection's own upstream connection only reads it, and a
    /// request moved down the layers of futures is copied at each (it is 264 bytes). The
    /// pooled client takes it, leaving an empty request behind.
    pub async fn send(
        &self,
        req: &mut Request<ReqBody>,
        mut permits: SmallVec<[Permit; 1]>,
    ) -> Response<Body> {
        // HTTP/1.1 upgrades only (an HTTP/2 upstream has no Upgrade), and only to a listed
        // protocol: any other `Upgrade` (h2c, whose tunnel no rule would see) is dropped with
        // the hop's fields, and the request goes on as a plain one.
        let asked = (!self.h2)
            .then(|| upgrade_asked(req.headers(), self.upgrades))
            .flatten();
        let upgrade = asked.map(|_| hyper::upgrade::on(&mut *req));
        // A small body of hyper's (an HTTP/2 stream's, which usually comes in the frame after
        // its head) that is all there already goes on like one read with its head; its one
        // `Content-Length` frames it upstream. One still coming is streamed through the pool.
        let coming = matches!(req.body(), Either::Left(body) if !body.is_end_stream());
        let length = (coming && self.affine.is_some() && upgrade.is_none())
            .then(|| one_length(req.headers()))
            .flatten()
            .filter(|n| *n <= super::http1::server::IN_HAND as u64);
        if let (Some(length), Either::Left(body)) = (length, req.body_mut()) {
            match in_hand(body, length as usize).await {
                Ok(Some(whole)) => *req.body_mut() = Either::Right(InHand::new(whole)),
                Ok(None) => {}
                Err(_) => return self.bad_body(),
            }
        }
        // The client connection's own upstream connection takes what one connection in
        // sequence can: requests without an upgrade (CONNECT has none to give) and without a
        // body still to come, HTTP/2 streams included; a body in hand is written with the
        // head. A body still coming goes through hyper's pool, whose client hands
        // back a response that comes while the body is still being sent (an early 413 or 401
        // to an upload).
        let affine = self.affine.filter(|_| {
            upgrade.is_none()
                && req.version() <= Version::HTTP_2
                && req.method() != Method::CONNECT
                && match req.body() {
                    Either::Left(body) => http_body::Body::is_end_stream(body),
                    Either::Right(_) => true,
                }
        });
        // The client connection's own upstream connection writes the client's headers as the
        // hop leaves them; the pooled client gets the request rewritten.
        let mut added = Added::of(
            req.headers(),
            req.uri().authority(),
            affine.map(|_| self.upstream),
            self.peer,
            self.trust_forwarded,
        );
        // (An upgrade keeps its own `Connection: upgrade`, and its connection is the tunnel's.)
        added.close = self.close && !self.h2 && upgrade.is_none();
        if affine.is_none() {
            if let Err(resp) = self.rewrite(req, upgrade.is_some(), &added) {
                return resp;
            }
        }
        let deadline = Sleep::until(self.timers.clone(), Timers::now() + self.response_timeout);
        let result = timeout(deadline, async {
            match affine {
                Some((conn, upstream)) => {
                    let resp = conn.send(upstream, req, &added, self.now).await?;
                    Ok(resp.map(Either::Right))
                }
                None => {
                    let mut req = std::mem::replace(req, Request::new(emptied()));
                    // A response that refuses a streamed body (an early 413 or 401, which an app
                    // sends before it reads the body) leaves the app free to read the rest of
                    // the body as it likes, and to answer it: that connection is never reused.
                    let streamed = !self.h2 && !req.body().is_end_stream();
                    let captured = streamed
                        .then(|| hyper_util::client::legacy::connect::capture_connection(&mut req));
                    let resp = self.client.request(req).await.map_err(Failure::Pooled)?;
                    let refused =
                        resp.status().is_client_error() || resp.status().is_server_error();
                    if let (true, Some(captured)) = (refused, captured) {
                        if let Some(connected) = captured.connection_metadata().as_ref() {
                            connected.poison();
                        }
                    }
                    Ok::<_, Failure>(resp.map(Either::Left))
                }
            }
        })
        .await;
        let mut resp = match result {
            Some(Ok(resp)) => {
                // The upstream's latency, for adaptive limits: to the response head.
                permits.iter_mut().for_each(Permit::responded);
                resp
            }
            // The client's own body was malformed (a bad chunk) or cut off: its fault, not the
            // upstream's.
            Some(Err(e)) if e.client_body_failed() => return self.bad_body(),
            Some(Err(e)) => return self.failed(e.classify()),
            None => return self.failed(UpstreamError::ResponseTimeout),
        };
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            let answered = resp
                .headers()
                .get(header::UPGRADE)
                .map(|v| v.as_bytes().trim_ascii());
            match (upgrade, asked) {
                (Some(client_side), Some(token))
                    if answered.is_some_and(|a| a.eq_ignore_ascii_case(token.as_bytes())) =>
                {
                    let upstream_side = hyper::upgrade::on(&mut resp);
                    // The tunnel, not the empty 101 body, holds the concurrency slots.
                    tokio::spawn(splice(client_side, upstream_side, permits));
                    return resp.map(|b| Either::Left(PermitBody::new(b, SmallVec::new())));
                }
                // A switch nobody asked for, or to another protocol: the connection would carry
                // what no rule sees. Dropping `resp` closes the upstream connection.
                _ => {
                    self.metrics.upstream_error(UpstreamError::Protocol).inc();
                    let mut answer = respond::error(
                        StatusCode::BAD_GATEWAY,
                        "upstream switched to a protocol that was not asked for",
                    );
                    answer
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                    return answer;
                }
            }
        }
        // The own connection's response comes without them (`h1` leaves them out).
        if matches!(resp.body(), Either::Left(_)) {
            strip_hop_by_hop(resp.headers_mut(), false);
        }
        resp.map(|b| Either::Left(PermitBody::new(b, permits)))
    }

    fn bad_body(&self) -> Response<Body> {
        self.metrics.bad_body.inc();
        respond::error(
            StatusCode::BAD_REQUEST,
            "the request body was malformed or ended early",
        )
    }

    fn failed(&self, kind: UpstreamError) -> Response<Body> {
        failed(self.metrics, kind)
    }

    /// Points the request at the upstream (absolute form, for the pooled client) and rewrites
    /// its headers for the hop.
    #[allow(clippy::result_large_err)]
    fn rewrite(
        &self,
        req: &mut Request<ReqBody>,
        upgrade: bool,
        added: &Added,
    ) -> Result<(), Response<Body>> {
        let path_and_query = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(http::uri::Scheme::HTTP);
        parts.authority = Some(self.upstream.clone());
        parts.path_and_query = Some(path_and_query);
        *req.uri_mut() = Uri::from_parts(parts).map_err(|_| {
            respond::error(
                StatusCode::BAD_REQUEST,
                "request target cannot be forwarded",
            )
        })?;
        *req.version_mut() = if self.h2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };

        let headers = req.headers_mut();
        // gRPC needs `TE: trailers` end to end; over HTTP/2 it is the one TE value allowed.
        let te_trailers = headers
            .get_all(header::TE)
            .iter()
            .any(|v| has_token(v.as_bytes(), b"trailers"));
        added.apply(headers, upgrade);
        if self.h2 && te_trailers {
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        Ok(())
    }
}

/// The answer to a request the upstream did not answer, counted in `metrics` by `kind`.
pub(super) fn failed(metrics: &Metrics, kind: UpstreamError) -> Response<Body> {
    metrics.upstream_error(kind).inc();
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
    };
    let mut resp = respond::error(status, detail);
    if kind == UpstreamError::Saturated {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

/// The headers a hop sets on a request: `Host` when it has none, `X-Forwarded-For` (the
/// client's lines folded, the peer appended), `X-Forwarded-Proto` and `-Host` (the client's
/// kept only from a trusted hop). Found in one pass over the client's headers, then either
/// written into them (the pooled client) or written after those that go on (`h1`).
pub struct Added {
    host: Option<HeaderValue>,
    /// Kept inline: the client's list and the peer's address fit in most cases, and the
    /// value is only written out (a `HeaderValue` of it is made for the pooled client).
    forwarded_for: SmallVec<[u8; FORWARDED_FOR_INLINE]>,
    proto: Option<HeaderValue>,
    forwarded_host: Option<HeaderValue>,
    /// The names the client's `Connection` lists: those fields do not go on.
    listed: SmallVec<[HeaderName; 1]>,
    /// The client's `X-Forwarded-*` come from a trusted hop.
    trusted: bool,
    /// `Connection: close` goes upstream, and the connection is not reused after the answer.
    pub close: bool,
}

/// Bytes of `X-Forwarded-For` kept in [`Added`] without an allocation.
const FORWARDED_FOR_INLINE: usize = 48;

impl Added {
    /// `authority`: the request target's, if absolute (or HTTP/2's `:authority`), the `Host`
    /// when the client sent none; else `default_host`.
    pub fn of(
        headers: &HeaderMap,
        authority: Option<&http::uri::Authority>,
        default_host: Option<&http::uri::Authority>,
        peer: IpAddr,
        trust_forwarded: bool,
    ) -> Added {
        let (mut host, mut proto, mut forwarded_host) = (None, false, false);
        let mut connection = SmallVec::<[&HeaderValue; 1]>::new();
        let mut forwarded_for = SmallVec::new();
        for (name, value) in headers {
            if name == header::HOST {
                host = host.or(Some(value));
            } else if name == header::CONNECTION {
                connection.push(value);
            } else if name == X_FORWARDED_FOR {
                if value.to_str().is_ok() {
                    forwarded_for.extend_from_slice(value.as_bytes());
                    forwarded_for.extend_from_slice(b", ");
                }
            } else if name == X_FORWARDED_PROTO {
                proto = true;
            } else if name == X_FORWARDED_HOST {
                forwarded_host = true;
            }
        }
        let listed: SmallVec<[HeaderName; 1]> = listed(connection.iter().map(|v| v.as_bytes()))
            .into_iter()
            .filter_map(|t| HeaderName::from_bytes(t).ok())
            .collect();
        // What the client's `Connection` names is gone before the hop's fields are worked
        // out (`Connection: X-Forwarded-For` drops the client's list, as stripping first did).
        if !listed.is_empty() {
            let named = |n: &HeaderName| listed.contains(n);
            host = host.filter(|_| !named(&header::HOST));
            if named(&X_FORWARDED_FOR) {
                forwarded_for.clear();
            }
            proto &= !named(&X_FORWARDED_PROTO);
            forwarded_host &= !named(&X_FORWARDED_HOST);
        }
        // A client's own list would be believed by an app that reads its leftmost entry: only a
        // listed proxy's is kept; anyone else's is replaced by the address it came from.
        if !trust_forwarded {
            forwarded_for.clear();
        }
        put_address(&mut forwarded_for, peer);
        let added_host = match host {
            Some(_) => None,
            None => authority
                .or(default_host)
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok()),
        };
        let forwarded_host = (!trust_forwarded || !forwarded_host)
            .then(|| host.or(added_host.as_ref()).cloned())
            .flatten();
        Added {
            host: added_host,
            forwarded_for,
            proto: (!trust_forwarded || !proto).then(|| HeaderValue::from_static("http")),
            forwarded_host,
            listed,
            trusted: trust_forwarded,
            close: false,
        }
    }

    /// Rewrites `headers` in place for the pooled client: the connection's own fields go
    /// (`Upgrade` stays for an `upgrade`), the hop's are set.
    pub fn apply(&self, headers: &mut HeaderMap, upgrade: bool) {
        strip_hop_by_hop(headers, upgrade);
        for (name, value) in self.fields() {
            // Made of visible ASCII only (the client's values that are text, and an address).
            if let Ok(value) = HeaderValue::from_bytes(value) {
                headers.insert(name.clone(), value);
            }
        }
        if !self.trusted && self.forwarded_host.is_none() {
            headers.remove(&X_FORWARDED_HOST);
        }
    }

    /// The headers set, each replacing the client's of that name.
    pub fn fields(&self) -> impl Iterator<Item = (&HeaderName, &[u8])> {
        let close = self.close.then_some((&header::CONNECTION, &b"close"[..]));
        self.set().chain(close)
    }

    /// The end-to-end headers set (`Connection: close`, when set, is the hop's own).
    pub fn set(&self) -> impl Iterator<Item = (&HeaderName, &[u8])> {
        fn value(v: &Option<HeaderValue>) -> Option<&[u8]> {
            v.as_ref().map(HeaderValue::as_bytes)
        }
        [
            (&header::HOST, value(&self.host)),
            (&X_FORWARDED_FOR, Some(&self.forwarded_for[..])),
            (&X_FORWARDED_PROTO, value(&self.proto)),
            (&X_FORWARDED_HOST, value(&self.forwarded_host)),
        ]
        .into_iter()
        .filter_map(|(name, value)| value.map(|v| (name, v)))
    }

    /// Whether the client's header `name` goes on (upgrades aside: those take the pooled
    /// client): not one of the connection's own, not one set here, no `X-Forwarded-Host` from
    /// an untrusted client (one without any host to replace it with goes too).
    pub fn passes(&self, name: &HeaderName) -> bool {
        !hop_by_hop(name)
            && !self.listed.contains(name)
            && self.set().all(|(set, _)| set != name)
            && (self.trusted || name != X_FORWARDED_HOST)
    }
}

/// The listed protocol an HTTP/1.1 upgrade request (`Connection: upgrade` + `Upgrade: ...`)
/// asks for: its one `Upgrade` value must be a protocol of `allowed` (a version suffix such
/// as `websocket/13` is not one: WebSocket is asked for as `websocket`).
fn upgrade_asked(headers: &HeaderMap, allowed: &[UpgradeProtocol]) -> Option<&'static str> {
    let mut values = headers.get_all(header::UPGRADE).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return None;
    };
    let asks = headers
        .get_all(header::CONNECTION)
        .iter()
        .any(|v| has_token(v.as_bytes(), b"upgrade"));
    let value = value.as_bytes().trim_ascii();
    allowed
        .iter()
        .map(|p| p.token())
        .find(|t| asks && value.eq_ignore_ascii_case(t.as_bytes()))
}

/// The request's body length when one `Content-Length` field gives it.
fn one_length(headers: &HeaderMap) -> Option<u64> {
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    match (lengths.next(), lengths.next()) {
        (Some(v), None) => super::http1::framing::parse_length(v.as_bytes()),
        _ => None,
    }
}

/// Whether the comma-separated `list` (a header value) holds `token`, whatever its case.
pub(super) fn has_token(list: &[u8], token: &[u8]) -> bool {
    list.split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// Whether `name` is one of the fields that always belong to one connection (RFC 9110
/// §7.6.1): [`HOP_BY_HOP`] and `Upgrade`. Those a message's `Connection` lists are [`listed`].
pub(super) fn hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(&name) || name == header::UPGRADE
}

/// The field names a message's `Connection` values list beyond those [`hop_by_hop`] covers:
/// usually none at all, or `close` (no field is named so; one that were would go too, as it
/// always has through [`strip_hop_by_hop`], which uses this list).
pub(super) fn listed<'a>(
    connection: impl IntoIterator<Item = &'a [u8]>,
) -> SmallVec<[&'a [u8]; 2]> {
    connection
        .into_iter()
        .flat_map(|v| v.split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| {
            !t.is_empty()
                && !t.eq_ignore_ascii_case(b"upgrade")
                && !HOP_BY_HOP
                    .iter()
                    .any(|h| h.as_str().as_bytes().eq_ignore_ascii_case(t))
        })
        .collect()
}

/// Removes the headers that belong to one connection (RFC 9110 §7.6.1), including those the
/// `Connection` header names. With `keep_upgrade`, `Upgrade` and `Connection: upgrade` stay.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    // Which of HOP_BY_HOP (bit i) and Upgrade the message carries, in one pass over the names
    // (standard ones compare as enums): only those present are then removed, each a hashed
    // lookup. Most requests carry none; most responses of nginx `Connection: keep-alive`.
    const UPGRADE: u16 = 1 << HOP_BY_HOP.len();
    let mut present = 0u16;
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|h| *h == name) {
            present |= 1 << i;
        } else if name == header::UPGRADE {
            present |= UPGRADE;
        }
    }
    if present == 0 && !keep_upgrade {
        return;
    }
    // HOP_BY_HOP[0] is `Connection`; the other headers it names go too (`upgrade` and
    // HOP_BY_HOP's own are dealt with below, by what the pass found). The values are shared
    // with the parsed message (cloning one counts a reference), and each named header is
    // removed by its text: no header name is allocated.
    if present & 1 != 0 {
        let connection: SmallVec<[HeaderValue; 2]> = headers
            .get_all(header::CONNECTION)
            .iter()
            .cloned()
            .collect();
        for token in listed(connection.iter().map(HeaderValue::as_bytes)) {
            if let Ok(name) = std::str::from_utf8(token) {
                headers.remove(name);
            }
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(*name);
        }
    }
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else if present & UPGRADE != 0 {
        headers.remove(header::UPGRADE);
    }
}

/// The headers [`strip_hop_by_hop`] always removes (`Upgrade` too, unless upgrading).
static HOP_BY_HOP: [&HeaderName; 8] = [
    &header::CONNECTION,
    &KEEP_ALIVE,
    &PROXY_CONNECTION,
    &header::TE,
    &header::TRAILER,
    &header::TRANSFER_ENCODING,
    &header::PROXY_AUTHENTICATE,
    &header::PROXY_AUTHORIZATION,
];

/// Writes `peer` as std writes it (an IPv4-mapped address as IPv4).
fn put_address(value: &mut SmallVec<[u8; FORWARDED_FOR_INLINE]>, peer: IpAddr) {
    use std::io::Write;
    match peer.to_canonical() {
        // By hand: core's formatting of an address costs ten times as much.
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    value.push(b'.');
                }
                put_decimal(value, octet);
            }
        }
        v6 => {
            let _ = write!(value, "{v6}");
        }
    }
}

/// `n` in decimal, without leading zeros.
fn put_decimal(out: &mut SmallVec<[u8; FORWARDED_FOR_INLINE]>, n: u8) {
    if n >= 100 {
        out.push(b'0' + n / 100);
    }
    if n >= 10 {
        out.push(b'0' + n / 10 % 10);
    }
    out.push(b'0' + n % 10);
}

impl Failure {
    /// True when sending failed because reading the client's request body failed (hyper
    /// reports the body stream's error as a user error, caused by the incoming body's own
    /// error).
    fn client_body_failed(&self) -> bool {
        let mut source: Option<&(dyn std::error::Error + 'static)> = match self {
            Failure::Pooled(e) => Some(e),
            Failure::Raw(_)
            | Failure::Connect(_)
            | Failure::ConnectTimeout
            | Failure::Saturated => None,
        };
        while let Some(s) = source {
            if let Some(h) = s.downcast_ref::<hyper::Error>() {
                if h.is_user() && h.source().is_some_and(|inner| inner.is::<hyper::Error>()) {
                    return true;
                }
            }
            source = s.source();
        }
        false
    }

    fn classify(&self) -> UpstreamError {
        match self {
            Failure::Connect(_) => UpstreamError::Connect,
            Failure::ConnectTimeout => UpstreamError::ConnectTimeout,
            Failure::Saturated => UpstreamError::Saturated,
            Failure::Raw(_) => UpstreamError::Protocol,
            Failure::Pooled(e) if !e.is_connect() => UpstreamError::Protocol,
            Failure::Pooled(e) => {
                let mut source = std::error::Error::source(e);
                while let Some(s) = source {
                    if s.is::<Saturated>() {
                        return UpstreamError::Saturated;
                    }
                    if let Some(io) = s.downcast_ref::<std::io::Error>() {
                        if io.kind() == std::io::ErrorKind::TimedOut {
                            return UpstreamError::ConnectTimeout;
                        }
                    }
                    source = s.source();
                }
                UpstreamError::Connect
            }
        }
    }
}

/// Copies bytes both ways between an upgraded client connection and the upstream's, holding
/// the request's concurrency slots until both sides are done.
async fn splice(
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    _permits: SmallVec<[Permit; 1]>,
) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(pair) => pair,
        Err(e) => {
            tracing::debug!(error = %e, "upgrade failed");
            return;
        }
    };
    let (mut c, mut u) = (TokioIo::new(client), TokioIo::new(upstream));
    if let Err(e) = tokio::io::copy_bidirectional(&mut c, &mut u).await {
        tracing::debug!(error = %e, "upgraded connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "keep-alive, x-secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert(header::TE, "trailers".parse().unwrap());
        h.insert(header::UPGRADE, "websocket".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn names_in_connection_match_whatever_their_case_and_odd_tokens_are_ignored() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "X-Secret , ,bad name".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn a_message_without_hop_by_hop_headers_is_left_as_it_is() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "app".parse().unwrap());
        h.insert("x-client", "c1".parse().unwrap());
        let before = h.clone();
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h, before);
    }

    #[test]
    fn an_upgrade_keeps_its_upgrade_headers() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "Upgrade".parse().unwrap());
        h.insert(header::UPGRADE, "websocket".parse().unwrap());
        assert_eq!(
            upgrade_asked(&h, &[UpgradeProtocol::Websocket]),
            Some("websocket")
        );
        assert_eq!(upgrade_asked(&h, &[]), None);
        strip_hop_by_hop(&mut h, true);
        assert_eq!(h.get(header::UPGRADE).unwrap(), "websocket");
        assert_eq!(h.get(header::CONNECTION).unwrap(), "upgrade");
    }

    #[test]
    fn only_a_listed_protocol_is_an_upgrade() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "Upgrade, HTTP2-Settings".parse().unwrap(),
        );
        h.insert(header::UPGRADE, "h2c".parse().unwrap());
        assert_eq!(upgrade_asked(&h, &[UpgradeProtocol::Websocket]), None);
        h.insert(header::UPGRADE, "websocket, h2c".parse().unwrap());
        assert_eq!(upgrade_asked(&h, &[UpgradeProtocol::Websocket]), None);
        h.insert(header::UPGRADE, "WebSocket".parse().unwrap());
        assert_eq!(
            upgrade_asked(&h, &[UpgradeProtocol::Websocket]),
            Some("websocket")
        );
        h.append(header::UPGRADE, "h2c".parse().unwrap());
        assert_eq!(upgrade_asked(&h, &[UpgradeProtocol::Websocket]), None);
    }

    fn added(h: &HeaderMap, trust: bool) -> Added {
        Added::of(h, None, None, "::ffff:10.0.0.1".parse().unwrap(), trust)
    }

    #[test]
    fn forwarded_for_lines_fold_and_the_peer_is_appended() {
        let mut h = HeaderMap::new();
        h.append(&X_FORWARDED_FOR, "1.1.1.1".parse().unwrap());
        h.append(&X_FORWARDED_FOR, "2.2.2.2".parse().unwrap());
        let a = added(&h, true);
        assert_eq!(&a.forwarded_for[..], b"1.1.1.1, 2.2.2.2, 10.0.0.1");
        // From a peer that is not a listed proxy, the list is the peer alone.
        assert_eq!(&added(&h, false).forwarded_for[..], b"10.0.0.1");
        assert!(
            !a.passes(&X_FORWARDED_FOR),
            "the client's lines are replaced"
        );
    }

    #[test]
    fn a_forwarded_for_list_longer_than_kept_inline_is_whole() {
        let long = (1..=12)
            .map(|i| format!("10.0.{i}.{i}"))
            .collect::<Vec<_>>()
            .join(", ");
        assert!(long.len() > FORWARDED_FOR_INLINE);
        let mut h = HeaderMap::new();
        h.append(&X_FORWARDED_FOR, long.parse().unwrap());
        let a = added(&h, true);
        assert_eq!(&a.forwarded_for[..], format!("{long}, 10.0.0.1").as_bytes());
        let mut rewritten = h.clone();
        a.apply(&mut rewritten, false);
        assert_eq!(rewritten[&X_FORWARDED_FOR], format!("{long}, 10.0.0.1"));
    }

    /// The headers the upstream gets, as the pooled client sends them (rewritten in place)
    /// and as `h1` writes them (the client's that pass, then the added): the same.
    fn both_ways(h: &HeaderMap, authority: Option<&str>, trust: bool) -> Vec<(String, String)> {
        let authority: Option<http::uri::Authority> = authority.map(|a| a.parse().unwrap());
        let peer: IpAddr = "192.0.2.7".parse().unwrap();
        let a = Added::of(h, None, authority.as_ref(), peer, trust);
        let mut rewritten = h.clone();
        a.apply(&mut rewritten, false);
        let written = h
            .iter()
            .filter(|(name, _)| a.passes(name))
            .map(|(n, v)| (n, v.as_bytes()))
            .chain(a.fields());
        let sorted = |it: &mut dyn Iterator<Item = (&HeaderName, &[u8])>| {
            let mut v: Vec<(String, String)> = it
                .map(|(n, v)| (n.to_string(), String::from_utf8(v.to_vec()).unwrap()))
                .collect();
            v.sort();
            v
        };
        let (left, right) = (
            sorted(&mut rewritten.iter().map(|(n, v)| (n, v.as_bytes()))),
            sorted(&mut written.into_iter()),
        );
        assert_eq!(left, right, "rewritten vs written, from {h:?}");
        left
    }

    #[test]
    fn the_pooled_client_and_the_own_connection_send_the_same_headers() {
        let plain = crate::key::tests::headers(&[("host", "shop"), ("x-client", "c1")]);
        let sent = both_ways(&plain, None, false);
        assert!(sent.contains(&("x-forwarded-for".into(), "192.0.2.7".into())));
        assert!(sent.contains(&("x-forwarded-host".into(), "shop".into())));
        assert!(sent.contains(&("x-forwarded-proto".into(), "http".into())));
        assert_eq!(sent.len(), 5);

        let busy = crate::key::tests::headers(&[
            ("connection", "keep-alive, X-Secret"),
            ("x-secret", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic Zm9v"),
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-for", "2.2.2.2, 3.3.3.3"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "front"),
            ("x-kept", "a"),
            ("x-kept", "b"),
        ]);
        for trust in [false, true] {
            let sent = both_ways(&busy, Some("app:8080"), trust);
            let proto = if trust { "https" } else { "http" };
            let fhost = if trust { "front" } else { "app:8080" };
            let xff = if trust {
                "1.1.1.1, 2.2.2.2, 3.3.3.3, 192.0.2.7"
            } else {
                "192.0.2.7"
            };
            let mut want: Vec<(String, String)> = [
                ("host", "app:8080"),
                ("x-forwarded-for", xff),
                ("x-forwarded-proto", proto),
                ("x-forwarded-host", fhost),
                ("x-kept", "a"),
                ("x-kept", "b"),
            ]
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
            want.sort();
            assert_eq!(sent, want, "trusted: {trust}");
        }

        // `Connection: close` names an option, and a field called so (were there one) goes
        // the same way on both paths.
        let closing = crate::key::tests::headers(&[
            ("host", "shop"),
            ("connection", "close"),
            ("close", "x"),
        ]);
        let sent = both_ways(&closing, None, false);
        assert!(
            sent.iter().all(|(n, _)| n != "close" && n != "connection"),
            "{sent:?}"
        );

        // A field the client's `Connection` names is gone before the hop's are worked out.
        let named = crate::key::tests::headers(&[
            ("host", "shop"),
            ("connection", "X-Forwarded-For, x-forwarded-proto"),
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-proto", "https"),
        ]);
        for trust in [false, true] {
            let sent = both_ways(&named, None, trust);
            assert!(sent.contains(&("x-forwarded-for".into(), "192.0.2.7".into())));
            assert!(sent.contains(&("x-forwarded-proto".into(), "http".into())));
        }

        // No host to say (an HTTP/1.0 request without `Host` through the pool): an untrusted
        // client's X-Forwarded-Host does not go on for want of one.
        let hostless = crate::key::tests::headers(&[("x-forwarded-host", "evil")]);
        let names =
            |sent: Vec<(String, String)>| sent.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        assert_eq!(
            names(both_ways(&hostless, None, false)),
            ["x-forwarded-for", "x-forwarded-proto"]
        );
        assert!(names(both_ways(&hostless, None, true)).contains(&"x-forwarded-host".to_string()));
    }

    #[test]
    fn a_keep_alive_response_loses_its_connection_header_and_nothing_else() {
        let mut h = HeaderMap::new();
        h.insert(header::SERVER, "nginx".parse().unwrap());
        h.insert(header::CONTENT_LENGTH, "3".parse().unwrap());
        h.insert(header::CONNECTION, "Keep-Alive".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 2, "{h:?}");
        assert!(h.contains_key(header::SERVER) && h.contains_key(header::CONTENT_LENGTH));
    }

    #[test]
    fn the_peer_address_is_written_as_std_writes_it() {
        for peer in [
            "0.0.0.0",
            "9.10.99.100",
            "127.0.0.1",
            "255.255.255.255",
            "10.200.3.45",
            "::1",
            "2001:db8::8a2e:370:7334",
            "::ffff:192.168.0.1",
        ] {
            let ip: IpAddr = peer.parse().unwrap();
            let mut out = SmallVec::new();
            put_address(&mut out, ip);
            assert_eq!(&out[..], ip.to_canonical().to_string().as_bytes());
        }
        for n in 0..=255u8 {
            let mut out = SmallVec::new();
            put_decimal(&mut out, n);
            assert_eq!(&out[..], n.to_string().as_bytes());
        }
    }
}
