"""The state machine and the reconcile core, driven by a fake spawner and a fake clock (no processes)."""

import signal

from plugvisor.common import notify
from plugvisor.supervisor import states
from plugvisor.supervisor.supervisor import Supervisor

from .conftest import node_config

GPU = "example.com/gpu"
NIC = "example.com/nic"


def registered(supervisor: Supervisor, resource: str, n: int = 1, devices: str = "2/2") -> None:
    child = supervisor.children[resource]
    supervisor.handle_report(
        child.pid, {"REGISTERED": str(n), "ENDPOINT": f"plugvisor-{n}.sock", "DEVICES": devices}
    )


def crash(supervisor: Supervisor, spawner, resource: str, returncode: int = 1) -> None:
    pid = supervisor.children[resource].pid
    spawner.exit(pid, returncode)
    for exit_ in spawner.reap():
        supervisor.handle_exit(exit_.pid, exit_.returncode)


class TestStartAndReadiness:
    def test_every_resource_gets_one_child_started_at_once(self, make_supervisor, spawner):
        """Start forks one child per resource, in file order, each STARTING."""
        supervisor = make_supervisor(GPU, NIC)
        assert [spec.resource for _, spec in spawner.spawned] == [GPU, NIC]
        assert all(child.state is states.STARTING for child in supervisor.children.values())

    def test_a_child_is_running_once_it_reports_its_registration(self, make_supervisor):
        """The REGISTERED datagram moves STARTING -> RUNNING and records endpoint and devices."""
        supervisor = make_supervisor(GPU)
        registered(supervisor, GPU, devices="3/4")
        child = supervisor.children[GPU]
        assert child.state is states.RUNNING
        assert child.devices == (3, 4)
        assert child.endpoint == "plugvisor-1.sock"

    def test_the_agent_is_ready_only_when_every_resource_is_registered(self, make_supervisor):
        """Readiness (systemd READY=1, /readyz) waits for the last registration."""
        supervisor = make_supervisor(GPU, NIC)
        registered(supervisor, GPU)
        assert not supervisor.ready
        assert supervisor.readiness() == (False, f"not registered: {NIC}")
        registered(supervisor, NIC)
        assert supervisor.ready

    def test_device_changes_update_the_counts(self, make_supervisor):
        """A DEVICES datagram alone updates healthy/total."""
        supervisor = make_supervisor(GPU)
        registered(supervisor, GPU)
        supervisor.handle_report(supervisor.children[GPU].pid, {"DEVICES": "1/2"})
        assert supervisor.children[GPU].devices == (1, 2)

    def test_reports_from_unknown_processes_are_ignored(self, make_supervisor):
        """A datagram from a PID that is no child of ours changes nothing."""
        supervisor = make_supervisor(GPU)
        supervisor.handle_report(99999, {"REGISTERED": "1"})
        assert supervisor.children[GPU].state is states.STARTING


class TestCrashRestart:
    def test_the_first_crash_restarts_at_once(self, make_supervisor, spawner):
        """One unexpected exit costs no delay: the child is started again on the next tick."""
        supervisor = make_supervisor(GPU)
        registered(supervisor, GPU)
        crash(supervisor, spawner, GPU, -signal.SIGKILL)
        child = supervisor.children[GPU]
        assert child.state is states.BACKOFF
        supervisor.tick()
        assert child.state is states.STARTING
        assert len(spawner.pids_for(GPU)) == 2
        assert child.restarts == {"killed": 1}
        assert child.last_exit is not None and child.last_exit.detail == "signal SIGKILL"

    def test_repeated_crashes_back_off_exponentially_up_to_the_cap(self, make_supervisor, spawner, clock):
        """Delays 0, 1, 2, 4, 8, 8... (initial 1 s, cap 8 s, no jitter), and the child is never given up."""
        supervisor = make_supervisor(GPU)
        delays = []
        for _ in range(7):
            crash(supervisor, spawner, GPU)
            child = supervisor.children[GPU]
            delays.append(child.delay)
            clock.advance(child.delay - 0.001 if child.delay else 0)
            supervisor.tick()
            if child.delay:
                assert child.state is states.BACKOFF, "started before its delay was over"
                clock.advance(0.001)
                supervisor.tick()
            assert child.state is states.STARTING
        assert delays == [0, 1, 2, 4, 8, 8, 8]

    def test_a_crash_looping_child_is_reported_and_never_disturbs_the_others(
        self, make_supervisor, spawner, clock
    ):
        """After crashLoopAfter failures the child is flagged; the other child keeps its one process."""
        supervisor = make_supervisor(GPU, NIC)
        registered(supervisor, NIC)
        for _ in range(6):
            crash(supervisor, spawner, GPU)
            clock.advance(supervisor.children[GPU].delay)
            supervisor.tick()
        assert supervisor.children[GPU].crash_looping
        assert "crash-looping: example.com/gpu" in supervisor.summary()
        assert len(spawner.pids_for(NIC)) == 1
        assert supervisor.children[NIC].state is states.RUNNING
        assert not [s for s in spawner.signals if s[0] in spawner.pids_for(NIC)]

    def test_staying_up_long_enough_resets_the_backoff(self, make_supervisor, spawner, clock):
        """A process up for resetAfter seconds wipes the failure count: the next crash restarts at once."""
        supervisor = make_supervisor(GPU)
        for _ in range(4):
            crash(supervisor, spawner, GPU)
            clock.advance(supervisor.children[GPU].delay)
            supervisor.tick()
        assert supervisor.children[GPU].failures == 4
        clock.advance(10)
        supervisor.tick()
        assert supervisor.children[GPU].failures == 0
        crash(supervisor, spawner, GPU)
        assert supervisor.children[GPU].delay == 0

    def test_a_configuration_error_waits_the_full_cap_every_time(self, make_supervisor, spawner, clock):
        """Exit status 2 cannot be fixed by retrying quickly: straight to the cap, shown as a crash loop."""
        supervisor = make_supervisor(GPU)
        crash(supervisor, spawner, GPU, 2)
        child = supervisor.children[GPU]
        assert (child.state, child.delay, child.crash_looping) == (states.BACKOFF, 8, True)
        assert child.restarts == {"config": 1}
        clock.advance(7.9)
        supervisor.tick()
        assert child.state is states.BACKOFF

    def test_a_spawn_failure_backs_off_like_a_crash(self, make_supervisor, spawner, clock):
        """An error creating the process is recorded and retried with backoff, never raised."""
        supervisor = make_supervisor(GPU)
        spawner.fail_next = ["EAGAIN", "EAGAIN"]
        crash(supervisor, spawner, GPU)
        supervisor.tick()
        child = supervisor.children[GPU]
        assert (child.state, child.spawn_error) == (states.BACKOFF, "EAGAIN")
        clock.advance(child.delay)
        supervisor.tick()
        clock.advance(child.delay)
        supervisor.tick()
        assert child.state is states.STARTING
        assert child.spawn_error is None
        assert child.restarts["spawn-error"] == 2

    def test_the_next_deadline_is_the_end_of_the_backoff(self, make_supervisor, spawner, clock):
        """The loop can sleep exactly until a backoff ends."""
        supervisor = make_supervisor(GPU)
        crash(supervisor, spawner, GPU)
        supervisor.tick()
        crash(supervisor, spawner, GPU)
        assert supervisor.tick() == clock.monotonic() + 1


class TestKubeletRestart:
    def test_status_3_restarts_at_once_without_counting_a_failure(self, make_supervisor, spawner):
        """A child that exits because the kubelet restarted is started again immediately, no backoff."""
        supervisor = make_supervisor(GPU)
        registered(supervisor, GPU)
        for _ in range(5):
            crash(supervisor, spawner, GPU, 3)
        child = supervisor.children[GPU]
        assert child.state is states.STARTING
        assert (child.failures, child.restarts["kubelet-restart"]) == (0, 5)
        assert len(spawner.pids_for(GPU)) == 6

    def test_restart_policy_restarts_children_registered_before_the_new_kubelet(
        self, make_supervisor, spawner, clock
    ):
        """kubelet.sock created after a registration: that child is stopped and restarted at once."""
        supervisor = make_supervisor(GPU, NIC, onKubeletRestart="restart")
        registered(supervisor, GPU)
        registered(supervisor, NIC)
        old = supervisor.children[GPU].pid
        supervisor.handle_kubelet_started(clock.wall() + 0.001)
        assert supervisor.kubelet_restarts == 1
        assert (old, signal.SIGTERM) in spawner.signals
        assert supervisor.children[GPU].state is states.STOPPING
        crash(supervisor, spawner, GPU, 0)
        assert supervisor.children[GPU].state is states.STARTING
        assert supervisor.children[GPU].restarts == {"kubelet-restart": 1}

    def test_a_child_the_agent_restarted_for_it_was_stopped_not_exited(self, make_supervisor, spawner, clock):
        """Its SIGTERM'd process ends with 0: stopped by the agent, never a bare ``exit status 0``."""
        supervisor = make_supervisor(GPU, onKubeletRestart="restart")
        registered(supervisor, GPU)
        supervisor.handle_kubelet_started(clock.wall() + 0.001)
        crash(supervisor, spawner, GPU, 0)
        last = supervisor.snapshot()["children"][0]["last_exit"]
        assert (last["cause"], last["status"]) == ("kubelet-restart", "stopped by the agent")

    def test_a_child_that_exited_itself_for_it_says_so(self, make_supervisor, spawner):
        """The plugin noticed first (status 3): shown as an exit to register again, the same restart."""
        supervisor = make_supervisor(GPU, onKubeletRestart="restart")
        registered(supervisor, GPU)
        crash(supervisor, spawner, GPU, 3)
        last = supervisor.snapshot()["children"][0]["last_exit"]
        assert (last["cause"], last["status"]) == (
            "kubelet-restart",
            "exited to register again (exit status 3)",
        )

    def test_a_stopped_child_that_had_to_be_killed_says_how_it_ended(self, make_supervisor, spawner, clock):
        supervisor = make_supervisor(GPU, onKubeletRestart="restart")
        registered(supervisor, GPU)
        supervisor.handle_kubelet_started(clock.wall() + 0.001)
        crash(supervisor, spawner, GPU, -signal.SIGKILL)
        last = supervisor.snapshot()["children"][0]["last_exit"]
        assert last["status"] == "stopped by the agent (signal SIGKILL)"

    def test_a_child_that_registered_with_the_new_kubelet_is_left_alone(
        self, make_supervisor, spawner, clock
    ):
        """If the child noticed first and registered again, the supervisor's own notice changes nothing."""
        supervisor = make_supervisor(GPU, onKubeletRestart="restart")
        kubelet_created = clock.wall()
        clock.advance(0.01)
        registered(supervisor, GPU)
        supervisor.handle_kubelet_started(kubelet_created)
        assert supervisor.children[GPU].state is states.RUNNING
        assert spawner.signals == []

    def test_reregister_policy_only_waits_for_the_new_registration(self, make_supervisor, spawner, clock):
        """With reregister the child is not signalled; it is unregistered until its next REGISTERED."""
        supervisor = make_supervisor(GPU, onKubeletRestart="reregister")
        registered(supervisor, GPU)
        supervisor.handle_kubelet_started(clock.wall() + 0.001)
        assert spawner.signals == []
        assert not supervisor.ready
        clock.advance(0.01)
        registered(supervisor, GPU, n=2)
        assert supervisor.ready

    def test_deletion_of_a_childs_own_socket_counts_as_a_kubelet_restart(self, make_supervisor, spawner):
        """Only the child whose socket vanished is affected."""
        supervisor = make_supervisor(GPU, NIC, onKubeletRestart="restart")
        registered(supervisor, GPU)
        supervisor.handle_report(
            supervisor.children[NIC].pid, {"REGISTERED": "1", "ENDPOINT": "plugvisor-nic.sock"}
        )
        supervisor.handle_socket_deleted("plugvisor-nic.sock")
        assert supervisor.children[NIC].state is states.STOPPING
        assert supervisor.children[GPU].state is states.RUNNING

    def test_a_registration_whose_socket_is_already_gone_is_outdated(self, make_supervisor, spawner):
        """A REGISTERED that arrives after the kubelet wiped the socket counts as lost: restart at once."""
        supervisor = make_supervisor(GPU, onKubeletRestart="restart")
        pid = supervisor.children[GPU].pid
        supervisor.handle_report(pid, {"REGISTERED": "1", "ENDPOINT": "gone.sock"})
        assert (pid, signal.SIGTERM) in spawner.signals
        assert not supervisor.ready

    def test_a_plugin_watcher_childs_socket_is_not_looked_for_in_the_kubelet_dir(self, spawner, clock):
        """Its socket is in plugins_registry: each registration was taken as outdated (a restart loop)."""
        config = node_config(GPU, onKubeletRestart="restart")
        config = config.model_copy(
            update={"resources": [config.resources[0].model_copy(update={"registration": "plugin-watcher"})]}
        )
        supervisor = Supervisor(
            config, spawner=spawner, clock=clock, rand=lambda: 0.5, socket_exists=lambda name: False
        )
        supervisor.start()
        pid = supervisor.children[GPU].pid
        supervisor.handle_report(pid, {"REGISTERED": "1", "ENDPOINT": "plugvisor-gpu-in-registry.sock"})
        assert (pid, signal.SIGTERM) not in spawner.signals
        assert supervisor.children[GPU].state is states.RUNNING

    def test_a_kubelet_restart_reported_by_the_child_unregisters_it(self, make_supervisor):
        """KUBELET_RESTART from the child means its registration is gone until the next REGISTERED."""
        supervisor = make_supervisor(GPU, onKubeletRestart="reregister")
        registered(supervisor, GPU)
        supervisor.handle_report(supervisor.children[GPU].pid, {"KUBELET_RESTART": "kubelet.sock created"})
        assert not supervisor.ready


class TestStop:
    def test_stop_sends_sigterm_then_sigkill_after_the_bound(self, make_supervisor, spawner, clock):
        """SIGTERM first; a child still there after stopTimeout gets SIGKILL once."""
        supervisor = make_supervisor(GPU)
        pid = supervisor.children[GPU].pid
        supervisor.stop()
        assert spawner.signals == [(pid, signal.SIGTERM)]
        clock.advance(4.9)
        supervisor.tick()
        assert spawner.signals == [(pid, signal.SIGTERM)]
        clock.advance(0.2)
        supervisor.tick()
        supervisor.tick()
        assert spawner.signals == [(pid, signal.SIGTERM), (pid, signal.SIGKILL)]
        crash(supervisor, spawner, GPU, -9)
        assert supervisor.stopped

    def test_a_stopped_child_is_not_restarted(self, make_supervisor, spawner, clock):
        """An exit during a stop ends in STOPPED, whatever the status."""
        supervisor = make_supervisor(GPU, NIC)
        supervisor.stop()
        crash(supervisor, spawner, GPU, 1)
        crash(supervisor, spawner, NIC, 0)
        clock.advance(100)
        supervisor.tick()
        assert supervisor.stopped
        assert len(spawner.spawned) == 2

    def test_a_child_in_backoff_stops_without_a_process(self, make_supervisor, spawner):
        """Stopping during BACKOFF cancels the pending start."""
        supervisor = make_supervisor(GPU)
        crash(supervisor, spawner, GPU)
        crash_count = len(spawner.spawned)
        supervisor.stop()
        supervisor.tick()
        assert supervisor.stopped
        assert len(spawner.spawned) == crash_count


class TestReload:
    def test_only_changed_added_and_removed_children_are_touched(self, make_supervisor, spawner, clock):
        """Unchanged: same process; changed: restarted at once; removed: stopped; added: started."""
        supervisor = make_supervisor(GPU, NIC, "example.com/old")
        for resource in (GPU, NIC, "example.com/old"):
            registered(supervisor, resource)
        nic_pid = supervisor.children[NIC].pid
        old_pid = supervisor.children["example.com/old"].pid
        new = node_config(GPU, NIC, "example.com/new").model_copy()
        resources = [
            r.model_copy(update={"paths": ["/dev/other"]}) if r.name == GPU else r for r in new.resources
        ]
        summary = supervisor.reload(new.model_copy(update={"resources": resources}))
        assert summary == {
            "added": ["example.com/new"],
            "removed": ["example.com/old"],
            "changed": [GPU],
            "unchanged": [NIC],
        }
        assert supervisor.children[NIC].pid == nic_pid
        assert supervisor.children[GPU].state is states.STOPPING
        assert (old_pid, signal.SIGTERM) in spawner.signals
        assert supervisor.children["example.com/new"].state is states.STARTING
        crash(supervisor, spawner, GPU, 0)
        assert supervisor.children[GPU].state is states.STARTING
        assert supervisor.children[GPU].restarts == {"reload": 1}
        assert '"/dev/other"' in " ".join(supervisor.children[GPU].spec.args)
        spawner.exit(old_pid, 0)
        for exit_ in spawner.reap():
            supervisor.handle_exit(exit_.pid, exit_.returncode)
        supervisor.tick()
        assert supervisor.retiring == []

    def test_a_new_restart_policy_applies_without_restarting(self, make_supervisor, spawner):
        """Backoff settings are not part of a child's process: changing them restarts nothing."""
        supervisor = make_supervisor(GPU)
        summary = supervisor.reload(node_config(GPU, restart={"maxDelay": 60}))
        assert summary["unchanged"] == [GPU]
        assert supervisor.children[GPU].policy.cap == 60
        assert len(spawner.spawned) == 1

    def test_a_setting_read_at_start_only_is_flagged_against_what_runs(self, make_supervisor):
        """runtimeDir and spawner apply at start: editing one warns, and editing it back to the value in
        force does not (the operator must not be told to restart for the configuration that runs)."""
        from structlog.testing import capture_logs

        supervisor = make_supervisor(GPU)
        started = supervisor.config.runtime_dir
        with capture_logs() as logs:
            supervisor.reload(node_config(GPU, runtimeDir="/tmp/elsewhere", spawner="exec"))
            first = [
                (e["setting"], e["running"]) for e in logs if e["event"] == "reload_setting_needs_restart"
            ]
            logs.clear()
            supervisor.reload(node_config(GPU, runtimeDir=str(started)))
            second = [e for e in logs if e["event"] == "reload_setting_needs_restart"]
        assert sorted(first) == [("runtime_dir", str(started)), ("spawner", "forkserver")]
        assert second == []


class TestSnapshot:
    def test_the_snapshot_has_what_status_shows(self, make_supervisor, spawner, clock):
        """Resource, state, PID, uptime, restarts, last exit cause, devices."""
        supervisor = make_supervisor(GPU)
        registered(supervisor, GPU, devices="7/8")
        crash(supervisor, spawner, GPU, 1)
        supervisor.tick()
        registered(supervisor, GPU, devices="7/8")
        clock.advance(3)
        child = supervisor.snapshot()["children"][0]
        assert child["resource"] == GPU
        assert child["state"] == "RUNNING"
        assert child["pid"] == spawner.pids_for(GPU)[-1]
        assert child["uptime"] == 3
        assert child["restarts"] == 1
        assert child["last_exit"]["cause"] == "crash"
        assert child["devices"] == {"healthy": 7, "total": 8}


class TestSpawnsInFlight:
    """A spawn answers later when the fork server is slow or being replaced; nothing waits for it."""

    def test_a_child_is_starting_without_a_pid_until_the_answer_comes(self, make_supervisor, spawner):
        """STARTING at once; the PID arrives with the answer."""
        spawner.deferred = True
        supervisor = make_supervisor(GPU)
        child = supervisor.children[GPU]
        assert child.state is states.STARTING
        assert child.pid is None
        pid = spawner.answer()
        assert child.pid == pid
        assert child.state is states.STARTING

    def test_a_stop_during_the_spawn_stops_the_process_as_soon_as_it_exists(self, make_supervisor, spawner):
        """SIGTERM goes to the new PID on arrival; its exit ends in STOPPED."""
        spawner.deferred = True
        supervisor = make_supervisor(GPU)
        supervisor.stop()
        child = supervisor.children[GPU]
        assert child.state is states.STOPPING
        assert child.next_deadline() is None, "no SIGKILL deadline can run out for a process not yet there"
        pid = spawner.answer()
        assert spawner.signals == [(pid, signal.SIGTERM)]
        spawner.exit(pid, 0)
        for exit_ in spawner.reap():
            supervisor.handle_exit(exit_.pid, exit_.returncode)
        assert child.state is states.STOPPED
        assert supervisor.stopped

    def test_a_failed_spawn_during_a_stop_ends_in_stopped(self, make_supervisor, spawner):
        """No process, no stop to wait for."""
        spawner.deferred = True
        supervisor = make_supervisor(GPU)
        supervisor.stop()
        spawner.answer(error="the agent is stopping")
        assert supervisor.children[GPU].state is states.STOPPED

    def test_a_restart_during_the_spawn_replaces_the_process_once(self, make_supervisor, spawner):
        """The first process is stopped on arrival, the second started when it has exited."""
        spawner.deferred = True
        supervisor = make_supervisor(GPU)
        child = supervisor.children[GPU]
        child.restart("reload")
        first = spawner.answer()
        assert spawner.signals == [(first, signal.SIGTERM)]
        spawner.exit(first, -signal.SIGTERM)
        for exit_ in spawner.reap():
            supervisor.handle_exit(exit_.pid, exit_.returncode)
        second = spawner.answer()
        assert child.pid == second != first
        assert child.state is states.STARTING
        assert child.restarts == {"reload": 1}

    def test_a_failed_spawn_backs_off_like_a_crash(self, make_supervisor, spawner, clock):
        """spawn-error: counted, backed off, retried when the delay is over."""
        spawner.deferred = True
        supervisor = make_supervisor(GPU)
        spawner.answer(error="fork failed: EAGAIN")
        child = supervisor.children[GPU]
        assert child.state is states.BACKOFF
        assert child.restarts == {"spawn-error": 1}
        assert child.spawn_error == "fork failed: EAGAIN"
        clock.advance(1.0)
        supervisor.tick()
        assert child.state is states.STARTING
        assert len(spawner.waiting) == 1


class TestRegistrationSafetyNet:
    """Whatever a child missed, it is not left unregistered for long while the kubelet is up."""

    def test_a_child_unregistered_for_the_timeout_is_restarted(self, make_supervisor, spawner, clock):
        """A kubelet restart the child never noticed: restarted after registrationTimeout."""
        supervisor = make_supervisor(GPU, registrationTimeout=20)
        registered(supervisor, GPU)
        first = supervisor.children[GPU].pid
        supervisor.handle_report(first, {"KUBELET_RESTART": "plugin socket deleted"})
        assert supervisor.tick() == clock.monotonic() + 20
        clock.advance(19)
        supervisor.tick()
        assert supervisor.children[GPU].pid == first
        clock.advance(1.5)
        supervisor.tick()
        assert (first, signal.SIGTERM) in spawner.signals
        crash(supervisor, spawner, GPU, returncode=-signal.SIGTERM)
        child = supervisor.children[GPU]
        assert child.pid != first
        assert child.restarts == {"unregistered": 1}
        assert child.failures == 0

    def test_a_child_that_never_registers_is_restarted_too(self, make_supervisor, spawner, clock):
        """The timeout counts from the start when there was never a registration."""
        supervisor = make_supervisor(GPU, registrationTimeout=20)
        clock.advance(21)
        supervisor.tick()
        assert spawner.signals == [(supervisor.children[GPU].pid, signal.SIGTERM)]

    def test_with_no_kubelet_nobody_is_blamed(self, clock, spawner):
        """No kubelet.sock: waiting is right, however long."""
        supervisor = Supervisor(
            node_config(GPU, registrationTimeout=20),
            spawner=spawner,
            clock=clock,
            rand=lambda: 0.5,
            socket_exists=lambda name: False,
        )
        supervisor.start()
        clock.advance(600)
        assert supervisor.tick() is None
        assert spawner.signals == []

    def test_the_timeout_counts_from_the_kubelets_start(self, make_supervisor, spawner, clock):
        """A kubelet that came up late gives every child the full timeout from then on."""
        supervisor = make_supervisor(GPU, registrationTimeout=20)
        clock.advance(15)
        supervisor.handle_kubelet_started(None)
        clock.advance(15)
        supervisor.tick()
        assert spawner.signals == []


class TestKubeletRestartLog:
    def test_the_restart_names_the_children_that_lost_their_socket_first(self, make_supervisor, clock):
        """Sockets are deleted before kubelet.sock appears: those children are the restart's affected."""
        from structlog.testing import capture_logs

        supervisor = make_supervisor(GPU, NIC)
        registered(supervisor, GPU)
        registered(supervisor, NIC, n=2)
        with capture_logs() as logs:
            supervisor.handle_socket_deleted("plugvisor-1.sock")
            supervisor.handle_socket_deleted("plugvisor-2.sock")
            supervisor.handle_kubelet_started(clock.wall() + 0.001)
        restart = [entry for entry in logs if entry["event"] == "kubelet_restart"]
        assert restart[0]["affected"] == sorted([GPU, NIC])


class TestForkServerTrouble:
    def test_a_spawn_the_fork_server_failed_counts_against_no_child(self, make_supervisor, spawner, clock):
        """Died, hung, never ready: retried after the first step, with no failure counted."""
        from plugvisor.supervisor.spawner import SpawnError

        spawner.deferred = True
        supervisor = make_supervisor(GPU)
        _spec, done = spawner.waiting.pop(0)
        done(SpawnError("the fork server did not answer within 10 s", helper_fault=True))
        child = supervisor.children[GPU]
        assert child.state is states.BACKOFF
        assert child.failures == 0
        assert child.restarts == {"spawn-error": 1}
        clock.advance(child.delay)
        supervisor.tick()
        assert child.state is states.STARTING


class TestDeadSockets:
    def test_every_dead_socket_of_the_resource_goes_when_its_process_is_reaped(self, clock, spawner):
        """Even one the process never got to report: the sweep is by the resource's socket prefix."""
        from plugvisor.common.sockets import socket_prefix

        swept: list[str] = []
        supervisor = Supervisor(
            node_config(GPU, NIC),
            spawner=spawner,
            clock=clock,
            rand=lambda: 0.5,
            socket_exists=lambda name: True,
            sweep_sockets=lambda prefix: swept.append(prefix) or [],
        )
        supervisor.start()
        crash(supervisor, spawner, GPU, returncode=-9)
        assert swept == [socket_prefix(GPU)]


class TestDraDrivers:
    DRIVER = "gpu.plugvisor.io"

    def make(self, spawner, clock, **settings: object) -> Supervisor:
        config = node_config(GPU, **settings)
        dra = config.resources[0].model_copy(update={"name": self.DRIVER, "mode": "dra"})
        supervisor = Supervisor(
            config.model_copy(update={"resources": [dra, config.resources[0]]}),
            spawner=spawner,
            clock=clock,
            rand=lambda: 0.5,
            socket_exists=lambda name: name == "kubelet.sock",  # no child's socket is in the kubelet dir
        )
        supervisor.start()
        return supervisor

    def test_a_driver_is_never_restarted_for_a_kubelet_restart_but_waits_for_its_new_registration(
        self, spawner, clock
    ):
        """The new kubelet's plugin watcher dials the driver again: restarting it would only cost its work."""
        supervisor = self.make(spawner, clock, onKubeletRestart="restart")
        driver = supervisor.children[self.DRIVER]
        supervisor.handle_report(driver.pid, {"REGISTERED": "1", "ENDPOINT": f"{self.DRIVER}-reg.sock"})
        assert driver.state is states.RUNNING  # its socket is not in the kubelet dir, and that is fine

        supervisor.handle_kubelet_started(clock.wall() + 0.001)

        assert (driver.pid, signal.SIGTERM) not in spawner.signals
        assert not driver.registered and not supervisor.ready
        clock.advance(0.01)
        supervisor.handle_report(driver.pid, {"REGISTERED": "2"})
        assert driver.registered and driver.restarts == {}

    def test_a_driver_that_is_never_dialled_again_is_restarted_after_the_registration_timeout(
        self, spawner, clock
    ):
        supervisor = self.make(spawner, clock, onKubeletRestart="restart", registrationTimeout=30)
        driver = supervisor.children[self.DRIVER]
        supervisor.handle_report(driver.pid, {"REGISTERED": "1"})
        supervisor.handle_kubelet_started(clock.wall() + 0.001)

        clock.advance(31)
        supervisor.tick()

        assert driver.state is states.STOPPING
        assert driver.restart_after_stop == "unregistered"

    def test_the_drivers_slices_and_mode_are_in_the_status(self, spawner, clock):
        supervisor = self.make(spawner, clock)
        driver = supervisor.children[self.DRIVER]
        supervisor.handle_report(driver.pid, {"REGISTERED": "1", "DEVICES": "7/8", "SLICES": "synced"})

        child = next(c for c in supervisor.snapshot()["children"] if c["resource"] == self.DRIVER)

        assert (child["mode"], child["slices"], child["devices"]) == (
            "dra",
            "synced",
            {"healthy": 7, "total": 8},
        )

    def test_a_driver_removed_by_a_reload_is_told_it_goes_for_good_and_one_stopped_with_the_agent_is_not(
        self, spawner, clock
    ):
        """The stop-for-good signal makes the driver withdraw its slices; an agent's stop keeps them."""
        supervisor = self.make(spawner, clock)
        driver_pid = supervisor.children[self.DRIVER].pid
        plugin_pid = supervisor.children[GPU].pid

        supervisor.reload(node_config(GPU))

        assert (driver_pid, notify.STOP_FOR_GOOD_SIGNAL) in spawner.signals
        assert (plugin_pid, notify.STOP_FOR_GOOD_SIGNAL) not in spawner.signals

        again = self.make(spawner, clock)
        driver_pid = again.children[self.DRIVER].pid
        again.stop()
        assert (driver_pid, signal.SIGTERM) in spawner.signals
        assert (driver_pid, notify.STOP_FOR_GOOD_SIGNAL) not in spawner.signals
