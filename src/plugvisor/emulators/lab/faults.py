"""Faults a real node shows, as changes to the lab's state.

Each fault is what the kernel would make visible, nothing more: an AER counter
that rises, a GPU whose driver link and nodes vanish and whose config space
reads all ones, a NIC whose ``operstate`` goes ``down`` (taking its VFs'
links with it), an FPGA port whose ``afu_id`` reads all ``f``, a Xilinx card
whose ``rom`` directory disappears (as after ``xbutil reset``), a PF whose VFs
drop to zero (as after a PF driver reload), a PCIe link that trained below its
capability (``current_link_*`` under ``max_link_*``), a GPU whose hwmon
temperatures pass their critical limits. How a plugin reacts is the plugin's
business; the lab only makes the tree tell the truth.

``heal`` undoes a fault. For AER that means the counters go back to zero: a real
kernel only resets them on re-enumeration, but tests want "healthy again" to be
observable, and re-plugging the device gives the faithful reset too.
"""

from __future__ import annotations

from enum import StrEnum

from plugvisor.emulators.lab import errors, fpga, gpu, hwmon, kinds, nic, pci, rdma
from plugvisor.emulators.lab.state import DeviceState, LabState


class FaultKind(StrEnum):
    """The faults the lab can inject."""

    AER_FATAL = "aer-fatal"
    AER_NONFATAL = "aer-nonfatal"
    AER_CORRECTABLE = "aer-correctable"
    FALLEN_OFF_BUS = gpu.FALLEN_OFF_BUS
    LINK_DOWN = nic.LINK_DOWN
    AFU_ID_INVALID = fpga.AFU_ID_INVALID
    ROM_MISSING = fpga.ROM_MISSING
    VFS_RESET = nic.VFS_RESET
    OVERHEAT = hwmon.OVERHEAT
    LINK_DEGRADED = pci.LINK_DEGRADED
    RDMA_PORT_DOWN = rdma.PORT_DOWN
    ECC_DBE = gpu.ECC_DBE
    ECC_SBE = gpu.ECC_SBE


_AER: dict[str, int] = {FaultKind.AER_FATAL: 0, FaultKind.AER_NONFATAL: 1, FaultKind.AER_CORRECTABLE: 2}


def fault_kind(name: str) -> FaultKind | str:
    """A built-in fault as its :class:`FaultKind`; an outside kind's own fault as its name."""
    try:
        return FaultKind(name)
    except ValueError:
        return name


def applicable(dev: DeviceState) -> tuple[FaultKind | str, ...]:
    """Return the faults that make sense for a device, in a stable order (AER first, then its kind's)."""
    aer = (FaultKind(f) for f in _AER) if dev.aer_capable else ()
    return (*aer, *(fault_kind(f) for f in kinds.get(dev.kind).faults(dev)))


def parse(kind: str | FaultKind, dev: DeviceState) -> FaultKind | str:
    """Return the fault kind a user named, checked against the device."""
    allowed = applicable(dev)
    fault = fault_kind(str(kind))
    if gpu.XID in allowed:
        try:
            if gpu.parse_xid(str(fault)) is not None:
                return fault
        except ValueError as exc:
            raise errors.UsageError(f"{dev.name}: {exc}") from None
    if fault not in allowed:
        if fault in {f.value for f in FaultKind} or str(fault).startswith("xid-"):
            problem = f"fault {str(kind)!r} does not apply to {dev.name} ({dev.kind} {dev.model})"
        else:
            problem = f"unknown fault kind {str(kind)!r} for {dev.name} ({dev.kind} {dev.model})"
        raise errors.UsageError(f"{problem}; expected one of: {', '.join(allowed)}")
    return fault


def inject(state: LabState, dev: DeviceState, fault: FaultKind | str) -> None:
    """Apply ``fault`` to the state (repeating an AER fault raises the counter again)."""
    if not dev.present:
        raise errors.UsageError(f"{dev.name} is unplugged; plug it back before injecting a fault")
    if fault in _AER:
        counts = list(dev.aer)
        counts[_AER[fault]] += 1
        dev.aer = (counts[0], counts[1], counts[2])
    elif fault is FaultKind.VFS_RESET:
        if FaultKind.VFS_RESET.value not in dev.faults:
            dev.saved_num_vfs = dev.num_vfs
        nic.set_vf_states(state, dev, 0)
    if fault not in dev.faults:
        dev.faults.append(str(fault))


def heal(state: LabState, dev: DeviceState, fault: FaultKind | str | None = None) -> None:
    """Undo one fault, or all of a device's faults."""
    targets = [fault_kind(f) for f in dev.faults] if fault is None else [fault]
    for kind in targets:
        if kind not in dev.faults:
            continue
        dev.faults.remove(str(kind))
        if kind in _AER:
            counts = list(dev.aer)
            counts[_AER[kind]] = 0
            dev.aer = (counts[0], counts[1], counts[2])
        elif kind is FaultKind.VFS_RESET:
            nic.set_vf_states(state, dev, dev.saved_num_vfs or 0)
            dev.saved_num_vfs = None
