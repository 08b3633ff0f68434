//! `spillway inject`: adds the sidecar to Kubernetes workload manifests, as `linkerd inject`
//! does, so that the app needs no change.
//!
//! For each Deployment, StatefulSet or DaemonSet: the sidecar takes the name of the app's
//! served port (Services that target the port by name now reach the sidecar) on a port number
//! of its own; the app's port is renamed; the sidecar forwards to the app's port number on
//! loopback; the app's probes that named the port point at its number (health checks never pass
//! through the limiter). The limits come from a ConfigMap mounted at `/etc/spillway` (a starter
//! one is emitted unless `--config-map` names the user's). Optional: a NetworkPolicy that admits
//! only the sidecar's ports; `--native-sidecar` (Kubernetes 1.29+: an init container with
//! `restartPolicy: Always`, started before the app and stopped after it). Idempotent: a pod
//! that has a `spillway` container is left as it is. Every other document passes through.
//! Must never: change a manifest it cannot inject without saying why.

use serde::Deserialize;
use serde_norway::{Mapping, Value};

/// What `spillway inject` was asked (also the command line's flags).
#[derive(Debug, Clone, clap::Args)]
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
    /// The app container, by name (default: the first).
    #[arg(long)]
    pub container: Option<String>,
    /// The app's served port, by name (default: the container's first).
    #[arg(long)]
    pub port: Option<String>,
    /// The ConfigMap with `spillway.yaml` (default: a starter `<workload>-spillway` is
    /// printed too).
    #[arg(long)]
    pub config_map: Option<String>,
    /// Also print a NetworkPolicy that admits only the sidecar's ports.
    #[arg(long)]
    pub network_policy: bool,
    /// The sidecar as a native sidecar (Kubernetes 1.29+): an init container with
    /// `restartPolicy: Always`, started before the app and stopped after it.
    #[arg(long)]
    pub native_sidecar: bool,
    /// The chart release whose PodMonitor scrapes the sidecar: the value of the pod label
    /// `spillway.dev/sidecar`.
    #[arg(long, default_value = "spillway")]
    pub release: String,
}

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
            native_sidecar: false,
            release: "spillway".into(),
        }
    }
}

/// The sidecar's container name: how an injected pod is recognised.
const SIDECAR: &str = "spillway";
/// The sidecar's preStop pause: endpoints are removed before it drains.
const PRE_STOP: u64 = 5;
/// Requests in flight get this long after SIGTERM (the sidecar's `timeouts.drain`).
const DRAIN: u64 = 25;

/// Injects every workload of `text` (one or more YAML documents); the documents out, in order,
/// with the emitted ConfigMaps and NetworkPolicies after their workloads.
pub fn inject(text: &str, opts: &Options) -> Result<String, String> {
    let mut out: Vec<Value> = Vec::new();
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
                let extra = inject_one(&mut item, opts)
                    .map_err(|e| format!("document {}, item {}: {e}", i + 1, j + 1))?;
                injected.push(item);
                injected.extend(extra);
            }
            if let Some(m) = doc.as_mapping_mut() {
                m.insert(key("items"), Value::Sequence(injected));
            }
            Vec::new()
        } else {
            inject_one(&mut doc, opts).map_err(|e| format!("document {}: {e}", i + 1))?
        };
        out.push(doc);
        out.extend(extra);
    }
    let mut text = String::new();
    for (i, doc) in out.iter().enumerate() {
        if i > 0 {
            text.push_str("---\n");
        }
        text.push_str(&serde_norway::to_string(doc).map_err(|e| e.to_string())?);
    }
    Ok(text)
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

/// The item of `list` whose `name` is `name`, or the first when no name is given.
fn named_or_first<'a>(list: &'a mut [Value], name: Option<&str>) -> Option<&'a mut Value> {
    match name {
        Some(n) => list.iter_mut().find(|x| str_of(x, &["name"]) == Some(n)),
        None => list.first_mut(),
    }
}

fn yaml(text: &str) -> Value {
    serde_norway::from_str(text).expect("a literal of this module, its strings quoted by `q`")
}

/// `s` as a quoted scalar, whatever it holds (a JSON string is a YAML one): names and images
/// from the manifest or the command line are pasted into this module's literals.
fn q(s: &str) -> String {
    serde_json::to_string(s).expect("a string serialises")
}

/// Injects one document when it is a workload; the documents to emit after it.
fn inject_one(doc: &mut Value, opts: &Options) -> Result<Vec<Value>, String> {
    let kind = str_of(doc, &["kind"]).unwrap_or_default().to_string();
    if !matches!(kind.as_str(), "Deployment" | "StatefulSet" | "DaemonSet") {
        return Ok(Vec::new());
    }
    let name = str_of(doc, &["metadata", "name"])
        .ok_or("a workload without metadata.name")?
        .to_string();
    let namespace = str_of(doc, &["metadata", "namespace"]).map(str::to_string);
    let pod = get(doc, &["spec", "template", "spec"]).ok_or("no spec.template.spec")?;
    let named = |list: &str| {
        get(pod, &[list])
            .and_then(Value::as_sequence)
            .is_some_and(|s| s.iter().any(|c| str_of(c, &["name"]) == Some(SIDECAR)))
    };
    if named("containers") || named("initContainers") {
        return Ok(Vec::new());
    }
    let what = format!("{kind} {name}");
    let selector = get(doc, &["spec", "selector", "matchLabels"]).cloned();
    let spec = map_at(doc, &["spec", "template", "spec"])?;

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
    let containers = seq_at(spec, "containers")?;
    let app = named_or_first(containers, opts.container.as_deref()).ok_or_else(|| {
        match &opts.container {
            Some(c) => format!("{what}: no container named {c}"),
            None => format!("{what}: no containers"),
        }
    })?;
    let app_name = str_of(app, &["name"]).unwrap_or("app").to_string();
    let ports = app
        .get_mut("ports")
        .and_then(Value::as_sequence_mut)
        .ok_or_else(|| {
            format!("{what}: container {app_name} declares no port to put the sidecar in front of")
        })?;
    let served = named_or_first(ports, opts.port.as_deref()).ok_or_else(|| match &opts.port {
        Some(p) => format!("{what}: container {app_name} has no port named {p}"),
        None => format!("{what}: container {app_name} declares no port"),
    })?;
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
            yaml(&format!("sleep: {{ seconds: {} }}", PRE_STOP + 5)),
        );
    }

    // An object's name is at most 253 characters; a workload's may already be.
    let ours = format!("{}-spillway", name.chars().take(244).collect::<String>());
    let config_map = opts.config_map.clone().unwrap_or_else(|| ours.clone());
    let mut sidecar = yaml(&format!(
        r#"
name: {SIDECAR}
image: {image}
args: ["proxy", "--config", "/etc/spillway/spillway.yaml"]
env:
  - {{ name: RUST_LOG, value: info }}
  - {{ name: SPILLWAY_LOG_FORMAT, value: json }}
ports:
  - {{ name: {port}, containerPort: {proxy}, protocol: TCP }}
  - {{ name: spillway-admin, containerPort: {admin}, protocol: TCP }}
readinessProbe: {{ httpGet: {{ path: /readyz, port: {admin} }}, periodSeconds: 5 }}
livenessProbe: {{ httpGet: {{ path: /healthz, port: {admin} }}, periodSeconds: 10 }}
lifecycle: {{ preStop: {{ sleep: {{ seconds: {PRE_STOP} }} }} }}
resources:
  requests: {{ cpu: 100m, memory: 32Mi }}
  limits: {{ cpu: "1", memory: 128Mi }}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities: {{ drop: [ALL] }}
volumeMounts:
  - {{ name: spillway-config, mountPath: /etc/spillway, readOnly: true }}
"#,
        image = q(&opts.image),
        port = q(&port_name),
        proxy = opts.proxy_port,
        admin = opts.admin_port,
    ));
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
    let grace = PRE_STOP + DRAIN + 15;
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
    let meta = map_at(doc, &["spec", "template", "metadata"])?;
    map_at_mapping(meta, "labels")?.insert(
        key("spillway.dev/sidecar"),
        Value::String(opts.release.clone()),
    );
    map_at_mapping(meta, "annotations")?
        .insert(key("spillway.dev/injected"), Value::String("true".into()));

    let mut extra = Vec::new();
    let ns = namespace
        .as_deref()
        .map(|n| format!("\n  namespace: {}", q(n)))
        .unwrap_or_default();
    if opts.config_map.is_none() {
        // A port named as Istio names HTTP/2 ones (grpc, grpc-*, http2, h2c): the app speaks
        // HTTP/2 in clear text.
        let h2 = !port_name.starts_with("grpc-web")
            && ["grpc", "http2", "h2c"]
                .iter()
                .any(|p| port_name == *p || port_name.starts_with(&format!("{p}-")));
        let scheme = if h2 { "h2c" } else { "http" };
        let config = format!(
            "# Written by spillway inject: the ports match the injected sidecar. Add rules below;\n# the sidecar reloads this file when the ConfigMap changes.\nservice: {}\nlisten: 0.0.0.0:{}\nadmin: 0.0.0.0:{}\nupstream: {scheme}://127.0.0.1:{app_port}\nrules: []\n",
            // A service name is at most 64 characters; a workload's may be 253.
            q(&name.chars().take(64).collect::<String>()),
            opts.proxy_port,
            opts.admin_port
        );
        let mut cm = yaml(&format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {}{ns}\ndata: {{}}\n",
            q(&config_map)
        ));
        map_at(&mut cm, &["data"])?.insert(key("spillway.yaml"), Value::String(config));
        extra.push(cm);
    }
    if opts.network_policy {
        let selector = selector.ok_or_else(|| {
            format!("{what}: --network-policy needs spec.selector.matchLabels to select the pods")
        })?;
        let mut np = yaml(&format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: {}{ns}\nspec:\n  policyTypes: [Ingress]\n  ingress:\n    - ports:\n        - {{ port: {}, protocol: TCP }}\n        - {{ port: {}, protocol: TCP }}\n",
            q(&ours),
            opts.proxy_port,
            opts.admin_port
        ));
        map_at(&mut np, &["spec", "podSelector"])?.insert(key("matchLabels"), selector);
        extra.push(np);
    }
    Ok(extra)
}

#[cfg(test)]
mod tests;
