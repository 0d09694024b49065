"""What operators and scripts read: the state file, `plugvisor status`, metrics text, systemd datagrams."""

import dataclasses
import errno
import json
import os
import socket

import pytest
from click.testing import CliRunner

from plugvisor.supervisor import status as status_
from plugvisor.supervisor.agent import RuntimeDirLock
from plugvisor.supervisor.cli import export_group, status_command
from plugvisor.supervisor.metrics import Metrics
from plugvisor.supervisor.supervisord import export_supervisord, program_name
from plugvisor.supervisor.systemd import Notifier

from .conftest import node_config


@pytest.fixture
def agent_lock(tmp_path):
    """Hold the runtime directory's lock as a live agent does (with this process's PID)."""
    lock = RuntimeDirLock(tmp_path)
    lock.acquire()
    yield
    lock.release()


@pytest.fixture
def running(make_supervisor):
    supervisor = make_supervisor("example.com/gpu", "example.com/nic")
    child = supervisor.children["example.com/gpu"]
    supervisor.handle_report(child.pid, {"REGISTERED": "1", "ENDPOINT": "plugvisor-g.sock", "DEVICES": "3/4"})
    return supervisor


class TestStatusCommand:
    def test_it_shows_each_child_with_state_pid_uptime_restarts_and_devices(
        self, running, tmp_path, agent_lock
    ):
        """The table names every resource with its state, PID, restarts, last exit and devices."""
        document = running.snapshot()
        document["supervisor"]["pid"] = os.getpid()
        status_.write_state(tmp_path, document)
        result = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)])
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert "1/2 resources registered" in lines[0]
        assert lines[1].split() == [
            "RESOURCE",
            "STATE",
            "PID",
            "UPTIME",
            "RESTARTS",
            "LAST",
            "EXIT",
            "DEVICES",
            "WATCH",
        ]
        gpu = lines[2].split()
        assert gpu[:3] == ["example.com/gpu", "RUNNING", str(running.children["example.com/gpu"].pid)]
        assert gpu[-2:] == ["3/4", "inotify"]
        assert lines[3].split()[1] == "STARTING"

    def test_json_output_is_the_full_state_for_scripts(self, running, tmp_path, agent_lock):
        """--json prints the document with uptimes computed now."""
        document = running.snapshot()
        document["supervisor"]["pid"] = os.getpid()
        status_.write_state(tmp_path, document)
        result = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path), "--json"])
        parsed = json.loads(result.output)
        assert [c["resource"] for c in parsed["children"]] == ["example.com/gpu", "example.com/nic"]
        assert parsed["children"][0]["devices"] == {"healthy": 3, "total": 4}
        assert parsed["children"][0]["uptime"] >= 0

    def test_a_state_the_agent_could_not_replace_is_shown_as_stale_until_a_write_works(
        self, running, tmp_path, agent_lock, monkeypatch
    ):
        """A full disk keeps the last state: status says it is old and since when, and the JSON too."""
        document = running.snapshot()
        document["supervisor"]["pid"] = os.getpid()
        status_.write_state(tmp_path, document)
        os.utime(tmp_path / status_.STATE_FILE, (1_700_000_000, 1_700_000_000))
        real_write = status_.write_atomically

        def no_space(path, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        monkeypatch.setattr(status_, "write_atomically", no_space)
        with pytest.raises(OSError, match="No space"):
            status_.write_state(tmp_path, document)
        result = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)])
        assert result.exit_code == 0, result.output
        assert result.output.startswith("STALE: the agent could not write its state since 2023-11-")
        parsed = json.loads(
            CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path), "--json"]).output
        )
        assert parsed["stale"] == {"written_at": 1_700_000_000}
        monkeypatch.setattr(status_, "write_atomically", real_write)
        status_.write_state(tmp_path, document)
        result = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)])
        assert "STALE" not in result.output
        assert sorted(p.name for p in tmp_path.iterdir() if "state" in p.name) == [status_.STATE_FILE]

    def test_the_state_is_never_written_through_a_link_planted_in_the_runtime_dir(self, running, tmp_path):
        """A runtime dir made world-writable: a link planted at a guessable temporary name goes nowhere."""
        victim = tmp_path / "victim"
        victim.write_text("precious\n")
        for name in (f".{status_.STATE_FILE}.{os.getpid()}", f".tmp-{status_.STATE_FILE}.x"):
            (tmp_path / name).symlink_to(victim)
        status_.write_state(tmp_path, running.snapshot())
        assert victim.read_text() == "precious\n"
        assert json.loads((tmp_path / status_.STATE_FILE).read_text())["children"]

    def test_a_state_file_too_large_to_be_one_is_refused_unread(self, tmp_path, agent_lock, monkeypatch):
        monkeypatch.setattr(status_, "MAX_STATE_BYTES", 1024)
        (tmp_path / status_.STATE_FILE).write_text(json.dumps({"pad": "x" * 2048}))
        result = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)])
        assert result.exit_code != 0
        assert f"{tmp_path / status_.STATE_FILE} is not a plugvisor agent state file: larger than" in (
            result.output
        )

    def test_no_agent_and_a_stale_file_are_errors(self, running, tmp_path):
        """Without a live supervisor, status says so and exits 1."""
        result = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)])
        assert result.exit_code == 1
        assert "no plugvisor agent state" in result.output
        document = running.snapshot()
        document["supervisor"]["pid"] = 2**22 + 1
        status_.write_state(tmp_path, document)
        result = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)])
        assert result.exit_code == 1
        assert "is stale" in result.output

    def test_a_live_process_that_merely_has_the_recorded_pid_is_not_the_agent(self, running, tmp_path):
        """After a crash or reboot the PID may be anyone's: only the holder of the agent's lock counts."""
        document = running.snapshot()
        document["supervisor"]["pid"] = os.getpid()  # alive, but holds no lock
        status_.write_state(tmp_path, document)
        (tmp_path / status_.PID_FILE).write_text(f"{os.getpid()}\n")
        result = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)])
        assert result.exit_code == 1
        assert "is stale" in result.output

    def test_names_from_the_kubelet_and_plugins_reach_the_terminal_escaped(self, running):
        """A pod named with a newline or an escape sequence cannot forge a line or clear the screen."""
        document = running.snapshot()
        gpu = document["children"][0]
        gpu["devices_detail"] = [
            {
                "id": "gpu-0\x1b[2J",
                "healthy": False,
                "cause": "hot\nfake line",
                "holders": [{"namespace": "ns\u202e", "pod": "p\n    evil", "container": "c\x07"}],
            }
        ]
        document["pod_resources"] = {"up": False, "error": "down\x1b]0;title\x07", "last_success": None}
        text = status_.render(document)
        assert not any(char in text for char in "\x1b\x07\u202e")
        assert text.count("\n") == len(text.splitlines()) - 1
        assert "gpu-0\\x1b[2J" in text
        assert "ns\\u202e/p\\n    evil/c\\x07" in text
        assert "unhealthy: hot\\nfake line" in text

    def test_why_a_resource_is_not_registered_is_shown(self, make_supervisor):
        supervisor = make_supervisor("example.com/gpu", "example.com/nic", "example.com/fpga")
        gpu, nic, fpga = supervisor.children.values()
        supervisor.handle_report(gpu.pid, {"WAITING": "a kubelet: /dp/kubelet.sock does not exist"})
        supervisor.handle_report(nic.pid, {"REGISTERED": "1", "ENDPOINT": "plugvisor-n.sock"})
        supervisor.handle_report(nic.pid, {"TAKEN_OVER": "plugvisor-nic-123456-0badc0de.sock"})
        supervisor.handle_report(fpga.pid, {"REGISTERED": "1", "ENDPOINT": "plugvisor-f.sock"})
        supervisor.handle_report(fpga.pid, {"UNREGISTERED": "its socket plugvisor-f.sock was deleted"})
        text = status_.render(supervisor.snapshot())
        assert "example.com/gpu: waiting for a kubelet: /dp/kubelet.sock does not exist" in text
        assert "example.com/nic: taken over by plugvisor-nic-123456-0badc0de.sock" in text
        assert "example.com/fpga: registering again: its socket plugvisor-f.sock was deleted" in text
        ready, why = supervisor.readiness()
        assert not ready
        assert "example.com/nic (taken over by plugvisor-nic-123456-0badc0de.sock)" in why
        assert "waiting for a kubelet: /dp/kubelet.sock does not exist" in supervisor.summary()

    def test_children_started_by_exec_without_the_fork_server_are_said_so(self, running, spawner):
        """The agent supervises on without its fork server: the status says why, and what brings it back."""
        assert "fork server unavailable" not in status_.render(running.snapshot())
        spawner.fallback = "a new fork server did not start: preload failed: ImportError('x')"
        lines = status_.render(running.snapshot()).splitlines()
        assert lines[1] == (
            "fork server unavailable (a new fork server did not start: preload failed: ImportError('x')): "
            "children are started by exec, slower to start; restart the agent to bring the fork server back"
        )

    def test_an_agent_that_could_not_write_any_state_is_not_said_to_be_missing(self, tmp_path, agent_lock):
        """A full runtime directory at start: no state file, but the agent runs (it holds the lock)."""
        result = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)])
        assert result.exit_code == 1
        assert f"the plugvisor agent (pid {os.getpid()}) runs but has no state file" in result.output
        assert "is `plugvisor run` running?" not in result.output

    @pytest.mark.parametrize("kind", ["fifo", "directory"])
    def test_a_pid_file_that_is_not_a_file_does_not_hang_status(self, running, tmp_path, kind):
        """A FIFO would block a plain open() forever: status must answer, and say no agent holds the lock."""
        document = running.snapshot()
        status_.write_state(tmp_path, document)
        pid_file = tmp_path / status_.PID_FILE
        os.mkfifo(pid_file) if kind == "fifo" else pid_file.mkdir()
        assert status_.lock_holder(tmp_path) is None
        result = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)])
        assert result.exit_code == 1
        assert "is stale" in result.output


class TestRuntimeDirLock:
    @pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
    def test_a_pid_file_that_is_not_a_regular_file_is_refused_naming_it(self, tmp_path, kind):
        """The agent says what is wrong with supervisor.pid instead of a traceback, and never writes through
        a link (its PID would overwrite the link's target)."""
        pid_file = tmp_path / status_.PID_FILE
        target = tmp_path / "target"
        target.write_text("precious\n")
        if kind == "fifo":
            os.mkfifo(pid_file)
        elif kind == "directory":
            pid_file.mkdir()
        else:
            pid_file.symlink_to(target)
        with pytest.raises(RuntimeError, match=f"{pid_file}: .*expected a regular file"):
            RuntimeDirLock(tmp_path).acquire()
        assert target.read_text() == "precious\n"


class TestMetrics:
    async def test_the_supervisor_exposes_state_restarts_registrations_and_devices(self, running, tmp_path):
        """Per-resource families from the supervisor's view, in Prometheus text format."""
        text = (await Metrics(running.snapshot, multiproc_dir=tmp_path).render()).decode()
        assert 'plugvisor_child_up{resource="example.com/gpu"} 1.0' in text
        assert 'plugvisor_child_state{resource="example.com/nic",state="STARTING"} 1.0' in text
        assert 'plugvisor_resource_registered{resource="example.com/gpu"} 1.0' in text
        assert 'plugvisor_resource_devices{health="unhealthy",resource="example.com/gpu"} 1.0' in text
        assert 'plugvisor_child_restarts_total{cause="killed",resource="example.com/gpu"} 0.0' in text
        assert "plugvisor_kubelet_restarts_total 0.0" in text
        assert "plugvisor_ready 0.0" in text
        assert "plugvisor_spawner_fallback 0.0" in text

    async def test_children_started_by_exec_without_the_fork_server_show_in_a_gauge(
        self, running, spawner, tmp_path
    ):
        spawner.fallback = "a new fork server did not start: it exited"
        text = (await Metrics(running.snapshot, multiproc_dir=tmp_path).render()).decode()
        assert "plugvisor_spawner_fallback 1.0" in text

    async def test_a_dra_driver_shows_its_mode_and_whether_its_slices_are_synced(
        self, running, tmp_path, agent_lock
    ):
        """A DRA child's SLICES= report reaches `plugvisor status` and /metrics."""
        child = running.children["example.com/nic"]
        child.spec = dataclasses.replace(child.spec, mode="dra")
        running.handle_report(child.pid, {"REGISTERED": "1", "DEVICES": "8/8", "SLICES": "failing: HTTP 403"})

        text = (await Metrics(running.snapshot, multiproc_dir=tmp_path).render()).decode()
        document = running.snapshot()
        document["supervisor"]["pid"] = os.getpid()
        status_.write_state(tmp_path, document)
        output = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)]).output

        assert 'plugvisor_child_info{kind="generic",mode="dra",resource="example.com/nic"} 1.0' in text
        assert (
            'plugvisor_child_info{kind="generic",mode="device-plugin",resource="example.com/gpu"} 1.0' in text
        )
        assert 'plugvisor_dra_slices_synced{resource="example.com/nic"} 0.0' in text
        assert 'plugvisor_dra_slices_synced{resource="example.com/gpu"}' not in text
        assert output.splitlines()[3].endswith("8/8, slices failing: HTTP 403  inotify")

    async def test_a_child_that_polls_for_want_of_inotify_shows_it_until_its_next_process(
        self, running, tmp_path, agent_lock
    ):
        """Its WATCH= report reaches `plugvisor status` (with why) and /metrics; a new process starts over."""
        child = running.children["example.com/nic"]
        why = "cannot watch files: too many inotify instances (fs.inotify.max_user_instances = 128)"
        running.handle_report(child.pid, {"WATCH": f"polling: {why}"})

        text = (await Metrics(running.snapshot, multiproc_dir=tmp_path).render()).decode()
        document = running.snapshot()
        document["supervisor"]["pid"] = os.getpid()
        status_.write_state(tmp_path, document)
        output = CliRunner().invoke(status_command, ["--runtime-dir", str(tmp_path)]).output.splitlines()

        assert 'plugvisor_watch_polling{resource="example.com/nic"} 1.0' in text
        assert 'plugvisor_watch_polling{resource="example.com/gpu"} 0.0' in text
        assert output[3].split()[-1] == "polling"
        assert output[2].split()[-1] == "inotify"
        assert output[4].startswith("watching files by polling, not inotify")
        assert output[5] == f"  1 (example.com/nic): {why}"
        assert document["children"][1]["watch_reason"] == why
        child.on_exit(-9)
        assert running.snapshot()["children"][1]["watch"] is None
        assert running.snapshot()["children"][1]["watch_reason"] is None


class TestSystemdNotifier:
    def test_it_sends_sd_notify_datagrams_to_notify_socket(self, short_dir):
        """READY/STATUS/WATCHDOG reach $NOTIFY_SOCKET as KEY=value lines; pings at half WATCHDOG_USEC."""
        path = short_dir / "notify"
        receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        receiver.bind(str(path))
        notifier = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "2000000"})
        try:
            assert notifier.watchdog_interval == 1.0
            notifier.ready("2/2 resources registered")
            notifier.status("2/2 resources registered")  # unchanged: not sent again
            notifier.watchdog()
            receiver.settimeout(1)
            assert receiver.recv(4096) == b"READY=1\nSTATUS=2/2 resources registered"
            assert receiver.recv(4096) == b"WATCHDOG=1"
        finally:
            notifier.close()
            receiver.close()

    def test_without_systemd_nothing_is_sent_and_nothing_fails(self):
        """Outside systemd every call is a no-op."""
        notifier = Notifier({})
        assert not notifier.enabled
        assert notifier.watchdog_interval is None
        assert not notifier.notify(READY=1)

    def test_a_watchdog_meant_for_another_process_is_ignored(self):
        """WATCHDOG_PID names the process that must ping."""
        assert Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval is None


class TestSupervisordExport:
    def test_each_resource_becomes_a_program_with_the_same_command(self):
        """One [program:x] per resource with the child's exact command line and a stop policy."""
        config = node_config("example.com/gpu", "example.com/nic")
        text = export_supervisord(config, source="node.yaml")
        assert "[group:plugvisor]\nprograms=plugvisor-example.com_gpu,plugvisor-example.com_nic" in text
        assert text.count("[program:") == 2
        assert "autorestart=unexpected" in text
        assert "stopwaitsecs=5" in text
        assert '--options-json \'{"paths":["/dev/fuse"]}\'' in text

    def test_percent_signs_are_escaped_for_supervisord(self):
        """supervisord expands %(x)s in values: a literal % must be doubled."""
        config = node_config("example.com/gpu")
        resources = [config.resources[0].model_copy(update={"paths": ["/dev/100%"]})]
        text = export_supervisord(config.model_copy(update={"resources": resources}), source="n")
        assert "/dev/100%%" in text

    def test_program_names_are_safe(self):
        """Resource names with '/' become valid program names."""
        assert program_name("vendor.example/gpu") == "plugvisor-vendor.example_gpu"

    def test_the_command_writes_to_a_file_and_rejects_invalid_files(self, tmp_path):
        """`plugvisor export supervisord --config F -o OUT`; an invalid file exits 2 naming the field."""
        good = tmp_path / "node.yaml"
        good.write_text("resources: [{name: a.example/x, kind: generic, paths: [/dev/x]}]\n")
        out = tmp_path / "out.conf"
        result = CliRunner().invoke(export_group, ["supervisord", "--config", str(good), "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert "[program:plugvisor-a.example_x]" in out.read_text()
        bad = tmp_path / "bad.yaml"
        bad.write_text("resources: [{name: x, kind: generic, paths: [/dev/x]}]\n")
        result = CliRunner().invoke(export_group, ["supervisord", "--config", str(bad)])
        assert result.exit_code == 2
        assert f"{bad}: resources[0].name" in result.output

    @pytest.mark.parametrize("planted", ["symlink", "fifo"])
    def test_an_output_name_that_is_a_link_or_not_a_file_is_refused_and_left_alone(self, tmp_path, planted):
        """`-o /tmp/x.conf` as root: a symlink someone left at that name must not redirect the write to its
        target (another file of the system), nor may a FIFO or device there be replaced or block us."""
        good = tmp_path / "node.yaml"
        good.write_text("resources: [{name: a.example/x, kind: generic, paths: [/dev/x]}]\n")
        victim = tmp_path / "victim"
        victim.write_text("precious\n")
        out = tmp_path / "out.conf"
        out.symlink_to(victim) if planted == "symlink" else os.mkfifo(out)
        result = CliRunner().invoke(export_group, ["supervisord", "--config", str(good), "-o", str(out)])
        assert result.exit_code == 2
        what = "a symbolic link" if planted == "symlink" else "not a regular file"
        assert f"--output: {out} is {what}; expected a regular file's name" in result.output
        assert victim.read_text() == "precious\n"
        assert out.is_symlink() == (planted == "symlink")
