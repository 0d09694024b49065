"""A DRA driver killed under the agent leaves no dead socket where the kubelet's plugin watcher looks."""

from __future__ import annotations

import socket
from pathlib import Path

from plugvisor.supervisor.clock import FakeClock
from plugvisor.supervisor.config import dra_socket_paths, parse_config
from plugvisor.supervisor.spawner import FakeSpawner
from plugvisor.supervisor.supervisor import Supervisor

DRIVER = "gpu.plugvisor.io"


def bind(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    return server


def test_the_dead_sockets_of_a_killed_driver_go_and_a_live_ones_stay(short_dir: Path) -> None:
    kubelet_dir = short_dir / "device-plugins"
    kubelet_dir.mkdir()
    config = parse_config(
        {"kubeletDir": str(kubelet_dir), "resources": [{"name": DRIVER, "kind": "gpu", "mode": "dra"}]},
        source="test",
    )
    spawner = FakeSpawner()
    supervisor = Supervisor(config, spawner=spawner, clock=FakeClock(), rand=lambda: 0.5)
    supervisor.start()
    registration, dra = dra_socket_paths(kubelet_dir, DRIVER)
    bind(registration).close()  # the killed driver's: a socket file nobody answers on
    live = bind(dra)  # one a live process serves (a driver started by hand, say) is never touched
    try:
        pid = supervisor.children[DRIVER].pid
        spawner.exit(pid, -9)
        for exit_ in spawner.reap():
            supervisor.handle_exit(exit_.pid, exit_.returncode)

        assert not registration.exists()
        assert dra.exists()
    finally:
        live.close()
