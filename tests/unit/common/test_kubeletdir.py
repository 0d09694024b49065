"""Classifying kubelet-directory events: one reading of inotify serves the plugins and the agent."""

import asyncio

import structlog
import structlog.testing
from asyncinotify import Mask

from plugvisor.common.kubeletdir import DirChange, DirEvent, KubeletDirWatch, classify
from plugvisor.supervisor.kubelet_watch import KubeletWatch


def test_a_kubelet_socket_created_or_moved_in_means_a_kubelet_listens():
    for mask in (Mask.CREATE, Mask.MOVED_TO):
        assert classify(mask, "kubelet.sock") == DirEvent(DirChange.KUBELET_SOCKET_CREATED, "kubelet.sock")


def test_other_files_appearing_are_reported_by_name():
    """A plugin learns that another one took its resource over from the new socket's name."""
    name = "plugvisor-gpu-123456-abcdef01.sock"
    assert classify(Mask.CREATE, name) == DirEvent(DirChange.FILE_CREATED, name)
    checkpoint = "kubelet_internal_checkpoint"
    assert classify(Mask.MOVED_TO, checkpoint) == DirEvent(DirChange.FILE_CREATED, checkpoint)


def test_a_file_deleted_or_moved_away_is_a_removal_naming_it():
    name = "plugvisor-gpu-123456-abcdef01.sock"
    for mask in (Mask.DELETE, Mask.MOVED_FROM):
        assert classify(mask, name) == DirEvent(DirChange.FILE_REMOVED, name)


def test_the_directory_going_away_is_reported():
    assert classify(Mask.DELETE_SELF, "") == DirEvent(DirChange.DIR_REMOVED, "")


async def test_the_directory_lines_name_the_process_that_says_them(tmp_path):
    """The agent and every plugin watch the same directory and write to one standard error: a line
    naming nobody could be any of 257 processes'."""
    missing = tmp_path / "no-such" / "device-plugins"
    plugin = KubeletDirWatch(
        missing, lambda _event: None, log=structlog.get_logger().bind(resource="x.io/gpu")
    )
    with structlog.testing.capture_logs() as lines:
        plugin.open()
    try:
        created = [line for line in lines if line["event"] == "kubelet_dir_created"]
        assert [line.get("resource") for line in created] == ["x.io/gpu"]
    finally:
        plugin.close()


async def test_the_agents_directory_lines_say_it_is_the_agent(tmp_path):
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    agent = KubeletWatch(
        directory, on_kubelet_started=lambda _when: None, on_socket_deleted=lambda _name: None
    )
    with structlog.testing.capture_logs() as lines:
        agent.open()
        directory.rmdir()  # the kubelet's directory deleted under us: said, and watched again once re-created
        for _ in range(200):
            if any(line["event"] == "kubelet_dir_watched_again" for line in lines):
                break
            await asyncio.sleep(0.05)
        await agent.close()
    said = [line for line in lines if line["event"].startswith("kubelet_dir_")]
    assert {line["event"] for line in said} >= {"kubelet_dir_deleted", "kubelet_dir_watched_again"}
    assert all(line.get("process") == "agent" for line in said), said


async def test_a_narrowed_watch_stays_narrowed_on_the_directory_made_again(tmp_path):
    """The kubelet's directory deleted and made again: the plugin's watch opens anew, as narrow as before."""
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    events = []
    watch = KubeletDirWatch(directory, events.append, log=structlog.get_logger().bind(resource="x.io/gpu"))
    watch.open()
    watch.narrow(("kubelet.sock", "pv-ours-"))
    run = asyncio.create_task(watch.run())
    try:
        directory.rmdir()
        async with asyncio.timeout(10):
            while DirEvent(DirChange.DIR_REMOVED, "") not in events or not directory.is_dir():
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # watched again by now
        for name in ("pv-other-1.sock", "pv-ours-1.sock"):
            (directory / name).touch()
        async with asyncio.timeout(10):
            while DirEvent(DirChange.FILE_CREATED, "pv-ours-1.sock") not in events:
                await asyncio.sleep(0.01)
        assert DirEvent(DirChange.FILE_CREATED, "pv-other-1.sock") not in events
    finally:
        run.cancel()
        watch.close()
