//! An upstream that writes more than its framing says must never make one client's bytes
//! another's answer: a pooled connection with anything pending on it is closed, not reused
//! (src/proxy/http1/client.rs, `Raw::check`). A raw-socket upstream answers each shape; the next client
//! must get exactly its own answer, for HTTP/1 and HTTP/2 clients.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

/// What `/bad/<shape>` answers: more bytes than its framing says.
fn bad(path: &str) -> Vec<u8> {
    let answer: &[u8] = match path {
        "/bad/head" => b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nSTOLE",
        "/bad/204" => b"HTTP/1.1 204 No Content\r\n\r\nSTOLE",
        "/bad/short" => b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokSTOLE",
        "/bad/chunks" => {
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nSTOLE"
        }
        "/bad/two" => {
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nSTOLE"
        }
        _ => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
    };
    answer.to_vec()
}

fn content_length(head: &str) -> usize {
    head.lines()
        .find_map(|l| {
            let l = l.to_ascii_lowercase();
            l.strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap_or(0)
}

/// A raw HTTP/1.1 upstream that never reads a body as one. `/echo/<x>` answers 200 with body
/// `<x>`; `/ignore` answers at once, and ends its answer when the body has come. `/bad/<shape>`
/// answers with more bytes than its framing says, in one write; `HEAD /late` answers the head,
/// then, when `late` is notified, writes a body nobody asked for on the same connection;
/// `/204-later` answers 204 with a length, and writes that body before its next answer.
async fn raw_upstream(late: Arc<Notify>) -> SocketAddr {
    raw_server(move |mut s| {
        let late = late.clone();
        async move {
            let mut buf = Vec::new();
            let mut owed = false;
            loop {
                let mut chunk = [0u8; 4096];
                let Ok(n) = s.read(&mut chunk).await else {
                    return;
                };
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
                while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    buf.drain(..end + 4);
                    let line = head.lines().next().unwrap_or_default().to_string();
                    let mut parts = line.split(' ');
                    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                    if std::mem::take(&mut owed) {
                        let stolen = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nSTOLE";
                        if s.write_all(stolen).await.is_err() {
                            return;
                        }
                    }
                    let answer: Vec<u8> = if path == "/204-later" {
                        owed = true;
                        b"HTTP/1.1 204 No Content\r\ncontent-length: 42\r\n\r\n".to_vec()
                    } else if path == "/ignore" {
                        // Answered at once; the body is never read as one: once it has come
                        // (the answer's end waits for it) its bytes are what is read next.
                        let length = content_length(&head);
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nok")
                            .await;
                        while buf.len() < length {
                            match s.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        b"ok".to_vec()
                    } else if let Some(x) = path.strip_prefix("/echo/") {
                        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{x}", x.len())
                            .into_bytes()
                    } else if path == "/late" {
                        // Answered whole (a HEAD by its head alone), then, once told, bytes
                        // nobody asked for on the idle connection.
                        let whole: &[u8] = if method == "HEAD" {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 13\r\n\r\n"
                        } else {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                        };
                        let _ = s.write_all(whole).await;
                        late.notified().await;
                        b"ATTACKER-BODY".to_vec()
                    } else {
                        bad(path)
                    };
                    if s.write_all(&answer).await.is_err() {
                        return;
                    }
                }
            }
        }
    })
    .await
}

async fn proxy_for(upstream: SocketAddr) -> spillway::Sidecar {
    // One worker: every client's requests share one list of idle upstream connections.
    let config = spillway::Config::from_yaml(
        &format!(
            "service: t\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: http://{upstream}\nworkers: 1\nrules: []\n"
        ),
        "test",
    )
    .unwrap();
    spillway::Sidecar::start(config).await.unwrap()
}

fn discarded(text: &str, reason: &str) -> f64 {
    metric(
        text,
        &format!("spillway_upstream_connections_discarded_total{{reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_past_a_responses_framing_never_reach_the_next_client() {
    let up = raw_upstream(Arc::new(Notify::new())).await;
    let sc = proxy_for(up).await;
    for (n, (method, shape)) in [
        ("HEAD", "/bad/head"),
        ("GET", "/bad/204"),
        ("GET", "/bad/short"),
        ("GET", "/bad/chunks"),
        ("GET", "/bad/two"),
    ]
    .into_iter()
    .enumerate()
    {
        for (kind, c) in [("http/1", client()), ("http/2", h2_client())] {
            // The attacker's request, then other clients' on fresh client connections.
            let _ = send(&c, sc.addr(), method, shape, &[]).await;
            for who in ["alice", "bob"] {
                let mine = format!("{who}-{n}");
                let (status, _, body) =
                    send(&client(), sc.addr(), "GET", &format!("/echo/{mine}"), &[]).await;
                assert_eq!(
                    (status, body.as_str()),
                    (StatusCode::OK, mine.as_str()),
                    "{kind} {method} {shape}: another client's bytes"
                );
            }
        }
    }
    let text = admin(&sc, "/metrics").await.1;
    // The three shapes with a body, over both client kinds, went to the pool and were
    // found out there; a HEAD's and a 204's connection never reach it.
    assert!(discarded(&text, "leftover") >= 6.0, "{text}");
}

/// A 204 that announces a body (which RFC 9110 forbids) may be followed by it at any time,
/// after its connection went to another client and before that client's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_204_that_announces_a_body_never_leaves_its_connection_to_the_next_client() {
    let up = raw_upstream(Arc::new(Notify::new())).await;
    let sc = proxy_for(up).await;
    for (kind, c) in [("http/1", client()), ("http/2", h2_client())] {
        let (status, _, _) = send(&c, sc.addr(), "GET", "/204-later", &[]).await;
        assert_eq!(status, StatusCode::NO_CONTENT);
        let mine = format!("alice-{kind}");
        let (status, _, body) =
            send(&client(), sc.addr(), "GET", &format!("/echo/{mine}"), &[]).await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::OK, mine.as_str()),
            "{kind}: the 204's late body answered another client"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_an_upstream_sends_while_its_connection_is_idle_close_it() {
    let late = Arc::new(Notify::new());
    let up = raw_upstream(late.clone()).await;
    let sc = proxy_for(up).await;
    // The attacker's GET is answered whole; the connection goes back to the pool (a HEAD's
    // would stay with its client: `tests/hostile/phases.rs`).
    let (status, _, _) = send(&client(), sc.addr(), "GET", "/late", &[]).await;
    assert_eq!(status, StatusCode::OK);
    // Now the app writes a body nobody asked for, on the idle connection.
    late.notify_one();
    // The proxy's readiness signal: the connection is closed and counted (bounded: 10 s).
    let mut seen = false;
    for _ in 0..500 {
        if discarded(&admin(&sc, "/metrics").await.1, "unasked_bytes") >= 1.0 {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen, "an idle connection with bytes pending was kept");
    let (status, _, body) = send(&client(), sc.addr(), "GET", "/echo/alice", &[]).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "alice"));
}

/// A raw upstream that reads bodies by their `Content-Length`. `/early` answers 413 before it
/// reads the body, then, once it has read it, writes a second response nobody asked for and
/// notifies `wrote`; `/echo/<x>` answers `<x>` after reading its body.
async fn early_upstream(wrote: Arc<Notify>) -> SocketAddr {
    raw_server(move |mut s| {
        let wrote = wrote.clone();
        async move {
            let mut buf = Vec::new();
            loop {
                let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                    let mut chunk = [0u8; 65536];
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    continue;
                };
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                buf.drain(..end + 4);
                let path = head.split(' ').nth(1).unwrap_or("").to_string();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                let early = path == "/early";
                if early {
                    let _ = s
                        .write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\n\r\n")
                        .await;
                }
                while buf.len() < length {
                    let mut chunk = [0u8; 65536];
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => {
                            // The proxy closed this connection before the body came whole:
                            // done with it all the same (the test waits for either).
                            if early {
                                wrote.notify_one();
                            }
                            return;
                        }
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                buf.drain(..length);
                let answer = match path.strip_prefix("/echo/") {
                    Some(x) => {
                        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{x}", x.len())
                    }
                    None => "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nSTOLE".to_string(),
                };
                let written = s.write_all(answer.as_bytes()).await;
                if early {
                    wrote.notify_one();
                }
                if written.is_err() {
                    return;
                }
            }
        }
    })
    .await
}

/// Sends a request with a `Content-Length` body of `n` bytes on a raw connection and reads
/// the answer.
async fn post(addr: SocketAddr, path: &str, n: usize) -> Answer {
    let mut c = tokio::io::BufReader::new(tokio::net::TcpStream::connect(addr).await.unwrap());
    let head = format!("POST {path} HTTP/1.1\r\nHost: app\r\nContent-Length: {n}\r\n\r\n");
    c.get_mut().write_all(head.as_bytes()).await.unwrap();
    // The app reads every body (after its early answer, for `/early`): the write ends.
    c.get_mut().write_all(&vec![b'b'; n]).await.unwrap();
    read_answer(&mut c).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_response_while_the_body_streams_leaves_nothing_for_the_next_client() {
    let wrote = Arc::new(Notify::new());
    let up = early_upstream(wrote.clone()).await;
    let sc = proxy_for(up).await;
    for (n, size) in [(0, 100), (1, 100_000), (2, 100_000)] {
        // The early answer; the app then writes a second one after reading the body, or finds
        // its connection closed by the proxy before the body came whole.
        let answer = post(sc.addr(), "/early", size).await;
        assert!(answer.status.contains(" 413 "), "{}", answer.status);
        wrote.notified().await;
        // The next clients' requests, small and streamed bodies, and without a body.
        for (who, size) in [("alice", 10), ("bob", 20_000)] {
            let mine = format!("{who}-{n}");
            let answer = post(sc.addr(), &format!("/echo/{mine}"), size).await;
            assert_eq!(
                answer.body, mine,
                "{who} after early {n}: another request's bytes"
            );
        }
        let mine = format!("carol-{n}");
        let (status, _, body) =
            send(&client(), sc.addr(), "GET", &format!("/echo/{mine}"), &[]).await;
        assert_eq!((status, body), (StatusCode::OK, mine));
    }
}

/// An app that answers an upload before it has read it may never read it as a body: once the
/// upload is sent, its bytes are what the app reads next on that connection, the start of a
/// request that the next client's bytes would complete. A connection whose answer came while
/// its upload was still being sent is never reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_answered_before_it_was_sent_never_leaves_its_connection_to_the_next_client() {
    use tokio::io::AsyncBufReadExt;
    let up = raw_upstream(Arc::new(Notify::new())).await;
    let sc = proxy_for(up).await;
    let smuggled = "GET /echo/SMUGGLED HTTP/1.1\r\nx-pad: ";
    // Larger than a body read whole with its head: streamed.
    let body = format!("{smuggled}{}", "a".repeat(20_000 - smuggled.len()));
    let mut c = tokio::io::BufReader::new(tokio::net::TcpStream::connect(sc.addr()).await.unwrap());
    let head = format!(
        "POST /ignore HTTP/1.1\r\nhost: app\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    c.get_mut().write_all(head.as_bytes()).await.unwrap();
    // The answer comes before the body is sent.
    let mut status = String::new();
    c.read_line(&mut status).await.unwrap();
    assert!(status.starts_with("HTTP/1.1 200 "), "{status}");
    c.get_mut().write_all(body.as_bytes()).await.unwrap();
    let mut line = String::new();
    while line != "\r\n" {
        line.clear();
        assert!(
            c.read_line(&mut line).await.unwrap() > 0,
            "the answer's head ends"
        );
    }
    let mut answer = [0u8; 4];
    c.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"okok");
    for who in ["alice", "bob"] {
        let (status, _, body) =
            send(&client(), sc.addr(), "GET", &format!("/echo/{who}"), &[]).await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::OK, who),
            "the upload's bytes answered another client"
        );
    }
}
