//! HTTP/1 served by the proxy's own code from the first byte to the last, as a client that
//! tries the corners would: upgrades and their tunnels, an upgrade the app refuses, heads
//! refused here (each with its status and its `bad_requests` reason), streamed uploads on
//! the client connection's own upstream connection, an HTTP/2 client's upload to an HTTP/1 app.

use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

async fn connect(sc: &spillway::internal::proxy::Sidecar) -> BufReader<TcpStream> {
    BufReader::new(TcpStream::connect(sc.addr()).await.unwrap())
}

/// Everything the proxy sends on `s` until it closes (or 5 s of quiet: a failure then).
async fn rest(s: &mut BufReader<TcpStream>) -> String {
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    assert!(
        read.is_ok(),
        "the connection stayed open: {:?}",
        String::from_utf8_lossy(&out)
    );
    String::from_utf8_lossy(&out).into_owned()
}

const UPGRADE: &str =
    "GET /ws HTTP/1.1\r\nhost: app\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n";

#[tokio::test]
async fn a_tunnel_carries_bytes_both_ways_including_those_sent_with_its_head() {
    let (sc, _up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    // The first frame comes in the same write as the head, before any 101.
    c.get_mut()
        .write_all(format!("{UPGRADE}first").as_bytes())
        .await
        .unwrap();
    let a = read_answer(&mut c).await;
    assert_eq!(a.status, "HTTP/1.1 101 Switching Protocols");
    let head = a.head.to_ascii_lowercase();
    assert!(head.contains("upgrade: websocket"), "{head}");
    assert!(head.contains("connection: upgrade"), "{head}");
    let mut got = [0u8; 5];
    c.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"first");
    // Anything at all, HTTP-looking or not, goes through untouched.
    let more = b"GET /not-a-request HTTP/1.1\r\n\r\n\x00\xff";
    c.get_mut().write_all(more).await.unwrap();
    let mut echoed = vec![0u8; more.len()];
    c.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, more);
    // The client's close ends the tunnel, and the app's side with it.
    c.get_mut().shutdown().await.unwrap();
    assert_eq!(rest(&mut c).await, "");
}

/// A tunnel where neither side sends anything for `timeouts.client_idle` ends (as nginx ends
/// one at `proxy_read_timeout`): an idle upgraded connection does not hold a connection slot
/// and the app's connection for ever.
#[tokio::test]
async fn a_tunnel_idle_both_ways_for_client_idle_is_closed() {
    let (sc, _up) = sidecar("timeouts: { client_idle: 300ms }\nrules: []").await;
    let mut c = connect(&sc).await;
    c.get_mut().write_all(UPGRADE.as_bytes()).await.unwrap();
    let a = read_answer(&mut c).await;
    assert_eq!(a.status, "HTTP/1.1 101 Switching Protocols");
    // Bytes both ways go through...
    for n in 0..3u8 {
        c.get_mut().write_all(&[b'a' + n]).await.unwrap();
        let mut got = [0u8; 1];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(got[0], b'a' + n);
    }
    // ...and then nothing: the proxy closes it.
    assert_eq!(rest(&mut c).await, "");
}

#[tokio::test]
async fn an_upgrade_the_app_does_not_take_closes_the_connection_and_what_followed_is_no_request() {
    let (sc, up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    // `/echo` answers 200: no switch. What the client sent after the head (a frame that looks
    // like a request) must never be read as one.
    let asked =
        "GET /echo HTTP/1.1\r\nhost: app\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n";
    let behind = "GET /smuggled HTTP/1.1\r\nhost: app\r\n\r\n";
    c.get_mut()
        .write_all(format!("{asked}{behind}").as_bytes())
        .await
        .unwrap();
    let a = read_answer(&mut c).await;
    assert_eq!(a.status, "HTTP/1.1 200 OK");
    assert!(
        a.head.to_ascii_lowercase().contains("connection: close"),
        "{}",
        a.head
    );
    // The app was asked for the upgrade, and saw nothing else.
    assert!(a.body.contains("\"upgrade\":\"websocket\""), "{}", a.body);
    assert_eq!(rest(&mut c).await, "");
    assert_eq!(
        up.signals
            .requests
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
}

#[tokio::test]
async fn an_upgrade_with_a_body_the_app_does_not_switch_never_leaves_its_upstream_connection_to_another_client(
) {
    let (sc, _up) = sidecar("rules: []").await;
    // A body on a GET may be one the app never reads: behind the upgrade, it could be the head
    // of a request that the next client's bytes complete on a reused connection.
    let smuggled = "GET /admin HTTP/1.1\r\nx-pad: ";
    let asked = format!(
        "GET /echo HTTP/1.1\r\nhost: app\r\nconnection: upgrade\r\nupgrade: websocket\r\n\
         content-length: {}\r\n\r\n{smuggled}",
        smuggled.len()
    );
    let mut c = connect(&sc).await;
    let a = ask(&mut c, &asked).await;
    assert_eq!(a.status, "HTTP/1.1 200 OK");
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    let used = v["peer"].as_str().unwrap().to_string();
    assert_eq!(rest(&mut c).await, "");
    // The next clients borrow from the worker's list: never the connection the upgrade used.
    for _ in 0..3 {
        let mut next = connect(&sc).await;
        let a = ask(&mut next, "GET /echo HTTP/1.1\r\nhost: app\r\n\r\n").await;
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        assert_ne!(v["peer"].as_str().unwrap(), used);
    }
}

#[tokio::test]
async fn an_http10_or_unlisted_upgrade_goes_on_as_a_plain_request() {
    let (sc, _up) = sidecar("rules: []").await;
    for asked in [
        "GET /echo HTTP/1.0\r\nhost: app\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
        "GET /echo HTTP/1.1\r\nhost: app\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n",
        "GET /echo HTTP/1.1\r\nhost: app\r\nupgrade: websocket\r\n\r\n",
    ] {
        let mut c = connect(&sc).await;
        let a = ask(&mut c, asked).await;
        assert!(a.status.ends_with("200 OK"), "{asked:?}: {}", a.status);
        assert!(!a.body.contains("upgrade"), "{asked:?}: {}", a.body);
    }
}

#[tokio::test]
async fn heads_refused_here_get_their_status_close_and_are_counted_by_reason() {
    let (sc, up) = sidecar("rules: []").await;
    let cases: &[(&str, &str, &str)] = &[
        ("CONNECT app:443 HTTP/1.1\r\nhost: app:443\r\n\r\n", "501", "method"),
        (
            "POST /echo HTTP/1.1\r\nhost: app\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            "400",
            "framing",
        ),
        (
            "POST /echo HTTP/1.1\r\nhost: app\r\ntransfer-encoding: gzip\r\n\r\nabc",
            "501",
            "framing",
        ),
        ("GET /echo HTTP/1.1\r\nhost: app\r\nexpect: magic\r\n\r\n", "417", "malformed"),
        ("GET /echo HTTP/1.1\r\nho st: app\r\n\r\n", "400", "malformed"),
        ("GET app:80 HTTP/1.1\r\nhost: app\r\n\r\n", "400", "malformed"),
    ];
    for (text, want, _) in cases {
        let mut c = connect(&sc).await;
        // A request pipelined behind the refused one is never served.
        c.get_mut()
            .write_all(format!("{text}GET /echo HTTP/1.1\r\nhost: app\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let all = rest(&mut c).await;
        assert!(
            all.starts_with(&format!("HTTP/1.1 {want} ")),
            "{text:?}: {all}"
        );
        assert!(all.contains("connection: close"), "{text:?}: {all}");
        assert!(all.contains("application/problem+json"), "{text:?}: {all}");
        assert_eq!(all.matches("HTTP/1.1 ").count(), 1, "{text:?}: {all}");
    }
    let many = format!(
        "GET / HTTP/1.1\r\nhost: app\r\n{}\r\n",
        "x: y\r\n".repeat(101)
    );
    let mut c = connect(&sc).await;
    c.get_mut().write_all(many.as_bytes()).await.unwrap();
    assert!(rest(&mut c).await.starts_with("HTTP/1.1 431 "));
    assert_eq!(
        up.signals
            .requests
            .load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the app saw none of them"
    );
    let (_, m) = admin(&sc, "/metrics").await;
    for (reason, at_least) in [("method", 1.0), ("framing", 2.0), ("malformed", 3.0)] {
        let sample = format!("spillway_bad_requests_total{{reason=\"{reason}\"}}");
        assert!(metric(&m, &sample).unwrap_or(0.0) >= at_least, "{sample}");
    }
    assert!(
        metric(
            &m,
            "spillway_bad_requests_total{reason=\"header_too_large\"}"
        )
        .unwrap_or(0.0)
            >= 1.0
    );
}

#[tokio::test]
async fn an_absolute_form_target_goes_on_in_origin_form() {
    let (sc, _up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    let a = ask(
        &mut c,
        "GET http://app/echo?q=1 HTTP/1.1\r\nhost: app\r\n\r\n",
    )
    .await;
    assert_eq!(a.status, "HTTP/1.1 200 OK");
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(v["uri"], "/echo?q=1");
    // The target's authority is the request's (RFC 9112 §3.2.2): one that `Host` contradicts
    // would have the rules and the app each believe another host.
    let mut c = connect(&sc).await;
    c.get_mut()
        .write_all(b"GET http://other/echo HTTP/1.1\r\nhost: app\r\n\r\n")
        .await
        .unwrap();
    assert!(rest(&mut c).await.starts_with("HTTP/1.1 400 "));
}

#[tokio::test]
async fn a_chunked_upload_streams_to_the_app_on_the_connections_own_upstream_connection() {
    let (sc, up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    let echo = "GET /echo HTTP/1.1\r\nhost: app\r\n\r\n";
    ask(&mut c, echo).await;
    let peer = |a: &Answer| {
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        v["peer"].as_str().unwrap().to_string()
    };
    let own = peer(&ask(&mut c, echo).await);
    c.get_mut()
        .write_all(b"POST /upload HTTP/1.1\r\nhost: app\r\ntransfer-encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    // The app has the head before the body's first chunk is sent: the body streams.
    up.signals.upload_head.notified().await;
    let piece = vec![b'x'; 40_000];
    for _ in 0..5 {
        c.get_mut()
            .write_all(format!("{:x}\r\n", piece.len()).as_bytes())
            .await
            .unwrap();
        c.get_mut().write_all(&piece).await.unwrap();
        c.get_mut().write_all(b"\r\n").await.unwrap();
    }
    c.get_mut().write_all(b"0\r\n\r\n").await.unwrap();
    let a = read_answer(&mut c).await;
    assert_eq!(
        (a.status.as_str(), a.body.as_str()),
        ("HTTP/1.1 200 OK", "200000")
    );
    // Same upstream connection, still reusable after the upload.
    assert_eq!(peer(&ask(&mut c, echo).await), own);
    // A length-framed one too, its length passed on.
    let body = "y".repeat(100_000);
    let a = ask(
        &mut c,
        &format!("POST /echo HTTP/1.1\r\nhost: app\r\ncontent-length: 100000\r\n\r\n{body}"),
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(v["body"].as_str().unwrap().len(), 100_000);
    assert_eq!(v["headers"]["content-length"], "100000");
    assert_eq!(v["peer"].as_str().unwrap(), own);
}

#[tokio::test]
async fn a_broken_chunked_upload_is_a_400_and_the_app_never_gets_a_whole_request() {
    let (sc, up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    c.get_mut()
        .write_all(b"POST /upload HTTP/1.1\r\nhost: app\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        .await
        .unwrap();
    up.signals.first_bytes.notified().await;
    // A chunk size that is no hex number.
    c.get_mut().write_all(b"zz\r\nmore\r\n").await.unwrap();
    let all = rest(&mut c).await;
    assert!(all.starts_with("HTTP/1.1 400 "), "{all}");
    assert!(all.contains("connection: close"), "{all}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_clients_upload_streams_to_an_http1_app() {
    let (sc, _up) = sidecar("rules: []").await;
    let tcp = TcpStream::connect(sc.addr()).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.unwrap();
    let req = http::Request::post("http://app/upload").body(()).unwrap();
    let (resp, mut send) = h2.send_request(req, false).unwrap();
    for _ in 0..4 {
        send.send_data(Bytes::from(vec![b'z'; 30_000]), false)
            .unwrap();
    }
    send.send_data(Bytes::new(), true).unwrap();
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
        got.extend_from_slice(&chunk);
    }
    assert_eq!(String::from_utf8_lossy(&got), "120000");
}
