"""Walk created trees the way real plugins do, and check what they would conclude."""

from __future__ import annotations

import glob
import os
import re

import pytest

from plugvisor.emulators.lab import DeviceKind, Lab, fidelity


def read(path: str) -> str:
    with open(path) as handle:
        return handle.read().strip()


@pytest.mark.parametrize("profile", ["small", "dgx-like", "amd-like", "intel-gpu-like"])
def test_tree_is_faithful(root: str, profile: str) -> None:
    """Links are relative and resolve inside the root, PF/VF pairs match, nodes agree with sys/dev/char."""
    Lab.create(root, profile)
    assert fidelity.problems(root) == []


def test_numa_and_switch_placement_in_sysfs(root: str) -> None:
    """numa_node and the PCI path of each GPU show the profile's NUMA split and switch pairs."""
    lab = Lab.create(root, "dgx-like")
    per_upstream: dict[str, list[int]] = {}
    for rec in lab.devices(kind=DeviceKind.GPU):
        dev = os.path.realpath(f"{root}/sys/bus/pci/devices/{rec.bdf}")
        parts = dev.split("/")
        upstream = parts[-3]
        assert read(f"{'/'.join(parts[:-2])}/class") == "0x060400"
        per_upstream.setdefault(upstream, []).append(int(read(f"{dev}/numa_node")))
        assert read(f"{dev}/local_cpulist") == lab.state().cpulist(rec.numa_node)
    assert len(per_upstream) == 4
    assert all(len(n) == 2 and len(set(n)) == 1 for n in per_upstream.values())


def test_nvidia_view(root: str) -> None:
    """procfs information names each GPU's bus location and minor, and /dev/nvidia<minor> exists."""
    Lab.create(root, "dgx-like")
    infos = glob.glob(f"{root}/proc/driver/nvidia/gpus/*/information")
    assert len(infos) == 8
    for path in infos:
        fields = dict(line.split(":", 1) for line in read(path).splitlines())
        bdf = fields["Bus Location"].strip()
        assert bdf == path.split("/")[-2]
        assert os.path.exists(f"{root}/dev/nvidia{fields['Device Minor'].strip()}")
        assert fields["GPU UUID"].strip().startswith("GPU-")
        assert read(f"{root}/sys/bus/pci/devices/{bdf}/vendor") == "0x10de"
    assert os.path.exists(f"{root}/dev/nvidiactl")


def test_intel_gpu_plugin_view(root: str) -> None:
    """Intel's scan: card links, vendor 0x8086, drm/ nodes present in /dev/dri, BDF parsed from the link."""
    Lab.create(root, "intel-gpu-like")
    cards = sorted(n for n in os.listdir(f"{root}/sys/class/drm") if re.fullmatch(r"card[0-9]+", n))
    assert len(cards) == 4
    for card in cards:
        base = f"{root}/sys/class/drm/{card}"
        assert read(f"{base}/device/vendor") == "0x8086"
        assert not os.path.exists(f"{base}/device/sriov_numvfs")
        assert os.path.basename(os.readlink(f"{base}/device/driver")) == "i915"
        for name in os.listdir(f"{base}/device/drm"):
            assert os.path.exists(f"{root}/dev/dri/{name}")
        target = os.readlink(base)
        assert target.startswith("../../devices/pci")
        bdf = target.split("/")[-3]
        assert os.path.realpath(f"{root}/dev/dri/by-path/pci-{bdf}-card") == f"{root}/dev/dri/{card}"


def test_rocm_plugin_view(root: str) -> None:
    """ROCm's scan: amdgpu BDFs under sys/module, KFD nodes whose location_id and render minor match."""
    Lab.create(root, "amd-like")
    bdfs = glob.glob(f"{root}/sys/module/amdgpu/drivers/pci:amdgpu/[0-9a-f][0-9a-f][0-9a-f][0-9a-f]:*")
    assert len(bdfs) == 8
    by_bdf = {}
    for node in glob.glob(f"{root}/sys/class/kfd/kfd/topology/nodes/*/properties"):
        props = dict(line.split() for line in read(node).splitlines())
        if int(props["cpu_cores_count"]) == 0 and int(props["gfx_target_version"]) > 0:
            loc = int(props["location_id"])
            bdf = f"{int(props['domain']):04x}:{(loc >> 8) & 0xFF:02x}:{(loc >> 3) & 0x1F:02x}.{loc & 7}"
            by_bdf[bdf] = (props, os.path.dirname(node))
    assert {os.path.basename(b) for b in bdfs} == set(by_bdf)
    for path in bdfs:
        props, node_dir = by_bdf[os.path.basename(path)]
        assert props["vendor_id"] == "4098"
        assert os.path.exists(f"{path}/drm/renderD{props['drm_render_minor']}")
        assert int(props["io_links_count"]) == len(os.listdir(f"{node_dir}/io_links"))
        types = {read(f"{link}/properties").split()[1] for link in glob.glob(f"{node_dir}/io_links/*")}
        assert {"2", "11"} == types
        assert read(f"{path}/numa_node") in {"0", "1"}
    assert os.path.exists(f"{root}/dev/kfd")


def test_sriov_plugin_view(root: str) -> None:
    """ghw's scan: identity from modalias, VFs via virtfn links, vfio groups for vfio-bound VFs."""
    profile = root + ".yaml"
    os.makedirs(os.path.dirname(profile), exist_ok=True)
    with open(profile, "w") as handle:
        handle.write(
            "name: vfio\nnics:\n  - model: intel-e810\n    count: 1\n    numVfs: 3\n    vfDriver: vfio-pci\n"
        )
    lab = Lab.create(root, profile)
    pf = lab.device("nic0")
    pf_dir = f"{root}/sys/bus/pci/devices/{pf.bdf}"
    assert read(f"{pf_dir}/modalias").startswith("pci:v00008086d00001592")
    for link in sorted(glob.glob(f"{pf_dir}/virtfn*")):
        vf = os.path.realpath(link)
        assert read(f"{vf}/device") == "0x1889"
        assert os.path.basename(os.readlink(f"{vf}/driver")) == "vfio-pci"
        group = os.path.basename(os.readlink(f"{vf}/iommu_group"))
        assert os.path.exists(f"{root}/dev/vfio/{group}")
        assert not os.path.exists(f"{vf}/net")
    assert os.path.exists(f"{root}/dev/vfio/vfio")
    assert "pci.ids" in os.listdir(f"{root}/usr/share/hwdata")
    assert fidelity.problems(root) == []


def test_fpga_views(root: str) -> None:
    """Intel: port node -> sys/dev/char -> afu_id; Xilinx: user_pf/mgmt_pf siblings, VBNV, xclmgmt node."""
    lab = Lab.create(root, "dgx-like")
    port = lab.device("fpga0").device_nodes[1]
    port_dir = os.path.realpath(f"{root}/sys/dev/char/{port.major}:{port.minor}")
    assert re.fullmatch(r"[0-9a-f]{32}", read(f"{port_dir}/afu_id"))
    pci_fn = port_dir.split("/fpga_region/")[0]
    assert read(f"{pci_fn}/class") == "0x120000"
    compat = glob.glob(
        f"{pci_fn}/fpga_region/region*/dfl-fme.*/dfl-fme-region.*/fpga_region/region*/compat_id"
    )
    assert len(compat) == 1
    xil = lab.device("fpga1")
    user = f"{root}/sys/bus/pci/devices/{xil.functions[1]}"
    mgmt = f"{root}/sys/bus/pci/devices/{xil.functions[0]}"
    assert os.path.exists(f"{user}/user_pf") and os.path.exists(f"{mgmt}/mgmt_pf")
    assert "xilinx_u250" in read(glob.glob(f"{user}/rom.*/VBNV")[0])
    assert os.path.exists(f"{root}/dev/xclmgmt{read(f'{mgmt}/instance')}")
    lab.fault("fpga1", "rom-missing")
    assert glob.glob(f"{user}/rom.*") == []
