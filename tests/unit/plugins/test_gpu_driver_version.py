"""The NVIDIA driver version the gpu kind publishes, from the bytes real nodes hold."""

from pathlib import Path

import pytest

from plugvisor.common.hostpaths import HostPaths
from plugvisor.dra.devices import SemVer
from plugvisor.plugins.gpu.dra import nvidia_driver_version, parse_nvidia_version

OPEN_MODULE = (
    b"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  \n"
    b"GCC version:  gcc version 15.3.0 (GCC) \n"
)
"""A real H200 node's /proc/driver/nvidia/version (NVIDIA's open kernel module), byte for byte."""
PROPRIETARY = (
    b"NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    b"GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04) \n"
)


def host(tmp_path: Path, procfs: bytes | None = None, module: bytes | None = None) -> HostPaths:
    if procfs is not None:
        (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
        (tmp_path / "proc/driver/nvidia/version").write_bytes(procfs)
    if module is not None:
        (tmp_path / "sys/module/nvidia").mkdir(parents=True)
        (tmp_path / "sys/module/nvidia/version").write_bytes(module)
    return HostPaths(root=tmp_path)


@pytest.mark.parametrize(
    ("text", "version"),
    [(OPEN_MODULE, "580.159.4"), (PROPRIETARY, "550.54.15")],
    ids=["open-module", "proprietary-module"],
)
def test_both_wordings_of_the_banner_give_the_version(text, version):
    assert parse_nvidia_version(text.decode()) == SemVer(version)


def test_the_open_modules_leading_zero_is_dropped_as_semver_requires(tmp_path):
    assert nvidia_driver_version(host(tmp_path, procfs=OPEN_MODULE)) == SemVer("580.159.4")


def test_a_banner_worded_another_way_falls_back_to_the_modules_own_version(tmp_path):
    paths = host(tmp_path, procfs=b"NVRM version: something new 1.2.3\n", module=b"580.159.04\n")
    assert nvidia_driver_version(paths) == SemVer("580.159.4")


def test_without_procfs_the_modules_own_version_is_used(tmp_path):
    assert nvidia_driver_version(host(tmp_path, module=b"580.159.04\n")) == SemVer("580.159.4")


def test_neither_file_means_no_version(tmp_path):
    assert nvidia_driver_version(host(tmp_path)) is None


def test_the_gcc_line_is_never_taken_for_the_drivers_version():
    assert parse_nvidia_version("GCC version:  gcc version 15.3.0 (GCC)\n") is None
