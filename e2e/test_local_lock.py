"""The local cluster (e2e/local) is taken down only by the run that holds the machine's lock."""

from __future__ import annotations

import pytest

from .local.cluster import LocalCluster


def test_a_run_that_never_got_the_lock_takes_nothing_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session whose setup gave up waiting for another owner still runs its teardown: that swept the
    other owner's running cluster away (its containers, components, bridge and state directory)."""
    cluster = LocalCluster(progress=lambda _: None)
    touched: list[str] = []
    monkeypatch.setattr(cluster, "sweep", lambda: touched.append("sweep"))
    monkeypatch.setattr(cluster, "_stop", lambda name, timeout=30: touched.append(name))
    assert cluster.lock is None
    cluster.down()
    assert touched == []
