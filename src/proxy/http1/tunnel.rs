//! An upgraded connection (a WebSocket): the bytes each side sent past its head first, then
//! everything both ways, untouched, until both sides are done or neither has sent anything for
//! `timeouts.client_idle` (as nginx ends one at `proxy_read_timeout`).
//!
//! Owns the tunnel's copy and its idle watch. Must never: read or change what goes through, or
//! outlive its response (which holds the request's concurrency slots).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _, ReadBuf};

use super::client::Raw;
use super::conn::{Lane, Served};
use crate::proxy::coarse::{Sleep, Timers};

type Instant = tokio::time::Instant;

pub(super) async fn tunnel(s: Served, upstream: Raw, lane: &Lane) -> io::Result<()> {
    // Nothing else holds the socket: an upgrade has no body still coming.
    let Ok(mut client) = Arc::try_unwrap(s.stream) else {
        debug_assert!(false, "an upgraded connection's socket is shared");
        tracing::debug!("an upgraded connection's socket is shared: closed");
        return Ok(());
    };
    let (mut upstream, from_upstream, _place) = upstream.into_tunnel();
    // What each side sent past its head goes to the other first, within `timeouts.send`
    // (a side that never reads would hold the tunnel before its idle watch begins).
    let first = async {
        upstream.write_all(&s.buf).await?;
        client.write_all(&from_upstream).await
    };
    let limit = Sleep::until(lane.timers.clone(), Timers::now() + lane.send);
    match crate::proxy::coarse::timeout(limit, first).await {
        Some(written) => written?,
        None => {
            tracing::debug!(
                "closed a tunnel whose first bytes were not taken within timeouts.send"
            );
            return Ok(());
        }
    }
    let start = Timers::now();
    let last = AtomicU64::new(0);
    let mut client = Watched {
        io: client,
        start,
        last: &last,
    };
    let mut upstream = Watched {
        io: upstream,
        start,
        last: &last,
    };
    let mut copy = std::pin::pin!(tokio::io::copy_bidirectional(&mut client, &mut upstream));
    loop {
        let since = std::time::Duration::from_nanos(last.load(Ordering::Relaxed));
        let due = start + since + lane.client_idle;
        tokio::select! {
            copied = &mut copy => return copied.map(drop),
            // Past `due`: closed, unless bytes moved meanwhile (then the wait starts again).
            () = Sleep::until(lane.timers.clone(), due) => {
                if last.load(Ordering::Relaxed) == since.as_nanos() as u64 {
                    tracing::debug!("closed a tunnel idle for client_idle");
                    return Ok(());
                }
            }
        }
    }
}

/// One side of the tunnel, noting when bytes last moved through it.
struct Watched<'a, T> {
    io: T,
    start: Instant,
    /// Nanoseconds since `start`, shared by both sides.
    last: &'a AtomicU64,
}

impl<T> Watched<'_, T> {
    fn moved(&self) {
        let at = self.start.elapsed().as_nanos() as u64;
        self.last.store(at, Ordering::Relaxed);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<'_, T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.moved();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<'_, T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, b);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.moved();
        }
        polled
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
