"""Fakes for the supervisor's state machine: a spawner that records, a clock that moves when told."""

from __future__ import annotations

import pytest

from plugvisor.supervisor.clock import FakeClock
from plugvisor.supervisor.config import NodeConfig, parse_config
from plugvisor.supervisor.spawner import FakeSpawner
from plugvisor.supervisor.supervisor import Supervisor


def node_config(*resources: str, **supervisor: object) -> NodeConfig:
    """A configuration with one generic resource per name (and supervisor settings)."""
    restart = {"initialDelay": 1, "maxDelay": 8, "multiplier": 2, "jitter": 0, "resetAfter": 10}
    settings: dict[str, object] = {"restart": restart, "stopTimeout": 5}
    settings.update(supervisor)
    return parse_config(
        {
            "kubeletDir": "/tmp/dp",
            "supervisor": settings,
            "resources": [{"name": name, "kind": "generic", "paths": ["/dev/fuse"]} for name in resources],
        },
        source="test.yaml",
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def spawner() -> FakeSpawner:
    return FakeSpawner()


@pytest.fixture
def make_supervisor(clock, spawner):
    def make(*resources: str, **settings: object) -> Supervisor:
        supervisor = Supervisor(
            node_config(*resources, **settings),
            spawner=spawner,
            clock=clock,
            rand=lambda: 0.5,
            socket_exists=lambda name: not name.startswith("gone"),
        )
        supervisor.start()
        return supervisor

    return make
