"""Memory as a node would see it: PSS counted among a set of processes only.

The kernel's PSS divides each page among every process that maps it, whoever
they are. On this machine that includes the bench itself (its emulated kubelet
maps gRPC and protobuf too) and other work running from the same Python: every
figure comes out lower than on a node, where the kubelet is a Go binary and
nothing else maps this interpreter's libraries. A bare grpc.aio server, for
instance, is ~32 MB PSS alone and ~23 MB next to the bench.

:func:`node_pss` recounts from the page tables: for each page a process has in
memory (``/proc/PID/pagemap``, which gives physical frame numbers to root), it
divides the page among the processes *of the given set* that map it. That is
what the kernel's PSS would say if the set ran alone; for a set of one process,
it is its RSS. Pages the kernel does not count in RSS (the shared zero page) are
left out here too. Needs root (without it frame numbers read as 0): the
function then returns None and the caller says so.
"""

from __future__ import annotations

import os
import struct
from array import array
from collections import Counter
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
_PRESENT = 1 << 63
_PFN_MASK = (1 << 55) - 1
_KPF_ZERO_PAGE = 1 << 24


def kernel_pss_kb(pid: int) -> int:
    """The kernel's PSS of ``pid`` (0 if it is gone)."""
    try:
        for row in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if row.startswith("Pss:"):
                return int(row.split()[1])
    except OSError:
        pass
    return 0


def _frames(pid: int) -> list[int]:
    """Physical frame numbers of every present page mapped by ``pid``, one per mapped virtual page."""
    frames: list[int] = []
    with Path(f"/proc/{pid}/maps").open() as maps, Path(f"/proc/{pid}/pagemap").open("rb") as pagemap:
        for row in maps:
            fields = row.split()
            if len(fields) > 5 and fields[5] == "[vsyscall]":
                continue
            start, end = (int(part, 16) for part in fields[0].split("-"))
            pagemap.seek(start // PAGE * 8)
            entries = array("Q")
            entries.frombytes(pagemap.read((end - start) // PAGE * 8))
            frames.extend(entry & _PFN_MASK for entry in entries if entry & _PRESENT)
    return frames


def _zero_pages(frames: set[int]) -> set[int]:
    """The frames among ``frames`` that are the kernel's zero page (not counted in RSS or PSS)."""
    zero: set[int] = set()
    try:
        with Path("/proc/kpageflags").open("rb") as flags:
            for frame in frames:
                flags.seek(frame * 8)
                data = flags.read(8)
                if len(data) == 8 and struct.unpack("Q", data)[0] & _KPF_ZERO_PAGE:
                    zero.add(frame)
    except OSError:
        pass
    return zero


def _sharing(pids: list[int]) -> tuple[dict[int, list[int]], Counter[int], set[int]] | None:
    """Each pid's frames, how many of ``pids`` map each frame, and the zero-page frames; None without root."""
    frames: dict[int, list[int]] = {}
    for pid in pids:
        try:
            frames[pid] = _frames(pid)
        except (OSError, ValueError):
            frames[pid] = []
    every = [frame for found in frames.values() for frame in found]
    if every and not any(every):
        return None  # frame numbers hidden: not root
    sharers: Counter[int] = Counter()
    for found in frames.values():
        sharers.update(set(found))
    return frames, sharers, _zero_pages(set(sharers))


def node_pss(pids: list[int]) -> dict[int, int] | None:
    """PSS in kB of each of ``pids`` with pages shared only among ``pids``; None without root."""
    found = _sharing(pids)
    if found is None:
        return None
    frames, sharers, zero = found
    return {
        pid: round(sum(PAGE / sharers[frame] for frame in mapped if frame not in zero) / 1024)
        for pid, mapped in frames.items()
    }


def private_kb(pids: list[int]) -> dict[int, int] | None:
    """kB of each of ``pids`` mapped by no other of ``pids`` (its own heap, pages it copied on write).

    With a fork server this is what each process costs on its own; the rest of the
    set's PSS is the pages they share (imported code and data), counted once in the sum.
    """
    found = _sharing(pids)
    if found is None:
        return None
    frames, sharers, zero = found
    return {
        pid: len({f for f in mapped if sharers[f] == 1 and f not in zero}) * PAGE // 1024
        for pid, mapped in frames.items()
    }
