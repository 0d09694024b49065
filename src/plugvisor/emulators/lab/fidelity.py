"""A reader's-eye check of a lab tree: what real plugins would trip over.

The checks are the fidelity checklist of the hardware notes, run against the
files rather than against the lab's intentions, so they also catch a renderer
that drifted from the state: every link relative and resolving inside the root,
``modalias`` agreeing with the ID attributes, ``virtfn``/``physfn`` pairing up
and matching ``sriov_numvfs``, ``driver`` and ``iommu_group`` links answered by
their back-links, and every device node matched by ``sys/dev/char`` and
``dev/char`` entries with the same numbers (and the same ``st_rdev`` for real
nodes), RDMA devices, ports and verbs nodes that agree, NUMA ``meminfo`` and CPU links
in kernel form, a CPU tree whose masks and lists agree, and PCI ``resource``/``local_cpus``
that agree with their siblings. Tests assert an empty report; a person can run ``plugvisor lab check``.
"""

# Paths here are strings joined to a root, as a plugin with a host-root prefix handles them.
# ruff: noqa: PTH110, PTH112, PTH114, PTH115, PTH116, PTH117, PTH118, PTH119, PTH120, PTH123, PTH207

from __future__ import annotations

import glob
import os
import re
import stat


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read().strip()


def _modalias(dev: str) -> str:
    vendor, device = int(_read(f"{dev}/vendor"), 16), int(_read(f"{dev}/device"), 16)
    sv, sd = int(_read(f"{dev}/subsystem_vendor"), 16), int(_read(f"{dev}/subsystem_device"), 16)
    cls = int(_read(f"{dev}/class"), 16)
    return (
        f"pci:v{vendor:08X}d{device:08X}sv{sv:08X}sd{sd:08X}"
        f"bc{cls >> 16:02X}sc{(cls >> 8) & 0xFF:02X}i{cls & 0xFF:02X}"
    )


def _links(root: str) -> list[str]:
    problems = []
    for top in ("sys", "dev", "proc"):
        for base, dirs, files in os.walk(os.path.join(root, top)):
            for name in dirs + files:
                path = os.path.join(base, name)
                if not os.path.islink(path):
                    continue
                target = os.readlink(path)
                rel = os.path.relpath(path, root)
                if os.path.isabs(target):
                    problems.append(f"{rel}: link target {target!r} is absolute")
                    continue
                resolved = os.path.realpath(path)
                if not resolved.startswith(root + "/"):
                    problems.append(f"{rel}: link resolves outside the root ({resolved})")
                elif not os.path.exists(resolved):
                    problems.append(f"{rel}: link {target!r} dangles")
    return problems


def _pci(root: str) -> list[str]:
    problems = []
    for entry in sorted(glob.glob(f"{root}/sys/bus/pci/devices/*")):
        bdf = os.path.basename(entry)
        dev = os.path.realpath(entry)
        if os.path.basename(dev) != bdf:
            problems.append(f"{bdf}: sys/bus/pci/devices entry points at {dev}")
            continue
        if _read(f"{dev}/modalias") != _modalias(dev):
            problems.append(f"{bdf}: modalias {_read(f'{dev}/modalias')} disagrees with the ID attributes")
        if int(_read(f"{dev}/numa_node")) < -1:
            problems.append(f"{bdf}: numa_node is not a node number")
        if os.path.islink(f"{dev}/driver"):
            drv = os.path.realpath(f"{dev}/driver")
            if os.path.realpath(f"{drv}/{bdf}") != dev:
                problems.append(f"{bdf}: driver {os.path.basename(drv)} has no link back to the device")
        if os.path.islink(f"{dev}/iommu_group"):
            group = os.path.realpath(f"{dev}/iommu_group")
            if os.path.realpath(f"{group}/devices/{bdf}") != dev:
                problems.append(f"{bdf}: iommu group {os.path.basename(group)} does not list the device")
        problems += _sriov(bdf, dev)
        problems += _attributes(bdf, dev)
    return problems


_RESOURCE_LINE = re.compile(r"^0x[0-9a-f]{16} 0x[0-9a-f]{16} 0x[0-9a-f]{16}$")
_PORT_STATE = re.compile(r"^[0-5]: (NOP|DOWN|INIT|ARMED|ACTIVE|ACTIVE_DEFER)$")
_GID = re.compile(r"^[0-9a-f]{4}(:[0-9a-f]{4}){7}$")
_MEMINFO = re.compile(r"^Node (\d+) ([A-Za-z_()]+):\s+(\d+)( kB)?$")


def _cpus(cpulist: str) -> set[int]:
    cpus: set[int] = set()
    for part in filter(None, cpulist.split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _mask_cpus(mask: str) -> set[int]:
    value = int(mask.replace(",", ""), 16)
    return {i for i in range(value.bit_length()) if value >> i & 1}


def _attributes(bdf: str, dev: str) -> list[str]:
    """``resource`` lines and ``resourceN`` sizes agree; ``local_cpus`` is ``local_cpulist`` as a mask."""
    problems = []
    if os.path.exists(f"{dev}/resource"):
        lines = _read(f"{dev}/resource").splitlines()
        bridge = os.path.exists(f"{dev}/secondary_bus_number")
        if len(lines) != (17 if bridge else 13) or not all(_RESOURCE_LINE.match(x) for x in lines):
            problems.append(f"{bdf}: resource is not {17 if bridge else 13} lines of three 0x%016llx fields")
        for path in glob.glob(f"{dev}/resource[0-9]"):
            if not int(lines[int(path[-1])].split()[2], 16):
                problems.append(f"{bdf}: {os.path.basename(path)} exists but its resource line is empty")
    if os.path.exists(f"{dev}/local_cpus") and _mask_cpus(_read(f"{dev}/local_cpus")) != _cpus(
        _read(f"{dev}/local_cpulist")
    ):
        problems.append(f"{bdf}: local_cpus and local_cpulist name different CPUs")
    return problems


def _rdma(root: str) -> list[str]:
    """IB devices hang off a PCI function, ports and GIDs read in kernel format, verbs nodes name them."""
    problems = []
    for link in sorted(glob.glob(f"{root}/sys/class/infiniband/*")):
        name = os.path.basename(link)
        ib = os.path.realpath(link)
        if not os.path.islink(link) or os.path.basename(os.path.dirname(ib)) != "infiniband":
            problems.append(f"sys/class/infiniband/{name}: not a link to <pci function>/infiniband/{name}")
            continue
        for port in glob.glob(f"{ib}/ports/*"):
            if not _PORT_STATE.match(_read(f"{port}/state")):
                problems.append(f"{name}: port {os.path.basename(port)} state {_read(f'{port}/state')!r}")
            for gid in glob.glob(f"{port}/gids/*"):
                if not _GID.match(_read(gid)):
                    problems.append(f"{name}: gid {os.path.basename(gid)} is not eight 4-digit groups")
    verbs = sorted(glob.glob(f"{root}/sys/class/infiniband_verbs/uverbs*"))
    for link in verbs:
        uverbs = os.path.realpath(link)
        ibdev = _read(f"{uverbs}/ibdev")
        fn = os.path.dirname(os.path.dirname(uverbs))
        if not os.path.isdir(f"{fn}/infiniband/{ibdev}"):
            problems.append(
                f"{os.path.basename(link)}: ibdev {ibdev} is not an IB device of its PCI function"
            )
        if not os.path.exists(f"{root}/dev/infiniband/{os.path.basename(link)}"):
            problems.append(f"{os.path.basename(link)}: no dev/infiniband/{os.path.basename(link)}")
    if verbs and not os.path.exists(f"{root}/dev/infiniband/rdma_cm"):
        problems.append("dev/infiniband/rdma_cm is missing while verbs devices exist")
    return problems


def _numa(root: str) -> list[str]:
    """Each node's ``meminfo`` parses as the kernel prints it and its ``cpuM`` links match ``cpulist``."""
    problems = []
    for node in sorted(glob.glob(f"{root}/sys/devices/system/node/node[0-9]*")):
        n = int(os.path.basename(node)[4:])
        if not os.path.exists(f"{node}/meminfo"):
            problems.append(f"node{n}: no meminfo")
            continue
        keys = {}
        for line in _read(f"{node}/meminfo").splitlines():
            m = _MEMINFO.match(line)
            if m is None or int(m.group(1)) != n:
                problems.append(f"node{n}/meminfo: line {line!r} is not 'Node {n} Key: value'")
                continue
            keys[m.group(2)] = int(m.group(3))
        if keys.get("MemTotal", 0) <= 0 or keys.get("MemFree", -1) > keys.get("MemTotal", 0):
            problems.append(f"node{n}/meminfo: MemTotal/MemFree missing or inconsistent")
        linked = {int(os.path.basename(c)[3:]) for c in glob.glob(f"{node}/cpu[0-9]*")}
        if linked != _cpus(_read(f"{node}/cpulist")):
            problems.append(f"node{n}: cpuM links disagree with cpulist")
        for pages in glob.glob(f"{node}/hugepages/hugepages-*kB/*_hugepages"):
            if not _read(pages).isdigit():
                problems.append(f"{os.path.relpath(pages, root)}: not a page count")
    return problems


def _sriov(bdf: str, dev: str) -> list[str]:
    problems = []
    if os.path.exists(f"{dev}/sriov_numvfs"):
        virtfns = glob.glob(f"{dev}/virtfn*")
        if len(virtfns) != int(_read(f"{dev}/sriov_numvfs")):
            problems.append(
                f"{bdf}: {len(virtfns)} virtfn links but sriov_numvfs is {_read(f'{dev}/sriov_numvfs')}"
            )
        for link in virtfns:
            if os.path.realpath(f"{link}/physfn") != dev:
                problems.append(f"{bdf}: {os.path.basename(link)} has no physfn pointing back")
    if os.path.islink(f"{dev}/physfn"):
        pf = os.path.realpath(f"{dev}/physfn")
        if not any(os.path.realpath(v) == dev for v in glob.glob(f"{pf}/virtfn*")):
            problems.append(f"{bdf}: its PF {os.path.basename(pf)} has no virtfn link to it")
    return problems


def _nodes(root: str) -> list[str]:
    problems = []
    for link in sorted(glob.glob(f"{root}/sys/dev/char/*")):
        numbers = os.path.basename(link)
        major, minor = (int(x) for x in numbers.split(":"))
        if not os.path.exists(f"{root}/dev/char/{numbers}"):
            problems.append(f"sys/dev/char/{numbers}: no dev/char/{numbers} link to a device node")
            continue
        node = os.path.realpath(f"{root}/dev/char/{numbers}")
        info = os.stat(node)
        if stat.S_ISCHR(info.st_mode) and (os.major(info.st_rdev), os.minor(info.st_rdev)) != (major, minor):
            problems.append(f"{os.path.relpath(node, root)}: rdev disagrees with sys/dev/char/{numbers}")
        target = os.path.realpath(link)
        if os.path.exists(f"{target}/dev") and _read(f"{target}/dev") != numbers:
            problems.append(f"sys/dev/char/{numbers}: its device says dev={_read(f'{target}/dev')}")
    for base, _, files in os.walk(f"{root}/dev"):
        if base.startswith(f"{root}/dev/char") or "by-path" in base:
            continue
        if base.startswith(f"{root}/dev/nvidia-caps"):
            continue  # made by nvidia-modprobe for a cdev region with no sysfs device: no dev/char link
        for name in files:
            path = os.path.join(base, name)
            if os.path.islink(path):
                continue
            if not any(os.path.realpath(c) == path for c in glob.glob(f"{root}/dev/char/*")):
                problems.append(f"{os.path.relpath(path, root)}: device node without a dev/char link")
    return problems


_PAIRS = ("core_cpus", "thread_siblings", "cluster_cpus", "die_cpus", "package_cpus", "core_siblings")
"""Topology attributes the kernel prints twice: as a mask and as a ``_list``."""


def _cpu_tree(root: str) -> list[str]:
    """The CPU tree hwloc and lscpu read is whole and agrees with itself.

    ``online`` names the ``cpuN`` directories, each has the topology mask files (without them
    hwloc describes the host instead), masks and lists agree, and each cache's size is its sets
    times ways times line size.
    """
    base = f"{root}/sys/devices/system/cpu"
    if not os.path.isdir(base):
        return []
    problems = []
    present = {int(os.path.basename(c)[3:]) for c in glob.glob(f"{base}/cpu[0-9]*")}
    if os.path.exists(f"{base}/online") and _cpus(_read(f"{base}/online")) != present:
        problems.append("sys/devices/system/cpu/online disagrees with the cpuN directories")
    for cpu in sorted(present):
        topology = f"{base}/cpu{cpu}/topology"
        if not os.path.exists(f"{topology}/package_cpus") and not os.path.exists(f"{topology}/core_cpus"):
            problems.append(f"cpu{cpu}: no topology/package_cpus or core_cpus mask")
        for name in _PAIRS:
            mask, cpus = f"{topology}/{name}", f"{topology}/{name}_list"
            if os.path.exists(mask) and _mask_cpus(_read(mask)) != _cpus(_read(cpus)):
                problems.append(f"cpu{cpu}: topology/{name} and {name}_list name different CPUs")
        for index in sorted(glob.glob(f"{base}/cpu{cpu}/cache/index[0-9]*")):
            where = f"cpu{cpu}/cache/{os.path.basename(index)}"
            if _mask_cpus(_read(f"{index}/shared_cpu_map")) != _cpus(_read(f"{index}/shared_cpu_list")):
                problems.append(f"{where}: shared_cpu_map and shared_cpu_list name different CPUs")
            size = _read(f"{index}/size")
            product = 1
            for name in ("number_of_sets", "ways_of_associativity", "coherency_line_size"):
                product *= int(_read(f"{index}/{name}"))
            if not size.endswith("K") or int(size[:-1]) * 1024 != product:
                problems.append(f"{where}: size {size!r} is not sets x ways x line size ({product} bytes)")
    return problems


def problems(root: str | os.PathLike[str]) -> list[str]:
    """Return every way the tree under ``root`` would mislead a real reader (empty when faithful)."""
    real = os.path.realpath(root)
    return _links(real) + _pci(real) + _nodes(real) + _rdma(real) + _numa(real) + _cpu_tree(real)
