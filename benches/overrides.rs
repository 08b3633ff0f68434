//! Overrides and `spillway test`, measured: the load time and memory of an `overrides_file`
//! of 100 000 entries; a decision's cost with and without a key's own limit; and how long the
//! simulation takes for a million requests (one proxy and a local rule; three proxies and a
//! global rule answered by the controller's sums).
//!
//! `cargo bench --bench overrides`. RSS is read from /proc/self/statm (Linux).

use std::net::{IpAddr, Ipv4Addr};

use http::{HeaderMap, Method, Uri};
use spillway::internal::key::RequestView;
use spillway::internal::metrics::Metrics;
use spillway::internal::rules::RuleSet;
use spillway::Config;
use tokio::time::Instant;

const ENTRIES: usize = 100_000;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn config(overrides: &str) -> Config {
    let yaml = format!(
        "service: b\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nlog_rejections: 0\nrules:\n  - name: per-key\n    key: [header:x-api-key]\n    limit: {{ rate: 1000000/s }}\n{overrides}"
    );
    Config::from_yaml(&yaml, "bench").unwrap()
}

fn load() {
    let dir = std::env::temp_dir().join(format!("spillway-bench-overrides-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("overrides.yaml");
    let mut text = String::with_capacity(ENTRIES * 64);
    for i in 0..ENTRIES {
        // One in ten written as a digest (a key kept out of the ConfigMap).
        let key = if i % 10 == 0 {
            spillway::internal::digest::Secret::default().of_value(format!("sk-{i:08}").as_bytes())
        } else {
            format!("sk-{i:08}")
        };
        text.push_str(&format!(
            "- {{ key: \"{key}\", limit: {{ rate: {}/s }} }}\n",
            100 + i % 7
        ));
    }
    std::fs::write(&file, &text).unwrap();
    let rules = RuleSet::build(
        &config(&format!("    overrides_file: {}\n", file.display())),
        &Metrics::new(),
    );
    let before = rss_bytes();
    let started = Instant::now();
    let loaded = rules.load_override_files(None);
    let took = started.elapsed();
    let after = rss_bytes();
    assert!(loaded[0].1 .0.is_ok(), "{:?}", loaded[0].1);
    println!(
        "overrides_file of {ENTRIES} entries ({} KiB): loaded in {:.0} ms, RSS +{:.1} MiB ({:.0} bytes an entry; the parse's garbage included)",
        text.len() / 1024,
        took.as_secs_f64() * 1e3,
        after.saturating_sub(before) as f64 / (1 << 20) as f64,
        after.saturating_sub(before) as f64 / ENTRIES as f64
    );
    // A reload of the same text: read and compared only.
    let started = Instant::now();
    rules.load_override_files(None);
    println!(
        "  the same file again: {:.1} ms (read and compared)",
        started.elapsed().as_secs_f64() * 1e3
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Nanoseconds per decision of `key` under `rules` (a warm key, never refused).
fn per_decision(rules: &RuleSet, key: &str) -> f64 {
    let mut headers = HeaderMap::new();
    headers.insert("x-api-key", key.parse().unwrap());
    let uri = Uri::from_static("/");
    let view = RequestView::new(
        &Method::GET,
        &uri,
        &headers,
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
    );
    const N: u64 = 2_000_000;
    let mut admitted = 0u64;
    let started = Instant::now();
    for i in 0..N {
        admitted += u64::from(matches!(
            rules.check(&view, 1_000_000_000 + i * 1_000),
            spillway::internal::rules::Verdict::Allow(_)
        ));
    }
    let ns = started.elapsed().as_secs_f64() * 1e9 / N as f64;
    assert_eq!(admitted, N);
    ns
}

fn lookups() {
    let digest = spillway::internal::digest::Secret::default().of_value(b"sk-other");
    for (label, overrides, key) in [
        ("no overrides", String::new(), "sk-1"),
        (
            "a listed key",
            "    overrides: [{ key: sk-1, limit: { rate: 2000000/s } }]\n".into(),
            "sk-1",
        ),
        (
            "an unlisted key",
            "    overrides: [{ key: sk-2, limit: { rate: 2000000/s } }]\n".into(),
            "sk-1",
        ),
        (
            "an unlisted key, digests listed",
            format!("    overrides: [{{ key: \"{digest}\", limit: unlimited }}]\n"),
            "sk-1",
        ),
    ] {
        let rules = RuleSet::build(&config(&overrides), &Metrics::new());
        println!("decision, {label}: {:.0} ns", per_decision(&rules, key));
    }
}

fn simulate() {
    use spillway::internal::scenario;
    let root = env!("CARGO_MANIFEST_DIR");
    for (file, label) in [
        ("bench/million-local.test.yaml", "one proxy, local rules"),
        (
            "bench/million-global.test.yaml",
            "three proxies, a global rule",
        ),
    ] {
        let started = Instant::now();
        let outcomes = scenario::run_file(&std::path::Path::new(root).join(file)).unwrap();
        let took = started.elapsed().as_secs_f64();
        let requests: u64 = outcomes.iter().map(|o| o.requests).sum();
        assert!(outcomes.iter().all(|o| o.passed), "{file}");
        println!(
            "spillway test, {label}: {requests} requests in {took:.2} s ({:.2} M/s)",
            requests as f64 / took / 1e6
        );
    }
}

fn main() {
    load();
    lookups();
    simulate();
}
