//! Hot reload: state kept for unchanged rules, fresh for changed ones; a bad file changes
//! nothing; a ConfigMap-style symlink swap and SIGHUP are both seen.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use http::StatusCode;
use spillway::{Config, Sidecar};

/// A config file of this test's own in a fresh directory.
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("spillway-reload-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn yaml(up: std::net::SocketAddr, rules: &str) -> String {
    format!("service: t\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{up}\nrules:\n{rules}")
}

fn rule(name: &str, rate: &str) -> String {
    format!("  - name: {name}\n    match: {{ path_prefix: /{name} }}\n    key: [header:x-client]\n    limit: {{ rate: {rate} }}\n")
}

/// The sidecar for the file at `path`; watching it when `watch` (tests that reload by hand
/// do not watch, so that the watcher cannot reload first).
async fn start(path: &Path, watch: bool) -> Sidecar {
    let text = std::fs::read_to_string(path).unwrap();
    let config = Config::from_yaml(&text, &path.display().to_string()).unwrap();
    let sc = Sidecar::start(config).await.unwrap();
    if watch {
        sc.watch_file(path.to_path_buf(), &text).unwrap();
    }
    sc
}

async fn status(sc: &Sidecar, path: &str) -> StatusCode {
    get(sc.addr(), path, &[("x-client", "c")]).await.0
}

/// Polls (bounded: 10 s) until the active version is not `old`: the reload's own signal.
async fn reloaded_from(sc: &Sidecar, old: &str) -> String {
    for _ in 0..500 {
        let v = sc.loaded().version.clone();
        if v != old {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no reload within 10 s");
}

#[tokio::test]
async fn a_reload_keeps_the_state_of_unchanged_rules_and_resets_changed_ones() {
    let up = upstream().await;
    let d = dir("keep");
    let path = d.join("spillway.yaml");
    let first = yaml(up.addr, &(rule("a", "1/h") + &rule("b", "1/h")));
    std::fs::write(&path, &first).unwrap();
    let sc = start(&path, false).await;
    for p in ["/a", "/b"] {
        assert_eq!(status(&sc, p).await, StatusCode::OK);
        assert_eq!(status(&sc, p).await, StatusCode::TOO_MANY_REQUESTS);
    }
    // b's limit changes, c is new, a is untouched but for its match (not part of its state).
    let second = yaml(
        up.addr,
        &(rule("a", "1/h").replace("path_prefix: /a", "path_prefix: /a/")
            + &rule("b", "2/h")
            + &rule("c", "1/h")),
    );
    std::fs::write(&path, &second).unwrap();
    let r = sc.reload_file(&path).await.unwrap();
    assert_eq!(r.kept, ["a"]);
    assert_eq!(r.fresh, ["b", "c"]);
    assert!(r.pending_restart.is_empty(), "{:?}", r.pending_restart);
    assert_eq!(
        status(&sc, "/a/x").await,
        StatusCode::TOO_MANY_REQUESTS,
        "a kept its spent bucket"
    );
    assert_eq!(status(&sc, "/b").await, StatusCode::OK, "b starts fresh");
    assert_eq!(
        status(&sc, "/b").await,
        StatusCode::OK,
        "with its new limit of 2"
    );
    assert_eq!(status(&sc, "/b").await, StatusCode::TOO_MANY_REQUESTS);
    let (_, config) = admin(&sc, "/config").await;
    let doc: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(doc["version"], r.version.as_str());
    assert_eq!(doc["rules"][1]["limit"]["rate"], "2/h");
    assert!(doc["loaded_at"].as_f64().unwrap() > 1.7e9);
    let (_, m) = admin(&sc, "/metrics").await;
    assert_eq!(
        metric(&m, "spillway_config_reloads_total{result=\"ok\"}"),
        Some(1.0)
    );
    // The keys gauge follows the swap: b's old key went with its old state.
    assert_eq!(metric(&m, "spillway_keys{rule=\"b\"}"), Some(1.0));
}

#[tokio::test]
async fn a_bad_file_changes_nothing_and_says_where_it_is_wrong() {
    let up = upstream().await;
    let d = dir("bad");
    let path = d.join("spillway.yaml");
    std::fs::write(&path, yaml(up.addr, &rule("a", "1/h"))).unwrap();
    let sc = start(&path, false).await;
    let before = sc.loaded().version.clone();
    assert_eq!(status(&sc, "/a").await, StatusCode::OK);
    std::fs::write(&path, yaml(up.addr, &rule("a", "often"))).unwrap();
    let e = sc.reload_file(&path).await.unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("{}:9:", path.display())) && e.contains("rules[0].limit.rate"),
        "{e}"
    );
    assert_eq!(sc.loaded().version, before);
    assert_eq!(
        status(&sc, "/a").await,
        StatusCode::TOO_MANY_REQUESTS,
        "the old rule still runs, with its state"
    );
    let (_, m) = admin(&sc, "/metrics").await;
    assert_eq!(
        metric(&m, "spillway_config_reloads_total{result=\"error\"}"),
        Some(1.0)
    );
    // An alert can tell a bad file still in place from one that was fixed.
    assert_eq!(
        metric(&m, "spillway_config_last_reload_successful"),
        Some(0.0)
    );
    std::fs::write(&path, yaml(up.addr, &rule("a", "1/h"))).unwrap();
    sc.reload_file(&path).await.unwrap();
    let (_, m) = admin(&sc, "/metrics").await;
    assert_eq!(
        metric(&m, "spillway_config_last_reload_successful"),
        Some(1.0)
    );
    // A file that vanished is an error too, not a crash.
    std::fs::remove_file(&path).unwrap();
    assert!(sc
        .reload_file(&path)
        .await
        .unwrap_err()
        .to_string()
        .contains("cannot read"));
}

#[tokio::test]
async fn settings_a_reload_cannot_apply_are_reported_and_keep_running() {
    let up = upstream().await;
    let d = dir("restart");
    let path = d.join("spillway.yaml");
    std::fs::write(&path, yaml(up.addr, &rule("a", "1/h"))).unwrap();
    let sc = start(&path, false).await;
    let changed = yaml(up.addr, &rule("a", "1/h")).replace(
        "rules:",
        "hosts: [app]\ntrusted_headers: [x-plan]\nkey_secret_file: /run/other-secret\ntimeouts: { upstream_response: 3s }\nworkers: 1\nrules:",
    );
    std::fs::write(&path, changed).unwrap();
    let r = sc.reload_file(&path).await.unwrap();
    // A new key secret would rename every key in logs and reports mid-run: a restart's.
    assert_eq!(
        r.pending_restart,
        [
            "hosts",
            "trusted_headers",
            "key_secret_file",
            "timeouts",
            "workers"
        ]
    );
    assert_eq!(r.kept, ["a"]);
    let (_, config) = admin(&sc, "/config").await;
    let doc: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(doc["pending_restart"][3], "timeouts");
    assert_eq!(
        doc["timeouts"]["upstream_response"], "30s",
        "the running value"
    );
}

#[tokio::test]
async fn a_configmap_symlink_swap_is_seen_and_applied() {
    use std::os::unix::fs::symlink;
    let up = upstream().await;
    let d = dir("configmap");
    // What the kubelet lays out: config.yaml -> ..data/config.yaml, ..data -> ..<timestamp>.
    let v1 = d.join("..2026_11_29_v1");
    std::fs::create_dir(&v1).unwrap();
    std::fs::write(v1.join("config.yaml"), yaml(up.addr, &rule("a", "1/h"))).unwrap();
    symlink("..2026_11_29_v1", d.join("..data")).unwrap();
    symlink("..data/config.yaml", d.join("config.yaml")).unwrap();
    let path = d.join("config.yaml");
    let sc = start(&path, true).await;
    let before = sc.loaded().version.clone();
    assert_eq!(status(&sc, "/a").await, StatusCode::OK);
    assert_eq!(status(&sc, "/a").await, StatusCode::TOO_MANY_REQUESTS);

    // The update: a new timestamped directory, then ..data swapped to it by an atomic rename.
    let v2 = d.join("..2026_11_29_v2");
    std::fs::create_dir(&v2).unwrap();
    std::fs::write(v2.join("config.yaml"), yaml(up.addr, &rule("a", "5/h"))).unwrap();
    symlink("..2026_11_29_v2", d.join("..data_tmp")).unwrap();
    std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
    std::fs::remove_dir_all(&v1).unwrap();

    let after = reloaded_from(&sc, &before).await;
    assert_ne!(after, before);
    assert_eq!(
        status(&sc, "/a").await,
        StatusCode::OK,
        "the new limit, fresh state"
    );
    let (_, m) = admin(&sc, "/metrics").await;
    assert_eq!(
        metric(&m, "spillway_config_reloads_total{result=\"ok\"}"),
        Some(1.0)
    );
}

#[tokio::test]
async fn sighup_reloads_the_running_binary() {
    let up = upstream().await;
    let d = dir("sighup");
    let path = d.join("spillway.yaml");
    std::fs::write(&path, yaml(up.addr, &rule("a", "1/h"))).unwrap();
    let proc = Proc::spawn(&["proxy", "--config", path.to_str().unwrap()]);
    let reloads = || async {
        let text = get(proc.admin, "/metrics", &[]).await.2;
        metric(&text, "spillway_config_reloads_total{result=\"ok\"}").unwrap_or(0.0)
    };
    assert_eq!(reloads().await, 0.0);
    // The file is unchanged, so only the signal can make this reload happen.
    let ok = std::process::Command::new("kill")
        .args(["-HUP", &proc.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let mut seen = 0.0;
    for _ in 0..500 {
        seen = reloads().await;
        if seen >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(seen, 1.0, "SIGHUP did not reload");
    assert_eq!(
        get(proc.addr, "/", &[]).await.0,
        StatusCode::OK,
        "and it still serves"
    );
}

/// Polls (bounded: 10 s) until `spillway_config_last_reload_successful` is `want`.
async fn reload_gauge(sc: &Sidecar, want: f64) {
    for _ in 0..500 {
        let (_, m) = admin(sc, "/metrics").await;
        if metric(&m, "spillway_config_last_reload_successful") == Some(want) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("spillway_config_last_reload_successful never {want}");
}

/// The usual fix for a bad file is to put the running one back as it was: a reload that
/// finds what already runs is a good state, and the reload alert must clear.
#[tokio::test]
async fn putting_back_the_running_file_after_a_bad_one_clears_the_reload_gauge() {
    let up = upstream().await;
    let d = dir("putback");
    let path = d.join("spillway.yaml");
    let good = yaml(up.addr, &rule("a", "1/h"));
    std::fs::write(&path, &good).unwrap();
    let sc = start(&path, true).await;
    std::fs::write(&path, yaml(up.addr, &rule("a", "often"))).unwrap();
    reload_gauge(&sc, 0.0).await;
    std::fs::write(&path, &good).unwrap();
    reload_gauge(&sc, 1.0).await;
}

// Issue 47: an injected pod's sidecar takes its release's limits ConfigMap (written for the
// chart's own ports) and its own listen, admin and upstream from the command line; a reload
// of the file keeps them, and reports no restart pending for what the file says otherwise.
#[tokio::test]
async fn the_command_lines_listen_and_upstream_stand_over_the_files_through_a_reload() {
    let up = upstream().await;
    let rules = |rate: &str| {
        format!(
            "service: shop\nlisten: 127.0.0.1:1\nadmin: 127.0.0.1:2\nupstream: http://127.0.0.1:3\nrules:\n  - {{ name: all, key: [], limit: {{ rate: {rate} }} }}\n"
        )
    };
    let path = temp_file("placed.yaml", &rules("1000/s"));
    let upstream = format!("http://{}", up.addr);
    let proxy = Proc::spawn(&[
        "proxy",
        "--config",
        path.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--upstream",
        &upstream,
    ]);
    let (status, _, body) = get(proxy.addr, "/", &[]).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    let (_, _, before) = get(proxy.admin, "/config", &[]).await;
    let before: serde_json::Value = serde_json::from_str(&before).unwrap();
    std::fs::write(&path, rules("1/m")).unwrap();
    // The reload is seen in /config's version (the file is watched).
    let mut after = serde_json::Value::Null;
    for _ in 0..200 {
        let (_, _, text) = get(proxy.admin, "/config", &[]).await;
        after = serde_json::from_str(&text).unwrap();
        if after["version"] != before["version"] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_ne!(after["version"], before["version"], "no reload seen");
    assert_eq!(after["pending_restart"], serde_json::json!([]), "{after:#}");
    assert_eq!(after["upstream"], upstream.as_str(), "{after:#}");
    // The new rule runs, in front of the placed upstream.
    let (first, _, _) = get(proxy.addr, "/", &[]).await;
    let (second, _, _) = get(proxy.addr, "/", &[]).await;
    assert_eq!(
        (first, second),
        (StatusCode::OK, StatusCode::TOO_MANY_REQUESTS)
    );
}
