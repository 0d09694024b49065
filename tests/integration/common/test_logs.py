"""Many processes logging to one standard error at once: every line is one whole record."""

import json
import os
import subprocess
import sys
import threading

WRITER = """
import sys
import structlog
from plugvisor.common.logs import configure_logging

configure_logging(fmt=sys.argv[1])
log = structlog.get_logger("test").bind(process=int(sys.argv[2]))
for i in range(int(sys.argv[3])):
    log.info("child_state", i=i, reason="plugin socket deleted", padding="x" * 200)
"""

PROCESSES = 8
RECORDS = 400


def _run_writers(fmt: str) -> list[str]:
    """Start every writer on one shared pipe as standard error (unbuffered, as under `python -u`)."""
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    chunks: list[bytes] = []

    def drain() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            chunks.extend(iter(lambda: pipe.read(65536), b""))

    reader = threading.Thread(target=drain)
    reader.start()
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, fmt, str(n), str(RECORDS)],
            stderr=write_end,
            stdout=subprocess.DEVNULL,
            env=env,
        )
        for n in range(PROCESSES)
    ]
    os.close(write_end)
    for writer in writers:
        assert writer.wait(timeout=120) == 0
    reader.join(timeout=120)
    return b"".join(chunks).decode().split("\n")


def test_json_lines_from_many_processes_each_parse_whole():
    lines = _run_writers("json")
    assert lines[-1] == ""
    records = [json.loads(line) for line in lines[:-1]]
    assert len(records) == PROCESSES * RECORDS
    for n in range(PROCESSES):
        assert [r["i"] for r in records if r["process"] == n] == list(range(RECORDS))


def test_key_value_lines_from_many_processes_are_never_merged_or_empty():
    lines = _run_writers("kv")[:-1]
    assert len(lines) == PROCESSES * RECORDS
    assert all(line.startswith("ts=") and line.count(" event=") == 1 for line in lines)
