{{/*
The image every container runs: the values' repository and tag (the chart's appVersion by default).
*/}}
{{- define "plugvisor.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
Labels Helm's conventions add to every object, beside the ones the kustomize overlays set.
*/}}
{{- define "plugvisor.helmLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
The labels of what the DRA drivers share (their ServiceAccount, RBAC and admission policy), as
deploy/kubernetes/components/dra sets them, and Helm's.
*/}}
{{- define "plugvisor.draLabels" -}}
app.kubernetes.io/name: plugvisor
app.kubernetes.io/component: dra-driver
{{ include "plugvisor.helmLabels" . }}
{{- end -}}
