"""The node's processors as ``drivers/base/cpu.c``, ``topology.c`` and ``cacheinfo.c`` show them.

Readers that place work and devices (hwloc, and through it MPI, Slurm and ROCm's device plugin;
``lscpu``; the kubelet's CPU manager through cAdvisor) build their picture of the machine from
``sys/devices/system/cpu``: the ``online``/``possible``/``present`` lists, each CPU's
``topology/`` (package, die, cluster and core ids, and the CPUs sharing each as a mask and as a
list) and ``cache/index<M>/``. hwloc refuses the whole tree, and
falls back to the machine it runs on, unless ``cpu0/topology/package_cpus`` or ``core_cpus``
(the mask files, not only the ``_list`` ones) exist.

The lab's processor is one model for every profile: a package per NUMA node (as on the
two-socket servers the profiles imitate), one thread per core (SMT off, so the NUMA nodes'
CPU numbering stays contiguous), private L1 and L2 caches and an L3 shared by the package.
The lab writes no ``/proc/cpuinfo``: its absence is how the lab tells its own ``proc/`` from a
real procfs before writing (:mod:`.tree`), and hwloc does without it (it names the packages'
CPU model from the processor it runs on instead).
"""

from __future__ import annotations

from dataclasses import dataclass

from plugvisor.emulators.lab import pci
from plugvisor.emulators.lab.spec import File, Spec, add_link, text

BASE = "sys/devices/system/cpu"
KERNEL_MAX = 8191
"""``kernel_max``: ``NR_CPUS - 1`` of a distribution kernel (``CONFIG_NR_CPUS=8192``)."""


@dataclass(frozen=True, slots=True)
class Cache:
    """One ``cache/index<M>`` of a CPU: what ``cacheinfo.c`` prints for it."""

    level: int
    type: str
    """``Data``, ``Instruction`` or ``Unified``."""
    size_kb: int
    ways: int
    shared: str
    """``core`` (private to the core) or ``package`` (shared by the package's cores)."""

    def sets(self, line: int) -> int:
        """``number_of_sets``: the size over ways times line size, as CPUID leaf 4 reports them."""
        return self.size_kb * 1024 // (self.ways * line)


LINE = 64
"""``coherency_line_size`` of every cache (bytes)."""
L3_PER_CORE_KB = 2048
"""The L3 grows with the package (2 MiB per core, about what current server parts have)."""


def caches(cores_per_package: int) -> tuple[Cache, ...]:
    """The cache hierarchy of one CPU, in ``index<M>`` order (L1d, L1i, L2, L3)."""
    return (
        Cache(1, "Data", 48, 12, "core"),
        Cache(1, "Instruction", 32, 8, "core"),
        Cache(2, "Unified", 2048, 16, "core"),
        Cache(3, "Unified", L3_PER_CORE_KB * cores_per_package, 16, "package"),
    )


def cpulist(cpus: range) -> str:
    """``%*pbl`` of a contiguous run of CPUs: ``N`` or ``first-last``."""
    return str(cpus.start) if len(cpus) == 1 else f"{cpus.start}-{cpus[-1]}"


def render(spec: Spec, packages: list[range]) -> None:
    """Write the CPU tree for ``packages`` (each the CPUs of one package, which is one NUMA node).

    Each CPU's ``nodeN`` link is the NUMA side's to write (it owns ``node/nodeN``). Files whose
    contents repeat (a package's mask, a ``0``) share one :class:`File` object: the tree writes
    the bytes, so sharing saves building them again for each CPU.
    """
    count = sum(len(p) for p in packages)
    everything = text(cpulist(range(count)))
    for name in ("online", "possible", "present"):
        spec[f"{BASE}/{name}"] = everything
    spec[f"{BASE}/offline"] = text("")
    spec[f"{BASE}/isolated"] = text("")
    spec[f"{BASE}/kernel_max"] = text(KERNEL_MAX)
    zero, online = text(0), File(b"1\n", 0o644)
    for package, cpus in enumerate(packages):
        pkg_list = text(cpulist(cpus))
        pkg_mask = text(pci.cpumask(cpulist(cpus), count))
        pkg_id = text(package)
        hierarchy = caches(len(cpus))
        for core, cpu in enumerate(cpus):
            c = f"{BASE}/cpu{cpu}"
            t = f"{c}/topology"
            own_list, own_mask = text(cpu), text(pci.cpumask(str(cpu), count))
            spec[f"{c}/online"] = online
            spec[f"{t}/physical_package_id"] = pkg_id
            spec[f"{t}/die_id"] = zero
            spec[f"{t}/cluster_id"] = text(cpu)
            spec[f"{t}/core_id"] = text(core)
            for name in ("core_cpus", "thread_siblings", "cluster_cpus"):
                spec[f"{t}/{name}"] = own_mask
                spec[f"{t}/{name}_list"] = own_list
            for name in ("package_cpus", "core_siblings", "die_cpus"):
                spec[f"{t}/{name}"] = pkg_mask
                spec[f"{t}/{name}_list"] = pkg_list
            for index, cache in enumerate(hierarchy):
                d = f"{c}/cache/index{index}"
                private = cache.shared == "core"
                spec[f"{d}/id"] = text(cpu) if private else pkg_id
                spec[f"{d}/level"] = text(cache.level)
                spec[f"{d}/type"] = text(cache.type)
                spec[f"{d}/size"] = text(f"{cache.size_kb}K")
                spec[f"{d}/coherency_line_size"] = text(LINE)
                spec[f"{d}/ways_of_associativity"] = text(cache.ways)
                spec[f"{d}/number_of_sets"] = text(cache.sets(LINE))
                spec[f"{d}/physical_line_partition"] = text(1)
                spec[f"{d}/shared_cpu_map"] = own_mask if private else pkg_mask
                spec[f"{d}/shared_cpu_list"] = own_list if private else pkg_list


def link_node(spec: Spec, cpu: int, node_dir: str, node: int) -> None:
    """Link ``cpu<cpu>/node<node>`` to its NUMA node's directory and back, as ``register_cpu`` does."""
    add_link(spec, f"{node_dir}/cpu{cpu}", f"{BASE}/cpu{cpu}")
    add_link(spec, f"{BASE}/cpu{cpu}/node{node}", node_dir)
