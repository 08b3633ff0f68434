//! `timeouts.client_idle` between requests: an HTTP/1 connection whose requests streamed their
//! bodies (a client that streams its uploads) waits `client_idle`, not `header_read`, for its
//! next request; an HTTP/2 connection with no open stream is closed with GOAWAY after
//! `client_idle`, and one with a stream open is not.

use std::time::Duration;

use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A chunked upload: its body is streamed (read as the request goes upstream).
const CHUNKED: &str =
    "POST /upload HTTP/1.1\r\nhost: app\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n";

/// A load balancer reuses an idle connection after a minute; one after two streamed uploads
/// in a row must not be closed after `header_read` (when hyper served such connections, it
/// was).
#[tokio::test]
async fn a_connection_after_streamed_uploads_waits_client_idle_between_requests() {
    let (sc, _up) = sidecar("timeouts: { header_read: 200ms, client_idle: 30s }\nrules: []").await;
    let mut c = BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
    for _ in 0..2 {
        let a = ask(&mut c, CHUNKED).await;
        assert_eq!(a.body, "5");
    }
    // Idle for three times header_read: the connection is still there for the next request.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let a = ask(&mut c, "GET /x HTTP/1.1\r\nhost: app\r\n\r\n").await;
    assert_eq!(
        a.body, "ok",
        "an idle connection after streamed uploads was closed before client_idle"
    );
    let a = ask(&mut c, CHUNKED).await;
    assert_eq!(a.body, "5");
    // A head begun and not finished is still bounded by header_read from its first byte.
    tokio::time::sleep(Duration::from_millis(600)).await;
    c.get_mut().write_all(b"GET /x HTTP/1.1\r\n").await.unwrap();
    assert!(at_end(&mut c).await, "a half-sent head kept its connection");
    sc.shutdown();
    sc.wait().await;
}

/// The same connection idle past `client_idle` is closed.
#[tokio::test]
async fn a_connection_after_streamed_uploads_is_closed_after_client_idle() {
    let (sc, _up) =
        sidecar("timeouts: { header_read: 200ms, client_idle: 400ms }\nrules: []").await;
    let mut c = BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
    for _ in 0..2 {
        let a = ask(&mut c, CHUNKED).await;
        assert_eq!(a.body, "5");
    }
    assert!(at_end(&mut c).await, "an idle connection stayed open");
    sc.shutdown();
    sc.wait().await;
}

/// An HTTP/2 connection (h2's own client) and the task driving it, whose output says how the
/// connection ended.
async fn h2_conn(
    sc: &spillway::internal::proxy::Sidecar,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(sc.addr()).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    let driven = tokio::spawn(conn);
    (h2.ready().await.unwrap(), driven)
}

async fn h2_get(h2: &mut h2::client::SendRequest<bytes::Bytes>, path: &str) -> String {
    let req = http::Request::get(format!("http://app{path}"))
        .body(())
        .unwrap();
    let (resp, _) = h2.send_request(req, true).unwrap();
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), http::StatusCode::OK);
    let mut body = resp.into_body();
    let mut text = Vec::new();
    while let Some(piece) = body.data().await {
        text.extend_from_slice(&piece.unwrap());
    }
    String::from_utf8(text).unwrap()
}

#[tokio::test]
async fn an_idle_http2_connection_is_closed_with_goaway_after_client_idle() {
    let (sc, _up) = sidecar("timeouts: { client_idle: 300ms }\nrules: []").await;
    let (mut h2, driven) = h2_conn(&sc).await;
    assert_eq!(h2_get(&mut h2, "/x").await, "ok");
    let ended = tokio::time::timeout(Duration::from_secs(20), driven)
        .await
        .expect("an idle HTTP/2 connection stayed open");
    ended
        .unwrap()
        .expect("the connection ended with GOAWAY, not an error");
    // A connection that never opens a stream is closed the same way.
    let (_h2, driven) = h2_conn(&sc).await;
    let ended = tokio::time::timeout(Duration::from_secs(20), driven)
        .await
        .expect("an HTTP/2 connection without streams stayed open");
    ended.unwrap().expect("ended with GOAWAY");
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn an_http2_connection_with_an_open_stream_outlives_client_idle() {
    let (sc, up) = sidecar("timeouts: { client_idle: 300ms }\nrules: []").await;
    let (h2, driven) = h2_conn(&sc).await;
    let held = up.signals.held.notified();
    let answer = tokio::spawn({
        let mut h2 = h2.clone();
        async move { h2_get(&mut h2, "/hold").await }
    });
    held.await;
    // The stream stays open for three times client_idle.
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(!driven.is_finished(), "closed with a stream open");
    up.signals.release.notify_one();
    assert_eq!(answer.await.unwrap(), "released");
    // Once idle, it goes.
    let ended = tokio::time::timeout(Duration::from_secs(20), driven)
        .await
        .expect("an idle HTTP/2 connection stayed open");
    ended.unwrap().expect("ended with GOAWAY");
    sc.shutdown();
    sc.wait().await;
}

/// A client that opens HTTP/2 and then never answers a PING: the GOAWAY that closes an idle
/// connection waits for that answer (h2's graceful shutdown), so without a bound the
/// connection stayed open for as long as the client liked.
#[tokio::test]
async fn an_idle_http2_client_that_never_answers_ping_is_still_closed() {
    let (sc, _up) =
        sidecar("timeouts: { client_idle: 300ms, header_read: 500ms }\nrules: []").await;
    let mut c = TcpStream::connect(sc.addr()).await.unwrap();
    // The preface, empty SETTINGS, and an ACK of the server's SETTINGS; then silence.
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    c.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    c.write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0]).await.unwrap();
    let mut seen = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(20), c.read_to_end(&mut seen)).await;
    assert!(
        matches!(closed, Ok(Ok(_)) | Ok(Err(_))),
        "an HTTP/2 connection whose client ignores PING stayed open"
    );
    sc.shutdown();
    sc.wait().await;
}
