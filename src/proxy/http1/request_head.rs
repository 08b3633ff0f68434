//! A client's request head, parsed (httparse) where it lies in the connection's buffer into
//! the request the request path takes: which heads this side serves, how their bodies are
//! framed (RFC 9112 §6.3), and which go to hyper (an upgrade, `CONNECT`, a target that is not
//! a path, a framing that is how one request is read as two, a malformed head). Must never:
//! serve a head hyper would read otherwise, or copy a field's value out of the buffer.

use std::mem::MaybeUninit;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Uri, Version};
use http_body_util::Either;

use super::framing::{parse_length, Chunk, Framing};
use crate::proxy::body::{InHand, ReqBody, IN_HAND};

/// Header fields in a request head at most (hyper's limit too); more hands the connection to
/// hyper, which answers 431.
const MAX_HEADERS: usize = 100;

/// What a look at the buffer found.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Parsed {
    Request(Request<ReqBody>),
    /// Not whole yet.
    Partial,
    /// A whole head whose body (of up to [`IN_HAND`] bytes) is not: the request needs this
    /// many bytes in the buffer.
    Short(usize),
    /// Not for this side: hyper's to serve (or refuse).
    Other,
    /// A request whose body is streamed as it is read (a larger or chunked one, one expecting
    /// `100 Continue`, one still coming at the head's deadline), framed so; whether the client
    /// waits for `100 Continue`.
    Streamed(Request<ReqBody>, Framing, bool),
}

#[cfg(test)]
thread_local! {
    /// Bytes handed to the parser on this thread: the parse work a test counts.
    pub(crate) static PARSED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Takes a whole request head this side serves out of `buf`, as the request; with its body
/// when that is small and here (`stream_all`: never, the body is streamed).
pub(crate) fn parse(buf: &mut BytesMut, stream_all: bool) -> Parsed {
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
    let (mut length, mut lengths, mut codings, mut chunked) = (None, 0, 0, false);
    let mut expects = false;
    for f in parsed.headers.iter() {
        let Ok(name) = HeaderName::from_bytes(f.name.as_bytes()) else {
            return Parsed::Other;
        };
        if name == header::CONTENT_LENGTH {
            lengths += 1;
            length = parse_length(f.value);
            if length.is_none() {
                return Parsed::Other;
            }
        } else if name == header::TRANSFER_ENCODING {
            codings += 1;
            chunked = ows_trimmed(f.value).eq_ignore_ascii_case(b"chunked");
        } else if name == header::EXPECT {
            // The one expectation there is (RFC 9110 §10.1.1); an HTTP/1.0 client's is ignored.
            if !ows_trimmed(f.value).eq_ignore_ascii_case(b"100-continue") {
                return Parsed::Other;
            }
            expects = minor > 0;
        } else if name == header::UPGRADE {
            // An upgrade: hyper's for good.
            return Parsed::Other;
        }
        named.push((name, at(f.value)));
    }
    // One length, or one coding that is `chunked` alone in HTTP/1.1, without a length: the
    // framings this side reads. Any other mix is how one request is read as two (RFC 9112
    // §6.3): hyper's to refuse.
    if lengths > 1 || codings > 1 || (codings == 1 && (!chunked || lengths > 0 || minor == 0)) {
        return Parsed::Other;
    }
    let framing = match (chunked, length) {
        (true, _) => Framing::Chunked(Chunk::Size),
        (false, Some(n)) => Framing::Length(n),
        (false, None) => Framing::Length(0),
    };
    // No body at all is in hand, whatever the client expects.
    let in_hand = match framing {
        Framing::Length(0) => Some(0),
        Framing::Length(n) if n <= IN_HAND as u64 && !expects && !stream_all => Some(n as usize),
        _ => None,
    };
    let length = match in_hand {
        Some(n) if buf.len() < len + n => return Parsed::Short(len + n),
        Some(n) => n,
        None => 0,
    };
    let head = buf.split_to(len).freeze();
    let body = match length {
        0 => Bytes::new(),
        n => buf.split_to(n).freeze(),
    };
    match request_of(&head, path, &mut named, minor, method, &body) {
        Some(req) if in_hand.is_some() => Parsed::Request(req),
        Some(req) => Parsed::Streamed(req, framing, expects),
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

/// A field value without the spaces and tabs around it.
fn ows_trimmed(value: &[u8]) -> &[u8] {
    let ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = value.iter().position(|b| !ows(b)).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !ows(b)).map_or(start, |e| e + 1);
    &value[start..end]
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
