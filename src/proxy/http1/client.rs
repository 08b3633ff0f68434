//! The client side: one HTTP/1.1 exchange on an upstream connection of our own, done in the
//! client connection's task. The request head is written straight from the request (the hop's
//! fields as they pass, [`Added`]), the response head parsed (httparse) where it lies in the
//! connection's buffer, its end-to-end lines passed on as the upstream wrote them ([`Passed`])
//! or, for a server that writes its own heads, as a map; the body is read from the socket by
//! the body itself ([`RawBody`]).
//!
//! Takes every request to an HTTP/1 upstream: a body in hand goes with the head, one still
//! coming is written as it is read ([`Upload`]), an upgrade's `101` hands the connection to
//! the tunnel. Framing per RFC 9112 §6.3 ([`framing`]); interim responses skipped, a `101` not
//! asked for refused. Reuse as [`super`] states, checked by [`UpstreamConn::check`] without a
//! syscall (the reactor's recorded readiness). Must never: parse a head from its start at each
//! read, build a header map for an HTTP/1 client, or put back a connection with bytes pending.

use std::cell::Cell;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Either;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::framing::{decode, field, keeps_alive, one_length, Framing, HeadEnd, Step};
use super::response_head::*;
use super::upload::{Stopped, Upload};
use crate::hop::listed;
use crate::proxy::body::{emptied, ReqBody};
use crate::proxy::forwarded::Added;

thread_local! {
    /// Set when this thread's runtime woke from waiting for events ([`woke`]); cleared by the
    /// first exchange after that.
    static WOKE: Cell<bool> = const { Cell::new(false) };
}

/// The worker runtimes' `on_thread_unpark` hook: the worker had nothing left to run and waited
/// for events, so the first request it sends upstream after the wait goes at once, without
/// waiting for a batch ([`exchange`]). tokio calls it only after such a wait, not at its looks
/// at the reactor between two runs of ready tasks.
pub fn woke() {
    WOKE.set(true);
}

/// The room a read of a response gets: most responses (a head and a small body) fit the
/// first, which each upstream connection keeps between exchanges (nginx's
/// `proxy_buffer_size` is a page too); one that fills it is read in larger pieces (fewer
/// syscalls for a large body).
const ROOM: [usize; 3] = [4 * 1024, 16 * 1024, 64 * 1024];

/// The most a response's read buffer holds: what an exchange whose body waits pins.
pub(crate) const MAX_ROOM: usize = ROOM[ROOM.len() - 1];

/// An upstream connection between exchanges. Boxed once, when connected: it moves between the
/// worker's idle list, an exchange and the response body it reads, and a response moves by
/// value through the request path's futures.
pub struct UpstreamConn(Box<Connection>);

impl std::ops::Deref for UpstreamConn {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        &self.0
    }
}

impl std::ops::DerefMut for UpstreamConn {
    fn deref_mut(&mut self) -> &mut Connection {
        &mut self.0
    }
}

/// What [`UpstreamConn`] holds: an upstream connection's socket and buffers.
pub struct Connection {
    stream: TcpStream,
    /// Bytes read and not yet used (empty between exchanges).
    buf: BytesMut,
    /// The request head being written, kept for the next one.
    out: Vec<u8>,
    /// How many reads of this exchange filled their room: a larger response is read in larger
    /// pieces ([`ROOM`]).
    filled: u8,
    /// Its place under `limits.max_upstream_connections`, held while it is open.
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The exchange's request body, while it is still being written ([`Upload`]): kept with
    /// the connection it goes on, not in the response, which moves through the request path.
    upload: Option<Upload>,
    /// It answered without a body (a HEAD, a 204, a 304): an app may still send one, so it
    /// serves the client connection that asked only, never the worker's list.
    own_only: bool,
}

impl UpstreamConn {
    /// Whether it may serve only the client connection it last served (see `own_only`).
    pub fn own_only(&self) -> bool {
        self.0.own_only
    }
}

/// Where a connection goes when the body that holds it has been read to its end.
pub trait ConnKeeper: Send + Sync + 'static {
    /// `since`: when the exchange started (the clock's nanoseconds).
    fn put(&self, raw: UpstreamConn, since: u64);
    /// A connection was closed instead of put back, for `why`.
    fn discarded(&self, why: Unusable);
}

/// Why an upstream connection was closed instead of reused (a metric's label).
pub use crate::metrics::Unusable;

/// Why an exchange produced no response.
#[derive(Debug)]
pub enum Failed {
    /// The upstream connection failed or the upstream answered out of protocol (502).
    Upstream(io::Error),
    /// Writing the request head failed: nothing of the request was taken, it can go on
    /// another connection.
    Unsent(io::Error),
    /// The client's streamed body broke before the response came: the client's fault (400).
    ClientBody,
}

impl Connection {
    /// Writes what can go now of the upload on its way, if any; the upload is over once sent
    /// whole or refused by the upstream ([`Stopped::Upstream`]: what it answered is still
    /// read). [`Stopped::Client`]: the client's body broke off.
    #[inline]
    fn poll_upload(&mut self, cx: &mut Context<'_>) -> Result<(), Stopped> {
        let Some(up) = self.upload.as_mut() else {
            return Ok(());
        };
        match up.poll_send(cx, &self.stream) {
            Poll::Pending => Ok(()),
            Poll::Ready(Err(Stopped::Client)) => Err(Stopped::Client),
            Poll::Ready(sent) => {
                self.upload = None;
                sent
            }
        }
    }
}

impl UpstreamConn {
    /// `stream`, holding `permit` while it is open.
    pub fn new(stream: TcpStream, permit: Option<tokio::sync::OwnedSemaphorePermit>) -> Self {
        UpstreamConn(Box::new(Connection {
            stream,
            buf: BytesMut::new(),
            out: Vec::new(),
            filled: 0,
            _permit: permit,
            upload: None,
            own_only: false,
        }))
    }

    /// Whether the connection may carry another exchange: not when bytes are left over from
    /// the last one, nor when the upstream sent anything since (bytes no request asked for: a
    /// body after a `HEAD` answer's head, a second response, more than its framing said) or
    /// closed it. nginx's keepalive cache closes an idle connection that becomes readable, for
    /// the same reason: those bytes would be read as the next client's answer. Costs no
    /// syscall: it reads the readiness the reactor recorded. What arrives after that record,
    /// or after the next request was written, cannot be told from that request's answer (the
    /// residual race of HTTP/1 keep-alive).
    pub fn check(&mut self) -> Result<(), Unusable> {
        if !self.buf.is_empty() {
            return Err(Unusable::Leftover);
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let ready = std::pin::pin!(self.stream.ready(tokio::io::Interest::READABLE));
        match ready.poll(&mut cx) {
            Poll::Pending => Ok(()),
            Poll::Ready(Ok(r)) if r.is_read_closed() || r.is_error() => Err(Unusable::Closed),
            Poll::Ready(Ok(_)) => Err(Unusable::Readable),
            Poll::Ready(Err(_)) => Err(Unusable::Closed),
        }
    }

    /// Reads more into `buf`; `Ok(0)` at the end of the stream. Through tokio's `AsyncRead`,
    /// which forgets the socket's readiness after a short read: the next read then waits for
    /// the reactor instead of trying (and failing) a `recv` first. Reads get the room of
    /// [`ROOM`] for how many of the exchange's reads filled theirs.
    #[inline]
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < 1024 {
            let want = ROOM[(self.filled as usize).min(ROOM.len() - 1)];
            self.buf.reserve(want);
        }
        let room = self.buf.capacity() - self.buf.len();
        let this = &mut *self.0;
        let read = std::pin::pin!(tokio::io::AsyncReadExt::read_buf(
            &mut this.stream,
            &mut this.buf
        ));
        let polled = read.poll(cx);
        if let Poll::Ready(Ok(n)) = polled {
            self.filled = self.filled.saturating_add((n == room) as u8);
        }
        polled
    }

    /// The socket and what was read from it past a `101`, for the tunnel; the connection's
    /// place under the cap goes with it.
    pub(crate) fn into_tunnel(
        self,
    ) -> (
        TcpStream,
        BytesMut,
        Option<tokio::sync::OwnedSemaphorePermit>,
    ) {
        let c = *self.0;
        (c.stream, c.buf, c._permit)
    }
}

/// Sends `req` (as the client sent it) with the headers the hop changes, `added`, on `raw`
/// and reads the response head; the body reads the rest, and hands the connection to `home`
/// at its end when it may be reused. A body in hand goes in the head's write; one still coming
/// is taken out of `req` and written as it is read ([`Upload`]), while the response is
/// awaited and then while its body is read: an app may answer before the upload's end. An
/// upgrade `added` asks for is answered by a `101` whose body gives the connection to the
/// tunnel ([`RawBody::take_switched`]). After an answer without a body (to a HEAD; a 204 or
/// 304 that announces one) the connection serves only the client connection that asked
/// ([`UpstreamConn::own_only`]): an app may send the body anyway, and that must never reach another
/// client.
pub async fn exchange(
    mut raw: UpstreamConn,
    req: &mut Request<ReqBody>,
    added: &Added,
    home: Arc<dyn ConnKeeper>,
    now: u64,
) -> Result<Exchanged, Failed> {
    // An HTTP/2 client's stream is answered by hyper's server, which writes from the map.
    let mapped = req.version() == Version::HTTP_2;
    // An HTTP/1 client's request is written once the other connections that became ready with
    // it have had their turn: tokio runs a yielded task again after its next look at the
    // reactor, so the worker's requests of one turn go upstream together, the app wakes once
    // for them instead of once each, and their responses come back together (docs/benchmarks-history.md,
    // "Upstream writes in batches"). Not for an HTTP/2 client's streams (each is a task of
    // hyper's already), nor for the first request after the worker waited for events
    // ([`woke`]): a worker that waits is not busy, and the yield would only delay it.
    if !mapped && !WOKE.replace(false) {
        tokio::task::yield_now().await;
    }
    let streamed = matches!(req.body(), Either::Left(b) if !b.is_end_stream());
    // A body still coming goes by its one length, else in chunks.
    let chunked = streamed && one_length(req.headers()).is_none();
    let mut head = std::mem::take(&mut raw.out);
    head.clear();
    write_head(&mut head, req, added, chunked);
    // A body in hand (small: the server side reads it with its head) goes in the same write;
    // its `Content-Length` passed on with the client's fields.
    let body_sent = match req.body() {
        Either::Right(body) => body.bytes(),
        Either::Left(_) => &[],
    };
    let in_hand = !body_sent.is_empty();
    head.extend_from_slice(body_sent);
    let written = raw.stream.write_all(&head).await;
    raw.out = head;
    if let Err(e) = written {
        // Not a whole request: the upstream cannot have acted on it.
        return Err(Failed::Unsent(e));
    }
    if streamed {
        if let Either::Left(body) = std::mem::replace(req.body_mut(), emptied()) {
            raw.upload = Some(Upload::new(body, chunked, added.progress.clone()));
        }
    }
    // The upstream stopped taking the upload: the connection is not reused.
    let mut cut = false;
    let head_only = req.method() == Method::HEAD;
    let mut end = HeadEnd::default();
    loop {
        // Parsed where it is used, never held across an await: a `Head` is 440 bytes, and
        // each future it passed through would copy it. Parsed again only once its end may
        // have come.
        let taken = match !raw.buf.is_empty() && end.may_end(&raw.buf) {
            false => Ok(None),
            true => take_head(&mut raw.buf),
        };
        match taken {
            // Borrowed where it was parsed into, not moved out (a copy).
            Ok(Some(ref head)) => {
                if head.status == 101 {
                    return switched(head, raw, added.upgrade).map_err(Failed::Upstream);
                }
                // Interim responses (100 Continue, 103 Early Hints): the final one follows.
                if (100..200).contains(&head.status) {
                    end = HeadEnd::default();
                    continue;
                }
                // A connection asked to close is not reused, whatever the answer says; nor
                // one whose request body was refused (an app that answers 413 or 401 before
                // it reads the body may read it afterwards as it likes, and answer it); nor
                // one that was asked to switch and did not (its request, a GET, may carry a
                // body the app never reads); nor one answered while its upload was still being
                // sent (an app that answers before it reads may never read the body as one).
                let refused = head.status >= 400 && (in_hand || streamed);
                let early = raw.0.upload.is_some();
                let kept = !added.close && added.upgrade.is_none() && !refused && !early && !cut;
                let announced = || {
                    head.fields.iter().any(|f| {
                        f.named == Named::TransferEncoding
                            || (f.named == Named::ContentLength
                                && &head.bytes[f.value.0 as usize..f.value.1 as usize] != b"0")
                    })
                };
                if head_only || ((head.status == 204 || head.status == 304) && announced()) {
                    raw.0.own_only = true;
                }
                let home = kept.then_some(home);
                return respond(head, head_only, mapped, raw, home, now).map_err(Failed::Upstream);
            }
            Ok(None) => {
                std::future::poll_fn(|cx| {
                    match raw.poll_upload(cx) {
                        Err(Stopped::Client) => return Poll::Ready(Err(Failed::ClientBody)),
                        // It may have answered already: its answer is read.
                        Err(Stopped::Upstream) => cut = true,
                        Ok(()) => {}
                    }
                    poll_more(&mut raw, cx).map_err(Failed::Upstream)
                })
                .await?
            }
            Err(e) => return Err(Failed::Upstream(e)),
        }
    }
}

/// Writes the request line (origin form) and headers: the client's that go on, then those the
/// hop sets; with `chunked`, the body goes in chunks and no length of the client's goes on.
pub(super) fn write_head<B>(out: &mut Vec<u8>, req: &Request<B>, added: &Added, chunked: bool) {
    out.extend_from_slice(req.method().as_str().as_bytes());
    out.push(b' ');
    let target = req.uri().path_and_query().map_or("/", |p| p.as_str());
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let passing = req.headers().iter().filter(|(name, _)| {
        added.passes(name) && !(chunked && *name == http::header::CONTENT_LENGTH)
    });
    let passing = passing.map(|(name, value)| (name, value.as_bytes()));
    for (name, value) in passing.chain(added.hop_set()) {
        field(out, name.as_str().as_bytes(), value);
    }
    if let Some(id) = &added.request_id {
        field(out, b"x-request-id", id.as_bytes());
    }
    if chunked {
        field(out, b"transfer-encoding", b"chunked");
    }
    if let Some(protocol) = added.upgrade {
        field(out, b"upgrade", protocol.as_bytes());
        field(out, b"connection", b"upgrade");
    } else if added.close {
        field(out, b"connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
}

/// The `101` of `head` to an upgrade that `asked` for a protocol, its fields in its map (the
/// connection's own go, but `Upgrade`), its body holding `raw` for the tunnel. A switch
/// nobody asked for, or to another protocol, is an error: the connection would carry what no
/// rule sees.
fn switched(head: &Head, raw: UpstreamConn, asked: Option<&str>) -> io::Result<Exchanged> {
    let text = &head.bytes[..];
    let is_upgrade = |f: &Field| f.name(text).eq_ignore_ascii_case(b"upgrade");
    let mut answered = head.fields.iter().filter(|f| is_upgrade(f));
    let to = match (answered.next(), answered.next()) {
        (Some(f), None) => f.value(text).trim_ascii(),
        _ => b"",
    };
    if !asked.is_some_and(|p| to.eq_ignore_ascii_case(p.as_bytes())) {
        return Err(protocol(
            "upstream switched to a protocol that was not asked for",
        ));
    }
    let fields = head.fields.iter().map(|f| (f.named, f.value(text)));
    let listed = listed(Delimiters::of(fields).connection.iter().copied());
    let passes = |f: &Field| {
        is_upgrade(f)
            || !(f.named.hop_by_hop()
                || listed.iter().any(|t| t.eq_ignore_ascii_case(f.name(text))))
    };
    let headers = map_of(head, passes)?;
    // Done, with the connection still in it: the tunnel's (see [`RawBody::take_switched`]).
    let body = RawBody {
        raw: Some(raw),
        framing: Framing::Done,
        home: None,
        since: 0,
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    *resp.headers_mut() = headers;
    Ok((resp, None))
}

/// The fields of `head` that pass, in a map.
fn map_of(head: &Head, passes: impl Fn(&Field) -> bool) -> io::Result<HeaderMap> {
    let text = &head.bytes[..];
    // Sized once: grown from empty, the map reallocated twice for a common response head.
    let mut headers = HeaderMap::with_capacity(head.fields.len());
    for f in head.fields.iter().filter(|f| passes(f)) {
        let name = match f.named.header_name() {
            Some(name) => name,
            None => HeaderName::from_bytes(f.name(text))
                .map_err(|_| protocol("upstream sent an invalid header name"))?,
        };
        let value = HeaderValue::from_maybe_shared(
            head.bytes.slice(f.value.0 as usize..f.value.1 as usize),
        )
        .map_err(|_| protocol("upstream sent an invalid header value"))?;
        headers.append(name, value);
    }
    Ok(headers)
}

/// Reads more of a response head into `raw.buf`: an error for a head too large, or a
/// connection closed before one.
fn poll_more(raw: &mut UpstreamConn, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
    if raw.buf.len() >= MAX_HEAD {
        return Poll::Ready(Err(protocol("upstream response head too large")));
    }
    if ready!(raw.poll_fill(cx))? == 0 {
        return Poll::Ready(Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "upstream closed the connection before a response",
        )));
    }
    Poll::Ready(Ok(()))
}

/// The response of `head`, its body reading the rest from `raw`. The head's hop-by-hop fields
/// delimit the body and say whether the connection stays; the response goes on without them,
/// its other fields [`Passed`] as they are, or in its map when `mapped`.
fn respond(
    head: &Head,
    head_only: bool,
    mapped: bool,
    raw: UpstreamConn,
    home: Option<Arc<dyn ConnKeeper>>,
    now: u64,
) -> io::Result<Exchanged> {
    let status = StatusCode::from_u16(head.status)
        .map_err(|_| protocol("upstream sent an invalid status"))?;
    let text = &head.bytes[..];
    let fields = head.fields.iter().map(|f| (f.named, f.value(text)));
    let delimiters = Delimiters::of(fields);
    let (framing, mut reusable) = framing(status, head_only, head.version, &delimiters)?;
    reusable &= keeps_alive(head.version, &delimiters.connection);
    // A Content-Length beside a Transfer-Encoding must not be passed on (RFC 9112 §6.3): the
    // client is told the decoded length, or gets it chunked.
    let coded = !delimiters.codings.is_empty();
    let listed = listed(delimiters.connection.iter().copied());
    let passes = |f: &Field| {
        !(f.named.hop_by_hop()
            || (coded && f.named == Named::ContentLength)
            || listed.iter().any(|t| t.eq_ignore_ascii_case(f.name(text))))
    };
    let passed = if mapped {
        None
    } else {
        Passed::of(head, passes)
    };
    let headers = match passed {
        Some(_) => HeaderMap::new(),
        None => map_of(head, passes)?,
    };
    let mut body = RawBody {
        raw: Some(raw),
        framing,
        home: home.filter(|_| reusable),
        since: now,
    };
    if matches!(body.framing, Framing::Done | Framing::Length(0)) {
        body.finish();
    }
    // The version stays HTTP/1.1: it is the client connection's to choose, not the upstream's
    // (an HTTP/1.0 response would make hyper's server close the client connection).
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    Ok((resp, passed))
}

/// An upstream's response: its body read from the upstream connection by the client
/// connection's task, and its fields in its map or passed on unread.
pub type Exchanged = (Response<RawBody>, Option<Passed>);

/// A response body read from the upstream connection by the client connection's task.
pub struct RawBody {
    /// The connection, until the body's end.
    raw: Option<UpstreamConn>,
    framing: Framing,
    /// Where the connection goes at the body's end; `None` when it is not reused.
    home: Option<Arc<dyn ConnKeeper>>,
    since: u64,
}

impl RawBody {
    /// The upstream connection of a `101`, for the tunnel.
    pub fn take_switched(&mut self) -> Option<UpstreamConn> {
        // Any other body done has given its connection back or dropped it.
        match self.framing {
            Framing::Done => self.raw.take(),
            _ => None,
        }
    }

    /// The body is over: the connection goes home if it may be reused and nothing follows.
    fn finish(&mut self) {
        self.framing = Framing::Done;
        // An upload not sent whole leaves the upstream waiting for the rest.
        if self
            .raw
            .as_mut()
            .is_some_and(|raw| raw.upload.take().is_some())
        {
            self.home = None;
        }
        if let (Some(mut raw), Some(home)) = (self.raw.take(), self.home.take()) {
            // More than the response's framing said: never pooled. (Readiness is looked at
            // when the connection is taken again: the read that ended this body left none.)
            if raw.buf.is_empty() {
                raw.filled = 0;
                home.put(raw, self.since);
            } else {
                home.discarded(Unusable::Leftover);
            }
        }
    }

    fn poll_step(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Frame<Bytes>>>> {
        // Done: nothing to read (a `101`'s connection is the tunnel's).
        if self.framing == Framing::Done {
            return Poll::Ready(None);
        }
        // The request's body goes on as the response comes: an app may answer as it reads.
        if let Some(raw) = self.raw.as_mut() {
            match raw.poll_upload(cx) {
                Err(Stopped::Client) => {
                    return Poll::Ready(Some(Err(io::Error::other(
                        "the client's request body broke off",
                    ))))
                }
                // What the upstream answers is still read; the connection is not reused.
                Err(Stopped::Upstream) => self.home = None,
                Ok(()) => {}
            }
        }
        loop {
            let Some(raw) = self.raw.as_mut() else {
                return Poll::Ready(None);
            };
            match decode(&mut self.framing, &mut raw.buf, false) {
                Ok(Step::Data(data)) => {
                    if self.framing == Framing::Done {
                        self.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(Step::Trailers(trailers)) => {
                    self.finish();
                    return Poll::Ready(Some(Ok(Frame::trailers(*trailers))));
                }
                Ok(Step::End) => {
                    self.finish();
                    return Poll::Ready(None);
                }
                Ok(Step::More) => {}
                Err(e) => return Poll::Ready(Some(Err(protocol(&format!("upstream sent {e}"))))),
            }
            match ready!(raw.poll_fill(cx)) {
                Ok(0) if matches!(self.framing, Framing::Close) => {
                    self.finish();
                    return Poll::Ready(None);
                }
                // An error drops the connection in `poll_frame`, as for every other error.
                Ok(0) => {
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "upstream closed the connection before the body's end",
                    ))));
                }
                Ok(_) => {}
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
        }
    }
}

impl Body for RawBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        let polled = this.poll_step(cx);
        if let Poll::Ready(Some(Err(_))) = polled {
            // A broken body: the connection goes with it.
            this.raw = None;
            this.framing = Framing::Done;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.framing, Framing::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Done => SizeHint::with_exact(0),
            Framing::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests;
