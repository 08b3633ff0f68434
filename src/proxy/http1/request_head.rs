//! A client's request head, parsed (httparse) where it lies in the connection's buffer into
//! the request the request path takes, its body framed (RFC 9112 §6.3); or refused, with the
//! status that says why (a malformed head, a framing that is how one request is read as two,
//! a coding or expectation not served, `CONNECT`; the HTTP/2 preface is a malformed head here:
//! `connection` told the protocol before). Must never: serve a
//! head hyper would read otherwise, or copy a field's value out of the buffer.

use std::mem::MaybeUninit;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Uri, Version};
use http_body_util::Either;

use super::framing::{parse_length, Chunk, Framing};
use crate::proxy::body::{InHand, ReqBody, IN_HAND};

/// Header fields in a request head at most (hyper's limit too); more is answered 431.
const MAX_HEADERS: usize = 100;

use crate::respond::Reason;
/// Why a head is refused: its status, reason and detail (the connection closes after the
/// answer: what follows a head this side cannot read cannot be told apart).
pub(crate) use crate::respond::Refused as Refusal;

pub(crate) const MALFORMED: Refusal = Refusal::closing(
    StatusCode::BAD_REQUEST,
    Reason::Malformed,
    "the request head is malformed",
);
const TOO_MANY: Refusal = Refusal::closing(
    StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
    Reason::HeaderTooLarge,
    "too many header fields",
);
/// The head outgrew what may be read of one (`limits.max_header_bytes`, with room).
pub(crate) const TOO_LARGE: Refusal = Refusal::closing(
    StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
    Reason::HeaderTooLarge,
    "the request head is too large",
);
const FRAMING: Refusal = Refusal::closing(
    StatusCode::BAD_REQUEST,
    Reason::Framing,
    "the request's length and codings conflict or are malformed",
);
const CODING: Refusal = Refusal::closing(
    StatusCode::NOT_IMPLEMENTED,
    Reason::Framing,
    "a transfer coding other than chunked alone is not served",
);
const EXPECT: Refusal = Refusal::closing(
    StatusCode::EXPECTATION_FAILED,
    Reason::Malformed,
    "only 100-continue is served",
);
const CONNECT: Refusal = Refusal::closing(
    StatusCode::NOT_IMPLEMENTED,
    Reason::Method,
    "CONNECT is not served by this proxy",
);

/// What a look at the buffer found.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Parsed {
    Request(Request<ReqBody>),
    /// Not whole yet.
    Partial,
    /// A whole head whose body (of up to [`IN_HAND`] bytes) is not: the request needs this
    /// many bytes in the buffer.
    Short(usize),
    /// Answered with this refusal, and the connection closed.
    Refused(Refusal),
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
        Err(httparse::Error::TooManyHeaders) => return Parsed::Refused(TOO_MANY),
        Err(_) => return Parsed::Refused(MALFORMED),
    };
    let (Some(method), Some(path), Some(minor)) = (parsed.method, parsed.path, parsed.version)
    else {
        return Parsed::Refused(MALFORMED);
    };
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Parsed::Refused(MALFORMED);
    };
    // A tunnel to a host of the client's choosing, framed unlike any other request: refused
    // from its head, and its connection closed.
    if method == Method::CONNECT {
        return Parsed::Refused(CONNECT);
    }
    // Origin form; absolute form (RFC 9112 §3.2.2: its authority is the request's); `*` for
    // OPTIONS. The authority form is CONNECT's alone.
    let form_ok =
        path.starts_with('/') || (path == "*" && method == Method::OPTIONS) || path.contains("://");
    if !form_ok {
        return Parsed::Refused(MALFORMED);
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
            return Parsed::Refused(MALFORMED);
        };
        if name == header::CONTENT_LENGTH {
            lengths += 1;
            length = parse_length(f.value);
            if length.is_none() {
                return Parsed::Refused(FRAMING);
            }
        } else if name == header::TRANSFER_ENCODING {
            codings += 1;
            chunked = ows_trimmed(f.value).eq_ignore_ascii_case(b"chunked");
        } else if name == header::EXPECT {
            // The one expectation there is (RFC 9110 §10.1.1); an HTTP/1.0 client's is ignored.
            if !ows_trimmed(f.value).eq_ignore_ascii_case(b"100-continue") {
                return Parsed::Refused(EXPECT);
            }
            expects = minor > 0;
        }
        named.push((name, at(f.value)));
    }
    // One length, or one coding that is `chunked` alone in HTTP/1.1, without a length: the
    // framings this side reads. Any other mix is how one request is read as two (RFC 9112
    // §6.3): refused, and the connection closed; a coding other than `chunked` is not served.
    if lengths > 1 || codings > 1 || (codings == 1 && (lengths > 0 || minor == 0)) {
        return Parsed::Refused(FRAMING);
    }
    if codings == 1 && !chunked {
        return Parsed::Refused(CODING);
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
        // The target's authority is the request's (RFC 9112 §3.2.2): a `Host` that says
        // otherwise would have the rules and the app each believe another host.
        Some(req) if !host_agrees(&req) => Parsed::Refused(MALFORMED),
        Some(req) if in_hand.is_some() => Parsed::Request(req),
        Some(req) => Parsed::Streamed(req, framing, expects),
        None => Parsed::Refused(MALFORMED),
    }
}

/// An absolute-form target's authority and every `Host` name the same host.
fn host_agrees(req: &Request<ReqBody>) -> bool {
    let Some(authority) = req.uri().authority() else {
        return true;
    };
    let host = authority.as_str().as_bytes();
    req.headers()
        .get_all(header::HOST)
        .iter()
        .all(|h| h.as_bytes().eq_ignore_ascii_case(host))
}

/// A field value without the spaces and tabs around it.
fn ows_trimmed(value: &[u8]) -> &[u8] {
    let ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = value.iter().position(|b| !ows(b)).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !ows(b)).map_or(start, |e| e + 1);
    &value[start..end]
}

/// The request of the parsed `head`: its target at `path`, its fields `named`; `None` when
/// the target is no URI or a value no header value (answered 400).
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
