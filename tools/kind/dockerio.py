"""Install Debian's docker.io for a kind run, and purge exactly what that installed afterwards.

    python3 tools/kind/dockerio.py install RECORD   # apt-get install docker.io; RECORD lists what came new
    python3 tools/kind/dockerio.py purge RECORD     # apt-get purge those packages, remove Docker's leftovers

Why: kind needs a Docker engine, and these machines' baseline is a host without one (docs/kind.md,
"Leaving the host as it was"): installing docker.io brings twelve packages (containerd, runc's users,
apparmor, needrestart, Perl modules...) and a ``docker`` group. ``install`` writes to RECORD the packages
that were not installed before it ran (nothing when docker.io already was: then ``purge`` purges
nothing), so ``purge`` takes away what it added and nothing the machine had. .ci/run uses the pair
around ``tox -e e2e``; a machine that has Docker already needs neither.

Only the standard library, as root: it runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = "docker.io"
# What the purge of the packages leaves that the install made (seen on these machines): Docker's state
# directories and its group. Removed only when the install came from here.
LEFTOVERS = (Path("/etc/docker"), Path("/var/lib/docker"), Path("/run/docker"))
APT_ENV = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


def installed() -> set[str]:
    """The packages dpkg says are installed (status ``install ok installed``), by name without arch."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package} ${db:Status-Abbrev}\n"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {line.split()[0] for line in out.splitlines() if line.split()[1:2] == ["ii"]}


def install(record: Path) -> int:
    """Install docker.io unless it is; write the newly installed packages to ``record`` (one a line)."""
    before = installed()
    if PACKAGE in before:
        record.write_text("")
        print(f"{PACKAGE} is installed already: nothing to install, nothing to purge afterwards")
        return 0
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", PACKAGE]):
        result = subprocess.run(argv, capture_output=True, text=True, env=APT_ENV, check=False)
        if result.returncode != 0:
            print(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr[-2000:]}", file=sys.stderr)
            record.write_text("\n".join(sorted(installed() - before)))
            return 1
    added = sorted(installed() - before)
    record.write_text("\n".join(added) + "\n")
    print(f"installed {PACKAGE} and {len(added) - 1} more packages: {' '.join(added)}")
    return 0


def purge(record: Path) -> int:
    """Purge the packages ``record`` lists, then Docker's directories and group if they are left."""
    try:
        packages = record.read_text().split()
    except FileNotFoundError:
        print(f"{record}: no such record (expected the file `install` wrote)", file=sys.stderr)
        return 2
    if not packages:
        print(f"{record}: nothing was installed for this run: nothing to purge")
        return 0
    still = sorted(set(packages) & installed())
    if still:
        result = subprocess.run(
            ["apt-get", "purge", "-y", "-qq", *still],
            capture_output=True,
            text=True,
            env=APT_ENV,
            check=False,
        )
        if result.returncode != 0:
            print(f"apt-get purge failed ({result.returncode}):\n{result.stderr[-2000:]}", file=sys.stderr)
            return 1
    for path in LEFTOVERS:
        shutil.rmtree(path, ignore_errors=True)
    if (
        shutil.which("getent")
        and subprocess.run(["getent", "group", "docker"], capture_output=True, check=False).returncode == 0
    ):
        subprocess.run(["groupdel", "docker"], capture_output=True, check=False)
    left = sorted(set(packages) & installed())
    if left:
        print(f"still installed after the purge: {' '.join(left)}", file=sys.stderr)
        return 1
    print(f"purged {len(still)} packages: {' '.join(still)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Install or purge; exit 2 on bad use (not root, no record), 1 when apt-get fails."""
    parser = argparse.ArgumentParser(prog="tools/kind/dockerio.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("action", choices=("install", "purge"))
    parser.add_argument("record", type=Path, help="the file listing the packages the install added")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("tools/kind/dockerio.py: needs root (apt-get)", file=sys.stderr)
        return 2
    return install(args.record) if args.action == "install" else purge(args.record)


if __name__ == "__main__":
    sys.exit(main())
