//! The fields that belong to one connection, not to the message (RFC 9110 §7.6.1): the one
//! hop-by-hop set every side of the proxy strips or skips.
//!
//! Owns the list and the reading of `Connection` values. Must never: allocate for a message
//! that names no extra field, or let `Connection` remove a field the message cannot go without
//! (that refusal is [`crate::hygiene`]'s).

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Whether `name` is one of the fields that always belong to one connection (RFC 9110
/// §7.6.1). Those a message's `Connection` lists are [`listed`].
pub fn hop_by_hop(name: &HeaderName) -> bool {
    is_hop_by_hop(name.as_str().as_bytes())
}

/// [`hop_by_hop`] for a name as it lies in a head, in any case: `Connection`, `Keep-Alive`,
/// `Proxy-Connection`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`, `Proxy-Authenticate`,
/// `Proxy-Authorization` (the one set; [`HOP_BY_HOP`] names the same fields but `Upgrade`, for
/// removing them from a map). By its length first: most names are none of these.
pub fn is_hop_by_hop(name: &[u8]) -> bool {
    let is = |text: &[u8]| name.eq_ignore_ascii_case(text);
    match name.len() {
        2 => is(b"te"),
        7 => is(b"trailer") || is(b"upgrade"),
        10 => is(b"connection") || is(b"keep-alive"),
        16 => is(b"proxy-connection"),
        17 => is(b"transfer-encoding"),
        18 => is(b"proxy-authenticate"),
        19 => is(b"proxy-authorization"),
        _ => false,
    }
}

/// The field names a message's `Connection` values list beyond those [`hop_by_hop`] covers:
/// usually none at all, or `close` (no field is named so; one that were would go too, as it
/// always has through [`strip_hop_by_hop`], which uses this list).
pub fn listed<'a>(connection: impl IntoIterator<Item = &'a [u8]>) -> SmallVec<[&'a [u8]; 2]> {
    connection
        .into_iter()
        .flat_map(|v| v.split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty() && !is_hop_by_hop(t))
        .collect()
}

/// Removes the headers that belong to one connection (RFC 9110 §7.6.1), including those the
/// `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Which of HOP_BY_HOP (bit i) and Upgrade the message carries, in one pass over the names
    // (standard ones compare as enums): only those present are then removed, each a hashed
    // lookup. Most requests carry none; most responses of nginx `Connection: keep-alive`.
    const UPGRADE: u16 = 1 << HOP_BY_HOP.len();
    let mut present = 0u16;
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|h| *h == name) {
            present |= 1 << i;
        } else if name == header::UPGRADE {
            present |= UPGRADE;
        }
    }
    if present == 0 {
        return;
    }
    // HOP_BY_HOP[0] is `Connection`; the other headers it names go too (`upgrade` and
    // HOP_BY_HOP's own are dealt with below, by what the pass found). The values are shared
    // with the parsed message (cloning one counts a reference), and each named header is
    // removed by its text: no header name is allocated.
    if present & 1 != 0 {
        let connection: SmallVec<[HeaderValue; 2]> = headers
            .get_all(header::CONNECTION)
            .iter()
            .cloned()
            .collect();
        for token in listed(connection.iter().map(HeaderValue::as_bytes)) {
            if let Ok(name) = std::str::from_utf8(token) {
                headers.remove(name);
            }
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(*name);
        }
    }
    if present & UPGRADE != 0 {
        headers.remove(header::UPGRADE);
    }
}

/// The headers [`strip_hop_by_hop`] always removes (with `Upgrade`).
static HOP_BY_HOP: [&HeaderName; 8] = [
    &header::CONNECTION,
    &KEEP_ALIVE,
    &PROXY_CONNECTION,
    &header::TE,
    &header::TRAILER,
    &header::TRANSFER_ENCODING,
    &header::PROXY_AUTHENTICATE,
    &header::PROXY_AUTHORIZATION,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "keep-alive, x-secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert(header::TE, "trailers".parse().unwrap());
        h.insert(header::UPGRADE, "websocket".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn names_in_connection_match_whatever_their_case_and_odd_tokens_are_ignored() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "X-Secret , ,bad name".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn the_map_s_list_is_the_set_but_upgrade() {
        for name in HOP_BY_HOP {
            assert!(
                is_hop_by_hop(name.as_str().to_ascii_uppercase().as_bytes()),
                "{name}"
            );
        }
        let others = [
            "upgrade",
            "tes",
            "connections",
            "date",
            "content-length",
            "x",
            "",
        ];
        let set: Vec<_> = others
            .iter()
            .filter(|n| is_hop_by_hop(n.as_bytes()))
            .collect();
        assert_eq!(set, [&"upgrade"]);
    }

    #[test]
    fn a_message_without_hop_by_hop_headers_is_left_as_it_is() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "app".parse().unwrap());
        h.insert("x-client", "c1".parse().unwrap());
        let before = h.clone();
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }
}
