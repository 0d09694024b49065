"""`plugvisor demo`, the README's first command, plays the whole node story and leaves nothing behind."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

STEP = re.compile(r"^─+ (\d+)\. (.+?) ─+$", re.MULTILINE)


def in_session(sid: int) -> list[str]:
    """What still runs in the session ``sid``: orphans keep the session of the demo that made them."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        fields = text.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
            found.append(text.split(")", 1)[0] + ")")  # "pid (comm)"
    return found


def leftovers() -> set[Path]:
    return {*Path("/tmp").glob("pvdemo-*"), *Path("/dev/shm").glob("pvdemo-*")}


@pytest.fixture(scope="module")
def played():
    """One run of the demo with --pace and no live view: what would be on screen is printed at each pause.

    A wide terminal, so that the tables' rows are not folded (the content is under test, not the layout).
    """
    before = leftovers()
    with subprocess.Popen(
        [sys.executable, "-m", "plugvisor", "demo", "--no-live", "--pace", "0.01"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "140"},
        start_new_session=True,  # its own session: whatever it leaves running is found by it
    ) as demo:
        try:
            stdout, stderr = demo.communicate(timeout=180)
        finally:
            if demo.returncode is None:
                os.killpg(demo.pid, 9)
    result = subprocess.CompletedProcess(demo.args, demo.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, before, demo.pid


def steps(out: str) -> dict[str, str]:
    """Each step's title -> what it printed, the screen shown at its pause included."""
    found = list(STEP.finditer(out))
    ends = [m.start() for m in found[1:]] + [len(out)]
    return {m.group(2): out[m.end() : end] for m, end in zip(found, ends, strict=True)}


def gpu_row(screen: str, gpu: str) -> str:
    return next(line for line in screen.splitlines() if line.strip().startswith(f"{gpu} "))


def test_the_demo_tells_the_whole_story_and_cleans_up(played):
    result, before, session = played
    out = result.stdout
    for pattern in (
        r"8 GPUs on 4 PCIe switches and 2 NUMA nodes",
        r"done: agent start -> every resource registered in [\d.]+ ms",
        r"pod trainer is Running: gpu\d \+ gpu\d \(both under PCIe switch sw\d\)",
        r"done: gpu\d unhealthy: allocatable 7",
        r"done: gpu\d healthy again: allocatable 8",
        r"done: gpu\d overheat -> in /metrics with its pod in [\d.]+ ms",
        r"/metrics: gpu\d junction 11\d °C \(critical 110\), pod default/trainer/train",
        r"gpu\d\s+│ \S+\s+│ healthy\s+│ default/trainer/train\s+│ edge \d+°C junction \d+°C",
        r"done: killed child -> registered again on a new socket",
        r"done: kubelet restart -> every resource registered again",
        r"done: 16 VFs advertised, no restart",
        r"plugvisor\.io/gpu\s+│ RUNNING .*│ 2 \(killed 1, kubelet-restart 1\)",
        r"cleaned up; bye",
    ):
        assert re.search(pattern, out), f"missing /{pattern}/ in:\n{out}"
    assert "Traceback" not in result.stderr, result.stderr
    assert leftovers() == before
    assert in_session(session) == []  # no fork server, plugin or emulator outlives the demo


def test_each_fault_is_on_screen_during_its_pause_and_healed_only_in_the_next_step(played):
    """A presenter pauses on the fault: the unhealthy GPU, the allocatable drop, the alert, the temperature;
    the heal is a step of its own. (The live view draws the same tables from the same files.)"""
    out = played[0].stdout
    shown = steps(out)
    titles = list(shown)
    fault = next(t for t in titles if t.startswith("A GPU fails"))
    victim = re.search(r"done: (gpu\d) unhealthy", shown[fault]).group(1)
    overheat = next(t for t in titles if t.startswith("A GPU the pod holds overheats"))
    hot = re.search(r"done: (gpu\d) overheat", shown[overheat]).group(1)
    assert titles.index(f"{victim} recovers (the fault is healed)") == titles.index(fault) + 1
    assert titles.index(f"{hot} cools down (the fault is healed)") == titles.index(overheat) + 1

    screen = shown[fault].split("on screen:", 1)[1]
    assert re.search(r"plugvisor\.io/gpu\s+│ 8\s+│ 7\s+│ \S+", screen), screen
    assert "unhealthy (aer-fatal)" in gpu_row(screen, victim) and "AerFatalErrors" in gpu_row(screen, victim)
    screen = shown[f"{victim} recovers (the fault is healed)"].split("on screen:", 1)[1]
    assert re.search(r"plugvisor\.io/gpu\s+│ 8\s+│ 8\s+│ -", screen), screen
    assert "healthy" in gpu_row(screen, victim) and "AerFatal" not in gpu_row(screen, victim)

    screen = shown[overheat].split("on screen:", 1)[1]
    row = gpu_row(screen, hot)
    assert "default/trainer/train" in row and "TemperatureCritical" in row, screen
    assert int(re.search(r"junction (\d+)°C", row).group(1)) >= 110, row
    row = gpu_row(shown[f"{hot} cools down (the fault is healed)"].split("on screen:", 1)[1], hot)
    assert "TemperatureCritical" not in row and int(re.search(r"junction (\d+)°C", row).group(1)) < 105, row
