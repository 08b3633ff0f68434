//! Client connections as the acceptors count them: per client address
//! (`limits.max_connections_per_client`; IPv6 by its /64, the listed proxies and
//! `connections_per_client_exempt` without a cap), and the kept-alive HTTP/1 connections idle
//! between two requests (each waits on a closable timer of its worker's), one of which is
//! closed when a new client finds every place (`limits.max_connections`) taken, as nginx
//! does. Must never: take a lock per request (the count's is taken per accepted connection
//! and per closed one), or close a connection with a request in flight.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::key::{client_of, Cidr};
use crate::proxy::deadlines::{Timers, Wanted};

/// Connections open per client address.
pub struct PerClient {
    cap: u32,
    exempt: Vec<Cidr>,
    /// Connections being answered 429 at once: past it, closed without an answer (a flood
    /// of refused connections holds no more descriptors than this).
    refusing: Arc<tokio::sync::Semaphore>,
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
            refusing: Arc::new(tokio::sync::Semaphore::new(REFUSING)),
            open: Default::default(),
        })
    }

    /// A place for a connection from `peer`, given back when dropped; `None` at the cap.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<Place> {
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

/// One acceptor's wait, counted while it lasts (also when its future is dropped).
struct Waiting<'a>(&'a Wanted);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Every worker's timers: a kept-alive HTTP/1 connection waiting for its next request waits
/// on a closable one ([`Timers`]), which is fired early to close it for a new client.
#[derive(Default)]
pub struct Idles {
    // Locked as each worker starts and when every place is taken, never across an await.
    #[allow(clippy::disallowed_types)]
    workers: std::sync::Mutex<Vec<Arc<Timers>>>,
    wanted: Arc<Wanted>,
}

impl Idles {
    pub fn add(&self, timers: &Arc<Timers>) {
        let _ = timers.wanted.set(self.wanted.clone());
        self.lock().push(timers.clone());
    }

    #[allow(clippy::disallowed_types)]
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Timers>>> {
        self.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether any worker has a kept-alive connection idle between requests.
    pub fn any(&self) -> bool {
        self.lock().iter().any(|t| t.any_closable())
    }

    /// Ready once some worker has an idle kept-alive connection (at once if one has).
    pub async fn some_idle(&self) {
        let wanted = &*self.wanted;
        wanted.count.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(wanted);
        let armed = wanted.armed.notified();
        let mut armed = std::pin::pin!(armed);
        armed.as_mut().enable();
        if !self.any() {
            armed.await;
        }
    }

    /// Closes one idle kept-alive connection; whether there was one.
    pub fn close_one(&self) -> bool {
        self.lock()
            .iter()
            .any(|t| t.any_closable() && t.close_one())
    }
}

/// Refused connections answered at once, at most.
const REFUSING: usize = 64;

/// The longest a refused connection is kept while its answer goes out.
const REFUSE_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

impl PerClient {
    /// Answers a connection past its client's cap 429, or closes it at once when
    /// [`REFUSING`] are being answered already.
    pub fn refuse(&self, stream: tokio::net::TcpStream) {
        if let Ok(permit) = self.refusing.clone().try_acquire_owned() {
            tokio::spawn(async move {
                refuse(stream, REFUSE_WITHIN).await;
                drop(permit);
            });
        }
    }
}

/// A connection past its client's cap: answered 429 (`Connection: close`) without reading
/// its request, then closed once the client has closed its end or `within` has passed (so
/// that the kernel does not reset it over unread bytes before the answer is read).
async fn refuse(mut stream: tokio::net::TcpStream, within: std::time::Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // An id as every answer of ours has (no request was read to take one from).
    let id = crate::ids::RequestId::made().text();
    let mut answer = Vec::with_capacity(256);
    answer.extend_from_slice(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: text/plain\r\ncontent-length: 40\r\nretry-after: 1\r\ncache-control: no-store\r\nconnection: close\r\nx-request-id: ");
    answer.extend_from_slice(id.as_bytes());
    answer.extend_from_slice(b"\r\n\r\ntoo many connections from this client.\r\n");
    let _ = tokio::time::timeout(within, async {
        stream.write_all(&answer).await?;
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

    fn poll_once<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> std::task::Poll<F::Output> {
        f.poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
    }

    #[tokio::test]
    async fn an_idle_connections_timer_is_fired_for_a_newcomer() {
        use crate::proxy::deadlines::Sleep;
        let idles = Idles::default();
        let (a, b) = (Arc::new(Timers::default()), Arc::new(Timers::default()));
        idles.add(&a);
        idles.add(&b);
        assert!(!idles.close_one(), "none idle");
        let far = Timers::now() + std::time::Duration::from_secs(3600);
        // A wait that is not closable (a head's deadline) is never fired early.
        let mut head = std::pin::pin!(Sleep::until(a.clone(), far));
        assert!(poll_once(head.as_mut()).is_pending());
        assert!(!idles.any());
        // An acceptor waits; a connection goes idle on b: the acceptor is told.
        let waiting = idles.some_idle();
        let mut waiting = std::pin::pin!(waiting);
        assert!(poll_once(waiting.as_mut()).is_pending());
        let mut idle = std::pin::pin!(Sleep::closable(b.clone(), far));
        assert!(poll_once(idle.as_mut()).is_pending());
        assert!(poll_once(waiting.as_mut()).is_ready());
        assert!(idles.close_one());
        assert!(poll_once(idle.as_mut()).is_ready(), "fired early");
        assert!(!idles.any() && !idles.close_one());
        assert!(poll_once(head.as_mut()).is_pending());
    }
}
