"""The ``acme-npu`` lab kind: Acme N1 NPUs in plugvisor's emulated lab, as their driver shows them.

What the (fictional) ``acme_npu`` driver writes for each card it binds, and what
the ``npu`` kind reads:

- ``<PCI function>/acme_npu/acme_npu<N>/``, a class device (``N``: probe order),
  linked from ``sys/class/acme_npu/acme_npu<N>``, with ``dev``, ``uevent`` and the
  attributes ``health`` (``ok``, ``ecc_error``, ``thermal_trip``), ``temp`` and
  ``temp_crit`` (millidegrees Celsius, as hwmon), ``serial``,
  ``firmware_version`` and ``mem_total_bytes``;
- ``/dev/acme_npu<N>``, character major 240 (``acme_npu`` in ``/proc/devices``).

The lab does the PCI function, its NUMA node, the PCIe switches, AER,
``link-degraded``, ``fallen-off-bus`` (the driver lets go: no class device, no
node) and hot-plug; this kind adds the two faults of its own hardware.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Final

import pydantic

from plugvisor.emulators.lab.extension import (
    Dir,
    GiB,
    Identity,
    PciDevice,
    PciDeviceKind,
    PciGroup,
    PciModel,
    Spec,
    class_device,
    text,
)

MAJOR: Final = 240
CLASS: Final = "acme_npu"
ECC: Final = "ecc-uncorrectable"
THERMAL: Final = "thermal-trip"
HEALTH: Final = {ECC: "ecc_error", THERMAL: "thermal_trip"}
"""What ``health`` reads with each fault (``ok`` without)."""
TEMP_CRIT: Final = 95_000


class NpuGroup(PciGroup):
    """One ``npus:`` group of a profile: the lab's placement keys and the card's own."""

    memory_gib: int = pydantic.Field(default=32, ge=1, le=1024, alias="memoryGiB")
    firmware: str = pydantic.Field(default="1.4.2", pattern=r"^\d+\.\d+\.\d+$")


class AcmeNpu(PciDeviceKind[NpuGroup]):
    """Acme N1 NPUs: one PCI function each, with the ``acme_npu`` class device and node."""

    name = "acme-npu"
    section = "npus"
    prefix = "npu"
    group_model = NpuGroup
    models: ClassVar[Mapping[str, PciModel]] = {
        "acme-n1": PciModel(
            key="acme-n1",
            name="N1 Neural Processing Unit",
            vendor_name="Acme Corporation (fictional)",
            identity=Identity(0x1AC3, 0x0101, 0x1AC3, 0x0001, 0x120000, revision=0x02),
            driver="acme_npu",
            module="acme_npu",
            bars=((0, 32 * 2**20, False), (2, 16 * GiB, True)),
        )
    }
    faults = (ECC, THERMAL)
    majors: ClassVar[Mapping[int, str]] = {MAJOR: CLASS}

    def attributes(self, group: NpuGroup, name: str) -> Mapping[str, str | int]:
        """Each card's serial number, memory and firmware, decided when the lab is created."""
        serial = hashlib.sha256(name.encode()).hexdigest()[:10].upper()
        return {"serial": f"N1-{serial}", "memory": group.memory_gib * GiB, "firmware": group.firmware}

    def render(self, device: PciDevice, spec: Spec) -> None:
        """The class device and its node; ``health`` and ``temp`` say what the faults did."""
        name = f"{CLASS}{device.index}"
        where = class_device(spec, device, cls=CLASS, name=name, major=MAJOR, minor=device.index)
        health = next((HEALTH[f] for f in (ECC, THERMAL) if f in device.faults), "ok")
        spec[f"{where}/health"] = text(health)
        spec[f"{where}/temp"] = text(104_000 if THERMAL in device.faults else 41_000 + 1_000 * device.index)
        spec[f"{where}/temp_crit"] = text(TEMP_CRIT)
        spec[f"{where}/serial"] = text(device.attributes["serial"])
        spec[f"{where}/firmware_version"] = text(device.attributes["firmware"])
        spec[f"{where}/mem_total_bytes"] = text(device.attributes["memory"])

    def shared(self, devices: Sequence[PciDevice], spec: Spec) -> None:
        """The class directory, there even while every card is unplugged (as the loaded driver keeps it)."""
        spec[f"sys/class/{CLASS}"] = Dir()

    def check(self, root: str) -> list[str]:
        """Each class device reads a known health and hangs off an Acme PCI function."""
        problems = []
        classes = Path(root, "sys/class", CLASS)
        for device in sorted(classes.iterdir()) if classes.is_dir() else []:
            if (device / "health").read_text().strip() not in ("ok", *HEALTH.values()):
                problems.append(f"{CLASS}/{device.name}: health is not ok, ecc_error or thermal_trip")
            vendor = device / "device" / "vendor"
            if not vendor.is_file() or vendor.read_text().strip() != "0x1ac3":
                problems.append(f"{CLASS}/{device.name}: device is not an Acme PCI function")
        return problems

    def profiles(self) -> Mapping[str, str]:
        """The package's profiles (``profiles/*.yaml``), by file name: ``--profile acme-npu-node``."""
        folder = importlib.resources.files(__package__) / "profiles"
        files = [p for p in folder.iterdir() if p.name.endswith(".yaml")]
        return {p.name.removesuffix(".yaml"): p.read_text(encoding="utf-8") for p in files}


LAB_KIND: Final = AcmeNpu()
"""What the ``plugvisor.lab`` entry point names."""
