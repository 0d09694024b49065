"""A second plugin for a resource another live plugvisor plugin serves: refused, or taken over on purpose.

The kubelet follows the newest registration of a resource and never tells the
older plugin; kubelets before kubernetes#135437 even mark every device unhealthy
when either of the two stops. A plugin started by hand beside the agent is
therefore refused with the socket it would fight, unless --replace says to take
over (what the agent's own children do).
"""

import asyncio
import signal
import socket
import sys

import pytest

from plugvisor.common.sockets import live_instances, socket_name, socket_prefix
from plugvisor.emulators.kubelet import EmulatedKubelet

RESOURCE = "example.com/serial"


def plugin_argv(node, *args):
    return [
        sys.executable, "-m", "plugvisor", "plugin", "generic",
        "--host-root", str(node / "root"),
        "--kubelet-dir", str(node / "dp"),
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
    async with EmulatedKubelet(short_dir / "dp") as kubelet:
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
    async with EmulatedKubelet(short_dir / "dp") as kubelet:
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
    (short_dir / "dp").mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(short_dir / "dp" / socket_name(RESOURCE, "deadbeef")))
    stale.close()  # the file stays; nothing listens: a plugin SIGKILLed without its agent
    async with EmulatedKubelet(short_dir / "dp") as kubelet:
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


@pytest.mark.parametrize("replacement", ["per-name", "per-socket"])
async def test_once_a_plugin_that_took_the_resource_over_stops_the_first_registers_again(
    short_dir, replacement
):
    """A kubelet up to 1.35 forgets the first plugin when a second registers, and marks every device
    unhealthy when the second stops; the first sees the second's socket go and registers again, on its
    own socket, so the resource comes back without a kubelet restart."""
    (short_dir / "root/dev").mkdir(parents=True)
    (short_dir / "root/dev/ttyUSB0").touch()
    failure: TimeoutError | None = None
    second_stderr = "(not stopped)"
    async with EmulatedKubelet(short_dir / "dp", replacement=replacement) as kubelet:
        first, first_socket = await start_first(short_dir, kubelet)
        try:
            second = await asyncio.create_subprocess_exec(
                *plugin_argv(short_dir, "--replace"), stderr=asyncio.subprocess.PIPE
            )
            try:
                await kubelet.wait_for(lambda k: endpoint(k) not in (None, first_socket), timeout=20)
                registrations = len(kubelet.registrations)
            finally:
                second_stderr = await stop(second)
            await kubelet.wait_for(
                lambda k: (
                    len(k.registrations) > registrations
                    and endpoint(k) == first_socket
                    and k.resource(RESOURCE).allocatable == 1
                ),
                timeout=20,
            )
            assert kubelet.registrations[-1].endpoint == first_socket.rsplit("/", 1)[-1]
        except TimeoutError as exc:  # say why: both plugins' logs
            failure = exc
        finally:
            stderr = await stop(first)
        if failure is not None:
            raise AssertionError(f"{failure}\nfirst plugin:\n{stderr}\nsecond plugin:\n{second_stderr}")
        assert "registering_again" in stderr, stderr
        assert "kubelet_restart_detected" not in stderr, stderr
