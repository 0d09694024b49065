"""A node's install, emulated in this environment: child interpreters that cannot import what only the
``emulators`` extra brings in (the release image installs the ``dra`` extra, not that one), exactly as if
those distributions were not installed."""

from __future__ import annotations

import subprocess
import sys
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from plugvisor.common.extras import EMULATORS

FIX = "pip install 'plugvisor[emulators]'"

WITHOUT_MODULES = """
import sys
for name in {blocked}:
    sys.modules[name] = None  # the import system then raises ModuleNotFoundError, as for a missing package
{code}
"""

RUN_CLI = "from plugvisor.cli import main\nmain({argv!r}, prog_name='plugvisor')"


def _distributions(requirements: list[str], extra: str) -> set[str]:
    """Every installed distribution these requirements pull in, with ``extra`` selected at the top only."""
    found: set[str] = set()
    pending = [(text, extra) for text in requirements]
    while pending:
        text, selected = pending.pop()
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": selected}):
            continue
        name = canonicalize_name(requirement.name)
        if name in found or name == "plugvisor":
            continue
        found.add(name)
        pending += [(sub, "") for sub in metadata.requires(name) or []]
    return found


@cache
def extra_only_modules() -> tuple[str, ...]:
    """The top-level modules of the distributions that only the emulators extra installs."""
    requirements = metadata.requires("plugvisor") or []
    # The release image installs the dra extra: what it shares with the emulators' stays importable.
    only = _distributions(requirements, EMULATORS) - _distributions(requirements, "dra")
    assert {"kubernetes-validate", "rich"} <= only, f"the {EMULATORS} extra no longer brings them: {only}"
    return tuple(
        sorted(
            module
            for module, owners in metadata.packages_distributions().items()
            if {canonicalize_name(owner) for owner in owners} <= only
        )
    )


def run_without_the_extra(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = WITHOUT_MODULES.format(blocked=extra_only_modules(), code=code)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )


def plugvisor_without_the_extra(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return run_without_the_extra(RUN_CLI.format(argv=list(argv)), cwd)
