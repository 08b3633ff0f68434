//! One upstream connection per HTTP/1 client connection, used from that connection's own task:
//! the request is written upstream in the worker's turn that read it, and the response is read
//! and written back in the poll that saw it arrive, as nginx's event loop does; no task or
//! channel per upstream connection, as hyper-util's pool has.
//!
//! Owns the worker's idle list ([`Idle`]) and the caps on upstream connections ([`Cap`]). A
//! client's first exchange borrows a connection from the list (or connects) and gives it back
//! at its body's end; from its second on an HTTP/1 client keeps one; every HTTP/2 stream
//! borrows, and its connection keeps one that may serve it alone (after a HEAD answer).
//! Connections unused for `timeouts.upstream_idle` are closed. For every request to an HTTP/1
//! upstream; an `h2c://` upstream has the pooled client.
//!
//! Cost per request: two uncontended locks and a readiness check (no syscall). Must never:
//! reuse a connection with bytes left on it, or connect more than [`MAX_CONNECTING`] at once
//! per worker (a burst of new clients would overflow the app's accept backlog).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Version};
use tokio::net::TcpStream;

use super::body::{Progress, ReqBody};
use super::failure::Failure;
use super::forwarded::Added;
use super::http1::client::{self as h1, Unusable, UpstreamConn};

/// `spillway_upstream_connections_discarded_total{reason}`, by [`Unusable`].
pub type Discards = [prometheus::IntCounter; 3];

/// Counts `why` in `discards`.
fn count(discards: &Discards, why: Unusable) {
    discards[why as usize].inc();
}

/// The proxy's upstream connections open at once at most (`limits.max_upstream_connections`):
/// each holds a permit from here while it is open, idle ones included, so that the descriptor
/// budget holds whatever clients do. A request that needs a new connection at the cap first
/// closes one of its worker's idle ones, else waits (at most `timeouts.upstream_connect`);
/// while any request waits, a connection of ours that comes back goes to a waiter of its
/// worker, or is closed so that its permit goes to one of another's. The pooled client's idle
/// connections and those an idle client connection keeps are not taken back.
pub struct Cap {
    permits: Arc<tokio::sync::Semaphore>,
    waiting: std::sync::atomic::AtomicUsize,
    /// `spillway_upstream_connection_waiters`.
    waiters: prometheus::IntGauge,
}

impl Cap {
    pub fn new(connections: usize, waiters: prometheus::IntGauge) -> Arc<Cap> {
        Arc::new(Cap {
            permits: Arc::new(tokio::sync::Semaphore::new(connections)),
            waiting: Default::default(),
            waiters,
        })
    }

    /// Counts a request as waiting for a permit while the guard lives.
    fn wait(&self) -> Waiting<'_> {
        Waiting::on(&self.waiting, Some(&self.waiters))
    }

    /// Some request waits for a permit.
    fn wanted(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) > 0
    }

    /// A permit for a new connection of the pooled client, at once or within `wait`; `None`
    /// when the cap stayed full.
    pub async fn permit(&self, wait: Duration) -> Option<tokio::sync::OwnedSemaphorePermit> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Some(p);
        }
        let _waiting = self.wait();
        let got = tokio::time::timeout(wait, self.permits.clone().acquire_owned()).await;
        got.ok().and_then(Result::ok)
    }
}

/// Counts a request as waiting while it lives: a wait given up (the request's future dropped
/// when its client leaves or resets the stream) must not leave the count raised, or
/// connections would be closed for waiters that are gone.
struct Waiting<'a>(
    &'a std::sync::atomic::AtomicUsize,
    Option<&'a prometheus::IntGauge>,
);

impl<'a> Waiting<'a> {
    /// Counted in `count`, and in `gauge` when given, until dropped.
    fn on(
        count: &'a std::sync::atomic::AtomicUsize,
        gauge: Option<&'a prometheus::IntGauge>,
    ) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        if let Some(gauge) = gauge {
            gauge.inc();
        }
        Waiting(count, gauge)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        if let Some(gauge) = self.1 {
            gauge.dec();
        }
    }
}

/// What a request at the cap got.
enum AtCap {
    /// A permit for a new connection.
    Permit(tokio::sync::OwnedSemaphorePermit),
    /// A connection of its worker's that came back meanwhile.
    Back(UpstreamConn),
}

/// Where and how to connect to the upstream.
pub struct UpstreamAddr {
    /// `host:port` (port 80 when the configuration gave none).
    pub address: String,
    pub connect_timeout: Duration,
    /// An upstream connection unused for this long is not reused (the upstream may be closing
    /// it at this very moment); nanoseconds.
    pub idle: u64,
}

/// The upstream connection of one client connection.
pub struct ClientUpstream {
    /// Shared with the response body that holds the connection, which puts it back here.
    slot: Arc<Slot>,
    /// The worker's upstream connections that no client connection holds.
    idle: Arc<Idle>,
    /// An HTTP/1 client connection's uploads' progress, told afresh for each (see
    /// [`Self::progress`]).
    progress: std::sync::OnceLock<Arc<Progress>>,
}

struct Slot {
    // Locked by the task serving an HTTP/1 client connection (its request path and its
    // response body), or an HTTP/2 one's streams', never across an await: rarely contended.
    #[allow(clippy::disallowed_types)]
    state: std::sync::Mutex<State>,
    /// An HTTP/2 client connection's: it keeps only a connection that may serve it alone
    /// (after a HEAD answer), which its next stream takes; others go to the worker's list.
    streams: AtomicBool,
    /// It holds such a connection (read without the lock by every stream).
    kept: AtomicBool,
    discards: Discards,
    /// The worker's list, which takes the connection when a request waits for one.
    idle: Arc<Idle>,
}

#[derive(Default)]
struct State {
    /// The connection between exchanges.
    raw: Option<UpstreamConn>,
    /// When `raw` was last used (the clock's nanoseconds).
    last_used: u64,
    /// A request of this client connection was sent upstream.
    served: bool,
}

impl Slot {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl h1::ConnKeeper for Slot {
    fn put(&self, raw: UpstreamConn, since: u64) {
        // A request waits for a connection: the worker's list gives it this one (one that
        // serves this client only is closed for it instead).
        if self.idle.cap.wanted() || (self.streams.load(Ordering::Relaxed) && !raw.own_only()) {
            h1::ConnKeeper::put(&*self.idle, raw, since);
            return;
        }
        let mut state = self.state();
        state.raw = Some(raw);
        state.last_used = since;
        self.kept.store(true, Ordering::Relaxed);
    }

    fn discarded(&self, why: Unusable) {
        count(&self.discards, why);
    }
}

impl ClientUpstream {
    pub fn new(idle: Arc<Idle>) -> Self {
        ClientUpstream {
            slot: Arc::new(Slot {
                state: Default::default(),
                discards: idle.discards.clone(),
                idle: idle.clone(),
                streams: AtomicBool::new(false),
                kept: AtomicBool::new(false),
            }),
            idle,
            progress: Default::default(),
        }
    }

    /// Where a body going up tells its progress. An HTTP/1 client connection's requests come
    /// one at a time: the last upload's is told afresh once nothing holds it (an upload ends
    /// with its response body), so an upload allocates none. An HTTP/2 stream gets its own.
    pub fn progress(&self, h2: bool) -> Arc<Progress> {
        if !h2 {
            let kept = self.progress.get_or_init(Default::default);
            if Arc::strong_count(kept) == 1 {
                kept.restart();
                return kept.clone();
            }
        }
        Arc::new(Progress::default())
    }

    /// Sends `req` (as the client sent it; a body still coming is taken out of it and streamed),
    /// with the headers the hop changes (`added`), on this client connection's upstream connection, connecting
    /// first when there is none usable; `now` is the clock's time. A connection the upstream
    /// closed meanwhile is not used (a new one is made); a request that was sent is never sent
    /// twice.
    pub async fn send(
        &self,
        upstream: &UpstreamAddr,
        req: &mut Request<ReqBody>,
        added: &Added,
        now: u64,
    ) -> Result<h1::Exchanged, Failure> {
        // An HTTP/2 client connection's streams run at once, each in a task of its own: every
        // one borrows, as an HTTP/1 connection's first exchange does, from the connection's
        // own slot first (what a HEAD answer left there, for it alone), then the worker's list.
        let h2 = req.version() == Version::HTTP_2;
        let (cached, first) = if h2 {
            self.slot.streams.store(true, Ordering::Relaxed);
            let cached = self.slot.kept.swap(false, Ordering::Relaxed).then(|| {
                let mut state = self.slot.state();
                let fresh = now.saturating_sub(state.last_used) < upstream.idle;
                state.raw.take().filter(|_| fresh)
            });
            (cached.flatten(), false)
        } else {
            let mut state = self.slot.state();
            let fresh = now.saturating_sub(state.last_used) < upstream.idle;
            let first = !std::mem::replace(&mut state.served, true);
            (state.raw.take().filter(|_| fresh), first)
        };
        let (raw, reused) = match cached.and_then(|raw| usable(raw, &self.idle.discards)) {
            Some(raw) => (raw, true),
            None => match self.idle.take(now, upstream.idle) {
                Some(raw) => (raw, true),
                None => Box::pin(self.connect(upstream, now)).await?,
            },
        };
        // A client connection's first exchange only borrows its connection: at the body's end
        // it goes back to the worker's list, for whichever request comes next (a client that
        // sends one request and leaves, or a burst of them, is no reason for a connection
        // each). From its second exchange on, a client keeps the one it has.
        let home: Arc<dyn h1::ConnKeeper> = if first {
            self.idle.clone()
        } else {
            self.slot.clone()
        };
        let failed = match h1::exchange(raw, req, added, home.clone(), now).await {
            Ok(resp) => return Ok(resp),
            // A reused connection the upstream closed just now: once more on another.
            Err(h1::Failed::Unsent(_)) if reused => {
                let (raw, _) = Box::pin(self.connect(upstream, now)).await?;
                h1::exchange(raw, req, added, home, now).await
            }
            Err(e) => Err(e),
        };
        failed.map_err(|e| match e {
            h1::Failed::Upstream(e) | h1::Failed::Unsent(e) => Failure::UpstreamConn(e),
            h1::Failed::ClientBody => Failure::ClientBody,
        })
    }

    /// A connection to the upstream, once it is this request's turn to connect: one that came
    /// back to the worker's list meanwhile (`true`: reused), or a new one.
    async fn connect(
        &self,
        upstream: &UpstreamAddr,
        now: u64,
    ) -> Result<(UpstreamConn, bool), Failure> {
        let permit = match self.idle.permit(now, upstream).await {
            Some(AtCap::Permit(p)) => p,
            Some(AtCap::Back(raw)) => return Ok((raw, true)),
            None => return Err(Failure::Saturated),
        };
        // A burst of new client connections must not become a burst of SYNs larger than the
        // app's accept backlog (128 for a tokio listener). The semaphore is never closed.
        let _turn = self.idle.connects.acquire().await;
        if let Some(raw) = self.idle.take(now, upstream.idle) {
            return Ok((raw, true));
        }
        let stream = tokio::time::timeout(upstream.connect_timeout, connect_any(&upstream.address))
            .await
            .map_err(|_| Failure::ConnectTimeout)?
            .map_err(Failure::Connect)?;
        let _ = stream.set_nodelay(true);
        Ok((UpstreamConn::new(stream, Some(permit)), false))
    }
}

/// `raw` if nothing happened on it since its last exchange; else it is closed, and counted.
fn usable(mut raw: UpstreamConn, discards: &Discards) -> Option<UpstreamConn> {
    match raw.check() {
        Ok(()) => Some(raw),
        Err(why) => {
            count(discards, why);
            None
        }
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

/// Leaves the upstream connection of a client connection that ended to the worker's next
/// client connection, if it is between exchanges. The upstream connection needs no polling of
/// its own meanwhile: the request path and the response body do its I/O in the client
/// connection's task.
pub(super) fn park(affine: &ClientUpstream) {
    let mut state = affine.slot.state();
    // One that serves this client only is closed with it.
    if let Some(raw) = state.raw.take().filter(|raw| !raw.own_only()) {
        affine.idle.put(IdleConn {
            raw,
            since: state.last_used,
        });
    }
}

/// Upstream connections of one worker that no client connection holds, most recently used
/// last. The worker's tick looks at each ([`prune`](Self::prune)): one the upstream closed
/// meanwhile is dropped, instead of sitting in CLOSE_WAIT until taken or expired. One closed
/// between two ticks is found out when it is taken.
pub struct Idle {
    // Only the worker's own thread locks it, never across an await: never contended.
    #[allow(clippy::disallowed_types)]
    conns: std::sync::Mutex<std::collections::VecDeque<IdleConn>>,
    /// Turns to connect, [`MAX_CONNECTING`] at once.
    connects: tokio::sync::Semaphore,
    discards: Discards,
    cap: Arc<Cap>,
    /// This worker's requests waiting at the cap, and their wake-up when a connection comes
    /// back.
    waiting: std::sync::atomic::AtomicUsize,
    back: tokio::sync::Notify,
}

impl Default for Idle {
    /// With counters of its own and no cap to speak of (tests).
    fn default() -> Self {
        let c = || prometheus::IntCounter::new("discarded", "test").expect("valid");
        let g = prometheus::IntGauge::new("waiters", "test").expect("valid");
        Self::new([c(), c(), c()], Cap::new(1 << 20, g))
    }
}

struct IdleConn {
    raw: UpstreamConn,
    /// When it was last used (the clock's nanoseconds).
    since: u64,
}

/// Connects one worker has in flight at most.
const MAX_CONNECTING: usize = 4;

/// Idle upstream connections kept per worker; the oldest goes first past this.
const MAX_IDLE: usize = 256;

impl h1::ConnKeeper for Idle {
    fn put(&self, raw: UpstreamConn, since: u64) {
        // Never another client's: a connection that serves only its client is closed when it
        // would come here (a client's first exchange, an HTTP/2 stream's, a waiter's turn).
        if raw.own_only() {
            return;
        }
        if self.cap.wanted() {
            // A request of this worker waits: it takes this one. Else one of another
            // worker's: closed, to give it this one's permit.
            if self.waiting.load(Ordering::Relaxed) == 0 {
                return;
            }
            Idle::put(self, IdleConn { raw, since });
            self.back.notify_one();
            return;
        }
        Idle::put(self, IdleConn { raw, since });
    }

    fn discarded(&self, why: Unusable) {
        count(&self.discards, why);
    }
}

impl Idle {
    /// An empty list counting what it closes in `discards`.
    pub fn new(discards: Discards, cap: Arc<Cap>) -> Self {
        Idle {
            conns: Default::default(),
            connects: tokio::sync::Semaphore::new(MAX_CONNECTING),
            discards,
            cap,
            waiting: Default::default(),
            back: tokio::sync::Notify::new(),
        }
    }

    /// Closes the least recently used connection; whether there was one.
    fn close_oldest(&self) -> bool {
        self.conns().pop_front().is_some()
    }

    /// A permit of the cap for a new connection, or a connection of this worker's that came
    /// back while the request waited; `None` once `upstream.connect_timeout` has passed with
    /// neither. At the cap, an idle connection of this worker's is closed for its permit
    /// first (the caller found none usable).
    async fn permit(&self, now: u64, upstream: &UpstreamAddr) -> Option<AtCap> {
        let cap = &self.cap;
        loop {
            if let Ok(p) = cap.permits.clone().try_acquire_owned() {
                return Some(AtCap::Permit(p));
            }
            if !self.close_oldest() {
                break;
            }
        }
        let deadline = tokio::time::Instant::now() + upstream.connect_timeout;
        let _waiting = (cap.wait(), Waiting::on(&self.waiting, None));
        loop {
            let waited = tokio::time::timeout_at(deadline, async {
                tokio::select! {
                    p = cap.permits.clone().acquire_owned() => p.ok().map(AtCap::Permit),
                    _ = self.back.notified() => None,
                }
            })
            .await;
            match waited {
                Ok(Some(got)) => return Some(got),
                Ok(None) => {
                    if let Some(raw) = self.take(now, upstream.idle) {
                        return Some(AtCap::Back(raw));
                    }
                }
                Err(_) => return None,
            }
        }
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, std::collections::VecDeque<IdleConn>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, parked: IdleConn) {
        let mut conns = self.conns();
        if conns.len() >= MAX_IDLE {
            conns.pop_front();
        }
        conns.push_back(parked);
    }

    /// The most recently used usable connection unused for less than `idle` nanoseconds.
    fn take(&self, now: u64, idle: u64) -> Option<UpstreamConn> {
        let mut conns = self.conns();
        while let Some(p) = conns.pop_back() {
            if now.saturating_sub(p.since) < idle {
                if let Some(raw) = usable(p.raw, &self.discards) {
                    return Some(raw);
                }
            }
        }
        None
    }

    /// Closes the connections unused for `idle` nanoseconds or more, and those the upstream
    /// closed.
    pub fn prune(&self, now: u64, idle: u64) {
        // Requests of another worker wait for a permit: this worker's idle ones give theirs.
        if self.cap.wanted() && self.waiting.load(Ordering::Relaxed) == 0 {
            self.conns().clear();
        }
        self.conns().retain_mut(|p| {
            if now.saturating_sub(p.since) >= idle {
                return false;
            }
            match p.raw.check() {
                Ok(()) => true,
                Err(why) => {
                    count(&self.discards, why);
                    false
                }
            }
        });
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.conns().len()
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
        let idle = Idle::default();
        idle.put(IdleConn {
            raw: UpstreamConn::new(stream, None),
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
