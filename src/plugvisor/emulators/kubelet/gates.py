"""Feature gates the emulated kubelet honours, with the upstream names and defaults.

Behaviour that a real kubelet only shows behind a gate stays behind the same
gate here, so a plugin tested against the emulator's defaults sees what a
default kubelet shows. The CLI accepts them in the kubelet's own syntax,
``--feature-gates=KubeletPodResourcesGet=true,ResourceHealthStatus=true``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

KUBELET_POD_RESOURCES_GET: Final = "KubeletPodResourcesGet"
RESOURCE_HEALTH_STATUS: Final = "ResourceHealthStatus"
DEVICE_MANAGER_DEALLOCATE: Final = "DeviceManagerDeallocate"


FIELDS: Final[Mapping[str, str]] = MappingProxyType(
    {
        KUBELET_POD_RESOURCES_GET: "kubelet_pod_resources_get",
        RESOURCE_HEALTH_STATUS: "resource_health_status",
        DEVICE_MANAGER_DEALLOCATE: "device_manager_deallocate",
    }
)


@dataclass(frozen=True, slots=True)
class FeatureGates:
    """The gates that change device-manager behaviour; defaults are the kubelet's.

    ``kubelet_pod_resources_get``: PodResources ``Get`` (alpha since 1.27, off;
    beta and on from 1.34; GA, locked on, from 1.36).
    ``resource_health_status``: ``allocatedResourcesStatus`` in container
    statuses (alpha since 1.31, off; beta and on from 1.36).
    The field defaults are the oldest releases'; a release's own defaults are
    ``versions.rules_for(v).default_gates``, the base its ``--feature-gates`` apply to.
    ``device_manager_deallocate``: the ``Deallocate``/``PostStopContainer`` calls
    of the KEP-20210712 addendum, never merged upstream (off); see docs/kubelet.md.
    """

    kubelet_pod_resources_get: bool = False
    resource_health_status: bool = False
    device_manager_deallocate: bool = False

    @classmethod
    def parse(cls, text: str, base: FeatureGates | None = None) -> FeatureGates:
        """Parse ``Name=true,Other=false`` as the kubelet's ``--feature-gates`` does, over ``base``.

        Raises :class:`ValueError` naming an unknown gate or a bad value.
        """
        values = {FIELDS[name]: value for name, value in cls.parse_values(text).items()}
        return dataclasses.replace(base if base is not None else cls(), **values)

    @staticmethod
    def parse_values(text: str) -> dict[str, bool]:
        """The gates ``text`` sets, by upstream name (a locked gate set to false is refused by name)."""
        values: dict[str, bool] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"missing bool value for {name}")
            field = FIELDS.get(name.strip())
            if field is None:
                known = ", ".join(sorted(FIELDS))
                raise ValueError(f"unrecognized feature gate: {name.strip()} (known here: {known})")
            lowered = raw.strip().lower()
            if lowered not in ("true", "false"):
                raise ValueError(f"invalid value of {name.strip()}={raw}, err: invalid syntax")
            values[name.strip()] = lowered == "true"
        return values

    def enabled(self) -> list[str]:
        """Return the upstream names of the gates that are on (for the view and logs)."""
        return [name for name, field in sorted(FIELDS.items()) if getattr(self, field)]
