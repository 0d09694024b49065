"""Hardware profiles: what a lab contains, as YAML, validated before anything is written.

A profile says *what* hardware a node has (models, counts, NUMA placement, PCIe
switches, VF counts); :mod:`~plugvisor.emulators.lab.layout` decides *where* it
sits on the PCI bus. Unknown keys are errors, and every error names the file,
the field (as spelled in the YAML) and what was expected, so a typo never turns
into a silently different lab.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import pydantic
import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from plugvisor.common.validation import known_keys, problem, unknown_key
from plugvisor.common.yamlfile import YamlFileError, read_yaml
from plugvisor.emulators.lab import catalog, errors, kinds, majors

_HEX32 = r"^[0-9a-f]{32}$"


def _known(table: dict[str, Any], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if value not in table:
            raise ValueError(f"unknown {what} model {value!r}; expected one of: {', '.join(table)}")
        return value

    return AfterValidator(check)


MAX_PCI_FUNCTIONS: Final = 8192
"""A lab's PCI functions in all, twice the big profile's: each group's ``count`` is bounded, but a
profile of many groups is not, and 16,384 GPUs take minutes and gigabytes to write."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class Placement(_Strict):
    """Where a group of devices sits: NUMA nodes and PCIe switches."""

    count: Annotated[int, Field(ge=1, le=4096)]
    numa_nodes: list[Annotated[int, Field(ge=0)]] | None = None
    """NUMA nodes to spread the group over, in contiguous blocks; default: all of them."""
    per_switch: Annotated[int, Field(ge=0, le=16)] = 0
    """Devices behind one PCIe switch; 0 puts each on its own root port."""


_BDF = r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$"
_GPU_UUID = r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"


class GpuDevice(_Strict):
    """Facts a profile fixes for one GPU of a group, as a real node's capture shows them."""

    pci_address: Annotated[str, Field(pattern=_BDF)] | None = None
    """Where the GPU sits, directly on the host bridge's root bus with no root port above it (as a
    GPU passed through to a VM does): ``0000:00:06.0``, lower-case hex. Only on bus 0000:00."""
    uuid: Annotated[str, Field(pattern=_GPU_UUID)] | None = None
    """NVIDIA GPUs: the ``GPU-`` UUID (lower-case hex), instead of one derived from the address."""
    irq: Annotated[int, Field(ge=1, le=1023)] | None = None
    """The interrupt line the driver reports (``information``'s ``IRQ:``, sysfs ``irq``)."""


class GpuGroup(Placement):
    """GPUs of one model."""

    model: Annotated[str, _known(catalog.GPUS, "GPU")]
    aer: bool = True
    """False: the functions have no AER capability, so no ``aer_dev_*`` files (a VM's passed-through GPU)."""
    devices: list[GpuDevice] = []
    """Per-GPU facts, in order (at most ``count``); GPUs beyond the list get the lab's own."""


class FpgaGroup(Placement):
    """FPGA cards of one model."""

    model: Annotated[str, _known(catalog.FPGAS, "FPGA")]
    afu_id: Annotated[str, Field(pattern=_HEX32)] | None = None
    """The accelerator function loaded in each port (DFL cards), 32 lower-case hex digits."""
    interface_id: Annotated[str, Field(pattern=_HEX32)] | None = None
    shell: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    """The shell name (``VBNV``) of Xilinx-like cards."""


class NicGroup(Placement):
    """SR-IOV NIC physical functions of one model (``count`` counts PFs, i.e. ports)."""

    model: Annotated[str, _known(catalog.NICS, "NIC")]
    ports_per_card: Annotated[int, Field(ge=1, le=8)] = 1
    total_vfs: Annotated[int, Field(ge=0)] | None = None
    """``sriov_totalvfs`` of each PF; default and maximum: the model's limit."""
    num_vfs: Annotated[int, Field(ge=0)] = 0
    """VFs created at start (``sriov_numvfs``)."""
    vf_driver: Literal["default", "vfio-pci"] = "default"
    """``default`` binds VFs to the model's VF netdev driver; ``vfio-pci`` hands them to userspace."""


_NODE_PATH = r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*(/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*$"
_LAB_OWNED_DEV = ("char/", "dri/", "vfio/", "nvidia", "kfd", "dfl-", "xclmgmt", "infiniband/")
"""``dev/`` names the lab's own devices write; a declared node may not take one."""


class DeviceNodeSpec(_Strict):
    """A plain character device node, for the ``generic`` kind: ``/dev/fuse``, ``/dev/ttyUSB0``...

    The lab writes it as the kernel's devtmpfs and sysfs show such a node: ``dev/<path>`` (a real
    node with ``--mknod``), ``sys/devices/virtual/<subsystem>/<name>`` with ``dev`` and ``uevent``,
    and the ``sys/dev/char`` and ``dev/char`` links.
    """

    path: Annotated[str, Field(pattern=_NODE_PATH, max_length=200)]
    """Relative to ``dev/``: ``fuse``, ``net/tun``."""
    major: Annotated[int, Field(ge=1, le=4095)]
    minor: Annotated[int, Field(ge=0, le=(1 << 20) - 1)]
    subsystem: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]*$", max_length=32)] = "misc"
    """The class the kernel files it under (``misc`` for fuse and tun, ``tty`` for serial ports)."""


class HugePages(_Strict):
    """Huge pages reserved on each NUMA node, by page size (as ``hugepages-<size>kB`` names them)."""

    pages_2m: Annotated[int, Field(ge=0, alias="2048kB")] = 0
    pages_1g: Annotated[int, Field(ge=0, alias="1048576kB")] = 0

    def sizes(self) -> dict[int, int]:
        """Page size in kB -> pages."""
        return {2048: self.pages_2m, 1048576: self.pages_1g}


class Profile(_Strict):
    """A whole lab.

    Keys beyond these are the sections of lab kinds from other packages
    (``npus:``); :func:`parse_profile` validates each with its kind's group model
    and refuses any other key.
    """

    model_config = ConfigDict(extra="allow", alias_generator=to_camel, populate_by_name=True, frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9._-]*$")]
    description: str = ""
    numa_nodes: Annotated[int, Field(ge=1, le=8)] = 1
    cpus_per_numa_node: Annotated[int, Field(ge=1, le=1024)] = 16
    memory_per_numa_node_gib: Annotated[int, Field(ge=1, le=65536, alias="memoryPerNumaNodeGiB")] = 64
    hugepages_per_numa_node: HugePages = Field(default_factory=HugePages)
    gpus: list[GpuGroup] = []
    fpgas: list[FpgaGroup] = []
    nics: list[NicGroup] = []
    device_nodes: list[DeviceNodeSpec] = []
    """Plain device nodes besides the PCI devices, for the ``generic`` kind."""
    numa_information: bool = True
    """False: the firmware describes no NUMA (a VM without ACPI SRAT): every PCI function's
    ``numa_node`` reads -1 and its ``local_cpulist`` is every CPU. Needs ``numaNodes: 1``."""
    iommu_groups: bool = True
    """False: the node has no IOMMU, so no ``iommu_group`` links (a VM without a vIOMMU)."""
    nvidia_driver_version: Annotated[str, Field(pattern=r"^[0-9]{3}\.[0-9]{2,3}(\.[0-9]{2})?$")] = "550.54.15"
    """The NVIDIA driver's version (``/sys/module/nvidia/version``, procfs, NVML)."""
    nvidia_kernel_module: Literal["open", "proprietary"] = "proprietary"
    """Which NVIDIA kernel module is loaded: its wording in ``/proc/driver/nvidia/version``."""
    nvidia_modeset: bool = True
    """Whether ``nvidia-modeset`` is loaded (``/dev/nvidia-modeset``); compute-only nodes often lack it."""
    driver_root: Annotated[str, Field(pattern=r"^/([A-Za-z0-9_.+-]+(/[A-Za-z0-9_.+-]+)*)?$")] = "/"
    """Where NVIDIA's user-space driver files live (libraries, ``nvidia-smi``), as the gpu
    resource's ``driverRoot`` option names it: ``/`` puts them in the distribution's places."""


def _field_name(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _cross_checks(profile: Profile) -> list[tuple[str, str]]:
    """Return the problems pydantic cannot see field by field."""
    problems: list[tuple[str, str]] = []
    groups = [(kind.section or "", kinds.groups(profile, kind)) for kind in kinds.placing()]
    for section, items in groups:
        for i, group in enumerate(items):
            for node in group.numa_nodes or ():
                if node >= profile.numa_nodes:
                    problems.append(
                        (
                            f"{section}[{i}].numaNodes",
                            f"NUMA node {node} does not exist; expected 0..{profile.numa_nodes - 1}",
                        )
                    )
            if group.numa_nodes == []:
                problems.append((f"{section}[{i}].numaNodes", "expected at least one NUMA node"))
    problems += _model_checks(profile)
    problems += _gpu_checks(profile)
    reserved = sum(size * pages for size, pages in profile.hugepages_per_numa_node.sizes().items())
    if reserved > profile.memory_per_numa_node_gib * 2**20:
        problems.append(
            (
                "hugepagesPerNumaNode",
                f"{reserved // 2**20} GiB of huge pages do not fit in memoryPerNumaNodeGiB "
                f"({profile.memory_per_numa_node_gib})",
            )
        )
    problems += _node_checks(profile)
    total = sum(g.count for _, items in groups for g in items) + len(profile.device_nodes)
    functions = sum(
        g.count * (1 + (g.num_vfs if isinstance(g, NicGroup) else 0)) for _, items in groups for g in items
    )
    if functions > MAX_PCI_FUNCTIONS:
        problems.append(
            (
                "",
                f"the profile makes {functions} PCI functions (devices, NIC ports and their VFs); at most "
                f"{MAX_PCI_FUNCTIONS} in all",
            )
        )
    if total == 0:
        sections = ", ".join(section for section, _ in groups)
        problems.append(
            ("", f"the profile has no devices; expected at least one of {sections} or deviceNodes")
        )
    return problems


def _node_checks(profile: Profile) -> list[tuple[str, str]]:
    """Return the declared device nodes that would clash with each other or with the lab's own."""
    problems: list[tuple[str, str]] = []
    paths: dict[str, int] = {}
    numbers: dict[tuple[int, int], int] = {}
    sysfs: dict[tuple[str, str], int] = {}
    for i, node in enumerate(profile.device_nodes):
        where = f"deviceNodes[{i}]"
        entry = (node.subsystem, node.path.rsplit("/", 1)[-1])
        if entry in sysfs:
            problems.append(
                (
                    f"{where}.path",
                    f"sys/class/{'/'.join(entry)} is already declared by deviceNodes[{sysfs[entry]}]",
                )
            )
        sysfs.setdefault(entry, i)
        if node.path in paths:
            problems.append(
                (f"{where}.path", f"{node.path!r} is already declared by deviceNodes[{paths[node.path]}]")
            )
        paths.setdefault(node.path, i)
        if node.path.startswith(_LAB_OWNED_DEV):
            problems.append(
                (
                    f"{where}.path",
                    f"{node.path!r} is where the lab writes its own devices' nodes; choose another",
                )
            )
        number = (node.major, node.minor)
        if number in numbers:
            problems.append(
                (where, f"{node.major}:{node.minor} is already used by deviceNodes[{numbers[number]}]")
            )
        numbers.setdefault(number, i)
        if node.major in majors.NAMES and node.major != majors.MISC:
            problems.append(
                (f"{where}.major", f"{node.major} belongs to the lab's {majors.NAMES[node.major]} devices")
            )
        if number == (majors.MISC, majors.VFIO_CONTAINER_MINOR):
            problems.append((where, "10:196 is /dev/vfio/vfio, which the lab writes itself"))
        nic_nodes = {
            "net/tun": majors.TUN_MINOR,
            "vhost-net": majors.VHOST_NET_MINOR,
            "": majors.RDMA_CM_MINOR,
        }
        if profile.nics and (
            node.path in nic_nodes or number in {(majors.MISC, m) for m in nic_nodes.values()}
        ):
            problems.append(
                (
                    where,
                    "/dev/net/tun, /dev/vhost-net and rdma_cm (misc 200, 238, 58) come with the NICs",
                )
            )
    return problems


def _fixed_device_checks(profile: Profile) -> list[tuple[str, str]]:
    """Return the problems of the facts GPU groups fix per device (``devices[]``)."""
    problems: list[tuple[str, str]] = []
    seen: dict[tuple[str, str], str] = {}
    for i, group in enumerate(profile.gpus):
        if len(group.devices) > group.count:
            problems.append(
                (
                    f"gpus[{i}].devices",
                    f"{len(group.devices)} entries for count {group.count}; expected at most {group.count}",
                )
            )
        for k, fixed in enumerate(group.devices):
            where = f"gpus[{i}].devices[{k}]"
            address, ident = fixed.pci_address, fixed.uuid
            if address is not None and (not address.startswith("0000:00:") or address[8:10] == "00"):
                problems.append(
                    (
                        f"{where}.pciAddress",
                        f"{address!r} is not on the root bus; expected 0000:00:<01-1f>.<0-7>",
                    )
                )
            if address is not None and group.per_switch:
                problems.append(
                    (f"{where}.pciAddress", "a GPU on the root bus cannot sit behind a switch (perSwitch)")
                )
            if ident is not None and catalog.GPUS[group.model].flavor != "nvidia":
                problems.append((f"{where}.uuid", f"a GPU UUID applies to NVIDIA GPUs, not {group.model}"))
            for key, value in (("pciAddress", address), ("uuid", ident)):
                if value is not None and (key, value) in seen:
                    problems.append((f"{where}.{key}", f"{value} is already {seen[key, value]}'s"))
                if value is not None:
                    seen.setdefault((key, value), where)
    return problems


def _gpu_checks(profile: Profile) -> list[tuple[str, str]]:
    """Return the problems of the GPU groups' fixed facts and the node-wide GPU options."""
    problems = _fixed_device_checks(profile)
    fixed_groups = [i for i, g in enumerate(profile.gpus) if any(d.pci_address for d in g.devices)]
    for i in fixed_groups:
        group = profile.gpus[i]
        if any(d.pci_address is None for d in group.devices) or len(group.devices) != group.count:
            problems.append(
                (
                    f"gpus[{i}].devices",
                    "give every GPU of a group a pciAddress, or none; expected one per count",
                )
            )
    if not profile.numa_information and profile.numa_nodes != 1:
        problems.append(
            (
                "numaInformation",
                f"false needs numaNodes: 1 (a node without NUMA information), got {profile.numa_nodes}",
            )
        )
    if not profile.iommu_groups and profile.nics:
        problems.append(
            ("iommuGroups", "false leaves SR-IOV NICs without IOMMU groups; expected true with nics")
        )
    nvidia = any(catalog.GPUS[g.model].flavor == "nvidia" for g in profile.gpus)
    for key, value, default in (
        ("nvidiaDriverVersion", profile.nvidia_driver_version, "550.54.15"),
        ("nvidiaKernelModule", profile.nvidia_kernel_module, "proprietary"),
        ("driverRoot", profile.driver_root, "/"),
    ):
        if value != default and not nvidia:
            problems.append((key, "applies to a node with NVIDIA GPUs; the profile has none"))
    return problems


def _model_checks(profile: Profile) -> list[tuple[str, str]]:
    """Return the problems of options that depend on the chosen model."""
    problems: list[tuple[str, str]] = []
    for i, fpga in enumerate(profile.fpgas):
        flavor = catalog.FPGAS[fpga.model].flavor
        if flavor == "xilinx" and (fpga.afu_id or fpga.interface_id):
            problems.append((f"fpgas[{i}]", f"afuId/interfaceId apply to DFL cards, not {fpga.model}"))
        if flavor == "dfl" and fpga.shell:
            problems.append((f"fpgas[{i}].shell", f"shell applies to Xilinx-like cards, not {fpga.model}"))
    for i, nic in enumerate(profile.nics):
        limit = catalog.NICS[nic.model].max_vfs
        total = limit if nic.total_vfs is None else nic.total_vfs
        if total > limit:
            problems.append((f"nics[{i}].totalVfs", f"{total} is more than {nic.model} supports ({limit})"))
        if nic.num_vfs > total:
            problems.append((f"nics[{i}].numVfs", f"{nic.num_vfs} is more than totalVfs ({total})"))
        if nic.count % nic.ports_per_card:
            problems.append(
                (
                    f"nics[{i}].count",
                    f"{nic.count} PFs do not fill cards of portsPerCard={nic.ports_per_card}",
                )
            )
    return problems


def _problems(
    exc: pydantic.ValidationError, model: Any, within: tuple[str, ...] = ()
) -> list[tuple[str, str]]:
    problems = []
    for err in exc.errors():
        detail = problem(err, model)
        if err["type"] == "literal_error":
            detail = f"{detail}, got {err['input']!r}"
        problems.append((_field_name((*within, *err["loc"])), detail))
    return problems


def _outside_sections(profile: Profile) -> list[tuple[str, str]]:
    """Check the keys no built-in field has: each must be an installed lab kind's section, and valid."""
    by_section = kinds.by_section()
    problems: list[tuple[str, str]] = []
    for key, value in (profile.model_extra or {}).items():
        kind = by_section.get(key)
        if not isinstance(kind, kinds.OutsideKind):
            detail = unknown_key(key, [*known_keys(Profile, ()), *by_section])
            broken = kinds.broken()
            if broken:
                detail += "; lab kinds that failed to load: " + "; ".join(
                    f"{k} ({v})" for k, v in broken.items()
                )
            problems.append((key, detail))
            continue
        try:
            groups = kind.kind.parse_groups(value)
        except pydantic.ValidationError as exc:
            problems += _problems(exc, list[kind.kind.group_model], (key,))  # type: ignore[name-defined]
            continue
        for i, group in enumerate(groups):
            if group.model not in kind.kind.models:
                expected = ", ".join(kind.kind.models)
                problems.append(
                    (
                        f"{key}[{i}].model",
                        f"unknown {kind.kind.name} model {group.model!r}; expected one of: {expected}",
                    )
                )
    return problems


def parse_profile(data: object, *, source: str) -> Profile:
    """Validate already-parsed YAML; raise :class:`~.errors.ProfileError` naming every bad field."""
    if not isinstance(data, dict):
        raise errors.ProfileError(source, [("", f"expected a mapping at the top, got {type(data).__name__}")])
    try:
        profile = Profile.model_validate(data)
    except pydantic.ValidationError as exc:
        raise errors.ProfileError(source, _problems(exc, Profile)) from None
    problems = _outside_sections(profile)
    if problems:
        raise errors.ProfileError(source, problems)
    problems = _cross_checks(profile)
    if problems:
        raise errors.ProfileError(source, problems)
    return profile


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file."""
    source = str(path)
    try:
        # Strict and bounded: UTF-8, no repeated key, no FIFO or huge file (plugvisor.common.yamlfile).
        data = read_yaml(Path(path))
    except YamlFileError as exc:
        raise errors.ProfileError(source, [("", str(exc).removeprefix(f"{source}: "))]) from None
    return parse_profile(data, source=source)


def _read_builtins() -> dict[str, str]:
    folder = importlib.resources.files(__package__) / "profiles"
    return {
        p.name.removesuffix(".yaml"): p.read_text(encoding="utf-8")
        for p in sorted(folder.iterdir(), key=lambda p: p.name)
        if p.name.endswith(".yaml")
    }


_BUILTINS = _read_builtins()
"""Read once at import, so tests that fake the file system (pyfakefs) can still use them."""
BUILTIN_PROFILES: Final = tuple(_BUILTINS)
"""The names of plugvisor's own profiles (reserved: a lab kind from another package cannot take one)."""


def _named() -> dict[str, tuple[str, str]]:
    """Every named profile: name -> (where it comes from, YAML text); plugvisor's own first."""
    named = {name: ("built-in profile", text) for name, text in _BUILTINS.items()}
    named.update(kinds.outside_profiles())
    return named


def builtin_names() -> list[str]:
    """Return the names of the profiles shipped with plugvisor and with installed lab kinds."""
    return sorted(_named())


def builtin(name: str) -> Profile:
    """Return a named profile (shipped with plugvisor, or with an installed lab kind)."""
    named = _named()
    if name not in named:
        known = ", ".join(sorted(named))
        raise errors.UsageError(f"unknown profile {name!r}; expected a YAML file or one of: {known}")
    where, text = named[name]
    return parse_profile(yaml.safe_load(text), source=f"{where} {name}")


def resolve(name_or_path: str) -> Profile:
    """Return the profile a user named: a built-in name, or a path to a YAML file."""
    if name_or_path in builtin_names():
        return builtin(name_or_path)
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path or Path(name_or_path).exists():
        return load_profile(name_or_path)
    return builtin(name_or_path)
