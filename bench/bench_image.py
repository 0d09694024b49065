"""How big the images are, and what in them: the release image (a node's install) and the `emulators` one.

Run: python bench/bench_image.py [--build] [--images-tool PATH] [--cache DIR]

Always: what pip installs, measured on disk. The wheel is built from this checkout and installed
twice with constraints.txt into empty directories (``pip install --target``, bytecode compiled as the
Dockerfile compiles it): with its ``dra`` extra (the release image's set), and with ``dra`` and
``emulators``. Printed per distribution, from each one's RECORD, with the shared libraries' size without
their debug sections beside it (what the Dockerfile's ``strip --strip-debug`` leaves; needs ``strip`` on
PATH). This is a proxy for plugvisor's share of the image, not the image: it leaves out the base and the tar
headers.

With ``--build`` (root, buildah): the images themselves, built from this checkout's Dockerfile by
``tools/kubernetes/images.py`` (a debootstrap stand-in for python:3.11-slim, since no registry is
reachable here), unpacked and gzip-compressed, split into the base image's layers and plugvisor's,
from each archive's manifest and history. The target (issue 22) is the release image <= 200 MB.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_MB = 200.0
IMAGES = {"release": "plugvisor-bench:release", "emulators": "plugvisor-bench:emulators"}
MB = 1e6
Sizes = dict[str, tuple[int, int]]
"""distribution -> (bytes on disk as pip installed them, bytes with debug sections stripped)"""


def mb(size: float) -> str:
    return f"{size / MB:7.1f} MB"


# -- what pip installs ------------------------------------------------------------------------------


def build_wheel(out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(out), str(REPO)],
        check=True,
        cwd=out,
    )
    shutil.rmtree(REPO / "build", ignore_errors=True)  # setuptools' scratch directory
    (wheel,) = out.glob("plugvisor-*.whl")
    return wheel


def install(requirement: str, target: Path) -> None:
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    constraints = ["--constraint", str(REPO / "constraints.txt")]
    subprocess.run([*pip, "--target", str(target), *constraints, requirement], check=True)


def stripped_size(path: Path, scratch: Path) -> int:
    """The size of a shared library without its debug sections (what the Dockerfile ships)."""
    copy = scratch / path.name
    shutil.copyfile(path, copy)
    subprocess.run(["strip", "--strip-debug", str(copy)], check=True)
    return copy.stat().st_size


def sizes_by_distribution(site: Path, strip: bool) -> Sizes:
    """distribution -> (bytes on disk as pip installed them, bytes with debug sections stripped)."""
    found: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for record in site.glob("*.dist-info/RECORD"):
            name = record.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0]
            total = shipped = 0
            with record.open(newline="") as rows:
                for row in csv.reader(rows):
                    path = site / row[0]
                    if not path.is_file() or path.parent.name == "bin":
                        continue
                    size = path.stat().st_size
                    total += size
                    shipped += stripped_size(path, Path(scratch)) if strip and ".so" in path.name else size
            found[name] = (total, shipped)
    return found


def print_sets(release: Sizes, emulators: Sizes, strip: bool) -> None:
    print("\n== what pip installs (pip install --target, bytecode compiled): proxy for plugvisor's layer")
    print(f"{'distribution':26} {'as installed':>13} {'debug-stripped':>15}   in")
    rows = sorted(emulators.items(), key=lambda item: -item[1][0])
    for name, (total, shipped) in rows:
        where = "release" if name in release else "emulators only"
        print(f"{name:26} {mb(total):>13} {mb(shipped) if strip else '-':>15}   {where}")
    for label, chosen in (("release set", release), ("with the emulators extra", emulators)):
        total = sum(t for t, _ in chosen.values())
        shipped = sum(s for _, s in chosen.values())
        print(f"{label:26} {mb(total):>13} {mb(shipped) if strip else '-':>15}")
    if not strip:
        print("(strip is not on PATH: the debug-stripped column is not measured)")


# -- the images ---------------------------------------------------------------------------------------


def layer_sizes(archive: Path) -> tuple[int, int]:
    """(base image bytes, plugvisor's bytes) of a docker-archive, split at plugvisor's first instruction."""
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))[0]  # type: ignore[arg-type]
        config = json.load(tar.extractfile(manifest["Config"]))  # type: ignore[arg-type]
        layers = [tar.getmember(name).size for name in manifest["Layers"]]
    base_layers = 0
    for entry in config["history"]:
        if "org.opencontainers.image.title" in entry.get("created_by", ""):
            break
        base_layers += not entry.get("empty_layer", False)
    return sum(layers[:base_layers]), sum(layers[base_layers:])


def build_images(tool: Path, cache: Path | None) -> dict[str, dict[str, object]]:
    argv = [sys.executable, str(tool), "--repo", str(REPO), "--no-pod-image", "--measure", "--json"]
    argv += ["--image", IMAGES["release"], "--image", f"{IMAGES['emulators']}=emulators"]
    if cache is not None:
        argv += ["--cache", str(cache)]
    result = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True)
    images: dict[str, dict[str, object]] = json.loads(result.stdout)["images"]
    return images


def print_images(images: dict[str, dict[str, object]]) -> None:
    print("\n== the images (buildah, from this checkout's Dockerfile; base: the python:3.11-slim stand-in)")
    print(f"{'image':12} {'unpacked':>11} {'(MiB)':>9} {'gzip':>11} {'base':>11} {'plugvisor':>11}   target")
    for label, ref in IMAGES.items():
        info = images[ref]
        unpacked = int(info["unpacked_bytes"])  # type: ignore[call-overload]
        base, ours = layer_sizes(Path(str(info["archive"])))
        verdict = f"<= {TARGET_MB:.0f} MB: {'met' if unpacked <= TARGET_MB * MB else 'MISSED'}"
        print(
            f"{label:12} {mb(unpacked):>11} {unpacked / 2**20:7.1f}Mi {mb(int(info['compressed_bytes'])):>11}"  # type: ignore[call-overload]
            f" {mb(base):>11} {mb(ours):>11}   {verdict if label == 'release' else '-'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="also build the images (root, buildah)")
    parser.add_argument("--images-tool", type=Path, default=REPO / "tools/kubernetes/images.py")
    parser.add_argument("--cache", type=Path, help="images.py's cache directory (default: its own)")
    args = parser.parse_args()

    strip = shutil.which("strip") is not None
    with tempfile.TemporaryDirectory(prefix="pv-image-") as scratch:
        root = Path(scratch)
        wheel = build_wheel(root)
        install(f"{wheel}[dra]", root / "release")
        install(f"{wheel}[dra,emulators]", root / "emulators")
        release = sizes_by_distribution(root / "release", strip)
        emulators = sizes_by_distribution(root / "emulators", strip)
    print_sets(release, emulators, strip)

    if not args.build:
        print("\n(the images themselves: --build, as root with buildah)")
        return
    reasons = []
    if os.geteuid() != 0:
        reasons.append("not root")
    if shutil.which("buildah") is None:
        reasons.append("buildah is not installed")
    if not args.images_tool.is_file():
        reasons.append(f"{args.images_tool} does not exist")
    if reasons:
        print(f"\n(images not built: {', '.join(reasons)})")
        return
    print_images(build_images(args.images_tool, args.cache))


if __name__ == "__main__":
    main()
