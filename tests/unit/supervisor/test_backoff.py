"""Restart delays: immediate first retry, then exponential, capped, jittered within bounds."""

import pytest

from plugvisor.supervisor.backoff import BackoffPolicy


class TestBackoffPolicy:
    @pytest.mark.parametrize(
        ("failures", "expected"),
        [(1, 0.0), (2, 0.25), (3, 0.5), (4, 1.0), (8, 16.0), (9, 30.0), (50, 30.0), (10_000, 30.0)],
        ids=str,
    )
    def test_the_delay_doubles_from_the_second_failure_up_to_the_cap(self, failures, expected):
        """The first failure restarts at once; later ones wait twice as long each time, never past the cap."""
        assert expected == BackoffPolicy(initial=0.25, multiplier=2, cap=30).base_delay(failures)

    @pytest.mark.parametrize("rand", [0.0, 0.25, 0.5, 0.999])
    def test_jitter_stays_within_its_spread_and_under_the_cap(self, rand):
        """Jitter moves a delay by at most +-jitter of it, and a capped delay never exceeds the cap."""
        policy = BackoffPolicy(initial=1, multiplier=2, cap=8, jitter=0.2)
        assert 0.8 * 4 <= policy.delay(4, rand=lambda: rand) <= 1.2 * 4
        assert policy.delay(20, rand=lambda: rand) <= 8

    def test_jitter_spreads_delays(self):
        """Different draws give different delays: children that failed together do not restart together."""
        policy = BackoffPolicy(initial=1, multiplier=2, cap=100, jitter=0.5)
        assert policy.delay(3, rand=lambda: 0.0) < policy.delay(3, rand=lambda: 1.0)

    def test_a_crash_loop_is_named_after_enough_consecutive_failures(self):
        """``crash_loop_after`` failures in a row is what gets reported as a crash loop."""
        policy = BackoffPolicy(crash_loop_after=3)
        assert [policy.crash_looping(n) for n in (1, 2, 3, 4)] == [False, False, True, True]
