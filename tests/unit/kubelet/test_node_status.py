"""The node's figures after each change: one resource read again, the same as a full poll would give."""

from __future__ import annotations

from types import SimpleNamespace

from plugvisor.common import constants
from plugvisor.emulators.kubelet import endpoint, journal, manager, model
from plugvisor.emulators.kubelet.nodestatus import NodeStatus

GRACE = 300.0
GPU, NIC, FPGA = "example.com/gpu", "example.com/nic", "example.com/fpga"


class Node:
    """Books and two node statuses on them: one told which resource changed, one that polls all."""

    def __init__(self) -> None:
        self.now = 0.0
        self.books = manager.DeviceManager(grace_period=GRACE)
        devices = SimpleNamespace(
            books=self.books, get_capacity=lambda: self.books.get_capacity(now=self.now)
        )
        log = journal.Journal(clock=lambda: self.now)
        self.told = NodeStatus(journal=log, devices=lambda: devices, grace_period=GRACE)
        self.polled = NodeStatus(journal=log, devices=lambda: devices, grace_period=GRACE)

    def changed(self, resource: str) -> None:
        self.told.sync(resource)
        self.polled.sync()
        assert (self.told.capacity, self.told.allocatable, self.told.removed) == (
            self.polled.capacity,
            self.polled.allocatable,
            self.polled.removed,
        )

    def connect(self, resource: str) -> None:
        plugin = endpoint.Endpoint(
            resource=resource, socket_path=f"/tmp/{resource[-3:]}.sock", stub=None, journal=journal.Journal()
        )
        self.books.plugin_connected(resource, plugin, model.PluginOptions())
        self.changed(resource)

    def devices(self, resource: str, *health: str) -> None:
        records = [manager.DeviceRecord(id=f"d{i}", health=h, numa_nodes=()) for i, h in enumerate(health)]
        self.books.list_and_watch_update(resource, records)
        self.changed(resource)

    def disconnect(self, resource: str) -> None:
        self.books.plugin_disconnected(resource, now=self.now)
        self.changed(resource)


def test_each_change_leaves_every_figure_as_a_full_poll_gives_it():
    node = Node()
    for resource in (GPU, NIC, FPGA):
        node.connect(resource)
    node.devices(GPU, constants.HEALTHY, constants.HEALTHY, constants.UNHEALTHY)
    node.devices(NIC, constants.UNHEALTHY)
    node.devices(FPGA)
    node.devices(GPU, constants.HEALTHY)
    node.disconnect(NIC)  # stopped: its devices unhealthy, kept for the grace period
    assert node.told.counts(GPU) == (1, 1)
    assert node.told.counts(NIC) == (1, 0)


def test_a_grace_period_that_ran_out_is_applied_by_the_next_change_of_any_resource():
    """The full poll drops every expired resource: a change of another must not skip that."""
    node = Node()
    node.connect(GPU)
    node.connect(NIC)
    node.devices(GPU, constants.HEALTHY)
    node.devices(NIC, constants.HEALTHY)
    node.disconnect(NIC)
    node.now = GRACE + 1
    # Told alone: a poll drops the expired resource from the books, so the second would not see it go.
    node.books.list_and_watch_update(
        GPU, [manager.DeviceRecord(id=d, health=constants.HEALTHY, numa_nodes=()) for d in ("d0", "d1")]
    )
    node.told.sync(GPU)
    assert NIC in node.told.removed
    assert node.told.counts(NIC) == (0, 0)
    assert node.told.counts(GPU) == (2, 2)
