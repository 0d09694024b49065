"""Where a plugin reads the host from, and how it names host paths to the kubelet.

Nothing in plugvisor hard-codes ``/sys`` or ``/dev``: every reader takes a
:class:`HostPaths`, so the same code serves a real node (root ``/``), a plugin
container with the host mounted at ``/host``, and an emulated lab in a temp dir.
(Intel's ``-prefix`` flag is the model; its ``pkg/topology`` ``mockRoot`` global is
the pattern to avoid.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from plugvisor.common import constants


@dataclass(frozen=True, slots=True)
class HostPaths:
    """The host's filesystem as one plugin process sees it.

    ``root`` is where sysfs/devfs/procfs are read (``root/sys``, ``root/dev``...).
    ``spec_root`` prefixes the host paths handed to the kubelet in DeviceSpecs and
    Mounts. It defaults to ``root``, which is right on a bare-metal node (both are
    ``/``) and in the emulated lab (the fake nodes really live under the lab root);
    a plugin container that sees the host at ``/host`` sets ``spec_root=/`` because
    the container runtime opens paths in the host's namespace.
    """

    root: Path = Path("/")
    kubelet_dir: Path = Path(constants.DEVICE_PLUGIN_PATH)
    spec_root: Path | None = None

    @property
    def sysfs(self) -> Path:
        """``<root>/sys``."""
        return self.root / "sys"

    @property
    def devfs(self) -> Path:
        """``<root>/dev``."""
        return self.root / "dev"

    @property
    def procfs(self) -> Path:
        """``<root>/proc``."""
        return self.root / "proc"

    @property
    def kubelet_socket(self) -> Path:
        """The kubelet's Registration socket."""
        return self.kubelet_dir / constants.KUBELET_SOCKET_NAME

    def host(self, absolute: str | PurePosixPath) -> Path:
        """Map a host-absolute path such as ``/dev/fuse`` to where this process reads it."""
        rel = PurePosixPath(absolute)
        if not rel.is_absolute():
            raise ValueError(f"host path {str(absolute)!r} must be absolute")
        return self.root.joinpath(*rel.parts[1:])

    def for_kubelet(self, local: Path) -> str:
        """Name a path read under ``root`` the way the container runtime on the host must see it."""
        spec_root = self.root if self.spec_root is None else self.spec_root
        rel = local.relative_to(self.root)
        return str(spec_root / rel)
