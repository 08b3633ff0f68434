//! Each HTTP/1 client connection has an upstream connection of its own after its first
//! request (src/proxy/upstream_pool.rs): reused while it lasts, replaced without an error when the
//! upstream closed it, never asked twice for a request it was sent, handed to the next client
//! when its client leaves. An HTTP/2 client's streams borrow the worker's connections.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::*;
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// A raw HTTP/1.1 upstream: answers each request with 200 and the number of the connection it
/// came on, counts connections and requests, and closes a connection after `per_conn`
/// responses (telling `closed`).
struct Counting {
    addr: SocketAddr,
    conns: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
    closed: Arc<Notify>,
}

async fn counting(per_conn: usize) -> Counting {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(Notify::new());
    let (c, r, done) = (conns.clone(), requests.clone(), closed.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let n = c.fetch_add(1, Ordering::SeqCst) + 1;
            let (r, done) = (r.clone(), done.clone());
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                for _ in 0..per_conn {
                    // One request head (GETs only: no body).
                    if read_head(&mut stream).await.is_none() {
                        return;
                    }
                    r.fetch_add(1, Ordering::SeqCst);
                    let body = n.to_string();
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if stream.get_mut().write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                }
                let _ = stream.get_mut().shutdown().await;
                drop(stream);
                done.notify_one();
            });
        }
    });
    Counting {
        addr,
        conns,
        requests,
        closed,
    }
}

/// Sends one GET on `stream` and returns (status line, body).
async fn get_on(stream: &mut BufReader<TcpStream>, head: &str) -> (String, String) {
    let a = ask(stream, head).await;
    (a.status, a.body)
}

const GET: &str = "GET /x HTTP/1.1\r\nhost: app\r\n\r\n";

async fn client(sc: &spillway::internal::proxy::Sidecar) -> BufReader<TcpStream> {
    BufReader::new(TcpStream::connect(sc.addr()).await.unwrap())
}

/// A proxy in front of `up` whose clock (the one upstream connections idle by) the test moves.
async fn on_manual_clock(
    up: &Counting,
    yaml: &str,
) -> (
    spillway::internal::proxy::Sidecar,
    spillway::internal::limit::ManualClock,
) {
    let clock = spillway::internal::limit::ManualClock::new(1_000_000_000);
    let sc = spillway::internal::proxy::Sidecar::start_with_clock(
        config(up.addr, yaml),
        spillway::internal::limit::AnyClock::Manual(clock.clone()),
    )
    .await
    .unwrap();
    (sc, clock)
}

#[tokio::test]
async fn after_its_first_request_a_client_connection_has_an_upstream_connection_of_its_own() {
    let up = counting(usize::MAX).await;
    // One worker: one list of connections for the first requests to borrow.
    let sc = spillway::internal::proxy::Sidecar::start(config(up.addr, "workers: 1\nrules: []"))
        .await
        .unwrap();
    let (mut a, mut b) = (client(&sc).await, client(&sc).await);
    let (mut seen_a, mut seen_b) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let (status, conn) = get_on(&mut a, GET).await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        seen_a.push(conn);
        let (status, conn) = get_on(&mut b, GET).await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        seen_b.push(conn);
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 10);
    assert_eq!(
        seen_a[0], seen_b[0],
        "a first request only borrows its connection: the next first request takes it"
    );
    assert!(seen_a.iter().all(|c| *c == seen_a[0]), "{seen_a:?}");
    assert!(seen_b[1..].iter().all(|c| *c == seen_b[1]), "{seen_b:?}");
    assert_ne!(
        seen_a[1], seen_b[1],
        "one upstream connection per client connection"
    );
    assert_eq!(
        up.conns.load(Ordering::SeqCst),
        2,
        "one per client connection: the borrowed one is kept by the first client to come back"
    );
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn an_upstream_connection_closed_between_requests_is_replaced_without_an_error() {
    // The upstream closes every connection after one response, as an app with a short
    // keep-alive timeout does to an idle one.
    let up = counting(1).await;
    let sc = spillway::internal::proxy::Sidecar::start(config(up.addr, "rules: []"))
        .await
        .unwrap();
    let mut c = client(&sc).await;
    for i in 1..=3 {
        let closed = up.closed.notified();
        let (status, body) = get_on(&mut c, GET).await;
        assert_eq!(status, "HTTP/1.1 200 OK", "request {i}");
        assert_eq!(
            body,
            i.to_string(),
            "request {i} on upstream connection {i}"
        );
        // The next request finds the old connection closed.
        closed.await;
    }
    assert_eq!(
        up.requests.load(Ordering::SeqCst),
        3,
        "no request sent twice"
    );
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn an_upstream_connection_idle_past_timeouts_idle_is_not_reused() {
    let up = counting(usize::MAX).await;
    // The old name of upstream_idle, still read.
    let (sc, clock) = on_manual_clock(&up, "timeouts: { idle: 10s }\nrules: []").await;
    let mut c = client(&sc).await;
    assert_eq!(get_on(&mut c, GET).await.1, "1", "borrowed");
    assert_eq!(get_on(&mut c, GET).await.1, "1", "kept as its own");
    clock.advance(std::time::Duration::from_secs(5));
    assert_eq!(get_on(&mut c, GET).await.1, "1", "5 s idle: reused");
    clock.advance(std::time::Duration::from_secs(11));
    assert_eq!(
        get_on(&mut c, GET).await.1,
        "2",
        "11 s idle: a new connection"
    );
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn an_http2_clients_streams_borrow_the_workers_upstream_connections() {
    let up = counting(usize::MAX).await;
    let yaml = "workers: 1\ntimeouts: { upstream_idle: 10s }\nrules: []";
    let (sc, clock) = on_manual_clock(&up, yaml).await;
    let (c, addr) = (h2_client(), sc.addr());
    // Ten streams at once: each borrows a connection for its exchange, at most one each.
    let mut streams = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let c = c.clone();
        streams.spawn(async move { send(&c, addr, "GET", "/x", &[]).await });
    }
    while let Some(answer) = streams.join_next().await {
        let (status, _, body) = answer.unwrap();
        assert_eq!(status, http::StatusCode::OK);
        assert!(body.parse::<usize>().is_ok(), "{body}");
    }
    let conns = up.conns.load(Ordering::SeqCst);
    assert!((1..=10).contains(&conns), "{conns} connections");
    // Each gave its connection back at its response's end: one after the other, the streams
    // take them again.
    for _ in 0..5 {
        let (status, _, body) = send(&c, addr, "GET", "/x", &[]).await;
        assert_eq!(status, http::StatusCode::OK);
        assert!(body.parse::<usize>().unwrap() <= conns, "{body}");
    }
    assert_eq!(up.conns.load(Ordering::SeqCst), conns, "no new connection");
    // They are the worker's own connections, idle by the proxy's clock (hyper's pool would go
    // by the real one): past `timeouts.idle`, none is reused.
    clock.advance(std::time::Duration::from_secs(11));
    let (_, _, body) = send(&c, addr, "GET", "/x", &[]).await;
    assert_eq!(body, (conns + 1).to_string(), "a new connection");
    assert_eq!(up.requests.load(Ordering::SeqCst), 16);
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_request_without_host_gets_the_upstreams_authority() {
    let (sc, up) = sidecar("rules: []").await;
    let mut c = client(&sc).await;
    let (status, body) = get_on(&mut c, "GET /echo HTTP/1.0\r\n\r\n").await;
    assert_eq!(status, "HTTP/1.0 200 OK");
    let echo: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(echo["headers"]["host"], up.addr.to_string(), "{echo}");
    assert_eq!(echo["uri"], "/echo", "origin-form on the wire: {echo}");
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_closed_client_connection_leaves_its_upstream_connection_to_the_next_one() {
    let up = counting(usize::MAX).await;
    // One worker: the idle upstream connections are per worker.
    let sc = spillway::internal::proxy::Sidecar::start(config(up.addr, "workers: 1\nrules: []"))
        .await
        .unwrap();
    for i in 1..=4 {
        let mut c = client(&sc).await;
        let first = get_on(&mut c, GET).await;
        let second = get_on(&mut c, GET).await;
        assert_eq!(first.0, "HTTP/1.1 200 OK", "client connection {i}");
        assert_eq!(second.0, "HTTP/1.1 200 OK", "client connection {i}");
        // The first client's first request makes upstream connection 1 and gives it back,
        // its second keeps it; every later client takes it over.
        assert_eq!(
            (first.1.as_str(), second.1.as_str()),
            ("1", "1"),
            "client connection {i}"
        );
        drop(c);
        // The proxy has seen the close (and parked the upstream connection) once its
        // connection gauge is back to zero.
        loop {
            let text = admin(&sc, "/metrics").await.1;
            if metric(&text, "spillway_connections") == Some(0.0) {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
    assert_eq!(up.conns.load(Ordering::SeqCst), 1);
    sc.shutdown();
    sc.wait().await;
}

/// An HTTP/2 connection to the sidecar, driven in the background (h2's own client, so that a
/// request's frames can be written together or apart).
async fn h2_conn(sc: &spillway::internal::proxy::Sidecar) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = TcpStream::connect(sc.addr()).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    h2.ready().await.unwrap()
}

/// What a request waits for before its second DATA frame, and that frame.
type Then<'a> = (
    std::pin::Pin<Box<dyn std::future::Future<Output = ()> + 'a>>,
    &'static [u8],
);

/// Sends `body` to `path` on `h2` in one DATA frame (with the head, as nothing is written
/// between them) or, with `then`, that frame and, once `then` is ready, a second one; returns
/// the response's body.
async fn h2_post(
    h2: &mut h2::client::SendRequest<bytes::Bytes>,
    addr: SocketAddr,
    path: &str,
    body: &'static [u8],
    then: Option<Then<'_>>,
) -> String {
    let length = body.len() + then.as_ref().map_or(0, |(_, more)| more.len());
    let req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-length", length)
        .body(())
        .unwrap();
    let (resp, mut stream) = h2.send_request(req, false).unwrap();
    stream
        .send_data(bytes::Bytes::from_static(body), then.is_none())
        .unwrap();
    if let Some((ready, more)) = then {
        ready.await;
        stream
            .send_data(bytes::Bytes::from_static(more), true)
            .unwrap();
    }
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), http::StatusCode::OK);
    let mut body = resp.into_body();
    let mut text = Vec::new();
    while let Some(piece) = body.data().await {
        let piece = piece.unwrap();
        body.flow_control().release_capacity(piece.len()).unwrap();
        text.extend_from_slice(&piece);
    }
    String::from_utf8(text).unwrap()
}

#[tokio::test]
async fn an_http2_streams_small_body_that_came_with_its_head_borrows_a_workers_connection() {
    let (sc, _up) = sidecar("workers: 1\nrules: []").await;
    let mut h2 = h2_conn(&sc).await;
    let (_, _, first) = send(&h2_client(), sc.addr(), "GET", "/echo", &[]).await;
    let borrowed: serde_json::Value = serde_json::from_str(&first).unwrap();
    let echo = h2_post(&mut h2, sc.addr(), "/echo", b"hello", None).await;
    let echo: serde_json::Value = serde_json::from_str(&echo).unwrap();
    assert_eq!(echo["body"], "hello", "{echo}");
    assert_eq!(echo["headers"]["content-length"], "5", "{echo}");
    // The connection the GET borrowed and gave back: hyper's pool would have used its own.
    assert_eq!(echo["peer"], borrowed["peer"], "{echo}");
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn an_http2_streams_small_body_still_coming_is_streamed_whole() {
    let (sc, up) = sidecar("workers: 1\nrules: []").await;
    let mut h2 = h2_conn(&sc).await;
    // The first frame is read (it reaches the app) before the second is sent: what the proxy
    // read of the body goes upstream ahead of the rest.
    let first_bytes = up.signals.first_bytes.notified();
    let at_app = Box::pin(async move {
        tokio::time::timeout(std::time::Duration::from_secs(10), first_bytes)
            .await
            .expect("the first piece reached the app");
    });
    let count = h2_post(
        &mut h2,
        sc.addr(),
        "/upload",
        b"hello",
        Some((at_app, b" world")),
    )
    .await;
    assert_eq!(count, "11");
    sc.shutdown();
    sc.wait().await;
}
