"""Stand-ins for what a node has and plugvisor cannot assume: a kubelet and hardware.

:mod:`plugvisor.emulators.kubelet` speaks the kubelet's side of the device plugin
protocol by the real kubelet's rules; :mod:`plugvisor.emulators.lab` writes
faithful sysfs/devfs/procfs trees with faults and hot-plug. Both are public
library code, so users can test their own plugins the way plugvisor tests its own.
"""
