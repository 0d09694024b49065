#!/usr/bin/python3
"""An OCI runtime wrapper for Docker: runc, asked only for the capabilities this machine's root has.

Why: on some machines (these VMs) root's bounding set lacks a capability, CAP_SYS_RESOURCE, and Docker
asks runc for every capability for a ``--privileged`` container (kind starts every node that way). runc
then fails: ``unable to apply caps: operation not permitted``. A machine with a normal root does not need
this wrapper; kind's own path is unchanged by it.

What: registered with Docker as a runtime (``/etc/docker/daemon.json``: ``{"runtimes": {"capfit":
{"path": "<this file>"}}}``), it is called with runc's command line. Before handing that to runc
unchanged (exec), it removes, from the capability sets of the container's spec (``create``/``run``: the
bundle's config.json) or of the process spec (``exec --process <file>``), every capability missing from
its own bounding set, which it inherits from dockerd. Nothing else in the spec changes, and with a full
bounding set nothing changes at all.

Only the standard library: it runs as Docker's runtime, outside any virtualenv.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

# Linux capability numbers (include/uapi/linux/capability.h), as the OCI spec names them.
CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER",
    "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE", "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
)  # fmt: skip
CAPABILITY_SETS = ("bounding", "effective", "inheritable", "permitted", "ambient")
# The distribution's runc, by absolute path (never PATH: another install's runc may come first there).
RUNC = "/usr/sbin/runc"


def missing_capabilities(status: str) -> frozenset[str]:
    """The capabilities absent from the ``CapBnd`` mask of a /proc/<pid>/status text."""
    for line in status.splitlines():
        if line.startswith("CapBnd:"):
            mask = int(line.split()[1], 16)
            return frozenset(name for bit, name in enumerate(CAPABILITIES) if not mask >> bit & 1)
    raise ValueError("no CapBnd line in the process status")


def fit_process(process: dict[str, Any], missing: frozenset[str]) -> bool:
    """Remove ``missing`` from an OCI process spec's capability sets; True when something changed."""
    sets = process.get("capabilities")
    if not isinstance(sets, dict):
        return False
    changed = False
    for name in CAPABILITY_SETS:
        granted = sets.get(name)
        if isinstance(granted, list) and missing.intersection(granted):
            sets[name] = [cap for cap in granted if cap not in missing]
            changed = True
    return changed


def spec_file(argv: list[str]) -> tuple[Path, bool] | None:
    """The JSON file a runc command line hands over, and whether it is a whole spec (else a process).

    ``create``/``run`` read ``<bundle>/config.json`` (``--bundle``/``-b``, default the working directory);
    ``exec --process <file>`` reads a process spec. Any other command carries no capabilities.
    """
    command = next((arg for arg in argv if arg in ("create", "run", "exec")), None)
    if command is None:
        return None
    rest = argv[argv.index(command) + 1 :]
    if command == "exec":
        value = _option(rest, ("--process", "-p"))
        return (Path(value), False) if value else None
    bundle = _option(rest, ("--bundle", "-b")) or "."
    return Path(bundle) / "config.json", True


def _option(args: list[str], names: tuple[str, ...]) -> str | None:
    for index, arg in enumerate(args):
        if arg in names and index + 1 < len(args):
            return args[index + 1]
        for name in names:
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def fit(argv: list[str], missing: frozenset[str]) -> None:
    """Rewrite the spec file ``argv`` names (if any) so that it asks for none of ``missing``."""
    found = spec_file(argv)
    if found is None or not missing:
        return
    path, whole = found
    document = json.loads(path.read_text())
    process = document.get("process", {}) if whole else document
    if fit_process(process, missing):
        path.write_text(json.dumps(document))


def main() -> None:
    """Fit the spec this command line names, then become runc with the same arguments."""
    argv = sys.argv[1:]
    fit(argv, missing_capabilities(Path("/proc/self/status").read_text()))
    runc = os.environ.get("PLUGVISOR_CAPFIT_RUNC", RUNC)
    os.execv(runc, [runc, *argv])  # noqa: S606 (runc's own argument vector, no shell involved)


if __name__ == "__main__":
    main()
