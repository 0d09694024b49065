"""The lab's libnvidia-ml.so.1, loaded by the real pynvml through ctypes, answers as NVML does.

One ``nvidia-h200-vm`` lab serves the module: what NVML reads must be the real node's answers
(copied here as literals from its capture). pynvml loads the lab's library the way it lets a
caller choose one: ``pynvml.nvmlLib`` set before ``nvmlInit``. pynvml caches function pointers
by name across loads, so the fixture empties that cache before and after (another test's
library must not answer for this one).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pynvml
import pytest

from plugvisor.emulators.lab import Lab

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="needs a C compiler (cc) to build the lab's NVML stand-in"
)

UUID = "GPU-2b75dc85-67dc-fd5d-9317-96e28aca4f63"
XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
SBE = pynvml.nvmlEventTypeSingleBitEccError


@pytest.fixture(scope="module")
def h200() -> Iterator[Lab]:
    """The grounded lab with pynvml initialised on its own libnvidia-ml.so.1."""
    base = tempfile.mkdtemp(prefix="/tmp/pvnvml-")
    cache = tempfile.mkdtemp(prefix="/tmp/pvnvml-cache-")
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", cache)  # the compiled library lands here, not in the user's cache
    try:
        node = Lab.create(f"{base}/root", "nvidia-h200-vm")
        assert node.notes == ()
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml.nvmlLib = ctypes.CDLL(f"{base}/root/usr/local/nvidia/lib64/libnvidia-ml.so.1")
        pynvml.nvmlInit()
        yield node
        pynvml.nvmlShutdown()
    finally:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        patch.undo()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture
def lab(h200: Lab) -> Iterator[Lab]:
    """The shared lab, with every fault healed after the test."""
    yield h200
    h200.heal("gpu0")


@pytest.fixture
def handle(lab: Lab) -> object:
    return pynvml.nvmlDeviceGetHandleByIndex(0)


@pytest.fixture
def events(handle: object) -> Iterator[object]:
    """An event set registered for XID and ECC events on the GPU (as device plugins register)."""
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle, XID | DBE | SBE, event_set)
    yield event_set
    pynvml.nvmlEventSetFree(event_set)


def cli(root: str, *args: str) -> None:
    """Run ``plugvisor lab`` as a person would, in its own process."""
    subprocess.run([sys.executable, "-m", "plugvisor", "lab", *args[:1], root, *args[1:]], check=True)


class TestTheRealNodesAnswers:
    def test_system(self, lab: Lab) -> None:
        assert pynvml.nvmlSystemGetDriverVersion() == "580.159.04"
        assert pynvml.nvmlSystemGetNVMLVersion() == "13.580.159.04"
        assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 13000
        assert pynvml.nvmlSystemGetCudaDriverVersion() == 13000
        assert pynvml.nvmlDeviceGetCount() == 1

    def test_identity(self, handle: object) -> None:
        assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA H200"
        assert pynvml.nvmlDeviceGetBrand(handle) == pynvml.NVML_BRAND_NVIDIA == 14
        assert pynvml.nvmlDeviceGetArchitecture(handle) == pynvml.NVML_DEVICE_ARCH_HOPPER
        assert pynvml.nvmlDeviceGetCudaComputeCapability(handle) == (9, 0)
        assert pynvml.nvmlDeviceGetUUID(handle) == UUID
        assert pynvml.nvmlDeviceGetMinorNumber(handle) == 0
        assert pynvml.nvmlDeviceGetVbiosVersion(handle) == "96.00.a5.00.1a"
        assert pynvml.nvmlDeviceGetMigMode(handle) == [0, 0]

    def test_pci(self, handle: object) -> None:
        pci = pynvml.nvmlDeviceGetPciInfo(handle)
        assert pci.busId == "00000000:00:06.0"
        assert (pci.domain, pci.bus, pci.device) == (0, 0, 6)
        assert (pci.pciDeviceId, pci.pciSubSystemId) == (0x233510DE, 0x18BF10DE)

    def test_memory(self, handle: object) -> None:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        assert (memory.total, memory.used) == (150754820096, 644939776)
        assert memory.free == memory.total - memory.used
        v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        assert v2.total == 150754820096
        assert v2.reserved + v2.used + v2.free == v2.total

    def test_idle_telemetry_within_the_real_nodes_range(self, handle: object) -> None:
        assert 34 <= pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) <= 41
        assert 88820 <= pynvml.nvmlDeviceGetPowerUsage(handle) <= 98594
        assert pynvml.nvmlDeviceGetUtilizationRates(handle).gpu == 0
        assert pynvml.nvmlDeviceGetTotalEccErrors(handle, 1, 0) == 0
        assert pynvml.nvmlDeviceGetPcieReplayCounter(handle) == 0
        assert pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM) > 0
        assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) >= pynvml.nvmlDeviceGetPowerUsage(handle)

    def test_lookups_by_bus_id_and_uuid_find_the_same_gpu(self, handle: object) -> None:
        for bus_id in ("00000000:00:06.0", "0000:00:06.0"):
            by_bus = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            assert pynvml.nvmlDeviceGetUUID(by_bus) == UUID
        assert pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByUUID(UUID)) == 0

    def test_idle_event_set_times_out(self, events: object) -> None:
        """The real node: registration accepted, EventSetWait(500 ms) -> Timeout."""
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(events, 500)


class TestErrorsAsNvmlReturnsThem:
    def test_index_out_of_range_is_an_invalid_argument(self, lab: Lab) -> None:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetHandleByIndex(1)

    def test_a_handle_that_is_not_a_gpus_is_an_invalid_argument(self, lab: Lab) -> None:
        bogus = ctypes.cast(ctypes.c_void_p(0x1000), pynvml.c_nvmlDevice_t)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetName(bogus)

    def test_unknown_bus_id_and_uuid_are_not_found(self, lab: Lab) -> None:
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByPciBusId("0000:00:07.0")
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")

    def test_a_malformed_bus_id_is_an_invalid_argument(self, lab: Lab) -> None:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetHandleByPciBusId("six")

    def test_an_unknown_temperature_sensor_is_an_invalid_argument(self, handle: object) -> None:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetTemperature(handle, 1)

    def test_a_function_the_stand_in_lacks_is_not_found_as_with_an_old_driver(self, handle: object) -> None:
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml.nvmlDeviceGetFanSpeed(handle)

    def test_error_strings_are_nvmls(self, lab: Lab) -> None:
        assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"
        assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_INVALID_ARGUMENT) == "Invalid Argument"


class TestFaults:
    def test_xid_from_the_command_line_raises_an_xid_event(self, lab: Lab, events: object) -> None:
        cli(str(lab.root), "fault", "gpu0", "xid-79")
        data = pynvml.nvmlEventSetWait_v2(events, 10_000)
        assert (data.eventType, data.eventData) == (XID, 79)
        assert pynvml.nvmlDeviceGetUUID(data.device) == UUID

    def test_an_active_xid_repeats_about_once_a_second(self, lab: Lab, events: object) -> None:
        """A GPU that keeps failing keeps saying so, and not faster than once a second."""
        lab.fault("gpu0", "xid-48")
        first = pynvml.nvmlEventSetWait_v2(events, 10_000)
        start = time.monotonic()
        repeats = [pynvml.nvmlEventSetWait_v2(events, 10_000) for _ in range(2)]
        assert [(e.eventType, e.eventData) for e in (first, *repeats)] == [(XID, 48)] * 3
        assert time.monotonic() - start >= 1.9

    def test_heal_ends_the_events(self, lab: Lab, events: object) -> None:
        lab.fault("gpu0", "xid-13")
        pynvml.nvmlEventSetWait_v2(events, 10_000)
        lab.heal("gpu0", "xid-13")
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(events, 1500)

    def test_ecc_dbe_raises_its_event_and_counts(self, lab: Lab, handle: object, events: object) -> None:
        before = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, 1)
        lab.fault("gpu0", "ecc-dbe")
        data = pynvml.nvmlEventSetWait_v2(events, 10_000)
        assert data.eventType == DBE
        during = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, 1)
        assert during >= before + 1
        lab.heal("gpu0", "ecc-dbe")
        after = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, 1)
        assert after >= during
        assert pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, 1) == 0

    def test_ecc_sbe_raises_a_single_bit_event(self, lab: Lab, events: object) -> None:
        lab.fault("gpu0", "ecc-sbe")
        assert pynvml.nvmlEventSetWait_v2(events, 10_000).eventType == SBE

    def test_overheat_moves_temperature_and_power(self, lab: Lab, handle: object) -> None:
        cool = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        idle = pynvml.nvmlDeviceGetPowerUsage(handle)
        cli(str(lab.root), "fault", "gpu0", "overheat")
        assert pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) > cool + 30
        assert pynvml.nvmlDeviceGetPowerUsage(handle) > idle

    def test_fallen_off_bus_loses_the_gpu_and_says_xid_79_once(
        self, lab: Lab, handle: object, events: object
    ) -> None:
        lab.fault("gpu0", "fallen-off-bus")
        data = pynvml.nvmlEventSetWait_v2(events, 10_000)
        assert (data.eventType, data.eventData) == (XID, 79)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetName(handle)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(events, 1500)
        lab.heal("gpu0")
        assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA H200"

    def test_an_unplugged_gpu_is_lost_until_plugged_back(self, lab: Lab, handle: object) -> None:
        lab.unplug("gpu0")
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetUUID(handle)
        lab.plug("gpu0")
        assert pynvml.nvmlDeviceGetUUID(handle) == UUID

    def test_a_state_file_it_cannot_parse_is_an_unknown_error_not_zeros(
        self, lab: Lab, handle: object
    ) -> None:
        path = f"{lab.root}/.plugvisor-lab/nvml/gpu0"
        with open(path, "rb") as original:
            kept = original.read()
        for garbage in (bytes(range(256)) * 4, b"temperature=40\n"):
            with open(f"{path}.new", "wb") as replaced:
                replaced.write(garbage)
            os.replace(f"{path}.new", path)
            with pytest.raises(pynvml.NVMLError_Unknown):
                pynvml.nvmlDeviceGetTemperature(handle, 0)
        with open(f"{path}.new", "wb") as restored:
            restored.write(kept)
        os.replace(f"{path}.new", path)
        assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA H200"

    def test_energy_only_goes_up(self, lab: Lab, handle: object) -> None:
        first = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        lab.fault("gpu0", "overheat")
        lab.heal("gpu0")
        assert pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) >= first


def test_a_cache_directory_that_cannot_be_made_builds_in_a_temporary_one_and_the_lab_is_whole(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """XDG_CACHE_HOME naming a file: the lab is still created whole, with its NVML library."""
    monkeypatch.setenv("XDG_CACHE_HOME", "/etc/passwd")
    node = Lab.create(str(tmp_path / "root"), "nvidia-h200-vm")
    assert node.notes == ()
    library = tmp_path / "root/usr/local/nvidia/lib64/libnvidia-ml.so.1"
    assert library.read_bytes().startswith(b"\x7fELF")
