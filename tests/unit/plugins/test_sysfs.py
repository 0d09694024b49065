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
            ("dangling", sysfs.read_text, Problem.MISSING),
            ("loop-a", sysfs.read_text, Problem.LOOP),
            ("dir", sysfs.read_text, Problem.UNREADABLE),
        ],
        ids=["missing", "undecodable", "not-a-number", "dangling", "loop", "directory"],
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
        assert sysfs.aer_problems(tmp_path, ["fatal", "nonfatal", "correctable"]) == ["2 AER fatal error(s)"]
        assert sysfs.link_problem(tmp_path) == "PCIe link down (width 0)"

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
