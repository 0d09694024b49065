"""`plugvisor run` as a real process against the emulated kubelet: start, crashes, kubelet restarts, stops."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ..full_disk import fill, small_tmpfs
from .conftest import (
    DISK,
    EXPECTED,
    FUSE,
    SERIAL,
    processes_of,
    registered_all,
    running_registered,
    start_registered,
    wait_gone,
)


async def test_start_registers_every_resource_and_reports_it(node, kubelet, agents):
    """Each resource gets a child that registers its devices; status, metrics and readiness say so."""
    node.write_config(metrics={"listen": "127.0.0.1:0"})
    agent = await agents()
    await kubelet.wait_for(registered_all(EXPECTED), timeout=20)
    await agent.wait_state(running_registered)
    children = agent.children()
    assert {name: (c["devices"]["healthy"], c["devices"]["total"]) for name, c in children.items()} == {
        FUSE: (4, 4),
        SERIAL: (2, 2),
        DISK: (1, 1),
    }
    status = subprocess.run(
        [sys.executable, "-c", "from plugvisor.supervisor.cli import status_command; status_command()",
         "--runtime-dir", str(node.runtime_dir)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "3/3 resources registered" in status.stdout
    rows = {line.split()[0]: line.split() for line in status.stdout.splitlines()[2:]}
    assert rows[FUSE][1] == "RUNNING"
    assert rows[FUSE][2] == str(children[FUSE]["pid"])
    assert rows[FUSE][-2:] == ["4/4", "inotify"]
    port = int(agent.log().split("url='http://127.0.0.1:")[1].split("/")[0])

    def get(path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    status_code, metrics = await asyncio.to_thread(get, "/metrics")
    assert status_code == 200
    assert f'plugvisor_resource_devices{{health="healthy",resource="{FUSE}"}} 4.0' in metrics
    assert f'plugvisor_resource_registered{{resource="{DISK}"}} 1.0' in metrics
    assert "plugvisor_ready 1.0" in metrics
    assert await asyncio.to_thread(get, "/healthz") == (200, "ok\n")
    assert (await asyncio.to_thread(get, "/readyz"))[0] == 200
    assert await agent.stop() == 0


async def test_a_killed_child_is_restarted_and_registers_again(node, kubelet, agents):
    """SIGKILL of one child: only that resource restarts, at once, and comes back with its devices."""
    node.write_config()
    agent = await agents()
    await agent.wait_state(running_registered)
    # The child reports "registered" when Register returns; the kubelet lists the resource at the
    # first ListAndWatch message, a moment later.
    await kubelet.wait_for(registered_all(EXPECTED))
    before = agent.children()
    endpoint = kubelet.resource(SERIAL).endpoint
    processes_before = len(processes_of(node))
    import os

    os.kill(before[SERIAL]["pid"], signal.SIGKILL)
    await kubelet.wait_for(
        lambda k: k.resource(SERIAL).registered and k.resource(SERIAL).endpoint != endpoint, timeout=10
    )
    await kubelet.wait_for(registered_all(EXPECTED))
    await agent.wait_state(lambda c: running_registered(c) and c[SERIAL]["pid"] != before[SERIAL]["pid"])
    after = agent.children()
    assert after[SERIAL]["restarts_by_cause"] == {"killed": 1}
    assert after[SERIAL]["last_exit"]["status"] == "signal SIGKILL"
    assert after[FUSE]["pid"] == before[FUSE]["pid"]
    assert after[DISK]["pid"] == before[DISK]["pid"]
    assert len(processes_of(node)) == processes_before
    assert await agent.stop() == 0


@pytest.mark.parametrize("policy", ["reregister", "restart"])
async def test_a_kubelet_restart_brings_every_resource_back(node, kubelet, agents, policy):
    """The kubelet wipes the sockets and restarts: every resource registers again, and the agent saw it."""
    node.write_config(supervisor={"onKubeletRestart": policy})
    agent = await agents()
    await agent.wait_state(running_registered)
    pids = {name: child["pid"] for name, child in agent.children().items()}
    for _ in range(3):
        generation = kubelet.generation
        await kubelet.restart()
        await kubelet.wait_for(
            lambda k, g=generation + 1: (
                registered_all(EXPECTED)(k) and all(r.generation == g for r in k.registrations[-3:])
            ),
            timeout=10,
        )
    await agent.wait_state(running_registered, timeout=10)
    state = agent.state()
    assert state["supervisor"]["kubelet_restarts"] == 3
    children = agent.children()
    if policy == "restart":
        assert all(children[name]["pid"] != pids[name] for name in pids)
        assert all(children[name]["restarts_by_cause"] == {"kubelet-restart": 3} for name in pids)
    else:
        assert {name: child["pid"] for name, child in children.items()} == pids
    assert len(node.sockets()) == 3
    assert await agent.stop() == 0


async def test_sigterm_stops_every_child_and_exits_0_leaving_nothing(node, kubelet, agents):
    """A clean stop: children end, their sockets go, the runtime files go, status 0."""
    node.write_config()
    agent = await agents()
    await agent.wait_state(running_registered)
    assert await agent.stop(signal.SIGTERM) == 0
    assert await wait_gone(node, timeout=1) == []
    assert node.sockets() == []
    assert not (node.runtime_dir / "state.json").exists()
    assert "supervisor_stopped" in agent.log()


async def test_sigint_stops_like_sigterm(node, kubelet, agents):
    """Ctrl-C is a clean stop too."""
    node.write_config()
    agent = await agents()
    await agent.wait_state(running_registered)
    assert await agent.stop(signal.SIGINT) == 0
    assert await wait_gone(node, timeout=1) == []


async def test_children_die_with_a_killed_supervisor_and_the_next_one_cleans_up(node, kubelet, agents):
    """SIGKILL of the supervisor takes its children down; a new agent removes stale sockets and registers."""
    node.write_config()
    node.kubelet_dir.mkdir(parents=True, exist_ok=True)
    stale = node.kubelet_dir / "plugvisor-fuse-000000-deadbeef.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(stale))
    leftover.close()
    first = await agents()
    await first.wait_state(running_registered)
    assert stale.name not in node.sockets(), "a stale socket survived the start"
    assert await first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert await wait_gone(node, timeout=3) == [], "children outlived their supervisor"
    second = await agents()
    # The first agent's state file is still there (it was SIGKILLed): wait for the second's own.
    await second.wait_state(
        lambda c: running_registered(c) and (second.state() or {})["supervisor"]["pid"] == second.pid
    )
    await kubelet.wait_for(registered_all(EXPECTED))
    assert len(node.sockets()) == 3
    assert await second.stop() == 0


async def test_sighup_restarts_only_changed_children_and_keeps_all_on_an_invalid_file(node, kubelet, agents):
    """Reload: changed -> new process; unchanged -> same one; added/removed; invalid -> no change."""
    node.write_config()
    agent = await agents()
    await agent.wait_state(running_registered)
    pids = {name: child["pid"] for name, child in agent.children().items()}

    resources = node.resources()
    resources[0]["count"] = 6
    resources.pop(2)
    resources.append({"name": "example.com/null", "kind": "generic", "paths": ["/dev/fuse"]})
    node.write_config(resources)
    agent.send(signal.SIGHUP)
    expected = {FUSE: 6, SERIAL: 2, "example.com/null": 1}
    await kubelet.wait_for(registered_all(expected), timeout=10)
    await agent.wait_state(
        lambda c: (
            set(c) == set(expected) and all(x["state"] == "RUNNING" and x["registered"] for x in c.values())
        )
    )
    children = agent.children()
    assert children[FUSE]["pid"] != pids[FUSE]
    assert children[FUSE]["restarts_by_cause"] == {"reload": 1}
    assert children[SERIAL]["pid"] == pids[SERIAL]
    await kubelet.wait_for(lambda k: not k.resource(DISK).registered)

    node.config_path.write_text("resources: [{name: broken, kind: generic}]\n")
    agent.send(signal.SIGHUP)
    deadline = asyncio.get_running_loop().time() + 10
    while "reload_rejected" not in agent.log():
        assert asyncio.get_running_loop().time() < deadline, agent.log()
        await asyncio.sleep(0.05)
    assert "resources[0].name" in agent.log()
    assert {name: c["pid"] for name, c in agent.children().items()} == {
        name: c["pid"] for name, c in children.items()
    }
    assert await agent.stop() == 0


async def test_systemd_is_told_ready_status_watchdog_and_stopping(node, kubelet, agents, short_dir):
    """With NOTIFY_SOCKET set: READY=1 after every registration, STATUS lines, watchdog pings, STOPPING=1."""
    node.write_config()
    path = short_dir / "notify.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.setblocking(False)
    messages = []
    try:
        agent = await agents({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not any("READY=1" in m for m in messages):
            assert loop.time() < deadline, messages
            try:
                messages.append((await loop.sock_recv(receiver, 4096)).decode())
            except BlockingIOError:
                await asyncio.sleep(0.01)
        await agent.wait_state(running_registered)  # raises, naming the children's states, if it never holds
        ready = next(m for m in messages if "READY=1" in m)
        assert "STATUS=3/3 resources registered" in ready
        while sum("WATCHDOG=1" in m for m in messages) < 3:
            assert loop.time() < deadline + 5, messages
            messages.append((await asyncio.wait_for(loop.sock_recv(receiver, 4096), 5)).decode())
        assert await agent.stop() == 0
        while True:
            try:
                messages.append(receiver.recv(4096).decode())
            except BlockingIOError:
                break
        assert any("STOPPING=1" in m for m in messages)
        assert not any("READY=1" in m for m in messages[: messages.index(ready)])
    finally:
        receiver.close()


async def test_children_do_not_inherit_the_systemd_variables(node, kubelet, agents, short_dir):
    """Only the main process talks to systemd."""
    node.write_config()
    agent = await agents({"NOTIFY_SOCKET": str(short_dir / "nobody.sock")})
    await agent.wait_state(running_registered)
    from pathlib import Path

    for child in agent.children().values():
        environ = Path(f"/proc/{child['pid']}/environ").read_bytes()
        assert b"NOTIFY_SOCKET" not in environ
    assert await agent.stop() == 0


async def test_an_invalid_file_exits_2_before_starting_anything(node, agents):
    """The message names the file and the field; no process, no socket, no runtime file."""
    node.write_config([{"name": FUSE, "kind": "generic", "paths": ["/dev/fuse"], "count": 0}])
    agent = await agents()
    assert await asyncio.wait_for(agent.proc.wait(), 20) == 2
    assert (
        f"{node.config_path}: resources[0].count: Input should be greater than or equal to 1" in agent.log()
    )
    assert not node.runtime_dir.exists()
    assert not node.kubelet_dir.exists()


def cmdline(pid: int) -> str:
    """What ps shows as the process's command line."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def maps_grpc(pid: int) -> bool:
    return "cygrpc" in Path(f"/proc/{pid}/maps").read_text()


async def test_the_fork_server_is_forked_from_the_agent_which_never_loads_grpc(node, kubelet, agents):
    """It shares the agent's imports and loads gRPC itself, single-threaded; only the plugins start it."""
    agent = await start_registered(node, kubelet, agents)
    plugins = {child["pid"]: name for name, child in agent.children().items()}
    (server,) = [pid for pid in processes_of(node) if pid not in plugins]
    assert parent_of(server) == agent.pid
    assert all(parent_of(pid) == agent.pid for pid in plugins)
    assert not maps_grpc(agent.pid)
    assert maps_grpc(server)
    assert len(list(Path(f"/proc/{server}/task").iterdir())) == 1
    assert agent.log().count("event='forkserver_ready'") == 1
    assert await agent.stop() == 0


async def test_every_process_says_what_it_is_in_ps_and_top(node, kubelet, agents):
    """The agent, the fork server and each plugin, by resource; not the agent's command line three times."""
    agent = await start_registered(node, kubelet, agents)
    plugins = {child["pid"]: name for name, child in agent.children().items()}
    (server,) = [pid for pid in processes_of(node) if pid not in plugins]
    assert cmdline(agent.pid) == f"plugvisor agent --config {node.config_path}"
    assert cmdline(server) == "plugvisor fork-server"
    assert {pid: cmdline(pid) for pid in plugins} == {
        pid: f"plugvisor plugin generic {name}" for pid, name in plugins.items()
    }
    comms = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in (agent.pid, server, *plugins)}
    assert comms == {
        agent.pid: "plugvisor",
        server: "pv-forkserver",
        **{pid: "pv:" + name.rsplit("/", 1)[1] for pid, name in plugins.items()},
    }
    assert await agent.stop() == 0


async def test_the_exec_spawner_restarts_crashed_children_too(node, kubelet, agents):
    """spawner: exec (fork+exec per child) gives the same behaviour, only slower to start."""
    node.write_config(node.resources()[:1], supervisor={"spawner": "exec"})
    agent = await agents()
    await agent.wait_state(lambda c: c.get(FUSE, {}).get("registered"), timeout=20)
    first = agent.children()[FUSE]["pid"]
    import os

    os.kill(first, signal.SIGKILL)
    await agent.wait_state(lambda c: c[FUSE]["registered"] and c[FUSE]["pid"] != first, timeout=20)
    assert "ExecSpawner" in agent.log()
    assert await agent.stop() == 0


@pytest.mark.parametrize(
    ("anchor", "after"),
    [("caught", 0.0), ("caught", 0.05), ("locked", 0.0), ("locked", 0.02), ("locked", 0.1), ("locked", 0.3)],
)
async def test_sigterm_at_any_moment_of_the_start_is_a_clean_stop(node, kubelet, agents, anchor, after):
    """Told to stop while importing, loading, or waiting for the fork server: exit 0, nothing left.

    Counted from the moment the process catches SIGTERM at all (a few milliseconds after exec,
    before any import of substance: before that it has created nothing to leave behind), or
    from the moment its runtime directory is locked (from then on there is something to clean).
    """
    node.write_config()
    agent = await agents()
    if anchor == "caught":
        await agent.wait_catching(signal.SIGTERM)
    else:
        pid_file = node.runtime_dir / "supervisor.pid"
        for _ in range(30_000):
            if pid_file.exists():
                break
            await asyncio.sleep(0.001)
    await asyncio.sleep(after)
    assert await agent.stop(signal.SIGTERM) == 0, agent.log()[-2000:]
    assert await wait_gone(node, timeout=3) == []
    assert node.sockets() == []
    leftovers = sorted(p.name for p in node.runtime_dir.iterdir()) if node.runtime_dir.exists() else []
    assert leftovers == [], leftovers


async def test_sigterm_while_the_fork_server_hangs_at_its_start_is_a_prompt_clean_stop(node, kubelet, agents):
    """A fork server stuck in its imports (here SIGSTOPped) is waited for up to its start timeout (60 s);
    a stop must not wait with it: a DaemonSet's grace period (30 s) would end the agent with SIGKILL."""
    node.write_config()
    agent = await agents()
    for _ in range(30_000):
        helpers = [pid for pid in processes_of(node) if pid != agent.pid]
        if helpers:
            break
        await asyncio.sleep(0.001)
    os.kill(helpers[0], signal.SIGSTOP)
    await asyncio.sleep(0.2)  # the agent is waiting for it now (or has not looked yet: both must stop)
    assert await agent.stop(signal.SIGTERM, timeout=20) == 0, agent.log()[-2000:]
    left = await wait_gone(node, timeout=5)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left] + [agent.log()[-3000:]]
    leftovers = sorted(p.name for p in node.runtime_dir.iterdir()) if node.runtime_dir.exists() else []
    assert leftovers == [], leftovers


@pytest.fixture
def full_disk_runtime_dir(node):
    """The runtime directory on its own small tmpfs, so that the test can fill it (needs root)."""
    with small_tmpfs(node.runtime_dir, "8m") as directory:
        yield directory


async def test_a_full_runtime_directory_does_not_stop_the_supervising(
    node, kubelet, agents, full_disk_runtime_dir
):
    """State and metrics files are best effort: with no space left, killed children still come back."""
    node.write_config(metrics={"listen": "127.0.0.1:0"})  # children write metric files only then
    agent = await agents()
    await agent.wait_state(running_registered)
    await kubelet.wait_for(registered_all(EXPECTED))
    before = agent.children()
    for victim in (SERIAL, FUSE):
        fill(full_disk_runtime_dir)  # again: a dead child's metric files free some space
        endpoint = kubelet.resource(victim).endpoint
        os.kill(before[victim]["pid"], signal.SIGKILL)
        try:
            await kubelet.wait_for(
                lambda k, v=victim, e=endpoint: k.resource(v).registered and k.resource(v).endpoint != e,
                timeout=20,
            )
        except TimeoutError as exc:
            raise AssertionError(agent.log()[-6000:]) from exc
    await kubelet.wait_for(registered_all(EXPECTED))
    fill(full_disk_runtime_dir)  # whatever the restarts freed
    agent.send(signal.SIGHUP)  # a reload rewrites the state file: it cannot
    deadline = asyncio.get_running_loop().time() + 30
    while "state_write_failed" not in agent.log() or "reloaded" not in agent.log():
        assert agent.proc.returncode is None, agent.log()[-3000:]
        assert asyncio.get_running_loop().time() < deadline, agent.log()[-3000:]
        await asyncio.sleep(0.05)
    assert "metrics_kept_local" in agent.log()
    status = run_status(node)
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.startswith("STALE: the agent could not write its state since"), status.stdout
    (full_disk_runtime_dir / "filler").unlink()
    await agent.wait_state(
        lambda c: (
            running_registered(c)
            and c[SERIAL]["pid"] != before[SERIAL]["pid"]
            and c[FUSE]["pid"] != before[FUSE]["pid"]
        )
    )
    assert "state_write_recovered" in agent.log()
    status = run_status(node)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "STALE" not in status.stdout
    assert not (node.runtime_dir / "state.stale.json").exists()
    assert await agent.stop() == 0


def run_status(node) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plugvisor", "status", "--runtime-dir", str(node.runtime_dir)],
        capture_output=True,
        text=True,
        check=False,
    )


async def test_an_agent_started_on_a_full_runtime_directory_still_registers_everything(
    node, kubelet, agents, full_disk_runtime_dir
):
    """No space for its PID, state or metrics: the lock is what counts; status still finds the agent."""
    fill(full_disk_runtime_dir)
    node.write_config()
    agent = await agents()
    try:
        await kubelet.wait_for(registered_all(EXPECTED), timeout=30)
    except TimeoutError as exc:
        raise AssertionError(agent.log()[-4000:]) from exc
    assert agent.proc.returncode is None
    assert "pid_file_write_failed" in agent.log()
    (full_disk_runtime_dir / "filler").unlink()
    await agent.wait_state(running_registered)
    status = subprocess.run(
        [sys.executable, "-m", "plugvisor", "status", "--runtime-dir", str(node.runtime_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert await agent.stop() == 0


async def test_a_deleted_kubelet_directory_is_watched_again(node, kubelet, agents):
    """rm -rf of the device-plugins dir, then a kubelet restart: the agent sees the restart all the same."""
    import shutil

    agent = await start_registered(node, kubelet, agents)
    shutil.rmtree(node.kubelet_dir)
    deadline = asyncio.get_running_loop().time() + 10
    while not node.kubelet_dir.is_dir():  # re-created by the watch, as the kubelet would
        assert asyncio.get_running_loop().time() < deadline, agent.log()[-2000:]
        await asyncio.sleep(0.02)
    generation = kubelet.generation
    await kubelet.restart()
    await kubelet.wait_for(
        lambda k: (
            registered_all(EXPECTED)(k) and all(r.generation == generation + 1 for r in k.registrations[-3:])
        ),
        timeout=30,
    )
    await agent.wait_state(running_registered)
    assert agent.state()["supervisor"]["kubelet_restarts"] == 1, agent.log()[-3000:]
    assert await agent.stop() == 0
