//! A request id a support engineer can follow: every answer Spillway makes itself carries one
//! (`x-request-id`, and `request_id` in its problem document), the same as its rejection log
//! line and its access log line; a trusted peer's id (or `traceparent`) is kept and a client's
//! is not, unless configured; the app is sent one only when asked. The access log (opt-in)
//! has a JSON line for every refusal and error and for one in N forwarded requests.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::*;
use http::StatusCode;

/// A proxy process with JSON logs, `extra` added to its configuration, in front of `upstream`:
/// its address and the file its stderr goes to.
struct Logged {
    child: std::process::Child,
    addr: std::net::SocketAddr,
    err: std::path::PathBuf,
}

impl Logged {
    fn start(upstream: &str, extra: &str) -> Logged {
        let config = temp_file(
            &format!("ids-{}.yaml", fastrand::u32(..)),
            &format!(
                "service: ids\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{upstream}\n{extra}rules:\n  - name: two-per-hour\n    match: {{ path_prefix: /api }}\n    key: [header:x-client]\n    limit: {{ rate: 2/h, burst: 2 }}\n"
            ),
        );
        let err = temp_file(&format!("ids-{}.err", fastrand::u32(..)), "");
        let mut child = Command::new(BIN)
            .args(["--log-format", "json", "proxy", "--config"])
            .arg(&config)
            .env_remove("RUST_LOG")
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
        Logged { child, addr, err }
    }

    /// The JSON lines logged under `target` so far, once the process has stopped.
    fn lines(mut self, target: &str) -> Vec<serde_json::Value> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::fs::read_to_string(&self.err)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| l["target"] == target)
            .collect()
    }
}

/// A proxy a test is done with is stopped, whether or not its lines were read.
impl Drop for Logged {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends requests for `who` until one is refused; the refusal's id, from its field and its
/// document (which must agree).
async fn refused_id(addr: std::net::SocketAddr, headers: &[(&str, &str)]) -> String {
    for _ in 0..3 {
        let (status, h, body) = get(addr, "/api/x", headers).await;
        if status == StatusCode::TOO_MANY_REQUESTS {
            let id = h["x-request-id"].to_str().unwrap().to_string();
            let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(doc["request_id"], id.as_str(), "{body}");
            assert_eq!(doc["rule"], "two-per-hour");
            return id;
        }
        assert!(
            !h.contains_key("x-request-id"),
            "an app's answer gets no id of ours"
        );
    }
    panic!("nothing refused");
}

#[tokio::test]
async fn a_429s_id_is_its_rejection_lines_and_a_clients_own_id_is_not_taken_by_default() {
    let up = upstream().await;
    let proxy = Logged::start(&up.addr.to_string(), "");
    // A client's id is not trusted: the answer's is made here.
    let spoofed = [("x-client", "alice"), ("x-request-id", "i-am-someone-else")];
    let id = refused_id(proxy.addr, &spoofed).await;
    assert_ne!(id, "i-am-someone-else");
    assert_eq!(id.len(), 24, "{id}");
    let other = refused_id(proxy.addr, &[("x-client", "bob")]).await;
    assert_ne!(id, other, "each request its own id");
    let lines = proxy.lines("spillway::rejection");
    let logged: Vec<&str> = lines
        .iter()
        .filter_map(|l| l["request_id"].as_str())
        .collect();
    assert!(
        logged.contains(&id.as_str()) && logged.contains(&other.as_str()),
        "{lines:?}"
    );
}

#[tokio::test]
async fn a_trusted_peers_id_and_traceparent_are_kept_and_any_takes_a_clients() {
    let up = upstream().await;
    let proxy = Logged::start(
        &up.addr.to_string(),
        "client_ip: { trusted_proxies: [127.0.0.1/32] }\n",
    );
    let id = refused_id(
        proxy.addr,
        &[("x-client", "alice"), ("x-request-id", "ingress-42")],
    )
    .await;
    assert_eq!(id, "ingress-42");
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let id = refused_id(proxy.addr, &[("x-client", "bob"), ("traceparent", tp)]).await;
    assert_eq!(id, "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7");
    // An id that would break a header or a JSON string is not taken.
    let id = refused_id(
        proxy.addr,
        &[("x-client", "carol"), ("x-request-id", "a\"b")],
    )
    .await;
    assert_eq!(id.len(), 24, "{id}");
    drop(proxy);
    let proxy = Logged::start(&up.addr.to_string(), "request_id: { from: any }\n");
    let id = refused_id(
        proxy.addr,
        &[("x-client", "dave"), ("x-request-id", "mine-7")],
    )
    .await;
    assert_eq!(id, "mine-7");
}

#[tokio::test]
async fn the_app_gets_an_id_only_when_forward_is_on() {
    let up = upstream().await;
    let off = Logged::start(&up.addr.to_string(), "");
    let (_, _, echoed) = get(off.addr, "/echo", &[]).await;
    let echoed: serde_json::Value = serde_json::from_str(&echoed).unwrap();
    assert!(echoed["headers"].get("x-request-id").is_none(), "{echoed}");
    let on = Logged::start(&up.addr.to_string(), "request_id: { forward: true }\n");
    let (_, _, echoed) = get(on.addr, "/echo", &[("x-request-id", "client-chosen")]).await;
    let echoed: serde_json::Value = serde_json::from_str(&echoed).unwrap();
    let sent = echoed["headers"]["x-request-id"].as_str().unwrap();
    // The client's is not trusted: replaced by one made here.
    assert_ne!(sent, "client-chosen");
    assert_eq!(sent.len(), 24);
}

#[tokio::test]
async fn the_access_log_has_every_refusal_and_error_and_one_in_n_forwarded_with_the_answers_id() {
    let up = upstream().await;
    let proxy = Logged::start(&up.addr.to_string(), "access_log: { admitted_one_in: 1 }\n");
    let (status, _, _) = get(
        proxy.addr,
        "/api/x",
        &[("x-client", "alice"), ("user-agent", "curl/8")],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let refused = refused_id(proxy.addr, &[("x-client", "alice")]).await;
    // A request the proxy refuses itself (a host it cannot take): an error line.
    let (status, h, body) = get(proxy.addr, "/%zz", &[]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let error_id = h["x-request-id"].to_str().unwrap().to_string();
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["request_id"], error_id.as_str());
    let lines = proxy.lines("spillway::access");
    let by_id = |id: &str| {
        lines
            .iter()
            .find(|l| l["request_id"] == id)
            .unwrap_or_else(|| panic!("no line for {id}: {lines:?}"))
    };
    let line = by_id(&refused);
    assert_eq!(line["status"], 429);
    assert_eq!(line["decision"], "rejected");
    assert_eq!(line["rule"], "two-per-hour");
    assert_eq!(line["method"], "GET");
    assert_eq!(line["path"], "/api/x");
    assert_eq!(line["client"], "127.0.0.1");
    let line = by_id(&error_id);
    assert_eq!(
        (line["status"].as_u64(), line["decision"].as_str()),
        (Some(400), Some("error"))
    );
    let forwarded: Vec<_> = lines
        .iter()
        .filter(|l| l["decision"] == "forwarded")
        .collect();
    assert!(!forwarded.is_empty(), "{lines:?}");
    assert_eq!(forwarded[0]["status"], 200);
    assert_eq!(forwarded[0]["user_agent"], "curl/8");
    assert_eq!(forwarded[0]["bytes_sent"], 2, "the app's \"ok\"");
}

#[tokio::test]
async fn with_the_access_log_off_nothing_is_logged_and_one_in_zero_logs_only_refusals() {
    let up = upstream().await;
    let off = Logged::start(&up.addr.to_string(), "");
    refused_id(off.addr, &[("x-client", "alice")]).await;
    assert!(off.lines("spillway::access").is_empty());
    let refusals = Logged::start(&up.addr.to_string(), "access_log: { admitted_one_in: 0 }\n");
    let id = refused_id(refusals.addr, &[("x-client", "alice")]).await;
    let lines = refusals.lines("spillway::access");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["request_id"], id.as_str());
}

#[tokio::test]
async fn an_upstream_failure_is_answered_with_an_id_in_its_field_and_document() {
    // Nothing listens there: 502, ours.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    let proxy = Logged::start(&addr.to_string(), "access_log: { admitted_one_in: 0 }\n");
    let (status, h, body) = get(proxy.addr, "/", &[]).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let id = h["x-request-id"].to_str().unwrap().to_string();
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["request_id"], id.as_str());
    let lines = proxy.lines("spillway::access");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["request_id"], id.as_str());
    assert_eq!(lines[0]["decision"], "error");
}

#[tokio::test]
async fn an_http2_clients_429_carries_its_id_too() {
    let (sc, _up) = sidecar(
        "rules:\n  - name: one\n    key: [header:x-client]\n    limit: { rate: 1/h, burst: 1 }\n",
    )
    .await;
    let c = h2_client();
    send(&c, sc.addr(), "GET", "/", &[("x-client", "a")]).await;
    let (status, h, body) = send(&c, sc.addr(), "GET", "/", &[("x-client", "a")]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["request_id"], h["x-request-id"].to_str().unwrap());
}

#[tokio::test]
async fn the_access_log_never_writes_a_query_and_keeps_to_its_budget_of_refusal_lines() {
    let up = upstream().await;
    let proxy = Logged::start(
        &up.addr.to_string(),
        "access_log: { admitted_one_in: 1, refusals_per_second: 1 }\n",
    );
    let (status, _, _) = get(proxy.addr, "/echo?api_key=sk-secret-1", &[]).await;
    assert_eq!(status, StatusCode::OK);
    // Twenty refusals, a line a second at most: far fewer lines than refusals.
    for _ in 0..22 {
        get(proxy.addr, "/api/x", &[("x-client", "alice")]).await;
    }
    let lines = proxy.lines("spillway::access");
    let text = format!("{lines:?}");
    assert!(!text.contains("sk-secret-1"), "{text}");
    assert!(lines.iter().any(|l| l["path"] == "/echo"), "{text}");
    let refused = lines.iter().filter(|l| l["decision"] == "rejected").count();
    assert!(
        (1..=10).contains(&refused),
        "{refused} refusal lines: {text}"
    );
}
