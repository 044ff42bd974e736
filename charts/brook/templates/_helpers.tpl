{{/*
Names, labels, images, and the operator's permissions, shared by the templates.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "brook.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/*
The full name: fullnameOverride, or the release name followed by the chart name unless the
release name already contains it. At most 40 characters, so that suffixes ("-operator",
"-operator-metrics") keep names valid DNS labels.
*/}}
{{- define "brook.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of the operator's Deployment, Roles and bindings. */}}
{{- define "brook.operator.fullname" -}}
{{- printf "%s-operator" (include "brook.fullname" .) }}
{{- end }}

{{/* Chart name and version, as in the helm.sh/chart label. */}}
{{- define "brook.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object of the operator. */}}
{{- define "brook.operator.labels" -}}
helm.sh/chart: {{ include "brook.chart" . }}
{{ include "brook.operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: brook
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the operator pod (stable across upgrades). */}}
{{- define "brook.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "brook.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of the monitoring objects: PodMonitor, PrometheusRule, dashboard ConfigMap. */}}
{{- define "brook.monitoring.labels" -}}
helm.sh/chart: {{ include "brook.chart" . }}
app.kubernetes.io/name: {{ include "brook.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: monitoring
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: brook
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
PromQL label matchers of the engine series that the PodMonitor scrapes: its job and, in
rbac.scope "namespace", the watched namespaces only, so that two releases of the chart (each
watching its own namespaces) never alert twice on one engine.
*/}}
{{- define "brook.rules.engineMatchers" -}}
job="brook-engine"
{{- with include "brook.watchNamespaces" . | fromJsonArray }}, namespace=~"{{ join "|" . }}"{{ end }}
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "brook.operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "brook.operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: repository, then @digest or :tag (appVersion by default). */}}
{{- define "brook.operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The default engine image (--engine-image). */}}

{{/*
The namespaces the operator watches, as a JSON list: none in rbac.scope "cluster" (it
watches all), else rbac.watchNamespaces or, when that is empty, the release namespace.
*/}}
{{- define "brook.watchNamespaces" -}}
{{- if eq .Values.rbac.scope "namespace" }}
{{- default (list .Release.Namespace) .Values.rbac.watchNamespaces | toJson }}
{{- else }}
{{- list | toJson }}
{{- end }}
{{- end }}

{{/* Fails on the misconfigurations values.schema.json cannot express. */}}
{{- define "brook.validate" -}}
{{- if and (eq .Values.rbac.scope "cluster") .Values.rbac.watchNamespaces }}
{{- fail "rbac.watchNamespaces is set but rbac.scope is \"cluster\" (every namespace): set rbac.scope to \"namespace\", or empty rbac.watchNamespaces" }}
{{- end }}
{{- $burn := .Values.prometheusRule.ttftSLOBurn }}
{{- if and .Values.prometheusRule.enabled $burn.enabled (ge (mulf $burn.burnRate (subf 1 $burn.objective)) 1.0) }}
{{- fail (printf "prometheusRule.ttftSLOBurn: burnRate %v x (1 - objective %v) is at least 1, so the alert could never fire: lower burnRate" $burn.burnRate $burn.objective) }}
{{- end }}
{{- if eq (int .Values.metrics.port) (int .Values.health.port) }}
{{- fail (printf "metrics.port and health.port are both %v: give them different ports" .Values.metrics.port) }}
{{- end }}
{{- end }}

{{/*
The operator's permissions: exactly NAMESPACED_RULES and CLUSTER_RULES of
operator/brook_operator/rbac.py, in the same order (tests/unit/operator/test_chart.py
compares them). Change them there first.
*/}}
{{- define "brook.operator.namespacedRules" -}}
# The resource: kopf lists and watches it and patches its annotations (handler progress); a
# child's event reads its owner; status is written through the subresource.
- apiGroups: ["brook.dev"]
  resources: ["llminferences"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["brook.dev"]
  resources: ["llminferences/status"]
  verbs: ["patch"]
# The children: read first (Brook writes only objects it owns), then server-side apply
# (create, then patch).
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
# The workload: applied, followed, and deleted when the topology changes kind.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.router's children, pruned (listed, deleted) when the router goes.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "create", "patch", "delete"]
# The autoscaler lists the leader pods to scrape their /metrics, and before a scale-in
# sets each one's pod-deletion-cost so the least-loaded one goes.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "patch"]
# Kubernetes Events on the resource (kopf posts core/v1 Events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{- define "brook.operator.clusterRules" -}}
# kopf discovers custom resources through their definitions (the operator also learns from
# them whether LeaderWorkerSet is installed); in namespace scope kopf follows the namespaces.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}

{{- /*
kopf's peering (leader election among operator replicas): on when replicas > 1. Its rules are
PEERING_CLUSTER_RULES / PEERING_NAMESPACED_RULES of rbac.py.
*/}}
{{- define "brook.peering" -}}
{{- if gt (int .Values.replicas) 1 }}true{{ end -}}
{{- end }}

{{- define "brook.operator.peeringClusterRules" -}}
# kopf's peering: the operator replicas elect the one that handles events.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{- define "brook.operator.peeringNamespacedRules" -}}
# kopf's peering: the operator replicas elect the one that handles events.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
