"""Bring the local cluster up or down by hand: ``python -m e2e.local up|down|status|check`` (as root).

``up`` stays in the foreground like upstream's hack/local-up-cluster.sh: it prints how to reach the
cluster and tears it down on Ctrl-C or SIGTERM. ``down`` sweeps a cluster whose owner was killed.
``status`` says whether this machine can run one and whether one is running; ``check`` lists anything a
cluster left behind (exit 1 if anything).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType

from ..machine_lock import LOCK
from .cluster import STATE, LocalCluster, unavailable


def _stamp(message: str) -> None:
    print(f"[local {time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.local", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down", "status", "check"))
    args = parser.parse_args(argv)
    if args.command == "status":
        reason = unavailable()
        print(f"cannot run here: {reason}" if reason else "this machine can run the local cluster")
        print(f"a cluster is running or was not torn down ({STATE})" if STATE.exists() else "no cluster")
        return 1 if reason else 0
    reason = unavailable()
    if reason:
        print(f"the local cluster cannot run here: {reason}", file=sys.stderr)
        return 1
    cluster = LocalCluster(_stamp)
    if args.command == "check":
        found = cluster.leftovers()
        print("\n".join(found) or "nothing left behind")
        return 1 if found else 0
    if args.command == "down":
        cluster.acquire(timeout=60)  # an owner still alive keeps the lock: never sweep under it
        cluster.down()
        _stamp("swept")
        return 0

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        cluster.up()
        _stamp(f"up: export KUBECONFIG={cluster.kubeconfig}   (Ctrl-C tears it down; lock {LOCK})")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        _stamp("tearing down")
    finally:
        cluster.down()
        left = cluster.leftovers()
        _stamp("nothing left behind" if not left else "LEFT BEHIND:\n  " + "\n  ".join(left))
    return 0


if __name__ == "__main__":
    sys.exit(main())
