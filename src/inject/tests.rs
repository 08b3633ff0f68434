use super::*;

const APP: &str = r#"
apiVersion: v1
kind: Service
metadata: { name: shop }
spec:
  selector: { app: shop }
  ports: [{ port: 80, targetPort: http }]
---
apiVersion: apps/v1
kind: Deployment
metadata: { name: shop, namespace: web }
spec:
  selector: { matchLabels: { app: shop } }
  template:
    metadata: { labels: { app: shop } }
    spec:
      containers:
        - name: shop
          image: shop:1
          ports: [{ name: http, containerPort: 8080 }]
          readinessProbe: { httpGet: { path: /ready, port: http } }
          livenessProbe: { tcpSocket: { port: http } }
"#;

fn docs(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap())
        .collect()
}

fn pod(doc: &Value) -> &Value {
    get(doc, &["spec", "template", "spec"]).unwrap()
}

fn container<'a>(pod: &'a Value, list: &str, name: &str) -> &'a Value {
    pod[list]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no {name} in {list}"))
}

#[test]
fn the_sidecar_takes_the_port_name_and_the_app_keeps_its_number_and_probes() {
    let out = docs(&inject(APP, &Options::default()).unwrap().text);
    let kinds: Vec<&str> = out.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["Service", "Deployment", "ConfigMap"]);
    assert_eq!(out[0], docs(APP)[0], "other documents pass through");
    let pod = pod(&out[1]);
    let app = container(pod, "containers", "shop");
    assert_eq!(app["ports"][0]["name"], "app-http");
    assert_eq!(app["ports"][0]["containerPort"], 8080);
    assert_eq!(app["readinessProbe"]["httpGet"]["port"], 8080);
    assert_eq!(app["livenessProbe"]["tcpSocket"]["port"], 8080);
    let sidecar = container(pod, "containers", "spillway");
    assert_eq!(
        sidecar["ports"][0]["name"], "http",
        "Services by name reach the sidecar"
    );
    assert_eq!(sidecar["ports"][0]["containerPort"], 4180);
    assert_eq!(pod["volumes"][0]["configMap"]["name"], "shop-spillway");
    // The starter config forwards to the app's port and listens where the sidecar's port is.
    let cm = &out[2];
    assert_eq!(cm["metadata"]["namespace"], "web");
    let config = cm["data"]["spillway.yaml"].as_str().unwrap();
    let parsed = crate::Config::from_yaml(config, "inject").unwrap();
    assert_eq!(parsed.listen.port(), 4180);
    assert_eq!(parsed.upstream.authority.as_str(), "127.0.0.1:8080");
    assert!(pod["terminationGracePeriodSeconds"].as_u64().unwrap() > 30);
}

#[test]
fn injecting_twice_changes_nothing() {
    let once = inject(APP, &Options::default()).unwrap().text;
    let twice = inject(&once, &Options::default()).unwrap().text;
    assert_eq!(docs(&once), docs(&twice));
}

#[test]
fn native_sidecar_network_policy_and_a_given_config_map() {
    let opts = Options {
        native_sidecar: true,
        network_policy: true,
        config_map: Some("limits".into()),
        ..Options::default()
    };
    let out = docs(&inject(APP, &opts).unwrap().text);
    let kinds: Vec<&str> = out.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["Service", "Deployment", "NetworkPolicy"]);
    let pod = pod(&out[1]);
    let sidecar = container(pod, "initContainers", "spillway");
    assert_eq!(sidecar["restartPolicy"], "Always");
    assert!(pod["containers"].as_sequence().unwrap().len() == 1);
    assert_eq!(pod["volumes"][0]["configMap"]["name"], "limits");
    let np = &out[2];
    assert_eq!(np["spec"]["podSelector"]["matchLabels"]["app"], "shop");
    assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], 4180);
}

#[test]
fn what_cannot_be_injected_is_refused_with_why() {
    let unnamed = APP.replace(
        "{ name: http, containerPort: 8080 }",
        "{ containerPort: 8080 }",
    );
    let e = inject(&unnamed, &Options::default()).unwrap_err();
    assert!(
        e.contains("no name") && e.contains("Deployment \"shop\""),
        "{e}"
    );
    let clash = APP.replace("containerPort: 8080", "containerPort: 4180");
    let e = inject(&clash, &Options::default()).unwrap_err();
    assert!(e.contains("port 4180 is the app's"), "{e}");
    let e = inject("kind: [", &Options::default()).unwrap_err();
    assert!(e.contains("document 1"), "{e}");
}

#[test]
fn a_grpc_port_gets_an_h2c_upstream() {
    let grpc = APP.replace("name: http, containerPort", "name: grpc, containerPort");
    let out = docs(&inject(&grpc, &Options::default()).unwrap().text);
    let config = out[2]["data"]["spillway.yaml"].as_str().unwrap();
    let parsed = crate::Config::from_yaml(config, "inject").unwrap();
    assert!(parsed.upstream.h2, "{config}");
}

#[test]
fn odd_names_are_quoted_not_parsed_and_a_list_is_injected_item_by_item() {
    // A Helm-style or numeric value pasted into a manifest must stay a string, not break out.
    let odd = APP.replace(
        "metadata: { name: shop, namespace: web }",
        "metadata: { name: \"123\", namespace: \"a, b}\" }",
    );
    let opts = Options {
        config_map: Some("x}: y".into()),
        image: "img:{{ .Values.tag }}".into(),
        ..Options::default()
    };
    let out = docs(&inject(&odd, &opts).unwrap().text);
    let pod = pod(&out[1]);
    assert_eq!(pod["volumes"][0]["configMap"]["name"], "x}: y");
    assert_eq!(
        container(pod, "containers", "spillway")["image"],
        "img:{{ .Values.tag }}"
    );
    // `kubectl get ... -o yaml` of several objects.
    let list = format!(
        "apiVersion: v1\nkind: List\nitems:\n{}",
        docs(APP)
            .iter()
            .map(|d| {
                let text = serde_norway::to_string(d).unwrap();
                let mut lines = text.lines();
                let first = format!("- {}", lines.next().unwrap());
                std::iter::once(first)
                    .chain(lines.map(|l| format!("  {l}")))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .collect::<Vec<_>>()
            .join("\n")
    );
    let out = docs(&inject(&list, &Options::default()).unwrap().text);
    let items = out[0]["items"].as_sequence().unwrap();
    let kinds: Vec<&str> = items.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["Service", "Deployment", "ConfigMap"]);
    container(pod_of(&items[1]), "containers", "spillway");
}

fn pod_of(doc: &Value) -> &Value {
    get(doc, &["spec", "template", "spec"]).unwrap()
}

#[test]
fn a_long_workload_name_gives_a_valid_starter_config() {
    let long = "s".repeat(250);
    let app = APP.replace(
        "metadata: { name: shop, namespace: web }",
        &format!("metadata: {{ name: {long}, namespace: web }}"),
    );
    let out = docs(&inject(&app, &Options::default()).unwrap().text);
    let config = out[2]["data"]["spillway.yaml"].as_str().unwrap();
    let parsed = crate::Config::from_yaml(config, "inject").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(parsed.service.0, "s".repeat(64));
    let name = out[2]["metadata"]["name"].as_str().unwrap();
    assert!(name.len() <= 253 && name.ends_with("-spillway"), "{name}");
}

#[test]
fn a_renamed_port_that_would_clash_with_another_is_refused() {
    let app = APP.replace(
        "ports: [{ name: http, containerPort: 8080 }]",
        "ports: [{ name: http, containerPort: 8080 }, { name: app-http, containerPort: 9090 }]",
    );
    let e = inject(&app, &Options::default()).unwrap_err();
    assert!(e.contains("app-http") && e.contains("already"), "{e}");
}

#[test]
fn lifecycle_hooks_that_named_the_port_go_to_its_number() {
    let app = APP.replace(
        "livenessProbe: { tcpSocket: { port: http } }",
        "livenessProbe: { tcpSocket: { port: http } }\n          lifecycle: { postStart: { httpGet: { path: /warm, port: http } }, preStop: { httpGet: { path: /bye, port: http } } }",
    );
    let out = docs(&inject(&app, &Options::default()).unwrap().text);
    let app = container(pod(&out[1]), "containers", "shop");
    assert_eq!(app["lifecycle"]["postStart"]["httpGet"]["port"], 8080);
    assert_eq!(app["lifecycle"]["preStop"]["httpGet"]["port"], 8080);
}

#[test]
fn the_app_gets_a_pause_longer_than_the_sidecars_in_both_modes() {
    for native in [false, true] {
        let opts = Options {
            native_sidecar: native,
            ..Options::default()
        };
        let out = docs(&inject(APP, &opts).unwrap().text);
        let pod = pod(&out[1]);
        let app = container(pod, "containers", "shop");
        let pause = app["lifecycle"]["preStop"]["sleep"]["seconds"]
            .as_u64()
            .unwrap();
        assert!(pause > PRE_STOP, "native {native}: {pause}");
        let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(grace > pause + PRE_STOP + DRAIN, "native {native}: {grace}");
    }
}

/// A realistic Deployment: metrics first, then http and grpc, probes and a Service that
/// targets the app's port by number.
const REALISTIC: &str = r#"
apiVersion: v1
kind: Service
metadata: { name: books, namespace: web }
spec:
  selector: { app: books }
  ports:
    - { name: http, port: 80, targetPort: 8080 }
    - { name: grpc, port: 9090 }
---
apiVersion: v1
kind: Service
metadata: { name: books-elsewhere, namespace: other }
spec:
  selector: { app: books }
  ports: [{ port: 80, targetPort: 8080 }]
---
apiVersion: apps/v1
kind: Deployment
metadata: { name: books, namespace: web }
spec:
  selector: { matchLabels: { app: books } }
  template:
    metadata: { labels: { app: books, tier: api } }
    spec:
      containers:
        - name: books
          image: books:1
          ports:
            - { name: metrics, containerPort: 9100 }
            - { name: http, containerPort: 8080 }
            - { name: grpc, containerPort: 9090 }
          readinessProbe: { httpGet: { path: /ready, port: http } }
"#;

#[test]
fn the_port_named_http_is_fronted_not_the_first_and_the_others_are_named() {
    let out = inject(REALISTIC, &Options::default()).unwrap();
    let got = docs(&out.text);
    let app = container(pod(&got[2]), "containers", "books");
    assert_eq!(app["ports"][0]["name"], "metrics", "{:?}", app["ports"]);
    assert_eq!(app["ports"][1]["name"], "app-http");
    assert_eq!(app["ports"][2]["name"], "grpc");
    let config = got[3]["data"]["spillway.yaml"].as_str().unwrap();
    let parsed = crate::Config::from_yaml(config, "inject").unwrap();
    assert_eq!(parsed.upstream.authority.as_str(), "127.0.0.1:8080");
    let line = out
        .summary
        .iter()
        .find(|l| l.starts_with("Deployment \"books\": injected"))
        .unwrap_or_else(|| panic!("{:?}", out.summary));
    assert!(
        line.contains("port http (8080)")
            && line.contains("metrics (9100)")
            && line.contains("grpc (9090)"),
        "{line}"
    );
}

#[test]
fn a_service_that_targets_the_apps_number_is_pointed_at_the_sidecar() {
    let out = inject(REALISTIC, &Options::default()).unwrap();
    let got = docs(&out.text);
    assert_eq!(got[0]["spec"]["ports"][0]["targetPort"], "http");
    // The grpc port is not fronted: its Service port stays as it was.
    assert!(got[0]["spec"]["ports"][1].get("targetPort").is_none());
    // Another namespace's Service selects other pods.
    assert_eq!(got[1]["spec"]["ports"][0]["targetPort"], 8080);
    assert!(
        out.summary
            .iter()
            .any(|l| l.contains("Service books: targetPort 8080 is now http")),
        "{:?}",
        out.summary
    );
    // A Service with no targetPort targets its own number.
    let bare = REALISTIC.replace(
        "{ name: http, port: 80, targetPort: 8080 }",
        "{ port: 8080 }",
    );
    let got = docs(&inject(&bare, &Options::default()).unwrap().text);
    assert_eq!(got[0]["spec"]["ports"][0]["targetPort"], "http");
    // Injected twice: nothing more changes.
    let once = inject(REALISTIC, &Options::default()).unwrap().text;
    let twice = inject(&once, &Options::default()).unwrap();
    assert_eq!(docs(&once), docs(&twice.text));
    assert!(
        twice
            .summary
            .iter()
            .any(|l| l.contains("skipped: it has a spillway container")),
        "{:?}",
        twice.summary
    );
}

#[test]
fn an_ambiguous_pod_is_refused_with_the_flag_that_settles_it() {
    let no_http = REALISTIC.replace("name: http, containerPort", "name: web, containerPort");
    let e = inject(&no_http, &Options::default()).unwrap_err();
    assert!(
        e.contains("none is named http") && e.contains("--port") && e.contains("web (8080)"),
        "{e}"
    );
    let opts = Options {
        port: Some("web".into()),
        ..Options::default()
    };
    let got = docs(&inject(&no_http, &opts).unwrap().text);
    assert_eq!(
        container(pod(&got[2]), "containers", "books")["ports"][1]["name"],
        "app-web"
    );
    // A lone port that is the metrics one is not taken for the served one.
    let metrics_only = APP.replace("name: http, containerPort", "name: metrics, containerPort");
    let e = inject(&metrics_only, &Options::default()).unwrap_err();
    assert!(e.contains("--port"), "{e}");
    // Two containers with a port named http.
    let two = APP.replace(
        "          livenessProbe: { tcpSocket: { port: http } }",
        "          livenessProbe: { tcpSocket: { port: http } }\n        - name: helper\n          image: helper:1\n          ports: [{ name: http, containerPort: 7070 }]",
    );
    let e = inject(&two, &Options::default()).unwrap_err();
    assert!(e.contains("--container"), "{e}");
}

#[test]
fn the_network_policy_shuts_only_the_fronted_ports_bypass() {
    let opts = Options {
        network_policy: true,
        ..Options::default()
    };
    let got = docs(&inject(REALISTIC, &opts).unwrap().text);
    let np = got.iter().find(|d| d["kind"] == "NetworkPolicy").unwrap();
    let open: Vec<u64> = np["spec"]["ingress"][0]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p["port"].as_u64().unwrap())
        .collect();
    assert_eq!(
        open,
        [4180, 9090, 9100],
        "the sidecar and the other ports, not 8080"
    );
    assert!(
        np["spec"]["ingress"][0].get("from").is_none(),
        "from anywhere"
    );
    let admin = &np["spec"]["ingress"][1];
    assert_eq!(admin["ports"][0]["port"], 9901);
    assert_eq!(
        admin["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "monitoring"
    );
    assert_eq!(np["spec"]["podSelector"]["matchLabels"]["app"], "books");
}

#[test]
fn the_sidecar_carries_the_charts_security_context() {
    let got = docs(&inject(APP, &Options::default()).unwrap().text);
    let sidecar = container(pod(&got[1]), "containers", "spillway");
    let sc = &sidecar["securityContext"];
    assert_eq!(sc["runAsGroup"], 65532);
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert!(sidecar["resources"]["limits"].get("cpu").is_none());
}

const JOBS: &str = r#"
apiVersion: batch/v1
kind: Job
metadata: { name: once }
spec:
  template:
    metadata: { labels: { app: once } }
    spec:
      restartPolicy: Never
      containers: [{ name: once, image: once:1, ports: [{ name: http, containerPort: 8080 }] }]
---
apiVersion: batch/v1
kind: CronJob
metadata: { name: nightly }
spec:
  schedule: "0 3 * * *"
  jobTemplate:
    spec:
      template:
        metadata: { labels: { app: nightly } }
        spec:
          restartPolicy: OnFailure
          containers: [{ name: nightly, image: n:1, ports: [{ name: http, containerPort: 8080 }] }]
---
apiVersion: v1
kind: Pod
metadata: { name: bare, labels: { app: bare } }
spec:
  containers: [{ name: bare, image: b:1, ports: [{ name: http, containerPort: 8080 }] }]
"#;

#[test]
fn jobs_only_as_native_sidecars_and_bare_pods_injected() {
    let out = inject(JOBS, &Options::default()).unwrap();
    let got = docs(&out.text);
    assert_eq!(got[0], docs(JOBS)[0], "the Job passes through");
    assert_eq!(got[1], docs(JOBS)[1], "the CronJob passes through");
    for name in ["Job \"once\"", "CronJob \"nightly\""] {
        assert!(
            out.summary
                .iter()
                .any(|l| l.starts_with(name) && l.contains("--native-sidecar")),
            "{name}: {:?}",
            out.summary
        );
    }
    container(&got[2]["spec"], "containers", "spillway");
    assert_eq!(
        got[2]["metadata"]["labels"]["spillway.dev/sidecar"],
        "spillway"
    );
    let native = Options {
        native_sidecar: true,
        ..Options::default()
    };
    let got = docs(&inject(JOBS, &native).unwrap().text);
    container(
        &got[0]["spec"]["template"]["spec"],
        "initContainers",
        "spillway",
    );
    let cron = &got[2]["spec"]["jobTemplate"]["spec"]["template"];
    container(&cron["spec"], "initContainers", "spillway");
    assert_eq!(
        cron["metadata"]["labels"]["spillway.dev/sidecar"],
        "spillway"
    );
}

#[test]
fn a_name_with_a_del_or_c1_character_is_quoted_not_a_panic() {
    for odd in ["shop\u{7f}", "shop\u{85}x", "shop\u{9f}"] {
        let app = APP.replace(
            "name: shop, namespace",
            &format!("name: {}, namespace", q(odd)),
        );
        let out = inject(&app, &Options::default()).unwrap();
        let got = docs(&out.text);
        assert_eq!(got[1]["metadata"]["name"], odd);
        assert_eq!(
            got[2]["metadata"]["name"].as_str().unwrap(),
            format!("{odd}-spillway")
        );
    }
}

#[test]
fn a_release_gives_its_limits_and_secrets_and_the_pod_its_own_ports() {
    let opts = Options {
        release: Some("shop-spillway".into()),
        ca_secret: Some("spillway-ca".into()),
        ..Options::default()
    };
    let got = docs(&inject(REALISTIC, &opts).unwrap().text);
    let kinds: Vec<&str> = got.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["Service", "Service", "Deployment"],
        "no starter ConfigMap"
    );
    let pod = pod(&got[2]);
    let volumes: Vec<(&str, &str)> = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| {
            let source = v
                .get("configMap")
                .map(|c| &c["name"])
                .unwrap_or_else(|| &v["secret"]["secretName"]);
            (v["name"].as_str().unwrap(), source.as_str().unwrap())
        })
        .collect();
    assert_eq!(
        volumes,
        [
            ("spillway-config", "shop-spillway-limits"),
            ("spillway-key-secret", "shop-spillway-key-secret"),
            ("spillway-token", "spillway-token"),
            ("spillway-tls", "spillway-ca"),
        ]
    );
    let sidecar = container(pod, "containers", "spillway");
    let mounts: Vec<&str> = sidecar["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    assert_eq!(
        mounts,
        [
            "/etc/spillway",
            "/var/run/secrets/spillway-key",
            "/var/run/secrets/spillway",
            "/var/run/secrets/spillway-tls"
        ]
    );
    let args: Vec<&str> = sidecar["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args[3..],
        [
            "--listen",
            "0.0.0.0:4180",
            "--admin",
            "0.0.0.0:9901",
            "--upstream",
            "http://127.0.0.1:8080"
        ]
    );
    assert_eq!(
        got[2]["spec"]["template"]["metadata"]["labels"]["spillway.dev/sidecar"],
        "shop-spillway"
    );
}

#[test]
fn a_releases_key_secret_pause_and_drain_are_the_releases() {
    let opts = Options {
        release: Some("shop-spillway".into()),
        key_secret: Some("shop-keys".into()),
        pre_stop_seconds: 10,
        drain_seconds: 60,
        ..Options::default()
    };
    let got = docs(&inject(APP, &opts).unwrap().text);
    let pod = pod(&got[1]);
    let key = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "spillway-key-secret")
        .unwrap();
    assert_eq!(key["secret"]["secretName"], "shop-keys");
    let sidecar = container(pod, "containers", "spillway");
    assert_eq!(sidecar["lifecycle"]["preStop"]["sleep"]["seconds"], 10);
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(grace > 10 + 60, "{grace}: SIGKILL would cut the drain");
}

/// The image a sidecar gets unless told otherwise (the flag's default, and the injector's when
/// its settings name none) is the one the release workflow publishes for this very version:
/// the chart's `image.repository` at its `appVersion` (tests/chart/check.py checks that they
/// name this version too).
#[test]
fn the_default_image_is_this_versions_release() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        opts: Options,
    }
    let flags = <Cli as clap::Parser>::parse_from(["inject"]).opts.image;
    let settings = serde_norway::from_str::<Options>("{}").unwrap().image;
    for image in [Options::default().image, flags, settings] {
        let (repository, tag) = image.rsplit_once(':').unwrap();
        assert_eq!(repository, "ghcr.io/spillway/spillway", "{image}");
        assert_eq!(tag, env!("CARGO_PKG_VERSION"), "{image}");
    }
}
