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

fn controller(listen: &str, extra: &[&str]) -> Proc {
    let mut args = vec!["controller", "--listen", listen, "--admin", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    Proc::spawn(&args)
}

fn aggregator(controller: SocketAddr, zone: &str) -> Proc {
    Proc::spawn(&[
        "aggregator",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--controller",
        &format!("http://{controller}"),
        "--zone",
        zone,
        "--interval",
        "100ms",
    ])
}

const LIMIT: u64 = 100;

fn proxy(name: &str, upstream: SocketAddr, control: SocketAddr, extra: &str) -> Proc {
    let yaml = format!(
        r#"service: shop
listen: 127.0.0.1:0
admin: 127.0.0.1:0
upstream: http://{upstream}
control_plane:
  url: http://{control}
  report_interval: 100ms
  stale_after: 1s
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
    let c = client();
    let mut tick = tokio::time::interval(Duration::from_nanos(1_000_000_000 / rps));
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
    let rate = admitted as f64 / secs;
    assert!(
        (0.7 * LIMIT as f64..=1.3 * LIMIT as f64).contains(&rate),
        "{what}: the fleet admitted {rate:.0}/s against a limit of {LIMIT}/s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uneven_fleet_converges_to_the_limit_and_keys_stay_independent() {
    let _one = ONE_AT_A_TIME.lock().await;
    let up = upstream().await;
    let ctl = controller("127.0.0.1:0", &[]);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_zones_and_a_proxy_reporting_straight_to_the_controller_share_one_limit() {
    let _one = ONE_AT_A_TIME.lock().await;
    let up = upstream().await;
    let ctl = controller("127.0.0.1:0", &[]);
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
        .find(|k| k["key"] == "k")
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
            let mut req = http::Request::post(format!("http://{}/v1/report", ctl.addr));
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
        report.replace("\"admitted\":30", "\"admitted\":31"),
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
    let (_, _, body) = get(ctl.addr, "/v1/state", &[]).await;
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["keys"].as_array().unwrap().len(), 1);
    assert_eq!(doc["keys"][0]["offered_rps"], 30.0);

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

#[tokio::test]
async fn while_the_control_plane_is_stale_the_fallback_limit_applies() {
    // A control plane that is not there: the proxy goes stale after stale_after.
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (sc, _up, clock) = sidecar_with_clock(&format!(
        r#"control_plane: {{ url: "http://{nowhere}", report_interval: 100ms, stale_after: 1s, decay: 1s }}
rules:
  - name: per-key
    key: [header:x-api-key]
    limit: {{ rate: 100/s }}
    scope: global
    fallback: {{ rate: 1/h, burst: 2 }}
"#
    ))
    .await;
    let k = [("x-api-key", "k")];
    // Fresh (no ratios yet): everything passes, the fallback is not used.
    for _ in 0..5 {
        assert_eq!(get(sc.addr(), "/", &k).await.0, StatusCode::OK);
    }
    clock.advance(Duration::from_secs(2));
    let statuses: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(get(sc.addr(), "/", &k).await.0.as_u16());
        }
        v
    };
    assert_eq!(statuses, [200, 200, 429], "the fallback's burst of 2");
}

#[tokio::test]
async fn a_request_dropped_by_a_global_rule_gets_429_with_retry_after_and_ratelimit_headers() {
    let any = "127.0.0.1:0".parse().unwrap();
    let ctl =
        spillway::control::controller::start(spillway::control::controller::ControllerOptions {
            listen: any,
            admin: any,
            token: Default::default(),
        })
        .await
        .unwrap();
    let (sc, _up) = sidecar(&format!(
        r#"control_plane: {{ url: "http://{}", report_interval: 100ms, stale_after: 5s }}
rules:
  - name: fleet-wide
    key: [header:x-api-key]
    limit: {{ rate: 5/s }}
    scope: global
"#,
        ctl.addr
    ))
    .await;
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
