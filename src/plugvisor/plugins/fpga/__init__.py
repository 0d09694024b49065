"""The ``fpga`` kind: Intel DFL/OPAE ports and Xilinx-style user/management PF pairs.

Discovery reads sysfs as Intel's and Xilinx's plugins do (no OPAE or XRT library).
The framework serves one resource per process, so ``family`` (``af``, ``region``,
``xilinx``; once called ``mode``) and ``match`` (AFU IDs, interface IDs, shells, vendors, addresses)
choose the devices of this resource; :func:`intel_resource_name` and
:func:`suggest_resources` give the names Intel's and Xilinx's plugins would use,
for writing the configuration. Health (all-``f`` IDs, port errors, lost shell,
fallen off the bus, AER, missing nodes) is recomputed on every scan, so a healed
device is Healthy again. PreStartContainer re-initialises the port (an in-tree
event/error clear plus an optional command); ``releaseCleanup`` runs a command
for each device no container holds any more (the framework's release watch).
"""

from __future__ import annotations

from typing import Final

from plugvisor.plugins.fpga.naming import intel_af_resource, intel_region_resource, xilinx_resource
from plugvisor.plugins.fpga.options import Family, FpgaOptions
from plugvisor.plugins.fpga.source import (
    FpgaScan,
    FpgaSource,
    Suggestion,
    intel_resource_name,
    suggest_resources,
)
from plugvisor.plugins.kinds import PluginKind

KIND: Final = PluginKind("fpga", FpgaOptions, FpgaSource, reads_pci=True, names_logs=True)

__all__ = [
    "KIND",
    "Family",
    "FpgaOptions",
    "FpgaScan",
    "FpgaSource",
    "Suggestion",
    "intel_af_resource",
    "intel_region_resource",
    "intel_resource_name",
    "suggest_resources",
    "xilinx_resource",
]
