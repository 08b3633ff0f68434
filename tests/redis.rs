//! `scope: redis` against a real redis-server on loopback: exactness across proxies, every
//! algorithm's edges, expiry, failures (killed, frozen, restarted, scripts flushed), the
//! breaker, the refused-key cache, and proxies whose clocks disagree.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use http::StatusCode;
use spillway::internal::limit::{AnyClock, ManualClock};
use spillway::Sidecar;

const ALGORITHMS: [&str; 5] = [
    "fixed_window",
    "sliding_window_log",
    "sliding_window_counter",
    "token_bucket",
    "gcra",
];

/// The `redis:` section and one rule `r` keyed by `x-client`, with `extra` rule lines.
fn yaml(redis: &RedisServer, section: &str, limit: &str, extra: &str) -> String {
    format!(
        "headers: always\nredis:\n  url: {}\n  timeout: 250ms\n{section}rules:\n  - name: r\n    key: [header:x-client]\n    limit: {limit}\n    scope: redis\n{extra}",
        redis.url()
    )
}

/// The Redis key of rule `r` of service `test` for client key `key`, then `suffix`.
fn rkey(key: &str, suffix: &str) -> String {
    // No key_secret_file in these tests: the built-in secret.
    let secret = spillway::internal::digest::Secret::default();
    let base = spillway::internal::exact::redis_key(&secret, "test", "r", key.as_bytes());
    format!("{}{suffix}", String::from_utf8(base).unwrap())
}

async fn start(up: SocketAddr, yaml: &str) -> Sidecar {
    Sidecar::start(config(up, yaml)).await.unwrap()
}

/// A rate limit of `algorithm`, as a rule writes it.
fn limit(rate: &str, algorithm: &str) -> String {
    format!("{{ rate: {rate}, algorithm: {algorithm} }}")
}

/// A sidecar in front of `up` with the `redis:` section and rule `r` of [`yaml`].
async fn proxy(
    up: &Upstream,
    redis: &RedisServer,
    section: &str,
    limit: &str,
    extra: &str,
) -> Sidecar {
    start(up.addr, &yaml(redis, section, limit, extra)).await
}

/// A Redis server, an app, and a proxy in front of it with `proxy`'s arguments.
async fn started(section: &str, limit: &str, extra: &str) -> (RedisServer, Upstream, Sidecar) {
    let redis = RedisServer::start();
    let up = upstream().await;
    let sc = proxy(&up, &redis, section, limit, extra).await;
    (redis, up, sc)
}

async fn metrics(sc: &Sidecar) -> String {
    admin(sc, "/metrics").await.1
}

fn count(text: &str, sample: &str) -> f64 {
    metric(text, sample).unwrap_or(0.0)
}

/// Waits, if needed, until Redis's clock is at least `margin` away from the end of the
/// current `window`, so that a burst of requests stays in one window of the window algorithms.
async fn clear_of_window_edge(redis: &RedisServer, window: Duration, margin: Duration) {
    let mut conn = redis.conn().await;
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let now = Duration::from_secs(secs) + Duration::from_micros(micros);
    let into = Duration::from_nanos((now.as_nanos() % window.as_nanos()) as u64);
    if window - into < margin {
        tokio::time::sleep(window - into + Duration::from_millis(10)).await;
    }
}

/// Sends `n` requests for key `key` at once, spread over `proxies`; returns the statuses.
async fn burst(proxies: &[SocketAddr], n: usize, key: &str) -> Vec<u16> {
    let client = client();
    let mut tasks = Vec::new();
    for i in 0..n {
        let (client, addr, key) = (client.clone(), proxies[i % proxies.len()], key.to_string());
        tasks.push(tokio::spawn(async move {
            send(&client, addr, "GET", "/", &[("x-client", &key)])
                .await
                .0
                .as_u16()
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_sharing_one_limit_admit_exactly_the_limit_with_every_algorithm() {
    let redis = RedisServer::start();
    let up = upstream().await;
    for algorithm in ALGORITHMS {
        // An hour's window: no refill and (checked) no window edge during the burst.
        let y = yaml(&redis, "", &limit("25/h", algorithm), "");
        let (a, b) = (start(up.addr, &y).await, start(up.addr, &y).await);
        clear_of_window_edge(&redis, Duration::from_secs(3600), Duration::from_secs(30)).await;
        let statuses = burst(&[a.addr(), b.addr()], 120, algorithm).await;
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        let refused = statuses.iter().filter(|s| **s == 429).count();
        assert_eq!(
            (admitted, refused),
            (25, 95),
            "{algorithm}: two proxies, one limit of 25"
        );
        // Both proxies asked Redis (neither decided alone).
        for sc in [&a, &b] {
            let m = metrics(sc).await;
            assert!(
                count(&m, "spillway_redis_duration_seconds_count") > 0.0,
                "{algorithm}"
            );
            assert_eq!(
                count(&m, "spillway_redis_on_error_total{action=\"allow\"}"),
                0.0
            );
        }
        a.shutdown();
        b.shutdown();
    }
}

#[tokio::test]
async fn every_algorithm_counts_remaining_refuses_past_the_limit_and_says_when_to_retry() {
    let redis = RedisServer::start();
    let up = upstream().await;
    for algorithm in ALGORITHMS {
        let sc = proxy(&up, &redis, "", &limit("3/m", algorithm), "").await;
        clear_of_window_edge(&redis, Duration::from_secs(60), Duration::from_secs(5)).await;
        let key = [("x-client", algorithm)];
        let mut remaining = Vec::new();
        for _ in 0..3 {
            let (status, headers, _) = get(sc.addr(), "/", &key).await;
            assert_eq!(status, StatusCode::OK, "{algorithm}");
            let rl = headers["ratelimit"].to_str().unwrap().to_string();
            remaining.push(
                rl.split(";r=")
                    .nth(1)
                    .unwrap()
                    .split(';')
                    .next()
                    .unwrap()
                    .to_string(),
            );
        }
        assert_eq!(remaining, ["2", "1", "0"], "{algorithm}");
        let (status, headers, body) = get(sc.addr(), "/", &key).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{algorithm}");
        let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
        // Fixed and sliding windows: up to a minute (the window); the counter may need the
        // next window and part of it; the buckets: one unit back, 20 s.
        let most = match algorithm {
            "token_bucket" | "gcra" => 20,
            "sliding_window_counter" => 120,
            _ => 60,
        };
        assert!(
            (1..=most).contains(&retry),
            "{algorithm}: retry-after {retry}, body {body}"
        );
        assert!(body.contains("\"rule\":\"r\""), "{body}");
        sc.shutdown();
    }
}

#[tokio::test]
async fn a_cost_above_the_limit_is_refused_without_a_retry_time() {
    let redis = RedisServer::start();
    let up = upstream().await;
    for algorithm in ALGORITHMS {
        let sc = proxy(
            &up,
            &redis,
            "",
            &limit("3/m", algorithm),
            "    cost: { header: x-cost, default: 1, max: 100, from: any }\n",
        )
        .await;
        let (status, headers, body) =
            get(sc.addr(), "/", &[("x-client", algorithm), ("x-cost", "4")]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{algorithm}");
        assert!(headers.get("retry-after").is_none(), "{algorithm}");
        assert!(
            body.contains("can never be admitted"),
            "{algorithm}: {body}"
        );
        // A cost within the limit still fits: nothing was counted for the refused one.
        let (status, ..) = get(sc.addr(), "/", &[("x-client", algorithm), ("x-cost", "3")]).await;
        assert_eq!(status, StatusCode::OK, "{algorithm}");
        sc.shutdown();
    }
}

#[tokio::test]
async fn sliding_log_members_are_unique_so_simultaneous_requests_all_count() {
    let redis = RedisServer::start();
    let up = upstream().await;
    let y = yaml(
        &redis,
        "",
        "{ rate: 1000/h, algorithm: sliding_window_log }",
        "",
    );
    let (a, b) = (start(up.addr, &y).await, start(up.addr, &y).await);
    let statuses = burst(&[a.addr(), b.addr()], 300, "same").await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let mut conn = redis.conn().await;
    let members: u64 = redis::cmd("ZCARD")
        .arg(rkey("same", ":log"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(members, 300, "one member per admitted request");
}

#[tokio::test]
async fn every_key_carries_a_ttl_no_longer_than_its_window_needs() {
    let redis = RedisServer::start();
    let up = upstream().await;
    for algorithm in ALGORITHMS {
        let sc = proxy(&up, &redis, "", &limit("5/10s", algorithm), "").await;
        get(sc.addr(), "/", &[("x-client", algorithm)]).await;
        let mut conn = redis.conn().await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(rkey(algorithm, "*"))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(!keys.is_empty(), "{algorithm}: no key written");
        for key in keys {
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap();
            // The sliding counter keeps the current window's count through the next window.
            let most = if algorithm == "sliding_window_counter" {
                20_001
            } else {
                10_001
            };
            assert!(ttl > 0 && ttl <= most, "{key}: pttl {ttl}");
        }
        sc.shutdown();
    }
}

#[tokio::test]
async fn keys_are_gone_once_their_window_has_passed() {
    let (redis, _up, sc) =
        started("", "{ rate: 2/200ms, algorithm: sliding_window_log }", "").await;
    get(sc.addr(), "/", &[("x-client", "gone")]).await;
    let mut conn = redis.conn().await;
    let pattern = rkey("gone", "*");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(&pattern)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 2, "log and sequence: {keys:?}");
    // Redis expires keys on its own clock; poll it (bounded) rather than guess a sleep.
    let mut left = keys.len();
    for _ in 0..100 {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(&pattern)
            .query_async(&mut conn)
            .await
            .unwrap();
        left = keys.len();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(left, 0, "keys outlived their window by more than 2 s");
}

#[tokio::test]
async fn a_refused_key_is_answered_locally_until_its_retry_time() {
    let (redis, _up, sc) = started("", "{ rate: 1/h, algorithm: fixed_window }", "").await;
    clear_of_window_edge(&redis, Duration::from_secs(3600), Duration::from_secs(30)).await;
    let key = [("x-client", "abuser")];
    assert_eq!(get(sc.addr(), "/", &key).await.0, StatusCode::OK);
    assert_eq!(
        get(sc.addr(), "/", &key).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let asked = count(&metrics(&sc).await, "spillway_redis_duration_seconds_count");
    for _ in 0..20 {
        let (status, headers, _) = get(sc.addr(), "/", &key).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!(headers.contains_key("retry-after"));
    }
    let m = metrics(&sc).await;
    assert_eq!(
        count(&m, "spillway_redis_duration_seconds_count"),
        asked,
        "no round trip"
    );
    assert_eq!(
        count(&m, "spillway_redis_cache_answers_total{rule=\"r\"}"),
        20.0
    );
    assert_eq!(
        count(
            &m,
            "spillway_requests_total{decision=\"rejected\",rule=\"r\"}"
        ),
        21.0
    );
    // Another key still goes to Redis.
    assert_eq!(
        get(sc.addr(), "/", &[("x-client", "other")]).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn proxies_with_skewed_clocks_agree_because_time_comes_from_redis() {
    let redis = RedisServer::start();
    let up = upstream().await;
    for algorithm in ALGORITHMS {
        let y = yaml(&redis, "", &limit("4/h", algorithm), "");
        // Ten hours apart: any use of a proxy's own clock in a decision would show.
        let early = ManualClock::new(1_000_000_000);
        let late = ManualClock::new(1_000_000_000 + 36_000 * 1_000_000_000);
        let a = Sidecar::start_with_clock(config(up.addr, &y), AnyClock::Manual(early))
            .await
            .unwrap();
        let b = Sidecar::start_with_clock(config(up.addr, &y), AnyClock::Manual(late))
            .await
            .unwrap();
        clear_of_window_edge(&redis, Duration::from_secs(3600), Duration::from_secs(30)).await;
        let key = format!("skew-{algorithm}");
        let mut statuses = Vec::new();
        for i in 0..8 {
            let addr = if i % 2 == 0 { a.addr() } else { b.addr() };
            statuses.push(get(addr, "/", &[("x-client", &key)]).await.0.as_u16());
        }
        assert_eq!(
            statuses,
            [200, 200, 200, 200, 429, 429, 429, 429],
            "{algorithm}"
        );
        // Both tell the refused client the same retry time (Redis's), to the second.
        let retry = |sc: &Sidecar| {
            let addr = sc.addr();
            let key = format!("skew2-{algorithm}");
            async move {
                let h = get(addr, "/", &[("x-client", &key)]).await.1;
                h.get("retry-after")
                    .map(|v| v.to_str().unwrap().parse::<i64>().unwrap())
            }
        };
        for _ in 0..4 {
            get(
                a.addr(),
                "/",
                &[("x-client", &format!("skew2-{algorithm}"))],
            )
            .await;
        }
        let (ra, rb) = (retry(&a).await.unwrap(), retry(&b).await.unwrap());
        assert!((ra - rb).abs() <= 1, "{algorithm}: {ra} vs {rb}");
        a.shutdown();
        b.shutdown();
    }
}

/// Each request must be answered; a hang would be a bug, not a slow machine.
async fn answered(addr: SocketAddr, key: &str) -> u16 {
    tokio::time::timeout(
        Duration::from_secs(30),
        get(addr, "/", &[("x-client", key)]),
    )
    .await
    .expect("a request hung while redis was down")
    .0
    .as_u16()
}

#[tokio::test]
async fn redis_killed_on_error_decides_and_the_breaker_stops_asking() {
    for (on_error, want) in [("allow", 200), ("deny", 429), ("fallback", 0)] {
        let (mut redis, _up, sc) = started(
            &format!("  on_error: {on_error}\n  breaker: {{ failures: 3, cooldown: 1h }}\n"),
            "{ rate: 100/s }",
            "    fallback: { rate: 2/h }\n",
        )
        .await;
        assert_eq!(answered(sc.addr(), "k").await, 200);
        redis.stop();
        let statuses: Vec<u16> = {
            let mut v = Vec::new();
            for _ in 0..10 {
                v.push(answered(sc.addr(), "k").await);
            }
            v
        };
        if on_error == "fallback" {
            // The rule's local fallback limit (2/h) decides.
            assert_eq!(statuses[..3], [200, 200, 429], "{on_error}");
            assert!(
                statuses[3..].iter().all(|s| *s == 429),
                "{on_error}: {statuses:?}"
            );
        } else {
            assert!(
                statuses.iter().all(|s| *s == want),
                "{on_error}: {statuses:?}"
            );
        }
        let m = metrics(&sc).await;
        assert_eq!(
            count(&m, "spillway_redis_breaker_opened_total"),
            1.0,
            "{on_error}"
        );
        assert_eq!(count(&m, "spillway_redis_breaker_state"), 1.0);
        // Three failures opened the breaker; after that Redis was not asked.
        assert_eq!(
            count(&m, "spillway_redis_errors_total{kind=\"connection\"}"),
            3.0
        );
        assert_eq!(
            count(
                &m,
                &format!("spillway_redis_on_error_total{{action=\"{on_error}\"}}")
            ),
            10.0
        );
        sc.shutdown();
    }
}

#[tokio::test]
async fn a_frozen_redis_costs_each_request_at_most_the_timeout() {
    let (redis, _up, sc) = started(
        "  breaker: { failures: 2, cooldown: 1h }\n",
        "{ rate: 100/s }",
        "",
    )
    .await;
    assert_eq!(answered(sc.addr(), "k").await, 200);
    redis.signal("-STOP");
    for _ in 0..5 {
        assert_eq!(answered(sc.addr(), "k").await, 200, "on_error: allow");
    }
    redis.signal("-CONT");
    let m = metrics(&sc).await;
    assert_eq!(
        count(&m, "spillway_redis_errors_total{kind=\"timeout\"}"),
        2.0
    );
    assert_eq!(count(&m, "spillway_redis_breaker_state"), 1.0);
    assert_eq!(
        count(&m, "spillway_redis_on_error_total{action=\"allow\"}"),
        5.0
    );
}

#[tokio::test]
async fn redis_restarted_decisions_resume_and_the_scripts_are_loaded_again() {
    let (mut redis, _up, sc) = started(
        "  on_error: allow\n  breaker: { failures: 1, cooldown: 100ms }\n",
        "{ rate: 1/h, algorithm: sliding_window_log }",
        "",
    )
    .await;
    assert_eq!(answered(sc.addr(), "a").await, 200);
    assert_eq!(answered(sc.addr(), "a").await, 429);
    redis.restart(); // empty: no keys, no scripts
                     // Until the proxy has reconnected, on_error admits; once Redis decides again, the fresh
                     // server admits key b once and refuses it after. Bounded: 200 tries, 25 ms apart.
    let mut resumed = false;
    for _ in 0..200 {
        let first = answered(sc.addr(), "b").await;
        let second = answered(sc.addr(), "b").await;
        if (first, second) == (200, 429) {
            resumed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
        // Start b afresh for the next try.
        let mut conn = redis.conn().await;
        let _: () = redis::cmd("DEL")
            .arg(rkey("b", ":log"))
            .arg(rkey("b", ":seq"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    assert!(resumed, "decisions did not resume after the restart");
    let m = metrics(&sc).await;
    assert_eq!(count(&m, "spillway_redis_connected"), 1.0);
    assert_eq!(count(&m, "spillway_redis_breaker_state"), 0.0);
}

#[tokio::test]
async fn a_flushed_script_cache_is_reloaded_on_noscript() {
    let (redis, _up, sc) = started("", "{ rate: 1/h, algorithm: gcra }", "").await;
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(answered(sc.addr(), "n").await, 200);
    assert_eq!(
        answered(sc.addr(), "n").await,
        429,
        "decided by Redis, not on_error"
    );
    let m = metrics(&sc).await;
    assert_eq!(
        count(&m, "spillway_redis_errors_total{kind=\"server\"}"),
        0.0
    );
    assert_eq!(
        count(&m, "spillway_redis_on_error_total{action=\"allow\"}"),
        0.0
    );
}

#[tokio::test]
async fn a_proxy_started_while_redis_is_down_serves_and_connects_later() {
    let mut redis = RedisServer::start();
    redis.stop();
    let up = upstream().await;
    let sc = proxy(
        &up,
        &redis,
        "  breaker: { failures: 1, cooldown: 50ms }\n",
        "{ rate: 1/h, algorithm: fixed_window }",
        "",
    )
    .await;
    assert_eq!(answered(sc.addr(), "x").await, 200, "on_error: allow");
    redis.restart();
    let mut refused = false;
    for _ in 0..200 {
        if answered(sc.addr(), "x").await == 429 {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(refused, "the proxy never reached redis once it was up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_routes_each_key_to_its_node_and_stays_exact() {
    let cluster = RedisCluster::start();
    let up = upstream().await;
    let y = format!(
        "redis:\n  url: {}\n  timeout: 1s\nrules:\n  - name: r\n    key: [header:x-client]\n    limit: {{ rate: 5/h, algorithm: sliding_window_log }}\n    scope: redis\n",
        cluster.urls()
    );
    let (a, b) = (start(up.addr, &y).await, start(up.addr, &y).await);
    for k in 0..12 {
        let statuses = burst(&[a.addr(), b.addr()], 12, &format!("k{k}")).await;
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        assert_eq!(admitted, 5, "key k{k}: {statuses:?}");
    }
    // The keys spread over the nodes, each decision's keys together on one.
    let mut nodes_with_keys = 0;
    for node in &cluster.nodes {
        let mut conn = node.conn().await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut conn)
            .await
            .unwrap();
        for log in keys.iter().filter(|k| k.ends_with(":log")) {
            let seq = log.replace(":log", ":seq");
            assert!(keys.contains(&seq), "{log} without {seq} on the same node");
        }
        nodes_with_keys += usize::from(!keys.is_empty());
    }
    assert!(nodes_with_keys >= 2, "12 keys all hashed to one node");
    let m = metrics(&a).await;
    assert_eq!(
        count(&m, "spillway_redis_errors_total{kind=\"server\"}"),
        0.0
    );
}

#[tokio::test]
async fn rediss_with_a_private_ca_decides_over_tls() {
    let (redis, ca) = RedisServer::start_tls();
    let up = upstream().await;
    let y = format!(
        "redis:\n  url: rediss://127.0.0.1:{}\n  timeout: 1s\n  ca_file: {}\nrules:\n  - name: r\n    key: [header:x-client]\n    limit: {{ rate: 2/h, algorithm: fixed_window }}\n    scope: redis\n",
        redis.port,
        ca.display()
    );
    let sc = start(up.addr, &y).await;
    clear_of_hour_edge_by_local_clock().await;
    let statuses = [
        answered(sc.addr(), "t").await,
        answered(sc.addr(), "t").await,
        answered(sc.addr(), "t").await,
    ];
    assert_eq!(statuses, [200, 200, 429], "decided by Redis over TLS");
    let m = metrics(&sc).await;
    assert_eq!(count(&m, "spillway_redis_connected"), 1.0);
    assert_eq!(
        count(&m, "spillway_redis_on_error_total{action=\"allow\"}"),
        0.0
    );
}

/// The fixed window of an hour must not end during the test; a TLS-only Redis has no plain
/// port to ask for its time, so the local clock (the same machine's) stands in.
async fn clear_of_hour_edge_by_local_clock() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let into = now.as_secs() % 3600;
    if 3600 - into < 30 {
        tokio::time::sleep(Duration::from_secs(3600 - into + 1)).await;
    }
}

#[tokio::test]
async fn a_client_s_key_never_sizes_or_moves_a_redis_key() {
    let (redis, _up, sc) = started("", "{ rate: 5/m, algorithm: sliding_window_log }", "").await;
    let long = format!("a}}b{{{}", "x".repeat(8000));
    for key in ["plain", "}{", "a}b{c}", long.as_str()] {
        let (status, ..) = get(sc.addr(), "/", &[("x-client", key)]).await;
        assert_eq!(status, StatusCode::OK, "{key:.20}");
    }
    let mut conn = redis.conn().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 2 * 4, "{keys:?}");
    // `~` and 32 hex digits of the keyed digest, and the closing brace.
    let base = "{test:r:".len() + 33 + 1;
    for k in &keys {
        // The tag is the service, the rule and a digest: no brace of a client's inside.
        assert!(k.starts_with("{test:r:"), "{k}");
        assert_eq!(k.find('}'), Some(base - 1), "{k}");
        assert!(k.len() <= base + ":log".len(), "{k}");
    }
}

#[tokio::test]
async fn a_script_error_is_counted_apart_and_never_opens_the_breaker() {
    let (redis, _up, sc) = started(
        "  breaker: { failures: 3, cooldown: 1m }\n  on_error: deny\n",
        "{ rate: 5/m, algorithm: gcra }",
        "",
    )
    .await;
    // The key the script reads holds a list: every call fails with WRONGTYPE, a script error.
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("RPUSH")
        .arg(rkey("broken", ":tat"))
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap();
    for _ in 0..6 {
        let (status, ..) = get(sc.addr(), "/", &[("x-client", "broken")]).await;
        // on_error decides that one request.
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    }
    let text = metrics(&sc).await;
    assert_eq!(
        count(&text, "spillway_redis_errors_total{kind=\"script\"}"),
        6.0
    );
    assert_eq!(count(&text, "spillway_redis_breaker_opened_total"), 0.0);
    // Other keys are still decided by Redis.
    let (status, ..) = get(sc.addr(), "/", &[("x-client", "fine")]).await;
    assert_eq!(status, StatusCode::OK);
}

#[test]
fn scripts_never_fail_on_any_cost_or_key() {
    use proptest::prelude::*;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let redis = RedisServer::start();
    let config = spillway::Config::from_yaml(
        &format!(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nredis: {{ url: {}, timeout: 2s, on_error: deny }}\n",
            redis.url()
        ),
        "t",
    )
    .unwrap();
    let metrics = spillway::internal::metrics::Metrics::new();
    let exact = spillway::internal::exact::Exact::new(
        config.redis.as_ref().unwrap(),
        "s",
        &spillway::internal::digest::Secret::default(),
        metrics.redis.clone(),
        AnyClock::default(),
    )
    .unwrap();
    rt.block_on(exact.start());
    assert!(exact.is_connected());
    let algorithms = [
        spillway::internal::limit::Algorithm::FixedWindow,
        spillway::internal::limit::Algorithm::SlidingWindowLog,
        spillway::internal::limit::Algorithm::SlidingWindowCounter,
        spillway::internal::limit::Algorithm::Gcra,
    ];
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    runner
        .run(
            &(
                proptest::collection::vec(any::<u8>(), 0..200),
                prop_oneof![Just(0u32), 1u32..5, Just(u32::MAX), any::<u32>()],
                1u32..1000,
            ),
            |(key, cost, burst)| {
                let quota = spillway::internal::limit::Quota::new(
                    std::num::NonZeroU32::new(burst).unwrap(),
                    Duration::from_secs(60),
                    std::num::NonZeroU32::new(burst).unwrap(),
                )
                .unwrap();
                for algorithm in algorithms {
                    let answer = rt.block_on(exact.decide("r", &key, algorithm, &quota, cost));
                    prop_assert!(answer.is_ok(), "{algorithm:?} cost {cost}: {answer:?}");
                }
                Ok(())
            },
        )
        .unwrap();
    let text = String::from_utf8(metrics.render()).unwrap();
    assert_eq!(
        count(&text, "spillway_redis_errors_total{kind=\"script\"}"),
        0.0
    );
}

/// A TCP forwarder on loopback to a backend that can be changed: what a Service or a DNS name
/// does when a failover repoints it (connections made before go on to the old backend).
struct Repointable {
    addr: SocketAddr,
    to: std::sync::Arc<arc_swap::ArcSwap<SocketAddr>>,
}

impl Repointable {
    async fn start(to: SocketAddr) -> Repointable {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let to = std::sync::Arc::new(arc_swap::ArcSwap::from_pointee(to));
        let target = to.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let backend = **target.load();
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(backend).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Repointable { addr, to }
    }

    fn repoint(&self, to: SocketAddr) {
        self.to.store(std::sync::Arc::new(to));
    }
}

/// Waits until `replica` has synced with its primary (bounded: 10 s).
async fn synced(replica: &RedisServer) {
    let mut c = replica.conn().await;
    for _ in 0..200 {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut c)
            .await
            .unwrap();
        if info.contains("master_link_status:up") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the replica never synced");
}

// Issue 42, 5: behind a name a failover repoints, the proxy follows the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_behind_one_name_the_limit_holds_again_on_the_new_primary() {
    let a = RedisServer::start();
    let b = RedisServer::start_with(&["--replicaof", "127.0.0.1", &a.port.to_string()]);
    synced(&b).await;
    let name = Repointable::start(SocketAddr::from(([127, 0, 0, 1], a.port))).await;
    let up = upstream().await;
    let sc = start(
        up.addr,
        &format!(
            "redis:\n  url: redis://{}\n  timeout: 250ms\n  on_error: allow\n  breaker: {{ failures: 3, cooldown: 200ms }}\nrules:\n  - name: r\n    key: [header:x-client]\n    limit: {{ rate: 5/h, algorithm: fixed_window }}\n    scope: redis\n",
            name.addr
        ),
    )
    .await;
    let admitted = |key: &'static str| {
        let addr = sc.addr();
        async move {
            let mut ok = 0;
            for _ in 0..8 {
                ok += usize::from(answered(addr, key).await == 200);
            }
            ok
        }
    };
    assert_eq!(admitted("before").await, 5);
    // The failover: b is promoted, a follows it (read-only now), the name points at b.
    let mut bc = b.conn().await;
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut bc)
        .await
        .unwrap();
    let mut ac = a.conn().await;
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(b.port)
        .query_async(&mut ac)
        .await
        .unwrap();
    name.repoint(SocketAddr::from(([127, 0, 0, 1], b.port)));
    // Until the proxy is on b, on_error admits; then b refuses past the limit (bounded: 10 s).
    let mut limited = false;
    for _ in 0..200 {
        if answered(sc.addr(), "after").await == 429 {
            limited = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        limited,
        "the proxy stayed on the demoted primary, admitting everything"
    );
    // And a fresh key is held to its limit exactly.
    assert_eq!(admitted("fresh").await, 5);
    sc.shutdown();
}

// Issue 42, 6: a Redis out of memory refuses every script's write, the sliding log's too.
#[tokio::test]
async fn a_redis_out_of_memory_refuses_every_script_and_on_error_decides() {
    let redis =
        RedisServer::start_with(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]);
    // Filled past its limit by someone else's keys.
    let mut c = redis.conn().await;
    let blob = "x".repeat(64 << 10);
    for i in 0..1000 {
        let r: redis::RedisResult<()> = redis::cmd("SET")
            .arg(format!("fill:{i}"))
            .arg(&blob)
            .query_async(&mut c)
            .await;
        if r.is_err() {
            break;
        }
    }
    let up = upstream().await;
    for algorithm in ALGORITHMS {
        let sc = proxy(
            &up,
            &redis,
            "  on_error: deny\n",
            &limit("100/s", algorithm),
            "",
        )
        .await;
        // No write reaches Redis past its memory: on_error (deny) decides.
        assert_eq!(answered(sc.addr(), "k").await, 429, "{algorithm}");
        let m = metrics(&sc).await;
        assert!(
            count(&m, "spillway_redis_errors_total{kind=\"server\"}") >= 1.0,
            "{algorithm}: {m}"
        );
        sc.shutdown();
    }
}

/// The ACL user docs/redis.md gives a service: its decisions work, and it reaches no other
/// service's keys.
#[tokio::test]
async fn a_service_with_its_own_acl_user_decides_and_reaches_only_its_keys() {
    let redis = RedisServer::start();
    let mut admin = redis.conn().await;
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "test",
            "on",
            ">s3cret-pw",
            "~{test:*",
            "+@all",
            "-@dangerous",
            "+info",
            "+role",
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("{books:r:x}")
        .arg("1")
        .query_async(&mut admin)
        .await
        .unwrap();
    let up = upstream().await;
    for algorithm in ALGORITHMS {
        let sc = start(
            up.addr,
            &format!(
                "redis:\n  url: redis://test:s3cret-pw@127.0.0.1:{}\n  timeout: 250ms\n  on_error: allow\nrules:\n  - name: r\n    key: [header:x-client]\n    limit: {}\n    scope: redis\n",
                redis.port,
                limit("3/h", algorithm)
            ),
        )
        .await;
        let mut ok = 0;
        for _ in 0..5 {
            ok += usize::from(answered(sc.addr(), algorithm).await == 200);
        }
        assert_eq!(ok, 3, "{algorithm}: the user's scripts did not decide");
        let m = metrics(&sc).await;
        assert_eq!(
            count(&m, "spillway_redis_on_error_total{action=\"allow\"}"),
            0.0,
            "{algorithm}: {m}"
        );
        sc.shutdown();
    }
    // The user cannot read another service's key.
    let client =
        redis::Client::open(format!("redis://test:s3cret-pw@127.0.0.1:{}", redis.port)).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let other: redis::RedisResult<Option<String>> = redis::cmd("GET")
        .arg("{books:r:x}")
        .query_async(&mut c)
        .await;
    assert!(other.is_err(), "{other:?}");
}

// Issue 42, 6: Redis key names another service sharing the Redis cannot compute.
#[tokio::test]
async fn redis_key_names_hold_a_digest_under_the_services_secret() {
    let redis = RedisServer::start();
    let secret = temp_file(
        &format!("redis-secret-{}", fastrand::u32(..)),
        "7d1e0c9b8a7f6e5d4c3b2a1908f7e6d5\n",
    );
    let up = upstream().await;
    let sc = start(
        up.addr,
        &format!(
            "key_secret_file: {}\n{}",
            secret.display(),
            yaml(&redis, "", &limit("5/h", "fixed_window"), "")
        ),
    )
    .await;
    assert_eq!(answered(sc.addr(), "alice").await, 200);
    let mut c = redis.conn().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut c)
        .await
        .unwrap();
    let loaded = spillway::internal::digest::Secret::load(&secret).unwrap();
    let ours = String::from_utf8(spillway::internal::exact::redis_key(
        &loaded, "test", "r", b"alice",
    ))
    .unwrap();
    assert!(
        !keys.is_empty() && keys.iter().all(|k| k.starts_with(&ours)),
        "{keys:?} vs {ours}"
    );
    // Neither the bare SHA-256 of the key nor the built-in secret's digest names it.
    use sha2::Digest as _;
    let sha = sha2::Sha256::digest(b"alice");
    let sha: String = sha.iter().map(|b| format!("{b:02x}")).collect();
    let built_in = spillway::internal::digest::Secret::default().of_value(b"alice");
    assert!(
        keys.iter()
            .all(|k| !k.contains(&sha) && !k.contains(&built_in)),
        "{keys:?}"
    );
    sc.shutdown();
}

/// Issue 42, item 6: a client rotating keys creates at most the rule's `new_keys` a second in
/// Redis (and its burst), the rest refused here; a key already seen still goes to Redis.
#[tokio::test]
async fn a_client_rotating_keys_creates_at_most_new_keys_a_second_in_redis() {
    let (redis, _up, sc) = started("", &limit("100/s", "gcra"), "    new_keys: 20\n").await;
    // A key seen before the flood is answered by Redis throughout.
    assert_eq!(answered(sc.addr(), "regular").await, 200);
    let client = client();
    let mut statuses = std::collections::BTreeMap::new();
    let began = tokio::time::Instant::now();
    for i in 0..400 {
        let key = format!("rotated-{i}");
        let (status, _, _) = send(&client, sc.addr(), "GET", "/", &[("x-client", &key)]).await;
        *statuses.entry(status.as_u16()).or_insert(0) += 1;
    }
    // A burst of 20 and 20 a second over the time the flood took.
    let most = 20 + (20.0 * began.elapsed().as_secs_f64()).ceil() as u64;
    let mut conn = redis.conn().await;
    let keys: u64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert!(
        keys <= most + 1,
        "{keys} keys in Redis after 400 rotated keys, at most {most} new ({statuses:?})"
    );
    let refused = statuses.get(&429).copied().unwrap_or(0);
    assert!(refused >= 400 - most, "{statuses:?}");
    assert_eq!(answered(sc.addr(), "regular").await, 200);
    let m = metrics(&sc).await;
    assert_eq!(
        count(&m, "spillway_redis_new_keys_refused_total{rule=\"r\"}"),
        refused as f64,
        "{m}"
    );
}

/// A request a later local rule refuses never reaches Redis, so it spends none of `new_keys`.
#[tokio::test]
async fn keys_refused_by_a_later_local_rule_spend_none_of_new_keys() {
    let (redis, _up, sc) = started(
        "",
        &limit("100/s", "gcra"),
        "    new_keys: 2\n  - name: one\n    key: []\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let client = client();
    let mut ok = 0;
    for i in 0..50 {
        let key = format!("k-{i}");
        let (status, _, _) = send(&client, sc.addr(), "GET", "/", &[("x-client", &key)]).await;
        ok += usize::from(status == StatusCode::OK);
    }
    assert_eq!(ok, 1, "the local rule admits one request in all");
    let m = metrics(&sc).await;
    assert_eq!(
        count(&m, "spillway_redis_new_keys_refused_total{rule=\"r\"}"),
        0.0,
        "{m}"
    );
    let mut conn = redis.conn().await;
    let keys: u64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert!(keys <= 1, "{keys}");
}

/// An app that answers every request with `x-usage-tokens: <usage>`.
async fn app_using(usage: u32) -> SocketAddr {
    answering(&format!(
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nx-usage-tokens: {usage}\r\n\r\nok"
    ))
    .await
}

/// The `RateLimit` field's remaining units (`r=`).
fn remaining(headers: &http::HeaderMap) -> u64 {
    let v = headers["ratelimit"].to_str().unwrap();
    let r = v
        .split(';')
        .find_map(|p| p.trim().strip_prefix("r="))
        .unwrap();
    r.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_usage_is_owed_in_redis_and_every_proxy_refuses_the_key_in_debt() {
    let redis = RedisServer::start();
    let rule = |reserve: u32| {
        yaml(
            &redis,
            "",
            "{ rate: 100/h, burst: 1000 }",
            &format!("    cost: {{ response: {{ header: x-usage-tokens }}, reserve: {reserve}, max: 100000 }}\n"),
        )
    };
    // One proxy's call uses 1 500 of the key's 1 000: it owes 500 in Redis, and another proxy
    // refuses the key until the debt has refilled (and the next call's unit with it).
    let (heavy, light) = (app_using(1500).await, app_using(100).await);
    let a = start(heavy, &rule(1)).await;
    let b = start(heavy, &rule(1)).await;
    assert_eq!(
        get(a.addr(), "/", &[("x-client", "k")]).await.0,
        StatusCode::OK
    );
    let mut conn = redis.conn().await;
    let tat = rkey("k", ":tat");
    // The charge goes to Redis after the response, off its path: wait until it is there.
    let mut owed = false;
    for _ in 0..500 {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&tat)
            .query_async(&mut conn)
            .await
            .unwrap();
        // Past the bucket's 1 000 units of 36 s: the key is in debt.
        if ttl > 36_000_000 {
            owed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        owed,
        "the usage never reached redis: {}",
        metrics(&a)
            .await
            .lines()
            .filter(|l| l.contains("redis") || l.contains("response_"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let (status, headers, _) = get(b.addr(), "/", &[("x-client", "k")]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(
        (501 * 36..=501 * 36 + 1).contains(&retry),
        "Retry-After {retry}"
    );
    assert_eq!(
        count(
            &metrics(&a).await,
            "spillway_response_units_total{kind=\"charged\",rule=\"r\"}"
        ),
        1500.0
    );

    // A reservation larger than the usage is given back in Redis.
    let c = start(light, &rule(500)).await;
    let d = start(light, &rule(500)).await;
    assert_eq!(
        get(c.addr(), "/", &[("x-client", "j")]).await.0,
        StatusCode::OK
    );
    let mut left = 0;
    for _ in 0..500 {
        let (status, headers, _) = get(d.addr(), "/", &[("x-client", "j")]).await;
        assert_eq!(status, StatusCode::OK);
        // d's call reserved 500 of what c's left: 1 000 - 100 - 500 once c's refund is in.
        left = remaining(&headers);
        if left == 400 {
            break;
        }
        // Not yet: give d's own call back by waiting for its charge (100 as well).
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(left, 400, "the unused reservation was given back");
    assert_eq!(
        count(
            &metrics(&c).await,
            "spillway_response_units_total{kind=\"lost\",rule=\"r\"}"
        ),
        0.0
    );
}

/// `/explain`'s answer for `path` with `headers`, from the sidecar's admin listener.
async fn explained(sc: &Sidecar, headers: &[(&str, &str)]) -> serde_json::Value {
    use http_body_util::BodyExt;
    let fields: Vec<[&str; 2]> = headers.iter().map(|(k, v)| [*k, *v]).collect();
    let body = serde_json::json!({ "path": "/", "headers": fields }).to_string();
    let req = hyper::Request::post(format!("http://{}/explain", sc.admin_addr()))
        .body(
            http_body_util::Full::new(bytes::Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}

#[tokio::test]
async fn explain_reads_every_algorithms_state_in_redis_without_writing_it() {
    let redis = RedisServer::start();
    let up = upstream().await;
    for algorithm in ALGORITHMS {
        // No refusal remembered here: each answer is Redis's.
        let sc = proxy(
            &up,
            &redis,
            "  cache_refusals: false\n",
            &limit("2/m", algorithm),
            "",
        )
        .await;
        clear_of_window_edge(&redis, Duration::from_secs(60), Duration::from_secs(5)).await;
        let key = [("x-client", algorithm)];
        let mut admitted = 0;
        for _ in 0..3 {
            // Asked twice: a read that wrote would leave the real request a different answer.
            explained(&sc, &key).await;
            let e = explained(&sc, &key).await;
            let rule = &e["rules"][0];
            assert_eq!(rule["state"]["read_from_redis"], true, "{algorithm}: {e:#}");
            let (status, _, _) = get(sc.addr(), "/", &key).await;
            match rule["decision"].as_str() {
                Some("admit") => {
                    assert_eq!(e["decision"], "admit", "{algorithm}: {e:#}");
                    assert_eq!(status, StatusCode::OK, "{algorithm}: {e:#}");
                    admitted += 1;
                }
                Some("refuse") => {
                    assert_eq!(
                        (e["decision"].as_str(), e["by"].as_str()),
                        (Some("refuse"), Some("r"))
                    );
                    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{algorithm}: {e:#}");
                }
                other => panic!("{algorithm}: {other:?}: {e:#}"),
            }
        }
        assert_eq!(admitted, 2, "{algorithm}");
        sc.shutdown();
    }
}

#[tokio::test]
async fn explain_says_what_on_error_does_when_redis_is_gone() {
    let mut redis = RedisServer::start();
    let up = upstream().await;
    let sc = proxy(&up, &redis, "  on_error: deny\n", &limit("2/m", "gcra"), "").await;
    redis.stop();
    let e = explained(&sc, &[("x-client", "a")]).await;
    assert_eq!(e["decision"], "asks_redis", "{e:#}");
    let reason = e["rules"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("on_error: deny"), "{reason}");
}

/// A key's own limit is the one Redis is asked with: two proxies admit exactly it, every
/// algorithm, while the rule's other keys keep the rule's; its 429 states its own policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_its_own_limit_is_held_to_it_exactly_across_proxies() {
    let redis = RedisServer::start();
    let up = upstream().await;
    for algorithm in ALGORITHMS {
        let y = yaml(
            &redis,
            "",
            &limit("5/h", algorithm),
            "    overrides: [{ key: vip, limit: { rate: 40/h } }]\n",
        );
        let (a, b) = (start(up.addr, &y).await, start(up.addr, &y).await);
        clear_of_window_edge(&redis, Duration::from_secs(3600), Duration::from_secs(30)).await;
        let statuses = burst(&[a.addr(), b.addr()], 120, "vip").await;
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        assert_eq!(admitted, 40, "{algorithm}: vip's own 40");
        let statuses = burst(&[a.addr(), b.addr()], 30, &format!("other-{algorithm}")).await;
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        assert_eq!(admitted, 5, "{algorithm}: the rule's 5");
        let (status, headers, _) = get(a.addr(), "/", &[("x-client", "vip")]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            headers["ratelimit-policy"], "\"r\";q=40;w=3600",
            "{algorithm}"
        );
        a.shutdown();
        b.shutdown();
        // The next algorithm's vip starts from nothing.
        let mut conn = redis.conn().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    }
}
