{{/* Names: the release name, prefixed with the chart name unless it already holds it. */}}
{{- define "prewarm.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "prewarm.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "agent") */}}
{{- define "prewarm.selector" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "prewarm.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "prewarm.warmupSecretName" -}}
{{- if .Values.warmup.existingSecret -}}{{ .Values.warmup.existingSecret }}{{- else -}}{{ include "prewarm.fullname" . }}-warmup{{- end -}}
{{- end -}}

{{/* Pod annotations for Prometheus' kubernetes_sd pod role. */}}
{{- define "prewarm.scrapeAnnotations" -}}
{{- if .ctx.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* Environment every prewarm process shares: Redis, the warmup secret, the metrics port. */}}
{{- define "prewarm.env" -}}
- name: PREWARM_REDIS_URL
{{- if .Values.redis.enabled }}
  value: {{ printf "redis://%s-redis:6379/0" (include "prewarm.fullname" .) | quote }}
{{- else if .Values.redis.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- else }}
  value: {{ required "redis.url (or redis.existingSecret) is required when redis.enabled=false" .Values.redis.url | quote }}
{{- end }}
{{- if and (not .Values.redis.enabled) .Values.redis.sentinelMaster }}
- name: PREWARM_REDIS_SENTINEL_MASTER
  value: {{ .Values.redis.sentinelMaster | quote }}
{{- end }}
{{- if not (kindIs "invalid" .Values.redis.waitReplicas) }}
- name: PREWARM_REDIS_WAIT_REPLICAS
  value: {{ .Values.redis.waitReplicas | quote }}
{{- end }}
- name: PREWARM_REDIS_WAIT_TIMEOUT_MS
  value: {{ .Values.redis.waitTimeoutMs | default 100 | quote }}
- name: PREWARM_AGENT_OUTBOX_RESEND_AFTER_S
  value: {{ .Values.outbox.resendAfterSeconds | default 30 | quote }}
- name: PREWARM_AGENT_OUTBOX_SWEEP_INTERVAL_S
  value: {{ .Values.outbox.sweepIntervalSeconds | default 5 | quote }}
- name: PREWARM_WARMUP_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "prewarm.warmupSecretName" . }}
      key: {{ .Values.warmup.existingSecretKey }}
- name: PREWARM_METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
- name: PREWARM_METRICS_HOST  # Prometheus scrapes the pod IP; the default is loopback only
  value: "0.0.0.0"
{{- end -}}

{{/* Environment of the planner (worker and beat): the plan's knobs and the actuator's targets. */}}
{{- define "prewarm.plannerEnv" -}}
- name: PREWARM_PLANNER_INTERVAL_S
  value: {{ .Values.planner.intervalSeconds | quote }}
{{- if ne .Values.autoscaling.warmupPoolSize nil }}
- name: PREWARM_PLANNER_WARM_POOL_SIZE
  value: {{ .Values.autoscaling.warmupPoolSize | quote }}
{{- end }}
- name: PREWARM_PLANNER_WARM_POOL_PERCENT
  value: {{ .Values.autoscaling.warmupPoolPercent | quote }}
- name: PREWARM_PLANNER_BUDGET_SHARE
  value: {{ .Values.autoscaling.budgetShare | quote }}
- name: PREWARM_PLANNER_STABILIZATION_S
  value: {{ .Values.hpa.behavior.scaleDown.stabilizationWindowSeconds | quote }}
- name: PREWARM_PLANNER_DRY_RUN
  value: {{ .Values.planner.dryRun | quote }}
- name: PREWARM_PLANNER_MIN_SERVING
  value: {{ .Values.planner.minServing | quote }}
- name: PREWARM_PLANNER_COLD_START_BUDGET
  value: {{ .Values.planner.coldStartBudget | quote }}
- name: PREWARM_PLANNER_MARGIN_RULE
  value: {{ .Values.planner.marginRule | quote }}
- name: PREWARM_PLANNER_SCALE_DOWN_TOLERANCE
  value: {{ .Values.planner.scaleDownTolerance | quote }}
- name: PREWARM_PLANNER_RELEASE_BAND
  value: {{ .Values.planner.releaseBand | quote }}
- name: PREWARM_PLANNER_INTERRUPTION_SHARE
  value: {{ .Values.planner.interruption.share | quote }}
- name: PREWARM_PLANNER_INTERRUPTION_MIN_REQUESTS
  value: {{ .Values.planner.interruption.minRequests | quote }}
- name: PREWARM_PLANNER_INTERRUPTION_HOLD_S
  value: {{ .Values.planner.interruption.holdSeconds | quote }}
- name: PREWARM_PLANNER_PAUSE_MEMORY
  value: {{ .Values.planner.interruption.pauseMemory | quote }}
{{- with .Values.planner.models }}
- name: PREWARM_PLANNER_MODELS
  value: {{ toJson . | quote }}
{{- end }}
- name: PREWARM_KUBERNETES_ENABLED
  value: {{ .Values.kubernetes.enabled | quote }}
- name: PREWARM_KUBERNETES_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- if .Values.inference.enabled }}
- name: PREWARM_KUBERNETES_DEPLOYMENT
  value: {{ printf "%s-inference" (include "prewarm.fullname" .) | quote }}
- name: PREWARM_KUBERNETES_POD_PORT
  value: {{ .Values.inference.port | quote }}
{{- end }}
- name: PREWARM_KUBERNETES_AUTOSCALING
  value: {{ .Values.autoscaling.mode | quote }}
- name: PREWARM_KUBERNETES_POD_SLEEP_MODE  # the pods can be parked asleep: a fleet round counts them in the target
  value: {{ .Values.podWarmer.sleepMode | quote }}
- name: PREWARM_KUBERNETES_MAX_REPLICAS
  value: {{ .Values.autoscaling.maxReplicas | quote }}
{{- if .Values.autoscaling.targets }}
{{- $map := dict }}{{- $caps := dict }}
{{- range include "prewarm.scaleTargets" . | fromJsonArray }}
{{- if not (hasKey $map .model) }}{{- $_ := set $map .model .deployment }}{{- $_ := set $caps .model (int .maxReplicas) }}{{- end }}
{{- if .byRevision }}{{- $key := printf "%s@%s" .model .revision }}{{- $_ := set $map $key .deployment }}{{- $_ := set $caps $key (int .maxReplicas) }}{{- end }}
{{- end }}
- name: PREWARM_KUBERNETES_DEPLOYMENTS
  value: {{ toJson $map | quote }}
- name: PREWARM_KUBERNETES_MAX_REPLICAS_BY_MODEL
  value: {{ toJson $caps | quote }}
{{- end }}
{{- end -}}

{{/* The Deployments whose replica count the planner's target drives, as a JSON list of
     {name, model, revision, byRevision, deployment, minReplicas, maxReplicas}: the chart's inference
     Deployment (when enabled) and every autoscaling.targets entry. One ScaledObject or HPA is rendered per
     entry. A model served by several Deployments (a rollout's stable and canary) is scaled per revision
     (byRevision): each entry must name its own revision and reads that revision's share of the target. */}}
{{- define "prewarm.scaleTargets" -}}
{{- $fullname := include "prewarm.fullname" . -}}
{{- $a := .Values.autoscaling -}}
{{- $out := list -}}
{{- if .Values.inference.enabled -}}
{{- $out = append $out (dict "name" (printf "%s-inference" $fullname) "model" .Values.inference.model "revision" (.Values.podWarmer.revision | default .Values.inference.revision) "deployment" (printf "%s-inference" $fullname) "minReplicas" $a.minReplicas "maxReplicas" $a.maxReplicas) -}}
{{- end -}}
{{- range $a.targets -}}
{{- $min := $a.minReplicas -}}{{- if hasKey . "minReplicas" -}}{{- $min = .minReplicas -}}{{- end -}}
{{- $max := $a.maxReplicas -}}{{- if hasKey . "maxReplicas" -}}{{- $max = .maxReplicas -}}{{- end -}}
{{- $out = append $out (dict "name" (printf "%s-%s" $fullname .deployment | trunc 63 | trimSuffix "-") "model" .model "revision" (.revision | default "") "deployment" .deployment "minReplicas" $min "maxReplicas" $max) -}}
{{- end -}}
{{- $deployments := dict -}}
{{- range $out -}}{{- $_ := set $deployments .model (append (get $deployments .model | default list) .deployment) -}}{{- end -}}
{{- $seen := dict -}}
{{- range $out -}}
{{- $of := get $deployments .model -}}
{{- $_ := set . "byRevision" (gt (len $of) 1) -}}
{{- if .byRevision -}}
{{- if not .revision -}}
{{- fail (printf "autoscaling.targets: model %s is served by the Deployments %s: each must name its revision (revision: ...), so each scales on its own share of the planner's target" .model (join ", " $of)) -}}
{{- end -}}
{{- $key := printf "%s@%s" .model .revision -}}
{{- if hasKey $seen $key -}}
{{- fail (printf "autoscaling.targets: the Deployments %s and %s both name %s: a revision is one Deployment" (get $seen $key) .deployment $key) -}}
{{- end -}}
{{- $_ := set $seen $key .deployment -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The HPA behavior of both autoscaling modes (KEDA hands it to the HPA it creates). The HPA follows the
     planner's target, which already holds capacity where it should: a scale-down window here would put a
     second, blind 300 s behind every predictive release. The window (hpa.behavior.scaleDown) is the
     planner's own (PREWARM_PLANNER_STABILIZATION_S): its reactive fallback keeps it while its forecasts
     are poor. */}}
{{- define "prewarm.hpaBehavior" -}}
scaleDown:
  stabilizationWindowSeconds: 0
scaleUp:
  stabilizationWindowSeconds: {{ .Values.hpa.behavior.scaleUp.stabilizationWindowSeconds }}
{{- end -}}


{{/* The runtimes' API key (/v1/*, /stats, /metrics): the gateway, the agents and the runtimes. */}}
{{- define "prewarm.runtimeApiKeyEnv" -}}
- name: PREWARM_RUNTIME_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ printf "%s-runtime" (include "prewarm.fullname" .) }}
      key: api-key
{{- end -}}

{{/* The runtimes' control token: agents, runtimes and the pod warmer only, never the gateway. */}}
{{- define "prewarm.runtimeTokenEnv" -}}
- name: PREWARM_RUNTIME_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ printf "%s-runtime" (include "prewarm.fullname" .) }}
      key: control-token
{{- end -}}

{{/* The upstreams' own API keys (issue 18), as a JSON object "<secret>/<key>" -> {secret, key}:
     podWarmer.apiKeySecret and each autoscaling.targets entry's apiKeySecret. The gateway mounts each
     at <gateway keys dir>/<secret>/<key>; a pod warmer registers the reference "<secret>/<key>" with
     each replica it makes, so Redis holds names of keys, never keys. */}}
{{- define "prewarm.upstreamKeys" -}}
{{- $out := dict -}}
{{- with .Values.podWarmer.apiKeySecret -}}
{{- $_ := set $out (printf "%s/%s" . $.Values.podWarmer.apiKeySecretKey) (dict "secret" . "key" $.Values.podWarmer.apiKeySecretKey) -}}
{{- end -}}
{{- range .Values.autoscaling.targets -}}
{{- if .apiKeySecret -}}
{{- $k := .apiKeySecretKey | default "api-key" -}}
{{- $_ := set $out (printf "%s/%s" .apiKeySecret $k) (dict "secret" .apiKeySecret "key" $k) -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}


{{/* The KEDA scaler's token (autoscaling.scaler.token.secret): the scaler asks every call for it, and KEDA
     resolves the trigger's tokenFromEnv from the scaled Deployment's container, so that container has it too. */}}
{{- define "prewarm.kedaTokenEnv" -}}
{{- with .Values.autoscaling.scaler.token.secret }}
- name: PREWARM_KEDA_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.autoscaling.scaler.token.key }}
{{- end }}
{{- end -}}
