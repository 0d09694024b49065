"""Creating, signalling and reaping child processes, behind one seam.

:class:`Spawner` is the seam (supervisord's ``options.fork/kill/waitpid``): the
state machine only ever calls ``spawn``, ``kill`` and ``reap``, so unit tests run
it with :class:`FakeSpawner`. Two real implementations:

- :class:`ForkServerSpawner` (the default): a helper process, started once by
  fork+exec, imports the plugin command and its kinds (gRPC included, but it
  creates no gRPC object, so forking it is safe) and forks one child per
  request. A child is serving within ~30 ms instead of ~350 ms for a fresh
  interpreter, and the children share the imported code pages (PSS ~24 MB
  instead of ~39 MB each). See docs/supervisor.md for the measurements.
- :class:`ExecSpawner`: plain fork+exec of ``python -m plugvisor plugin ...``; the
  fallback when the fork server cannot start, and a configuration choice.

Both put each child in its own process group (a stop reaches any helper it
started; a terminal's Ctrl-C reaches only the supervisor, which stops children
in order) and give it a parent-death signal, so that no child outlives the
supervisor. The supervisor itself never imports gRPC: the fork server is a
separate process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from plugvisor.supervisor import prctl
from plugvisor.supervisor.config import ChildSpec

CHILD_DEATH_SIGNAL = signal.SIGTERM
"""Children get SIGTERM when their parent dies: they stop cleanly and remove their socket."""

_log = structlog.get_logger("plugvisor.supervisor.spawner")


class SpawnError(Exception):
    """A child process could not be created (the message says why)."""


@dataclass(frozen=True, slots=True)
class Exit:
    """A child process ended: its status as ``subprocess`` reports it (negative: killed by a signal)."""

    pid: int
    returncode: int


Wake = Callable[[], None]


class Spawner(Protocol):
    """**Protocol:** what the supervisor needs from process creation.

    ``spawn`` returns the new process's PID or raises :class:`SpawnError`; ``kill``
    signals a child (its process group) and ignores one that is already gone;
    ``reap`` returns, without blocking, the exits since the last call. ``open``
    receives a callback to call whenever ``reap`` has something new.
    """

    async def open(self, wake: Wake) -> None:
        """Get ready to spawn; call ``wake`` when exits are waiting."""
        ...

    def spawn(self, spec: ChildSpec) -> int:
        """Start a process for ``spec``."""
        ...

    def kill(self, pid: int, sig: int) -> None:
        """Send ``sig`` to the child ``pid``."""
        ...

    def reap(self) -> list[Exit]:
        """The exits not reported yet."""
        ...

    async def close(self) -> None:
        """Release what ``open`` set up (children must be stopped first)."""
        ...


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        # Not a group leader any more (or gone): the process itself, if it is still there.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class ExecSpawner:
    """fork+exec of ``python -m plugvisor plugin ...`` per child; reaped on SIGCHLD."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._wake: Wake | None = None

    async def open(self, wake: Wake) -> None:
        """Reap on SIGCHLD (no thread: preexec_fn must not fork a threaded process)."""
        self._wake = wake
        asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, wake)

    def spawn(self, spec: ChildSpec) -> int:
        """fork+exec the child's command line."""
        parent = os.getpid()

        def in_child() -> None:
            os.setpgid(0, 0)
            prctl.die_with_parent(CHILD_DEATH_SIGNAL, parent)

        try:
            proc = subprocess.Popen(
                spec.argv(),
                env=self._env,
                stdin=subprocess.DEVNULL,
                preexec_fn=in_child,  # noqa: PLW1509 - the supervisor runs no threads
                close_fds=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise SpawnError(f"cannot start {spec.argv()[0]}: {exc}") from exc
        self._procs[proc.pid] = proc
        return proc.pid

    def kill(self, pid: int, sig: int) -> None:
        """Signal the child's process group."""
        if pid in self._procs:
            _signal_group(pid, sig)

    def reap(self) -> list[Exit]:
        """Poll every child (waitpid WNOHANG)."""
        exits = []
        for pid, proc in list(self._procs.items()):
            code = proc.poll()
            if code is not None:
                del self._procs[pid]
                exits.append(Exit(pid, code))
        return exits

    async def close(self) -> None:
        """Stop reaping on SIGCHLD."""
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)


class _LineChannel:
    """Newline-delimited JSON over a pipe, readable both without blocking and with a bounded wait."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""
        self.closed = False
        os.set_blocking(fd, False)

    def read_available(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        while not self.closed:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if line.strip():
                with contextlib.suppress(ValueError):
                    messages.append(json.loads(line))
        return messages

    def wait_readable(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        return bool(ready)


class ForkServerSpawner:
    """Children forked by a warm helper process (``plugvisor.supervisor.forkserver``).

    The helper is the children's parent: it reaps them and reports each exit on
    its pipe. It dies with the supervisor (SIGKILL), and its children with it
    (SIGTERM). If the helper itself dies, every child it had is reported as
    killed and a new helper is started on the next spawn.
    """

    def __init__(
        self, env: Mapping[str, str], *, preload_kinds: Sequence[str] = (), start_timeout: float = 60.0
    ):
        self._env = dict(env)
        self._preload = list(preload_kinds)
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: _LineChannel | None = None
        self._children: set[int] = set()
        self._exits: list[Exit] = []
        self._wake: Wake | None = None
        self._next_id = 0
        self.server_pid: int | None = None
        self.preload_seconds: float | None = None

    async def open(self, wake: Wake) -> None:
        """Start the helper and wait until it has imported everything (raises SpawnError if it cannot)."""
        self._wake = wake
        self._start_server()

    def _start_server(self) -> None:
        argv = [sys.executable, "-m", "plugvisor.supervisor.forkserver", "--parent", str(os.getpid())]
        for kind in self._preload:
            argv += ["--preload-kind", kind]
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv, env=self._env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
            )
        except OSError as exc:
            raise SpawnError(f"cannot start the fork server: {exc}") from exc
        assert proc.stdin is not None
        assert proc.stdout is not None
        channel = _LineChannel(proc.stdout.fileno())
        ready = self._await(channel, "ready", started + self._start_timeout)
        if ready is None or ready.get("error"):
            proc.kill()
            proc.wait()
            reason = "it exited or timed out" if ready is None else ready["error"]
            raise SpawnError(f"the fork server did not start: {reason}")
        self._proc, self._channel = proc, channel
        self.server_pid = proc.pid
        self.preload_seconds = round(time.monotonic() - started, 3)
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().add_reader(channel.fd, self._on_readable)
        _log.info("forkserver_ready", pid=proc.pid, seconds=self.preload_seconds)

    def _await(
        self, channel: _LineChannel, op: str, deadline: float, ident: int | None = None
    ) -> dict[str, Any] | None:
        """Read messages until ``op`` (with ``id``) arrives; exits read meanwhile are queued."""
        while True:
            found: dict[str, Any] | None = None
            # Every message of a read is handled: exits that came in the same read as the
            # reply must not be lost.
            for message in channel.read_available():
                if message.get("op") == "exit":
                    self._record_exit(int(message["pid"]), int(message["returncode"]))
                elif message.get("op") == op and (ident is None or message.get("id") == ident):
                    found = message
            if found is not None:
                return found
            if channel.closed:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            channel.wait_readable(remaining)

    def _record_exit(self, pid: int, returncode: int) -> None:
        if pid in self._children:
            self._children.discard(pid)
            self._exits.append(Exit(pid, returncode))
            # The message may have been read while waiting for a spawn reply, so the pipe
            # will not become readable for it again: wake the loop explicitly.
            if self._wake is not None:
                self._wake()

    def _on_readable(self) -> None:
        channel = self._channel
        if channel is None:
            return
        for message in channel.read_available():
            if message.get("op") == "exit":
                self._record_exit(int(message["pid"]), int(message["returncode"]))
        if channel.closed:
            self._server_lost()
        if self._wake is not None:
            self._wake()

    def _server_lost(self) -> None:
        proc, channel = self._proc, self._channel
        self._proc = self._channel = None
        if channel is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                asyncio.get_running_loop().remove_reader(channel.fd)
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
            _log.error(
                "forkserver_lost", pid=proc.pid, returncode=proc.returncode, children=len(self._children)
            )
        # Its children got their parent-death signal; report them as killed so they are restarted.
        for pid in sorted(self._children):
            self._exits.append(Exit(pid, -signal.SIGKILL))
        self._children.clear()

    def spawn(self, spec: ChildSpec) -> int:
        """Ask the helper to fork a child running ``plugvisor <args>``."""
        if self._proc is None or self._channel is None:
            self._start_server()
        assert self._proc is not None
        assert self._proc.stdin is not None
        assert self._channel is not None
        self._next_id += 1
        request = {"op": "spawn", "id": self._next_id, "args": list(spec.args), "env": self._env}
        try:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError as exc:
            self._server_lost()
            raise SpawnError(f"the fork server is gone: {exc}") from exc
        reply = self._await(self._channel, "spawned", time.monotonic() + 10.0, self._next_id)
        if self._channel.closed:
            self._server_lost()
        if reply is None:
            raise SpawnError("the fork server did not answer within 10 s")
        if reply.get("error"):
            raise SpawnError(str(reply["error"]))
        pid = int(reply["pid"])
        self._children.add(pid)
        return pid

    def kill(self, pid: int, sig: int) -> None:
        """Signal the child's process group (the supervisor may signal its grandchildren: same user)."""
        if pid in self._children:
            _signal_group(pid, sig)

    def reap(self) -> list[Exit]:
        """The exits the helper reported."""
        if self._channel is not None:
            self._on_readable_quiet()
        exits, self._exits = self._exits, []
        return exits

    def _on_readable_quiet(self) -> None:
        assert self._channel is not None
        for message in self._channel.read_available():
            if message.get("op") == "exit":
                self._record_exit(int(message["pid"]), int(message["returncode"]))
        if self._channel.closed:
            self._server_lost()

    async def close(self) -> None:
        """Close the helper's input: it exits (children must already be stopped)."""
        proc, channel = self._proc, self._channel
        self._proc = self._channel = None
        if proc is None:
            return
        if channel is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                asyncio.get_running_loop().remove_reader(channel.fd)
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        deadline = time.monotonic() + 2.0
        # Polled: waiting in a thread would make the process threaded, and the exec spawner's
        # preexec_fn must never run in a threaded process.
        while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@dataclass
class FakeSpawner:
    """A spawner for tests: records every call; exits are injected with :meth:`exit`.

    ``fail_next`` makes the next spawns raise :class:`SpawnError` with those messages.
    """

    next_pid: int = 100
    spawned: list[tuple[int, ChildSpec]] = field(default_factory=list)
    signals: list[tuple[int, int]] = field(default_factory=list)
    alive: set[int] = field(default_factory=set)
    fail_next: list[str] = field(default_factory=list)
    _exits: list[Exit] = field(default_factory=list)
    _wake: Wake | None = None

    async def open(self, wake: Wake) -> None:
        """Remember the wake callback."""
        self._wake = wake

    def spawn(self, spec: ChildSpec) -> int:
        """Hand out the next PID."""
        if self.fail_next:
            raise SpawnError(self.fail_next.pop(0))
        pid = self.next_pid
        self.next_pid += 1
        self.spawned.append((pid, spec))
        self.alive.add(pid)
        return pid

    def kill(self, pid: int, sig: int) -> None:
        """Record the signal (the process does not react until :meth:`exit`)."""
        self.signals.append((pid, sig))

    def exit(self, pid: int, returncode: int) -> None:
        """Make ``pid`` exit with ``returncode``."""
        self.alive.discard(pid)
        self._exits.append(Exit(pid, returncode))
        if self._wake is not None:
            self._wake()

    def reap(self) -> list[Exit]:
        """The injected exits."""
        exits, self._exits = self._exits, []
        return exits

    async def close(self) -> None:
        """Nothing to release."""

    def pids_for(self, resource: str) -> list[int]:
        """Every PID spawned for ``resource``, oldest first."""
        return [pid for pid, spec in self.spawned if spec.resource == resource]
