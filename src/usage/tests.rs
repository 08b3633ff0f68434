use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;

fn pointers(p: &[&str]) -> Pointers {
    Pointers::parse(p.iter().copied()).unwrap()
}

/// `doc` scanned for `p` fed in pieces of `piece` bytes: what was found, if it was read whole.
fn scan(p: &Pointers, doc: &[u8], piece: usize) -> Option<Vec<Found>> {
    let mut s = Json::new(p);
    for part in doc.chunks(piece.max(1)) {
        s.feed(p, part);
    }
    s.end();
    s.done().then(|| s.found()[..p.0.len()].to_vec())
}

/// What serde_json finds at `pointer` in `v`, as the scanner says it.
fn expected(v: &Value, pointer: &str) -> Found {
    match v.pointer(pointer) {
        None | Some(Value::Null) => Found::None,
        Some(Value::Number(n)) => n.as_u64().map_or(Found::Bad, Found::Number),
        Some(_) => Found::Bad,
    }
}

#[test]
fn the_two_common_shapes_are_read() {
    let openai = pointers(&["/usage/total_tokens"]);
    let body = br#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"usage: {\"total_tokens\": 9}"}}],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;
    for piece in [1, 2, 7, body.len()] {
        assert_eq!(scan(&openai, body, piece), Some(vec![Found::Number(42)]));
    }
    let several = pointers(&[
        "/usage/prompt_tokens",
        "/usage/completion_tokens",
        "/choices/0/index",
    ]);
    assert_eq!(
        scan(&several, body, 3),
        Some(vec![Found::Number(12), Found::Number(30), Found::Number(0)])
    );
}

#[test]
fn what_is_not_a_whole_count_is_bad_and_null_is_absent() {
    let p = pointers(&["/usage/total_tokens"]);
    for (doc, want) in [
        (json!({"usage": {"total_tokens": -5}}), Found::Bad),
        (json!({"usage": {"total_tokens": 1.5}}), Found::Bad),
        (json!({"usage": {"total_tokens": "12"}}), Found::Bad),
        (json!({"usage": {"total_tokens": {"n": 1}}}), Found::Bad),
        (json!({"usage": {"total_tokens": [1]}}), Found::Bad),
        (json!({"usage": {"total_tokens": true}}), Found::Bad),
        (json!({"usage": {"total_tokens": null}}), Found::None),
        (json!({"usage": null}), Found::None),
        (json!({"usage": {"total": 3}}), Found::None),
        (json!([{"usage": {"total_tokens": 3}}]), Found::None),
        (json!({"usage": {"total_tokens": 0}}), Found::Number(0)),
    ] {
        let text = doc.to_string();
        assert_eq!(scan(&p, text.as_bytes(), 1), Some(vec![want]), "{text}");
    }
    // Past u64 it saturates (the charge clamps it to the rule's max).
    let huge = br#"{"usage":{"total_tokens":123456789012345678901234567890}}"#;
    assert_eq!(scan(&p, huge, 5), Some(vec![Found::Number(u64::MAX)]));
}

#[test]
fn what_is_not_json_or_too_deep_is_not_read_whole() {
    let p = pointers(&["/usage/total_tokens"]);
    for doc in [
        &b"{\"usage\":{\"total_tokens\":12}"[..],
        b"{\"usage\" {\"total_tokens\":12}}",
        b"{\"usage\":{\"total_tokens\":12}}}",
        b"{\"usage\":{\"total_tokens\":12]}",
        b"[DONE]",
        b"<html>502</html>",
        b"",
        b"{\"a\":\"line\nbreak\"}",
    ] {
        assert_eq!(scan(&p, doc, 1), None, "{}", String::from_utf8_lossy(doc));
    }
    let deep = format!(
        "{}1{}",
        "[".repeat(MAX_DEPTH + 1),
        "]".repeat(MAX_DEPTH + 1)
    );
    assert_eq!(scan(&p, deep.as_bytes(), 64), None);
    let fits = format!("{}1{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
    assert_eq!(scan(&p, fits.as_bytes(), 64), Some(vec![Found::None]));
}

#[test]
fn pointers_are_rfc_6901_and_bounded() {
    let p = pointers(&["/a~1b/m~0n", "/x/01", "/x/1", "/"]);
    let doc = br#"{"a/b":{"m~n":7},"x":{"01":8,"1":9},"":10}"#;
    assert_eq!(
        scan(&p, doc, 4),
        Some(vec![
            Found::Number(7),
            Found::Number(8),
            Found::Number(9),
            Found::Number(10)
        ])
    );
    let arrays = pointers(&["/x/01", "/x/1"]);
    assert_eq!(
        scan(&arrays, br#"{"x":[5,6]}"#, 1),
        Some(vec![Found::None, Found::Number(6)]),
        "01 is a key, never an index"
    );
    for bad in ["usage", "/a~2", "/a~", ""] {
        assert!(Pointers::parse([bad]).is_err(), "{bad}");
    }
    assert!(Pointers::parse(["/a"; MAX_POINTERS + 1]).is_err());
    assert!(Pointers::parse(std::iter::empty()).is_err());
    let long = format!("/{}", "k".repeat(MAX_SEGMENT + 1));
    assert!(Pointers::parse([long.as_str()]).is_err());
}

#[test]
fn events_of_both_shapes_are_read_as_they_stream() {
    // OpenAI-compatible (vLLM with stream_options.include_usage): usage in the last chunk.
    let openai = pointers(&["/usage/total_tokens"]);
    let stream = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"!\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n",
        "data: [DONE]\n\n",
    );
    // Anthropic: input in message_start, output (cumulative) in message_delta.
    let anthropic = pointers(&["/message/usage/input_tokens", "/usage/output_tokens"]);
    let messages = concat!(
        "event: message_start\r\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\r\n\r\n",
        ": a comment\r\n\r\n",
        "event: content_block_delta\r\n",
        "data: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hello\"}}\r\n\r\n",
        "event: message_delta\r\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\r\n",
        "data: \"usage\":{\"output_tokens\":15}}\r\n\r\n",
        "event: message_stop\r\n",
        "data: {\"type\":\"message_stop\"}\r\n\r\n",
    );
    for piece in [1, 3, 17, 4096] {
        let mut e = Events::new(&openai);
        for part in stream.as_bytes().chunks(piece) {
            e.feed(&openai, part);
        }
        e.end(&openai);
        assert_eq!(e.found()[0], Found::Number(7), "in pieces of {piece}");
        let mut e = Events::new(&anthropic);
        for part in messages.as_bytes().chunks(piece) {
            e.feed(&anthropic, part);
        }
        e.end(&anthropic);
        assert_eq!(
            e.found()[..2],
            [Found::Number(25), Found::Number(15)],
            "in pieces of {piece}"
        );
    }
    // A stream cut before its usage event ends has found nothing.
    let cut = &stream[..stream.find("\"total_tokens\"").unwrap()];
    let mut e = Events::new(&openai);
    e.feed(&openai, cut.as_bytes());
    e.end(&openai);
    assert_eq!(e.found()[0], Found::None);
}

/// Small JSON values whose keys often fall on the pointers' steps.
fn values() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        "[a-z\"\\\\ /~{}\\[\\]:,]{0,6}".prop_map(Value::from),
    ];
    let key = prop_oneof![
        Just("usage".to_string()),
        Just("total_tokens".to_string()),
        Just("0".to_string()),
        Just("a/b".to_string()),
        "[a-z\"\\\\]{0,3}",
    ];
    leaf.prop_recursive(5, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

proptest! {
    /// Differential: what the scanner finds at each pointer is what serde_json's `pointer`
    /// finds, whatever the document and however its bytes are cut.
    #[test]
    fn the_scanner_finds_what_serde_json_finds(
        v in values(),
        pretty in any::<bool>(),
        piece in 1usize..40,
    ) {
        let text = if pretty { serde_json::to_string_pretty(&v) } else { serde_json::to_string(&v) }.unwrap();
        let list = ["/usage/total_tokens", "/usage", "/0/usage/total_tokens", "/a~1b/0", "/0"];
        let p = pointers(&list);
        let found = scan(&p, text.as_bytes(), piece);
        // Keys are compared as written; serde escapes only `"`, `\` and controls, which no
        // pointer's keys here hold, so that changes nothing.
        let want: Vec<Found> = list.iter().map(|ptr| expected(&v, ptr)).collect();
        prop_assert_eq!(found, Some(want), "{}", text);
    }
}

proptest! {
    /// Differential, for event streams: each event's data (pretty-printed JSON over several
    /// `data:` lines, or one) read as serde_json reads it, the last value found at each pointer
    /// standing, whatever the line endings and however the stream's bytes are cut.
    #[test]
    fn events_find_what_serde_json_finds_in_the_last_event_that_has_it(
        events in prop::collection::vec((values(), any::<bool>()), 1..5),
        crlf in any::<bool>(),
        piece in 1usize..64,
    ) {
        let list = ["/usage/total_tokens", "/usage", "/0"];
        let p = pointers(&list);
        let eol = if crlf { "\r\n" } else { "\n" };
        let mut stream = String::new();
        let mut want = vec![Found::None; list.len()];
        for (v, pretty) in &events {
            let text = if *pretty { serde_json::to_string_pretty(v) } else { serde_json::to_string(v) }.unwrap();
            stream.push_str(&format!("event: e{eol}"));
            for line in text.lines() {
                stream.push_str(&format!("data: {line}{eol}"));
            }
            stream.push_str(eol);
            for (w, ptr) in want.iter_mut().zip(list) {
                let found = expected(v, ptr);
                if found != Found::None {
                    *w = found;
                }
            }
        }
        let mut e = Events::new(&p);
        for part in stream.as_bytes().chunks(piece) {
            e.feed(&p, part);
        }
        e.end(&p);
        prop_assert_eq!(&e.found()[..list.len()], &want[..], "{}", stream);
    }
}
