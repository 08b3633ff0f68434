//! The control plane against a tenant with a token (issue 42, "What was seen"): each test is
//! what a compromised pod of one service sends, against the real controller on loopback, and
//! asserts what the other services and the controller keep.

mod common;

use std::net::SocketAddr;

use common::*;
use http::StatusCode;

/// A controller with a token per service (`shop`, `books`) and the admin's, in a process.
fn controller_with_tokens() -> Proc {
    let dir = tokens_dir();
    controller_with(&["--tokens", dir.to_str().unwrap()])
}

// 3. A service reading its own state: the heaviest keys of each rule, never every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_read_shows_each_rules_heaviest_keys_not_every_key() {
    let ctl = controller_with_tokens();
    assert_eq!(
        report(ctl.addr, "shop-t", many_keys("s1", "shop", 20_000)).await,
        StatusCode::OK
    );
    assert_eq!(
        report(ctl.addr, "books-t", many_keys("b1", "books", 3)).await,
        StatusCode::OK
    );
    let read = |token: &'static str| async move {
        let auth = format!("Bearer {token}");
        let (status, _, body) = get(ctl.addr, "/v1/state", &[("authorization", &auth)]).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        (
            body.len(),
            serde_json::from_str::<serde_json::Value>(&body).unwrap(),
        )
    };
    let (bytes, state) = read("shop-t").await;
    let keys = state["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 100, "the heaviest 100 of 20 000");
    assert!(bytes < 64 << 10, "{bytes} bytes for one read");
    assert!(keys.iter().all(|k| k["service"] == "shop"));
    // The heaviest are those shown: k19999 offered the most.
    assert!(keys.iter().any(|k| k["key"] == "k19999"), "{keys:?}");
    assert!(!keys.iter().any(|k| k["key"] == "k0"), "{keys:?}");
    // And the rule says how many it holds in all.
    assert_eq!(
        state["rules"],
        serde_json::json!([{ "service": "shop", "rule": "r", "keys": 20_000, "shown": 100 }])
    );
    // The admin sees both services, each cut the same way.
    let (_, state) = read("admin-t").await;
    assert_eq!(state["keys"].as_array().unwrap().len(), 103);
    // Reading in a loop costs the reports nothing they can see: they are still answered.
    for _ in 0..20 {
        read("shop-t").await;
    }
    assert_eq!(
        report(ctl.addr, "books-t", many_keys("b1", "books", 3)).await,
        StatusCode::OK
    );
}

// 1. One tenant's slow bodies hold no other service's turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_services_slow_report_bodies_leave_every_other_service_reporting() {
    use tokio::io::AsyncWriteExt;
    let ctl = controller_with_tokens();
    // 40 reports announcing 1 MB each, sending one byte of it and then nothing.
    let mut slow = Vec::new();
    for _ in 0..40 {
        let mut s = tokio::net::TcpStream::connect(ctl.addr).await.unwrap();
        s.write_all(
            b"POST /v1/report HTTP/1.1\r\nHost: c\r\nAuthorization: Bearer shop-t\r\nspillway-wire: 2\r\nContent-Length: 1000000\r\n\r\n{",
        )
        .await
        .unwrap();
        slow.push(s);
    }
    // Meanwhile the other service's reports, small and large, are answered within what its
    // proxies wait for a reply (their report interval, 1 s here).
    for keys in [1, 3_000] {
        let body = many_keys("b1", "books", keys);
        assert!(keys == 1 || body.len() > 64 << 10);
        let answered = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            report(ctl.addr, "books-t", body),
        )
        .await;
        assert_eq!(
            answered.ok(),
            Some(StatusCode::OK),
            "a report of {keys} keys behind another tenant's slow bodies"
        );
    }
    drop(slow);
}

// 7. The control plane makes room for its connections as the proxy does.
#[test]
fn the_controller_raises_a_low_soft_open_files_limit() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(BIN);
    cmd.args([
        "controller",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
    ])
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::null());
    // SAFETY: setrlimit is async-signal-safe; it lowers the child's own soft limit only.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(|| {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
            lim.rlim_cur = 1024.min(lim.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let fields: Vec<&str> = open_files.split_whitespace().collect();
    let (soft, hard) = (fields[3], fields[4]);
    let want = (2 * 32_768 + 256).to_string();
    assert!(
        soft == want || soft == hard,
        "the soft limit stayed low: {open_files} (ready: {line:?})"
    );
}

/// A connection to `to` from the loopback address `from` (127.0.0.x: each its own address).
async fn connect_from(from: [u8; 4], to: SocketAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(to).await.unwrap()
}

/// Whether `s` is answered when it asks for the state (401 without a token: it was served).
async fn served(s: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if s.write_all(b"GET /v1/state HTTP/1.1\r\nHost: c\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    let mut buf = [0u8; 12];
    matches!(s.read(&mut buf).await, Ok(n) if n > 0 && buf.starts_with(b"HTTP/1.1"))
}

// 7. One address's idle connections take at most its share of the places.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holds_at_most_its_share_of_the_controllers_connections() {
    let ctl = controller_with_tokens();
    let mut idle = Vec::new();
    for _ in 0..520 {
        idle.push(connect_from([127, 0, 0, 9], ctl.addr).await);
    }
    // The last ones, past the address's 512, were closed; the first is served.
    let mut over = idle.pop().unwrap();
    assert!(
        !served(&mut over).await,
        "a connection past the share was kept"
    );
    assert!(
        served(&mut idle[0]).await,
        "a connection within the share was not served"
    );
    // Another address reports, and the admin port answers.
    assert_eq!(
        report(ctl.addr, "books-t", many_keys("b1", "books", 1)).await,
        StatusCode::OK
    );
    assert_eq!(get(ctl.admin, "/healthz", &[]).await.0, StatusCode::OK);
}

/// The most memory `pid` has held (VmHWM), in MiB.
fn peak_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        / 1024
}

/// An aggregator forwarding to `ctl`, taking the tokens of [`tokens_dir`].
fn aggregator_with_tokens(ctl: &Proc, dir: &std::path::Path) -> Proc {
    let url = format!("http://{}", ctl.addr);
    Proc::spawn(&[
        "aggregator",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--controller",
        &url,
        "--zone",
        "z",
        "--tokens",
        dir.to_str().unwrap(),
    ])
}

// 2 and 1. A tenant's values are not held for long, nor replaced many times a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_source_reports_at_most_once_per_interval_and_not_for_minutes() {
    let dir = tokens_dir();
    let ctl = controller_with(&["--tokens", dir.to_str().unwrap()]);
    let agg = aggregator_with_tokens(&ctl, &dir);
    let with_interval = |source: &str, ms: u64| {
        many_keys(source, "shop", 3)
            .replace(r#""interval_ms":1000"#, &format!(r#""interval_ms":{ms}"#))
    };
    // Ten minutes' values, held for half an hour: refused; a minute's taken.
    assert_eq!(
        report(agg.addr, "shop-t", with_interval("s1", 600_000)).await,
        StatusCode::BAD_REQUEST
    );
    // Twenty reports of one source at once: three pass (late ones, then the next on time),
    // the rest are refused until the source's interval has passed.
    let mut taken = 0;
    let mut refused = 0;
    for seq in 1..=20 {
        let body = with_interval("s2", 60_000)
            .replace(r#""interval_ms""#, &format!(r#""seq":{seq},"interval_ms""#));
        match report(agg.addr, "shop-t", body).await {
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            // Counted (no ratios from the controller for it yet).
            _ => taken += 1,
        }
    }
    assert_eq!((taken, refused), (3, 17));
    // Other sources of the same service still report.
    assert_ne!(
        report(agg.addr, "shop-t", with_interval("s3", 1000)).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

// 2. One service's maximal reports stay within the aggregator's stated budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_services_maximal_reports_keep_the_aggregator_within_its_memory_budget() {
    let dir = tokens_dir();
    let ctl = controller_with(&["--tokens", dir.to_str().unwrap()]);
    let agg = aggregator_with_tokens(&ctl, &dir);
    // Two services' hosts, 8 at a time, each with an 8 MiB report of its own keys: the most
    // either may hold, and what both may hold together.
    let mut answered = 0;
    for (service, token) in [("shop", "shop-t"), ("books", "books-t")] {
        for batch in 0..2 {
            let sends = (0..8).map(|i| {
                let body = maximal_report(&format!("{service}-{}", batch * 8 + i), service);
                report(agg.addr, token, body)
            });
            for status in futures_util::future::join_all(sends).await {
                answered += usize::from(status == StatusCode::OK);
            }
        }
        // A third service's hosts still report in between.
        let status = report(agg.addr, "maps-t", many_keys("m-{service}", "maps", 3)).await;
        assert_eq!(status, StatusCode::OK);
    }
    assert!(answered > 0, "no maximal report was taken at all");
    let peak = peak_mib(agg.child.id());
    eprintln!("aggregator peak {peak} MiB, controller peak {} MiB, {answered} of 32 maximal reports taken", peak_mib(ctl.child.id()));
    assert!(
        peak <= AGGREGATOR_BUDGET_MIB,
        "the aggregator held {peak} MiB at its peak (budget {AGGREGATOR_BUDGET_MIB} MiB)"
    );
}

/// What docs/fleet.md states the aggregator holds at most, within the chart's 256 Mi.
const AGGREGATOR_BUDGET_MIB: u64 = 200;

// 7. The controller's /metrics shows a rule's rates only to a token that may read them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_metrics_show_rules_only_to_who_may_read_them() {
    let ctl = controller_with_tokens();
    for (token, source, service) in [("shop-t", "s1", "shop"), ("books-t", "b1", "books")] {
        assert_eq!(
            report(ctl.addr, token, many_keys(source, service, 3)).await,
            StatusCode::OK
        );
    }
    let rows = |body: &str, service: &str| {
        body.lines()
            .filter(|l| {
                l.starts_with("spillway_controller_offered_requests_per_second{")
                    && l.contains(&format!("spillway_service=\"{service}\""))
            })
            .count()
    };
    let scrape = |token: Option<&'static str>| async move {
        let auth = token.map(|t| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("authorization", a.as_str())).collect();
        let (status, _, body) = get(ctl.admin, "/metrics", &headers).await;
        assert_eq!(status, StatusCode::OK);
        body
    };
    let anyone = scrape(None).await;
    assert!(
        anyone.contains("spillway_controller_sources"),
        "the process's own metrics stay public"
    );
    assert_eq!(
        (rows(&anyone, "shop"), rows(&anyone, "books")),
        (0, 0),
        "{anyone}"
    );
    let shop = scrape(Some("shop-t")).await;
    assert_eq!((rows(&shop, "shop"), rows(&shop, "books")), (1, 0));
    let admin = scrape(Some("admin-t")).await;
    assert_eq!((rows(&admin, "shop"), rows(&admin, "books")), (1, 1));
    // Prometheus's token sees every rule's rates, and nothing else.
    let prometheus = scrape(Some("metrics-t")).await;
    assert_eq!(
        (rows(&prometheus, "shop"), rows(&prometheus, "books")),
        (1, 1)
    );
    let auth = [("authorization", "Bearer metrics-t")];
    assert_eq!(
        get(ctl.addr, "/v1/state", &auth).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        report(ctl.addr, "metrics-t", many_keys("m1", "shop", 1)).await,
        StatusCode::FORBIDDEN
    );
}

// 4. With one token for every service, a live host's name stays with the process reporting
// under it: another pod holding the token can neither take it nor spoil its sequence numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_hosts_name_stays_with_its_process_under_a_shared_token() {
    let dir = tokens_dir();
    std::fs::write(dir.join("_shared"), "shared-t").unwrap();
    let ctl = controller_with(&["--tokens", dir.to_str().unwrap()]);
    use http_body_util::BodyExt;
    let post = |instance: &'static str, seq: u64| async move {
        let body = many_keys("shop-0", "shop", 1)
            .replace(r#""interval_ms""#, &format!(r#""seq":{seq},"interval_ms""#));
        let req = http::Request::post(format!("http://{}/v1/report", ctl.addr))
            .header("spillway-wire", "2")
            .header("spillway-instance", instance)
            .header("authorization", "Bearer shared-t")
            .body(
                http_body_util::Full::new(bytes::Bytes::from(body))
                    .map_err(|never| match never {})
                    .boxed(),
            )
            .unwrap();
        client().request(req).await.unwrap().status()
    };
    assert_eq!(post("a1", 10).await, StatusCode::OK);
    assert_eq!(post("b2", u64::MAX).await, StatusCode::CONFLICT);
    // The shared token sends no zone sums beside the aggregators' own.
    let zone = many_keys("zone:z/r", "shop", 1);
    assert_eq!(
        report(ctl.addr, "shared-t", zone).await,
        StatusCode::FORBIDDEN
    );
    // The process that held the name goes on, its numbers untouched.
    assert_eq!(post("a1", 11).await, StatusCode::OK);
}

// 2. One service's maximal reports straight to the controller stay within its budget too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_services_maximal_reports_keep_the_controller_within_its_memory_budget() {
    let ctl = controller_with_tokens();
    // Enough 8 MiB reports, 4 at a time, to fill the service's quarter of the values.
    let mut answered = 0;
    for batch in 0..3 {
        let sends = (0..4).map(|i| {
            let body = maximal_report(&format!("direct-{}", batch * 4 + i), "shop");
            report(ctl.addr, "shop-t", body)
        });
        for status in futures_util::future::join_all(sends).await {
            answered += usize::from(status == StatusCode::OK);
        }
    }
    assert!(answered > 0, "no maximal report was taken at all");
    // Another service still reports.
    assert_eq!(
        report(ctl.addr, "books-t", many_keys("b1", "books", 3)).await,
        StatusCode::OK
    );
    let peak = peak_mib(ctl.child.id());
    eprintln!("controller peak {peak} MiB, {answered} of 12 maximal reports taken");
    assert!(
        peak <= CONTROLLER_BUDGET_MIB,
        "the controller held {peak} MiB at its peak (budget {CONTROLLER_BUDGET_MIB} MiB)"
    );
}

/// What docs/fleet.md states a tenant can take the controller to, within the chart's 1 Gi: a
/// quarter of its 2 000 000 values and its bodies' budget.
const CONTROLLER_BUDGET_MIB: u64 = 512;
