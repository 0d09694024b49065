"""The generic kind: squat-style groups of globbed paths, readable IDs, clear option errors."""

import importlib.metadata
from pathlib import Path

import pydantic
import pytest

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.validation import describe
from plugvisor.plugins.generic import KIND, GenericOptions, GenericSource

ROOT = Path("/lab")


def source(fs, options, *, files=(), spec_root=None):
    for f in files:
        fs.create_file(ROOT / f.lstrip("/"))
    paths = HostPaths(root=ROOT, kubelet_dir=Path("/kubelet"), spec_root=spec_root)
    return GenericSource(GenericOptions.model_validate(options), paths)


class TestScan:
    def test_count_hands_one_node_out_many_times(self, fs):
        devices = source(fs, {"paths": ["/dev/fuse"], "count": 3}, files=["/dev/fuse"]).scan().devices
        assert list(devices) == ["fuse-0", "fuse-1", "fuse-2"]
        spec = devices["fuse-1"].specs[0]
        assert (spec.container_path, spec.host_path, spec.permissions) == ("/dev/fuse", "/lab/dev/fuse", "rw")

    def test_a_glob_gives_one_device_per_match(self, fs):
        devices = (
            source(fs, {"paths": ["/dev/ttyUSB*"]}, files=["/dev/ttyUSB1", "/dev/ttyUSB0", "/dev/tty0"])
            .scan()
            .devices
        )
        assert list(devices) == ["ttyUSB0", "ttyUSB1"]

    def test_paths_of_a_group_pair_up_by_match_order(self, fs):
        options = {
            "groups": [
                {
                    "paths": [
                        {"path": "/dev/snd/pcmC*D0c"},
                        {"path": "/dev/snd/controlC*", "permissions": "r"},
                        {"path": "/etc/asound.conf", "type": "Mount", "readOnly": True, "limit": 2},
                    ]
                }
            ]
        }
        files = [
            "/dev/snd/pcmC0D0c",
            "/dev/snd/pcmC1D0c",
            "/dev/snd/controlC0",
            "/dev/snd/controlC1",
            "/etc/asound.conf",
        ]
        devices = source(fs, options, files=files).scan().devices
        assert list(devices) == ["pcmC0D0c_controlC0_asound.conf", "pcmC1D0c_controlC1_asound.conf"]
        second = devices["pcmC1D0c_controlC1_asound.conf"]
        assert [s.host_path for s in second.specs] == ["/lab/dev/snd/pcmC1D0c", "/lab/dev/snd/controlC1"]
        assert second.specs[1].permissions == "r"
        assert [(m.container_path, m.read_only) for m in second.mounts] == [("/etc/asound.conf", True)]

    def test_a_group_is_as_long_as_its_scarcest_reusable_path(self, fs):
        options = {"groups": [{"paths": ["/dev/a*", "/dev/b"]}]}
        devices = source(fs, options, files=["/dev/a0", "/dev/a1", "/dev/b"]).scan().devices
        assert len(devices) == 1

    def test_missing_paths_give_no_devices(self, fs):
        fs.create_dir(ROOT / "dev")
        assert len(source(fs, {"paths": ["/dev/fuse"]}).scan().devices) == 0

    def test_mount_path_renames_the_node_in_the_container(self, fs):
        options = {"paths": [{"path": "/dev/ttyACM0", "mountPath": "/dev/modem"}]}
        devices = source(fs, options, files=["/dev/ttyACM0"]).scan().devices
        assert devices["ttyACM0"].specs[0].container_path == "/dev/modem"

    def test_spec_root_renames_host_paths_for_a_mounted_host(self, fs):
        devices = (
            source(fs, {"paths": ["/dev/fuse"]}, files=["/dev/fuse"], spec_root=Path("/")).scan().devices
        )
        assert devices["fuse"].specs[0].host_path == "/dev/fuse"

    def test_groups_matching_the_same_path_get_distinct_ids(self, fs):
        options = {"groups": [{"paths": ["/dev/fuse"]}, {"paths": ["/dev/fuse"]}]}
        devices = source(fs, options, files=["/dev/fuse"]).scan().devices
        assert list(devices) == ["fuse", "g1-fuse"]

    def test_overlong_ids_are_shortened_but_stay_unique(self, fs):
        long_a = "/dev/" + "a" * 70
        long_b = "/dev/" + "a" * 69 + "b"
        devices = source(fs, {"paths": ["/dev/a*"]}, files=[long_a, long_b]).scan().devices
        assert len(devices) == 2
        assert all(len(i) <= 63 for i in devices)

    def test_watches_the_directories_where_matches_can_appear(self, fs):
        src = source(
            fs, {"paths": ["/dev/bus/usb/*/*"]}, files=["/dev/bus/usb/001/002", "/dev/bus/usb/002/001"]
        )
        assert [str(p) for p in src.scan().watch] == [
            "/lab/dev/bus/usb",
            "/lab/dev/bus/usb/001",
            "/lab/dev/bus/usb/002",
        ]

    def test_a_root_with_glob_characters_is_taken_literally(self, fs):
        root = Path("/lab[1]")
        fs.create_file(root / "dev/fuse")
        src = GenericSource(GenericOptions(paths=["/dev/fuse"]), HostPaths(root=root))
        assert list(src.scan().devices) == ["fuse"]


class TestOptions:
    @pytest.mark.parametrize(
        ("options", "expected"),
        [
            ({}, "(top level): 'paths' must list at least one path"),
            ({"paths": ["dev/fuse"]}, "paths[0].path: 'dev/fuse' must be an absolute path"),
            (
                {"paths": ["/dev/../etc/shadow"]},
                "paths[0].path: '/dev/../etc/shadow' must not contain '..'",
            ),
            # A path the kernel cannot open is refused, not a device that never appears.
            ({"paths": ["/dev/fu\x00se"]}, "paths[0].path: '/dev/fu\\x00se' contains a NUL byte"),
            ({"paths": ["/dev/fuse\n"]}, "paths[0].path: '/dev/fuse\\n' contains a control character"),
            ({"paths": ["/" + "d" * 5000]}, "is longer than 4096 bytes (PATH_MAX)"),
            (
                {"groups": [{"paths": [{"path": "/dev/x", "mountPath": "/x\ty"}]}]},
                "contains a control character",
            ),
            ({"paths": ["/dev/fuse"], "count": 0}, "count: Input should be greater than or equal to 1"),
            # YAML's `count: true` or `count: "5"` is a mistake, not the number 1 or 5.
            ({"paths": ["/dev/fuse"], "count": True}, "count: Input should be a valid integer"),
            ({"paths": ["/dev/fuse"], "count": "5"}, "count: Input should be a valid integer"),
            (
                {"paths": [{"path": "/dev/x", "readOnly": "no"}]},
                "paths[0].readOnly: Input should be a valid boolean",
            ),
            ({"paths": ["/dev/fuse"], "colour": "red"}, "colour: unknown key"),
            ({"paths": ["/dev/fuse"], "groups": [{"paths": ["/dev/x"]}]}, "give either 'paths'"),
            (
                {"paths": [{"path": "/dev/x", "permissions": "x"}]},
                "paths[0].permissions: String should match",
            ),
            (
                {"paths": [{"path": "/dev/x", "type": "Socket"}]},
                "paths[0].type: Input should be 'Device' or 'Mount'",
            ),
        ],
    )
    def test_bad_options_are_named_by_field(self, options, expected):
        with pytest.raises(pydantic.ValidationError) as info:
            GenericOptions.model_validate(options)
        assert expected in describe(info.value, source="node.yaml")

    def test_the_kind_builds_from_plain_mappings(self, fs):
        built = KIND.build(
            {"paths": ["/dev/fuse"], "count": 2}, HostPaths(root=ROOT), resource="example.com/fuse"
        )
        fs.create_file(ROOT / "dev/fuse")
        assert len(built.scan().devices) == 2


class TestKindRegistry:
    def test_an_unknown_kind_lists_the_installed_ones(self):
        from plugvisor.plugins.kinds import UnknownKindError, get_kind

        with pytest.raises(
            UnknownKindError, match=r"unknown plugin kind 'nope': installed kinds are .*generic"
        ):
            get_kind("nope")

    def test_a_broken_entry_point_is_reported_by_name(self, monkeypatch):
        from importlib.metadata import EntryPoint

        from plugvisor.plugins import kinds

        broken = EntryPoint(
            name="broken", value="plugvisor.plugins.generic:NOT_THERE", group=kinds.ENTRY_POINT_GROUP
        )
        monkeypatch.setattr(
            importlib.metadata,
            "entry_points",
            lambda **kw: [broken] if kw.get("name") in (None, "broken") else [],
        )
        with pytest.raises(
            kinds.KindLoadError, match=r"'broken' is registered as .*NOT_THERE but cannot be loaded"
        ):
            kinds.get_kind("broken")

    def test_a_third_party_kind_is_loaded_through_its_entry_point(self, monkeypatch):
        from importlib.metadata import EntryPoint

        from plugvisor.plugins import kinds

        widget = EntryPoint(
            name="widget", value="plugvisor.plugins.generic:KIND", group=kinds.ENTRY_POINT_GROUP
        )
        monkeypatch.setattr(
            importlib.metadata, "entry_points", lambda **kw: [widget] if kw.get("name") == "widget" else []
        )
        assert kinds.get_kind("widget") is KIND

    def test_the_built_in_kinds_are_the_ones_pyproject_registers(self):
        from plugvisor.plugins import kinds

        registered = {
            ep.name: ep.value
            for ep in importlib.metadata.entry_points(group=kinds.ENTRY_POINT_GROUP)
            if ep.dist is not None and ep.dist.name == "plugvisor"
        }
        assert registered == dict(kinds.BUILTIN_KINDS)
        for name in kinds.BUILTIN_KINDS:
            assert kinds.get_kind(name).name == name

    def test_a_built_in_kind_is_found_without_reading_package_metadata(self, monkeypatch):
        from plugvisor.plugins import kinds

        def no_metadata(**_kw):
            raise AssertionError("a built-in kind must not need the installed packages' metadata")

        monkeypatch.setattr(importlib.metadata, "entry_points", no_metadata)
        assert kinds.get_kind("generic") is KIND


class TestHostRootConfinement:
    def test_an_absolute_link_in_the_host_root_resolves_inside_it(self, fs):
        fs.create_file("/realdev/fuse")  # this process's own: must never be handed out
        fs.create_file(ROOT / "realdev/fuse")
        fs.create_symlink(ROOT / "dev", "/realdev")
        paths = HostPaths(root=ROOT, kubelet_dir=Path("/kubelet"))
        devices = GenericSource(GenericOptions(paths=["/dev/fuse"]), paths).scan().devices
        assert [s.host_path for d in devices.values() for s in d.specs] == ["/lab/realdev/fuse"]

    def test_nothing_outside_the_host_root_matches(self, fs):
        fs.create_file("/realdev/ttyUSB0")
        fs.create_symlink(ROOT / "dev", "/realdev")
        paths = HostPaths(root=ROOT, kubelet_dir=Path("/kubelet"))
        assert len(GenericSource(GenericOptions(paths=["/dev/ttyUSB*"]), paths).scan().devices) == 0


class TestLinks:
    """A matched path that is a link: the runtime follows it on the host, so it is checked inside the root."""

    def scan(self, fs):
        paths = HostPaths(root=ROOT, kubelet_dir=Path("/kubelet"))
        return GenericSource(GenericOptions(paths=["/dev/link*"]), paths).scan().devices

    def test_a_dangling_link_is_published_unhealthy(self, fs):
        fs.create_symlink(ROOT / "dev/link0", "/etc/does-not-exist")
        assert not self.scan(fs)["link0"].healthy

    def test_a_link_whose_target_exists_only_outside_the_root_is_unhealthy(self, fs):
        fs.create_file("/etc/only-here")  # this process's own, not the host's
        fs.create_symlink(ROOT / "dev/link0", "/etc/only-here")
        assert not self.scan(fs)["link0"].healthy

    def test_a_link_to_a_node_inside_the_root_is_healthy(self, fs):
        fs.create_file(ROOT / "dev/real0")
        fs.create_symlink(ROOT / "dev/link0", "/dev/real0")
        fs.create_symlink(ROOT / "dev/link1", "real0")
        devices = self.scan(fs)
        assert devices["link0"].healthy and devices["link1"].healthy
        assert devices["link0"].specs[0].host_path == "/lab/dev/link0"  # the runtime follows it itself

    def test_a_link_that_comes_back_to_life_is_healthy_at_the_next_scan(self, fs):
        fs.create_symlink(ROOT / "dev/link0", "/dev/real0")
        assert not self.scan(fs)["link0"].healthy
        fs.create_file(ROOT / "dev/real0")
        assert self.scan(fs)["link0"].healthy
