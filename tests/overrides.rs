//! Overrides through the real proxy: a file of keys' own limits reloaded under load without
//! any key losing its state, a bad file keeping the last good set, keys written as digests,
//! and exemptions by client address that a client cannot claim for itself.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use http::StatusCode;
use http_body_util::BodyExt;

/// A fresh directory of this test's own.
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("spillway-overrides-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Replaces `path`'s content at once (as a ConfigMap update does): the watcher never reads
/// half a file.
fn put(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn status(addr: std::net::SocketAddr, key: &str) -> StatusCode {
    get(addr, "/", &[("x-api-key", key)]).await.0
}

/// How many of `n` requests of `key` are admitted.
async fn admitted(addr: std::net::SocketAddr, key: &str, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        match status(addr, key).await {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("{key}: {other}"),
        }
    }
    ok
}

async fn loads(sc: &spillway::Sidecar, result: &str) -> f64 {
    let (_, text) = admin(sc, "/metrics").await;
    metric(
        &text,
        &format!("spillway_overrides_reloads_total{{result=\"{result}\",rule=\"per-key\"}}"),
    )
    .unwrap_or(0.0)
}

/// Polls (bounded: 10 s) until the file's loads of `result` pass `seen`: the reload's own
/// signal.
async fn loaded_past(sc: &spillway::Sidecar, result: &str, seen: f64) -> f64 {
    for _ in 0..500 {
        let n = loads(sc, result).await;
        if n > seen {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no {result} load of the overrides file within 10 s");
}

fn entries(extra: &[(&str, &str)]) -> String {
    let mut out = String::from(
        "- { key: vip, limit: { rate: 5/h } }\n- { key: steady, limit: { rate: 40/h } }\n",
    );
    for (k, l) in extra {
        out.push_str(&format!("- {{ key: {k}, limit: {l} }}\n"));
    }
    out
}

#[tokio::test]
async fn an_overrides_file_is_reloaded_under_load_and_no_key_loses_its_state() {
    let d = dir("load");
    let file = d.join("overrides.yaml");
    put(&file, &entries(&[]));
    let (sc, _up, _clock) = sidecar_with_clock(&format!(
        "rules:\n  - name: per-key\n    key: [header:x-api-key]\n    limit: {{ rate: 3/h }}\n    overrides_file: {}\n",
        file.display()
    ))
    .await;
    let addr = sc.addr();
    // Loaded before the first request: the raise holds from the start.
    assert_eq!(admitted(addr, "vip", 8).await, 5);
    assert_eq!(admitted(addr, "plain", 8).await, 3);
    assert_eq!(loads(&sc, "ok").await, 1.0, "loaded once at start");

    // Two clients of `steady` (its own 40/h) send 80 while the file changes five times.
    let load: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { admitted(addr, "steady", 40).await }))
        .collect();
    let mut seen = 1.0;
    for v in 0..5 {
        let n = format!("new{v}");
        put(&file, &entries(&[(&n, "{ rate: 7/h }")]));
        seen = loaded_past(&sc, "ok", seen).await;
    }
    let mut steady = 0;
    for t in load {
        steady += t.await.unwrap();
    }
    assert_eq!(steady, 40, "steady's bucket was never reset by a reload");
    // Spent keys stay spent; the newest entry has its own limit; one dropped is the rule's.
    assert_eq!(admitted(addr, "vip", 3).await, 0);
    assert_eq!(admitted(addr, "plain", 3).await, 0);
    assert_eq!(admitted(addr, "new4", 9).await, 7);
    assert_eq!(admitted(addr, "new0", 9).await, 3);

    // A bad file keeps the last good set, and says so.
    put(
        &file,
        &(entries(&[("new4", "{ rate: 7/h }"), ("late", "{ rate: 9/h }")])
            + "- { key: oops, limit: lots }\n"),
    );
    loaded_past(&sc, "error", 0.0).await;
    assert_eq!(
        admitted(addr, "late", 9).await,
        3,
        "the bad file's new entry is not in force"
    );
    let (_, text) = admin(&sc, "/metrics").await;
    assert_eq!(
        metric(&text, "spillway_overrides{rule=\"per-key\"}"),
        Some(3.0)
    );
    // Put right, it loads.
    put(&file, &entries(&[("late2", "{ rate: 9/h }")]));
    loaded_past(&sc, "ok", seen).await;
    assert_eq!(admitted(addr, "late2", 12).await, 9);
}

#[tokio::test]
async fn a_key_written_as_its_digest_gets_its_own_limit() {
    let d = dir("digest");
    let secret = d.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    let digest = spillway::internal::digest::Secret::load(&secret)
        .unwrap()
        .of_value(b"sk-live-vip");
    let file = d.join("overrides.yaml");
    put(
        &file,
        &format!("overrides:\n  - key: \"{digest}\"\n    limit: unlimited\n"),
    );
    let (sc, _up, _clock) = sidecar_with_clock(&format!(
        "key_secret_file: {}\nrules:\n  - name: per-key\n    key: [header:x-api-key]\n    limit: {{ rate: 2/h }}\n    overrides_file: {}\n",
        secret.display(),
        file.display()
    ))
    .await;
    assert_eq!(admitted(sc.addr(), "sk-live-vip", 20).await, 20);
    assert_eq!(admitted(sc.addr(), "sk-live-other", 20).await, 2);
    // explain says why.
    let ask = serde_json::json!({ "path": "/", "headers": [["x-api-key", "sk-live-vip"]] });
    let req = http::Request::post(format!("http://{}/explain", sc.admin_addr()))
        .body(BodyExt::boxed(
            http_body_util::Full::new(bytes::Bytes::from(ask.to_string()))
                .map_err(|never| match never {}),
        ))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let e: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(e["rules"][0]["override"], "unlimited", "{e:#}");
    assert_eq!(e["rules"][0]["decision"], "unlimited", "{e:#}");
}

#[tokio::test]
async fn a_bad_overrides_file_stops_the_start() {
    let d = dir("bad");
    let file = d.join("overrides.yaml");
    put(&file, "- { key: [a, b], limit: unlimited }\n");
    let up = upstream().await;
    let config = config(
        up.addr,
        &format!(
            "rules:\n  - name: per-key\n    key: [header:x-api-key]\n    limit: {{ rate: 2/h }}\n    overrides_file: {}\n",
            file.display()
        ),
    );
    let e = spillway::Sidecar::start(config)
        .await
        .err()
        .expect("refused");
    assert!(e.to_string().contains("per-key"), "{e}");
    assert!(e.to_string().contains("part"), "{e}");
}

/// The exemption is by the address the keys use: a client cannot write itself into it.
#[tokio::test]
async fn an_exemption_by_address_cannot_be_claimed_by_a_forwarded_header() {
    let rules = "rules:\n  - name: limited\n    match: { except_client_ip: [203.0.113.0/24] }\n    key: client_ip\n    limit: { rate: 2/h }\n";
    let claim = |ip: &'static str| [("x-forwarded-for", ip)];
    // Nobody is trusted: the claim is the client's own word.
    let (sc, _up, _clock) = sidecar_with_clock(rules).await;
    let mut ok = 0;
    for _ in 0..6 {
        if get(sc.addr(), "/", &claim("203.0.113.5")).await.0 == StatusCode::OK {
            ok += 1;
        }
    }
    assert_eq!(ok, 2, "an untrusted X-Forwarded-For does not exempt");
    // Behind a trusted proxy (this test, on loopback), the office it names is exempt.
    let (sc, _up, _clock) = sidecar_with_clock(&format!(
        "client_ip: {{ trusted_proxies: [127.0.0.1/32] }}\n{rules}"
    ))
    .await;
    let count = |ip: &'static str| {
        let addr = sc.addr();
        async move {
            let mut ok = 0;
            for _ in 0..6 {
                if get(addr, "/", &claim(ip)).await.0 == StatusCode::OK {
                    ok += 1;
                }
            }
            ok
        }
    };
    assert_eq!(count("203.0.113.5").await, 6);
    assert_eq!(count("198.51.100.7").await, 2);
}

/// A global rule: the raised key's own limit goes with its reports, and the controller holds
/// it to that while the rule's other keys are held to the rule's.
#[tokio::test]
async fn a_global_key_with_its_own_limit_is_held_to_it_fleet_wide() {
    let ctl = controller_in_process().await;
    let rules =
        global_rule(ctl.addr) + "    overrides:\n      - { key: vip, limit: { rate: 100000/s } }\n";
    let (sc, _up) = sidecar(&rules).await;
    let (mut k_dropped, mut vip_dropped) = (0, 0);
    // Both offered alike, far over 5/s, until k has been dropped often (bounded).
    for _ in 0..6000 {
        if k_dropped >= 20 {
            break;
        }
        for (key, dropped) in [("k", &mut k_dropped), ("vip", &mut vip_dropped)] {
            match get(sc.addr(), "/", &[("x-api-key", key)]).await.0 {
                StatusCode::OK => {}
                StatusCode::TOO_MANY_REQUESTS => *dropped += 1,
                other => panic!("{key}: {other}"),
            }
        }
    }
    assert!(k_dropped >= 20, "the rule's limit never held k");
    // Then on the controller's answers (bounded: 3000 rounds), which name both keys.
    let mut answered = 0.0;
    for _ in 0..3000 {
        let (_, text) = admin(&sc, "/metrics").await;
        answered = metric(&text, "spillway_reports_total{result=\"ok\"}").unwrap_or(0.0);
        if answered >= 5.0 {
            break;
        }
        for key in ["k", "vip"] {
            let refused =
                get(sc.addr(), "/", &[("x-api-key", key)]).await.0 == StatusCode::TOO_MANY_REQUESTS;
            if refused && key == "vip" {
                vip_dropped += 1;
            }
        }
    }
    assert!(answered >= 5.0, "the controller never answered");
    assert_eq!(
        vip_dropped, 0,
        "vip's own limit is far above what it was offered"
    );
    ctl.shutdown();
}
