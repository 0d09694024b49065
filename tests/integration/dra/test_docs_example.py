"""The kind author's example of docs/dra.md, as written there: it must keep working."""

from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.plugins.generic import KIND
from plugvisor.testing import dra_devices, running_dra_driver, short_socket_dir

OPTIONS = {"paths": ["/dev/ttyUSB*"]}


def test_what_the_kind_publishes(tmp_path):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/ttyUSB0").touch()
    published = dra_devices(KIND, OPTIONS, tmp_path, driver="tty.example.com")
    assert published["ttyusb0"].attributes["path"] == "/dev/ttyUSB0"


async def test_a_claim_gets_the_port(tmp_path):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/ttyUSB0").touch()
    with short_socket_dir() as base:
        kubelet = EmulatedKubelet(base / "device-plugins", objects_dir=base / "api", write_view=False)
        async with (
            kubelet,
            running_dra_driver(kubelet, KIND, OPTIONS, driver="tty.example.com", root=tmp_path) as tty,
        ):
            claim, edits = await tty.prepare("ttyusb0")
            assert [path for path, _ in edits.device_nodes] == ["/dev/ttyUSB0"]
            await tty.unprepare(claim)
