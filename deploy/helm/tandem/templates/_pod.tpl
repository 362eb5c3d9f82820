{{/* Pod pieces shared by the Deployment and the LeaderWorkerSet's leader and workers. */}}

{{- define "tandem.volume" -}}
{{- if eq .volume.type "pvc" }}
persistentVolumeClaim:
  claimName: {{ .volume.claimName | quote }}
  readOnly: {{ .volume.readOnly }}
{{- else if eq .volume.type "hostPath" }}
hostPath:
  path: {{ .volume.hostPath | quote }}
  type: Directory
{{- else if eq .volume.type "emptyDir" }}
emptyDir: {}
{{- else }}
{{- fail (printf "%s.volume.type must be pvc, hostPath or emptyDir (got %q)" .what .volume.type) }}
{{- end }}
{{- end }}

{{- define "tandem.volumes" -}}
- name: models
  {{- include "tandem.volume" (dict "volume" .Values.model.volume "what" "model") | trim | nindent 2 }}
{{- if .Values.adapters.enabled }}
- name: adapters
  {{- include "tandem.volume" (dict "volume" .Values.adapters.volume "what" "adapters") | trim | nindent 2 }}
{{- end }}
# The token ring (POSIX shared memory) and NCCL's intra-host transport live in /dev/shm.
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit | quote }}
# Compiled guided-decoding constraints: a cache, rebuilt on a fresh pod.
- name: cache
  emptyDir: {}
{{- end }}

{{- define "tandem.volumeMounts" -}}
- name: models
  mountPath: {{ .Values.model.mountPath | quote }}
  readOnly: {{ .Values.model.volume.readOnly }}
{{- if .Values.adapters.enabled }}
- name: adapters
  mountPath: {{ .Values.adapters.mountPath | quote }}
  readOnly: {{ .Values.adapters.volume.readOnly }}
{{- end }}
- name: dshm
  mountPath: /dev/shm
- name: cache
  mountPath: /cache
{{- end }}

{{- define "tandem.resources" -}}
{{- $res := deepCopy .Values.resources }}
{{- $gpus := int (include "tandem.gpusPerPod" .) }}
{{- if gt $gpus 0 }}
{{- $limits := default dict $res.limits }}
{{- $_ := set $limits .Values.gpu.resourceName $gpus }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Pod-level settings. enableServiceLinks is off because a Service named `tandem` in the
namespace would inject TANDEM_PORT=tcp://..., which the tandem CLI reads as its --port
default and cannot parse. */}}
{{- define "tandem.podSpecCommon" -}}
enableServiceLinks: false
terminationGracePeriodSeconds: {{ include "tandem.terminationGracePeriodSeconds" . }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  {{- include "tandem.volumes" . | trim | nindent 2 }}
{{- end }}

{{- define "tandem.podMetadata" -}}
labels:
  {{- include "tandem.selectorLabels" .ctx | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with .ctx.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .ctx.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The container running `tandem serve`: ports, probes (values.yaml says which and why),
the drain on SIGTERM. */}}
{{- define "tandem.serverContainer" -}}
name: tandem
image: {{ include "tandem.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args:
  {{- include "tandem.serveArgs" . | trim | nindent 2 }}
{{- if or .Values.server.env .Values.server.apiKey.existingSecret .Values.kvCache.events.enabled }}
env:
{{- with .Values.server.apiKey.existingSecret }}
  # --api-key, out of every command line.
  - name: TANDEM_API_KEY
    valueFrom:
      secretKeyRef:
        name: {{ . | quote }}
        key: {{ $.Values.server.apiKey.secretKey | quote }}
{{- end }}
{{- if .Values.kvCache.events.enabled }}
  # For the KV events' topic ($(POD_IP) in kvCache.events.topic): routers key on the pod.
  - name: POD_IP
    valueFrom:
      fieldRef:
        fieldPath: status.podIP
{{- end }}
{{- with .Values.server.env }}
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
ports:
  - name: grpc
    containerPort: {{ .Values.server.grpcPort }}
    protocol: TCP
  - name: http
    containerPort: {{ .Values.server.httpPort }}
    protocol: TCP
{{- if .Values.leaderWorkerSet.enabled }}
  - name: dist-init
    containerPort: {{ .Values.leaderWorkerSet.distInitPort }}
    protocol: TCP
  - name: dist-plans
    containerPort: {{ add1 (int .Values.leaderWorkerSet.distInitPort) }}
    protocol: TCP
{{- end }}
startupProbe:
  grpc:
    port: {{ .Values.server.grpcPort }}
    service: fmaas.GenerationService
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.startup.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
readinessProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
livenessProbe:
  httpGet:
    path: /live
    port: http
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
{{- if gt (int .Values.preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .Values.preStopSleepSeconds | quote }}]
{{- end }}
resources:
  {{- include "tandem.resources" . | trim | nindent 2 }}
{{- with .Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  {{- include "tandem.volumeMounts" . | trim | nindent 2 }}
{{- end }}
