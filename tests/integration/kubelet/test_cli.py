"""``kubelet_command`` as a real process: SIGHUP restarts like a kubelet, SIGTERM stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugvisor.common import constants

RUN = "from plugvisor.emulators.kubelet.cli import kubelet_command; kubelet_command()"


def make_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(os.fspath(path))


class Kubelet:
    """A running ``kubelet_command`` whose stderr is read line by line."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", RUN, *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[str] = []

    def wait_for_line(self, *fragments: str) -> str:
        """Read stderr until a line contains every fragment; fail if the process ends first."""
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            if all(fragment in line for fragment in fragments):
                return line
        pytest.fail(f"process ended without a line containing {fragments}: {''.join(self.lines)}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)


@pytest.fixture
def cli_kubelet(socket_dir: Path) -> Iterator[Kubelet]:
    running = Kubelet("--dir", str(socket_dir), "--grace-period", "5")
    yield running
    if running.process.poll() is None:
        running.process.kill()
        running.process.wait()


class TestKubeletCommand:
    def test_sighup_restarts_and_sigterm_exits_zero(self, cli_kubelet: Kubelet, socket_dir: Path) -> None:
        """SIGHUP deletes only sockets and serves kubelet.sock again; SIGTERM exits 0."""
        cli_kubelet.wait_for_line("event='started'", "generation=1")
        make_socket(socket_dir / "plugin.sock")
        (socket_dir / "keep.txt").write_text("x")
        (socket_dir / "keep.d").mkdir()
        cli_kubelet.process.send_signal(signal.SIGHUP)
        cli_kubelet.wait_for_line("event='started'", "generation=2")
        assert sorted(p.name for p in socket_dir.iterdir()) == sorted(
            [constants.KUBELET_SOCKET_NAME, "keep.txt", "keep.d"]
        )
        assert any("event='socket_removed'" in line and "plugin.sock" in line for line in cli_kubelet.lines)
        assert cli_kubelet.stop() == 0
        document = json.loads(Path(f"{socket_dir}.kubelet.json").read_text())
        assert document["kubelet"]["generation"] == 2
        assert document["kubelet"]["running"] is False

    def test_sigint_also_exits_zero(self, cli_kubelet: Kubelet) -> None:
        """Ctrl-C is a clean stop."""
        cli_kubelet.wait_for_line("event='started'")
        cli_kubelet.process.send_signal(signal.SIGINT)
        assert cli_kubelet.process.wait(timeout=30) == 0

    @pytest.mark.parametrize(
        ("args", "option"),
        [
            ((), "--dir"),
            (("--dir", "/tmp/x", "--grace-period", "-1"), "--grace-period"),
            (("--dir", "/tmp/" + "d" * 120), "--dir"),
            (("--dir", "/tmp/x", "--feature-gates", "Nope=true"), "--feature-gates"),
            (("--dir", "/tmp/x", "--replacement", "sometimes"), "--replacement"),
            (("--dir", "/tmp/x", "--pods", "/nonexistent/pods"), "'/nonexistent/pods' does not exist"),
            (
                ("--dir", "/tmp/x", "--kubelet-version", "1.20"),
                "'1.20' is not supported: choose one of 1.26, 1.29",
            ),
            (
                (
                    "--dir",
                    "/tmp/x",
                    "--kubelet-version",
                    "1.26",
                    "--feature-gates",
                    "ResourceHealthStatus=true",
                ),
                "unrecognized feature gate: ResourceHealthStatus (kubelet 1.26",
            ),
            (("--dir", "/tmp/x", "--grace-period", "nan"), "--grace-period"),
            (
                ("--dir", "/tmp/x", "--view", "/proc/self/nope/view.json"),
                "'--view': /proc/self/nope/view.json",
            ),
            (("--dir", "/tmp/x", "--pods-view", "/proc/self/nope/pods.json"), "'--pods-view'"),
            (("--dir", "/tmp/x", "--node-name", "Bad_Name!"), "'--node-name': 'bad_name!': a lowercase RFC"),
            (("--dir", "/tmp/x", "--node-name", "  "), "'--node-name': empty"),
        ],
        ids=[
            "missing-dir",
            "negative-grace",
            "socket-path-too-long",
            "unknown-gate",
            "bad-replacement",
            "pods-dir-missing",
            "unknown-version",
            "gate-too-new-for-the-version",
            "nan-grace",
            "view-unwritable",
            "pods-view-unwritable",
            "node-name-not-a-subdomain",
            "node-name-empty",
        ],
    )
    def test_bad_usage_exits_2_naming_the_option(self, args: tuple[str, ...], option: str) -> None:
        """Usage errors are exit status 2 with the option in the message."""
        result = subprocess.run(
            [sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 2
        assert option in result.stderr


class TestPodsDirectory:
    def test_a_manifest_dropped_in_runs_and_its_status_is_written(self, socket_dir: Path) -> None:
        """--pods makes a node: the pod is admitted, started, and shown in <DIR>.pods.json."""
        pods_dir = socket_dir / "pods"
        pods_dir.mkdir()
        kubelet = Kubelet("--dir", str(socket_dir / "dp"), "--pods", str(pods_dir), "--node-name", "n1")
        try:
            kubelet.wait_for_line("event='started'")
            (pods_dir / "web.yaml").write_text(
                "apiVersion: v1\nkind: Pod\nmetadata: {name: web}\n"
                "spec:\n  containers: [{name: c, image: nginx}]\n"
            )
            kubelet.wait_for_line("event='container_started'", "default/web-n1/c")
            (pods_dir / "bad.yaml").write_text("kind: Service\n")
            kubelet.wait_for_line("event='pod_invalid'", "not a Pod")
            assert kubelet.stop() == 0
            document = json.loads(Path(f"{socket_dir}/dp.pods.json").read_text())
            assert [(p["metadata"]["name"], p["status"]["phase"]) for p in document["pods"]] == [
                ("web-n1", "Running")
            ]
        finally:
            if kubelet.process.poll() is None:
                kubelet.process.kill()
                kubelet.process.wait()


@pytest.fixture
def pods_kubelet(socket_dir: Path) -> Iterator[tuple[Kubelet, Path]]:
    """A kubelet with a --pods directory, started; killed at the end if the test did not stop it."""
    pods_dir = socket_dir / "pods"
    pods_dir.mkdir()
    kubelet = Kubelet("--dir", str(socket_dir / "dp"), "--pods", str(pods_dir), "--node-name", "n1")
    kubelet.wait_for_line("event='started'")
    yield kubelet, pods_dir
    if kubelet.process.poll() is None:
        kubelet.process.kill()
        kubelet.process.wait()


class TestAnIntegerTooLongToConvert:
    def test_is_a_pod_invalid_naming_the_field_and_the_node_goes_on(self, pods_kubelet) -> None:
        """5,000 digits (beyond Python's int-str limit): it used to end the emulated kubelet."""
        kubelet, pods_dir = pods_kubelet
        (pods_dir / "huge.yaml").write_text(
            "apiVersion: v1\nkind: Pod\nmetadata: {name: huge}\nspec:\n  containers:\n"
            f"  - {{name: c, image: i, resources: {{limits: {{example.com/good: {'9' * 5000}}}}}}}\n"
        )
        line = kubelet.wait_for_line("event='pod_invalid'")
        assert "limits.example.com/good: line 6, column 64: an integer of 5000 digits" in line
        (pods_dir / "web.yaml").write_text(
            "apiVersion: v1\nkind: Pod\nmetadata: {name: web}\nspec:\n  containers: [{name: c, image: i}]\n"
        )
        kubelet.wait_for_line("event='container_started'", "default/web-n1/c")
        assert kubelet.stop() == 0


class TestANegativeExtendedResourceLimit:
    def test_is_refused_at_validation_and_the_node_goes_on(self, socket_dir: Path) -> None:
        """All versions: refused with the API's text, later pods are admitted, SIGTERM exits 0 quietly."""
        pods_dir = socket_dir / "pods"
        pods_dir.mkdir()
        kubelet = Kubelet("--dir", str(socket_dir / "dp"), "--pods", str(pods_dir), "--node-name", "n1")
        try:
            kubelet.wait_for_line("event='started'")
            (pods_dir / "neg.yaml").write_text(
                "apiVersion: v1\nkind: Pod\nmetadata: {name: neg}\nspec:\n  containers:\n"
                "  - {name: c, image: i, resources: {limits: {example.com/good: -1}}}\n"
            )
            line = kubelet.wait_for_line("event='pod_invalid'")
            assert 'limits[example.com/good]: Invalid value: "-1": must be greater than or equal to 0' in line
            (pods_dir / "web.yaml").write_text(
                "apiVersion: v1\nkind: Pod\nmetadata: {name: web}\nspec:\n"
                "  containers: [{name: c, image: i}]\n"
            )
            kubelet.wait_for_line("event='container_started'", "default/web-n1/c")
            assert kubelet.stop() == 0
            assert kubelet.process.stderr is not None
            rest = kubelet.process.stderr.read()
            assert "Traceback" not in "".join(kubelet.lines) + rest
        finally:
            if kubelet.process.poll() is None:
                kubelet.process.kill()
                kubelet.process.wait()
