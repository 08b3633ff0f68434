//! The connections that hyper's server serves for the proxy, for good ([`hand_off`]): HTTP/2,
//! and an HTTP/1 connection from an upgrade or a head this side does not take; with its own
//! head timer, and the HTTP/2 responses watched for a client that never opens its window
//! ([`Stalls`]). Must never: keep a connection past `client_idle` without a stream.

use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::{Request, Response, Version};
use http_body::Frame;
use http_body_util::Either;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::conn::*;
use super::stalls::*;
use crate::proxy::body::{ReqBody, Streamed};
use crate::proxy::coarse::{Sleep, Timers};
use crate::proxy::request::{handle, AbandonGuard, Conn};
use crate::proxy::respond::{self, Body};

/// Serves the rest of the connection with hyper's server: the bytes read so far first.
pub(super) async fn hand_off(
    s: Served,
    conn: Arc<Conn>,
    lane: &Lane,
    drained: Pin<&mut impl Future>,
) -> Result<(), Error> {
    // The HTTP/2 connection preface (RFC 9113 §3.4), which went to hyper as no HTTP/1 head.
    let h2 = s.buf.starts_with(b"PRI * HTTP/2.0\r\n");
    // No streamed body of an earlier request holds the socket by now (its request is gone);
    // if one still did, the connection could not be handed over whole.
    let Ok(stream) = Arc::try_unwrap(s.stream) else {
        return Ok(());
    };
    let heard = Arc::new(AtomicU32::new(0));
    let mut hyper = lane.hyper.clone();
    hyper.http1().timer(lane.head_timer(&heard));
    let io = TokioIo::new(Rewind {
        read: s.buf.freeze(),
        stream,
        heard,
        clock: s.clock,
    });
    let stalls = lane.stalls.clone();
    let open = Arc::new(Open::default());
    let watched = open.clone();
    let service = service_fn(move |req: Request<hyper::body::Incoming>| {
        // Made with the request's future, so that one dropped before its first poll (an
        // HTTP/2 stream reset at once) counts as abandoned too.
        let guard = AbandonGuard(Some(conn.clone()));
        let busy = Busy::new(&open);
        let version = req.version();
        let req = req.map(|b| Either::Left(Streamed::new(b)));
        let stalls = stalls.clone();
        async move {
            // An HTTP/2 client's streams use at most `max_upstream_per_client` upstream
            // connections at once: the others wait for a place, then get 503.
            let slot = match version == Version::HTTP_2 {
                true => match guard.conn().stream_slot().await {
                    Ok(slot) => slot,
                    Err(mut refused) => {
                        guard.disarm();
                        respond::whole(&mut refused);
                        return Ok(refused.map(|b| Counted {
                            body: stalls.guard(b, version, None),
                            _busy: busy,
                        }));
                    }
                },
                false => None,
            };
            let resp = answer(guard, req).await;
            Ok::<_, std::convert::Infallible>(resp.map(|b| Counted {
                body: stalls.guard(b, version, slot),
                _busy: busy,
            }))
        }
    });
    let mut served = pin!(hyper.serve_connection_with_upgrades(io, service));
    // An HTTP/2 connection without a stream for `client_idle` is closed with GOAWAY; an
    // HTTP/1 one's idle wait is its head timer's.
    let idle = async {
        match h2 {
            true => watched.idle(&lane.timers, lane.client_idle).await,
            false => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        done = served.as_mut() => done,
        _ = drained => {
            served.as_mut().graceful_shutdown();
            served.await
        }
        () = idle => {
            served.as_mut().graceful_shutdown();
            // h2 sends its last GOAWAY once the client answers a PING: one that never does
            // is dropped after another `client_idle`.
            let limit = Sleep::until(lane.timers.clone(), Timers::now() + lane.client_idle);
            crate::proxy::coarse::timeout(limit, served).await.unwrap_or(Ok(()))
        }
    }
}

/// The requests open on an HTTP/2 connection hyper serves, for closing it once it has had
/// none for `timeouts.client_idle`.
#[derive(Default)]
pub(super) struct Open {
    /// Requests whose response body has not ended or been dropped (Relaxed: one thread).
    pub(super) count: AtomicU32,
    /// Requests begun: an idle spell that saw one start is over.
    pub(super) begun: AtomicU32,
    /// Told when `count` falls to zero.
    pub(super) none: tokio::sync::Notify,
}

impl Open {
    /// Ready once the connection has had no open request for `idle`.
    async fn idle(&self, timers: &Arc<Timers>, idle: Duration) {
        loop {
            let mut none = pin!(self.none.notified());
            none.as_mut().enable();
            if self.count.load(Ordering::Relaxed) != 0 {
                none.await;
                continue;
            }
            let spell = self.begun.load(Ordering::Relaxed);
            Sleep::until(timers.clone(), Timers::now() + idle).await;
            if self.count.load(Ordering::Relaxed) == 0
                && self.begun.load(Ordering::Relaxed) == spell
            {
                return;
            }
        }
    }
}

/// One open request of an [`Open`], from its head to its response body's end.
pub(super) struct Busy(Arc<Open>);

impl Busy {
    pub(super) fn new(open: &Arc<Open>) -> Self {
        open.count.fetch_add(1, Ordering::Relaxed);
        open.begun.fetch_add(1, Ordering::Relaxed);
        Busy(open.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.none.notify_waiters();
        }
    }
}

/// A response body that keeps its request counted open until hyper drops it.
pub(super) struct Counted {
    pub(super) body: Guarded,
    pub(super) _busy: Busy,
}

impl http_body::Body for Counted {
    type Data = <Guarded as http_body::Body>::Data;
    type Error = <Guarded as http_body::Body>::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A request of hyper's server through the request path, and its answer with the map filled
/// in (hyper's server writes from it). `guard` is made with the request's future, so that one
/// dropped before its first poll (an HTTP/2 stream reset at once) counts as abandoned too.
pub(super) async fn answer(guard: AbandonGuard, mut req: Request<ReqBody>) -> Response<Body> {
    let mut resp = handle(guard.conn(), &mut req).await;
    guard.disarm();
    respond::whole(&mut resp);
    resp
}

/// A connection with bytes already read from it in front.
pub(super) struct Rewind {
    pub(super) read: Bytes,
    pub(super) stream: TcpStream,
    /// Counts the reads from `stream` that brought bytes, for hyper's head timer
    /// ([`HeadTimer`]).
    pub(super) heard: Arc<AtomicU32>,
    /// hyper's writes are bounded by `timeouts.send` too.
    pub(super) clock: SendClock,
}

impl AsyncRead for Rewind {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.read.is_empty() {
            let n = this.read.len().min(buf.remaining());
            buf.put_slice(&this.read[..n]);
            this.read.advance(n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.heard.fetch_add(1, Ordering::Relaxed);
        }
        polled
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.clock.bound(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.clock.bound(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
