//! Per-worker timers at the anchor's tick, for the two deadlines every request arms: hyper's
//! header-read timeout and the upstream response timeout.
//!
//! Both almost never fire. On tokio's timer wheel each is an entry built per request,
//! registered under the time driver's lock on first poll and deregistered on drop. Here a timer
//! is a slot in the worker's [`Timers`]: arming takes a slot and clones the waker under a lock
//! only the worker's own thread takes, disarming frees it, and the worker's anchor tick wakes
//! those due. No clock read beyond the one that computes the deadline (docs/measurements.md,
//! "Coarse timers").
//!
//! They fire up to one tick late: the tick is half the shorter of the two timeouts, at most a
//! second (`anchor_period` in `proxy/mod.rs`). Must never: be the only thing that bounds a
//! wait that must be exact (use tokio's timers for those).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::Instant;

/// One worker's timers.
#[derive(Default)]
pub struct Timers {
    // Locked by the worker's own thread only (its connections' tasks and its anchor tick), never
    // across an await: never contended.
    #[allow(clippy::disallowed_types)]
    slots: std::sync::Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    entries: Vec<Entry>,
    free: Vec<usize>,
}

struct Entry {
    deadline: Instant,
    /// `None` once fired, or while the slot is free.
    waker: Option<Waker>,
    fired: bool,
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
            for e in slots.entries.iter_mut() {
                if !e.fired && e.deadline <= now {
                    if let Some(w) = e.waker.take() {
                        e.fired = true;
                        due.push(w);
                    }
                }
            }
        }
        // Outside the lock: a wake may poll (or drop) a timer at once.
        due.into_iter().for_each(Waker::wake);
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
}

impl Sleep {
    pub fn until(timers: Arc<Timers>, deadline: Instant) -> Self {
        Self {
            timers,
            deadline,
            slot: None,
        }
    }

    /// Moves the deadline (it may fire again if it had fired).
    pub(crate) fn reset(&mut self, deadline: Instant) {
        self.deadline = deadline;
        if let Some(i) = self.slot {
            let mut slots = self.timers.lock();
            let e = &mut slots.entries[i];
            e.deadline = deadline;
            e.fired = false;
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
                };
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
            slots.entries[i].waker = None;
            slots.entries[i].fired = true;
            slots.free.push(i);
        }
    }
}

impl hyper::rt::Sleep for Sleep {}

/// hyper's HTTP/1 header-read timer for one connection, on its worker's [`Timers`]. hyper
/// arms it when it starts waiting for a head, so its one timeout would bound the idle wait
/// between requests too: here a wait in which no byte came ends after `idle`
/// (`timeouts.client_idle`), and from the first byte read (`heard` moved) the head has
/// `header_read`. hyper polls it after each read that leaves the head unfinished.
#[derive(Clone)]
pub struct HeadTimer {
    pub timers: Arc<Timers>,
    /// Counts the connection's reads that brought bytes.
    pub heard: Arc<std::sync::atomic::AtomicU32>,
    pub idle: Duration,
    pub header_read: Duration,
}

impl HeadTimer {
    fn arm(&self) -> HeadSleep {
        HeadSleep {
            sleep: Sleep::until(self.timers.clone(), Timers::now() + self.idle),
            heard: self.heard.clone(),
            at_arm: self.heard.load(std::sync::atomic::Ordering::Relaxed),
            header_read: self.header_read,
            begun: false,
        }
    }
}

/// [`HeadTimer`]'s timer: `idle`'s until a byte comes, then `header_read`'s from there.
pub struct HeadSleep {
    sleep: Sleep,
    heard: Arc<std::sync::atomic::AtomicU32>,
    at_arm: u32,
    header_read: Duration,
    begun: bool,
}

impl Future for HeadSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if !this.begun && this.heard.load(std::sync::atomic::Ordering::Relaxed) != this.at_arm {
            this.begun = true;
            this.sleep.reset(Timers::now() + this.header_read);
        }
        Pin::new(&mut this.sleep).poll(cx)
    }
}

impl hyper::rt::Sleep for HeadSleep {}

// hyper's `Timer` speaks `std::time::Instant`; converted to and from tokio's at this boundary.
// hyper's HTTP/1 server uses its timer for the header-read timeout alone, so each sleep it
// asks for is a head's.
#[allow(clippy::disallowed_types)]
impl hyper::rt::Timer for HeadTimer {
    fn sleep(&self, _: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(self.arm())
    }

    fn sleep_until(&self, _: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(self.arm())
    }

    fn now(&self) -> std::time::Instant {
        Timers::now().into_std()
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, _: std::time::Instant) {
        match sleep.as_mut().downcast_mut_pin::<HeadSleep>() {
            Some(ours) => {
                let ours = ours.get_mut();
                ours.sleep.reset(Timers::now() + self.idle);
                ours.at_arm = self.heard.load(std::sync::atomic::Ordering::Relaxed);
                ours.begun = false;
            }
            None => *sleep = Box::pin(self.arm()),
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
    fn reset_moves_an_armed_deadline_and_rearms_a_fired_one() {
        let timers = Arc::new(Timers::default());
        let t0 = Timers::now();
        let mut cx = noop_cx();
        let mut s = Sleep::until(timers.clone(), t0 + Duration::from_secs(1));
        assert!(Pin::new(&mut s).poll(&mut cx).is_pending());
        s.reset(t0 + Duration::from_secs(5));
        timers.fire(t0 + Duration::from_secs(2));
        assert!(Pin::new(&mut s).poll(&mut cx).is_pending(), "moved later");
        timers.fire(t0 + Duration::from_secs(5));
        assert!(Pin::new(&mut s).poll(&mut cx).is_ready());
        s.reset(t0 + Duration::from_secs(8));
        assert!(Pin::new(&mut s).poll(&mut cx).is_pending(), "armed again");
        timers.fire(t0 + Duration::from_secs(8));
        assert!(Pin::new(&mut s).poll(&mut cx).is_ready());
    }

    #[test]
    fn a_head_timer_waits_idle_until_a_byte_then_header_read_and_reset_keeps_its_slot() {
        use hyper::rt::Timer;
        use std::sync::atomic::Ordering;
        let timers = Arc::new(Timers::default());
        let timer = HeadTimer {
            timers: timers.clone(),
            heard: Default::default(),
            idle: Duration::from_secs(60),
            header_read: Duration::from_secs(5),
        };
        let t0 = Timers::now();
        let mut s = timer.sleep_until(t0.into_std());
        let mut cx = noop_cx();
        assert!(s.as_mut().poll(&mut cx).is_pending());
        timers.fire(t0 + Duration::from_secs(30));
        assert!(s.as_mut().poll(&mut cx).is_pending(), "idle: no byte came");
        timers.fire(t0 + Duration::from_secs(61));
        assert!(
            s.as_mut().poll(&mut cx).is_ready(),
            "idle for longer than idle"
        );

        timer.reset(&mut s, t0.into_std());
        assert_eq!(timers.armed(), 1, "the same slot, moved");
        assert!(s.as_mut().poll(&mut cx).is_pending());
        timer.heard.fetch_add(1, Ordering::Relaxed);
        assert!(s.as_mut().poll(&mut cx).is_pending(), "a byte came");
        let t1 = Timers::now();
        timers.fire(t1 + Duration::from_secs(4));
        assert!(s.as_mut().poll(&mut cx).is_pending());
        timers.fire(t1 + Duration::from_secs(6));
        assert!(
            s.as_mut().poll(&mut cx).is_ready(),
            "a head begun and not finished within header_read"
        );
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
