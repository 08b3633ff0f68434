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
        Self::start_with(name, openmetrics, None)
    }

    /// The same, serving HTTPS with the certificate in `tls` (from [`test_ca`]).
    fn start_with(name: &str, openmetrics: &str, tls: Option<&Path>) -> Prometheus {
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
        let mut cmd = std::process::Command::new("prometheus");
        if let Some(tls) = tls {
            std::fs::write(
                dir.join("web.yml"),
                format!(
                    "tls_server_config:\n  cert_file: {}\n  key_file: {}\n",
                    tls.join("server.crt").display(),
                    tls.join("server.key").display()
                ),
            )
            .unwrap();
            cmd.arg(format!(
                "--web.config.file={}",
                dir.join("web.yml").display()
            ));
        }
        let scheme = if tls.is_some() { "https" } else { "http" };
        let child = cmd
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
            url: format!("{scheme}://127.0.0.1:{port}"),
            dir,
        };
        prom.wait_ready();
        prom
    }

    /// Polls `/-/ready` (Prometheus's readiness signal), bounded: 30 s.
    fn wait_ready(&self) {
        for _ in 0..600 {
            let ok = std::process::Command::new("curl")
                .args(["-sfk", &format!("{}/-/ready", self.url)])
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
    allowed(5.0)
}

/// OpenMetrics text: `spillway_requests_total{rule,decision}` counters of service shop's one
/// replica, one sample a minute, for `days` days per rule, ending now.
fn history(rules: &[(&str, u64, Shape)]) -> String {
    let series: Vec<Series> = rules
        .iter()
        .map(|&(rule, days, shape)| ("shop", "pod-a", rule, days, shape))
        .collect();
    history_of(&series)
}

/// (service, instance, rule, days, shape); the service as `namespace/service`, or alone to
/// run in the namespace of its name.
type Series<'a> = (&'a str, &'a str, &'a str, u64, Shape);

/// OpenMetrics text: `spillway_requests_total{namespace,spillway_service,instance,rule,decision}`
/// counters, one sample a minute, for `days` days per series, ending now.
fn history_of(series: &[Series]) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let now = now - now % STEP - STEP;
    let mut out = String::from(
        "# HELP spillway_requests Rule decisions.\n# TYPE spillway_requests counter\n",
    );
    for (service, instance, rule, days, shape) in series {
        let (namespace, service) = service.split_once('/').unwrap_or((service, service));
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
                    "spillway_requests_total{{namespace=\"{namespace}\",spillway_service=\"{service}\",instance=\"{instance}\",rule=\"{rule}\",decision=\"{decision}\"}} {total} {t}"
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

/// `spillway tune --config <config> --prometheus <prometheus> --namespace shop` and `more`:
/// whether it succeeded, its output, its errors.
fn tune(config: &Path, prometheus: &str, more: &[&str]) -> (bool, String, String) {
    let config = config.to_str().unwrap();
    run_tune(
        &[
            &["--config", config, "--prometheus", prometheus][..],
            &["--namespace", "shop"],
            more,
        ]
        .concat(),
    )
}

fn run_tune(args: &[&str]) -> (bool, String, String) {
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
    let (ok, table, err) = tune(
        &config,
        &prom.url,
        &["--margin", "25%", "--write", tuned.to_str().unwrap()],
    );
    assert!(ok, "{err}\n{table}");
    let checkout = row(&table, "checkout");
    assert!(
        checkout.contains("| 90/s | 80.0/s per replica |"),
        "{checkout}"
    );
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
        spillway::internal::config::Mode::Shadow,
        "changed rules go to shadow"
    );
    assert_eq!(
        c.rules[1].mode,
        spillway::internal::config::Mode::Enforce,
        "young is untouched"
    );

    // p99 ignores the ten minutes a day: 50/s + 25 % = 63/s, lower than 90/s.
    let (ok, table, err) = tune(&config, &prom.url, &["--quantile", "p99"]);
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
    let (ok, table, err) = run_tune(&[
        "--promote",
        config.to_str().unwrap(),
        "--prometheus",
        &prom.url,
        "--namespace",
        "shop",
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
    assert_eq!(mode("search"), spillway::internal::config::Mode::Enforce);
    assert_eq!(mode("login"), spillway::internal::config::Mode::Shadow);
}

/// 125 000/s: what a pod of another team exported as shop's.
fn forged(_: u64) -> [(&'static str, f64); 3] {
    allowed(125_000.0)
}

/// 1 000/s: shop's own, twenty times its limit.
fn surge(_: u64) -> [(&'static str, f64); 3] {
    allowed(1_000.0)
}

const SMALL: &str = "service: shop
listen: 127.0.0.1:0
upstream: http://127.0.0.1:1
rules:
  - name: checkout
    key: []
    limit: { rate: 10/s }
  - name: export
    key: []
    limit: { rate: 50/s }
";

#[test]
fn tune_reads_only_the_services_namespace_and_refuses_a_tenfold_raise_unless_asked() {
    // Shop's checkout runs at 8/s in namespace shop; a pod in namespace evil exports series
    // labelled spillway_service="shop" at 125 000/s. Shop's export really runs at 1 000/s.
    let prom = Prometheus::start(
        "forged",
        &history_of(&[
            ("shop", "pod-a", "checkout", 21, |_| allowed(8.0)),
            ("evil/shop", "pod-x", "checkout", 21, forged),
            ("shop", "pod-a", "export", 21, surge),
        ]),
    );
    let config = file(&prom.dir, "small.yaml", SMALL);
    let (ok, table, err) = tune(&config, &prom.url, &[]);
    assert!(ok, "{err}\n{table}");
    // 8/s + 25 % = 10/s: the forged series is not read.
    assert!(
        row(&table, "checkout").contains("| 8.0/s per replica |")
            && row(&table, "checkout").contains("unchanged"),
        "{table}"
    );
    // 1 000/s + 25 % = about 1 250/s, 25 times 50/s: refused, said, not written.
    let export = row(&table, "export");
    assert!(
        export.contains("skipped: 125") && export.contains("/s would raise it 25.0x, past 10x"),
        "{export}"
    );
    assert!(!table.contains("WARNING: this RAISES"), "{table}");
    let (ok, table, err) = tune(&config, &prom.url, &["--allow-raise"]);
    assert!(ok, "{err}");
    assert!(row(&table, "export").contains("/s | RAISE +24"), "{table}");

    // Without a namespace, it is asked for; with --all-namespaces the forged series counts.
    let anywhere = |more: &[&str]| {
        let config = config.to_str().unwrap();
        run_tune(&[&["--config", config, "--prometheus", &prom.url][..], more].concat())
    };
    let (ok, _, err) = anywhere(&[]);
    assert!(!ok && err.contains("--namespace"), "{err}");
    let (ok, _, err) = anywhere(&["--namespace", "Shop\"}"]);
    assert!(!ok && err.contains("not a namespace name"), "{err}");
    let (ok, table, err) = anywhere(&["--all-namespaces"]);
    assert!(ok, "{err}");
    assert!(
        row(&table, "checkout").contains("125000.0/s per replica")
            && row(&table, "checkout").contains("past 10x"),
        "{table}"
    );
}

#[test]
fn tune_says_what_is_wrong_when_prometheus_is_not_there() {
    let dir = std::env::temp_dir().join(format!("spillway-tune-none-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = file(&dir, "spillway.yaml", CONFIG);
    let (ok, _, err) = tune(&config, "http://127.0.0.1:1", &[]);
    assert!(!ok);
    assert!(
        err.contains("cannot reach Prometheus at http://127.0.0.1:1"),
        "{err}"
    );
    let (ok, _, err) = tune(&config, "ftp://x", &[]);
    assert!(!ok);
    assert!(
        err.contains("expected http://host:port or https://host:port"),
        "{err}"
    );
}

/// 50/s steady.
fn fifty(_: u64) -> [(&'static str, f64); 3] {
    allowed(50.0)
}

/// 500/s steady: another service's rule of the same name.
fn busy(_: u64) -> [(&'static str, f64); 3] {
    allowed(500.0)
}

/// `rate` requests/s, all allowed.
fn allowed(rate: f64) -> [(&'static str, f64); 3] {
    [
        ("allowed", rate),
        ("rejected", 0.0),
        ("shadow_rejected", 0.0),
    ]
}

const FLEET_CONFIG: &str = "service: shop
listen: 127.0.0.1:0
upstream: http://127.0.0.1:1
control_plane: { url: 'http://127.0.0.1:1' }
rules:
  - name: checkout
    key: []
    limit: { rate: 200/s }
  - name: fleet-checkout
    key: []
    limit: { rate: 200/s }
    scope: global
";

#[test]
fn tune_proposes_per_replica_for_local_rules_per_fleet_for_global_ones_and_per_service() {
    // Two replicas of shop (one peaking at 80/s ten minutes every other day), and books, whose
    // rules share shop's names, ten times busier. Prometheus serves HTTPS.
    let ca = test_ca("prometheus");
    let prom = Prometheus::start_with(
        "replicas",
        &history_of(&[
            ("shop", "pod-a", "checkout", 21, checkout),
            ("shop", "pod-b", "checkout", 21, fifty),
            ("books", "pod-c", "checkout", 21, busy),
            ("shop", "pod-a", "fleet-checkout", 21, fifty),
            ("shop", "pod-b", "fleet-checkout", 21, fifty),
            ("books", "pod-c", "fleet-checkout", 21, busy),
        ]),
        Some(&ca),
    );
    let config = file(&prom.dir, "fleet.yaml", FLEET_CONFIG);
    let ca_file = ca.join("ca.crt");
    let (ok, table, err) = tune(
        &config,
        &prom.url,
        &["--ca-file", ca_file.to_str().unwrap()],
    );
    assert!(ok, "{err}\n{table}");
    // Local: the busiest replica's 80/s + 25 %, not the fleet's 130/s nor books' 500/s.
    let local = row(&table, "checkout");
    assert!(local.contains("| 80.0/s per replica |"), "{local}");
    assert!(local.contains("| 100/s | lower -50 %"), "{local}");
    // Global: the fleet's 100/s + 25 %, without books.
    let global = row(&table, "fleet-checkout");
    assert!(global.contains("| 100.0/s |"), "{global}");
    assert!(global.contains("| 125/s |"), "{global}");

    // --selector narrows further: no instance matches, so there is no traffic.
    let (ok, table, err) = tune(
        &config,
        &prom.url,
        &[
            "--ca-file",
            ca_file.to_str().unwrap(),
            "--selector",
            "instance=\"pod-z\"",
        ],
    );
    assert!(ok, "{err}");
    assert!(
        row(&table, "checkout").contains("skipped: only 0m of history"),
        "{table}"
    );

    // Without the CA, the certificate is not trusted: said, not ignored.
    let (ok, _, err) = tune(&config, &prom.url, &[]);
    assert!(!ok);
    assert!(err.contains("cannot reach Prometheus"), "{err}");
}

#[test]
fn tune_sends_the_bearer_token_to_prometheus_or_the_proxy_in_front_of_it() {
    use std::io::{Read, Write};
    // What stands in front of Prometheus here refuses everyone and keeps what it was sent.
    let front = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = front.local_addr().unwrap();
    let seen = std::thread::spawn(move || {
        let (mut s, _) = front.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        let body = r#"{"status":"error","error":"bad token"}"#;
        let _ = write!(
            s,
            "HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        String::from_utf8_lossy(&head).to_lowercase()
    });
    let dir = std::env::temp_dir().join(format!("spillway-tune-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = file(&dir, "spillway.yaml", CONFIG);
    let token = file(&dir, "token", "s3cret\n");
    let (ok, _, err) = tune(
        &config,
        &format!("http://{addr}"),
        &["--bearer-token-file", token.to_str().unwrap()],
    );
    assert!(!ok);
    assert!(err.contains("401") && err.contains("bad token"), "{err}");
    let head = seen.join().unwrap();
    assert!(head.contains("authorization: bearer s3cret\r\n"), "{head}");
}
