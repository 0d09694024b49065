"""Allocate answers are kept per device-set version: a changed device set never gets an old answer.

The servicer is called directly with a stand-in context (no sockets): a kept
answer is served only for the version it was checked against, every call still
counts (releases, metrics), and a post-allocate hook's answers are never kept.
"""

import tracemalloc

import grpc
import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.devices import Device, DeviceSet, DeviceSpec, Health
from plugvisor.deviceplugin.hooks import ContainerAllocation, Hooks
from plugvisor.deviceplugin.server import AllocateAnswer, AllocateAnswers, PluginServer
from plugvisor.deviceplugin.snapshot import Snapshot

RESOURCE = "example.com/cached"


class AbortedError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Context:
    """What the servicer uses of grpc's context on the Allocate path: abort raises, as grpc's does."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AbortedError(code, details)


class UsedDevices:
    """Records what the servicer reports as handed out (Releases.used)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def used(self, ids) -> None:
        self.calls.append(list(ids))


def device(name: str, *, env: str | None = None, health: Health = Health.HEALTHY) -> Device:
    return Device(
        name,
        health=health,
        specs=[DeviceSpec(f"/dev/{name}", f"/dev/{name}")],
        envs={"VISIBLE": env or name},
    )


def request(*containers: list[str]) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )


def envs(response: api_pb2.AllocateResponse) -> list[dict[str, str]]:
    return [dict(c.envs) for c in response.container_responses]


def servicer(devices: DeviceSet, hooks: Hooks | None = None, releases=None):
    cell = SnapshotCell(Snapshot(devices))
    return cell, PluginServer(RESOURCE, cell, hooks or Hooks(), releases=releases)


class TestAnswerTable:
    def test_an_answer_is_found_only_at_the_version_it_was_kept_for(self):
        table = AllocateAnswers()
        answer = AllocateAnswer(api_pb2.AllocateResponse(), ("a",))
        table.put(3, b"key", answer)
        assert table.get(3, b"key") is answer
        assert table.get(4, b"key") is None
        assert table.get(3, b"key") is None  # moving on dropped it for good
        assert len(table) == 0

    def test_keeping_an_answer_for_another_version_drops_the_others(self):
        table = AllocateAnswers()
        table.put(1, b"a", AllocateAnswer(api_pb2.AllocateResponse(), ("a",)))
        table.put(2, b"b", AllocateAnswer(api_pb2.AllocateResponse(), ("b",)))
        assert table.get(2, b"a") is None
        assert len(table) == 1

    def test_the_table_is_bounded_and_drops_the_oldest_first(self):
        table = AllocateAnswers(limit=3)
        for key in (b"1", b"2", b"3", b"4"):
            table.put(0, key, AllocateAnswer(api_pb2.AllocateResponse(), ()))
        assert len(table) == 3
        assert table.get(0, b"1") is None
        assert table.get(0, b"4") is not None

    def test_the_table_is_bounded_by_bytes_too(self):
        table = AllocateAnswers(max_bytes=64_000)
        ids = tuple(f"dev-{i}" for i in range(50))  # 3200 bytes of IDs, 4 KB or so per answer
        for n in range(100):
            table.put(0, b"%d" % n + b"x" * 500, AllocateAnswer(api_pb2.AllocateResponse(), ids))
            assert table.held_bytes <= 64_000
        assert 0 < len(table) < 20
        assert table.get(0, b"99" + b"x" * 500) is not None  # the newest stays

    def test_an_answer_too_big_to_keep_is_not_kept(self):
        table = AllocateAnswers(max_bytes=64_000)
        table.put(0, b"small", AllocateAnswer(api_pb2.AllocateResponse(), ("a",)))
        table.put(0, b"x" * 5000, AllocateAnswer(api_pb2.AllocateResponse(), ("a",)))
        assert table.get(0, b"x" * 5000) is None
        assert table.get(0, b"small") is not None

    def test_keeping_a_key_again_counts_it_once(self):
        table = AllocateAnswers()
        for _ in range(3):
            table.put(0, b"key", AllocateAnswer(api_pb2.AllocateResponse(), ("a",)))
        assert table.held_bytes == AllocateAnswers.cost(
            b"key", AllocateAnswer(api_pb2.AllocateResponse(), ("a",))
        )


class TestAllocateKeepsAnswersPerVersion:
    async def test_a_repeated_request_gets_the_same_answer(self):
        _, server = servicer(DeviceSet([device("a"), device("b")]))
        first = await server.Allocate(request(["a", "b"]), Context())
        again = await server.Allocate(request(["a", "b"]), Context())
        assert envs(again) == envs(first) == [{"VISIBLE": "a,b"}]

    async def test_the_order_of_ids_and_containers_is_part_of_the_question(self):
        _, server = servicer(DeviceSet([device("a"), device("b")]))
        await server.Allocate(request(["a"], ["b"]), Context())
        assert envs(await server.Allocate(request(["b"], ["a"]), Context())) == [
            {"VISIBLE": "b"},
            {"VISIBLE": "a"},
        ]
        assert envs(await server.Allocate(request(["b", "a"]), Context())) == [{"VISIBLE": "b,a"}]

    async def test_a_changed_device_gets_a_new_answer(self):
        cell, server = servicer(DeviceSet([device("a")]))
        await server.Allocate(request(["a"]), Context())
        cell.publish(Snapshot(DeviceSet([device("a", env="renamed")])))
        assert envs(await server.Allocate(request(["a"]), Context())) == [{"VISIBLE": "renamed"}]

    @pytest.mark.parametrize(
        ("changed", "code"),
        [
            (DeviceSet([device("a", health=Health.UNHEALTHY)]), grpc.StatusCode.FAILED_PRECONDITION),
            (DeviceSet([device("b")]), grpc.StatusCode.NOT_FOUND),
        ],
        ids=["turned-unhealthy", "vanished"],
    )
    async def test_a_request_answered_before_is_checked_again_after_a_change(self, changed, code):
        cell, server = servicer(DeviceSet([device("a"), device("b")]))
        await server.Allocate(request(["a"]), Context())
        cell.publish(Snapshot(changed))
        with pytest.raises(AbortedError) as info:
            await server.Allocate(request(["a"]), Context())
        assert info.value.code == code
        assert '["a"]' in info.value.details

    async def test_a_device_that_recovers_is_handed_out_again(self):
        cell, server = servicer(DeviceSet([device("a", health=Health.UNHEALTHY)]))
        with pytest.raises(AbortedError):
            await server.Allocate(request(["a"]), Context())
        cell.publish(Snapshot(DeviceSet([device("a")])))
        assert envs(await server.Allocate(request(["a"]), Context())) == [{"VISIBLE": "a"}]

    async def test_a_rejected_request_is_rejected_every_time(self):
        _, server = servicer(DeviceSet([device("a")]))
        for _ in range(2):
            with pytest.raises(AbortedError) as info:
                await server.Allocate(request(["a", "a"]), Context())
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT

    async def test_every_call_reports_its_devices_as_used_even_when_answered_from_the_table(self):
        used = UsedDevices()
        _, server = servicer(DeviceSet([device("a"), device("b")]), releases=used)
        for _ in range(3):
            await server.Allocate(request(["a"], ["b"]), Context())
        assert used.calls == [["a", "b"]] * 3

    async def test_distinct_requests_for_thousands_of_devices_keep_little(self):
        # A client naming every device in a new order each time: each answer is right, few are kept.
        names = [f"d{i}" for i in range(3000)]
        _, server = servicer(DeviceSet([device(name) for name in names]))
        await server.Allocate(request(names), Context())
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for shift in range(1, 50):
                order = names[shift:] + names[:shift]
                response = await server.Allocate(request(order), Context())
                assert envs(response) == [{"VISIBLE": ",".join(order)}]
            del response
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 4 << 20  # each of these answers holds about 300 KB: 15 MB if all were kept

    async def test_a_post_allocate_hook_is_asked_every_time(self):
        class Counting:
            calls = 0

            def post_allocate(
                self, allocation: ContainerAllocation, snapshot: Snapshot
            ) -> ContainerAllocation:
                Counting.calls += 1
                return ContainerAllocation(envs={"CALL": str(Counting.calls)})

        _, server = servicer(DeviceSet([device("a")]), hooks=Hooks(post_allocate=Counting()))
        first = await server.Allocate(request(["a"]), Context())
        again = await server.Allocate(request(["a"]), Context())
        assert (envs(first), envs(again)) == ([{"CALL": "1"}], [{"CALL": "2"}])
