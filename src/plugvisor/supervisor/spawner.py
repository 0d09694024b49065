"""Creating, signalling and reaping child processes, behind one seam.

:class:`Spawner` is the seam (supervisord's ``options.fork/kill/waitpid``): the
state machine only ever calls ``spawn``, ``kill`` and ``reap``, so unit tests run
it with :class:`FakeSpawner`. ``spawn`` never blocks: it answers through a
callback, at once or later, so that a slow or dead fork server never stalls the
supervisor's loop. Two real implementations:

- :class:`ForkServerSpawner` (the default): a helper process, forked from the
  supervisor once its imports are done (:mod:`.forkserver`), imports the plugin
  command and its kinds (gRPC included, but it creates no gRPC object, so
  forking it is safe) and forks one child per request. A child is serving within
  ~30 ms instead of ~350 ms for a fresh interpreter, and every process shares
  the pages of what was imported once (each child's own memory is ~9 MB, the
  pages it copied on write). See docs/supervisor.md for the measurements. The
  supervisor is a child subreaper and the helper forks through an intermediate
  that exits at once, so every plugin is the supervisor's own child: the
  supervisor reaps it, and the helper can die (and be replaced) without taking
  any plugin with it. While no fork server can start, it starts children by
  fork+exec itself (the same reaper collects them), so a crashed child is always
  restarted.
- :class:`ExecSpawner`: plain fork+exec of ``python -m plugvisor plugin ...``; the
  fallback when the fork server cannot start with the agent, and a configuration choice.

Reaping is :class:`Reaper`'s alone: one ``waitpid(-1)`` loop for every child of
the supervisor (plugins, the helper, orphans it adopted), so that no exit status
is ever lost to, or stolen from, another waiter.

Both put each child in its own process group (a stop reaches any helper it
started; a terminal's Ctrl-C reaches only the supervisor, which stops children
in order) and give it a parent-death signal, so that no child outlives the
supervisor. The supervisor itself never imports gRPC: the fork server imports
it after it was forked.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import structlog

from plugvisor.supervisor import forkserver, prctl
from plugvisor.supervisor.config import ChildSpec
from plugvisor.supervisor.prctl import CHILD_DEATH_SIGNAL

_log = structlog.get_logger("plugvisor.supervisor.spawner")


class SpawnError(Exception):
    """A child process could not be created (the message says why).

    ``helper_fault``: the fork server failed (died, hung, never became ready),
    not anything about the child; such a failure counts against no child.
    """

    def __init__(self, message: str, *, helper_fault: bool = False) -> None:
        super().__init__(message)
        self.helper_fault = helper_fault


@dataclass(frozen=True, slots=True)
class Exit:
    """A child process ended: its status as ``subprocess`` reports it (negative: killed by a signal)."""

    pid: int
    returncode: int


class _Process(Protocol):
    """A child process the reaper records the exit of: ``subprocess.Popen`` or a forked fork server."""

    pid: int
    returncode: int | None


Wake = Callable[[], None]
SpawnDone = Callable[[int | SpawnError], None]
"""Receives the new process's PID, or the reason it could not be created."""


class Spawner(Protocol):
    """**Protocol:** what the supervisor needs from process creation.

    ``spawn`` starts creating a process for ``spec`` and calls ``done`` with its
    PID or a :class:`SpawnError`, either before returning or later from the event
    loop; it never blocks. ``kill`` signals a child (its process group) and
    ignores one that is already gone; ``reap`` returns, without blocking, the
    exits since the last call, each only after its ``done`` was called. ``open``
    receives a callback to call whenever ``reap`` has something new.
    """

    @property
    def fallback(self) -> str | None:
        """Why children are started by fork+exec although the fork server was chosen (None: they are not)."""
        ...

    async def open(self, wake: Wake) -> None:
        """Get ready to spawn; call ``wake`` when exits are waiting."""
        ...

    def spawn(self, spec: ChildSpec, done: SpawnDone) -> None:
        """Start a process for ``spec``; report it through ``done``."""
        ...

    def kill(self, pid: int, sig: int) -> None:
        """Send ``sig`` to the child ``pid``."""
        ...

    def refresh(self, preload_kinds: Sequence[str], *, dra: bool = False) -> None:
        """Create the next children with the code installed now, with these kinds (and DRA) loaded ahead."""
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


class Reaper:
    """Every ``waitpid`` of the supervisor: exits of our children, kept until claimed.

    Processes started with ``subprocess.Popen`` (or forked: the fork server) are
    registered with :meth:`track` and get their ``returncode`` set here, so
    ``Popen`` itself never waits on a PID that may, by then, belong to another
    child. An exit whose PID nobody has claimed yet (a plugin that died before
    its spawn answer was read, or an orphan we adopted) is kept for
    :data:`UNCLAIMED_TTL` seconds.
    """

    UNCLAIMED_TTL: Final = 60.0

    def __init__(self) -> None:
        self._popens: dict[int, tuple[_Process, bool]] = {}
        self._unclaimed: dict[int, tuple[int, float]] = {}

    def track(self, proc: _Process, *, report: bool = False) -> None:
        """Let the reaper set ``proc.returncode`` when it exits (and report the exit if ``report``).

        Keeping the ``Popen`` referenced until then also keeps it out of
        ``subprocess``'s own list of abandoned children, which it polls, by PID,
        whenever another ``Popen`` is created.
        """
        self._popens[proc.pid] = (proc, report)

    def collect(self) -> list[Exit]:
        """Reap every child that has ended; returns every exit but those of quietly tracked ``Popen``s."""
        exits = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            tracked = self._popens.pop(pid, None)
            if tracked is not None:
                tracked[0].returncode = code
                if not tracked[1]:
                    continue
            exits.append(Exit(pid, code))
        return exits

    def keep_unclaimed(self, exit_: Exit) -> None:
        """Hold an exit whose PID is not known (yet)."""
        now = time.monotonic()
        self._unclaimed[exit_.pid] = (exit_.returncode, now)
        for pid, (_, at) in list(self._unclaimed.items()):
            if now - at > self.UNCLAIMED_TTL:
                del self._unclaimed[pid]

    def claim(self, pid: int) -> Exit | None:
        """The exit of ``pid`` if it was reaped before anybody knew the PID."""
        found = self._unclaimed.pop(pid, None)
        return None if found is None else Exit(pid, found[0])


def _exec(spec: ChildSpec, env: Mapping[str, str], reaper: Reaper) -> int | SpawnError:
    """fork+exec the child's command line, its exit left to ``reaper``; its PID or why there is none."""
    parent = os.getpid()

    def in_child() -> None:
        os.setpgid(0, 0)
        prctl.die_with_parent(CHILD_DEATH_SIGNAL, parent)

    try:
        proc = subprocess.Popen(
            spec.argv(),
            env=env,
            stdin=subprocess.DEVNULL,
            preexec_fn=in_child,  # noqa: PLW1509 - the supervisor runs no threads
            close_fds=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return SpawnError(f"cannot start {spec.argv()[0]}: {exc}")
    # The reaper, not Popen, waits for it: one waitpid(-1) loop owns every status.
    reaper.track(proc, report=True)
    return proc.pid


class ExecSpawner:
    """fork+exec of ``python -m plugvisor plugin ...`` per child; reaped on SIGCHLD."""

    def __init__(self, env: Mapping[str, str], *, fallback: str | None = None) -> None:
        """``fallback``: why this spawner replaces the fork server that was chosen (it could not start)."""
        self._env = dict(env)
        self._children: set[int] = set()
        self._reaper = Reaper()
        self._wake: Wake | None = None
        self.fallback = fallback

    async def open(self, wake: Wake) -> None:
        """Reap on SIGCHLD (no thread: preexec_fn must not fork a threaded process)."""
        self._wake = wake
        asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, wake)

    def spawn(self, spec: ChildSpec, done: SpawnDone) -> None:
        """fork+exec the child's command line; answers before returning."""
        result = _exec(spec, self._env, self._reaper)
        if isinstance(result, int):
            self._children.add(result)
        done(result)

    def kill(self, pid: int, sig: int) -> None:
        """Signal the child's process group."""
        if pid in self._children:
            _signal_group(pid, sig)

    def refresh(self, preload_kinds: Sequence[str], *, dra: bool = False) -> None:
        """Nothing to do: every child is a fresh interpreter, which imports what is installed."""

    def reap(self) -> list[Exit]:
        """Every child that has ended (waitpid WNOHANG)."""
        exits = []
        for exit_ in self._reaper.collect():
            if exit_.pid in self._children:
                self._children.discard(exit_.pid)
                exits.append(exit_)
        return exits

    async def close(self) -> None:
        """Stop reaping on SIGCHLD."""
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)


class _LineChannel:
    """Newline-delimited JSON read from a non-blocking pipe, lines of any length."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()
        self.closed = False
        """The writers have closed their end (no more messages will come)."""
        self._open = True
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
        end = self._buffer.rfind(b"\n")
        if end < 0:
            return messages
        lines = bytes(self._buffer[:end]).split(b"\n")
        del self._buffer[: end + 1]
        for line in lines:
            if line.strip():
                with contextlib.suppress(ValueError):
                    messages.append(json.loads(line))
        return messages

    def close(self) -> None:
        """Stop reading and close our end (once: the number may belong to another file afterwards)."""
        if not self._open:
            return
        self._open = False
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self.fd)
        with contextlib.suppress(OSError):
            os.close(self.fd)


class _Outbox:
    """Bytes waiting for a non-blocking pipe, written as fast as the reader takes them; owns the pipe.

    A pipe holds 64 KiB; one request can be as large (a resource's options travel
    on its command line) and hundreds are sent at once when the agent starts or
    reloads. What does not fit waits here, and the event loop writes it when the
    pipe has room again: no request is ever dropped for a full pipe, nor the
    loop blocked by one.
    """

    def __init__(self, fd: int, on_error: Callable[[OSError], None]) -> None:
        """``on_error``: the reader went away while bytes were waiting (the pipe is closed)."""
        self._fd = fd
        self._on_error = on_error
        self._chunks: collections.deque[memoryview] = collections.deque()
        self._watching = False
        self._close_when_sent = False
        os.set_blocking(fd, False)

    def put(self, data: bytes) -> None:
        """Queue ``data`` and write what the pipe takes now (raises OSError if the reader is gone)."""
        self._chunks.append(memoryview(data))
        self._flush()

    def finish(self) -> None:
        """Close the pipe once everything queued is written (the reader then sees its end)."""
        self._close_when_sent = True
        self._flush_or_fail()

    def _flush(self) -> None:
        """Write until the pipe is full or nothing is left; watch for room while something is left."""
        if self._fd < 0:
            return
        while self._chunks:
            try:
                written = os.write(self._fd, self._chunks[0])
            except BlockingIOError:
                break
            if written == len(self._chunks[0]):
                self._chunks.popleft()
            else:
                self._chunks[0] = self._chunks[0][written:]
        loop = asyncio.get_running_loop()
        if self._chunks and not self._watching:
            loop.add_writer(self._fd, self._flush_or_fail)
            self._watching = True
        elif not self._chunks:
            if self._watching:
                loop.remove_writer(self._fd)
                self._watching = False
            if self._close_when_sent:
                self.close()

    def _flush_or_fail(self) -> None:
        try:
            self._flush()
        except OSError as exc:
            self.close()
            self._on_error(exc)

    def close(self) -> None:
        """Drop what is left and close the pipe (once)."""
        self._chunks.clear()
        if self._fd < 0:
            return
        if self._watching:
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                asyncio.get_running_loop().remove_writer(self._fd)
            self._watching = False
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1


class _Helper:
    """One fork-server process, its pipes, its readiness and its progress."""

    def __init__(self, proc: forkserver.Forked, on_input_error: Callable[[OSError], None]) -> None:
        self.proc = proc
        self.outbox = _Outbox(proc.requests, on_input_error)
        self.channel = _LineChannel(proc.answers)
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.started: asyncio.Task[None] | None = None
        self.ready_at: float | None = None
        self.lost = False
        self.retired = False
        """Replaced by a fork server with newer code: it exits once it has answered what it was sent."""
        self.waiting = 0
        """Requests sent to it and not answered yet."""
        self.progress_at = time.monotonic()
        """When it last answered, or last had nothing to do: the watchdog measures from there."""
        self.watchdog: asyncio.TimerHandle | None = None

    def close_pipes(self) -> None:
        """Stop reading and writing (once): its input closes, so it exits after what it was sent."""
        self.outbox.close()
        self.channel.close()
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None


@dataclass(slots=True)
class _Pending:
    """A spawn request that has no answer yet."""

    spec: ChildSpec
    done: SpawnDone
    helper: _Helper
    losses: tuple[str, ...]
    """Why the fork servers it was sent to before were lost (it is sent once more after the first)."""


class ForkServerSpawner:
    """Children forked by a warm helper process (``plugvisor.supervisor.forkserver``), reaped by us.

    The supervisor becomes a child subreaper; the helper forks each child through
    an intermediate that exits at once, so each child is re-parented to the
    supervisor, which reaps it. If the helper dies, nothing happens to any child:
    the next spawn starts a new helper and waits for its readiness without
    blocking the loop.

    Requests are written through an :class:`_Outbox` (flow control: as fast as the
    helper reads, whatever their number and size) and the helper answers each.
    It is taken for lost only when it is: its output closed (it exited), its
    input refused (it exited), its start failed, or it answered nothing for
    ``spawn_timeout`` seconds while requests waited (hung). A slow helper working
    through a long queue is not hung. A request whose helper was lost is sent once
    more to a new one (lost twice, it is started by fork+exec); failures reach
    ``done``, never the caller.

    The fork server is unavailable when a new one cannot start (it failed its
    preload, died or hung before it was ready, or could not be forked) or its
    replacement is held back (they keep dying young). Children are then started
    by fork+exec from here, as :class:`ExecSpawner` does, until a fork server is
    ready again: said once, and shown as :attr:`fallback`. A fork server that
    reported it cannot load the code (plugvisor upgraded in place: it is forked
    from the agent's modules, older than the files beside them) would fail the
    same way every time, so none is started again until :meth:`refresh`; only a
    new agent process loads the new code whole.
    """

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        preload_kinds: Sequence[str] = (),
        preload_dra: bool = False,
        start_timeout: float = 60.0,
        spawn_timeout: float = 10.0,
    ):
        """``env``: every child's environment; ``preload_kinds``: the kinds the fork server loads first.

        ``preload_dra``: the DRA driver's side too (a node with ``mode: dra`` entries).
        """
        self._env = dict(env)
        self._preload = list(preload_kinds)
        self._preload_dra = preload_dra
        self._start_timeout = start_timeout
        self._spawn_timeout = spawn_timeout
        self._helper: _Helper | None = None
        self._children: set[int] = set()
        self._exits: list[Exit] = []
        self._pending: dict[int, _Pending] = {}
        self._reaper = Reaper()
        self._wake: Wake | None = None
        self._next_id = 0
        self._closing = False
        self._opened = False
        self._young_deaths = 0
        self._replacement: asyncio.TimerHandle | None = None
        self._retired: set[_Helper] = set()
        self._fallback: str | None = None
        self._gave_up = False
        """A fork server said it cannot load the code: none is started again until :meth:`refresh`."""
        self.helpers_started = 0

    @property
    def fallback(self) -> str | None:
        """Why children are started by fork+exec now (no fork server is ready), or None."""
        return self._fallback

    async def open(self, wake: Wake) -> None:
        """Become a subreaper, start the helper and wait until it is ready (raises SpawnError if not)."""
        self._wake = wake
        try:
            prctl.become_subreaper()
        except OSError as exc:
            raise SpawnError(f"cannot adopt the fork server's children: {exc}") from exc
        asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, self._on_sigchld)
        helper = self._start_helper()
        assert helper.started is not None
        await helper.started
        self._opened = True

    def _start_helper(self) -> _Helper:
        try:
            proc = forkserver.fork(self._env, self._preload, dra=self._preload_dra)
        except OSError as exc:
            raise SpawnError(f"cannot start the fork server: {exc}") from exc
        self._reaper.track(proc)
        helper = _Helper(proc, lambda exc: self._helper_lost(helper, _input_refused(exc)))
        self._helper = helper
        self.helpers_started += 1
        loop = asyncio.get_running_loop()
        loop.add_reader(helper.channel.fd, self._on_readable, helper)
        helper.started = loop.create_task(self._await_ready(helper), name="forkserver-start")
        return helper

    async def _await_ready(self, helper: _Helper) -> None:
        started = time.monotonic()
        try:
            ready = await asyncio.wait_for(asyncio.shield(helper.ready), self._start_timeout)
        except TimeoutError:
            reason = f"it did not start within {self._start_timeout:g} s"
        except SpawnError as exc:
            reason = str(exc)
        else:
            reason = "" if not ready.get("error") else f"it did not start: {ready['error']}"
        if reason:
            self._helper_lost(helper, reason, quiet=True)
            raise SpawnError(helper_fault=True, message=f"the fork server is unavailable: {reason}")
        helper.ready_at = helper.progress_at = time.monotonic()
        self._arm_watchdog(helper)
        _log.info(
            "forkserver_ready",
            pid=helper.proc.pid,
            seconds=round(helper.ready_at - started, 3),
            n=self.helpers_started,
        )
        if self._fallback is not None and helper is self._helper:
            self._fallback = None
            self._gave_up = False
            _log.info("forkserver_available", pid=helper.proc.pid, note="children are forked from it again")

    def _on_readable(self, helper: _Helper) -> None:
        for message in helper.channel.read_available():
            op = message.get("op")
            if op == "ready" and not helper.ready.done():
                helper.ready.set_result(message)
            elif op == "spawned":
                helper.progress_at = time.monotonic()
                self._answered(message)
        if helper.channel.closed:
            self._helper_lost(helper, "it exited")

    def _answered(self, message: dict[str, Any]) -> None:
        ident = message.get("id")
        pending = self._pending.pop(ident, None) if isinstance(ident, int) else None
        if pending is None:
            pid = message.get("pid")
            if isinstance(pid, int) and pid > 1:
                # An answer nobody waits for any more: nobody tracks that process, so it
                # must not run (it would register the resource behind our back).
                _log.warning("forkserver_late_answer", id=ident, pid=pid, action="killed")
                _signal_group(pid, signal.SIGKILL)
            return
        pending.helper.waiting -= 1
        pid = message.get("pid")
        if message.get("error") or not isinstance(pid, int):
            pending.done(SpawnError(str(message.get("error") or "the fork server gave no PID")))
            return
        self._children.add(pid)
        pending.done(pid)
        early = self._reaper.claim(pid)
        if early is not None:
            # It died before its answer was read: the exit was reaped and kept for now.
            self._children.discard(pid)
            self._exits.append(early)
            self._poke()

    def _arm_watchdog(self, helper: _Helper) -> None:
        """Check the helper's progress ``spawn_timeout`` after it last made some, while requests wait."""
        if helper.watchdog is not None or helper.ready_at is None or helper.lost or not helper.waiting:
            return
        due = max(0.0, helper.progress_at + self._spawn_timeout - time.monotonic())
        helper.watchdog = asyncio.get_running_loop().call_later(due, self._check_progress, helper)

    def _check_progress(self, helper: _Helper) -> None:
        helper.watchdog = None
        if helper.lost or not helper.waiting or self._closing:
            return
        if time.monotonic() - helper.progress_at < self._spawn_timeout:
            self._arm_watchdog(helper)
            return
        # It has requests and has answered none of them for that long: stopped or stuck.
        # It would never answer the later ones either. Replace it.
        _log.warning("forkserver_hung", pid=helper.proc.pid, waiting=helper.waiting, action="replaced")
        self._helper_lost(helper, f"it answered nothing for {self._spawn_timeout:g} s")

    def _helper_lost(self, helper: _Helper, reason: str, *, quiet: bool = False) -> None:
        """The helper exited, hung or failed to start: forget it; its requests go to a new one, once.

        ``quiet``: expected (retired, or before :meth:`open` returned, whose caller
        hears of it): not logged.
        """
        if helper.lost:
            # Once only: the second call would act on fd numbers that a newer helper may own by now.
            return
        helper.lost = True
        self._retired.discard(helper)
        quiet = quiet or helper.retired
        if self._helper is helper:
            self._helper = None
        if helper.proc.returncode is None:
            # Its whole group: intermediates that have not answered yet go with it.
            _signal_group(helper.proc.pid, signal.SIGKILL)
        helper.close_pipes()
        refused = _start_refused(helper.ready)
        if refused is not None:
            reason = refused  # what it said before it exited, rather than that it exited
        elif not helper.ready.done():
            helper.ready.set_exception(SpawnError(helper_fault=True, message=reason))
            helper.ready.exception()  # retrieved: whoever awaits it gets it through the shield
        replace = self._opened and not self._closing and not helper.retired
        if replace and helper.ready_at is None:
            # A replacement that never became ready: no fork server to send children to.
            self._fall_back(f"a new fork server did not start: {reason}", for_good=refused is not None)
        elif not quiet:
            _log.warning(
                "forkserver_lost",
                pid=helper.proc.pid,
                reason=reason,
                children=len(self._children),
                note="children keep running; a new fork server starts",
            )
        retry = [(i, p) for i, p in self._pending.items() if p.helper is helper]
        for ident, pending in retry:
            del self._pending[ident]
            if pending.losses or self._fallback is not None:
                self._exec(pending.spec, pending.done)
            else:
                self._request(pending.spec, pending.done, losses=(reason,))
        if replace and self._helper is None and self._replacement is None and not self._gave_up:
            young = helper.ready_at is None or time.monotonic() - helper.ready_at < 1.0
            self._schedule_replacement(young=young)

    def _fall_back(self, reason: str, *, for_good: bool) -> None:
        """No fork server is ready: children are started by fork+exec until one is (said once).

        ``for_good``: it cannot load the code, and never will in this process.
        """
        self._gave_up = self._gave_up or for_good
        if self._fallback is not None:
            return
        self._fallback = reason
        if for_good:
            until = "until the agent is restarted (a restart of the agent brings the fork server back)"
        else:
            until = "until a new fork server is ready (a restart of the agent brings it back too)"
        _log.warning(
            "forkserver_unavailable",
            error=reason,
            fallback="exec",
            note=f"children are started by exec, slower to start, {until}",
        )

    def _exec(self, spec: ChildSpec, done: SpawnDone) -> None:
        """Start the child by fork+exec, without the fork server; reaped here like every other child."""
        result = _exec(spec, self._env, self._reaper)
        if isinstance(result, int):
            self._children.add(result)
        done(result)

    def _schedule_replacement(self, *, young: bool) -> None:
        """Start the next helper ahead of need, so that the next crash is restarted as fast as ever.

        Helpers that keep dying young (before they were ready, or within a second of
        it: an OOM loop) are replaced after a growing delay instead of in a tight
        loop; children are started by fork+exec meanwhile.
        """
        self._young_deaths = self._young_deaths + 1 if young else 0
        if self._young_deaths <= 1:
            self._start_in_background()
            return
        delay = min(30.0, 0.5 * 2 ** (self._young_deaths - 2))
        self._fall_back(
            f"{self._young_deaths} fork server(s) in a row ended within a second of starting; "
            f"the next one starts in {delay:g} s",
            for_good=False,
        )
        self._replacement = asyncio.get_running_loop().call_later(delay, self._replace)

    def _replace(self) -> None:
        self._replacement = None
        if not self._closing and self._helper is None and not self._gave_up:
            self._start_in_background()

    def _start_in_background(self) -> _Helper | None:
        """A new helper, its readiness awaited by nobody (a failure is logged, and handled, when it comes)."""
        try:
            helper = self._start_helper()
        except SpawnError as exc:
            self._fall_back(str(exc), for_good=False)
            if self._replacement is None:
                self._schedule_replacement(young=True)
            return None
        assert helper.started is not None
        helper.started.add_done_callback(lambda task: task.cancelled() or task.exception())
        return helper

    def refresh(self, preload_kinds: Sequence[str], *, dra: bool = False) -> None:
        """From now on fork children from a new fork server, forked now (with the code this process has now).

        The current one is retired: it answers what it was sent, then its input
        closes and it exits. Its children run on, as ever. Called on a reload that
        changed the kinds in use or their installed code (this process has just
        imported the new code to validate the file).
        """
        self._preload = list(preload_kinds)
        self._preload_dra = dra
        helper, self._helper = self._helper, None
        if self._closing:
            return
        if helper is not None:
            helper.retired = True
            self._retired.add(helper)
            helper.outbox.finish()
        if self._replacement is not None:
            return  # a replacement is due (fork servers keep dying young): it will have the new code
        self._gave_up = False  # the new code may load where the old could not: worth one more try
        if self._start_in_background() is not None:
            retired = None if helper is None else helper.proc.pid
            _log.info("forkserver_refreshed", kinds=self._preload, dra=dra, retired=retired)

    def spawn(self, spec: ChildSpec, done: SpawnDone) -> None:
        """Ask the helper (started now if there is none) to fork a child running ``plugvisor <args>``."""
        self._request(spec, done, losses=())

    def _request(self, spec: ChildSpec, done: SpawnDone, *, losses: tuple[str, ...]) -> None:
        helper = self._helper
        if helper is None and self._replacement is None and not self._gave_up:
            helper = self._start_in_background()
        if helper is None:
            # None can start now (a replacement is held back, or none can load the code).
            self._exec(spec, done)
            return
        self._next_id += 1
        ident = self._next_id
        self._pending[ident] = _Pending(spec, done, helper, losses)
        if not helper.waiting:
            helper.progress_at = time.monotonic()  # it had nothing to do until now
        helper.waiting += 1
        request = {"op": "spawn", "id": ident, "args": list(spec.args)}
        try:
            # Written even before the helper is ready: it reads once its preload is done.
            helper.outbox.put(json.dumps(request, separators=(",", ":")).encode() + b"\n")
        except OSError as exc:
            self._helper_lost(helper, _input_refused(exc))
            return
        self._arm_watchdog(helper)

    def _on_sigchld(self) -> None:
        self._collect()
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake()

    def _collect(self) -> None:
        for exit_ in self._reaper.collect():
            if exit_.pid in self._children:
                self._children.discard(exit_.pid)
                self._exits.append(exit_)
            else:
                self._reaper.keep_unclaimed(exit_)

    def kill(self, pid: int, sig: int) -> None:
        """Signal the child's process group (it is our own child)."""
        if pid in self._children:
            _signal_group(pid, sig)

    def reap(self) -> list[Exit]:
        """The exits of our children since the last call."""
        self._collect()
        exits, self._exits = self._exits, []
        return exits

    async def close(self) -> None:
        """Close the helper's input: it exits (children must already be stopped)."""
        self._closing = True
        if self._replacement is not None:
            self._replacement.cancel()
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)
        for pending in self._pending.values():
            pending.done(SpawnError("the agent is stopping"))
        self._pending.clear()
        helpers = [*self._retired, *([self._helper] if self._helper is not None else [])]
        self._helper = None
        self._retired.clear()
        for helper in helpers:
            if helper.started is not None and not helper.started.done():
                helper.started.cancel()
            helper.close_pipes()
        deadline = time.monotonic() + 2.0
        self._reaper.collect()
        while any(helper.proc.returncode is None for helper in helpers):
            if time.monotonic() > deadline:
                for helper in helpers:
                    if helper.proc.returncode is None:
                        _signal_group(helper.proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 2.0
            await asyncio.sleep(0.01)
            self._reaper.collect()


def _input_refused(exc: OSError) -> str:
    return f"its input was closed ({exc.strerror or exc}): it exited"


def _start_refused(ready: asyncio.Future[dict[str, Any]]) -> str | None:
    """What a fork server said when it could not start (a failed preload), if it said so."""
    if not ready.done() or ready.cancelled() or ready.exception() is not None:
        return None
    error = ready.result().get("error")
    return None if not error else str(error)


def start_slots(spawner: Spawner) -> int:
    """How many children may start at once: a few per core, fewer when each start is a fresh interpreter."""
    cores = len(os.sched_getaffinity(0))
    return cores * (2 if isinstance(spawner, ExecSpawner) or spawner.fallback is not None else 8)


class StartLimiter:
    """At most ``slots`` children starting at once; the other spawns wait their turn, in order.

    A plugin's start is CPU work (a fresh interpreter's imports: ~0.35 s of one
    core; a forked child's start: ~40 ms), and each child has ``registrationTimeout``
    to register. 128 children started at once on two cores each got a 64th of
    the CPU: none registered in time, every one was restarted as unregistered,
    and the restarts started over (measured with ``spawner: exec``: 24 of 128
    registered after 300 s). Here a child holds its slot from its spawn until it
    says it serves (its first ``ENDPOINT=`` or ``REGISTERED=`` report, passed to
    :meth:`started`), exits, or cannot be spawned; a waiting spawn has no process
    yet, so nothing is blamed on it (the child is STARTING without a PID).
    """

    def __init__(self, inner: Spawner, slots: int | None = None) -> None:
        """``slots``: a fixed number; by default :func:`start_slots` of how ``inner`` starts children now."""
        self.inner = inner
        self._slots = slots
        self._waiting: collections.deque[tuple[ChildSpec, SpawnDone]] = collections.deque()
        self._in_flight = 0
        self._starting: set[int] = set()

    @property
    def slots(self) -> int:
        """How many children may be starting now (fewer while the fork server is unavailable)."""
        return max(1, self._slots if self._slots is not None else start_slots(self.inner))

    @property
    def fallback(self) -> str | None:
        """The inner spawner's."""
        return self.inner.fallback

    async def open(self, wake: Wake) -> None:
        """Open the inner spawner."""
        await self.inner.open(wake)

    def spawn(self, spec: ChildSpec, done: SpawnDone) -> None:
        """Spawn now if a slot is free, else when one is."""
        self._waiting.append((spec, done))
        self._admit()

    def started(self, pid: int) -> None:
        """The child ``pid`` serves (it reported so): its slot goes to the next waiting spawn."""
        if pid in self._starting:
            self._starting.discard(pid)
            self._admit()

    def _admit(self) -> None:
        slots = self.slots
        while self._waiting and self._in_flight + len(self._starting) < slots:
            spec, done = self._waiting.popleft()
            self._in_flight += 1
            self.inner.spawn(spec, functools.partial(self._answered, done))

    def _answered(self, done: SpawnDone, result: int | SpawnError) -> None:
        self._in_flight -= 1
        if isinstance(result, int):
            self._starting.add(result)
        done(result)
        self._admit()

    def kill(self, pid: int, sig: int) -> None:
        """Signal the child (through the inner spawner)."""
        self.inner.kill(pid, sig)

    def refresh(self, preload_kinds: Sequence[str], *, dra: bool = False) -> None:
        """Refresh the inner spawner."""
        self.inner.refresh(preload_kinds, dra=dra)

    def reap(self) -> list[Exit]:
        """The inner spawner's exits; each frees the slot its child still held."""
        exits = self.inner.reap()
        freed = False
        for exit_ in exits:
            if exit_.pid in self._starting:
                self._starting.discard(exit_.pid)
                freed = True
        if freed:
            self._admit()
        return exits

    async def close(self) -> None:
        """Fail the waiting spawns, then close the inner spawner."""
        waiting, self._waiting = self._waiting, collections.deque()
        for _, done in waiting:
            done(SpawnError("the agent is stopping"))
        await self.inner.close()


@dataclass
class FakeSpawner:
    """A spawner for tests: records every call; exits are injected with :meth:`exit`.

    ``fail_next`` makes the next spawns fail with those messages. Spawns answer
    before returning, unless ``deferred``: then they wait in ``waiting`` until
    :meth:`answer` (a fork server that is slow or being replaced).
    """

    next_pid: int = 100
    spawned: list[tuple[int, ChildSpec]] = field(default_factory=list)
    signals: list[tuple[int, int]] = field(default_factory=list)
    alive: set[int] = field(default_factory=set)
    fail_next: list[str] = field(default_factory=list)
    deferred: bool = False
    waiting: list[tuple[ChildSpec, SpawnDone]] = field(default_factory=list)
    refreshed: list[list[str]] = field(default_factory=list)
    fallback: str | None = None
    refreshed_dra: list[bool] = field(default_factory=list)
    _exits: list[Exit] = field(default_factory=list)
    _wake: Wake | None = None

    async def open(self, wake: Wake) -> None:
        """Remember the wake callback."""
        self._wake = wake

    def spawn(self, spec: ChildSpec, done: SpawnDone) -> None:
        """Hand out the next PID (now, or at :meth:`answer` when ``deferred``)."""
        if self.deferred:
            self.waiting.append((spec, done))
            return
        self._answer(spec, done)

    def answer(self, error: str | None = None) -> int | None:
        """Answer the oldest waiting spawn: its PID, or ``error``; returns the PID."""
        spec, done = self.waiting.pop(0)
        if error is not None:
            done(SpawnError(error))
            return None
        return self._answer(spec, done)

    def _answer(self, spec: ChildSpec, done: SpawnDone) -> int | None:
        if self.fail_next:
            done(SpawnError(self.fail_next.pop(0)))
            return None
        pid = self.next_pid
        self.next_pid += 1
        self.spawned.append((pid, spec))
        self.alive.add(pid)
        done(pid)
        return pid

    def kill(self, pid: int, sig: int) -> None:
        """Record the signal (the process does not react until :meth:`exit`)."""
        self.signals.append((pid, sig))

    def refresh(self, preload_kinds: Sequence[str], *, dra: bool = False) -> None:
        """Record the kinds (and whether DRA is preloaded, in :attr:`refreshed_dra`)."""
        self.refreshed.append(list(preload_kinds))
        self.refreshed_dra.append(dra)

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
