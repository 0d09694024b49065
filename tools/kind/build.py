"""Build kind and its node image offline, from Go modules and Debian, into a cache outside the checkout.

    python3 tools/kind/build.py                 # build what is missing or out of date, print each step
    python3 tools/kind/build.py --only kind     # only the kind command (also: tools, base, node)
    python3 tools/kind/build.py --status        # say what is built and what is missing; build nothing
    python3 tools/kind/build.py --kubeadm-patch # the kubeadmConfigPatches a kind config needs with it

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
  systemd units and containerd configuration read from the kind module (images/base/files); and a
  containerd drop-in that sets restrict_oom_score_adj where the node lacks CAP_SYS_RESOURCE (these
  machines: see RESTRICT_OOM_SCRIPT).
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
import tempfile
import time
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


def versions(path: Path | None = None) -> dict[str, str]:
    """The pinned versions, checked: table name -> release tag.

    A version becomes a directory name (the cache) and a module query, so anything but a release tag
    (``../../tmp/x``) is refused before it is used.
    """
    path = path or VERSIONS
    try:
        document = kbuild.read_toml(path)
    except kbuild.VersionsError as exc:
        raise UsageError(str(exc)) from None
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
    if wrong:
        detail = f"{wrong[0]!r:.40} is none of them" if wrong[0] else "an empty step"
        raise UsageError(
            f"--only {text!r:.80}: expected one or more of {', '.join(STEPS)}, comma-separated ({detail})"
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
RUNTIME_PACKAGES = ("iptables", "nftables", "conntrack", "iproute2", "ca-certificates")
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
    names["kindnet-standin"] = f"plugvisor.local/kindnet-standin:{kubernetes}"
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


def go_raw_string(source: str, name: str, values: dict[str, str] | None = None) -> str:
    """The value of ``const name = `...` + ident + `...``` in a Go file, identifiers resolved.

    kind keeps its default CNI and storage manifests as such constants (pkg/build/nodeimage); the
    node image carries them in /kind/manifests. Identifiers are resolved from ``values`` first, then
    from the file's own string constants.
    """
    match = re.search(rf"^(?:const|var)\s+{re.escape(name)}\s*=\s*((?:`[^`]*`|\s*\+\s*|\w+)+)", source, re.M)
    if match is None:
        raise UsageError(f"Go source: no string constant {name}")
    parts = re.findall(r"`([^`]*)`|(\w+)", match.group(1))
    text = []
    for literal, ident in parts:
        if ident and values and ident in values:
            text.append(values[ident])
        elif ident:
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
    if not kbuild.pause_archive(layout.kubernetes_bin.parent).exists():
        absent.append("images/pause.tar")
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
    """The commands, Go builds with stamps: kind (for the host), crictl, kubeadm and kubectl (the node)."""
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


# ---------------------------------------------------------------------------------------------------
# The images (buildah, daemonless, on a store of this cache's own).
# ---------------------------------------------------------------------------------------------------

# Added to the base, run by a containerd drop-in before containerd starts. Lowering a process's
# oom_score_adj needs CAP_SYS_RESOURCE, and the kubelet asks for -997 for the control plane's pods: in a
# node container without it (these machines' root lacks it, so capfit drops it: docs/kind.md) every
# sandbox fails ("runc create failed: unable to start container process: can't get final child's PID
# from pipe: EOF"). containerd's restrict_oom_score_adj (which kind's config leaves false, and rootless
# nodes set true) keeps pods at or above containerd's own score instead. With the capability, nothing
# changes.
RESTRICT_OOM_SCRIPT = """\
#!/bin/sh
# tools/kind/build.py (plugvisor): restrict_oom_score_adj when CAP_SYS_RESOURCE (bit 24) is not in
# this node's effective capabilities.
set -eu
mask=$(awk '/^CapEff:/ {print $2}' /proc/self/status)
if [ $(( 0x$mask >> 24 & 1 )) -eq 0 ]; then
  sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml
fi
"""

# kind's hook that mounts the product UUID files into every container (its base Dockerfile adds it).
PRODUCT_FILES_HOOK = '{"path": "/kind/bin/mount-product-files.sh"}'
# Run in the base image's working container (host network): what kind's base Dockerfile's RUN steps
# do, with Debian's runc and CNI plugins in place of the ones it downloads.
BASE_SCRIPT = f"""\
set -eu
export DEBIAN_FRONTEND=noninteractive
rm -f /etc/apt/sources.list
cat > /etc/apt/sources.list.d/debian.sources <<'EOF'
Types: deb
URIs: {kimages.MIRROR}
Suites: {kimages.SUITE} {kimages.SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: {kimages.SECURITY_MIRROR}
Suites: {kimages.SUITE}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
chmod 755 /kind /kind/bin
clean-install {" ".join(BASE_PACKAGES)}
find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete
rm -f /lib/systemd/system/multi-user.target.wants/*
rm -f /etc/systemd/system/*.wants/*
rm -f /lib/systemd/system/local-fs.target.wants/*
rm -f /lib/systemd/system/sockets.target.wants/*udev*
rm -f /lib/systemd/system/sockets.target.wants/*initctl*
rm -f /lib/systemd/system/basic.target.wants/*
echo "ReadKMsg=no" >> /etc/systemd/journald.conf
ln -sf /usr/lib/systemd/systemd /sbin/init
systemctl enable kubelet.service
systemctl enable containerd.service
systemctl enable undo-mount-hacks.service
systemctl mask systemd-binfmt.service
mkdir -p /etc/kubernetes/manifests /opt/cni/bin /etc/systemd/system/containerd.service.d
cat > /kind/bin/restrict-oom-score-adj.sh <<'SCRIPT'
{RESTRICT_OOM_SCRIPT}SCRIPT
chmod 755 /kind/bin/restrict-oom-score-adj.sh
cat > /etc/systemd/system/containerd.service.d/10-restrict-oom-score-adj.conf <<'UNIT'
[Service]
ExecStartPre=/kind/bin/restrict-oom-score-adj.sh
UNIT
for plugin in {" ".join(CNI_PLUGINS)}; do cp /usr/lib/cni/$plugin /opt/cni/bin/; done
ctr oci spec \\
    | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {PRODUCT_FILES_HOOK}' \\
    | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json
containerd --version
runc --version
crictl --version
"""
BASE_CONFIG = [
    "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "--env", "container=docker",
    "--stop-signal", "SIGRTMIN+3",
    "--entrypoint", json.dumps(KIND_ENTRYPOINT),
    "--cmd", "",
    "--label", "org.opencontainers.image.description=A stand-in for kindest/base made by tools/kind/build.py:"
    f" Debian {kimages.SUITE} with systemd, containerd, runc and kind's files",
]  # fmt: skip
# The Kubernetes components' common base: Debian minbase, what kube-proxy drives, nothing cached.
RUNTIME_SCRIPT = f"""\
set -eu
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends {" ".join(RUNTIME_PACKAGES)}
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/* /usr/share/doc/* /usr/share/man/* /usr/share/locale/* \\
    /var/log/* /tmp/* /var/tmp/*
"""
RUNTIME_REF = f"localhost/plugvisor/kind-runtime:{kimages.SUITE}"
# kindnetd's job, done without its image (the module proxy refuses kindnet): on every node, a ptp +
# host-local CNI configuration over the node's spec.podCIDR, and a route to every other node's pod
# CIDR through that node's address. A shell loop with kubectl on the components' base; kind applies
# the node's /kind/manifests/default-cni.yaml as it is (it carries neither of kind's template or
# patch markers), as it would kindnet's manifest. No masquerading: these clusters reach nothing
# outside, and traffic between nodes and pods is routed both ways. One pass is a shell function, so
# a test can run it once with kubectl and ip faked.
CNI_SYNC = r"""sync_once() {
  conf=${KINDNET_CONF:-/etc/cni/net.d/10-kindnet-standin.conflist}
  cidr=$(kubectl get node "$NODE_NAME" -o jsonpath='{.spec.podCIDR}' 2>/dev/null || true)
  if [ -n "$cidr" ]; then
    want=$(cat <<EOF
{"cniVersion": "0.4.0", "name": "kindnet-standin", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": 1500,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$cidr"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
)
    if [ "$(cat "$conf" 2>/dev/null)" != "$want" ]; then
      printf '%s\n' "$want" > "$conf.tmp" && mv "$conf.tmp" "$conf" && echo "wrote $conf for $cidr"
    fi
  fi
  nodes='{range .items[*]}{.metadata.name} {.spec.podCIDR} '
  nodes="$nodes"'{.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}'
  kubectl get nodes -o jsonpath="$nodes" 2>/dev/null | while read -r name podcidr address; do
    if [ "$name" != "$NODE_NAME" ] && [ -n "$podcidr" ] && [ -n "$address" ]; then
      ip route replace "$podcidr" via "$address"
    fi
  done
}
"""
CNI_SCRIPT = CNI_SYNC + "set -u\nwhile true; do sync_once; sleep 5; done\n"


def cni_manifest(image: str) -> str:
    """The node's /kind/manifests/default-cni.yaml: the kindnetd stand-in's RBAC and DaemonSet."""
    script = "".join(f"              {line}\n" if line else "\n" for line in CNI_SCRIPT.splitlines())
    return f"""\
# A stand-in for kindnetd written by plugvisor's tools/kind/build.py (kindnet's module is not served
# where the node image was made): per node, a ptp/host-local CNI configuration and routes to the
# other nodes' pod CIDRs.
kind: ClusterRole
apiVersion: rbac.authorization.k8s.io/v1
metadata:
  name: kindnet
rules:
  - apiGroups: [""]
    resources: [nodes]
    verbs: [get, list, watch]
---
kind: ClusterRoleBinding
apiVersion: rbac.authorization.k8s.io/v1
metadata:
  name: kindnet
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: kindnet
subjects:
  - kind: ServiceAccount
    name: kindnet
    namespace: kube-system
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: kindnet
  namespace: kube-system
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: kindnet
  namespace: kube-system
  labels:
    app: kindnet
    k8s-app: kindnet
spec:
  selector:
    matchLabels:
      app: kindnet
  template:
    metadata:
      labels:
        app: kindnet
        k8s-app: kindnet
    spec:
      hostNetwork: true
      nodeSelector:
        kubernetes.io/os: linux
      tolerations:
        - operator: Exists
      priorityClassName: system-node-critical
      serviceAccountName: kindnet
      containers:
        - name: kindnet-standin
          image: {image}
          imagePullPolicy: IfNotPresent
          command:
            - sh
            - -c
            - |
{script}          env:
            - name: NODE_NAME
              valueFrom:
                fieldRef:
                  fieldPath: spec.nodeName
          securityContext:
            privileged: true
          volumeMounts:
            - name: cni-cfg
              mountPath: /etc/cni/net.d
      volumes:
        - name: cni-cfg
          hostPath:
            path: /etc/cni/net.d
            type: DirectoryOrCreate
"""


# Images kind's own node image carries that cannot be made here: the module proxy refuses the module.
REFUSED = {
    "kindnetd": "sigs.k8s.io/kindnet (also github.com/kubernetes-sigs/kindnet, github.com/aojea/kindnet)"
}


def file_hash(path: Path) -> str:
    """sha256 of a file, for the images' keys (a new binary makes a new image)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def tree_hash(root: Path) -> str:
    """sha256 over a directory's files (relative names and contents), for kind's files in the base."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + file_hash(path).encode())
    return digest.hexdigest()


def copy_kind_files(files: Path, root: Path) -> None:
    """Copy kind's images/base/files into a root file system, with the modes its Dockerfile gives them.

    Scripts (usr/local/bin, kind/bin) 0755, everything else 0644, directories 0755, owned by root.
    """
    for path in sorted(files.rglob("*")):
        target = root / path.relative_to(files)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            target.chmod(0o755)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        relative = path.relative_to(files).as_posix()
        target.chmod(0o755 if relative.startswith(("usr/local/bin/", "kind/bin/")) else 0o644)
        os.chown(target, 0, 0)


def install_binary(source: Path, target: Path) -> None:
    """A binary into an image's root, 0755, owned by root."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    target.chmod(0o755)
    os.chown(target, 0, 0)


@dataclass
class NodeImages:
    """Makes the runtime, component, base and node images of one run, under the cache's lock."""

    layout: Layout
    pinned: dict[str, str]
    kubernetes: str
    etcd: str

    def __post_init__(self) -> None:
        self.runner = kimages.Runner(self.layout.root)
        self.buildah = kimages.Buildah(
            self.runner, self.layout.root / "storage", self.layout.root / "runroot"
        )
        self.images = kimages.Images(self.layout.root, self.buildah, self.runner)
        pin = f"sigs.k8s.io/kind@{self.pinned['kind']}"
        self.kind_module = Path(json.loads(kbuild.run(["go", "mod", "download", "-json", pin]))["Dir"])

    # -- the debootstrapped Debian both bases start from ------------------------------------------

    def debian_root(self) -> Path:
        """Debian minbase, debootstrapped once into the cache and kept (the bases copy it)."""
        rootfs = self.layout.root / "debootstrap" / kimages.SUITE
        stamp = rootfs.parent / f".{kimages.SUITE}.done"
        if stamp.exists():
            return rootfs
        shutil.rmtree(rootfs, ignore_errors=True)
        rootfs.parent.mkdir(parents=True, exist_ok=True)
        self.runner.use_log("debootstrap")
        with kimages.Step(f"debootstrap {kimages.SUITE} (minbase)"):
            self.runner.run(
                ["unshare", "--mount", "--propagation", "private", "debootstrap", "--variant=minbase",
                 kimages.SUITE, str(rootfs), kimages.MIRROR]
            )  # fmt: skip
        stamp.write_text(kimages.MIRROR + "\n")
        return rootfs

    def from_debian(
        self, name: str, script: str, ref: str, config: Sequence[str], files: dict[Path, Path]
    ) -> None:
        """An image from the debootstrapped root, committed as one layer named ``ref``.

        ``files`` (host path -> path in the image) are copied in first, then ``script`` runs inside
        with the host's network.
        """
        rootfs = self.debian_root()
        self.runner.use_log(name)
        with self.buildah.working_container(name) as container:
            with kimages.Step(f"{ref}: load Debian and the files"), self.buildah.mounted(container) as mount:
                self.runner.run(["sh", "-c", kimages.COPY_ROOTFS, "sh", str(rootfs), str(mount)])
                for source, target in files.items():
                    if source.is_dir():
                        copy_kind_files(source, mount / target.relative_to("/"))
                    else:
                        install_binary(source, mount / target.relative_to("/"))
            with kimages.Step(f"{ref}: apt-get and set up"):
                self.buildah("run", "--runtime", kimages.runtime(), "--network", "host", container, "--",
                             "sh", "-c", script)  # fmt: skip
            with kimages.Step(f"{ref}: commit (one layer)"):
                self.buildah("config", *config, container)
                self.buildah("commit", "--quiet", "--squash", "--rm", container, kimages.normalize_ref(ref))
        self.buildah("rmi", "--prune")

    # -- the images --------------------------------------------------------------------------------

    def base(self) -> Built:
        """The stand-in for kindest/base."""
        ref = base_ref(self.pinned)
        name = kimages.normalize_ref(ref)
        binaries = {
            **{
                self.layout.kubernetes_bin / b: Path("/usr/local/bin") / b for b in kbuild.CONTAINERD_COMMANDS
            },
            self.layout.bin / "crictl": Path("/usr/local/bin/crictl"),
        }
        files = self.kind_module / "images" / "base" / "files"
        recipe = [RECIPE_VERSION, BASE_SCRIPT, BASE_CONFIG, tree_hash(files)]
        recipe += [f"{target}={file_hash(source)}" for source, target in sorted(binaries.items())]
        key = hashlib.sha256(json.dumps(recipe, default=str).encode()).hexdigest()
        cached = self.images.cached(ref, name, key)
        if cached is not None:
            return cached
        config = [*BASE_CONFIG, "--label", f"{kimages.KEY_LABEL}={key}"]
        self.from_debian("plugvisor-kind-base", BASE_SCRIPT, ref, config, {files: Path("/"), **binaries})
        return self.images.write_archive(ref, name, key)

    def runtime_base(self) -> str:
        """The components' base image (Debian minbase, iptables, nftables, conntrack); its image ID."""
        key = hashlib.sha256(f"{RECIPE_VERSION}\0{RUNTIME_SCRIPT}".encode()).hexdigest()
        info = self.buildah.image_info(RUNTIME_REF)
        if info is not None and info[1].get(kimages.KEY_LABEL) == key:
            return str(info[0])
        config = ["--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                  "--label", f"{kimages.KEY_LABEL}={key}"]  # fmt: skip
        self.from_debian("plugvisor-kind-runtime", RUNTIME_SCRIPT, RUNTIME_REF, config, {})
        info = self.buildah.image_info(RUNTIME_REF)
        assert info is not None
        return str(info[0])

    def component(self, ref: str, binary: Path, target: str, entrypoint: list[str] | None) -> Built:
        """One program on the components' base: its binary at ``target``, the entrypoint given."""
        name = kimages.normalize_ref(ref)
        base_id = self.runtime_base()
        key = hashlib.sha256(
            json.dumps([RECIPE_VERSION, base_id, file_hash(binary), target, entrypoint]).encode()
        ).hexdigest()
        cached = self.images.cached(ref, name, key)
        if cached is not None:
            return cached
        self.runner.use_log(kimages.archive_filename(name).removesuffix(".tar"))
        container = self.buildah("from", "--pull=never", RUNTIME_REF, capture=True).strip()
        try:
            with kimages.Step(f"{ref}: {binary.name} on the components' base"):
                with self.buildah.mounted(container) as mount:
                    install_binary(binary, mount / target.lstrip("/"))
                config = ["--entrypoint", json.dumps(entrypoint)] if entrypoint else []
                self.buildah("config", *config, container)
                self.buildah("commit", "--quiet", "--rm", container, name)
        finally:
            subprocess.run([*self.buildah.global_args(), "rm", container], capture_output=True, check=False)
        self.buildah("rmi", "--prune")
        return self.images.write_archive(ref, name, key)

    def helper(self, ref: str) -> Built:
        """The storage provisioner's helper pods' image: a shell, rm and mkdir (Debian's busybox)."""
        name = kimages.normalize_ref(ref)
        applets = sorted(self.runner.run([str(kimages.BUSYBOX), "--list-full"], capture=True).split())
        key = hashlib.sha256(
            f"{RECIPE_VERSION}\0{file_hash(kimages.BUSYBOX)}\0{applets}".encode()
        ).hexdigest()
        cached = self.images.cached(ref, name, key)
        if cached is not None:
            return cached
        with (
            kimages.Step(f"{ref}: busybox-static"),
            self.buildah.working_container("plugvisor-kind-helper") as container,
        ):
            with self.buildah.mounted(container) as mount:
                kimages.fill_pod_root(mount, applets)
            self.buildah("commit", "--quiet", "--rm", container, name)
        return self.images.write_archive(ref, name, key)

    def go_images(self, go: str) -> dict[str, Path]:
        """CoreDNS and the local-path provisioner, built from their modules: name -> binary."""
        version = self.pinned["local-path-provisioner"]
        components = [
            kbuild.Component("coredns", "github.com/coredns/coredns", self.pinned["coredns"],
                             {"coredns": "github.com/coredns/coredns"}, "-s -w"),
            kbuild.Component("local-path-provisioner", "github.com/rancher/local-path-provisioner", version,
                             {"local-path-provisioner": "github.com/rancher/local-path-provisioner"},
                             f"-s -w -X main.VERSION={version}"),
        ]  # fmt: skip
        for component in components:
            kbuild.build_component(component, self.layout.root, go)
        return {c.name: self.layout.bin / c.name for c in components}

    def preload(self, archives: Sequence[Path], into: Path) -> None:
        """Import the archives into a containerd content store at ``into`` (/var/lib/containerd).

        As ``kind build node-image`` does in its build container, but with the cache's containerd run
        on the host, on a private socket and root, CRI off; images are not unpacked (containerd
        unpacks them when a container is first made from them).
        """
        work = Path(tempfile.mkdtemp(prefix="pvkind-", dir="/tmp"))  # a short socket path
        config = work / "config.toml"
        config.write_text(
            'version = 3\ndisabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images",'
            ' "io.containerd.cri.v1.runtime", "io.containerd.internal.v1.tracing"]\n'
        )
        socket = work / "c.sock"
        log = (self.layout.root / "logs" / "preload-containerd.log").open("w")
        daemon = subprocess.Popen(
            [str(self.layout.kubernetes_bin / "containerd"), "--config", str(config), "--root", str(into),
             "--state", str(work / "state"), "--address", str(socket)],
            stdout=log, stderr=log,
        )  # fmt: skip
        ctr = [str(self.layout.kubernetes_bin / "ctr"), "--address", str(socket), "--namespace", "k8s.io"]
        try:
            deadline = time.monotonic() + 30
            while not socket.exists():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise kimages.BuildError(f"containerd did not start; see {log.name}")
                time.sleep(0.2)
            self.runner.use_log("preload")
            with kimages.Step(f"import {len(archives)} images into the node's containerd"):
                for archive in archives:
                    self.runner.run([*ctr, "images", "import", "--no-unpack", "--local", str(archive)])
                listed = self.runner.run([*ctr, "images", "list", "--quiet"], capture=True)
                say(f"the node's containerd holds: {' '.join(listed.split())}")
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
            log.close()
            shutil.rmtree(work, ignore_errors=True)

    def node(self, base: Built, go: str) -> Built:
        """The stand-in for kindest/node, from the base."""
        ref = node_ref(self.kubernetes)
        name = kimages.normalize_ref(ref)
        binaries = {
            self.layout.kubernetes_bin / "kubelet": Path("/usr/bin/kubelet"),
            self.layout.bin / "kubeadm": Path("/usr/bin/kubeadm"),
            self.layout.bin / "kubectl": Path("/usr/bin/kubectl"),
        }
        names = image_names(self.kubernetes, self.etcd, self.pinned)
        built_go = self.go_images(go)
        parts = [
            *(self.component(names[c], self.layout.kubernetes_bin / c, f"/usr/local/bin/{c}", None)
              for c in CONTROL_PLANE),
            self.component(names["etcd"], self.layout.kubernetes_bin / "etcd", "/usr/local/bin/etcd", None),
            self.component(names["coredns"], built_go["coredns"], "/coredns", ["/coredns"]),
            self.component(names["local-path-provisioner"], built_go["local-path-provisioner"],
                           "/usr/local/bin/local-path-provisioner", None),
            self.helper(names["local-path-helper"]),
            self.component(names["kindnet-standin"], self.layout.bin / "kubectl",
                           "/usr/local/bin/kubectl", None),
        ]  # fmt: skip
        pause = kbuild.pause_archive(self.layout.kubernetes_bin.parent)
        archives = [p.archive for p in parts] + [pause]
        nodeimage = self.kind_module / "pkg" / "build" / "nodeimage"
        cni = cni_manifest(names["kindnet-standin"])
        storage = go_raw_string(
            (nodeimage / "const_storage.go").read_text(),
            "defaultStorageManifest",
            {"storageProvisionerImage": names["local-path-provisioner"],
             "storageHelperImage": names["local-path-helper"]},
        )  # fmt: skip
        recipe = [RECIPE_VERSION, base.image_id, self.kubernetes, cni, storage, names]
        recipe += [f"{target}={file_hash(source)}" for source, target in sorted(binaries.items())]
        recipe += [file_hash(archive) for archive in archives]
        key = hashlib.sha256(json.dumps(recipe, default=str).encode()).hexdigest()
        cached = self.images.cached(ref, name, key)
        if cached is not None:
            return cached
        self.runner.use_log("kind-node")
        container = self.buildah("from", "--pull=never", base.name, capture=True).strip()
        try:
            with self.buildah.mounted(container) as mount:
                with kimages.Step(f"{ref}: kubelet, kubeadm, kubectl, /kind"):
                    for source, target in binaries.items():
                        install_binary(source, mount / target.relative_to("/"))
                    (mount / "kind/version").write_text(self.kubernetes)
                    (mount / "kind/manifests").mkdir(parents=True, exist_ok=True)
                    (mount / "kind/manifests/default-cni.yaml").write_text(cni)
                    (mount / "kind/manifests/default-storage.yaml").write_text(storage)
                    containerd_config = mount / "etc/containerd/config.toml"
                    text = containerd_config.read_text()
                    text = re.sub(r'sandbox_image = "[^"]*"', f'sandbox_image = "{names["pause"]}"', text)
                    containerd_config.write_text(text)
                self.preload(archives, mount / "var/lib/containerd")
            with kimages.Step(f"{ref}: commit"):
                self.buildah("config", "--entrypoint", json.dumps(KIND_ENTRYPOINT), container)
                self.buildah("commit", "--quiet", "--squash", "--rm", container, name)
        finally:
            subprocess.run([*self.buildah.global_args(), "rm", container], capture_output=True, check=False)
        self.buildah("rmi", "--prune")
        return self.images.write_archive(ref, name, key)


Built = kimages.Built
say = kimages.say


def build_images(
    layout: Layout, pinned: dict[str, str], *, kubernetes: str, etcd: str, steps: Sequence[str], go: str
) -> None:
    """The base image, then the node image (which needs the base), under the cache's lock (root only)."""
    if "base" not in steps and "node" not in steps:
        return
    if os.geteuid() != 0:
        raise UsageError("the images need root (debootstrap and buildah's image store)")
    # The base needs containerd's commands and crictl; the node everything.
    needed = {
        "base": ["crictl", *kbuild.CONTAINERD_COMMANDS],
        "node": [*TOOL_BINARIES, *KUBERNETES_CACHE_BINARIES],
    }
    wanted = [b for step in steps for b in needed.get(step, [])]
    absent = [b for b in wanted if not (layout.bin / b).exists() and not (layout.kubernetes_bin / b).exists()]
    if absent:
        raise UsageError(
            f"not built yet: {' '.join(dict.fromkeys(absent))} (tools/kubernetes/build.py builds the"
            " Kubernetes cache, tools/kind/build.py --only tools the rest)"
        )
    with kimages.locked(layout.root):
        kimages.install_packages(kimages.Runner(layout.root), allowed=True)
        maker = NodeImages(layout, pinned, kubernetes, etcd)
        base = maker.base()
        say(f"{base.ref}: {base.archive} ({base.unpacked_bytes / 1e6:.0f} MB unpacked)")
        if "node" in steps:
            node = maker.node(base, go)
            say(f"{node.ref}: {node.archive} ({node.unpacked_bytes / 1e6:.0f} MB unpacked)")
            for image, module in REFUSED.items():
                say(f"not in the node: {image} (the module proxy refuses {module}); a stand-in does its job")


def main(argv: list[str] | None = None) -> int:
    """Build, or report (--status); exit 2 on bad input, 1 when a step fails or something is missing."""
    parser = argparse.ArgumentParser(
        prog="tools/kind/build.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", default=None, help="the cache directory (default: per kind version)")
    parser.add_argument("--status", action="store_true", help="say what is built and what is missing")
    parser.add_argument(
        "--kubeadm-patch",
        action="store_true",
        help="print the kubeadmConfigPatches entries a kind config needs with the node image",
    )
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
    if args.kubeadm_patch:
        print(kubeadm_patch(etcd), end="")
        return 0
    if args.status:
        built, missing = status_lines(layout, pinned, kubernetes)
        for line in built:
            print(f"built: {line}")
        for line in missing:
            print(f"missing: {line}")
        if not missing:
            print(f"ready: kind create cluster --image {node_ref(kubernetes)} (with {layout.bin / 'kind'})")
            print("  its config needs the kubeadmConfigPatches that --kubeadm-patch prints")
            for image, module in REFUSED.items():
                print(
                    f"  not in the node: {image} (the module proxy refuses {module});"
                    " a stand-in does its job (docs/kind.md)"
                )
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
        build_images(layout, pinned, kubernetes=kubernetes, etcd=etcd, steps=steps, go=go)
    except (kbuild.BuildError, kimages.BuildError, UsageError, OSError) as error:
        print(f"[build] failed: {error}", file=sys.stderr)
        return 1
    print(f"[build] all done in {time.monotonic() - started:.1f} s: {layout.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
