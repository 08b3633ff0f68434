use std::net::IpAddr;

use http::{HeaderMap, HeaderName, Method, Uri};

use super::super::*;
use crate::config::Config;
use crate::limit::{AnyClock, Clock, ManualClock, NANOS_PER_SEC};

const T0: Nanos = 10 * NANOS_PER_SEC;

/// A rule set of `rules`, its metrics, and a manual clock at [`T0`] that arms charges.
fn ruleset(rules: &str) -> (RuleSet, Metrics, ManualClock) {
    let yaml =
        format!("service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n{rules}");
    let config = Config::from_yaml(&yaml, "t").unwrap_or_else(|e| panic!("{e}"));
    let metrics = Metrics::new();
    (
        RuleSet::build(&config, &metrics),
        metrics,
        ManualClock::new(T0),
    )
}

fn tokens(extra: &str) -> String {
    format!(
        "  - name: tokens\n    key: header:x-api-key\n    limit: {{ rate: 100/s, burst: 1000 }}\n    cost: {{ response: {{ header: x-usage-tokens }}, max: 5000{extra} }}\n"
    )
}

struct Client {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    ip: IpAddr,
}

fn client(key: &str) -> Client {
    let mut headers = HeaderMap::new();
    headers.insert("x-api-key", key.parse().unwrap());
    Client {
        method: Method::POST,
        uri: "/v1/chat/completions".parse().unwrap(),
        headers,
        ip: "192.0.2.1".parse().unwrap(),
    }
}

impl Client {
    fn check(&self, rules: &RuleSet, clock: &ManualClock) -> Verdict {
        let view = RequestView::new(&self.method, &self.uri, &self.headers, self.ip);
        rules.check(&view, clock.now())
    }

    /// Admitted, with its charges armed as the gate arms them.
    fn admit(&self, rules: &RuleSet, clock: &ManualClock) -> Option<Charges> {
        match self.check(rules, clock) {
            Verdict::Allow(mut admit) => {
                admit.charges.arm(&AnyClock::Manual(clock.clone()));
                Some(admit.charges)
            }
            _ => None,
        }
    }

    fn retry_after(&self, rules: &RuleSet, clock: &ManualClock) -> Option<Nanos> {
        match self.check(rules, clock) {
            Verdict::Deny(d) => d.retry_after,
            _ => None,
        }
    }
}

/// The head of a response carrying `fields`.
fn head(charges: &mut Charges, fields: &[(&str, &str)]) {
    let map: HeaderMap = fields
        .iter()
        .map(|(k, v)| {
            (
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            )
        })
        .collect();
    charges.head(|name| map.get(name).map(|v| v.as_bytes()));
}

fn units(m: &Metrics, kind: &str) -> u64 {
    m.response_units.with_label_values(&["tokens", kind]).get()
}

fn unread(m: &Metrics, reason: &str) -> u64 {
    m.usage_unread.with_label_values(&["tokens", reason]).get()
}

#[test]
fn usage_past_the_budget_is_owed_and_refuses_the_key_until_it_has_refilled() {
    let (rules, m, clock) = ruleset(&tokens(""));
    let a = client("a");
    let mut c = a.admit(&rules, &clock).expect("a full budget admits");
    // 1 reserved, then 1 500 used of a 1 000 budget: 500 owed, at 100 a second.
    head(&mut c, &[("x-usage-tokens", "1500")]);
    drop(c);
    assert_eq!(units(&m, "charged"), 1500);
    assert_eq!(units(&m, "reserved"), 1);
    let retry = a.retry_after(&rules, &clock).expect("in debt: refused");
    // The debt (500) and the reservation (1), at 10 ms a unit.
    assert_eq!(retry, 501 * NANOS_PER_SEC / 100);
    assert!(
        client("b").admit(&rules, &clock).is_some(),
        "another key's budget is its own"
    );
    clock.set(T0 + retry - 1);
    assert!(a.admit(&rules, &clock).is_none(), "a nanosecond early");
    clock.set(T0 + retry);
    assert!(
        a.admit(&rules, &clock).is_some(),
        "admitted once the debt has refilled"
    );
}

#[test]
fn a_key_with_budget_left_is_admitted_however_much_each_call_will_use() {
    // Decided before: admitted while not in debt, however large the call turns out.
    let (rules, _, clock) = ruleset(&tokens(", reserve: 0"));
    let a = client("a");
    let mut c = a.admit(&rules, &clock).unwrap();
    head(&mut c, &[("x-usage-tokens", "999")]);
    drop(c);
    let mut c = a.admit(&rules, &clock).expect("one unit left: not in debt");
    head(&mut c, &[("x-usage-tokens", "4000")]);
    drop(c);
    assert!(a.admit(&rules, &clock).is_none());
}

#[test]
fn a_reservation_is_given_back_or_topped_up_once_the_usage_is_known() {
    let (rules, m, clock) = ruleset(&tokens(", reserve: 400, unknown: 400"));
    let a = client("a");
    // Two calls in flight reserve 800 of 1 000: a third is refused before either answers.
    let mut first = a.admit(&rules, &clock).unwrap();
    let mut second = a.admit(&rules, &clock).unwrap();
    assert!(
        a.admit(&rules, &clock).is_none(),
        "reservations bound what is in flight"
    );
    head(&mut first, &[("x-usage-tokens", "100")]);
    drop(first);
    // 300 given back: 500 left, a third call fits.
    let third = a.admit(&rules, &clock).expect("the refund made room");
    head(&mut second, &[("x-usage-tokens", "700")]);
    drop(second);
    drop(third);
    // 100 + 700 + the third's unread usage (its reservation, 400): 1 200 of 1 000.
    assert_eq!(units(&m, "charged"), 1200);
    assert_eq!(units(&m, "reserved"), 1200);
    assert_eq!(unread(&m, "cut_short"), 1);
    assert_eq!(
        a.retry_after(&rules, &clock),
        Some(600 * NANOS_PER_SEC / 100),
        "200 owed and 400 to reserve"
    );
}

#[test]
fn usage_that_cannot_be_read_is_charged_unknown_and_counted_by_why() {
    let (rules, m, clock) = ruleset(&tokens(", reserve: 0, unknown: 300"));
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[], "missing"),
        (&[("x-usage-tokens", "-5")], "malformed"),
        (&[("x-usage-tokens", "1.5")], "malformed"),
        (&[("x-usage-tokens", "")], "malformed"),
        (&[("x-usage-tokens", "12 tokens")], "malformed"),
        (&[("x-usage-tokens", "0x10")], "malformed"),
    ];
    for (i, (fields, why)) in cases.iter().enumerate() {
        clock.set(T0 + i as u64 * 100 * NANOS_PER_SEC);
        let before = unread(&m, why);
        let mut c = client("a").admit(&rules, &clock).unwrap();
        head(&mut c, fields);
        drop(c);
        assert_eq!(unread(&m, why), before + 1, "{fields:?}");
    }
    assert_eq!(units(&m, "charged"), 300 * cases.len() as u64);
    // Spaces around a number are read; zero is a usage (a cached answer).
    let mut c = client("a").admit(&rules, &clock).unwrap();
    head(&mut c, &[("x-usage-tokens", " 0 ")]);
    drop(c);
    assert_eq!(units(&m, "charged"), 300 * cases.len() as u64);
}

#[test]
fn absurd_usage_is_clamped_to_max_and_counted() {
    let (rules, m, clock) = ruleset(&tokens(", reserve: 0"));
    let mut c = client("a").admit(&rules, &clock).unwrap();
    head(
        &mut c,
        &[("x-usage-tokens", "99999999999999999999999999999999")],
    );
    drop(c);
    assert_eq!(units(&m, "charged"), 5000);
    assert_eq!(unread(&m, "clamped"), 1);
    // 5 000 used of 1 000: 4 000 owed, 40 s at 100/s.
    assert_eq!(
        client("a").retry_after(&rules, &clock),
        Some(40 * NANOS_PER_SEC)
    );
}

#[test]
fn a_response_cut_short_or_never_answered_is_charged_and_a_refused_request_is_not() {
    let (rules, m, clock) = ruleset(&format!(
        "{}  - name: strict\n    key: header:x-api-key\n    limit: {{ rate: 1/s, burst: 1 }}\n",
        tokens(", reserve: 10, unknown: 700")
    ));
    let a = client("a");
    // Admitted by both rules; the app never answers (the charges are dropped armed).
    drop(a.admit(&rules, &clock).unwrap());
    assert_eq!(units(&m, "charged"), 700);
    assert_eq!(unread(&m, "cut_short"), 1);
    // Refused by the second rule: the first one's reservation is given back, nothing owed.
    assert!(a.admit(&rules, &clock).is_none());
    assert_eq!(units(&m, "charged"), 700);
    // Decided but never armed (the client left while a shaping rule held it): nothing.
    clock.set(T0 + NANOS_PER_SEC);
    let Verdict::Allow(admit) = a.check(&rules, &clock) else {
        panic!("admitted")
    };
    drop(admit);
    assert_eq!(units(&m, "charged"), 700);
    assert_eq!(units(&m, "reserved"), 10);
}

#[test]
fn trailers_and_body_bytes_settle_as_the_body_streams() {
    let (rules, m, clock) = ruleset(
        "  - name: trailer\n    key: header:x-api-key\n    limit: { rate: 100/s, burst: 1000 }\n    cost: { response: { trailer: x-usage }, reserve: 0, max: 5000, unknown: 50 }\n  - name: bytes\n    key: header:x-api-key\n    limit: { rate: 1000/s, burst: 10000 }\n    cost: { response: body_bytes, reserve: 0, max: 100000 }\n",
    );
    let count = |rule: &str| m.response_units.with_label_values(&[rule, "charged"]).get();
    let mut c = client("a").admit(&rules, &clock).unwrap();
    head(&mut c, &[("x-usage", "999")]);
    assert_eq!(count("trailer"), 0, "a trailer rule does not read the head");
    c.data(&[b'x'; 1200]);
    c.data(&[b'x'; 34]);
    let mut trailers = HeaderMap::new();
    trailers.insert("x-usage", "321".parse().unwrap());
    c.trailers(&trailers);
    assert_eq!(count("trailer"), 321);
    assert_eq!(count("bytes"), 0, "bytes settle at the end");
    c.end(true);
    assert_eq!(count("bytes"), 1234);
    drop(c);
    assert_eq!(
        (count("trailer"), count("bytes")),
        (321, 1234),
        "settled once"
    );
    // Cut short: the bytes sent, and the trailer's unknown.
    let mut c = client("a").admit(&rules, &clock).unwrap();
    head(&mut c, &[]);
    c.data(&[b'x'; 10]);
    drop(c);
    assert_eq!((count("trailer"), count("bytes")), (371, 1244));
    // Ended without the trailer, or with it twice.
    let mut c = client("a").admit(&rules, &clock).unwrap();
    c.end(true);
    let mut c2 = client("a").admit(&rules, &clock).unwrap();
    let mut twice = HeaderMap::new();
    twice.append("x-usage", "1".parse().unwrap());
    twice.append("x-usage", "2".parse().unwrap());
    c2.trailers(&twice);
    drop((c, c2));
    assert_eq!(count("trailer"), 471);
    let why = |r: &str| m.usage_unread.with_label_values(&["trailer", r]).get();
    assert_eq!(
        (why("missing"), why("malformed"), why("cut_short")),
        (1, 1, 1)
    );
}

#[test]
fn a_shadow_rule_owes_what_it_admits_and_never_refuses() {
    let (rules, m, clock) = ruleset(&format!("{}    mode: shadow\n", tokens(", reserve: 0")));
    let a = client("a");
    let mut c = a.admit(&rules, &clock).unwrap();
    head(&mut c, &[("x-usage-tokens", "3000")]);
    drop(c);
    let c = a
        .admit(&rules, &clock)
        .expect("a shadow rule never refuses");
    drop(c);
    assert_eq!(
        m.requests
            .with_label_values(&["tokens", "shadow_rejected"])
            .get(),
        1
    );
    // The refused-in-shadow request is not charged: enforced, it would not have run.
    assert_eq!(units(&m, "charged"), 3000);
}

#[test]
fn a_key_past_the_store_is_charged_in_the_sketch() {
    let (rules, m, clock) =
        ruleset(&tokens(", reserve: 0").replace("    cost:", "    max_keys: 1\n    cost:"));
    // `a` holds the store's one place (in debt, so it cannot be forgotten).
    let mut c = client("a").admit(&rules, &clock).unwrap();
    head(&mut c, &[("x-usage-tokens", "2000")]);
    drop(c);
    let b = client("b");
    let mut c = b.admit(&rules, &clock).expect("b is new to the sketch");
    head(&mut c, &[("x-usage-tokens", "2000")]);
    drop(c);
    assert_eq!(units(&m, "charged"), 4000);
    assert!(b.admit(&rules, &clock).is_none(), "b owes in the sketch");
}

#[test]
fn a_key_with_a_call_in_flight_is_not_forgotten_before_its_charge() {
    let (rules, _, clock) = ruleset(&tokens(", reserve: 0"));
    let a = client("a");
    let mut c = a.admit(&rules, &clock).unwrap();
    // A long stream: the key's bucket refilled while it ran, but its charge is to come.
    clock.set(T0 + 60 * NANOS_PER_SEC);
    assert_eq!(rules.sweep(clock.now()), 0);
    head(&mut c, &[("x-usage-tokens", "1500")]);
    drop(c);
    assert_eq!(
        a.retry_after(&rules, &clock),
        Some(500 * NANOS_PER_SEC / 100),
        "1 500 of a full 1 000: 500 owed"
    );
    // Repaid and nothing in flight: forgotten as any full bucket.
    clock.set(T0 + 120 * NANOS_PER_SEC);
    assert_eq!(rules.sweep(clock.now()), 1);
}

/// A rule reading `json` usage, 100 units a second, 1 000 at most.
fn json_rule(json: &str) -> String {
    format!(
        "  - name: tokens\n    key: header:x-api-key\n    limit: {{ rate: 100/s, burst: 1000 }}\n    cost: {{ response: {json}, reserve: 0, max: 100000, unknown: 333 }}\n"
    )
}

/// A response with `fields` and `body` in pieces of `piece` bytes, ended `whole` or not.
fn respond(c: &mut Charges, fields: &[(&str, &str)], body: &str, piece: usize, whole: bool) {
    head(c, fields);
    for part in body.as_bytes().chunks(piece) {
        c.data(part);
    }
    if whole {
        c.end(true);
    }
}

#[test]
fn a_json_bodys_usage_is_read_as_it_streams_in_any_pieces() {
    let (rules, m, clock) = ruleset(&json_rule("json"));
    let body = r#"{"id":"x","choices":[{"message":{"content":"{\"usage\":{\"total_tokens\":1}}"}}],"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}"#;
    for piece in [1, 5, body.len()] {
        let mut c = client("a").admit(&rules, &clock).unwrap();
        respond(
            &mut c,
            &[("content-type", "application/json")],
            body,
            piece,
            true,
        );
    }
    assert_eq!(units(&m, "charged"), 36);
    // Summed pointers, and Anthropic's shape named.
    let (rules, m, clock) = ruleset(&json_rule(
        "{ json: [/usage/prompt_tokens, /usage/completion_tokens] }",
    ));
    let mut c = client("a").admit(&rules, &clock).unwrap();
    respond(&mut c, &[], body, 7, true);
    assert_eq!(units(&m, "charged"), 12);
    let (rules, m, clock) = ruleset(&json_rule("{ json: anthropic }"));
    let mut c = client("a").admit(&rules, &clock).unwrap();
    let stream = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":20,\"output_tokens\":1}}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":30}}\n\n";
    respond(
        &mut c,
        &[("content-type", "text/event-stream; charset=utf-8")],
        stream,
        3,
        true,
    );
    assert_eq!(units(&m, "charged"), 50);
}

#[test]
fn a_body_without_readable_usage_is_charged_unknown_by_why() {
    let (rules, m, clock) = ruleset(&json_rule("json"));
    // (response fields, body, ended whole, why it is unread)
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, bool, &'a str);
    let cases: &[Case] = &[
        (
            &[],
            r#"{"error":{"message":"overloaded"}}"#,
            true,
            "missing",
        ),
        (&[], r#"{"usage":{"total_tokens":"12"}}"#, true, "malformed"),
        (&[], r#"{"usage":{"total_tokens":-3}}"#, true, "malformed"),
        (&[], "<html>bad gateway</html>", true, "malformed"),
        (&[], r#"{"usage":{"total_to"#, false, "cut_short"),
        (
            &[("content-encoding", "gzip")],
            "\x1f\u{8b}...",
            true,
            "encoded",
        ),
        (
            &[("content-type", "text/event-stream")],
            "data: {\"usage\":null}\n\ndata: [DONE]\n\n",
            true,
            "missing",
        ),
    ];
    for (i, (fields, body, whole, why)) in cases.iter().enumerate() {
        clock.set(T0 + i as u64 * 100 * NANOS_PER_SEC);
        let before = unread(&m, why);
        let mut c = client("a").admit(&rules, &clock).unwrap();
        respond(&mut c, fields, body, 4, *whole);
        drop(c);
        assert_eq!(unread(&m, why), before + 1, "{body}");
    }
    assert_eq!(units(&m, "charged"), 333 * cases.len() as u64);
    // The usage said before the body broke off stands.
    let mut c = client("b").admit(&rules, &clock).unwrap();
    respond(
        &mut c,
        &[("content-type", "text/event-stream")],
        "data: {\"usage\":{\"total_tokens\":77}}\n\ndata: {\"choices\":[",
        4,
        false,
    );
    drop(c);
    assert_eq!(units(&m, "charged"), 333 * cases.len() as u64 + 77);
}

#[test]
fn only_a_rule_that_reads_the_body_asks_for_it_uncompressed() {
    for (rule, reads) in [
        (json_rule("json"), true),
        (json_rule("{ header: x-usage }"), false),
        (json_rule("body_bytes").replace(", unknown: 333", ""), false),
    ] {
        let (rules, _, clock) = ruleset(&rule);
        let c = client("a").admit(&rules, &clock).unwrap();
        assert_eq!(c.reads_body(), reads, "{rule}");
    }
}

#[test]
fn a_reservation_the_bucket_has_refilled_since_is_not_given_back_again() {
    let (rules, _, clock) = ruleset(&tokens(", reserve: 50"));
    let a = client("a");
    // A slow call reserves 50; a second later its 50 units have refilled (100 a second).
    let mut slow = a.admit(&rules, &clock).unwrap();
    clock.set(T0 + NANOS_PER_SEC);
    let mut heavy = a.admit(&rules, &clock).unwrap();
    head(&mut heavy, &[("x-usage-tokens", "1500")]);
    drop(heavy);
    let owed = a.retry_after(&rules, &clock).expect("in debt");
    // The slow call used 1 of its 50: nothing of them is still held to give back.
    head(&mut slow, &[("x-usage-tokens", "1")]);
    drop(slow);
    assert_eq!(a.retry_after(&rules, &clock), Some(owed), "the debt stands");
    // Settled at once, the same reservation is given back whole.
    let b = client("b");
    let mut c = b.admit(&rules, &clock).unwrap();
    head(&mut c, &[("x-usage-tokens", "1")]);
    drop(c);
    let mut c = b.admit(&rules, &clock).unwrap();
    head(&mut c, &[("x-usage-tokens", "949")]);
    drop(c);
    assert!(
        b.admit(&rules, &clock).is_some(),
        "1 + 949 + 50 reserved: exactly full"
    );
}

#[test]
fn a_reload_that_makes_a_cost_the_responses_charges_it() {
    let yaml = |cost: &str| {
        format!("service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: tokens\n    key: header:x-api-key\n    limit: {{ rate: 100/s, burst: 1000 }}\n    cost: {cost}\n")
    };
    let metrics = Metrics::new();
    let ratios = Arc::new(ArcSwap::from_pointee(DropRatios::empty(0)));
    let before = Config::from_yaml(&yaml("1"), "t").unwrap();
    let first = RuleSet::build(&before, &metrics);
    let after = Config::from_yaml(
        &yaml("{ response: { header: x-usage-tokens }, max: 5000 }"),
        "t",
    )
    .unwrap();
    let rules = RuleSet::rebuild(&after, &metrics, ratios, Some(&first));
    let clock = ManualClock::new(T0);
    let a = client("a");
    let mut c = a.admit(&rules, &clock).unwrap();
    head(&mut c, &[("x-usage-tokens", "1500")]);
    drop(c);
    assert!(
        a.retry_after(&rules, &clock).is_some(),
        "charged after the reload"
    );
}

#[test]
fn a_debt_stops_a_year_past_the_budget_and_nothing_overflows() {
    let (rules, _, clock) = ruleset(
        "  - name: tokens\n    key: header:x-api-key\n    limit: { rate: 1/d, burst: 10 }\n    cost: { response: { header: x-usage-tokens }, reserve: 0, max: 4000000000 }\n",
    );
    let a = client("a");
    let mut open = Vec::new();
    for _ in 0..50 {
        open.push(
            a.admit(&rules, &clock)
                .expect("not in debt until the first answer"),
        );
    }
    for mut c in open {
        head(&mut c, &[("x-usage-tokens", "4000000000")]);
    }
    let retry = a.retry_after(&rules, &clock).expect("in debt");
    let year = crate::limit::gcra::MAX_DEBT;
    assert!(retry <= year + 86_400 * NANOS_PER_SEC, "{retry}");
    assert!(retry >= year, "{retry}");
}

#[test]
fn a_stream_cut_before_its_last_count_pays_at_least_unknown() {
    let (rules, m, clock) = ruleset(&json_rule("{ json: anthropic }"));
    let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":20,\"output_tokens\":1}}}\n\nevent: content_block_delta\ndata: {\"delta\":{\"text\":\"Hi\"}}\n\n";
    let mut c = client("a").admit(&rules, &clock).unwrap();
    respond(
        &mut c,
        &[("content-type", "text/event-stream")],
        start,
        5,
        false,
    );
    drop(c);
    assert_eq!(
        units(&m, "charged"),
        333,
        "the input count alone would be 20"
    );
    // A count already past `unknown` stands.
    let big = start.replace("\"input_tokens\":20", "\"input_tokens\":900");
    let mut c = client("b").admit(&rules, &clock).unwrap();
    respond(
        &mut c,
        &[("content-type", "text/event-stream")],
        &big,
        5,
        false,
    );
    drop(c);
    assert_eq!(units(&m, "charged"), 333 + 900);
}

#[test]
fn an_admission_carries_its_charges_in_few_bytes() {
    // Every request's admission is moved a few times on the request path, and a larger one
    // cost every request instructions (BENCHMARKS.md, issue 44, says how many and why).
    assert!(
        std::mem::size_of::<Admit>() <= 192,
        "{}",
        std::mem::size_of::<Admit>()
    );
}

/// A global rule of `rate` units a second per client address whose cost is the response's
/// `x-usage-tokens` (reserve 50), with no reply yet, and the ratios to answer it by.
fn global_tokens(rate: u32) -> (RuleSet, Metrics, ManualClock, Arc<ArcSwap<DropRatios>>) {
    let yaml = format!(
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: {{ url: 'http://127.0.0.1:1' }}\nrules:\n  - name: tokens\n    key: client_ip\n    limit: {{ rate: {rate}/s }}\n    scope: global\n    cost: {{ response: {{ header: x-usage-tokens }}, reserve: 50, max: 5000 }}\n"
    );
    let config = Config::from_yaml(&yaml, "t").unwrap_or_else(|e| panic!("{e}"));
    let metrics = Metrics::new();
    let ratios = Arc::new(ArcSwap::from_pointee(DropRatios::empty(T0)));
    let rules = RuleSet::build_with_ratios(&config, &metrics, ratios.clone());
    (rules, metrics, ManualClock::new(T0), ratios)
}

/// One call of `a` admitted and charged `used` tokens; whether it was admitted.
fn call(a: &Client, rules: &RuleSet, clock: &ManualClock, used: u32) -> bool {
    let Some(mut c) = a.admit(rules, clock) else {
        return false;
    };
    head(&mut c, &[("x-usage-tokens", &used.to_string())]);
    true
}

#[test]
fn a_global_rule_reports_the_units_its_responses_were_charged_and_refusals_at_the_keys_mean() {
    let (rules, m, clock, ratios) = global_tokens(1_000_000);
    let a = client("a");
    for (i, used) in [100, 300, 500].into_iter().enumerate() {
        // A second apart: a new key's guard, the provisional limit, has no burst.
        clock.set(T0 + i as u64 * NANOS_PER_SEC);
        assert!(call(&a, &rules, &clock, used), "no ratio: admitted");
    }
    assert_eq!(units(&m, "charged"), 900);
    // The first was decided at its reservation, the next ones at the key's mean so far.
    let second = 100.0 + (300.0 - 100.0) / MEAN_OF;
    let estimated = 50 + 100 + second.round() as u64;
    assert_eq!(units(&m, "reserved"), estimated);
    let report = rules.drain_global(10, 1.0, 1, 0);
    assert_eq!(
        report[0].keys,
        vec![("192.0.2.1".to_string(), estimated, 900, 0.0)],
        "offered at the estimates the calls were decided by, admitted in the units charged"
    );
    // Refused by the reply to that report: each refusal offered the key's mean, never the
    // reservation.
    let mean = second + (500.0 - second) / MEAN_OF;
    ratios.store(Arc::new(
        DropRatios::of(
            clock.now(),
            [("tokens", Some("192.0.2.1"), 1.0)].into_iter(),
        )
        .answering(1),
    ));
    for _ in 0..4 {
        assert!(!call(&a, &rules, &clock, 100), "a ratio of 1 refuses");
    }
    let report = rules.drain_global(10, 1.0, 2, 0);
    let (_, offered, admitted, _) = &report[0].keys[0];
    assert_eq!((*offered, *admitted), (4 * mean.round() as u64, 0));
}

#[test]
fn a_global_key_s_share_is_held_in_units_charged_and_a_call_past_it_is_debt() {
    let (rules, m, clock, ratios) = global_tokens(1_000_000);
    let a = client("a");
    // Named by a report (taken over a nanosecond: its guard's allowance bounds nothing here),
    // answered with a ratio of 0.6: it keeps 40 % of what it offers.
    assert!(call(&a, &rules, &clock, 500));
    rules.drain_global(10, 1e-9, 1, 0);
    ratios.store(Arc::new(
        DropRatios::of(T0, [("tokens", Some("192.0.2.1"), 0.6)].into_iter()).answering(1),
    ));
    let reserved = units(&m, "reserved");
    // Calls of 100 to 900 tokens: each is decided at the key's mean, and the share's credit
    // pays its actual tokens, going into debt past it.
    let mut rng = fastrand::Rng::with_seed(7);
    let (mut used, mut admitted) = (0u64, 0u64);
    for _ in 0..3000 {
        let tokens = rng.u32(100..=900);
        if call(&a, &rules, &clock, tokens) {
            admitted += u64::from(tokens);
        }
        used += u64::from(tokens);
    }
    let want = 0.4 * used as f64;
    assert!(
        (admitted as f64 - want).abs() <= 0.03 * want,
        "{admitted} tokens admitted of {used}"
    );
    // Decided at estimates, reported in the tokens charged.
    let report = rules.drain_global(10, 1.0, 2, 0);
    assert_eq!(report[0].keys[0].2, admitted, "admitted tokens, as charged");
    assert_ne!(
        units(&m, "reserved") - reserved,
        admitted,
        "decided at estimates"
    );
    // A call far past the estimate puts the key in debt: the share refuses until its later
    // requests have earned it back (4 500 at 0.4 of a ~500-token estimate each: about 22).
    let mut c = loop {
        if let Some(c) = a.admit(&rules, &clock) {
            break c;
        }
    };
    head(&mut c, &[("x-usage-tokens", "5000")]);
    drop(c);
    let refused = (0..8).filter(|_| a.admit(&rules, &clock).is_none()).count();
    assert_eq!(refused, 8, "in debt: every request refused");
}
