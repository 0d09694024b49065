"""A real kube-apiserver with its etcd, on loopback, for the DRA API-server side's integration tests.

The binaries are the ones tools/kubernetes builds (``~/.cache/plugvisor/kubernetes/<version>/bin``,
or the directory in ``PLUGVISOR_K8S_BIN``); without them, or without openssl for the serving
certificate, every test here is skipped saying so. The server is as small as it can be: etcd
without fsync, one API server bound to 127.0.0.1 on free ports, a CA and serving certificate made
for the run, static tokens for an administrator and for the driver (a plain user that the tests
bind to the deployment's ClusterRole), RBAC on. Everything lives in one temporary directory,
removed with the processes at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User

from plugvisor.dra.kube.config import ApiConfig, api_client

START_TIMEOUT = 180.0  # seconds: a loaded 2-core machine needs tens of seconds for the API server
ADMIN_TOKEN = "admin-token-for-tests-only"
DRIVER_TOKEN = "driver-token-for-tests-only"
DRIVER_USER = "plugvisor-dra-driver"
NOBODY_TOKEN = "nobody-token-for-tests-only"


def binaries() -> Path | None:
    """The directory holding etcd and kube-apiserver, or None."""
    explicit = os.environ.get("PLUGVISOR_K8S_BIN")
    candidates = [Path(explicit)] if explicit else []
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plugvisor" / "kubernetes"
    candidates += sorted(cache.glob("*/bin"), reverse=True)
    for directory in candidates:
        if (directory / "etcd").is_file() and (directory / "kube-apiserver").is_file():
            return directory
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> None:
    """A CA, a serving certificate for 127.0.0.1 signed by it, and the service-account key pair."""
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=plugvisor-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=directory,
    )
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=kube-apiserver",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        cwd=directory,
    )
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.cnf",
        "-out",
        "server.crt",
        cwd=directory,
    )
    openssl("genrsa", "-out", "sa.key", "2048", cwd=directory)
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)


@dataclass(frozen=True)
class ApiServer:
    """A running API server: where it is and how to reach it as the administrator or the driver."""

    url: str
    ca: Path
    workdir: Path

    def config(self, token: str) -> ApiConfig:
        cluster = Cluster(server=self.url, certificate_auth=str(self.ca))
        return ApiConfig(
            KubeConfig.from_one(cluster=cluster, user=User(token=token)), f"test api server {self.url}"
        )

    def kubeconfig(self, token: str, path: Path) -> Path:
        """A kubeconfig file for ``token`` (what KUBECONFIG would name)."""
        cluster = {"server": self.url, "certificate-authority": str(self.ca)}
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "t",
            "clusters": [{"name": "t", "cluster": cluster}],
            "users": [{"name": "t", "user": {"token": token}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
        }
        path.write_text(yaml.safe_dump(document))
        return path


def _ready(url: str, ca: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca))
    request = urllib.request.Request(f"{url}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=5) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def _tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@contextlib.contextmanager
def running_api_server(*, feature_gates: str = "") -> Iterator[ApiServer]:
    """etcd and kube-apiserver in a temporary directory, stopped and removed on exit (or skipped)."""
    bin_dir = binaries()
    if bin_dir is None:
        pytest.skip(
            "no kube-apiserver and etcd binaries: run `python3 tools/kubernetes/build.py` "
            "(they go to ~/.cache/plugvisor/kubernetes/<version>/bin) or set PLUGVISOR_K8S_BIN"
        )
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the API server's serving certificate")
    workdir = Path(tempfile.mkdtemp(prefix="pv-apiserver-"))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        make_certificates(workdir)
        (workdir / "tokens.csv").write_text(
            f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n{DRIVER_TOKEN},{DRIVER_USER},driver-uid\n'
            f"{NOBODY_TOKEN},nobody,nobody-uid\n"
        )
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        with (workdir / "etcd.log").open("wb") as log:
            processes.append(
                subprocess.Popen(
                    [
                        str(bin_dir / "etcd"),
                        "--name",
                        "test",
                        "--data-dir",
                        str(workdir / "etcd"),
                        "--listen-client-urls",
                        etcd_url,
                        "--advertise-client-urls",
                        etcd_url,
                        "--listen-peer-urls",
                        peer_url,
                        "--initial-advertise-peer-urls",
                        peer_url,
                        "--initial-cluster",
                        f"test={peer_url}",
                        "--unsafe-no-fsync",
                        "--log-level",
                        "warn",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        api_args = [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none",  # a loopback address cannot be a Service endpoint
            f"--secure-port={api_port}",
            f"--tls-cert-file={workdir / 'server.crt'}",
            f"--tls-private-key-file={workdir / 'server.key'}",
            f"--client-ca-file={workdir / 'ca.crt'}",
            f"--token-auth-file={workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-key-file={workdir / 'sa.pub'}",
            f"--service-account-signing-key-file={workdir / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.0.0.0/24",
            f"--cert-dir={workdir / 'certs'}",
            "--enable-priority-and-fairness=false",
        ]
        if feature_gates:
            api_args.append(f"--feature-gates={feature_gates}")
        with (workdir / "apiserver.log").open("wb") as log:
            processes.append(
                subprocess.Popen(api_args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        server = ApiServer(f"https://127.0.0.1:{api_port}", workdir / "ca.crt", workdir)
        deadline = time.monotonic() + START_TIMEOUT
        while not _ready(server.url, server.ca):
            for process in processes:
                if process.poll() is not None:
                    pytest.fail(
                        f"{Path(str(process.args[0])).name} exited with {process.returncode}:\n"  # type: ignore[index]
                        f"{_tail(workdir / 'etcd.log')}\n{_tail(workdir / 'apiserver.log')}"
                    )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the API server was not ready in {START_TIMEOUT} s:\n{_tail(workdir / 'apiserver.log')}"
                )
            time.sleep(0.5)
        yield server
    finally:
        for process in reversed(processes):
            _stop(process)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="package")
def apiserver() -> Iterator[ApiServer]:
    with running_api_server() as server:
        yield server


@pytest.fixture
async def admin(apiserver: ApiServer) -> AsyncIterator[AsyncClient]:
    client = api_client(apiserver.config(ADMIN_TOKEN))
    yield client
    await client.close()
