"""Placement: NUMA nodes, PCIe switches and addresses follow the profile (no file system)."""

from __future__ import annotations

from collections import Counter

from plugvisor.emulators.lab import builtin, layout
from plugvisor.emulators.lab.nic import vf_address
from plugvisor.emulators.lab.profiles import GpuGroup
from plugvisor.emulators.lab.state import DeviceKind


class TestDgxLike:
    def test_gpus_split_over_numa_nodes(self) -> None:
        """8 GPUs sit 4 per NUMA node."""
        state = layout.build(builtin("dgx-like"))
        gpus = [d for d in state.devices.values() if d.kind is DeviceKind.GPU]
        assert dict(Counter(d.numa_node for d in gpus)) == {0: 4, 1: 4}

    def test_two_gpus_per_switch_on_one_node(self) -> None:
        """Each PCIe switch holds two GPUs of one NUMA node, and the GPU paths pass through it."""
        state = layout.build(builtin("dgx-like"))
        gpus = [d for d in state.devices.values() if d.kind is DeviceKind.GPU]
        by_switch: dict[str | None, list[int]] = {}
        for gpu in gpus:
            by_switch.setdefault(gpu.switch, []).append(gpu.numa_node)
        assert None not in by_switch
        assert all(len(nodes) == 2 and len(set(nodes)) == 1 for nodes in by_switch.values())
        for sw in state.switches:
            for gpu in (g for g in gpus if g.switch == sw.name):
                assert f"/{sw.upstream}/" in gpu.primary.path

    def test_nvidia_minors_follow_bus_order(self) -> None:
        """The driver numbers GPUs in probe order, i.e. by address."""
        state = layout.build(builtin("dgx-like"))
        gpus = sorted(
            (d for d in state.devices.values() if d.kind is DeviceKind.GPU), key=lambda d: d.primary.bdf
        )
        assert list(range(8)) == [g.minor for g in gpus]

    def test_bridges_cover_their_buses(self) -> None:
        """Every device's bus lies within each bridge above it (secondary..subordinate)."""
        state = layout.build(builtin("dgx-like"))
        bridges = {b.bdf: b for b in state.bridges}
        for dev in state.devices.values():
            bus = dev.primary.address.bus
            for part in dev.primary.path.split("/")[3:-1]:
                _, secondary, subordinate = bridges[part].buses
                assert secondary <= bus <= subordinate, (dev.name, part)


class TestAddresses:
    def test_all_addresses_unique_in_big(self) -> None:
        """No two functions (VFs included) share an address, even with thousands of VFs."""
        state = layout.build(builtin("big"))
        bdfs = [fn.bdf for d in state.devices.values() for fn in d.functions] + [b.bdf for b in state.bridges]
        assert len(bdfs) == len(set(bdfs))
        assert sum(1 for d in state.devices.values() if d.kind is DeviceKind.NIC_VF) >= 4096

    def test_vf_address_follows_offset_and_stride(self) -> None:
        """VF i sits at PF routing id + sriov_offset + i * sriov_stride."""
        state = layout.build(builtin("small"))
        pf = state.devices["nic0"]
        assert pf.vf_offset is not None
        for i in range(3):
            assert pf.primary.address.routing_id + pf.vf_offset + i == vf_address(pf, i).routing_id

    def test_iommu_groups_unique(self) -> None:
        """Every function has its own IOMMU group."""
        state = layout.build(builtin("dgx-like"))
        groups = [fn.iommu_group for d in state.devices.values() for fn in d.functions]
        groups += [b.iommu_group for b in state.bridges]
        assert len(groups) == len(set(groups))


class TestThousandsOfGpus:
    """The profile allows gpus.count up to 4,096; past ~250 devices one PCI domain's buses ran out."""

    @staticmethod
    def _gpus(count: int, per_switch: int = 0):
        profile = builtin("dgx-like").model_copy(
            update={"gpus": [GpuGroup(model="nvidia-h100", count=count, per_switch=per_switch)]}
        )
        state = layout.build(profile)
        return state, [d for d in state.devices.values() if d.kind is DeviceKind.GPU]

    def test_4096_gpus_get_distinct_addresses_over_several_pci_domains(self) -> None:
        _state, gpus = self._gpus(4096)
        addresses = [gpu.primary.address for gpu in gpus]
        assert len(set(addresses)) == 4096
        assert len({a.domain for a in addresses}) > 1
        assert dict(Counter(gpu.numa_node for gpu in gpus)) == {0: 2048, 1: 2048}
        assert sorted(g.minor for g in gpus) == list(range(4096))

    def test_each_root_port_tree_stays_in_its_domain_and_covers_its_buses(self) -> None:
        state, gpus = self._gpus(600, per_switch=4)
        bridges = {b.bdf: b for b in state.bridges}
        for gpu in gpus:
            address = gpu.primary.address
            domain, host_bridge = state_host_bridge(gpu.primary.path)
            assert domain == address.domain, gpu.primary.path
            assert host_bridge in state.host_bridges
            for part in gpu.primary.path.split("/")[3:-1]:
                assert part.startswith(f"{address.domain:04x}:"), (gpu.name, part)
                _, secondary, subordinate = bridges[part].buses
                assert secondary <= address.bus <= subordinate, (gpu.name, part)

    def test_small_labs_keep_their_addresses(self) -> None:
        """Domain 0 first, as before: existing profiles and their tests see the same BDFs."""
        state = layout.build(builtin("big"))
        assert {d.primary.address.domain for d in state.devices.values()} == {0}


def state_host_bridge(path: str) -> tuple[int, str]:
    """``sys/devices/pci0001:00/...`` -> (1, ``pci0001:00``)."""
    name = path.split("/")[2]
    return int(name[3:7], 16), name
