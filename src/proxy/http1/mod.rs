//! HTTP/1.1, written by hand on both sides of the proxy, each owning its connections from
//! start to end: the client connections' server side ([`server`], its request heads in
//! [`request_head`], streamed bodies in [`request_body`]) and the upstream connections' client
//! side ([`client`], its response heads in [`response_head`], streamed uploads in [`upload`]), with what
//! they share ([`framing`]). hyper serves HTTP/2 only (`proxy::http2`), from a connection's
//! first byte (`proxy::connection` tells which): no connection moves between the two.
//!
//! Serves (server) every HTTP/1.0 and 1.1 request but those [`request_head`] refuses (answered
//! here, the connection closed): bodies by one `Content-Length` or `chunked` alone, `Expect:
//! 100-continue` answered when the body is first read, upgrades to a listed protocol turned
//! into a tunnel by the `101` that switches. Reads responses (client): a body framed by `HEAD`,
//! 1xx/204/304, chunks, one agreed `Content-Length` or the close; conflicting lengths, a bad
//! chunk, a head over 64 KiB or a `101` not asked for are 502. Reuses an upstream connection
//! only after a response that allows it, read to its end with nothing left over, whose request
//! was sent whole and not refused and had no `Connection: close`; at its next use only if the
//! upstream sent nothing meanwhile (HTTP/1 keep-alive's residual race aside). Must never: parse
//! a head from its start at each read, or write a byte of one exchange's answer to another.
//! Proven against hyper by the differential tests (`tests.rs`).

pub(crate) mod client;
pub(crate) mod framing;
pub(crate) mod request_body;
pub(crate) mod request_head;
pub(crate) mod response_head;
pub(crate) mod server;
mod tunnel;
pub(crate) mod upload;

#[cfg(test)]
mod tests;
