"""Starting the fork server first, while the agent itself is still importing and validating.

``plugvisor run`` spent most of its start in series: the supervisor imported its
own machinery and validated the file, and only then started the fork server,
which then imported the plugin side (gRPC, the framework, the kinds). The two
are independent, so :func:`begin`, called on the ``plugvisor`` command's first
lines, reads the file cheaply (plain YAML, no validation) for the two facts the
fork server's imports depend on, the kinds to preload and whether children
write multiprocess metrics, and starts it at once: both processes then import
at the same time, on two cores.

Nothing here decides anything. The agent validates the file as before and
adopts the early fork server only if it was started for what the validated
file says (:func:`take`); otherwise, or if the agent never gets that far (an
invalid file, another agent running), it is ended (:func:`discard`). It cannot
outlive the agent either way: it gets SIGKILL when the agent dies and exits
when its standard input closes.

This module is imported before anything else of the agent, so it imports
nothing heavy (PyYAML and the strict reader only once it reads the file).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from plugvisor.common.notify import STATUS_SOCKET_ENV
from plugvisor.supervisor import prctl, signals
from plugvisor.supervisor.systemd import SYSTEMD_ENV

MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client picks its multiprocess value class when it is imported, by this variable's presence."""
# plugvisor.supervisor.status's names, which imports more than this module may.
_METRICS_DIR: Final = "prometheus"
_REPORT_SOCKET: Final = "status.sock"


def forkserver_argv(preload_kinds: Sequence[str]) -> list[str]:
    """The fork server's command line."""
    argv = [sys.executable, "-m", "plugvisor.supervisor.forkserver", "--parent", str(os.getpid())]
    for kind in preload_kinds:
        argv += ["--preload-kind", kind]
    return argv


def launch(env: Mapping[str, str], preload_kinds: Sequence[str]) -> subprocess.Popen[bytes]:
    """Start a fork server (raises OSError); the caller owns, watches and reaps it."""
    return subprocess.Popen(
        forkserver_argv(preload_kinds),
        env=dict(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )


@dataclass(frozen=True, slots=True)
class Prestarted:
    """A fork server started before the file was validated, and what it was started for."""

    proc: subprocess.Popen[bytes]
    preload_kinds: tuple[str, ...]
    multiprocess_metrics: bool
    runtime_dir: Path

    def suits(self, preload_kinds: Sequence[str], *, multiprocess_metrics: bool, runtime_dir: Path) -> bool:
        """Whether it was started for exactly these kinds, metrics mode and runtime directory, and runs."""
        return (
            self.preload_kinds == tuple(preload_kinds)
            and self.multiprocess_metrics == multiprocess_metrics
            and self.runtime_dir == runtime_dir
            and self.proc.poll() is None
        )


_prestarted: Prestarted | None = None


def _config_path(args: Sequence[str]) -> Path | None:
    """``--config PATH`` or ``--config=PATH`` from ``plugvisor run``'s arguments."""
    for index, arg in enumerate(args):
        if arg == "--config" and index + 1 < len(args):
            return Path(args[index + 1])
        if arg.startswith("--config="):
            return Path(arg.partition("=")[2])
    return None


def _cheap_read(path: Path) -> tuple[tuple[str, ...], bool, Path] | None:
    """(kinds, metrics wanted, runtime directory) from the file, unvalidated; None if unsure.

    Read by the agent's own strict reader, so that what the validation refuses
    later cannot hang or crash this early look first: a FIFO is refused without
    blocking (a blocked open would also hold back SIGTERM, which is only recorded
    this early), and nesting is bounded before PyYAML's recursive composer
    (libyaml's C one overflows the stack on a 60 KB file of brackets).
    """
    from plugvisor.common.yamlfile import YamlFileError, read_yaml  # noqa: PLC0415 - see the module doc

    try:
        data: Any = read_yaml(path)
    except YamlFileError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("resources"), list):
        return None
    supervisor = data.get("supervisor") or {}
    if not isinstance(supervisor, dict) or supervisor.get("spawner", "forkserver") != "forkserver":
        return None
    found = {entry.get("kind") if isinstance(entry, dict) else None for entry in data["resources"]}
    kinds = {kind for kind in found if isinstance(kind, str) and kind}
    if not kinds or len(kinds) != len(found):
        return None
    runtime = supervisor.get("runtimeDir") or os.environ.get("PLUGVISOR_RUNTIME_DIR") or "/run/plugvisor"
    return tuple(sorted(kinds)), data.get("metrics") is not None, Path(str(runtime))


def child_env(base: Mapping[str, str], *, runtime_dir: Path, multiprocess_metrics: bool) -> dict[str, str]:
    """The environment of the fork server and, before what the agent adds, of every child.

    Without systemd's variables (only the agent speaks to systemd), with the
    agent's status socket, and with the metrics directory only when the agent
    serves ``/metrics`` (prometheus-client decides at import time whether it writes
    multiprocess files, so the fork server must be started the way its children run).
    """
    env = {key: value for key, value in base.items() if key not in SYSTEMD_ENV and key != MULTIPROC_ENV}
    env[STATUS_SOCKET_ENV] = str(runtime_dir / _REPORT_SOCKET)
    if multiprocess_metrics:
        env[MULTIPROC_ENV] = str(runtime_dir / _METRICS_DIR)
    return env


def begin(args: Sequence[str]) -> None:
    """``plugvisor run``'s first step: record stop signals, then start the fork server if the file allows.

    Anything unexpected (no such file, not YAML, no resources, ``spawner: exec``)
    simply starts nothing early: the agent's own validation reports it, or
    starts the fork server itself.
    """
    global _prestarted  # noqa: PLW0603 - one early fork server per process, handed over once
    signals.install()
    path = _config_path(args)
    if path is None or _prestarted is not None:
        return
    try:
        found = _cheap_read(path)
    except Exception:  # whatever is wrong, the validation will say it properly
        return
    if found is None:
        return
    kinds, metrics, runtime_dir = found
    env = child_env(os.environ, runtime_dir=runtime_dir, multiprocess_metrics=metrics)
    try:
        prctl.become_subreaper()  # as the spawner would: the plugins it forks must become ours
        proc = launch(env, kinds)
    except OSError:
        return
    _prestarted = Prestarted(proc, kinds, metrics, runtime_dir)


def take() -> Prestarted | None:
    """The early fork server, handed over once (None if none was started)."""
    global _prestarted
    prestarted, _prestarted = _prestarted, None
    return prestarted


def discard(prestarted: Prestarted | None = None) -> None:
    """End a fork server that will not be used (by default the one not taken) and reap it."""
    if prestarted is None:
        prestarted = take()
    if prestarted is None:
        return
    end(prestarted.proc)


def end(proc: subprocess.Popen[bytes]) -> None:
    """Kill a fork server that has no children yet, and reap it (one that is stopped or hung included)."""
    with contextlib.suppress(OSError):
        proc.kill()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
        proc.wait(5)
