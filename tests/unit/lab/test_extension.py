"""Lab device kinds from other packages: found through entry points, placed, drawn, broken and mended
like the lab's own, and refused with the reason when they cannot work."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from plugvisor.emulators import lab
from plugvisor.emulators.lab import extension, kinds
from plugvisor.emulators.lab.extension import Identity, PciDevice, PciDeviceKind, PciGroup, PciModel, Spec


class Accel(PciDeviceKind[PciGroup]):
    """A small outside kind: a class device with a ``state`` attribute and one fault of its own."""

    name = "test-accel"
    section = "accels"
    prefix = "acc"
    models: ClassVar[Mapping[str, PciModel]] = {
        "a1": PciModel(
            key="a1",
            name="A1 Accelerator",
            vendor_name="Test Vendor",
            identity=Identity(0x1AAA, 0x0001, 0x1AAA, 0x0001, 0x120000),
            driver="accel_drv",
            module="accel_mod",
        )
    }
    faults = ("wedged",)
    majors: ClassVar[Mapping[int, str]] = {240: "accel"}

    def attributes(self, group: PciGroup, name: str) -> dict[str, str | int]:
        return {"serial": f"S-{name}"}

    def render(self, device: PciDevice, spec: Spec) -> None:
        where = extension.class_device(
            spec, device, cls="accel", name=f"accel{device.index}", major=240, minor=device.index
        )
        spec[f"{where}/state"] = extension.text("wedged" if "wedged" in device.faults else "running")

    def shared(self, devices: Sequence[PciDevice], spec: Spec) -> None:
        spec["sys/class/accel"] = extension.Dir()

    def check(self, root: str) -> list[str]:
        return [
            f"{p.name}: no state"
            for p in Path(root, "sys/class/accel").iterdir()
            if not (p / "state").exists()
        ]

    def profiles(self) -> dict[str, str]:
        return {
            "accel-node": "name: accel-node\nnumaNodes: 2\naccels: [{model: a1, count: 4, perSwitch: 2}]\n"
        }


class EntryPoint:
    """What importlib.metadata yields, for a kind object defined here."""

    def __init__(self, name: str, value: object) -> None:
        self.name, self.value, self._value = name, f"tests:{name}", value

    def load(self) -> object:
        if isinstance(self._value, Exception):
            raise self._value
        return self._value


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, object]]:
    """Entry points of the ``plugvisor.lab`` group to install: name -> kind (or an exception to raise)."""
    points: dict[str, object] = {}
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda group: (
            [EntryPoint(n, v) for n, v in points.items()] if group == kinds.ENTRY_POINT_GROUP else []
        ),
    )
    monkeypatch.setattr(kinds, "_REGISTRY", {})
    monkeypatch.setattr(kinds, "_BROKEN", {})
    monkeypatch.setattr(kinds, "_loaded", False)
    yield points


@pytest.fixture
def accel_lab(installed: dict[str, object], tmp_path: Path) -> lab.Lab:
    installed["test-accel"] = Accel()
    return lab.Lab.create(tmp_path / "root", "accel-node")


def test_the_built_in_kinds_are_the_ones_pyproject_registers() -> None:
    registered = {
        ep.name: ep.value
        for ep in importlib.metadata.entry_points(group=kinds.ENTRY_POINT_GROUP)
        if ep.dist is not None and ep.dist.name == "plugvisor"
    }
    assert registered == dict(kinds.BUILTIN)


def test_an_outside_kind_is_placed_like_the_labs_own(accel_lab: lab.Lab) -> None:
    """Its profile section, names, PCI functions on switches and NUMA nodes, numbers in bus order."""
    cards = accel_lab.devices(kind="test-accel")
    assert [(c.name, c.numa_node, c.kind, c.model) for c in cards] == [
        ("acc0", 0, "test-accel", "a1"),
        ("acc1", 0, "test-accel", "a1"),
        ("acc2", 1, "test-accel", "a1"),
        ("acc3", 1, "test-accel", "a1"),
    ]
    assert cards[0].pcie_switch == cards[1].pcie_switch != cards[2].pcie_switch
    assert dict(cards[3].attributes) == {"serial": "S-acc3"}
    root = accel_lab.root
    function = root / cards[2].sysfs_path
    assert (function / "vendor").read_text() == "0x1aaa\n"
    assert (function / "driver").resolve() == root / "sys/bus/pci/drivers/accel_drv"
    assert (root / "sys/bus/pci/drivers/accel_drv/module").resolve() == root / "sys/module/accel_mod"
    assert (root / "sys/class/accel/accel2/device").resolve() == function
    assert "240 accel\n" in (root / "proc/devices").read_text()
    assert "1aaa  Test Vendor\n\t0001  A1 Accelerator" in (root / "usr/share/hwdata/pci.ids").read_text()
    assert accel_lab.check() == []


def test_its_faults_and_the_shared_ones_change_the_tree(accel_lab: lab.Lab) -> None:
    root = accel_lab.root
    accel_lab.fault("acc1", "wedged")
    assert (root / "sys/class/accel/accel1/state").read_text() == "wedged\n"
    accel_lab.fault("acc1", "aer-fatal")
    assert "TOTAL_ERR_FATAL 1" in (root / accel_lab.device("acc1").sysfs_path / "aer_dev_fatal").read_text()
    accel_lab.fault("acc2", "fallen-off-bus")  # the driver lets go: the kind's entries go with it
    assert not (root / "sys/class/accel/accel2").exists() and not (root / "dev/accel2").exists()
    assert accel_lab.device("acc2").driver is None
    with pytest.raises(lab.UsageError, match=r"expected one of: .*link-degraded, wedged"):
        accel_lab.fault("acc0", "overheat")
    assert accel_lab.check() == []
    accel_lab.heal("acc1")
    accel_lab.heal("acc2")
    assert (root / "sys/class/accel/accel1/state").read_text() == "running\n"
    assert (root / "dev/accel2").exists()


def test_hot_plug_takes_everything_the_device_drew_and_brings_it_back(accel_lab: lab.Lab) -> None:
    root = accel_lab.root
    accel_lab.fault("acc3", "wedged")
    accel_lab.unplug("acc3")
    assert not (root / "sys/class/accel/accel3").exists()
    assert not (root / "sys/bus/pci/devices" / accel_lab.device("acc3").bdf).exists()
    assert accel_lab.check() == []
    accel_lab.plug("acc3")  # freshly enumerated: no faults
    assert (root / "sys/class/accel/accel3/state").read_text() == "running\n"


def test_a_profile_section_of_the_kind_is_validated_like_the_labs_own(installed: dict[str, object]) -> None:
    installed["test-accel"] = Accel()
    with pytest.raises(
        lab.ProfileError, match=r"accels\[0\].perSwich: unknown key; did you mean `perSwitch`"
    ):
        lab.parse_profile({"name": "x", "accels": [{"model": "a1", "count": 1, "perSwich": 1}]}, source="p")
    with pytest.raises(lab.ProfileError, match="unknown test-accel model 'a2'; expected one of: a1"):
        lab.parse_profile({"name": "x", "accels": [{"model": "a2", "count": 1}]}, source="p")
    with pytest.raises(lab.ProfileError, match=r"accles: unknown key; did you mean `accels`\?"):
        lab.parse_profile({"name": "x", "accles": []}, source="p")
    assert "accel-node" in lab.builtin_names()


def test_a_kind_that_cannot_be_loaded_is_named_where_it_is_needed(installed: dict[str, object]) -> None:
    """A broken package does not take the lab away: the built-in kinds work, its section says why not."""
    installed["test-accel"] = ImportError("No module named 'accel_driver_bits'")
    assert lab.builtin("small").name == "small"
    with pytest.raises(
        lab.ProfileError, match=r"test-accel \(ImportError: No module named 'accel_driver_bits'\)"
    ):
        lab.parse_profile({"name": "x", "accels": [{"model": "a1", "count": 1}]}, source="p")
    with pytest.raises(lab.LabError, match="'test-accel' is installed but cannot be loaded"):
        kinds.get("test-accel")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"name": "nic-vf"}, "name 'nic-vf': expected lower-case letters, digits, - (not a built-in kind)"),
        ({"section": "gpus"}, "section 'gpus': expected a new profile key"),
        ({"section": "deviceNodes"}, "section 'deviceNodes': expected a new profile key"),
        ({"prefix": "gpu"}, "device name prefix 'gpu' is taken"),
        ({"prefix": "acc1"}, "prefix 'acc1': expected 1-16 lower-case letters"),
        ({"faults": ("aer-fatal",)}, "'aer-fatal' is not a new fault name"),
        ({"majors": {195: "x"}}, "195 is the lab's own"),
        ({"profiles": lambda self: {"small": "name: small"}}, "small are plugvisor's own profiles"),
    ],
)
def test_a_kind_that_would_clash_is_refused_with_the_reason(
    installed: dict[str, object], change: dict[str, object], reason: str
) -> None:
    clashing = type("Clashing", (Accel,), change)
    installed[str(change.get("name", "test-accel"))] = clashing()
    assert reason in kinds.broken()[str(change.get("name", "test-accel"))]


def test_the_names_of_the_labs_own_kinds_are_reserved(installed: dict[str, object]) -> None:
    installed["gpu"] = type("Impostor", (Accel,), {"name": "gpu"})()
    assert kinds.broken() == {"gpu (tests:gpu)": "'gpu' is the name of one of the lab's own kinds"}
    assert kinds.get("gpu") is not None and kinds.get("gpu").section == "gpus"


def test_an_entry_point_that_is_no_pci_device_kind_is_refused(installed: dict[str, object]) -> None:
    installed["test-accel"] = object()
    assert kinds.broken() == {"test-accel": "tests:test-accel is a object, not a PciDeviceKind"}
