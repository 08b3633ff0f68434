{{/* Names and labels. */}}
{{- define "spillway.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "spillway.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := .Values.nameOverride | default .Chart.Name -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "spillway.labels" -}}
app.kubernetes.io/name: {{ include "spillway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "spillway.selector" -}}
app.kubernetes.io/name: {{ include "spillway.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The control plane's image, from the chart's context: pinned by digest when one is
given, else image.tag, else the chart's appVersion (the release of that version). */}}
{{- define "spillway.image" -}}
{{- include "spillway.imageOf" (merge (dict "appVersion" .Chart.AppVersion) (deepCopy .Values.image)) -}}
{{- end -}}

{{/* The sidecar's image (JSON), from a values dict and the chart's appVersion (`appVersion`
beside `values`; this chart's own templates give it): sidecar.image over image; another
repository is not pinned by image.digest. */}}
{{- define "spillway.sidecarImage" -}}
{{- $own := .values.sidecar.image | default dict -}}
{{- $image := mergeOverwrite (deepCopy .values.image) (ternary (dict "digest" "") dict (hasKey $own "repository")) (deepCopy $own) -}}
{{- $_ := set $image "appVersion" (.appVersion | default "") -}}
{{- $image | toJson -}}
{{- end -}}

{{- define "spillway.imageOf" -}}
{{- if .digest -}}
{{ .repository }}@{{ .digest }}
{{- else -}}
{{ .repository }}:{{ .tag | default .appVersion | required "spillway: no image tag: set image.tag, or pass \"appVersion\" .Subcharts.spillway.Chart.AppVersion to spillway.sidecar" }}
{{- end -}}
{{- end -}}

{{/* "true" when the control plane gives each service its own token (the default), from the
controlPlane values: one shared token only when asked for (token.shared, token.value or
token.existingSecret) and no per-service tokens are named. */}}
{{- define "spillway.perServiceTokens" -}}
{{- if or .tokens.existingSecret .tokens.services (not (or .token.shared .token.value .token.existingSecret)) -}}true{{- end -}}
{{- end -}}

{{/* "true" when a sidecar of this release mounts its token from the tokens Secret: its
service's own, or a generated shared one (`_shared`). A shared token given as a value or a
Secret is mounted from that Secret (key token). */}}
{{- define "spillway.tokenDir" -}}
{{- if or (include "spillway.perServiceTokens" .) (not (or .token.value .token.existingSecret)) -}}true{{- end -}}
{{- end -}}

{{/* The services given a generated token: tokens.services, or this release's own service;
`_shared` for a generated shared token; none for a shared token given as a value or Secret. */}}
{{- define "spillway.tokenServices" -}}
{{- $cp := .Values.controlPlane -}}
{{- if not (include "spillway.tokenDir" $cp) -}}
{{- else if not (include "spillway.perServiceTokens" $cp) -}}
{{- "_shared" -}}
{{- else if $cp.tokens.services -}}
{{- join "," $cp.tokens.services -}}
{{- else if .Values.sidecar.enabled -}}
{{- .Values.service -}}
{{- else -}}
{{- fail "controlPlane.tokens.services: list the services whose proxies report to this control plane (each gets its own token), or set controlPlane.token.shared: true for one token shared by all" -}}
{{- end -}}
{{- end -}}

{{/* The tokens Secret the control plane reads as a directory (--tokens): given, or generated
(with the aggregators', admin and metrics tokens in every mode, so that only the aggregators
send zone sums). */}}
{{- define "spillway.tokensSecret" -}}
{{- .Values.controlPlane.tokens.existingSecret | default (printf "%s-tokens" (include "spillway.fullname" .)) -}}
{{- end -}}

{{/* The control-plane server flags and mounts for tokens and TLS (controller and aggregators). */}}
{{- define "spillway.serverSecurityArgs" -}}
- --tokens=/var/run/secrets/spillway
{{- if .Values.controlPlane.tls.existingSecret }}
- --tls-cert=/var/run/secrets/spillway-tls/tls.crt
- --tls-key=/var/run/secrets/spillway-tls/tls.key
{{- end }}
{{- end -}}

{{- define "spillway.serverSecurityMounts" -}}
- { name: token, mountPath: /var/run/secrets/spillway, readOnly: true }
{{- if .Values.controlPlane.tls.existingSecret }}
- { name: tls, mountPath: /var/run/secrets/spillway-tls, readOnly: true }
{{- end }}
{{- end -}}

{{- define "spillway.serverSecurityVolumes" -}}
- name: token
  {{- if include "spillway.tokenDir" .Values.controlPlane }}
  secret:
    secretName: {{ include "spillway.tokensSecret" . }}
  {{- else }}
  # A shared token given as a value or a Secret, as `_shared`, beside the generated
  # aggregators', admin and metrics tokens.
  projected:
    sources:
      - secret:
          name: {{ include "spillway.tokenSecret" . }}
          items:
            - { key: token, path: _shared }
      - secret:
          name: {{ include "spillway.tokensSecret" . }}
  {{- end }}
{{- with .Values.controlPlane.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- end -}}

{{/* http or https, as the control plane speaks. */}}
{{- define "spillway.controlScheme" -}}
{{- if .controlPlane.tls.existingSecret }}https{{ else }}http{{ end -}}
{{- end -}}

{{/* Every controller's URL, comma-separated: <full>-controller-<i>.<full>-controller-pods. */}}
{{- define "spillway.controllerUrls" -}}
{{- $cp := .Values.controlPlane -}}
{{- $name := printf "%s-controller" (include "spillway.fullname" .) -}}
{{- $scheme := include "spillway.controlScheme" .Values -}}
{{- $urls := list -}}
{{- range $i := until (int $cp.controller.replicas) -}}
{{- $urls = append $urls (printf "%s://%s-%d.%s-pods.%s.svc:%d" $scheme $name $i $name $.Release.Namespace (int $cp.controller.port)) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}

{{- define "spillway.tokenSecret" -}}
{{- .Values.controlPlane.token.existingSecret | default (printf "%s-token" (include "spillway.fullname" .)) -}}
{{- end -}}

{{/* Hardened container security context: non-root, read-only root, no privileges. */}}
{{- define "spillway.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "spillway.scrapeAnnotations" -}}
{{- if .root.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/*
The sidecar container, for your own chart (with this one as a dependency):

  containers:
    - name: app
      ...                       # listening on 127.0.0.1 only (sidecar.appPort)
    {{- include "spillway.sidecar" (dict "values" .Values.spillway "release" "spillway" "appVersion" .Subcharts.spillway.Chart.AppVersion) | nindent 4 }}
  volumes:
    {{- include "spillway.sidecarVolumes" (dict "values" .Values.spillway "release" "spillway") | nindent 4 }}
  terminationGracePeriodSeconds: {{ include "spillway.terminationGracePeriod" .Values.spillway }}

`values` are this chart's values (`.Values.spillway` in the parent); `release` is the full name
of the release that installed this chart (its ConfigMap `<release>-limits` and token);
`appVersion` is this chart's, the image tag when `image.tag` is empty (the default). Label the
pod `spillway.dev/sidecar: <release>` for that release's PodMonitor. Give the app container
`{{- include "spillway.appLifecycle" .Values.spillway | nindent 6 }}`, so that it keeps serving
while the sidecar stops taking requests. With `sidecar.native`, put the sidecar under
`initContainers` instead (Kubernetes >= 1.29): it starts before the app and stops after it.
*/}}
{{- define "spillway.sidecar" -}}
{{- $v := .values -}}
- name: spillway
  {{- if $v.sidecar.native }}
  restartPolicy: Always
  {{- end }}
  {{- $image := include "spillway.sidecarImage" (dict "values" $v "appVersion" .appVersion) | fromJson }}
  image: {{ include "spillway.imageOf" $image }}
  imagePullPolicy: {{ $image.pullPolicy }}
  args: ["proxy", "--config", "/etc/spillway/spillway.yaml"]
  env:
    - name: RUST_LOG
      value: info
    - name: SPILLWAY_LOG_FORMAT
      value: {{ $v.logFormat | default "json" | quote }}
    {{- with $v.sidecar.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - { name: http, containerPort: {{ $v.sidecar.port }}, protocol: TCP }
    - { name: spillway-admin, containerPort: {{ $v.sidecar.adminPort }}, protocol: TCP }
  readinessProbe:
    httpGet: { path: /readyz, port: spillway-admin }
    periodSeconds: 2
    failureThreshold: 1
  livenessProbe:
    httpGet: { path: /healthz, port: spillway-admin }
    periodSeconds: 10
    failureThreshold: 3
  lifecycle:
    # Let the endpoints controller take the pod out of Services before the drain starts.
    preStop:
      sleep: { seconds: {{ $v.sidecar.preStopSeconds }} }
  resources:
    {{- toYaml $v.sidecar.resources | nindent 4 }}
  securityContext:
    {{- with $v.sidecar.securityContext }}
    {{- toYaml . | nindent 4 }}
    {{- else }}
    {{- include "spillway.containerSecurityContext" . | nindent 4 }}
    {{- end }}
  volumeMounts:
    # A directory mount, not subPath: ConfigMap updates arrive (the ..data symlink swap)
    # and the sidecar reloads them.
    - { name: spillway-config, mountPath: /etc/spillway, readOnly: true }
    - { name: spillway-key-secret, mountPath: /var/run/secrets/spillway-key, readOnly: true }
    {{- if or $v.controlPlane.enabled $v.controlPlane.url }}
    - { name: spillway-token, mountPath: /var/run/secrets/spillway, readOnly: true }
    {{- if $v.controlPlane.tls.existingSecret }}
    - { name: spillway-tls, mountPath: /var/run/secrets/spillway-tls, readOnly: true }
    {{- end }}
    {{- end }}
{{- end -}}

{{- define "spillway.sidecarVolumes" -}}
- name: spillway-config
  configMap:
    name: {{ .release }}-limits
- name: spillway-key-secret
  secret:
    secretName: {{ (.values.sidecar.keySecret | default dict).existingSecret | default (printf "%s-key-secret" .release) }}
    items:
      - { key: secret, path: secret }
{{- $cp := .values.controlPlane }}
{{- if or $cp.enabled $cp.url }}
- name: spillway-token
  secret:
    {{- if $cp.url }}
    # This service's token, in its own namespace (the control plane is another release's).
    secretName: {{ required "controlPlane.url needs controlPlane.token.existingSecret: a Secret with this service's token (key: token)" $cp.token.existingSecret }}
    {{- else if include "spillway.tokenDir" $cp }}
    # Only this service's token (or the generated shared one), as the file `token`.
    secretName: {{ $cp.tokens.existingSecret | default (printf "%s-tokens" .release) }}
    items:
      - { key: {{ if include "spillway.perServiceTokens" $cp }}{{ .values.service | quote }}{{ else }}"_shared"{{ end }}, path: token }
    {{- else }}
    secretName: {{ $cp.token.existingSecret | default (printf "%s-token" .release) }}
    {{- end }}
{{- with .values.controlPlane.tls.existingSecret }}
- name: spillway-tls
  secret:
    secretName: {{ . }}
    items:
      - { key: ca.crt, path: ca.crt }
{{- end }}
{{- end }}
{{- end -}}

{{/*
The app container's preStop: it keeps serving for the sidecar's pause and five seconds more,
while the endpoints drop the pod and the sidecar stops taking requests; without it the app
stops first and a rollout returns 502s. (A native sidecar stops after the app anyway; the app
still waits for the endpoints.) From a values dict.
*/}}
{{- define "spillway.appLifecycle" -}}
lifecycle:
  preStop:
    sleep: { seconds: {{ add .sidecar.preStopSeconds 5 }} }
{{- end -}}

{{/*
Longer than the preStop pause and the drain together, so that SIGKILL never cuts a drain. A
native sidecar stops only after the app, so the app's pause (`spillway.appLifecycle`) comes
first.
*/}}
{{- define "spillway.terminationGracePeriod" -}}
{{- $app := ternary (add .sidecar.preStopSeconds 5) 0 (.sidecar.native | default false) -}}
{{- add $app .sidecar.preStopSeconds .sidecar.drainSeconds 5 -}}
{{- end -}}

{{/*
The control plane pods' scheduling knobs that need no merging: tolerations, image pull
secrets, priority class.
*/}}
{{- define "spillway.podKnobs" -}}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{/* The injected sidecar itself, as JSON from the chart's context: its image, ports, pause
and drain (inject's options, and the injector's settings). */}}
{{- define "spillway.injectedSidecar" -}}
{{- $image := include "spillway.sidecarImage" (dict "values" .Values "appVersion" .Chart.AppVersion) | fromJson -}}
{{- $s := .Values.sidecar -}}
{{- dict "image" (include "spillway.imageOf" $image) "proxy_port" $s.port "admin_port" $s.adminPort "pre_stop_seconds" $s.preStopSeconds "drain_seconds" $s.drainSeconds | toJson -}}
{{- end -}}

{{/* What a sidecar injected for this release is, as JSON (the injector's settings, and the
flags NOTES gives `spillway inject`): the release, the sidecar's image and ports, and the
token and CA Secrets as the chart's own sidecar mounts them. */}}
{{- define "spillway.injectFor" -}}
{{- $cp := .Values.controlPlane -}}
{{- $full := include "spillway.fullname" . -}}
{{- $s := include "spillway.injectedSidecar" . | fromJson -}}
{{- $_ := set $s "release" $full -}}
{{- with (.Values.sidecar.keySecret | default dict).existingSecret -}}
{{- $_ := set $s "key_secret" . -}}
{{- end -}}
{{- if $cp.url -}}
{{- $_ := set $s "token_secret" $cp.token.existingSecret -}}
{{- else if $cp.enabled -}}
{{- if include "spillway.tokenDir" $cp -}}
{{- $_ := set $s "token_secret" ($cp.tokens.existingSecret | default (printf "%s-tokens" $full)) -}}
{{- $_ := set $s "token_key" (ternary .Values.service "_shared" (eq (include "spillway.perServiceTokens" $cp) "true")) -}}
{{- else -}}
{{- $_ := set $s "token_secret" ($cp.token.existingSecret | default (printf "%s-token" $full)) -}}
{{- end -}}
{{- end -}}
{{- with $cp.tls.existingSecret -}}
{{- $_ := set $s "ca_secret" . -}}
{{- end -}}
{{- toJson $s -}}
{{- end -}}
