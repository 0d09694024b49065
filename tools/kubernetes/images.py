"""Build the real cluster's container images without Docker, as archives for `ctr images import`.

    python3 tools/kubernetes/images.py                 # build what changed, print each step and its time
    python3 tools/kubernetes/images.py --json          # the same, then a summary for programs on stdout
    python3 tools/kubernetes/images.py --image plugvisor-lab:e2e=emulators   # another tag, from a stage
    python3 tools/kubernetes/images.py --import /tmp/pv/containerd.sock --ctr /path/to/ctr

What it makes (run as root; only the standard library, so it runs before any virtualenv exists):

- A stand-in for python:3.11-slim, made once and kept: these machines reach Debian's archive and PyPI
  but no image registry, so the Dockerfile's base is made from Debian (debootstrap, bookworm, minbase)
  with Debian's python3 (3.11) and pip, slimmed as Debian's own slim images are (no documentation but
  the copyright files, no manuals, no translations, no package lists or caches). Debian marks its
  Python as externally managed (PEP 668), which makes `pip install` refuse to touch the system; like
  the official image, whose Python is the only one in it, the stand-in drops that marker, so the
  Dockerfile's `pip install` works unchanged (pip installs into /usr/local, beside Debian's packages).
- The project's image, from the repository's Dockerfile, unchanged, built by buildah (daemonless)
  with the stand-in passed as the Dockerfile's PYTHON_IMAGE argument and nothing ever pulled. RUN
  steps use the host's network (pip downloads the dependencies) and trust the certificate
  authorities the host trusts (its CA bundle is mounted over the image's for the build only, so a
  TLS-inspecting proxy works; nothing of the host ends up in the image).
- A tiny image for the scenarios' pods: Debian's busybox-static with a link per applet, /bin/sh
  included, nothing else.

Each image is written as a docker-archive (the format `docker save` writes and `kind load` imports,
with its tag inside) that containerd's `ctr -n k8s.io images import` accepts. An image is rebuilt
only when what it is made from changed: for the project's image, a hash of the Dockerfile, of every
file its COPY and ADD instructions name (today pyproject.toml, README.md, LICENSE, constraints.txt and
src/; bytecode and tool caches excluded), the build arguments, the target and the base image; so a
second run with nothing to do takes seconds.

Everything lands in ${XDG_CACHE_HOME:-~/.cache}/plugvisor/images/ (override with --cache or
PLUGVISOR_IMAGES_CACHE): storage/ is buildah's image store (private: see what it holds with
`buildah --root <cache>/storage --runroot <cache>/runroot images`), archives/ the archives and what
each was built from, logs/ each step's full output. The Debian packages it needs (buildah, runc,
debootstrap, busybox-static) are installed with apt-get when missing.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Bump when the way any image is made changes: every cached image is then made again.
RECIPE_VERSION = "1"

DEFAULT_IMAGE = "plugvisor:e2e"
DEFAULT_POD_IMAGE = "plugvisor-e2e-pod:latest"
STANDIN = "localhost/plugvisor/python-standin:3.11-slim"
KEY_LABEL = "io.plugvisor.images.key"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# Debian's python3 and pip read this path (Debian patches pip's certifi to use the system store).
IMAGE_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

SUITE = "bookworm"  # Debian 12: its python3 is 3.11, the Python of python:3.11-slim
MIRROR = "http://deb.debian.org/debian"
SECURITY_MIRROR = "http://deb.debian.org/debian-security"
# Executable (or, for busybox, the package's status) -> the Debian package that provides it. runc, not
# crun: the crun of bookworm refuses hosts whose cgroups are mixed v1/v2 ("hybrid"), as these VMs are.
DEBIAN_TOOLS = {"buildah": "buildah", "runc": "runc", "debootstrap": "debootstrap"}
BUSYBOX_PACKAGE = "busybox-static"  # the pod image has no C library: only the static build runs there
BUSYBOX = Path("/bin/busybox")

# Run inside the debootstrapped root file system (buildah run, host network): the stand-in's packages,
# with Debian's security updates, trimmed the way debian:bookworm-slim is.
STANDIN_SCRIPT = f"""\
set -eu
export DEBIAN_FRONTEND=noninteractive
cat > /etc/dpkg/dpkg.cfg.d/plugvisor-slim <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
EOF
cat > /etc/apt/apt.conf.d/plugvisor-slim <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
EOF
rm -f /etc/apt/sources.list
cat > /etc/apt/sources.list.d/debian.sources <<'EOF'
Types: deb
URIs: {MIRROR}
Suites: {SUITE} {SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: {SECURITY_MIRROR}
Suites: {SUITE}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
apt-get update -q
apt-get upgrade -y -q
apt-get install -y -q python3 python3-pip python-is-python3 ca-certificates
python3 -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version'
rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED
apt-get clean
find /usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete
find /usr/share/doc -mindepth 1 -type d -empty -delete
rm -rf /usr/share/man/* /usr/share/info/* /usr/share/groff/* /usr/share/lintian/* /usr/share/linda/* \\
    /usr/share/locale/* /var/lib/apt/lists/* /var/cache/apt/* /var/cache/debconf/*-old \\
    /var/lib/dpkg/*-old /root/.cache /tmp/* /var/tmp/*
find /var/log -type f -delete
python3 --version
"""
# Copies the debootstrapped tree ($1) into the container's mounted root ($2), owners, modes and
# extended attributes (file capabilities) kept. Device nodes, downloaded packages and package lists
# stay out: the runtime makes /dev, and the next step fetches fresh lists.
COPY_ROOTFS = (
    'tar -C "$1" --exclude=./dev/* --exclude=./proc/* --exclude=./sys/*'
    " --exclude=./var/cache/apt/archives/*.deb --exclude=./var/lib/apt/lists/* --xattrs -cf - ."
    ' | tar -C "$2" --numeric-owner --xattrs --xattrs-include="*" -xpf -'
)
STANDIN_CONFIG = [
    "--env",
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "--env",
    "LANG=C.UTF-8",
    "--cmd",
    '["python3"]',
    "--label",
    "org.opencontainers.image.description=A stand-in for python:3.11-slim made by tools/kubernetes/images.py:"
    f" Debian {SUITE} (minbase) with Debian's python3 and pip",
]
POD_CONFIG = [
    "--cmd",
    '["sh"]',
    "--env",
    "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
    "--label",
    "org.opencontainers.image.description=Debian's busybox-static, for the e2e scenarios' pods",
]

# Directories that never reach the wheel or the image's behaviour: their churn must not cause rebuilds.
SKIPPED_DIRS = frozenset(
    {"__pycache__", ".git", ".tox", ".venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
)
SKIPPED_SUFFIXES = (".pyc", ".pyo")


class BuildError(RuntimeError):
    """A step failed; the message says which and shows the end of the tool's output."""


class UsageError(ValueError):
    """Bad input on the command line; the message names it and what was expected."""


# ---------------------------------------------------------------------------------------------------
# Pure parts: references, arguments, the Dockerfile's inputs and their hash.
# ---------------------------------------------------------------------------------------------------

_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[\w][\w.-]{0,127}")


def normalize_ref(ref: str) -> str:
    """The full name containerd and the kubelet give an image reference (docker.io/library/..., :latest).

    A pod that says ``image: plugvisor:e2e`` runs ``docker.io/library/plugvisor:e2e``; the archive must
    carry that name for the import to satisfy it.
    """
    expected = "expected [registry/]name[:tag] with a lower-case name, e.g. plugvisor:e2e"
    if not ref or "@" in ref or ref != ref.strip():
        raise UsageError(f"image reference {ref!r}: {expected} (no digest)")
    name, tag = ref, "latest"
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = ref.rsplit(":", 1)
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        domain, path = parts[0], parts[1:]  # as Docker decides: a first component that looks like a host
    else:
        domain, path = "docker.io", parts if len(parts) > 1 else ["library", *parts]
    if not all(_COMPONENT.fullmatch(p) for p in path) or not _TAG.fullmatch(tag):
        raise UsageError(f"image reference {ref!r}: {expected}")
    return f"{domain}/{'/'.join(path)}:{tag}"


def parse_build_arg(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` from --build-arg."""
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise UsageError(f"--build-arg {text!r}: expected KEY=VALUE with KEY a Dockerfile ARG name")
    return key, value


@dataclass(frozen=True)
class ImageSpec:
    """One image of the project's Dockerfile to build: its tag and the stage it stops at (None: last)."""

    ref: str
    target: str | None = None

    @property
    def name(self) -> str:
        """The normalized reference: the name in buildah's store, in the archive and in containerd."""
        return normalize_ref(self.ref)


def parse_image_spec(text: str) -> ImageSpec:
    """``REF`` or ``REF=TARGET`` from --image."""
    ref, sep, target = text.partition("=")
    if sep and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", target):
        raise UsageError(
            f"--image {text!r}: expected REF or REF=TARGET, TARGET a stage name of the Dockerfile"
        )
    normalize_ref(ref)  # fails with the reference named
    return ImageSpec(ref, target or None)


def _instructions(dockerfile: str) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuation lines joined, comments dropped."""
    pending: list[str] = []
    for line in [*(raw.strip() for raw in dockerfile.splitlines()), None]:  # None: the end
        if line is not None and (not line or line.startswith("#")):
            continue  # inside a continuation too, as the Dockerfile parser does
        if line is not None and line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        text = " ".join([*pending, line or ""]).strip()
        pending = []
        if text:
            instruction, _, rest = text.partition(" ")
            yield instruction.upper(), rest.strip()


def dockerfile_stages(dockerfile: str) -> list[str]:
    """The named stages of a Dockerfile, in order (``FROM image AS name``; names are case-insensitive)."""
    stages = []
    for instruction, rest in _instructions(dockerfile):
        words = [word for word in rest.split() if not word.startswith("--")]
        if instruction == "FROM" and len(words) >= 3 and words[-2].lower() == "as":
            stages.append(words[-1].lower())
    return stages


def dockerfile_sources(dockerfile: str) -> list[str]:
    """The build-context paths that the Dockerfile's COPY and ADD instructions read.

    Copies from another stage or image (``--from``) and remote sources (URLs) read nothing of the
    context and are left out.
    """
    sources: list[str] = []
    for instruction, rest in _instructions(dockerfile):
        if instruction not in ("COPY", "ADD"):
            continue
        words = [str(w) for w in json.loads(rest)] if rest.startswith("[") else shlex.split(rest)
        flags = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        if any(f.startswith("--from=") for f in flags) or len(paths) < 2:
            continue
        sources += [p for p in paths[:-1] if not re.match(r"^[a-z]+://|^git@", p)]
    return sources


def _walk(path: Path) -> Iterator[Path]:
    """Every file and link under path (itself if it is one), in a stable order, caches left out."""
    if path.is_symlink() or not path.is_dir():
        yield path
        return
    for child in sorted(path.iterdir()):
        if child.name in SKIPPED_DIRS or child.name.endswith(SKIPPED_SUFFIXES):
            continue
        yield from _walk(child)


def input_digest(context: Path, dockerfile: Path, extra: Mapping[str, str]) -> str:
    """A hash of everything the image is made from: equal hashes, equal images (so no rebuild).

    ``extra`` carries what is not a file: build arguments, the target, the base image's identity.
    Raises UsageError when a COPY source names a variable or matches nothing (a build would fail or
    copy something this hash cannot see).
    """
    digest = hashlib.sha256()
    text = dockerfile.read_text()
    digest.update(b"dockerfile\0" + text.encode() + b"\0")
    for key in sorted(extra):
        digest.update(f"extra\0{key}\0{extra[key]}\0".encode())
    for source in dockerfile_sources(text):
        if "$" in source:
            raise UsageError(
                f"{dockerfile}: COPY/ADD source {source!r} names a variable; expected literal paths"
            )
        pattern = source.lstrip("/")
        matches = sorted(context.glob(pattern)) if any(c in pattern for c in "*?[") else [context / pattern]
        matches = [m for m in matches if m.exists() or m.is_symlink()]
        if not matches:
            raise UsageError(f"{dockerfile}: COPY/ADD source {source!r} is not in {context}")
        for match in matches:
            for path in _walk(match):
                relative = path.relative_to(context).as_posix()
                if path.is_symlink():
                    digest.update(f"link\0{relative}\0{path.readlink()}\0".encode())
                    continue
                executable = "x" if os.access(path, os.X_OK) else "-"
                digest.update(f"file\0{relative}\0{executable}\0".encode())
                digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def archive_filename(name: str) -> str:
    """A file name for the archive of a normalized reference (one archive per tag, replaced on rebuild)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".tar"


# ---------------------------------------------------------------------------------------------------
# Running things: timed steps, logged commands, buildah.
# ---------------------------------------------------------------------------------------------------


def say(message: str) -> None:
    """Progress goes to stderr: stdout is kept for --json."""
    print(f"[images] {message}", file=sys.stderr, flush=True)


@dataclass
class Step:
    """Prints a step when it starts and how long it took when it ends."""

    name: str

    def __enter__(self) -> Step:
        self.started = time.monotonic()
        say(f"{self.name} ...")
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        outcome = "failed" if error else "done"
        say(f"{self.name}: {outcome} in {time.monotonic() - self.started:.1f} s")


@dataclass
class Runner:
    """Runs the tools, each command's output appended to one log file per image (shown when it fails)."""

    cache: Path
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.cache / "logs" / "images.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)

    def use_log(self, name: str) -> None:
        """Send the following commands' output to logs/<name>.log, started afresh."""
        self.log = self.cache / "logs" / f"{name}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")

    def run(self, argv: Sequence[str], *, capture: bool = False, env: Mapping[str, str] | None = None) -> str:
        """Run argv; its output goes to the log (or is returned, with capture). Failure raises BuildError."""
        with self.log.open("a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            result = subprocess.run(
                argv,
                stdout=subprocess.PIPE if capture else log,
                stderr=log,
                text=True,
                check=False,
                env=None if env is None else {**os.environ, **env},
            )
        if result.returncode != 0:
            tail = "\n".join(self.log.read_text().splitlines()[-40:])
            name = Path(argv[0]).name
            raise BuildError(f"{name} failed (exit {result.returncode}); the end of {self.log}:\n{tail}")
        return result.stdout or ""


@dataclass
class Buildah:
    """buildah on the cache's private image store, with runc and the host's network for RUN steps."""

    runner: Runner
    root: Path
    runroot: Path

    def global_args(self) -> list[str]:
        """The store every command works on (never the machine's /var/lib/containers)."""
        return [
            "buildah",
            "--root",
            str(self.root),
            "--runroot",
            str(self.runroot),
            "--storage-driver",
            "overlay",
        ]

    def __call__(self, *args: str, capture: bool = False) -> str:
        """Run one buildah command."""
        return self.runner.run([*self.global_args(), *args], capture=capture)

    def image_info(self, name: str) -> tuple[str, dict[str, str]] | None:
        """The image's ID and labels, or None when the store has no image of that name."""
        result = subprocess.run(
            [*self.global_args(), "inspect", "--type", "image", name],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            return None
        info = json.loads(result.stdout)
        labels = info.get("OCIv1", {}).get("config", {}).get("Labels") or {}
        return str(info["FromImageID"]), {str(k): str(v) for k, v in labels.items()}

    @contextlib.contextmanager
    def working_container(self, name: str) -> Iterator[str]:
        """A container from scratch, removed whatever happens (committing with --rm removes it too)."""
        subprocess.run([*self.global_args(), "rm", name], capture_output=True, check=False)
        container = self("from", "--name", name, "scratch", capture=True).strip()
        try:
            yield container
        finally:
            subprocess.run([*self.global_args(), "rm", container], capture_output=True, check=False)

    @contextlib.contextmanager
    def mounted(self, container: str) -> Iterator[Path]:
        """The container's root file system, mounted on the host while the block runs."""
        mountpoint = Path(self("mount", container, capture=True).strip())
        try:
            yield mountpoint
        finally:
            self("umount", container)


# ---------------------------------------------------------------------------------------------------
# The images.
# ---------------------------------------------------------------------------------------------------


@dataclass
class Built:
    """One image's archive and what the summary says about it."""

    ref: str
    name: str
    archive: Path
    image_id: str
    archive_bytes: int
    unpacked_bytes: int
    rebuilt: bool
    compressed_bytes: int | None = None

    def summary(self) -> dict[str, object]:
        """The --json entry of this image."""
        return {
            "name": self.name,
            "archive": str(self.archive),
            "archive_bytes": self.archive_bytes,
            "unpacked_bytes": self.unpacked_bytes,
            "compressed_bytes": self.compressed_bytes,
            "image_id": self.image_id,
            "rebuilt": self.rebuilt,
        }


def layer_sizes(archive: Path) -> tuple[int, list[str]]:
    """Total bytes of the archive's (uncompressed) layers, and the layers' member names."""
    with tarfile.open(archive) as tar:
        manifest = tar.extractfile("manifest.json")
        assert manifest is not None
        layers = [str(name) for name in json.load(manifest)[0]["Layers"]]
        return sum(tar.getmember(name).size for name in layers), layers


def gzip_size(archive: Path, layers: Sequence[str]) -> int:
    """What the layers weigh gzip-compressed (level 6, as registries store them)."""
    total = 0
    with tarfile.open(archive) as tar:
        for name in layers:
            member = tar.extractfile(name)
            assert member is not None
            compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
            while chunk := member.read(1 << 20):
                total += len(compressor.compress(chunk))
            total += len(compressor.flush())
    return total


@dataclass
class Images:
    """Makes the images of one run under the cache's lock."""

    cache: Path
    buildah: Buildah
    runner: Runner
    force: bool = False
    measure: bool = False

    @property
    def archives(self) -> Path:
        """Where the archives and their records are."""
        return self.cache / "archives"

    def cached(self, ref: str, name: str, key: str) -> Built | None:
        """The archive of a previous run, if it was made from the same inputs and is still whole."""
        archive = self.archives / archive_filename(name)
        record_path = archive.with_suffix(".json")
        if self.force or not archive.exists() or not record_path.exists():
            return None
        record = json.loads(record_path.read_text())
        if record.get("key") != key or record.get("archive_bytes") != archive.stat().st_size:
            return None
        if self.buildah.image_info(name) is None:  # the store was wiped: make it again, so both agree
            return None
        say(f"{ref}: up to date ({archive})")
        return Built(
            ref=ref,
            name=name,
            archive=archive,
            image_id=record["image_id"],
            archive_bytes=record["archive_bytes"],
            unpacked_bytes=record["unpacked_bytes"],
            compressed_bytes=record.get("compressed_bytes"),
            rebuilt=False,
        )

    def write_archive(self, ref: str, name: str, key: str) -> Built:
        """Write the image from the store as a docker-archive named after it, with its record."""
        self.archives.mkdir(parents=True, exist_ok=True)
        archive = self.archives / archive_filename(name)
        partial = archive.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        with Step(f"{ref}: write the archive"):
            self.buildah("push", "--quiet", name, f"docker-archive:{partial}:{name}")
            partial.replace(archive)
        info = self.buildah.image_info(name)
        assert info is not None
        unpacked, layers = layer_sizes(archive)
        built = Built(
            ref=ref,
            name=name,
            archive=archive,
            image_id=info[0],
            archive_bytes=archive.stat().st_size,
            unpacked_bytes=unpacked,
            rebuilt=True,
        )
        if self.measure:
            with Step(f"{ref}: measure the gzip-compressed size"):
                built.compressed_bytes = gzip_size(archive, layers)
        record = {**built.summary(), "ref": ref, "key": key}
        archive.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
        return built

    def standin(self, refresh: bool) -> str:
        """The python:3.11-slim stand-in's image ID, made when the store lacks it (or on --refresh-base)."""
        key = hashlib.sha256(f"{RECIPE_VERSION}\0{STANDIN_SCRIPT}\0{STANDIN_CONFIG}".encode()).hexdigest()
        info = self.buildah.image_info(STANDIN)
        if info is not None and info[1].get(KEY_LABEL) == key and not refresh:
            say(f"base image {STANDIN}: up to date ({info[0][:12]})")
            return info[0]
        self.runner.use_log("standin")
        work = self.cache / "work"
        shutil.rmtree(work, ignore_errors=True)
        rootfs = work / "rootfs"
        rootfs.parent.mkdir(parents=True)
        try:
            with Step(f"base image: debootstrap {SUITE} (minbase)"):
                # In a mount namespace of its own: the /proc and /sys debootstrap mounts in the new root
                # go away with it, even if debootstrap is interrupted.
                self.runner.run(
                    [
                        "unshare",
                        "--mount",
                        "--propagation",
                        "private",
                        "debootstrap",
                        "--variant=minbase",
                        SUITE,
                        str(rootfs),
                        MIRROR,
                    ]
                )
            with self.buildah.working_container("plugvisor-standin") as container:
                with (
                    Step("base image: load the root file system into buildah"),
                    self.buildah.mounted(container) as mountpoint,
                ):
                    self.runner.run(["sh", "-c", COPY_ROOTFS, "sh", str(rootfs), str(mountpoint)])
                shutil.rmtree(work)
                with Step("base image: apt-get python3 and pip (with security updates), slim it"):
                    self.buildah(
                        "run",
                        "--runtime",
                        runtime(),
                        "--network",
                        "host",
                        container,
                        "--",
                        "sh",
                        "-c",
                        STANDIN_SCRIPT,
                    )
                with Step(f"base image: commit {STANDIN} (one layer)"):
                    self.buildah("config", *STANDIN_CONFIG, "--label", f"{KEY_LABEL}={key}", container)
                    self.buildah("commit", "--quiet", "--squash", "--rm", container, STANDIN)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self.buildah("rmi", "--prune")  # the previous stand-in, now untagged
        info = self.buildah.image_info(STANDIN)
        assert info is not None
        return info[0]

    def project(
        self,
        spec: ImageSpec,
        *,
        context: Path,
        dockerfile: Path,
        build_args: Mapping[str, str],
        ca_bundle: Path | None,
    ) -> Built:
        """The project's image from its Dockerfile, unchanged, built when its inputs changed."""
        base = build_args.get("PYTHON_IMAGE", "")
        base_info = self.buildah.image_info(base)
        extra = {
            "recipe": RECIPE_VERSION,
            "base": base_info[0] if base_info else base,
            "target": spec.target or "",
            "name": spec.name,
            **{f"arg:{k}": v for k, v in build_args.items()},
        }
        key = input_digest(context, dockerfile, extra)
        cached = self.cached(spec.ref, spec.name, key)
        if cached is not None:
            return cached
        self.runner.use_log(archive_filename(spec.name).removesuffix(".tar"))
        argv = ["build", "--runtime", runtime(), "--network", "host", "--pull=never", "--layers=false"]
        argv += ["--force-rm", "--file", str(dockerfile), "--tag", spec.name]
        if ca_bundle is not None:
            argv += ["--volume", f"{ca_bundle}:{IMAGE_CA_BUNDLE}:ro"]
        if spec.target:
            argv += ["--target", spec.target]
        for arg, value in build_args.items():
            argv += ["--build-arg", f"{arg}={value}"]
        with Step(
            f"{spec.ref}: buildah build {dockerfile.name}"
            + (f" --target {spec.target}" if spec.target else "")
        ):
            self.buildah(*argv, str(context))
        self.buildah("rmi", "--prune")  # the image this one replaces, now untagged
        return self.write_archive(spec.ref, spec.name, key)

    def pod(self, ref: str) -> Built:
        """The pods' image: Debian's static busybox, a link per applet, root and nobody in /etc/passwd."""
        name = normalize_ref(ref)
        applets = sorted(self.runner.run([str(BUSYBOX), "--list-full"], capture=True).split())
        busybox_hash = hashlib.sha256(BUSYBOX.read_bytes()).hexdigest()
        recipe = f"{RECIPE_VERSION}\0{name}\0{busybox_hash}\0{applets}\0{POD_CONFIG}"
        key = hashlib.sha256(recipe.encode()).hexdigest()
        cached = self.cached(ref, name, key)
        if cached is not None:
            return cached
        self.runner.use_log(archive_filename(name).removesuffix(".tar"))
        with (
            Step(f"{ref}: busybox-static, {len(applets)} applets"),
            self.buildah.working_container("plugvisor-pod-image") as container,
        ):
            with self.buildah.mounted(container) as root:
                fill_pod_root(root, applets)
            self.buildah("config", *POD_CONFIG, container)
            self.buildah("commit", "--quiet", "--rm", container, name)
        self.buildah("rmi", "--prune")
        return self.write_archive(ref, name, key)


def fill_pod_root(root: Path, applets: Sequence[str]) -> None:
    """Busybox as the pods' whole system: the binary, its applets' links, root and nobody, /tmp."""
    for directory in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "tmp", "var/tmp"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "var/tmp").chmod(0o1777)
    (root / "root").chmod(0o700)
    shutil.copy2(BUSYBOX, root / "bin/busybox")
    for applet in applets:
        link = root / applet
        if not link.exists() and not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to("/bin/busybox")
    (root / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
    )
    (root / "etc/group").write_text("root:x:0:\nnobody:x:65534:\n")


def runtime() -> str:
    """The OCI runtime for RUN steps (see DEBIAN_TOOLS on why runc): the distribution's runc.

    Never whatever PATH finds first: another install's runc may come earlier there (e2e/local/hostbin.py).
    """
    return shutil.which("runc", path="/usr/sbin:/usr/bin:/sbin:/bin") or "/usr/sbin/runc"


# ---------------------------------------------------------------------------------------------------
# The machine: root, Debian's packages, the cache's lock, containerd.
# ---------------------------------------------------------------------------------------------------


def package_installed(package: str) -> bool:
    """Whether dpkg reports the package installed."""
    status = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False
    )
    return status.returncode == 0 and "install ok installed" in status.stdout


def missing_packages() -> list[str]:
    """The Debian packages this script needs and does not find."""
    missing = [package for tool, package in DEBIAN_TOOLS.items() if shutil.which(tool) is None]
    if shutil.which("dpkg-query") is None or not package_installed(BUSYBOX_PACKAGE):
        missing.append(BUSYBOX_PACKAGE)
    return missing


def install_packages(runner: Runner, allowed: bool) -> None:
    """apt-get install what is missing; refresh the package lists once if that fails."""
    missing = missing_packages()
    if not missing:
        return
    if not allowed or shutil.which("apt-get") is None:
        raise BuildError(f"missing Debian packages: {' '.join(missing)} (install them with apt-get)")
    runner.use_log("apt-get")
    with Step(f"installing from Debian: {' '.join(missing)}"):
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
        try:
            runner.run(install, env=env)
        except BuildError:  # an empty or old package list: refresh it once
            runner.run(["apt-get", "update", "-q"], env=env)
            runner.run(install, env=env)


def default_cache() -> Path:
    """${PLUGVISOR_IMAGES_CACHE}, else ${XDG_CACHE_HOME:-~/.cache}/plugvisor/images."""
    if os.environ.get("PLUGVISOR_IMAGES_CACHE"):
        return Path(os.environ["PLUGVISOR_IMAGES_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plugvisor" / "images"


@contextlib.contextmanager
def locked(cache: Path) -> Iterator[None]:
    """One run at a time per cache: two builds into one store and one archive would corrupt both."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / "lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another run on {cache} to finish ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def import_into(runner: Runner, ctr: str, address: str, namespace: str, built: Built) -> None:
    """Import with ctr, then check containerd lists the image under its full name."""
    runner.use_log("import")
    base = [ctr, "--address", address, "--namespace", namespace, "images"]
    with Step(f"{built.ref}: ctr -n {namespace} images import"):
        runner.run([*base, "import", str(built.archive)])
        listed = runner.run([*base, "list", "--quiet"], capture=True).split()
        if built.name not in listed:
            raise BuildError(f"ctr imported {built.archive} but lists no {built.name} (it lists: {listed})")


# ---------------------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The command line (its --help is the module's docstring, with every option)."""
    cli = argparse.ArgumentParser(
        prog="images.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_argument(
        "--image",
        dest="images",
        action="append",
        metavar="REF[=TARGET]",
        help=f"a tag to build from the Dockerfile, optionally from stage TARGET; repeat for several"
        f" (default: {DEFAULT_IMAGE}, the last stage)",
    )
    cli.add_argument(
        "--build-arg",
        dest="build_args",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to every build; PYTHON_IMAGE=... replaces the stand-in (it must be in the store:"
        " nothing is pulled)",
    )
    cli.add_argument(
        "--pod-image", default=DEFAULT_POD_IMAGE, metavar="REF", help="the pods' image (default: %(default)s)"
    )
    cli.add_argument("--no-pod-image", action="store_true", help="do not make the pods' image")
    cli.add_argument("--repo", type=Path, default=REPO, help="the build context (default: this checkout)")
    cli.add_argument("--dockerfile", type=Path, help="default: Dockerfile in --repo")
    cli.add_argument("--cache", type=Path, help=f"the cache directory (default: {default_cache()})")
    cli.add_argument(
        "--ca-bundle",
        default=str(HOST_CA_BUNDLE) if HOST_CA_BUNDLE.exists() else "",
        help="the certificate authorities RUN steps trust, mounted over the image's for the build only"
        " (default: %(default)s; '' for the image's own)",
    )
    cli.add_argument(
        "--force", action="store_true", help="rebuild the images even if their inputs did not change"
    )
    cli.add_argument(
        "--refresh-base", action="store_true", help="make the stand-in again (new Debian updates)"
    )
    cli.add_argument("--measure", action="store_true", help="also measure each image's gzip-compressed size")
    cli.add_argument(
        "--no-apt", action="store_true", help="do not install missing Debian packages; fail instead"
    )
    cli.add_argument(
        "--import", dest="import_address", metavar="ADDRESS", help="import into the containerd at this socket"
    )
    cli.add_argument("--ctr", default="ctr", help="the ctr binary for --import (default: %(default)s)")
    cli.add_argument(
        "--namespace", default="k8s.io", help="containerd namespace for --import (default: %(default)s)"
    )
    cli.add_argument(
        "--json", action="store_true", help="print a summary on stdout: {images: {ref: {archive, ...}}}"
    )
    return cli


@dataclass
class Plan:
    """What the command line asks for, checked: every image's tag, the build's inputs."""

    specs: list[ImageSpec]
    build_args: dict[str, str]
    pod_ref: str | None
    context: Path
    dockerfile: Path
    ca_bundle: Path | None


def plan(args: argparse.Namespace) -> Plan:
    """Check the command line; UsageError names the first bad input and what was expected."""
    specs = [parse_image_spec(text) for text in args.images or [DEFAULT_IMAGE]]
    pod_ref = None if args.no_pod_image else str(args.pod_image)
    names = [spec.name for spec in specs] + ([normalize_ref(pod_ref)] if pod_ref else [])
    if len(set(names)) != len(names):
        raise UsageError(f"--image/--pod-image: expected a distinct tag for each image, got {names}")
    dockerfile = (args.dockerfile or args.repo / "Dockerfile").resolve()
    if not dockerfile.is_file():
        raise UsageError(f"--dockerfile {dockerfile}: expected a Dockerfile")
    try:
        stages = dockerfile_stages(dockerfile.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--dockerfile {dockerfile}: cannot read it: {exc}") from None
    for spec, text in zip(specs, args.images or [DEFAULT_IMAGE], strict=True):
        if spec.target is not None and spec.target.lower() not in stages:
            raise UsageError(
                f"--image {text!r}: the Dockerfile has no stage {spec.target!r} (its stages: "
                f"{', '.join(stages) or 'none named'})"
            )
    ca_bundle = Path(args.ca_bundle) if args.ca_bundle else None
    if ca_bundle is not None and not ca_bundle.is_file():
        raise UsageError(f"--ca-bundle {ca_bundle}: expected a PEM file of certificate authorities")
    return Plan(
        specs=specs,
        build_args=dict(parse_build_arg(text) for text in args.build_args),
        pod_ref=pod_ref,
        context=args.repo.resolve(),
        dockerfile=dockerfile,
        ca_bundle=ca_bundle,
    )


def build(plan: Plan, args: argparse.Namespace, cache: Path) -> list[Built]:
    """Make every image the plan names (and import them with --import), under the cache's lock."""
    runner = Runner(cache)
    with locked(cache):
        install_packages(runner, allowed=not args.no_apt)
        images = Images(
            cache, Buildah(runner, cache / "storage", cache / "runroot"), runner, args.force, args.measure
        )
        build_args = plan.build_args
        if "PYTHON_IMAGE" not in build_args:
            build_args = {"PYTHON_IMAGE": STANDIN, **build_args}
            images.standin(refresh=args.refresh_base)
        built = [
            images.project(
                spec,
                context=plan.context,
                dockerfile=plan.dockerfile,
                build_args=build_args,
                ca_bundle=plan.ca_bundle,
            )
            for spec in plan.specs
        ]
        if plan.pod_ref is not None:
            built.append(images.pod(plan.pod_ref))
        if args.import_address:
            for image in built:
                import_into(runner, args.ctr, args.import_address, args.namespace, image)
    return built


def main(argv: list[str] | None = None) -> int:
    """Build the images, or say in one line why not; exit status 1 on any failure, 2 on bad input."""
    args = parser().parse_args(argv)
    try:
        checked = plan(args)
    except UsageError as error:
        print(f"images.py: {error}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("images.py: must run as root (debootstrap and buildah's image store need it)", file=sys.stderr)
        return 1
    started = time.monotonic()
    try:
        built = build(checked, args, (args.cache or default_cache()).resolve())
    except (BuildError, UsageError, OSError) as error:
        say(f"failed: {error}")
        return 1
    for image in built:
        size = f"{image.unpacked_bytes / 1e6:.1f} MB unpacked"
        if image.compressed_bytes is not None:
            size += f", {image.compressed_bytes / 1e6:.1f} MB gzip-compressed"
        say(f"{image.ref} ({image.name}): {image.archive} ({size}{'' if image.rebuilt else ', cached'})")
    say(f"all done in {time.monotonic() - started:.1f} s")
    if args.json:
        print(json.dumps({"images": {image.ref: image.summary() for image in built}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
