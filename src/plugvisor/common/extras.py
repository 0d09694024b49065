"""Optional dependencies: what a part of plugvisor says when the extra it needs is not installed.

The release image and a node's install carry only what a node runs (the agent
and its plugins). The emulated kubelet and the demo need more (Kubernetes object
schemas, a terminal UI), so those come with an extra; a command that needs one
must say which, in one line, rather than end in a traceback about a module the
user never heard of.
"""

from __future__ import annotations

from typing import Final

EMULATORS: Final = "emulators"
"""The emulated kubelet (``plugvisor kubelet``, the one ``testing.running_plugin`` needs) and the demo."""


class MissingExtraError(ImportError):
    """A part of plugvisor was imported without the optional dependencies it needs.

    An :class:`ImportError`, so that code probing for an optional part with
    ``try: import ... except ImportError`` keeps working; its message is one
    line that names the part, the missing module and the command that fixes it.
    """

    def __init__(self, part: str, extra: str, missing: ModuleNotFoundError) -> None:
        module = (missing.name or "a dependency").partition(".")[0]
        super().__init__(
            f"{part} needs plugvisor's {extra!r} extra ({module} is not installed): "
            f"pip install 'plugvisor[{extra}]'",
            name=missing.name,
        )
