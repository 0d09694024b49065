"""Character device numbers, coherent across ``dev/``, ``sys/dev/char`` and ``proc/devices``.

Fixed majors are the kernel's (NVIDIA 195, DRM 226, misc 10). Drivers that ask
the kernel for a dynamic major get one from this table instead, and the lab
lists every major it uses in ``proc/devices`` under the driver's own name, which
is where tools such as ``nvidia-modprobe`` look them up.
"""

from __future__ import annotations

from typing import Final

MISC: Final = 10
NVIDIA: Final = 195
DRM: Final = 226
NVIDIA_UVM: Final = 238
"""As a real node with the 580 driver numbers it (the H200 capture: ``/dev/nvidia-uvm`` 238:0)."""
KFD: Final = 236
XCLMGMT: Final = 237
DFL_FME: Final = 235
NVIDIA_CAPS: Final = 241
"""``/dev/nvidia-caps/nvidia-cap<N>``: MIG's config (1) and monitor (2) capabilities."""
DFL_PORT: Final = 239
VFIO: Final = 242
UVERBS: Final = 231
"""``IB_UVERBS_MAJOR``: fixed, with minors from ``IB_UVERBS_BASE_MINOR`` (192) up."""

NVIDIACTL_MINOR: Final = 255
NVIDIA_MODESET_MINOR: Final = 254
VFIO_CONTAINER_MINOR: Final = 196
RENDER_BASE: Final = 128
UVERBS_BASE_MINOR: Final = 192
RDMA_CM_MINOR: Final = 58
"""``rdma_cm`` is a misc device with a dynamic minor; the lab uses one value consistently."""
VHOST_NET_MINOR: Final = 238
TUN_MINOR: Final = 200

NAMES: Final[dict[int, str]] = {
    MISC: "misc",
    NVIDIA: "nvidia",
    DRM: "drm",
    NVIDIA_UVM: "nvidia-uvm",
    NVIDIA_CAPS: "nvidia-caps",
    KFD: "kfd",
    XCLMGMT: "xclmgmt",
    DFL_FME: "dfl-fme",
    DFL_PORT: "dfl-port",
    VFIO: "vfio",
    UVERBS: "infiniband_verbs",
}
"""How each major appears in ``proc/devices``."""
