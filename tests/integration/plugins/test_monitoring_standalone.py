"""`plugvisor plugin --metrics-listen` serves the agent's per-device families by itself, owners included."""

import asyncio
import socket
import sys
import time
import urllib.request

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
