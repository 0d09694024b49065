"""Which Kubernetes API client the DRA driver process should use: measured, not guessed.

Run: python bench/bench_kubeclient.py [--rounds 5] [--python PYTHON] [--kubeconfig FILE]

Each candidate runs in a fresh interpreter (``--python``, default this one) that
imports what it needs, loads the configuration from ``KUBECONFIG`` as a driver
would, lists ResourceSlices (``resource.k8s.io/v1``) and reads one ResourceClaim,
then waits while this script measures it. Printed per candidate (medians over the
rounds; candidates alternate order between rounds, so a slow spell of the shared
machine hits them alike):

- import time, and the time from "imported" to "both answers decoded"
  (configuration, client, TLS handshake, two requests);
- memory of the whole process after the calls, as "node PSS" (bench/node_memory.py:
  what it would be alone on a node) and the kernel's PSS beside it;
- each beside the floor measured in the same run: the standard library alone
  (asyncio streams + ssl + json, and PyYAML for the kubeconfig, which plugvisor
  has anyway) doing the same two requests by hand;
- the distributions it installs beyond plugvisor's own dependencies, and their
  size on disk (the image grows by that much);
- what it offers: async, typed ``resource.k8s.io/v1`` models (ResourceSlice,
  ResourceClaim, DeviceClass, device taints), watch, in-cluster service account,
  ``KUBECONFIG``. Checked in the candidate's own interpreter where a check is cheap.

The API server is a small HTTPS fake in this process (a self-signed certificate
made with ``openssl``, a bearer token, canned ``resource.k8s.io/v1`` objects) unless
``--kubeconfig`` names a real one (which must serve ``resource.k8s.io/v1`` and
hold a ResourceClaim ``default/bench``). Candidates that are not installed in
``--python``'s environment are listed as such; the measurement that picked the
client (pyproject.toml, ``dra`` extra) installed them all into one scratch venv:
``pip install kubernetes kubernetes-asyncio lightkube kr8s httpx aiohttp``.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--probe":
    # The candidate's side: nothing above but json/os/sys/time, so the figures are the candidate's.
    _CANDIDATE = sys.argv[2]
    _started = time.perf_counter()

    def _result(imported: float, slices: int, claim: str) -> None:
        done = time.perf_counter()
        print(
            json.dumps(
                {
                    "import_ms": (imported - _started) * 1000,
                    "call_ms": (done - imported) * 1000,
                    "slices": slices,
                    "claim": claim,
                }
            ),
            flush=True,
        )
        sys.stdin.readline()  # the parent measures memory now, then closes our stdin

    _SLICES = "/apis/resource.k8s.io/v1/resourceslices"
    _CLAIM = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/bench"

    def _kubeconfig_parts() -> tuple[str, str, str]:
        import yaml  # imported before the clock stops (below): every candidate reads YAML

        with open(os.environ["KUBECONFIG"]) as handle:  # noqa: PTH123 - no pathlib: fewer imports
            conf = yaml.safe_load(handle)
        cluster = conf["clusters"][0]["cluster"]
        return cluster["server"], cluster["certificate-authority"], conf["users"][0]["user"]["token"]

    if _CANDIDATE == "stdlib":
        import asyncio
        import ssl

        import yaml

        _imported = time.perf_counter()

        async def _stdlib() -> tuple[int, str]:
            server, ca, token = _kubeconfig_parts()
            host, _, port = server.removeprefix("https://").rpartition(":")
            context = ssl.create_default_context(cafile=ca)
            reader, writer = await asyncio.open_connection(host, int(port), ssl=context)

            async def get(path: str) -> dict:
                request = (
                    f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
                    "Accept: application/json\r\n\r\n"
                )
                writer.write(request.encode())
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                return json.loads(await reader.readexactly(length))

            slices = await get(_SLICES)
            claim = await get(_CLAIM)
            writer.close()
            return len(slices["items"]), claim["metadata"]["uid"]

        _result(_imported, *asyncio.run(_stdlib()))
    elif _CANDIDATE == "httpx (thin)":
        import asyncio
        import ssl

        import httpx
        import yaml

        _imported = time.perf_counter()

        async def _httpx() -> tuple[int, str]:
            server, ca, token = _kubeconfig_parts()
            context = ssl.create_default_context(cafile=ca)
            headers = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(base_url=server, verify=context, headers=headers) as client:
                slices = (await client.get(_SLICES)).json()
                claim = (await client.get(_CLAIM)).json()
            return len(slices["items"]), claim["metadata"]["uid"]

        _result(_imported, *asyncio.run(_httpx()))
    elif _CANDIDATE == "aiohttp (thin)":
        import asyncio
        import ssl

        import aiohttp
        import yaml  # noqa: F401

        _imported = time.perf_counter()

        async def _aiohttp() -> tuple[int, str]:
            server, ca, token = _kubeconfig_parts()
            context = ssl.create_default_context(cafile=ca)
            headers = {"Authorization": f"Bearer {token}"}
            connector = aiohttp.TCPConnector(ssl=context)
            async with aiohttp.ClientSession(server, connector=connector, headers=headers) as session:
                async with session.get(_SLICES) as response:
                    slices = await response.json()
                async with session.get(_CLAIM) as response:
                    claim = await response.json()
            return len(slices["items"]), claim["metadata"]["uid"]

        _result(_imported, *asyncio.run(_aiohttp()))
    elif _CANDIDATE == "lightkube":
        import asyncio

        from lightkube import AsyncClient, KubeConfig
        from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

        _imported = time.perf_counter()

        async def _lightkube() -> tuple[int, str]:
            client = AsyncClient(KubeConfig.from_env())
            slices = [item async for item in client.list(ResourceSlice)]
            claim = await client.get(ResourceClaim, "bench", namespace="default")
            await client.close()
            assert claim.metadata is not None
            return len(slices), str(claim.metadata.uid)

        _result(_imported, *asyncio.run(_lightkube()))
    elif _CANDIDATE in ("kubernetes_asyncio", "kubernetes.aio"):  # the same generated API, two packages
        import asyncio

        if _CANDIDATE == "kubernetes_asyncio":
            from kubernetes_asyncio import client as k8s_client
            from kubernetes_asyncio import config as k8s_config
        else:
            from kubernetes.aio import client as k8s_client  # type: ignore[no-redef]
            from kubernetes.aio import config as k8s_config  # type: ignore[no-redef]

        _imported = time.perf_counter()

        async def _generated_async() -> tuple[int, str]:
            await k8s_config.load_kube_config()
            async with k8s_client.ApiClient() as api:
                resource = k8s_client.ResourceV1Api(api)
                slices = await resource.list_resource_slice()
                claim = await resource.read_namespaced_resource_claim("bench", "default")
            return len(slices.items), claim.metadata.uid

        _result(_imported, *asyncio.run(_generated_async()))
    elif _CANDIDATE == "kubernetes (sync)":
        from kubernetes import client as k8s_client
        from kubernetes import config as k8s_config

        _imported = time.perf_counter()
        k8s_config.load_kube_config()
        _resource = k8s_client.ResourceV1Api()
        _slices = _resource.list_resource_slice()
        _claim = _resource.read_namespaced_resource_claim("bench", "default")
        _result(_imported, len(_slices.items), _claim.metadata.uid)
    elif _CANDIDATE == "kr8s":
        import asyncio

        import kr8s.asyncio

        _imported = time.perf_counter()

        async def _kr8s() -> tuple[int, str]:
            api = await kr8s.asyncio.api(kubeconfig=os.environ["KUBECONFIG"])
            async with api.call_api(
                "GET", version="v1", base="/apis/resource.k8s.io", url="resourceslices"
            ) as r:
                slices = r.json()
            path = "resourceclaims/bench"
            async with api.call_api(
                "GET", version="v1", base="/apis/resource.k8s.io", namespace="default", url=path
            ) as r:
                claim = r.json()
            return len(slices["items"]), claim["metadata"]["uid"]

        _result(_imported, *asyncio.run(_kr8s()))
    else:
        raise SystemExit(f"unknown candidate {_CANDIDATE!r}")
    raise SystemExit(0)


import argparse
import http.server
import shutil
import ssl
import statistics
import subprocess
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from node_memory import kernel_pss_kb, node_pss

# name -> (distribution whose requirement closure is installed, import name checked for presence)
CANDIDATES = {
    "stdlib": (None, "ssl"),
    "httpx (thin)": ("httpx", "httpx"),
    "aiohttp (thin)": ("aiohttp", "aiohttp"),
    "lightkube": ("lightkube", "lightkube"),
    "kubernetes_asyncio": ("kubernetes_asyncio", "kubernetes_asyncio"),
    "kubernetes.aio": ("kubernetes", "kubernetes"),
    "kubernetes (sync)": ("kubernetes", "kubernetes"),
    "kr8s": ("kr8s", "kr8s"),
}
FLOOR = "stdlib"
TOKEN = "bench-token-0123456789"

# What each offers, checked in the candidate's interpreter (an expression over the imported module).
FACT_CHECKS = {
    "lightkube": {
        "async": "hasattr(__import__('lightkube'), 'AsyncClient')",
        "v1 typed": "all(hasattr(__import__('lightkube.resources.resource_v1', fromlist=['x']), n)"
        " for n in ('ResourceSlice', 'ResourceClaim', 'DeviceClass'))",
        "taints": "'taints' in __import__('lightkube.models.resource_v1', fromlist=['x'])"
        ".Device.__annotations__",
        "watch": "hasattr(__import__('lightkube').AsyncClient, 'watch')",
        "in-cluster": "hasattr(__import__('lightkube').KubeConfig, 'from_service_account')",
    },
    "kubernetes_asyncio": {
        "async": "True",
        "v1 typed": "all(hasattr(__import__('kubernetes_asyncio.client', fromlist=['x']), n)"
        " for n in ('ResourceV1Api', 'V1ResourceSlice', 'ResourceV1ResourceClaim', 'V1DeviceClass'))",
        "taints": "'taints' in __import__('kubernetes_asyncio.client', fromlist=['x'])"
        ".V1Device.openapi_types",
        "watch": "hasattr(__import__('kubernetes_asyncio.watch', fromlist=['x']), 'Watch')",
        "in-cluster": "hasattr(__import__('kubernetes_asyncio.config', fromlist=['x']),"
        " 'load_incluster_config')",
    },
    "kubernetes.aio": {
        "async": "True",
        "v1 typed": "all(hasattr(__import__('kubernetes.aio.client', fromlist=['x']), n)"
        " for n in ('ResourceV1Api', 'V1ResourceSlice', 'ResourceV1ResourceClaim', 'V1DeviceClass'))",
        "taints": "'taints' in __import__('kubernetes.aio.client', fromlist=['x']).V1Device.model_fields",
        "watch": "hasattr(__import__('kubernetes.aio.watch', fromlist=['x']), 'Watch')",
        "in-cluster": "hasattr(__import__('kubernetes.aio.config', fromlist=['x']), 'load_incluster_config')",
    },
    "kubernetes (sync)": {
        "async": "False",
        "v1 typed": "all(hasattr(__import__('kubernetes.client', fromlist=['x']), n)"
        " for n in ('ResourceV1Api', 'V1ResourceSlice', 'ResourceV1ResourceClaim', 'V1DeviceClass'))",
        "taints": "'taints' in __import__('kubernetes.client', fromlist=['x']).V1Device.model_fields",
        "watch": "hasattr(__import__('kubernetes.watch', fromlist=['x']), 'Watch')",
        "in-cluster": "hasattr(__import__('kubernetes.config', fromlist=['x']), 'load_incluster_config')",
    },
    "kr8s": {
        "async": "True",
        "v1 typed": "False",  # objects are generic dicts (python-box); kinds are found by discovery
        "taints": "False",
        "watch": "hasattr(__import__('kr8s.asyncio', fromlist=['x']).Api, 'watch')",
        "in-cluster": "True",  # kr8s._auth reads the service account when KUBERNETES_SERVICE_HOST is set
    },
}
# The thin clients and the floor are HTTP only: everything Kubernetes is ours to write.
for _thin in ("stdlib", "httpx (thin)", "aiohttp (thin)"):
    FACT_CHECKS[_thin] = {
        "async": "True",
        "v1 typed": "False",
        "taints": "False",
        "watch": "False",
        "in-cluster": "False",
    }

_DEVICE = {
    "attributes": {
        "model": {"string": "H100"},
        "uuid": {"string": "GPU-00000000-0000-0000-0000-000000000000"},
        "driverVersion": {"version": "550.54.15"},
        "numaNode": {"int": 0},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
    },
    "capacity": {"memory": {"value": "80Gi"}},
}
SLICE_LIST = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceSliceList",
    "metadata": {"resourceVersion": "100"},
    "items": [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "name": f"node-{n}-gpu.plugvisor.io-abcde",
                "uid": f"uid-{n}",
                "resourceVersion": "99",
            },
            "spec": {
                "driver": "gpu.plugvisor.io",
                "nodeName": f"node-{n}",
                "pool": {"name": f"node-{n}", "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": f"gpu-{i}", **_DEVICE} for i in range(8)],
            },
        }
        for n in range(4)
    ],
}
CLAIM = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "bench", "namespace": "default", "uid": "claim-uid", "resourceVersion": "101"},
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.plugvisor.io"}}]}},
    "status": {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": "gpu.plugvisor.io", "pool": "node-0", "device": "gpu-0"}
                ]
            }
        }
    },
}


class _FakeApiServer(http.server.ThreadingHTTPServer):
    daemon_threads = True


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(
                401,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "code": 401,
                    "message": "Unauthorized",
                },
            )
            return
        path = self.path.partition("?")[0]
        if path == "/apis/resource.k8s.io/v1/resourceslices":
            self._send(200, SLICE_LIST)
        elif path == "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/bench":
            self._send(200, CLAIM)
        elif path.rstrip("/") == "/version":  # kr8s asks on connecting
            self._send(200, {"major": "1", "minor": "37", "gitVersion": "v1.37.2"})
        else:
            print("fake API server: 404", path, file=sys.stderr)
            self._send(
                404,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "code": 404,
                    "message": "not found",
                },
            )

    def _send(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


def fake_api_server(workdir: Path) -> tuple[_FakeApiServer, Path]:
    """Start the HTTPS fake; returns it and a kubeconfig that reaches it."""
    cert, key = workdir / "server.crt", workdir / "server.key"
    subprocess.run(
        [
            *(
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
            ),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    server = _FakeApiServer(("127.0.0.1", 0), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = workdir / "kubeconfig"
    port = server.server_address[1]
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "bench",
                        "cluster": {
                            "server": f"https://127.0.0.1:{port}",
                            "certificate-authority": str(cert),
                        },
                    }
                ],
                "users": [{"name": "bench", "user": {"token": TOKEN}}],
                "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}],
                "current-context": "bench",
            }
        )
    )
    return server, kubeconfig


def installed(python: str, module: str) -> bool:
    """Whether ``module`` can be imported by ``python``."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", probe], check=False).returncode == 0


_FOOTPRINT = """
import json, sys
from importlib import metadata
from packaging.requirements import Requirement

def closure(names):
    seen = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        size = sum((f.size or 0) for f in (dist.files or ()))
        seen[key] = size
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen

have = closure(sys.argv[2:])
new = closure([sys.argv[1]])
extra = {k: v for k, v in new.items() if k not in have}
print(json.dumps({"count": len(extra), "bytes": sum(extra.values()), "names": sorted(extra)}))
"""

# plugvisor's own runtime dependencies (pyproject.toml): what a candidate adds comes on top of these.
PLUGVISOR_DEPS = [
    "grpcio",
    "protobuf",
    "pyyaml",
    "pydantic",
    "click",
    "structlog",
    "asyncinotify",
    "rich",
    "prometheus-client",
    "kubernetes-validate",
    "uvloop",
]


def footprint(python: str, dist: str | None) -> dict[str, object] | None:
    """Distributions (and bytes on disk) that ``dist`` installs beyond plugvisor's dependencies."""
    if dist is None:
        return {"count": 0, "bytes": 0, "names": []}
    out = subprocess.run(
        [python, "-c", _FOOTPRINT, dist, *PLUGVISOR_DEPS], check=False, capture_output=True, text=True
    )
    return json.loads(out.stdout) if out.returncode == 0 else None


def facts(python: str, candidate: str) -> dict[str, bool]:
    """The candidate's offer, evaluated in its own interpreter."""
    checks = FACT_CHECKS[candidate]
    program = (
        "import json\nprint(json.dumps({" + ", ".join(f"{k!r}: bool({v})" for k, v in checks.items()) + "}))"
    )
    out = subprocess.run([python, "-c", program], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        return dict.fromkeys(checks, False)
    return json.loads(out.stdout)


def measure(python: str, candidate: str, kubeconfig: Path) -> dict[str, float] | str:
    """One fresh process of ``candidate``: its timings and memory, or why it failed."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)  # never the in-cluster configuration of wherever this runs
    proc = subprocess.Popen(
        [python, str(Path(__file__).resolve()), "--probe", candidate],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=60)
        return proc.stderr.read().strip().splitlines()[-1] if proc.returncode else "no answer"
    figures: dict[str, float] = json.loads(line)
    alone = node_pss([proc.pid])
    figures["node_pss_mb"] = alone[proc.pid] / 1024 if alone else float("nan")
    figures["kernel_pss_mb"] = kernel_pss_kb(proc.pid) / 1024
    proc.stdin.close()
    proc.wait(timeout=60)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--python", default=sys.executable, help="the interpreter whose packages are measured"
    )
    parser.add_argument("--kubeconfig", type=Path, help="a real API server instead of the fake")
    args = parser.parse_args()
    if shutil.which("openssl") is None and args.kubeconfig is None:
        raise SystemExit("openssl is needed for the fake API server's certificate (or pass --kubeconfig)")

    present = [name for name, (_, module) in CANDIDATES.items() if installed(args.python, module)]
    missing = [name for name in CANDIDATES if name not in present]
    with tempfile.TemporaryDirectory(prefix="pv-kubeclient-") as tmp:
        server = None
        kubeconfig = args.kubeconfig
        if kubeconfig is None:
            server, kubeconfig = fake_api_server(Path(tmp))
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in present}
        errors: dict[str, str] = {}
        for round_ in range(args.rounds):
            order = present[round_ % len(present) :] + present[: round_ % len(present)]
            for name in order:
                result = measure(args.python, name, kubeconfig)
                if isinstance(result, str):
                    errors[name] = result
                else:
                    samples[name].append(result)
        if server is not None:
            server.shutdown()

    def median(name: str, key: str) -> float:
        return statistics.median(sample[key] for sample in samples[name])

    print(f"{args.rounds} rounds, python {args.python}, load average {os.getloadavg()[0]:.1f}")
    header = (
        "| candidate | import ms | x floor | config + 2 calls ms | x floor | node PSS MB | + floor MB "
        "| kernel PSS MB | adds (dists, MB on disk) | async | v1 typed | taints | watch | in-cluster |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    floor_ok = bool(samples.get(FLOOR))
    for name in present:
        if not samples[name]:
            print(f"| {name} | failed: {errors.get(name, '?')} |")
            continue
        imp, call, pss = median(name, "import_ms"), median(name, "call_ms"), median(name, "node_pss_mb")
        ratio_imp = f"{imp / median(FLOOR, 'import_ms'):.1f}x" if floor_ok else "-"
        ratio_call = f"{call / median(FLOOR, 'call_ms'):.1f}x" if floor_ok else "-"
        plus = f"{pss - median(FLOOR, 'node_pss_mb'):+.1f}" if floor_ok else "-"
        foot = footprint(args.python, CANDIDATES[name][0])
        adds = "?" if foot is None else f"{foot['count']}, {int(foot['bytes']) / 2**20:.1f}"  # type: ignore[call-overload]
        offer = facts(args.python, name)
        flags = " | ".join(
            "yes" if offer[key] else "no" for key in ("async", "v1 typed", "taints", "watch", "in-cluster")
        )
        print(
            f"| {name} | {imp:.0f} | {ratio_imp} | {call:.0f} | {ratio_call} | {pss:.1f} | {plus} "
            f"| {median(name, 'kernel_pss_mb'):.1f} | {adds} | {flags} |"
        )
    for name in missing:
        print(f"| {name} | not installed in {args.python} |")
    for name, error in errors.items():
        print(f"{name}: {error}")


if __name__ == "__main__":
    main()
