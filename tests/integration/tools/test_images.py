"""tools/kubernetes/images.py for real: buildah builds the images, and what the archives hold runs.

The archives are checked as containerd would get them: their layers unpacked in order into a
directory, and programs run there in a chroot (in a mount namespace of their own, so nothing stays
mounted). The first run on a machine makes the python:3.11-slim stand-in and builds everything
(about a minute and a half here); later runs reuse the cache in seconds. So these tests run only when
asked, with PLUGVISOR_BUILD_IMAGES=1 (the real local cluster's suite sets it), as root with buildah.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "kubernetes" / "images.py"

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("PLUGVISOR_BUILD_IMAGES") != "1",
        reason="builds container images (a minute and a half the first time): set PLUGVISOR_BUILD_IMAGES=1",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="buildah's image store, debootstrap and chroot need root"),
    pytest.mark.skipif(
        shutil.which("buildah") is None, reason="buildah is not installed (apt-get install buildah)"
    ),
    pytest.mark.timeout(1800),
]


def _build(*args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, str(TOOL), "--json", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=1700,
    )
    assert result.returncode == 0, result.stderr
    summary: dict[str, Any] = json.loads(result.stdout)
    return summary


@pytest.fixture(scope="module")
def built() -> dict[str, Any]:
    """The default images, made (or found up to date) by one run."""
    return _build()["images"]  # type: ignore[no-any-return]


def _unpack(archive: Path, root: Path) -> None:
    """A docker-archive's layers, lowest first, into root, whiteouts applied (as a snapshotter does)."""
    root.mkdir()
    with tarfile.open(archive) as tar:
        manifest = tar.extractfile("manifest.json")
        assert manifest is not None
        layers = json.load(manifest)[0]["Layers"]
    for layer in layers:
        with tarfile.open(archive) as tar:
            member = tar.extractfile(layer)
            assert member is not None
            subprocess.run(
                ["tar", "-C", str(root), "--numeric-owner", "-xpf", "-"], input=member.read(), check=True
            )
        for whiteout in list(root.rglob(".wh.*")):
            target = whiteout.parent / whiteout.name.removeprefix(".wh.")
            if whiteout.name == ".wh..wh..opq":
                continue  # opaque directory: the upper layer's contents replace the lower's; unpacked
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
            whiteout.unlink()


def _chroot(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run argv in root with /proc and /dev, in a private mount namespace (nothing outlives it)."""
    script = (
        'mkdir -p "$1/proc" "$1/dev" && mount -t proc proc "$1/proc" && mount --rbind /dev "$1/dev"'
        ' && shift && exec chroot "$@"'
    )
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            str(root),
            str(root),
            *argv,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
    )


def _unpacked(built: dict[str, Any], ref: str, factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An image's archive unpacked for a module's tests; removed afterwards (it is a root file system)."""
    root = factory.mktemp("unpacked") / "root"
    _unpack(Path(built[ref]["archive"]), root)
    yield root
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def project_root(built: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from _unpacked(built, "plugvisor:e2e", tmp_path_factory)


@pytest.fixture(scope="module")
def pod_root(built: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from _unpacked(built, "plugvisor-e2e-pod:latest", tmp_path_factory)


def test_the_archives_carry_the_names_a_pod_spec_resolves_to(built: dict[str, Any]) -> None:
    assert set(built) == {"plugvisor:e2e", "plugvisor-e2e-pod:latest"}
    for ref, image in built.items():
        archive = Path(image["archive"])
        assert archive.stat().st_size == image["archive_bytes"]
        with tarfile.open(archive) as tar:
            manifest = tar.extractfile("manifest.json")
            assert manifest is not None
            assert json.load(manifest)[0]["RepoTags"] == [image["name"]], ref
    assert built["plugvisor:e2e"]["name"] == "docker.io/library/plugvisor:e2e"


def test_a_second_run_with_nothing_changed_reuses_every_archive(built: dict[str, Any]) -> None:
    again = _build()["images"]
    assert {ref: image["rebuilt"] for ref, image in again.items()} == dict.fromkeys(built, False)
    assert {ref: image["archive"] for ref, image in again.items()} == {
        ref: image["archive"] for ref, image in built.items()
    }


def test_the_project_image_runs_plugvisor_and_creates_a_lab(project_root: Path) -> None:
    helped = _chroot(project_root, "plugvisor", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "lab" in helped.stdout
    assert "run" in helped.stdout
    created = _chroot(project_root, "plugvisor", "lab", "create", "/tmp/x", "--profile", "small")
    assert created.returncode == 0, created.stderr
    assert "created lab /tmp/x" in created.stdout
    assert (project_root / "tmp/x/.plugvisor-lab/state.json").is_file()
    version = _chroot(project_root, "python3", "-c", "import sys; print(sys.version_info[:2])")
    assert version.stdout.strip() == "(3, 11)"


def test_the_stand_in_base_is_slim_and_lets_pip_install(project_root: Path) -> None:
    assert not list((project_root / "usr/lib").glob("python3*/EXTERNALLY-MANAGED"))
    assert not any((project_root / "var/lib/apt/lists").iterdir())
    assert not any((project_root / "usr/share/man").iterdir())
    docs = {p.name for p in (project_root / "usr/share/doc").rglob("*") if p.is_file()}
    assert docs == {"copyright"}
    assert (project_root / "usr/local/bin/plugvisor").is_file()  # pip installed it beside Debian's packages
    pip = _chroot(project_root, "pip", "--version")
    assert pip.returncode == 0, pip.stderr


def test_the_pod_image_is_busybox_alone_with_a_shell(pod_root: Path) -> None:
    files = sorted(
        p.relative_to(pod_root).as_posix() for p in pod_root.rglob("*") if p.is_file() and not p.is_symlink()
    )
    assert files == ["bin/busybox", "etc/group", "etc/passwd"]
    said = _chroot(pod_root, "/bin/sh", "-c", "echo hello from $(readlink /bin/sh); id -un; ls /tmp")
    assert said.returncode == 0, said.stderr
    assert said.stdout.split("\n")[:2] == ["hello from /bin/busybox", "root"]
