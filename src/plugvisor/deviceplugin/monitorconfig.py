"""How a plugin process monitors its devices, apart from the monitor itself.

Every plugin's configuration carries a :class:`MonitorConfig`, but only a plugin
that monitors (``--metrics-listen``, or a child of the agent) needs
:mod:`plugvisor.deviceplugin.device_monitor` and what it loads (the report model,
the PodResources poller): kept apart, a standalone plugin without metrics never
imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from plugvisor.deviceplugin.errors import ConfigurationError

DEFAULT_POD_RESOURCES_INTERVAL: Final = 5.0
"""Seconds between two PodResources ``List`` calls of an agent (one poller for all its plugins)."""
DEFAULT_TELEMETRY_INTERVAL: Final = 10.0


@dataclass(frozen=True, slots=True)
class MonitorConfig:
    """Whether and how a plugin process monitors its devices.

    ``monitor_dir``: the agent's shared directory (reports, owners file, poller
    lock); ``None`` for a standalone plugin, which keeps everything in memory.
    ``pod_resources_socket``: ``None`` means beside the kubelet directory.
    """

    enabled: bool = False
    monitor_dir: Path | None = None
    pod_resources_socket: Path | None = None
    pod_resources_interval: float = DEFAULT_POD_RESOURCES_INTERVAL
    telemetry_interval: float = DEFAULT_TELEMETRY_INTERVAL
    owners: bool = True

    def __post_init__(self) -> None:
        for name in ("pod_resources_interval", "telemetry_interval"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigurationError(f"monitoring {name.replace('_', ' ')} must be positive, got {value}")
