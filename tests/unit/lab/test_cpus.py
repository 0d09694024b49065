"""The CPU tree as ``drivers/base/topology.c`` and ``cacheinfo.c`` print it, and ``lab check`` guarding it."""

from __future__ import annotations

import os

import pytest

from plugvisor.emulators.lab import Lab, cpus, fidelity
from plugvisor.emulators.lab.spec import File, Spec

from .conftest import ROOT

TWO_SOCKETS = [range(56), range(56, 112)]
"""dgx-like's shape: 112 CPUs, so every mask spans four 32-bit words."""


def content(spec: Spec, path: str) -> str:
    entry = spec[path]
    assert isinstance(entry, File)
    return entry.content.decode()


@pytest.fixture
def two_sockets() -> Spec:
    spec: Spec = {}
    cpus.render(spec, TWO_SOCKETS)
    return spec


def test_masks_are_32_bit_words_most_significant_first(two_sockets: Spec) -> None:
    """``%*pb`` over 112 CPUs: the first word only as wide as its 16 bits, the rest 8 hex digits."""
    topology = "sys/devices/system/cpu/cpu56/topology"
    assert content(two_sockets, f"{topology}/package_cpus") == "ffff,ffffffff,ff000000,00000000\n"
    assert content(two_sockets, f"{topology}/package_cpus_list") == "56-111\n"
    assert content(two_sockets, f"{topology}/core_cpus") == "0000,00000000,01000000,00000000\n"
    assert content(two_sockets, f"{topology}/core_cpus_list") == "56\n"


def test_ids_count_cores_within_their_package(two_sockets: Spec) -> None:
    """cpu57 is package 1's second core; the old names (``core_siblings``) say what the new ones say."""
    topology = "sys/devices/system/cpu/cpu57/topology"
    assert content(two_sockets, f"{topology}/physical_package_id") == "1\n"
    assert content(two_sockets, f"{topology}/core_id") == "1\n"
    assert content(two_sockets, f"{topology}/die_id") == "0\n"
    assert content(two_sockets, f"{topology}/core_siblings") == content(
        two_sockets, f"{topology}/package_cpus"
    )
    assert content(two_sockets, f"{topology}/thread_siblings") == content(
        two_sockets, f"{topology}/core_cpus"
    )


def test_node_wide_lists(two_sockets: Spec) -> None:
    base = "sys/devices/system/cpu"
    for name in ("online", "possible", "present"):
        assert content(two_sockets, f"{base}/{name}") == "0-111\n"
    assert content(two_sockets, f"{base}/offline") == "\n"
    assert content(two_sockets, f"{base}/kernel_max") == "8191\n"


def test_caches_private_to_the_core_and_an_l3_shared_by_the_package(two_sockets: Spec) -> None:
    cache = "sys/devices/system/cpu/cpu60/cache"
    kinds = [
        (content(two_sockets, f"{cache}/index{i}/level"), content(two_sockets, f"{cache}/index{i}/type"))
        for i in range(4)
    ]
    assert kinds == [("1\n", "Data\n"), ("1\n", "Instruction\n"), ("2\n", "Unified\n"), ("3\n", "Unified\n")]
    assert content(two_sockets, f"{cache}/index2/shared_cpu_list") == "60\n"
    assert content(two_sockets, f"{cache}/index3/shared_cpu_list") == "56-111\n"
    assert content(two_sockets, f"{cache}/index3/size") == f"{56 * 2048}K\n"
    assert content(two_sockets, f"{cache}/index3/id") == "1\n"
    for i in range(4):
        index = f"{cache}/index{i}"
        sets, ways, line = (
            int(content(two_sockets, f"{index}/{name}"))
            for name in ("number_of_sets", "ways_of_associativity", "coherency_line_size")
        )
        assert (
            int(content(two_sockets, f"{index}/size").strip().removesuffix("K")) * 1024 == sets * ways * line
        )


def test_a_single_cpu_lists_itself_alone() -> None:
    spec: Spec = {}
    cpus.render(spec, [range(1)])
    assert content(spec, "sys/devices/system/cpu/online") == "0\n"
    assert content(spec, "sys/devices/system/cpu/cpu0/topology/package_cpus") == "1\n"


def test_the_lab_writes_no_proc_cpuinfo(small: Lab) -> None:
    """The lab tells its own ``proc/`` from a real procfs by the absence of ``cpuinfo``."""
    assert not os.path.exists(f"{ROOT}/proc/cpuinfo")
    assert os.path.exists(f"{ROOT}/sys/devices/system/cpu/cpu0/topology/package_cpus")


def test_check_reports_a_mask_that_disagrees_with_its_list(small: Lab) -> None:
    path = f"{ROOT}/sys/devices/system/cpu/cpu3/topology/package_cpus"
    os.chmod(path, 0o644)
    with open(path, "w") as handle:
        handle.write("00ff\n")
    assert fidelity.problems(ROOT) == [
        "cpu3: topology/package_cpus and package_cpus_list name different CPUs"
    ]


def test_check_reports_a_cpu_without_the_mask_files_hwloc_needs(small: Lab) -> None:
    for name in ("package_cpus", "core_cpus"):
        os.remove(f"{ROOT}/sys/devices/system/cpu/cpu0/topology/{name}")
    assert fidelity.problems(ROOT) == ["cpu0: no topology/package_cpus or core_cpus mask"]


def test_check_reports_a_cache_size_that_is_not_its_geometry(small: Lab) -> None:
    path = f"{ROOT}/sys/devices/system/cpu/cpu1/cache/index2/size"
    os.chmod(path, 0o644)
    with open(path, "w") as handle:
        handle.write("1000K\n")
    assert fidelity.problems(ROOT) == [
        "cpu1/cache/index2: size '1000K' is not sets x ways x line size (2097152 bytes)"
    ]
