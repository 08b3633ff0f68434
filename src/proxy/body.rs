//! A client request's body as the request path holds it: hyper's, streamed, behind the frames
//! already read of it; or one read whole with its head.
//!
//! Owns reading a small body whole ([`in_hand`]) and telling the server side when a body was
//! read to its end ([`Ended`]). Must never: read past what a request's framing says, or hold
//! a body's bytes twice.

use std::sync::Arc;

use bytes::Bytes;
use http_body::{Body as _, Frame};
use http_body_util::Either;
use hyper::body::Incoming;
use smallvec::SmallVec;

/// A request body of up to this many bytes (with a `Content-Length`) is read whole, within
/// the head's deadline, and sent upstream in the head's `write` (nginx's
/// `client_body_buffer_size` on 64-bit systems); a larger one, or one still coming at the
/// deadline, is streamed.
pub const IN_HAND: usize = 16 * 1024;

/// A client request's body: hyper's, or one read whole before it goes on (by our own HTTP/1
/// server side, `inbound`, with its head; or a small one of hyper's that was all there).
pub type ReqBody = Either<Streamed, InHand>;

/// hyper's body of a request, behind the frames of it already read (see `in_hand`).
#[derive(Debug)]
pub struct Streamed {
    /// Boxed: rarely any, and every request (kept in its connection's slot) would carry the room.
    ahead: Option<Box<Ahead>>,
    rest: Incoming,
}

/// The frames of a body read before the body went on, in order; and who is told when the body
/// has been read to its end.
#[derive(Debug, Default)]
struct Ahead {
    frames: std::collections::VecDeque<Frame<Bytes>>,
    ended: Option<Arc<Ended>>,
}

/// Set once a body has been read to its end: how `inbound` knows that hyper's server has read
/// the whole of a request it served, and may give its connection back.
#[derive(Debug, Default)]
pub struct Ended(std::sync::atomic::AtomicBool);

impl Ended {
    pub fn set(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Streamed {
    pub fn new(rest: Incoming) -> Self {
        Self { ahead: None, rest }
    }

    /// A body that sets `ended` once it has been read to its end.
    pub fn watched(rest: Incoming, ended: Arc<Ended>) -> Self {
        let ahead = Ahead {
            frames: Default::default(),
            ended: Some(ended),
        };
        Self {
            ahead: Some(Box::new(ahead)),
            rest,
        }
    }

    /// Tells whoever watches this body that hyper's part of it is over, when `over`.
    fn over(&self, over: bool) -> bool {
        if over {
            if let Some(ended) = self.ahead.as_ref().and_then(|a| a.ended.as_ref()) {
                ended.set();
            }
        }
        over
    }
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(frame) = self
            .ahead
            .as_mut()
            .and_then(|ahead| ahead.frames.pop_front())
        {
            return std::task::Poll::Ready(Some(Ok(frame)));
        }
        let polled = std::pin::Pin::new(&mut self.rest).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(None) => self.over(true),
            std::task::Poll::Ready(Some(Ok(_))) => self.over(self.rest.is_end_stream()),
            _ => false,
        };
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ahead
            .as_ref()
            .is_none_or(|ahead| ahead.frames.is_empty())
            && self.over(self.rest.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let ahead = self.ahead.iter().flat_map(|ahead| ahead.frames.iter());
        let ahead: u64 = ahead
            .filter_map(|f| f.data_ref())
            .map(|d| d.len() as u64)
            .sum();
        let rest = self.rest.size_hint();
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
/// rest, for the pooled client to stream. An error is the client's (a malformed or cut body).
/// Called once per request, before anything else reads the body.
pub(super) async fn in_hand(
    body: &mut Streamed,
    length: usize,
) -> Result<Option<Bytes>, hyper::Error> {
    // Most small bodies are one frame: no allocation for it.
    let mut frames: SmallVec<[Frame<Bytes>; 1]> = SmallVec::new();
    let whole = std::future::poll_fn(|cx| {
        let mut read = 0;
        while !body.rest.is_end_stream() && read <= length {
            match std::pin::Pin::new(&mut body.rest).poll_frame(cx) {
                std::task::Poll::Ready(Some(Ok(frame))) => {
                    read += frame.data_ref().map_or(0, |d| d.len());
                    frames.push(frame);
                }
                std::task::Poll::Ready(Some(Err(e))) => return std::task::Poll::Ready(Err(e)),
                std::task::Poll::Ready(None) => {
                    body.over(true);
                    break;
                }
                std::task::Poll::Pending => return std::task::Poll::Ready(Ok(false)),
            }
        }
        std::task::Poll::Ready(Ok(body.rest.is_end_stream()
            && read == length
            && frames.iter().all(Frame::is_data)))
    })
    .await?;
    body.over(body.rest.is_end_stream());
    if !whole {
        if !frames.is_empty() {
            let ahead = body.ahead.get_or_insert_with(Default::default);
            ahead.frames.extend(frames);
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
