//! An upstream's response head, parsed (httparse) where it lies in the connection's buffer:
//! where each field is ([`Field`], [`Named`] for the few this side acts on), how its body ends
//! (RFC 9112 §6.3, [`framing`]), and its end-to-end lines as the upstream wrote them
//! ([`Passed`]) for our server side to copy. Must never: parse a head from its start at each
//! read, build a header map for an HTTP/1 client, or let a faulty delimiter (Transfer-Encoding
//! in HTTP/1.0, conflicting lengths) through as a guess.

#[cfg(test)]
use std::cell::Cell;
use std::io;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{StatusCode, Version};
use smallvec::SmallVec;

use super::framing::{parse_length, Chunk, Framing};

/// Response heads (and chunked trailers) larger than this are refused (502).
pub const MAX_HEAD: usize = 64 * 1024;
/// Header fields in a response head at most.
pub(super) const MAX_HEADERS: usize = 100;

/// A response head as parsed: its text, and where each part lies in it.
pub(super) struct Head {
    pub(super) bytes: Bytes,
    pub(super) status: u16,
    pub(super) version: Version,
    pub(super) fields: SmallVec<[Field; 16]>,
    /// Every field's line ends in CRLF (RFC 9112 lets a recipient take a bare LF too).
    pub(super) crlf: bool,
}

/// Where a header field lies in its head: `[start, end)` of its name, of its value, and the
/// end of its line (after the line's end of line).
#[derive(Clone, Copy)]
pub(super) struct Field {
    pub(super) name: (u32, u32),
    pub(super) value: (u32, u32),
    pub(super) end: u32,
    pub(super) named: Named,
}

/// What a response field's name is to this side.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Named {
    Connection,
    TransferEncoding,
    ContentLength,
    Date,
    /// Another field of one connection ([`is_hop_by_hop`](crate::hop::is_hop_by_hop)).
    Hop,
    Other,
}

impl Named {
    /// By its length first: most names are none of these and cost one `match`.
    pub(super) fn of(name: &[u8]) -> Named {
        let is = |text: &[u8]| name.eq_ignore_ascii_case(text);
        match name.len() {
            4 if is(b"date") => Named::Date,
            10 if is(b"connection") => Named::Connection,
            14 if is(b"content-length") => Named::ContentLength,
            17 if is(b"transfer-encoding") => Named::TransferEncoding,
            _ if crate::hop::is_hop_by_hop(name) => Named::Hop,
            _ => Named::Other,
        }
    }

    /// The field's name, for the names recognised here that pass on (no parse needed).
    pub(super) fn header_name(self) -> Option<HeaderName> {
        match self {
            Named::Date => Some(http::header::DATE),
            Named::ContentLength => Some(http::header::CONTENT_LENGTH),
            _ => None,
        }
    }

    pub(super) fn hop_by_hop(self) -> bool {
        matches!(
            self,
            Named::Connection | Named::TransferEncoding | Named::Hop
        )
    }
}

impl Field {
    pub(super) fn name<'a>(&self, head: &'a [u8]) -> &'a [u8] {
        &head[self.name.0 as usize..self.name.1 as usize]
    }

    pub(super) fn value<'a>(&self, head: &'a [u8]) -> &'a [u8] {
        &head[self.value.0 as usize..self.value.1 as usize]
    }
}

pub(super) fn protocol(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

#[cfg(test)]
thread_local! {
    /// Bytes handed to the parser on this thread: the parse work a test counts.
    pub(super) static PARSED: Cell<usize> = const { Cell::new(0) };
}

/// The response head at the start of `buf`, taken out of it; `None` while it is partial.
pub(super) fn take_head(buf: &mut BytesMut) -> io::Result<Option<Head>> {
    #[cfg(test)]
    PARSED.set(PARSED.get() + buf.len());
    // Uninitialised: filling 100 empty fields first would cost more than the parse.
    let mut fields = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut fields,
    );
    let len = match parsed {
        Ok(httparse::Status::Complete(len)) if len > MAX_HEAD => {
            return Err(protocol("upstream response head too large"));
        }
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => {
            return Err(protocol(&format!(
                "upstream sent an invalid response head: {e}"
            )))
        }
    };
    let status = resp.code.unwrap_or(0);
    let version = if resp.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    // Offsets fit: a head is at most MAX_HEAD bytes.
    let base = buf.as_ptr() as usize;
    let at = |part: &[u8]| (part.as_ptr() as usize - base) as u32;
    let mut fields: SmallVec<[Field; 16]> = SmallVec::new();
    for f in resp.headers.iter() {
        let (name, value) = (at(f.name.as_bytes()), at(f.value));
        fields.push(Field {
            name: (name, name + f.name.len() as u32),
            value: (value, value + f.value.len() as u32),
            end: 0,
            named: Named::of(f.name.as_bytes()),
        });
    }
    // A line ends where the next begins; the last one before the empty line.
    let mut crlf = buf[..len].ends_with(b"\r\n\r\n");
    let mut end = len as u32 - 2;
    for f in fields.iter_mut().rev() {
        f.end = end;
        crlf &= buf[..end as usize].ends_with(b"\r\n");
        end = f.name.0;
    }
    Ok(Some(Head {
        bytes: buf.split_to(len).freeze(),
        status,
        version,
        fields,
        crlf,
    }))
}

/// Runs of kept lines a response head is copied in at most; a head whose hop-by-hop lines cut
/// it into more gets a map instead.
pub(super) const RUNS: usize = 3;

/// The end-to-end fields of an upstream response head as the upstream wrote them, for our HTTP/1
/// server side to copy into the client's head: a few runs of whole lines, with the hop's lines
/// (`Connection`, `Keep-Alive`, those `Connection` names, ...) left out. No `HeaderName` or
/// `HeaderValue` is made and no map is built, hashed, walked and dropped. Held unread by the
/// response's head (`proxy::response::ResponseHead`), which puts them in its map
/// ([`Passed::into_map`]) for a server that writes its own heads (hyper's) or a change to the
/// map (`headers: always`); an HTTP/2 client's exchange builds the map at once.
pub struct Passed {
    pub(super) head: Bytes,
    pub(super) runs: [(u32, u32); RUNS],
    pub(super) used: u8,
    /// A `Date` line is among them.
    pub date: bool,
    /// A `Content-Length` line is among them.
    pub length: bool,
}

impl Passed {
    /// The fields of `head` that `passes` lets through; `None` when the head has bare-LF line
    /// ends or more than [`RUNS`] runs of kept lines.
    pub(super) fn of(head: &Head, passes: impl Fn(&Field) -> bool) -> Option<Passed> {
        if !head.crlf {
            return None;
        }
        let mut p = Passed {
            head: head.bytes.clone(),
            runs: [(0, 0); RUNS],
            used: 0,
            date: false,
            length: false,
        };
        for f in head.fields.iter().filter(|f| passes(f)) {
            p.date |= f.named == Named::Date;
            p.length |= f.named == Named::ContentLength;
            match p.used {
                n if n > 0 && p.runs[n as usize - 1].1 == f.name.0 => {
                    p.runs[n as usize - 1].1 = f.end
                }
                n if (n as usize) < RUNS => {
                    p.runs[n as usize] = (f.name.0, f.end);
                    p.used += 1;
                }
                _ => return None,
            }
        }
        Some(p)
    }

    /// The runs of lines, each `name: value\r\n` lines as the upstream wrote them.
    pub fn runs(&self) -> impl Iterator<Item = &[u8]> {
        self.runs[..self.used as usize]
            .iter()
            .map(|&(a, b)| &self.head[a as usize..b as usize])
    }

    /// Appends the fields to `headers`, for a server that writes its own heads.
    pub fn into_map(self, headers: &mut HeaderMap) {
        let lines = self
            .runs()
            .map(|run| run.iter().filter(|&&c| c == b'\n').count());
        headers.reserve(lines.sum());
        for &(a, b) in &self.runs[..self.used as usize] {
            let mut at = a as usize;
            for line in self.head[a as usize..b as usize].split_inclusive(|&c| c == b'\n') {
                let start = at;
                at += line.len();
                // httparse took every line as `name: value`, so each has its colon.
                let Some(colon) = line.iter().position(|&c| c == b':') else {
                    continue;
                };
                let rest = &line[colon + 1..];
                let leading = rest.len() - rest.trim_ascii_start().len();
                let from = start + colon + 1 + leading;
                let name = HeaderName::from_bytes(&line[..colon]);
                let value = HeaderValue::from_maybe_shared(
                    self.head.slice(from..from + rest.trim_ascii().len()),
                );
                if let (Ok(name), Ok(value)) = (name, value) {
                    headers.append(name, value);
                }
            }
        }
    }
}

/// The values of the fields that delimit a message's body and say what becomes of its
/// connection.
#[derive(Default)]
pub(super) struct Delimiters<'a> {
    pub(super) connection: SmallVec<[&'a [u8]; 2]>,
    pub(super) codings: SmallVec<[&'a [u8]; 1]>,
    pub(super) lengths: SmallVec<[&'a [u8]; 1]>,
}

impl<'a> Delimiters<'a> {
    pub(super) fn of(fields: impl Iterator<Item = (Named, &'a [u8])>) -> Self {
        let mut d = Delimiters::default();
        for (named, value) in fields {
            match named {
                Named::Connection => d.connection.push(value),
                Named::TransferEncoding => d.codings.push(value),
                Named::ContentLength => d.lengths.push(value),
                _ => {}
            }
        }
        d
    }
}

/// How the body of a response with these `delimiters` ends (RFC 9112 §6.3), and whether the
/// connection may carry another exchange after it.
pub(super) fn framing(
    status: StatusCode,
    head_only: bool,
    version: Version,
    delimiters: &Delimiters,
) -> io::Result<(Framing, bool)> {
    if status == StatusCode::NO_CONTENT && !head_only {
        // No body, but one announced (RFC 9110 §8.6 forbids it): an app that writes one may
        // write it later, after the connection went to someone else.
        let announced = !delimiters.codings.is_empty()
            || delimiters.lengths.iter().any(|v| v.trim_ascii() != b"0");
        return Ok((Framing::Done, !announced));
    }
    if head_only || status.is_informational() || status == StatusCode::NOT_MODIFIED {
        return Ok((Framing::Done, true));
    }
    // Transfer-Encoding came with HTTP/1.1: in an HTTP/1.0 message the framing is faulty
    // (RFC 9112 §6.1), and guessing it is how one answer becomes two.
    if version == Version::HTTP_10 && !delimiters.codings.is_empty() {
        return Err(protocol(
            "upstream sent Transfer-Encoding in an HTTP/1.0 response",
        ));
    }
    if !delimiters.codings.is_empty() {
        // Only `chunked`, once: any other coding's bytes are not the content, and the field
        // that says so is the hop's, so the client would get them as the body (nginx refuses
        // them too).
        let mut codings = delimiters
            .codings
            .iter()
            .flat_map(|v| v.split(|&b| b == b','))
            .map(<[u8]>::trim_ascii)
            .filter(|c| !c.is_empty());
        let chunked = codings
            .next()
            .is_some_and(|c| c.eq_ignore_ascii_case(b"chunked"));
        if !chunked || codings.next().is_some() {
            return Err(protocol(
                "upstream sent a transfer coding other than chunked",
            ));
        }
        // With a Content-Length too, the coding wins and the connection is not reused.
        let alone = delimiters.lengths.is_empty();
        return Ok((Framing::Chunked(Chunk::Size), alone));
    }
    let mut length = None;
    for value in &delimiters.lengths {
        for item in value.split(|&b| b == b',') {
            let n = parse_length(item.trim_ascii())
                .ok_or_else(|| protocol("upstream sent an invalid Content-Length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(protocol("upstream sent conflicting Content-Lengths"));
            }
            length = Some(n);
        }
    }
    Ok(match length {
        Some(n) => (Framing::Length(n), true),
        None => (Framing::Close, false),
    })
}
