"""The generic plugin in a real kind cluster: advertised, allocated to a pod, back after a kubelet restart.

Needs docker (with an engine), kind and kubectl; run with `tox -e e2e`. The
cluster is created from kind-config.yaml and deleted afterwards unless
PLUGVISOR_E2E_KEEP is set.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import CLUSTER

REPO = Path(__file__).resolve().parent.parent
RESOURCE = "plugvisor.io/fuse"
pytestmark = pytest.mark.e2e


def sh(*args: str, check: bool = True, timeout: float = 600) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


def kubectl(*args: str, check: bool = True) -> str:
    return sh("kubectl", "--context", f"kind-{CLUSTER}", *args, check=check)


def node_resource(kind: str) -> str | None:
    node = json.loads(kubectl("get", "nodes", "-l", "plugvisor.io/lab-profile=gpu-node", "-o", "json"))[
        "items"
    ][0]
    return node["status"].get(kind, {}).get(RESOURCE)


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s")


@pytest.fixture(scope="module")
def cluster():
    existing = sh("kind", "get", "clusters").split()
    if CLUSTER not in existing:
        sh("kind", "create", "cluster", "--config", str(REPO / "kind-config.yaml"), "--wait", "120s")
    sh("docker", "build", "-t", "plugvisor:e2e", str(REPO))
    sh("kind", "load", "docker-image", "plugvisor:e2e", "--name", CLUSTER)
    kubectl("apply", "-k", str(REPO / "deploy/kubernetes/overlays/lab"))
    try:
        yield
    finally:
        if not os.environ.get("PLUGVISOR_E2E_KEEP"):
            sh("kind", "delete", "cluster", "--name", CLUSTER, check=False)


def test_the_node_advertises_the_resource(cluster):
    wait_until(lambda: node_resource("allocatable") == "10", 180, f"node allocatable {RESOURCE}=10")
    assert node_resource("capacity") == "10"


def test_a_pod_gets_the_device_node(cluster):
    wait_until(lambda: node_resource("allocatable") == "10", 180, f"node allocatable {RESOURCE}=10")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "uses-fuse"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "check",
                    "image": "plugvisor:e2e",
                    "imagePullPolicy": "IfNotPresent",
                    "command": [
                        "python",
                        "-c",
                        "import os, stat; assert stat.S_ISCHR(os.stat('/dev/fuse').st_mode)",
                    ],
                    "resources": {"limits": {RESOURCE: "1"}},
                }
            ],
        },
    }
    subprocess.run(
        ["kubectl", "--context", f"kind-{CLUSTER}", "apply", "-f", "-"],
        input=json.dumps(pod),
        text=True,
        check=True,
    )
    wait_until(
        lambda: (
            kubectl("get", "pod", "uses-fuse", "-o", "jsonpath={.status.phase}") in ("Succeeded", "Failed")
        ),
        180,
        "pod uses-fuse finished",
    )
    assert kubectl("get", "pod", "uses-fuse", "-o", "jsonpath={.status.phase}") == "Succeeded"
    kubectl("delete", "pod", "uses-fuse", "--wait=false")


def test_the_resource_comes_back_after_a_kubelet_restart(cluster):
    wait_until(lambda: node_resource("allocatable") == "10", 180, f"node allocatable {RESOURCE}=10")
    sh("docker", "exec", f"{CLUSTER}-worker", "systemctl", "restart", "kubelet")
    time.sleep(2)
    wait_until(
        lambda: node_resource("allocatable") == "10", 90, f"{RESOURCE} allocatable again after the restart"
    )
