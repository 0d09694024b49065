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
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

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
        (["--set", "kinds.My_Kind.enabled=true"], "invalid propertyName 'My_Kind'"),
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
    a control character in it; and node.yaml's kubeletDir, which follows `kubelet`."""
    args = [helm(), "template", "plugvisor", str(CHART), *KUBE_VERSION, *settings]
    result = subprocess.run(args, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode != 0
    assert named in result.stderr


def test_values_are_rendered_as_values_never_as_yaml() -> None:
    """An image tag or a host path with a newline or a colon in it stays one string in one field: it cannot
    add a field to the pod (a securityContext, a command) nor break the document."""
    hostile = "x\n          workingDir: /injected"
    mounts = '[{"name": "host-dev", "path": "/dev: x", "mountPath": "/host/dev\\n  hostPID: true"}]'
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
    assert any(m["mountPath"] == "/host/dev\n  hostPID: true" for m in container["volumeMounts"])


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
