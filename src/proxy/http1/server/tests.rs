use super::*;
use crate::proxy::body::IN_HAND;
use crate::proxy::http1::framing::Chunk;
use crate::proxy::http2::stalls::Stalls;
use http::header::HeaderName;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;
use tokio::sync::watch;

fn parsed(text: &[u8]) -> (Parsed, BytesMut) {
    let mut buf = BytesMut::from(text);
    (parse(&mut buf, false), buf)
}

#[test]
fn a_plain_request_is_taken_out_of_the_buffer_and_what_follows_stays() {
    let (p, rest) =
        parsed(b"GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-Client: c1\r\nX-Client: c2\r\n\r\nGET /next");
    let Parsed::Request(req) = p else {
        panic!("not served here")
    };
    assert_eq!(req.method(), Method::GET);
    assert_eq!(req.uri(), "/a?b=1");
    assert_eq!(req.version(), Version::HTTP_11);
    assert_eq!(req.headers()["host"], "x");
    let clients: Vec<_> = req.headers().get_all("x-client").iter().collect();
    assert_eq!(clients, ["c1", "c2"]);
    assert!(http_body::Body::is_end_stream(req.body()));
    assert_eq!(&rest[..], b"GET /next");
}

#[test]
fn http10_head_and_a_zero_length_are_served_here() {
    let (p, _) = parsed(b"HEAD / HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
    let Parsed::Request(req) = p else {
        panic!("not served here")
    };
    assert_eq!(
        (req.method(), req.version()),
        (&Method::HEAD, Version::HTTP_10)
    );
}

#[test]
fn a_small_body_that_came_with_its_head_is_taken_with_it() {
    let (p, rest) = parsed(b"POST /u HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloGET /next");
    let Parsed::Request(req) = p else {
        panic!("not served here")
    };
    let Either::Right(body) = req.body() else {
        panic!("a body in hand")
    };
    assert_eq!(body.bytes(), b"hello");
    assert_eq!(http_body::Body::size_hint(body).exact(), Some(5));
    assert_eq!(req.headers()["content-length"], "5");
    assert_eq!(&rest[..], b"GET /next");

    // Not all of it yet: the request needs the head's 39 bytes and 5 more.
    let text = b"POST /u HTTP/1.1\r\nContent-Length: 5\r\n\r\nhel";
    let (p, rest) = parsed(text);
    assert!(matches!(p, Parsed::Short(44)));
    assert_eq!(&rest[..], text, "nothing taken");
}

#[test]
fn a_head_not_yet_whole_waits() {
    assert!(matches!(
        parsed(b"GET / HTTP/1.1\r\nHost: x\r\n").0,
        Parsed::Partial
    ));
}

#[test]
fn streamed_bodies_are_served_here_framed_as_their_head_says() {
    let large = format!(
        "POST /u HTTP/1.1\r\nContent-Length: {}\r\n\r\nxyz",
        IN_HAND + 1
    );
    let cases: &[(&[u8], Framing, bool)] = &[
        (large.as_bytes(), Framing::Length(IN_HAND as u64 + 1), false),
        (
            b"POST /u HTTP/1.1\r\nTransfer-Encoding:  Chunked \r\n\r\n0\r\n\r\n",
            Framing::Chunked(Chunk::Size),
            false,
        ),
        (
            b"PUT /u HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n",
            Framing::Length(5),
            true,
        ),
    ];
    for (text, framing, expects) in cases {
        let (p, rest) = parsed(text);
        let text_lossy = String::from_utf8_lossy(text);
        let Parsed::Streamed(req, f, e) = p else {
            panic!("{text_lossy:?} not streamed");
        };
        assert_eq!((f, e), (*framing, *expects), "{text_lossy:?}");
        // The head is taken; what follows it is the body's.
        assert!(text.ends_with(&rest), "{text_lossy:?}");
        assert_eq!(req.uri(), "/u");
    }
    // No body: nothing to stream, whatever the client expects.
    let (p, _) = parsed(b"PUT /u HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n");
    assert!(matches!(p, Parsed::Request(_)));
    // An HTTP/1.0 client's expectation is ignored (it knows no 100): its small body is in hand.
    let (p, _) = parsed(b"PUT /u HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\nabc");
    assert!(matches!(p, Parsed::Request(_)));
    // A small body in hand, when told to: streamed all the same.
    let mut buf = BytesMut::from(&b"POST /u HTTP/1.1\r\nContent-Length: 3\r\n\r\nab"[..]);
    assert!(matches!(
        parse(&mut buf, true),
        Parsed::Streamed(_, Framing::Length(3), false)
    ));
}

#[test]
fn odd_framings_and_garbage_are_refused_here_with_the_status_that_says_why() {
    let refused: &[(&[u8], u16)] = &[
        // Framings that are how one request is read as two: 400, and the connection closes.
        (
            b"POST /u HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
            400,
        ),
        (b"POST /u HTTP/1.1\r\nContent-Length: -5\r\n\r\nhello", 400),
        (
            b"POST /u HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        (
            b"POST /u HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
        ),
        (
            b"POST /u HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        // A coding this side does not decode: 501.
        (
            b"POST /u HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            501,
        ),
        (
            b"POST /u HTTP/1.1\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
            501,
        ),
        (
            b"POST /u HTTP/1.1\r\nTransfer-Encoding: chunked\x0b\r\n\r\n0\r\n\r\n",
            400,
        ),
        (
            b"PUT /u HTTP/1.1\r\nExpect: something\r\nContent-Length: 0\r\n\r\n",
            417,
        ),
        // A target no URI, or in the authority form without CONNECT.
        (
            b"POST /a<b> HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
            400,
        ),
        (b"GET app:80 HTTP/1.1\r\n\r\n", 400),
        (b"GET * HTTP/1.1\r\n\r\n", 400),
        (b"CONNECT app:443 HTTP/1.1\r\n\r\n", 501),
        (b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00", 400),
    ];
    for (text, status) in refused {
        let (p, _) = parsed(text);
        let text_lossy = String::from_utf8_lossy(text);
        match p {
            Parsed::Refused(why) => assert_eq!(why.status, *status, "{text_lossy:?}"),
            _ => panic!("not refused: {text_lossy:?}"),
        }
    }
    let many = format!("GET / HTTP/1.1\r\n{}\r\n", "X: y\r\n".repeat(101));
    assert!(matches!(parsed(many.as_bytes()).0, Parsed::Refused(w) if w.status == 431));
    // The HTTP/2 preface is no HTTP/1 head (a connection that begins with it is hyper's before
    // any head is read: `proxy::connection`).
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    assert!(matches!(parsed(preface).0, Parsed::Refused(w) if w.status == 400));
    // Served here: an upgrade (its own request, the tunnel comes with its answer), the
    // absolute form, and `*` for OPTIONS.
    let served: &[(&[u8], &str)] = &[
        (
            b"GET /ws HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
            "/ws",
        ),
        (b"OPTIONS * HTTP/1.1\r\n\r\n", "*"),
        (b"GET http://app/x?q HTTP/1.1\r\n\r\n", "http://app/x?q"),
    ];
    for (text, target) in served {
        match parsed(text).0 {
            Parsed::Request(req) => assert_eq!(req.uri(), *target),
            _ => panic!("not served: {:?}", String::from_utf8_lossy(text)),
        }
    }
}

/// A request head sent one byte per write: the parser is handed each byte a bounded
/// number of times (it was handed the whole buffer at every read: quadratic).
#[tokio::test]
async fn a_trickled_head_costs_parse_work_linear_in_its_size() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    client.set_nodelay(true).unwrap();
    let (server, _) = listener.accept().await.unwrap();
    let head = format!(
        "GET /t HTTP/1.1\r\nHost: x\r\n{}\r\n",
        "X-Pad: 0123456789abcdef0123456789abcdef0123456789abcdef\r\n".repeat(60)
    );
    let n = head.len();
    let (_drain, draining) = watch::channel(false);
    let lane = ConnSettings {
        hyper: hyper::server::conn::http2::Builder::new(TokioExecutor::new()),
        max_head: 64 * 1024,
        header_read: Duration::from_secs(30),
        client_idle: Duration::from_secs(30),
        send: Duration::from_secs(30),
        body_idle: Duration::from_secs(30),
        body_idle_errors: prometheus::IntCounter::new("b", "b").unwrap(),
        timers: Arc::new(Timers::default()),
        h2_budget: crate::proxy::http2::held::Budget::new(
            1 << 20,
            1 << 20,
            prometheus::IntGauge::new("h", "h").unwrap(),
            prometheus::IntCounter::new("s", "s").unwrap(),
        ),
        stalls: Arc::new(Stalls::new(
            (
                Duration::from_secs(30),
                prometheus::IntCounter::new("t", "t").unwrap(),
            ),
            (
                Duration::from_secs(30),
                prometheus::IntCounter::new("b", "b").unwrap(),
            ),
            Duration::from_secs(1),
        )),
        draining,
    };
    let mut s = ClientConn::new(server, &lane);
    // On a thread of its own: each byte its own segment, most read on their own.
    let writer = std::thread::spawn(move || {
        use std::io::Write as _;
        for b in head.as_bytes() {
            client.write_all(&[*b]).unwrap();
            std::thread::sleep(Duration::from_micros(20));
        }
        client
    });
    let mut slot = None;
    let never = std::pin::pin!(std::future::pending::<()>());
    PARSED.set(0);
    let next = s.head(&lane, never, &mut slot).await.unwrap();
    assert!(
        matches!(next, HeadRead::Request(_, None)),
        "a whole head is a request"
    );
    let work = PARSED.get();
    assert!(work <= 3 * n, "{work} bytes parsed for a head of {n}");
    drop(writer.join().unwrap());
}

#[test]
fn the_end_of_a_head_is_searched_once() {
    let mut end = HeadEnd::default();
    let text = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    let mut ends = Vec::new();
    for i in 1..=text.len() {
        ends.push(end.may_end(&text[..i]));
    }
    // The first look, then only when the empty line is whole (split across calls too).
    let at: Vec<usize> = (0..ends.len()).filter(|&i| ends[i]).collect();
    assert_eq!(at, [0, text.len() - 1]);
    let mut bare = HeadEnd::default();
    assert!(bare.may_end(b"G"));
    assert!(!bare.may_end(b"GET / HTTP/1.1\nHost: x\n"));
    assert!(bare.may_end(b"GET / HTTP/1.1\nHost: x\n\n"));
}

#[test]
fn lengths_and_decimals() {
    let mut digits = [0u8; 20];
    assert_eq!(decimal(0, &mut digits), b"0");
    assert_eq!(decimal(164, &mut digits), b"164");
    assert_eq!(
        decimal(u64::MAX, &mut digits),
        u64::MAX.to_string().as_bytes()
    );
    assert_eq!(parse_length(b"164"), Some(164));
    assert_eq!(parse_length(b""), None);
    assert_eq!(parse_length(b"1 2"), None);
    assert_eq!(parse_length(b"99999999999999999999"), None);
}

fn head_of(
    status: StatusCode,
    headers: &[(&str, &str)],
    framing: ResponseFraming,
    asked: ResponseAsks,
    stay: bool,
) -> String {
    let mut map = HeaderMap::new();
    for (n, v) in headers {
        map.append(
            HeaderName::from_bytes(n.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    let mut out = Vec::new();
    write_head(
        &mut out,
        status,
        (&map, Lines::default()),
        &framing,
        Some(3),
        asked,
        stay,
    );
    String::from_utf8(out).unwrap()
}

const GET11: ResponseAsks = ResponseAsks {
    head: false,
    http10: false,
    keep_alive: true,
};

#[test]
fn the_head_says_how_the_body_ends_and_what_becomes_of_the_connection() {
    let h = head_of(
        StatusCode::OK,
        &[("content-type", "text/plain")],
        ResponseFraming::Length(3),
        GET11,
        true,
    );
    assert!(
        h.starts_with("HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ndate: "),
        "{h}"
    );
    assert!(h.ends_with("GMT\r\ncontent-length: 3\r\n\r\n"), "{h}");
    // A length the response gave is not written twice; its own Connection is replaced.
    let h = head_of(
        StatusCode::OK,
        &[("content-length", "3"), ("connection", "x")],
        ResponseFraming::Length(3),
        GET11,
        false,
    );
    assert_eq!(h.matches("content-length").count(), 1, "{h}");
    assert!(
        !h.contains("connection: x") && h.ends_with("connection: close\r\n\r\n"),
        "{h}"
    );
    let h = head_of(StatusCode::OK, &[], ResponseFraming::Chunked, GET11, true);
    assert!(h.ends_with("transfer-encoding: chunked\r\n\r\n"), "{h}");
    // HTTP/1.0: its own version, keep-alive said when kept.
    let ten = ResponseAsks {
        http10: true,
        ..GET11
    };
    let h = head_of(
        StatusCode::TOO_MANY_REQUESTS,
        &[("date", "d")],
        ResponseFraming::Close,
        ten,
        true,
    );
    assert!(
        h.starts_with("HTTP/1.0 429 Too Many Requests\r\ndate: d\r\n"),
        "{h}"
    );
    assert!(h.ends_with("connection: keep-alive\r\n\r\n"), "{h}");
    // HEAD: the length a GET would have had.
    let head = ResponseAsks {
        head: true,
        ..GET11
    };
    let h = head_of(StatusCode::OK, &[], ResponseFraming::None, head, true);
    assert!(h.ends_with("content-length: 3\r\n\r\n"), "{h}");
}
