"""``plugvisor lab``: create, inspect, break and mend an emulated hardware tree.

Exit codes follow the product's rule: 0 success, 2 bad usage or an invalid
profile (the message names the file, the field and what was expected), 1
anything else (a refused root, a missing CAP_MKNOD, EBUSY on ``sriov_numvfs``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import signal
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import click

from plugvisor.emulators.lab import errors, nvml, profiles
from plugvisor.emulators.lab.lab import DeviceRecord, Lab

P = ParamSpec("P")
R = TypeVar("R")

_ROOT = click.argument("root", type=click.Path(file_okay=False, path_type=str))


def _errors(func: Callable[P, R]) -> Callable[P, R]:
    """Turn the lab's errors into one line on stderr and the right exit code."""

    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except errors.LabError as exc:
            click.echo(f"plugvisor lab: {exc}", err=True)
            sys.exit(exc.exit_code)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise  # the reader went away (`| head`): click ends the command quietly
            # The environment, not the input: a read-only or full file system, permissions.
            where = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"plugvisor lab: {where}{exc.strerror or exc}", err=True)
            sys.exit(1)

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper


def _line(r: DeviceRecord) -> str:
    faults = ",".join(r.faults) or "-"
    switch = r.pcie_switch or "-"
    extra = f" vfs={r.num_vfs}/{r.total_vfs}" if r.total_vfs is not None else ""
    extra += "".join(f" {key}={value}" for key, value in r.attributes)
    return (
        f"{r.name:<10} {r.kind:<7} {r.model:<16} {r.bdf:<13} {r.vendor}:{r.device[2:]}  "
        f"numa={r.numa_node} switch={switch:<4} {r.state:<9} faults={faults}{extra}"
    )


@click.group(name="lab")
def lab_group() -> None:
    """Emulated GPUs, FPGAs and SR-IOV NICs under a root directory, with faults and hot-plug."""


@lab_group.command()
@_ROOT
@click.option(
    "--profile",
    "profile",
    default="small",
    show_default=True,
    help=f"A built-in profile ({', '.join(profiles.builtin_names())}) or a YAML file.",
)
@click.option("--mknod", is_flag=True, help="Create real character device nodes (needs CAP_MKNOD).")
@click.option("--force", is_flag=True, help="Replace a lab that already exists under ROOT.")
@_errors
def create(root: str, profile: str, mknod: bool, force: bool) -> None:
    """Write an emulated hardware tree (sys/, dev/, proc/) under ROOT."""
    lab = Lab.create(root, profile, mknod=mknod, replace=force)
    for note in lab.notes:
        click.echo(f"plugvisor lab: {note}", err=True)
    records = lab.devices()
    vfs = sum(1 for r in records if r.parent)
    click.echo(f"created lab {lab.root} ({len(records) - vfs} devices, {vfs} VFs)")


@lab_group.command()
@_ROOT
@click.option("--json", "as_json", is_flag=True, help="Print JSON: devices, identities, topology, faults.")
@_errors
def show(root: str, as_json: bool) -> None:
    """List the lab's devices and their state."""
    lab = Lab.open(root)
    if as_json:
        click.echo(json.dumps(lab.show(), indent=2))
        return
    data = lab.show()
    click.echo(f"lab {data['root']} profile={data['profile']} mknod={data['mknod']}")
    for sw in data["switches"]:
        click.echo(
            f"switch {sw['name']} numa={sw['numa_node']} upstream={sw['upstream']} devices={sw['devices']}"
        )
    for record in lab.devices():
        click.echo(_line(record))


@lab_group.command()
@_ROOT
@click.argument("device")
@click.argument("kind")
@_errors
def fault(root: str, device: str, kind: str) -> None:
    """Inject a fault into DEVICE: aer-fatal, fallen-off-bus, overheat... (docs/lab.md).

    A KIND that does not apply to DEVICE is refused, listing those that do.
    """
    lab = Lab.open(root)
    click.echo(_line(lab.fault(device, kind)))
    if (kind.startswith("xid-") or kind in nvml.NVML_FAULTS) and not nvml.standin_present(
        str(lab.root), lab.state()
    ):
        click.echo(
            f"plugvisor lab: warning: {kind} recorded, but this lab has no NVML stand-in (it was created "
            "without a C compiler): only NVML shows this fault, so nothing will see it",
            err=True,
        )


@lab_group.command()
@_ROOT
@click.argument("device")
@click.argument("kind", required=False)
@_errors
def heal(root: str, device: str, kind: str | None) -> None:
    """Undo a fault of DEVICE (all of them without KIND)."""
    click.echo(_line(Lab.open(root).heal(device, kind)))


@lab_group.command()
@_ROOT
@click.argument("device")
@_errors
def unplug(root: str, device: str) -> None:
    """Hot-unplug DEVICE: its subtree, links and device nodes go."""
    click.echo(_line(Lab.open(root).unplug(device)))


@lab_group.command()
@_ROOT
@click.argument("device")
@_errors
def plug(root: str, device: str) -> None:
    """Re-plug DEVICE."""
    click.echo(_line(Lab.open(root).plug(device)))


@lab_group.command()
@_ROOT
@click.argument("pf")
@click.argument("count", type=click.IntRange(min=0))
@_errors
def vfs(root: str, pf: str, count: int) -> None:
    """Write COUNT to PF's sriov_numvfs (0 first to change a non-zero count, as the kernel wants)."""
    click.echo(_line(Lab.open(root).set_num_vfs(pf, count)))


@lab_group.command()
@_ROOT
@_errors
def watch(root: str) -> None:
    """Apply writes to any PF's sriov_numvfs, as the kernel would, until SIGTERM or SIGINT."""
    from plugvisor.emulators.lab.watcher import NumVfsWatcher  # noqa: PLC0415 - inotify only when watching

    async def main() -> None:
        watcher = NumVfsWatcher(root)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, watcher.stop)
        async with watcher:
            click.echo(f"watching sriov_numvfs under {watcher.lab.root}", err=True)
            await watcher._stop.wait()
        click.echo(f"stopped: {watcher.applied} writes applied, {watcher.rejected} refused", err=True)

    asyncio.run(main())


@lab_group.command()
@_ROOT
@_errors
def check(root: str) -> None:
    """Check the tree as a plugin would read it (links, modalias, PF/VF pairs, nodes); exit 1 on a problem."""
    found = Lab.open(root).check()
    for problem in found:
        click.echo(problem)
    if found:
        sys.exit(1)
    click.echo("no problems found")


@lab_group.command(name="profiles")
def list_profiles() -> None:
    """List the built-in profiles."""
    for name in profiles.builtin_names():
        click.echo(f"{name:<16} {profiles.builtin(name).description}")
