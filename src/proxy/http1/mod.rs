//! HTTP/1.1, written by hand on both sides of the proxy: the client connections' server side
//! ([`server`]) and the upstream connections' client side ([`client`], its response heads in
//! [`head`]), with what they share ([`framing`]). hyper's server and client stay for everything
//! else.
//!
//! Accepts (server): HTTP/1.0 and 1.1 request heads in origin form without `Transfer-Encoding`,
//! `Expect` or `Upgrade`, not `CONNECT`, with no body or one `Content-Length` of at most
//! [`server::IN_HAND`] read whole. Hands to hyper's server, with every byte read so far: a
//! streamed body (for that request, then the connection comes back), an upgrade, an HTTP/2
//! preface, a head too large or malformed (for the rest of the connection; hyper answers 400
//! or 431). Refuses nothing itself: what it does not serve, hyper does.
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
pub(crate) mod server;
pub(crate) mod stalls;

#[cfg(test)]
mod tests;
