"""The plugin's own metrics: created at first use (or recorders that do nothing when nobody can read them).

The per-call metric writers record exactly what prometheus-client's own observe/inc record, checked in
both of prometheus-client's storage modes: values in the process, and the multiprocess mode the agent's
children run in (values in mmap'ed files that the agent aggregates), through the exposition a scrape
would read.
"""

import subprocess
import sys

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector

from plugvisor.deviceplugin import metrics

AMOUNTS = [0.0, 0.00005, 0.0001, 0.00010001, 0.0003, 0.002, 0.5, 1.0, 29.9, 30.0, 31.0, 1e9]


def record(registry: CollectorRegistry, *, fast: bool) -> None:
    histogram = Histogram("rpc_seconds", "h", ["method"], buckets=metrics.RPC_BUCKETS, registry=registry)
    counter = Counter("handed_out", "c", ["resource"], registry=registry)
    h_child, c_child = histogram.labels("Allocate"), counter.labels("r")
    observe = metrics.observer(h_child) if fast else h_child.observe
    inc = metrics.incrementer(c_child) if fast else c_child.inc
    for amount in AMOUNTS:
        observe(amount)
        inc(3)


def exposition(registry: CollectorRegistry) -> list[str]:
    return [
        line
        for line in generate_latest(registry).decode().splitlines()
        if not line.startswith("#") and "_created" not in line
    ]


def test_in_process_values_match_observe_and_inc():
    fast, plain = CollectorRegistry(), CollectorRegistry()
    record(fast, fast=True)
    record(plain, fast=False)
    assert exposition(fast) == exposition(plain)
    assert 'rpc_seconds_bucket{le="0.0001",method="Allocate"} 3.0' in exposition(fast)


@pytest.mark.parametrize("fast", [True, False], ids=["per-call-writers", "observe-and-inc"])
def test_multiprocess_files_hold_what_observe_and_inc_write(tmp_path, monkeypatch, fast):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    record(CollectorRegistry(), fast=fast)
    values.close_all_multiprocess_files()
    aggregated = CollectorRegistry()
    MultiProcessCollector(aggregated, path=str(tmp_path))
    lines = exposition(aggregated)
    assert 'rpc_seconds_bucket{le="0.0001",method="Allocate"} 3.0' in lines
    assert 'rpc_seconds_bucket{le="+Inf",method="Allocate"} 12.0' in lines
    assert 'rpc_seconds_count{method="Allocate"} 12.0' in lines
    assert 'handed_out_total{resource="r"} 36.0' in lines


def test_children_laid_out_unlike_prometheus_clients_fall_back_to_the_public_methods():
    class Opaque:
        def observe(self, amount: float) -> None: ...

        def inc(self, amount: float = 1) -> None: ...

    opaque = Opaque()
    assert metrics.observer(opaque) == opaque.observe  # type: ignore[arg-type]
    assert metrics.incrementer(opaque) == opaque.inc  # type: ignore[arg-type]


def run(code):
    argv = [sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_every_metric_is_a_prometheus_metric_by_default():
    for name in metrics.METRICS:
        assert isinstance(getattr(metrics, name), prometheus_client.metrics.MetricWrapperBase)


def test_disabled_metrics_record_nothing_and_never_load_prometheus_client():
    result = run(
        "import sys\n"
        "from plugvisor.deviceplugin import metrics\n"
        "metrics.disable()\n"
        "metrics.RPC_SECONDS.labels('r', 'Allocate').observe(0.1)\n"
        "metrics.RPC_ERRORS.labels('r', 'Allocate', 'NOT_FOUND').inc()\n"
        "metrics.ALLOCATED_DEVICES.labels('r').inc(2)\n"
        "metrics.STREAMS.labels('r').inc(); metrics.STREAMS.labels('r').dec()\n"
        "metrics.PLUGIN_REGISTRATIONS.labels('r').inc()\n"
        "metrics.observer(metrics.RPC_SECONDS.labels('r', 'Allocate'))(0.1)\n"
        "metrics.incrementer(metrics.ALLOCATED_DEVICES.labels('r'))(2)\n"
        "print('prometheus_client' in sys.modules)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]


def test_disabling_metrics_already_in_use_is_refused():
    result = run(
        "from plugvisor.deviceplugin import metrics\n"
        "metrics.PLUGIN_REGISTRATIONS.labels('r').inc()\n"
        "metrics.disable()\n"
    )
    assert result.returncode == 1
    assert "the plugin metrics are in use already" in result.stderr


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="NOT_A_METRIC"):
        _ = metrics.NOT_A_METRIC
