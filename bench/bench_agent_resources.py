"""What one DaemonSet pod of plugvisor uses: memory and CPU of `plugvisor run` on a lab, per overlay.

Run: python bench/bench_agent_resources.py [--idle 10] [--churn 10]

For each kind overlay (deploy/kubernetes/overlays/lab/node-<kind>.yaml, the configuration the kind
cluster runs) the agent runs on a lab written from the kind worker's profile, against the emulated
kubelet (`plugvisor kubelet`, its own process, not measured). Figures are for the agent's whole
process tree (supervisor, fork server, plugin children), which is what the pod's cgroup is charged:

- start: CPU seconds from spawn until /readyz answers 200 (every resource registered), and the peak
  of the summed RSS, sampled every 20 ms (an upper bound: shared pages are counted once per process);
- idle: CPU in millicores over --idle seconds of nothing happening, summed PSS and RSS at the end;
- churn: millicores over --churn seconds while the lab changes every 0.2 s (fault/heal, or a VF
  count change for the NIC), each change making the plugin rescan and stream a new list.

The DaemonSet requests and limits in deploy/kubernetes/base/daemonset.yaml come from these figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from plugvisor.emulators.lab import Lab

REPO = Path(__file__).resolve().parent.parent
LAB_OVERLAY = REPO / "deploy/kubernetes/overlays/lab"
PROFILE_OF = {"gpu": "gpu-node", "nic": "nic-fpga-node", "fpga": "nic-fpga-node", "generic": "gpu-node"}
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def tree(pid: int) -> list[int]:
    """The pid and all its descendants, from /proc/<pid>/task/*/children."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (
                int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
            )  # incl. reaped children
    return total / TICKS


def memory(pids: list[int]) -> tuple[float, float]:
    """Summed (PSS, RSS) in MiB."""
    pss = rss = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1])
    return pss / 1024, rss / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class Change:
    """One lab change that makes the plugin rescan and stream a new list, and its undoing."""

    def __init__(self, kinds: list[str], lab_root: Path) -> None:
        self.lab = Lab.open(lab_root)
        self.root = lab_root
        self.kind = kinds[0]
        pick = {"gpu": "gpu", "nic": "nic-pf", "fpga": "fpga"}.get(self.kind)
        self.device = next((r.name for r in self.lab.devices() if r.kind.value == pick), None)
        self.changed = False

    def flip(self) -> None:
        if self.kind == "generic":
            a, b = self.root / "dev/fuse", self.root / "dev/.fuse"
            (b if self.changed else a).rename(a if self.changed else b)
        elif self.kind == "nic":
            self.lab.set_num_vfs(str(self.device), 8 if self.changed else 0)
        elif self.changed:
            self.lab.heal(str(self.device))
        else:
            self.lab.fault(str(self.device), "aer-fatal")
        self.changed = not self.changed

    def restore(self) -> None:
        if self.changed:
            self.flip()


def measure(kinds: list[str], *, idle: float, churn: float, work: Path) -> dict[str, Any]:
    profile = PROFILE_OF[kinds[0]]
    lab_root = work / f"lab-{profile}"
    if not lab_root.exists():
        Lab.create(lab_root, str(LAB_OVERLAY / "profiles" / f"{profile}.yaml"))
    kubelet_dir = work / "dp"
    kubelet_dir.mkdir(exist_ok=True)
    kubelet = subprocess.Popen(
        [sys.executable, "-m", "plugvisor", "kubelet", "--dir", str(kubelet_dir), "--no-pod-resources"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while not (kubelet_dir / "kubelet.sock").exists():
        time.sleep(0.05)
    port = free_port()
    resources = []
    for kind in kinds:
        resources += yaml.safe_load((LAB_OVERLAY / f"node-{kind}.yaml").read_text())["resources"]
    config = {
        "kubeletDir": str(kubelet_dir),
        "hostRoot": str(lab_root),
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "supervisor": {"runtimeDir": str(work / "run")},
        "resources": resources,
    }
    (work / "node.yaml").write_text(yaml.safe_dump(config))
    started = time.monotonic()
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plugvisor",
            "run",
            "--config",
            str(work / "node.yaml"),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    peak_rss = 0.0
    try:
        while not ready(port):
            if time.monotonic() - started > 60:
                raise SystemExit(f"{kinds}: the agent was not ready within 60 s")
            peak_rss = max(peak_rss, memory(tree(agent.pid))[1])
            time.sleep(0.02)
        start_seconds = time.monotonic() - started
        start_cpu = cpu_seconds(tree(agent.pid))
        time.sleep(1)  # let the first ListAndWatch answers settle
        before, t0 = cpu_seconds(tree(agent.pid)), time.monotonic()
        time.sleep(idle)
        idle_mcores = 1000 * (cpu_seconds(tree(agent.pid)) - before) / (time.monotonic() - t0)
        pss, rss = memory(tree(agent.pid))
        peak_rss = max(peak_rss, rss)
        change = Change(kinds, lab_root)
        before, t0 = cpu_seconds(tree(agent.pid)), time.monotonic()
        while time.monotonic() - t0 < churn:
            change.flip()
            peak_rss = max(peak_rss, memory(tree(agent.pid))[1])
            time.sleep(0.2)
        churn_mcores = 1000 * (cpu_seconds(tree(agent.pid)) - before) / (time.monotonic() - t0)
        change.restore()
        processes = len(tree(agent.pid))
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        kubelet.send_signal(signal.SIGTERM)
        kubelet.wait(30)
    return {
        "kinds": "+".join(kinds),
        "processes": processes,
        "start_s": start_seconds,
        "start_cpu_s": start_cpu,
        "peak_rss": peak_rss,
        "idle_mcores": idle_mcores,
        "churn_mcores": churn_mcores,
        "pss": pss,
        "rss": rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    parser.add_argument("--churn", type=float, default=10.0, help="seconds of the churn window")
    args = parser.parse_args()
    scenarios = [["generic"], ["gpu"], ["nic"], ["fpga"], ["gpu", "generic"], ["nic", "fpga", "generic"]]
    parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    print(
        f"{'overlay / resources':<22}{'procs':>6}{'ready s':>9}{'start cpu s':>13}{'peak RSS':>10}"
        f"{'idle PSS':>10}{'idle RSS':>10}{'idle mcpu':>11}{'churn mcpu':>12}"
    )
    for kinds in scenarios:
        work = Path(tempfile.mkdtemp(prefix="pvbench-", dir=parent))
        try:
            r = measure(kinds, idle=args.idle, churn=args.churn, work=work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(
            f"{r['kinds']:<22}{r['processes']:>6}{r['start_s']:>9.2f}{r['start_cpu_s']:>13.2f}"
            f"{r['peak_rss']:>8.0f}Mi{r['pss']:>8.0f}Mi{r['rss']:>8.0f}Mi{r['idle_mcores']:>11.1f}"
            f"{r['churn_mcores']:>12.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
