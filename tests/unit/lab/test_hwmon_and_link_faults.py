"""The lab's hwmon trees (amdgpu, i915 formats) and the overheat and link-degraded faults."""

from collections.abc import Callable
from pathlib import Path

import pytest

from plugvisor.emulators.lab import Lab, errors

from .conftest import ROOT


def read(path: Path) -> str:
    return path.read_text().strip()


def hwmon_of(node: Lab, name: str) -> Path:
    bdf = node.device(name).bdf
    (directory,) = (Path(ROOT) / "sys/bus/pci/devices" / bdf / "hwmon").iterdir()
    return directory


def test_amd_like_gpus_have_amdgpu_sensors_in_kernel_units(lab_of: Callable[[str], Lab]) -> None:
    node = lab_of("amd-like")
    hw = hwmon_of(node, "gpu0")
    assert read(hw / "name") == "amdgpu"
    assert [read(hw / f"temp{i}_label") for i in (1, 2, 3)] == ["edge", "junction", "mem"]
    assert int(read(hw / "temp2_input")) < int(read(hw / "temp2_crit"))  # millidegrees, below critical
    assert int(read(hw / "power1_average")) > 1_000_000  # microwatts
    assert (Path(ROOT) / "sys/class/hwmon" / hw.name / "device").resolve() == hw.parent.parent.resolve()
    assert not list(hw.glob("fan*"))  # passively cooled Instinct parts have no fan attributes


def test_intel_like_gpus_have_i915_power_and_energy_but_no_temperature(lab_of: Callable[[str], Lab]) -> None:
    node = lab_of("intel-gpu-like")
    hw = hwmon_of(node, "gpu0")
    assert read(hw / "name") == "i915"
    assert int(read(hw / "energy1_input")) > 0
    assert not list(hw.glob("temp*"))
    with pytest.raises(errors.UsageError, match="overheat"):
        node.fault("gpu0", "overheat")


def test_overheat_passes_the_critical_limit_and_heal_cools_down(lab_of: Callable[[str], Lab]) -> None:
    node = lab_of("amd-like")
    hw = hwmon_of(node, "gpu1")
    node.fault("gpu1", "overheat")
    assert int(read(hw / "temp2_input")) > int(read(hw / "temp2_crit"))
    node.heal("gpu1")
    assert int(read(hw / "temp2_input")) < int(read(hw / "temp2_crit"))


@pytest.mark.parametrize(
    ("profile", "device"), [("amd-like", "gpu2"), ("dgx-like", "nic0"), ("dgx-like", "fpga0")]
)
def test_link_degraded_trains_below_the_maximum(
    lab_of: Callable[[str], Lab], profile: str, device: str
) -> None:
    node = lab_of(profile)
    fn = Path(ROOT) / "sys/bus/pci/devices" / node.device(device).bdf
    assert read(fn / "current_link_width") == read(fn / "max_link_width")
    node.fault(device, "link-degraded")
    assert int(read(fn / "current_link_width")) < int(read(fn / "max_link_width"))
    current, maximum = (float(read(fn / f"{k}_link_speed").split()[0]) for k in ("current", "max"))
    assert current < maximum
    assert read(fn / "current_link_speed").endswith(" GT/s PCIe")
    node.heal(device)
    assert read(fn / "current_link_speed") == read(fn / "max_link_speed")
