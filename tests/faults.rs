//! Faults under load: the controller, an aggregator, Redis and the upstream each killed and
//! restarted while clients send traffic through the proxy. Real processes on loopback (the
//! spillway binary, redis-server), bounded loops that stop by themselves.
//!
//! What must hold: for control-plane and Redis faults no request is lost (no connection error
//! at the client) and none gets a 5xx (fail open / on_error); for an upstream outage the proxy
//! answers 502 at once while it is down and serves again once it is back, without a restart
//! (no poisoned pool). The figures printed (run with --nocapture) are in RELIABILITY.md.

// The harness shares its tallies between client tasks with a std Mutex held for a few
// instructions, never across an await: this is the test's bookkeeping, not a request path.
#![allow(clippy::disallowed_types)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use spillway::Sidecar;
use tokio::task::JoinSet;

/// What the clients saw, by phase: status code (0 = connection error) -> count.
#[derive(Default, Debug)]
struct Seen {
    by_phase: [BTreeMap<u16, u64>; 3],
    /// After the restore: when each status was first seen, since the restore.
    first_after: BTreeMap<u16, Duration>,
}

/// `clients` loops of GETs with rotating keys until `stop`; `phase` says where we are
/// (0 before the fault, 1 during, 2 after the restart).
async fn traffic(
    addr: SocketAddr,
    clients: usize,
    phase: Arc<Mutex<(usize, tokio::time::Instant)>>,
    stop: Arc<AtomicBool>,
    limited: Arc<tokio::sync::Notify>,
) -> Seen {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut tasks = JoinSet::new();
    for c in 0..clients {
        let (seen, phase, stop) = (seen.clone(), phase.clone(), stop.clone());
        let limited = limited.clone();
        tasks.spawn(async move {
            let client = client();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) && n < 100_000 {
                let key = format!("k{}", (c as u64 + n) % 8);
                let req = http::Request::get(format!("http://{addr}/"))
                    .header("x-api-key", key)
                    .body(empty())
                    .unwrap();
                let status = match tokio::time::timeout(
                    Duration::from_secs(10),
                    client.request(req),
                )
                .await
                {
                    Ok(Ok(resp)) => {
                        let s = resp.status().as_u16();
                        let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
                        s
                    }
                    _ => 0,
                };
                if status == 429 {
                    limited.notify_one();
                }
                let (p, since) = *phase.lock().unwrap();
                let mut seen = seen.lock().unwrap();
                *seen.by_phase[p].entry(status).or_default() += 1;
                if p == 2 {
                    seen.first_after
                        .entry(status)
                        .or_insert_with(|| since.elapsed());
                }
                n += 1;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    Arc::try_unwrap(seen).unwrap().into_inner().unwrap()
}

/// Runs traffic; after `before` calls `fault`, after `during` calls `restore` (which returns
/// when the part is back), then keeps going for `after`. With `limiting`, `before` starts once
/// the clients saw the limit enforced (a 429), which a control loop takes a few report rounds
/// to reach. Returns what the clients saw.
async fn scenario<F, R>(addr: SocketAddr, limiting: bool, fault: F, restore: R, name: &str) -> Seen
where
    F: std::future::Future<Output = ()>,
    R: std::future::Future<Output = ()>,
{
    let phase = Arc::new(Mutex::new((0usize, tokio::time::Instant::now())));
    let stop = Arc::new(AtomicBool::new(false));
    let limited = Arc::new(tokio::sync::Notify::new());
    let load = tokio::spawn(traffic(
        addr,
        8,
        phase.clone(),
        stop.clone(),
        limited.clone(),
    ));
    if limiting {
        tokio::time::timeout(Duration::from_secs(20), limited.notified())
            .await
            .unwrap_or_else(|_| panic!("{name}: the limit was never enforced before the fault"));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    phase.lock().unwrap().0 = 1;
    fault.await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    restore.await;
    *phase.lock().unwrap() = (2, tokio::time::Instant::now());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = load.await.unwrap();
    eprintln!(
        "{name}: before {:?} | during {:?} | after {:?} | first after the restore: {:?}",
        seen.by_phase[0], seen.by_phase[1], seen.by_phase[2], seen.first_after
    );
    seen
}

fn count(seen: &BTreeMap<u16, u64>, f: impl Fn(u16) -> bool) -> u64 {
    seen.iter().filter(|(s, _)| f(**s)).map(|(_, n)| n).sum()
}

/// No connection errors and no 5xx in any phase; some traffic in each.
fn nothing_lost(seen: &Seen, name: &str) {
    for (p, phase) in seen.by_phase.iter().enumerate() {
        assert!(
            count(phase, |_| true) > 0,
            "{name}: no traffic in phase {p}"
        );
        assert_eq!(
            count(phase, |s| s == 0),
            0,
            "{name}: requests lost in phase {p}: {phase:?}"
        );
        assert_eq!(
            count(phase, |s| s >= 500),
            0,
            "{name}: 5xx in phase {p}: {phase:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_faults_lose_nothing_and_cause_no_5xx() {
    let up = upstream().await;
    let ctl = controller();
    let ctl_addr = ctl.addr;
    let agg_args = |ctl: SocketAddr| {
        vec![
            "aggregator".to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--admin".into(),
            "127.0.0.1:0".into(),
            "--controller".into(),
            format!("http://{ctl}"),
            "--zone".into(),
            "z".into(),
            "--interval".into(),
            "200ms".into(),
        ]
    };
    let args = agg_args(ctl_addr);
    let agg = Proc::spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let sc = Sidecar::start(config(
        up.addr,
        &format!(
            "control_plane: {{ url: 'http://{}', report_interval: 200ms, stale_after: 1s, decay: 1s }}\n\
             rules:\n  - name: per-key\n    key: [header:x-api-key]\n    limit: {{ rate: 50/s }}\n    scope: global\n",
            agg.addr
        ),
    ))
    .await
    .unwrap();

    // The controller dies and comes back on the same port.
    let ctl = Arc::new(Mutex::new(ctl));
    let (c1, c2) = (ctl.clone(), ctl.clone());
    let seen = scenario(
        sc.addr(),
        true,
        async move { c1.lock().unwrap().kill() },
        async move {
            *c2.lock().unwrap() = Proc::spawn(&[
                "controller",
                "--listen",
                &ctl_addr.to_string(),
                "--admin",
                "127.0.0.1:0",
            ]);
        },
        "controller killed",
    )
    .await;
    nothing_lost(&seen, "controller killed");
    assert!(
        count(&seen.by_phase[0], |s| s == 429) > 0,
        "the limit was enforced before the fault"
    );

    // The zone's aggregator dies and comes back on the same port.
    let agg_addr = agg.addr;
    let agg = Arc::new(Mutex::new(agg));
    let (a1, a2) = (agg.clone(), agg.clone());
    let seen = scenario(
        sc.addr(),
        true,
        async move { a1.lock().unwrap().kill() },
        async move {
            let mut a = agg_args(ctl_addr);
            a[2] = agg_addr.to_string();
            *a2.lock().unwrap() = Proc::spawn(&a.iter().map(String::as_str).collect::<Vec<_>>());
        },
        "aggregator killed",
    )
    .await;
    nothing_lost(&seen, "aggregator killed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_loses_nothing_and_causes_no_5xx() {
    let redis = Arc::new(Mutex::new(RedisServer::start()));
    let url = redis.lock().unwrap().url();
    let up = upstream().await;
    let sc = Sidecar::start(config(
        up.addr,
        &format!(
            "redis: {{ url: '{url}', timeout: 20ms, on_error: allow, breaker: {{ failures: 3, cooldown: 200ms }} }}\n\
             rules:\n  - name: exact\n    key: [header:x-api-key]\n    limit: {{ rate: 50/s, algorithm: sliding_window_log }}\n    scope: redis\n"
        ),
    ))
    .await
    .unwrap();
    let (r1, r2) = (redis.clone(), redis.clone());
    let seen = scenario(
        sc.addr(),
        true,
        async move { r1.lock().unwrap().stop() },
        async move { r2.lock().unwrap().restart() },
        "redis killed",
    )
    .await;
    nothing_lost(&seen, "redis killed");
    assert!(
        count(&seen.by_phase[0], |s| s == 429) > 0,
        "redis enforced before the fault"
    );
    assert!(
        count(&seen.by_phase[2], |s| s == 429) > 0,
        "and again after its restart"
    );
}

/// An upstream that can be killed (listener closed, every connection cut) and restarted on
/// the same port.
struct KillableApp {
    addr: SocketAddr,
    tasks: Arc<Mutex<JoinSet<()>>>,
}

impl KillableApp {
    async fn start(addr: SocketAddr) -> KillableApp {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let tasks = Arc::new(Mutex::new(JoinSet::new()));
        let t = tasks.clone();
        tasks.lock().unwrap().spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                t.lock().unwrap().spawn(async move {
                    let service = hyper::service::service_fn(|_req| async {
                        Ok::<_, std::convert::Infallible>(http::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from_static(b"ok")),
                        ))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        KillableApp { addr, tasks }
    }

    fn kill(&self) {
        self.tasks.lock().unwrap().abort_all();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_outage_gives_fast_502s_and_full_recovery_without_a_restart() {
    let app = KillableApp::start("127.0.0.1:0".parse().unwrap()).await;
    let addr = app.addr;
    let sc = Sidecar::start(config(
        addr,
        "timeouts: { upstream_connect: 1s }\nrules: []\n",
    ))
    .await
    .unwrap();
    let app = Arc::new(Mutex::new(Some(app)));
    let (a1, a2) = (app.clone(), app.clone());
    let seen = scenario(
        sc.addr(),
        false,
        async move {
            if let Some(a) = a1.lock().unwrap().take() {
                a.kill();
            }
        },
        async move {
            let restarted = KillableApp::start(addr).await;
            *a2.lock().unwrap() = Some(restarted);
        },
        "upstream killed",
    )
    .await;
    for (p, phase) in seen.by_phase.iter().enumerate() {
        assert_eq!(
            count(phase, |s| s == 0),
            0,
            "phase {p}: the proxy itself never drops a client: {phase:?}"
        );
    }
    assert_eq!(
        count(&seen.by_phase[0], |s| s != 200),
        0,
        "{:?}",
        seen.by_phase[0]
    );
    let during = &seen.by_phase[1];
    assert!(
        count(during, |s| s == 502) > 0,
        "an outage is answered with 502: {during:?}"
    );
    assert_eq!(
        count(during, |s| s == 504),
        0,
        "refused connections fail fast, not by timeout: {during:?}"
    );
    let after = &seen.by_phase[2];
    let ok_after = count(after, |s| s == 200);
    assert!(ok_after > 0, "no recovery after the restart: {after:?}");
    // Recovery is whole: once the first 200 came back, nothing failed again.
    assert!(
        count(after, |s| s == 200) * 10 > count(after, |_| true) * 9,
        "most requests after the restart succeed (a few in flight at the moment it came back may not): {after:?}"
    );
}
