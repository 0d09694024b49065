"""FPGA cards: Intel DFL and Xilinx-like management/user PF pairs.

Intel's FPGA plugin opens ``/dev/dfl-port.N``, follows ``sys/dev/char/M:m`` to
the port, reads ``afu_id`` there, walks up to the PCI function, and reads the
interface id from ``dfl-fme.N/dfl-fme-region.N/fpga_region/regionM/compat_id``;
an all-``f`` id means unhealthy. Xilinx's plugin looks for ``user_pf`` and
``mgmt_pf`` markers on sibling functions, the shell name in ``rom.*/VBNV`` (the
directory ``xbutil reset`` makes vanish), and ``/dev/xclmgmt<instance>``.
"""

from __future__ import annotations

from typing import Any, Final

from plugvisor.emulators.lab import catalog, kinds, majors, pci
from plugvisor.emulators.lab.catalog import DflFpgaModel, XilinxFpgaModel
from plugvisor.emulators.lab.gpu import FALLEN_OFF_BUS, drm_shared, render_drm
from plugvisor.emulators.lab.pci import Bdf
from plugvisor.emulators.lab.spec import Dir, File, Spec, add_link, add_node, driver_dir, text
from plugvisor.emulators.lab.state import DeviceKind, DeviceState, FunctionState, LabState

AFU_ID_INVALID = "afu-id-invalid"
ROM_MISSING = "rom-missing"
ALL_F = "f" * 32


def _function(
    state: LabState,
    dev: DeviceState,
    fn: FunctionState,
    ident: pci.Identity,
    bars: tuple[catalog.BarSpec, ...],
    **extra: str,
) -> pci.Function:
    fallen = FALLEN_OFF_BUS in dev.faults
    return pci.Function(
        bdf=fn.address,
        path=fn.path,
        identity=ident,
        driver=None if fallen else fn.driver,
        numa_node=dev.numa_node,
        cpulist=state.cpulist(dev.numa_node),
        iommu_group=fn.iommu_group,
        link_speed="8.0 GT/s PCIe",
        aer=dev.aer,
        config_readable=not fallen,
        link_degraded=pci.LINK_DEGRADED in dev.faults,
        multifunction=len(dev.functions) > 1,
        extra=extra,
        bars=pci.assign_bars(fn.address, bars),
        nr_cpus=state.nr_cpus,
        msi_vectors=2,
    )


def _platform_device(spec: Spec, path: str, *, driver: str, major: int, minor: int, node: str) -> None:
    """Add a DFL feature device (FME or port): platform bus, driver link, char node."""
    spec[path] = Dir()
    spec[f"{path}/dev"] = text(f"{major}:{minor}")
    name = path.rsplit("/", 1)[1]
    spec[f"{path}/uevent"] = text(f"MAJOR={major}\nMINOR={minor}\nDEVNAME={name}\nDRIVER={driver}")
    add_link(spec, f"{path}/subsystem", "sys/bus/platform")
    add_link(spec, f"{path}/driver", f"sys/bus/platform/drivers/{driver}")
    add_link(spec, f"sys/bus/platform/drivers/{driver}/{name}", path)
    add_link(spec, f"sys/bus/platform/devices/{name}", path)
    add_node(spec, at=node, major=major, minor=minor, sys_target=path, mode=0o600)


def _render_dfl(state: LabState, dev: DeviceState, model: DflFpgaModel) -> Spec:
    spec: Spec = {}
    fn = dev.primary
    pci.render_function(spec, _function(state, dev, fn, model.identity, model.bars))
    if FALLEN_OFF_BUS in dev.faults:
        return spec
    assert dev.fpga_index is not None
    i = dev.fpga_index
    region = f"{fn.path}/fpga_region/region{2 * i}"
    spec[region] = Dir()
    spec[f"{region}/uevent"] = text("")
    add_link(spec, f"{region}/subsystem", "sys/class/fpga_region")
    add_link(spec, f"{region}/device", fn.path)
    add_link(spec, f"sys/class/fpga_region/region{2 * i}", region)

    fme = f"{region}/dfl-fme.{i}"
    _platform_device(spec, fme, driver="dfl-fme", major=majors.DFL_FME, minor=i, node=f"dev/dfl-fme.{i}")
    spec[f"{fme}/bitstream_id"] = text(model.bitstream_id)
    spec[f"{fme}/bitstream_metadata"] = text("0x2018041100000000")
    spec[f"{fme}/ports_num"] = text(1)
    spec[f"{fme}/socket_id"] = text(0)
    spec[f"{fme}/cache_size"] = text(0)
    pr = f"{fme}/dfl-fme-region.{i}/fpga_region/region{2 * i + 1}"
    spec[pr] = Dir()
    spec[f"{pr}/compat_id"] = text(dev.interface_id or ALL_F)
    add_link(spec, f"{pr}/subsystem", "sys/class/fpga_region")
    add_link(spec, f"sys/class/fpga_region/region{2 * i + 1}", pr)

    port = f"{region}/dfl-port.{i}"
    _platform_device(spec, port, driver="dfl-port", major=majors.DFL_PORT, minor=i, node=f"dev/dfl-port.{i}")
    afu = ALL_F if AFU_ID_INVALID in dev.faults else (dev.afu_id or ALL_F)
    spec[f"{port}/afu_id"] = text(afu)
    spec[f"{port}/id"] = text(0)
    spec[f"{port}/power_state"] = text(0)
    spec[f"{port}/ltr"] = File(b"0\n", 0o644)
    spec[f"{port}/ap1_event"] = File(b"0\n", 0o644)
    spec[f"{port}/ap2_event"] = File(b"0\n", 0o644)
    return spec


def instance(fn: FunctionState) -> int:
    """XRT's device instance for a function: ``domain << 16 | bus << 8 | devfn``."""
    a = fn.address
    return (a.domain << 16) | (a.bus << 8) | (a.device << 3) | a.function


def _render_xilinx(state: LabState, dev: DeviceState, model: XilinxFpgaModel) -> Spec:
    spec: Spec = {}
    mgmt, user = dev.functions
    fallen = FALLEN_OFF_BUS in dev.faults
    inst = instance(mgmt)
    pci.render_function(
        spec, _function(state, dev, mgmt, model.mgmt, model.mgmt_bars, mgmt_pf="", instance=str(inst))
    )
    pci.render_function(
        spec,
        _function(state, dev, user, model.user, model.user_bars, user_pf="", instance=str(instance(user))),
    )
    if fallen:
        return spec
    add_node(
        spec, at=f"dev/xclmgmt{inst}", major=majors.XCLMGMT, minor=inst, sys_target=mgmt.path, mode=0o600
    )
    uinst = instance(user)
    if ROM_MISSING not in dev.faults:
        rom = f"{user.path}/rom.u.{uinst}"
        spec[rom] = Dir()
        spec[f"{rom}/VBNV"] = text(dev.shell or model.vbnv)
        spec[f"{rom}/timestamp"] = text(model.timestamp)
        spec[f"{rom}/FPGA"] = text("xcu250-figd2104-2L-e")
        spec[f"{rom}/ddr_bank_count_max"] = text(4)
    spec[f"{user.path}/xmc.u.{uinst}/serial_num"] = text(f"XFL1{uinst:08X}")
    assert dev.card is not None
    render_drm(spec, user.path, user.bdf, dev.card)
    return spec


def render(state: LabState, dev: DeviceState) -> Spec:
    """Render one FPGA card."""
    model = catalog.FPGAS[dev.model]
    if isinstance(model, XilinxFpgaModel):
        return _render_xilinx(state, dev, model)
    return _render_dfl(state, dev, model)


PLATFORM_DRIVERS = {"dfl-fme": "dfl_fme", "dfl-port": "dfl_afu"}
"""DFL feature drivers on the platform bus -> their modules."""


class _FpgaKind:
    """FPGA cards: a DFL function, or a Xilinx-like management/user PF pair."""

    owns: tuple[str, ...] = (DeviceKind.FPGA,)
    section: str | None = "fpgas"
    prefix = "fpga"

    def ports(self, group: Any) -> int:
        return 1

    def buses(self, group: Any) -> int:
        return 1

    def place(
        self,
        placer: kinds.Placer,
        names: list[str],
        group: Any,
        *,
        node: int,
        parent: str,
        bus: int,
        switch: str | None,
    ) -> None:
        model = catalog.FPGAS[group.model]
        if isinstance(model, XilinxFpgaModel):
            functions = [
                placer.function(parent, Bdf.on_bus(bus, 0, 0), "mgmt", "xclmgmt"),
                placer.function(parent, Bdf.on_bus(bus, 0, 1), "user", "xocl"),
            ]
        else:
            functions = [placer.function(parent, Bdf.on_bus(bus, 0, 0), "fpga", "dfl-pci")]
        dev = DeviceState(
            name=names[0],
            kind=DeviceKind.FPGA,
            model=model.key,
            numa_node=node,
            switch=switch,
            functions=functions,
        )
        if isinstance(model, XilinxFpgaModel):
            dev.shell = group.shell or model.vbnv
        else:
            dev.afu_id = group.afu_id or model.afu_id
            dev.interface_id = group.interface_id or model.interface_id
        placer.add(dev)

    def number(self, state: LabState, dev: DeviceState, counters: dict[str, int]) -> None:
        dev.fpga_index = counters.get("fpga", 0)
        counters["fpga"] = dev.fpga_index + 1
        if catalog.FPGAS[dev.model].flavor == "xilinx":
            dev.card = counters.get("drm", 0)
            counters["drm"] = dev.card + 1

    def finish(self, state: LabState, dev: DeviceState) -> None:
        return

    def render(self, state: LabState, dev: DeviceState) -> Spec:
        return render(state, dev)

    def family(self, state: LabState, dev: DeviceState) -> list[str]:
        return [dev.name]

    def identity(self, dev: DeviceState) -> pci.Identity:
        model = catalog.FPGAS[dev.model]
        return model.user if isinstance(model, XilinxFpgaModel) else model.identity

    def faults(self, dev: DeviceState) -> tuple[str, ...]:
        flavor = catalog.FPGAS[dev.model].flavor
        return (FALLEN_OFF_BUS, AFU_ID_INVALID if flavor == "dfl" else ROM_MISSING, pci.LINK_DEGRADED)

    def shared(self, state: LabState, devices: list[DeviceState]) -> kinds.Shared:
        out = kinds.Shared()
        flavors = {catalog.FPGAS[d.model].flavor for d in devices}
        if "dfl" in flavors:
            out.majors |= {majors.DFL_FME, majors.DFL_PORT}
            out.spec["sys/class/fpga_region"] = Dir()
            for driver, module in PLATFORM_DRIVERS.items():
                driver_dir(out.spec, "platform", driver, module)
        if "xilinx" in flavors:
            out.majors.add(majors.XCLMGMT)
            drm_shared(out)
        return out


KIND: Final = _FpgaKind()
"""What the registry finds under ``fpga`` (:data:`.kinds.BUILTIN`)."""
