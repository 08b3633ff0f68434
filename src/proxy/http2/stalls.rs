//! HTTP/2 responses watched for a client that never opens its window: hyper polls a stream's
//! body only while the window has room, so such a client would hold the response, its slots and
//! its upstream connection as long as it liked. The worker's tick drops a response that waited
//! `timeouts.send` on its client. Must never: drop a response that waits on the upstream.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body as _, Frame};

use crate::proxy::respond::Body;

/// A response body hyper's server sends: as it is, or (an HTTP/2 stream's) shared with the
/// worker's [`Stalls`]. hyper polls an HTTP/2 body only while the stream's window has room, so
/// a client that never opens it would hold the response, its slots and its upstream connection
/// for as long as it likes; the worker's tick drops such a response once it has waited
/// `timeouts.send` on the client, and hyper resets the stream at its next look.
pub enum Guarded {
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
}

impl Stalls {
    /// `limit`: `timeouts.send`; `tick`: how often [`Stalls::tick`] runs.
    pub fn new(limit: Duration, tick: Duration, timeouts: prometheus::IntCounter) -> Self {
        let ticks = limit.as_nanos().div_ceil(tick.as_nanos().max(1));
        Stalls {
            list: Default::default(),
            limit: u32::try_from(ticks).unwrap_or(u32::MAX).max(1),
            timeouts,
        }
    }

    /// `body` for hyper's server; an HTTP/2 stream's watched, holding `slot` to its end.
    pub(super) fn guard(
        &self,
        body: Body,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Guarded {
        if body.is_end_stream() {
            return Guarded::Plain(body);
        }
        let stall = Arc::new(Stall {
            // See `Stall::state`.
            #[allow(clippy::disallowed_types)]
            state: std::sync::Mutex::new(Watch {
                body: Some(body),
                slot,
                polled: false,
                idle: 0,
                ours: false,
            }),
        });
        self.list
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(&stall));
        Guarded::Watched(stall)
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
                if std::mem::take(&mut w.polled) || w.ours {
                    w.idle = 0;
                    return true;
                }
                w.idle += 1;
                if w.idle > self.limit {
                    w.body = None;
                    w.slot = None;
                    self.timeouts.inc();
                    return false;
                }
                true
            });
    }
}

impl http_body::Body for Guarded {
    type Data = <Body as http_body::Body>::Data;
    type Error = <Body as http_body::Body>::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.get_mut() {
            Guarded::Plain(body) => Pin::new(body).poll_frame(cx),
            Guarded::Watched(stall) => {
                let mut w = stall.state();
                w.polled = true;
                let Some(body) = &mut w.body else {
                    return Poll::Ready(Some(Err(
                        "the client took no bytes within timeouts.send".into()
                    )));
                };
                let polled = Pin::new(body).poll_frame(cx);
                w.ours = polled.is_pending();
                if matches!(polled, Poll::Ready(None))
                    || w.body.as_ref().is_some_and(|b| b.is_end_stream())
                {
                    w.slot = None;
                }
                polled
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Guarded::Plain(body) => body.is_end_stream(),
            Guarded::Watched(stall) => stall
                .state()
                .body
                .as_ref()
                .is_none_or(|b| b.is_end_stream()),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            Guarded::Plain(body) => body.size_hint(),
            Guarded::Watched(stall) => stall
                .state()
                .body
                .as_ref()
                .map(|b| b.size_hint())
                .unwrap_or_default(),
        }
    }
}
