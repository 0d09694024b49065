"""PodResources conversion rules and the rate limiter, without sockets."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.common import constants
from plugvisor.emulators.kubelet import gates, manager, podresources

GPU = "example.com/gpu"


def summary(entries: list) -> list[tuple[str, list[str], list[int] | None]]:
    return [
        (
            e.resource_name,
            list(e.device_ids),
            [n.ID for n in e.topology.nodes] if e.HasField("topology") else None,
        )
        for e in entries
    ]


class TestConversion:
    def test_one_entry_per_device_and_numa_node(self) -> None:
        """A two-NUMA device appears twice; a device without topology once, without topology."""
        allocation = manager.ContainerAllocation(
            devices_by_numa=MappingProxyType({-1: ("plain",), 0: ("a", "both"), 1: ("both",)}),
            response=api_pb2.ContainerAllocateResponse(),
        )
        assert summary(podresources.container_devices({GPU: allocation})) == [
            (GPU, ["a"], [0]),
            (GPU, ["both"], [0]),
            (GPU, ["both"], [1]),
            (GPU, ["plain"], None),
        ]

    def test_allocatable_lists_healthy_devices_only(self) -> None:
        """Unhealthy devices are left out; an empty topology yields no entry, as upstream."""
        books = manager.DeviceManager(grace_period=1)
        books.list_and_watch_update(
            GPU,
            [
                manager.DeviceRecord("a", constants.HEALTHY, (0, 1)),
                manager.DeviceRecord("b", constants.UNHEALTHY, (0,)),
                manager.DeviceRecord("c", constants.HEALTHY, ()),
                manager.DeviceRecord("d", constants.HEALTHY, (), has_topology=True),
            ],
        )
        assert summary(podresources.allocatable_devices(books)) == [
            (GPU, ["a"], [0]),
            (GPU, ["a"], [1]),
            (GPU, ["c"], None),
        ]


class TestRateLimiter:
    def test_a_burst_passes_then_calls_are_refused_until_tokens_refill(self) -> None:
        """Burst 10 at once, then one more token per 1/QPS seconds."""
        now = [0.0]
        limiter = podresources.RateLimiter(qps=100, burst=10, clock=lambda: now[0])
        assert [limiter.allow() for _ in range(11)] == [True] * 10 + [False]
        now[0] += 0.01
        assert limiter.allow()
        assert not limiter.allow()
        now[0] += 10
        assert sum(limiter.allow() for _ in range(20)) == 10


class TestFeatureGates:
    def test_defaults_are_the_kubelets(self) -> None:
        """Get, health status and the proposed Deallocate are all off by default."""
        assert gates.FeatureGates().enabled() == []

    def test_parse_the_kubelet_syntax(self) -> None:
        """``Name=true,Other=false``, case-insensitive booleans."""
        parsed = gates.FeatureGates.parse("KubeletPodResourcesGet=true, ResourceHealthStatus=TRUE")
        assert parsed.enabled() == ["KubeletPodResourcesGet", "ResourceHealthStatus"]

    @pytest.mark.parametrize("text", ["Nope=true", "KubeletPodResourcesGet", "KubeletPodResourcesGet=yes"])
    def test_mistakes_are_refused(self, text: str) -> None:
        """Unknown names and non-boolean values raise ValueError."""
        with pytest.raises(ValueError):
            gates.FeatureGates.parse(text)
