"""Fixtures shared by every test level."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc import aio as _grpc_aio

# gRPC's asyncio engine shuts down when its last channel or server is collected, and starts again with the
# next one. A test process makes and drops hundreds, and one such shutdown can hang for good joining the
# engine's poller thread (grpc/grpc#40989: the loop stops reading the wake-up socket while the poller is
# blocked writing to it): seen as a 180 s timeout in an unrelated test's teardown. Started once here, the
# engine stays up for the whole session, as it does in a plugvisor process, whose server lives as long as it.
_grpc_aio.init_grpc_aio()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory under /tmp with a short path: unix socket paths must stay under 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="/tmp/pv-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
