"""The e2e scenarios' backend: `--backend emulated` (the default, offline, part of the README's test
command), `--backend kind` (`tox -e e2e`; skipped with the reason when docker or kind is missing) or
`--backend local` (`tox -e e2e-local`: upstream Kubernetes on this machine; skipped, naming the missing
piece, without root, Go or the built components)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from grpc import aio as _grpc_aio

from .backends import (
    Backend,
    EmulatedBackend,
    KindBackend,
    LocalBackend,
    Progress,
    kind_unavailable,
    local_unavailable,
)

# gRPC's asyncio engine shuts down when its last channel or server is collected, and starts again with the
# next one. A test process makes and drops hundreds, and one such shutdown can hang for good joining the
# engine's poller thread (grpc/grpc#40989: the loop stops reading the wake-up socket while the poller is
# blocked writing to it): seen as a 180 s timeout in an unrelated test's teardown. Started once here, the
# engine stays up for the whole session, as it does in a plugvisor process, whose server lives as long as it.
_grpc_aio.init_grpc_aio()

_ACTIVE: list[Backend] = []
_STEPS: list[Progress] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("plugvisor e2e")
    group.addoption(
        "--backend",
        choices=("emulated", "kind", "local"),
        default=os.environ.get("PLUGVISOR_E2E_BACKEND", "emulated"),
        help="where the e2e scenarios run: emulated nodes (offline), a kind cluster, or a local cluster",
    )
    group.addoption(
        "--keep-cluster",
        action="store_true",
        default=bool(os.environ.get("PLUGVISOR_E2E_KEEP")),
        help="kind: leave the cluster running afterwards",
    )
    group.addoption(
        "--reuse-cluster",
        action="store_true",
        default=bool(os.environ.get("PLUGVISOR_E2E_REUSE")),
        help="kind: use the existing plugvisor-e2e cluster instead of creating one",
    )


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    choice = request.config.getoption("--backend")
    progress = Progress(choice)
    _STEPS.append(progress)
    chosen: Backend
    if choice == "kind":
        reason = kind_unavailable()
        if reason is not None:
            pytest.skip(f"the kind backend needs docker, kind and kubectl: {reason}")
        chosen = KindBackend(
            progress,
            keep=request.config.getoption("--keep-cluster"),
            reuse=request.config.getoption("--reuse-cluster"),
        )
    elif choice == "local":
        reason = local_unavailable()
        if reason is not None:
            pytest.skip(f"the local backend cannot run here: {reason}")
        chosen = LocalBackend(progress)
    else:
        chosen = EmulatedBackend(progress)
    _ACTIVE.append(chosen)
    try:
        progress("setting up")
        chosen.setup()
        yield chosen
    finally:
        chosen.teardown()
        _ACTIVE.remove(chosen)


LAST = ("test_dra.py", "test_nvidia.py")
"""Modules that run after the others, in this order: the DRA scenarios start on the worker the device-plugin
scenarios end on (the local node plays one worker at a time: a switch takes time), and the NVIDIA ones
make the node a role no other module plays, so they switch once, at the end."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: LAST.index(item.path.name) + 1 if item.path.name in LAST else 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    """On a failure, add what a person needs: the agents' logs, the nodes, the events."""
    report = yield
    if report.failed and _ACTIVE:
        try:
            report.sections.append((f"{_ACTIVE[0].name} backend diagnostics", _ACTIVE[0].diagnose()))
        except Exception as exc:  # diagnostics must never hide the failure itself
            report.sections.append(("backend diagnostics", f"could not collect them: {exc!r}"))
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The backend's steps and their times (set-up, roles, images, the cleanup check) after the results."""
    for progress in _STEPS:
        if progress.lines and progress.backend != "emulated":
            terminalreporter.section(f"e2e {progress.backend} backend: steps")
            for line in progress.lines:
                terminalreporter.write_line(line)
