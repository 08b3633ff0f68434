//! A client's request body still coming, written to the upstream connection as it is read:
//! by the exchange while it waits for the response head, then by the response body as it is
//! read ([`super::client::RawBody`]), in the task that reads the response (an HTTP/1 client
//! connection's, an HTTP/2 stream's). Framed upstream by its
//! one `Content-Length`, else in chunks (trailers are not passed on).
//!
//! Its progress is told to whoever times the exchange ([`Progress`]): the response timeout
//! starts when the upload is whole, and a stalled one is the client's or the app's.
//!
//! Must never: write a byte past what the body gave, or let an upload that stopped (the
//! client's body broke, the upstream stopped taking it) leave its connection reusable.

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Body as _;
use smallvec::SmallVec;
use tokio::net::TcpStream;

use crate::proxy::body::{Progress, Streamed};

/// How far an upload got, when it stopped before its end.
pub(crate) enum Stopped {
    /// The client's body broke (malformed, cut off): the client's fault, and what the upstream
    /// was sent is not a whole request.
    Client,
    /// The upstream connection took no more (it may have answered already).
    Upstream,
}

/// A request body being written upstream.
pub(crate) struct Upload {
    body: Streamed,
    chunked: bool,
    progress: Option<Arc<Progress>>,
    /// Written next, in order: a chunk's size line, its data, its end.
    pending: SmallVec<[Bytes; 3]>,
    /// The body gave its last frame (and the chunked end is queued).
    ended: bool,
}

impl Upload {
    /// `body`, framed in chunks unless the head gave its length (`chunked: false`).
    pub(crate) fn new(body: Streamed, chunked: bool, progress: Option<Arc<Progress>>) -> Self {
        Upload {
            body,
            chunked,
            progress,
            pending: SmallVec::new(),
            ended: false,
        }
    }

    /// Writes what the body has to `stream` until it waits for the body or the socket
    /// (`Pending`), or the body is sent whole (`Ready(Ok)`).
    pub(crate) fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        stream: &TcpStream,
    ) -> Poll<Result<(), Stopped>> {
        let polled = self.poll_inner(cx, stream);
        if let Some(p) = &self.progress {
            if polled.is_ready() {
                p.ended();
            }
        }
        polled
    }

    fn poll_inner(
        &mut self,
        cx: &mut Context<'_>,
        stream: &TcpStream,
    ) -> Poll<Result<(), Stopped>> {
        loop {
            while !self.pending.is_empty() {
                match stream.poll_write_ready(cx) {
                    Poll::Pending => {
                        if let Some(p) = &self.progress {
                            p.waits(false);
                        }
                        return Poll::Pending;
                    }
                    Poll::Ready(Err(_)) => return Poll::Ready(Err(Stopped::Upstream)),
                    Poll::Ready(Ok(())) => {}
                }
                let written = {
                    let slices: SmallVec<[IoSlice<'_>; 3]> =
                        self.pending.iter().map(|b| IoSlice::new(b)).collect();
                    stream.try_write_vectored(&slices)
                };
                match written {
                    Ok(0) => return Poll::Ready(Err(Stopped::Upstream)),
                    Ok(mut n) => {
                        if let Some(p) = &self.progress {
                            p.moved_on();
                        }
                        while n > 0 {
                            let first = &mut self.pending[0];
                            if n >= first.len() {
                                n -= first.len();
                                self.pending.remove(0);
                            } else {
                                bytes::Buf::advance(first, n);
                                n = 0;
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => return Poll::Ready(Err(Stopped::Upstream)),
                }
            }
            if self.ended {
                return Poll::Ready(Ok(()));
            }
            match std::pin::Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Pending => {
                    if let Some(p) = &self.progress {
                        p.waits(true);
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Some(Err(_))) => return Poll::Ready(Err(Stopped::Client)),
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(p) = &self.progress {
                        p.moved_on();
                    }
                    // Trailers are not passed on (an HTTP/1 upstream may not take them).
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if data.is_empty() {
                        continue;
                    }
                    if self.chunked {
                        self.pending
                            .push(Bytes::from(format!("{:x}\r\n", data.len()).into_bytes()));
                        self.pending.push(data);
                        self.pending.push(Bytes::from_static(b"\r\n"));
                    } else {
                        self.pending.push(data);
                    }
                }
                Poll::Ready(None) => {
                    self.ended = true;
                    if self.chunked {
                        self.pending.push(Bytes::from_static(b"0\r\n\r\n"));
                    }
                }
            }
        }
    }
}
