//! Responses of every framing through a client connection's own upstream connection
//! (src/proxy/http1/client.rs, the hand-written HTTP/1.1 exchange): each body arrives whole, and the
//! connection is reused after a response only when that response allows it. Requests whose
//! body is still coming are written by the same connection's upload (src/proxy/http1/upload.rs);
//! they are checked here too.
//!
//! A client connection's first request only borrows a connection (src/proxy/upstream_pool.rs), so
//! every test sends a first request before the ones it is about.

// The test upstream keeps what it received behind a lock: test code, not the request path.
#![allow(clippy::disallowed_types)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use crate::common::*;
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the upstream answers to a path (`{c}`: the number of the connection), and whether it
/// closes the connection after.
fn script(path: &str) -> (String, bool) {
    let (text, close) = match path {
        "/plain" => (
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-conn: {c}\r\n\r\nok",
            false,
        ),
        "/chunked" => (
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-conn: {c}\r\n\r\n\
             3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\nx-checksum: 7\r\n\r\n",
            false,
        ),
        "/head" => (
            "HTTP/1.1 200 OK\r\ncontent-length: 100\r\nx-conn: {c}\r\n\r\n",
            false,
        ),
        "/204" => ("HTTP/1.1 204 No Content\r\nx-conn: {c}\r\n\r\n", false),
        "/304" => (
            "HTTP/1.1 304 Not Modified\r\ncontent-length: 50\r\nx-conn: {c}\r\n\r\n",
            false,
        ),
        "/hints" => (
            "HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n\
             HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-conn: {c}\r\n\r\nhints",
            false,
        ),
        "/hop" => (
            "HTTP/1.1 200 OK\r\nconnection: keep-alive, x-hop\r\nkeep-alive: timeout=5\r\n\
             x-hop: 1\r\nx-kept: yes\r\ncontent-length: 2\r\nx-conn: {c}\r\n\r\nok",
            false,
        ),
        // Hop lines between every kept one: too many pieces to copy, so it takes the map.
        "/hops" => (
            "HTTP/1.1 200 OK\r\nx-a: 1\r\nkeep-alive: timeout=5\r\nx-b: 2\r\nte: x\r\n\
             x-c: 3\r\nproxy-connection: x\r\nx-d: 4\r\nconnection: keep-alive\r\n\
             content-length: 2\r\nx-conn: {c}\r\n\r\nok",
            false,
        ),
        // Bare LF line ends (RFC 9112 §2.2 lets a recipient take them).
        "/lf" => (
            "HTTP/1.1 200 OK\nx-lf: yes\nkeep-alive: timeout=5\ncontent-length: 2\nx-conn: {c}\n\nok",
            false,
        ),
        "/until-close" => ("HTTP/1.1 200 OK\r\nx-conn: {c}\r\n\r\nto the end", true),
        "/close" => (
            "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\nx-conn: {c}\r\n\r\nok",
            true,
        ),
        "/te-and-cl" => (
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 100\r\nx-conn: {c}\r\n\r\n\
             3\r\nabc\r\n0\r\n\r\n",
            false,
        ),
        "/http10" => (
            "HTTP/1.0 200 OK\r\ncontent-length: 2\r\nx-conn: {c}\r\n\r\nok",
            false,
        ),
        "/conflict" => (
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
            true,
        ),
        "/short" => ("HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf", true),
        "/garbage" => ("HTTP/1.1 two hundred\r\n\r\n", true),
        // A coding other than chunked: its bytes are not the content, and the field that says
        // so is the hop's, so passing them on would hand the client gzip as its body.
        "/gzip-chunked" => (
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n3\r\nGZ1\r\n0\r\n\r\n",
            true,
        ),
        "/gzip-lines" => (
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n\
             3\r\nGZ1\r\n0\r\n\r\n",
            true,
        ),
        "/gzip" => ("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nGZ1", true),
        "/chunked-twice" => (
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
            true,
        ),
        "/switch" => (
            "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
            false,
        ),
        other => panic!("no script for {other}"),
    };
    (text.to_string(), close)
}

/// A raw HTTP/1.1 upstream answering by [`script`] (and `/echo` with the request body as it
/// came on the wire); the bodies it received are kept in order.
struct Scripted {
    addr: SocketAddr,
    bodies: Arc<Mutex<Vec<Vec<u8>>>>,
}

async fn scripted() -> Scripted {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let kept = bodies.clone();
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok((stream, _)) = listener.accept().await {
            n += 1;
            tokio::spawn(serve(stream, n, kept.clone()));
        }
    });
    Scripted { addr, bodies }
}

async fn serve(mut stream: TcpStream, conn: usize, bodies: Arc<Mutex<Vec<Vec<u8>>>>) {
    let mut buf = Vec::new();
    loop {
        // One request head.
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(k) => buf.extend_from_slice(&chunk[..k]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        buf.drain(..end);
        let path = head.split(' ').nth(1).unwrap().to_string();
        // Its body, as it came: by Content-Length, or up to the last chunk.
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse::<usize>().unwrap());
        let chunked = head.contains("transfer-encoding: chunked");
        let body_end = loop {
            match (length, chunked) {
                (Some(len), _) if buf.len() >= len => break len,
                (None, true) => {
                    if let Some(i) = buf.windows(5).position(|w| w == b"0\r\n\r\n") {
                        break i + 5;
                    }
                }
                (None, false) => break 0,
                _ => {}
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(k) => buf.extend_from_slice(&chunk[..k]),
            }
        };
        let body: Vec<u8> = buf.drain(..body_end).collect();
        let (text, close) = if path == "/echo" {
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{}",
                body.len(),
                String::from_utf8_lossy(&body)
            );
            (answer, false)
        } else if path == "/huge" {
            let filler = "x".repeat(70 * 1024);
            (
                format!("HTTP/1.1 200 OK\r\nx-filler: {filler}\r\n\r\n"),
                true,
            )
        } else {
            script(&path)
        };
        bodies.lock().unwrap().push(body);
        let text = text.replace("{c}", &conn.to_string());
        if stream.write_all(text.as_bytes()).await.is_err() {
            return;
        }
        if close {
            let _ = stream.shutdown().await;
            return;
        }
    }
}

/// One keep-alive client connection to the proxy.
struct Client {
    send: http1::SendRequest<TestBody>,
}

type TestBody = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

/// A response as the client saw it: status, `x-conn`, `content-length`, body, trailers.
struct Seen {
    status: StatusCode,
    conn: Option<String>,
    length: Option<String>,
    headers: http::HeaderMap,
    body: Result<Bytes, String>,
}

impl Client {
    async fn new(proxy: SocketAddr) -> Client {
        let stream = TcpStream::connect(proxy).await.unwrap();
        let (send, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(conn);
        Client { send }
    }

    async fn send(&mut self, method: Method, path: &str, body: TestBody) -> Seen {
        self.try_send(method, path, body).await.unwrap()
    }

    /// As [`send`](Self::send); `Err` when the proxy closed the connection before a response.
    async fn try_send(
        &mut self,
        method: Method,
        path: &str,
        body: TestBody,
    ) -> Result<Seen, hyper::Error> {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "app")
            .body(body)
            .unwrap();
        self.send.ready().await?;
        let resp = self.send.send_request(req).await?;
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_string())
        };
        let (status, conn, length) = (resp.status(), header("x-conn"), header("content-length"));
        let headers = resp.headers().clone();
        let body = match resp.into_body().collect().await {
            Ok(all) => Ok(all.to_bytes()),
            Err(e) => Err(e.to_string()),
        };
        Ok(Seen {
            status,
            conn,
            length,
            headers,
            body,
        })
    }

    async fn get(&mut self, path: &str) -> Seen {
        self.send(Method::GET, path, empty()).await
    }
}

fn empty() -> TestBody {
    Full::new(Bytes::new()).boxed()
}

async fn proxy(up: &Scripted) -> spillway::internal::proxy::Sidecar {
    // One worker: one pool, one list of idle connections.
    spillway::internal::proxy::Sidecar::start(config(up.addr, "workers: 1\nrules: []"))
        .await
        .unwrap()
}

#[tokio::test]
async fn every_framing_arrives_whole_and_the_connection_is_reused_after_it() {
    let up = scripted().await;
    let sc = proxy(&up).await;
    let mut c = Client::new(sc.addr()).await;
    let borrowed = c.get("/plain").await.conn;
    let own = c.get("/plain").await.conn;
    assert_eq!(
        own, borrowed,
        "the borrowed connection came back and is kept"
    );

    // Chunk extensions and a trailer section: read through (HTTP/1 clients get no trailers:
    // `Trailer` is stripped as hop-by-hop, and hyper's server sends only declared ones).
    let chunked = c.get("/chunked").await;
    assert_eq!(chunked.body.unwrap(), "abcdefg");
    assert_eq!(chunked.conn, own);

    let head = c.send(Method::HEAD, "/head", empty()).await;
    assert_eq!(head.status, StatusCode::OK);
    assert_eq!(head.length.as_deref(), Some("100"), "HEAD keeps the length");
    assert_eq!(head.body.unwrap(), "");

    for (path, status) in [
        ("/204", StatusCode::NO_CONTENT),
        ("/304", StatusCode::NOT_MODIFIED),
    ] {
        let seen = c.get(path).await;
        assert_eq!(seen.status, status, "{path}");
        assert_eq!(seen.body.unwrap(), "", "{path}");
        assert_eq!(seen.conn, own, "{path}");
    }

    // The connection's own fields, and those its `Connection` names, stay with it.
    let hop = c.get("/hop").await;
    assert_eq!(hop.body.unwrap(), "ok");
    assert_eq!(hop.headers["x-kept"], "yes");
    for name in ["connection", "keep-alive", "x-hop"] {
        assert!(!hop.headers.contains_key(name), "{name}: {:?}", hop.headers);
    }
    assert_eq!(hop.conn, own, "`keep-alive` keeps it");

    // The same through hyper's server (HTTP/2), which gets the fields in the map; and heads
    // that take the map path on our side too.
    let h2 = h2_client();
    for (path, kept, gone) in [
        (
            "/hop",
            &["x-kept"][..],
            &["connection", "keep-alive", "x-hop"][..],
        ),
        (
            "/hops",
            &["x-a", "x-b", "x-c", "x-d"],
            &["keep-alive", "te", "proxy-connection"],
        ),
        ("/lf", &["x-lf"], &["keep-alive"]),
    ] {
        let ours = c.get(path).await;
        let (status, theirs, body) = send(&h2, sc.addr(), "GET", path, &[]).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"), "{path}");
        assert_eq!(ours.body.unwrap(), "ok", "{path}");
        assert_eq!(ours.conn, own, "{path}");
        for headers in [&ours.headers, &theirs] {
            assert_eq!(headers["content-length"], "2", "{path}: {headers:?}");
            for name in kept {
                assert!(headers.contains_key(*name), "{path} {name}: {headers:?}");
            }
            for name in gone {
                assert!(!headers.contains_key(*name), "{path} {name}: {headers:?}");
            }
        }
    }

    // The same after a request whose body was streamed (chunked) on that client connection.
    let stream = TcpStream::connect(sc.addr()).await.unwrap();
    let mut handed = tokio::io::BufReader::new(stream);
    let upload = "POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n\
                  2\r\nhi\r\n0\r\n\r\n";
    assert_eq!(ask(&mut handed, upload).await.status, "HTTP/1.1 200 OK");
    let hop = ask(&mut handed, "GET /hop HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert_eq!(
        (hop.status.as_str(), hop.body.as_str()),
        ("HTTP/1.1 200 OK", "ok")
    );
    assert!(hop.head.contains("x-kept: yes\r\n"), "{}", hop.head);
    for name in ["connection: keep-alive", "keep-alive:", "x-hop:"] {
        assert!(!hop.head.contains(name), "{name}: {}", hop.head);
    }

    let hints = c.get("/hints").await;
    assert_eq!(
        hints.status,
        StatusCode::OK,
        "the interim response is skipped"
    );
    assert_eq!(hints.body.unwrap(), "hints");

    let last = c.get("/plain").await;
    assert_eq!(last.body.unwrap(), "ok");
    assert_eq!(
        last.conn, own,
        "still the same connection after all of them"
    );
    sc.shutdown();
    sc.wait().await;
}

/// Segments with data the kernel has received on `s` (`TCP_INFO`'s `tcpi_data_segs_in`):
/// on loopback, one per `write` of the proxy's (a small one; pure ACKs are not counted).
#[allow(unsafe_code)]
fn data_segments_in(s: &TcpStream) -> u32 {
    use std::os::fd::AsRawFd;
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let got = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    assert_eq!(got, 0, "TCP_INFO: {}", std::io::Error::last_os_error());
    info.tcpi_data_segs_in
}

/// Reads from `s` until what came ends with `end`.
async fn read_until(s: &mut TcpStream, end: &[u8]) -> Vec<u8> {
    let mut got = Vec::new();
    while !got.ends_with(end) {
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&chunk[..n]);
    }
    got
}

#[tokio::test]
async fn chunks_the_upstream_sent_together_reach_the_client_in_one_write() {
    let up = scripted().await;
    let sc = proxy(&up).await;
    let mut c = TcpStream::connect(sc.addr()).await.unwrap();
    // The first request borrows a connection, the second keeps one.
    for _ in 0..2 {
        c.write_all(b"GET /plain HTTP/1.1\r\nhost: app\r\n\r\n")
            .await
            .unwrap();
        read_until(&mut c, b"\r\n\r\nok").await;
    }
    // The upstream writes the head, two chunks, the last chunk and a trailer at once.
    let before = data_segments_in(&c);
    c.write_all(b"GET /chunked HTTP/1.1\r\nhost: app\r\n\r\n")
        .await
        .unwrap();
    let got = read_until(&mut c, b"0\r\n\r\n").await;
    let text = String::from_utf8_lossy(&got);
    let body = &got[text.find("\r\n\r\n").unwrap() + 4..];
    assert_eq!(dechunk(body), "abcdefg", "{text}");
    // A write per chunk and one for the end would be four.
    assert_eq!(data_segments_in(&c) - before, 1, "{text}");
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_response_that_ends_its_connection_is_read_to_the_end_and_not_reused() {
    let up = scripted().await;
    let sc = proxy(&up).await;
    let mut c = Client::new(sc.addr()).await;
    c.get("/plain").await;
    let first = c.get("/plain").await.conn;

    let until_close = c.get("/until-close").await;
    assert_eq!(until_close.body.unwrap(), "to the end");
    assert_eq!(until_close.conn, first);

    let second = c.get("/plain").await.conn;
    assert_ne!(
        second, first,
        "a body delimited by the close ends the connection"
    );

    let close = c.get("/close").await;
    assert_eq!(close.body.unwrap(), "ok");
    assert_eq!(close.conn, second);
    let third = c.get("/plain").await.conn;
    assert_ne!(third, second, "`Connection: close` ends the connection");

    // Transfer-Encoding beside a Content-Length: the coding wins, the length is not passed
    // on, and the connection is not reused (RFC 9112 §6.3).
    let both = c.get("/te-and-cl").await;
    assert_eq!(both.body.unwrap(), "abc");
    assert_ne!(both.length.as_deref(), Some("100"));
    assert_eq!(both.conn, third);
    let fourth = c.get("/plain").await.conn;
    assert_ne!(fourth, third);

    // HTTP/1.0 without `keep-alive` closes too (the upstream's; the client's stays open).
    let old = c.get("/http10").await;
    assert_eq!(old.body.unwrap(), "ok");
    assert_eq!(old.conn, fourth);
    assert_ne!(c.get("/plain").await.conn, fourth);
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn a_broken_response_is_a_502_and_a_cut_body_an_error() {
    let up = scripted().await;
    let sc = proxy(&up).await;
    let mut c = Client::new(sc.addr()).await;
    c.get("/plain").await;
    for path in [
        "/conflict",
        "/garbage",
        "/huge",
        "/switch",
        "/gzip-chunked",
        "/gzip-lines",
        "/gzip",
        "/chunked-twice",
    ] {
        let seen = c.get(path).await;
        assert_eq!(seen.status, StatusCode::BAD_GATEWAY, "{path}");
    }
    // The head was whole, the body not: the client gets the head and a cut body, or (when
    // the proxy had not flushed the head yet) a closed connection; never a whole response.
    if let Ok(cut) = c.try_send(Method::GET, "/short", empty()).await {
        assert_eq!(cut.status, StatusCode::OK);
        assert!(cut.body.is_err(), "the body ended early: {:?}", cut.body);
    }
    // The proxy closed that client connection; a new one is served.
    let mut again = Client::new(sc.addr()).await;
    assert_eq!(again.get("/plain").await.body.unwrap(), "ok");
    assert_eq!(again.get("/plain").await.body.unwrap(), "ok");
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn request_bodies_go_upstream_with_their_length_or_chunked() {
    let up = scripted().await;
    let sc = proxy(&up).await;
    let mut c = Client::new(sc.addr()).await;
    c.get("/plain").await;

    let sized = c
        .send(
            Method::POST,
            "/echo",
            Full::new(Bytes::from("hello")).boxed(),
        )
        .await;
    assert_eq!(sized.body.unwrap(), "hello");

    // A body of unknown length: the client sends it chunked, and so does the proxy.
    let frames = futures_stream(vec![Bytes::from("hel"), Bytes::from("lo")]);
    let streamed = c.send(Method::POST, "/echo", frames).await;
    let wire = streamed.body.unwrap();
    let decoded: String = dechunk(&wire);
    assert_eq!(decoded, "hello", "chunked on the wire: {wire:?}");
    assert!(
        wire.ends_with(b"0\r\n\r\n"),
        "ends with the last chunk: {wire:?}"
    );

    let bodies = up.bodies.lock().unwrap().clone();
    assert_eq!(bodies[bodies.len() - 2], b"hello");
    sc.shutdown();
    sc.wait().await;
}

/// A body of `frames` with no length known in advance.
fn futures_stream(frames: Vec<Bytes>) -> TestBody {
    let frames = frames
        .into_iter()
        .map(|b| Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b)));
    StreamBody::new(Stream(frames.collect())).boxed()
}

/// Frames handed out one by one, each in a poll of its own.
struct Stream(
    std::collections::VecDeque<Result<hyper::body::Frame<Bytes>, std::convert::Infallible>>,
);

impl futures_core::Stream for Stream {
    type Item = Result<hyper::body::Frame<Bytes>, std::convert::Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::task::Poll::Ready(self.0.pop_front())
    }
}

/// The data of a chunked body as sent on the wire.
fn dechunk(mut wire: &[u8]) -> String {
    let mut out = String::new();
    loop {
        let line_end = wire.windows(2).position(|w| w == b"\r\n").unwrap();
        let size =
            usize::from_str_radix(std::str::from_utf8(&wire[..line_end]).unwrap(), 16).unwrap();
        wire = &wire[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.push_str(std::str::from_utf8(&wire[..size]).unwrap());
        wire = &wire[size + 2..];
    }
}
