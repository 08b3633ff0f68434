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

fn behind(proxies: &[&str]) -> ClientIpPolicy {
    ClientIpPolicy {
        proxies: proxies.iter().map(|c| c.parse().unwrap()).collect(),
        ..ClientIpPolicy::default()
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn without_listed_proxies_the_peer_is_the_client_whatever_the_header_says() {
    let h = headers(&[("x-forwarded-for", "1.1.1.1")]);
    assert_eq!(ClientIpPolicy::default().client(&h, PEER), PEER);
    // A listed block that does not hold the peer: the same.
    assert_eq!(behind(&["192.168.0.0/16"]).client(&h, PEER), PEER);
}

#[test]
fn a_listed_proxy_s_entries_are_walked_from_the_right_past_listed_addresses() {
    let h = headers(&[("x-forwarded-for", "6.6.6.6, 2.2.2.2, 10.0.0.7")]);
    assert_eq!(behind(&["10.0.0.0/8"]).client(&h, PEER), ip("2.2.2.2"));
    let mut two = behind(&["10.0.0.0/8"]);
    two.max_hops = 1;
    assert_eq!(two.client(&h, PEER), ip("10.0.0.7"));
}

#[test]
fn several_header_lines_form_one_list() {
    let h = headers(&[
        ("x-forwarded-for", "6.6.6.6"),
        ("x-forwarded-for", "3.3.3.3, 10.1.1.1"),
    ]);
    assert_eq!(behind(&["10.0.0.0/8"]).client(&h, PEER), ip("3.3.3.3"));
}

#[test]
fn garbage_stops_the_walk_at_the_last_listed_address() {
    let h = headers(&[("x-forwarded-for", "nonsense, 10.0.0.3")]);
    assert_eq!(behind(&["10.0.0.0/8"]).client(&h, PEER), ip("10.0.0.3"));
    assert_eq!(
        behind(&["10.0.0.0/8"]).client(&HeaderMap::new(), PEER),
        PEER
    );
}

#[test]
fn ipv4_mapped_addresses_are_tested_as_ipv4() {
    let h = headers(&[("x-forwarded-for", "::ffff:2.2.2.2")]);
    let mapped = ip("::ffff:10.0.0.9");
    assert_eq!(behind(&["10.0.0.0/8"]).client(&h, mapped), ip("2.2.2.2"));
}

#[test]
fn public_ipv6_is_keyed_by_its_64_and_private_addresses_whole() {
    let p = ClientIpPolicy::default();
    assert_eq!(p.keyed(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
    assert_eq!(p.keyed(ip("fd00::1:2")), ip("fd00::1:2"));
    assert_eq!(p.keyed(ip("fe80::1")), ip("fe80::1"));
    assert_eq!(p.keyed(ip("8.8.4.4")), ip("8.8.4.4"));
    // NAT64: the IPv4 client inside, not the gateway's /64.
    assert_eq!(p.keyed(ip("64:ff9b::808:404")), ip("8.8.4.4"));
    assert_eq!(p.keyed(ip("64:ff9b::101:101")), ip("1.1.1.1"));
    let p24 = ClientIpPolicy {
        ipv4_prefix: 24,
        ..ClientIpPolicy::default()
    };
    assert_eq!(p24.keyed(ip("8.8.4.4")), ip("8.8.4.0"));
    assert_eq!(p24.keyed(ip("10.1.2.3")), ip("10.1.2.3"));
}

#[test]
fn cidr_blocks_parse_and_refuse_host_bits() {
    assert!("10.0.0.0/8"
        .parse::<Cidr>()
        .unwrap()
        .contains(ip("10.9.9.9")));
    assert!(!"10.0.0.0/8"
        .parse::<Cidr>()
        .unwrap()
        .contains(ip("11.0.0.1")));
    assert!("::1".parse::<Cidr>().unwrap().contains(ip("::1")));
    assert!("0.0.0.0/0".parse::<Cidr>().unwrap().contains(ip("1.2.3.4")));
    assert!("10.0.0.1/8".parse::<Cidr>().is_err());
    assert!("10.0.0.0/33".parse::<Cidr>().is_err());
    assert!("example".parse::<Cidr>().is_err());
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
    assert_eq!(extract(&parts, &view(&m, &u, &h1), &mut k1), Extract::Found);
    assert_eq!(extract(&parts, &view(&m, &u, &h2), &mut k2), Extract::Found);
    assert_ne!(k1, k2);
}

#[test]
fn a_missing_part_means_the_rule_does_not_apply() {
    let parts = vec![KeyPart::ClientIp, KeyPart::Query("user".into())];
    let (m, h) = (Method::GET, HeaderMap::new());
    let u = Uri::from_static("/x?a=1&user=bob");
    let mut k = KeyBuf::new();
    assert_eq!(extract(&parts, &view(&m, &u, &h), &mut k), Extract::Found);
    let u = Uri::from_static("/x?a=1");
    assert_eq!(extract(&parts, &view(&m, &u, &h), &mut k), Extract::Missing);
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
    assert_eq!(
        extract_text(&parts, &view(&m, &u, &h), &mut k),
        Extract::Found
    );
    assert_eq!(&k[..], b"10.0.0.9\x1fabc");
    assert_eq!(
        extract_text(&parts, &view(&m, &u, &HeaderMap::new()), &mut k),
        Extract::Missing
    );
}

#[test]
fn host_is_taken_without_port_and_lower_cased() {
    let h = headers(&[("host", "API.Example.com:8080")]);
    let u = Uri::from_static("/");
    assert_eq!(request_host(&u, &h), Some("API.Example.com"));
    let mut k = KeyBuf::new();
    let m = Method::GET;
    assert_eq!(
        extract(&[KeyPart::Host], &view(&m, &u, &h), &mut k),
        Extract::Found
    );
    assert_eq!(&k[4..], b"api.example.com");
    let u2 = Uri::from_static("http://[::1]:80/");
    assert_eq!(request_host(&u2, &HeaderMap::new()), Some("::1"));
}

#[test]
fn query_keys_are_decoded_and_a_repeated_keyed_field_is_refused() {
    let parts = vec![KeyPart::Query("user".into())];
    let (m, h) = (Method::GET, HeaderMap::new());
    let (mut a, mut b) = (KeyBuf::new(), KeyBuf::new());
    let u1 = Uri::from_static("/x?user=bob");
    let u2 = Uri::from_static("/x?%75ser=b%6Fb");
    assert_eq!(extract(&parts, &view(&m, &u1, &h), &mut a), Extract::Found);
    assert_eq!(extract(&parts, &view(&m, &u2, &h), &mut b), Extract::Found);
    assert_eq!(a, b);
    let twice = Uri::from_static("/x?user=a&user=b");
    assert_eq!(
        extract(&parts, &view(&m, &twice, &h), &mut a),
        Extract::Repeated
    );
    let hp = vec![KeyPart::Header(HeaderName::from_static("x-k"))];
    let h2 = headers(&[("x-k", "a"), ("x-k", "b")]);
    assert_eq!(extract(&hp, &view(&m, &u1, &h2), &mut a), Extract::Repeated);
}

#[test]
fn path_keys_fold_case_params_and_a_trailing_slash_unless_strict() {
    let parts = vec![KeyPart::Path];
    let (m, h) = (Method::GET, HeaderMap::new());
    let (mut a, mut b) = (KeyBuf::new(), KeyBuf::new());
    let u1 = Uri::from_static("/Login;jsessionid=1/");
    let u2 = Uri::from_static("/login");
    extract(&parts, &view(&m, &u1, &h), &mut a);
    extract(&parts, &view(&m, &u2, &h), &mut b);
    assert_eq!(a, b);
    extract(&parts, &view(&m, &u1, &h).strict(true), &mut a);
    assert_ne!(a, b);
}

#[test]
fn long_local_keys_are_hashed_to_a_fixed_size_and_short_ones_kept() {
    let mut short = KeyBuf::from_slice(&[7u8; INLINE_KEY]);
    bound_local(&mut short);
    assert_eq!(&short[..], &[7u8; INLINE_KEY][..]);
    let mut long = KeyBuf::from_slice(&[7u8; 16 * 1024]);
    let mut other = KeyBuf::from_slice(&[8u8; 16 * 1024]);
    bound_local(&mut long);
    bound_local(&mut other);
    assert_eq!(long.len(), 17);
    assert_eq!(long[0], HASHED);
    assert_ne!(long, other);
    let mut again = KeyBuf::from_slice(&[7u8; 16 * 1024]);
    bound_local(&mut again);
    assert_eq!(long, again);
}

#[test]
fn global_keys_have_one_canonical_text_in_every_process() {
    let mut k = KeyBuf::from_slice(b"alice");
    canonical_text(&mut k);
    assert_eq!(&k[..], b"alice");
    let mut bad = KeyBuf::from_slice(b"caf\xe9");
    canonical_text(&mut bad);
    assert!(bad.starts_with(b"sha256:") && bad.len() == 71);
    let long = "x".repeat(2000);
    let mut k = KeyBuf::from_slice(long.as_bytes());
    canonical_text(&mut k);
    assert_eq!(canonical_key(&long), std::str::from_utf8(&k).unwrap());
    // Canonical already: unchanged.
    assert_eq!(
        canonical_key(std::str::from_utf8(&k).unwrap()),
        std::str::from_utf8(&k).unwrap()
    );
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

#[test]
fn an_ipv4_client_inside_an_ipv6_address_is_keyed_as_that_ipv4_client() {
    let rfc6052 = [
        ("2001:db8::/32", "2001:db8:c000:221::"),
        ("2001:db8:100::/40", "2001:db8:1c0:2:21::"),
        ("2001:db8:122::/48", "2001:db8:122:c000:2:2100::"),
        ("2001:db8:122:300::/56", "2001:db8:122:3c0:0:221::"),
        ("2001:db8:122:344::/64", "2001:db8:122:344:c0:2:2100:0"),
        ("2001:db8:122:344::/96", "2001:db8:122:344::192.0.2.33"),
    ];
    for (net, addr) in rfc6052 {
        let policy = ClientIpPolicy {
            nat64: vec![net.parse().unwrap()],
            ..ClientIpPolicy::default()
        };
        assert_eq!(policy.unwrapped(ip(addr)), ip("192.0.2.33"), "{net} {addr}");
    }
    let policy = ClientIpPolicy::default();
    // The well-known NAT64 prefix by default; 6to4; Teredo (RFC 4380's example).
    assert_eq!(policy.unwrapped(ip("64:ff9b::c000:221")), ip("192.0.2.33"));
    assert_eq!(policy.unwrapped(ip("2002:c000:221:1::9")), ip("192.0.2.33"));
    assert_eq!(
        policy.unwrapped(ip("2001:0:4136:e378:8000:63bf:3fff:fdd2")),
        ip("192.0.2.45")
    );
    // Any other IPv6 address is itself.
    assert_eq!(policy.unwrapped(ip("2001:db8::1")), ip("2001:db8::1"));
    // Two 6to4 sites of one IPv4 address share its key; two Teredo clients of one relay do not.
    assert_eq!(
        policy.keyed(ip("2002:c000:221:1::9")),
        policy.keyed(ip("2002:c000:221:ffff::9"))
    );
    assert_ne!(
        policy.keyed(ip("2001:0:4136:e378:8000:63bf:3fff:fdd2")),
        policy.keyed(ip("2001:0:4136:e378:8000:63bf:3fff:fdd3"))
    );
}

#[test]
fn a_rule_s_own_prefix_cuts_its_family_and_leaves_the_other_as_configured() {
    for (text, v4, v6) in [
        ("client_ip/48", None, Some(48)),
        ("client_ip/24", Some(24), None),
        ("client_ip/24/56", Some(24), Some(56)),
        ("client_ip/32/32", Some(32), Some(32)),
    ] {
        let part: KeyPart = text.parse().unwrap();
        assert_eq!(part, KeyPart::ClientNet { v4, v6 }, "{text}");
        assert_eq!(part.to_string(), text);
    }
    for bad in [
        "client_ip/0",
        "client_ip/129",
        "client_ip/x",
        "client_ip/33/48",
        "client_ip/",
    ] {
        let e = bad.parse::<KeyPart>().unwrap_err();
        assert!(e.contains("client_ip/N"), "{bad}: {e}");
    }
    let policy = ClientIpPolicy::default();
    let key = |part: &str, addr: &str| {
        let who = policy.who(&HeaderMap::new(), ip(addr));
        let (method, uri, headers) = (
            http::Method::GET,
            http::Uri::from_static("/"),
            HeaderMap::new(),
        );
        let mut view = RequestView::new(&method, &uri, &headers, who.keyed);
        view.client_addr = who.addr;
        let mut out = KeyBuf::new();
        extract(&[part.parse().unwrap()], &view, &mut out);
        out
    };
    // /48: one bucket for a site's /64s; the plain part keys each /64.
    assert_eq!(
        key("client_ip/48", "2a01:1:2:3::1"),
        key("client_ip/48", "2a01:1:2:4::1")
    );
    assert_ne!(
        key("client_ip", "2a01:1:2:3::1"),
        key("client_ip", "2a01:1:2:4::1")
    );
    // An IPv6-only prefix leaves IPv4 clients keyed as configured (whole), and the reverse.
    assert_eq!(
        key("client_ip/48", "198.51.100.7"),
        key("client_ip", "198.51.100.7")
    );
    assert_ne!(
        key("client_ip/48", "198.51.100.7"),
        key("client_ip/48", "198.51.100.8")
    );
    assert_eq!(
        key("client_ip/24", "198.51.100.7"),
        key("client_ip/24", "198.51.100.8")
    );
    assert_eq!(
        key("client_ip/24", "2a01:1:2:3::1"),
        key("client_ip", "2a01:1:2:3::1")
    );
    // Private addresses (callers in the cluster) stay whole under any prefix.
    assert_ne!(
        key("client_ip/8", "10.0.0.1"),
        key("client_ip/8", "10.0.0.2")
    );
    // A 6to4 client is its IPv4 address, cut by the IPv4 prefix.
    assert_eq!(
        key("client_ip/24", "2002:c633:6407::1"),
        key("client_ip/24", "198.51.100.9")
    );
}

#[test]
fn private_blocks_are_told_from_ones_that_reach_the_internet() {
    for block in [
        "10.0.0.0/8",
        "10.1.0.0/16",
        "192.168.1.1",
        "127.0.0.0/8",
        "fd00::/8",
        "::1",
        "100.64.0.0/10",
    ] {
        assert!(block.parse::<Cidr>().unwrap().is_private(), "{block}");
    }
    for block in [
        "0.0.0.0/0",
        "8.0.0.0/8",
        "10.0.0.0/7",
        "::/0",
        "2001:db8::/32",
        "203.0.113.0/24",
    ] {
        assert!(!block.parse::<Cidr>().unwrap().is_private(), "{block}");
    }
}

#[test]
fn a_stored_key_is_shown_as_its_request_would_be_logged() {
    let (m, u) = (
        Method::GET,
        "/Some/Path?tenant=acme".parse::<Uri>().unwrap(),
    );
    let mut h = HeaderMap::new();
    h.insert("x-api-key", "sk-live-1".parse().unwrap());
    let req = view(&m, &u, &h);
    let digest = |v: &[u8], out: &mut KeyBuf| {
        out.extend_from_slice(b"~");
        out.extend_from_slice(&v.len().to_string().into_bytes());
    };
    let parts: Vec<KeyPart> = [
        "client_ip",
        "header:x-api-key",
        "path",
        "query:tenant",
        "method",
    ]
    .iter()
    .map(|p| p.parse().unwrap())
    .collect();
    let mut logged = KeyBuf::new();
    assert_eq!(
        extract_shown(&parts, &req, digest, &mut logged),
        Extract::Found
    );
    canonical_text(&mut logged);
    // A local rule's framed key, and a global or redis rule's text form.
    let mut local = KeyBuf::new();
    assert_eq!(extract(&parts, &req, &mut local), Extract::Found);
    bound_local(&mut local);
    assert_eq!(
        shown_stored(&parts, &local, true, digest).as_deref(),
        Some(&logged[..])
    );
    let mut text = KeyBuf::new();
    assert_eq!(extract_text(&parts, &req, &mut text), Extract::Found);
    assert_eq!(
        shown_stored(&parts, &text, false, digest).as_deref(),
        Some(&logged[..])
    );
    // Not a key of these parts, or a long key kept as its hash: nothing to show.
    assert_eq!(shown_stored(&parts[..2], &local, true, digest), None);
    let mut long = KeyBuf::new();
    long.extend_from_slice(&[7; 100]);
    let mut framed = KeyBuf::new();
    framed.extend_from_slice(&100u32.to_le_bytes());
    framed.extend_from_slice(&long);
    bound_local(&mut framed);
    assert_eq!(shown_stored(&parts[1..2], &framed, true, digest), None);
}
