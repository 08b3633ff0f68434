//! An HTTP/2 connection's responses while hyper sends them: counted open ([`Open`], for closing
//! a connection without streams), and watched for a client that never opens its window (hyper
//! polls a stream's body only while the window has room, so such a client would hold the
//! response, its slots and its upstream connection as long as it liked): the worker's tick
//! drops a response that waited `timeouts.send` on its client. Must never: drop a response that
//! waits on the upstream.

use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use http_body::{Body as _, Frame};

use super::held::{Held, Room};

/// The most of a response a body hands hyper at once: h2 takes a whole piece past a stream's
/// shut window, so this bounds what a client's flow control can make it keep (h2's default
/// frame size: no more frames than hyper would write anyway).
const PIECE: usize = 16 * 1024;
use crate::proxy::deadlines::{Sleep, Timers};
use crate::proxy::response::Body;

/// A response body hyper's server sends: as it is, or (an HTTP/2 stream's) shared with the
/// worker's [`Stalls`]. hyper polls an HTTP/2 body only while the stream's window has room, so
/// a client that never opens it would hold the response, its slots and its upstream connection
/// for as long as it likes; the worker's tick drops such a response once it has waited
/// `timeouts.send` on the client, and hyper resets the stream at its next look.
/// Its request is counted open on its connection until hyper drops it ([`Busy`]).
pub struct Guarded {
    body: Kind,
    _busy: Busy,
}

enum Kind {
    Plain(Body),
    Watched(Arc<Stall>),
}

/// An HTTP/2 stream's response body, and whether it waits on the client.
pub struct Stall {
    // Locked by the stream's task and the worker's tick, both on the worker's thread, never
    // across an await: never contended.
    #[allow(clippy::disallowed_types)]
    state: std::sync::Mutex<Watch>,
}

pub(super) struct Watch {
    /// `None` once dropped for the client's stall.
    pub(super) body: Option<Body>,
    /// The stream's place among its client's upstream connections, until the body's end.
    pub(super) slot: Option<tokio::sync::OwnedSemaphorePermit>,
    /// hyper polled the body since the last tick (no clock read per poll: the tick counts).
    pub(super) polled: bool,
    /// Ticks in a row without a poll while the body was not waited on.
    pub(super) idle: u32,
    /// The last poll found the body pending: the stream waits on the upstream, not the client.
    pub(super) ours: bool,
    /// Ticks in a row the body waited on the upstream without a poll (the upstream silent).
    pub(super) silent: u32,
    /// Its rules' `upstream_body_idle`, in ticks, in place of the worker's.
    pub(super) body_idle: Option<u32>,
    /// The worker's tick (what `body_idle` counts).
    pub(super) tick: Duration,
    /// The stream's task, as of the last poll that found the upstream silent: woken when the
    /// body is given up for `timeouts.upstream_body_idle`, so that hyper resets the stream.
    pub(super) waker: Option<std::task::Waker>,
    /// Its connection's bytes held for the client: the body reads its upstream only with
    /// room in them.
    pub(super) held: Arc<Held>,
    /// Waiting for that room, and charged for it.
    pub(super) waits: bool,
    /// What is left of a chunk the upstream gave past [`PIECE`], handed next.
    pub(super) rest: Option<bytes::Bytes>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if self.waits {
            self.held.charge(false);
        }
        self.held.body(false);
    }
}

/// `d` in ticks of `tick` (at least one), as the worker's tick counts it.
fn ticks(d: Duration, tick: Duration) -> u32 {
    u32::try_from(d.as_nanos().div_ceil(tick.as_nanos().max(1)))
        .unwrap_or(u32::MAX)
        .max(1)
}

impl Stall {
    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, Watch> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One worker's HTTP/2 responses in flight (see [`Guarded`]).
pub struct Stalls {
    // Locked by the worker's own thread only, never across an await.
    #[allow(clippy::disallowed_types)]
    list: std::sync::Mutex<Vec<std::sync::Weak<Stall>>>,
    /// `timeouts.send` in ticks of the worker: a response not polled for more is dropped.
    limit: u32,
    pub(crate) timeouts: prometheus::IntCounter,
    /// `timeouts.upstream_body_idle` in ticks: a body its upstream sent nothing of for more
    /// is given up, counted in `body_idle`.
    body_idle: u32,
    body_idle_errors: prometheus::IntCounter,
    /// The worker's tick, to turn a rule's `upstream_body_idle` into ticks.
    tick: Duration,
}

impl Stalls {
    /// `limit`: `timeouts.send`; `body_idle`: `timeouts.upstream_body_idle`; `tick`: how
    /// often [`Stalls::tick`] runs.
    pub fn new(
        (limit, timeouts): (Duration, prometheus::IntCounter),
        (body_idle, body_idle_errors): (Duration, prometheus::IntCounter),
        tick: Duration,
    ) -> Self {
        Stalls {
            list: Default::default(),
            limit: ticks(limit, tick),
            timeouts,
            body_idle: ticks(body_idle, tick),
            body_idle_errors,
            tick,
        }
    }

    /// `body` for hyper's server; an HTTP/2 stream's watched, holding `slot` until its
    /// connection has written it, and reading only with room in what `held` may hold.
    pub(super) fn guard(
        &self,
        body: Body,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
        busy: Busy,
        held: &Arc<Held>,
    ) -> Guarded {
        if body.is_end_stream() {
            return Guarded {
                body: Kind::Plain(body),
                _busy: busy,
            };
        }
        held.body(true);
        let stall = Arc::new(Stall {
            // See `Stall::state`.
            #[allow(clippy::disallowed_types)]
            state: std::sync::Mutex::new(Watch {
                body: Some(body),
                slot,
                polled: false,
                idle: 0,
                ours: false,
                silent: 0,
                body_idle: None,
                tick: self.tick,
                waker: None,
                held: held.clone(),
                waits: false,
                rest: None,
            }),
        });
        self.list
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(&stall));
        Guarded {
            body: Kind::Watched(stall),
            _busy: busy,
        }
    }

    /// At the worker's tick: drops each response that has waited on its client for the limit
    /// (its slots and upstream connection are freed with it), and forgets the finished ones.
    pub fn tick(&self) {
        self.list
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|weak| {
                let Some(stall) = weak.upgrade() else {
                    return false;
                };
                let mut w = stall.state();
                let Some(body) = &w.body else { return false };
                if body.is_end_stream() {
                    return false;
                }
                let polled = std::mem::take(&mut w.polled);
                if w.ours {
                    w.idle = 0;
                    w.silent = if polled {
                        0
                    } else {
                        w.silent.saturating_add(1)
                    };
                    if w.silent > w.body_idle.unwrap_or(self.body_idle) {
                        // The upstream connection goes with the body; hyper resets the
                        // stream at its next look, which the waker asks for.
                        w.body = None;
                        w.slot = None;
                        self.body_idle_errors.inc();
                        if let Some(waker) = w.waker.take() {
                            waker.wake();
                        }
                        return false;
                    }
                    return true;
                }
                if polled {
                    w.idle = 0;
                    return true;
                }
                w.idle += 1;
                if w.idle > self.limit {
                    w.body = None;
                    w.slot = None;
                    if std::mem::take(&mut w.waits) {
                        w.held.charge(false);
                    }
                    self.timeouts.inc();
                    return false;
                }
                true
            });
    }
}

impl Guarded {
    /// With its rules' `upstream_body_idle`, when they set one.
    pub(super) fn idle_after(self, idle: Option<Duration>) -> Self {
        if let (Some(idle), Kind::Watched(stall)) = (idle, &self.body) {
            let mut w = stall.state();
            w.body_idle = Some(ticks(idle, w.tick));
        }
        self
    }
}

impl http_body::Body for Guarded {
    type Data = <Body as http_body::Body>::Data;
    type Error = <Body as http_body::Body>::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match &mut self.get_mut().body {
            Kind::Plain(body) => Pin::new(body).poll_frame(cx),
            Kind::Watched(stall) => {
                let mut w = stall.state();
                w.polled = true;
                let w = &mut *w;
                let Some(body) = &mut w.body else {
                    return Poll::Ready(Some(Err(
                        "the response was given up: its client took no bytes within timeouts.send, or its upstream sent none within timeouts.upstream_body_idle".into()
                    )));
                };
                // No room: the client has not read what its connection holds (its wait,
                // charged for the upstream buffer it pins), or the process holds its budget
                // (not the client's wait). The upstream is left unread meanwhile.
                match w.held.room(cx) {
                    Room::Yes => {}
                    Room::Client => {
                        w.ours = false;
                        if !std::mem::replace(&mut w.waits, true) {
                            w.held.charge(true);
                        }
                        return Poll::Pending;
                    }
                    Room::Process => {
                        w.ours = true;
                        return Poll::Pending;
                    }
                }
                if std::mem::take(&mut w.waits) {
                    w.held.charge(false);
                }
                let polled = match w.rest.take() {
                    Some(rest) => Poll::Ready(Some(Ok(Frame::data(rest)))),
                    None => Pin::new(body).poll_frame(cx),
                };
                let polled = polled.map(|f| {
                    f.map(|f| {
                        f.map(|frame| match frame.into_data() {
                            Ok(mut data) => {
                                if data.len() > PIECE {
                                    let piece = data.split_to(PIECE);
                                    w.rest = Some(data);
                                    data = piece;
                                }
                                w.held.hand(data.len());
                                Frame::data(data)
                            }
                            Err(frame) => frame,
                        })
                    })
                });
                w.ours = polled.is_pending();
                if w.ours && !w.waker.as_ref().is_some_and(|k| k.will_wake(cx.waker())) {
                    w.waker = Some(cx.waker().clone());
                }
                if matches!(polled, Poll::Ready(None))
                    || (w.rest.is_none() && w.body.as_ref().is_some_and(|b| b.is_end_stream()))
                {
                    w.held.release(w.slot.take());
                }
                polled
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.body {
            Kind::Plain(body) => body.is_end_stream(),
            Kind::Watched(stall) => {
                let w = stall.state();
                w.rest.is_none() && w.body.as_ref().is_none_or(|b| b.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.body {
            Kind::Plain(body) => body.size_hint(),
            Kind::Watched(stall) => stall
                .state()
                .body
                .as_ref()
                .map(|b| b.size_hint())
                .unwrap_or_default(),
        }
    }
}

/// The requests open on an HTTP/2 connection hyper serves, for closing it once it has had
/// none for `timeouts.client_idle`.
#[derive(Default)]
pub(super) struct Open {
    /// Requests whose response body has not ended or been dropped (Relaxed: one thread).
    pub(super) count: AtomicU32,
    /// Requests begun: an idle spell that saw one start is over (none: the connection has
    /// not yet sent its first request).
    pub(super) begun: AtomicU32,
    /// Told when `count` falls to zero.
    pub(super) none: tokio::sync::Notify,
    /// Told when `count` leaves zero: an idle wait in progress is over (and its timer, if
    /// closable, no longer offers the connection for room).
    pub(super) began: tokio::sync::Notify,
}

impl Open {
    /// Ready once the connection has had no open request for `idle` (before its first
    /// request: at `first`, a deadline from its accept), or sooner when a new client needs its
    /// place (after a first request, its wait is closable as a kept-alive HTTP/1 connection's
    /// is); whether it was sooner.
    pub(super) async fn idle(&self, timers: &Arc<Timers>, first: Instant, idle: Duration) -> bool {
        loop {
            let mut none = pin!(self.none.notified());
            none.as_mut().enable();
            if self.count.load(Ordering::Relaxed) != 0 {
                none.await;
                continue;
            }
            let spell = self.begun.load(Ordering::Relaxed);
            let deadline = if spell == 0 {
                first
            } else {
                Timers::now() + idle
            };
            let wait = match spell {
                0 => Sleep::until(timers.clone(), deadline),
                _ => Sleep::closable(timers.clone(), deadline),
            };
            tokio::select! {
                biased;
                () = self.began.notified() => continue,
                () = wait => {}
            }
            if self.count.load(Ordering::Relaxed) == 0
                && self.begun.load(Ordering::Relaxed) == spell
            {
                // Timers fire late, never early, but for room.
                return Timers::now() < deadline;
            }
        }
    }
}

/// One open request of an [`Open`], from its head to its response body's end.
pub(super) struct Busy(Arc<Open>);

impl Busy {
    pub(super) fn new(open: &Arc<Open>) -> Self {
        if open.count.fetch_add(1, Ordering::Relaxed) == 0 {
            open.began.notify_one();
        }
        open.begun.fetch_add(1, Ordering::Relaxed);
        Busy(open.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.none.notify_waiters();
        }
    }
}
