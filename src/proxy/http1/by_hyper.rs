//! The connections, and the requests, that hyper's server serves for the proxy: HTTP/2 (and an
//! HTTP/1 connection after an upgrade or a head it cannot take) for good ([`hand_off`]), and
//! one request whose body is streamed, after which the connection may come back
//! ([`by_hyper_once`]); each with its own head timer, and the HTTP/2 responses watched for a
//! client that never opens its window ([`Stalls`]). Must never: keep a connection past
//! `client_idle` without a stream, or take one back with bytes of a request left in hyper.

use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap};
use http::{Request, Response, Version};
use http_body::Frame;
use http_body_util::Either;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::conn::*;
use super::framing::has_token;
use super::stalls::*;
use crate::proxy::body::{Ended, ReqBody, Streamed};
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
    let heard = Arc::new(AtomicU32::new(0));
    let mut hyper = lane.hyper.clone();
    hyper.http1().timer(lane.head_timer(&heard));
    let io = TokioIo::new(Rewind {
        read: s.buf.freeze(),
        stream: s.stream,
        heard,
        once: None,
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

/// Serves one request whose body is streamed (a larger or chunked one, one still coming at
/// the head's deadline, one expecting `100 Continue`) with hyper's HTTP/1 server, and takes the
/// connection back when hyper is done with it and would keep it: the client's later requests
/// are this side's again, instead of hyper's for the rest of the connection. `None` when the
/// connection ended with hyper.
///
/// Back only when hyper is between requests with nothing left of this one: its body read to
/// the end (by the request path; one it left unread hyper drains or closes on), the response's
/// written to the end and out of hyper's buffer, and neither side asked to close. A second
/// request hyper read meanwhile (pipelined) leaves the connection with hyper, and so does a
/// second such request right after the first ([`serve`]).
pub(super) async fn by_hyper_once(
    s: Served,
    conn: &Arc<Conn>,
    lane: &Lane,
    mut drained: Pin<&mut impl Future>,
) -> Result<Option<Served>, Error> {
    let Served {
        stream,
        buf,
        out,
        clock,
        kept: _,
    } = s;
    let once = Arc::new(Once::default());
    let heard = Arc::new(AtomicU32::new(0));
    let mut h1 = lane.h1.clone();
    h1.timer(lane.head_timer(&heard));
    let io = TokioIo::new(Rewind {
        read: buf.freeze(),
        stream,
        heard,
        once: Some(once.clone()),
        clock,
    });
    let service = {
        let (conn, once) = (conn.clone(), once.clone());
        service_fn(move |req: Request<hyper::body::Incoming>| {
            let guard = AbandonGuard(Some(conn.clone()));
            let once = once.clone();
            // Boxed: hyper polls the connection by `&mut` only with an `Unpin` future.
            Box::pin(async move {
                let first = once.requests.fetch_add(1, Ordering::Relaxed) == 0;
                let keep = req.version() == Version::HTTP_11 && !asks_close(req.headers());
                let req = req.map(|b| {
                    Either::Left(match first {
                        true => Streamed::watched(b, once.read.clone()),
                        false => Streamed::new(b),
                    })
                });
                let resp = answer(guard, req).await;
                if first && keep && !asks_close(resp.headers()) {
                    once.keep.store(true, Ordering::Relaxed);
                }
                let once = first.then_some(once);
                Ok::<_, std::convert::Infallible>(resp.map(|body| Answered { body, once }))
            })
        })
    };
    let mut served = h1.serve_connection(io, service);
    // Set when this side asked hyper to finish: because the exchange is over, or the worker drains.
    let (mut over, mut draining) = (false, false);
    let ended = std::future::poll_fn(|cx| loop {
        if let Poll::Ready(r) = served.poll_without_shutdown(cx) {
            return Poll::Ready(r);
        }
        if !over && !draining && once.over() {
            over = true;
        } else if !draining && drained.as_mut().poll(cx).is_ready() {
            draining = true;
        } else {
            return Poll::Pending;
        }
        // Between requests, this ends the connection at once, giving back its parts.
        Pin::new(&mut served).graceful_shutdown();
    })
    .await;
    let back = ended.is_ok() && over && !draining && once.over();
    let parts = served.into_parts();
    let Rewind {
        read,
        mut stream,
        clock,
        ..
    } = parts.io.into_inner();
    if !back {
        let _ = stream.shutdown().await;
        return ended.map(|()| None).map_err(Into::into);
    }
    // What hyper read of the next request, then what it had not yet taken of ours.
    let mut buf = BytesMut::with_capacity(READ.max(parts.read_buf.len() + read.len()));
    buf.extend_from_slice(&parts.read_buf);
    buf.extend_from_slice(&read);
    Ok(Some(Served {
        stream,
        buf,
        out,
        clock,
        kept: true,
    }))
}

/// How the one exchange of [`by_hyper_once`] went.
#[derive(Default)]
pub(super) struct Once {
    /// Requests hyper has handed to the request path.
    pub(super) requests: AtomicU32,
    /// The first one's body was read to its end.
    pub(super) read: Arc<Ended>,
    /// Its response's body was written to its end.
    pub(super) answered: AtomicBool,
    /// Neither it nor its response asked to close (and it is HTTP/1.1).
    pub(super) keep: AtomicBool,
    /// hyper's last write did not take all it was given: bytes may wait in its buffer.
    pub(super) blocked: AtomicBool,
}

impl Once {
    /// hyper is between requests, with nothing of the first left.
    pub(super) fn over(&self) -> bool {
        self.requests.load(Ordering::Relaxed) == 1
            && self.read.is_set()
            && self.answered.load(Ordering::Relaxed)
            && self.keep.load(Ordering::Relaxed)
            && !self.blocked.load(Ordering::Relaxed)
    }
}

/// Whether a request's or a response's `Connection` says `close`.
pub(super) fn asks_close(headers: &HeaderMap) -> bool {
    let connection = headers.get_all(header::CONNECTION);
    connection.iter().any(|v| has_token(v.as_bytes(), b"close"))
}

pin_project_lite::pin_project! {
    /// A response body that says when hyper has read it to its end.
    struct Answered {
        #[pin]
        body: Body,
        once: Option<Arc<Once>>,
    }
}

impl Answered {
    pub(super) fn over(&self, over: bool) -> bool {
        if let (true, Some(once)) = (over, &self.once) {
            once.answered.store(true, Ordering::Relaxed);
        }
        over
    }
}

impl http_body::Body for Answered {
    type Data = <Body as http_body::Body>::Data;
    type Error = <Body as http_body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = self.as_mut().project().body.poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.over(true),
            Poll::Ready(Some(Ok(_))) => self.over(self.body.is_end_stream()),
            _ => false,
        };
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.over(self.body.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A connection with bytes already read from it in front.
pub(super) struct Rewind {
    pub(super) read: Bytes,
    pub(super) stream: TcpStream,
    /// Counts the reads from `stream` that brought bytes, for hyper's head timer
    /// ([`HeadTimer`]).
    pub(super) heard: Arc<AtomicU32>,
    /// Told whether each write took everything (see [`by_hyper_once`]).
    pub(super) once: Option<Arc<Once>>,
    /// hyper's writes are bounded by `timeouts.send` too.
    pub(super) clock: SendClock,
}

impl Rewind {
    pub(super) fn wrote<T>(&self, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if let Some(once) = &self.once {
            once.blocked.store(polled.is_pending(), Ordering::Relaxed);
        }
        polled
    }
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
        let polled = this.clock.bound(cx, polled);
        this.wrote(polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        let polled = this.clock.bound(cx, polled);
        this.wrote(polled)
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
