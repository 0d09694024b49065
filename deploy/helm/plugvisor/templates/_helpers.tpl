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
