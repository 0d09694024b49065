"""The tty kind, tested with plugvisor's public test helpers: its source alone, then as a plugin."""

from pathlib import Path

import pydantic
import pytest
from plugvisor_tty import KIND

from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.plugins.kinds import get_kind
from plugvisor.testing import kind_loads_without_grpc, running_plugin, scan, short_socket_dir

RESOURCE = "example.com/serial"


def allocatable(kubelet: EmulatedKubelet) -> int:
    view = kubelet.resource(RESOURCE)
    return 0 if view is None else view.allocatable


def make_host(root: Path, ports: dict[str, str], *, by_id: dict[str, str] | None = None, nodes=None) -> Path:
    """A host tree: sysfs tty classes with their drivers, device nodes, udev's by-id links."""
    for name, driver in ports.items():
        drivers = root / "sys/bus/usb-serial/drivers" / driver
        drivers.mkdir(parents=True, exist_ok=True)
        device = root / "sys/devices/usb1" / name
        device.mkdir(parents=True)
        (device / "driver").symlink_to(drivers)
        port = root / "sys/class/tty" / name
        port.mkdir(parents=True)
        (port / "device").symlink_to(device)
    (root / "dev").mkdir(exist_ok=True)
    for name in ports if nodes is None else nodes:
        (root / "dev" / name).touch()
    if by_id:
        links = root / "dev/serial/by-id"
        links.mkdir(parents=True)
        for stable, name in by_id.items():
            (links / stable).symlink_to(f"../../{name}")
    return root


class TestSource:
    def test_every_matching_port_is_a_device_named_after_it(self, tmp_path):
        host = make_host(tmp_path, {"ttyUSB0": "ftdi_sio", "ttyACM0": "cdc_acm", "ttyS0": "serial"})
        snapshot = scan(KIND, {}, host)
        assert list(snapshot.devices) == ["ttyACM0", "ttyUSB0"]
        spec = snapshot.devices["ttyUSB0"].specs[0]
        assert (spec.container_path, spec.host_path) == ("/dev/ttyUSB0", f"{tmp_path}/dev/ttyUSB0")

    def test_drivers_select_the_ports(self, tmp_path):
        host = make_host(tmp_path, {"ttyUSB0": "ftdi_sio", "ttyUSB1": "cp210x"})
        assert list(scan(KIND, {"drivers": ["cp210x"]}, host).devices) == ["ttyUSB1"]

    def test_a_port_without_its_device_node_is_unhealthy(self, tmp_path):
        host = make_host(tmp_path, {"ttyUSB0": "ftdi_sio", "ttyUSB1": "ftdi_sio"}, nodes=["ttyUSB0"])
        devices = scan(KIND, {}, host).devices
        assert devices["ttyUSB0"].healthy and not devices["ttyUSB1"].healthy

    def test_the_scan_carries_the_stable_names_and_what_to_watch(self, tmp_path):
        host = make_host(tmp_path, {"ttyUSB0": "ftdi_sio"}, by_id={"usb-FTDI_A1-if00-port0": "ttyUSB0"})
        snapshot = scan(KIND, {}, host)
        assert snapshot.data.by_id == {"ttyUSB0": "usb-FTDI_A1-if00-port0"}
        assert tmp_path / "dev" in snapshot.watch

    def test_an_unknown_key_is_an_error_naming_it(self, tmp_path):
        with pytest.raises(pydantic.ValidationError, match="driver"):
            scan(KIND, {"driver": ["ftdi_sio"]}, tmp_path)


class TestContract:
    def test_the_kind_is_installed_under_its_entry_point(self):
        assert get_kind("tty") is KIND

    def test_loading_the_kind_imports_no_grpc(self):
        """plugvisor's agent loads every configured kind to validate its configuration, and never gRPC."""
        assert kind_loads_without_grpc("tty", {"drivers": ["ftdi_sio"]}) == []


async def test_a_container_gets_the_port_and_its_stable_name(tmp_path):
    host = make_host(tmp_path, {"ttyUSB0": "ftdi_sio"}, by_id={"usb-FTDI_A1-if00-port0": "ttyUSB0"})
    with short_socket_dir() as sockets:
        async with (
            EmulatedKubelet(sockets / "dp", write_view=False) as kubelet,
            running_plugin(kubelet, KIND, {}, resource=RESOURCE, root=host),
        ):
            await kubelet.wait_for(lambda k: allocatable(k) == 1)
            allocation = await kubelet.allocate(RESOURCE, 1)
    assert allocation.device_ids == ("ttyUSB0",)
    assert [d.host_path for d in allocation.response.devices] == [f"{host}/dev/ttyUSB0"]
    assert allocation.response.envs["SERIAL_PORTS"] == "usb-FTDI_A1-if00-port0"
