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
    let out = docs(&inject(APP, &Options::default()).unwrap());
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
    let once = inject(APP, &Options::default()).unwrap();
    let twice = inject(&once, &Options::default()).unwrap();
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
    let out = docs(&inject(APP, &opts).unwrap());
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
        e.contains("no name") && e.contains("Deployment shop"),
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
    let out = docs(&inject(&grpc, &Options::default()).unwrap());
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
    let out = docs(&inject(&odd, &opts).unwrap());
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
    let out = docs(&inject(&list, &Options::default()).unwrap());
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
    let out = docs(&inject(&app, &Options::default()).unwrap());
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
    let out = docs(&inject(&app, &Options::default()).unwrap());
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
        let out = docs(&inject(APP, &opts).unwrap());
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
