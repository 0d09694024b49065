"""Build kind and its node image offline, from Go modules and Debian, into a cache outside the checkout.

    python3 tools/kind/build.py                 # build what is missing or out of date, print each step
    python3 tools/kind/build.py --only kind     # only the kind command (also: tools, base, node)
    python3 tools/kind/build.py --status        # say what is built and what is missing; build nothing

Why: these machines reach the Go module proxy and Debian's archive and nothing else (docs/kind.md), so
kind's own images (kindest/base, kindest/node), which download containerd, runc, crictl and the CNI
plugins from GitHub and pull etcd, CoreDNS and the rest from registries, cannot be used here. This
makes their equivalents daemonless, with buildah, as tools/kubernetes/images.py makes the project's:

- ``kind``: the command, from the proxied module ``sigs.k8s.io/kind`` (versions.toml beside this file).
- tools: ``crictl`` (sigs.k8s.io/cri-tools), and ``kubeadm`` and ``kubectl`` from the same
  k8s.io/kubernetes wrapper module tools/kubernetes/build.py builds the other Kubernetes commands from
  (kind runs kubeadm in every node).
- ``base``: the stand-in for kindest/base. Debian (debootstrap, bookworm, minbase) with the packages
  kind's base Dockerfile installs (systemd, iptables, nftables, ...), Debian's runc and CNI plugins,
  containerd, its shim and ctr from tools/kubernetes/build.py's cache, crictl, and kind's entrypoint,
  systemd units and containerd configuration read from the kind module (images/base/files).
- ``node``: the stand-in for kindest/node, from the base: kubelet (that cache), kubeadm and kubectl in
  /usr/bin, /kind/version, the default CNI and storage manifests, and the images kubeadm and kind
  start, imported into the node's containerd beforehand (as ``kind build node-image`` does): the
  control plane's four images and etcd's from the binaries of that cache, CoreDNS and the local-path
  provisioner built from their modules, the sandbox (pause) image of that cache.

Each image is written as a docker-archive (``docker load`` / ``kind load image-archive``) under
${XDG_CACHE_HOME:-~/.cache}/plugvisor/kind/<kind version>/archives (override with --cache or
PLUGVISOR_KIND_CACHE); bin/ holds the commands, each with a stamp of what it was built from, so a second
run with nothing to do takes seconds. Run as root for the images (debootstrap and buildah's store).

Only the standard library: this runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
VERSIONS = HERE / "versions.toml"
KUBERNETES_TOOLS = HERE.parent / "kubernetes"
# Bump when the way an image is made changes: every cached image is then made again.
RECIPE_VERSION = "1"
STEPS = ("kind", "tools", "base", "node")
PINNED = ("kind", "cri-tools", "coredns", "local-path-provisioner")

# A Go module's release tag, as tools/kubernetes/build.py accepts it: never a path.
_TAG = re.compile(r"v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]{1,64})?")


class UsageError(ValueError):
    """Bad input (versions.toml or the command line); one line naming it and what was expected."""


def versions(path: Path = VERSIONS) -> dict[str, str]:
    """The pinned versions, checked: table name -> release tag.

    A version becomes a directory name (the cache) and a module query, so anything but a release tag
    (``../../tmp/x``) is refused before it is used.
    """
    try:
        document = tomllib.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    pinned = {}
    for table in PINNED:
        section = document.get(table)
        if not isinstance(section, dict):
            raise UsageError(f'{path}: [{table}]: missing table (expected version = "vX.Y.Z")')
        version = section.get("version")
        if not isinstance(version, str) or not _TAG.fullmatch(version):
            raise UsageError(
                f'{path}: {table}.version: expected a release tag such as "v1.2.3", got {version!r:.80}'
            )
        pinned[table] = version
    return pinned


def parse_steps(text: str) -> tuple[str, ...]:
    """``--only`` as a tuple of steps in build order: a comma-separated subset of STEPS."""
    wanted = [part.strip() for part in text.split(",")]
    wrong = [part for part in wanted if part not in STEPS]
    if not text.strip() or wrong:
        raise UsageError(
            f"--only {text!r}: expected one or more of {', '.join(STEPS)}, comma-separated"
            + (f" ({wrong[0]!r} is none of them)" if wrong and wrong[0] else "")
        )
    return tuple(step for step in STEPS if step in wanted)


def cache_root(kind_version: str, override: str | None = None) -> Path:
    """${PLUGVISOR_KIND_CACHE}, or ${XDG_CACHE_HOME:-~/.cache}/plugvisor/kind/<kind version>."""
    chosen = override or os.environ.get("PLUGVISOR_KIND_CACHE")
    if chosen:
        return Path(chosen).expanduser().resolve()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "plugvisor" / "kind" / kind_version


def _load(name: str, path: Path) -> ModuleType:
    """A sibling tool as a module (tools/ is not a package): its functions are reused, never changed."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path}: cannot load it (expected tools/kubernetes beside tools/kind)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


kbuild = _load("plugvisor_kubernetes_build", KUBERNETES_TOOLS / "build.py")
kimages = _load("plugvisor_kubernetes_images", KUBERNETES_TOOLS / "images.py")


# ---------------------------------------------------------------------------------------------------
# Names: the commands, the images, and where each lands.
# ---------------------------------------------------------------------------------------------------

HOST_BINARIES = ("kind",)
TOOL_BINARIES = ("crictl", "kubeadm", "kubectl")
# From tools/kubernetes/build.py's cache: what the node (or its images) is made of.
KUBERNETES_CACHE_BINARIES = (
    "kubelet",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-proxy",
    "etcd",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
)
CONTROL_PLANE = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy")
# What kind's base Dockerfile installs from apt (one package per purpose, see its comments), plus
# what it downloads from GitHub and Debian also packages: runc and the CNI plugins.
BASE_PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "conntrack", "iptables", "nftables", "iproute2", "ethtool",
    "util-linux", "mount", "kmod", "libseccomp2", "pigz", "fuse-overlayfs", "nfs-common", "open-iscsi",
    "e2fsprogs", "bash", "ca-certificates", "curl", "jq", "procps", "runc", "containernetworking-plugins",
)  # fmt: skip
# The plugins kind's base image builds (the rest of Debian's package stays in /usr/lib/cni).
CNI_PLUGINS = ("host-local", "loopback", "ptp", "portmap")
# What the Kubernetes components' images hold besides their binary: kube-proxy drives nft, iptables
# and conntrack (upstream's image is distroless-iptables); the binaries are linked against glibc.
RUNTIME_PACKAGES = ("iptables", "nftables", "conntrack", "ca-certificates")
KIND_ENTRYPOINT = ["/usr/local/bin/entrypoint", "/sbin/init"]


def image_names(kubernetes: str, etcd: str, pinned: dict[str, str]) -> dict[str, str]:
    """Each image of the node: its key -> the reference it is imported under.

    The control plane and CoreDNS keep the names kubeadm asks for (same version, same program);
    etcd's tag is the etcd actually built (tools/kubernetes/versions.toml), which kubeadm is told
    with ``etcd.local.imageTag`` (see :func:`kubeadm_patch`); the images kind names after its own
    builds (storage provisioner and helper, pause) are named for what they are, and the node's
    manifests and containerd configuration name them so.
    """
    names = {name: f"registry.k8s.io/{name}:{kubernetes}" for name in CONTROL_PLANE}
    names["etcd"] = f"registry.k8s.io/etcd:{etcd.removeprefix('v')}-0"
    names["coredns"] = f"registry.k8s.io/coredns/coredns:{pinned['coredns']}"
    names["local-path-provisioner"] = (
        f"plugvisor.local/local-path-provisioner:{pinned['local-path-provisioner']}"
    )
    names["local-path-helper"] = "plugvisor.local/local-path-helper:busybox"
    names["pause"] = kbuild.PAUSE_IMAGE
    return names


def kubeadm_patch(etcd: str) -> str:
    """The kubeadmConfigPatches entry a kind config needs for this node image on these machines.

    etcd's image tag (the built release, not kubeadm's default), and the kubelet's ``failCgroupV1:
    false`` (cgroup v1 hosts; Kubernetes 1.35 and later refuse cgroup v1 otherwise).
    """
    return (
        "kind: ClusterConfiguration\n"
        "etcd:\n"
        "  local:\n"
        f'    imageTag: "{etcd.removeprefix("v")}-0"\n'
        "---\n"
        "kind: KubeletConfiguration\n"
        "failCgroupV1: false\n"
    )


def base_ref(pinned: dict[str, str]) -> str:
    """The base image's reference: kind's version, as kindest/base is tagged per kind release."""
    return f"localhost/plugvisor/kind-base:{pinned['kind']}"


def node_ref(kubernetes: str) -> str:
    """The node image's reference, tagged with the Kubernetes release, as kindest/node is."""
    return f"localhost/plugvisor/kind-node:{kubernetes}"


def go_raw_string(source: str, name: str) -> str:
    """The value of ``const name = `...` + ident + `...``` in a Go file, identifiers resolved.

    kind keeps its default CNI and storage manifests as such constants (pkg/build/nodeimage); the
    node image carries them in /kind/manifests. Only string constants of the same file are resolved.
    """
    match = re.search(rf"^(?:const|var)\s+{re.escape(name)}\s*=\s*((?:`[^`]*`|\s*\+\s*|\w+)+)", source, re.M)
    if match is None:
        raise UsageError(f"Go source: no string constant {name}")
    parts = re.findall(r"`([^`]*)`|(\w+)", match.group(1))
    text = []
    for literal, ident in parts:
        if ident:
            value = re.search(rf'^\s*(?:const\s+)?{re.escape(ident)}\s*=\s*"([^"]*)"', source, re.M)
            if value is None:
                raise UsageError(f"Go source: {name} names {ident}, which is no string constant")
            text.append(value.group(1))
        else:
            text.append(literal)
    return "".join(text)


# ---------------------------------------------------------------------------------------------------
# Status: what is built, what is missing (no tracebacks, no builds).
# ---------------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """Where everything is, for one kind version and one Kubernetes cache."""

    root: Path
    kubernetes_bin: Path

    @property
    def bin(self) -> Path:
        """The commands this tool builds."""
        return self.root / "bin"

    @property
    def archives(self) -> Path:
        """The images' docker-archives and their records."""
        return self.root / "archives"


def status_lines(layout: Layout, pinned: dict[str, str], kubernetes: str) -> tuple[list[str], list[str]]:
    """(built, missing): one line per piece, the missing ones saying what makes them."""
    built, missing = [], []
    for name in (*HOST_BINARIES, *TOOL_BINARIES):
        path = layout.bin / name
        (built if path.exists() else missing).append(
            f"{name}: {path}"
            if path.exists()
            else f"{name}: not built (tools/kind/build.py --only "
            f"{'kind' if name in HOST_BINARIES else 'tools'})"
        )
    absent = [b for b in KUBERNETES_CACHE_BINARIES if not (layout.kubernetes_bin / b).exists()]
    if absent:
        missing.append(
            f"Kubernetes {kubernetes} cache: {' '.join(absent)} not in {layout.kubernetes_bin}"
            " (tools/kubernetes/build.py builds them)"
        )
    else:
        built.append(f"Kubernetes {kubernetes} cache: {layout.kubernetes_bin}")
    for label, ref in (("base image", base_ref(pinned)), ("node image", node_ref(kubernetes))):
        archive = layout.archives / kimages.archive_filename(kimages.normalize_ref(ref))
        if archive.exists():
            built.append(f"{label}: {archive} ({archive.stat().st_size / 1e6:.0f} MB)")
        else:
            step = "base" if label == "base image" else "node"
            missing.append(
                f"{label}: no {archive.name} in {layout.archives} (tools/kind/build.py --only {step})"
            )
    if shutil.which("go") is None:
        missing.append("Go is not installed (everything here is built from Go modules)")
    if shutil.which("buildah") is None:
        missing.append("buildah is not installed (the images are made with it; apt-get install buildah)")
    return built, missing


# ---------------------------------------------------------------------------------------------------
# Building.
# ---------------------------------------------------------------------------------------------------


def build_commands(layout: Layout, pinned: dict[str, str], steps: Sequence[str], go: str) -> None:
    """kind (for the host), crictl, kubeadm and kubectl (for the node): Go builds with stamps."""
    components = []
    if "kind" in steps:
        components.append(
            kbuild.Component(
                "kind", "sigs.k8s.io/kind", pinned["kind"], {"kind": "sigs.k8s.io/kind"}, "-s -w"
            )
        )
    if "tools" in steps:
        components.append(
            kbuild.Component(
                "cri-tools",
                "sigs.k8s.io/cri-tools",
                pinned["cri-tools"],
                {"crictl": "sigs.k8s.io/cri-tools/cmd/crictl"},
                f"-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version={pinned['cri-tools']}",
            )
        )
        kubernetes = kbuild.components()[-1]  # build.py's, so the flags (version stamps) are the same
        components.append(
            kbuild.Component(
                "kubernetes-tools",
                kubernetes.module,
                kubernetes.version,
                {c: f"k8s.io/kubernetes/cmd/{c}" for c in ("kubeadm", "kubectl")},
                kubernetes.ldflags,
                replaces=kbuild.staging_replaces(kubernetes.version),
            )
        )
    for component in components:
        kbuild.build_component(component, layout.root, go)


def build_images(
    layout: Layout, pinned: dict[str, str], kubernetes: str, etcd: str, steps: Sequence[str]
) -> None:
    """The base and node images (next commit)."""
    if "base" in steps or "node" in steps:
        raise UsageError("the base and node images are not made by this version of the tool yet")


def main(argv: list[str] | None = None) -> int:
    """Build, or report (--status); exit 2 on bad input, 1 when a step fails or something is missing."""
    parser = argparse.ArgumentParser(
        prog="tools/kind/build.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", default=None, help="the cache directory (default: per kind version)")
    parser.add_argument("--status", action="store_true", help="say what is built and what is missing")
    parser.add_argument(
        "--only", default=",".join(STEPS), help="comma-separated steps (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        pinned = versions()
        steps = parse_steps(args.only)
        kubernetes_pins = kbuild.versions()
    except (UsageError, kbuild.VersionsError) as error:
        print(f"tools/kind/build.py: {error}", file=sys.stderr)
        return 2
    kubernetes = str(kubernetes_pins["kubernetes"]["version"])
    etcd = str(kubernetes_pins["etcd"]["version"])
    layout = Layout(cache_root(pinned["kind"], args.cache), kbuild.bin_dir())
    if args.status:
        built, missing = status_lines(layout, pinned, kubernetes)
        for line in built:
            print(f"built: {line}")
        for line in missing:
            print(f"missing: {line}")
        if not missing:
            print(f"ready: kind create cluster --image {node_ref(kubernetes)} (with {layout.bin / 'kind'})")
        return 1 if missing else 0
    if shutil.which("go") is None:
        print(
            "tools/kind/build.py: Go is not installed (everything here is built from Go modules)",
            file=sys.stderr,
        )
        return 1
    started = time.monotonic()
    try:
        go = kbuild.go_version()
        print(f"[build] {go}, cache {layout.root}", flush=True)
        build_commands(layout, pinned, steps, go)
        build_images(layout, pinned, kubernetes, etcd, steps)
    except (kbuild.BuildError, kimages.BuildError, UsageError, OSError) as error:
        print(f"[build] failed: {error}", file=sys.stderr)
        return 1
    print(f"[build] all done in {time.monotonic() - started:.1f} s: {layout.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
