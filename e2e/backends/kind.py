"""A kind cluster (kind-config.yaml): the image built with docker and loaded into the nodes.

Two routes to the same cluster. The user's, on any machine with a registry: kind and kubectl from PATH, the
engine that answers, ``kind create cluster --config kind-config.yaml``, ``docker build`` and ``kind load
docker-image``. The offline one (e2e/kind), where tools/kind/build.py made the node image on this machine
because no registry answers: kind and kubectl from its cache, the node image ``docker load``-ed and passed
with ``--image``, the config given the patches that image needs, the images from
tools/kubernetes/images.py's archives, and dockerd started and stopped by the run (under the machine's
lock, the host checked afterwards) when none answers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from ..deployment import REPO
from ..kind import offline
from ..kind.engine import Engine, EngineError, docker_answers
from ..local import hostbin
from .api import ApiBackend
from .common import IMAGE, SHELL_POD_SCRIPT, Progress, run, wait_until

CLUSTER = "plugvisor-e2e"
KUBELET_ENV = "/etc/default/kubelet"
"""Where kubeadm's systemd drop-in for the kubelet (10-kubeadm.conf, in kind's node) reads KUBELET_EXTRA_ARGS
from: the file the drop-in leaves to the operator."""


def offline_route() -> bool:
    """Whether this machine takes the offline route: tools/kind/build.py made the node image here."""
    return offline.node_image() is not None


def kind_unavailable() -> str | None:
    """Why the kind backend cannot run here (every reason at once), or None."""
    missing = []
    if importlib.util.find_spec("kubernetes") is None:
        missing.append("the kubernetes Python client is not installed (the e2e extra; use tox -e e2e)")
    if offline_route():
        missing += offline.missing()
        if shutil.which("docker") is None:
            missing.append("no docker command (python3 tools/kind/dockerio.py install RECORD, as root)")
        elif not docker_answers(dict(os.environ)):
            if shutil.which("dockerd", path=os.pathsep.join(hostbin.SYSTEM_DIRS)) is None:
                missing.append(
                    "no Docker engine answers and dockerd is not installed (Debian's docker.io:"
                    " python3 tools/kind/dockerio.py install RECORD, as root; .ci/run does)"
                )
            elif os.geteuid() != 0:
                missing.append("no Docker engine answers, and starting dockerd needs root")
        return "; ".join(missing) or None
    missing += [f"{tool} is not installed" for tool in ("docker", "kubectl") if shutil.which(tool) is None]
    if shutil.which("kind") is None:
        missing.append("kind is not installed (or build it: python3 tools/kind/build.py --only kind)")
    if shutil.which("docker") is not None and not docker_answers(dict(os.environ)):
        missing.append("docker is installed but no Docker engine answers (docker info failed)")
    return "; ".join(missing) or None


class KindBackend(ApiBackend):
    """The cluster of kind-config.yaml with the lab overlay applied; checks through the API server."""

    name = "kind"

    def __init__(self, progress: Progress, *, keep: bool, reuse: bool) -> None:
        super().__init__(progress)
        self.keep = keep
        self.reuse = reuse
        self.created = False
        self.offline = offline_route()
        self.engine = Engine(progress)
        self.work = Path(tempfile.mkdtemp(prefix="pvkind-"))
        self.kubeconfig = self.work / "kubeconfig"
        self.kind = str(offline.cache_bin("kind")) if self.offline else "kind"
        self.kubectl_command = str(offline.cache_bin("kubectl")) if self.offline else "kubectl"
        self._node_roots: dict[str, Path] = {}

    def kubectl(self, *args: str, timeout: float = 300) -> str:
        where = ["--kubeconfig", str(self.kubeconfig)] if self.offline else ["--context", f"kind-{CLUSTER}"]
        return run([self.kubectl_command, *where, *args], timeout=timeout)

    def _docker(self, *args: str, timeout: float = 300) -> str:
        return run(["docker", *args], timeout=timeout, env=self.engine.env)

    def _kind(self, *args: str, timeout: float = 300) -> str:
        return run([self.kind, *args], timeout=timeout, env=self.engine.env, cwd=REPO)

    def _timed(self, what: str, step: Callable[[], object]) -> None:
        started = time.monotonic()
        step()
        self.progress(f"{what} ({time.monotonic() - started:.1f} s)")

    def setup(self) -> None:
        if self.offline:
            self._setup_offline()
        else:
            self._setup_online()
        if self.offline:
            self._config.load_kube_config(config_file=str(self.kubeconfig))
        else:
            self._config.load_kube_config(context=f"kind-{CLUSTER}")
        self.core = self._client.CoreV1Api()
        for worker in self.workers:
            nodes = self.core.list_node(label_selector=f"plugvisor.io/lab-profile={worker.name}").items
            assert len(nodes) == 1, f"expected one node labelled plugvisor.io/lab-profile={worker.name}"
            self.node_names[worker.name] = nodes[0].metadata.name
        self.apply_lab_overlay()
        self.progress("waiting for every DaemonSet")
        started = time.monotonic()
        self.wait_daemonsets()
        self.progress(f"every DaemonSet rolled out ({time.monotonic() - started:.1f} s)")

    def _setup_online(self) -> None:
        """The user's path: kind from PATH, kindest/node pulled, the image built with docker build."""
        existing = run(["kind", "get", "clusters"]).split()
        if CLUSTER in existing and self.reuse:
            self.progress(f"reusing kind cluster {CLUSTER}")
        else:
            if CLUSTER in existing:
                run(["kind", "delete", "cluster", "--name", CLUSTER], timeout=300)
            self.progress("kind create cluster (a control plane, two workers)")
            run(
                ["kind", "create", "cluster", "--config", "kind-config.yaml", "--wait", "180s"],
                timeout=900,
                cwd=REPO,  # kind resolves the relative extraMounts from where it runs
            )
            self.created = True
        self.progress(f"docker build -t {IMAGE} (the release Dockerfile) and kind load")
        run(["docker", "build", "-t", IMAGE, str(REPO)], timeout=1200)
        run(["kind", "load", "docker-image", IMAGE, "--name", CLUSTER], timeout=600)

    def _setup_offline(self) -> None:
        """This machine's route (e2e/kind/offline.py): every piece from the local caches."""
        found = offline.node_image()
        assert found is not None
        ref, archive = found
        if self.keep or self.reuse:
            self.progress(
                "--keep-cluster/--reuse-cluster are not honoured on the offline route: its dockerd goes"
            )
        self.engine.ensure()
        self._timed(
            f"docker load {archive.name}", lambda: self._docker("load", "-i", str(archive), timeout=900)
        )
        config = offline.write_config(self.work / "kind-config.yaml")
        if CLUSTER in self._kind("get", "clusters").split():
            self._kind("delete", "cluster", "--name", CLUSTER)
        self.progress(f"kind create cluster --image {ref} (kind-config.yaml + build.py --kubeadm-patch)")
        self.created = True
        self._timed(
            "kind create cluster",
            lambda: self._kind(
                "create", "cluster", "--config", str(config), "--image", ref, "--name", CLUSTER,
                "--kubeconfig", str(self.kubeconfig), "--wait", "180s", timeout=900,
            ),
        )  # fmt: skip
        started = time.monotonic()
        images = offline.project_images()
        self.progress(f"images from tools/kubernetes/images.py ({time.monotonic() - started:.1f} s)")
        # The workers only: every pod of the suite runs there, and the control plane's import is a third
        # of the time on a machine with two cores.
        nodes = ",".join(
            n
            for n in self._kind("get", "nodes", "--name", CLUSTER).split()
            if not n.endswith("-control-plane")
        )
        for image in images.values():
            # A link of its own: another checkout's images.py may replace the cache's archive meanwhile.
            archive = offline.pin(Path(image["archive"]), self.work)
            self._timed(
                f"kind load image-archive {archive.name} --nodes {nodes}",
                lambda a=archive: self._kind(
                    "load", "image-archive", str(a), "--name", CLUSTER, "--nodes", nodes, timeout=900
                ),
            )
        self.pod_image = next(i["name"] for ref, i in images.items() if ref != offline.PROJECT_IMAGE)
        self.pod_command = ("sh", "-c", SHELL_POD_SCRIPT)

    def teardown(self) -> None:
        try:
            if self.offline:
                self._teardown_offline()
            elif self.keep or not self.created:
                self.progress(
                    f"kept kind cluster {CLUSTER} (delete it with: kind delete cluster --name {CLUSTER})"
                )
            else:
                subprocess.run(
                    ["kind", "delete", "cluster", "--name", CLUSTER], capture_output=True, check=False
                )
        finally:
            shutil.rmtree(self.work, ignore_errors=True)

    def _teardown_offline(self) -> None:
        """The cluster deleted, then (if the run started it) dockerd stopped and the host checked."""
        started = time.monotonic()
        if self.created:
            subprocess.run(
                [self.kind, "delete", "cluster", "--name", CLUSTER, "--kubeconfig", str(self.kubeconfig)],
                capture_output=True, env=self.engine.env, check=False, timeout=300,
            )  # fmt: skip
            self.progress(f"kind delete cluster ({time.monotonic() - started:.1f} s)")
        if not self.engine.started:
            return
        subprocess.run(
            ["docker", "network", "prune", "-f"],
            capture_output=True,
            env=self.engine.env,
            check=False,
            timeout=120,
        )
        try:
            self.engine.stop()
        except EngineError as exc:
            raise AssertionError(str(exc)) from None
        self.progress(f"teardown done ({time.monotonic() - started:.1f} s)")

    def restart_kubelet(self, worker: str) -> None:
        self._docker("exec", self.node_names[worker], "systemctl", "restart", "kubelet")

    # -- what only the node shows: a kind node is a container (its name is the node's) --------------------

    def node_unreachable(self) -> str | None:
        """A node's files and unix sockets are reached through its container's root, /proc/PID/root of
        the container's init: that takes root, and the Docker engine running on this machine's kernel
        (not in a VM, as Docker Desktop's is)."""
        if os.geteuid() != 0:
            return "reaching a kind node's files and sockets (/proc/PID/root of its container) takes root"
        worker = self.workers[0].name
        try:
            root = self._node_root(worker)
        except (subprocess.SubprocessError, ValueError) as exc:
            return f"docker inspect of node {self.node_names.get(worker)} failed: {exc}"
        if not (root / "var/lib/kubelet").is_dir():
            return (
                f"{root}/var/lib/kubelet is not there: the Docker engine does not run on this machine's"
                " kernel, so its containers' file systems cannot be reached from here"
            )
        return None

    def _node_root(self, worker: str) -> Path:
        """/proc/PID/root of the node container's init (kept: the container lives as long as the cluster)."""
        if worker not in self._node_roots:
            pid = int(self._docker("inspect", "-f", "{{.State.Pid}}", self.node_names[worker]).strip())
            if pid <= 0:
                raise ValueError(f"node container {self.node_names[worker]} is not running (PID {pid})")
            self._node_roots[worker] = Path(f"/proc/{pid}/root")
        return self._node_roots[worker]

    def node_path(self, worker: str, path: Path) -> Path:
        """``path`` under the node container's root, each symlink on the way followed as the node follows
        it: an absolute link (kind's ``/var/run -> /run``) points into the node, not into this machine."""
        root = self._node_root(worker)
        parts = list(path.relative_to("/").parts)
        current = PurePosixPath("/")
        followed = 0
        while parts:
            part = parts.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                current = current.parent
                continue
            here = root / (current / part).relative_to("/")
            if not here.is_symlink():
                current = current / part
                continue
            followed += 1
            if followed > 40:
                raise OSError(f"too many symbolic links under {root} resolving {path}")
            target = PurePosixPath(here.readlink())
            parts = [*(target if target.is_absolute() else current / target).relative_to("/").parts, *parts]
            current = PurePosixPath("/")
        return root / current.relative_to("/")

    def kubelet_verbosity(self, worker: str, level: int) -> None:
        """Run the node's kubelet at log verbosity ``level`` (its ``--v``) from now on, restarting it once if
        it ran otherwise, and wait until it answers its health check again.

        kind's kubelet logs at 0; the DRA scenarios read lines it logs at 1 and 2 (a plugin's registration,
        a container being stopped), as the local node's kubelet (``--v=2``) writes them. Set as an operator
        would, in the file kubeadm's drop-in reads KUBELET_EXTRA_ARGS from, beside what kind put there
        (``--runtime-cgroups``). Needs :meth:`node_path` (see :meth:`node_unreachable`).
        """
        node = self.node_names[worker]
        env_file = self.node_path(worker, Path(KUBELET_ENV))
        lines = env_file.read_text().splitlines() if env_file.exists() else []
        found = [i for i, line in enumerate(lines) if line.startswith("KUBELET_EXTRA_ARGS=")]
        old = lines[found[-1]].split("=", 1)[1].strip().strip("\"'").split() if found else []
        args = [*(a for a in old if not a.startswith("--v=")), f"--v={level}"]
        if args == old:
            return
        line = "KUBELET_EXTRA_ARGS=" + " ".join(args)
        if found:
            lines[found[-1]] = line
        else:
            lines.append(line)
        self.progress(f"{node}: the kubelet's log at verbosity {level} ({KUBELET_ENV}: {line}; restarted)")
        env_file.write_text("\n".join(lines) + "\n")
        self._docker("exec", node, "systemctl", "restart", "kubelet")
        wait_until(
            lambda: self._docker("exec", node, "curl", "-sf", "http://127.0.0.1:10248/healthz") == "ok",
            timeout=self.timeout,
            what=f"{node}: the kubelet healthy again after its restart",
            interval=1,
        )

    def kubelet_log(self, worker: str, since: float) -> str:
        """The kubelet unit's journal in the node (kind nodes run systemd), messages only: klog's lines."""
        return self._docker(
            "exec", self.node_names[worker], "journalctl", "-u", "kubelet", "-o", "cat", "--no-pager",
            "--since", f"@{int(since) - 1}", timeout=120,
        )  # fmt: skip

    def pod_http(self, namespace: str, pod: str, port: int, path: str) -> str:
        """Through the API server's pod proxy: the pod network lives inside the node containers, and this
        machine has no route to it."""
        answer = self.core.connect_get_namespaced_pod_proxy_with_path(
            f"{pod}:{port}", namespace, path.lstrip("/")
        )
        return str(answer)

    def diagnose(self) -> str:
        parts = [super().diagnose()]
        if self.engine.started:
            parts.append(f"--- dockerd's log, last lines\n{self.engine.log_tail(20)}")
        return "\n".join(parts)
