use super::*;
use crate::key::tests::headers;

struct Nowhere;

impl ConnKeeper for Nowhere {
    fn put(&self, _: UpstreamConn, _: u64) {}
    fn discarded(&self, _: Unusable) {}
}

/// A response head the upstream sends one byte per write: the parser is handed each byte
/// a bounded number of times.
#[tokio::test]
async fn a_trickled_response_head_costs_parse_work_linear_in_its_size() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let head = format!(
        "HTTP/1.1 200 OK\r\n{}content-length: 2\r\n\r\nok",
        "x-pad: 0123456789abcdef0123456789abcdef0123456789abcdef\r\n".repeat(60)
    );
    let n = head.len();
    let app = std::thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut req = [0u8; 1024];
        let _ = s.read(&mut req).unwrap();
        for b in head.as_bytes() {
            s.write_all(&[*b]).unwrap();
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        s
    });
    let raw = UpstreamConn::new(TcpStream::connect(addr).await.unwrap(), None);
    let mut req = Request::get("/t")
        .body(Either::Right(crate::proxy::forward::InHand::default()))
        .unwrap();
    let added = Added::of(req.headers(), None, None, [127, 0, 0, 1].into(), false);
    PARSED.set(0);
    woke();
    let (resp, _) = exchange(raw, &mut req, &added, Arc::new(Nowhere), 0)
        .await
        .map_err(|_| "failed")
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let work = PARSED.get();
    assert!(work <= 3 * n, "{work} bytes parsed for a head of {n}");
    drop(app.join().unwrap());
}

fn framed(status: u16, head_only: bool, pairs: &[(&str, &str)]) -> io::Result<(String, bool)> {
    let status = StatusCode::from_u16(status).unwrap();
    let h = headers(pairs);
    let d = delimiters(&h);
    framing(status, head_only, Version::HTTP_11, &d).map(|(f, reuse)| {
        let f = match f {
            Framing::Done => "done".to_string(),
            Framing::Length(n) => format!("length {n}"),
            Framing::Chunked(_) => "chunked".to_string(),
            Framing::Close => "close".to_string(),
        };
        (f, reuse)
    })
}

fn delimiters(h: &HeaderMap) -> Delimiters<'_> {
    Delimiters::of(
        h.iter()
            .map(|(n, v)| (Named::of(n.as_str().as_bytes()), v.as_bytes())),
    )
}

#[test]
fn a_body_is_delimited_as_rfc_9112_says() {
    let done = Some(("done".to_string(), true));
    assert_eq!(framed(200, true, &[("content-length", "9")]).ok(), done);
    assert_eq!(framed(204, false, &[]).ok(), done);
    assert_eq!(framed(204, false, &[("content-length", "0")]).ok(), done);
    // A 204 that announces a body may send it later: not reused.
    let not_kept = Some(("done".to_string(), false));
    assert_eq!(
        framed(204, false, &[("content-length", "5")]).ok(),
        not_kept
    );
    assert_eq!(
        framed(204, false, &[("transfer-encoding", "chunked")]).ok(),
        not_kept
    );
    assert_eq!(framed(304, false, &[("content-length", "9")]).ok(), done);
    assert_eq!(
        framed(
            200,
            false,
            &[("content-length", "3, 3"), ("content-length", "3")]
        )
        .unwrap(),
        ("length 3".to_string(), true)
    );
    assert!(framed(200, false, &[("content-length", "3, 4")]).is_err());
    assert!(framed(200, false, &[("content-length", "+3")]).is_err());
    assert!(framed(200, false, &[("content-length", "")]).is_err());
    assert_eq!(
        framed(200, false, &[("transfer-encoding", " Chunked")]).unwrap(),
        ("chunked".to_string(), true)
    );
    // Any other coding: its bytes are not the content (502).
    for codings in [
        &["gzip, chunked"][..],
        &["gzip", "chunked"],
        &["chunked, chunked"],
    ] {
        let fields: Vec<_> = codings.iter().map(|c| ("transfer-encoding", *c)).collect();
        assert!(framed(200, false, &fields).is_err(), "{codings:?}");
    }
    // Both: the coding wins, and the connection is not reused.
    assert_eq!(
        framed(
            200,
            false,
            &[("transfer-encoding", "chunked"), ("content-length", "3")]
        )
        .unwrap(),
        ("chunked".to_string(), false)
    );
    assert!(framed(200, false, &[("transfer-encoding", "gzip")]).is_err());
    assert_eq!(
        framed(200, false, &[]).unwrap(),
        ("close".to_string(), false)
    );
}

/// What `head` passes on when the hop's own fields stay behind: the runs of lines, and the
/// map a server writing its own heads gets; `None` when it takes the map path.
type Seen = (Vec<String>, bool, bool, Vec<(String, String)>);

fn passed(head: &str) -> Option<Seen> {
    let mut buf = BytesMut::from(head);
    let head = take_head(&mut buf).unwrap().expect("a whole head");
    let p = Passed::of(&head, |f| !f.named.hop_by_hop())?;
    let runs = p
        .runs()
        .map(|r| String::from_utf8_lossy(r).into_owned())
        .collect();
    let (date, length) = (p.date, p.length);
    let mut map = HeaderMap::new();
    p.into_map(&mut map);
    let map = map
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
        .collect();
    Some((runs, date, length, map))
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

#[test]
fn an_upstream_head_passes_as_written_less_the_hops_lines() {
    // nginx's: one run, the connection's field left out.
    let (runs, date, length, map) = passed(
        "HTTP/1.1 200 OK\r\nServer: nginx\r\nDate: Mon, 30 Nov 2026 16:00:00 GMT\r\n\
         Content-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
    )
    .unwrap();
    assert_eq!(
        runs,
        ["Server: nginx\r\nDate: Mon, 30 Nov 2026 16:00:00 GMT\r\nContent-Length: 2\r\n"]
    );
    assert!(date && length);
    assert_eq!(
        map,
        pairs(&[
            ("server", "nginx"),
            ("date", "Mon, 30 Nov 2026 16:00:00 GMT"),
            ("content-length", "2")
        ])
    );
    // Hop lines between kept ones cut the head into runs; values keep their inner spaces
    // and lose the outer ones in the map.
    let (runs, date, length, map) = passed(
        "HTTP/1.1 200 OK\r\nkeep-alive: timeout=5\r\nx-a:  one two \r\nTE: trailers\r\n\
         x-b:2\r\nx-c: 3\r\nconnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(runs, ["x-a:  one two \r\n", "x-b:2\r\nx-c: 3\r\n"]);
    assert!(!date && !length);
    assert_eq!(
        map,
        pairs(&[("x-a", "one two"), ("x-b", "2"), ("x-c", "3")])
    );
    // An empty value, and one of spaces only.
    let (runs, _, length, map) =
        passed("HTTP/1.1 200 OK\r\nx-empty:\r\nx-blank:   \r\ncontent-length: 0\r\n\r\n").unwrap();
    assert_eq!(runs, ["x-empty:\r\nx-blank:   \r\ncontent-length: 0\r\n"]);
    assert!(length);
    assert_eq!(
        map,
        pairs(&[("x-empty", ""), ("x-blank", ""), ("content-length", "0")])
    );
    // Nothing kept, nothing to write.
    let (runs, ..) = passed("HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n").unwrap();
    assert!(runs.is_empty());
}

#[test]
fn a_response_field_is_named_by_what_reading_the_head_needs_of_it() {
    assert_eq!(Named::of(b"Date"), Named::Date);
    assert_eq!(Named::of(b"CONTENT-LENGTH"), Named::ContentLength);
    assert_eq!(Named::of(b"Connection"), Named::Connection);
    assert_eq!(Named::of(b"transfer-Encoding"), Named::TransferEncoding);
    // The rest of the one hop-by-hop set (`crate::hop`), in any case.
    for name in ["Keep-Alive", "TE", "upgrade", "Proxy-Authorization"] {
        assert_eq!(Named::of(name.as_bytes()), Named::Hop, "{name}");
    }
    for name in ["server", "tes", "connections", "x", ""] {
        assert_eq!(Named::of(name.as_bytes()), Named::Other, "{name}");
    }
}

#[test]
fn a_head_cut_into_many_runs_or_with_bare_lf_line_ends_takes_the_map() {
    // Four runs of kept lines.
    assert!(passed(
        "HTTP/1.1 200 OK\r\nx-a: 1\r\nte: t\r\nx-b: 2\r\nte: t\r\nx-c: 3\r\nte: t\r\n\
         x-d: 4\r\n\r\n"
    )
    .is_none());
    // Three are fine.
    assert!(
        passed("HTTP/1.1 200 OK\r\nx-a: 1\r\nte: t\r\nx-b: 2\r\nte: t\r\nx-c: 3\r\n\r\n").is_some()
    );
    for lf in [
        "HTTP/1.1 200 OK\nx-a: 1\nx-b: 2\n\n",
        "HTTP/1.1 200 OK\r\nx-a: 1\nx-b: 2\r\n\r\n",
        "HTTP/1.1 200 OK\r\nx-a: 1\r\nx-b: 2\r\n\n",
    ] {
        assert!(passed(lf).is_none(), "{lf:?}");
    }
}

#[test]
fn keep_alive_follows_the_version_and_connection() {
    let keeps = |version, pairs: &[(&str, &str)]| {
        let h = headers(pairs);
        let d = delimiters(&h);
        keeps_alive(version, &d.connection)
    };
    assert!(keeps(Version::HTTP_11, &[]));
    assert!(!keeps(Version::HTTP_11, &[("connection", "Close")]));
    assert!(!keeps(Version::HTTP_10, &[]));
    assert!(keeps(Version::HTTP_10, &[("connection", "x, keep-alive")]));
}

#[test]
fn the_request_head_is_written_as_it_goes_on_the_wire() {
    let req = Request::builder()
        .method(Method::POST)
        .uri("/a?b=c")
        .header("host", "app")
        .header("connection", "x-drop")
        .header("x-drop", "1")
        .header("x-many", "1")
        .header("x-many", "2")
        .body(())
        .unwrap();
    let peer = "192.0.2.7".parse().unwrap();
    let added = Added::of(req.headers(), None, None, peer, false);
    let mut out = Vec::new();
    write_head(&mut out, &req, &added, false);
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "POST /a?b=c HTTP/1.1\r\nhost: app\r\nx-many: 1\r\nx-many: 2\r\n\
         x-forwarded-for: 192.0.2.7\r\nx-forwarded-proto: http\r\nx-forwarded-host: app\r\n\r\n"
    );
}

#[tokio::test]
async fn reads_take_a_page_and_grow_only_for_a_response_that_fills_them() {
    let (app, mut raw) = app_and_raw().await;
    let mut app = TcpStream::from_std(app).unwrap();
    // A small response: one page of room, which the connection keeps.
    app.write_all(&[b'x'; 300]).await.unwrap();
    assert_eq!(
        std::future::poll_fn(|cx| raw.poll_fill(cx)).await.unwrap(),
        300
    );
    assert!(raw.buf.capacity() < ROOM[1], "{}", raw.buf.capacity());
    raw.buf.clear();
    raw.filled = 0;
    // A large one (on loopback the whole of it is in our socket once written): each read
    // that fills its room gets more room for the next.
    let large = 60 * 1024;
    app.write_all(&vec![b'y'; large]).await.unwrap();
    let mut reads = Vec::new();
    while reads.iter().sum::<usize>() < large {
        let before = raw.buf.len();
        std::future::poll_fn(|cx| raw.poll_fill(cx)).await.unwrap();
        reads.push(raw.buf.len() - before);
    }
    assert!(reads[0] <= ROOM[0], "{reads:?}");
    assert!(reads.iter().all(|n| *n <= ROOM[2]), "{reads:?}");
    assert!(reads.len() <= 3, "{reads:?}");
    assert!(raw.buf.capacity() >= ROOM[1], "{}", raw.buf.capacity());
}

struct Dropped;

impl ConnKeeper for Dropped {
    fn put(&self, _: UpstreamConn, _: u64) {}
    fn discarded(&self, _: Unusable) {}
}

/// A connection to a listening "app", and our end of it.
async fn app_and_raw() -> (std::net::TcpStream, UpstreamConn) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    app.set_nonblocking(true).unwrap();
    (
        app,
        UpstreamConn::new(listener.accept().await.unwrap().0, None),
    )
}

/// A GET exchanged on `raw`: the response's status.
async fn exchanged(raw: UpstreamConn) -> Result<StatusCode, ()> {
    let mut req = Request::get("/x")
        .header("host", "app")
        .body(Either::Right(crate::proxy::forward::InHand::new(
            Bytes::new(),
        )))
        .unwrap();
    let peer = "192.0.2.7".parse().unwrap();
    let added = Added::of(req.headers(), None, None, peer, false);
    let resp = exchange(raw, &mut req, &added, Arc::new(Dropped), 0).await;
    resp.map(|(r, _)| r.status()).map_err(|_| ())
}

/// What a real `recv` on the app's side finds now (std's, not tokio's readiness-gated
/// `try_read`): a byte, or `WouldBlock` when nothing was written yet.
fn first_byte(app: &std::net::TcpStream) -> Result<usize, io::ErrorKind> {
    app.peek(&mut [0u8; 1]).map_err(|e| e.kind())
}

/// The same, waiting up to `limit` for a byte: a blocking `recv` (the whole runtime's thread
/// waits, so only for bytes already sent: loopback may hand them over a little later).
fn first_byte_within(
    app: &std::net::TcpStream,
    limit: std::time::Duration,
) -> Result<usize, io::ErrorKind> {
    app.set_nonblocking(false).unwrap();
    app.set_read_timeout(Some(limit)).unwrap();
    let seen = first_byte(app);
    app.set_nonblocking(true).unwrap();
    seen
}

/// The app reads the request whole and answers 204.
async fn answered(app: std::net::TcpStream) {
    let mut app = TcpStream::from_std(app).unwrap();
    let mut got = Vec::new();
    while !got.ends_with(b"\r\n\r\n") {
        let mut piece = [0u8; 512];
        let n = tokio::io::AsyncReadExt::read(&mut app, &mut piece)
            .await
            .unwrap();
        assert!(n > 0, "closed after {got:?}");
        got.extend_from_slice(&piece[..n]);
    }
    assert!(
        got.starts_with(b"GET /x HTTP/1.1\r\nhost: app\r\n"),
        "{got:?}"
    );
    app.write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
        .await
        .unwrap();
}

/// On a busy worker's runtime (one thread, which has not waited for events since its last
/// exchange), a request goes upstream only after the tasks that were ready with it have run:
/// task `b`, queued behind the exchange, looks at the app's socket before anything was
/// written to it (without the yield, the exchange writes in its first poll, before `b` runs,
/// and `b` sees the request).
#[test]
fn a_request_goes_upstream_after_the_tasks_ready_with_it() {
    // No unpark hook: this runtime never says it woke.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    WOKE.set(false);
    rt.block_on(async {
        let (app, raw) = app_and_raw().await;
        let a = tokio::spawn(exchanged(raw));
        let b = tokio::spawn(async move {
            let seen = first_byte(&app);
            (app, seen)
        });
        let (app, seen) = b.await.unwrap();
        assert_eq!(seen, Err(io::ErrorKind::WouldBlock));
        // Then the request is written whole, and the exchange ends with the response.
        answered(app).await;
        assert_eq!(a.await.unwrap(), Ok(StatusCode::NO_CONTENT));
    });
}

/// On a worker's runtime that waited for events (here a timer, with nothing else to run),
/// the first request it sends upstream after the wait goes at once, in its exchange's first
/// poll; the next one of the same turn only after the tasks ready with it: task `look`,
/// queued behind both exchanges, finds the first request at its app and not the second.
/// (Without the hook both would wait; without the yield both would be there.)
#[test]
fn after_a_wait_the_first_request_goes_upstream_at_once_and_the_turns_others_after_it() {
    let rt = crate::proxy::worker::worker_runtime().unwrap();
    rt.block_on(async {
        let (app1, raw1) = app_and_raw().await;
        let (app2, raw2) = app_and_raw().await;
        // Not a wait for readiness: with nothing else to run, the runtime parks until the
        // timer fires, and its unpark hook runs.
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        let a = tokio::spawn(exchanged(raw1));
        let b = tokio::spawn(exchanged(raw2));
        let look = tokio::spawn(async move {
            let first = first_byte_within(&app1, std::time::Duration::from_secs(10));
            let seen = (first, first_byte(&app2));
            (app1, app2, seen)
        });
        let (app1, app2, seen) = look.await.unwrap();
        assert_eq!(seen, (Ok(1), Err(io::ErrorKind::WouldBlock)));
        answered(app1).await;
        answered(app2).await;
        assert_eq!(a.await.unwrap(), Ok(StatusCode::NO_CONTENT));
        assert_eq!(b.await.unwrap(), Ok(StatusCode::NO_CONTENT));
    });
}

#[test]
fn an_upstream_heads_fields_are_read_unparsed_and_mapped_once_when_the_map_changes() {
    use crate::proxy::response::{Lines, Reply};
    let head = "HTTP/1.1 200 OK\r\nx-usage: 42\r\nconnection: keep-alive\r\nX-Usage: 7\r\ncontent-length: 0\r\n\r\n";
    let mut buf = BytesMut::from(head);
    let head = take_head(&mut buf).unwrap().expect("a whole head");
    let passed = Passed::of(&head, |f| !f.named.hop_by_hop()).unwrap();
    let body = Either::Right(RawBody {
        raw: None,
        framing: Framing::Done,
        home: None,
        since: 0,
    });
    let mut reply = Reply::upstream(Response::new(body), Some(passed), Default::default());
    // The first of its name, without case, without a map.
    let usage = http::HeaderName::from_static("x-usage");
    assert_eq!(reply.head.field(&usage), Some(&b"42"[..]));
    assert_eq!(
        reply.head.field(&http::header::CONNECTION),
        None,
        "the hop's stay behind"
    );
    let (map, lines) = reply.head.written();
    assert!(map.is_empty());
    assert!(matches!(lines, Some(Lines::Upstream(_))));
    // A field of Spillway's: the upstream's lines are in the map first, in their order.
    reply
        .head
        .headers_mut()
        .insert("x-ours", HeaderValue::from_static("1"));
    let (map, lines) = reply.head.written();
    assert!(lines.is_none());
    let usage: Vec<_> = map.get_all("x-usage").iter().collect();
    assert_eq!(usage, ["42", "7"]);
    assert_eq!(map["content-length"], "0");
    assert_eq!(map["x-ours"], "1");
}
