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

{{/*
The kubelet's directories, from `kubelet` (values.schema.json has refused relative paths and `..`; a trailing
slash is dropped): device-plugins as the agent sees it (node.yaml kubeletDir, beside plugins_registry, plugins
and pod-resources, as the agent derives them) and where it is on the host. As YAML, for fromYaml.
*/}}
{{- define "plugvisor.kubeletDirs" -}}
{{- $root := clean .Values.kubelet.rootDir }}
devicePlugins: {{ printf "%s/device-plugins" $root | quote }}
devicePluginsOnHost: {{ clean .Values.kubelet.devicePluginsDir | quote }}
pluginsRegistry: {{ printf "%s/plugins_registry" $root | quote }}
plugins: {{ printf "%s/plugins" $root | quote }}
podResources: {{ printf "%s/pod-resources" $root | quote }}
{{- end -}}

{{/*
The port of node.metrics.listen (HOST:PORT, values.schema.json says which), where the probes and Prometheus
reach the agent.
*/}}
{{- define "plugvisor.metricsPort" -}}
{{ regexFind "[0-9]+$" .Values.node.metrics.listen }}
{{- end -}}
