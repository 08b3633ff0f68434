//! The admin listener: `/metrics`, `/healthz`, `/readyz` to anyone; `/config` and `/ui` from
//! loopback or with the `admin_token_file`'s token (or to anyone, as `admin_open` says); and
//! for support, from loopback or with the token only, `/explain` (what the rules would decide
//! of a described request, and why), `/top` (each rule's most active keys) and `/log-level`
//! (the log filter, read and changed).
//!
//! Owns the operator-facing HTTP endpoints on their own port, so that probes and scrapes never
//! compete with client traffic and are never rate limited. Must never: expose raw keys, answer
//! ready while draining, take anything from a key's state, or serve the support endpoints (or
//! the rules, unless asked) to the scraped address without the token.

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
        async move {
            match req.uri().path() {
                "/explain" | "/top" | "/log-level" => support(&shared, req).await,
                _ => route(&shared, req),
            }
        }
    })
    .await;
}

fn route(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
    }
    let page = match req.uri().path() {
        "/config" => Some(crate::config::AdminPage::Config),
        "/ui" | "/ui/state.json" => Some(crate::config::AdminPage::Ui),
        _ => None,
    };
    if let Some(page) = page {
        let config = shared.config.load();
        if !config.admin_open.contains(&page) {
            let peer = req
                .extensions()
                .get::<crate::control::server::Peer>()
                .map(|p| p.0);
            let token_file = config.admin_token_file.as_deref();
            if let Err((status, why)) = may_support(peer, req.headers(), token_file) {
                return text(status, why);
            }
        }
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
            // Keys only for who may ask `/top` (loopback, or the token).
            let peer = req.extensions().get::<crate::control::server::Peer>().map(|p| p.0);
            let token_file = shared.config.load().admin_token_file.clone();
            let keys = may_support(peer, req.headers(), token_file.as_deref()).is_ok();
            let mut resp = Response::new(Full::new(ui_state(shared, keys)));
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
            "not found; try /metrics /healthz /readyz (and from loopback /config /ui /explain /top /log-level)\n",
        ),
    }
}

/// The proxy's state for its status page: per rule its counters (the page turns them into
/// rates), limit, mode and keys tracked; the control plane's staleness; Redis.
#[cfg(feature = "ui")]
fn ui_state(shared: &Shared, keys: bool) -> Bytes {
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
    // Each rule's keys holding the most of their limits now, read from the stores.
    let top = keys.then(|| {
        let now = crate::limit::Clock::now(&shared.clock);
        rules
            .top(5, now)
            .into_iter()
            .flat_map(|r| {
                let (rule, used) = (r.rule, r.used);
                let refused = r.refused.into_iter().map({
                    let rule = rule.clone();
                    move |k| {
                        serde_json::json!({
                            "rule": rule, "key": k.key, "used": k.refusals,
                            "of": "refusals over the last minute or two", "limited": true,
                        })
                    }
                });
                r.top
                    .into_iter()
                    .map(move |k| {
                        serde_json::json!({
                            "rule": rule, "key": k.key, "used": k.used, "of": used, "limited": k.limited,
                        })
                    })
                    .chain(refused)
            })
            .collect::<Vec<_>>()
    });
    let doc = serde_json::json!({
        "role": "proxy",
        "service": config.service.0,
        "version": shared.loaded.load().version,
        "rules": list,
        "control_plane": control_plane,
        "redis": redis,
        "top": top,
    });
    Bytes::from(serde_json::to_vec(&doc).unwrap_or_default())
}

/// The largest request description `/explain` reads, and the longest it waits for it.
const EXPLAIN_BODY: usize = 64 << 10;
const EXPLAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The support endpoints: served to loopback, or to a request with the admin token.
async fn support(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let peer = req
        .extensions()
        .get::<crate::control::server::Peer>()
        .map(|p| p.0);
    let token_file = shared.config.load().admin_token_file.clone();
    if let Err((status, why)) = may_support(peer, req.headers(), token_file.as_deref()) {
        return text(status, why);
    }
    let now = crate::limit::Clock::now(&shared.clock);
    match (req.uri().path(), req.method()) {
        ("/explain", &Method::POST) => {
            let body = match read_body(req).await {
                Ok(body) => body,
                Err(resp) => return resp,
            };
            let asked: Asked = match serde_json::from_slice(&body) {
                Ok(asked) => asked,
                Err(e) => {
                    return owned(
                        StatusCode::BAD_REQUEST,
                        format!("malformed description: {e}\n"),
                    )
                }
            };
            match explain(shared, asked, now).await {
                Ok(doc) => json(StatusCode::OK, &doc),
                Err(e) => owned(StatusCode::BAD_REQUEST, format!("{e}\n")),
            }
        }
        ("/explain", _) => text(
            StatusCode::METHOD_NOT_ALLOWED,
            "POST a request description: {\"method\", \"path\", \"headers\", \"client\"}\n",
        ),
        ("/top", &Method::GET) => {
            let n = req
                .uri()
                .query()
                .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("n=")))
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or(10)
                .clamp(1, 1000);
            let rules = shared.rules.load();
            json(
                StatusCode::OK,
                &serde_json::json!({ "rules": rules.top(n, now) }),
            )
        }
        ("/log-level", &Method::GET) => match crate::logs::level() {
            Some(level) => owned(StatusCode::OK, format!("{level}\n")),
            None => text(
                StatusCode::NOT_FOUND,
                "no log filter of Spillway's in this process\n",
            ),
        },
        // PUT only: a web page cannot send one without asking first (a POST it can).
        ("/log-level", &Method::PUT) => {
            let body = match read_body(req).await {
                Ok(body) => body,
                Err(resp) => return resp,
            };
            let spec = String::from_utf8_lossy(&body);
            match crate::logs::set_level(&spec) {
                Ok(()) => owned(StatusCode::OK, format!("{}\n", spec.trim())),
                Err(e) => owned(StatusCode::BAD_REQUEST, format!("{e}\n")),
            }
        }
        _ => text(
            StatusCode::METHOD_NOT_ALLOWED,
            "POST /explain, GET /top, GET or PUT /log-level\n",
        ),
    }
}

/// With the token in `token_file` (read when a request carries one, so that a rotated Secret
/// counts at once), from anywhere; else from this host's own loopback address (127.0.0.1 or
/// ::1: a `kubectl port-forward` or `exec` arrives so; not the rest of 127/8, where a mesh's
/// inbound traffic comes from) and as a tool asks, not a web page: no `Origin` (a cross-site
/// request) and a `Host` that is `localhost` or an address (not a name a page rebound).
/// Else why not.
fn may_support(
    peer: Option<std::net::IpAddr>,
    headers: &http::HeaderMap,
    token_file: Option<&std::path::Path>,
) -> Result<(), (StatusCode, &'static str)> {
    let given = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    if let (Some(file), Some(given)) = (token_file, given) {
        match crate::control::auth::read_token(file) {
            Ok(token) if bool::from(subtle::ConstantTimeEq::ct_eq(given, &token[..])) => {
                return Ok(())
            }
            // A stale token through a port-forward: loopback decides, below.
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "admin_token_file cannot be read: the support endpoints answer loopback only");
            }
        }
    }
    let near = peer.is_some_and(|p| {
        p.to_canonical() == std::net::IpAddr::from(std::net::Ipv4Addr::LOCALHOST)
            || p == std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
    });
    if !near {
        return Err(match token_file {
            Some(_) => (
                StatusCode::UNAUTHORIZED,
                "a bearer token is needed from beyond loopback\n",
            ),
            None => (
                StatusCode::FORBIDDEN,
                "served to loopback only (kubectl port-forward), or with admin_token_file's token\n",
            ),
        });
    }
    if headers.contains_key(http::header::ORIGIN) {
        return Err((
            StatusCode::FORBIDDEN,
            "a web page's request (Origin): ask with spillway or curl, or with the token\n",
        ));
    }
    let host = headers
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.split(':').next().unwrap_or(""),
    };
    if !(name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok()) {
        return Err((
            StatusCode::FORBIDDEN,
            "asked by a host name (a rebound page?): ask localhost or the address, or with the token\n",
        ));
    }
    Ok(())
}

/// A bounded body, within [`EXPLAIN_WAIT`].
async fn read_body(req: Request<Incoming>) -> Result<Bytes, Response<Full<Bytes>>> {
    use http_body_util::BodyExt;
    let limited = http_body_util::Limited::new(req.into_body(), EXPLAIN_BODY);
    match tokio::time::timeout(EXPLAIN_WAIT, limited.collect()).await {
        Ok(Ok(body)) => Ok(body.to_bytes()),
        Ok(Err(_)) => Err(text(
            StatusCode::PAYLOAD_TOO_LARGE,
            "a body of 64 KiB at most\n",
        )),
        Err(_) => Err(text(
            StatusCode::REQUEST_TIMEOUT,
            "the body came too slowly\n",
        )),
    }
}

/// A request to explain: as a client would send it to the proxy.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Asked {
    #[serde(default = "get")]
    pub method: String,
    /// The request target: a path and query.
    #[serde(default = "root")]
    pub path: String,
    /// Header fields: an object, or a list of `[name, value]` pairs (for a repeated field).
    #[serde(default)]
    pub headers: Fields,
    /// The address the request comes from (the socket peer: with a trusted proxy's, its
    /// `X-Forwarded-For` counts as the proxy would count it). Default: 127.0.0.1.
    #[serde(default)]
    pub client: Option<std::net::IpAddr>,
}

fn get() -> String {
    "GET".into()
}

fn root() -> String {
    "/".into()
}

#[derive(serde::Deserialize, Default)]
#[serde(untagged)]
pub enum Fields {
    #[default]
    None,
    Map(std::collections::BTreeMap<String, String>),
    List(Vec<(String, String)>),
}

/// What the rules would decide of `asked` at `now`: the request made as the proxy makes it
/// (its hygiene, its client), explained, and Redis asked read only for `scope: redis` rules.
async fn explain(
    shared: &Shared,
    asked: Asked,
    now: crate::limit::Nanos,
) -> Result<serde_json::Value, String> {
    let config = shared.config.load_full();
    let rules = shared.rules.load_full();
    let how = (&shared.hygiene, &shared.client_ip, &config.hosts[..]);
    let (mut explained, client, path) = match describe(how, &rules, asked, now)? {
        Ok(described) => described,
        Err(refused) => return Ok(refused),
    };
    let asks = explained.asks.clone();
    for ask in &asks {
        let answer = match (rules.store(), rules.redis_question(ask)) {
            (Some(store), Some(q)) => store.peek(q).await,
            _ => None,
        };
        explained.redis_answered(ask, answer, rules.store().map(|s| s.on_error()));
    }
    document(&explained, client, path)
}

/// What `config`'s rules make of `asked` with no state (no proxy reached): which rules match
/// it and with which key; decisions are a fresh key's.
pub fn explain_offline(
    config: &crate::config::Config,
    asked: Asked,
) -> Result<serde_json::Value, String> {
    let secret = crate::digest::Secret::of(config.key_secret_file.as_deref())?;
    let metrics = crate::metrics::Metrics::new();
    let rules = crate::rules::RuleSet::build(config, &metrics).with_secret(secret);
    // The keys' own limits as the proxy would load them (a command's read, not a worker's).
    for (rule, (loaded, _)) in rules.load_override_files(None) {
        loaded.map_err(|e| format!("rule {rule}: overrides_file {e}"))?;
    }
    let hygiene = crate::hygiene::Hygiene::of(config);
    let policy = config.client_ip.policy();
    let mut doc = match describe((&hygiene, &policy, &config.hosts[..]), &rules, asked, 0)? {
        Ok((explained, client, path)) => document(&explained, client, path)?,
        Err(refused) => refused,
    };
    if let serde_json::Value::Object(m) = &mut doc {
        m.insert("offline".into(), true.into());
        if let Some(serde_json::Value::Array(list)) = m.get_mut("rules") {
            for r in list.iter_mut().filter_map(|r| r.as_object_mut()) {
                r.remove("state");
                r.remove("remaining");
                r.remove("retry_after_s");
                if matches!(
                    r.get("decision").and_then(|d| d.as_str()),
                    Some("admit" | "refuse" | "asks_redis")
                ) {
                    r.insert("decision".into(), "applies".into());
                    r.insert("reason".into(), "its match selects the request; its key's state is the proxy's (ask a running one)".into());
                }
            }
        }
        if m.get("decision").and_then(|d| d.as_str()) != Some("bad_request") {
            m.insert("decision".into(), "unknown offline".into());
            m.remove("by");
            m.remove("retry_after_s");
        }
    }
    Ok(doc)
}

/// An explanation as JSON, with the client the rules keyed and the path they matched.
fn document(
    explained: &crate::rules::Explanation,
    client: String,
    path: String,
) -> Result<serde_json::Value, String> {
    let mut doc = serde_json::to_value(explained).map_err(|e| e.to_string())?;
    if let serde_json::Value::Object(m) = &mut doc {
        m.insert("client".into(), client.into());
        m.insert("path".into(), path.into());
    }
    Ok(doc)
}

/// [`RuleSet::explain`] of `asked`, made a request by `hygiene` and `policy` as the proxy
/// makes one (a missing `Host` is the first of `hosts`): the explanation, the client the
/// rules keyed and the path they matched; or the hygiene's refusal's document.
#[allow(clippy::type_complexity)]
fn describe(
    (hygiene, policy, hosts): (
        &crate::hygiene::Hygiene,
        &crate::key::ClientIpPolicy,
        &[crate::config::ServedHost],
    ),
    rules: &crate::rules::RuleSet,
    asked: Asked,
    now: crate::limit::Nanos,
) -> Result<Result<(crate::rules::Explanation, String, String), serde_json::Value>, String> {
    let mut builder = Request::builder()
        .method(asked.method.as_str())
        .uri(asked.path.as_str());
    let fields: Vec<(String, String)> = match asked.headers {
        Fields::None => Vec::new(),
        Fields::Map(m) => m.into_iter().collect(),
        Fields::List(l) => l,
    };
    let has_host = fields.iter().any(|(k, _)| k.eq_ignore_ascii_case("host"));
    for (k, v) in &fields {
        builder = builder.header(k.as_str(), v.as_str());
    }
    if !has_host {
        // A request must name a host the app serves: the first of `hosts:`.
        let host = match hosts.first() {
            None => "localhost".to_string(),
            Some(crate::config::ServedHost::Name(n)) => n.clone(),
            Some(crate::config::ServedHost::Subdomains(s)) => format!("any{s}"),
            Some(crate::config::ServedHost::Ip(ip)) => match ip {
                std::net::IpAddr::V4(a) => a.to_string(),
                std::net::IpAddr::V6(a) => format!("[{a}]"),
            },
        };
        builder = builder.header(http::header::HOST, host);
    }
    let mut req = builder
        .body(())
        .map_err(|e| format!("not a request: {e}"))?;
    let peer = asked
        .client
        .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
    if let Err(refused) = hygiene.apply(&mut req) {
        return Ok(Err(serde_json::json!({
            "decision": "bad_request",
            "status": refused.status.as_u16(),
            "reason": refused.detail,
            "rules": [],
        })));
    }
    let trusted = policy.trusts(peer);
    if !trusted {
        hygiene.untrusted(&mut req);
    }
    let client = policy.who(req.headers(), peer);
    let view = crate::key::RequestView::for_proxy(
        &req,
        client,
        (trusted, hygiene.strict_path),
        crate::ids::IdFrom::Trusted,
    );
    let explained = rules.explain(&view, now);
    Ok(Ok((
        explained,
        client.keyed.to_string(),
        view.path().to_string(),
    )))
}

fn json(status: StatusCode, value: &impl serde::Serialize) -> Response<Full<Bytes>> {
    let body = serde_json::to_vec_pretty(value).unwrap_or_default();
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

fn owned(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
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

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(token: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        h
    }

    fn with(pairs: &[(&str, &str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn the_support_endpoints_answer_loopback_or_the_token_and_nobody_else() {
        let tool = with(&[("host", "127.0.0.1:9901")]);
        let far: std::net::IpAddr = "10.1.2.3".parse().unwrap();
        for near in ["127.0.0.1", "::1", "::ffff:127.0.0.1"] {
            assert!(
                may_support(Some(near.parse().unwrap()), &tool, None).is_ok(),
                "{near}"
            );
        }
        for host in ["localhost:9901", "[::1]:9901", "127.0.0.1"] {
            let h = with(&[("host", host)]);
            assert!(
                may_support(Some("::1".parse().unwrap()), &h, None).is_ok(),
                "{host}"
            );
        }
        // The rest of 127/8 is a mesh's inbound traffic (127.0.0.6), not an operator.
        let mesh: std::net::IpAddr = "127.0.0.6".parse().unwrap();
        assert_eq!(
            may_support(Some(mesh), &tool, None).unwrap_err().0,
            StatusCode::FORBIDDEN
        );
        // A web page: cross-site (Origin), or rebound to this address under its own name.
        let page = with(&[
            ("host", "127.0.0.1:9901"),
            ("origin", "https://evil.example"),
        ]);
        let near: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(
            may_support(Some(near), &page, None).unwrap_err().0,
            StatusCode::FORBIDDEN
        );
        let rebound = with(&[("host", "evil.example:9901")]);
        assert_eq!(
            may_support(Some(near), &rebound, None).unwrap_err().0,
            StatusCode::FORBIDDEN
        );
        // The scraped address, without a token file: refused, whatever it sends.
        assert_eq!(
            may_support(Some(far), &bearer("x"), None).unwrap_err().0,
            StatusCode::FORBIDDEN
        );
        assert!(may_support(None, &tool, None).is_err());
        let dir = std::env::temp_dir().join(format!("spillway-admin-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "s3cret\n").unwrap();
        assert_eq!(
            may_support(Some(far), &tool, Some(&file)).unwrap_err().0,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            may_support(Some(far), &bearer("s3cre"), Some(&file))
                .unwrap_err()
                .0,
            StatusCode::UNAUTHORIZED
        );
        assert!(may_support(Some(far), &bearer("s3cret"), Some(&file)).is_ok());
        // The token opens it to a page's request too (a page cannot know it).
        let mut h = bearer("s3cret");
        h.insert(
            http::header::ORIGIN,
            "https://evil.example".parse().unwrap(),
        );
        assert!(may_support(Some(far), &h, Some(&file)).is_ok());
        // A token file gone: loopback only again, never open.
        std::fs::remove_file(&file).unwrap();
        assert_eq!(
            may_support(Some(far), &bearer("s3cret"), Some(&file))
                .unwrap_err()
                .0,
            StatusCode::UNAUTHORIZED
        );
        assert!(may_support(Some(near), &tool, Some(&file)).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
