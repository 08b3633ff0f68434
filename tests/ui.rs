//! The status page (`/ui`) of a running controller and proxy, loaded in headless Chromium
//! (Debian's `chromium`, installed by scripts/test when missing): what it shows is checked in
//! the DOM the page's own script built from live state.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;

const CHROMIUM: &str = "/usr/bin/chromium";

/// The DOM of `url` after its scripts ran for a few (virtual) seconds.
fn rendered(url: &str, name: &str) -> String {
    let profile =
        std::env::temp_dir().join(format!("spillway-chromium-{}-{name}", std::process::id()));
    let out = std::process::Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(url)
        .output()
        .unwrap_or_else(|e| {
            panic!("{CHROMIUM}: {e}; scripts/test installs it (apt-get install chromium)")
        });
    let _ = std::fs::remove_dir_all(&profile);
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The text of the table row whose first cell is `first`, tags stripped.
fn row(dom: &str, first: &str) -> String {
    let at = dom
        .find(&format!("<td>{first}</td>"))
        .unwrap_or_else(|| panic!("no row {first:?} in the page:\n{dom}"));
    let start = dom[..at].rfind("<tr").unwrap();
    let end = at + dom[at..].find("</tr>").unwrap();
    let mut text = String::new();
    let mut in_tag = false;
    for c in dom[start..end].chars() {
        match c {
            '<' => in_tag = true,
            '>' => {
                in_tag = false;
                if !text.ends_with('|') {
                    text.push('|');
                }
            }
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_pages_show_rules_rates_keys_and_who_reports() {
    let ctl = controller();
    let up = upstream().await;
    let yaml = format!(
        "service: shop\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{}\n{}{}",
        up.addr,
        format_args!(
            "control_plane: {{ url: 'http://{}', report_interval: 200ms, stale_after: 5s, host: pod-a, zone: eu-1 }}\n",
            ctl.addr
        ),
        "rules:\n  - name: per-key\n    key: [header:x-api-key]\n    limit: { rate: 50/s }\n    scope: global\n  - name: per-client\n    key: [client_ip]\n    limit: { rate: 1000/s }\n    mode: shadow\n  - name: bytes\n    key: [client_ip]\n    limit: { rate: 1000000/s }\n    cost: { response: body_bytes, reserve: 0, max: 100000 }\n",
    );
    let path = temp_file("ui.yaml", &yaml);
    let proxy = Proc::spawn(&["proxy", "--config", path.to_str().unwrap()]);

    // Traffic for the whole test: the heavy key well over its fleet limit, a light one under.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (stop, addr) = (stop.clone(), proxy.addr);
        tokio::spawn(async move {
            let c = client();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) && n < 200_000 {
                let key = if n % 10 == 0 {
                    "light-key"
                } else {
                    "heavy-key"
                };
                send(&c, addr, "GET", "/", &[("x-api-key", key)]).await;
                n += 1;
            }
        })
    };
    // The control plane knows a header's value by its digest (the built-in secret's here).
    let heavy_key = spillway::internal::digest::Secret::default().of_value(b"heavy-key");
    // Ready when the controller's state has the rule (bounded: 10 s).
    let mut seen = false;
    for _ in 0..500 {
        let state = get(ctl.admin, "/ui/state.json", &[]).await.2;
        assert!(!state.contains("heavy-key"), "a key in clear: {state}");
        if state.contains(&heavy_key[..8]) {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen, "the controller never saw the proxy's reports");

    let page = rendered(&format!("http://{}/ui", ctl.admin), "controller");
    assert!(page.contains("Spillway controller"), "{page}");
    let rule = row(&page, "shop / per-key");
    assert!(rule.contains("|global|50.0/s per key|"), "{rule}");
    assert!(page.contains("<canvas"), "a chart per rule");
    let heavy = row(&page, "per-key");
    assert!(
        heavy.contains(&format!("|{}…|", &heavy_key[..8])),
        "heaviest keys first: {heavy}"
    );
    // A proxy reporting straight to the controller shows as its host (through an aggregator,
    // it would be the zone).
    let source = row(&page, "pod-a");
    assert!(source.contains("s ago|fresh|"), "{source}");

    let page = rendered(&format!("http://{}/ui", proxy.admin), "proxy");
    assert!(page.contains("Spillway proxy: shop"), "{page}");
    assert!(
        row(&page, "per-key").contains("|global|50/s (burst 50)|"),
        "{page}"
    );
    assert!(
        row(&page, "per-client").contains("|local (shadow)|"),
        "{page}"
    );
    // A budget charged after the response shows its units.
    let bytes = row(&page, "bytes");
    assert!(
        bytes.contains(
            "units/s charged|1000000/s (burst 1000000) units of the response's body bytes|"
        ),
        "{bytes}"
    );
    assert!(row(&page, "control plane").contains("|fresh|"), "{page}");
    // The keys holding their limits now, for loopback (or the admin token): by digest.
    assert!(page.contains(&format!("<td>{heavy_key}</td>")), "{page}");
    assert!(!page.contains("heavy-key"), "a key in clear: {page}");

    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
}
