//! What the server side and the client side share: the end of a head, lengths, whether a
//! message keeps its connection, and how a header line is written.

use http::Version;

/// Writes one header field as a line of an HTTP/1 head: `name: value\r\n`.
pub(crate) fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
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
}
