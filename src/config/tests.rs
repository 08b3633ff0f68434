use super::*;

const GOOD: &str = r#"
service: checkout
listen: 127.0.0.1:8080
upstream: http://127.0.0.1:9000
admin: 127.0.0.1:9901
client_ip:
  trusted_hops: 0
timeouts: { header_read: 10s, upstream_connect: 1s, upstream_response: 30s, idle: 60s, drain: 25s }
headers: on_reject
rules:
  - name: per-client
    match: { path_prefix: /api/, methods: [GET, POST] }
    key: [client_ip]
    limit: { rate: 10/s, burst: 20 }
    scope: local
    mode: enforce
"#;

fn err(yaml: &str) -> String {
    Config::from_yaml(yaml, "test.yaml")
        .unwrap_err()
        .to_string()
}

fn with_rule(rule: &str) -> String {
    format!("service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n{rule}")
}

#[test]
fn the_documented_example_parses_with_its_values() {
    let c = Config::from_yaml(GOOD, "test.yaml").unwrap();
    assert_eq!(c.service.0, "checkout");
    assert_eq!(c.upstream.authority.as_str(), "127.0.0.1:9000");
    assert_eq!(c.timeouts.upstream_response.0, Duration::from_secs(30));
    let r = &c.rules[0];
    let Limit::Rate {
        burst,
        quota,
        algorithm,
        ..
    } = &r.limit
    else {
        panic!("a rate limit")
    };
    assert_eq!(burst.get(), 20);
    assert_eq!(quota.emission(), 100_000_000);
    assert_eq!(*algorithm, Algorithm::TokenBucket);
    assert_eq!(r.cost, Cost::Fixed(1));
    assert_eq!(r.on_limit, OnLimit::Reject);
    assert_eq!(r.matcher.methods.len(), 2);
    assert_eq!(r.scope, Scope::Local);
}

#[test]
fn burst_defaults_to_the_rate_count_and_scope_mode_to_local_enforce() {
    let c = Config::from_yaml(
        &with_rule("  - name: a\n    key: client_ip\n    limit: { rate: 100/10s }\n"),
        "t",
    )
    .unwrap();
    let r = &c.rules[0];
    let Limit::Rate { burst, quota, .. } = &r.limit else {
        panic!("a rate limit")
    };
    assert_eq!(burst.get(), 100);
    assert_eq!(quota.emission(), 100_000_000);
    assert_eq!(quota.window(), 10_000_000_000);
    assert_eq!((r.scope, r.mode), (Scope::Local, Mode::Enforce));
    assert_eq!(r.max_keys.get(), 100_000);
}

#[test]
fn empty_rules_are_a_plain_proxy() {
    let c = Config::from_yaml(
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules: []\n",
        "t",
    )
    .unwrap();
    assert!(c.rules.is_empty());
    assert_eq!(c.headers, HeaderMode::OnReject);
}

#[test]
fn a_bad_rate_unit_names_file_line_and_field() {
    let yaml = with_rule(
        "  - name: a\n    key: client_ip\n    limit: { rate: 10/s }\n  - name: b\n    key: client_ip\n    limit: { rate: 10/x }\n",
    );
    let e = err(&yaml);
    assert!(e.starts_with("test.yaml:10:"), "{e}");
    assert!(
        e.contains("rules[1].limit.rate: \"10/x\": unknown unit \"x\""),
        "{e}"
    );
}

#[test]
fn unknown_fields_are_errors_with_their_place() {
    let e = err(&with_rule(
        "  - name: a\n    key: client_ip\n    limit: { rate: 10/s, brust: 3 }\n",
    ));
    assert!(e.contains("rules[0].limit: unknown field `brust`"), "{e}");
    assert!(e.starts_with("test.yaml:7:"), "{e}");
    let e = err("service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nlisen: x\n");
    assert!(e.contains("unknown field `lisen`"), "{e}");
}

#[test]
fn unknown_scopes_are_refused_clearly() {
    let e = err(&with_rule(
        "  - name: a\n    key: client_ip\n    limit: { rate: 10/s }\n    scope: galactic\n",
    ));
    assert!(e.contains("unknown variant `galactic`"), "{e}");
}

#[test]
fn zero_and_malformed_values_are_refused() {
    for (limit, want) in [
        ("{ rate: 0/s }", "the count must be > 0"),
        ("{ rate: 10/s, burst: 0 }", "rules[0].limit.burst"),
        ("{ rate: 10 }", "expected N/unit"),
        ("{ rate: ten/s }", "is not a whole number"),
        ("{ rate: 10/0s }", "the period must be > 0"),
        ("{ rate: 10/ms }", "unknown unit \"ms\""),
        (
            "{ rate: 4000000000/1ms }",
            "faster than one request per nanosecond",
        ),
    ] {
        let e = err(&with_rule(&format!(
            "  - name: a\n    key: client_ip\n    limit: {limit}\n"
        )));
        assert!(e.contains(want), "{limit}: {e}");
    }
}

#[test]
fn key_parts_and_matchers_are_validated() {
    for (rule, want) in [
        ("key: [cookie]", "unknown key part"),
        ("key: [path, path]", "appears twice"),
        ("key: path\n    match: { path_regex: '(' }", "bad regex"),
        (
            "key: path\n    match: { methods: [get] }",
            "methods are upper case",
        ),
        (
            "key: path\n    match: { host: 'a b' }",
            "expected a host name",
        ),
        (
            "key: path\n    match: { headers: { 'x y': z } }",
            "not a header name",
        ),
        ("key: path\n    match: { paht: /x }", "unknown field `paht`"),
    ] {
        let e = err(&with_rule(&format!(
            "  - name: a\n    limit: {{ rate: 1/s }}\n    {rule}\n"
        )));
        assert!(e.contains(want), "{rule}: {e}");
    }
}

#[test]
fn duplicate_rule_names_point_at_the_second() {
    let yaml = with_rule(
        "  - name: a\n    key: path\n    limit: { rate: 1/s }\n  - name: a\n    key: path\n    limit: { rate: 1/s }\n",
    );
    let e = err(&yaml);
    assert_eq!(e, "test.yaml:8: rules[1].name: duplicate rule name \"a\"");
}

#[test]
fn rule_names_must_be_label_and_header_safe() {
    let e = err(&with_rule(
        "  - name: 'a\"b'\n    key: path\n    limit: { rate: 1/s }\n",
    ));
    assert!(e.contains("rules[0].name"), "{e}");
}

#[test]
fn upstream_must_be_a_plain_http_base() {
    for (up, want) in [
        (
            "https://127.0.0.1:9000",
            "https upstreams are not supported",
        ),
        ("http://127.0.0.1:9000/app", "takes no path"),
        ("127.0.0.1:9000", "expected http://host:port"),
        ("ftp://127.0.0.1:9000", "or h2c://host:port for HTTP/2"),
    ] {
        let e = err(&format!(
            "service: s\nlisten: 127.0.0.1:0\nupstream: {up}\n"
        ));
        assert!(e.contains(want), "{up}: {e}");
        assert!(e.contains("upstream:"), "{e}");
    }
}

#[test]
fn durations_parse_and_print_back() {
    for (s, d) in [
        ("250ms", Duration::from_millis(250)),
        ("1s", Duration::from_secs(1)),
        ("5m", Duration::from_secs(300)),
        ("2h", Duration::from_secs(7200)),
        ("1d", Duration::from_secs(86_400)),
    ] {
        assert_eq!(parse_duration(s).unwrap(), d);
        assert_eq!(format_duration(d), s);
    }
    for bad in ["", "5", "s", "1.5s", "5 parsecs", "-1s", "99999999999s"] {
        assert!(parse_duration(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn rates_print_back_as_written() {
    for s in ["10/s", "5/m", "7/h", "1/d", "100/10s", "3/250ms"] {
        assert_eq!(s.parse::<Rate>().unwrap().to_string(), s);
    }
}

#[test]
fn a_missing_file_says_which() {
    let e = Config::load("/nonexistent/spillway.yaml")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("/nonexistent/spillway.yaml: cannot read"),
        "{e}"
    );
}

#[test]
fn the_effective_config_serializes_to_json() {
    let c = Config::from_yaml(GOOD, "t").unwrap();
    let json = serde_json::to_value(&c).unwrap();
    assert_eq!(json["rules"][0]["limit"]["rate"], "10/s");
    assert_eq!(json["rules"][0]["limit"]["burst"], 20);
    assert_eq!(json["rules"][0]["key"][0], "client_ip");
    assert_eq!(json["timeouts"]["drain"], "25s");
    assert_eq!(json["upstream"], "http://127.0.0.1:9000");
}

#[test]
fn example_configs_in_the_repository_are_valid() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/config");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        // Scenario files (`spillway test`) and overrides files sit beside the configurations.
        let name = path.to_string_lossy();
        if name.ends_with(".test.yaml") || name.ends_with(".keys.yaml") {
            continue;
        }
        if path.extension().is_some_and(|e| e == "yaml") {
            match Config::load(&path) {
                Ok(_) => seen += 1,
                // A build without a feature refuses the examples that need it, by name.
                Err(e)
                    if cfg!(not(all(feature = "redis", feature = "tls")))
                        && e.to_string()
                            .contains("feature, which this build of spillway lacks") => {}
                Err(e) => panic!("{e}"),
            }
        }
    }
    assert!(seen >= 2, "expected example configs in {dir}");
}

#[test]
fn every_algorithm_and_concurrency_parse() {
    for a in Algorithm::ALL {
        let c = Config::from_yaml(
            &with_rule(&format!(
                "  - name: a\n    key: path\n    limit: {{ rate: 20/s, burst: 40, algorithm: {} }}\n",
                a.name()
            )),
            "t",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(c.rules[0].limit, Limit::Rate { algorithm, .. } if algorithm == a));
    }
    let c = Config::from_yaml(
        &with_rule("  - name: up\n    key: client_ip\n    limit: { concurrency: 4 }\n"),
        "t",
    )
    .unwrap();
    assert!(matches!(c.rules[0].limit, Limit::Concurrency(n) if n.get() == 4));
}

#[test]
fn an_adaptive_limit_is_told_it_releases_at_the_head_already() {
    let e = err(&with_rule(
        "  - name: a\n    key: []\n    limit: { adaptive: { max: 10 } }\n    release: head\n",
    ));
    assert!(
        e.contains("always gives its slot back at the response head"),
        "{e}"
    );
    let c = Config::from_yaml(
        &with_rule("  - name: a\n    key: []\n    limit: { concurrency: 2 }\n    release: head\n"),
        "t.yaml",
    )
    .unwrap();
    assert_eq!(c.rules[0].release, Release::Head);
}

#[test]
fn cost_delay_and_limits_are_checked_against_each_other() {
    for (rule, want) in [
        ("limit: { rate: 1/s, concurrency: 2 }", "not both"),
        ("limit: { burst: 2 }", "missing rate"),
        (
            "limit: { concurrency: 2, burst: 3 }",
            "concurrency takes no burst",
        ),
        (
            "limit: { rate: 1/s, algorithm: magic }",
            "unknown variant `magic`",
        ),
        (
            "limit: { concurrency: 2 }\n    cost: 2",
            "cost: applies to rate limits",
        ),
        (
            "limit: { concurrency: 2 }\n    on_limit: delay",
            "on_limit: delay applies to rate limits",
        ),
        (
            "limit: { rate: 1/s }\n    release: head",
            "release: applies to concurrency limits",
        ),
        (
            "limit: { rate: 10/s, burst: 5 }\n    cost: 6",
            "cost: 6 exceeds limit.burst 5",
        ),
        ("limit: { rate: 10/s }\n    cost: 0", "must be between 1"),
        (
            "limit: { rate: 10/s }\n    cost: { header: x-cost, default: 5, max: 2 }",
            "default 5 exceeds max 2",
        ),
        (
            "limit: { rate: 10/s }\n    cost: { header: x-cost }",
            "missing field `max`",
        ),
        (
            "limit: { rate: 2000000/s, algorithm: sliding_window_counter }",
            "counts up to 1048575",
        ),
        (
            "limit: { rate: 10000/s, algorithm: sliding_window_log }",
            "sliding_window_log keeps 16 bytes",
        ),
        (
            "limit: { rate: 10/s, algorithm: leaky_bucket }\n    on_limit: delay",
            "redundant with leaky_bucket",
        ),
        (
            "limit: { rate: 10/s }\n    on_limit: later",
            "unknown variant `later`",
        ),
    ] {
        let e = err(&with_rule(&format!(
            "  - name: a\n    key: path\n    {rule}\n"
        )));
        assert!(e.contains(want), "{rule}: {e}");
        assert!(
            e.contains("rules[0]") || e.contains("rule a:"),
            "names the rule: {rule}: {e}"
        );
    }
}

#[test]
fn a_response_cost_parses_with_its_defaults_and_prints_back() {
    for (cost, want) in [
        (
            "{ response: { header: X-Usage-Tokens }, max: 8000 }",
            ResponseCost {
                usage: Usage::Header(HeaderNameStr(http::HeaderName::from_static(
                    "x-usage-tokens",
                ))),
                reserve: 1,
                max: 8000,
                unknown: 8000,
            },
        ),
        (
            "{ response: { trailer: x-usage }, reserve: 0, max: 8000, unknown: 500 }",
            ResponseCost {
                usage: Usage::Trailer(HeaderNameStr(http::HeaderName::from_static("x-usage"))),
                reserve: 0,
                max: 8000,
                unknown: 500,
            },
        ),
        (
            "{ response: body_bytes, reserve: 4096, max: 10000000 }",
            ResponseCost {
                usage: Usage::BodyBytes,
                reserve: 4096,
                max: 10_000_000,
                unknown: 10_000_000,
            },
        ),
    ] {
        let yaml = with_rule(&format!(
            "  - name: a\n    key: path\n    limit: {{ rate: 100000/m, burst: 100000 }}\n    cost: {cost}\n"
        ));
        let c = Config::from_yaml(&yaml, "t.yaml").unwrap_or_else(|e| panic!("{cost}: {e}"));
        assert_eq!(c.rules[0].cost, Cost::Response(want), "{cost}");
        // What `check-config --print` shows reads back as the same rule.
        let printed = serde_norway::to_string(&c.rules[0]).unwrap();
        let again: Rule =
            serde_norway::from_str(&printed).unwrap_or_else(|e| panic!("{printed}: {e}"));
        assert_eq!(again.cost, c.rules[0].cost, "{printed}");
    }
}

#[test]
fn a_response_cost_that_cannot_mean_what_it_says_is_refused() {
    let tokens = "cost: { response: { header: x-usage }, max: 100 }";
    for (rule, want) in [
        (
            format!("limit: {{ rate: 10/s }}\n    {tokens}\n    on_limit: delay"),
            "nothing to wait for",
        ),
        (
            format!("limit: {{ concurrency: 2 }}\n    {tokens}"),
            "cost: applies to rate limits",
        ),
        (
            format!("limit: {{ rate: 10/s, algorithm: fixed_window }}\n    {tokens}"),
            "fixed_window cannot owe units",
        ),
        (
            format!("limit: {{ rate: 10/s, algorithm: leaky_bucket }}\n    {tokens}"),
            "leaky_bucket cannot owe units",
        ),
        (
            "limit: { rate: 10/s }\n    scope: redis\n    cost: { response: { header: x-usage }, reserve: 0, max: 100 }".into(),
            "at least 1 with scope: redis",
        ),
        (
            "limit: { rate: 10/s, burst: 5 }\n    cost: { response: { header: x-usage }, reserve: 6, max: 100 }".into(),
            "reserve: 6 exceeds limit.burst 5",
        ),
        (
            "limit: { rate: 10/s }\n    cost: { response: { header: x-usage }, reserve: 200, max: 100 }".into(),
            "reserve 200 exceeds max 100",
        ),
        (
            "limit: { rate: 10/s }\n    cost: { response: { header: x-usage }, unknown: 200, max: 100 }".into(),
            "unknown 200 exceeds max 100",
        ),
        (
            "limit: { rate: 10/s }\n    cost: { response: body_bytes, unknown: 5, max: 100 }".into(),
            "always known",
        ),
        (
            "limit: { rate: 10/s }\n    cost: { response: { header: x-usage }, default: 5, max: 100 }".into(),
            "header, default and from are a request header's",
        ),
        (
            "limit: { rate: 10/s }\n    cost: { header: x-cost, reserve: 5, max: 100 }".into(),
            "reserve and unknown apply to a response cost",
        ),
        (
            "limit: { rate: 10/s }\n    cost: { response: { header: x-a, trailer: x-b }, max: 100 }".into(),
            "one of header:, trailer: or json:",
        ),
        (
            "limit: { rate: 10/s }\n    cost: { response: tokens, max: 100 }".into(),
            "tokens: give",
        ),
        (
            "limit: { rate: 10/s }\n    cost: { max: 100 }".into(),
            "give header:",
        ),
    ] {
        let e = err(&with_rule(&format!(
            "  - name: a\n    key: path\n    {rule}\n"
        )));
        assert!(e.contains(want), "{rule}: {e}");
    }
    // A global rule takes a response cost (its reservation is a first estimate, not held in a
    // bucket: past the rate is allowed), but not with delay.
    let global = |extra: &str| {
        format!(
            "{}control_plane:\n  url: http://127.0.0.1:1\n",
            with_rule(&format!("  - name: a\n    key: path\n    limit: {{ rate: 10/s }}\n    scope: global\n    cost: {{ response: {{ header: x-usage }}, reserve: 50, max: 1000 }}\n{extra}"))
        )
    };
    let c = Config::from_yaml(&global(""), "test.yaml").expect("a global response cost");
    assert!(matches!(&c.rules[0].cost, Cost::Response(r) if r.reserve == 50));
    let e = err(&global("    on_limit: delay\n    max_delay: 1s\n"));
    assert!(e.contains("nothing to wait for"), "{e}");
    let e = err(&global("").replace("max: 1000", "max: 5000000"));
    assert!(
        e.contains("more than a global rule charges one call"),
        "{e}"
    );
}

#[test]
fn a_header_cost_parses_with_its_default() {
    let c = Config::from_yaml(
        &with_rule("  - name: a\n    key: path\n    limit: { rate: 10/s }\n    cost: { header: X-Request-Cost, max: 100 }\n    on_limit: delay\n    max_delay: 2s\n    max_queue: 7\n"),
        "t",
    )
    .unwrap();
    let r = &c.rules[0];
    assert_eq!(
        r.cost,
        Cost::Header {
            header: http::HeaderName::from_static("x-request-cost"),
            default: 1,
            max: 100,
            from: CostFrom::Trusted,
        }
    );
    assert_eq!(
        (r.on_limit, r.max_delay.unwrap().0, r.max_queue.get()),
        (OnLimit::Delay, Duration::from_secs(2), 7)
    );
    let json = serde_json::to_value(&c).unwrap();
    assert_eq!(json["rules"][0]["cost"]["header"], "x-request-cost");
    assert_eq!(json["rules"][0]["on_limit"], "delay");
}

#[test]
fn a_cost_default_below_one_is_a_config_error() {
    let e = err(&with_rule(
        "  - name: a\n    key: path\n    limit: { rate: 10/s }\n    cost: { header: x-cost, default: 0, max: 10 }\n",
    ));
    assert!(e.contains("default"), "{e}");
    let e = err(&with_rule(
        "  - name: a\n    key: path\n    limit: { rate: 10/s }\n    cost: { header: x-cost, max: 0 }\n",
    ));
    assert!(e.contains("max"), "{e}");
    let c = Config::from_yaml(
        &with_rule("  - name: a\n    key: path\n    limit: { rate: 10/s }\n    cost: { header: x-cost, max: 5, from: any }\n"),
        "t",
    )
    .unwrap();
    assert!(matches!(
        c.rules[0].cost,
        Cost::Header {
            from: CostFrom::Any,
            ..
        }
    ));
}

#[test]
fn trusted_hops_without_listed_proxies_is_an_error_that_names_the_fix() {
    let e = err("service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nclient_ip:\n  trusted_hops: 1\n");
    assert!(e.contains("trusted_proxies"), "{e}");
    let c = Config::from_yaml(
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nclient_ip:\n  trusted_proxies: [10.0.0.0/8, \"fd00::/8\"]\n  trusted_hops: 2\n",
        "t",
    )
    .unwrap();
    assert_eq!(c.client_ip.trusted_proxies.len(), 2);
    let e = err("service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nclient_ip:\n  trusted_proxies: [10.0.0.1/8]\n");
    assert!(e.contains("10.0.0.0/8"), "{e}");
}

#[test]
fn a_rule_level_error_names_the_rule_and_its_line() {
    let yaml = with_rule(
        "  - name: fine\n    key: path\n    limit: { rate: 1/s }\n  - name: broken\n    key: path\n    limit: { concurrency: 2 }\n    cost: 2\n",
    );
    let e = err(&yaml);
    assert!(
        e.contains("rule broken: cost: applies to rate limits"),
        "{e}"
    );
    assert!(
        e.starts_with("test.yaml:8:") || e.starts_with("test.yaml:11:"),
        "{e}"
    );
}

#[test]
fn a_global_rule_needs_a_control_plane_and_a_plain_rate() {
    let e = err(&with_rule(
        "  - name: a\n    key: client_ip\n    limit: { rate: 10/s }\n    scope: global\n",
    ));
    assert_eq!(
        e,
        "test.yaml:5: rule a: scope: global needs a control_plane section with the aggregator's url"
    );
    let cp = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: { url: 'http://127.0.0.1:7001' }\nrules:\n";
    for (rule, want) in [
        (
            "limit: { rate: 10/s, algorithm: gcra }",
            "a global rule is enforced by drop ratios",
        ),
        (
            "limit: { concurrency: 3 }",
            "takes a rate limit, not concurrency",
        ),
        (
            "limit: { rate: 10/s }\n    on_limit: delay",
            "applies to local rules",
        ),
        (
            "limit: { rate: 10/s }\n    cost: 30",
            "cost: 30 exceeds limit.burst 10",
        ),
        // Accepted and ignored before: now each says why it does nothing.
        (
            "limit: { rate: 10/s, burst: 50 }",
            "limit.burst: a global rule's fleet-wide limit is its rate",
        ),
        (
            "limit: { rate: 10/s }\n    fallback: { rate: 1/s, algorithm: leaky_bucket }",
            "fallback.algorithm: leaky_bucket shapes",
        ),
    ] {
        let e = err(&format!(
            "{cp}  - name: a\n    key: path\n    scope: global\n    {rule}\n"
        ));
        assert!(e.contains(want), "{rule}: {e}");
    }
    let e = err(&with_rule(
        "  - name: a\n    key: path\n    limit: { rate: 10/s }\n    fallback: { rate: 1/s }\n",
    ));
    assert!(
        e.contains("fallback: applies to scope: global and scope: redis rules only"),
        "{e}"
    );
    let c = Config::from_yaml(
        &format!("{cp}  - name: a\n    key: path\n    scope: global\n    limit: {{ rate: 100/s }}\n    fallback: {{ rate: 10/s, burst: 20 }}\n"),
        "t",
    )
    .unwrap();
    let p = c.control_plane.unwrap();
    assert_eq!(p.report_interval.0, Duration::from_secs(1));
    assert_eq!(p.stale_after.0, Duration::from_secs(5));
    assert_eq!(p.top_k.get(), 100);
    assert!(c.rules[0].fallback.is_some());
    let e = err(&format!(
        "{}  report_interval: 50ms\n",
        cp.replace(
            "control_plane: { url: 'http://127.0.0.1:7001' }\n",
            "control_plane:\n  url: http://127.0.0.1:7001\n"
        )
        .replace("rules:\n", "")
    ));
    assert!(
        e.contains("report_interval: must be between 100ms and 600s"),
        "{e}"
    );
    let e = err(&with_rule(
        "  - name: a\n    key: path\n    limit: { rate: 10/s }\n    new_keys: 5\n",
    ));
    assert!(
        e.contains("new_keys: applies to scope: redis rules only"),
        "{e}"
    );
}

#[test]
fn an_h2c_upstream_is_http2_and_prints_back() {
    let c = Config::from_yaml(
        "service: s\nlisten: 127.0.0.1:0\nupstream: h2c://127.0.0.1:50051\n",
        "t",
    )
    .unwrap();
    assert!(c.upstream.h2);
    assert_eq!(
        serde_json::to_value(&c).unwrap()["upstream"],
        "h2c://127.0.0.1:50051"
    );
    let e = err("service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: { url: 'h2c://127.0.0.1:7001' }\n");
    assert!(
        e.contains("control plane speaks http:// or https://"),
        "{e}"
    );
}

const BASE: &str = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\n";

#[test]
fn the_control_plane_is_one_url_or_a_list_of_controllers_of_one_scheme() {
    let one = Config::from_yaml(
        &format!("{BASE}control_plane: {{ url: 'http://c1:7000' }}\n"),
        "t",
    )
    .unwrap();
    let json = serde_json::to_value(&one).unwrap();
    assert_eq!(json["control_plane"]["url"], "http://c1:7000/");
    let two = Config::from_yaml(
        &format!("{BASE}control_plane:\n  url: [http://c1:7000, 'http://c2:7000/']\n"),
        "t",
    )
    .unwrap();
    let urls = &two.control_plane.as_ref().unwrap().url;
    assert_eq!(urls.0.len(), 2);
    let json = serde_json::to_value(&two).unwrap();
    assert_eq!(
        json["control_plane"]["url"],
        serde_json::json!(["http://c1:7000/", "http://c2:7000/"]),
        "prints back as it parses"
    );
    for (list, why) in [
        ("[]", "give at least one URL"),
        ("[http://c1:7000, http://c1:7000/]", "is given twice"),
        ("[http://c1:7000, https://c2:7000]", "all http:// or all https://"),
        ("[http://c1:7000, 'http://c2:7000/x']", "expected http(s)://host:port"),
        ("[http://c1:1, http://c1:2, http://c1:3, http://c1:4, http://c1:5, http://c1:6, http://c1:7, http://c1:8, http://c1:9]", "at most 8 URLs"),
        ("{ a: b }", "http(s)://host:port, or a list of them"),
    ] {
        let e = err(&format!("{BASE}control_plane:\n  url: {list}\n"));
        assert!(e.contains(why), "{list}: {e}");
        assert!(e.contains("t.yaml:5"), "{list}: {e}");
    }
}

const REDIS_RULE: &str =
    "  - name: login\n    key: client_ip\n    limit: { rate: 5/m, algorithm: sliding_window_log }\n    scope: redis\n";

#[cfg(feature = "redis")]
#[test]
fn a_redis_section_and_redis_rules_parse_with_defaults() {
    let c = Config::from_yaml(
        &format!("{BASE}redis:\n  url: redis://127.0.0.1:6379\nrules:\n{REDIS_RULE}"),
        "t.yaml",
    )
    .unwrap();
    let r = c.redis.as_ref().unwrap();
    assert_eq!(r.url.0, ["redis://127.0.0.1:6379"]);
    assert!(!r.url.is_cluster());
    assert_eq!(r.timeout.0, Duration::from_millis(50));
    assert_eq!(r.on_error, OnError::Allow);
    assert_eq!(r.breaker.failures.get(), 5);
    assert_eq!(c.rules[0].scope, Scope::Redis);
    let cluster = Config::from_yaml(
        &format!("{BASE}redis:\n  url: [redis://10.0.0.1:7000, redis://10.0.0.2:7000]\n  on_error: deny\nrules:\n{REDIS_RULE}"),
        "t.yaml",
    )
    .unwrap();
    assert!(cluster.redis.unwrap().url.is_cluster());
}

#[cfg(feature = "redis")]
#[test]
fn redis_mistakes_are_named_with_their_line() {
    let e = |yaml: String| Config::from_yaml(&yaml, "t.yaml").unwrap_err().to_string();
    assert_eq!(
        e(format!("{BASE}rules:\n{REDIS_RULE}")),
        "t.yaml:5: rule login: scope: redis needs a redis section with the server's url"
    );
    assert!(
        e(format!("{BASE}redis:\n  url: http://x:6379\n")).starts_with(
            "t.yaml:5:8: redis.url: \"http://x:6379\": expected a redis:// or rediss:// URL"
        )
    );
    assert!(e(format!(
        "{BASE}redis:\n  url: redis://x:6379\n  on_error: fallback\nrules:\n{REDIS_RULE}"
    ))
    .ends_with("rule login: redis.on_error is fallback, so this rule needs a fallback: limit"));
    assert!(e(format!(
        "{BASE}redis:\n  url: redis://x:6379\n  on_error: maybe\n"
    ))
    .contains("redis.on_error: unknown variant `maybe`"));
    let leaky = "  - name: l\n    key: client_ip\n    limit: { rate: 5/m, algorithm: leaky_bucket }\n    scope: redis\n";
    assert!(e(format!(
        "{BASE}redis:\n  url: redis://x:6379\nrules:\n{leaky}"
    ))
    .contains("rule l: limit.algorithm: leaky_bucket shapes by waiting in one proxy"));
    let conc = "  - name: c\n    key: client_ip\n    limit: { concurrency: 5 }\n    scope: redis\n";
    assert!(e(format!(
        "{BASE}redis:\n  url: redis://x:6379\nrules:\n{conc}"
    ))
    .contains("rule c: scope: redis takes a rate limit, not concurrency"));
}

#[cfg(feature = "redis")]
#[test]
fn redis_passwords_never_show_in_config_dumps_or_errors() {
    let c = Config::from_yaml(
        &format!("{BASE}redis:\n  url: redis://app:s3cret@10.0.0.1:6379/2\nrules:\n{REDIS_RULE}"),
        "t.yaml",
    )
    .unwrap();
    let json = serde_json::to_string(&c).unwrap();
    assert!(!json.contains("s3cret"), "{json}");
    assert!(json.contains("redis://app:***@10.0.0.1:6379/2"), "{json}");
    let e = Config::from_yaml(
        &format!("{BASE}redis:\n  url: http://app:s3cret@10.0.0.1:6379\n"),
        "t.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(!e.contains("s3cret"), "{e}");
}

#[test]
fn adaptive_limits_parse_and_their_mistakes_are_named() {
    let c = Config::from_yaml(
        &format!("{BASE}rules:\n  - name: app\n    key: []\n    limit: {{ adaptive: {{ min: 4, max: 512 }} }}\n"),
        "t.yaml",
    )
    .unwrap();
    let Limit::Adaptive(spec) = c.rules[0].limit else {
        panic!("not adaptive")
    };
    assert_eq!(spec.settings().initial, 4, "starts at min by default");
    assert_eq!(spec.tolerance, 2.0);
    let e = |rule: &str| err(&format!("{BASE}rules:\n{rule}"));
    assert!(
        e("  - name: a\n    key: []\n    limit: { adaptive: { min: 9, max: 4 } }\n")
            .contains("adaptive: min 9 is above max 4")
    );
    assert!(
        e("  - name: a\n    key: []\n    limit: { adaptive: { max: 4, tolerance: 1.0 } }\n")
            .contains("tolerance 1 must be between 1.1 and 10")
    );
    assert!(
        e("  - name: a\n    key: client_ip\n    limit: { adaptive: { max: 4 } }\n")
            .contains("rule a: an adaptive limit is one per rule")
    );
    assert!(
        e("  - name: a\n    key: []\n    limit: { adaptive: { max: 4 }, rate: 1/s }\n")
            .contains("adaptive takes no rate")
    );
}

#[test]
fn a_service_name_reserved_for_token_files_is_refused() {
    for name in ["_aggregators", "_x", ".hidden"] {
        let e = err(&format!(
            "service: {name}\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\n"
        ));
        assert!(e.contains("are reserved"), "{name}: {e}");
    }
}

#[test]
fn delay_settings_without_on_limit_delay_are_refused() {
    for extra in ["max_delay: 2s", "max_queue: 5"] {
        let e = err(&with_rule(&format!(
            "  - name: a\n    key: path\n    limit: {{ rate: 10/s }}\n    {extra}\n"
        )));
        assert!(
            e.contains("applies only with on_limit: delay"),
            "{extra}: {e}"
        );
    }
    // A leaky bucket's queue takes max_delay (its wait's bound) but not max_queue (its burst).
    let leaky = "  - name: a\n    key: path\n    limit: { rate: 10/s, algorithm: leaky_bucket }\n";
    let c = Config::from_yaml(&with_rule(&format!("{leaky}    max_delay: 300ms\n")), "t").unwrap();
    assert_eq!(c.rules[0].max_delay.unwrap().0, Duration::from_millis(300));
    let e = err(&with_rule(&format!("{leaky}    max_queue: 5\n")));
    assert!(
        e.contains("max_queue applies only with on_limit: delay"),
        "{e}"
    );
    let c = Config::from_yaml(&with_rule(leaky), "t").unwrap();
    assert_eq!(c.rules[0].max_delay, None, "no bound but the burst's");
    let c = Config::from_yaml(
        &with_rule("  - name: a\n    key: path\n    limit: { rate: 10/s }\n    on_limit: delay\n    max_delay: 2s\n    max_queue: 5\n"),
        "t",
    )
    .unwrap();
    assert_eq!(c.rules[0].max_delay.unwrap().0, Duration::from_secs(2));
    assert_eq!(c.rules[0].max_queue.get(), 5);
    // The effective configuration (`/config`) reads back as the same configuration.
    let text = serde_json::to_string(&c).unwrap();
    Config::from_yaml(&text, "t").unwrap();
}

#[test]
fn upstream_idle_takes_its_old_name_idle_but_not_both() {
    let base = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\n";
    let read = |t: &str| Config::from_yaml(&format!("{base}timeouts: {t}\n"), "t");
    let old = read("{ idle: 7s }").unwrap();
    assert_eq!(old.timeouts.upstream_idle(), Duration::from_secs(7));
    assert_eq!(
        read("{ upstream_idle: 8s }")
            .unwrap()
            .timeouts
            .upstream_idle(),
        Duration::from_secs(8)
    );
    assert_eq!(
        read("{ header_read: 5s }")
            .unwrap()
            .timeouts
            .upstream_idle(),
        Duration::from_secs(60),
        "the default"
    );
    let e = read("{ idle: 7s, upstream_idle: 8s }")
        .unwrap_err()
        .to_string();
    assert!(e.contains("give upstream_idle alone"), "{e}");
    // The effective configuration (`/config`) names it once, and reads back the same.
    let text = serde_json::to_string(&old).unwrap();
    assert!(!text.contains("\"idle\""), "{text}");
    let again = Config::from_yaml(&text, "t").unwrap();
    assert_eq!(again.timeouts.upstream_idle(), Duration::from_secs(7));
}

/// A rule keyed by the host, with no `hosts:` list: each Host a client makes up is a key of
/// its own (a fresh limit, and a place in the rule's store), so the rule limits nothing a
/// client wants past it. Said, not refused.
#[test]
fn a_rule_keyed_by_host_without_hosts_is_warned_of() {
    let base = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\n";
    let rules = "rules:\n  - name: per-host\n    key: [client_ip, host]\n    limit: { rate: 10/s }\n  - name: plain\n    key: client_ip\n    limit: { rate: 10/s }\n";
    let warnings = Config::from_yaml(&format!("{base}{rules}"), "t")
        .unwrap()
        .warnings();
    let keyed: Vec<_> = warnings
        .iter()
        .filter(|w| w.contains("keyed by host"))
        .collect();
    assert_eq!(keyed.len(), 1, "{warnings:?}");
    assert!(
        keyed[0].contains("rule per-host") && keyed[0].contains("hosts:"),
        "{keyed:?}"
    );
    let listed = Config::from_yaml(&format!("{base}hosts: [api.example.com]\n{rules}"), "t")
        .unwrap()
        .warnings();
    assert!(listed.is_empty(), "{listed:?}");
}

/// A timeout every request passes through, set to nothing (or below the workers' tick),
/// would end every request at once: refused by name, not started.
#[test]
fn a_timeout_every_request_meets_is_refused_below_100ms() {
    let base = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\n";
    let read = |t: &str| Config::from_yaml(&format!("{base}timeouts: {t}\n"), "t");
    for name in [
        "header_read",
        "upstream_connect",
        "upstream_response",
        "upstream_body_idle",
        "client_body_idle",
        "send",
    ] {
        for value in ["0s", "50ms"] {
            let e = read(&format!("{{ {name}: {value} }}"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("timeouts.{name}")) && e.contains("at least 100ms"),
                "{name}: {value}: {e}"
            );
        }
        read(&format!("{{ {name}: 100ms }}")).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    // Nothing kept idle, no drain: choices, not mistakes.
    for t in [
        "{ client_idle: 0s }",
        "{ upstream_idle: 0s }",
        "{ drain: 0s }",
    ] {
        read(t).unwrap_or_else(|e| panic!("{t}: {e}"));
    }
}

#[test]
fn a_fallback_is_a_rate_limit_that_can_admit_the_rules_cost() {
    let cp = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: { url: 'http://127.0.0.1:7001' }\nrules:\n";
    let redis = "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nredis: { url: 'redis://127.0.0.1:6379', on_error: fallback }\nrules:\n";
    // An adaptive fallback was accepted and then left out: a Redis outage admitted everything.
    for (head, scope) in [(cp, "global"), (redis, "redis")] {
        let e = err(&format!(
            "{head}  - name: a\n    key: path\n    limit: {{ rate: 10/s }}\n    scope: {scope}\n    fallback: {{ adaptive: {{ max: 10 }} }}\n"
        ));
        assert!(e.contains("fallback: takes a rate limit"), "{scope}: {e}");
    }
    // A fallback whose burst is below the cost of a request could never admit it.
    let e = err(&format!(
        "{redis}  - name: a\n    key: path\n    limit: {{ rate: 10/s }}\n    cost: 5\n    scope: redis\n    fallback: {{ rate: 1/s, burst: 2 }}\n"
    ));
    assert!(e.contains("exceeds fallback.burst"), "{e}");
}

#[test]
fn a_max_delay_too_long_to_count_in_nanoseconds_is_no_bound_not_a_short_one() {
    let c = Config::from_yaml(
        &with_rule("  - name: a\n    key: path\n    limit: { rate: 1/h, algorithm: leaky_bucket }\n    max_delay: 300000d\n"),
        "t",
    )
    .unwrap();
    let rules = crate::rules::RuleSet::build(&c, &crate::metrics::Metrics::new());
    assert_eq!(rules.max_wait_of("a"), Some(crate::limit::Nanos::MAX));
}

/// A build without Redis refuses what needs it, naming the feature, rather than admitting
/// every request a `scope: redis` rule was meant to count.
#[cfg(not(feature = "redis"))]
#[test]
fn redis_needs_the_redis_feature() {
    let e = |yaml: String| Config::from_yaml(&yaml, "t.yaml").unwrap_err().to_string();
    assert_eq!(
        e(format!(
            "{BASE}redis:\n  url: redis://x:6379\nrules:\n{REDIS_RULE}"
        )),
        "t.yaml:7: rule login: needs the `redis` feature, which this build of spillway lacks \
         (cargo build --features redis)"
    );
    assert_eq!(
        e(format!("{BASE}redis:\n  url: redis://x:6379\n")),
        "t.yaml:4: redis: needs the `redis` feature, which this build of spillway lacks \
         (cargo build --features redis)"
    );
}

/// A build without TLS refuses an https:// control plane rather than send counts in clear.
#[cfg(not(feature = "tls"))]
#[test]
fn https_needs_the_tls_feature() {
    let e = Config::from_yaml(
        &format!("{BASE}control_plane:\n  url: https://agg:9000\n"),
        "t.yaml",
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        e,
        "t.yaml:4: control_plane.url: https:// needs the `tls` feature, which this build of \
         spillway lacks (cargo build --features tls)"
    );
}

#[test]
fn a_file_nested_thousands_deep_is_refused_before_it_is_parsed() {
    let flow = format!(
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules: {}{}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let e = err(&flow);
    assert!(
        e.contains("nested deeper than 64") && e.contains(":4"),
        "{e}"
    );
    let mut block =
        String::from("service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nx:\n");
    for depth in 1..200 {
        block.push_str(&format!("{}a:\n", "  ".repeat(depth)));
    }
    assert!(err(&block).contains("nested deeper than 64"));
    // Balanced brackets in a value, and a few in a comment, are no nesting to speak of.
    let quoted = format!(
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: a\n    key: client_ip\n    match: {{ path_regex: \"{}\" }}  # {}\n    limit: {{ rate: 1/s }}\n",
        "[a]".repeat(100),
        "[".repeat(10)
    );
    assert!(Config::from_yaml(&quoted, "t").is_ok());
    // Quotes and comment marks do not hide brackets from the count...
    for hidden in ["x: [a\", ", "x: [a#b, ", "x: ['a, "] {
        let bomb = format!(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\n{hidden}{}{}]\n",
            "[".repeat(20_000),
            "]".repeat(20_000)
        );
        assert!(err(&bomb).contains("nested deeper than 64"), "{hidden}");
    }
    // ...and what a rule leaves open on its line does not add up over many rules.
    let mut many =
        String::from("service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n");
    for i in 0..70 {
        many.push_str(&format!(
            "  - name: r{i}\n    key: client_ip\n    match: {{ path_regex: \"^/a{i}/[#x]\" }}\n    limit: {{ rate: 1/s }}\n"
        ));
    }
    assert!(Config::from_yaml(&many, "t").is_ok());
}

#[test]
fn a_client_share_is_a_part_of_a_shared_limits_slots_and_nothing_else() {
    let shared = |extra: &str| {
        with_rule(&format!(
            "  - name: a\n    key: []\n    limit: {{ concurrency: 8 }}\n{extra}"
        ))
    };
    let c = Config::from_yaml(&shared(""), "t").unwrap();
    assert_eq!(c.rules[0].client_share, Some(DEFAULT_CLIENT_SHARE));
    let c = Config::from_yaml(&shared("    client_share: 1\n"), "t").unwrap();
    assert_eq!(c.rules[0].client_share, Some(1.0));
    let c = Config::from_yaml(
        &with_rule("  - name: a\n    key: []\n    limit: { adaptive: { min: 2, max: 64 } }\n    client_share: 0.25\n"),
        "t",
    )
    .unwrap();
    assert_eq!(c.rules[0].client_share, Some(0.25));
    // Printed back and read again, the same.
    let again = Config::from_yaml(&serde_norway::to_string(&c).unwrap(), "t").unwrap();
    assert_eq!(again.rules[0].client_share, Some(0.25));
    for bad in ["0", "-0.5", "1.5", ".nan"] {
        let e = err(&shared(&format!("    client_share: {bad}\n")));
        assert!(
            e.contains("client_share:") && e.contains("at most 1"),
            "{bad}: {e}"
        );
    }
    let keyed = err(&with_rule(
        "  - name: a\n    key: client_ip\n    limit: { concurrency: 8 }\n    client_share: 0.5\n",
    ));
    assert!(keyed.contains("applies to a shared (key: [])"), "{keyed}");
    let rate = err(&with_rule(
        "  - name: a\n    key: []\n    limit: { rate: 10/s }\n    client_share: 0.5\n",
    ));
    assert!(rate.contains("applies to a shared (key: [])"), "{rate}");
    // A keyed limit has no share to print.
    let c = Config::from_yaml(
        &with_rule("  - name: a\n    key: client_ip\n    limit: { concurrency: 8 }\n"),
        "t",
    )
    .unwrap();
    assert_eq!(c.rules[0].client_share, None);
}

#[test]
fn a_rules_upstream_body_idle_is_at_least_100ms() {
    let e = err(&with_rule(
        "  - name: a\n    key: []\n    limit: { rate: 10/s }\n    upstream_body_idle: 0s\n",
    ));
    assert!(e.contains("upstream_body_idle: at least 100ms"), "{e}");
    Config::from_yaml(
        &with_rule(
            "  - name: a\n    key: []\n    limit: { rate: 10/s }\n    upstream_body_idle: 100ms\n",
        ),
        "t",
    )
    .unwrap();
}
