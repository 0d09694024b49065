"""The committed gRPC modules are exactly what tools/generate_api.py produces from proto/."""

import importlib.util
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("generate_api", REPO / "tools" / "generate_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_current():
    """Editing a .proto without running `python tools/generate_api.py` fails here."""
    pytest.importorskip("grpc_tools", reason="the codegen extra (grpcio-tools) is not installed")
    generator = _load_generator()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        written = generator.generate(out)
        generated = [
            p for p in written if p.parts[:2] == ("plugvisor", "api") and p.parent != Path("plugvisor/api")
        ]
        assert generated, "the generator wrote nothing"
        stale = [
            str(rel) for rel in generated if (out / rel).read_bytes() != (REPO / "src" / rel).read_bytes()
        ]
        assert not stale, f"stale generated files (run `python tools/generate_api.py`): {stale}"


def test_wire_names_match_the_kubelet():
    """Service and method paths come from the proto package names, which must be upstream's."""
    from plugvisor.api.deviceplugin.v1beta1 import api_pb2
    from plugvisor.api.pluginregistration.v1 import api_pb2 as registration_pb2
    from plugvisor.api.podresources.v1 import api_pb2 as podresources_pb2

    services = {
        s.full_name: [m.name for m in s.methods] for s in api_pb2.DESCRIPTOR.services_by_name.values()
    }
    assert services == {
        "v1beta1.Registration": ["Register"],
        "v1beta1.DevicePlugin": [
            "GetDevicePluginOptions",
            "ListAndWatch",
            "GetPreferredAllocation",
            "Allocate",
            "PreStartContainer",
        ],
    }
    assert "v1.PodResourcesLister" in {
        s.full_name for s in podresources_pb2.DESCRIPTOR.services_by_name.values()
    }
    assert "pluginregistration.Registration" in {
        s.full_name for s in registration_pb2.DESCRIPTOR.services_by_name.values()
    }


@pytest.mark.parametrize(
    ("message", "field", "number"),
    [
        ("RegisterRequest", "version", 1),
        ("RegisterRequest", "endpoint", 2),
        ("RegisterRequest", "resource_name", 3),
        ("RegisterRequest", "options", 4),
        ("Device", "ID", 1),
        ("Device", "health", 2),
        ("Device", "topology", 3),
        ("NUMANode", "ID", 1),
        ("ContainerPreferredAllocationRequest", "available_deviceIDs", 1),
        ("ContainerPreferredAllocationRequest", "must_include_deviceIDs", 2),
        ("ContainerPreferredAllocationRequest", "allocation_size", 3),
        ("ContainerAllocateRequest", "devices_ids", 1),
        ("ContainerAllocateResponse", "envs", 1),
        ("ContainerAllocateResponse", "mounts", 2),
        ("ContainerAllocateResponse", "devices", 3),
        ("ContainerAllocateResponse", "annotations", 4),
        ("ContainerAllocateResponse", "cdi_devices", 5),
        ("DeviceSpec", "permissions", 3),
        ("Mount", "read_only", 3),
        ("DevicePluginOptions", "get_preferred_allocation_available", 2),
    ],
)
def test_field_numbers_are_the_wire_contract(message, field, number):
    from plugvisor.api.deviceplugin.v1beta1 import api_pb2

    assert api_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == number


def test_dra_wire_names_match_the_kubelet():
    """The DRA services travel under upstream's package names: the kubelet dials exactly these paths."""
    from plugvisor.api.dra.v1 import api_pb2 as dra_v1
    from plugvisor.api.dra.v1beta1 import api_pb2 as dra_v1beta1
    from plugvisor.api.drahealth.v1 import api_pb2 as health_v1
    from plugvisor.api.drahealth.v1alpha1 import api_pb2 as health_v1alpha1

    def services(module):
        return {s.full_name: [m.name for m in s.methods] for s in module.DESCRIPTOR.services_by_name.values()}

    methods = ["NodePrepareResources", "NodeUnprepareResources"]
    assert services(dra_v1) == {"k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin": methods}
    assert services(dra_v1beta1) == {"k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin": methods}
    assert services(health_v1) == {"v1.DRAResourceHealth": ["NodeWatchResources"]}
    assert services(health_v1alpha1) == {"v1alpha1.DRAResourceHealth": ["NodeWatchResources"]}


@pytest.mark.parametrize(
    ("module", "message", "field", "number"),
    [
        ("dra.v1", "Claim", "namespace", 1),
        ("dra.v1", "Claim", "uid", 2),
        ("dra.v1", "Claim", "name", 3),
        ("dra.v1", "Device", "request_names", 1),
        ("dra.v1", "Device", "pool_name", 2),
        ("dra.v1", "Device", "device_name", 3),
        ("dra.v1", "Device", "cdi_device_ids", 4),
        ("dra.v1", "Device", "share_id", 5),
        ("dra.v1", "NodePrepareResourceResponse", "error", 2),
        ("dra.v1", "NodeUnprepareResourceResponse", "error", 1),
        ("dra.v1beta1", "Device", "cdi_device_ids", 4),
        ("drahealth.v1", "DeviceHealth", "device", 1),
        ("drahealth.v1", "DeviceHealth", "health", 2),
        ("drahealth.v1", "DeviceHealth", "last_updated_time", 3),
        ("drahealth.v1", "DeviceHealth", "health_check_timeout_seconds", 4),
        ("drahealth.v1", "DeviceHealth", "message", 5),
        ("drahealth.v1alpha1", "DeviceIdentifier", "device_name", 2),
    ],
)
def test_dra_field_numbers_are_the_wire_contract(module, message, field, number):
    import importlib

    api_pb2 = importlib.import_module(f"plugvisor.api.{module}.api_pb2")
    assert api_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == number


def test_dra_v1beta1_has_no_share_id():
    """share_id is v1 only; a v1beta1 answer must not carry it (a 1.32-1.33 kubelet would drop it)."""
    from plugvisor.api.dra.v1beta1 import api_pb2

    assert "share_id" not in api_pb2.DESCRIPTOR.message_types_by_name["Device"].fields_by_name
