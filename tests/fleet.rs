//! The control plane with real processes of the built binary on loopback: controllers,
//! aggregators and proxies, each started on port 0 and read from its readiness line.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use http::StatusCode;

/// The fleet tests run one at a time: each starts several processes and offers a few hundred
/// requests per second, and on a 2-core machine in parallel they would starve one another's
/// control loops and measure the machine, not Spillway.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// This test's turn (see [`ONE_AT_A_TIME`]), an app, and a controller with its defaults.
async fn fleet() -> (tokio::sync::MutexGuard<'static, ()>, Upstream, Proc) {
    let one = ONE_AT_A_TIME.lock().await;
    (one, upstream().await, controller("127.0.0.1:0", &[]))
}

fn controller(listen: &str, extra: &[&str]) -> Proc {
    let mut args = vec!["controller", "--listen", listen, "--admin", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    Proc::spawn(&args)
}

fn aggregator(controller: SocketAddr, zone: &str) -> Proc {
    aggregator_with(controller, zone, &[])
}

fn aggregator_with(controller: SocketAddr, zone: &str, extra: &[&str]) -> Proc {
    aggregator_at(&format!("http://{controller}"), zone, extra)
}

/// An aggregator for `zone` reporting to the controller at `url`.
fn aggregator_at(url: &str, zone: &str, extra: &[&str]) -> Proc {
    let mut args = aggregator_args(url, zone, "100ms");
    args.extend_from_slice(extra);
    Proc::spawn(&args)
}

/// The arguments of an aggregator on loopback for `zone`, forwarding to `url` every `every`.
fn aggregator_args<'a>(url: &'a str, zone: &'a str, every: &'a str) -> Vec<&'a str> {
    vec![
        "aggregator",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--controller",
        url,
        "--zone",
        zone,
        "--interval",
        every,
    ]
}

const LIMIT: u64 = 100;

fn proxy(name: &str, upstream: SocketAddr, control: SocketAddr, extra: &str) -> Proc {
    proxy_every(name, upstream, control, ("100ms", "1s"), extra)
}

/// A proxy named `name` with one global rule per API key of [`LIMIT`] (and `extra` YAML on
/// it), reporting to `control` every `every.0`, stale after `every.1`.
fn proxy_every(
    name: &str,
    upstream: SocketAddr,
    control: SocketAddr,
    every: (&str, &str),
    extra: &str,
) -> Proc {
    let (interval, stale_after) = every;
    let yaml = format!(
        r#"service: shop
listen: 127.0.0.1:0
admin: 127.0.0.1:0
upstream: http://{upstream}
control_plane:
  url: http://{control}
  report_interval: {interval}
  stale_after: {stale_after}
  decay: 1s
  host: {name}
rules:
  - name: per-key
    key: [header:x-api-key]
    limit: {{ rate: {LIMIT}/s }}
    scope: global
{extra}"#
    );
    let path = temp_file(&format!("{name}.yaml"), &yaml);
    Proc::spawn(&["proxy", "--config", path.to_str().unwrap()])
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    limited: AtomicU64,
    other: AtomicU64,
}

impl Counts {
    fn take(&self) -> (u64, u64, u64) {
        (
            self.ok.swap(0, Ordering::Relaxed),
            self.limited.swap(0, Ordering::Relaxed),
            self.other.swap(0, Ordering::Relaxed),
        )
    }
}

/// Offers `rps` requests/s of key `key` to `addr` for `secs`, counting answers in `counts`.
async fn offer(addr: SocketAddr, key: &'static str, rps: u64, secs: f64, counts: Arc<Counts>) {
    offer_from(addr, key, rps, secs, 0.0, counts).await
}

/// [`offer`], the first request `phase` (0 to 1) of a period late.
async fn offer_from(
    addr: SocketAddr,
    key: &'static str,
    rps: u64,
    secs: f64,
    phase: f64,
    counts: Arc<Counts>,
) {
    let c = client();
    let period = Duration::from_nanos(1_000_000_000 / rps);
    let start = tokio::time::Instant::now() + period.mul_f64(phase);
    let mut tick = tokio::time::interval_at(start, period);
    let n = (rps as f64 * secs) as u64;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        tick.tick().await;
        let (c, counts) = (c.clone(), counts.clone());
        tasks.spawn(async move {
            let (status, _, _) = send(&c, addr, "GET", "/", &[("x-api-key", key)]).await;
            let counter = match status {
                StatusCode::OK => &counts.ok,
                StatusCode::TOO_MANY_REQUESTS => &counts.limited,
                s => {
                    eprintln!("unexpected status {s}");
                    &counts.other
                }
            };
            counter.fetch_add(1, Ordering::Relaxed);
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// Offers `rps[i]` to `proxies[i]` for `secs` at once; returns the summed counts.
async fn offer_all(
    proxies: &[&Proc],
    key: &'static str,
    rps: &[u64],
    secs: f64,
) -> (u64, u64, u64) {
    let counts = Arc::new(Counts::default());
    let mut tasks = Vec::new();
    for (p, r) in proxies.iter().zip(rps) {
        tasks.push(tokio::spawn(offer(p.addr, key, *r, secs, counts.clone())));
    }
    for t in tasks {
        t.await.unwrap();
    }
    counts.take()
}

fn assert_near_limit(admitted: u64, secs: f64, what: &str) {
    assert_within(admitted, secs, 0.3, what);
}

/// The fleet's admitted rate is within `share` of [`LIMIT`] either way.
fn assert_within(admitted: u64, secs: f64, share: f64, what: &str) {
    let rate = admitted as f64 / secs;
    let limit = LIMIT as f64;
    assert!(
        ((1.0 - share) * limit..=(1.0 + share) * limit).contains(&rate),
        "{what}: the fleet admitted {rate:.0}/s against a limit of {LIMIT}/s"
    );
}

/// Three proxies in front of one app, reporting to `control`, offered 6:2:1 at 3x the limit.
const UNEVEN: [u64; 3] = [200, 67, 33];

/// Proxies p1, p2, ... in front of `up`, the n-th reporting to `to[n]`.
fn proxies(up: SocketAddr, to: &[SocketAddr]) -> Vec<Proc> {
    to.iter()
        .enumerate()
        .map(|(i, addr)| proxy(&format!("p{}", i + 1), up, *addr, ""))
        .collect()
}

/// Offers [`UNEVEN`] for `secs`, for the control loop to settle.
async fn settle(p: &[Proc], secs: f64) {
    let refs: Vec<&Proc> = p.iter().collect();
    offer_all(&refs, "hot", &UNEVEN, secs).await;
}

/// Offers [`UNEVEN`] for `secs` and checks that the fleet dropped some and admitted within
/// 15 % of the limit, with no errors.
async fn holds_the_limit(p: &[Proc], secs: f64, what: &str) {
    let refs: Vec<&Proc> = p.iter().collect();
    let (ok, limited, other) = offer_all(&refs, "hot", &UNEVEN, secs).await;
    assert_eq!(other, 0, "{what}: errors from the proxies");
    assert!(limited > 0, "{what}: nothing dropped");
    assert_within(ok, secs, 0.15, what);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_aggregator_replicas_in_one_zone_count_every_host_once() {
    let (_one, up, ctl) = fleet().await;
    // The chart's default: two replicas of the zone's aggregator. Two proxies report to one,
    // the third to the other (a Service keeps each proxy's connection on one replica).
    let a = aggregator(ctl.addr, "z1");
    let b = aggregator(ctl.addr, "z1");
    let p = proxies(up.addr, &[a.addr, a.addr, b.addr]);
    settle(&p, 3.0).await;
    holds_the_limit(&p, 4.0, "two replicas, each with part of the zone").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxies_moving_between_three_replicas_every_report_are_counted_once() {
    let (_one, up, ctl) = fleet().await;
    let replicas: Vec<Proc> = (0..3).map(|_| aggregator(ctl.addr, "z1")).collect();
    // Per-request balancing (a mesh): each report of a proxy lands on the next replica.
    let lb = Balancer::start(replicas.iter().map(|r| r.addr).collect()).await;
    let p = proxies(up.addr, &[lb.addr; 3]);
    settle(&p, 3.0).await;
    holds_the_limit(&p, 4.0, "three replicas, hosts moving every report").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_and_a_new_one_added_under_load_keep_the_fleet_at_its_limit() {
    let (_one, up, ctl) = fleet().await;
    let mut a = aggregator(ctl.addr, "z1");
    let b = aggregator(ctl.addr, "z1");
    let lb = Balancer::start(vec![a.addr, b.addr]).await;
    let p = proxies(up.addr, &[lb.addr; 3]);
    settle(&p, 3.0).await;
    holds_the_limit(&p, 2.0, "two replicas").await;
    // One replica dies: the balancer skips it, its last sums age out.
    a.kill();
    holds_the_limit(&p, 3.0, "one replica killed").await;
    // A new replica joins.
    let c = aggregator(ctl.addr, "z1");
    lb.set(vec![b.addr, c.addr]);
    holds_the_limit(&p, 3.0, "a replica added").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uneven_fleet_converges_to_the_limit_and_keys_stay_independent() {
    let (_one, up, ctl) = fleet().await;
    let agg = aggregator(ctl.addr, "z1");
    let p: Vec<Proc> = (1..=3)
        .map(|i| proxy(&format!("p{i}"), up.addr, agg.addr, ""))
        .collect();
    let refs: Vec<&Proc> = p.iter().collect();
    // 3x the limit, split 6:2:1. Let the loop settle, then measure.
    let rps = [200, 67, 33];
    offer_all(&refs, "hot", &rps, 2.0).await;
    let light = Arc::new(Counts::default());
    let light_task = tokio::spawn(offer(p[2].addr, "light", 20, 3.0, light.clone()));
    let (ok, limited, other) = offer_all(&refs, "hot", &rps, 3.0).await;
    assert_eq!(other, 0, "no errors from the proxies");
    assert!(limited > 0);
    assert_near_limit(ok, 3.0, "steady state");
    light_task.await.unwrap();
    let (ok, limited, _) = light.take();
    assert_eq!(
        limited, 0,
        "a key under its limit is never dropped ({ok} admitted)"
    );
}

/// A fleet token budget: the app says what each call used (`x-usage-tokens`), the proxies
/// report offered and admitted tokens (a refused call at its key's mean), and the controller's
/// ratio holds the fleet's tokens, not its requests, to the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_token_budget_is_held_in_the_units_the_responses_report() {
    let (_one, _up, ctl) = fleet().await;
    let app =
        answering("HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-usage-tokens: 5\r\n\r\nok").await;
    let agg = aggregator(ctl.addr, "z1");
    // Reserving 1: decided at the reservation alone, each call would count a fifth of itself.
    let cost = "    cost: { response: { header: x-usage-tokens }, reserve: 1, max: 1000 }\n";
    let p: Vec<Proc> = (1..=2)
        .map(|i| proxy(&format!("p{i}"), app, agg.addr, cost))
        .collect();
    let refs: Vec<&Proc> = p.iter().collect();
    // 20 calls a second at each proxy, 5 tokens each: twice the 100 tokens a second.
    let (settling, _, errors) = offer_all(&refs, "hot", &[20, 20], 3.0).await;
    let (ok, limited, other) = offer_all(&refs, "hot", &[20, 20], 4.0).await;
    assert_eq!(errors + other, 0, "no errors from the proxies");
    assert!(
        limited > 0,
        "the fleet's tokens are past the budget: some refused"
    );
    // Decided at the reservation alone, a refused call would offer a fifth of what the
    // admitted ones cost, and the fleet's ratio would let too few through.
    assert_within(ok * 5, 4.0, 0.2, "tokens");
    // Each answer was charged its 5 tokens at its head, before the client had it.
    let mut charged = 0.0;
    for proxy in &p {
        let sample = "spillway_response_units_total{kind=\"charged\",rule=\"per-key\"}";
        charged += counted(proxy.admin, sample).await;
    }
    assert_eq!(charged, (5 * (settling + ok)) as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_zones_and_a_proxy_reporting_straight_to_the_controller_share_one_limit() {
    let (_one, up, ctl) = fleet().await;
    let a1 = aggregator(ctl.addr, "z1");
    let a2 = aggregator(ctl.addr, "z2");
    let p1 = proxy("p1", up.addr, a1.addr, "");
    let p2 = proxy("p2", up.addr, a2.addr, "");
    let p3 = proxy("p3", up.addr, ctl.addr, "");
    let refs = [&p1, &p2, &p3];
    let rps = [100, 100, 100];
    offer_all(&refs, "k", &rps, 2.0).await;
    let (ok, _, other) = offer_all(&refs, "k", &rps, 3.0).await;
    assert_eq!(other, 0);
    assert_near_limit(ok, 3.0, "two zones and a direct proxy");
    // The controller shows the key with every source.
    let (status, _, body) = get(ctl.addr, "/v1/state", &[]).await;
    assert_eq!(status, StatusCode::OK);
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    let key = doc["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["key"] == shown("k").as_str())
        .unwrap();
    assert_eq!(key["sources"], 3, "zone:z1, zone:z2 and p3: {key}");
    assert_eq!(key["limit_rps"], LIMIT as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_controller_fails_open_without_errors_and_a_restarted_one_resumes_limiting() {
    let _one = ONE_AT_A_TIME.lock().await;
    let up = upstream().await;
    // A fixed port, so the restarted controller is found at the same address.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let listen = port.to_string();
    let mut ctl = controller(&listen, &[]);
    let agg = aggregator(ctl.addr, "z1");
    let p = proxy("p1", up.addr, agg.addr, "");
    let refs = [&p];
    offer_all(&refs, "k", &[300], 2.0).await;
    let (ok, limited, _) = offer_all(&refs, "k", &[300], 1.0).await;
    assert!(limited > 0, "limiting before the outage ({ok} admitted)");

    ctl.kill();
    // stale_after 1s + decay 1s: after ~2 s every request passes again.
    let (_, _, other) = offer_all(&refs, "k", &[300], 2.5).await;
    assert_eq!(other, 0, "no 5xx while the controller is gone");
    let (ok, limited, other) = offer_all(&refs, "k", &[300], 1.0).await;
    assert_eq!((limited, other), (0, 0), "failed open: all {ok} admitted");
    let (_, text) = {
        let (s, _, b) = get(p.admin, "/metrics", &[]).await;
        (s, b)
    };
    assert_eq!(metric(&text, "spillway_control_plane_stale"), Some(1.0));

    let _ctl = controller(&listen, &[]);
    offer_all(&refs, "k", &[300], 2.0).await;
    let (ok, limited, other) = offer_all(&refs, "k", &[300], 2.0).await;
    assert_eq!(other, 0);
    assert!(limited > 0, "limiting resumed after the restart");
    assert_near_limit(ok, 2.0, "after the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_need_the_token_and_must_be_well_formed() {
    let token = temp_file("token", "s3cret\n");
    let ctl = controller("127.0.0.1:0", &["--token-file", token.to_str().unwrap()]);
    let c = client();
    let report = r#"{"version":1,"source":"h","zone":"z","interval_ms":1000,"entries":[
        {"service":"s","rule":"r","limit":{"count":10,"period_ms":1000},"key":"k","offered":30,"admitted":30}]}"#;
    let post = |auth: Option<&'static str>, body: String| {
        let c = c.clone();
        async move {
            // As this release's reporters (a previous one gets 503 while the controller warms).
            let mut req = http::Request::post(format!("http://{}/v1/report", ctl.addr))
                .header("spillway-wire", "2");
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let body = http_body_util::Full::new(bytes::Bytes::from(body));
            use http_body_util::BodyExt;
            let resp = c
                .request(
                    req.body(body.map_err(|never| match never {}).boxed())
                        .unwrap(),
                )
                .await;
            // A server that refuses a body it will not read may close before the client has
            // sent it all: then the client sees the reset, not always the 413 before it.
            let Ok(resp) = resp else {
                return (
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "connection closed early".into(),
                );
            };
            let status = resp.status();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
    };
    assert_eq!(post(None, report.into()).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(
        post(Some("Bearer wrong"), report.into()).await.0,
        StatusCode::UNAUTHORIZED
    );
    let (status, body) = post(Some("Bearer s3cret"), report.into()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!((reply["ratios"][0]["ratio"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-9);
    // An invalid entry is dropped and counted; the report is not refused for it.
    let (status, body) = post(
        Some("Bearer s3cret"),
        report
            .replace("\"admitted\":30", "\"admitted\":31")
            .replace("\"h\"", "\"h2\""),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("\"ratios\":[]"), "{body}");
    for bad in [
        "not json".to_string(),
        report.replace("\"version\":1", "\"version\":9"),
        report.replace("\"offered\":30", "\"offered\":-1"),
    ] {
        let (status, body) = post(Some("Bearer s3cret"), bad.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
    let huge = format!("{{\"pad\":\"{}\"}}", "x".repeat(9 << 20));
    assert_eq!(
        post(Some("Bearer s3cret"), huge).await.0,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    // The refused reports changed nothing: one entry, from the good report.
    let (status, _, _) = get(ctl.addr, "/v1/state", &[]).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "state holds keys: it needs the token"
    );
    let (_, _, body) = get(ctl.addr, "/v1/state", &[("authorization", "Bearer s3cret")]).await;
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["keys"].as_array().unwrap().len(), 1);
    let offered = doc["keys"][0]["offered_rps"].as_f64().unwrap();
    assert!((29.0..=30.0).contains(&offered), "{offered}");

    // A rotated Secret: the new token works without a restart, the old one no longer does.
    // Polled (bounded: 10 s), since the file watcher's reload is the signal.
    std::fs::write(&token, "n3w-t0ken\n").unwrap();
    let mut rotated = false;
    for _ in 0..500 {
        if post(Some("Bearer n3w-t0ken"), report.into()).await.0 == StatusCode::OK {
            rotated = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(rotated, "the rotated token was never accepted");
    assert_eq!(
        post(Some("Bearer s3cret"), report.into()).await.0,
        StatusCode::UNAUTHORIZED
    );
}

/// A sidecar whose control plane is not there (it goes stale after 1 s of its manual clock),
/// with one global rule per `x-api-key` and `fallback`.
async fn stale_sidecar(
    fallback: &str,
) -> (
    spillway::internal::proxy::Sidecar,
    Upstream,
    spillway::internal::limit::ManualClock,
) {
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    sidecar_with_clock(&format!(
        r#"control_plane: {{ url: "http://{nowhere}", report_interval: 100ms, stale_after: 1s, decay: 1s }}
rules:
  - name: per-key
    key: [header:x-api-key]
    limit: {{ rate: 100/s }}
    scope: global
    fallback: {fallback}
"#
    ))
    .await
}

#[tokio::test]
async fn while_the_control_plane_is_stale_the_fallback_limit_applies() {
    let (sc, _up, clock) = stale_sidecar("{ rate: 1/h, burst: 2 }").await;
    let addr = sc.addr();
    let three = |key: &'static str| async move {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(get(addr, "/", &[("x-api-key", key)]).await.0.as_u16());
        }
        v
    };
    // Fresh, but no reply has assigned the key: the fallback is its provisional limit.
    assert_eq!(
        three("k").await,
        [200, 200, 429],
        "provisional: the fallback"
    );
    clock.advance(Duration::from_secs(2));
    assert_eq!(
        three("k2").await,
        [200, 200, 429],
        "the fallback's burst of 2"
    );
    assert_eq!(three("k").await, [429, 429, 429], "the same fallback state");
}

/// `fallback.algorithm` is the fallback's: a sliding log of 2/s refuses a third request half
/// a second later, where a token bucket would have refilled one.
#[tokio::test]
async fn a_fallback_limit_uses_its_own_algorithm() {
    let (sc, _up, clock) = stale_sidecar("{ rate: 2/s, algorithm: sliding_window_log }").await;
    let k = [("x-api-key", "k")];
    clock.advance(Duration::from_secs(2));
    let mut statuses = Vec::new();
    for step in [0, 0, 0, 500, 600] {
        clock.advance(Duration::from_millis(step));
        statuses.push(get(sc.addr(), "/", &k).await.0.as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 429, 200], "a sliding log of 2/s");
}

#[tokio::test]
async fn a_request_dropped_by_a_global_rule_gets_429_with_retry_after_and_ratelimit_headers() {
    let ctl = controller_in_process().await;
    let (sc, _up) = sidecar(&global_rule(ctl.addr)).await;
    let k = [("x-api-key", "k")];
    // Offer far over 5/s until the controller's ratio arrives and a request is dropped
    // (bounded: 3000 requests).
    let mut dropped = None;
    for _ in 0..3000 {
        let (status, headers, body) = get(sc.addr(), "/", &k).await;
        if status == StatusCode::TOO_MANY_REQUESTS {
            dropped = Some((headers, body));
            break;
        }
    }
    let (headers, body) = dropped.expect("the global rule never dropped a request");
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry >= 1, "{retry}");
    assert_eq!(headers["ratelimit-policy"], "\"fleet-wide\";q=5;w=1");
    assert_eq!(
        headers["ratelimit"],
        format!("\"fleet-wide\";r=0;t={retry}").as_str()
    );
    assert!(body.contains("\"rule\":\"fleet-wide\""), "{body}");
    ctl.shutdown();
}

/// POSTs `body` to `addr`'s `/v1/report` with `Authorization: Bearer <token>`, as this
/// release's reporters do (`spillway-wire: 2`).
async fn post_as(addr: SocketAddr, token: Option<&str>, body: String) -> (StatusCode, String) {
    post_wire(addr, token, body, Some("2")).await
}

/// [`post_as`] with `spillway-wire: <wire>`, or none (a previous release's reporter).
async fn post_wire(
    addr: SocketAddr,
    token: Option<&str>,
    body: String,
    wire: Option<&str>,
) -> (StatusCode, String) {
    use http_body_util::BodyExt;
    let mut req = http::Request::post(format!("http://{addr}/v1/report"));
    if let Some(w) = wire {
        req = req.header("spillway-wire", w);
    }
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let body = http_body_util::Full::new(bytes::Bytes::from(body));
    let resp = client()
        .request(
            req.body(body.map_err(|never| match never {}).boxed())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A report from `source` of one key of `service`, offered 30 against a limit of `limit` per
/// second.
fn one_key(source: &str, service: &str, key: &str, limit: u64) -> String {
    format!(
        r#"{{"version":1,"source":"{source}","zone":"z","interval_ms":1000,"entries":[
        {{"service":"{service}","rule":"r","limit":{{"count":{limit},"period_ms":1000}},"key":"{key}","offered":30,"admitted":30}}]}}"#
    )
}

/// The keys `/v1/state` shows to `token`.
async fn state_keys(addr: SocketAddr, token: &str) -> (StatusCode, Vec<String>) {
    let auth = format!("Bearer {token}");
    let (status, _, body) = get(addr, "/v1/state", &[("authorization", &auth)]).await;
    let keys = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|d| d["keys"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .map(|k| {
            format!(
                "{}/{}",
                k["service"].as_str().unwrap(),
                k["key"].as_str().unwrap_or("-")
            )
        })
        .collect();
    (status, keys)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_services_token_reports_and_reads_only_that_service() {
    let dir = std::env::temp_dir().join(format!("spillway-tokens-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("..data")).unwrap();
    for (name, token) in [
        ("shop", "shop-t"),
        ("books", "books-t"),
        ("_aggregators", "agg-t"),
        ("_admin", "admin-t"),
        (".hidden", "hidden-t"),
    ] {
        std::fs::write(dir.join(name), token).unwrap();
    }
    let ctl = controller("127.0.0.1:0", &["--tokens", dir.to_str().unwrap()]);
    let metrics = || async { get(ctl.admin, "/metrics", &[]).await.2 };

    // Books is over its limit; shop's reply must not carry books' key.
    let (status, body) = post_as(
        ctl.addr,
        Some("books-t"),
        one_key("b1", "books", "secret-books-key", 10),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("secret-books-key"), "its own ratio: {body}");
    let (status, body) = post_as(
        ctl.addr,
        Some("shop-t"),
        one_key("s1", "shop", "shop-key", 100),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(
        !body.contains("books"),
        "another service's keys leaked: {body}"
    );

    // The attacks of the issue: shop's token reporting a tiny limit for books, as a host or as
    // a zone; a dot entry's token; no token at all.
    let forged = one_key("s1", "books", "secret-books-key", 1);
    assert_eq!(
        post_as(ctl.addr, Some("shop-t"), forged).await.0,
        StatusCode::FORBIDDEN
    );
    let zone = one_key("zone:z/x", "shop", "shop-key", 100);
    assert_eq!(
        post_as(ctl.addr, Some("shop-t"), zone.clone()).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        post_as(ctl.addr, Some("hidden-t"), zone.clone()).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        post_as(ctl.addr, Some("admin-t"), zone.clone()).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        post_as(ctl.addr, Some("agg-t"), zone).await.0,
        StatusCode::OK
    );
    // The admin token reads, and reports nothing; the aggregators' token sends zone sums only
    // (either could otherwise blank a host of shop's under its own name).
    let blank = r#"{"version":1,"source":"shop/s1","interval_ms":1000,"seq":4611686018427387904,"entries":[]}"#;
    for token in ["admin-t", "agg-t"] {
        let (status, body) = post_as(ctl.addr, Some(token), blank.into()).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{token}: {body}");
    }
    let text = metrics().await;
    assert_eq!(
        metric(
            &text,
            "spillway_controller_reports_total{result=\"forbidden\"}"
        ),
        Some(5.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "spillway_controller_reports_total{result=\"unauthorized\"}"
        ),
        Some(1.0)
    );

    // Shop's token cannot take over books' host name: an empty report with a huge sequence
    // number under it lands in shop's own name space, and books' host keeps reporting.
    let hijack =
        r#"{"version":1,"source":"b1","interval_ms":1000,"seq":18446744073709551615,"entries":[]}"#;
    assert_eq!(
        post_as(ctl.addr, Some("shop-t"), hijack.into()).await.0,
        StatusCode::OK
    );
    let again =
        one_key("b1", "books", "secret-books-key", 10).replace("\"zone\"", "\"seq\":5,\"zone\"");
    let (status, body) = post_as(ctl.addr, Some("books-t"), again).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(
        body.contains("secret-books-key"),
        "books' host still counted: {body}"
    );
    let text = metrics().await;
    assert_eq!(
        metric(
            &text,
            "spillway_controller_reports_total{result=\"duplicate\"}"
        ),
        None,
        "{text}"
    );

    // State: nothing without a token, a service sees itself, aggregators and admin see all.
    assert_eq!(
        get(ctl.addr, "/v1/state", &[]).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        get(ctl.admin, "/ui/state.json", &[]).await.0,
        StatusCode::UNAUTHORIZED
    );
    let (_, shop) = state_keys(ctl.addr, "shop-t").await;
    assert_eq!(shop, ["shop/shop-key"]);
    let (_, all) = state_keys(ctl.addr, "admin-t").await;
    assert_eq!(all.len(), 2, "{all:?}");
    let (_, all) = state_keys(ctl.addr, "agg-t").await;
    assert_eq!(all.len(), 2, "{all:?}");
    let (_, _, ui) = get(
        ctl.admin,
        "/ui/state.json",
        &[("authorization", "Bearer shop-t")],
    )
    .await;
    assert!(ui.contains("shop-key") && !ui.contains("books"), "{ui}");

    // A rotated service token: polled (bounded: 10 s), since the watcher's reload is the signal.
    std::fs::write(dir.join("shop"), "shop-t2\n").unwrap();
    let mut rotated = false;
    for _ in 0..500 {
        if post_as(
            ctl.addr,
            Some("shop-t2"),
            one_key("s1", "shop", "shop-key", 100),
        )
        .await
        .0 == StatusCode::OK
        {
            rotated = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(rotated, "the rotated token was never accepted");
    assert_eq!(
        post_as(
            ctl.addr,
            Some("shop-t"),
            one_key("s1", "shop", "shop-key", 100)
        )
        .await
        .0,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_names_and_keys_are_refused_without_growing_the_controller() {
    let ctl = controller("127.0.0.1:0", &[]);
    let long_source = one_key(&"s".repeat(10_000), "shop", "k", 10);
    let (status, body) = post_as(ctl.addr, None, long_source).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    // An entry with a huge key is dropped (counted); the rest of the report stands.
    let huge_key = format!(
        r#"{{"version":1,"source":"h","interval_ms":1000,"entries":[
        {{"service":"shop","rule":"r","limit":{{"count":10,"period_ms":1000}},"key":"{}","offered":30,"admitted":30}},
        {{"service":"shop","rule":"r","limit":{{"count":10,"period_ms":1000}},"key":"small","offered":30,"admitted":30}}]}}"#,
        "k".repeat(100_000)
    );
    let (status, body) = post_as(ctl.addr, None, huge_key).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("small") && !body.contains("kkkk"), "{body}");
    let text = get(ctl.admin, "/metrics", &[]).await.2;
    assert_eq!(
        metric(
            &text,
            "spillway_controller_reports_total{result=\"entries_dropped\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "spillway_controller_reports_total{result=\"invalid\"}"
        ),
        Some(1.0)
    );
}

#[test]
fn a_control_plane_beyond_loopback_needs_a_token_or_says_it_is_insecure() {
    for role in [
        &["controller"][..],
        &[
            "aggregator",
            "--controller",
            "http://127.0.0.1:9",
            "--zone",
            "z",
        ][..],
    ] {
        let out = std::process::Command::new(BIN)
            .args(role)
            .args(["--listen", "0.0.0.0:0", "--admin", "127.0.0.1:0"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{role:?} started with no token");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--tokens DIR") && err.contains("--insecure"),
            "{err}"
        );
    }
    // With --insecure it starts, and says so in a metric.
    let ctl = Proc::spawn(&[
        "controller",
        "--listen",
        "0.0.0.0:0",
        "--admin",
        "127.0.0.1:0",
        "--insecure",
    ]);
    let text = std::thread::spawn(move || {
        tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(async move { get(ctl.admin, "/metrics", &[]).await.2 })
    })
    .join()
    .unwrap();
    assert_eq!(
        metric(&text, "spillway_controller_insecure"),
        Some(1.0),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_with_per_service_tokens_the_fleet_limits_and_refuses_plain_text() {
    let _one = ONE_AT_A_TIME.lock().await;
    let ca = test_ca("fleet");
    let file = |n: &str| ca.join(n).to_str().unwrap().to_string();
    let tokens = std::env::temp_dir().join(format!("spillway-tls-tokens-{}", std::process::id()));
    std::fs::create_dir_all(&tokens).unwrap();
    for (name, token) in [
        ("shop", "shop-t"),
        ("books", "books-t"),
        ("_aggregators", "agg-t"),
    ] {
        std::fs::write(tokens.join(name), token).unwrap();
    }
    let tokens = tokens.to_str().unwrap();
    let tls = [
        "--tls-cert",
        &file("server.crt"),
        "--tls-key",
        &file("server.key"),
    ];
    let mut args = vec!["--tokens", tokens];
    args.extend_from_slice(&tls);
    let ctl = controller("127.0.0.1:0", &args);
    let url = format!("https://{}", ctl.addr);
    let ca_file = file("ca.crt");
    let mut args = vec!["--tokens", tokens, "--ca-file", &ca_file];
    args.extend_from_slice(&tls);
    let agg = aggregator_at(&url, "z1", &args);
    let up = upstream().await;
    let shop_token = temp_file("shop-token", "shop-t\n");
    let yaml = format!(
        r#"service: shop
listen: 127.0.0.1:0
admin: 127.0.0.1:0
upstream: http://{}
control_plane:
  url: https://{}
  ca_file: {}
  token_file: {}
  report_interval: 100ms
  stale_after: 1s
  host: tls-1
rules:
  - name: per-key
    key: [header:x-api-key]
    limit: {{ rate: {LIMIT}/s }}
    scope: global
"#,
        up.addr,
        agg.addr,
        file("ca.crt"),
        shop_token.display()
    );
    let path = temp_file("tls-proxy.yaml", &yaml);
    let p = Proc::spawn(&["proxy", "--config", path.to_str().unwrap()]);
    offer_all(&[&p], "k", &[300], 2.0).await;
    let (ok, limited, other) = offer_all(&[&p], "k", &[300], 2.0).await;
    assert_eq!(other, 0);
    assert!(limited > 0, "limiting over TLS ({ok} admitted)");
    assert_near_limit(ok, 2.0, "over TLS");

    // The aggregator holds shop's token for shop only.
    let c = reqwest_like_tls(&file("ca.crt"));
    let forged = one_key("h", "books", "k", 1);
    let status = c(agg.addr, "shop-t", forged).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // The status page and its state are on the TLS port too, so the token travels encrypted.
    let tls = spillway::internal::control::tls::client_config(Some(std::path::Path::new(&file(
        "ca.crt",
    ))))
    .unwrap();
    let https = spillway::internal::control::client::json_client(Some(tls)).unwrap();
    for (path, token) in [("/ui", None), ("/ui/state.json", Some("Bearer agg-t"))] {
        let mut req = http::Request::get(format!("https://{}{path}", ctl.addr));
        if let Some(t) = token {
            req = req.header("authorization", t);
        }
        let req = req
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let status = https.request(req).await.unwrap().status();
        assert_eq!(status, StatusCode::OK, "{path} over TLS");
    }
    // Plain text to a TLS port gets no answer.
    let plain = tokio::time::timeout(
        Duration::from_secs(5),
        client().request(
            http::Request::get(format!("http://{}/v1/state", ctl.addr))
                .body(empty())
                .unwrap(),
        ),
    )
    .await
    .expect("the TLS port closes on plain text");
    assert!(plain.is_err() || plain.unwrap().status() != StatusCode::OK);
}

/// Posts a report over HTTPS, trusting `ca`; returns the status.
#[allow(clippy::type_complexity)]
fn reqwest_like_tls(
    ca: &str,
) -> impl Fn(
    SocketAddr,
    &'static str,
    String,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = StatusCode> + Send>> {
    let tls =
        spillway::internal::control::tls::client_config(Some(std::path::Path::new(ca))).unwrap();
    let c = spillway::internal::control::client::json_client(Some(tls)).unwrap();
    move |addr, token, body| {
        let c = c.clone();
        Box::pin(async move {
            let req = http::Request::post(format!("https://{addr}/v1/report"))
                .header("authorization", format!("Bearer {token}"))
                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                .unwrap();
            c.request(req).await.unwrap().status()
        })
    }
}

/// A report from host `h` (zone `z`, 4 s interval) numbered `seq`, offering `offered` a
/// second of key `k` against a limit of 10, its rate stepped by `jump`.
fn stepping(seq: u64, offered: u64, jump: f64) -> String {
    format!(
        r#"{{"version":1,"source":"h","zone":"z","interval_ms":4000,"seq":{seq},"entries":[
        {{"service":"shop","rule":"r","limit":{{"count":10,"period_ms":1000}},"key":"k","offered":{offered},"admitted":{offered},"jump":{jump}}}]}}"#,
        offered = offered * 4
    )
}

/// The reply's `age_ms` and its ratio for key `k` (0 when it has none).
fn age_and_ratio(body: &str) -> (u64, f64) {
    let reply: serde_json::Value = serde_json::from_str(body).unwrap();
    let ratio = reply["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["key"] == "k")
        .map_or(0.0, |r| r["ratio"].as_f64().unwrap());
    (reply["age_ms"].as_u64().unwrap(), ratio)
}

/// An aggregator's answered forwards.
const FORWARDS_OK: &str = "spillway_aggregator_forwards_total{result=\"ok\"}";

/// `sample` in the metrics of the process whose admin listener is `admin` (0 until counted).
async fn counted(admin: SocketAddr, sample: &str) -> f64 {
    metric(&get(admin, "/metrics", &[]).await.2, sample).unwrap_or(0.0)
}

/// Waits until `sample` at `admin` is past `before` (its readiness signal), and returns it.
async fn counted_past(admin: SocketAddr, sample: &str, before: f64) -> f64 {
    loop {
        let now = counted(admin, sample).await;
        if now > before {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An aggregator for zone `z` forwarding to `ctl` every `every`, once its first forward (at
/// its start) was answered.
async fn answering_aggregator(ctl: &Proc, every: &str) -> Proc {
    let url = format!("http://{}", ctl.addr);
    let agg = Proc::spawn(&aggregator_args(&url, "z", every));
    counted_past(agg.admin, FORWARDS_OK, 0.0).await;
    agg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_whose_rate_stepped_is_answered_by_sums_that_hold_it() {
    let (_one, _up, ctl) = fleet().await;
    // Forwarding every 2 s: a reply to a report is otherwise from the forward before it.
    let agg = answering_aggregator(&ctl, "2s").await;
    // A steady report is answered at once, by sums that do not hold it (age above 0): the
    // controller has not heard of the key.
    let (status, body) = post_as(agg.addr, None, stepping(1, 8, 0.0)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (age, ratio) = age_and_ratio(&body);
    assert!(age >= 1, "{body}");
    assert_eq!(ratio, 0.0, "{body}");
    let before = counted(agg.admin, FORWARDS_OK).await;
    // The host's rate steps to 30 times the limit: its reply waits for an early forward and
    // carries the controller's answer to it, saying so (age 0).
    let (status, body) = post_as(agg.addr, None, stepping(2, 300, 292.0)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (age, ratio) = age_and_ratio(&body);
    assert_eq!(age, 0, "the sums behind the reply hold the report: {body}");
    assert!(ratio > 0.5, "the step is in the ratio: {body}");
    assert!(counted(agg.admin, FORWARDS_OK).await > before);
}

/// A report from host `host` (zone `z`, 2 s interval) numbered `seq`, offering `offered` a
/// second of key `k` against a limit of 10, its rate stepped by `jump`.
fn moving(host: &str, seq: u64, offered: u64, jump: f64) -> String {
    format!(
        r#"{{"version":1,"source":"{host}","zone":"z","interval_ms":2000,"seq":{seq},"entries":[
        {{"service":"shop","rule":"r","limit":{{"count":10,"period_ms":1000}},"key":"k","offered":{offered},"admitted":{offered},"jump":{jump}}}]}}"#,
        offered = offered * 2
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_moving_between_hosts_is_answered_by_sums_that_hold_both_steps() {
    let (_one, _up, ctl) = fleet().await;
    // Forwarding every 3 s, hosts reporting every 2 s: a host waits at most 1 s for a forward
    // that holds its step, and a window shorter than half an interval would leave the
    // controller's sums empty before the next tick. So both hosts' steps go in forwards of
    // the last window's rates again.
    let agg = answering_aggregator(&ctl, "3s").await;
    // Two hosts offer the key 6:1 of 7 times its limit, and a forward takes it.
    for (host, offered) in [("h1", 60), ("h2", 10)] {
        let (status, body) = post_as(agg.addr, None, moving(host, 1, offered, 0.0)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let before = counted(agg.admin, FORWARDS_OK).await;
    counted_past(agg.admin, FORWARDS_OK, before).await;
    // The load moves from h1 to h2, the total unchanged; each host's report says its step.
    let (status, body) = post_as(agg.addr, None, moving("h1", 2, 10, -50.0)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (age1, ratio1) = age_and_ratio(&body);
    let (status, body) = post_as(agg.addr, None, moving("h2", 2, 60, 50.0)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (age2, ratio2) = age_and_ratio(&body);
    // Each answered by sums that hold its own report.
    assert_eq!(age1, 0, "the step down is in the sums behind its reply");
    assert_eq!(age2, 0, "the step up is in the sums behind its reply");
    // The fleet's sum did not grow: the step up met the step down, and h2 (whose surge hold
    // ends on it) is given the ratio h1 was.
    assert!(ratio1 > 0.5, "the key is held to its limit: {ratio1}");
    assert!(
        (ratio2 - ratio1).abs() < 0.02,
        "the fleet's load did not grow: {ratio1} then {ratio2}"
    );
    // The load moves back, the step up sent first and the step down at once after it: one
    // early forward holds both (a forward with the step up alone would have its reply wait
    // for a step down that could only follow it). After the next tick's forward: there are
    // two early forwards at most between two of the interval's.
    let before = counted(agg.admin, FORWARDS_OK).await;
    counted_past(agg.admin, FORWARDS_OK, before).await;
    let up = tokio::spawn(post_as(agg.addr, None, moving("h1", 3, 60, 50.0)));
    let (status, body) = post_as(agg.addr, None, moving("h2", 3, 10, -50.0)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = up.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{body}");
    let (age3, ratio3) = age_and_ratio(&body);
    assert_eq!(age3, 0, "the step up is in the sums behind its reply");
    assert!(
        (ratio3 - ratio1).abs() < 0.02,
        "the fleet's load did not grow: {ratio1} then {ratio3}"
    );
}

/// Zone `zone`'s sums as its one aggregator replica forwards them (1 s window), numbered
/// `seq`: key `k` offered `offered` a second against a limit of 10, its rate stepped by `jump`.
fn zone_sums(zone: &str, seq: u64, offered: u64, jump: f64) -> String {
    format!(
        r#"{{"version":1,"source":"zone:{zone}/r","zone":"{zone}","interval_ms":1000,"seq":{seq},"entries":[
        {{"service":"shop","rule":"r","limit":{{"count":10,"period_ms":1000}},"key":"k","offered":{offered},"admitted":{offered},"jump":{jump}}}]}}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_up_is_answered_with_the_step_down_that_comes_through_another_zone_moments_later() {
    let (_one, _up, ctl) = fleet().await;
    // Two zones offer the key 6:1 of 7 times its limit, until the controller is past its
    // warm-up (a reply without the wire header is refused until then).
    let mut seq = 0;
    let before = loop {
        seq += 1;
        let a = post_wire(ctl.addr, None, zone_sums("a", seq, 60, 0.0), None).await;
        let b = post_wire(ctl.addr, None, zone_sums("b", seq, 10, 0.0), None).await;
        if a.0 == StatusCode::OK && b.0 == StatusCode::OK {
            break age_and_ratio(&b.1).1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(before > 0.5, "the key is held to its limit: {before}");
    let ok = "spillway_controller_reports_total{result=\"ok\"}";
    // The load moves from zone a to zone b: b's step up is taken first, a's step down just
    // after it (each zone's aggregator forwards early, at once).
    let before_up = counted(ctl.admin, ok).await;
    let up = tokio::spawn(post_wire(
        ctl.addr,
        None,
        zone_sums("b", seq + 1, 60, 50.0),
        None,
    ));
    counted_past(ctl.admin, ok, before_up).await;
    let (status, body) = post_wire(ctl.addr, None, zone_sums("a", seq + 1, 10, -50.0), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = up.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{body}");
    // The reply to the step up holds the step down too: the fleet's load did not grow (a
    // sum grown by the step up alone would say about 0.92), so the proxies the load moved
    // to are not held to their old share for an interval more.
    let after = age_and_ratio(&body).1;
    assert!(
        (after - before).abs() < 0.02,
        "the step up's reply: {after}, before the move: {before}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_announces_its_rules_as_it_starts_and_reports_its_counts_a_whole_interval_later() {
    let (_one, up, ctl) = fleet().await;
    // Reporting every 10 s: its first report of counts comes 10 s after it starts.
    let p = proxy_every("p1", up.addr, ctl.addr, ("10s", "30s"), "");
    // Offered (admitted or not: a new key's provisional limit is spaced evenly).
    for _ in 0..5 {
        let status = get(p.addr, "/", &[("x-api-key", "k")]).await.0;
        assert!([200, 429].contains(&status.as_u16()), "{status}");
    }
    // Its first report is answered at once (so its reply's hints bound its new keys from the
    // start: their share of the limit, not the whole of it).
    counted_past(p.admin, "spillway_reports_total{result=\"ok\"}", 0.0).await;
    // It named the rule and counted nothing: the requests so far are a rate over the first
    // interval, and go with its report.
    let (status, _, body) = get(ctl.addr, "/v1/state", &[]).await;
    assert_eq!(status, StatusCode::OK);
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    let keys = doc["keys"].as_array().unwrap();
    let tail = keys
        .iter()
        .find(|k| k["rule"] == "per-key" && k["key"].is_null())
        .unwrap_or_else(|| panic!("the rule is known: {body}"));
    assert_eq!(tail["sources"], 1, "{tail}");
    assert_eq!(tail["offered_rps"], 0.0, "{tail}");
    assert!(
        keys.iter().all(|k| k["key"] != shown("k").as_str()),
        "no key's counts yet: {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_arrives_is_cut_off_and_a_new_replica_hands_out_no_empty_ratios() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let agg = aggregator(nowhere, "z1");
    // A report whose body stops after one byte: answered 408, the connection not held.
    let mut s = tokio::net::TcpStream::connect(agg.addr).await.unwrap();
    s.write_all(b"POST /v1/report HTTP/1.1\r\nhost: a\r\ncontent-length: 100\r\n\r\n{")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the stalled body still holds the connection");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    // With no answer from its controller yet, a replica counts a report but does not answer
    // it with an empty set of ratios (a proxy would take that as fresh): 503.
    let in_z1 = one_key("h", "shop", "k", 10).replace(r#""zone":"z""#, r#""zone":"z1""#);
    let (status, body) = post_as(agg.addr, None, in_z1).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    // A host that says it is in another zone (its sidecar points at the wrong zone's
    // aggregators) is counted, and shown apart.
    let (status, body) = post_as(agg.addr, None, one_key("h2", "shop", "k", 10)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let text = get(agg.admin, "/metrics", &[]).await.2;
    assert_eq!(
        metric(&text, "spillway_aggregator_reports_total{result=\"ok\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "spillway_aggregator_reports_total{result=\"other_zone\"}"
        ),
        Some(1.0),
        "{text}"
    );
}

// The fleet's arithmetic: many keys, uneven intervals and weighted requests.

/// A proxy of service `shop` reporting to `control` every `interval`, with `rules` (YAML
/// list items) and `top_k`.
fn proxy_with(
    name: &str,
    upstream: SocketAddr,
    control: SocketAddr,
    interval: &str,
    top_k: u32,
    rules: &str,
) -> Proc {
    let yaml = format!(
        r#"service: shop
listen: 127.0.0.1:0
admin: 127.0.0.1:0
upstream: http://{upstream}
control_plane:
  url: http://{control}
  report_interval: {interval}
  stale_after: 30s
  decay: 1s
  top_k: {top_k}
  host: {name}
rules:
{rules}"#
    );
    let path = temp_file(&format!("{name}.yaml"), &yaml);
    Proc::spawn(&["proxy", "--config", path.to_str().unwrap()])
}

/// `n` proxies named `name1`, `name2`... as [`proxy_with`] starts them.
fn named_proxies(
    n: usize,
    name: &str,
    upstream: SocketAddr,
    control: SocketAddr,
    interval: &str,
    top_k: u32,
    rules: &str,
) -> Vec<Proc> {
    (1..=n)
        .map(|i| {
            proxy_with(
                &format!("{name}{i}"),
                upstream,
                control,
                interval,
                top_k,
                rules,
            )
        })
        .collect()
}

/// One global rule per API key at `rate`, with `extra` YAML.
fn per_key(rate: &str, extra: &str) -> String {
    format!(
        "  - name: per-key\n    key: [header:x-api-key]\n    limit: {{ rate: {rate} }}\n    scope: global\n{extra}"
    )
}

/// Offers, for `secs` at once, each (proxy, key, rps) of `load`; answers counted per entry.
/// Entries start at phases spread over their periods, as independent clients do: clients in
/// lockstep at a multiple of the report interval would each meet the ratio at the same point
/// of its ripple.
async fn offer_keys(load: &[(SocketAddr, &'static str, u64)], secs: f64) -> Vec<(u64, u64, u64)> {
    let counts: Vec<Arc<Counts>> = load.iter().map(|_| Arc::default()).collect();
    let mut tasks = Vec::new();
    for (i, ((addr, key, rps), c)) in load.iter().zip(&counts).enumerate() {
        // The golden ratio's fractional multiples: evenly spread for any number of entries.
        let phase = (i as f64 * 0.618_033_988_75).fract();
        tasks.push(tokio::spawn(offer_from(
            *addr,
            key,
            *rps,
            secs,
            phase,
            c.clone(),
        )));
    }
    for t in tasks {
        t.await.unwrap();
    }
    counts.iter().map(|c| c.take()).collect()
}

/// What the control plane knows a `header:` key's value by: its digest (no
/// `key_secret_file` here: the built-in secret's).
fn shown(value: &str) -> String {
    spillway::internal::digest::Secret::default().of_value(value.as_bytes())
}

fn key_name(prefix: &str, i: usize) -> &'static str {
    Box::leak(format!("{prefix}-{i}").into_boxed_str())
}

/// Admitted and offered over `counts`.
fn sum(counts: &[(u64, u64, u64)]) -> (u64, u64) {
    let ok = counts.iter().map(|c| c.0).sum();
    let all = counts.iter().map(|c| c.0 + c.1 + c.2).sum();
    (ok, all)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legitimate_keys_under_their_limit_lose_nothing_while_a_flood_of_keys_is_held_to_its_own() {
    let (_one, up, ctl) = fleet().await;
    // 2/s per key; 60 attacker keys at 2/s on each of two proxies (twice their limit), four
    // clients at half their limit, each sticking to one proxy. top_k 10: most keys are not
    // among a proxy's heaviest.
    let rules = per_key("2/s", "");
    let p = named_proxies(2, "flood", up.addr, ctl.addr, "250ms", 10, &rules);
    let mut load = Vec::new();
    for i in 0..60 {
        let k = key_name("attacker", i);
        load.push((p[0].addr, k, 2));
        load.push((p[1].addr, k, 2));
    }
    for i in 0..4 {
        load.push((p[i % 2].addr, key_name("legit", i), 1));
    }
    offer_keys(&load, 3.0).await;
    let secs = 8.0;
    let counts = offer_keys(&load, secs).await;
    let (legit_ok, legit_all) = sum(&counts[120..]);
    assert!(
        legit_ok as f64 >= 0.99 * legit_all as f64,
        "legitimate keys: {legit_ok} of {legit_all} admitted"
    );
    let (attack_ok, _) = sum(&counts[..120]);
    eprintln!("attackers: {attack_ok}; legitimate: {legit_ok} of {legit_all}");
    let allowed = 60.0 * 2.0 * secs;
    assert!(
        (attack_ok as f64 - allowed).abs() <= 0.15 * allowed,
        "attackers got {attack_ok} against the {allowed} their keys are allowed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_under_their_limit_spread_over_three_proxies_beyond_top_k_are_all_admitted() {
    let (_one, up, ctl) = fleet().await;
    // 90 clients at 60 % of 5/s, 30 on each proxy, top_k 10.
    let rules = per_key("5/s", "");
    let p = named_proxies(3, "tail", up.addr, ctl.addr, "250ms", 10, &rules);
    let load: Vec<_> = (0..90)
        .map(|i| (p[i % 3].addr, key_name("client", i), 3))
        .collect();
    offer_keys(&load, 3.0).await;
    let counts = offer_keys(&load, 8.0).await;
    let (ok, all) = sum(&counts);
    assert!(
        ok as f64 >= 0.99 * all as f64,
        "{ok} of {all} admitted for clients under their limit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_light_on_each_proxy_but_over_its_limit_across_them_is_found_and_held() {
    let (_one, up, ctl) = fleet().await;
    // top_k 3: each proxy has three heavier keys of its own and ten light ones; the hidden
    // key offers 10/s on each of three proxies, 30/s against 10/s.
    let rules = per_key("10/s", "");
    let p = named_proxies(3, "hide", up.addr, ctl.addr, "250ms", 3, &rules);
    let mut load = Vec::new();
    for (n, proxy) in p.iter().enumerate() {
        load.push((proxy.addr, "hidden", 10));
        for j in 0..3 {
            load.push((proxy.addr, key_name("heavy", n * 3 + j), 16));
        }
        for j in 0..10 {
            load.push((proxy.addr, key_name("light", n * 10 + j), 2));
        }
    }
    offer_keys(&load, 3.0).await;
    // Each request is admitted or not by a random draw: 16 s, 160 admitted of 480, keeps
    // the draw's own spread (one standard deviation 6.5 %) well inside the bound.
    let secs = 16.0;
    let counts = offer_keys(&load, secs).await;
    let hidden: u64 = counts.iter().step_by(14).map(|c| c.0).sum();
    let rate = hidden as f64 / secs;
    eprintln!("hidden: {rate:.2}/s");
    assert!(
        (rate - 10.0).abs() <= 0.2 * 10.0,
        "the hidden key got {rate:.1}/s against 10/s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxies_reporting_every_250ms_1s_and_5s_behind_one_aggregator_share_one_limit() {
    let (_one, up, ctl) = fleet().await;
    let control = format!("http://{}", ctl.addr);
    let agg = Proc::spawn(&aggregator_args(&control, "eu-1", "1s"));
    let rules = per_key(&format!("{LIMIT}/s"), "");
    let p: Vec<Proc> = ["250ms", "1s", "5s"]
        .iter()
        .enumerate()
        .map(|(i, every)| proxy_with(&format!("mixed{i}"), up.addr, agg.addr, every, 10, &rules))
        .collect();
    let load: Vec<_> = p.iter().map(|p| (p.addr, "hot", LIMIT)).collect();
    // Two of the slowest proxy's reports before measuring.
    offer_keys(&load, 11.0).await;
    let secs = 10.0;
    let counts = offer_keys(&load, secs).await;
    let (ok, _) = sum(&counts);
    assert!(counts.iter().all(|c| c.2 == 0), "errors: {counts:?}");
    assert_within(ok, secs, 0.1, "mixed intervals");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_rule_with_a_cost_limits_units_not_requests() {
    let (_one, up, ctl) = fleet().await;
    // 50 units/s, each request costs 5: 10 requests/s fleet-wide, offered 30/s.
    let rules = per_key("50/s", "    cost: 5\n");
    let p = proxy_with("cost", up.addr, ctl.addr, "250ms", 10, &rules);
    let load = [(p.addr, "metered", 30)];
    offer_keys(&load, 3.0).await;
    let secs = 8.0;
    let (ok, _) = sum(&offer_keys(&load, secs).await);
    let rate = ok as f64 / secs;
    assert!(
        (rate - 10.0).abs() <= 0.2 * 10.0,
        "{rate:.1} requests/s of cost 5 admitted against 50 units/s"
    );
}

/// The previous release's binary (`scripts/test` builds it from the commit this wire version
/// follows and names it in `SPILLWAY_PREVIOUS`).
fn previous() -> Option<String> {
    let bin = std::env::var("SPILLWAY_PREVIOUS")
        .ok()
        .filter(|b| !b.is_empty());
    if bin.is_none() {
        eprintln!("SPILLWAY_PREVIOUS is not set (scripts/test sets it): mixed versions not tried");
    }
    bin
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_folded_behind_a_previous_releases_aggregator_is_still_held() {
    let Some(old) = previous() else { return };
    let (_one, up, ctl) = fleet().await;
    // One proxy straight to today's controller, two behind the previous release's aggregator
    // (which relays ratios but no name_above, so its proxies fold what is past top_k 1).
    // The key offers 40/s on each, 120/s against 100/s; on the two behind the aggregator a
    // heavier key of their own folds it, so only 40/s of it is ever seen by name unless the
    // controller has them name it.
    let control = format!("http://{}", ctl.addr);
    let agg = Proc::spawn_bin(&old, &aggregator_args(&control, "eu-1", "100ms"));
    let rules = per_key(&format!("{LIMIT}/s"), "");
    let p = [
        proxy_with("seen", up.addr, ctl.addr, "250ms", 10, &rules),
        proxy_with("folds1", up.addr, agg.addr, "250ms", 1, &rules),
        proxy_with("folds2", up.addr, agg.addr, "250ms", 1, &rules),
    ];
    let mut load: Vec<_> = p.iter().map(|p| (p.addr, "spread", 40)).collect();
    load.push((p[1].addr, "decoy-1", 60));
    load.push((p[2].addr, "decoy-2", 60));
    offer_keys(&load, 3.0).await;
    let secs = 8.0;
    let counts = offer_keys(&load, secs).await;
    assert!(counts.iter().all(|c| c.2 == 0), "errors: {counts:?}");
    let (spread, _) = sum(&counts[..3]);
    assert_within(
        spread,
        secs,
        0.1,
        "a key folded behind a previous aggregator",
    );
    let (decoys, all) = sum(&counts[3..]);
    assert!(
        decoys as f64 >= 0.99 * all as f64,
        "decoys under their limit: {decoys} of {all}"
    );
}

fn proxy_yaml(name: &str, upstream: SocketAddr, control: SocketAddr) -> std::path::PathBuf {
    proxy_yaml_with(name, upstream, control, "")
}

/// [`proxy_yaml`] with `extra` added to its rule.
fn proxy_yaml_with(
    name: &str,
    upstream: SocketAddr,
    control: SocketAddr,
    extra: &str,
) -> std::path::PathBuf {
    let yaml = format!(
        r#"service: shop
listen: 127.0.0.1:0
admin: 127.0.0.1:0
upstream: http://{upstream}
control_plane:
  url: http://{control}
  report_interval: 100ms
  stale_after: 5s
  top_k: 3
  host: {name}
rules:
{rules}"#,
        rules = per_key(&format!("{LIMIT}/s"), extra)
    );
    temp_file(&format!("{name}.yaml"), &yaml)
}

/// Holds [`LIMIT`] with `p`, offered 2:1 at three times the limit, no errors; and a key
/// under its limit beside many folded ones is not refused.
async fn mixed_fleet_holds_the_limit(p: &[Proc], what: &str) {
    let mut load = vec![(p[0].addr, "hot", 2 * LIMIT), (p[1].addr, "hot", LIMIT)];
    load.extend(p[2..].iter().map(|p| (p.addr, "hot", LIMIT / 2)));
    offer_keys(&load, 3.0).await;
    let secs = 5.0;
    let counts = offer_keys(&load, secs).await;
    assert!(counts.iter().all(|c| c.2 == 0), "{what}: errors {counts:?}");
    assert_within(sum(&counts).0, secs, 0.15, what);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxies_and_a_control_plane_one_version_apart_still_share_one_limit() {
    let Some(old) = previous() else { return };
    let (_one, up, ctl) = fleet().await;
    // The upgrade's first step: a controller of today's, of its own, with the previous
    // release's aggregator and proxies behind it.
    {
        let first = controller("127.0.0.1:0", &[]);
        let url = format!("http://{}", first.addr);
        let agg = Proc::spawn_bin(&old, &aggregator_args(&url, "eu-0", "100ms"));
        let paths = [
            proxy_yaml("old-1", up.addr, agg.addr),
            proxy_yaml("old-2", up.addr, agg.addr),
        ];
        let p =
            paths.map(|path| Proc::spawn_bin(&old, &["proxy", "--config", path.to_str().unwrap()]));
        mixed_fleet_holds_the_limit(&p, "the controller upgraded first").await;
        answered(&p[0], 3.0).await;
    }
    // Today's controller and aggregator with a proxy of each release behind the aggregator.
    let control = format!("http://{}", ctl.addr);
    let agg_args = aggregator_args(&control, "eu-1", "100ms");
    let agg = Proc::spawn(&agg_args);
    let path_old = proxy_yaml("old-proxy", up.addr, agg.addr);
    // A previous release reports a header's value in clear: the new proxies share its count
    // while they do too, the upgrade's first step (CHANGELOG).
    let path_new = proxy_yaml_with("new-proxy", up.addr, agg.addr, "    log_keys: clear\n");
    // And a previous-release proxy reporting straight to today's controller.
    let path_direct = proxy_yaml("old-direct", up.addr, ctl.addr);
    let p = [
        Proc::spawn_bin(&old, &["proxy", "--config", path_old.to_str().unwrap()]),
        Proc::spawn(&["proxy", "--config", path_new.to_str().unwrap()]),
        Proc::spawn_bin(&old, &["proxy", "--config", path_direct.to_str().unwrap()]),
    ];
    mixed_fleet_holds_the_limit(&p, "previous proxies, new control plane").await;
    // Each previous-release proxy's version-1 reports were answered, not merely survived.
    answered(&p[0], 3.0).await;
    answered(&p[2], 3.0).await;
    drop(p);
    drop(agg);
    drop(ctl);

    // The previous release's controller and aggregator with today's proxies, one of them
    // straight to the controller.
    let ctl = Proc::spawn_bin(
        &old,
        &[
            "controller",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ],
    );
    let control = format!("http://{}", ctl.addr);
    let agg_args = aggregator_args(&control, "eu-1", "100ms");
    let agg = Proc::spawn_bin(&old, &agg_args);
    // And today's aggregator in front of it (a control plane's upgrade rolling both at once).
    let agg_new = Proc::spawn(&aggregator_args(&control, "eu-2", "100ms"));
    let a = proxy_yaml("new-a", up.addr, agg.addr);
    let b = proxy_yaml("new-b", up.addr, ctl.addr);
    let c = proxy_yaml("new-c", up.addr, agg_new.addr);
    let p = [
        Proc::spawn(&["proxy", "--config", a.to_str().unwrap()]),
        Proc::spawn(&["proxy", "--config", b.to_str().unwrap()]),
        Proc::spawn(&["proxy", "--config", c.to_str().unwrap()]),
    ];
    mixed_fleet_holds_the_limit(&p, "new proxies, previous control plane").await;
    answered(&p[2], 3.0).await;
    // Nothing was refused as malformed: the new fields never reached the previous release.
    for (admin, role) in [(ctl.admin, "controller"), (agg.admin, "aggregator")] {
        let (_, _, metrics) = get(admin, "/metrics", &[]).await;
        let ok = format!("spillway_{role}_reports_total{{result=\"ok\"}}");
        let malformed = format!("spillway_{role}_reports_total{{result=\"malformed\"}}");
        assert!(
            metric(&metrics, &ok).unwrap_or(0.0) > 0.0,
            "{role}: {metrics}"
        );
        assert_eq!(metric(&metrics, &malformed), None, "{role}: {metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_whose_controller_is_rolled_back_under_it_goes_back_to_version_1() {
    let Some(old) = previous() else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let up = upstream().await;
    let listen = fixed_port();
    let mut ctl = controller(&listen, &[]);
    // top_k 1 and three keys: each report folds a tail, which goes with its sketch (a field
    // past version 1) once the controller has said it takes them.
    let rules = per_key(&format!("{LIMIT}/s"), "");
    let p = proxy_with("p", up.addr, ctl.addr, "250ms", 1, &rules);
    let load = [(p.addr, "a", 30), (p.addr, "b", 20), (p.addr, "c", 10)];
    offer_keys(&load, 1.5).await;
    answered(&p, 3.0).await;
    // Load all along, so that the first report the previous release sees has a tail.
    let all_along = tokio::spawn(async move { offer_keys(&load, 4.0).await });
    // Rolled back at the same address: the previous release refuses the sketch (400), the
    // proxy sends the same report again as version 1 and stays there.
    ctl.kill();
    let old_ctl = Proc::spawn_bin(
        &old,
        &["controller", "--listen", &listen, "--admin", "127.0.0.1:0"],
    );
    let (_, _, before) = get(p.admin, "/metrics", &[]).await;
    answered(&p, reports_ok(&before) + 4.0).await;
    all_along.await.unwrap();
    let (_, _, metrics) = get(old_ctl.admin, "/metrics", &[]).await;
    let count = |result: &str| {
        metric(
            &metrics,
            &format!("spillway_controller_reports_total{{result=\"{result}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert!(
        count("ok") >= 4.0,
        "the previous controller took version 1: {metrics}"
    );
    // Refused once (or twice, a report already on its way), then version 1 only.
    assert!(
        count("malformed") >= 1.0 && count("malformed") < count("ok") / 2.0,
        "the report with the sketch reached it and was refused, and the next ones were plain version 1: {metrics}"
    );
}

/// A proxy's reports answered, from its /metrics `text` (with or without its service label).
fn reports_ok(text: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with("spillway_reports_total{result=\"ok\""))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Waits until the proxy at `p` has had `n` reports answered.
async fn answered(p: &Proc, n: f64) {
    for _ in 0..600 {
        let (_, _, text) = get(p.admin, "/metrics", &[]).await;
        if reports_ok(&text) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{n} reports were not answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_is_held_to_its_provisional_limit_until_its_first_ratio() {
    let (_one, up, ctl) = fleet().await;
    // 10/s, one proxy reporting every second: its provisional limit is the whole 10/s (the
    // controller says one proxy reports the rule), one request every 100 ms.
    let p = proxy_with("p1", up.addr, ctl.addr, "1s", 10, &per_key("10/s", ""));
    // A first key, so that the controller has answered with the rule's hint.
    send(&client(), p.addr, "GET", "/", &[("x-api-key", "first")]).await;
    answered(&p, 2.0).await;
    // A key nobody has seen: 400 requests as fast as they go, 16 at a time.
    let c = client();
    let start = tokio::time::Instant::now();
    let mut ok = 0u64;
    for _ in 0..25 {
        let mut batch = tokio::task::JoinSet::new();
        for _ in 0..16 {
            let c = c.clone();
            batch.spawn(async move {
                send(&c, p.addr, "GET", "/", &[("x-api-key", "fresh")])
                    .await
                    .0
            });
        }
        while let Some(s) = batch.join_next().await {
            ok += u64::from(s.unwrap() == StatusCode::OK);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // 10/s until a ratio (at most as much again) takes over.
    let bound = 2.0 * (1.0 + 10.0 * secs) + 2.0;
    assert!(
        (ok as f64) <= bound,
        "{ok} of 400 admitted in {secs:.2} s for a new key against 10/s (at most {bound:.0})"
    );
    assert!(ok >= 1, "the provisional limit admits");
}

/// A free port on loopback, for a process that must come back at the same address: below the
/// kernel's ephemeral range, so that another test's bind to port 0 (or an outgoing
/// connection) cannot take it between this check and the process's own bind.
fn fixed_port() -> String {
    loop {
        let port = fastrand::u16(20_000..32_000);
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return l.local_addr().unwrap().to_string();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_controller_warms_up_and_its_first_sums_do_not_release_the_fallback() {
    let _one = ONE_AT_A_TIME.lock().await;
    let up = upstream().await;
    let listen = fixed_port();
    let mut ctl = controller(&listen, &[]);
    // Two aggregator replicas of one zone, forwarding every second; three proxies reporting
    // every second, two to one replica and one to the other.
    let url = format!("http://{}", ctl.addr);
    let aggs: Vec<Proc> = (0..2)
        .map(|_| Proc::spawn(&aggregator_args(&url, "z1", "1s")))
        .collect();
    // Reporting every second, stale after 2 s, with a fallback of a third of the limit.
    let fallback = "    fallback: { rate: 33/s, burst: 5 }\n";
    let p: Vec<Proc> = (1..=3)
        .map(|i| {
            let name = format!("p{i}");
            proxy_every(&name, up.addr, aggs[i % 2].addr, ("1s", "2s"), fallback)
        })
        .collect();
    let refs: Vec<&Proc> = p.iter().collect();
    let load = [100, 100, 100];
    offer_all(&refs, "k", &load, 4.0).await;
    ctl.kill();
    // Stale after 2 s: the fallbacks hold the fleet at about the limit.
    offer_all(&refs, "k", &load, 3.5).await;
    let _ctl = controller(&listen, &[]);
    // The 2 s after the restart: the controller's first sums are partial (its state is soft:
    // one replica's forward before the other's), and a proxy that took them as fresh would
    // leave its fallback for a ratio computed on part of the fleet.
    let (ok, limited, other) = offer_all(&refs, "k", &load, 2.0).await;
    assert_eq!(other, 0);
    let allowance = 3.0 * (33.0 * 2.0 + 5.0);
    eprintln!("the 2 s after the restart: {ok} admitted, {limited} refused");
    assert!(
        ok as f64 <= 1.1 * allowance,
        "{ok} admitted ({limited} refused) in the 2 s after the restart; the fallbacks allow {allowance}"
    );
    // Warmed up, the controller's ratios hold the limit.
    offer_all(&refs, "k", &load, 3.0).await;
    holds_fleet(&refs, &load, 3.0, "after the warm-up").await;
}

/// Offers `load` to `proxies` for `secs`: the fleet admits the limit within 15 %, with no
/// errors.
async fn holds_fleet(proxies: &[&Proc], load: &[u64], secs: f64, what: &str) {
    let (ok, limited, other) = offer_all(proxies, "k", load, secs).await;
    assert_eq!(other, 0, "{what}: errors");
    assert!(limited > 0, "{what}: nothing dropped");
    assert_within(ok, secs, 0.15, what);
}

/// Two controllers serve at once (active-active): every aggregator forwards to both, and
/// hosts get the first authoritative one's ratios. Restarted one at a time (killed), then the
/// aggregators (stopped as Kubernetes does), under 2.4x overload: no 1-second window of the
/// fleet admits more than the limit and 10 %, or less than 80 % of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_two_controllers_then_the_aggregators_never_admits_past_the_limit() {
    let _one = ONE_AT_A_TIME.lock().await;
    let up = upstream().await;
    let ctl_ports = [fixed_port(), fixed_port()];
    let agg_ports = [fixed_port(), fixed_port()];
    let urls = format!("http://{},http://{}", ctl_ports[0], ctl_ports[1]);
    let spawn_agg = {
        let urls = urls.clone();
        move |port: String| {
            let mut args = aggregator_args(&urls, "z1", "1s");
            args[2] = &port;
            Proc::spawn(&args)
        }
    };
    let mut ctls: Vec<Proc> = ctl_ports.iter().map(|l| controller(l, &[])).collect();
    let mut aggs: Vec<Proc> = agg_ports.iter().cloned().map(&spawn_agg).collect();
    // Reporting every second, two to one replica and one to the other.
    let p: Vec<Proc> = (1..=3)
        .map(|i| {
            proxy_every(
                &format!("p{i}"),
                up.addr,
                aggs[i % 2].addr,
                ("1s", "3s"),
                "",
            )
        })
        .collect();
    // 2.4x the limit, evenly over the proxies, for the whole run; counted every second.
    let counts = Arc::new(Counts::default());
    let secs = 27.0;
    let load: Vec<_> = p
        .iter()
        .map(|p| tokio::spawn(offer(p.addr, "k", LIMIT * 4 / 5, secs, counts.clone())))
        .collect();
    const PHASES: [&str; 5] = [
        "warm-up",
        "controller 1 restarted",
        "controller 2 restarted",
        "aggregator 1 restarted",
        "aggregator 2 restarted",
    ];
    let phase = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let sampler = {
        let (counts, phase) = (counts.clone(), phase.clone());
        tokio::spawn(async move {
            let mut windows = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            for _ in 0..secs as usize {
                tick.tick().await;
                windows.push((PHASES[phase.load(Ordering::Relaxed)], counts.take()));
            }
            windows
        })
    };
    let next = |i: usize| {
        phase.store(i, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(4))
    };
    // The warm-up: both controllers past theirs, the ratios settled.
    tokio::time::sleep(Duration::from_secs(7)).await;
    for i in 0..2 {
        ctls[i].kill();
        let listen = ctl_ports[i].clone();
        ctls[i] = tokio::task::spawn_blocking(move || controller(&listen, &[]))
            .await
            .unwrap();
        next(1 + i).await;
    }
    for i in 0..2 {
        // Gracefully, as a rolling update does: its last forward hands over what it holds.
        aggs[i].terminate();
        let (port, spawn) = (agg_ports[i].clone(), spawn_agg.clone());
        aggs[i] = tokio::task::spawn_blocking(move || spawn(port))
            .await
            .unwrap();
        next(3 + i).await;
    }
    for l in load {
        l.await.unwrap();
    }
    let windows = sampler.await.unwrap();
    eprintln!("admitted per second: {windows:?}");
    let measured: Vec<_> = windows.iter().filter(|(w, _)| *w != "warm-up").collect();
    assert!(measured.len() >= 14, "{windows:?}");
    for (what, (ok, limited, other)) in &measured {
        assert_eq!(*other, 0, "{what}: errors");
        assert!(*limited > 0, "{what}: nothing refused at 2.4x the limit");
        assert!(
            *ok as f64 <= 1.1 * LIMIT as f64,
            "{what}: {ok} admitted in one second against a limit of {LIMIT}/s"
        );
        assert!(
            *ok as f64 >= 0.8 * LIMIT as f64,
            "{what}: only {ok} admitted in one second against a limit of {LIMIT}/s"
        );
    }
    let mean = measured.iter().map(|(_, c)| c.0).sum::<u64>() as f64 / measured.len() as f64;
    assert!(
        mean >= 0.85 * LIMIT as f64,
        "{mean}/s admitted on average: {windows:?}"
    );
}

/// A proxy reporting straight to two controllers sends each report to both (each computes
/// ratios on the whole fleet), and one of them dying leaves the fleet limited by the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_reports_to_every_controller_of_its_list_and_one_dying_changes_nothing() {
    let (_one, up, c1) = fleet().await;
    let c2 = controller("127.0.0.1:0", &[]);
    let p: Vec<Proc> = (1..=2)
        .map(|i| {
            let name = format!("p{i}");
            let yaml = format!(
                "service: shop\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{}\n\
                 control_plane:\n  url: [http://{}, http://{}]\n  report_interval: 100ms\n  host: {name}\n\
                 rules:\n  - name: per-key\n    key: [header:x-api-key]\n    limit: {{ rate: {LIMIT}/s }}\n    scope: global\n",
                up.addr, c1.addr, c2.addr
            );
            let path = temp_file(&format!("{name}-two.yaml"), &yaml);
            Proc::spawn(&["proxy", "--config", path.to_str().unwrap()])
        })
        .collect();
    let refs: Vec<&Proc> = p.iter().collect();
    let load = [120, 120];
    offer_all(&refs, "k", &load, 3.0).await;
    for c in [&c1, &c2] {
        let (status, keys) = state_keys(c.addr, "any").await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            keys.contains(&format!("shop/{}", shown("k"))),
            "every controller sees the key: {keys:?}"
        );
    }
    holds_fleet(&refs, &load, 3.0, "two controllers").await;
    let mut c1 = c1;
    c1.kill();
    holds_fleet(&refs, &load, 3.0, "the first controller dead").await;
}

/// A stopped control-plane server closes its kept-alive connections once their requests are
/// answered: a proxy pooling one to an aggregator being replaced would otherwise keep being
/// answered by the old one, whose relayed ratios only age (in-process, until it exits).
#[tokio::test]
async fn a_stopped_control_server_closes_kept_alive_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ctl = controller_in_process().await;
    let mut conn = tokio::net::TcpStream::connect(ctl.addr).await.unwrap();
    let req = b"GET /v1/nothing HTTP/1.1\r\nhost: c\r\n\r\n";
    conn.write_all(req).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = conn.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 "), "answered");
    ctl.shutdown();
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection outlived its server");
    ctl.wait().await;
}

/// A previous release cannot read the warming header: while warming, a controller (and an
/// aggregator relaying a warming one) answers it 503, so that it keeps the ratios it holds
/// instead of taking ones computed on part of the fleet; this release's reporters get the
/// ratios with the header. The report counts either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warming_control_plane_gives_a_previous_release_no_ratios() {
    let _one = ONE_AT_A_TIME.lock().await;
    // A warm-up longer than the test.
    let ctl = controller("127.0.0.1:0", &["--warm-up", "10m"]);
    let agg = aggregator(ctl.addr, "z");
    let report = |source: &str| one_key(source, "svc", "k", 10);
    let (status, body) = post_wire(ctl.addr, None, report("old-host"), None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("warming up"), "{body}");
    let (status, body) = post_as(ctl.addr, None, report("new-host")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("\"ratios\""), "{body}");
    let (status, keys) = state_keys(ctl.addr, "any").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(keys, ["svc/k"], "both reports counted");
    // The aggregator relays the warming controller's ratios once it has forwarded.
    let relayed = loop {
        let (status, body) = post_as(agg.addr, None, report("new-host-2")).await;
        if status == StatusCode::OK {
            break body;
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(relayed.contains("\"ratios\""), "{relayed}");
    let (status, body) = post_wire(agg.addr, None, report("old-host-2"), None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("warming up"), "{body}");
}

/// A proxy of `service` in front of `up`, reporting to `agg` with `token` every second, one
/// global rule per API key of [`LIMIT`].
fn service_proxy(service: &str, up: SocketAddr, agg: SocketAddr, token: &str) -> Proc {
    let token_file = temp_file(&format!("{service}-token"), &format!("{token}\n"));
    let yaml = format!(
        r#"service: {service}
listen: 127.0.0.1:0
admin: 127.0.0.1:0
upstream: http://{up}
control_plane:
  url: http://{agg}
  token_file: {}
  report_interval: 1s
  stale_after: 3s
  host: {service}-1
rules:
  - name: per-key
    key: [header:x-api-key]
    limit: {{ rate: {LIMIT}/s }}
    scope: global
"#,
        token_file.display()
    );
    let path = temp_file(&format!("{service}-proxy.yaml"), &yaml);
    Proc::spawn(&["proxy", "--config", path.to_str().unwrap()])
}

/// What each of `proxies` admitted of 3x [`LIMIT`] over `secs`, and the reports it failed to
/// get answered meanwhile (a reply past its timeout, or an error).
async fn offered_apart(proxies: &[&Proc], secs: f64) -> Vec<(u64, f64)> {
    let failed = |p: &Proc| {
        let admin = p.admin;
        async move {
            let (_, _, text) = get(admin, "/metrics", &[]).await;
            metric(&text, "spillway_reports_total{result=\"error\"}").unwrap_or(0.0)
        }
    };
    let mut before = Vec::new();
    for p in proxies {
        before.push(failed(p).await);
    }
    let counts: Vec<Arc<Counts>> = proxies.iter().map(|_| Arc::default()).collect();
    let tasks: Vec<_> = proxies
        .iter()
        .zip(&counts)
        .map(|(p, c)| tokio::spawn(offer(p.addr, "hot", 3 * LIMIT, secs, c.clone())))
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let mut out = Vec::new();
    for ((p, c), b) in proxies.iter().zip(&counts).zip(before) {
        let (ok, _, other) = c.take();
        assert_eq!(other, 0, "errors from a proxy");
        out.push((ok, failed(p).await - b));
    }
    out
}

/// One service's token at its worst until `stop`: slow bodies, maximal reports, state reads in
/// a loop, a flood of new sources; `sent` counts what got through of the last three.
async fn tenant_at_its_worst(
    agg_addr: SocketAddr,
    ctl_addr: SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
    sent: Arc<[AtomicU64; 3]>,
) {
    use tokio::io::AsyncWriteExt;
    let mut attack = tokio::task::JoinSet::new();
    // Slow bodies: forty reports announcing 1 MB and sending one byte, renewed every second.
    let s = stop.clone();
    attack.spawn(async move {
        while !s.load(Ordering::Relaxed) {
            let mut held = Vec::new();
            for _ in 0..40 {
                if let Ok(mut c) = tokio::net::TcpStream::connect(agg_addr).await {
                    let _ = c
                        .write_all(b"POST /v1/report HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer shop-t\r\nspillway-wire: 2\r\nContent-Length: 1000000\r\n\r\n{")
                        .await;
                    held.push(c);
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    // Maximal reports, two at a time, each from a host of its own.
    for lane in 0..2 {
        let (s, sent) = (stop.clone(), sent.clone());
        attack.spawn(async move {
            let mut i = 0;
            while !s.load(Ordering::Relaxed) {
                let body = maximal_report(&format!("big-{lane}-{i}"), "shop");
                let status = report(agg_addr, "shop-t", body).await;
                sent[0].fetch_add(
                    u64::from(status != StatusCode::SERVICE_UNAVAILABLE),
                    Ordering::Relaxed,
                );
                i += 1;
            }
        });
    }
    // State reads in a loop, and a flood of new sources.
    let (s, read) = (stop.clone(), sent.clone());
    attack.spawn(async move {
        while !s.load(Ordering::Relaxed) {
            let auth = [("authorization", "Bearer shop-t")];
            let (status, _, _) = get(ctl_addr, "/v1/state", &auth).await;
            read[1].fetch_add(u64::from(status == StatusCode::OK), Ordering::Relaxed);
        }
    });
    let (s, flood) = (stop.clone(), sent.clone());
    attack.spawn(async move {
        let mut i = 0;
        while !s.load(Ordering::Relaxed) {
            let body = many_keys(&format!("flood-{i}"), "shop", 1);
            let status = report(agg_addr, "shop-t", body).await;
            let taken = status != StatusCode::TOO_MANY_REQUESTS;
            flood[2].fetch_add(u64::from(taken), Ordering::Relaxed);
            i += 1;
        }
    });
    while attack.join_next().await.is_some() {}
}

// Issue 42, item 1: one service's token at its worst (slow bodies, maximal reports, state reads
// in a loop, a flood of new sources) while two other services' proxies report through the same
// aggregator and controller: their limits are as they were, and their reports are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_at_its_worst_leaves_other_services_limits_and_reports_as_they_were() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = tokens_dir();
    let dir = dir.to_str().unwrap();
    let ctl = controller("127.0.0.1:0", &["--tokens", dir]);
    // The chart's cadence: forwards every second, as the proxies report.
    let url = format!("http://{}", ctl.addr);
    let mut args = aggregator_args(&url, "z1", "1s");
    args.extend_from_slice(&["--tokens", dir]);
    let agg = Proc::spawn(&args);
    let up = upstream().await;
    let books = service_proxy("books", up.addr, agg.addr, "books-t");
    let maps = service_proxy("maps", up.addr, agg.addr, "maps-t");
    let fleets = [&books, &maps];
    // The chart's 1 s reports (a reply is waited for that long): settled, then as it is calm.
    offered_apart(&fleets, 4.0).await;
    let calm = offered_apart(&fleets, 4.0).await;
    for ((ok, failed), service) in calm.iter().zip(["books", "maps"]) {
        eprintln!("{service} calm: {ok} admitted, {failed} reports failed");
    }

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // What the tenant got through: maximal reports, state reads, new sources.
    let sent = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let (agg_addr, ctl_addr) = (agg.addr, ctl.addr);
    let (stop2, sent2) = (stop.clone(), sent.clone());
    // The tenant runs on a thread and runtime of its own: building maximal reports must not
    // hold up the workers that pace the other services' offered load.
    let attacker = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(tenant_at_its_worst(agg_addr, ctl_addr, stop2, sent2))
    });
    // The attack's first maximal reports take a second or so to build and send: measured
    // once it runs in full.
    offered_apart(&fleets, 2.0).await;
    // Meanwhile a host of books reports each second as a proxy does (a rule of its own, so
    // the limit measured is the proxies'), and keeps every answer.
    let observing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watch = observing.clone();
    let observer = tokio::spawn(async move {
        let mut answers = Vec::new();
        while watch.load(Ordering::Relaxed) {
            let body = r#"{"version":1,"source":"books-observer","zone":"z1","interval_ms":1000,"entries":[{"service":"books","rule":"observer","limit":{"count":10,"period_ms":1000},"key":"k","offered":1,"admitted":1}]}"#;
            let answer = tokio::time::timeout(
                Duration::from_secs(10),
                report(agg_addr, "books-t", body.to_string()),
            )
            .await;
            answers.push(answer.ok());
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        answers
    });
    let under_attack = offered_apart(&fleets, 4.0).await;
    observing.store(false, Ordering::Relaxed);
    let answers = observer.await.unwrap();
    stop.store(true, Ordering::Relaxed);
    tokio::task::spawn_blocking(move || attacker.join().unwrap())
        .await
        .unwrap();
    let sent: Vec<u64> = sent.iter().map(|n| n.load(Ordering::Relaxed)).collect();
    eprintln!("the tenant got through: {sent:?} (maximal reports, state reads, new sources)");
    assert!(
        sent.iter().all(|n| *n > 0),
        "the attack did not run: {sent:?}"
    );
    // Every report of another service's host was taken and answered: no turn, quota or
    // room of the tenant's was charged to it.
    assert!(
        answers.len() >= 3,
        "the observer reported {} times",
        answers.len()
    );
    assert!(
        answers.iter().all(|a| *a == Some(StatusCode::OK)),
        "books's host got {answers:?} under attack"
    );
    for (((ok, failed), (was, _)), service) in
        under_attack.into_iter().zip(calm).zip(["books", "maps"])
    {
        // A reply later than the proxy's 1 s timeout is the machine's speed (this suite runs
        // a debug build beside the attack): printed, not asserted. A refusal is asserted
        // below, and a proxy failing open would show in its count.
        eprintln!("{service}: {ok} admitted, {failed} reports failed");
        // As it was calm, and within the limit, by the steady fleet's bound of any second
        // (issue 39: 5 % and one request a second for each proxy; a service has one).
        let moved = (ok as f64 - was as f64).abs() / 4.0;
        assert!(
            moved <= 0.05 * LIMIT as f64 + 1.0,
            "{service} under attack: {ok} admitted in 4 s against {was} calm"
        );
        assert_within(ok, 4.0, 0.06, &format!("{service} under attack"));
    }
}

/// A surge: the fleet's offered load steps from its limit to three times it, 6:2:1 over
/// three proxies reporting every second behind an aggregator forwarding every second. Each
/// proxy's report says its rate jumped, the sums jump with it, and until they hold the jump a
/// proxy is held to what it was allowed before: from 2 s after the step, the fleet admits
/// its limit (what smoothing alone let through there was up to three times it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_surge_to_three_times_the_limit_is_held_from_two_seconds_after_it() {
    let (_one, up, ctl) = fleet().await;
    let url = format!("http://{}", ctl.addr);
    let agg = Proc::spawn(&aggregator_args(&url, "z1", "1s"));
    let p: Vec<Proc> = (1..=3)
        .map(|i| proxy_every(&format!("p{i}"), up.addr, agg.addr, ("1s", "5s"), ""))
        .collect();
    let refs: Vec<&Proc> = p.iter().collect();
    let at_limit: Vec<u64> = UNEVEN.iter().map(|r| r / 3).collect();
    // At the limit long enough for every proxy to be answered with the key's share.
    let (ok, _, other) = offer_all(&refs, "k", &at_limit, 6.0).await;
    assert_eq!(other, 0, "errors before the step");
    assert!(ok > 0);
    // The step; its first two seconds are the loop's (a report interval's worth may pass).
    offer_all(&refs, "k", &UNEVEN, 2.0).await;
    let (ok, limited, other) = offer_all(&refs, "k", &UNEVEN, 4.0).await;
    assert_eq!(other, 0, "errors after the step");
    assert!(limited > 0, "nothing dropped after the step");
    assert_within(ok, 4.0, 0.15, "from 2 s after a step to 3x");
}
