"""Request checking names the offending IDs; the default allocation merges what devices carry.

Includes the property-based test the issue asks for at the unit level: arbitrary
requests either pass the checks and lead to a correct answer, or fail with the
right status code. (tests/integration/deviceplugin/test_fuzz_server.py throws the
same kind of input at a live server.)
"""

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from plugvisor.deviceplugin import allocation
from plugvisor.deviceplugin.devices import Device, DeviceSet, DeviceSpec, Health, Mount
from plugvisor.deviceplugin.errors import RequestError

DEVICES = DeviceSet(
    [
        Device(
            "d0", specs=[DeviceSpec("/dev/x0", "/host/x0")], envs={"VIS": "d0"}, cdi_devices=["v.io/c=d0"]
        ),
        Device(
            "d1", specs=[DeviceSpec("/dev/x1", "/host/x1")], envs={"VIS": "d1"}, cdi_devices=["v.io/c=d1"]
        ),
        Device("d2", health=Health.UNHEALTHY),
        Device("d3", mounts=[Mount("/m", "/host/m", read_only=True)], annotations={"a": "1"}),
    ]
)


def reject(call):
    with pytest.raises(RequestError) as info:
        call()
    return info.value


class TestCheckAllocate:
    def test_accepts_known_healthy_distinct_ids(self):
        allocation.check_allocate([["d0", "d1"], ["d3"]], DEVICES, resource="r.io/x")

    @pytest.mark.parametrize(
        ("containers", "code", "fragment"),
        [
            ([], grpc.StatusCode.INVALID_ARGUMENT, "no container requests"),
            ([[]], grpc.StatusCode.INVALID_ARGUMENT, "no device IDs"),
            ([["nope", "d0"]], grpc.StatusCode.NOT_FOUND, '["nope"]'),
            ([["../../etc"]], grpc.StatusCode.NOT_FOUND, '["../../etc"]'),
            ([["d2"]], grpc.StatusCode.FAILED_PRECONDITION, '["d2"]'),
            ([["d0", "d0"]], grpc.StatusCode.INVALID_ARGUMENT, "more than once"),
            ([["d0"], ["d0"]], grpc.StatusCode.INVALID_ARGUMENT, "also requested by container request 0"),
        ],
        ids=["empty", "no-ids", "unknown", "path-like", "unhealthy", "repeated", "shared-across-containers"],
    )
    def test_rejects_with_status_and_the_offending_ids(self, containers, code, fragment):
        err = reject(lambda: allocation.check_allocate(containers, DEVICES, resource="r.io/x"))
        assert err.code == code
        assert fragment in err.message

    def test_long_id_lists_are_capped_in_messages(self):
        ids = [f"n{i}" for i in range(30)]
        err = reject(lambda: allocation.check_allocate([ids], DEVICES, resource="r.io/x"))
        assert "and 20 more" in err.message


class TestCheckPreferred:
    def check(self, available, must, size):
        allocation.check_preferred(available, must, size, DEVICES, index=0, resource="r.io/x")

    def test_accepts_a_satisfiable_request(self):
        self.check(["d0", "d1", "d3"], ["d1"], 2)

    @pytest.mark.parametrize(
        ("available", "must", "size", "code", "fragment"),
        [
            ([], [], 1, grpc.StatusCode.INVALID_ARGUMENT, "no available"),
            (["d0", "zz"], [], 1, grpc.StatusCode.NOT_FOUND, '["zz"]'),
            (["d0", "d2"], [], 1, grpc.StatusCode.FAILED_PRECONDITION, '["d2"]'),
            (["d0", "d0"], [], 1, grpc.StatusCode.INVALID_ARGUMENT, "more than once"),
            (["d0"], ["d1"], 1, grpc.StatusCode.INVALID_ARGUMENT, "not among the available"),
            (["d0", "d1"], [], 3, grpc.StatusCode.INVALID_ARGUMENT, "cannot be met"),
            (["d0", "d1"], ["d0", "d1"], 1, grpc.StatusCode.INVALID_ARGUMENT, "smaller than"),
            (["d0"], [], 0, grpc.StatusCode.INVALID_ARGUMENT, "must be positive"),
        ],
    )
    def test_rejects_unsatisfiable_requests(self, available, must, size, code, fragment):
        err = reject(lambda: self.check(available, must, size))
        assert err.code == code
        assert fragment in err.message


class TestDefaultAllocation:
    def test_merges_nodes_mounts_envs_and_cdi_names(self):
        alloc = allocation.build_allocation(DEVICES.subset(["d1", "d0", "d3"]))
        assert [s.container_path for s in alloc.specs] == ["/dev/x1", "/dev/x0"]
        assert alloc.envs == {"VIS": "d1,d0"}
        assert alloc.annotations == {"a": "1"}
        assert alloc.cdi_devices == ("v.io/c=d1", "v.io/c=d0")
        assert [m.read_only for m in alloc.mounts] == [True]

    def test_replicas_sharing_a_node_get_it_once(self):
        shared = DeviceSet(Device(f"f{i}", specs=[DeviceSpec("/dev/fuse", "/dev/fuse")]) for i in range(3))
        assert len(allocation.build_allocation(shared).specs) == 1

    def test_default_preference_starts_with_must_include(self):
        assert allocation.default_preferred(["a", "b", "c", "d"], ["c"], 3) == ["c", "a", "b"]

    @pytest.mark.parametrize(
        ("answer", "valid"),
        [(["a", "c"], True), (["a"], False), (["a", "a"], False), (["a", "z"], False), (["a", "b"], False)],
    )
    def test_hook_answers_are_checked(self, answer, valid):
        assert allocation.is_valid_preferred(answer, ["a", "b", "c"], ["c"], 2) is valid


ids = st.sampled_from(["d0", "d1", "d2", "d3", "nope", "../x", "", "d0 "])


@given(containers=st.lists(st.lists(ids, max_size=5), max_size=3))
def test_any_allocate_request_is_either_valid_or_rejected_with_a_reason(containers):
    try:
        allocation.check_allocate(containers, DEVICES, resource="r.io/x")
    except RequestError as err:
        assert err.code in {
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION,
        }
        assert err.message
        return
    flat = [i for c in containers for i in c]
    assert containers and all(containers)
    assert len(flat) == len(set(flat))
    assert set(flat) <= DEVICES.healthy_ids


@given(available=st.lists(ids, max_size=6), must=st.lists(ids, max_size=3), size=st.integers(-2, 8))
def test_any_preference_request_is_answered_correctly_or_rejected(available, must, size):
    try:
        allocation.check_preferred(available, must, size, DEVICES, index=0, resource="r.io/x")
    except RequestError:
        return
    answer = allocation.default_preferred(available, must, size)
    assert allocation.is_valid_preferred(answer, available, must, size)
