"""Placement: NUMA nodes, PCIe switches and addresses follow the profile (no file system)."""

from __future__ import annotations

from collections import Counter

from plugvisor.emulators.lab import builtin, layout
from plugvisor.emulators.lab.nic import vf_address
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
