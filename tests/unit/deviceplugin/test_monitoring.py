"""Device reports, owners and the per-device families: round trips, labels, bounded cardinality."""

import os

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from plugvisor.common import device_metrics, monitoring
from plugvisor.common.monitoring import DeviceDescription, Holder, Owners, Reading
from plugvisor.deviceplugin.device_monitor import build_report
from plugvisor.deviceplugin.devices import Device, DeviceSet, Health

GPU = "plugvisor.io/gpu"


def report():
    devices = DeviceSet([Device("g0", numa_nodes=[0]), Device("g1", health=Health.UNHEALTHY, numa_nodes=[1])])
    descriptions = {
        "g0": DeviceDescription(
            kind="gpu",
            pci_address="0000:03:00.0",
            identity={"uuid": "GPU-0"},
            readings=[Reading("plugvisor_device_temperature_celsius", 41.0, {"sensor": "edge"})],
        ),
        "g1": DeviceDescription(
            kind="gpu", pci_address="0000:04:00.0", cause="2 AER fatal error(s)", cause_code="aer-fatal"
        ),
    }
    return build_report(GPU, devices, descriptions, now=100.0)


def samples(view):
    return {
        (
            metric.name if metric.type != "counter" else metric.name + "_total",
            tuple(sorted(s.labels.items())),
        ): s.value
        for metric in device_metrics.collect(view)
        for s in metric.samples
        if not s.name.endswith("_created")
    }


def labels_of(found, name):
    return [dict(labels) for (metric, labels) in found if metric == name]


def test_readings_must_name_a_known_family_and_its_labels():
    with pytest.raises(monitoring.InvalidReadingError, match="unknown telemetry family"):
        Reading("plugvisor_device_mood", 1.0)
    with pytest.raises(monitoring.InvalidReadingError, match=r"takes labels \['sensor'\]"):
        Reading("plugvisor_device_temperature_celsius", 1.0, {"probe": "edge"})
    with pytest.raises(monitoring.InvalidReadingError, match="unknown identity labels"):
        DeviceDescription(identity={"serial": "x"})


def test_a_kind_may_use_its_own_cause_words_in_the_labels_shape():
    """The built-in kinds' causes are no closed list: a kind says ``ecc-error`` and the label says so."""
    described = DeviceDescription(cause="the card reports ecc_error", cause_code="ecc-error")
    assert described.cause_code == "ecc-error"
    for bad in ("ECC error", "ecc_error", "-x", "x" * 41, ""):
        with pytest.raises(monitoring.InvalidReadingError, match="expected lower-case words joined by '-'"):
            DeviceDescription(cause_code=bad)


def test_reports_and_owners_survive_their_files(tmp_path):
    written = report()
    monitoring.write_report(tmp_path, written)
    assert monitoring.report_path(tmp_path, GPU).name == "plugvisor.io%2Fgpu.jsonl"
    assert monitoring.read_report(tmp_path, GPU) == written
    owners = Owners(holders={(GPU, "g0"): (Holder("ml", "trainer", "train"),)}, up=True, last_success=5.0)
    monitoring.write_owners(tmp_path, owners)
    assert monitoring.read_owners(tmp_path) == owners


def test_a_torn_or_foreign_file_reads_as_absent(tmp_path):
    path = monitoring.report_path(tmp_path, GPU)
    path.parent.mkdir()
    path.write_text('{"resource": "x"')
    assert monitoring.read_report(tmp_path, GPU) is None
    (tmp_path / monitoring.OWNERS_FILE).write_text("[]")
    assert monitoring.read_owners(tmp_path) is None


def test_only_the_current_process_report_is_shown(tmp_path):
    monitoring.write_report(tmp_path, report())
    assert monitoring.directory_view(tmp_path, {GPU: os.getpid()}).reports
    assert not monitoring.directory_view(tmp_path, {GPU: os.getpid() + 1}).reports  # an older child's
    assert not monitoring.directory_view(tmp_path, {GPU: None}).reports  # backing off
    assert not monitoring.directory_view(tmp_path, {}).reports  # removed by a reload


def test_every_device_gets_its_labels_health_cause_and_readings():
    found = samples(monitoring.View([report()], None))
    (info, _) = sorted(labels_of(found, "plugvisor_device_info"), key=lambda d: d["device"])
    assert info["uuid"] == "GPU-0" and info["kind"] == "gpu" and info["numa_node"] == "0"
    assert info["pci_address"] == "0000:03:00.0" and info["pod"] == ""
    health = {d["device"]: d["cause"] for d in labels_of(found, "plugvisor_device_healthy")}
    assert health == {"g0": "", "g1": "aer-fatal"}
    (temperature,) = labels_of(found, "plugvisor_device_temperature_celsius")
    assert temperature["sensor"] == "edge" and temperature["device"] == "g0"
    assert "plugvisor_pod_resources_up" not in {name for name, _ in found}  # nobody polled yet


def test_owners_label_every_series_of_their_devices_and_leave_with_the_pod():
    held = Owners(holders={(GPU, "g0"): (Holder("ml", "trainer", "train"),)}, up=True, last_success=1.0)
    found = samples(monitoring.View([report()], held))
    allocated = {
        d["device"]: (d["namespace"], d["pod"], d["container"])
        for d in labels_of(found, "plugvisor_device_allocated")
    }
    assert allocated == {"g0": ("ml", "trainer", "train"), "g1": ("", "", "")}
    assert found[("plugvisor_pod_resources_up", ())] == 1.0
    gone = samples(monitoring.View([report()], Owners(up=True, last_success=2.0)))
    assert not any("trainer" in str(labels) for _, labels in gone)
    assert len(gone) == len(found)  # the pod's series were replaced, not added to


def test_a_device_shared_by_containers_keeps_one_series():
    both = (Holder("ml", "p", "init"), Holder("ml", "p", "app"))
    assert monitoring.holder_labels(both) == ("p", "ml", "app,init")


def test_the_catalogue_names_what_the_collector_emits():
    names = {name for name, _ in samples(monitoring.View([report()], Owners(up=True, last_success=1.0)))}
    assert names <= monitoring.exported_metric_names()


def test_the_agents_fast_writer_gives_the_collectors_samples():
    """render (the agent's scrape path) and the collector (standalone) agree sample for sample."""
    held = Owners(
        holders={(GPU, "g0"): (Holder('m"l', "trainer", "a\\b"),)}, up=False, last_success=3.5, error="x"
    )
    view = monitoring.View([report()], held)
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(device_metrics.DeviceCollector(lambda: view))

    def parsed(text):
        return {
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if not s.name.endswith("_created")
        }

    expected = parsed(prometheus_client.generate_latest(registry).decode())
    assert parsed(device_metrics.render(view).decode()) == expected
    assert any(dict(labels).get("namespace") == 'm"l' for _, labels, _ in expected)
