"""The Kubernetes deployment: every overlay renders, validates against the Kubernetes schema, and agrees
with its own node.yaml, with the lab overlay and with kind-config.yaml."""

from __future__ import annotations

import copy
import functools
import os
import posixpath
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.release import default_pod_resources_socket
from plugvisor.dra.devices import PublishedDevice
from plugvisor.emulators.lab import Lab
from plugvisor.emulators.lab import nvml as lab_nvml
from plugvisor.plugins import kinds
from plugvisor.supervisor.config import NodeConfig, parse_config
from plugvisor.testing import dra_devices

from ..node_install import plugvisor_without_the_extra
from .conftest import (
    KUBERNETES_VERSION,
    KUSTOMIZE,
    OVERLAYS,
    REPO,
    agents_with_config,
    check_kubelet_dirs,
    kind_config,
    kubectl,
    objects,
    render,
)

KUBELET_DEVICE_PLUGINS = "/var/lib/kubelet/device-plugins"
DRA_CDI_DIR = "/var/run/cdi"
"""Where a DRA driver writes each prepared claim's CDI spec (its --cdi-dir default, inside hostRoot)."""
PCI_IDS_DIR = "/usr/share"
"""Where the PCI ID database is (usr/share/hwdata, misc, or share itself, by distribution)."""
KUBELET_POD_RESOURCES = "/var/lib/kubelet/pod-resources"
LAB_NVML_STATE = f"/{lab_nvml.STATE_DIR}"
"""The lab's NVML state, under the lab's root."""
_GLOB = re.compile(r"[*?\[]")


def test_every_kind_has_an_overlay_and_the_readme_names_each() -> None:
    """One overlay per kind, the CDI variant and the lab; the README says which to apply for what."""
    assert set(OVERLAYS) == {
        *("gpu", "gpu-cdi", "nic", "fpga", "generic", "lab"),
        *("gpu-dra", "nic-dra", "fpga-dra", "generic-dra", "lab-dra"),
    }
    readme = (REPO / "README.md").read_text()
    for overlay in OVERLAYS:
        assert f"overlays/{overlay}" in readme, f"README.md does not say when to apply overlays/{overlay}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_is_a_valid_kubernetes_object(overlay: str) -> None:
    """Each object `kubectl kustomize` renders passes the Kubernetes schema, unknown fields refused."""
    docs = render(overlay)
    assert {doc["kind"] for doc in docs} >= {"DaemonSet", "ConfigMap"}
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            pytest.fail(
                f"overlays/{overlay}: {name} is not a valid Kubernetes {KUBERNETES_VERSION} object: {exc}"
            )


# -- one agent DaemonSet and what it mounts ---------------------------------------------------------


def _agents(overlay: str) -> list[dict[str, Any]]:
    return [ds for ds in objects(overlay, "DaemonSet") if ds["metadata"]["name"] != "plugvisor-lab"]


def _agent_ids() -> list[tuple[str, str]]:
    return [(overlay, ds["metadata"]["name"]) for overlay in OVERLAYS for ds in _agents(overlay)]


def _daemonset(overlay: str, name: str) -> dict[str, Any]:
    return next(ds for ds in objects(overlay, "DaemonSet") if ds["metadata"]["name"] == name)


def _container(ds: dict[str, Any], name: str = "agent") -> dict[str, Any]:
    return next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _volumes(ds: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}


def _node_config(overlay: str, ds: dict[str, Any]) -> tuple[NodeConfig, dict[str, Any]]:
    """The agent's node.yaml, found through its --config argument, the mount and the ConfigMap."""
    agent = _container(ds)
    config_path = next(a.split("=", 1)[1] for a in agent["args"] if a.startswith("--config="))
    mount = next(m for m in agent["volumeMounts"] if m["mountPath"] == posixpath.dirname(config_path))
    volume = _volumes(ds)[mount["name"]]
    configmaps = {cm["metadata"]["name"]: cm for cm in objects(overlay, "ConfigMap")}
    name = volume["configMap"]["name"]
    assert name in configmaps, (
        f"{ds['metadata']['name']} mounts ConfigMap {name}, which the overlay does not render"
    )
    text = configmaps[name]["data"][posixpath.basename(config_path)]
    return parse_config(yaml.safe_load(text), source=f"{overlay}:{name}"), yaml.safe_load(text)


def _in_a_lab(config: NodeConfig) -> bool:
    """Whether the agent reads a lab: the paths it hands the kubelet are under a lab's root, not at /."""
    return str(config.spec_root or "/") != "/"


def _needed_host_paths(config: NodeConfig) -> dict[str, bool]:  # noqa: PLR0912 - one rule per kind
    """Host paths each configured kind reads (False) or writes (True), from the kinds' documentation."""
    needs: dict[str, bool] = {}
    for resource in config.resources:
        options = resource.options
        if resource.dra:
            needs[DRA_CDI_DIR] = True  # each prepared claim's CDI spec
            if resource.kind in ("gpu", "nic", "fpga"):
                needs[PCI_IDS_DIR] = False  # the devices' `model` attribute, from pci.ids
        if resource.kind == "gpu":
            needs |= {"/sys": False, "/dev": False, "/proc/driver": False}
            # NVIDIA's user-space driver (driverRoot; / keeps it under /usr) and the toolkit's CDI spec
            driver_root = options.get("driverRoot", "/")
            needs |= {"/usr" if driver_root == "/" else driver_root: False, "/etc/cdi": False}
            if _in_a_lab(config) and options.get("nvml", {}).get("enabled", "auto") is not False:
                # The lab's libnvidia-ml finds the lab's NVML state by walking up from its own path under
                # hostRoot: without it there NVML says the driver is not loaded (docs/lab.md).
                needs[LAB_NVML_STATE] = False
            if options.get("cdi"):
                needs[options.get("cdiDir", "/var/run/cdi")] = True
        elif resource.kind == "nic":
            needs |= {"/sys": False, "/dev": False}
        elif resource.kind == "fpga":
            needs |= {"/sys": True, "/dev": needs.get("/dev", False)}
            cleanup = options.get("releaseCleanup")
            if cleanup:
                socket = cleanup.get("podResourcesSocket", "/var/lib/kubelet/pod-resources/kubelet.sock")
                needs[posixpath.dirname(socket)] = False
        elif resource.kind == "generic":
            groups = options.get("groups") or [{"paths": options["paths"]}]
            for group in groups:
                for entry in group["paths"]:
                    path = entry if isinstance(entry, str) else entry["path"]
                    static = [p for p in PurePosixPath(path).parent.parts if not _GLOB.search(p)]
                    needs.setdefault(str(PurePosixPath(*static)), False)
        else:
            pytest.fail(f"no mount rule for kind {resource.kind!r}: add one to this test")
    return needs


def _cdi_dirs(config: NodeConfig) -> set[str]:
    """The CDI spec directories the configuration writes (DRA claims', the gpu kind's with `cdi: true`)."""
    found = {DRA_CDI_DIR for resource in config.resources if resource.dra}
    return found | {
        resource.options.get("cdiDir", DRA_CDI_DIR)
        for resource in config.resources
        if resource.kind == "gpu" and resource.options.get("cdi")
    }


@pytest.mark.parametrize(("overlay", "name"), _agent_ids())
def test_mounts_are_exactly_what_the_configured_kinds_read_and_write(overlay: str, name: str) -> None:
    """Each host path a kind reads is mounted read-only at hostRoot+path, from specRoot+path on the node,
    each path it writes read-write, and nothing else of the host is mounted under hostRoot."""
    ds = _daemonset(overlay, name)
    config, _ = _node_config(overlay, ds)
    host_root, spec_root = str(config.host_root), str(config.spec_root or config.host_root)
    volumes = _volumes(ds)
    under_root = {
        m["mountPath"]: m
        for m in _container(ds)["volumeMounts"]
        if m["mountPath"].startswith(host_root.rstrip("/") + "/") and "hostPath" in volumes[m["name"]]
    }
    needed = _needed_host_paths(config)
    used: set[str] = set()
    for path, writable in sorted(needed.items()):
        candidates = [
            p for p in under_root if path == p[len(host_root) :] or path.startswith(p[len(host_root) :] + "/")
        ]
        assert candidates, f"{name}: {path} is read by a {overlay} resource but not mounted under {host_root}"
        mount = under_root[max(candidates, key=len)]
        used.add(mount["mountPath"])
        relative = mount["mountPath"][len(host_root) :]
        # CDI specs are read by the node's container runtime, at the node's own path, whatever specRoot says.
        source = relative if path in _cdi_dirs(config) else posixpath.join(spec_root, relative.lstrip("/"))
        assert volumes[mount["name"]]["hostPath"]["path"] == source, (
            f"{name}: {mount['mountPath']} must come from the node's {source}, "
            + (
                "where the container runtime reads CDI specs"
                if source == relative
                else "the path the kubelet is told (specRoot)"
            )
        )
        assert bool(mount.get("readOnly")) is not writable, (
            f"{name}: {mount['mountPath']} must be {'read-write' if writable else 'read-only'}"
        )
    assert set(under_root) == used, (
        f"{name}: host mounts no configured kind needs: {sorted(set(under_root) - used)}"
    )


@pytest.mark.parametrize(("overlay", "name"), _agent_ids())
def test_kubelet_dir_config_runtime_dir_and_probes_agree(overlay: str, name: str) -> None:
    """kubeletDir is the kubelet's own directory, runtime dir and /tmp are writable, probes reach /metrics."""
    ds = _daemonset(overlay, name)
    config, raw = _node_config(overlay, ds)
    agent, volumes = _container(ds), _volumes(ds)
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    kubelet = mounts[str(config.kubelet_dir)]
    assert volumes[kubelet["name"]]["hostPath"]["path"] == KUBELET_DEVICE_PLUGINS
    assert not kubelet.get("readOnly")
    env = {e["name"]: e.get("value") for e in agent.get("env", [])}
    runtime_dir = raw.get("supervisor", {}).get("runtimeDir") or env["PLUGVISOR_RUNTIME_DIR"]
    for writable in (runtime_dir, "/tmp"):
        assert "emptyDir" in volumes[mounts[writable]["name"]], (
            f"{name}: {writable} must be a writable emptyDir"
        )
    assert config.metrics is not None
    assert config.metrics.host == "0.0.0.0", "the kubelet probes the pod's address, not its loopback"
    port = next(p for p in agent["ports"] if p["name"] == "metrics")
    assert port["containerPort"] == config.metrics.port
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}


@pytest.mark.parametrize(("overlay", "name"), _agent_ids())
def test_the_pod_resources_socket_the_agent_dials_is_the_kubelets_mounted_read_only(
    overlay: str, name: str
) -> None:
    """Monitoring (on unless turned off) labels devices with their owners from PodResources; the socket it
    dials, explicit or the default beside kubeletDir, lies in a read-only mount of the node's directory."""
    ds = _daemonset(overlay, name)
    config, _ = _node_config(overlay, ds)
    if not config.monitoring.enabled:
        pytest.skip(f"{name}: monitoring is off, nothing dials PodResources")
    socket = config.monitoring.pod_resources_socket or default_pod_resources_socket(config.kubelet_dir)
    agent, volumes = _container(ds), _volumes(ds)
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    directory = posixpath.dirname(str(socket))
    assert directory in mounts, f"{name}: {socket} is dialled but {directory} is not mounted"
    mount = mounts[directory]
    assert volumes[mount["name"]]["hostPath"]["path"] == KUBELET_POD_RESOURCES
    assert mount.get("readOnly") is True, f"{name}: {directory} needs no write access"


@pytest.mark.parametrize(("overlay", "name"), _agent_ids())
def test_the_agent_runs_with_least_privilege_as_a_node_critical_daemon(overlay: str, name: str) -> None:
    """No capability, read-only root, no escalation; system-node-critical, tolerant, never two per node.
    The one exception is the gpu agent off the lab: privileged, so that NVML can open NVIDIA's device nodes
    (components/nvml-privileged; test_nvml_* below)."""
    ds = _daemonset(overlay, name)
    pod = ds["spec"]["template"]["spec"]
    security = _container(ds)["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    if _nvml_opens_devices(overlay, ds):
        assert security["privileged"] is True
    else:
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["allowPrivilegeEscalation"] is False
        assert not security.get("privileged")
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod["tolerations"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
    config, _ = _node_config(overlay, ds)
    # A token only where a DRA driver talks to the API server (test_dra_drivers_* below say which).
    assert pod["automountServiceAccountToken"] is any(resource.dra for resource in config.resources)
    resources = _container(ds)["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert "memory" in resources["limits"]
    selector = dict(pod["nodeSelector"])
    selector.pop("kubernetes.io/os", None)
    if overlay not in ("generic", "generic-dra"):  # /dev/fuse is on every Linux node
        assert selector, (
            f"{name}: no node selector beyond the OS; the kind would run on nodes without its hardware"
        )
    assert all(v for v in pod["nodeSelector"].values())


def _nvml_opens_devices(overlay: str, ds: dict[str, Any]) -> bool:
    """Whether the agent serves gpu resources off the lab, whose NVML opens the host's device nodes."""
    return not overlay.startswith("lab") and ds["metadata"]["labels"]["plugvisor.io/kind"] == "gpu"


@pytest.mark.parametrize("overlay", ["gpu", "gpu-cdi", "gpu-dra"])
def test_nvml_can_open_nvidias_device_nodes_in_the_gpu_overlays(overlay: str) -> None:
    """libnvidia-ml opens /dev/nvidiactl and /dev/nvidia<N> by those paths: only a privileged container has
    the host's nodes in its /dev and a device cgroup that lets it open them. A privileged container may not
    say allowPrivilegeEscalation false (the API server refuses the pair), so the key is gone, and with it
    the capabilities a privileged container has anyway."""
    ((ds, config),) = agents_with_config(render(overlay))
    assert all(resource.kind == "gpu" for resource in config.resources)
    security = _container(ds)["securityContext"]
    assert security["privileged"] is True
    assert "allowPrivilegeEscalation" not in security and "capabilities" not in security
    kubernetes_validate.validate(ds, KUBERNETES_VERSION, strict=True)


def test_nvml_through_nvidias_runtime_keeps_the_gpu_agent_unprivileged(tmp_path: Path) -> None:
    """components/nvml-runtime-class over overlays/gpu: the `nvidia` runtime class, which puts the device
    nodes NVIDIA_VISIBLE_DEVICES=all names in the container, utility (NVML) only, and the container back to
    no privilege and no capability, as NVIDIA's own device plugin runs."""
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{posixpath.relpath(KUSTOMIZE / 'overlays/gpu', tmp_path)}]\n"
        f"components: [{posixpath.relpath(KUSTOMIZE / 'components/nvml-runtime-class', tmp_path)}]\n"
    )
    result = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, result.stderr
    (ds,) = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    security = pod["containers"][0]["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    kubernetes_validate.validate(ds, KUBERNETES_VERSION, strict=True)


def test_the_kubelet_root_dir_example_mounts_what_its_agents_use_from_that_root() -> None:
    """examples/kubelet-root-dir, overlays/gpu-dra on k0s as docs/deployment.md shows it: every kubelet
    directory its node.yaml leads the agent to is mounted where it looks, plugins_registry, plugins and
    pod-resources from /var/lib/k0s/kubelet, device-plugins from the kubelet's fixed directory; the objects
    are valid, and the agent differs from overlays/gpu-dra's in those paths only."""
    docs = render("kubelet-root-dir", where="examples")
    ((ds, config),) = agents_with_config(docs)
    check_kubelet_dirs(ds, config, root="/var/lib/k0s/kubelet", device_plugins=KUBELET_DEVICE_PLUGINS)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    ((plain, plain_config),) = agents_with_config(render("gpu-dra"))
    assert config.model_copy(update={"kubelet_dir": plain_config.kubelet_dir}) == plain_config

    def without_kubelet_paths(pod: dict[str, Any]) -> dict[str, Any]:
        """The pod without its kubelet directories, and its ConfigMap's content-hashed name."""
        pod = copy.deepcopy(pod)
        pod["volumes"] = [
            v for v in pod["volumes"] if "configMap" not in v and "kubelet" not in str(v.get("hostPath"))
        ]
        for container in pod["containers"]:
            container["volumeMounts"] = [
                m for m in container["volumeMounts"] if "kubelet" not in m["mountPath"]
            ]
        return pod

    assert without_kubelet_paths(ds["spec"]["template"]["spec"]) == without_kubelet_paths(
        plain["spec"]["template"]["spec"]
    )


# -- DRA drivers ---------------------------------------------------------------------------------------------

DRA_OVERLAYS = [overlay for overlay in OVERLAYS if overlay.endswith("-dra")]
EXAMPLES = sorted((REPO / "deploy/kubernetes/examples/dra").glob("*.yaml"))


def _dra_drivers(overlay: str) -> list[str]:
    return [
        resource.name
        for ds in _agents(overlay)
        for resource in _node_config(overlay, ds)[0].resources
        if resource.dra
    ]


@pytest.mark.parametrize("overlay", DRA_OVERLAYS)
def test_dra_drivers_have_their_sockets_token_and_node_name(overlay: str) -> None:
    """Each DRA overlay runs DRA drivers; their agent mounts the kubelet's plugins_registry and plugins
    directories read-write from the kubelet root that kubeletDir lies in, runs as the plugvisor-dra
    ServiceAccount with its token, and knows its node from the downward API."""
    assert _dra_drivers(overlay), f"overlays/{overlay} configures no resource with mode: dra"
    for ds in _agents(overlay):
        config, _ = _node_config(overlay, ds)
        pod, agent, volumes = ds["spec"]["template"]["spec"], _container(ds), _volumes(ds)
        mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
        for directory in (config.plugins_registry, config.dra_plugins_dir):
            path = str(directory)
            assert path in mounts and not mounts[path].get("readOnly"), f"{path} must be mounted read-write"
            assert volumes[mounts[path]["name"]]["hostPath"]["path"] == path
        assert pod["serviceAccountName"] == "plugvisor-dra"
        env = {e["name"]: e for e in agent["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


@pytest.mark.parametrize("overlay", DRA_OVERLAYS)
def test_dra_rbac_is_exactly_what_a_driver_calls(overlay: str) -> None:
    """Slices of its node (read, watch, write), claims (read), its Node (get); bound to the agent's account;
    writes restricted to the driver's own node by an admission policy bound to Deny."""
    (role,) = objects(overlay, "ClusterRole")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert rules == {
        (("resource.k8s.io",), ("resourceslices",)): {"get", "list", "watch", "create", "update", "delete"},
        (("resource.k8s.io",), ("resourceclaims",)): {"get", "list", "watch"},
        (("",), ("nodes",)): {"get"},
    }
    (binding,) = objects(overlay, "ClusterRoleBinding")
    (account,) = objects(overlay, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
    ]
    (policy,) = objects(overlay, "ValidatingAdmissionPolicy")
    (policy_binding,) = objects(overlay, "ValidatingAdmissionPolicyBinding")
    assert policy_binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    condition = policy["spec"]["matchConditions"][0]["expression"]
    assert f':{account["metadata"]["name"]}"' in condition, "the policy must apply to the drivers' account"


@pytest.mark.parametrize("overlay", DRA_OVERLAYS)
def test_every_dra_driver_has_a_device_class_selecting_its_devices(overlay: str) -> None:
    classes = {c["metadata"]["name"]: c for c in objects(overlay, "DeviceClass")}
    for driver in _dra_drivers(overlay):
        assert driver in classes, f"overlays/{overlay}: no DeviceClass {driver}"
        (selector,) = classes[driver]["spec"]["selectors"]
        assert selector["cel"]["expression"] == f'device.driver == "{driver}"'


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_every_dra_example_is_valid_and_claims_from_a_class_an_overlay_installs(example: Path) -> None:
    classes = {c["metadata"]["name"] for overlay in DRA_OVERLAYS for c in objects(overlay, "DeviceClass")}
    docs = [doc for doc in yaml.safe_load_all(example.read_text()) if doc]
    templates = [doc for doc in docs if doc["kind"] == "ResourceClaimTemplate"]
    assert templates
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    for template in templates:
        for request in template["spec"]["spec"]["devices"]["requests"]:
            assert request["exactly"]["deviceClassName"] in classes


def test_the_gpu_pair_example_constrains_both_gpus_to_one_pcie_root() -> None:
    docs = yaml.safe_load_all(
        (REPO / "deploy/kubernetes/examples/dra/gpu-pair-same-pcie-root.yaml").read_text()
    )
    template = next(doc for doc in docs if doc["kind"] == "ResourceClaimTemplate")
    devices = template["spec"]["spec"]["devices"]
    assert devices["requests"][0]["exactly"]["count"] == 2
    assert devices["constraints"] == [
        {"requests": ["gpus"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}
    ]


_CEL_REFERENCE = re.compile(
    r'device\.(?P<map>attributes|capacity)\["(?P<domain>[^"]+)"\]\.(?P<name>\w+)'
    r'(?:\s*(?P<op>==|!=)\s*(?P<literal>"[^"]*"|true|false|-?\d+))?'
)
_LITERAL_TYPES = {"true": bool, "false": bool}


@functools.cache
def _published_by_driver() -> dict[str, list[PublishedDevice]]:
    """What every DRA overlay's drivers publish on a dgx-like lab (GPUs, ConnectX and E810 VFs, FPGAs)."""
    root = Path(tempfile.mkdtemp(prefix="pv-dra-lab-"))
    try:
        Lab.create(str(root / "lab"), "dgx-like")
        published: dict[str, list[PublishedDevice]] = {}
        for overlay in DRA_OVERLAYS:
            for ds in _agents(overlay):
                for resource in _node_config(overlay, ds)[0].resources:
                    if resource.dra:
                        kind = kinds.get_kind(resource.kind)
                        devices = dra_devices(kind, resource.options, root / "lab", driver=resource.name)
                        published[resource.name] = list(devices.values())
        return published
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _selections() -> Iterator[tuple[str, str, str]]:
    """(where, driver, CEL expression or matchAttribute name) of every DeviceClass and example claim."""
    for overlay in DRA_OVERLAYS:
        for device_class in objects(overlay, "DeviceClass"):
            for selector in device_class["spec"].get("selectors", []):
                yield (
                    f"DeviceClass {device_class['metadata']['name']}",
                    device_class["metadata"]["name"],
                    (selector["cel"]["expression"]),
                )
    for example in EXAMPLES:
        for doc in yaml.safe_load_all(example.read_text()):
            if not doc or doc["kind"] != "ResourceClaimTemplate":
                continue
            devices = doc["spec"]["spec"]["devices"]
            drivers = {r["name"]: r["exactly"]["deviceClassName"] for r in devices["requests"]}
            for request in devices["requests"]:
                for selector in request["exactly"].get("selectors", []):
                    yield example.name, drivers[request["name"]], selector["cel"]["expression"]
            for constraint in devices.get("constraints", []):
                for request in constraint.get("requests") or list(drivers):
                    domain, _, name = constraint["matchAttribute"].rpartition("/")
                    yield example.name, drivers[request], f'device.attributes["{domain}"].{name}'


def test_every_attribute_a_class_or_example_selects_on_is_one_its_driver_publishes() -> None:
    """A CEL selector or matchAttribute on a name no device has matches nothing, silently: every one names
    an attribute (of the right type where it is compared) that the driver's kind publishes on a lab, and
    a flag it asks for (`rdma == true`) is one some device has."""
    published = _published_by_driver()
    checked = 0
    for where, driver, expression in _selections():
        devices = published[driver]
        for ref in _CEL_REFERENCE.finditer(expression):
            key = ref["name"] if ref["domain"] == driver else f"{ref['domain']}/{ref['name']}"
            values = [getattr(device, ref["map"]).get(key) for device in devices]
            found = [value for value in values if value is not None]
            assert found, f"{where}: no device of {driver} has {ref['map']} {key!r} ({expression})"
            if ref["literal"] is not None:
                literal = ref["literal"]
                wanted = str if literal.startswith('"') else _LITERAL_TYPES.get(literal, int)
                assert all(type(value) is wanted for value in found), (
                    f"{where}: {key} of {driver} is {type(found[0]).__name__}, compared with {literal}"
                )
                if wanted is bool and ref["op"] == "==":  # strings are the user's to fill in (a PF name)
                    assert (literal == "true") in found, f"{where}: no device of {driver} has {key} {literal}"
            checked += 1
    assert checked >= 3  # the VF example's pfName and rdma, the GPU pair's pcieRoot


# -- the lab overlays and kind-config.yaml --------------------------------------------------------------

LAB_OVERLAYS = ("lab", "lab-dra")
"""The lab's kinds as device plugins, and as DRA drivers."""


def _workers() -> list[dict[str, Any]]:
    return [n for n in kind_config()["nodes"] if n["role"] == "worker"]


def _schedules(ds: dict[str, Any], labels: dict[str, str]) -> bool:
    node_labels = {"kubernetes.io/os": "linux", **labels}
    return all(node_labels.get(k) == v for k, v in ds["spec"]["template"]["spec"]["nodeSelector"].items())


def test_kind_config_is_a_control_plane_and_two_lab_workers() -> None:
    """Two workers with different emulated hardware, each with its lab profile where the lab pod reads it."""
    config = kind_config()
    assert [n["role"] for n in config["nodes"]] == ["control-plane", "worker", "worker"]
    lab = _daemonset("lab", "plugvisor-lab")
    init = lab["spec"]["template"]["spec"]["initContainers"][0]
    profile_mount = next(m for m in init["volumeMounts"] if m["name"] == "profile")
    profile_on_node = _volumes(lab)["profile"]["hostPath"]["path"]
    profiles = set()
    for worker in _workers():
        assert _schedules(lab, worker["labels"]), "the lab DaemonSet must run on every lab worker"
        (mount,) = [m for m in worker["extraMounts"] if m["containerPath"] == profile_on_node]
        assert (REPO / mount["hostPath"]).is_file(), (
            f"kind-config.yaml mounts {mount['hostPath']}, which is missing"
        )
        profiles.add(mount["hostPath"])
    assert len(profiles) == 2
    assert not _schedules(lab, {}), "the control plane has no lab"
    command = " ".join(init["command"])
    lab_mount = next(m for m in init["volumeMounts"] if m["name"] == "lab")["mountPath"]
    assert f"plugvisor lab create {lab_mount} --profile {profile_mount['mountPath']} --mknod" in command
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["MKNOD"]}


@pytest.mark.parametrize("overlay", LAB_OVERLAYS)
def test_every_lab_agent_reads_the_lab_the_lab_pod_writes(overlay: str) -> None:
    """The agents' specRoot is the node directory the lab is created in, so the runtime finds the nodes;
    both lab overlays run the same lab."""
    lab = _daemonset(overlay, "plugvisor-lab")
    assert lab == _daemonset("lab", "plugvisor-lab")
    lab_dir = _volumes(lab)["lab"]["hostPath"]["path"]
    for ds in _agents(overlay):
        config, _ = _node_config(overlay, ds)
        assert str(config.spec_root) == lab_dir, ds["metadata"]["name"]


@pytest.fixture(scope="module")
def worker_labs() -> Iterator[dict[str, str]]:
    """The lab of each kind worker, written (plainly) from the profile kind-config.yaml gives it."""
    base = tempfile.mkdtemp(prefix="/tmp/pvdeploy-")
    roots: dict[str, str] = {}
    try:
        for worker in _workers():
            profile = next(
                m["hostPath"] for m in worker["extraMounts"] if "lab-profile" in m["containerPath"]
            )
            root = f"{base}/{worker['labels']['plugvisor.io/lab-profile']}"
            Lab.create(root, str(REPO / profile))
            roots[worker["labels"]["plugvisor.io/lab-profile"]] = root
        yield roots
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _devices(config: NodeConfig, root: str) -> dict[str, int]:
    found = {}
    for resource in config.resources:
        kind = kinds.get_kind(resource.kind)
        options = kind.options_model.model_validate(resource.options)
        source = kind.build(options, HostPaths(root=Path(root)), resource=resource.name)
        found[resource.name] = len(source.scan().devices)
    return found


@pytest.mark.parametrize("overlay", LAB_OVERLAYS)
def test_each_kind_runs_exactly_on_the_workers_whose_lab_has_its_hardware(
    worker_labs: dict[str, str], overlay: str
) -> None:
    """Scheduled by the worker's labels => its resources find devices in that worker's lab; not scheduled
    => they would find none. Every kind runs somewhere."""
    for ds in _agents(overlay):
        name = ds["metadata"]["name"]
        config, _ = _node_config(overlay, ds)
        placed = []
        for worker in _workers():
            profile = worker["labels"]["plugvisor.io/lab-profile"]
            found = _devices(config, worker_labs[profile])
            if _schedules(ds, worker["labels"]):
                placed.append(profile)
                assert all(found.values()), f"{name} runs on the {profile} worker, whose lab gives it {found}"
            else:
                assert not any(found.values()), f"{name} skips the {profile} worker, whose lab has {found}"
        assert placed, f"{name} runs on no worker of kind-config.yaml"


def _mount_source(ds: dict[str, Any], path: str) -> str | None:
    """The node path behind ``path`` in the agent's container (the deepest hostPath mount holding it)."""
    volumes = _volumes(ds)
    holding = [
        m
        for m in _container(ds)["volumeMounts"]
        if (path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"))
        and "hostPath" in volumes[m["name"]]
    ]
    if not holding:
        return None
    mount = max(holding, key=lambda m: len(m["mountPath"]))
    source: str = volumes[mount["name"]]["hostPath"]["path"]
    rest = path[len(mount["mountPath"]) :].lstrip("/")
    return posixpath.join(source, rest) if rest else source


def _where_the_standin_finds_its_state(
    ds: dict[str, Any], library: str, lab_root: str, lab_on_disk: str
) -> tuple[str, str] | None:
    """The stand-in's own search, in the agent's container: up from its directory to the first one holding
    .plugvisor-lab/nvml/system; that directory and the file's node path, with ``lab_on_disk`` standing for
    the node's ``lab_root``."""
    directory = library
    while directory != "/":
        directory = posixpath.dirname(directory)
        node = _mount_source(ds, posixpath.join(directory, LAB_NVML_STATE.lstrip("/"), "system"))
        on_disk = lab_on_disk + node[len(lab_root) :] if node and node.startswith(f"{lab_root}/") else None
        if node and on_disk and os.path.isfile(on_disk):
            return directory, node
    return None


@pytest.mark.parametrize("overlay", LAB_OVERLAYS)
def test_the_lab_gpu_agents_nvml_finds_the_labs_state_on_the_kind_workers(
    worker_labs: dict[str, str], overlay: str
) -> None:
    """On each worker it runs on, the gpu agent reads the lab's libnvidia-ml at the driver root the worker's
    lab wrote it to, and the stand-in, walking up from its own path in the container, meets the lab's NVML
    state (mounted read-only from the node's lab) at the lab root's place: the shipped overlay gives NVML's
    attributes, health and telemetry in the lab. Without the state's mount NVML says the driver is not
    loaded (docs/lab.md)."""
    checked = []
    for ds in _agents(overlay):
        if ds["metadata"]["labels"]["plugvisor.io/kind"] != "gpu":
            continue
        config, _ = _node_config(overlay, ds)
        host_root, lab_root = str(config.host_root), str(config.spec_root)
        for worker in _workers():
            if not _schedules(ds, worker["labels"]):
                continue
            state = Lab.open(worker_labs[worker["labels"]["plugvisor.io/lab-profile"]]).state()
            assert lab_nvml.nvidia_gpus(state), f"{worker['labels']}: no NVIDIA GPU for NVML to answer for"
            for resource in config.resources:
                assert resource.options.get("driverRoot", "/") == state.profile.driver_root, (
                    f"{ds['metadata']['name']}: driverRoot is not where the worker's lab puts its driver"
                )
                library = posixpath.join(host_root, lab_nvml.lib_dir(state), "libnvidia-ml.so.1")
                assert _mount_source(ds, library) == posixpath.join(
                    lab_root, lab_nvml.lib_dir(state), "libnvidia-ml.so.1"
                ), f"{ds['metadata']['name']}: {library} is not the lab's library"
                lab_on_disk = worker_labs[worker["labels"]["plugvisor.io/lab-profile"]]
                found = _where_the_standin_finds_its_state(ds, library, lab_root, lab_on_disk)
                assert found == (host_root, f"{lab_root}{LAB_NVML_STATE}/system"), (
                    f"{ds['metadata']['name']}: the lab's NVML state is not at {host_root}{LAB_NVML_STATE} "
                    f"(the stand-in would find {found}): NVML in the agent would say the driver is not loaded"
                )
                checked.append(ds["metadata"]["name"])
    assert checked, f"overlays/{overlay} runs no gpu agent on a kind worker"


@pytest.mark.parametrize("overlay", LAB_OVERLAYS)
def test_lab_agents_differ_from_the_kind_overlays_only_in_where_the_host_is(overlay: str) -> None:
    """The lab reuses each kind overlay (lab-dra each kind's DRA overlay): same resources and kind options,
    only specRoot differs, and the NVML quiet period before a GPU is healthy again (the lab heals an XID in
    seconds; a real GPU needs a reset)."""

    def comparable(raw: dict[str, Any]) -> dict[str, Any]:
        resources = [{k: v for k, v in r.items() if k != "nvml"} for r in raw.get("resources", [])]
        return {**{k: v for k, v in raw.items() if k != "specRoot"}, "resources": resources}

    for ds in _agents(overlay):
        labels = ds["metadata"]["labels"]
        kind = labels["plugvisor.io/kind"] + ("-dra" if labels.get("plugvisor.io/mode") == "dra" else "")
        _, lab_raw = _node_config(overlay, ds)
        _, real_raw = _node_config(kind, _daemonset(kind, ds["metadata"]["name"]))
        assert comparable(lab_raw) == comparable(real_raw)
        for lab_resource, real_resource in zip(lab_raw["resources"], real_raw["resources"], strict=True):
            if "nvml" in lab_resource:
                assert lab_resource["nvml"] == {"recoverAfterSeconds": 3}, lab_resource
                assert "nvml" not in real_resource


# -- the image every pod runs ------------------------------------------------------------------------


def _plugvisor_commands(container: dict[str, Any]) -> set[tuple[str, ...]]:
    """The plugvisor subcommands a container runs: from its shell command, or its args (the entry point)."""
    if "command" not in container:
        words = [container.get("args", [])]
    else:
        text = " ".join([*container["command"], *container.get("args", [])])
        words = [match.split()[1:] for match in re.findall(r"\bplugvisor(?: [\w-]+)+", text)]
    return {tuple(w for w in argv[:2] if not w.startswith(("-", "/"))) for argv in words}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_a_pod_runs_is_in_the_release_image_which_has_no_extra(
    overlay: str, tmp_path: Path
) -> None:
    """Every pod runs the release image (the Dockerfile's default target, no extra): the agents and the lab
    overlay's `plugvisor lab` alike, so the e2e suite tests the image a node gets."""
    commands: set[tuple[str, ...]] = set()
    images = set()
    for ds in objects(overlay, "DaemonSet"):
        pod = ds["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            images.add(container["image"])
            commands |= _plugvisor_commands(container)
    assert len(images) == 1, f"overlays/{overlay} runs several images: {images}"
    assert commands
    for command in sorted(commands):
        result = plugvisor_without_the_extra(tmp_path, *command, "--help")
        ran = " ".join(command)
        assert result.returncode == 0, f"overlays/{overlay} runs plugvisor {ran}: {result.stderr}"
