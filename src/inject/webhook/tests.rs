use super::*;

/// A pod of a Deployment as the API server sends it: a generated name, a ReplicaSet owner.
fn review(namespace: &str, annotations: Json, pod_spec: Json) -> Json {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": { "group": "", "version": "v1", "kind": "Pod" },
            "operation": "CREATE",
            "namespace": namespace,
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "generateName": "shop-7d9c5b-",
                    "labels": { "app": "shop" },
                    "annotations": annotations,
                    "ownerReferences": [{ "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "shop-7d9c5b", "uid": "1" }]
                },
                "spec": pod_spec
            }
        }
    })
}

fn web() -> Json {
    json!({ "containers": [{ "name": "shop", "image": "shop:1",
        "ports": [{ "name": "metrics", "containerPort": 9100 }, { "name": "http", "containerPort": 8080 }] }] })
}

fn settings() -> Options {
    Options {
        release: Some("shop-spillway".into()),
        ..Options::default()
    }
}

#[test]
fn a_pod_in_a_namespace_that_asked_is_patched_and_the_patch_adds_the_sidecar() {
    let r = review("web", json!({}), web());
    let Decision::Inject(patch, what) = decide(&r["request"], &settings(), "spillway-system", true)
    else {
        panic!("not injected");
    };
    assert!(
        what.contains("port http (8080)") && what.contains("metrics (9100)"),
        "{what}"
    );
    let spec = &patch[0]["value"];
    let names: Vec<&str> = spec["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["shop", "spillway"]);
    assert_eq!(patch[1]["value"]["spillway.dev/sidecar"], "shop-spillway");
    assert_eq!(
        patch[1]["value"]["app"], "shop",
        "the pod's own labels stay"
    );
    // The answer carries it base64-encoded, allowed.
    let a = answer(&r, &Decision::Inject(patch.clone(), what));
    assert_eq!(a["response"]["uid"], r["request"]["uid"]);
    assert_eq!(a["response"]["allowed"], true);
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(a["response"]["patch"].as_str().unwrap())
        .unwrap();
    assert_eq!(serde_json::from_slice::<Json>(&bytes).unwrap(), patch);
}

#[test]
fn only_an_annotated_pod_is_injected_where_the_namespace_did_not_ask() {
    let opts = settings();
    let plain = review("web", json!({}), web());
    assert_eq!(
        decide(&plain["request"], &opts, "spillway-system", false),
        Decision::Leave
    );
    let asked = review("web", json!({ "spillway.dev/inject": "enabled" }), web());
    assert!(matches!(
        decide(&asked["request"], &opts, "spillway-system", false),
        Decision::Inject(..)
    ));
    let refused = review("web", json!({ "spillway.dev/inject": "disabled" }), web());
    assert_eq!(
        decide(&refused["request"], &opts, "spillway-system", true),
        Decision::Leave
    );
}

#[test]
fn its_own_namespace_and_kube_system_are_never_injected() {
    for ns in ["spillway-system", "kube-system"] {
        let r = review(ns, json!({ "spillway.dev/inject": "enabled" }), web());
        let d = decide(&r["request"], &settings(), "spillway-system", true);
        assert!(
            matches!(&d, Decision::Cannot(why) if why.contains(ns)),
            "{ns}: {d:?}"
        );
    }
}

#[test]
fn what_cannot_be_injected_is_admitted_as_it_is_with_the_reason() {
    // No port named http, two ports: ambiguous.
    let odd = json!({ "containers": [{ "name": "a", "image": "a",
        "ports": [{ "name": "web", "containerPort": 8080 }, { "name": "admin", "containerPort": 8081 }] }] });
    let r = review("web", json!({}), odd.clone());
    let d = decide(&r["request"], &settings(), "spillway-system", true);
    let Decision::Cannot(why) = &d else {
        panic!("{d:?}")
    };
    assert!(why.contains("--port"), "{why}");
    let a = answer(&r, &d);
    assert_eq!(a["response"]["allowed"], true);
    assert!(a["response"].get("patch").is_none());
    assert!(a["response"]["warnings"][0]
        .as_str()
        .unwrap()
        .contains("not injected"));
    // The pod's annotation settles it.
    let r = review("web", json!({ "spillway.dev/port": "web" }), odd);
    assert!(matches!(
        decide(&r["request"], &settings(), "spillway-system", true),
        Decision::Inject(..)
    ));
    // A Job's pod, with a classic sidecar.
    let mut job = web();
    job["restartPolicy"] = json!("Never");
    let r = review("web", json!({}), job);
    let d = decide(&r["request"], &settings(), "spillway-system", true);
    assert!(
        matches!(&d, Decision::Cannot(why) if why.contains("native_sidecar")),
        "{d:?}"
    );
    let native = Options {
        native_sidecar: true,
        ..settings()
    };
    assert!(matches!(
        decide(&r["request"], &native, "spillway-system", true),
        Decision::Inject(..)
    ));
}

#[test]
fn an_injected_pod_is_left_as_it_is() {
    let r = review("web", json!({}), web());
    let Decision::Inject(patch, _) = decide(&r["request"], &settings(), "ns", true) else {
        panic!("not injected");
    };
    let mut again = r.clone();
    again["request"]["object"]["spec"] = patch[0]["value"].clone();
    assert_eq!(
        decide(&again["request"], &settings(), "ns", true),
        Decision::Leave
    );
}

#[test]
fn settings_need_limits_not_named_after_a_pod() {
    let dir = std::env::temp_dir().join(format!("spillway-injector-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("injector.yaml");
    std::fs::write(&path, "image: x:1\n").unwrap();
    assert!(settings_of(&path).unwrap_err().contains("release"));
    std::fs::write(&path, "release: shop-spillway\nimgae: typo\n").unwrap();
    assert!(settings_of(&path).unwrap_err().contains("imgae"));
    std::fs::write(
        &path,
        "release: shop-spillway\nresources: { requests: { cpu: 50m } }\nnative_sidecar: true\n",
    )
    .unwrap();
    let opts = settings_of(&path).unwrap();
    assert!(opts.native_sidecar && opts.resources.is_some());
}

fn settings_of(path: &Path) -> Result<Options, String> {
    super::settings(path)
}

#[test]
fn pods_that_asked_and_run_without_the_sidecar_are_listed() {
    let list = r#"
apiVersion: v1
kind: List
items:
  - { apiVersion: v1, kind: Namespace, metadata: { name: web, labels: { spillway.dev/inject: enabled } } }
  - { apiVersion: v1, kind: Namespace, metadata: { name: batch } }
  - { apiVersion: v1, kind: Pod, metadata: { name: a, namespace: web }, spec: { containers: [{ name: app }] } }
  - { apiVersion: v1, kind: Pod, metadata: { name: b, namespace: web }, spec: { containers: [{ name: app }, { name: spillway }] } }
  - { apiVersion: v1, kind: Pod, metadata: { name: c, namespace: web }, spec: { initContainers: [{ name: spillway }], containers: [{ name: app }] } }
  - { apiVersion: v1, kind: Pod, metadata: { name: d, namespace: web, annotations: { spillway.dev/inject: disabled } }, spec: { containers: [{ name: app }] } }
  - { apiVersion: v1, kind: Pod, metadata: { name: e, namespace: batch, annotations: { spillway.dev/inject: enabled } }, spec: { containers: [{ name: app }] } }
  - { apiVersion: v1, kind: Pod, metadata: { name: f, namespace: batch }, spec: { containers: [{ name: app }] } }
"#;
    assert_eq!(uninjected(list, &[]).unwrap(), ["web/a", "batch/e"]);
    // The injector's own namespace is never injected: not listed.
    assert_eq!(uninjected(list, &["batch"]).unwrap(), ["web/a"]);
    let off = list.replace(
        "name: batch }",
        "name: batch, labels: { spillway.dev/inject: disabled } }",
    );
    assert_eq!(uninjected(&off, &[]).unwrap(), ["web/a"]);
    assert!(uninjected("kind: Pod\nmetadata: { name: x }\n", &[])
        .unwrap_err()
        .contains("no namespaces"));
    assert!(uninjected("kind: [", &[]).is_err());
}

#[test]
fn hostile_or_odd_pods_are_admitted_as_they_are_never_a_panic() {
    for object in [
        json!({ "metadata": "x", "spec": {} }),
        json!({ "metadata": [], "spec": [] }),
        json!({ "metadata": {}, "spec": 7 }),
        json!({ "metadata": { "name": "p\u{7f}\u{85}" }, "spec": { "containers": "x" } }),
        json!({ "metadata": { "annotations": "x" }, "spec": { "containers": [1, 2] } }),
    ] {
        let r = json!({ "kind": { "kind": "Pod" }, "operation": "CREATE", "namespace": "web", "object": object });
        let d = decide(&r, &settings(), "spillway-system", true);
        assert!(
            matches!(d, Decision::Cannot(_) | Decision::Leave),
            "{object}: {d:?}"
        );
    }
    // On the node's network, the sidecar would take the node's ports.
    let mut host = web();
    host["hostNetwork"] = json!(true);
    let r = review("web", json!({}), host);
    assert!(matches!(
        decide(&r["request"], &settings(), "ns", true),
        Decision::Cannot(why) if why.contains("hostNetwork")
    ));
}

#[test]
fn a_pod_names_the_release_of_its_namespace_that_holds_its_limits() {
    let opts = Options {
        key_secret: Some("shared-key".into()),
        ..settings()
    };
    let r = review("web", json!({ "spillway.dev/release": "books" }), web());
    let Decision::Inject(patch, _) = decide(&r["request"], &opts, "ns", true) else {
        panic!("not injected");
    };
    let volumes = patch[0]["value"]["volumes"].as_array().unwrap();
    let source = |name: &str| {
        let v = volumes.iter().find(|v| v["name"] == name).unwrap();
        v["configMap"]["name"]
            .as_str()
            .or(v["secret"]["secretName"].as_str())
            .unwrap()
            .to_string()
    };
    assert_eq!(source("spillway-config"), "books-limits");
    // The settings' key Secret is the settings' release's, not the one the pod names.
    assert_eq!(source("spillway-key-secret"), "books-key-secret");
    assert_eq!(patch[1]["value"]["spillway.dev/sidecar"], "books");
    // A name that would make the pod invalid (a label value, object names) is refused.
    let r = review(
        "web",
        json!({ "spillway.dev/release": "Books Team!" }),
        web(),
    );
    assert!(matches!(
        decide(&r["request"], &opts, "ns", true),
        Decision::Cannot(why) if why.contains("not a release name")
    ));
}
