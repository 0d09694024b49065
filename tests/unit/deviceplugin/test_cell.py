"""The latest-value cell: readers never end on a stale value, and equal values wake nobody."""

import asyncio

import pytest

from plugvisor.deviceplugin.cell import CellClosedError, SnapshotCell


async def test_a_slow_reader_skips_intermediate_values_but_gets_the_last():
    cell = SnapshotCell(0)
    for value in range(1, 6):
        cell.publish(value)
    version, value = await cell.wait_newer(0)
    assert (version, value) == (5, 5)


async def test_every_reader_sees_every_change_it_waits_for():
    cell = SnapshotCell("a")
    readers = [asyncio.create_task(cell.wait_newer(0)) for _ in range(3)]
    await asyncio.sleep(0)
    cell.publish("b")
    assert [await r for r in readers] == [(1, "b")] * 3


async def test_publishing_an_equal_value_changes_nothing():
    cell = SnapshotCell((1, 2))
    assert cell.publish((1, 2)) is False
    assert cell.version == 0
    assert cell.publish((1, 3)) is True
    assert cell.version == 1


async def test_closing_wakes_readers_with_an_error():
    cell = SnapshotCell(0)
    reader = asyncio.create_task(cell.wait_newer(0))
    await asyncio.sleep(0)
    cell.close()
    with pytest.raises(CellClosedError):
        await reader
    with pytest.raises(CellClosedError):
        cell.publish(1)
