"""The node agent's supervisor: one child process per resource, kept registered with the kubelet.

``plugvisor run --config node.yaml`` reads the configuration (:mod:`.config`),
forks one plugin process per resource through a warm fork server
(:mod:`.spawner`, :mod:`.forkserver`), and owns every restart: capped exponential
backoff with jitter for crashes (:mod:`.backoff`, :mod:`.child`), immediate
restarts when the kubelet restarts (:mod:`.kubelet_watch`), clean stops, reloads
on SIGHUP (:mod:`.supervisor`, the core; :mod:`.agent`, the process around it).
It reports through a state file read by ``plugvisor status`` (:mod:`.status`),
Prometheus metrics (:mod:`.metrics`) and systemd notifications (:mod:`.systemd`),
and can export itself as supervisord programs (:mod:`.supervisord`).

This process never imports gRPC (it is not fork-safe once started); children
report to it through sd_notify-style datagrams instead (:mod:`.reports`). The
package is deliberately not a top-level ``supervisor``: see docs/architecture.md, "Names".
"""
