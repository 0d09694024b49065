"""What a plugin process loads: what it uses, and nothing of the agent, the emulators or the unused options.

Every module kept out here cost each plugin process start-up time and memory
(bench/bench_footprint.py measures both); these tests pin them out on any
machine, without timing anything. The plugin runs for real, registers with the
emulated kubelet and stops on SIGTERM; on its way out it writes the names of the
modules it imported.
"""

import asyncio
import json
import signal
import sys

import pytest

from plugvisor.emulators.kubelet import EmulatedKubelet

RESOURCE = "example.com/fuse"

RUN_AND_LIST_MODULES = """
import atexit, json, sys
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(sorted(sys.modules))))
from plugvisor.cli import main
main(sys.argv[2:], prog_name="plugvisor")
"""

NEVER = (
    "plugvisor.supervisor",  # the agent
    "plugvisor.emulators",  # the emulated kubelet and lab, and so kubernetes_validate
    "kubernetes_validate",
    "plugvisor.demo",
    "plugvisor.testing",
    "plugvisor.dra",  # the DRA driver: a device plugin never loads it (nor the dispatch's DRA command)
    "plugvisor.plugins.draentry",
    "rich",  # the demo's terminal view (structlog would import it for a renderer we never use)
    "plugvisor.plugins.gpu",  # kinds never import each other: a generic plugin loads no other kind
    "plugvisor.plugins.fpga",
    "plugvisor.plugins.nic",
)
UNLESS_ASKED = {
    "prometheus_client": "--metrics-listen",  # or an agent that aggregates its children's metrics
    "yaml": "--options-file",  # the agent hands its children their options as JSON
    # Device monitoring (reports, telemetry, the PodResources poller): a plugin without metrics has none.
    "plugvisor.common.monitoring": "--metrics-listen",
    "plugvisor.deviceplugin.device_monitor": "--metrics-listen",
    "plugvisor.deviceplugin.owners": "--metrics-listen",
}


def loaded(modules, prefix):
    return sorted(m for m in modules if m == prefix or m.startswith(prefix + "."))


async def run_plugin(node, *args):
    (node / "root/dev").mkdir(parents=True, exist_ok=True)
    (node / "root/dev/fuse").touch()
    listing = node / "modules.json"
    argv = ["plugin", "generic", "--resource", RESOURCE, "--host-root", str(node / "root")]
    argv += ["--kubelet-dir", str(node / "dp"), *args]
    async with EmulatedKubelet(node / "dp") as kubelet:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", RUN_AND_LIST_MODULES, str(listing), *argv, stderr=asyncio.subprocess.PIPE
        )
        try:
            await kubelet.wait_for(
                lambda k: (view := k.resource(RESOURCE)) is not None and view.allocatable >= 1, timeout=30
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, stderr.decode()
    return set(json.loads(listing.read_text()))


async def test_a_standalone_plugin_loads_nothing_it_does_not_use(short_dir):
    modules = await run_plugin(short_dir, "--path", "/dev/fuse")
    assert "plugvisor.deviceplugin.runtime" in modules  # it did run the framework
    for prefix in (*NEVER, *UNLESS_ASKED):
        assert not loaded(modules, prefix), f"a plain generic plugin imported {loaded(modules, prefix)}"


@pytest.mark.parametrize("module", sorted(UNLESS_ASKED))
async def test_an_optional_part_is_loaded_when_its_option_asks_for_it(short_dir, module):
    option = UNLESS_ASKED[module]
    if option == "--options-file":
        (short_dir / "options.yaml").write_text("paths: [/dev/fuse]\n")
        args = [option, str(short_dir / "options.yaml")]
    else:
        args = ["--path", "/dev/fuse", option, "127.0.0.1:0"]
    modules = await run_plugin(short_dir, *args)
    assert module in modules
    for prefix in NEVER:
        assert not loaded(modules, prefix)
