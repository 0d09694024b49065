"""Safe sysfs reads: every way a tree can be broken comes back as a value naming the cause."""

import os

import pytest

from plugvisor.plugins import sysfs
from plugvisor.plugins.sysfs import Problem, Unreadable


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "good").write_text("0x10de\n")
    (tmp_path / "garbage").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "words").write_text("many words\n")
    os.symlink("nowhere", tmp_path / "dangling")
    os.symlink("loop-b", tmp_path / "loop-a")
    os.symlink("loop-a", tmp_path / "loop-b")
    os.symlink("/etc", tmp_path / "outside")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")  # opening it for reading must not wait for a writer
    with (tmp_path / "huge").open("wb") as huge:
        huge.truncate(2 << 30)  # sparse: 2 GiB where a few bytes belong, never read whole
    return tmp_path


class TestReads:
    def test_a_good_attribute_parses(self, tree):
        assert sysfs.read_hex(tree / "good") == 0x10DE

    @pytest.mark.parametrize(
        ("name", "reader", "problem"),
        [
            ("absent", sysfs.read_text, Problem.MISSING),
            ("garbage", sysfs.read_text, Problem.GARBAGE),
            ("words", sysfs.read_int, Problem.GARBAGE),
            ("dangling", sysfs.read_text, Problem.GARBAGE),
            ("loop-a", sysfs.read_text, Problem.GARBAGE),
            ("outside", sysfs.read_text, Problem.GARBAGE),
            ("dir", sysfs.read_text, Problem.GARBAGE),
            ("fifo", sysfs.read_text, Problem.GARBAGE),
            ("huge", sysfs.read_text, Problem.GARBAGE),
        ],
        ids=[
            "missing",
            "undecodable",
            "not-a-number",
            "dangling",
            "loop",
            "link-out",
            "directory",
            "fifo",
            "huge",
        ],
    )
    def test_failures_are_values_naming_the_cause(self, tree, name, reader, problem):
        result = reader(tree / name)
        assert isinstance(result, Unreadable)
        assert result.problem is problem
        assert name in str(result)

    @pytest.mark.skipif(os.geteuid() == 0, reason="root reads anything")
    def test_an_unreadable_file_is_reported_with_the_errno_text(self, tree):
        (tree / "secret").write_text("1")
        (tree / "secret").chmod(0)
        result = sysfs.read_text(tree / "secret")
        assert isinstance(result, Unreadable) and result.problem is Problem.UNREADABLE

    def test_resolve_refuses_loops_dangling_links_and_escapes(self, tree):
        assert sysfs.resolve(tree / "loop-a", tree).problem is Problem.LOOP
        assert sysfs.resolve(tree / "dangling", tree).problem is Problem.DANGLING
        assert sysfs.resolve(tree / "outside", tree).problem is Problem.OUTSIDE
        assert sysfs.resolve(tree / "dir", tree) == (tree / "dir").resolve()

    def test_link_name_reads_a_driver_link_without_resolving_it(self, tree):
        os.symlink("../../bus/pci/drivers/nvidia", tree / "driver")
        assert sysfs.link_name(tree / "driver") == "nvidia"
        assert sysfs.link_name(tree / "good").problem is Problem.GARBAGE


class TestPci:
    def test_aer_totals_and_link_state(self, tmp_path):
        (tmp_path / "aer_dev_fatal").write_text("DLP 0\nTOTAL_ERR_FATAL 2\n")
        (tmp_path / "aer_dev_nonfatal").write_text("junk\n")
        (tmp_path / "current_link_width").write_text("0\n")
        assert sysfs.aer_problems(tmp_path, ["fatal", "correctable"]) == ["2 AER fatal error(s)"]
        assert sysfs.link_problem(tmp_path) == "PCIe link down (width 0)"

    @pytest.mark.parametrize("make", ["garbage", "directory", "fifo", "huge"])
    def test_aer_counters_that_cannot_be_read_make_the_device_unhealthy_naming_the_cause(
        self, tmp_path, make
    ):
        counters = tmp_path / "aer_dev_fatal"
        if make == "garbage":
            counters.write_text("TOTAL_ERR_FATAL many\n")
        elif make == "directory":
            counters.mkdir()
        elif make == "fifo":
            os.mkfifo(counters)
        else:
            with counters.open("wb") as huge:
                huge.truncate(2 << 30)
        (problem,) = sysfs.aer_problems(tmp_path, ["fatal"])
        assert problem.startswith("AER fatal counters unreadable:") and "aer_dev_fatal" in problem

    def test_missing_aer_and_link_attributes_are_not_faults(self, tmp_path):
        assert sysfs.aer_problems(tmp_path, ["fatal", "nonfatal"]) == []
        assert sysfs.link_problem(tmp_path) is None

    def test_garbage_link_width_is_a_problem(self, tmp_path):
        (tmp_path / "current_link_width").write_text("wide\n")
        assert "PCIe link width unreadable" in sysfs.link_problem(tmp_path)

    @pytest.mark.parametrize(
        ("operstate", "carrier", "expected"),
        [
            ("up", "1", None),
            ("down", None, "PF ens1 link down"),
            ("up", "0", "PF ens1 link down"),
            ("dormant", None, None),
            ("sideways", None, "PF ens1 operstate unreadable"),
            (b"\xff", None, "PF ens1 operstate unreadable"),
        ],
    )
    def test_interface_link_state(self, tmp_path, operstate, carrier, expected):
        data = operstate if isinstance(operstate, bytes) else f"{operstate}\n".encode()
        (tmp_path / "operstate").write_bytes(data)
        if carrier is not None:
            (tmp_path / "carrier").write_text(carrier + "\n")
        problem = sysfs.netdev_link_problem(tmp_path, "PF ens1")
        if expected is None:
            assert problem is None
        else:
            assert problem.startswith(expected)
            assert "operstate" in problem or "down" in problem

    @pytest.mark.parametrize(
        ("make", "expected"),
        [("missing", "missing"), ("dir", "is a directory, not a device node"), ("file", None)],
    )
    def test_device_node_problems(self, tmp_path, make, expected):
        node = tmp_path / "nvidia0"
        if make == "dir":
            node.mkdir()
        elif make == "file":
            node.write_text("")
        assert sysfs.node_problem(node) == expected

    def test_config_space_of_all_ones_means_fallen_off_the_bus(self, tmp_path):
        (tmp_path / "config").write_bytes(b"\xff" * 64)
        assert sysfs.config_all_ones(tmp_path)
        (tmp_path / "config").write_bytes(b"\xde\x10" + b"\xff" * 62)
        assert not sysfs.config_all_ones(tmp_path)

    def test_a_bus_entry_pointing_elsewhere_is_refused(self, tmp_path):
        bus = tmp_path / "sys/bus/pci/devices"
        bus.mkdir(parents=True)
        os.symlink("../../../devices/pci0000:00/0000:00:01.0", bus / "0000:03:00.0")
        result = sysfs.read_function(tmp_path / "sys", "0000:03:00.0")
        assert isinstance(result, Unreadable) and result.problem is Problem.GARBAGE

    @staticmethod
    def _function(sysfs_dir, bdf="0000:03:00.0"):
        bus = sysfs_dir / "bus/pci/devices"
        bus.mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../../devices/pci0000:00/{bdf}", bus / bdf)
        return sysfs_dir / "devices/pci0000:00" / bdf

    def test_a_dangling_bus_link_says_so(self, tmp_path):
        self._function(tmp_path / "sys")
        result = sysfs.function_dir(tmp_path / "sys", "0000:03:00.0")
        assert isinstance(result, Unreadable) and result.problem is Problem.DANGLING
        assert "0000:03:00.0" in str(result)

    def test_a_link_inside_the_tree_cannot_lead_out_of_sysfs(self, tmp_path):
        device = self._function(tmp_path / "sys")
        device.parent.mkdir(parents=True)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "vendor").write_text("0x10de\n")
        device.symlink_to(elsewhere)  # an absolute link: another tree's attributes
        result = sysfs.function_dir(tmp_path / "sys", "0000:03:00.0")
        assert isinstance(result, Unreadable)

    def test_a_looping_driver_link_is_a_driver_problem_not_a_driver(self, tmp_path):
        device = self._function(tmp_path / "sys")
        device.mkdir(parents=True)
        for name, value in (("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200")):
            (device / name).write_text(value + "\n")
        os.symlink("driver", device / "driver")
        function = sysfs.read_function(tmp_path / "sys", "0000:03:00.0")
        assert function.driver is None
        assert function.driver_problem == "driver link (driver): symlink loop"


class TestProblemLog:
    def test_logs_a_problem_once_and_its_recovery_once(self):
        events = []

        class Logger:
            def warning(self, event, **kw):
                events.append((event, kw["cause"]))

            def info(self, event, **kw):
                events.append((event, None))

        log = sysfs.ProblemLog(Logger())
        for _ in range(3):
            log.report("gpu0", "no driver bound")
        log.report("gpu0", None)
        log.report("gpu0", None)
        assert events == [("device_unhealthy", "no driver bound"), ("device_recovered", None)]
