"""/metrics on a big node: one rendering shared by concurrent scrapes, made in slices, at most two alive."""

import asyncio
import os

import pytest

from plugvisor.common import monitoring
from plugvisor.common.monitoring import DeviceDescription, DeviceReport, Reading, ResourceReport
from plugvisor.supervisor import metrics as metrics_
from plugvisor.supervisor.metrics import Metrics, ScrapeGate

RESOURCE = "plugvisor.io/vf"


def write_report(monitor_dir, devices: int, *, pid: int | None = None) -> None:
    description = DeviceDescription(
        kind="vf",
        pci_address="0000:3b:00.0",
        readings=(Reading("plugvisor_device_netdev_up", 1.0, {"interface": "ens1f0v0", "role": "vf"}),),
    )
    report = ResourceReport(
        RESOURCE,
        os.getpid() if pid is None else pid,
        1_700_000_000.0,
        tuple(DeviceReport(f"vf{i}", True, (0,), description) for i in range(devices)),
    )
    monitoring.write_report(monitor_dir, report)


def snapshot():
    return {
        "supervisor": {"kubelet_restarts": 0, "ready": True},
        "children": [
            {
                "resource": RESOURCE,
                "pid": os.getpid(),
                "state": "RUNNING",
                "registered": True,
                "registrations": 1,
                "devices": None,
                "restarts_by_cause": {},
                "crash_looping": False,
                "backoff_delay": None,
            }
        ],
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def monitor_dir(tmp_path):
    write_report(tmp_path, 2000)
    return tmp_path


class TestSharing:
    async def test_concurrent_scrapes_share_one_rendering(self, monitor_dir):
        metrics = Metrics(snapshot, multiproc_dir=None, monitor_dir=monitor_dir)
        bodies = await asyncio.gather(*(metrics.acquire() for _ in range(50)))
        assert metrics.renderings == 1
        assert len({id(body) for body in bodies}) == 1
        assert bodies[0].readers == 50
        assert bodies[0].data.count(b"\nplugvisor_device_info{") == 2000

    async def test_a_scrape_after_the_reuse_window_gets_a_fresh_rendering(self, monitor_dir):
        clock = Clock()
        metrics = Metrics(snapshot, multiproc_dir=None, monitor_dir=monitor_dir, clock=clock)
        first = await metrics.acquire()
        metrics.release(first)
        clock.now += metrics_.REUSE_FOR / 2
        assert await metrics.acquire() is first
        clock.now += metrics_.REUSE_FOR
        assert await metrics.acquire() is not first
        assert metrics.renderings == 2

    async def test_no_more_than_two_renderings_are_alive_whatever_slow_readers_do(self, monitor_dir):
        """A reader that holds a rendering keeps it alive; later scrapes then share the newest one."""
        clock = Clock()
        metrics = Metrics(snapshot, multiproc_dir=None, monitor_dir=monitor_dir, clock=clock)
        slow = await metrics.acquire()  # never released (yet)
        clock.now += 10
        second = await metrics.acquire()
        assert second is not slow
        for _ in range(5):
            clock.now += 10
            assert await metrics.acquire() is second  # stale, but no third copy while `slow` reads
        assert metrics.renderings == 2
        metrics.release(slow)
        clock.now += 10
        assert await metrics.acquire() not in (slow, second)

    async def test_an_unchanged_report_is_not_parsed_again(self, monitor_dir, monkeypatch):
        metrics = Metrics(snapshot, multiproc_dir=None, monitor_dir=monitor_dir)
        first = await metrics.render()
        monkeypatch.setattr(monitoring, "parse_device", lambda line: pytest.fail("parsed again"))
        assert await metrics.render() == first

    async def test_a_report_of_an_earlier_process_is_not_shown(self, tmp_path):
        write_report(tmp_path, 10, pid=os.getpid() + 1)
        text = await Metrics(snapshot, multiproc_dir=None, monitor_dir=tmp_path).render()
        assert b"plugvisor_device_info{" not in text


class TestSlices:
    async def test_a_big_rendering_lets_the_loop_run_in_between(self, monitor_dir, monkeypatch):
        """Supervision, /healthz and the watchdog run on the same loop: a rendering must not hold it."""
        monkeypatch.setattr(metrics_, "SLICE_SECONDS", 0.0)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        await Metrics(snapshot, multiproc_dir=None, monitor_dir=monitor_dir).render()
        task.cancel()
        assert ticks - before >= 1000  # the other task ran between slices of 2,000 devices

    async def test_scrapes_give_way_to_starting_children_for_a_bounded_time(self, monkeypatch):
        """While children start, a scrape waits; never more than START_PRIORITY in all, however many start."""
        gate = ScrapeGate()
        slept = []

        async def sleep(delay):
            slept.append(delay)

        monkeypatch.setattr(asyncio, "sleep", sleep)
        pause = gate.pacer()
        gate.follow(lambda window: 0.0)
        await pause()
        assert slept == [0.0]
        gate.follow(lambda window: metrics_.time.monotonic() + 3600)  # children keep starting
        for _ in range(5):
            await pause()
        assert sum(slept) == pytest.approx(metrics_.START_PRIORITY)
        assert slept[-1] == 0.0
