"""One waitpid(-1) loop owns every exit status of the agent, and subprocess never steals one.

Run in a child interpreter of its own: a reaper in the test process would reap
other tests' children too.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import subprocess, sys, time
    from plugvisor.supervisor.spawner import Reaper

    reaper = Reaper()
    quiet = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    loud = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
    reaper.track(quiet)
    reaper.track(loud, report=True)
    time.sleep(1.0)
    # Creating another Popen makes subprocess poll the children it thinks abandoned: none
    # of ours may be among them, or their status would be gone before the reaper looks.
    later = subprocess.Popen([sys.executable, "-c", "pass"])
    reaper.track(later)
    deadline = time.monotonic() + 20
    exits = []
    while time.monotonic() < deadline and (later.returncode is None or quiet.returncode is None or not exits):
        exits += reaper.collect()
        time.sleep(0.01)
    reported = [(e.pid == loud.pid, e.returncode) for e in exits]
    print(reported, quiet.returncode, loud.returncode, later.returncode)
    """
)


def test_tracked_children_get_their_status_and_only_reported_ones_are_returned():
    """A quiet Popen gets its returncode set; a reported one is returned as an Exit too."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[(True, 5)] 4 5 0"
