//! One upstream connection per HTTP/1 client connection, driven by that connection's own task.
//!
//! hyper-util's pooled client runs every upstream connection as a task of its own, so a request
//! crosses from the client connection's task to the upstream connection's task through a
//! channel, and its response crosses back through another: two trips through the runtime's
//! queue per request (each behind every other ready connection), plus the pool's lock and
//! checkout. An HTTP/1 client connection sends its requests one at a time, so it can keep one
//! upstream connection of its own and poll it from its own task ([`drive`]): the request is
//! written upstream in the poll that read it, and the response is written back in the poll that
//! read it, as nginx's event loop does. Measured in BENCHMARKS.md.
//!
//! Cost per request: one uncontended lock to take the sender and one to put it back, hyper's
//! dispatch (a oneshot for the response). A connect only when there is no usable connection:
//! the first request, after the upstream closed it, or after [`Upstream::idle`] unused.
//!
//! Used for HTTP/1 requests to an HTTP/1 upstream without an upgrade; HTTP/2 client
//! connections (concurrent streams, each a task of hyper's), upgrades and `h2c://` upstreams
//! keep the pooled client. When a client connection ends between requests, its upstream
//! connection waits in the worker's [`Idle`] list for the next client connection (clients
//! that close after each request do not cost a connect each), and is closed once unused for
//! `timeouts.idle`. A client connection's first request goes through the worker's pool when
//! there is no idle connection to take, so only clients that come back get a connection of
//! their own; and a worker makes at most [`MAX_CONNECTING`] connects at once (the others wait
//! their turn). Both keep a burst of new clients from overflowing the app's accept backlog
//! (128 for a tokio listener; SYNs dropped there are retried only after a second, the default
//! connect timeout).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use atomic_waker::AtomicWaker;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::forward::Failure;

type Driver = Pin<Box<http1::Connection<TokioIo<TcpStream>, Incoming>>>;

/// Where and how to connect.
pub struct Upstream {
    /// `host:port` (port 80 when the configuration gave none).
    pub address: String,
    pub connect_timeout: Duration,
    /// An upstream connection unused for this long is not reused (the upstream may be closing
    /// it at this very moment); nanoseconds.
    pub idle: u64,
}

/// The upstream connection of one client connection.
pub struct Affine {
    // Locked only by the one task serving the client connection, never across an await: never
    // contended.
    #[allow(clippy::disallowed_types)]
    state: std::sync::Mutex<State>,
    /// The connection task's wakes (see [`drive`]).
    pub wakes: Arc<Wakes>,
    /// The worker's upstream connections that no client connection holds.
    idle: Arc<Idle>,
}

#[derive(Default)]
struct State {
    /// The connection's sender between requests.
    sender: Option<http1::SendRequest<Incoming>>,
    /// When `sender` was last used (the clock's nanoseconds).
    last_used: u64,
    /// A connection made by a request, not yet picked up by [`drive`].
    new_driver: Option<Driver>,
    /// A request of this client connection went through the worker's pool.
    pooled_once: bool,
}

impl Affine {
    pub fn new(idle: Arc<Idle>) -> Self {
        Affine {
            state: Default::default(),
            wakes: Default::default(),
            idle,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `req` (origin-form URI, `Host` set) on this client connection's upstream
    /// connection, connecting first when there is none usable; `now` is the clock's time. A
    /// request that a reused connection could not take (closed by the upstream meanwhile) is
    /// sent again on a new connection; one that was sent is never sent twice.
    ///
    /// The common case (a connection ready for the next request) hands `req` to hyper at once
    /// and awaits only its response; everything else is a boxed future of its own, so that the
    /// request path's future, moved once per request, stays small.
    pub async fn send(
        &self,
        upstream: &Upstream,
        req: Request<Incoming>,
        now: u64,
    ) -> Result<Response<Incoming>, Failure> {
        let cached = {
            let mut state = self.state();
            let fresh = now.saturating_sub(state.last_used) < upstream.idle;
            state.sender.take().filter(|s| fresh && !s.is_closed())
        };
        let (sender, sent) = match cached {
            Some(mut sender) if sender.is_ready() => {
                let sent = sender.try_send_request(req).await;
                (sender, sent)
            }
            _ => return Box::pin(self.send_slow(upstream, cached, req, now)).await,
        };
        match sent {
            Ok(resp) => {
                self.put(sender, now);
                Ok(resp)
            }
            Err(mut e) => match e.take_message() {
                Some(unsent) => Box::pin(self.send_slow(upstream, None, unsent, now)).await,
                None => Err(Failure::Exchange(e.into_error())),
            },
        }
    }

    /// [`send`](Self::send) when `cached` is not ready at once or there is none.
    async fn send_slow(
        &self,
        upstream: &Upstream,
        cached: Option<http1::SendRequest<Incoming>>,
        mut req: Request<Incoming>,
        now: u64,
    ) -> Result<Response<Incoming>, Failure> {
        let (mut sender, mut reused) = match cached {
            Some(s) => (s, true),
            None => match self.idle.take(now, upstream.idle) {
                Some(parked) => {
                    self.state().new_driver = Some(parked.driver);
                    self.wakes.set(UPSTREAM);
                    (parked.sender, true)
                }
                // A client's first request with no connection to take shares the worker's
                // pool: a client that sends one request and leaves (or a burst of them) is no
                // reason for a connection of its own, and a burst of new clients must not
                // become a burst of connects the app cannot accept in time.
                None if !std::mem::replace(&mut self.state().pooled_once, true) => {
                    return Err(Failure::Busy(Box::new(req)))
                }
                None => (self.connect(upstream).await?, false),
            },
        };
        loop {
            if reused && sender.ready().await.is_err() {
                sender = self.connect(upstream).await?;
                reused = false;
            }
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    self.put(sender, now);
                    return Ok(resp);
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) if reused => {
                        req = unsent;
                        sender = self.connect(upstream).await?;
                        reused = false;
                    }
                    _ => return Err(Failure::Exchange(e.into_error())),
                },
            }
        }
    }

    fn put(&self, sender: http1::SendRequest<Incoming>, now: u64) {
        let mut state = self.state();
        state.sender = Some(sender);
        state.last_used = now;
    }

    /// A new connection to the upstream; its driver is left for [`drive`] to poll.
    async fn connect(&self, upstream: &Upstream) -> Result<http1::SendRequest<Incoming>, Failure> {
        // A burst of new client connections must not become a burst of SYNs larger than the
        // app's accept backlog (128 for a tokio listener). The semaphore is never closed.
        let _turn = self.idle.connects.acquire().await;
        let stream = tokio::time::timeout(upstream.connect_timeout, connect_any(&upstream.address))
            .await
            .map_err(|_| Failure::ConnectTimeout)?
            .map_err(Failure::Connect)?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(Failure::Exchange)?;
        self.state().new_driver = Some(Box::pin(conn));
        // Never polled yet: nothing else would wake it.
        self.wakes.set(UPSTREAM);
        Ok(sender)
    }
}

/// The first address of `address` that accepts a connection.
async fn connect_any(address: &str) -> std::io::Result<TcpStream> {
    let mut last = None;
    for addr in tokio::net::lookup_host(address).await? {
        match TcpStream::connect(addr).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{address} resolves to no address"),
        )
    }))
}

/// Which side of a connection task needs a poll, and the task's waker for wakes that arrive
/// while it is not polling. Each side is polled with a waker of its own, so a wake names the
/// side to poll; wakes that arrive during [`drive`]'s poll (the upstream side completing the
/// client side's response, the client side handing a request to the upstream side) are
/// handled in that same poll instead of a trip through the runtime's queue.
#[derive(Default)]
pub struct Wakes {
    bits: AtomicU8,
    polling: AtomicBool,
    task: AtomicWaker,
}

const CLIENT: u8 = 1;
const UPSTREAM: u8 = 2;
const TRIPPED: u8 = 4;
/// Rounds of one poll of [`drive`] before it yields to the runtime (fairness, and tokio's
/// cooperative budget: a resource out of budget wakes at once, which would loop here).
const ROUNDS: usize = 8;

impl Wakes {
    fn set(&self, bits: u8) {
        // SeqCst pairs with `drive`'s store of `polling` then load of `bits`: either this wake
        // sees `polling` false and wakes the task, or `drive` sees the bit.
        self.bits.fetch_or(bits, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst) {
            self.task.wake();
        }
    }

    /// Makes [`drive`] end now: the connection is dropped, with every stream on it.
    pub fn trip(&self) {
        self.set(TRIPPED);
    }
}

struct SideWaker {
    wakes: Arc<Wakes>,
    bit: u8,
}

impl Wake for SideWaker {
    fn wake(self: Arc<Self>) {
        self.wakes.set(self.bit);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.set(self.bit);
    }
}

/// Polls `server` (a client connection) and the upstream connection of `affine` from one task,
/// each when its own waker was woken, until `server` ends (`Some`, and the upstream
/// connection closes) or the connection is tripped (`None`).
pub async fn drive<F: Future>(server: F, affine: &Affine) -> Option<F::Output> {
    let wakes = &affine.wakes;
    let client = Waker::from(Arc::new(SideWaker {
        wakes: wakes.clone(),
        bit: CLIENT,
    }));
    let upstream = Waker::from(Arc::new(SideWaker {
        wakes: wakes.clone(),
        bit: UPSTREAM,
    }));
    let mut server = std::pin::pin!(server);
    let mut driver: Option<Driver> = None;
    wakes.bits.fetch_or(CLIENT, Ordering::SeqCst);
    std::future::poll_fn(|cx| {
        wakes.task.register(cx.waker());
        wakes.polling.store(true, Ordering::SeqCst);
        for _ in 0..ROUNDS {
            let bits = wakes.bits.swap(0, Ordering::SeqCst);
            if bits & TRIPPED != 0 {
                return Poll::Ready(None);
            }
            if bits == 0 {
                break;
            }
            if bits & UPSTREAM != 0 {
                poll_driver(affine, &mut driver, &mut Context::from_waker(&upstream));
            }
            if bits & CLIENT != 0 {
                if let Poll::Ready(out) = server.as_mut().poll(&mut Context::from_waker(&client)) {
                    park(affine, driver.take());
                    return Poll::Ready(Some(out));
                }
            }
        }
        wakes.polling.store(false, Ordering::SeqCst);
        if wakes.bits.load(Ordering::SeqCst) != 0 {
            // Woken meanwhile, or still work after all rounds: poll again after other tasks.
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    })
    .await
}

/// Leaves the upstream connection of a client connection that ended to the worker's next
/// client connection, if it is between requests.
fn park(affine: &Affine, driver: Option<Driver>) {
    let mut state = affine.state();
    let driver = state.new_driver.take().or(driver);
    if let (Some(sender), Some(driver)) = (state.sender.take(), driver) {
        if sender.is_ready() {
            affine.idle.put(Parked {
                sender,
                driver,
                since: state.last_used,
            });
        }
    }
}

/// Upstream connections of one worker that no client connection holds, most recently used
/// last. The worker's tick polls each once ([`prune`](Self::prune)): one the upstream closed
/// meanwhile reads its EOF there and is dropped, instead of sitting in CLOSE_WAIT until taken
/// or expired. One closed between two ticks is found out when it is taken (its request comes
/// back unsent and goes on a new connection).
pub struct Idle {
    // Only the worker's own thread locks it, never across an await: never contended.
    #[allow(clippy::disallowed_types)]
    conns: std::sync::Mutex<std::collections::VecDeque<Parked>>,
    /// Turns to connect, [`MAX_CONNECTING`] at once.
    connects: tokio::sync::Semaphore,
}

impl Default for Idle {
    fn default() -> Self {
        Idle {
            conns: Default::default(),
            connects: tokio::sync::Semaphore::new(MAX_CONNECTING),
        }
    }
}

struct Parked {
    sender: http1::SendRequest<Incoming>,
    driver: Driver,
    /// When it was last used (the clock's nanoseconds).
    since: u64,
}

/// Connects one worker has in flight at most.
const MAX_CONNECTING: usize = 4;

/// Idle upstream connections kept per worker; the oldest goes first past this.
const MAX_IDLE: usize = 256;

impl Idle {
    fn conns(&self) -> std::sync::MutexGuard<'_, std::collections::VecDeque<Parked>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, parked: Parked) {
        let mut conns = self.conns();
        if conns.len() >= MAX_IDLE {
            conns.pop_front();
        }
        conns.push_back(parked);
    }

    /// The most recently used connection unused for less than `idle` nanoseconds.
    fn take(&self, now: u64, idle: u64) -> Option<Parked> {
        let mut conns = self.conns();
        while let Some(p) = conns.pop_back() {
            if now.saturating_sub(p.since) < idle && !p.sender.is_closed() {
                return Some(p);
            }
        }
        None
    }

    /// Closes the connections unused for `idle` nanoseconds or more, and those the upstream
    /// closed: each is polled once, with a waker that does nothing (the next tick polls again).
    pub fn prune(&self, now: u64, idle: u64) {
        let mut cx = Context::from_waker(Waker::noop());
        self.conns().retain_mut(|p| {
            now.saturating_sub(p.since) < idle
                && p.driver.as_mut().poll(&mut cx).is_pending()
                && !p.sender.is_closed()
        });
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.conns().len()
    }
}

fn poll_driver(affine: &Affine, driver: &mut Option<Driver>, cx: &mut Context<'_>) {
    if let Some(new) = affine.state().new_driver.take() {
        // The old connection, if any, has no sender left: it is done.
        *driver = Some(new);
    }
    if let Some(d) = driver {
        if let Poll::Ready(ended) = d.as_mut().poll(cx) {
            if let Err(e) = ended {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
            *driver = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiting_connection_the_upstream_closed_is_dropped_by_the_next_prune() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (app_side, _) = listener.accept().await.unwrap();
        let (sender, conn) = http1::Builder::new()
            .handshake::<_, Incoming>(TokioIo::new(stream))
            .await
            .unwrap();
        let idle = Idle::default();
        idle.put(Parked {
            sender,
            driver: Box::pin(conn),
            since: 0,
        });
        for _ in 0..100 {
            idle.prune(1, u64::MAX);
            tokio::task::yield_now().await;
        }
        assert_eq!(idle.len(), 1, "an open connection waits to be taken");
        drop(app_side);
        // Bounded: the EOF reaches the connection once the runtime's reactor has seen it.
        for _ in 0..10_000 {
            idle.prune(1, u64::MAX);
            if idle.len() == 0 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(idle.len(), 0, "a connection the app closed is dropped");
    }
}
