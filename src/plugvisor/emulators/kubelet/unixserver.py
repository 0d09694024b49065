"""Serving a gRPC servicer on a unix socket, as every server of the emulated kubelet does.

One place for the two details that are easy to get wrong: ``add_insecure_port``
reports a failed bind by returning 0 rather than raising (so it is checked
here), and a stopped server's socket file is removed so that the next start,
or a plugin watching the directory, never sees a dead socket.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc


async def serve(socket_path: Path, add_servicers: Callable[[grpc.aio.Server], None]) -> grpc.aio.Server:
    """Start a server on ``socket_path`` with what ``add_servicers`` adds; raise if it cannot bind."""
    server = grpc.aio.server()
    add_servicers(server)
    if not server.add_insecure_port("unix:" + os.fspath(socket_path)):
        raise OSError(f"cannot listen on {socket_path}")
    await server.start()
    return server


async def stop(server: grpc.aio.Server | None, socket_path: Path, *, unlink: bool = True) -> None:
    """Stop ``server`` at once (open streams are cut) and remove its socket file."""
    if server is not None:
        await server.stop(None)
    if unlink:
        socket_path.unlink(missing_ok=True)  # noqa: ASYNC240 - one unlink of a local socket file
