//! Request ids: what an answer of Spillway's, its rejection log line and its access log line
//! call a request, so that a support engineer can find one from another. Taken from a trusted
//! `x-request-id` (or the ids of a `traceparent`), else made here: a thread's random prefix
//! and its count, unique in the fleet for practical purposes, and written out only when an
//! answer or a line needs it. Owns [`RequestId`], its text, and how it is chosen. Must never:
//! allocate, take an id it cannot write safely in a header and a JSON string, or trust a
//! client's id unless told to.

use std::cell::Cell;
use std::fmt;

use http::HeaderMap;

/// The longest id taken from a request; longer ones are replaced by one made here.
pub const MAX_LEN: usize = 64;

pub static X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// Whose ids are taken (`request_id.from`).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum IdFrom {
    /// A peer in `client_ip.trusted_proxies`' `x-request-id`, else its `traceparent`'s ids.
    #[default]
    Trusted,
    /// Any client's (an id a client chose shows in the logs as it chose it).
    Any,
    /// None: every id is made here.
    Never,
}

/// A request's id: made here (this thread's random prefix and its count: nothing is written
/// until an answer or a line needs it), or taken from the request.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum RequestId {
    Made { prefix: u64, n: u64 },
    Taken(IdText),
}

/// An id's text: at most [`MAX_LEN`] bytes of visible ASCII other than `"` and `\`, inline.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IdText {
    len: u8,
    bytes: [u8; MAX_LEN],
}

impl RequestId {
    /// The id of a request with `headers` from a peer that is (`trusted`) a listed proxy or
    /// not, by `from`; `made` when none is taken.
    #[inline]
    pub fn of(headers: &HeaderMap, trusted: bool, from: IdFrom, made: RequestId) -> RequestId {
        Self::taken_by(headers, trusted, from).unwrap_or(made)
    }

    /// The id `from` takes of a request with `headers` from a peer that is `trusted` or not;
    /// `None` when none is taken (no header is read for a peer whose ids are not taken).
    #[inline]
    pub fn taken_by(headers: &HeaderMap, trusted: bool, from: IdFrom) -> Option<RequestId> {
        match from {
            IdFrom::Trusted if trusted => Self::taken(headers),
            IdFrom::Any => Self::taken(headers),
            _ => None,
        }
    }

    /// The request's own id: its `x-request-id`, else its `traceparent`'s trace and parent
    /// ids (`<trace-id>-<parent-id>`).
    #[cold]
    fn taken(headers: &HeaderMap) -> Option<RequestId> {
        if let Some(id) = headers
            .get(&X_REQUEST_ID)
            .and_then(|v| IdText::from_bytes(v.as_bytes()))
        {
            return Some(RequestId::Taken(id));
        }
        let tp = headers.get("traceparent")?.as_bytes();
        // `00-<32 hex>-<16 hex>-<2 hex>`.
        let hex = |b: &[u8]| b.iter().all(u8::is_ascii_hexdigit);
        if tp.len() < 55 || tp[2] != b'-' || tp[35] != b'-' || tp[52] != b'-' {
            return None;
        }
        let (trace, parent) = (&tp[3..35], &tp[36..52]);
        if !hex(trace) || !hex(parent) || trace.iter().all(|&b| b == b'0') {
            return None;
        }
        IdText::from_bytes(&tp[3..52]).map(RequestId::Taken)
    }

    /// A new id made here: this thread's random prefix and its next count.
    #[inline]
    pub fn made() -> RequestId {
        let (prefix, n) = Self::next();
        RequestId::Made { prefix, n }
    }

    /// What [`Self::made`] makes, as its two numbers (what a request keeps until asked).
    #[inline]
    pub fn next() -> (u64, u64) {
        thread_local! {
            static NEXT: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
        }
        NEXT.with(|next| {
            let (mut prefix, n) = next.get();
            if prefix == 0 {
                // A thread's own prefix: threads count apart.
                prefix = fastrand::u64(1..);
            }
            next.set((prefix, n.wrapping_add(1)));
            (prefix, n)
        })
    }

    /// The id as it is written: for one made here, 12 hex digits of the prefix and 12 of the
    /// count.
    #[inline]
    pub fn text(&self) -> IdText {
        match *self {
            RequestId::Taken(text) => text,
            RequestId::Made { prefix, n } => {
                let mut text = IdText {
                    len: 24,
                    bytes: [0; MAX_LEN],
                };
                let (p, c) = ((prefix >> 16).to_be_bytes(), n.to_be_bytes());
                for i in 0..6 {
                    text.bytes[2 * i..2 * i + 2].copy_from_slice(&HEX_PAIRS[p[i + 2] as usize]);
                    text.bytes[12 + 2 * i..14 + 2 * i]
                        .copy_from_slice(&HEX_PAIRS[c[i + 2] as usize]);
                }
                text
            }
        }
    }
}

/// Each byte's two hex digits.
const HEX_PAIRS: [[u8; 2]; 256] = {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0; 2]; 256];
    let mut i = 0;
    while i < 256 {
        pairs[i] = [HEX[i >> 4], HEX[i & 15]];
        i += 1;
    }
    pairs
};

impl IdText {
    /// `bytes` as an id, if it may be one.
    pub fn from_bytes(bytes: &[u8]) -> Option<IdText> {
        let fits = (1..=MAX_LEN).contains(&bytes.len())
            && bytes
                .iter()
                .all(|&b| b.is_ascii_graphic() && b != b'"' && b != b'\\');
        if !fits {
            return None;
        }
        let mut id = IdText {
            len: bytes.len() as u8,
            bytes: [0; MAX_LEN],
        };
        id.bytes[..bytes.len()].copy_from_slice(bytes);
        Some(id)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    pub fn as_str(&self) -> &str {
        // Visible ASCII only (see `from_bytes` and `RequestId::text`).
        std::str::from_utf8(self.as_bytes()).unwrap_or("")
    }

    /// The id as a header value.
    pub fn header_value(&self) -> http::HeaderValue {
        http::HeaderValue::from_bytes(self.as_bytes()).expect("an id is visible ASCII")
    }
}

impl fmt::Display for IdText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for IdText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdText({})", self.as_str())
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RequestId({})", self.text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn id(h: &HeaderMap, trusted: bool, from: IdFrom) -> String {
        RequestId::of(h, trusted, from, RequestId::made())
            .text()
            .to_string()
    }

    #[test]
    fn a_trusted_peers_id_is_taken_and_an_untrusted_ones_never_by_default() {
        let h = headers(&[("x-request-id", "abc-123")]);
        assert_eq!(id(&h, true, IdFrom::Trusted), "abc-123");
        assert_ne!(id(&h, false, IdFrom::Trusted), "abc-123");
        assert_eq!(id(&h, false, IdFrom::Any), "abc-123");
        assert_ne!(id(&h, true, IdFrom::Never), "abc-123");
    }

    #[test]
    fn a_traceparent_gives_its_trace_and_parent_ids_and_a_malformed_one_nothing() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            id(&headers(&[("traceparent", tp)]), true, IdFrom::Trusted),
            "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473x-00f067aa0ba902b7-01",
            "00-short-01",
        ] {
            let made = id(&headers(&[("traceparent", bad)]), true, IdFrom::Trusted);
            assert_eq!(made.len(), 24, "{bad}: {made}");
        }
    }

    #[test]
    fn ids_that_would_break_a_header_or_json_are_replaced() {
        for bad in ["a\"b", "a\\b", "a b", &"x".repeat(MAX_LEN + 1)] {
            let made = id(&headers(&[("x-request-id", bad)]), true, IdFrom::Any);
            assert_ne!(made, bad);
            assert_eq!(made.len(), 24);
        }
        let longest = IdText::from_bytes(&[b'x'; MAX_LEN]).unwrap();
        assert_eq!(longest.as_bytes().len(), MAX_LEN);
    }

    #[test]
    fn made_ids_are_distinct_and_hex_and_the_same_id_writes_the_same_text() {
        let a = RequestId::made();
        let b = RequestId::made();
        assert_eq!(a.text(), a.text());
        assert_ne!(a.text(), b.text());
        let text = a.text();
        assert!(text.as_bytes().iter().all(u8::is_ascii_hexdigit), "{text}");
        // Consecutive ids of a thread share its prefix and differ in their count.
        assert_eq!(text.as_bytes()[..12], b.text().as_bytes()[..12]);
        let other = std::thread::spawn(|| RequestId::made().text())
            .join()
            .unwrap();
        assert_ne!(text.as_bytes()[..12], other.as_bytes()[..12]);
    }
}
