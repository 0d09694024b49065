"""How plugvisor names its plugin sockets, and the length limit every socket path must respect.

Each server instance of a resource gets a fresh file name in the kubelet's
directory, ``plugvisor-<slug>-<hash6>-<token>.sock``: readable (the name part of
the resource), unambiguous (a hash of the full name: two domains may share a
name part) and unique per instance (a random token), so a stale file can never
be mistaken for a live one. The plugin creates these names; the agent finds its
children's files by the same prefix (to notice their deletion, to clean up after
a crash) and checks the configured directory leaves room for them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from plugvisor.common.constants import MAX_UNIX_SOCKET_PATH

SOCKET_PREFIX: Final = "plugvisor-"
SOCKET_SUFFIX: Final = ".sock"
_SLUG_RE: Final = re.compile(r"[^a-z0-9]+")
_TOKEN_BYTES: Final = 4
_INSTANCE_PART_LENGTH: Final = len("-") + 2 * _TOKEN_BYTES + len(SOCKET_SUFFIX)


@contextlib.contextmanager
def owner_only() -> Iterator[None]:
    """Bind sockets in this block under umask 0177: the file is never, even briefly, open to others.

    bind() creates the socket file with the process's umask applied; setting
    the mode afterwards would leave a moment in which anyone could connect.
    The kubelet and the agent run as root and need nothing more.
    """
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def socket_prefix(resource: str) -> str:
    """The part of a socket file name that is the same for every instance of ``resource``."""
    name_part = resource.rsplit("/", 1)[-1].lower()
    slug = _SLUG_RE.sub("-", name_part).strip("-")[:24] or "resource"
    digest = hashlib.sha256(resource.encode()).hexdigest()[:6]
    return f"{SOCKET_PREFIX}{slug}-{digest}"


def socket_name(resource: str, token: str | None = None) -> str:
    """A new socket file name for one server instance of ``resource`` (``token``: fixed, for tests)."""
    return f"{socket_prefix(resource)}-{token or secrets.token_hex(_TOKEN_BYTES)}{SOCKET_SUFFIX}"


def is_plugvisor_socket(name: str) -> bool:
    """Whether a file name in the kubelet's directory is one of our plugin sockets."""
    return name.startswith(SOCKET_PREFIX) and name.endswith(SOCKET_SUFFIX)


def longest_socket_path(kubelet_dir: Path, resource: str) -> int:
    """The length in bytes of every socket path of ``resource`` in ``kubelet_dir``."""
    return len(os.fsencode(kubelet_dir)) + 1 + len(socket_prefix(resource)) + _INSTANCE_PART_LENGTH


def socket_path_problem(path: Path) -> str | None:
    """Why a unix socket cannot be bound at ``path`` (too long for ``sun_path``); None when it can."""
    length = len(os.fsencode(path))
    if length > MAX_UNIX_SOCKET_PATH:
        return f"socket path {str(path)!r} is {length} bytes; unix sockets allow {MAX_UNIX_SOCKET_PATH}"
    return None


BIND_TO_LISTEN: Final = 2.0
"""Seconds a socket file may exist and not answer before it counts as dead.

A server's file exists from its bind, a moment before it listens: another plugin
of the resource starting at the same time has a socket that does not answer yet
and must not be taken for a dead one (nor for no plugin at all). gRPC binds and
listens in one call, so this is generous even on a loaded machine.
"""


def socket_answers(path: Path, timeout: float = 0.5) -> bool:
    """Whether a process holds the unix socket at ``path``.

    A connection refused or a missing file means nobody does; a timeout or a
    full backlog means a process holds it and is slow to accept, which is not
    dead (removing or replacing such a socket would cut a live plugin off).
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(timeout)
    try:
        probe.connect(os.fsencode(path))
    except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    finally:
        probe.close()
    return True


def is_instance_name(name: str, prefix: str) -> bool:
    """Whether ``name`` is a socket file name of the resource whose :func:`socket_prefix` is ``prefix``."""
    return name.startswith(prefix + "-") and name.endswith(SOCKET_SUFFIX)


def socket_files(directory: Path, prefix: str = SOCKET_PREFIX) -> list[Path]:
    """The unix sockets in ``directory`` whose names start with ``prefix`` (and end ``.sock``), by name.

    Anything else with such a name (a regular file, a symlink) is left out, and
    a missing or unreadable directory has none.
    """
    try:
        paths = sorted(directory.iterdir())
    except OSError:
        return []
    found = []
    for path in paths:
        if not (path.name.startswith(prefix) and path.name.endswith(SOCKET_SUFFIX)):
            continue
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                found.append(path)
        except OSError:
            continue
    return found


def live_instances(directory: Path, resource: str) -> list[Path]:
    """The sockets of ``resource`` in ``directory`` that a process serves, by name.

    An unreadable or missing directory has none: this is a guard against a
    second plugin for one resource, not a check that the directory works.
    """
    return [path for path in socket_files(directory, socket_prefix(resource) + "-") if socket_answers(path)]
