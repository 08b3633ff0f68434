//! Usage charged after the response, through the real proxy: the app's response says what a
//! call consumed (a header, a trailer, its body's bytes), the key owes it, and its next
//! requests are refused until the debt has refilled; responses cut short still pay.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::BodyExt;
use spillway::internal::limit::{AnyClock, ManualClock};
use spillway::Sidecar;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};

use super::common::*;

const A: [(&str, &str); 1] = [("x-api-key", "a")];
const B: [(&str, &str); 1] = [("x-api-key", "b")];

/// One rule, `tokens`: 100 units a second, 1 000 at most, per `x-api-key`, costing `cost`.
fn budget(cost: &str) -> String {
    format!(
        "rules:\n  - name: tokens\n    key: header:x-api-key\n    limit: {{ rate: 100/s, burst: 1000 }}\n    cost: {cost}\n"
    )
}

/// The sidecar in front of `upstream` with `rest`, its limiters on a manual clock.
async fn proxy(upstream: std::net::SocketAddr, rest: &str) -> (Sidecar, ManualClock) {
    let clock = ManualClock::new(1_000_000_000);
    let sc = Sidecar::start_with_clock(config(upstream, rest), AnyClock::Manual(clock.clone()))
        .await
        .unwrap();
    (sc, clock)
}

async fn units(sc: &Sidecar, rule: &str, kind: &str) -> Option<f64> {
    let (_, text) = admin(sc, "/metrics").await;
    metric(
        &text,
        &format!("spillway_response_units_total{{kind=\"{kind}\",rule=\"{rule}\"}}"),
    )
}

async fn unread(sc: &Sidecar, rule: &str, reason: &str) -> Option<f64> {
    let (_, text) = admin(sc, "/metrics").await;
    metric(
        &text,
        &format!("spillway_response_usage_unread_total{{reason=\"{reason}\",rule=\"{rule}\"}}"),
    )
}

/// Polls the metrics until `rule`'s `kind` units reach `value` (bounded: 5 s): a charge
/// settled on another task (a body dropped when its client went away).
async fn until_units(sc: &Sidecar, rule: &str, kind: &str, value: f64) {
    for _ in 0..500 {
        if units(sc, rule, kind).await == Some(value) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{rule} {kind} units never reached {value}: {:?}",
        units(sc, rule, kind).await
    );
}

#[tokio::test]
async fn usage_in_a_response_header_is_owed_and_refuses_the_key_until_it_has_refilled() {
    let up =
        answering("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nx-usage-tokens: 1500\r\n\r\nok").await;
    let (sc, clock) = proxy(
        up,
        &budget("{ response: { header: x-usage-tokens }, max: 100000 }"),
    )
    .await;
    let (status, headers, body) = get(sc.addr(), "/v1/chat/completions", &A).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    assert_eq!(headers["x-usage-tokens"], "1500", "the app's field goes on");
    // 1 500 used of 1 000: 500 owed, and the next call's reservation (1), at 100 a second.
    let (status, headers, _) = get(sc.addr(), "/v1/chat/completions", &A).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "6");
    let policy = headers["ratelimit-policy"].to_str().unwrap();
    assert!(policy.contains("q=1000"), "the budget in units: {policy}");
    // Another key's budget is its own, over HTTP/2 as well.
    let (status, ..) = send(&h2_client(), sc.addr(), "GET", "/v1/chat/completions", &B).await;
    assert_eq!(status, StatusCode::OK);
    let (status, ..) = send(&h2_client(), sc.addr(), "GET", "/v1/chat/completions", &B).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "charged over HTTP/2");
    clock.advance(Duration::from_millis(5_009));
    assert_eq!(
        get(sc.addr(), "/", &A).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    clock.advance(Duration::from_millis(1));
    assert_eq!(get(sc.addr(), "/", &A).await.0, StatusCode::OK, "repaid");
    assert_eq!(units(&sc, "tokens", "charged").await, Some(4500.0));
    assert_eq!(units(&sc, "tokens", "reserved").await, Some(3.0));
}

#[tokio::test]
async fn an_apps_absurd_or_negative_usage_is_clamped_or_charged_unknown_and_counted() {
    let up = answering(
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nx-usage-tokens: 184467440737095516150\r\n\r\nok",
    )
    .await;
    let (sc, _) = proxy(
        up,
        &budget("{ response: { header: x-usage-tokens }, reserve: 0, max: 2000 }"),
    )
    .await;
    assert_eq!(get(sc.addr(), "/", &A).await.0, StatusCode::OK);
    assert_eq!(units(&sc, "tokens", "charged").await, Some(2000.0));
    assert_eq!(unread(&sc, "tokens", "clamped").await, Some(1.0));
    let (status, headers, _) = get(sc.addr(), "/", &A).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "10", "1 000 owed at 100 a second");

    let up =
        answering("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nx-usage-tokens: -5\r\n\r\nok").await;
    let (sc, _) = proxy(
        up,
        &budget("{ response: { header: x-usage-tokens }, reserve: 0, max: 2000, unknown: 1200 }"),
    )
    .await;
    assert_eq!(get(sc.addr(), "/", &A).await.0, StatusCode::OK);
    assert_eq!(unread(&sc, "tokens", "malformed").await, Some(1.0));
    assert_eq!(units(&sc, "tokens", "charged").await, Some(1200.0));
    assert_eq!(
        get(sc.addr(), "/", &A).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn usage_in_a_chunked_bodys_trailer_is_charged_when_the_body_ends() {
    let up = answering(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x-usage\r\n\r\n5\r\nhello\r\n0\r\nx-usage: 2000\r\n\r\n",
    )
    .await;
    let (sc, _) = proxy(
        up,
        &budget("{ response: { trailer: x-usage }, max: 100000 }"),
    )
    .await;
    let (status, _, body) = get(sc.addr(), "/", &A).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "hello"));
    assert_eq!(units(&sc, "tokens", "charged").await, Some(2000.0));
    let (status, headers, _) = get(sc.addr(), "/", &A).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "11", "1 000 owed and one reserved");
}

/// A body of the frames given, last first.
struct Frames(Vec<hyper::body::Frame<Bytes>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.pop().map(Ok))
    }
}

/// An HTTP/2 (h2c) app whose every response ends with the trailer `x-usage: 2500`.
async fn h2_app_with_trailers() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|_req| async {
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("x-usage", "2500".parse().unwrap());
                    let body = Frames(vec![
                        hyper::body::Frame::trailers(trailers),
                        hyper::body::Frame::data(Bytes::from_static(b"streamed")),
                    ]);
                    Ok::<_, std::convert::Infallible>(http::Response::new(body))
                });
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn usage_in_an_http2_apps_trailer_is_charged() {
    let app = h2_app_with_trailers().await;
    let clock = ManualClock::new(1_000_000_000);
    let yaml = format!(
        "service: test\nlisten: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: h2c://{app}\n{}",
        budget("{ response: { trailer: x-usage }, max: 100000 }")
    );
    let config = spillway::Config::from_yaml(&yaml, "test.yaml").unwrap();
    let sc = Sidecar::start_with_clock(config, AnyClock::Manual(clock))
        .await
        .unwrap();
    let (status, _, body) = send(&h2_client(), sc.addr(), "POST", "/grpc.Svc/Call", &A).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "streamed"));
    assert_eq!(units(&sc, "tokens", "charged").await, Some(2500.0));
    let (status, headers, _) = send(&h2_client(), sc.addr(), "POST", "/grpc.Svc/Call", &A).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "16", "1 500 owed and one reserved");
}

#[tokio::test]
async fn a_byte_budget_is_charged_the_bytes_delivered() {
    const BODY: &str = concat!(
        "HTTP/1.1 200 OK\r\nContent-Length: 3000\r\n\r\n",
        include_str!("usage.rs")
    );
    // The body is this file's first 3 000 bytes (Content-Length cuts the rest).
    let up = answering(BODY).await;
    let (sc, _) = proxy(
        up,
        "rules:\n  - name: bytes\n    key: header:x-api-key\n    limit: { rate: 1000/s, burst: 1000 }\n    cost: { response: body_bytes, reserve: 0, max: 100000000 }\n",
    )
    .await;
    let (status, _, body) = get(sc.addr(), "/download", &A).await;
    assert_eq!((status, body.len()), (StatusCode::OK, 3000));
    assert_eq!(units(&sc, "bytes", "charged").await, Some(3000.0));
    let (status, headers, _) = get(sc.addr(), "/download", &A).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        headers["retry-after"], "2",
        "2 000 bytes owed at 1 000 a second"
    );
}

/// A raw app that streams an event every 20 ms, for as long as its client reads.
async fn streaming() -> std::net::SocketAddr {
    raw_server(|s| async move {
        let mut s = BufReader::new(s);
        // Whether or not a whole head came: the answer goes out.
        let _ = read_head(&mut s).await;
        let s = s.get_mut();
        let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
        if s.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        loop {
            let event = "data: {\"delta\":\"token\"}\n\n";
            let chunk = format!("{:x}\r\n{event}\r\n", event.len());
            if s.write_all(chunk.as_bytes()).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_is_charged_unknown_and_the_bytes_it_was_sent() {
    let app = streaming().await;
    let (sc, _) = proxy(
        app,
        "rules:\n  - name: tokens\n    key: header:x-api-key\n    limit: { rate: 100/s, burst: 1000 }\n    cost: { response: { trailer: x-usage }, reserve: 0, max: 100000, unknown: 4000 }\n  - name: bytes\n    key: header:x-api-key\n    limit: { rate: 1000000/s, burst: 1000000 }\n    cost: { response: body_bytes, reserve: 0, max: 100000000 }\n",
    )
    .await;
    let mut c = BufReader::new(tokio::net::TcpStream::connect(sc.addr()).await.unwrap());
    c.get_mut()
        .write_all(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nx-api-key: a\r\n\r\n")
        .await
        .unwrap();
    // Three events in, the client goes.
    let mut seen = Vec::new();
    while seen.windows(5).filter(|w| w == b"token").count() < 3 {
        let mut buf = [0u8; 512];
        let n = c.read(&mut buf).await.unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    drop(c);
    until_units(&sc, "tokens", "charged", 4000.0).await;
    assert_eq!(unread(&sc, "tokens", "cut_short").await, Some(1.0));
    let bytes = units(&sc, "bytes", "charged").await.unwrap();
    assert!(
        bytes >= 3.0 * 24.0,
        "at least the three events read: {bytes}"
    );
    // 4 000 owed of 1 000: refused for 30 s.
    let (status, headers, _) = get(sc.addr(), "/v1/stream", &A).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "30");
}

#[tokio::test]
async fn an_app_that_breaks_off_its_body_or_never_answers_is_charged_unknown() {
    // Two bytes of five, then the connection closes.
    let up = raw_server(|s| async move {
        let mut s = BufReader::new(s);
        // Whether or not a whole head came: the answer goes out.
        let _ = read_head(&mut s).await;
        let _ = s
            .get_mut()
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhe")
            .await;
    })
    .await;
    let rule = budget("{ response: { header: x-usage }, reserve: 0, max: 100000, unknown: 700 }");
    let (sc, _) = proxy(up, &rule).await;
    let resp = client()
        .request(
            http::Request::get(format!("http://{}/", sc.addr()))
                .header("x-api-key", "a")
                .body(empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.into_body().collect().await.is_err(), "cut short");
    // The head said nothing: charged at the head, as missing.
    until_units(&sc, "tokens", "charged", 700.0).await;
    assert_eq!(unread(&sc, "tokens", "missing").await, Some(1.0));

    // No app at all: 502, and the call still pays what an unread one does.
    let gone = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = gone.local_addr().unwrap();
    drop(gone);
    let (sc, _) = proxy(addr, &rule).await;
    assert_eq!(get(sc.addr(), "/", &A).await.0, StatusCode::BAD_GATEWAY);
    until_units(&sc, "tokens", "charged", 700.0).await;
    assert_eq!(unread(&sc, "tokens", "cut_short").await, Some(1.0));
}

/// A raw HTTP/1 app that answers each request with `head` and then `body` in writes of
/// `piece` bytes (flushed one by one: they reach the proxy in pieces), closing after it if
/// `head` says so, and sending the request heads it read to `heads`.
async fn in_pieces(
    head: &'static str,
    body: &'static str,
    piece: usize,
) -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let addr = raw_server(move |s| {
        let tx = tx.clone();
        async move {
            let mut s = BufReader::new(s);
            while let Some(request) = read_head(&mut s).await {
                let _ = tx.send(request);
                let w = s.get_mut();
                if w.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                for part in body.as_bytes().chunks(piece) {
                    if w.write_all(part).await.is_err() || w.flush().await.is_err() {
                        return;
                    }
                    tokio::task::yield_now().await;
                }
                // A body without a length ends with the connection.
                if head.contains("Connection: close") {
                    return;
                }
            }
        }
    })
    .await;
    (addr, rx)
}

const COMPLETION: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Two plus two is four."},"finish_reason":"stop"}],"usage":{"prompt_tokens":1100,"completion_tokens":400,"total_tokens":1500}}"#;

#[tokio::test]
async fn a_json_bodys_usage_is_read_as_it_passes_and_the_app_is_asked_for_no_compression() {
    let head: &'static str = Box::leak(
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            COMPLETION.len()
        )
        .into_boxed_str(),
    );
    let (app, mut heads) = in_pieces(head, COMPLETION, 7).await;
    let (sc, _) = proxy(app, &budget("{ response: json, reserve: 0, max: 100000 }")).await;
    let (status, _, body) = send(
        &client(),
        sc.addr(),
        "GET",
        "/v1/chat/completions",
        &[("x-api-key", "a"), ("accept-encoding", "gzip, br")],
    )
    .await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, COMPLETION),
        "passed on whole"
    );
    let request = heads.recv().await.unwrap().to_ascii_lowercase();
    assert!(
        request.contains("accept-encoding: identity\r\n"),
        "{request}"
    );
    assert!(!request.contains("gzip"), "{request}");
    assert_eq!(units(&sc, "tokens", "charged").await, Some(1500.0));
    let (status, headers, _) = get(sc.addr(), "/v1/chat/completions", &A).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "5", "500 owed at 100 a second");
}

const OPENAI_STREAM: &str = concat!(
    "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Two\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" plus two\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":900,\"completion_tokens\":300,\"total_tokens\":1200}}\n\n",
    "data: [DONE]\n\n",
);

const ANTHROPIC_STREAM: &str = concat!(
    "event: message_start\n",
    "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":700,\"output_tokens\":1}}}\n\n",
    "event: content_block_delta\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Four.\"}}\n\n",
    "event: message_delta\n",
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":600}}\n\n",
    "event: message_stop\n",
    "data: {\"type\":\"message_stop\"}\n\n",
);

const STREAM_HEAD: &str =
    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n";

#[tokio::test]
async fn an_event_streams_usage_is_read_in_both_common_shapes() {
    for (json, stream, want) in [
        ("json", OPENAI_STREAM, 1200.0),
        ("{ json: anthropic }", ANTHROPIC_STREAM, 1300.0),
    ] {
        let (app, _) = in_pieces(STREAM_HEAD, stream, 5).await;
        let (sc, _) = proxy(
            app,
            &budget(&format!("{{ response: {json}, reserve: 0, max: 100000 }}")),
        )
        .await;
        let (status, _, body) = get(sc.addr(), "/v1/messages", &A).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, stream), "{json}");
        assert_eq!(units(&sc, "tokens", "charged").await, Some(want), "{json}");
        assert_eq!(
            get(sc.addr(), "/v1/messages", &A).await.0,
            StatusCode::TOO_MANY_REQUESTS,
            "{json}"
        );
    }
}

#[tokio::test]
async fn a_compressed_body_is_charged_unknown_and_counted() {
    let (app, _) = in_pieces(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\n",
        "\x1f\x08\x00\x00",
        4,
    )
    .await;
    let (sc, _) = proxy(
        app,
        &budget("{ response: json, reserve: 0, max: 100000, unknown: 2500 }"),
    )
    .await;
    assert_eq!(get(sc.addr(), "/", &A).await.0, StatusCode::OK);
    assert_eq!(unread(&sc, "tokens", "encoded").await, Some(1.0));
    assert_eq!(units(&sc, "tokens", "charged").await, Some(2500.0));
}
