"""How a container's Allocate responses merge into what the runtime gets (kubelet-contract.md §6)."""

from __future__ import annotations

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.emulators.kubelet import runtime_config


def response(**fields: object) -> api_pb2.ContainerAllocateResponse:
    return api_pb2.ContainerAllocateResponse(**fields)  # type: ignore[arg-type]


class TestMerge:
    def test_the_first_value_wins_and_a_different_later_one_is_a_conflict(self) -> None:
        """Envs and annotations merge by key; only differing values count as conflicts."""
        merged = runtime_config.merge(
            [
                ("a.io/x", response(envs={"K": "1", "SAME": "s"}, annotations={"n": "1"})),
                ("b.io/y", response(envs={"K": "2", "SAME": "s", "OTHER": "o"}, annotations={"n": "2"})),
            ]
        )
        assert dict(merged.envs) == {"K": "1", "SAME": "s", "OTHER": "o"}
        assert dict(merged.annotations) == {"n": "1"}
        assert [(c.kind, c.key, c.kept, c.ignored, c.resource) for c in merged.conflicts] == [
            ("env", "K", "1", "2", "b.io/y"),
            ("annotation", "n", "1", "2", "b.io/y"),
        ]

    def test_devices_and_mounts_are_keyed_by_container_path(self) -> None:
        """A second device or mount at the same container path is dropped; mounts take the path as name."""
        merged = runtime_config.merge(
            [
                (
                    "a.io/x",
                    response(
                        devices=[
                            api_pb2.DeviceSpec(container_path="/dev/x", host_path="/dev/x0", permissions="rw")
                        ],
                        mounts=[api_pb2.Mount(container_path="/lib", host_path="/h/lib", read_only=True)],
                    ),
                ),
                (
                    "b.io/y",
                    response(
                        devices=[
                            api_pb2.DeviceSpec(container_path="/dev/x", host_path="/dev/x1", permissions="r")
                        ],
                        mounts=[api_pb2.Mount(container_path="/lib", host_path="/h/lib")],
                    ),
                ),
            ]
        )
        assert merged.devices == (runtime_config.RuntimeDevice("/dev/x0", "/dev/x", "rw"),)
        assert merged.mounts == (runtime_config.RuntimeMount("/lib", "/lib", "/h/lib", read_only=True),)
        assert [c.kind for c in merged.conflicts] == ["device"]  # same host path for the mount: no conflict

    def test_cdi_devices_are_deduplicated_in_order(self) -> None:
        """CDI names are passed once each."""
        merged = runtime_config.merge(
            [
                (
                    "a.io/x",
                    response(
                        cdi_devices=[api_pb2.CDIDevice(name="v.io/x=1"), api_pb2.CDIDevice(name="v.io/x=2")]
                    ),
                ),
                ("b.io/y", response(cdi_devices=[api_pb2.CDIDevice(name="v.io/x=1")])),
            ]
        )
        assert merged.cdi_devices == ("v.io/x=1", "v.io/x=2")
        assert merged.to_json()["cdiDevices"] == ["v.io/x=1", "v.io/x=2"]
