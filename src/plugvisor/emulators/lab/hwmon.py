"""hwmon directories under the AMD-like and Intel-like GPUs, as amdgpu and i915 write them.

The kernel's hwmon ABI (Documentation/hwmon/sysfs-interface.rst): one
``hwmon/hwmon<N>`` directory under the device, linked from
``/sys/class/hwmon/hwmon<N>``, holding ``name`` and integer attributes in fixed
units: temperatures in millidegrees Celsius (``temp<i>_input``, ``_crit``,
``_crit_hyst``, ``_emergency``, named by ``temp<i>_label``), power in microwatts,
energy in microjoules, voltages in millivolts, frequencies in hertz.

What each driver exposes differs, and so does the lab:

- **amdgpu** (Instinct-class, passively cooled, so no ``fan*``/``pwm*``): ``edge``,
  ``junction`` and ``mem`` temperatures with critical and emergency limits,
  ``power1_average`` with its caps, ``vddgfx``, ``sclk``/``mclk``.
- **i915** (Documentation/ABI/testing/sysfs-driver-intel-i915-hwmon): power
  limits (``power1_max``, ``power1_rated_max``, ``power1_crit``), ``curr1_crit``,
  ``in0_input`` and the ``energy1_input`` counter; i915 reports no temperature
  through hwmon, so neither does the lab (and ``overheat`` applies to AMD-like GPUs).

The ``overheat`` fault raises the temperatures past their critical limit (the
junction first, as on real parts) and the power to near its cap.
"""

from __future__ import annotations

from typing import Final

from plugvisor.emulators.lab.spec import Dir, File, Spec, add_link, text

OVERHEAT: Final = "overheat"
CLASS_DIR: Final = "sys/class/hwmon"

_AMD_TEMPS: Final = (
    # label, normal, overheated, crit, crit_hyst, emergency (millidegrees C)
    ("edge", 38000, 97000, 100000, -273150, 105000),
    ("junction", 42000, 112000, 110000, -273150, 115000),
    ("mem", 45000, 96000, 105000, -273150, 110000),
)


def render(spec: Spec, fn_path: str, index: int, driver: str, *, overheat: bool = False) -> None:
    """Add ``hwmon/hwmon<index>`` under the PCI function at ``fn_path`` for ``driver`` (amdgpu or i915)."""
    if driver == "amdgpu":
        attributes = _amdgpu(overheat=overheat)
    elif driver == "i915":
        attributes = _i915()
    else:
        return
    directory = f"{fn_path}/hwmon/hwmon{index}"
    spec[directory] = Dir()
    spec[f"{directory}/name"] = text(driver)
    spec[f"{directory}/uevent"] = File(b"")
    for name, value in attributes.items():
        spec[f"{directory}/{name}"] = text(value)
    add_link(spec, f"{directory}/device", fn_path)
    add_link(spec, f"{directory}/subsystem", CLASS_DIR)
    add_link(spec, f"{CLASS_DIR}/hwmon{index}", directory)


def _amdgpu(*, overheat: bool) -> dict[str, str | int]:
    attributes: dict[str, str | int] = {}
    for number, (label, normal, hot, crit, hyst, emergency) in enumerate(_AMD_TEMPS, start=1):
        attributes[f"temp{number}_label"] = label
        attributes[f"temp{number}_input"] = hot if overheat else normal
        attributes[f"temp{number}_crit"] = crit
        attributes[f"temp{number}_crit_hyst"] = hyst
        attributes[f"temp{number}_emergency"] = emergency
    attributes.update(
        {
            "power1_label": "PPT",
            "power1_average": 296000000 if overheat else 92000000,
            "power1_cap": 300000000,
            "power1_cap_max": 300000000,
            "power1_cap_min": 0,
            "power1_cap_default": 300000000,
            "in0_label": "vddgfx",
            "in0_input": 818,
            "freq1_label": "sclk",
            "freq1_input": 800000000,
            "freq2_label": "mclk",
            "freq2_input": 1600000000,
        }
    )
    return attributes


def _i915() -> dict[str, str | int]:
    return {
        "power1_max": 150000000,
        "power1_rated_max": 150000000,
        "power1_max_interval": 977,
        "power1_crit": 400000000,
        "curr1_crit": 0,
        "in0_input": 720,
        "energy1_input": 5813257812,
    }
