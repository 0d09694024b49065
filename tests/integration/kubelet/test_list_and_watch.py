"""ListAndWatch over a real socket: health, stream ends, no re-dial, grace period, replacement."""

from __future__ import annotations

import grpc
import pytest

from plugvisor.common import constants
from plugvisor.emulators.kubelet import EmulatedKubelet, EventKind, PluginMethod, device, devices

from .conftest import PluginFactory, counts

GPU = "example.com/gpu"
UNHEALTHY = constants.UNHEALTHY


def four(*bad: str) -> list:
    return [device(i, UNHEALTHY if i in bad else constants.HEALTHY) for i in ("d1", "d2", "d3", "d4")]


class TestHealth:
    async def test_scenario_13_one_device_unhealthy_then_healthy(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """(alloc, cap): (1,1) -> (0,1) -> (1,1)."""
        stub = await plugin(GPU, devices("d1"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 1, 1))
        await stub.update(devices("d1", health=UNHEALTHY))
        await kubelet.wait_for(counts(GPU, 0, 1))
        await stub.update(devices("d1"))
        await kubelet.wait_for(counts(GPU, 1, 1))

    async def test_scenario_15_toggling_four_devices(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """(4,4) -> (3,4) -> (4,4) -> (2,4) -> (3,4) -> (4,4), each message a full list."""
        stub = await plugin(GPU, four())
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 4, 4))
        for bad, expected in [
            (("d1",), (3, 4)),
            ((), (4, 4)),
            (("d2", "d3"), (2, 4)),
            (("d3",), (3, 4)),
            ((), (4, 4)),
        ]:
            await stub.update(four(*bad))
            await kubelet.wait_for(counts(GPU, *expected))
        assert kubelet.calls_for(GPU) == [PluginMethod.GET_DEVICE_PLUGIN_OPTIONS, PluginMethod.LIST_AND_WATCH]

    async def test_duplicates_on_the_wire_collapse_and_conflicts_count_twice(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Same-health duplicates count once; a conflicting duplicate is in both sets."""
        stub = await plugin(GPU, [device("a"), device("a"), device("b"), device("b", UNHEALTHY)])
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 3))
        view = kubelet.resource(GPU)
        assert view is not None
        assert view.devices["b"].reported_health == UNHEALTHY


class TestStreamEnd:
    async def test_a_stream_error_makes_every_device_unhealthy_and_is_never_redialed(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Scenario 17: (2,2) -> (0,2), exactly two calls, the plugin still alive."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        await stub.end_streams("device plugin crashed")
        await kubelet.wait_for(counts(GPU, 0, 2))
        view = kubelet.resource(GPU)
        assert view is not None
        assert not view.registered
        assert kubelet.calls_for(GPU) == [PluginMethod.GET_DEVICE_PLUGIN_OPTIONS, PluginMethod.LIST_AND_WATCH]
        ended = [e for e in kubelet.events if e.kind is EventKind.STREAM_ENDED]
        assert ended[0].fields["error"] == "rpc error: code = Unknown desc = device plugin crashed"

    async def test_a_clean_end_of_stream_counts_as_a_failure_too(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """EOF is no different from an error for the kubelet."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        await stub.end_streams()
        await kubelet.wait_for(counts(GPU, 0, 2))
        assert [e.fields["error"] for e in kubelet.events if e.kind is EventKind.STREAM_ENDED] == ["EOF"]

    async def test_scenario_16_a_stream_failing_immediately_shows_zero_of_zero(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """No device ever listed: the resource is reported at (0, 0), calls are not retried."""
        stub = await plugin(GPU, devices("a"))
        stub.errors[PluginMethod.LIST_AND_WATCH] = "no"
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 0, 0))
        assert kubelet.calls_for(GPU) == [PluginMethod.GET_DEVICE_PLUGIN_OPTIONS, PluginMethod.LIST_AND_WATCH]

    async def test_scenario_18_a_stopped_plugin_is_removed_after_the_grace_period(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """(2,2) -> (0,2) -> removed and reported at (0,0)."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        await stub.stop()
        await kubelet.wait_for(counts(GPU, 0, 2))
        await kubelet.wait_for(lambda k: (v := k.resource(GPU)) is not None and v.removed)
        view = kubelet.resource(GPU)
        assert view is not None
        assert (view.allocatable, view.capacity, view.endpoint, view.registered) == (0, 0, None, False)
        assert [e.kind for e in kubelet.events].count(EventKind.RESOURCE_REMOVED) == 1

    async def test_registering_again_heals_the_resource(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Only a new Register brings the devices back."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        await stub.end_streams("blip")
        await kubelet.wait_for(counts(GPU, 0, 2))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        view = kubelet.resource(GPU)
        assert view is not None
        assert view.registered


class TestReplacement:
    async def test_a_second_plugin_takes_over_the_resource(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The newest Register wins: its endpoint and its list."""
        first = await plugin(GPU, devices("a", "b"))
        await first.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        second = await plugin(GPU, devices("x", "y", "z"))
        await second.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 3, 3))
        view = kubelet.resource(GPU)
        assert view is not None
        assert view.endpoint == str(second.socket_path)

    async def test_the_old_streams_end_disconnects_the_new_plugin(
        self, kubelet_1_35: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The replacement race of kubernetes#121994 (1.35): the old stream's end stops the current one."""
        kubelet = kubelet_1_35
        first = await plugin(GPU, devices("a", "b"))
        await first.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        second = await plugin(GPU, devices("x", "y", "z"))
        await second.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 3, 3))
        await first.stop()
        await kubelet.wait_for(counts(GPU, 0, 3))
        # The new plugin's stream is cut too: its channel was closed under it.
        await kubelet.wait_for(lambda k: [e.kind for e in k.events].count(EventKind.STREAM_ENDED) == 2)
        view = kubelet.resource(GPU)
        assert view is not None
        assert not view.registered

    async def test_a_failed_registration_leaves_the_working_plugin_alone(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Scenario 22: a plugin whose options call fails does not disturb the current one."""
        first = await plugin(GPU, devices("a", "b"))
        await first.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        slow = await plugin(GPU, devices("x"))
        slow.errors[PluginMethod.GET_DEVICE_PLUGIN_OPTIONS] = "not ready"
        with pytest.raises(grpc.aio.AioRpcError):
            await slow.register(kubelet.socket_path)
        assert counts(GPU, 2, 2)(kubelet)
        await first.update(devices("a", "b", "c"))
        await kubelet.wait_for(counts(GPU, 3, 3))
