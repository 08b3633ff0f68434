//! Which worker takes a new connection: the first worker at once; the others only once it has
//! left the connection waiting for [`GRACE`], and then every connection waiting with it.
//!
//! Every worker's runtime watches the one shared listening socket, so every worker is woken for
//! every new connection, and whichever tries first wins: a burst of 16 connections split about
//! evenly. Split, both workers wake and sleep for every few requests, and on this 2-core
//! machine they compete with the load generator and the app for the cores; on one worker, the
//! other core is left to them. Measured before this change (`wrk -c16`, limiting rule, two runs
//! each): `workers: 1` gave 72-77k req/s at p99 0.6-0.7 ms where two randomly split workers
//! gave 63-66k at 0.9-1.2 ms; the A/B of the change itself is in BENCHMARKS.md. nginx
//! concentrates the same way (`EPOLLEXCLUSIVE` wakes one waiting
//! worker: 15 or 16 of 16 connections on one worker in our runs); at 128 connections its split
//! varied from 57/71 to 121/7.
//!
//! Deferring is what keeps the load-balancing: a worker that is busy does not get back to its
//! accept loop within [`GRACE`] (a round over 64 busy connections takes about that long here),
//! so the others take the connections it cannot. Cost: one timer per connection arrival on the
//! deferring workers, nothing per request. Must never: leave a connection waiting when the first
//! worker is busy for longer than about [`GRACE`].

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::net::TcpStream;

/// How long a worker other than the first leaves a new connection for the first.
pub const GRACE: Duration = Duration::from_millis(1);

/// One worker's handle on the shared listening socket.
pub struct Acceptor {
    fd: AsyncFd<std::net::TcpListener>,
    /// `None` for the first worker.
    grace: Option<Duration>,
    /// The last try took a connection: take the rest of the backlog without waiting again.
    draining: bool,
}

impl Acceptor {
    /// The handle of worker `index` (0 = the first). Must be called within its runtime.
    pub fn for_worker(listener: std::net::TcpListener, index: usize) -> io::Result<Self> {
        Self::new(listener, (index > 0).then_some(GRACE))
    }

    /// A handle that leaves each new connection to the others for `grace` (`None`: takes it).
    fn new(listener: std::net::TcpListener, grace: Option<Duration>) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        // SAFETY: the `AsyncFd` owns the listener, whose descriptor stays open and the same
        // until the `AsyncFd` is dropped.
        let fd = unsafe { AsyncFd::register(listener) }.map_err(io::Error::from)?;
        Ok(Self {
            fd,
            grace,
            draining: false,
        })
    }

    pub async fn accept(&mut self) -> io::Result<(TcpStream, SocketAddr)> {
        loop {
            let mut ready = self.fd.readable().await?;
            if let (Some(grace), false) = (self.grace, self.draining) {
                tokio::time::sleep(grace).await;
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

    fn listener() -> std::net::TcpListener {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap()
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

    #[tokio::test]
    async fn connections_go_to_the_first_worker_while_it_keeps_up() {
        let l = listener();
        let addr = l.local_addr().unwrap();
        let (tx, mut took) = mpsc::unbounded_channel();
        // A grace no test outlasts: whatever the machine's pauses, the first worker is never
        // too slow here, so every connection must be its.
        let long = Some(Duration::from_secs(3600));
        run(
            Acceptor::new(l.try_clone().unwrap(), long).unwrap(),
            1,
            tx.clone(),
        );
        run(Acceptor::for_worker(l, 0).unwrap(), 0, tx);
        let mut clients = Vec::new();
        for n in 0..20 {
            clients.push(TcpStream::connect(addr).await.unwrap());
            let (worker, _conn) = took.recv().await.unwrap();
            assert_eq!(worker, 0, "connection {n} went to a deferring worker");
        }
    }

    #[tokio::test]
    async fn a_deferring_worker_takes_what_the_first_leaves_waiting() {
        let l = listener();
        let addr = l.local_addr().unwrap();
        let (tx, mut took) = mpsc::unbounded_channel();
        // The first worker's handle exists but nobody accepts on it: a busy first worker.
        let _busy = Acceptor::for_worker(l.try_clone().unwrap(), 0).unwrap();
        run(Acceptor::for_worker(l, 1).unwrap(), 1, tx);
        let mut clients = Vec::new();
        for _ in 0..5 {
            clients.push(TcpStream::connect(addr).await.unwrap());
        }
        for _ in 0..5 {
            assert_eq!(took.recv().await.unwrap().0, 1);
        }
    }
}
