{{- define "pagedserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagedserve.labels" -}}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pagedserve.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "pagedserve.fullname" .)) -}}
{{- end -}}

{{/* PromQL matchers for this release's series: the ServiceMonitor's targets carry namespace and service. */}}
{{- define "pagedserve.promSelector" -}}
namespace="{{ .Release.Namespace }}",service="{{ include "pagedserve.fullname" . }}"
{{- end -}}

{{/* The name a Prometheus series has with the chart's --metrics-prefix: include "pagedserve.metric" (list . "x"). */}}
{{- define "pagedserve.metric" -}}
{{- printf "%s:%s" (index . 0).Values.server.metricsPrefix (index . 1) -}}
{{- end -}}

{{- define "pagedserve.eppName" -}}
{{- printf "%s-epp" (include "pagedserve.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of the endpoint picker's objects: apart from the model server's, whose selector must not match them. */}}
{{- define "pagedserve.eppSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-epp
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end -}}

{{- define "pagedserve.eppLabels" -}}
{{ include "pagedserve.eppSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pagedserve.servedName" -}}
{{- first .Values.model.servedModelName -}}
{{- end -}}

{{- define "pagedserve.kvEventsOn" -}}
{{- if or .Values.kvEvents.enabled (and .Values.inferencePool.enabled (eq .Values.inferencePool.prefixScorer "precise")) -}}
true
{{- end -}}
{{- end -}}

{{/* kv@<pod ip>:<port>@<served name>: the pod identity the endpoint picker (llm-d v0.9) gives each endpoint.
Kubernetes expands $(POD_IP) from the container's environment. */}}
{{- define "pagedserve.kvEventsTopic" -}}
{{- .Values.kvEvents.topic | default (printf "kv@$(POD_IP):%v@%s" .Values.server.port (include "pagedserve.servedName" .)) -}}
{{- end -}}

{{/* Values the templates cannot serve are refused here, with the reason, instead of rendering something broken. */}}
{{- define "pagedserve.validate" -}}
{{- if and .Values.autoscaling.enabled (lt (int .Values.autoscaling.minReplicas) 1) -}}
{{- fail "autoscaling.minReplicas must be at least 1: the autoscaler scales on a metric the pagedserve pods export (the request queue), so with no pod running nothing reports the requests that arrive and the replica count never leaves 0. Scale to zero needs a signal that exists without pods, e.g. the KEDA HTTP add-on in front of the Service (deploy/README.md)" -}}
{{- end -}}
{{- if and .Values.inferencePool.enabled (ne .Values.server.metricsPrefix "vllm") -}}
{{- fail "inferencePool.enabled needs server.metricsPrefix vllm: the endpoint picker reads vllm:num_requests_waiting, vllm:num_requests_running and vllm:kv_cache_usage_perc from every pod" -}}
{{- end -}}
{{- if and (or .Values.inferencePool.enabled .Values.kvEvents.enabled) (not .Values.model.servedModelName) -}}
{{- fail "inferencePool.enabled and kvEvents.enabled need model.servedModelName: the KV-event topic and the endpoint picker name the model the way clients do" -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.terminationGracePeriod" -}}
{{- with .Values.termination -}}
{{- add .preStopSleepSeconds .shutdownTimeoutSeconds .marginSeconds -}}
{{- end -}}
{{- end -}}

{{/* `pagedserve serve` flags; the image's entrypoint puts `serve` in front. */}}
{{- define "pagedserve.args" -}}
{{- $s := .Values.server -}}
- --host
- "0.0.0.0"
- --port
- {{ $s.port | quote }}
- --metrics-prefix
- {{ $s.metricsPrefix | quote }}
- --shutdown-timeout
- {{ .Values.termination.shutdownTimeoutSeconds | quote }}
{{- with .Values.model.path }}
- --model
- {{ . | quote }}
{{- end }}
{{- with .Values.model.servedModelName }}
- --served-model-name
{{- range . }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- if gt (int $s.tensorParallelSize) 1 }}
- --tensor-parallel-size
- {{ $s.tensorParallelSize | quote }}
{{- end }}
{{- if include "pagedserve.kvEventsOn" . }}
- --kv-events-config
- {{ dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%v" .Values.kvEvents.port) "topic" (include "pagedserve.kvEventsTopic" .) | toJson | quote }}
{{- end }}
{{- if .Values.kvOffload.volume }}
- --kv-offload-dir
- {{ .Values.kvOffload.mountPath | quote }}
{{- with .Values.kvOffload.maxBytes }}
- --kv-offload-max-bytes
- {{ . | int64 | quote }}
{{- end }}
{{- end }}
{{- range $flag, $value := dict "--block-size" $s.blockSize "--max-model-len" $s.maxModelLen "--max-num-seqs" $s.maxNumSeqs "--kv-cache-memory" $s.kvCacheMemory "--num-threads" $s.numThreads }}
{{- if not (kindIs "invalid" $value) }}
- {{ $flag }}
- {{ $value | int64 | quote }}
{{- end }}
{{- end }}
{{- range $s.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
