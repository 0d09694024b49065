"""`plugvisor plugin generic` as a real child process, against the emulated kubelet."""

import asyncio
import json
import signal
import sys

import pytest

from plugvisor.emulators.kubelet import EmulatedKubelet

RESOURCE = "example.com/serial"


@pytest.fixture
def node(short_dir):
    (short_dir / "root" / "dev").mkdir(parents=True)
    return short_dir


def plugin_argv(node, *args):
    return [
        sys.executable,
        "-m",
        "plugvisor",
        "plugin",
        "generic",
        "--host-root",
        str(node / "root"),
        "--kubelet-dir",
        str(node / "dp"),
        *args,
    ]


def allocatable(resource):
    def check(kubelet):
        view = kubelet.resource(resource)
        return None if view is None else view.allocatable

    return check


async def test_hot_plug_and_clean_stop(node):
    (node / "root/dev/ttyUSB0").touch()
    async with EmulatedKubelet(node / "dp") as kubelet:
        proc = await asyncio.create_subprocess_exec(
            *plugin_argv(node, "--resource", RESOURCE, "--path", "/dev/ttyUSB*"),
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await kubelet.wait_for(lambda k: allocatable(RESOURCE)(k) == 1, timeout=20)
            (node / "root/dev/ttyUSB1").touch()
            await kubelet.wait_for(lambda k: allocatable(RESOURCE)(k) == 2)
            assert sorted(kubelet.resource(RESOURCE).devices) == ["ttyUSB0", "ttyUSB1"]
            (node / "root/dev/ttyUSB0").unlink()
            await kubelet.wait_for(lambda k: sorted(k.resource(RESOURCE).devices) == ["ttyUSB1"])
            allocation = await kubelet.allocate(RESOURCE, 1)
            assert [d.host_path for d in allocation.response.devices] == [str(node / "root/dev/ttyUSB1")]
            assert [d.container_path for d in allocation.response.devices] == ["/dev/ttyUSB1"]
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, stderr.decode()
        assert not list((node / "dp").glob("plugvisor-*.sock")), "the plugin left its socket behind"
        await kubelet.wait_for(lambda k: allocatable(RESOURCE)(k) == 0)


async def test_default_resource_name_and_json_logs(node):
    (node / "root/dev/fuse").touch()
    async with EmulatedKubelet(node / "dp") as kubelet:
        proc = await asyncio.create_subprocess_exec(
            *plugin_argv(node, "--path", "/dev/fuse", "--count", "3", "--log-format", "json"),
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await kubelet.wait_for(lambda k: allocatable("plugvisor.io/generic")(k) == 3, timeout=20)
        finally:
            proc.send_signal(signal.SIGINT)
            _, stderr = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0
    first = stderr.decode().splitlines()[0]
    assert first.startswith("{") and '"event"' in first


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resource", "serial", "--path", "/dev/x"], "resource name 'serial' has no domain"),
        (["--path", "dev/x"], "paths[0].path: 'dev/x' must be an absolute path"),
        (["--count", "2"], "'paths' must list at least one path"),
        (["--options-json", '{"pahts": ["/dev/x"]}'], "pahts: unknown key; did you mean `paths`?"),
    ],
)
async def test_bad_configuration_exits_2_with_a_message(node, args, message):
    proc = await asyncio.create_subprocess_exec(
        *plugin_argv(node, *args), stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert message in stderr.decode()
    assert not (node / "dp").exists() or not list((node / "dp").iterdir())


async def test_an_options_file_that_is_not_a_mapping_is_refused(node):
    bad = node / "opts.yaml"
    bad.write_text("- /dev/fuse\n")
    proc = await asyncio.create_subprocess_exec(
        *plugin_argv(node, "--options-file", str(bad)), stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert "must hold a mapping of the kind's keys, not list" in stderr.decode()


async def test_exits_3_on_a_kubelet_restart_when_a_supervisor_owns_restarts(node):
    (node / "root/dev/fuse").touch()
    async with EmulatedKubelet(node / "dp") as kubelet:
        proc = await asyncio.create_subprocess_exec(
            *plugin_argv(node, "--options-json", '{"paths": ["/dev/fuse"]}', "--on-kubelet-restart", "exit"),
            stderr=asyncio.subprocess.PIPE,
        )
        await kubelet.wait_for(lambda k: allocatable("plugvisor.io/generic")(k) == 1, timeout=20)
        await kubelet.restart()
        _, stderr = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 3, stderr.decode()
    assert "exiting_for_restart" in stderr.decode()


async def test_serves_its_metrics_on_loopback_when_asked(node):
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (node / "root/dev/fuse").touch()
    async with EmulatedKubelet(node / "dp") as kubelet:
        proc = await asyncio.create_subprocess_exec(
            *plugin_argv(node, "--path", "/dev/fuse", "--metrics-listen", f"127.0.0.1:{port}"),
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await kubelet.wait_for(lambda k: allocatable("plugvisor.io/generic")(k) == 1, timeout=20)
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.communicate(), 10)
    assert 'plugvisor_plugin_registrations_total{resource="plugvisor.io/generic"} 1.0' in body
    assert 'plugvisor_plugin_list_and_watch_streams{resource="plugvisor.io/generic"} 1.0' in body


REPORT_COLLECTOR_AT_EXIT = """
import atexit, gc, json, sys
atexit.register(
    lambda: open(sys.argv[1], "w").write(json.dumps([gc.get_freeze_count(), len(gc.get_objects())]))
)
from plugvisor.cli import main
main(sys.argv[2:], prog_name="plugvisor")
"""


async def test_a_serving_plugin_keeps_its_start_up_objects_out_of_the_collectors_walks(node):
    """A full collection would otherwise walk everything start-up made, with every call in flight waiting."""
    (node / "root/dev/ttyUSB0").touch()
    report = node / "collector.json"
    argv = plugin_argv(node, "--resource", RESOURCE, "--path", "/dev/ttyUSB*")
    async with EmulatedKubelet(node / "dp") as kubelet:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            REPORT_COLLECTOR_AT_EXIT,
            str(report),
            *argv[3:],
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await kubelet.wait_for(lambda k: allocatable(RESOURCE)(k) == 1, timeout=30)
            await kubelet.allocate(RESOURCE, 1)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, stderr.decode()
    frozen, walked = json.loads(report.read_text())
    assert frozen > 10 * walked, (frozen, walked)
