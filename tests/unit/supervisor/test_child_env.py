"""The environment the agent gives its fork server and children."""

from pathlib import Path

from plugvisor.common.notify import STATUS_SOCKET_ENV
from plugvisor.supervisor.agent import MULTIPROC_ENV, child_env


def test_the_environment_has_the_status_socket_metrics_only_when_served_and_nothing_of_systemd():
    base = {"PATH": "/bin", MULTIPROC_ENV: "/stale", "NOTIFY_SOCKET": "/run/systemd/notify"}
    run = Path("/run/pv")
    assert child_env(base, runtime_dir=run, multiprocess_metrics=False) == {
        "PATH": "/bin",
        STATUS_SOCKET_ENV: "/run/pv/status.sock",
    }
    assert child_env(base, runtime_dir=run, multiprocess_metrics=True) == {
        "PATH": "/bin",
        STATUS_SOCKET_ENV: "/run/pv/status.sock",
        MULTIPROC_ENV: "/run/pv/prometheus",
    }
