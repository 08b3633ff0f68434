//! The sidecar's response, [`Reply`]: its body type, and its head ([`ResponseHead`]) holding
//! the status, the fields Spillway set, the fields it passes on unread (an upstream's lines as
//! the upstream wrote them, a kept 429's), and the connection's fate. The unread lines are why
//! a forwarded response costs no `HeaderMap`: our HTTP/1 side copies them into its write.
//! What Spillway's own answers are is `crate::respond`'s.
//!
//! Must never: hand out the map alone while lines are unread (a reader would miss them: every
//! method that reaches it maps them first, but [`ResponseHead::written`], which gives both for
//! the writer), or carry a field in a body.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName};
use http::{Extensions, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use super::http1::framing::has_token;
use super::http1::response_head::Passed;
use crate::limit::Permits;
use crate::respond::{Kept, PermitBody, Refused};

/// An upstream response's body: from the pooled client, or read from our own connection.
pub type UpstreamBody = Either<Incoming, super::http1::client::RawBody>;

/// Response bodies of the sidecar: the upstream's, streamed, or a short document of ours.
pub type Body = Either<PermitBody<UpstreamBody>, Full<Bytes>>;

/// In a response's extensions: the `upstream_body_idle` its rules set, in place of the
/// global one.
#[derive(Debug, Clone, Copy)]
pub struct BodyIdle(pub std::time::Duration);

/// A response of the sidecar's: its head and its body.
pub struct Reply {
    pub head: ResponseHead,
    pub body: Body,
}

/// A response's head: see the module's doc.
pub struct ResponseHead {
    status: StatusCode,
    /// Spillway's fields, and once [`ResponseHead::headers_mut`] mapped them, all of them.
    headers: HeaderMap,
    unread: Unread,
    close: bool,
    extensions: Extensions,
}

/// Fields passed on as lines, not (yet) in the map.
enum Unread {
    None,
    /// An upstream's, as it wrote them (the hop's left out).
    Upstream(Passed),
    /// A rule's kept 429's.
    Kept(Kept),
}

/// The fields a head passes on as lines, to be written after the map's.
pub enum Lines<'a> {
    /// An upstream's runs of lines; whether a `Date` and a `Content-Length` are among them.
    Upstream(&'a Passed),
    /// A kept 429's lines (no `Content-Length`, no `Date`), and the request's id, for an
    /// `x-request-id` line after them.
    Kept(&'a [u8], &'a crate::ids::IdText),
}

impl Reply {
    /// An upstream's response, its fields in its map or `passed` on unread; its body holds
    /// `permits` until it ends.
    pub fn upstream(
        resp: Response<UpstreamBody>,
        passed: Option<Passed>,
        permits: Permits,
    ) -> Self {
        let (parts, body) = resp.into_parts();
        // The map then holds none of the fields: written after them, mapped before them.
        debug_assert!(passed.is_none() || parts.headers.is_empty());
        Reply {
            head: ResponseHead {
                status: parts.status,
                headers: parts.headers,
                unread: passed.map_or(Unread::None, Unread::Upstream),
                close: false,
                extensions: parts.extensions,
            },
            body: Either::Left(PermitBody::new(body, permits)),
        }
    }

    /// A rule's kept 429, its fields unread, and so its document: our HTTP/1 side writes it
    /// from the head ([`ResponseHead::kept_document`]), [`Reply::into_http`] puts it in the body.
    pub fn kept(kept: Kept) -> Self {
        let body = Either::Right(Full::new(Bytes::new()));
        Reply {
            head: ResponseHead {
                status: StatusCode::TOO_MANY_REQUESTS,
                headers: HeaderMap::new(),
                unread: Unread::Kept(kept),
                close: false,
                extensions: Extensions::new(),
            },
            body,
        }
    }

    /// Spillway's refusal `refused` of the request `id`, the connection's fate in its head.
    pub fn refused(refused: &Refused, id: &crate::ids::IdText) -> Self {
        let mut reply = Reply::whole(refused.answer(id));
        reply.head.close = refused.close;
        reply
    }

    /// `resp` as it is: the map holds every field. A `Connection` naming `close` in it (what
    /// `crate::respond` writes for the embedded layer) is the connection's fate instead; the
    /// field is the hop's, never written on.
    pub fn whole(resp: Response<Body>) -> Self {
        let (mut parts, body) = resp.into_parts();
        let connection = parts.headers.get_all(http::header::CONNECTION);
        let close = connection.iter().any(|v| has_token(v.as_bytes(), b"close"));
        parts.headers.remove(http::header::CONNECTION);
        Reply {
            head: ResponseHead {
                status: parts.status,
                headers: parts.headers,
                unread: Unread::None,
                close,
                extensions: parts.extensions,
            },
            body,
        }
    }

    /// The response for a server that writes its own heads (hyper's): every field in the map.
    /// The connection's fate is not a field of an HTTP/2 response.
    pub fn into_http(mut self) -> Response<Body> {
        if let Unread::Kept(kept) = &self.head.unread {
            self.body = Either::Right(Full::new(kept.body()));
        }
        self.head.map_unread();
        let mut resp = Response::new(self.body);
        *resp.status_mut() = self.head.status;
        *resp.headers_mut() = self.head.headers;
        *resp.extensions_mut() = self.head.extensions;
        resp
    }
}

impl ResponseHead {
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The map, with every field in it: lines unread are put in it first (after the fields
    /// already there, as they would be written).
    pub fn headers_mut(&mut self) -> &mut HeaderMap {
        self.map_unread();
        &mut self.headers
    }

    /// The value of the first `name` field, wherever it is (a value not valid UTF-8 or
    /// visible ASCII is given as its bytes): the map's first, then the lines'.
    pub fn field(&self, name: &HeaderName) -> Option<&[u8]> {
        if let Some(v) = self.headers.get(name) {
            return Some(v.as_bytes());
        }
        let name = name.as_str();
        match &self.unread {
            Unread::None => None,
            Unread::Upstream(passed) => passed.runs().find_map(|lines| field_in(lines, name)),
            Unread::Kept(kept) if name == crate::ids::X_REQUEST_ID.as_str() => {
                Some(kept.id().as_bytes())
            }
            Unread::Kept(kept) => field_in(kept.fields(), name),
        }
    }

    /// The map as it is, and the fields still to be written as lines after it: for a server
    /// that writes its own heads from both (ours).
    pub fn written(&self) -> (&HeaderMap, Option<Lines<'_>>) {
        let lines = match &self.unread {
            Unread::None => None,
            Unread::Upstream(passed) => Some(Lines::Upstream(passed)),
            Unread::Kept(kept) => Some(Lines::Kept(kept.fields(), kept.id())),
        };
        (&self.headers, lines)
    }

    /// A kept 429's document, its end still to be written with the request's id (see
    /// [`Reply::kept`]): the open document and its whole length.
    pub fn kept_document(&self) -> Option<(&[u8], usize)> {
        match &self.unread {
            Unread::Kept(kept) => {
                let open = kept.open_body();
                Some((open, open.len() + crate::respond::id_member_len(kept.id())))
            }
            _ => None,
        }
    }

    /// The client connection closes after this response.
    pub fn close(&mut self) {
        self.close = true;
    }

    /// Whether the client connection closes after this response.
    pub fn closes(&self) -> bool {
        self.close
    }

    pub fn extensions(&self) -> &Extensions {
        &self.extensions
    }

    pub fn extensions_mut(&mut self) -> &mut Extensions {
        &mut self.extensions
    }

    /// The head was written: its fields are not kept while the body streams.
    pub fn sent(&mut self) {
        self.headers = HeaderMap::new();
        self.unread = Unread::None;
    }

    /// Puts the unread lines in the map; none are left unread.
    fn map_unread(&mut self) {
        match std::mem::replace(&mut self.unread, Unread::None) {
            Unread::None => {}
            Unread::Upstream(passed) => passed.into_map(&mut self.headers),
            Unread::Kept(kept) => {
                // A kept 429's fields first: the map holds only what was added to it since.
                let mut headers = kept.map();
                headers.extend(std::mem::take(&mut self.headers));
                self.headers = headers;
            }
        }
    }
}

/// The value of the first `name: value` line of `lines` named `name` (without case).
fn field_in<'a>(lines: &'a [u8], name: &str) -> Option<&'a [u8]> {
    lines.split(|&c| c == b'\n').find_map(|line| {
        let colon = line.iter().position(|&c| c == b':')?;
        line[..colon]
            .eq_ignore_ascii_case(name.as_bytes())
            .then(|| line[colon + 1..].trim_ascii())
    })
}
