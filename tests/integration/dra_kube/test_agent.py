"""The agent's ``mode: dra`` child against a real kube-apiserver and the emulated kubelet.

The scenario is tests/integration/supervisor/dra_agent.py's (the file world runs it without an API
server): here the driver finds the API server through ``KUBECONFIG`` (a token the deployment's
ClusterRole is bound to), publishes real ResourceSlices, and reads the claim the test allocated as
a scheduler would (``status.allocation``, written with the administrator's token).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Namespace
from lightkube.resources.resource_v1 import ResourceClaim, ResourceClaimStatus

from plugvisor.emulators.kubelet.dra import resource_claim

from ..supervisor.conftest import Agent, Node, wait_gone
from ..supervisor.dra_agent import DRIVER, World, make_lab, play
from .conftest import DRIVER_TOKEN, ApiServer, pool


@pytest.fixture
async def namespace(admin: AsyncClient) -> AsyncIterator[str]:
    name = f"team-{uuid.uuid4().hex[:6]}"
    await admin.create(
        Namespace.from_dict({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    )
    yield name
    await admin.delete(Namespace, name)


def api_world(apiserver: ApiServer, admin: AsyncClient, node: str, namespace: str, kubeconfig: Path) -> World:
    async def slice_devices() -> list[str]:
        return [
            device["name"]
            for item in await pool(admin, node)
            if item["spec"]["driver"] == DRIVER
            for device in item["spec"].get("devices") or []
        ]

    async def allocate(name: str, devices: list[str]) -> dict[str, Any]:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": name,
                            "exactly": {
                                "deviceClassName": DRIVER,
                                "allocationMode": "ExactCount",
                                "count": len(devices),
                            },
                        }
                    ]
                }
            },
        }
        created = await admin.create(ResourceClaim.from_dict(body))
        uid = str(created.metadata.uid)  # type: ignore[union-attr]
        claim = resource_claim(namespace, name, uid, [(name, DRIVER, node, d) for d in devices])
        allocated = {**created.to_dict(), "status": claim["status"]}
        await admin.replace(ResourceClaimStatus.from_dict(allocated), name, namespace=namespace)
        return claim

    env = {"KUBECONFIG": str(apiserver.kubeconfig(DRIVER_TOKEN, kubeconfig))}
    return World(node, env, slice_devices, allocate)


@pytest.mark.usefixtures("driver_role")
async def test_an_agents_dra_driver_publishes_to_a_real_api_server_and_prepares_its_claims(
    apiserver: ApiServer, admin: AsyncClient, node: str, namespace: str, tmp_path: Path
) -> None:
    world = api_world(apiserver, admin, node, namespace, tmp_path / "kubeconfig")
    base = Path(tempfile.mkdtemp(prefix="/tmp/pvk-"))  # unix sockets need a short path
    emulated = Node(base)
    started: list[Agent] = []

    async def start_agent(env: dict[str, str]) -> Agent:
        agent = Agent(emulated, env)
        started.append(agent)
        return await agent.start()

    try:
        await play(emulated, make_lab(tmp_path / "lab"), world, start_agent)
    finally:
        for agent in started:
            if agent.proc is not None and agent.proc.returncode is None:
                agent.proc.kill()
                await agent.proc.wait()
        assert not await wait_gone(emulated, timeout=5)
        shutil.rmtree(base, ignore_errors=True)
