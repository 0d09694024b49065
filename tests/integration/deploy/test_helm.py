"""The Helm chart (deploy/helm/plugvisor) renders the kustomize overlays' objects, valid, from values.

Each overlay has a values file, deploy/helm/plugvisor/ci/<overlay>-values.yaml; the chart rendered with it
must give the objects `kubectl kustomize` gives for the overlay, apart from what Helm does its own way:
its labels (instance, managed-by, version, chart), the ConfigMap's fixed name where kustomize appends a
content hash, and the checksum annotation that rolls the agents when node.yaml changes instead. Helm is
the pinned one tools/install_helm.py builds (tox runs it); without it these tests skip, saying why.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from plugvisor.plugins.gpu import GpuOptions

from .conftest import KUBERNETES_VERSION, OVERLAYS, REPO, agents_with_config, check_kubelet_dirs, render

CHART = REPO / "deploy/helm/plugvisor"
VALUES = sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml"))
HELM_LABELS = (
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/version",
    "helm.sh/chart",
)
_HASH = re.compile(r"-[a-z0-9]{10}$")
KUBE_VERSION = ("--kube-version", KUBERNETES_VERSION)
"""What `helm template` and `lint` take the cluster to be (Helm's own default, v1.20, predates the chart)."""


def _installer() -> Any:
    spec = importlib.util.spec_from_file_location("install_helm", REPO / "tools" / "install_helm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def helm() -> str:
    """The Helm tools/install_helm.py installed beside this Python, never one found elsewhere on PATH."""
    installer = _installer()
    found = shutil.which("helm", path=str(Path(sys.executable).parent))
    if found is None or installer.installed_version(Path(found)) != installer.VERSION:
        pytest.skip(
            f"helm {installer.VERSION} is not installed in this environment: `python tools/install_helm.py` "
            "builds it from its Go module (tox's tests environment runs it; it needs go on PATH)"
        )
    return found


def chart(values: str | None, *extra: str) -> tuple[dict[str, Any], ...]:
    """`helm template` of the chart into kube-system, with ci/<values>-values.yaml (None: the defaults)."""
    args = [helm(), "template", "plugvisor", str(CHART), "--namespace", "kube-system", *KUBE_VERSION, *extra]
    if values is not None:
        args += ["--values", str(CHART / "ci" / f"{values}-values.yaml")]
    result = subprocess.run(args, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, f"helm template with {values}-values.yaml failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def comparable(docs: tuple[dict[str, Any], ...], *, hashed: bool) -> dict[tuple[str, str], dict[str, Any]]:
    """Objects by kind and name, without what only one of kustomize and Helm does (see the module's doc)."""

    def name(value: str) -> str:
        return _HASH.sub("", value) if hashed else value

    out = {}
    for original in docs:
        doc = copy.deepcopy(original)
        doc["metadata"]["name"] = name(doc["metadata"]["name"])
        template = doc.get("spec", {}).get("template", {})
        for labels in (doc["metadata"].get("labels", {}), template.get("metadata", {}).get("labels", {})):
            for key in HELM_LABELS:
                labels.pop(key, None)
        if doc["kind"] == "ConfigMap":
            doc["data"] = {k: yaml.safe_load(v) for k, v in doc["data"].items()}
        if template:
            template["metadata"].pop("annotations", None)
            pod = template["spec"]
            for volume in pod["volumes"]:
                if "configMap" in volume:
                    volume["configMap"]["name"] = name(volume["configMap"]["name"])
            pod["volumes"].sort(key=lambda v: v["name"])
            for container in pod["containers"] + pod.get("initContainers", []):
                container["volumeMounts"].sort(key=lambda m: m["name"])
        out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def test_every_overlay_has_a_values_file_and_nothing_else_does() -> None:
    assert VALUES == OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_chart_renders_the_overlays_objects(overlay: str) -> None:
    """Same DaemonSets, containers, mounts, probes, security contexts and node.yaml as `kubectl kustomize`."""
    expected = comparable(render(overlay), hashed=True)
    rendered = comparable(chart(overlay), hashed=False)
    assert sorted(rendered) == sorted(expected)
    for key, doc in expected.items():
        assert rendered[key] == doc, f"{key[0]}/{key[1]} differs from overlays/{overlay}"


@pytest.mark.parametrize("values", [*VALUES, None])
def test_every_object_the_chart_renders_is_a_valid_kubernetes_object(values: str | None) -> None:
    """The Kubernetes schema, unknown fields refused, as for the overlays; by default nothing is enabled."""
    docs = chart(values)
    if values is None:
        assert docs == (), "with its default values the chart deploys nothing: the kinds are opt-in"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{values}: {doc['kind']}/{doc['metadata']['name']} is not a valid object: {exc}")


@pytest.mark.parametrize("values", VALUES)
def test_helm_lint_finds_nothing(values: str) -> None:
    result = subprocess.run(
        [
            helm(),
            "lint",
            "--strict",
            *KUBE_VERSION,
            str(CHART),
            "--values",
            str(CHART / "ci" / f"{values}-values.yaml"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_changed_node_yaml_rolls_the_agents() -> None:
    """What the overlays' hashed ConfigMap names do: the pod template changes with node.yaml."""

    def checksum(*extra: str) -> str:
        ds = next(d for d in chart("generic", *extra) if d["kind"] == "DaemonSet")
        return str(ds["spec"]["template"]["metadata"]["annotations"]["checksum/node.yaml"])

    # --set on one item of a list would replace the whole list (Helm's way): the resource is given whole.
    twenty = '[{"name": "plugvisor.io/fuse", "kind": "generic", "paths": ["/dev/fuse"], "count": 20}]'
    assert checksum() != checksum("--set-json", f"kinds.generic.resources={twenty}")
    assert checksum() == checksum("--set", "image.tag=other")


K0S = "/var/lib/k0s/kubelet"
MICROK8S = "/var/snap/microk8s/common/var/lib/kubelet"


@pytest.mark.parametrize(
    ("settings", "root", "device_plugins"),
    [
        ([], "/var/lib/kubelet", "/var/lib/kubelet/device-plugins"),
        (["--set", f"kubelet.rootDir={K0S}"], K0S, "/var/lib/kubelet/device-plugins"),
        (["--set", f"kubelet.rootDir={MICROK8S}/"], MICROK8S, "/var/lib/kubelet/device-plugins"),
        (
            ["--set", "kubelet.rootDir=/data/kubelet,kubelet.devicePluginsDir=/data/kubelet/device-plugins/"],
            "/data/kubelet",
            "/data/kubelet/device-plugins",
        ),
    ],
    ids=["default", "k0s", "microk8s-trailing-slash", "moved-device-plugins"],
)
def test_every_kubelet_directory_the_agent_uses_is_mounted_from_the_configured_kubelet(
    settings: list[str], root: str, device_plugins: str
) -> None:
    """With kubelet.rootDir (and kubelet.devicePluginsDir), each kubelet directory an agent's node.yaml
    leads it to is mounted where it looks, from the node's (conftest.check_kubelet_dirs says which): device
    plugins and DRA drivers of every kind, valid objects."""
    docs = chart("lab", "--values", str(CHART / "ci" / "lab-dra-values.yaml"), *settings)
    agents = list(agents_with_config(docs))
    assert len(agents) == 8
    for ds, config in agents:
        check_kubelet_dirs(ds, config, root=root, device_plugins=device_plugins)
        kubernetes_validate.validate(ds, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("listen", ["0.0.0.0:9400", ":8080", "[::]:65535", "0.0.0.0:1"])
def test_the_metrics_port_the_probes_and_container_declare_is_node_metrics_listens(listen: str) -> None:
    """The container's `metrics` port, which both probes name, is the port node.metrics.listen binds, for
    device plugins and DRA drivers alike."""
    docs = chart(
        "gpu", "--set", "kinds.gpu.dra.enabled=true", "--set-string", f"node.metrics.listen={listen}"
    )
    agents = list(agents_with_config(docs))
    assert len(agents) == 2
    for ds, config in agents:
        container = ds["spec"]["template"]["spec"]["containers"][0]
        assert config.metrics is not None
        assert config.metrics.listen == listen
        assert container["ports"] == [
            {"name": "metrics", "containerPort": config.metrics.port, "protocol": "TCP"}
        ]
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        kubernetes_validate.validate(ds, KUBERNETES_VERSION, strict=True)


def test_one_release_with_both_lab_values_renders_both_lab_overlays() -> None:
    """A kind's device plugins and DRA drivers side by side, as `kubectl apply -k` of overlays/lab and
    overlays/lab-dra together: their objects, each once."""
    expected = comparable(render("lab"), hashed=True) | comparable(render("lab-dra"), hashed=True)
    docs = chart("lab-dra", "--values", str(CHART / "ci" / "lab-values.yaml"))
    rendered = comparable(docs, hashed=False)
    assert len(docs) == len(rendered), "an object rendered twice"
    assert sorted(rendered) == sorted(expected)
    assert rendered == expected


_MOUNT_NAMED_CONFIG = '[{"name": "config", "path": "/etc", "mountPath": "/host/etc", "readOnly": true}]'
_MOUNT_OVER_RUNTIME = '[{"name": "host-run", "path": "/run", "mountPath": "/run/plugvisor"}]'
_TWO_MOUNTS_OF_ONE_NAME = (
    '[{"name": "scratch", "path": "/srv", "mountPath": "/host/srv"},'
    ' {"name": "scratch", "path": "/opt", "mountPath": "/host/opt"}]'
)
_TWO_MOUNTS_AT_ONE_PATH = (
    '[{"name": "one", "path": "/srv", "mountPath": "/host/srv"},'
    ' {"name": "two", "path": "/opt", "mountPath": "/host/srv/"}]'
)
NIC_AS_GPU_DRIVER = '[{"name": "gpu.plugvisor.io", "kind": "nic", "mode": "dra"}]'


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (
            ["--set", "kinds.gpu.dra.enable=true"],
            "'/kinds/gpu/dra': additional properties 'enable' not allowed",
        ),
        (["--set", "kinds.nic.resources[0].mode=dra"], "'/kinds/nic/resources/0/mode': value must be one of"),
        (["--set", "kinds.gpu.dra.resources[0].name=plugvisor.io/gpu"], "'/kinds/gpu/dra/resources/0/name'"),
        (["--set", "node.specRoot=/"], "'/node/specRoot'"),
        (
            [
                *("--set", "kinds.gpu.dra.enabled=true,kinds.nic.dra.enabled=true"),
                *("--set-json", f"kinds.nic.dra.resources={NIC_AS_GPU_DRIVER}"),
            ],
            "kinds.nic.dra.resources: the driver gpu.plugvisor.io is already another DRA resource's",
        ),
        (["--set", "kinds.My_Kind.enabled=true"], "at '/kinds': additional properties 'My_Kind' not allowed"),
        (
            [
                "--set-json",
                'kinds.generic.hostMounts=[{"name": "x", "path": "/etc",'
                ' "mountPath": "/host/../etc/plugvisor"}]',
            ],
            "'/kinds/generic/hostMounts/0/mountPath'",
        ),
        (
            [
                "--set-json",
                'kinds.generic.hostMounts=[{"name": "x", "path": "/sys/../etc", "mountPath": "/host/sys"}]',
            ],
            "'/kinds/generic/hostMounts/0/path'",
        ),
        (["--set", "lab.root=/var/lib/../../etc"], "'/lab/root'"),
        (
            ["--set", f"kinds.gpu.dra.resources[0].name={'a' * 90}.example.com"],
            "'/kinds/gpu/dra/resources/0/name'",
        ),
        (["--set-json", 'kinds.gpu.nodeSelector={"bad key!": "true"}'], "'/kinds/gpu/nodeSelector'"),
        (["--set-json", 'nodeSelector={"gpu": true}'], "'/nodeSelector/gpu'"),
        (["--set-json", 'podLabels={"team": "a b"}'], "'/podLabels/team'"),
        (["--set", "resources.limits.memory=lots"], "'/resources/limits/memory'"),
        (["--set", "resources.limit.memory=1Gi"], "'/resources': additional properties 'limit' not allowed"),
        (["--set", "resources.requests.cpu=-1"], "'/resources/requests/cpu'"),
        (["--set-json", 'tolerations=[{"operator": "Sometimes"}]'], "'/tolerations/0/operator'"),
        (["--set", "kinds.gpu.driverRoot=/run/nvidia/../../etc"], "'/kinds/gpu/driverRoot'"),
        (["--set", "kinds.gpu.dra.resources[0].extendedResourceName=gpu"], "extendedResourceName'"),
        (["--set", "nodeConfigs.configs.Shared.gpu.resources=null"], "'/nodeConfigs/configs'"),
        (
            ["--set-json", 'nodeConfigs.configs.shared={"gpu": {"resources": [], "replicas": 2}}'],
            "'/nodeConfigs/configs/shared/gpu': additional properties 'replicas' not allowed",
        ),
        (
            [
                *("--set", "kinds.gpu.enabled=true"),
                *(
                    "--set-json",
                    'nodeConfigs.configs.shared={"gpus": {"resources": [{"name": "a.io/b", "kind": "gpu"}]}}',
                ),
            ],
            "nodeConfigs.configs.shared.gpus: there is no kind gpus in kinds",
        ),
        (
            ["--set-json", f"kinds.generic.hostMounts={_MOUNT_NAMED_CONFIG}"],
            "'/kinds/generic/hostMounts/0/name'",
        ),
        (
            ["--set-json", f"kinds.generic.hostMounts={_MOUNT_OVER_RUNTIME}"],
            "'/kinds/generic/hostMounts/0/mountPath'",
        ),
        (
            [
                *("--set", "kinds.generic.enabled=true"),
                *("--set-json", f"kinds.generic.hostMounts={_TWO_MOUNTS_OF_ONE_NAME}"),
            ],
            "kinds.generic.hostMounts: the name scratch is given twice",
        ),
        (
            [
                *("--set", "kinds.generic.enabled=true"),
                *("--set-json", f"kinds.generic.hostMounts={_TWO_MOUNTS_AT_ONE_PATH}"),
            ],
            "kinds.generic.hostMounts: the mountPath /host/srv is given twice",
        ),
        (
            ["--set", "kinds.gpu.enabled=true", "--set", "kinds.gpu.driverRoot=/sys"],
            "kinds.gpu.driverRoot: /sys is mounted for the driver root",
        ),
        (
            ["--set", "kinds.gpu.dra.enabled=true", "--set", "kinds.gpu.driverRoot=/proc/driver/"],
            "kinds.gpu.driverRoot: /proc/driver is mounted for the driver root",
        ),
        (["--set", "node.metrics.listen=0.0.0.0:65536"], "'/node/metrics/listen'"),
        (["--set", "node.metrics.listen=:0"], "'/node/metrics/listen'"),
        (["--set", "node.metrics.listen=127.0.0.1:9400"], "'/node/metrics/listen'"),
        (["--set-string", "node.metrics.listen=9400"], "'/node/metrics/listen'"),
        (["--set", "kubelet.rootDir=var/lib/kubelet"], "'/kubelet/rootDir'"),
        (["--set", "kubelet.rootDir=/var/lib/k0s/../kubelet"], "'/kubelet/rootDir'"),
        (["--set", "kubelet.rootDir=/var/lib/k0s/kubelet/.."], "'/kubelet/rootDir'"),
        (["--set", "kubelet.rootDir=/var//lib/kubelet"], "'/kubelet/rootDir'"),
        (["--set", "kubelet.rootDir=/"], "'/kubelet/rootDir'"),
        (
            ["--set-json", 'kubelet.devicePluginsDir="/var/lib/kubelet\\ndevice-plugins"'],
            "'/kubelet/devicePluginsDir'",
        ),
        (
            ["--set", "node.kubeletDir=/var/lib/k0s/kubelet/device-plugins"],
            "node.kubeletDir: the chart sets it from kubelet.rootDir",
        ),
    ],
)
def test_values_the_chart_cannot_honour_are_refused_naming_the_key(settings: list[str], named: str) -> None:
    """values.schema.json: a misspelt key, a DRA resource among the device plugins, a driver name that
    cannot name a DeviceClass, a node.yaml key the chart sets itself; and one driver name given twice. Never
    silently ignored, nor left for the cluster to refuse half-way through an install. Nor are values the
    objects would contradict: a kind name that cannot name a DaemonSet, a host mount whose name or path is
    one the chart's own volumes use, a metrics address the kubelet's probes cannot reach (no port, port 0
    or past 65535, loopback), a kubelet directory that is relative or has `..`, `.`, an empty component or
    a control character in it; and node.yaml's kubeletDir, which follows `kubelet`. A driver root the kind
    already mounts (/sys, /proc/driver) is driverRoot's fault, not a host mount given twice. Host paths,
    mount paths and the lab's root with `..` (a mount that leads elsewhere than it says), a driver name
    longer than the API server takes (63), label keys and values Kubernetes refuses (and a boolean for a
    string), resources that are not a ResourceRequirements, a per-node config naming a kind there is not."""
    args = [helm(), "template", "plugvisor", str(CHART), *KUBE_VERSION, *settings]
    result = subprocess.run(args, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode != 0
    assert named in result.stderr


def test_values_are_rendered_as_values_never_as_yaml() -> None:
    """An image tag or a host path with a newline or a colon in it stays one string in one field: it cannot
    add a field to the pod (a securityContext, a command) nor break the document."""
    hostile = "x\n          workingDir: /injected"
    mounts = '[{"name": "host-dev", "path": "/dev: x", "mountPath": "/host/dev: {hostPID: true}"}]'
    docs = chart(
        "generic",
        *("--set-string", f"image.tag={hostile}"),
        *("--set-json", f"kinds.generic.hostMounts={mounts}"),
    )
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "workingDir" not in container
    assert "hostPID" not in pod
    assert container["image"].endswith(f":{hostile}")
    assert {"name": "host-dev", "hostPath": {"path": "/dev: x", "type": "Directory"}} in pod["volumes"]
    assert any(m["mountPath"] == "/host/dev: {hostPID: true}" for m in container["volumeMounts"])


def test_the_gpu_dra_driver_beside_cdi_device_plugins_mounts_the_cdi_directory_once() -> None:
    """ci/gpu-cdi's gpu agent mounts the host's /var/run/cdi as host-cdi; the gpu DRA agent, which inherits
    the kind's mounts and mounts that directory itself, must not get it twice (an invalid DaemonSet)."""
    docs = chart("gpu-cdi", "--set", "kinds.gpu.dra.enabled=true")
    for doc in docs:
        if doc["kind"] != "DaemonSet":
            continue
        pod = doc["spec"]["template"]["spec"]
        volumes = [v["name"] for v in pod["volumes"]]
        mounts = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
        assert len(set(volumes)) == len(volumes), doc["metadata"]["name"]
        assert len(set(mounts)) == len(mounts), doc["metadata"]["name"]
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert "host-cdi" in volumes


def _label_values(doc: dict[str, Any]) -> list[object]:
    """Every label value of an object: its own, its selector's, its pod template's, its node selector's."""
    spec = doc.get("spec", {})
    template = spec.get("template", {})
    maps = [
        doc["metadata"].get("labels", {}),
        spec.get("selector", {}).get("matchLabels", {}),
        template.get("metadata", {}).get("labels", {}),
        template.get("metadata", {}).get("annotations", {}),
        template.get("spec", {}).get("nodeSelector", {}),
    ]
    return [value for labels in maps for value in labels.values()]


@pytest.mark.parametrize("name", ["yes", "on", "null", "0x1f", "1e3", "true"])
def test_every_label_value_renders_as_a_string_whatever_the_kind_is_called(name: str) -> None:
    """YAML reads yes, on and true as booleans, null as nothing and 0x1f, 1e3 as numbers: a kind (or a
    per-node config) of that name must still give string labels, or the API server refuses the object."""
    kind = '{"enabled": true, "resources": [{"name": "x.io/y", "kind": "generic", "paths": ["/dev/fuse"]}],'
    kind += ' "hostMounts": [], "nodeSelector": {"a": "' + name + '"}}'
    config = (
        '{"' + name + '": {"resources": [{"name": "x.io/y", "kind": "generic", "paths": ["/dev/null"]}]}}'
    )
    docs = chart(
        None,
        *("--set-json", f"kinds.{name}={kind}"),
        *("--set-json", f"nodeConfigs.configs.{name}={config}"),
        *("--set-json", f'podLabels={{"team": "{name}"}}'),
    )
    assert len([d for d in docs if d["kind"] == "DaemonSet"]) == 2
    for doc in docs:
        for value in _label_values(doc):
            assert isinstance(value, str), f"{doc['kind']}/{doc['metadata']['name']}: {value!r}"
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_bad_kind_name_is_named_at_the_same_place_on_every_run() -> None:
    """Helm's schema library reported propertyNames failures at a random other key of the values."""
    args = [helm(), "template", "plugvisor", str(CHART), *KUBE_VERSION, "--set", "kinds.My_Kind.enabled=true"]
    errors = {
        subprocess.run(args, capture_output=True, text=True, check=False, timeout=120).stderr
        for _ in range(4)
    }
    assert len(errors) == 1
    assert "at '/kinds': additional properties 'My_Kind' not allowed" in errors.pop()


def _template(*settings: str) -> subprocess.CompletedProcess[str]:
    args = [helm(), "template", "plugvisor", str(CHART), "--namespace", "kube-system", *settings]
    return subprocess.run(args, capture_output=True, text=True, check=False, timeout=120)


def test_device_plugins_render_offline_without_a_kube_version() -> None:
    result = _template("--set", "kinds.gpu.enabled=true")
    assert result.returncode == 0, result.stderr
    assert [d["kind"] for d in yaml.safe_load_all(result.stdout) if d] == ["ConfigMap", "DaemonSet"]


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ((), "no cluster was asked its version: pass the cluster's, e.g. helm template --kube-version 1.37"),
        (("--kube-version", "1.28.0"), "DRA drivers need Kubernetes 1.34 or newer"),
        (("--kube-version", "1.33.5"), "this release is for v1.33.5"),
    ],
)
def test_dra_drivers_are_refused_for_a_release_they_do_not_fit_saying_which(
    settings: tuple[str, ...], said: str
) -> None:
    result = _template("--set", "kinds.gpu.dra.enabled=true", *settings)
    assert result.returncode != 0
    assert "kinds.gpu.dra.enabled: " in result.stderr and said in result.stderr


def test_device_plugins_are_refused_below_the_oldest_kubelet_the_project_plays() -> None:
    result = _template("--set", "kinds.gpu.enabled=true", "--kube-version", "1.25.0")
    assert result.returncode != 0 and "need Kubernetes 1.26 or newer" in result.stderr
    assert _template("--set", "kinds.gpu.dra.enabled=true", "--kube-version", "1.34.0").returncode == 0


def _pod(docs: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == name]
    pod: dict[str, Any] = ds["spec"]["template"]
    return pod


def test_what_nvidias_chart_takes_reaches_every_agents_pod() -> None:
    """tolerations, affinity, nodeSelector, priorityClassName, imagePullSecrets, pod labels and annotations,
    resources and the update strategy, as NVIDIA's device-plugin chart takes them."""
    affinity = '{"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms":'
    affinity += ' [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}'
    docs = chart(
        "gpu",
        *("--set", "kinds.gpu.dra.enabled=true"),
        *(
            "--set-json",
            'tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]',
        ),
        *("--set-json", f"affinity={affinity}"),
        *("--set-json", 'nodeSelector={"pool": "gpu", "kubernetes.io/os": "windows"}'),
        *("--set", "priorityClassName=gpu-critical"),
        *("--set-json", 'imagePullSecrets=[{"name": "registry"}]'),
        *("--set-json", 'podLabels={"team": "ml", "plugvisor.io/kind": "not-mine"}'),
        *("--set-json", 'podAnnotations={"example.com/note": "x"}'),
        *(
            "--set-json",
            'resources={"requests": {"cpu": "50m", "memory": "100Mi"}, "limits": {"memory": 1073741824}}',
        ),
        *(
            "--set-json",
            'updateStrategy={"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}',
        ),
    )
    for name in ("plugvisor-gpu", "plugvisor-gpu-dra"):
        template = _pod(docs, name)
        pod = template["spec"]
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert pod["affinity"] == json.loads(affinity)
        assert pod["nodeSelector"] == {
            "kubernetes.io/os": "linux",  # the chart's own wins: the agents are Linux processes
            "pool": "gpu",
            "feature.node.kubernetes.io/pci-0302_10de.present": "true",
        }
        assert pod["priorityClassName"] == "gpu-critical"
        assert pod["imagePullSecrets"] == [{"name": "registry"}]
        assert template["metadata"]["labels"]["team"] == "ml"
        assert template["metadata"]["labels"]["plugvisor.io/kind"] == "gpu"  # the selector's own wins
        assert template["metadata"]["annotations"]["example.com/note"] == "x"
        assert pod["containers"][0]["resources"]["requests"] == {"cpu": "50m", "memory": "100Mi"}
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "plugvisor-gpu"]
    # Helm merges a map given with the chart's own: maxSurge stays 0 unless given
    rolling = {"maxSurge": 0, "maxUnavailable": "10%"}
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": rolling}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_per_node_config_runs_its_own_agent_on_its_nodes_and_the_default_keeps_off_them() -> None:
    dra = {
        "name": "gpu.plugvisor.io",
        "kind": "gpu",
        "mode": "dra",
        "match": {"pciAddresses": ["0000:3b:00.0"]},
    }
    shared = json.dumps(
        {
            "gpu": {
                "resources": [{"name": "plugvisor.io/gpu", "kind": "gpu", "replicas": 4}],
                "dra": {"resources": [dra]},
            }
        }
    )
    terms = [
        {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
    ]
    affinity = json.dumps(
        {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}
    )
    docs = chart(
        "gpu-dra",
        *("--set", "kinds.gpu.enabled=true"),
        *("--set-json", f"nodeConfigs.configs.shared={shared}"),
        *(
            "--set-json",
            'nodeConfigs.configs.other={"gpu": {"resources": [{"name": "plugvisor.io/gpu", "kind": "gpu"}]}}',
        ),
        *("--set-json", f"affinity={affinity}"),
    )
    names = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "DaemonSet")
    assert names == [
        "plugvisor-gpu",
        "plugvisor-gpu-dra",
        "plugvisor-gpu-other",
        "plugvisor-gpu-shared",
        "plugvisor-gpu-shared-dra",
    ]
    configs = {
        d["metadata"]["name"]: yaml.safe_load(d["data"]["node.yaml"])
        for d in docs
        if d["kind"] == "ConfigMap"
    }
    assert configs["plugvisor-config-gpu-shared"]["resources"][0]["replicas"] == 4
    assert "replicas" not in configs["plugvisor-config-gpu"]["resources"][0]
    shared_pod = _pod(docs, "plugvisor-gpu-shared")
    assert shared_pod["spec"]["nodeSelector"]["plugvisor.io/config"] == "shared"
    assert shared_pod["metadata"]["labels"]["plugvisor.io/config"] == "shared"
    default_terms = _pod(docs, "plugvisor-gpu")["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    keep_off = {"key": "plugvisor.io/config", "operator": "NotIn", "values": ["other", "shared"]}
    assert len(default_terms) == 2 and all(keep_off in term["matchExpressions"] for term in default_terms)
    dra_terms = _pod(docs, "plugvisor-gpu-dra")["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert all({**keep_off, "values": ["shared"]} in term["matchExpressions"] for term in dra_terms)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_prometheus_operators_monitors_are_off_by_default_and_select_every_agent() -> None:
    assert not [d for d in chart("gpu") if d["apiVersion"].startswith("monitoring.coreos.com")]
    docs = chart(
        "gpu",
        *("--set", "monitoring.podMonitor.enabled=true,monitoring.serviceMonitor.enabled=true"),
        *("--set-json", 'monitoring.podMonitor.labels={"release": "prometheus"}'),
    )
    by_kind = {d["kind"]: d for d in docs}
    pod_monitor, service_monitor, service = (
        by_kind["PodMonitor"],
        by_kind["ServiceMonitor"],
        by_kind["Service"],
    )
    agent_labels = _pod(docs, "plugvisor-gpu")["metadata"]["labels"]
    assert pod_monitor["metadata"]["labels"]["release"] == "prometheus"
    for selector in (pod_monitor["spec"]["selector"]["matchLabels"], service["spec"]["selector"]):
        assert selector.items() <= agent_labels.items()
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert service_monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None"
    kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    ("driver_root", "host_path"), [("/", "/usr"), ("/run/nvidia/driver/", "/run/nvidia/driver")]
)
def test_the_driver_root_is_mounted_read_only_where_the_gpu_resources_read_it(
    driver_root: str, host_path: str
) -> None:
    docs = chart("gpu-dra", "--set", "kinds.gpu.enabled=true", "--set", f"kinds.gpu.driverRoot={driver_root}")
    for ds, config in agents_with_config(docs):
        pod = ds["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "host-driver")
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "host-driver")
        assert volume["hostPath"]["path"] == host_path
        assert mount == {"name": "host-driver", "mountPath": f"/host{host_path}", "readOnly": True}
        assert any(
            m["mountPath"] == "/host/etc/cdi" and m["readOnly"] for m in pod["containers"][0]["volumeMounts"]
        )
        for resource in config.resources:
            # what the gpu kind reads the driver from, under hostRoot /host, where host-driver is mounted
            read = GpuOptions.model_validate({k: v for k, v in resource.options.items() if k != "mode"})
            assert read.driver_root == (driver_root.rstrip("/") or "/")
    without = chart("gpu", "--set", "kinds.gpu.driverRoot=")
    assert not any(v["name"] == "host-driver" for v in _pod(without, "plugvisor-gpu")["spec"]["volumes"])


def test_the_gpu_device_class_serves_the_extended_resource_and_node_yaml_never_sees_the_key() -> None:
    docs = chart("gpu-dra")
    (device_class,) = [d for d in docs if d["kind"] == "DeviceClass"]
    assert device_class["spec"]["extendedResourceName"] == "plugvisor.io/gpu"
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert "extendedResourceName" not in configmap["data"]["node.yaml"]
    plain = [{"name": "gpu.plugvisor.io", "kind": "gpu", "mode": "dra"}]
    none = chart("gpu-dra", "--set-json", f"kinds.gpu.dra.resources={json.dumps(plain)}")
    assert "extendedResourceName" not in next(d for d in none if d["kind"] == "DeviceClass")["spec"]


def _security(docs: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    security: dict[str, Any] = _pod(docs, name)["spec"]["containers"][0]["securityContext"]
    return security


def test_the_gpu_agents_run_privileged_by_default_so_that_nvml_can_open_the_device_nodes() -> None:
    """kinds.gpu.nvml.deviceAccess privileged (the default): the device plugin's agent and the DRA driver's
    are privileged (without allowPrivilegeEscalation false, which the API server refuses beside it); every
    other kind's agent keeps no privilege and no capability."""
    docs = chart("gpu", "--set", "kinds.gpu.dra.enabled=true", "--set", "kinds.nic.enabled=true")
    for name in ("plugvisor-gpu", "plugvisor-gpu-dra"):
        security = _security(docs, name)
        assert security["privileged"] is True
        assert "allowPrivilegeEscalation" not in security and "capabilities" not in security
        assert "runtimeClassName" not in _pod(docs, name)["spec"]
    assert _security(docs, "plugvisor-nic")["privileged"] is False
    assert _security(docs, "plugvisor-nic")["capabilities"] == {"drop": ["ALL"]}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_nvidias_runtime_class_gives_nvml_the_device_nodes_without_privilege() -> None:
    docs = chart(
        "gpu",
        *("--set", "kinds.gpu.dra.enabled=true"),
        *("--set", "kinds.gpu.nvml.deviceAccess=runtimeClass"),
        *("--set", "kinds.gpu.nvml.runtimeClassName=nvidia-cdi"),
    )
    for name in ("plugvisor-gpu", "plugvisor-gpu-dra"):
        pod = _pod(docs, name)["spec"]
        assert pod["runtimeClassName"] == "nvidia-cdi"
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"  # NVML, nothing of CUDA
        security = _security(docs, name)
        assert security["privileged"] is False and security["capabilities"] == {"drop": ["ALL"]}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    "settings", [["--set", "kinds.gpu.nvml.deviceAccess=none"], ["--set", "lab.enabled=true"]]
)
def test_without_device_access_or_in_a_lab_the_gpu_agent_keeps_no_privilege(settings: list[str]) -> None:
    """none: NVML cannot start and the kind serves from sysfs; a lab's NVML opens no device at all."""
    docs = chart("gpu", *settings)
    security = _security(docs, "plugvisor-gpu")
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert "runtimeClassName" not in _pod(docs, "plugvisor-gpu")["spec"]


def test_a_gpu_agent_whose_resources_never_load_nvml_keeps_no_privilege() -> None:
    """Every gpu resource with `nvml.enabled: false`: nothing opens the device nodes, nothing is given."""
    off = [
        {
            "name": "plugvisor.io/gpu",
            "kind": "gpu",
            "match": {"vendors": ["0x10de"]},
            "nvml": {"enabled": False},
        }
    ]
    docs = chart("gpu", "--set-json", f"kinds.gpu.resources={json.dumps(off)}")
    assert _security(docs, "plugvisor-gpu")["privileged"] is False
    one_on = [*off, {"name": "plugvisor.io/gpu-b", "kind": "gpu", "match": {"vendors": ["0x10de"]}}]
    docs = chart("gpu", "--set-json", f"kinds.gpu.resources={json.dumps(one_on)}")
    assert _security(docs, "plugvisor-gpu")["privileged"] is True


def test_a_device_access_the_chart_does_not_know_is_refused_naming_the_key() -> None:
    result = _template("--set", "kinds.gpu.enabled=true", "--set", "kinds.gpu.nvml.deviceAccess=hostDev")
    assert result.returncode != 0 and "/kinds/gpu/nvml/deviceAccess" in result.stderr


def test_the_migration_guides_helm_command_runs_the_gpu_agent_on_the_labelled_nodes_alone() -> None:
    """docs/migrating-from-nvidia.md's `helm install` (by node): the agent selects the label it sets and
    not Node Feature Discovery's, which a cluster without NFD has on no node."""
    guide = (REPO / "docs/migrating-from-nvidia.md").read_text()
    command = re.search(r"helm install plugvisor deploy/helm/plugvisor (.*?)\n   ```", guide, re.DOTALL)
    assert command, "docs/migrating-from-nvidia.md has no `helm install plugvisor` command"
    settings = re.findall(r"--(set|set-json) '?([^' ]+)'?", command[1])
    docs = chart(None, *(arg for flag, value in settings for arg in (f"--{flag}", value)))
    assert _pod(docs, "plugvisor-gpu")["spec"]["nodeSelector"] == {
        "kubernetes.io/os": "linux",
        "plugvisor.io/gpu": "true",
    }
