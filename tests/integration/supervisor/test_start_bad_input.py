"""`plugvisor run` given a file it cannot use: exit 2 naming it, promptly, with no fork server left behind.

The agent reads its file strictly before it starts anything: a FIFO must not hang
the start, and nesting that crashes libyaml's C composer must be refused first.
"""

import os
import subprocess
import sys

import pytest


def leftovers(runtime_dir: str, agent: int) -> list[int]:
    """Processes other than ``agent`` with the agent's environment (a fork server is forked from it)."""
    marker = f"PLUGVISOR_RUNTIME_DIR={runtime_dir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (agent, os.getpid()):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
        except OSError:
            continue
        if marker in environ:
            found.append(int(entry))
    return found


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("a FIFO", "not a regular file"),
        ("lists nested 30000 deep", "nested more than 100 levels deep"),
        ("a directory", "a directory"),
    ],
)
def test_a_file_the_agent_cannot_use_exits_2_naming_it(short_dir, breakage, expected):
    config = short_dir / "node.yaml"
    if breakage == "a FIFO":
        os.mkfifo(config)
    elif breakage == "a directory":
        config.mkdir()
    else:  # libyaml's C composer overflowed the stack on this (SIGSEGV, no message)
        config.write_text("resources: " + "[" * 30000 + "]" * 30000 + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "plugvisor", "run", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PLUGVISOR_RUNTIME_DIR": str(short_dir / "run")},
    )
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"plugvisor run --config <{breakage}> still runs after 60 s")
    assert proc.returncode == 2, stderr
    assert str(config) in stderr and expected in stderr, stderr
    assert leftovers(str(short_dir / "run"), proc.pid) == []
