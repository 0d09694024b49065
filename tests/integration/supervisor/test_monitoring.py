"""Monitoring through the whole agent: owners from PodResources, lab faults in the telemetry, status."""

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request

import yaml

from plugvisor.emulators import lab

from .conftest import registered_all

GPU = "plugvisor.io/gpu"
STATUS = "from plugvisor.supervisor.cli import status_command; status_command()"


def write_config(node, lab_root):
    document = {
        "kubeletDir": str(node.kubelet_dir),
        "hostRoot": str(lab_root),
        "supervisor": {"runtimeDir": str(node.runtime_dir), "stopTimeout": 3},
        "metrics": {"listen": "127.0.0.1:0"},
        "monitoring": {"podResourcesInterval": 0.3, "telemetryInterval": 0.3},
        "resources": [{"name": GPU, "kind": "gpu"}],
    }
    node.config_path.write_text(yaml.safe_dump(document))


def scrape(agent):
    port = int(agent.log().split("url='http://127.0.0.1:")[1].split("/")[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def series(text, name):
    """{labels dict as a frozenset of items: value} for every sample of ``name``."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            pairs = frozenset(re.findall(r'(\w+)="([^"]*)"', labels))
            found[pairs] = float(value)
    return found


async def until(agent, predicate, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        text = await asyncio.to_thread(scrape, agent)
        if predicate(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not show in /metrics within {timeout}s:\n{text[-3000:]}")
        await asyncio.sleep(0.1)


def held_by(text):
    return {
        (dict(labels)["device"], dict(labels)["namespace"], dict(labels)["pod"], dict(labels)["container"])
        for labels, value in series(text, "plugvisor_device_allocated").items()
        if value == 1.0
    }


def status(node, *args):
    return subprocess.run(
        [sys.executable, "-c", STATUS, "--runtime-dir", str(node.runtime_dir), *args],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


async def test_owners_appear_while_the_pod_runs_and_vanish_when_it_ends(node, kubelet, agents, tmp_path):
    """A pod's GPUs carry its pod/namespace/container labels; once it ends no series names it."""
    node_lab = lab.Lab.create(str(tmp_path / "lab"), "amd-like")
    write_config(node, node_lab.root)
    agent = await agents()
    await kubelet.wait_for(registered_all({GPU: 8}), timeout=20)
    text = await until(
        agent,
        lambda t: "plugvisor_pod_resources_up 1.0" in t and len(series(t, "plugvisor_device_healthy")) == 8,
        "a PodResources poll and the eight GPUs",
    )
    assert held_by(text) == set()
    pod = await kubelet.add_pod(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "trainer", "namespace": "ml"},
            "spec": {"containers": [{"name": "train", "image": "x", "resources": {"limits": {GPU: "2"}}}]},
        }
    )
    devices = pod.container("train").devices[GPU]
    text = await until(agent, lambda t: len(held_by(t)) == 2, "the pod's two GPUs")
    assert held_by(text) == {(d, "ml", "trainer", "train") for d in devices}
    temperatures = series(text, "plugvisor_device_temperature_celsius")
    assert {dict(k)["pod"] for k in temperatures if dict(k)["device"] in devices} == {"trainer"}

    shown = status(node)
    assert re.search(rf"{re.escape(devices[0])}\s+healthy\s+ml/trainer/train", shown), shown
    document = json.loads(status(node, "--json"))
    (child,) = document["children"]
    holders = {d["id"]: d["holders"] for d in child["devices_detail"]}
    assert holders[devices[0]] == [{"namespace": "ml", "pod": "trainer", "container": "train"}]
    assert document["pod_resources"]["pid"] in {c["pid"] for c in document["children"]}  # a child polls

    assert kubelet.delete_pod("trainer", "ml")
    text = await until(agent, lambda t: not held_by(t), "the pod's end")
    assert 'pod="trainer"' not in text
    assert len(series(text, "plugvisor_device_allocated")) == 8
    assert await agent.stop() == 0


async def test_lab_faults_show_in_the_telemetry(node, kubelet, agents, tmp_path):
    """overheat raises a GPU's hwmon temperatures past critical; link-degraded; aer-fatal -> cause."""
    node_lab = lab.Lab.create(str(tmp_path / "lab"), "amd-like")
    write_config(node, node_lab.root)
    agent = await agents()
    await kubelet.wait_for(registered_all({GPU: 8}), timeout=20)
    hot = node_lab.device("gpu1")
    slow = node_lab.device("gpu2")
    sick = node_lab.device("gpu3")
    node_lab.fault(hot.name, "overheat")
    node_lab.fault(slow.name, "link-degraded")
    node_lab.fault(sick.name, "aer-fatal")

    def key(labels):
        d = dict(labels)
        return d["device"], d.get("sensor") or d.get("link") or d.get("cause") or d.get("severity")

    def shows_all(text):
        temperature = {key(k): v for k, v in series(text, "plugvisor_device_temperature_celsius").items()}
        critical = {
            key(k): v for k, v in series(text, "plugvisor_device_temperature_critical_celsius").items()
        }
        degraded = {
            dict(k)["device"]: v for k, v in series(text, "plugvisor_device_pcie_link_degraded").items()
        }
        healthy = {key(k): v for k, v in series(text, "plugvisor_device_healthy").items()}
        return (
            temperature.get((hot.bdf, "junction"), 0) > critical.get((hot.bdf, "junction"), 1000)
            and degraded.get(slow.bdf) == 1.0
            and healthy.get((sick.bdf, "aer-fatal")) == 0.0
        )

    text = await until(agent, shows_all, "the three faults")
    widths = {key(k): v for k, v in series(text, "plugvisor_device_pcie_link_width_lanes").items()}
    assert widths[(slow.bdf, "current")] < widths[(slow.bdf, "max")]
    aer = {key(k): v for k, v in series(text, "plugvisor_device_aer_errors_total").items()}
    assert aer[(sick.bdf, "fatal")] == 1.0
    assert series(text, "plugvisor_device_pcie_link_degraded")  # the healthy GPUs report 0, not nothing
    cool = {key(k): v for k, v in series(text, "plugvisor_device_temperature_celsius").items()}
    assert cool[(node_lab.device("gpu0").bdf, "junction")] < 100

    node_lab.heal(hot.name)
    await until(
        agent,
        lambda t: (
            {key(k): v for k, v in series(t, "plugvisor_device_temperature_celsius").items()}[
                (hot.bdf, "junction")
            ]
            < 100
        ),
        "the cool-down",
    )
    assert await agent.stop() == 0
