//! The server side: one task per client connection (handed over by `connection` once its
//! first bytes were no HTTP/2 preface) reads a request head into the connection's buffer,
//! parses it (httparse) into the request its [`Handler`] takes, and writes the response head
//! and what of its body is there in one `write`.
//!
//! Serves what [`super`] says: a head [`request_head`](super::request_head) refuses is answered
//! here and the connection closed, a `101` to an upgrade makes the connection a [`tunnel`]. A small body (one `Content-Length` up to [`IN_HAND`](crate::proxy::body::IN_HAND)) is read
//! whole within the head's deadline and goes upstream in the head's `write`. A larger or
//! chunked body, or one still coming at the deadline, is streamed by [`RequestBody`], which
//! reads the socket while it lasts; the connection goes on once it is read to its end.
//! Each head must be whole within `timeouts.header_read`, parsed again only once its end may
//! have come ([`HeadEnd`]); each write must take a byte within `timeouts.send`. The connection
//! stays open unless the client says `close` or the response's head does (`closes`), a body was cut short (or left
//! unread past what is drained), or the worker drains. While a request without a streamed body is in flight the
//! socket is peeked only when readable: what it has (a pipelined request) is read into the
//! buffer for the next head, and an end of stream abandons the request. Must never:
//! allocate a buffer per request, or hold the request or response where a move through futures
//! would copy it.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::Poll;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, StatusCode, Version};
use http_body::Body as _;
use http_body_util::Either;
use smallvec::SmallVec;
use tokio::io::ReadBuf;
use tokio::net::TcpStream;

use super::client::UpstreamConn;
use super::framing::{field, keeps_alive, parse_length, Framing, HeadEnd};
use super::request_body::{read_shared, Inbound, RequestBody};
use super::request_head::*;
use crate::proxy::body::{ReqBody, Streamed};
use crate::proxy::deadlines::{Sleep, Timers};
use crate::proxy::protocol::*;
use crate::proxy::response::{self, Reply};

/// Body pieces up to this size are copied behind the head (or, in chunks, behind the chunks
/// before them) and written with it; a larger one is written on its own.
pub const COALESCE: usize = 16 * 1024;

/// Serves the client connection `s` (what of it was read is in its buffer), its requests
/// answered by `handler`, until it ends; `drained` is ready once the worker drains.
pub(in crate::proxy) async fn serve<H: Handler>(
    mut s: ClientConn,
    handler: Arc<H>,
    lane: &ConnSettings,
    mut drained: Pin<&mut impl Future>,
) -> Result<(), Error> {
    // Where each request is made: it is borrowed by the request path (each move down its
    // futures would copy it) and dropped before its response is written.
    let mut slot = None;
    loop {
        let mut asked;
        let streamed;
        let mut resp = {
            let req = match s.head(lane, drained.as_mut(), &mut slot).await? {
                HeadRead::Request(req, body) => {
                    streamed = body;
                    req
                }
                HeadRead::Closed => return Ok(()),
                HeadRead::Refused(why) => return s.refuse(&*handler, why).await,
            };
            asked = ResponseAsks::of(req);
            let guard = Abandon::new(&handler);
            let answer = pin!(handler.handle(req));
            // A body being read is the body's to read: the socket is not peeked meanwhile.
            let watch = streamed.is_none();
            let Some(resp) = unless_left(&s.stream, &mut s.buf, answer, watch).await else {
                // The client left: the request's future is gone, `guard` counts it.
                return Ok(());
            };
            guard.disarm();
            resp
        };
        slot = None;
        asked.keep_alive &= !lane.draining.has_changed().unwrap_or(true);
        let mut continued = Ok(());
        if let Some(body) = &streamed {
            // A `100 Continue` begun goes out whole before the response, one not begun never;
            // a client still waiting for it is told the connection closes.
            let (rest, never_asked) = body.response_begins();
            asked.keep_alive &= !never_asked;
            if !rest.is_empty() {
                continued = send_all(&s.stream, &mut s.clock, rest).await;
            }
        }
        let written = match continued {
            // A client that leaves while its response waits on the app is watched for, unless
            // its body may still be coming (the body's to read).
            Ok(()) => s.respond(&mut resp, asked, streamed.is_none()).await,
            Err(e) => Err(e),
        };
        let switching = resp.head.status() == StatusCode::SWITCHING_PROTOCOLS;
        if switching {
            if let (Ok(_), Some(upstream)) = (&written, switched(&mut resp)) {
                // The response (its concurrency slots) lives as long as the tunnel.
                let tunneled = super::tunnel::tunnel(s, upstream, lane).await;
                drop(resp);
                return tunneled.map_err(Into::into);
            }
        }
        let stay = match written {
            // A switch with no tunnel behind it: the client would speak the new protocol.
            Ok(stay) => stay && !switching,
            Err(e) => {
                // A body still being read must not outlive its connection.
                if let Some(body) = &streamed {
                    body.abandon();
                }
                return Err(e.into());
            }
        };
        drop(resp);
        let mut ended = true;
        if let Some(body) = streamed {
            // The body may still be going upstream (an answer before the upload's end): the
            // connection goes on once it is read to its end, and what followed it is the next
            // request's; the rest of one the app left unread is read and dropped (bounded).
            // One broken off, or still coming at `client_idle`, closes it.
            ended = match stay {
                true => {
                    let wait = Sleep::until(lane.timers.clone(), Timers::now() + lane.client_idle);
                    body.finish(&mut s.buf, wait).await
                }
                false => body.ended(),
            };
            if !ended {
                body.abandon();
            }
        }
        if !stay || !ended {
            s.close();
            return Ok(());
        }
        s.kept = true;
    }
}

/// What came in on a connection.
enum HeadRead<'a> {
    /// Made in the caller's slot (moved out through the futures, it would be copied at each),
    /// with its body's share of the connection when the body is streamed.
    Request(&'a mut Request<ReqBody>, Option<Arc<Inbound>>),
    /// Closed by the client, timed out in a head, or the worker drains.
    Closed,
    /// A head refused: answered so, then the connection is closed.
    Refused(Refusal),
}

/// Writes all of `bytes` to the client, each wait for it bounded by `clock`.
async fn send_all(stream: &TcpStream, clock: &mut SendClock, mut bytes: &[u8]) -> io::Result<()> {
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
            let polled = loop {
                match stream.poll_write_ready(cx) {
                    Poll::Ready(Ok(())) => match stream.try_write(bytes) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                        written => break Poll::Ready(written),
                    },
                    Poll::Ready(Err(e)) => break Poll::Ready(Err(e)),
                    Poll::Pending => break Poll::Pending,
                }
            };
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

impl ClientConn {
    /// Reads until the buffer holds a whole request head this side serves, and its small
    /// body: a new connection's within `timeouts.header_read` of the start; a kept one waits
    /// `timeouts.client_idle` for the next head's first byte, then `header_read` from there.
    async fn head<'a>(
        &mut self,
        lane: &ConnSettings,
        mut drained: Pin<&mut impl Future>,
        slot: &'a mut Option<Request<ReqBody>>,
    ) -> io::Result<HeadRead<'a>> {
        // Armed (a slot in the worker's timers) only when a read has to wait. Between two
        // requests of a kept connection the wait is `client_idle`'s; a head's own time starts
        // at its first byte.
        let mut between = self.kept && self.buf.is_empty();
        let wait = if between {
            lane.client_idle
        } else {
            lane.header_read
        };
        // Between requests the wait is closable: fired early to close the connection for a
        // new client when every place is taken.
        let mut deadline = match between {
            true => Sleep::closable(lane.timers.clone(), Timers::now() + wait),
            // A connection's first head is due `header_read` after its accept (what told its
            // protocol was read within that too).
            false if !self.kept => Sleep::until(lane.timers.clone(), self.opened + wait),
            false => Sleep::until(lane.timers.clone(), Timers::now() + wait),
        };
        // The head's first byte came after an idle wait: its own deadline is made only if a
        // read has to wait for the rest (most heads come whole in that first read).
        let mut begun = false;
        // Bytes the buffer must hold before the head is parsed again: a whole head's and its
        // small body's, once the body is known to be short of them.
        let mut need = 1;
        // A head trickled in is parsed again only once its end may have come: linear in its
        // size, not quadratic.
        let mut end = HeadEnd::default();
        // The deadline passed on a whole head whose small body is still coming: it is
        // streamed from here (a slow upload is served, not cut off).
        let mut late = false;
        loop {
            if late || (self.buf.len() >= need && (need > 1 || end.may_end(&self.buf))) {
                match parse(&mut self.buf, late) {
                    Parsed::Request(req) => return Ok(HeadRead::Request(slot.insert(req), None)),
                    Parsed::Refused(why) => return Ok(HeadRead::Refused(why)),
                    Parsed::Streamed(req, framing, expects) => {
                        return Ok(self.streamed(slot, req, framing, expects))
                    }
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
                if late {
                    return Ok(HeadRead::Closed);
                }
            }
            if need == 1 && self.buf.len() >= lane.max_head {
                return Ok(HeadRead::Refused(TOO_LARGE));
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
                n = read_some(&mut self.stream, &mut self.buf) => n,
                // A whole head whose small body is still coming is streamed; anything else ends.
                _ = &mut deadline => {
                    if need > 1 {
                        late = true;
                        continue;
                    }
                    return Ok(HeadRead::Closed);
                }
                _ = drained.as_mut(), if idle => return Ok(HeadRead::Closed),
            };
            match n {
                Ok(0) => return Ok(HeadRead::Closed),
                Ok(_) if between => {
                    between = false;
                    begun = true;
                }
                Ok(_) => {}
                Err(e) if is_gone(&e) => return Ok(HeadRead::Closed),
                Err(e) => return Err(e),
            }
        }
    }

    /// A request whose body is streamed: the body takes the connection's buffer (what was
    /// read after the head) and reads the rest as it is polled.
    fn streamed<'a>(
        &mut self,
        slot: &'a mut Option<Request<ReqBody>>,
        mut req: Request<ReqBody>,
        framing: Framing,
        expects: bool,
    ) -> HeadRead<'a> {
        let buf = std::mem::take(&mut self.buf);
        let inbound = Inbound::new(self.stream.clone(), buf, framing, expects);
        *req.body_mut() = Either::Left(Streamed::http1(RequestBody::new(inbound.clone())));
        HeadRead::Request(slot.insert(req), Some(inbound))
    }

    /// Answers a refused head with its status, counted by its reason, and ends the connection.
    async fn refuse(mut self, handler: &impl Handler, why: Refusal) -> Result<(), Error> {
        handler.refused(why.reason);
        // No head was read to take an id from.
        let mut resp = Reply::refused(&why, &crate::ids::RequestId::made().text());
        let asked = ResponseAsks {
            head: false,
            http10: false,
            keep_alive: false,
        };
        self.respond(&mut resp, asked, false).await?;
        self.close();
        Ok(())
    }

    /// Ends the connection: no more writes (the client reads to the end of what was sent).
    fn close(&self) {
        let _ = socket2::SockRef::from(&*self.stream).shutdown(std::net::Shutdown::Write);
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
    /// Writes `resp`; `Ok` with whether the connection stays. While the body waits on the
    /// upstream, at most `timeouts.upstream_body_idle` (then the response is cut short and the
    /// connection closes), and, when `watch`, not for a client that has left (an error).
    async fn respond(
        &mut self,
        resp: &mut Reply,
        asked: ResponseAsks,
        watch: bool,
    ) -> io::Result<bool> {
        let status = resp.head.status();
        let mut stay = asked.keep_alive && !resp.head.closes();
        let (headers, lines) = resp.head.written();
        let given = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| parse_length(v.as_bytes()));
        // A kept 429's document is the head's to give: its end is the request's id.
        let kept = resp.head.kept_document();
        let known = match kept {
            Some((_, len)) => Some(len as u64),
            None => resp.body.size_hint().exact(),
        };
        let framing = if asked.head
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            ResponseFraming::None
        } else if let Some(n) = given.or(known) {
            ResponseFraming::Length(n)
        } else if asked.http10 {
            stay = false;
            ResponseFraming::Close
        } else {
            ResponseFraming::Chunked
        };
        self.out.clear();
        let lines = Lines::of(lines);
        let id = lines.id;
        write_head(
            &mut self.out,
            status,
            (headers, lines),
            &framing,
            known,
            asked,
            stay,
        );
        let whole = match (kept, id, &framing) {
            (Some((open, _)), Some(id), ResponseFraming::Length(_)) => {
                self.out.extend_from_slice(open);
                crate::respond::put_id_member(&mut self.out, id);
                true
            }
            _ => false,
        };
        // Not kept while the body streams.
        resp.head.sent();
        if whole {
            send_all(&self.stream, &mut self.clock, &self.out).await?;
            return Ok(stay);
        }
        let body_idle = resp
            .head
            .extensions()
            .get::<response::BodyIdle>()
            .map_or(self.body_idle.0, |b| b.0);
        let mut body = Pin::new(&mut resp.body);
        if let ResponseFraming::None = framing {
            send_all(&self.stream, &mut self.clock, &self.out).await?;
            return Ok(stay);
        }
        let mut left = match framing {
            ResponseFraming::Length(n) => n,
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
                        let deadline =
                            Sleep::until(self.clock.timers.clone(), Timers::now() + body_idle);
                        let waited = unless_left(
                            &self.stream,
                            &mut self.buf,
                            crate::proxy::deadlines::timeout(
                                deadline,
                                std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)),
                            ),
                            watch,
                        );
                        match waited.await {
                            Some(Some(frame)) => frame,
                            // Silent past `upstream_body_idle`: the client learns it from
                            // the close, the upstream connection goes with the body.
                            Some(None) => {
                                self.body_idle.1.inc();
                                self.flush().await?;
                                return Ok(false);
                            }
                            None => return Err(io::ErrorKind::ConnectionAborted.into()),
                        }
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
            if let ResponseFraming::Length(_) = framing {
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
            if !matches!(framing, ResponseFraming::Chunked) || self.out.len() >= COALESCE {
                self.flush().await?;
            }
        }
        if let ResponseFraming::Chunked = framing {
            self.out.extend_from_slice(b"0\r\n\r\n");
        }
        self.flush().await?;
        // A body shorter than its length: the client learns it from the close.
        Ok(stay
            && matches!(
                framing,
                ResponseFraming::Chunked | ResponseFraming::Length(_)
            )
            && (left == 0 || left == u64::MAX))
    }

    /// Queues one piece of the body behind what is queued; a large piece is written at once.
    async fn put(&mut self, data: &Bytes, framing: &ResponseFraming) -> io::Result<()> {
        use std::io::Write as _;
        let chunked = matches!(framing, ResponseFraming::Chunked);
        if chunked {
            let _ = write!(self.out, "{:x}\r\n", data.len());
        }
        if data.len() <= COALESCE {
            self.out.extend_from_slice(data);
        } else {
            self.flush().await?;
            send_all(&self.stream, &mut self.clock, data).await?;
        }
        if chunked {
            self.out.extend_from_slice(b"\r\n");
        }
        Ok(())
    }

    /// Writes what is queued.
    async fn flush(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            send_all(&self.stream, &mut self.clock, &self.out).await?;
            self.out.clear();
        }
        Ok(())
    }
}

/// What the request said about its response.
#[derive(Clone, Copy)]
struct ResponseAsks {
    head: bool,
    http10: bool,
    /// The client keeps the connection (and the worker is not draining).
    keep_alive: bool,
}

impl ResponseAsks {
    fn of(req: &Request<ReqBody>) -> ResponseAsks {
        let connection: smallvec::SmallVec<[&[u8]; 2]> = req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        ResponseAsks {
            head: req.method() == Method::HEAD,
            http10: req.version() == Version::HTTP_10,
            keep_alive: keeps_alive(req.version(), &connection),
        }
    }
}

/// How a response's body is delimited.
enum ResponseFraming {
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
    /// A kept 429's request id, written as `x-request-id` after the runs.
    id: Option<&'a crate::ids::IdText>,
}

impl<'a> Lines<'a> {
    fn of(lines: Option<response::Lines<'a>>) -> Self {
        match lines {
            Some(response::Lines::Kept(fields, id)) => Lines {
                runs: smallvec::smallvec![fields],
                id: Some(id),
                ..Lines::default()
            },
            Some(response::Lines::Upstream(passed)) => Lines {
                runs: passed.runs().collect(),
                date: passed.date,
                length: passed.length,
                id: None,
            },
            None => Lines::default(),
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
    framing: &ResponseFraming,
    known: Option<u64>,
    asked: ResponseAsks,
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
    if let Some(id) = lines.id {
        out.extend_from_slice(b"x-request-id: ");
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !lines.date && !headers.contains_key(header::DATE) {
        date::with(|d| field(out, b"date", d));
    }
    let mut digits = [0u8; 20];
    match framing {
        ResponseFraming::Length(len) if !length_given => {
            field(out, b"content-length", decimal(*len, &mut digits))
        }
        ResponseFraming::Chunked => field(out, b"transfer-encoding", b"chunked"),
        // A HEAD's answer says the length a GET would have had, when it is known.
        ResponseFraming::None if asked.head && !length_given => {
            if let Some(len) = known.filter(|&l| l > 0) {
                field(out, b"content-length", decimal(len, &mut digits));
            }
        }
        _ => {}
    }
    if status == StatusCode::SWITCHING_PROTOCOLS {
        field(out, b"connection", b"upgrade");
    } else if !stay {
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

/// Reads what the socket has into `buf`, waiting until it has something; 0 at its end. The
/// socket's one reader waker is this task's (no streamed body reads it meanwhile). Through
/// tokio's `poll_read` while no body holds the socket, which forgets its readiness after a
/// short read: the next wait (or peek) goes to the reactor instead of trying a `recv` first.
async fn read_some(stream: &mut Arc<TcpStream>, buf: &mut BytesMut) -> io::Result<usize> {
    if let Some(stream) = Arc::get_mut(stream) {
        return tokio::io::AsyncReadExt::read_buf(stream, buf).await;
    }
    read_shared(stream, buf).await
}

/// The client reset or broke the connection: nothing to answer.
pub(in crate::proxy) fn is_gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// Pipelined bytes read into the connection's buffer while a response waits, at most (about:
/// one read may pass it): past it they stay in the socket, and its end is no longer watched.
const PIPELINED: usize = 16 * 1024;

/// Runs `answer` unless the client closes its connection first (`None`; `answer` is dropped),
/// which is watched for when `watching`. Bytes the client sends meanwhile (a pipelined
/// request) are read into `buf`, the next request's, so that an end behind them is seen.
async fn unless_left<F: Future>(
    stream: &TcpStream,
    buf: &mut BytesMut,
    answer: F,
    mut watching: bool,
) -> Option<F::Output> {
    let mut answer = pin!(answer);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(out) = answer.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        while watching {
            let mut one = [MaybeUninit::<u8>::uninit(); 1];
            let mut peek = ReadBuf::uninit(&mut one);
            match stream.poll_peek(cx, &mut peek) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(None),
                Poll::Ready(Ok(_)) if buf.len() < PIPELINED => {
                    // As the head's reads grow it (reclaimed in place once the heads are gone).
                    if buf.capacity() - buf.len() < 1024 {
                        buf.reserve(buf.len().max(READ));
                    }
                    match stream.try_read_buf(buf) {
                        Ok(0) => return Poll::Ready(None),
                        Err(e) if e.kind() != io::ErrorKind::WouldBlock => {
                            return Poll::Ready(None)
                        }
                        // Then peeked again: its end, more, or a registered wait.
                        _ => {}
                    }
                }
                Poll::Ready(Ok(_)) => watching = false,
                Poll::Pending => break,
            }
        }
        Poll::Pending
    })
    .await
}

/// The upstream connection a `101` switched, for the tunnel.
fn switched(resp: &mut Reply) -> Option<UpstreamConn> {
    match &mut resp.body {
        Either::Left(permit) => match permit.inner_mut() {
            Either::Right(raw) => raw.take_switched(),
            Either::Left(_) => None,
        },
        Either::Right(_) => None,
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
mod tests;
