"""The gpu kind as a DRA driver: one published device per physical GPU, with what users select on.

Attributes (the driver's domain unless qualified): ``type`` (``gpu``, as
NVIDIA's driver), ``index`` (NVIDIA's minor number, or the DRM card number),
``uuid`` (NVIDIA), ``model`` (the driver's product name, else the host's PCI
ID database), ``vendor`` (``nvidia``, ``amd``, ``intel``), ``pciDeviceId``,
``driver`` (the kernel module), ``driverVersion`` (a version: NVML's, else
NVIDIA's procfs, else the module's own), and the standard
``resource.kubernetes.io/pciBusID``, ``pcieRoot`` and ``numaNode`` (only where
the kernel knows it). Where NVML answers, NVIDIA GPUs also carry what
``gpu.nvidia.com`` publishes under the same names and types: ``productName``,
``brand``, ``architecture``, ``cudaComputeCapability`` and
``cudaDriverVersion`` (versions), plus ``migEnabled``; and taints while NVML
health holds them unhealthy (``gpu.plugvisor.io/xid=<n>``, ``.../ecc=dbe``,
``.../gpu-lost``, NoSchedule). Capacity ``memory`` in bytes: NVML's total for
NVIDIA, else where the kernel tells it without a vendor library (Intel's
``lmem_total_bytes``, AMD's ``mem_info_vram_total``).

Names follow the device IDs (``deviceIdStrategy``): ``gpu-6d3c...`` for a UUID,
``gpu-0000-3b-00-0`` for a PCI address, ``gpu-3`` for an index. Time-slicing
replicas are a device-plugin notion: only the first replica of each GPU is
published, under the GPU's name; in DRA, pods share a GPU by sharing a claim.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import AttributeValue, DeviceTaint, PublishedDevice, SemVer, bytes_quantity
from plugvisor.dra.hooks import dra_device_name
from plugvisor.dra.validation import clip_value
from plugvisor.plugins import sysfs
from plugvisor.plugins.draattributes import function_attributes, module_version, read_bytes_count
from plugvisor.plugins.gpu.discovery import Gpu, parse_information
from plugvisor.plugins.gpu.nvml import GpuView, System
from plugvisor.plugins.gpu.options import NVIDIA

_NVIDIA_VERSION: Final = re.compile(
    r"^NVRM version:.*?Kernel Module(?: for \S+)?\s+([0-9]+(?:\.[0-9]+)*)(?=\s|$)", re.MULTILINE
)
"""The version in ``/proc/driver/nvidia/version``'s first line, in both wordings the driver has:

- proprietary module: ``NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Sun ...``;
- open module (the default from Hopper on): ``NVRM version: NVIDIA UNIX Open Kernel Module for x86_64
  580.159.04  Release Build ...``, where the architecture comes after the words, not before.
"""


def parse_nvidia_version(text: str) -> SemVer | None:
    """The driver version in the text of ``/proc/driver/nvidia/version`` (either wording), or None."""
    match = _NVIDIA_VERSION.search(text)
    return SemVer.tolerant(match.group(1)) if match else None


def nvidia_driver_version(paths: HostPaths) -> SemVer | None:
    """The NVIDIA kernel module's version: procfs's banner, else ``/sys/module/nvidia/version``.

    The module's own file holds just the number (``580.159.04``) and is there
    whichever wording the banner uses; procfs comes first because it is what
    NVIDIA's tools read, the module file covers a banner worded in a way not
    known here.
    """
    text = sysfs.read_text(paths.procfs / "driver/nvidia/version")
    found = parse_nvidia_version(text) if isinstance(text, str) else None
    return found if found is not None else module_version(paths, "nvidia")


def memory_bytes(gpu: Gpu) -> int | None:
    """The GPU's own memory, where the kernel driver reports it."""
    found = read_bytes_count(gpu.function.path / "mem_info_vram_total")  # amdgpu
    if found is None and gpu.index is not None:
        found = read_bytes_count(
            gpu.function.path / "drm" / f"card{gpu.index}" / "lmem_total_bytes"
        )  # i915, xe
    return found


def gpu_name(physical: str) -> str:
    """The GPU's name in the pool: its device ID as a DNS label, starting ``gpu-``."""
    name = dra_device_name(physical)
    return name if name.startswith("gpu-") else dra_device_name(f"gpu-{physical}")


def nvml_attributes(view: GpuView, system: System | None) -> dict[str, AttributeValue]:
    """The attributes NVIDIA's DRA driver publishes from NVML, under its names and types."""
    identity = view.identity
    attributes: dict[str, AttributeValue] = {}
    for name, text in (
        ("productName", identity.product_name),
        ("brand", identity.brand),
        ("architecture", identity.architecture),
    ):
        if text:
            attributes[name] = clip_value(text)
    for name, version in (
        ("cudaComputeCapability", identity.compute_capability),
        ("driverVersion", system.driver_version if system else None),
        ("cudaDriverVersion", system.cuda_driver_version if system else None),
    ):
        parsed = SemVer.tolerant(version) if version else None
        if parsed is not None:
            attributes[name] = parsed
    if identity.mig_enabled is not None:
        attributes["migEnabled"] = identity.mig_enabled
    return attributes


def published(
    paths: HostPaths,
    snapshot: Snapshot[Any],
    gpus: Mapping[str, Gpu],
    physical: Mapping[str, str],
    *,
    nvml: Mapping[str, GpuView] = MappingProxyType({}),
    system: System | None = None,
) -> dict[str, PublishedDevice]:
    """Every physical GPU of the snapshot, by the device ID of its first replica.

    ``nvml``: NVML's view of the GPUs it knows, by PCI address: its attributes
    join (and its driver version replaces procfs's), its memory total is the
    ``memory`` capacity, and its health problems become taints, so that a
    cluster that keeps device taints shows why the GPU takes no new claims.
    """
    versions: dict[str, SemVer | None] = {}
    answer: dict[str, PublishedDevice] = {}
    taken: set[str] = set()
    for device_id in snapshot.devices:
        gpu, name = gpus.get(device_id), physical.get(device_id)
        if gpu is None or name is None or name in taken:
            continue
        taken.add(name)
        attributes: dict[str, AttributeValue] = {"type": "gpu", **function_attributes(gpu.function, paths)}
        if gpu.index is not None:
            attributes["index"] = gpu.index
        if gpu.uuid:
            attributes["uuid"] = clip_value(gpu.uuid)
        driver = gpu.function.driver or ""
        if gpu.function.vendor == NVIDIA:
            info = sysfs.read_text(paths.procfs / "driver/nvidia/gpus" / gpu.bdf / "information")
            model = parse_information(info).get("Model") if isinstance(info, str) else None
            if model:
                attributes["model"] = clip_value(model)
            if "nvidia" not in versions:
                versions["nvidia"] = nvidia_driver_version(paths)
            version = versions["nvidia"]
        else:
            if driver and driver not in versions:
                versions[driver] = module_version(paths, driver)
            version = versions.get(driver)
        if version is not None:
            attributes["driverVersion"] = version
        view = nvml.get(gpu.bdf)
        memory = memory_bytes(gpu)
        taints: tuple[DeviceTaint, ...] = ()
        if view is not None:
            attributes.update(nvml_attributes(view, system))
            memory = view.identity.memory_bytes or memory
            taints = tuple(DeviceTaint(key, value) for key, value in view.taints)
        capacity = {"memory": bytes_quantity(memory)} if memory is not None else {}
        answer[device_id] = PublishedDevice(gpu_name(name), attributes, capacity, taints)
    return answer
