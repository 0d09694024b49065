"""The published device model: what the API server would refuse is refused where a kind builds it."""

import pytest

from plugvisor.dra.devices import (
    NUMA_NODE,
    PCIE_ROOT,
    InvalidDraDeviceError,
    PublishedDevice,
    SemVer,
    bytes_quantity,
    qualified_name_problem,
    quantity_problem,
)


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
        assert qualified_name_problem(name) is None

    @pytest.mark.parametrize(
        "name",
        ["", "1model", "has-dash", "a" * 33, "Upper.Domain/x", "/x", "domain/", "a/b/c", f"{'a' * 64}/x"],
    )
    def test_other_names_are_refused(self, name):
        assert qualified_name_problem(name) is not None


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
            ({"name": "ok", "attributes": {"x": "y" * 65}}, "longer than 64"),
            ({"name": "ok", "capacity": {"memory": "lots"}}, "not a Kubernetes quantity"),
            ({"name": "ok", "capacity": {"mem ory": "1"}}, "capacity 'mem ory'"),
        ],
        ids=[
            "upper-case",
            "empty",
            "too-long",
            "attribute-name",
            "float",
            "long-string",
            "quantity",
            "capacity-name",
        ],
    )
    def test_a_kinds_mistake_is_one_error_naming_the_device_and_field(self, kwargs, message):
        with pytest.raises(InvalidDraDeviceError, match=message):
            PublishedDevice(**kwargs)

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
