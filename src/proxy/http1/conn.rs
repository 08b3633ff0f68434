//! A client connection's parts that the HTTP/1 server side and hyper's HTTP/2 server share: the
//! worker's [`Lane`], the connection's socket and buffers ([`Served`]) and the bound on its
//! writes ([`SendClock`]). Must never: do I/O of its own beyond a write's bound.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use hyper::server::conn::http2;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::proxy::coarse::{Sleep, Timers};
use crate::proxy::http2::stalls::Stalls;

pub(crate) use super::framing::READ;

/// What a worker's connections share.
pub struct Lane {
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
    /// Turns true when the worker drains.
    pub draining: watch::Receiver<bool>,
}

pub(crate) type Error = Box<dyn std::error::Error + Send + Sync>;

pub(crate) struct Served {
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
    pub(crate) fn new(lane: &Lane) -> Self {
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
