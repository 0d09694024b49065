"""Why a resource is down, where operators look: its process's last error, a rejected reload, no device."""

import structlog.testing

from plugvisor.supervisor import status as status_

from .test_supervisor import GPU, NIC, crash, registered

ERROR = "cannot_run: too many inotify instances (fs.inotify.max_user_instances = 128): raise it"


def failing(supervisor, spawner, resource, error=ERROR, returncode=2):
    """The process says why it fails, then exits, as a plugin's last words do."""
    supervisor.handle_report(supervisor.children[resource].pid, {"ERROR": error})
    crash(supervisor, spawner, resource, returncode)


class TestTheLastErrorLine:
    def test_a_looping_childs_last_error_is_in_its_last_exit_in_status_and_in_readyz(
        self, make_supervisor, spawner
    ):
        supervisor = make_supervisor(GPU, NIC)
        registered(supervisor, NIC)
        failing(supervisor, spawner, GPU)
        child = supervisor.snapshot()["children"][0]
        assert child["last_exit"]["error"] == ERROR
        ready, why = supervisor.readiness()
        assert not ready and f"{GPU} (config (exit status 2): {ERROR})" in why
        text = status_.render(supervisor.snapshot())
        assert f"  {GPU}: config (exit status 2): {ERROR}" in text

    def test_the_error_belongs_to_the_process_that_said_it(self, make_supervisor, spawner, clock):
        supervisor = make_supervisor(GPU)
        failing(supervisor, spawner, GPU)
        clock.advance(60)
        supervisor.tick()
        crash(supervisor, spawner, GPU, returncode=-9)  # the next process said nothing: killed
        assert supervisor.snapshot()["children"][0]["last_exit"]["error"] is None

    def test_a_megabyte_error_with_escapes_is_cut_and_escaped(self, make_supervisor, spawner):
        supervisor = make_supervisor(GPU)
        failing(supervisor, spawner, GPU, error="\x1b[2J" + "e" * (1 << 20))
        error = supervisor.snapshot()["children"][0]["last_exit"]["error"]
        assert len(error) < 400 and "\x1b" not in error

    def test_a_registered_child_shows_no_old_error(self, make_supervisor, spawner, clock):
        supervisor = make_supervisor(GPU)
        failing(supervisor, spawner, GPU)
        clock.advance(60)
        supervisor.tick()
        registered(supervisor, GPU)
        assert supervisor.readiness()[0]
        assert f"{GPU}: config" not in status_.render(supervisor.snapshot())


class TestARejectedReload:
    def test_status_and_readyz_say_the_last_reload_was_rejected_until_one_is_taken(self, make_supervisor):
        supervisor = make_supervisor(GPU)
        registered(supervisor, GPU)
        supervisor.reload_rejected("/etc/plugvisor/node.yaml: resources[0].kind: unknown kind 'gpux'")
        ready, why = supervisor.readiness()
        assert ready and "last reload rejected" in why and "unknown kind 'gpux'" in why
        snapshot = supervisor.snapshot()
        assert "unknown kind 'gpux'" in snapshot["supervisor"]["reload_rejected"]["error"]
        assert "last reload (SIGHUP) rejected" in status_.render(snapshot)
        supervisor.reload(supervisor.config)
        assert supervisor.snapshot()["supervisor"]["reload_rejected"] is None
        assert "rejected" not in supervisor.readiness()[1]


class TestAResourceMatchingNothing:
    def test_it_is_warned_about_once_and_shown_in_status(self, make_supervisor):
        supervisor = make_supervisor(GPU, NIC)
        registered(supervisor, NIC)
        with structlog.testing.capture_logs() as logs:
            registered(supervisor, GPU, devices="0/0")
            supervisor.handle_report(supervisor.children[GPU].pid, {"DEVICES": "0/0"})
        assert [entry["event"] for entry in logs].count("resource_matches_no_device") == 1
        text = status_.render(supervisor.snapshot())
        assert f"  {GPU}: matches no device" in text
        assert "no device: " + GPU in supervisor.summary()

    def test_devices_appearing_clear_it(self, make_supervisor):
        supervisor = make_supervisor(GPU)
        registered(supervisor, GPU, devices="0/0")
        supervisor.handle_report(supervisor.children[GPU].pid, {"DEVICES": "1/1"})
        assert "matches no device" not in status_.render(supervisor.snapshot())
