"""sysfs telemetry: kernel formats in, readings out; anything unreadable is absent with one log line."""

import structlog

from plugvisor.plugins import telemetry


def log():
    return telemetry.TelemetryLog(structlog.get_logger("test"))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def by_family(readings):
    return {(r.family, tuple(sorted(r.labels.values()))): r.value for r in readings}


def aer(name, count):
    return f"RxErr 0\nBadTLP {count}\n{name} {count}\n"


class TestPcie:
    def test_aer_totals_and_a_link_at_full_speed(self, tmp_path):
        write(tmp_path / "aer_dev_fatal", aer("TOTAL_ERR_FATAL", 2))
        write(tmp_path / "aer_dev_nonfatal", aer("TOTAL_ERR_NONFATAL", 0))
        write(tmp_path / "aer_dev_correctable", aer("TOTAL_ERR_COR", 7))
        for link in ("current", "max"):
            write(tmp_path / f"{link}_link_speed", "32.0 GT/s PCIe\n")
            write(tmp_path / f"{link}_link_width", "16\n")
        values = by_family(telemetry.pcie_readings("d", tmp_path, log()))
        assert values[("plugvisor_device_aer_errors", ("fatal",))] == 2
        assert values[("plugvisor_device_aer_errors", ("correctable",))] == 7
        assert values[("plugvisor_device_pcie_link_speed_gts", ("current",))] == 32.0
        assert values[("plugvisor_device_pcie_link_width_lanes", ("max",))] == 16
        assert values[("plugvisor_device_pcie_link_degraded", ())] == 0

    def test_a_link_below_its_maximum_is_degraded(self, tmp_path):
        write(tmp_path / "current_link_speed", "16.0 GT/s PCIe\n")
        write(tmp_path / "max_link_speed", "16.0 GT/s PCIe\n")
        write(tmp_path / "current_link_width", "8\n")
        write(tmp_path / "max_link_width", "16\n")
        values = by_family(telemetry.pcie_readings("d", tmp_path, log()))
        assert values[("plugvisor_device_pcie_link_degraded", ())] == 1

    def test_a_device_without_aer_or_link_files_has_no_such_readings_and_no_log(self, tmp_path):
        with structlog.testing.capture_logs() as logs:
            assert telemetry.pcie_readings("d", tmp_path, log()) == []
        assert logs == []

    def test_garbage_is_absent_with_one_log_line_until_it_reads_again(self, tmp_path):
        write(tmp_path / "current_link_width", "sixteen\n")
        write(tmp_path / "max_link_width", "16\n")
        shared = log()
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                values = by_family(telemetry.pcie_readings("d", tmp_path, shared))
            assert ("plugvisor_device_pcie_link_width_lanes", ("current",)) not in values
            write(tmp_path / "current_link_width", "16\n")
            telemetry.pcie_readings("d", tmp_path, shared)
        assert [e["event"] for e in logs] == ["telemetry_unreadable", "telemetry_readable"]

    def test_speeds_parse_as_the_kernel_prints_them(self):
        assert telemetry.link_speed("2.5 GT/s PCIe") == 2.5
        assert telemetry.link_speed("8.0 GT/s") == 8.0
        assert telemetry.link_speed("Unknown") is None


class TestHwmon:
    def test_amdgpu_sensors_with_labels_and_units(self, tmp_path):
        hw = tmp_path / "hwmon" / "hwmon3"
        write(hw / "name", "amdgpu\n")
        write(hw / "temp1_input", "45000\n")
        write(hw / "temp1_label", "edge\n")
        write(hw / "temp1_crit", "100000\n")
        write(hw / "temp2_input", "51000\n")
        write(hw / "power1_average", "92000000\n")
        write(hw / "fan1_input", "1800\n")
        write(hw / "in0_input", "818\n")
        values = by_family(telemetry.hwmon_readings("d", tmp_path, log()))
        assert values == {
            ("plugvisor_device_temperature_celsius", ("edge",)): 45.0,
            ("plugvisor_device_temperature_critical_celsius", ("edge",)): 100.0,
            ("plugvisor_device_temperature_celsius", ("temp2",)): 51.0,
            ("plugvisor_device_power_watts", ("power1",)): 92.0,
            ("plugvisor_device_fan_rpm", ("fan1",)): 1800.0,
        }

    def test_instantaneous_power_wins_over_the_average_and_energy_is_a_counter(self, tmp_path):
        hw = tmp_path / "hwmon" / "hwmon0"
        write(hw / "power1_average", "1000000\n")
        write(hw / "power1_input", "2000000\n")
        write(hw / "energy1_input", "5000000\n")
        values = by_family(telemetry.hwmon_readings("d", tmp_path, log()))
        assert values == {
            ("plugvisor_device_power_watts", ("power1",)): 2.0,
            ("plugvisor_device_energy_joules", ("energy1",)): 5.0,
        }


class TestNetdev:
    def test_up_down_and_an_unknown_operstate_decided_by_carrier(self, tmp_path):
        write(tmp_path / "net" / "ens1" / "operstate", "up\n")
        write(tmp_path / "net" / "ens2" / "operstate", "down\n")
        write(tmp_path / "net" / "ens3" / "operstate", "unknown\n")
        write(tmp_path / "net" / "ens3" / "carrier", "1\n")
        values = by_family(telemetry.netdev_readings("d", tmp_path, "pf", log()))
        assert values == {
            ("plugvisor_device_netdev_up", ("ens1", "pf")): 1,
            ("plugvisor_device_netdev_up", ("ens2", "pf")): 0,
            ("plugvisor_device_netdev_up", ("ens3", "pf")): 1,
        }


class TestCauses:
    def test_problem_texts_map_to_stable_words(self):
        assert telemetry.cause_code([]) is None
        assert telemetry.cause_code(["3 AER fatal error(s)"]) == "aer-fatal"
        assert telemetry.cause_code(["config space reads all ones (fallen off the bus)"]) == "fallen-off-bus"
        assert telemetry.cause_code(["PF ens1f0 link down"]) == "pf-link-down"
        assert telemetry.cause_code(["PF 0000:17:00.0: 1 AER nonfatal error(s)"]) == "aer-nonfatal"
        assert telemetry.cause_code(["VF eth3 link down"]) == "vf-link-down"
        assert telemetry.cause_code(["PCIe link down (width 0)"]) == "link-down"
        assert telemetry.cause_code(["no driver bound"]) == "no-driver"
        assert telemetry.cause_code(["device node /dev/dri/card1 missing"]) == "device-node-missing"
        assert telemetry.cause_code(["AER fatal counters unreadable: x: garbage"]) == "unreadable"
        assert telemetry.cause_code(["PF ens1 operstate unreadable: x"]) == "unreadable"
        assert telemetry.cause_code(["something new"]) == "other"

    def test_nvml_causes_keep_the_xid_number(self):
        assert telemetry.cause_code(["xid 79 (NVML XID critical error)"]) == "xid-79"
        assert telemetry.cause_code(["xid 48 (NVML XID critical error)", "AER fatal"]) == "xid-48"
        assert telemetry.cause_code(["double-bit ECC error (NVML)"]) == "ecc-dbe"
        assert telemetry.cause_code(["GPU lost (NVML GPU_IS_LOST)"]) == "gpu-lost"
