"""Install the pinned Helm into a directory (by default beside this Python), built from its Go module.

``python tools/install_helm.py [DIR]``: tox's ``tests`` environment runs it before the tests, so that
``tests/integration/deploy/test_helm.py`` renders deploy/helm/plugvisor with a known Helm and never with
whatever ``helm`` is on PATH. Helm publishes no wheel; its Go module (``helm.sh/helm/v3``) is the
release's own source, and ``go install module@version`` builds exactly that version. A Helm of that
version already in DIR is kept; Go's build cache makes a rebuild take seconds after the first one.

Without Go, or if the build fails, it says why and exits 0: the chart's tests then skip, naming the
reason, rather than fail the whole run on a machine that cannot build Helm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

MODULE = "helm.sh/helm/v3/cmd/helm"
VERSION = "v3.22.0"
BUILD_TIMEOUT = 1800
"""Seconds: the first build downloads and compiles about 300 packages (several minutes on two cores)."""


def installed_version(helm: Path) -> str | None:
    """The version a Helm binary reports (``v3.22.0``), or None when there is none that runs."""
    try:
        result = subprocess.run(
            [str(helm), "version", "--template", "{{.Version}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def install(target: Path) -> str:
    """Make ``target/helm`` the pinned Helm; returns what was done, or why not."""
    helm = target / "helm"
    if installed_version(helm) == VERSION:
        return f"helm {VERSION} is already installed at {helm}"
    go = shutil.which("go")
    if go is None:
        return f"helm {VERSION} not installed: go is not on PATH (the chart's tests will skip)"
    target.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOBIN": str(target), "CGO_ENABLED": "0"}
    try:
        result = subprocess.run(
            # The version Helm reports is set at link time, as its own Makefile does (else `v3.22`).
            [
                go,
                "install",
                "-trimpath",
                f"-ldflags=-s -w -X helm.sh/helm/v3/internal/version.version={VERSION}",
                f"{MODULE}@{VERSION}",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"helm {VERSION} not installed: `go install` took more than {BUILD_TIMEOUT} s"
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        return f"helm {VERSION} not installed: `go install {MODULE}@{VERSION}` failed:\n{tail}"
    return f"helm {VERSION} built with {go} into {helm}"


USAGE = "usage: python tools/install_helm.py [DIR]  (DIR: an absolute directory; default: this Python's)"


def target_problem(args: list[str]) -> str | None:
    """Why ``args`` name no directory to install into, or None: checked before anything is created.

    An option (``--help`` aside, answered before) or a relative path would
    otherwise become a directory of that name wherever the command runs.
    """
    if len(args) > 1:
        return f"expected one directory, got {len(args)}: {' '.join(args)[:200]}"
    if not args:
        return None
    target = args[0]
    if not target.startswith("/"):
        return f"{target[:200]!r}: expected an absolute directory"
    if Path(target).exists() and not Path(target).is_dir():
        return f"{target[:200]}: exists and is not a directory"
    return None


def main(argv: list[str]) -> int:
    """Install into ``argv[1]``, or into the directory of this Python's scripts; 2 for bad input."""
    args = argv[1:]
    if args and args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__.split(chr(10) + chr(10))[0]}")
        return 0
    problem = target_problem(args)
    if problem is not None:
        print(f"install_helm.py: {problem}", file=sys.stderr)
        return 2
    target = Path(args[0]) if args else Path(sys.executable).parent
    print(install(target))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
