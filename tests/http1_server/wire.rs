//! The proxy's own HTTP/1 server side (src/proxy/http1/server.rs) as a client sees it on the wire:
//! pipelined requests answered in order, HTTP/1.0 keep-alive and close, a small body forwarded
//! with its head on the connection's own upstream connection (also when it comes after the
//! head), a larger, chunked or expecting body streamed by this side too (the connection its own
//! throughout), a client leaving mid-request noticed, idle connections closed by a drain.

use std::time::Duration;

use crate::common::*;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

async fn connect(sc: &spillway::internal::proxy::Sidecar) -> BufReader<TcpStream> {
    BufReader::new(TcpStream::connect(sc.addr()).await.unwrap())
}

/// A request for the upstream's `/echo`, numbered `n` in its `x-n` header.
fn get_echo(n: u32) -> String {
    format!("GET /echo HTTP/1.1\r\nhost: app\r\nx-n: {n}\r\n\r\n")
}

/// What the upstream's `/echo` saw, as it answered.
fn echoed(a: &Answer) -> serde_json::Value {
    serde_json::from_str(&a.body).unwrap()
}

/// The `x-n` header the upstream's `/echo` saw.
fn echoed_n(a: &Answer) -> String {
    echoed(a)["headers"]["x-n"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order_on_one_connection() {
    let (sc, _up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    let three: String = (1..=3).map(get_echo).collect();
    c.get_mut().write_all(three.as_bytes()).await.unwrap();
    for n in 1..=3 {
        let a = read_answer(&mut c).await;
        assert_eq!(a.status, "HTTP/1.1 200 OK");
        assert_eq!(echoed_n(&a), n.to_string());
    }
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn http10_clients_are_closed_unless_they_ask_for_keep_alive() {
    let (sc, _up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    let a = ask(&mut c, "GET /x HTTP/1.0\r\nconnection: keep-alive\r\n\r\n").await;
    assert_eq!(
        (a.status.as_str(), a.body.as_str()),
        ("HTTP/1.0 200 OK", "ok")
    );
    assert!(a.head.contains("connection: keep-alive\r\n"), "{}", a.head);
    // The same connection, now without keep-alive: answered, then closed.
    let a = ask(&mut c, "GET /x HTTP/1.0\r\n\r\n").await;
    assert_eq!(a.body, "ok");
    assert!(a.head.contains("connection: close\r\n"), "{}", a.head);
    assert!(at_end(&mut c).await, "closed after an HTTP/1.0 answer");
    sc.shutdown();
    sc.wait().await;
}

/// The `peer` the upstream's `/echo` saw: the proxy's end of the upstream connection.
fn echoed_peer(a: &Answer) -> String {
    echoed(a)["peer"].as_str().unwrap().to_string()
}

/// A client connection that keeps an upstream connection of its own, and that connection's
/// `peer`: a client's first exchange borrows one from the worker's list, its second keeps one.
async fn with_own_upstream(
    sc: &spillway::internal::proxy::Sidecar,
) -> (BufReader<TcpStream>, String) {
    let mut c = connect(sc).await;
    ask(&mut c, &get_echo(1)).await;
    let own = echoed_peer(&ask(&mut c, &get_echo(2)).await);
    (c, own)
}

#[tokio::test]
async fn a_small_body_sent_with_its_head_goes_on_the_connections_own_upstream_connection() {
    let (sc, _up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    let first = ask(&mut c, &get_echo(1)).await;
    // Twice: a client's first exchange borrows from the worker's list, its second keeps one.
    let own = echoed_peer(&ask(&mut c, &get_echo(2)).await);
    let post = "POST /echo HTTP/1.1\r\nhost: app\r\ncontent-length: 5\r\n\r\nhello";
    let a = ask(&mut c, post).await;
    assert_eq!(a.status, "HTTP/1.1 200 OK");
    let v = echoed(&a);
    assert_eq!(v["body"], "hello");
    assert_eq!(v["headers"]["content-length"], "5");
    // hyper's pooled client would have sent it on a connection of its own.
    assert_eq!(
        echoed_peer(&a),
        own,
        "first exchange on {}",
        echoed_peer(&first)
    );
    // Pipelined behind a body: both answered, in order, still on our own side.
    let two = format!("{post}{}", get_echo(4));
    c.get_mut().write_all(two.as_bytes()).await.unwrap();
    let a = read_answer(&mut c).await;
    assert_eq!(echoed_peer(&a), own);
    let a = read_answer(&mut c).await;
    assert_eq!((echoed_n(&a), echoed_peer(&a)), ("4".to_string(), own));
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_request_with_a_body_mid_connection_is_served_and_so_are_those_after_it() {
    let (sc, _up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    assert_eq!(echoed_n(&ask(&mut c, &get_echo(1)).await), "1");
    // A body larger than is read with its head: from here hyper serves the connection,
    // starting with the bytes already read.
    let large = 20_000;
    let post = format!(
        "POST /upload HTTP/1.1\r\nhost: app\r\ncontent-length: {large}\r\n\r\n{}",
        "x".repeat(large)
    );
    let a = ask(&mut c, &post).await;
    assert_eq!(
        (a.status.as_str(), a.body),
        ("HTTP/1.1 200 OK", large.to_string())
    );
    assert_eq!(echoed_n(&ask(&mut c, &get_echo(3)).await), "3");
    sc.shutdown();
    sc.wait().await;
}

/// Returns once the proxy has read every byte `client` sent: its end of the connection has
/// nothing left to receive (`/proc/net/tcp`'s `rx_queue`).
async fn read_by_proxy(client: &TcpStream) {
    let hex = |a: std::net::SocketAddr| match a {
        std::net::SocketAddr::V4(a) => {
            format!(
                "{:08X}:{:04X}",
                u32::from_ne_bytes(a.ip().octets()),
                a.port()
            )
        }
        std::net::SocketAddr::V6(_) => unreachable!("the sidecar listens on 127.0.0.1"),
    };
    let ends = (
        hex(client.peer_addr().unwrap()),
        hex(client.local_addr().unwrap()),
    );
    for _ in 0..10_000 {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let queued = table.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 4 && (f[1], f[2]) == (ends.0.as_str(), ends.1.as_str()))
                .then(|| u64::from_str_radix(f[4].split(':').nth(1)?, 16).ok())
                .flatten()
        });
        if queued == Some(0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("the proxy never read what the client sent");
}

/// A POST to `/echo` whose body, `hello`, is sent only once the proxy has read its head alone
/// (a client's second write, or a second TCP segment). This side waits for the body and sends
/// it with the head on the connection's own upstream connection; hyper's server would hand the
/// head on at once and the body after it through the pooled client, on a connection of its own.
async fn post_body_after_head(c: &mut BufReader<TcpStream>) -> Answer {
    let head = "POST /echo HTTP/1.1\r\nhost: app\r\ncontent-length: 5\r\n\r\n";
    c.get_mut().write_all(head.as_bytes()).await.unwrap();
    read_by_proxy(c.get_ref()).await;
    let a = ask(c, "hello").await;
    assert_eq!(a.status, "HTTP/1.1 200 OK");
    assert_eq!(echoed(&a)["body"], "hello");
    a
}

#[tokio::test]
async fn a_small_body_that_comes_after_its_head_is_waited_for_and_sent_with_it() {
    let (sc, _up) = sidecar("rules: []").await;
    let (mut c, own) = with_own_upstream(&sc).await;
    let a = post_body_after_head(&mut c).await;
    // Still on this side: hyper's pooled client would have used a connection of its own.
    assert_eq!(echoed_peer(&a), own);
    assert_eq!(echoed_peer(&ask(&mut c, &get_echo(3)).await), own);
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn after_a_streamed_body_the_connection_goes_on_with_its_own_upstream_connection() {
    let (sc, _up) = sidecar("rules: []").await;
    let (mut c, own) = with_own_upstream(&sc).await;
    let chunked = "POST /echo HTTP/1.1\r\nhost: app\r\ntransfer-encoding: chunked\r\n\r\n\
                   5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n";
    let large = "x".repeat(20_000);
    let long = format!("POST /echo HTTP/1.1\r\nhost: app\r\ncontent-length: 20000\r\n\r\n{large}");
    for (req, body) in [(chunked, "hello world"), (long.as_str(), large.as_str())] {
        let a = ask(&mut c, req).await;
        assert_eq!(a.status, "HTTP/1.1 200 OK");
        assert_eq!(echoed(&a)["body"], body);
        // On its own upstream connection still: the connection never left this side.
        assert_eq!(echoed_peer(&post_body_after_head(&mut c).await), own);
    }
    // A body that waits for `100 Continue`, sent when the body is first read.
    let expect = "POST /echo HTTP/1.1\r\nhost: app\r\nexpect: 100-continue\r\n\
                  content-length: 5\r\n\r\n";
    c.get_mut().write_all(expect.as_bytes()).await.unwrap();
    let mut line = String::new();
    c.read_line(&mut line).await.unwrap();
    assert_eq!(line, "HTTP/1.1 100 Continue\r\n");
    line.clear();
    c.read_line(&mut line).await.unwrap();
    assert_eq!(line, "\r\n");
    assert_eq!(echoed(&ask(&mut c, "hello").await)["body"], "hello");
    assert_eq!(echoed_peer(&post_body_after_head(&mut c).await), own);
    // Pipelined behind a streamed body: what the body read past its end is the next request,
    // each answered in its turn.
    let two = format!("{chunked}{}", get_echo(7));
    c.get_mut().write_all(two.as_bytes()).await.unwrap();
    assert_eq!(echoed(&read_answer(&mut c).await)["body"], "hello world");
    assert_eq!(echoed_n(&read_answer(&mut c).await), "7");
    assert_eq!(echoed_n(&ask(&mut c, &get_echo(8)).await), "8");
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_streamed_body_that_ends_after_its_answer_keeps_the_client_connection_not_the_upstream_one(
) {
    let (sc, up) = sidecar("rules: []").await;
    let (mut c, own) = with_own_upstream(&sc).await;
    // The app answers after the head and the first chunk; the body's end comes after that.
    let head = "POST /early HTTP/1.1\r\nhost: app\r\ntransfer-encoding: chunked\r\n\r\n\
                5\r\nhello\r\n";
    c.get_mut().write_all(head.as_bytes()).await.unwrap();
    let a = read_answer(&mut c).await;
    assert_eq!(
        (a.status.as_str(), a.body.as_str()),
        ("HTTP/1.1 200 OK", "early")
    );
    c.get_mut().write_all(b"0\r\n\r\n").await.unwrap();
    // The client's connection goes on, though the body's end was read after the answer was
    // written; the upstream one does not: the upload had not ended with its answer, so the app
    // was still reading a request on it (its read of the body ends with the connection).
    let next = post_body_after_head(&mut c).await;
    assert_eq!(next.status, "HTTP/1.1 200 OK");
    up.signals.drained.notified().await;
    assert_ne!(echoed_peer(&next), own);
    sc.shutdown();
    sc.wait().await;
}

/// A client that never finishes an upload the app answered early holds neither its connection
/// nor the app's exchange: at `client_idle` the connection closes and the body the app was
/// still reading ends.
#[tokio::test]
async fn an_upload_left_unfinished_after_its_answer_is_closed_at_client_idle() {
    let (sc, up) = sidecar("timeouts: { client_idle: 300ms }\nrules: []").await;
    let mut c = connect(&sc).await;
    let head = "POST /early HTTP/1.1\r\nhost: app\r\ntransfer-encoding: chunked\r\n\r\n\
                5\r\nhello\r\n";
    let a = ask(&mut c, head).await;
    assert_eq!(a.body, "early");
    // The rest of the body never comes, and the client never closes.
    assert!(at_end(&mut c).await, "closed by the proxy");
    tokio::time::timeout(Duration::from_secs(10), up.signals.drained.notified())
        .await
        .expect("the app's read of the body ended");
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_client_that_streams_body_after_body_stays_on_this_side() {
    let (sc, _up) = sidecar("rules: []").await;
    let (mut c, own) = with_own_upstream(&sc).await;
    let chunked = "POST /echo HTTP/1.1\r\nhost: app\r\ntransfer-encoding: chunked\r\n\r\n\
                   2\r\nhi\r\n0\r\n\r\n";
    for _ in 0..3 {
        assert_eq!(echoed(&ask(&mut c, chunked).await)["body"], "hi");
    }
    // Served by this side throughout: a body that comes after its head still goes on the
    // connection's own upstream connection.
    assert_eq!(echoed_peer(&post_body_after_head(&mut c).await), own);
    assert_eq!(echoed_n(&ask(&mut c, &get_echo(3)).await), "3");
    sc.shutdown();
    sc.wait().await;
}

/// A refused upload never reaches the app: a client that waits for `100 Continue` gets the 429
/// instead (and sends nothing; the connection closes), one that sent a small body gets the 429
/// and its connection goes on.
#[tokio::test]
async fn a_refused_upload_is_answered_before_its_body_and_never_reaches_the_app() {
    let rule = "rules:\n  - name: one\n    key: client_ip\n    limit: { rate: 1/m }\n";
    let (sc, up) = sidecar(rule).await;
    let mut c = connect(&sc).await;
    assert_eq!(echoed_n(&ask(&mut c, &get_echo(1)).await), "1");
    let seen = || {
        up.signals
            .requests
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    let before = seen();
    let expect = "POST /echo HTTP/1.1\r\nhost: app\r\nexpect: 100-continue\r\n\
                  content-length: 100000\r\n\r\n";
    let a = ask(&mut c, expect).await;
    assert_eq!(
        a.status, "HTTP/1.1 429 Too Many Requests",
        "no 100 first: {}",
        a.head
    );
    assert!(a.head.contains("connection: close\r\n"), "{}", a.head);
    assert!(at_end(&mut c).await, "closed: the body was never asked for");
    let mut c = connect(&sc).await;
    let chunked = format!(
        "POST /echo HTTP/1.1\r\nhost: app\r\ntransfer-encoding: chunked\r\n\r\n\
         5\r\nhello\r\n0\r\n\r\n{}",
        get_echo(2)
    );
    let a = ask(&mut c, &chunked).await;
    assert_eq!(a.status, "HTTP/1.1 429 Too Many Requests");
    // A small body is read and dropped: the connection goes on to the next request (refused
    // too, by the same rule).
    let next = read_answer(&mut c).await;
    assert_eq!(next.status, "HTTP/1.1 429 Too Many Requests");
    assert_eq!(seen(), before, "the app saw none of it");
    sc.shutdown();
    sc.wait().await;
}

/// A request body's chunk-size lines are read strictly: a bare LF, a second CR, a leading space
/// or a CR in an extension, which another parser in the path may read otherwise, is refused
/// with 400 and the connection closed, and the app sees nothing of what follows.
#[tokio::test]
async fn a_chunked_body_with_a_bare_lf_is_refused_and_closes_the_connection() {
    let (sc, _up) = sidecar("rules: []").await;
    for body in [
        "5\nhello\r\n0\r\n\r\n",
        "5\r\nhello\r\n0\n\r\n",
        "5\r\nhelloXX0\r\n\r\n",
        "zz\r\nhello\r\n0\r\n\r\n",
        // A size line another parser reads otherwise: a second CR, a leading space, a CR in an
        // extension.
        "5\r\r\nhello\r\n0\r\n\r\n",
        " 5\r\nhello\r\n0\r\n\r\n",
        "5;a\rb\r\nhello\r\n0\r\n\r\n",
    ] {
        let mut c = connect(&sc).await;
        let req = format!(
            "POST /echo HTTP/1.1\r\nhost: app\r\ntransfer-encoding: chunked\r\n\r\n{body}{}",
            get_echo(9)
        );
        c.get_mut().write_all(req.as_bytes()).await.unwrap();
        let a = read_answer(&mut c).await;
        assert_eq!(a.status, "HTTP/1.1 400 Bad Request", "{body:?}: {}", a.head);
        assert!(at_end(&mut c).await, "{body:?}: closed after the answer");
    }
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_streamed_request_that_asks_to_close_is_answered_and_closed() {
    let (sc, _up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    let req = "POST /echo HTTP/1.1\r\nhost: app\r\ntransfer-encoding: chunked\r\n\
               connection: close\r\n\r\n2\r\nhi\r\n0\r\n\r\n";
    let a = ask(&mut c, req).await;
    assert_eq!(echoed(&a)["body"], "hi");
    assert!(a.head.contains("connection: close\r\n"), "{}", a.head);
    assert!(at_end(&mut c).await, "closed after the answer");
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_small_body_still_coming_at_the_head_deadline_is_streamed() {
    let (sc, up) = sidecar("timeouts: { header_read: 200ms }\nrules: []").await;
    let mut c = connect(&sc).await;
    let head = "POST /upload HTTP/1.1\r\nhost: app\r\ncontent-length: 5\r\n\r\n";
    let arrived = up.signals.upload_head.notified();
    c.get_mut().write_all(head.as_bytes()).await.unwrap();
    // Past the deadline the head goes to the app without its body, which is then streamed: a
    // slow upload is served, not cut off.
    tokio::time::timeout(Duration::from_secs(10), arrived)
        .await
        .expect("the head was forwarded without its body");
    let a = ask(&mut c, "hello").await;
    assert_eq!(
        (a.status.as_str(), a.body.as_str()),
        ("HTTP/1.1 200 OK", "5")
    );
    assert_eq!(echoed_n(&ask(&mut c, &get_echo(2)).await), "2");
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_client_that_leaves_mid_request_ends_its_upstream_exchange() {
    // A raw upstream that takes one request, never answers, and says when the proxy hangs up.
    let up = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up_addr = up.local_addr().unwrap();
    let (got, mut got_rx) = tokio::sync::mpsc::unbounded_channel::<&str>();
    tokio::spawn(async move {
        let (mut s, _) = up.accept().await.unwrap();
        let mut buf = vec![0u8; 4096];
        let mut seen = Vec::new();
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "the proxy closed before a whole request");
            seen.extend_from_slice(&buf[..n]);
        }
        got.send("request").unwrap();
        // Held until the proxy ends the exchange.
        let n = s.read(&mut buf).await.unwrap_or(0);
        got.send(if n == 0 { "closed" } else { "more bytes" })
            .unwrap();
    });
    let sc = spillway::internal::proxy::Sidecar::start(config(up_addr, "rules: []"))
        .await
        .unwrap();
    let mut c = TcpStream::connect(sc.addr()).await.unwrap();
    c.write_all(b"GET /held HTTP/1.1\r\nhost: app\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(got_rx.recv().await, Some("request"));
    drop(c);
    // The proxy's response deadline is 30 s: the close must come from the client leaving.
    let ended = tokio::time::timeout(Duration::from_secs(10), got_rx.recv()).await;
    assert_eq!(ended, Ok(Some("closed")));
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_drain_closes_idle_keep_alive_connections() {
    let (sc, _up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    assert_eq!(
        ask(
            &mut c,
            "GET /x HTTP/1.1
host: app

"
        )
        .await
        .body,
        "ok"
    );
    sc.shutdown();
    assert!(
        at_end(&mut c).await,
        "an idle connection is closed by the drain"
    );
    tokio::time::timeout(Duration::from_secs(10), sc.wait())
        .await
        .expect("the proxy stops once drained");
}

#[tokio::test]
async fn idle_connections_are_closed_after_the_header_timeout_new_or_kept_alive() {
    let (sc, _up) =
        sidecar("timeouts: { header_read: 200ms, client_idle: 400ms }\nrules: []").await;
    // A client that connects and sends nothing.
    let mut silent = connect(&sc).await;
    // A client that made one request and stays idle.
    let mut kept = connect(&sc).await;
    let a = ask(
        &mut kept,
        "GET /x HTTP/1.1
host: app

",
    )
    .await;
    assert_eq!(a.body, "ok");
    assert!(at_end(&mut silent).await, "a silent connection stayed open");
    assert!(
        at_end(&mut kept).await,
        "an idle keep-alive connection stayed open"
    );
    sc.shutdown();
    sc.wait().await;
}

/// A load balancer keeps an idle connection open for a minute or more and reuses it without
/// warning: closing it after `header_read` (10 s) gave the sporadic 502 on its next request.
/// Between requests the wait is `client_idle`; `header_read` starts at the next head's first
/// byte.
#[tokio::test]
async fn a_kept_alive_connection_waits_client_idle_between_requests() {
    let (sc, _up) = sidecar("timeouts: { header_read: 200ms, client_idle: 30s }\nrules: []").await;
    let mut kept = connect(&sc).await;
    let a = ask(&mut kept, "GET /x HTTP/1.1\r\nhost: app\r\n\r\n").await;
    assert_eq!(a.body, "ok");
    // Idle for three times header_read: the connection is still there for the next request.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    let a = ask(&mut kept, "GET /x HTTP/1.1\r\nhost: app\r\n\r\n").await;
    assert_eq!(
        a.body, "ok",
        "an idle keep-alive connection was closed before client_idle"
    );
    // A head begun and not finished is still bounded by header_read from its first byte.
    use tokio::io::AsyncWriteExt;
    kept.get_mut()
        .write_all(b"GET /x HTTP/1.1\r\n")
        .await
        .unwrap();
    assert!(
        at_end(&mut kept).await,
        "a half-sent head kept its connection"
    );
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_head_larger_than_the_first_buffer_arriving_in_pieces_is_served_whole() {
    let (sc, _up) = sidecar("rules: []").await;
    let mut c = connect(&sc).await;
    // 12 KiB of one header (the limit is 16 KiB), written in 1 KiB pieces, then a plain
    // request behind it on the same connection.
    let big = "b".repeat(12 * 1024);
    let head = format!("GET /echo HTTP/1.1\r\nhost: app\r\nx-big: {big}\r\nx-n: 1\r\n\r\n");
    for piece in head.as_bytes().chunks(1024) {
        c.get_mut().write_all(piece).await.unwrap();
        c.get_mut().flush().await.unwrap();
    }
    let a = read_answer(&mut c).await;
    let echo = echoed(&a);
    assert_eq!(
        echo["headers"]["x-big"].as_str().map(str::len),
        Some(big.len())
    );
    assert_eq!(echoed_n(&a), "1");
    let a = ask(&mut c, &get_echo(2)).await;
    assert_eq!(echoed_n(&a), "2");
    sc.shutdown();
    sc.wait().await;
}
