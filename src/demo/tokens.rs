//! `spillway demo --tokens`: token budgets charged after the response, on loopback.
//!
//! A fake OpenAI-compatible app ([`start_llm`]) answers `POST /v1/chat/completions`: streamed
//! as server-sent events (`"stream": true`), ending with a usage chunk and `[DONE]`, or as one
//! JSON document, each call using 100 to 900 tokens. The proxy in front of it gives each API key
//! a budget in tokens by its plan; clients of two plans call it without pause, and a table once
//! a second shows the tokens the app said each plan's calls used, beside their budgets.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

use crate::{Config, Sidecar};

/// (client's API key, plan, streams it keeps going at once).
const CLIENTS: [(&str, &str, usize); 3] = [
    ("sk-alice", "free", 4),
    ("sk-bob", "free", 4),
    ("sk-carol", "pro", 4),
];
/// Tokens a second (and at most at once) per API key, by plan.
const FREE: u64 = 1_000;
const PRO: u64 = 4_000;

fn config(upstream: std::net::SocketAddr) -> String {
    format!(
        r#"
service: demo-tokens
listen: 127.0.0.1:0
upstream: http://{upstream}
admin: 127.0.0.1:0
limits: {{ max_connections: 100 }}
rules:
  - name: free-plan
    match: {{ path_prefix: /v1/, headers: {{ x-plan: free }} }}
    key: header:authorization
    limit: {{ rate: {FREE}/s, burst: {FREE} }}
    cost: {{ response: json, reserve: 100, max: 4000 }}
    log_keys: clear     # the demo's own keys; keep the digest (and a key_secret_file) for real ones
  - name: pro-plan
    match: {{ path_prefix: /v1/, headers: {{ x-plan: pro }} }}
    key: header:authorization
    limit: {{ rate: {PRO}/s, burst: {PRO} }}
    cost: {{ response: json, reserve: 100, max: 4000 }}
    log_keys: clear
"#
    )
}

/// What one client saw in a second.
#[derive(Default)]
struct Seen {
    calls: AtomicU64,
    refused: AtomicU64,
    tokens: AtomicU64,
}

/// Runs the demo for `duration`, printing a table once a second.
pub async fn run(duration: Duration) -> anyhow::Result<()> {
    let app = start_llm().await?;
    let config =
        Config::from_yaml(&config(app), "<demo --tokens>").context("the demo's own config")?;
    let sidecar = Sidecar::start(config).await?;
    let proxy = sidecar.addr();
    println!(
        "Spillway demo --tokens: a fake OpenAI-compatible app on {app}, the sidecar on {proxy}"
    );
    println!(
        "(metrics on http://{}/metrics: spillway_response_units_total)",
        sidecar.admin_addr()
    );
    println!(
        "Budgets per API key: free {FREE} tokens/s, pro {PRO} tokens/s, charged what each \
         streamed answer's last chunk says it used (100 to 900 tokens a call).\n\
         alice and bob (free) and carol (pro) each keep 4 streams going for {} s.\n",
        duration.as_secs()
    );
    println!(" second |   alice (free)   |    bob (free)    |   carol (pro)");
    println!("        | tokens calls 429 | tokens calls 429 | tokens calls 429");
    println!("--------+------------------+------------------+-----------------");
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let deadline = tokio::time::Instant::now() + duration;
    let mut seen = Vec::new();
    let mut callers = tokio::task::JoinSet::new();
    for (key, plan, streams) in CLIENTS {
        let s = Arc::new(Seen::default());
        seen.push(s.clone());
        for _ in 0..streams {
            let (client, s) = (client.clone(), s.clone());
            callers.spawn(async move {
                while tokio::time::Instant::now() < deadline {
                    call(&client, proxy, key, plan, &s).await;
                }
            });
        }
    }
    let mut totals = vec![0u64; seen.len()];
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    for second in 1..=duration.as_secs() {
        tick.tick().await;
        let mut row = format!(" {second:>6} |");
        for (i, s) in seen.iter().enumerate() {
            let tokens = s.tokens.swap(0, Ordering::Relaxed);
            let calls = s.calls.swap(0, Ordering::Relaxed);
            let refused = s.refused.swap(0, Ordering::Relaxed);
            totals[i] += tokens;
            row.push_str(&format!(" {tokens:>6} {calls:>5} {refused:>3} |"));
        }
        row.pop();
        println!("{row}");
    }
    while callers.join_next().await.is_some() {}
    let secs = duration.as_secs().max(1);
    println!();
    for ((key, plan, streams), total) in CLIENTS.iter().zip(&totals) {
        let budget = if *plan == "pro" { PRO } else { FREE };
        println!(
            "{key} ({plan}): {total} tokens in {secs} s ({} a second) against {budget} a second: \
             at most {} (the budget, its burst, and what its {streams} calls in flight may use past it)",
            total / secs,
            budget * (secs + 1) + *streams as u64 * 900,
        );
    }
    sidecar.shutdown();
    sidecar.wait().await;
    Ok(())
}

/// One streamed chat completion through the proxy: counted as a call and its usage as the
/// client read it, or as a 429 (then a short pause, as a client honouring `Retry-After` with
/// jitter would take at least).
async fn call(
    client: &Client<HttpConnector, Full<Bytes>>,
    proxy: std::net::SocketAddr,
    key: &str,
    plan: &str,
    seen: &Seen,
) {
    let req = Request::post(format!("http://{proxy}/v1/chat/completions"))
        .header("authorization", format!("Bearer {key}"))
        .header("x-plan", plan)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"demo","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Hi"}]}"#,
        )))
        .expect("a valid request");
    let Ok(resp) = client.request(req).await else {
        return;
    };
    let status = resp.status();
    let Ok(body) = resp.into_body().collect().await.map(|b| b.to_bytes()) else {
        return;
    };
    if status == 429 {
        seen.refused.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(50)).await;
        return;
    }
    seen.calls.fetch_add(1, Ordering::Relaxed);
    seen.tokens
        .fetch_add(total_tokens(&body), Ordering::Relaxed);
}

/// The last `"total_tokens":N` in `body`.
pub fn total_tokens(body: &[u8]) -> u64 {
    let needle = b"\"total_tokens\":";
    let Some(at) = body.windows(needle.len()).rposition(|w| w == needle) else {
        return 0;
    };
    body[at + needle.len()..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .fold(0, |n, d| n * 10 + u64::from(d - b'0'))
}

/// The fake app: see the module's documentation. Its answers stream a chunk every 5 ms.
pub async fn start_llm() -> anyhow::Result<std::net::SocketAddr> {
    super::serve_app(service_fn(answer)).await
}

type AppBody = http_body_util::Either<Full<Bytes>, Chunks>;

async fn answer(req: Request<Incoming>) -> Result<Response<AppBody>, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    if path != "/v1/chat/completions" {
        let mut resp = Response::new(http_body_util::Either::Left(Full::new(Bytes::from_static(
            br#"{"error":{"message":"not found","type":"invalid_request_error"}}"#,
        ))));
        *resp.status_mut() = http::StatusCode::NOT_FOUND;
        return Ok(resp);
    }
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let model = request["model"].as_str().unwrap_or("demo").to_string();
    let prompt = 20 + fastrand::u64(..80);
    // 100 to 899 tokens a call in all.
    let completion = 80 + fastrand::u64(..720);
    let usage = serde_json::json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    });
    let created = 1_700_000_000u64;
    if request["stream"].as_bool() != Some(true) {
        let doc = serde_json::json!({
            "id": "chatcmpl-demo",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "message": { "role": "assistant", "content": "Hello from the demo app." },
                "finish_reason": "stop",
            }],
            "usage": usage,
        });
        let mut resp = Response::new(http_body_util::Either::Left(Full::new(Bytes::from(
            doc.to_string(),
        ))));
        resp.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("application/json"),
        );
        return Ok(resp);
    }
    let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
        let c = serde_json::json!({
            "id": "chatcmpl-demo",
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
            "usage": null,
        });
        Bytes::from(format!("data: {c}\n\n"))
    };
    let mut events = vec![chunk(
        serde_json::json!({ "role": "assistant", "content": "" }),
        serde_json::Value::Null,
    )];
    for word in ["Hello", " from", " the", " demo", " app."] {
        events.push(chunk(
            serde_json::json!({ "content": word }),
            serde_json::Value::Null,
        ));
    }
    events.push(chunk(serde_json::json!({}), serde_json::json!("stop")));
    let last = serde_json::json!({
        "id": "chatcmpl-demo",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    });
    events.push(Bytes::from(format!("data: {last}\n\n")));
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let mut resp = Response::new(http_body_util::Either::Right(Chunks::new(
        events,
        Duration::from_millis(5),
    )));
    resp.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("text/event-stream"),
    );
    Ok(resp)
}

/// A body of chunks, one every `every` (a model producing tokens).
pub struct Chunks {
    chunks: std::collections::VecDeque<Bytes>,
    every: Duration,
    timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl Chunks {
    fn new(chunks: Vec<Bytes>, every: Duration) -> Self {
        Chunks {
            chunks: chunks.into(),
            every,
            timer: None,
        }
    }
}

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.chunks.is_empty() {
            return std::task::Poll::Ready(None);
        }
        let every = self.every;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(every)));
        if std::future::Future::poll(timer.as_mut(), cx).is_pending() {
            return std::task::Poll::Pending;
        }
        self.timer = None;
        std::task::Poll::Ready(self.chunks.pop_front().map(|c| Ok(Frame::data(c))))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
    }
}
