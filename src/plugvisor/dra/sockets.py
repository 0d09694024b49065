"""The driver's two sockets, served at fixed paths and served again whenever the file disappears.

A DRA driver's sockets have names the kubelet finds by convention
(``plugins/<driver>/dra.sock``, ``plugins_registry/<driver>-reg.sock``), not
per instance, so the rules of the device plugin's sockets apply in this form:

- never bind over a socket a live process serves (gRPC would take the path
  over silently): the path is probed first, and a live one is refused unless
  the caller takes it over on purpose (``replace``);
- never leave it world-accessible (bound under a tight umask, then 0600);
- make it appear only once it is served: it is bound under a hidden name
  (the plugin watcher ignores names starting with ``.``) and renamed into
  place after the server listens. A watcher that dials a socket the moment it
  appears would otherwise find nobody listening yet and back off (a second,
  in gRPC's dial);
- keep it: a deleted socket (an operator's ``rm``, a clean-up script, a
  directory wiped and made again) is served again at once. For the
  registration socket that is what makes the kubelet register the driver
  again; without it the driver would stay unregistered until it restarted.

A socket replaced by a live process is not taken back: that is another driver
of the same name taking over on purpose (``--replace``: the agent's child
replacing one started by hand, a second agent, a new DaemonSet pod started
before the old one stops). The socket stops serving (so the kubelet's
connection moves to the newcomer) and stands by; once nobody answers at the
path any more, it is served again. Taking it back would make the two take it
from each other for ever.

Serving again means a fresh gRPC server: stopping the old one deletes the
socket file at its path (gRPC does), so the old one is stopped first and the
new one bound after. Calls in flight on the old one are cancelled; the kubelet
retries them, and every call of the driver is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Final

import grpc
import structlog
from asyncinotify import Mask

from plugvisor.common import inotify as inotify_
from plugvisor.common.sockets import owner_only, socket_answers, socket_path_problem
from plugvisor.deviceplugin.errors import ConfigurationError, SocketInUseError

CHECK_INTERVAL: Final = 5.0
"""Seconds between two looks at the sockets besides inotify (a directory replaced behind our back)."""
_MASK: Final = Mask.DELETE | Mask.MOVED_FROM | Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.ONLYDIR


class KeptSocket:
    """One gRPC server on one socket path, started again whenever the file is gone."""

    def __init__(
        self,
        path: Path,
        handlers: Sequence[grpc.GenericRpcHandler],
        *,
        role: str,
        replace: bool = False,
        directory_mode: int = 0o750,
    ) -> None:
        self.path = path
        self.role = role
        self._handlers = tuple(handlers)
        self._replace = replace
        self._directory_mode = directory_mode
        self._server: grpc.aio.Server | None = None
        self._inode: tuple[int, int] | None = None
        self.served = 0
        """How many times the socket was bound (1 after start, +1 per re-creation)."""
        self.standing_by = False
        """Another live process took the path over; this one does not serve until it is gone."""
        self._log = structlog.get_logger("plugvisor.dra.socket").bind(role=role, socket=str(path))

    async def start(self) -> None:
        """Bind and serve; :class:`SocketInUseError` if a live process serves the path, unless ``replace``."""
        problem = socket_path_problem(self.path)
        if problem is not None:
            raise ConfigurationError(f"{problem}: use a shorter kubelet directory")
        self.path.parent.mkdir(mode=self._directory_mode, parents=True, exist_ok=True)
        # What is at the path stays until the rename below replaces it: never a moment without a
        # socket there, which another process of the driver would take for its own socket gone.
        if (
            (self.path.exists() or self.path.is_symlink())
            and not self._replace
            and await asyncio.to_thread(socket_answers, self.path)
        ):
            raise SocketInUseError(
                f"{self.path} is served by another live process; refusing to take it over "
                "(stop the other driver, or take over with --replace)"
            )
        # Hidden (the plugin watcher skips dot files) and no longer than the socket's own name: a path
        # that fits the unix socket limit must fit while it is bound too.
        binding = self.path.with_name(f".{self.path.name[:-1]}")
        binding.unlink(missing_ok=True)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(self._handlers)
        try:
            with owner_only():
                bound = server.add_insecure_port(f"unix:{binding}")
        except RuntimeError:  # grpc.aio raises where grpc returns 0
            bound = 0
        if not bound:
            raise ConfigurationError(f"could not bind the {self.role} socket {binding}")
        await server.start()
        self._server = server
        self.served += 1
        try:
            binding.chmod(stat.S_IRUSR | stat.S_IWUSR)
            info = binding.lstat()
            binding.replace(self.path)
            self._inode = (info.st_dev, info.st_ino)
        except FileNotFoundError:  # the directory was wiped meanwhile: the keeper serves it again
            self._inode = None
        self._log.info("serving", times=self.served)

    def is_ours(self) -> bool:
        """Whether the path is still the socket this server bound (not gone, not replaced)."""
        try:
            info = self.path.lstat()
        except OSError:
            return False
        return self._inode == (info.st_dev, info.st_ino) and stat.S_ISSOCK(info.st_mode)

    async def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving; the socket file goes with the server (when it is still ours)."""
        server, self._server = self._server, None
        if server is None:
            return
        await server.stop(grace)
        if self.is_ours():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._inode = None

    async def serve_again(self) -> None:
        """The file is gone (or dead): stop the old server, then serve a fresh socket at the path."""
        self._log.warning("socket_gone", meaning="serving it again")
        await self.stop(grace=1.0)
        self._replace = True  # whatever is at the path now answers nobody: not a live driver
        await self.start()
        self.standing_by = False

    async def stand_by(self) -> None:
        """Another live process serves the path now: stop serving, leave its socket alone."""
        self._log.warning(
            "taken_over",
            meaning="another live process of this driver serves the socket now; this one stands by and "
            "serves it again when that one is gone",
        )
        self.standing_by = True
        await self.stop(grace=1.0)


async def keep(
    sockets: Sequence[KeptSocket],
    *,
    check_interval: float = CHECK_INTERVAL,
    on_change: Callable[[KeptSocket], Awaitable[None]] | None = None,
    on_gone: Callable[[KeptSocket], None] | None = None,
) -> None:
    """Serve every socket again as soon as its file disappears; runs until cancelled.

    inotify on each socket's directory wakes this at once (on the process's one
    instance; polled every :data:`~plugvisor.common.inotify.POLL_INTERVAL` seconds
    when the node's inotify budget is spent); a look every ``check_interval``
    seconds covers what inotify cannot see (a directory deleted and made again:
    the watch went with the old one). A socket another
    live process now serves is left to it (:meth:`KeptSocket.stand_by`) until
    nobody answers there. They are served again in their order, each only once
    those before it are ours: the kubelet registers a driver the moment its
    registration socket (the last) appears, and dials its DRA socket at once
    (after a takeover, the other process may still be closing it). ``on_change``
    hears a socket that started or stopped standing by; ``on_gone`` hears a
    socket found no longer ours (gone, dead or taken over), before anything is
    done about it.
    """
    log = structlog.get_logger("plugvisor.dra.socket")
    with inotify_.open_watches(poll_interval=inotify_.POLL_INTERVAL) as inotify:
        # Only our sockets' names matter: plugins_registry holds every driver's and plugin's, and
        # each of their events would wake this loop for a look at all of ours.
        inotify.narrow(tuple(sorted({kept.path.name for kept in sockets})) or ("",))
        watched: set[Path] = set()
        while True:
            for directory in {kept.path.parent for kept in sockets} - watched:
                with contextlib.suppress(OSError):
                    inotify.add_watch(directory, _MASK)
                    watched.add(directory)
            waiting = False
            for kept in sockets:
                if kept.is_ours():
                    continue
                if on_gone is not None and not kept.standing_by:
                    on_gone(kept)
                was_standing_by = kept.standing_by
                try:
                    if await asyncio.to_thread(_served_by_another, kept.path):
                        if not was_standing_by:
                            await kept.stand_by()
                    elif not waiting:
                        await kept.serve_again()
                except (OSError, ConfigurationError, SocketInUseError) as exc:
                    log.error("socket_not_served", socket=str(kept.path), error=str(exc))
                if kept.standing_by != was_standing_by and on_change is not None:
                    await on_change(kept)
                waiting = waiting or not kept.is_ours()
            try:
                event = await asyncio.wait_for(inotify.get(), check_interval)
            except TimeoutError:
                continue
            if event.mask & (Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED) and event.watch is not None:
                watched.discard(event.watch.path)


def _served_by_another(path: Path) -> bool:
    """Whether a socket (not a link to one elsewhere) is at ``path`` and a live process answers on it."""
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode):
            return False
    except OSError:
        return False
    return socket_answers(path)
