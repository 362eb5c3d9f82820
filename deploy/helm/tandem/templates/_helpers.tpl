{{/* Names and labels. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The pods that serve the APIs: every Deployment pod, or the LeaderWorkerSet leaders. The
Service, the InferencePool and the ServiceMonitor select these only. */}}
{{- define "tandem.serverSelectorLabels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{/* Pods per replica: the LeaderWorkerSet group size, else one. */}}
{{- define "tandem.nodes" -}}
{{- if .Values.leaderWorkerSet.enabled }}{{ int .Values.leaderWorkerSet.size }}{{ else }}1{{ end }}
{{- end }}

{{/* GPUs per pod: gpu.perPod, else one per tensor-parallel rank on the pod (none on a CPU). */}}
{{- define "tandem.gpusPerPod" -}}
{{- $tp := int .Values.server.tensorParallelSize }}
{{- $nodes := int (include "tandem.nodes" .) }}
{{- if ne (mod $tp $nodes) 0 }}
{{- fail (printf "server.tensorParallelSize (%d) must be a multiple of leaderWorkerSet.size (%d)" $tp $nodes) }}
{{- end }}
{{- if not (kindIs "invalid" .Values.gpu.perPod) }}{{ int .Values.gpu.perPod }}
{{- else if eq .Values.server.device "cpu" }}0
{{- else }}{{ div $tp $nodes }}
{{- end }}
{{- end }}

{{- define "tandem.terminationGracePeriodSeconds" -}}
{{- if not (kindIs "invalid" .Values.terminationGracePeriodSeconds) }}{{ int .Values.terminationGracePeriodSeconds }}
{{- else }}{{ add (int .Values.preStopSleepSeconds) (int (ceil .Values.server.shutdownTimeout)) 15 }}
{{- end }}
{{- end }}

{{- define "tandem.image" -}}
{{ printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}
{{- end }}

{{/* Flags every process of a replica shares: the model and how it is split. The leader's
`serve` and the workers' `run-role gpu-worker` both take them. */}}
{{- define "tandem.engineArgs" -}}
- --model
- {{ printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.path | quote }}
- --device
- {{ .Values.server.device | quote }}
- --tensor-parallel-size
- {{ .Values.server.tensorParallelSize | quote }}
- --log-level
- {{ .Values.server.logLevel | quote }}
{{- with .Values.kvCache.offloadingSize }}
- --kv-offloading-size
- {{ . | quote }}
{{- end }}
{{- if .Values.adapters.enabled }}
- --adapter-cache
- {{ .Values.adapters.mountPath | quote }}
- --max-loras
- {{ .Values.adapters.maxLoras | quote }}
- --max-lora-rank
- {{ .Values.adapters.maxLoraRank | quote }}
{{- end }}
{{- end }}

{{/* `tandem serve`: every process of the replica (of the leader's host with LWS). */}}
{{- define "tandem.serveArgs" -}}
{{- if eq (int .Values.server.httpPort) 0 }}
{{- fail "server.httpPort must not be 0: the readiness and liveness probes use the HTTP API" }}
{{- end }}
- serve
- --host
- "0.0.0.0"
- --port
- {{ .Values.server.grpcPort | quote }}
- --http-port
- {{ .Values.server.httpPort | quote }}
- --shutdown-timeout
- {{ .Values.server.shutdownTimeout | quote }}
- --liveness-timeout
- {{ .Values.server.livenessTimeout | quote }}
- --guided-cache-dir
- /cache/guided
{{- with .Values.model.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
{{ include "tandem.engineArgs" . }}
{{- with .Values.kvCache.events }}
{{- if .enabled }}
- --kv-events-config
- {{ dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" .endpoint "replay_endpoint" .replayEndpoint "topic" .topic "buffer_steps" (int .bufferSteps) | toJson | quote }}
{{- end }}
{{- end }}
{{- if .Values.leaderWorkerSet.enabled }}
- --nnodes
- {{ .Values.leaderWorkerSet.size | quote }}
- --node-rank
- "0"
- --dist-init-addr
- {{ printf "$(LWS_LEADER_ADDRESS):%d" (int .Values.leaderWorkerSet.distInitPort) | quote }}
{{- end }}
{{- range .Values.server.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* `tandem run-role gpu-worker`: the tensor-parallel ranks of a worker host. */}}
{{- define "tandem.workerArgs" -}}
- run-role
- gpu-worker
{{ include "tandem.engineArgs" . }}
- --nnodes
- {{ .Values.leaderWorkerSet.size | quote }}
- --node-rank
- "$(LWS_WORKER_INDEX)"
- --dist-init-addr
- {{ printf "$(LWS_LEADER_ADDRESS):%d" (int .Values.leaderWorkerSet.distInitPort) | quote }}
{{- range .Values.server.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
