"""``plugvisor demo``: the whole device-plugin flow on an emulated node, narrated, with timings.

Everything is real except the hardware and the kubelet: each plugin is its own
process serving gRPC on a unix socket, the emulated kubelet applies the real
kubelet's rules, and every figure printed is measured as it happens. Device
"hardware" is a temporary directory of device files (serial adapters and
/dev/fuse), so the demo needs no privileges and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from plugvisor.deviceplugin.logs import configure_logging
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.emulators.kubelet.errors import AllocationError

SERIAL = "demo.plugvisor.io/serial"
FUSE = "demo.plugvisor.io/fuse"
STEP_TIMEOUT = 20.0


@dataclass
class DemoPlugin:
    """One plugin child process."""

    resource: str
    argv: list[str]
    process: asyncio.subprocess.Process | None = None


class Demo:
    """Runs the story step by step; each step prints what happened and how long it took."""

    def __init__(self, workdir: Path, console: Console, *, keep: bool) -> None:
        self.workdir = workdir
        self.console = console
        self.keep = keep
        self.root = workdir / "node"
        self.kubelet_dir = workdir / "device-plugins"
        self.kubelet = EmulatedKubelet(self.kubelet_dir, grace_period=60.0)
        self.plugins: list[DemoPlugin] = []
        self.timings: list[tuple[str, float]] = []

    def _say(self, text: str) -> None:
        self.console.print(text)

    def _step(self, number: int, title: str) -> None:
        self.console.rule(f"[bold]{number}. {title}")

    async def _measure(
        self, label: str, predicate: Callable[[EmulatedKubelet], bool], started: float
    ) -> float:
        await self.kubelet.wait_for(predicate, timeout=STEP_TIMEOUT, what=label)
        elapsed = time.monotonic() - started
        self.timings.append((label, elapsed))
        self._say(f"  [green]done[/green]: {label} in [bold]{elapsed * 1000:.1f} ms[/bold]")
        return elapsed

    def _show_resources(self) -> None:
        table = Table(show_edge=False, header_style="bold")
        for column in ("resource", "capacity", "allocatable", "devices", "plugin socket"):
            table.add_column(column, overflow="fold")
        for name, view in self.kubelet.resources.items():
            devices = " ".join(
                f"{d}{'' if v.health == 'Healthy' else '(unhealthy)'}" for d, v in view.devices.items()
            )
            endpoint = Path(view.endpoint).name if view.endpoint else "-"
            table.add_row(name, str(view.capacity), str(view.allocatable), devices or "-", endpoint)
        self.console.print(table)

    def _make_hardware(self) -> None:
        dev = self.root / "dev"
        dev.mkdir(parents=True)
        for name in ("ttyUSB0", "ttyUSB1", "fuse"):
            (dev / name).touch()

    def _plugin_argv(self, resource: str, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "plugvisor",
            "plugin",
            "generic",
            "--resource",
            resource,
            "--host-root",
            str(self.root),
            "--kubelet-dir",
            str(self.kubelet_dir),
            "--log-level",
            "warning",
            *extra,
        ]

    async def _start_plugin(self, plugin: DemoPlugin) -> None:
        plugin.process = await asyncio.create_subprocess_exec(*plugin.argv, stdin=asyncio.subprocess.DEVNULL)

    def _registered(self, resource: str, count: int) -> Callable[[EmulatedKubelet], bool]:
        def check(kubelet: EmulatedKubelet) -> bool:
            view = kubelet.resource(resource)
            return view is not None and view.registered and view.allocatable == count

        return check

    async def run(self) -> None:
        """Play the story; raises if any step does not happen within its timeout."""
        self._say(f"[bold]plugvisor demo[/bold]: an emulated node in {self.workdir}")
        self._step(1, "Hardware and kubelet")
        self._make_hardware()
        self._say(f"  device files: {', '.join(sorted(p.name for p in (self.root / 'dev').iterdir()))}")
        await self.kubelet.start()
        self._say(f"  emulated kubelet listening on {self.kubelet.socket_path}")

        self._step(2, "Two plugins, one process each, register")
        self.plugins = [
            DemoPlugin(SERIAL, self._plugin_argv(SERIAL, "--path", "/dev/ttyUSB*")),
            DemoPlugin(FUSE, self._plugin_argv(FUSE, "--path", "/dev/fuse", "--count", "4")),
        ]
        started = time.monotonic()
        for plugin in self.plugins:
            await self._start_plugin(plugin)
        await self._measure(
            "both resources registered (process start included)",
            lambda k: self._registered(SERIAL, 2)(k) and self._registered(FUSE, 4)(k),
            started,
        )
        self._show_resources()

        self._step(3, "A pod asks for a serial adapter")
        started = time.monotonic()
        allocation = await self.kubelet.allocate(SERIAL, 1, pod_uid="demo-pod", container="app")
        elapsed = time.monotonic() - started
        self.timings.append(("allocation (GetPreferredAllocation/Allocate)", elapsed))
        assert allocation.response is not None
        nodes = ", ".join(
            f"{d.host_path} -> {d.container_path} ({d.permissions})" for d in allocation.response.devices
        )
        self._say(
            f"  got {list(allocation.device_ids)} in [bold]{elapsed * 1000:.1f} ms[/bold]: "
            f"device nodes {nodes}"
        )
        try:
            await self.kubelet.allocate(SERIAL, 5, pod_uid="greedy-pod", container="app")
        except AllocationError as exc:
            self._say(
                "  a pod asking for 5 is refused as the kubelet would: "
                f"[yellow]{exc.pod_status_message}[/yellow]"
            )

        self._step(4, "Hot-plug: a third adapter appears, then vanishes")
        started = time.monotonic()
        (self.root / "dev" / "ttyUSB2").touch()
        await self._measure(
            "kubelet sees ttyUSB2 (inotify, no polling)", self._registered(SERIAL, 3), started
        )
        started = time.monotonic()
        (self.root / "dev" / "ttyUSB2").unlink()
        await self._measure("kubelet sees it gone", self._registered(SERIAL, 2), started)

        self._step(5, "The kubelet restarts (every socket in its directory is deleted)")
        generation = self.kubelet.generation
        started = time.monotonic()
        await self.kubelet.restart()
        await self._measure(
            "every resource registered again",
            lambda k: (
                k.generation > generation and self._registered(SERIAL, 2)(k) and self._registered(FUSE, 4)(k)
            ),
            started,
        )
        self._show_resources()
        held = self.kubelet.allocated(SERIAL, pod_uid="demo-pod", container="app")
        self._say(f"  the pod still holds {list(held or ())}")

        self._step(6, "Summary")
        for label, seconds in self.timings:
            self._say(f"  {seconds * 1000:8.1f} ms  {label}")
        if self.keep:
            self._say(
                f"\n[bold]--keep[/bold]: still running. View: {self.kubelet.view_path}. "
                "Press Ctrl-C to stop and clean up."
            )
            await asyncio.Event().wait()

    async def close(self) -> None:
        """Stop the plugins (SIGTERM, then SIGKILL after 5 s) and the kubelet."""
        for plugin in self.plugins:
            if plugin.process is not None and plugin.process.returncode is None:
                plugin.process.send_signal(signal.SIGTERM)
        for plugin in self.plugins:
            if plugin.process is not None:
                try:
                    await asyncio.wait_for(plugin.process.wait(), 5)
                except TimeoutError:
                    plugin.process.kill()
                    await plugin.process.wait()
        if self.kubelet.running:
            await self.kubelet.stop()


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="/tmp/pvdemo-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        view = Path(f"{path / 'device-plugins'}.kubelet.json")
        with contextlib.suppress(FileNotFoundError):
            view.unlink()


@click.command("demo")
@click.option("--keep", is_flag=True, help="Leave everything running at the end, until Ctrl-C.")
def demo_command(keep: bool) -> None:
    """Run the device-plugin flow on an emulated node, narrated with measured timings."""
    configure_logging(level="warning")
    console = Console(highlight=False, width=max(100, shutil.get_terminal_size((100, 24)).columns))

    async def main() -> None:
        with _workdir() as workdir:
            demo = Demo(workdir, console, keep=keep)
            task = asyncio.current_task()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, lambda: task.cancel() if task else None)
            try:
                await demo.run()
            except asyncio.CancelledError:
                console.print("\nstopping")
            finally:
                await demo.close()

    asyncio.run(main())
    console.print("cleaned up; bye")
