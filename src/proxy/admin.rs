//! The admin listener: `/metrics`, `/healthz`, `/readyz`, `/config`.
//!
//! Owns the operator-facing HTTP endpoints on their own port, so that probes and scrapes never
//! compete with client traffic and are never rate limited. Must never: expose raw keys, or
//! answer ready while draining.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::{config_json, Shared};

/// Serves the admin endpoints until `stop` turns true, on the small server the control plane's
/// listeners use too (its caps on connections, each one's header-read timeout).
pub async fn serve(listener: TcpListener, shared: Arc<Shared>, stop: watch::Receiver<bool>) {
    crate::control::server::serve(listener, stop, None, move |req| {
        let shared = shared.clone();
        async move { route(&shared, req) }
    })
    .await;
}

fn route(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
    }
    match req.uri().path() {
        "/metrics" => {
            let mut resp = Response::new(Full::new(Bytes::from(shared.metrics.render())));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            resp
        }
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => {
            if shared.draining.load(Ordering::Relaxed) {
                text(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
            } else {
                text(StatusCode::OK, "ready\n")
            }
        }
        #[cfg(feature = "ui")]
        "/ui" => crate::ui::page(),
        #[cfg(feature = "ui")]
        "/ui/state.json" => {
            let mut resp = Response::new(Full::new(ui_state(shared)));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            resp
        }
        "/config" => {
            let mut resp = Response::new(Full::new(config_json(
                &shared.config.load(),
                &shared.loaded.load(),
            )));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            resp
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /metrics /healthz /readyz /config /ui\n",
        ),
    }
}

/// The proxy's state for its status page: per rule its counters (the page turns them into
/// rates), limit, mode and keys tracked; the control plane's staleness; Redis.
#[cfg(feature = "ui")]
fn ui_state(shared: &Shared) -> Bytes {
    let config = shared.config.load();
    let rules = shared.rules.load();
    let m = &shared.metrics;
    let count = |rule: &str, decision: &str| m.requests.with_label_values(&[rule, decision]).get();
    let list: Vec<serde_json::Value> = config
        .rules
        .iter()
        .map(|r| {
            let name = r.name.0.as_str();
            // A budget charged after the response counts its units, not requests.
            let units = r.cost.response().map(|c| match &c.usage {
                crate::config::Usage::Header(h) => format!("header {}", h.0),
                crate::config::Usage::Trailer(t) => format!("trailer {}", t.0),
                crate::config::Usage::BodyBytes => "body bytes".into(),
                crate::config::Usage::Json(p) => format!("JSON {}", p.text().join(" + ")),
            });
            let (kind, limit) = match &r.limit {
                crate::config::Limit::Rate { rate, burst, .. } => (
                    format!("{:?}", r.scope).to_lowercase(),
                    match &units {
                        Some(what) => {
                            format!("{rate} (burst {burst}) units of the response's {what}")
                        }
                        None => format!("{rate} (burst {burst})"),
                    },
                ),
                crate::config::Limit::Concurrency(n) => {
                    ("concurrency".into(), format!("{n} in flight"))
                }
                crate::config::Limit::Adaptive(spec) => (
                    "adaptive".into(),
                    format!(
                        "{} in flight now ({}..{})",
                        m.adaptive_limit.with_label_values(&[name]).get(),
                        spec.min,
                        spec.max
                    ),
                ),
            };
            let limit_rps = match &r.limit {
                crate::config::Limit::Rate { rate, .. } if r.key.0.is_empty() => {
                    Some(f64::from(rate.count.get()) / rate.period.as_secs_f64())
                }
                _ => None,
            };
            serde_json::json!({
                "rule": name, "kind": kind, "limit": limit, "limit_rps": limit_rps,
                "mode": format!("{:?}", r.mode).to_lowercase(),
                "allowed": count(name, "allowed"), "rejected": count(name, "rejected"),
                "shadow_rejected": count(name, "shadow_rejected"),
                "keys": rules.tracked_keys(name),
                "units_charged": units.is_some().then(|| {
                    m.response_units.with_label_values(&[name, "charged"]).get()
                }),
            })
        })
        .collect();
    let control_plane = config.control_plane.as_ref().map(|_| {
        serde_json::json!({
            "age_s": m.control_plane_age.get(),
            "stale": m.control_plane_stale.get() == 1,
        })
    });
    let redis = config.redis.as_ref().map(|_| {
        serde_json::json!({
            "connected": m.redis.connected.get() == 1,
            "breaker_open": m.redis.breaker_state.get() != 0,
        })
    });
    let doc = serde_json::json!({
        "role": "proxy",
        "service": config.service.0,
        "version": shared.loaded.load().version,
        "rules": list,
        "control_plane": control_plane,
        "redis": redis,
    });
    Bytes::from(serde_json::to_vec(&doc).unwrap_or_default())
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}
