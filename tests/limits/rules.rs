//! Rules that mean what they say (issue 41, "What was seen", in its order): each test sends
//! what a client sent to get past a rule, or what a reviewer found in an answer, against the
//! real proxy on loopback, raw bytes where the spelling matters. Each asserts the answer.

use std::net::SocketAddr;

use crate::common::*;
use http::StatusCode;
use spillway::Sidecar;
use tokio::io::BufReader;

/// Sends `text` on a fresh connection and reads one answer.
async fn raw(addr: SocketAddr, text: impl AsRef<str>) -> Answer {
    let s = tokio::net::TcpStream::connect(addr).await.unwrap();
    ask(&mut BufReader::new(s), text.as_ref()).await
}

fn status(a: &Answer) -> u16 {
    a.status
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// A rule that admits one request in an hour, for everyone, on what `matches` says.
fn one_an_hour(matches: &str) -> String {
    format!(
        "rules:\n  - name: once\n    key: []\n    match: {{ {matches} }}\n    limit: {{ rate: 1/h, burst: 1 }}\n"
    )
}

// 1. A prefix with a trailing slash matches the path it names.
#[tokio::test]
async fn a_prefix_with_a_trailing_slash_matches_its_own_path_in_every_spelling() {
    let (sc, _up) = sidecar(&one_an_hour("path_prefix: /api/")).await;
    let first = raw(sc.addr(), "GET /api/x HTTP/1.1\r\nHost: app\r\n\r\n").await;
    assert_eq!(status(&first), 200, "{}", first.status);
    for target in [
        "/api/",
        "/api",
        "/API/",
        "//api//",
        "/api/.",
        "/Api",
        "/api;x=1/",
    ] {
        let a = raw(
            sc.addr(),
            format!("GET {target} HTTP/1.1\r\nHost: app\r\n\r\n"),
        )
        .await;
        assert_eq!(status(&a), 429, "{target} escaped /api/: {}", a.status);
    }
    // What never was under it stays outside.
    for target in ["/apix", "/ap", "/", "/v1/api/"] {
        let a = raw(
            sc.addr(),
            format!("GET {target} HTTP/1.1\r\nHost: app\r\n\r\n"),
        )
        .await;
        assert_eq!(status(&a), 200, "{target} is not under /api/: {}", a.status);
    }
}

#[tokio::test]
async fn the_create_endpoint_is_under_its_collection_s_prefix_and_a_regex_prefix_too() {
    let (sc, _up) = sidecar(&one_an_hour("path_prefix: /api/users/, methods: [POST]")).await;
    let post = |target: &'static str| {
        raw(
            sc.addr(),
            format!("POST {target} HTTP/1.1\r\nHost: app\r\nContent-Length: 0\r\n\r\n"),
        )
    };
    assert_eq!(status(&post("/api/users/7").await), 200);
    assert_eq!(status(&post("/api/users/").await), 429);
    assert_eq!(status(&post("/api/users").await), 429);
    // An anchored regex that names a directory matches the directory itself.
    let (sc, _up) = sidecar(&one_an_hour("path_regex: \"^/api/\"")).await;
    let get = |target: &'static str| {
        raw(
            sc.addr(),
            format!("GET {target} HTTP/1.1\r\nHost: app\r\n\r\n"),
        )
    };
    assert_eq!(status(&get("/api/x").await), 200);
    assert_eq!(status(&get("/api").await), 429);
    assert_eq!(status(&get("/API/").await), 429);
    assert_eq!(status(&get("/apix").await), 200);
}

// 2. A host the app does not serve is not served at all.
#[tokio::test]
async fn a_host_not_listed_is_misdirected_whatever_its_spelling() {
    let (sc, up) = sidecar(&format!(
        "hosts: [api.example.com, \"*.example.org\", 10.1.2.3, \"[fd00::1]\"]\n{}",
        one_an_hour("host: api.example.com")
    ))
    .await;
    for host in [
        "",
        "127.0.0.1",
        "x",
        "api.example.com..",
        "example.org",
        "10.1.2.4",
    ] {
        let a = raw(sc.addr(), format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n")).await;
        assert_eq!(status(&a), 421, "Host: {host:?} -> {}", a.status);
        assert!(a.head.contains("cache-control: no-store"), "{}", a.head);
        assert!(a.body.contains("\"status\":421"), "{}", a.body);
    }
    // Absolute form names the host in the target: the same list applies.
    let a = raw(sc.addr(), "GET http://evil.example/ HTTP/1.0\r\n\r\n").await;
    assert_eq!(status(&a), 421, "{}", a.status);
    assert_eq!(
        up.signals
            .requests
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    // Listed hosts pass, with port, case and a fully qualified name's dot.
    for host in [
        "10.1.2.3:8080",
        "[fd00::1]:80",
        "a.example.org",
        "b.a.example.org",
    ] {
        let a = raw(sc.addr(), format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n")).await;
        assert_eq!(status(&a), 200, "Host: {host:?} -> {}", a.status);
    }
    // The host rule sees every spelling of its host as one.
    for (host, want) in [
        ("api.example.com", 200),
        ("API.Example.COM:443", 429),
        ("api.example.com.", 429),
    ] {
        let a = raw(sc.addr(), format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n")).await;
        assert_eq!(status(&a), want, "Host: {host:?} -> {}", a.status);
    }
    // HTTP/1.0 without a Host: the one app serves it, and every host rule counts it.
    let a = raw(sc.addr(), "GET / HTTP/1.0\r\n\r\n").await;
    assert_eq!(status(&a), 429, "{}", a.status);
    // The admin port answers whatever the Host.
    let (code, _) = admin(&sc, "/healthz").await;
    assert_eq!(code, StatusCode::OK);
}

// 4. Our answers: never cached, and gRPC only to gRPC.
#[tokio::test]
async fn a_refused_plain_http_request_saying_grpc_gets_a_429_never_a_200() {
    let (sc, _up) = sidecar(&one_an_hour("path_prefix: /")).await;
    let post = "POST /svc/Call HTTP/1.1\r\nHost: app\r\nContent-Type: application/grpc\r\nContent-Length: 0\r\n\r\n";
    assert_eq!(status(&raw(sc.addr(), post).await), 200);
    let a = raw(sc.addr(), post).await;
    assert_eq!(status(&a), 429, "{}", a.status);
    assert!(a.head.contains("cache-control: no-store"), "{}", a.head);
    assert!(!a.head.contains("grpc-status"), "{}", a.head);
    // A GET saying gRPC is no gRPC call either.
    let a = raw(
        sc.addr(),
        "GET / HTTP/1.1\r\nHost: app\r\nContent-Type: application/grpc\r\n\r\n",
    )
    .await;
    assert_eq!(status(&a), 429, "{}", a.status);
    // gRPC-Web runs over HTTP/1.1: its refusal is in its own form.
    let a = raw(
        sc.addr(),
        "POST /svc/Call HTTP/1.1\r\nHost: app\r\nContent-Type: application/grpc-web+proto\r\nContent-Length: 0\r\n\r\n",
    )
    .await;
    assert_eq!(status(&a), 200, "{}", a.status);
    assert!(a.head.contains("grpc-status: 8"), "{}", a.head);
    assert!(
        a.head.contains("content-type: application/grpc-web+proto"),
        "{}",
        a.head
    );
    assert!(a.head.contains("cache-control: no-store"), "{}", a.head);
    // gRPC over HTTP/2 keeps its form.
    let client = h2_client();
    let (code, headers, _) = send(
        &client,
        sc.addr(),
        "POST",
        "/svc/Call",
        &[("content-type", "application/grpc")],
    )
    .await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(headers["grpc-status"], "8");
    assert_eq!(headers["cache-control"], "no-store");
}

#[tokio::test]
async fn every_answer_of_the_proxy_says_no_store() {
    let (sc, _up) = sidecar(&one_an_hour("path_prefix: /limited")).await;
    let get = "GET /limited HTTP/1.1\r\nHost: app\r\n\r\n";
    assert_eq!(status(&raw(sc.addr(), get).await), 200);
    let mut seen = Vec::new();
    // A kept 429, a 400 of the head, a 400 of the target, a 431.
    seen.push(raw(sc.addr(), get).await);
    seen.push(raw(sc.addr(), "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n").await);
    seen.push(raw(sc.addr(), "GET /../x HTTP/1.1\r\nHost: app\r\n\r\n").await);
    seen.push(
        raw(
            sc.addr(),
            format!(
                "GET / HTTP/1.1\r\nHost: app\r\nx-big: {}\r\n\r\n",
                "a".repeat(70_000)
            ),
        )
        .await,
    );
    for a in &seen {
        assert!(status(a) >= 400, "{}", a.status);
        assert!(
            a.head.contains("cache-control: no-store"),
            "{}: {}",
            a.status,
            a.head
        );
    }
    // A 502: the app is gone.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let sc = Sidecar::start(config(dead, "")).await.unwrap();
    let a = raw(sc.addr(), "GET / HTTP/1.1\r\nHost: app\r\n\r\n").await;
    assert_eq!(status(&a), 502, "{}", a.status);
    assert!(a.head.contains("cache-control: no-store"), "{}", a.head);
}

// 7. HTTP/2 cookies reach an HTTP/1 app as one field.
#[tokio::test]
async fn http2_cookie_fields_reach_an_http1_app_joined_in_one_line() {
    let (sc, _up) = sidecar("").await;
    let client = h2_client();
    let (code, _, body) = send(
        &client,
        sc.addr(),
        "GET",
        "/echo",
        &[("cookie", "a=1"), ("cookie", "b=2"), ("cookie", "c=3")],
    )
    .await;
    assert_eq!(code, StatusCode::OK);
    let seen: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(seen["headers"]["cookie"], "a=1; b=2; c=3", "{body}");
}

/// A connection to `to` from the loopback address `from` (127.0.0.x: each its own client).
async fn connect_from(from: [u8; 4], to: SocketAddr) -> BufReader<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    BufReader::new(socket.connect(to).await.unwrap())
}

// 6. A tier in a header is the ingress's to say, never the client's.
#[tokio::test]
async fn a_trusted_header_from_a_client_is_removed_and_from_the_ingress_kept() {
    let (sc, _up) = sidecar(
        "client_ip: { trusted_proxies: [127.0.0.2/32] }\ntrusted_headers: [x-plan]\nrules:\n  - name: free\n    key: [client_ip]\n    match: { headers_absent: [x-plan] }\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let echo = "GET /echo HTTP/1.1\r\nHost: app\r\nX-Plan: premium\r\n\r\n";
    // The client names its own plan: removed, so the free tier counts it, and the app never
    // reads it.
    let mut c = connect_from([127, 0, 0, 1], sc.addr()).await;
    let a = ask(&mut c, echo).await;
    assert_eq!(status(&a), 200, "{}", a.status);
    let seen: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert!(seen["headers"].get("x-plan").is_none(), "{}", a.body);
    let a = ask(&mut c, echo).await;
    assert_eq!(
        status(&a),
        429,
        "a self-upgrade escaped the free tier: {}",
        a.status
    );
    // The ingress says it: kept, and the free tier does not apply.
    let mut ingress = connect_from([127, 0, 0, 2], sc.addr()).await;
    for _ in 0..3 {
        let a = ask(&mut ingress, echo).await;
        assert_eq!(status(&a), 200, "{}", a.status);
        let seen: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        assert_eq!(seen["headers"]["x-plan"], "premium", "{}", a.body);
    }
}

// 3. IPv6 clients keyed as the rule says, and IPv4 clients inside IPv6 addresses as themselves.
#[tokio::test]
async fn each_rule_keys_ipv6_clients_by_its_own_prefix_and_tunnels_by_their_ipv4_client() {
    let (sc, _up) = sidecar(
        "client_ip: { trusted_proxies: [127.0.0.0/8], nat64_prefixes: [\"64:ff9b::/96\", \"64:ff9b:1:abcd::/96\"] }\nrules:\n  - name: site\n    key: [client_ip/48]\n    match: { path_prefix: /site }\n    limit: { rate: 1/h, burst: 1 }\n  - name: host\n    key: [client_ip]\n    match: { path_prefix: /host }\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let from = |path: &str, client: &str| {
        raw(
            sc.addr(),
            format!("GET {path} HTTP/1.1\r\nHost: app\r\nX-Forwarded-For: {client}\r\n\r\n"),
        )
    };
    // A /48 holder's 65 536 /64s are one bucket under the /48 rule...
    assert_eq!(status(&from("/site", "2a01:1:2:3::1").await), 200);
    assert_eq!(status(&from("/site", "2a01:1:2:4::1").await), 429);
    // ...and each /64 its own under the other.
    assert_eq!(status(&from("/host", "2a01:1:2:3::1").await), 200);
    assert_eq!(status(&from("/host", "2a01:1:2:4::1").await), 200);
    // 6to4: every /64 of 2002:c633:6407::/48 is the one IPv4 address 198.51.100.7.
    assert_eq!(status(&from("/host", "2002:c633:6407:1::1").await), 200);
    assert_eq!(status(&from("/host", "2002:c633:6407:2::1").await), 429);
    assert_eq!(status(&from("/host", "198.51.100.7").await), 429);
    // Two Teredo clients of one relay are two clients.
    assert_eq!(
        status(&from("/host", "2001:0:4136:e378:8000:63bf:3fff:fdd2").await),
        200
    );
    assert_eq!(
        status(&from("/host", "2001:0:4136:e378:8000:63bf:3fff:fdd3").await),
        200
    );
    assert_eq!(
        status(&from("/host", "2001:0:4136:e378:8000:63bf:3fff:fdd2").await),
        429
    );
    // Two clients behind a local-use NAT64 prefix are two clients.
    assert_eq!(
        status(&from("/host", "64:ff9b:1:abcd::c633:6410").await),
        200
    );
    assert_eq!(
        status(&from("/host", "64:ff9b:1:abcd::c633:6411").await),
        200
    );
    assert_eq!(status(&from("/host", "198.51.100.16").await), 429);
}

// 5. Keys kept private: what the control plane holds of a header key is its digest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_knows_a_header_key_by_its_digest_and_still_holds_its_limit() {
    let ctl = controller_in_process().await;
    let secret = temp_file(
        &format!("promises-secret-{}", fastrand::u32(..)),
        "0b7c1e9f2a4d6e8f0a1c3e5f7a9b1d3f\n",
    );
    let (sc, _up) = sidecar(&format!(
        "key_secret_file: {}\n{}",
        secret.display(),
        global_rule(ctl.addr)
    ))
    .await;
    let token = [("x-api-key", "sk_live_4eC39HqLyjWDarjtT1zdp7dc")];
    let digest = spillway::internal::digest::Secret::load(&secret)
        .unwrap()
        .of_value(token[0].1.as_bytes());
    // Requests until the controller holds the key (bounded: 3000 requests).
    let mut state = String::new();
    for _ in 0..300 {
        for _ in 0..10 {
            get(sc.addr(), "/", &token).await;
        }
        state = get(ctl.addr, "/v1/state", &[]).await.2;
        // A named key (the rule's tail, `"key":null`, comes with the proxy's first report).
        if state.contains("\"key\":\"") {
            break;
        }
    }
    assert!(state.contains(&digest), "{digest} not in {state}");
    assert!(!state.contains("sk_live"), "the key in clear: {state}");
    ctl.shutdown();
}

// 6. The shipped examples, with the bypasses that got past them.

/// The example `file` in front of `upstream`, its listeners on loopback (and its Redis at
/// `redis`), its limiters on a clock that does not move: each bucket holds its burst exactly.
async fn example(file: &str, upstream: SocketAddr, redis: Option<String>) -> Sidecar {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let text: String = text
        .lines()
        .map(|l| {
            if l.starts_with("listen:") {
                "listen: 127.0.0.1:0".to_string()
            } else if l.starts_with("admin:") {
                "admin: 127.0.0.1:0".to_string()
            } else if l.starts_with("upstream:") {
                format!("upstream: http://{upstream}")
            } else if let (Some(url), true) = (&redis, l.trim_start().starts_with("url: redis://"))
            {
                format!("  url: {url}")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let config = spillway::Config::from_yaml(&text, file).unwrap_or_else(|e| panic!("{e}"));
    let clock = spillway::internal::limit::ManualClock::new(1_000_000_000);
    Sidecar::start_with_clock(config, spillway::internal::limit::AnyClock::Manual(clock))
        .await
        .unwrap()
}

/// Sends `n` requests from `from` with the fields `extra(i)` adds; how many were admitted.
async fn admitted_of(
    sc: &Sidecar,
    from: [u8; 4],
    n: usize,
    extra: impl Fn(usize) -> String,
) -> usize {
    let mut c = connect_from(from, sc.addr()).await;
    let mut ok = 0;
    for i in 0..n {
        let a = ask(
            &mut c,
            &format!("GET /api/x HTTP/1.1\r\nHost: app\r\n{}\r\n", extra(i)),
        )
        .await;
        ok += usize::from(status(&a) == 200);
    }
    ok
}

#[tokio::test]
async fn the_tiers_example_holds_against_made_up_keys_and_self_named_plans() {
    let up = upstream().await;
    let sc = example("config/tiers.yaml", up.addr, None).await;
    // A new X-Api-Key on every request: anonymous all the same (burst 10).
    let ok = admitted_of(&sc, [127, 0, 0, 11], 40, |i| format!("X-Api-Key: k{i}\r\n")).await;
    assert_eq!(ok, 10, "made-up keys escaped the anonymous limit");
    // A plan named by the client itself: removed, anonymous.
    let ok = admitted_of(&sc, [127, 0, 0, 12], 40, |i| {
        format!("X-Api-Key: k{i}\r\nX-Plan: premium\r\n")
    })
    .await;
    assert_eq!(ok, 10, "a self-upgrade to premium");
    let ok = admitted_of(&sc, [127, 0, 0, 13], 40, |_| {
        "X-Api-Key: mine\r\nX-Plan: other\r\n".to_string()
    })
    .await;
    assert_eq!(ok, 10, "a plan no tier names went unlimited");
}

#[tokio::test]
async fn the_fleet_example_holds_a_client_that_makes_up_a_key_per_request() {
    let up = upstream().await;
    let sc = example("config/fleet.yaml", up.addr, None).await;
    let ok = admitted_of(&sc, [127, 0, 0, 21], 450, |i| {
        format!("X-Api-Key: k{i}\r\n")
    })
    .await;
    assert_eq!(ok, 400, "the per-address backstop (burst 400) did not hold");
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exact_example_holds_a_client_that_makes_up_a_key_per_request() {
    let redis = RedisServer::start();
    let up = upstream().await;
    let sc = example("config/exact.yaml", up.addr, Some(redis.url())).await;
    let ok = admitted_of(&sc, [127, 0, 0, 31], 250, |i| {
        format!("X-Api-Key: k{i}\r\n")
    })
    .await;
    assert_eq!(ok, 200, "the per-address backstop (burst 200) did not hold");
}

#[test]
fn check_config_warns_of_a_trusted_block_of_the_internet_and_a_host_rule_without_hosts() {
    let file = temp_file(
        &format!("promises-warn-{}.yaml", fastrand::u32(..)),
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nclient_ip: { trusted_proxies: [0.0.0.0/0, 8.8.8.0/24, 10.0.0.0/8, \"2001:db8::/32\", \"::/0\"] }\nrules:\n  - name: api\n    key: client_ip\n    match: { host: api.example.com }\n    limit: { rate: 1/s }\n",
    );
    let out = std::process::Command::new(BIN)
        .args(["check-config", "--output", "json"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let warnings: Vec<String> = report[0]["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap().to_string())
        .collect();
    for block in ["0.0.0.0/0", "8.8.8.0/24", "2001:db8::/32", "::/0"] {
        assert!(
            warnings.iter().any(|w| w.contains(&format!(" {block} "))),
            "{block}: {warnings:?}"
        );
    }
    assert!(
        !warnings.iter().any(|w| w.contains("10.0.0.0/8")),
        "{warnings:?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("rule api") && w.contains("hosts:")),
        "{warnings:?}"
    );
    // With the hosts listed, the rule means what it says.
    let listed = temp_file(
        &format!("promises-hosts-{}.yaml", fastrand::u32(..)),
        "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\nhosts: [api.example.com]\nrules:\n  - name: api\n    key: client_ip\n    match: { host: api.example.com }\n    limit: { rate: 1/s }\n",
    );
    let out = std::process::Command::new(BIN)
        .args(["check-config", "--output", "json"])
        .arg(&listed)
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report[0]["warnings"], serde_json::json!([]), "{report}");
}

// The review's: whitespace around an HTTP/2 value is one key to the app, two to a rule.
#[tokio::test]
async fn an_http2_value_padded_with_whitespace_is_refused_not_a_new_key() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: k\n    key: [header:x-api-key]\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let client = h2_client();
    let (code, _, _) = send(&client, sc.addr(), "GET", "/", &[("x-api-key", "w2k")]).await;
    assert_eq!(code, StatusCode::OK);
    for padded in ["w2k ", " w2k", "w2k\t", "w2k  "] {
        let (code, _, body) = send(&client, sc.addr(), "GET", "/", &[("x-api-key", padded)]).await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "{padded:?}: {body}");
    }
    let (code, _, _) = send(&client, sc.addr(), "GET", "/", &[("x-api-key", "w2k")]).await;
    assert_eq!(code, StatusCode::TOO_MANY_REQUESTS);
}

#[test]
fn trusted_headers_cannot_name_a_field_the_proxy_frames_or_forwards_by() {
    for field in [
        "content-length",
        "Transfer-Encoding",
        "host",
        "x-forwarded-for",
        "te",
    ] {
        let yaml = format!(
            "service: s\nlisten: 127.0.0.1:0\nupstream: http://127.0.0.1:1\ntrusted_headers: [x-plan, {field}]\n"
        );
        let e = spillway::Config::from_yaml(&yaml, "t.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("trusted_headers") && e.contains(":4"),
            "{field}: {e}"
        );
    }
}

// The review's: an HTTP/2 request naming no host at all (neither :authority nor Host).
#[tokio::test]
async fn an_http2_request_without_authority_or_host_is_refused() {
    let (sc, up) = sidecar("").await;
    let io = tokio::net::TcpStream::connect(sc.addr()).await.unwrap();
    let (mut h2, conn) = h2::client::handshake(io).await.unwrap();
    tokio::spawn(conn);
    // A relative target: the h2 crate sends :scheme and :path, and no :authority.
    let req = http::Request::get("/echo").body(()).unwrap();
    let answered = match h2.send_request(req, true) {
        Ok((resp, _)) => resp.await.map(|r| r.status()).ok(),
        Err(_) => None,
    };
    assert_eq!(answered, Some(StatusCode::BAD_REQUEST));
    assert_eq!(
        up.signals
            .requests
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
}
