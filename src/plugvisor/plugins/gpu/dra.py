"""The gpu kind as a DRA driver: one published device per physical GPU, with what users select on.

Attributes (the driver's domain unless qualified): ``index`` (NVIDIA's minor
number, or the DRM card number), ``uuid`` (NVIDIA), ``model`` (the driver's
product name, else the host's PCI ID database), ``vendor`` (``nvidia``,
``amd``, ``intel``), ``pciDeviceId``, ``driver`` (the kernel module),
``driverVersion`` (a version: NVIDIA's procfs, else the module's own), and the
standard ``resource.kubernetes.io/pciBusID``, ``pcieRoot`` and ``numaNode``.
Capacity ``memory`` where the kernel tells it without a vendor library
(Intel's ``lmem_total_bytes``, AMD's ``mem_info_vram_total``); NVIDIA's needs
NVML and is left out.

Names follow the device IDs (``deviceIdStrategy``): ``gpu-6d3c...`` for a UUID,
``gpu-0000-3b-00-0`` for a PCI address, ``gpu-3`` for an index. Time-slicing
replicas are a device-plugin notion: only the first replica of each GPU is
published, under the GPU's name; in DRA, pods share a GPU by sharing a claim.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import AttributeValue, PublishedDevice, SemVer, bytes_quantity
from plugvisor.dra.hooks import dra_device_name
from plugvisor.plugins import sysfs
from plugvisor.plugins.draattributes import function_attributes, module_version, read_bytes_count
from plugvisor.plugins.gpu.discovery import Gpu, parse_information
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


def published(
    paths: HostPaths, snapshot: Snapshot[Any], gpus: Mapping[str, Gpu], physical: Mapping[str, str]
) -> dict[str, PublishedDevice]:
    """Every physical GPU of the snapshot, by the device ID of its first replica."""
    versions: dict[str, SemVer | None] = {}
    answer: dict[str, PublishedDevice] = {}
    taken: set[str] = set()
    for device_id in snapshot.devices:
        gpu, name = gpus.get(device_id), physical.get(device_id)
        if gpu is None or name is None or name in taken:
            continue
        taken.add(name)
        attributes: dict[str, AttributeValue] = function_attributes(gpu.function, paths)
        if gpu.index is not None:
            attributes["index"] = gpu.index
        if gpu.uuid:
            attributes["uuid"] = gpu.uuid[:64]
        driver = gpu.function.driver or ""
        if gpu.function.vendor == NVIDIA:
            info = sysfs.read_text(paths.procfs / "driver/nvidia/gpus" / gpu.bdf / "information")
            model = parse_information(info).get("Model") if isinstance(info, str) else None
            if model:
                attributes["model"] = model[:64]
            if "nvidia" not in versions:
                versions["nvidia"] = nvidia_driver_version(paths)
            version = versions["nvidia"]
        else:
            if driver and driver not in versions:
                versions[driver] = module_version(paths, driver)
            version = versions.get(driver)
        if version is not None:
            attributes["driverVersion"] = version
        memory = memory_bytes(gpu)
        capacity = {"memory": bytes_quantity(memory)} if memory is not None else {}
        answer[device_id] = PublishedDevice(gpu_name(name), attributes, capacity)
    return answer
