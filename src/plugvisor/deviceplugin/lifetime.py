"""How a plugin process's runtime lives: the kind's start/close around it, its tasks until told to stop.

Both servers of a kind (the device plugin's :mod:`~plugvisor.deviceplugin.runtime`
and the DRA driver's :mod:`plugvisor.dra.runtime`) run the same way: the kind's
:class:`~plugvisor.deviceplugin.hooks.PluginLifecycle` brackets everything, and a
handful of tasks (discovery, monitoring, serving) run until the process is told
to stop or one of them ends. A task that ends by failing ends them all, and its
error is what the process reports.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeAlias

from structlog.typing import FilteringBoundLogger

from plugvisor.deviceplugin.hooks import PluginLifecycle

Work: TypeAlias = tuple[str, Coroutine[Any, Any, None]]
"""One task of a runtime: its name (in task dumps) and what it runs."""


@contextlib.asynccontextmanager
async def kind_lifecycle(hook: PluginLifecycle | None, log: FilteringBoundLogger) -> AsyncIterator[None]:
    """The kind's ``start`` before the block and ``close`` after it (in worker threads: they may block).

    A failing ``close`` is logged: it must not hide why the process stopped.
    """
    if hook is not None:
        await asyncio.to_thread(hook.start)
    try:
        yield
    finally:
        if hook is not None:
            try:
                await asyncio.to_thread(hook.close)
            except Exception:
                log.exception("close_failed")


async def run_until_stopped(
    stop: asyncio.Event, work: Sequence[tuple[str, Coroutine[Any, Any, None]]]
) -> None:
    """Run ``work`` (name, coroutine) as tasks until ``stop`` is set or one of them ends.

    The first task that ended with an error has it raised here; every task is
    cancelled and awaited before this returns, whatever happened.
    """
    stopper = asyncio.create_task(stop.wait(), name="stop")
    tasks = [stopper, *(asyncio.create_task(coroutine, name=name) for name, coroutine in work)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopper and not task.cancelled():
                error = task.exception()
                if error is not None:
                    raise error
    finally:
        await cancel_all(tasks)


async def cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel every task, then wait for each to end (what it raised on the way out is not ours to see)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
