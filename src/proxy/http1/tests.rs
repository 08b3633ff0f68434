//! Differential tests: the hand-written HTTP/1 parsers against hyper, on the same bytes.
//!
//! Server side: generated request streams (valid and mangled: length and coding conflicts and
//! obfuscations, whitespace before colons, obs-fold, bare LF, NUL and CR in values, duplicate
//! fields, chunked bodies with huge or signed sizes, extensions and trailers, `Expect`,
//! pipelined requests) go to [`request_head::parse`] (and a streamed body to the request body's
//! decoder) and to hyper's HTTP/1 server. Every request this side serves must be one hyper
//! serves too, the same (method, target, version, fields, body), in the same order; what this
//! side refuses is answered and its connection closed. The bytes this side would forward for
//! each request ([`client::write_head`]) are parsed again by hyper's server: exactly one
//! request, the same but for the hop's fields.
//!
//! Client side: generated responses go to [`client::exchange`] over a loopback socket and to
//! hyper's HTTP/1 client: the same status, body bytes, failure, and framing that allows reuse.
//!
//! Deliberate differences (the generators avoid them or the checks allow them):
//! - a request refused here (its head or its body) may be one hyper serves;
//! - a request body's chunk-size lines are read strictly here (hex digits, then extensions
//!   only, CRLF; hyper takes some other shapes), and a body refused here fails its request
//!   and closes its connection;
//! - an unasked `101` is refused here (502); hyper's client hands it over for an upgrade;
//! - a chunk-size line of more than 15 hex digits is refused here; hyper takes up to 16;
//! - a response with a transfer coding other than `chunked` alone is refused here (502), as
//!   nginx refuses it: the client would get the coded bytes as its body; hyper reads it;
//! - a response with both `Transfer-Encoding` and `Content-Length` is read the same, but its
//!   connection is not reused here (RFC 9112 §6.3: it "ought to be handled as an error"); nor
//!   is a 204's that announces a body (the app may write it later);
//! - none else: bytes after a response's framing make both sides drop the connection.
//!
//! Cases per target: `SPILLWAY_DIFF_CASES` (10 000 by default; `bench/differential.sh` runs
//! more).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, Response, Version};
use http_body_util::{BodyExt, Empty, Full};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::client::{self, ConnKeeper, Unusable, UpstreamConn};
use super::framing::Step;
use super::request_head::{self, Parsed};
use crate::proxy::forward::{Added, InHand, ReqBody};

/// A request or response as one side saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    method: String,
    target: String,
    version: Version,
    fields: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

fn fields_of(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
        .collect()
}

fn cases() -> ProptestConfig {
    let cases = std::env::var("SPILLWAY_DIFF_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10_000);
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("regressions"),
        )),
        ..ProptestConfig::default()
    }
}

/// A runtime whose clock stands still and jumps when every task waits: a wait for more bytes
/// that will never come ends at once, deterministically.
fn paused() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

/// The requests hyper's HTTP/1 server serves from `bytes` (the client then closes its side),
/// in order; a request whose body cannot be read whole is not served.
fn hyper_serves(bytes: &[u8]) -> Vec<Seen> {
    paused().block_on(async {
        let (mut client, server_io) = tokio::io::duplex(1 << 20);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let tx = tx.clone();
            async move {
                let (parts, body) = req.into_parts();
                if let Ok(body) = body.collect().await {
                    let _ = tx.send(Seen {
                        method: parts.method.to_string(),
                        target: parts.uri.to_string(),
                        version: parts.version,
                        fields: fields_of(&parts.headers),
                        body: body.to_bytes().to_vec(),
                    });
                }
                Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
            }
        });
        // The client closes its side after the bytes: hyper must still serve what it read
        // (the proxy's server abandons a request whose client left, on both sides alike).
        let conn = hyper::server::conn::http1::Builder::new()
            .half_close(true)
            .serve_connection(hyper_util::rt::TokioIo::new(server_io), service);
        let task = tokio::spawn(conn);
        client.write_all(bytes).await.unwrap();
        client.shutdown().await.unwrap();
        // Read the answers until hyper closes (or gives up waiting).
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(60), client.read_to_end(&mut sink)).await;
        let _ = tokio::time::timeout(Duration::from_secs(60), task).await;
        let mut seen = Vec::new();
        while let Ok(s) = rx.try_recv() {
            seen.push(s);
        }
        seen
    })
}

/// A request this side serves: as seen, as made, and whether its body was streamed.
type ParsedRequest = (Seen, Request<ReqBody>, bool);

/// The requests this side serves from `bytes`, in order (with whether the body was streamed,
/// decoded as the request body would decode it), and what stopped it.
fn ours_serves(bytes: &[u8]) -> (Vec<ParsedRequest>, &'static str) {
    let mut buf = BytesMut::from(bytes);
    let mut out = Vec::new();
    loop {
        let (req, body, streamed) = match request_head::parse(&mut buf, false) {
            Parsed::Request(req) => {
                let body = match req.body() {
                    http_body_util::Either::Right(b) => b.bytes().to_vec(),
                    http_body_util::Either::Left(_) => unreachable!("served here: in hand"),
                };
                (req, body, false)
            }
            Parsed::Streamed(req, mut framing, _) => {
                let mut body = Vec::new();
                loop {
                    match super::framing::decode(&mut framing, &mut buf, true) {
                        Ok(Step::Data(d)) => body.extend_from_slice(&d),
                        Ok(Step::Trailers(_)) => {}
                        Ok(Step::End) => break,
                        Ok(Step::More) => return (out, "partial"),
                        // Answered 400 and closed.
                        Err(_) => return (out, "refused"),
                    }
                }
                (req, body, true)
            }
            Parsed::Partial => return (out, "partial"),
            Parsed::Short(_) => return (out, "short"),
            Parsed::Refused(_) => return (out, "refused"),
        };
        // A request that does not keep its connection is its last (the server closes after
        // answering it, as hyper does).
        let connection: Vec<&[u8]> = req
            .headers()
            .get_all(http::header::CONNECTION)
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        let last = !super::framing::keeps_alive(req.version(), &connection);
        let seen = Seen {
            method: req.method().to_string(),
            target: req.uri().to_string(),
            version: req.version(),
            fields: fields_of(req.headers()),
            body,
        };
        out.push((seen, req, streamed));
        if last {
            return (out, "closed");
        }
    }
}

/// What the hop sends upstream for `req`: its head as [`client::write_head`] writes it and
/// its body; and the fields the upstream must see.
fn forwarded(req: &Request<ReqBody>) -> (Vec<u8>, Vec<(String, Vec<u8>)>) {
    let upstream: http::uri::Authority = "app:8080".parse().unwrap();
    let added = Added::of(
        req.headers(),
        req.uri().authority(),
        Some(&upstream),
        [10, 0, 0, 1].into(),
        false,
    );
    let mut out = Vec::new();
    client::write_head(&mut out, req, &added, false);
    if let http_body_util::Either::Right(b) = req.body() {
        out.extend_from_slice(b.bytes());
    }
    let kept = req.headers().iter().filter(|(n, _)| added.passes(n));
    let mut want: Vec<(String, Vec<u8>)> = kept
        .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
        .chain(
            added
                .fields()
                .map(|(n, v)| (n.as_str().to_string(), v.to_vec())),
        )
        .collect();
    want.sort();
    (out, want)
}

// ---- Generators -------------------------------------------------------------------------

fn line_end() -> impl Strategy<Value = &'static str> {
    prop_oneof![8 => Just("\r\n"), 1 => Just("\n"), 1 => Just("\r")]
}

fn token() -> impl Strategy<Value = String> {
    "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,12}"
}

fn method() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => Just("GET".to_string()),
        3 => Just("POST".to_string()),
        1 => Just("HEAD".to_string()),
        1 => Just("PUT".to_string()),
        1 => Just("OPTIONS".to_string()),
        1 => Just("CONNECT".to_string()),
        1 => Just("get".to_string()),
        1 => token(),
    ]
}

fn target() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => Just("/".to_string()),
        4 => "/[a-z0-9/._~%?=&;-]{0,20}",
        1 => Just("*".to_string()),
        1 => Just("http://app/x".to_string()),
        1 => Just("app:443".to_string()),
        1 => Just("/a b".to_string()),
        1 => Just("/a\tb".to_string()),
        1 => "[ -~]{0,12}",
    ]
}

fn version() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        8 => Just("HTTP/1.1"),
        2 => Just("HTTP/1.0"),
        1 => Just("HTTP/2.0"),
        1 => Just("HTTP/1.2"),
        1 => Just("http/1.1"),
    ]
}

fn length_value() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (0u32..40).prop_map(|n| n.to_string()),
        1 => Just("".to_string()),
        1 => (0u32..40).prop_map(|n| format!("+{n}")),
        1 => (0u32..40).prop_map(|n| format!("-{n}")),
        1 => (0u32..40).prop_map(|n| format!(" {n} ")),
        1 => (0u32..40).prop_map(|n| format!("{n}, {n}")),
        1 => (0u32..40, 0u32..40).prop_map(|(a, b)| format!("{a},{b}")),
        1 => (0u32..40).prop_map(|n| format!("0x{n:x}")),
        1 => Just("99999999999999999999".to_string()),
        1 => Just("18446744073709551616".to_string()),
    ]
}

fn coding() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => Just("chunked".to_string()),
        1 => Just("Chunked".to_string()),
        1 => Just(" chunked".to_string()),
        1 => Just("chunked ".to_string()),
        1 => Just("xchunked".to_string()),
        1 => Just("chunked, gzip".to_string()),
        1 => Just("gzip, chunked".to_string()),
        1 => Just("identity".to_string()),
        1 => Just("chunked\u{b}".to_string()),
    ]
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => "[ -~]{0,16}".prop_map(String::into_bytes),
        1 => Just(b"a\0b".to_vec()),
        1 => Just(b"a\rb".to_vec()),
        1 => Just(b"\xff\xfe".to_vec()),
        1 => Just(b"a\tb ".to_vec()),
    ]
}

/// One header line, without its line end.
fn field() -> impl Strategy<Value = Vec<u8>> {
    let named = |name: &'static str, v: BoxedStrategy<String>| {
        v.prop_map(move |v| format!("{name}: {v}").into_bytes())
    };
    prop_oneof![
        4 => named("Host", prop_oneof![Just("app".to_string()), Just("app:8080".to_string()), Just("".to_string()), "[ -~]{0,8}".boxed()].boxed()),
        3 => named("Content-Length", length_value().boxed()),
        2 => named("Transfer-Encoding", coding().boxed()),
        1 => named("Expect", Just("100-continue".to_string()).boxed()),
        1 => named("Upgrade", Just("websocket".to_string()).boxed()),
        2 => named("Connection", prop_oneof![Just("close".to_string()), Just("keep-alive".to_string()), Just("x-a".to_string()), Just("content-length".to_string())].boxed()),
        1 => named("Content-Length ", length_value().boxed()),
        1 => named("Content_Length", length_value().boxed()),
        1 => named("Transfer-Encoding ", coding().boxed()),
        1 => Just(b"X-Fold: a\r\n b".to_vec()),
        1 => Just(b"X-Fold: a\n\tb".to_vec()),
        1 => Just(b" X-Lead: a".to_vec()),
        1 => Just(b"NoColon".to_vec()),
        1 => Just(b": empty-name".to_vec()),
        1 => Just(b"X-Forwarded-For: 1.2.3.4".to_vec()),
        4 => (token(), value()).prop_map(|(n, v)| {
            let mut line = n.into_bytes();
            line.extend_from_slice(b": ");
            line.extend_from_slice(&v);
            line
        }),
    ]
}

fn chunked_body() -> impl Strategy<Value = Vec<u8>> {
    let size = prop_oneof![
        4 => (0usize..12).prop_map(|n| (format!("{n:x}"), n)),
        1 => Just(("-1".to_string(), 1)),
        1 => Just(("ffffffffffffffffff".to_string(), 3)),
        1 => (0usize..12).prop_map(|n| (format!("{n:x};ext=1"), n)),
        1 => (0usize..12).prop_map(|n| (format!("{n:x} "), n)),
        1 => (0usize..12).prop_map(|n| (format!("0{n:x}"), n)),
        1 => (0usize..12).prop_map(|n| (format!("{n:X}"), n)),
        1 => (0usize..12).prop_map(|n| (format!(" {n:x}"), n)),
        1 => (0usize..12).prop_map(|n| (format!("\t{n:x}"), n)),
        1 => (0usize..12).prop_map(|n| (format!("{n:x}\r"), n)),
        1 => (0usize..12).prop_map(|n| (format!("{n:x}\x0c"), n)),
        1 => (0usize..12).prop_map(|n| (format!("{n:x};a\rb"), n)),
    ];
    (
        prop::collection::vec(size, 0..3),
        prop_oneof![Just(""), Just("X-T: 1\r\n")],
        any::<bool>(),
    )
        .prop_map(|(chunks, trailer, end)| {
            let mut out = Vec::new();
            for (line, n) in chunks {
                out.extend_from_slice(line.as_bytes());
                out.extend_from_slice(b"\r\n");
                out.extend(std::iter::repeat_n(b'c', n));
                out.extend_from_slice(b"\r\n");
            }
            if end {
                out.extend_from_slice(b"0\r\n");
                out.extend_from_slice(trailer.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            out
        })
}

/// A request: its line, fields, line ends and a body of some shape.
fn request() -> impl Strategy<Value = Vec<u8>> {
    (
        method(),
        target(),
        version(),
        prop::collection::vec(field(), 0..6),
        line_end(),
        prop_oneof![
            3 => Just(Vec::new()),
            3 => prop::collection::vec(any::<u8>(), 0..40),
            2 => chunked_body(),
            1 => Just(b"GET /smuggled HTTP/1.1\r\nHost: app\r\n\r\n".to_vec()),
        ],
    )
        .prop_map(|(method, target, version, fields, end, body)| {
            let mut out = format!("{method} {target} {version}{end}").into_bytes();
            for f in fields {
                out.extend_from_slice(&f);
                out.extend_from_slice(end.as_bytes());
            }
            out.extend_from_slice(end.as_bytes());
            out.extend_from_slice(&body);
            out
        })
}

/// One to three requests back to back (pipelined), with now and then a stray byte between.
fn requests() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec(request(), 1..4),
        prop_oneof![5 => Just(Vec::new()), 1 => Just(b"\r\n".to_vec()), 1 => Just(b"x".to_vec())],
    )
        .prop_map(|(reqs, between)| reqs.join(&between[..]))
}

// ---- Server side ------------------------------------------------------------------------

/// The request path's checks and rewrites before a request goes on, as the sidecar has them.
fn hygiene() -> crate::hygiene::Hygiene {
    let config = crate::config::Config::from_yaml(
        "service: t\nlisten: 127.0.0.1:0\nupstream: http://app:8080\n",
        "t.yaml",
    )
    .unwrap();
    crate::hygiene::Hygiene::of(&config)
}

fn check_server(bytes: &[u8]) -> Result<(), TestCaseError> {
    let (ours, stopped) = ours_serves(bytes);
    let theirs = hyper_serves(bytes);
    let served = ours.len();
    for (i, (seen, mut req, streamed)) in ours.into_iter().enumerate() {
        let Some(hyper) = theirs.get(i) else {
            return Err(TestCaseError::fail(format!(
                "served here but not by hyper: request {i} {seen:?}; hyper served {theirs:?}"
            )));
        };
        prop_assert_eq!(&seen, hyper, "request {} differs", i);
        // What the request path refuses (400) goes nowhere; a streamed body goes on through
        // hyper's client, which frames it anew.
        if hygiene().apply(&mut req).is_err() || streamed {
            continue;
        }
        // What goes upstream is exactly one request, the same but for the hop's fields.
        let (out, want) = forwarded(&req);
        let again = hyper_serves(&out);
        prop_assert_eq!(
            again.len(),
            1,
            "forwarded bytes are {} requests: {:?}",
            again.len(),
            String::from_utf8_lossy(&out)
        );
        let mut got = again[0].fields.clone();
        got.sort();
        prop_assert_eq!(&again[0].method, &seen.method);
        // In origin form, whatever form the client used.
        let origin = req.uri().path_and_query().map_or("/", |p| p.as_str());
        prop_assert_eq!(&again[0].target, origin);
        prop_assert_eq!(&again[0].body, &seen.body);
        prop_assert_eq!(got, want);
    }
    // A request hyper serves where this side waits for more bytes (and would time out) is a
    // difference too: what this side stops at must be hyper's to serve or refuse.
    if matches!(stopped, "partial" | "short") && theirs.len() > served {
        return Err(TestCaseError::fail(format!(
            "hyper served request {served} ({:?}) where this side waits ({stopped})",
            theirs[served]
        )));
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn the_server_side_serves_what_hyper_serves_and_forwards_one_request(bytes in requests()) {
        check_server(&bytes)?;
    }
}

#[test]
fn known_smuggling_shapes_are_not_served_here() {
    // Each of these is how one request is read as two: refused, never served here.
    let shapes: &[&[u8]] = &[
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length : 5\r\n\r\nhello",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\nhello",
    ];
    for bytes in shapes {
        let mut buf = BytesMut::from(*bytes);
        assert!(
            matches!(request_head::parse(&mut buf, false), Parsed::Refused(_)),
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
        check_server(bytes).unwrap();
    }
}

// ---- Client side ------------------------------------------------------------------------

/// What a response exchange came to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    /// Status, body bytes, and whether its framing allows the connection's reuse.
    Whole(u16, Vec<u8>, bool),
    Failed,
}

fn status_line() -> impl Strategy<Value = String> {
    let code = prop_oneof![
        6 => Just(200u16),
        1 => Just(204),
        1 => Just(304),
        1 => Just(404),
        1 => Just(100),
        1 => Just(103),
        1 => Just(199),
        1 => Just(999),
    ];
    (
        prop_oneof![8 => Just("HTTP/1.1"), 2 => Just("HTTP/1.0"), 1 => Just("HTTP/2.0")],
        code,
    )
        .prop_map(|(v, c)| format!("{v} {c} X"))
}

fn response() -> impl Strategy<Value = Vec<u8>> {
    let head = (
        status_line(),
        prop::collection::vec(field(), 0..5),
        line_end(),
    )
        .prop_map(|(status, fields, end)| {
            let mut out = format!("{status}{end}").into_bytes();
            for f in fields {
                out.extend_from_slice(&f);
                out.extend_from_slice(end.as_bytes());
            }
            out.extend_from_slice(end.as_bytes());
            out
        });
    (
        prop_oneof![1 => Just(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec()), 6 => Just(Vec::new())],
        head,
        prop_oneof![
            3 => Just(Vec::new()),
            3 => prop::collection::vec(any::<u8>(), 0..40),
            3 => chunked_body(),
        ],
    )
        .prop_map(|(interim, head, body)| [interim, head, body].concat())
}

/// Records what became of the connection.
#[derive(Default)]
struct Record {
    put: std::sync::atomic::AtomicBool,
}

impl ConnKeeper for Record {
    fn put(&self, _: UpstreamConn, _: u64) {
        self.put.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn discarded(&self, _: Unusable) {}
}

/// This side's exchange of `method /` against an upstream that writes `bytes` and closes.
async fn ours_reads(listener: &tokio::net::TcpListener, method: &str, bytes: &[u8]) -> Answer {
    let addr = listener.local_addr().unwrap();
    let connect = tokio::net::TcpStream::connect(addr);
    let (stream, accepted) = tokio::join!(connect, listener.accept());
    let (mut app, _) = accepted.unwrap();
    let bytes = bytes.to_vec();
    let app = tokio::spawn(async move {
        let mut head = [0u8; 1024];
        let _ = app.read(&mut head).await;
        let _ = app.write_all(&bytes).await;
        let _ = app.shutdown().await;
        // Held until the exchange is over: a reset would race the bytes.
        let mut rest = Vec::new();
        let _ = app.read_to_end(&mut rest).await;
    });
    let raw = UpstreamConn::new(stream.unwrap(), None);
    let mut req = Request::builder()
        .method(method)
        .uri("/")
        .header("host", "app")
        .body(http_body_util::Either::Right(InHand::default()))
        .unwrap();
    let added = Added::of(req.headers(), None, None, [10, 0, 0, 1].into(), false);
    let record = Arc::new(Record::default());
    client::woke();
    let answer = match client::exchange(raw, &mut req, &added, record.clone(), 0).await {
        Err(_) => Answer::Failed,
        Ok((resp, _)) => {
            let status = resp.status().as_u16();
            let mut body = resp.into_body();
            let mut data = Vec::new();
            let mut failed = false;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(f) => {
                        if let Some(d) = f.data_ref() {
                            data.extend_from_slice(d);
                        }
                    }
                    Err(_) => {
                        failed = true;
                        break;
                    }
                }
            }
            drop(body);
            let reusable = record.put.load(std::sync::atomic::Ordering::SeqCst);
            match failed {
                true => Answer::Failed,
                false => Answer::Whole(status, data, reusable),
            }
        }
    };
    app.abort();
    answer
}

/// hyper's client on the same bytes: once with the close after them (status, body), once
/// without (whether the connection is ready for another request after the body).
fn hyper_reads(method: &str, bytes: &[u8]) -> Answer {
    let run = |close: bool| {
        paused().block_on(async {
            let (io, mut app) = tokio::io::duplex(1 << 20);
            let (mut sender, conn) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(
                hyper_util::rt::TokioIo::new(io),
            )
            .await
            .unwrap();
            tokio::spawn(conn);
            let bytes = bytes.to_vec();
            tokio::spawn(async move {
                let mut head = [0u8; 1024];
                let _ = app.read(&mut head).await;
                let _ = app.write_all(&bytes).await;
                if close {
                    let _ = app.shutdown().await;
                }
                // Kept open otherwise, as a kept-alive upstream would be.
                std::future::pending::<()>().await;
            });
            let req = Request::builder()
                .method(method)
                .uri("/")
                .header("host", "app")
                .body(Full::new(Bytes::new()))
                .unwrap();
            let exchange = async {
                let resp = sender.send_request(req).await.ok()?;
                let status = resp.status().as_u16();
                let body = resp.into_body().collect().await.ok()?.to_bytes().to_vec();
                let ready = match close {
                    true => false,
                    false => sender.ready().await.is_ok(),
                };
                Some((status, body, ready))
            };
            tokio::time::timeout(Duration::from_secs(60), exchange)
                .await
                .ok()
                .flatten()
        })
    };
    match run(true) {
        None => Answer::Failed,
        Some((status, body, _)) => {
            let reusable = run(false).is_some_and(|(_, _, ready)| ready);
            Answer::Whole(status, body, reusable)
        }
    }
}

/// Whether hyper's answer and ours differ only as listed in this module's doc.
fn deliberate(bytes: &[u8], ours: &Answer, theirs: &Answer) -> bool {
    let text = String::from_utf8_lossy(bytes).to_ascii_lowercase();
    // An unasked 101, and chunk sizes past 15 hex digits.
    if text.contains(" 101 ") || text.contains("ffffffffffffffff") {
        return true;
    }
    // A transfer coding other than `chunked` alone.
    let codings: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("transfer-encoding:"))
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    if *ours == Answer::Failed && !codings.is_empty() && codings != ["chunked"] {
        return true;
    }
    // Both a coding and a length, or a 204 that announces a body: the same answer, but the
    // connection is not reused here.
    match (ours, theirs) {
        (Answer::Whole(s, b, false), Answer::Whole(t, c, true)) => {
            s == t
                && b == c
                && ((text.contains("\ntransfer-encoding") && text.contains("\ncontent-length"))
                    || (*s == 204
                        && (text.contains("\ntransfer-encoding")
                            || text.contains("\ncontent-length"))))
        }
        _ => false,
    }
}

fn check_client(
    rt: &tokio::runtime::Runtime,
    listener: &tokio::net::TcpListener,
    method: &str,
    bytes: &[u8],
) -> Result<(), TestCaseError> {
    let ours = rt.block_on(ours_reads(listener, method, bytes));
    let theirs = hyper_reads(method, bytes);
    if ours != theirs && !deliberate(bytes, &ours, &theirs) {
        return Err(TestCaseError::fail(format!(
            "{method} {:?}: ours {ours:?}, hyper {theirs:?}",
            String::from_utf8_lossy(bytes)
        )));
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn the_client_side_reads_what_hyper_reads(
        bytes in response(),
        head in prop::bool::weighted(0.15),
    ) {
        thread_local! {
            static LOOP: (tokio::runtime::Runtime, tokio::net::TcpListener) = {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
                (rt, listener)
            };
        }
        let method = if head { "HEAD" } else { "GET" };
        LOOP.with(|(rt, listener)| check_client(rt, listener, method, &bytes))?;
    }
}
