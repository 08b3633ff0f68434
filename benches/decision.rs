//! The in-path decision for every algorithm: one hot key and 1M keys, on one and two threads,
//! with governor's keyed limiter in the same run as a reference.
//!
//! `cargo bench --bench decision`. Each `decision/*` figure is the cost of `RuleSet::check`
//! for one request under one matching rule (match, key extraction, lookup, the algorithm,
//! counter), exactly as the proxy calls it, with `now` read from the real clock once per
//! decision. `governor/*` is `check_key` on a `DefaultKeyedRateLimiter<IpAddr>`: a bare keyed
//! check with no matching, key extraction or metrics, so it is the floor we compare against.
//! Limits are set so that every decision admits (the common path). Two-thread figures are wall
//! time per decision on each thread while both run at once.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion};
use http::{HeaderMap, Method, Uri};
use spillway::internal::key::RequestView;
use spillway::internal::limit::{Algorithm, Clock, Limiter, MonotonicClock};
use spillway::internal::metrics::Metrics;
use spillway::internal::rules::RuleSet;
use spillway::Config;

const MANY: u32 = 1_000_000;

fn ruleset(algorithm: Algorithm) -> RuleSet {
    // A limit no benchmark reaches, except for the sliding log: it keeps an entry per request
    // in its window, and its memory cap (burst x max_keys x 16 B <= 1 GiB) keeps the limit
    // low, so its hot key is mostly refused (the O(log n) refusal path).
    let limit = match algorithm {
        Algorithm::SlidingWindowLog => {
            "{ rate: 10/1ms, algorithm: sliding_window_log }".to_string()
        }
        // Its counts are 20-bit: a million per millisecond is the same rate, in range.
        Algorithm::SlidingWindowCounter => {
            "{ rate: 1000000/1ms, algorithm: sliding_window_counter }".to_string()
        }
        a => format!("{{ rate: 1000000000/s, algorithm: {} }}", a.name()),
    };
    let yaml = format!(
        "service: bench\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: per-client\n    match: {{ path_prefix: /api/ }}\n    key: client_ip\n    limit: {limit}\n    max_keys: 2000000\n"
    );
    let config = Config::from_yaml(&yaml, "bench").unwrap();
    RuleSet::build(&config, &Metrics::new())
}

/// A global rule whose drop ratio for the key of `ip(1)` is `ratio`, as a reply set it.
fn global_ruleset(ratio: f64) -> RuleSet {
    let yaml = "service: bench\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: { url: 'http://127.0.0.1:1', stale_after: 1h }\nrules:\n  - name: fleet\n    match: { path_prefix: /api/ }\n    key: client_ip\n    limit: { rate: 100/s }\n    scope: global\n";
    let config = Config::from_yaml(yaml, "bench").unwrap();
    // Built from JSON, as a reporter reads it (and as every wire version has it).
    let reply: spillway::internal::control::Reply = serde_json::from_str(&format!(
        r#"{{"version":1,"age_ms":0,"ratios":[{{"service":"bench","rule":"fleet","key":"{}","ratio":{ratio}}}]}}"#,
        ip(1)
    ))
    .unwrap();
    use spillway::internal::rules::DropRatios;
    let now = MonotonicClock::new().now();
    let ratios = Arc::new(arc_swap::ArcSwap::from_pointee(DropRatios::empty(now)));
    let rules = RuleSet::build_with_ratios(&config, &Metrics::new(), ratios.clone());
    // The key assigned, as a reply answering a report that named it makes it.
    Req::new().decide(&rules, ip(1));
    rules.drain_global(10, 1.0, 1, 0);
    ratios.store(Arc::new(
        DropRatios::from_reply(&reply, "bench", now).answering(1),
    ));
    rules
}

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

struct Req {
    clock: MonotonicClock,
    uri: Uri,
    headers: HeaderMap,
}

impl Req {
    fn new() -> Self {
        Req {
            clock: MonotonicClock::new(),
            uri: Uri::from_static("/api/orders"),
            headers: HeaderMap::new(),
        }
    }
    #[inline]
    fn decide(&self, rules: &RuleSet, ip: IpAddr) {
        let view = RequestView::new(&Method::GET, &self.uri, &self.headers, ip);
        black_box(rules.check(&view, self.clock.now()));
    }
}

/// Runs `iters` calls of `f(thread, i)` on each of `threads` threads at once; returns wall
/// time for them all (criterion divides by `iters`: time per call per thread).
fn contended<F>(threads: u32, iters: u64, f: Arc<F>) -> Duration
where
    F: Fn(u32, u64) + Send + Sync + 'static,
{
    let barrier = Arc::new(std::sync::Barrier::new(threads as usize + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (f, barrier) = (f.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..iters {
                    f(t, i);
                }
            })
        })
        .collect();
    let clock = MonotonicClock::new();
    barrier.wait();
    let start = clock.now();
    for h in handles {
        h.join().unwrap();
    }
    Duration::from_nanos(clock.now() - start)
}

/// The four figures for one limiter: `check(thread, i)` decides the `i`th request.
fn four<F, G>(
    g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    hot: Arc<F>,
    many: Arc<G>,
) where
    F: Fn(u32, u64) + Send + Sync + 'static,
    G: Fn(u32, u64) + Send + Sync + 'static,
{
    let mut i = 0u64;
    g.bench_function(format!("{name}/one_key/1_thread"), |b| {
        b.iter(|| {
            i += 1;
            hot(0, i)
        })
    });
    g.bench_function(format!("{name}/1m_keys/1_thread"), |b| {
        b.iter(|| {
            i += 1;
            many(0, i)
        })
    });
    g.bench_function(format!("{name}/one_key/2_threads"), |b| {
        b.iter_custom(|iters| contended(2, iters, hot.clone()))
    });
    g.bench_function(format!("{name}/1m_keys/2_threads"), |b| {
        b.iter_custom(|iters| contended(2, iters, many.clone()))
    });
}

/// Key `i` of thread `t` among `MANY`, spread so that threads touch different keys.
fn many_key(t: u32, i: u64) -> u32 {
    ((i.wrapping_mul(2_654_435_761) as u32).wrapping_add(t * 7919)) % MANY
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for algorithm in Algorithm::ALL {
        let hot = Arc::new(ruleset(algorithm));
        let many = Arc::new(ruleset(algorithm));
        let r = Req::new();
        for k in 0..MANY {
            r.decide(&many, ip(k));
        }
        let req = Arc::new(Req::new());
        let (rq, h) = (req.clone(), hot.clone());
        let hot_fn = Arc::new(move |_t: u32, _i: u64| rq.decide(&h, ip(1)));
        let (rq, m) = (req.clone(), many.clone());
        let many_fn = Arc::new(move |t: u32, i: u64| rq.decide(&m, ip(many_key(t, i))));
        four(&mut g, algorithm.name(), hot_fn, many_fn);
    }

    let unmatched = Uri::from_static("/static/logo.png");
    let rules = ruleset(Algorithm::TokenBucket);
    let clock = MonotonicClock::new();
    let headers = HeaderMap::new();
    g.bench_function("no_matching_rule/1_thread", |b| {
        b.iter(|| {
            let view = RequestView::new(&Method::GET, &unmatched, &headers, ip(1));
            black_box(rules.check(&view, clock.now()))
        })
    });
    // What the proxy adds before the decision since the hostile-client work: the Host check,
    // the target's canonical form (already canonical here: nothing to rewrite), the identity
    // fields' scan, the client address behind a listed proxy; then the same decision.
    let config = Config::from_yaml(
        "service: bench\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nclient_ip: { trusted_proxies: [10.0.0.0/8] }\n",
        "bench",
    )
    .unwrap();
    let hygiene = spillway::internal::hygiene::Hygiene::of(&config);
    let policy = config.client_ip.policy();
    let mut req = http::Request::get("/api/orders?user=bob")
        .header("host", "app")
        .header("user-agent", "bench")
        .header("x-forwarded-for", "203.0.113.9")
        .body(())
        .unwrap();
    let peer = ip(7);
    g.bench_function("token_bucket/one_key/with_request_hygiene", |b| {
        b.iter(|| {
            hygiene.apply(&mut req).unwrap();
            let client = policy.client(req.headers(), peer);
            let view = RequestView::of(&req, client).trusted(policy.trusts(peer));
            black_box(rules.check(&view, clock.now()))
        })
    });
    // A global rule, decided by the control plane's last ratios: a key the reply names at 0
    // (admitted) and one at 1 (refused: the 429's path up to its rendering).
    for (name, ratio) in [("admitted", 0.0), ("refused", 1.0)] {
        let rules = global_ruleset(ratio);
        let r = Req::new();
        g.bench_function(format!("global/{name}/one_key/1_thread"), |b| {
            b.iter(|| r.decide(&rules, ip(1)))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("governor");
    let quota = governor::Quota::per_second(NonZeroU32::new(1_000_000_000).unwrap());
    let hot = Arc::new(governor::DefaultKeyedRateLimiter::<IpAddr>::keyed(quota));
    let many = Arc::new(governor::DefaultKeyedRateLimiter::<IpAddr>::keyed(quota));
    for k in 0..MANY {
        let _ = many.check_key(&ip(k));
    }
    let h = hot.clone();
    let hot_fn = Arc::new(move |_t: u32, _i: u64| {
        let _ = black_box(h.check_key(&ip(1)));
    });
    let m = many.clone();
    let many_fn = Arc::new(move |t: u32, i: u64| {
        let _ = black_box(m.check_key(&ip(many_key(t, i))));
    });
    four(&mut g, "keyed", hot_fn, many_fn);
    g.finish();

    // The parts, to read the figures above against.
    let mut parts = c.benchmark_group("parts");
    parts.bench_function("clock_now", |b| b.iter(|| black_box(clock.now())));
    let quota = spillway::internal::limit::Quota::new(
        NonZeroU32::new(1_000_000_000).unwrap(),
        Duration::from_secs(1),
        NonZeroU32::new(1_000_000_000).unwrap(),
    )
    .unwrap();
    let bucket = spillway::internal::limit::TokenBucket::new();
    parts.bench_function("token_bucket_check", |b| {
        b.iter(|| black_box(bucket.check(&quota, clock.now(), 1)))
    });
    parts.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
