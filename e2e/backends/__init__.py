"""Where the scenarios run: emulated nodes, a kind cluster or a real local cluster, behind one interface.

Every backend answers the questions a user asks a cluster (a node's capacity and allocatable, a pod's
phase, the device nodes and environment its container got) and performs the operations an operator
performs (create and delete pods, inject lab faults, delete an agent pod, run a command in it, restart
a kubelet). The scenarios in test_scenarios.py are written once against this interface.

- EmulatedBackend (emulated.py): per kind worker, a lab written from the worker's profile, `plugvisor
  kubelet` (the emulated kubelet, its own process, static pods in a directory) and one `plugvisor run` per
  agent of the lab overlay scheduled on that worker, with the overlay's node.yaml. It plays the
  DaemonSet controller (an agent that is "deleted" is started again) and the container runtime's view is
  the kubelet's runtime config for each container.
- KindBackend (kind.py): the cluster of kind-config.yaml, the image built from this checkout, the lab
  overlay applied; every check goes through the API server with the official Kubernetes client (api.py).
  On a machine without a registry, kind, its node image and the images come from the local caches and the
  run starts and stops dockerd itself (e2e/kind).
- LocalBackend (local.py): the same checks and operations (api.py) on upstream Kubernetes run from
  binaries on this machine (e2e/local), one node playing each kind worker in turn; images built without
  Docker by tools/kubernetes/images.py.
"""

from .common import Backend, PodView, Progress, wait_until
from .emulated import EmulatedBackend
from .kind import KindBackend, kind_unavailable
from .local import LocalBackend, local_unavailable

__all__ = [
    "Backend",
    "EmulatedBackend",
    "KindBackend",
    "LocalBackend",
    "PodView",
    "Progress",
    "kind_unavailable",
    "local_unavailable",
    "wait_until",
]
