"""A second plugin for a resource another live plugvisor plugin serves: refused, or taken over on purpose.

The kubelet follows the newest registration of a resource and never tells the
older plugin; kubelets before kubernetes#135437 (up to 1.36) even mark every
device unhealthy when either of the two stops, and 1.37 refuses a second
Register from a socket it holds. A plugin started by hand beside the agent is
therefore refused with the socket it would fight, unless --replace says to take
over (what the agent's own children do); and either way round, once one of the
two stops, the other serves the resource, on both kubelet generations and in
both registration modes.
"""

import asyncio
import contextlib
import signal
import socket
import sys
from pathlib import Path

import pytest

from plugvisor.common.sockets import live_instances, socket_answers, socket_name, socket_prefix
from plugvisor.deviceplugin.runtime import STREAM_CUT
from plugvisor.emulators.kubelet import EmulatedKubelet, EventKind

RESOURCE = "example.com/serial"


def plugin_argv(node, *args):
    return [
        sys.executable, "-m", "plugvisor", "plugin", "generic",
        "--host-root", str(node / "root"),
        "--kubelet-dir", str(node / "device-plugins"),
        "--resource", RESOURCE,
        "--path", "/dev/ttyUSB*",
        *args,
    ]  # fmt: skip


def endpoint(kubelet):
    view = kubelet.resource(RESOURCE)
    return None if view is None or not view.registered else view.endpoint


async def start_first(node, kubelet):
    proc = await asyncio.create_subprocess_exec(*plugin_argv(node), stderr=asyncio.subprocess.PIPE)
    await kubelet.wait_for(lambda k: endpoint(k) is not None, timeout=20)
    return proc, endpoint(kubelet)


async def stop(proc):
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(proc.communicate(), 10)
    return stderr.decode()


async def test_a_second_plugin_exits_2_naming_the_live_socket_and_the_first_stays_registered(short_dir):
    (short_dir / "root/dev").mkdir(parents=True)
    (short_dir / "root/dev/ttyUSB0").touch()
    async with EmulatedKubelet(short_dir / "device-plugins") as kubelet:
        first, first_socket = await start_first(short_dir, kubelet)
        try:
            second = await asyncio.create_subprocess_exec(
                *plugin_argv(short_dir), stderr=asyncio.subprocess.PIPE
            )
            try:
                _, stderr = await asyncio.wait_for(second.communicate(), 20)
            finally:
                if second.returncode is None:
                    second.kill()
                    await second.wait()
            assert second.returncode == 2
            message = stderr.decode()
            assert f"{RESOURCE} is already served" in message
            assert first_socket in message
            assert "--replace" in message
            assert endpoint(kubelet) == first_socket
            assert [r.resource for r in kubelet.registrations] == [RESOURCE], "the second one registered"
        finally:
            assert first.returncode is None, await stop(first)
            await stop(first)


async def test_replace_takes_the_resource_over_and_says_so(short_dir):
    (short_dir / "root/dev").mkdir(parents=True)
    (short_dir / "root/dev/ttyUSB0").touch()
    async with EmulatedKubelet(short_dir / "device-plugins") as kubelet:
        first, first_socket = await start_first(short_dir, kubelet)
        second = await asyncio.create_subprocess_exec(
            *plugin_argv(short_dir, "--replace", "--log-format", "json"), stderr=asyncio.subprocess.PIPE
        )
        try:
            await kubelet.wait_for(lambda k: endpoint(k) not in (None, first_socket), timeout=20)
        finally:
            stderr = await stop(second)
            await stop(first)
        assert second.returncode == 0, stderr
        assert '"event": "replacing_live_plugin"' in stderr
        assert first_socket in stderr


async def test_a_socket_nobody_serves_does_not_block_a_start(short_dir):
    (short_dir / "root/dev").mkdir(parents=True)
    (short_dir / "root/dev/ttyUSB0").touch()
    (short_dir / "device-plugins").mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(short_dir / "device-plugins" / socket_name(RESOURCE, "deadbeef")))
    stale.close()  # the file stays; nothing listens: a plugin SIGKILLed without its agent
    async with EmulatedKubelet(short_dir / "device-plugins") as kubelet:
        proc = await asyncio.create_subprocess_exec(*plugin_argv(short_dir), stderr=asyncio.subprocess.PIPE)
        try:
            await kubelet.wait_for(lambda k: endpoint(k) is not None, timeout=20)
        finally:
            stderr = await stop(proc)
        assert proc.returncode == 0, stderr


def test_live_instances_are_this_resources_listening_sockets_only(short_dir):
    listening = []
    for name in (
        socket_name(RESOURCE, "00000001"),  # this resource, served
        socket_name("example.com/other", "00000002"),  # another resource, served
        socket_prefix(RESOURCE) + "x-00000003.sock",  # a longer prefix, not an instance of RESOURCE
    ):
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(short_dir / name))
        server.listen()
        listening.append(server)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(short_dir / socket_name(RESOURCE, "00000004")))
    dead.close()
    (short_dir / socket_name(RESOURCE, "00000005")).write_text("not a socket")
    try:
        assert live_instances(short_dir, RESOURCE) == [short_dir / socket_name(RESOURCE, "00000001")]
        assert live_instances(short_dir / "missing", RESOURCE) == []
    finally:
        for server in listening:
            server.close()


GENERATIONS = [
    pytest.param("1.35", id="1.35-per-name"),  # kubernetes#121994: any stream's end zeroes the resource
    pytest.param("1.37", id="1.37-per-socket"),  # kubernetes#135437: a second Register from a socket refused
]
MODES = ["kubelet-sock", "plugin-watcher"]


def node_of(base, version):
    """An emulated kubelet of ``version`` with a test-sized grace period, its plugin watcher beside it."""
    (base / "root/dev").mkdir(parents=True)
    (base / "root/dev/ttyUSB0").touch()
    return EmulatedKubelet(base / "device-plugins", grace_period=2, kubelet_version=version)


def counts(kubelet):
    view = kubelet.resource(RESOURCE)
    return None if view is None else (view.allocatable, view.capacity)


@contextlib.asynccontextmanager
async def plugins(node, kubelet, mode):
    """``start(*args)`` starts a plugin process and returns it once the kubelet follows it, with the socket
    it follows; no process outlives the block."""
    started = []

    async def start(*args):
        before = endpoint(kubelet)
        proc = await asyncio.create_subprocess_exec(
            *plugin_argv(node, "--registration", mode, *args), stderr=asyncio.subprocess.PIPE
        )
        started.append(proc)
        await kubelet.wait_for(
            lambda k: endpoint(k) not in (None, before) and counts(k) == (1, 1),
            timeout=30,
            what="the kubelet follows the new plugin",
        )
        return proc, endpoint(kubelet)

    try:
        yield start
    except BaseException as failure:  # what each plugin said tells why the kubelet saw what it saw
        for number, proc in enumerate(started, 1):
            if proc.returncode is None:
                proc.kill()
            with contextlib.suppress(Exception):
                _, stderr = await asyncio.wait_for(proc.communicate(), 10)
                failure.add_note(f"plugin {number} (exit {proc.returncode}) said:\n{stderr.decode()[-6000:]}")
        raise
    finally:
        for proc in started:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def stop_and_none_is_left(kubelet, proc):
    """The last plugin stopped cleanly, and the resource went the way of a plugin that is gone: allocatable
    0 at once, capacity kept for the grace period, then dropped. Returns its log."""
    log = await stop(proc)
    assert proc.returncode == 0, log
    await kubelet.wait_for(lambda k: counts(k) in (None, (0, 0)), timeout=20, what="dropped after the grace")
    counted = (EventKind.ENDPOINT_STOPPED, EventKind.DEVICES_UPDATED)
    last = [e for e in kubelet.events if e.kind in counted][-1]
    assert last.kind is EventKind.ENDPOINT_STOPPED, last
    assert (last.fields["capacity"], last.fields["allocatable"]) == (1, 0), last
    return log


async def the_second_serves_once_the_first_ended(kubelet, version):
    """The kubelet handled the first plugin's end its generation's way, and the second one serves."""
    if version == "1.35":
        handled, what = EventKind.ENDPOINT_STOPPED, "zeroed the resource (kubernetes#121994)"
    else:
        handled, what = EventKind.PLUGIN_INSTANCE_ENDED, "left the second plugin's instance serving"
    ended = f"the first plugin's end {what}"
    await kubelet.wait_for(lambda k: handled in [e.kind for e in k.events], what=ended)
    await kubelet.wait_for(
        lambda k: counts(k) == (1, 1) and k.resource(RESOURCE).registered,
        timeout=30,
        what="the resource served by the second plugin",
    )
    never_refused(kubelet)


def never_refused(kubelet):
    refused = [r for r in kubelet.registrations if not r.accepted]
    assert not refused, refused  # 1.37: "device plugin already connected" and the plugin forgotten


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("version", GENERATIONS)
async def test_when_the_plugin_that_took_over_stops_the_first_serves_the_resource_again(
    short_dir, version, mode
):
    """The first plugin registers again from a fresh socket, and keeps the one the kubelet still holds a
    stream on: on either generation the resource is served while one plugin runs, and gone when none does."""
    async with node_of(short_dir, version) as kubelet, plugins(short_dir, kubelet, mode) as start:
        first, first_socket = await start()
        second, second_socket = await start("--replace")
        registrations = len(kubelet.registrations)
        second_log = await stop(second)
        assert second.returncode == 0, second_log
        await kubelet.wait_for(
            lambda k: (
                len(k.registrations) > registrations
                and endpoint(k) not in (None, first_socket, second_socket)
                and counts(k) == (1, 1)
            ),
            timeout=30,
            what="the first plugin registered again, from a fresh socket",
        )
        never_refused(kubelet)
        # The first socket still serves the stream the kubelet holds on it: ending that stream would
        # make a kubelet up to 1.36 drop the fresh one.
        assert socket_answers(Path(first_socket))
        first_log = await stop_and_none_is_left(kubelet, first)
        never_refused(kubelet)
    assert not list(Path(first_socket).parent.glob("plugvisor-*.sock")), "a socket was left behind"
    assert "registering_again" in first_log or "registration_lost" in first_log, first_log
    assert "kubelet_restart_detected" not in first_log, first_log


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("version", GENERATIONS)
async def test_when_the_first_plugin_stops_the_one_that_took_over_goes_on_serving(short_dir, version, mode):
    """Up to 1.36 the first plugin's end closes the stream of the plugin the kubelet follows (and zeroes
    the resource): that plugin sees its stream cut and registers again. From 1.37 nothing happens."""
    async with node_of(short_dir, version) as kubelet, plugins(short_dir, kubelet, mode) as start:
        first, _ = await start()
        second, _ = await start("--replace")
        first_log = await stop(first)
        assert first.returncode == 0, first_log
        await the_second_serves_once_the_first_ended(kubelet, version)
        second_log = await stop_and_none_is_left(kubelet, second)
        never_refused(kubelet)
    if version == "1.35":
        assert "registering_again" in second_log or "registration_lost" in second_log, second_log


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("version", GENERATIONS)
async def test_a_killed_first_plugin_leaves_the_one_that_took_over_serving(short_dir, version, mode):
    """A killed plugin leaves its socket behind, so nothing says another plugin stopped; up to 1.36 its
    stream's end still cuts the stream of the plugin the kubelet follows, which registers again."""
    async with node_of(short_dir, version) as kubelet, plugins(short_dir, kubelet, mode) as start:
        first, _ = await start()
        second, _ = await start("--replace")
        first.kill()
        await first.wait()
        await the_second_serves_once_the_first_ended(kubelet, version)
        second_log = await stop_and_none_is_left(kubelet, second)
    if version == "1.35":
        assert f'reason="{STREAM_CUT}"' in second_log, second_log
    else:
        assert STREAM_CUT not in second_log, second_log
