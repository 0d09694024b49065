"""Bytecode for plugvisor's own modules before a bench starts its processes, as the release image has it.

The image compiles every module once at build time (Dockerfile) and runs with
``PYTHONDONTWRITEBYTECODE``. A checkout installed for development (``pip install
-e``) has no bytecode for plugvisor's own modules until an interpreter writes it,
and with ``PYTHONDONTWRITEBYTECODE`` set (tox sets it, and so may the shell) none
ever does: every process the bench starts then compiles each plugvisor module
it imports, which measured 25-30 ms more per start of ``plugvisor plugin`` and
3.5 MB more node PSS for ``plugvisor run`` with three resources. Compiling here
makes the bench measure what ships. Installed from a wheel, pip has compiled the
modules already and this changes nothing.
"""

from __future__ import annotations

import compileall
from pathlib import Path

import plugvisor


def compile_plugvisor() -> str:
    """Write missing or stale bytecode for plugvisor's modules where they are; say what was done."""
    package = Path(plugvisor.__file__).parent
    if not compileall.compile_dir(package, quiet=2):
        return f"bytecode: could not compile every module under {package} (a start compiles those each time)"
    return f"bytecode: plugvisor's modules compiled under {package}, as the release image has them"
