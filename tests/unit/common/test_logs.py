"""Log records carry input from outside (claim names, UIDs, paths): each field cut, every line one line."""

import io
import json

import pytest
import structlog

from plugvisor.common.logs import MAX_LOG_FIELD, configure_logging


def record(fmt, **fields):
    stream = io.StringIO()
    configure_logging(fmt=fmt, stream=stream)
    try:
        structlog.get_logger("test").warning("claim_not_prepared", **fields)
    finally:
        configure_logging()
    return stream.getvalue()


@pytest.mark.parametrize("fmt", ["kv", "json"])
class TestOutsideInputInALogLine:
    def test_a_megabyte_field_is_cut_saying_how_long_it_was(self, fmt):
        line = record(fmt, claim="x" * (1 << 20))
        assert len(line) < 2 * MAX_LOG_FIELD
        assert f"({1 << 20} characters)" in line

    def test_a_megabyte_list_is_cut_too(self, fmt):
        line = record(fmt, devices=["gpu"] * 300_000)
        assert len(line) < 2 * MAX_LOG_FIELD

    def test_control_characters_are_escaped_and_the_record_stays_one_line(self, fmt):
        line = record(fmt, claim="a\nb\x1b[2J\u202ec\x00")
        assert line.count("\n") == 1 and line.endswith("\n")
        assert not any(not ch.isprintable() for ch in line[:-1])

    def test_a_field_of_ordinary_length_is_left_whole(self, fmt):
        name = "default/" + "n" * 253 + " (uid 0f5e2a7c-5b57-4e6a-9d43-2f0c1e4b5a6d)"
        line = record(fmt, claim=name)
        assert name in (json.loads(line)["claim"] if fmt == "json" else line)
