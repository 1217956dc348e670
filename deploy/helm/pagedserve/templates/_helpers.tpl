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
{{- range $flag, $value := dict "--max-model-len" $s.maxModelLen "--max-num-seqs" $s.maxNumSeqs "--kv-cache-memory" $s.kvCacheMemory "--num-threads" $s.numThreads }}
{{- if not (kindIs "invalid" $value) }}
- {{ $flag }}
- {{ $value | int64 | quote }}
{{- end }}
{{- end }}
{{- range $s.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
