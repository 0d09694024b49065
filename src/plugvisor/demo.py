"""``plugvisor demo``: a whole emulated node, start to finish, narrated with measured timings.

Everything is real except the hardware and the kubelet. The hardware lab writes
a ``dgx-like`` tree (8 GPUs two per PCIe switch on two NUMA nodes, FPGAs, SR-IOV
NICs), with AMD Instinct-like GPUs because their driver reports temperatures
through hwmon (NVIDIA's exposes none in sysfs); the emulated kubelet applies the
real kubelet's rules; ``plugvisor run`` supervises one plugin process per
resource, each serving gRPC on its own unix socket. The story: devices appear, a
pod asks for two GPUs and gets a switch-local pair, a GPU faults and heals, one of
the pod's GPUs overheats and the agent's /metrics shows it with the pod's name, a
plugin process is SIGKILLed, the kubelet restarts, VFs are added. Every figure
printed is measured as it happens. Nothing needs privileges and nothing is left
behind. ``--pace SECONDS`` pauses after each step, for a presenter.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

import click
import yaml

from plugvisor.common import extras, monitoring
from plugvisor.common.logs import configure_logging
from plugvisor.emulators import lab as lab_
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.emulators.lab.profiles import GpuGroup, builtin
from plugvisor.supervisor import status as status_

try:
    from rich.console import Console, Group, RenderableType
    from rich.live import Live
    from rich.table import Table
    from rich.text import Text
except ModuleNotFoundError as missing:  # a node's install: see plugvisor.common.extras
    raise extras.MissingExtraError("the demo", extras.EMULATORS, missing) from None

GPU: Final = "plugvisor.io/gpu"
NIC: Final = "plugvisor.io/nic"
FPGA: Final = "plugvisor.io/fpga"
FUSE: Final = "plugvisor.io/fuse"
STEP_TIMEOUT: Final = 30.0
REFRESH_SECONDS: Final = 0.2
MONITOR_INTERVAL: Final = 0.25
"""Seconds between PodResources polls and telemetry samples: fast, so the story need not wait
(the agent's defaults are 5 and 10)."""


VIEW_PRIORITY: Final = (0, 2, 1, 3)
"""Which tables of the live view stay when the terminal is short: the node's resources (the allocatable
drop), the GPUs (health, owner, temperature), the agent's children, the pods."""
MIN_LOG_LINES: Final = 5
MAX_LOG_LINES: Final = 14


def fit_view(
    console: Console, sections: Sequence[RenderableType], log: Sequence[Text], *, priority: Sequence[int]
) -> Group:
    """The tables that fit the console's height, in their order, then the newest narration lines.

    A live view taller than the terminal loses its bottom (rich crops it), and
    one wider wraps every line: an 80x24 terminal never showed the allocatable
    drop. Each table is measured at the console's width; tables are taken in
    ``priority`` order while :data:`MIN_LOG_LINES` of narration still fit,
    and the narration gets the rest (at most :data:`MAX_LOG_LINES`), newest
    last. One line is left for the live display's cursor.
    """
    options = console.options
    budget = console.size.height - 1
    heights = [len(console.render_lines(section, options, pad=False)) for section in sections]
    chosen: set[int] = set()
    used = 0
    for index in priority:
        if used + heights[index] + MIN_LOG_LINES <= budget:
            chosen.add(index)
            used += heights[index]
    room = min(MAX_LOG_LINES, budget - used)
    shown: list[Text] = []
    for line in reversed(log):
        lines = len(console.render_lines(line, options, pad=False))
        if lines > room:
            break
        shown.insert(0, line)
        room -= lines
    return Group(
        *(section for index, section in enumerate(sections) if index in chosen), Text("\n").join(shown)
    )


@dataclass
class Timing:
    """One measured step."""

    label: str
    seconds: float


@dataclass
class Node:
    """Where the emulated node lives: the lab root, the kubelet's directory, the agent's files."""

    workdir: Path
    lab_root: Path
    kubelet_dir: Path = field(init=False)
    runtime_dir: Path = field(init=False)
    config: Path = field(init=False)
    agent_log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.kubelet_dir = self.workdir / "device-plugins"
        self.runtime_dir = self.workdir / "run"
        self.config = self.workdir / "node.yaml"
        self.agent_log = self.workdir / "agent.log"


class Demo:
    """Plays the story; each step narrates what happened and how long recovery took."""

    def __init__(self, node: Node, console: Console, *, keep: bool, pace: float = 0.0) -> None:
        self.node = node
        self.console = console
        self.keep = keep
        self.pace = pace
        self.kubelet = EmulatedKubelet(node.kubelet_dir, grace_period=60.0)
        self.lab: lab_.Lab | None = None
        self.agent: asyncio.subprocess.Process | None = None
        self.timings: list[Timing] = []
        self.log: list[Text] = []
        self.resources: dict[str, int] = {}
        self.live: Live | None = None
        self._agent_log: IO[bytes] | None = None

    # -- narration and the live view ------------------------------------------------

    def _say(self, text: str, *, style: str = "") -> None:
        line = Text.from_markup(text, style=style)
        self.log.append(line)
        if self.live is None:
            self.console.print(line)

    def _step(self, number: int, title: str) -> None:
        if self.live is None:
            self.console.rule(f"[bold]{number}. {title}")
        else:
            self.log.append(Text(f"{number}. {title}", style="bold cyan"))

    def _children(self) -> dict[str, dict[str, Any]]:
        try:
            document = status_.read_state(self.node.runtime_dir)
        except (status_.NoAgentError, OSError, ValueError):
            return {}
        return {child["resource"]: child for child in document.get("children", [])}

    def _resource_table(self) -> Table:
        table = Table(title="kubelet: node resources", show_edge=False, header_style="bold", expand=True)
        for column in ("resource", "capacity", "allocatable", "unhealthy"):
            table.add_column(column, overflow="fold")
        for name, view in self.kubelet.resources.items():
            sick = sorted(view.unhealthy_ids)
            table.add_row(name, str(view.capacity), str(view.allocatable), " ".join(sick[:3]) or "-")
        return table

    def _children_table(self) -> Table:
        table = Table(title="plugvisor run: children", show_edge=False, header_style="bold", expand=True)
        for column in ("resource", "state", "pid", "restarts", "devices"):
            table.add_column(column)
        for name, child in sorted(self._children().items()):
            devices = child.get("devices") or {}
            shown = f"{devices.get('healthy', '?')}/{devices.get('total', '?')}" if devices else "-"
            causes = ", ".join(f"{k} {v}" for k, v in (child.get("restarts_by_cause") or {}).items())
            restarts = f"{child.get('restarts', 0)}" + (f" ({causes})" if causes else "")
            table.add_row(name, str(child.get("state")), str(child.get("pid")), restarts, shown)
        return table

    def _pods_table(self) -> Table:
        table = Table(title="kubelet: pods", show_edge=False, header_style="bold", expand=True)
        for column in ("pod", "phase", "devices"):
            table.add_column(column, overflow="fold")
        for pod in self.kubelet.pods:
            held = {r: ids for c in pod.containers for r, ids in c.devices.items()}
            shown = "; ".join(f"{r}: {' '.join(ids)}" for r, ids in held.items()) or "-"
            table.add_row(pod.name, str(pod.phase), shown)
        return table

    def _gpu_rows(self) -> list[tuple[str, str, str, str, str, str]]:
        """Per GPU: lab name, device ID, health (cause), holder, temperatures, alerts: the agent's files."""
        monitor_dir = self.node.runtime_dir / status_.MONITOR_DIR
        report = monitoring.read_report(monitor_dir, GPU)
        if report is None or self.lab is None:
            return []
        owners = monitoring.read_owners(monitor_dir)
        holders = owners.holders if owners is not None else {}
        names = {key: record.name for key, record in self._gpu_names().items()}
        rows = []
        for device in report.devices:
            held = ", ".join(
                f"{h.namespace}/{h.pod}/{h.container}" for h in holders.get((GPU, device.id), ())
            )
            temperatures = _by_sensor(device.description.readings, "plugvisor_device_temperature_celsius")
            shown = " ".join(
                f"{sensor} {value:.0f}°C"
                for sensor, value in temperatures.items()
                if sensor in ("edge", "junction")
            )
            health = "healthy" if device.healthy else f"unhealthy ({device.description.cause_code})"
            alerts = ", ".join(_alerts(device.description.readings)) or "-"
            rows.append((names.get(device.id, "?"), device.id, health, held or "-", shown or "-", alerts))
        return rows

    def _gpu_table(self) -> Table:
        table = Table(
            title="GPUs: owner, temperature and alerts (from the agent; alerts: deploy/monitoring's rules)",
            show_edge=False,
            header_style="bold",
            expand=True,
        )
        for column in ("gpu", "device", "health", "held by", "temperature", "alerts"):
            table.add_column(column, overflow="fold")
        for row in self._gpu_rows():
            table.add_row(*row)
        return table

    def _view(self) -> Group:
        """The live view, fitted to the terminal's height (see :func:`fit_view`)."""
        sections = [self._resource_table(), self._children_table(), self._gpu_table(), self._pods_table()]
        return fit_view(self.console, sections, self.log, priority=VIEW_PRIORITY)

    async def _refresh(self) -> None:
        while self.live is not None:
            self.live.update(self._view(), refresh=True)
            await asyncio.sleep(REFRESH_SECONDS)

    # -- helpers ----------------------------------------------------------------------

    async def _measure(
        self, label: str, predicate: Callable[[EmulatedKubelet], bool], started: float
    ) -> float:
        await self.kubelet.wait_for(predicate, timeout=STEP_TIMEOUT, what=label)
        elapsed = time.monotonic() - started
        self.timings.append(Timing(label, elapsed))
        self._say(f"  [green]done[/green]: {label} in [bold]{elapsed * 1000:.1f} ms[/bold]")
        return elapsed

    def _allocatable(self, resource: str, count: int) -> Callable[[EmulatedKubelet], bool]:
        def check(kubelet: EmulatedKubelet) -> bool:
            view = kubelet.resource(resource)
            return view is not None and view.registered and view.allocatable == count

        return check

    def _all_registered(self, kubelet: EmulatedKubelet) -> bool:
        return all(self._allocatable(name, count)(kubelet) for name, count in self.resources.items())

    def _write_config(self, nic_pf: str) -> None:
        resources: list[dict[str, Any]] = [
            {"name": GPU, "kind": "gpu"},
            {"name": NIC, "kind": "nic", "match": {"pfNames": [nic_pf]}},
            {"name": FPGA, "kind": "fpga", "family": "af"},
            {"name": FUSE, "kind": "generic", "paths": ["/dev/fuse"], "count": 4},
        ]
        config = {
            "kubeletDir": str(self.node.kubelet_dir),
            "hostRoot": str(self.node.lab_root),
            "supervisor": {"runtimeDir": str(self.node.runtime_dir), "stopTimeout": 3},
            "metrics": {"listen": "127.0.0.1:0"},
            "monitoring": {"podResourcesInterval": MONITOR_INTERVAL, "telemetryInterval": MONITOR_INTERVAL},
            "resources": resources,
        }
        self.node.config.write_text(yaml.safe_dump(config, sort_keys=False))

    def _gpu_names(self) -> dict[str, lab_.DeviceRecord]:
        """GPU device IDs (as the plugin reports them: UUIDs or PCI addresses) mapped to the lab's records."""
        assert self.lab is not None
        by_id: dict[str, lab_.DeviceRecord] = {}
        for record in self.lab.devices(kind=lab_.DeviceKind.GPU):
            by_id[record.bdf] = record  # AMD- and Intel-like GPUs: the PCI address
            if record.uuid:
                by_id[record.uuid] = record  # NVIDIA-like GPUs: the UUID the driver reports
        return by_id

    # -- the story --------------------------------------------------------------------

    async def run(self) -> None:
        """Play the story; raises if any step does not happen within its timeout."""
        gpus = await self._hardware()
        await self._pause()
        await self._agent()
        await self._pause()
        held = await self._pod()
        await self._pause()
        victim = await self._gpu_fault(gpus, held)
        await self._pause()
        await self._gpu_recovers(victim, len(gpus))
        await self._pause()
        hot = await self._overheat(held)
        await self._pause()
        await self._cool_down(hot)
        await self._pause()
        await self._kill_child(len(gpus), len(held))
        await self._pause()
        await self._kubelet_restart()
        await self._pause()
        await self._more_vfs()
        await self._pause()
        await self._summary()

    async def _pause(self) -> None:
        """``--pace``: give the audience time to read the step (the default, 0, keeps the story fast).

        Each step returns only once its outcome is in what the view shows (the kubelet's
        state and the agent's files), so the pause always shows it. Without the live view
        the pause prints what it would show: the node's resources and the GPUs.
        """
        if self.pace > 0:
            if self.live is None:
                self.console.print(Text("on screen:", style="dim"), self._resource_table(), self._gpu_table())
            await asyncio.sleep(self.pace)

    async def _shown(self, what: str, check: Callable[[Sequence[tuple[str, ...]]], bool]) -> None:
        """Wait until the GPU table (the agent's report and owners files) satisfies ``check``."""
        deadline = time.monotonic() + STEP_TIMEOUT
        while not check(self._gpu_rows()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the agent's view never showed {what}")
            await asyncio.sleep(0.05)

    async def _hardware(self) -> list[lab_.DeviceRecord]:
        self._step(1, "Hardware: an emulated dgx-like node with AMD Instinct-like GPUs")
        started = time.monotonic()
        profile = builtin("dgx-like")
        profile = profile.model_copy(
            update={
                "name": "dgx-like-amd",
                "gpus": [GpuGroup(model="amd-mi300x", count=8, per_switch=2)],  # hwmon temperatures
            }
        )
        self.lab = await asyncio.to_thread(lab_.Lab.create, self.node.lab_root, profile)
        (self.node.lab_root / "dev" / "fuse").touch()
        records = self.lab.devices()
        self.timings.append(Timing("lab created (sys/, dev/, proc/)", time.monotonic() - started))
        gpus = [r for r in records if r.kind is lab_.DeviceKind.GPU]
        nic0 = self.lab.device("nic0")
        self._say(
            f"  {len(gpus)} GPUs on {len({r.pcie_switch for r in gpus})} PCIe switches and "
            f"{len({r.numa_node for r in gpus})} NUMA nodes, "
            f"{sum(r.kind is lab_.DeviceKind.FPGA for r in records)} FPGAs, "
            f"NIC {nic0.netdev} with {nic0.num_vfs} VFs, in {self.node.lab_root}"
        )
        dfl_ports = sum(r.kind is lab_.DeviceKind.FPGA and r.vendor == "0x8086" for r in records)
        self.resources = {GPU: len(gpus), NIC: nic0.num_vfs or 0, FPGA: dfl_ports, FUSE: 4}
        assert nic0.netdev is not None
        self._write_config(nic0.netdev)
        return gpus

    async def _agent(self) -> None:
        self._step(2, "The kubelet and the agent: one plugin process per resource")
        await self.kubelet.start()
        self._agent_log = self.node.agent_log.open("wb")
        started = time.monotonic()
        self.agent = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "plugvisor",
            "run",
            "--config",
            str(self.node.config),
            "--log-level",
            "info",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=self._agent_log,
        )
        await self._measure("agent start -> every resource registered", self._all_registered, started)
        for name, child in sorted(self._children().items()):
            devices = child.get("devices") or {}
            self._say(
                f"  {name}: pid {child.get('pid')}, {devices.get('healthy')}/{devices.get('total')} devices, "
                f"socket {child.get('endpoint')}"
            )

    async def _pod(self) -> tuple[str, ...]:
        self._step(3, "A pod asks for two GPUs")
        started = time.monotonic()
        pod = await self.kubelet.add_pod(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "trainer", "namespace": "default"},
                "spec": {
                    "containers": [
                        {"name": "train", "image": "example/train", "resources": {"limits": {GPU: "2"}}}
                    ]
                },
            }
        )
        self.timings.append(
            Timing("pod admitted (GetPreferredAllocation + Allocate)", time.monotonic() - started)
        )
        held = pod.container("train").devices.get(GPU, ())
        names = self._gpu_names()
        placed = [names[i] for i in held if i in names]
        switches = sorted({str(r.pcie_switch) for r in placed})
        where = f"both under PCIe switch {switches[0]}" if len(switches) == 1 else f"switches {switches}"
        self._say(f"  pod {pod.name} is {pod.phase}: {' + '.join(r.name for r in placed)} ({where})")
        await self._shown(
            "the pod holding its GPUs",
            lambda rows: all(_row(rows, r.name)[3] == "default/trainer/train" for r in placed),
        )
        return held

    async def _gpu_fault(self, gpus: list[lab_.DeviceRecord], held: tuple[str, ...]) -> lab_.DeviceRecord:
        assert self.lab is not None
        self._step(4, "A GPU fails: an AER fatal error")
        victim = next(r for r in gpus if r.bdf not in held and r.uuid not in held)
        started = time.monotonic()
        await asyncio.to_thread(self.lab.fault, victim.name, "aer-fatal")
        await self._measure(
            f"{victim.name} unhealthy: allocatable {len(gpus) - 1}",
            self._allocatable(GPU, len(gpus) - 1),
            started,
        )
        await self._shown(
            f"{victim.name} unhealthy", lambda rows: _row(rows, victim.name)[2] == "unhealthy (aer-fatal)"
        )
        self._say(f"  the agent: {victim.name} unhealthy (aer-fatal), alert PlugvisorAerFatalErrors")
        return victim

    async def _gpu_recovers(self, victim: lab_.DeviceRecord, gpu_count: int) -> None:
        assert self.lab is not None
        self._step(5, f"{victim.name} recovers (the fault is healed)")
        started = time.monotonic()
        await asyncio.to_thread(self.lab.heal, victim.name)
        await self._measure(
            f"{victim.name} healthy again: allocatable {gpu_count}",
            self._allocatable(GPU, gpu_count),
            started,
        )
        await self._shown(f"{victim.name} healthy", lambda rows: _row(rows, victim.name)[2] == "healthy")

    def _scrape(self) -> str:
        log = self.node.agent_log.read_text(errors="replace")
        address = log.split("event='metrics_listening' url='http://", 1)[1].split("/", 1)[0]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
            text: str = response.read().decode()
        return text

    async def _overheat(self, held: tuple[str, ...]) -> lab_.DeviceRecord:
        assert self.lab is not None
        self._step(6, "A GPU the pod holds overheats; the agent's /metrics names the pod")
        names = self._gpu_names()
        victim = names[held[0]]
        wanted = (f'device="{victim.bdf}"', 'pod="trainer"', 'sensor="junction"')
        started = time.monotonic()
        await asyncio.to_thread(self.lab.fault, victim.name, "overheat")
        deadline = started + STEP_TIMEOUT
        while True:
            text = await asyncio.to_thread(self._scrape)
            hot = [
                line
                for line in text.splitlines()
                if line.startswith("plugvisor_device_temperature_celsius{") and all(w in line for w in wanted)
            ]
            if hot and float(hot[0].rsplit(" ", 1)[1]) >= 110.0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{victim.name}'s temperature did not rise in /metrics")
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - started
        self.timings.append(Timing(f"{victim.name} overheat -> in /metrics with its pod", elapsed))
        self._say(
            f"  [green]done[/green]: {victim.name} overheat -> in /metrics with its pod in "
            f"[bold]{elapsed * 1000:.1f} ms[/bold]"
        )
        value = float(hot[0].rsplit(" ", 1)[1])
        self._say(
            f"  /metrics: {victim.name} junction {value:.0f} °C (critical 110), pod default/trainer/train"
        )
        await self._shown(
            f"{victim.name} at its critical temperature",
            lambda rows: "TemperatureCritical" in _row(rows, victim.name)[5],
        )
        self._say(f"  the agent: alert PlugvisorDeviceTemperatureCritical on {victim.name}, held by the pod")
        return victim

    async def _cool_down(self, victim: lab_.DeviceRecord) -> None:
        assert self.lab is not None
        self._step(7, f"{victim.name} cools down (the fault is healed)")
        started = time.monotonic()
        await asyncio.to_thread(self.lab.heal, victim.name)
        await self._shown(
            f"{victim.name} below its critical temperature",
            lambda rows: "TemperatureCritical" not in _row(rows, victim.name)[5],
        )
        elapsed = time.monotonic() - started
        self.timings.append(Timing(f"{victim.name} cooled down -> alert condition clear", elapsed))
        self._say(
            f"  [green]done[/green]: {victim.name} below critical in [bold]{elapsed * 1000:.1f} ms[/bold]"
        )

    async def _kill_child(self, gpu_count: int, held: int) -> None:
        self._step(8, "The gpu plugin process is killed (SIGKILL)")
        child = self._children()[GPU]
        view = self.kubelet.resource(GPU)
        endpoint = view.endpoint if view is not None else None

        def back(kubelet: EmulatedKubelet) -> bool:
            now = kubelet.resource(GPU)
            return self._allocatable(GPU, gpu_count)(kubelet) and now is not None and now.endpoint != endpoint

        started = time.monotonic()
        os.kill(int(child["pid"]), signal.SIGKILL)
        await self._measure("killed child -> registered again on a new socket", back, started)
        self._say(f"  the other resources kept their processes; the pod still holds {held} GPUs")

    async def _kubelet_restart(self) -> None:
        self._step(9, "The kubelet restarts (every socket in its directory is deleted)")
        generation = self.kubelet.generation
        started = time.monotonic()
        await self.kubelet.restart()
        await self._measure(
            "kubelet restart -> every resource registered again",
            lambda k: k.generation > generation and self._all_registered(k),
            started,
        )

    async def _more_vfs(self) -> None:
        assert self.lab is not None
        self._step(10, "More VFs: sriov_numvfs 8 -> 0 -> 16")
        started = time.monotonic()
        await asyncio.to_thread(self.lab.set_num_vfs, "nic0", 0)
        await asyncio.to_thread(self.lab.set_num_vfs, "nic0", 16)
        self.resources[NIC] = 16
        await self._measure("16 VFs advertised, no restart", self._allocatable(NIC, 16), started)

    async def _summary(self) -> None:
        self._step(11, "Summary")
        for timing in self.timings:
            self._say(f"  {timing.seconds * 1000:8.1f} ms  {timing.label}")
        if self.keep:
            self._say(
                f"--keep: still running. Lab: {self.node.lab_root}; config: {self.node.config}; "
                f"kubelet view: {self.kubelet.view_path}. Ctrl-C stops and cleans up."
            )
            await asyncio.Event().wait()

    async def close(self) -> None:
        """Stop the agent (SIGTERM; it stops its children) and the kubelet."""
        if self.agent is not None and self.agent.returncode is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.agent.wait(), 15)
            except TimeoutError:
                self.agent.kill()
                await self.agent.wait()
        if self.kubelet.running:
            await self.kubelet.stop()
        if self._agent_log is not None:
            self._agent_log.close()

    def agent_log_tail(self, lines: int = 30) -> str:
        """The end of the agent's log (its children's lines included), for a step that failed."""
        try:
            text = self.node.agent_log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _by_sensor(readings: Iterable[monitoring.Reading], family: str) -> dict[str, float]:
    return {r.labels["sensor"]: r.value for r in readings if r.family == family}


def _alerts(readings: Sequence[monitoring.Reading]) -> list[str]:
    """The alerts of deploy/monitoring's PrometheusRule whose conditions hold for one device's readings."""
    found = []
    fatal = [
        r.value
        for r in readings
        if r.family == "plugvisor_device_aer_errors" and r.labels["severity"] == "fatal"
    ]
    if any(fatal):
        found.append(f"AerFatalErrors ({int(max(fatal))})")
    critical = _by_sensor(readings, "plugvisor_device_temperature_critical_celsius")
    hot = [
        sensor
        for sensor, value in _by_sensor(readings, "plugvisor_device_temperature_celsius").items()
        if sensor in critical and value >= critical[sensor] - 5
    ]
    if hot:
        found.append(f"TemperatureCritical ({', '.join(hot)})")
    return found


def _row(rows: Sequence[tuple[str, ...]], gpu: str) -> tuple[str, ...]:
    """The GPU table's row of the lab's ``gpu`` (empty cells while the agent has not reported it)."""
    return next((row for row in rows if row[0] == gpu), ("",) * 6)


def _scratch_parent() -> str:
    """Memory-backed /dev/shm when there is one: writing thousands of sysfs entries is much faster."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


@contextlib.contextmanager
def _node() -> Iterator[Node]:
    workdir = Path(tempfile.mkdtemp(prefix="/tmp/pvdemo-"))
    lab_parent = Path(tempfile.mkdtemp(prefix="pvdemo-lab-", dir=_scratch_parent()))
    try:
        yield Node(workdir=workdir, lab_root=lab_parent / "node")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(lab_parent, ignore_errors=True)
        for leftover in (Path(f"{workdir / 'device-plugins'}.kubelet.json"),):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


@click.command("demo")
@click.option("--keep", is_flag=True, help="Leave everything running at the end, until Ctrl-C.")
@click.option(
    "--pace",
    type=click.FloatRange(min=0, max=600),
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="Pause this long after each step (for a presenter or a class).",
)
@click.option(
    "--live/--no-live",
    default=None,
    help="Live terminal view (resources, children, pods, events) [default: when stdout is a terminal].",
)
def demo_command(keep: bool, pace: float, live: bool | None) -> None:
    """Run a whole emulated node: lab, kubelet, supervised plugins, faults, crashes, restarts."""
    configure_logging(level="warning")
    # A terminal gets the live view at its own size (a wider one would wrap every line); printed
    # output (no terminal) keeps room for the tables' long cells.
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=max(100, shutil.get_terminal_size((110, 24)).columns))
    use_live = console.is_terminal if live is None else live

    async def main() -> int:
        code = 0
        with _node() as node:
            demo = Demo(node, console, keep=keep, pace=pace)
            task = asyncio.current_task()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, lambda: task.cancel() if task else None)
            refresher: asyncio.Task[None] | None = None
            try:
                if use_live:
                    with Live(demo._view(), console=console, auto_refresh=False) as demo.live:
                        refresher = asyncio.create_task(demo._refresh())
                        await demo.run()
                        demo.live.update(demo._view(), refresh=True)
                else:
                    await demo.run()
                    console.print(demo._resource_table())
                    console.print(demo._children_table())
                    console.print(demo._gpu_table())
                    console.print(demo._pods_table())
            except asyncio.CancelledError:
                console.print("\nstopping")
            except TimeoutError as exc:
                console.print(f"[red]a step did not happen in time[/red]: {exc}")
                console.print(f"agent log (last lines):\n{demo.agent_log_tail()}", markup=False)
                code = 1
            finally:
                demo.live = None
                if refresher is not None:
                    refresher.cancel()
                await demo.close()
        return code

    code = asyncio.run(main())
    console.print("cleaned up; bye")
    raise SystemExit(code)
