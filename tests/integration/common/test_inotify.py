"""The process's one inotify instance, shared by its watchers: each sees its own events, and only those."""

import asyncio
import contextlib
import os

from asyncinotify import Mask

from plugvisor.common import inotify


def instances_held() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
    return count


async def next_event(group: inotify.WatchGroup):
    return await asyncio.wait_for(group.get(), 10)


async def test_every_group_of_a_loop_shares_one_instance_which_closes_with_the_last():
    before = instances_held()
    groups = [inotify.open_watches() for _ in range(5)]
    assert instances_held() == before + 1
    for group in groups:
        group.close()
    assert instances_held() == before


async def test_two_groups_on_one_directory_each_get_the_events_they_asked_for(tmp_path):
    """inotify has one watch per inode and instance: its mask is the union, the delivery is not."""
    creations, deletions = inotify.open_watches(), inotify.open_watches()
    try:
        creations.add_watch(tmp_path, Mask.CREATE)
        deletions.add_watch(tmp_path, Mask.DELETE)
        (tmp_path / "a").touch()
        (tmp_path / "a").unlink()
        created = await next_event(creations)
        deleted = await next_event(deletions)
        assert (created.mask & Mask.CREATE, str(created.name)) == (Mask.CREATE, "a")
        assert (deleted.mask & Mask.DELETE, str(deleted.name)) == (Mask.DELETE, "a")
        assert creations.sync_get() is None
        assert deletions.sync_get() is None
    finally:
        creations.close()
        deletions.close()


async def test_a_narrowed_group_is_handed_only_the_names_it_asked_for_while_another_gets_all(tmp_path):
    """A plugin hears of kubelet.sock and its own resource's sockets; the agent, on the same inode, of all."""
    plugin, agent = inotify.open_watches(), inotify.open_watches()
    try:
        plugin.add_watch(tmp_path, Mask.CREATE | Mask.DELETE)
        agent.add_watch(tmp_path, Mask.CREATE | Mask.DELETE)
        plugin.narrow(("kubelet.sock", "pv-ours-"))
        for name in ("pv-other-1.sock", "kubelet.sock", "pv-ours-1.sock", "pv-other-2.sock"):
            (tmp_path / name).touch()
        (tmp_path / "pv-other-1.sock").unlink()
        seen = [(await next_event(plugin)).name, (await next_event(plugin)).name]
        assert seen == ["kubelet.sock", "pv-ours-1.sock"]
        assert plugin.sync_get() is None
        everything = [(await next_event(agent)).name for _ in range(5)]
        assert everything == [
            "pv-other-1.sock",
            "kubelet.sock",
            "pv-ours-1.sock",
            "pv-other-2.sock",
            "pv-other-1.sock",
        ]
    finally:
        plugin.close()
        agent.close()


async def test_a_narrowed_group_still_hears_of_the_directory_itself(tmp_path):
    directory = tmp_path / "dp"
    directory.mkdir()
    with inotify.open_watches() as group:
        group.add_watch(directory, Mask.CREATE | Mask.DELETE_SELF)
        group.narrow(("kubelet.sock",))
        (directory / "pv-other.sock").touch()
        (directory / "pv-other.sock").unlink()
        directory.rmdir()
        assert (await next_event(group)).mask & Mask.DELETE_SELF


async def test_one_group_letting_go_of_a_directory_leaves_the_other_watching_it(tmp_path):
    first, second = inotify.open_watches(), inotify.open_watches()
    try:
        watch = first.add_watch(tmp_path, Mask.CREATE)
        second.add_watch(tmp_path, Mask.CREATE)
        first.rm_watch(watch)
        (tmp_path / "b").touch()
        assert str((await next_event(second)).name) == "b"
        assert first.sync_get() is None
    finally:
        first.close()
        second.close()


async def test_a_group_that_stops_reading_is_bounded_and_told_it_lost_events(tmp_path, monkeypatch):
    monkeypatch.setattr(inotify, "MAX_QUEUED", 3)
    reader, idle = inotify.open_watches(), inotify.open_watches()
    try:
        idle.add_watch(tmp_path, Mask.CREATE)
        for index in range(10):
            (tmp_path / str(index)).touch()
        reader.add_watch(tmp_path, Mask.DELETE)
        (tmp_path / "0").unlink()
        await next_event(reader)
        assert idle.sync_get().mask & Mask.Q_OVERFLOW
    finally:
        reader.close()
        idle.close()


async def test_a_burst_of_events_pauses_the_reader_and_what_came_meanwhile_is_read_at_the_pause_end(
    tmp_path, monkeypatch
):
    """A process is woken once per pause in a storm, not once per event (the kubelet directory at a
    restart: every plugin's socket goes and comes); a lone event is read at once, as ever."""
    monkeypatch.setattr(inotify, "BURST_WINDOW", 3600.0)  # every wake-up after the first is in the burst
    monkeypatch.setattr(inotify, "BURST_GAP_FIRST", 4.0)
    monkeypatch.setattr(inotify, "BURST_GAP_MAX", 4.0)
    group = inotify.open_watches()
    try:
        group.add_watch(tmp_path, Mask.CREATE)
        (tmp_path / "lone").touch()
        assert str((await next_event(group)).name) == "lone"
        (tmp_path / "second").touch()  # within the window: read at once, then the reader pauses
        assert str((await next_event(group)).name) == "second"
        waiting = asyncio.ensure_future(group.get())
        await asyncio.sleep(0)  # the waiter looks (nothing yet) and waits
        (tmp_path / "during-the-pause").touch()
        done, _ = await asyncio.wait({waiting}, timeout=0.3)
        assert not done, "read while the reader pauses"
        assert str((await asyncio.wait_for(waiting, 10)).name) == "during-the-pause"
    finally:
        group.close()


async def test_in_a_storm_every_event_is_delivered_once_and_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(inotify, "BURST_WINDOW", 3600.0)
    monkeypatch.setattr(inotify, "BURST_GAP_FIRST", 0.01)
    group = inotify.open_watches()
    try:
        group.add_watch(tmp_path, Mask.CREATE | Mask.DELETE)
        for index in range(40):
            (tmp_path / str(index)).touch()
            if index % 5 == 0:
                await asyncio.sleep(0.005)
        for index in range(40):
            (tmp_path / str(index)).unlink()
        seen = [(bool((event := await next_event(group)).mask & Mask.CREATE), event.name) for _ in range(80)]
        assert seen == [(True, str(i)) for i in range(40)] + [(False, str(i)) for i in range(40)]
        assert group.sync_get() is None
    finally:
        group.close()


async def test_a_watcher_to_which_an_event_mattered_ends_the_pause(tmp_path, monkeypatch):
    """A crash-looping kubelet restarts again the moment a plugin has registered: the plugin must see
    the next restart at once, not after a pause meant for the other plugins' sockets."""
    monkeypatch.setattr(inotify, "BURST_WINDOW", 3600.0)
    monkeypatch.setattr(inotify, "BURST_GAP_FIRST", 3600.0)
    monkeypatch.setattr(inotify, "BURST_GAP_MAX", 3600.0)
    group = inotify.open_watches()
    try:
        group.add_watch(tmp_path, Mask.CREATE)
        for name in ("first", "second"):  # the second wake-up is in the burst: the reader pauses
            (tmp_path / name).touch()
            assert str((await next_event(group)).name) == name
        waiting = asyncio.ensure_future(group.get())
        await asyncio.sleep(0)  # the waiter looks (nothing yet) and waits
        group.hurry()
        (tmp_path / "after").touch()
        assert str((await asyncio.wait_for(waiting, 10)).name) == "after"
    finally:
        group.close()
