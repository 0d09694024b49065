"""Build the real cluster's binaries (versions.toml) from Go modules into a cache outside the checkout.

    python3 tools/kubernetes/build.py            # build what is missing or out of date, print each step
    python3 tools/kubernetes/build.py --status   # say what is missing, build nothing (exit 1 if anything is)

Why from Go modules and not release tarballs: these machines reach the Go module proxy, PyPI and Debian
and nothing else, so every component is compiled from its module with the machine's Go. Upstream's
k8s.io/kubernetes go.mod points the k8s.io/* staging modules at ./staging paths its module zip does not
hold, so a small wrapper module requires it and replaces each of those with the published v0.X.Y module
of the same release (read from its own go.mod, so a new version needs no edit here). etcd's and
containerd's commands are built the same way, from wrapper modules that require them.

Everything lands in ${XDG_CACHE_HOME:-~/.cache}/plugvisor/kubernetes/<kubernetes version>/ (override with
--cache or PLUGVISOR_K8S_CACHE): src/ holds the wrapper modules, bin/ the binaries, each with a stamp of
what it was built from (module version, Go version, flags); a binary whose stamp matches is not rebuilt,
so a second run with nothing to do takes a second. Go's own module and build caches are used as they
are, so a rebuild after a version bump compiles only what changed. The Debian packages the node needs
(runc, CNI plugins, iptables, conntrack, openssl) are installed with apt-get when missing (root only).

Only the standard library is used: this runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSIONS = HERE / "versions.toml"
WRAPPER = "plugvisor.local/kubernetes"
KUBE_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
CONTAINERD_COMMANDS = ("containerd", "containerd-shim-runc-v2", "ctr")
# containerd's Makefile tags minus what needs C libraries (btrfs, zfs) or block devices (devmapper):
# a containerd with the overlayfs and native snapshotters, which is what the node uses.
CONTAINERD_TAGS = "urfave_cli_no_docs no_btrfs no_zfs no_devmapper"
ETCD_MAIN = """\
// The etcd command: upstream's main is package etcdmain of go.etcd.io/etcd/server/v3.
package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


# A Go module's release tag (what the module proxy serves), e.g. v1.37.2 or v2.4.0-rc.1: never a path.
_TAG = re.compile(r"v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]{1,64})?")
# A Debian package name (Debian policy 5.6.1): lowercase letters, digits, + - . ; two characters at least.
_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]{1,99}")


class VersionsError(Exception):
    """versions.toml is missing, not TOML, or holds something that is not what is expected; one line."""


def read_toml(path: Path) -> dict[str, object]:
    """A TOML file's tables, or one line naming the file and why it cannot be read (tools/kind too)."""
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise VersionsError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise VersionsError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise VersionsError(f"{path}: not valid TOML: {exc}") from None


def versions() -> dict[str, dict[str, object]]:
    """The pinned versions, checked (read at each call: the file is small and the script short-lived).

    Raises :class:`VersionsError` naming the file and the key: a version becomes a
    directory name (the cache) and a module query, so anything but a release tag
    (``../../../tmp/evil``) is refused before it is used, and ``packages`` must be
    a list of Debian package names (a string would be read letter by letter).
    """
    document = read_toml(VERSIONS)
    for table in ("kubernetes", "etcd", "containerd"):
        section = document.get(table)
        if not isinstance(section, dict):
            raise VersionsError(f'{VERSIONS}: [{table}]: missing table (expected version = "vX.Y.Z")')
        version = section.get("version")
        if not isinstance(version, str) or not _TAG.fullmatch(version):
            raise VersionsError(
                f'{VERSIONS}: {table}.version: expected a release tag such as "v1.2.3", got {version!r:.80}'
            )
    debian = document.get("debian")
    packages = debian.get("packages") if isinstance(debian, dict) else None
    if not isinstance(packages, list) or not all(isinstance(p, str) for p in packages):
        raise VersionsError(
            f'{VERSIONS}: debian.packages: expected a list of package names, such as ["runc"], '
            f"got {packages!r:.80}"
        )
    wrong = [p for p in packages if not _PACKAGE.fullmatch(p)]
    if wrong:
        raise VersionsError(f"{VERSIONS}: debian.packages: {wrong[0]!r:.80} is not a Debian package name")
    return document


def cache_root(override: str | None = None) -> Path:
    """The cache for the pinned Kubernetes version: bin/, src/ and the stamps."""
    if override or os.environ.get("PLUGVISOR_K8S_CACHE"):
        return Path(override or os.environ["PLUGVISOR_K8S_CACHE"]).expanduser().resolve()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "plugvisor" / "kubernetes" / str(versions()["kubernetes"]["version"])


def bin_dir(override: str | None = None) -> Path:
    """Where the cluster finds its binaries (the e2e backend asks here, so both agree)."""
    return cache_root(override) / "bin"


PAUSE_IMAGE = "plugvisor.local/pause:1"


def every_binary() -> tuple[str, ...]:
    """Every binary the cluster runs, for the status check."""
    return (*KUBE_COMMANDS, "etcd", *CONTAINERD_COMMANDS, "pause")


def pause_archive(root: Path) -> Path:
    """The pods' sandbox image, as a docker archive for `ctr images import`."""
    return root / "images" / "pause.tar"


def missing_debian_packages() -> list[str]:
    """The node's Debian packages that dpkg does not report installed."""
    wanted = [str(p) for p in versions()["debian"]["packages"]]  # type: ignore[attr-defined]
    if shutil.which("dpkg-query") is None:
        return wanted
    missing = []
    for package in wanted:
        status = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False
        )
        if status.returncode != 0 or "install ok installed" not in status.stdout:
            missing.append(package)
    return missing


@dataclass
class Step:
    """Prints a step when it starts and how long it took when it ends."""

    name: str

    def __enter__(self) -> Step:
        self.started = time.monotonic()
        print(f"[build] {self.name} ...", flush=True)
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        outcome = "failed" if error else "done"
        print(f"[build] {self.name}: {outcome} in {time.monotonic() - self.started:.1f} s", flush=True)


class BuildError(RuntimeError):
    """A build step failed; the message says which and shows the tool's output."""


def run(argv: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a tool; on failure raise with its output, so the step that failed shows why."""
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        raise BuildError(f"{' '.join(argv)} failed ({result.returncode}):\n{output[-6000:]}")
    return result.stdout


def go_version() -> str:
    """The Go that builds: part of every stamp, so a new Go rebuilds everything."""
    return run(["go", "env", "GOVERSION"]).strip()


@dataclass
class Component:
    """A wrapper module (go.mod + sources) and the commands built from it."""

    name: str
    module: str | None  # None: the wrapper's own sources are the program
    version: str
    packages: dict[str, str]  # binary name -> Go package
    ldflags: str
    tags: str = ""
    sources: dict[str, str] | None = None
    replaces: dict[str, str] | None = None

    def go_mod(self, go: str) -> str:
        """The wrapper's go.mod before tidy: only what is pinned; tidy adds the rest deterministically."""
        lines = [f"module {WRAPPER}/{self.name}", "", f"go {go}"]
        if self.module:
            lines += ["", f"require {self.module} {self.version}"]
        if self.replaces:
            lines += ["", "replace ("]
            lines += [f"\t{old} => {new}" for old, new in sorted(self.replaces.items())]
            lines.append(")")
        return "\n".join(lines) + "\n"

    def source_files(self) -> dict[str, str]:
        """The wrapper's Go files: given ones, or a tools.go that imports every command (for go mod tidy)."""
        if self.sources is not None:
            return self.sources
        imports = "".join(f'\t_ "{package}"\n' for package in self.packages.values())
        header = f"//go:build tools\n\n// The commands built from {self.module}.\npackage tools\n\n"
        text = f"{header}import (\n{imports})\n"
        return {"tools.go": text}

    def stamp(self, binary: str, go: str) -> str:
        """Everything a binary is built from: a binary whose stamp differs is rebuilt."""
        return json.dumps(
            {
                "module": self.module,
                "version": self.version,
                "package": self.packages[binary],
                "go": go,
                "ldflags": self.ldflags,
                "tags": self.tags,
            },
            sort_keys=True,
        )


def staging_replaces(kubernetes: str) -> dict[str, str]:
    """Each k8s.io/* module that k8s.io/kubernetes replaces with ./staging, pinned to its v0.X.Y release."""
    info = json.loads(run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{kubernetes}"]))
    staging = "v0." + kubernetes.removeprefix("v").split(".", 1)[1]
    replaces = {}
    for line in Path(info["GoMod"]).read_text().splitlines():
        parts = line.replace("replace", "").split()
        if len(parts) == 3 and parts[1] == "=>" and parts[2].startswith("./staging/"):
            replaces[parts[0]] = f"{parts[0]} {staging}"
    if not replaces:
        raise BuildError(f"k8s.io/kubernetes {kubernetes}: its go.mod replaces no ./staging module")
    return replaces


def components() -> list[Component]:
    """What is built, in order (smallest first, so a broken toolchain fails fast)."""
    pinned = versions()
    kubernetes = str(pinned["kubernetes"]["version"])
    major, minor = kubernetes.removeprefix("v").split(".")[:2]
    kube_ldflags = " ".join(
        f"-X {package}.{key}={value}"
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for key, value in (
            ("gitVersion", kubernetes),
            ("gitMajor", major),
            ("gitMinor", minor),
            ("gitTreeState", "clean"),
        )
    )
    containerd = str(pinned["containerd"]["version"])
    containerd_module = "github.com/containerd/containerd/v2"
    return [
        Component(
            "etcd",
            "go.etcd.io/etcd/server/v3",
            str(pinned["etcd"]["version"]),
            {"etcd": "."},
            "-s -w",
            sources={"main.go": ETCD_MAIN},
        ),
        Component(
            "containerd",
            containerd_module,
            containerd,
            {c: f"{containerd_module}/cmd/{c}" for c in CONTAINERD_COMMANDS},
            f"-s -w -X {containerd_module}/version.Version={containerd}"
            f" -X {containerd_module}/version.Package=github.com/containerd/containerd/v2",
            tags=CONTAINERD_TAGS,
        ),
        Component(
            "pause",
            None,
            "local",
            {"pause": "."},
            "-s -w",
            sources={"main.go": (HERE / "pause" / "main.go").read_text()},
        ),
        Component(
            "kubernetes",
            "k8s.io/kubernetes",
            kubernetes,
            {c: f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS},
            f"-s -w {kube_ldflags}",
        ),
    ]


def prepare_module(component: Component, src: Path, go: str) -> None:
    """Write the wrapper module and resolve it (go mod tidy) when what it requires changed."""
    directory = src / component.name
    directory.mkdir(parents=True, exist_ok=True)
    if component.name == "kubernetes" and component.replaces is None:
        component.replaces = staging_replaces(component.version)
    wanted = component.go_mod(go.removeprefix("go").rsplit(".", 1)[0] + ".0")
    files = {"go.mod.in": wanted, **component.source_files()}
    key = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    tidy_stamp = directory / ".tidy-stamp"
    if tidy_stamp.exists() and tidy_stamp.read_text() == key:
        return
    with Step(f"{component.name} {component.version}: resolve the wrapper module (go mod tidy)"):
        for name, text in component.source_files().items():
            (directory / name).write_text(text)
        (directory / "go.mod").write_text(wanted)
        (directory / "go.sum").unlink(missing_ok=True)
        run(["go", "mod", "tidy"], cwd=directory)  # tidy reads every file, whatever its build tags
        tidy_stamp.write_text(key)


def build_component(component: Component, root: Path, go: str) -> None:
    """Build the component's stale binaries in one go build (they share most packages)."""
    out = root / "bin"
    out.mkdir(parents=True, exist_ok=True)
    stale = [
        binary
        for binary in component.packages
        if not (out / binary).exists()
        or not (out / f".{binary}.stamp").exists()
        or (out / f".{binary}.stamp").read_text() != component.stamp(binary, go)
    ]
    if not stale:
        print(f"[build] {component.name} {component.version}: {', '.join(component.packages)} up to date")
        return
    prepare_module(component, root / "src", go)
    partial = out / ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    with Step(f"{component.name} {component.version}: go build {' '.join(stale)}"):
        argv = ["go", "build", "-o", f"{partial}/", "-ldflags", component.ldflags]
        if component.tags:
            argv += ["-tags", component.tags]
        # Static, like upstream's release binaries: the shim and pause run in other mount namespaces.
        env = {**os.environ, "CGO_ENABLED": "0"} if component.name in ("containerd", "pause") else None
        run([*argv, *(component.packages[b] for b in stale)], cwd=root / "src" / component.name, env=env)
        for binary in stale:  # each named after its package's last element (etcd: the wrapper's)
            (partial / binary).replace(out / binary)
            (out / f".{binary}.stamp").write_text(component.stamp(binary, go))
    shutil.rmtree(partial, ignore_errors=True)


def write_pause_image(root: Path) -> None:
    """A one-layer image holding the pause binary, written as `docker save` would (for ctr import)."""
    binary = root / "bin" / "pause"
    archive = pause_archive(root)
    stamp = hashlib.sha256(binary.read_bytes()).hexdigest()
    stamp_file = archive.parent / ".pause.stamp"
    if archive.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        return
    with Step(f"pause image {PAUSE_IMAGE}"):
        layer = io.BytesIO()
        with tarfile.open(fileobj=layer, mode="w") as tar:
            info = tar.gettarinfo(str(binary), arcname="pause")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with binary.open("rb") as handle:
                tar.addfile(info, handle)
        layer_bytes = layer.getvalue()
        diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Entrypoint": ["/pause"]},
                "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            }
        ).encode()
        config_name = hashlib.sha256(config).hexdigest() + ".json"
        manifest = json.dumps([{"Config": config_name, "RepoTags": [PAUSE_IMAGE], "Layers": ["layer.tar"]}])
        archive.parent.mkdir(parents=True, exist_ok=True)
        partial = archive.with_suffix(".partial")
        with tarfile.open(partial, mode="w") as tar:
            members = {config_name: config, "layer.tar": layer_bytes, "manifest.json": manifest.encode()}
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        partial.replace(archive)
        stamp_file.write_text(stamp)


def install_debian_packages() -> None:
    """apt-get install what is missing (root only); refresh the package list once if that fails."""
    missing = missing_debian_packages()
    if not missing:
        print(f"[build] Debian packages: {' '.join(versions()['debian']['packages'])} installed")  # type: ignore[arg-type]
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BuildError(f"missing Debian packages {' '.join(missing)}: install them as root with apt-get")
    with Step(f"apt-get install {' '.join(missing)}"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
        try:
            run(install, env=env)
        except BuildError:  # an empty or old package list: refresh it once
            run(["apt-get", "update", "-q"], env=env)
            run(install, env=env)


def status(root: Path) -> list[str]:
    """What keeps the cluster from running here, one reason per missing piece."""
    problems = []
    if shutil.which("go") is None:
        problems.append("Go is not installed (the components are built from Go modules)")
    absent = [b for b in every_binary() if not (root / "bin" / b).exists()]
    if absent:
        problems.append(f"not built in {root / 'bin'}: {' '.join(absent)} (run tools/kubernetes/build.py)")
    packages = missing_debian_packages()
    if packages:
        problems.append(f"missing Debian packages: {' '.join(packages)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Build, or report (--status, --print-bin-dir); exit status 1 names what failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", help="the cache directory (default: %(default)s)", default=None)
    parser.add_argument("--status", action="store_true", help="report what is missing; build nothing")
    parser.add_argument("--print-bin-dir", action="store_true", help="print where the binaries are")
    parser.add_argument("--no-apt", action="store_true", help="do not install the Debian packages")
    parser.add_argument(
        "--if-possible",
        action="store_true",
        help="without Go, say so and exit 0; without root, build but leave the Debian packages alone"
        " (tox -e e2e-local: its suite then skips, naming what is missing)",
    )
    args = parser.parse_args(argv)
    try:
        root = cache_root(args.cache)
        versions()  # every key checked now, before anything is done
    except VersionsError as error:
        print(f"[build] {error}", file=sys.stderr)
        return 2
    if args.print_bin_dir:
        print(root / "bin")
        return 0
    if args.status:
        problems = status(root)
        print("\n".join(problems) or f"ready: {root / 'bin'}")
        return 1 if problems else 0
    if shutil.which("go") is None:
        print("[build] Go is not installed: the components are built from Go modules", file=sys.stderr)
        return 0 if args.if_possible else 1
    started = time.monotonic()
    try:
        if args.if_possible and os.geteuid() != 0:
            print("[build] not root: the Debian packages are not checked or installed", file=sys.stderr)
        elif not args.no_apt:
            install_debian_packages()
        go = go_version()
        print(f"[build] {go}, cache {root}", flush=True)
        for component in components():
            build_component(component, root, go)
        write_pause_image(root)
    except BuildError as error:
        print(f"[build] {error}", file=sys.stderr)
        return 1
    print(f"[build] all done in {time.monotonic() - started:.1f} s: {root / 'bin'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
