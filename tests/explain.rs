//! "Why was this client limited?": `/explain` on a running proxy says what each rule would
//! decide of a described request, taking nothing, and the real request that follows gets
//! exactly that, for every rule kind; `spillway explain` asks it from the command line, or
//! explains offline from a configuration file or a saved `/config`; `/top` lists keys from
//! the stores; `/log-level` changes the filter of a running process.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use http_body_util::BodyExt;
use hyper::Request;

/// One rule per path, each of a kind of its own, all refusing past two requests (or one slot)
/// of a client on a clock that does not move.
const RULES: &str = r#"control_plane: { url: "http://127.0.0.1:1", report_interval: 100ms, stale_after: 1h }
rules:
  - name: tb
    match: { path_prefix: /tb }
    key: [header:x-client]
    limit: { rate: 1/h, burst: 2 }
    cost: { header: x-cost, default: 1, max: 100, from: any }
  - name: gcra
    match: { path_prefix: /gcra }
    key: [header:x-client]
    limit: { rate: 1/h, burst: 2, algorithm: gcra }
  - name: leaky
    match: { path_prefix: /leaky }
    key: [header:x-client]
    limit: { rate: 1/h, burst: 3, algorithm: leaky_bucket }
    max_delay: 2s
  - name: fixed
    match: { path_prefix: /fixed }
    key: [client_ip, header:x-client]
    limit: { rate: 2/h, algorithm: fixed_window }
  - name: log
    match: { path_prefix: /log }
    key: [header:x-client]
    limit: { rate: 2/h, algorithm: sliding_window_log }
  - name: counter
    match: { path_prefix: /counter }
    key: [header:x-client]
    limit: { rate: 2/h, algorithm: sliding_window_counter }
  - name: watching
    match: { path_prefix: /counter }
    key: [header:x-client]
    limit: { rate: 1/h, burst: 1 }
    mode: shadow
  - name: fleet
    match: { path_prefix: /fleet }
    key: [header:x-client]
    limit: { rate: 1/h }
    scope: global
  - name: slots
    match: { path_prefix: /hold }
    key: [header:x-client]
    limit: { concurrency: 1 }
  - name: app
    match: { path_prefix: /hold }
    key: []
    limit: { adaptive: { min: 1, max: 1 } }
"#;

/// `/explain`'s answer for `path` with `headers`.
async fn explain(
    admin: std::net::SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> serde_json::Value {
    let fields: Vec<[&str; 2]> = headers.iter().map(|(k, v)| [*k, *v]).collect();
    let body = serde_json::json!({ "path": path, "headers": fields }).to_string();
    let req = Request::post(format!("http://{admin}/explain"))
        .body(BodyExt::boxed(
            http_body_util::Full::new(bytes::Bytes::from(body)).map_err(|never| match never {}),
        ))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap()
}

/// The status an explanation says the request gets.
fn status_of(e: &serde_json::Value) -> StatusCode {
    match e["decision"].as_str().unwrap() {
        "admit" => StatusCode::OK,
        "refuse" => StatusCode::TOO_MANY_REQUESTS,
        "bad_request" => StatusCode::BAD_REQUEST,
        other => panic!("decision {other}"),
    }
}

#[tokio::test]
async fn an_explanation_matches_the_next_real_decision_for_every_rule_kind_and_takes_nothing() {
    let (sc, _up, _clock) = sidecar_with_clock(RULES).await;
    let alice = [("x-client", "alice")];
    for (path, admits) in [
        ("/tb", 2),
        ("/gcra", 2),
        ("/leaky", 1),
        ("/fixed", 2),
        ("/log", 2),
        ("/counter", 2),
        ("/fleet", 1),
    ] {
        let mut admitted = 0;
        for _ in 0..4 {
            // Asked twice: an explanation that took units would leave the second one, and
            // the real request, a different answer.
            let first = explain(sc.admin_addr(), path, &alice).await;
            let e = explain(sc.admin_addr(), path, &alice).await;
            assert_eq!(first["decision"], e["decision"], "{path}: {e}");
            let (status, headers, _) = get(sc.addr(), path, &alice).await;
            assert_eq!(status, status_of(&e), "{path}: explained {e:#}");
            if status == StatusCode::OK {
                admitted += 1;
            } else {
                assert_eq!(
                    e["by"].as_str(),
                    headers
                        .get("ratelimit-policy")
                        .and_then(|p| p.to_str().ok())
                        .and_then(|p| p.split(';').next())
                        .map(|n| n.trim_matches('"')),
                    "{path}: the refusing rule"
                );
                assert_eq!(
                    e["retry_after_s"]
                        .as_u64()
                        .map(|s| s.to_string())
                        .as_deref(),
                    headers.get("retry-after").and_then(|r| r.to_str().ok()),
                    "{path}: Retry-After"
                );
            }
        }
        assert_eq!(admitted, admits, "{path}: what the rule itself allows");
    }
    // The shadow rule refuses past one, and says so without deciding.
    let e = explain(sc.admin_addr(), "/counter", &[("x-client", "bob")]).await;
    let watching = e["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"] == "watching")
        .unwrap();
    assert_eq!(watching["decision"], "admit");
    assert_eq!(
        get(sc.addr(), "/counter", &[("x-client", "bob")]).await.0,
        StatusCode::OK
    );
    let e = explain(sc.admin_addr(), "/counter", &[("x-client", "bob")]).await;
    let watching = e["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"] == "watching")
        .unwrap();
    assert_eq!(watching["decision"], "refuse");
    assert_eq!(watching["mode"], "shadow");
    assert_eq!(e["decision"], "admit");
    assert_eq!(
        get(sc.addr(), "/counter", &[("x-client", "bob")]).await.0,
        StatusCode::OK
    );
    // A cost the rule cannot read: 400, named.
    let bad = [("x-client", "carol"), ("x-cost", "many")];
    let e = explain(sc.admin_addr(), "/tb", &bad).await;
    assert_eq!(e["decision"], "bad_request");
    assert_eq!(e["by"], "tb");
    assert_eq!(get(sc.addr(), "/tb", &bad).await.0, StatusCode::BAD_REQUEST);
    // A request no rule matches, and one without the key's header: admitted, each rule says why.
    let e = explain(sc.admin_addr(), "/other", &alice).await;
    assert_eq!(e["decision"], "admit");
    assert!(e["rules"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["decision"] == "not_matched"));
    let e = explain(sc.admin_addr(), "/tb", &[]).await;
    assert_eq!(e["rules"][0]["decision"], "no_key");
}

#[tokio::test]
async fn concurrency_and_adaptive_slots_are_explained_as_they_are_held() {
    let (sc, up, _clock) = sidecar_with_clock(RULES).await;
    let alice = [("x-client", "alice")];
    let e = explain(sc.admin_addr(), "/hold", &alice).await;
    assert_eq!(e["decision"], "admit", "{e:#}");
    let held_at = up.signals.held.notified();
    let addr = sc.addr();
    let held = tokio::spawn(async move { get(addr, "/hold", &[("x-client", "alice")]).await });
    tokio::time::timeout(Duration::from_secs(10), held_at)
        .await
        .expect("the app holds a request");
    let e = explain(sc.admin_addr(), "/hold", &alice).await;
    assert_eq!(e["decision"], "refuse", "{e:#}");
    assert_eq!(e["by"], "slots");
    assert_eq!(
        e["rules"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["decision"] == "refuse")
            .count(),
        2
    );
    assert_eq!(e["rules"][8]["state"]["in_flight"], 1);
    // Another client has a slot of its own in `slots`, but not in the shared adaptive limit.
    let e = explain(sc.admin_addr(), "/hold", &[("x-client", "bob")]).await;
    assert_eq!(e["by"], "app", "{e:#}");
    // An adaptive limit refuses for capacity: 503.
    assert_eq!(
        get(sc.addr(), "/hold", &[("x-client", "bob")]).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    up.signals.release.notify_one();
    assert_eq!(held.await.unwrap().0, StatusCode::OK);
    let e = explain(sc.admin_addr(), "/hold", &alice).await;
    assert_eq!(e["decision"], "admit", "{e:#}");
}

#[tokio::test]
async fn top_lists_keys_from_the_stores_and_a_digested_key_never_in_clear() {
    let (sc, _up, _clock) = sidecar_with_clock(RULES).await;
    for _ in 0..3 {
        get(sc.addr(), "/tb", &[("x-client", "alice-secret")]).await;
    }
    get(sc.addr(), "/tb", &[("x-client", "bob-secret")]).await;
    let (status, text) = admin(&sc, "/top?n=5").await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(
        !text.contains("alice-secret") && !text.contains("bob-secret"),
        "{text}"
    );
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tb = doc["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"] == "tb")
        .unwrap();
    assert_eq!(tb["keys"], 2);
    // The refused key first, as explain names it.
    let first = &tb["top"][0];
    assert_eq!(first["limited"], true);
    let e = explain(sc.admin_addr(), "/tb", &[("x-client", "alice-secret")]).await;
    assert_eq!(first["key"], e["rules"][0]["stored"], "{e:#}");
    assert_eq!(tb["top"][1]["limited"], false);
    // And the keys refused lately: alice's one refusal.
    assert_eq!(tb["refused"][0]["key"], first["key"]);
    assert_eq!(tb["refused"][0]["refusals"], 1);
    assert_eq!(tb["refused"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn the_command_line_explains_from_a_sidecar_and_offline_from_a_file_or_a_saved_config() {
    let (sc, _up, _clock) = sidecar_with_clock(RULES).await;
    let admin_addr = sc.admin_addr().to_string();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(BIN).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let args = [
        "explain",
        "--admin",
        &admin_addr,
        "-H",
        "x-client: alice",
        "/tb",
    ];
    let (code, out, err) = tokio::task::spawn_blocking({
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        move || run(&args.iter().map(String::as_str).collect::<Vec<_>>())
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.starts_with("decision: admit"), "{out}");
    assert!(out.contains("- tb (local, enforce): admit"), "{out}");
    // Offline, from the YAML and from what /config served: the rule and its key, no state.
    let (_, config_json) = admin(&sc, "/config").await;
    let saved = temp_file(&format!("explain-{}.json", fastrand::u32(..)), &config_json);
    let yaml = temp_file(
        &format!("explain-{}.yaml", fastrand::u32(..)),
        &format!("service: test\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:9\n{RULES}"),
    );
    for file in [&yaml, &saved] {
        let file = file.display().to_string();
        let (code, out, err) = tokio::task::spawn_blocking(move || {
            run(&[
                "explain",
                "--json",
                "--config",
                &file,
                "-H",
                "x-client: alice",
                "/tb",
            ])
        })
        .await
        .unwrap();
        assert_eq!(code, Some(0), "{err}");
        let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(doc["offline"], true);
        assert_eq!(doc["rules"][0]["decision"], "applies", "{doc:#}");
        assert_eq!(
            doc["rules"][0]["key"],
            digest_of_builtin("alice"),
            "{doc:#}"
        );
        assert!(doc["rules"][0].get("state").is_none());
    }
    // No sidecar there: a clear error, exit 2.
    let (code, _, err) =
        tokio::task::spawn_blocking(move || run(&["explain", "--admin", "127.0.0.1:1", "/"]))
            .await
            .unwrap();
    assert_eq!(code, Some(2));
    assert!(err.contains("127.0.0.1:1"), "{err}");
}

/// `spillway digest`'s digest of `value` under the built-in secret.
fn digest_of_builtin(value: &str) -> String {
    let out = std::process::Command::new(BIN)
        .args(["digest", value])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test]
async fn the_log_filter_of_a_running_proxy_is_read_and_changed_and_a_bad_one_refused() {
    let up = upstream().await;
    let config = temp_file(
        &format!("loglevel-{}.yaml", fastrand::u32(..)),
        &format!(
            "service: logs\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{}\nrules:\n  - name: one\n    key: [header:x-client]\n    limit: {{ rate: 1/h, burst: 1 }}\n",
            up.addr
        ),
    );
    let err = temp_file(&format!("loglevel-{}.err", fastrand::u32(..)), "");
    let mut child = std::process::Command::new(BIN)
        .args(["proxy", "--config"])
        .arg(&config)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let field = |after: &str| {
        line.split(after)
            .nth(1)
            .and_then(|r| r.split([' ', ')']).next())
            .unwrap()
            .trim()
            .to_string()
    };
    let (addr, admin_addr) = (field("listening on ").parse().unwrap(), field("(admin "));
    let level = |args: &[&str]| {
        let out = std::process::Command::new(BIN)
            .args(["log-level", "--admin", &admin_addr])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    };
    assert_eq!(level(&[]), (Some(0), "info".to_string()));
    let refused = |who: &'static str| async move {
        get(addr, "/", &[("x-client", who)]).await;
        assert_eq!(
            get(addr, "/", &[("x-client", who)]).await.0,
            StatusCode::TOO_MANY_REQUESTS
        );
    };
    refused("alice").await;
    assert_eq!(level(&["warn"]), (Some(0), "warn".to_string()));
    refused("bob").await;
    assert_eq!(level(&["spillway=["]).0, Some(2));
    assert_eq!(level(&[]), (Some(0), "warn".to_string()));
    assert_eq!(level(&["info"]).0, Some(0));
    refused("carol").await;
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&err).unwrap();
    let rejections = text
        .lines()
        .filter(|l| l.contains("request refused by a rule"))
        .count();
    // alice's and carol's, not bob's (logged while the filter said warn).
    assert_eq!(rejections, 2, "{text}");
}
