"""kind on a machine without an image registry: what tools/kind/build.py made here, put to use.

A normal machine needs none of this: kind pulls kindest/node, and the project's image is built with
``docker build``. These machines reach no registry (docs/kind.md), so where tools/kind/build.py made the
offline node image the kind backend takes this route instead:

- kind is the one that tool built (its cache's bin/), and so is kubectl (the cluster's release);
- the node image is ``docker load``-ed from its archive and passed to ``kind create cluster --image``;
- kind-config.yaml is given the ``kubeadmConfigPatches`` the node image needs here (``build.py
  --kubeadm-patch``: etcd's tag, the kubelet's ``failCgroupV1: false``) in a copy; the file itself stays
  the one every other CI uses;
- the project's image and the pods' image come from tools/kubernetes/images.py's archives (buildah, no
  Docker, no pull of python:3.11-slim) and go in with ``kind load image-archive``;
- the Docker engine is started by the run itself where none answers (engine.py), with the capability
  wrapper as its default runtime, under the machine's lock, and the host checked afterwards.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from ..deployment import KIND_CONFIG, REPO
from ..hostfs import load_tool

IMAGES_SCRIPT = REPO / "tools/kubernetes/images.py"
PROJECT_IMAGE = "plugvisor:e2e"


@functools.cache
def kind_tool() -> Any:
    """tools/kind/build.py, which knows where the kind it builds and the offline node image are."""
    return load_tool("tools/kind/build.py", "plugvisor_kind_build")


def cache_bin(command: str) -> Path | None:
    """A command tools/kind/build.py built (kind, kubectl), if it was built here."""
    tool = kind_tool()
    try:
        path = tool.cache_root(tool.versions()["kind"]) / "bin" / command
    except tool.UsageError:
        return None
    return path if path.exists() else None


def node_image() -> tuple[str, Path] | None:
    """The offline node image (its reference and archive), if tools/kind/build.py made it here."""
    tool = kind_tool()
    try:
        pinned = tool.versions()
        kubernetes = str(tool.kbuild.versions()["kubernetes"]["version"])
    except (tool.UsageError, tool.kbuild.VersionsError):
        return None
    ref = tool.node_ref(kubernetes)
    archive = (
        tool.cache_root(pinned["kind"])
        / "archives"
        / tool.kimages.archive_filename(tool.kimages.normalize_ref(ref))
    )
    return (ref, archive) if archive.exists() else None


def kubeadm_patches() -> list[str]:
    """The kubeadmConfigPatches the node image needs here, one entry per document (build.py's own text)."""
    tool = kind_tool()
    etcd = str(tool.kbuild.versions()["etcd"]["version"])
    return [part.strip() + "\n" for part in tool.kubeadm_patch(etcd).split("---\n") if part.strip()]


def write_config(target: Path) -> Path:
    """kind-config.yaml with the patches added (after any of its own), its hostPaths made absolute."""
    config = yaml.safe_load(KIND_CONFIG.read_text())
    config["kubeadmConfigPatches"] = [*config.get("kubeadmConfigPatches", []), *kubeadm_patches()]
    for node in config.get("nodes", []):
        for mount in node.get("extraMounts", []):
            mount["hostPath"] = str((REPO / mount["hostPath"]).resolve())
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    return target


def project_images() -> dict[str, dict[str, Any]]:
    """The project's and the pods' images from tools/kubernetes/images.py (cached): ref -> its summary.

    Each summary has ``name`` (the reference the archive carries) and ``archive``.
    """
    result = subprocess.run(
        [sys.executable, str(IMAGES_SCRIPT), "--json"],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"tools/kubernetes/images.py failed ({result.returncode}):\n{result.stderr[-4000:]}"
        )
    images: dict[str, dict[str, Any]] = json.loads(result.stdout)["images"]
    return images


def pin(archive: Path, directory: Path) -> Path:
    """A hard link to ``archive`` in ``directory`` (a copy across file systems): the image as built now.

    tools/kubernetes/images.py's cache is per machine, and a run from another checkout replaces an
    archive whose inputs differ (atomically, by rename): the link keeps this run's.
    """
    pinned = directory / archive.name
    try:
        os.link(archive, pinned)
    except OSError:
        shutil.copyfile(archive, pinned)
    return pinned


def missing() -> list[str]:
    """What the offline route lacks on this machine (empty: it can run)."""
    problems = []
    for command in ("kind", "kubectl"):
        if cache_bin(command) is None:
            problems.append(f"{command} is not built (python3 tools/kind/build.py --only kind,tools)")
    if not IMAGES_SCRIPT.exists():
        problems.append(f"{IMAGES_SCRIPT.relative_to(REPO)} is missing (it builds the project's images)")
    return problems
