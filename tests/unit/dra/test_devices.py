"""The published device model: what the API server would refuse is refused where a kind builds it."""

import pytest

from plugvisor.dra import validation
from plugvisor.dra.devices import (
    NUMA_NODE,
    PCIE_ROOT,
    DeviceTaint,
    InvalidDraDeviceError,
    PublishedDevice,
    SemVer,
    bytes_quantity,
    device_json,
)
from plugvisor.dra.validation import qualified_problem, quantity_problem


class TestSemVer:
    @pytest.mark.parametrize("text", ["1.0.0", "550.54.15", "1.2.3-rc.1", "1.2.3+build.5", "0.0.0"])
    def test_semantic_versions_are_taken(self, text):
        assert SemVer(text).value == text

    @pytest.mark.parametrize("text", ["1.0", "v1.0.0", "01.2.3", "1.2.3.4", "", "1.2.3-", "x"])
    def test_anything_else_is_refused_naming_it(self, text):
        with pytest.raises(InvalidDraDeviceError, match="is not a semantic version"):
            SemVer(text)

    @pytest.mark.parametrize(
        ("printed", "version"),
        [
            ("550.54.15", "550.54.15"),
            ("535.104.05", "535.104.5"),
            ("6.8", "6.8.0"),
            ("v2", "2.0.0"),
            (" 1.2.3-rc1 \n", "1.2.3-rc1"),
        ],
    )
    def test_drivers_printed_versions_are_read_tolerantly(self, printed, version):
        assert SemVer.tolerant(printed) == SemVer(version)

    @pytest.mark.parametrize("printed", ["", "abc", "1.x.3", "1.2.3.4", "unknown"])
    def test_what_is_no_version_at_all_gives_none(self, printed):
        assert SemVer.tolerant(printed) is None


class TestNames:
    @pytest.mark.parametrize(
        "name", ["model", "driverVersion", "_x", "resource.kubernetes.io/pcieRoot", "a.b/c_1"]
    )
    def test_qualified_names_are_taken(self, name):
        assert qualified_problem(name) is None

    @pytest.mark.parametrize(
        "name",
        ["", "1model", "has-dash", "a" * 33, "under_score.io/x", "/x", "domain/", "a/b/c", f"{'a' * 64}/x"],
    )
    def test_other_names_are_refused(self, name):
        assert qualified_problem(name) is not None


class TestPublishedDevice:
    def test_values_are_kept_sorted_and_read_only(self):
        device = PublishedDevice(
            "gpu-0", {"model": "H100", NUMA_NODE: 0, "healthy": True}, {"memory": "80Gi"}
        )
        assert list(device.attributes) == ["healthy", "model", NUMA_NODE]
        with pytest.raises(TypeError):
            device.attributes["x"] = 1  # type: ignore[index]

    def test_equal_devices_compare_equal(self):
        assert PublishedDevice("a", {"x": 1}) == PublishedDevice("a", {"x": 1})
        assert PublishedDevice("a", {"x": 1}) != PublishedDevice("a", {"x": 2})

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"name": "GPU-0"}, "must be a DNS label"),
            ({"name": ""}, "must not be empty"),
            ({"name": "a" * 64}, "is 64 characters"),
            ({"name": "ok", "attributes": {"bad-name": 1}}, "attribute 'bad-name'"),
            ({"name": "ok", "attributes": {"x": 1.5}}, "float is not an attribute value"),
            ({"name": "ok", "attributes": {"x": "y" * 65}}, r"65 bytes long \(UTF-8\); at most 64"),
            ({"name": "ok", "attributes": {"x": 2**63}}, "does not fit in a 64-bit integer"),
            ({"name": "ok", "capacity": {"memory": "lots"}}, "not a Kubernetes quantity"),
            ({"name": "ok", "capacity": {"mem ory": "1"}}, "capacity 'mem ory'"),
            (
                {
                    "name": "ok",
                    "attributes": {f"a{i}": i for i in range(30)},
                    "capacity": {"m": "1", "n": "1", "o": "1"},
                },
                "33 attributes and capacities; at most 32",
            ),
            (
                {"name": "ok", "taints": tuple(DeviceTaint(f"k{i}") for i in range(17))},
                "17 taints; at most 16",
            ),
        ],
        ids=[
            "upper-case",
            "empty",
            "too-long",
            "attribute-name",
            "float",
            "long-string",
            "int64",
            "quantity",
            "capacity-name",
            "too-many-entries",
            "too-many-taints",
        ],
    )
    def test_a_kinds_mistake_is_one_error_naming_the_device_and_field(self, kwargs, message):
        with pytest.raises(InvalidDraDeviceError, match=message):
            PublishedDevice(**kwargs)

    @pytest.mark.parametrize(
        ("taint", "message"),
        [
            (("bad key!",), "the key 'bad key!'"),
            (("k", "a value with spaces"), "is not a label value"),
            (("k", "", "Evict"), "'Evict' is not one of None, NoSchedule, NoExecute"),
        ],
        ids=["key", "value", "effect"],
    )
    def test_a_taint_the_api_server_would_refuse_is_refused_naming_it(self, taint, message):
        with pytest.raises(InvalidDraDeviceError, match=message):
            DeviceTaint(*taint)

    def test_the_api_form_has_one_typed_value_per_attribute(self):
        device = PublishedDevice(
            "gpu-0",
            {"healthy": True, "index": 3, "model": "H100", "driverVersion": SemVer("550.54.15")},
            {"memory": "80Gi"},
            (DeviceTaint("gpu.plugvisor.io/unhealthy"),),
        )
        assert device_json(device) == {
            "name": "gpu-0",
            "attributes": {
                "driverVersion": {"version": "550.54.15"},
                "healthy": {"bool": True},
                "index": {"int": 3},
                "model": {"string": "H100"},
            },
            "capacity": {"memory": {"value": "80Gi"}},
            "taints": [{"key": "gpu.plugvisor.io/unhealthy", "effect": "NoSchedule"}],
        }

    def test_a_version_and_a_standard_attribute_are_taken(self):
        device = PublishedDevice("gpu-0", {"driverVersion": SemVer("550.54.15"), PCIE_ROOT: "pci0000:00"})
        assert device.attributes["driverVersion"] == SemVer("550.54.15")


class TestQuantities:
    @pytest.mark.parametrize(
        ("count", "quantity"),
        [
            (80 << 30, "80Gi"),
            (16 << 30, "16Gi"),
            (512 << 20, "512Mi"),
            (1536, "1536"),
            (1024, "1Ki"),
            (0, "0"),
        ],
    )
    def test_byte_counts_get_the_largest_exact_binary_suffix(self, count, quantity):
        assert bytes_quantity(count) == quantity
        assert quantity_problem(quantity) is None

    @pytest.mark.parametrize("value", ["80Gi", "1500m", "2", "1e3", "0.5"])
    def test_quantities_are_taken(self, value):
        assert quantity_problem(value) is None

    @pytest.mark.parametrize("value", ["", "80 Gi", "Gi", "1.2.3", "80GiB"])
    def test_other_strings_are_not_quantities(self, value):
        assert quantity_problem(value) is not None


class TestAttributeLength:
    """Kubernetes counts an attribute's length in bytes (Go's len of a string), not in characters."""

    def test_a_string_of_64_characters_but_more_bytes_is_refused(self):
        assert "128 bytes long (UTF-8)" in str(validation.string_problem("é" * 64))

    @pytest.mark.parametrize("text", ["é" * 40, "a" + "é" * 40, "x" * 70, "NVIDIA ✓ " * 10])
    def test_a_value_is_cut_to_64_bytes_without_splitting_a_character(self, text):
        clipped = validation.clip_value(text)
        assert len(clipped.encode()) <= 64 and text.startswith(clipped)
        assert len(clipped.encode()) > 64 - 4  # cut at the last whole character, not shorter
        assert validation.string_problem(clipped) is None

    def test_a_short_value_is_kept_whole(self):
        assert validation.clip_value("NVIDIA H200") == "NVIDIA H200"
