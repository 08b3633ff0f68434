//! The fields a hop adds to a request: `Host` when it has none, `X-Forwarded-For`, `-Proto`
//! and `-Host`, found in one pass over the client's fields.
//!
//! Owns what the app is told about the client and how it is written. Must never: keep a
//! client's own `X-Forwarded-*` from a peer that is not a trusted proxy, or allocate for a
//! list that fits inline.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

use crate::hop::{hop_by_hop, listed, strip_hop_by_hop};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The headers a hop sets on a request: `Host` when it has none, `X-Forwarded-For` (the
/// client's lines folded, the peer appended), `X-Forwarded-Proto` and `-Host` (the client's
/// kept only from a trusted hop). Found in one pass over the client's headers, then either
/// written into them (the pooled client) or written after those that go on (`h1`).
pub struct Added {
    host: Option<HeaderValue>,
    /// Kept inline: the client's list and the peer's address fit in most cases, and the
    /// value is only written out (a `HeaderValue` of it is made for the pooled client).
    forwarded_for: SmallVec<[u8; FORWARDED_FOR_INLINE]>,
    proto: Option<HeaderValue>,
    forwarded_host: Option<HeaderValue>,
    /// The names the client's `Connection` lists: those fields do not go on.
    listed: SmallVec<[HeaderName; 1]>,
    /// The client's `X-Forwarded-*` come from a trusted hop.
    trusted: bool,
    /// `Connection: close` goes upstream, and the connection is not reused after the answer.
    pub close: bool,
    /// The listed protocol the request asks to switch to, when it may: `Upgrade` and
    /// `Connection: upgrade` go upstream (not `close`), and the connection is the tunnel's or,
    /// unswitched, not reused.
    pub upgrade: Option<&'static str>,
    /// A body still coming tells its progress here, for the exchange's deadlines.
    pub progress: Option<std::sync::Arc<super::body::Progress>>,
    /// The request's id, sent as `x-request-id` (`request_id.forward`; the client's field of
    /// that name is taken out of the request before). Boxed: most proxies send none, and this
    /// is moved with every request.
    pub request_id: Option<Box<crate::ids::IdText>>,
}

/// Bytes of `X-Forwarded-For` kept in [`Added`] without an allocation.
const FORWARDED_FOR_INLINE: usize = 48;

impl Added {
    /// `authority`: the request target's, if absolute (or HTTP/2's `:authority`), the `Host`
    /// when the client sent none; else `default_host`.
    pub fn of(
        headers: &HeaderMap,
        authority: Option<&http::uri::Authority>,
        default_host: Option<&http::uri::Authority>,
        peer: IpAddr,
        trust_forwarded: bool,
    ) -> Added {
        let (mut host, mut proto, mut forwarded_host) = (None, false, false);
        let mut connection = SmallVec::<[&HeaderValue; 1]>::new();
        let mut forwarded_for = SmallVec::new();
        for (name, value) in headers {
            if name == header::HOST {
                host = host.or(Some(value));
            } else if name == header::CONNECTION {
                connection.push(value);
            } else if name == X_FORWARDED_FOR {
                if value.to_str().is_ok() {
                    forwarded_for.extend_from_slice(value.as_bytes());
                    forwarded_for.extend_from_slice(b", ");
                }
            } else if name == X_FORWARDED_PROTO {
                proto = true;
            } else if name == X_FORWARDED_HOST {
                forwarded_host = true;
            }
        }
        let listed: SmallVec<[HeaderName; 1]> = listed(connection.iter().map(|v| v.as_bytes()))
            .into_iter()
            .filter_map(|t| HeaderName::from_bytes(t).ok())
            .collect();
        // What the client's `Connection` names is gone before the hop's fields are worked
        // out (`Connection: X-Forwarded-For` drops the client's list, as stripping first did).
        if !listed.is_empty() {
            let named = |n: &HeaderName| listed.contains(n);
            host = host.filter(|_| !named(&header::HOST));
            if named(&X_FORWARDED_FOR) {
                forwarded_for.clear();
            }
            proto &= !named(&X_FORWARDED_PROTO);
            forwarded_host &= !named(&X_FORWARDED_HOST);
        }
        // A client's own list would be believed by an app that reads its leftmost entry: only a
        // listed proxy's is kept; anyone else's is replaced by the address it came from.
        if !trust_forwarded {
            forwarded_for.clear();
        }
        put_address(&mut forwarded_for, peer);
        let added_host = match host {
            Some(_) => None,
            None => authority
                .or(default_host)
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok()),
        };
        let forwarded_host = (!trust_forwarded || !forwarded_host)
            .then(|| host.or(added_host.as_ref()).cloned())
            .flatten();
        Added {
            host: added_host,
            forwarded_for,
            proto: (!trust_forwarded || !proto).then(|| HeaderValue::from_static("http")),
            forwarded_host,
            listed,
            trusted: trust_forwarded,
            close: false,
            upgrade: None,
            progress: None,
            request_id: None,
        }
    }

    /// Rewrites `headers` in place for the pooled (HTTP/2) client: the connection's own
    /// fields go, the hop's are set.
    pub fn apply(&self, headers: &mut HeaderMap) {
        strip_hop_by_hop(headers);
        for (name, value) in self.fields() {
            // Made of visible ASCII only (the client's values that are text, and an address).
            if let Ok(value) = HeaderValue::from_bytes(value) {
                headers.insert(name.clone(), value);
            }
        }
        if !self.trusted && self.forwarded_host.is_none() {
            headers.remove(&X_FORWARDED_HOST);
        }
    }

    /// The headers set, each replacing the client's of that name.
    pub fn fields(&self) -> impl Iterator<Item = (&HeaderName, &[u8])> {
        let close = self.close.then_some((&header::CONNECTION, &b"close"[..]));
        self.set().chain(close)
    }

    /// The end-to-end headers set (`Connection: close`, when set, is the hop's own), the
    /// request's id among them when it is sent.
    pub fn set(&self) -> impl Iterator<Item = (&HeaderName, &[u8])> {
        self.hop_set().chain(
            self.request_id
                .as_deref()
                .map(|id| (&crate::ids::X_REQUEST_ID, id.as_bytes())),
        )
    }

    /// [`Self::set`] but the request's id (written apart: most requests send none).
    pub fn hop_set(&self) -> impl Iterator<Item = (&HeaderName, &[u8])> {
        fn value(v: &Option<HeaderValue>) -> Option<&[u8]> {
            v.as_ref().map(HeaderValue::as_bytes)
        }
        [
            (&header::HOST, value(&self.host)),
            (&X_FORWARDED_FOR, Some(&self.forwarded_for[..])),
            (&X_FORWARDED_PROTO, value(&self.proto)),
            (&X_FORWARDED_HOST, value(&self.forwarded_host)),
        ]
        .into_iter()
        .filter_map(|(name, value)| value.map(|v| (name, v)))
    }

    /// Whether the client's header `name` goes on: not one of the connection's own, not one set here, no `X-Forwarded-Host` from
    /// an untrusted client (one without any host to replace it with goes too).
    pub fn passes(&self, name: &HeaderName) -> bool {
        !hop_by_hop(name)
            && !self.listed.contains(name)
            && self.hop_set().all(|(set, _)| set != name)
            && (self.trusted || name != X_FORWARDED_HOST)
    }
}

/// Writes `peer` as std writes it (an IPv4-mapped address as IPv4).
fn put_address(value: &mut SmallVec<[u8; FORWARDED_FOR_INLINE]>, peer: IpAddr) {
    use std::io::Write;
    match peer.to_canonical() {
        // By hand: core's formatting of an address costs ten times as much.
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    value.push(b'.');
                }
                put_decimal(value, octet);
            }
        }
        v6 => {
            let _ = write!(value, "{v6}");
        }
    }
}

/// `n` in decimal, without leading zeros.
fn put_decimal(out: &mut SmallVec<[u8; FORWARDED_FOR_INLINE]>, n: u8) {
    if n >= 100 {
        out.push(b'0' + n / 100);
    }
    if n >= 10 {
        out.push(b'0' + n / 10 % 10);
    }
    out.push(b'0' + n % 10);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn added(h: &HeaderMap, trust: bool) -> Added {
        Added::of(h, None, None, "::ffff:10.0.0.1".parse().unwrap(), trust)
    }

    #[test]
    fn forwarded_for_lines_fold_and_the_peer_is_appended() {
        let mut h = HeaderMap::new();
        h.append(&X_FORWARDED_FOR, "1.1.1.1".parse().unwrap());
        h.append(&X_FORWARDED_FOR, "2.2.2.2".parse().unwrap());
        let a = added(&h, true);
        assert_eq!(&a.forwarded_for[..], b"1.1.1.1, 2.2.2.2, 10.0.0.1");
        // From a peer that is not a listed proxy, the list is the peer alone.
        assert_eq!(&added(&h, false).forwarded_for[..], b"10.0.0.1");
        assert!(
            !a.passes(&X_FORWARDED_FOR),
            "the client's lines are replaced"
        );
    }

    #[test]
    fn a_forwarded_for_list_longer_than_kept_inline_is_whole() {
        let long = (1..=12)
            .map(|i| format!("10.0.{i}.{i}"))
            .collect::<Vec<_>>()
            .join(", ");
        assert!(long.len() > FORWARDED_FOR_INLINE);
        let mut h = HeaderMap::new();
        h.append(&X_FORWARDED_FOR, long.parse().unwrap());
        let a = added(&h, true);
        assert_eq!(&a.forwarded_for[..], format!("{long}, 10.0.0.1").as_bytes());
        let mut rewritten = h.clone();
        a.apply(&mut rewritten);
        assert_eq!(rewritten[&X_FORWARDED_FOR], format!("{long}, 10.0.0.1"));
    }

    /// The headers the upstream gets, as the pooled client sends them (rewritten in place)
    /// and as `h1` writes them (the client's that pass, then the added): the same.
    fn both_ways(h: &HeaderMap, authority: Option<&str>, trust: bool) -> Vec<(String, String)> {
        let authority: Option<http::uri::Authority> = authority.map(|a| a.parse().unwrap());
        let peer: IpAddr = "192.0.2.7".parse().unwrap();
        let a = Added::of(h, None, authority.as_ref(), peer, trust);
        let mut rewritten = h.clone();
        a.apply(&mut rewritten);
        let written = h
            .iter()
            .filter(|(name, _)| a.passes(name))
            .map(|(n, v)| (n, v.as_bytes()))
            .chain(a.fields());
        let sorted = |it: &mut dyn Iterator<Item = (&HeaderName, &[u8])>| {
            let mut v: Vec<(String, String)> = it
                .map(|(n, v)| (n.to_string(), String::from_utf8(v.to_vec()).unwrap()))
                .collect();
            v.sort();
            v
        };
        let (left, right) = (
            sorted(&mut rewritten.iter().map(|(n, v)| (n, v.as_bytes()))),
            sorted(&mut written.into_iter()),
        );
        assert_eq!(left, right, "rewritten vs written, from {h:?}");
        left
    }

    #[test]
    fn the_pooled_client_and_the_own_connection_send_the_same_headers() {
        let plain = crate::key::tests::headers(&[("host", "shop"), ("x-client", "c1")]);
        let sent = both_ways(&plain, None, false);
        assert!(sent.contains(&("x-forwarded-for".into(), "192.0.2.7".into())));
        assert!(sent.contains(&("x-forwarded-host".into(), "shop".into())));
        assert!(sent.contains(&("x-forwarded-proto".into(), "http".into())));
        assert_eq!(sent.len(), 5);

        let busy = crate::key::tests::headers(&[
            ("connection", "keep-alive, X-Secret"),
            ("x-secret", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic Zm9v"),
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-for", "2.2.2.2, 3.3.3.3"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "front"),
            ("x-kept", "a"),
            ("x-kept", "b"),
        ]);
        for trust in [false, true] {
            let sent = both_ways(&busy, Some("app:8080"), trust);
            let proto = if trust { "https" } else { "http" };
            let fhost = if trust { "front" } else { "app:8080" };
            let xff = if trust {
                "1.1.1.1, 2.2.2.2, 3.3.3.3, 192.0.2.7"
            } else {
                "192.0.2.7"
            };
            let mut want: Vec<(String, String)> = [
                ("host", "app:8080"),
                ("x-forwarded-for", xff),
                ("x-forwarded-proto", proto),
                ("x-forwarded-host", fhost),
                ("x-kept", "a"),
                ("x-kept", "b"),
            ]
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
            want.sort();
            assert_eq!(sent, want, "trusted: {trust}");
        }

        // `Connection: close` names an option, and a field called so (were there one) goes
        // the same way on both paths.
        let closing = crate::key::tests::headers(&[
            ("host", "shop"),
            ("connection", "close"),
            ("close", "x"),
        ]);
        let sent = both_ways(&closing, None, false);
        assert!(
            sent.iter().all(|(n, _)| n != "close" && n != "connection"),
            "{sent:?}"
        );

        // A field the client's `Connection` names is gone before the hop's are worked out.
        let named = crate::key::tests::headers(&[
            ("host", "shop"),
            ("connection", "X-Forwarded-For, x-forwarded-proto"),
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-proto", "https"),
        ]);
        for trust in [false, true] {
            let sent = both_ways(&named, None, trust);
            assert!(sent.contains(&("x-forwarded-for".into(), "192.0.2.7".into())));
            assert!(sent.contains(&("x-forwarded-proto".into(), "http".into())));
        }

        // No host to say (an HTTP/1.0 request without `Host` through the pool): an untrusted
        // client's X-Forwarded-Host does not go on for want of one.
        let hostless = crate::key::tests::headers(&[("x-forwarded-host", "evil")]);
        let names =
            |sent: Vec<(String, String)>| sent.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        assert_eq!(
            names(both_ways(&hostless, None, false)),
            ["x-forwarded-for", "x-forwarded-proto"]
        );
        assert!(names(both_ways(&hostless, None, true)).contains(&"x-forwarded-host".to_string()));
    }

    #[test]
    fn a_keep_alive_response_loses_its_connection_header_and_nothing_else() {
        let mut h = HeaderMap::new();
        h.insert(header::SERVER, "nginx".parse().unwrap());
        h.insert(header::CONTENT_LENGTH, "3".parse().unwrap());
        h.insert(header::CONNECTION, "Keep-Alive".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 2, "{h:?}");
        assert!(h.contains_key(header::SERVER) && h.contains_key(header::CONTENT_LENGTH));
    }

    #[test]
    fn the_peer_address_is_written_as_std_writes_it() {
        for peer in [
            "0.0.0.0",
            "9.10.99.100",
            "127.0.0.1",
            "255.255.255.255",
            "10.200.3.45",
            "::1",
            "2001:db8::8a2e:370:7334",
            "::ffff:192.168.0.1",
        ] {
            let ip: IpAddr = peer.parse().unwrap();
            let mut out = SmallVec::new();
            put_address(&mut out, ip);
            assert_eq!(&out[..], ip.to_canonical().to_string().as_bytes());
        }
        for n in 0..=255u8 {
            let mut out = SmallVec::new();
            put_decimal(&mut out, n);
            assert_eq!(&out[..], n.to_string().as_bytes());
        }
    }
}
