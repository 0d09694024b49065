"""The ``gpu`` kind: NVIDIA, AMD and Intel GPUs from PCI sysfs, with topology-aware allocation.

Discovery reads PCI sysfs by vendor/class (no NVML, no vendor library needed),
device nodes from devfs, NVIDIA's UUIDs from procfs. Health is recomputed on every
scan (driver binding, fallen off the bus, AER, link state, nodes present), so a
recovered GPU is Healthy again. Where NVIDIA's ``libnvidia-ml.so.1`` loads, NVML
adds identity, XID/ECC health events and telemetry (:mod:`.nvml`). Time-slicing
advertises ``replicas`` IDs per GPU; GetPreferredAllocation scores sets by PCI-tree distance (see
:mod:`plugvisor.plugins.topology`). With ``cdi: true`` a CDI spec is kept in the
CDI directory and Allocate returns ``cdi_devices``.
"""

from __future__ import annotations

from typing import Final

from plugvisor.plugins.gpu.options import GpuOptions
from plugvisor.plugins.gpu.source import GpuScan, GpuSource
from plugvisor.plugins.kinds import PluginKind

KIND: Final = PluginKind("gpu", GpuOptions, GpuSource, reads_pci=True, preload=("pynvml",), names_logs=True)
"""``pynvml`` is imported by the fork server (10-40 ms, a pure-Python module that loads nothing until
``nvmlInit``); the library itself is loaded in each child only (:mod:`.nvml`)."""

__all__ = ["KIND", "GpuOptions", "GpuScan", "GpuSource"]
