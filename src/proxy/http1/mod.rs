//! HTTP/1.1, written by hand on both sides of the proxy: the client connections' server side
//! ([`server`]) and the upstream connections' client side ([`client`], its response heads in
//! [`head`]), with what they share ([`framing`]). hyper's server and client stay for everything
//! else.
//!
//! Serves (server): HTTP/1.0 and 1.1 requests in origin form, not `CONNECT`, without `Upgrade`;
//! a body of one `Content-Length` (read whole with its head up to [`IN_HAND`](crate::proxy::body::IN_HAND), else
//! streamed) or `Transfer-Encoding: chunked` alone (streamed; trailers read, not passed on), `Expect:
//! 100-continue` answered when the body is first read ([`request_body`]). Hands to hyper's
//! server for good, with every byte read so far: an upgrade, an HTTP/2 preface, a framing that
//! is how one request is read as two (conflicting or repeated lengths, other codings), a head
//! too large or malformed (hyper answers 400 or 431).
//! Reads responses (client): a body framed by `HEAD`, 1xx/204/304, chunks, one agreed
//! `Content-Length` or the close; conflicting lengths, a bad chunk or a head over 64 KiB are 502.
//! Reuses an upstream connection only after a response that allows it, read to its end with
//! nothing left over, whose request had no refused body and no `Connection: close`; at its
//! next use only if the upstream sent nothing meanwhile. Bytes that arrive after the next
//! request was written cannot be told from its answer: HTTP/1 keep-alive's own residual race.
//! Must never: parse a head from its start at each read, or write a byte of one exchange's
//! answer to another. Proven against hyper by the differential tests (`tests.rs`).

mod by_hyper;
pub(crate) mod client;
pub(crate) mod conn;
pub(crate) mod framing;
pub(crate) mod head;
pub(crate) mod request_body;
pub(crate) mod request_head;
pub(crate) mod server;
pub(crate) mod stalls;

#[cfg(test)]
mod tests;
