//! What the connection owner (`connection`) gives both protocol servers (`http1`, `http2`):
//! the worker's settings for its connections ([`ConnSettings`]), a connection's socket and buffers
//! ([`ClientConn`]), the bound on its writes ([`SendClock`]), and the request path as a
//! [`Handler`] they hand each request to, statically dispatched. With it a protocol server
//! imports nothing of the request path, the forward, or the other protocol.
//!
//! Must never: do I/O of its own beyond a write's bound, or name the request path's types.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use http::Request;
use hyper::server::conn::http2;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpStream;
use tokio::sync::{watch, OwnedSemaphorePermit};
use tokio::time::Instant;

use crate::proxy::body::ReqBody;
use crate::proxy::deadlines::{Sleep, Timers};
use crate::proxy::http2::held::Budget;
use crate::proxy::http2::stalls::Stalls;
use crate::proxy::response::Reply;

pub(crate) use crate::proxy::http1::framing::READ;

/// The request path, as a protocol server sees it.
pub(crate) trait Handler: Send + Sync + 'static {
    /// `req`'s answer. Borrows `req`: a request moved down the layers of futures is copied at
    /// each; what is left of it is the caller's to drop.
    fn handle<'a>(
        &'a self,
        req: &'a mut Request<ReqBody>,
    ) -> impl Future<Output = Reply> + Send + 'a;

    /// A place for an HTTP/2 stream among the upstream connections one client may use at once,
    /// held until its response body ends (`None`: no such bound); `Err` with the answer when
    /// none came free.
    fn stream_slot(
        &self,
    ) -> impl Future<Output = Result<Option<OwnedSemaphorePermit>, Reply>> + Send + '_;

    /// A head the protocol refused, counted by its reason.
    fn refused(&self, reason: crate::metrics::Reason);

    /// A request was abandoned before its answer: its client left, or reset its stream.
    fn abandoned(&self);
}

/// Counts its request as abandoned ([`Handler::abandoned`]) when dropped before
/// [`disarm`](Self::disarm).
pub(crate) struct Abandon<H: Handler>(Option<Arc<H>>);

impl<H: Handler> Abandon<H> {
    pub(crate) fn new(handler: &Arc<H>) -> Self {
        Abandon(Some(handler.clone()))
    }

    pub(crate) fn handler(&self) -> &H {
        self.0.as_ref().expect("armed until disarmed")
    }

    pub(crate) fn disarm(mut self) {
        self.0 = None;
    }
}

impl<H: Handler> Drop for Abandon<H> {
    fn drop(&mut self) {
        if let Some(handler) = self.0.take() {
            handler.abandoned();
        }
    }
}

/// What a worker's connections share.
pub struct ConnSettings {
    /// hyper's HTTP/2 server, for the connections that begin with its preface.
    pub hyper: http2::Builder<TokioExecutor>,
    /// A partial head at least this long is answered 431.
    pub max_head: usize,
    pub header_read: Duration,
    /// `timeouts.client_idle`: the wait for a kept-alive connection's next request.
    pub client_idle: Duration,
    /// `timeouts.send`: a client that takes no byte of a response for this long is dropped.
    pub send: Duration,
    /// `timeouts.upstream_body_idle`: a response body silent this long is given up, counted
    /// in `body_idle`.
    pub body_idle: Duration,
    pub body_idle_errors: prometheus::IntCounter,
    /// The worker's timers (the header-read and send deadlines).
    pub timers: Arc<Timers>,
    /// The worker's HTTP/2 responses, watched for a window that stays shut.
    pub stalls: Arc<Stalls>,
    /// The process's budget of HTTP/2 response bytes held (`limits.max_response_buffer`).
    pub h2_budget: Arc<Budget>,
    /// Turns true when the worker drains.
    pub draining: watch::Receiver<bool>,
}

pub(crate) type Error = Box<dyn std::error::Error + Send + Sync>;

pub(crate) struct ClientConn {
    /// When the connection was accepted: its first head is due `header_read` after.
    pub(crate) opened: Instant,
    /// Shared with a streamed request body while it is read.
    pub(crate) stream: Arc<TcpStream>,
    /// Read and not yet used.
    pub(crate) buf: BytesMut,
    /// The response head being written, kept for the next one.
    pub(crate) out: Vec<u8>,
    /// Bounds how long a write may wait for the client to take bytes.
    pub(crate) clock: SendClock,
    /// A response was written and the connection kept: the next wait is `client_idle`'s.
    pub(crate) kept: bool,
    /// `timeouts.upstream_body_idle`, and where giving up a body for it is counted.
    pub(crate) body_idle: (Duration, prometheus::IntCounter),
}

impl ClientConn {
    pub(crate) fn new(stream: TcpStream, lane: &ConnSettings) -> Self {
        ClientConn {
            opened: Timers::now(),
            stream: Arc::new(stream),
            buf: BytesMut::with_capacity(READ),
            out: Vec::with_capacity(512),
            clock: SendClock::new(lane),
            kept: false,
            body_idle: (lane.body_idle, lane.body_idle_errors.clone()),
        }
    }
}

/// `timeouts.send` for a client's writes (nginx's `send_timeout`): a write that takes no byte
/// for that long fails, and the connection with it (its request's slots are freed as the
/// response is dropped). Armed only when a write has to wait: a client that keeps up costs
/// nothing.
pub(crate) struct SendClock {
    pub(crate) timers: Arc<Timers>,
    pub(crate) limit: Duration,
    pub(crate) wait: Option<Sleep>,
    pub(crate) timeouts: prometheus::IntCounter,
}

impl SendClock {
    pub(crate) fn new(lane: &ConnSettings) -> Self {
        SendClock {
            timers: lane.timers.clone(),
            limit: lane.send,
            wait: None,
            timeouts: lane.stalls.timeouts.clone(),
        }
    }

    /// A write's outcome, `polled`, with the wait bounded: pending arms the deadline (once per
    /// wait), past it the write fails; any progress disarms it.
    pub(crate) fn bound<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.wait = None;
            return polled;
        }
        let (timers, limit) = (&self.timers, self.limit);
        let wait = self
            .wait
            .get_or_insert_with(|| Sleep::until(timers.clone(), Timers::now() + limit));
        match Pin::new(wait).poll(cx) {
            Poll::Ready(()) => {
                self.timeouts.inc();
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client took no bytes within timeouts.send",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
