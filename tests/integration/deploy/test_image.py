"""The release image, without a Docker engine: the Dockerfile's own steps, run here on the built wheel.

The docker build itself is part of the e2e suite (`tox -e e2e`); here the same wheel-and-entry-point
path is exercised: the build stage's files become a wheel, the wheel is installed alone, and its
`plugvisor` entry point answers `--help` and finds its package data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .conftest import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    lines = [
        line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """(FROM argument, the stage's other instructions), in order."""
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for op, arg in _instructions():
        if op == "FROM":
            stages.append((arg, []))
        elif stages:
            stages[-1][1].append((op, arg))
    return stages


def _stage(name: str) -> list[tuple[str, str]]:
    return next(steps for origin, steps in _stages() if origin.endswith(f" AS {name}"))


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_the_release_image_is_the_default_target_and_installs_the_wheel_for_dra_with_the_constraints() -> (
    None
):
    """The wheel with its `dra` extra (DRA overlays run it), not the emulators', pinned by constraints.txt;
    `plugvisor --help` at build time; entry point."""
    assert _stages()[-1] == ("release", []), "the last stage (the default target) must be the release image"
    build = " ".join(" ".join(arg.split()) for op, arg in _stage("build") if op == "RUN")
    assert '--constraint constraints.txt "$(echo /wheels/plugvisor-*.whl)[dra]"' in build
    assert "--root /staging" in build
    release = _stage("release")
    assert ("COPY", "--from=build /staging/ /") in release
    assert ("ENTRYPOINT", '["plugvisor"]') in release
    assert any(op == "RUN" and "plugvisor --help" in arg for op, arg in release)
    assert not any("[emulators]" in arg for _, arg in release)


def test_the_emulators_target_adds_the_extra_to_the_release_image() -> None:
    origin = next(origin for origin, _ in _stages() if origin.endswith(" AS emulators"))
    assert origin == "release AS emulators"
    (install,) = [arg for op, arg in _stage("emulators") if op == "RUN"]
    assert '"$(echo /wheels/plugvisor-*.whl)[emulators]"' in install
    assert "--constraint /tmp/constraints.txt" in install
    assert "plugvisor kubelet --help" in install


def test_oci_labels_match_the_project() -> None:
    """Source, version and licence labels say what pyproject.toml says."""
    assert f'org.opencontainers.image.licenses="{PYPROJECT["project"]["license"]}"' in DOCKERFILE
    assert f"ARG VERSION={PYPROJECT['project']['version']}" in DOCKERFILE
    assert 'org.opencontainers.image.version="${VERSION}"' in DOCKERFILE
    assert "org.opencontainers.image.source=" in DOCKERFILE
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text
    assert "Version 2.0, January 2004" in license_text


def test_constraints_pin_every_runtime_dependency_within_pyproject() -> None:
    """Each dependency, the dra and emulators extras' too, is pinned within pyproject's range; theirs too."""
    pins = _pins()
    extras = PYPROJECT["project"]["optional-dependencies"]
    for text in [*PYPROJECT["project"]["dependencies"], *extras["dra"], *extras["emulators"]]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"constraints.txt does not pin {requirement.name}"
        assert requirement.specifier.contains(pins[name]), (
            f"{name}=={pins[name]} breaks pyproject's {requirement}"
        )
    for name, version in pins.items():
        try:
            installed = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if installed.version != version:
            continue
        for text in installed.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                assert canonicalize_name(requirement.name) in pins, (
                    f"{name} needs {requirement.name}, not pinned"
                )


def test_the_build_context_keeps_what_the_dockerfile_copies() -> None:
    """.dockerignore drops caches and tests, never a file the Dockerfile copies."""
    ignored = {
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"
    }
    copied = {
        word
        for op, arg in _instructions()
        if op == "COPY" and "--from" not in arg
        for word in arg.split()[:-1]
    }
    assert copied >= {"pyproject.toml", "README.md", "LICENSE", "src", "constraints.txt"}
    assert not copied & ignored
    assert {".git", ".tox", ".venv"} <= ignored


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel the Dockerfile's build stage makes, from exactly the files it copies."""
    context = tmp_path_factory.mktemp("context")
    build = _stage("build")
    wheel_step = next(i for i, (op, arg) in enumerate(build) if op == "RUN" and "pip wheel" in arg)
    for arg in [arg for op, arg in build[:wheel_step] if op == "COPY"]:
        *sources, _ = arg.split()
        for source in sources:
            origin = REPO / source
            if origin.is_dir():
                shutil.copytree(origin, context / source, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(origin, context / source)
    out = tmp_path_factory.mktemp("wheels")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(context)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if result.returncode != 0 and (
        "Could not find a version" in result.stderr or "NewConnection" in result.stderr
    ):
        pytest.skip(
            f"the build backend cannot be fetched from the package index here: {result.stderr[-300:]}"
        )
    assert result.returncode == 0, result.stderr
    (built,) = out.glob("plugvisor-*.whl")
    return built


def test_the_wheels_entry_point_runs_help_and_finds_its_data(wheel: Path, tmp_path: Path) -> None:
    """Installed alone, the wheel's `plugvisor` answers --help, and its built-in lab profiles are there."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-compile",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        check=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    entry = target / "bin" / "plugvisor"

    def run(*args: str) -> str:
        result = subprocess.run(
            [str(entry), *args], capture_output=True, text=True, env=env, timeout=120, check=False
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "Usage: plugvisor" in run("--help")
    assert "dgx-like" in run("lab", "profiles")
    where = subprocess.run(
        [sys.executable, "-c", "import json, plugvisor; print(json.dumps(plugvisor.__file__))"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert json.loads(where.stdout).startswith(str(target))
