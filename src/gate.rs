//! Admission around the synchronous decision: waiting when a rule delays, holding
//! concurrency slots until the response body ends, and the same as a tower [`Layer`] for
//! services that embed Spillway without the sidecar.
//!
//! Owns the only awaits of the limiting path: the leaky bucket's shaping wait and the
//! `on_limit: delay` retries, each a tokio timer (no thread held). The rule snapshot is loaded
//! afresh for each try and never held across an await. Must never: answer a request itself
//! (that is `proxy::respond`), or wait longer than the rule's `max_delay`.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{Either, Full};
use serde::Deserialize;

use tower::{Layer, Service};

use crate::config::{ClientIp, ConfigError, HeaderMode, Rule, Scope};
use crate::key::{self, RequestView};
use crate::limit::{AnyClock, Clock, Permit};
use crate::metrics::Metrics;
use crate::respond;
pub use crate::respond::PermitBody;
pub use crate::rules::Refusal;
use crate::rules::{Admit, RuleSet, Verdict};

/// Decides `req`, waiting when a rule says so: the leaky bucket's shaping wait, or, for a
/// rule with `on_limit: delay`, until the limiter admits it (at most `max_delay`, with a place
/// in the rule's queue). A caller that drops this future (the client went away) frees its
/// queue place and any concurrency slot it held.
pub async fn admit(
    rules: &ArcSwap<RuleSet>,
    clock: &AnyClock,
    req: &RequestView<'_>,
) -> Result<Admit, Refusal> {
    let mut place: Option<crate::rules::QueuePlace> = None;
    // Bounded by tokio's clock, so that a waiting request ends even if the limiter's clock
    // were to stand still.
    let mut deadline = None;
    loop {
        let now = clock.now();
        // The snapshot guard is released before any await: a decision that must ask Redis
        // keeps the rule set alive by its `Arc` instead.
        let verdict = {
            let guard = rules.load();
            match guard.check(req, now) {
                Verdict::Remote(remote) => Err((arc_swap::Guard::into_inner(guard), remote)),
                v => Ok(v),
            }
        };
        let verdict = match verdict {
            Ok(v) => v,
            // Boxed: the rare path (a network round trip) keeps the common future small.
            Err((set, remote)) => Box::pin(ask_store(&set, remote, req, now)).await,
        };
        match verdict {
            Verdict::Allow(admit) => {
                if admit.wait > 0 {
                    Box::pin(tokio::time::sleep(Duration::from_nanos(admit.wait))).await;
                }
                if let Some(place) = place {
                    place.admitted();
                }
                return Ok(admit);
            }
            Verdict::BadRequest(bad) => return Err(Refusal::BadRequest(bad)),
            Verdict::Remote(_) => unreachable!("ask_store answers Allow or Deny"),
            Verdict::Deny(denial) => {
                let (Some(delay), Some(retry)) = (&denial.delay, denial.retry_after) else {
                    return Err(Refusal::Limited(denial));
                };
                let now = tokio::time::Instant::now();
                let deadline = *deadline.get_or_insert(now + Duration::from_nanos(delay.max_delay));
                let wake = now + Duration::from_nanos(retry);
                if wake > deadline {
                    return Err(Refusal::Limited(denial));
                }
                if place.is_none() {
                    match delay.queue.enter() {
                        Some(p) => place = Some(p),
                        None => return Err(Refusal::Limited(denial)),
                    }
                }
                drop(denial);
                Box::pin(tokio::time::sleep_until(wake)).await;
            }
        }
    }
}

/// Asks the rule set's store each question a decision left open (`scope: redis` rules, in
/// turn, each bounded by `redis.timeout`), then finishes the decision.
async fn ask_store(
    set: &RuleSet,
    mut remote: Box<crate::rules::Remote>,
    req: &RequestView<'_>,
    now: crate::limit::Nanos,
) -> Verdict {
    loop {
        let answer = match (remote.question(set), set.store()) {
            (None, _) => return set.finish(remote),
            (Some(q), Some(store)) => store.decide(q).await,
            (Some(_), None) => None,
        };
        if let Some(refused) = set.answer(&mut remote, answer, req, now) {
            return refused;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The tower layer.

/// The client address of a request for [`RateLimitLayer`]: insert it as a request extension
/// (a bare `SocketAddr` extension works too). Without either, `client_ip` keys are 0.0.0.0.
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub SocketAddr);

/// The rules part of the YAML, for embedding: `rules:` and optionally `headers:` and
/// `client_ip:`, with the same schema and errors as the sidecar's file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Policy {
    #[serde(default)]
    client_ip: ClientIp,
    #[serde(default)]
    headers: HeaderMode,
    #[serde(default)]
    rules: Vec<Rule>,
}

/// Spillway's limiting as a tower [`Layer`], built from the same YAML rules as the sidecar.
///
/// ```
/// use spillway::RateLimitLayer;
/// use tower::{Layer, ServiceExt};
///
/// # tokio_test_block_on(async {
/// let layer = RateLimitLayer::from_yaml(r#"
/// rules:
///   - name: per-key
///     key: [header:x-api-key]
///     limit: { rate: 1/m, burst: 1 }
/// "#, "inline").unwrap();
/// let app = tower::service_fn(|_req: http::Request<String>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(String::from("hello")))
/// });
/// let svc = layer.layer(app);
/// let req = || http::Request::get("/").header("x-api-key", "k").body(String::new()).unwrap();
/// assert_eq!(svc.clone().oneshot(req()).await.unwrap().status(), 200);
/// assert_eq!(svc.clone().oneshot(req()).await.unwrap().status(), 429);
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
/// # }
/// ```
#[derive(Clone)]
pub struct RateLimitLayer {
    shared: Arc<LayerShared>,
}

struct LayerShared {
    rules: ArcSwap<RuleSet>,
    clock: AnyClock,
    metrics: Arc<Metrics>,
    client_ip: key::ClientIpPolicy,
    hygiene: crate::hygiene::Hygiene,
}

impl RateLimitLayer {
    /// Builds the layer from YAML with a `rules:` list; `source` names it in errors.
    pub fn from_yaml(yaml: &str, source: &str) -> Result<Self, ConfigError> {
        let policy: Policy = crate::config::parse_yaml(yaml, source)?;
        crate::config::check_rule_names(&policy.rules, yaml, source)?;
        // Accepted, they would never limit: the layer has no control plane and no Redis.
        if let Some(rule) = policy.rules.iter().find(|r| r.scope != Scope::Local) {
            let needs = match rule.scope {
                Scope::Global => "scope: global needs the sidecar's control plane",
                _ => "scope: redis needs the sidecar's redis section",
            };
            return Err(ConfigError::Invalid {
                file: source.to_string(),
                line: crate::config::line_of_nth_name(yaml, &rule.name.0, 1),
                column: None,
                message: format!("rule {}: {needs}; the layer decides local rules", rule.name),
            });
        }
        let metrics = Arc::new(Metrics::new());
        let rules = RuleSet::from_rules(&policy.rules, policy.headers, &metrics);
        Ok(Self {
            shared: Arc::new(LayerShared {
                rules: ArcSwap::from_pointee(rules),
                clock: AnyClock::default(),
                metrics,
                client_ip: policy.client_ip.policy(),
                hygiene: crate::hygiene::Hygiene::default(),
            }),
        })
    }

    /// The layer's metrics, in Prometheus text format.
    pub fn render_metrics(&self) -> Vec<u8> {
        self.shared.metrics.render()
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;
    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service [`RateLimitLayer`] wraps around another.
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    shared: Arc<LayerShared>,
}

/// What [`RateLimit`] answers: the inner service's body, or a short one of ours.
pub type LimitedBody<B> = Either<PermitBody<B>, Full<Bytes>>;

impl<S, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    ReqB: Send + 'static,
    ResB: Body<Data = Bytes> + Unpin,
{
    type Response = Response<LimitedBody<ResB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqB>) -> Self::Future {
        // The clone that was driven to readiness serves this request (tower's usual dance).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move {
            let peer = req
                .extensions()
                .get::<PeerAddr>()
                .map(|p| p.0)
                .or_else(|| req.extensions().get::<SocketAddr>().copied())
                .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |a| a.ip());
            let grpc = respond::is_grpc(req.headers());
            // The inner service is given what the rules saw: the sidecar's request hygiene,
            // with its defaults.
            if let Err((_, detail)) = shared.hygiene.apply(&mut req) {
                return Ok(respond::error(http::StatusCode::BAD_REQUEST, &detail));
            }
            let client_ip = shared.client_ip.client(req.headers(), peer);
            let trusted = shared.client_ip.trusts(peer);
            let admitted = admit(
                &shared.rules,
                &shared.clock,
                &RequestView::of(&req, client_ip).trusted(trusted),
            )
            .await;
            let mut admit = match admitted {
                Ok(a) => a,
                Err(refusal) => return Ok(respond::refusal(&refusal, grpc)),
            };
            let resp = inner.call(req).await?;
            admit.permits.iter_mut().for_each(Permit::responded);
            let mut resp = resp.map(|b| Either::Left(PermitBody::new(b, admit.permits)));
            // `states` is filled only under `headers: always`, so this is a no-op otherwise.
            respond::add_rate_headers(resp.headers_mut(), &admit.states);
            Ok(resp)
        })
    }
}
