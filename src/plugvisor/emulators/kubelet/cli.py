"""``plugvisor kubelet --dir DIR``: the emulated kubelet as a long-running command.

Signals map to what operators do to a real kubelet: SIGHUP restarts it (every
socket in DIR deleted, ``kubelet.sock`` created again - the plugins' cue to
re-register), SIGTERM and SIGINT stop it cleanly with exit status 0. Each event
is logged as one ``key=value`` line on stderr, so a script can follow it with
``grep``; the full state is in the JSON view file.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any, Literal

import click
import structlog

from plugvisor.api import constants
from plugvisor.emulators.kubelet import kubelet as kubelet_
from plugvisor.emulators.kubelet import model

_Command = Literal["restart", "stop"]


def _event_logger() -> Any:
    """Build a logger that prints one key=value line per call, without global configuration."""
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.KeyValueRenderer(key_order=["timestamp", "event", "resource", "message"]),
        ],
    )


async def _serve(socket_dir: Path, *, view_path: Path | None, grace_period: float) -> None:
    logger = _event_logger()

    def log_event(event: model.Event) -> None:
        fields = {**event.fields, "resource": event.resource, "message": event.message}
        fields["generation"] = event.generation
        logger.info(str(event.kind), **{key: value for key, value in fields.items() if value is not None})

    kubelet = kubelet_.EmulatedKubelet(
        socket_dir, view_path=view_path, grace_period=grace_period, on_event=log_event
    )
    commands: asyncio.Queue[_Command] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, commands.put_nowait, "restart")
    loop.add_signal_handler(signal.SIGTERM, commands.put_nowait, "stop")
    loop.add_signal_handler(signal.SIGINT, commands.put_nowait, "stop")
    try:
        await kubelet.start()
        logger.info("view", message=f"view file {kubelet.view_path}", path=os.fspath(kubelet.view_path))
        while await commands.get() == "restart":
            await kubelet.restart()
    finally:
        for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await kubelet.stop()


@click.command(name="kubelet")
@click.option(
    "--dir",
    "socket_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The device-plugins directory: kubelet.sock is served here, plugins put their sockets here.",
)
@click.option(
    "--view",
    "view_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the JSON view [default: <DIR>.kubelet.json, beside the directory].",
)
@click.option(
    "--grace-period",
    type=click.FloatRange(min=0),
    default=kubelet_.DEFAULT_GRACE_PERIOD,
    show_default=True,
    metavar="SECONDS",
    help="How long a resource whose plugin went away is kept (capacity kept, allocatable 0) before removal.",
)
def kubelet_command(socket_dir: Path, view_path: Path | None, grace_period: float) -> None:
    """Run an emulated kubelet's device-plugin side on DIR (SIGHUP restarts it like a real kubelet)."""
    socket_path = Path(os.path.abspath(socket_dir)) / constants.KUBELET_SOCKET_NAME  # noqa: PTH100
    if len(os.fsencode(socket_path)) > constants.MAX_UNIX_SOCKET_PATH:
        raise click.BadParameter(
            f"{socket_path} would be {len(os.fsencode(socket_path))} bytes; unix socket paths are limited "
            f"to {constants.MAX_UNIX_SOCKET_PATH}. Use a shorter directory.",
            param_hint="'--dir'",
        )
    try:
        asyncio.run(_serve(socket_dir, view_path=view_path, grace_period=grace_period))
    except OSError as error:
        raise click.ClickException(f"cannot serve in {socket_dir}: {error}") from error
