"""A plugin starting up removes the sockets killed plugins of its resource left: only those, never a live one.

Real unix sockets in a real directory; the probe is the real one, observed.
"""

import os
import socket
from pathlib import Path

from plugvisor.common.sockets import socket_answers, socket_name
from plugvisor.deviceplugin.endpoint import remove_dead_instances

RESOURCE = "example.com/serial"
OTHER = "example.com/fuse"


def bound(path: Path, *, listening: bool) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    if listening:
        server.listen()
    return server


def dead(path: Path) -> Path:
    """A socket file whose process is gone (what a SIGKILL leaves)."""
    bound(path, listening=False).close()
    return path


async def test_only_the_dead_sockets_of_the_resource_are_removed(short_dir):
    killed = [dead(short_dir / socket_name(RESOURCE)) for _ in range(2)]
    live = short_dir / socket_name(RESOURCE)
    server = bound(live, listening=True)
    others = dead(short_dir / socket_name(OTHER))
    regular = short_dir / socket_name(RESOURCE)
    regular.write_text("not a socket\n")
    link = short_dir / socket_name(RESOURCE)
    link.symlink_to(dead(short_dir / "elsewhere.sock"))
    try:
        removed = await remove_dead_instances(short_dir, RESOURCE)
        assert sorted(removed) == sorted(path.name for path in killed)
        assert not any(path.exists() for path in killed)
        for kept in (live, others, regular, link):
            assert os.path.lexists(kept), kept.name
        assert socket_answers(live)
    finally:
        server.close()


async def test_a_socket_bound_by_a_plugin_starting_at_the_same_time_is_kept(short_dir):
    """Bound but not listening yet when it is first probed: not answering, and not dead."""
    path = short_dir / socket_name(RESOURCE)
    starting = bound(path, listening=False)
    probes = []

    def probe(candidate: Path) -> bool:
        answered = socket_answers(candidate)
        probes.append(answered)
        if len(probes) == 1:
            starting.listen()  # the other plugin gets to listen just after our first look
        return answered

    try:
        removed = await remove_dead_instances(short_dir, RESOURCE, answers=probe)
        assert removed == []
        assert probes[0] is False and probes[-1] is True
        assert socket_answers(path)
    finally:
        starting.close()


async def test_a_missing_directory_has_nothing_to_remove(short_dir):
    assert await remove_dead_instances(short_dir / "absent", RESOURCE) == []
