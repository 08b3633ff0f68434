//! A body on a GET or HEAD must never become a request the limiter did not see. Many apps
//! ignore such a body (Python's `http.server` never reads it): on a kept-alive connection its
//! bytes are then parsed as the next request. The proxy forwards the request with
//! `Connection: close` and closes that upstream connection after the answer
//! (`bodies_on_get: forward`, the default), or answers 400 (`bodies_on_get: reject`).

// A test app's log, not the request path.
#![allow(clippy::disallowed_types)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use crate::common::*;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// An app that, like `http.server`, reads request heads only (a GET's body is never read) and
/// keeps the connection unless the request says `Connection: close`. Every request line it
/// parses is recorded.
async fn body_ignoring_app() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let addr = raw_server(move |mut s| {
        let log = log.clone();
        async move {
            let mut buf = Vec::new();
            loop {
                while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    buf.drain(..end + 4);
                    let line = head.lines().next().unwrap_or_default().to_string();
                    log.lock().unwrap().push(line.clone());
                    let path = line.split(' ').nth(1).unwrap_or("").to_string();
                    // A HEAD's answer says a length of 0, so that a raw reader needs no body.
                    let answer = match line.starts_with("head ") {
                        true => "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_string(),
                        false => format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{path}",
                            path.len()
                        ),
                    };
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    if head.contains("\nconnection: close") {
                        // A lingering close: what the client still sends is read and
                        // dropped, so that the answer is not lost to a reset.
                        let _ = s.shutdown().await;
                        let mut sink = [0u8; 4096];
                        while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
                        return;
                    }
                }
                let mut chunk = [0u8; 4096];
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
        }
    })
    .await;
    (addr, seen)
}

const SMUGGLED: &str = "GET /admin HTTP/1.1\r\nhost: app\r\n\r\n";

async fn proxy(app: SocketAddr, rest: &str) -> spillway::Sidecar {
    // One worker: every client's requests share its upstream connections.
    let cfg = config(app, &format!("workers: 1\n{rest}"));
    spillway::Sidecar::start(cfg).await.unwrap()
}

async fn raw(addr: SocketAddr) -> BufReader<TcpStream> {
    BufReader::new(TcpStream::connect(addr).await.unwrap())
}

/// GETs and HEADs whose bodies carry a request, in every framing the proxy takes: a small
/// body read with the head, a large one streamed, a chunked one. Each with a label.
fn attacks() -> Vec<(&'static str, String)> {
    let padded = format!("{SMUGGLED}{}", "x".repeat(20_000));
    let chunked = format!("{:x}\r\n{SMUGGLED}\r\n0\r\n\r\n", SMUGGLED.len());
    vec![
        (
            "small GET body",
            format!(
                "GET /public HTTP/1.1\r\nHost: app\r\nContent-Length: {}\r\n\r\n{SMUGGLED}",
                SMUGGLED.len()
            ),
        ),
        (
            "small HEAD body",
            format!(
                "HEAD /public HTTP/1.1\r\nHost: app\r\nContent-Length: {}\r\n\r\n{SMUGGLED}",
                SMUGGLED.len()
            ),
        ),
        (
            "large GET body",
            format!(
                "GET /public HTTP/1.1\r\nHost: app\r\nContent-Length: {}\r\n\r\n{padded}",
                padded.len()
            ),
        ),
        (
            "small DELETE body",
            format!(
                "DELETE /public HTTP/1.1\r\nHost: app\r\nContent-Length: {}\r\n\r\n{SMUGGLED}",
                SMUGGLED.len()
            ),
        ),
        (
            "chunked GET body",
            format!(
                "GET /public HTTP/1.1\r\nHost: app\r\nTransfer-Encoding: chunked\r\n\r\n{chunked}"
            ),
        ),
    ]
}

/// Sends `text` and reads the answer's status line and head (a HEAD's answer has no body).
async fn ask_head(c: &mut BufReader<TcpStream>, text: &str) -> (String, String) {
    use tokio::io::AsyncBufReadExt;
    c.get_mut().write_all(text.as_bytes()).await.unwrap();
    let mut status = String::new();
    c.read_line(&mut status).await.unwrap();
    let mut head = String::new();
    loop {
        let mut line = String::new();
        c.read_line(&mut line).await.unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
        head.push_str(&line.to_ascii_lowercase());
    }
    (status, head)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_body_the_app_ignores_never_becomes_a_request() {
    let (app, seen) = body_ignoring_app().await;
    let sc = proxy(app, "").await;
    for (label, attack) in attacks() {
        let mut c = raw(sc.addr()).await;
        let (status, _) = ask_head(&mut c, &attack).await;
        assert!(status.contains(" 200 "), "{label}: {status}");
        if !label.contains("HEAD") {
            let mut body = [0u8; 7];
            c.read_exact(&mut body).await.unwrap();
            assert_eq!(&body, b"/public", "{label}");
        }
        // A second request on the same client connection, and one from another client: the
        // upstream connection the body went on is never used again.
        let again = ask(&mut c, "GET /again HTTP/1.1\r\nHost: app\r\n\r\n").await;
        assert_eq!(again.body, "/again", "{label}");
        let mut other = raw(sc.addr()).await;
        let theirs = ask(&mut other, "GET /other HTTP/1.1\r\nHost: app\r\n\r\n").await;
        assert_eq!(theirs.body, "/other", "{label}");
    }
    // The same over HTTP/2 (a GET with DATA frames).
    let h2 = h2_client_with_bodies();
    for body in [
        SMUGGLED.to_string(),
        format!("{SMUGGLED}{}", "y".repeat(20_000)),
    ] {
        let req = http::Request::get(format!("http://{}/public", sc.addr()))
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = h2.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let _ = resp.into_body().collect().await;
        let (_, _, body) = get(sc.addr(), "/other", &[]).await;
        assert_eq!(body, "/other");
    }
    let lines = seen.lock().unwrap().clone();
    assert!(
        lines.iter().all(|l| !l.contains("/admin")),
        "the app ran a request the limiter never saw: {lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("get /public")),
        "{lines:?}"
    );
}

fn h2_client_with_bodies() -> hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
> {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_on_get_reject_answers_400_and_forwards_nothing() {
    let (app, seen) = body_ignoring_app().await;
    let sc = proxy(app, "bodies_on_get: reject\n").await;
    for (label, attack) in attacks().into_iter().filter(|(l, _)| !l.contains("DELETE")) {
        let mut c = raw(sc.addr()).await;
        let (status, head) = ask_head(&mut c, &attack).await;
        assert!(status.contains(" 400 "), "{label}: {status}");
        assert!(head.contains("connection: close"), "{label}: {head}");
    }
    // A GET without a body, and a POST with one, are not touched.
    let mut c = raw(sc.addr()).await;
    let plain = ask(
        &mut c,
        "GET /plain HTTP/1.1\r\nHost: app\r\nContent-Length: 0\r\n\r\n",
    )
    .await;
    assert_eq!(plain.body, "/plain");
    let lines = seen.lock().unwrap().clone();
    assert!(
        lines
            .iter()
            .all(|l| !l.contains("/public") && !l.contains("/admin")),
        "{lines:?}"
    );
    let text = admin(&sc, "/metrics").await.1;
    assert!(
        metric(&text, "spillway_bad_requests_total{reason=\"body_on_get\"}").unwrap_or(0.0) >= 4.0,
        "{text}"
    );
}
