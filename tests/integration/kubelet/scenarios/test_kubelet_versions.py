"""Where kubelet releases differ, and where the emulator used to differ from every release.

Each test names the kubelet versions it applies to (``--kubelet-version``). The
differences were found by running the emulator beside a real v1.26.1 kubelet with
the same plugin and pods; the newer behaviour comes from the upstream changes named
in :mod:`plugvisor.emulators.kubelet.versions`.
"""

from __future__ import annotations

import os

import pytest

from plugvisor.emulators.kubelet import EventKind, checkpoint
from plugvisor.emulators.kubelet.pods import ContainerState, PodPhase

from .conftest import RESOURCE, Node, busybox_pod, static

LIMIT = f"resources: {{limits: {{{RESOURCE}: 1}}}}"


def init_and_app_pod(name: str) -> str:
    """A pod whose regular init container holds a device it hands on to the app container."""
    return (
        f"apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  initContainers:\n"
        f"  - {{name: init, image: busybox, {LIMIT}}}\n"
        f"  containers:\n  - {{name: app, image: busybox, {LIMIT}}}\n"
    )


async def run_pod(node: Node, name: str, text: str) -> None:
    (node.pods_dir / f"{name}.yaml").write_text(text)
    await node.kubelet.wait_for(
        lambda k: (p := k.pod(static(name))) is not None and p.phase is not PodPhase.PENDING,
        what=f"pod {name} admitted or rejected",
    )


class TestInitContainerDevicesAcrossARestart:
    """A running pod whose init container held devices; the kubelet restarts while the plugin is down."""

    async def test_kubelet_1_26_keeps_the_pod_running(self, make_node) -> None:
        """1.26: the init container already holds its device, so nothing is checked."""
        async with make_node(kubelet_version="1.26") as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await run_pod(node, "p", init_and_app_pod("p"))
            await node.stop_plugin()
            await node.kubelet.restart()
            status = node.kubelet.pod(static("p"))
            assert status is not None and status.phase is PodPhase.RUNNING
            assert status.container("app").state is ContainerState.RUNNING

    @pytest.mark.parametrize("version", ["1.29", "1.35"])
    async def test_later_kubelets_reject_it_and_kill_its_containers(self, make_node, version) -> None:
        """1.29, 1.35 (kubernetes#116376): rejected; a rejected pod's running containers are killed."""
        async with make_node(kubelet_version=version) as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await run_pod(node, "p", init_and_app_pod("p"))
            await node.stop_plugin()
            await node.kubelet.restart()
            status = node.kubelet.pod(static("p"))
            assert status is not None and (status.phase, status.reason) == (
                PodPhase.FAILED,
                "UnexpectedAdmissionError",
            )
            assert status.message == (
                "Pod was rejected: Allocate failed due to no healthy devices present; "
                f"cannot allocate unhealthy devices {RESOURCE}, which is unexpected"
            )
            app = status.container("app")
            assert (app.state, app.exit_code) == (ContainerState.TERMINATED, 137)


class TestANewPodWhileThePluginIsDownAfterARestart:
    @pytest.mark.parametrize(
        ("version", "error"),
        [
            ("1.26", f"requested number of devices unavailable for {RESOURCE}. Requested: 1, Available: 0"),
            ("1.29", f"no healthy devices present; cannot allocate unhealthy devices {RESOURCE}"),
            ("1.35", f"no healthy devices present; cannot allocate unhealthy devices {RESOURCE}"),
        ],
    )
    async def test_the_rejection_names_the_releases_check(self, make_node, version, error) -> None:
        async with make_node(kubelet_version=version) as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await node.stop_plugin()
            await node.kubelet.restart()
            await run_pod(node, "late", busybox_pod("late"))
            status = node.kubelet.pod(static("late"))
            assert status is not None and status.phase is PodPhase.FAILED
            assert status.message == f"Pod was rejected: Allocate failed due to {error}, which is unexpected"


class TestANeverAdmittedPodsCheckpointEntries:
    """A pod rejected half-way (its first container got a device) is deleted; what stays in the file?"""

    PARTLY = (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: partly}\nspec:\n  containers:\n"
        f"  - {{name: first, image: busybox, {LIMIT}}}\n"
        f"  - {{name: greedy, image: busybox, resources: {{limits: {{{RESOURCE}: 5}}}}}}\n"
    )

    async def entries_after_deletion(self, node: Node) -> list[str]:
        node.start_plugin()
        await node.wait_counts(2, 2)
        await run_pod(node, "partly", self.PARTLY)
        assert node.kubelet.pod(static("partly")).phase is PodPhase.FAILED  # type: ignore[union-attr]
        (node.pods_dir / "partly.yaml").unlink()
        await node.kubelet.wait_for(lambda k: k.pod(static("partly")) is None, what="pod deleted")
        node.kubelet.update_allocated_devices()
        node.kubelet.write_checkpoint()
        entries = checkpoint.read(node.kubelet.checkpoint_path).pod_device_entries or []
        return [entry.container_name for entry in entries]

    @pytest.mark.parametrize("version", ["1.26", "1.29"])
    async def test_up_to_1_31_they_stay_until_another_pod_is_admitted(self, make_node, version) -> None:
        """1.26, 1.29 (kubernetes#103979): the last pod through admission counts as active."""
        async with make_node(kubelet_version=version) as node:
            assert await self.entries_after_deletion(node) == ["first"]

    async def test_kubelet_1_35_drops_them(self, make_node) -> None:
        """1.35 (kubernetes#127506 removed the pending-admission pod)."""
        async with make_node(kubelet_version="1.35") as node:
            assert await self.entries_after_deletion(node) == []


class TestStartOrder:
    @pytest.mark.parametrize("version", ["1.29", "1.35"])
    async def test_a_plugin_that_re_registers_at_once_is_in_time_for_the_pods(
        self, make_node, version
    ) -> None:
        """All versions serve Register before pods are delivered (1.26 would keep this pod anyway).

        The delay between the two is widened here so that the order, not the speed
        of a loaded test machine, decides.
        """
        async with make_node(kubelet_version=version, pod_sources_delay=2.0) as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await run_pod(node, "p", init_and_app_pod("p"))
            await node.kubelet.restart()
            status = node.kubelet.pod(static("p"))
            assert status is not None and status.phase is PodPhase.RUNNING
            second = [e.kind for e in node.kubelet.events if e.generation == 2]
            assert second.index(EventKind.REGISTERED) < second.index(EventKind.ALLOCATED)


class TestKubeletSocketAtStop:
    async def test_a_stopped_kubelet_leaves_its_socket_and_the_next_start_removes_it(self, make_node) -> None:
        """All versions: a dying kubelet does not clean up; the next start's directory cleanup does."""
        async with make_node() as node:
            await node.kubelet.stop()
            assert node.kubelet.socket_path.is_socket()
            await node.kubelet.start()
            removed = [
                e.fields.get("path")
                for e in node.kubelet.events
                if e.kind is EventKind.SOCKET_REMOVED and e.generation == 2
            ]
            assert removed == [os.fspath(node.kubelet.socket_path)]
            assert node.kubelet.socket_path.is_socket()
