use std::net::IpAddr;

use http::{HeaderMap, Method, Uri};

use super::*;
use crate::config::Config;
use crate::limit::NANOS_PER_SEC;

fn ruleset(rules: &str, headers: &str) -> (RuleSet, Metrics) {
    let yaml = format!(
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nheaders: {headers}\nrules:\n{rules}"
    );
    let config = Config::from_yaml(&yaml, "t").unwrap_or_else(|e| panic!("{e}"));
    let metrics = Metrics::new();
    (RuleSet::build(&config, &metrics), metrics)
}

struct Req {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    ip: IpAddr,
}

fn req(method: &str, uri: &str, headers: &[(&str, &str)]) -> Req {
    let mut h = HeaderMap::new();
    for (k, v) in headers {
        h.append(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    Req {
        method: method.parse().unwrap(),
        uri: uri.parse().unwrap(),
        headers: h,
        ip: "192.0.2.1".parse().unwrap(),
    }
}

impl Req {
    fn from(mut self, ip: &str) -> Self {
        self.ip = ip.parse().unwrap();
        self
    }
    fn check(&self, rules: &RuleSet, now: Nanos) -> Verdict {
        let view = RequestView::new(&self.method, &self.uri, &self.headers, self.ip);
        rules.check(&view, now)
    }
    fn allowed(&self, rules: &RuleSet, now: Nanos) -> bool {
        matches!(self.check(rules, now), Verdict::Allow(_))
    }
}

fn count(m: &Metrics, rule: &str, decision: &str) -> u64 {
    m.requests.with_label_values(&[rule, decision]).get()
}

const T0: Nanos = 10 * NANOS_PER_SEC;

#[test]
fn keys_are_isolated_from_each_other() {
    let (rules, _) = ruleset(
        "  - name: r\n    key: client_ip\n    limit: { rate: 1/s, burst: 2 }\n",
        "on_reject",
    );
    let a = req("GET", "/", &[]).from("10.0.0.1");
    let b = req("GET", "/", &[]).from("10.0.0.2");
    assert!(a.allowed(&rules, T0));
    assert!(a.allowed(&rules, T0));
    assert!(!a.allowed(&rules, T0));
    assert!(b.allowed(&rules, T0), "b has its own bucket");
    assert_eq!(rules.tracked_keys("r"), Some(2));
}

#[test]
fn a_denial_says_when_to_retry_and_names_the_rule() {
    let (rules, m) = ruleset(
        "  - name: slow\n    key: client_ip\n    limit: { rate: 1/m, burst: 1 }\n",
        "on_reject",
    );
    let r = req("GET", "/", &[]);
    assert!(r.allowed(&rules, T0));
    let Verdict::Deny(d) = r.check(&rules, T0 + NANOS_PER_SEC) else {
        panic!("expected a denial")
    };
    assert_eq!(&**d.state.rule(), "slow");
    assert_eq!(d.retry_after, Some(59 * NANOS_PER_SEC));
    assert_eq!(d.retry_after_secs(), Some(59));
    assert_eq!(d.state.policy(), "\"slow\";q=1;w=60");
    assert_eq!(count(&m, "slow", "allowed"), 1);
    assert_eq!(count(&m, "slow", "rejected"), 1);
}

#[test]
fn retry_after_rounds_up_and_is_never_zero() {
    let (rules, _) = ruleset(
        "  - name: r\n    key: client_ip\n    limit: { rate: 10/s, burst: 1 }\n",
        "on_reject",
    );
    let r = req("GET", "/", &[]);
    assert!(r.allowed(&rules, T0));
    let Verdict::Deny(d) = r.check(&rules, T0 + 1) else {
        panic!()
    };
    assert_eq!(d.retry_after, Some(100_000_000 - 1));
    assert_eq!(d.retry_after_secs(), Some(1));
}

#[test]
fn a_rule_whose_key_part_is_missing_does_not_apply() {
    let (rules, m) = ruleset(
        "  - name: by-key\n    key: [header:x-api-key]\n    limit: { rate: 1/h, burst: 1 }\n",
        "on_reject",
    );
    let anon = req("GET", "/", &[]);
    for _ in 0..5 {
        assert!(anon.allowed(&rules, T0));
    }
    assert_eq!(count(&m, "by-key", "allowed"), 0);
    let keyed = req("GET", "/", &[("x-api-key", "k1")]);
    assert!(keyed.allowed(&rules, T0));
    assert!(!keyed.allowed(&rules, T0));
}

#[test]
fn the_longest_upstream_body_idle_of_the_rules_that_apply_wins() {
    let (rules, _) = ruleset(
        "  - name: events\n    match: { path_prefix: /events }\n    key: []\n    limit: { rate: 100/s }\n    upstream_body_idle: 1h\n  - name: short\n    key: []\n    limit: { rate: 100/s }\n    upstream_body_idle: 5s\n  - name: by-key\n    key: [header:x-k]\n    limit: { rate: 100/s }\n    upstream_body_idle: 2h\n",
        "on_reject",
    );
    let idle = |r: &Req| match r.check(&rules, T0) {
        Verdict::Allow(admit) => admit.body_idle,
        _ => panic!("refused"),
    };
    let secs = |s| Some(std::time::Duration::from_secs(s));
    assert_eq!(idle(&req("GET", "/events/1", &[])), secs(3600));
    assert_eq!(idle(&req("GET", "/other", &[])), secs(5));
    // A rule whose key is missing does not apply, nor does its setting.
    assert_eq!(idle(&req("GET", "/other", &[("x-k", "a")])), secs(7200));
}

#[test]
fn tuple_keys_count_each_combination_apart() {
    let (rules, _) = ruleset(
        "  - name: r\n    key: [client_ip, method]\n    limit: { rate: 1/h, burst: 1 }\n",
        "on_reject",
    );
    assert!(req("GET", "/", &[]).allowed(&rules, T0));
    assert!(req("POST", "/", &[]).allowed(&rules, T0));
    assert!(!req("GET", "/", &[]).allowed(&rules, T0));
    assert!(req("GET", "/", &[]).from("10.9.9.9").allowed(&rules, T0));
}

#[test]
fn shadow_rules_count_what_they_would_reject_and_reject_nothing() {
    let (rules, m) = ruleset(
        "  - name: trial\n    key: client_ip\n    limit: { rate: 1/h, burst: 2 }\n    mode: shadow\n",
        "on_reject",
    );
    let r = req("GET", "/", &[]);
    for _ in 0..5 {
        assert!(r.allowed(&rules, T0));
    }
    assert_eq!(count(&m, "trial", "allowed"), 2);
    assert_eq!(count(&m, "trial", "shadow_rejected"), 3);
    assert_eq!(count(&m, "trial", "rejected"), 0);
}

#[test]
fn a_rejection_by_one_rule_takes_no_tokens_from_the_others() {
    let (rules, m) = ruleset(
        "  - name: wide\n    key: client_ip\n    limit: { rate: 1/h, burst: 3 }\n  - name: narrow\n    match: { path_prefix: /tight }\n    key: client_ip\n    limit: { rate: 1/h, burst: 1 }\n",
        "on_reject",
    );
    let tight = req("GET", "/tight", &[]);
    assert!(tight.allowed(&rules, T0));
    // "narrow" refuses these; "wide" must give back what it granted each time.
    for _ in 0..10 {
        assert!(!tight.allowed(&rules, T0));
    }
    let other = req("GET", "/other", &[]);
    assert!(other.allowed(&rules, T0));
    assert!(other.allowed(&rules, T0));
    assert!(!other.allowed(&rules, T0), "wide had exactly 3");
    assert_eq!(count(&m, "narrow", "rejected"), 10);
    assert_eq!(count(&m, "wide", "allowed"), 3);
}

#[test]
fn tiers_select_rules_by_headers() {
    let (rules, m) = ruleset(
        r#"  - name: anonymous
    match: { headers_absent: [x-api-key] }
    key: client_ip
    limit: { rate: 1/h, burst: 1 }
  - name: standard
    match: { headers_present: [x-api-key], headers_absent: [x-plan] }
    key: [header:x-api-key]
    limit: { rate: 1/h, burst: 2 }
  - name: premium
    match: { headers: { x-plan: premium } }
    key: [header:x-api-key]
    limit: { rate: 1/h, burst: 4 }
"#,
        "on_reject",
    );
    let admitted = |r: &Req| (0..10).filter(|_| r.allowed(&rules, T0)).count();
    assert_eq!(admitted(&req("GET", "/", &[])), 1);
    assert_eq!(admitted(&req("GET", "/", &[("x-api-key", "a")])), 2);
    assert_eq!(
        admitted(&req(
            "GET",
            "/",
            &[("x-api-key", "b"), ("x-plan", "premium")]
        )),
        4
    );
    assert_eq!(count(&m, "premium", "allowed"), 4);
    assert_eq!(count(&m, "anonymous", "allowed"), 1);
}

#[test]
fn matchers_check_path_method_host_and_regex() {
    let (rules, _) = ruleset(
        r#"  - name: r
    match: { path_prefix: /api/, methods: [POST], host: "*.example.com", path_regex: "/v[0-9]+/" }
    key: client_ip
    limit: { rate: 1/h, burst: 1 }
  - name: exact
    match: { path: /login }
    key: client_ip
    limit: { rate: 1/h, burst: 1 }
"#,
        "on_reject",
    );
    let hit = |m: &str, u: &str, host: &str| {
        let r = req(m, u, &[("host", host)]);
        r.allowed(&rules, T0);
        !r.allowed(&rules, T0)
    };
    assert!(hit("POST", "/api/v1/x", "a.example.com"));
    assert!(!hit("GET", "/api/v2/x", "a.example.com"), "method");
    assert!(
        !hit("POST", "/api/v3/x", "example.com"),
        "bare domain is not a subdomain"
    );
    assert!(!hit("POST", "/api/x", "b.example.com"), "regex");
    assert!(!hit("POST", "/other/v4/x", "c.example.com"), "prefix");
    assert!(hit("GET", "/login", "x"));
    assert!(!hit("GET", "/login/more", "y"), "exact path only");
}

#[test]
fn with_headers_always_allowed_requests_carry_each_rules_state() {
    let (rules, _) = ruleset(
        "  - name: r\n    key: client_ip\n    limit: { rate: 10/s, burst: 20 }\n",
        "always",
    );
    let Verdict::Allow(Admit { states, .. }) = req("GET", "/", &[]).check(&rules, T0) else {
        panic!()
    };
    assert_eq!(states.len(), 1);
    assert_eq!(states[0].remaining, 19);
    assert_eq!(
        states[0].reset_secs, 1,
        "100 ms to be whole again, rounded up"
    );
    assert_eq!(states[0].policy(), "\"r\";q=20;w=2");
}

#[test]
fn past_max_keys_each_new_key_is_limited_by_the_sketch_not_one_shared_bucket() {
    let (rules, m) = ruleset(
        "  - name: r\n    key: client_ip\n    limit: { rate: 1/h, burst: 1 }\n    max_keys: 2\n",
        "on_reject",
    );
    assert!(req("GET", "/", &[]).from("10.0.0.1").allowed(&rules, T0));
    assert!(req("GET", "/", &[]).from("10.0.0.2").allowed(&rules, T0));
    // The store is full of states still refilling: newcomers are each admitted once...
    assert!(req("GET", "/", &[]).from("10.0.0.3").allowed(&rules, T0));
    assert!(req("GET", "/", &[]).from("10.0.0.4").allowed(&rules, T0));
    // ...and each limited on its own.
    assert!(!req("GET", "/", &[]).from("10.0.0.3").allowed(&rules, T0));
    assert_eq!(rules.tracked_keys("r"), Some(2));
    assert_eq!(m.overflow.with_label_values(&["r"]).get(), 3);
    assert_eq!(m.sketch_refused.with_label_values(&["r"]).get(), 1);
    // Tracked keys keep their own state.
    assert!(!req("GET", "/", &[]).from("10.0.0.1").allowed(&rules, T0));
}

#[test]
fn a_full_store_gives_an_idle_state_s_place_to_a_new_key() {
    let (rules, m) = ruleset(
        "  - name: r\n    key: client_ip\n    limit: { rate: 1/s, burst: 1 }\n    max_keys: 2\n",
        "on_reject",
    );
    assert!(req("GET", "/", &[]).from("10.0.0.1").allowed(&rules, T0));
    assert!(req("GET", "/", &[])
        .from("10.0.0.2")
        .allowed(&rules, T0 + NANOS_PER_SEC / 2));
    // 10.0.0.1's bucket is whole again a second later (indistinguishable from fresh);
    // 10.0.0.2's is not: the newcomer takes 10.0.0.1's place, and 10.0.0.2 keeps its state.
    let later = T0 + NANOS_PER_SEC;
    assert!(req("GET", "/", &[]).from("10.0.0.3").allowed(&rules, later));
    assert_eq!(rules.tracked_keys("r"), Some(2));
    assert_eq!(m.evicted.with_label_values(&["r", "idle"]).get(), 1);
    assert_eq!(m.overflow.with_label_values(&["r"]).get(), 0);
    assert!(!req("GET", "/", &[]).from("10.0.0.2").allowed(&rules, later));
}

#[test]
fn sweeping_forgets_only_buckets_that_have_refilled() {
    let (rules, m) = ruleset(
        "  - name: r\n    key: client_ip\n    limit: { rate: 1/s, burst: 1 }\n",
        "on_reject",
    );
    assert!(req("GET", "/", &[]).from("10.0.0.1").allowed(&rules, T0));
    assert!(req("GET", "/", &[])
        .from("10.0.0.2")
        .allowed(&rules, T0 + NANOS_PER_SEC / 2));
    assert_eq!(rules.sweep(T0 + NANOS_PER_SEC), 1);
    assert_eq!(rules.tracked_keys("r"), Some(1));
    assert_eq!(m.keys.with_label_values(&["r"]).get(), 1);
    assert_eq!(m.evicted.with_label_values(&["r", "idle"]).get(), 1);
    // The key that was still refilling keeps its state: no fresh bucket.
    assert!(!req("GET", "/", &[])
        .from("10.0.0.2")
        .allowed(&rules, T0 + NANOS_PER_SEC));
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Decisions for one key are the same whether or not other keys are busy.
        #[test]
        fn decisions_for_different_keys_never_interfere(
            algorithm in proptest::sample::select(crate::limit::Algorithm::ALL.to_vec()),
            steps in proptest::collection::vec((0u64..200, proptest::bool::ANY), 1..150),
        ) {
            let rule = format!(
                "  - name: r\n    key: [header:x-k]\n    limit: {{ rate: 5/s, burst: 3, algorithm: {} }}\n",
                algorithm.name()
            );
            let (alone, _) = ruleset(&rule, "on_reject");
            let (shared, _) = ruleset(&rule, "on_reject");
            let a = req("GET", "/", &[("x-k", "a")]);
            let b = req("GET", "/", &[("x-k", "b")]);
            let mut now = T0;
            for (gap_ms, also_b) in steps {
                now += gap_ms * 1_000_000;
                if also_b {
                    shared_check(&b, &shared, now);
                }
                prop_assert_eq!(a.allowed(&alone, now), a.allowed(&shared, now), "at {}", now);
            }
        }
    }

    fn shared_check(r: &Req, rules: &RuleSet, now: Nanos) {
        let _ = r.check(rules, now);
    }
}

/// A global rule (5/s per client) built with `ratios` as the control plane's last answer.
fn global(max_keys: u32, ratios: DropRatios) -> (RuleSet, Arc<ArcSwap<DropRatios>>) {
    let yaml = format!(
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: {{ url: 'http://127.0.0.1:1' }}\nrules:\n  - name: g\n    key: client_ip\n    limit: {{ rate: 5/s }}\n    scope: global\n    max_keys: {max_keys}\n"
    );
    let config = Config::from_yaml(&yaml, "t").unwrap_or_else(|e| panic!("{e}"));
    let ratios = Arc::new(ArcSwap::from_pointee(ratios));
    let rules = RuleSet::build_with_ratios(&config, &Metrics::new(), ratios.clone());
    (rules, ratios)
}

/// `n` requests of client `ip`; how many were admitted.
fn admitted(rules: &RuleSet, ip: &str, n: u32) -> u32 {
    (0..n)
        .map(|i| {
            u32::from(
                req("GET", "/", &[])
                    .from(ip)
                    .allowed(rules, T0 + u64::from(i)),
            )
        })
        .sum()
}

#[test]
fn a_key_the_report_named_and_the_reply_left_out_is_under_its_limit_and_only_folded_keys_get_the_tails_ratio(
) {
    let (rules, ratios) = global(100, DropRatios::empty(T0));
    // Ten clients: one heavy, nine light. top_k 1 names the heavy one and folds the rest.
    for i in 0..10 {
        admitted(&rules, &format!("10.0.0.{i}"), if i == 0 { 50 } else { 1 });
    }
    let report = rules.drain_global(1, 1.0, 7, 0);
    assert_eq!(report[0].keys.len(), 1);
    assert_eq!(report[0].other.2, 9, "nine folded");
    assert!((report[0].folded.count() - 9.0).abs() < 1.0);
    let tail_at_one = || DropRatios::of(T0, [("g", None, 1.0)].into_iter());
    // Until report 7 is answered, what stood before it stands: nothing reported yet, so the
    // tail's ratio, for every key.
    ratios.store(Arc::new(tail_at_one().answering(6)));
    assert_eq!(admitted(&rules, "10.0.0.0", 20), 0, "not yet named");
    // The answer to report 7: the tail at 1 (everything dropped), the named key left out
    // (under its limit).
    ratios.store(Arc::new(tail_at_one().answering(7)));
    assert_eq!(admitted(&rules, "10.0.0.0", 20), 20, "named, left out: 0");
    assert_eq!(
        admitted(&rules, "10.0.0.5", 20),
        0,
        "folded: the tail's ratio"
    );
    assert_eq!(
        admitted(&rules, "10.9.9.9", 20),
        0,
        "never reported: limited as the tail is"
    );
    // Report 8 names 10.0.0.0 again (the heaviest); report 9 folds it (one request beside
    // 30 of another client): the fold applies once report 9 is answered, not before.
    rules.drain_global(1, 1.0, 8, 0);
    admitted(&rules, "10.0.0.0", 1);
    admitted(&rules, "10.0.0.5", 30);
    let report = rules.drain_global(1, 1.0, 9, 0);
    assert_eq!(report[0].keys[0].0, "10.0.0.5");
    ratios.store(Arc::new(tail_at_one().answering(8)));
    assert_eq!(admitted(&rules, "10.0.0.0", 20), 20, "named in 8");
    ratios.store(Arc::new(tail_at_one().answering(9)));
    assert_eq!(admitted(&rules, "10.0.0.0", 20), 0, "folded in 9");
}

#[test]
fn keys_past_the_controllers_threshold_or_watched_by_it_are_named_beyond_top_k() {
    let (rules, ratios) = global(100, DropRatios::empty(T0));
    let mut answer = DropRatios::of(T0, [("g", Some("10.0.0.9"), 0.0)].into_iter());
    answer.hint("g", 2.0, None);
    ratios.store(Arc::new(answer));
    // Over one second: 10.0.0.0 offers 50, 10.0.0.1..4 offer 3 (past 2/s), the rest 1;
    // 10.0.0.9 is watched.
    for i in 0..10 {
        let n = match i {
            0 => 50,
            1..=4 => 3,
            _ => 1,
        };
        admitted(&rules, &format!("10.0.0.{i}"), n);
    }
    let report = rules.drain_global(1, 1.0, 1, 0);
    let mut named: Vec<&str> = report[0].keys.iter().map(|k| k.0.as_str()).collect();
    named.sort_unstable();
    assert_eq!(
        named,
        ["10.0.0.0", "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.9"]
    );
    assert_eq!(report[0].other.2, 4);
}

#[test]
fn a_key_this_proxy_alone_saw_past_the_whole_limit_is_named_before_any_reply() {
    // No reply yet, so no name_above: a key one proxy was offered past the rule's fleet-wide
    // limit is over it whatever the others saw, and folded it would get the tail's ratio
    // (the bench's hidden key: its whole rate for a second).
    // The rule's limit is 5/s.
    let (rules, _ratios) = global(100, DropRatios::empty(T0));
    for (i, n) in [8, 6, 5, 4].into_iter().enumerate() {
        admitted(&rules, &format!("10.0.0.{i}"), n);
    }
    let report = rules.drain_global(1, 1.0, 1, 0);
    let mut named: Vec<&str> = report[0].keys.iter().map(|k| k.0.as_str()).collect();
    named.sort_unstable();
    assert_eq!(named, ["10.0.0.0", "10.0.0.1", "10.0.0.2"]);
    assert_eq!(report[0].other.2, 1, "under the limit here: folded");
}

#[test]
fn keys_a_full_store_cannot_track_are_counted_in_the_tails_sketch_and_get_its_ratio() {
    let (rules, ratios) = global(2, DropRatios::empty(T0));
    for i in 0..50 {
        admitted(&rules, &format!("10.1.0.{i}"), 1);
    }
    let report = rules.drain_global(10, 1.0, 1, 0);
    let tail_keys = report[0].folded.count();
    assert!(
        (tail_keys - 48.0).abs() < 4.0,
        "48 keys past the store, counted as {tail_keys}"
    );
    ratios.store(Arc::new(DropRatios::of(T0, [("g", None, 1.0)].into_iter())));
    assert_eq!(
        admitted(&rules, "10.1.0.40", 5),
        0,
        "an untracked key is in the tail"
    );
}

#[test]
fn a_cut_reply_keeps_a_named_keys_last_ratio_up_to_the_cut_instead_of_zero() {
    let before = DropRatios::of(
        T0,
        [("g", Some("a"), 0.6), ("g", Some("b"), 0.2)].into_iter(),
    );
    let mut after = DropRatios::of(T0, [("g", Some("c"), 0.9)].into_iter());
    after.hint("g", 1.0, Some(0.5));
    after.keep_cut(&before, [("g", "a"), ("g", "b"), ("g", "d")].into_iter());
    assert_eq!(after.ratio("g", b"a", false), 0.5, "at most the cut");
    assert_eq!(after.ratio("g", b"b", false), 0.2);
    assert_eq!(after.ratio("g", b"c", false), 0.9);
    assert_eq!(after.ratio("g", b"d", false), 0.0, "nothing known: 0");
    // Not cut: left out means 0.
    let mut whole = DropRatios::of(T0, [("g", Some("c"), 0.9)].into_iter());
    whole.keep_cut(&before, [("g", "a")].into_iter());
    assert_eq!(whole.ratio("g", b"a", false), 0.0);
}

#[test]
fn a_global_rule_counts_its_cost_in_units() {
    let yaml = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: { url: 'http://127.0.0.1:1' }\nrules:\n  - name: g\n    key: client_ip\n    limit: { rate: 50/s }\n    scope: global\n    cost: 5\n";
    let config = Config::from_yaml(yaml, "t").unwrap_or_else(|e| panic!("{e}"));
    let rules = RuleSet::build(&config, &Metrics::new());
    admitted(&rules, "10.0.0.1", 3);
    let report = rules.drain_global(10, 1.0, 1, 0);
    assert_eq!(report[0].keys, vec![("10.0.0.1".to_string(), 15, 15, 0.0)]);
}

/// A global rule (a million a second per client, so that its limit bounds nothing these tests
/// offer) whose ratio for 10.0.0.1 is `p`, followed by `then` (more rules, YAML list items).
/// The key is assigned (a report named it, and the ratio answers that report), and its share
/// has decided nothing yet.
fn global_at(p: f64, then: &str) -> RuleSet {
    let yaml = format!(
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: {{ url: 'http://127.0.0.1:1' }}\nrules:\n  - name: g\n    key: client_ip\n    limit: {{ rate: 1000000/s }}\n    scope: global\n{then}"
    );
    let config = Config::from_yaml(&yaml, "t").unwrap_or_else(|e| panic!("{e}"));
    let ratios = Arc::new(ArcSwap::from_pointee(DropRatios::empty(T0)));
    let rules = RuleSet::build_with_ratios(&config, &Metrics::new(), ratios.clone());
    // At ratio 0 the share is not asked.
    assert!(req("GET", "/", &[]).from("10.0.0.1").allowed(&rules, T0));
    // Reported as one request in a nanosecond: the guard (its allowance, a share of what this
    // proxy was offered, up to the limit) is far above what these tests offer, so that the
    // share decides.
    rules.drain_global(10, 1e-9, 1, 0);
    let answer = DropRatios::of(T0, [("g", Some("10.0.0.1"), p)].into_iter()).answering(1);
    ratios.store(Arc::new(answer));
    rules
}

mod shares {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// A key's share is exact: any n requests at ratio p admit round(n(1 − p)) ± 1.
        #[test]
        fn n_requests_at_ratio_p_admit_their_share_within_one(
            p in 0.0f64..=1.0,
            n in 1u32..600,
        ) {
            let rules = global_at(p, "");
            let got = admitted(&rules, "10.0.0.1", n);
            let want = (f64::from(n) * (1.0 - p)).round();
            prop_assert!((f64::from(got) - want).abs() <= 1.0, "{got} of {n} at {p}, want {want}");
        }

        /// However it starts, every stretch of a key's requests admits its share within two
        /// (each admission's place is drawn within its unit of credit).
        #[test]
        fn every_stretch_of_requests_admits_its_share_within_two(
            p in 0.01f64..0.99,
            before in 0u32..300,
            n in 1u32..300,
        ) {
            let rules = global_at(p, "");
            admitted(&rules, "10.0.0.1", before);
            let got = admitted(&rules, "10.0.0.1", n);
            let want = f64::from(n) * (1.0 - p);
            prop_assert!((f64::from(got) - want).abs() < 2.0, "{got} of {n} at {p}, want {want}");
        }
    }

    /// Far over its limit a key keeps a tiny share of what one proxy is offered (40/s of tens
    /// of thousands): its credit is fine enough that the share is still exact, not rounded
    /// down by a few percent with every request.
    #[test]
    fn a_tiny_share_is_exact_over_many_requests() {
        for keep in [1.27e-4, 3.7e-4, 7.6e-4, 5.7e-3, 2.5e-5] {
            let c = GlobalCounters::default();
            let n = 4_000_000u32;
            let got = (0..n).filter(|_| c.share(keep, 1)).count() as f64;
            let want = (f64::from(n) * keep).round();
            assert!(
                (got - want).abs() <= 1.0,
                "{got} of {n} at a share of {keep}, want {want}"
            );
        }
        // A request of many units at a tiny share (a weighted rule's cost) too.
        let c = GlobalCounters::default();
        let got = (0..1_000_000u32).filter(|_| c.share(2.5e-4, 40)).count() as f64;
        assert!(
            (got - 250.0).abs() <= 1.0,
            "{got} requests of 40 units at 2.5e-4, want 250"
        );
    }

    /// Clients of one key taking turns at a tiny share that divides the credit's unit evenly
    /// (a thousandth and less: a key far over its limit) still share the admissions: each
    /// admission's place is drawn finer than one request's earning.
    #[test]
    fn clients_taking_turns_at_a_tiny_share_all_get_some() {
        for (cycle, keep) in [(4usize, 1.0 / 1024.0), (2, 3.0 / 1024.0), (3, 1.0 / 4096.0)] {
            let c = GlobalCounters::default();
            let rounds = 400_000;
            let mut by_place = vec![0u32; cycle];
            for i in 0..cycle * rounds {
                by_place[i % cycle] += u32::from(c.share(keep, 1));
            }
            let each = rounds as f64 * keep;
            assert!(
                by_place.iter().all(|&got| f64::from(got) > each / 3.0),
                "cycle {cycle} at a share of {keep}: {by_place:?}, about {each} each"
            );
        }
    }

    /// Requests of a key that come in a fixed cycle (its clients taking turns) are admitted
    /// evenly across the cycle: none of them starves.
    #[test]
    fn a_key_whose_requests_come_in_a_fixed_cycle_starves_no_place_in_it() {
        for (cycle, p) in [
            (2usize, 0.5),
            (3, 2.0 / 3.0),
            (4, 0.75),
            (8, 0.875),
            (5, 0.5),
        ] {
            let rules = global_at(p, "");
            let rounds = 400;
            let mut by_place = vec![0u32; cycle];
            for i in 0..cycle * rounds {
                let r = req("GET", "/", &[]).from("10.0.0.1");
                by_place[i % cycle] += u32::from(r.allowed(&rules, T0 + i as u64));
            }
            // Each place's share is binomial around rounds × (1 − p): at least a third of it.
            let each = rounds as f64 * (1.0 - p);
            for (place, got) in by_place.iter().enumerate() {
                assert!(
                    f64::from(*got) > each / 3.0,
                    "cycle {cycle} at {p}: place {place} got {got}, about {each} each: {by_place:?}"
                );
            }
        }
    }

    /// A global rule at ratio 0.5 for 10.0.0.1, then a rule that grants one request per x-b
    /// value an hour (without the header it does not apply), its grant for `x-b: spent`
    /// spent: the rules, a request that rule refuses, and the time.
    fn after_a_spent_later_rule() -> (RuleSet, Req, Nanos) {
        let rules = global_at(
            0.5,
            "  - name: later\n    key: [header:x-b]\n    limit: { rate: 1/h }\n",
        );
        let refused = req("GET", "/", &[("x-b", "spent")]).from("10.0.0.1");
        let mut t = T0;
        while !refused.allowed(&rules, t) {
            t += 1;
        }
        (rules, refused, t)
    }

    /// A request a later rule refuses gives its share back: the key's next request has it.
    #[test]
    fn a_request_a_later_rule_refuses_gives_its_share_back() {
        let (rules, refused, mut t) = after_a_spent_later_rule();
        let clean = req("GET", "/", &[]).from("10.0.0.1");
        let mut passed = 0;
        for _ in 0..50 {
            t += 1;
            assert!(!refused.allowed(&rules, t));
            t += 1;
            passed += u32::from(clean.allowed(&rules, t));
        }
        // 100 requests offered at ratio 0.5: 50 admitted, and the later rule refused those
        // the global rule would have taken, so the clean ones have their places.
        assert!(passed >= 49, "{passed} of 50 clean requests admitted");
    }

    /// A later refusal gives back no more than one request's share: a key whose every
    /// request a later rule refuses banks no burst for when it relents.
    #[test]
    fn refusals_by_a_later_rule_bank_no_burst() {
        let (rules, refused, mut t) = after_a_spent_later_rule();
        for _ in 0..1000 {
            t += 1;
            refused.allowed(&rules, t);
        }
        let got = admitted(&rules, "10.0.0.1", 10);
        assert!(got <= 6, "{got} of 10 admitted after 1000 refusals at 0.5");
    }
}

mod provisional {
    use super::*;

    /// A global rule of 10/s (1 s reports) with `extra` YAML on the rule; the control plane's
    /// last reply answers report 3 and says there are `hosts` proxies (name_above is
    /// limit / 2N).
    fn fleet_of(hosts: f64, extra: &str) -> (RuleSet, Arc<ArcSwap<DropRatios>>) {
        fleet_limited(10, hosts, extra)
    }

    /// [`fleet_of`] for a rule of `limit`/s.
    fn fleet_limited(limit: u32, hosts: f64, extra: &str) -> (RuleSet, Arc<ArcSwap<DropRatios>>) {
        let yaml = format!(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: {{ url: 'http://127.0.0.1:1', report_interval: 1s }}\nrules:\n  - name: g\n    key: client_ip\n    limit: {{ rate: {limit}/s }}\n    scope: global\n{extra}"
        );
        let config = Config::from_yaml(&yaml, "t").unwrap_or_else(|e| panic!("{e}"));
        let mut answer = DropRatios::of(T0, [("g", None, 0.0)].into_iter()).answering(3);
        answer.hint("g", f64::from(limit) / (2.0 * hosts), None);
        let ratios = Arc::new(ArcSwap::from_pointee(answer));
        let rules = RuleSet::build_with_ratios(&config, &Metrics::new(), ratios.clone());
        (rules, ratios)
    }

    fn admitted_at(rules: &RuleSet, ip: &str, n: u32, at: Nanos) -> u32 {
        (0..n)
            .map(|_| u32::from(req("GET", "/", &[]).from(ip).allowed(rules, at)))
            .sum()
    }

    /// A key no reply has assigned yet is held to limit / N on each proxy, spaced evenly,
    /// not let through until its first ratio.
    #[test]
    fn a_new_key_is_held_to_the_provisional_limit_until_assigned() {
        let (rules, _) = fleet_of(5.0, "");
        // 10/s over 5 proxies: 2/s here, one every half second.
        assert_eq!(admitted_at(&rules, "10.0.0.1", 400, T0), 1);
        // (Up to a quarter of a second early: see the next test.)
        let half = NANOS_PER_SEC / 2;
        assert_eq!(admitted_at(&rules, "10.0.0.1", 400, T0 + half / 2 - 1), 0);
        assert_eq!(admitted_at(&rules, "10.0.0.1", 400, T0 + half / 2), 1);
        // The next two seconds (the ratios still fresh), four.
        let got: u32 = (1..=20)
            .map(|i| admitted_at(&rules, "10.0.0.1", 4, T0 + half + i * NANOS_PER_SEC / 10))
            .sum();
        assert_eq!(got, 4);
        // Another new key has its own.
        assert_eq!(admitted_at(&rules, "10.0.0.2", 400, T0), 1);
    }

    /// A client at the provisional rate is not refused for arriving a little early (timers,
    /// scheduling, the network): the limit takes a request up to half a spacing early, and
    /// still admits no burst beyond one request, nor over any stretch more than its rate and
    /// one request.
    #[test]
    fn a_client_at_the_provisional_rate_with_jitter_is_not_refused() {
        let (rules, _) = fleet_of(5.0, "");
        // 2/s here: one every 500 ms, each up to 120 ms early or late (260 ms apart at worst).
        let half = NANOS_PER_SEC / 2;
        let jitter = [0, 120, -120, 100, -100, 0, 110, -110, 50, -50];
        let got: u32 = jitter
            .iter()
            .enumerate()
            .map(|(i, j)| {
                let at = (T0 + i as u64 * half).saturating_add_signed(j * 1_000_000);
                admitted_at(&rules, "10.0.0.1", 1, at)
            })
            .sum();
        assert_eq!(got, 10, "every request at 2/s, jittered");
        // A burst is still one request.
        let at = T0;
        assert_eq!(admitted_at(&rules, "10.0.0.2", 400, at), 1);
        // And faster than the rate, no more than the rate over the stretch.
        let got: u32 = (0..40)
            .map(|i| admitted_at(&rules, "10.0.0.3", 1, at + i * NANOS_PER_SEC / 10))
            .sum();
        assert!(
            (8..=9).contains(&got),
            "10/s offered, 2/s held: {got} in 4 s"
        );
    }

    /// [`fleet_of`]'s rule before any reply: the ratios a proxy starts with (no hint).
    fn unhinted() -> RuleSet {
        let (rules, ratios) = fleet_of(1.0, "");
        ratios.store(Arc::new(DropRatios::empty(T0)));
        rules
    }

    /// With no hint yet (no reply has said how many proxies there are), the provisional
    /// limit is the rule's limit on each proxy.
    #[test]
    fn before_any_hint_the_provisional_limit_is_the_rules_limit() {
        let rules = unhinted();
        let got: u32 = (0..10)
            .map(|i| admitted_at(&rules, "10.0.0.1", 40, T0 + i * NANOS_PER_SEC / 10))
            .sum();
        assert_eq!(got, 10, "10/s: one every 100 ms");
    }

    /// Reports a warming controller answered (it keeps no ratios yet, so the proxy's stay
    /// the empty ones it started with) assign no key: a key two such reports named is held
    /// to its provisional limit still, not let through as a key the reply left out.
    #[test]
    fn a_key_only_warming_replies_answered_is_still_provisional() {
        let rules = unhinted();
        for (seq, second) in [(1, 0), (2, 1)] {
            let from = T0 + second * NANOS_PER_SEC;
            let got = second_of(&rules, "10.0.0.1", 40, from);
            assert!((10..=11).contains(&got), "{got} of 40 in a second at 10/s");
            rules.drain_global(10, 1.0, seq, from + NANOS_PER_SEC);
        }
        let got = admitted_at(&rules, "10.0.0.1", 400, T0 + 2 * NANOS_PER_SEC);
        assert!(got <= 1, "{got} of a burst of 400 admitted at 10/s");
    }

    /// A rule's `fallback` is its provisional limit when it has one.
    #[test]
    fn a_rules_fallback_is_its_provisional_limit() {
        let (rules, _) = fleet_of(5.0, "    fallback: { rate: 7/s }\n");
        assert_eq!(admitted_at(&rules, "10.0.0.1", 400, T0), 7);
    }

    /// The fleet trace: one event per key and report that counts it, with what it was offered
    /// and what it was allowed until then.
    #[test]
    fn a_report_traces_each_named_key_with_its_allowance() {
        struct Lines(std::sync::mpsc::Sender<Vec<u8>>);
        impl std::io::Write for Lines {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                let _ = self.0.send(b.to_vec());
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || Lines(tx.clone()))
            .finish();
        // Reported at 10/s and answered with a ratio of 0.5: allowed 5/s.
        let (rules, _) = assigned_with(0.5);
        second_of(&rules, "10.0.0.1", 12, T0 + NANOS_PER_SEC);
        tracing::subscriber::with_default(subscriber, || rules.drain_global(10, 1.0, 5, 0));
        let text = String::from_utf8(rx.try_iter().flatten().collect()).unwrap();
        for field in [
            "drained",
            "key=10.0.0.1",
            "seq=5",
            "answers=4",
            "offered=12",
            "keep=0.5",
            "allowance=5.0",
        ] {
            assert!(text.contains(field), "{field} not in {text}");
        }
    }

    /// Keys past a full store share one set of counters, but each has its own share from the
    /// reply: the guard works out each one's allowance, never one kept for another key.
    #[test]
    fn keys_past_a_full_store_are_each_guarded_by_their_own_share() {
        let (rules, ratios) = fleet_limited(40, 4.0, "    max_keys: 1\n");
        // 10.0.0.1 takes the store's one place; 10.0.0.2 goes to the shared overflow, which
        // is reported (folded) at 20/s.
        admitted_at(&rules, "10.0.0.1", 1, T0);
        second_of(&rules, "10.0.0.2", 20, T0);
        rules.drain_global(10, 1.0, 4, 0);
        // The reply names both (other proxies reported them by name): 10.0.0.2 far over its
        // limit (it keeps 0.1: an allowance of 2/s of the overflow's 20/s), 10.0.0.3 watched
        // under it (it keeps 10: an allowance of the whole limit).
        let at = T0 + NANOS_PER_SEC;
        let named = [("g", Some("10.0.0.2"), 0.9), ("g", Some("10.0.0.3"), -9.0)];
        let mut answer = DropRatios::of(at, named.into_iter()).answering(4);
        answer.hint("g", 5.0, None);
        ratios.store(Arc::new(answer));
        // 10.0.0.2 first: its share admits one of ten, and the guard works out its 2/s.
        assert_eq!(admitted_at(&rules, "10.0.0.2", 10, at), 1);
        let got = second_of(&rules, "10.0.0.3", 30, at);
        assert_eq!(got, 30, "{got} of 30 admitted under an allowance of 40/s");
    }

    /// Offers `key` `n` requests spread evenly over the second from `from`: how many pass.
    fn second_of(rules: &RuleSet, key: &str, n: u64, from: Nanos) -> u32 {
        spread(rules, key, n, from, NANOS_PER_SEC)
    }

    /// What `n` requests of `key` spread evenly over `span` from `from` admit.
    fn spread(rules: &RuleSet, key: &str, n: u64, from: Nanos, span: Nanos) -> u32 {
        (0..n)
            .map(|i| admitted_at(rules, key, 1, from + i * span / n))
            .sum()
    }

    /// `key` offered 10/s for the first second (so reported at 10/s), then a reply that
    /// answers that report with the key's ratio `ratio`; the rule's limit is 40/s over 4
    /// proxies (so that what the ratios say the fleet offers is never less than this proxy
    /// alone, and its provisional limit is 10/s).
    fn assigned(ratio: f64) -> RuleSet {
        assigned_with(ratio).0
    }

    /// [`assigned`], with the ratios the next reply is stored in.
    fn assigned_with(ratio: f64) -> (RuleSet, Arc<ArcSwap<DropRatios>>) {
        let (rules, ratios) = fleet_limited(40, 4.0, "");
        assert_eq!(second_of(&rules, "10.0.0.1", 10, T0), 10);
        rules.drain_global(10, 1.0, 4, 0);
        let at = T0 + NANOS_PER_SEC;
        ratios.store(Arc::new(reply(at, ratio, 4)));
        (rules, ratios)
    }

    /// A reply at `at` to report `answers` for the fleet of [`assigned`]: 10.0.0.1's `ratio`,
    /// and the hint of 4 proxies (a provisional limit of 10/s).
    fn reply(at: Nanos, ratio: f64, answers: u64) -> DropRatios {
        let mut answer =
            DropRatios::of(at, [("g", Some("10.0.0.1"), ratio)].into_iter()).answering(answers);
        answer.hint("g", 5.0, None);
        answer
    }

    /// What the guard admits in a second at an allowance of `per_sec`: its headroom over
    /// it, and a report interval's worth (1 s here) more.
    fn guarded_second(per_sec: f64) -> u32 {
        (2.0 * per_sec * GUARD_HEADROOM) as u32
    }

    /// What the guard admits in a second at an allowance of `per_sec` once its report
    /// interval's worth is spent: its headroom over it.
    fn headroom_second(per_sec: f64) -> u32 {
        (per_sec * GUARD_HEADROOM) as u32
    }

    /// A surge between two replies: the key's ratio of 0.5 answered a report of 10/s here,
    /// so this proxy's allowance is 5/s. Offered 30/s, the share alone would admit 15; the
    /// guard admits the allowance (with its headroom) and one report interval's worth of it.
    #[test]
    fn a_surge_on_an_assigned_key_is_held_to_its_allowance_until_the_next_reply() {
        let rules = assigned(0.5);
        let got = second_of(&rules, "10.0.0.1", 30, T0 + NANOS_PER_SEC);
        let bound = guarded_second(5.0);
        assert!(
            bound < 15 && (bound..=bound + 1).contains(&got),
            "{got} of 30 admitted"
        );
    }

    /// The key of [`assigned`] (allowed 5/s: half its own 10/s), offered `rps` for the next
    /// second, then reported (report 5: a jump to `rps`) and answered (`own_lag` 0, so the
    /// sums hold that report) with `ratio`.
    fn surged_and_answered(rps: u64, ratio: f64) -> RuleSet {
        let (rules, ratios) = assigned_with(0.5);
        second_of(&rules, "10.0.0.1", rps, T0 + NANOS_PER_SEC);
        let report = rules.drain_global(10, 1.0, 5, 0);
        assert_eq!(report[0].keys[0].3, rps as f64 - 10.0, "the report's jump");
        let at = T0 + 2 * NANOS_PER_SEC;
        ratios.store(Arc::new(reply(at, ratio, 5)));
        rules
    }

    /// A surge here that the fleet shares: reported at 10/s, then 30/s (a jump), and answered
    /// by sums that hold that report and grew with it (a ratio of 0.8: the fleet offers 200/s
    /// where it offered 80/s, past half this proxy's jump of 20/s). Until the sums hold the
    /// report after it (the other proxies' jumps may still be on their way), the key is held
    /// to what it was allowed before, 5/s, without headroom: offered 60/s, a second of 5/s
    /// passes (the surge's first second spent the report interval's worth), not the share's
    /// 12.
    #[test]
    fn a_surge_the_fleet_shares_is_held_to_what_was_allowed_until_the_sums_hold_the_next_report() {
        let rules = surged_and_answered(30, 0.8);
        let got = second_of(&rules, "10.0.0.1", 60, T0 + 2 * NANOS_PER_SEC);
        assert_eq!(got, 5, "{got} of 60 admitted");
    }

    /// Clients moving to this proxy (the fleet's load unchanged): reported at 10/s, then 30/s,
    /// and answered by sums that hold that report with the fleet's load where it was (a ratio
    /// of 0.5 still). Held to 5/s until then, the key is allowed half its new 30/s at once:
    /// offered 120/s (the share alone: 60), a second of 15/s with headroom passes.
    #[test]
    fn clients_that_moved_here_get_their_share_once_the_sums_hold_their_jump() {
        let rules = surged_and_answered(30, 0.5);
        let got = second_of(&rules, "10.0.0.1", 120, T0 + 2 * NANOS_PER_SEC);
        let bound = headroom_second(15.0);
        assert!(
            (bound - 1..=bound + 1).contains(&got),
            "{got} of 120 admitted, against {bound}"
        );
    }

    /// Before the sums hold the jump, moved clients and a surge look alike here: both are held
    /// to what this proxy was allowed, without headroom.
    #[test]
    fn before_the_sums_hold_a_jump_it_is_held_to_what_was_allowed() {
        let (rules, _) = assigned_with(0.5);
        second_of(&rules, "10.0.0.1", 30, T0 + NANOS_PER_SEC);
        rules.drain_global(10, 1.0, 5, 0);
        // Still the answer to report 4: 5/s, where the headroom gave 6.
        let got = second_of(&rules, "10.0.0.1", 60, T0 + 2 * NANOS_PER_SEC);
        assert_eq!(got, 5, "{got} of 60 admitted");
    }

    /// The sums hold the report after the jump: the surge's hold ends, and the key is allowed
    /// its share of its new rate (with headroom).
    #[test]
    fn a_surges_hold_ends_when_the_sums_hold_the_report_after_it() {
        let (rules, ratios) = assigned_with(0.5);
        second_of(&rules, "10.0.0.1", 30, T0 + NANOS_PER_SEC);
        rules.drain_global(10, 1.0, 5, 0);
        second_of(&rules, "10.0.0.1", 30, T0 + 2 * NANOS_PER_SEC);
        let report = rules.drain_global(10, 1.0, 6, 0);
        assert_eq!(
            report[0].keys[0].3, 0.0,
            "the report after a jump follows it"
        );
        let at = T0 + 3 * NANOS_PER_SEC;
        ratios.store(Arc::new(reply(at, 0.8, 6)));
        // 30/s x 0.2: 6/s, with headroom (the interval's worth was spent).
        let got = second_of(&rules, "10.0.0.1", 60, at);
        let bound = headroom_second(6.0);
        assert!(
            (bound - 1..=bound + 1).contains(&got),
            "{got} of 60 admitted, against {bound}"
        );
    }

    /// A key under its limit travels with a ratio below 0, `(offered - limit) / offered`:
    /// at -1 the fleet offers half its limit (20/s, this proxy's 10/s half of it), so this
    /// proxy may grow to twice what it reported (20/s, and a report interval's worth) before
    /// the next reply.
    #[test]
    fn a_key_under_its_limit_may_grow_to_its_share_of_the_limit() {
        let rules = assigned(-1.0);
        let got = second_of(&rules, "10.0.0.1", 80, T0 + NANOS_PER_SEC);
        let bound = guarded_second(20.0);
        assert!(
            bound < 80 && (bound..=bound + 1).contains(&got),
            "{got} of 80 admitted"
        );
        // And nothing is dropped below it.
        let rules = assigned(-1.0);
        assert_eq!(second_of(&rules, "10.0.0.1", 20, T0 + NANOS_PER_SEC), 20);
    }

    /// A key the fleet barely offers (the sums' smoothed rate near nothing, while this proxy's
    /// own part of it is not: the two are smoothed in different places) has a ratio far below
    /// 0, and the share it gives this proxy is still no more than the rule's whole limit
    /// (40/s, and a report interval's worth), not a million times what it reported.
    #[test]
    fn a_key_the_fleet_barely_offers_is_allowed_no_more_than_the_rules_limit() {
        let rules = assigned(-1e6);
        let got = second_of(&rules, "10.0.0.1", 400, T0 + NANOS_PER_SEC);
        let bound = guarded_second(40.0);
        assert!(
            (bound..=bound + 1).contains(&got),
            "{got} of 400 admitted, against {bound}"
        );
    }

    /// A ratio of exactly 0 (what a controller one version back sends for a key it watches)
    /// says nothing of the fleet's load: no bound.
    #[test]
    fn a_ratio_of_zero_sets_no_bound() {
        let rules = assigned(0.0);
        assert_eq!(second_of(&rules, "10.0.0.1", 60, T0 + NANOS_PER_SEC), 60);
    }

    /// A key of a 400/s rule over 4 proxies offered 100/s here for a second, that report
    /// taken at `drained` (0: a time not known) and answered with the key's ratio 0.5: this
    /// proxy's allowance is 50/s.
    fn allowed_half_of_100(drained: Nanos) -> RuleSet {
        answered(400, 100, 0.5, drained)
    }

    /// A key of a `limit`/s rule over 4 proxies offered `offered` a second here for a second,
    /// that report taken at `drained` and answered with the key's `ratio`.
    fn answered(limit: u32, offered: u64, ratio: f64, drained: Nanos) -> RuleSet {
        let (rules, ratios) = fleet_limited(limit, 4.0, "");
        second_of(&rules, "10.0.0.1", offered, T0);
        rules.drain_global(10, 1.0, 4, drained);
        let mut answer = DropRatios::of(
            T0 + NANOS_PER_SEC,
            [("g", Some("10.0.0.1"), ratio)].into_iter(),
        )
        .answering(4);
        answer.hint("g", f64::from(limit) / 8.0, None);
        ratios.store(Arc::new(answer));
        rules
    }

    /// The fleet's ratio is of what it was offered a reply ago: when this proxy's load swings
    /// after the report (a closed loop's clients, a busy machine), the share admits this
    /// proxy's allowance of what it is offered now, not the ratio of it. Offered 30 % more
    /// or 10 % less than it reported, it admits about its 50/s either way, where the ratio
    /// alone admits 65 or 45.
    #[test]
    fn an_assigned_key_admits_its_allowance_of_what_it_is_offered_now() {
        let after = T0 + NANOS_PER_SEC;
        for (offered, within) in [(130, 46..=54), (90, 47..=53)] {
            let rules = allowed_half_of_100(after);
            let got = second_of(&rules, "10.0.0.1", offered, after);
            assert!(
                within.contains(&got),
                "{got} of {offered} admitted, allowed 50/s"
            );
        }
        // With no report taken lately (or none whose time is known), the ratio decides.
        for drained in [0, T0 - 3 * NANOS_PER_SEC] {
            let rules = allowed_half_of_100(drained);
            let got = second_of(&rules, "10.0.0.1", 130, after);
            assert!(
                (64..=66).contains(&got),
                "{got} of 130 admitted at a ratio of 0.5"
            );
        }
    }

    /// A client that waits out most of the interval and then sends its usual count at once
    /// reads as a low rate since the report: the share goes past the ratio's by an eighth at
    /// most, not up to its allowance of that low rate.
    #[test]
    fn a_client_that_waits_and_then_sends_at_once_gains_little_past_the_ratio() {
        let after = T0 + NANOS_PER_SEC;
        let rules = allowed_half_of_100(after);
        let late = after + 8 * NANOS_PER_SEC / 10;
        let got: u32 = (0..100)
            .map(|i| admitted_at(&rules, "10.0.0.1", 1, late + i * NANOS_PER_SEC / 500))
            .sum();
        assert!(got <= 57, "{got} of 100 admitted at a ratio of 0.5");
    }

    /// What `n` requests spread over the second from `from`, after a pause of `pause` ms,
    /// admit.
    fn paused_second(rules: &RuleSet, from: Nanos, pause: u64, n: u64) -> u32 {
        let ms = NANOS_PER_SEC / 1000;
        spread(rules, "10.0.0.1", n, from + pause * ms, (1000 - pause) * ms)
    }

    /// A client that pauses after each report (the 429's `Retry-After` says when it comes)
    /// and then sends its usual count over the rest of the interval reads as a low rate
    /// since the report: however long the pause, it gains an eighth past its allowance at
    /// most.
    #[test]
    fn a_client_that_pauses_after_each_report_gains_little() {
        let after = T0 + NANOS_PER_SEC;
        for pause in [100, 125, 150, 200, 500] {
            let rules = allowed_half_of_100(after);
            let got = paused_second(&rules, after, pause, 100);
            assert!(
                got <= 56,
                "{got} of 100 after a {pause} ms pause, allowed 50/s"
            );
        }
    }

    /// A key of a 1600/s rule over 4 proxies offered 4000/s here for a second, that report
    /// taken at `drained` and answered with the key's ratio 0.9: this proxy's allowance is
    /// 400/s, a tenth of what it is offered.
    fn allowed_tenth_of_4000(drained: Nanos) -> RuleSet {
        answered(1600, 4000, 0.9, drained)
    }

    /// [`allowed_tenth_of_4000`], and a second offered 4000/s after its reply: the time the
    /// next second starts.
    fn paced_for_a_second(rules: &RuleSet) -> Nanos {
        let after = T0 + NANOS_PER_SEC;
        let got = second_of(rules, "10.0.0.1", 4000, after);
        // The allowance, and the interval's worth the guard takes early at first.
        assert!((400..=801).contains(&got), "{got} of 4000, allowed 400/s");
        after + NANOS_PER_SEC
    }

    /// A key offered thousands a second (a closed loop's clients on a busy machine) whose
    /// offered rate falls or rises by 40 % within an interval: what was counted since the
    /// report lags the swing, so the share alone admits a sixth less or more than this
    /// proxy's allowance in that second. It is paced instead: its allowance, give or take a
    /// few requests.
    #[test]
    fn a_heavy_key_admits_its_allowance_when_its_load_swings_within_an_interval() {
        for then in [2400, 5600] {
            let rules = allowed_tenth_of_4000(T0 + NANOS_PER_SEC);
            let after = paced_for_a_second(&rules);
            let half = NANOS_PER_SEC / 2;
            let first = spread(&rules, "10.0.0.1", 2000, after, half);
            let second = spread(&rules, "10.0.0.1", then / 2, after + half, half);
            let got = first + second;
            assert!(
                (392..=408).contains(&got),
                "{got} admitted ({first} + {second}) offered 4000/s then {then}/s, allowed 400/s"
            );
        }
    }

    /// Pacing lets the guard, not the share, pick which requests of a heavy key pass: two
    /// clients taking turns (A, B, A, B) both still get about half.
    #[test]
    fn a_paced_key_whose_clients_take_turns_starves_neither() {
        let rules = allowed_tenth_of_4000(T0 + NANOS_PER_SEC);
        let after = paced_for_a_second(&rules);
        let mut each = [0u32; 2];
        for i in 0..4000 {
            let t = after + i * NANOS_PER_SEC / 4000;
            each[(i % 2) as usize] += admitted_at(&rules, "10.0.0.1", 1, t);
        }
        assert!(
            each.iter().all(|&n| n >= 160),
            "{each:?} of 2000 each, allowed 400/s between them"
        );
    }

    /// A heavy key whose requests come in a burst each second (a batch, a pool of connections
    /// firing together) still gets its allowance: what the pace did not let through while the
    /// key was quiet, it lets through in the burst, up to a report interval's worth.
    #[test]
    fn a_heavy_key_that_comes_in_bursts_still_gets_its_allowance() {
        let rules = allowed_tenth_of_4000(T0 + NANOS_PER_SEC);
        let after = paced_for_a_second(&rules);
        let ms = NANOS_PER_SEC / 1000;
        // Quiet for 900 ms, then 4000 in 100 ms.
        let got = spread(&rules, "10.0.0.1", 4000, after + 900 * ms, 100 * ms);
        // (Up to two more: where each place of the pace frees is drawn within two spacings.)
        assert!(
            (380..=403).contains(&got),
            "{got} of a burst of 4000, allowed 400/s"
        );
    }

    /// Pacing counts requests, not units: a key of requests of cost 100 offered 2000 units a
    /// second (20 requests) is too few requests to estimate an allowance from closely, and its
    /// share decides, within the guard's headroom, as for any light key.
    #[test]
    fn a_key_of_few_costly_requests_is_not_paced() {
        let c = GlobalCounters::default();
        (0..20).for_each(|_| {
            c.offer(100);
        });
        c.take(1.0, 1, || (0.0, 0.0, false));
        let (_, paced) = c.keep_now(0.1, || 200.0, (0.0, 100), 0, NANOS_PER_SEC);
        assert!(!paced, "20 requests of cost 100 paced");
        let (keep, paced) = c.keep_now(0.1, || 200.0, (0.0, 1), 0, NANOS_PER_SEC);
        assert!(
            paced && keep == 0.2,
            "2000 requests of cost 1: {keep} {paced}"
        );
    }

    /// A heavy key's client that pauses after each report and then sends its usual count
    /// over the rest of the interval gains nothing: pacing spends no credit it did not earn.
    #[test]
    fn a_heavy_client_that_pauses_after_each_report_gains_nothing() {
        for pause in [100, 250, 500, 800] {
            let rules = allowed_tenth_of_4000(T0 + NANOS_PER_SEC);
            let after = paced_for_a_second(&rules);
            let got = paused_second(&rules, after, pause, 4000);
            // (Up to two more: where each place of the pace frees is drawn within two spacings.)
            assert!(
                got <= 402,
                "{got} of 4000 after a {pause} ms pause, allowed 400/s"
            );
        }
    }

    /// The controller smooths its sums from when each report's rates arrive, so sums taken as
    /// a report arrives pair with this proxy's smoothed rate from the report before it: a key
    /// at 100/s, 110/s, then 120/s (no step), answered at 0.5, is allowed half of its rate
    /// smoothed through the second report (behind an aggregator, the first), not the last.
    #[test]
    fn the_allowance_pairs_with_the_rate_the_sums_have_weighed() {
        let c = GlobalCounters::default();
        let none = || (0.0, 0.0, false);
        for (seq, n) in [(1, 100), (2, 110), (3, 120)] {
            (0..n).for_each(|_| {
                c.offer(1);
            });
            c.take(1.0, seq, none);
        }
        let second = 100.0 + (1.0 - (-1.0f64).exp()) * 10.0;
        let near = |a: f64, b: f64| (a - b).abs() < 1e-3;
        // Straight to the controller (the sums hold report 3): the rate as of report 2.
        let (allowed, _) = c.allowance(0.5, 3, 0, 1e6);
        assert!(near(allowed, second / 2.0), "{allowed}");
        // Behind an aggregator (they hold report 2): as of report 1.
        let (allowed, _) = c.allowance(0.5, 3, 1, 1e6);
        assert!(near(allowed, 50.0), "{allowed}");
        // A step moves both at once: sums holding report 4, a jump to 300/s, pair with it.
        (0..300).for_each(|_| {
            c.offer(1);
        });
        c.take(1.0, 4, none);
        let (allowed, _) = c.allowance(0.5, 4, 0, 1e6);
        assert!(near(allowed, 150.0), "{allowed}");
    }

    /// A key at 4000/s here, allowed 400 of it (a share of 0.1 of a fleet of three such
    /// proxies under a limit of 1200), falls to 1500/s at report 4 and comes back at report
    /// `back`, allowed 150 in the dip by ratios that kept `keep_then`: what the surge is held
    /// to until the sums hold it.
    fn held_after_a_dip(back: u64, keep_then: f64) -> Option<f64> {
        let c = GlobalCounters::default();
        let none = || (0.0, 0.0, false);
        let offer = |n: u32| {
            c.offer(n);
        };
        for seq in 1..=3 {
            offer(4000);
            c.take(1.0, seq, none);
        }
        offer(1500);
        let (_, _, jump) = c.take(1.0, 4, || (400.0, 0.1, false));
        assert!(jump < 0.0, "{jump}");
        for seq in 5..back {
            offer(1500);
            c.take(1.0, seq, none);
        }
        offer(4000);
        let (_, _, jump) = c.take(1.0, back, || (150.0, keep_then, false));
        assert!(jump > 0.0, "{jump}");
        c.held(keep_then, back - 1, 0, 1200.0)
    }

    /// Load that falls and comes back within a few reports while the fleet's fell by as large
    /// a part (a busy machine's closed loop) is no surge past what this proxy was allowed
    /// before the fall: the hold is that, not the little it was allowed in the dip (its own
    /// rate had stepped down a reply before the sums did). Load that left for another proxy
    /// and came back (the fleet's unchanged: that proxy was given its part meanwhile), load
    /// that left this proxy, or all but one, and came back (the proxies that fell less were
    /// given a larger share meanwhile), or a dip long past, is held to what it was allowed
    /// just before.
    #[test]
    fn load_coming_back_after_a_fleet_wide_dip_is_held_to_what_was_allowed_before_it() {
        // This proxy fell by 5/8 of its 4000/s; the others by a little more (the fleet's 12 000
        // to 4 400): the fleet's share rose to 1200 / 4400.
        assert_eq!(held_after_a_dip(5, 1200.0 / 4400.0), Some(400.0));
        assert_eq!(held_after_a_dip(7, 1200.0 / 4400.0), Some(400.0));
        // Only this one fell, its load gone to another: the fleet's share stayed 0.1.
        assert_eq!(held_after_a_dip(5, 0.1), Some(150.0));
        // Only this one fell, its load gone (a client that pauses here to come back to the
        // pre-dip allowance while the others were given its part): the fleet's 12 000 fell by
        // this proxy's 2 500 alone.
        assert_eq!(held_after_a_dip(5, 1200.0 / 9500.0), Some(150.0));
        // Two of the three fell alike, the third not (a client that pauses on all but one
        // proxy): the fleet's 12 000 fell to 7 000, a smaller part than this proxy's.
        assert_eq!(held_after_a_dip(5, 1200.0 / 7000.0), Some(150.0));
        // The others fell by a smaller part than this one (to 1800/s each: 5 100 in all).
        assert_eq!(held_after_a_dip(5, 1200.0 / 5100.0), Some(150.0));
        // Long after the fall.
        assert_eq!(held_after_a_dip(10, 1200.0 / 4400.0), Some(150.0));
    }

    /// Once a reply answers a report that named or folded the key, its ratio decides alone.
    #[test]
    fn an_assigned_key_is_decided_by_its_ratio() {
        let (rules, ratios) = fleet_of(5.0, "");
        admitted_at(&rules, "10.0.0.1", 400, T0);
        rules.drain_global(10, 1.0, 4, 0);
        let mut answer = DropRatios::of(T0, [("g", None, 0.0)].into_iter()).answering(4);
        answer.hint("g", 1.0, None);
        ratios.store(Arc::new(answer));
        assert_eq!(admitted_at(&rules, "10.0.0.1", 400, T0 + 1), 400);
    }
}

/// A key the last report had is not forgotten by a sweep right after that report (the
/// sweeper and the reporter tick together): forgotten, it would be a new key again, held to
/// its provisional limit until a reply assigns it anew. Idle means a whole interval unoffered.
#[test]
fn a_sweep_right_after_a_report_keeps_the_keys_that_report_had() {
    let rules = global_at(0.5, "");
    admitted(&rules, "10.0.0.1", 10);
    rules.drain_global(10, 1.0, 2, 0);
    assert_eq!(rules.sweep(T0 + 10), 0, "offered in the last interval");
    assert_eq!(rules.tracked_keys("g"), Some(1));
    // A client that pauses between requests (one a second, reports every 250 ms) keeps its
    // key assigned: idle means QUIET_REPORTS reports in a row found it unoffered.
    for seq in 3..2 + QUIET_REPORTS {
        rules.drain_global(10, 0.25, seq, 0);
        assert_eq!(rules.sweep(T0 + 20), 0, "quiet for {} reports", seq - 2);
    }
    rules.drain_global(10, 0.25, 2 + QUIET_REPORTS, 0);
    assert_eq!(rules.sweep(T0 + 20), 1);
}

/// A full store makes room sooner than the sweep forgets: a key one report found unoffered
/// gives its place to a new key (nothing is lost but its assignment).
#[test]
fn a_full_store_takes_the_place_of_a_key_one_report_found_unoffered() {
    let rules = global_at(0.0, "    max_keys: 1\n");
    admitted(&rules, "10.0.0.1", 1);
    rules.drain_global(10, 1.0, 2, 0);
    rules.drain_global(10, 1.0, 3, 0);
    admitted(&rules, "10.0.0.2", 1);
    let counts = rules.drain_global(10, 1.0, 4, 0);
    assert_eq!(counts[0].keys, vec![("10.0.0.2".to_string(), 1, 1, 0.0)]);
    assert_eq!(rules.tracked_keys("g"), Some(1));
}

/// A global rule keyed by a header reports its keys by their digest, and a ratio for that
/// digest applies to the key; the key in clear is nowhere in the report.
#[test]
fn a_global_key_with_a_header_is_reported_and_dropped_by_its_digest() {
    let yaml = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: { url: 'http://127.0.0.1:1' }\nrules:\n  - name: g\n    key: [client_ip, header:x-api-key]\n    limit: { rate: 5/s }\n    scope: global\n";
    let config = Config::from_yaml(yaml, "t").unwrap_or_else(|e| panic!("{e}"));
    let ratios = Arc::new(ArcSwap::from_pointee(DropRatios::empty(T0)));
    let secret = crate::digest::Secret::default();
    let rules = RuleSet::build_with_ratios(&config, &Metrics::new(), ratios.clone())
        .with_secret(secret.clone());
    let r = req("GET", "/", &[("x-api-key", "sk_live_abc")]).from("10.0.0.1");
    assert!(r.allowed(&rules, T0));
    let report = rules.drain_global(10, 1.0, 1, 0);
    let named: Vec<&str> = report[0].keys.iter().map(|k| k.0.as_str()).collect();
    let digest = format!("10.0.0.1\u{1f}{}", secret.of_value(b"sk_live_abc"));
    assert_eq!(named, [digest.as_str()]);
    // The answer names the digest: the key is dropped.
    ratios.store(Arc::new(
        DropRatios::of(T0, [("g", Some(digest.as_str()), 1.0)].into_iter()).answering(1),
    ));
    assert!(
        !r.allowed(&rules, T0 + 1),
        "the digest's ratio did not apply"
    );
    // A ratio for the key in clear is no ratio of this key.
    let clear = "10.0.0.1\u{1f}sk_live_abc";
    ratios.store(Arc::new(
        DropRatios::of(T0, [("g", Some(clear), 1.0)].into_iter()).answering(1),
    ));
    assert!(r.allowed(&rules, T0 + 2));
}

#[test]
fn a_shared_adaptive_limit_gives_one_client_its_share_and_an_ipv6_client_is_its_64() {
    let (rules, _m) = ruleset(
        "  - name: cap\n    key: []\n    limit: { adaptive: { min: 8, max: 8 } }\n",
        "on_reject",
    );
    let mut held = Vec::new();
    let mut take = |ip: &str| match req("GET", "/", &[]).from(ip).check(&rules, T0) {
        Verdict::Allow(a) => {
            held.push(a);
            true
        }
        _ => false,
    };
    let one: Vec<bool> = (0..5).map(|_| take("192.0.2.1")).collect();
    assert_eq!(one, [true, true, true, true, false], "half of 8");
    let other: Vec<bool> = (0..5).map(|_| take("198.51.100.1")).collect();
    assert_eq!(other, [true, true, true, true, false], "the other half");
    drop(held);
    let (rules, _m) = ruleset(
        "  - name: cap\n    key: []\n    limit: { adaptive: { min: 8, max: 8 } }\n",
        "on_reject",
    );
    let mut held = Vec::new();
    let v6: Vec<bool> = (0..5)
        .map(|i| {
            let ip = format!("2001:db8:0:2::{}", i + 1);
            match req("GET", "/", &[]).from(&ip).check(&rules, T0) {
                Verdict::Allow(a) => {
                    held.push(a);
                    true
                }
                _ => false,
            }
        })
        .collect();
    assert_eq!(v6, [true, true, true, true, false], "one /64, one client");
    // Loopback has no part: it may take the rest whole.
    let lo = (0..5)
        .filter(
            |_| match req("GET", "/", &[]).from("127.0.0.1").check(&rules, T0) {
                Verdict::Allow(a) => {
                    held.push(a);
                    true
                }
                _ => false,
            },
        )
        .count();
    assert_eq!(lo, 4, "loopback takes what the shared limit has left");
}

#[test]
fn a_reload_keeps_a_rules_state_only_while_what_its_state_was_built_from_is_the_same() {
    let build = |extra: &str| {
        let yaml = format!(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: a\n    key: client_ip\n    limit: {{ rate: 10/s }}\n{extra}  - name: b\n    key: []\n    limit: {{ concurrency: 4 }}\n"
        );
        Config::from_yaml(&yaml, "t").unwrap_or_else(|e| panic!("{e}"))
    };
    let metrics = Metrics::new();
    let ratios = || Arc::new(ArcSwap::from_pointee(DropRatios::empty(0)));
    let first = RuleSet::build(&build(""), &metrics);
    let same = RuleSet::rebuild(&build(""), &metrics, ratios(), Some(&first));
    assert_eq!(same.kept_from(&first), ["a", "b"]);
    // Each of these changes what a rule's state was built from: it starts afresh.
    for extra in [
        "    sketch: { width: 1024, depth: 4 }\n",
        "    max_keys: 5\n",
        "    log_keys: clear\n",
    ] {
        let changed = RuleSet::rebuild(&build(extra), &metrics, ratios(), Some(&first));
        assert_eq!(changed.kept_from(&first), ["b"], "{extra}");
    }
    let b = |extra: &str| {
        let yaml = format!(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: b\n    key: []\n    limit: {{ concurrency: 4 }}\n{extra}"
        );
        Config::from_yaml(&yaml, "t").unwrap_or_else(|e| panic!("{e}"))
    };
    let first = RuleSet::build(&b(""), &metrics);
    for extra in ["    release: head\n", "    client_share: 0.25\n"] {
        let changed = RuleSet::rebuild(&b(extra), &metrics, ratios(), Some(&first));
        assert!(changed.kept_from(&first).is_empty(), "{extra}");
    }
}

#[test]
fn client_ip_blocks_select_and_exempt_clients() {
    let (rules, m) = ruleset(
        r#"  - name: partners
    match: { client_ip: [198.51.100.0/24, "2001:db8:1::/48"] }
    key: client_ip
    limit: { rate: 1/h, burst: 3 }
  - name: everyone-else
    match: { except_client_ip: [198.51.100.0/24, 203.0.113.7, "2001:db8:1::/48"] }
    key: client_ip
    limit: { rate: 1/h, burst: 1 }
"#,
        "on_reject",
    );
    let admitted = |ip: &str| {
        let r = req("GET", "/", &[]).from(ip);
        (0..10).filter(|_| r.allowed(&rules, T0)).count()
    };
    assert_eq!(
        admitted("198.51.100.9"),
        3,
        "a partner has its own limit only"
    );
    assert_eq!(
        admitted("::ffff:198.51.100.10"),
        3,
        "an IPv4-mapped partner too"
    );
    assert_eq!(admitted("2001:db8:1:ffff::1"), 3);
    assert_eq!(
        admitted("203.0.113.7"),
        10,
        "the exempt office is limited by neither"
    );
    assert_eq!(admitted("203.0.113.8"), 1, "its neighbour is not exempt");
    assert_eq!(admitted("2001:db8:2::1"), 1);
    assert_eq!(count(&m, "partners", "allowed"), 9);
}

#[test]
fn a_client_ip_block_that_is_not_a_block_is_refused() {
    for bad in ["10.0.0.1/8", "10.0.0.0/33", "office", "fd00::/129"] {
        let yaml = format!(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: r\n    match: {{ except_client_ip: [\"{bad}\"] }}\n    key: client_ip\n    limit: {{ rate: 1/s }}\n"
        );
        let e = Config::from_yaml(&yaml, "t").unwrap_err().to_string();
        assert!(e.contains(bad), "{bad}: {e}");
    }
}

#[test]
fn an_override_replaces_the_rules_limit_for_its_key_only() {
    let (rules, m) = ruleset(
        r#"  - name: per-key
    key: [header:x-api-key]
    limit: { rate: 2/m }
    overrides:
      - { key: vip, limit: { rate: 10/m } }
      - { key: partner, limit: unlimited }
      - { key: naughty, limit: { rate: 1/m } }
"#,
        "always",
    );
    let admitted = |k: &str| {
        let r = req("GET", "/", &[("x-api-key", k)]);
        (0..30).filter(|_| r.allowed(&rules, T0)).count()
    };
    assert_eq!(admitted("vip"), 10, "a raise: more than the rule's 2");
    assert_eq!(admitted("partner"), 30, "unlimited");
    assert_eq!(admitted("naughty"), 1, "a cut");
    assert_eq!(admitted("someone"), 2, "everyone else has the rule's");
    // The unlimited key is not decided by the rule at all.
    assert_eq!(count(&m, "per-key", "allowed"), 13);
    // A raised key's answers carry its own policy.
    let Verdict::Deny(d) = req("GET", "/", &[("x-api-key", "vip")]).check(&rules, T0) else {
        panic!("vip is spent")
    };
    assert_eq!(d.state.policy(), "\"per-key\";q=10;w=60");
    let Verdict::Deny(d) = req("GET", "/", &[("x-api-key", "someone")]).check(&rules, T0) else {
        panic!("someone is spent")
    };
    assert_eq!(d.state.policy(), "\"per-key\";q=2;w=60");
}

#[test]
fn an_override_written_as_a_digest_or_in_parts_finds_its_key() {
    let secret = crate::digest::Secret::default();
    let digest = secret.of_value(b"sk-live-123");
    let (rules, _) = ruleset(
        &format!(
            r#"  - name: per-key
    key: [header:x-api-key]
    limit: {{ rate: 1/m }}
    overrides:
      - {{ key: "{digest}", limit: {{ rate: 5/m }} }}
  - name: per-route
    key: [header:x-tenant, method, path]
    limit: {{ rate: 1/m }}
    overrides:
      - {{ key: [acme, POST, /Upload/], limit: {{ rate: 3/m }} }}
"#
        ),
        "on_reject",
    );
    let rules = rules.with_secret(secret);
    let r = req("GET", "/", &[("x-api-key", "sk-live-123")]);
    assert_eq!((0..9).filter(|_| r.allowed(&rules, T0)).count(), 5);
    let r = req("GET", "/", &[("x-api-key", "sk-live-124")]);
    assert_eq!((0..9).filter(|_| r.allowed(&rules, T0)).count(), 1);
    // The path as rules see it: without case or its trailing slash.
    let r = req("POST", "/upload", &[("x-tenant", "acme")]);
    assert_eq!((0..9).filter(|_| r.allowed(&rules, T0)).count(), 3);
    let r = req("GET", "/upload", &[("x-tenant", "acme")]);
    assert_eq!((0..9).filter(|_| r.allowed(&rules, T0)).count(), 1);
}

#[test]
fn overrides_that_cannot_hold_as_written_are_refused() {
    let bad = [
        ("key: [header:k]\n    limit: { rate: 2/m }\n    overrides: [{ key: [a, b], limit: unlimited }]", "part"),
        ("key: [header:k]\n    limit: { rate: 2/m }\n    overrides: [{ key: a, limit: { concurrency: 3 } }]", "rate"),
        ("key: [header:k]\n    limit: { concurrency: 2 }\n    overrides: [{ key: a, limit: { rate: 3/s } }]", "concurrency"),
        ("key: [header:k]\n    limit: { rate: 2/m }\n    overrides: [{ key: a, limit: unlimited }, { key: a, limit: { rate: 1/s } }]", "same key"),
        ("key: []\n    limit: { rate: 2/m }\n    overrides: [{ key: a, limit: unlimited }]", "needs a key"),
        ("key: [header:k]\n    limit: { rate: 2/m, algorithm: fixed_window }\n    overrides: [{ key: a, limit: { rate: 10/h } }]", "burst"),
        ("key: [header:k]\n    limit: { rate: 2/m }\n    cost: 5\n    overrides: [{ key: a, limit: { rate: 4/m } }]", "cost"),
        ("key: [header:k]\n    limit: { rate: 2/m }\n    overrides: [{ key: a, limit: lots }]", "unlimited"),
        ("key: [client_ip]\n    limit: { rate: 2/m }\n    overrides: [{ key: office, limit: unlimited }]", "address"),
        ("key: [header:k, header:j]\n    limit: { rate: 2/m }\n    overrides: [{ key: [\"~0123456789abcdef0123456789abcdef\", clear], limit: unlimited }]", "digest"),
        ("key: [header:k]\n    scope: global\n    limit: { rate: 2/m }\n    overrides: [{ key: a, limit: { rate: 4/m, burst: 8 } }]", "burst"),
        ("key: [header:k]\n    limit: { rate: 2/m }\n    overrides: [{ key: \"~0123456789ABCDEF0123456789ABCDEF\", limit: unlimited }]", "lower-case hex"),
        ("key: [header:k]\n    limit: { rate: 2/m }\n    overrides: [{ key: a, limit: { rate: 4/m, brust: 8 } }]", "unlimited, { rate"),
        ("key: [client_ip]\n    limit: { rate: 2/m }\n    overrides: [{ key: 203.0.113.0/24, limit: unlimited }]", "one client"),
        ("key: [client_ip/24]\n    limit: { rate: 2/m }\n    overrides: [{ key: 203.0.113.0/16, limit: unlimited }]", "/24"),
        ("key: [host]\n    limit: { rate: 2/m }\n    overrides: [{ key: \"api.example.com:443\", limit: unlimited }]", "port"),
        ("key: [method]\n    limit: { rate: 2/m }\n    overrides: [{ key: get, limit: unlimited }]", "upper case"),
    ];
    for (rule, want) in bad {
        let yaml = format!(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: {{ url: http://127.0.0.1:1 }}\nrules:\n  - name: r\n    {rule}\n"
        );
        let e = Config::from_yaml(&yaml, "t").unwrap_err().to_string();
        assert!(e.contains(want), "{rule}: {e}");
    }
}

#[test]
fn a_rule_that_replaces_another_stands_in_for_it() {
    let (rules, m) = ruleset(
        r#"  - name: default
    key: client_ip
    limit: { rate: 2/m }
  - name: partners
    match: { headers: { x-plan: partner } }
    key: client_ip
    limit: { rate: 5/m }
    replaces: [default]
  - name: everyone
    key: client_ip
    limit: { rate: 20/m }
"#,
        "on_reject",
    );
    let admitted = |r: &Req| (0..30).filter(|_| r.allowed(&rules, T0)).count();
    assert_eq!(
        admitted(&req("GET", "/", &[("x-plan", "partner")]).from("10.0.0.1")),
        5
    );
    assert_eq!(admitted(&req("GET", "/", &[]).from("10.0.0.2")), 2);
    assert_eq!(
        count(&m, "default", "allowed"),
        2,
        "default never saw the partner"
    );
    // A rule not named is not replaced: `everyone` counted both.
    assert_eq!(count(&m, "everyone", "allowed"), 7);
}

#[test]
fn replaces_that_could_not_mean_anything_is_refused() {
    let rule = |name: &str, extra: &str| {
        format!("  - name: {name}\n    key: client_ip\n    limit: {{ rate: 1/s }}\n{extra}")
    };
    for (rules, want) in [
        (rule("a", "    replaces: [b]\n"), "no rule is called"),
        (rule("a", "    replaces: [a]\n"), "itself"),
        (
            rule("a", "    replaces: [b]\n") + &rule("b", "    replaces: [a]\n"),
            "replace each other",
        ),
        (
            rule("a", "    replaces: [b]\n    mode: shadow\n") + &rule("b", ""),
            "shadow",
        ),
    ] {
        let yaml = format!(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n{rules}"
        );
        let e = Config::from_yaml(&yaml, "t").unwrap_err().to_string();
        assert!(e.contains(want), "{rules}: {e}");
    }
}

#[test]
fn a_global_key_with_its_own_limit_is_always_named_with_that_limit() {
    let (rules, _) = ruleset(
        r#"  - name: g
    key: client_ip
    scope: global
    limit: { rate: 100/s }
    overrides:
      - { key: 10.0.0.9, limit: { rate: 500/s } }
"#,
        "on_reject\ncontrol_plane: { url: 'http://127.0.0.1:1' }",
    );
    for i in 0..10 {
        let r = req("GET", "/", &[]).from(&format!("10.0.0.{i}"));
        for n in 0..(if i == 9 { 1 } else { 5 }) {
            r.allowed(&rules, T0 + n);
        }
    }
    // top_k 1 names the heaviest; the light key with an override is named all the same.
    let report = rules.drain_global(1, 1.0, 1, 0);
    let named: Vec<&str> = report[0].keys.iter().map(|k| k.0.as_str()).collect();
    assert_eq!(named.len(), 2, "{named:?}");
    assert!(named.contains(&"10.0.0.9"), "{named:?}");
    assert_eq!(report[0].owns.len(), 1);
    assert_eq!(report[0].owns["10.0.0.9"].count.get(), 500);
    assert_eq!(report[0].other.2, 8);
}

#[test]
fn a_rule_replaced_in_turn_does_not_stand_in_for_what_it_names() {
    // a stands in for b, b for c: where a applies, b does not, so c does.
    let (rules, m) = ruleset(
        r#"  - name: a
    key: client_ip
    limit: { rate: 5/m }
    replaces: [b]
  - name: b
    key: client_ip
    limit: { rate: 3/m }
    replaces: [c]
  - name: c
    key: client_ip
    limit: { rate: 2/m }
"#,
        "on_reject",
    );
    let r = req("GET", "/", &[]).from("10.0.0.1");
    assert_eq!((0..10).filter(|_| r.allowed(&rules, T0)).count(), 2);
    assert_eq!(count(&m, "b", "allowed"), 0);
    assert_eq!(count(&m, "c", "allowed"), 2);
}

#[test]
fn a_key_written_as_a_block_or_a_host_is_found_as_requests_key_it() {
    let (rules, _) = ruleset(
        r#"  - name: nets
    key: client_ip/24
    limit: { rate: 1/m }
    overrides: [{ key: 203.0.113.0/24, limit: { rate: 4/m } }]
  - name: hosts
    key: host
    limit: { rate: 1/m }
    overrides: [{ key: "API.example.com.", limit: { rate: 3/m } }]
"#,
        "on_reject",
    );
    let r = req("GET", "/", &[]).from("203.0.113.77");
    assert_eq!(
        (0..9).filter(|_| r.allowed(&rules, T0)).count(),
        1,
        "hosts: no host, the rule's"
    );
    let r = req("GET", "/", &[("host", "api.example.com:8443")]).from("198.51.100.1");
    assert_eq!(
        (0..9).filter(|_| r.allowed(&rules, T0)).count(),
        1,
        "nets: the rule's"
    );
    let r = req("GET", "/", &[("host", "api.example.com")]).from("203.0.113.78");
    // nets (4 for its block, one spent above) and hosts (3, one spent above): the smaller.
    assert_eq!((0..9).filter(|_| r.allowed(&rules, T0)).count(), 2);
}

#[test]
fn an_overrides_file_with_no_entries_must_say_so() {
    use crate::config::parse_overrides;
    for empty in ["", "\n  \n", "# all gone\n"] {
        let e = parse_overrides(empty, "f").unwrap_err().to_string();
        assert!(e.contains("write [] for none"), "{empty:?}: {e}");
    }
    assert!(parse_overrides("[]\n", "f").unwrap().is_empty());
    assert!(parse_overrides("overrides: []\n", "f").unwrap().is_empty());
    assert_eq!(
        parse_overrides("overrides:\n  - { key: a, limit: unlimited }\n", "f")
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn a_global_key_listed_by_digest_is_reported_with_its_own_limit_under_log_keys_clear() {
    let digest = crate::digest::Secret::default().of_value(b"sk-vip");
    let (rules, _) = ruleset(
        &format!(
            r#"  - name: g
    key: header:x-api-key
    scope: global
    log_keys: clear
    limit: {{ rate: 100/s }}
    overrides:
      - {{ key: "{digest}", limit: {{ rate: 500/s }} }}
"#
        ),
        "on_reject\ncontrol_plane: { url: 'http://127.0.0.1:1' }",
    );
    req("GET", "/", &[("x-api-key", "sk-vip")]).allowed(&rules, T0);
    let report = rules.drain_global(0, 1.0, 1, 0);
    assert_eq!(report[0].keys.len(), 1, "named though top_k is 0");
    assert_eq!(report[0].owns["sk-vip"].count.get(), 500);
}

#[test]
fn overrides_past_a_thousand_distinct_limits_are_refused() {
    let entries: String = (1..=1001)
        .map(|i| format!("      - {{ key: k{i}, limit: {{ rate: {i}/s }} }}\n"))
        .collect();
    let yaml = format!(
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: r\n    key: [header:k]\n    limit: {{ rate: 2/s }}\n    overrides:\n{entries}"
    );
    let e = Config::from_yaml(&yaml, "t").unwrap_err().to_string();
    assert!(e.contains("1001 distinct limits"), "{e}");
    // A thousand is fine.
    let yaml = yaml.replace("      - { key: k1001, limit: { rate: 1001/s } }\n", "");
    assert!(Config::from_yaml(&yaml, "t").is_ok());
}
