//! The embeddable tower layer runs the sidecar's decision and answers: for the same rules, the
//! same statuses, `Retry-After`, `RateLimit` headers and problem documents, global rules (with
//! a real controller) included; and it refuses the rules it cannot enforce instead of letting
//! their traffic through.

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
    // What the sidecar refuses before any rule, the layer refuses too: a method in lower case.
    let req = http::Request::builder()
        .method("get")
        .uri("http://app/")
        .header("x-api-key", "third")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = svc.clone().oneshot(req).await.unwrap();
    let (status, head) = (resp.status().as_u16(), resp.headers().clone());
    // One refusal value renders it for both: the connection closes after it, as it does
    // after the sidecar's.
    assert_eq!(
        head.get("connection").map(|v| v.as_bytes()),
        Some(&b"close"[..])
    );
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let from_layer = seen(status, &head, &body);
    let (status, head, body) =
        send(&client(), sc.addr(), "get", "/", &[("x-api-key", "third")]).await;
    assert_eq!(status, 400);
    assert_eq!(from_layer, seen(400, &head, body.as_bytes()));
    sc.shutdown();
    sc.wait().await;
}

#[test]
fn rules_the_layer_cannot_enforce_are_refused_with_why() {
    for (scope, why) in [
        (
            "global",
            "scope: global needs a control_plane section with the aggregator's url",
        ),
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
    // A control plane needs the service the fleet counts under, and a runtime to report from.
    let cp = "control_plane: { url: \"http://127.0.0.1:1\" }\nrules: []\n";
    let e = spillway::RateLimitLayer::from_yaml(cp, "layer")
        .err()
        .unwrap();
    assert!(e.to_string().contains("needs service"), "{e}");
    let e = spillway::RateLimitLayer::from_yaml(&format!("service: s\n{cp}"), "layer")
        .err()
        .unwrap();
    assert!(e.to_string().contains("tokio runtime"), "{e}");
}

/// A global rule in the layer is the fleet's, as in a sidecar: the layer reports its counts
/// to the control plane, which sums them with the sidecar's of the same service, and both
/// refuse by the ratio it sends back, with the same answer.
#[tokio::test]
async fn a_global_rule_limits_the_layer_and_the_sidecar_together() {
    let ctl = controller_in_process().await;
    let rules = global_rule(ctl.addr);
    let layer =
        spillway::RateLimitLayer::from_yaml(&format!("service: test\n{rules}"), "layer").unwrap();
    let app = tower::service_fn(|_req: http::Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
    });
    let svc = layer.layer(app);
    let (sc, _up) = sidecar(&rules).await;
    let k = [("x-api-key", "k")];
    // Offered through the layer alone at about 500/s, far over 5/s, until the controller's
    // ratio arrives and a request is dropped (bounded: 10 s of it).
    let mut from_layer = None;
    let mut pace = tokio::time::interval(std::time::Duration::from_millis(2));
    for _ in 0..5000 {
        pace.tick().await;
        let req = http::Request::get("http://app/")
            .header("x-api-key", "k")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = svc.clone().oneshot(req).await.unwrap();
        if resp.status() == http::StatusCode::TOO_MANY_REQUESTS {
            let head = resp.headers().clone();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            from_layer = Some(seen(429, &head, &body));
            break;
        }
    }
    let from_layer = from_layer.expect("the layer's global rule never dropped a request");
    // The sidecar of the same service (`test`), which offered nothing: the fleet's ratio is
    // its too.
    let mut from_sidecar = None;
    for _ in 0..3000 {
        let (status, head, body) = get(sc.addr(), "/", &k).await;
        if status == http::StatusCode::TOO_MANY_REQUESTS {
            from_sidecar = Some(seen(429, &head, body.as_bytes()));
            break;
        }
    }
    assert_eq!(Some(from_layer), from_sidecar);
    sc.shutdown();
    sc.wait().await;
}

#[tokio::test]
async fn the_layer_charges_usage_an_inner_service_says_in_its_response() {
    let rules = "rules:
  - name: tokens
    key: [header:x-api-key]
    limit: { rate: 100/h, burst: 1000 }
    cost: { response: { header: x-usage-tokens }, reserve: 0, max: 100000 }
";
    let layer = spillway::RateLimitLayer::from_yaml(rules, "layer").unwrap();
    let app = tower::service_fn(|_req: http::Request<Full<Bytes>>| async {
        let mut resp = http::Response::new(Full::new(Bytes::from_static(b"answer")));
        resp.headers_mut()
            .insert("x-usage-tokens", http::HeaderValue::from_static("1200"));
        Ok::<_, Infallible>(resp)
    });
    let svc = layer.layer(app);
    let call = || {
        let req = http::Request::get("http://app/v1/chat/completions")
            .header("x-api-key", "k")
            .body(Full::new(Bytes::new()))
            .unwrap();
        svc.clone().oneshot(req)
    };
    let resp = call().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        &resp.into_body().collect().await.unwrap().to_bytes()[..],
        b"answer"
    );
    // 1 200 used of 1 000: in debt, refused, however little the next call would use.
    let resp = call().await.unwrap();
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().contains_key("retry-after"));
}
