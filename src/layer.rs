//! The tower [`Layer`]: Spillway's limiting embedded in a service, without the sidecar. A thin
//! adapter: the sidecar's hygiene, the same decision and admission (`gate::admit`), the same
//! answers (`respond`); global rules report to the control plane as a sidecar's do. Must
//! never: decide or answer in a way of its own, or accept a rule it cannot enforce (a `scope:
//! redis` rule; a global one without a control plane).

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{Either, Full};
use serde::Deserialize;
use tokio::sync::watch;
use tower::{Layer, Service};

use crate::config::{ClientIp, ConfigError, ControlPlane, HeaderMode, Name, Rule, Scope};
use crate::control::reporter::Reporter;
use crate::gate::admit;
use crate::key::{self, RequestView};
use crate::limit::{AnyClock, Clock, Permit};
use crate::metrics::Metrics;
use crate::respond;
use crate::respond::PermitBody;
use crate::rules::{DropRatios, RuleSet};

/// The client address of a request for [`RateLimitLayer`]: insert it as a request extension
/// (a bare `SocketAddr` extension works too). Without either, `client_ip` keys are 0.0.0.0.
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub SocketAddr);

/// The rules part of the YAML, for embedding: `rules:` and optionally `headers:`,
/// `client_ip:`, and for global rules `service:` and `control_plane:`, with the same schema
/// and errors as the sidecar's file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Policy {
    #[serde(default)]
    service: Option<Name>,
    #[serde(default)]
    control_plane: Option<ControlPlane>,
    #[serde(default)]
    client_ip: ClientIp,
    #[serde(default)]
    headers: HeaderMode,
    /// As the sidecar's: the secret private key parts are digested under.
    #[serde(default)]
    key_secret_file: Option<std::path::PathBuf>,
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
    rules: Arc<ArcSwap<RuleSet>>,
    clock: AnyClock,
    metrics: Arc<Metrics>,
    client_ip: key::ClientIpPolicy,
    hygiene: crate::hygiene::Hygiene,
    /// Dropped with the last clone of the layer: its reporter sends one last report and stops.
    _reporting: Option<watch::Sender<bool>>,
}

impl RateLimitLayer {
    /// Builds the layer from YAML with a `rules:` list; `source` names it in errors. With
    /// global rules (and their `service:` and `control_plane:`), it must be built inside a
    /// tokio runtime: it reports to the control plane from there, as a sidecar does.
    pub fn from_yaml(yaml: &str, source: &str) -> Result<Self, ConfigError> {
        let policy: Policy = crate::config::parse_yaml(yaml, source)?;
        crate::config::check_rule_names(&policy.rules, yaml, source)?;
        let invalid = |line, message: String| ConfigError::Invalid {
            file: source.to_string(),
            line,
            column: None,
            message,
        };
        // Accepted, it would never limit: the layer has no Redis.
        if let Some(rule) = policy.rules.iter().find(|r| r.scope == Scope::Redis) {
            return Err(invalid(
                crate::config::line_of_nth_name(yaml, &rule.name.0, 1),
                format!(
                    "rule {}: scope: redis needs the sidecar's redis section; the layer decides \
                     local and global rules",
                    rule.name
                ),
            ));
        }
        let cp = policy.control_plane.as_ref();
        crate::config::check_control_plane(cp, &policy.rules, yaml, source)?;
        let clock = AnyClock::default();
        let metrics = Arc::new(Metrics::new());
        // Fresh from the start, as a sidecar's: a control plane that never answers makes them
        // stale after `stale_after`.
        let ratios = Arc::new(ArcSwap::from_pointee(DropRatios::empty(clock.now())));
        let secret = crate::digest::Secret::of(policy.key_secret_file.as_deref())
            .map_err(|e| invalid(None, e))?;
        let rules = RuleSet::from_rules(&policy.rules, policy.headers, &metrics)
            .in_fleet(cp, ratios.clone())
            .with_secret(secret);
        let rules = Arc::new(ArcSwap::from_pointee(rules));
        let reporting = match cp {
            Some(cp) => {
                let Some(service) = &policy.service else {
                    return Err(invalid(
                        None,
                        "control_plane: needs service, the name the fleet counts these rules \
                         under"
                            .into(),
                    ));
                };
                let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
                    invalid(
                        None,
                        "control_plane: the layer reports from a tokio runtime; build it inside \
                         one"
                        .into(),
                    )
                })?;
                let (stop, stopped) = watch::channel(false);
                let reporter =
                    Reporter::new(&service.0, cp, &ratios, &clock, &metrics, stopped.clone())
                        .map_err(|e| invalid(None, e.to_string()))?;
                runtime.spawn(reporter.run(rules.clone(), stopped));
                Some(stop)
            }
            None => None,
        };
        Ok(Self {
            shared: Arc::new(LayerShared {
                rules,
                clock,
                metrics,
                client_ip: policy.client_ip.policy(),
                hygiene: crate::hygiene::Hygiene::default(),
                _reporting: reporting,
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
            let grpc = respond::form(req.method(), req.version(), req.headers());
            // The inner service is given what the rules saw: the sidecar's request hygiene,
            // with its defaults.
            if let Err(refused) = shared.hygiene.apply(&mut req) {
                return Ok(refused.response(&crate::ids::RequestId::made().text()));
            }
            let client = shared.client_ip.who(req.headers(), peer);
            let trusted = shared.client_ip.trusts(peer);
            let mut view = RequestView::of(&req, client.keyed).trusted(trusted);
            view.client_addr = client.addr;
            let admitted = admit(&shared.rules, &shared.clock, &view).await;
            let mut admit = match admitted {
                Ok(a) => a,
                Err(refusal) => {
                    return Ok(respond::answer(&refusal, grpc, &view.request_id().text()));
                }
            };
            if admit.charges.reads_body() {
                // A compressed answer could not be read for its usage: ask for none (an
                // absent field would let the app choose any coding).
                req.headers_mut().insert(
                    http::header::ACCEPT_ENCODING,
                    http::HeaderValue::from_static("identity"),
                );
            }
            let resp = inner.call(req).await?;
            admit.permits.iter_mut().for_each(Permit::responded);
            admit.permits.retain(|p| !p.releases_at_head());
            admit
                .charges
                .head(|name| resp.headers().get(name).map(|v| v.as_bytes()));
            let charges = std::mem::take(&mut admit.charges);
            let mut resp = resp.map(|b| {
                let mut body = PermitBody::new(b, admit.permits);
                body.charge(charges);
                Either::Left(body)
            });
            // `states` is filled only under `headers: always`, so this is a no-op otherwise.
            respond::add_rate_headers(resp.headers_mut(), &admit.states);
            Ok(resp)
        })
    }
}
