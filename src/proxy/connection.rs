//! A client connection from its accept to its end: which protocol it speaks (HTTP/2 when its
//! first bytes are the preface, RFC 9113 §3.4; HTTP/1 otherwise), handed whole to that
//! protocol's server with the request path as its [`Handler`]; and its budget of abandoned
//! requests, past which it is closed (rapid reset).
//!
//! Must never: read past what decides the protocol (the bytes read stay in the connection's
//! buffer for its server), or wait for them longer than the first head may take
//! (`timeouts.header_read` from the accept).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;

use atomic_waker::AtomicWaker;
use tokio::net::TcpStream;

use super::deadlines::Sleep;
use super::http1;
use super::http2;
use super::protocol::{ClientConn, ConnSettings, Error, Handler};

/// The HTTP/2 connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Requests one connection may abandon per second (an HTTP/2 RST_STREAM before the response,
/// or the client gone) before the proxy closes it: the rapid-reset attack (CVE-2023-44487)
/// makes the server start work for streams it cancels at once, thousands per second. An
/// HTTP/1 connection abandons at most one request, when it closes.
pub(super) const ABANDON_BUDGET: u32 = 200;

/// Abandoned requests of one connection in the current second, and the trip that closes it
/// when they spend its budget: its task's waker, and whether it must end now ([`until_tripped`]).
#[derive(Default)]
pub(super) struct Abandoned {
    // Relaxed: a rate bound; a race miscounts by one.
    second: AtomicU64,
    count: AtomicU32,
    tripped: AtomicBool,
    task: AtomicWaker,
}

impl Abandoned {
    /// One more abandoned in second `now`; when that spent the connection's budget, the
    /// connection is tripped (its task woken to end it, with every stream on it). Whether it was.
    pub(super) fn abandon(&self, now: u64) -> bool {
        if self.second.swap(now, Ordering::Relaxed) != now {
            self.count.store(0, Ordering::Relaxed);
        }
        let spent = self.count.fetch_add(1, Ordering::Relaxed) + 1 == ABANDON_BUDGET;
        if spent {
            // SeqCst pairs with `until_tripped`'s register then load: either it sees the flag
            // or this wakes the registered task.
            self.tripped.store(true, Ordering::SeqCst);
            self.task.wake();
        }
        spent
    }
}

/// Polls `served` (a client connection) until it ends (`Some`) or `abandoned` trips it
/// (`None`: the caller drops it).
///
/// Takes the connection's future pinned where it was made: a future taken by value would be
/// kept twice in this one's state (as the argument, and moved into the pinned local), doubling
/// each connection's task.
pub(super) async fn until_tripped<F: Future>(
    mut served: Pin<&mut F>,
    abandoned: &Abandoned,
) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        abandoned.task.register(cx.waker());
        if abandoned.tripped.load(Ordering::SeqCst) {
            return Poll::Ready(None);
        }
        served.as_mut().poll(cx).map(Some)
    })
    .await
}

/// The future a worker's connection task waits on while it drains: made once per connection
/// (waiting on it costs nothing per request), pinned by the task and lent to [`told`] and then
/// to the [`Served`] connection.
pub(super) fn drained(lane: &ConnSettings) -> impl Future<Output = ()> + Send + use<> {
    let mut draining = lane.draining.clone();
    async move {
        let _ = draining.wait_for(|d| *d).await;
    }
}

/// The client connection `stream`, told which protocol it speaks; `None` when it closed, was
/// silent past `header_read` or the worker drains first.
pub(super) async fn told(
    stream: TcpStream,
    lane: &ConnSettings,
    drained: Pin<&mut impl Future>,
) -> io::Result<Option<(ClientConn, Protocol)>> {
    let mut s = ClientConn::new(stream, lane);
    Ok(speaks(&mut s, lane, drained)
        .await?
        .map(|protocol| (s, protocol)))
}

/// Serves the told connection `s` with `handler` until it ends: the future its task polls,
/// one of the two servers' own (not one awaiting it, which would be a poll more per wake).
pub(super) fn serve<'a, H: Handler, D: Future>(
    (s, protocol): (ClientConn, Protocol),
    handler: Arc<H>,
    lane: &'a ConnSettings,
    drained: Pin<&'a mut D>,
) -> Served<
    impl Future<Output = Result<(), Error>> + 'a,
    impl Future<Output = Result<(), Error>> + 'a,
> {
    match protocol {
        Protocol::Http1 => Served::Http1 {
            server: http1::server::serve(s, handler, lane, drained),
        },
        Protocol::Http2 => Served::Http2 {
            server: http2::serve(s, handler, lane, drained),
        },
    }
}

pin_project_lite::pin_project! {
    /// A client connection being served by the server of its protocol.
    #[project = ServedProj]
    pub(super) enum Served<A, B> {
        Http1 { #[pin] server: A },
        Http2 { #[pin] server: B },
    }
}

impl<A, B> Future for Served<A, B>
where
    A: Future<Output = Result<(), Error>>,
    B: Future<Output = Result<(), Error>>,
{
    type Output = Result<(), Error>;

    #[inline]
    fn poll(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match self.project() {
            ServedProj::Http1 { server } => server.poll(cx),
            ServedProj::Http2 { server } => server.poll(cx),
        }
    }
}

#[derive(Debug, PartialEq)]
pub(super) enum Protocol {
    Http1,
    Http2,
}

/// Which protocol `s` speaks, read from its first bytes into its buffer: as soon as they part
/// from the preface (at the first byte for every HTTP/1 method but `PRI`), or when the whole
/// preface came. `None`: closed, silent past `header_read`, or the worker drains first.
async fn speaks(
    s: &mut ClientConn,
    lane: &ConnSettings,
    mut drained: Pin<&mut impl Future>,
) -> io::Result<Option<Protocol>> {
    let mut deadline = Sleep::until(lane.timers.clone(), s.opened + lane.header_read);
    loop {
        if let Some(protocol) = decided(&s.buf) {
            return Ok(Some(protocol));
        }
        // Nothing else holds the socket before the first request.
        let Some(stream) = Arc::get_mut(&mut s.stream) else {
            return Ok(Some(Protocol::Http1));
        };
        let read = tokio::select! {
            biased;
            read = tokio::io::AsyncReadExt::read_buf(stream, &mut s.buf) => read,
            _ = &mut deadline => return Ok(None),
            _ = drained.as_mut(), if s.buf.is_empty() => return Ok(None),
        };
        match read {
            Ok(0) => return Ok(None),
            Ok(_) => {}
            Err(e) if http1::server::is_gone(&e) => return Ok(None),
            Err(e) => return Err(e),
        }
    }
}

/// The protocol `first` (a connection's first bytes) says, or `None` until more come.
fn decided(first: &[u8]) -> Option<Protocol> {
    let n = first.len().min(PREFACE.len());
    if first[..n] != PREFACE[..n] {
        Some(Protocol::Http1)
    } else if n == PREFACE.len() {
        Some(Protocol::Http2)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_hyper_s_only_when_its_first_bytes_are_the_preface() {
        let decide = decided;
        assert_eq!(decide(b"G"), Some(Protocol::Http1));
        assert_eq!(decide(b"POST / HTTP/1.1\r\n"), Some(Protocol::Http1));
        assert_eq!(decide(b"PRI * HTTP/1.1\r\n\r\n"), Some(Protocol::Http1));
        assert_eq!(decide(b"PRI * HTTP/2.0\r\n"), None, "more is read");
        assert_eq!(decide(PREFACE), Some(Protocol::Http2));
        assert_eq!(decide(b""), None);
    }

    #[tokio::test]
    async fn a_tripped_connection_ends_at_once_and_its_future_is_not_kept_twice() {
        let abandoned = Abandoned::default();
        let large = [0u8; 4096];
        let served = std::pin::pin!(async move { std::hint::black_box(large).len() });
        let until = until_tripped(served, &abandoned);
        assert!(
            std::mem::size_of_val(&until) < 256,
            "the trip's future is {} bytes for a connection future of 4 KiB",
            std::mem::size_of_val(&until)
        );
        assert_eq!(
            until.await,
            Some(4096),
            "a connection that ends is served to its end"
        );
        let tripped = Abandoned::default();
        for _ in 0..ABANDON_BUDGET {
            tripped.abandon(1);
        }
        let never = std::pin::pin!(std::future::pending::<()>());
        assert_eq!(until_tripped(never, &tripped).await, None);
    }

    #[test]
    fn a_trip_wakes_the_connections_task_that_waits_and_ends_it() {
        use std::sync::atomic::AtomicUsize;
        use std::task::{Context, Wake, Waker};
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let woken = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(woken.clone());
        let mut cx = Context::from_waker(&waker);
        let abandoned = Abandoned::default();
        let never = std::pin::pin!(std::future::pending::<()>());
        let mut until = std::pin::pin!(until_tripped(never, &abandoned));
        assert!(
            until.as_mut().poll(&mut cx).is_pending(),
            "served while not tripped"
        );
        for _ in 1..ABANDON_BUDGET {
            abandoned.abandon(3);
        }
        assert_eq!(woken.0.load(Ordering::SeqCst), 0, "within the budget");
        abandoned.abandon(3);
        assert_eq!(
            woken.0.load(Ordering::SeqCst),
            1,
            "the waiting task is woken"
        );
        assert_eq!(until.as_mut().poll(&mut cx), Poll::Ready(None));
    }

    #[test]
    fn the_abandon_budget_is_spent_at_its_count_within_one_second() {
        let a = Abandoned::default();
        for _ in 1..ABANDON_BUDGET {
            assert!(!a.abandon(7));
        }
        assert!(!a.tripped.load(Ordering::SeqCst));
        assert!(a.abandon(7), "the budget's last");
        assert!(
            a.tripped.load(Ordering::SeqCst),
            "and the connection tripped"
        );
        let b = Abandoned::default();
        for i in 0..3 * ABANDON_BUDGET {
            assert!(
                !b.abandon(u64::from(i / (ABANDON_BUDGET - 1))),
                "a new second starts over"
            );
        }
        assert!(!b.tripped.load(Ordering::SeqCst));
    }
}
