"""Running a command with a real, private inotify budget: a user namespace of its own.

Linux counts inotify instances per user for all of the user's processes (128 by default), and every
engineer and daemon on this machine is root: a test must never spend the real budget. A new user
namespace has limits of its own (``user.max_inotify_instances``, ``user.max_inotify_watches``) that
only its processes see, enforced by the kernel as the host's are; its processes still count against
the host's too, so a limit of 0 or 2 takes nothing from anyone else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def inotify_instances(pid: int) -> int:
    """How many inotify instances process ``pid`` holds (its descriptors that are inotify ones)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == "anon_inode:inotify":
                count += 1
        except OSError:
            continue
    return count


def _can_limit_inotify_in_a_user_namespace() -> str | None:
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    probe = subprocess.run(
        ["unshare", "-U", "-r", "sh", "-c", "echo 1 > /proc/sys/user/max_inotify_instances"],
        capture_output=True,
        check=False,
    )
    return None if probe.returncode == 0 else f"no user namespace here: {probe.stderr.decode().strip()}"


NO_USER_NAMESPACE = _can_limit_inotify_in_a_user_namespace()
"""Why a test cannot run a command with its own inotify limit here; None when it can."""


def with_inotify_limit(instances: int, *command: str) -> list[str]:
    """``command`` in a new user namespace that allows its processes ``instances`` inotify instances."""
    script = f'echo {instances} > /proc/sys/user/max_inotify_instances && exec "$@"'
    return ["unshare", "-U", "-r", "sh", "-c", script, "sh", *command]
