"""The kubelet version knob: one table of rules, each from an upstream change, the newest by default."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugvisor.emulators.kubelet import EmulatedKubelet, FeatureGates, versions

DOCS = Path(__file__).resolve().parents[3] / "docs" / "kubelet.md"


@pytest.mark.parametrize(
    ("version", "health_first", "skip_running", "pending_active"),
    [("1.26", False, False, True), ("1.29", True, True, True), ("1.35", True, True, False)],
)
def test_each_supported_release_gets_its_rules(version, health_first, skip_running, pending_active) -> None:
    rules = versions.rules_for(version)
    assert (
        rules.health_checks_before_reuse,
        rules.skip_running_containers_while_sources_not_ready,
        rules.pending_admission_pod_is_active,
    ) == (health_first, skip_running, pending_active)


def test_the_default_is_the_newest_release() -> None:
    assert versions.DEFAULT_VERSION == versions.SUPPORTED_VERSIONS[-1] == "1.37"
    assert versions.rules_for().version == "1.37"


@pytest.mark.parametrize("spelling", ["1.29", "v1.29", "1.29.4", " v1.29.0 "])
def test_patch_releases_and_a_leading_v_play_the_minor_release(spelling: str) -> None:
    assert versions.rules_for(spelling).version == "1.29"


@pytest.mark.parametrize("version", ["1.20", "1.30", "2", "latest", "1.29.x", ""])
def test_an_unknown_version_is_named_with_every_supported_one(version: str) -> None:
    with pytest.raises(versions.UnsupportedVersionError) as raised:
        versions.rules_for(version)
    assert f"kubelet version {version!r} is not supported: choose one of 1.26, 1.29, 1.35" in str(
        raised.value
    )


def test_the_unregistered_resource_error_changed_wording() -> None:
    assert (
        versions.rules_for("1.26").unregistered_device_error
        == "can't allocate unregistered device {resource}"
    )
    assert (
        versions.rules_for("1.29").unregistered_device_error
        == "cannot allocate unregistered device {resource}"
    )


@pytest.mark.parametrize(
    ("version", "gates", "message"),
    [
        ("1.26", FeatureGates(kubelet_pod_resources_get=True), "KubeletPodResourcesGet (kubelet 1.26"),
        ("1.29", FeatureGates(resource_health_status=True), "ResourceHealthStatus (kubelet 1.29"),
    ],
)
def test_a_gate_the_release_does_not_have_is_refused(version, gates, message) -> None:
    with pytest.raises(ValueError, match=r"unrecognized feature gate: ") as raised:
        EmulatedKubelet(Path("/tmp/pv-none"), kubelet_version=version, gates=gates, write_view=False)
    assert message in str(raised.value)


def test_every_release_knows_the_emulators_own_proposal_gate() -> None:
    for version in versions.SUPPORTED_VERSIONS:
        rules = versions.rules_for(version)
        rules.check_gates(rules.gates_from_flag("DeviceManagerDeallocate=true"))


@pytest.mark.parametrize(
    ("version", "get", "health", "replacement"),
    [
        ("1.29", False, False, "per-name"),
        ("1.35", True, False, "per-name"),
        ("1.37", True, True, "per-socket"),
    ],
)
def test_each_release_has_its_own_defaults(version: str, get: bool, health: bool, replacement: str) -> None:
    """PodResources Get on from 1.34, device health in pod status from 1.36, per-socket instances in 1.37."""
    rules = versions.rules_for(version)
    assert rules.default_gates.kubelet_pod_resources_get is get
    assert rules.default_gates.resource_health_status is health
    assert rules.replacement == replacement


def test_a_locked_gate_cannot_be_turned_off() -> None:
    """As upstream's feature gate parser: GA gates locked to their default refuse the other value."""
    with pytest.raises(ValueError, match="cannot set feature gate KubeletPodResourcesGet to false"):
        versions.rules_for("1.37").gates_from_flag("KubeletPodResourcesGet=false")
    assert (
        not versions.rules_for("1.35")
        .gates_from_flag("KubeletPodResourcesGet=false")
        .kubelet_pod_resources_get
    )
    locked = versions.rules_for("1.37").with_locks(FeatureGates())
    assert locked.kubelet_pod_resources_get


def test_every_rule_names_its_upstream_change_and_a_known_release() -> None:
    for rule in versions.RULES:
        assert "kubernetes#" in rule.change or "feature gate" in rule.change
        assert rule.until is None or versions._key(rule.until) > versions._key(rule.since)


def test_docs_show_the_same_table() -> None:
    """docs/kubelet.md renders RULES; this keeps the page true when a rule is added."""
    assert versions.markdown_table() in DOCS.read_text()


def test_the_readme_and_docs_name_the_releases_played_and_the_default():
    """A reader choosing `--kubelet-version` from the README or docs/kubelet.md is offered what is played."""
    repo = Path(__file__).resolve().parents[3]
    readme = (repo / "README.md").read_text()
    listed = "|".join(versions.SUPPORTED_VERSIONS)
    assert f"(`--kubelet-version {listed}`, default {versions.DEFAULT_VERSION})" in readme
    assert f"default the newest, {versions.DEFAULT_VERSION})" in (repo / "docs" / "kubelet.md").read_text()
