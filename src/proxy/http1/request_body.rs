//! A client's request body that our server side streams: read from the client connection by
//! whoever forwards the body, as they poll it, and decoded there ([`decode`], strict).
//!
//! Owns the body's share of the connection while it lasts: the bytes read past the head, the
//! `100 Continue` a client waiting for it is sent when the body is first polled, and the bytes
//! read past the body's end (the next request), which go back to the connection; the rest of a
//! body the app left unread, which the connection reads and drops (bounded). The server side
//! does not read the socket until the body is over or gone. Must never: read past what
//! the body's framing says without keeping it for the connection, write a `100 Continue` after
//! the response has begun, or let a connection go on after a body that broke off.

use std::error::Error as StdError;
use std::fmt;
use std::io;
use std::pin::Pin;
#[allow(clippy::disallowed_types)]
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use super::framing::{decode, Chunk, Framing, Step, READ};

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// The most of a body the app left unread that is read and dropped to keep its connection.
pub(super) const DRAIN: usize = 64 * 1024;

/// Why a client's request body could not be read: the client's fault, answered 400.
#[derive(Debug)]
pub struct ClientBodyError(pub(crate) String);

impl fmt::Display for ClientBodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the client's request body: {}", self.0)
    }
}

impl StdError for ClientBodyError {}

/// The body's state, shared by the body and the connection that made it.
pub(super) struct Inbound {
    stream: Arc<TcpStream>,
    // One body's, not global: taken by whoever polls the body, and by its connection only
    // before and after the response; never held across an await.
    #[allow(clippy::disallowed_types)]
    state: Mutex<State>,
    /// Told when the body ends, breaks off or is dropped.
    over: Notify,
}

struct State {
    /// Read from the connection and not yet given: the body's next bytes, then what follows.
    buf: BytesMut,
    framing: Framing,
    /// Bytes of the `100 Continue` still to write: all of it until the body is first polled;
    /// none once written or once the response has begun.
    to_continue: &'static [u8],
    /// The client was never told to send its body: it waits for a `100 Continue` that did not
    /// come before the response.
    never_asked: bool,
    /// The body broke off: a bad chunk, the client gone.
    broken: bool,
    /// Dropped before its end (the app answered without reading it all): the connection reads
    /// the rest and drops it, within bounds.
    dropped: bool,
    /// The body's task, waiting to write the `100 Continue`: woken when the response takes
    /// its place (the socket keeps one write waker, which the response's writes take).
    write_waker: Option<std::task::Waker>,
}

impl Inbound {
    /// The body of a request whose head was just taken from `buf`, which holds what was read
    /// after it; `expects` when the client waits for `100 Continue`.
    pub(super) fn new(
        stream: Arc<TcpStream>,
        buf: BytesMut,
        framing: Framing,
        expects: bool,
    ) -> Arc<Inbound> {
        // Nothing to read: nothing to wait for either.
        let (framing, expects) = match framing {
            Framing::Length(0) => (Framing::Done, false),
            framing => (framing, expects),
        };
        Arc::new(Inbound {
            stream,
            #[allow(clippy::disallowed_types)]
            state: Mutex::new(State {
                buf,
                framing,
                to_continue: if expects { CONTINUE } else { &[] },
                never_asked: false,
                broken: false,
                dropped: false,
                write_waker: None,
            }),
            over: Notify::new(),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding it leaves a body no one can trust: read as broken.
        self.state.lock().unwrap_or_else(|poisoned| {
            let mut state = poisoned.into_inner();
            state.broken = true;
            state
        })
    }

    /// Before the response's head: what is left of a `100 Continue` begun (rare: one write of
    /// 25 bytes nearly always takes all), to be written first, one not begun never; and whether
    /// the client still waits to be asked for its body (then the connection cannot go on).
    pub(super) fn response_begins(&self) -> (&'static [u8], bool) {
        let mut state = self.state();
        let rest = match state.to_continue.len() {
            n if n == CONTINUE.len() => {
                state.never_asked = state.framing != Framing::Done;
                &[]
            }
            _ => state.to_continue,
        };
        state.to_continue = &[];
        if let Some(waker) = state.write_waker.take() {
            waker.wake();
        }
        (rest, state.never_asked)
    }

    /// The connection is gone (an error, or closed at once): the body fails at its next read
    /// rather than hold its upstream exchange open.
    pub(super) fn abandon(&self) {
        self.state().broken = true;
        let _ = socket2::SockRef::from(&*self.stream).shutdown(std::net::Shutdown::Read);
        self.over.notify_waiters();
    }

    /// Waits (at most until `deadline`) for the body to be over; whether it was read to its
    /// end, in which case what followed it is given back in `buf`. A body dropped before its end
    /// is read to it here and dropped (at most [`DRAIN`] bytes more, as hyper's server and
    /// nginx's lingering close do), unless its client still waits to be asked for it.
    pub(super) async fn finish(
        &self,
        buf: &mut BytesMut,
        deadline: impl std::future::Future,
    ) -> bool {
        let mut deadline = std::pin::pin!(deadline);
        let (mut rest, mut framing) = loop {
            let mut over = std::pin::pin!(self.over.notified());
            over.as_mut().enable();
            {
                let mut state = self.state();
                if state.framing == Framing::Done && !state.broken {
                    *buf = std::mem::take(&mut state.buf);
                    return true;
                }
                if state.broken || (state.dropped && state.never_asked) {
                    return false;
                }
                if state.dropped {
                    break (std::mem::take(&mut state.buf), state.framing);
                }
            }
            tokio::select! {
                () = over => {}
                _ = deadline.as_mut() => return false,
            }
        };
        // The body is gone: nothing else reads the socket now. At most `DRAIN` more bytes
        // (chunk lines included) are read.
        if matches!(framing, Framing::Length(n) if n > DRAIN as u64) {
            return false;
        }
        let mut read = 0;
        loop {
            match decode(&mut framing, &mut rest, true) {
                Ok(Step::Data(_) | Step::Trailers(_)) => {}
                Ok(Step::End) => {
                    *buf = rest;
                    return true;
                }
                Ok(Step::More) if read > DRAIN => return false,
                Ok(Step::More) => {
                    rest.reserve(READ);
                    tokio::select! {
                        got = read_shared(&self.stream, &mut rest) => match got {
                            Ok(0) | Err(_) => return false,
                            Ok(n) => read += n,
                        },
                        _ = deadline.as_mut() => return false,
                    }
                }
                Err(_) => return false,
            }
        }
    }

    /// Whether the body was read to its end (what followed it then is in `buf`).
    pub(super) fn ended(&self) -> bool {
        let state = self.state();
        state.framing == Framing::Done && !state.broken
    }
}

/// Reads what a socket shared with a streamed body has into `buf`, waiting until it has
/// something; 0 at its end. Only its one reader at a time may call this: the socket keeps one
/// reader waker.
pub(super) async fn read_shared(stream: &TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    std::future::poll_fn(|cx| loop {
        match stream.try_read_buf(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::task::ready!(stream.poll_read_ready(cx))?
            }
            read => return Poll::Ready(read),
        }
    })
    .await
}

/// How a body came to be over.
enum BodyEnd {
    Ended,
    Broken,
    Dropped,
}

/// The request body: see the module's documentation.
pub struct RequestBody {
    inbound: Arc<Inbound>,
    /// Seen over: nothing more is read.
    done: bool,
}

impl fmt::Debug for RequestBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestBody")
            .field("done", &self.done)
            .finish()
    }
}

impl RequestBody {
    pub(super) fn new(inbound: Arc<Inbound>) -> Self {
        RequestBody {
            inbound,
            done: false,
        }
    }

    fn poll_step(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, String>>> {
        let inbound = &*self.inbound;
        let mut state = inbound.state();
        if state.broken {
            return Poll::Ready(Some(Err("broken off".into())));
        }
        while !state.to_continue.is_empty() {
            // Through `try_io`, not `try_write`: the response's writes keep that to themselves
            // (one caller, inlined on the path every response takes).
            let rest = state.to_continue;
            let wrote = inbound.stream.try_io(tokio::io::Interest::WRITABLE, || {
                socket2::SockRef::from(&*inbound.stream).send(rest)
            });
            match wrote {
                Ok(n) => state.to_continue = &state.to_continue[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    match inbound.stream.poll_write_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e.to_string()))),
                        Poll::Pending => {
                            state.write_waker = Some(cx.waker().clone());
                            return Poll::Pending;
                        }
                    }
                }
                Err(e) => return Poll::Ready(Some(Err(e.to_string()))),
            }
        }
        loop {
            let state = &mut *state;
            match decode(&mut state.framing, &mut state.buf, true) {
                Ok(Step::Data(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Ok(Step::Trailers(t)) => return Poll::Ready(Some(Ok(Frame::trailers(*t)))),
                Ok(Step::End) => return Poll::Ready(None),
                Ok(Step::More) => {}
                Err(e) => return Poll::Ready(Some(Err(format!("sent {e}")))),
            }
            // Room for what the body still says it has, up to 64 KiB a read: an upload comes in
            // few large reads, not many of the connection buffer's first size.
            let want = match state.framing {
                Framing::Length(n) | Framing::Chunked(Chunk::Data(n)) => n.min(64 * 1024) as usize,
                _ => 16 * 1024,
            };
            if state.buf.capacity() - state.buf.len() < want.max(1024) {
                state.buf.reserve(want.max(READ));
            }
            match inbound.stream.try_read_buf(&mut state.buf) {
                Ok(0) => {
                    return Poll::Ready(Some(Err(
                        "the client closed the connection before the body's end".into(),
                    )))
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    match inbound.stream.poll_read_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e.to_string()))),
                        Poll::Pending => return Poll::Pending,
                    }
                }
                Err(e) => return Poll::Ready(Some(Err(e.to_string()))),
            }
        }
    }

    /// The body is over: ended, broken off, or dropped before its end.
    fn over(&mut self, how: BodyEnd) {
        if !self.done {
            self.done = true;
            match how {
                BodyEnd::Ended => {}
                BodyEnd::Broken => self.inbound.state().broken = true,
                BodyEnd::Dropped => self.inbound.state().dropped = true,
            }
            self.inbound.over.notify_waiters();
        }
    }
}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let polled = self.poll_step(cx);
        match &polled {
            Poll::Ready(None) => self.over(BodyEnd::Ended),
            Poll::Ready(Some(Err(_))) => self.over(BodyEnd::Broken),
            Poll::Ready(Some(Ok(_))) if self.inbound.ended() => self.over(BodyEnd::Ended),
            _ => {}
        }
        polled.map(|p| p.map(|r| r.map_err(ClientBodyError)))
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inbound.ended()
    }

    fn size_hint(&self) -> SizeHint {
        match self.inbound.state().framing {
            Framing::Done => SizeHint::with_exact(0),
            Framing::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        // Dropped before its end: the rest is the connection's to read and drop.
        let how = match self.inbound.ended() {
            true => BodyEnd::Ended,
            false => BodyEnd::Dropped,
        };
        self.over(how);
    }
}
