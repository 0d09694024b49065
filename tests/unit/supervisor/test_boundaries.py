"""The supervisor process never loads gRPC (it is not fork-safe once started), nor PyPI's supervisor."""

import subprocess
import sys

import pytest

MODULES = [
    "plugvisor.supervisor",
    "plugvisor.supervisor.agent",
    "plugvisor.supervisor.backoff",
    "plugvisor.supervisor.child",
    "plugvisor.supervisor.cli",
    "plugvisor.supervisor.clock",
    "plugvisor.supervisor.config",
    "plugvisor.supervisor.forkserver",
    "plugvisor.supervisor.kubelet_watch",
    "plugvisor.supervisor.metrics",
    "plugvisor.supervisor.prctl",
    "plugvisor.supervisor.reports",
    "plugvisor.supervisor.spawner",
    "plugvisor.supervisor.states",
    "plugvisor.supervisor.status",
    "plugvisor.supervisor.supervisor",
    "plugvisor.supervisor.supervisord",
    "plugvisor.supervisor.systemd",
]

PROBE = f"""
import sys
from plugvisor.supervisor.config import child_specs, parse_config
for name in {MODULES!r}:
    __import__(name)
entry = {{"name": "a.example/x", "kind": "generic", "paths": ["/dev/x"]}}
driver = {{"name": "gpu.plugvisor.io", "kind": "gpu", "mode": "dra"}}
config = parse_config({{"resources": [entry, driver]}}, source="t")
child_specs(config)
forbidden = ("grpc.", "plugvisor.api.deviceplugin", "plugvisor.api.podresources",
    "plugvisor.api.pluginregistration", "plugvisor.deviceplugin.server", "plugvisor.deviceplugin.endpoint",
    "plugvisor.deviceplugin.registration", "plugvisor.deviceplugin.runtime", "plugvisor.deviceplugin.errors",
    "plugvisor.dra", "lightkube", "httpx2")
# Kinds import the DRA device model (gRPC-free, by contract) at load time; the driver itself never loads.
model = ("plugvisor.dra", "plugvisor.dra.devices", "plugvisor.dra.validation", "plugvisor.dra.hooks",
    "plugvisor.dra.cluster")
loaded = sorted(
    m for m in sys.modules
    if (m in ("grpc", "lightkube", "httpx2") or m.startswith(forbidden)) and m not in model
)
print(",".join(loaded))
print("supervisor" in sys.modules)
"""


def test_no_supervisor_module_pulls_in_grpc():
    """Importing every module and validating a configuration (a DRA driver's too) loads no gRPC module,
    no DRA driver module (the kinds' DRA device model aside) and no Kubernetes API client (fresh
    interpreter)."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, cwd="/"
    )
    loaded, pypi_supervisor = result.stdout.splitlines()
    assert loaded == ""
    assert pypi_supervisor == "False"


def test_the_states_module_imports_nothing():
    """states.py has no imports, so it can never be part of an import cycle."""
    import inspect

    from plugvisor.supervisor import states

    source = inspect.getsource(states)
    assert not [line for line in source.splitlines() if line.startswith(("import ", "from "))]


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("generic", {"paths": ["/dev/fuse"]}),
        ("gpu", {"replicas": 2, "cdi": True}),
        ("nic", {"match": {"pfNames": ["ens1f0#0-7"]}}),
        ("fpga", {"family": "xilinx", "releaseCleanup": {"command": ["true"]}}),
    ],
)
def test_every_built_in_kind_validates_its_options_without_grpc(kind, options):
    """The agent loads every configured kind to validate it; a kind's module must not load gRPC."""
    from plugvisor.testing import kind_loads_without_grpc

    assert kind_loads_without_grpc(kind, options) == []
