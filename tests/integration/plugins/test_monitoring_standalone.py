"""`plugvisor plugin --metrics-listen` serves the agent's per-device families by itself, owners included."""

import asyncio
import socket
import sys
import time
import urllib.request
from pathlib import Path

from plugvisor.deviceplugin.metrics_http import MAX_CONNECTIONS

GPU = "plugvisor.io/gpu"


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()
    except OSError:
        return ""


async def test_a_standalone_plugin_serves_device_metrics_with_owners(make_lab, kubelet, base):
    node = make_lab("amd-like")
    port = free_port()
    log = (base / "plugin.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plugvisor", "plugin", "gpu", "--host-root", str(node.root),
        "--kubelet-dir", str(kubelet.socket_dir), "--metrics-listen", f"127.0.0.1:{port}",
        "--pod-resources-interval", "0.2", "--telemetry-interval", "0.2", stderr=log,
    )  # fmt: skip
    try:
        pod = None
        deadline = time.monotonic() + 30
        while True:
            text = await asyncio.to_thread(scrape, port)
            view = kubelet.resource(GPU)
            # Scanned is not yet registered: a pod sent before the kubelet has the devices is refused.
            registered = view is not None and view.allocatable == 8
            if pod is None and text.count("plugvisor_device_healthy{") == 8 and registered:
                pod = await kubelet.add_pod(
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": "solo", "namespace": "lab"},
                        "spec": {
                            "containers": [{"name": "c", "image": "x", "resources": {"limits": {GPU: "1"}}}]
                        },
                    }
                )
            if pod is not None and 'plugvisor_device_allocated{container="c"' in text:
                break
            assert time.monotonic() < deadline, (
                f"no owner in the standalone plugin's metrics:\n{text[-2000:]}"
            )
            await asyncio.sleep(0.1)
        (device,) = pod.container("c").devices[GPU]
        assert f'device="{device}",namespace="lab"' in text
        assert "plugvisor_device_temperature_celsius{" in text
        assert "plugvisor_pod_resources_up 1.0" in text
        assert "plugvisor_plugin_registrations_total" in text  # the process's own metrics beside them
    finally:
        process.terminate()
        await process.wait()
        log.close()


def threads_of(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


async def test_many_idle_connections_cost_a_bounded_number_of_threads_and_a_scrape_still_answers(
    kubelet, base
):
    """prometheus-client's server held one thread per connection for as long as the client kept it open.

    300 connections that never send a request: the process keeps at most MAX_CONNECTIONS of them
    (the one silent the longest gives way to a new one), each dropped after IDLE_TIMEOUT of silence,
    and a scrape made after all of them were accepted is answered.
    """
    (base / "dev").mkdir()
    (base / "dev" / "null0").touch()
    port = free_port()
    log_path = base / "plugin.log"
    log = log_path.open("wb")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plugvisor", "plugin", "generic", "--resource", "example.com/null",
        "--path", "/dev/null0", "--host-root", str(base), "--kubelet-dir", str(kubelet.socket_dir),
        "--metrics-listen", f"127.0.0.1:{port}", stderr=log,
    )  # fmt: skip
    idle: list[socket.socket] = []
    try:
        await kubelet.wait_for(lambda k: k.resource("example.com/null") is not None, timeout=30)
        assert "plugvisor_" in await asyncio.to_thread(scrape, port), log_path.read_text()
        before = threads_of(process.pid)  # registered and scraped once: every thread it keeps is there
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", port)))
        # Connections are accepted one after the other: once this scrape is answered, all 300 were handled.
        assert "plugvisor_" in await asyncio.to_thread(scrape, port)
        assert threads_of(process.pid) <= before + MAX_CONNECTIONS
        # Each idle one is dropped after its silence: the threads go back to what they were.
        deadline = time.monotonic() + 60
        while threads_of(process.pid) > before:
            assert time.monotonic() < deadline, f"{threads_of(process.pid)} threads, {before} before"
            await asyncio.sleep(0.2)
    finally:
        for connection in idle:
            connection.close()
        process.terminate()
        await process.wait()
        log.close()
    assert "Traceback" not in log_path.read_text()
