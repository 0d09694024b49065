"""The DRA driver's side of the Kubernetes API server: configuration, ResourceSlices, ResourceClaims.

Everything here runs in a DRA driver process, never in the agent: it needs the
``dra`` extra (lightkube, chosen by ``bench/bench_kubeclient.py``; pyproject.toml
says why). :mod:`.config` finds the API server and the node the way client-go
programs do, :mod:`.slices` keeps this node's ResourceSlices equal to the
driver's devices, :mod:`.claims` reads what the scheduler allocated to a claim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import httpx2

from plugvisor.common.names import node_name_problem
from plugvisor.dra.cluster import PublishState
from plugvisor.dra.kube.claims import ClaimReader
from plugvisor.dra.kube.config import KubeConfigError, api_client, load_api_config
from plugvisor.dra.kube.slices import SlicePublisher

__all__ = ["KubeConfigError", "PublishState", "connect"]


async def connect(
    *,
    driver: str,
    node_name: str,
    on_state: Callable[[PublishState], None] | None = None,
    env: Mapping[str, str] | None = None,
    transport: httpx2.AsyncBaseTransport | None = None,
    kubelet_socket: Path | None = None,
) -> tuple[ClaimReader, SlicePublisher]:
    """A driver's claim reader and slice publisher, over one client configured as :mod:`.config` says.

    Raises :class:`~plugvisor.dra.kube.config.KubeConfigError` (naming what was
    tried) when there is no configuration or ``node_name`` cannot be a Node's
    name. Nothing is sent yet: an API server that is down only delays the
    first publication (:class:`~plugvisor.dra.kube.slices.SlicePublisher`).
    Closing (or withdrawing) the publisher closes the client. ``kubelet_socket``
    (the kubelet's ``kubelet.sock``) lets the publisher tell a kubelet restart.
    """
    problem = node_name_problem(node_name)
    if problem is not None:
        raise KubeConfigError(f"the node's name: {problem}")
    config = load_api_config(env=env)
    client = api_client(config, transport=transport)
    publisher = SlicePublisher(
        client,
        driver=driver,
        node=node_name,
        on_state=on_state,
        close_client=True,
        kubelet_socket=kubelet_socket,
    )
    return ClaimReader(client), publisher
