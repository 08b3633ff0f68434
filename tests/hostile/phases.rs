//! Every phase of a request past its head is bounded (issue 40), tried as the attacker sends
//! it against the release binary's code on loopback: HTTP/2 response buffers a client never
//! reads.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// What the big-response app answers with: about the size the attacker asked for.
static BIG: [u8; 400_000] = [b'x'; 400_000];

/// An app that answers every request with [`BIG`] (sent from static memory, so that the app
/// costs the test process nothing per response), counting the requests it has seen.
async fn big_app() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let counted = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let service = service_fn(move |_req| {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async move {
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from_static(&BIG),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, seen)
}

/// A TCP connection that stops reading when told (its writes go on): the client of an
/// attacker that asks and never takes the answers.
struct StopReading {
    tcp: TcpStream,
    stop: Arc<AtomicBool>,
}

impl AsyncRead for StopReading {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.stop.load(Ordering::SeqCst) {
            return Poll::Pending;
        }
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for StopReading {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

/// The attacker on one connection: the largest windows HTTP/2 allows, `streams`
/// requests for big responses, and not one byte read after them. Returns what keeps the
/// connection open.
async fn never_reading_h2(proxy: std::net::SocketAddr, streams: usize) -> impl Drop {
    let stop = Arc::new(AtomicBool::new(false));
    let io = StopReading {
        tcp: TcpStream::connect(proxy).await.unwrap(),
        stop: stop.clone(),
    };
    let (mut h2, conn) = h2::client::Builder::new()
        .initial_window_size(i32::MAX as u32)
        .initial_connection_window_size(i32::MAX as u32)
        .handshake::<_, Bytes>(io)
        .await
        .unwrap();
    let driver = tokio::spawn(conn);
    let mut pending = Vec::new();
    for _ in 0..streams {
        let Ok(ready) = h2.ready().await else { break };
        h2 = ready;
        let req = http::Request::get(format!("http://{proxy}/big"))
            .body(())
            .unwrap();
        // Past the proxy's `max_h2_streams` the client is refused: the attacker gets what
        // it allows.
        let Ok((resp, _)) = h2.send_request(req, true) else {
            break;
        };
        pending.push(resp);
    }
    // The requests are written by the driver whatever the reads do.
    stop.store(true, Ordering::SeqCst);
    /// The connection's driver and its streams: dropping a stream's handle would reset it.
    struct Held {
        driver: tokio::task::JoinHandle<Result<(), h2::Error>>,
        _streams: Vec<h2::client::ResponseFuture>,
    }
    impl Drop for Held {
        fn drop(&mut self) {
            self.driver.abort();
        }
    }
    Held {
        driver,
        _streams: pending,
    }
}

/// The most memory the process has been resident in, from its start (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// Waits until the app has seen no new request and the proxy's resident memory has not
/// grown for a second (the attack has taken what it can), at most `within`.
async fn settled(pid: u32, seen: &AtomicUsize, within: Duration) {
    let end = tokio::time::Instant::now() + within;
    let mut last = (usize::MAX, 0);
    let mut still = 0;
    while tokio::time::Instant::now() < end && still < 10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = (seen.load(Ordering::SeqCst), peak_rss(pid));
        still = if now == last { still + 1 } else { 0 };
        last = now;
    }
}

fn proxy_config(app: std::net::SocketAddr, extra: &str) -> std::path::PathBuf {
    let yaml = format!(
        "service: t\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{app}\n{extra}rules: []\n"
    );
    temp_file(&format!("phases-{}.yaml", fastrand_name()), &yaml)
}

fn fastrand_name() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// What an attack of `connections` never-reading HTTP/2 connections left: the proxy's peak
/// resident memory before and after, the responses the app was asked for, and the
/// connections the proxy closed for its budget.
struct Aftermath {
    before: u64,
    peak: u64,
    asked: usize,
    shed: f64,
}

impl Aftermath {
    /// The chart's sidecar limit is 128 Mi: the proxy stays well under it.
    fn fits_a_sidecar(&self) {
        // For BENCHMARKS.md (`-- --nocapture`).
        eprintln!(
            "peak {} MiB (from {} MiB), {} responses asked of the app, {} connections closed",
            self.peak >> 20,
            self.before >> 20,
            self.asked,
            self.shed
        );
        assert!(
            self.peak < 96 << 20,
            "the proxy's memory peaked at {} MiB (from {} MiB) for {} never-read responses",
            self.peak >> 20,
            self.before >> 20,
            self.asked
        );
    }
}

async fn never_read(connections: usize) -> Aftermath {
    let (app, seen) = big_app().await;
    let path = proxy_config(app, "");
    let mut proxy = Proc::spawn(&["proxy", "--config", path.to_str().unwrap()]);
    let pid = proxy.child.id();
    let before = peak_rss(pid);
    let mut attackers = Vec::new();
    for _ in 0..connections {
        attackers.push(never_reading_h2(proxy.addr, 256).await);
    }
    settled(pid, &seen, Duration::from_secs(30)).await;

    // A well-behaved client on its own connection still gets a whole big response.
    let (status, _, body) = send(&h2_client(), proxy.addr, "GET", "/big", &[]).await;
    assert_eq!(status, 200);
    assert_eq!(body.len(), BIG.len());

    let peak = peak_rss(pid);
    let (_, _, metrics) = get(proxy.admin, "/metrics", &[]).await;
    let shed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("spillway_h2_connections_shed_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    proxy.kill();
    drop(attackers);
    Aftermath {
        before,
        peak,
        asked: seen.load(Ordering::SeqCst),
        shed,
    }
}

/// 1. HTTP/2 response buffers: 16 connections of 256 streams each, every one asking for
/// 400 KB and reading nothing, fit the chart's 128 Mi with room to spare (they held 1.5 GiB
/// before the budgets), and a client on another connection is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_read_http2_responses_stay_within_the_memory_budget() {
    never_read(16).await.fits_a_sidecar();
}

/// The next attacker opens more such connections than the process's budget holds: the
/// connections holding the most are closed, and memory stays where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_process_budget_the_connections_holding_most_are_closed() {
    let a = never_read(48).await;
    assert!(a.shed >= 1.0, "no connection was closed for the budget");
    a.fits_a_sidecar();
}

/// The next request head an app reads from `s` (what it read past it stays in `buf`);
/// `None` at the connection's end.
async fn next_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(buf.drain(..i + 4).collect());
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// An app that answers every request with a head and the first bytes of a body it never
/// finishes; each connection's end (the proxy closing it) is told on `closed`.
async fn stalling_app() -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<()>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let addr = raw_server(move |mut s| {
        let tx = tx.clone();
        async move {
            if next_head(&mut s, &mut Vec::new()).await.is_none() {
                return;
            }
            let mut buf = vec![0u8; 4096];
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\nfirst bytes")
                .await;
            // Stalled: nothing more, until the proxy closes its end.
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
            let _ = tx.send(());
        }
    })
    .await;
    (addr, rx)
}

/// Reads a response's head from a raw HTTP/1 connection: its status line.
async fn read_head(c: &mut tokio::io::BufReader<TcpStream>) -> String {
    use tokio::io::AsyncBufReadExt;
    let mut status = String::new();
    c.read_line(&mut status).await.unwrap();
    loop {
        let mut line = String::new();
        c.read_line(&mut line).await.unwrap();
        if line == "\r\n" || line.is_empty() {
            return status.trim_end().to_string();
        }
    }
}

/// Whether the proxy closes `c` within 10 s, whatever it sent before.
async fn closes(c: &mut tokio::io::BufReader<TcpStream>) -> bool {
    use tokio::io::AsyncReadExt;
    let mut rest = Vec::new();
    matches!(
        tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut rest)).await,
        Ok(Ok(_))
    )
}

/// The stalling app behind a sidecar of `yaml` (timeouts and rules); its closed connections.
async fn stalling_sidecar(
    yaml: &str,
) -> (spillway::Sidecar, tokio::sync::mpsc::UnboundedReceiver<()>) {
    let (app, closed) = stalling_app().await;
    (
        spillway::Sidecar::start(config(app, yaml)).await.unwrap(),
        closed,
    )
}

/// Asks `path` of the stalling app over HTTP/1 and sees its head; the connection, held.
async fn stalled_h1(proxy: std::net::SocketAddr, path: &str) -> tokio::io::BufReader<TcpStream> {
    let mut c = tokio::io::BufReader::new(TcpStream::connect(proxy).await.unwrap());
    let ask = format!("GET {path} HTTP/1.1\r\nHost: app\r\n\r\n");
    tokio::io::AsyncWriteExt::write_all(c.get_mut(), ask.as_bytes())
        .await
        .unwrap();
    assert_eq!(read_head(&mut c).await, "HTTP/1.1 200 OK");
    c
}

/// Asks `path` of the stalling app over HTTP/2: its stream must be reset within 10 s.
async fn reset_h2(proxy: std::net::SocketAddr, path: &str) {
    let resp = h2_client()
        .request(
            http::Request::get(format!("http://{proxy}{path}"))
                .body(empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = tokio::time::timeout(
        Duration::from_secs(10),
        http_body_util::BodyExt::collect(resp.into_body()),
    )
    .await
    .expect("the stream was never reset");
    assert!(body.is_err(), "a body cut short must not look whole");
}

/// Whether the stalling app saw a connection of its closed within 10 s.
async fn upstream_closed(closed: &mut tokio::sync::mpsc::UnboundedReceiver<()>) -> bool {
    tokio::time::timeout(Duration::from_secs(10), closed.recv())
        .await
        .is_ok()
}

/// 2. An app that sends a head and stalls is given up after `timeouts.upstream_body_idle`:
/// the HTTP/1 client's connection closes (its response cut short), and the upstream
/// connection is closed too.
#[tokio::test]
async fn an_upstream_body_silent_past_its_idle_timeout_is_given_up() {
    let (sc, mut closed) =
        stalling_sidecar("timeouts: { upstream_body_idle: 1s }\nrules: []\n").await;
    let mut c = stalled_h1(sc.addr(), "/stall").await;
    assert!(
        closes(&mut c).await,
        "the client's connection was never closed"
    );
    assert!(
        upstream_closed(&mut closed).await,
        "the upstream connection was never closed"
    );
    let (_, m) = admin(&sc, "/metrics").await;
    assert_eq!(
        metric(&m, "spillway_upstream_errors_total{kind=\"body_idle\"}"),
        Some(1.0)
    );
}

/// The same for an HTTP/2 client: its stream is reset, its connection and other streams go on.
#[tokio::test]
async fn an_http2_streams_upstream_body_silent_past_its_idle_timeout_is_reset() {
    let (sc, mut closed) =
        stalling_sidecar("timeouts: { upstream_body_idle: 1s }\nrules: []\n").await;
    reset_h2(sc.addr(), "/stall").await;
    assert!(
        upstream_closed(&mut closed).await,
        "the upstream connection was never closed"
    );
}

/// An HTTP/1 client that leaves while its response waits on the app releases the upstream
/// connection at once, not at the idle timeout (here the default, 60 s).
#[tokio::test]
async fn an_http1_client_that_leaves_mid_response_releases_the_upstream() {
    let (sc, mut closed) = stalling_sidecar("rules: []\n").await;
    drop(stalled_h1(sc.addr(), "/stall").await);
    assert!(
        upstream_closed(&mut closed).await,
        "the upstream connection is still held for a client that left"
    );
}

/// A connection to `to` from the loopback address `from` (127.0.0.x: each its own client).
async fn connect_from(from: [u8; 4], to: std::net::SocketAddr) -> tokio::io::BufReader<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::from((from, 0))).unwrap();
    tokio::io::BufReader::new(socket.connect(to).await.unwrap())
}

/// One request on a kept-alive connection; its status line.
async fn one_get(c: &mut tokio::io::BufReader<TcpStream>) -> String {
    ask(c, "GET / HTTP/1.1\r\nHost: app\r\n\r\n").await.status
}

/// 3a. One address is stopped at `max_connections_per_client`: its next connection is
/// refused with 429 and closed, while another address is served.
#[tokio::test]
async fn one_address_is_stopped_at_its_connection_cap() {
    let (sc, _up) = sidecar(
        "limits: { max_connections_per_client: 4, connections_per_client_exempt: [] }\nrules: []\n",
    )
    .await;
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut c = connect_from([127, 0, 0, 2], sc.addr()).await;
        assert_eq!(one_get(&mut c).await, "HTTP/1.1 200 OK");
        held.push(c);
    }
    let mut fifth = connect_from([127, 0, 0, 2], sc.addr()).await;
    tokio::io::AsyncWriteExt::write_all(fifth.get_mut(), b"GET / HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    let a = read_answer(&mut fifth).await;
    assert_eq!(a.status, "HTTP/1.1 429 Too Many Requests", "{}", a.head);
    assert!(a.head.contains("connection: close"), "{}", a.head);
    assert!(a.head.contains("x-request-id: "), "{}", a.head);
    assert!(closes(&mut fifth).await);
    let mut other = connect_from([127, 0, 0, 3], sc.addr()).await;
    assert_eq!(one_get(&mut other).await, "HTTP/1.1 200 OK");
    // A place given back is taken again, once the proxy has seen it closed (3 held, 1 other).
    drop(held.pop());
    for _ in 0..500 {
        let (_, m) = admin(&sc, "/metrics").await;
        if metric(&m, "spillway_connections") == Some(4.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut again = connect_from([127, 0, 0, 2], sc.addr()).await;
    assert_eq!(one_get(&mut again).await, "HTTP/1.1 200 OK");
    let (_, m) = admin(&sc, "/metrics").await;
    assert!(
        metric(
            &m,
            "spillway_connections_refused_total{reason=\"per_client\"}"
        ) >= Some(1.0),
        "{m}"
    );
}

/// 3b. Clients that hold every connection idle between requests do not lock a new client
/// out: at `max_connections`, an idle kept-alive connection is closed for it (loopback
/// addresses are exempt from the per-client cap, as a mesh's proxy would be).
#[tokio::test]
async fn at_the_connection_cap_an_idle_kept_alive_connection_makes_room() {
    let (sc, _up) = sidecar("workers: 1\nlimits: { max_connections: 8 }\nrules: []\n").await;
    let mut idle = Vec::new();
    for i in 0..8u8 {
        let mut c = connect_from([127, 0, 0, 10 + i], sc.addr()).await;
        assert_eq!(one_get(&mut c).await, "HTTP/1.1 200 OK");
        idle.push(c);
    }
    let mut new = connect_from([127, 0, 0, 30], sc.addr()).await;
    tokio::io::AsyncWriteExt::write_all(new.get_mut(), b"GET / HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    // Without room made, it would wait for a kept-alive connection's `client_idle` (75 s).
    let a = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut new))
        .await
        .expect("the new client was not served while others idled on every connection");
    assert_eq!(a.status, "HTTP/1.1 200 OK");
    let mut closed = 0;
    for c in &mut idle {
        closed += closes_now(c).await as usize;
    }
    assert_eq!(
        closed, 1,
        "exactly one idle connection is closed for the newcomer"
    );
}

/// Whether the proxy has closed `c` (read at once, without waiting for more).
async fn closes_now(c: &mut tokio::io::BufReader<TcpStream>) -> bool {
    use tokio::io::AsyncReadExt;
    let mut one = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_millis(200), c.read(&mut one)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

/// 3c. An HTTP/2 connection that sends its preface (and settings) but never a request is
/// closed at `header_read`, as an HTTP/1 connection that never sends its head is, not kept
/// for `client_idle` and a GOAWAY's wait on top.
#[tokio::test]
async fn an_http2_connection_without_a_first_request_is_closed_at_header_read() {
    let (sc, _up) = sidecar("timeouts: { header_read: 1s }\nrules: []\n").await;
    for opening in [
        &b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"[..],
        // The preface and an empty SETTINGS frame.
        &b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"[..],
    ] {
        let mut c = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
        tokio::io::AsyncWriteExt::write_all(c.get_mut(), opening)
            .await
            .unwrap();
        assert!(
            closes(&mut c).await,
            "held past header_read after {opening:?}"
        );
    }
}

/// Sends a POST head announcing `length` bytes and the first `first` of them.
async fn post_head(
    c: &mut tokio::io::BufReader<TcpStream>,
    path: &str,
    length: usize,
    first: usize,
) {
    let head = format!("POST {path} HTTP/1.1\r\nHost: app\r\ncontent-length: {length}\r\n\r\n");
    let mut out = head.into_bytes();
    out.extend(std::iter::repeat_n(b'u', first));
    tokio::io::AsyncWriteExt::write_all(c.get_mut(), &out)
        .await
        .unwrap();
}

/// 5. `upstream_response` starts when the upload is whole: an upload that takes longer than
/// it, its pieces coming steadily, is answered by the app.
#[tokio::test]
async fn a_slow_steady_upload_is_not_cut_by_the_response_timeout() {
    let (sc, up) = sidecar("timeouts: { upstream_response: 1s }\nrules: []\n").await;
    let mut c = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
    let piece = 8 * 1024;
    post_head(&mut c, "/upload", 10 * piece, piece * 3).await;
    up.signals.first_bytes.notified().await;
    for _ in 3..10 {
        // Steady, and slower than the response timeout in all.
        tokio::time::sleep(Duration::from_millis(300)).await;
        tokio::io::AsyncWriteExt::write_all(c.get_mut(), &vec![b'u'; piece])
            .await
            .unwrap();
    }
    let a = read_answer(&mut c).await;
    assert_eq!(a.status, "HTTP/1.1 200 OK", "{}", a.body);
    assert_eq!(a.body, (10 * piece).to_string());
}

/// 2. A client body that stops coming gets 408 after `timeouts.client_body_idle`, not the
/// app's 504 at `upstream_response` (here longer than the test waits).
#[tokio::test]
async fn a_client_body_that_stops_gets_408() {
    let (sc, up) = sidecar("timeouts: { client_body_idle: 1s }\nrules: []\n").await;
    let mut c = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
    post_head(&mut c, "/upload", 100_000, 20_000).await;
    up.signals.first_bytes.notified().await;
    let a = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut c))
        .await
        .expect("no answer to a body that stopped");
    assert_eq!(a.status, "HTTP/1.1 408 Request Timeout", "{}", a.body);
    assert!(a.head.contains("connection: close"), "{}", a.head);
}

/// 2. The same on a kept-alive connection whose last upload went up whole: what a connection
/// knew of its last upload (sent whole: the response timeout's turn) is not the next one's.
#[tokio::test]
async fn a_client_body_that_stops_after_a_whole_upload_on_its_connection_gets_408() {
    let (sc, up) = sidecar("timeouts: { client_body_idle: 1s }\nrules: []\n").await;
    let mut c = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
    post_head(&mut c, "/upload", 100_000, 20_000).await;
    up.signals.first_bytes.notified().await;
    tokio::io::AsyncWriteExt::write_all(c.get_mut(), &[b'u'; 80_000])
        .await
        .unwrap();
    let a = read_answer(&mut c).await;
    assert_eq!(a.status, "HTTP/1.1 200 OK", "{}", a.body);
    assert_eq!(a.body, "100000");
    post_head(&mut c, "/upload", 100_000, 20_000).await;
    up.signals.first_bytes.notified().await;
    let a = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut c))
        .await
        .expect("no answer to the second body, which stopped");
    assert_eq!(a.status, "HTTP/1.1 408 Request Timeout", "{}", a.body);
}

/// 2. An app that takes no byte of an upload for `timeouts.send` gets the request 504.
#[tokio::test]
async fn an_app_that_takes_no_byte_of_an_upload_gets_504() {
    use tokio::io::AsyncReadExt;
    // Reads the head, then nothing: the upload fills the sockets' buffers and stops.
    let app = raw_server(|mut s| async move {
        let mut buf = vec![0u8; 1024];
        let _ = s.read(&mut buf).await;
        std::future::pending::<()>().await;
    })
    .await;
    let sc = spillway::Sidecar::start(config(app, "timeouts: { send: 1s }\nrules: []\n"))
        .await
        .unwrap();
    let text = upload_until_answered(sc.addr(), 64 << 20).await;
    assert!(text.starts_with("HTTP/1.1 504"), "{text}");
}

/// Uploads `length` bytes to `proxy` until it answers (within 20 s): its answer's head.
async fn upload_until_answered(proxy: std::net::SocketAddr, length: usize) -> String {
    use tokio::io::AsyncReadExt;
    let c = TcpStream::connect(proxy).await.unwrap();
    let (mut r, mut w) = c.into_split();
    let writer = tokio::spawn(async move {
        let head = format!("POST /x HTTP/1.1\r\nHost: app\r\ncontent-length: {length}\r\n\r\n");
        tokio::io::AsyncWriteExt::write_all(&mut w, head.as_bytes()).await?;
        let piece = vec![b'u'; 64 * 1024];
        for _ in 0..(length / piece.len()) {
            tokio::io::AsyncWriteExt::write_all(&mut w, &piece).await?;
        }
        Ok::<_, std::io::Error>(w)
    });
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), async {
        let mut buf = [0u8; 4096];
        while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = r.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
    writer.abort();
    assert!(read.is_ok(), "no answer while the app took nothing");
    String::from_utf8_lossy(&answer).into_owned()
}

/// An app that answers a HEAD with a head and, late (when the connection's next request
/// comes), the body a GET would have had: a response of its own to whoever asks next.
async fn late_head_body_app() -> std::net::SocketAddr {
    use tokio::io::AsyncWriteExt;
    raw_server(|mut s| async move {
        let mut buf = Vec::new();
        let mut owed = false;
        while let Some(head) = next_head(&mut s, &mut buf).await {
            if head.starts_with(b"HEAD ") {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 46\r\n\r\n")
                    .await;
                owed = true;
                continue;
            }
            if std::mem::take(&mut owed) {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nPOISONED")
                    .await;
            }
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await;
        }
    })
    .await
}

/// 6. A HEAD's upstream connection never serves another client: the app's late body cannot
/// become the answer to someone else's request, however the attacker times it.
#[tokio::test]
async fn a_heads_late_body_never_answers_another_client() {
    let app = late_head_body_app().await;
    let sc = spillway::Sidecar::start(config(app, "workers: 1\nrules: []\n"))
        .await
        .unwrap();
    for _ in 0..5 {
        // The attacker: a fresh connection per HEAD, gone once answered.
        let mut attacker = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
        tokio::io::AsyncWriteExt::write_all(
            attacker.get_mut(),
            b"HEAD / HTTP/1.1\r\nHost: app\r\n\r\n",
        )
        .await
        .unwrap();
        assert_eq!(read_head(&mut attacker).await, "HTTP/1.1 200 OK");
        drop(attacker);
        // Someone else, on a fresh connection of their own.
        let mut victim = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
        let a = ask(&mut victim, "GET / HTTP/1.1\r\nHost: app\r\n\r\n").await;
        assert_eq!(a.body, "ok", "another client's answer: {}", a.body);
    }
}

/// Opens `n` long-lived responses (a head, then a body that never ends) through `proxy`;
/// returns their connections, held open.
async fn open_streams(
    proxy: std::net::SocketAddr,
    n: usize,
) -> Vec<tokio::io::BufReader<TcpStream>> {
    let mut held = Vec::new();
    for _ in 0..n {
        let mut c = tokio::io::BufReader::new(TcpStream::connect(proxy).await.unwrap());
        tokio::io::AsyncWriteExt::write_all(
            c.get_mut(),
            b"GET /events HTTP/1.1\r\nHost: app\r\n\r\n",
        )
        .await
        .unwrap();
        assert_eq!(read_head(&mut c).await, "HTTP/1.1 200 OK");
        held.push(c);
    }
    held
}

/// The status of one more request through `proxy`, on a connection of its own.
async fn one_more(proxy: std::net::SocketAddr) -> String {
    let mut c = tokio::io::BufReader::new(TcpStream::connect(proxy).await.unwrap());
    tokio::io::AsyncWriteExt::write_all(c.get_mut(), b"GET /other HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    read_head(&mut c).await
}

/// 4. Long-lived responses (event streams) do not lock a shared adaptive limit: it measures
/// to the response head and releases there, so the shipped rule (`config/exact.yaml`) still
/// serves others while 8 streams stay open.
#[tokio::test]
async fn event_streams_do_not_lock_a_shared_adaptive_limit() {
    let (sc, _closed) = stalling_sidecar(
        "rules:\n  - name: app-capacity\n    key: []\n    limit: { adaptive: { min: 8, max: 512, tolerance: 2.0 } }\n",
    )
    .await;
    let _streams = open_streams(sc.addr(), 12).await;
    assert_eq!(one_more(sc.addr()).await, "HTTP/1.1 200 OK");
}

/// A fixed `concurrency:` counts to the response's end (it is for time-heavy endpoints), unless
/// the rule says `release: head`.
#[tokio::test]
async fn a_fixed_concurrency_counts_to_the_end_unless_it_releases_at_the_head() {
    let (sc, _closed) = stalling_sidecar("rules:\n  - name: to-the-end\n    match: { path: /events }\n    key: []\n    limit: { concurrency: 2 }\n  - name: at-the-head\n    match: { path_prefix: /live }\n    key: []\n    limit: { concurrency: 2 }\n    release: head\n").await;
    let _streams = open_streams(sc.addr(), 2).await;
    let mut c = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
    let a = ask(&mut c, "GET /events HTTP/1.1\r\nHost: app\r\n\r\n").await;
    assert!(
        a.status.starts_with("HTTP/1.1 429") || a.status.starts_with("HTTP/1.1 503"),
        "{}",
        a.status
    );
    let mut live = Vec::new();
    for _ in 0..4 {
        let mut c = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
        tokio::io::AsyncWriteExt::write_all(
            c.get_mut(),
            b"GET /live HTTP/1.1\r\nHost: app\r\n\r\n",
        )
        .await
        .unwrap();
        assert_eq!(read_head(&mut c).await, "HTTP/1.1 200 OK");
        live.push(c);
    }
}

/// A rule's own `upstream_body_idle` replaces the global one for the requests it applies to
/// (here shorter, so that the test need not wait for the global 60 s).
#[tokio::test]
async fn a_rules_upstream_body_idle_applies_to_its_requests() {
    let (sc, mut closed) = stalling_sidecar("rules:\n  - name: feeds\n    match: { path_prefix: /feed }\n    key: []\n    limit: { rate: 100/s }\n    upstream_body_idle: 1s\n").await;
    let mut c = stalled_h1(sc.addr(), "/feed").await;
    assert!(closes(&mut c).await, "the rule's 1 s did not apply");
    assert!(upstream_closed(&mut closed).await);
    // The same over HTTP/2.
    reset_h2(sc.addr(), "/feed").await;
}

/// An app that answers `/fast` at once and never answers anything else (it holds the
/// connection until the proxy closes it).
async fn hanging_app() -> std::net::SocketAddr {
    use tokio::io::AsyncWriteExt;
    raw_server(|mut s| async move {
        let Some(head) = next_head(&mut s, &mut Vec::new()).await else {
            return;
        };
        if head.starts_with(b"GET /fast ") {
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                .await;
            return;
        }
        // Held until the proxy closes its end.
        let _ = next_head(&mut s, &mut Vec::new()).await;
    })
    .await
}

/// The shared adaptive limit's gauge, once it is below `below` (`None` if not within 20 s).
async fn adaptive_limit_below(sc: &spillway::Sidecar, below: f64) -> Option<f64> {
    for _ in 0..200 {
        let (_, text) = admin(sc, "/metrics").await;
        if let Some(v) = metric(&text, "spillway_adaptive_limit{rule=\"app-capacity\"}") {
            if v < below {
                return Some(v);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// 4. An adaptive limit's windows also close on a timer: an app that stops answering (no
/// request completes, none has timed out yet) is learned from the requests still waiting, so
/// the limit comes down instead of waiting for `upstream_response` to fail them.
#[tokio::test]
async fn an_app_that_stops_answering_brings_an_adaptive_limit_down_before_any_timeout() {
    let app = hanging_app().await;
    let sc = spillway::Sidecar::start(config(
        app,
        "rules:\n  - name: app-capacity\n    key: []\n    limit: { adaptive: { min: 2, max: 512, initial: 40, tolerance: 2.0 } }\n",
    ))
    .await
    .unwrap();
    // A baseline: quick answers, their window closed (by the timer if they were too few).
    for _ in 0..12 {
        let mut c = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
        let a = ask(&mut c, "GET /fast HTTP/1.1\r\nHost: app\r\n\r\n").await;
        assert!(a.status.starts_with("HTTP/1.1 200"), "{}", a.status);
    }
    let mut learned = false;
    for _ in 0..100 {
        let (_, text) = admin(&sc, "/metrics").await;
        let baseline = metric(
            &text,
            "spillway_adaptive_baseline_seconds{rule=\"app-capacity\"}",
        );
        if baseline.is_some_and(|b| b > 0.0) {
            learned = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(learned, "no baseline from 12 quick answers");
    // Now the app hangs: 30 requests wait on it, none completes (upstream_response is 30 s).
    let mut waiting = Vec::new();
    for _ in 0..30 {
        let mut c = TcpStream::connect(sc.addr()).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut c, b"GET /slow HTTP/1.1\r\nHost: app\r\n\r\n")
            .await
            .unwrap();
        waiting.push(c);
    }
    let limit = adaptive_limit_below(&sc, 40.0).await;
    assert!(
        limit.is_some(),
        "the limit stayed at 40 with 30 requests waiting on an app that stopped answering"
    );
}

/// Opens a long-lived response of `path` from `from`: its status, and the connection held.
async fn stream_from(
    from: [u8; 4],
    proxy: std::net::SocketAddr,
    path: &str,
) -> (String, tokio::io::BufReader<TcpStream>) {
    let mut c = connect_from(from, proxy).await;
    let ask = format!("GET {path} HTTP/1.1\r\nHost: app\r\n\r\n");
    tokio::io::AsyncWriteExt::write_all(c.get_mut(), ask.as_bytes())
        .await
        .unwrap();
    (read_head(&mut c).await, c)
}

/// 4. One client cannot hold a shared (`key: []`) limit's every slot with long-lived
/// responses: it gets `client_share` of them (half by default) and another client is served.
#[tokio::test]
async fn one_client_holds_at_most_its_share_of_a_shared_concurrency_limit() {
    let (sc, _closed) = stalling_sidecar(
        "limits: { connections_per_client_exempt: [] }\nrules:\n  - name: downloads\n    match: { path_prefix: /dl }\n    key: []\n    limit: { concurrency: 8 }\n  - name: feeds\n    match: { path_prefix: /feed }\n    key: []\n    limit: { concurrency: 8 }\n    client_share: 0.25\n",
    )
    .await;
    let mut held = Vec::new();
    let mut statuses = Vec::new();
    for _ in 0..8 {
        let (status, c) = stream_from([127, 0, 0, 2], sc.addr(), "/dl").await;
        statuses.push(status);
        held.push(c);
    }
    let ok = statuses.iter().filter(|s| *s == "HTTP/1.1 200 OK").count();
    assert_eq!(ok, 4, "one client's streams of a limit of 8: {statuses:?}");
    assert!(
        statuses
            .iter()
            .all(|s| s == "HTTP/1.1 200 OK" || s.starts_with("HTTP/1.1 429")),
        "{statuses:?}"
    );
    let (other, _c) = stream_from([127, 0, 0, 3], sc.addr(), "/dl").await;
    assert_eq!(other, "HTTP/1.1 200 OK", "another client was locked out");
    // A stated share of a quarter: 2 of 8.
    let mut feeds = Vec::new();
    for _ in 0..4 {
        let (status, c) = stream_from([127, 0, 0, 4], sc.addr(), "/feed").await;
        feeds.push(status);
        held.push(c);
    }
    assert_eq!(
        feeds.iter().filter(|s| *s == "HTTP/1.1 200 OK").count(),
        2,
        "{feeds:?}"
    );
    // A part given back is taken again.
    drop(held.drain(..4));
    let mut again = false;
    for _ in 0..100 {
        let (status, c) = stream_from([127, 0, 0, 2], sc.addr(), "/dl").await;
        if status == "HTTP/1.1 200 OK" {
            again = true;
            held.push(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        again,
        "the client's part was not given back when its streams closed"
    );
}

/// Behind a mesh or an ingress every client has one address: loopback (and the trusted
/// proxies) have no part of their own, so a shared limit is whole for them.
#[tokio::test]
async fn exempt_addresses_have_the_whole_shared_limit() {
    let (sc, _closed) = stalling_sidecar(
        "rules:\n  - name: downloads\n    key: []\n    limit: { concurrency: 4 }\n",
    )
    .await;
    let mut held = Vec::new();
    for _ in 0..4 {
        let (status, c) = stream_from([127, 0, 0, 1], sc.addr(), "/dl").await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        held.push(c);
    }
}

/// An HTTP/2 connection from `from` that has made one request and now idles without a stream;
/// its driver, which ends when the proxy closes the connection.
async fn idle_h2_from(
    from: [u8; 4],
    proxy: std::net::SocketAddr,
) -> (
    h2::client::SendRequest<Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::from((from, 0))).unwrap();
    let tcp = socket.connect(proxy).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(conn);
    let mut h2 = h2.ready().await.unwrap();
    let req = http::Request::get(format!("http://{proxy}/"))
        .body(())
        .unwrap();
    let (resp, _) = h2.send_request(req, true).unwrap();
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    (h2, driver)
}

/// 3b over HTTP/2: clients whose HTTP/2 connections idle without a stream on every place do
/// not lock a new client out either: one of them is closed for it (GOAWAY), as an idle
/// kept-alive HTTP/1 connection is.
#[tokio::test]
async fn at_the_connection_cap_an_idle_http2_connection_makes_room() {
    let (sc, _up) = sidecar("workers: 1\nlimits: { max_connections: 6 }\nrules: []\n").await;
    let mut idle = Vec::new();
    for i in 0..6u8 {
        idle.push(idle_h2_from([127, 0, 0, 40 + i], sc.addr()).await);
    }
    let mut new = connect_from([127, 0, 0, 60], sc.addr()).await;
    tokio::io::AsyncWriteExt::write_all(new.get_mut(), b"GET / HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    // Without room made, it would wait for an HTTP/2 connection's `client_idle` (75 s).
    let Ok(a) = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut new)).await else {
        let (_, m) = admin(&sc, "/metrics").await;
        let closed = idle
            .iter()
            .filter(|(_, driver)| driver.is_finished())
            .count();
        panic!(
            "the new client was not served while HTTP/2 connections idled on every place: {closed} closed, {:?} closed for room, {:?} open",
            metric(&m, "spillway_connections_closed_for_room_total"),
            metric(&m, "spillway_connections")
        );
    };
    assert_eq!(a.status, "HTTP/1.1 200 OK");
    // Its driver ends once it has read the GOAWAY and the close.
    let closed = || {
        idle.iter()
            .filter(|(_, driver)| driver.is_finished())
            .count()
    };
    for _ in 0..100 {
        if closed() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        closed(),
        1,
        "exactly one idle HTTP/2 connection is closed for the newcomer"
    );
}

/// 2. An HTTP/1 client that pipelined its next request while its response waited on the app,
/// then left, releases the upstream at once too: the bytes it sent are read (kept for that
/// next request) and its end of stream seen behind them.
#[tokio::test]
async fn an_http1_client_that_pipelined_then_left_releases_the_upstream() {
    let (sc, mut closed) = stalling_sidecar("rules: []\n").await;
    let mut c = stalled_h1(sc.addr(), "/stall").await;
    tokio::io::AsyncWriteExt::write_all(c.get_mut(), b"GET /next HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    drop(c);
    assert!(
        upstream_closed(&mut closed).await,
        "the upstream connection is still held for a client that pipelined and left"
    );
}

/// An app whose `/slow` body comes in two parts a moment apart; anything else is `ok`.
async fn two_part_app() -> std::net::SocketAddr {
    use tokio::io::AsyncWriteExt;
    raw_server(|mut s| async move {
        let mut buf = Vec::new();
        while let Some(head) = next_head(&mut s, &mut buf).await {
            if head.starts_with(b"GET /slow ") {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nfirst")
                    .await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                let _ = s.write_all(b"rest!").await;
            } else {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
            }
        }
    })
    .await
}

/// ...and a client that pipelines its next request meanwhile and stays gets both answers.
#[tokio::test]
async fn a_request_pipelined_while_a_response_streams_is_answered_after_it() {
    let app = two_part_app().await;
    let sc = spillway::Sidecar::start(config(app, "rules: []\n"))
        .await
        .unwrap();
    let mut c = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
    tokio::io::AsyncWriteExt::write_all(c.get_mut(), b"GET /slow HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_head(&mut c).await, "HTTP/1.1 200 OK");
    tokio::io::AsyncWriteExt::write_all(c.get_mut(), b"GET /next HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 10];
    tokio::io::AsyncReadExt::read_exact(&mut c, &mut first)
        .await
        .unwrap();
    assert_eq!(&first, b"firstrest!");
    let next = read_answer(&mut c).await;
    assert_eq!(next.status, "HTTP/1.1 200 OK", "{}", next.head);
    assert_eq!(next.body, "ok");
}

/// An HTTP/2-only app (an `h2c://` upstream) that reads a request's body whole and answers
/// with its length.
async fn h2c_counting_app() -> std::net::SocketAddr {
    use http_body_util::BodyExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                    let n = req
                        .into_body()
                        .collect()
                        .await
                        .map_or(0, |b| b.to_bytes().len());
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(
                        n.to_string(),
                    ))))
                });
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
            });
        }
    });
    app
}

/// 5. The same through an `h2c://` upstream (hyper's pooled client sends the body): the
/// response timeout starts when the upload is whole.
#[tokio::test]
async fn a_slow_steady_upload_to_an_h2c_upstream_is_not_cut_by_the_response_timeout() {
    let app = h2c_counting_app().await;
    let yaml = format!(
        "service: s\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: h2c://{app}\ntimeouts: {{ upstream_response: 1s }}\nrules: []\n"
    );
    let sc = spillway::Sidecar::start(spillway::Config::from_yaml(&yaml, "t").unwrap())
        .await
        .unwrap();
    let mut c = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
    let piece = 8 * 1024;
    post_head(&mut c, "/upload", 10 * piece, piece * 3).await;
    for _ in 3..10 {
        // Steady, and slower than the response timeout in all.
        tokio::time::sleep(Duration::from_millis(300)).await;
        tokio::io::AsyncWriteExt::write_all(c.get_mut(), &vec![b'u'; piece])
            .await
            .unwrap();
    }
    let a = read_answer(&mut c).await;
    assert_eq!(a.status, "HTTP/1.1 200 OK", "{}", a.body);
    assert_eq!(a.body, (10 * piece).to_string());
}

/// 2. An `h2c://` app that takes no byte of an upload (its stream's window stays shut) gets
/// the request 504 after `timeouts.send`, as an HTTP/1 app does.
#[tokio::test]
async fn an_h2c_app_that_takes_no_byte_of_an_upload_gets_504() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = service_fn(|_req: http::Request<hyper::body::Incoming>| async move {
                    // Holds the body unread and never answers.
                    std::future::pending::<()>().await;
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
                });
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
            });
        }
    });
    let yaml = format!(
        "service: s\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: h2c://{app}\ntimeouts: {{ send: 1s }}\nrules: []\n"
    );
    let sc = spillway::Sidecar::start(spillway::Config::from_yaml(&yaml, "t").unwrap())
        .await
        .unwrap();
    let text = upload_until_answered(sc.addr(), 64 << 20).await;
    assert!(text.starts_with("HTTP/1.1 504"), "{text}");
}

/// 2. A tunnel to an app that switches and then never reads (a small receive window) while
/// its client sends and never reads either is closed once nothing has moved for
/// `client_idle`: its first bytes (what the client sent past its upgrade request, read while
/// the switch was awaited) go within `timeouts.send`, then the idle watch holds it.
#[tokio::test]
async fn a_tunnel_to_an_app_that_never_reads_is_closed_when_nothing_moves() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(1024).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(16).unwrap();
    let app = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                // Reads the head alone (the rest stays in its small window), switches, and
                // never reads again.
                let mut head = Vec::new();
                let mut one = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if s.read(&mut one).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(one[0]);
                }
                let _ = s
                    .write_all(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n")
                    .await;
                std::future::pending::<()>().await;
            });
        }
    });
    let sc = spillway::Sidecar::start(config(
        app,
        "timeouts: { send: 1s, client_idle: 2s }\nrules: []\n",
    ))
    .await
    .unwrap();
    let mut c = TcpStream::connect(sc.addr()).await.unwrap();
    let mut ask = b"GET /ws HTTP/1.1\r\nHost: app\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".to_vec();
    // Frames sent at once, without waiting for the switch.
    ask.extend(std::iter::repeat_n(b'f', 1 << 20));
    let (mut r, mut w) = c.split();
    let (_, read) = tokio::join!(
        async {
            let _ = tokio::time::timeout(Duration::from_secs(15), w.write_all(&ask)).await;
        },
        tokio::time::timeout(Duration::from_secs(15), async {
            let mut all = Vec::new();
            let _ = r.read_to_end(&mut all).await;
            all
        })
    );
    let all = read.expect("the tunnel was held with nothing moving past client_idle");
    let text = String::from_utf8_lossy(&all);
    assert!(text.starts_with("HTTP/1.1 101"), "{text}");
}

/// Bytes a client sends past its upgrade request before the switch (read while the app's
/// answer was awaited) reach the app first, in order, once the tunnel is up.
#[tokio::test]
async fn bytes_sent_before_the_switch_reach_the_app_first() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = raw_server(|mut s| async move {
        let mut head = Vec::new();
        let mut one = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if s.read(&mut one).await.unwrap_or(0) == 0 {
                return;
            }
            head.push(one[0]);
        }
        // Answers late, so that the client's early bytes wait at the proxy.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = s
            .write_all(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n")
            .await;
        let (mut r, mut w) = s.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
    })
    .await;
    let sc = spillway::Sidecar::start(config(app, "rules: []\n"))
        .await
        .unwrap();
    let mut c = tokio::io::BufReader::new(TcpStream::connect(sc.addr()).await.unwrap());
    let early: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
    let mut ask = b"GET /ws HTTP/1.1\r\nHost: app\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".to_vec();
    ask.extend_from_slice(&early);
    c.get_mut().write_all(&ask).await.unwrap();
    assert!(read_head(&mut c).await.starts_with("HTTP/1.1 101"));
    let mut echoed = vec![0u8; early.len()];
    tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut echoed))
        .await
        .expect("the early bytes never came back")
        .unwrap();
    assert!(
        echoed == early,
        "the early bytes came back changed or out of order"
    );
}

/// One request on an HTTP/2 connection of the h2 crate's: its status and body.
async fn h2_ask(
    h2: &mut h2::client::SendRequest<Bytes>,
    method: &str,
    proxy: std::net::SocketAddr,
) -> (u16, String) {
    let mut ready = h2.clone().ready().await.unwrap();
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://{proxy}/"))
        .body(())
        .unwrap();
    let (resp, _) = ready.send_request(req, true).unwrap();
    let resp = resp.await.unwrap();
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut text = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
        text.extend_from_slice(&chunk);
    }
    (status, String::from_utf8_lossy(&text).into_owned())
}

/// 5. Over HTTP/2 too: the upstream connection a HEAD answer leaves serves that client
/// connection's next stream (so that HEADs cost no connection each) and never another's.
#[tokio::test]
async fn an_http2_heads_late_body_never_answers_another_client() {
    let app = late_head_body_app().await;
    let sc = spillway::Sidecar::start(config(app, "workers: 1\nrules: []\n"))
        .await
        .unwrap();
    let connect = || async {
        let tcp = TcpStream::connect(sc.addr()).await.unwrap();
        let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
        (h2, tokio::spawn(conn))
    };
    let (mut attacker, _a) = connect().await;
    let (mut victim, _v) = connect().await;
    for _ in 0..5 {
        assert_eq!(h2_ask(&mut attacker, "HEAD", sc.addr()).await.0, 200);
        let (status, body) = h2_ask(&mut victim, "GET", sc.addr()).await;
        assert_eq!(
            (status, body.as_str()),
            (200, "ok"),
            "another client's answer"
        );
    }
}
