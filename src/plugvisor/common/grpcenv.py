"""gRPC core's environment, set before gRPC is first imported (and without importing anything heavy).

Kept apart from :mod:`plugvisor.common.logs` so that ``plugvisor --help`` can set
it without loading the logging machinery.
"""

from __future__ import annotations

import os


def quiet_grpc_core() -> None:
    """Keep gRPC core's own info lines (a GOAWAY on every peer restart) off standard error.

    gRPC reads ``GRPC_VERBOSITY`` when it is first imported, so this must run
    before that; our structured log says what matters. An explicit
    ``GRPC_VERBOSITY`` in the environment still wins.
    """
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
