"""The emulated hardware lab: faithful GPU, FPGA and SR-IOV NIC trees under a root.

Every test, demo and CI run uses the lab to exercise real discovery code with no
hardware. Its standard is that a plugin reading the tree through a host-root
prefix cannot tell it from a real node in the parts it reads; see ``docs/lab.md``
for what is written, the profiles and the fault kinds.

Typical use::

    from plugvisor.emulators import lab

    node = lab.Lab.create("/tmp/pvlab-x/root", "dgx-like")
    node.fault("gpu3", lab.FaultKind.FALLEN_OFF_BUS)
    node.set_num_vfs("nic0", 0)
"""

from __future__ import annotations

from plugvisor.emulators.lab.errors import (
    DeviceBusyError,
    LabError,
    LabExistsError,
    MknodNotPermittedError,
    NotALabError,
    ProfileError,
    StateError,
    UnsafeRootError,
    UsageError,
)
from plugvisor.emulators.lab.faults import FaultKind
from plugvisor.emulators.lab.lab import DeviceNode, DeviceRecord, Lab
from plugvisor.emulators.lab.profiles import Profile, builtin, builtin_names, load_profile, parse_profile
from plugvisor.emulators.lab.state import DeviceKind
from plugvisor.emulators.lab.tree import check_root

__all__ = [
    "DeviceBusyError",
    "DeviceKind",
    "DeviceNode",
    "DeviceRecord",
    "FaultKind",
    "Lab",
    "LabError",
    "LabExistsError",
    "MknodNotPermittedError",
    "NotALabError",
    "Profile",
    "ProfileError",
    "StateError",
    "UnsafeRootError",
    "UsageError",
    "builtin",
    "builtin_names",
    "check_root",
    "load_profile",
    "parse_profile",
]
