"""Without inotify budget a process polls: which errors mean that, and what a polled watch reports."""

import asyncio
import errno
import os

import pytest
import structlog
from asyncinotify import Inotify, Mask

from plugvisor.common import inotify

DIR_MASK = Mask.CREATE | Mask.DELETE | Mask.DELETE_SELF | Mask.ONLYDIR


def no_instances(*args, **kwargs):
    raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))


@pytest.fixture
def instances_spent(monkeypatch):
    """``inotify_init`` fails as it does when the user's ``max_user_instances`` are all taken."""
    monkeypatch.setattr(inotify, "Inotify", no_instances)


@pytest.fixture
def watches_spent(monkeypatch):
    """``inotify_add_watch`` fails as it does when the user's ``max_user_watches`` are all taken."""

    def add_watch(self, path, mask):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Inotify, "add_watch", add_watch)


async def next_event(group: inotify.WatchGroup) -> inotify.WatchEvent:
    return await asyncio.wait_for(group.get(), 10)


@pytest.mark.parametrize(
    ("code", "sysctl"),
    [(errno.EMFILE, "fs.inotify.max_user_instances"), (errno.ENOSPC, "fs.inotify.max_user_watches")],
)
def test_a_spent_budget_means_polling_and_the_reason_names_the_sysctl(code, sysctl):
    reason = inotify.fallback_reason(OSError(code, os.strerror(code)), what="cannot watch /x")
    assert reason is not None
    assert reason.startswith("cannot watch /x: too many inotify")
    assert sysctl in reason


@pytest.mark.parametrize("code", [errno.ENFILE, errno.ENOMEM])
def test_the_system_running_out_of_files_or_memory_means_polling_too(code):
    assert inotify.fallback_reason(OSError(code, os.strerror(code)), what="cannot watch /x") is not None


@pytest.mark.parametrize("code", [errno.ENOENT, errno.ENOTDIR, errno.EACCES])
def test_errors_about_the_path_are_not_a_reason_to_poll(code):
    assert inotify.fallback_reason(OSError(code, os.strerror(code)), what="cannot watch /x") is None


async def test_with_inotify_the_mode_says_so_and_nobody_is_told_of_polling(tmp_path):
    told = []
    stop = inotify.on_polling(told.append)
    with inotify.open_watches(poll_interval=0.01) as group:
        group.add_watch(tmp_path, DIR_MASK)
        assert group.polled == frozenset()
    stop()
    assert inotify.watch_mode() == ("inotify", None)
    assert told == []


async def test_no_instance_left_means_polling_said_once_to_every_listener(instances_spent, tmp_path):
    told, later = [], []
    inotify.on_polling(told.append)
    first = inotify.open_watches(poll_interval=0.01)
    second = inotify.open_watches(poll_interval=0.01)
    first.add_watch(tmp_path, DIR_MASK)
    second.add_watch(tmp_path, DIR_MASK)
    inotify.on_polling(later.append)  # a listener that comes after the fallback hears it at once
    mode, reason = inotify.watch_mode()
    assert mode == "polling"
    assert "fs.inotify.max_user_instances" in reason
    assert told == later == [reason]
    assert first.polled == second.polled == frozenset({tmp_path})
    first.close()
    second.close()


async def test_the_polling_line_names_each_listeners_process(instances_spent, tmp_path):
    told = []
    with structlog.testing.capture_logs() as logs:
        inotify.on_polling(told.append, log=structlog.get_logger("test").bind(resource="example.com/a"))
        with inotify.open_watches(poll_interval=0.01) as group:
            group.add_watch(tmp_path, DIR_MASK)
    said = [entry for entry in logs if entry["event"] == "watching_by_polling"]
    assert [entry.get("resource") for entry in said] == ["example.com/a"]
    assert len(told) == 1


async def test_with_no_listener_naming_itself_the_polling_line_is_said_unnamed(instances_spent, tmp_path):
    with structlog.testing.capture_logs() as logs:
        inotify.on_polling(lambda _why: None)
        with inotify.open_watches(poll_interval=0.01) as group:
            group.add_watch(tmp_path, DIR_MASK)
    said = [entry for entry in logs if entry["event"] == "watching_by_polling"]
    assert len(said) == 1 and "resource" not in said[0]


async def test_a_polled_directory_reports_entries_created_and_deleted(instances_spent, tmp_path):
    (tmp_path / "old").touch()
    with inotify.open_watches(poll_interval=0.01) as group:
        watch = group.add_watch(tmp_path, DIR_MASK)
        (tmp_path / "new").touch()
        (tmp_path / "old").unlink()
        events = [await next_event(group), await next_event(group)]
        assert {(event.mask, event.name) for event in events} == {(Mask.CREATE, "new"), (Mask.DELETE, "old")}
        assert [event.watch for event in events] == [watch, watch]
        assert group.sync_get() is None


async def test_a_narrowed_polled_directory_reports_only_the_names_asked_for(instances_spent, tmp_path):
    (tmp_path / "pv-other-old.sock").touch()
    with inotify.open_watches(poll_interval=0.01) as group:
        group.add_watch(tmp_path, DIR_MASK)
        group.narrow(("kubelet.sock", "pv-ours-"))
        for name in ("pv-other-1.sock", "pv-ours-1.sock", "kubelet.sock"):
            (tmp_path / name).touch()
        (tmp_path / "pv-other-old.sock").unlink()  # listed before narrow(): not reported gone either
        events = [await next_event(group), await next_event(group)]
        assert {(event.mask, event.name) for event in events} == {
            (Mask.CREATE, "pv-ours-1.sock"),
            (Mask.CREATE, "kubelet.sock"),
        }
        await asyncio.sleep(0.1)
        assert group.sync_get() is None
        for _ in range(3):  # a few looks later, still nothing of the others
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(group.get(), 0.05)


def test_narrowing_to_no_name_at_all_is_refused():
    """An empty tuple would drop every named event: a watch that hears nothing, silently."""
    group = inotify.WatchGroup.__new__(inotify.WatchGroup)
    with pytest.raises(ValueError, match="at least one name prefix"):
        group.narrow(())


async def test_an_entry_replaced_between_two_looks_is_reported_gone_and_created(instances_spent, tmp_path):
    """A kubelet that restarts between two looks: ``kubelet.sock`` is another file under the same name."""
    socket = tmp_path / "kubelet.sock"
    socket.touch()
    with inotify.open_watches(poll_interval=0.01) as group:
        group.add_watch(tmp_path, DIR_MASK)
        os.link(socket, tmp_path / "old")  # the old file lives on: the new one has another inode
        socket.unlink()
        socket.touch()
        seen = []
        while (Mask.CREATE, "kubelet.sock") not in seen:
            event = await next_event(group)
            seen.append((event.mask, event.name))
        assert (Mask.DELETE, "kubelet.sock") in seen


async def test_a_polled_directory_that_goes_away_is_reported_and_its_watch_ends(instances_spent, tmp_path):
    watched = tmp_path / "dir"
    watched.mkdir()
    with inotify.open_watches(poll_interval=0.01) as group:
        watch = group.add_watch(watched, DIR_MASK)
        watched.rmdir()
        gone, ignored = await next_event(group), await next_event(group)
        assert (gone.mask, gone.watch) == (Mask.DELETE_SELF, watch)
        assert (ignored.mask, ignored.watch) == (Mask.IGNORED, watch)
        assert group.polled == frozenset()


async def test_a_directory_made_again_under_the_same_name_ends_the_watch_as_inotify_would(
    instances_spent, tmp_path
):
    """inotify watches the inode: the new directory is not the one watched."""
    watched = tmp_path / "dir"
    watched.mkdir()
    with inotify.open_watches(poll_interval=0.01) as group:
        group.add_watch(watched, DIR_MASK)
        watched.rename(tmp_path / "moved")
        watched.mkdir()
        assert (await next_event(group)).mask == Mask.DELETE_SELF


async def test_a_group_without_a_poll_interval_never_looks(instances_spent, tmp_path):
    """A plugin's device paths: its periodic rescan is the look, so the group adds none."""
    with inotify.open_watches(poll_interval=None) as group:
        group.add_watch(tmp_path, DIR_MASK)
        (tmp_path / "new").touch()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(group.get(), 0.2)
        assert group.polled == frozenset({tmp_path})


async def test_a_path_that_cannot_be_watched_is_still_an_error_when_polling(instances_spent, tmp_path):
    with inotify.open_watches(poll_interval=0.01) as group:
        with pytest.raises(FileNotFoundError):
            group.add_watch(tmp_path / "missing", DIR_MASK)
        (tmp_path / "file").touch()
        with pytest.raises(NotADirectoryError):
            group.add_watch(tmp_path / "file", DIR_MASK)


async def test_no_watch_left_polls_that_path_only_and_says_so(watches_spent, tmp_path):
    told = []
    inotify.on_polling(told.append)
    with inotify.open_watches(poll_interval=0.01) as group:
        group.add_watch(tmp_path, DIR_MASK)
        assert group.polled == frozenset({tmp_path})
        (tmp_path / "new").touch()
        assert (await next_event(group)).name == "new"
    assert len(told) == 1
    assert "fs.inotify.max_user_watches" in told[0]


async def test_a_process_that_fell_back_stays_polling(monkeypatch, tmp_path):
    """It does not take an instance back that another process may be waiting for; its next start does."""
    monkeypatch.setattr(inotify, "Inotify", no_instances)
    with inotify.open_watches(poll_interval=0.01) as group:
        group.add_watch(tmp_path, DIR_MASK)
    monkeypatch.undo()
    with inotify.open_watches(poll_interval=0.01) as group:
        group.add_watch(tmp_path, DIR_MASK)
        assert group.polled == frozenset({tmp_path})
    assert inotify.watch_mode()[0] == "polling"


async def test_a_polled_directory_that_keeps_changing_is_looked_at_less_often_until_it_is_quiet(
    instances_spent, tmp_path, monkeypatch
):
    """At a kubelet restart of hundreds of resources the directory changes for seconds, and each look
    lists every socket: from the second look in a row that finds a change, the next waits longer."""
    monkeypatch.setattr(inotify, "POLL_BUSY_MAX", 0.4)
    group = inotify.open_watches(poll_interval=0.1)
    try:
        group.add_watch(tmp_path, Mask.CREATE)
        waits = []
        for index in range(5):
            (tmp_path / f"busy{index}").touch()
            event = await asyncio.wait_for(group.get(), 10)
            assert event.name == f"busy{index}"
            waits.append(group._poll_wait)
        assert waits == [0.1, 0.2, 0.4, 0.4, 0.4]
        quiet = asyncio.ensure_future(group.get())
        await asyncio.sleep(1.0)  # a look finds nothing: back to the interval
        assert not quiet.done()
        assert group._poll_wait == 0.1
        quiet.cancel()
    finally:
        group.close()
