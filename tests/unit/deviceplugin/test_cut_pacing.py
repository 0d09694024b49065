"""Registering again after the kubelet cut our stream: at once the first time, then backing off."""

from plugvisor.deviceplugin.runtime import CUT_PAUSE_MAX, CutPacing


async def test_a_first_cut_waits_nothing_and_cut_after_cut_doubles_the_wait_up_to_the_bound():
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    pacing = CutPacing(sleep)
    waits = [await pacing.pause(lasted=0.1) for _ in range(10)]
    assert waits == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, CUT_PAUSE_MAX, CUT_PAUSE_MAX, CUT_PAUSE_MAX]
    assert slept == waits[1:]


async def test_a_registration_that_lasted_starts_the_count_again():
    async def sleep(seconds: float) -> None:
        pass

    pacing = CutPacing(sleep)
    for _ in range(4):
        await pacing.pause(lasted=0.1)
    assert await pacing.pause(lasted=CUT_PAUSE_MAX + 1) == 0.0
    assert await pacing.pause(lasted=0.1) == 0.5
