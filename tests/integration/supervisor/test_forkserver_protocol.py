"""The fork server's protocol holds at the configuration's limits: 256 spawns of the largest options at once.

Each run is a child interpreter of its own (as in test_reaper.py): the spawner makes
its process a child subreaper and reaps with ``waitpid(-1)``, which must not touch
the test process's other children. The children it forks are real processes that
exit at once (an unknown kind), so the pipes, not the plugins, are what is tested;
no inotify instance, no socket is used.
"""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from plugvisor.supervisor.config import ChildSpec
    from plugvisor.supervisor.spawner import ForkServerSpawner

    count, option_bytes = int(sys.argv[1]), int(sys.argv[2])
    # The largest options the configuration accepts travel on each child's command line.
    options = json.dumps({"paths": ["/dev/x" * (option_bytes // 6)]})

    async def main():
        woken = asyncio.Event()
        spawner = ForkServerSpawner(dict(os.environ), spawn_timeout=120)
        await spawner.open(woken.set)
        answers = {}
        for index in range(count):
            resource = f"example.com/r{index}"
            args = ("plugin", "no-such-kind", "--resource", resource, "--options-json", options)
            spec = ChildSpec(resource, "no-such-kind", args)
            spawner.spawn(spec, lambda result, index=index: answers.__setitem__(index, result))
        exits = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 150
        while (len(answers) < count or len(exits) < count) and loop.time() < deadline:
            woken.clear()
            for exit_ in spawner.reap():
                exits[exit_.pid] = exit_.returncode
            try:
                await asyncio.wait_for(woken.wait(), 0.5)
            except TimeoutError:
                pass
        pids = {index: result for index, result in answers.items() if isinstance(result, int)}
        errors = sorted({str(result) for result in answers.values() if not isinstance(result, int)})
        await spawner.close()
        print(json.dumps({
            "answered": len(answers),
            "pids": len(set(pids.values())),
            "errors": errors,
            "exit_codes": sorted(set(exits[pid] for pid in pids.values() if pid in exits)),
            "reaped": sum(1 for pid in pids.values() if pid in exits),
            "helpers": spawner.helpers_started,
        }))

    asyncio.run(main())
    """
)


def run_spawns(count: int, option_bytes: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(count), str(option_bytes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # every child says, on one line, that its kind is unknown
        text=True,
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stdout
    return json.loads(result.stdout.splitlines()[-1])  # the last line: the spawner logs before it


def test_256_spawns_with_the_largest_options_all_get_a_process_from_one_fork_server():
    """Each request is ~64 KiB, the whole batch ~16 MiB: far more than a pipe holds; nothing is lost."""
    outcome = run_spawns(256, 64_000)
    assert outcome == {
        "answered": 256,
        "pids": 256,
        "errors": [],
        "exit_codes": [2],  # each child ran the plugin command, which refused the unknown kind
        "reaped": 256,
        "helpers": 1,
    }


ERRORS = textwrap.dedent(
    """
    import asyncio, os, sys
    from plugvisor.supervisor.config import ChildSpec
    from plugvisor.supervisor.spawner import ForkServerSpawner

    CASES = [
        ("plugin", "generic", "--no-such-option"),  # refused by the parser, in the fork server
        ("plugin", "generic", "--count", "0"),  # refused by the parser too (a range)
        ("plugin", "no-such-kind"),  # refused by the command, in the child
        ("not-a-plugin",),
    ]

    async def main():
        woken = asyncio.Event()
        spawner = ForkServerSpawner(dict(os.environ))
        await spawner.open(woken.set)
        pids = []
        for args in CASES:
            spawner.spawn(ChildSpec("example.com/x", "generic", args), pids.append)
        exits = {}
        while len(pids) < len(CASES) or len(exits) < len(CASES):
            woken.clear()
            exits.update((e.pid, e.returncode) for e in spawner.reap())
            if len(pids) < len(CASES) or len(exits) < len(CASES):
                await asyncio.wait_for(woken.wait(), 60)
        await spawner.close()
        print([exits[pid] for pid in pids])

    asyncio.run(main())
    """
)


def test_a_command_line_the_plugin_refuses_is_reported_by_the_child_with_its_exit_status():
    """Parsed in the fork server, refused or not: each child says why on stderr and exits 2."""
    result = subprocess.run(
        [sys.executable, "-c", ERRORS], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[2, 2, 2, 2]"
    for expected in (
        "No such option '--no-such-option'",
        "Invalid value for '--count': 0 is not in the range x>=1.",
        "unknown plugin kind 'no-such-kind'",
        "a plugin process takes 'plugin KIND ...', got ['not-a-plugin']",
    ):
        assert expected in result.stderr, result.stderr


UPGRADED = textwrap.dedent(
    """
    import asyncio, os
    import plugvisor.plugins.entry as entry
    from plugvisor.supervisor.spawner import ForkServerSpawner, SpawnError

    def preload():  # what importing changed files beside the agent's old modules does
        raise ImportError("cannot import name 'beside_kubelet_dir' from 'plugvisor.common.hostpaths'")

    entry.preload = preload  # forked with this process's memory: the fork server has it too

    async def main():
        spawner = ForkServerSpawner(dict(os.environ))
        try:
            await spawner.open(lambda: None)
        except SpawnError as exc:
            print(exc)
        else:
            print("started")
        await spawner.close()

    asyncio.run(main())
    """
)


def test_a_fork_server_that_cannot_load_code_changed_under_the_agent_says_to_restart_it():
    """plugvisor upgraded in place: a new fork server, forked from the agent's old modules, cannot import the
    new files; the error says what happened and what to do, not only the ImportError."""
    result = subprocess.run(
        [sys.executable, "-c", UPGRADED], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    said = result.stdout.strip()
    assert "preload failed: ImportError(\"cannot import name 'beside_kubelet_dir'" in said, said
    assert "plugvisor's files changed under the running agent? restart the agent" in said, said


UNAVAILABLE = textwrap.dedent(
    """
    import asyncio, json, os
    import plugvisor.plugins.entry as entry
    from plugvisor.supervisor.config import ChildSpec
    from plugvisor.supervisor.spawner import ForkServerSpawner

    working = entry.preload

    def broken():  # what importing changed files beside the agent's old modules does
        raise ImportError("cannot import name 'beside_kubelet_dir' from 'plugvisor.common.hostpaths'")

    # A forked child exits 7; an exec'd one runs the real command, which refuses the unknown kind (2).
    entry.prepare = lambda args: lambda: 7
    SPEC = ChildSpec("example.com/x", "no-such-kind", ("plugin", "no-such-kind"))

    async def until(condition):
        for _ in range(60_000):
            if condition():
                return
            await asyncio.sleep(0.002)
        raise AssertionError("never")

    async def main():
        woken = asyncio.Event()
        spawner = ForkServerSpawner(dict(os.environ))
        await spawner.open(woken.set)
        exits = {}

        async def exit_of_a_spawn():
            answers = []
            spawner.spawn(SPEC, answers.append)
            await until(lambda: answers)
            assert isinstance(answers[0], int), answers
            def reaped():
                exits.update((e.pid, e.returncode) for e in spawner.reap())
                return answers[0] in exits
            await until(reaped)
            return exits[answers[0]]

        outcome = {"forked": await exit_of_a_spawn()}
        entry.preload = broken  # every fork server forked from now on fails its preload
        spawner.refresh([])
        await until(lambda: spawner.fallback is not None)
        outcome["fallback"] = spawner.fallback
        outcome["while_unavailable"] = [await exit_of_a_spawn(), await exit_of_a_spawn()]
        entry.preload = working
        spawner.refresh([])  # what a reload onto loadable code does
        await until(lambda: spawner.fallback is None)
        outcome["available_again"] = await exit_of_a_spawn()
        outcome["helpers"] = spawner.helpers_started
        await spawner.close()
        print(json.dumps(outcome))

    asyncio.run(main())
    """
)


def test_while_no_fork_server_can_start_children_are_started_by_exec_until_one_can():
    """No request fails and none waits for a fork server that cannot come: exec starts it; said once."""
    result = subprocess.run(
        [sys.executable, "-c", UNAVAILABLE], capture_output=True, text=True, timeout=170, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    *logs, last = result.stdout.splitlines()
    outcome = json.loads(last)
    assert outcome == {
        "forked": 7,
        "fallback": outcome["fallback"],
        "while_unavailable": [2, 2],
        "available_again": 7,
        "helpers": 3,
    }
    assert outcome["fallback"].startswith("a new fork server did not start: preload failed: ImportError(")
    events = [word for line in logs for word in line.split()]
    assert events.count("forkserver_unavailable") == 1, logs
    assert events.count("forkserver_available") == 1, logs


PRELOADED = textwrap.dedent(
    """
    import asyncio, functools, json, os, sys
    import plugvisor.plugins.entry as entry
    from plugvisor.supervisor.config import ChildSpec
    from plugvisor.supervisor.spawner import ForkServerSpawner

    def loaded(path):  # what a child finds loaded before it imports anything itself
        names = (
            "plugvisor.deviceplugin.runtime",
            "plugvisor.deviceplugin.device_monitor",
            "plugvisor.dra.runtime",
            "plugvisor.dra.kube",
            "lightkube",
        )
        with open(path, "w") as out:
            json.dump([name for name in names if name in sys.modules], out)
        return 0

    entry.prepare = lambda args: functools.partial(loaded, args[-1])  # the fork server has it too

    async def main(dra, env):
        woken = asyncio.Event()
        spawner = ForkServerSpawner({**os.environ, **env}, preload_dra=dra)
        await spawner.open(woken.set)
        path = f"{sys.argv[1]}/{dra}-{bool(env)}.json"
        spawner.spawn(ChildSpec("r", "gpu", ("plugin", "gpu", path)), lambda result: None)
        while not os.path.exists(path) or not any(True for _ in spawner.reap()):
            woken.clear()
            try:
                await asyncio.wait_for(woken.wait(), 0.5)
            except TimeoutError:
                pass
        await spawner.close()
        with open(path) as result:
            print(json.dumps([dra, bool(env), json.load(result)]))

    for dra, env in ((False, {}), (True, {}), (True, {"PLUGVISOR_DRA_OBJECTS_DIR": "/nowhere"})):
        asyncio.run(main(dra, env))
    """
)


def test_the_dra_side_is_preloaded_only_for_a_node_with_dra_entries(tmp_path):
    """A device-plugin-only node's children carry no DRA code; a DRA node's get the runtime and, unless
    the drivers keep their objects as files, the API client. Every child finds device monitoring loaded
    (a standalone plugin imports it only when it monitors; a child importing it would carry its own copy)."""
    result = subprocess.run(
        [sys.executable, "-c", PRELOADED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    device_plugin = ["plugvisor.deviceplugin.runtime", "plugvisor.deviceplugin.device_monitor"]
    assert [json.loads(line) for line in result.stdout.splitlines() if line.startswith("[")] == [
        [False, False, device_plugin],
        [True, False, [*device_plugin, "plugvisor.dra.runtime", "plugvisor.dra.kube", "lightkube"]],
        [True, True, [*device_plugin, "plugvisor.dra.runtime"]],
    ]


NVML_PRELOADED = textwrap.dedent(
    """
    import asyncio, functools, json, os, sys
    import plugvisor.plugins.entry as entry
    from plugvisor.supervisor.config import ChildSpec
    from plugvisor.supervisor.spawner import ForkServerSpawner

    def loaded(path):
        maps = open("/proc/self/maps").read()
        with open(path, "w") as out:
            json.dump(["pynvml" in sys.modules, "libnvidia-ml" in maps], out)
        return 0

    entry.prepare = lambda args: functools.partial(loaded, args[-1])  # the fork server has it too

    async def main(kinds):
        woken = asyncio.Event()
        spawner = ForkServerSpawner(dict(os.environ), preload_kinds=kinds)
        await spawner.open(woken.set)
        path = f"{sys.argv[1]}/{'-'.join(kinds)}.json"
        spawner.spawn(ChildSpec("r", kinds[0], ("plugin", kinds[0], path)), lambda result: None)
        while not os.path.exists(path) or not any(True for _ in spawner.reap()):
            woken.clear()
            try:
                await asyncio.wait_for(woken.wait(), 0.5)
            except TimeoutError:
                pass
        await spawner.close()
        with open(path) as result:
            print(json.dumps([kinds, json.load(result)]))

    for kinds in (["generic"], ["gpu"]):
        asyncio.run(main(kinds))
    """
)


def test_a_gpu_nodes_fork_server_preloads_pynvml_and_loads_no_nvidia_library(tmp_path):
    """pynvml's import is paid once (the fork server), NVML's library only in each gpu child that opens it."""
    result = subprocess.run(
        [sys.executable, "-c", NVML_PRELOADED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in result.stdout.splitlines() if line.startswith("[")] == [
        [["generic"], [False, False]],
        [["gpu"], [True, False]],
    ]
