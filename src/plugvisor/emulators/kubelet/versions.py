"""Which kubelet release the emulator plays: every version-dependent rule, keyed by version, in one place.

A device plugin meets many kubelet releases in the field, and the device
manager's rules changed between them in ways a plugin notices (which error a
rejected pod shows, whether a pod survives a kubelet restart). The emulator
therefore plays one release at a time, chosen with ``--kubelet-version`` (or
``EmulatedKubelet(kubelet_version=...)``); the default is the newest.

Each rule below names the upstream change it comes from and the first release
that has it; :func:`rules_for` turns a version into the :class:`KubeletRules`
the device manager, admission and manifest validation read. Nothing else in
the emulator compares versions. docs/kubelet.md renders the same table.

Releases are played as first shipped (``x.y.0``): backports to later patch
releases are named in the rule's notes but not modelled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from plugvisor.emulators.kubelet import gates as gates_

if TYPE_CHECKING:
    from plugvisor.emulators.kubelet.registration import Replacement

SUPPORTED_VERSIONS: Final[tuple[str, ...]] = ("1.26", "1.29", "1.35", "1.37")
"""The releases whose device manager sources were read for this emulator, oldest first."""

DEFAULT_VERSION: Final = SUPPORTED_VERSIONS[-1]


class UnsupportedVersionError(ValueError):
    """A kubelet version the emulator does not play; the message lists the ones it does."""


def _key(version: str) -> tuple[int, int]:
    major, minor = version.split(".")
    return int(major), int(minor)


@dataclass(frozen=True, slots=True)
class Rule:
    """One version-dependent rule: where it comes from and what it does."""

    name: str
    since: str
    """The first release that has the rule (``x.y``)."""
    until: str | None
    """The first release that no longer has it, or ``None`` while the newest still does."""
    change: str
    """The upstream change (pull request) it comes from."""
    what: str
    """What a plugin or a pod sees, in one sentence."""

    def applies_to(self, version: str) -> bool:
        """Tell whether ``version`` has this rule."""
        if _key(version) < _key(self.since):
            return False
        return self.until is None or _key(version) < _key(self.until)


RULES: Final[tuple[Rule, ...]] = (
    Rule(
        name="health_checks_before_reuse",
        since="1.27",
        until=None,
        change="kubernetes#116376 (fixes #109595; backported to 1.26.5 by #116337)",
        what=(
            "admission checks that the resource is registered and has healthy devices, and that a "
            "container's checkpointed devices are all healthy, *before* the 'nothing new needed' "
            "shortcut: after a restart, a pod whose completed init container held devices is rejected "
            "while its plugin is not back (`no healthy devices present; cannot allocate unhealthy "
            "devices <res>`). Before it, a container that already held its devices needed nothing, and "
            "a new pod found no devices with `requested number of devices unavailable for <res>. "
            "Requested: N, Available: 0`; an unregistered resource read `can't allocate unregistered "
            "device <res>` (now `cannot ...`)"
        ),
    ),
    Rule(
        name="skip_running_containers_while_sources_not_ready",
        since="1.28",
        until=None,
        change="kubernetes#118635 (fixes #118559)",
        what=(
            "while the restarted kubelet has not seen all its pods, a container the runtime still "
            "runs needs no allocation at all, so the health checks above never reject a running pod "
            "across a plain kubelet restart"
        ),
    ),
    Rule(
        name="pending_admission_pod_is_active",
        since="1.22",
        until="1.32",
        change="kubernetes#103979 (added in 1.22); removed by kubernetes#127506",
        what=(
            "UpdateAllocatedDevices counts the pod that last went through admission as active even "
            "when admission rejected it, so a never-admitted pod's entries stay in the books and the "
            "checkpoint until another pod is admitted"
        ),
    ),
    Rule(
        name="kubelet_pod_resources_get_gate",
        since="1.27",
        until=None,
        change="feature gate `KubeletPodResourcesGet`, alpha (Kubernetes feature-gate reference)",
        what="the `KubeletPodResourcesGet` feature gate exists (off by default)",
    ),
    Rule(
        name="resource_health_status_gate",
        since="1.31",
        until=None,
        change="feature gate `ResourceHealthStatus`, alpha (KEP-4680; Kubernetes feature-gate reference)",
        what="the `ResourceHealthStatus` feature gate exists (off by default)",
    ),
    Rule(
        name="pod_resources_get_on_by_default",
        since="1.34",
        until=None,
        change="feature gate `KubeletPodResourcesGet` beta in 1.34 (pkg/features/kube_features.go)",
        what="PodResources `Get` answers without any `--feature-gates`",
    ),
    Rule(
        name="pod_resources_get_locked_on",
        since="1.36",
        until=None,
        change="feature gate `KubeletPodResourcesGet` GA in 1.36, locked to its default",
        what=(
            "`KubeletPodResourcesGet=false` is refused (`cannot set feature gate KubeletPodResourcesGet "
            "to false, feature is locked to true`)"
        ),
    ),
    Rule(
        name="resource_health_status_on_by_default",
        since="1.36",
        until=None,
        change="feature gate `ResourceHealthStatus` beta in 1.36 (pkg/features/kube_features.go)",
        what="containers report `allocatedResourcesStatus` without any `--feature-gates`",
    ),
    Rule(
        name="replacement_per_socket",
        since="1.37",
        until=None,
        change=(
            "kubernetes#135437 (read in v1.37.2's plugin/v1beta1/handler.go and manager.go; "
            "v1.35.4 and v1.36.3 still per name)"
        ),
        what=(
            "plugin instances are tracked per socket path: a second instance of a resource takes over, "
            "the first one's end does not zero its allocatable, and a second Register from a connected "
            "socket is refused (`--replacement per-socket`); before, `per-name`"
        ),
    ),
)
"""Every version-dependent rule of the device manager, oldest first."""

_GATE_RULES: Final = {
    gates_.KUBELET_POD_RESOURCES_GET: "kubelet_pod_resources_get_gate",
    gates_.RESOURCE_HEALTH_STATUS: "resource_health_status_gate",
}


@dataclass(frozen=True, slots=True)
class KubeletRules:
    """The rules of one kubelet release, as the emulator's parts read them.

    ``schema_version`` selects the Kubernetes object schema manifests are
    validated against; the booleans are the :data:`RULES` of the same names.
    """

    version: str
    health_checks_before_reuse: bool
    skip_running_containers_while_sources_not_ready: bool
    pending_admission_pod_is_active: bool
    feature_gates: frozenset[str]
    """Upstream names of the gates this release knows (the emulator's own proposal gate always)."""
    default_gates: gates_.FeatureGates
    """The gates as this release has them when ``--feature-gates`` says nothing."""
    locked_gates: frozenset[str]
    """Gates this release refuses to turn off (GA, locked to their default)."""
    replacement: Replacement
    """How a second plugin instance of a resource is handled (``--replacement``'s default)."""

    @property
    def schema_version(self) -> str:
        """The Kubernetes release whose object schema manifests are validated against."""
        return self.version

    @property
    def unregistered_device_error(self) -> str:
        """The format of admission's error for a resource no plugin ever registered."""
        if self.health_checks_before_reuse:
            return "cannot allocate unregistered device {resource}"
        return "can't allocate unregistered device {resource}"

    def gates_from_flag(self, text: str) -> gates_.FeatureGates:
        """``--feature-gates`` over this release's defaults; a locked gate set to false is refused."""
        for name, value in gates_.FeatureGates.parse_values(text).items():
            if name in self.locked_gates and not value:
                raise ValueError(f"cannot set feature gate {name} to false, feature is locked to true")
        return gates_.FeatureGates.parse(text, base=self.default_gates)

    def with_locks(self, gates: gates_.FeatureGates) -> gates_.FeatureGates:
        """``gates`` with this release's locked gates on (they cannot be off in it)."""
        on = {field: True for name, field in gates_.FIELDS.items() if name in self.locked_gates}
        return dataclasses.replace(gates, **on)

    def check_gates(self, gates: gates_.FeatureGates) -> None:
        """Raise :class:`ValueError` for an enabled gate this release does not know."""
        for name in gates.enabled():
            if name not in self.feature_gates:
                raise ValueError(
                    f"unrecognized feature gate: {name} (kubelet {self.version} knows: "
                    f"{', '.join(sorted(self.feature_gates))})"
                )


def check_version(version: str) -> str:
    """Normalise ``v1.29``/``1.29.3`` to ``1.29``; raise naming the supported versions otherwise."""
    text = version.strip()
    parts = text.removeprefix("v").split(".")
    minor = ".".join(parts[:2])
    if len(parts) >= 2 and all(part.isdigit() for part in parts) and minor in SUPPORTED_VERSIONS:
        return minor
    raise UnsupportedVersionError(
        f"kubelet version {version!r} is not supported: choose one of {', '.join(SUPPORTED_VERSIONS)} "
        f"(default {DEFAULT_VERSION})"
    )


def rules_for(version: str = DEFAULT_VERSION) -> KubeletRules:
    """Return the rules of ``version`` (``1.26``, ``v1.29``, ``1.35.2`` ...)."""
    played = check_version(version)
    applied = {rule.name for rule in RULES if rule.applies_to(played)}
    known_gates = {gate for gate, rule in _GATE_RULES.items() if rule in applied}
    known_gates.add(gates_.DEVICE_MANAGER_DEALLOCATE)
    defaults = gates_.FeatureGates(
        kubelet_pod_resources_get="pod_resources_get_on_by_default" in applied,
        resource_health_status="resource_health_status_on_by_default" in applied,
    )
    locked = {gates_.KUBELET_POD_RESOURCES_GET} if "pod_resources_get_locked_on" in applied else set()
    return KubeletRules(
        version=played,
        health_checks_before_reuse="health_checks_before_reuse" in applied,
        skip_running_containers_while_sources_not_ready=(
            "skip_running_containers_while_sources_not_ready" in applied
        ),
        pending_admission_pod_is_active="pending_admission_pod_is_active" in applied,
        feature_gates=frozenset(known_gates),
        default_gates=defaults,
        locked_gates=frozenset(locked),
        replacement="per-socket" if "replacement_per_socket" in applied else "per-name",
    )


def markdown_table() -> str:
    """Render :data:`RULES` as docs/kubelet.md shows them (a test keeps the page in step)."""
    lines = [
        "| Rule | From | Until | Upstream change | What it does |",
        "|---|---|---|---|---|",
    ]
    lines.extend(
        f"| `{rule.name}` | {rule.since} | {rule.until or '-'} | {rule.change} | {rule.what} |"
        for rule in RULES
    )
    return "\n".join(lines)
