"""Exit statuses, shared by every plugvisor command and by the agent that reads its children's.

They are part of the interface: a service manager, a script or the agent acts
on them. The agent in particular tells "the child refused its configuration"
(retrying quickly cannot help) and "the kubelet restarted, start me again now"
from a crash by these numbers alone.
"""

from __future__ import annotations

from typing import Final

EXIT_OK: Final = 0
"""Success, or a requested stop (SIGTERM, SIGINT)."""

EXIT_FAILURE: Final = 1
"""Anything else: a crash, a socket another live process serves, no agent to ask."""

EXIT_USAGE: Final = 2
"""Bad usage or invalid configuration; the message names the option, file or field."""

EXIT_CONFIGURATION: Final = EXIT_USAGE
"""A plugin refusing its configuration (including the kubelet refusing the resource) is a usage error."""

EXIT_KUBELET_RESTARTED: Final = 3
"""A plugin run with ``on_kubelet_restart="exit"`` saw the kubelet restart; its owner starts it again now."""
