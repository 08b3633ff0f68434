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

use super::client::UpstreamConn;
use crate::proxy::deadlines::{Sleep, Timers};
use crate::proxy::protocol::{ClientConn, ConnSettings};

type Instant = tokio::time::Instant;

pub(super) async fn tunnel(
    s: ClientConn,
    upstream: UpstreamConn,
    lane: &ConnSettings,
) -> io::Result<()> {
    // Nothing else holds the socket: an upgrade has no body still coming.
    let Ok(mut client) = Arc::try_unwrap(s.stream) else {
        debug_assert!(false, "an upgraded connection's socket is shared");
        tracing::debug!("an upgraded connection's socket is shared: closed");
        return Ok(());
    };
    let (mut upstream, from_upstream, _place) = upstream.into_tunnel();
    let limit = Sleep::until(lane.timers.clone(), Timers::now() + lane.send);
    if !first_writes(&mut upstream, &s.buf, &mut client, &from_upstream, limit).await? {
        tracing::debug!("closed a tunnel whose first bytes were not taken within timeouts.send");
        return Ok(());
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

/// What each side sent past its head, written to the other before anything else moves:
/// `false` if `limit` (`timeouts.send`) fired first. A side that never reads would otherwise
/// hold the tunnel before its idle watch begins.
async fn first_writes<U, C>(
    upstream: &mut U,
    to_upstream: &[u8],
    client: &mut C,
    to_client: &[u8],
    limit: Sleep,
) -> io::Result<bool>
where
    U: AsyncWrite + Unpin,
    C: AsyncWrite + Unpin,
{
    let first = async {
        upstream.write_all(to_upstream).await?;
        client.write_all(to_client).await
    };
    match crate::proxy::deadlines::timeout(limit, first).await {
        Some(written) => written.map(|()| true),
        None => Ok(false),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The first writes to a side that never reads end when `timeouts.send` fires, whichever
    /// side it is; to sides that read, they complete. (In-process pipes: a real socket takes
    /// what one read of the other side brings into its kernel buffers, so a real peer that
    /// never reads does not block these writes unless its buffers were full before.)
    // Paused time: writes that wait forever end the test at once (tokio's timeout below
    // fires when nothing else can run), not after a wall-clock wait.
    #[tokio::test(start_paused = true)]
    async fn first_writes_to_a_side_that_never_reads_end_at_the_send_timeout() {
        let timers = Arc::new(Timers::default());
        let past_head = vec![b'x'; 4096];
        for stuck_upstream in [true, false] {
            // Each pipe holds 64 bytes until its far end reads; a stuck end is never read.
            let (mut upstream, upstream_far) = tokio::io::duplex(64);
            let (mut client, client_far) = tokio::io::duplex(64);
            let drain = |far: tokio::io::DuplexStream| {
                tokio::spawn(async move {
                    let mut far = far;
                    tokio::io::copy(&mut far, &mut tokio::io::sink()).await
                })
            };
            let (_stuck, reader) = if stuck_upstream {
                (upstream_far, drain(client_far))
            } else {
                (client_far, drain(upstream_far))
            };
            let t0 = Timers::now();
            let limit = Sleep::until(timers.clone(), t0 + Duration::from_secs(30));
            let fire = {
                let timers = timers.clone();
                async move {
                    // Both writes have done all they can (the reader drained what it had).
                    for _ in 0..100 {
                        tokio::task::yield_now().await;
                    }
                    timers.fire(t0 + Duration::from_secs(30));
                }
            };
            let (written, ()) = tokio::time::timeout(Duration::from_secs(3600), async {
                tokio::join!(
                    first_writes(&mut upstream, &past_head, &mut client, &past_head, limit),
                    fire
                )
            })
            .await
            .expect("the first writes ended");
            assert!(
                !written.expect("no write error"),
                "stuck upstream: {stuck_upstream}: the writes ended at the limit"
            );
            reader.abort();
        }
        // Both sides read: the writes complete, the limit never fires.
        let (mut upstream, upstream_far) = tokio::io::duplex(64);
        let (mut client, client_far) = tokio::io::duplex(64);
        let readers = [upstream_far, client_far].map(|mut far| {
            tokio::spawn(async move {
                let mut got = Vec::new();
                tokio::io::AsyncReadExt::read_to_end(&mut far, &mut got)
                    .await
                    .map(|_| got.len())
            })
        });
        let limit = Sleep::until(timers.clone(), Timers::now() + Duration::from_secs(30));
        let written = first_writes(&mut upstream, &past_head, &mut client, &past_head, limit).await;
        assert!(
            written.expect("no write error"),
            "both sides took their bytes"
        );
        drop((upstream, client));
        for r in readers {
            assert_eq!(r.await.expect("reader").expect("read"), past_head.len());
        }
    }
}
