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

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body as _;
use http_body_util::Either;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use smallvec::SmallVec;

use super::affine::{Affine, Cap, Dial};
use super::body::in_hand;
pub use super::body::{emptied, InHand, ReqBody, Streamed};
use super::coarse::{timeout, Sleep, Timers};
pub use super::failure::{Failure, Saturated};
pub use super::forwarded::Added;
use super::http1::framing::has_token;
pub use super::respond::UpstreamBody;
use super::respond::{self, Body};
use crate::config::UpgradeProtocol;
use crate::hop::strip_hop_by_hop;
use crate::limit::Permit;
use crate::metrics::{Metrics, UpstreamError};
use crate::respond::PermitBody;

pub type UpstreamClient = Client<Capped, ReqBody>;

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

/// The pooled client's connector: each connection holds a permit of the proxy's `Cap`
/// while it is open (an upgraded one, a WebSocket, until the tunnel closes).
#[derive(Clone)]
pub struct Capped {
    inner: HttpConnector,
    cap: Arc<Cap>,
    wait: Duration,
}

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
    pub affine: Option<(&'a Affine, &'a Dial)>,
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
            .filter(|n| *n <= super::body::IN_HAND as u64);
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
}
