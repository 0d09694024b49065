"""The ``nic`` kind: SR-IOV virtual functions as devices, selected as the SR-IOV network device plugin does.

Unlike that plugin, VF pools follow ``sriov_numvfs`` changes without a restart
(sriov-network-device-plugin#276), and health is real: a PF whose link goes down
takes its VFs out of the allocatable count until it comes back (#362/#363).
"""

from __future__ import annotations

from typing import Final

from plugvisor.plugins.kinds import PluginKind
from plugvisor.plugins.nic.options import NicOptions
from plugvisor.plugins.nic.source import NicSource, env_name

KIND: Final = PluginKind("nic", NicOptions, NicSource, reads_pci=True, names_logs=True)

__all__ = ["KIND", "NicOptions", "NicSource", "env_name"]
