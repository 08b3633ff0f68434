//! Logs as a log collector reads them: `--log-format json` gives one object a line, text has
//! no colour codes when stderr is not a terminal, and a rule's rejections are logged (rule,
//! decision, key, client, method, path, `traceparent`, units) within `log_rejections` lines a
//! second.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::*;

/// Runs the proxy with `format` and a rule that refuses all but the first request of each
/// key, sends `n` requests, and returns what it wrote to stderr.
async fn stderr_of(format: &str, n: usize) -> String {
    stderr_with(format, n, "", "").await.0
}

/// [`stderr_of`] with `top` added to the configuration and `rule` to its rule; also the
/// configuration's path.
async fn stderr_with(
    format: &str,
    n: usize,
    top: &str,
    rule: &str,
) -> (String, std::path::PathBuf) {
    let up = upstream().await;
    let config = temp_file(
        &format!("logs-{format}-{}.yaml", fastrand::u32(..)),
        &format!(
            "service: logs\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{}\nlog_rejections: 3\n{top}rules:\n  - name: one-per-hour\n    key: [header:x-client]\n    limit: {{ rate: 1/h, burst: 1 }}\n{rule}",
            up.addr
        ),
    );
    let err = temp_file(&format!("logs-{format}-{}.err", fastrand::u32(..)), "");
    let mut child = Command::new(BIN)
        .args(["--log-format", format, "proxy", "--config"])
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("listening on ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap_or_else(|| panic!("no readiness line: {line:?}"))
        .parse()
        .unwrap();
    let trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    for _ in 0..n {
        get(
            addr,
            "/api/x",
            &[("x-client", "alice"), ("traceparent", trace)],
        )
        .await;
    }
    let _ = child.kill();
    let _ = child.wait();
    (std::fs::read_to_string(&err).unwrap(), config)
}

/// What `spillway digest` prints for `value` with `args`.
fn digest_of(args: &[&str], value: &str) -> String {
    let out = Command::new(BIN)
        .arg("digest")
        .args(args)
        .arg(value)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The keys of the rejections logged in JSON `text`.
fn logged_keys(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l["target"] == "spillway::rejection")
        .map(|l| l["key"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test]
async fn a_key_from_a_header_is_logged_as_the_digest_support_can_compute_never_in_clear() {
    let secret = temp_file(
        &format!("logs-secret-{}", fastrand::u32(..)),
        "5f0c6c0ad7a54a5b8d1e3c2f9a7b6e41\n",
    );
    let top = format!("key_secret_file: {}\n", secret.display());
    let (text, config) = stderr_with("json", 3, &top, "").await;
    let keys = logged_keys(&text);
    assert!(!keys.is_empty(), "no rejection logged: {text}");
    assert!(!text.contains("alice"), "the key in clear: {text}");
    let want = digest_of(&["--config", config.to_str().unwrap()], "alice");
    assert!(want.starts_with('~') && want.len() == 33, "{want}");
    assert!(keys.iter().all(|k| *k == want), "{keys:?} vs {want}");
    // The same from the secret file itself; another secret, another digest.
    assert_eq!(
        digest_of(&["--secret-file", secret.to_str().unwrap()], "alice"),
        want
    );
    assert_ne!(digest_of(&[], "alice"), want);
    // `log_keys: clear` opts the rule out.
    let (text, _) = stderr_with("json", 3, &top, "    log_keys: clear\n").await;
    let keys = logged_keys(&text);
    assert!(
        !keys.is_empty() && keys.iter().all(|k| k == "alice"),
        "{keys:?}"
    );
    // A secret too short to be one is refused at start, naming the file.
    let short = temp_file(&format!("logs-short-{}", fastrand::u32(..)), "abc\n");
    let out = Command::new(BIN)
        .args(["check-config"])
        .arg(temp_file(
            &format!("logs-short-{}.yaml", fastrand::u32(..)),
            &format!(
                "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nkey_secret_file: {}\n",
                short.display()
            ),
        ))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("at least 16") && err.contains(&short.display().to_string()),
        "{err}"
    );
}

#[tokio::test]
async fn json_logs_carry_each_rejection_within_the_rules_budget() {
    let text = stderr_of("json", 40).await;
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect();
    let rejections: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["target"] == "spillway::rejection")
        .collect();
    assert!(!rejections.is_empty(), "no rejection logged: {text}");
    for r in &rejections {
        assert_eq!(r["rule"], "one-per-hour");
        assert_eq!(r["decision"], "rejected");
        // The built-in secret's digest (no key_secret_file): never the value.
        assert_eq!(r["key"], digest_of(&[], "alice").as_str());
        assert_eq!(r["client"], "127.0.0.1");
        assert_eq!(r["method"], "GET");
        assert_eq!(r["path"], "/api/x");
        assert_eq!(
            r["traceparent"],
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
    }
    // At most 3 a second. The budget counts seconds of the monotonic clock, which need not
    // turn with the wall clock: a wall-clock second holds at most two budgets.
    let mut per_second = std::collections::HashMap::<String, usize>::new();
    for r in &rejections {
        let ts = r["timestamp"].as_str().unwrap_or_default();
        *per_second
            .entry(ts.get(..19).unwrap_or(ts).to_string())
            .or_default() += 1;
    }
    assert!(per_second.values().all(|&n| n <= 6), "{per_second:?}");
    assert!(rejections.len() < 39, "every one of 39 rejections logged");
}

#[tokio::test]
async fn text_logs_have_no_colour_codes_when_not_on_a_terminal() {
    let text = stderr_of("text", 3).await;
    assert!(text.contains("request refused by a rule"), "{text}");
    assert!(!text.contains('\u{1b}'), "escape codes in {text:?}");
}

#[tokio::test]
async fn a_rejection_by_a_response_cost_says_the_units_the_key_owes() {
    // The app's "ok" is 2 bytes against a budget of 1: the key owes 1 once it has answered.
    let (text, _) = stderr_with(
        "json",
        3,
        "",
        "    cost: { response: body_bytes, reserve: 0, max: 1000 }\n",
    )
    .await;
    let rejection = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["target"] == "spillway::rejection")
        .unwrap_or_else(|| panic!("no rejection logged: {text}"));
    assert_eq!(rejection["rule"], "one-per-hour");
    assert_eq!(rejection["units"], 0, "the reservation: {rejection}");
    assert_eq!(rejection["owed"], 1, "{rejection}");
}
