"""e2e tests run in a kind cluster; without docker, kind and kubectl they skip, saying which is missing."""

import shutil
import subprocess

import pytest

CLUSTER = "plugvisor-e2e"


def _missing() -> str | None:
    for tool in ("docker", "kind", "kubectl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if info.returncode != 0:
        return "docker is installed but no Docker engine answers (docker info failed)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"e2e needs a kind cluster: {reason}")
    for item in items:
        item.add_marker(skip)
