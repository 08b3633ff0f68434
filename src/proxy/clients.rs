//! Client connections as the acceptors count them: per client address
//! (`limits.max_connections_per_client`; IPv6 by its /64, the listed proxies and
//! `connections_per_client_exempt` without a cap), and, per worker, the kept-alive HTTP/1
//! connections idle between two requests, one of which is closed when a new client finds
//! every place (`limits.max_connections`) taken, as nginx does. Must never: take a lock per
//! request (the count's is taken per accepted connection and per closed one), or close a
//! connection with a request in flight.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::key::Cidr;

/// Connections open per client address.
pub struct PerClient {
    cap: u32,
    exempt: Vec<Cidr>,
    // Locked once per accepted connection and once per closed one, never across an await.
    #[allow(clippy::disallowed_types)]
    open: std::sync::Mutex<HashMap<IpAddr, u32>>,
}

impl PerClient {
    /// `exempt`: the listed proxies and `connections_per_client_exempt`.
    pub fn new(cap: u32, exempt: Vec<Cidr>) -> Arc<Self> {
        Arc::new(PerClient {
            cap,
            exempt,
            open: Default::default(),
        })
    }

    /// A place for a connection from `peer`, given back when dropped; `None` at the cap.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<Place> {
        let peer = peer.to_canonical();
        if self.exempt.iter().any(|c| c.contains(peer)) {
            return Some(Place(None));
        }
        let client = client_of(peer);
        let mut open = self.lock();
        let n = open.entry(client).or_insert(0);
        if *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(Place(Some((self.clone(), client))))
    }

    #[allow(clippy::disallowed_types)]
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, u32>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The client an address stands for: IPv4 whole, IPv6 by its /64 (what one host is given).
fn client_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
    }
}

/// One connection's place under [`PerClient`]'s cap.
pub struct Place(Option<(Arc<PerClient>, IpAddr)>);

impl Drop for Place {
    fn drop(&mut self) {
        if let Some((per, client)) = self.0.take() {
            let mut open = per.lock();
            if let Some(n) = open.get_mut(&client) {
                *n -= 1;
                if *n == 0 {
                    open.remove(&client);
                }
            }
        }
    }
}

/// One worker's kept-alive connections idle between requests.
pub struct Idle {
    count: AtomicUsize,
    /// Told to close one of them.
    pub close: tokio::sync::Notify,
    /// An acceptor found every place taken and no idle connection: told when one goes idle.
    wanted: Arc<(std::sync::atomic::AtomicBool, tokio::sync::Notify)>,
}

impl Idle {
    /// One of this worker's connections is idle until the guard is dropped.
    pub fn enter(&self) -> IdleGuard<'_> {
        self.count.fetch_add(1, Ordering::Relaxed);
        if self.wanted.0.load(Ordering::Relaxed) {
            self.wanted.1.notify_waiters();
        }
        IdleGuard(self)
    }
}

pub struct IdleGuard<'a>(&'a Idle);

impl Drop for IdleGuard<'_> {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Every worker's [`Idle`].
#[derive(Default)]
pub struct Idles {
    // Locked as each worker starts and when every place is taken, never across an await.
    #[allow(clippy::disallowed_types)]
    workers: std::sync::Mutex<Vec<Arc<Idle>>>,
    wanted: Arc<(std::sync::atomic::AtomicBool, tokio::sync::Notify)>,
}

impl Idles {
    pub fn add(&self) -> Arc<Idle> {
        let idle = Arc::new(Idle {
            count: AtomicUsize::new(0),
            close: tokio::sync::Notify::new(),
            wanted: self.wanted.clone(),
        });
        self.workers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(idle.clone());
        idle
    }

    /// Whether any worker has an idle kept-alive connection.
    pub fn any(&self) -> bool {
        let workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        workers.iter().any(|w| w.count.load(Ordering::Relaxed) > 0)
    }

    /// Ready once some worker has an idle kept-alive connection (at once if one has).
    pub async fn some_idle(&self) {
        let appeared = self.wanted.1.notified();
        let mut appeared = std::pin::pin!(appeared);
        appeared.as_mut().enable();
        self.wanted.0.store(true, Ordering::Relaxed);
        if !self.any() {
            appeared.await;
        }
        self.wanted.0.store(false, Ordering::Relaxed);
    }

    /// Closes one idle kept-alive connection, of the worker that has the most; whether there
    /// was one.
    pub fn close_one(&self) -> bool {
        let workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        let most = workers
            .iter()
            .max_by_key(|w| w.count.load(Ordering::Relaxed))
            .filter(|w| w.count.load(Ordering::Relaxed) > 0);
        if let Some(w) = most {
            w.close.notify_one();
        }
        most.is_some()
    }
}

/// A connection past its client's cap: answered 429 (`Connection: close`) without reading
/// its request, then closed once the client has closed its end or `within` has passed (so
/// that the kernel does not reset it over unread bytes before the answer is read).
pub async fn refuse(mut stream: tokio::net::TcpStream, within: std::time::Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const ANSWER: &[u8] = b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: text/plain\r\ncontent-length: 40\r\nretry-after: 1\r\ncache-control: no-store\r\nconnection: close\r\n\r\ntoo many connections from this client.\r\n";
    let _ = tokio::time::timeout(within, async {
        stream.write_all(ANSWER).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_client_is_held_to_its_cap_and_its_places_come_back() {
        let per = PerClient::new(2, vec!["127.0.0.0/8".parse().unwrap()]);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let (p1, p2) = (per.admit(a).unwrap(), per.admit(a).unwrap());
        assert!(per.admit(a).is_none());
        assert!(per.admit("192.0.2.2".parse().unwrap()).is_some());
        drop(p1);
        assert!(per.admit(a).is_some());
        drop(p2);
        // Exempt peers are not counted at all.
        let local: Vec<_> = (0..10)
            .map(|_| per.admit("127.0.0.5".parse().unwrap()))
            .collect();
        assert!(local.iter().all(Option::is_some));
    }

    #[test]
    fn an_ipv6_client_is_its_64_and_mapped_ipv4_is_ipv4() {
        let per = PerClient::new(1, vec![]);
        let _held = per.admit("2001:db8:1:2::1".parse().unwrap()).unwrap();
        assert!(per.admit("2001:db8:1:2:ffff::9".parse().unwrap()).is_none());
        assert!(per.admit("2001:db8:1:3::1".parse().unwrap()).is_some());
        let _v4 = per.admit("192.0.2.7".parse().unwrap()).unwrap();
        assert!(per.admit("::ffff:192.0.2.7".parse().unwrap()).is_none());
    }

    #[test]
    fn the_worker_with_the_most_idle_connections_is_asked_to_close_one() {
        let idles = Idles::default();
        let (a, b) = (idles.add(), idles.add());
        assert!(!idles.close_one(), "none idle");
        let _one = a.enter();
        let (_two, _three) = (b.enter(), b.enter());
        assert!(idles.close_one());
        // b was told (a stored permit: its next waiter closes at once).
        let told = b.close.notified();
        let mut told = std::pin::pin!(told);
        assert!(futures_util::FutureExt::now_or_never(told.as_mut()).is_some());
        let untold = a.close.notified();
        assert!(futures_util::FutureExt::now_or_never(untold).is_none());
    }
}
