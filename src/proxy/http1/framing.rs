//! What the server side and the client side share: the end of a head, lengths, whether a
//! message keeps its connection, how a header line is written, and how a body is cut out of
//! the bytes read ([`decode`]: a length, chunks and their trailers, or the close). Must never:
//! read a byte past a body's end, or take a chunk line it cannot read as a guess.

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::Version;

/// A connection buffer's first size, and its least room for a read: most request heads are a
/// few hundred bytes (nginx starts with 1 KiB). A larger head doubles it as it comes.
pub(crate) const READ: usize = 2 * 1024;
/// A chunk-size line longer than this is refused.
const MAX_CHUNK_LINE: usize = 1024;
/// Trailer sections larger than this are refused.
pub(crate) const MAX_TRAILERS: usize = 64 * 1024;
/// Trailer fields at most.
const MAX_TRAILER_FIELDS: usize = 100;

/// How a body ends, and how far its reading has come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Framing {
    /// Read to its end (or none at all).
    Done,
    /// This many bytes more.
    Length(u64),
    Chunked(Chunk),
    /// At the close of the connection (a response's only).
    Close,
}

/// Where a chunked body's decoding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Chunk {
    /// Before a chunk-size line.
    Size,
    /// Inside a chunk's data, this many bytes left.
    Data(u64),
    /// After a chunk's data: its CRLF.
    DataEnd,
    /// After the last chunk: trailer fields up to an empty line, searched for up to here.
    Trailers(usize),
}

/// What [`decode`] found in the buffer.
#[derive(Debug)]
pub(crate) enum Step {
    /// A piece of the body's data.
    Data(Bytes),
    /// Its trailers, the last piece (boxed: rare, and a step is returned for every piece).
    Trailers(Box<HeaderMap>),
    /// The body is over (`framing` is `Done`).
    End,
    /// More bytes are needed.
    More,
}

/// Takes the next piece of a body framed by `framing` out of `buf`, leaving what follows the
/// body in it. A chunk-size line is read strictly (hex digits, then extensions only); `strict`
/// (a client's request): each chunk line ends in CRLF; otherwise (an upstream's response) a
/// bare LF ends a chunk-size line too, as RFC 9112 §2.2 allows a recipient. An error says what was wrong; the body cannot go on after one.
// Always inlined: on the response path, where most bodies are one piece of known length, a
// call here cost more than the step itself.
#[inline(always)]
pub(crate) fn decode(
    framing: &mut Framing,
    buf: &mut BytesMut,
    strict: bool,
) -> Result<Step, &'static str> {
    loop {
        match *framing {
            Framing::Done => return Ok(Step::End),
            Framing::Length(left) | Framing::Chunked(Chunk::Data(left)) if !buf.is_empty() => {
                let take = (buf.len() as u64).min(left);
                let data = buf.split_to(take as usize).freeze();
                let left = left - take;
                *framing = match *framing {
                    Framing::Length(_) if left == 0 => Framing::Done,
                    Framing::Length(_) => Framing::Length(left),
                    _ if left == 0 => Framing::Chunked(Chunk::DataEnd),
                    _ => Framing::Chunked(Chunk::Data(left)),
                };
                return Ok(Step::Data(data));
            }
            Framing::Length(0) => {
                *framing = Framing::Done;
                return Ok(Step::End);
            }
            Framing::Close if !buf.is_empty() => {
                return Ok(Step::Data(buf.split().freeze()));
            }
            Framing::Chunked(Chunk::Size) => match buf.iter().position(|&b| b == b'\n') {
                Some(end) if end > MAX_CHUNK_LINE => return Err("a chunk-size line too long"),
                Some(end) => {
                    let line = &buf[..end];
                    let line = match line.strip_suffix(b"\r") {
                        Some(line) => line,
                        None if strict => return Err("a chunk-size line without its CR"),
                        None => line,
                    };
                    let size = chunk_size(line).ok_or("an invalid chunk size")?;
                    buf.advance(end + 1);
                    *framing = Framing::Chunked(match size {
                        0 => Chunk::Trailers(0),
                        n => Chunk::Data(n),
                    });
                }
                None if buf.len() > MAX_CHUNK_LINE => return Err("a chunk-size line too long"),
                None => return Ok(Step::More),
            },
            Framing::Chunked(Chunk::DataEnd) if buf.len() >= 2 => {
                if &buf[..2] != b"\r\n" {
                    return Err("a chunk without its CRLF");
                }
                buf.advance(2);
                *framing = Framing::Chunked(Chunk::Size);
            }
            Framing::Chunked(Chunk::Trailers(searched)) => {
                if buf.starts_with(b"\r\n") {
                    buf.advance(2);
                    *framing = Framing::Done;
                    return Ok(Step::End);
                }
                if buf.len() < 2 {
                    return Ok(Step::More);
                }
                // Searched once in all, not from the start at each read.
                let from = searched.saturating_sub(3);
                let found = buf[from..]
                    .windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .map(|at| from + at);
                *framing = Framing::Chunked(Chunk::Trailers(buf.len()));
                match found {
                    Some(end) => {
                        let trailers = trailers(&buf[..end + 4], strict)?;
                        buf.advance(end + 4);
                        *framing = Framing::Done;
                        if trailers.is_empty() {
                            return Ok(Step::End);
                        }
                        return Ok(Step::Trailers(Box::new(trailers)));
                    }
                    None if buf.len() > MAX_TRAILERS => return Err("trailers too large"),
                    None => return Ok(Step::More),
                }
            }
            _ => return Ok(Step::More),
        }
    }
}

/// The size of a chunk-size line without its end, read as RFC 9112 §7.1 writes it:
/// hex digits first, then only extensions (`;`, after optional spaces or tabs) with no control
/// character; anything else (a space before the size, a second CR, a bare CR in an extension)
/// is how two parsers come to read one body differently.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 15 {
        return None;
    }
    let rest = &line[digits..];
    let ext = rest.trim_ascii_start();
    let ows = rest.len() - ext.len();
    if !rest[..ows].iter().all(|&b| b == b' ' || b == b'\t') {
        return None;
    }
    if !(ext.is_empty() || ext[0] == b';') || ext.iter().any(|&b| b < 0x20 && b != b'\t') {
        return None;
    }
    line[..digits].iter().try_fold(0u64, |n, &d| {
        let v = (d as char).to_digit(16)?;
        Some(n * 16 + u64::from(v))
    })
}

/// Trailer fields (ending in an empty line) as a header map; `strict`: every line ends in CRLF.
fn trailers(text: &[u8], strict: bool) -> Result<HeaderMap, &'static str> {
    if strict
        && text
            .iter()
            .enumerate()
            .any(|(i, &b)| b == b'\n' && (i == 0 || text[i - 1] != b'\r'))
    {
        return Err("trailers with a bare LF");
    }
    let mut fields = [httparse::EMPTY_HEADER; MAX_TRAILER_FIELDS];
    let parsed = httparse::parse_headers(text, &mut fields).map_err(|_| "invalid trailers")?;
    let httparse::Status::Complete((_, fields)) = parsed else {
        return Err("incomplete trailers");
    };
    let mut map = HeaderMap::with_capacity(fields.len());
    for f in fields {
        let name = HeaderName::from_bytes(f.name.as_bytes());
        let value = HeaderValue::from_bytes(f.value);
        if let (Ok(name), Ok(value)) = (name, value) {
            map.append(name, value);
        }
    }
    Ok(map)
}

/// Writes one header field as a line of an HTTP/1 head: `name: value\r\n`.
pub(crate) fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// A message's body length when one `Content-Length` field gives it.
pub(crate) fn one_length(headers: &HeaderMap) -> Option<u64> {
    let mut lengths = headers.get_all(http::header::CONTENT_LENGTH).iter();
    match (lengths.next(), lengths.next()) {
        (Some(v), None) => parse_length(v.as_bytes()),
        _ => None,
    }
}

/// A decimal length of at most 19 digits.
pub(crate) fn parse_length(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0, |n, d| n * 10 + u64::from(d - b'0')))
}

/// Whether a message of `version` with these `Connection` values leaves its connection open
/// for another exchange (RFC 9112 §9.3): the upstream's response, or the client's request.
pub(crate) fn keeps_alive(version: Version, connection: &[&[u8]]) -> bool {
    let has = |token: &[u8]| connection.iter().any(|v| has_token(v, token));
    // `close` wins whatever else is said.
    if version == Version::HTTP_10 {
        has(b"keep-alive") && !has(b"close")
    } else {
        !has(b"close")
    }
}

/// How far a growing buffer has been searched for the empty line that ends a message head, so
/// that a head trickled a byte at a time is searched once in all rather than parsed from its
/// start at every read (quadratic in its size).
#[derive(Default)]
pub(crate) struct HeadEnd {
    searched: usize,
    looked: bool,
    /// Empty lines before the head (which httparse skips) end here, once known.
    lead: Option<usize>,
}

impl HeadEnd {
    /// Whether `buf` (the same buffer as at the last call, grown at its end) may hold a whole
    /// head now: at the first look (what is no head at all is refused at once), then only once
    /// an empty line (`\n\n` or `\n\r\n`, RFC 9112 lets a bare LF end a line) has arrived.
    pub fn may_end(&mut self, buf: &[u8]) -> bool {
        // The first look parses (most heads are whole in the first read); the search starts
        // at the next one, from the buffer's start.
        if !std::mem::replace(&mut self.looked, true) {
            return true;
        }
        // Empty lines before the head end nothing: found once, not searched again.
        let lead = match self.lead {
            Some(lead) => lead,
            None => {
                let from = self.searched.min(buf.len());
                let blank = buf[from..]
                    .iter()
                    .take_while(|&&b| b == b'\r' || b == b'\n');
                let end = from + blank.count();
                if end == buf.len() {
                    self.searched = buf.len();
                    return false;
                }
                self.lead = Some(end);
                end
            }
        };
        // The empty line may have begun in the bytes searched last time.
        let from = self.searched.saturating_sub(2).max(lead).min(buf.len());
        self.searched = buf.len();
        has_empty_line(&buf[from..])
    }
}

/// Whether `bytes` hold `\n\n` or `\n\r\n`.
fn has_empty_line(bytes: &[u8]) -> bool {
    let mut at = 0;
    while let Some(i) = bytes[at..].iter().position(|&b| b == b'\n') {
        let rest = &bytes[at + i + 1..];
        if rest.starts_with(b"\n") || rest.starts_with(b"\r\n") {
            return true;
        }
        at += i + 1;
    }
    false
}

/// Whether the comma-separated `list` (a header value) holds `token`, whatever its case.
pub(crate) fn has_token(list: &[u8], token: &[u8]) -> bool {
    list.split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Empty lines before a head (which the parser skips) are not its end: a client that
    /// trickles them cannot make every read parse the buffer again.
    #[test]
    fn empty_lines_before_a_head_do_not_make_it_parsed_again() {
        let mut text = b"\r\n".repeat(1000);
        text.extend_from_slice(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut end = HeadEnd::default();
        let looks = (1..=text.len().div_ceil(2))
            .map(|i| end.may_end(&text[..(2 * i).min(text.len())]))
            .filter(|&may| may)
            .count();
        assert_eq!(looks, 2, "the first look and the head's end");
    }

    #[test]
    fn chunk_sizes_are_hex_digits_then_extensions_only() {
        assert_eq!(chunk_size(b"1a"), Some(26));
        assert_eq!(chunk_size(b"FF;name=value"), Some(255));
        assert_eq!(chunk_size(b"1a \t;name=\"v\""), Some(26));
        assert_eq!(chunk_size(b"0"), Some(0));
        assert_eq!(chunk_size(b"1234567890abcdef"), None, "past 15 digits");
        for bad in [
            &b""[..],
            b"zz",
            b" 5",
            b"\t5",
            b"5\r",
            b"5\x0c",
            b"5;a\rb",
            b"5 x",
            b"-1",
        ] {
            assert_eq!(chunk_size(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    /// Every frame and the step that ends the body, from `input` given `at` a time.
    fn decoded(
        framing: Framing,
        input: &[u8],
        at: usize,
        strict: bool,
    ) -> (
        Vec<u8>,
        Option<HeaderMap>,
        Result<(), &'static str>,
        Vec<u8>,
    ) {
        let (mut framing, mut buf) = (framing, BytesMut::new());
        let (mut data, mut trailers) = (Vec::new(), None);
        let mut fed = 0;
        loop {
            match decode(&mut framing, &mut buf, strict) {
                Ok(Step::Data(d)) => data.extend_from_slice(&d),
                Ok(Step::Trailers(t)) => trailers = Some(*t),
                Ok(Step::End) => return (data, trailers, Ok(()), buf.to_vec()),
                Ok(Step::More) if fed < input.len() => {
                    let n = at.min(input.len() - fed);
                    buf.extend_from_slice(&input[fed..fed + n]);
                    fed += n;
                }
                Ok(Step::More) => return (data, trailers, Err("cut short"), buf.to_vec()),
                Err(e) => return (data, trailers, Err(e), buf.to_vec()),
            }
        }
    }

    #[test]
    fn a_chunked_body_ends_at_its_last_chunk_and_leaves_what_follows() {
        let input = b"5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nEtag: 1\r\n\r\nGET / HTTP/1.1\r\n";
        for at in [1, 2, 3, 7, input.len()] {
            let (data, trailers, end, rest) =
                decoded(Framing::Chunked(Chunk::Size), input, at, true);
            assert_eq!(end, Ok(()), "read {at} at a time");
            assert_eq!(data, b"hello world");
            assert_eq!(trailers.unwrap()["etag"], "1");
            // What follows is left, whole or in part as it was read.
            assert!(b"GET / HTTP/1.1\r\n".starts_with(&rest), "{rest:?}");
        }
    }

    #[test]
    fn a_request_body_takes_only_crlf_lines_and_a_response_a_bare_lf_too() {
        let bare = b"5\nhello\r\n0\r\n\r\n";
        let strict = decoded(Framing::Chunked(Chunk::Size), bare, 64, true);
        assert_eq!(strict.2, Err("a chunk-size line without its CR"));
        let lenient = decoded(Framing::Chunked(Chunk::Size), bare, 64, false);
        assert_eq!((lenient.0.as_slice(), lenient.2), (&b"hello"[..], Ok(())));
        for (input, why) in [
            (&b"5\r\nhelloX\r\n0\r\n\r\n"[..], "a chunk without its CRLF"),
            (b"g\r\n", "an invalid chunk size"),
            (b"0\r\nA: b\nC: d\r\n\r\n", "trailers with a bare LF"),
        ] {
            assert_eq!(
                decoded(Framing::Chunked(Chunk::Size), input, 64, true).2,
                Err(why)
            );
        }
        let long = [b"1;".as_slice(), &[b'x'; 2000], b"\r\n"].concat();
        assert_eq!(
            decoded(Framing::Chunked(Chunk::Size), &long, 4096, true).2,
            Err("a chunk-size line too long")
        );
    }

    #[test]
    fn a_length_body_stops_at_its_length() {
        let (data, _, end, rest) = decoded(Framing::Length(5), b"helloGET", 3, true);
        assert_eq!((data.as_slice(), end), (&b"hello"[..], Ok(())));
        assert!(b"GET".starts_with(&rest));
        assert_eq!(
            decoded(Framing::Length(5), b"hel", 3, true).2,
            Err("cut short")
        );
    }

    proptest::proptest! {
        /// Any body, cut into any chunks with any extensions, read in any pieces, comes back
        /// whole, and nothing after it is taken.
        #[test]
        fn chunks_decode_to_the_body(
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..600),
            cuts in proptest::collection::vec(1usize..200, 1..8),
            ext in proptest::bool::ANY,
            at in 1usize..50,
        ) {
            let mut input = Vec::new();
            let mut rest = body.as_slice();
            for cut in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let n = (*cut).min(rest.len());
                input.extend_from_slice(format!("{n:X}").as_bytes());
                if ext {
                    input.extend_from_slice(b";a=\"b\"");
                }
                input.extend_from_slice(b"\r\n");
                input.extend_from_slice(&rest[..n]);
                input.extend_from_slice(b"\r\n");
                rest = &rest[n..];
            }
            input.extend_from_slice(b"0\r\n\r\nNEXT");
            let (data, trailers, end, left) =
                decoded(Framing::Chunked(Chunk::Size), &input, at, true);
            proptest::prop_assert_eq!(end, Ok(()));
            proptest::prop_assert_eq!(data, body);
            proptest::prop_assert!(trailers.is_none());
            proptest::prop_assert!(b"NEXT".starts_with(&left));
        }
    }
}
