//! `spillway tune` and `--promote` against a real Prometheus (Debian's package, installed by
//! scripts/test when missing) whose database is filled with three weeks of synthetic history
//! through `promtool tsdb create-blocks-from openmetrics`.

mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;

const DAY: u64 = 86_400;
const STEP: u64 = 60;

/// A Prometheus of this test's own on a free loopback port, killed (by its PID) when dropped.
struct Prometheus {
    child: std::process::Child,
    url: String,
    dir: PathBuf,
}

impl Prometheus {
    /// Loads `openmetrics` into a fresh database, then serves it.
    fn start(name: &str, openmetrics: &str) -> Prometheus {
        let dir = std::env::temp_dir().join(format!("spillway-prom-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        std::fs::write(dir.join("history.om"), openmetrics).unwrap();
        let out = std::process::Command::new("promtool")
            .args(["tsdb", "create-blocks-from", "openmetrics"])
            .arg(dir.join("history.om"))
            .arg(dir.join("data"))
            .output()
            .expect("promtool (scripts/test installs the prometheus package)");
        assert!(
            out.status.success(),
            "promtool: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::write(
            dir.join("prometheus.yml"),
            "global:\n  scrape_interval: 1h\n",
        )
        .unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg("--storage.tsdb.retention.time=365d")
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("prometheus (scripts/test installs it)");
        let prom = Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            dir,
        };
        prom.wait_ready();
        prom
    }

    /// Polls `/-/ready` (Prometheus's readiness signal), bounded: 30 s.
    fn wait_ready(&self) {
        for _ in 0..600 {
            let ok = std::process::Command::new("curl")
                .args(["-sf", &format!("{}/-/ready", self.url)])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
                || ready_by_tcp(&self.url);
            if ok {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("prometheus at {} never became ready", self.url);
    }
}

/// `/-/ready` over a raw socket, for machines without curl.
fn ready_by_tcp(url: &str) -> bool {
    use std::io::{Read, Write};
    let addr = url.trim_start_matches("http://");
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(format!("GET /-/ready HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .is_err()
    {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.0 200") || buf.starts_with("HTTP/1.1 200")
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Offered requests/s of a rule at `t` (seconds since the history began), split by decision.
type Shape = fn(u64) -> [(&'static str, f64); 3];

/// 50/s, and 80/s (of which 5/s rejected) for ten minutes at 18:00 every other day: rare
/// enough (about 0.5 % of the five-minute steps) that its 99th percentile is the 50/s.
fn checkout(t: u64) -> [(&'static str, f64); 3] {
    let minute = (t % DAY) / 60;
    let peak = (t / DAY) % 2 == 0 && (18 * 60..18 * 60 + 10).contains(&minute);
    if peak {
        [
            ("allowed", 75.0),
            ("rejected", 5.0),
            ("shadow_rejected", 0.0),
        ]
    } else {
        [
            ("allowed", 50.0),
            ("rejected", 0.0),
            ("shadow_rejected", 0.0),
        ]
    }
}

/// A shadow rule that would have refused 0.5 %.
fn search(_: u64) -> [(&'static str, f64); 3] {
    [
        ("allowed", 19.9),
        ("rejected", 0.0),
        ("shadow_rejected", 0.1),
    ]
}

/// A shadow rule that would have refused 10 %.
fn login(_: u64) -> [(&'static str, f64); 3] {
    [
        ("allowed", 9.0),
        ("rejected", 0.0),
        ("shadow_rejected", 1.0),
    ]
}

fn steady(_: u64) -> [(&'static str, f64); 3] {
    [
        ("allowed", 5.0),
        ("rejected", 0.0),
        ("shadow_rejected", 0.0),
    ]
}

/// OpenMetrics text: `spillway_requests_total{rule,decision}` counters, one sample a minute,
/// for `days` days per rule, ending now.
fn history(rules: &[(&str, u64, Shape)]) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let now = now - now % STEP - STEP;
    let mut out = String::from(
        "# HELP spillway_requests Rule decisions.\n# TYPE spillway_requests counter\n",
    );
    for (rule, days, shape) in rules {
        let begin = now - days * DAY;
        for decision in ["allowed", "rejected", "shadow_rejected"] {
            let mut total = 0.0;
            let mut t = begin;
            while t <= now {
                let rate = shape(t - begin)
                    .iter()
                    .find(|(d, _)| *d == decision)
                    .map_or(0.0, |(_, r)| *r);
                total += rate * STEP as f64;
                let _ = writeln!(
                    out,
                    "spillway_requests_total{{rule=\"{rule}\",decision=\"{decision}\"}} {total} {t}"
                );
                t += STEP;
            }
        }
    }
    out.push_str("# EOF\n");
    out
}

const CONFIG: &str = "service: shop
listen: 127.0.0.1:0
upstream: http://127.0.0.1:1
rules:
  # the whole checkout API
  - name: checkout
    match: { path_prefix: /checkout }
    key: []
    limit: { rate: 90/s, burst: 120 }   # set long ago
  - name: young
    key: []
    limit: { rate: 10/s }
  - name: per-client
    key: [client_ip]
    limit: { rate: 20/s }
  - name: search
    key: []
    limit: { rate: 30/s }
    mode: shadow
  - name: login
    key: []
    limit: { rate: 10/s }
    mode: shadow
";

fn tune(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(BIN)
        .arg("tune")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn row<'a>(table: &'a str, rule: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.starts_with(&format!("| {rule} |")))
        .unwrap_or_else(|| panic!("no row for {rule} in:\n{table}"))
}

fn file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn tune_proposes_from_weeks_of_history_in_shadow_and_promote_enforces_what_is_safe() {
    let prom = Prometheus::start(
        "tune",
        &history(&[
            ("checkout", 21, checkout),
            ("young", 2, steady),
            ("per-client", 21, steady),
            ("search", 21, search),
            ("login", 21, login),
        ]),
    );
    let dir = prom.dir.clone();
    let config = file(&dir, "spillway.yaml", CONFIG);
    let tuned = dir.join("tuned.yaml");

    // max: the 80/s peak + 25 % = 100/s, a raise from 90/s, said loudly.
    let (ok, table, err) = tune(&[
        "--config",
        config.to_str().unwrap(),
        "--prometheus",
        &prom.url,
        "--margin",
        "25%",
        "--write",
        tuned.to_str().unwrap(),
    ]);
    assert!(ok, "{err}\n{table}");
    let checkout = row(&table, "checkout");
    assert!(checkout.contains("| 90/s | 80.0/s |"), "{checkout}");
    assert!(
        checkout.contains("| 100/s | RAISE +11 % (shadow first) |"),
        "{checkout}"
    );
    assert!(
        table.contains("WARNING: this RAISES the limit of checkout"),
        "{table}"
    );
    let young = row(&table, "young");
    assert!(
        young.contains("skipped: only 2d0h of history (need 7d0h)"),
        "{young}"
    );
    assert!(
        row(&table, "per-client").contains("skipped: per-key limit"),
        "{table}"
    );
    let written = std::fs::read_to_string(&tuned).unwrap();
    assert!(
        written.contains("    limit: { rate: 100/s, burst: 120 }   # set long ago\n"),
        "{written}"
    );
    assert!(
        written.contains("  # the whole checkout API\n"),
        "comments survive"
    );
    let c = spillway::Config::from_yaml(&written, "tuned").unwrap();
    assert_eq!(
        c.rules[0].mode,
        spillway::config::Mode::Shadow,
        "changed rules go to shadow"
    );
    assert_eq!(
        c.rules[1].mode,
        spillway::config::Mode::Enforce,
        "young is untouched"
    );

    // p99 ignores the ten minutes a day: 50/s + 25 % = 63/s, lower than 90/s.
    let (ok, table, err) = tune(&[
        "--config",
        config.to_str().unwrap(),
        "--prometheus",
        &prom.url,
        "--quantile",
        "p99",
    ]);
    assert!(ok, "{err}");
    let checkout = row(&table, "checkout");
    assert!(checkout.contains("| 63/s | lower -30 %"), "{checkout}");
    assert!(
        !table.contains("WARNING: this RAISES the limit of checkout"),
        "{table}"
    );
    assert!(table.contains("dry run"));

    // promote: search (0.5 % would-be rejections) to enforce; login (10 %) stays in shadow.
    let promoted = dir.join("promoted.yaml");
    let (ok, table, err) = tune(&[
        "--promote",
        config.to_str().unwrap(),
        "--prometheus",
        &prom.url,
        "--lookback",
        "21d",
        "--threshold",
        "1%",
        "--write",
        promoted.to_str().unwrap(),
    ]);
    assert!(ok, "{err}\n{table}");
    assert!(
        row(&table, "search").contains("| 0.50 % |") && row(&table, "search").contains("enforce"),
        "{table}"
    );
    assert!(
        row(&table, "login").contains("| 10.00 % |")
            && row(&table, "login").contains("stays shadow"),
        "{table}"
    );
    let c = spillway::Config::load(&promoted).unwrap();
    let mode = |n: &str| c.rules.iter().find(|r| r.name.0 == n).unwrap().mode;
    assert_eq!(mode("search"), spillway::config::Mode::Enforce);
    assert_eq!(mode("login"), spillway::config::Mode::Shadow);
}

#[test]
fn tune_says_what_is_wrong_when_prometheus_is_not_there() {
    let dir = std::env::temp_dir().join(format!("spillway-tune-none-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = file(&dir, "spillway.yaml", CONFIG);
    let (ok, _, err) = tune(&[
        "--config",
        config.to_str().unwrap(),
        "--prometheus",
        "http://127.0.0.1:1",
    ]);
    assert!(!ok);
    assert!(
        err.contains("cannot reach Prometheus at http://127.0.0.1:1"),
        "{err}"
    );
    let (ok, _, err) = tune(&[
        "--config",
        config.to_str().unwrap(),
        "--prometheus",
        "ftp://x",
    ]);
    assert!(!ok);
    assert!(err.contains("expected http://host:port"), "{err}");
}
