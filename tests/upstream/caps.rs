//! One client must not be able to open as many upstream connections as it has streams, nor
//! all clients together more than the descriptor budget allows: `limits.max_upstream_per_client`
//! and `limits.max_upstream_connections`. A stream beyond a cap waits for a connection (at most
//! `timeouts.upstream_connect`), then gets 503 with `Retry-After`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::Notify;

/// Connections open to the app now, and the most seen at once.
#[derive(Default)]
struct Open {
    now: AtomicUsize,
    most: AtomicUsize,
    /// Accepted in all.
    total: AtomicUsize,
}

struct Counted(Arc<Open>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An HTTP/1 app: `/slow` answers after 50 ms, `/held` when `release` is notified, anything
/// else at once. Counts its open connections.
async fn app(release: Arc<Notify>) -> (SocketAddr, Arc<Open>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let open = Arc::new(Open::default());
    let counts = open.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            counts.total.fetch_add(1, Ordering::SeqCst);
            let n = counts.now.fetch_add(1, Ordering::SeqCst) + 1;
            counts.most.fetch_max(n, Ordering::SeqCst);
            let counted = Counted(counts.clone());
            let release = release.clone();
            tokio::spawn(async move {
                let _counted = counted;
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let release = release.clone();
                    async move {
                        match req.uri().path() {
                            "/slow" => tokio::time::sleep(Duration::from_millis(50)).await,
                            "/held" => release.notified().await,
                            _ => {}
                        }
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, open)
}

async fn proxy(app: SocketAddr, limits: &str, connect: &str) -> spillway::Sidecar {
    let cfg = config(
        app,
        &format!(
            "workers: 1\nlimits: {{ max_h2_streams: 256, {limits} }}\ntimeouts: {{ upstream_connect: {connect} }}\n"
        ),
    );
    spillway::Sidecar::start(cfg).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_http2_client_with_200_streams_stays_within_the_caps_and_others_are_served() {
    let (app_addr, open) = app(Arc::new(Notify::new())).await;
    let sc = proxy(
        app_addr,
        "max_upstream_connections: 50, max_upstream_per_client: 20",
        "30s",
    )
    .await;
    let h2 = h2_client();
    let done = Arc::new(AtomicUsize::new(0));
    let mut streams = Vec::new();
    for _ in 0..200 {
        let (h2, done, addr) = (h2.clone(), done.clone(), sc.addr());
        streams.push(tokio::spawn(async move {
            let req = Request::get(format!("http://{addr}/slow"))
                .body(empty())
                .unwrap();
            let resp = h2.request(req).await.unwrap();
            let status = resp.status();
            let _ = resp.into_body().collect().await;
            done.fetch_add(1, Ordering::SeqCst);
            status
        }));
    }
    // Meanwhile another client is served, before the first one's streams are all answered.
    while open.now.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let (status, _, body) = get(sc.addr(), "/quick", &[]).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    assert!(
        done.load(Ordering::SeqCst) < 200,
        "the second client waited for all of the first one's streams"
    );
    for s in streams {
        assert_eq!(s.await.unwrap(), StatusCode::OK, "every stream is answered");
    }
    let most = open.most.load(Ordering::SeqCst);
    assert!(
        most <= 21,
        "{most} upstream connections at once for one client (cap 20, and one for the other)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_clients_together_stay_within_max_upstream_connections() {
    let (app_addr, open) = app(Arc::new(Notify::new())).await;
    let sc = proxy(app_addr, "max_upstream_connections: 4", "30s").await;
    let mut clients = Vec::new();
    for _ in 0..12 {
        let addr = sc.addr();
        // Each its own client connection, several requests each.
        clients.push(tokio::spawn(async move {
            let c = client();
            let mut ok = 0;
            for _ in 0..3 {
                ok += (send(&c, addr, "GET", "/slow", &[]).await.0 == StatusCode::OK) as u32;
            }
            ok
        }));
    }
    for c in clients {
        assert_eq!(c.await.unwrap(), 3, "every request is answered");
    }
    let most = open.most.load(Ordering::SeqCst);
    assert!(most <= 4, "{most} upstream connections at once (cap 4)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_finds_no_connection_in_time_gets_503_with_retry_after() {
    let release = Arc::new(Notify::new());
    let (app_addr, open) = app(release.clone()).await;
    let sc = proxy(app_addr, "max_upstream_per_client: 2", "1s").await;
    let h2 = h2_client();
    let mut streams = Vec::new();
    for _ in 0..6 {
        let (h2, addr) = (h2.clone(), sc.addr());
        streams.push(tokio::spawn(async move {
            let req = Request::get(format!("http://{addr}/held"))
                .body(empty())
                .unwrap();
            let resp = h2.request(req).await.unwrap();
            let retry = resp.headers().get("retry-after").cloned();
            (resp.status(), retry)
        }));
    }
    // Four of them wait for one of the two connections, and give up after a second (the
    // app holds the two it has until told).
    for _ in 0..400 {
        if streams.iter().filter(|s| s.is_finished()).count() >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mut answered = Vec::new();
    let mut waiting = Vec::new();
    for s in streams {
        if s.is_finished() {
            answered.push(s.await.unwrap());
        } else {
            waiting.push(s);
        }
    }
    assert_eq!(answered.len(), 4, "the streams beyond the cap");
    for (status, retry) in answered {
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(retry.is_some(), "503 without Retry-After");
    }
    assert!(open.most.load(Ordering::SeqCst) <= 2);
    // The two that got a connection are answered once the app lets them go.
    release.notify_waiters();
    for s in waiting {
        assert_eq!(s.await.unwrap().0, StatusCode::OK);
    }
}

/// Waits (bounded) until the proxy says `n` requests wait for an upstream connection.
async fn waiters(sc: &spillway::Sidecar, n: f64) {
    for _ in 0..500 {
        let text = admin(sc, "/metrics").await.1;
        if metric(&text, "spillway_upstream_connection_waiters") == Some(n) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never {n} waiters");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_that_give_up_leave_connections_reusable() {
    let release = Arc::new(Notify::new());
    let (app_addr, open) = app(release.clone()).await;
    let sc = proxy(app_addr, "max_upstream_connections: 1", "30s").await;
    // The one connection is held; three clients wait for it, then leave.
    let addr = sc.addr();
    let held = tokio::spawn(async move { get(addr, "/held", &[]).await.0 });
    while open.now.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let mut leaving = Vec::new();
    for _ in 0..3 {
        let mut s = tokio::net::TcpStream::connect(sc.addr()).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut s, b"GET /quick HTTP/1.1\r\nHost: app\r\n\r\n")
            .await
            .unwrap();
        leaving.push(s);
    }
    waiters(&sc, 3.0).await;
    drop(leaving);
    waiters(&sc, 0.0).await;
    release.notify_waiters();
    assert_eq!(held.await.unwrap(), StatusCode::OK);
    // The connection is reused from here on, not closed for waiters that are gone. One
    // client connection: a pooled client may open a second one before its first is back in
    // its pool, and the upstream connection an idle client connection keeps is not taken back
    // for another (see `Cap`), so at a cap of one the second would wait out the connect time.
    let before = open.total.load(Ordering::SeqCst);
    let stream = tokio::net::TcpStream::connect(sc.addr()).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    for _ in 0..5 {
        let req = Request::get("/quick")
            .header("host", "app")
            .body(empty())
            .unwrap();
        send.ready().await.unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.into_body().collect().await.unwrap();
    }
    let opened = open.total.load(Ordering::SeqCst) - before;
    assert!(
        opened <= 1,
        "{opened} new upstream connections for 5 requests"
    );
}
