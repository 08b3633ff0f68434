//! HTTP/2 client connections, which hyper's server serves from their preface on ([`serve`],
//! handed the connection by `proxy::connection`, which read the preface), each stream through
//! the request path the connection was given (its `Handler`), as an HTTP/1 request is; its
//! response watched for a client that never opens its window ([`Stalls`]), at most
//! `max_upstream_per_client` of its streams at the upstream at once; one without a stream is
//! closed for a new client at `max_connections`, as an idle kept-alive HTTP/1 connection is.
//! Must never: keep a connection past `client_idle` without a stream.

pub(crate) mod held;
pub(crate) mod stalls;

use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::{Request, Response};
use http_body_util::Either;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::proxy::body::{ReqBody, Streamed};
use crate::proxy::deadlines::{Sleep, Timers};
use crate::proxy::protocol::*;
use crate::proxy::response::{self, Body};
use stalls::*;

/// How long a connection closed for a new client's place may take to answer its GOAWAY.
const ROOM_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Serves an HTTP/2 connection with hyper's server, its streams answered by `handler`: the
/// bytes read so far (its preface, or what came of it) first.
pub(in crate::proxy) async fn serve<H: Handler>(
    s: ClientConn,
    handler: Arc<H>,
    lane: &ConnSettings,
    drained: Pin<&mut impl Future>,
) -> Result<(), Error> {
    let opened = s.opened;
    // Only a connection's first bytes are a preface: no request body holds the socket.
    let Ok(stream) = Arc::try_unwrap(s.stream) else {
        return Ok(());
    };
    let held = lane.h2_budget.open();
    let io = TokioIo::new(Rewind {
        read: s.buf.freeze(),
        stream,
        clock: s.clock,
        held: held.clone(),
    });
    let shed = held.clone();
    let stalls = lane.stalls.clone();
    let open = Arc::new(Open::default());
    let watched = open.clone();
    let service = service_fn(move |req: Request<hyper::body::Incoming>| {
        // Made with the request's future, so that one dropped before its first poll (an
        // HTTP/2 stream reset at once) counts as abandoned too.
        let guard = Abandon::new(&handler);
        let busy = Busy::new(&open);
        let req = req.map(|b| Either::Left(Streamed::new(b)));
        let stalls = stalls.clone();
        let held = held.clone();
        // Boxed whole, the request in it: hyper moves each stream's future (into its task and
        // about), and the request path's is large; one allocation costs less than its copies
        // (BENCHMARKS.md, issue 49).
        Box::pin(async move {
            // A client's streams use at most `max_upstream_per_client` upstream connections
            // at once: the others wait for a place, then get 503.
            let slot = match guard.handler().stream_slot().await {
                Ok(slot) => slot,
                Err(refused) => {
                    guard.disarm();
                    let refused = refused.into_http();
                    return Ok(refused.map(|b| stalls.guard(b, None, busy, &held)));
                }
            };
            let resp = answer(guard, req).await;
            let idle = resp.extensions().get::<response::BodyIdle>().map(|b| b.0);
            Ok::<_, std::convert::Infallible>(
                resp.map(|b| stalls.guard(b, slot, busy, &held).idle_after(idle)),
            )
        })
    });
    let mut served = pin!(lane.hyper.serve_connection(io, service));
    // A connection without a stream for `client_idle` is closed with GOAWAY; one that has
    // sent none within `header_read` of its accept too, as an HTTP/1 connection that never
    // sends its first head is closed.
    let idle = watched.idle(&lane.timers, opened + lane.header_read, lane.client_idle);
    let done = tokio::select! {
        biased;
        done = served.as_mut() => done,
        // The process holds its budget of response bytes, this connection the most: it is
        // closed, and what hyper held for it freed.
        () = shed.shed.notified() => return Ok(()),
        _ = drained => {
            served.as_mut().graceful_shutdown();
            tokio::select! {
                done = served => done,
                () = shed.shed.notified() => return Ok(()),
            }
        }
        for_room = idle => {
            served.as_mut().graceful_shutdown();
            // h2 sends its last GOAWAY once the client answers a PING: one that never does
            // is dropped after another `client_idle` (`header_read` before a first request;
            // a second when a new client waits for the place).
            let never = watched.begun.load(std::sync::atomic::Ordering::Relaxed) == 0;
            let grace = match (for_room, never) {
                (true, _) => ROOM_GRACE,
                (false, true) => lane.header_read,
                (false, false) => lane.client_idle,
            };
            let limit = Sleep::until(lane.timers.clone(), Timers::now() + grace);
            tokio::select! {
                done = crate::proxy::deadlines::timeout(limit, served) => done.unwrap_or(Ok(())),
                () = shed.shed.notified() => return Ok(()),
            }
        }
    };
    Ok(done?)
}

/// A request of hyper's server through the request path, and its answer with the map filled
/// in (hyper's server writes from it). `guard` is made with the request's future, so that one
/// dropped before its first poll (an HTTP/2 stream reset at once) counts as abandoned too.
pub(super) async fn answer<H: Handler>(
    guard: Abandon<H>,
    mut req: Request<ReqBody>,
) -> Response<Body> {
    let resp = guard.handler().handle(&mut req).await;
    guard.disarm();
    resp.into_http()
}

/// A connection with bytes already read from it in front.
pub(super) struct Rewind {
    pub(super) read: Bytes,
    pub(super) stream: TcpStream,
    /// hyper's writes are bounded by `timeouts.send` too.
    pub(super) clock: SendClock,
    /// What the connection's responses hold, less what is written.
    pub(super) held: Arc<held::Held>,
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
        Pin::new(&mut this.stream).poll_read(cx, buf)
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
        match polled {
            Poll::Ready(Ok(n)) => this.held.wrote(n),
            Poll::Pending => this.held.blocked(true),
            _ => {}
        }
        this.clock.bound(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        match polled {
            Poll::Ready(Ok(n)) => this.held.wrote(n),
            Poll::Pending => this.held.blocked(true),
            _ => {}
        }
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
