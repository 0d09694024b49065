"""Which binary the local cluster runs, decided here and never by whatever PATH finds first.

A machine can carry several container runtimes: installing Debian's docker.io, for one, puts containerd
1.6's ``containerd-shim-runc-v2`` in /usr/bin, and a containerd 2.x that looks its shim up on PATH starts
that one, whose protocol it does not speak (every sandbox fails with ``type with url <id>: not found``).
So the cluster's own binaries (containerd, its shim, ctr, the Kubernetes components) come from the build's
bin directory, and the host tools it needs (runc, ip, iptables, nft, openssl, the CNI plugins' helpers) from
the distribution's system directories, in a fixed order; the components it starts get a PATH of exactly
those, the build's directory first, whatever the caller's PATH was.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# The distribution's own directories, sbin first (Debian's runc, iptables and nft live there). Not
# /usr/local or /opt: that is where other installs (a Docker client, another containerd) put theirs.
SYSTEM_DIRS = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


class MissingBinaryError(RuntimeError):
    """A host tool the cluster needs is not in the system directories."""


def system_binary(name: str) -> str:
    """The absolute path of ``name`` in SYSTEM_DIRS (the first that has it), never from PATH."""
    found = shutil.which(name, path=os.pathsep.join(SYSTEM_DIRS))
    if found is None:
        raise MissingBinaryError(f"{name} is not installed in any of {', '.join(SYSTEM_DIRS)}")
    return found


def search_path(bin_dir: Path) -> str:
    """The PATH every component runs with: the build's binaries first, then the system directories."""
    return os.pathsep.join([str(bin_dir), *SYSTEM_DIRS])


def environment(bin_dir: Path) -> dict[str, str]:
    """The caller's environment with PATH replaced by ``search_path(bin_dir)``."""
    return {**os.environ, "PATH": search_path(bin_dir)}


def absolute(argv: list[str]) -> list[str]:
    """``argv`` with a bare command name replaced by its system path (an absolute one is kept as is)."""
    if not argv or Path(argv[0]).is_absolute():
        return argv
    return [system_binary(argv[0]), *argv[1:]]
