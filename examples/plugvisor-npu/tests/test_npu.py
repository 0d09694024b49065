"""The npu kind and the acme-npu lab kind, tested with plugvisor's public helpers only.

The lab kind writes the cards as their driver would; the plugin kind reads them,
so every test of the source runs on a lab tree: its faults and hot-plug are the
hardware events the kind must follow.
"""

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pydantic
import pytest
from plugvisor_npu.kind import KIND
from plugvisor_npu.lab import LAB_KIND

from plugvisor.deviceplugin import HostPaths
from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.emulators.lab import extension
from plugvisor.plugins.kinds import get_kind
from plugvisor.testing import kind_loads_without_grpc, running_plugin, scan, short_socket_dir

RESOURCE = "acme.com/npu"


@pytest.fixture
def node():
    """A lab with four Acme N1 cards (the package's own profile), under a short path."""
    parent = Path(tempfile.mkdtemp(prefix="pvnpu-", dir="/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"))
    try:
        yield lab.Lab.create(parent / "root", "acme-npu-node")
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def serial(node: lab.Lab, name: str) -> str:
    return dict(node.device(name).attributes)["serial"]


def plugvisor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plugvisor", *args], capture_output=True, text=True, check=False, timeout=60
    )


class TestLabKind:
    def test_the_profile_places_two_cards_per_switch_on_each_numa_node(self, node):
        cards = node.devices(kind="acme-npu")
        assert [c.name for c in cards] == ["npu0", "npu1", "npu2", "npu3"]
        assert [c.numa_node for c in cards] == [0, 0, 1, 1]
        assert cards[0].pcie_switch == cards[1].pcie_switch != cards[2].pcie_switch
        assert [n.path for n in cards[2].device_nodes] == ["/dev/acme_npu2"]
        assert {c.vendor for c in cards} == {"0x1ac3"}

    def test_the_driver_view_is_faithful_whatever_the_faults(self, node):
        """`plugvisor lab check`: the lab's own checks (links, nodes, PCI) and the kind's."""
        node.fault("npu0", "ecc-uncorrectable")
        node.fault("npu1", "thermal-trip")
        node.fault("npu2", "fallen-off-bus")
        node.unplug("npu3")
        assert node.check() == []
        result = plugvisor("lab", "check", str(node.root))
        assert result.returncode == 0 and "no problems found" in result.stdout, result.stdout + result.stderr

    def test_faults_are_what_the_driver_shows(self, node):
        classes = node.root / "sys/class/acme_npu"
        node.fault("npu1", "thermal-trip")
        assert (classes / "acme_npu1/health").read_text() == "thermal_trip\n"
        assert int((classes / "acme_npu1/temp").read_text()) > int(
            (classes / "acme_npu1/temp_crit").read_text()
        )
        node.fault("npu2", "fallen-off-bus")  # the driver lets go: no class device, no node
        assert not (classes / "acme_npu2").exists() and not (node.root / "dev/acme_npu2").exists()
        node.heal("npu1")
        node.heal("npu2")
        assert (classes / "acme_npu1/health").read_text() == "ok\n" and (classes / "acme_npu2").exists()

    def test_the_cli_refuses_a_fault_of_another_kind_listing_the_cards_own(self, node):
        result = plugvisor("lab", "fault", str(node.root), "npu0", "overheat")
        assert result.returncode == 2
        assert "does not apply to npu0" in result.stderr
        assert "ecc-uncorrectable, thermal-trip" in result.stderr

    def test_a_profile_key_of_the_kind_is_validated_with_the_field_named(self, tmp_path):
        profile = tmp_path / "p.yaml"
        profile.write_text("name: p\nnpus: [{model: acme-n1, count: 1, memoryGB: 8}]\n")
        expected = "npus[0].memoryGB: unknown key; did you mean `memoryGiB`?"
        with pytest.raises(lab.ProfileError, match=re.escape(expected)):
            lab.load_profile(profile)
        profile.write_text("name: p\nnpus: [{model: acme-n2, count: 1}]\n")
        with pytest.raises(
            lab.ProfileError, match="unknown acme-npu model 'acme-n2'; expected one of: acme-n1"
        ):
            lab.load_profile(profile)


class TestSource:
    def test_one_device_per_card_named_by_serial_with_its_numa_node(self, node):
        snapshot = scan(KIND, {}, node.root)
        assert sorted(snapshot.devices) == sorted(serial(node, f"npu{i}") for i in range(4))
        card = snapshot.devices[serial(node, "npu2")]
        assert card.healthy and card.numa_nodes == (1,)
        assert card.specs[0].container_path == "/dev/acme_npu2"

    def test_a_card_that_reports_a_fault_is_unhealthy_with_the_cards_own_cause(self, node):
        node.fault("npu1", "ecc-uncorrectable")
        source = KIND.build({}, lab_paths(node), resource=RESOURCE)
        snapshot = source.scan()
        broken = serial(node, "npu1")
        assert not snapshot.devices[broken].healthy
        description = source.describe(snapshot)[broken]
        assert (description.cause_code, description.pci_address) == ("ecc-error", node.device("npu1").bdf)
        temperatures = {r.family: r.value for r in description.readings}
        assert temperatures["plugvisor_device_temperature_critical_celsius"] == 95.0

    def test_options_select_cards_and_a_typo_is_an_error_naming_the_key(self, node):
        wanted = serial(node, "npu3")
        assert list(scan(KIND, {"serials": [wanted]}, node.root).devices) == [wanted]
        with pytest.raises(pydantic.ValidationError, match="serial"):
            scan(KIND, {"serial": [wanted]}, node.root)

    def test_a_preferred_allocation_keeps_to_one_numa_node(self, node):
        source = KIND.build({}, lab_paths(node), resource=RESOURCE)
        snapshot = source.scan()
        chosen = source.preferred_allocation(list(snapshot.devices), [serial(node, "npu3")], 2, snapshot)
        assert set(chosen) == {serial(node, "npu2"), serial(node, "npu3")}


def lab_paths(node):
    return HostPaths(root=node.root)


class TestContract:
    def test_both_kinds_are_installed_under_their_entry_points(self):
        assert get_kind("npu") is KIND
        assert extension.installed("acme-npu") is LAB_KIND

    def test_the_lab_kind_is_plain_files(self):
        """Like plugvisor's own lab, the lab kind loads neither gRPC nor the framework it tests."""
        probe = (
            "import sys; from plugvisor.emulators.lab import extension; extension.installed('acme-npu'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc' or m.startswith('plugvisor.dev')))"  # noqa: E501
        )
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        assert result.stdout.strip() == "[]"

    def test_loading_the_kind_imports_no_grpc(self):
        """plugvisor's agent loads every configured kind to validate its configuration, and never gRPC."""
        assert kind_loads_without_grpc("npu", {"serials": ["N1-0"]}) == []


def allocatable(kubelet: EmulatedKubelet) -> int:
    view = kubelet.resource(RESOURCE)
    return 0 if view is None else view.allocatable


def capacity(kubelet: EmulatedKubelet) -> int:
    view = kubelet.resource(RESOURCE)
    return 0 if view is None else view.capacity


async def test_the_kubelet_follows_the_cards_faults_and_hot_plug(node):
    """A fault written in place is seen at the periodic rescan; an unplugged card at once (inotify)."""
    with short_socket_dir() as sockets:
        async with (
            EmulatedKubelet(sockets / "dp", write_view=False) as kubelet,
            running_plugin(kubelet, KIND, {}, resource=RESOURCE, root=node.root, rescan_interval=0.2),
        ):
            await kubelet.wait_for(lambda k: allocatable(k) == 4, timeout=30)
            allocation = await kubelet.allocate(RESOURCE, 2)
            cards = set(allocation.response.envs["ACME_VISIBLE_CARDS"].split(","))
            assert cards in ({"acme_npu0", "acme_npu1"}, {"acme_npu2", "acme_npu3"}), "one NUMA node's cards"
            node.fault("npu0", "thermal-trip")
            await kubelet.wait_for(lambda k: allocatable(k) == 3 and capacity(k) == 4, timeout=30)
            node.heal("npu0")
            node.unplug("npu3")
            await kubelet.wait_for(lambda k: capacity(k) == 3 and allocatable(k) == 3, timeout=30)
            node.plug("npu3")
            await kubelet.wait_for(lambda k: capacity(k) == 4 and allocatable(k) == 4, timeout=30)
