"""Bounded soak: a crash loop, hundreds of random SIGKILLs and a hundred kubelet restarts, then nothing amiss.

Bounded to well under a minute on two cores; the figures of interest are printed
by bench/bench_supervisor.py, this test only checks outcomes.
"""

import asyncio
import os
import random
import signal

import pytest

from .conftest import DISK, EXPECTED, FUSE, SERIAL, processes_of, registered_all

KILLS = 200
KUBELET_RESTARTS = 100


def all_running(children):
    return len(children) == 3 and all(c["state"] == "RUNNING" and c["registered"] for c in children.values())


@pytest.mark.soak
async def test_soak(node, kubelet, agents):
    """Crash loop, random kills and kubelet restarts leave every resource registered, nothing orphaned."""
    node.write_config(
        supervisor={"restart": {"initialDelay": 0.05, "maxDelay": 0.4, "resetAfter": 2, "crashLoopAfter": 4}}
    )
    agent = await agents()
    await agent.wait_state(all_running, timeout=20)
    rng = random.Random(6)

    # 1. A crash-looping child: killed as soon as each new process appears. Its backoff grows to
    #    the cap and is reported; the others keep their processes and registrations throughout.
    steady = {name: agent.children()[name]["pid"] for name in (SERIAL, DISK)}
    steady_registrations = {
        name: len([r for r in kubelet.registrations if r.resource == name]) for name in steady
    }
    seen_delays = []
    looping_reported = False
    for _ in range(8):
        await agent.wait_state(lambda c: c[FUSE]["state"] in ("STARTING", "RUNNING") and c[FUSE]["pid"])
        os.kill(agent.children()[FUSE]["pid"], signal.SIGKILL)
        await agent.wait_state(
            lambda c: c[FUSE]["state"] == "BACKOFF" or c[FUSE]["restarts"] > len(seen_delays)
        )
        child = agent.children()[FUSE]
        seen_delays.append(child["backoff_delay"] or 0)
        looping_reported = looping_reported or child["crash_looping"]
        for name in steady:
            assert kubelet.resource(name).registered, f"{name} lost its registration during the crash loop"
    assert max(seen_delays) >= 0.3, f"no backoff visible: {seen_delays}"
    assert looping_reported
    assert {name: agent.children()[name]["pid"] for name in steady} == steady
    assert {
        name: len([r for r in kubelet.registrations if r.resource == name]) for name in steady
    } == steady_registrations
    await agent.wait_state(all_running, timeout=10)

    # 2. Random SIGKILLs of any child, without waiting for the previous one to come back.
    killed = set()
    while len(killed) < KILLS:
        pid = agent.children()[rng.choice(list(EXPECTED))]["pid"]
        if pid and pid not in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended on its own since the state was written: checked below
                continue
            killed.add(pid)
        await asyncio.sleep(rng.uniform(0.005, 0.04))
    await kubelet.wait_for(registered_all(EXPECTED), timeout=30)

    # 3. Kubelet restarts, each waiting until everything is registered with the new kubelet.
    for _ in range(KUBELET_RESTARTS):
        await kubelet.restart()
        generation = kubelet.generation
        await kubelet.wait_for(
            lambda k, g=generation: (
                registered_all(EXPECTED)(k)
                and all(
                    max(r.generation for r in k.registrations if r.resource == name and r.accepted) == g
                    for name in EXPECTED
                )
            ),
            timeout=15,
        )

    # The end state: right devices, the supervisor alive, one process per child plus the fork
    # server, one socket per resource, and a state that says so.
    await agent.wait_state(all_running, timeout=15)
    assert agent.proc.returncode is None
    for name, count in EXPECTED.items():
        view = kubelet.resource(name)
        assert (view.capacity, view.allocatable) == (count, count)
    assert len(processes_of(node)) == 4, processes_of(node)
    assert len(node.sockets()) == 3, node.sockets()
    state = agent.state()
    assert state["supervisor"]["kubelet_restarts"] == KUBELET_RESTARTS
    causes = {c["resource"]: c["restarts_by_cause"] for c in state["children"]}
    unexpected = {
        name: {k: v for k, v in by.items() if k not in ("killed", "kubelet-restart")}
        for name, by in causes.items()
    }
    assert not any(unexpected.values()), f"children ended for other causes than ours: {unexpected}"
    assert sum(by.get("killed", 0) for by in causes.values()) == KILLS + len(seen_delays), causes
    assert await agent.stop() == 0
    assert node.sockets() == []
