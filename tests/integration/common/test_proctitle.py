"""Process titles and the environment block, in a real process (its own memory is what changes)."""

import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import os, sys
    from plugvisor.common import proctitle

    del os.environ["NOTIFY_SOCKET"]
    os.environ["CHANGED"] = "after"
    os.environ["ADDED"] = "later"
    proctitle.forget_environment_changes()
    proctitle.set_name("pv:probe-with-a-long-name")
    proctitle.set_title(sys.argv[1] * int(sys.argv[2]))
    print(open("/proc/self/environ", "rb").read().split(b"\\0"))
    print(open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode())
    print(open("/proc/self/comm").read().strip())
    """
)


def probe(title: str, times: int = 1) -> list[str]:
    """Run the probe with ``title * times`` as its title: its environ entries, cmdline and comm."""
    env = {
        "PATH": os.environ["PATH"],
        "KEPT": "yes",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "CHANGED": "before",
    }
    result = subprocess.run(
        [sys.executable, "-c", PROBE, title, str(times)], env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.splitlines()


def test_the_environment_block_keeps_only_what_is_still_true():
    environ, _, _ = probe("plugvisor plugin generic example.com/fuse")
    assert "b'KEPT=yes'" in environ
    for gone in ("NOTIFY_SOCKET", "CHANGED=before", "CHANGED=after", "ADDED"):
        assert gone not in environ, environ


def test_ps_and_top_show_the_title_and_the_name():
    _, cmdline, comm = probe("plugvisor plugin generic example.com/fuse")
    assert cmdline == "plugvisor plugin generic example.com/fuse"
    assert comm == "pv:probe-with-a"  # comm holds 15 bytes


def test_a_title_longer_than_the_command_line_is_cut_to_fit_it():
    _, cmdline, _ = probe("x", 100_000)
    started_with = len(f"{sys.executable} -c {PROBE} x 100000")
    assert cmdline == "x" * started_with  # the command line's own memory, less its final NUL
