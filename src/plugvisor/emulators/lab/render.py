"""From the lab's state to its tree; which module draws which device is the kind registry's business."""

from __future__ import annotations

from plugvisor.emulators.lab import kinds, platform
from plugvisor.emulators.lab.spec import Spec
from plugvisor.emulators.lab.state import DeviceState, LabState


def device(state: LabState, dev: DeviceState) -> Spec:
    """Render one device as it is now; an unplugged device renders to nothing.

    A kind that no module registered raises :class:`~.errors.LabError` naming it.
    """
    kind = kinds.get(dev.kind)
    if not dev.present:
        return {}
    return kind.render(state, dev)


def family(state: LabState, name: str) -> list[str]:
    """Return a device and those whose tree depends on it (a PF's VFs)."""
    dev = state.devices[name]
    return kinds.get(dev.kind).family(state, dev)


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
