//! Adaptive concurrency against an upstream whose latency grows with its concurrency past a
//! knee: the limit settles near the knee, the upstream's concurrency (so its latency) stays
//! bounded, and a steady load below the knee sees no 503.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use spillway::Sidecar;

/// Latency at or below the knee.
const BASE: Duration = Duration::from_millis(20);
/// Past this many requests at once the app slows down in proportion (a saturated service).
const KNEE: u32 = 16;

#[derive(Default)]
struct App {
    in_flight: AtomicU32,
    peak: AtomicU32,
}

/// The app: `BASE` up to `KNEE` concurrent requests, `BASE x n / KNEE` past it.
async fn app() -> (SocketAddr, Arc<App>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let state = Arc::new(App::default());
    let s = state.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let s = s.clone();
            tokio::spawn(async move {
                let service = service_fn(move |_req| {
                    let s = s.clone();
                    async move {
                        let n = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        s.peak.fetch_max(n, Ordering::SeqCst);
                        let latency = BASE.mul_f64(f64::from(n.max(KNEE)) / f64::from(KNEE));
                        tokio::time::sleep(latency).await;
                        s.in_flight.fetch_sub(1, Ordering::SeqCst);
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, state)
}

/// `clients` closed-loop clients for `for_`; returns (answered 200, answered 503) counted
/// only after `settle` has passed.
async fn load(
    addr: SocketAddr,
    clients: usize,
    for_: Duration,
    settle: Duration,
) -> (usize, usize) {
    let ok = Arc::new(AtomicUsize::new(0));
    let shed = Arc::new(AtomicUsize::new(0));
    let counting = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (ok, shed, counting, stop) = (ok.clone(), shed.clone(), counting.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let client = client();
            while !stop.load(Ordering::Relaxed) {
                let status = send(&client, addr, "GET", "/", &[]).await.0.as_u16();
                if counting.load(Ordering::Relaxed) {
                    match status {
                        200 => ok.fetch_add(1, Ordering::Relaxed),
                        503 => shed.fetch_add(1, Ordering::Relaxed),
                        other => panic!("unexpected {other}"),
                    };
                }
                if status == 503 {
                    // A shed client backs off a little, as a real one would on Retry-After.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }));
    }
    tokio::time::sleep(settle).await;
    counting.store(true, Ordering::Relaxed);
    tokio::time::sleep(for_.saturating_sub(settle)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    (ok.load(Ordering::Relaxed), shed.load(Ordering::Relaxed))
}

async fn gauge(sc: &Sidecar, name: &str) -> f64 {
    let text = admin(sc, "/metrics").await.1;
    metric(&text, &format!("{name}{{rule=\"app\"}}")).unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_settles_near_the_knee_and_a_steady_load_below_it_sees_no_503() {
    let (up, state) = app().await;
    let yaml = "rules:\n  - name: app\n    key: []\n    limit: { adaptive: { min: 2, max: 256, initial: 8, tolerance: 1.5 } }\n";
    let sc = Sidecar::start(config(up, yaml)).await.unwrap();

    // Below the knee from the start: nothing is shed.
    let (ok, shed) = load(sc.addr(), 6, Duration::from_millis(1500), Duration::ZERO).await;
    assert!(ok > 100, "{ok}");
    assert_eq!(shed, 0, "a steady load below the knee was shed");

    // Four times the knee: the limit finds the knee, and the app is kept near it.
    let (ok, shed) = load(
        sc.addr(),
        64,
        Duration::from_secs(5),
        Duration::from_secs(3),
    )
    .await;
    state
        .peak
        .store(state.in_flight.load(Ordering::SeqCst), Ordering::SeqCst);
    let limit = gauge(&sc, "spillway_adaptive_limit").await;
    assert!(ok > 100 && shed > 0, "ok {ok}, shed {shed}");
    assert!(
        (f64::from(KNEE) / 2.0..=f64::from(KNEE) * 2.5).contains(&limit),
        "limit {limit} is not near the knee ({KNEE})"
    );
    eprintln!("overload: ok {ok}, shed {shed}, limit {limit}");
    let baseline = gauge(&sc, "spillway_adaptive_baseline_seconds").await;
    assert!(baseline > 0.0, "a baseline was learned");

    // Measure the app's own concurrency (its latency follows it) once the limit has settled.
    let (_, _) = {
        state.peak.store(0, Ordering::SeqCst);
        load(sc.addr(), 64, Duration::from_secs(2), Duration::ZERO).await
    };
    let peak = state.peak.load(Ordering::SeqCst);
    eprintln!("app peak in flight after settling: {peak}");
    assert!(
        peak <= KNEE * 5 / 2,
        "the app saw {peak} at once (knee {KNEE}): its latency was not bounded"
    );

    // Back below the knee: after a short settle, nothing is shed.
    let (ok, shed) = load(
        sc.addr(),
        6,
        Duration::from_millis(2000),
        Duration::from_millis(500),
    )
    .await;
    assert!(ok > 100, "{ok}");
    assert_eq!(
        shed, 0,
        "steady load below the knee was shed after an overload"
    );
}

#[tokio::test]
async fn a_refusal_is_503_with_retry_after_and_the_capacity_problem_type() {
    let (sc, up) = sidecar(
        "rules:\n  - name: app\n    key: []\n    limit: { adaptive: { min: 1, max: 1 } }\n",
    )
    .await;
    let addr = sc.addr();
    let held = up.signals.held.notified();
    let first = tokio::spawn(async move { get(addr, "/hold", &[]).await.0 });
    held.await; // the first request is at the app, holding the only slot
    let (status, headers, body) = get(addr, "/", &[]).await;
    assert_eq!(status, http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "1");
    assert!(
        headers.get("ratelimit").is_none(),
        "capacity is not the client's quota"
    );
    assert!(body.contains("temporary-reduced-capacity"), "{body}");
    up.signals.release.notify_one();
    assert_eq!(first.await.unwrap(), http::StatusCode::OK);
}
