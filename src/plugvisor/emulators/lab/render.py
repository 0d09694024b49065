"""From the lab's state to its tree: the one place that knows which renderer draws which device."""

from __future__ import annotations

from plugvisor.emulators.lab import fpga, gpu, nic, platform
from plugvisor.emulators.lab.spec import Spec
from plugvisor.emulators.lab.state import DeviceKind, DeviceState, LabState


def device(state: LabState, dev: DeviceState) -> Spec:
    """Render one device as it is now; an unplugged device renders to nothing."""
    if not dev.present:
        return {}
    if dev.kind is DeviceKind.NIC_VF:
        assert dev.parent is not None
        if not state.devices[dev.parent].present:
            return {}
        return nic.render_vf(state, dev)
    if dev.kind is DeviceKind.NIC_PF:
        return nic.render_pf(state, dev)
    if dev.kind is DeviceKind.GPU:
        return gpu.render(state, dev)
    return fpga.render(state, dev)


def family(state: LabState, name: str) -> list[str]:
    """Return a device and those whose tree depends on it (a PF's VFs)."""
    dev = state.devices[name]
    if dev.kind is DeviceKind.NIC_PF:
        return [name, *(vf.name for vf in state.vfs_of(name))]
    return [name]


def devices(state: LabState, names: list[str]) -> Spec:
    """Render several devices into one spec."""
    spec: Spec = {}
    for name in names:
        if name in state.devices:
            spec.update(device(state, state.devices[name]))
    return spec


def whole(state: LabState) -> Spec:
    """Render the whole lab."""
    spec = platform.render(state)
    for dev in state.devices.values():
        spec.update(device(state, dev))
    return spec
