//! HTTP/2 response bytes held for clients: handed to hyper's server by a stream's body and not
//! yet written to the client's socket. [`Budget`] is the process's
//! (`limits.max_response_buffer`), [`Held`] one connection's
//! (`limits.max_response_buffer_per_connection`). A body asks for [`Room`] before it reads its
//! upstream: past its connection's budget while the socket refuses writes, it waits for that
//! client (charged the read buffer its exchange pins, [`WAIT_COST`]); past the process's, the
//! connection with the most unwritten bytes is closed, one at a time, and the body waits. A
//! stream's upstream slot is kept until as much is written as had been handed when it ended.
//! What h2 drops unwritten (a reset stream) is settled once the socket takes writes
//! ([`Budget::settle`]). Must never: let a body read past either budget (one 16 KiB piece per
//! stream at most), count a shut flow-control window as a stalled client, or take a lock on
//! a body's way while under both budgets.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Waker};

use prometheus::{IntCounter, IntGauge};

/// A connection that holds less than this is not closed for the process's budget: closing
/// it would free little, and it is most likely one whose client reads.
const SHED_AT_LEAST: u64 = 64 << 10;

/// What a body waiting for room costs besides its bytes: its upstream exchange's read buffer.
pub const WAIT_COST: u64 = crate::proxy::http1::client::MAX_ROOM as u64;

/// The process's budget: every HTTP/2 connection's held bytes summed (the gauge
/// `spillway_h2_response_bytes_held` is the count itself).
pub struct Budget {
    limit: u64,
    per_connection: u64,
    held: IntGauge,
    shed: IntCounter,
    /// Connections that may hold bytes, to find the one to close. Locked when an HTTP/2
    /// connection starts and when the process is at its budget, never on a body's way.
    #[allow(clippy::disallowed_types)]
    connections: std::sync::Mutex<Vec<Weak<Held>>>,
    /// Bodies waiting for the process's budget (any worker's).
    #[allow(clippy::disallowed_types)]
    waiting: std::sync::Mutex<Vec<Waker>>,
    any_waiting: AtomicBool,
    /// What the connections told to close still hold (freed when they end): not shed again.
    closing: AtomicU64,
}

/// Whether a body may read its next chunk, and if not, whose the wait is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Room {
    Yes,
    /// Its connection holds its budget and the client takes nothing: the client's wait.
    Client,
    /// The process holds its budget: other connections' doing.
    Process,
}

impl Budget {
    pub fn new(limit: u64, per_connection: u64, held: IntGauge, shed: IntCounter) -> Arc<Self> {
        Arc::new(Budget {
            limit,
            per_connection: per_connection.min(limit),
            held,
            shed,
            connections: Default::default(),
            waiting: Default::default(),
            any_waiting: AtomicBool::new(false),
            closing: AtomicU64::new(0),
        })
    }

    /// The bytes one stream may have buffered in hyper (its send buffer): a sixteenth of a
    /// connection's budget, so that a few slow streams do not take all of it.
    pub fn per_stream(&self) -> usize {
        (self.per_connection / 16).clamp(16 << 10, 400 << 10) as usize
    }

    /// A new connection's account.
    pub fn open(self: &Arc<Self>) -> Arc<Held> {
        let held = Arc::new(Held {
            budget: self.clone(),
            pending: AtomicU64::new(0),
            charged: AtomicU64::new(0),
            closing_cost: AtomicU64::new(0),
            open: Default::default(),
            blocked: AtomicBool::new(false),
            waiting: Default::default(),
            any_waiting: AtomicBool::new(false),
            handed: AtomicU64::new(0),
            gone: AtomicU64::new(0),
            parked: Default::default(),
            any_parked: AtomicBool::new(false),
            shed: tokio::sync::Notify::new(),
        });
        let mut list = lock(&self.connections);
        if list.len() == list.capacity() {
            list.retain(|c| c.strong_count() > 0);
        }
        list.push(Arc::downgrade(&held));
        held
    }

    /// Closes the connection holding the most unwritten bytes (at least [`SHED_AT_LEAST`]:
    /// a client that reads is not closed for others' doing), unless those already closing
    /// will bring the process under its budget.
    fn shed_one(&self) {
        let closing = self.closing.load(Ordering::SeqCst);
        if self.held().saturating_sub(closing) < self.limit {
            return;
        }
        let mut list = lock(&self.connections);
        list.retain(|c| c.strong_count() > 0);
        let hog = list
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|c| !c.closing())
            .max_by_key(|c| c.bytes());
        drop(list);
        let Some(hog) = hog.filter(|c| c.bytes() >= SHED_AT_LEAST) else {
            return;
        };
        if hog.pending.fetch_or(CLOSING, Ordering::SeqCst) & CLOSING == 0 {
            // Its bytes are freed when its connection ends; until then they count as closing.
            self.closing.fetch_add(hog.cost(), Ordering::SeqCst);
            hog.closing_cost.store(hog.cost(), Ordering::SeqCst);
            self.shed.inc();
            hog.shed.notify_one();
        }
    }

    fn held(&self) -> u64 {
        self.held.get().max(0) as u64
    }

    /// At most one stream's bytes in hyper: its send buffer and the chunk past it.
    fn per_body(&self) -> u64 {
        self.per_stream() as u64 + WAIT_COST
    }

    /// Brings each connection whose last write was taken whole down to what its open bodies
    /// can hold: h2 frees the bytes of a stream the client resets without writing them, and a
    /// socket that takes every write holds nothing back (what h2 keeps for a shut window is
    /// at most a chunk per stream). Run every tick of one worker.
    pub fn settle(&self) {
        let list = lock(&self.connections);
        for c in list.iter().filter_map(Weak::upgrade) {
            if c.blocked.load(Ordering::Relaxed) {
                continue;
            }
            let most = u64::from(c.open.load(Ordering::Relaxed)) * self.per_body();
            let bytes = c.bytes();
            if bytes > most {
                c.forget(bytes - most);
            }
        }
    }

    fn wake_all(&self) {
        if self.any_waiting.load(Ordering::SeqCst) && self.any_waiting.swap(false, Ordering::SeqCst)
        {
            for w in lock(&self.waiting).drain(..) {
                w.wake();
            }
        }
    }
}

/// Set in [`Held::pending`] once the connection was told to close.
const CLOSING: u64 = 1 << 63;

/// One HTTP/2 connection's held bytes, its waiting bodies and the upstream slots of streams
/// whose bytes it has not yet written.
pub struct Held {
    budget: Arc<Budget>,
    /// Bytes held (and [`CLOSING`]). Relaxed: one connection's task changes it.
    pending: AtomicU64,
    /// [`WAIT_COST`] for each of its bodies waiting for its client to read.
    charged: AtomicU64,
    /// What it held when told to close (counted in [`Budget::closing`] until it ends).
    closing_cost: AtomicU64,
    /// Its bodies not yet dropped.
    open: std::sync::atomic::AtomicU32,
    /// Its socket's last write was refused for want of room (the client is not reading).
    blocked: AtomicBool,
    /// Bodies waiting for this connection's client to read. Locked by the connection's
    /// worker, and by the tick that settles it; never across an await.
    #[allow(clippy::disallowed_types)]
    waiting: std::sync::Mutex<Vec<Waker>>,
    any_waiting: AtomicBool,
    /// Bytes ever handed, and ever gone (written or dropped): a parked slot is given back
    /// once as many are gone as had been handed when its body ended (h2 writes its streams'
    /// bytes about in the order they came).
    handed: AtomicU64,
    gone: AtomicU64,
    /// Upstream slots of ended bodies, with the `handed` count they wait for (in order).
    #[allow(clippy::disallowed_types)]
    parked: std::sync::Mutex<std::collections::VecDeque<(u64, tokio::sync::OwnedSemaphorePermit)>>,
    any_parked: AtomicBool,
    /// Told when the process's budget closes this connection.
    pub(super) shed: tokio::sync::Notify,
}

impl Held {
    fn closing(&self) -> bool {
        self.pending.load(Ordering::Relaxed) & CLOSING != 0
    }

    fn bytes(&self) -> u64 {
        self.pending.load(Ordering::Relaxed) & !CLOSING
    }

    /// What closing it would free.
    fn cost(&self) -> u64 {
        self.bytes() + self.charged.load(Ordering::Relaxed)
    }

    /// A body of this connection begins (`true`) or ends (`false`) a wait for its client
    /// to read (its upstream exchange's read buffer stays pinned meanwhile).
    pub(super) fn charge(&self, waits: bool) {
        if waits {
            self.charged.fetch_add(WAIT_COST, Ordering::Relaxed);
            self.budget.held.add(WAIT_COST as i64);
        } else {
            self.charged.fetch_sub(WAIT_COST, Ordering::Relaxed);
            self.budget.held.sub(WAIT_COST as i64);
            if self.budget.held() < self.budget.limit {
                self.budget.wake_all();
            }
        }
    }

    /// Whether a body of this connection may read its next chunk; if not, whose the wait is,
    /// and `cx` is woken when it may look again. Its connection's budget stops it only while
    /// the client takes nothing (its socket refused the last write): bytes h2 keeps for a
    /// stream's shut window are the client's flow control, not a stall.
    pub(super) fn room(&self, cx: &Context<'_>) -> Room {
        let budget = &*self.budget;
        let full = || self.bytes() >= budget.per_connection && self.blocked.load(Ordering::SeqCst);
        if !full() && budget.held() < budget.limit {
            return Room::Yes;
        }
        if full() {
            push(&mut lock(&self.waiting), cx);
            self.any_waiting.store(true, Ordering::SeqCst);
            // Written meanwhile (by this task, or forgotten by another worker's tick).
            return match full() {
                true => Room::Client,
                false => self.room(cx),
            };
        }
        push(&mut lock(&budget.waiting), cx);
        budget.any_waiting.store(true, Ordering::SeqCst);
        budget.shed_one();
        // Another worker's connection may have written (or closed) meanwhile.
        match budget.held() < budget.limit {
            true => Room::Yes,
            false => Room::Process,
        }
    }

    /// A body handed `n` bytes to hyper.
    #[inline]
    pub(super) fn hand(&self, n: usize) {
        self.handed.fetch_add(n as u64, Ordering::Relaxed);
        self.pending.fetch_add(n as u64, Ordering::Relaxed);
        self.budget.held.add(n as i64);
    }

    /// A body of this connection is made (`true`) or dropped.
    pub(super) fn body(&self, open: bool) {
        if open {
            self.open.fetch_add(1, Ordering::Relaxed);
        } else {
            self.open.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The socket refused a write for want of room (`true`), or took one (then its waiting
    /// bodies look again: its budget stops them only while it refuses).
    #[inline]
    pub(super) fn blocked(&self, blocked: bool) {
        if self.blocked.load(Ordering::Relaxed) != blocked {
            self.blocked.store(blocked, Ordering::SeqCst);
            if !blocked && self.any_waiting.load(Ordering::SeqCst) {
                self.any_waiting.store(false, Ordering::SeqCst);
                for w in lock(&self.waiting).drain(..) {
                    w.wake();
                }
            }
        }
    }

    /// The connection wrote `n` bytes to its client (frame headers too: they count against
    /// what it held, which errs toward more room by 9 bytes a frame).
    #[inline]
    pub(super) fn wrote(&self, n: usize) {
        self.blocked(false);
        if self.bytes() == 0 {
            return;
        }
        self.forget(n as u64);
    }

    /// `n` of the bytes it held are gone (written, or dropped by h2). Also from another
    /// worker's tick ([`Budget::settle`]): never below zero.
    fn forget(&self, n: u64) {
        let mut taken = 0;
        let word = self
            .pending
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                taken = n.min(w & !CLOSING);
                Some(w - taken)
            })
            .unwrap_or_else(|w| w);
        let bytes = word & !CLOSING;
        let n = taken;
        self.budget.held.sub(n as i64);
        if self.any_waiting.load(Ordering::SeqCst) && bytes - n < self.budget.per_connection {
            self.any_waiting.store(false, Ordering::SeqCst);
            for w in lock(&self.waiting).drain(..) {
                w.wake();
            }
        }
        if self.budget.held() < self.budget.limit {
            self.budget.wake_all();
        }
        let gone = self.gone.fetch_add(n, Ordering::Relaxed) + n;
        if self.any_parked.load(Ordering::Relaxed) {
            let mut parked = lock(&self.parked);
            // All written: whatever order h2 took them in, every parked slot is free.
            let all = bytes == n;
            while parked.front().is_some_and(|(at, _)| all || *at <= gone) {
                parked.pop_front();
            }
            self.any_parked.store(!parked.is_empty(), Ordering::Relaxed);
        }
    }

    /// A stream's body has ended: its upstream slot is given back once this connection has
    /// written what it holds.
    pub(super) fn release(&self, slot: Option<tokio::sync::OwnedSemaphorePermit>) {
        if let Some(slot) = slot {
            if self.bytes() > 0 {
                let at = self.handed.load(Ordering::Relaxed);
                lock(&self.parked).push_back((at, slot));
                self.any_parked.store(true, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let closing = self.closing_cost.load(Ordering::SeqCst);
        if closing > 0 {
            self.budget.closing.fetch_sub(closing, Ordering::SeqCst);
        }
        let bytes = self.cost();
        if bytes > 0 {
            self.budget.held.sub(bytes as i64);
            self.budget.wake_all();
        }
    }
}

/// Adds `cx`'s waker to `list` unless it is there already (a body polled again while it
/// waits).
fn push(list: &mut Vec<Waker>, cx: &Context<'_>) {
    if !list.iter().any(|w| w.will_wake(cx.waker())) {
        list.push(cx.waker().clone());
    }
}

// The locks above say why each is taken.
#[allow(clippy::disallowed_types)]
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Wake;

    struct Count(std::sync::atomic::AtomicU32);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn budget(limit: u64, per: u64) -> Arc<Budget> {
        Budget::new(
            limit,
            per,
            IntGauge::new("held", "h").unwrap(),
            IntCounter::new("shed", "s").unwrap(),
        )
    }

    #[test]
    fn a_connection_at_its_budget_waits_while_its_client_reads_nothing() {
        let b = budget(1 << 20, 100 << 10);
        let c = b.open();
        let woken = Arc::new(Count(Default::default()));
        let waker = Waker::from(woken.clone());
        let cx = Context::from_waker(&waker);
        assert_eq!(c.room(&cx), Room::Yes);
        c.hand(100 << 10);
        assert_eq!(
            c.room(&cx),
            Room::Yes,
            "bytes a shut window keeps are the client's flow control, not a stall"
        );
        c.blocked(true);
        assert_eq!(c.room(&cx), Room::Client, "at its budget, its socket full");
        assert_eq!(b.held(), 100 << 10);
        c.wrote(10);
        assert_eq!(woken.0.load(Ordering::SeqCst), 1, "woken once it reads");
        assert_eq!(c.room(&cx), Room::Yes);
        // More written than held (frame headers) takes nothing below zero.
        c.wrote(1 << 20);
        assert_eq!((c.bytes(), b.held()), (0, 0));
    }

    #[test]
    fn at_the_process_budget_the_connection_holding_most_is_closed_once() {
        let b = budget(256 << 10, 200 << 10);
        let (small, big, asking) = (b.open(), b.open(), b.open());
        small.hand(80 << 10);
        big.hand(180 << 10);
        let waker = Waker::from(Arc::new(Count(Default::default())));
        let cx = Context::from_waker(&waker);
        assert_eq!(
            asking.room(&cx),
            Room::Process,
            "the process is at its budget"
        );
        assert!(big.closing() && !small.closing());
        // Asked again before the closed one has ended: no second connection goes for it.
        assert_eq!(asking.room(&cx), Room::Process);
        assert!(!small.closing());
        assert_eq!(b.shed.get(), 1);
        // Its bytes are freed when the connection ends, and the waiting bodies woken.
        drop(big);
        assert_eq!(b.held(), 80 << 10);
        assert_eq!(b.closing.load(Ordering::SeqCst), 0);
        assert_eq!(asking.room(&cx), Room::Yes);
    }

    #[test]
    fn a_client_that_reads_is_not_closed_for_the_waits_of_others() {
        let b = budget(4 * WAIT_COST, 1 << 20);
        let (c, other) = (b.open(), b.open());
        let waker = Waker::from(Arc::new(Count(Default::default())));
        let cx = Context::from_waker(&waker);
        for _ in 0..4 {
            c.charge(true);
        }
        assert_eq!(
            other.room(&cx),
            Room::Process,
            "the process's budget counts the waits"
        );
        assert!(!c.closing(), "no unwritten bytes: nothing to close it for");
        for _ in 0..4 {
            c.charge(false);
        }
        assert_eq!(b.held(), 0);
        assert_eq!(other.room(&cx), Room::Yes);
    }

    #[test]
    fn bytes_h2_dropped_unwritten_are_settled_once_the_socket_takes_writes() {
        let b = budget(1 << 30, 1 << 20);
        let c = b.open();
        c.body(true);
        c.hand(900 << 10);
        // The client resets the stream: h2 drops what it held, nothing is written.
        c.body(false);
        c.blocked(true);
        b.settle();
        assert_eq!(
            c.bytes(),
            900 << 10,
            "a blocked socket may still hold it all"
        );
        c.wrote(100);
        b.settle();
        assert_eq!((c.bytes(), b.held()), (0, 0), "no body left to hold any");
        c.body(true);
        c.hand(900 << 10);
        b.settle();
        assert_eq!(
            c.bytes(),
            b.per_body(),
            "an open body holds a stream's worth at most"
        );
    }

    #[test]
    fn a_slot_waits_for_its_connections_bytes_to_be_written() {
        let b = budget(1 << 20, 1 << 20);
        let c = b.open();
        let slots = Arc::new(tokio::sync::Semaphore::new(1));
        c.hand(1000);
        c.release(Some(slots.clone().try_acquire_owned().unwrap()));
        assert_eq!(slots.available_permits(), 0, "held while unsent");
        c.wrote(600);
        assert_eq!(slots.available_permits(), 0);
        c.wrote(600);
        assert_eq!(slots.available_permits(), 1, "given back once written");
    }

    #[test]
    fn a_slot_is_not_held_behind_another_streams_endless_bytes() {
        let b = budget(1 << 30, 1 << 20);
        let c = b.open();
        let slots = Arc::new(tokio::sync::Semaphore::new(1));
        // A long download keeps the connection holding bytes while a short answer ends.
        c.hand(5000);
        c.hand(300);
        c.release(Some(slots.clone().try_acquire_owned().unwrap()));
        c.hand(5000);
        c.wrote(5000);
        assert_eq!(slots.available_permits(), 0);
        c.wrote(300);
        assert_eq!(
            slots.available_permits(),
            1,
            "as much written as was handed when it ended, though the connection still holds 5000"
        );
        assert_eq!(c.bytes(), 5000);
    }
}
