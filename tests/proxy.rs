//! The sidecar end to end: a real proxy on 127.0.0.1:0 in front of an in-test upstream.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PER_CLIENT: &str = r#"
rules:
  - name: per-client
    match: { path_prefix: /api/ }
    key: [header:x-client]
    limit: { rate: 1/h, burst: 2 }
"#;

#[tokio::test]
async fn requests_over_the_limit_get_429_with_retry_after_and_ratelimit_headers() {
    let (sc, _up) = sidecar(PER_CLIENT).await;
    let a = [("x-client", "a")];
    assert_eq!(get(sc.addr(), "/api/x", &a).await.0, StatusCode::OK);
    assert_eq!(get(sc.addr(), "/api/x", &a).await.0, StatusCode::OK);
    let (status, headers, body) = get(sc.addr(), "/api/x", &a).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // 1 per hour from empty: the next token is 3600 s away (less the few ms the test took).
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((3599..=3600).contains(&retry), "{retry}");
    assert_eq!(headers["ratelimit-policy"], "\"per-client\";q=2;w=7200");
    assert_eq!(
        headers["ratelimit"],
        format!("\"per-client\";r=0;t={retry}").as_str()
    );
    assert_eq!(headers["content-type"], "application/problem+json");
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["status"], 429);
    assert_eq!(doc["rule"], "per-client");
    assert_eq!(doc["retry_after"], retry);
    // Allowed responses carry no RateLimit headers under the default on_reject.
    let (status, headers, _) = get(sc.addr(), "/api/x", &[("x-client", "b")]).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!headers.contains_key("ratelimit"));
}

#[tokio::test]
async fn retry_after_is_computed_from_the_bucket_and_a_retry_then_is_admitted() {
    let (sc, _up, clock) = sidecar_with_clock(
        "rules:\n  - name: r\n    key: client_ip\n    limit: { rate: 1/m, burst: 1 }\n",
    )
    .await;
    assert_eq!(get(sc.addr(), "/", &[]).await.0, StatusCode::OK);
    clock.advance(Duration::from_millis(20_500));
    let (status, headers, _) = get(sc.addr(), "/", &[]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // 39.5 s left, rounded up.
    assert_eq!(headers["retry-after"], "40");
    clock.advance(Duration::from_millis(39_499));
    assert_eq!(
        get(sc.addr(), "/", &[]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let (_, headers, _) = get(sc.addr(), "/", &[]).await;
    assert_eq!(
        headers["retry-after"], "1",
        "1 ms left still says 1 s, never 0"
    );
    clock.advance(Duration::from_millis(1));
    assert_eq!(get(sc.addr(), "/", &[]).await.0, StatusCode::OK);
}

/// A head's fields but `Date` and the request's id, sorted: what two answers must agree on.
fn fields<'a>(pairs: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<(String, String)> {
    let mut out: Vec<_> = pairs
        .filter(|(n, _)| !n.eq_ignore_ascii_case("date") && !n.eq_ignore_ascii_case("x-request-id"))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    out.sort();
    out
}

/// A problem document without its `request_id`, which must be `id` (each answer has its own).
fn without_id(body: &str, id: &str) -> serde_json::Value {
    let mut doc: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(doc["request_id"], id, "{body}");
    doc.as_object_mut().unwrap().remove("request_id");
    doc
}

fn map_fields(headers: &http::HeaderMap) -> Vec<(String, String)> {
    fields(
        headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.to_str().unwrap())),
    )
}

/// Our HTTP/1 side writes the lines a rule keeps for a 429, after a streamed body too; hyper's
/// HTTP/2 server writes the 429 from its map. A client sees the same answer.
#[tokio::test]
async fn a_kept_429_reads_the_same_from_every_server_side() {
    for mode in ["on_reject", "never"] {
        let (sc, _up, _clock) = sidecar_with_clock(&format!(
            "headers: {mode}\nrules:\n  - name: r\n    key: client_ip\n    \
             limit: {{ rate: 1/m, burst: 1 }}\n"
        ))
        .await;
        assert_eq!(get(sc.addr(), "/", &[]).await.0, StatusCode::OK);
        // The clock stands still: every refusal's hint is 60 s, one the rule keeps.
        let (status, headers, body) = get(sc.addr(), "/", &[]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{mode}");
        assert_eq!(headers["retry-after"], "60");
        assert_eq!(headers.contains_key("ratelimit"), mode == "on_reject");
        let ours = map_fields(&headers);

        // A chunked body, streamed by our HTTP/1 side.
        let stream = tokio::net::TcpStream::connect(sc.addr()).await.unwrap();
        let mut c = tokio::io::BufReader::new(stream);
        let raw = ask(
            &mut c,
            "POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        )
        .await;
        assert_eq!(raw.status, "HTTP/1.1 429 Too Many Requests");
        let lines = raw.head.lines().filter_map(|l| l.split_once(':'));
        assert_eq!(fields(lines), ours, "{mode}: after a streamed body");
        let id = raw
            .head
            .lines()
            .find_map(|l| l.strip_prefix("x-request-id:"))
            .unwrap()
            .trim();
        assert_eq!(
            without_id(&raw.body, id),
            without_id(&body, headers["x-request-id"].to_str().unwrap())
        );

        let (status, h2_headers, h2_body) = send(&h2_client(), sc.addr(), "GET", "/", &[]).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(map_fields(&h2_headers), ours, "{mode}: HTTP/2");
        let h2_id = h2_headers["x-request-id"].to_str().unwrap();
        assert_eq!(
            without_id(&h2_body, h2_id),
            without_id(&body, headers["x-request-id"].to_str().unwrap())
        );
    }
}

#[tokio::test]
async fn each_key_has_its_own_bucket() {
    let (sc, _up) = sidecar(PER_CLIENT).await;
    for _ in 0..2 {
        assert_eq!(
            get(sc.addr(), "/api/x", &[("x-client", "a")]).await.0,
            StatusCode::OK
        );
    }
    assert_eq!(
        get(sc.addr(), "/api/x", &[("x-client", "a")]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        get(sc.addr(), "/api/x", &[("x-client", "b")]).await.0,
        StatusCode::OK
    );
    // No key, no rule: requests without the header are not limited by it.
    for _ in 0..5 {
        assert_eq!(get(sc.addr(), "/api/x", &[]).await.0, StatusCode::OK);
    }
    // Outside the matched prefix the rule does not apply either.
    assert_eq!(
        get(sc.addr(), "/other", &[("x-client", "a")]).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn tuple_keys_limit_each_combination() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: r\n    key: [header:x-client, method]\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let c = client();
    let a = [("x-client", "a")];
    assert_eq!(send(&c, sc.addr(), "GET", "/", &a).await.0, StatusCode::OK);
    assert_eq!(send(&c, sc.addr(), "POST", "/", &a).await.0, StatusCode::OK);
    assert_eq!(
        send(&c, sc.addr(), "GET", "/", &a).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&c, sc.addr(), "GET", "/", &[("x-client", "b")])
            .await
            .0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn behind_a_listed_proxy_the_key_is_the_trusted_entry_not_the_spoofable_left() {
    let (sc, _up) = sidecar(
        "client_ip: { trusted_proxies: [127.0.0.1], trusted_hops: 1 }\nrules:\n  - name: r\n    key: client_ip\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let xff = |v: &'static str| [("x-forwarded-for", v)];
    assert_eq!(
        get(sc.addr(), "/", &xff("6.6.6.6, 203.0.113.7")).await.0,
        StatusCode::OK
    );
    // Same client behind the LB, new spoofed leftmost entry: still the same key.
    assert_eq!(
        get(sc.addr(), "/", &xff("1.1.1.1, 203.0.113.7")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        get(sc.addr(), "/", &xff("6.6.6.6, 203.0.113.8")).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn without_trusted_hops_forwarded_for_is_ignored_for_the_key() {
    let (sc, _up) =
        sidecar("rules:\n  - name: r\n    key: client_ip\n    limit: { rate: 1/h, burst: 1 }\n")
            .await;
    assert_eq!(
        get(sc.addr(), "/", &[("x-forwarded-for", "1.1.1.1")])
            .await
            .0,
        StatusCode::OK
    );
    assert_eq!(
        get(sc.addr(), "/", &[("x-forwarded-for", "2.2.2.2")])
            .await
            .0,
        StatusCode::TOO_MANY_REQUESTS,
        "a client cannot pick a fresh bucket by writing its own X-Forwarded-For"
    );
}

#[tokio::test]
async fn shadow_rules_admit_everything_and_count_what_they_would_reject() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: trial\n    key: client_ip\n    limit: { rate: 1/h, burst: 2 }\n    mode: shadow\n",
    )
    .await;
    for _ in 0..5 {
        assert_eq!(get(sc.addr(), "/", &[]).await.0, StatusCode::OK);
    }
    let (_, text) = admin(&sc, "/metrics").await;
    let m = |d: &str| {
        metric(
            &text,
            &format!("spillway_requests_total{{decision=\"{d}\",rule=\"trial\"}}"),
        )
    };
    assert_eq!(m("allowed"), Some(2.0));
    assert_eq!(m("shadow_rejected"), Some(3.0));
    assert_eq!(m("rejected"), Some(0.0));
}

#[tokio::test]
async fn tiers_give_anonymous_and_premium_clients_different_limits() {
    let (sc, _up) = sidecar(
        r#"rules:
  - name: anonymous
    match: { headers_absent: [x-api-key] }
    key: client_ip
    limit: { rate: 1/h, burst: 1 }
  - name: premium
    match: { headers: { x-plan: premium } }
    key: [header:x-api-key]
    limit: { rate: 1/h, burst: 3 }
"#,
    )
    .await;
    let mut anon = 0;
    let mut premium = 0;
    for _ in 0..5 {
        anon += (get(sc.addr(), "/", &[]).await.0 == StatusCode::OK) as u32;
        premium += (get(sc.addr(), "/", &[("x-api-key", "k"), ("x-plan", "premium")])
            .await
            .0
            == StatusCode::OK) as u32;
    }
    assert_eq!((anon, premium), (1, 3));
}

#[tokio::test]
async fn headers_always_puts_ratelimit_on_allowed_responses() {
    let (sc, _up) = sidecar(
        "headers: always\nrules:\n  - name: r\n    key: client_ip\n    limit: { rate: 10/s, burst: 20 }\n",
    )
    .await;
    let (status, headers, _) = get(sc.addr(), "/", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["ratelimit-policy"], "\"r\";q=20;w=2");
    assert_eq!(headers["ratelimit"], "\"r\";r=19;t=1");
}

#[tokio::test]
async fn the_upstream_sees_forwarded_headers_its_host_and_no_hop_by_hop_headers() {
    let (sc, _up) = sidecar("rules: []\n").await;
    let (status, _, body) = get(
        sc.addr(),
        "/echo?q=1",
        &[
            ("host", "shop.example.com"),
            ("connection", "x-private"),
            ("x-private", "secret"),
            ("proxy-authorization", "Basic Zm9v"),
            ("x-forwarded-for", "198.51.100.1"),
            ("x-kept", "yes"),
        ],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    let h = &doc["headers"];
    assert_eq!(doc["uri"], "/echo?q=1");
    assert_eq!(h["host"], "shop.example.com");
    // The client is no listed proxy: its own list is replaced by its address.
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-forwarded-host"], "shop.example.com");
    assert_eq!(h["x-kept"], "yes");
    assert!(h.get("x-private").is_none(), "{h}");
    assert!(h.get("proxy-authorization").is_none(), "{h}");
}

#[tokio::test]
async fn a_large_upload_streams_through_without_being_buffered() {
    let (sc, up) = sidecar("rules: []\n").await;
    let (tx, body) = channel_body();
    let req = Request::post(format!("http://{}/upload", sc.addr()))
        .body(body)
        .unwrap();
    let c = client();
    let response = tokio::spawn(async move { c.request(req).await });
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 256; // 256 MiB in all
    tx.send(Bytes::from(vec![7u8; CHUNK])).await.unwrap();
    // A proxy that buffered the whole body would never pass the first chunk on while the
    // rest is still unsent: this wait would time out.
    tokio::time::timeout(Duration::from_secs(30), up.signals.first_bytes.notified())
        .await
        .expect("the upstream saw the first bytes before the upload ended");
    let chunk = Bytes::from(vec![7u8; CHUNK]);
    for _ in 1..CHUNKS {
        tx.send(chunk.clone()).await.unwrap();
    }
    drop(tx);
    let resp = response.await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, (CHUNK * CHUNKS).to_string().as_bytes());
}

#[tokio::test]
async fn a_websocket_upgrade_passes_through_both_ways() {
    let (sc, _up) = sidecar("rules: []\n").await;
    let mut s = tokio::net::TcpStream::connect(sc.addr()).await.unwrap();
    s.write_all(
        b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
          Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("upgrade: websocket"),
        "{head}"
    );
    for msg in [&b"hello"[..], b"over the upgraded connection"] {
        s.write_all(msg).await.unwrap();
        let mut back = vec![0u8; msg.len()];
        s.read_exact(&mut back).await.unwrap();
        assert_eq!(back, msg);
    }
}

#[tokio::test]
async fn a_refused_upstream_gives_502_at_once() {
    // A port that was free a moment ago and has no listener now.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let sc = spillway::Sidecar::start(config(closed, "rules: []\n"))
        .await
        .unwrap();
    let (status, headers, body) = get(sc.addr(), "/", &[]).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(body.contains("upstream refused the connection"), "{body}");
    let (_, text) = admin(&sc, "/metrics").await;
    assert_eq!(
        metric(&text, "spillway_upstream_errors_total{kind=\"connect\"}"),
        Some(1.0)
    );
}

#[tokio::test]
async fn a_slow_upstream_gives_504() {
    let (sc, _up) = sidecar("timeouts: { upstream_response: 200ms }\nrules: []\n").await;
    let (status, _, body) = get(sc.addr(), "/slow", &[]).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert!(body.contains("did not respond in time"), "{body}");
    let (_, text) = admin(&sc, "/metrics").await;
    assert_eq!(
        metric(
            &text,
            "spillway_upstream_errors_total{kind=\"response_timeout\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn oversized_headers_get_431() {
    let (sc, _up) = sidecar("limits: { max_header_bytes: 8192 }\nrules: []\n").await;
    let big = "x".repeat(10_000);
    let (status, _, body) = get(sc.addr(), "/", &[("x-big", &big)]).await;
    assert_eq!(status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    assert!(body.contains("request headers are larger"), "{body}");
    // Far past the limit the server side refuses as it reads, before a request is made; still
    // 431.
    let mut s = tokio::net::TcpStream::connect(sc.addr()).await.unwrap();
    let huge = format!(
        "GET / HTTP/1.1\r\nHost: x\r\nX-Huge: {}\r\n\r\n",
        "y".repeat(64 * 1024)
    );
    let _ = s.write_all(huge.as_bytes()).await;
    let mut resp = Vec::new();
    let _ = s.read_to_end(&mut resp).await;
    let resp = String::from_utf8_lossy(&resp);
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp}");
    // And the proxy still serves others.
    assert_eq!(get(sc.addr(), "/", &[]).await.0, StatusCode::OK);
}

#[tokio::test]
async fn malformed_requests_get_400_and_the_proxy_keeps_serving() {
    let (sc, _up) = sidecar("rules: []\n").await;
    for raw in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
        b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
    ] {
        let mut s = tokio::net::TcpStream::connect(sc.addr()).await.unwrap();
        let _ = s.write_all(raw).await;
        let mut resp = Vec::new();
        let _ = s.read_to_end(&mut resp).await;
        let resp = String::from_utf8_lossy(&resp);
        assert!(resp.starts_with("HTTP/1.1 400"), "{raw:?} -> {resp}");
    }
    assert_eq!(get(sc.addr(), "/", &[]).await.0, StatusCode::OK);
}

#[tokio::test]
async fn http2_with_prior_knowledge_is_proxied_and_limited() {
    let (sc, _up) = sidecar(PER_CLIENT).await;
    let c = h2_client();
    let a = [("x-client", "a")];
    let (status, _, body) = send(&c, sc.addr(), "GET", "/echo", &a).await;
    assert_eq!(status, StatusCode::OK);
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        doc["version"], "HTTP/1.1",
        "the upstream is spoken to in HTTP/1.1"
    );
    assert_eq!(doc["headers"]["host"], sc.addr().to_string());
    assert_eq!(
        send(&c, sc.addr(), "GET", "/api/1", &a).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&c, sc.addr(), "GET", "/api/2", &a).await.0,
        StatusCode::OK
    );
    let (status, headers, _) = send(&c, sc.addr(), "GET", "/api/3", &a).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(headers.contains_key("retry-after"));
}

#[tokio::test]
async fn shutdown_drains_the_request_in_flight_and_turns_not_ready() {
    let (sc, up) = sidecar("rules: []\n").await;
    assert_eq!(admin(&sc, "/readyz").await.0, StatusCode::OK);
    let addr = sc.addr();
    let in_flight = tokio::spawn(async move { get(addr, "/hold", &[]).await });
    up.signals.held.notified().await;

    sc.shutdown();
    // Not ready while draining (the admin listener stays up until the drain ends).
    let mut ready = StatusCode::OK;
    // Each try is a real request to the admin listener; the workers close their listeners
    // within a few scheduler turns.
    for _ in 0..2000 {
        ready = admin(&sc, "/readyz").await.0;
        if ready == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(ready, StatusCode::SERVICE_UNAVAILABLE);
    // New connections are no longer accepted.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());

    up.signals.release.notify_one();
    let (status, _, body) = in_flight.await.unwrap();
    assert_eq!((status, body.as_str()), (StatusCode::OK, "released"));
    tokio::time::timeout(Duration::from_secs(10), sc.wait())
        .await
        .expect("the proxy stops once drained");
}

#[tokio::test]
async fn admin_serves_health_config_and_metrics() {
    let (sc, _up) = sidecar(PER_CLIENT).await;
    assert_eq!(
        admin(&sc, "/healthz").await,
        (StatusCode::OK, "ok\n".into())
    );
    let (status, body) = admin(&sc, "/config").await;
    assert_eq!(status, StatusCode::OK);
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["rules"][0]["name"], "per-client");
    assert_eq!(doc["rules"][0]["limit"]["rate"], "1/h");
    get(sc.addr(), "/api/x", &[("x-client", "secret-key-value")]).await;
    let (_, text) = admin(&sc, "/metrics").await;
    assert_eq!(
        metric(&text, "spillway_keys{rule=\"per-client\"}"),
        Some(1.0)
    );
    assert!(text.contains("spillway_request_duration_seconds_bucket"));
    assert!(
        !text.contains("secret-key-value"),
        "labels never carry raw keys"
    );
    assert_eq!(admin(&sc, "/nope").await.0, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let (sc, _up) = sidecar("timeouts: { header_read: 200ms }\nrules: []\n").await;
    let mut s = tokio::net::TcpStream::connect(sc.addr()).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .await
        .unwrap();
    // The proxy closes the connection; the guard only keeps a regression from hanging CI.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the slow client was never disconnected");
    assert!(!String::from_utf8_lossy(&rest).contains("200 OK"));
    assert_eq!(get(sc.addr(), "/", &[]).await.0, StatusCode::OK);
}

#[tokio::test]
async fn a_second_proxy_on_a_port_in_use_fails_to_start() {
    let (first, up) = sidecar("rules: []\n").await;
    let yaml = format!(
        "service: s\nlisten: {}\nadmin: 127.0.0.1:0\nupstream: http://{}\nrules: []\n",
        first.addr(),
        up.addr
    );
    let config = spillway::Config::from_yaml(&yaml, "t").unwrap();
    let err = spillway::Sidecar::start(config)
        .await
        .err()
        .expect("the port is taken");
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
    assert!(err.to_string().contains(&first.addr().to_string()), "{err}");
}

#[tokio::test]
async fn an_h2c_upstream_gets_grpc_calls_with_te_trailers_and_its_trailers_come_back() {
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    // A gRPC-shaped app: HTTP/2 only, answers with a body and a grpc-status trailer, and
    // tells what it received.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let seen = format!(
                            "{:?} te={}",
                            req.version(),
                            req.headers()
                                .get("te")
                                .map_or("-", |v| v.to_str().unwrap_or("?"))
                        );
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("grpc-status", "0".parse().unwrap());
                        let frames = vec![
                            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(seen))),
                            Ok(Frame::trailers(trailers)),
                        ];
                        let body = StreamBody::new(tokio_stream_iter(frames));
                        Ok::<_, std::convert::Infallible>(http::Response::new(body))
                    },
                );
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
            });
        }
    });
    let yaml = format!(
        "service: s\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: h2c://{app}\nrules: []\n"
    );
    let sc = spillway::Sidecar::start(spillway::Config::from_yaml(&yaml, "t").unwrap())
        .await
        .unwrap();
    let req = http::Request::post(format!("http://{}/pkg.Svc/Call", sc.addr()))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(empty())
        .unwrap();
    let resp = h2_client().request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let collected = resp.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned().expect("trailers came back");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(collected.to_bytes(), "HTTP/2.0 te=trailers");
}

/// A `Stream` over a vector, without a dependency for it.
fn tokio_stream_iter<T: Unpin>(items: Vec<T>) -> impl futures_core::Stream<Item = T> + Unpin {
    struct Iter<T>(std::vec::IntoIter<T>);
    impl<T: Unpin> futures_core::Stream for Iter<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            std::task::Poll::Ready(self.0.next())
        }
    }
    Iter(items.into_iter())
}

#[tokio::test]
async fn every_proxy_says_its_build_and_exports_process_metrics() {
    let (sc, _up) = sidecar("rules: []\n").await;
    let (_, m) = admin(&sc, "/metrics").await;
    let info = m
        .lines()
        .find(|l| l.starts_with("spillway_build_info{"))
        .unwrap_or_else(|| panic!("no build info: {m}"));
    assert!(
        info.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION")))
            && info.contains("commit=\""),
        "{info}"
    );
    for name in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_cpu_seconds_total",
    ] {
        assert!(m.lines().any(|l| l.starts_with(name)), "no {name}");
    }
}

/// A raw `GET path` to `addr` from the local address `from`; the status code.
async fn get_from(from: std::net::IpAddr, addr: std::net::SocketAddr, path: &str) -> u16 {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::new(from, 0)).unwrap();
    let mut conn = socket.connect(addr).await.unwrap();
    let head = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut resp = Vec::new();
    conn.read_to_end(&mut resp).await.unwrap();
    let text = String::from_utf8_lossy(&resp);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

// Issue 47: the admin port is reached from the pod network for probes and scrapes; the rules
// (`/config`) and the status page (`/ui`) stay on loopback (a `kubectl port-forward`) unless
// `admin_open` names them. 127.0.0.2 stands for another pod: only 127.0.0.1 counts as near.
#[tokio::test]
async fn the_rules_and_the_status_page_stay_off_the_pod_network_unless_asked() {
    let far: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let near: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    let (sc, _up) = sidecar("rules: []\n").await;
    let admin = sc.admin_addr();
    for path in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(
            get_from(far, admin, path).await,
            200,
            "{path} from the network"
        );
    }
    let mut pages = vec!["/config"];
    if cfg!(feature = "ui") {
        pages.extend(["/ui", "/ui/state.json"]);
    }
    for path in &pages {
        assert_eq!(
            get_from(far, admin, path).await,
            403,
            "{path} from the network"
        );
        assert_eq!(
            get_from(near, admin, path).await,
            200,
            "{path} from loopback"
        );
    }
    let (sc, _up) = sidecar("admin_open: [config, ui]\nrules: []\n").await;
    for path in &pages {
        assert_eq!(
            get_from(far, sc.admin_addr(), path).await,
            200,
            "{path} opened"
        );
    }
}
