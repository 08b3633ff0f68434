//! What is checked and rewritten in a request before any rule sees it, by the sidecar and by
//! the tower layer alike: a method in capitals, one valid `Host`, one canonical path, no field
//! the app will not get, no client-written claim the app might believe, one `Cookie` line, a
//! host the app answers for.
//!
//! Owns those checks and which refusal each gives (its status, its `metrics::Reason`).
//! Must never: answer (the caller renders the refusal), or let a request the app would read
//! differently from the rules through.

use http::{Request, StatusCode};

use crate::config::Config;
use crate::key;
use crate::respond::{Reason, Refused};

/// What is checked and rewritten in a request before any rule sees it: a method in capitals,
/// one valid `Host`, one canonical path, no field the app will not get, no client-written
/// claim the app might believe.
pub struct Hygiene {
    /// Larger request heads (fields and target) are refused with 431 ([`Reason::HeaderTooLarge`]).
    max_header_bytes: usize,
    /// HTTP/1.1 needs its one `Host` (the sidecar; an embedding server frames its own).
    require_host: bool,
    normalize_path: bool,
    reject_separators: bool,
    pub(crate) strict_path: bool,
    pub(crate) upgrades: Vec<crate::config::UpgradeProtocol>,
    /// `bodies_on_get: reject`: a GET or HEAD with a body is answered 400.
    pub(crate) reject_get_bodies: bool,
    /// `hosts:`; empty, any host.
    hosts: Vec<crate::config::ServedHost>,
    /// `trusted_headers:`, removed unless the peer is a trusted proxy.
    trusted_headers: Vec<http::HeaderName>,
}

impl Default for Hygiene {
    /// The defaults of a configuration that says nothing, for the tower layer: the server
    /// that embeds it owns the framing, so a request without `Host` is its business.
    fn default() -> Self {
        Hygiene {
            max_header_bytes: usize::MAX,
            require_host: false,
            normalize_path: true,
            reject_separators: false,
            strict_path: false,
            upgrades: crate::config::default_upgrades(),
            reject_get_bodies: false,
            hosts: Vec::new(),
            trusted_headers: Vec::new(),
        }
    }
}

impl Hygiene {
    pub fn of(config: &Config) -> Self {
        Hygiene {
            max_header_bytes: config.limits.max_header_bytes.0,
            require_host: true,
            normalize_path: config.normalize_path,
            reject_separators: config.path_escapes == crate::config::PathEscapes::Reject,
            strict_path: config.path_match == crate::config::PathMatch::Strict,
            upgrades: config.upgrades.clone(),
            reject_get_bodies: config.bodies_on_get == crate::config::BodiesOnGet::Reject,
            hosts: config.hosts.clone(),
            trusted_headers: config.trusted_headers.iter().map(|h| h.0.clone()).collect(),
        }
    }

    /// Refuses a head over `max_header_bytes` ([`Reason::HeaderTooLarge`]: 431) and what is ambiguous (a
    /// method with lower-case letters; a missing, repeated or malformed `Host`; a `Connection`
    /// that names the body's length or `Host`; a path that cannot be normalised) with the
    /// `bad_requests` reason and a detail; rewrites the path to its canonical spelling; removes
    /// the fields the client's `Connection` names (the app would not get them: the rules must
    /// not see them either) and the client's claims ([`key::is_client_claim`]). Allocates only
    /// when it rewrites or refuses.
    pub fn apply<B>(&self, req: &mut Request<B>) -> Result<(), Refused> {
        // Methods are case-sensitive (RFC 9110 §9.1): `get` matches no `methods: [GET]`, but
        // many apps fold the case and serve it as GET. Refused, as nginx refuses it.
        // (GET and POST, most requests, are known to be spelled in capitals.)
        let method = req.method();
        if method != http::Method::GET
            && method != http::Method::POST
            && method.as_str().bytes().any(|b| b.is_ascii_lowercase())
        {
            return Err(Refused::closing(
                StatusCode::BAD_REQUEST,
                Reason::Method,
                "the method has lower-case letters; this proxy takes methods in capitals",
            ));
        }
        // One pass over the fields (standard names compare as enums), not a lookup for each;
        // it also sums the head's bytes as sent (name, ": ", value, CRLF per field).
        let (mut host, mut hosts, mut connection, mut claims) = (None, 0u32, false, false);
        let mut cookies = 0u32;
        // RFC 9113 §8.2.1: an HTTP/2 field value never starts or ends with a space or a tab.
        // An HTTP/1 app trims them, so `k` and `k ` would be one key to it and two to a rule.
        let h2 = req.version() == http::Version::HTTP_2;
        let mut padded = false;
        let mut bytes = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
        for (name, value) in req.headers() {
            bytes += name.as_str().len() + value.len() + 4;
            if h2 {
                let v = value.as_bytes();
                padded |= matches!(v.first(), Some(b' ' | b'\t'))
                    || matches!(v.last(), Some(b' ' | b'\t'));
            }
            if name == http::header::HOST {
                host = Some(value);
                hosts += 1;
            } else if name == http::header::CONNECTION {
                connection = true;
            } else if name == http::header::COOKIE {
                cookies += 1;
            } else if key::is_client_claim(name.as_str()) {
                claims = true;
            }
        }
        if bytes > self.max_header_bytes {
            return Err(Refused::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                Reason::HeaderTooLarge,
                "request headers are larger than this proxy accepts",
            ));
        }
        if padded {
            return Err(Refused::closing(
                StatusCode::BAD_REQUEST,
                Reason::Malformed,
                "an HTTP/2 field value starts or ends with whitespace (RFC 9113 8.2.1)",
            ));
        }
        match host {
            _ if hosts > 1 => {
                return Err(Refused::closing(
                    StatusCode::BAD_REQUEST,
                    Reason::Host,
                    "the request has more than one Host header",
                ));
            }
            None if self.require_host && req.version() == http::Version::HTTP_11 => {
                return Err(Refused::closing(
                    StatusCode::BAD_REQUEST,
                    Reason::Host,
                    "an HTTP/1.1 request must have a Host header",
                ));
            }
            None if self.require_host && h2 && req.uri().authority().is_none() => {
                return Err(Refused::closing(
                    StatusCode::BAD_REQUEST,
                    Reason::Host,
                    "an HTTP/2 request must have :authority or Host (RFC 9113 8.3.1)",
                ));
            }
            Some(h) if !key::valid_host(h.as_bytes()) => {
                return Err(Refused::closing(
                    StatusCode::BAD_REQUEST,
                    Reason::Host,
                    "the Host header is not a host and port",
                ));
            }
            _ => {}
        }
        if !self.hosts.is_empty() {
            // Absolute form names its host in the target (HTTP/1.0 may send no `Host`).
            let named = key::request_host(req.uri(), req.headers());
            if named.is_some_and(|h| !self.hosts.iter().any(|s| s.serves(h))) {
                return Err(Refused::new(
                    StatusCode::MISDIRECTED_REQUEST,
                    Reason::Misdirected,
                    "this service does not answer for the request's host",
                ));
            }
        }
        if self.normalize_path {
            match crate::target::canonical_uri(req.uri(), self.reject_separators) {
                Ok(Some(uri)) => *req.uri_mut() = uri,
                Ok(None) => {}
                Err(e) => {
                    return Err(
                        Refused::closing(StatusCode::BAD_REQUEST, Reason::Target, "")
                            .saying(e.to_string()),
                    )
                }
            }
        }
        if connection {
            drop_listed(req.headers_mut())?;
        }
        if cookies > 1 && req.version() == http::Version::HTTP_2 {
            join_cookies(req.headers_mut());
        }
        if claims {
            let names: Vec<http::HeaderName> = req
                .headers()
                .keys()
                .filter(|n| key::is_client_claim(n.as_str()))
                .cloned()
                .collect();
            for name in names {
                req.headers_mut().remove(name);
            }
        }
        Ok(())
    }
}

impl Hygiene {
    /// Removes the `trusted_headers` from a request whose peer is not a trusted proxy: a
    /// client must not name its own tier.
    pub fn untrusted<B>(&self, req: &mut Request<B>) {
        for name in &self.trusted_headers {
            req.headers_mut().remove(name);
        }
    }
}

/// Joins the `Cookie` fields of an HTTP/2 request into one, with `; ` (RFC 9113 §8.2.3): an
/// HTTP/1 app reads one `Cookie` line, and might read only the first or the last of several.
fn join_cookies(headers: &mut http::HeaderMap) {
    let mut joined = Vec::new();
    for value in headers.get_all(http::header::COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(value.as_bytes());
    }
    // Made of field values and "; ": a valid value.
    if let Ok(value) = http::HeaderValue::from_bytes(&joined) {
        headers.insert(http::header::COOKIE, value);
    }
}

/// Removes the fields `Connection` lists (beyond the hop-by-hop ones, `Transfer-Encoding`
/// among them, which [`crate::hop::listed`] leaves out and the hop removes anyway); refuses a
/// list that names `Content-Length` or `Host`, which would leave the app to frame the body
/// itself (a request smuggled inside it) or to guess the host.
fn drop_listed(headers: &mut http::HeaderMap) -> Result<(), Refused> {
    let values: smallvec::SmallVec<[http::HeaderValue; 2]> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .cloned()
        .collect();
    for token in crate::hop::listed(values.iter().map(http::HeaderValue::as_bytes)) {
        if token.eq_ignore_ascii_case(b"content-length") || token.eq_ignore_ascii_case(b"host") {
            return Err(Refused::closing(
                StatusCode::BAD_REQUEST,
                Reason::Connection,
                "the Connection header names a field the request cannot go without",
            ));
        }
        if let Ok(name) = std::str::from_utf8(token) {
            headers.remove(name);
        }
    }
    Ok(())
}
