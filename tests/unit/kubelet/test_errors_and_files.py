"""Go renderings of errors and paths, the start-up socket cleanup, and the JSON view file."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import structlog.testing

from plugvisor.common import constants
from plugvisor.emulators.kubelet import errors, journal, names, registration, view


def make_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(os.fspath(path))


class TestGoStatusError:
    @pytest.mark.parametrize(
        ("code", "details", "expected"),
        [
            (grpc.StatusCode.UNKNOWN, "boom", "rpc error: code = Unknown desc = boom"),
            (grpc.StatusCode.CANCELLED, "x", "rpc error: code = Canceled desc = x"),
            (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "Deadline Exceeded",
                "rpc error: code = DeadlineExceeded desc = context deadline exceeded",
            ),
            (grpc.StatusCode.UNAVAILABLE, "gone", "rpc error: code = Unavailable desc = gone"),
        ],
        ids=["unknown", "canceled-spelled-the-go-way", "client-deadline", "unavailable"],
    )
    def test_renders_like_grpc_go(self, code: grpc.StatusCode, details: str, expected: str) -> None:
        """Status errors read as grpc-go's Error() text."""
        assert errors.go_status_error(code, details) == expected


class TestGoJoin:
    @pytest.mark.parametrize(
        ("directory", "name", "expected"),
        [
            ("/var/lib/kubelet/device-plugins/", "gpu.sock", "/var/lib/kubelet/device-plugins/gpu.sock"),
            ("/d", "/abs/gpu.sock", "/d/abs/gpu.sock"),
            ("/d/e", "../gpu.sock", "/d/gpu.sock"),
            ("/d", "", "/d"),
            ("//d", "x", "/d/x"),
        ],
        ids=["plain", "absolute-name-stays-inside", "dot-dot-is-lexical", "empty-name", "double-slash"],
    )
    def test_joins_like_filepath_join(self, directory: str, name: str, expected: str) -> None:
        """The dial target is computed as Go's filepath.Join computes it."""
        assert errors.go_join(directory, name) == expected


class TestCleanupPluginDirectory:
    def test_removes_only_sockets(self, short_dir: Path) -> None:
        """Sockets go; regular files, directories and the checkpoint stay."""
        make_socket(short_dir / "plugin.sock")
        make_socket(short_dir / constants.KUBELET_SOCKET_NAME)
        (short_dir / constants.CHECKPOINT_NAME).write_text("{}")
        (short_dir / "notes.txt").write_text("keep")
        (short_dir / "sub").mkdir()
        make_socket(short_dir / "sub" / "nested.sock")
        removed = registration.cleanup_plugin_directory(
            short_dir, keep=frozenset({constants.CHECKPOINT_NAME})
        )
        assert sorted(p.name for p in removed) == ["kubelet.sock", "plugin.sock"]
        assert sorted(p.name for p in short_dir.iterdir()) == [constants.CHECKPOINT_NAME, "notes.txt", "sub"]
        assert (short_dir / "sub" / "nested.sock").exists()

    def test_a_link_to_a_socket_is_removed_and_a_dangling_link_is_kept(self, short_dir: Path) -> None:
        """Entries are stat'ed through links, as Go's os.Stat does; unstat-able ones are skipped."""
        target_dir = Path(tempfile.mkdtemp(prefix="/tmp/pvk-"))
        try:
            make_socket(target_dir / "real.sock")
            (short_dir / "link.sock").symlink_to(target_dir / "real.sock")
            (short_dir / "dangling").symlink_to(target_dir / "missing")
            registration.cleanup_plugin_directory(short_dir)
            assert sorted(p.name for p in short_dir.iterdir()) == ["dangling"]
            assert (target_dir / "real.sock").exists()
        finally:
            shutil.rmtree(target_dir, ignore_errors=True)


class TestViewFile:
    def test_default_path_is_beside_the_socket_directory(self) -> None:
        """<DIR>.kubelet.json, outside DIR."""
        assert view.default_view_path(Path("/tmp/pvk-x")) == Path("/tmp/pvk-x.kubelet.json")

    def test_write_replaces_the_file_and_leaves_no_temporary(self, short_dir: Path) -> None:
        """The document lands whole under its name; nothing else is left behind."""
        target = short_dir / "view.json"
        view.write_atomically(target, {"n": 1})
        view.write_atomically(target, {"n": 2})
        assert json.loads(target.read_text()) == {"n": 2}
        assert [p.name for p in short_dir.iterdir()] == ["view.json"]

    async def test_a_burst_of_changes_is_written_once(self, short_dir: Path) -> None:
        """Changes only mark the view dirty; the writer coalesces them."""
        state = {"n": 0}
        writer = view.ViewWriter(short_dir / "view.json", lambda: dict(state))
        writer.start()
        for n in range(1, 51):
            state["n"] = n
            writer.mark_dirty()
        await writer.stop()
        assert json.loads((short_dir / "view.json").read_text()) == {"n": 50}
        assert writer.writes < 50

    async def test_a_view_that_cannot_be_written_is_reported_once_and_the_writer_goes_on(
        self, short_dir: Path
    ) -> None:
        """A full disk or a removed directory loses the view, never the kubelet: the failure is told once
        (not on every change), the writer keeps running, and writes again once the file can be written."""
        blocker = short_dir / "gone"
        blocker.write_text("a file where the view's directory should be")
        failures: list[tuple[Path, OSError]] = []
        state = {"n": 0}
        writer = view.ViewWriter(
            blocker / "view.json", lambda: dict(state), lambda p, e: failures.append((p, e))
        )
        writer.start()
        for n in range(1, 4):
            state["n"] = n
            writer.mark_dirty()
            await writer.settled()
        assert [path for path, _ in failures] == [blocker / "view.json"]
        blocker.unlink()
        state["n"] = 4
        writer.mark_dirty()
        await writer.settled()
        await writer.stop()
        assert json.loads((blocker / "view.json").read_text()) == {"n": 4}


class TestSharedNameRules:
    def test_a_trailing_newline_makes_a_name_invalid(self) -> None:
        """The kubelet rejects "example.com/gpu\\n"; the emulator must too."""
        assert not names.is_extended_resource_name("example.com/gpu\n")


async def test_a_plugin_connection_that_fails_to_close_does_not_stop_the_kubelet_half_way(tmp_path):
    """A dying kubelet's connections end whatever their state: the stop completes, the failure is said."""

    async def close_fails():
        raise RuntimeError("channel already closing")

    async def close_fine():
        return None

    server = registration.RegistrationServer(
        socket_dir=tmp_path, handler=SimpleNamespace(), journal=journal.Journal(), dial_timeout=1.0
    )
    never = asyncio.get_running_loop().create_future()
    failing = SimpleNamespace(resource="example.com/a", socket_path="/x/a.sock", close=close_fails)
    fine = SimpleNamespace(resource="example.com/b", socket_path="/x/b.sock", close=close_fine)
    server._runs = {asyncio.ensure_future(never): failing, asyncio.ensure_future(asyncio.sleep(60)): fine}
    server.clients = {"example.com/a": [failing], "example.com/b": [fine]}
    with structlog.testing.capture_logs() as lines:
        await server.stop()
    assert server.clients == {} and server._runs == {}
    said = [line for line in lines if line["event"] == "plugin connection close failed"]
    assert [(line["resource"], line["err"]) for line in said] == [
        ("example.com/a", "RuntimeError: channel already closing")
    ]
