"""hwloc reads the lab as it reads a server: NUMA nodes, packages, cores and PUs, and every PCI function
under the NUMA node the profile puts it on.

hwloc is what MPI, Slurm and AMD's ROCm device plugin place devices with; ROCm's plugin asks it for
the NUMA node of each GPU's bus ID. ``HWLOC_FSROOT`` points hwloc's Linux backend at the lab root, and
when the CPU tree there is incomplete hwloc silently describes the host instead, so the counts below
also prove the tree was read at all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

from plugvisor.emulators.lab import Lab, builtin
from plugvisor.emulators.lab.profiles import Profile

LSTOPO = shutil.which("lstopo-no-graphics")
pytestmark = pytest.mark.skipif(
    LSTOPO is None, reason="lstopo-no-graphics (Debian package hwloc-nox) is not installed"
)

IO_TYPES = {"Bridge", "PCIDev", "OSDev", "Misc"}


def topology(root: str) -> ET.Element:
    """hwloc's view of the lab root, every PCI function included (``--whole-io``), as XML."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HWLOC_")}
    env["HWLOC_FSROOT"] = root
    assert LSTOPO is not None
    command = [LSTOPO, "--whole-io", "--of", "xml", "-"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert "hwloc/linux" not in done.stderr, done.stderr
    return ET.fromstring(done.stdout)


def bits(mask: str) -> set[int]:
    """hwloc's bitmap text (``0x0000ffff,0xffffffff``; a zero word as ``0x0`` or nothing) as its bits."""
    value = 0
    for word in mask.split(","):
        value = value << 32 | int(word or "0", 16)
    return {bit for bit in range(value.bit_length()) if value >> bit & 1}


def count(top: ET.Element, kind: str) -> int:
    return sum(1 for obj in top.iter("object") if obj.get("type") == kind)


def placements(top: ET.Element) -> dict[str, ET.Element]:
    """Each PCI function's bus ID -> the first non-I/O object above it (what ROCm's plugin asks for)."""
    parent = {child: obj for obj in top.iter("object") for child in obj.findall("object")}
    out = {}
    for obj in top.iter("object"):
        busid = obj.get("pci_busid")
        if busid is None or obj.get("type") not in ("PCIDev", "Bridge"):
            continue
        above = parent[obj]
        while above.get("type") in IO_TYPES:
            above = parent[above]
        out[busid] = above
    return out


def check(root: str, profile: Profile) -> None:
    top = topology(root)
    nodes, cpus = profile.numa_nodes, profile.numa_nodes * profile.cpus_per_numa_node
    assert count(top, "NUMANode") == nodes
    assert count(top, "Package") == nodes
    assert count(top, "Core") == cpus
    assert count(top, "PU") == cpus
    where = placements(top)
    devices = Lab.open(root).devices()
    assert devices
    for dev in devices:
        if dev.state != "present":
            continue
        want = set(range(nodes)) if dev.numa_node == -1 else {dev.numa_node}
        for bdf in dev.functions:
            assert bdf in where, f"{dev.name} {bdf} is not in hwloc's PCI tree"
            assert bits(where[bdf].get("nodeset", "0x0")) == want, (dev.name, bdf, where[bdf].attrib)
            with open(f"{root}/sys/bus/pci/devices/{bdf}/local_cpulist") as handle:
                local = handle.read().strip()
            first, _, last = local.partition("-")
            assert bits(where[bdf].get("cpuset", "0x0")) == set(range(int(first), int(last or first) + 1))


@pytest.mark.parametrize("name", ["small", "dgx-like", "amd-like", "intel-gpu-like", "big"])
def test_hwloc_sees_the_profiles_numa_cpus_and_device_placement(root: str, name: str) -> None:
    """A named profile's NUMA nodes, packages, cores and PUs, and each device under its NUMA node."""
    Lab.create(root, name)
    check(root, builtin(name))


def test_hwloc_places_a_gpu_of_the_amd_like_lab_on_its_numa_node(root: str) -> None:
    """The case ROCm's plugin failed on (``No NUMA node found with bus ID: 0000:88:00.0``)."""
    Lab.create(root, "amd-like")
    gpu = next(d for d in Lab.open(root).devices() if d.bdf == "0000:88:00.0")
    above = placements(topology(root))["0000:88:00.0"]
    assert above.get("type") == "Package"
    assert bits(above.get("nodeset", "0x0")) == {gpu.numa_node} == {1}


def test_hwloc_puts_devices_without_numa_information_under_the_whole_machine(root: str) -> None:
    """``numa_node`` -1 (a VM without ACPI SRAT): hwloc still sees node 0 and places devices by their CPUs."""
    if "numa_information" not in Profile.model_fields:
        pytest.skip("this lab has no numaInformation profile key (the lab branch adds it)")
    profile = builtin("small").model_copy(update={"numa_information": False})
    Lab.create(root, profile)
    assert {d.numa_node for d in Lab.open(root).devices()} == {-1}
    check(root, profile)
