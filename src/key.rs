//! Key extraction: which bucket a request belongs to under a rule, and who the client is.
//!
//! Owns the key parts a rule can count by, the client address (`X-Forwarded-For` read only
//! from listed proxies, public IPv6 keyed by prefix) and the bounded forms a key is kept in.
//! A key is written into a caller-provided stack buffer ([`KeyBuf`]) with each part
//! length-framed, so that a tuple key cannot collide with another whose parts concatenate to
//! the same bytes. A local key past [`INLINE_KEY`] bytes becomes a keyed 128-bit hash
//! ([`bound_local`]); a global key, a fleet-stable digest ([`canonical_text`]). Must never:
//! allocate for keys under 128 bytes, read `X-Forwarded-For` from a peer that is not a listed
//! proxy, or pick one of several values of a keyed field (that is [`Extract::Repeated`]).

use std::borrow::Cow;
use std::fmt;
use std::hash::Hasher;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::OnceLock;

use http::{HeaderMap, HeaderName, Method, Uri};
use smallvec::SmallVec;

/// Key bytes, on the stack up to 128 bytes.
pub type KeyBuf = SmallVec<[u8; 128]>;

/// One component of a rule's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    /// The client address: the socket peer, or what a trusted proxy in front said; public
    /// addresses cut to `client_ip.ipv4_prefix` / `ipv6_prefix`.
    ClientIp,
    /// The same, cut to this rule's own prefixes (`client_ip/24`, `client_ip/48`,
    /// `client_ip/24/48`); `None`, the configured one.
    ClientNet {
        v4: Option<u8>,
        v6: Option<u8>,
    },
    /// A request header's value; absent header = rule does not apply; sent twice = 400.
    Header(HeaderName),
    /// A query parameter's value, percent-decoded (`%XX` and `+`).
    Query(String),
    /// The request path, without the query, in its match form (see [`RequestView::path`]).
    Path,
    Method,
    /// The host, lower case, without port or trailing dot; none (HTTP/1.0) = the empty host.
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
                if let Some(lengths) = s.strip_prefix("client_ip/") {
                    return client_net(s, lengths);
                }
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
                        "{s:?}: unknown key part (expected client_ip, client_ip/PREFIX, header:NAME, query:NAME, path, method or host)"
                    ))
                }
            }
        }
    }
}

/// `client_ip/N` (N up to 32: IPv4's prefix; over 32: IPv6's) or `client_ip/V4/V6`.
fn client_net(s: &str, lengths: &str) -> Result<KeyPart, String> {
    let bad = || {
        format!(
            "{s:?}: expected client_ip/N (1-32 for IPv4 clients, 33-128 for IPv6 ones) or client_ip/V4/V6 (client_ip/24/48)"
        )
    };
    let num = |t: &str| t.parse::<u8>().map_err(|_| bad());
    match lengths.split_once('/') {
        None => match num(lengths)? {
            n @ 1..=32 => Ok(KeyPart::ClientNet {
                v4: Some(n),
                v6: None,
            }),
            n @ 33..=128 => Ok(KeyPart::ClientNet {
                v4: None,
                v6: Some(n),
            }),
            _ => Err(bad()),
        },
        Some((v4, v6)) => match (num(v4)?, num(v6)?) {
            (v4 @ 1..=32, v6 @ 1..=128) => Ok(KeyPart::ClientNet {
                v4: Some(v4),
                v6: Some(v6),
            }),
            _ => Err(bad()),
        },
    }
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPart::ClientIp => f.write_str("client_ip"),
            KeyPart::ClientNet { v4, v6 } => match (v4, v6) {
                (Some(a), Some(b)) => write!(f, "client_ip/{a}/{b}"),
                (Some(n), None) | (None, Some(n)) => write!(f, "client_ip/{n}"),
                (None, None) => f.write_str("client_ip"),
            },
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
    /// The client's address before `client_ip`'s prefixes cut it (an address inside NAT64,
    /// 6to4 or Teredo already taken out): what `client_ip/N` key parts cut to their own.
    pub client_addr: IpAddr,
    /// The socket peer is a listed trusted proxy: its cost headers are honoured.
    pub trusted_peer: bool,
    /// `path_match: strict`: paths compare as written, case and `;params` included.
    pub strict_path: bool,
    /// Worked out on the first rule that asks (most never do), then kept for the others.
    host: OnceLock<Option<&'a str>>,
    /// The path as rules see it; worked out at once (one pass over a canonical path, which
    /// costs less than a `OnceLock` would).
    path: Cow<'a, str>,
    /// Whose request ids are taken (`request_id.from`).
    ids: crate::ids::IdFrom,
    /// The id made for the request, if none is taken (`RequestId::Made`'s numbers; its text
    /// is written only if asked).
    made: (u64, u64),
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
            client_addr: client_ip,
            trusted_peer: false,
            strict_path: false,
            host: OnceLock::new(),
            path: path_form(uri, false),
            ids: crate::ids::IdFrom::Trusted,
            made: crate::ids::RequestId::next(),
        }
    }

    /// The view the proxy decides by: `client` behind a `trusted` peer or not, paths
    /// compared as written when `strict`, request ids taken as `ids` says (one construction,
    /// no builder moves).
    pub fn for_proxy<B>(
        req: &'a http::Request<B>,
        client: Client,
        (trusted, strict): (bool, bool),
        ids: crate::ids::IdFrom,
    ) -> Self {
        RequestView {
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
            client_ip: client.keyed,
            client_addr: client.addr,
            trusted_peer: trusted,
            strict_path: strict,
            host: OnceLock::new(),
            path: path_form(req.uri(), strict),
            ids,
            made: crate::ids::RequestId::next(),
        }
    }

    /// The same view, its peer a trusted proxy (or not).
    pub fn trusted(mut self, yes: bool) -> Self {
        self.trusted_peer = yes;
        self
    }

    /// The same view, comparing paths as written (`path_match: strict`).
    pub fn strict(mut self, yes: bool) -> Self {
        if yes != self.strict_path {
            self.strict_path = yes;
            self.path = path_form(self.uri, yes);
        }
        self
    }

    /// The request's id ([`crate::ids::RequestId::of`]), the same however often asked.
    #[inline]
    pub fn request_id(&self) -> crate::ids::RequestId {
        let (prefix, n) = self.made;
        let made = crate::ids::RequestId::Made { prefix, n };
        crate::ids::RequestId::of(self.headers, self.trusted_peer, self.ids, made)
    }

    /// The path rules match and key by: as written under `path_match: strict`, else without
    /// `;params` and one trailing slash (compared without case). Frameworks differ in what they
    /// route alike; counting these together over-counts rather than under-counts.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The host without port, when the request names one: worked out once, when a rule first
    /// asks (most rules never ask, and a lookup on every request was measurable).
    pub fn host(&self) -> Option<&'a str> {
        *self
            .host
            .get_or_init(|| request_host(self.uri, self.headers))
    }
}

/// The path rules see: as written when `strict`, else its match form.
#[inline]
fn path_form(uri: &Uri, strict: bool) -> Cow<'_, str> {
    if strict {
        Cow::Borrowed(uri.path())
    } else {
        crate::target::match_form(uri.path())
    }
}

/// The request's host: the `Host` header, else the URI authority (HTTP/2), without port and
/// without the trailing dot of a fully qualified name (`api.example.com.` is the same host).
pub fn request_host<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<&'a str> {
    let raw = match headers.get(http::header::HOST) {
        Some(v) => v.to_str().ok()?,
        None => uri.authority()?.as_str(),
    };
    let host = strip_port(raw);
    Some(match host.strip_suffix('.') {
        Some(h) if !h.is_empty() => h,
        _ => host,
    })
}

/// Whether `host` is a subdomain under `suffix` (`.example.com`), without case: something
/// before the suffix, and the suffix at a character boundary.
pub fn under_domain(host: &str, suffix: &str) -> bool {
    host.len() > suffix.len()
        && host.is_char_boundary(host.len() - suffix.len())
        && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
}

/// Whether `value` is a `Host` as RFC 9110 §7.2 allows: a registered name or an IPv4
/// address, or an IPv6 literal in brackets, then an optional port of digits.
pub fn valid_host(value: &[u8]) -> bool {
    if value.first() == Some(&b'[') {
        let Some(end) = value.iter().position(|&b| b == b']') else {
            return false;
        };
        let inner = &value[1..end];
        return !inner.is_empty()
            && inner
                .iter()
                .all(|b| b.is_ascii_hexdigit() || matches!(b, b':' | b'.'))
            && valid_port(&value[end + 1..]);
    }
    // One pass: name bytes, then at the first ':' the port's shape.
    let mut i = 0;
    while i < value.len() {
        let b = value[i];
        if b == b':' {
            return valid_port(&value[i..]);
        }
        if !HOST_BYTE[usize::from(b)] {
            return false;
        }
        i += 1;
    }
    true
}

/// Nothing, or `:` and up to five digits.
fn valid_port(port: &[u8]) -> bool {
    match port.split_first() {
        None => true,
        Some((b':', digits)) => digits.len() <= 5 && digits.iter().all(u8::is_ascii_digit),
        Some(_) => false,
    }
}

/// The bytes of a `Host` outside brackets: a registered name or IPv4 address (RFC 3986
/// `reg-name`: unreserved, pct-encoded, sub-delims) and the port's `:` and digits, as a table.
static HOST_BYTE: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'-' | b'.'
                    | b'_'
                    | b'~'
                    | b'%'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
                    | b':'
            );
        b += 1;
    }
    t
};

/// Request fields that say who the client is, where it came from or what it asked for, which
/// a client can write and some app or framework believes (`X-Real-IP`, `X-Original-URL`,
/// `X-HTTP-Method-Override`...), and every name with a `_` (CGI-style servers read
/// `X_Forwarded_For` as `X-Forwarded-For`): removed from every request before the rules see
/// it. `X-Forwarded-*` are not here: the proxy sets those itself.
pub fn is_client_claim(name: &str) -> bool {
    // A plain loop: names are short, and memchr's set-up costs more than it saves here. The
    // listed names all start with one of four letters: most fields are ruled out by that.
    name.bytes().any(|b| b == b'_')
        || matches!(name.as_bytes().first(), Some(b'c' | b'f' | b't' | b'x'))
            && matches!(
                name,
                "forwarded"
                    | "x-real-ip"
                    | "true-client-ip"
                    | "cf-connecting-ip"
                    | "fastly-client-ip"
                    | "x-client-ip"
                    | "x-cluster-client-ip"
                    | "x-original-url"
                    | "x-rewrite-url"
                    | "x-http-method-override"
                    | "x-http-method"
                    | "x-method-override"
            )
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

/// What extracting a key found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extract {
    Found,
    /// A part is absent: the rule does not apply to this request.
    Missing,
    /// A keyed header or query parameter appears more than once: frameworks disagree on which
    /// one wins, so the request is refused (400) rather than counted under either.
    Repeated,
}

/// The value of each part of `parts` for `req`, handed to `put` (with the part's index).
fn each_part(
    parts: &[KeyPart],
    req: &RequestView<'_>,
    mut put: impl FnMut(usize, Value<'_>),
) -> Extract {
    for (i, part) in parts.iter().enumerate() {
        match part {
            KeyPart::ClientIp => put(i, Value::Ip(req.client_ip)),
            KeyPart::ClientNet { v4, v6 } => put(
                i,
                Value::Ip(match req.client_addr {
                    IpAddr::V4(a) if v4.is_some() && !private_v4(a) => {
                        IpAddr::V4(mask_v4(a, v4.unwrap_or(32)))
                    }
                    IpAddr::V6(a) if v6.is_some() && !private_v6(a) => {
                        IpAddr::V6(mask_v6(a, v6.unwrap_or(128)))
                    }
                    // The configured prefix for the other family.
                    _ => req.client_ip,
                }),
            ),
            KeyPart::Header(name) => {
                let mut values = req.headers.get_all(name).iter();
                match (values.next(), values.next()) {
                    (None, _) => return Extract::Missing,
                    (Some(v), None) => put(i, Value::Private(v.as_bytes())),
                    (Some(_), Some(_)) => return Extract::Repeated,
                }
            }
            KeyPart::Query(name) => match query_param(req.uri.query(), name) {
                Param::Missing => return Extract::Missing,
                Param::Repeated => return Extract::Repeated,
                Param::One(v) => put(i, Value::Private(&crate::target::decode_query(v))),
            },
            KeyPart::Path => put(
                i,
                if req.strict_path {
                    Value::Bytes(req.path().as_bytes())
                } else {
                    Value::Folded(req.path().as_bytes())
                },
            ),
            KeyPart::Method => put(i, Value::Bytes(req.method.as_str().as_bytes())),
            // No host (HTTP/1.0): the app serves it all the same, so it is keyed as the empty
            // host rather than let past the rule.
            KeyPart::Host => put(i, Value::Folded(req.host().unwrap_or("").as_bytes())),
        }
    }
    Extract::Found
}

/// One part's value: bytes as they are, bytes compared without case, or an address; a
/// header's or query parameter's bytes are private (shown and sent as a digest).
enum Value<'a> {
    Bytes(&'a [u8]),
    Private(&'a [u8]),
    Folded(&'a [u8]),
    Ip(IpAddr),
}

/// Writes the key of `parts` for `req` into `out` (each part length-framed).
pub fn extract(parts: &[KeyPart], req: &RequestView<'_>, out: &mut KeyBuf) -> Extract {
    out.clear();
    each_part(parts, req, |_, v| match v {
        Value::Bytes(b) | Value::Private(b) => push(out, b),
        Value::Folded(b) => {
            out.extend_from_slice(&(b.len() as u32).to_le_bytes());
            out.extend(b.iter().map(u8::to_ascii_lowercase));
        }
        Value::Ip(ip) => match ip.to_canonical() {
            IpAddr::V4(v4) => push(out, &v4.octets()),
            IpAddr::V6(v6) => push(out, &v6.octets()),
        },
    })
}

/// Writes the text form of the key of `parts` for `req` into `out`: what global and redis
/// rules report and look up by. Parts are separated by U+001F, which no header value, path
/// or address holds (a decoded query value could: it is then one more part, still counted).
/// Bounded by [`canonical_text`] before use.
pub fn extract_text(parts: &[KeyPart], req: &RequestView<'_>, out: &mut KeyBuf) -> Extract {
    extract_shown(parts, req, |v, out| out.extend_from_slice(v), out)
}

/// A key as a store keeps it, written as [`extract_shown`] writes it from a request (each
/// private part by `digest`): for listing a store's keys without their requests. `local`: a
/// local rule's framed key ([`extract`], [`bound_local`]), else the text form. `None` for a
/// local key kept as its hash, or bytes that are not a key of `parts`.
pub fn shown_stored(
    parts: &[KeyPart],
    stored: &[u8],
    local: bool,
    digest: impl Fn(&[u8], &mut KeyBuf),
) -> Option<KeyBuf> {
    let mut values: SmallVec<[&[u8]; 4]> = SmallVec::new();
    if local {
        if stored.len() == 17 && stored[0] == HASHED {
            return None;
        }
        let mut rest = stored;
        while !rest.is_empty() {
            let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
            values.push(rest.get(4..4 + len)?);
            rest = &rest[4 + len..];
        }
    } else {
        values.extend(stored.split(|&b| b == 0x1f));
    }
    if values.len() != parts.len() {
        return None;
    }
    let mut out = KeyBuf::new();
    for (i, (part, value)) in parts.iter().zip(values).enumerate() {
        if i > 0 {
            out.push(0x1f);
        }
        match part {
            KeyPart::Header(_) | KeyPart::Query(_) => digest(value, &mut out),
            KeyPart::ClientIp | KeyPart::ClientNet { .. } if local => {
                use std::io::Write;
                let ip = match value.len() {
                    4 => IpAddr::from(<[u8; 4]>::try_from(value).ok()?),
                    16 => IpAddr::from(<[u8; 16]>::try_from(value).ok()?),
                    _ => return None,
                };
                let _ = write!(out, "{ip}");
            }
            _ => out.extend_from_slice(value),
        }
    }
    canonical_text(&mut out);
    Some(out)
}

/// A key written as its parts' values (`overrides:`), in the form the rule's store keeps it:
/// `local`, a local rule's framed key ([`extract`], [`bound_local`]); else the text form
/// ([`extract_text`], [`canonical_text`]). An address is keyed as a request from it would be
/// (`client_ip` through `policy`, `client_ip/N` cut to N; a block is its first address); a
/// host and (unless `strict_path`) a path compare without case. When a private part is written
/// as its digest (`~` and 32 hex digits, what `spillway digest` prints) every private part
/// must be, and the key is returned in its shown form ([`extract_shown`]) with `true`.
pub fn written_key(
    parts: &[KeyPart],
    values: &[String],
    local: bool,
    (policy, strict_path): (&ClientIpPolicy, bool),
) -> Result<(KeyBuf, bool), String> {
    use std::io::Write;
    if values.len() != parts.len() {
        return Err(format!(
            "the rule's key has {} part{} ({}); write {}",
            parts.len(),
            if parts.len() == 1 { "" } else { "s" },
            parts
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            if parts.len() == 1 {
                "one value".to_string()
            } else {
                format!("a list of {} values in that order", parts.len())
            }
        ));
    }
    let is_digest = |v: &str| {
        v.len() == 33
            && v.as_bytes()[0] == DIGEST_MARK
            && v[1..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut private: SmallVec<[bool; 4]> = SmallVec::new();
    for (p, v) in parts.iter().zip(values) {
        if !matches!(p, KeyPart::Header(_) | KeyPart::Query(_)) {
            continue;
        }
        // A mistyped digest read as a value would be a key any reader of the logs could send.
        if v.starts_with('~') && !is_digest(v) {
            return Err(format!(
                "{v:?}: a value starting with ~ is read as a digest: ~ and 32 lower-case hex digits (spillway digest)"
            ));
        }
        private.push(is_digest(v));
    }
    let shown = private.iter().any(|d| *d);
    if shown && !private.iter().all(|d| *d) {
        return Err(
            "write every header: and query: part of a key as its digest (~...) or none of them"
                .into(),
        );
    }
    let text = shown || !local;
    let mut out = KeyBuf::new();
    for (i, (part, value)) in parts.iter().zip(values).enumerate() {
        // An address as the key holds it: text, or its octets in a local key.
        let ip_bytes = |ip: IpAddr| {
            let mut b = KeyBuf::new();
            match (text, ip) {
                (true, ip) => {
                    let _ = write!(b, "{ip}");
                }
                (false, IpAddr::V4(v4)) => b.extend_from_slice(&v4.octets()),
                (false, IpAddr::V6(v6)) => b.extend_from_slice(&v6.octets()),
            }
            b
        };
        // An address, and the prefix written after it, if any.
        let addr = |v: &str| -> Result<(IpAddr, Option<u8>), String> {
            let v = v.trim();
            let (ip, len) = match v.split_once('/') {
                Some((a, n)) => (
                    a,
                    Some(
                        n.parse::<u8>()
                            .map_err(|_| format!("{v:?}: not a prefix length"))?,
                    ),
                ),
                None => (v, None),
            };
            ip.parse::<IpAddr>()
                .map(|ip| (policy.unwrapped(ip.to_canonical()), len))
                .map_err(|_| format!("{v:?}: {part} is an address"))
        };
        let bytes: KeyBuf = match part {
            KeyPart::ClientIp => {
                let (ip, len) = addr(value)?;
                if len.is_some() {
                    return Err(format!(
                        "{value:?}: client_ip keys one client: write its address (client_ip/N keys a block)"
                    ));
                }
                let ip = policy.cut(ip);
                ip_bytes(ip)
            }
            KeyPart::ClientNet { v4, v6 } => {
                let (ip, len) = addr(value)?;
                let ip = match ip {
                    IpAddr::V4(a) if v4.is_some() && !private_v4(a) => {
                        IpAddr::V4(mask_v4(a, v4.unwrap_or(32)))
                    }
                    IpAddr::V6(a) if v6.is_some() && !private_v6(a) => {
                        IpAddr::V6(mask_v6(a, v6.unwrap_or(128)))
                    }
                    other => policy.cut(other),
                };
                // A block of another size than the key's would name a part of a key, or many.
                let keyed = match ip {
                    IpAddr::V4(a) if private_v4(a) => 32,
                    IpAddr::V6(a) if private_v6(a) => 128,
                    IpAddr::V4(_) => v4.unwrap_or(policy.ipv4_prefix),
                    IpAddr::V6(_) => v6.unwrap_or(policy.ipv6_prefix),
                };
                if len.is_some_and(|n| n != keyed) {
                    return Err(format!(
                        "{value:?}: {part} keys this address's /{keyed}: write that block, or an address in it"
                    ));
                }
                ip_bytes(ip)
            }
            KeyPart::Host => {
                // As a request's host is keyed: no port, no trailing dot.
                let host = value.strip_suffix('.').unwrap_or(value);
                if host.contains(':') && !host.starts_with('[') {
                    return Err(format!("{value:?}: a host is written without its port"));
                }
                KeyBuf::from_iter(host.bytes().map(|b| b.to_ascii_lowercase()))
            }
            KeyPart::Path if !strict_path => KeyBuf::from_iter(
                crate::target::match_form(value)
                    .bytes()
                    .map(|b| b.to_ascii_lowercase()),
            ),
            KeyPart::Method => {
                if http::Method::from_bytes(value.as_bytes()).is_err()
                    || value.bytes().any(|b| b.is_ascii_lowercase())
                {
                    return Err(format!(
                        "{value:?}: not a method (they are upper case: GET)"
                    ));
                }
                KeyBuf::from_slice(value.as_bytes())
            }
            _ => KeyBuf::from_slice(value.as_bytes()),
        };
        if text {
            if i > 0 {
                out.push(0x1f);
            }
            out.extend_from_slice(&bytes);
        } else {
            push(&mut out, &bytes);
        }
    }
    if text {
        canonical_text(&mut out);
    } else {
        bound_local(&mut out);
    }
    Ok((out, shown))
}

/// Whether a key of `parts` has a private part (a `header:` or `query:` value).
pub fn has_private(parts: &[KeyPart]) -> bool {
    parts
        .iter()
        .any(|p| matches!(p, KeyPart::Header(_) | KeyPart::Query(_)))
}

/// [`extract_text`], each private part written by `digest` instead (see `crate::digest`):
/// the form a key is logged and reported in. Not for a known key's decision.
pub fn extract_shown(
    parts: &[KeyPart],
    req: &RequestView<'_>,
    digest: impl Fn(&[u8], &mut KeyBuf),
    out: &mut KeyBuf,
) -> Extract {
    use std::io::Write;
    out.clear();
    each_part(parts, req, |i, v| {
        if i > 0 {
            out.push(0x1f);
        }
        match v {
            Value::Bytes(b) => out.extend_from_slice(b),
            Value::Private(b) => digest(b, out),
            Value::Folded(b) => out.extend(b.iter().map(u8::to_ascii_lowercase)),
            Value::Ip(ip) => {
                let _ = write!(out, "{ip}");
            }
        }
    })
}

/// Marks a digested part in a key's text form (`crate::digest` writes it; here, so that keys
/// need not import the digest).
pub const DIGEST_MARK: u8 = b'~';

/// Keys of a local rule up to this many bytes are kept as they are.
pub const INLINE_KEY: usize = 64;

/// Marks a hashed local key: a framed key of 17 bytes starts with a part length below 17.
const HASHED: u8 = 0xff;

/// Bounds a local key: past [`INLINE_KEY`] bytes it becomes `HASHED` and a 128-bit SipHash
/// of it under this process's random secret, so that a flood of long keys costs 17 bytes each
/// and no client can aim two keys at one hash without knowing the secret.
// Always: the request path's key_of is the caller that counts (an override's key is another).
#[inline(always)]
pub fn bound_local(key: &mut KeyBuf) {
    if key.len() <= INLINE_KEY {
        return;
    }
    let (k0, k1) = *secret();
    let mut h = siphasher::sip128::SipHasher13::new_with_keys(k0, k1);
    h.write(key);
    let digest = siphasher::sip128::Hasher128::finish128(&h).as_bytes();
    key.clear();
    key.push(HASHED);
    key.extend_from_slice(&digest);
}

/// This process's secret for [`bound_local`], drawn once.
fn secret() -> &'static (u64, u64) {
    static SECRET: OnceLock<(u64, u64)> = OnceLock::new();
    SECRET.get_or_init(|| {
        // Seeded from the OS by std's RandomState (no extra dependency): two independent draws.
        use std::hash::{BuildHasher, RandomState};
        let draw = || RandomState::new().build_hasher().finish();
        (draw(), draw())
    })
}

/// The one form a global or redis key takes in every proxy and in the control plane: UTF-8
/// of up to [`INLINE_KEY`] bytes as it is; anything longer, or not UTF-8, `sha256:` and the
/// hex digest of its bytes (the same in every process, unlike [`bound_local`]).
#[inline]
pub fn canonical_text(key: &mut KeyBuf) {
    if key.len() <= INLINE_KEY && std::str::from_utf8(key).is_ok() {
        return;
    }
    let digest = sha2::Sha256::digest(&key[..]);
    key.clear();
    key.extend_from_slice(b"sha256:");
    push_hex(key, &digest);
}

/// [`canonical_text`] of a key received as text (a report of another proxy's).
pub fn canonical_key(key: &str) -> Cow<'_, str> {
    if key.len() <= INLINE_KEY {
        return Cow::Borrowed(key);
    }
    if key.len() == 71
        && key.starts_with("sha256:")
        && key[7..]
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    {
        return Cow::Borrowed(key);
    }
    let mut buf = KeyBuf::from_slice(key.as_bytes());
    canonical_text(&mut buf);
    Cow::Owned(String::from_utf8_lossy(&buf).into_owned())
}

/// Appends `bytes` in lower-case hex.
pub fn push_hex(out: &mut KeyBuf, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(HEX[usize::from(b >> 4)]);
        out.push(HEX[usize::from(b & 15)]);
    }
}

use sha2::Digest as _;

#[inline]
fn push(out: &mut KeyBuf, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// A query parameter's raw value, if it appears once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param<'a> {
    Missing,
    One(&'a str),
    Repeated,
}

/// The raw value of the `name` parameter in a query string; names compare decoded. Pairs are
/// split at `&` and at `;` (which some frameworks also split at), so `?x=1;user=a` keys `a`.
pub fn query_param<'a>(query: Option<&'a str>, name: &str) -> Param<'a> {
    let Some(query) = query else {
        return Param::Missing;
    };
    let mut found = Param::Missing;
    for pair in query.split(['&', ';']) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == name || crate::target::decodes_to(k, name.as_bytes()) {
            if found != Param::Missing {
                return Param::Repeated;
            }
            found = Param::One(v);
        }
    }
    found
}

/// The client an address stands for, for per-client bounds (connections, a shared limit's
/// parts): IPv4 whole, IPv6 by its /64 (what one host is given).
pub fn client_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(mask_v6(v6, 64)),
        v4 => v4,
    }
}

/// An address block: `10.0.0.0/8`, `2001:db8::/32`, or one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    pub fn is_v6(&self) -> bool {
        self.addr.is_ipv6()
    }

    /// Whether every address in the block is private, loopback, link-local or shared (the
    /// addresses of a cluster and its network, never of a client on the internet).
    pub fn is_private(&self) -> bool {
        match self.addr {
            IpAddr::V4(v4) => {
                let inside = |net: [u8; 4], len: u8| {
                    self.prefix >= len && mask_v4(v4, len) == Ipv4Addr::from(net)
                };
                inside([10, 0, 0, 0], 8)
                    || inside([172, 16, 0, 0], 12)
                    || inside([192, 168, 0, 0], 16)
                    || inside([127, 0, 0, 0], 8)
                    || inside([169, 254, 0, 0], 16)
                    || inside([100, 64, 0, 0], 10)
            }
            IpAddr::V6(v6) => {
                let inside =
                    |net: u128, len: u8| self.prefix >= len && u128::from(mask_v6(v6, len)) == net;
                inside(1, 128) || inside(0xfc00 << 112, 7) || inside(0xfe80 << 112, 10)
            }
        }
    }
}

impl Cidr {
    /// Whether `ip` (canonical: IPv4-mapped IPv6 as IPv4) is in the block.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => mask_v4(ip, self.prefix) == net,
            (IpAddr::V6(net), IpAddr::V6(ip)) => mask_v6(ip, self.prefix) == net,
            _ => false,
        }
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("{s:?}: not an address or CIDR block (10.0.0.0/8, fd00::/8)"))?;
        let addr = addr.to_canonical();
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => match p.trim().parse::<u8>() {
                Ok(p) if p <= max => p,
                _ => return Err(format!("{s:?}: the prefix length must be 0 to {max}")),
            },
        };
        let net = match addr {
            IpAddr::V4(v4) => IpAddr::V4(mask_v4(v4, prefix)),
            IpAddr::V6(v6) => IpAddr::V6(mask_v6(v6, prefix)),
        };
        if net != addr {
            return Err(format!(
                "{s:?}: has bits set past its prefix; did you mean {net}/{prefix}?"
            ));
        }
        Ok(Cidr { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

fn mask_v4(ip: Ipv4Addr, prefix: u8) -> Ipv4Addr {
    let bits = u32::from(ip);
    let mask = u32::MAX
        .checked_shl(32 - u32::from(prefix.min(32)))
        .unwrap_or(0);
    Ipv4Addr::from(bits & mask)
}

fn mask_v6(ip: Ipv6Addr, prefix: u8) -> Ipv6Addr {
    let bits = u128::from(ip);
    let mask = u128::MAX
        .checked_shl(128 - u32::from(prefix.min(128)))
        .unwrap_or(0);
    Ipv6Addr::from(bits & mask)
}

/// Who the client is: the socket peer, or, when the peer is a listed proxy, the first
/// `X-Forwarded-For` entry from the right that is not (nginx's `set_real_ip_from` with
/// `real_ip_recursive on`), walking at most `max_hops` entries. Then keyed by prefix: public
/// IPv6 by its /`ipv6_prefix` (a host has a /64 to pick from), IPv4 by /`ipv4_prefix`;
/// private, unique-local, link-local and loopback addresses (callers in the cluster) whole.
#[derive(Debug, Clone)]
pub struct ClientIpPolicy {
    pub proxies: Vec<Cidr>,
    pub max_hops: usize,
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
    /// NAT64 prefixes (RFC 6052 lengths): an address in one is its IPv4 client.
    pub nat64: Vec<Cidr>,
}

impl Default for ClientIpPolicy {
    fn default() -> Self {
        ClientIpPolicy {
            proxies: Vec::new(),
            max_hops: usize::MAX,
            ipv4_prefix: 32,
            ipv6_prefix: 64,
            nat64: vec![WELL_KNOWN_NAT64],
        }
    }
}

/// `64:ff9b::/96` (RFC 6052).
pub const WELL_KNOWN_NAT64: Cidr = Cidr {
    addr: IpAddr::V6(Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0)),
    prefix: 96,
};

/// The prefix lengths RFC 6052 embeds an IPv4 address after.
pub const NAT64_LENGTHS: [u8; 6] = [32, 40, 48, 56, 64, 96];

/// Who a request's client is: its address with any IPv4 inside taken out, and that cut to
/// the configured prefixes (what `client_ip` keys by).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Client {
    pub addr: IpAddr,
    pub keyed: IpAddr,
}

impl ClientIpPolicy {
    /// Whether the socket peer is a listed proxy (whose forwarded fields and costs count).
    #[inline]
    pub fn trusts(&self, peer: IpAddr) -> bool {
        !self.proxies.is_empty() && self.proxies.iter().any(|c| c.contains(peer))
    }

    /// The client's address as rules key it.
    pub fn client(&self, headers: &HeaderMap, peer: IpAddr) -> IpAddr {
        self.who(headers, peer).keyed
    }

    /// The client's address, and as `client_ip` keys it.
    #[inline]
    pub fn who(&self, headers: &HeaderMap, peer: IpAddr) -> Client {
        let mut client = peer.to_canonical();
        if self.trusts(client) && self.max_hops > 0 {
            client = self.walk(headers, client);
        }
        let addr = self.unwrapped(client);
        Client {
            addr,
            keyed: self.cut(addr),
        }
    }

    /// The first untrusted address from the right of `X-Forwarded-For`; an entry that is not
    /// an address ends the walk at the last trusted one.
    fn walk(&self, headers: &HeaderMap, peer: IpAddr) -> IpAddr {
        let mut client = peer;
        let mut walked = 0usize;
        // Several X-Forwarded-For lines form one list in order; walk it from the right.
        let values: SmallVec<[&[u8]; 4]> = headers
            .get_all(http::header::HeaderName::from_static("x-forwarded-for"))
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        for value in values.iter().rev() {
            for entry in value.rsplit(|&b| b == b',') {
                if walked == self.max_hops {
                    return client;
                }
                walked += 1;
                let Some(ip) = parse_forwarded_ip(entry) else {
                    return client;
                };
                client = ip.to_canonical();
                if !self.trusts(client) {
                    return client;
                }
            }
        }
        client
    }

    /// `ip` cut to the prefix it is keyed by (see [`Self::unwrapped`]).
    pub fn keyed(&self, ip: IpAddr) -> IpAddr {
        self.cut(self.unwrapped(ip))
    }

    /// The IPv4 client inside an IPv6 address that carries one, else `ip`: NAT64 (the listed
    /// prefixes; else all of a gateway's clients share its /64), 6to4 (`2002::/16`, else each
    /// IPv4 address has a /48 of keys) and Teredo (`2001::/32`, else a relay's clients share
    /// one /64).
    // Always: `who`, per request, is the caller that counts (an override's key is another).
    #[inline(always)]
    pub fn unwrapped(&self, ip: IpAddr) -> IpAddr {
        let IpAddr::V6(v6) = ip else { return ip };
        let o = v6.octets();
        let v4 = |a: u8, b: u8, c: u8, d: u8| IpAddr::V4(Ipv4Addr::new(a, b, c, d));
        if o[0] == 0x20 && o[1] == 0x02 {
            return v4(o[2], o[3], o[4], o[5]);
        }
        if o[..4] == [0x20, 0x01, 0, 0] {
            return v4(!o[12], !o[13], !o[14], !o[15]);
        }
        for net in &self.nat64 {
            if net.contains(ip) {
                // RFC 6052 §2.2: the IPv4 bits follow the prefix, skipping bits 64-71.
                let at: [usize; 4] = match net.prefix {
                    32 => [4, 5, 6, 7],
                    40 => [5, 6, 7, 9],
                    48 => [6, 7, 9, 10],
                    56 => [7, 9, 10, 11],
                    64 => [9, 10, 11, 12],
                    _ => [12, 13, 14, 15],
                };
                return v4(o[at[0]], o[at[1]], o[at[2]], o[at[3]]);
            }
        }
        ip
    }

    /// `ip` cut to the configured prefixes; private addresses whole.
    #[inline]
    pub fn cut(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(v4) if !private_v4(v4) => IpAddr::V4(mask_v4(v4, self.ipv4_prefix)),
            IpAddr::V6(v6) if !private_v6(v6) => IpAddr::V6(mask_v6(v6, self.ipv6_prefix)),
            other => other,
        }
    }
}

fn private_v4(ip: Ipv4Addr) -> bool {
    ip.is_private() || ip.is_loopback() || ip.is_link_local() || ip.is_unspecified()
        // 100.64.0.0/10, shared address space (carrier NAT, some clusters' pod ranges).
        || (ip.octets()[0] == 100 && ip.octets()[1] & 0xc0 == 64)
}

fn private_v6(ip: Ipv6Addr) -> bool {
    let first = ip.segments()[0];
    ip.is_loopback()
        || ip.is_unspecified()
        || first & 0xfe00 == 0xfc00 // unique local, fc00::/7
        || first & 0xffc0 == 0xfe80 // link local, fe80::/10
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
pub(crate) mod tests;
