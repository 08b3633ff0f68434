//! Fuzzing of every parser that takes outside input, driven by proptest (cargo-fuzz needs a
//! nightly toolchain, which this project's machines do not have). Each target runs a bounded
//! number of generated inputs in the test command; proptest keeps any failing input in
//! `proptest-regressions/`, which is committed, so a crash found once stays a regression test.
//!
//! The property everywhere: no panic, and the answer is one of the documented ones.
//!
//! The hand-written HTTP/1 parsers (request heads and small bodies, response heads, chunked
//! bodies and trailers) are fuzzed against hyper instead, which is a stronger property than "no
//! panic": `src/proxy/http1/tests.rs` (`cargo test --lib http1::tests`, and
//! `bench/differential.sh` for a longer run).

use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;

use http::{HeaderMap, HeaderValue, Method, Request};
use proptest::prelude::*;
use spillway::internal::config::{parse_duration, Config, Rate};
use spillway::internal::control::Report;
use spillway::internal::key::{
    bound_local, canonical_key, canonical_text, extract, extract_text, ClientIpPolicy, KeyBuf,
    KeyPart, RequestView, INLINE_KEY,
};

const VALID: &str = "service: shop
listen: 127.0.0.1:8080
upstream: http://127.0.0.1:9000
control_plane: { url: http://127.0.0.1:7001, report_interval: 1s }
redis: { url: redis://127.0.0.1:6379, timeout: 5ms, on_error: fallback }
rules:
  - name: per-client
    match: { path_prefix: /api/, methods: [GET, POST], headers: { x-plan: free } }
    key: [client_ip, header:x-api-key, query:tenant]
    limit: { rate: 10/s, burst: 20, algorithm: sliding_window_counter }
    cost: { header: x-cost, default: 1, max: 10 }
    on_limit: delay
    max_delay: 500ms
  - name: fleet
    key: [header:x-api-key]
    limit: { rate: 1000/m }
    scope: global
    fallback: { rate: 20/s }
  - name: exact
    key: [client_ip]
    limit: { rate: 5/m, algorithm: sliding_window_log }
    scope: redis
    fallback: { rate: 1/s }
  - name: app
    key: []
    limit: { adaptive: { min: 2, max: 64 } }
";

const REPORT: &str = r#"{"version":1,"source":"h","zone":"z","interval_ms":1000,"entries":[
{"service":"s","rule":"r","limit":{"count":10,"period_ms":1000},"key":"k","offered":30,"admitted":10}]}"#;

/// `text` with `edits` applied: (position, byte) inserted, or the byte at position replaced.
fn mutate(text: &str, edits: &[(usize, u8, bool)]) -> Vec<u8> {
    let mut b = text.as_bytes().to_vec();
    for &(at, byte, insert) in edits {
        let at = at % (b.len() + 1);
        if insert || at == b.len() {
            b.insert(at, byte);
        } else {
            b[at] = byte;
        }
    }
    b
}

fn cases(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: n,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("regressions"),
        )),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(cases(10_000))]

    #[test]
    fn config_from_any_text_is_ok_or_a_located_error(text in ".{0,400}") {
        if let Err(e) = Config::from_yaml(&text, "f.yaml") {
            prop_assert!(e.to_string().starts_with("f.yaml"), "{e}");
        }
    }

    #[test]
    fn config_mutated_from_a_valid_one_is_ok_or_a_located_error(
        edits in proptest::collection::vec((0usize..2000, any::<u8>(), any::<bool>()), 1..6)
    ) {
        let bytes = mutate(VALID, &edits);
        if let Ok(text) = std::str::from_utf8(&bytes) {
            if let Err(e) = Config::from_yaml(text, "f.yaml") {
                prop_assert!(e.to_string().starts_with("f.yaml"), "{e}");
            }
        }
    }

    #[test]
    fn durations_and_rates_parse_or_refuse_and_round_trip(s in "[0-9a-z/ .-]{0,16}") {
        if let Ok(d) = parse_duration(&s) {
            prop_assert!(d.as_nanos() > 0 || s.trim().starts_with('0'));
        }
        if let Ok(r) = Rate::from_str(&s) {
            let again = Rate::from_str(&r.to_string()).expect("a printed rate parses");
            prop_assert_eq!(again, r);
        }
    }

    #[test]
    fn x_forwarded_for_yields_a_listed_address_or_the_peer(
        lines in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..60), 0..4),
        hops in 0u8..5,
    ) {
        let peer = IpAddr::V4(Ipv4Addr::new(10, 9, 8, 7));
        let mut headers = HeaderMap::new();
        for l in &lines {
            if let Ok(v) = HeaderValue::from_bytes(l) {
                headers.append("x-forwarded-for", v);
            }
        }
        let policy = ClientIpPolicy {
            proxies: vec!["10.0.0.0/8".parse().unwrap()],
            max_hops: usize::from(hops),
            ipv4_prefix: 32,
            ipv6_prefix: 128,
            nat64: Vec::new(),
        };
        let ip = policy.client(&headers, peer);
        if ip != peer {
            let listed = headers
                .get_all("x-forwarded-for")
                .iter()
                .flat_map(|v| v.to_str().unwrap_or("").split(',').map(|s| s.trim().to_string()).collect::<Vec<_>>())
                .any(|s| [s.parse::<IpAddr>().ok(), s.trim_matches(|c| c == '[' || c == ']').parse::<IpAddr>().ok()].into_iter().flatten().any(|a| policy.keyed(a) == ip));
            prop_assert!(listed, "{ip} is neither the peer nor in the header");
        }
        // Without listed proxies the header is never read.
        prop_assert_eq!(ClientIpPolicy::default().client(&headers, peer), peer);
    }

    #[test]
    fn any_byte_string_as_a_key_takes_a_bounded_form(key in proptest::collection::vec(any::<u8>(), 0..400)) {
        let mut local = KeyBuf::from_slice(&key);
        bound_local(&mut local);
        prop_assert!(local.len() <= INLINE_KEY);
        if key.len() <= INLINE_KEY {
            prop_assert_eq!(&local[..], &key[..]);
        }
        let mut text = KeyBuf::from_slice(&key);
        canonical_text(&mut text);
        let text = std::str::from_utf8(&text).expect("canonical keys are UTF-8").to_string();
        prop_assert!(text.len() <= 71);
        // The control plane's canonical form of it is itself.
        prop_assert_eq!(canonical_key(&text).into_owned(), text);
    }

    #[test]
    fn any_cost_header_is_a_cost_of_at_least_one_or_a_400(value in proptest::collection::vec(any::<u8>(), 0..24)) {
        let Ok(v) = HeaderValue::from_bytes(&value) else { return Ok(()) };
        let yaml = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nheaders: always\nrules:\n  - name: r\n    key: []\n    limit: { rate: 1000/s, burst: 1000 }\n    cost: { header: x-cost, max: 100, from: any }\n";
        let config = Config::from_yaml(yaml, "t").unwrap();
        let rules = spillway::internal::rules::RuleSet::build(&config, &spillway::internal::metrics::Metrics::new());
        let req = Request::get("/").header("x-cost", v).body(()).unwrap();
        let view = RequestView::of(&req, IpAddr::V4(Ipv4Addr::LOCALHOST));
        let text = String::from_utf8_lossy(&value).trim_matches(|c: char| c.is_ascii_whitespace()).to_string();
        let whole = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
        let expected = whole.then(|| text.parse::<u64>().map_or(100, |n| n.min(100))).filter(|n| *n >= 1);
        match rules.check(&view, 1_000_000_000) {
            spillway::internal::rules::Verdict::Allow(admit) => {
                let n = expected.expect("admitted only a whole cost of at least 1");
                prop_assert_eq!(u64::from(admit.states[0].remaining), 1000 - n);
            }
            spillway::internal::rules::Verdict::BadRequest(bad) => {
                prop_assert!(expected.is_none(), "{:?} refused", text);
                prop_assert_eq!(&*bad.rule, "r");
            }
            other => prop_assert!(false, "{:?}", other),
        }
    }

    #[test]
    fn any_request_target_normalises_idempotently_or_is_refused(target in "[!-~]{0,80}") {
        let Ok(uri) = http::Uri::from_str(&target) else { return Ok(()) };
        for reject in [false, true] {
            if let Ok(n) = spillway::internal::target::canonical_uri(&uri, reject) {
                let once = n.unwrap_or_else(|| uri.clone());
                prop_assert_eq!(spillway::internal::target::canonical_uri(&once, reject), Ok(None));
                prop_assert_eq!(once.query(), uri.query());
                if once.path().starts_with('/') {
                    for seg in once.path().split('/') {
                        prop_assert!(seg != "." && seg != "..");
                    }
                }
            }
        }
    }

    #[test]
    fn key_extraction_never_panics_and_is_deterministic(
        path in "/[ -~]{0,80}",
        header in proptest::collection::vec(any::<u8>(), 0..200),
        method in "[A-Z]{1,8}",
    ) {
        let Ok(method) = Method::from_bytes(method.as_bytes()) else { return Ok(()) };
        let mut req = Request::builder().method(method);
        if let Ok(uri) = http::Uri::from_str(&path) {
            req = req.uri(uri);
        }
        let Ok(mut req) = req.body(()) else { return Ok(()) };
        if let Ok(v) = HeaderValue::from_bytes(&header) {
            req.headers_mut().insert("x-api-key", v.clone());
            req.headers_mut().insert("host", v);
        }
        let view = RequestView::of(&req, IpAddr::V4(Ipv4Addr::LOCALHOST));
        let parts = [
            KeyPart::ClientIp,
            KeyPart::Header(http::HeaderName::from_static("x-api-key")),
            KeyPart::Query("tenant".into()),
            KeyPart::Path,
            KeyPart::Method,
            KeyPart::Host,
        ];
        for n in 0..=parts.len() {
            let (mut a, mut b) = (KeyBuf::new(), KeyBuf::new());
            let found = extract(&parts[..n], &view, &mut a);
            prop_assert_eq!(found, extract(&parts[..n], &view, &mut b));
            prop_assert_eq!(&a, &b);
            let mut t = KeyBuf::new();
            prop_assert_eq!(found, extract_text(&parts[..n], &view, &mut t));
        }
    }

    #[test]
    fn report_bodies_decode_and_validate_or_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(r) = serde_json::from_slice::<Report>(&bytes) {
            let _ = r.validate();
        }
    }

    #[test]
    fn reports_mutated_from_a_valid_one_decode_and_validate_or_are_refused(
        edits in proptest::collection::vec((0usize..400, any::<u8>(), any::<bool>()), 1..5)
    ) {
        let bytes = mutate(REPORT, &edits);
        if let Ok(r) = serde_json::from_slice::<Report>(&bytes) {
            if r.validate().is_ok() {
                for e in &r.entries {
                    prop_assert!(e.admitted <= e.offered);
                }
            }
        }
    }
}

#[test]
fn the_seed_inputs_are_valid() {
    assert!(Config::from_yaml(VALID, "seed").is_ok());
    let r: Report = serde_json::from_str(REPORT).unwrap();
    assert!(r.validate().is_ok());
}
