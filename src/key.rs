//! Key extraction: which bucket a request belongs to under a rule, and who the client is.
//!
//! Owns the key parts a rule can count by and the `X-Forwarded-For` walk. A key is written
//! into a caller-provided stack buffer ([`KeyBuf`]) with each part length-framed, so that a
//! tuple key (`[client_ip, method]`) cannot collide with another tuple whose parts concatenate
//! to the same bytes. Must never: allocate for keys under 128 bytes, trust the leftmost
//! `X-Forwarded-For` entry, or fail a request (a missing part means "rule does not apply").

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::OnceLock;

use http::{HeaderMap, HeaderName, Method, Uri};
use smallvec::SmallVec;

/// Key bytes, on the stack up to 128 bytes.
pub type KeyBuf = SmallVec<[u8; 128]>;

/// One component of a rule's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    /// The client address (see [`client_ip`]).
    ClientIp,
    /// A request header's value; absent header = rule does not apply.
    Header(HeaderName),
    /// A query parameter's raw (still percent-encoded) value.
    Query(String),
    /// The request path, without the query.
    Path,
    Method,
    /// The host, lower case, without port.
    Host,
}

impl FromStr for KeyPart {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "client_ip" => Ok(KeyPart::ClientIp),
            "path" => Ok(KeyPart::Path),
            "method" => Ok(KeyPart::Method),
            "host" => Ok(KeyPart::Host),
            _ => {
                if let Some(name) = s.strip_prefix("header:") {
                    HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes())
                        .map(KeyPart::Header)
                        .map_err(|_| format!("{s:?}: {name:?} is not a header name"))
                } else if let Some(name) = s.strip_prefix("query:") {
                    if name.is_empty() {
                        Err(format!("{s:?}: missing parameter name"))
                    } else {
                        Ok(KeyPart::Query(name.to_string()))
                    }
                } else {
                    Err(format!(
                        "{s:?}: unknown key part (expected client_ip, header:NAME, query:NAME, path, method or host)"
                    ))
                }
            }
        }
    }
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPart::ClientIp => f.write_str("client_ip"),
            KeyPart::Header(h) => write!(f, "header:{h}"),
            KeyPart::Query(q) => write!(f, "query:{q}"),
            KeyPart::Path => f.write_str("path"),
            KeyPart::Method => f.write_str("method"),
            KeyPart::Host => f.write_str("host"),
        }
    }
}

/// What key extraction and matching read from a request; all borrowed.
#[derive(Debug, Clone)]
pub struct RequestView<'a> {
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
    pub client_ip: IpAddr,
    /// Worked out on the first rule that asks (most never do), then kept for the others.
    host: OnceLock<Option<&'a str>>,
}

impl<'a> RequestView<'a> {
    /// The view of `req` from `client_ip`. It borrows the head only, never the body, so a
    /// future holding it stays `Send` whatever the body type.
    pub fn of<B>(req: &'a http::Request<B>, client_ip: IpAddr) -> Self {
        RequestView::new(req.method(), req.uri(), req.headers(), client_ip)
    }

    pub fn new(
        method: &'a Method,
        uri: &'a Uri,
        headers: &'a HeaderMap,
        client_ip: IpAddr,
    ) -> Self {
        RequestView {
            method,
            uri,
            headers,
            client_ip,
            host: OnceLock::new(),
        }
    }

    /// The host without port, when the request names one: worked out once, when a rule first
    /// asks (a `Host` lookup on every request cost ~250 instructions, and most rules never ask).
    pub fn host(&self) -> Option<&'a str> {
        *self
            .host
            .get_or_init(|| request_host(self.uri, self.headers))
    }
}

/// The request's host: the `Host` header, else the URI authority (HTTP/2), without port.
pub fn request_host<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<&'a str> {
    let raw = match headers.get(http::header::HOST) {
        Some(v) => v.to_str().ok()?,
        None => uri.authority()?.as_str(),
    };
    Some(strip_port(raw))
}

fn strip_port(hostport: &str) -> &str {
    if let Some(rest) = hostport.strip_prefix('[') {
        // [v6]:port
        return rest.split(']').next().unwrap_or(rest);
    }
    match hostport.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => hostport,
    }
}

/// Writes the key of `parts` for `req` into `out`. Returns false when a part is missing, which
/// means the rule does not apply to this request.
pub fn extract(parts: &[KeyPart], req: &RequestView<'_>, out: &mut KeyBuf) -> bool {
    out.clear();
    for part in parts {
        match part {
            KeyPart::ClientIp => match req.client_ip.to_canonical() {
                IpAddr::V4(v4) => push(out, &v4.octets()),
                IpAddr::V6(v6) => push(out, &v6.octets()),
            },
            KeyPart::Header(name) => match req.headers.get(name) {
                Some(v) => push(out, v.as_bytes()),
                None => return false,
            },
            KeyPart::Query(name) => match query_param(req.uri.query(), name) {
                Some(v) => push(out, v.as_bytes()),
                None => return false,
            },
            KeyPart::Path => push(out, req.uri.path().as_bytes()),
            KeyPart::Method => push(out, req.method.as_str().as_bytes()),
            KeyPart::Host => match req.host() {
                Some(h) => {
                    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
                    out.extend(h.bytes().map(|b| b.to_ascii_lowercase()));
                }
                None => return false,
            },
        }
    }
    true
}

/// Writes the text form of the key of `parts` for `req` into `out`: what global rules report
/// and look their ratios up by. Parts are separated by U+001F, which no header value, query or
/// path can hold, so tuples stay unambiguous. Returns false when a part is missing.
pub fn extract_text(parts: &[KeyPart], req: &RequestView<'_>, out: &mut KeyBuf) -> bool {
    use std::io::Write;
    out.clear();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push(0x1f);
        }
        match part {
            // Formatting into the stack buffer: no allocation.
            KeyPart::ClientIp => {
                let _ = write!(out, "{}", req.client_ip.to_canonical());
            }
            KeyPart::Header(name) => match req.headers.get(name) {
                Some(v) => out.extend_from_slice(v.as_bytes()),
                None => return false,
            },
            KeyPart::Query(name) => match query_param(req.uri.query(), name) {
                Some(v) => out.extend_from_slice(v.as_bytes()),
                None => return false,
            },
            KeyPart::Path => out.extend_from_slice(req.uri.path().as_bytes()),
            KeyPart::Method => out.extend_from_slice(req.method.as_str().as_bytes()),
            KeyPart::Host => match req.host() {
                Some(h) => out.extend(h.bytes().map(|b| b.to_ascii_lowercase())),
                None => return false,
            },
        }
    }
    true
}

#[inline]
fn push(out: &mut KeyBuf, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// The raw value of the first `name=` parameter in a query string.
pub fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then_some(v)
    })
}

/// The client address: the socket peer when `trusted_hops` is 0, else the `X-Forwarded-For`
/// entry `trusted_hops` from the right (each trusted proxy appended the address it saw).
/// When the header has fewer entries than that, or the entry is not an address, the peer is
/// used: entries left of the trusted ones are whatever the client wrote and are never used.
pub fn client_ip(headers: &HeaderMap, peer: IpAddr, trusted_hops: u8) -> IpAddr {
    if trusted_hops == 0 {
        return peer;
    }
    let mut seen = 0u16;
    // Several X-Forwarded-For lines form one list in order; walk it from the right.
    let values: SmallVec<[&[u8]; 4]> = headers
        .get_all(http::header::HeaderName::from_static("x-forwarded-for"))
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    for value in values.iter().rev() {
        for entry in value.rsplit(|&b| b == b',') {
            seen += 1;
            if seen == u16::from(trusted_hops) {
                return parse_forwarded_ip(entry).unwrap_or(peer);
            }
        }
    }
    peer
}

/// One `X-Forwarded-For` entry: an address, optionally with a port (`1.2.3.4:80`, `[::1]:80`).
fn parse_forwarded_ip(entry: &[u8]) -> Option<IpAddr> {
    let s = std::str::from_utf8(entry).ok()?.trim();
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(rest) = s.strip_prefix('[') {
        return rest.split(']').next()?.parse().ok();
    }
    let (ip, port) = s.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    ip.parse().ok()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    /// A header map of `pairs`, repeated names appended (also used by other modules' tests).
    pub(crate) fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    const PEER: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 9));

    #[test]
    fn without_trusted_hops_the_peer_is_the_client_whatever_the_header_says() {
        let h = headers(&[("x-forwarded-for", "1.1.1.1")]);
        assert_eq!(client_ip(&h, PEER, 0), PEER);
    }

    #[test]
    fn one_trusted_hop_takes_the_rightmost_entry_not_the_spoofable_leftmost() {
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 2.2.2.2")]);
        assert_eq!(client_ip(&h, PEER, 1), "2.2.2.2".parse::<IpAddr>().unwrap());
        assert_eq!(client_ip(&h, PEER, 2), "6.6.6.6".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn several_header_lines_form_one_list() {
        let h = headers(&[
            ("x-forwarded-for", "6.6.6.6"),
            ("x-forwarded-for", "3.3.3.3, 2.2.2.2"),
        ]);
        assert_eq!(client_ip(&h, PEER, 2), "3.3.3.3".parse::<IpAddr>().unwrap());
        assert_eq!(client_ip(&h, PEER, 3), "6.6.6.6".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn too_few_entries_or_garbage_fall_back_to_the_peer() {
        let h = headers(&[("x-forwarded-for", "2.2.2.2")]);
        assert_eq!(client_ip(&h, PEER, 2), PEER);
        let h = headers(&[("x-forwarded-for", "nonsense")]);
        assert_eq!(client_ip(&h, PEER, 1), PEER);
        assert_eq!(client_ip(&HeaderMap::new(), PEER, 1), PEER);
    }

    #[test]
    fn entries_with_ports_and_brackets_parse() {
        assert_eq!(
            parse_forwarded_ip(b" 1.2.3.4:8080"),
            Some("1.2.3.4".parse().unwrap())
        );
        assert_eq!(
            parse_forwarded_ip(b"[2001:db8::1]:443"),
            Some("2001:db8::1".parse().unwrap())
        );
        assert_eq!(
            parse_forwarded_ip(b"2001:db8::1"),
            Some("2001:db8::1".parse().unwrap())
        );
    }

    fn view<'a>(m: &'a Method, u: &'a Uri, h: &'a HeaderMap) -> RequestView<'a> {
        RequestView::new(m, u, h, PEER)
    }

    #[test]
    fn tuple_keys_are_framed_so_concatenations_do_not_collide() {
        let parts = vec![
            KeyPart::Header(HeaderName::from_static("a")),
            KeyPart::Header(HeaderName::from_static("b")),
        ];
        let (m, u) = (Method::GET, Uri::from_static("/"));
        let h1 = headers(&[("a", "xy"), ("b", "z")]);
        let h2 = headers(&[("a", "x"), ("b", "yz")]);
        let (mut k1, mut k2) = (KeyBuf::new(), KeyBuf::new());
        assert!(extract(&parts, &view(&m, &u, &h1), &mut k1));
        assert!(extract(&parts, &view(&m, &u, &h2), &mut k2));
        assert_ne!(k1, k2);
    }

    #[test]
    fn a_missing_part_means_the_rule_does_not_apply() {
        let parts = vec![KeyPart::ClientIp, KeyPart::Query("user".into())];
        let (m, h) = (Method::GET, HeaderMap::new());
        let u = Uri::from_static("/x?a=1&user=bob");
        let mut k = KeyBuf::new();
        assert!(extract(&parts, &view(&m, &u, &h), &mut k));
        let u = Uri::from_static("/x?a=1");
        assert!(!extract(&parts, &view(&m, &u, &h), &mut k));
    }

    #[test]
    fn text_keys_are_readable_and_tuples_separated() {
        let parts = vec![
            KeyPart::ClientIp,
            KeyPart::Header(HeaderName::from_static("k")),
        ];
        let (m, u) = (Method::GET, Uri::from_static("/"));
        let h = headers(&[("k", "abc")]);
        let mut k = KeyBuf::new();
        assert!(extract_text(&parts, &view(&m, &u, &h), &mut k));
        assert_eq!(&k[..], b"10.0.0.9\x1fabc");
        assert!(!extract_text(
            &parts,
            &view(&m, &u, &HeaderMap::new()),
            &mut k
        ));
    }

    #[test]
    fn host_is_taken_without_port_and_lower_cased() {
        let h = headers(&[("host", "API.Example.com:8080")]);
        let u = Uri::from_static("/");
        assert_eq!(request_host(&u, &h), Some("API.Example.com"));
        let mut k = KeyBuf::new();
        let m = Method::GET;
        assert!(extract(&[KeyPart::Host], &view(&m, &u, &h), &mut k));
        assert_eq!(&k[4..], b"api.example.com");
        let u2 = Uri::from_static("http://[::1]:80/");
        assert_eq!(request_host(&u2, &HeaderMap::new()), Some("::1"));
    }

    #[test]
    fn key_parts_parse_and_print_back() {
        for s in [
            "client_ip",
            "header:x-api-key",
            "query:user",
            "path",
            "method",
            "host",
        ] {
            assert_eq!(s.parse::<KeyPart>().unwrap().to_string(), s);
        }
        assert!("cookie:x".parse::<KeyPart>().is_err());
        assert!("query:".parse::<KeyPart>().is_err());
    }
}
