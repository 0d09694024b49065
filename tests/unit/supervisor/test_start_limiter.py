"""At most N children start at once; the others wait their turn, without a process to blame."""

import asyncio
import os

from plugvisor.supervisor.config import ChildSpec
from plugvisor.supervisor.spawner import FakeSpawner, SpawnError, StartLimiter


def spec(index: int) -> ChildSpec:
    return ChildSpec(f"example.com/r{index}", "generic", ("plugin", "generic"))


def spawn_all(limiter: StartLimiter, count: int) -> list[object]:
    answers: list[object] = [None] * count
    for index in range(count):
        limiter.spawn(spec(index), lambda result, index=index: answers.__setitem__(index, result))
    return answers


def test_only_the_first_slots_are_spawned_and_each_freed_slot_starts_the_next_in_order():
    fake = FakeSpawner()
    limiter = StartLimiter(fake, slots=2)
    answers = spawn_all(limiter, 5)
    assert answers == [100, 101, None, None, None]
    limiter.started(100)  # it serves
    assert answers[2] == 102 and answers[3:] == [None, None]
    fake.exit(101, -9)  # died before it served
    limiter.reap()
    assert answers[3] == 103 and answers[4] is None
    limiter.started(100)  # a second report of the same process frees nothing more
    assert answers[4] is None
    limiter.started(102)
    assert answers[4] == 104


def test_a_spawn_that_fails_frees_its_slot():
    fake = FakeSpawner(fail_next=["EAGAIN"])
    limiter = StartLimiter(fake, slots=1)
    answers = spawn_all(limiter, 2)
    assert isinstance(answers[0], SpawnError)
    assert answers[1] == 100


def test_closing_fails_the_waiting_spawns():
    fake = FakeSpawner()
    limiter = StartLimiter(fake, slots=1)
    answers = spawn_all(limiter, 3)
    asyncio.run(limiter.close())
    assert answers[0] == 100
    assert [str(answer) for answer in answers[1:]] == ["the agent is stopping"] * 2


def test_the_registration_timeout_counts_from_the_process_not_from_the_wait_for_a_slot():
    """A spawn that waited 60 s for its turn is not restarted as unregistered the moment it starts."""
    from plugvisor.supervisor.clock import FakeClock
    from plugvisor.supervisor.supervisor import Supervisor

    from .conftest import node_config

    clock = FakeClock()
    fake = FakeSpawner(deferred=True)
    supervisor = Supervisor(
        node_config("example.com/gpu", registrationTimeout=20),
        spawner=fake,
        clock=clock,
        socket_exists=lambda name: True,  # the kubelet is up all along
    )
    supervisor.start()
    clock.advance(60)  # waiting: no process, nothing to blame
    supervisor.tick()
    pid = fake.answer()
    supervisor.tick()
    clock.advance(19)
    supervisor.tick()
    assert not fake.signals, "restarted as unregistered although it has existed for 19 s only"
    clock.advance(2)
    supervisor.tick()
    assert (pid, 15) in fake.signals


def test_fewer_children_start_at_once_while_they_are_started_by_exec_instead_of_the_fork_server():
    """A fresh interpreter's start costs ~10 times a fork's CPU: the slots shrink with the fallback."""
    fake = FakeSpawner()
    limiter = StartLimiter(fake)
    cores = len(os.sched_getaffinity(0))
    assert limiter.slots == 8 * cores
    fake.fallback = "a new fork server did not start: it exited"
    answers = spawn_all(limiter, 2 * cores + 1)
    assert limiter.slots == 2 * cores
    assert answers.count(None) == 1
    fake.fallback = None
    assert limiter.slots == 8 * cores
