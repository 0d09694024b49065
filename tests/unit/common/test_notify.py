"""Status datagrams use sd_notify's KEY=value lines and never fail the sender."""

import pytest

from plugvisor.common.notify import StatusReporter, decode, encode


def test_fields_round_trip():
    assert decode(encode({"REGISTERED": 2, "DEVICES": "3/4"})) == {"REGISTERED": "2", "DEVICES": "3/4"}


def test_a_multi_line_value_is_refused():
    with pytest.raises(ValueError, match="one line"):
        encode({"KUBELET_RESTART": "a\nb"})


def test_without_a_socket_nothing_is_sent(monkeypatch):
    monkeypatch.delenv("PLUGVISOR_STATUS_SOCKET", raising=False)
    reporter = StatusReporter()
    assert not reporter.enabled
    assert reporter.send(REGISTERED=1) is False


def test_a_missing_listener_only_drops_the_message():
    reporter = StatusReporter("/nonexistent/status.sock")
    assert reporter.enabled
    assert reporter.send(REGISTERED=1) is False
    reporter.close()
