"""An in-memory API server for ResourceSlices, Nodes and ResourceClaims, behind lightkube's transport seam.

It does what the real one does for the calls the driver makes (generateName,
resourceVersion conflicts, field selectors, dry-run, watch streams, Status
errors with causes), and what a test asks for on top: being down, failing
with a status code, refusing a device, dropping taints as a cluster without
DRADeviceTaints does. tests/integration/dra_kube runs the same publisher
against a real kube-apiserver.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import random
import string
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import parse_qs

import httpx2

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def status(code: int, message: str, causes: list[dict[str, str]] | None = None) -> httpx2.Response:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "message": message,
    }
    if causes:
        body["details"] = {"causes": causes}
    return httpx2.Response(code, json=body)


class FakeApi:
    """The state and the knobs; ``transport`` is what the client is given."""

    def __init__(self, *, node: str = "node-a") -> None:
        self.nodes: dict[str, str] = {node: "6d1f7c1e-0000-4000-8000-000000000001"}
        self.slices: dict[str, dict[str, Any]] = {}
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.taints_supported = True
        self.down = False
        self.fail: list[int] = []
        """Status codes to answer the next writes with, one each."""
        self.refuse: Callable[[dict[str, Any]], list[dict[str, str]] | None] = lambda body: None
        """Given a slice body, the causes to refuse it with (None: accept)."""
        self.requests: list[tuple[str, str]] = []
        self._rv = itertools.count(100)
        self._watchers: list[asyncio.Queue[dict[str, Any] | None]] = []
        self._random = random.Random(0)
        self.transport = httpx2.MockTransport(self._handle)

    # -- what tests look at ---------------------------------------------------------------------

    def pool(self, driver: str, node: str) -> list[dict[str, Any]]:
        """The driver's slices of ``node``, in name order (the scheduler's order)."""
        return sorted(
            (
                s
                for s in self.slices.values()
                if s["spec"]["driver"] == driver and s["spec"].get("nodeName") == node
            ),
            key=lambda s: s["metadata"]["name"],
        )

    def published(self, driver: str, node: str) -> list[str]:
        """Device names of the pool's newest generation, in order."""
        slices = self.pool(driver, node)
        if not slices:
            return []
        newest = max(s["spec"]["pool"]["generation"] for s in slices)
        return [
            d["name"]
            for s in slices
            if s["spec"]["pool"]["generation"] == newest
            for d in s["spec"]["devices"]
        ]

    def delete_all(self) -> None:
        """What the kubelet does at start: every slice of the node goes."""
        for name in list(self.slices):
            self._delete(name)

    # -- the server -------------------------------------------------------------------------------

    async def _handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append((request.method, request.url.path))
        if self.down:
            raise httpx2.ConnectError("connection refused", request=request)
        query = {key: values[-1] for key, values in parse_qs(request.url.query.decode()).items()}
        path = request.url.path
        if path.startswith("/api/v1/nodes/"):
            return self._node(path.rsplit("/", 1)[1])
        if path.startswith("/apis/resource.k8s.io/v1/namespaces/"):
            parts = path.split("/")
            claim = self.claims.get((parts[5], parts[7]))
            if claim is None:
                return status(404, f'resourceclaims.resource.k8s.io "{parts[7]}" not found')
            return httpx2.Response(200, json=claim)
        if path == SLICES or path.startswith(SLICES + "/"):
            return self._slices(request, query, path)
        return status(405, f"{request.method} {path} is not served by the fake")

    def _node(self, name: str) -> httpx2.Response:
        if name not in self.nodes:
            return status(404, f'nodes "{name}" not found')
        metadata = {"name": name, "uid": self.nodes[name]}
        return httpx2.Response(200, json={"apiVersion": "v1", "kind": "Node", "metadata": metadata})

    def _slices(  # noqa: PLR0911 - one answer per route, as a server mux reads
        self, request: httpx2.Request, query: dict[str, str], path: str
    ) -> httpx2.Response:
        name = path.removeprefix(SLICES).strip("/")
        if request.method == "GET" and not name:
            if query.get("watch") == "true":
                return self._watch(query)
            items = [s for s in self.slices.values() if self._selected(s, query.get("fieldSelector", ""))]
            metadata = {"resourceVersion": str(next(self._rv))}
            body = {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1", "metadata": metadata}
            return httpx2.Response(200, json={**body, "items": items})
        if request.method in ("POST", "PUT") and self.fail:
            return status(self.fail.pop(0), "injected failure")
        if request.method == "POST" and not name:
            return self._create(json.loads(request.content), dry_run=query.get("dryRun") == "All")
        if request.method == "PUT":
            return self._update(name, json.loads(request.content))
        if request.method == "DELETE":
            if name not in self.slices:
                return status(404, f'resourceslices.resource.k8s.io "{name}" not found')
            self._delete(name)
            return httpx2.Response(200, json={"kind": "Status", "status": "Success"})
        return status(405, f"{request.method} {path} is not served by the fake")

    @staticmethod
    def _selected(item: dict[str, Any], selector: str) -> bool:
        fields = {"spec.driver": item["spec"]["driver"], "spec.nodeName": item["spec"].get("nodeName", "")}
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if fields.get(key) != value:
                return False
        return True

    def _stored(self, body: dict[str, Any]) -> dict[str, Any]:
        item = copy.deepcopy(body)
        item["metadata"]["resourceVersion"] = str(next(self._rv))
        for device in item["spec"].get("devices") or []:
            if not self.taints_supported:
                device.pop("taints", None)
            for taint in device.get("taints") or []:
                taint.setdefault("timeAdded", "2026-01-01T00:00:00Z")
        return item

    def _create(self, body: dict[str, Any], *, dry_run: bool) -> httpx2.Response:
        causes = self.refuse(body)
        if causes:
            return status(422, "ResourceSlice is invalid", causes)
        item = self._stored(body)
        metadata = item["metadata"]
        suffix = "".join(self._random.choice(string.ascii_lowercase + string.digits) for _ in range(5))
        metadata["name"] = metadata.pop("generateName") + suffix
        metadata["uid"] = f"uid-{metadata['name']}"
        if not dry_run:
            self.slices[metadata["name"]] = item
            self._emit("ADDED", item)
        return httpx2.Response(201, json=item)

    def _update(self, name: str, body: dict[str, Any]) -> httpx2.Response:
        current = self.slices.get(name)
        if current is None:
            return status(404, f'resourceslices.resource.k8s.io "{name}" not found')
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return status(
                409, "the object has been modified; please apply your changes to the latest version"
            )
        causes = self.refuse(body)
        if causes:
            return status(422, "ResourceSlice is invalid", causes)
        item = self._stored(body)
        self.slices[name] = item
        self._emit("MODIFIED", item)
        return httpx2.Response(200, json=item)

    def _delete(self, name: str) -> None:
        item = self.slices.pop(name)
        item["metadata"]["resourceVersion"] = str(next(self._rv))  # a deletion is a new version too
        self._emit("DELETED", item)

    def _emit(self, kind: str, item: dict[str, Any]) -> None:
        for queue in self._watchers:
            queue.put_nowait({"type": kind, "object": item})

    def _watch(self, query: dict[str, str]) -> httpx2.Response:
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._watchers.append(queue)
        selector = query.get("fieldSelector", "")
        if "resourceVersion" not in query:
            for item in self.slices.values():
                queue.put_nowait({"type": "ADDED", "object": item})

        async def lines() -> AsyncIterator[bytes]:
            try:
                while True:
                    event = await queue.get()
                    if event is None:
                        return
                    if self._selected(event["object"], selector):
                        yield json.dumps(event).encode() + b"\n"
            finally:
                self._watchers.remove(queue)

        return httpx2.Response(200, content=lines(), headers={"Content-Type": "application/json"})
