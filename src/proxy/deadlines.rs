//! Per-worker timers at the anchor's tick, for the deadlines every request arms: its head's
//! read (`timeouts.header_read`), the upstream response timeout, and a kept-alive
//! connection's wait for its next request, which an acceptor may fire early ([`Wanted`]) to
//! close the connection for a new client.
//!
//! Both almost never fire. On tokio's timer wheel each is an entry built per request,
//! registered under the time driver's lock on first poll and deregistered on drop. Here a timer
//! is a slot in the worker's [`Timers`]: arming takes a slot and clones the waker under a lock
//! only the worker's own thread takes, disarming frees it, and the worker's anchor tick wakes
//! those due. No clock read beyond the one that computes the deadline (docs/measurements.md,
//! "Coarse timers").
//!
//! They fire up to one tick late: the tick is half the shorter of the two timeouts, at most a
//! second (`anchor_period` in `proxy/settings.rs`). Must never: be the only thing that bounds a
//! wait that must be exact (use tokio's timers for those).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use tokio::time::Instant;

/// Acceptors waiting for a kept-alive connection to go idle (every place taken, none idle).
#[derive(Default)]
pub struct Wanted {
    pub(crate) count: std::sync::atomic::AtomicUsize,
    pub(crate) armed: tokio::sync::Notify,
}

impl Wanted {
    /// A kept-alive connection began to wait for its next request (one relaxed load when no
    /// acceptor waits).
    pub fn armed(&self) {
        if self.count.load(Ordering::Relaxed) > 0 {
            self.armed.notify_waiters();
        }
    }
}

/// One worker's timers.
#[derive(Default)]
pub struct Timers {
    // Locked by the worker's own thread (its connections' tasks and its anchor tick), never
    // across an await; by another worker's acceptor only when every connection place is taken.
    #[allow(clippy::disallowed_types)]
    slots: std::sync::Mutex<Slots>,
    /// Armed closable timers ([`Sleep::closable`]), as of the last change (read without the
    /// lock by acceptors).
    closable: std::sync::atomic::AtomicUsize,
    /// Acceptors waiting for a closable timer to be armed: told when one is.
    pub(crate) wanted: std::sync::OnceLock<Arc<Wanted>>,
}

#[derive(Default)]
struct Slots {
    entries: Vec<Entry>,
    free: Vec<usize>,
    closable: usize,
}

struct Entry {
    deadline: Instant,
    /// `None` once fired, or while the slot is free.
    waker: Option<Waker>,
    fired: bool,
    /// A kept-alive connection's wait for its next request: fired early to make room.
    closable: bool,
}

impl Timers {
    /// The time deadlines are measured in: tokio's clock, so that paused time pauses these too.
    pub fn now() -> Instant {
        Instant::now()
    }

    /// Wakes every armed timer due by `now`.
    pub fn fire(&self, now: Instant) {
        let mut due = Vec::new();
        {
            let mut slots = self.lock();
            let mut closed = 0;
            for e in slots.entries.iter_mut() {
                if !e.fired && e.deadline <= now {
                    if let Some(w) = e.waker.take() {
                        e.fired = true;
                        closed += usize::from(e.closable);
                        due.push(w);
                    }
                }
            }
            if closed > 0 {
                slots.closable -= closed;
                self.closable.store(slots.closable, Ordering::Relaxed);
            }
        }
        // Outside the lock: a wake may poll (or drop) a timer at once.
        due.into_iter().for_each(Waker::wake);
    }

    /// Whether a closable timer is armed.
    pub fn any_closable(&self) -> bool {
        self.closable.load(Ordering::Relaxed) > 0
    }

    /// Fires one armed closable timer now (its connection closes); whether there was one.
    pub fn close_one(&self) -> bool {
        let woken = {
            let mut slots = self.lock();
            let found = slots
                .entries
                .iter_mut()
                .find(|e| e.closable && !e.fired && e.waker.is_some());
            let woken = found.and_then(|e| {
                e.fired = true;
                e.waker.take()
            });
            if woken.is_some() {
                slots.closable -= 1;
                self.closable.store(slots.closable, Ordering::Relaxed);
            }
            woken
        };
        woken.map(Waker::wake).is_some()
    }

    /// Armed timers.
    #[cfg(test)]
    fn armed(&self) -> usize {
        let slots = self.lock();
        slots.entries.len() - slots.free.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        // A panic while holding it leaves plain data: carry on with it.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A future that is ready at the first tick at or after its deadline.
pub struct Sleep {
    timers: Arc<Timers>,
    deadline: Instant,
    /// Taken on first poll.
    slot: Option<usize>,
    closable: bool,
}

impl Sleep {
    pub fn until(timers: Arc<Timers>, deadline: Instant) -> Self {
        Self {
            timers,
            deadline,
            slot: None,
            closable: false,
        }
    }

    /// The same, for a kept-alive connection's wait for its next request: fired early by
    /// [`Timers::close_one`] when a new client needs its place.
    pub fn closable(timers: Arc<Timers>, deadline: Instant) -> Self {
        Self {
            timers,
            deadline,
            slot: None,
            closable: true,
        }
    }

    /// Moves the deadline (fired or not), keeping its slot: no slot given back and taken
    /// again. A closable timer that had fired is armed (and counted) again.
    pub fn reset(&mut self, deadline: Instant) {
        self.deadline = deadline;
        if let Some(i) = self.slot {
            let mut slots = self.timers.lock();
            let e = &mut slots.entries[i];
            e.deadline = deadline;
            // Fired: its waker was taken; the next poll gives one again.
            if std::mem::replace(&mut e.fired, false) && e.closable {
                slots.closable += 1;
                self.timers
                    .closable
                    .store(slots.closable, Ordering::Relaxed);
                if let Some(wanted) = self.timers.wanted.get() {
                    wanted.armed();
                }
            }
        }
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let mut slots = this.timers.lock();
        match this.slot {
            None => {
                let entry = Entry {
                    deadline: this.deadline,
                    waker: Some(cx.waker().clone()),
                    fired: false,
                    closable: this.closable,
                };
                if this.closable {
                    slots.closable += 1;
                    this.timers
                        .closable
                        .store(slots.closable, Ordering::Relaxed);
                    if let Some(wanted) = this.timers.wanted.get() {
                        wanted.armed();
                    }
                }
                let i = match slots.free.pop() {
                    Some(i) => {
                        slots.entries[i] = entry;
                        i
                    }
                    None => {
                        slots.entries.push(entry);
                        slots.entries.len() - 1
                    }
                };
                this.slot = Some(i);
                Poll::Pending
            }
            Some(i) => {
                let e = &mut slots.entries[i];
                if e.fired {
                    return Poll::Ready(());
                }
                match &e.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => e.waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some(i) = self.slot.take() {
            let mut slots = self.timers.lock();
            let e = &mut slots.entries[i];
            let armed = e.closable && !e.fired;
            e.waker = None;
            e.fired = true;
            e.closable = false;
            if armed {
                slots.closable -= 1;
                self.timers
                    .closable
                    .store(slots.closable, Ordering::Relaxed);
            }
            slots.free.push(i);
        }
    }
}

/// `fut`, or `None` when `sleep` fires first.
pub fn timeout<F: Future>(sleep: Sleep, fut: F) -> Timeout<F> {
    Timeout { fut, sleep }
}

pin_project_lite::pin_project! {
    /// [`timeout`]'s future: `fut` and `sleep` side by side. A struct, not an `async fn`: the
    /// compiler keeps an `async fn`'s argument and the local it is pinned in as two fields,
    /// which held the forwarding future twice; a request's future lives as long as its
    /// connection in hyper's dispatcher.
    pub struct Timeout<F> {
        #[pin]
        fut: F,
        sleep: Sleep,
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.fut.poll(cx) {
            return Poll::Ready(Some(out));
        }
        Pin::new(this.sleep).poll(cx).map(|()| None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn noop_cx() -> Context<'static> {
        Context::from_waker(Waker::noop())
    }

    #[test]
    fn a_timer_fires_at_the_first_tick_at_or_after_its_deadline() {
        let timers = Arc::new(Timers::default());
        let t0 = Timers::now();
        let mut sleep = Box::pin(Sleep::until(timers.clone(), t0 + Duration::from_secs(10)));
        let mut cx = noop_cx();
        assert!(sleep.as_mut().poll(&mut cx).is_pending());
        assert_eq!(timers.armed(), 1);
        timers.fire(t0 + Duration::from_secs(9));
        assert!(sleep.as_mut().poll(&mut cx).is_pending(), "not due yet");
        timers.fire(t0 + Duration::from_secs(10));
        assert!(sleep.as_mut().poll(&mut cx).is_ready());
        assert!(sleep.as_mut().poll(&mut cx).is_ready(), "stays ready");
        drop(sleep);
        assert_eq!(timers.armed(), 0);
    }

    #[test]
    fn a_dropped_timer_frees_its_slot_for_the_next_and_never_fires() {
        let timers = Arc::new(Timers::default());
        let t0 = Timers::now();
        let mut cx = noop_cx();
        for _ in 0..100 {
            let mut s = Box::pin(Sleep::until(timers.clone(), t0));
            assert!(s.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(timers.armed(), 0, "every slot came back");
        assert_eq!(timers.lock().entries.len(), 1, "and was reused");
        // A timer never polled takes no slot.
        let _unpolled = Sleep::until(timers.clone(), t0);
        timers.fire(t0 + Duration::from_secs(1));
        assert_eq!(timers.armed(), 0);
    }

    #[test]
    fn a_reset_timer_keeps_its_slot_and_fires_at_its_new_deadline_even_after_firing() {
        let timers = Arc::new(Timers::default());
        let t0 = Timers::now();
        let mut cx = noop_cx();
        let mut sleep = Box::pin(Sleep::until(timers.clone(), t0 + Duration::from_secs(1)));
        assert!(sleep.as_mut().poll(&mut cx).is_pending());
        sleep.reset(t0 + Duration::from_secs(5));
        timers.fire(t0 + Duration::from_secs(1));
        assert!(sleep.as_mut().poll(&mut cx).is_pending(), "moved later");
        timers.fire(t0 + Duration::from_secs(5));
        assert!(sleep.as_mut().poll(&mut cx).is_ready());
        // Fired, then moved: pending again until its new deadline.
        sleep.reset(t0 + Duration::from_secs(8));
        assert!(
            sleep.as_mut().poll(&mut cx).is_pending(),
            "fired, then moved"
        );
        timers.fire(t0 + Duration::from_secs(7));
        assert!(sleep.as_mut().poll(&mut cx).is_pending());
        timers.fire(t0 + Duration::from_secs(8));
        assert!(sleep.as_mut().poll(&mut cx).is_ready());
        assert_eq!(timers.lock().entries.len(), 1, "one slot throughout");
        drop(sleep);
        assert_eq!(timers.armed(), 0);
        // A closable one closed for room, then moved: armed and counted again, and given
        // back once when dropped.
        let mut kept = Box::pin(Sleep::closable(
            timers.clone(),
            t0 + Duration::from_secs(60),
        ));
        assert!(kept.as_mut().poll(&mut cx).is_pending());
        assert!(timers.any_closable());
        assert!(timers.close_one());
        assert!(!timers.any_closable(), "fired for room");
        assert!(kept.as_mut().poll(&mut cx).is_ready());
        kept.reset(t0 + Duration::from_secs(90));
        assert!(timers.any_closable(), "armed again");
        assert!(kept.as_mut().poll(&mut cx).is_pending());
        drop(kept);
        assert!(!timers.any_closable(), "counted off once");
        assert_eq!(timers.lock().closable, 0);
        // A reset before the first poll only moves the deadline.
        let mut early = Box::pin(Sleep::until(timers.clone(), t0));
        early.reset(t0 + Duration::from_secs(20));
        assert!(early.as_mut().poll(&mut cx).is_pending());
        timers.fire(t0 + Duration::from_secs(19));
        assert!(early.as_mut().poll(&mut cx).is_pending());
    }

    #[tokio::test]
    async fn timeout_gives_the_output_or_none_when_the_timer_fires_first() {
        let timers = Arc::new(Timers::default());
        let t0 = Timers::now();
        let soon = Sleep::until(timers.clone(), t0 + Duration::from_secs(60));
        assert_eq!(timeout(soon, async { 7 }).await, Some(7));
        let never = std::future::pending::<u32>();
        let fired = {
            let timers = timers.clone();
            async move {
                // Fires once the timeout below has armed its timer.
                tokio::task::yield_now().await;
                timers.fire(t0 + Duration::from_secs(1));
            }
        };
        let (out, ()) = tokio::join!(
            timeout(
                Sleep::until(timers.clone(), t0 + Duration::from_secs(1)),
                never
            ),
            fired
        );
        assert_eq!(out, None);
        assert_eq!(timers.armed(), 0);
    }
}
