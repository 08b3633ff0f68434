//! What reading a response body for its usage costs per KiB (`cost: { response: json }`): the
//! scanner of `src/usage.rs` over a JSON completion and over an event stream, fed in 1 KiB
//! pieces as a body arrives. Figures and the command in BENCHMARKS.md.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use spillway::internal::usage::{Events, Json, Pointers};

/// A chat completion of about `kib` KiB: its text, then its usage.
fn completion(kib: usize) -> Vec<u8> {
    let text = "All work and no play makes Jack a dull boy. ".repeat(kib * 1024 / 44);
    format!(
        r#"{{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"m","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":12,"completion_tokens":900,"total_tokens":912}}}}"#
    )
    .into_bytes()
}

/// An OpenAI-compatible stream of about `kib` KiB: one chunk per word, then the usage chunk.
fn stream(kib: usize) -> Vec<u8> {
    let chunk = r#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":" word"},"finish_reason":null}],"usage":null}"#;
    let mut out = String::new();
    while out.len() < kib * 1024 {
        out.push_str(chunk);
        out.push_str("\n\n");
    }
    out.push_str(r#"data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":900,"total_tokens":912}}"#);
    out.push_str("\n\ndata: [DONE]\n\n");
    out.into_bytes()
}

fn bench(c: &mut Criterion) {
    let pointers = Pointers::parse(["/usage/total_tokens"]).unwrap();
    let mut g = c.benchmark_group("usage_scan");
    let body = completion(16);
    g.throughput(Throughput::Bytes(body.len() as u64));
    g.bench_function("json_completion_16KiB", |b| {
        b.iter(|| {
            let mut s = Json::new(&pointers);
            for piece in body.chunks(1024) {
                s.feed(&pointers, black_box(piece));
            }
            s.end();
            black_box(s.found()[0])
        })
    });
    let events = stream(16);
    g.throughput(Throughput::Bytes(events.len() as u64));
    g.bench_function("event_stream_16KiB", |b| {
        b.iter(|| {
            let mut s = Events::new(&pointers);
            for piece in events.chunks(1024) {
                s.feed(&pointers, black_box(piece));
            }
            s.end(&pointers);
            black_box(s.found()[0])
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
