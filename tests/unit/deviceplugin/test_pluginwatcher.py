"""The plugin-watcher registration service: the kubelet's refusal is logged cut and escaped."""

import structlog.testing

from plugvisor.api.pluginregistration.v1 import api_pb2 as reg_pb2
from plugvisor.deviceplugin.pluginwatcher import RegistrationService


async def test_a_megabyte_refusal_is_logged_cut_and_escaped():
    service = RegistrationService(
        plugin_type="DRAPlugin", name="gpu.example.com", endpoint="", versions=["v1"]
    )
    error = "\x1b[2J" + "e" * (1 << 20)
    with structlog.testing.capture_logs() as logs:
        await service._notify(reg_pb2.RegistrationStatus(plugin_registered=False, error=error), None)
    (entry,) = logs
    assert entry["event"] == "registration_refused"
    assert len(entry["error"]) < 1000 and "\x1b" not in entry["error"]
    assert service.verdicts.get_nowait().error == error  # the verdict itself is the kubelet's word
