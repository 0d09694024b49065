"""The warm fork server: forked from the agent, it imports the plugin side once and forks plugin children.

:func:`fork` is called by :class:`~plugvisor.supervisor.spawner.ForkServerSpawner`
in the agent, once the agent has imported what it needs and validated its file.
The child it creates is the fork server: it inherits, shared page for page, every
module the agent has loaded (structlog, click, pydantic, asyncio, the kinds' options
models), then imports what only plugins need (the framework, gRPC, protobuf,
uvloop) and forks one plugin per request. Nothing is imported twice on the node,
and nothing of the plugin side ever enters the agent.

Why fork at all: a fresh interpreter spends ~300 ms importing gRPC, pydantic and
the plugin before it can serve, more than the whole "child killed -> registered
again" budget; a plugin forked from here is serving within ~30 ms. gRPC is not
fork-safe once it has *started* (threads, pollers): the agent never imports it,
this process imports it after it was forked from the agent but never creates a
gRPC object, and checks that it is still single-threaded before it says it is
ready; only a plugin, after its own fork, starts gRPC.

Each plugin is forked through a short-lived intermediate process that exits at
once, so the plugin is re-parented to the agent (a child subreaper): the agent
reaps it, learns its exit status and is the parent whose death it follows. The
fork server is then nobody's parent but the intermediates', and its death (an OOM
kill, a SIGKILL) takes no plugin with it: the agent forks a new one.

Protocol, one JSON object per line, on two pipes. Agent -> fork server:
``{"op": "spawn", "id": N, "args": [...]}``, of any length (the agent writes as
fast as this process reads, and a line is handled once its newline has arrived).
Fork server -> agent: ``{"op": "ready", "pid": P, "threads": 1}`` once (or
``"error"``), then ``{"op": "spawned", "id": N, "pid": P}`` (or ``"error"``) per
request, written by its intermediate in one write of less than ``PIPE_BUF``
bytes before it exits, so that the answer is in the pipe before the plugin can
run at all and answers of concurrent intermediates never interleave. The end of
its input ends the fork server; it dies with the agent (SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib
import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NoReturn

from plugvisor.common import proctitle
from plugvisor.supervisor import prctl
from plugvisor.supervisor.prctl import CHILD_DEATH_SIGNAL

TITLE: Final = "plugvisor fork-server"
"""What ``ps`` shows for this process (its ``comm``, what ``top`` shows, is ``pv-forkserver``)."""

_PLUGIN_ENTRY: Final = "plugvisor.plugins.entry"
"""The plugin entry module: ``prepare(args)`` here, then what it returns in the child: ``plugvisor plugin``.

Imported by name, in this process only: the agent's own import graph must not
reach the framework (an import-linter contract), and only plugins need it.
"""

_DRA_ENTRY: Final = "plugvisor.plugins.draentry"
"""The DRA driver's entry module, preloaded (by name, as the plugin entry) only on a node with DRA entries.

Its runtime and the Kubernetes API client add megabytes that a node of device
plugins only must not carry; a driver forked without them imports them after
the fork, which more than doubles its time to serve again after a crash.
"""

_MAX_ERROR: Final = 300
"""Longest error text in an answer: an answer must stay one write shorter than ``PIPE_BUF``."""


@dataclass(slots=True)
class Forked:
    """A fork server as the agent sees it: its PID and its two pipes (``returncode`` set once reaped)."""

    pid: int
    requests: int
    """The agent writes requests here."""
    answers: int
    """The agent reads answers here."""
    returncode: int | None = None


def fork(env: Mapping[str, str], preload_kinds: Sequence[str], *, dra: bool = False) -> Forked:
    """Fork a fork server from this process (the agent: single-threaded, its imports done); raises OSError.

    ``env`` becomes the fork server's environment, hence every plugin's. ``dra``
    preloads the DRA driver's side too (the node has ``mode: dra`` entries).
    """
    agent = os.getpid()
    requests_r, requests_w = os.pipe2(os.O_CLOEXEC)
    answers_r, answers_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError:
        for fd in (requests_r, requests_w, answers_r, answers_w):
            os.close(fd)
        raise
    if pid == 0:
        _become_server(agent, requests_r, answers_w, dict(env), list(preload_kinds), dra=dra)
    os.close(requests_r)
    os.close(answers_w)
    return Forked(pid, requests_w, answers_r)


def _become_server(
    agent: int, control_in: int, control_out: int, env: dict[str, str], kinds: list[str], *, dra: bool
) -> NoReturn:
    """Runs in the forked child: leave the agent behind, preload, serve; never returns into the agent."""
    code = 1
    try:
        # Every object the agent had stays as it is: never collected here (no finalizer of the
        # agent's can run in this process, e.g. close a descriptor that is ours by then), and
        # the collector never writes to, hence copies, the pages this process shares with it.
        gc.freeze()
        os.setpgid(0, 0)  # its own group: the agent's SIGKILL of the group takes unanswered intermediates
        prctl.die_with_parent(signal.SIGKILL, agent)
        _leave_the_agent(control_in, control_out)
        os.environ.clear()
        os.environ.update(env)
        proctitle.forget_environment_changes()
        proctitle.set_name("pv-forkserver")
        proctitle.set_title(TITLE)
        code = _serve(_Server(control_in, control_out, agent), kinds, dra)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _leave_the_agent(control_in: int, control_out: int) -> None:
    """Drop what this process inherited from the agent's run: signal handlers, its event loop, its files."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's Ctrl-C or hangup is the agent's to handle
        signal.signal(sig, signal.SIG_IGN)
    # Forked from inside the agent's event loop: as far as asyncio knows, it is still running here,
    # and a plugin's own loop would refuse to start (Python 3.12 resets this itself after a fork).
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(None)
    # stdin is nothing; anything printed goes to the agent's standard error (the log), never into
    # the protocol; every other descriptor (the agent's sockets, its lock, its epoll, the kubelet
    # watch) is closed, so that no plugin holds any of them.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    low = 3
    for keep in sorted({control_in, control_out}):
        os.closerange(low, keep)
        low = keep + 1
    os.closerange(low, _max_fd())


def _max_fd() -> int:
    try:
        return max(256, os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 65536


def _thread_count() -> int:
    try:
        return sum(1 for _ in Path("/proc/self/task").iterdir())
    except OSError:
        return 1


def _await_adoption(agent: int, timeout: float = 5.0) -> None:
    """Wait until the intermediate has exited and the agent is our parent; exit if it never is.

    The parent-death signal is set only then: set earlier, the intermediate's exit
    would fire it. A parent other than the agent after the bound means the agent
    is gone or is no subreaper; running on would leave a plugin nobody reaps or
    stops, so the child exits instead.
    """
    deadline = time.monotonic() + timeout
    while os.getppid() != agent:
        if time.monotonic() > deadline:
            sys.stderr.write(f"plugvisor: not adopted by the agent (pid {agent}); exiting\n")
            os._exit(1)
        time.sleep(0.0002)


class _Server:
    def __init__(self, control_in: int, control_out: int, agent: int) -> None:
        self.agent = agent
        self.pid = os.getpid()
        self.control_in = control_in
        self.control_out = control_out
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.buffer = bytearray()

    def send(self, **message: Any) -> None:
        data = json.dumps(message).encode() + b"\n"
        while data:
            written = os.write(self.control_out, data)
            data = data[written:]

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        while True:
            try:
                ready, _, _ = select.select([self.control_in, self.wake_r], [], [])
            except InterruptedError:  # pragma: no cover - PEP 475 retries select
                continue
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            self.reap()
            if self.control_in in ready:
                data = os.read(self.control_in, 65536)
                if not data:
                    self.await_intermediates()
                    return
                # A request can be longer than one read (its options travel in it): only
                # what ends in a newline is complete, the rest waits for the next read.
                self.buffer += data
                end = self.buffer.rfind(b"\n")
                if end < 0:
                    continue
                lines = bytes(self.buffer[:end]).split(b"\n")
                del self.buffer[: end + 1]
                for line in lines:
                    if line.strip():
                        self.handle(json.loads(line))

    def await_intermediates(self) -> None:
        """Before this process exits: every intermediate has answered (and exited).

        An intermediate dies with this process (its parent-death signal): exiting
        while one had not answered yet would leave a plugin nobody knows of.
        """
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return

    def reap(self) -> None:
        """Collect the intermediates (plugins are the agent's children, never ours)."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def handle(self, request: dict[str, Any]) -> None:
        ident = request.get("id")
        args = [str(arg) for arg in request["args"]]
        command = _prepare(args)
        try:
            intermediate = os.fork()
        except OSError as exc:
            self.send(op="spawned", id=ident, error=_fork_error(exc))
            return
        if intermediate == 0:
            self.become_intermediate(ident, args, command)

    def become_intermediate(self, ident: Any, args: list[str], command: Callable[[], int]) -> NoReturn:
        """Runs in the intermediate: fork the plugin, report its PID, exit."""
        code = 0
        try:
            # Dies with the fork server, whatever it is doing (stopped included): a fork server
            # that is replaced or killed leaves no intermediate behind.
            prctl.die_with_parent(signal.SIGKILL, self.pid)
            try:
                pid = os.fork()
            except OSError as exc:
                self.send(op="spawned", id=ident, error=_fork_error(exc))
            else:
                if pid == 0:
                    self.become_child(args, command)
                self.send(op="spawned", id=ident, pid=pid)
        except BaseException:
            code = 1
        finally:
            os._exit(code)

    def become_child(self, args: list[str], command: Callable[[], int]) -> NoReturn:
        """Runs in the forked plugin."""
        code = 1
        try:
            os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
            for fd in (self.control_in, self.control_out, self.wake_r, self.wake_w):
                os.close(fd)
            _await_adoption(self.agent)
            prctl.die_with_parent(CHILD_DEATH_SIGNAL, self.agent)
            sys.argv = ["plugvisor", *args]
            # The fork server's objects stay frozen here too: unfrozen, they would join the
            # oldest generation, and the child's first full collection would write to every
            # one of them, copying the pages it shares with the fork server (measured: each
            # child's PSS 17 -> 24 MB after one full collection; unchanged when they stay
            # frozen). Preloaded objects that become garbage here are still freed by
            # reference counting; only cycles among them would wait for the process's exit.
            code = command()
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def _fork_error(exc: OSError) -> str:
    return f"fork failed: {exc.strerror or exc}"[:_MAX_ERROR]


def _prepare(args: list[str]) -> Callable[[], int]:
    """The plugin command for ``args``, parsed here, to run in the child (see ``entry.prepare``)."""
    try:
        command: Callable[[], int] = importlib.import_module(_PLUGIN_ENTRY).prepare(args)
    except Exception:  # a bug of the parsing: the child reports it, this process serves on
        return functools.partial(_report, traceback.format_exc())
    return command


def _report(text: str) -> int:
    sys.stderr.write(text)
    return 1


def _preload(kinds: Sequence[str], dra: bool) -> None:
    """Import what every child needs, so that a fork inherits it instead of importing it again."""
    if "prometheus_client" in sys.modules:
        # Imported by the agent (it serves /metrics) before this fork: prometheus-client chose
        # its value class then, for the agent's environment. Plugins write multiprocess files
        # when this environment says so; the metrics they create after this fork use the class
        # chosen now.
        values = importlib.import_module("prometheus_client.values")
        setattr(values, "ValueClass", values.get_value_class())  # noqa: B010 - a module's attribute
    importlib.import_module(_PLUGIN_ENTRY).preload()
    if dra:
        importlib.import_module(_DRA_ENTRY).preload()
    kinds_ = importlib.import_module("plugvisor.plugins.kinds")
    for name in kinds:
        with contextlib.suppress(Exception):  # the child reports a broken kind (or a missing module) itself
            for module in kinds_.get_kind(name).preload:
                importlib.import_module(module)


def _serve(server: _Server, kinds: Sequence[str], dra: bool) -> int:
    """Preload, report readiness, then fork on request until the agent closes our input."""
    try:
        _preload(kinds, dra)
    except Exception as exc:
        error = f"preload failed: {exc!r}"
        if isinstance(exc, ImportError):
            # Forked from the agent, this process has the agent's modules and imports the rest from
            # disk: code changed on disk since the agent started (plugvisor upgraded in place) cannot
            # be mixed with them. Only a new agent process loads it whole.
            error += "; plugvisor's files changed under the running agent? restart the agent"
        server.send(op="ready", pid=os.getpid(), error=error)
        return 1
    threads = _thread_count()
    if threads != 1:
        server.send(op="ready", pid=os.getpid(), error=f"{threads} threads after preload: forking is unsafe")
        return 1
    # Objects that exist now are shared by every child; keep the collector from touching
    # (and so copying) their pages, here and in every child (which never unfreezes them).
    gc.collect()
    gc.freeze()
    server.send(op="ready", pid=os.getpid(), threads=threads)
    server.serve()
    return 0
