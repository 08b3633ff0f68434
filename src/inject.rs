//! `spillway inject`: adds the sidecar to Kubernetes workload manifests, as `linkerd inject`
//! does, so that the app needs no change.
//!
//! For each Deployment, StatefulSet, DaemonSet, ReplicaSet or bare Pod (a Job or CronJob only
//! as a native sidecar, which lets it complete): the sidecar fronts one served port, the one
//! named `http` or `--port` (an ambiguous pod is refused, naming the fix); it takes that port's
//! name on a number of its own, the app's port is renamed, and the sidecar forwards to the
//! app's number on loopback; probes and hooks that named the port go to its number. A Service
//! of the input that targets the app's number is pointed at the name. The limits come from a
//! ConfigMap mounted at `/etc/spillway`. Optional: a NetworkPolicy that shuts only the fronted
//! port's bypass. Idempotent. Every other document passes through; each workload gets a line
//! of [`Injected::summary`] (injected, ports fronted and not, or skipped and why).
//! Must never: change a manifest it cannot inject without saying why.

use serde::Deserialize;
use serde_norway::{Mapping, Value};

/// What `spillway inject` was asked (also the command line's flags, and the injector's
/// configuration file, field for field).
#[derive(Debug, Clone, clap::Args, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Options {
    /// The sidecar's image.
    #[arg(long, default_value = IMAGE)]
    pub image: String,
    /// The port number the sidecar listens on; it takes the name of the app's port.
    #[arg(long, default_value_t = PROXY_PORT)]
    pub proxy_port: u16,
    /// The sidecar's admin port (metrics, probes).
    #[arg(long, default_value_t = ADMIN_PORT)]
    pub admin_port: u16,
    /// The app container, by name (default: the one with the served port).
    #[arg(long)]
    pub container: Option<String>,
    /// The port the sidecar fronts, by name (default: the one named `http`, or a container's
    /// only port).
    #[arg(long)]
    pub port: Option<String>,
    /// The ConfigMap with `spillway.yaml` (default: a starter `<workload>-spillway` is
    /// printed too).
    #[arg(long)]
    pub config_map: Option<String>,
    /// Also print a NetworkPolicy that shuts the fronted port's bypass: the pod's other
    /// ports stay open, the sidecar's admin port admits `--scrape-namespace` only.
    #[arg(long)]
    pub network_policy: bool,
    /// The namespace Prometheus scrapes from (the NetworkPolicy's admin port).
    #[arg(long, default_value = "monitoring")]
    pub scrape_namespace: String,
    /// The sidecar as a native sidecar (Kubernetes 1.29+): an init container with
    /// `restartPolicy: Always`, started before the app and stopped after it.
    #[arg(long)]
    pub native_sidecar: bool,
    /// The chart release (its full name) whose limits the sidecar takes: its ConfigMap
    /// `<release>-limits` and Secret `<release>-key-secret` are mounted (no starter
    /// ConfigMap), and its PodMonitor scrapes the pod (the label `spillway.dev/sidecar`).
    #[arg(long)]
    pub release: Option<String>,
    /// With `--release`: the Secret with this service's control-plane token (key `token`),
    /// mounted when it exists.
    #[arg(long, default_value = "spillway-token")]
    pub token_secret: String,
    /// The key of `--token-secret` that holds the token (the chart's per-service tokens
    /// Secret keys each by its service).
    #[arg(long, default_value = "token")]
    pub token_key: String,
    /// With `--release`: the Secret with the control plane's `ca.crt` (the release's
    /// `controlPlane.tls.existingSecret`), for an `https://` control plane.
    #[arg(long)]
    pub ca_secret: Option<String>,
    /// With `--release`: the Secret the release's keys are digested under (its
    /// `sidecar.keySecret.existingSecret`; default `<release>-key-secret`).
    #[arg(long)]
    pub key_secret: Option<String>,
    /// The pause before the sidecar drains (its `preStop`), as the release's
    /// `sidecar.preStopSeconds`.
    #[arg(long, default_value_t = PRE_STOP)]
    pub pre_stop_seconds: u64,
    /// The drain the sidecar's configuration gives (`timeouts.drain`, the release's
    /// `sidecar.drainSeconds`): the pod's grace period covers it.
    #[arg(long, default_value_t = DRAIN)]
    pub drain_seconds: u64,
    /// The sidecar's resources (requests and limits, as Kubernetes takes them), over the
    /// default; from the injector's configuration only.
    #[arg(skip)]
    pub resources: Option<Value>,
    /// The sidecar's security context, over the chart's hardened one; from the injector's
    /// configuration only.
    #[arg(skip)]
    pub security_context: Option<Value>,
}

/// The image the release workflow publishes for this version (.github/workflows/release.yml),
/// which the chart defaults to as well (`image.repository` at its `appVersion`).
const IMAGE: &str = concat!("ghcr.io/spillway/spillway:", env!("CARGO_PKG_VERSION"));
const PROXY_PORT: u16 = 4180;
const ADMIN_PORT: u16 = 9901;

impl Default for Options {
    /// The command line's defaults.
    fn default() -> Self {
        Options {
            image: IMAGE.to_string(),
            proxy_port: PROXY_PORT,
            admin_port: ADMIN_PORT,
            container: None,
            port: None,
            config_map: None,
            network_policy: false,
            scrape_namespace: "monitoring".into(),
            native_sidecar: false,
            release: None,
            token_secret: "spillway-token".into(),
            token_key: "token".into(),
            ca_secret: None,
            key_secret: None,
            pre_stop_seconds: PRE_STOP,
            drain_seconds: DRAIN,
            resources: None,
            security_context: None,
        }
    }
}

/// The sidecar's container name: how an injected pod is recognised.
const SIDECAR: &str = "spillway";
/// The sidecar's preStop pause: endpoints are removed before it drains.
const PRE_STOP: u64 = 5;
/// Requests in flight get this long after SIGTERM (the sidecar's `timeouts.drain`).
const DRAIN: u64 = 25;

/// What [`inject`] made: the documents, and a line per workload saying what was done.
#[derive(Debug)]
pub struct Injected {
    pub text: String,
    pub summary: Vec<String>,
}

/// An injected pod's fronted port, for the Services of the input that target it.
struct Fronted {
    namespace: Option<String>,
    labels: Mapping,
    app_port: u64,
    name: String,
}

/// Injects every workload of `text` (one or more YAML documents); the documents out, in order,
/// with the emitted ConfigMaps and NetworkPolicies after their workloads, and Services that
/// targeted an injected app's port number pointed at the sidecar.
pub fn inject(text: &str, opts: &Options) -> Result<Injected, String> {
    let mut out: Vec<Value> = Vec::new();
    let mut summary = Vec::new();
    let mut fronted = Vec::new();
    let mut step = |doc: &mut Value, summary: &mut Vec<String>| -> Result<Vec<Value>, String> {
        let (extra, front) = inject_one(doc, opts, summary)?;
        fronted.extend(front);
        Ok(extra)
    };
    for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let mut doc = Value::deserialize(doc).map_err(|e| format!("document {}: {e}", i + 1))?;
        if doc.is_null() {
            continue;
        }
        let extra = if str_of(&doc, &["kind"]) == Some("List") {
            // What `kubectl get ... -o yaml` prints for several objects: each item, and what
            // is emitted for it, stays in the list.
            let items = get(&doc, &["items"])
                .and_then(Value::as_sequence)
                .cloned()
                .unwrap_or_default();
            let mut injected = Vec::new();
            for (j, mut item) in items.into_iter().enumerate() {
                let extra = step(&mut item, &mut summary)
                    .map_err(|e| format!("document {}, item {}: {e}", i + 1, j + 1))?;
                injected.push(item);
                injected.extend(extra);
            }
            if let Some(m) = doc.as_mapping_mut() {
                m.insert(key("items"), Value::Sequence(injected));
            }
            Vec::new()
        } else {
            step(&mut doc, &mut summary).map_err(|e| format!("document {}: {e}", i + 1))?
        };
        out.push(doc);
        out.extend(extra);
    }
    for doc in &mut out {
        if str_of(doc, &["kind"]) == Some("List") {
            for item in doc
                .get_mut("items")
                .and_then(Value::as_sequence_mut)
                .into_iter()
                .flatten()
            {
                retarget(item, &fronted, &mut summary);
            }
        } else {
            retarget(doc, &fronted, &mut summary);
        }
    }
    let mut text = String::new();
    for (i, doc) in out.iter().enumerate() {
        if i > 0 {
            text.push_str("---\n");
        }
        text.push_str(&serde_norway::to_string(doc).map_err(|e| e.to_string())?);
    }
    Ok(Injected { text, summary })
}

/// Points a Service's ports that target an injected app's port by number (or, with no
/// `targetPort`, by their own number) at the port's name, which the sidecar now has: else
/// its traffic would go round the limiter.
fn retarget(doc: &mut Value, fronted: &[Fronted], summary: &mut Vec<String>) {
    if str_of(doc, &["kind"]) != Some("Service") {
        return;
    }
    let name = str_of(doc, &["metadata", "name"])
        .unwrap_or("?")
        .to_string();
    let namespace = str_of(doc, &["metadata", "namespace"]).map(str::to_string);
    let Some(selector) = get(doc, &["spec", "selector"]).and_then(Value::as_mapping) else {
        return;
    };
    if selector.is_empty() {
        return;
    }
    let Some(f) = fronted.iter().find(|f| {
        f.namespace == namespace && selector.iter().all(|(k, v)| f.labels.get(k) == Some(v))
    }) else {
        return;
    };
    let (app_port, port_name) = (f.app_port, f.name.clone());
    let ports = doc
        .get_mut("spec")
        .and_then(|s| s.get_mut("ports"))
        .and_then(Value::as_sequence_mut);
    for port in ports.into_iter().flatten() {
        let target = port
            .get("targetPort")
            .or_else(|| port.get("port"))
            .and_then(Value::as_u64);
        if target != Some(app_port) {
            continue;
        }
        if let Some(m) = port.as_mapping_mut() {
            m.insert(key("targetPort"), Value::String(port_name.clone()));
            summary.push(format!(
                "Service {name}: targetPort {app_port} is now {port_name} (the sidecar); it reached the app round the limiter"
            ));
        }
    }
}

fn key(k: &str) -> Value {
    Value::String(k.to_string())
}

fn get<'a>(v: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, k| v.get(*k))
}

fn str_of<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    get(v, path).and_then(Value::as_str)
}

/// The mapping at `path` in `v`, made (empty) where missing.
fn map_at<'a>(v: &'a mut Value, path: &[&str]) -> Result<&'a mut Mapping, String> {
    let mut v = v;
    for k in path {
        let m = v
            .as_mapping_mut()
            .ok_or_else(|| format!("{k}: expected a mapping"))?;
        v = m
            .entry(key(k))
            .or_insert_with(|| Value::Mapping(Mapping::new()));
        if v.is_null() {
            *v = Value::Mapping(Mapping::new());
        }
    }
    v.as_mapping_mut()
        .ok_or_else(|| format!("{}: expected a mapping", path.join(".")))
}

/// The value under `k` in `m`, made `empty` where missing or null.
fn entry<'a>(m: &'a mut Mapping, k: &str, empty: Value) -> &'a mut Value {
    let v = m.entry(key(k)).or_insert(Value::Null);
    if v.is_null() {
        *v = empty;
    }
    v
}

/// The sequence under `k` in `m`, made (empty) where missing.
fn seq_at<'a>(m: &'a mut Mapping, k: &str) -> Result<&'a mut Vec<Value>, String> {
    entry(m, k, Value::Sequence(Vec::new()))
        .as_sequence_mut()
        .ok_or_else(|| format!("{k}: expected a list"))
}

/// The mapping under `k` in `m`, made (empty) where missing.
fn map_at_mapping<'a>(m: &'a mut Mapping, k: &str) -> Result<&'a mut Mapping, String> {
    entry(m, k, Value::Mapping(Mapping::new()))
        .as_mapping_mut()
        .ok_or_else(|| format!("{k}: expected a mapping"))
}

fn yaml(text: &str) -> Value {
    serde_norway::from_str(text).expect("a literal of this module, its strings quoted by `q`")
}

/// `s` as a quoted scalar, whatever it holds: names and images from the manifest or the
/// command line are pasted into this module's literals. A JSON string is a YAML one, once the
/// characters YAML does not print (DEL, C1 controls) are escaped too.
fn q(s: &str) -> String {
    let json = serde_json::to_string(s).expect("a string serialises");
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_control() || matches!(c, '\u{FFFE}' | '\u{FFFF}') {
            out.push_str(&format!("\\u{:04X}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// Where a kind's pod spec and pod metadata are, and whether its pods must end (a Job's).
fn pod_paths(kind: &str) -> Option<(&'static [&'static str], &'static [&'static str], bool)> {
    Some(match kind {
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" => (
            &["spec", "template", "spec"][..],
            &["spec", "template", "metadata"][..],
            false,
        ),
        "Job" => (
            &["spec", "template", "spec"][..],
            &["spec", "template", "metadata"][..],
            true,
        ),
        "CronJob" => (
            &["spec", "jobTemplate", "spec", "template", "spec"][..],
            &["spec", "jobTemplate", "spec", "template", "metadata"][..],
            true,
        ),
        "Pod" => (&["spec"][..], &["metadata"][..], false),
        _ => return None,
    })
}

/// Port names that say a port is not the app's served one.
fn not_served(name: &str) -> bool {
    [
        "metrics",
        "prometheus",
        "admin",
        "health",
        "management",
        "debug",
        "pprof",
    ]
    .iter()
    .any(|n| name == *n || name.starts_with(&format!("{n}-")))
}

/// A port for the summary: `name (number)` or the number.
fn show_port(p: &Value) -> String {
    let number = get(p, &["containerPort"])
        .and_then(Value::as_u64)
        .unwrap_or(0);
    match str_of(p, &["name"]) {
        Some(n) => format!("{n} ({number})"),
        None => number.to_string(),
    }
}

/// Which container and which of its ports the sidecar fronts: `--container` / `--port`, else
/// the port named `http`, else a lone container's lone served port; an ambiguous pod is an
/// error naming the flags.
fn served(spec: &Mapping, what: &str, opts: &Options) -> Result<(usize, usize), String> {
    let containers: &[Value] = spec
        .get("containers")
        .and_then(Value::as_sequence)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let ports_of = |c: &Value| -> Vec<Value> {
        get(c, &["ports"])
            .and_then(Value::as_sequence)
            .cloned()
            .unwrap_or_default()
    };
    let name_of = |c: &Value| str_of(c, &["name"]).unwrap_or("?").to_string();
    let wanted = opts.port.as_deref().unwrap_or("http");
    let has = |c: &Value| {
        ports_of(c)
            .iter()
            .any(|p| str_of(p, &["name"]) == Some(wanted))
    };
    let app = match &opts.container {
        Some(n) => containers
            .iter()
            .position(|c| str_of(c, &["name"]) == Some(n))
            .ok_or_else(|| format!("{what}: no container named {n}"))?,
        None => {
            let with: Vec<usize> = (0..containers.len())
                .filter(|&i| has(&containers[i]))
                .collect();
            match (with.as_slice(), containers.len()) {
                ([one], _) => *one,
                ([], 1) => 0,
                ([], 0) => return Err(format!("{what}: no containers")),
                ([], _) => {
                    let names: Vec<String> = containers.iter().map(name_of).collect();
                    return Err(format!(
                        "{what}: none of its containers ({}) has a port named {wanted}: name the app's with --container and its port with --port",
                        names.join(", ")
                    ));
                }
                (_, _) => {
                    return Err(format!(
                        "{what}: several containers have a port named {wanted}: name the app's with --container"
                    ))
                }
            }
        }
    };
    let c = &containers[app];
    let app_name = name_of(c);
    let ports = ports_of(c);
    if ports.is_empty() {
        return Err(format!(
            "{what}: container {app_name} declares no port to put the sidecar in front of; declare the one it serves (named http) and inject again"
        ));
    }
    if let Some(i) = ports
        .iter()
        .position(|p| str_of(p, &["name"]) == Some(wanted))
    {
        return Ok((app, i));
    }
    if opts.port.is_some() {
        return Err(format!(
            "{what}: container {app_name} has no port named {wanted}"
        ));
    }
    let listed: Vec<String> = ports.iter().map(show_port).collect();
    match ports.as_slice() {
        [one] if str_of(one, &["name"]).is_none_or(|n| !not_served(n)) => Ok((app, 0)),
        _ => Err(format!(
            "{what}: container {app_name} declares {} and none is named http: name the one the sidecar fronts with --port (or name it http)",
            listed.join(", ")
        )),
    }
}

/// The sidecar container just added to `spec`.
fn sidecar_of(spec: &mut Mapping, native: bool) -> Result<&mut Mapping, String> {
    let list = if native {
        "initContainers"
    } else {
        "containers"
    };
    seq_at(spec, list)?
        .iter_mut()
        .find(|c| str_of(c, &["name"]) == Some(SIDECAR))
        .and_then(Value::as_mapping_mut)
        .ok_or_else(|| "the sidecar went missing".to_string())
}

/// Injects one document when it is a workload, saying what was done in `summary`; the
/// documents to emit after it, and what it fronts.
fn inject_one(
    doc: &mut Value,
    opts: &Options,
    summary: &mut Vec<String>,
) -> Result<(Vec<Value>, Option<Fronted>), String> {
    let kind = str_of(doc, &["kind"]).unwrap_or_default().to_string();
    let Some((spec_path, meta_path, ends)) = pod_paths(&kind) else {
        return Ok((Vec::new(), None));
    };
    let name = str_of(doc, &["metadata", "name"])
        .ok_or_else(|| format!("a {kind} without metadata.name"))?
        .to_string();
    let namespace = str_of(doc, &["metadata", "namespace"]).map(str::to_string);
    // Debug-quoted: a name is the manifest's, and may hold anything.
    let what = format!("{kind} {name:?}");
    let pod = get(doc, spec_path).ok_or_else(|| format!("{what}: no {}", spec_path.join(".")))?;
    let named = |list: &str| {
        get(pod, &[list])
            .and_then(Value::as_sequence)
            .is_some_and(|s| s.iter().any(|c| str_of(c, &["name"]) == Some(SIDECAR)))
    };
    if named("containers") || named("initContainers") {
        summary.push(format!(
            "{what}: skipped: it has a spillway container already"
        ));
        return Ok((Vec::new(), None));
    }
    if ends && !opts.native_sidecar {
        summary.push(format!(
            "{what}: skipped: a classic sidecar never exits, so its pods would never complete; inject it with --native-sidecar (Kubernetes 1.29+)"
        ));
        return Ok((Vec::new(), None));
    }
    let labels = get(doc, meta_path)
        .and_then(|m| m.get("labels"))
        .and_then(Value::as_mapping)
        .cloned()
        .unwrap_or_default();
    let selector = get(doc, &["spec", "selector", "matchLabels"])
        .filter(|_| kind != "Job" && kind != "CronJob" && kind != "Pod")
        .and_then(Value::as_mapping)
        .cloned()
        .unwrap_or_else(|| labels.clone());
    let spec = map_at(doc, spec_path)?;

    // Every port number the pod uses, for a clash with the sidecar's.
    let mut used = Vec::new();
    for list in ["containers", "initContainers"] {
        for c in spec
            .get(list)
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            for p in c
                .get("ports")
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
            {
                used.extend(p.get("containerPort").and_then(Value::as_u64));
            }
        }
    }
    for port in [opts.proxy_port, opts.admin_port] {
        if used.contains(&u64::from(port)) {
            return Err(format!(
                "{what}: port {port} is the app's; give the sidecar another (--proxy-port, --admin-port)"
            ));
        }
    }

    // Every port name of the pod: the app's renamed port must not take one of them.
    let taken: Vec<String> = ["containers", "initContainers"]
        .iter()
        .filter_map(|list| spec.get(*list).and_then(Value::as_sequence))
        .flatten()
        .filter_map(|c| get(c, &["ports"]).and_then(Value::as_sequence))
        .flatten()
        .filter_map(|p| str_of(p, &["name"]).map(str::to_string))
        .collect();
    let (app_at, port_at) = served(spec, &what, opts)?;
    // What stays unfronted: every other port the pod declares.
    let mut others: Vec<Value> = Vec::new();
    for (i, c) in seq_at(spec, "containers")?.iter().enumerate() {
        for (j, p) in get(c, &["ports"])
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
            .enumerate()
        {
            if (i, j) != (app_at, port_at) {
                others.push(p.clone());
            }
        }
    }
    let containers = seq_at(spec, "containers")?;
    let app = &mut containers[app_at];
    let app_name = str_of(app, &["name"]).unwrap_or("app").to_string();
    let served = app
        .get_mut("ports")
        .and_then(Value::as_sequence_mut)
        .and_then(|p| p.get_mut(port_at))
        .ok_or("the served port went missing")?;
    let port_name = str_of(served, &["name"])
        .ok_or_else(|| {
            format!(
                "{what}: the served port has no name, so a Service reaches it by number and would bypass the sidecar; name it (e.g. http), target it by name, and inject again"
            )
        })?
        .to_string();
    let app_port = get(served, &["containerPort"])
        .and_then(Value::as_u64)
        .ok_or_else(|| format!("{what}: port {port_name} has no containerPort"))?;
    // The app's port keeps its number under a new name; the sidecar takes the old name.
    let renamed: String = format!("app-{port_name}").chars().take(15).collect();
    let renamed = renamed.trim_end_matches('-').to_string();
    if taken.contains(&renamed) {
        return Err(format!(
            "{what}: the app's port {port_name} would be renamed {renamed}, which a port of the pod already has; rename that one and inject again"
        ));
    }
    served
        .as_mapping_mut()
        .ok_or("a port that is not a mapping")?
        .insert(key("name"), Value::String(renamed));
    // Probes and lifecycle hooks that named the port go to its number: health checks and
    // the app's own hooks never pass the limiter.
    for path in [
        &["livenessProbe"][..],
        &["readinessProbe"],
        &["startupProbe"],
        &["lifecycle", "postStart"],
        &["lifecycle", "preStop"],
    ] {
        for handler in ["httpGet", "tcpSocket", "grpc"] {
            let hook = path.iter().try_fold(&mut *app, |v, k| v.get_mut(*k));
            if let Some(p) = hook.and_then(|p| p.get_mut(handler)) {
                if p.get("port").and_then(Value::as_str) == Some(port_name.as_str()) {
                    p.as_mapping_mut()
                        .ok_or("a probe that is not a mapping")?
                        .insert(key("port"), Value::Number(app_port.into()));
                }
            }
        }
    }
    // The app keeps serving while the endpoints drop the pod and the sidecar stops taking
    // requests (both stop at once, or a native sidecar after the app), so a rollout drops none.
    if get(app, &["lifecycle", "preStop"]).is_none() {
        map_at(app, &["lifecycle"])?.insert(
            key("preStop"),
            yaml(&format!(
                "sleep: {{ seconds: {} }}",
                opts.pre_stop_seconds + 5
            )),
        );
    }

    // An object's name is at most 253 characters; a workload's may already be.
    let ours = format!("{}-spillway", name.chars().take(244).collect::<String>());
    let config_map = match (&opts.config_map, &opts.release) {
        (Some(c), _) => c.clone(),
        (None, Some(r)) => format!("{r}-limits"),
        (None, None) => ours.clone(),
    };
    // A port named as Istio names HTTP/2 ones (grpc, grpc-*, http2, h2c): the app speaks
    // HTTP/2 in clear text.
    let h2 = !port_name.starts_with("grpc-web")
        && ["grpc", "http2", "h2c"]
            .iter()
            .any(|p| port_name == *p || port_name.starts_with(&format!("{p}-")));
    let scheme = if h2 { "h2c" } else { "http" };
    // The pod's ports on the command line, over whatever the limits file says: one release's
    // ConfigMap serves every workload injected for it.
    let args = [
        "proxy".to_string(),
        "--config".into(),
        "/etc/spillway/spillway.yaml".into(),
        "--listen".into(),
        format!("0.0.0.0:{}", opts.proxy_port),
        "--admin".into(),
        format!("0.0.0.0:{}", opts.admin_port),
        "--upstream".into(),
        format!("{scheme}://127.0.0.1:{app_port}"),
    ];
    let mut sidecar = yaml(&format!(
        r#"
name: {SIDECAR}
image: {image}
args: {args}
env:
  - {{ name: RUST_LOG, value: info }}
  - {{ name: SPILLWAY_LOG_FORMAT, value: json }}
ports:
  - {{ name: {port}, containerPort: {proxy}, protocol: TCP }}
  - {{ name: spillway-admin, containerPort: {admin}, protocol: TCP }}
readinessProbe: {{ httpGet: {{ path: /readyz, port: {admin} }}, periodSeconds: 5 }}
livenessProbe: {{ httpGet: {{ path: /healthz, port: {admin} }}, periodSeconds: 10 }}
lifecycle: {{ preStop: {{ sleep: {{ seconds: {pre_stop} }} }} }}
resources:
  requests: {{ cpu: 100m, memory: 32Mi }}
  limits: {{ memory: 128Mi }}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities: {{ drop: [ALL] }}
  seccompProfile: {{ type: RuntimeDefault }}
volumeMounts:
  - {{ name: spillway-config, mountPath: /etc/spillway, readOnly: true }}
"#,
        args = serde_json::to_string(&args).expect("strings serialise"),
        pre_stop = opts.pre_stop_seconds,
        image = q(&opts.image),
        port = q(&port_name),
        proxy = opts.proxy_port,
        admin = opts.admin_port,
    ));
    if let Some(r) = &opts.resources {
        sidecar
            .as_mapping_mut()
            .expect("a mapping literal")
            .insert(key("resources"), r.clone());
    }
    if let Some(c) = &opts.security_context {
        sidecar
            .as_mapping_mut()
            .expect("a mapping literal")
            .insert(key("securityContext"), c.clone());
    }
    if opts.native_sidecar {
        sidecar
            .as_mapping_mut()
            .expect("a mapping literal")
            .insert(key("restartPolicy"), Value::String("Always".into()));
        seq_at(spec, "initContainers")?.insert(0, sidecar);
    } else {
        seq_at(spec, "containers")?.push(sidecar);
    }
    seq_at(spec, "volumes")?.push(yaml(&format!(
        "{{ name: spillway-config, configMap: {{ name: {} }} }}",
        q(&config_map)
    )));
    if let Some(release) = &opts.release {
        // What the release's ConfigMap names, where the chart's sidecar has it: the secret keys
        // are digested under, and the control-plane token (when the release reports).
        let mounts = seq_at(sidecar_of(spec, opts.native_sidecar)?, "volumeMounts")?;
        mounts.push(yaml(
            "{ name: spillway-key-secret, mountPath: /var/run/secrets/spillway-key, readOnly: true }",
        ));
        mounts.push(yaml(
            "{ name: spillway-token, mountPath: /var/run/secrets/spillway, readOnly: true }",
        ));
        let volumes = seq_at(spec, "volumes")?;
        let key_secret = opts
            .key_secret
            .clone()
            .unwrap_or_else(|| format!("{release}-key-secret"));
        volumes.push(yaml(&format!(
            "{{ name: spillway-key-secret, secret: {{ secretName: {}, items: [{{ key: secret, path: secret }}] }} }}",
            q(&key_secret)
        )));
        volumes.push(yaml(&format!(
            "{{ name: spillway-token, secret: {{ secretName: {}, optional: true, items: [{{ key: {}, path: token }}] }} }}",
            q(&opts.token_secret),
            q(&opts.token_key)
        )));
        if let Some(ca) = &opts.ca_secret {
            seq_at(sidecar_of(spec, opts.native_sidecar)?, "volumeMounts")?.push(yaml(
                "{ name: spillway-tls, mountPath: /var/run/secrets/spillway-tls, readOnly: true }",
            ));
            seq_at(spec, "volumes")?.push(yaml(&format!(
                "{{ name: spillway-tls, secret: {{ secretName: {}, items: [{{ key: ca.crt, path: ca.crt }}] }} }}",
                q(ca)
            )));
        }
    }
    let grace = opts.pre_stop_seconds + opts.drain_seconds + 15;
    let current = spec
        .get("terminationGracePeriodSeconds")
        .and_then(Value::as_u64)
        .unwrap_or(30);
    if current < grace {
        spec.insert(
            key("terminationGracePeriodSeconds"),
            Value::Number(grace.into()),
        );
    }
    let meta = map_at(doc, meta_path)?;
    map_at_mapping(meta, "labels")?.insert(
        key("spillway.dev/sidecar"),
        Value::String(opts.release.clone().unwrap_or_else(|| "spillway".into())),
    );
    map_at_mapping(meta, "annotations")?
        .insert(key("spillway.dev/injected"), Value::String("true".into()));

    let mut extra = Vec::new();
    let ns = namespace
        .as_deref()
        .map(|n| format!("\n  namespace: {}", q(n)))
        .unwrap_or_default();
    if opts.config_map.is_none() && opts.release.is_none() {
        let config = format!(
            "# Written by spillway inject: the ports match the injected sidecar. Add rules below;\n# the sidecar reloads this file when the ConfigMap changes.\nservice: {}\nlisten: 0.0.0.0:{}\nadmin: 0.0.0.0:{}\nupstream: {scheme}://127.0.0.1:{app_port}\ntimeouts: {{ drain: {}s }}\nrules: []\n",
            // A service name is at most 64 characters; a workload's may be 253.
            q(&name.chars().take(64).collect::<String>()),
            opts.proxy_port,
            opts.admin_port,
            opts.drain_seconds
        );
        let mut cm = yaml(&format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {}{ns}\ndata: {{}}\n",
            q(&config_map)
        ));
        map_at(&mut cm, &["data"])?.insert(key("spillway.yaml"), Value::String(config));
        extra.push(cm);
    }
    let mut open: Vec<u64> = others
        .iter()
        .filter_map(|p| get(p, &["containerPort"]).and_then(Value::as_u64))
        .filter(|p| *p != app_port)
        .collect();
    open.sort_unstable();
    open.dedup();
    if opts.network_policy {
        if selector.is_empty() {
            return Err(format!(
                "{what}: --network-policy needs labels on its pods to select them"
            ));
        }
        // Ingress is shut but for what is listed: the sidecar's port and the pod's other
        // ports from anywhere, the admin port from the scraping namespace (probes come from
        // the node, which NetworkPolicies do not hold back in common CNIs); the app's
        // fronted number, the way round the limiter, from nowhere.
        let mut ports = vec![format!("{{ port: {}, protocol: TCP }}", opts.proxy_port)];
        ports.extend(
            open.iter()
                .map(|p| format!("{{ port: {p}, protocol: TCP }}")),
        );
        let mut np = yaml(&format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: {}{ns}\nspec:\n  policyTypes: [Ingress]\n  ingress:\n    - ports: [{}]\n    - from: [{{ namespaceSelector: {{ matchLabels: {{ kubernetes.io/metadata.name: {} }} }} }}]\n      ports: [{{ port: {}, protocol: TCP }}]\n",
            q(&ours),
            ports.join(", "),
            q(&opts.scrape_namespace),
            opts.admin_port
        ));
        map_at(&mut np, &["spec", "podSelector"])?
            .insert(key("matchLabels"), Value::Mapping(selector));
        extra.push(np);
    }
    let unfronted: Vec<String> = others.iter().map(show_port).collect();
    summary.push(format!(
        "{what}: injected: container {app_name:?} port {port_name} ({app_port}) is fronted by the sidecar on {}; not fronted: {}",
        opts.proxy_port,
        if unfronted.is_empty() {
            "none".to_string()
        } else {
            unfronted.join(", ")
        }
    ));
    Ok((
        extra,
        Some(Fronted {
            namespace,
            labels,
            app_port,
            name: port_name,
        }),
    ))
}

pub mod webhook;

#[cfg(test)]
mod tests;
