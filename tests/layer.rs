//! The embeddable tower layer runs the sidecar's decision and answers: for the same rules, the
//! same statuses, `Retry-After`, `RateLimit` headers and problem documents; and it refuses the
//! rules it cannot enforce instead of letting their traffic through.

mod common;

use std::convert::Infallible;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use tower::{Layer, ServiceExt};

const RULES: &str = "headers: always
rules:
  - name: per-key
    key: [header:x-api-key]
    limit: { rate: 2/h }
  - name: costly
    match: { path_prefix: /big }
    key: []
    limit: { rate: 1/h, burst: 3 }
    cost: 2
";

/// What a client can tell about an answer: the status, the limiting headers, the problem
/// document's rule and status (its detail names the retry hint, which may differ by a second).
fn seen(status: u16, headers: &http::HeaderMap, body: &[u8]) -> String {
    let h = |name: &str| {
        headers
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    };
    let doc: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    format!(
        "{status} policy={} limit={} retry={} type={} rule={} doc_status={}",
        h("ratelimit-policy"),
        h("ratelimit"),
        !h("retry-after").is_empty(),
        h("content-type"),
        doc["rule"],
        doc["status"]
    )
}

#[tokio::test]
async fn the_layer_answers_as_the_sidecar_does_for_the_same_rules() {
    let layer = spillway::RateLimitLayer::from_yaml(RULES, "layer").unwrap();
    let app = tower::service_fn(|_req: http::Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
    });
    let svc = layer.layer(app);
    let (sc, _up, _clock) = sidecar_with_clock(RULES).await;
    let asks: [(&str, &[(&str, &str)]); 6] = [
        ("/", &[("x-api-key", "k")]),
        ("/", &[("x-api-key", "k")]),
        ("/", &[("x-api-key", "k")]),
        ("/big", &[]),
        ("/big", &[]),
        ("/", &[("x-api-key", "other")]),
    ];
    let mut statuses = Vec::new();
    for (path, headers) in asks {
        let mut req = http::Request::get(format!("http://app{path}"));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = svc
            .clone()
            .oneshot(req.body(Full::new(Bytes::new())).unwrap())
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let head = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        statuses.push(status);
        let from_layer = seen(status, &head, &body);
        let (status, head, body) = get(sc.addr(), path, headers).await;
        let from_sidecar = seen(status.as_u16(), &head, body.as_bytes());
        assert_eq!(from_layer, from_sidecar, "{path} {headers:?}");
    }
    assert_eq!(statuses, [200, 200, 429, 200, 429, 200]);
    sc.shutdown();
    sc.wait().await;
}

#[test]
fn rules_the_layer_cannot_enforce_are_refused_with_why() {
    for (scope, why) in [
        ("global", "scope: global needs the sidecar's control plane"),
        ("redis", "scope: redis needs the sidecar's redis section"),
    ] {
        let yaml = format!(
            "rules:\n  - name: fleet\n    key: [client_ip]\n    limit: {{ rate: 10/s }}\n    scope: {scope}\n"
        );
        match spillway::RateLimitLayer::from_yaml(&yaml, "layer") {
            Ok(_) => panic!("scope: {scope} was accepted and would never limit"),
            Err(e) => assert!(e.to_string().contains(why), "{e}"),
        }
    }
}
