"""Test helpers for people who write kinds: the same tools plugvisor's own tests use, as a public API.

A kind is tested at two levels (docs/writing-a-kind.md):

- its source alone, against a host tree in a temporary directory (or the
  emulated lab, :mod:`plugvisor.emulators.lab`): :func:`scan` builds the kind
  from raw options, as a configuration file gives them, and scans once;
- the whole plugin against the emulated kubelet
  (:class:`~plugvisor.emulators.kubelet.EmulatedKubelet`): :func:`running_plugin`
  runs it in process, registered and serving, for the duration of an ``async
  with`` block, and :func:`short_socket_dir` gives a directory whose socket
  paths fit the unix limit;
- the kind as a DRA driver, as far as that is honest without a scheduler and
  an API server (docs/dra.md): :func:`running_dra_driver` runs it registered
  with the emulated kubelet, whose ``objects_dir`` stands in for the API
  server; :meth:`DraDriver.prepare` prepares a claim for named devices (the
  test plays the scheduler) and returns the container edits its CDI devices
  resolve to, read back from the CDI directory as a container runtime would.

The last two run against the emulated kubelet, so this module comes with the ``emulators`` extra
(``pip install 'plugvisor[emulators]'``); without it, importing it says so (an ``ImportError``).

:func:`kind_loads_without_grpc` checks the one rule the agent imposes on a
kind's module: loading it (the agent does, to validate its configuration) must
not import gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plugvisor.common import constants
from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import PublishedDevice
from plugvisor.dra.hooks import DraDescriber, kind_resource
from plugvisor.dra.local import FileClaimReader, FileSlicePublisher
from plugvisor.dra.pool import build_pool
from plugvisor.dra.runtime import DraDriverRuntime, DriverConfig
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.emulators.kubelet import dra as kubelet_dra
from plugvisor.plugins.kinds import PluginKind, get_kind

__all__ = [
    "ContainerEdits",
    "DraDriver",
    "dra_devices",
    "kind_loads_without_grpc",
    "resolve_cdi_devices",
    "running_dra_driver",
    "running_plugin",
    "scan",
    "short_socket_dir",
]


def scan(
    kind: PluginKind[Any], options: Mapping[str, Any], root: Path, *, resource: str = "example.com/device"
) -> Snapshot[Any]:
    """Build ``kind`` from raw ``options`` for a host tree at ``root`` and scan it once."""
    source = kind.build(dict(options), HostPaths(root=root), resource=resource)
    return source.scan()


@contextlib.contextmanager
def short_socket_dir(prefix: str = "pvt-") -> Iterator[Path]:
    """A fresh directory under ``/tmp`` (unix socket paths allow 107 bytes), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def running_plugin(
    kubelet: EmulatedKubelet,
    kind: PluginKind[Any],
    options: Mapping[str, Any],
    *,
    resource: str,
    root: Path = Path("/"),
    rescan_interval: float = 30.0,
    timeout: float = 10.0,
) -> AsyncIterator[DevicePluginRuntime]:
    """Run ``kind`` in this process against ``kubelet`` until the block ends; yields the runtime.

    The block starts once the plugin is registered (or raises
    :class:`TimeoutError` after ``timeout`` seconds); at its end the plugin
    stops as it would on SIGTERM, and any error it failed with is raised.
    """
    paths = HostPaths(root=root, kubelet_dir=kubelet.socket_dir)
    source = kind.build(dict(options), paths, resource=resource)
    runtime = DevicePluginRuntime(PluginConfig(resource, paths, rescan_interval=rescan_interval), source)
    stop = asyncio.Event()
    task = asyncio.create_task(runtime.run(stop), name=f"plugin {resource}")
    try:
        registered = asyncio.ensure_future(runtime.registrations.wait_newer(0))
        done, _ = await asyncio.wait({registered, task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            registered.cancel()
            task.result()  # raises why the plugin stopped
            raise RuntimeError(f"the plugin for {resource} stopped before it registered")
        if registered not in done:
            registered.cancel()
            raise TimeoutError(f"the plugin for {resource} did not register within {timeout} s")
        yield runtime
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout)


_PROBE = """
import json, sys
from plugvisor.plugins.kinds import get_kind
kind = get_kind(sys.argv[1])
kind.options_model.model_validate(json.loads(sys.argv[2]))
print(json.dumps(sorted(m for m in sys.modules if m == "grpc" or m.startswith("grpc."))))
"""


def kind_loads_without_grpc(name: str, options: Mapping[str, Any] | None = None) -> list[str]:
    """Load the installed kind ``name`` and validate ``options`` in a fresh interpreter, as the agent does.

    Returns the gRPC modules that got imported (the rule: none). Raises
    :class:`RuntimeError` with the interpreter's error output when the kind
    cannot be loaded or the options are invalid.
    """
    get_kind(name)  # a clear error here if the kind is not installed at all
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, name, json.dumps(dict(options or {}))],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if result.returncode != 0:
        raise RuntimeError(f"loading kind {name!r} failed:\n{result.stderr}")
    loaded: list[str] = json.loads(result.stdout)
    return loaded


def dra_devices(
    kind: PluginKind[Any], options: Mapping[str, Any], root: Path, *, driver: str = "example.com"
) -> dict[str, PublishedDevice]:
    """Build ``kind`` for a host tree at ``root``, scan once, and return what its DRA driver would publish.

    By name in the pool, healthy or not: the kind's :class:`~plugvisor.dra.hooks.DraDescriber`
    answer, checked as the driver checks it, or the default one.
    """
    source = kind.build(
        dict(options), HostPaths(root=root), resource=kind_resource(driver, kind.name), log_as=driver
    )
    describer = source if isinstance(source, DraDescriber) else None
    return dict(build_pool(source.scan(), describer, driver=driver).devices)


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    """What a container runtime applies for a set of CDI devices: the union of their specs' edits."""

    device_nodes: tuple[tuple[str, str], ...]
    """(path in the container, path on the host), in order."""
    env: Mapping[str, str]
    mounts: tuple[tuple[str, str, tuple[str, ...]], ...]
    """(container path, host path, options)."""


def resolve_cdi_devices(cdi_dir: Path, names: Sequence[str]) -> ContainerEdits:
    """Resolve fully qualified CDI device IDs (``vendor/class=name``) against the specs in ``cdi_dir``.

    As a container runtime does: each ID's device edits plus its spec's own
    edits, in order; a later variable of the same name wins. Raises
    :class:`LookupError` naming an ID no spec in the directory defines.
    """
    specs = [json.loads(path.read_text()) for path in sorted(cdi_dir.glob("*.json"))]
    nodes: list[tuple[str, str]] = []
    env: dict[str, str] = {}
    mounts: list[tuple[str, str, tuple[str, ...]]] = []
    applied_specs: set[int] = set()
    for qualified in names:
        kind, _, device_name = qualified.partition("=")
        found = [
            (index, spec, device)
            for index, spec in enumerate(specs)
            if spec.get("kind") == kind
            for device in spec.get("devices", [])
            if device.get("name") == device_name
        ]
        if not found:
            raise LookupError(f"no CDI spec in {cdi_dir} defines {qualified}")
        index, spec, device = found[0]
        edits = [device.get("containerEdits", {})]
        if index not in applied_specs:
            applied_specs.add(index)
            edits.append(spec.get("containerEdits", {}))
        for edit in edits:
            nodes += [(n["path"], n.get("hostPath", n["path"])) for n in edit.get("deviceNodes", [])]
            env.update(entry.partition("=")[::2] for entry in edit.get("env", []))
            mounts += [
                (mount["containerPath"], mount["hostPath"], tuple(mount.get("options", [])))
                for mount in edit.get("mounts", [])
            ]
    return ContainerEdits(tuple(nodes), env, tuple(mounts))


class DraDriver:
    """A kind running as a DRA driver in this process, registered with an emulated kubelet."""

    def __init__(self, kubelet: EmulatedKubelet, runtime: DraDriverRuntime) -> None:
        self.kubelet = kubelet
        self.runtime = runtime
        self.driver = runtime.config.driver
        self.node_name = runtime.config.node_name
        self._claims = itertools.count(1)

    @property
    def devices(self) -> dict[str, PublishedDevice]:
        """The devices the driver publishes now, by name, as the slice lists them (healthy or tainted)."""
        return {device.name: device for device in self.runtime.pools.value.listed()}

    @property
    def cdi_dir(self) -> Path:
        """Where the driver writes its claims' CDI specs (inside the host root)."""
        return self.runtime.cdi_dir

    async def prepare(
        self, *devices: str, request: str = "devices", namespace: str = "default", name: str | None = None
    ) -> tuple[kubelet_dra.ClaimView, ContainerEdits]:
        """Allocate a claim of ``devices`` (by name) from this node's pool, and have the kubelet prepare it.

        Returns the kubelet's prepared claim and the container edits its CDI
        devices resolve to. Raises :class:`~plugvisor.emulators.kubelet.dra.DraCallError`
        with the kubelet's text when the driver refuses it.
        """
        manager = _dra_manager(self.kubelet)
        number = next(self._claims)
        claim_name = name or f"claim-{number}"
        claim = kubelet_dra.resource_claim(
            namespace,
            claim_name,
            f"{self.driver}-{claim_name}-{number}",
            [(request, self.driver, self.node_name, device) for device in devices],
        )
        view = await manager.prepare(claim)
        return view, resolve_cdi_devices(self.cdi_dir, view.cdi_devices())

    async def unprepare(self, claim: kubelet_dra.ClaimView) -> None:
        """Have the kubelet unprepare a claim :meth:`prepare` returned."""
        await _dra_manager(self.kubelet).unprepare(claim.namespace, claim.name)


def _dra_manager(kubelet: EmulatedKubelet) -> kubelet_dra.DraManager:
    if kubelet.dra is None or kubelet.dra.objects_dir is None:
        raise ValueError(
            "the emulated kubelet needs DRA (kubelet_version 1.34 or later) and an objects_dir standing in "
            "for the API server: EmulatedKubelet(..., objects_dir=...)"
        )
    return kubelet.dra


@contextlib.asynccontextmanager
async def running_dra_driver(
    kubelet: EmulatedKubelet,
    kind: PluginKind[Any],
    options: Mapping[str, Any],
    *,
    driver: str,
    root: Path = Path("/"),
    cdi_dir: str = constants.DEFAULT_CDI_DIR,
    rescan_interval: float = 30.0,
    timeout: float = 10.0,
) -> AsyncIterator[DraDriver]:
    """Run ``kind`` as the DRA driver ``driver`` in this process against ``kubelet`` until the block ends.

    The kubelet needs an ``objects_dir``: the driver reads its claims there and
    writes its slice there (:mod:`plugvisor.dra.local`). The block starts once
    the kubelet registered the driver (or raises :class:`TimeoutError`); at its
    end the driver stops as on SIGTERM and any error it failed with is raised.
    ``cdi_dir`` is a host path under ``root``.
    """
    objects = _dra_manager(kubelet).objects_dir
    assert objects is not None
    paths = HostPaths(root=root, kubelet_dir=kubelet.socket_dir)
    config = DriverConfig(
        driver,
        kubelet.node_name,
        paths,
        cdi_dir=cdi_dir,
        rescan_interval=rescan_interval,
        plugins_registry=kubelet.plugins_registry,
    )
    source = kind.build(dict(options), paths, resource=kind_resource(driver, kind.name), log_as=driver)
    runtime = DraDriverRuntime(
        config,
        source,
        claims=FileClaimReader(objects),
        slices=FileSlicePublisher(objects, driver=driver, node_name=kubelet.node_name),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runtime.run(stop), name=f"dra driver {driver}")
    try:
        registered = asyncio.ensure_future(runtime.registrations.wait_newer(0))
        done, _ = await asyncio.wait({registered, task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            registered.cancel()
            task.result()
            raise RuntimeError(f"the DRA driver {driver} stopped before it registered")
        if registered not in done:
            registered.cancel()
            raise TimeoutError(f"the DRA driver {driver} was not registered within {timeout} s")
        yield DraDriver(kubelet, runtime)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout)
