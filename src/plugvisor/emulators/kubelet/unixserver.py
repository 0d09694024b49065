"""Serving a gRPC servicer on a unix socket, as every server of the emulated kubelet does.

One place for the details that are easy to get wrong: ``add_insecure_port``
reports a failed bind by returning 0 rather than raising (so it is checked
here); gRPC removes the socket file it bound when the server stops; and a
socket that must outlive its server (the kubelet's own ``kubelet.sock``, which a
dying kubelet leaves behind) is therefore bound at a private path and *linked*
into place: when the server stops, gRPC unlinks only the private name, and the
public one stays, dead, with no event in the watched directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc


async def serve(
    socket_path: Path, add_servicers: Callable[[grpc.aio.Server], None], *, bound_at: Path | None = None
) -> grpc.aio.Server:
    """Start a server on ``socket_path`` with what ``add_servicers`` adds; raise if it cannot bind.

    With ``bound_at`` the server binds that private path and ``socket_path`` is
    created as a hard link to it once the server listens, so that ``socket_path``
    survives the server (see the module docstring). Both must be on one file system.
    """
    server = grpc.aio.server()
    add_servicers(server)
    listen = bound_at if bound_at is not None else socket_path
    if bound_at is not None:
        bound_at.unlink(missing_ok=True)  # noqa: ASYNC240 - ours: a crashed run may have left it
    if not server.add_insecure_port("unix:" + os.fspath(listen)):
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    if bound_at is not None:
        try:
            socket_path.unlink(missing_ok=True)  # noqa: ASYNC240 - one unlink of a local socket
            os.link(bound_at, socket_path)
        except OSError:
            await server.stop(None)
            raise
    return server


async def stop(server: grpc.aio.Server | None, socket_path: Path, *, unlink: bool = True) -> None:
    """Stop ``server`` at once (open streams are cut) and remove its socket file."""
    if server is not None:
        await server.stop(None)
    if unlink:
        socket_path.unlink(missing_ok=True)  # noqa: ASYNC240 - one unlink of a local socket file
