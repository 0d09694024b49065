"""The plugin command's look at the host root: no PCI bus is worth a warning only to kinds that read it."""

import pydantic
import pytest
import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.plugins import entrycommon
from plugvisor.plugins.kinds import PluginKind, get_kind


class NoOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


def warnings_for(kind, tmp_path):
    (tmp_path / "root/sys").mkdir(parents=True, exist_ok=True)  # a host root with no sys/bus/pci/devices
    host = HostPaths(root=tmp_path / "root", kubelet_dir=tmp_path / "dp")
    with structlog.testing.capture_logs() as logs:
        entrycommon.check_host(kind, host, "example.com/x")
    return [log["event"] for log in logs]


@pytest.mark.parametrize("name", ["gpu", "nic", "fpga"])
def test_a_pci_kind_warns_when_the_host_root_has_no_pci_bus(tmp_path, name):
    assert warnings_for(get_kind(name), tmp_path) == ["no_pci_bus"]


def test_a_kind_of_other_devices_is_not_told_to_check_its_host_root(tmp_path):
    """A USB serial or platform-device kind has no PCI bus to miss (outside kinds but those that say so)."""
    assert warnings_for(get_kind("generic"), tmp_path) == []
    assert warnings_for(PluginKind("tty", NoOptions, lambda *a, **k: None), tmp_path) == []  # type: ignore[arg-type]
