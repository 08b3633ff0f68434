//! Bytes per report at 10, 1 000 and 100 000 distinct keys of one global rule.
//!
//! `cargo bench --bench report_size`. Each key is offered once, then the reporter's own
//! `build_report` takes the counts (top_k 100) and the report is serialized as it is sent.

use std::net::{IpAddr, Ipv4Addr};

use http::{HeaderMap, Method, Uri};
use spillway::internal::control::reporter::build_report;
use spillway::internal::key::RequestView;
use spillway::internal::metrics::Metrics;
use spillway::internal::rules::RuleSet;
use spillway::Config;

fn main() {
    let yaml = "service: checkout\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ncontrol_plane: { url: 'http://127.0.0.1:7001', top_k: 100 }\nrules:\n  - name: per-client\n    key: client_ip\n    limit: { rate: 100/s }\n    scope: global\n    max_keys: 200000\n";
    let config = Config::from_yaml(yaml, "bench").unwrap();
    println!("| distinct keys offered | entries in the report | bytes (JSON) |");
    println!("|---|---|---|");
    for n in [10u32, 1_000, 100_000] {
        let rules = RuleSet::build(&config, &Metrics::new());
        let (uri, headers) = (Uri::from_static("/"), HeaderMap::new());
        for i in 0..n {
            let view = RequestView::new(
                &Method::GET,
                &uri,
                &headers,
                IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)),
            );
            // Uneven: key i is offered 1 + i % 7 times, so the top-k is a real choice.
            for _ in 0..=(i % 7) {
                std::hint::black_box(rules.check(&view, 1));
            }
        }
        let report = build_report(
            &rules,
            "checkout",
            "pod-1",
            "eu-1",
            std::time::Duration::from_secs(1),
            100,
            1,
        );
        let bytes = serde_json::to_vec(&report).unwrap().len();
        println!("| {n} | {} | {bytes} |", report.entries.len());
    }
}
