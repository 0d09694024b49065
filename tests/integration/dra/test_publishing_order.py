"""When a driver's slices reach the API server: only while the kubelet has the driver registered.

The scheduler allocates from a slice the moment it exists; a pod whose claim the kubelet cannot prepare
yet (no registered driver) backs off for about a minute. So the driver publishes at its registration,
again at every registration (a restarted kubelet deletes the node's slices), and holds its writes from a
registration it knows is lost until the next one. In process, against the emulated kubelet's plugin
watcher; the slices are files (:mod:`plugvisor.dra.local`), observed through the publisher.
"""

import asyncio
import contextlib
from collections.abc import Sequence

from plugvisor.common.hostpaths import HostPaths
from plugvisor.dra.devices import PublishedDevice
from plugvisor.dra.hooks import kind_resource
from plugvisor.dra.local import FileClaimReader, FileSlicePublisher
from plugvisor.dra.runtime import DraDriverRuntime, DriverConfig
from plugvisor.plugins.gpu import KIND as GPU

from .conftest import NODE, eventually, make_kubelet, slice_devices

DRIVER = "gpu.plugvisor.io"


class Recorded(FileSlicePublisher):
    """The file publisher, noting each call with the registration in force as the driver saw it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.runtime: DraDriverRuntime | None = None
        self.calls: list[tuple[str, int | None]] = []

    def _registration(self) -> int | None:
        assert self.runtime is not None
        registration = self.runtime.registrations.value
        return None if registration is None else registration.number

    async def publish(self, devices: Sequence[PublishedDevice]) -> None:
        self.calls.append(("publish", self._registration()))
        await super().publish(devices)

    def hold(self) -> None:
        self.calls.append(("hold", self._registration()))
        super().hold()


@contextlib.asynccontextmanager
async def driver(kubelet, lab_root, base):
    """The gpu kind as a driver in this process, its publisher recorded, whether or not the kubelet runs."""
    paths = HostPaths(root=lab_root, kubelet_dir=kubelet.socket_dir)
    config = DriverConfig(DRIVER, NODE, paths, cdi_dir="/cdi", plugins_registry=kubelet.plugins_registry)
    slices = Recorded(base / "api", driver=DRIVER, node_name=NODE)
    runtime = DraDriverRuntime(
        config,
        GPU.build({}, paths, resource=kind_resource(DRIVER, "gpu")),
        claims=FileClaimReader(base / "api"),
        slices=slices,
    )
    slices.runtime = runtime
    stop = asyncio.Event()
    task = asyncio.create_task(runtime.run(stop))
    try:
        yield runtime, slices
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def registered(runtime: DraDriverRuntime, number: int = 1):
    return lambda: (r := runtime.registrations.value) is not None and r.number >= number


async def test_a_driver_publishes_nothing_until_the_kubelet_registered_it(base, lab_root):
    kubelet = make_kubelet(base)
    async with driver(kubelet, lab_root, base) as (runtime, slices):
        # Serving, with its pool built: all a kubelet needs to register it; none is running yet.
        await eventually(runtime.registration_socket.is_ours, what="the registration socket served")
        assert slices.calls == []
        assert slice_devices(base) == []

        async with kubelet:
            await eventually(registered(runtime), what="registered")
            await eventually(lambda: len(slice_devices(base)) == 8, what="8 devices in the slice")
        assert slices.calls == [("publish", 1)]


async def test_a_restarted_kubelet_that_removed_the_slice_has_it_back_once_it_registered_the_driver(
    base, lab_root
):
    kubelet = make_kubelet(base)
    async with kubelet, driver(kubelet, lab_root, base) as (runtime, slices):
        await eventually(lambda: len(slice_devices(base)) == 8, what="8 devices in the slice")
        slices.path.unlink()  # what a starting kubelet does to the node's slices
        await kubelet.restart()
        await eventually(registered(runtime, 2), what="registered again")
        await eventually(lambda: len(slice_devices(base)) == 8, what="the slice back")
        assert slices.calls == [("publish", 1), ("publish", 2)]


async def test_a_lost_registration_holds_publishing_until_the_kubelet_registers_the_driver_again(
    base, lab_root
):
    kubelet = make_kubelet(base)
    async with kubelet, driver(kubelet, lab_root, base) as (runtime, slices):
        await eventually(lambda: len(slice_devices(base)) == 8, what="8 devices in the slice")
        runtime.registration_socket.path.unlink()  # the kubelet deregisters the driver
        await eventually(registered(runtime, 2), what="registered again")
        await eventually(lambda: len(slices.calls) == 3, what="published again")
        assert slices.calls == [("publish", 1), ("hold", 1), ("publish", 2)]
        assert len(slice_devices(base)) == 8
