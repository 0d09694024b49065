"""Test helpers for people who write kinds: the same tools plugvisor's own tests use, as a public API.

A kind is tested at two levels (docs/writing-a-kind.md):

- its source alone, against a host tree in a temporary directory (or the
  emulated lab, :mod:`plugvisor.emulators.lab`): :func:`scan` builds the kind
  from raw options, as a configuration file gives them, and scans once;
- the whole plugin against the emulated kubelet
  (:class:`~plugvisor.emulators.kubelet.EmulatedKubelet`): :func:`running_plugin`
  runs it in process, registered and serving, for the duration of an ``async
  with`` block, and :func:`short_socket_dir` gives a directory whose socket
  paths fit the unix limit. The emulated kubelet comes with the ``emulators``
  extra (``pip install 'plugvisor[emulators]'``); the caller creates it, so
  this module itself, and the first level, need no more than a node's install.

:func:`kind_loads_without_grpc` checks the one rule the agent imposes on a
kind's module: loading it (the agent does, to validate its configuration) must
not import gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.plugins.kinds import PluginKind, get_kind

if TYPE_CHECKING:
    from plugvisor.emulators.kubelet import EmulatedKubelet

__all__ = ["kind_loads_without_grpc", "running_plugin", "scan", "short_socket_dir"]


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
