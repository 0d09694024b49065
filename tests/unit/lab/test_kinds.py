"""The lab's kind registry: every kind has exactly one module, and nothing falls through to another's."""

from __future__ import annotations

import pytest

from plugvisor.emulators.lab import DeviceKind, LabError, builtin, kinds, layout, render


def test_every_device_kind_has_a_module() -> None:
    """Each state kind is owned by a registered module, and NIC PFs and VFs by the same one."""
    owners = {k: kinds.get(k) for k in DeviceKind}
    assert owners[DeviceKind.NIC_PF] is owners[DeviceKind.NIC_VF]
    assert len(set(map(id, owners.values()))) == 3


def test_profile_sections_are_placed_in_profile_order() -> None:
    """gpus, then fpgas, then nics: device names and bus order stay what profiles always gave."""
    assert [k.section for k in kinds.placing()] == ["gpus", "fpgas", "nics"]


def test_unknown_kind_is_an_error_naming_it() -> None:
    """Asking for a kind nobody registered names it and what exists."""
    with pytest.raises(LabError, match=r"no lab device kind 'tpu' is registered; expected one of: fpga, gpu"):
        kinds.get("tpu")


def test_an_unregistered_kind_never_falls_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the GPU module gone, rendering a GPU is an error, not an FPGA tree (the old fall-through)."""
    state = layout.build(builtin("small"))
    registry = dict(kinds._REGISTRY)
    del registry[DeviceKind.GPU]
    monkeypatch.setattr(kinds, "_REGISTRY", registry)
    with pytest.raises(LabError, match="no lab device kind 'gpu'"):
        render.device(state, state.devices["gpu0"])


def test_a_kind_cannot_be_registered_twice() -> None:
    """A second module claiming a kind is refused, so two renderers never compete for one device."""

    class Impostor:
        owns = (DeviceKind.GPU,)

    with pytest.raises(LabError, match="'gpu' is registered twice"):
        kinds.register(Impostor())  # type: ignore[arg-type]
