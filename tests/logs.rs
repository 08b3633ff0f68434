//! Logs as a log collector reads them: `--log-format json` gives one object a line, text has
//! no colour codes when stderr is not a terminal, and a rule's rejections are logged (rule,
//! decision, key, client, method, path, `traceparent`) within `log_rejections` lines a second.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::*;

/// Runs the proxy with `format` and a rule that refuses all but the first request of each
/// key, sends `n` requests, and returns what it wrote to stderr.
async fn stderr_of(format: &str, n: usize) -> String {
    let up = upstream().await;
    let config = temp_file(
        &format!("logs-{format}.yaml"),
        &format!(
            "service: logs\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{}\nlog_rejections: 3\nrules:\n  - name: one-per-hour\n    key: [header:x-client]\n    limit: {{ rate: 1/h, burst: 1 }}\n",
            up.addr
        ),
    );
    let err = temp_file(&format!("logs-{format}.err"), "");
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
    std::fs::read_to_string(&err).unwrap()
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
        assert_eq!(r["key"], "alice");
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
