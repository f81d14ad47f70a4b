{{/* Names and labels shared by every object of the chart. */}}

{{- define "forkd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "forkd.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "forkd.labels" -}}
{{ include "forkd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "forkd.image" -}}
{{- $repository := required "image.repository is required: an image holding forkd (with its ray extra) and QEMU; none is published" .Values.image.repository -}}
{{- printf "%s:%s" $repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The Secret holding the bearer token under the key `token`. */}}
{{- define "forkd.tokenSecret" -}}
{{- if and .Values.token.existingSecret .Values.token.value -}}
{{- fail "set token.existingSecret or token.value, not both" -}}
{{- end -}}
{{- if not (or .Values.token.existingSecret .Values.token.value) -}}
{{- fail "token.existingSecret or token.value is required: the daemon listens on TCP only with a bearer token (e.g. --set token.value=$(openssl rand -hex 32))" -}}
{{- end -}}
{{- .Values.token.existingSecret | default (printf "%s-token" (include "forkd.fullname" .)) -}}
{{- end -}}

{{/* The node's IP from the downward API: the daemon listens there; the Ray worker on the same node calls it there. */}}
{{- define "forkd.hostIPEnv" -}}
- name: HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
{{- end -}}
