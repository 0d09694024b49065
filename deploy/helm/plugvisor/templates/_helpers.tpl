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

{{/*
Refuse a Kubernetes release the objects do not fit, naming it and what needs more. The device plugins need
1.26 (the oldest kubelet the project plays); the DRA drivers 1.34 (resource.k8s.io/v1, the kubelet's v1 DRA
plugin API). `helm template` without --kube-version (and without a cluster) takes Kubernetes to be v1.20.0,
Helm's fixed default: that is read as "not known", so device plugins render offline and DRA drivers ask for
--kube-version. Chart.yaml has no kubeVersion for that reason: Helm would refuse before any template runs.
*/}}
{{- define "plugvisor.checkKubeVersion" -}}
{{- $version := .Capabilities.KubeVersion.Version }}
{{- $unknown := eq $version "v1.20.0" }}
{{- $dra := list }}
{{- $plugins := list }}
{{- range $name := keys .Values.kinds | sortAlpha }}
{{- $kind := get $.Values.kinds $name }}
{{- if $kind.enabled }}{{- $plugins = append $plugins (printf "kinds.%s.enabled" $name) }}{{- end }}
{{- if dig "dra" "enabled" false $kind }}{{- $dra = append $dra (printf "kinds.%s.dra.enabled" $name) }}{{- end }}
{{- end }}
{{- if and $dra (semverCompare "<1.34.0-0" $version) }}
{{- if $unknown }}
{{- fail (printf "%s: DRA drivers need Kubernetes 1.34 or newer (resource.k8s.io/v1), and no cluster was asked its version: pass the cluster's, e.g. helm template --kube-version 1.37 (Helm then takes it to be %s, its default)" (join ", " $dra) $version) }}
{{- end }}
{{- fail (printf "%s: DRA drivers need Kubernetes 1.34 or newer (resource.k8s.io/v1 DeviceClass and ResourceSlice, the kubelet's v1 DRA plugin API); this release is for %s. Use the kinds' device plugins (kinds.<kind>.enabled) there" (join ", " $dra) $version) }}
{{- end }}
{{- if and $plugins (not $unknown) (semverCompare "<1.26.0-0" $version) }}
{{- fail (printf "%s: plugvisor's device plugins need Kubernetes 1.26 or newer (the oldest kubelet whose device-plugin rules it is held against); this release is for %s" (join ", " $plugins) $version) }}
{{- end }}
{{- end -}}

{{/*
A label value as a YAML string, whatever it looks like (yes, on, null, 0x1f, 1e3 are strings here).
*/}}
{{- define "plugvisor.labels" -}}
{{- $lines := list }}
{{- range $key := keys . | sortAlpha }}
{{- $lines = append $lines (printf "%s: %s" ($key | quote) (get $ $key | toString | quote)) }}
{{- end }}
{{- join "\n" $lines }}
{{- end -}}
