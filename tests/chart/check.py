#!/usr/bin/env python3
"""Checks the Dockerfile and the Helm chart, offline, as scripts/test's last step.

- hadolint on the Dockerfile;
- `helm lint --strict` (Helm's own Go SDK, through helm-python-sdk) with several value sets;
- every manifest rendered with those value sets validated against the Kubernetes schemas
  (kubernetes-validate, strict); the Prometheus Operator kinds against their required fields;
- bad values refused by values.schema.json with a message that names the field;
- the limits ConfigMap's spillway.yaml passes `spillway check-config`;
- the configuration's JSON Schema admits config/*.yaml, the README's examples and the rendered
  ConfigMaps, and refuses the shapes `check-config` refuses;
- the sidecar's hardening and shutdown timing as rendered;
- the dashboard's JSON parses, every metric it queries is one a live proxy, aggregator or
  controller exports, and every panel shows data in a real Prometheus scraping them (they, a
  Redis and Prometheus are started here, on loopback, and stopped by their PIDs).

usage: check.py ROOT SPILLWAY_BINARY
"""

import base64
import http.server
import json
import os
import re
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

ROOT, BIN = sys.argv[1], sys.argv[2]
CHART = os.path.join(ROOT, "charts", "spillway")
K8S = "1.33.0"
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


VALUE_SETS = {
    "defaults": {},
    "sidecar only (example app)": {"example": {"enabled": True}},
    "full control plane": {
        "controlPlane": {"enabled": True, "zones": [{"name": "zone-a"}, {"name": "zone-b", "replicas": 3}, {"name": "zone-c"}]},
        "limits": {"rules": [
            {"name": "per-key", "key": ["header:x-api-key"], "limit": {"rate": "100/s"}, "scope": "global"},
            {"name": "app", "key": [], "limit": {"adaptive": {"min": 4, "max": 256}}},
        ]},
        "example": {"enabled": True},
    },
    "per-service tokens and TLS": {
        "controlPlane": {"enabled": True, "tokens": {"existingSecret": "spillway-tokens"},
                         "tls": {"existingSecret": "spillway-tls"}},
        "limits": {"rules": [{"name": "per-key", "key": ["header:x-api-key"], "limit": {"rate": "100/s"}, "scope": "global"}]},
        "example": {"enabled": True},
    },
    "platform knobs": {
        "controlPlane": {"enabled": True, "zones": [{"name": "zone-a"}]},
        "nodeSelector": {"pool": "infra"},
        "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "x"}}}}]}},
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"team": "platform"},
        "priorityClassName": "system-cluster-critical",
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
        "sidecar": {"appScheme": "h2c", "extraEnv": [{"name": "TZ", "value": "UTC"}]},
        "example": {"enabled": True},
    },
    "monitoring on": {
        "controlPlane": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
        "limits": {"rules": [{"name": "login", "key": ["client_ip"], "limit": {"rate": "5/m", "algorithm": "sliding_window_log"}, "scope": "redis"}],
                   "redis": {"url": "redis://redis:6379", "timeout": "5ms", "on_error": "allow"}},
    },
}

# Several teams on one control plane: it runs in a release of its own, each team's release holds
# its limits and points at it.
VALUE_SETS.update({
    "control plane alone": {
        "sidecar": {"enabled": False},
        "controlPlane": {"enabled": True, "tokens": {"services": ["shop", "cart"]}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "sidecar only, another release's control plane": {
        "controlPlane": {"url": "https://spillway-aggregator.spillway-system:7001",
                         "token": {"existingSecret": "spillway-token"}, "tls": {"existingSecret": "spillway-ca"}},
        "limits": {"rules": [{"name": "per-key", "key": ["header:x-api-key"], "limit": {"rate": "100/s"}, "scope": "global"}]},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "example": {"enabled": True},
    },
    "native sidecar": {"sidecar": {"native": True}, "example": {"enabled": True}},
    "shared token, asked for": {"controlPlane": {"enabled": True, "token": {"shared": True}}, "example": {"enabled": True}},
    "shared token as a value": {"controlPlane": {"enabled": True, "token": {"value": "not-a-secret"}}, "example": {"enabled": True}},
})

# The service is required wherever the release has the sidecar.
for _values in VALUE_SETS.values():
    if _values.get("sidecar", {}).get("enabled", True):
        _values.setdefault("service", "shop")

VALUE_SETS["injector"] = {"service": "shop", "injector": {"enabled": True, "nativeSidecar": True},
                          "controlPlane": {"enabled": True}}
VALUE_SETS["injector with cert-manager"] = {"service": "shop",
                                            "injector": {"enabled": True, "certManager": {"enabled": True, "issuer": "ca"}}}

# A Helm user's knobs: names, a pinned image, the sidecar's own image and security context,
# and settings of the sidecar's configuration the chart has no values of its own for.
VALUE_SETS["a helm user's knobs"] = {
    "service": "shop",
    "nameOverride": "limiter",
    "fullnameOverride": "shop-limiter",
    "image": {"digest": "sha256:" + "ab" * 32},
    "sidecar": {"image": {"repository": "mirror.example/spillway", "tag": "0.1.0-rc1"},
                "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "readOnlyRootFilesystem": True,
                                    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}},
    "limits": {
        "clientIp": {"trustedProxies": ["10.0.0.0/8"], "ipv4Prefix": 24},
        "config": {"timeouts": {"client_idle": "350s"}, "limits": {"max_connections": 20000},
                   "log_rejections": 0, "normalize_path": False, "path_escapes": "reject",
                   "path_match": "strict"},
        "rules": [{"name": "per-client", "key": ["client_ip"], "limit": {"rate": "10/s"}}],
    },
    "controlPlane": {"enabled": True},
    "example": {"enabled": True},
}

OPERATOR_REQUIRED = {
    "ServiceMonitor": ["selector", "endpoints"],
    "PodMonitor": ["selector", "podMetricsEndpoints"],
    "PrometheusRule": ["groups"],
}


def manifests(rendered):
    """The manifests of a chart's render, in order (NOTES.txt is text, not YAML)."""
    return [d for path, text in rendered.items() if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]


def hadolint():
    exe = os.path.join(os.path.dirname(sys.executable), "hadolint")
    r = subprocess.run([exe, os.path.join(ROOT, "Dockerfile")], capture_output=True, text=True)
    check(r.returncode == 0, f"hadolint Dockerfile {r.stdout.strip()}")


def release():
    """The release pipeline, offline (the workflows themselves cannot run here): actionlint,
    with shellcheck on their run: scripts, finds nothing in .github/workflows; scripts/check-pins
    fails naming each FROM line of the Dockerfile that pulls a base without a digest, and passes
    on a copy whose every FROM has one (fake digests: a test of the checker, not a pin);
    renovate.json pins bases and actions by digest; one version names the binary, the chart's
    appVersion, its image tag and `spillway inject`'s image, in the repository the release
    workflow pushes to."""
    import tomllib

    bindir = os.path.dirname(sys.executable)
    wf_dir = os.path.join(ROOT, ".github", "workflows")
    workflows = sorted(os.path.join(wf_dir, n) for n in os.listdir(wf_dir) if n.endswith((".yml", ".yaml")))
    names = [os.path.basename(w) for w in workflows]
    check({"release.yml", "ci.yml"} <= set(names), f"release: the release and CI workflows are there {names}")
    r = subprocess.run([os.path.join(bindir, "actionlint"), "-no-color", "-shellcheck", os.path.join(bindir, "shellcheck"),
                        *workflows], cwd=ROOT, capture_output=True, text=True)
    check(r.returncode == 0, "release: actionlint finds nothing in .github/workflows"
          + ("" if r.returncode == 0 else f"\n{(r.stdout + r.stderr).strip()}"))

    # scripts/check-pins, against what a FROM line pulls: not scratch, not an earlier stage.
    pins = os.path.join(ROOT, "scripts", "check-pins")
    digest = re.compile(r"@sha256:[0-9a-f]{64}$")

    def pulls(lines):
        """(line number, image) of each FROM line that pulls an image."""
        stages, out = set(), []
        for n, line in enumerate(lines, 1):
            words = line.split()
            if not words or words[0].lower() != "from":
                continue
            args = [w for w in words[1:] if not w.startswith("--")]
            if args and args[0].lower() != "scratch" and args[0].lower() not in stages:
                out.append((n, args[0]))
            if len(args) >= 3 and args[1].lower() == "as":
                stages.add(args[2].lower())
        return out

    def run_pins(lines):
        d = tempfile.mkdtemp(prefix="spillway-pins-")
        path = os.path.join(d, "Dockerfile")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        r = subprocess.run([pins, path], capture_output=True, text=True)
        shutil.rmtree(d)
        return r, path

    def with_image(line, image):
        words = line.split()
        i = next(i for i, w in enumerate(words[1:], 1) if not w.startswith("--"))
        return " ".join(words[:i] + [image] + words[i + 1:])

    with open(os.path.join(ROOT, "Dockerfile")) as f:
        lines = f.read().splitlines()
    images = pulls(lines)
    check(len(images) >= 2, f"release: the Dockerfile's FROM lines that pull a base {images}")
    unpinned = [(n, image) for n, image in images if not digest.search(image)]
    r = subprocess.run([pins], capture_output=True, text=True)
    said = (r.stdout + r.stderr).strip()
    if unpinned:
        check(r.returncode == 1 and all(f"Dockerfile:{n}: " in said and image in said for n, image in unpinned)
              and said.count("unpinned base image") == len(unpinned),
              f"release: check-pins fails naming the Dockerfile's unpinned FROM lines {[n for n, _ in unpinned]}"
              + ("" if r.returncode == 1 else f": {said}"))
    else:
        check(r.returncode == 0, f"release: check-pins passes, every FROM of the Dockerfile pinned: {said}")
    # Every digest taken off: each FROM that pulls is named; a fake one on each: it passes.
    bare = list(lines)
    for n, image in images:
        bare[n - 1] = with_image(lines[n - 1], image.split("@")[0])
    r, path = run_pins(bare)
    ok = r.returncode == 1 and all(f"{path}:{n}: " in r.stdout for n, _ in images)
    check(ok, "release: check-pins names every FROM without a digest" + ("" if ok else f": {r.stdout.strip()}"))
    fake = list(bare)
    for n, image in images:
        fake[n - 1] = with_image(bare[n - 1], image.split("@")[0] + "@sha256:" + "0" * 64)
    r, _ = run_pins(fake)
    check(r.returncode == 0, "release: check-pins passes with a digest on every FROM (fake digests)"
          + ("" if r.returncode == 0 else f": {r.stdout.strip()}"))
    short = list(fake)
    n, image = images[0]
    short[n - 1] = with_image(bare[n - 1], image.split("@")[0] + "@sha256:abc")
    r, path = run_pins(short)
    ok = r.returncode == 1 and f"{path}:{n}: " in r.stdout
    check(ok, "release: check-pins refuses a digest that is not 64 hex digits" + ("" if ok else f": {r.stdout.strip()}"))

    with open(os.path.join(ROOT, "renovate.json")) as f:
        renovate = json.load(f)
    extends = renovate.get("extends", [])
    check("docker:pinDigests" in extends and "helpers:pinGitHubActionDigests" in extends,
          f"release: renovate.json pins base images by digest and actions by commit {extends}")

    with open(os.path.join(ROOT, "Cargo.toml"), "rb") as f:
        version = tomllib.load(f)["package"]["version"]
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        chart = yaml.safe_load(f)
    with open(os.path.join(CHART, "values.yaml")) as f:
        image = yaml.safe_load(f)["image"]
    check(str(chart["appVersion"]) == version, f"release: Chart.yaml's appVersion {chart['appVersion']} is Cargo.toml's version {version}")
    check(image["tag"] == "", f"release: values.yaml's image.tag is empty, so the image follows appVersion {image['tag']!r}")
    rendered = helm.Chart.load(CHART).render({"service": "shop", "controlPlane": {"enabled": True},
                                              "example": {"enabled": True}, "injector": {"enabled": True}},
                                             name="spillway", namespace="shop", is_install=True)
    docs = manifests(rendered)
    used = {c["image"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"] if c["name"] != "app"}
    used |= {yaml.safe_load(d["data"]["injector.yaml"])["image"] for d in docs
             if d["kind"] == "ConfigMap" and "injector.yaml" in d.get("data", {})}
    check(used == {f"{image['repository']}:{chart['appVersion']}"},
          f"release: every image the chart renders (and the injector injects) is {image['repository']}:<appVersion> {sorted(used)}")
    with open(os.path.join(wf_dir, "release.yml")) as f:
        pushed = yaml.safe_load(f)["env"]["IMAGE"]
    check(pushed == image["repository"], f"release: the workflow pushes {pushed}, where the chart points ({image['repository']})")
    out = subprocess.run([BIN, "inject", os.path.join(ROOT, "tests", "chart", "sample-app.yaml")], capture_output=True, text=True)
    injected = {c["image"] for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"
                for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "spillway"}
    check(injected == {f"{image['repository']}:{version}"},
          f"release: spillway inject's default image is the chart's, at the binary's version {injected}")


def lint_and_render():
    chart = helm.Chart.load(CHART)
    configmaps = []
    for name, values in VALUE_SETS.items():
        report = helm.lint(CHART, values, strict=True, kube_version="v" + K8S)
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        check(not problems, f"helm lint --strict ({name}) {problems or ''}")
        rendered = chart.render(values, name="spillway", namespace="shop", is_install=True)
        docs = []
        for path, text in rendered.items():
            if path.endswith("NOTES.txt"):
                continue
            for doc in yaml.safe_load_all(text):
                if doc:
                    docs.append((path, doc))
        kinds = sorted({d["kind"] for _, d in docs})
        check(bool(docs), f"render ({name}): {len(docs)} manifests: {', '.join(kinds)}")
        releases(name, [d for _, d in docs])
        for path, doc in docs:
            what = f"{name}: {doc['kind']} {doc['metadata']['name']}"
            if doc["kind"] == "Certificate":
                # cert-manager's: no schema of it ships with Kubernetes.
                spec = doc["spec"]
                check(doc["apiVersion"] == "cert-manager.io/v1" and spec.get("secretName") and spec.get("issuerRef", {}).get("name")
                      and any(n.endswith(".svc") for n in spec.get("dnsNames", [])),
                      f"{what}: cert-manager fields, and the Service's name among its DNS names")
                continue
            if doc["kind"] in OPERATOR_REQUIRED:
                ok = doc["apiVersion"] == "monitoring.coreos.com/v1" and all(k in doc["spec"] for k in OPERATOR_REQUIRED[doc["kind"]])
                check(ok, f"{what}: Prometheus Operator fields")
                if doc["kind"] == "PodMonitor":
                    sel = doc["spec"]["namespaceSelector"]
                    check(sel.get("matchNames") == ["shop"], f"{what}: scrapes this release's namespace only")
                    pods = doc["spec"]["selector"]["matchExpressions"]
                    check(pods == [{"key": "spillway.dev/sidecar", "operator": "In", "values": ["spillway"]}],
                          f"{what}: selects this release's sidecars only {pods}")
                continue
            try:
                kubernetes_validate.validate(doc, K8S, strict=True)
                check(True, f"{what}: valid against Kubernetes {K8S}")
            except kubernetes_validate.ValidationError as e:
                check(False, f"{what}: {e.message} at {list(e.path)}")
            if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-limits"):
                configmaps.append((name, doc["data"]["spillway.yaml"]))
            if doc["kind"] == "Deployment" and doc["metadata"]["name"].endswith("-example"):
                sidecar_rules(name, doc)
            if name == "platform knobs":
                knobs(doc, what)
            if name == "a helm user's knobs":
                helm_user(doc, what)

            if doc["kind"] in ("Deployment", "StatefulSet") and (
                    doc["metadata"]["name"].endswith(("-controller", "-aggregator"))
                    or "-aggregator-" in doc["metadata"]["name"]):
                args = doc["spec"]["template"]["spec"]["containers"][0]["args"]
                check("--log-format=json" in args, f"{what}: logs JSON lines")
    return configmaps


def releases(name, docs):
    """What each kind of release renders: a control plane alone, a team's sidecar-only release
    pointing at it, a native sidecar."""
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    deployments = by_kind.get("Deployment", {})
    statefulsets = by_kind.get("StatefulSet", {})
    control = [n for n in {**deployments, **statefulsets} if n.endswith("-controller") or "-aggregator-" in n]
    if "spillway-controller" in statefulsets:
        active_active(name, by_kind)
    if name == "control plane alone":
        check("spillway-limits" not in by_kind.get("ConfigMap", {}) and "PodMonitor" not in by_kind,
              f"{name}: no limits ConfigMap and no PodMonitor")
        check(len(control) == 2, f"{name}: the controllers and an aggregator {control}")
        tokens = by_kind.get("Secret", {}).get("spillway-tokens", {}).get("data", {})
        check(sorted(tokens) == ["_admin", "_aggregators", "_metrics", "cart", "shop"], f"{name}: a token per service {sorted(tokens)}")
        args = statefulsets["spillway-controller"]["spec"]["template"]["spec"]["containers"][0]["args"]
        check("--tokens=/var/run/secrets/spillway" in args, f"{name}: the controller reads the per-service tokens")
    if name == "full control plane":
        # Without a word about tokens, each service gets its own: this release's, the
        # aggregators' and the admin's; the sidecar mounts only its own.
        tokens = by_kind.get("Secret", {}).get("spillway-tokens", {}).get("data", {})
        check(sorted(tokens) == ["_admin", "_aggregators", "_metrics", "shop"] and "spillway-token" not in by_kind.get("Secret", {}),
              f"{name}: per-service tokens by default {sorted(tokens)}")
        vols = {v["name"]: v for v in deployments["spillway-example"]["spec"]["template"]["spec"]["volumes"]}
        check(vols["spillway-token"]["secret"]["secretName"] == "spillway-tokens"
              and vols["spillway-token"]["secret"]["items"] == [{"key": "shop", "path": "token"}],
              f"{name}: the sidecar mounts its own service's token {vols['spillway-token']}")
    monitor = by_kind.get("ServiceMonitor", {}).get("spillway-control-plane")
    if monitor:
        auth = monitor["spec"]["endpoints"][0].get("authorization", {})
        check(auth.get("type") == "Bearer" and auth["credentials"] == {"name": "spillway-tokens", "key": "_metrics", "optional": True},
              f"{name}: Prometheus scrapes the controllers' per-rule rates with the metrics token {auth}")
    if name == "shared token, asked for":
        # One token for every service, beside the aggregators' own: it sends no zone sums.
        secrets = by_kind.get("Secret", {})
        tokens = secrets.get("spillway-tokens", {}).get("data", {})
        args = statefulsets["spillway-controller"]["spec"]["template"]["spec"]["containers"][0]["args"]
        vols = {v["name"]: v for v in deployments["spillway-example"]["spec"]["template"]["spec"]["volumes"]}
        check(sorted(tokens) == ["_admin", "_aggregators", "_metrics", "_shared"] and "spillway-token" not in secrets
              and "--tokens=/var/run/secrets/spillway" in args
              and vols["spillway-token"]["secret"]["items"] == [{"key": "_shared", "path": "token"}],
              f"{name}: one shared token beside the aggregators' own {sorted(tokens)} {args}")
    if name == "shared token as a value":
        # The given token is `_shared` beside the aggregators' own: it sends no zone sums.
        secrets = by_kind.get("Secret", {})
        tokens = secrets.get("spillway-tokens", {}).get("data", {})
        pod = statefulsets["spillway-controller"]["spec"]["template"]["spec"]
        vol = {v["name"]: v for v in pod["volumes"]}["token"]
        sources = vol.get("projected", {}).get("sources", [])
        check("spillway-token" in secrets and sorted(tokens) == ["_admin", "_aggregators", "_metrics"]
              and "--tokens=/var/run/secrets/spillway" in pod["containers"][0]["args"]
              and sources == [{"secret": {"name": "spillway-token", "items": [{"key": "token", "path": "_shared"}]}},
                              {"secret": {"name": "spillway-tokens"}}],
              f"{name}: the given shared token beside the aggregators' own {sorted(secrets)} {sources}")
    if name == "sidecar only, another release's control plane":
        secrets = sorted(by_kind.get("Secret", {}))
        check(not control and secrets == ["spillway-key-secret"],
              f"{name}: no control plane and no token of its own, only its key secret {control} {secrets}")
        conf = yaml.safe_load(by_kind["ConfigMap"]["spillway-limits"]["data"]["spillway.yaml"])
        check(conf["control_plane"]["url"] == "https://spillway-aggregator.spillway-system:7001"
              and conf["control_plane"]["ca_file"] == "/var/run/secrets/spillway-tls/ca.crt",
              f"{name}: reports to the given control plane, trusting its CA {conf['control_plane']}")
        vols = {v["name"]: v for v in deployments["spillway-example"]["spec"]["template"]["spec"]["volumes"]}
        check(vols["spillway-token"]["secret"]["secretName"] == "spillway-token"
              and vols["spillway-tls"]["secret"]["secretName"] == "spillway-ca", f"{name}: mounts the team's Secrets")
    limits = by_kind.get("ConfigMap", {}).get("spillway-limits")
    if limits:
        # Keys' private parts are digested under one secret per service, the chart's own.
        key = by_kind.get("Secret", {}).get("spillway-key-secret", {}).get("data", {})
        check("key_secret_file: /var/run/secrets/spillway-key/secret" in limits["data"]["spillway.yaml"]
              and len(base64.b64decode(key.get("secret", ""))) >= 16,
              f"{name}: the sidecar's config names the key secret the chart creates")
    if name == "native sidecar":
        spec = deployments["spillway-example"]["spec"]["template"]["spec"]
        init = [c for c in spec.get("initContainers", []) if c["name"] == "spillway"]
        check(len(init) == 1 and init[0].get("restartPolicy") == "Always"
              and all(c["name"] != "spillway" for c in spec["containers"]),
              f"{name}: the sidecar is an init container with restartPolicy: Always")


def active_active(name, by_kind):
    """The controllers serve at once: a StatefulSet of two by default, each reached by name through
    a headless Service that publishes them while they warm up, a PodDisruptionBudget letting one
    go at a time, and every aggregator forwarding to each of them by name."""
    sts = by_kind["StatefulSet"]["spillway-controller"]["spec"]
    replicas = sts["replicas"]
    check(replicas >= 2 and sts["serviceName"] == "spillway-controller-pods"
          and sts["podManagementPolicy"] == "Parallel" and sts["minReadySeconds"] >= 10,
          f"{name}: {replicas} controllers in a StatefulSet, restarted one at a time past their warm-up")
    pods = by_kind["Service"]["spillway-controller-pods"]["spec"]
    check(pods["clusterIP"] == "None" and pods["publishNotReadyAddresses"] is True,
          f"{name}: a headless Service names each controller, warming ones too")
    pdb = by_kind["PodDisruptionBudget"]["spillway-controller"]["spec"]
    check(pdb.get("maxUnavailable") == 1, f"{name}: a PodDisruptionBudget lets one controller go at a time")
    scheme = "https" if "spillway-tls" in json.dumps(sts) else "http"
    want = ",".join(f"{scheme}://spillway-controller-{i}.spillway-controller-pods.shop.svc:7000" for i in range(replicas))
    aggs = [d for n, d in by_kind.get("Deployment", {}).items() if "-aggregator-" in n]
    check(aggs and all(f"--controller={want}" in d["spec"]["template"]["spec"]["containers"][0]["args"] for d in aggs),
          f"{name}: every aggregator forwards to each controller by name ({want})")


def helm_user(doc, what):
    """nameOverride, fullnameOverride, a digest, the sidecar's image and security context, and
    the sidecar's settings through limits.config all arrive where they are meant to."""
    name = doc["metadata"]["name"]
    check(name.startswith("shop-limiter"), f"{what}: named from fullnameOverride")
    labels = doc["metadata"].get("labels", {})
    if "app.kubernetes.io/name" in labels:
        check(labels["app.kubernetes.io/name"] == "limiter", f"{what}: labelled with nameOverride")
    if doc["kind"] == "ConfigMap" and name.endswith("-limits"):
        config = yaml.safe_load(doc["data"]["spillway.yaml"])
        check(config["timeouts"] == {"drain": "25s", "client_idle": "350s"}
              and config["limits"] == {"max_connections": 20000}
              and config["log_rejections"] == 0 and config["normalize_path"] is False
              and config["path_escapes"] == "reject" and config["path_match"] == "strict"
              and config["client_ip"]["ipv4_prefix"] == 24,
              f"{what}: limits.config and clientIp.ipv4Prefix reach spillway.yaml")
    if doc["kind"] not in ("Deployment", "StatefulSet"):
        return
    pod = doc["spec"]["template"]["spec"]
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        if c["name"] == "spillway":
            check(c["image"] == "mirror.example/spillway:0.1.0-rc1", f"{what}: the sidecar's own image {c['image']}")
            check(c["securityContext"]["runAsUser"] == 10001, f"{what}: the sidecar's own security context")
        else:
            if c["image"].startswith("ghcr.io/spillway"):
                check(c["image"] == "ghcr.io/spillway/spillway@sha256:" + "ab" * 32, f"{what}: pinned by digest {c['image']}")


def subchart():
    """As a dependency of another chart, with the `global` values Helm passes to every
    subchart: it renders, and its manifests are valid."""
    with tempfile.TemporaryDirectory() as d:
        parent = os.path.join(d, "shop")
        os.makedirs(os.path.join(parent, "charts"))
        shutil.copytree(CHART, os.path.join(parent, "charts", "spillway"))
        with open(os.path.join(parent, "Chart.yaml"), "w") as f:
            f.write("apiVersion: v2\nname: shop\nversion: 1.0.0\ndependencies:\n  - { name: spillway, version: 0.1.0 }\n")
        # The parent's own Deployment with the sidecar, as docs/kubernetes.md shows it.
        os.makedirs(os.path.join(parent, "templates"))
        with open(os.path.join(parent, "templates", "app.yaml"), "w") as f:
            f.write("""apiVersion: apps/v1
kind: Deployment
metadata: { name: shop-app }
spec:
  selector: { matchLabels: { app: shop } }
  template:
    metadata: { labels: { app: shop, spillway.dev/sidecar: shop-spillway } }
    spec:
      containers:
        - { name: app, image: shop:1 }
        {{- include "spillway.sidecar" (dict "values" .Values.spillway "release" "shop-spillway" "appVersion" .Subcharts.spillway.Chart.AppVersion) | nindent 8 }}
      volumes:
        {{- include "spillway.sidecarVolumes" (dict "values" .Values.spillway "release" "shop-spillway") | nindent 8 }}
""")
        values = {"global": {"imageRegistry": "mirror.example", "storageClass": "fast"},
                  "spillway": {"service": "shop", "example": {"enabled": True}}}
        try:
            rendered = helm.Chart.load(parent).render(values, name="shop", namespace="shop", is_install=True)
        except helm.HelmError as e:
            check(False, f"subchart render with global values: {str(e).splitlines()[0][:200]}")
            return
        docs = manifests(rendered)
        check(any(d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-limits") for d in docs),
              f"subchart render with global values: {len(docs)} manifests")
        with open(os.path.join(CHART, "Chart.yaml")) as f:
            app_version = yaml.safe_load(f)["appVersion"]
        images = {c["image"] for d in docs if d["kind"] == "Deployment"
                  for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "spillway"}
        check(images == {f"ghcr.io/spillway/spillway:{app_version}"},
              f"subchart: the parent's sidecar and the example's run the chart's appVersion {images}")
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, K8S, strict=True)
            except kubernetes_validate.ValidationError as e:
                check(False, f"subchart: {doc['kind']} {doc['metadata']['name']}: {e.message}")


def knobs(doc, what):
    """The platform knobs reach the control plane's pods, and the sidecar's own."""
    if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-limits"):
        check("upstream: h2c://" in doc["data"]["spillway.yaml"], f"{what}: an h2c app is reached over h2c")
    if doc["kind"] != "Deployment":
        return
    spec = doc["spec"]["template"]["spec"]
    meta = doc["spec"]["template"]["metadata"]
    if doc["metadata"]["name"].endswith("-example"):
        sidecar = next(c for c in spec["containers"] if c["name"] == "spillway")
        check({"name": "TZ", "value": "UTC"} in sidecar["env"], f"{what}: the sidecar's extra env")
        return
    check(spec.get("nodeSelector", {}).get("pool") == "infra", f"{what}: nodeSelector")
    check(spec.get("tolerations", [{}])[0].get("key") == "infra", f"{what}: tolerations")
    check(spec.get("imagePullSecrets") == [{"name": "regcred"}], f"{what}: imagePullSecrets")
    check(spec.get("priorityClassName") == "system-cluster-critical", f"{what}: priorityClassName")
    check(meta["annotations"].get("team") == "platform", f"{what}: podAnnotations")
    check({"name": "TZ", "value": "UTC"} in spec["containers"][0].get("env", []), f"{what}: extraEnv")
    if "-aggregator-" in doc["metadata"]["name"]:
        check("topology.kubernetes.io/zone" in spec["nodeSelector"], f"{what}: still pinned to its zone")
    else:
        check("podAntiAffinity" in spec.get("affinity", {}), f"{what}: affinity")


def sidecar_rules(name, deployment):
    spec = deployment["spec"]["template"]["spec"]
    sidecar = next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == "spillway")
    sc = sidecar["securityContext"]
    check(sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["readOnlyRootFilesystem"]
          and sc["capabilities"]["drop"] == ["ALL"], f"{name}: sidecar non-root, read-only, no privileges")
    check(sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
          and sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz", f"{name}: probes on /readyz and /healthz")
    pre = sidecar["lifecycle"]["preStop"]["sleep"]["seconds"]
    check(spec["terminationGracePeriodSeconds"] > pre + 25, f"{name}: grace period {spec['terminationGracePeriodSeconds']} s > preStop {pre} s + drain 25 s")
    if sidecar.get("restartPolicy") == "Always":
        # A native sidecar stops after the app: the app's pause, then the sidecar's and its drain.
        app = next(c for c in spec["containers"] if c["name"] == "app")
        app_pause = app["lifecycle"]["preStop"]["sleep"]["seconds"]
        check(spec["terminationGracePeriodSeconds"] > app_pause + pre + 25,
              f"{name}: grace period {spec['terminationGracePeriodSeconds']} s > the app's pause {app_pause} s + preStop {pre} s + drain 25 s")
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "spillway-config")
    check("subPath" not in mount, f"{name}: config mounted as a directory (ConfigMap updates reach it)")
    app = next(c for c in spec["containers"] if c["name"] == "app")
    check(any("127.0.0.1" in a for a in app.get("args", [])), f"{name}: the app listens on loopback only")
    app_pause = app.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    check(app_pause > pre and spec["terminationGracePeriodSeconds"] > app_pause,
          f"{name}: the app keeps serving past the sidecar's pause ({app_pause} s > {pre} s), within the grace period")
    env = {e["name"]: e.get("value") for e in sidecar.get("env", [])}
    check(env.get("SPILLWAY_LOG_FORMAT") == "json", f"{name}: the sidecar logs JSON lines")


def bad_values():
    chart = helm.Chart.load(CHART)
    for values, field in [
        ({"sidecar": {"port": "eighty", "adminPort": 9901, "appPort": 8081}}, "port"),
        ({"service": "not a name!"}, "service"),
        ({"limits": {"rules": [{"name": "x", "key": []}]}}, "limit"),
        ({"limits": {"rules": [{"name": "x", "key": [], "limit": {"rate": "10/sec"}}]}}, "10/sec"),
        ({"limits": {"rules": [{"name": "x", "key": [], "limit": {"rate": "1/s"}, "scop": "global"}]}}, "scop"),
        ({"controlPlane": {"controller": {"replicas": 9}}}, "replicas"),
        ({"sidecar": {"port": 8080, "adminPort": 9901, "appPort": 8081, "prot": 1}}, "prot"),
        ({"limits": {"rules": [], "config": {"listen": "0.0.0.0:1"}}}, "listen"),
        ({"limits": {"rules": [], "config": {"timeouts": {"client_idel": "1s"}}}}, "client_idel"),
        ({"image": {"repository": "r", "tag": "t", "digest": "latest"}}, "digest"),
    ]:
        try:
            chart.validate_schema(chart.merge_values(values))
            check(False, f"values {values} refused")
        except helm.HelmError as e:
            check(field in str(e), f"values {json.dumps(values)} refused, naming {field!r}: {str(e).splitlines()[0][:160]}")


def bad_releases():
    """Combinations a template refuses with what to do."""
    chart = helm.Chart.load(CHART)
    for values, words in [
        ({"controlPlane": {"enabled": True, "url": "http://agg:7001"}}, "not both"),
        ({"controlPlane": {"url": "http://agg:7001"}, "example": {"enabled": True}}, "token.existingSecret"),
        ({"controlPlane": {"url": "http://agg:7001"}}, "token.existingSecret"),
        ({"service": "shop", "controlPlane": {"enabled": True, "tokens": {"services": ["cart"]}}}, "must list this release's service"),
        ({"sidecar": {"enabled": False}, "controlPlane": {"enabled": True}}, "controlPlane.tokens.services"),
        ({}, "service: name the service"),
    ]:
        try:
            chart.render(values, name="spillway", namespace="shop", is_install=True)
            check(False, f"values {json.dumps(values)} refused")
        except Exception as e:
            check(words in str(e), f"values {json.dumps(values)} refused, saying {words!r}: {str(e).splitlines()[0][:160]}")


def check_configs(configmaps):
    with tempfile.TemporaryDirectory() as d:
        for name, text in configmaps:
            path = os.path.join(d, "spillway.yaml")
            with open(path, "w") as f:
                f.write(text)
            # The token and CA files are the pod's mounts, not this machine's.
            r = subprocess.run([BIN, "check-config", "--skip-files", path], capture_output=True, text=True)
            check(r.returncode == 0, f"{name}: ConfigMap spillway.yaml passes check-config {r.stderr.strip()}")


def config_schema(configmaps):
    """The configuration's JSON Schema (schema/, `spillway schema`) admits every configuration
    we ship or show (config/*.yaml, the yaml examples of README.md and docs/*.md, the chart's
    rendered ConfigMaps), and refuses the shapes check-config refuses."""
    schema = json.load(open(os.path.join(ROOT, "schema", "spillway.schema.json")))
    validator = jsonschema.Draft7Validator(schema)
    r = subprocess.run([BIN, "schema"], capture_output=True, text=True)
    check(r.returncode == 0 and json.loads(r.stdout) == schema, "`spillway schema` prints schema/spillway.schema.json")

    def errors(doc):
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message[:120]}" for e in validator.iter_errors(doc)]

    shown = []
    for path in sorted(os.listdir(os.path.join(ROOT, "config"))):
        # Scenario files (spillway test) and overrides files are not configurations.
        if path.endswith(".yaml") and not path.endswith((".test.yaml", ".keys.yaml")):
            shown.append((f"config/{path}", open(os.path.join(ROOT, "config", path)).read()))
    base = {"service": "s", "listen": "127.0.0.1:8080", "upstream": "http://127.0.0.1:9000"}
    docs = sorted(p for p in os.listdir(os.path.join(ROOT, "docs")) if p.endswith(".md"))
    for page in ["README.md"] + [f"docs/{p}" for p in docs]:
        text = open(os.path.join(ROOT, page)).read()
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", text, re.S)):
            if "{{" in block:
                continue  # a Helm template, not a configuration
            doc = yaml.safe_load(block)
            if isinstance(doc, dict) and ("rules" in doc or "service" in doc):
                # A fragment is shown with the rest of a configuration left out.
                shown.append((f"{page} yaml example {i + 1}", yaml.safe_dump({**base, **doc})))
    shown += [(f"{name}: ConfigMap spillway.yaml", text) for name, text in configmaps]
    for name, text in shown:
        found = errors(yaml.safe_load(text))
        check(not found, f"{name} is valid against the schema {found}")

    # Shapes check-config refuses, each refused by the schema too (an editor flags them as
    # they are typed).
    rule = "rules:\n  - name: r\n    key: [client_ip]\n    limit: { rate: 10/s }\n"
    head = "service: s\nlisten: 127.0.0.1:8080\nupstream: http://127.0.0.1:9000\n"
    for what, text in [
        ("an unknown top-level field", head + "limitz: {}\n"),
        ("a missing upstream", "service: s\nlisten: 127.0.0.1:8080\n"),
        ("a service name with a space", head.replace("service: s", "service: my app")),
        ("a reserved service name", head.replace("service: s", "service: _admin")),
        ("an upstream over https", head.replace("http://", "https://")),
        ("an upstream with a path", head.replace(":9000", ":9000/api")),
        ("a duration without a unit", head + "timeouts: { header_read: 10 }\n"),
        ("a duration in an unknown unit", head + "timeouts: { drain: 5sec }\n"),
        ("an unknown timeout", head + "timeouts: { read: 5s }\n"),
        ("a header limit below 1 KiB", head + "limits: { max_header_bytes: 100 }\n"),
        ("zero connections", head + "limits: { max_connections: 0 }\n"),
        ("an unknown headers mode", head + "headers: sometimes\n"),
        ("a rate without a unit", head + rule.replace("10/s", "10")),
        ("a rate per an unknown unit", head + rule.replace("10/s", "10/sec")),
        ("a zero rate", head + rule.replace("10/s", "0/s")),
        ("a burst of zero", head + rule.replace("rate: 10/s", "rate: 10/s, burst: 0")),
        ("an unknown algorithm", head + rule.replace("rate: 10/s", "rate: 10/s, algorithm: lru")),
        ("an unknown limit field", head + rule.replace("rate: 10/s", "rate: 10/s, brust: 5")),
        ("an unknown key part", head + rule.replace("[client_ip]", "[cookie:session]")),
        ("a key part given twice", head + rule.replace("[client_ip]", "[path, path]")),
        ("a rule name with a slash", head + rule.replace("name: r", "name: a/b")),
        ("a rule without a key", head + rule.replace("    key: [client_ip]\n", "")),
        ("an unknown rule field", head + rule + "    scop: global\n"),
        ("an unknown scope", head + rule + "    scope: cluster\n"),
        ("an unknown on_limit", head + rule + "    on_limit: queue\n"),
        ("a lower-case method", head + rule + "    match: { methods: [get] }\n"),
        ("a cost of zero", head + rule + "    cost: 0\n"),
        ("a cost header without its max", head + rule + "    cost: { header: x-cost }\n"),
        ("a redis URL of another scheme", head + "redis: { url: http://127.0.0.1:6379 }\n"),
        ("a control plane URL of another scheme", head + "control_plane: { url: ftp://agg:7001 }\n"),
    ]:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write(text)
            f.flush()
            r = subprocess.run([BIN, "check-config", "--skip-files", f.name], capture_output=True, text=True)
        found = errors(yaml.safe_load(text))
        check(r.returncode == 2 and found, f"{what}: refused by check-config ({r.returncode}) and by the schema {found[:1]}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args):
    p = subprocess.Popen([BIN] + args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    m = re.search(r"listening on (\S+) \(admin ([^)]+)\)", line)
    if not m:
        p.kill()
        raise RuntimeError(f"{args}: no readiness line: {line!r}")
    return p, m.group(1), m.group(2)


def metrics(admin):
    text = urllib.request.urlopen(f"http://{admin}/metrics", timeout=5).read().decode()
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M)), text


def wait_port(port, what, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")


class App(http.server.BaseHTTPRequestHandler):
    """The app behind the proxy: 200 to everything, saying it used 42 units."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "2")
        self.send_header("x-usage-tokens", "42")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def monitoring():
    """Two releases in two namespaces with alerts and dashboards on: each release's alerts
    watch only its namespace's sidecars (or what metrics.prometheusRule.selector names), every
    alert has a runbook_url whose anchor docs/runbooks.md has, promtool accepts the rules, and
    each release installs a dashboard of its own uid and file name (one shared uid on ask)."""
    chart = helm.Chart.load(CHART)
    on = {"service": "shop", "controlPlane": {"enabled": True},
          "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}

    def objects(values, name, namespace):
        out = {}
        for doc in manifests(chart.render(values, name=name, namespace=namespace, is_install=True)):
            if doc.get("kind") in ("PrometheusRule", "ConfigMap"):
                out.setdefault(doc["kind"], []).append(doc)
        return out

    def alerts(got):
        return [r for g in got["PrometheusRule"][0]["spec"]["groups"] for r in g["rules"]]

    def dashboard_of(got):
        return next(c for c in got["ConfigMap"] if c["metadata"]["name"].endswith("-dashboard"))

    with open(os.path.join(ROOT, "docs", "runbooks.md")) as f:
        anchors = {re.sub(r"[^a-z0-9_-]", "", h.strip().lower().replace(" ", "-"))
                   for h in re.findall(r"^#+ (.+)$", f.read(), re.M)}
    uids, files = set(), set()
    # Two teams' releases in one namespace, and a third in another.
    for name, namespace, service in [("shop", "web", "shop"), ("books", "web", "books"), ("cart", "cart", "cart")]:
        got = objects({**on, "service": service}, name, namespace)
        rules = alerts(got)
        scoped = all(f'namespace="{namespace}",spillway_service="{service}"' in r["expr"] for r in rules)
        check(len(rules) >= 5 and scoped,
              f"alerts of release {namespace}/{name}: {len(rules)}, each scoped to its namespace and service {service}")
        for r in rules:
            url = r["annotations"].get("runbook_url", "")
            check(url.startswith("https://") and "docs/runbooks.md#" in url and url.split("#")[1] in anchors,
                  f"alert {r['alert']}: runbook_url {url} names a section of docs/runbooks.md")
        d = tempfile.mkdtemp(prefix="spillway-rules-")
        with open(os.path.join(d, "rules.yml"), "w") as f:
            yaml.safe_dump({"groups": got["PrometheusRule"][0]["spec"]["groups"]}, f)
        r = subprocess.run(["promtool", "check", "rules", os.path.join(d, "rules.yml")], capture_output=True, text=True)
        check(r.returncode == 0, f"promtool check rules ({namespace}/{name}) {'' if r.returncode == 0 else r.stdout + r.stderr}")
        dash = dashboard_of(got)
        (key, text), = dash["data"].items()
        uid = json.loads(text)["uid"]
        uids.add(uid)
        files.add(key)
        title = json.loads(text)["title"]
        check(key == f"{uid}.json" and len(uid) <= 40 and title == f"Spillway ({namespace}/{name}-spillway)",
              f"dashboard of {namespace}/{name}: uid {uid}, file {key}, title {title}")
    check(len(uids) == 3 and len(files) == 3, f"three releases install three dashboards, not one uid twice {sorted(uids)}")
    everywhere = json.loads(json.dumps(on))
    everywhere["metrics"]["serviceMonitor"]["allNamespaces"] = True
    got = objects(everywhere, "shop", "web")
    rules = alerts(got)
    check(all('spillway_service="shop"' in r["expr"] and "namespace=" not in r["expr"] for r in rules),
          "with serviceMonitor.allNamespaces the alerts watch the service's sidecars in every namespace")
    mine = json.loads(json.dumps(on))
    mine["metrics"]["prometheusRule"]["selector"] = 'job="monitoring/shop-sidecars"'
    mine["dashboard"] = {"uid": "spillway-all"}
    got = objects(mine, "shop", "shop")
    rules = alerts(got)
    check(all('job="monitoring/shop-sidecars"' in r["expr"] and 'namespace="shop"' not in r["expr"] for r in rules),
          "metrics.prometheusRule.selector replaces the namespace scope")
    dash = dashboard_of(got)
    check(json.loads(dash["data"]["spillway-all.json"])["uid"] == "spillway-all", "dashboard.uid gives one shared dashboard")
    # A value that would end its matcher early and append PromQL of its own (an alert that
    # always fires, or never) is refused by the values schema, not rendered.
    for bad in ['namespace="a" or vector(1)', "x", 'a="\\",b=" }) > 0 or vector(1) #"', 'a="x"} or vector(1) #']:
        v = json.loads(json.dumps(on))
        v["metrics"]["prometheusRule"]["selector"] = bad
        try:
            chart.render(v, name="shop", namespace="shop", is_install=True)
            check(False, f"selector {bad!r} refused by the values schema")
        except helm.HelmError as e:
            check("schema" in str(e) and "selector" in str(e), f"selector {bad!r} refused by the values schema {'' if 'schema' in str(e) else str(e)[:200]}")
    v = json.loads(json.dumps(on))
    v["metrics"]["prometheusRule"]["selector"] = 'job="a\\"b"'
    got = objects(v, "shop", "shop")
    check(all('{job="a\\"b"}' in r["expr"] or 'job="a\\"b"}' in r["expr"] for r in alerts(got)),
          "a selector's escaped quote stays inside its value")


def dashboard():
    """Every panel of the dashboard shows data: a proxy (with a global, a Redis, an adaptive, a
    shadow and a response-cost rule), an aggregator and a controller run on loopback with a real app and a real
    Redis, a real Prometheus scrapes them (labelled as the chart's monitors label a pod), and
    each panel's queries run against it as Grafana sends them with every variable on "All"."""
    with open(os.path.join(CHART, "files", "dashboard.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    # The alerts' expressions too: an alert on a metric nobody exports never fires.
    with open(os.path.join(CHART, "templates", "monitoring.yaml")) as f:
        # (`spillway_service` is the label every proxy series carries, not a metric.)
        exprs += [n for n in re.findall(r"spillway_[a-z_]+", f.read()) if n != "spillway_service"]
    wanted = set()
    for e in exprs:
        # Label names (in `by (...)`, `without (...)` and `{...}` matchers) are not metrics.
        e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
        e = re.sub(r"\{[^}]*\}", "", e)
        for name in re.findall(r"\b(spillway_[a-z_]+)", e):
            wanted.add(re.sub(r"_(bucket|sum|count)$", "", name))
    check(len(dash["panels"]) >= 8, f"dashboard parses: {len(dash['panels'])} panels, {len(wanted)} metrics")
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    check({"namespace", "service", "pod", "rule"} <= set(variables), f"dashboard variables: {sorted(variables)}")

    procs = []
    d = tempfile.mkdtemp(prefix="spillway-chart-")
    app = http.server.ThreadingHTTPServer(("127.0.0.1", 0), App)
    threading.Thread(target=app.serve_forever, daemon=True).start()
    done = threading.Event()
    senders = []
    try:
        redis_port = free_port()
        procs.append(subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no", "--dir", d],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port(redis_port, "redis-server")
        ctl, ctl_addr, ctl_admin = start(["controller", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        procs.append(ctl)
        agg, agg_addr, agg_admin = start(["aggregator", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
                                          "--controller", f"http://{ctl_addr}", "--zone", "z", "--interval", "200ms"])
        procs.append(agg)
        config = os.path.join(d, "spillway.yaml")
        with open(config, "w") as f:
            f.write(f"""service: shop
listen: 127.0.0.1:0
admin: 127.0.0.1:0
upstream: http://127.0.0.1:{app.server_address[1]}
timeouts: {{ upstream_response: 1s }}
control_plane: {{ url: 'http://{agg_addr}', report_interval: 200ms }}
redis: {{ url: 'redis://127.0.0.1:{redis_port}', timeout: 50ms }}
rules:
  - name: per-key
    key: [header:x-api-key]
    limit: {{ rate: 20/s }}
    scope: global
  - name: exact
    match: {{ path: /exact }}
    key: [client_ip]
    limit: {{ rate: 5/m }}
    scope: redis
  - name: app
    key: []
    limit: {{ adaptive: {{ max: 64 }} }}
  - name: shadowed
    key: [client_ip]
    limit: {{ rate: 1/h }}
    mode: shadow
  - name: tokens
    match: {{ path: /tokens }}
    key: [client_ip]
    limit: {{ rate: 100/s, burst: 1000 }}
    cost: {{ response: {{ header: x-usage-tokens }}, max: 4000 }}
""")
        proxy, proxy_addr, proxy_admin = start(["proxy", "--config", config])
        procs.append(proxy)

        # Traffic from a few threads all along, so that rates and the control plane's
        # per-rule figures (shown while a report with their counts is fresh) have data.
        def send(path):
            while not done.is_set():
                req = urllib.request.Request(f"http://{proxy_addr}{path}", headers={"x-api-key": "k"})
                try:
                    urllib.request.urlopen(req, timeout=2).read()
                except Exception:
                    pass

        senders = [threading.Thread(target=send, args=(p,)) for p in ["/", "/", "/", "/exact", "/tokens"]]
        for t in senders:
            t.start()
        # A name counts once any read showed it; bounded: 30 s.
        names = set()
        deadline = time.time() + 30
        while time.time() < deadline and not wanted <= names:
            for admin in (proxy_admin, agg_admin, ctl_admin):
                names |= metrics(admin)[0]
            time.sleep(0.1)
        missing = sorted(wanted - names)
        check(not missing, f"every metric the dashboard queries is exported {missing or ''}")

        # A real Prometheus scraping the three as the Prometheus Operator's monitors would:
        # every target label the Operator sets (namespace, service, pod, container, endpoint,
        # job), every second. A label of ours with one of those names would come back as
        # exported_*.
        prom_port = free_port()
        jobs = "".join(f"""  - job_name: {job}
    scrape_interval: 1s
    static_configs:
      - targets: ['{admin}']
        labels: {{ namespace: shop, service: {service}, pod: {job}-0, container: spillway, endpoint: admin, job: {service} }}
""" for job, service, admin in [("sidecar", "shop-app", proxy_admin), ("aggregator", "spillway-aggregator", agg_admin),
                                 ("controller", "spillway-controller", ctl_admin)])
        with open(os.path.join(d, "prometheus.yml"), "w") as f:
            f.write("global: { scrape_interval: 1s, evaluation_interval: 1s }\nscrape_configs:\n" + jobs)
        procs.append(subprocess.Popen(["prometheus", f"--config.file={d}/prometheus.yml",
                                       f"--storage.tsdb.path={d}/tsdb", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port(prom_port, "prometheus", 60)
        # It listens before its storage is open: its API answers 503 until /-/ready says 200.
        deadline = time.time() + 60
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/-/ready", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("prometheus did not become ready")
            time.sleep(0.2)

        def query(expr):
            # Grafana's "All" for each variable, and its rate interval for a 1 s scrape.
            for name, v in variables.items():
                expr = expr.replace(f"${name}", v.get("allValue") or ".*")
            expr = expr.replace("$__rate_interval", "10s")
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            body = json.load(urllib.request.urlopen(url, timeout=5))
            return [r for r in body["data"]["result"] if r["value"][1] not in ("NaN", "+Inf", "-Inf")]

        # Each panel has data once any of its queries returns a number; bounded: 60 s.
        empty = {p["title"] for p in dash["panels"]}
        deadline = time.time() + 60
        while empty and time.time() < deadline:
            for p in dash["panels"]:
                if p["title"] in empty and any(query(t["expr"]) for t in p["targets"]):
                    empty.discard(p["title"])
            time.sleep(0.5)
        check(not empty, f"every dashboard panel shows data in a real Prometheus ({len(dash['panels'])} panels) {sorted(empty) or ''}")
        # No series lost a label to the scraper's, and the controller's panels group by the
        # service the rules are of, not the Kubernetes Service scraped.
        every = query('{__name__=~"spillway_.+"}')
        renamed = sorted({k for r in every for k in r["metric"] if k.startswith("exported_")})
        check(every and not renamed, f"no label of ours renamed exported_* by the scraper's ({len(every)} series) {renamed or ''}")
        fleet = [r for p in dash["panels"] for t in p["targets"] if "spillway_controller_" in t["expr"] for r in query(t["expr"])]
        check(fleet and all(r["metric"].get("spillway_service") == "shop" for r in fleet),
              f"the controller's panels show service shop ({len(fleet)} series) {[r['metric'] for r in fleet if r['metric'].get('spillway_service') != 'shop'][:2]}")
    finally:
        done.set()
        for t in senders:
            t.join()
        app.shutdown()
        for p in procs:
            p.kill()
            p.wait()


def inject():
    """`spillway inject` on a sample app: every manifest it prints is valid Kubernetes, the
    ConfigMap it writes passes check-config, and a second pass changes nothing."""
    sample = os.path.join(ROOT, "tests", "chart", "sample-app.yaml")
    for flags in ([], ["--native-sidecar", "--network-policy", "--release", "shop-limits"]):
        what = "inject " + (" ".join(flags) or "(defaults)")
        out = subprocess.run([BIN, "inject", sample] + flags, capture_output=True, text=True)
        check(out.returncode == 0, f"{what}: exits 0 {out.stderr.strip() if out.returncode else ''}")
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        # A line per workload on stderr: what was fronted, what was not, what was skipped.
        said = out.stderr
        for name in ("shop", "ledger", "books", "reindex"):
            check(f'"{name}"' in said, f"{what}: the summary names {name}")
        check('Deployment "books": injected: container "books" port http (8080)' in said
              and "metrics (9100)" in said and "grpc (9090)" in said,
              f"{what}: books is fronted on its http port, metrics and grpc named as not fronted")
        native = "--native-sidecar" in flags
        check(('CronJob "reindex": skipped' in said) != native,
              f"{what}: the CronJob is {'injected' if native else 'skipped, and why'}")
        books = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "books"][0]
        check(books["spec"]["ports"][0]["targetPort"] == "http" and books["spec"]["ports"][1]["targetPort"] == "grpc",
              f"{what}: the Service that targeted 8080 by number now targets the sidecar")
        release = "shop-limits" if "--release" in flags else "spillway"
        for doc in docs:
            if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
                label = doc["spec"]["template"]["metadata"]["labels"].get("spillway.dev/sidecar")
                check(label == release, f"{what}: {doc['metadata']['name']} labelled for the PodMonitor of release {release!r}")
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, K8S, strict=True)
                check(True, f"{what}: {doc['kind']} {doc['metadata']['name']} valid against Kubernetes {K8S}")
            except kubernetes_validate.ValidationError as e:
                check(False, f"{what}: {doc['kind']} {doc['metadata']['name']}: {e.message} at {list(e.path)}")
            if doc["kind"] == "ConfigMap":
                d = tempfile.mkdtemp(prefix="spillway-inject-")
                path = os.path.join(d, "spillway.yaml")
                with open(path, "w") as f:
                    f.write(doc["data"]["spillway.yaml"])
                r = subprocess.run([BIN, "check-config", path], capture_output=True, text=True)
                check(r.returncode == 0, f"{what}: ConfigMap {doc['metadata']['name']} passes check-config {r.stderr.strip()}")
        again = subprocess.run([BIN, "inject", "-"] + flags, input=out.stdout, capture_output=True, text=True)
        check(again.returncode == 0 and [d for d in yaml.safe_load_all(again.stdout) if d] == docs,
              f"{what}: a second pass changes nothing")


def pair():
    """One install model: a release's NOTES name the `spillway inject` flags; injected so, a
    workload mounts that release's limits ConfigMap and Secrets (each rendered by the chart),
    and the sidecar's config (the ConfigMap under the pod's own --listen, --admin and
    --upstream) passes check-config."""
    chart = helm.Chart.load(CHART)
    sample = os.path.join(ROOT, "tests", "chart", "sample-app.yaml")
    for name, values in [
        ("another release's control plane, TLS", {
            "service": "shop",
            "controlPlane": {"url": "https://spillway-aggregator.spillway-system:7001",
                             "token": {"existingSecret": "spillway-token"}, "tls": {"existingSecret": "spillway-ca"}}}),
        ("its own control plane, per-service tokens", {"service": "shop", "controlPlane": {"enabled": True}}),
        ("no control plane", {"service": "shop"}),
    ]:
        what = f"inject for a release ({name})"
        rendered = chart.render(values, name="shop", namespace="web", is_install=True)
        notes = next(t for p, t in rendered.items() if p.endswith("NOTES.txt"))
        said = re.search(r"`spillway inject ([^`]*)`", notes)
        check(said is not None, f"{what}: NOTES names the inject command")
        if said is None:
            continue
        flags = said.group(1).split()
        objects = {(d["kind"], d["metadata"]["name"]): d for d in manifests(rendered)}
        out = subprocess.run([BIN, "inject", sample, "--native-sidecar"] + flags, capture_output=True, text=True)
        check(out.returncode == 0, f"{what}: inject {' '.join(flags)} exits 0 {out.stderr.strip() if out.returncode else ''}")
        for doc in [d for d in yaml.safe_load_all(out.stdout) if d]:
            pod = {"Pod": lambda d: d["spec"], "CronJob": lambda d: d["spec"]["jobTemplate"]["spec"]["template"]["spec"]}.get(
                doc["kind"], lambda d: d["spec"]["template"]["spec"])(doc) if doc["kind"] in ("Deployment", "StatefulSet", "CronJob") else None
            if pod is None:
                continue
            who = f"{what}: {doc['kind']} {doc['metadata']['name']}"
            try:
                kubernetes_validate.validate(doc, K8S, strict=True)
            except kubernetes_validate.ValidationError as e:
                check(False, f"{who}: {e.message} at {list(e.path)}")
            vols = {v["name"]: v for v in pod["volumes"]}
            cm = objects.get(("ConfigMap", vols["spillway-config"]["configMap"]["name"]))
            check(cm is not None, f"{who}: mounts the release's limits ConfigMap {vols['spillway-config']['configMap']['name']}")
            key = vols["spillway-key-secret"]["secret"]["secretName"]
            check(("Secret", key) in objects, f"{who}: mounts the release's key Secret {key}")
            token = vols["spillway-token"]["secret"]
            if values.get("controlPlane", {}).get("enabled"):
                rendered_token = objects.get(("Secret", token["secretName"]), {})
                check(token["items"][0]["key"] in rendered_token.get("data", {}),
                      f"{who}: mounts its service's token from the release's Secret {token}")
            if cm is None:
                continue
            sidecar = next(c for c in pod["initContainers"] if c["name"] == "spillway")
            config = sidecar_config(who, yaml.safe_load(cm["data"]["spillway.yaml"]), sidecar["args"])
            declared = {p["containerPort"] for p in sidecar["ports"]}
            check({int(config["listen"].rsplit(":", 1)[1]), int(config["admin"].rsplit(":", 1)[1])} == declared,
                  f"{who}: the sidecar listens on the ports it declares {declared}")


def sidecar_config(who, limits, args):
    """The limits file as an injected sidecar runs it (its --listen, --admin and --upstream
    over the file's), checked by check-config; returned."""
    config = dict(limits)
    for flag in ("--listen", "--admin", "--upstream"):
        config[flag[2:]] = args[args.index(flag) + 1]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "spillway.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        r = subprocess.run([BIN, "check-config", "--skip-files", path], capture_output=True, text=True)
        check(r.returncode == 0, f"{who}: its sidecar's config passes check-config {r.stderr.strip()}")
    return config


def injector():
    """`spillway injector` as the chart deploys it (its settings from the rendered ConfigMap),
    over HTTPS on loopback: real AdmissionReview v1 requests for pods of a Deployment, a
    StatefulSet and a Job, an injected pod again, a pod with no HTTP port and pods of
    kube-system and its own namespace. Each answer allows; a returned JSONPatch is applied and
    the pod validated against Kubernetes, its sidecar's config run through check-config."""
    import ssl
    chart = helm.Chart.load(CHART)

    def objects_of(values, name, namespace):
        rendered = chart.render(values, name=name, namespace=namespace, is_install=True)
        return {(d["kind"], d["metadata"]["name"]): d for d in manifests(rendered)}

    # The control plane and the injector in spillway-system; a team's sidecar-only release,
    # named as injector.release says, in the namespace whose pods are injected.
    objects = objects_of(VALUE_SETS["injector"], "shop", "spillway-system")
    team = objects_of({"service": "books", "controlPlane": {
        "url": "http://shop-spillway-aggregator.spillway-system:7001", "token": {"existingSecret": "spillway-token"}}},
        "spillway", "web")
    hooks = objects[("MutatingWebhookConfiguration", "shop-spillway-injector-spillway-system")]["webhooks"]
    check([h["clientConfig"]["service"]["path"] for h in hooks] == ["/inject", "/inject-annotated"]
          and all(h["failurePolicy"] == "Ignore" and "caBundle" in h["clientConfig"] for h in hooks)
          and all({"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "spillway-system"]}
                  in h["namespaceSelector"]["matchExpressions"] for h in hooks),
          "injector: two webhooks (namespaces that asked, annotated pods), failurePolicy Ignore, never kube-system or its own")
    settings = objects[("ConfigMap", "shop-spillway-injector")]["data"]["injector.yaml"]
    limits = yaml.safe_load(team[("ConfigMap", "spillway-limits")]["data"]["spillway.yaml"])
    d = tempfile.mkdtemp(prefix="spillway-injector-")
    run = lambda *a: subprocess.run(["openssl", *a], cwd=d, capture_output=True, check=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test CA", "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "tls.key", "-out", "tls.csr")
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "san.ext", "-out", "tls.crt")
    with open(os.path.join(d, "injector.yaml"), "w") as f:
        f.write(settings)
    proc = subprocess.Popen([BIN, "injector", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
                             "--config", os.path.join(d, "injector.yaml"), "--namespace", "spillway-system",
                             "--tls-cert", os.path.join(d, "tls.crt"), "--tls-key", os.path.join(d, "tls.key")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        addr = line.split("listening on ")[1].split(" ")[0]
        tls = ssl.create_default_context(cafile=os.path.join(d, "ca.crt"))

        def review(namespace, pod, path="/inject"):
            body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "operation": "CREATE", "namespace": namespace, "object": pod}}).encode()
            req = urllib.request.Request(f"https://{addr}{path}", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, context=tls, timeout=10) as r:
                return json.load(r)["response"]

        def patched(pod, response):
            pod = json.loads(json.dumps(pod))
            for op in json.loads(base64.b64decode(response["patch"])):
                *parents, last = op["path"].strip("/").split("/")
                target = pod
                for p in parents:
                    target = target.setdefault(p, {})
                check(op["op"] in ("add", "replace"), f"injector: a patch op it can apply ({op['op']})")
                target[last] = op["value"]
            return pod

        sample = {(x["kind"], x["metadata"]["name"]): x for x in yaml.safe_load_all(open(os.path.join(ROOT, "tests", "chart", "sample-app.yaml"))) if x}

        def pod_of(kind, name, owner):
            template = json.loads(json.dumps(sample[(kind, name)]["spec"]))
            template = template["jobTemplate"]["spec"]["template"] if kind == "CronJob" else template["template"]
            meta = dict(template["metadata"], generateName=f"{name}-", ownerReferences=[
                {"apiVersion": "apps/v1" if owner != "Job" else "batch/v1", "kind": owner, "name": name, "uid": "1"}])
            return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}

        for (kind, name, owner) in [("Deployment", "books", "ReplicaSet"), ("StatefulSet", "ledger", "StatefulSet"),
                                    ("CronJob", "reindex", "Job")]:
            what = f"injector: a pod of {kind} {name}"
            pod = pod_of(kind, name, owner)
            response = review("web", pod)
            check(response["allowed"] and response.get("patchType") == "JSONPatch", f"{what}: allowed, with a JSONPatch")
            if "patch" not in response:
                continue
            after = patched(pod, response)
            after["metadata"]["name"] = f"{name}-x1"
            try:
                kubernetes_validate.validate(after, K8S, strict=True)
                check(True, f"{what}: the patched pod is valid against Kubernetes {K8S}")
            except kubernetes_validate.ValidationError as e:
                check(False, f"{what}: the patched pod: {e.message} at {list(e.path)}")
            spec = after["spec"]
            sidecar = next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "spillway")
            vols = {v["name"]: v for v in spec["volumes"]}
            mounted = [("ConfigMap", vols["spillway-config"]["configMap"]["name"]),
                       ("Secret", vols["spillway-key-secret"]["secret"]["secretName"])]
            check(all(m in team for m in mounted)
                  and vols["spillway-token"]["secret"]["secretName"] == "spillway-token"
                  and after["metadata"]["labels"]["spillway.dev/sidecar"] == "spillway",
                  f"{what}: mounts the limits and key Secret its own namespace's release renders {mounted}, "
                  "the token that release names, and is labelled for that release's PodMonitor")
            defaults = yaml.safe_load(open(os.path.join(CHART, "values.yaml")))
            check(sidecar["resources"] == defaults["sidecar"]["resources"] and sidecar["image"].startswith("ghcr.io/spillway/spillway"),
                  f"{what}: the image and resources of the injector's settings")
            sidecar_config(what, limits, sidecar["args"])
            again = review("web", after)
            check(again["allowed"] and "patch" not in again, f"{what}: injected again, left as it is")
        # Asked for, but not possible: admitted as it is, and why.
        metrics_only = pod_of("Deployment", "books", "ReplicaSet")
        metrics_only["spec"]["containers"][0]["ports"] = [{"name": "metrics", "containerPort": 9100}]
        response = review("web", metrics_only)
        check(response["allowed"] and "patch" not in response and "not injected" in " ".join(response.get("warnings", [])),
              f"injector: a pod with no HTTP port is admitted as it is, with a warning {response.get('warnings')}")
        for ns in ("kube-system", "spillway-system"):
            response = review(ns, pod_of("Deployment", "books", "ReplicaSet"))
            check(response["allowed"] and "patch" not in response, f"injector: a pod of {ns} is never injected")
        plain = pod_of("Deployment", "books", "ReplicaSet")
        response = review("web", plain, "/inject-annotated")
        check(response["allowed"] and "patch" not in response, "injector: an unannotated pod where the namespace did not ask is left")
        plain["metadata"]["annotations"] = {"spillway.dev/inject": "enabled"}
        response = review("web", plain, "/inject-annotated")
        check("patch" in response, "injector: a pod annotated spillway.dev/inject: enabled is injected")
        # Any pod can reach it: a body of tiny values or past 3 MiB is refused before it is
        # parsed, and it still answers.
        for what, body in [("a million and a half values", b'{"kind":"AdmissionReview","request":{"x":[' + b"0," * 1_400_000 + b"0]}}"),
                           ("4 MiB", b'{"kind":"AdmissionReview","request":{"x":"' + b"a" * (4 << 20) + b'"}}')]:
            req = urllib.request.Request(f"https://{addr}/inject", data=body, headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, context=tls, timeout=30)
                status = 200
            except urllib.error.HTTPError as e:
                status = e.code
            except (ConnectionError, urllib.error.URLError):
                status = "closed"
            check(status in (400, 413, "closed"), f"injector: a review of {what} is refused unparsed ({status})")
        check(review("web", pod_of("Deployment", "books", "ReplicaSet")).get("patch"), "injector: still answers after them")
        # With failurePolicy Ignore a pod may start without it: check-injection finds it.
        injected = patched(plain, response)
        injected["metadata"].update(name="books-1", namespace="web")
        missed = json.loads(json.dumps(plain))
        missed["metadata"].update(name="books-2", namespace="web")
        cluster = {"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "web", "labels": {"spillway.dev/inject": "enabled"}}},
            injected, missed]}
        r = subprocess.run([BIN, "check-injection", "-"], input=json.dumps(cluster), capture_output=True, text=True)
        check(r.returncode == 1 and r.stdout.startswith("web/books-2:") and "books-1" not in r.stdout,
              f"injector: check-injection lists the pod that runs without the sidecar {r.stdout.strip()[:120]}")
    finally:
        proc.kill()
        proc.wait()


hadolint()
release()
inject()
pair()
injector()
configmaps = lint_and_render()
bad_values()
bad_releases()
subchart()
check_configs(configmaps)
config_schema(configmaps)
monitoring()
dashboard()
print(f"\n{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
