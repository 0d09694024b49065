"""Walk the lab as the readers of a GPU server do: ghw-style NUMA and memory, the SR-IOV plugin's RDMA map,
pciutils-style attributes, and the nodes SR-IOV configurations ask for."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

from plugvisor.emulators.lab import Lab, builtin, fidelity, layout, render
from plugvisor.emulators.lab.spec import File

PROFILES = ["small", "dgx-like", "amd-like", "intel-gpu-like"]
"""Written to disk here; ``big`` is checked from its rendered spec (see the test below)."""


def read(path: str) -> str:
    with open(path) as handle:
        return handle.read().strip()


def cpus(cpulist: str) -> set[int]:
    out: set[int] = set()
    for part in cpulist.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


@pytest.mark.parametrize("profile", PROFILES)
def test_ghw_style_numa_memory_and_cpus(root: str, profile: str) -> None:
    """Per node: MemTotal is the profile's memory, cpuM links lead to that package, huge pages count."""
    Lab.create(root, profile)
    p = builtin(profile)
    nodes = sorted(glob.glob(f"{root}/sys/devices/system/node/node[0-9]*"))
    assert len(nodes) == p.numa_nodes
    for node in nodes:
        n = int(os.path.basename(node)[4:])
        info = {}
        for line in read(f"{node}/meminfo").splitlines():
            m = re.fullmatch(r"Node (\d+) (\S+):\s+(\d+)(?: kB)?", line)
            assert m is not None and int(m.group(1)) == n, line
            info[m.group(2)] = int(m.group(3))
        assert info["MemTotal"] == p.memory_per_numa_node_gib * 1024 * 1024
        assert 0 < info["MemFree"] < info["MemTotal"]
        assert info["HugePages_Total"] == p.hugepages_per_numa_node.pages_2m
        linked = sorted(int(os.path.basename(c)[3:]) for c in glob.glob(f"{node}/cpu[0-9]*"))
        assert set(linked) == cpus(read(f"{node}/cpulist"))
        for cpu in linked:
            topo = f"{node}/cpu{cpu}/topology"
            assert read(f"{topo}/physical_package_id") == str(n)
        for size, pages in p.hugepages_per_numa_node.sizes().items():
            assert read(f"{node}/hugepages/hugepages-{size}kB/nr_hugepages") == str(pages)
    total = sum(int(read(f"{n}/meminfo").splitlines()[0].split()[3]) for n in nodes)
    assert read(f"{root}/proc/meminfo").splitlines()[0].split()[1] == str(total)


def test_big_profile_memory_from_its_rendering() -> None:
    """``big`` (too slow to write in every run): the same NUMA memory and CPU links, from its rendering."""
    state = layout.build(builtin("big"))
    spec = render.whole(state)
    for node in state.numa_nodes:
        meminfo = spec[f"sys/devices/system/node/node{node.id}/meminfo"]
        assert isinstance(meminfo, File)
        first = meminfo.content.decode().splitlines()[0]
        assert first == f"Node {node.id} MemTotal:       {512 * 1024 * 1024:8d} kB"
        assert all(f"sys/devices/system/node/node{node.id}/cpu{c}" in spec for c in cpus(node.cpulist))


def _rdma_devices_for(root: str, bdf: str) -> list[str]:
    """rdmamap's GetRdmaDevicesForPcidev: directories under <pci>/infiniband."""
    base = f"{root}/sys/bus/pci/devices/{bdf}/infiniband"
    if not os.path.isdir(base):
        return []
    return sorted(
        n for n in os.listdir(base) if os.path.isdir(f"{base}/{n}") and not os.path.islink(f"{base}/{n}")
    )


def _char_devices(root: str, ibdev: str) -> list[str]:
    """rdmamap's GetRdmaCharDevices: uverbs whose ibdev names the device, and rdma_cm."""
    found = []
    for entry in sorted(os.listdir(f"{root}/sys/class/infiniband_verbs")):
        path = f"{root}/sys/class/infiniband_verbs/{entry}/ibdev"
        if entry.startswith("uverbs") and read(path) == ibdev:
            found.append(f"/dev/infiniband/{entry}")
    if os.path.exists(f"{root}/dev/infiniband/rdma_cm"):
        found.append("/dev/infiniband/rdma_cm")
    return found


def test_sriov_plugin_rdma_map(root: str) -> None:
    """Every ConnectX-like VF is RDMA (one mlx5 device, its uverbs node and rdma_cm); no E810 VF is."""
    lab = Lab.create(root, "dgx-like")
    seen: set[str] = set()
    for rec in lab.devices():
        if rec.parent is None:
            continue
        devs = _rdma_devices_for(root, rec.bdf)
        if rec.model == "intel-e810":
            assert devs == []
            continue
        assert len(devs) == 1 and devs[0].startswith("mlx5_")
        assert devs[0] not in seen
        seen.add(devs[0])
        nodes = _char_devices(root, devs[0])
        assert len(nodes) == 2 and nodes[-1] == "/dev/infiniband/rdma_cm"
        for node in nodes:
            assert os.path.exists(root + node)
        assert os.path.islink(f"{root}/sys/class/infiniband/{devs[0]}")
        port = f"{root}/sys/class/infiniband/{devs[0]}/ports/1"
        assert read(f"{port}/state") == "4: ACTIVE"
        assert read(f"{port}/link_layer") == "Ethernet"
        assert read(f"{port}/gid_attrs/ndevs/0") == rec.netdev
        assert re.fullmatch(r"fe80(:0000){3}(:[0-9a-f]{4}){4}", read(f"{port}/gids/0"))
    assert len(seen) == 8


def test_rdma_port_fault_and_heal(root: str) -> None:
    """rdma-port-down takes one VF's port DOWN, heal brings it back; a PF link-down takes VF ports down."""
    lab = Lab.create(root, "dgx-like")
    vf = lab.device("nic1vf2")
    ibdev = _rdma_devices_for(root, vf.bdf)[0]
    state = f"{root}/sys/class/infiniband/{ibdev}/ports/1/state"
    lab.fault("nic1vf2", "rdma-port-down")
    assert (read(state), read(state.replace("/state", "/phys_state"))) == ("1: DOWN", "3: Disabled")
    assert fidelity.problems(root) == []
    lab.heal("nic1vf2")
    assert read(state) == "4: ACTIVE"
    lab.fault("nic1", "link-down")
    assert read(state) == "1: DOWN"
    lab.heal("nic1")
    assert read(state) == "4: ACTIVE"


def test_vf_count_changes_keep_rdma_numbers_coherent(root: str) -> None:
    """VFs removed and created again take the lowest free mlx5/uverbs numbers; every link resolves."""
    lab = Lab.create(root, "dgx-like")
    lab.set_num_vfs("nic1", 0)
    assert sorted(os.listdir(f"{root}/sys/class/infiniband")) == ["mlx5_0"]
    lab.set_num_vfs("nic1", 3)
    assert sorted(os.listdir(f"{root}/dev/infiniband")) == [
        "rdma_cm",
        "uverbs0",
        "uverbs1",
        "uverbs2",
        "uverbs3",
    ]
    assert fidelity.problems(root) == []


@pytest.mark.parametrize("profile", PROFILES)
def test_pciutils_style_attributes(root: str, profile: str) -> None:
    """Every function has resource lines lspci can parse, resourceN sized as they say, and the PCI extras."""
    Lab.create(root, profile)
    for entry in glob.glob(f"{root}/sys/bus/pci/devices/*"):
        dev = os.path.realpath(entry)
        lines = read(f"{dev}/resource").splitlines()
        assert len(lines) in (13, 17)
        sized = 0
        for i, line in enumerate(lines):
            start, end, flags = (int(x, 16) for x in line.split())
            if flags:
                sized += 1
                assert end > start and flags & 0x200  # IORESOURCE_MEM
                if i < 6:
                    assert os.path.exists(f"{dev}/resource{i}")  # empty in the lab, see docs/lab.md
        if not os.path.exists(f"{dev}/secondary_bus_number"):
            assert sized >= 1
            assert read(f"{dev}/link/l1_aspm") in ("0", "1")
        assert read(f"{dev}/driver_override") == "(null)"
        assert read(f"{dev}/power_state") == "D0"
        assert read(f"{dev}/power/control") == "on"
        assert read(f"{dev}/consistent_dma_mask_bits") == "64"
        assert read(f"{dev}/broken_parity_status") == "0"
        assert all(read(p) in ("msi", "msix") for p in glob.glob(f"{dev}/msi_irqs/*"))
        mask = int(read(f"{dev}/local_cpus").replace(",", ""), 16)
        assert {i for i in range(mask.bit_length()) if mask >> i & 1} == cpus(read(f"{dev}/local_cpulist"))


def test_sriov_vf_bars_are_slices_of_the_pf_iov_bars(root: str) -> None:
    """A VF's BAR0 is the PF's SR-IOV BAR0 plus index times its size, as the SR-IOV capability places it."""
    lab = Lab.create(root, "small")
    pf = lab.device("nic0")
    pf_lines = read(f"{root}/sys/bus/pci/devices/{pf.bdf}/resource").splitlines()
    iov_start, iov_end, _ = (int(x, 16) for x in pf_lines[7].split())
    total = int(read(f"{root}/sys/bus/pci/devices/{pf.bdf}/sriov_totalvfs"))
    size = (iov_end - iov_start + 1) // total
    for i, name in enumerate(pf.vfs):
        vf = lab.device(name)
        start = int(read(f"{root}/sys/bus/pci/devices/{vf.bdf}/resource").splitlines()[0].split()[0], 16)
        assert start == iov_start + i * size


@pytest.mark.parametrize("profile", ["small", "dgx-like"])
def test_nic_profiles_have_tun_and_vhost_net(root: str, profile: str) -> None:
    """SR-IOV configs that ask for /dev/net/tun and /dev/vhost-net find them, numbered as misc 200/238."""
    Lab.create(root, profile)
    assert os.path.realpath(f"{root}/dev/char/10:200") == f"{root}/dev/net/tun"
    assert os.path.realpath(f"{root}/dev/char/10:238") == f"{root}/dev/vhost-net"


def test_check_reports_a_broken_rdma_and_numa_tree(root: str) -> None:
    """`lab check` notices a verbs node naming a missing device, and a meminfo not in kernel form."""
    Lab.create(root, "dgx-like")
    verbs = os.path.realpath(f"{root}/sys/class/infiniband_verbs/uverbs3")
    os.chmod(f"{verbs}/ibdev", 0o644)
    with open(f"{verbs}/ibdev", "w") as handle:
        handle.write("mlx5_99\n")
    meminfo = f"{root}/sys/devices/system/node/node1/meminfo"
    os.chmod(meminfo, 0o644)
    with open(meminfo, "w") as handle:
        handle.write("MemTotal: 1 kB\n")
    found = fidelity.problems(root)
    assert any("uverbs3: ibdev mlx5_99" in p for p in found)
    assert any(p.startswith("node1/meminfo") for p in found)


def test_lspci_reads_the_lab(root: str) -> None:
    """pciutils' own reader (sysfs access method pointed at the lab) lists every function with its BARs."""
    lspci = shutil.which("lspci")
    if lspci is None:
        pytest.skip("lspci (pciutils) is not installed; the attribute checks above stand in for it")
    lab = Lab.create(root, "dgx-like")
    ids = f"{root}/usr/share/hwdata/pci.ids"
    out = subprocess.run(
        [lspci, "-D", "-v", "-A", "linux-sysfs", "-O", f"sysfs.path={root}/sys/bus/pci", "-i", ids],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for rec in lab.devices():
        assert rec.bdf in out
    assert "NUMA node 1" in out and "Kernel driver in use: mlx5_core" in out
    assert "Memory at" in out and "[virtual]" not in out  # config-space BARs agree with resource
