"""The gpu kind's NVML layer, against a stand-in for pynvml's functions: identity, health, telemetry, errors.

The lab's real stand-in library, loaded through pynvml and ctypes, is in
tests/integration/plugins/test_gpu_nvml_lab.py; here each NVML answer and error
is chosen by the test, which a library cannot be made to do one field at a time.
"""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest
import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.hostpaths import multiarch_triplet as triplet
from plugvisor.plugins.gpu.nvml import (
    EVENT_DBE,
    EVENT_SBE,
    EVENT_XID,
    TAINT_ECC,
    TAINT_LOST,
    TAINT_XID,
    Nvml,
    Unavailable,
    library_candidates,
    normalized_bus_id,
    nvml_bus_id,
)
from plugvisor.plugins.gpu.options import GpuOptions
from plugvisor.plugins.telemetry import cause_code

BUS_IDS = ("00000000:3B:00.0", "00000000:86:00.0")


class Utilization:
    gpu = 42
    memory = 7


class Memory:
    total = 150754820096
    used = 644939776
    free = total - used


class PciInfo:
    def __init__(self, bus_id: str) -> None:
        self.busId = bus_id.encode()


class Handle:
    """A device handle as a test double: identified by the object, as NVML's by its pointer."""

    def __init__(self, index: int) -> None:
        self.index = index


class FakeNvml:
    """pynvml's functions, answering as the real H200 did; ``errors[(function, index)]`` makes one fail."""

    NVMLError = pynvml.NVMLError

    def __init__(self, count: int = 2) -> None:
        self.handles = [Handle(i) for i in range(count)]
        self.errors: dict[tuple[str, int | None], int] = {}
        self.registered: list[tuple[int, int]] = []
        self.shutdowns = 0

    def _check(self, name: str, handle: Handle | None = None) -> None:
        code = self.errors.get((name, None if handle is None else handle.index))
        if code is None and handle is not None:
            code = self.errors.get((name, None))
        if code is not None:
            raise pynvml.NVMLError(code)

    def __getattr__(self, name: str):
        if not name.startswith("nvml"):
            raise AttributeError(name)
        answers = {
            "nvmlDeviceGetName": "NVIDIA H200",
            "nvmlDeviceGetBrand": 14,
            "nvmlDeviceGetArchitecture": 9,
            "nvmlDeviceGetCudaComputeCapability": (9, 0),
            "nvmlDeviceGetMemoryInfo": Memory(),
            "nvmlDeviceGetMigMode": [0, 0],
            "nvmlDeviceGetTemperature": 34,
            "nvmlDeviceGetPowerUsage": 88820,
            "nvmlDeviceGetTotalEnergyConsumption": 123456789,
            "nvmlDeviceGetClockInfo": 1980,
            "nvmlDeviceGetPcieReplayCounter": 3,
            "nvmlDeviceGetTotalEccErrors": 0,
            "nvmlDeviceGetUtilizationRates": Utilization(),
            "nvmlDeviceGetSupportedEventTypes": EVENT_XID | EVENT_DBE | EVENT_SBE | 0x4,
        }
        if name not in answers:
            raise AttributeError(name)

        def call(handle: Handle, *_args):
            self._check(name, handle)
            return answers[name]

        return call

    def nvmlDeviceGetCount(self):
        self._check("nvmlDeviceGetCount")
        return len(self.handles)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.handles[index]

    def nvmlDeviceGetPciInfo_v3(self, handle):
        self._check("nvmlDeviceGetPciInfo_v3", handle)
        return PciInfo(BUS_IDS[handle.index])

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        self._check("nvmlSystemGetCudaDriverVersion_v2")
        return 13000

    def nvmlEventSetCreate(self):
        self._check("nvmlEventSetCreate")
        return object()

    def nvmlDeviceRegisterEvents(self, handle, types, _event_set):
        self._check("nvmlDeviceRegisterEvents", handle)
        self.registered.append((handle.index, types))

    def nvmlEventSetWait_v2(self, _event_set, timeout_ms):
        time.sleep(min(timeout_ms, 10) / 1000)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, _event_set):
        self.freed = True

    def nvmlShutdown(self):
        self.shutdowns += 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def opened(api=None, clock=None, **nvml_keys) -> Nvml:
    options = GpuOptions.model_validate({"nvml": nvml_keys}).nvml
    nvml = Nvml(api or FakeNvml(), options, clock=clock or Clock())
    nvml.enumerate()
    return nvml


def xid(nvml: Nvml, api: FakeNvml, gpu: int, number: int) -> bool:
    return nvml.event(id(api.handles[gpu]), EVENT_XID, number)


FIRST = "0000:3b:00.0"


class TestIdentity:
    def test_each_gpu_is_known_by_its_sysfs_address_with_what_nvidias_dra_driver_publishes(self):
        nvml = opened()
        assert nvml.bus_ids == ["0000:3b:00.0", "0000:86:00.0"]
        identity = nvml.view(FIRST).identity
        assert identity.product_name == "NVIDIA H200"
        assert (identity.brand, identity.architecture, identity.compute_capability) == (
            "Nvidia",
            "Hopper",
            "9.0",
        )
        assert (identity.memory_bytes, identity.mig_enabled) == (150754820096, False)
        assert (nvml.system.driver_version, nvml.system.cuda_driver_version) == ("580.159.04", "13.0")

    def test_a_field_nvml_does_not_support_is_left_out_with_one_line_and_the_rest_stays(self):
        api = FakeNvml()
        api.errors[("nvmlDeviceGetArchitecture", 0)] = pynvml.NVML_ERROR_NOT_SUPPORTED
        with structlog.testing.capture_logs() as logs:
            nvml = opened(api)
            nvml.view(FIRST)
        identity = nvml.view(FIRST).identity
        assert identity.architecture is None and identity.brand == "Nvidia"
        assert nvml.view("0000:86:00.0").identity.architecture == "Hopper"
        absent = [e for e in logs if e["event"] == "nvml_field_absent"]
        assert [(e["gpu"], e["field"]) for e in absent] == [(FIRST, "architecture")]
        assert "Not Supported" in absent[0]["error"]

    def test_a_field_that_fails_recovers_and_fails_again_is_said_each_time_it_starts_and_per_cause(self):
        api = FakeNvml()
        nvml = opened(api)
        with structlog.testing.capture_logs() as logs:
            unknown, unsupported = pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_NOT_SUPPORTED
            for code in (unknown, unknown, None, unknown, unsupported):
                api.errors.pop(("nvmlDeviceGetPowerUsage", 0), None)
                if code is not None:
                    api.errors[("nvmlDeviceGetPowerUsage", 0)] = code
                nvml.readings(FIRST)
        said = [(e["event"], e.get("error")) for e in logs if e.get("field") == "power"]
        assert said == [
            ("nvml_field_absent", "Unknown Error"),
            ("nvml_field_back", None),
            ("nvml_field_absent", "Unknown Error"),
            ("nvml_field_absent", "Not Supported"),
        ]

    def test_a_function_an_old_library_lacks_is_one_line_for_all_gpus(self):
        api = FakeNvml()
        api.errors[("nvmlDeviceGetArchitecture", None)] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
        with structlog.testing.capture_logs() as logs:
            nvml = opened(api)
        assert all(nvml.view(b).identity.architecture is None for b in nvml.bus_ids)
        assert [e.get("gpus") for e in logs if e["event"] == "nvml_field_absent"] == ["all"]

    def test_anything_else_pynvml_raises_for_a_field_leaves_only_that_field_out(self):
        api = FakeNvml()

        def mismatch(_handle):
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called")

        api.nvmlDeviceGetBrand = mismatch
        identity = opened(api).view(FIRST).identity
        assert identity.brand is None and identity.architecture == "Hopper"

    def test_a_gpu_whose_bus_id_cannot_be_read_is_skipped_and_the_others_kept(self):
        api = FakeNvml()
        api.errors[("nvmlDeviceGetPciInfo_v3", 1)] = pynvml.NVML_ERROR_GPU_IS_LOST
        assert opened(api).bus_ids == [FIRST]

    def test_a_library_without_the_count_function_is_the_wrong_version(self):
        api = FakeNvml()
        api.errors[("nvmlDeviceGetCount", None)] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
        with pytest.raises(Unavailable, match="wrong version"):
            opened(api)

    @pytest.mark.parametrize(
        ("nvml_id", "sysfs"),
        [
            ("00000000:3B:00.0", "0000:3b:00.0"),
            ("0000:3b:00.0", "0000:3b:00.0"),
            ("00000001:C1:00.1", "0001:c1:00.1"),
        ],
    )
    def test_bus_ids_are_matched_as_sysfs_writes_them(self, nvml_id, sysfs):
        assert normalized_bus_id(nvml_id) == sysfs
        assert normalized_bus_id(nvml_bus_id(sysfs)) == sysfs


class TestNaming:
    def test_a_failed_shutdown_names_the_process_as_every_other_nvml_line(self):
        """``nvml_close_failed`` at nvmlShutdown named nobody: under one stderr it could be any resource's."""
        api = FakeNvml()

        def refuse() -> None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

        api.nvmlShutdown = refuse
        options = GpuOptions.model_validate({}).nvml
        nvml = Nvml(api, options, resource="gpu.plugvisor.io", clock=Clock())
        nvml.enumerate()
        with structlog.testing.capture_logs() as logs:
            nvml.close()
        (said,) = [e for e in logs if e["event"] == "nvml_close_failed"]
        assert (said["step"], said["resource"]) == ("nvmlShutdown", "gpu.plugvisor.io")


class TestHealth:
    def test_a_critical_xid_makes_only_its_gpu_unhealthy_with_the_xid_as_cause_and_taint(self):
        api = FakeNvml()
        nvml = opened(api)
        assert xid(nvml, api, 0, 79)
        view = nvml.view(FIRST)
        assert view.problems == ("xid 79 (NVML XID critical error)",)
        assert cause_code(view.problems) == "xid-79"
        assert view.taints == ((TAINT_XID, "79"),)
        assert nvml.view("0000:86:00.0").problems == ()

    @pytest.mark.parametrize("number", [13, 31, 43, 45, 68, 109])
    def test_nvidias_default_ignored_xids_change_nothing_but_the_last_xid(self, number):
        api = FakeNvml()
        nvml = opened(api)
        assert not xid(nvml, api, 0, number)
        assert nvml.view(FIRST).problems == ()
        last = {r.family: r.value for r in nvml.readings(FIRST)}["plugvisor_gpu_last_xid"]
        assert last == number

    def test_an_ignored_xid_is_said_once_per_gpu_and_xid_not_at_every_event(self):
        api = FakeNvml()
        nvml = opened(api)
        with structlog.testing.capture_logs() as logs:
            for number in (13, 13, 13, 31, 31):
                xid(nvml, api, 0, number)
            xid(nvml, api, 1, 13)
        said = [(e["gpu"], e["xid"]) for e in logs if e["event"] == "nvml_xid_ignored"]
        assert said == [(FIRST, 13), (FIRST, 31), ("0000:86:00.0", 13)]

    def test_an_xid_taken_back_from_the_ignored_ones_counts(self):
        api = FakeNvml()
        nvml = opened(api, enableHealthChecks=[13])
        assert xid(nvml, api, 0, 13)
        assert nvml.view(FIRST).taints == ((TAINT_XID, "13"),)

    def test_a_double_bit_ecc_error_is_unhealthy_and_a_single_bit_one_is_not(self):
        api = FakeNvml()
        nvml = opened(api)
        assert not nvml.event(id(api.handles[1]), EVENT_SBE, 0)
        assert nvml.view("0000:86:00.0").problems == ()
        assert nvml.event(id(api.handles[1]), EVENT_DBE, 0)
        view = nvml.view("0000:86:00.0")
        assert cause_code(view.problems) == "ecc-dbe"
        assert view.taints == ((TAINT_ECC, "dbe"),)

    def test_the_gpu_is_healthy_again_after_the_quiet_period_and_not_before(self):
        api, clock = FakeNvml(), Clock()
        nvml = opened(api, clock, recoverAfterSeconds=60)
        xid(nvml, api, 0, 48)
        clock.now += 59
        xid(nvml, api, 0, 48)  # still failing: the quiet period starts over
        clock.now += 59
        assert nvml.view(FIRST).problems
        clock.now += 1
        assert nvml.view(FIRST).problems == ()

    def test_the_event_thread_sees_the_quiet_period_end_and_asks_for_a_rescan(self):
        api, clock = FakeNvml(), Clock()
        nvml = opened(api, clock, recoverAfterSeconds=5)
        xid(nvml, api, 0, 48)
        assert not nvml._expired()
        clock.now += 5
        assert nvml._expired()
        assert nvml.view(FIRST).problems == ()

    def test_with_no_recovery_the_gpu_stays_unhealthy_as_nvidias_plugin_keeps_it(self):
        api, clock = FakeNvml(), Clock()
        nvml = opened(api, clock, recoverAfterSeconds=0)
        xid(nvml, api, 0, 48)
        clock.now += 10**6
        assert not nvml._expired()
        assert nvml.view(FIRST).problems

    def test_a_lost_gpu_is_unhealthy_until_nvml_answers_for_it_again(self):
        api = FakeNvml()
        nvml = opened(api)
        api.errors[("nvmlDeviceGetTemperature", 0)] = pynvml.NVML_ERROR_GPU_IS_LOST
        view = nvml.view(FIRST)
        assert cause_code(view.problems) == "gpu-lost"
        assert view.taints == ((TAINT_LOST, ""),)
        assert [r.family for r in nvml.readings(FIRST)] == ["plugvisor_gpu_last_xid"]
        del api.errors[("nvmlDeviceGetTemperature", 0)]
        assert nvml.view(FIRST).problems == ()

    def test_a_gpu_that_comes_back_after_it_was_gone_starts_over(self):
        api = FakeNvml()
        nvml = opened(api)
        api.nvmlDeviceGetHandleByPciBusId = lambda bus_id: api.handles[0]
        xid(nvml, api, 0, 79)
        nvml.track({"0000:86:00.0"})
        nvml.track({FIRST, "0000:86:00.0"})
        assert nvml.view(FIRST).problems == ()

    def test_a_gpu_nvml_did_not_know_at_start_is_looked_up_by_bus_id_once_in_a_while_and_then_known(self):
        """Lost when the plugin started, or plugged in since: sysfs lists it, NVML learns of it later."""
        api, clock = FakeNvml(), Clock()
        api.errors[("nvmlDeviceGetPciInfo_v3", 1)] = pynvml.NVML_ERROR_GPU_IS_LOST
        nvml = opened(api, clock)
        assert nvml.bus_ids == [FIRST]
        del api.errors[("nvmlDeviceGetPciInfo_v3", 1)]
        asked: list[bytes] = []
        answers: list[object] = [pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND), api.handles[1]]

        def by_bus_id(bus_id: bytes):
            asked.append(bus_id)
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        api.nvmlDeviceGetHandleByPciBusId = by_bus_id
        second = "0000:86:00.0"
        nvml.track({FIRST, second})
        nvml.track({FIRST, second})
        assert asked == [b"00000000:86:00.0"]  # not asked at every scan
        clock.now += 60
        nvml.track({FIRST, second})
        assert nvml.bus_ids == [FIRST, second]
        assert nvml.view(second).identity.product_name == "NVIDIA H200"
        assert xid(nvml, api, 1, 48)

    def test_a_replugged_gpu_without_a_new_handle_yet_gets_it_on_the_event_threads_recheck(self):
        """The old handle answers GPU_IS_LOST for good; the recheck looks the new one up and asks it."""
        api = FakeNvml()
        nvml = opened(api)
        old, new = api.handles[0], Handle(0)
        temperature = api.nvmlDeviceGetTemperature

        def temperature_of(handle, *args):
            if handle is old:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            return temperature(handle, *args)

        api.nvmlDeviceGetTemperature = temperature_of
        handles: list[object] = []

        def by_bus_id(_bus_id: bytes):
            if not handles:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            return handles[0]

        api.nvmlDeviceGetHandleByPciBusId = by_bus_id
        nvml.track({"0000:86:00.0"})
        nvml.track({FIRST, "0000:86:00.0"})
        assert cause_code(nvml.view(FIRST).problems) == "gpu-lost"
        assert not nvml._recheck()
        handles.append(new)
        assert nvml._recheck()
        assert nvml.view(FIRST).problems == ()

    def test_all_turns_nvml_health_off_and_no_events_are_watched(self):
        api = FakeNvml()
        nvml = opened(api, disableHealthChecks="all")
        assert not nvml.watch_events(lambda: None)
        nvml.event(id(api.handles[0]), EVENT_DBE, 0)
        assert nvml.view(FIRST).problems == ()

    def test_every_gpu_is_registered_for_xid_and_both_ecc_events_it_supports(self):
        api = FakeNvml()
        nvml = opened(api)
        assert nvml.watch_events(lambda: None)
        nvml.close()
        assert api.registered == [
            (0, EVENT_XID | EVENT_DBE | EVENT_SBE),
            (1, EVENT_XID | EVENT_DBE | EVENT_SBE),
        ]
        assert api.shutdowns == 1

    def test_a_gpu_that_cannot_register_keeps_the_others_watched(self):
        api = FakeNvml()
        api.errors[("nvmlDeviceRegisterEvents", 0)] = pynvml.NVML_ERROR_NOT_SUPPORTED
        nvml = opened(api)
        with structlog.testing.capture_logs() as logs:
            assert nvml.watch_events(lambda: None)
        nvml.close()
        assert [i for i, _ in api.registered] == [1]
        assert [e["gpu"] for e in logs if e["event"] == "nvml_events_not_registered"] == [FIRST]

    def test_an_event_for_a_gpu_nobody_registered_changes_nothing(self):
        nvml = opened()
        assert not nvml.event(12345, EVENT_XID, 79)
        assert all(nvml.view(b).problems == () for b in nvml.bus_ids)


class TestTelemetry:
    def test_dcgm_exporters_default_counters_in_the_projects_units(self):
        values = {(r.family, tuple(r.labels.values())): r.value for r in opened().readings(FIRST)}
        assert values == {
            ("plugvisor_gpu_last_xid", ()): 0.0,
            ("plugvisor_device_temperature_celsius", ("gpu",)): 34.0,
            ("plugvisor_device_power_watts", ("gpu",)): 88.82,
            ("plugvisor_device_energy_joules", ("gpu",)): 123456.789,
            ("plugvisor_gpu_sm_clock_hertz", ()): 1.98e9,
            ("plugvisor_gpu_pcie_replays", ()): 3.0,
            ("plugvisor_gpu_ecc_errors", ("sbe",)): 0.0,
            ("plugvisor_gpu_ecc_errors", ("dbe",)): 0.0,
            ("plugvisor_gpu_utilization_ratio", ()): 0.42,
            ("plugvisor_gpu_memory_copy_utilization_ratio", ()): 0.07,
            ("plugvisor_gpu_memory_used_bytes", ()): 644939776.0,
            ("plugvisor_gpu_memory_total_bytes", ()): 150754820096.0,
        }

    def test_ecc_counts_of_a_gpu_without_ecc_are_left_out_once(self):
        api = FakeNvml()
        api.errors[("nvmlDeviceGetTotalEccErrors", None)] = pynvml.NVML_ERROR_NOT_SUPPORTED
        nvml = opened(api)
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                families = [r.family for r in nvml.readings(FIRST)]
        assert "plugvisor_gpu_ecc_errors" not in families
        assert "plugvisor_device_power_watts" in families
        assert sorted(e["field"] for e in logs if e["event"] == "nvml_field_absent") == ["eccDbe", "eccSbe"]

    def test_a_gpu_nvml_does_not_know_has_no_nvml_readings(self):
        assert opened().readings("0000:00:01.0") == []


class TestLoading:
    def test_the_driver_roots_library_directories_are_searched_in_the_toolkits_order(self, tmp_path):
        paths = HostPaths(root=tmp_path)
        found = [str(p.relative_to(tmp_path)) for p in library_candidates(paths, "/usr/local/nvidia")]
        t = triplet()
        assert found == [
            "usr/local/nvidia/lib64/libnvidia-ml.so.1",
            f"usr/local/nvidia/lib/{t}/libnvidia-ml.so.1",
            "usr/local/nvidia/usr/lib64/libnvidia-ml.so.1",
            f"usr/local/nvidia/usr/lib/{t}/libnvidia-ml.so.1",
            "usr/local/nvidia/lib/libnvidia-ml.so.1",
            "usr/local/nvidia/usr/lib/libnvidia-ml.so.1",
        ]

    def test_a_link_in_the_driver_root_cannot_lead_out_of_the_host_root(self, tmp_path):
        (tmp_path / "drv").mkdir()
        (tmp_path / "drv/lib64").symlink_to("/usr/lib")
        (candidate, *_) = library_candidates(HostPaths(root=tmp_path), "/drv")
        assert candidate == tmp_path / "usr/lib/libnvidia-ml.so.1"

    def test_a_looping_search_directory_is_skipped_and_the_search_goes_on(self, tmp_path):
        """driverfiles skips such a directory; NVML's search agrees and finds the library in the next."""
        (tmp_path / "dr/usr/lib64").mkdir(parents=True)
        (tmp_path / "dr/lib64").symlink_to("lib64")
        (tmp_path / "dr/usr/lib64/libnvidia-ml.so.1").write_text("x")
        found = library_candidates(HostPaths(root=tmp_path), "/dr")
        assert tmp_path / "dr/usr/lib64/libnvidia-ml.so.1" in found
        assert not any(str(p).startswith(str(tmp_path / "dr/lib64")) for p in found)

    def test_no_library_is_unavailable_naming_the_driver_root_and_where_it_looked(self, tmp_path):
        options = GpuOptions().nvml
        with pytest.raises(
            Unavailable, match=r"libnvidia-ml.so.1 not found under driverRoot /run/nvidia/driver"
        ) as raised:
            Nvml.open(HostPaths(root=tmp_path), "/run/nvidia/driver", options)
        assert raised.value.absent  # no driver: nothing wrong, said at info

    @pytest.mark.parametrize("kind", ["text", "empty", "directory"])
    def test_a_library_that_is_there_but_broken_is_not_taken_for_an_absent_one(self, tmp_path, kind):
        """A broken driver install is a warning for someone to look at, not the info of a node without one."""
        (tmp_path / "lib64").mkdir()
        library = tmp_path / "lib64/libnvidia-ml.so.1"
        if kind == "directory":
            library.mkdir()
        else:
            library.write_text("not an ELF file\n" if kind == "text" else "")
        with pytest.raises(Unavailable, match="cannot be loaded") as raised:
            Nvml.open(HostPaths(root=tmp_path), "/", GpuOptions().nvml)
        assert not raised.value.absent

    def test_a_dangling_link_is_named_where_it_was_looked_for_and_said_to_be_dangling(self, tmp_path):
        (tmp_path / "dr/lib64").mkdir(parents=True)
        (tmp_path / "dr/lib64/libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.999")
        with pytest.raises(Unavailable) as raised:
            Nvml.open(HostPaths(root=tmp_path), "/dr", GpuOptions().nvml)
        said = str(raised.value)
        assert f"{tmp_path}/dr/lib64/libnvidia-ml.so.1: a dangling link" in said
        assert "libnvidia-ml.so.999" in said

    def test_a_file_that_is_no_library_cannot_be_loaded_and_says_so(self, tmp_path):
        (tmp_path / "lib64").mkdir()
        (tmp_path / "lib64/libnvidia-ml.so.1").write_text("not an ELF file\n")
        with pytest.raises(Unavailable, match="cannot be loaded"):
            Nvml.open(HostPaths(root=tmp_path), "/", GpuOptions().nvml)

    def test_a_shared_library_that_is_not_nvml_is_the_wrong_version(self, tmp_path):
        libm = next(
            (
                p
                for p in (Path("/lib/x86_64-linux-gnu/libm.so.6"), Path("/usr/lib64/libm.so.6"))
                if p.exists()
            ),
            None,
        )
        if libm is None:
            pytest.skip("no libm.so.6 to stand for a library of the wrong version")
        (tmp_path / "lib64").mkdir()
        shutil.copy(libm, tmp_path / "lib64/libnvidia-ml.so.1")
        with pytest.raises(Unavailable, match="wrong version: it has no nvmlInitWithFlags"):
            Nvml.open(HostPaths(root=tmp_path), "/", GpuOptions().nvml)


def test_the_agent_loading_the_gpu_kind_imports_no_pynvml_and_loads_no_library():
    """The agent validates configuration with the kind's module: NVML stays for the plugin processes."""
    probe = (
        "import sys; from plugvisor.plugins.kinds import get_kind;"
        "get_kind('gpu').options_model.model_validate({'nvml': {'disableHealthChecks': [48]}});"
        "maps = open('/proc/self/maps').read();"
        "print('pynvml' in sys.modules, 'libnvidia-ml' in maps)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split() == ["False", "False"]
