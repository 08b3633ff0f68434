//! A real OpenAI-compatible client through the proxy: the official `openai` Python library
//! (installed by `scripts/test` into a venv it names in `SPILLWAY_OPENAI_PYTHON`) streams chat
//! completions from the demo's fake app until its API key's token budget is spent, and then
//! gets the proxy's 429 as a `RateLimitError`.

mod common;

use common::config;
use spillway::Sidecar;

#[tokio::test]
async fn the_openai_library_streams_until_its_keys_token_budget_is_spent() {
    let python = std::env::var("SPILLWAY_OPENAI_PYTHON").expect(
        "SPILLWAY_OPENAI_PYTHON: a Python with the openai package (scripts/test installs it in target/openai-venv)",
    );
    let app = spillway::internal::demo::tokens::start_llm().await.unwrap();
    // 2 000 tokens an hour per API key: it does not refill in the test's time.
    let sc = Sidecar::start(config(
        app,
        "rules:\n  - name: tokens\n    key: header:authorization\n    limit: { rate: 2000/h, burst: 2000 }\n    cost: { response: json, reserve: 0, max: 4000 }\n",
    ))
    .await
    .unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai/client.py");
    let base = format!("http://{}/v1", sc.addr());
    // On a thread of its own: the proxy serves on this test's runtime meanwhile.
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&python)
            .args([script, base.as_str(), "sk-test-key", "50"])
            .output()
    })
    .await
    .unwrap()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let calls = seen["calls"].as_array().unwrap();
    assert!(!calls.is_empty(), "{seen}");
    for call in calls {
        assert_eq!(call["text"], "Hello from the demo app.", "{seen}");
    }
    let tokens: Vec<u64> = calls
        .iter()
        .map(|c| {
            c["total_tokens"]
                .as_u64()
                .expect("every stream ends with its usage")
        })
        .collect();
    let used: u64 = tokens.iter().sum();
    // Admitted while not in debt: refused only once the calls' usage passed the budget, and
    // not before (the last call admitted found some budget left).
    assert!(
        used > 2000,
        "refused with {used} of 2 000 tokens used: {seen}"
    );
    assert!(used - tokens.last().unwrap() <= 2000, "{seen}");
    let refused = &seen["refused"];
    assert_eq!(refused["status"], 429, "{seen}");
    let retry: u64 = refused["retry_after"].as_str().unwrap().parse().unwrap();
    // The debt (used - 2 000) refills at 2 000 an hour: 1.8 s a token.
    let owed = used - 2000;
    assert!(
        retry >= owed * 1800 / 1000 && retry <= owed * 1800 / 1000 + 2,
        "Retry-After {retry} for {owed} tokens owed: {seen}"
    );
    assert!(
        refused["policy"].as_str().unwrap().contains("q=2000"),
        "{seen}"
    );
}
