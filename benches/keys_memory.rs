//! Memory per tracked key, and RSS when 1 M distinct keys are offered to a rule capped at
//! `max_keys: 100000`: client addresses for every algorithm, then header keys of 60 bytes (the
//! longest kept as they are, framed) and of 16 KiB (kept as a 17-byte hash), and a global
//! rule's client addresses (their counters for the reports).
//!
//! `cargo bench --bench keys_memory`. Each algorithm runs in a fresh child process, so that
//! one's freed memory does not flatter the next. RSS is read from /proc/self/statm (Linux).

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;

use http::{HeaderMap, Method, Uri};
use spillway::internal::key::RequestView;
use spillway::internal::limit::Algorithm;
use spillway::internal::metrics::Metrics;
use spillway::internal::rules::RuleSet;
use spillway::Config;

const CAP: u32 = 100_000;
const OFFERED: u32 = 1_000_000;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// `key`: `client_ip`, or `header:x-k=N`: an `x-k` header of N bytes, distinct per request.
fn one(limit: &str, key: &str) {
    let (part, len) = match key.split_once('=') {
        Some((part, n)) => (part, n.parse::<usize>().unwrap()),
        None => (key, 0),
    };
    // `... scope: global`: a global rule's keys (their counters for the reports), with a
    // control plane that never answers.
    let (rate, global) = match limit.split_once(" scope: global") {
        Some((rate, _)) => (rate, "    scope: global\n"),
        None => (limit, ""),
    };
    let control = if global.is_empty() {
        ""
    } else {
        "control_plane: { url: 'http://127.0.0.1:1' }\n"
    };
    let yaml = format!(
        "service: m\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\n{control}rules:\n  - name: r\n    key: {part}\n    limit: {rate}\n{global}    max_keys: {CAP}\n"
    );
    let config = Config::from_yaml(&yaml, "bench").unwrap();
    let metrics = Metrics::new();
    let rules = RuleSet::build(&config, &metrics);
    let uri = Uri::from_static("/");
    let mut value = vec![b'k'; len];
    let offer = |from: u32, to: u32, value: &mut Vec<u8>| {
        let mut headers = HeaderMap::new();
        for i in from..to {
            if len > 0 {
                value[..8.min(len)].copy_from_slice(&format!("{i:08}").as_bytes()[..8.min(len)]);
                headers.insert("x-k", http::HeaderValue::from_bytes(value).unwrap());
            }
            let view = RequestView::new(
                &Method::GET,
                &uri,
                &headers,
                IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)),
            );
            std::hint::black_box(rules.check(&view, 1_000_000_000));
        }
    };
    // The header map's own first allocation, and the transient value, before measuring.
    offer(OFFERED, OFFERED + 1, &mut value);
    let before = rss_bytes();
    offer(0, CAP, &mut value);
    let at_cap = rss_bytes();
    offer(CAP, OFFERED, &mut value);
    let after = rss_bytes();
    println!(
        "| {limit} | {key} | {} | {:.1} MiB | {:.1} MiB | {} |",
        (at_cap - before) / u64::from(CAP),
        at_cap as f64 / (1 << 20) as f64,
        after as f64 / (1 << 20) as f64,
        rules.tracked_keys("r").unwrap(),
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--one") {
        one(&args[i + 1], &args[i + 2]);
        return;
    }
    println!("| limit | key | bytes per tracked key | RSS at 100k keys | RSS after 1M offered | keys tracked |");
    println!("|---|---|---|---|---|---|");
    let mut runs: Vec<(String, &str)> = Algorithm::ALL
        .iter()
        .map(|a| {
            (
                format!("{{ rate: 10/s, algorithm: {} }}", a.name()),
                "client_ip",
            )
        })
        .collect();
    runs.push(("{ concurrency: 4 }".into(), "client_ip"));
    runs.push(("{ rate: 10/s } scope: global".into(), "client_ip"));
    // Keys as long as a local key is kept (64 B: heap past 24) and far longer (hashed).
    runs.push(("{ rate: 10/s }".into(), "header:x-k=60"));
    runs.push(("{ rate: 10/s }".into(), "header:x-k=16384"));
    let exe = std::env::current_exe().unwrap();
    for (limit, key) in runs {
        let status = Command::new(&exe)
            .args(["--one", &limit, key])
            .status()
            .unwrap();
        assert!(status.success());
    }
}
