"""Plugin socket names: one rule, used by the plugin that creates them and the agent that finds them."""

from pathlib import Path

import pytest

from plugvisor.common.sockets import (
    is_plugvisor_socket,
    longest_socket_path,
    socket_name,
    socket_path_problem,
    socket_prefix,
)


@pytest.mark.parametrize("resource", ["example.com/fuse", "vendor.example/GPU_big.x", "a.b/---"])
def test_every_instance_name_starts_with_the_resources_prefix(resource):
    """The agent finds a child's sockets by the prefix the child's names start with."""
    assert socket_name(resource, "12345678") == socket_prefix(resource) + "-12345678.sock"
    assert is_plugvisor_socket(socket_name(resource))


def test_two_instances_get_different_names():
    assert socket_name("example.com/fuse") != socket_name("example.com/fuse")


def test_two_domains_with_the_same_name_part_get_different_prefixes():
    assert socket_prefix("a.example/gpu") != socket_prefix("b.example/gpu")


@pytest.mark.parametrize("resource", ["example.com/fuse", "vendor.example/" + "x" * 60])
def test_the_longest_path_is_the_length_of_every_real_one(resource):
    kubelet_dir = Path("/var/lib/kubelet/device-plugins")
    assert longest_socket_path(kubelet_dir, resource) == len(str(kubelet_dir / socket_name(resource)))


def test_a_path_too_long_for_a_unix_socket_is_named_with_the_limit():
    assert socket_path_problem(Path("/tmp/ok.sock")) is None
    problem = socket_path_problem(Path("/tmp/" + "d" * 120 + "/x.sock"))
    assert problem is not None
    assert "unix sockets allow 107" in problem


def test_other_files_are_not_ours():
    assert not is_plugvisor_socket("kubelet.sock")
    assert not is_plugvisor_socket("plugvisor-gpu-123456-abcd.json")
    assert not is_plugvisor_socket("kubelet_internal_checkpoint")
