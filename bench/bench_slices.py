"""How soon a device's change reaches the API server: SlicePublisher.publish -> the pool is synced.

Run: python bench/bench_slices.py [--changes 100] [--kubeconfig FILE]

Against a real kube-apiserver: the one ``--kubeconfig`` names (it must let its user create a Node and
ResourceSlices), else a minimal one started for the run with the integration tests' launcher
(tests/integration/dra_kube/conftest.py: etcd + kube-apiserver on loopback, the binaries of
tools/kubernetes). An 8-GPU pool is published, then one GPU at a time is withdrawn (as a lab fault
does) and put back; each change is timed from ``publish()`` to ``wait_synced()``. The floor, measured
in the same run, interleaved: one bare ``replace`` of a slice with the same client (one PUT round trip),
which is what a one-slice change cannot do with less. Also: the first publication of 300 devices
(3 slices) and the publisher's own Python work per no-op publish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceSlice

from plugvisor.common.logs import configure_logging
from plugvisor.dra.devices import PublishedDevice, SemVer
from plugvisor.dra.kube.config import ApiConfig, api_client, load_api_config
from plugvisor.dra.kube.slices import SlicePublisher

REPO = Path(__file__).resolve().parents[1]
DRIVER = "gpu.plugvisor.io"
NODE = "bench-node"


def gpus(count: int, missing: int | None = None) -> list[PublishedDevice]:
    return [
        PublishedDevice(
            f"gpu-{i}",
            attributes={"model": "H100", "index": i, "driverVersion": SemVer("550.54.15")},
            capacity={"memory": "80Gi"},
        )
        for i in range(count)
        if i != missing
    ]


@contextlib.contextmanager
def api_server(kubeconfig: Path | None) -> Iterator[ApiConfig]:
    if kubeconfig is not None:
        yield load_api_config(env={"KUBECONFIG": str(kubeconfig)})
        return
    with launched_api_server() as (launcher, server):
        yield server.config(launcher.ADMIN_TOKEN)


@contextlib.contextmanager
def launched_api_server() -> Iterator[tuple[Any, Any]]:
    """The integration tests' launcher module and its running API server (SystemExit if it cannot run)."""
    spec = importlib.util.spec_from_file_location(
        "dra_kube_conftest", REPO / "tests/integration/dra_kube/conftest.py"
    )
    assert spec is not None and spec.loader is not None
    launcher = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = launcher  # its dataclasses look their module up
    spec.loader.exec_module(launcher)
    try:
        with launcher.running_api_server() as server:
            yield launcher, server
    except BaseException as exc:  # pytest.skip raises an exception of its own
        if type(exc).__name__ == "Skipped":
            raise SystemExit(f"no API server: {exc}") from None
        raise


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(config: ApiConfig, changes: int) -> None:
    admin = api_client(config)
    with contextlib.suppress(Exception):
        await admin.create(Node.from_dict({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}))
    publisher = SlicePublisher(api_client(config), driver=DRIVER, node=NODE, close_client=True)

    started = time.perf_counter()
    await publisher.publish(gpus(300))
    assert await publisher.wait_synced(120), publisher.state
    first = time.perf_counter() - started

    await publisher.publish(gpus(8))
    assert await publisher.wait_synced(120), publisher.state
    changed: list[float] = []
    floor: list[float] = []
    for n in range(changes):
        for devices in (gpus(8, missing=n % 8), gpus(8)):
            t0 = time.perf_counter()
            await publisher.publish(devices)
            assert await publisher.wait_synced(120), publisher.state
            changed.append(time.perf_counter() - t0)
        (item,) = [s async for s in admin.list(ResourceSlice, fields={"spec.nodeName": NODE})]
        t0 = time.perf_counter()
        await admin.replace(item)
        floor.append(time.perf_counter() - t0)

    noop = time.perf_counter()
    for _ in range(1000):
        await publisher.publish(gpus(8))
    noop_us = (time.perf_counter() - noop) * 1000

    await publisher.withdraw()
    with contextlib.suppress(Exception):
        await admin.delete(Node, NODE)
    await admin.close()

    f50, f99 = statistics.median(floor) * 1000, percentile(floor, 0.99) * 1000
    c50, c99 = statistics.median(changed) * 1000, percentile(changed, 0.99) * 1000
    print(f"{changes * 2} changes of an 8-GPU pool (a GPU withdrawn, then back), {changes} floor samples")
    print("| figure | p50 | p99 | x floor (p50) |")
    print("|---|---|---|---|")
    print(f"| floor: one PUT of a slice | {f50:.1f} ms | {f99:.1f} ms | 1.0x |")
    print(f"| publish() -> synced, one device changed | {c50:.1f} ms | {c99:.1f} ms | {c50 / f50:.1f}x |")
    print(f"| first publication of 300 devices (3 slices) | {first * 1000:.0f} ms | | |")
    print(f"| publish() of an unchanged pool (no request) | {noop_us:.1f} us each | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--kubeconfig", type=Path, help="a real cluster instead of a minimal API server")
    args = parser.parse_args()
    configure_logging(level="warning")  # one line per change would drown the table
    with api_server(args.kubeconfig) as config:
        asyncio.run(measure(config, args.changes))


if __name__ == "__main__":
    sys.exit(main())
