//! A limit that holds against a hostile client: each test sends what an attacker sent to get
//! past a limit already used up, or to take the limit away from everyone (issue 26, "What was
//! seen", in its order), against the real proxy on loopback, raw bytes where the spelling
//! matters. Each asserts the attacker's answer, not the proxy's internals.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};

/// Sends `text` on a fresh connection and reads one answer.
async fn raw(addr: SocketAddr, text: impl AsRef<str>) -> Answer {
    let text = text.as_ref();
    let s = tokio::net::TcpStream::connect(addr).await.unwrap();
    ask(&mut BufReader::new(s), text).await
}

fn status(a: &Answer) -> u16 {
    a.status
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn get_line(target: &str, extra: &str) -> String {
    format!("GET {target} HTTP/1.1\r\nHost: app\r\n{extra}\r\n")
}

// 1. Cost 0.
#[tokio::test]
async fn a_cost_of_zero_or_garbage_is_a_400_naming_the_rule_not_a_free_request() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: priced\n    key: [header:x-user]\n    limit: { rate: 1/h, burst: 2 }\n    cost: { header: x-cost, max: 2, from: any }\n",
    )
    .await;
    let user = "x-user: mallory\r\n";
    for _ in 0..2 {
        assert_eq!(
            status(&raw(sc.addr(), &get_line("/", &format!("{user}x-cost: 1\r\n"))).await),
            200
        );
    }
    for cost in ["0", "-1", "1.5", "0.0", "one", "", "1, 1"] {
        let a = raw(
            sc.addr(),
            &get_line("/", &format!("{user}x-cost: {cost}\r\n")),
        )
        .await;
        assert_eq!(status(&a), 400, "x-cost: {cost:?} -> {}", a.status);
        assert!(a.head.contains("application/problem+json"), "{}", a.head);
        assert!(a.body.contains("\"rule\":\"priced\""), "{}", a.body);
    }
    // Twice the field: which one a framework reads is anyone's guess.
    let twice = raw(
        sc.addr(),
        &get_line("/", &format!("{user}x-cost: 1\r\nx-cost: 0\r\n")),
    )
    .await;
    assert_eq!(status(&twice), 400);
    // The limit is still used up.
    assert_eq!(
        status(&raw(sc.addr(), &get_line("/", &format!("{user}x-cost: 1\r\n"))).await),
        429
    );
}

// 2. Path spellings.
#[tokio::test]
async fn another_spelling_of_a_used_up_path_is_counted_as_that_path() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: login\n    match: { path: /login }\n    key: [client_ip]\n    limit: { rate: 1/h, burst: 1 }\n  - name: admin\n    match: { path_prefix: /admin/ }\n    key: [client_ip]\n    limit: { rate: 1/h, burst: 1 }\n  - name: report\n    match: { path_regex: '^/reports/[0-9]+$' }\n    key: [client_ip]\n    limit: { rate: 1/h, burst: 1 }\n  - name: per-path\n    match: { path_prefix: /p/ }\n    key: [path]\n    limit: { rate: 1/h, burst: 1 }\n  - name: per-user\n    match: { path: /q }\n    key: [query:user]\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let addr = sc.addr();
    let ask = |t: &str| raw(addr, get_line(t, ""));
    assert_eq!(status(&ask("/login").await), 200);
    for spelling in [
        "/%6cogin",
        "/%6Cogin",
        "//login",
        "/./login",
        "/x/../login",
        "/x/%2e%2e/login",
        "/LOGIN",
        "/login/",
        "/login;jsessionid=1",
    ] {
        assert_eq!(status(&ask(spelling).await), 429, "{spelling}");
    }
    assert_eq!(status(&ask("/admin/users").await), 200);
    for spelling in [
        "//admin/users",
        "/Admin/users",
        "/%61dmin/x",
        "/x/../admin/y",
    ] {
        assert_eq!(status(&ask(spelling).await), 429, "{spelling}");
    }
    assert_eq!(status(&ask("/reports/1").await), 200);
    for spelling in ["/REPORTS/2", "/reports/%33", "/reports/4/", "//reports/5"] {
        assert_eq!(status(&ask(spelling).await), 429, "{spelling}");
    }
    assert_eq!(status(&ask("/p/a").await), 200);
    for spelling in ["/p/A", "/p/%61", "/p//a", "/p/a/", "/p/a;x=1"] {
        assert_eq!(status(&ask(spelling).await), 429, "{spelling}");
    }
    assert_eq!(status(&ask("/q?user=bob").await), 200);
    for spelling in ["/q?user=b%6Fb", "/q?%75ser=bob", "/q?user=bo%62"] {
        assert_eq!(status(&ask(spelling).await), 429, "{spelling}");
    }
    // Two values of a keyed parameter: refused, not counted under either.
    assert_eq!(status(&ask("/q?user=eve&user=bob").await), 400);
}

#[tokio::test]
async fn the_app_is_sent_the_target_the_rules_counted_and_what_cannot_be_normalised_is_400() {
    let (sc, _up) = sidecar("rules: []\n").await;
    let a = raw(sc.addr(), &get_line("/x/..//%65cho?a=%2e%2E", "")).await;
    assert_eq!(status(&a), 200, "{}", a.body);
    let echoed: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    // The path canonical; the query as sent.
    assert_eq!(echoed["uri"], "/echo?a=%2e%2E");
    for bad in ["/..", "/a/../../echo", "/ech%zz", "/..;/echo"] {
        let a = raw(sc.addr(), &get_line(bad, "")).await;
        assert_eq!(status(&a), 400, "{bad}");
    }
    // An encoded slash is kept by default (upper-cased), refused with path_escapes: reject.
    let a = raw(sc.addr(), &get_line("/echo%2fx", "")).await;
    assert_eq!(status(&a), 200);
    let (strict, _up2) = sidecar("path_escapes: reject\nrules: []\n").await;
    assert_eq!(
        status(&raw(strict.addr(), &get_line("/echo%2Fx", "")).await),
        400
    );
    assert_eq!(
        status(&raw(strict.addr(), &get_line("/echo%5cx", "")).await),
        400
    );
    // normalize_path: false forwards the raw target (signed URLs).
    let (rawpath, _up3) = sidecar("normalize_path: false\nrules: []\n").await;
    let a = raw(rawpath.addr(), &get_line("//echo", "")).await;
    assert_ne!(status(&a), 400);
}

// 3. X-Forwarded-For from anyone.
#[tokio::test]
async fn x_forwarded_for_from_an_unlisted_peer_picks_no_bucket() {
    // The old setting alone is refused: it made every client's header believed.
    let up = upstream().await;
    let yaml = format!(
        "service: t\nlisten: 127.0.0.1:0\nupstream: http://{}\nclient_ip: {{ trusted_hops: 1 }}\n",
        up.addr
    );
    let e = spillway::Config::from_yaml(&yaml, "t.yaml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("trusted_proxies"), "{e}");

    // Listed proxies that are not the peer (127.0.0.1): the header is ignored.
    let (sc, _up) = sidecar(
        "client_ip: { trusted_proxies: [10.0.0.0/8], trusted_hops: 1 }\nrules:\n  - name: per-ip\n    key: [client_ip]\n    limit: { rate: 1/h, burst: 2 }\n",
    )
    .await;
    let mut answers = Vec::new();
    for i in 0..6 {
        let xff = format!("x-forwarded-for: 203.0.113.{i}\r\n");
        answers.push(status(&raw(sc.addr(), &get_line("/", &xff)).await));
    }
    assert_eq!(answers, [200, 200, 429, 429, 429, 429]);

    // The peer listed: the rightmost unlisted entry is the client, each its own bucket.
    let (sc, _up) = sidecar(
        "client_ip: { trusted_proxies: [127.0.0.0/8] }\nrules:\n  - name: per-ip\n    key: [client_ip]\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let via = |c: &str| format!("x-forwarded-for: 6.6.6.6, {c}, 127.0.0.9\r\n");
    assert_eq!(
        status(&raw(sc.addr(), &get_line("/", &via("198.51.100.1"))).await),
        200
    );
    assert_eq!(
        status(&raw(sc.addr(), &get_line("/", &via("198.51.100.2"))).await),
        200
    );
    // The spoofable leftmost entry changes nothing.
    let spoof = "x-forwarded-for: 1.2.3.4, 198.51.100.1, 127.0.0.9\r\n";
    assert_eq!(status(&raw(sc.addr(), &get_line("/", spoof)).await), 429);
    // A public IPv6 client is one client across its /64.
    assert_eq!(
        status(&raw(sc.addr(), &get_line("/", &via("2001:db8:1:2::1"))).await),
        200
    );
    assert_eq!(
        status(&raw(sc.addr(), &get_line("/", &via("2001:db8:1:2:ffff::9"))).await),
        429
    );
}

// 4. h2c tunnel.
#[tokio::test]
async fn an_h2c_upgrade_is_never_forwarded_and_an_unasked_switch_is_a_502() {
    let (sc, _up) = sidecar("rules: []\n").await;
    // The test app's /ws answers 101 to anything: the proxy forwarded no Upgrade, so the
    // switch was not asked for.
    let a = raw(
        sc.addr(),
        &get_line("/ws", "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"),
    )
    .await;
    assert_eq!(status(&a), 502, "{} {}", a.status, a.head);
    // What the app is sent carries no Upgrade.
    let a = raw(
        sc.addr(),
        &get_line("/echo", "Connection: Upgrade\r\nUpgrade: h2c\r\n"),
    )
    .await;
    assert_eq!(status(&a), 200);
    assert!(!a.body.to_ascii_lowercase().contains("h2c"), "{}", a.body);
    // WebSocket still works.
    let a = raw(
        sc.addr(),
        &get_line("/ws", "Connection: Upgrade\r\nUpgrade: websocket\r\n"),
    )
    .await;
    assert_eq!(status(&a), 101);
}

#[tokio::test]
async fn a_switch_to_another_protocol_than_asked_is_a_502() {
    // An upstream that answers every request with a switch to h2c.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s
                    .write_all(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
                    .await;
                let _ = s.read(&mut buf).await;
            });
        }
    });
    let sc = spillway::Sidecar::start(config(up, "rules: []\n"))
        .await
        .unwrap();
    let a = raw(
        sc.addr(),
        &get_line("/ws", "Connection: Upgrade\r\nUpgrade: websocket\r\n"),
    )
    .await;
    assert_eq!(status(&a), 502, "{}", a.status);
    assert!(a.head.contains("connection: close"), "{}", a.head);
}

// 5. Key bytes.
#[tokio::test]
async fn long_keys_are_limited_each_on_its_own_whatever_their_length() {
    let (sc, _up) = sidecar(
        "limits: { max_header_bytes: 65536 }\nrules:\n  - name: per-key\n    key: [header:x-k]\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let long = |last: char| format!("{}{last}", "k".repeat(16 * 1024));
    for last in ['a', 'b', 'c'] {
        let h = format!("x-k: {}\r\n", long(last));
        assert_eq!(status(&raw(sc.addr(), get_line("/", &h)).await), 200);
        // The same 16 KiB key again: its own (hashed) bucket is used up.
        assert_eq!(status(&raw(sc.addr(), get_line("/", &h)).await), 429);
    }
    let (_, text) = admin(&sc, "/metrics").await;
    assert_eq!(metric(&text, "spillway_keys{rule=\"per-key\"}"), Some(3.0));
}

/// Resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[tokio::test]
async fn a_thousand_16_kib_keys_do_not_cost_16_mib() {
    let up = upstream().await;
    let yaml = format!(
        "service: t\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{}\nworkers: 1\nlimits: {{ max_header_bytes: 65536 }}\nrules:\n  - name: per-key\n    key: [header:x-k]\n    limit: {{ rate: 1/h, burst: 1 }}\n",
        up.addr
    );
    let path = temp_file("hostile-keys.yaml", &yaml);
    let proxy = Proc::spawn(&["proxy", "--config", path.to_str().unwrap()]);
    // One keep-alive connection, so that its buffers are made once.
    let s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let mut conn = BufReader::new(s);
    let send_key = |i: usize| {
        let key = format!("{i:08}{}", "k".repeat(16 * 1024));
        format!("GET / HTTP/1.1\r\nHost: app\r\nx-k: {key}\r\n\r\n")
    };
    for i in 0..50 {
        assert_eq!(status(&ask(&mut conn, &send_key(i)).await), 200);
    }
    let before = rss(proxy.child.id());
    for i in 50..1050 {
        assert_eq!(status(&ask(&mut conn, &send_key(i)).await), 200);
    }
    let grown = rss(proxy.child.id()).saturating_sub(before);
    // 1 000 keys of 16 KiB kept verbatim would be 16 MiB; hashed, they are a few hundred KiB.
    assert!(
        grown < 4 << 20,
        "memory grew by {} KiB for 1 000 long keys",
        grown >> 10
    );
}

// 6. Global rules switched off by one request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_long_or_non_utf8_key_does_not_switch_off_a_global_rule() {
    let ctl = controller();
    let up = upstream().await;
    let sc = spillway::Sidecar::start(config(
        up.addr,
        &format!(
            "control_plane:\n  url: http://{}\n  report_interval: 100ms\n  stale_after: 2s\n  decay: 1s\n  host: h\nrules:\n  - name: g\n    key: [header:x-api-key]\n    limit: {{ rate: 20/s }}\n    scope: global\n",
            ctl.addr
        ),
    ))
    .await
    .unwrap();
    let c = client();
    let long = "L".repeat(2000);
    // obs-text: a byte past 0x7f in a header value, not UTF-8.
    let odd = http::HeaderValue::from_bytes(b"caf\xe9").unwrap();
    let send_key = |key: http::HeaderValue| {
        let c = c.clone();
        let addr = sc.addr();
        async move {
            let req = http::Request::get(format!("http://{addr}/"))
                .header("x-api-key", key)
                .body(empty())
                .unwrap();
            c.request(req).await.map(|r| r.status()).ok()
        }
    };
    // 200/s of each key against 20/s: both the UTF-8 key beside the long one and the non-UTF-8
    // key must be dropped to about the limit once the ratios come back (bounded: 15 s).
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    let (mut plain_limited, mut odd_limited) = (0, 0);
    for _ in 0..3000 {
        tick.tick().await;
        let long_v = http::HeaderValue::from_str(&long).unwrap();
        let (_, a, b) = tokio::join!(
            send_key(long_v),
            send_key(http::HeaderValue::from_static("plain")),
            send_key(odd.clone())
        );
        plain_limited += usize::from(a == Some(StatusCode::TOO_MANY_REQUESTS));
        odd_limited += usize::from(b == Some(StatusCode::TOO_MANY_REQUESTS));
        if plain_limited >= 20 && odd_limited >= 20 {
            break;
        }
    }
    assert!(
        plain_limited >= 20,
        "the plain key was never limited beside a 2000-byte key"
    );
    assert!(
        odd_limited >= 20,
        "the non-UTF-8 key never got its own drop ratio"
    );
}

// 7. Newcomers locked out.
#[tokio::test]
async fn a_key_flood_that_fills_the_store_does_not_lock_out_a_first_time_client() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: per-user\n    key: [header:x-user]\n    limit: { rate: 1/h, burst: 1 }\n    max_keys: 50\n",
    )
    .await;
    let c = client();
    for i in 0..300 {
        let user = format!("flood-{i}");
        send(&c, sc.addr(), "GET", "/", &[("x-user", &user)]).await;
    }
    // A real user's first request is admitted; a flooding key stays limited.
    for i in 0..10 {
        let user = format!("newcomer-{i}");
        let (s, _, _) = send(&c, sc.addr(), "GET", "/", &[("x-user", &user)]).await;
        assert_eq!(s, StatusCode::OK, "{user}");
    }
    for i in [0, 100, 299] {
        let user = format!("flood-{i}");
        let (s, _, _) = send(&c, sc.addr(), "GET", "/", &[("x-user", &user)]).await;
        assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{user}");
    }
}

// 8. Host and identity headers.
#[tokio::test]
async fn a_missing_or_doubled_host_is_400_and_identity_fields_never_reach_the_app() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: by-host\n    match: { host: app }\n    key: [client_ip]\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let a = raw(sc.addr(), "GET /echo HTTP/1.1\r\n\r\n").await;
    assert_eq!(status(&a), 400);
    let a = raw(
        sc.addr(),
        "GET /echo HTTP/1.1\r\nHost: app\r\nHost: other\r\n\r\n",
    )
    .await;
    assert_eq!(status(&a), 400);
    let a = raw(
        sc.addr(),
        &get_line(
            "/echo",
            "Forwarded: for=1.2.3.4\r\nX-Real-IP: 1.2.3.4\r\nX_Forwarded_For: 1.2.3.4\r\nX-Forwarded-Host: evil\r\nX-Forwarded-Proto: https\r\n",
        ),
    )
    .await;
    assert_eq!(status(&a), 200, "{}", a.body);
    let echoed: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    let headers = echoed["headers"].as_object().unwrap();
    for gone in ["forwarded", "x-real-ip", "x_forwarded_for"] {
        assert!(
            !headers.contains_key(gone),
            "{gone} reached the app: {headers:?}"
        );
    }
    assert_eq!(headers["x-forwarded-host"], "app");
    assert_eq!(headers["x-forwarded-proto"], "http");
    // The host rule saw the request above; a request without Host cannot slip past it.
    let a = raw(sc.addr(), "GET /echo HTTP/1.1\r\n\r\n").await;
    assert_eq!(status(&a), 400);
    assert_eq!(status(&raw(sc.addr(), &get_line("/", "")).await), 429);
}

// 9. The client names its own cost.
#[tokio::test]
async fn a_cost_header_from_a_client_is_ignored_unless_the_rule_opts_in() {
    let rule = "rules:\n  - name: priced\n    key: [header:x-user]\n    limit: { rate: 1/h, burst: 10 }\n    cost: { header: x-cost, default: 5, max: 10 }\n";
    let (sc, _up) = sidecar(rule).await;
    let cheap = "x-user: u\r\nx-cost: 1\r\n";
    // Each request costs the default 5, whatever the client says.
    assert_eq!(status(&raw(sc.addr(), &get_line("/", cheap)).await), 200);
    assert_eq!(status(&raw(sc.addr(), &get_line("/", cheap)).await), 200);
    assert_eq!(status(&raw(sc.addr(), &get_line("/", cheap)).await), 429);
    // Garbage from a client whose header is not read is not an error either.
    let junk = "x-user: v\r\nx-cost: 0\r\n";
    assert_eq!(status(&raw(sc.addr(), &get_line("/", junk)).await), 200);

    // From a listed proxy (here the loopback peer) the header counts.
    let (sc, _up) = sidecar(&format!(
        "client_ip: {{ trusted_proxies: [127.0.0.1] }}\n{rule}"
    ))
    .await;
    for _ in 0..10 {
        assert_eq!(status(&raw(sc.addr(), &get_line("/", cheap)).await), 200);
    }
    assert_eq!(status(&raw(sc.addr(), &get_line("/", cheap)).await), 429);
}

// The next attacker: what an independent review of the fixes above found.

#[tokio::test]
async fn connection_cannot_drop_the_framing_and_smuggle_a_second_request() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: login\n    match: { path: /login }\n    key: []\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let inner = "GET /login HTTP/1.1\r\nHost: app\r\n\r\n";
    // (`Transfer-Encoding` is hop-by-hop already: named or not, it never goes on alone.)
    for named in [
        "content-length",
        "Content-Length, close",
        "host",
        "close, HOST",
    ] {
        let text = format!(
            "POST /echo HTTP/1.1\r\nHost: app\r\nConnection: {named}\r\nContent-Length: {}\r\n\r\n{inner}",
            inner.len()
        );
        let a = raw(sc.addr(), text).await;
        assert_eq!(
            status(&a),
            400,
            "Connection: {named}: {} {}",
            a.status,
            a.body
        );
    }
    // The limit on /login was never touched by the smuggled requests.
    assert_eq!(status(&raw(sc.addr(), get_line("/login", "")).await), 200);
}

#[tokio::test]
async fn a_field_named_in_connection_is_gone_before_the_rules_see_it() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: anonymous\n    match: { headers_absent: [authorization] }\n    key: []\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    assert_eq!(status(&raw(sc.addr(), get_line("/", "")).await), 200);
    // The app would never see this Authorization: the request is anonymous to it, and to us.
    let hidden = "Authorization: Bearer x\r\nConnection: authorization\r\n";
    assert_eq!(status(&raw(sc.addr(), get_line("/", hidden)).await), 429);
}

#[tokio::test]
async fn semicolons_head_and_method_overrides_do_not_slip_past_a_rule() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: per-user\n    match: { path: /q }\n    key: [query:user]\n    limit: { rate: 1/h, burst: 1 }\n  - name: reads\n    match: { path: /r, methods: [GET] }\n    key: []\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    assert_eq!(
        status(&raw(sc.addr(), get_line("/q?user=alice", "")).await),
        200
    );
    for t in ["/q?x=1;user=alice", "/q?user=alice;n=2"] {
        assert_eq!(status(&raw(sc.addr(), get_line(t, "")).await), 429, "{t}");
    }
    assert_eq!(status(&raw(sc.addr(), get_line("/r", "")).await), 200);
    // A HEAD answer has no body whatever its Content-Length: read its status line only.
    let mut s = tokio::net::TcpStream::connect(sc.addr()).await.unwrap();
    s.write_all(b"HEAD /r HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    let mut line = String::new();
    tokio::io::AsyncBufReadExt::read_line(&mut BufReader::new(s), &mut line)
        .await
        .unwrap();
    assert!(line.starts_with("HTTP/1.1 429"), "{line}");
    // Methods are case-sensitive, and `get` matches no `methods: [GET]`; but many apps fold
    // the case (Django, werkzeug) and serve it as GET. Refused, over HTTP/1 and HTTP/2.
    for method in ["get", "Get", "gET"] {
        let a = raw(
            sc.addr(),
            &format!("{method} /r HTTP/1.1\r\nHost: app\r\n\r\n"),
        )
        .await;
        assert_eq!(status(&a), 400, "{method}: {}", a.body);
        assert_eq!(
            send(&h2_client(), sc.addr(), method, "/r", &[]).await.0,
            StatusCode::BAD_REQUEST,
            "{method} over HTTP/2"
        );
    }
    let a = raw(
        sc.addr(),
        "POST /echo HTTP/1.1\r\nHost: app\r\nContent-Length: 0\r\nX-HTTP-Method-Override: DELETE\r\nX-Method-Override: DELETE\r\nX-HTTP-Method: DELETE\r\n\r\n",
    )
    .await;
    assert_eq!(status(&a), 200);
    assert!(
        !a.body.to_ascii_lowercase().contains("delete"),
        "{}",
        a.body
    );
}

#[tokio::test]
async fn an_encoded_or_back_slash_is_a_slash_to_the_rules() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: login\n    match: { path: /api/login }\n    key: []\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    assert_eq!(
        status(&raw(sc.addr(), get_line("/api/login", "")).await),
        200
    );
    for t in [
        "/api%2Flogin",
        "/api%2flogin",
        "/api%5Clogin",
        "/x%2F..%2Fapi/login",
    ] {
        assert_eq!(status(&raw(sc.addr(), get_line(t, "")).await), 429, "{t}");
    }
}

#[tokio::test]
async fn host_rules_see_the_host_the_app_gets() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: api\n    match: { host: api.example.com }\n    key: []\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let host = |h: &str| format!("GET / HTTP/1.1\r\nHost: {h}\r\n\r\n");
    assert_eq!(status(&raw(sc.addr(), host("api.example.com")).await), 200);
    assert_eq!(status(&raw(sc.addr(), host("api.example.com.")).await), 429);
    assert_eq!(
        status(&raw(sc.addr(), host("API.example.com:80")).await),
        429
    );
    // An HTTP/1.0 request without Host is served by the one app too: the rule applies.
    assert_eq!(status(&raw(sc.addr(), "GET / HTTP/1.0\r\n\r\n").await), 429);
    for bad in ["api.example.com/x", "a b", "api.example.com:x", "[::1"] {
        assert_eq!(status(&raw(sc.addr(), host(bad)).await), 400, "{bad}");
    }
}

#[tokio::test]
async fn identity_fields_of_an_untrusted_client_never_reach_the_app() {
    let (sc, _up) = sidecar("rules: []\n").await;
    let a = raw(
        sc.addr(),
        get_line(
            "/echo",
            "X-Forwarded-For: 1.2.3.4\r\nTrue-Client-IP: 1.2.3.4\r\nCF-Connecting-IP: 1.2.3.4\r\nX-Client-IP: 1.2.3.4\r\nX-Cluster-Client-IP: 1.2.3.4\r\nX-Original-URL: /admin\r\nX-Rewrite-URL: /admin\r\n",
        ),
    )
    .await;
    assert_eq!(status(&a), 200);
    let echoed: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    let headers = echoed["headers"].as_object().unwrap();
    // The client's own X-Forwarded-For is replaced by its address, not appended to.
    assert_eq!(headers["x-forwarded-for"], "127.0.0.1");
    for gone in [
        "true-client-ip",
        "cf-connecting-ip",
        "x-client-ip",
        "x-cluster-client-ip",
        "x-original-url",
        "x-rewrite-url",
    ] {
        assert!(!headers.contains_key(gone), "{gone} reached the app");
    }
}

#[test]
fn a_rule_on_a_field_that_never_reaches_the_app_is_a_config_error() {
    for rule in [
        "key: [header:x_user]",
        "key: [header:x-real-ip]",
        "match: { headers_absent: [forwarded] }\n    key: []",
        "match: { headers: { x_plan: free } }\n    key: []",
    ] {
        let yaml = format!(
            "service: t\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nrules:\n  - name: r\n    {rule}\n    limit: {{ rate: 1/s }}\n"
        );
        let e = spillway::Config::from_yaml(&yaml, "t.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("removes"), "{rule}: {e}");
    }
}
