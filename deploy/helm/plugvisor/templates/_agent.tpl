{{- /*
One agent: its node.yaml as a ConfigMap, and a DaemonSet running `plugvisor run` on the nodes with the
kind's hardware, mounting exactly what the kind reads. Called with a dict: root (the chart's context),
kind (its name), values (kinds.<kind>), dra (false: the kind's device plugins, its resources; true: its
DRA drivers, its dra.resources, named <kind>-dra and labelled plugvisor.io/mode=dra, with dra.hostMounts
and what components/dra adds: the plugvisor-dra ServiceAccount's token, NODE_NAME, the kubelet's plugin
directories and the host's /var/run/cdi). A checksum of node.yaml in the pod template does what the overlays' content-hashed
ConfigMap names do: a changed node.yaml rolls the agents, one node at a time.

The kubelet's directories come from `kubelet` (plugvisor.kubeletDirs): the pod sees each at the host's own path
under kubelet.rootDir, which is where the agent looks for them (node.yaml kubeletDir is rootDir/device-plugins,
and plugins_registry, plugins and pod-resources lie beside it), and the paths a DRA driver names to the kubelet
are the host's. Only device-plugins may come from elsewhere on the host (kubelet.devicePluginsDir): the kubelet
names device plugins' sockets by file name there, so the pod may see it under any path. The metrics port,
containerPort and probes, is node.metrics.listen's.
*/}}
{{- define "plugvisor.agent" }}
{{- $ := .root }}
{{- $kind := .values }}
{{- $dra := .dra }}
{{- $config := .config | default "" }}
{{- $base := ternary (printf "%s-%s" .kind $config) .kind (ne $config "") }}
{{- $name := ternary (printf "%s-dra" $base) $base $dra }}
{{- if gt (len (printf "plugvisor-config-%s" $name)) 63 }}
{{- fail (printf "nodeConfigs.configs.%s: the agent's names (plugvisor-config-%s) would be over 63 characters; a shorter config or kind name" $config $name) }}
{{- end }}
{{- $selector := dict "app.kubernetes.io/name" "plugvisor" "plugvisor.io/kind" .kind }}
{{- $modeLabel := ternary (dict "plugvisor.io/mode" "dra") dict $dra }}
{{- if $config }}
{{- $_ := set $modeLabel "plugvisor.io/config" $config }}
{{- end }}
{{- $declared := $kind.resources }}
{{- $hostMounts := $kind.hostMounts }}
{{- if $dra }}
{{- $declared = $kind.dra.resources }}
{{- $hostMounts = list }}
{{- range concat $kind.hostMounts ($kind.dra.hostMounts | default list) }}
{{- /* A DRA agent mounts the host's CDI directory itself (below): the kind's own (gpu with cdi) would be a second volume of that name and path. */}}
{{- if not (or (eq .name "host-cdi") (eq (clean .mountPath) "/host/var/run/cdi")) }}
{{- $hostMounts = append $hostMounts . }}
{{- end }}
{{- end }}
{{- end }}
{{- if $config }}
{{- $declared = .resources }}
{{- end }}
{{- /* NVIDIA's user-space driver (kinds.<kind>.driverRoot): read-only under /host, /usr for a driver on the host's /, and the host's /etc/cdi where NVIDIA's container toolkit writes its spec; the gpu resources read it from there. */}}
{{- $driverRoot := $kind.driverRoot | default "" }}
{{- if $driverRoot }}
{{- $driverRoot = clean $driverRoot }}
{{- $driverPath := ternary "/usr" $driverRoot (eq $driverRoot "/") }}
{{- $hostMounts = concat (list (dict "name" "host-driver" "path" $driverPath "mountPath" (printf "/host%s" $driverPath) "readOnly" true "driverRoot" true) (dict "name" "host-etc-cdi" "path" "/etc/cdi" "mountPath" "/host/etc/cdi" "readOnly" true "type" "DirectoryOrCreate" "driverRoot" true)) $hostMounts }}
{{- end }}
{{- /* NVML opens NVIDIA's device nodes itself (kinds.<kind>.nvml.deviceAccess, values.yaml): a privileged container, or NVIDIA's container runtime giving them; a lab's NVML opens none. */}}
{{- $deviceAccess := "none" }}
{{- if and (not $.Values.lab.enabled) (kindIs "map" $kind.nvml) }}
{{- $deviceAccess = $kind.nvml.deviceAccess | default "none" }}
{{- end }}
{{- $resources := list }}
{{- range $declared }}
{{- $resource := omit . "extendedResourceName" }}
{{- if and (ne $driverRoot "") (ne $driverRoot "/") (eq (toString .kind) "gpu") (not (hasKey . "driverRoot")) }}
{{- $_ := set $resource "driverRoot" $driverRoot }}
{{- end }}
{{- $resources = append $resources $resource }}
{{- end }}
{{- /* No resource that loads NVML (a gpu resource without nvml.enabled false): no device access to give. */}}
{{- $loadsNvml := false }}
{{- range $resources }}
{{- if and (eq (toString .kind) "gpu") (ne (toString (dig "nvml" "enabled" "auto" .)) "false") }}
{{- $loadsNvml = true }}
{{- end }}
{{- end }}
{{- if not $loadsNvml }}
{{- $deviceAccess = "none" }}
{{- end }}
{{- /* In a lab, NVML is the lab's libnvidia-ml (under the driver root's mount), which finds the lab's state by walking up from its own path under /host to the directory holding .plugvisor-lab/nvml: that state is mounted there, or NVML says the driver is not loaded (overlays/lab's patch-gpu.yaml does the same). */}}
{{- if and $.Values.lab.enabled $loadsNvml }}
{{- $hostMounts = append $hostMounts (dict "name" "lab-nvml" "path" "/.plugvisor-lab/nvml" "mountPath" "/host/.plugvisor-lab/nvml" "readOnly" true) }}
{{- end }}
{{- /* Each mount is one volume and one mount of the pod: a name or a mountPath given twice is an invalid DaemonSet. */}}
{{- $kindName := .kind }}
{{- /* The driver root's own mounts (driverRoot above) are the chart's: a clash with one is driverRoot's, which the user set, not a hostMounts entry given twice. */}}
{{- $seen := dict }}
{{- range $mount := $hostMounts }}
{{- range $key := list (printf "name %s" .name) (printf "mountPath %s" (clean .mountPath)) }}
{{- if hasKey $seen $key }}
{{- if or (get $seen $key) $mount.driverRoot }}
{{- fail (printf "kinds.%s.driverRoot: %s is mounted for the driver root, and a host mount of kinds.%s.hostMounts has the same %s; a driver root must be a directory of its own (/, /run/nvidia/driver, /usr/local/nvidia), not one the kind already mounts" $kindName $driverRoot $kindName $key) }}
{{- end }}
{{- fail (printf "kinds.%s.hostMounts: the %s is given twice; each host mount is one volume mounted at one path" $kindName $key) }}
{{- end }}
{{- $_ := set $seen $key (hasKey $mount "driverRoot") }}
{{- end }}
{{- end }}
{{- $hardware := ternary $.Values.lab.root "" $.Values.lab.enabled }}
{{- $kubelet := include "plugvisor.kubeletDirs" $ | fromYaml }}
{{- $node := merge (dict "hostRoot" "/host" "specRoot" (ternary $.Values.lab.root "/" $.Values.lab.enabled) "kubeletDir" $kubelet.devicePlugins "resources" $resources) (deepCopy $.Values.node) }}
{{- $nodeYaml := toYaml $node }}
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: plugvisor-config-{{ $name }}
  namespace: {{ $.Release.Namespace }}
  labels:
    {{- include "plugvisor.labels" (merge (dict "plugvisor.io/kind" .kind) $modeLabel) | nindent 4 }}
    {{- include "plugvisor.helmLabels" $ | nindent 4 }}
data:
  node.yaml: |
    {{- $nodeYaml | nindent 4 }}
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: plugvisor-{{ $name }}
  namespace: {{ $.Release.Namespace }}
  labels:
    app.kubernetes.io/name: plugvisor
    app.kubernetes.io/component: node-agent
    app.kubernetes.io/part-of: plugvisor
    {{- include "plugvisor.labels" (merge (dict "plugvisor.io/kind" .kind) $modeLabel) | nindent 4 }}
    {{- include "plugvisor.helmLabels" $ | nindent 4 }}
spec:
  selector:
    matchLabels:
      {{- include "plugvisor.labels" (merge (deepCopy $modeLabel) $selector) | nindent 6 }}
  {{- with $.Values.updateStrategy }}
  updateStrategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  template:
    metadata:
      labels:
        {{- include "plugvisor.labels" (merge (deepCopy $modeLabel) $selector (dict "app.kubernetes.io/component" "node-agent") ($.Values.podLabels | default dict)) | nindent 8 }}
      annotations:
        {{- include "plugvisor.labels" (merge (dict "checksum/node.yaml" ($nodeYaml | sha256sum)) ($.Values.podAnnotations | default dict)) | nindent 8 }}
    spec:
      {{- with $.Values.priorityClassName }}
      priorityClassName: {{ . | quote }}
      {{- end }}
      {{- with $.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      nodeSelector:
        {{- $nodeSelector := merge (dict "kubernetes.io/os" "linux") (ternary ($kind.labNodeSelector | default dict) ($kind.nodeSelector | default dict) $.Values.lab.enabled) ($.Values.nodeSelector | default dict) }}
        {{- if $config }}
        {{- $_ := set $nodeSelector $.Values.nodeConfigs.label $config }}
        {{- end }}
        {{- include "plugvisor.labels" $nodeSelector | nindent 8 }}
      {{- with $.Values.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $affinity := deepCopy ($.Values.affinity | default dict) }}
      {{- if .excluded }}
      {{- /* The nodes of per-node configs run those configs' agents: this one keeps off them, in every required term (terms are ORed). */}}
      {{- $expression := dict "key" $.Values.nodeConfigs.label "operator" "NotIn" "values" .excluded }}
      {{- $nodeAffinity := get $affinity "nodeAffinity" | default dict }}
      {{- $required := get $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default dict }}
      {{- $terms := list }}
      {{- range (get $required "nodeSelectorTerms" | default (list dict)) }}
      {{- $term := deepCopy . }}
      {{- $_ := set $term "matchExpressions" (append (get $term "matchExpressions" | default list) $expression) }}
      {{- $terms = append $terms $term }}
      {{- end }}
      {{- $_ := set $required "nodeSelectorTerms" $terms }}
      {{- $_ := set $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" $required }}
      {{- $_ := set $affinity "nodeAffinity" $nodeAffinity }}
      {{- end }}
      {{- with $affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $dra }}
      # The drivers publish ResourceSlices and read ResourceClaims with the pod's own token.
      serviceAccountName: plugvisor-dra
      automountServiceAccountToken: true
      {{- else }}
      automountServiceAccountToken: false
      {{- end }}
      enableServiceLinks: false
      {{- if eq $deviceAccess "runtimeClass" }}
      # NVIDIA's container runtime puts /dev/nvidiactl and /dev/nvidia<N> in the container (and lets its
      # device cgroup open them) for NVIDIA_VISIBLE_DEVICES below: what NVML needs, and nothing more.
      runtimeClassName: {{ $kind.nvml.runtimeClassName | default "nvidia" | quote }}
      {{- end }}
      # SIGTERM stops the children (stopTimeout, 5 s each, in parallel), then the agent exits 0.
      terminationGracePeriodSeconds: 30
      securityContext:
        seccompProfile:
          type: RuntimeDefault
      containers:
        - name: agent
          image: {{ include "plugvisor.image" $ | quote }}
          imagePullPolicy: {{ $.Values.image.pullPolicy }}
          args:
            - run
            - --config=/etc/plugvisor/node.yaml
            - --log-format=json
          env:
            {{- if $dra }}
            # The node the drivers publish for: their pool's name and the slices' owner.
            - name: NODE_NAME
              valueFrom:
                fieldRef: {fieldPath: spec.nodeName}
            {{- end }}
            - name: PLUGVISOR_RUNTIME_DIR
              value: /run/plugvisor
            {{- if eq $deviceAccess "runtimeClass" }}
            - name: NVIDIA_VISIBLE_DEVICES
              value: all
            - name: NVIDIA_DRIVER_CAPABILITIES
              value: utility
            {{- end }}
          ports:
            - name: metrics
              containerPort: {{ include "plugvisor.metricsPort" $ }}
              protocol: TCP
          livenessProbe:
            httpGet: {path: /healthz, port: metrics}
            initialDelaySeconds: 5
            periodSeconds: 10
            timeoutSeconds: 3
            failureThreshold: 3
          readinessProbe:
            httpGet: {path: /readyz, port: metrics}
            periodSeconds: 5
            timeoutSeconds: 3
            failureThreshold: 2
          resources:
            {{- toYaml $.Values.resources | nindent 12 }}
          securityContext:
            runAsUser: 0
            runAsGroup: 0
            runAsNonRoot: false
            {{- if eq $deviceAccess "privileged" }}
            # NVML opens /dev/nvidiactl and /dev/nvidia<N> (major 195) by their own paths: only a privileged
            # container has the host's device nodes in its /dev and a device cgroup that lets it open them.
            privileged: true
            readOnlyRootFilesystem: true
            {{- else }}
            privileged: false
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: [ALL]
            {{- end }}
          volumeMounts:
            {{- range $hostMounts }}
            - name: {{ .name }}
              mountPath: {{ .mountPath | quote }}
              {{- if .readOnly }}
              readOnly: true
              {{- end }}
            {{- end }}
            - {name: config, mountPath: /etc/plugvisor, readOnly: true}
            - {name: device-plugins, mountPath: {{ $kubelet.devicePlugins | quote }}}
            # PodResources: who holds which device (monitoring, release cleanup); read-only is enough.
            - {name: pod-resources, mountPath: {{ $kubelet.podResources | quote }}, readOnly: true}
            - {name: runtime, mountPath: /run/plugvisor}
            - {name: tmp, mountPath: /tmp}
            {{- if $dra }}
            # Where the kubelet finds DRA drivers: <kubelet root>/plugins_registry/<driver>-reg.sock and
            # plugins/<driver>/dra.sock (their checkpoint beside it); each prepared claim is a CDI spec in
            # the host's /var/run/cdi, which the container runtime reads.
            - {name: kubelet-plugins, mountPath: {{ $kubelet.plugins | quote }}}
            - {name: kubelet-plugins-registry, mountPath: {{ $kubelet.pluginsRegistry | quote }}}
            - {name: host-cdi, mountPath: /host/var/run/cdi}
            {{- end }}
      volumes:
        {{- range $hostMounts }}
        - name: {{ .name }}
          hostPath:
            path: {{ printf "%s%s" $hardware .path | quote }}
            type: {{ .type | default "Directory" }}
        {{- end }}
        - name: config
          configMap:
            name: plugvisor-config-{{ $name }}
        - name: device-plugins
          hostPath: {path: {{ $kubelet.devicePluginsOnHost | quote }}, type: Directory}
        - name: pod-resources
          hostPath: {path: {{ $kubelet.podResources | quote }}, type: DirectoryOrCreate}
        - name: runtime
          emptyDir: {medium: Memory, sizeLimit: 16Mi}
        - name: tmp
          emptyDir: {medium: Memory, sizeLimit: 16Mi}
        {{- if $dra }}
        # The node's own paths, in a lab too: the kubelet and the container runtime read them.
        - name: kubelet-plugins
          hostPath: {path: {{ $kubelet.plugins | quote }}, type: DirectoryOrCreate}
        - name: kubelet-plugins-registry
          hostPath: {path: {{ $kubelet.pluginsRegistry | quote }}, type: DirectoryOrCreate}
        - name: host-cdi
          hostPath: {path: /var/run/cdi, type: DirectoryOrCreate}
        {{- end }}
{{- end }}
