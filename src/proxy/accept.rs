//! Which worker takes a new connection: the first worker, unless it is busy. The others take a
//! connection at once while the first spent most of its last tick (at least [`WINDOW`])
//! running tasks, and otherwise only once it has left the connection waiting for [`GRACE`].
//!
//! Why: every worker is woken for every new connection on the shared socket, and split
//! connections make both workers wake and sleep for every few requests, competing with the app
//! for the cores (nginx concentrates the same way; docs/measurements.md, "Concentrating new
//! connections" and "Load, not a grace"). The first worker's load is tokio's busy time of its
//! runtime, published on its tick ([`Sampler`]).
//!
//! Cost: one atomic load, and on the other workers one timer per arrival while the first is
//! not busy; nothing per request. Must never: leave a connection waiting longer than about
//! [`GRACE`], or leave new connections to a first worker that was busy for a whole window.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::net::TcpStream;
use tokio::runtime::RuntimeMetrics;
use tokio::time::Instant;

/// How long a worker other than the first leaves a new connection for the first while the
/// first's load does not show it busy.
pub const GRACE: Duration = Duration::from_millis(20);

/// The shortest span the first worker's load is measured over (its tick is 1 s by default).
pub const WINDOW: Duration = Duration::from_millis(100);

/// Whether the first worker is busy: written by its [`Sampler`], read by the others.
#[derive(Debug, Default)]
pub struct FirstLoad {
    busy: AtomicBool,
}

impl FirstLoad {
    pub fn is_busy(&self) -> bool {
        self.busy.load(Ordering::Relaxed)
    }

    fn set(&self, busy: bool) {
        self.busy.store(busy, Ordering::Relaxed);
    }
}

/// Busy: tasks ran for at least three quarters of the span. A worker that cannot keep up runs
/// tasks all the time it is on a CPU; what is left is its time in `epoll_wait` for events.
fn busy(ran: Duration, span: Duration) -> bool {
    !span.is_zero() && ran.as_nanos() * 4 >= span.as_nanos() * 3
}

/// The span being measured: where it started, and the runtime's busy time then.
#[derive(Debug, Clone, Copy)]
struct Span {
    at: Instant,
    ran: Duration,
}

impl Span {
    /// Ends the span at `now` with the runtime's busy time `ran` if it is at least [`WINDOW`]
    /// long, saying whether the worker was busy over it, and starts the next one.
    fn close(&mut self, now: Instant, ran: Duration) -> Option<bool> {
        let span = now.checked_duration_since(self.at)?;
        if span < WINDOW {
            return None;
        }
        let was = busy(ran.saturating_sub(self.ran), span);
        *self = Span { at: now, ran };
        Some(was)
    }
}

/// The first worker's side of [`FirstLoad`]: measures its runtime's busy time on its tick.
/// (tokio offers that metric on targets with 64-bit atomics: every target a sidecar runs on.)
pub struct Sampler {
    load: Arc<FirstLoad>,
    metrics: RuntimeMetrics,
    span: Span,
}

impl Sampler {
    /// Must be called within the first worker's (current-thread) runtime.
    pub fn new(load: Arc<FirstLoad>) -> Self {
        let metrics = tokio::runtime::Handle::current().metrics();
        let span = Span {
            at: Instant::now(),
            ran: metrics.worker_total_busy_duration(0),
        };
        Self {
            load,
            metrics,
            span,
        }
    }

    pub fn sample(&mut self, now: Instant) {
        let ran = self.metrics.worker_total_busy_duration(0);
        if let Some(busy) = self.span.close(now, ran) {
            self.load.set(busy);
        }
    }
}

/// One worker's handle on the shared listening socket.
pub struct Acceptor {
    fd: AsyncFd<std::net::TcpListener>,
    /// `None` for the first worker; the first's load for the others.
    first: Option<Arc<FirstLoad>>,
    /// How long the others leave a connection to a first worker that is not busy.
    grace: Duration,
    /// The last try took a connection: take the rest of the backlog without waiting again.
    draining: bool,
}

impl Acceptor {
    /// The handle of worker `index` (0 = the first). Must be called within its runtime.
    pub fn for_worker(
        listener: std::net::TcpListener,
        index: usize,
        first: &Arc<FirstLoad>,
    ) -> io::Result<Self> {
        Self::new(listener, (index > 0).then(|| first.clone()), GRACE)
    }

    fn new(
        listener: std::net::TcpListener,
        first: Option<Arc<FirstLoad>>,
        grace: Duration,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        // SAFETY: the `AsyncFd` owns the listener, whose descriptor stays open and the same
        // until the `AsyncFd` is dropped.
        #[allow(unsafe_code)]
        let fd = unsafe { AsyncFd::register(listener) }.map_err(io::Error::from)?;
        Ok(Self {
            fd,
            first,
            grace,
            draining: false,
        })
    }

    pub async fn accept(&mut self) -> io::Result<(TcpStream, SocketAddr)> {
        loop {
            let mut ready = self.fd.readable().await?;
            let defer = self.first.as_ref().is_some_and(|first| !first.is_busy());
            if defer && !self.draining {
                tokio::time::sleep(self.grace).await;
            }
            // A would-block clears the readiness: back to waiting for the next connection.
            let Ok(accepted) = ready.try_io(|l| l.get_ref().accept()) else {
                self.draining = false;
                continue;
            };
            self.draining = accepted.is_ok();
            let (stream, peer) = accepted?;
            stream.set_nonblocking(true)?;
            return Ok((TcpStream::from_std(stream)?, peer));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    /// A listener for the workers to share, its address, and the first worker's load.
    fn shared() -> (std::net::TcpListener, SocketAddr, Arc<FirstLoad>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        (l, addr, Arc::new(FirstLoad::default()))
    }

    /// Accepts forever, saying which worker took each connection.
    fn run(mut a: Acceptor, index: usize, took: mpsc::UnboundedSender<(usize, TcpStream)>) {
        tokio::spawn(async move {
            while let Ok((s, _)) = a.accept().await {
                if took.send((index, s)).is_err() {
                    return;
                }
            }
        });
    }

    /// `n` clients, connected (and kept open).
    async fn connect(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
        let mut clients = Vec::new();
        for _ in 0..n {
            clients.push(TcpStream::connect(addr).await.unwrap());
        }
        clients
    }

    /// A grace no test outlasts: whatever the machine's pauses, the first worker is never too
    /// slow for it.
    const LONG: Duration = Duration::from_secs(3600);

    #[tokio::test]
    async fn connections_go_to_the_first_worker_while_it_keeps_up() {
        let (l, addr, load) = shared();
        let (tx, mut took) = mpsc::unbounded_channel();
        let deferring = Acceptor::new(l.try_clone().unwrap(), Some(load.clone()), LONG);
        run(deferring.unwrap(), 1, tx.clone());
        run(Acceptor::for_worker(l, 0, &load).unwrap(), 0, tx);
        let mut clients = Vec::new();
        for n in 0..20 {
            clients.push(TcpStream::connect(addr).await.unwrap());
            let (worker, _conn) = took.recv().await.unwrap();
            assert_eq!(worker, 0, "connection {n} went to a deferring worker");
        }
    }

    #[tokio::test]
    async fn a_deferring_worker_takes_what_the_first_leaves_waiting() {
        let (l, addr, load) = shared();
        let (tx, mut took) = mpsc::unbounded_channel();
        // The first worker's handle exists but nobody accepts on it: a stuck first worker,
        // whose load does not show it (it is not busy).
        let _stuck = Acceptor::for_worker(l.try_clone().unwrap(), 0, &load).unwrap();
        let deferring = Acceptor::new(l, Some(load), Duration::from_millis(1));
        run(deferring.unwrap(), 1, tx);
        let _clients = connect(addr, 5).await;
        for _ in 0..5 {
            assert_eq!(took.recv().await.unwrap().0, 1);
        }
    }

    #[tokio::test]
    async fn a_deferring_worker_takes_at_once_while_the_first_is_busy() {
        let (l, addr, load) = shared();
        let (tx, mut took) = mpsc::unbounded_channel();
        load.set(true);
        let _busy = Acceptor::for_worker(l.try_clone().unwrap(), 0, &load).unwrap();
        run(Acceptor::new(l, Some(load), LONG).unwrap(), 1, tx);
        let _clients = connect(addr, 5).await;
        // Waiting out the grace would take an hour: a minute is a failure, not a hang.
        let all = async {
            for _ in 0..5 {
                assert_eq!(took.recv().await.unwrap().0, 1);
            }
        };
        tokio::time::timeout(Duration::from_secs(60), all)
            .await
            .expect("the busy first worker's connections waited for the grace");
    }

    #[test]
    fn busy_is_three_quarters_of_the_span_running_tasks() {
        let s = Duration::from_secs(1);
        assert!(busy(Duration::from_millis(750), s));
        assert!(busy(s, s));
        assert!(!busy(Duration::from_millis(749), s));
        assert!(!busy(Duration::ZERO, s));
        assert!(!busy(Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn a_span_closes_once_it_is_a_window_long() {
        let t0 = Instant::now();
        let mut span = Span {
            at: t0,
            ran: Duration::from_secs(5),
        };
        let at = |d: Duration| t0 + d;
        // Too short: nothing said, the span goes on.
        assert_eq!(span.close(at(WINDOW / 2), Duration::from_secs(6)), None);
        // Busy for 80 of the first 100 ms.
        let ran = Duration::from_secs(5) + WINDOW * 4 / 5;
        assert_eq!(span.close(at(WINDOW), ran), Some(true));
        // The next span starts there: 10 % of it busy.
        let ran2 = ran + WINDOW / 5;
        assert_eq!(span.close(at(WINDOW * 3), ran2), Some(false));
        // A clock that went back says nothing.
        assert_eq!(span.close(t0, ran2), None);
    }

    #[test]
    fn the_runtime_reports_busy_time_of_a_current_thread_worker() {
        // What the sampler relies on: tokio counts the first worker's busy time (a stable
        // metric on 64-bit targets) while a task runs, without the unstable cfg.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let ran = rt.block_on(async {
            let metrics = tokio::runtime::Handle::current().metrics();
            let before = metrics.worker_total_busy_duration(0);
            // A task that holds the worker for 50 ms, as a saturated worker's tasks do.
            tokio::spawn(async { std::thread::sleep(Duration::from_millis(50)) })
                .await
                .unwrap();
            metrics.worker_total_busy_duration(0) - before
        });
        assert!(ran >= Duration::from_millis(50), "busy time {ran:?}");
    }
}
