"""CUDA in the container, on a real lab: the driver root the lab writes is what a GPU container gets mounted.

The lab writes NVIDIA's user-space driver as a real node has it (a compiled NVML stand-in as
libnvidia-ml.so.<version>, the other libraries as markers, each with its soname link; the tools). The gpu
kind, run against it through the emulated kubelet, must answer Allocate with each library at its soname in
the container's multiarch directory, read-only, from the file the link names; the libnvidia-ml a container
would load must be the working NVML of the lab's own GPUs.
"""

from __future__ import annotations

import ctypes
import json
import platform
from pathlib import Path

import pytest
import yaml

from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.emulators.lab import nvml
from plugvisor.plugins.gpu import KIND
from plugvisor.testing import running_dra_driver, short_socket_dir

RESOURCE = "plugvisor.io/gpu"
LIBS = f"/usr/lib/{platform.machine()}-linux-gnu"

needs_cc = pytest.mark.skipif(
    nvml.compiler() is None, reason="no C compiler (cc): the lab writes no NVIDIA libraries without one"
)


def _profile(tmp_path: Path, driver_root: str) -> str:
    profile = yaml.safe_load((Path(nvml.__file__).parent / "profiles/small.yaml").read_text())
    profile |= {"name": "small-driver-root", "driverRoot": driver_root}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    return str(path)


def _nvml_count(path: str) -> int:
    library = ctypes.CDLL(path)
    assert library.nvmlInit_v2() == 0
    count = ctypes.c_uint()
    assert library.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
    library.nvmlShutdown()
    return count.value


WHERE = {"/": f"usr/lib/{platform.machine()}-linux-gnu", "/usr/local/nvidia": "usr/local/nvidia/lib64"}
"""Where the lab writes the libraries for each driver root (the distribution's place for /)."""


@needs_cc
@pytest.mark.parametrize("driver_root", sorted(WHERE))
async def test_allocate_mounts_the_labs_driver_at_the_sonames_a_cuda_program_loads(
    make_lab, kubelet, running, tmp_path, driver_root
):
    lib_dir = WHERE[driver_root]
    node = make_lab(_profile(tmp_path, driver_root))
    root = Path(node.root)
    async with running(kubelet, node, KIND, {"driverRoot": driver_root}, RESOURCE):
        await kubelet.wait_for(lambda k: (v := k.resource(RESOURCE)) is not None and v.allocatable == 1)
        allocation = await kubelet.allocate(RESOURCE, 1)
    mounts = {m.container_path: m for m in allocation.response.mounts}
    (full,) = (root / lib_dir).glob("libcuda.so.*.*")  # libcuda.so.<driver version>
    version = full.name.removeprefix("libcuda.so.")
    for name, soname in nvml.LIBRARIES:
        real = str(root / lib_dir / f"{name}.so.{version}")
        assert mounts[f"{LIBS}/{name}.so.{version}"].host_path == real
        if soname is not None:
            assert mounts[f"{LIBS}/{name}.so.{soname}"].host_path == real, f"{name}.so.{soname}"
    for binary in nvml.BINARIES:
        assert f"/usr/bin/{binary}" in mounts
    assert all(m.read_only for m in mounts.values())
    # the file a container loads as libnvidia-ml.so.1 is the lab's working NVML, with its one GPU
    assert _nvml_count(mounts[f"{LIBS}/libnvidia-ml.so.1"].host_path) == 1


@needs_cc
async def test_with_cdi_the_spec_carries_the_driver_and_the_toolkits_hook_where_the_host_has_it(
    make_lab, kubelet, running
):
    node = make_lab("small")
    root = Path(node.root)
    hook = root / "usr/bin/nvidia-cdi-hook"
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o755)
    options = {"cdi": True, "cdiDir": "/var/run/cdi"}
    async with running(kubelet, node, KIND, options, RESOURCE):
        await kubelet.wait_for(lambda k: (v := k.resource(RESOURCE)) is not None and v.allocatable == 1)
        allocation = await kubelet.allocate(RESOURCE, 1)
    assert list(allocation.response.mounts) == []  # the spec has them, for every container of the resource
    spec = json.loads((root / "var/run/cdi/plugvisor.io-gpu.json").read_text())
    edits = spec["containerEdits"]
    mounted = {m["containerPath"]: m for m in edits["mounts"]}
    assert "ro" in mounted[f"{LIBS}/libcuda.so.1"]["options"]
    assert _nvml_count(mounted[f"{LIBS}/libnvidia-ml.so.1"]["hostPath"]) == 1
    assert edits["hooks"] == [
        {
            "hookName": "createContainer",
            "path": str(hook),  # the runtime runs it on the host: the lab's, as the mounts' host paths
            "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", LIBS],
        }
    ]


@needs_cc
@pytest.mark.parametrize("cdi", [False, True], ids=["claim-spec", "resource-spec"])
async def test_a_dra_claim_for_an_nvidia_gpu_gets_the_driver_mounted(make_lab, cdi):
    """The claim's CDI devices resolve, as a runtime resolves them, to the driver's files read-only: in the
    claim's own spec, or (cdi: true) in the resource's spec that the claim names."""
    node = make_lab("small")
    root = Path(node.root)
    with short_socket_dir() as base:
        kubelet = EmulatedKubelet(base / "device-plugins", objects_dir=base / "api", write_view=False)
        async with (
            kubelet,
            running_dra_driver(kubelet, KIND, {"cdi": cdi}, driver="gpu.plugvisor.io", root=root) as gpu,
        ):
            (name,) = gpu.devices
            claim, edits = await gpu.prepare(name)
            await gpu.unprepare(claim)
    mounts = {container: (host, options) for container, host, options in edits.mounts}
    host, options = mounts[f"{LIBS}/libnvidia-ml.so.1"]
    assert "ro" in options
    assert _nvml_count(host) == 1
    assert f"{LIBS}/libcuda.so.1" in mounts and "/usr/bin/nvidia-smi" in mounts
