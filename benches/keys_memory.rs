//! Memory per tracked key, and RSS when 1 M distinct keys are offered to a rule capped at
//! `max_keys: 100000`.
//!
//! `cargo bench --bench keys_memory`. Each algorithm runs in a fresh child process, so that
//! one's freed memory does not flatter the next. RSS is read from /proc/self/statm (Linux).

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;

use http::{HeaderMap, Method, Uri};
use spillway::key::RequestView;
use spillway::limit::Algorithm;
use spillway::metrics::Metrics;
use spillway::rules::RuleSet;
use spillway::Config;

const CAP: u32 = 100_000;
const OFFERED: u32 = 1_000_000;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn one(limit: &str) {
    let yaml = format!(
        "service: m\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: r\n    key: client_ip\n    limit: {limit}\n    max_keys: {CAP}\n"
    );
    let config = Config::from_yaml(&yaml, "bench").unwrap();
    let metrics = Metrics::new();
    let rules = RuleSet::build(&config, &metrics);
    let (uri, headers) = (Uri::from_static("/"), HeaderMap::new());
    let offer = |from: u32, to: u32| {
        for i in from..to {
            let view = RequestView::new(
                &Method::GET,
                &uri,
                &headers,
                IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)),
            );
            std::hint::black_box(rules.check(&view, 1_000_000_000));
        }
    };
    let before = rss_bytes();
    offer(0, CAP);
    let at_cap = rss_bytes();
    offer(CAP, OFFERED);
    let after = rss_bytes();
    println!(
        "| {limit} | {} | {:.1} MiB | {:.1} MiB | {} |",
        (at_cap - before) / u64::from(CAP),
        at_cap as f64 / (1 << 20) as f64,
        after as f64 / (1 << 20) as f64,
        rules.tracked_keys("r").unwrap(),
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--one") {
        one(&args[i + 1]);
        return;
    }
    println!("| limit | bytes per tracked key | RSS at 100k keys | RSS after 1M offered | keys tracked |");
    println!("|---|---|---|---|---|");
    let mut limits: Vec<String> = Algorithm::ALL
        .iter()
        .map(|a| format!("{{ rate: 10/s, algorithm: {} }}", a.name()))
        .collect();
    limits.push("{ concurrency: 4 }".into());
    let exe = std::env::current_exe().unwrap();
    for limit in limits {
        let status = Command::new(&exe).args(["--one", &limit]).status().unwrap();
        assert!(status.success());
    }
}
