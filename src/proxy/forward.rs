//! Forwarding to the upstream: which upgrades go on, header rewriting, the pooled client of an
//! `h2c://` upstream, error mapping.
//!
//! Owns what a reverse proxy must do to a request and a response in transit (RFC 9110 §7.6:
//! hop-by-hop headers, `X-Forwarded-*`, an upgrade only to a listed protocol, `CONNECT`
//! refused), and which upstream failure a request met (its answer is
//! `respond::Refused::upstream`'s: 502, 503 or 504). An HTTP/1 upstream is spoken to
//! by our own client on the client connection's own upstream connection (`upstream_pool`); an HTTP/2
//! one by hyper's pooled client. Bodies are never buffered whole, except a small client body
//! (up to `body::IN_HAND`, with one `Content-Length`) that is all there when the request goes
//! on: it is written with the head. Otherwise the client's body is streamed upstream as it
//! comes, and the upstream's body is streamed back as it comes.

use std::future::Future as _;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, StatusCode, Uri, Version};
use http_body::Body as _;
use http_body_util::Either;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use super::body::in_hand;
use super::body::Progress;
pub use super::body::{emptied, InHand, ReqBody, Streamed};
use super::deadlines::{timeout, Sleep, Timers};
pub use super::failure::{Failure, Saturated};
pub use super::forwarded::Added;
use super::http1::framing::{has_token, one_length};
use super::response::Reply;
pub use super::response::UpstreamBody;
use super::upstream_pool::{Cap, ClientUpstream, UpstreamAddr};
use crate::config::UpgradeProtocol;
use crate::hop::strip_hop_by_hop;
use crate::limit::{Permit, Permits};
use crate::metrics::{Metrics, Reason, UpstreamError};
use crate::respond::{self, Refused};

pub type UpstreamClient = Client<Capped, ReqBody>;

/// Builds the pooled upstream client, for an HTTP/2 upstream (prior knowledge). Each
/// connection it opens holds a permit of `cap` while open.
pub fn client(connect_timeout: Duration, idle: Duration, cap: Arc<Cap>) -> UpstreamClient {
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
        .http2_only(true)
        .build(connector)
}

/// Idle connections the pooled client keeps, per worker: they hold permits of the cap that a
/// waiting request cannot take back.
const MAX_POOLED_IDLE: usize = 8;

/// The pooled (HTTP/2) client's connector: each connection holds a permit of the proxy's
/// `Cap` while it is open.
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

/// Which deadline passed while a request was forwarded.
enum Late {
    /// No response head within `upstream_response` of the request sent whole.
    Response,
    /// The upstream took no byte of the body for `timeouts.send`.
    Upstream,
    /// The client sent no byte of its body for `timeouts.client_body_idle`.
    Client,
}

/// What the request path knows when it forwards.
pub struct Forward<'a> {
    pub client: &'a UpstreamClient,
    pub upstream: &'a http::uri::Authority,
    pub peer: IpAddr,
    /// Whether `X-Forwarded-Proto`/`-Host` from a trusted hop are kept rather than replaced.
    pub trust_forwarded: bool,
    pub response_timeout: Duration,
    /// `timeouts.send` and `timeouts.client_body_idle`: how long a body still coming may
    /// wait on the upstream and on the client while it goes up.
    pub upload_timeouts: (Duration, Duration),
    /// Where the response deadline is kept (the worker's tick fires it).
    pub timers: &'a Arc<Timers>,
    pub metrics: &'a Metrics,
    /// The client connection's own upstream connection (or, for HTTP/2 streams, one borrowed
    /// from the worker's), for an HTTP/1 upstream; `None` (an HTTP/2 upstream) sends through
    /// the pooled client.
    pub affine: Option<(&'a ClientUpstream, &'a UpstreamAddr)>,
    /// The request's start (the clock's nanoseconds).
    pub now: u64,
    /// The `Upgrade` protocols that may be forwarded.
    pub upgrades: &'a [UpgradeProtocol],
    /// The upstream connection must not carry another request after this one (a body on a
    /// GET, which the app may not read): `Connection: close` goes with it.
    pub close: bool,
    /// The request's id, for an answer of ours; sent upstream too with `forward_id`.
    pub id: crate::ids::RequestId,
    pub forward_id: bool,
}

impl Forward<'_> {
    /// Sends `req` upstream and returns the response to stream back, or the error response.
    /// `permits` are concurrency slots, held until the response body ends.
    /// Borrows `req`: our own client only reads its head (and takes a body still coming), and
    /// a request moved down the layers of futures is copied at each (it is 264 bytes). The
    /// pooled client takes it, leaving an empty request behind.
    pub async fn send(&self, req: &mut Request<ReqBody>, mut permits: Permits) -> Reply {
        // CONNECT asks for a tunnel to a host of the client's choosing: not a reverse proxy's
        // to give (an HTTP/1 client's is refused with its head, an HTTP/2 client's here).
        if req.method() == Method::CONNECT {
            return Reply::whole(respond::error(
                StatusCode::NOT_IMPLEMENTED,
                "CONNECT is not served by this proxy",
                &self.id.text(),
            ));
        }
        let coming = matches!(req.body(), Either::Left(body) if !body.is_end_stream());
        // HTTP/1.1 upgrades only (an HTTP/2 upstream has no Upgrade), to a listed protocol,
        // with no body still coming (the connection is the tunnel's once the request is sent):
        // any other `Upgrade` (h2c, whose tunnel no rule would see) is dropped with the hop's
        // fields, and the request goes on as a plain one.
        let asked = (self.affine.is_some() && req.version() == Version::HTTP_11 && !coming)
            .then(|| upgrade_asked(req.headers(), self.upgrades))
            .flatten();
        // A small streamed body (an HTTP/2 stream's, which usually comes in the frame after its
        // head; an HTTP/1 one that waited for `100 Continue` or came late) that is all there
        // already goes on like one read with its head; its one `Content-Length` frames it
        // upstream. One still coming is streamed.
        let length = (coming && self.affine.is_some())
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
        // An HTTP/1 upstream is spoken to by our own client, on the client connection's own
        // upstream connection (written as the hop leaves the client's fields); an HTTP/2 one
        // by hyper's pooled client, which gets the request rewritten.
        let mut added = Added::of(
            req.headers(),
            req.uri().authority(),
            self.affine.map(|_| self.upstream),
            self.peer,
            self.trust_forwarded,
        );
        added.upgrade = asked;
        added.close = self.close;
        if self.forward_id {
            added.request_id = Some(Box::new(self.id.text()));
        }
        // A body still coming goes up before the response timeout starts.
        // (Still a stream if it was one and was not read whole above: asking again would
        // lock an HTTP/2 stream's state.)
        let progress =
            (coming && matches!(req.body(), Either::Left(_))).then(|| match self.affine {
                Some((conn, _)) => conn.progress(req.version() == Version::HTTP_2),
                None => Arc::new(Progress::default()),
            });
        added.progress = progress.clone();
        if self.affine.is_none() {
            // hyper's client reads the body: the body tells how far it got.
            if let (Some(p), Either::Left(body)) = (&progress, req.body_mut()) {
                body.watched(p.clone());
            }
            if let Err(resp) = self.rewrite(req, &added) {
                return resp;
            }
        }
        // Pinned where it is made: the exchange's future is large, and each move copies it.
        let mut exchange = std::pin::pin!(async {
            match self.affine {
                Some((conn, upstream)) => {
                    let (resp, passed) = conn.send(upstream, req, &added, self.now).await?;
                    Ok((resp.map(Either::Right), passed))
                }
                None => {
                    let req = std::mem::replace(req, Request::new(emptied()));
                    let resp = self.client.request(req).await.map_err(Failure::Pooled)?;
                    Ok::<_, Failure>((resp.map(Either::Left), None))
                }
            }
        });
        let result = match &progress {
            None => {
                let deadline =
                    Sleep::until(self.timers.clone(), Timers::now() + self.response_timeout);
                timeout(deadline, exchange.as_mut())
                    .await
                    .ok_or(Late::Response)
            }
            Some(progress) => self.uploading(exchange.as_mut(), progress).await,
        };
        let result = match result {
            Ok(r) => Some(r),
            Err(Late::Response) => None,
            Err(Late::Upstream) => return self.failed(UpstreamError::UploadStalled),
            Err(Late::Client) => return self.body_timeout(),
        };
        let resp = match result {
            Some(Ok(resp)) => {
                // The upstream's latency, for adaptive limits: to the response head. Slots
                // given back at the head (adaptive ones, `release: head`) go now: a long-lived
                // response must not hold a shared limit.
                permits.iter_mut().for_each(Permit::responded);
                permits.retain(|p| !p.releases_at_head());
                Ok(resp)
            }
            // The client's own body was malformed (a bad chunk) or cut off: its fault, not the
            // upstream's.
            Some(Err(e)) if e.client_body_failed() => return self.bad_body(),
            Some(Err(e)) => Err(self.failed(e.classify())),
            None => Err(self.failed(UpstreamError::ResponseTimeout)),
        };
        let mut resp = match resp {
            // The own connection's response comes without them (`h1` leaves them out).
            Ok((mut resp, passed)) => {
                if matches!(resp.body(), Either::Left(_)) {
                    strip_hop_by_hop(resp.headers_mut());
                }
                Reply::upstream(resp, passed, permits)
            }
            Err(answer) => answer,
        };
        // An upgrade not switched: what the client sent after its head may be the new
        // protocol's, never to be read as requests.
        if asked.is_some() && resp.head.status() != StatusCode::SWITCHING_PROTOCOLS {
            resp.head.close();
        }
        resp
    }

    /// The client's body was malformed or cut off: nothing after it on the connection can be
    /// told apart, so the connection closes.
    fn bad_body(&self) -> Reply {
        self.refuse(BAD_BODY)
    }

    /// `exchange` while its body still goes up: the response timeout starts once it is whole;
    /// until then the upload may wait `timeouts.send` on the upstream and
    /// `timeouts.client_body_idle` on the client without progress (looked at every shorter of
    /// the two: a stall is found up to one of those, and a tick, after its own limit).
    async fn uploading<T>(
        &self,
        exchange: impl std::future::Future<Output = T>,
        progress: &Progress,
    ) -> Result<T, Late> {
        let (send, client) = self.upload_timeouts;
        let mut exchange = std::pin::pin!(exchange);
        // Checked at the shorter of the two; a wait is judged by its own side's.
        let mut since = Timers::now();
        let mut deadline = Sleep::until(self.timers.clone(), since + send.min(client));
        let mut seen = progress.moved();
        let mut over = false;
        std::future::poll_fn(|cx| loop {
            if let std::task::Poll::Ready(out) = exchange.as_mut().poll(cx) {
                return std::task::Poll::Ready(Ok(out));
            }
            if !over && progress.over() {
                over = true;
                deadline.reset(Timers::now() + self.response_timeout);
            }
            if std::pin::Pin::new(&mut deadline).poll(cx).is_pending() {
                return std::task::Poll::Pending;
            }
            if over {
                return std::task::Poll::Ready(Err(Late::Response));
            }
            let now = Timers::now();
            let moved = progress.moved();
            if moved != seen {
                (seen, since) = (moved, now);
            }
            let (limit, late) = match progress.on_client() {
                true => (client, Late::Client),
                false => (send, Late::Upstream),
            };
            if now >= since + limit {
                return std::task::Poll::Ready(Err(late));
            }
            deadline.reset((since + limit).min(now + send.min(client)));
        })
        .await
    }

    /// The client's body stopped coming for `timeouts.client_body_idle`: 408, and the
    /// connection closes (what of the body is still coming cannot be told from a request).
    fn body_timeout(&self) -> Reply {
        self.refuse(BODY_TIMEOUT)
    }

    fn refuse(&self, refused: Refused) -> Reply {
        self.metrics.refused(refused.reason).inc();
        Reply::refused(&refused, &self.id.text())
    }

    fn failed(&self, kind: UpstreamError) -> Reply {
        failed(self.metrics, kind, &self.id.text())
    }

    /// Points the request at the upstream (absolute form, for the pooled client) and rewrites
    /// its headers for the hop.
    #[allow(clippy::result_large_err)]
    fn rewrite(&self, req: &mut Request<ReqBody>, added: &Added) -> Result<(), Reply> {
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
            Reply::whole(respond::error(
                StatusCode::BAD_REQUEST,
                "request target cannot be forwarded",
                &self.id.text(),
            ))
        })?;
        *req.version_mut() = Version::HTTP_2;

        let headers = req.headers_mut();
        // gRPC needs `TE: trailers` end to end; over HTTP/2 it is the one TE value allowed.
        let te_trailers = headers
            .get_all(header::TE)
            .iter()
            .any(|v| has_token(v.as_bytes(), b"trailers"));
        added.apply(headers);
        if te_trailers {
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        Ok(())
    }
}

// The client connection closes after these: what of the request body is still coming
// cannot be told from a next request.
const BAD_BODY: Refused = Refused::closing(
    StatusCode::BAD_REQUEST,
    Reason::Body,
    "the request body was malformed or ended early",
);
const BODY_TIMEOUT: Refused = Refused::closing(
    StatusCode::REQUEST_TIMEOUT,
    Reason::BodyTimeout,
    "the request body stopped coming",
);

/// The answer to a request the upstream did not answer, counted in `metrics` by `kind`.
pub(super) fn failed(metrics: &Metrics, kind: UpstreamError, id: &crate::ids::IdText) -> Reply {
    let refused = Refused::upstream(kind);
    metrics.refused(refused.reason).inc();
    Reply::refused(&refused, id)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upgrade_is_asked_for_with_connection_upgrade() {
        let mut h = HeaderMap::new();
        h.insert(header::UPGRADE, "websocket".parse().unwrap());
        assert_eq!(upgrade_asked(&h, &[UpgradeProtocol::Websocket]), None);
        h.insert(header::CONNECTION, "Upgrade".parse().unwrap());
        assert_eq!(
            upgrade_asked(&h, &[UpgradeProtocol::Websocket]),
            Some("websocket")
        );
        assert_eq!(upgrade_asked(&h, &[]), None);
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
