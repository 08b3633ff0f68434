//! `spillway injector`: a mutating admission webhook that adds the sidecar to pods as they are
//! created, with the same code as `spillway inject`, for namespaces labelled and pods
//! annotated `spillway.dev/inject: enabled` (a pod annotated `disabled` is left alone).
//!
//! Owns the answer to an AdmissionReview v1 for a pod: a JSONPatch, or none. Reads its
//! settings (image, ports, resources, the name of the limits release each namespace has) from
//! one file, the injector's ConfigMap, at each review: an upgrade is one change there and a
//! rollout. A pod mounts the limits of the release in its own namespace (ConfigMaps do not
//! cross namespaces): `release` of the settings, or the pod's `spillway.dev/release`. Must
//! never: refuse a pod (what it cannot inject is admitted as it is, the reason in a warning to
//! the client and a log line), inject its own namespace or `kube-system`, inject a pod twice,
//! or hold more than a few bounded bodies at once (any pod of the cluster can reach it).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use http::{Method, Request, StatusCode};
use hyper::body::Incoming;
use prometheus::{IntCounterVec, Opts, Registry};
use serde_json::{json, Value as Json};
use tokio::sync::watch;

use super::{inject_one, Options};
use crate::control::server::{self, Body, Running};

/// The label (on a namespace) and annotation (on a pod) that ask for the sidecar.
pub const INJECT: &str = "spillway.dev/inject";
/// Pod annotations that say which container and port the sidecar fronts, and which release
/// of the pod's namespace holds its limits.
pub const CONTAINER: &str = "spillway.dev/container";
pub const PORT: &str = "spillway.dev/port";
pub const RELEASE: &str = "spillway.dev/release";

/// The largest review read: a pod is bounded by etcd's object size, and a CREATE's review
/// carries it once.
const MAX_REVIEW: usize = 3 << 20;
/// The most JSON values (arrays, objects, scalars) a review may hold: a real pod has a few
/// thousand; a body of `[0,0,...]` parses into many times its size.
const MAX_VALUES: usize = 200_000;
/// Reviews read and decided at once; more wait for a turn (up to [`TURN_WAIT`]).
const REVIEWS_AT_ONCE: usize = 4;
/// How long a review waits for a turn, and for its body: well within the webhook's timeout.
const TURN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The pods of `text` (what `kubectl get namespaces,pods -A -o yaml` prints: documents, or
/// a List) that asked for the sidecar, by their namespace's label or their own annotation,
/// and run without it: `failurePolicy: Ignore` admits a pod when the injector is down, and
/// one it could not inject is admitted as it is. Not `skip`'s namespaces (the injector's own),
/// kube-system, or a namespace labelled `disabled`. `namespace/name` each; an error when
/// `text` is not YAML or holds no namespaces.
pub fn uninjected(text: &str, skip: &[&str]) -> Result<Vec<String>, String> {
    use serde::Deserialize as _;
    let mut objects: Vec<Json> = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let doc = Json::deserialize(doc).map_err(|e| format!("document {}: {e}", i + 1))?;
        match doc["items"].as_array() {
            Some(items) => objects.extend(items.iter().cloned()),
            None if doc.is_object() => objects.push(doc),
            None => {}
        }
    }
    let labelled = |value: &str| -> Vec<&str> {
        objects
            .iter()
            .filter(|o| o["kind"] == "Namespace")
            .filter(|o| o["metadata"]["labels"][INJECT] == value)
            .filter_map(|o| o["metadata"]["name"].as_str())
            .collect()
    };
    // As the webhooks see them: a namespace labelled disabled sends no pod to either.
    let (enabled, disabled) = (labelled("enabled"), labelled("disabled"));
    if !objects.iter().any(|o| o["kind"] == "Namespace") {
        return Err(
            "no namespaces in the input: pipe kubectl get namespaces,pods -A -o yaml".into(),
        );
    }
    let mut missing = Vec::new();
    for pod in objects.iter().filter(|o| o["kind"] == "Pod") {
        let meta = &pod["metadata"];
        let namespace = meta["namespace"].as_str().unwrap_or("default");
        let asked = match meta["annotations"][INJECT].as_str() {
            Some("disabled") => false,
            Some("enabled") => true,
            _ => enabled.contains(&namespace),
        };
        let has = ["containers", "initContainers"].iter().any(|list| {
            pod["spec"][list]
                .as_array()
                .is_some_and(|cs| cs.iter().any(|c| c["name"] == super::SIDECAR))
        });
        let seen = namespace != "kube-system" && !skip.contains(&namespace);
        if asked && !has && seen && !disabled.contains(&namespace) {
            missing.push(format!(
                "{namespace}/{}",
                meta["name"].as_str().unwrap_or("?")
            ));
        }
    }
    Ok(missing)
}

/// How the injector runs.
pub struct InjectorOptions {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// HTTPS: the API server calls webhooks over TLS only.
    pub tls: Option<crate::control::tls::ServerTls>,
    /// The injector's settings: [`Options`] as YAML.
    pub config: PathBuf,
    /// The namespace it runs in, never injected.
    pub namespace: String,
}

/// Reads and checks the injector's settings: a sidecar for a pod created from a Deployment
/// needs limits that are not named after the pod (a release's, or a ConfigMap given).
pub fn settings(path: &Path) -> Result<Options, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let opts: Options =
        serde_norway::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if opts.release.is_none() && opts.config_map.is_none() {
        return Err(format!(
            "{}: name the release each namespace holds its limits in (release: <full name>), or a config_map",
            path.display()
        ));
    }
    Ok(opts)
}

/// What was decided of one pod.
#[derive(Debug, PartialEq)]
pub enum Decision {
    /// The JSONPatch that adds the sidecar, and what was done.
    Inject(Json, String),
    /// Left as it is: not asked for, or already injected (nothing to say).
    Leave,
    /// Left as it is though asked for, and why.
    Cannot(String),
}

/// Decides what to do with the pod of an AdmissionReview `request`: `every` when the call came
/// for a namespace that asked for the sidecar (else only a pod annotated so is injected).
pub fn decide(request: &Json, opts: &Options, own: &str, every: bool) -> Decision {
    let namespace = request["namespace"].as_str().unwrap_or_default();
    let pod = &request["object"];
    if request["kind"]["kind"] != "Pod" || request["operation"] != "CREATE" || !pod.is_object() {
        return Decision::Leave;
    }
    if !pod["metadata"].is_object() || !pod["spec"].is_object() {
        return Decision::Cannot("a pod without metadata or spec".into());
    }
    let annotations = &pod["metadata"]["annotations"];
    let asked = annotations[INJECT].as_str();
    if asked == Some("disabled") || !(every || asked == Some("enabled")) {
        return Decision::Leave;
    }
    if namespace == own || namespace == "kube-system" {
        return Decision::Cannot(format!(
            "the injector never injects {namespace:?}: its own namespace or kube-system"
        ));
    }
    let mut opts = opts.clone();
    opts.network_policy = false;
    if let Some(c) = annotations[CONTAINER].as_str() {
        opts.container = Some(c.to_string());
    }
    if let Some(p) = annotations[PORT].as_str() {
        opts.port = Some(p.to_string());
    }
    if let Some(r) = annotations[RELEASE].as_str() {
        // A release's name, as Helm takes it: it becomes a label value and object names.
        let valid = !r.is_empty()
            && r.len() <= 53
            && r.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !r.starts_with('-')
            && !r.ends_with('-');
        if !valid {
            return Decision::Cannot(format!(
                "{RELEASE}: {r:?} is not a release name (lowercase letters, digits and -, at most 53)"
            ));
        }
        opts.release = Some(r.to_string());
        opts.key_secret = None;
    }
    // On the node's network the sidecar would take the node's ports 4180 and 9901, and the
    // second such pod on a node would never start.
    if pod["spec"]["hostNetwork"] == true {
        return Decision::Cannot(
            "a pod on the node's network (hostNetwork): the sidecar would take the node's ports"
                .into(),
        );
    }
    // A pod that ends (a Job's) never completes beside a classic sidecar.
    let restart = pod["spec"]["restartPolicy"].as_str().unwrap_or("Always");
    if restart != "Always" && !opts.native_sidecar {
        return Decision::Cannot(format!(
            "a pod with restartPolicy {restart} (a Job's) would never complete beside a classic sidecar: set native_sidecar: true in the injector's settings (Kubernetes 1.29+)"
        ));
    }
    // A pod of a Deployment has a generated name only: named for the messages.
    let mut named = pod.clone();
    if named["metadata"]["name"].as_str().is_none() {
        let stem = pod["metadata"]["generateName"].as_str().unwrap_or("pod");
        named["metadata"]["name"] = Json::String(format!("{stem}*"));
    }
    let mut doc = match serde_norway::to_value(&named) {
        Ok(d) => d,
        Err(e) => return Decision::Cannot(format!("the pod could not be read: {e}")),
    };
    let mut said = Vec::new();
    let (what, fronted) = match inject_one(&mut doc, &opts, &mut said) {
        Ok((_, fronted)) => (said.pop().unwrap_or_default(), fronted),
        Err(e) => return Decision::Cannot(e),
    };
    if fronted.is_none() {
        // Already injected: the same pod again changes nothing.
        return Decision::Leave;
    }
    let after: Json = match serde_json::to_value(&doc) {
        Ok(a) => a,
        Err(e) => return Decision::Cannot(format!("the injected pod could not be written: {e}")),
    };
    // The spec whole, and the metadata maps inject changed (never the name it was given).
    let patch = json!([
        { "op": "replace", "path": "/spec", "value": after["spec"] },
        { "op": "add", "path": "/metadata/labels", "value": after["metadata"]["labels"] },
        { "op": "add", "path": "/metadata/annotations", "value": after["metadata"]["annotations"] },
    ]);
    Decision::Inject(patch, what)
}

/// The AdmissionReview v1 answering `review`: always allowed, with the patch or the warning.
pub fn answer(review: &Json, decision: &Decision) -> Json {
    let uid = review["request"]["uid"].clone();
    let mut response = json!({ "uid": uid, "allowed": true });
    match decision {
        Decision::Inject(patch, _) => {
            let bytes = serde_json::to_vec(patch).unwrap_or_default();
            response["patchType"] = json!("JSONPatch");
            response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(bytes));
        }
        Decision::Cannot(why) => {
            response["warnings"] = json!([format!("spillway: not injected: {why}")]);
        }
        Decision::Leave => {}
    }
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    })
}

struct State {
    config: PathBuf,
    namespace: String,
    pods: IntCounterVec,
    registry: Registry,
    turns: tokio::sync::Semaphore,
}

/// A review's body within [`MAX_REVIEW`] bytes and [`MAX_VALUES`] values, read within `until`.
async fn read_review(req: Request<Incoming>, until: tokio::time::Instant) -> Result<Json, String> {
    use http_body_util::BodyExt;
    let announced = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if announced.is_some_and(|n| n > MAX_REVIEW) {
        return Err(format!("a review larger than {MAX_REVIEW} bytes"));
    }
    let body = http_body_util::Limited::new(req.into_body(), MAX_REVIEW);
    let bytes = match tokio::time::timeout_at(until, body.collect()).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => return Err(format!("the review could not be read: {e}")),
        Err(_) => return Err("the review came too slowly".into()),
    };
    // Each value but the last is followed by a comma or a closing bracket: counted before
    // parsing, so that a body of tiny values never becomes hundreds of megabytes.
    let values = bytes
        .iter()
        .filter(|b| matches!(b, b',' | b'[' | b'{'))
        .count();
    if values > MAX_VALUES {
        return Err(format!("a review of more than {MAX_VALUES} values"));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("malformed review: {e}"))
}

impl State {
    async fn review(&self, req: Request<Incoming>, every: bool) -> http::Response<Body> {
        let until = tokio::time::Instant::now() + TURN_WAIT;
        let Ok(Ok(_turn)) = tokio::time::timeout_at(until, self.turns.acquire()).await else {
            self.pods.with_label_values(&["busy"]).inc();
            let mut resp = server::error(StatusCode::SERVICE_UNAVAILABLE, "busy; retry");
            resp.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
            return resp;
        };
        let review = match read_review(req, until).await {
            Ok(r) => r,
            Err(e) => return server::error(StatusCode::BAD_REQUEST, &e),
        };
        let request = &review["request"];
        if review["kind"] != "AdmissionReview" || !request.is_object() {
            return server::error(StatusCode::BAD_REQUEST, "not an AdmissionReview");
        }
        let decision = match settings(&self.config) {
            Ok(opts) => decide(request, &opts, &self.namespace, every),
            Err(e) => Decision::Cannot(format!("the injector's settings: {e}")),
        };
        // Debug-quoted: names are the pod's, and must not forge log lines.
        let pod = request["object"]["metadata"]["generateName"]
            .as_str()
            .or(request["object"]["metadata"]["name"].as_str())
            .unwrap_or_default();
        let namespace = request["namespace"].as_str().unwrap_or_default();
        let result = match &decision {
            // Debug-quoted too: what was done names the pod's ports.
            Decision::Inject(_, what) => {
                tracing::info!(pod = ?pod, namespace = ?namespace, done = ?what, "injected");
                "injected"
            }
            Decision::Cannot(why) => {
                tracing::warn!(pod = ?pod, namespace = ?namespace, why = ?why, "not injected");
                "not_injected"
            }
            Decision::Leave => "left",
        };
        self.pods.with_label_values(&[result]).inc();
        server::json(StatusCode::OK, &answer(&review, &decision))
    }
}

/// Starts the webhook (`POST /inject` for namespaces that asked, `POST /inject-annotated`
/// for pods that may) and its admin listener (`/metrics`, `/healthz`, `/readyz`).
pub async fn start(opts: InjectorOptions) -> std::io::Result<Running> {
    // A bad settings file stops the start: the pods it would admit uninjected are many.
    settings(&opts.config).map_err(std::io::Error::other)?;
    let listener = server::bind(opts.listen, "injector").await?;
    let admin = server::bind(opts.admin, "admin").await?;
    let (addr, admin_addr) = (listener.local_addr()?, admin.local_addr()?);
    let registry = Registry::new();
    crate::metrics::register_process(&registry);
    let pods = IntCounterVec::new(
        Opts::new(
            "spillway_injector_pods_total",
            "Pods reviewed, by result: injected, not_injected (asked for, but could not be: see the log), left (not asked for, or injected already), busy (no turn: the API server's failurePolicy decides).",
        ),
        &["result"],
    )
    .expect("valid metric");
    registry.register(Box::new(pods.clone())).expect("unique");
    let state = Arc::new(State {
        config: opts.config,
        namespace: opts.namespace,
        pods,
        registry,
        turns: tokio::sync::Semaphore::new(REVIEWS_AT_ONCE),
    });
    let (stop, stopped) = watch::channel(false);
    let s = state.clone();
    let api = tokio::spawn(server::serve(
        listener,
        stopped.clone(),
        opts.tls,
        move |req| {
            let s = s.clone();
            async move {
                match (req.method(), req.uri().path()) {
                    (&Method::POST, "/inject") => s.review(req, true).await,
                    (&Method::POST, "/inject-annotated") => s.review(req, false).await,
                    _ => server::error(
                        StatusCode::NOT_FOUND,
                        "POST an AdmissionReview to /inject or /inject-annotated",
                    ),
                }
            }
        },
    ));
    let s = state.clone();
    let admin = tokio::spawn(server::serve(admin, stopped, None, move |req| {
        let s = s.clone();
        async move { server::admin_route(req.uri().path(), || server::render(&s.registry)) }
    }));
    Ok(Running::new(addr, admin_addr, stop, vec![api, admin]))
}

#[cfg(test)]
mod tests;
