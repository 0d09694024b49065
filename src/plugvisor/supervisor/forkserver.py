"""The warm fork server: a helper process that forks plugin children from a preloaded interpreter.

Run by :class:`~plugvisor.supervisor.spawner.ForkServerSpawner` as
``python -m plugvisor.supervisor.forkserver --parent PID``; never imported by the
supervisor for anything but this module's (gRPC-free) top level.

Why a separate process: a fresh interpreter spends ~300 ms importing gRPC,
pydantic and the plugin before it can serve, which alone exceeds the 300 ms
"child killed -> registered again" target. This helper pays that once, then
forks. gRPC is not fork-safe once it has *started* (threads, pollers), so the
helper imports it but never creates a gRPC object, and checks that it is still
single-threaded before answering that it is ready; a child starts gRPC only
after the fork. The supervisor never imports gRPC at all.

Each plugin is forked through a short-lived intermediate process that exits
at once, so the plugin is re-parented to the supervisor (a child subreaper):
the supervisor reaps it, learns its exit status and is the parent whose death
it follows. The fork server is then nobody's parent but the intermediates', and
its death (an OOM kill, a SIGKILL) takes no plugin with it: the supervisor
starts a new one quietly on the next spawn.

Protocol, one JSON object per line. Supervisor -> helper on stdin:
``{"op": "spawn", "id": N, "args": [...], "env": {...}}``, of any length (the
supervisor writes as fast as this process reads, and a line is handled once its
newline has arrived). Helper -> supervisor on stdout: ``{"op": "ready", "pid": P,
"threads": 1}`` once, then ``{"op": "spawned", "id": N, "pid": P}`` (or
``"error"``) per request, written by its intermediate in one write of
less than ``PIPE_BUF`` bytes before it exits, so that the answer is in the pipe
before the plugin can run at all and answers of concurrent intermediates never
interleave. End of stdin ends the helper. It dies with the supervisor (SIGKILL).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plugvisor.common import richless
from plugvisor.supervisor import prctl
from plugvisor.supervisor.prctl import CHILD_DEATH_SIGNAL

richless.install()  # before the preload imports structlog: every child inherits structlog without rich

_PLUGIN_ENTRY = "plugvisor.plugins.entry"
"""The plugin entry module: its ``main(args)`` is what a child runs, the same as ``plugvisor plugin``.

Imported by name, in this helper only: the supervisor's own import graph must
not reach the framework (an import-linter contract), and only this process
needs it.
"""


def _thread_count() -> int:
    try:
        return sum(1 for _ in Path("/proc/self/task").iterdir())
    except OSError:
        return 1


def _await_adoption(supervisor: int, timeout: float = 5.0) -> None:
    """Wait until the intermediate has exited and the supervisor is our parent; exit if it never is.

    The parent-death signal is set only then: set earlier, the intermediate's exit
    would fire it. A parent other than the supervisor after the bound means the
    supervisor is gone or is no subreaper; running on would leave a plugin nobody
    reaps or stops, so the child exits instead.
    """
    deadline = time.monotonic() + timeout
    while os.getppid() != supervisor:
        if time.monotonic() > deadline:
            sys.stderr.write(f"plugvisor: not adopted by the supervisor (pid {supervisor}); exiting\n")
            os._exit(1)
        time.sleep(0.0002)


class _Server:
    def __init__(self, control_in: int, control_out: int, supervisor: int) -> None:
        self.supervisor = supervisor
        self.control_in = control_in
        self.control_out = control_out
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.buffer = bytearray()
        self.pid = os.getpid()

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

    def reap(self) -> None:
        """Collect the intermediates (plugins are the supervisor's children, never ours)."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def handle(self, request: dict[str, Any]) -> None:
        ident = request.get("id")
        try:
            intermediate = os.fork()
        except OSError as exc:
            self.send(op="spawned", id=ident, error=f"fork failed: {exc.strerror or exc}")
            return
        if intermediate == 0:
            self.become_intermediate(ident, list(request["args"]), dict(request["env"]))

    def become_intermediate(self, ident: Any, args: list[str], env: dict[str, str]) -> None:
        """Runs in the intermediate: fork the plugin, report its PID, exit (never returns)."""
        code = 0
        try:
            try:
                pid = os.fork()
            except OSError as exc:
                self.send(op="spawned", id=ident, error=f"fork failed: {exc.strerror or exc}")
            else:
                if pid == 0:
                    self.become_child(args, env)
                self.send(op="spawned", id=ident, pid=pid)
        except BaseException:
            code = 1
        finally:
            os._exit(code)

    def become_child(self, args: list[str], env: dict[str, str]) -> None:
        """Runs in the forked child: never returns."""
        code = 1
        try:
            os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
            for fd in (self.control_in, self.control_out, self.wake_r, self.wake_w):
                os.close(fd)
            _await_adoption(self.supervisor)
            prctl.die_with_parent(CHILD_DEATH_SIGNAL, self.supervisor)
            # A forked child keeps the helper's command line; its name at least tells them apart in ps.
            resource = args[args.index("--resource") + 1] if "--resource" in args else "plugin"
            prctl.set_name("pv:" + resource.rsplit("/", 1)[-1])
            os.environ.clear()
            os.environ.update(env)
            sys.argv = ["plugvisor", *args]
            # The fork server's objects stay frozen here too: unfrozen, they would join the
            # oldest generation, and the child's first full collection would write to every
            # one of them, copying the pages it shares with the fork server (measured: each
            # child's PSS 17 -> 24 MB after one full collection; unchanged when they stay
            # frozen). Preloaded objects that become garbage here are still freed by
            # reference counting; only cycles among them would wait for the process's exit.
            code = _run_plugin_command(args)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def _run_plugin_command(args: list[str]) -> int:
    code: int = importlib.import_module(_PLUGIN_ENTRY).main(args)
    return code


def _preload(kinds: Sequence[str]) -> None:
    """Import what every child needs, so that a fork inherits it instead of importing it again."""
    importlib.import_module(_PLUGIN_ENTRY).preload()
    kinds_ = importlib.import_module("plugvisor.plugins.kinds")
    for name in kinds:
        with contextlib.suppress(Exception):  # the child reports a broken kind itself
            kinds_.get_kind(name)


def main(argv: Sequence[str] | None = None) -> None:
    """Preload, report readiness, then fork on request until stdin closes."""
    parser = argparse.ArgumentParser(prog="plugvisor.supervisor.forkserver")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--preload-kind", action="append", default=[])
    options = parser.parse_args(argv)
    prctl.die_with_parent(signal.SIGKILL, options.parent)
    prctl.set_name("pv-forkserver")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # The protocol keeps private copies of stdin/stdout: anything printed by an import
    # (or by a child before it execs nothing) goes to stderr, never into the protocol.
    control_in = os.dup(0)
    control_out = os.dup(1)
    os.set_inheritable(control_in, False)
    os.set_inheritable(control_out, False)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    server = _Server(control_in, control_out, options.parent)
    try:
        _preload(options.preload_kind)
    except Exception as exc:
        server.send(op="ready", pid=os.getpid(), error=f"preload failed: {exc!r}")
        return
    threads = _thread_count()
    if threads != 1:
        server.send(op="ready", pid=os.getpid(), error=f"{threads} threads after preload: forking is unsafe")
        return
    # Objects that exist now are shared by every child; keep the collector from touching
    # (and so copying) their pages, here and in every child (which never unfreezes them).
    gc.collect()
    gc.freeze()
    server.send(op="ready", pid=os.getpid(), threads=threads)
    server.serve()


if __name__ == "__main__":
    main()
