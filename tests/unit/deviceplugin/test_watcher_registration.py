"""What a plugin in plugin-watcher mode does with the kubelet's verdicts."""

import structlog

from plugvisor.api.pluginregistration.v1 import api_pb2 as reg_pb2
from plugvisor.deviceplugin.watcherregistration import MAX_ERROR_LENGTH, WatcherRegistrar


async def test_a_refusal_is_logged_with_its_error_cut_short():
    """The error comes from the other side of a socket: a 1 MB one was a 1 MB log line."""
    registrar = WatcherRegistrar("example.com/x")
    status = reg_pb2.RegistrationStatus(plugin_registered=False, error="no " * 350_000)
    with structlog.testing.capture_logs() as logs:
        await registrar._notify(status, None)
    (line,) = [entry for entry in logs if entry["event"] == "registration_refused"]
    assert len(line["error"]) < MAX_ERROR_LENGTH + 40
    assert line["error"].endswith("(1050000 characters)")
