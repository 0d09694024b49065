"""What registration counts from the kubelet directory: restarts, our socket, our resource's others."""

import asyncio

import structlog

from plugvisor.common.kubeletdir import DirChange, DirEvent
from plugvisor.common.sockets import socket_name
from plugvisor.deviceplugin.registration import KubeletDirState, Registrar

RESOURCE = "example.com/serial"


def removed(name):
    return DirEvent(DirChange.FILE_REMOVED, name)


def watched(tmp_path):
    state = KubeletDirState(tmp_path, log=structlog.get_logger().bind(resource="x.example/y"))
    Registrar(state, resource=RESOURCE)  # names the resource whose sockets are siblings
    state.own_socket = socket_name(RESOURCE, "00000002")
    state.served |= {socket_name(RESOURCE, "00000001"), state.own_socket}
    return state


def test_a_removed_socket_of_our_resource_that_we_never_served_is_a_sibling_gone(tmp_path):
    state = watched(tmp_path)
    state._apply(removed(socket_name(RESOURCE, "0000000a")))
    assert state.state.value.sibling_removals == 1
    assert state.state.value.socket_deletions == 0


def test_our_own_sockets_old_and_current_are_no_siblings(tmp_path):
    """Serving a fresh socket removes the old one: that must not look like another plugin leaving."""
    state = watched(tmp_path)
    state._apply(removed(socket_name(RESOURCE, "00000001")))
    state._apply(removed(socket_name(RESOURCE, "00000002")))
    assert state.state.value.sibling_removals == 0
    assert state.state.value.socket_deletions == 1  # the current one: the kubelet wiped it


def test_other_resources_and_other_files_are_not_counted(tmp_path):
    state = watched(tmp_path)
    for name in (
        socket_name("example.com/other", "0000000b"),
        socket_name(RESOURCE, "0000000c").removesuffix(".sock"),  # not a socket name
        "nvidia-gpu.sock",
        "kubelet.sock",
    ):
        state._apply(removed(name))
    assert state.state.value.sibling_removals == 0


async def test_the_watch_hands_over_only_kubelet_sock_and_our_resources_sockets(tmp_path):
    """At a kubelet restart of N resources each plugin is sent ~5 N events: the others' are dropped unread."""
    state = KubeletDirState(tmp_path, log=structlog.get_logger().bind(resource="x.example/y"))
    applied = []
    state._watch._on_event = applied.append
    state.open()
    try:
        Registrar(state, resource=RESOURCE)
        ours = socket_name(RESOURCE, "0000000d")
        for name in (socket_name("example.com/other", "0000000e"), "kubelet_internal_checkpoint", ours):
            (tmp_path / name).touch()
        (tmp_path / "kubelet.sock").touch()
        run = asyncio.create_task(state.run())
        try:
            async with asyncio.timeout(10):
                while len(applied) < 2:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
        finally:
            run.cancel()
        assert [event.name for event in applied] == [ours, "kubelet.sock"]
    finally:
        state.close()
