//! The in-path decision: one hot key and 100k keys, on one and two threads.
//!
//! `cargo bench --bench decision`. Each figure is the cost of `RuleSet::check` for one
//! request under one matching rule (match, key extraction, lookup, CAS, counter), as the
//! proxy calls it, with `now` read from the real clock once per decision.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use http::{HeaderMap, Method, Uri};
use spillway::key::RequestView;
use spillway::limit::{Clock, Limiter, MonotonicClock};
use spillway::metrics::Metrics;
use spillway::rules::RuleSet;
use spillway::Config;

const KEYS: u32 = 100_000;

fn ruleset() -> RuleSet {
    // A limit no benchmark reaches, so every decision takes the admit path (the common one).
    let yaml = "service: bench\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: per-client\n    match: { path_prefix: /api/ }\n    key: client_ip\n    limit: { rate: 1000000000/s }\n    max_keys: 200000\n";
    let config = Config::from_yaml(yaml, "bench").unwrap();
    RuleSet::build(&config, &Metrics::new())
}

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

fn decide(rules: &RuleSet, clock: &MonotonicClock, uri: &Uri, headers: &HeaderMap, ip: IpAddr) {
    let view = RequestView {
        method: &Method::GET,
        uri,
        headers,
        host: None,
        client_ip: ip,
    };
    black_box(rules.check(&view, clock.now()));
}

/// Runs `iters` decisions on each of `threads` threads at once; returns wall time per
/// decision per thread.
fn contended(rules: &Arc<RuleSet>, threads: u32, iters: u64, keys: u32) -> Duration {
    let barrier = Arc::new(std::sync::Barrier::new(threads as usize + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let rules = rules.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let clock = MonotonicClock::new();
                let uri = Uri::from_static("/api/orders");
                let headers = HeaderMap::new();
                barrier.wait();
                let mut k = t * 7919;
                for _ in 0..iters {
                    k = if k + 1 >= keys { 0 } else { k + 1 };
                    decide(&rules, &clock, &uri, &headers, ip(k));
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

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    let clock = MonotonicClock::new();
    let uri = Uri::from_static("/api/orders");
    let headers = HeaderMap::new();

    let hot = ruleset();
    g.bench_function("one_key/1_thread", |b| {
        b.iter(|| decide(&hot, &clock, &uri, &headers, ip(1)))
    });

    let many = ruleset();
    for i in 0..KEYS {
        decide(&many, &clock, &uri, &headers, ip(i));
    }
    let mut k = 0;
    g.bench_function("100k_keys/1_thread", |b| {
        b.iter(|| {
            k = if k + 1 >= KEYS { 0 } else { k + 1 };
            decide(&many, &clock, &uri, &headers, ip(k))
        })
    });

    let unmatched = Uri::from_static("/static/logo.png");
    g.bench_function("no_matching_rule/1_thread", |b| {
        b.iter(|| decide(&hot, &clock, &unmatched, &headers, ip(1)))
    });

    let hot = Arc::new(hot);
    g.bench_function("one_key/2_threads", |b| {
        b.iter_custom(|iters| contended(&hot, 2, iters, 1))
    });
    let many = Arc::new(many);
    g.bench_function("100k_keys/2_threads", |b| {
        b.iter_custom(|iters| contended(&many, 2, iters, KEYS))
    });
    g.finish();

    // The parts, to read the figures above against.
    let mut parts = c.benchmark_group("parts");
    parts.bench_function("clock_now", |b| b.iter(|| black_box(clock.now())));
    let quota = spillway::limit::Quota::new(
        std::num::NonZeroU32::new(1_000_000_000).unwrap(),
        Duration::from_secs(1),
        std::num::NonZeroU32::new(1_000_000_000).unwrap(),
    )
    .unwrap();
    let bucket = spillway::limit::TokenBucket::new();
    parts.bench_function("token_bucket_check", |b| {
        b.iter(|| black_box(bucket.check(&quota, clock.now(), 1)))
    });
    parts.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
