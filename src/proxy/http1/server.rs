//! The server side: one task per client connection reads a request head into the
//! connection's buffer, parses it (httparse) into the request the request path takes, and
//! writes the response head and what of its body is there in one `write`.
//!
//! Serves what [`super`] says; a small body (one `Content-Length` up to [`IN_HAND`]) is read
//! whole within the head's deadline and goes upstream in the head's `write`. A streamed body
//! is served by hyper's HTTP/1 server for that one request ([`by_hyper_once`]), and the
//! connection comes back once hyper is between requests; anything else is hyper's for good.
//! Each head must be whole within `timeouts.header_read`, parsed again only once its end may
//! have come ([`HeadEnd`]); each write must take a byte within `timeouts.send`. The connection
//! stays open unless the client or the response says `close`, the body was cut short, or the
//! worker drains. While a request is in flight the socket is peeked only when readable: an end
//! of stream abandons the request. Must never: allocate a buffer per request, or hold the
//! request or response where a move through futures would copy it.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body as _, Frame};
use http_body_util::Either;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::framing::{field, has_token, keeps_alive, parse_length, HeadEnd};
pub use crate::proxy::body::IN_HAND;
use crate::proxy::body::{Ended, InHand, ReqBody, Streamed};
use crate::proxy::coarse::{HeadTimer, Sleep, Timers};
use crate::proxy::respond::{self, Body, Own};
use crate::proxy::{handle, AbandonGuard, Conn};

/// Header fields in a request head at most (hyper's limit too); more hands the connection to
/// hyper, which answers 431.
const MAX_HEADERS: usize = 100;
/// The buffer's first size, and its least room for a read: most request heads are a few
/// hundred bytes (nginx starts with 1 KiB). A larger head doubles it as it comes.
const READ: usize = 2 * 1024;
/// Body pieces up to this size are copied behind the head (or, in chunks, behind the chunks
/// before them) and written with it; a larger one is written on its own.
pub const COALESCE: usize = 16 * 1024;

/// What a worker's connections share.
pub struct Lane {
    /// hyper's server, for the connections handed to it (each given its own HTTP/1 head
    /// timer, [`HeadTimer`]).
    pub hyper: auto::Builder<TokioExecutor>,
    /// hyper's HTTP/1 server, configured as `hyper`'s, for a request whose body it streams.
    pub h1: hyper::server::conn::http1::Builder,
    /// A partial head at least this long is handed to hyper (which answers 431).
    pub max_head: usize,
    pub header_read: Duration,
    /// `timeouts.client_idle`: the wait for a kept-alive connection's next request.
    pub client_idle: Duration,
    /// `timeouts.send`: a client that takes no byte of a response for this long is dropped.
    pub send: Duration,
    /// The worker's timers (the header-read and send deadlines).
    pub timers: Arc<Timers>,
    /// The worker's HTTP/2 responses, watched for a window that stays shut.
    pub stalls: Arc<Stalls>,
    /// Turns true when the worker drains.
    pub draining: watch::Receiver<bool>,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

impl Lane {
    /// hyper's HTTP/1 head timer for a connection whose reads `heard` counts.
    fn head_timer(&self, heard: &Arc<AtomicU32>) -> HeadTimer {
        HeadTimer {
            timers: self.timers.clone(),
            heard: heard.clone(),
            idle: self.client_idle,
            header_read: self.header_read,
        }
    }
}

/// Serves the client connection `stream` until it ends.
pub(in crate::proxy) async fn serve(
    stream: TcpStream,
    conn: Arc<Conn>,
    lane: Arc<Lane>,
) -> Result<(), Error> {
    let mut draining = lane.draining.clone();
    // Made once per connection: waiting on it costs nothing per request.
    let mut drained = pin!(async move {
        let _ = draining.wait_for(|d| *d).await;
    });
    let mut s = Served {
        stream,
        buf: BytesMut::with_capacity(READ),
        out: Vec::with_capacity(512),
        clock: SendClock::new(&lane),
        kept: false,
    };
    // Where each request is made: it is borrowed by the request path (each move down its
    // futures would copy it) and dropped before its response is written.
    let mut slot = None;
    // The last request was lent to hyper: a client whose requests all stream their bodies
    // (uploads only) is left to hyper from its second such request on, rather than paying for
    // a hyper connection made for each request and each head parsed twice (here and by hyper).
    let mut lent = false;
    loop {
        let mut asked;
        let mut resp = {
            let req = match s.head(&lane, drained.as_mut(), &mut slot).await? {
                Next::Request(req) => req,
                Next::Closed => return Ok(()),
                Next::Hyper { back } if !back || lent => {
                    return hand_off(s, conn, &lane, drained).await
                }
                Next::Hyper { .. } => {
                    match by_hyper_once(s, &conn, &lane, drained.as_mut()).await? {
                        Some(back) => {
                            s = back;
                            lent = true;
                            continue;
                        }
                        None => return Ok(()),
                    }
                }
            };
            lent = false;
            asked = Asked::of(req);
            let guard = AbandonGuard(Some(conn.clone()));
            let answer = pin!(handle(&conn, req));
            let Some(resp) = unless_left(&s.stream, answer).await else {
                // The client left: the request's future is gone, `guard` counts it.
                return Ok(());
            };
            guard.disarm();
            resp
        };
        slot = None;
        asked.keep_alive &= !lane.draining.has_changed().unwrap_or(true);
        if !s.respond(&mut resp, asked).await? {
            let _ = s.stream.shutdown().await;
            return Ok(());
        }
        s.kept = true;
    }
}

/// What came in on a connection.
enum Next<'a> {
    /// Made in the caller's slot (moved out through the futures, it would be copied at each).
    Request(&'a mut Request<ReqBody>),
    /// Closed by the client, timed out in a head, or the worker drains.
    Closed,
    /// For hyper to serve: from here on, or (`back`) a request whose body it streams, after
    /// which the connection may come back.
    Hyper { back: bool },
}

struct Served {
    stream: TcpStream,
    /// Read and not yet used.
    buf: BytesMut,
    /// The response head being written, kept for the next one.
    out: Vec<u8>,
    /// Bounds how long a write may wait for the client to take bytes.
    clock: SendClock,
    /// A response was written and the connection kept: the next wait is `client_idle`'s.
    kept: bool,
}

/// `timeouts.send` for a client's writes (nginx's `send_timeout`): a write that takes no byte
/// for that long fails, and the connection with it (its request's slots are freed as the
/// response is dropped). Armed only when a write has to wait: a client that keeps up costs
/// nothing.
pub(super) struct SendClock {
    timers: Arc<Timers>,
    limit: Duration,
    wait: Option<Sleep>,
    timeouts: prometheus::IntCounter,
}

impl SendClock {
    fn new(lane: &Lane) -> Self {
        SendClock {
            timers: lane.timers.clone(),
            limit: lane.send,
            wait: None,
            timeouts: lane.stalls.timeouts.clone(),
        }
    }

    /// A write's outcome, `polled`, with the wait bounded: pending arms the deadline (once per
    /// wait), past it the write fails; any progress disarms it.
    fn bound<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.wait = None;
            return polled;
        }
        let (timers, limit) = (&self.timers, self.limit);
        let wait = self
            .wait
            .get_or_insert_with(|| Sleep::until(timers.clone(), Timers::now() + limit));
        match Pin::new(wait).poll(cx) {
            Poll::Ready(()) => {
                self.timeouts.inc();
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client took no bytes within timeouts.send",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

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

struct Watch {
    /// `None` once dropped for the client's stall.
    body: Option<Body>,
    /// The stream's place among its client's upstream connections, until the body's end.
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
    /// hyper polled the body since the last tick (no clock read per poll: the tick counts).
    polled: bool,
    /// Ticks in a row without a poll while the body was not waited on.
    idle: u32,
    /// The last poll found the body pending: the stream waits on the upstream, not the client.
    ours: bool,
}

impl Stall {
    fn state(&self) -> std::sync::MutexGuard<'_, Watch> {
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
    timeouts: prometheus::IntCounter,
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
    fn guard(
        &self,
        body: Body,
        version: Version,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Guarded {
        if version != Version::HTTP_2 || body.is_end_stream() {
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

/// Writes all of `bytes` to the client, each wait for it bounded by `clock`.
async fn send_all(
    stream: &mut TcpStream,
    clock: &mut SendClock,
    mut bytes: &[u8],
) -> io::Result<()> {
    // Most writes take everything at once: no future, no clock.
    while !bytes.is_empty() {
        match stream.try_write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    while !bytes.is_empty() {
        let n = std::future::poll_fn(|cx| {
            let polled = Pin::new(&mut *stream).poll_write(cx, bytes);
            clock.bound(cx, polled)
        })
        .await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        bytes = &bytes[n..];
    }
    Ok(())
}

impl Served {
    /// Reads until the buffer holds a whole request head this side serves, and its small
    /// body: a new connection's within `timeouts.header_read` of the start; a kept one waits
    /// `timeouts.client_idle` for the next head's first byte, then `header_read` from there.
    async fn head<'a>(
        &mut self,
        lane: &Lane,
        mut drained: Pin<&mut impl Future>,
        slot: &'a mut Option<Request<ReqBody>>,
    ) -> io::Result<Next<'a>> {
        // Armed (a slot in the worker's timers) only when a read has to wait. Between two
        // requests of a kept connection the wait is `client_idle`'s; a head's own time starts
        // at its first byte.
        let mut between = self.kept && self.buf.is_empty();
        let wait = if between {
            lane.client_idle
        } else {
            lane.header_read
        };
        let mut deadline = Sleep::until(lane.timers.clone(), Timers::now() + wait);
        // The head's first byte came after an idle wait: its own deadline is made only if a
        // read has to wait for the rest (most heads come whole in that first read).
        let mut begun = false;
        // Bytes the buffer must hold before the head is parsed again: a whole head's and its
        // small body's, once the body is known to be short of them.
        let mut need = 1;
        // A head trickled in is parsed again only once its end may have come: linear in its
        // size, not quadratic.
        let mut end = HeadEnd::default();
        loop {
            if self.buf.len() >= need && (need > 1 || end.may_end(&self.buf)) {
                match parse(&mut self.buf) {
                    Parsed::Request(req) => return Ok(Next::Request(slot.insert(req))),
                    Parsed::Other => return Ok(Next::Hyper { back: false }),
                    Parsed::Streamed => return Ok(Next::Hyper { back: true }),
                    // What of the body the socket holds now; the rest is waited for here
                    // within the head's deadline, as nginx buffers a small body before it
                    // forwards. A body that comes apart from its head (a client's second
                    // write, a second TCP segment) keeps the connection on this side.
                    Parsed::Short(whole) => {
                        need = whole;
                        if self.read_now(whole)? {
                            continue;
                        }
                    }
                    Parsed::Partial => {}
                }
            }
            if need == 1 && self.buf.len() >= lane.max_head {
                return Ok(Next::Hyper { back: false });
            }
            if self.buf.capacity() - self.buf.len() < 1024 {
                // Reclaimed in place once the last request's head is gone; grown otherwise.
                self.buf.reserve(self.buf.len().max(READ));
            }
            if std::mem::take(&mut begun) {
                deadline = Sleep::until(lane.timers.clone(), Timers::now() + lane.header_read);
            }
            // Between requests the worker's drain ends the wait; within a head, the deadline.
            let idle = self.buf.is_empty();
            let n = tokio::select! {
                biased;
                n = self.stream.read_buf(&mut self.buf) => n,
                // A whole head whose small body is still coming is hyper's to stream from
                // here (a slow upload is served, not cut off); anything else ends.
                _ = &mut deadline => {
                    return Ok(if need > 1 { Next::Hyper { back: true } } else { Next::Closed })
                }
                _ = drained.as_mut(), if idle => return Ok(Next::Closed),
            };
            match n {
                Ok(0) => return Ok(Next::Closed),
                Ok(_) if between => {
                    between = false;
                    begun = true;
                }
                Ok(_) => {}
                Err(e) if is_gone(&e) => return Ok(Next::Closed),
                Err(e) => return Err(e),
            }
        }
    }

    /// Reads what the socket holds, without waiting, until the buffer has `need` bytes;
    /// whether it has.
    fn read_now(&mut self, need: usize) -> io::Result<bool> {
        self.buf.reserve(need.saturating_sub(self.buf.len()));
        while self.buf.len() < need {
            match self.stream.try_read_buf(&mut self.buf) {
                Ok(0) => return Ok(false),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock || is_gone(&e) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Writes `resp`; whether the connection may serve another request. Borrows it where the
    /// caller has it: moved into this future, a response (264 bytes) would be copied again.
    async fn respond(&mut self, resp: &mut Response<Body>, asked: Asked) -> io::Result<bool> {
        let status = resp.status();
        let mut stay = asked.keep_alive && !asks_close(resp.headers());
        let given = resp
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| parse_length(v.as_bytes()));
        let known = resp.body().size_hint().exact();
        let framing = if asked.head
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            Framing::None
        } else if let Some(n) = given.or(known) {
            Framing::Length(n)
        } else if asked.http10 {
            stay = false;
            Framing::Close
        } else {
            Framing::Chunked
        };
        self.out.clear();
        write_head(
            &mut self.out,
            status,
            (resp.headers(), Lines::of(resp.body())),
            &framing,
            known,
            asked,
            stay,
        );
        // Not kept while the body streams.
        drop(std::mem::take(resp.headers_mut()));
        let mut body = Pin::new(resp.body_mut());
        if let Framing::None = framing {
            send_all(&mut self.stream, &mut self.clock, &self.out).await?;
            return Ok(stay);
        }
        let mut left = match framing {
            Framing::Length(n) => n,
            _ => u64::MAX,
        };
        while left > 0 {
            // What is there already goes in the same write as what is queued: the head and
            // the first piece; in chunks, the chunks the upstream sent together and the chunked
            // end. Before waiting for more (a slow app, a stream of events) what is queued is
            // written, so that nothing waits behind a piece still to come.
            let frame =
                match std::future::poll_fn(|cx| Poll::Ready(body.as_mut().poll_frame(cx))).await {
                    Poll::Ready(f) => f,
                    Poll::Pending => {
                        self.flush().await?;
                        std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await
                    }
                };
            let mut data = match frame {
                None => break,
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) => d,
                    // Trailers: not for an HTTP/1 client.
                    Err(_) => continue,
                },
                // The body broke off: the client can only tell by the close.
                Some(Err(_)) => {
                    self.flush().await?;
                    return Ok(false);
                }
            };
            if let Framing::Length(_) = framing {
                if data.len() as u64 > left {
                    // More than the length said: what is beyond it cannot be sent.
                    data.truncate(left as usize);
                    stay = false;
                }
                left -= data.len() as u64;
            }
            if data.is_empty() {
                continue;
            }
            self.put(&data, &framing).await?;
            // The rest of a body of known length or read to the close comes with the
            // upstream's next read: written now, not after a read that would only find nothing.
            if !matches!(framing, Framing::Chunked) || self.out.len() >= COALESCE {
                self.flush().await?;
            }
        }
        if let Framing::Chunked = framing {
            self.out.extend_from_slice(b"0\r\n\r\n");
        }
        self.flush().await?;
        // A body shorter than its length: the client learns it from the close.
        Ok(stay
            && matches!(framing, Framing::Chunked | Framing::Length(_))
            && (left == 0 || left == u64::MAX))
    }

    /// Queues one piece of the body behind what is queued; a large piece is written at once.
    async fn put(&mut self, data: &Bytes, framing: &Framing) -> io::Result<()> {
        use std::io::Write as _;
        let chunked = matches!(framing, Framing::Chunked);
        if chunked {
            let _ = write!(self.out, "{:x}\r\n", data.len());
        }
        if data.len() <= COALESCE {
            self.out.extend_from_slice(data);
        } else {
            self.flush().await?;
            send_all(&mut self.stream, &mut self.clock, data).await?;
        }
        if chunked {
            self.out.extend_from_slice(b"\r\n");
        }
        Ok(())
    }

    /// Writes what is queued.
    async fn flush(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            send_all(&mut self.stream, &mut self.clock, &self.out).await?;
            self.out.clear();
        }
        Ok(())
    }
}

/// What the request said about its response.
#[derive(Clone, Copy)]
struct Asked {
    head: bool,
    http10: bool,
    /// The client keeps the connection (and the worker is not draining).
    keep_alive: bool,
}

impl Asked {
    fn of(req: &Request<ReqBody>) -> Asked {
        let connection: smallvec::SmallVec<[&[u8]; 2]> = req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        Asked {
            head: req.method() == Method::HEAD,
            http10: req.version() == Version::HTTP_10,
            keep_alive: keeps_alive(req.version(), &connection),
        }
    }
}

/// How a response's body is delimited.
enum Framing {
    None,
    Length(u64),
    Chunked,
    Close,
}

/// Header lines a response brings as they are to be written: a kept 429's, or those the
/// upstream wrote (neither has `Connection` or `Transfer-Encoding`).
#[derive(Default)]
struct Lines<'a> {
    runs: SmallVec<[&'a [u8]; 3]>,
    date: bool,
    length: bool,
}

impl<'a> Lines<'a> {
    fn of(body: &'a Body) -> Self {
        match body {
            Either::Right(Own::Canned(canned)) => Lines {
                runs: smallvec::smallvec![canned.fields()],
                ..Lines::default()
            },
            Either::Left(permit) => match permit.inner() {
                Either::Right(raw) => match raw.passed() {
                    Some(passed) => Lines {
                        runs: passed.runs().collect(),
                        date: passed.date,
                        length: passed.length,
                    },
                    None => Lines::default(),
                },
                Either::Left(_) => Lines::default(),
            },
            Either::Right(Own::Doc(_)) => Lines::default(),
        }
    }
}

/// The status line and the header fields: the response's own, except those this side sets
/// (`Connection`, `Transfer-Encoding`, and `Content-Length` unless the response gave one),
/// then the `lines` it brings written, then `Date` unless given.
fn write_head(
    out: &mut Vec<u8>,
    status: StatusCode,
    (headers, lines): (&HeaderMap, Lines),
    framing: &Framing,
    known: Option<u64>,
    asked: Asked,
    stay: bool,
) {
    // An HTTP/1.0 client is answered in its version (as hyper did).
    out.extend_from_slice(if asked.http10 {
        b"HTTP/1.0 "
    } else {
        b"HTTP/1.1 "
    });
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut length_given = lines.length;
    for (name, value) in headers {
        if name == header::CONNECTION || name == header::TRANSFER_ENCODING {
            continue;
        }
        length_given |= name == header::CONTENT_LENGTH;
        field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    for run in lines.runs {
        out.extend_from_slice(run);
    }
    if !lines.date && !headers.contains_key(header::DATE) {
        date::with(|d| field(out, b"date", d));
    }
    let mut digits = [0u8; 20];
    match framing {
        Framing::Length(len) if !length_given => {
            field(out, b"content-length", decimal(*len, &mut digits))
        }
        Framing::Chunked => field(out, b"transfer-encoding", b"chunked"),
        // A HEAD's answer says the length a GET would have had, when it is known.
        Framing::None if asked.head && !length_given => {
            if let Some(len) = known.filter(|&l| l > 0) {
                field(out, b"content-length", decimal(len, &mut digits));
            }
        }
        _ => {}
    }
    if !stay {
        field(out, b"connection", b"close");
    } else if asked.http10 {
        field(out, b"connection", b"keep-alive");
    }
    out.extend_from_slice(b"\r\n");
}

/// `n` in decimal, written into `buf`.
fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// The client reset or broke the connection: nothing to answer.
fn is_gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// What a look at the buffer found.
#[allow(clippy::large_enum_variant)]
pub(super) enum Parsed {
    Request(Request<ReqBody>),
    /// Not whole yet.
    Partial,
    /// A whole head whose body (of up to [`IN_HAND`] bytes) is not: the request needs this
    /// many bytes in the buffer.
    Short(usize),
    /// Not for this side: hyper's to serve (or refuse).
    Other,
    /// A head whose body hyper streams (a larger or chunked one, or one expecting `100
    /// Continue`): hyper's to serve, and the connection's after it.
    Streamed,
}

#[cfg(test)]
thread_local! {
    /// Bytes handed to the parser on this thread: the parse work a test counts.
    static PARSED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Takes a whole request head this side serves out of `buf`, as the request.
pub(super) fn parse(buf: &mut BytesMut) -> Parsed {
    #[cfg(test)]
    PARSED.set(PARSED.get() + buf.len());
    // Uninitialised: filling 100 empty fields first would cost more than the parse.
    let mut fields = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut parsed,
        buf,
        &mut fields,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Other,
    };
    let (Some(method), Some(path), Some(minor)) = (parsed.method, parsed.path, parsed.version)
    else {
        return Parsed::Other;
    };
    if !path.starts_with('/') {
        return Parsed::Other;
    }
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Parsed::Other;
    };
    if method == Method::CONNECT {
        return Parsed::Other;
    }
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| {
        let start = s.as_ptr() as usize - base;
        start..start + s.len()
    };
    let path = at(path.as_bytes());
    let mut named: smallvec::SmallVec<[(HeaderName, std::ops::Range<usize>); 16]> =
        smallvec::SmallVec::new();
    let mut length = None;
    let mut streamed = false;
    for f in parsed.headers.iter() {
        let Ok(name) = HeaderName::from_bytes(f.name.as_bytes()) else {
            return Parsed::Other;
        };
        if name == header::CONTENT_LENGTH {
            // One field with a small length: the body is read with the head. Another field
            // or a larger body: hyper's (which streams it, or answers 400).
            match parse_length(f.value) {
                Some(n) if n <= IN_HAND as u64 && length.is_none() => length = Some(n as usize),
                _ => streamed = true,
            }
        }
        // An upgrade: hyper's for good. A body in chunks or an expectation: hyper's to stream.
        if name == header::UPGRADE {
            return Parsed::Other;
        }
        streamed |= name == header::TRANSFER_ENCODING || name == header::EXPECT;
        if !streamed {
            named.push((name, at(f.value)));
        }
    }
    if streamed {
        return Parsed::Streamed;
    }
    let length = length.unwrap_or(0);
    if buf.len() < len + length {
        return Parsed::Short(len + length);
    }
    let head = buf.split_to(len).freeze();
    let body = match length {
        0 => Bytes::new(),
        n => buf.split_to(n).freeze(),
    };
    match request_of(&head, path, &mut named, minor, method, &body) {
        Some(req) => Parsed::Request(req),
        None => {
            // hyper's to refuse, from the head on: put it back in front.
            let mut whole = BytesMut::with_capacity(head.len() + body.len() + buf.len());
            whole.extend_from_slice(&head);
            whole.extend_from_slice(&body);
            whole.extend_from_slice(buf);
            *buf = whole;
            Parsed::Other
        }
    }
}

/// The request of the parsed `head`: its target at `path`, its fields `named`; `None` when
/// the target is no URI or a value no header value (hyper then answers 400).
fn request_of(
    head: &Bytes,
    path: std::ops::Range<usize>,
    named: &mut smallvec::SmallVec<[(HeaderName, std::ops::Range<usize>); 16]>,
    minor: u8,
    method: Method,
    body: &Bytes,
) -> Option<Request<ReqBody>> {
    let uri = Uri::from_maybe_shared(head.slice(path)).ok()?;
    let mut headers = HeaderMap::with_capacity(named.len());
    // Drained, not moved: the list is 640 bytes.
    for (name, range) in named.drain(..) {
        headers.append(
            name,
            HeaderValue::from_maybe_shared(head.slice(range)).ok()?,
        );
    }
    let mut req = Request::new(Either::Right(InHand::new(body.clone())));
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.version_mut() = if minor == 0 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    *req.headers_mut() = headers;
    Some(req)
}

/// Runs `answer` unless the client closes its connection first (`None`; `answer` is dropped).
/// Bytes the client sends meanwhile (a pipelined request) stay in the socket.
async fn unless_left<F: Future>(stream: &TcpStream, mut answer: Pin<&mut F>) -> Option<F::Output> {
    let mut watching = true;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(out) = answer.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        if watching {
            let mut one = [MaybeUninit::<u8>::uninit(); 1];
            let mut peek = ReadBuf::uninit(&mut one);
            match stream.poll_peek(cx, &mut peek) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(None),
                Poll::Ready(Ok(_)) => watching = false,
                Poll::Pending => {}
            }
        }
        Poll::Pending
    })
    .await
}

/// Serves the rest of the connection with hyper's server: the bytes read so far first.
async fn hand_off(
    s: Served,
    conn: Arc<Conn>,
    lane: &Lane,
    drained: Pin<&mut impl Future>,
) -> Result<(), Error> {
    // The HTTP/2 connection preface (RFC 9113 §3.4), which went to hyper as no HTTP/1 head.
    let h2 = s.buf.starts_with(b"PRI * HTTP/2.0\r\n");
    let heard = Arc::new(AtomicU32::new(0));
    let mut hyper = lane.hyper.clone();
    hyper.http1().timer(lane.head_timer(&heard));
    let io = TokioIo::new(Rewind {
        read: s.buf.freeze(),
        stream: s.stream,
        heard,
        once: None,
        clock: s.clock,
    });
    let stalls = lane.stalls.clone();
    let open = Arc::new(Open::default());
    let watched = open.clone();
    let service = service_fn(move |req: Request<hyper::body::Incoming>| {
        // Made with the request's future, so that one dropped before its first poll (an
        // HTTP/2 stream reset at once) counts as abandoned too.
        let guard = AbandonGuard(Some(conn.clone()));
        let busy = Busy::new(&open);
        let version = req.version();
        let req = req.map(|b| Either::Left(Streamed::new(b)));
        let stalls = stalls.clone();
        async move {
            // An HTTP/2 client's streams use at most `max_upstream_per_client` upstream
            // connections at once: the others wait for a place, then get 503.
            let slot = match version == Version::HTTP_2 {
                true => match guard.conn().stream_slot().await {
                    Ok(slot) => slot,
                    Err(mut refused) => {
                        guard.disarm();
                        respond::whole(&mut refused);
                        return Ok(refused.map(|b| Counted {
                            body: stalls.guard(b, version, None),
                            _busy: busy,
                        }));
                    }
                },
                false => None,
            };
            let resp = answer(guard, req).await;
            Ok::<_, std::convert::Infallible>(resp.map(|b| Counted {
                body: stalls.guard(b, version, slot),
                _busy: busy,
            }))
        }
    });
    let mut served = pin!(hyper.serve_connection_with_upgrades(io, service));
    // An HTTP/2 connection without a stream for `client_idle` is closed with GOAWAY; an
    // HTTP/1 one's idle wait is its head timer's.
    let idle = async {
        match h2 {
            true => watched.idle(&lane.timers, lane.client_idle).await,
            false => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        done = served.as_mut() => done,
        _ = drained => {
            served.as_mut().graceful_shutdown();
            served.await
        }
        () = idle => {
            served.as_mut().graceful_shutdown();
            // h2 sends its last GOAWAY once the client answers a PING: one that never does
            // is dropped after another `client_idle`.
            let limit = Sleep::until(lane.timers.clone(), Timers::now() + lane.client_idle);
            crate::proxy::coarse::timeout(limit, served).await.unwrap_or(Ok(()))
        }
    }
}

/// The requests open on an HTTP/2 connection hyper serves, for closing it once it has had
/// none for `timeouts.client_idle`.
#[derive(Default)]
struct Open {
    /// Requests whose response body has not ended or been dropped (Relaxed: one thread).
    count: AtomicU32,
    /// Requests begun: an idle spell that saw one start is over.
    begun: AtomicU32,
    /// Told when `count` falls to zero.
    none: tokio::sync::Notify,
}

impl Open {
    /// Ready once the connection has had no open request for `idle`.
    async fn idle(&self, timers: &Arc<Timers>, idle: Duration) {
        loop {
            let mut none = pin!(self.none.notified());
            none.as_mut().enable();
            if self.count.load(Ordering::Relaxed) != 0 {
                none.await;
                continue;
            }
            let spell = self.begun.load(Ordering::Relaxed);
            Sleep::until(timers.clone(), Timers::now() + idle).await;
            if self.count.load(Ordering::Relaxed) == 0
                && self.begun.load(Ordering::Relaxed) == spell
            {
                return;
            }
        }
    }
}

/// One open request of an [`Open`], from its head to its response body's end.
struct Busy(Arc<Open>);

impl Busy {
    fn new(open: &Arc<Open>) -> Self {
        open.count.fetch_add(1, Ordering::Relaxed);
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

/// A response body that keeps its request counted open until hyper drops it.
struct Counted {
    body: Guarded,
    _busy: Busy,
}

impl http_body::Body for Counted {
    type Data = <Guarded as http_body::Body>::Data;
    type Error = <Guarded as http_body::Body>::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A request of hyper's server through the request path, and its answer with the map filled
/// in (hyper's server writes from it). `guard` is made with the request's future, so that one
/// dropped before its first poll (an HTTP/2 stream reset at once) counts as abandoned too.
async fn answer(guard: AbandonGuard, mut req: Request<ReqBody>) -> Response<Body> {
    let mut resp = handle(guard.conn(), &mut req).await;
    guard.disarm();
    respond::whole(&mut resp);
    resp
}

/// Serves one request whose body is streamed (a larger or chunked one, one still coming at
/// the head's deadline, one expecting `100 Continue`) with hyper's HTTP/1 server, and takes the
/// connection back when hyper is done with it and would keep it: the client's later requests
/// are this side's again, instead of hyper's for the rest of the connection. `None` when the
/// connection ended with hyper.
///
/// Back only when hyper is between requests with nothing left of this one: its body read to
/// the end (by the request path; one it left unread hyper drains or closes on), the response's
/// written to the end and out of hyper's buffer, and neither side asked to close. A second
/// request hyper read meanwhile (pipelined) leaves the connection with hyper, and so does a
/// second such request right after the first ([`serve`]).
async fn by_hyper_once(
    s: Served,
    conn: &Arc<Conn>,
    lane: &Lane,
    mut drained: Pin<&mut impl Future>,
) -> Result<Option<Served>, Error> {
    let Served {
        stream,
        buf,
        out,
        clock,
        kept: _,
    } = s;
    let once = Arc::new(Once::default());
    let heard = Arc::new(AtomicU32::new(0));
    let mut h1 = lane.h1.clone();
    h1.timer(lane.head_timer(&heard));
    let io = TokioIo::new(Rewind {
        read: buf.freeze(),
        stream,
        heard,
        once: Some(once.clone()),
        clock,
    });
    let service = {
        let (conn, once) = (conn.clone(), once.clone());
        service_fn(move |req: Request<hyper::body::Incoming>| {
            let guard = AbandonGuard(Some(conn.clone()));
            let once = once.clone();
            // Boxed: hyper polls the connection by `&mut` only with an `Unpin` future.
            Box::pin(async move {
                let first = once.requests.fetch_add(1, Ordering::Relaxed) == 0;
                let keep = req.version() == Version::HTTP_11 && !asks_close(req.headers());
                let req = req.map(|b| {
                    Either::Left(match first {
                        true => Streamed::watched(b, once.read.clone()),
                        false => Streamed::new(b),
                    })
                });
                let resp = answer(guard, req).await;
                if first && keep && !asks_close(resp.headers()) {
                    once.keep.store(true, Ordering::Relaxed);
                }
                let once = first.then_some(once);
                Ok::<_, std::convert::Infallible>(resp.map(|body| Answered { body, once }))
            })
        })
    };
    let mut served = h1.serve_connection(io, service);
    // Set when this side asked hyper to finish: because the exchange is over, or the worker drains.
    let (mut over, mut draining) = (false, false);
    let ended = std::future::poll_fn(|cx| loop {
        if let Poll::Ready(r) = served.poll_without_shutdown(cx) {
            return Poll::Ready(r);
        }
        if !over && !draining && once.over() {
            over = true;
        } else if !draining && drained.as_mut().poll(cx).is_ready() {
            draining = true;
        } else {
            return Poll::Pending;
        }
        // Between requests, this ends the connection at once, giving back its parts.
        Pin::new(&mut served).graceful_shutdown();
    })
    .await;
    let back = ended.is_ok() && over && !draining && once.over();
    let parts = served.into_parts();
    let Rewind {
        read,
        mut stream,
        clock,
        ..
    } = parts.io.into_inner();
    if !back {
        let _ = stream.shutdown().await;
        return ended.map(|()| None).map_err(Into::into);
    }
    // What hyper read of the next request, then what it had not yet taken of ours.
    let mut buf = BytesMut::with_capacity(READ.max(parts.read_buf.len() + read.len()));
    buf.extend_from_slice(&parts.read_buf);
    buf.extend_from_slice(&read);
    Ok(Some(Served {
        stream,
        buf,
        out,
        clock,
        kept: true,
    }))
}

/// How the one exchange of [`by_hyper_once`] went.
#[derive(Default)]
struct Once {
    /// Requests hyper has handed to the request path.
    requests: AtomicU32,
    /// The first one's body was read to its end.
    read: Arc<Ended>,
    /// Its response's body was written to its end.
    answered: AtomicBool,
    /// Neither it nor its response asked to close (and it is HTTP/1.1).
    keep: AtomicBool,
    /// hyper's last write did not take all it was given: bytes may wait in its buffer.
    blocked: AtomicBool,
}

impl Once {
    /// hyper is between requests, with nothing of the first left.
    fn over(&self) -> bool {
        self.requests.load(Ordering::Relaxed) == 1
            && self.read.is_set()
            && self.answered.load(Ordering::Relaxed)
            && self.keep.load(Ordering::Relaxed)
            && !self.blocked.load(Ordering::Relaxed)
    }
}

/// Whether a request's or a response's `Connection` says `close`.
fn asks_close(headers: &HeaderMap) -> bool {
    let connection = headers.get_all(header::CONNECTION);
    connection.iter().any(|v| has_token(v.as_bytes(), b"close"))
}

pin_project_lite::pin_project! {
    /// A response body that says when hyper has read it to its end.
    struct Answered {
        #[pin]
        body: Body,
        once: Option<Arc<Once>>,
    }
}

impl Answered {
    fn over(&self, over: bool) -> bool {
        if let (true, Some(once)) = (over, &self.once) {
            once.answered.store(true, Ordering::Relaxed);
        }
        over
    }
}

impl http_body::Body for Answered {
    type Data = <Body as http_body::Body>::Data;
    type Error = <Body as http_body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = self.as_mut().project().body.poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.over(true),
            Poll::Ready(Some(Ok(_))) => self.over(self.body.is_end_stream()),
            _ => false,
        };
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.over(self.body.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A connection with bytes already read from it in front.
struct Rewind {
    read: Bytes,
    stream: TcpStream,
    /// Counts the reads from `stream` that brought bytes, for hyper's head timer
    /// ([`HeadTimer`]).
    heard: Arc<AtomicU32>,
    /// Told whether each write took everything (see [`by_hyper_once`]).
    once: Option<Arc<Once>>,
    /// hyper's writes are bounded by `timeouts.send` too.
    clock: SendClock,
}

impl Rewind {
    fn wrote<T>(&self, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if let Some(once) = &self.once {
            once.blocked.store(polled.is_pending(), Ordering::Relaxed);
        }
        polled
    }
}

impl AsyncRead for Rewind {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.read.is_empty() {
            let n = this.read.len().min(buf.remaining());
            buf.put_slice(&this.read[..n]);
            this.read.advance(n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.heard.fetch_add(1, Ordering::Relaxed);
        }
        polled
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        let polled = this.clock.bound(cx, polled);
        this.wrote(polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        let polled = this.clock.bound(cx, polled);
        this.wrote(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// The `Date` field's value, formatted once a second per thread.
mod date {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};

    thread_local! {
        static NOW: RefCell<(u64, String)> = const { RefCell::new((0, String::new())) };
    }

    pub fn with(f: impl FnOnce(&[u8])) {
        let now = SystemTime::now();
        let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        NOW.with(|cell| {
            let mut cached = cell.borrow_mut();
            if cached.0 != secs || cached.1.is_empty() {
                *cached = (secs, httpdate::fmt_http_date(now));
            }
            f(cached.1.as_bytes());
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &[u8]) -> (Parsed, BytesMut) {
        let mut buf = BytesMut::from(text);
        (parse(&mut buf), buf)
    }

    #[test]
    fn a_plain_request_is_taken_out_of_the_buffer_and_what_follows_stays() {
        let (p, rest) = parsed(
            b"GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-Client: c1\r\nX-Client: c2\r\n\r\nGET /next",
        );
        let Parsed::Request(req) = p else {
            panic!("not served here")
        };
        assert_eq!(req.method(), Method::GET);
        assert_eq!(req.uri(), "/a?b=1");
        assert_eq!(req.version(), Version::HTTP_11);
        assert_eq!(req.headers()["host"], "x");
        let clients: Vec<_> = req.headers().get_all("x-client").iter().collect();
        assert_eq!(clients, ["c1", "c2"]);
        assert!(http_body::Body::is_end_stream(req.body()));
        assert_eq!(&rest[..], b"GET /next");
    }

    #[test]
    fn http10_head_and_a_zero_length_are_served_here() {
        let (p, _) = parsed(b"HEAD / HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
        let Parsed::Request(req) = p else {
            panic!("not served here")
        };
        assert_eq!(
            (req.method(), req.version()),
            (&Method::HEAD, Version::HTTP_10)
        );
    }

    #[test]
    fn a_small_body_that_came_with_its_head_is_taken_with_it() {
        let (p, rest) = parsed(b"POST /u HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloGET /next");
        let Parsed::Request(req) = p else {
            panic!("not served here")
        };
        let Either::Right(body) = req.body() else {
            panic!("a body in hand")
        };
        assert_eq!(body.bytes(), b"hello");
        assert_eq!(http_body::Body::size_hint(body).exact(), Some(5));
        assert_eq!(req.headers()["content-length"], "5");
        assert_eq!(&rest[..], b"GET /next");

        // Not all of it yet: the request needs the head's 39 bytes and 5 more.
        let text = b"POST /u HTTP/1.1\r\nContent-Length: 5\r\n\r\nhel";
        let (p, rest) = parsed(text);
        assert!(matches!(p, Parsed::Short(44)));
        assert_eq!(&rest[..], text, "nothing taken");
    }

    #[test]
    fn a_head_not_yet_whole_waits() {
        assert!(matches!(
            parsed(b"GET / HTTP/1.1\r\nHost: x\r\n").0,
            Parsed::Partial
        ));
    }

    #[test]
    fn streamed_bodies_upgrades_other_targets_and_garbage_go_to_hyper_with_every_byte() {
        let large = format!(
            "POST /u HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            IN_HAND + 1
        );
        // Bodies hyper streams (or, for the bad lengths, answers 400 and closes on): the
        // connection may come back after them.
        let streamed: &[&[u8]] = &[
            large.as_bytes(),
            b"POST /u HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
            b"POST /u HTTP/1.1\r\nContent-Length: -5\r\n\r\nhello",
            b"POST /u HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"PUT /u HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n",
        ];
        let others: &[&[u8]] = &[
            // A target no URI: hyper answers 400; the body goes back with the head.
            b"POST /a<b> HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
            b"GET /ws HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
            // An upgrade is hyper's for good, whatever comes before it.
            b"POST /ws HTTP/1.1\r\nTransfer-Encoding: chunked\r\nUpgrade: x\r\n\r\n0\r\n\r\n",
            b"CONNECT app:443 HTTP/1.1\r\n\r\n",
            b"OPTIONS * HTTP/1.1\r\n\r\n",
            b"GET http://app/x HTTP/1.1\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            // An HTTP/2 preface is known before it is whole.
            b"PRI * HTTP/2",
            b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
            b"\x16\x03\x01\x02\x00",
        ];
        let cases = streamed.iter().map(|t| (*t, true));
        for (text, is_streamed) in cases.chain(others.iter().map(|t| (*t, false))) {
            let (p, rest) = parsed(text);
            let got = match p {
                Parsed::Streamed => Some(true),
                Parsed::Other => Some(false),
                _ => None,
            };
            let text_lossy = String::from_utf8_lossy(text);
            assert_eq!(got, Some(is_streamed), "{text_lossy:?}");
            assert_eq!(&rest[..], text, "bytes kept for hyper");
        }
    }

    /// A request head sent one byte per write: the parser is handed each byte a bounded
    /// number of times (it was handed the whole buffer at every read: quadratic).
    #[tokio::test]
    async fn a_trickled_head_costs_parse_work_linear_in_its_size() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        client.set_nodelay(true).unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let head = format!(
            "GET /t HTTP/1.1\r\nHost: x\r\n{}\r\n",
            "X-Pad: 0123456789abcdef0123456789abcdef0123456789abcdef\r\n".repeat(60)
        );
        let n = head.len();
        let (_drain, draining) = watch::channel(false);
        let lane = Lane {
            hyper: auto::Builder::new(TokioExecutor::new()),
            h1: hyper::server::conn::http1::Builder::new(),
            max_head: 64 * 1024,
            header_read: Duration::from_secs(30),
            client_idle: Duration::from_secs(30),
            send: Duration::from_secs(30),
            timers: Arc::new(Timers::default()),
            stalls: Arc::new(Stalls::new(
                Duration::from_secs(30),
                Duration::from_secs(1),
                prometheus::IntCounter::new("t", "t").unwrap(),
            )),
            draining,
        };
        let mut s = Served {
            stream: server,
            buf: BytesMut::with_capacity(READ),
            out: Vec::new(),
            clock: SendClock::new(&lane),
            kept: false,
        };
        // On a thread of its own: each byte its own segment, most read on their own.
        let writer = std::thread::spawn(move || {
            use std::io::Write as _;
            for b in head.as_bytes() {
                client.write_all(&[*b]).unwrap();
                std::thread::sleep(Duration::from_micros(20));
            }
            client
        });
        let mut slot = None;
        let never = std::pin::pin!(std::future::pending::<()>());
        PARSED.set(0);
        let next = s.head(&lane, never, &mut slot).await.unwrap();
        assert!(
            matches!(next, Next::Request(_)),
            "a whole head is a request"
        );
        let work = PARSED.get();
        assert!(work <= 3 * n, "{work} bytes parsed for a head of {n}");
        drop(writer.join().unwrap());
    }

    #[test]
    fn the_end_of_a_head_is_searched_once() {
        let mut end = HeadEnd::default();
        let text = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut ends = Vec::new();
        for i in 1..=text.len() {
            ends.push(end.may_end(&text[..i]));
        }
        // The first look, then only when the empty line is whole (split across calls too).
        let at: Vec<usize> = (0..ends.len()).filter(|&i| ends[i]).collect();
        assert_eq!(at, [0, text.len() - 1]);
        let mut bare = HeadEnd::default();
        assert!(bare.may_end(b"G"));
        assert!(!bare.may_end(b"GET / HTTP/1.1\nHost: x\n"));
        assert!(bare.may_end(b"GET / HTTP/1.1\nHost: x\n\n"));
    }

    #[test]
    fn lengths_and_decimals() {
        let mut digits = [0u8; 20];
        assert_eq!(decimal(0, &mut digits), b"0");
        assert_eq!(decimal(164, &mut digits), b"164");
        assert_eq!(
            decimal(u64::MAX, &mut digits),
            u64::MAX.to_string().as_bytes()
        );
        assert_eq!(parse_length(b"164"), Some(164));
        assert_eq!(parse_length(b""), None);
        assert_eq!(parse_length(b"1 2"), None);
        assert_eq!(parse_length(b"99999999999999999999"), None);
    }

    fn head_of(
        status: StatusCode,
        headers: &[(&str, &str)],
        framing: Framing,
        asked: Asked,
        stay: bool,
    ) -> String {
        let mut map = HeaderMap::new();
        for (n, v) in headers {
            map.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        let mut out = Vec::new();
        write_head(
            &mut out,
            status,
            (&map, Lines::default()),
            &framing,
            Some(3),
            asked,
            stay,
        );
        String::from_utf8(out).unwrap()
    }

    const GET11: Asked = Asked {
        head: false,
        http10: false,
        keep_alive: true,
    };

    #[test]
    fn the_head_says_how_the_body_ends_and_what_becomes_of_the_connection() {
        let h = head_of(
            StatusCode::OK,
            &[("content-type", "text/plain")],
            Framing::Length(3),
            GET11,
            true,
        );
        assert!(
            h.starts_with("HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ndate: "),
            "{h}"
        );
        assert!(h.ends_with("GMT\r\ncontent-length: 3\r\n\r\n"), "{h}");
        // A length the response gave is not written twice; its own Connection is replaced.
        let h = head_of(
            StatusCode::OK,
            &[("content-length", "3"), ("connection", "x")],
            Framing::Length(3),
            GET11,
            false,
        );
        assert_eq!(h.matches("content-length").count(), 1, "{h}");
        assert!(
            !h.contains("connection: x") && h.ends_with("connection: close\r\n\r\n"),
            "{h}"
        );
        let h = head_of(StatusCode::OK, &[], Framing::Chunked, GET11, true);
        assert!(h.ends_with("transfer-encoding: chunked\r\n\r\n"), "{h}");
        // HTTP/1.0: its own version, keep-alive said when kept.
        let ten = Asked {
            http10: true,
            ..GET11
        };
        let h = head_of(
            StatusCode::TOO_MANY_REQUESTS,
            &[("date", "d")],
            Framing::Close,
            ten,
            true,
        );
        assert!(
            h.starts_with("HTTP/1.0 429 Too Many Requests\r\ndate: d\r\n"),
            "{h}"
        );
        assert!(h.ends_with("connection: keep-alive\r\n\r\n"), "{h}");
        // HEAD: the length a GET would have had.
        let head = Asked {
            head: true,
            ..GET11
        };
        let h = head_of(StatusCode::OK, &[], Framing::None, head, true);
        assert!(h.ends_with("content-length: 3\r\n\r\n"), "{h}");
    }
}
