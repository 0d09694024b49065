"""The host as Docker finds it, and putting it back: what a suite-started dockerd must leave as it was.

Measured on these machines (docs/kind.md): starting dockerd turns the iptables FORWARD policy to DROP,
adds the ``ip filter`` and ``ip nat`` nftables tables (iptables-nft), turns on IPv4 forwarding (and IPv6
forwarding once kind's dual-stack network exists), makes ``docker0`` and a ``br-*`` bridge per network,
mounts its overlays and network namespaces, and containerd 1.6's shims make /run/containerd. A record taken
before dockerd starts lists all of that; ``restore`` undoes what dockerd left once it is stopped, and
``differences`` is the check: empty when the host matches the record.

Only for a dockerd the suite started itself: a Docker that was already running is the machine owner's,
with whatever state they keep.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..hostfs import read_sysctl, remove
from ..local import hostbin

SYSCTLS = (
    "net/ipv4/ip_forward",
    "net/ipv6/conf/all/forwarding",
    "net/ipv6/conf/default/forwarding",
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
)
"""What Docker's bridge driver may turn on (forwarding) or relies on (bridge netfilter)."""
PATHS = (
    Path("/etc/docker"),
    Path("/var/lib/docker"),
    Path("/run/docker"),
    Path("/run/docker.sock"),
    Path("/run/containerd"),  # containerd 1.6's shims put their sockets in /run/containerd/s
)
"""Where Docker writes at fixed places even with its data and exec roots elsewhere."""
DOCKER_LINK_PREFIXES = ("docker0", "br-", "veth")
"""The links Docker makes: its default bridge, one bridge per network, the containers' veth ends."""


def _tool(argv: list[str]) -> str:
    """A system tool's output ('' when it fails or is missing): the record must not die on a listing."""
    try:
        argv = hostbin.absolute(argv)
    except hostbin.MissingBinaryError:
        return ""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    return result.stdout if result.returncode == 0 else ""


def nft_tables() -> list[str]:
    """Every nftables table as ``family name`` (iptables-nft's included)."""
    return sorted(
        " ".join(line.split()[1:])
        for line in _tool(["nft", "list", "tables"]).splitlines()
        if line.startswith("table")
    )


def forward_policy() -> str:
    """The iptables (nft backend) FORWARD policy: ``ACCEPT`` on a host without any table (Debian's default).

    Listed only when a ``filter`` table exists: without one, FORWARD accepts, and listing it would not
    change that (iptables-nft makes no table to list), but reading nothing is cheaper than asking.
    """
    for line in _tool(["iptables", "-S", "FORWARD"]).splitlines():
        if line.startswith("-P FORWARD "):
            return line.split()[2]
    return "ACCEPT"


def links() -> list[str]:
    return sorted(entry.name for entry in Path("/sys/class/net").iterdir())


def mounts() -> list[str]:
    points = []
    with Path("/proc/self/mountinfo").open() as info:
        for line in info:
            points.append(line.split()[4].replace("\\040", " "))
    return sorted(points)


def _under(point: str, roots: list[Path]) -> bool:
    return any(point == str(r) or point.startswith(f"{r}/") for r in roots)


@dataclass(frozen=True)
class HostRecord:
    """What Docker may change, as it was before dockerd started."""

    forward_policy: str
    nft_tables: tuple[str, ...]
    sysctls: tuple[tuple[str, str | None], ...]
    links: tuple[str, ...]
    mounts: tuple[str, ...]
    paths: tuple[tuple[str, bool], ...]

    @classmethod
    def take(cls) -> HostRecord:
        # The tables first: listing FORWARD must not be what makes one.
        tables = tuple(nft_tables())
        return cls(
            forward_policy=forward_policy(),
            nft_tables=tables,
            sysctls=tuple((name, read_sysctl(name)) for name in SYSCTLS),
            links=tuple(links()),
            mounts=tuple(mounts()),
            paths=tuple((str(p), p.exists() or p.is_symlink()) for p in PATHS),
        )

    def summary(self) -> str:
        """One line for the progress log."""
        sysctls = " ".join(f"{name.replace('/', '.')}={value}" for name, value in self.sysctls)
        docker_links = [name for name in self.links if name.startswith(DOCKER_LINK_PREFIXES)]
        return (
            f"FORWARD {self.forward_policy}; nft tables: {', '.join(self.nft_tables) or 'none'}; {sysctls};"
            f" Docker's links: {', '.join(docker_links) or 'none'}"
        )

    def differences(self, private: list[Path]) -> list[str]:
        """How the host differs from the record now (empty: it matches).

        Links and mounts are compared where Docker makes them (its links' prefixes; ``private``, the run's
        data and exec roots, and Docker's fixed paths): the machine is shared, and what other programs do
        meanwhile elsewhere is not this run's to judge.
        """
        found = []
        policy = forward_policy()
        if policy != self.forward_policy:
            found.append(f"iptables FORWARD policy {policy} (was {self.forward_policy})")
        tables = set(nft_tables())
        found += [f"nftables table {t} (new)" for t in sorted(tables - set(self.nft_tables))]
        found += [f"nftables table {t} (gone)" for t in sorted(set(self.nft_tables) - tables)]
        for name, value in self.sysctls:
            now = read_sysctl(name)
            if now != value:
                found.append(f"sysctl {name} = {now} (was {value})")
        now_links = {name for name in links() if name.startswith(DOCKER_LINK_PREFIXES)}
        before_links = {name for name in self.links if name.startswith(DOCKER_LINK_PREFIXES)}
        found += [f"link {name} (new)" for name in sorted(now_links - before_links)]
        found += [f"link {name} (gone)" for name in sorted(before_links - now_links)]
        roots = [*private, *(Path(p) for p, _ in self.paths)]
        now_mounts = {m for m in mounts() if _under(m, roots)}
        before_mounts = {m for m in self.mounts if _under(m, roots)}
        found += [f"mount {point} (new)" for point in sorted(now_mounts - before_mounts)]
        found += [f"mount {point} (gone)" for point in sorted(before_mounts - now_mounts)]
        found += [f"path {p} (new)" for p in private if p.exists()]
        for path, existed in self.paths:
            exists = Path(path).exists() or Path(path).is_symlink()
            if exists != existed:
                found.append(
                    f"path {path} {'exists' if exists else 'is gone'} (it {'did' if existed else 'did not'})"
                )
        return found

    def restore(self, private: list[Path]) -> list[str]:
        """After dockerd stopped: undo what it left; the steps taken, for the progress log.

        Docker's new nftables tables are deleted (with them the FORWARD DROP), its links (bridges, veths)
        deleted, new mounts under ``private`` (the run's data and exec roots) and Docker's fixed paths
        unmounted, the sysctls put back, the paths Docker made removed.
        """
        steps = []
        for table in sorted(set(nft_tables()) - set(self.nft_tables)):
            _tool(["nft", "delete", "table", *table.split()])
            steps.append(f"nft delete table {table}")
        for name in sorted(set(links()) - set(self.links)):
            if name.startswith(DOCKER_LINK_PREFIXES):
                _tool(["ip", "link", "del", name])
                steps.append(f"ip link del {name}")
        roots = [*private, *(Path(p) for p, _ in self.paths)]
        for point in sorted(set(mounts()) - set(self.mounts), key=len, reverse=True):
            if _under(point, roots):
                _tool(["umount", "--lazy", point])
                steps.append(f"umount {point}")
        for name, value in self.sysctls:
            if value is not None and read_sysctl(name) != value:
                with contextlib.suppress(OSError):
                    (Path("/proc/sys") / name).write_text(value)
                    steps.append(f"sysctl {name}={value}")
        made = [Path(path) for path, existed in self.paths if not existed]
        for target in [*made, *private]:
            if target.exists() or target.is_symlink():
                remove(target)
                steps.append(f"rm -r {target}")
        return steps


def docker_processes() -> dict[int, str]:
    """Processes of Debian's Docker engine (dockerd, its containerd, the shims): none once it stopped."""
    names = {"dockerd", "containerd", "containerd-shim", "containerd-shim-runc-v2", "docker-proxy"}
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                exe = (entry / "exe").readlink()
                if exe.name in names and str(exe.parent) in hostbin.SYSTEM_DIRS:
                    found[int(entry.name)] = exe.name
    return found


def alive(pid: int) -> bool:
    """Alive and not a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
