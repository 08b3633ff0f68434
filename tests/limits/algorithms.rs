//! Every algorithm, cost, delay, concurrency, overflow and gRPC through the real proxy.

use std::time::Duration;

use crate::common::*;
use http::StatusCode;

fn rule(limit: &str, extra: &str) -> String {
    format!("rules:\n  - name: r\n    key: [header:x-client]\n    limit: {limit}\n{extra}")
}

async fn statuses(addr: std::net::SocketAddr, n: usize, headers: &[(&str, &str)]) -> Vec<u16> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(get(addr, "/", headers).await.0.as_u16());
    }
    out
}

const A: [(&str, &str); 1] = [("x-client", "a")];

#[tokio::test]
async fn each_rate_algorithm_limits_through_the_proxy_and_says_when_to_retry() {
    for algorithm in [
        "token_bucket",
        "gcra",
        "fixed_window",
        "sliding_window_log",
        "sliding_window_counter",
    ] {
        let (sc, _up, clock) = sidecar_with_clock(&rule(
            &format!("{{ rate: 2/10s, algorithm: {algorithm} }}"),
            "",
        ))
        .await;
        assert_eq!(
            statuses(sc.addr(), 3, &A).await,
            [200, 200, 429],
            "{algorithm}"
        );
        let (_, headers, _) = get(sc.addr(), "/", &A).await;
        let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
        // The sliding counter may wait into the next window (up to 1.5 windows here).
        assert!((1..=15).contains(&retry), "{algorithm}: {retry}");
        clock.advance(Duration::from_secs(retry));
        assert_eq!(
            statuses(sc.addr(), 1, &A).await,
            [200],
            "{algorithm} after {retry} s"
        );
        // Another key is untouched.
        assert_eq!(
            statuses(sc.addr(), 2, &[("x-client", "b")]).await,
            [200, 200],
            "{algorithm}"
        );
    }
}

#[tokio::test]
async fn the_leaky_bucket_queues_its_burst_and_refuses_past_it() {
    // 20/s, 2 may queue: the second request waits 50 ms (real time), the third is refused.
    let (sc, _up, _clock) = sidecar_with_clock(&rule(
        "{ rate: 20/s, burst: 2, algorithm: leaky_bucket }",
        "",
    ))
    .await;
    assert_eq!(statuses(sc.addr(), 3, &A).await, [200, 200, 429]);
}

/// A leaky bucket's queue is `burst` long: at 1/h the second request would wait an hour.
/// `max_delay` bounds the wait; past it the request is refused, with when to retry.
#[tokio::test]
async fn a_leaky_bucket_wait_is_bounded_by_max_delay() {
    let (sc, _up, _clock) = sidecar_with_clock(&rule(
        "{ rate: 1/h, burst: 3, algorithm: leaky_bucket }",
        "    max_delay: 2s\n",
    ))
    .await;
    let first = get(sc.addr(), "/", &A).await;
    assert_eq!(first.0, StatusCode::OK);
    let (status, headers, _) =
        tokio::time::timeout(Duration::from_secs(20), get(sc.addr(), "/", &A))
            .await
            .expect("a request waited in the leaky bucket past max_delay");
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((3590..=3600).contains(&retry), "retry-after {retry}");
    // The refused request took no place in the queue: the next one is refused the same way.
    assert_eq!(
        get(sc.addr(), "/", &A).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn a_header_cost_takes_that_many_units_and_a_bad_one_gets_400() {
    let (sc, _up, _clock) = sidecar_with_clock(&rule(
        "{ rate: 1/h, burst: 10 }",
        "    cost: { header: x-cost, default: 1, max: 100, from: any }\n",
    ))
    .await;
    let with_cost = |c: &'static str| [("x-client", "a"), ("x-cost", c)];
    assert_eq!(get(sc.addr(), "/", &with_cost("7")).await.0, StatusCode::OK);
    assert_eq!(
        get(sc.addr(), "/", &with_cost("4")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(get(sc.addr(), "/", &with_cost("3")).await.0, StatusCode::OK);
    let (status, _, body) = get(sc.addr(), "/", &with_cost("lots")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body.contains("x-cost, which must be sent once, as a whole number of at least 1"),
        "{body}"
    );
}

#[tokio::test]
async fn a_cost_above_the_burst_is_refused_and_never_admitted() {
    let (sc, _up, clock) = sidecar_with_clock(&rule(
        "{ rate: 10/s, burst: 10 }",
        "    cost: { header: x-cost, max: 100, from: any }\n",
    ))
    .await;
    let h = [("x-client", "a"), ("x-cost", "50")];
    let (status, headers, body) = get(sc.addr(), "/", &h).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(!headers.contains_key("retry-after"), "no retry can succeed");
    assert!(body.contains("can never be admitted"), "{body}");
    clock.advance(Duration::from_secs(3600));
    assert_eq!(
        get(sc.addr(), "/", &h).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // It took nothing: a normal request still has the whole burst.
    assert_eq!(
        statuses(sc.addr(), 10, &[("x-client", "a"), ("x-cost", "1")]).await,
        [200; 10]
    );
}

#[tokio::test]
async fn a_delayed_request_waits_and_is_then_admitted() {
    let (sc, _up) = sidecar(&rule(
        "{ rate: 10/s, burst: 1 }",
        "    on_limit: delay\n    max_delay: 2s\n",
    ))
    .await;
    assert_eq!(statuses(sc.addr(), 3, &A).await, [200, 200, 200]);
    let (_, text) = admin(&sc, "/metrics").await;
    assert_eq!(
        metric(&text, "spillway_delayed_total{rule=\"r\"}"),
        Some(2.0)
    );
    assert_eq!(metric(&text, "spillway_delay_queue{rule=\"r\"}"), Some(0.0));
}

#[tokio::test]
async fn a_wait_longer_than_max_delay_is_refused_at_once() {
    let (sc, _up) = sidecar(&rule(
        "{ rate: 1/m, burst: 1 }",
        "    on_limit: delay\n    max_delay: 2s\n",
    ))
    .await;
    assert_eq!(statuses(sc.addr(), 2, &A).await, [200, 429]);
}

/// Polls the admin metrics until `sample` has `value` (bounded: 2 s).
async fn until_metric(sc: &spillway::Sidecar, sample: &str, value: f64) {
    for _ in 0..200 {
        let (_, text) = admin(sc, "/metrics").await;
        if metric(&text, sample) == Some(value) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{sample} never reached {value}");
}

#[tokio::test]
async fn a_full_delay_queue_refuses_and_a_client_that_leaves_frees_its_place() {
    let (sc, _up) = sidecar(&rule(
        "{ rate: 1/5s, burst: 1 }",
        "    on_limit: delay\n    max_delay: 10s\n    max_queue: 1\n",
    ))
    .await;
    assert_eq!(statuses(sc.addr(), 1, &A).await, [200]);
    let addr = sc.addr();
    let waiting = tokio::spawn(async move { get(addr, "/", &A).await });
    let queued = "spillway_delay_queue{rule=\"r\"}";
    until_metric(&sc, queued, 1.0).await;
    // The queue holds one: the next is refused at once.
    assert_eq!(statuses(sc.addr(), 1, &A).await, [429]);
    // The waiting client goes away: its place is freed.
    waiting.abort();
    until_metric(&sc, queued, 0.0).await;
}

#[tokio::test]
async fn concurrency_limits_requests_in_flight_and_frees_the_slot_when_the_body_ends() {
    let (sc, up) = sidecar(
        "rules:\n  - name: uploads\n    key: [header:x-client]\n    limit: { concurrency: 1 }\n",
    )
    .await;
    let addr = sc.addr();
    let first = tokio::spawn(async move { get(addr, "/hold", &A).await });
    up.signals.held.notified().await;
    let (status, headers, _) = get(sc.addr(), "/", &A).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(headers["ratelimit-policy"], "\"uploads\";q=1");
    // Another key has its own slot.
    assert_eq!(
        get(sc.addr(), "/", &[("x-client", "b")]).await.0,
        StatusCode::OK
    );
    up.signals.release.notify_one();
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    assert_eq!(statuses(sc.addr(), 2, &A).await, [200, 200]);
}

#[tokio::test]
async fn past_max_keys_each_new_key_is_estimated_on_its_own() {
    let (sc, _up, _clock) =
        sidecar_with_clock(&rule("{ rate: 1/h, burst: 1 }", "    max_keys: 2\n")).await;
    for k in ["a", "b", "c", "d"] {
        assert_eq!(
            get(sc.addr(), "/", &[("x-client", k)]).await.0,
            StatusCode::OK
        );
    }
    // a and b own buckets; c and d are counted by the sketch, each on its own.
    for k in ["a", "c", "d"] {
        assert_eq!(
            get(sc.addr(), "/", &[("x-client", k)]).await.0,
            StatusCode::TOO_MANY_REQUESTS,
            "{k}"
        );
    }
    let (_, text) = admin(&sc, "/metrics").await;
    assert_eq!(metric(&text, "spillway_keys{rule=\"r\"}"), Some(2.0));
    assert_eq!(
        metric(&text, "spillway_overflow_total{rule=\"r\"}"),
        Some(4.0)
    );
    assert_eq!(
        metric(&text, "spillway_sketch_refused_total{rule=\"r\"}"),
        Some(2.0)
    );
}

#[tokio::test]
async fn a_limited_grpc_call_gets_resource_exhausted() {
    let (sc, _up) = sidecar(&rule("{ rate: 1/h, burst: 1 }", "")).await;
    let c = h2_client();
    let h = [("x-client", "a"), ("content-type", "application/grpc")];
    assert_eq!(
        send(&c, sc.addr(), "POST", "/pkg.Svc/Call", &h).await.0,
        StatusCode::OK
    );
    let (status, headers, body) = send(&c, sc.addr(), "POST", "/pkg.Svc/Call", &h).await;
    assert_eq!(status, StatusCode::OK, "gRPC errors travel in grpc-status");
    assert_eq!(headers["grpc-status"], "8");
    assert_eq!(headers["content-type"], "application/grpc");
    assert!(headers["grpc-message"]
        .to_str()
        .unwrap()
        .contains("rule%20r"));
    let pushback: u64 = headers["grpc-retry-pushback-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(pushback > 3_000_000, "{pushback}");
    assert!(body.is_empty());
}

/// Opens a WebSocket-style upgrade through the proxy; returns the stream and the status line.
async fn upgrade(addr: std::net::SocketAddr) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /ws HTTP/1.1\r\nHost: x\r\nx-client: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read_exact(&mut byte).await.is_err() {
            break;
        }
        head.push(byte[0]);
    }
    let status = String::from_utf8_lossy(&head)
        .lines()
        .next()
        .unwrap_or("")
        .to_string();
    (s, status)
}

#[tokio::test]
async fn an_upgraded_connection_holds_its_concurrency_slot_until_it_closes() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: tunnels\n    key: [header:x-client]\n    limit: { concurrency: 1 }\n",
    )
    .await;
    let (first, status) = upgrade(sc.addr()).await;
    assert!(status.starts_with("HTTP/1.1 101"), "{status}");
    let (_, status) = upgrade(sc.addr()).await;
    assert!(
        status.starts_with("HTTP/1.1 429"),
        "the open tunnel holds the slot: {status}"
    );
    drop(first);
    // The tunnel ends once the proxy sees the close; poll until a new tunnel is admitted.
    let mut last = String::new();
    for _ in 0..200 {
        let (_, status) = upgrade(sc.addr()).await;
        if status.starts_with("HTTP/1.1 101") {
            return;
        }
        last = status;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the slot was never freed: {last}");
}
