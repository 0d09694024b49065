"""Host paths resolve inside the host root as a chroot would: no link leads out of it."""

import errno
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugvisor.common.hostpaths import HostPaths, resolve_in_root


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    (root / "run" / "cdi").mkdir(parents=True)
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("/run")  # what Debian and Ubuntu ship
    (root / "var" / "lock").symlink_to("../run/lock")
    (root / "up").symlink_to("../../../..")
    (root / "loop").symlink_to("/loop")
    (root / "a").symlink_to("b")
    (root / "b").symlink_to("a")
    return root


class TestResolveInRoot:
    def test_an_absolute_link_restarts_at_the_root_not_at_our_own_slash(self, root):
        assert resolve_in_root(root, "/var/run/cdi") == root / "run" / "cdi"

    def test_a_relative_link_is_followed_inside_the_root(self, root):
        assert resolve_in_root(root, "/var/lock/x") == root / "run" / "lock" / "x"

    def test_dot_dot_stops_at_the_root(self, root):
        assert resolve_in_root(root, "/../../../run/cdi") == root / "run" / "cdi"
        assert resolve_in_root(root, "//var//run/cdi") == root / "run" / "cdi"
        assert resolve_in_root(root, "/up/run") == root / "run"

    def test_missing_components_are_kept_as_written_for_a_write_to_create(self, root):
        assert resolve_in_root(root, "/etc/cdi/spec.json") == root / "etc" / "cdi" / "spec.json"

    def test_a_missing_component_then_dot_dot_still_resolves_what_follows(self, root):
        assert resolve_in_root(root, "/nothing/../var/run/cdi") == root / "run" / "cdi"

    def test_a_path_relative_to_the_root_means_the_same(self, root):
        assert resolve_in_root(root, "var/run/cdi") == resolve_in_root(root, "/var/run/cdi")

    def test_loops_fail_with_eloop_as_the_kernel_does(self, root):
        for path in ("/loop", "/a/x"):
            with pytest.raises(OSError, match="symbolic links") as caught:
                resolve_in_root(root, path)
            assert caught.value.errno == errno.ELOOP

    def test_the_real_root_is_the_kernel_own_resolution(self):
        assert resolve_in_root(Path("/"), "/var/run/../x") == Path("/var/run/../x")


class TestHostPaths:
    def test_every_host_path_is_resolved_inside_the_root(self, root):
        paths = HostPaths(root=root)
        assert paths.host("/var/run/cdi") == root / "run" / "cdi"
        assert paths.inside(root / "var" / "run") == root / "run"

    def test_sysfs_and_devfs_links_to_our_own_slash_stay_in_the_root(self, root):
        (root / "sys").symlink_to("/sys")
        (root / "dev").symlink_to("/realdev")
        paths = HostPaths(root=root)
        with pytest.raises(OSError, match="symbolic links"):
            _ = paths.sysfs  # /sys -> /sys inside the root is a loop, never our /sys
        assert paths.devfs == root / "realdev"

    def test_paths_named_to_the_kubelet_use_the_resolved_location(self, root):
        paths = HostPaths(root=root, spec_root=Path("/"))
        assert paths.for_kubelet(paths.host("/var/run/cdi/x.json")) == "/run/cdi/x.json"


_NAMES = st.sampled_from(["a", "b", "c", "..", "."])
_TARGETS = st.lists(st.sampled_from(["a", "b", "c", "..", "/", "x"]), min_size=1, max_size=4).map("/".join)


@settings(max_examples=150, deadline=None)
@given(
    links=st.dictionaries(st.sampled_from(["a", "b/c", "c", "b/a"]), _TARGETS, max_size=3),
    path=st.lists(_NAMES, max_size=6),
)
def test_whatever_the_links_the_result_is_under_the_root_and_link_free(tmp_path_factory, links, path):
    root = tmp_path_factory.mktemp("root")
    (root / "b").mkdir()
    for name, target in links.items():
        link = root / name
        if not link.parent.is_dir() or link.exists() or link.is_symlink():
            continue
        link.symlink_to(target)
    try:
        result = resolve_in_root(root, "/" + "/".join(path))
    except OSError as exc:
        assert exc.errno == errno.ELOOP
        return
    assert result == root or root in result.parents
    walked = root
    for part in result.relative_to(root).parts:
        walked = walked / part
        assert not walked.is_symlink(), f"{walked} is a link left unresolved"
    assert os.path.realpath(result).startswith(os.path.realpath(root))


class TestAMissingKubeletDir:
    """Created only where a kubelet's would appear: in an existing kubelet root, under its own name."""

    def test_one_that_exists_is_used(self, tmp_path):
        from plugvisor.common.hostpaths import missing_kubelet_dir_problem

        assert missing_kubelet_dir_problem(tmp_path) is None

    def test_one_in_an_existing_kubelet_root_is_a_kubelet_not_started_yet(self, tmp_path):
        from plugvisor.common.hostpaths import missing_kubelet_dir_problem

        assert missing_kubelet_dir_problem(tmp_path / "device-plugins") is None
        assert missing_kubelet_dir_problem(tmp_path / "dp") is None  # an emulated kubelet's, any name
        assert not (tmp_path / "device-plugins").exists()  # nothing created by the check

    def test_one_whose_kubelet_root_is_missing_too_is_a_typo_named_with_the_missing_level(self, tmp_path):
        from plugvisor.common.hostpaths import missing_kubelet_dir_problem

        problem = missing_kubelet_dir_problem(tmp_path / "kubelt" / "device-plugins")
        assert problem is not None
        assert (
            f"{tmp_path / 'kubelt' / 'device-plugins'}: does not exist, nor does {tmp_path / 'kubelt'}"
            in problem
        )
        assert "typo" in problem
        assert not (tmp_path / "kubelt").exists()

    @pytest.mark.parametrize("name", ["device-plugin", "device_plugins", "devices-plugins", "Device-Plugins"])
    def test_a_near_miss_of_device_plugins_is_a_typo(self, tmp_path, name):
        from plugvisor.common.hostpaths import missing_kubelet_dir_problem

        problem = missing_kubelet_dir_problem(tmp_path / name)
        assert problem is not None and f"did you mean {tmp_path / 'device-plugins'}?" in problem
