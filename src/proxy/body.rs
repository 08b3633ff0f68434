//! A client request's body as the request path holds it: streamed (hyper's for HTTP/2, our
//! HTTP/1 server side's), behind the frames already read of it; or one read whole with its head.
//!
//! Owns reading a small body whole (`in_hand`), and how far one being sent got ([`Progress`],
//! for the exchange's deadlines). Must never: read past what a request's framing says, or hold
//! a body's bytes twice.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body::{Body as _, Frame};
use http_body_util::Either;
use hyper::body::Incoming;

pub use super::http1::request_body::{ClientBodyError, RequestBody};
use smallvec::SmallVec;

/// A request body of up to this many bytes (with a `Content-Length`) is read whole, within
/// the head's deadline, and sent upstream in the head's `write` (nginx's
/// `client_body_buffer_size` on 64-bit systems); a larger one, or one still coming at the
/// deadline, is streamed.
pub const IN_HAND: usize = 16 * 1024;

/// A client request's body: hyper's, or one read whole before it goes on (by our own HTTP/1
/// server side, `http1::server`, with its head; or a small one of hyper's that was all there).
pub type ReqBody = Either<Streamed, InHand>;

/// A request body still coming: hyper's (HTTP/2), or our HTTP/1 server side's; behind the
/// frames of it already read (see `in_hand`).
#[derive(Debug)]
pub struct Streamed {
    /// Boxed: rarely any, and every request (kept in its connection's slot) would carry the room.
    #[allow(clippy::box_collection)]
    ahead: Option<Box<std::collections::VecDeque<Frame<Bytes>>>>,
    rest: Rest,
    /// Told how it is read, when hyper's client sends it (an `h2c://` upstream): the response
    /// timeout starts once it is whole.
    progress: Option<Arc<Progress>>,
}

#[derive(Debug)]
enum Rest {
    Hyper(Incoming),
    Http1(RequestBody),
}

/// How a body being sent upstream is getting on, for its exchange's deadlines (Relaxed: read
/// by the same task): told by our HTTP/1 client's upload as it writes, or by the body itself
/// as hyper's client reads it (an `h2c://` upstream).
#[derive(Debug, Default)]
pub struct Progress {
    /// Bumped whenever a byte was written or the body gave a frame.
    moved: AtomicU64,
    /// It waits on the client's body (else on the upstream).
    on_client: AtomicBool,
    /// Sent whole, or stopped.
    over: AtomicBool,
}

impl Progress {
    pub fn moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }

    pub fn on_client(&self) -> bool {
        self.on_client.load(Ordering::Relaxed)
    }

    pub fn over(&self) -> bool {
        self.over.load(Ordering::Relaxed)
    }

    /// Bytes were written, or the body gave a frame.
    pub(crate) fn moved_on(&self) {
        self.moved.fetch_add(1, Ordering::Relaxed);
    }

    /// It waits on the client's body (`true`) or on the upstream.
    pub(crate) fn waits(&self, on_client: bool) {
        self.on_client.store(on_client, Ordering::Relaxed);
    }

    /// As new, for the next upload.
    pub(crate) fn restart(&self) {
        self.moved.store(0, Ordering::Relaxed);
        self.on_client.store(false, Ordering::Relaxed);
        self.over.store(false, Ordering::Relaxed);
    }

    /// Sent whole, or stopped.
    pub(crate) fn ended(&self) {
        self.over.store(true, Ordering::Relaxed);
    }

    /// The body was polled by hyper's client: it waits on the client (`pending`), gave a frame
    /// (the next wait is the upstream's, until it is polled again), or is `over` (its last
    /// frame, or an error).
    fn polled(&self, pending: bool, gave: bool, over: bool) {
        if gave {
            self.moved_on();
        }
        self.waits(pending);
        if over {
            self.ended();
        }
    }
}

/// Why a streamed body could not be read (hyper's error, or [`ClientBodyError`]).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

impl Streamed {
    pub fn new(rest: Incoming) -> Self {
        Self {
            ahead: None,
            rest: Rest::Hyper(rest),
            progress: None,
        }
    }

    /// A body our HTTP/1 server side reads from the client connection.
    pub fn http1(rest: RequestBody) -> Self {
        Self {
            ahead: None,
            rest: Rest::Http1(rest),
            progress: None,
        }
    }

    /// Tells `progress` how it is read from here on.
    pub fn watched(&mut self, progress: Arc<Progress>) {
        self.progress = Some(progress);
    }

    fn rest_ended(&self) -> bool {
        match &self.rest {
            Rest::Hyper(b) => b.is_end_stream(),
            Rest::Http1(b) => b.is_end_stream(),
        }
    }

    fn poll_rest(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match &mut self.rest {
            Rest::Hyper(b) => std::pin::Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(Into::into))),
            Rest::Http1(b) => std::pin::Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(Into::into))),
        }
    }
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let polled = match self.ahead.as_mut().and_then(|ahead| ahead.pop_front()) {
            Some(frame) => std::task::Poll::Ready(Some(Ok(frame))),
            None => self.poll_rest(cx),
        };
        if let Some(p) = &self.progress {
            let (gave, over) = match &polled {
                std::task::Poll::Pending => (false, false),
                std::task::Poll::Ready(Some(Ok(_))) => (true, self.is_end_stream()),
                std::task::Poll::Ready(_) => (false, true),
            };
            p.polled(polled.is_pending(), gave, over);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.as_ref().is_none_or(|ahead| ahead.is_empty()) && self.rest_ended()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let ahead = self.ahead.iter().flat_map(|ahead| ahead.iter());
        let ahead: u64 = ahead
            .filter_map(|f| f.data_ref())
            .map(|d| d.len() as u64)
            .sum();
        let rest = match &self.rest {
            Rest::Hyper(b) => b.size_hint(),
            Rest::Http1(b) => b.size_hint(),
        };
        let mut hint = http_body::SizeHint::new();
        hint.set_lower(rest.lower() + ahead);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + ahead);
        }
        hint
    }
}

/// Reads what of hyper's `body` is there already, without waiting; the whole body when that
/// was all of it and it is `length` bytes of data. Otherwise what was read stays ahead of the
/// rest, to be streamed. An error is the client's (a malformed or cut body).
/// Called once per request, before anything else reads the body.
pub(super) async fn in_hand(
    body: &mut Streamed,
    length: usize,
) -> Result<Option<Bytes>, BodyError> {
    // Most small bodies are one frame: no allocation for it.
    let mut frames: SmallVec<[Frame<Bytes>; 1]> = SmallVec::new();
    let whole = std::future::poll_fn(|cx| {
        let mut read = 0;
        while !body.rest_ended() && read <= length {
            match body.poll_rest(cx) {
                std::task::Poll::Ready(Some(Ok(frame))) => {
                    read += frame.data_ref().map_or(0, |d| d.len());
                    frames.push(frame);
                }
                std::task::Poll::Ready(Some(Err(e))) => return std::task::Poll::Ready(Err(e)),
                std::task::Poll::Ready(None) => break,
                std::task::Poll::Pending => return std::task::Poll::Ready(Ok(false)),
            }
        }
        std::task::Poll::Ready(Ok(body.rest_ended()
            && read == length
            && frames.iter().all(Frame::is_data)))
    })
    .await?;
    if !whole {
        if !frames.is_empty() {
            let ahead = body.ahead.get_or_insert_with(Default::default);
            ahead.extend(frames);
        }
        return Ok(None);
    }
    // Every frame is data (`whole`). One is the body as it came; more are joined.
    if frames.len() == 1 {
        return Ok(frames.pop().and_then(|f| f.into_data().ok()));
    }
    let mut all = bytes::BytesMut::with_capacity(length);
    for data in frames.into_iter().filter_map(|f| f.into_data().ok()) {
        all.extend_from_slice(&data);
    }
    Ok(Some(all.freeze()))
}

/// What a borrowed request keeps when its body (or the whole request) is taken out of it.
pub fn emptied() -> ReqBody {
    Either::Right(InHand::default())
}

/// A request body read whole before the request was made, given as one frame.
#[derive(Debug, Default)]
pub struct InHand(Option<Bytes>);

impl InHand {
    pub fn new(bytes: Bytes) -> Self {
        Self((!bytes.is_empty()).then_some(bytes))
    }

    /// What is left to give: all of it until the body is polled.
    pub fn bytes(&self) -> &[u8] {
        self.0.as_deref().unwrap_or_default()
    }
}

impl http_body::Body for InHand {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.take().map(|b| Ok(http_body::Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.bytes().len() as u64)
    }
}
